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


class SavingDataModule(pl.LightningDataModule):
    """A user's DataModule as Lightning's docs teach it: ``save_hyperparameters()``, then its settings read from
    ``self.hparams`` in ``setup``."""

    def __init__(self, n: int = 16, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        from tests.helpers.tiny import TokenBlocks

        self.train_dataset = TokenBlocks(n=self.hparams.n)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.train_dataset, batch_size=self.hparams.batch_size, shuffle=True)


def per_sample_cross_entropy(outputs, batch):  # unannotated, as users write it (and the README's lambda)
    """A per-sample loss function named in YAML by its import path."""
    return outputs["per_sample_loss"]


class SeededLM(pl.LightningModule):
    """A user's module that records its ``seed`` and ``num_epochs`` as hyperparameters (names a technique wrapper's
    options share)."""

    def __init__(self, seed: int = 1, num_epochs: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        return torch.nn.functional.cross_entropy(self.head(self.embed(ids)).flatten(0, 1), ids.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)
