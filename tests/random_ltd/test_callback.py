"""RandomLTDCallback in Lightning: fit with each adapter, the schedule's step axis under gradient accumulation,
accounting, resume, the layer-token LR schedule, DDP, setup errors, require_steps as a Duration (and the deprecated
require_fraction), the repr and the declared requirements."""

from __future__ import annotations

import json
import math
import warnings
from fractions import Fraction
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

import lightning_effi.random_ltd
from lightning_effi.adapters import GenericAdapter
from lightning_effi.callbacks import InfoBatchCallback, RandomLTDCallback
from lightning_effi.core.accounting import EfficiencyMonitor
from lightning_effi.core.lr_schedules import layer_token_lr, layer_token_multiplier
from lightning_effi.core.progress import Duration
from lightning_effi.core.requirements import BATCH_STRUCTURES, IncompatibleTechniques, Requirements, check_trainer
from lightning_effi.functional import random_ltd as F
from lightning_effi.infobatch.data import InfoBatchDataModule
from lightning_effi.random_ltd import is_converted
from lightning_effi.reference.data.base import PaddingCollate
from lightning_effi.tasks import ImageClassifier
from tests.helpers.harness import assert_resume_equals_uninterrupted, fit_ddp, make_trainer
from tests.helpers.tiny import (
    TinyDataModule,
    TokenBlocks,
    sgd,
    tiny_bert_cls,
    tiny_bert_mlm,
    tiny_gpt2,
    tiny_image_data,
    tiny_lm_data,
    tiny_sentence_data,
)


def deep_gpt2(**kw):
    return tiny_gpt2(n_layer=4, **kw)


class MLMBlocks(TokenBlocks):
    """Token blocks with MLM labels on every third position (-100 elsewhere)."""

    def __getitem__(self, i):
        x = self.data[i]
        labels = torch.full_like(x, -100)
        labels[::3] = x[::3]
        return {"input_ids": x, "labels": labels}


class Watch(Callback):
    """Records, per training batch, the reserved length, the controller's draw key and the LTD layers' calls."""

    def __init__(self, ltd: RandomLTDCallback):
        self.ltd = ltd
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        idx = self.ltd.controller.last_indices()
        self.rows.append(
            {
                "step": trainer.global_step,
                "batch_idx": batch_idx,
                "r": self.ltd.current_value,
                "records": list(self.ltd.controller.records),
                "indices": None if idx is None else idx.clone(),
                "consumed": self.ltd.consumed_layer_tokens,
            }
        )


def ltd(**kw):
    kw = {"min_value": 4, "require_steps": 6, "seq_per_step": 4, "seed": 7} | kw
    return RandomLTDCallback(**kw)


# ------------------------------------------------------------------------------------------------ fit per adapter


@pytest.mark.parametrize(
    ("model_fn", "data_fn", "seq"),
    [
        (deep_gpt2, tiny_lm_data, 16),
        (lambda: tiny_bert_mlm(n_layer=4), lambda: TinyDataModule(MLMBlocks()), 16),
        (lambda: tiny_bert_cls(n_layer=4), tiny_sentence_data, None),
        (
            lambda: ImageClassifier(
                "vit_tiny_patch16_224",
                optimizer=sgd,
                model_kwargs={"img_size": 32, "patch_size": 8, "depth": 4, "embed_dim": 32, "num_heads": 2},
            ),
            tiny_image_data,
            17,
        ),
    ],
)
def test_fit_each_adapter_follows_the_schedule(tmp_path, model_fn, data_fn, seq):
    pl.seed_everything(0)
    model = model_fn()
    cb = ltd(max_value=8, require_steps=3)
    watch = Watch(cb)
    trainer = make_trainer(tmp_path, [cb, watch], max_steps=4, max_epochs=-1)
    trainer.fit(model, datamodule=data_fn())
    assert [r["r"] for r in watch.rows] == [F.ltd_value(s, 4, 8, 3, 4) for s in range(4)] == [4, 4, 4, 8]
    for row in watch.rows:
        (rec,) = row["records"]
        assert rec.reserved_length == min(row["r"], rec.seq_len)
        if seq is not None:
            assert rec.seq_len == seq
        if rec.reserved_length < rec.seq_len:
            assert row["indices"].shape == (2, rec.batch_size, rec.reserved_length)
    assert not is_converted(model)  # teardown restored the layers
    assert cb.consumed_layer_tokens == sum(
        F.layer_tokens(r.batch_size, r.seq_len, r.reserved_length, 4, 2) for row in watch.rows for r in row["records"]
    )


def test_logged_metrics_and_accounting_adjustment(tmp_path):
    pl.seed_everything(0)
    cb = ltd(max_value=16, require_steps=4)
    monitor = EfficiencyMonitor(print_summary=False)
    watch = Watch(cb)
    from lightning.pytorch.loggers import CSVLogger

    trainer = make_trainer(
        tmp_path,
        [monitor, cb, watch],
        max_steps=5,
        max_epochs=-1,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="log"),
    )
    model = deep_gpt2()
    trainer.fit(model, datamodule=tiny_lm_data())
    import csv

    rows = list(csv.DictReader(open(next(tmp_path.glob("log/*/metrics.csv")))))
    logged = [float(r["effi/random_ltd/reserved_length"]) for r in rows if r.get("effi/random_ltd/reserved_length")]
    assert logged == [F.ltd_value(s, 4, 16, 4, 4) for s in range(5)] == [4, 4, 8, 12, 16]
    # the monitor's layer-tokens are the LTD layer-tokens (B = 8, S = 16, L = 4, L_ltd = 2)
    expected = sum(F.layer_tokens(8, 16, r, 4, 2) for r in [4, 4, 8, 12, 16])
    assert monitor.totals["layer_tokens"] == expected == cb.consumed_layer_tokens
    full = model.effi_training_flops({"input_ids": torch.zeros(8, 16, dtype=torch.long)})
    saved = sum(2 * (F.flops_per_layer(8, 16, 32) - F.flops_per_layer(8, r, 32)) for r in [4, 4, 8, 12, 16])
    assert monitor.totals["flops"] == pytest.approx(5 * full - saved, rel=1e-12)
    summary = cb.effi_summary()
    assert summary["random_ltd/layer_token_saving"] == pytest.approx(1 - expected / (5 * 8 * 16 * 4))


class SkipsSomeBatches(type(deep_gpt2())):  # type: ignore[misc]
    """A step that skips batches 1 and 3 of each epoch (``return None``: no backward, no update under automatic
    optimization), e.g. a bad batch."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx in (1, 3) else loss


def test_a_skipped_batch_is_not_counted(tmp_path):
    """A batch whose ``training_step`` returned None trained nothing: random-LTD counted its layer-tokens, samples and
    FLOPs (full_layer_tokens 6144 for 4096, consumed ahead of the monitor's: qa83-compat 01), and a layer-token LR
    schedule ran ahead on it. Now its figures are the monitor's, which leaves such batches out; ``r`` still follows
    the optimizer step (Lightning advances it for a skipped batch too)."""
    pl.seed_everything(0)
    cb, monitor = ltd(max_value=16, require_steps=4), EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path, [monitor, cb], max_steps=6, max_epochs=-1)
    model = SkipsSomeBatches(**deep_gpt2().hparams)
    trainer.fit(model, datamodule=tiny_lm_data())
    assert trainer.global_step == 6 and monitor.totals["batches"] == 4  # batches 1 and 3 skipped
    trained = [F.ltd_value(s, 4, 16, 4, 4) for s in (0, 2, 4, 5)]  # B = 8, S = 16, L = 4, L_ltd = 2
    assert cb.consumed_layer_tokens == sum(F.layer_tokens(8, 16, r, 4, 2) for r in trained)
    assert cb.consumed_layer_tokens == monitor.totals["layer_tokens"]
    assert cb.full_layer_tokens == 4 * 8 * 16 * 4 and cb.consumed_samples == 4 * 8


class SkipsTheFirstBatch(type(deep_gpt2())):  # type: ignore[misc]
    """Skips the first micro-batch, after its forward or (``if bad: return None``) before it."""

    def __init__(self, before_forward: bool) -> None:
        super().__init__(**deep_gpt2().hparams)
        self.before_forward = before_forward

    def training_step(self, batch, batch_idx):
        skip = self.global_step == 0 and batch_idx == 0
        if skip and self.before_forward:
            return None
        loss = super().training_step(batch, batch_idx)
        return None if skip else loss


@pytest.mark.parametrize("before_forward", [False, True])
def test_a_skipped_micro_batch_still_counts_in_the_step_batch_size(tmp_path, before_forward):
    """The first step's batch size is read from its samples: with its first micro-batch skipped it read 4 for 8, and
    ``expected_total_layer_tokens`` (a layer-token LR schedule's length) came to half the run's (qa84-break 01); a
    micro-batch skipped before its forward has no layer records, and read so still (qa85-break 01)."""
    pl.seed_everything(0)
    cb, monitor = ltd(max_value=16, require_steps=4), EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path, [monitor, cb], max_steps=3, max_epochs=-1, accumulate_grad_batches=2)
    trainer.fit(SkipsTheFirstBatch(before_forward), datamodule=tiny_lm_data())
    assert cb.global_batch_size == 16  # 2 micro-batches of 8 a step
    assert cb.consumed_samples == monitor.totals["samples"] == 32  # 4 micro-batches trained (the skipped one not)
    assert cb.expected_total_layer_tokens() == cb.total_layer_tokens(3, 16)


@pytest.mark.parametrize(
    ("resumed", "told"),
    [
        (dict(accumulate_grad_batches=2), None),
        (dict(accumulate_grad_batches=4), "trains 32 samples a step"),
        (dict(accumulate_grad_batches=2, batch_size=4), "trains 8 samples a step"),  # another per-device batch
        (dict(accumulate_grad_batches=4, batch_size=4), None),  # 4 x 4: the checkpoint's 16 samples a step
        # every step ends an epoch (5 batches of 8): its first step was skipped and nothing told (qa95-regress 01)
        (dict(accumulate_grad_batches=5), "trains 40 samples a step"),
    ],
)
def test_resume_with_another_batch_warns_that_the_expected_total_is_not_the_runs(tmp_path, resumed, told):
    """The checkpoint holds the first step's global batch size (16: 2 micro-batches of 8); in a fit resumed with
    steps of another size, ``expected_total_layer_tokens`` (a layer-token LR schedule's default total) counted every
    step at 16 samples, silently (qa90-resume). It warns when read, once, comparing this fit's steps with the
    checkpoint's: micro-batch counts missed another per-device batch and warned of 4 x 4 against 8 x 2
    (qa93-regress 02). A fit that never reads it is not warned (qa92-user 03)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    cb = ltd(max_value=16, require_steps=4)
    keep = ModelCheckpoint(dirpath=tmp_path / "ck", filename="end")  # at the epoch's end: 40 blocks, 3 steps
    trainer = make_trainer(tmp_path, [cb, keep], max_epochs=1, accumulate_grad_batches=2)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
    assert (cb.global_batch_size, cb.micro_batches) == (16, 2) and cb.state_dict()["micro_batches"] == 2
    batch_size = resumed.pop("batch_size", 8)
    cb = ltd(max_value=16, require_steps=4)
    trainer = make_trainer(tmp_path, [cb], max_epochs=2, **resumed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = str(tmp_path / "ck" / "end.ckpt")
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data(batch_size=batch_size), ckpt_path=ckpt)
        fit_said = [str(w.message) for w in caught if "where the checkpoint's run trained" in str(w.message)]
        assert cb.expected_total_layer_tokens() == cb.total_layer_tokens(cb.total_steps, 16)
        assert cb.expected_total_layer_tokens() == cb.total_layer_tokens(cb.total_steps, 16)
    said = [str(w.message) for w in caught if "where the checkpoint's run trained" in str(w.message)]
    assert cb.micro_batches == 2 and cb.global_batch_size == 16
    assert fit_said == [] and len(said) == (told is not None)
    if told:
        assert f"this fit {told} where the checkpoint's run trained 16 samples a step" in said[0]
        assert "pass total_layer_tokens" in said[0]
    bad = ltd().state_dict() | {"micro_batches": -1}
    with pytest.raises(ValueError, match="micro_batches"):
        ltd()._checked_state(bad)


def test_resume_on_an_epochs_smaller_last_batch_is_not_another_batch_size(tmp_path):
    """40 blocks in batches of 16 (16, 16, 8), resumed at step 2: the fit's first step is the epoch's smaller last
    batch, which warned of another batch size (qa94-regress 04). The first step that is not an epoch's last is
    compared."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    cb = ltd(max_value=16, require_steps=4)
    keep = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    make_trainer(tmp_path, [cb, keep], max_steps=2).fit(deep_gpt2(), datamodule=tiny_lm_data(batch_size=16))
    cb = ltd(max_value=16, require_steps=4)
    trainer = make_trainer(tmp_path, [cb], max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = str(tmp_path / "ck" / "step=2.ckpt")
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data(batch_size=16), ckpt_path=ckpt)
        assert cb.expected_total_layer_tokens() == cb.total_layer_tokens(6, 16)
    assert not [w for w in caught if "where the checkpoint's run trained" in str(w.message)]
    assert cb._fit_step_batch == (16, 1, 1, False)


def test_layer_token_lr_with_the_default_total_beside_a_vcycle_is_refused_at_train_start(tmp_path):
    """Each V-cycle level's network gives another total at its depth: the schedule rebuilt at a level change read the
    coarse one and the LR rose again when the full model came back (qa93-regress 07). Refused before any step."""
    from lightning_effi.callbacks import VCycleCallback

    cb = ltd(min_value=4, seq_per_step=4)

    def scheduler(opt, total_steps, progress=None):
        return layer_token_lr(opt, cb, 100, None)

    trainer = make_trainer(tmp_path, [cb, VCycleCallback(e_a=2, e_small=2)], max_steps=6)
    with pytest.raises(ValueError, match=r"layer_token_lr\(total_layer_tokens=None\) .* but VCycleCallback changes"):
        trainer.fit(deep_gpt2(scheduler=scheduler), datamodule=tiny_lm_data())
    assert trainer.global_step == 0


def test_layer_token_lr_restarted_mid_run_reads_the_total(tmp_path):
    """A schedule read at its step 0 after training started (SequentialLR restarts its child with step(0)) reads the
    total: a read at step 0 was taken for the constructor's and trained one step at the peak LR (qa93-regress 01)."""
    from torch.optim.lr_scheduler import LinearLR, SequentialLR

    cb, seen = ltd(max_value=16, require_steps=4), []

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((trainer.optimizers[0].param_groups[0]["lr"], cb.consumed_layer_tokens))

    def scheduler(opt, total_steps, progress=None):
        first = LinearLR(opt, start_factor=1.0, end_factor=1.0, total_iters=2)
        return SequentialLR(opt, [first, layer_token_lr(opt, cb, 0, None, decay="linear")], milestones=[2])

    pl.seed_everything(0)
    trainer = make_trainer(tmp_path, [cb, Probe()], max_steps=6)
    trainer.fit(deep_gpt2(scheduler=scheduler), datamodule=tiny_lm_data())
    total = cb.expected_total_layer_tokens()
    for lr, consumed in seen[3:]:
        assert lr == pytest.approx(0.05 * layer_token_multiplier(consumed, 0, total, "linear"), rel=1e-9)
    assert seen[3][0] < 0.05


# ------------------------------------------------------------------------------------------------ step axis


def test_gradient_accumulation_shares_r_and_counts_once_per_step(tmp_path):
    pl.seed_everything(0)
    cb = ltd(min_value=4, max_value=16, require_steps=2, accounting="deepspeed")
    watch = Watch(cb)
    trainer = make_trainer(tmp_path, [cb, watch], max_steps=3, max_epochs=-1, accumulate_grad_batches=4)
    trainer.fit(deep_gpt2(), datamodule=TinyDataModule(TokenBlocks(n=96), batch_size=2))
    assert len(watch.rows) == 12
    by_step = {}
    for row in watch.rows:
        by_step.setdefault(row["step"] if row["batch_idx"] % 4 != 3 else row["step"] - 1, []).append(row["r"])
    assert by_step == {0: [4] * 4, 1: [8] * 4, 2: [16] * 4}
    # deepspeed accounting: + global_batch * (r * L_ltd + max * (L - L_ltd)) once per optimizer step
    assert cb.consumed_layer_tokens == sum(8 * (r * 2 + 16 * 2) for r in (4, 8, 16))
    # micro-batches of one step draw different indices (the context is keyed by step and micro-batch)
    first = [row["indices"] for row in watch.rows[:4]]
    assert not torch.equal(first[0], first[1])


def test_truncated_batches_count_their_real_length(tmp_path):
    """The first batch has the full 16 tokens (an explicit max_value is checked against it); the later ones are
    truncated to 6 <= r: they pass through and count 6 tokens in every layer."""

    class Truncate(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx > 0:
                batch["input_ids"] = batch["input_ids"][:, :6]

    pl.seed_everything(0)
    cb = ltd(min_value=8, max_value=16, require_steps=2)
    watch = Watch(cb)
    trainer = make_trainer(tmp_path, [Truncate(), cb, watch], max_steps=3, max_epochs=-1)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
    assert [(r.seq_len, r.reserved_length) for row in watch.rows for r in row["records"]] == [(16, 8), (6, 6), (6, 6)]
    assert cb.controller.draws == 1  # only the first batch (r = 8 < 16) drew indices
    assert cb.consumed_layer_tokens == F.layer_tokens(8, 16, 8, 4, 2) + 2 * 8 * 6 * 4


# ------------------------------------------------------------------------------------------------ resume


def test_resume_mid_run_equals_uninterrupted(tmp_path):
    cbs = lambda: [ltd(max_value=16, require_steps=8)]  # noqa: E731
    a, b = assert_resume_equals_uninterrupted(
        deep_gpt2, tiny_lm_data, tmp_path, total_steps=8, resume_step=5, callbacks_fn=cbs
    )
    cb_a = next(c for c in a.callbacks if isinstance(c, RandomLTDCallback))
    cb_b = next(c for c in b.callbacks if isinstance(c, RandomLTDCallback))
    assert cb_a.consumed_layer_tokens == cb_b.consumed_layer_tokens > 0
    assert cb_a.current_value == cb_b.current_value == F.ltd_value(7, 4, 16, 8, 4) == 12  # last step: 7


def test_resume_draws_the_same_indices(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    runs = []
    for resume in (False, True):
        pl.seed_everything(0 if not resume else 99)
        cb = ltd(max_value=16, require_steps=20)
        watch = Watch(cb)
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
        trainer = make_trainer(
            tmp_path / str(resume), [cb, watch] + ([] if resume else [ckpt]), max_steps=7, max_epochs=-1
        )
        trainer.fit(
            deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=5.ckpt") if resume else None
        )
        runs.append(watch.rows)
    full, resumed = runs
    assert [r["step"] for r in resumed] == [6, 7]  # global_step after each step
    for a, b in zip(full[5:], resumed):
        assert torch.equal(a["indices"], b["indices"]) and a["r"] == b["r"] and a["consumed"] == b["consumed"]
    state = torch.load(tmp_path / "ck" / "step=5.ckpt", weights_only=True)["callbacks"]
    (ltd_state,) = [v for k, v in state.items() if k.startswith("RandomLTDCallback")]
    assert ltd_state["current_value"] == F.ltd_value(4, 4, 16, 20, 4)


def test_resume_with_another_max_value_raises(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = make_trainer(tmp_path, [ltd(max_value=16), ckpt], max_steps=2, max_epochs=-1)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
    trainer = make_trainer(tmp_path, [ltd(max_value=12)], max_steps=4, max_epochs=-1)
    with pytest.raises(ValueError, match="other settings"):
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=2.ckpt"))
    trainer = make_trainer(tmp_path, [ltd(max_value=12, strict=False)], max_steps=4, max_epochs=-1)
    with pytest.warns(UserWarning, match="other settings"):
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=2.ckpt"))


def _stop_and_resume(tmp_path, saved_kw, resumed_kw, steps=8, at=4):
    """An uninterrupted fit of ``steps`` with ``ltd(**saved_kw)`` and one resumed at step ``at`` of its checkpoint with
    ``ltd(**resumed_kw)``: the two callbacks and models."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = []
    for kw, ckpt_path in ((saved_kw, None), (resumed_kw, str(tmp_path / "ck" / f"step={at}.ckpt"))):
        pl.seed_everything(0)
        cb, model = ltd(**kw), deep_gpt2()
        extra = [ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=at, save_top_k=-1, filename="{step}")]
        trainer = make_trainer(tmp_path, [cb, *extra] if ckpt_path is None else [cb], max_steps=steps, max_epochs=-1)
        trainer.fit(model, datamodule=tiny_lm_data(), ckpt_path=ckpt_path)
        out.append((cb, model))
    return out


COUNTERS = ("consumed_samples", "consumed_layer_tokens", "full_layer_tokens", "saved_flops", "current_value")


@pytest.mark.parametrize(("saved", "resumed"), [(4, "0.5dur"), ("0.5dur", 4), ("0.45dur", "4st")])
def test_resume_with_the_same_require_steps_spelled_otherwise_goes_on_exactly(tmp_path, saved, resumed):
    """The card: the same count however spelled resumes. The state key holds ``require_steps`` as given (None for a
    fraction), so 4 and "0.5dur" of 8 steps were refused as "other settings" (qa90-resume 01)."""
    with pytest.warns(UserWarning) as told:
        (full, full_model), (cb, model) = _stop_and_resume(
            tmp_path, {"require_steps": saved}, {"require_steps": resumed}
        )
    # Lightning warns that the state's callback is missing; ours says it is this one's (qa91-break 07)
    lightning = [str(w.message) for w in told if str(w.message).startswith("Be aware that when using `ckpt_path`")]
    ours = [str(w.message) for w in told if "is this callback's" in str(w.message)]
    assert len(lightning) == 1 and len(ours) == 1
    assert f"given now as {resumed!r}" in ours[0] and "can be ignored" in ours[0]
    assert cb.require_steps == full.require_steps == 4
    assert {k: getattr(cb, k) for k in COUNTERS} == {k: getattr(full, k) for k in COUNTERS}
    for a, b in zip(full_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("resumed", [6, "6st", "0.75dur"])
def test_another_step_count_resumes_by_one_rule_however_spelled(tmp_path, resumed):
    """One step count, one outcome (qa91-regress 04): a checkpoint whose schedule reached max_value (require_steps 4,
    step 4 of 8) goes on at max_value with 6 steps spelled any way (an int was refused, a fraction resumed); one
    whose schedule had not (step 2) is refused, naming the jump of the reserved length, however spelled."""
    (full, full_model), (cb, model) = _stop_and_resume(
        tmp_path / "end", {"require_steps": 4}, {"require_steps": resumed}
    )
    assert cb.require_steps == 4 and {k: getattr(cb, k) for k in COUNTERS} == {k: getattr(full, k) for k in COUNTERS}
    for a, b in zip(full_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(
        ValueError, match=r"but the checkpoint's schedule has require_steps=4 .*the reserved length at "
    ):
        _stop_and_resume(tmp_path / "mid", {"require_steps": 4}, {"require_steps": resumed}, at=2)


def test_resume_with_strict_false_and_other_settings_keeps_the_checkpoints_counters(tmp_path):
    """strict=False with another identity setting: warned, the run goes on with the new settings, and the
    checkpoint's counters are restored. They restarted at the resume step (32 samples for 64, the recorded
    layer-token saving wrong: qa90-resume 02). The warning names the setting with both values, once."""
    (full, _), (cb, _) = _stop_and_resume(tmp_path, {"seq_per_step": 4}, {"seq_per_step": 2, "strict": False})
    assert cb.consumed_samples == full.consumed_samples == 8 * 8  # 8 steps of 8 samples
    assert cb.full_layer_tokens == full.full_layer_tokens  # the full model's layer-tokens do not depend on it
    assert cb.consumed_layer_tokens > full.consumed_layer_tokens * 4 / 8  # the first 4 steps' are counted
    pl.seed_everything(0)
    trainer = make_trainer(tmp_path, [ltd(seq_per_step=2, strict=False)], max_steps=8, max_epochs=-1)
    with pytest.warns(UserWarning) as caught:
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=4.ckpt"))
    told = [str(w.message) for w in caught if "RandomLTDCallback: the checkpoint" in str(w.message)]
    assert told == [
        "RandomLTDCallback: the checkpoint was written with other settings (seq_per_step: 4 in the checkpoint, 2 "
        "now) (strict=False: resume with this configuration)"
    ]
    with pytest.raises(ValueError, match=r"other settings \(require_steps: 6 in the checkpoint, 8 now; seq_per"):
        make_trainer(tmp_path, [ltd(require_steps=8, seq_per_step=2)], max_steps=8, max_epochs=-1).fit(
            deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=4.ckpt")
        )


def test_fit_again_continues_the_schedule(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = make_trainer(tmp_path, [ltd(max_value=16, require_steps=4), ckpt], max_steps=2, max_epochs=-1)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
    cb = ltd(max_value=16, require_steps=4)
    watch = Watch(cb)
    trainer = make_trainer(tmp_path, [cb, watch], max_steps=4, max_epochs=-1)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=2.ckpt"))
    assert [r["r"] for r in watch.rows] == [F.ltd_value(s, 4, 16, 4, 4) for s in (2, 3)] == [8, 12]


# ------------------------------------------------------------------------------------------------ layer-token LR


def test_layer_token_multiplier_golden():
    m = lambda t, **kw: layer_token_multiplier(t, 1000, 10000, **kw)  # noqa: E731
    assert m(500) == 0.5 and m(1000) == 1.0
    assert m(10000, min_lr_ratio=0.1) == pytest.approx(0.1) and m(10**9, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert m(5500, decay="linear") == pytest.approx(0.5)
    assert m(5500) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="exceed"):
        layer_token_multiplier(0, 10, 10)
    with pytest.raises(ValueError, match="decay"):
        layer_token_multiplier(0, 1, 10, decay="step")


def test_layer_token_lr_in_a_fit_reads_the_tokens_of_finished_steps(tmp_path):
    cb = ltd(max_value=16, require_steps=4)
    seen = []

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append((trainer.optimizers[0].param_groups[0]["lr"], cb.consumed_layer_tokens))

    warmup, total = 2000, 20000

    def scheduler(opt, total_steps, progress=None):
        return layer_token_lr(opt, cb, warmup, total, decay="linear", min_lr_ratio=0.0)

    pl.seed_everything(0)
    model = deep_gpt2(scheduler=scheduler)
    trainer = make_trainer(tmp_path, [cb, Probe()], max_steps=6, max_epochs=-1)
    trainer.fit(model, datamodule=tiny_lm_data())
    for lr, consumed in seen:
        assert lr == pytest.approx(0.05 * layer_token_multiplier(consumed, warmup, total, "linear"), rel=1e-12)
    assert seen[0] == (0.0, 0) and seen[1][1] == F.layer_tokens(8, 16, 4, 4, 2)


@pytest.mark.parametrize("warmup", [0, 1000])
def test_layer_token_lr_with_the_default_total_resumes_past_the_warmup(tmp_path, warmup):
    """``LambdaLR``'s constructor reads the multiplier before train start: a fit resumed past the warmup with
    ``total_layer_tokens=None`` raised there (the run's length is known at train start only, qa92-user 01), and so did
    a fresh fit with ``warmup_layer_tokens=0``. The resumed fit's LRs and weights are the uninterrupted fit's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    runs = []
    for ckpt_path in (None, str(tmp_path / "ck" / "step=3.ckpt")):
        pl.seed_everything(0)
        cb, lrs = ltd(max_value=16, require_steps=4), []

        class Probe(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx, lrs=lrs):
                lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

        def scheduler(opt, total_steps, progress=None, cb=cb):
            return layer_token_lr(opt, cb, warmup, None, decay="linear")

        model = deep_gpt2(scheduler=scheduler)
        extra = [ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1, filename="{step}")]
        trainer = make_trainer(tmp_path, [cb, Probe(), *(extra if ckpt_path is None else [])], max_steps=6)
        trainer.fit(model, datamodule=tiny_lm_data(), ckpt_path=ckpt_path)
        runs.append((lrs, model, cb))
    (full_lrs, full_model, full_cb), (lrs, model, cb) = runs
    assert full_cb.consumed_layer_tokens > warmup and lrs == full_lrs[3:]
    assert full_lrs[0] == (1.0 if warmup == 0 else 0.0) * 0.05 and full_lrs[-1] < max(full_lrs)
    for a, b in zip(full_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(min_value=0), "min_value"),
        (dict(min_value=20, max_value=10), "min_value .* <= max_value"),
        (dict(layer_ids=[2, 1]), "sorted"),
        (dict(layer_ids=[-1]), "layer_ids"),
        (dict(rounding="up"), "rounding"),
        (dict(require_steps=3, require_fraction=0.5), "not both"),
        (dict(require_fraction=1.5), "require_fraction"),
        (dict(require_steps="0.5dur", require_fraction=0.5), "not both"),
        (dict(require_steps=0.8), r"require_steps: a float .* write '0\.8dur'"),
        (dict(require_steps=0.25), r"require_steps: a float .* write '0\.25dur'"),
        (dict(require_steps=100.0), r"require_steps: a float .* int of optimizer steps"),
        (dict(require_steps=0), "require_steps must be an int >= 1"),
        (dict(require_steps=True), "require_steps"),
        (dict(require_steps="0dur"), "require_steps must be at least one step"),
        (dict(require_steps="0ep"), "require_steps must be at least one step"),
        (dict(require_steps="1.5dur"), "require_steps"),
        (dict(require_steps="1e6tok"), "require_steps=.* in tokens"),
        (dict(require_steps="500"), "require_steps: cannot read"),
        (dict(accounting="max"), "accounting"),
        (dict(keep_prefix_tokens=-1), "keep_prefix_tokens"),
        (dict(seq_per_step=2.5), "seq_per_step"),
        (dict(adapter=3), "adapter"),
    ],
)
def test_construction_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RandomLTDCallback(**kwargs)


@pytest.mark.parametrize(
    ("cb_kwargs", "model_fn", "match"),
    [
        (dict(layer_ids=[1, 4]), deep_gpt2, "out of range"),
        (dict(max_value=64), deep_gpt2, "larger than the longest sequence the model takes .*max_sequence_length"),
        (
            dict(min_value=40),
            deep_gpt2,
            r"min_value \(40\) is larger than the sequence length the patched layers see \(16",
        ),
        (dict(), tiny_gpt2, r"default .* selects none; .* in \[0, 2\) \(the first is 0\), e.g. layer_ids=\[1\]"),
        (dict(adapter="timm_vit"), deep_gpt2, "no model inside"),
    ],
)
def test_setup_errors(tmp_path, cb_kwargs, model_fn, match):
    cb = RandomLTDCallback(**({"min_value": 4, "require_steps": 4} | cb_kwargs))
    trainer = make_trainer(tmp_path, [cb], max_steps=2, max_epochs=-1)
    with pytest.raises(ValueError, match=match):
        trainer.fit(model_fn(), datamodule=tiny_lm_data())


def test_cnn_has_no_adapter(tmp_path):
    from tests.helpers.tiny import tiny_cnn

    trainer = make_trainer(tmp_path, [RandomLTDCallback(min_value=4)], max_steps=1, max_epochs=-1)
    with pytest.raises(ValueError, match="no model inside"):
        trainer.fit(tiny_cnn(), datamodule=tiny_image_data())


def test_unknown_run_length_needs_require_steps(tmp_path):
    trainer = make_trainer(tmp_path, [RandomLTDCallback(min_value=4)], max_steps=-1, max_epochs=-1)
    with pytest.raises(ValueError, match=r"require_steps='1dur': .*unknown \(max_epochs=-1 and max_steps=-1\)"):
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())


def test_a_loader_without_a_length_is_named_as_the_unknown_length(tmp_path):
    """With max_epochs=2 over an IterableDataset the message said "(max_epochs=-1 and max_steps=-1)"."""
    from tests.helpers.tiny import TokenStreamData

    trainer = make_trainer(tmp_path, [RandomLTDCallback(min_value=4)], max_epochs=2)
    with pytest.raises(ValueError, match=r"max_epochs=2 over a train dataloader without a length .*Trainer\(max_steps"):
        trainer.fit(deep_gpt2(), datamodule=TokenStreamData())


def test_require_fraction_of_the_run(tmp_path):
    with pytest.warns(DeprecationWarning, match="require_fraction"):
        cb = RandomLTDCallback(min_value=4, require_fraction=0.5)
    trainer = make_trainer(tmp_path, [cb], max_epochs=2)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
    assert cb.require_steps == math.ceil(0.5 * 10)  # 40 samples / batch 8 = 5 steps per epoch, 2 epochs


def test_a_fraction_of_the_run_counts_a_gradient_accumulation_schedulers_factors(tmp_path):
    """'1dur' resolved against Lightning's estimate, which divides every epoch by the first epoch's factor: 8 steps
    for a run of 6 (5 batches, then 3 steps of 2), so the schedule never finished (qa58-break 05)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    cb = RandomLTDCallback(min_value=4, seq_per_step=1)
    trainer = make_trainer(tmp_path, [cb, GradientAccumulationScheduler({0: 1, 1: 2})], max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
    assert trainer.global_step == 5 + 3 == cb.require_steps == cb.total_steps
    assert not [w for w in caught if "before the" in str(w.message)]
    # the layer-token LR's default total follows epoch 1's steps of two micro-batches (3,200 for 4,096, qa59-break 03)
    assert cb.expected_total_layer_tokens() == cb.consumed_layer_tokens == 4096
    # epochs at the scheduler's factor from the first epoch ('1ep' of {0: 2} resolved to 5, qa59-break 02), and the
    # V-cycle's stages in epochs fit the run they were refused in
    cb = RandomLTDCallback(min_value=4, seq_per_step=1, require_steps="1ep")
    trainer = make_trainer(tmp_path / "ep", [cb, GradientAccumulationScheduler({0: 2})], max_epochs=3)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
    assert trainer.global_step == 9 and cb.require_steps == 3
    from lightning_effi.callbacks import VCycleCallback

    vc = VCycleCallback(e_a="1ep", e_small="1ep")
    trainer = make_trainer(tmp_path / "vc", [vc, GradientAccumulationScheduler({0: 2})], max_epochs=3)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
    assert vc.stage_ends[:2] == [3, 6]
    # each epoch at its own factor: 5 batches, {0: 1, 1: 2} over 3 epochs end at steps 5, 8 and 11 ('2ep' was 10 and
    # the V-cycle's second stage ended at 10, qa60-break 02)
    cb = RandomLTDCallback(min_value=4, seq_per_step=1, require_steps="2ep")
    vc = VCycleCallback(e_a="1ep", e_small="1ep")
    schedule = GradientAccumulationScheduler({0: 1, 1: 2})
    for i, callback in enumerate((cb, vc)):
        trainer = make_trainer(tmp_path / f"changing{i}", [callback, schedule], max_epochs=3)
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
        assert trainer.global_step == 11
    assert cb.require_steps == 8 and vc.stage_ends[:2] == [5, 8]


# ------------------------------------------------------------------------------------------------ require_steps


def _fit_schedule(tmp_path, cb_kwargs, **trainer_kwargs):
    """Fit a 4-layer GPT-2 with random-LTD; returns the callback and the reserved length of every batch."""
    pl.seed_everything(0)
    cb = RandomLTDCallback(**({"min_value": 4, "max_value": 16, "seq_per_step": 4, "seed": 7} | cb_kwargs))
    watch = Watch(cb)
    trainer = make_trainer(tmp_path, [cb, watch], **trainer_kwargs)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
    return cb, [row["r"] for row in watch.rows]


@pytest.mark.parametrize(
    ("new", "fraction", "trainer_kwargs", "expected"),
    [
        ("0.5dur", 0.5, dict(max_epochs=2), 5),  # T = estimated_stepping_batches = 10, at train start
        (Duration(0.3, "fraction"), 0.3, dict(max_steps=7, max_epochs=-1), 3),  # ceil(0.3 * 7), T = max_steps, in setup
        ("0.01dur", 0.01, dict(max_steps=7, max_epochs=-1), 1),  # at least 1
        ("1dur", None, dict(max_epochs=1), 5),  # None: neither given, the default (the whole run)
    ],
)
def test_require_steps_fraction_equals_require_fraction(tmp_path, new, fraction, trainer_kwargs, expected):
    cb_new, rs_new = _fit_schedule(tmp_path / "new", dict(require_steps=new), **trainer_kwargs)
    if fraction is None:
        cb_old, rs_old = _fit_schedule(tmp_path / "old", {}, **trainer_kwargs)
    else:
        with pytest.warns(DeprecationWarning, match="require_steps="):
            cb_old, rs_old = _fit_schedule(tmp_path / "old", dict(require_fraction=fraction), **trainer_kwargs)
    assert cb_new.require_steps == cb_old.require_steps == expected
    assert rs_new == rs_old == [F.ltd_value(s, 4, 16, expected, 4) for s in range(len(rs_new))]
    assert cb_new.config() == cb_old.config() and cb_new.state_key == cb_old.state_key


def test_require_steps_fraction_of_an_epoch_bounded_run(tmp_path):
    """max_steps set but max_epochs ends the run first: a fraction is of the steps the run has (run_length, as the
    V-cycle reads it), not of max_steps, so the growth finishes within the run."""
    cb, rs = _fit_schedule(tmp_path, dict(require_steps="0.5dur"), max_steps=1000, max_epochs=1)
    assert cb.require_steps == 3  # ceil(0.5 * 5): 40 samples / batch 8 = 5 steps, not ceil(0.5 * 1000)
    assert rs == [F.ltd_value(s, 4, 16, 3, 4) for s in range(5)] and rs[-1] == 16


def test_require_steps_step_spellings_are_the_int(tmp_path):
    cb_int, rs_int = _fit_schedule(tmp_path / "int", dict(require_steps=3), max_steps=5, max_epochs=-1)
    for spelling in ("3st", "3ba", Duration(3)):
        cb = RandomLTDCallback(min_value=4, max_value=16, seq_per_step=4, seed=7, require_steps=spelling)
        assert cb.require_steps == 3 and cb.state_key == cb_int.state_key
    cb, rs = _fit_schedule(tmp_path / "st", dict(require_steps="3st"), max_steps=5, max_epochs=-1)
    assert rs == rs_int == [4, 8, 12, 16, 16] and cb.config() == cb_int.config()


@pytest.mark.parametrize(
    ("epochs", "accumulate", "expected"),
    [
        (1, 1, 5),  # 40 samples / batch 8 = 5 batches = 5 optimizer steps per epoch
        (2, 2, 6),  # ceil(5 / 2) = 3 optimizer steps per epoch
    ],
)
def test_require_steps_in_epochs(tmp_path, epochs, accumulate, expected):
    cb, rs = _fit_schedule(
        tmp_path / "ep", dict(require_steps=f"{epochs}ep"), max_epochs=3, accumulate_grad_batches=accumulate
    )
    cb_steps, rs_steps = _fit_schedule(
        tmp_path / "st", dict(require_steps=expected), max_epochs=3, accumulate_grad_batches=accumulate
    )
    assert cb.require_steps == expected
    assert rs == rs_steps and cb.config() == cb_steps.config()
    assert repr(cb).count(f"require_steps='{epochs}ep'") == 1


def test_require_fraction_is_deprecated():
    with pytest.warns(DeprecationWarning, match=r"require_fraction is deprecated.*require_steps='0\.5dur'"):
        cb = RandomLTDCallback(require_fraction=0.5)
    new = RandomLTDCallback(require_steps="0.5dur")
    assert cb.require_duration == new.require_duration == Duration(0.5, "fraction")
    assert cb.state_key == new.state_key and cb.config() == new.config()


def test_state_key_keeps_its_pre_duration_form():
    """The checkpoint key of a run written before require_steps took durations: a fixed step count or None."""
    key = (
        "RandomLTDCallback{{'min_value': 4, 'max_value': 16, 'require_steps': {}, 'seq_per_step': 4, "
        "'layer_ids': None}}"
    )
    kw = dict(min_value=4, max_value=16, seq_per_step=4)
    for spelling in ("0.5dur", "2ep", Duration(0.8, "fraction"), None):
        assert RandomLTDCallback(**kw, require_steps=spelling).state_key == key.format("None")
    for spelling in (6, "6st"):
        assert RandomLTDCallback(**kw, require_steps=spelling).state_key == key.format("6")


def test_resume_a_require_fraction_checkpoint_with_require_steps_dur(tmp_path):
    """A checkpoint written with require_fraction (the pre-Duration spelling; the state is unchanged) resumes with
    require_steps='0.5dur' in the same run: the schedule continues with the checkpoint's require_steps. In a longer
    run the fraction gives other steps, but the checkpoint's schedule had ended (max_value at step 2), so it is kept
    (an unfinished one is refused: test_resume_with_another_derived_require_steps)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    with pytest.warns(DeprecationWarning):
        old = ltd(max_value=16, require_steps=None, require_fraction=0.5)
    trainer = make_trainer(tmp_path, [old, ckpt], max_steps=4, max_epochs=-1)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())
    state = torch.load(tmp_path / "ck" / "step=2.ckpt", weights_only=True)["callbacks"]
    assert state[old.state_key]["config"]["require_steps"] == old.require_steps == 2
    cb = ltd(max_value=16, require_steps="0.5dur")
    assert cb.state_key == old.state_key
    watch = Watch(cb)
    trainer = make_trainer(tmp_path, [cb, watch], max_steps=4, max_epochs=-1)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=2.ckpt"))
    assert cb.require_steps == 2 and trainer.global_step == 4  # ceil(0.5 * 4): the schedule continues
    assert [r["r"] for r in watch.rows] == [F.ltd_value(s, 4, 16, 2, 4) for s in range(2, 4)] == [16] * 2
    # the checkpoint's schedule had reached max_value at step 2: a longer run goes on at max_value (its own 0.5dur,
    # 3 steps, would lower the reserved length to 12 at step 2)
    cb = ltd(max_value=16, require_steps="0.5dur")
    watch = Watch(cb)
    trainer = make_trainer(tmp_path, [cb, watch], max_steps=6, max_epochs=-1)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=2.ckpt"))
    assert cb.require_steps == 2 and [r["r"] for r in watch.rows] == [16] * 4
    assert F.ltd_value(2, 4, 16, 3, 4) == 12


def _checkpoint_at_step_3(root):
    """A run of 8 steps with require_steps='0.5dur' (4 steps), a checkpoint after every step."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    first = ltd(max_value=16, require_steps="0.5dur")
    make_trainer(root / "a", [first, ckpt], max_steps=8, max_epochs=-1).fit(deep_gpt2(), datamodule=tiny_lm_data())
    assert first.require_steps == 4
    return str(root / "ck" / "step=3.ckpt")


def _resume_ltd(root, cb, path):
    watch = Watch(cb)
    trainer = make_trainer(root, [cb, watch], max_steps=8, max_epochs=-1)
    trainer.fit(deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=path)
    return trainer, [row["r"] for row in watch.rows]


@pytest.mark.parametrize(("require_steps", "steps"), [("0.25dur", 2), ("1ep", 5), (Duration(1.0, "fraction"), 8)])
def test_resume_with_another_derived_require_steps(tmp_path, require_steps, steps):
    """Saved with require_steps='0.5dur' (4 of 8 steps), resumed with a fraction or epochs giving other steps:
    strict raises when training starts; not strict warns and the schedule continues with the current arguments'
    step count (the state key, without the derived count, is unchanged)."""
    path = _checkpoint_at_step_3(tmp_path)
    with pytest.raises(ValueError, match=rf"gives {steps} optimizer steps .*require_steps=4 .*strict=False"):
        _resume_ltd(tmp_path / "strict", ltd(max_value=16, require_steps=require_steps), path)
    cb = ltd(max_value=16, require_steps=require_steps, strict=False)
    with pytest.warns(UserWarning, match=rf"strict=False: continue the schedule with require_steps={steps} \(the"):
        trainer, rs = _resume_ltd(tmp_path / "lenient", cb, path)
    assert cb.require_steps == steps and trainer.global_step == 8
    assert rs == [F.ltd_value(s, 4, 16, steps, 4) for s in range(3, 8)]
    assert cb.state_dict()["config"]["require_steps"] == steps


@pytest.mark.parametrize("require_steps", ["0.5dur", "0.45dur", Duration(0.5, "fraction")])  # ceil(0.45 * 8) = 4
def test_resume_with_the_same_derived_require_steps(tmp_path, require_steps):
    path = _checkpoint_at_step_3(tmp_path)
    cb = ltd(max_value=16, require_steps=require_steps)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*RandomLTDCallback.*")
        trainer, rs = _resume_ltd(tmp_path / "b", cb, path)
    assert cb.require_steps == 4 and trainer.global_step == 8
    assert rs == [F.ltd_value(s, 4, 16, 4, 4) for s in range(3, 8)]


# ------------------------------------------------------------------------------------------------ repr, requirements


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        dict(
            min_value=8,
            max_value=64,
            require_steps=100,
            seq_per_step=8,
            layer_ids=[1, 2],
            adapter="hf_gpt2",
            rounding="deepspeed",
            keep_prefix_tokens="auto",
            accounting="deepspeed",
            seed=3,
            strict=False,
        ),
        dict(require_fraction=0.5, layer_ids=[2], keep_prefix_tokens=1),
        dict(require_steps="0.8dur"),
        dict(require_steps="2ep"),
        dict(require_steps="500st"),
        dict(require_steps=Duration(0.123456789, "fraction")),
    ],
)
@pytest.mark.filterwarnings("ignore:.*require_fraction is deprecated:DeprecationWarning")
def test_repr_evaluates_to_an_equal_callback(kwargs):
    cb = RandomLTDCallback(**kwargs)
    text = repr(cb)
    for name in (
        "min_value",
        "max_value",
        "require_steps",
        "seq_per_step",
        "layer_ids",
        "adapter",
        "rounding",
        "keep_prefix_tokens",
        "accounting",
        "seed",
        "strict",
    ):
        assert f"{name}=" in text
    assert "require_fraction=" not in text  # a deprecated require_fraction shows as require_steps='<f>dur'
    again = eval(text, {"RandomLTDCallback": RandomLTDCallback})
    assert repr(again) == text and again.state_key == cb.state_key and again.config() == cb.config()
    assert again.require_duration == cb.require_duration


def test_repr_shows_require_steps_as_given():
    assert "require_steps=100," in repr(RandomLTDCallback(require_steps=100))
    assert "require_steps='0.8dur'," in repr(RandomLTDCallback(require_steps="0.8dur"))
    assert "require_steps='0.5dur'," in repr(RandomLTDCallback(require_steps=Duration(0.5, "fraction")))
    assert "require_steps=None, seq_per_step" in repr(RandomLTDCallback())
    with pytest.warns(DeprecationWarning):
        assert "require_steps='0.8dur', seq_per_step" in repr(RandomLTDCallback(require_fraction=0.8))


@pytest.mark.filterwarnings("ignore:.*require_fraction is deprecated:DeprecationWarning")
def test_repr_of_numpy_arguments_is_plain():
    import numpy as np

    cb = RandomLTDCallback(
        min_value=np.int64(8),
        max_value=np.int64(16),
        layer_ids=np.array([1, 2]).tolist(),
        seed=np.int64(5),
        require_fraction=np.float64(0.5),
    )
    again = eval(repr(cb), {"RandomLTDCallback": RandomLTDCallback})
    assert repr(again) == repr(cb) and type(again.seed) is int and type(again.min_value) is int


def test_repr_with_an_adapter_instance_shows_the_adapter():
    cb = RandomLTDCallback(adapter=GenericAdapter("model.blocks", max_sequence_length=16, hidden_size=8))
    assert "adapter=GenericAdapter(" in repr(cb)  # not evaluable: documented


def test_requirements_are_declared_and_match_metadata():
    req = RandomLTDCallback.requirements
    assert isinstance(req, Requirements)
    assert req.patches_layers and req.follows_model_changes and req.batch_structures == BATCH_STRUCTURES
    assert not (
        req.owns_train_sampler
        or req.changes_epoch_length
        or req.changes_model_shapes
        or req.needs_per_sample_loss
        or req.edits_batch
    )
    folder = Path(lightning_effi.random_ltd.__file__).parent
    metadata = json.loads((folder / "metadata.json").read_text())
    assert metadata["requirements"] == json.loads(json.dumps(req.as_dict()))  # tuples as lists
    assert metadata["class_name"] == RandomLTDCallback.__name__
    root = folder.parent.parent
    assert (root / metadata["card"]).is_file() and (root / metadata["hydra"]).is_file()


class ShapeChanger(Callback):
    """A stand-in technique that replaces the model's network during fit (as the V-cycle does): after step 2 the GPT-2
    of 4 layers becomes a fresh one of 3 (``effi_model_depths`` says so in advance), telling the followers."""

    requirements = Requirements(changes_model_shapes=True)

    def __init__(self, depths=(4, 3)):
        self.depths = list(depths)

    def effi_model_depths(self, pl_module):
        return self.depths

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            from transformers import GPT2LMHeadModel

            for cb in trainer.callbacks:
                if hasattr(cb, "effi_before_model_change"):
                    cb.effi_before_model_change(trainer, pl_module)
            config = pl_module.model.config.to_dict() | {"n_layer": self.depths[1]}
            pl_module.model = GPT2LMHeadModel(type(pl_module.model.config).from_dict(config))
            for cb in trainer.callbacks:
                if hasattr(cb, "effi_after_model_change"):
                    cb.effi_after_model_change(trainer, pl_module)
            trainer.strategy.setup_optimizers(trainer)


def test_follows_a_technique_that_changes_model_shapes(tmp_path):
    """Not refused (random-LTD follows model changes): the patch moves to the new network (default ids: all but the
    first and the last of its 3 layers), the schedule and the counters go on (layer-tokens with each step's depth),
    and nothing stays patched after the fit."""
    cb = ltd(max_value=16, require_steps=4)
    watch = Watch(cb)
    model = deep_gpt2()
    old = model.model
    trainer = make_trainer(tmp_path, [cb, ShapeChanger(), watch], max_steps=4, max_epochs=-1)
    trainer.fit(model, datamodule=tiny_lm_data())
    assert model.model is not old and len(model.model.transformer.h) == 3
    assert cb.num_layers == 3 and cb.layer_ids == (1,) and cb.controller.layer_ids == (1,)
    assert [r["r"] for r in watch.rows] == [F.ltd_value(s, 4, 16, 4, 4) for s in range(4)]
    depths = [4, 4, 3, 3]
    assert cb.consumed_layer_tokens == sum(
        F.layer_tokens(8, 16, min(r["r"], 16), d, d - 2) for r, d in zip(watch.rows, depths)
    )
    assert [None if r["indices"] is None else r["indices"].shape[0] for r in watch.rows][:3] == [2, 2, 1]
    assert not is_converted(model) and not is_converted(old)


def test_layer_ids_must_exist_at_every_depth_of_a_shape_change(tmp_path):
    model = deep_gpt2()
    trainer = make_trainer(tmp_path, [ltd(max_value=16, layer_ids=[2, 3]), ShapeChanger((4, 3))], max_steps=1)
    with pytest.raises(ValueError, match=r"layer_ids=\[2, 3\]: ShapeChanger trains a network of 3 layers at level 2"):
        trainer.fit(model, datamodule=tiny_lm_data())
    assert not is_converted(model)


def test_a_layer_patcher_that_does_not_follow_is_refused(tmp_path):
    class Patcher(Callback):
        requirements = Requirements(patches_layers=True)

        def setup(self, trainer, pl_module, stage):
            check_trainer(trainer)

    trainer = make_trainer(tmp_path, [ShapeChanger(), Patcher()], max_steps=1, max_epochs=-1)
    with pytest.raises(IncompatibleTechniques, match="layer patching across shape changes"):
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data())


def test_generic_adapter_rebinds_to_the_new_network():
    from torch import nn

    module = nn.Module()
    module.model = nn.Module()
    module.model.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
    adapter = GenericAdapter("model.blocks", max_sequence_length=8, hidden_size=4).bind(module)
    first = adapter.layers()
    module.model = nn.Module()
    module.model.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
    assert adapter.bind(module).layers() is first  # binding the same module again is a no-op
    assert adapter.rebind(module) is adapter and len(adapter.layers()) == 2 and adapter.layers() is not first


# ------------------------------------------------------------------------------------------------ DDP


class _RankDump(Callback):
    """Per rank (ddp_spawn processes): the LTD indices and a parameter fingerprint after every batch, dumped as JSON."""

    def __init__(self, ltd_cb, out_dir):
        self.ltd, self.out_dir, self.rows = ltd_cb, str(out_dir), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        self.rows.append(
            {
                "indices": self.ltd.controller.last_indices().tolist(),
                "params": params[::97].tolist(),
                "consumed": self.ltd.consumed_layer_tokens,
            }
        )

    def on_fit_end(self, trainer, pl_module):
        import json
        from pathlib import Path

        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.out_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


@pytest.mark.slow
def test_ddp_two_processes(tmp_path):
    import json

    cb = ltd(max_value=16, require_steps=4)
    fit_ddp(
        deep_gpt2(), tiny_lm_data(), tmp_path, [cb, _RankDump(cb, tmp_path / "dump")], max_steps=3, max_epochs=-1
    )  # DDP default: find_unused_parameters=False
    rank0, rank1 = (json.loads((tmp_path / "dump" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(rank0) == len(rank1) == 3
    for a, b in zip(rank0, rank1):
        assert a["indices"] != b["indices"]  # ranks draw different tokens
        assert a["params"] == b["params"]  # and stay in sync
        assert a["consumed"] == b["consumed"]  # layer-tokens are summed over ranks
    assert rank0[0]["consumed"] == 2 * F.layer_tokens(8, 16, 4, 4, 2)  # 2 ranks x batch 8


class _ShardedVarLength(pl.LightningDataModule):
    """32 token rows: rank 0's first batch (its shard ``[0::2]``, no distributed sampler) padded to 8 tokens, every
    other batch to 16."""

    def train_dataloader(self) -> DataLoader:
        from lightning_effi.core.loader import EpochShuffleSampler

        g = torch.Generator().manual_seed(0)
        lengths = [8 if i % 2 == 0 and i < 8 else 16 for i in range(32)]
        rows = [{"input_ids": torch.randint(1, 64, (n,), generator=g)} for n in lengths]
        t = self.trainer
        sampler = EpochShuffleSampler(rows, num_replicas=t.world_size, rank=t.global_rank, shuffle=False)
        return DataLoader(rows, batch_size=4, sampler=sampler, collate_fn=PaddingCollate(pad_token_id=0))


@pytest.mark.slow
def test_ddp_checks_the_longest_first_batch_over_the_ranks(tmp_path):
    """A min_value valid for the run (its first batches over the ranks: 8 and 16 tokens) was refused on rank 0 alone,
    whose first batch is 8 tokens, and derived max_value 8 there, while rank 1 died waiting (qa113-ddp 01). Checked
    and derived on the longest over the ranks: both train; a min_value above it is warned on every rank alike."""
    cb = ltd(min_value=10, seq_per_step=1, layer_ids=[1])
    no_sampler = {"use_distributed_sampler": False}
    _, ranks = fit_ddp(tiny_gpt2(), _ShardedVarLength(), tmp_path, [cb], max_steps=2, **no_sampler)
    assert [r["global_step"] for r in ranks] == [2, 2]
    # above every first batch of samples of varying lengths: warned on every rank alike (a later batch may be longer)
    above = ltd(min_value=17, seq_per_step=1, layer_ids=[1])
    _, ranks = fit_ddp(tiny_gpt2(), _ShardedVarLength(), tmp_path / "above", [above], max_steps=2, **no_sampler)
    assert [r["global_step"] for r in ranks] == [2, 2]


# ------------------------------------------------------------------------------------------------ the progress clock
def ib_lm_data():
    return InfoBatchDataModule(TinyDataModule(TokenBlocks(n=40), batch_size=8))


def infobatch():
    return InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7)


class ClockedR(Callback):
    """Per training batch: ``[optimizer step, InfoBatch's effi_progress_done() at the batch's start, r]``.
    Checkpointed, so a resumed run's final state holds the rows of both halves."""

    def __init__(self) -> None:
        self.rows: list[list] = []
        self._progress = -1.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._progress = next(c for c in trainer.callbacks if isinstance(c, InfoBatchCallback)).effi_progress_done()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ltd_cb = next(c for c in trainer.callbacks if isinstance(c, RandomLTDCallback))
        self.rows.append([trainer.global_step - 1, self._progress, ltd_cb.current_value])

    def state_dict(self):
        return {"rows": [list(r) for r in self.rows]}

    def load_state_dict(self, state_dict):
        self.rows = [list(r) for r in state_dict["rows"]]


def _fit_on_the_clock(root, **ltd_kwargs):
    pl.seed_everything(0)
    ib, cb, log = infobatch(), ltd(max_value=16, **ltd_kwargs), ClockedR()
    trainer = make_trainer(root, [ib, cb, log], max_epochs=4)
    trainer.fit(deep_gpt2(), datamodule=ib_lm_data())
    return trainer, ib, cb, log


def test_epochs_on_the_clock_count_the_clocks_own_epochs(tmp_path):
    """InfoBatch with ``num_epochs=2`` in a 4-epoch run: its progress runs over 2 epochs, so ``"1ep"`` is half of it
    and the growth spans epoch 0, reaching max_value at epoch 1's first step (it was 1 / max_epochs, a quarter:
    max_value after half of epoch 0, qa86-break 11)."""
    pl.seed_everything(0)
    ib = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7, num_epochs=2)
    cb, log = ltd(max_value=16, require_steps="1ep"), ClockedR()
    with pytest.warns(UserWarning, match="num_epochs"):
        make_trainer(tmp_path, [ib, cb, log], max_epochs=4).fit(deep_gpt2(), datamodule=ib_lm_data())
    assert ib.effi_clock_epochs() == 2 and cb.require_share == Fraction(1, 2)
    epoch0 = [r for _, p, r in log.rows if p < Fraction(1, 2)]
    assert len(epoch0) == 5 and 16 not in epoch0 and log.rows[5][2] == 16


@pytest.mark.parametrize(
    ("require_steps", "rounding", "ticks"),
    [
        ("0.8dur", "clamped", 800_000_000),
        ("0.8dur", "deepspeed", 800_000_000),
        ("2ep", "clamped", 500_000_000),  # 2 of max_epochs = 4
        (None, "clamped", 1_000_000_000),  # the default: the whole run
    ],
)
def test_derived_schedule_follows_infobatchs_progress(tmp_path, require_steps, rounding, ticks):
    """Under InfoBatch (epochs of 5, <5, <5, 5 steps where estimated_stepping_batches counts 20) a fraction or epochs
    is a share of its training progress: the batches of each step use the growth at ``p / f`` exactly, with ``p`` the
    progress before the step, ``(e + j / L_e) / 4``, and ``f`` the share (``ltd_value(p·n, min, max, f·n,
    seq_per_step, rounding)`` for a common denominator ``n``), so the growth ends where the share of the run ends,
    however short the epochs get."""
    trainer, ib, cb, log = _fit_on_the_clock(tmp_path, require_steps=require_steps, rounding=rounding)
    assert cb.clock == "progress" and cb.require_progress == ticks and cb.require_steps is None
    assert cb.config()["clock"] == "progress" and cb.config()["require_progress"] == ticks
    lengths = [math.ceil(h["size"] / 8) for h in ib.history]
    assert lengths[0] == lengths[3] == 5 and lengths[1] < 5 and lengths[2] < 5
    progress = [(e + j / length) / 4 for e, length in enumerate(lengths) for j in range(length)]
    assert [row[0] for row in log.rows] == list(range(sum(lengths))) == list(range(trainer.global_step))
    assert [row[1] for row in log.rows] == progress
    share = Fraction(ticks, 10**9)
    exact = [Fraction(e * length + j, 4 * length) for e, length in enumerate(lengths) for j in range(length)]
    n = [p.denominator * share.denominator for p in exact]
    expected = [F.ltd_value(int(p * d), 4, 16, int(share * d), 4, rounding) for p, d in zip(exact, n)]
    assert [row[2] for row in log.rows] == expected
    assert expected[0] == 4 and len(set(expected)) > 2  # grows from min_value
    assert trainer.global_step < trainer.estimated_stepping_batches == 20  # the epochs shortened
    if require_steps == "0.8dur" and rounding == "clamped":  # max_value from progress 0.8 on, and only there
        assert [r == 16 for r in expected] == [p >= 0.8 for p in progress] and expected[-1] == 16
    if require_steps == "2ep":  # max_value from the start of epoch 2 on
        assert [r for p, r in zip(progress, expected) if p >= 0.5] == [16] * (lengths[2] + lengths[3])
        assert all(r < 16 for p, r in zip(progress, expected) if p < 0.5)


def test_a_progress_growth_reaches_its_boundaries_on_time():
    """The progress ``p`` and the share ``f`` are exact fractions and the growth is the step formula at ``p / f``.
    Held in ticks of 1e-9, a boundary ``k / n`` that rounds down (1/3 reads 333333333) was read below it and stayed
    one step at the last value (r = 4 at step 8 of 24 where the step schedule gives 8, qa79-stack 01), and so under a
    share that rounds up (2 of 3 epochs: r = 8 at 4/9 where 12 is due, qa81-break 04); read a tick later instead, a
    step less than 1.5 ticks before a boundary got the next value a step early (qa82-break 03: 1551 for 1550 at step
    372367 of a 999,998-step run growing over half of it). Every progress ``j / (E·L)`` of E epochs of L steps gives
    ``ltd_value`` at ``p / f`` in whole numbers, and a growth over ``S`` of ``T`` steps is the step schedule's."""
    cb = ltd()
    cb.clock, cb.max_value = "progress", 16
    for epochs in (1, 3, 7, 9):
        for share in {Fraction(n, epochs) for n in range(1, epochs + 1)}:
            cb.require_share, cb.require_progress = share, round(share * 10**9)
            for length in range(1, 7):
                for j in range(epochs * length + 1):
                    x = Fraction(j, epochs * length) / share  # p / f
                    got = cb.value_at_progress(Fraction(j, epochs * length))
                    assert got == F.ltd_value(x.numerator, 4, 16, x.denominator, 4), (epochs, share, length, j)
    cb.require_share = Fraction(1)
    assert cb.value_at_progress(Fraction(1, 3)) == 8 == F.ltd_value(8, 4, 16, 24, 4)
    cb.require_share = Fraction(2, 3)
    assert cb.value_at_progress(Fraction(4, 9)) == 12
    cb.require_share = Fraction(1, 10**9)  # '0dur': min_value at the start, max_value from the first tick
    assert cb.value_at_progress(0) == 4 and cb.value_at_progress(Fraction(1, 10**9)) == 16
    # a growth over S of T steps gives the step schedule's value at every step (seq_per_step=1: every token counts)
    long_run = ltd(min_value=101, max_value=2048, seq_per_step=1)
    long_run.clock, long_run.max_value = "progress", 2048
    for total, grow in ((999_998, 499_999), (3 * 7 * 11, 7 * 11), (1000, 1)):
        long_run.require_share = Fraction(grow, total)
        steps = range(total + 1) if total < 10_000 else range(372_300, 372_400)
        assert [long_run.value_at_progress(Fraction(s, total)) for s in steps] == [
            F.ltd_value(s, 101, 2048, grow, 1) for s in steps
        ], total
    long_run.require_share = Fraction(1, 2)
    assert long_run.value_at_progress(Fraction(372_367, 999_998)) == 1550  # 1551 read in ticks
    for bad in (-0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="progress must be a number in \\[0, 1\\]"):
            cb.value_at_progress(bad)


def test_a_step_count_keeps_the_step_schedule_under_infobatch(tmp_path):
    trainer, _, cb, log = _fit_on_the_clock(tmp_path, require_steps=6)
    assert cb.clock == "step" and cb.require_steps == 6 and cb.require_progress is None
    assert [row[2] for row in log.rows] == [F.ltd_value(s, 4, 16, 6, 4) for s in range(trainer.global_step)]
    with pytest.raises(RuntimeError, match="not on a progress clock"):
        cb.value_at_progress(0)


def test_progress_schedule_resumes_exactly(tmp_path):
    """Resumed mid-epoch inside InfoBatch's first prune epoch: the same reserved length at every later step."""
    pl.seed_everything(0, workers=True)
    probe = make_trainer(tmp_path / "probe", [infobatch()], max_epochs=4)
    probe.fit(deep_gpt2(), datamodule=ib_lm_data())
    _, b = assert_resume_equals_uninterrupted(
        deep_gpt2,
        ib_lm_data,
        tmp_path,
        total_steps=probe.global_step,
        resume_step=6,
        callbacks_fn=lambda: [infobatch(), ltd(max_value=16, require_steps="0.8dur"), ClockedR()],
        max_epochs=4,
    )
    cb = next(c for c in b.callbacks if isinstance(c, RandomLTDCallback))
    log = next(c for c in b.callbacks if isinstance(c, ClockedR))
    assert cb.clock == "progress" and len(log.rows) == probe.global_step and log.rows[-1][2] == 16
    with pytest.raises(RuntimeError, match="progress clock .* use value_at_progress"):
        cb.value_at(0)


def test_a_checkpoint_of_another_clock_is_reported_at_train_start(tmp_path):
    """Written on InfoBatch's progress clock, resumed without InfoBatch (the step clock): strict raises before any
    step, naming the clock; not strict warns and continues on the step clock."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = make_trainer(tmp_path / "a", [infobatch(), ltd(max_value=16, require_steps="0.8dur"), ckpt], max_epochs=4)
    trainer.fit(deep_gpt2(), datamodule=ib_lm_data())
    path = str(tmp_path / "ck" / "step=5.ckpt")  # the end of epoch 0
    cb = ltd(max_value=16, require_steps="0.8dur")
    trainer = make_trainer(tmp_path / "b", [cb], max_epochs=4)
    match = r"configuration differs \(checkpoint, now\): .*'clock': \('progress', 'step'\).*'require_progress': \(8"
    with pytest.raises(ValueError, match=match):
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=path)
    assert trainer.global_step == 5  # restored, not trained
    cb = ltd(max_value=16, require_steps="0.8dur", strict=False)
    trainer = make_trainer(tmp_path / "c", [cb], max_epochs=4)
    with pytest.warns(UserWarning, match="strict=False: continue the schedule with this run's clock"):
        trainer.fit(deep_gpt2(), datamodule=tiny_lm_data(), ckpt_path=path)
    assert cb.clock == "step" and cb.require_steps == 16 and trainer.global_step == 20  # ceil(0.8 * 20)
