"""Every non-public Lightning call lives in core/compat.py, pinned to the supported Lightning range."""

import re
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
    private = re.compile(r"from lightning[a-z._]* import .*\b_[a-z]|trainer\._|strategy\._")
    offenders = [
        f"{path.relative_to(root)}:{i}"
        for path in sorted(root.rglob("*.py"))
        if path != root / "core" / "compat.py"
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if private.search(line)
    ]
    assert offenders == []
