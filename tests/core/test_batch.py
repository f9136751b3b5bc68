"""The techniques' batch metadata travels beside the user's batch (``EffiBatch``) and is taken off before any user hook:
the user's DataModule and LightningModule hooks and ``training_step`` see exactly the batch their collate made."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_effi.callbacks import InfoBatchCallback
from lightning_effi.core.batch import EffiBatch, batch_meta, unwrap
from lightning_effi.data import InfoBatchDataModule
from tests.helpers.harness import make_trainer


class Pairs(Dataset):
    """``(x, y)`` samples: ``x = [i, i, i, i]`` (float), ``y = i % 3``."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)), i % 3


class PairsData(pl.LightningDataModule):
    def __init__(self, hooks: bool = False) -> None:
        super().__init__()
        self.seen: list[tuple[str, object]] = []
        if hooks:  # the user's DataModule overrides the batch hooks (instance attributes count for Lightning)
            self.on_before_batch_transfer = self._before  # type: ignore[method-assign]
            self.on_after_batch_transfer = self._after  # type: ignore[method-assign]

    def _before(self, batch, dataloader_idx):
        self.seen.append(("dm_before", batch))
        return batch

    def _after(self, batch, dataloader_idx):
        self.seen.append(("dm_after", batch))
        return batch

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Pairs(), batch_size=6, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Pairs(), batch_size=6)


class PairsModule(pl.LightningModule):
    """Tuple batches ``(x, y)``; returns the per-sample losses InfoBatch needs; records what its hooks receive."""

    def __init__(self, hooks: bool = False) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.seen: list[tuple[str, object]] = []
        self.meta_seen: list[list[int]] = []
        if hooks:
            self.on_before_batch_transfer = self._before  # type: ignore[method-assign]

    def _before(self, batch, dataloader_idx):
        self.seen.append(("module_before", batch))
        return batch

    def training_step(self, batch, batch_idx):
        self.seen.append(("training_step", batch))
        x, y = batch
        per_sample = nn.functional.cross_entropy(self.net(x), y, reduction="none")
        return {"loss": per_sample.mean(), "per_sample_loss": per_sample}

    def validation_step(self, batch, batch_idx):
        self.seen.append(("validation_step", batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MetaSpy(pl.Callback):
    def __init__(self) -> None:
        self.indices: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        meta = batch_meta(trainer)
        assert meta is not None
        self.indices.append(meta["index"].tolist())
        x, _ = batch
        assert x[:, 0].long().tolist() == meta["index"].tolist()  # the metadata belongs to this very batch


def fit(root, module: PairsModule, dm: PairsData, **kw) -> tuple[pl.Trainer, MetaSpy]:
    spy = MetaSpy()
    trainer = make_trainer(
        root,
        max_epochs=2,
        callbacks=[InfoBatchCallback(prune_ratio=0.5, delta=0.5, seed=0), spy],
        limit_val_batches=1,
        **kw,
    )
    trainer.fit(module, datamodule=InfoBatchDataModule(dm))
    return trainer, spy


def is_user_pair(batch) -> bool:
    return isinstance(batch, (list, tuple)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)


def test_unwrap_and_batch_meta_without_a_technique():
    eb = EffiBatch([1, 2], {"index": torch.tensor([3])})
    assert unwrap(eb) == ([1, 2], eb.meta) and unwrap((1, 2)) == ((1, 2), None)
    assert batch_meta(None) is None and batch_meta(pl.Trainer(logger=False)) is None


def test_user_hooks_and_training_step_see_the_users_batch_and_the_metadata_stays_beside_it(tmp_path):
    module, dm = PairsModule(hooks=True), PairsData(hooks=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, spy = fit(tmp_path, module, dm)
    assert not [w for w in caught if "overridden `on_before_batch_transfer` in both" in str(w.message)]
    kinds = [kind for kind, _ in module.seen]
    assert "module_before" in kinds and "training_step" in kinds and "validation_step" in kinds
    assert all(is_user_pair(batch) for _, batch in module.seen)  # never an EffiBatch, never an index
    steps = [b for kind, b in module.seen if kind == "training_step"]
    assert len(steps) == len(spy.indices) and len(spy.indices) >= 5
    assert sorted(i for batch in spy.indices[:4] for i in batch) == list(range(24))  # epoch 0: every sample once


def test_the_users_datamodule_hooks_are_called_through_the_wrapper(tmp_path):
    module, dm = PairsModule(hooks=True), PairsData(hooks=True)
    fit(tmp_path, module, dm)
    kinds = [kind for kind, _ in dm.seen]
    assert kinds.count("dm_before") > 0 and kinds.count("dm_before") == kinds.count("dm_after")
    assert all(is_user_pair(batch) for _, batch in dm.seen)
    # Lightning's rule without the wrapper: the DataModule's hook wins over the module's
    assert "module_before" not in [kind for kind, _ in module.seen]


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_precision_converts_the_users_batch_inside_and_leaves_the_metadata(precision, tmp_path):
    module, dm = PairsModule(), PairsData()
    _, spy = fit(tmp_path, module, dm, precision=precision)
    dtype = torch.float64 if precision == "64-true" else torch.bfloat16
    xs = [b[0] for kind, b in module.seen if kind == "training_step"]
    assert xs and all(x.dtype == dtype for x in xs)
    assert all(isinstance(i, int) for batch in spy.indices for i in batch)
