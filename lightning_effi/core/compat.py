"""Every non-public Lightning call lightning_effi makes, in one place, pinned to the supported Lightning range.

The techniques call these functions instead of Lightning internals, so a Lightning upgrade is checked here (and by
``tests/framework/``, which pins the behaviour relied on) rather than in every callback.
"""

from __future__ import annotations

from typing import Any

import lightning
import lightning.pytorch as pl
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy

__all__ = [
    "SUPPORTED_LIGHTNING",
    "lightning_version_supported",
    "optimizers_to_device",
    "rewrap_ddp",
    "uses_distributed_sampler",
]

#: Lightning versions whose non-public APIs are used below (the ``lightning`` requirement in ``pyproject.toml``).
SUPPORTED_LIGHTNING = ">=2.6.1,<2.7"


def lightning_version_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed ``lightning.__version__``) lies in :data:`SUPPORTED_LIGHTNING`."""
    from packaging.specifiers import SpecifierSet

    return (version or lightning.__version__) in SpecifierSet(SUPPORTED_LIGHTNING)


def rewrap_ddp(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Wrap ``pl_module`` in a new ``DistributedDataParallel`` after its parameters changed shape (DDP only).

    Sets ``strategy.model`` to the bare module, then calls ``DDPStrategy.configure_ddp()`` (which asserts that
    ``strategy.model`` is the bare LightningModule). Under DDP every rank must call it at the same step: the new
    wrapper broadcasts rank 0's parameters. Returns whether a DDP strategy was re-wrapped.
    """
    strategy = trainer.strategy
    if not isinstance(strategy, DDPStrategy):
        return False
    strategy.model = pl_module
    strategy.configure_ddp()
    return True


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    """Move every optimizer's state tensors to ``device`` (``lightning.fabric.utilities.optimizer``, non-public)."""
    _optimizers_to_device(optimizers, device)


def uses_distributed_sampler(trainer: pl.Trainer) -> bool:
    """Whether Lightning injects a ``DistributedSampler`` into the training loader
    (``Trainer(use_distributed_sampler)``, read from the trainer's non-public accelerator connector)."""
    return bool(trainer._accelerator_connector.use_distributed_sampler)
