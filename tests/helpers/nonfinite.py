"""Shared pieces of the non-finite loss tests (``lightning_effi.core.nonfinite``): a tiny GPT-2 whose loss is NaN at
chosen steps, the weights each training step starts from, the user's own handling of a NaN step, and the check that a
stopped step left the weights untouched."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_effi.tasks import GPT2CausalLM
from tests.helpers.tiny import TINY_GPT2, sgd


class PoisonedGPT2(GPT2CausalLM):
    """A tiny seeded GPT-2 (``TINY_GPT2``, SGD) whose training loss is NaN at the global steps ``nan_steps``.

    Args:
        nan_steps: the global steps whose loss (and per-sample loss) is multiplied by NaN.
        plain_loss: ``training_step`` returns the loss tensor alone, as a user's module does (InfoBatch then computes
            the per-sample loss itself); else the task's ``{"loss", "per_sample_loss"}``.
        clean_grads: the user's own handling: non-finite gradients zeroed before each optimizer step, so that one
            NaN step leaves the weights finite.
    """

    def __init__(self, nan_steps: tuple[int, ...] = (), plain_loss: bool = False, clean_grads: bool = False) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            super().__init__(**TINY_GPT2, optimizer=sgd)
        self.nan_steps, self.plain_loss, self.clean_grads = set(nan_steps), plain_loss, clean_grads

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        scale = math.nan if self.global_step in self.nan_steps else 1.0
        if self.plain_loss:
            return out["loss"] * scale
        return {"loss": out["loss"] * scale, "per_sample_loss": out["per_sample_loss"] * scale}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.clean_grads:
            zero_nonfinite_grads(self)


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
