"""Every non-public Lightning call lives in core/compat.py, pinned to the supported Lightning range."""

import subprocess
from pathlib import Path

import lightning

import lightning_effi
from lightning_effi.core import compat


def test_installed_lightning_is_supported():
    assert compat.lightning_version_supported(), lightning.__version__
    assert not compat.lightning_version_supported("2.7.0")
    assert not compat.lightning_version_supported("2.5.5")


def test_no_private_lightning_access_outside_compat():
    root = Path(lightning_effi.__file__).parent
    out = subprocess.run(
        ["git", "grep", "-nE", r"from lightning[a-z._]* import .*\b_[a-z]|trainer\._|strategy\._", "--", "."],
        cwd=root,
        capture_output=True,
        text=True,
    ).stdout
    offenders = [line for line in out.splitlines() if not line.startswith("core/compat.py")]
    assert offenders == []
