"""Shared fixtures of the data-layer tests: a session-wide cache directory and the real datasets.

The session cache directory and ``data_root`` come from ``tests/conftest.py``. Expensive preparation (the one
CIFAR-10 decode, tokenizer training) happens once per session.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cifar_dm(data_root):
    """CIFAR-10 DataModule on the shared archive, decoded once per session (~15-30 s)."""
    from lightning_effi.data import CIFAR10DataModule

    dm = CIFAR10DataModule(data_root / "cifar10", num_workers=0, batch_size=32)
    dm.prepare_data()
    dm.setup("fit")
    return dm


@pytest.fixture(scope="session")
def shakespeare(data_root) -> Path:
    return data_root / "tinyshakespeare" / "input.txt"
