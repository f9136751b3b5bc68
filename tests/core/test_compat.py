"""Every non-public Lightning call lives in core/compat.py, pinned to the supported Lightning range."""

import ast
import importlib.metadata
import math
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from packaging.specifiers import SpecifierSet
from torch.optim.lr_scheduler import LambdaLR

import lightning_effi
from lightning_effi.core import compat
from lightning_effi.reference.tasks.language_models import GPT2CausalLM
from tests.harness.settings import seeded
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TINY_GPT2, TinyDataModule, TokenBlocks


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


class _RebuildOnFitStart(pl.Callback):
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        compat.rebuild_train_loader_after_restore(trainer)


def _estimated_cosine_model() -> pl.LightningModule:
    """The tiny GPT-2 with a step cosine LambdaLR sized from ``trainer.estimated_stepping_batches``."""

    class Estimated(GPT2CausalLM):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            total = int(self.trainer.estimated_stepping_batches)
            cosine = lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total))  # noqa: E731
            return {"optimizer": opt, "lr_scheduler": {"scheduler": LambdaLR(opt, cosine), "interval": "step"}}

    return seeded(lambda: Estimated(**TINY_GPT2))()


def _fit(root: Path, callbacks: list[pl.Callback], ckpt_path: Path | None = None) -> dict[str, torch.Tensor]:
    pl.seed_everything(0)
    model = _estimated_cosine_model()
    trainer = make_trainer(root, callbacks, max_epochs=2)
    trainer.fit(model, datamodule=TinyDataModule(TokenBlocks(n=24, seq_len=16), batch_size=4), ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("rebuild", [False, True])
def test_rebuild_train_loader_after_restore(tmp_path: Path, rebuild: bool) -> None:
    """Pins Lightning issue #20550 and the workaround: with ``estimated_stepping_batches`` read in
    ``configure_optimizers``, a fit resumed in the middle of epoch 0 (step 2 of 6) keeps the loader built before the
    restore and replays the epoch from its start (other weights than the uninterrupted fit); dropping that loader in
    ``on_fit_start`` makes the resume exact. A fresh fit drops nothing."""
    extra: list[pl.Callback] = [_RebuildOnFitStart()] if rebuild else []
    every = ModelCheckpoint(tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    whole = _fit(tmp_path / "whole", [every, *extra])
    resumed = _fit(tmp_path / "resumed", list(extra), ckpt_path=tmp_path / "ckpts" / "step=2.ckpt")
    same = all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert same is rebuild
    fresh = make_trainer(tmp_path / "fresh", max_epochs=1)
    assert compat.rebuild_train_loader_after_restore(fresh) is False


def test_a_run_without_a_technique_resumes_exactly_with_the_efficiency_monitor(tmp_path: Path) -> None:
    """A baseline (no technique, only the EfficiencyMonitor, as every frontier baseline of the Hydra app) with a
    schedule sized by ``estimated_stepping_batches``, resumed mid-epoch: the monitor rebuilds the loader, so the fit
    ends with the uninterrupted weights (before, the epoch was replayed from its start, silently)."""
    from lightning_effi.core.accounting import EfficiencyMonitor

    every = ModelCheckpoint(tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    whole = _fit(tmp_path / "whole", [every, EfficiencyMonitor(print_summary=False)])
    resumed = _fit(tmp_path / "resumed", [EfficiencyMonitor(print_summary=False)], tmp_path / "ckpts" / "step=2.ckpt")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
