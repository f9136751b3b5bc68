"""Every config composes and instantiates; every experiment runs with fast_dev_run (lightning-hydra-template's
``tests/test_configs.py`` and ``tests/test_sweeps.py``)."""

import json

import hydra
import lightning.pytorch as pl
import pytest
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger

from lightning_effi.train import build, run
from lightning_effi.utils.instantiate import instantiate_callbacks, instantiate_loggers
from tests.helpers.hydra import CONF, compose_train

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


def test_a_null_entry_switches_a_callback_or_logger_off_and_a_scalar_is_refused_by_name(tmp_path):
    """``callbacks.efficiency=null`` crashed while formatting its own error (OmegaConf's to_yaml on None)."""
    from lightning_effi.utils.instantiate import ConfigError

    cfg = compose_train(["callbacks.efficiency=null", "logger=csv"], tmp_path)
    names = [type(c).__name__ for c in instantiate_callbacks(cfg.callbacks)]
    assert "EfficiencyMonitor" not in names and "ModelCheckpoint" in names
    cfg = compose_train(["callbacks.lr_monitor=5"], tmp_path)
    with pytest.raises(
        ConfigError, match=r"^callbacks\.lr_monitor: expected a config with a _target_, got '5' \(null or"
    ):
        instantiate_callbacks(cfg.callbacks)
    cfg = compose_train(["logger=csv", "logger.csv=null"], tmp_path)
    assert instantiate_loggers(cfg.logger) == []


@pytest.mark.parametrize("name", GROUP_FILES["trainer"])
def test_trainer_configs_compose(name, tmp_path):
    cfg = compose_train([f"trainer={name}"], tmp_path, fast=False)
    assert cfg.trainer._target_ == "lightning.pytorch.Trainer"
    if name in ("cpu", "ddp", "ddp_sim"):  # no GPU here: only the CPU ones can be built
        trainer = hydra.utils.instantiate(cfg.trainer)
        assert isinstance(trainer, pl.Trainer) and trainer.num_devices == (2 if "ddp" in name else 1)


@pytest.mark.parametrize("name", GROUP_FILES["experiment"])
def test_every_experiment_builds_and_runs_with_fast_dev_run(name, tmp_path):
    """Each experiment composes, builds its model and Trainer, and runs one batch of fit and validation
    (``fast_dev_run``) through the app, writing its record (a multirun through the script:
    ``tests/test_train.py::test_multirun_sweep_writes_one_result_per_job``)."""
    overrides = [f"experiment={name}", "++trainer.fast_dev_run=true", "trainer.accelerator=cpu", "data.num_workers=0"]
    cfg = compose_train(overrides, tmp_path, fast=False)
    _, model, trainer = build(cfg)
    assert isinstance(model, pl.LightningModule) and isinstance(trainer, pl.Trainer)
    assert cfg.task_name == name
    result = run(cfg)
    assert result["task_name"] == name and result["efficiency"]["optimizer_steps"] == 1
    assert json.loads((tmp_path / "result.json").read_text())["task_name"] == name


def test_the_reports_advice_for_labelling_a_run_works_in_the_app(tmp_path):
    """The report's duplicate-run error says how to label a variant (``LABEL_HOW``): ``arm`` is a config group, so
    ``+arm=<name>`` is refused by Hydra; a file ``arm/<name>.yaml`` (here in the user's own config folder, added
    with ``hydra.searchpath``) picked with ``arm=<name>`` sets the label."""
    from lightning_effi.report.table import LABEL_HOW

    assert "conf/arm/<name>.yaml holding '# @package _global_' and 'arm: <name>', picked with arm=<name>" in LABEL_HOW
    (tmp_path / "conf" / "arm").mkdir(parents=True)
    (tmp_path / "conf" / "arm" / "lr_3e-3.yaml").write_text("# @package _global_\narm: lr_3e-3\n")
    cfg = compose_train([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "arm=lr_3e-3"], tmp_path / "out")
    assert cfg.arm == "lr_3e-3" and cfg.budget == 1.0


def test_the_launch_folder_is_hydras_origin_in_a_job_it_moved_into(tmp_path, monkeypatch):
    """paths.root_dir (${effi_cwd:}) is the folder the app was launched from; under hydra.job.chdir=true the job's
    own folder was taken for it, and the data path pointed into the run (qa106-break 07)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from lightning_effi.utils.instantiate import launch_folder

    monkeypatch.chdir(tmp_path)
    cfg = compose_train([], tmp_path)
    try:
        OmegaConf.set_readonly(cfg.hydra, False)
        with open_dict(cfg):
            cfg.hydra.runtime.cwd = "/the/launch/folder"
            cfg.hydra.job.chdir = False
        HydraConfig.instance().set_config(cfg)
        assert launch_folder() == str(tmp_path)  # not moved: the working folder
        OmegaConf.set_readonly(cfg.hydra, False)
        with open_dict(cfg):
            cfg.hydra.job.chdir = True
        HydraConfig.instance().set_config(cfg)
        assert launch_folder() == "/the/launch/folder"
        assert OmegaConf.create({"root": "${effi_cwd:}"}).root == "/the/launch/folder"
        # chdir unset, and the working folder the job's (Hydra 1.1's defaults: an app without version_base moves
        # into it; qa107-regress 01)
        OmegaConf.set_readonly(cfg.hydra, False)
        with open_dict(cfg):
            cfg.hydra.job.chdir = None
            cfg.hydra.runtime.output_dir = str(tmp_path)
        HydraConfig.instance().set_config(cfg)
        assert launch_folder() == "/the/launch/folder"
        OmegaConf.set_readonly(cfg.hydra, False)
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(tmp_path / "elsewhere")
        HydraConfig.instance().set_config(cfg)
        assert launch_folder() == str(tmp_path)  # not moved
    finally:
        HydraConfig.instance().cfg = None  # type: ignore[assignment]
    assert launch_folder() == str(tmp_path)
