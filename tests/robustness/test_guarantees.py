"""Guarantees stated in the docstrings and error messages of the techniques that own the training sampler (InfoBatch,
curriculum), each checked by the error it promises; the message must name the cause.

- ``core/wrapping.py`` ``loader_template``: a custom sampler or batch sampler, or an ``IterableDataset``, is refused
  (it would be silently replaced) with a ``DataConfigError`` naming the technique and what was found;
- ``InfoBatchDataModule`` / ``CurriculumDataModule.train_dataloader``: the training set's length must stay constant
  during a run ("the training dataset's length changed from A to B"); ``WrappingDataModule.setup``: each fit reads the
  user's training loader afresh (a refit trains on that fit's training set);
- ``Curriculum._check_same_indexes``: index files that differ between DDP ranks raise a ``CurriculumConfigError``;
- ``InfoBatchCallback.load_state_dict``: a checkpoint of a training set of another size is refused;
- ``loader_template`` also refuses an explicit ``DataLoader(batch_sampler=BatchSampler(...))`` (naming
  ``batch_sampler``) and a subclass of a plain sampler with its own order; the curriculum checks the training set's
  length at every epoch's start (its loader is built once per fit). More loader checks: ``test_loader_checks.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from lightning_effi.callbacks import Curriculum, InfoBatchCallback
from lightning_effi.core.errors import DataConfigError
from lightning_effi.curriculum import CurriculumConfigError
from lightning_effi.curriculum.analysis import MetricIndex
from lightning_effi.curriculum.stream import indexes_fingerprint
from lightning_effi.data import CurriculumDataModule
from lightning_effi.infobatch.data import InfoBatchDataModule
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TinyDataModule, TokenBlocks, tiny_gpt2

N, BATCH = 40, 8
TRUNCATE = {
    "seqlen_truncate": dict(
        difficulty_type="value",
        clustering_type="single_cluster",
        min_difficulty=8,
        max_difficulty=16,
        schedule_type="fixed_linear",
        schedule_config=dict(total_curriculum_step=4, difficulty_step=8),
    )
}
#: technique -> (its callback, its DataModule wrapper, the name its messages use, Trainer arguments of a short run)
TECHNIQUES = {
    "infobatch": (lambda: InfoBatchCallback(delta=0.75), InfoBatchDataModule, "InfoBatch", dict(max_epochs=1)),
    "curriculum": (lambda: Curriculum(metrics=TRUNCATE), CurriculumDataModule, "curriculum", dict(max_steps=2)),
}


class LoaderModule(pl.LightningDataModule):
    """A user DataModule whose training loader is ``make()``."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make

    def train_dataloader(self) -> DataLoader:
        return self.make()


class Batches(pl.Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.count += 1


def fit(tmp_path: Path, technique: str, make_loader, **trainer_kwargs) -> Batches:
    """A short fit of ``technique`` on a DataModule whose loader is ``make_loader()``; returns the batch counter."""
    callback, wrapper, _, kw = TECHNIQUES[technique]
    batches = Batches()
    trainer = make_trainer(tmp_path, [callback(), batches], **{**kw, **trainer_kwargs})
    trainer.fit(tiny_gpt2(), datamodule=wrapper(LoaderModule(make_loader)))
    return batches


# --------------------------------------------------------------------------------------- samplers and datasets
class EvenPositions(RandomSampler):
    """A user sampler with its own order (even positions only), subclassing a plain sampler."""

    def __iter__(self):
        return iter(range(0, len(self.data_source), 2))

    def __len__(self) -> int:
        return (len(self.data_source) + 1) // 2


class Chunks:
    """A user batch sampler (not a ``BatchSampler``): consecutive chunks of 8."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter([list(range(i, min(i + BATCH, self.n))) for i in range(0, self.n, BATCH)])

    def __len__(self) -> int:
        return -(-self.n // BATCH)


class Stream(IterableDataset):
    def __iter__(self):
        blocks = TokenBlocks()
        return iter(blocks[i] for i in range(len(blocks)))


@pytest.mark.parametrize("technique", sorted(TECHNIQUES))
def test_a_custom_sampler_is_refused_at_setup(tmp_path, technique):
    data, name = TokenBlocks(), TECHNIQUES[technique][2]
    weighted = lambda: DataLoader(data, batch_size=BATCH, sampler=torch.utils.data.WeightedRandomSampler([1.0] * N, N))
    batches = Batches()
    with pytest.raises(DataConfigError) as err:
        batches = fit(tmp_path, technique, weighted)
    assert str(err.value).startswith(f"{name}: the wrapped training loader uses WeightedRandomSampler / BatchSampler")
    assert f"{name} owns the sampler" in str(err.value) and batches.count == 0


@pytest.mark.parametrize("technique", sorted(TECHNIQUES))
def test_a_custom_batch_sampler_is_refused_at_setup(tmp_path, technique):
    data, name = TokenBlocks(), TECHNIQUES[technique][2]
    with pytest.raises(DataConfigError, match=rf"^{name}: the wrapped training loader uses SequentialSampler / Chunks"):
        fit(tmp_path, technique, lambda: DataLoader(data, batch_sampler=Chunks(N)))
    # a length-grouping batch sampler (a protein engineer's, qa41-user 01): the way to pad less under the technique
    with pytest.raises(DataConfigError, match=r"groups samples by length cannot be kept: to pad less, pack"):
        fit(tmp_path, technique, lambda: DataLoader(data, batch_sampler=Chunks(N)))


@pytest.mark.parametrize("technique", sorted(TECHNIQUES))
def test_an_iterable_dataset_is_refused_at_setup(tmp_path, technique):
    name = TECHNIQUES[technique][2]
    with pytest.raises(DataConfigError, match=rf"^{name}: the training dataset must be map-style; IterableDataset"):
        fit(tmp_path, technique, lambda: DataLoader(Stream(), batch_size=BATCH))


@pytest.mark.parametrize("technique", sorted(TECHNIQUES))
@pytest.mark.parametrize("several", ["dict", "CombinedLoader"])
def test_several_training_loaders_are_refused_with_the_way_out(tmp_path, technique, several):
    """A dict of loaders or a CombinedLoader was refused with "must return one DataLoader, got dict" and no reason
    or remedy (qa38-break 04)."""
    from lightning.pytorch.utilities import CombinedLoader

    data, name = TokenBlocks(), TECHNIQUES[technique][2]

    def loaders():
        both = {"a": DataLoader(data, batch_size=BATCH), "b": DataLoader(data, batch_size=BATCH)}
        return both if several == "dict" else CombinedLoader(both, mode="min_size")

    with pytest.raises(
        DataConfigError,
        match=rf"^{name}: the wrapped train_dataloader\(\) must return one DataLoader, "
        rf"got {several} \(several training loaders\): .*ConcatDataset",
    ):
        fit(tmp_path, technique, loaders)


@pytest.mark.parametrize("technique", sorted(TECHNIQUES))
def test_an_explicit_batch_sampler_is_refused_naming_it(tmp_path, technique):
    data, name = TokenBlocks(), TECHNIQUES[technique][2]
    explicit = lambda: DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), BATCH, drop_last=False))
    batches = Batches()
    with pytest.raises(DataConfigError, match=rf"^{name}: .*batch_sampler") as err:
        batches = fit(tmp_path, technique, explicit)
    assert f"DataLoader(dataset, batch_size={BATCH}, drop_last=False" in str(err.value) and batches.count == 0


@pytest.mark.parametrize("technique", sorted(TECHNIQUES))
def test_a_plain_sampler_subclass_with_its_own_order_is_refused(tmp_path, technique):
    data, name = TokenBlocks(), TECHNIQUES[technique][2]
    with pytest.raises(DataConfigError, match=rf"^{name}: the wrapped training loader uses EvenPositions"):
        fit(tmp_path, technique, lambda: DataLoader(data, batch_size=BATCH, sampler=EvenPositions(data)))


# ------------------------------------------------------------------------------------ a training set that changes
class Resizable(TokenBlocks):
    """``len()`` is ``size`` (settable); the items stay readable, so nothing but a length check can notice."""

    def __init__(self) -> None:
        super().__init__(n=N)
        self.size = N

    def __len__(self) -> int:
        return self.size


class ShrinkAfterFirstEpoch(pl.Callback):
    def __init__(self, data: Resizable) -> None:
        self.data = data

    def on_train_epoch_end(self, trainer, pl_module):
        self.data.size = 30


def test_infobatch_refuses_a_training_set_whose_length_changes_between_epochs(tmp_path):
    data, batches = Resizable(), Batches()
    trainer = make_trainer(
        tmp_path, [InfoBatchCallback(delta=0.75), ShrinkAfterFirstEpoch(data), batches], max_epochs=3
    )
    with pytest.raises(DataConfigError, match=r"^InfoBatch: the training dataset's length changed from 40 to 30"):
        trainer.fit(tiny_gpt2(), datamodule=InfoBatchDataModule(TinyDataModule(data, batch_size=BATCH)))
    assert batches.count == 5  # epoch 0 trained, epoch 1's loader refused


def test_curriculum_refuses_a_training_set_whose_length_changes_between_epochs(tmp_path):
    data, batches = Resizable(), Batches()
    trainer = make_trainer(tmp_path, [Curriculum(metrics=TRUNCATE), ShrinkAfterFirstEpoch(data), batches], max_steps=6)
    with pytest.raises(DataConfigError, match=r"^curriculum: the training dataset's length changed from 40 to 30"):
        trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(data, batch_size=BATCH)))
    assert batches.count == 5  # epoch 0 (40 samples / 8) trained, refused at epoch 1's start


class SetupBuildsData(TinyDataModule):
    """A user DataModule that builds its training set in ``setup`` (``n`` samples)."""

    def __init__(self, n: int) -> None:
        super().__init__(TokenBlocks(n=n), batch_size=BATCH)
        self.n = n

    def setup(self, stage: str) -> None:
        self.train_dataset = TokenBlocks(n=self.n)


@pytest.mark.parametrize("technique", sorted(TECHNIQUES))
def test_a_refit_uses_the_training_set_of_that_fit(tmp_path, technique):
    """The same wrapper fitted twice, the user's DataModule building another training set in its ``setup`` for the
    second fit: the second fit trains on that one (the wrapper reads the user's loader afresh at every
    ``setup("fit")``), never silently on the first fit's."""
    callback, wrapper, name, kw = TECHNIQUES[technique]
    user = SetupBuildsData(40)
    dm, cb = wrapper(user), callback()
    make_trainer(tmp_path / "first", [cb], **kw).fit(tiny_gpt2(), datamodule=dm)
    user.n = 24  # the next setup builds 24 samples
    make_trainer(tmp_path / "second", [cb], **kw).fit(tiny_gpt2(), datamodule=dm)
    assert len(user.train_dataset) == 24
    assert dm.template()["dataset"] is user.train_dataset
    assert (cb.dataset_size if technique == "infobatch" else cb.controller.n) == 24


# ------------------------------------------------------------------------------- the curriculum's cross-rank check
def fake_trainer(*other_ranks: torch.Tensor) -> SimpleNamespace:
    """A stand-in for a DDP Trainer: ``strategy.all_gather`` stacks this rank's tensor with the given ones."""
    gather = lambda local: torch.stack([local, *other_ranks])
    return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"), all_gather=gather))


def digest(indexes) -> torch.Tensor:
    """What a rank contributes: the first 15 hex digits of the indexes' fingerprint, as an int64 tensor ``[1]``."""
    return torch.tensor([int(indexes_fingerprint(indexes)[:15], 16)], dtype=torch.int64)


def test_cross_rank_check_refuses_indexes_that_differ():
    """The check (run in ``Curriculum.setup`` when ``world_size > 1``) with a stand-in ``all_gather``: three ranks
    that agree pass; a rank whose analysis orders a row differently makes it raise, naming every rank's hash. (A real
    two-process gloo run of the same function took about a minute on the 2-core CI machine, mostly imports.)"""
    ours = {"seqlen": MetricIndex.from_sample_to_metric(np.array([3, 1, 2, 1]))}
    same = {"seqlen": MetricIndex.from_sample_to_metric(np.array([3, 1, 2, 1]))}
    other = {"seqlen": MetricIndex.from_sample_to_metric(np.array([3, 1, 1, 2]))}  # another analysis, same size
    Curriculum._check_same_indexes(fake_trainer(digest(same), digest(same)), ours)  # three ranks agree
    with pytest.raises(CurriculumConfigError, match="the analysis indexes differ between ranks") as err:
        Curriculum._check_same_indexes(fake_trainer(digest(same), digest(other)), ours)
    assert str(digest(ours).item()) in str(err.value) and str(digest(other).item()) in str(err.value)
    assert "every rank must read the same index files" in str(err.value)


# --------------------------------------------------------------------------------- InfoBatch checkpoint, other size
class StopAfterTwoEpochs(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        trainer.should_stop = trainer.current_epoch >= 1


@pytest.fixture(scope="module")
def infobatch_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of InfoBatch (E = 4) after 2 of its 4 epochs, on 40 samples."""
    root = tmp_path_factory.mktemp("infobatch_ckpt")
    trainer = make_trainer(root, [InfoBatchCallback(num_epochs=4, delta=0.75), StopAfterTwoEpochs()], max_epochs=4)
    trainer.fit(tiny_gpt2(), datamodule=InfoBatchDataModule(TinyDataModule(TokenBlocks(n=N), batch_size=BATCH)))
    assert trainer.current_epoch == 2
    trainer.save_checkpoint(root / "infobatch.ckpt")
    return root / "infobatch.ckpt"


@pytest.mark.parametrize("strict", [True, False])
def test_infobatch_refuses_a_checkpoint_of_another_training_set_size(tmp_path, infobatch_checkpoint, strict):
    cb, batches = InfoBatchCallback(num_epochs=4, delta=0.75, strict=strict), Batches()
    trainer = make_trainer(tmp_path, [cb, batches], max_epochs=4)
    data = InfoBatchDataModule(TinyDataModule(TokenBlocks(n=32), batch_size=BATCH))
    # whatever strict: the score table is per sample (strict=False warned, then failed on the table's size)
    with pytest.raises(ValueError) as err:
        trainer.fit(tiny_gpt2(), datamodule=data, ckpt_path=infobatch_checkpoint)
    assert str(err.value) == (
        "InfoBatchCallback: the checkpoint's state is for a training set of 40 samples, this fit's has 32: its score "
        "table holds one score per sample, so it cannot resume on another training set (strict=False does not "
        "apply); resume on the training set it was written on, or start a fresh fit"
    )
    assert batches.count == 0
