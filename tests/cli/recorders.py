"""A callback that records what each training step saw, named by ``class_path`` in the CLI tests' YAML."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


class Batches(pl.Callback):
    """Per training batch: the shape of ``batch["input_ids"]`` (samples, tokens), and the width and depth
    (``model.config.n_embd``, ``n_layer``) of the model that computed its loss (read before the backward, so after
    any technique changed the model for this step)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.sizes: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.shapes.append(tuple(batch["input_ids"].shape))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        config = pl_module.model.config
        self.sizes.append((config.n_embd, config.n_layer))
