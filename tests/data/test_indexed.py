import copy
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from lightning_effi.core.batch import EffiBatch
from lightning_effi.data import IndexedDataset, indexed_collate, sequence_lengths


class Squares(Dataset):
    def __init__(self, n=50):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor(float(i) ** 2), "y": torch.tensor([i, i + 1])}

    def sequence_lengths(self):
        return np.arange(self.n) % 7 + 1


class Batched(Squares):
    calls = 0

    def __getitems__(self, indices):
        Batched.calls += 1
        return [self[i] for i in indices]


class Huge(Dataset):
    def __len__(self):
        return 2**41

    def __getitem__(self, i):
        return {"x": torch.tensor(float(i % 10))}


def test_getitem_pairs_the_index_with_the_sample_unchanged():
    base = {"x": 1}

    class Const(Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return base

    ds = IndexedDataset(Const())
    assert ds[2] == (2, {"x": 1}) and ds[2][1] is base and base == {"x": 1}
    assert len(ds) == 3 and isinstance(ds.dataset, Const)
    assert not hasattr(ds, "n")  # no attribute delegation


def test_getitems_uses_wrapped_batch_fetch():
    ds = IndexedDataset(Batched())
    before = Batched.calls
    items = ds.__getitems__([4, 1, 7])
    assert Batched.calls == before + 1
    assert [i for i, _ in items] == [4, 1, 7]
    assert [int(s["x"]) for _, s in items] == [16, 1, 49]
    assert [i for i, _ in IndexedDataset(Squares()).__getitems__([3, 0])] == [3, 0]


def test_rejects_iterable_datasets():
    class Stream(IterableDataset):
        def __iter__(self):
            yield {"x": 1}

    with pytest.raises(TypeError, match="IterableDataset"):
        IndexedDataset(Stream())


class Tuples(Dataset):
    """``(x, y)`` samples, as torchvision datasets give them."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((3,), float(i)), i % 4


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_indices(num_workers):
    ds = IndexedDataset(Squares(50))
    loader = DataLoader(
        ds,
        batch_size=8,
        shuffle=True,
        num_workers=num_workers,
        collate_fn=indexed_collate(),
        generator=torch.Generator().manual_seed(0),
    )
    seen = []
    for collated in loader:
        assert isinstance(collated, EffiBatch) and set(collated.meta) == {"index"}
        batch, index = collated.batch, collated.meta["index"]
        assert set(batch) == {"x", "y"}  # the user's batch, without the index
        assert index.dtype == torch.int64 and index.shape == batch["x"].shape
        assert torch.equal(batch["x"], index.double().pow(2).float())
        assert torch.equal(batch["y"][:, 0], index)
        seen += index.tolist()
    assert sorted(seen) == list(range(50))


def test_any_sample_structure_reaches_the_collate_unchanged():
    loader = DataLoader(IndexedDataset(Tuples()), batch_size=5, sampler=[7, 2, 11, 0, 5], collate_fn=indexed_collate())
    collated = next(iter(loader))
    x, y = collated.batch  # default_collate of (x, y) tuples: [x, y]
    assert collated.meta["index"].tolist() == [7, 2, 11, 0, 5]
    assert x[:, 0].tolist() == [7.0, 2.0, 11.0, 0.0, 5.0] and y.tolist() == [3, 2, 3, 0, 1]


def test_pin_memory_keeps_the_metadata():
    collated = indexed_collate()([(1, torch.ones(2)), (4, torch.zeros(2))])
    pinned = collated.pin_memory() if torch.cuda.is_available() else EffiBatch(collated.batch, collated.meta)
    assert pinned.meta["index"].tolist() == [1, 4] and torch.equal(pinned.batch, collated.batch)


def test_large_indices_round_trip():
    ds = IndexedDataset(Huge())
    wanted = [2**40, 2**40 + 1, 2**41 - 1, 3]
    collated = next(iter(DataLoader(ds, batch_size=4, sampler=wanted, collate_fn=indexed_collate())))
    assert collated.meta["index"].dtype == torch.int64 and collated.meta["index"].tolist() == wanted


def test_pickle_and_deepcopy():
    ds = IndexedDataset(Squares(5))
    for clone in (pickle.loads(pickle.dumps(ds)), copy.deepcopy(ds)):
        assert clone[4][0] == 4 and len(clone) == 5
    collate = pickle.loads(pickle.dumps(indexed_collate()))
    assert collate([ds[1], ds[3]]).meta["index"].tolist() == [1, 3]


def test_indexed_collate_custom_fn_and_errors():
    def stack_x(samples):
        return [torch.stack([s["x"] for s in samples])]  # any structure: a list

    collated = indexed_collate(stack_x)([(9, {"x": torch.tensor(1.0)})])
    assert collated.meta["index"].tolist() == [9] and collated.batch[0].tolist() == [1.0]
    with pytest.raises(TypeError, match="index, sample"):
        indexed_collate()([{"x": 1, "index": 0}])


def test_sequence_lengths_follows_subset_and_indexed():
    base = Squares(20)
    expected = np.arange(20) % 7 + 1
    assert sequence_lengths(base).dtype == np.int64
    assert sequence_lengths(IndexedDataset(base)).tolist() == expected.tolist()
    sub = Subset(base, [5, 0, 19])
    assert sequence_lengths(sub).tolist() == expected[[5, 0, 19]].tolist()
    assert sequence_lengths(IndexedDataset(Subset(sub, [2]))).tolist() == [expected[19]]
    assert sequence_lengths(Huge()) is None and sequence_lengths(IndexedDataset(Huge())) is None


def test_index_must_be_an_integer_and_is_the_true_position():
    ds = IndexedDataset(Squares(10))
    for bad in (1.7, 2.0, "3", None, True, np.float64(1.0), torch.tensor(1.5)):
        with pytest.raises(TypeError, match="must be an integer"):
            ds[bad]
    with pytest.raises(TypeError, match="must be an integer"):
        ds.__getitems__([1, 2.5])
    assert ds[-1][0] == 9 and int(ds[-1][1]["x"]) == 81
    assert ds[-10][0] == 0
    assert [i for i, _ in ds.__getitems__([-1, 0, np.int64(-2), torch.tensor(3)])] == [9, 0, 8, 3]
    assert type(ds[np.int32(4)][0]) is int
    for out in (10, -11):
        with pytest.raises(IndexError):
            ds[out]


# ------------------------------------------------------------------------------ a collate that reorders the rows
def _sorting_collate(samples):  # longest first, as pack_padded_sequence(enforce_sorted=True) needs
    samples = sorted(samples, key=lambda s: -len(s))
    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True), torch.tensor([len(s) for s in samples])


def _padding_collate(samples):
    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True), torch.tensor([len(s) for s in samples])


def _masking_collate(samples):  # a random transform (an MLM masking): each call draws
    ids = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
    return {"input_ids": torch.where(torch.rand(ids.shape) < 0.3, 0, ids), "labels": ids}


def _sequences(lengths=(3, 7, 5, 7, 2)):
    return [torch.arange(1, n + 1) * (i + 1) for i, n in enumerate(lengths)]


def test_collate_reorders_tells_a_sorting_collate_from_one_that_keeps_the_order():
    """A collate that sorts the samples by length sent InfoBatch's scores and weights to other samples, in silence
    (20 of 24 scores another sample's loss, qa45-break 01): the samples are collated again in reverse order and the
    rows compared."""
    from lightning_effi.core.indexed import collate_reorders

    samples = _sequences()
    assert collate_reorders(_sorting_collate, samples, _sorting_collate(samples))
    assert not collate_reorders(_padding_collate, samples, _padding_collate(samples))
    assert not collate_reorders(_sorting_collate, samples[:1], _sorting_collate(samples[:1]))  # one row: no order
    same = [torch.ones(4, dtype=torch.long)] * 3  # rows all equal: nothing to tell
    assert not collate_reorders(_sorting_collate, same, _sorting_collate(same))
    fixed = lambda s: torch.arange(2 * len(s)).view(len(s), 2)  # noqa: E731 - rows made whatever the samples
    assert not collate_reorders(fixed, samples, fixed(samples))
    # a random collate: the rows differ between the two calls, so nothing is claimed; the probe changes no draw
    torch.manual_seed(0)
    batch = _masking_collate(samples)
    after = torch.rand(3)
    torch.manual_seed(0)
    batch = _masking_collate(samples)
    assert not collate_reorders(_masking_collate, samples, batch)
    assert torch.equal(torch.rand(3), after)


def test_indexed_collate_refuses_a_collate_that_reorders_at_its_first_batch():
    from lightning_effi.core.errors import DataConfigError

    items = list(enumerate(_sequences()))
    with pytest.raises(DataConfigError, match=r"\(_sorting_collate\) puts the samples .*enforce_sorted=False"):
        indexed_collate(_sorting_collate)(items)
    out = indexed_collate(_padding_collate)(items)
    assert out.meta["index"].tolist() == [0, 1, 2, 3, 4]


def test_a_sorting_collate_is_refused_at_a_later_batch_when_the_first_tells_nothing():
    """Documents cut to one length: the first batch's samples all sort alike and keep their order, so checking it
    alone let the sort through (qa46-break 02). The first batches are checked."""
    from lightning_effi.core.errors import DataConfigError

    collate = indexed_collate(_sorting_collate)
    alike = [torch.arange(1, 5) * (i + 1) for i in range(4)]
    collate(list(enumerate(alike)))  # tells nothing
    with pytest.raises(DataConfigError, match="puts the samples of a batch in another order"):
        collate(list(enumerate(_sequences())))
