"""Compose the project's Hydra config in tests (lightning-hydra-template ``tests/conftest.py``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
DATA_DIR = ROOT.parent / "shared" / "data"
TRAIN_SCRIPT = ROOT / "experiments" / "train.py"


FAST = {
    "trainer.accelerator": "cpu",
    "trainer.devices": 1,
    "trainer.max_epochs": 1,
    "trainer.limit_train_batches": 3,
    "trainer.limit_val_batches": 2,
    "trainer.limit_test_batches": 2,
    "trainer.num_sanity_val_steps": 0,
    "trainer.enable_progress_bar": False,
    "data.num_workers": 0,
}


def compose_train(overrides: Sequence[str], out_dir: Path, fast: bool = True) -> DictConfig:
    """Compose ``conf/train.yaml`` with ``overrides``; outputs go to ``out_dir``; with ``fast``: CPU, one epoch,
    few batches, no workers (the template's test defaults)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(out_dir)
        cfg.hydra.runtime.cwd = str(ROOT)
        cfg.hydra.job.num = 0
        cfg.paths.data_dir = str(DATA_DIR)
        if fast:  # test defaults, unless an override sets the key
            given = {o.lstrip("+~").split("=")[0] for o in overrides}
            for key, value in FAST.items():
                group, name = key.split(".")
                if key not in given:
                    cfg[group][name] = value
    HydraConfig.instance().set_config(cfg)
    return cfg


def run_train_script(args: Sequence[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``experiments/train.py`` in a subprocess (outputs under ``cwd``); returns the completed process."""
    flags = [a for a in args if a.startswith("-")]  # Hydra flags (-m) go before the overrides
    overrides = [a for a in args if not a.startswith("-")]
    cmd = [sys.executable, str(TRAIN_SCRIPT), *flags, f"paths.data_dir={DATA_DIR}", *overrides]  # root_dir: the cwd
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
