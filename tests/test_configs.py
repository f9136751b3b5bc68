"""Every config composes and instantiates; every experiment runs with fast_dev_run (lightning-hydra-template's
``tests/test_configs.py`` and ``tests/test_sweeps.py``)."""

from pathlib import Path

import hydra
import lightning.pytorch as pl
import pytest
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger

from lightning_effi.train import build
from lightning_effi.utils.instantiate import instantiate_callbacks, instantiate_loggers
from tests.helpers.hydra import CONF, compose_train, run_train_script

GROUP_FILES = {
    g: sorted(p.stem for p in (CONF / g).glob("*.yaml"))
    for g in ("data", "model", "trainer", "callbacks", "logger", "experiment", "debug")
}


def test_every_group_has_configs():
    assert set(GROUP_FILES["experiment"]) >= {
        "gpt_stdlib",
        "gpt_shakespeare",
        "cifar10_cnn",
        "cifar10_vit",
        "sst2_bert",
        "mlm_bert",
    }
    assert set(GROUP_FILES["trainer"]) >= {"cpu", "gpu", "ddp", "ddp_sim"}


@pytest.mark.parametrize("name", GROUP_FILES["callbacks"])
def test_callback_configs_instantiate(name, tmp_path):
    cfg = compose_train([f"callbacks={name}"], tmp_path)
    callbacks = instantiate_callbacks(cfg.get("callbacks"))
    assert all(isinstance(c, Callback) for c in callbacks)
    assert (len(callbacks) == 0) == (name == "none")


@pytest.mark.parametrize("name", GROUP_FILES["logger"])
def test_logger_configs_instantiate(name, tmp_path):
    loggers = instantiate_loggers(compose_train([f"logger={name}"], tmp_path).logger)
    assert loggers and all(isinstance(lg, Logger) for lg in loggers)


@pytest.mark.parametrize("name", GROUP_FILES["trainer"])
def test_trainer_configs_compose(name, tmp_path):
    cfg = compose_train([f"trainer={name}"], tmp_path, fast=False)
    assert cfg.trainer._target_ == "lightning.pytorch.Trainer"
    if name in ("cpu", "ddp", "ddp_sim"):  # no GPU here: only the CPU ones can be built
        trainer = hydra.utils.instantiate(cfg.trainer)
        assert isinstance(trainer, pl.Trainer) and trainer.num_devices == (2 if "ddp" in name else 1)


@pytest.mark.parametrize("name", GROUP_FILES["experiment"])
def test_experiments_build(name, tmp_path):
    cfg = compose_train([f"experiment={name}"], tmp_path)
    datamodule, model, trainer = build(cfg)
    assert isinstance(model, pl.LightningModule) and isinstance(trainer, pl.Trainer)
    assert cfg.task_name == name


@pytest.mark.slow
def test_every_experiment_runs_with_fast_dev_run(tmp_path: Path):
    proc = run_train_script(
        ["-m", "experiment=glob(*)", "++trainer.fast_dev_run=true", "trainer.accelerator=cpu", "data.num_workers=0"],
        tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted(tmp_path.glob("logs/*/multiruns/*/*/result.json"))
    assert len(results) == len(GROUP_FILES["experiment"]), proc.stdout[-2000:]
