"""The V-cycle stacked with other techniques: random-LTD follows every level change (GPT-2 and ViT, exact resume at a
coarse level, DDP); the stages stay on time when another technique shortens the epochs (a progress clock, tested with
a stand-in for InfoBatch that shortens epochs the same way); a run cut short goes back up to the full model; the
curriculum's sequence-length truncation with random-LTD (no drop when a batch is not longer than the reserved
length, both metrics logged at the same steps, a ``min_value`` that would never drop refused)."""

from __future__ import annotations

import csv
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import Subset

from lightning_effi.callbacks import Curriculum, InfoBatchCallback, RandomLTDCallback, VCycleCallback
from lightning_effi.core.accounting import EfficiencyMonitor
from lightning_effi.core.loader import EpochShuffleSampler, ResumableDataLoader
from lightning_effi.core.progress import PROGRESS_TICKS
from lightning_effi.core.protocols import FollowsModelChanges, PlansModelChanges, ProvidesProgressClock
from lightning_effi.data import CurriculumDataModule
from lightning_effi.functional import random_ltd as F
from lightning_effi.functional import vcycle as V
from lightning_effi.infobatch.data import InfoBatchDataModule
from lightning_effi.models.vcycle_base import find_vcycle_adapter
from lightning_effi.random_ltd import is_converted
from lightning_effi.tasks import ImageClassifier
from tests.harness.settings import MONITOR_TIMES
from tests.helpers.harness import assert_resume_equals_uninterrupted, fit_ddp, make_trainer
from tests.helpers.tiny import TinyDataModule, TokenBlocks, sgd, tiny_gpt2, tiny_image_data, tiny_lm_data


def gpt2_6(**kw: Any) -> pl.LightningModule:
    """6 layers × 32 (2 heads): level 2 is 3 layers × 16, where the default LTD layers are [1]."""
    return tiny_gpt2(n_layer=6, **kw)


def vit_6(**kw: Any) -> ImageClassifier:
    """timm ViT, 6 blocks × 32, 16 patches + the class token (17 tokens): level 2 is 3 blocks × 16."""
    kwargs = dict(img_size=32, patch_size=8, depth=6, embed_dim=32, num_heads=2)
    return ImageClassifier("vit_tiny_patch16_224", model_kwargs=kwargs, optimizer=sgd, **kw)


def depth_of(pl_module: pl.LightningModule) -> int:
    net = pl_module.model
    return len(net.blocks) if hasattr(net, "blocks") else len(net.transformer.h)


def layers_of(pl_module: pl.LightningModule) -> list[torch.nn.Module]:
    net = pl_module.model
    return list(net.blocks) if hasattr(net, "blocks") else list(net.transformer.h)


class LTDProbe(Callback):
    """Per training batch: at its start, the layers random-LTD has patched and the network's layers; at its end, the
    reserved length, the shapes the LTD layers saw, the drawn indices and the consumed layer-tokens."""

    def __init__(self, ltd: RandomLTDCallback) -> None:
        self.ltd, self.rows = ltd, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        patched = self.ltd.patched.layers if self.ltd.patched is not None else []
        layers = layers_of(pl_module)
        self.rows.append(
            {
                "step": trainer.global_step,
                "depth": len(layers),
                "patched": [layers.index(p) if p in layers else None for p in patched],
                "really_patched": [i for i, m in enumerate(layers) if "forward" in vars(m)],
            }
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        idx = self.ltd.controller.last_indices()
        self.rows[-1].update(
            r=self.ltd.current_value,
            records=[(r.batch_size, r.seq_len, r.reserved_length) for r in self.ltd.controller.records],
            drawn=None if idx is None else tuple(idx.shape),
            consumed=self.ltd.consumed_layer_tokens,
        )


LTD = dict(min_value=4, require_steps=6, seq_per_step=4, seed=7)


def ltd_cb(**kw: Any) -> RandomLTDCallback:
    return RandomLTDCallback(**{**LTD, **kw})


def fit(callbacks, model, data, root, **kw) -> pl.Trainer:
    trainer = make_trainer(Path(root), callbacks, **{"max_epochs": -1, **kw})
    trainer.fit(model, datamodule=data)
    return trainer


# ------------------------------------------------------------------------------------------------ V-cycle + random-LTD
CASES = {
    "gpt2": (gpt2_6, tiny_lm_data, dict(max_value=16), 16),
    "vit": (vit_6, tiny_image_data, dict(keep_prefix_tokens="auto"), 17),
}


@pytest.mark.parametrize("case", CASES)
def test_random_ltd_follows_every_level_change(tmp_path, case):
    """2 levels (e_a 2, e_small 3, 8 steps): the LTD layers are those of the network in place at every step (4 of
    the full 6, 1 of the coarse 3), the reserved length per step is random-LTD's alone, the layer-tokens count the
    layers each step's network has, and the run ends on the full model, unpatched."""
    build, data, kw, seq = CASES[case]
    pl.seed_everything(0)
    model = build()
    full = model.model
    ltd = ltd_cb(**kw)
    probe = LTDProbe(ltd)
    vc = VCycleCallback(e_a=2, e_small=3)
    trainer = fit([vc, ltd, probe], model, data(), tmp_path / "stack", max_steps=8)
    assert trainer.global_step == 8 and vc.switches == 2 and vc.level == 1
    depths = [row["depth"] for row in probe.rows]
    assert depths == [6, 6, 3, 3, 3, 6, 6, 6]
    for row in probe.rows:
        expected = list(range(1, row["depth"] - 1))  # the default: all but the first and the last
        assert row["patched"] == row["really_patched"] == expected
    assert [len(row["patched"]) for row in probe.rows] == [4, 4, 1, 1, 1, 4, 4, 4]

    pl.seed_everything(0)  # random-LTD alone on the same model and data
    alone = ltd_cb(**kw)
    alone_probe = LTDProbe(alone)
    fit([alone, alone_probe], build(), data(), tmp_path / "alone", max_steps=8)
    reserved = [row["r"] for row in probe.rows]
    assert reserved == [row["r"] for row in alone_probe.rows] == [F.ltd_value(s, 4, seq, 6, 4) for s in range(8)]

    total = 0
    for row in probe.rows:
        ((batch, seq_len, r),) = row["records"]
        assert seq_len == seq and r == min(row["r"], seq)
        n_ltd = row["depth"] - 2
        if r < seq_len:
            assert row["drawn"] == (n_ltd, batch, r)  # the coarse level drops tokens too
        total += F.layer_tokens(batch, seq_len, r, row["depth"], n_ltd)
        assert row["consumed"] == total
    assert ltd.consumed_layer_tokens == total
    assert ltd.full_layer_tokens == sum(8 * seq * d for d in depths)
    assert model.model is full and depth_of(model) == 6 and not is_converted(model)


def test_three_levels_and_explicit_layer_ids(tmp_path):
    """3 levels (8 → 4 → 2 layers) with explicit layer_ids [0, 1]: kept as given at every level."""
    pl.seed_everything(0)
    model = tiny_gpt2(n_layer=8, n_head=4)
    ltd = ltd_cb(max_value=16, layer_ids=[0, 1])
    probe = LTDProbe(ltd)
    vc = VCycleCallback(levels=3, e_a=1, e_small=2, up_leg=1)
    fit([vc, ltd, probe], model, tiny_lm_data(), tmp_path, max_steps=6)
    assert [row["depth"] for row in probe.rows] == [8, 4, 2, 2, 4, 8]
    assert all(row["patched"] == row["really_patched"] == [0, 1] for row in probe.rows)
    total = sum(F.layer_tokens(8, 16, min(row["r"], 16), row["depth"], 2) for row in probe.rows)
    assert ltd.consumed_layer_tokens == total and vc.level == 1 and not is_converted(model)


@pytest.mark.parametrize("order", ["vcycle_first", "random_ltd_first"])
def test_layer_ids_missing_at_a_coarse_level_fail_at_setup(tmp_path, order):
    """Explicit ids beyond a coarse level's depth are refused in setup (either setup order: random-LTD asks the
    V-cycle for every level's depth), before any step and with nothing patched; so is the default on a full model of
    2 layers (it would select none at every level)."""
    for layer_ids, n_layer, match in (
        ([3, 4], 6, r"layer_ids=\[3, 4\]: VCycleCallback trains a network of 3 layers at level 2 .*\[6, 3\].*below 3"),
        ([1, 2], 4, r"layer_ids=\[1, 2\]: VCycleCallback trains a network of 2 layers at level 2 .*\[4, 2\].*below 2"),
        (None, 2, r"layer_ids: the model has 2 layers, so the default .* selects none"),
    ):
        vc, ltd = VCycleCallback(e_a=2, e_small=3), ltd_cb(max_value=16, layer_ids=layer_ids)
        model = tiny_gpt2(n_layer=n_layer)
        trainer = make_trainer(tmp_path, [vc, ltd] if order == "vcycle_first" else [ltd, vc], max_steps=8)
        with pytest.raises(ValueError, match=match):
            trainer.fit(model, datamodule=tiny_lm_data())
        assert trainer.global_step == 0 and not is_converted(model) and depth_of(model) == n_layer


@pytest.mark.parametrize("order", ["vcycle_first", "random_ltd_first"])
def test_default_layer_ids_pause_at_a_two_layer_level(tmp_path, order, caplog):
    """GPT-2 of 4 layers, coarse level of 2: the default ids pause random-LTD there (announced once at setup): nothing
    is patched or dropped at the coarse level, its steps count their full layer-tokens (the EfficiencyMonitor's
    too), ``effi/random_ltd/ltd_layers`` logs 2, 2, 0, 0, 0, 2, 2, 2, and the run ends on the full model, unpatched."""
    pl.seed_everything(0)
    model = tiny_gpt2(n_layer=4)
    vc, ltd, monitor = VCycleCallback(e_a=2, e_small=3), ltd_cb(max_value=16), EfficiencyMonitor(print_summary=False)
    probe, logger = LTDProbe(ltd), CSVLogger(tmp_path, name="log")
    stack = [vc, ltd] if order == "vcycle_first" else [ltd, vc]
    with caplog.at_level(logging.INFO):
        trainer = fit([monitor, *stack, probe], model, tiny_lm_data(), tmp_path, max_steps=8, logger=logger,
                      log_every_n_steps=1)  # fmt: skip
    announced = [r.getMessage() for r in caplog.records if "pauses" in r.getMessage()]
    assert announced == [
        "RandomLTDCallback: pauses at level 2 of VCycleCallback (layers per level: [4, 2]): the default layer_ids "
        "(all but the first and the last layer) select none in a network of <= 2 layers, so no token is dropped "
        "there and its steps count their full layer-tokens and FLOPs; pass explicit layer_ids to drop tokens there"
    ]
    assert trainer.global_step == 8 and vc.level == 1 and not is_converted(model) and depth_of(model) == 4
    assert [row["depth"] for row in probe.rows] == [4, 4, 2, 2, 2, 4, 4, 4]
    total = 0
    for row in probe.rows:
        paused = row["depth"] == 2
        assert row["patched"] == row["really_patched"] == ([] if paused else [1, 2])
        ((batch, seq_len, r),) = row["records"]
        assert (batch, seq_len) == (8, 16) and r == (16 if paused else min(row["r"], 16))
        assert row["drawn"] is None if paused or r == 16 else row["drawn"] == (2, 8, r)
        total += F.layer_tokens(8, 16, r, row["depth"], 0 if paused else 2)
        assert row["consumed"] == total
    assert [row["r"] for row in probe.rows] == [F.ltd_value(s, 4, 16, 6, 4) for s in range(8)]  # the schedule goes on
    assert ltd.consumed_layer_tokens == total and ltd.full_layer_tokens == sum(8 * 16 * r["depth"] for r in probe.rows)
    assert monitor.summary["layer_tokens"] == total
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("effi/random_ltd/ltd_layers")]
    assert [float(row["effi/random_ltd/ltd_layers"]) for row in rows] == [2, 2, 0, 0, 0, 2, 2, 2]


@pytest.mark.parametrize("resume_step", [3, 6])  # at the paused coarse level; after the up-switch
def test_resume_at_a_paused_level_equals_uninterrupted(tmp_path, resume_step):
    assert_resume_equals_uninterrupted(
        lambda: tiny_gpt2(n_layer=4),
        tiny_lm_data,
        tmp_path,
        total_steps=8,
        resume_step=resume_step,
        callbacks_fn=lambda: [EfficiencyMonitor(), VCycleCallback(e_a=2, e_small=3), ltd_cb(max_value=16)],
        ignore_state=("map_seconds", *MONITOR_TIMES),
    )


def test_protocols_are_declared():
    assert isinstance(ltd_cb(), FollowsModelChanges) and isinstance(VCycleCallback(e_a=1, e_small=1), PlansModelChanges)
    assert not isinstance(VCycleCallback(e_a=1, e_small=1), FollowsModelChanges)


@pytest.mark.parametrize("case, resume_step", [("gpt2", 3), ("gpt2", 6), ("vit", 4)])
def test_resume_at_a_coarse_level_equals_uninterrupted(tmp_path, case, resume_step):
    """Checkpoints inside the coarse stage (steps 3, 4) and after the up-switch (6): the resumed run rebuilds the
    coarse level, re-patches it, and ends exactly as the uninterrupted run (weights, optimizer, both callbacks)."""
    build, data, kw, _ = CASES[case]
    assert_resume_equals_uninterrupted(
        build,
        data,
        tmp_path,
        total_steps=8,
        resume_step=resume_step,
        callbacks_fn=lambda: [VCycleCallback(e_a=2, e_small=3, lr_multiplier={2: 2.0}), ltd_cb(**kw)],
        ignore_state=("map_seconds",),
    )


# ------------------------------------------------------------------------------------------------ progress clock
class ShortEpochData(TinyDataModule):
    """40 token blocks, batch 8; the epochs not in ``full`` train on the first ``keep`` blocks only (as InfoBatch
    prunes between a full first epoch and full annealing epochs): 5, 2, 2, 5 optimizer steps over 4 epochs. Needs
    ``reload_dataloaders_every_n_epochs=1``; resumes mid-epoch."""

    def __init__(self, keep: int = 16, full: tuple[int, ...] = (0, 3)) -> None:
        super().__init__(TokenBlocks(), batch_size=8)
        self.keep, self.full = keep, full

    def train_dataloader(self) -> ResumableDataLoader:
        epoch = self.trainer.current_epoch
        data = self.train_dataset if epoch in self.full else Subset(self.train_dataset, range(self.keep))
        sampler = EpochShuffleSampler(data, seed=self.seed)
        return ResumableDataLoader(data, batch_size=self.batch_size, sampler=sampler)


class ShortEpochs(Callback):
    """A stand-in for InfoBatch's progress clock (:class:`ProvidesProgressClock`) over epochs of known lengths:
    progress after ``n`` steps is ``(e + j / L_e) / E`` (``j`` steps done in epoch ``e`` of ``L_e``)."""

    def __init__(self, lengths: tuple[int, ...] = (5, 2, 2, 5)) -> None:
        self.lengths, self._trainer = lengths, None

    def setup(self, trainer, pl_module, stage):
        self._trainer = trainer

    def _progress(self, steps: int) -> float:
        for epoch, length in enumerate(self.lengths):
            if steps <= length:
                return (epoch + steps / length) / len(self.lengths)
            steps -= length
        return 1.0

    def effi_progress(self) -> float:
        return self._progress(self._trainer.global_step + 1)

    def effi_progress_done(self) -> float:
        return self._progress(self._trainer.global_step)

    def effi_min_total_steps(self) -> int:
        return sum(self.lengths)


class Levels(Callback):
    """The level (network depth) of every optimizer step, after any switch at its end."""

    def __init__(self) -> None:
        self.depths: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.depths.append(depth_of(pl_module))


def short_run(vc, root, extra=(), **kw):
    pl.seed_everything(0)
    levels = Levels()
    model = gpt2_6()
    trainer = make_trainer(
        Path(root),
        [ShortEpochs(), vc, *extra, levels],
        max_epochs=4,
        reload_dataloaders_every_n_epochs=1,
        **kw,
    )
    trainer.fit(model, datamodule=ShortEpochData())
    return trainer, model, levels


def test_short_epochs_fractions_complete_the_cycle_on_the_progress_clock(tmp_path):
    """14 steps where estimated_stepping_batches says 20. On the step clock '0.3dur' / '0.5dur' would end at steps 6
    and 16 (after the run: it would end on the coarse model); on the progress clock the switches come after the first
    step at progress >= 0.3 (step 6: 0.375) and >= 0.8 (step 10: (3 + 1/5) / 4), and the run ends on the full model."""
    assert isinstance(ShortEpochs(), ProvidesProgressClock)
    vc = VCycleCallback(e_a="0.3dur", e_small="0.5dur")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, model, levels = short_run(vc, tmp_path)
    assert not [w for w in caught if "ended at level" in str(w.message)]
    assert trainer.global_step == 14 and trainer.estimated_stepping_batches == 20
    assert vc.clock == "progress" and vc.config()["clock"] == "progress"
    assert vc.stages == [(1, 3 * PROGRESS_TICKS // 10), (2, PROGRESS_TICKS // 2)]
    assert vc.stage_ends == [300_000_000, 800_000_000]
    assert levels.depths == [6] * 5 + [3] * 4 + [6] * 5  # after steps 6 and 10
    assert vc.switches == 2 and vc.level == 1 and vc.cut_short_level == 0 and depth_of(model) == 6


def test_short_epochs_epoch_lengths_switch_on_epoch_boundaries(tmp_path):
    """'1ep' / '2ep' on the progress clock are 1/4 and 2/4 of the run (max_epochs=4): the switches come at the ends of
    epochs 0 and 2 (steps 5 and 9), not after 5 and 15 full-length steps."""
    vc = VCycleCallback(e_a="1ep", e_small="2ep")
    trainer, model, levels = short_run(vc, tmp_path)
    assert vc.stage_ends == [250_000_000, 750_000_000]
    assert levels.depths == [6] * 4 + [3] * 4 + [6] * 6 and trainer.global_step == 14
    assert vc.level == 1 and depth_of(model) == 6


def test_short_epochs_steps_must_fit_the_fewest_steps(tmp_path):
    """Stage lengths in steps keep the step clock and must fit in effi_min_total_steps() (14): 15 raise at train
    start naming both callbacks and the fix, before any step; 2 + 5 fit. Steps mixed with fractions raise in setup."""
    too_long = r"VCycleCallback: .*need 15 optimizer steps .*ShortEpochs shortens .*as few as 14 .*fractions of the run"
    with pytest.raises(ValueError, match=too_long):
        short_run(VCycleCallback(e_a=5, e_small=10), tmp_path / "a")
    vc = VCycleCallback(e_a=5, e_small=10)
    trainer = make_trainer(tmp_path / "b", [ShortEpochs(), vc], max_epochs=4, reload_dataloaders_every_n_epochs=1)
    with pytest.raises(ValueError, match="as few as 14"):
        trainer.fit(gpt2_6(), datamodule=ShortEpochData())
    assert trainer.global_step == 0 and vc.level == 1
    vc = VCycleCallback(e_a=2, e_small=5)
    trainer, model, levels = short_run(vc, tmp_path / "c")
    assert vc.clock == "step" and vc.stage_ends == [2, 7] and levels.depths == [6, 3, 3, 3, 3, 3, 6] + [6] * 7
    mixed = (
        r"ShortEpochs changes the epoch lengths, .*got e_a=5, e_small='0.5dur'. Give every stage length as a fraction"
    )
    with pytest.raises(ValueError, match=mixed):
        short_run(VCycleCallback(e_a=5, e_small="0.5dur"), tmp_path / "d")
    with pytest.raises(ValueError, match=r"need 1.1 of the run on ShortEpochs's progress clock"):
        short_run(VCycleCallback(e_a="0.6dur", e_small="0.5dur"), tmp_path / "e")


@pytest.mark.parametrize("resume_step", [7, 11])  # inside the coarse stage; after the up-switch
def test_short_epochs_resume_equals_uninterrupted(tmp_path, resume_step):
    def callbacks():
        return [ShortEpochs(), VCycleCallback(e_a="0.3dur", e_small="0.5dur"), ltd_cb(max_value=16)]

    a, b = assert_resume_equals_uninterrupted(
        gpt2_6,
        ShortEpochData,
        tmp_path,
        total_steps=14,
        resume_step=resume_step,
        callbacks_fn=callbacks,
        ignore_state=("map_seconds",),
        max_epochs=4,
        reload_dataloaders_every_n_epochs=1,
    )
    vc = next(c for c in b.callbacks if isinstance(c, VCycleCallback))
    assert vc.clock == "progress" and vc.level == 1 and vc.switches == 2


def test_a_checkpoint_of_another_clock_is_reported(tmp_path):
    """A checkpoint written on the progress clock, resumed without the progress source: reported at train start (the
    clock is chosen once every callback's setup ran), before any step."""
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpts",
        every_n_train_steps=1,
        save_top_k=-1,
        filename="{step}",
        save_on_train_epoch_end=False,
    )
    short_run(VCycleCallback(e_a="0.3dur", e_small="0.5dur"), tmp_path / "a", extra=[ckpt])
    trainer = make_trainer(
        tmp_path / "b",
        [VCycleCallback(e_a="0.3dur", e_small="0.5dur")],
        max_epochs=4,
        reload_dataloaders_every_n_epochs=1,
    )
    with pytest.raises(ValueError, match=r"stages count the 'progress' clock, this run's the 'step' clock"):
        trainer.fit(gpt2_6(), datamodule=ShortEpochData(), ckpt_path=tmp_path / "ckpts" / "step=7.ckpt")


class Progress(Callback):
    """InfoBatch's effi_progress_done() after every optimizer step (its on_before_optimizer_step counted the step)."""

    def __init__(self, ib: InfoBatchCallback) -> None:
        self.ib, self.done = ib, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.done.append(self.ib.effi_progress_done())


def test_infobatch_is_the_vcycles_progress_clock(tmp_path):
    """The real InfoBatch (40 blocks, batch 8, epochs of 5, <5, <5, 5 steps; estimated_stepping_batches says 20) is
    the V-cycle's clock: '0.3dur' / '0.5dur' switch after the first steps at which its effi_progress_done() has
    reached 0.3 and 0.8, and the run ends on the full model. Stage lengths in steps must fit in its
    effi_min_total_steps(): 5 + 3 + 3 + 5 = 16 (a prune epoch keeps at least 1 + floor(0.5 · 39) = 20 samples)."""

    def data() -> InfoBatchDataModule:
        return InfoBatchDataModule(TinyDataModule(TokenBlocks(), batch_size=8))

    pl.seed_everything(0)
    ib, vc, levels = (
        InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7),
        VCycleCallback(e_a="0.3dur", e_small="0.5dur"),
        Levels(),
    )
    progress = Progress(ib)
    trainer = make_trainer(tmp_path / "a", [ib, vc, levels, progress], max_epochs=4)
    trainer.fit(gpt2_6(), datamodule=data())
    assert vc.clock == "progress" and vc.stage_ends == [300_000_000, 800_000_000]
    assert trainer.global_step < trainer.estimated_stepping_batches == 20
    lengths = [math.ceil(h["size"] / 8) for h in ib.history]
    assert progress.done == [(e + j / n) / 4 for e, n in enumerate(lengths) for j in range(1, n + 1)]
    first, second = (next(k for k, p in enumerate(progress.done) if p >= end) for end in (0.3, 0.8))
    assert levels.depths == [3 if first <= k < second else 6 for k in range(trainer.global_step)]
    assert vc.switches == 2 and vc.level == 1 and vc.cut_short_level == 0
    stack = [InfoBatchCallback(prune_ratio=0.5, delta=0.75), VCycleCallback(e_a=5, e_small=12)]
    trainer = make_trainer(tmp_path / "b", stack, max_epochs=4)
    with pytest.raises(ValueError, match=r"need 17 optimizer steps .*InfoBatchCallback shortens .*as few as 16"):
        trainer.fit(gpt2_6(), datamodule=data())
    assert trainer.global_step == 0
    vc = VCycleCallback(e_a=5, e_small=11)
    make_trainer(tmp_path / "c", [InfoBatchCallback(prune_ratio=0.5, delta=0.75), vc], max_epochs=4).fit(
        gpt2_6(), datamodule=data()
    )
    assert vc.clock == "step" and vc.stage_ends == [5, 16] and vc.level == 1


# ------------------------------------------------------------------------------------------------ cut short
class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class States(Callback):
    """Put before the V-cycle: the network's state dict after every step, before any switch."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[trainer.global_step] = {k: v.clone() for k, v in pl_module.model.state_dict().items()}


def test_a_run_cut_short_goes_back_up(tmp_path):
    """Stopped at step 4 inside the coarse stage (trainer.should_stop): on_train_end de-coalesces and interpolates
    with the snapshot of step 2 (the operators of the up-switch), warns, random-LTD re-patches then unpatches, and
    the module holds the full model with those weights."""
    pl.seed_everything(0)
    model = gpt2_6()
    full = model.model
    states, ltd = States(), ltd_cb(max_value=16)
    vc = VCycleCallback(e_a=2, e_small=5, alpha_original=0.3)
    with pytest.warns(UserWarning, match=r"ended at level 2 in stage 2 of 3 \(step 4.*WITHOUT TRAINING"):
        trainer = fit([states, vc, ltd, StopAt(4)], model, tiny_lm_data(), tmp_path, max_steps=10)
    assert trainer.global_step == 4 and vc.level == 1 and vc.cut_short_level == 2 and vc.snapshots == {}
    assert model.model is full and depth_of(model) == 6 and not is_converted(model)
    assert vc.effi_summary()["vcycle/final_level"] == 1 and vc.effi_summary()["vcycle/cut_short_level"] == 2
    plan = find_vcycle_adapter(full).plan(full, "half", "adjacent", "official")
    expected = V.interpolate(V.decoalesce(states.steps[4], plan), states.steps[2], 0.3)
    final = model.model.state_dict()
    assert expected.keys() == final.keys() and all(torch.equal(final[k], v) for k, v in expected.items())
    assert {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]} == {
        id(p) for p in model.parameters()
    }  # an optimizer of the full model


def test_a_three_level_run_cut_short_at_the_coarsest_level_and_by_max_time(tmp_path):
    """3 levels stopped at level 3 go up 3 → 2 → 1; a run ended by max_time at a coarse level goes back up too."""
    pl.seed_everything(0)
    model = tiny_gpt2(n_layer=4, n_head=4)
    vc = VCycleCallback(levels=3, e_a=1, e_small=5, up_leg=1)
    with pytest.warns(UserWarning, match=r"ended at level 3 in stage 3 of 5 .*level 3 -> 2 -> 1"):
        fit([vc, StopAt(3)], model, tiny_lm_data(), tmp_path / "a", max_steps=10)
    assert vc.level == 1 and depth_of(model) == 4 and model.model.config.n_embd == 32

    class Slow(Callback):  # every step takes ~0.3 s: max_time (1 s) ends the run inside the coarse stage
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            import time

            time.sleep(0.3)

    pl.seed_everything(0)
    model = gpt2_6()
    vc = VCycleCallback(e_a=1, e_small=500)
    with pytest.warns(UserWarning, match=r"ended at level 2 in stage 2 of 3"):
        trainer = fit([vc, Slow()], model, tiny_lm_data(), tmp_path / "b", max_steps=1000, max_time={"seconds": 1})
    assert 1 <= trainer.global_step < 500 and vc.level == 1 and depth_of(model) == 6


# ------------------------------------------------------------------------------------------------ curriculum + LTD
TRUNC = dict(
    difficulty_type="value",
    clustering_type="single_cluster",
    min_difficulty=2,
    max_difficulty=16,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=10, difficulty_step=1),
)


def test_curriculum_truncation_with_random_ltd(tmp_path):
    """Batches truncated to d tokens: random-LTD drops nothing while d <= r (the layers see d tokens, no indices are
    drawn) and drops r of d tokens once d > r; the two techniques log their values at the same steps."""
    pl.seed_everything(0)
    ltd = ltd_cb(max_value=16, min_value=8, require_steps=12)
    probe = LTDProbe(ltd)
    logger = CSVLogger(tmp_path, name="log")
    trainer = make_trainer(
        tmp_path, [Curriculum(metrics={"seqlen_truncate": TRUNC}), ltd, probe], max_steps=12, max_epochs=-1,
        logger=logger, log_every_n_steps=1,
    )  # fmt: skip
    model = tiny_gpt2(n_layer=4)
    trainer.fit(model, datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4)))
    kept = dropped = 0
    for row in probe.rows:
        ((batch, seq_len, r),) = row["records"]
        assert r == min(row["r"], seq_len)
        if seq_len <= row["r"]:
            assert row["drawn"] is None  # nothing dropped: every layer sees the whole (truncated) batch
            kept += 1
        else:
            assert row["drawn"] == (2, batch, row["r"])
            dropped += 1
    assert kept >= 3 and dropped >= 3
    assert ltd.consumed_layer_tokens == sum(
        F.layer_tokens(*row["records"][0], 4, 2) for row in probe.rows
    )  # layer-tokens from each batch's real length
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    difficulty, reserved = "effi/curriculum/seqlen_truncate_difficulty", "effi/random_ltd/reserved_length"
    steps_d = [int(row["step"]) for row in rows if row.get(difficulty)]
    steps_r = [int(row["step"]) for row in rows if row.get(reserved)]
    assert steps_d == steps_r == list(range(12))
    side_by_side = [(float(row[difficulty]), float(row[reserved])) for row in rows if row.get(difficulty)]
    assert side_by_side == [(float(row["records"][0][1]), float(row["r"])) for row in probe.rows]
    assert not is_converted(model)


@pytest.mark.parametrize("where", ["callback", "datamodule", "nested datamodule"])
def test_a_min_value_that_never_drops_under_truncation_is_refused(tmp_path, where):
    """Wherever the curriculum's configuration lives: on the callback, on its DataModule, or on its DataModule wrapped
    in InfoBatch's (the one pipeline of InfoBatch + curriculum)."""
    trunc = {**TRUNC, "max_difficulty": 8}
    for min_value, ok in ((12, False), (8, False), (4, True)):
        cur = Curriculum(metrics={"seqlen_truncate": trunc}) if where == "callback" else Curriculum()
        dm = CurriculumDataModule(
            tiny_lm_data(batch_size=4), **({"metrics": {"seqlen_truncate": trunc}} if where != "callback" else {})
        )
        extra: list[Callback] = []
        if where == "nested datamodule":
            dm, extra = InfoBatchDataModule(dm), [InfoBatchCallback(prune_ratio=0.5)]
        # an ok run's max_value within the curriculum's longest batch: above it is refused too (qa102-break 01)
        ltd = ltd_cb(max_value=8 if ok else 16, min_value=min_value)
        model = tiny_gpt2(n_layer=4)
        trainer = make_trainer(tmp_path / f"{min_value}", [ltd, cur, *extra], max_steps=2, max_epochs=-1)
        if ok:
            trainer.fit(model, datamodule=dm)
            continue
        with pytest.raises(
            ValueError,
            match=rf"RandomLTDCallback: its reserved length is never below {min_value} tokens .*Curriculum's "
            r"seqlen_truncate makes every batch at most 8 tokens long .*never drop a token: lower "
            r"RandomLTDCallback.min_value below 8",
        ):
            trainer.fit(model, datamodule=dm)
        assert trainer.global_step == 0 and not is_converted(model)


# ------------------------------------------------------------------------------------------------ DDP
class RankProbe(Callback):
    """Per rank and step: the network's depth, the patched layers, the drawn indices, a parameter fingerprint, the
    consumed layer-tokens; the final weights and whether anything is still patched after the fit."""

    def __init__(self, ltd: RandomLTDCallback, out: str) -> None:
        self.ltd, self.out, self.rows = ltd, out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        idx = self.ltd.controller.last_indices()
        params = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        self.rows.append(
            {
                "depth": depth_of(pl_module),
                "patched": len(self.ltd.patched.layers),
                "indices": None if idx is None else idx.tolist(),
                "params": params[::97].tolist(),
                "consumed": self.ltd.consumed_layer_tokens,
            }
        )

    def teardown(self, trainer, pl_module, stage):  # after random-LTD's teardown (later in the callback list)
        r = trainer.global_rank
        torch.save(pl_module.model.state_dict(), Path(self.out) / f"rank{r}.pt")
        record = {"rows": self.rows, "converted": is_converted(pl_module), "depth": depth_of(pl_module)}
        (Path(self.out) / f"probe{r}.json").write_text(json.dumps(record))


@pytest.mark.slow
def test_ddp_two_processes(tmp_path):
    """2 processes: both ranks switch at the same steps, patch the same layers, draw different tokens, stay in sync,
    and count the layer-tokens of both ranks with each step's depth; both end on the full model, unpatched."""
    ltd = ltd_cb(max_value=16)
    pl.seed_everything(0)
    fit_ddp(
        gpt2_6(),
        tiny_lm_data(batch_size=4),
        tmp_path,
        [VCycleCallback(e_a=1, e_small=2), ltd, RankProbe(ltd, str(tmp_path))],
        max_steps=5,
        max_epochs=-1,
    )
    probes = [json.loads((tmp_path / f"probe{r}.json").read_text()) for r in range(2)]
    rows0, rows1 = probes[0]["rows"], probes[1]["rows"]
    # after each step's switch: coarse after steps 1 and 2, full again after step 3
    assert [r["depth"] for r in rows0] == [r["depth"] for r in rows1] == [3, 3, 6, 6, 6]
    assert [r["patched"] for r in rows0] == [r["patched"] for r in rows1] == [1, 1, 4, 4, 4]
    total = 0
    for step, (a, b) in enumerate(zip(rows0, rows1)):
        assert a["indices"] != b["indices"] and a["params"] == b["params"] and a["consumed"] == b["consumed"]
        depth = 6 if step in (0, 3, 4) else 3  # the network that trained the step
        total += 2 * F.layer_tokens(4, 16, F.ltd_value(step, 4, 16, 6, 4), depth, depth - 2)
        assert a["consumed"] == total
    assert all(not p["converted"] and p["depth"] == 6 for p in probes)
    w0, w1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)


class _TwoTowers(pl.LightningModule):
    """Two PyTorch encoders over one batch (a CLIP's towers, here on the same tokens): ``deep`` of 4 layers, ``shallow``
    of 2."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

        def encoder(depth: int) -> torch.nn.TransformerEncoder:
            layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            return torch.nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)

        self.deep, self.shallow = encoder(4), encoder(2)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        x = self.embed(ids)
        logits = self.head(self.deep(x)) + self.head(self.shallow(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_random_ltd_on_one_tower_does_not_follow_a_vcycle_on_the_other(tmp_path, caplog):
    """The V-cycle's depths per level (2, 1: the other tower's) were applied to random-LTD's tower of 4 layers:
    layer_ids=[1, 2] were refused and the default ids were announced as pausing, while tokens were dropped at every
    level (qa50-clip 05)."""
    from tests.helpers.tiny import TinyDataModule, TokenBlocks

    seen: list[int] = []
    model = _TwoTowers()
    attention = model.deep.layers[1].self_attn
    attention.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]) if m.training else None)
    ltd = RandomLTDCallback(min_value=4, max_value=16, seq_per_step=4, require_steps=4, layer_ids=[1, 2],
                            model_attr="deep")  # fmt: skip
    vcycle = VCycleCallback(e_a=1, e_small=2, model_attr="shallow", width_scheme=None, alpha_original=0.3)
    trainer = make_trainer(tmp_path, [ltd, vcycle], max_steps=4, max_epochs=-1)
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=TinyDataModule(TokenBlocks(n=32, seq_len=16), batch_size=4))
    assert seen == [4, 4, 8, 12] and "pauses at level" not in caplog.text  # dropped at every level
