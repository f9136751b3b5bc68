"""The user's DataModule behind a technique's wrapper (``CurriculumDataModule``, ``InfoBatchDataModule``) is reached as
without it: its attributes read and set through ``trainer.datamodule``, its hyperparameters in the checkpoint and the
logger's ``hparams.yaml`` (``load_from_checkpoint`` rebuilds it with them), and the wrappers' own attributes never
mixed with the user's of the same name."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_effi.callbacks import Curriculum, InfoBatchCallback
from lightning_effi.core.errors import DataConfigError
from lightning_effi.core.wrapping import wrapper_chain
from lightning_effi.curriculum.config import CurriculumConfig
from lightning_effi.data import CurriculumDataModule, InfoBatchDataModule
from tests.helpers.harness import make_trainer

TRUNC = dict(
    difficulty_type="value",
    clustering_type="single_cluster",
    min_difficulty=4,
    max_difficulty=8,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=2, difficulty_step=1),
)


class UserData(pl.LightningDataModule):
    """A user's DataModule: its hyperparameters saved, a ``num_classes`` the module reads, a ``config`` of its own."""

    def __init__(self, vocab_size: int = 30, num_classes: int = 3, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.num_classes, self.num_workers, self.config = num_classes, 0, {"metrics": "the user's"}

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, self.hparams.vocab_size, (16, 8), generator=g)
        self.data = TensorDataset(ids, torch.randint(0, self.num_classes, (16,), generator=g))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.hparams.batch_size, num_workers=self.num_workers, shuffle=True)


class Classifier(pl.LightningModule):
    """Builds its head in ``setup`` from ``trainer.datamodule.num_classes`` (the Lightning pattern)."""

    def setup(self, stage: str) -> None:
        self.embed = nn.Embedding(30, 8)
        self.head = nn.Linear(8, self.trainer.datamodule.num_classes)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return nn.functional.cross_entropy(self.head(self.embed(ids).mean(1)), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("wrapper", [CurriculumDataModule, InfoBatchDataModule])
def test_an_attribute_the_wrapper_lacks_is_the_user_datamodules_to_read_and_set(wrapper):
    user = UserData(num_classes=5)
    dm = wrapper(user)
    assert dm.num_classes == 5 and dm.hparams == {"vocab_size": 30, "num_classes": 5, "batch_size": 4}
    dm.num_workers = 2  # set where the user's loader reads it
    assert user.num_workers == 2 and "num_workers" not in vars(dm)
    dm.new_attribute = 1  # one neither has: the user's, as without the wrapper (it landed on the wrapper before)
    assert user.new_attribute == 1 and "new_attribute" not in vars(dm) and dm.new_attribute == 1
    assert dm.prepare_data_per_node is True
    user.prepare_data_per_node = False  # Lightning reads the user's through trainer.datamodule
    user.allow_zero_length_dataloader_with_multiple_devices = True
    assert dm.prepare_data_per_node is False and dm.allow_zero_length_dataloader_with_multiple_devices is True
    dm.prepare_data_per_node = True
    assert user.prepare_data_per_node is True
    with pytest.raises(AttributeError, match="nor has the UserData it wraps"):
        _ = dm.missing
    with pytest.raises(AttributeError):  # private names are never read from the user's
        _ = dm._private
    with pytest.raises(AttributeError, match="batch_size"):  # the wrapper's property: the user has none
        _ = dm.batch_size


def test_the_wrappers_own_config_is_never_the_users():
    user = UserData()
    dm = CurriculumDataModule(user, metrics={"seqlen_truncate": TRUNC})
    assert isinstance(dm.config, CurriculumConfig) and user.config == {"metrics": "the user's"}
    assert CurriculumDataModule(UserData()).config is None  # metrics on the callback: none of its own
    outer = InfoBatchDataModule(dm)
    assert outer.config is dm.config  # an InfoBatch wrapper outside the curriculum's reads the curriculum's
    assert outer.planner is None and dm.thinner is None and dm.controller is None


def test_a_module_reads_the_wrapped_datamodules_attribute_and_the_checkpoint_holds_its_hparams(tmp_path: Path):
    pl.seed_everything(0)
    dm = CurriculumDataModule(UserData(vocab_size=25, num_classes=4))
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    logger = CSVLogger(tmp_path, name="run")
    trainer = make_trainer(tmp_path, [Curriculum(metrics={"seqlen_truncate": TRUNC}), checkpoint], max_steps=2)
    trainer.logger = logger  # make_trainer's default is no logger
    model = Classifier()
    trainer.fit(model, datamodule=dm)
    assert model.head.out_features == 4
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["datamodule_hyper_parameters"] == {"vocab_size": 25, "num_classes": 4, "batch_size": 4}
    restored = UserData.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert restored.hparams.vocab_size == 25 and restored.num_classes == 4
    logged = yaml.safe_load((Path(logger.log_dir) / "hparams.yaml").read_text())
    assert logged == {"vocab_size": 25, "num_classes": 4, "batch_size": 4}


def test_a_wrapper_subclass_that_saves_its_hyperparameters_keeps_them_its_own():
    """Lightning's ``save_hyperparameters`` updates ``hparams``, the user's DataModule's while the wrapper has none:
    a subclass that saved its own changed the user's and failed (qa81-regress 03)."""

    class Noted(CurriculumDataModule):
        def __init__(self, datamodule: pl.LightningDataModule, note: str = "") -> None:
            super().__init__(datamodule)
            self.save_hyperparameters(ignore=["datamodule"])

    user = UserData()
    dm = Noted(user, note="exp-7")
    assert dm.hparams == {"note": "exp-7"} and dm._log_hyperparams
    assert user.hparams == {"vocab_size": 30, "num_classes": 3, "batch_size": 4}


class ScaledData(UserData):
    """Its loader's collate scales the ids by ``scale`` (1 unless set), read when ``train_dataloader()`` is called;
    ``rows`` (all unless set) cuts the dataset."""

    def train_dataloader(self) -> DataLoader:
        scale, rows = getattr(self, "scale", 1), getattr(self, "rows", 16)
        self.reads = getattr(self, "reads", 0) + 1
        data = self.data if rows == 16 else torch.utils.data.Subset(self.data, range(rows))

        def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
            ids, labels = torch.utils.data.default_collate(samples)
            return ids * scale, labels

        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=True, collate_fn=collate)


class SetsInSetup(Classifier):
    """Hands its DataModule a loader setting in its ``setup`` (``self.trainer.datamodule.<name> = value``), the
    Lightning pattern, and records the largest id of each training batch."""

    def __init__(self, **settings: int) -> None:
        super().__init__()
        self.settings, self.largest = settings, []

    def setup(self, stage: str) -> None:
        for name, value in self.settings.items():
            setattr(self.trainer.datamodule, name, value)
        super().setup(stage)
        self.embed = nn.Embedding(60, 8)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.largest.append(int(batch[0].max()))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("wrapper", ["plain", "curriculum", "infobatch", "both"])
def test_a_loader_setting_the_module_hands_over_in_its_setup_is_trained_with(tmp_path: Path, wrapper: str):
    """The module's ``setup`` runs after the technique's callback read the user's loader: the loader is read again
    after the setting, and the fit trains on it, as without the technique (ids doubled here); the fit trained on the
    loader read before the setting in silence (qa81-break 03). A setting made during training is not read back, as
    without the technique."""

    pl.seed_everything(0)
    user = ScaledData()
    callbacks: list[pl.Callback] = []
    dm: pl.LightningDataModule = user
    if wrapper in ("curriculum", "both"):
        dm = CurriculumDataModule(dm, metrics={"seqlen_truncate": TRUNC})
        callbacks.append(Curriculum())
    if wrapper in ("infobatch", "both"):
        ib = InfoBatchCallback(prune_ratio=0.5, delta=0.75)
        dm, callbacks = ib.wrap_datamodule(dm), [*callbacks, ib]
    model = SetsInSetup(scale=2)
    make_trainer(tmp_path, callbacks, max_epochs=2).fit(model, datamodule=dm)
    assert user.scale == 2 and len(model.largest) >= 4
    assert all(value % 2 == 0 for value in model.largest) and max(model.largest) > 30  # every batch's ids doubled
    reads = user.reads
    dm.scale = 3  # after the fit's setup: the loader is not read again (nor would Lightning read it)
    assert user.scale == 3 and all(w.template() is not None for w in wrapper_chain(dm)[:-1] if w._template is not None)
    assert user.reads == reads


@pytest.mark.parametrize("wrapper", [CurriculumDataModule, InfoBatchDataModule])
def test_a_loader_setting_that_changes_the_samples_after_the_technique_read_them_is_refused(tmp_path, wrapper):
    """A setting from the module's ``setup`` that cuts the dataset (16 to 8 samples) comes after the technique sized
    its per-sample state by the first loader: refused, naming what changed and where to set it."""

    pl.seed_everything(0)
    if wrapper is CurriculumDataModule:
        dm, callback = wrapper(ScaledData(), metrics={"seqlen_truncate": TRUNC}), Curriculum()
    else:
        callback = InfoBatchCallback(prune_ratio=0.5, delta=0.75)
        dm = callback.wrap_datamodule(ScaledData())
    with pytest.raises(
        DataConfigError,
        match=r"your ScaledData's train_dataloader\(\) returned a loader with 8 samples \(was 16\) after",
    ):
        make_trainer(tmp_path, [callback], max_epochs=2).fit(SetsInSetup(rows=8), datamodule=dm)


class RebuiltData(UserData):
    """Builds its dataset anew at each ``train_dataloader()`` call (the same 16 samples), reads ``hparams.scale`` in
    its collate and its own ``collate_fn`` when it has one."""

    def train_dataloader(self) -> DataLoader:
        scale = self.hparams.get("scale", 1)

        def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
            ids, labels = torch.utils.data.default_collate(samples)
            return ids * scale, labels

        data = TensorDataset(*self.data.tensors)  # a new object over the same samples
        size = getattr(self, "batch_size", self.hparams.batch_size)
        return DataLoader(data, batch_size=size, collate_fn=getattr(self, "collate_fn", collate))


class SetsThroughHparams(SetsInSetup):
    def setup(self, stage: str) -> None:
        self.trainer.datamodule.hparams.scale = 2  # a setting handed over by changing the hparams object
        super().setup(stage)


def _double(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids, labels = torch.utils.data.default_collate(samples)
    return ids * 2, labels


@pytest.mark.parametrize("how", ["harmless", "hparams", "collate_fn", "batch_size"])
def test_the_loader_is_read_again_when_the_fit_serves_its_first(tmp_path, how):
    """Whatever way the module's ``setup`` hands the setting over, the first loader served reads the user's again:
    a setting the loader never reads, over a dataset built anew at each call, trains (refused as 'another dataset',
    qa87-break 01); one through the ``hparams`` object is trained with (02); a ``collate_fn`` set through the
    wrapper is the user's (an AttributeError, 04); a ``batch_size`` set there is refused (InfoBatch's checks were
    skipped, 03)."""
    pl.seed_everything(0)
    user = RebuiltData()
    callback = InfoBatchCallback(prune_ratio=0.5, delta=0.75)
    dm = callback.wrap_datamodule(user)
    model = {
        "harmless": SetsInSetup(note=1),
        "hparams": SetsThroughHparams(),
        "collate_fn": SetsInSetup(collate_fn=_double),
        "batch_size": SetsInSetup(batch_size=8),
    }[how]
    if how == "batch_size":
        user.batch_size = 4  # an attribute the wrapper's batch_size reads (as Lightning's tuner does)
        with pytest.raises(DataConfigError, match=r"returned a loader with batch_size=8 \(was 4\)"):
            make_trainer(tmp_path, [callback], max_epochs=2).fit(model, datamodule=dm)
        return
    make_trainer(tmp_path, [callback], max_epochs=2).fit(model, datamodule=dm)
    doubled = all(value % 2 == 0 for value in model.largest) and max(model.largest) > 30
    assert len(model.largest) >= 4 and doubled == (how != "harmless")
