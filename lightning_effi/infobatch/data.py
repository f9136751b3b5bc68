"""``InfoBatchDataModule``: wraps any DataModule so that InfoBatch can choose each epoch's training samples. The
method card ``README.md`` beside this file tells the long story.

It holds no InfoBatch configuration: the :class:`~lightning_effi.callbacks.InfoBatchCallback` finds it on
``trainer.datamodule`` in ``setup`` and attaches itself; every ``train_dataloader()`` call then rebuilds the loader
from the callback's plan for ``trainer.current_epoch``:

``ResumableDataLoader(IndexedDataset(dataset), sampler=InfoBatchSampler(plan, world, rank),
collate_fn=indexed_collate(collate_fn), ...)``, with the user's loader's ``batch_size``, ``drop_last``,
``num_workers``, ``pin_memory``, ``worker_init_fn``, ``prefetch_factor``, ``timeout``, ``multiprocessing_context``
and ``in_order`` (``persistent_workers`` is off: the loader is rebuilt every epoch),

so each batch is an :class:`~lightning_effi.core.batch.EffiBatch`: the user's batch, of any structure, as their
collate function made it, and ``meta["index"]`` (int64 dataset positions), which the DataModule takes apart before
any user hook (the callback reads it with :func:`~lightning_effi.core.batch.batch_meta`); the epoch's length is right
every epoch (Lightning reloads the loader each epoch), and a mid-epoch resume continues the saved plan where it
stopped.

The callback sets ``reload_dataloaders_every_n_epochs = 1`` for the training loader's sake, and Lightning then rebuilds
the validation loader every epoch too (one ``Trainer`` setting drives both). Unless the user asked for reloads
(``reload_dataloaders_every_n_epochs`` was 0 when the fit started), ``val_dataloader()`` therefore returns, for the
rest of the fit, the loader the wrapped DataModule returned at its first call: the user's ``val_dataloader()`` runs
once per fit, as without InfoBatch, and a loader with ``persistent_workers=True`` keeps its workers across epochs
(under DDP with Lightning's ``use_distributed_sampler``, Lightning still rebuilds that loader around a
``DistributedSampler`` at every reload, unless the loader has a ``DistributedSampler`` of its own).

Composed with the curriculum (a :class:`~lightning_effi.data.CurriculumDataModule` wraps this one or is wrapped by it,
see "Composition" in the method card), the curriculum draws every batch and InfoBatch thins each micro-batch inside
the curriculum's sampler: an ``InfoBatchDataModule`` whose chain holds a ``CurriculumDataModule`` delegates
``train_dataloader()`` to it, and one nested inside a ``CurriculumDataModule`` is only checked for its callback.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from lightning_effi.core.errors import DataConfigError
from lightning_effi.core.indexed import IndexedDataset, indexed_collate
from lightning_effi.core.loader import ResumableDataLoader
from lightning_effi.core.wrapping import EvaluationLoader, WrappingDataModule, find_wrapper
from lightning_effi.curriculum.data import CurriculumDataLoader, CurriculumDataModule
from lightning_effi.infobatch.sampler import InfoBatchSampler


class InfoBatchDataModule(WrappingDataModule):
    """Wrap ``datamodule`` for InfoBatch. Everything but the training loader is delegated unchanged.

    Args:
        datamodule: any ``LightningDataModule`` whose ``train_dataloader()`` returns a ``DataLoader`` over a
            map-style dataset (samples and batches of any structure), with a plain (shuffling or sequential)
            sampler. Each epoch's samples come in a seeded random order (a sequential loader's order is not kept:
            a warning says so).

    Raises:
        DataConfigError: (at the first ``train_dataloader()``) a custom sampler or batch sampler, an iterable
            dataset, or a dataset whose length changed during the run; (without the callback) used alone or nested
            with a ``CurriculumDataModule``.
    """

    technique = "InfoBatch"
    own_attributes = WrappingDataModule.own_attributes | {"planner"}

    def __init__(self, datamodule: pl.LightningDataModule) -> None:
        super().__init__(datamodule)
        self.planner: Any = None  # the InfoBatchCallback, attached in its setup()
        #: the validation loader served for the rest of the fit (see the module docstring); None outside a fit
        self._val_loader: Any = None
        #: whether the user's Trainer reloads loaders itself (reload_dataloaders_every_n_epochs > 0 before the fit)
        self._user_reloads = True

    def setup(self, stage: str) -> None:
        """Delegated; for ``fit``, also note the Trainer's ``reload_dataloaders_every_n_epochs`` before the InfoBatch
        callback sets it to 1 (Lightning runs the DataModule's ``setup`` before the callbacks')."""
        self._val_loader = None
        if stage == "fit":
            self._user_reloads = bool(self.trainer is None or self.trainer.reload_dataloaders_every_n_epochs)
        super().setup(stage)

    def teardown(self, stage: str) -> None:
        self._val_loader = None
        super().teardown(stage)

    val_dataloader = EvaluationLoader("_val_dataloader")  # none where the wrapped DataModule has none

    def _val_dataloader(self) -> Any:
        """The wrapped DataModule's validation loader; during a fit whose Trainer did not ask for reloads, the one
        its first call returned (the module docstring says why)."""
        trainer = self.trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if not fitting or self._user_reloads or self.planner is None:
            return self.datamodule.val_dataloader()
        if self._val_loader is None:
            self._val_loader = self.datamodule.val_dataloader()
        return self._val_loader

    def check_attached(self) -> None:
        """Raise unless the InfoBatch callback attached itself.

        Raises:
            DataConfigError: no callback (InfoBatchCallback is missing from the Trainer).
        """
        if self.planner is None:
            raise DataConfigError(
                "InfoBatchDataModule needs an InfoBatchCallback in Trainer(callbacks=[...]); without it use the "
                "wrapped DataModule directly"
            )

    def train_dataloader(self) -> ResumableDataLoader | CurriculumDataLoader:
        """The loader of the current epoch, built from the attached callback's plan (see the module docstring); the
        curriculum's loader, thinned by the callback, when a ``CurriculumDataModule`` is nested inside this one."""
        self.check_attached()
        self._serve()
        curriculum = find_wrapper(self.datamodule, CurriculumDataModule)
        if curriculum is not None:
            return curriculum.train_dataloader()
        t = self.template()
        if len(t["dataset"]) != t["length"]:
            raise DataConfigError(
                f"InfoBatch: the training dataset's length changed from {t['length']} to {len(t['dataset'])}; "
                "it must stay constant during a run"
            )
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        plan = self.planner.plan_for(epoch)
        sampler = InfoBatchSampler(plan, num_replicas=world, rank=rank, drop_last=t["drop_last"])
        workers = t["num_workers"]
        loader = ResumableDataLoader(
            IndexedDataset(t["dataset"]),
            batch_size=t["batch_size"],
            sampler=sampler,
            collate_fn=indexed_collate(t["collate_fn"]),
            drop_last=t["drop_last"],
            num_workers=workers,
            pin_memory=t["pin_memory"],
            worker_init_fn=t["worker_init_fn"],
            prefetch_factor=t["prefetch_factor"] if workers > 0 else None,
            persistent_workers=False,  # rebuilt every epoch: persistence buys nothing
            timeout=t["timeout"],
            multiprocessing_context=t["multiprocessing_context"],
            in_order=t["in_order"],
        )
        self.planner.record_loader(epoch, padded=sampler.padded, batches=len(loader))
        return loader
