"""Checks of the data-loading layer (issue #21, "Nothing silent"), each with the error it promises:

- ``core/wrapping.py`` :func:`~lightning_effi.core.wrapping.custom_order` / ``loader_template``: which samplers a
  technique may replace (plain ones, subclasses that keep their order, lightning_effi's own and the resumable
  loader's wrapper) and which it refuses (a subclass with its own ``__iter__`` / ``__len__``, a ``RandomSampler``
  with replacement or another ``num_samples``, an explicit ``batch_sampler=``, no automatic batching, a dataset
  without ``len()``);
- ``core/loader.py``: ``EpochShuffleSampler`` / ``ResumableDataLoader`` over an ``IterableDataset`` (the campaign's
  ``infobatch_dm.datamodule.iterable_dataset``) refused naming it and what is needed;
- ``curriculum/data.py``: the batch-structure check at setup (``truncate_keys`` that name no tensor, the campaign's
  ``curriculum.truncate_keys.unknown_key``), which reads at most ``PROBE_SAMPLES`` samples and leaves the run
  unchanged; the per-epoch length check of :class:`~lightning_effi.curriculum.data.CurriculumSampler`;
- ``curriculum/stream.py``: a checkpoint's stream state checked against its own position (the campaign's
  ``checkpoint.curriculum.*``), and the warning for samples a ``value`` metric's ``max_difficulty`` never reaches.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from lightning_effi.callbacks import Curriculum, InfoBatchCallback
from lightning_effi.core.errors import DataConfigError
from lightning_effi.core.loader import EpochShuffleSampler, ResumableDataLoader, SkippableSampler
from lightning_effi.core.wrapping import custom_order, loader_template
from lightning_effi.curriculum import CurriculumConfig, CurriculumConfigError, CurriculumController
from lightning_effi.curriculum import callback as curriculum_callback
from lightning_effi.curriculum.analysis.index import MetricIndex
from lightning_effi.curriculum.data import (
    LENGTH_PROBES,
    PROBE_SAMPLES,
    CurriculumCollate,
    CurriculumDataModule,
    CurriculumSampler,
)
from lightning_effi.infobatch.data import InfoBatchDataModule
from lightning_effi.infobatch.functional import EpochPlan
from lightning_effi.infobatch.sampler import InfoBatchSampler
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TinyDataModule, TokenBlocks, tiny_gpt2

N, BATCH = 40, 8
TRUNCATE = dict(
    difficulty_type="value",
    clustering_type="single_cluster",
    min_difficulty=8,
    max_difficulty=16,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=4, difficulty_step=8),
)


# ------------------------------------------------------------------------------------------------ samplers
class OwnOrder(RandomSampler):
    """A plain sampler's subclass with its own order (reversed)."""

    def __iter__(self):
        return iter(range(len(self.data_source) - 1, -1, -1))


class OwnLength(SequentialSampler):
    """A plain sampler's subclass that changes only the epoch's length."""

    def __len__(self) -> int:
        return 3


class Tagged(RandomSampler):
    """A plain sampler's subclass that only adds an attribute: it still only shuffles."""

    tag = "mine"


class TaggedEpochShuffle(EpochShuffleSampler):
    pass


class ShiftLoader(DataLoader):
    """A loader that transforms each batch as it iterates."""

    def __iter__(self):
        return ({**b, "input_ids": b["input_ids"] + 1} for b in super().__iter__())


def test_torchdatas_stateful_loader_is_read_as_the_plain_loader_it_is():
    """torchdata's ``StatefulDataLoader`` (the README's loader for mid-epoch resumes) builds its own ``RandomSampler``
    and ``BatchSampler`` for ``shuffle=True``: refused as a custom batch sampler that groups samples by length
    (qa98-break 04). Its ``RandomSampler`` with replacement stays refused."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    data = TokenBlocks(n=N)
    for shuffle in (True, False):
        loader = stateful.StatefulDataLoader(data, batch_size=BATCH, shuffle=shuffle, drop_last=True)
        t = loader_template(loader, "InfoBatch")
        assert (t["dataset"], t["batch_size"], t["drop_last"], t["length"]) == (data, BATCH, True, N)
    # its DDP sampler, DistributedSampler's order (qa99-regress 03)
    shard = stateful.sampler.StatefulDistributedSampler(data, num_replicas=2, rank=1)
    loader = stateful.StatefulDataLoader(data, batch_size=BATCH, sampler=shard)
    assert loader_template(loader, "InfoBatch", world=(2, 1))["length"] == N
    sampler = stateful.sampler.RandomSampler(data, replacement=True)
    with pytest.raises(DataConfigError, match="a RandomSampler that draws with replacement"):
        loader_template(stateful.StatefulDataLoader(data, batch_size=BATCH, sampler=sampler), "InfoBatch")


def test_custom_order_accepts_exactly_the_samplers_that_only_shuffle():
    data = list(range(10))
    plain = [
        RandomSampler(data),
        SequentialSampler(data),
        DistributedSampler(data, num_replicas=1, rank=0),
        EpochShuffleSampler(data),
        TaggedEpochShuffle(data),
        Tagged(data),
        SkippableSampler(SequentialSampler(data)),  # overfit_batches' sampler inside the resumable loader
        SkippableSampler(SkippableSampler(RandomSampler(data))),
    ]
    assert [custom_order(s) for s in plain] == [None] * len(plain)
    assert custom_order(OwnOrder(data)) == "a RandomSampler subclass that overrides __iter__ (its own order)"
    assert custom_order(OwnLength(data)) == "a SequentialSampler subclass that overrides __len__ (its own order)"
    assert custom_order(SkippableSampler(OwnOrder(data))) == custom_order(OwnOrder(data))
    assert custom_order(RandomSampler(data, replacement=True)) == "a RandomSampler that draws with replacement"
    assert custom_order(RandomSampler(data, num_samples=4)) == (
        "a RandomSampler that draws num_samples=4 of the dataset's 10 samples per epoch"
    )
    assert custom_order(torch.utils.data.WeightedRandomSampler([1.0] * 10, 10)) == "a custom sampler"
    plan = EpochPlan(
        epoch=0,
        indices=torch.arange(10),
        weights=torch.ones(10),
        kind="full",
        threshold=float("nan"),
        num_well_learned=0,
        num_kept_well_learned=0,
        saved=0,
    )
    assert (
        custom_order(InfoBatchSampler(plan))
        == "a DistributedSampler subclass that overrides __iter__ and __len__ (its own order)"
    )


def test_loader_template_reads_a_plain_loader():
    data = TokenBlocks(n=N)
    for loader in (
        DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True),
        DataLoader(data, batch_size=BATCH, sampler=Tagged(data), drop_last=True),
        ResumableDataLoader(data, batch_size=BATCH, sampler=EpochShuffleSampler(data), drop_last=True),
    ):
        t = loader_template(loader, "InfoBatch")
        assert (t["dataset"], t["batch_size"], t["drop_last"], t["length"]) == (data, BATCH, True, N)


@pytest.mark.parametrize(
    ("make", "sequential"),
    [
        (lambda d: DataLoader(d, batch_size=BATCH, shuffle=False), "SequentialSampler"),
        (lambda d: DataLoader(d, batch_size=BATCH, sampler=DistributedSampler(d, 1, 0, shuffle=False)), "Distributed"),
        (lambda d: DataLoader(d, batch_size=BATCH, shuffle=True), None),
        (lambda d: DataLoader(d, batch_size=BATCH, sampler=DistributedSampler(d, 1, 0, shuffle=True)), None),
    ],
)
def test_loader_template_warns_that_a_sequential_order_is_not_kept(make, sequential):
    """A ``shuffle=False`` loader is accepted, but the technique draws its own random order: a warning naming the
    sampler says the order is not kept; a shuffling loader reads without one."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader_template(make(TokenBlocks(n=N)), "InfoBatch")
    messages = [str(w.message) for w in caught if "order is not kept" in str(w.message)]
    if sequential is None:
        assert messages == []
    else:
        assert len(messages) == 1 and sequential in messages[0] and messages[0].startswith("InfoBatch: ")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda d: DataLoader(d, batch_sampler=BatchSampler(RandomSampler(d), 5, drop_last=True)),
            "InfoBatch: the wrapped training loader uses RandomSampler / BatchSampler given as "
            "DataLoader(batch_sampler=...) (the loader's batch_size is None); InfoBatch owns the sampler and the batch "
            "sampler and rebuilds the loader from its batch_size, so it accepts only plain shuffling loaders: "
            "DataLoader(dataset, batch_size=..., shuffle=True/False, drop_last=...), no custom sampler or "
            "batch_sampler (here DataLoader(dataset, batch_size=5, drop_last=True, shuffle=...))",
        ),
        (
            lambda d: DataLoader(d, batch_size=None),
            "InfoBatch: the wrapped training loader uses SequentialSampler / NoneType: batch_size=None (no automatic "
            "batching: every sample is a batch); InfoBatch owns the sampler and accepts only plain shuffling loaders",
        ),
        (
            lambda d: DataLoader(d, batch_size=BATCH, sampler=OwnOrder(d)),
            "InfoBatch: the wrapped training loader uses OwnOrder / BatchSampler (a RandomSampler subclass that "
            "overrides __iter__ (its own order)); InfoBatch owns the sampler",
        ),
        (
            lambda d: DataLoader(d, batch_size=BATCH, sampler=RandomSampler(d, replacement=True)),
            "InfoBatch: the wrapped training loader uses RandomSampler / BatchSampler (a RandomSampler that draws "
            "with replacement); InfoBatch owns the sampler",
        ),
        (
            lambda d: ShiftLoader(d, batch_size=BATCH, shuffle=True),
            "InfoBatch: the wrapped training loader is a ShiftLoader, a DataLoader subclass with its own __iter__; "
            "InfoBatch owns the sampler and rebuilds the loader as a plain DataLoader",
        ),
        (
            lambda d: DataLoader(d, batch_size=BATCH, sampler=SequentialSampler(range(N // 2))),
            f"InfoBatch: the wrapped training loader uses SequentialSampler / BatchSampler over {N // 2} samples, "
            f"while the loader's dataset holds {N}: InfoBatch owns the sampler and draws from the whole dataset",
        ),
        (
            lambda d: DataLoader(d, batch_size=BATCH, sampler=RandomSampler(range(N + 1))),
            f"InfoBatch: the wrapped training loader uses RandomSampler / BatchSampler over {N + 1} samples",
        ),
    ],
    ids=[
        "explicit_batch_sampler",
        "no_auto_batching",
        "own_order",
        "replacement",
        "own_iteration",  # the subclass's batches were replaced by plain ones (qa98-break 01)
        "smaller_source",  # every sample trained, not the sampler's 20 (qa98-break 05)
        "other_source",
    ],
)
def test_loader_template_refuses_what_it_would_silently_replace(make, message):
    with pytest.raises(DataConfigError) as err:
        loader_template(make(TokenBlocks(n=N)), "InfoBatch")
    assert str(err.value).startswith(message), str(err.value)


def test_a_distributed_sampler_of_another_world_is_refused_and_the_trainers_is_read():
    """A single-process fit whose loader serves shard 0 of 2 (``DistributedSampler(num_replicas=2, rank=0)``): the
    technique shards the whole dataset itself and trained all 32 samples, not the 16 of the shard, with only the
    sequential-order warning (qa32-break 05). The sampler of the Trainer's own world and rank is plain."""
    data = TokenBlocks(n=N)
    shard = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    with pytest.raises(DataConfigError) as err:
        loader_template(shard, "InfoBatch", world=(1, 0))
    assert str(err.value) == (
        "InfoBatch: the wrapped training loader uses DistributedSampler / BatchSampler: a DistributedSampler("
        "num_replicas=2, rank=0), while this Trainer runs rank 0 of 1: InfoBatch owns the sampler and shards the whole "
        "dataset over the Trainer's ranks itself, so it would train every sample, not the sampler's shard; give the "
        "shard as the dataset (torch.utils.data.Subset(dataset, indices)) with a plain loader, or leave the sharding "
        "to the Trainer"
    )
    assert loader_template(shard, "InfoBatch", world=(2, 0))["length"] == N  # rank 0 of 2: the Trainer's world
    with pytest.raises(
        DataConfigError, match=r"DistributedSampler\(num_replicas=2, rank=0\), while this Trainer runs rank 1 of 2"
    ):
        loader_template(shard, "InfoBatch", world=(2, 1))


class TrainOnly(pl.LightningDataModule):
    """A DataModule with a training loader only (the user validates elsewhere, or not yet)."""

    def train_dataloader(self):
        return DataLoader(TokenBlocks(n=N), batch_size=BATCH, shuffle=True)


@pytest.mark.parametrize("technique", ["infobatch", "curriculum"])
def test_a_datamodule_without_evaluation_loaders_skips_them_wrapped_as_unwrapped(tmp_path, technique):
    """A module with a validation_step and a DataModule without val_dataloader: Lightning skips validation; wrapped,
    the fit crashed before its first step with "`val_dataloader` must be implemented" (qa33-user 01). The wrapper
    now defines no evaluation loader its DataModule lacks, nested wrappers too; one it has is delegated."""
    from lightning_effi.core.wrapping import is_overridden
    from tests.helpers.tiny import seqlen_truncate

    if technique == "infobatch":
        data, callback = InfoBatchDataModule(TrainOnly()), InfoBatchCallback()
    else:
        data, callback = CurriculumDataModule(TrainOnly()), Curriculum(metrics=seqlen_truncate(8, 16, 2, 8))
    for name in ("val_dataloader", "test_dataloader", "predict_dataloader"):
        assert not is_overridden(name, data, pl.LightningDataModule)
        assert not is_overridden(name, InfoBatchDataModule(data), pl.LightningDataModule)
    model = tiny_gpt2()
    assert is_overridden("validation_step", model, pl.LightningModule)
    trainer = make_trainer(tmp_path, [callback], max_epochs=2, limit_val_batches=None)
    trainer.fit(model, datamodule=data)
    assert trainer.current_epoch == 2 and trainer.global_step > 0
    assert is_overridden(
        "val_dataloader", InfoBatchDataModule(TinyDataModule(TokenBlocks(n=N))), pl.LightningDataModule
    )


class NoLength(Dataset):
    def __getitem__(self, i):
        return torch.zeros(2)


def test_loader_template_refuses_a_dataset_without_a_length():
    loader = DataLoader(NoLength(), batch_size=2, sampler=[0, 1])
    with pytest.raises(DataConfigError, match=r"^curriculum: the training dataset must be map-style with a length; "):
        loader_template(loader, "curriculum")


# ---------------------------------------------------------------------------------------- iterable datasets
class Stream(IterableDataset):
    def __iter__(self):
        blocks = TokenBlocks(n=N)
        return iter(blocks[i] for i in range(N))


def test_a_checkpoint_of_another_loader_is_refused_naming_it(tmp_path):
    """A curriculum checkpoint resumed without the curriculum: its training-loader state is the curriculum loader's
    (empty; the position lives in the Curriculum callback), which the plain resumable loader refuses, naming both
    remedies, instead of a raw KeyError."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers.tiny import tiny_lm_data

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = make_trainer(tmp_path / "a", [Curriculum(metrics={"seqlen_truncate": TRUNCATE}), ckpt], max_steps=3)
    first.fit(tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data()))
    second = make_trainer(tmp_path / "b", max_steps=6)
    with pytest.raises(ValueError, match=r"the checkpoint holds another loader's state \(keys \[\], not this loader's"):
        second.fit(tiny_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert second.global_step == 3  # restored, not trained further


def test_a_checkpoint_of_infobatchs_pruned_epoch_resumed_without_infobatch_is_refused_naming_it(tmp_path):
    """The plain loader refused it with "the checkpoint has samples=29, the run now 40; resume with the same data
    settings (batch size, subset, number of devices)", none of which was the cause (qa48-break 04)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_effi import InfoBatchCallback, InfoBatchDataModule
    from tests.helpers.tiny import tiny_lm_data

    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=7, save_top_k=-1, filename="{step}")
    first = make_trainer(tmp_path / "a", [InfoBatchCallback(prune_ratio=0.5, num_epochs=4), ckpt], max_epochs=4)
    first.fit(tiny_gpt2(), datamodule=InfoBatchDataModule(tiny_lm_data()))  # step 7: inside pruned epoch 1
    second = make_trainer(tmp_path / "b", max_epochs=4)
    with pytest.raises(ValueError, match=r"drawn by InfoBatchSampler \(\d+ samples\), this run's by EpochShuffle.*"
                       r"\(InfoBatch's pruned epochs: InfoBatchCallback and InfoBatchDataModule\)"):  # fmt: skip
        second.fit(tiny_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ckpt" / "step=7.ckpt"))


def test_the_resumable_loader_and_its_sampler_refuse_an_iterable_dataset():
    for build, owner in (
        (lambda: EpochShuffleSampler(Stream()), "EpochShuffleSampler"),
        (lambda: ResumableDataLoader(Stream(), batch_size=2, sampler=[0, 1]), "ResumableDataLoader"),
    ):
        with pytest.raises(TypeError, match=rf"^{owner}\.dataset: Stream is an IterableDataset .*map-style dataset"):
            build()
    with pytest.raises(TypeError, match=r"^EpochShuffleSampler\.dataset: NoLength has no __len__"):
        EpochShuffleSampler(NoLength())


class Batches(pl.Callback):
    def __init__(self) -> None:
        self.epochs_started = 0
        self.batches: list[torch.Tensor] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.epochs_started += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch["input_ids"].clone())


def test_infobatch_with_an_iterable_dataset_is_refused_at_setup_naming_it(tmp_path):
    """The campaign's ``infobatch_dm.datamodule.iterable_dataset``: the user's loader (a ``ResumableDataLoader`` with
    an ``EpochShuffleSampler``) over an ``IterableDataset`` raised ``TypeError: object of type 'Stream' has no len()``;
    now the sampler names the IterableDataset and what is needed, before any epoch."""
    seen = Batches()
    trainer = make_trainer(tmp_path, [InfoBatchCallback(delta=0.75), seen], max_epochs=1)
    with pytest.raises(TypeError, match=r"^EpochShuffleSampler\.dataset: Stream is an IterableDataset") as err:
        trainer.fit(tiny_gpt2(), datamodule=InfoBatchDataModule(TinyDataModule(Stream(), batch_size=BATCH)))
    assert "InfoBatch and the curriculum, which choose the samples, need a map-style training set" in str(err.value)
    assert seen.epochs_started == 0


# ------------------------------------------------------------------------------- curriculum: batch structure
class Counted(TokenBlocks):
    """TokenBlocks that counts the samples read."""

    def __init__(self) -> None:
        super().__init__(n=N)
        self.reads = 0

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i)


class ReadsAtEpochStart(Batches):
    def __init__(self, data: Counted) -> None:
        super().__init__()
        self.data, self.reads = data, None

    def on_train_epoch_start(self, trainer, pl_module):
        super().on_train_epoch_start(trainer, pl_module)
        if self.reads is None:
            self.reads = self.data.reads


def test_truncate_keys_that_name_no_tensor_are_refused_at_setup(tmp_path):
    """The campaign's ``curriculum.truncate_keys.unknown_key``: refused before the first epoch starts (it was refused
    at the first batch), with the message the first batch gives plus where it was found."""
    seen = Batches()
    trainer = make_trainer(
        tmp_path, [Curriculum(metrics={"seqlen_truncate": TRUNCATE}, truncate_keys=["token_ids"]), seen]
    )
    with pytest.raises(DataConfigError) as err:
        trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(TokenBlocks(n=N), batch_size=BATCH)))
    assert str(err.value) == (
        "seqlen_truncate: nothing to truncate: the training batch has none of truncate_keys ['token_ids'] as a "
        "[B, S, ...] tensor; found a dict with input_ids: int64[4, 16]. Put the token ids in the batch as an integer "
        "[B, S] tensor (or name the sequence tensors with truncate_keys, in a dict or dataclass batch), or remove "
        "seqlen_truncate. A batch of continuous features [B, S, D] without token ids: a dict batch {'x': ..., "
        "'attention_mask': [B, S] with 1 or True at the real positions, ...}, or truncate_keys naming its sequence "
        f"tensors [found at setup, on a batch of the training set's first {PROBE_SAMPLES} samples]"
    )
    assert seen.epochs_started == 0 and seen.batches == []


def test_the_setup_check_reads_a_few_samples_and_leaves_the_run_unchanged(tmp_path, monkeypatch):
    """The checks read ``min(PROBE_SAMPLES, micro-batch, N)`` samples (the batch structure) plus ``min(LENGTH_PROBES,
    N)`` (the data's sequence length against the difficulty range) and the N of the pass that confirms it (rows the
    probes missed may be longer: qa106-user 02) before the first epoch, and the batches trained are those of a run
    without them (they consume no randomness and move no stream position)."""

    def run(root: Path) -> ReadsAtEpochStart:
        data = Counted()
        seen = ReadsAtEpochStart(data)
        pl.seed_everything(0)
        trainer = make_trainer(root, [Curriculum(metrics={"seqlen_truncate": TRUNCATE}), seen], max_steps=6)
        trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(data, batch_size=BATCH)))
        return seen

    checked = run(tmp_path / "checked")
    monkeypatch.setattr(CurriculumDataModule, "_check_batches", lambda self, t, collate: None)
    monkeypatch.setattr(curriculum_callback, "data_sequence_length", lambda *args: None)
    monkeypatch.setattr(curriculum_callback, "data_longest_sequence", lambda *args: None)
    unchecked = run(tmp_path / "unchecked")
    assert (checked.reads, unchecked.reads) == (min(PROBE_SAMPLES, BATCH, N) + min(LENGTH_PROBES, N) + N, 0)
    assert len(checked.batches) == 6
    # fixed_linear from 8 to 16 over 4 steps, in steps of 8: d(s) = 8 + 8 s / 4 rounded down to a multiple of 8
    assert [tuple(b.shape) for b in checked.batches] == [(BATCH, 8)] * 3 + [(BATCH, 16)] * 3
    assert all(torch.equal(a, b) for a, b in zip(checked.batches, unchecked.batches, strict=True))


def test_the_check_leaves_a_collate_that_fails_outside_the_workers_to_the_loader():
    def needs_a_worker(samples):
        if torch.utils.data.get_worker_info() is None:
            raise RuntimeError("opened in the worker only")
        return torch.stack([s["input_ids"] for s in samples])

    samples = [TokenBlocks(n=4)[i] for i in range(4)]
    assert CurriculumCollate(needs_a_worker, ["seqlen_truncate"]).check(samples, [8]) is None
    assert CurriculumCollate(None, ["seqlen_truncate"]).check(samples, [8]) is None  # a truncatable batch passes
    with pytest.raises(DataConfigError, match=r"sequence-first.*\[found at setup, on a batch of the training set's"):
        CurriculumCollate(lambda xs: torch.stack([x["input_ids"] for x in xs]).t(), ["seqlen_truncate"]).check(
            samples, [8]
        )


def test_the_curriculum_sampler_checks_the_length_at_every_iteration():
    data = list(range(40))
    controller = SimpleNamespace(n=40, rank=0, micro_batches=lambda: iter([[(0, 1, 0, (8,))]]))
    sampler = CurriculumSampler(controller, dataset=data)  # type: ignore[arg-type]
    assert list(sampler) == [[(0, 1, 0, (8,))]]
    data.pop()
    with pytest.raises(DataConfigError, match=r"^curriculum: the training dataset's length changed from 40 to 39;"):
        iter(sampler)  # raised at iter(), i.e. at the epoch's start, not at the first batch


# ---------------------------------------------------------------------------------- curriculum: checkpoints
PCT = dict(
    difficulty_type="percentile",
    clustering_type="schedule_based",
    analysis="seqlen",
    min_difficulty=10,
    max_difficulty=100,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=12, difficulty_step=10),
)


def controller(n: int = 64, ga: int = 1, values=None, metric=PCT) -> CurriculumController:
    config = CurriculumConfig(metrics={"m": metric}, percentile_rounding="proportional")
    v = np.random.default_rng(0).integers(0, 50, n) if values is None else np.asarray(values)
    return CurriculumController(config, {"m": MetricIndex.from_sample_to_metric(v)}, n, 4, 1, 0, ga)


def trained_state(ga: int, micro_batches: int) -> dict:
    """The stream state after ``micro_batches`` committed micro-batches."""
    c = controller(ga=ga)
    for i, batch in enumerate(c.micro_batches()):
        if i == micro_batches:
            break
        c.commit(batch[0][1], batch[0][2])
    return copy.deepcopy(c.state_dict())


@pytest.mark.parametrize(("ga", "micro"), [(1, 0), (1, 5), (2, 3), (2, 4), (3, 7)])
def test_a_checkpoint_written_by_the_stream_loads(ga, micro):
    state = trained_state(ga, micro)
    assert state["committed_micro"] == micro and state["micro_offset"] == ((micro - 1) % ga + 1 if micro else 0)
    fresh = controller(ga=ga)
    fresh.load_state_dict(state)
    assert fresh.committed["micro"] == micro and fresh.state_dict() == state


def edit(key: str, value, within: str | None = None):
    def change(state: dict) -> None:
        (state[within] if within else state)[key] = value

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (edit("curriculum_step", -2), "curriculum_step=-2, but the position (pre_state, micro_offset) gives 3"),
        (
            edit("committed_micro", -3),
            "committed_micro=-3, expected pre_state.step x grad_accum + micro_offset = 2 x 2",
        ),
        (edit("committed_micro", 6), "committed_micro=6, expected pre_state.step x grad_accum + micro_offset"),
        (edit("micro_offset", 3), "micro_offset=3, expected an int in [0, 2]"),
        (
            edit("consumed_samples", 10**9),
            "consumed_samples=1000000000, but the position (pre_state, micro_offset) gives 20",
        ),
        (edit("current_difficulties", {"m": float("nan")}), "current_difficulties={'m': nan}, but the position"),
        (edit("step", -1, "pre_state"), "pre_state.step=-1, expected an int >= 0"),
        (edit("difficulties", {"m": float("nan")}, "pre_state"), "pre_state.difficulties={'m': nan}, expected an int"),
        (lambda s: s.pop("committed_micro"), "the checkpoint's stream state has no 'committed_micro'"),
        (edit("history", [["x"]], "pre_state"), "pre_state is malformed (ValueError"),
    ],
    ids=[
        "step",
        "micro_neg",
        "micro_off",
        "offset",
        "consumed",
        "difficulty_nan",
        "pre_step",
        "pre_nan",
        "missing",
        "history",
    ],
)
@pytest.mark.parametrize("strict", [True, False])
def test_an_edited_checkpoint_is_refused_naming_the_entry(change, message, strict):
    """``trained_state(2, 5)``: 5 micro-batches of ``grad_accum=2``, i.e. pre_state.step 2, micro_offset 1, 20
    samples consumed (4 per micro-batch). Refused with or without ``strict`` (an invalid state is not a setting)."""
    state = trained_state(2, 5)
    assert (state["pre_state"]["step"], state["micro_offset"], state["consumed_samples"]) == (2, 1, 20)
    change(state)
    fresh = controller(ga=2)
    before = copy.deepcopy(fresh.committed)
    with pytest.raises(CurriculumConfigError) as err:
        fresh.load_state_dict(state, strict=strict)
    assert message in str(err.value) and str(err.value).startswith("Curriculum: the checkpoint's stream state ")
    assert "resume from another checkpoint, or start the run afresh" in str(err.value)
    assert fresh.committed == before  # nothing was applied


def test_a_checkpoint_of_another_geometry_still_loads_without_strict():
    """strict=False keeps resuming a consistent checkpoint written with another ``grad_accum`` (its own geometry is
    used for the position's invariant)."""
    state = trained_state(2, 5)
    fresh = controller(ga=1)
    with pytest.warns(UserWarning, match="another configuration"):
        fresh.load_state_dict(state, strict=False)
    assert fresh.committed["micro"] == 5


# -------------------------------------------------------------------------- curriculum: never-eligible samples
VALUE = dict(
    difficulty_type="value",
    clustering_type="schedule_based",
    analysis="seqlen",
    min_difficulty=4,
    max_difficulty=8,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=3, difficulty_step=1),
)


def test_a_percentile_metric_that_deepspeed_rounding_holds_back_is_warned_about():
    """DeepSpeed's percentile arithmetic admits ``N // max_difficulty`` samples a percentile: on 199 samples, 50 at
    difficulty 50 of 100, and the 99 hardest at 100 only; the card said "the easiest d%" (qa97-user 02). Warned when
    ``N % max_difficulty`` is over 5% of N; not with proportional rounding, nor where the remainder is small."""

    def stream(n: int, rounding: str) -> CurriculumController:
        config = CurriculumConfig(metrics={"m": PCT}, percentile_rounding=rounding)
        values = np.random.default_rng(0).integers(0, 50, n)
        return CurriculumController(config, {"m": MetricIndex.from_sample_to_metric(values)}, n, 4, 1, 0, 1)

    with pytest.warns(UserWarning) as record:
        stream(199, "deepspeed")
    (said,) = [str(w.message) for w in record if "percentile_rounding 'deepspeed'" in str(w.message)]
    assert "N // max_difficulty = 199 // 100 = 1 samples a percentile: at difficulty 50, 50 of the 199" in said
    assert "the 99 hardest join all at once at max_difficulty" in said and "'proportional'" in said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stream(199, "proportional")
        stream(1050, "deepspeed")  # 50 of 1050 held back: under 5%
        stream(1000, "deepspeed")


def test_samples_above_a_value_metrics_max_difficulty_are_warned_about():
    values = [3, 4, 8, 9, 16, 5, 12, 8]  # 9, 16, 12 never reach max_difficulty 8
    with pytest.warns(UserWarning) as record:
        c = controller(n=8, values=values, metric=VALUE)
    assert c.never_eligible() == {"m": (3, 16)}
    assert [str(w.message) for w in record if "never become eligible" in str(w.message)] == [
        "curriculum_metrics.m: 3 of the 8 training samples have a m value above max_difficulty (8), up to 16: they "
        "never become eligible, so the run never trains on them; raise max_difficulty to 16 to include every sample "
        "(or remove those samples from the training set)"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        every = controller(n=8, values=values, metric={**VALUE, "max_difficulty": 16})
        assert every.never_eligible() == {} and controller().never_eligible() == {}  # percentile: all at max


def test_a_value_metric_whose_first_difficulty_admits_every_sample_is_warned_about():
    """min_difficulty at or above every sample's value: the metric never filters, the run trains the plain shuffled
    data, and nothing said so (qa108-break 03)."""
    values = [3, 4, 8, 5]
    with pytest.warns(UserWarning) as record:
        controller(n=4, values=values, metric={**VALUE, "min_difficulty": 9, "max_difficulty": 12})
    assert [str(w.message) for w in record if "never filters" in str(w.message)] == [
        "curriculum_metrics.m: every one of the 4 training samples has a m value at or below the first curriculum "
        "step's difficulty (10, from min_difficulty 9): every sample is eligible from the start, so this metric "
        "never filters the data; the values run 3..8: set min_difficulty below 8 (and max_difficulty to 8)"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        controller(n=4, values=values, metric={**VALUE, "min_difficulty": 4, "max_difficulty": 8})


def test_a_resume_after_the_last_batch_of_a_limited_epoch_starts_the_next_epoch_at_its_first_batch(tmp_path):
    """Epochs of 6 batches limited to 4 (Trainer(limit_train_batches=4)): a checkpoint after the 4th batch of epoch 1
    resumes in epoch 2, whose first 4 batches are trained, as in the uninterrupted fit (before, the loader skipped 4
    batches of epoch 2 as well: it trained its last 2, and the weights differed, silently)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers.tiny import HandImageLinear, Images, TinyDataModule

    class Rec(pl.Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.rows.append((trainer.current_epoch, batch["labels"].tolist()))

    def run(root, ckpt=None):
        rec, model = Rec(), HandImageLinear()
        checkpoints = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
        trainer = pl.Trainer(
            max_epochs=3,
            limit_train_batches=4,
            limit_val_batches=0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[rec, checkpoints],
        )
        trainer.fit(model, datamodule=TinyDataModule(Images(n=48), batch_size=8), ckpt_path=ckpt)
        return [labels for epoch, labels in rec.rows if epoch == 2], model.net.weight.detach().clone()

    full, w_full = run(tmp_path / "a")
    resumed, w_resumed = run(tmp_path / "b", tmp_path / "a" / "step=8.ckpt")
    assert len(full) == 4 and resumed == full and torch.equal(w_full, w_resumed)
    mid, w_mid = run(tmp_path / "c", tmp_path / "a" / "step=6.ckpt")  # mid-epoch (2 of 4 in epoch 1) still skips
    assert mid == full and torch.equal(w_full, w_mid)
