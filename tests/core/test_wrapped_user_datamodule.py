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

from lightning_effi.callbacks import Curriculum
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
