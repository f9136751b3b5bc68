"""Shared pieces of the non-finite loss tests (``lightning_effi.core.nonfinite``): the weights each training step
starts from, the user's own handling of a NaN step, and the check that a stopped step left the weights untouched."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn


class WeightsAtBatchStart(pl.Callback):
    """The module's ``state_dict`` (cloned) at the start of each training batch, by global step: the weights that
    step starts from."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.before[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def zero_nonfinite_grads(module: nn.Module) -> None:
    """The user's own handling of a bad step (call in ``on_before_optimizer_step``): NaN / inf gradients become 0,
    so one NaN step leaves the weights finite."""
    for p in module.parameters():
        if p.grad is not None:
            torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)


def assert_weights_unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    """``module``'s weights equal ``before`` exactly (same keys, same values): the step stopped before its backward."""
    after = module.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, msg=k)
