"""Every non-public Lightning call lives in core/compat.py, pinned to the supported Lightning range."""

import ast
import importlib.metadata
from pathlib import Path

import lightning
from packaging.specifiers import SpecifierSet

import lightning_effi
from lightning_effi.core import compat


def test_installed_lightning_is_supported():
    assert compat.lightning_version_supported(), lightning.__version__
    assert not compat.lightning_version_supported("2.7.0")
    assert not compat.lightning_version_supported("2.5.5")


def _private_lightning_uses(source: str) -> list[int]:
    """Lines that import a private name from lightning or read a private attribute of a trainer or strategy."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        module = getattr(node, "module", None) or ""
        if isinstance(node, ast.ImportFrom) and (module == "lightning" or module.startswith("lightning.")):
            if any(alias.name.startswith("_") for alias in node.names) or "._" in f".{node.module}":
                lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("trainer", "strategy", "fit_loop", "epoch_loop"):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_private_use_finder_sees_wrapped_imports():
    source = "from lightning.fabric.utilities.optimizer import (\n    a,\n    _b,\n)\nx = self.trainer._c\n"
    assert _private_lightning_uses(source) == [1, 5]


def test_no_private_lightning_access_outside_compat():
    root = Path(lightning_effi.__file__).parent
    offenders = {
        str(path.relative_to(root)): found
        for path in sorted(root.rglob("*.py"))
        if path != root / "core" / "compat.py" and (found := _private_lightning_uses(path.read_text(encoding="utf-8")))
    }
    assert offenders == {}


def test_supported_range_is_the_declared_requirement():
    requirement = next(r for r in importlib.metadata.requires("lightning-effi") if r.startswith("lightning"))
    assert SpecifierSet(requirement.removeprefix("lightning")) == SpecifierSet(compat.SUPPORTED_LIGHTNING)
