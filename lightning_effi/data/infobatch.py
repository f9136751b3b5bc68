"""``InfoBatchDataModule``: wraps any DataModule so that InfoBatch can choose each epoch's training samples.

It holds no InfoBatch configuration: the :class:`~lightning_effi.callbacks.InfoBatchCallback` finds it on
``trainer.datamodule`` in ``setup`` and attaches itself; every ``train_dataloader()`` call then rebuilds the loader
from the callback's plan for ``trainer.current_epoch`` (``shared/specs/infobatch.md`` §4.2):

``ResumableDataLoader(IndexedDataset(dataset), sampler=InfoBatchSampler(plan, world, rank),
collate_fn=indexed_collate(collate_fn), ...)``

so each batch carries ``batch["index"]`` (int64 dataset positions; the callback removes it before the user's
``training_step``), the epoch's length is right every epoch (Lightning reloads the loader each epoch), and a
mid-epoch resume continues the saved plan where it stopped.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from lightning_effi.data.errors import DataConfigError
from lightning_effi.data.indexed import IndexedDataset, indexed_collate
from lightning_effi.data.infobatch_sampler import InfoBatchSampler
from lightning_effi.data.loader import EpochShuffleSampler, ResumableDataLoader

#: samplers that only shuffle (or not): InfoBatch replaces them with its own plan without changing the semantics
_PLAIN_SAMPLERS = (RandomSampler, SequentialSampler, EpochShuffleSampler, DistributedSampler)


class InfoBatchDataModule(pl.LightningDataModule):
    """Wrap ``datamodule`` for InfoBatch. Everything but the training loader is delegated unchanged.

    Args:
        datamodule: any ``LightningDataModule`` whose ``train_dataloader()`` returns a ``DataLoader`` over a
            map-style dataset of **dict** samples, with a plain (shuffling or sequential) sampler.

    Raises:
        DataConfigError: (at the first ``train_dataloader()``) a custom sampler or batch sampler, an iterable
            dataset, or a dataset whose length changed during the run; (without the callback) used alone.
    """

    def __init__(self, datamodule: pl.LightningDataModule) -> None:
        super().__init__()
        if not isinstance(datamodule, pl.LightningDataModule):
            raise DataConfigError(f"data.datamodule: expected a LightningDataModule, got {type(datamodule).__name__}")
        self.datamodule = datamodule
        self.planner: Any = None  # the InfoBatchCallback, attached in its setup()
        self._template: dict[str, Any] | None = None

    # ---------------------------------------------------------------------------------------------- delegation
    def prepare_data(self) -> None:
        self.datamodule.prepare_data()

    def setup(self, stage: str) -> None:
        self.datamodule.trainer = self.trainer
        self.datamodule.setup(stage)

    def teardown(self, stage: str) -> None:
        self.datamodule.teardown(stage)

    def val_dataloader(self) -> Any:
        return self.datamodule.val_dataloader()

    def test_dataloader(self) -> Any:
        return self.datamodule.test_dataloader()

    def predict_dataloader(self) -> Any:
        return self.datamodule.predict_dataloader()

    def state_dict(self) -> dict[str, Any]:
        return self.datamodule.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.datamodule.load_state_dict(state_dict)

    def model_hints(self) -> dict[str, Any]:
        hints = getattr(self.datamodule, "model_hints", None)
        return hints() if callable(hints) else {}

    # -------------------------------------------------------------------------------------------- training data
    def template(self) -> dict[str, Any]:
        """The wrapped training loader's dataset and settings, read once (first call) and validated."""
        if self._template is None:
            self.datamodule.trainer = self.trainer
            loader = self.datamodule.train_dataloader()
            if not isinstance(loader, DataLoader):
                raise DataConfigError(
                    f"InfoBatch: the wrapped train_dataloader() must return one DataLoader, got {type(loader).__name__}"
                )
            if isinstance(loader.dataset, IterableDataset):
                raise DataConfigError("InfoBatch: the training dataset must be map-style; IterableDataset is not supported")
            batch_sampler = loader.batch_sampler
            sampler = getattr(batch_sampler, "sampler", loader.sampler)
            if type(batch_sampler) is not BatchSampler or not isinstance(sampler, _PLAIN_SAMPLERS):
                raise DataConfigError(
                    f"InfoBatch: the wrapped training loader uses {type(sampler).__name__} / "
                    f"{type(batch_sampler).__name__}; InfoBatch owns the sampler and accepts only plain shuffling "
                    "loaders (shuffle=True/False, no custom sampler or batch_sampler)"
                )
            self._template = dict(
                dataset=loader.dataset,
                batch_size=loader.batch_size,
                drop_last=loader.drop_last,
                collate_fn=loader.collate_fn,
                num_workers=loader.num_workers,
                pin_memory=loader.pin_memory,
                worker_init_fn=loader.worker_init_fn,
                prefetch_factor=loader.prefetch_factor,
                length=len(loader.dataset),
            )
        return self._template

    @property
    def train_dataset(self) -> Any:
        return self.template()["dataset"]

    def train_dataloader(self) -> ResumableDataLoader:
        """The loader of the current epoch, built from the attached callback's plan (see the module docstring)."""
        if self.planner is None:
            raise DataConfigError(
                "InfoBatchDataModule needs an InfoBatchCallback in Trainer(callbacks=[...]); without it use the "
                "wrapped DataModule directly"
            )
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
            persistent_workers=False,  # rebuilt every epoch: persistence buys nothing (infobatch.md §4.2)
        )
        self.planner.record_loader(epoch, padded=sampler.padded, batches=len(loader))
        return loader
