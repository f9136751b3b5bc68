"""Pins the Lightning 2.6 behaviour the technique callbacks rely on (hook order, loader reloading, mid-epoch resume,
checkpointed callback state, ...). An upgrade that changes one of these facts fails here first; the non-public calls
themselves are all in ``lightning_effi/core/compat.py``."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader, Sampler

QUIET = dict(
    accelerator="cpu",
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    limit_val_batches=0,
)


class Recorder(pl.Callback):
    def __init__(self, log):
        self.events = log

    def setup(self, trainer, pl_module, stage):
        self.events.append("setup")

    def on_fit_start(self, trainer, pl_module):
        self.events.append("on_fit_start")

    def on_train_epoch_start(self, trainer, pl_module):
        self.events.append("on_train_epoch_start")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.events.append("on_train_batch_start")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.events.append("on_train_batch_end")

    def on_train_epoch_end(self, trainer, pl_module):
        self.events.append("on_train_epoch_end")


class LoggingScheduler(torch.optim.lr_scheduler.LambdaLR):
    def __init__(self, optimizer, log, name):
        super().__init__(optimizer, lambda s: 1.0)  # its initial step() is not recorded
        self._log, self._name = log, name

    def step(self, *args, **kwargs):
        if hasattr(self, "_log"):
            self._log.append(self._name)
        return super().step(*args, **kwargs)


def test_hook_order_and_scheduler_timing(tmp_path):
    log: list[str] = []

    class Model(BoringModel):
        def configure_optimizers(self):
            log.append("configure_optimizers")
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [
                {"scheduler": LoggingScheduler(opt, log, "sched_step"), "interval": "step"},
                {"scheduler": LoggingScheduler(opt, log, "sched_epoch"), "interval": "epoch"},
            ]

    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        callbacks=[Recorder(log)],
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        **QUIET,
    )
    trainer.fit(Model())
    assert log[:3] == ["setup", "configure_optimizers", "on_fit_start"]
    body = log[log.index("on_train_epoch_start") :]
    assert body == [
        "on_train_epoch_start",
        "on_train_batch_start",
        "sched_step",
        "on_train_batch_end",
        "on_train_batch_start",
        "sched_step",
        "sched_epoch",
        "on_train_batch_end",
        "on_train_epoch_end",
    ]


def test_empty_callback_state_is_never_loaded_and_state_arrives_deep_copied(tmp_path):
    calls = []

    class Empty(pl.Callback):
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            calls.append("empty")

    class Full(pl.Callback):
        state = {"x": [1, 2]}

        def state_dict(self):
            return self.state

        def load_state_dict(self, state):
            calls.append(state is not self.state and state == self.state)

    kw = dict(max_steps=2, default_root_dir=tmp_path, **QUIET)
    trainer = pl.Trainer(callbacks=[Empty(), Full()], **kw)
    trainer.fit(BoringModel())
    ckpt = tmp_path / "x.ckpt"
    trainer.save_checkpoint(ckpt)
    pl.Trainer(callbacks=[Empty(), Full()], **{**kw, "max_steps": 3}).fit(BoringModel(), ckpt_path=ckpt)
    assert calls == [True]


class LengthSampler(Sampler):
    """Yields 0..n-1 where n follows the epoch: ``lengths[epoch]``."""

    def __init__(self, lengths):
        self.lengths, self.epoch = lengths, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.lengths[min(self.epoch, len(self.lengths) - 1)]

    def __iter__(self):
        return iter(range(len(self)))


@pytest.mark.parametrize("reload, expected", [(False, [10, 10]), (True, [10, 15])])
def test_length_caching_and_reload_attribute(tmp_path, reload, expected):
    batches: list[int] = []
    sampler = LengthSampler([100, 150])
    epochs_seen: list[int] = []

    class Model(BoringModel):
        def train_dataloader(self):  # the reload happens before set_epoch, with current_epoch already advanced
            epochs_seen.append(self.trainer.current_epoch)
            sampler.set_epoch(self.trainer.current_epoch)
            return DataLoader(RandomDataset(32, 200), batch_size=10, sampler=sampler)

        def on_train_epoch_start(self):
            batches.append(0)

        def training_step(self, batch, batch_idx):
            batches[-1] += 1
            return super().training_step(batch, batch_idx)

    class SetReload(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            if reload:
                trainer.reload_dataloaders_every_n_epochs = 1

    trainer = pl.Trainer(
        max_epochs=2, callbacks=[SetReload()], default_root_dir=tmp_path, enable_checkpointing=False, **QUIET
    )
    trainer.fit(Model())
    assert batches == expected
    assert epochs_seen == ([0, 1] if reload else [0])


def test_estimated_stepping_batches(tmp_path):
    class Model(BoringModel):
        def train_dataloader(self):
            return DataLoader(RandomDataset(32, 100), batch_size=10)

    t = pl.Trainer(max_epochs=4, accumulate_grad_batches=3, default_root_dir=tmp_path, **QUIET)
    t.fit(Model())
    assert t.estimated_stepping_batches == math.ceil(10 / 3) * 4 == 16
    t = pl.Trainer(max_epochs=4, max_steps=7, accumulate_grad_batches=3, default_root_dir=tmp_path, **QUIET)
    t.fit(Model())
    assert t.estimated_stepping_batches == 7


def test_batch_edits_in_place_and_the_loss_channel(tmp_path):
    seen = {}

    class Model(BoringModel):
        def train_dataloader(self):
            return DataLoader([{"x": torch.randn(32)} for _ in range(4)], batch_size=2)

        def training_step(self, batch, batch_idx):
            seen["edited"] = batch.get("edited", False)
            out = self.layer(batch["x"])
            per_sample = out.pow(2).mean(1)
            return {"loss": per_sample.mean(), "per_sample_loss": per_sample, "index": torch.tensor([0, 1])}

    class Edit(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batch["edited"] = True

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["requires_grad"] = outputs["per_sample_loss"].requires_grad
            seen["loss_detached"] = not outputs["loss"].requires_grad
            seen["index"] = outputs["index"].tolist()

    pl.Trainer(max_steps=1, callbacks=[Edit()], default_root_dir=tmp_path, enable_checkpointing=False, **QUIET).fit(
        Model()
    )
    assert seen == {"edited": True, "requires_grad": True, "loss_detached": True, "index": [0, 1]}


def test_mid_epoch_resume_of_a_plain_loader_replays_the_epoch_head(tmp_path):
    """Acceptance test 17: a plain loader resumed after 4 of 10 batches runs batch_idx 4..9 on the data of loader
    batches 0..5 (why lightning_effi's train loaders are ResumableDataLoader)."""
    data = [torch.full((32,), float(i)) for i in range(10)]
    seen: list[tuple[int, float]] = []

    class Model(BoringModel):
        def train_dataloader(self):
            return DataLoader(data, batch_size=1, shuffle=False)

        def training_step(self, batch, batch_idx):
            seen.append((batch_idx, float(batch[0, 0])))
            return super().training_step(batch, batch_idx)

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    pl.Trainer(max_epochs=1, callbacks=[ckpt], default_root_dir=tmp_path, **QUIET).fit(Model())
    seen.clear()
    pl.Trainer(max_epochs=1, default_root_dir=tmp_path, **QUIET).fit(Model(), ckpt_path=tmp_path / "step=4.ckpt")
    assert seen == [(i, float(i - 4)) for i in range(4, 10)]
