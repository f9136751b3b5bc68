"""Session fixtures shared by all tests: one cache directory for the session (also seen by subprocesses), and the
real datasets under ``<repo>/../shared/data`` (read-only, never downloaded; tests needing them skip if absent)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (the default, see pyproject.toml) each worker is one of several processes sharing the cores:
    # one intra-op thread each, also for the subprocesses and DDP ranks the tests start. Oversubscribed OpenMP
    # threads made the suite slower than one process.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

DATA_ROOT = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def offline_loggers():
    """Weights & Biases offline and MLflow without telemetry for the whole session (subprocesses inherit it): no
    test may reach the network."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        mp.setenv("DO_NOT_TRACK", "1")
        yield


@pytest.fixture(scope="session", autouse=True)
def effi_cache_dir(tmp_path_factory) -> Path:
    """``EFFI_CACHE_DIR`` for the whole session, inherited by subprocesses. An existing ``EFFI_CACHE_DIR`` is kept
    (reuse a warm cache with ``EFFI_CACHE_DIR=... pytest``)."""
    if os.environ.get("EFFI_CACHE_DIR"):
        yield Path(os.environ["EFFI_CACHE_DIR"])
        return
    path = tmp_path_factory.mktemp("effi_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EFFI_CACHE_DIR", str(path))
        yield path


@pytest.fixture(autouse=True)
def no_hydra_state_left():
    """Clear Hydra's process-wide state after each test: a test that composes a config sets ``HydraConfig`` (for
    ``${hydra:...}``), and a later test in the same worker then ran as if inside a Hydra job (a ``ResultWriter``
    wrote into the earlier test's job folder)."""
    yield
    if "hydra.core.hydra_config" in sys.modules:
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().cfg = None  # type: ignore[assignment]
        GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def data_root() -> Path:
    if not DATA_ROOT.is_dir():
        pytest.skip(f"shared datasets not found at {DATA_ROOT}")
    return DATA_ROOT
