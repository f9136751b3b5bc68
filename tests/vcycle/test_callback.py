"""VCycleCallback: the whole V-cycle inside one ``trainer.fit``: level changes on GPT-2, BERT and ViT, learning rates,
exact resume, stage lengths, FLOPs accounting, refused configurations, DDP."""

from __future__ import annotations

import copy
import importlib
import json
import warnings
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_effi.callbacks import VCycleCallback
from lightning_effi.core.flops import transformer_training_flops
from lightning_effi.core.lr_schedules import warmup_cosine, warmup_cosine_multiplier
from lightning_effi.core.progress import Duration
from lightning_effi.core.requirements import IncompatibleTechniques, Requirements
from lightning_effi.functional import vcycle as V
from lightning_effi.models.vcycle_base import find_vcycle_adapter
from lightning_effi.random_ltd.callback import RandomLTDCallback
from lightning_effi.vcycle.stages import stage_plan, vcycle_flops_fraction
from tests.helpers.harness import assert_resume_equals_uninterrupted, fit_ddp, make_trainer
from tests.helpers.tiny import (
    TINY_GPT2,
    TINY_VIT,
    TinyDataModule,
    TokenBlocks,
    sgd,
    tiny_bert_cls,
    tiny_bert_mlm,
    tiny_gpt2,
    tiny_image_data,
    tiny_lm_data,
    tiny_sentence_data,
    tiny_vit,
)

GPT4 = dict(n_layer=4, n_head=4)  # 3 levels: (4 layers, 32) -> (2, 16) -> (1, 8)


class Recorder(Callback):
    """Per optimizer step: the model's state dict, sizes, the optimizer's parameters and learning rates."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, Any]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        cfg = pl_module.model.config
        self.steps[trainer.global_step] = {
            "state": copy.deepcopy(pl_module.model.state_dict()),
            "model": pl_module.model,
            "sizes": (cfg.n_embd, cfg.n_head, cfg.n_layer),
            "opt_ids": [id(p) for g in opt.param_groups for p in g["params"]],
            "module_ids": {id(p) for p in pl_module.parameters()},
            "opt_state": len(opt.state),
            "lrs": [g["lr"] for g in opt.param_groups],
        }


def run(callbacks, max_steps, model=None, **kw):
    pl.seed_everything(0)
    model = model or tiny_gpt2()
    trainer = make_trainer(Path(kw.pop("root")), callbacks, max_steps=max_steps, max_epochs=-1, **kw)
    trainer.fit(model, datamodule=tiny_lm_data())
    return trainer, model


def test_stage_plan_and_flops_fraction():
    assert stage_plan(2, 5, 50) == [(1, 5), (2, 50)]
    assert stage_plan(3, 2, 4, [3]) == [(1, 2), (2, 2), (3, 4), (2, 3)]
    # official GPT-2 example: 12 layers x 768 -> 6 x 384, T 512, V 50257; 55K large + 50K small steps vs 100K
    big = transformer_training_flops(1, 512, 12, 768, None, 50257)
    small = transformer_training_flops(1, 512, 6, 384, None, 50257)
    assert vcycle_flops_fraction([(55_000, big), (50_000, small)], 100_000, big) == pytest.approx(0.671, abs=0.002)


def test_two_level_switch(tmp_path):
    pre, post = Recorder(), Recorder()
    cb = VCycleCallback(e_a=2, e_small=3, alpha_original=0.3, lr_multiplier={2: 4.0})
    trainer, model = run([pre, cb, post], 7, root=tmp_path)
    original = pre.steps[1]["model"]
    assert trainer.global_step == 7 and sorted(post.steps) == list(range(1, 8))
    sizes = {s: post.steps[s]["sizes"] for s in post.steps}
    assert sizes == {
        1: (32, 2, 2),
        2: (16, 1, 1),
        3: (16, 1, 1),
        4: (16, 1, 1),
        5: (32, 2, 2),
        6: (32, 2, 2),
        7: (32, 2, 2),
    }
    for s, rec in post.steps.items():  # the optimizer holds exactly the current model's parameters
        assert len(rec["opt_ids"]) == len(set(rec["opt_ids"])) and set(rec["opt_ids"]) == rec["module_ids"]
        assert rec["module_ids"] == {id(p) for p in rec["model"].parameters()}
        assert rec["lrs"] == ([0.2, 0.2] if 2 <= s < 5 else [0.05, 0.05])  # SGD lr 0.05, x4 on level 2
    small_ids = set(post.steps[2]["opt_ids"])
    assert not small_ids & {id(p) for p in original.parameters()}  # no parameter of the old model remains
    assert post.steps[2]["opt_state"] == 0 and post.steps[5]["opt_state"] == 0  # fresh optimizers
    assert post.steps[3]["opt_state"] > 0 and pre.steps[5]["sizes"] == (16, 1, 1)
    # weights: coalesce at step 2, interpolate(decoalesce(small), snapshot, alpha) at step 5, computed by hand
    plan = find_vcycle_adapter(original).plan(original, "half", "adjacent", "official")
    for k, v in V.coalesce(pre.steps[2]["state"], plan).items():
        assert torch.equal(post.steps[2]["state"][k], v), k
    expected = V.interpolate(V.decoalesce(pre.steps[5]["state"], plan), pre.steps[2]["state"], 0.3)
    for k, v in expected.items():
        assert torch.equal(post.steps[5]["state"][k], v), k
    assert model.model is original  # the large module itself comes back (ties intact)
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    assert cb.snapshots == {} and cb.level == 1 and cb.switches == 2 and model.effi_num_layers == 2
    assert "on_load_checkpoint" not in vars(model)  # teardown removed the resume wrapper
    # FLOPs: 4 large + 3 small steps vs 7 large, batches (8, 16)
    c1 = transformer_training_flops(8, 16, 2, 32, None, 64)
    c2 = transformer_training_flops(8, 16, 1, 16, None, 64)
    summary = cb.effi_summary()
    assert summary["vcycle/baseline_flops"] == 7 * c1 and summary["vcycle/flops"] == 4 * c1 + 3 * c2
    assert summary["vcycle/flops_saved_frac"] == pytest.approx(1 - vcycle_flops_fraction([(4, c1), (3, c2)], 7, c1))


def test_baseline_steps_sets_the_accounting_baseline(tmp_path):
    """A V-cycle of 7 steps (4 large, 3 small) against a 5-step baseline: the saving may be negative."""
    cb = VCycleCallback(e_a=2, e_small=3, baseline_steps=5)
    run([cb], 7, root=tmp_path)
    c1 = transformer_training_flops(8, 16, 2, 32, None, 64)
    c2 = transformer_training_flops(8, 16, 1, 16, None, 64)
    summary = cb.effi_summary()
    assert summary["vcycle/baseline_flops"] == pytest.approx(5 * c1)
    assert summary["vcycle/flops"] == 4 * c1 + 3 * c2
    assert summary["vcycle/flops_saved_frac"] == pytest.approx(1 - (4 * c1 + 3 * c2) / (5 * c1))
    assert cb.state_dict()["full_model_flops"] == 7 * c1 and cb.state_dict()["flops_steps"] == 7


def test_callback_reused_for_a_second_fit_starts_a_fresh_cycle(tmp_path):
    cb = VCycleCallback(e_a="0.3dur", e_small=3)
    run([cb], 7, root=tmp_path / "a")
    first = cb.effi_summary()
    assert cb.stage_ends == [2, 5]
    trainer, model = run([cb], 10, root=tmp_path / "b")  # a longer second fit: its own stage lengths
    assert cb.stage_ends == [3, 6] and cb.switches == 2 and cb.level == 1
    fresh = VCycleCallback(e_a="0.3dur", e_small=3)
    run([fresh], 10, root=tmp_path / "c")

    def counts(summary):  # map_seconds is a wall time
        return {k: v for k, v in summary.items() if k != "vcycle/map_seconds"}

    assert counts(cb.effi_summary()) == counts(fresh.effi_summary()) != counts(first)


def test_callback_left_mid_cycle_is_ended_by_on_exception(tmp_path):
    class Stop(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                raise ValueError("crash inside the small stage")

    cb = VCycleCallback(e_a=2, e_small=3)
    with pytest.warns(UserWarning, match="put a full-size network back in pl_module.model"):
        with pytest.raises(ValueError, match="crash inside"):
            run([cb, Stop()], 7, root=tmp_path / "a")
    assert cb.level == 1 and cb.state_dict()["level"] == 2  # the state still describes the interrupted level
    run([cb], 7, root=tmp_path / "b")  # a new cycle on the full-size network
    assert cb.level == 1 and cb.switches == 2 and cb.state_dict()["level"] == 1


class StateRecorder(Callback):
    """Any architecture: per optimizer step, the network's state dict and whether the optimizer holds exactly the
    module's parameters."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, Any]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt_ids = [id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]]
        self.steps[trainer.global_step] = {
            "state": copy.deepcopy(pl_module.model.state_dict()),
            "opt_is_module": len(opt_ids) == len(set(opt_ids))
            and set(opt_ids) == {id(p) for p in pl_module.parameters()},
        }


class MaskedBlocks(torch.utils.data.Dataset):
    """Token blocks with every third position masked for MLM (labels -100 elsewhere)."""

    def __init__(self) -> None:
        self.blocks = TokenBlocks()

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[i]["input_ids"]
        labels = torch.full_like(ids, -100)
        labels[::3] = ids[::3]
        return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize(
    "build, data",
    [
        (tiny_vit, tiny_image_data),
        (tiny_bert_cls, tiny_sentence_data),
        (tiny_bert_mlm, lambda: TinyDataModule(MaskedBlocks())),
    ],
    ids=["timm_vit", "hf_bert_cls", "hf_bert_mlm"],
)
def test_two_level_switch_vit_and_bert(tmp_path, build, data):
    """The callback on the other adapters: the weights at both switches equal the operators computed by hand."""
    pre, post = StateRecorder(), StateRecorder()
    cb = VCycleCallback(e_a=2, e_small=2, alpha_original=0.4)
    pl.seed_everything(0)
    model = build()
    original = model.model
    trainer = make_trainer(tmp_path, [pre, cb, post], max_steps=6, max_epochs=-1)
    trainer.fit(model, datamodule=data())
    assert trainer.global_step == 6 and cb.switches == 2 and model.model is original
    assert all(rec["opt_is_module"] for rec in post.steps.values())
    plan = find_vcycle_adapter(original).plan(original, "half", "adjacent", "official")
    small = V.coalesce(pre.steps[2]["state"], plan)
    assert small.keys() == post.steps[2]["state"].keys()
    for k, v in small.items():
        assert torch.equal(post.steps[2]["state"][k], v), k
    expected = V.interpolate(V.decoalesce(pre.steps[4]["state"], plan), pre.steps[2]["state"], 0.4)
    for k, v in expected.items():
        assert torch.equal(post.steps[4]["state"][k], v), k
    assert post.steps[3]["state"][k].shape == small[k].shape and post.steps[5]["state"][k].shape == v.shape
    if build is tiny_bert_mlm:  # the MLM decoder stays tied to the word embeddings through both switches
        assert original.get_output_embeddings().weight is original.get_input_embeddings().weight


def test_three_levels_with_gradient_accumulation(tmp_path):
    post = Recorder()
    cb = VCycleCallback(levels=3, e_a=2, e_small=2, up_leg=2, lr_multiplier={2: 2.0, 3: 4.0})
    trainer, model = run([cb, post], 9, model=tiny_gpt2(**GPT4), root=tmp_path, accumulate_grad_batches=2)
    assert cb.stage_ends == [2, 4, 6, 8] and trainer.global_step == 9
    sizes = [post.steps[s]["sizes"] for s in range(1, 10)]
    large, mid, small = (32, 4, 4), (16, 2, 2), (8, 1, 1)
    assert sizes == [large, mid, mid, small, small, mid, mid, large, large]
    for _s, rec in post.steps.items():
        assert set(rec["opt_ids"]) == rec["module_ids"] == {id(p) for p in rec["model"].parameters()}
        assert rec["lrs"][0] == pytest.approx(0.05 * {large: 1, mid: 2, small: 4}[rec["sizes"]])
    assert post.steps[2]["model"] is post.steps[6]["model"] is not post.steps[4]["model"]  # level 2 comes back
    assert cb.snapshots == {} and cb.level == 1 and model.model is post.steps[1]["model"]


@pytest.mark.parametrize("lr_schedule", ["continue", "restart"])
def test_lr_schedule_after_switch(tmp_path, lr_schedule):
    post = Recorder()
    cb = VCycleCallback(e_a=2, e_small=3, lr_multiplier={2: 4.0}, lr_schedule=lr_schedule)
    model = tiny_gpt2(scheduler=partial(warmup_cosine, warmup_fraction=0.5, min_lr_ratio=0.1))
    run([cb, post], 7, model=model, root=tmp_path)
    # LambdaLR at progress (k + 1) / 7 for scheduler step k; "continue": k = global step, "restart": k from 0
    lr = lambda base, k: base * warmup_cosine_multiplier((k + 1) / 7, 0.5, 0.1)  # noqa: E731
    for step, k in ((2, 2), (3, 3), (5, 5), (6, 6)) if lr_schedule == "continue" else ((2, 0), (3, 1), (5, 0), (6, 1)):
        base = 0.2 if step < 5 else 0.05
        assert post.steps[step]["lrs"] == pytest.approx([lr(base, k)] * 2, rel=1e-12), step


def test_level_one_lr_multiplier_from_the_first_step(tmp_path):
    """Level 1's factor scales the curve from the fit's first step, as the others' from their switch: it was applied
    only at the switch back to level 1, so the first stage trained at the unscaled LR (0.01 where {1: 2.0} gives 0.02,
    qa79-vcycle 01); under "continue" one curve, times 2 at level 1 and 4 at level 2."""
    post = Recorder()
    cb = VCycleCallback(e_a=2, e_small=3, lr_multiplier={1: 2.0, 2: 4.0})
    model = tiny_gpt2(scheduler=partial(warmup_cosine, warmup_fraction=0.5, min_lr_ratio=0.1))
    run([cb, post], 7, model=model, root=tmp_path)
    lr = lambda base, k: base * warmup_cosine_multiplier((k + 1) / 7, 0.5, 0.1)  # noqa: E731
    assert sorted(post.steps) == list(range(1, 8))  # after each step: the LR of the step to come
    for step, rec in post.steps.items():
        base = 0.05 * (4.0 if 2 <= step < 5 else 2.0)
        assert rec["lrs"] == pytest.approx([lr(base, step)] * 2, rel=1e-12), step


class WarmsUpByHand(type(tiny_gpt2())):  # type: ignore[misc]
    """Lightning's documented warm-up in ``optimizer_step``: ``pg["lr"] = scale * base`` over the first ``warmup``
    steps; ``scaled`` multiplies it by the V-cycle's ``lr_factor`` of the current level."""

    def __init__(self, scaled: bool, warmup: int = 4) -> None:
        super().__init__(**{**TINY_GPT2, "optimizer": sgd})  # SGD at 0.05
        self.scaled, self.warmup = scaled, warmup

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step < self.warmup:
            vcycle = next(c for c in self.trainer.callbacks if isinstance(c, VCycleCallback))
            factor = vcycle.lr_factor(vcycle.level) if self.scaled else 1.0
            for group in optimizer.param_groups:
                group["lr"] = min(1.0, (self.trainer.global_step + 1) / self.warmup) * 0.05 * factor


@pytest.mark.parametrize(("scaled", "warmup"), [(False, 4), (True, 4), (True, 12)])
def test_an_lr_written_by_hand_at_a_scaled_level_is_warned_of(tmp_path, scaled, warmup):
    """A warm-up written into ``param_groups`` (no scheduler) replaces the rate level 2's ``lr_multiplier`` scaled:
    unscaled, the level trained at 0.05 where 0.2 was due, in silence (qa83-compat 06). A written rate is warned of
    once, saying what the V-cycle does and to include ``lr_factor``: whether it does cannot be told from its value
    (a scaled ramp over 12 steps is at the unscaled 0.05 at step 3, qa84-break 04). A scheduler's rates are not."""
    post = Recorder()
    cb = VCycleCallback(e_a=2, e_small=4, lr_multiplier={2: 4.0})  # level 2: steps 2-5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run([cb, post], 8, model=WarmsUpByHand(scaled, warmup), root=tmp_path)
    told = [str(w.message) for w in caught if "changed outside an LR scheduler" in str(w.message)]
    lrs = {s: rec["lrs"][0] for s, rec in post.steps.items()}  # after each step: the LR of the step to come
    ramp = [min(1.0, (s + 1) / warmup) * 0.05 * (4.0 if scaled else 1.0) for s in (2, 3, 4)]  # steps 3, 4, 5
    assert lrs[2] == pytest.approx(0.2) and [lrs[s] for s in (3, 4, 5)] == pytest.approx(ramp)
    assert len(told) == 1 and f"at step 3, from 0.2 to {ramp[0]:g}, at level 2 (lr_multiplier=4)" in told[0]
    # a scheduler's warm-up is the schedule's (its base_lrs scaled): not warned of
    post = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = tiny_gpt2(scheduler=partial(warmup_cosine, warmup_fraction=0.5, min_lr_ratio=0.1))
        run([VCycleCallback(e_a=2, e_small=4, lr_multiplier={2: 4.0}), post], 8, model=model, root=tmp_path / "s")
    assert not [w for w in caught if "changed outside an LR scheduler" in str(w.message)]


@pytest.mark.parametrize("finder", ["lr", "batch_size"])
def test_level_one_lr_multiplier_with_a_finder_callback(tmp_path, finder):
    """A finder callback searches at the fit's start and restores the checkpoint it wrote before: the level-1 factor,
    applied at train start, was skipped as for a resumed fit, and the first stage trained at the unscaled LR (0.05 for
    0.1, qa81-break 01). The optimizers it restores had no factor: it applies."""
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

    search = (
        LearningRateFinder(num_training_steps=3, min_lr=1e-3, max_lr=1.0, update_attr=False)
        if finder == "lr"
        else BatchSizeFinder(mode="power", steps_per_trial=1, init_val=4, max_trials=2)
    )
    post = Recorder()
    cb = VCycleCallback(e_a=2, e_small=3, lr_multiplier={1: 2.0, 2: 4.0})
    run([cb, search, post], 7, root=tmp_path)
    assert {s: rec["lrs"][0] for s, rec in post.steps.items()} == pytest.approx(
        {s: 0.05 * (4.0 if 2 <= s < 5 else 2.0) for s in range(1, 8)}, rel=1e-12
    )


def _vcycle(levels: int = 2, lr_multiplier: dict[int, float] | None = None):
    if levels == 2:
        return [VCycleCallback(e_a=2, e_small=3, lr_multiplier=lr_multiplier or {2: 4.0})]
    return [VCycleCallback(levels=3, e_a=2, e_small=2, up_leg=2, lr_multiplier={3: 4.0})]


@pytest.mark.parametrize(
    ("resume_step", "lr_multiplier"),
    [(1, None), (2, None), (3, None), (5, None), (1, {1: 2.0, 2: 4.0}), (5, {1: 2.0, 2: 4.0})],
)  # first large stage, right after the down-switch, inside the small stage, right after the up-switch; with level
def test_resume_two_levels(tmp_path, resume_step, lr_multiplier):  # 1's factor in the first level-1 stage, the last
    model_fn = partial(tiny_gpt2, scheduler=partial(warmup_cosine, warmup_fraction=0.3))
    assert_resume_equals_uninterrupted(
        model_fn,
        tiny_lm_data,
        tmp_path,
        total_steps=7,
        resume_step=resume_step,
        callbacks_fn=partial(_vcycle, 2, lr_multiplier),
        ignore_state=("map_seconds",),
    )


@pytest.mark.parametrize("resume_step", [5, 7])  # inside level 3; inside the up-leg at level 2
def test_resume_three_levels(tmp_path, resume_step):
    assert_resume_equals_uninterrupted(
        partial(tiny_gpt2, **GPT4),
        tiny_lm_data,
        tmp_path,
        total_steps=9,
        resume_step=resume_step,
        callbacks_fn=partial(_vcycle, 3),
        ignore_state=("map_seconds",),
    )


def test_small_stage_checkpoint_content_and_wrapper_needed(tmp_path, monkeypatch):
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpts",
        every_n_train_steps=1,
        save_top_k=-1,
        filename="{step}",
        save_on_train_epoch_end=False,
    )
    run([*_vcycle(), ckpt], 5, root=tmp_path / "a")
    path = tmp_path / "ckpts" / "step=3.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    # the checkpoint's weights are the full model's (the level-2 model de-coalesced); the exact level-2 weights and
    # the snapshot travel in the callback's state (before, the state dict held the level-2 shapes: the checkpoint did
    # not load without the V-cycle)
    assert checkpoint["state_dict"]["model.transformer.wte.weight"].shape == (64, 32)
    state = checkpoint["callbacks"][_vcycle()[0].state_key]
    assert state["level"] == 2 and state["stage_index"] == 1
    assert state["weights"]["transformer.wte.weight"].shape == (64, 16)
    assert state["snapshots"]["1"]["transformer.wte.weight"].shape == (64, 32)
    monkeypatch.setattr(VCycleCallback, "_install_load_hook", lambda self, pl_module: None)
    trainer = make_trainer(tmp_path / "b", _vcycle(), max_steps=7, max_epochs=-1)
    with pytest.raises(RuntimeError, match="checkpoint is at level 2 but the model is at level 1: the on_load_chec"):
        trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data(), ckpt_path=path)


# ------------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(levels=1, e_a=1, e_small=1), "levels must be an int >= 2"),
        (dict(e_small=1), "e_a is required"),
        (dict(e_a_steps=1, e_a_fraction=0.1, e_small_steps=1), "not e_a_steps and e_a_fraction"),
        (dict(e_a_steps=1, e_small_steps=1, e_small_epochs=1), "not e_small_steps and e_small_epochs"),
        (dict(e_a_epochs=0, e_small_steps=1), "e_a_epochs must be an int >= 1"),
        (dict(e_a_epochs=1.5, e_small_steps=1), "e_a_epochs must be an int >= 1"),
        (dict(levels=3, e_a_epochs=1, e_small_epochs=1, up_leg_epochs=[1, 1]), "up_leg_epochs must be .* list of 1"),
        (dict(e_a_epochs=1, e_small_epochs=1, up_leg_epochs=1), "levels >= 3 only"),
        (dict(e_a_steps=0, e_small_steps=1), "e_a_steps must be an int >= 1"),
        (dict(levels=3, e_a=1, e_small=1), "requires up_leg"),
        (dict(levels=3, e_a_steps=1, e_small_steps=1, up_leg_steps=[1, 2]), "list of 1 ints"),
        (dict(e_a_steps=1, e_small_steps=1, up_leg_steps=1), "levels >= 3 only"),
        (dict(e_a=1, e_small=1, alpha_original=1.5), "alpha_original must be in"),
        (dict(e_a=1, e_small=1, alpha_original=-0.1), "alpha_original must be in"),
        (dict(e_a=1, e_small=1, lr_multiplier={3: 2.0}), "keys must be levels"),
        (dict(e_a=1, e_small=1, lr_multiplier={2: 0.0}), "must be a number > 0"),
        (dict(e_a=1, e_small=1, lr_multiplier=[4.0]), r"lr_multiplier must be a mapping \{level: factor\}"),
        (dict(e_a=1, e_small=1, embedding_convention="nope"), "embedding_convention"),
        (dict(e_a=1, e_small=1, baseline_steps=0), "baseline_steps must be an int >= 1"),
        (dict(e_a=1, e_small=1, baseline_steps=2.5), "baseline_steps must be an int >= 1"),
        (
            dict(e_a=1, e_small=1, depth_scheme="adjacnet"),
            r"^VCycleCallback\.depth_scheme must be 'adjacent' \| 'half', ",
        ),
        (dict(e_a=1, e_small=1, width_scheme="halve"), r"^VCycleCallback\.width_scheme must be 'half', None .*'halve'"),
        (dict(e_a=1, e_small=1, width_scheme=5), r"^VCycleCallback\.width_scheme must be 'half', None .*got 5$"),
        (dict(e_a=1, e_small=1, depth_scheme=[[0, 1], [2, "3"]]), r"depth_scheme must be .* groups of indices"),
        (dict(e_a=1, e_small=1, depth_scheme=[]), r"depth_scheme must be .*, got \[\]$"),
        # coarse levels equal to the full model: a run of optimizer rebuilds and interpolations (qa102-nlp 04)
        (
            dict(e_a=1, e_small=1, width_scheme=None, depth_scheme=None),
            r"^VCycleCallback: width_scheme=None and depth_scheme=None keep both the width and the depth",
        ),
        (dict(e_a=1, e_small=1, width_scheme=None, depth_scheme=[[0], [1], [2]]), r"keep both the width and the depth"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VCycleCallback(**kwargs)


# ------------------------------------------------------------------------------------------------------ durations
def _fake_trainer(**kw):
    return SimpleNamespace(
        **{
            "strategy": make_trainer(Path("."), []).strategy,
            "callbacks": [],
            "max_steps": -1,
            "num_training_batches": 5,
            "accumulate_grad_batches": 1,
            "estimated_stepping_batches": 20,
            **kw,
        }
    )


@pytest.mark.parametrize(
    "new, old, max_steps, ends",
    [
        (dict(e_a=2, e_small=3), dict(e_a_steps=2, e_small_steps=3), 10, [2, 5]),
        (dict(e_a="2st", e_small="3st"), dict(e_a_steps=2, e_small_steps=3), 10, [2, 5]),
        (dict(e_a="0.3dur", e_small="0.5dur"), dict(e_a_fraction=0.3, e_small_fraction=0.5), 7, [2, 5]),
        (dict(e_a="0.01dur", e_small="0.15dur"), dict(e_a_fraction=0.01, e_small_fraction=0.15), 7, [1, 2]),
        (dict(e_a="1ep", e_small="2ep"), dict(e_a_epochs=1, e_small_epochs=2), -1, [5, 15]),  # 5 steps per epoch
        (
            dict(levels=3, e_a=1, e_small="1ep", up_leg=["0.25dur"]),
            dict(levels=3, e_a_steps=1, e_small_epochs=1, up_leg_fraction=0.25),
            -1,
            [1, 2, 7, 12],
        ),
        (
            dict(levels=3, e_a=1, e_small=1, up_leg=[3]),
            dict(levels=3, e_a_steps=1, e_small_steps=1, up_leg_steps=[3]),
            9,
            [1, 2, 3, 6],
        ),
    ],
)
def test_duration_lengths_resolve_like_the_old_spelling(new, old, max_steps, ends):
    """Each unit of the new ``e_a`` / ``e_small`` / ``up_leg`` gives the stages of its deprecated spelling, in
    ``setup`` (``max_steps`` set) or at train start (epochs, or a run bounded by epochs: 20 steps, 5 per epoch)."""
    levels = new.get("levels", 2)
    model = lambda: tiny_gpt2(**(GPT4 if levels == 3 else {}))  # noqa: E731
    with pytest.warns(DeprecationWarning):
        callbacks = [VCycleCallback(**new), VCycleCallback(**old)]
    for cb in callbacks:
        cb.setup(_fake_trainer(callbacks=[cb], max_steps=max_steps), model(), "fit")
        cb.on_train_start(_fake_trainer(max_steps=max_steps, global_step=0), None)
        assert cb.stage_ends == ends
    assert callbacks[0].config() == callbacks[1].config()


def test_new_spelling_in_a_run(tmp_path):
    """Three levels with every unit: e_a in epochs, e_small in steps, up_leg as a list of one fraction (6 epochs of 2
    batches = 12 steps)."""
    cb = VCycleCallback(levels=3, e_a="1ep", e_small="2st", up_leg=["0.25dur"])
    pl.seed_everything(0)
    trainer = make_trainer(tmp_path, [cb], max_epochs=6, limit_train_batches=2)
    trainer.fit(tiny_gpt2(**GPT4), datamodule=tiny_lm_data())
    assert cb.stages == [(1, 2), (2, 2), (3, 2), (2, 3)] and cb.stage_ends == [2, 4, 6, 9]
    assert cb.switches == 4 and cb.level == 1 and trainer.global_step == 12


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(e_a=0.05, e_small=1), r"VCycleCallback\.e_a must be an int \(optimizer steps\) or a string"),
        (dict(e_a=1, e_small=0.5), r"VCycleCallback\.e_small must be an int"),
        (dict(levels=3, e_a=1, e_small=1, up_leg=[0.1]), r"VCycleCallback\.up_leg\[0\] must be an int"),
        (
            dict(e_a=2, e_a_steps=2, e_small=1),
            r"give one of e_a, e_a_steps, e_a_fraction or e_a_epochs, not e_a and "
            r"e_a_steps",
        ),
        (dict(e_a=2, e_small="0.5dur", e_small_fraction=0.5), r"not e_small and e_small_fraction"),
        (dict(levels=3, e_a=1, e_small=1, up_leg=[2], up_leg_steps=[2]), r"not up_leg and up_leg_steps"),
        (dict(e_a=1, e_small=1, e_small_step=1), r"unexpected keyword arguments \['e_small_step'\]"),
    ],
)
def test_new_spelling_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        VCycleCallback(**kwargs)


@pytest.mark.parametrize("value", [None, 2, "2ep"])
def test_misspelled_keyword_raises_whatever_its_value(value):
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['e_a_stepz'\]"):
        VCycleCallback(e_a=1, e_small=1, e_a_stepz=value)


def test_old_spelling_warns_with_its_replacement():
    with pytest.warns(DeprecationWarning, match=r"e_a_steps is deprecated .*use e_a=5") as record:
        VCycleCallback(e_a_steps=5, e_small="0.5dur")
    assert len(record) == 1 and record[0].filename == __file__  # the warning points at the caller
    with pytest.warns(DeprecationWarning, match=r"up_leg_fraction is deprecated .*use up_leg='0.1dur'"):
        VCycleCallback(levels=3, e_a=1, e_small=1, up_leg_fraction=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        VCycleCallback(levels=3, e_a="1ep", e_small="0.5dur", up_leg=["500st"])  # the new spelling does not warn


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(e_a=2, e_small=3),
        dict(
            levels=3,
            e_a="1ep",
            e_small=Duration(0.5, "fraction"),
            up_leg=["0.1dur"],
            width_scheme=[[0, 1], [2, 3]],
            depth_scheme="half",
            alpha_original=0.25,
            lr_multiplier={2: 4.0, 3: 2},
            embedding_convention="exact",
            model_attr="net",
            adapter="hf_gpt2",
            lr_schedule="restart",
            strict=False,
            baseline_steps=100,
            unrelated_params=["side.*", "aux.weight"],
        ),
        dict(levels=4, e_a="0.05dur", e_small=7, up_leg="2ep", depth_scheme=None),
    ],
)
def test_repr_evaluates_to_an_equal_callback(kwargs):
    cb = VCycleCallback(**kwargs)
    again = eval(repr(cb), {"VCycleCallback": VCycleCallback, "Duration": Duration})
    assert repr(again) == repr(cb) and again.config() == cb.config()
    assert (again.e_a, again.e_small, again.up_leg) == (cb.e_a, cb.e_small, cb.up_leg)
    for name in (
        "levels",
        "alpha_original",
        "lr_multiplier",
        "model_attr",
        "adapter_arg",
        "lr_schedule",
        "strict",
        "baseline_steps",
        "width_scheme",
        "depth_scheme",
        "embedding_convention",
        "unrelated_params",
    ):
        assert getattr(again, name) == getattr(cb, name), name
    with pytest.warns(DeprecationWarning):
        old = VCycleCallback(e_a_fraction=0.05, e_small_steps=3)
    assert repr(old).startswith("VCycleCallback(levels=2, e_a='0.05dur', e_small=3, up_leg=None,")


def test_checkpoint_of_the_old_spelling_resumes_with_the_new(tmp_path):
    """The checkpoint format does not depend on the spelling: a run written with ``e_a_steps`` / ``e_small_steps``
    resumes inside its small stage with ``e_a`` / ``e_small`` (strict: a configuration mismatch would raise)."""
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpts",
        every_n_train_steps=1,
        save_top_k=-1,
        filename="{step}",
        save_on_train_epoch_end=False,
    )
    with pytest.warns(DeprecationWarning):
        old = VCycleCallback(e_a_steps=2, e_small_steps=3)
    run([old, ckpt], 7, root=tmp_path / "a")
    new = VCycleCallback(e_a=2, e_small=3)
    assert new.state_key == old.state_key
    trainer = make_trainer(tmp_path / "b", [new], max_steps=7, max_epochs=-1)
    trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data(), ckpt_path=tmp_path / "ckpts" / "step=3.ckpt")
    assert trainer.global_step == 7 and new.switches == 2 and new.level == 1


def test_stages_must_fit(tmp_path):
    trainer = make_trainer(tmp_path, [VCycleCallback(e_a=2, e_small=3)], max_steps=4, max_epochs=-1)
    with pytest.raises(ValueError, match=r"need 5 optimizer steps .*e_small = 3.* run has 4.*max_steps"):
        trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())


class Plain(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Linear(4, 4)


def test_unknown_architecture_and_odd_sizes():
    strategy = make_trainer(Path("."), []).strategy

    def setup(cb, module):  # the callback is one of the fake trainer's callbacks, as in a real fit
        cb.setup(SimpleNamespace(strategy=strategy, callbacks=[cb], max_steps=10), module, "fit")

    with pytest.raises(ValueError, match="no V-cycle adapter for Linear"):
        setup(VCycleCallback(e_a=1, e_small=1), Plain())
    with pytest.raises(ValueError, match="model_attr"):
        setup(VCycleCallback(e_a=1, e_small=1, model_attr="net"), Plain())
    # a dotted path (as random-LTD's GenericAdapter takes) is refused with the way to coalesce one inner list
    with pytest.raises(
        ValueError,
        match=r"model_attr must be an attribute name .*got 'net.stages.2'.*"
        r"TorchBlocksVCycleAdapter subclass whose block_list\(model\) returns that list",
    ):
        VCycleCallback(e_a=1, e_small=1, model_attr="net.stages.2")
    # a network with a list of blocks of one class that differ (T5: the first block alone holds the relative
    # position bias): the refusal says why the list does not qualify, not only that no adapter matched
    from transformers import T5Config, T5EncoderModel

    t5 = Plain()
    t5.model = T5EncoderModel(T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=3, num_heads=2))
    with pytest.raises(
        ValueError,
        match=r"no V-cycle adapter for T5EncoderModel \(its list 'encoder.block' \(3 x T5Block\) is not of identical "
        r"blocks \(block 0 alone holds layer.0.SelfAttention.relative_attention_bias.weight\)",
    ):
        setup(VCycleCallback(e_a=1, e_small=1), t5)
    # a list of single layers (a GNN's Linear per hop): the refusal says so and how to wrap them (qa54-domains 05)
    gnn = Plain()
    gnn.model = nn.Module()
    gnn.model.convs = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
    with pytest.raises(ValueError, match=r"its list 'convs' holds 4 single Linear layers, not blocks.*wrap each"):
        setup(VCycleCallback(e_a=1, e_small=1), gnn)
    with pytest.raises(ValueError, match="n_layer"):  # 3 layers cannot be paired by the default depth scheme
        setup(VCycleCallback(e_a=1, e_small=1), tiny_gpt2(n_layer=3))


def test_unsupported_strategy_and_callbacks(tmp_path):
    cb = VCycleCallback(e_a=1, e_small=1)
    fake = SimpleNamespace(strategy=FSDPStrategy(), callbacks=[cb], max_steps=10)
    with pytest.raises(MisconfigurationException, match="supports the strategies .*not FSDPStrategy"):
        cb.setup(fake, tiny_gpt2(), "fit")
    trainer = make_trainer(
        tmp_path,
        [VCycleCallback(e_a=1, e_small=1), StochasticWeightAveraging(swa_lrs=0.01)],
        max_steps=4,
        max_epochs=-1,
    )
    with pytest.raises(MisconfigurationException, match="StochasticWeightAveraging"):
        trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())


def test_requirements_refuse_deepspeed_weight_averaging_and_layer_patching():
    """The strategies are matched by exact class name: DeepSpeed (a DDPStrategy subclass) is refused; weight averaging
    callbacks and techniques that patch layers (random-LTD) are refused by ``check_trainer``."""
    assert issubclass(DeepSpeedStrategy, DDPStrategy)
    deepspeed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # constructing one needs the deepspeed package
    cb = VCycleCallback(e_a=1, e_small=1)
    fake = SimpleNamespace(strategy=deepspeed, callbacks=[cb], max_steps=10)
    with pytest.raises(IncompatibleTechniques, match="not DeepSpeedStrategy. Use strategy='auto'.*one fit per stage"):
        cb.setup(fake, tiny_gpt2(), "fit")
    single = make_trainer(Path("."), []).strategy
    for other in (StochasticWeightAveraging(swa_lrs=0.01), WeightAveraging()):
        cb = VCycleCallback(e_a=1, e_small=1)
        fake = SimpleNamespace(strategy=single, callbacks=[cb, other], max_steps=10)
        with pytest.raises(IncompatibleTechniques, match=f"cannot run with {type(other).__name__}: its averaged"):
            cb.setup(fake, tiny_gpt2(), "fit")

    class PatchesLayers(Callback):
        requirements = Requirements(patches_layers=True)

    cb = VCycleCallback(e_a=1, e_small=1)
    fake = SimpleNamespace(strategy=single, callbacks=[cb, PatchesLayers()], max_steps=10)
    with pytest.raises(
        IncompatibleTechniques,
        match=r"VCycleCallback and PatchesLayers cannot be combined \(layer "
        r"patching across shape changes\)",
    ):
        cb.setup(fake, tiny_gpt2(), "fit")


def test_random_ltd_follows_the_level_changes(tmp_path):
    """Random-LTD patches layers but follows model changes (``follows_model_changes``): no conflict; it is told
    before and after every level change (the whole composition is tested in tests/composition/test_vcycle_stacks.py).
    A layer patcher that does not follow is still refused (above)."""
    assert RandomLTDCallback.requirements.follows_model_changes

    class Told(Callback):
        def __init__(self) -> None:
            self.calls: list[tuple[str, int, int]] = []

        def effi_before_model_change(self, trainer, pl_module):
            self.calls.append(("before", trainer.global_step, pl_module.model.config.n_layer))

        def effi_after_model_change(self, trainer, pl_module):
            self.calls.append(("after", trainer.global_step, pl_module.model.config.n_layer))

    told, ltd = Told(), RandomLTDCallback(min_value=4, max_value=16, require_steps=2, seq_per_step=4)
    cb = VCycleCallback(e_a=1, e_small=2)
    run([cb, ltd, told], 4, model=tiny_gpt2(n_layer=6), root=tmp_path)
    assert cb.level == 1 and cb.switches == 2 and ltd.num_layers == 6 and ltd.layer_ids == (1, 2, 3, 4)
    assert told.calls == [("before", 1, 6), ("after", 1, 3), ("before", 3, 3), ("after", 3, 6)]


def test_metadata_json_matches_the_class():
    root = Path(__file__).resolve().parents[2]
    meta = json.loads((root / "lightning_effi" / "vcycle" / "metadata.json").read_text())
    infobatch = json.loads((root / "lightning_effi" / "infobatch" / "metadata.json").read_text())
    assert list(meta) == list(infobatch)
    assert meta["requirements"] == json.loads(json.dumps(VCycleCallback.requirements.as_dict()))
    assert meta["class_name"] == "VCycleCallback" and meta["card"] == "lightning_effi/vcycle/README.md"
    assert (root / meta["card"]).is_file() and (root / meta["hydra"]).is_file()
    assert importlib.import_module(meta["functional"]) is V


def test_stages_must_fit_an_epoch_based_run(tmp_path):
    """Step lengths in a run bounded by epochs are checked against its optimizer steps (2 epochs of 5 batches)."""
    trainer = make_trainer(tmp_path, [VCycleCallback(e_a=4, e_small=7)], max_epochs=2)
    with pytest.raises(ValueError, match=r"need 11 optimizer steps .* run has 10"):
        trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())


def test_stages_must_fit_a_run_ended_by_epochs_before_max_steps(tmp_path):
    """max_steps=100 but one epoch of 3 batches ends the run at step 3: the 4 steps of stages do not fit (before,
    the run ended at step 3 on the coarse model, without a word)."""
    cb = VCycleCallback(e_a=2, e_small=2)
    trainer = make_trainer(tmp_path, [cb], max_steps=100, max_epochs=1, limit_train_batches=3)
    with pytest.raises(ValueError, match=r"need 4 optimizer steps .* run has 3 .*max_epochs.*limit_train_batches"):
        trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data(batch_size=8))
    assert trainer.global_step == 0 and cb.level == 1


def test_fractions_resolve_against_a_run_ended_by_epochs(tmp_path):
    """max_steps=1000 but max_epochs=1 (5 steps): the fractions are of the 5 steps (before, of 1000: it never
    switched)."""
    cb = VCycleCallback(e_a="0.5dur", e_small="0.2dur")
    model = tiny_gpt2()
    trainer = make_trainer(tmp_path, [cb], max_steps=1000, max_epochs=1)
    trainer.fit(model, datamodule=tiny_lm_data())
    assert cb.stages == [(1, 2), (2, 1)] and cb.stage_ends == [2, 3] and trainer.global_step == 5
    assert cb.switches == 2 and cb.level == 1 and model.model.config.n_embd == 32
    cb = VCycleCallback(e_a="0.5dur", e_small="0.2dur")  # max_steps bounds the run: resolved as before
    trainer = make_trainer(tmp_path / "b", [cb], max_steps=10, max_epochs=3)
    trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    assert cb.stage_ends == [5, 7] and cb.level == 1 and trainer.global_step == 10


def test_fractions_need_a_known_length(tmp_path):
    trainer = make_trainer(tmp_path, [VCycleCallback(e_a="0.1dur", e_small="0.5dur")], max_steps=-1, max_epochs=-1)
    with pytest.raises(ValueError, match=r"unknown \(max_epochs=-1 and max_steps=-1\).*_fraction.*or epochs"):
        trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    # a loader without a length: max_epochs named as given, and no epochs advised (qa57-loops 04)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0)))

    trainer = make_trainer(tmp_path / "stream", [VCycleCallback(e_a="0.1dur", e_small="0.5dur")], max_epochs=2)
    with pytest.raises(ValueError, match=r"max_epochs=2 over a train dataloader without a length") as err:
        trainer.fit(tiny_gpt2(), torch.utils.data.DataLoader(Stream(), batch_size=4))
    assert "'2ep'" not in str(err.value) and str(err.value).endswith("in optimizer steps (ints)")


def epoch_run(cb, root, **kw):
    pl.seed_everything(0)
    model = tiny_gpt2()
    rec = Recorder()
    trainer = make_trainer(Path(root), [cb, rec], **kw)
    trainer.fit(model, datamodule=tiny_lm_data())
    return trainer, model, rec


def test_epoch_stage_lengths(tmp_path):
    """``*_epochs``: n epochs = n · ceil(batches / accumulate_grad_batches) optimizer steps (40 blocks, batch 8: 5
    batches per epoch), resolved at on_train_start; the switches fall on epoch boundaries and the run equals the same
    V-cycle given in steps."""
    cb = VCycleCallback(e_a="1ep", e_small="2ep")
    trainer, model, rec = epoch_run(cb, tmp_path / "a", max_epochs=4)
    assert cb.stages == [(1, 5), (2, 10)] and cb.stage_ends == [5, 15] and trainer.global_step == 20
    assert [rec.steps[s]["sizes"][2] for s in (4, 5, 14, 15)] == [2, 1, 1, 2]  # switches after steps 5 and 15
    same = VCycleCallback(e_a=5, e_small=10)
    _, model_b, _ = epoch_run(same, tmp_path / "b", max_epochs=4)
    for (k, a), (_, b) in zip(model.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), k
    assert cb.config() == same.config()

    cb = VCycleCallback(e_a="1ep", e_small="1ep")  # 5 batches, accumulate 2: ceil(5 / 2) = 3 steps per epoch
    trainer, _, _ = epoch_run(cb, tmp_path / "c", max_epochs=3, accumulate_grad_batches=2)
    assert cb.stage_ends == [3, 6] and trainer.global_step == 9 and cb.switches == 2 and cb.level == 1

    cb = VCycleCallback(levels=3, e_a="1ep", e_small="1ep", up_leg=["2ep"])  # limit 2 batches per epoch
    pl.seed_everything(0)
    trainer = make_trainer(tmp_path / "d", [cb], max_epochs=6, limit_train_batches=2)
    trainer.fit(tiny_gpt2(**GPT4), datamodule=tiny_lm_data())
    assert cb.stages == [(1, 2), (2, 2), (3, 2), (2, 4)] and cb.switches == 4 and cb.level == 1


class NoLength(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from TokenBlocks()


def test_epoch_stages_must_fit_and_need_a_length(tmp_path):
    trainer = make_trainer(tmp_path, [VCycleCallback(e_a="1ep", e_small="2ep")], max_epochs=2)
    with pytest.raises(ValueError, match=r"need 15 optimizer steps .*5 optimizer steps per epoch\) but the run has 10"):
        trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    data = TinyDataModule(TokenBlocks())
    data.train_dataloader = lambda: torch.utils.data.DataLoader(NoLength(), batch_size=8)
    trainer = make_trainer(tmp_path / "b", [VCycleCallback(e_a="1ep", e_small=2)], max_steps=10, max_epochs=-1)
    with pytest.raises(ValueError, match="in epochs .*needs a train dataloader with a length"):
        trainer.fit(tiny_gpt2(), datamodule=data)


def test_resume_epoch_stages(tmp_path):
    """Stage lengths in epochs, a run bounded by epochs: resuming inside the small stage (step 7 of 20) continues
    exactly."""
    assert_resume_equals_uninterrupted(
        tiny_gpt2,
        tiny_lm_data,
        tmp_path,
        total_steps=20,
        resume_step=7,
        callbacks_fn=lambda: [VCycleCallback(e_a="1ep", e_small="2ep")],
        ignore_state=("map_seconds",),
        max_epochs=4,
    )


def _epoch_checkpoints(root):
    """A 3-epoch run (15 steps) with e_a='1ep' (5 steps) and e_small=3, a checkpoint after every step."""
    ckpt = ModelCheckpoint(
        dirpath=root / "ckpts", every_n_train_steps=1, save_top_k=-1, filename="{step}", save_on_train_epoch_end=False
    )
    pl.seed_everything(0)
    cb = VCycleCallback(e_a="1ep", e_small=3)
    make_trainer(root / "a", [cb, ckpt], max_steps=-1, max_epochs=3).fit(tiny_gpt2(), datamodule=tiny_lm_data())
    assert cb.stages == [(1, 5), (2, 3)] and cb.level == 1
    return root / "ckpts" / "step=6.ckpt"  # inside the small stage, level 2


def _resume(root, cb, path):
    trainer = make_trainer(root, [cb], max_steps=-1, max_epochs=3)
    trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data(), ckpt_path=path)
    return trainer


def test_resume_with_other_stages_in_a_run_bounded_by_epochs(tmp_path):
    """A checkpoint of a run bounded by epochs, resumed with other stage lengths: strict raises at train start, not
    strict warns and continues with the current arguments' stages; the same steps spelled otherwise resume."""
    path = _epoch_checkpoints(tmp_path)
    for i, kwargs in enumerate([dict(e_a="2ep", e_small=3), dict(e_a="1ep", e_small=1), dict(e_a=4, e_small=3)]):
        cb = VCycleCallback(**kwargs)
        with pytest.raises(ValueError, match=r"checkpoint's stages .*\[\(1, 5\), \(2, 3\)\] differ .*strict=False"):
            _resume(tmp_path / f"strict{i}", cb, path)
    for i, e_a in enumerate([5, "5st", "1ep", "0.34dur", Duration(5)]):  # 0.34 x 15 steps = 5
        cb = VCycleCallback(e_a=e_a, e_small=3)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*VCycleCallback.*")
            trainer = _resume(tmp_path / f"same{i}", cb, path)
        assert trainer.global_step == 15 and cb.stage_ends == [5, 8] and cb.switches == 2 and cb.level == 1
    cb = VCycleCallback(e_a="2ep", e_small=3, strict=False)  # stages [(1, 10), (2, 3)]: level 2 until step 13
    with pytest.warns(UserWarning, match=r"differ .*strict=False: continue with the current arguments' stages"):
        trainer = _resume(tmp_path / "lenient", cb, path)
    assert cb.stages == [(1, 10), (2, 3)] and cb.stage_ends == [10, 13]
    assert trainer.global_step == 15 and cb.switches == 2 and cb.level == 1


def test_resume_with_a_longer_run_and_fractions(tmp_path):
    """Fractions of a run bounded by max_steps, resumed in a longer run: other stages, reported the same way."""
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpts",
        every_n_train_steps=1,
        save_top_k=-1,
        filename="{step}",
        save_on_train_epoch_end=False,
    )
    run([VCycleCallback(e_a="0.2dur", e_small="0.5dur"), ckpt], 10, root=tmp_path / "a")  # stages [(1, 2), (2, 5)]
    path = tmp_path / "ckpts" / "step=3.ckpt"
    trainer = make_trainer(tmp_path / "b", [VCycleCallback(e_a="0.2dur", e_small="0.5dur")], max_steps=20)
    with pytest.raises(ValueError, match=r"\[\(1, 2\), \(2, 5\)\] differ .* \[\(1, 4\), \(2, 10\)\]"):
        trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data(), ckpt_path=path)
    cb = VCycleCallback(e_a=2, e_small=5)  # the same steps: resumes
    trainer = make_trainer(tmp_path / "c", [cb], max_steps=10)
    trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data(), ckpt_path=path)
    assert trainer.global_step == 10 and cb.stage_ends == [2, 7] and cb.level == 1


def test_fractions_fast_dev_run(tmp_path):
    """Stage lengths as fractions of the run: with fast_dev_run (1 step) the cycle still runs (down and up at step
    1, a zero-length small stage) and ends on the full model."""
    cb = VCycleCallback(e_a="0.05dur", e_small="0.5dur")
    trainer, model = run([cb], 1, root=tmp_path, fast_dev_run=True)
    assert cb.stage_ends == [1, 1] and cb.level == 1 and cb.switches == 1 and model.model.config.n_embd == 32
    cb = VCycleCallback(e_a="0.2dur", e_small="0.5dur")
    run([cb], 10, root=tmp_path / "b")
    assert cb.stage_ends == [2, 7] and cb.level == 1


# ------------------------------------------------------------------------------------------------------ DDP
class RankProbe(Callback):
    """Per rank: level sizes per step, whether the DDP wrapper and the optimizer hold the current parameters; the
    final weights to ``<out>/rank<r>.pt``."""

    def __init__(self, out: str):
        self.out, self.records = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ddp = trainer.strategy.model
        params = {id(p) for p in pl_module.model.parameters()}
        opt = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
        self.records.append(
            [
                trainer.global_step,
                pl_module.model.config.n_embd,
                isinstance(ddp, DistributedDataParallel)
                and ddp.module is pl_module
                and {id(p) for p in ddp.parameters()} == params == opt,
            ]
        )

    def on_train_end(self, trainer, pl_module):
        r = trainer.global_rank
        torch.save(pl_module.model.state_dict(), Path(self.out) / f"rank{r}.pt")
        (Path(self.out) / f"probe{r}.json").write_text(json.dumps(self.records))


@pytest.mark.slow
def test_ddp_two_processes(tmp_path):
    cb = VCycleCallback(e_a=1, e_small=2, lr_multiplier={2: 4.0})
    pl.seed_everything(0)
    _, ranks = fit_ddp(
        tiny_gpt2(), tiny_lm_data(batch_size=4), tmp_path, [cb, RankProbe(str(tmp_path))], max_steps=5, max_epochs=-1
    )
    probes = [json.loads((tmp_path / f"probe{r}.json").read_text()) for r in range(2)]
    assert probes[0] == probes[1] == [[1, 16, True], [2, 16, True], [3, 32, True], [4, 32, True], [5, 32, True]]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 5
    assert ranks[0]["batches"][0]["fingerprint"] != ranks[1]["batches"][0]["fingerprint"]  # ranks see other data
    w0, w1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)


@pytest.mark.slow
@pytest.mark.parametrize("resume_step", [2, 4])  # inside the small stage (small shapes) / after the up-switch
def test_ddp_resume_equals_uninterrupted(tmp_path, resume_step):
    """Under DDP (2 processes), resuming from a checkpoint taken inside the small stage or after the up-switch ends
    with the same weights on both ranks as the uninterrupted DDP run, and the same per-step sizes from the resume
    step on."""
    make_cb = lambda: VCycleCallback(e_a=1, e_small=2, lr_multiplier={2: 4.0})  # noqa: E731
    ckpt = lambda: ModelCheckpoint(
        dirpath=tmp_path / "ckpts",
        every_n_train_steps=1,
        save_top_k=-1,  # noqa: E731
        filename="{step}",
        save_on_train_epoch_end=False,
    )
    for arm in ("a", "b"):
        (tmp_path / arm).mkdir()
    pl.seed_everything(0)
    fit_ddp(
        tiny_gpt2(),
        tiny_lm_data(batch_size=4),
        tmp_path / "a",
        [make_cb(), RankProbe(str(tmp_path / "a")), ckpt()],
        max_steps=5,
        max_epochs=-1,
    )
    path = tmp_path / "ckpts" / f"step={resume_step}.ckpt"
    assert path.exists()
    pl.seed_everything(1234)
    _, ranks = fit_ddp(
        tiny_gpt2(),
        tiny_lm_data(batch_size=4),
        tmp_path / "b",
        [make_cb(), RankProbe(str(tmp_path / "b"))],
        max_steps=5,
        max_epochs=-1,
        ckpt_path=path,
    )
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 5
    for r in range(2):
        probe_a = json.loads((tmp_path / "a" / f"probe{r}.json").read_text())
        probe_b = json.loads((tmp_path / "b" / f"probe{r}.json").read_text())
        assert probe_b == probe_a[resume_step:]
        wa, wb = (torch.load(tmp_path / arm / f"rank{r}.pt", weights_only=True) for arm in ("a", "b"))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ------------------------------------------------------------------------------------------------ frozen parameters
class PartlyFrozen(pl.LightningModule):
    """A 4-layer GPT-2 (3 levels: 4 x 32 -> 2 x 16 -> 1 x 8) under ``net`` with frozen token and position embeddings
    (the tied ``lm_head`` with them), optionally a frozen teacher; the optimizer holds the trainable parameters."""

    FROZEN = ("transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight")

    def __init__(self, teacher: bool = False) -> None:
        super().__init__()
        self.net = tiny_gpt2(**GPT4).model
        for name in ("wte", "wpe"):
            getattr(self.net.transformer, name).requires_grad_(False)
        if teacher:
            self.teacher = tiny_gpt2(**GPT4).model.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        return self.net(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9)


class GradFlags(Callback):
    """Per optimizer step: the level's depth and ``{name: requires_grad}`` of ``pl_module.net``'s parameters."""

    def __init__(self) -> None:
        self.steps: dict[int, tuple[int, dict[str, bool]]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        net = pl_module.net
        flags = {k: p.requires_grad for k, p in net.named_parameters(remove_duplicate=False)}
        self.steps[trainer.global_step] = (net.config.n_layer, flags)


def test_model_attr_naming_a_frozen_module_is_refused(tmp_path):
    """Issue #18: ``model_attr`` naming a frozen teacher raises in setup, before any step, and the teacher is left
    as it is (it used to go through the cycle: made trainable at the coarse levels and its weights changed)."""
    module = PartlyFrozen(teacher=True)
    teacher = {k: v.clone() for k, v in module.teacher.state_dict().items()}
    trainer = make_trainer(tmp_path, [VCycleCallback(e_a=1, e_small=2, model_attr="teacher")], max_steps=4)
    with pytest.raises(
        ValueError,
        match=r"VCycleCallback\.model_attr: PartlyFrozen\.teacher \(GPT2LMHeadModel\) has no trainable parameter .*"
        r"a frozen module is not trained, so a V-cycle on it is meaningless",
    ):
        trainer.fit(module, datamodule=tiny_lm_data())
    assert trainer.global_step == 0 and all(p.requires_grad is False for p in module.teacher.parameters())
    assert all(torch.equal(v, module.teacher.state_dict()[k]) for k, v in teacher.items())


def test_frozen_parameters_stay_frozen_at_every_level(tmp_path):
    """Issue #18: a partly frozen network keeps each parameter's ``requires_grad`` at every level of a 3-level
    cycle (the frozen embeddings stay frozen, the rest trains), and the frozen weights come back from the cycle
    exactly as they were (restored from the snapshots on the way up; they were never trained)."""
    flags = GradFlags()
    cb = VCycleCallback(levels=3, e_a=1, e_small=2, up_leg=1)
    pl.seed_everything(0)
    module = PartlyFrozen()
    before = {k: v.clone() for k, v in module.net.state_dict().items()}
    trainer = make_trainer(tmp_path, [cb, flags], max_steps=6, max_epochs=-1)
    trainer.fit(module, datamodule=tiny_lm_data())
    assert cb.switches == 4 and cb.level == 1
    # the model in place after each step's switch: levels 2, 3, 3, 2, 1, 1
    assert [flags.steps[s][0] for s in sorted(flags.steps)] == [2, 1, 1, 2, 4, 4]
    for step, (_, requires_grad) in flags.steps.items():
        assert {k for k, v in requires_grad.items() if not v} == set(PartlyFrozen.FROZEN), step
        assert len(requires_grad) > 10 and all(v for k, v in requires_grad.items() if k not in PartlyFrozen.FROZEN)
    after = module.net.state_dict()
    for k in PartlyFrozen.FROZEN:
        assert torch.equal(after[k], before[k]), k
    assert not torch.equal(after["transformer.h.0.attn.c_attn.weight"], before["transformer.h.0.attn.c_attn.weight"])
    assert module.net.lm_head.weight is module.net.transformer.wte.weight


class UnfreezesAtCoarseLevel(PartlyFrozen):
    """Gradual unfreezing by hand (what the refusal of BaseFinetuning advises): at step 2, on the coarse network, the
    position embedding is unfrozen and the first block's MLP frozen; the optimizer holds every parameter."""

    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            self.net.transformer.wpe.requires_grad_(True)
            self.net.transformer.h[0].mlp.requires_grad_(False)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_requires_grad_changed_at_a_coarse_level_is_kept_at_the_full_one(tmp_path):
    """The parked full network's flags came back at de-coalescing: an embedding the module unfroze at the coarse level
    was frozen again for the rest of the run, its coarse training thrown away (its initial weights exactly), and a
    module frozen there trained again (qa51-distill 03). The coarse network's changed flags pass on to the full one."""
    flags = GradFlags()
    cb = VCycleCallback(e_a=1, e_small=3)
    pl.seed_everything(0)
    module = UnfreezesAtCoarseLevel()
    before = {k: v.clone() for k, v in module.net.state_dict().items()}
    trainer = make_trainer(tmp_path, [cb, flags], max_steps=7, max_epochs=-1)
    trainer.fit(module, datamodule=tiny_lm_data())
    depths = [flags.steps[s][0] for s in sorted(flags.steps)]
    assert depths == [2, 2, 2, 4, 4, 4, 4] and cb.level == 1  # the coarse network trains steps 1-3
    last = flags.steps[max(flags.steps)][1]
    assert last["transformer.wpe.weight"] and not last["transformer.wte.weight"]
    # the coarse block 0 is the full blocks 0 and 1 (a depth group): both frozen; blocks 2 and 3 train
    mlp = {k: v for k, v in last.items() if ".mlp." in k}
    assert len(mlp) == 16 and {k for k, v in mlp.items() if not v} == {k for k in mlp if k[14] in "01"}
    after = module.net.state_dict()
    assert not torch.equal(after["transformer.wpe.weight"], before["transformer.wpe.weight"])  # trained, kept
    assert torch.equal(after["transformer.wte.weight"], before["transformer.wte.weight"])  # frozen throughout


class FrozenFirstBlock(PartlyFrozen):
    """Block 0 frozen, the rest trainable (the position embedding too), unfrozen whole at step 2 (gradual unfreezing
    by hand, ULMFiT) while the coarse network trains."""

    def __init__(self) -> None:
        super().__init__()
        self.net.requires_grad_(True)
        self.net.transformer.h[0].requires_grad_(False)

    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            self.net.requires_grad_(True)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_depth_group_merging_frozen_and_trainable_layers_is_warned_at_setup(tmp_path):
    """Block 0 frozen beside the trainable block 1: their merged coarse block trains, and block 0 comes back frozen
    with its weights; the module's requires_grad_(True) at step 2 (level 2) cannot reach it, as the merged block was
    trainable already: block 0 stayed frozen for the rest of the fit, its initial weights exactly, in silence
    (qa54-break 02). The setup now says so, naming the group and the remedies."""
    pl.seed_everything(0)
    module = FrozenFirstBlock()
    before = module.net.transformer.h[0].mlp.c_fc.weight.detach().clone()
    trainer = make_trainer(tmp_path, [VCycleCallback(e_a=1, e_small=3)], max_steps=7, max_epochs=-1)
    message = r"layers \[0, 1\]: transformer\.h\.0\.ln_1\.weight, transformer\.h\.0\.ln_1\.bias and 10 more frozen.*"
    with pytest.warns(UserWarning, match=message + r"cannot reach them\. Unfreeze them at level 1"):
        trainer.fit(module, datamodule=tiny_lm_data())
    # what the warning says: block 0 is frozen again, untrained, after the cycle
    assert not module.net.transformer.h[0].mlp.c_fc.weight.requires_grad
    assert torch.equal(module.net.transformer.h[0].mlp.c_fc.weight, before)


def test_requires_grad_through_coalescing_and_rebuilt_levels():
    """The functional rule: a small tensor is frozen when every large tensor it is made from is (depth groups
    included), trainable otherwise; ``coalesce_model`` and ``build_levels`` (the resume rebuild) apply it."""
    net = tiny_gpt2(**GPT4).model
    net.transformer.wte.requires_grad_(False)
    for i in (0, 2, 3):  # depth groups (0, 1), (2, 3): layer 1 trains, so small layer 0 does; small layer 1 is frozen
        net.transformer.h[i].mlp.c_fc.weight.requires_grad_(False)
    adapter = find_vcycle_adapter(net)
    plans = V.plan_levels(net, adapter, 3)
    small = V.coalesced_requires_grad(V.requires_grad_flags(net), plans[0])
    assert {k for k, v in small.items() if not v} == {
        "transformer.wte.weight",
        "lm_head.weight",
        "transformer.h.1.mlp.c_fc.weight",
    }
    coalesced = V.coalesce_model(net, plans[0], adapter)
    assert V.requires_grad_flags(coalesced) == small
    # the depth group (0, 1) merges a frozen c_fc weight with a trainable one; (2, 3) is frozen whole
    assert V.mixed_depth_groups(V.requires_grad_flags(net), plans[0]) == [([0, 1], ["transformer.h.0.mlp.c_fc.weight"])]
    level_3, larger = V.build_levels(net, adapter, plans, 3)
    assert V.requires_grad_flags(larger[2]) == small
    assert {k for k, v in V.requires_grad_flags(level_3).items() if not v} == {
        "transformer.wte.weight",
        "lm_head.weight",
    }


@pytest.mark.parametrize("library", ["hf", "timm"])
def test_the_coarse_networks_keep_the_activation_checkpointing_of_the_full_one(library):
    """An adapter builds each coarse network from a config: a model checkpointed with HF's
    gradient_checkpointing_enable() or timm's set_grad_checkpointing() trained its coarse levels without it, with
    the activation memory the user had turned off (qa54-extras 01)."""
    if library == "hf":
        net = tiny_gpt2(**GPT4).model
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def checkpointed(m: nn.Module) -> bool:
            blocks = m.transformer.h
            return all(b.gradient_checkpointing and b._gradient_checkpointing_func.keywords == {"use_reentrant": False}
                       for b in blocks)  # fmt: skip
    else:
        from lightning_effi.tasks import ImageClassifier

        vit = {**TINY_VIT, "depth": 4, "num_heads": 4}
        net = ImageClassifier("vit_tiny_patch16_224", model_kwargs=vit, optimizer=sgd).model
        net.set_grad_checkpointing(True)

        def checkpointed(m: nn.Module) -> bool:
            return bool(m.grad_checkpointing)

    adapter = find_vcycle_adapter(net)
    plans = V.plan_levels(net, adapter, 3)
    assert checkpointed(V.coalesce_model(net, plans[0], adapter))
    level_3, larger = V.build_levels(net, adapter, plans, 3)  # the resume rebuild
    assert checkpointed(level_3) and checkpointed(larger[2])


def test_the_coarse_networks_keep_the_input_gradient_hook_of_frozen_embeddings():
    """HF's gradient_checkpointing_enable() on a model with frozen embeddings registers a hook that makes the
    embeddings' output require grad (enable_input_require_grads()); the coarse network had none, so its reentrant
    checkpoints had no input requiring grad and none of its blocks trained, in silence (qa57-break 03)."""
    net = tiny_gpt2(**GPT4).model
    net.transformer.wte.requires_grad_(False)
    net.transformer.wpe.requires_grad_(False)
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert net._require_grads_hooks  # HF registered it: the embeddings are frozen
    adapter = find_vcycle_adapter(net)
    small = V.coalesce_model(net, V.plan_levels(net, adapter, 2)[0], adapter)
    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "None of the inputs have requires_grad=True" while it failed
        small.train()(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for b in small.transformer.h for p in b.parameters()]
    assert len(grads) == 24 and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_a_batch_the_training_step_skips_is_not_counted_and_the_accounting_goes_on(tmp_path):
    """A training_step returning None (Lightning's way to skip a batch) made the V-cycle's FLOPs accounting ask the
    monitor for a batch it had not seen; the accounting was disabled for the rest of the fit, with a warning naming
    the wrong remedy, and vcycle/flops disagreed with the monitor's. The skipped batch is now not counted."""
    from lightning_effi import EfficiencyMonitor

    class Skips(type(tiny_gpt2())):
        def training_step(self, batch, batch_idx):
            return None if batch_idx == 3 else super().training_step(batch, batch_idx)

    pl.seed_everything(0)
    monitor, cb = EfficiencyMonitor(print_summary=False), VCycleCallback(e_a=2, e_small=2)
    trainer = make_trainer(tmp_path, [monitor, cb], max_steps=6, max_epochs=-1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*skipped batches are not counted")
        warnings.filterwarnings("error", message=".*FLOPs accounting disabled")
        model = Skips(**{**TINY_GPT2, **GPT4, "optimizer": sgd})
        trainer.fit(model, datamodule=TinyDataModule(TokenBlocks(n=64), batch_size=8))
    s = monitor.summary
    assert cb.flops_account.enabled and monitor.totals["batches"] == 5  # 6 steps, one of them skipped
    assert s["vcycle/flops"] == pytest.approx(s["flops"], rel=1e-12) and s["vcycle/flops_saved_frac"] > 0
    assert s["vcycle/flops_saved_frac"] == pytest.approx(s["flops_saved_frac"], rel=1e-9)


class TimmScheduled(Callback):
    """Each training step's learning rate (read at the step's start)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_a_timm_scheduler_stepped_per_epoch_starts_at_its_warmup_with_a_level_one_factor(tmp_path):
    """A timm scheduler stepped per epoch the timm way (``step(epoch=current_epoch + 1)`` at an epoch's end): level
    1's factor set the first epoch's LR by calling that hook at train start, which stepped it to epoch 1 (0.0505 for
    warmup_lr_init 0.001, qa82-break 01). Every level-1 step trains at the LR of the same run at twice the LR without
    a multiplier."""
    from timm.scheduler import CosineLRScheduler

    class Module(type(tiny_gpt2())):  # type: ignore[misc]
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=self.peak)
            scheduler = CosineLRScheduler(optimizer, t_initial=5, warmup_t=2, warmup_lr_init=1e-3, t_in_epochs=True)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

        def lr_scheduler_step(self, scheduler, metric):
            scheduler.step(epoch=self.current_epoch + 1)

    lrs = {}
    for multiplier, peak in ((None, 0.1), ({1: 2.0}, 0.05)):
        watch = TimmScheduled()
        pl.seed_everything(0)
        module = Module(**{**TINY_GPT2, "n_layer": 4, "optimizer": sgd})
        module.peak = peak
        vcycle = VCycleCallback(e_a=2, e_small=4, lr_multiplier=multiplier, width_scheme=None)
        loop = dict(max_steps=10, max_epochs=-1, limit_train_batches=2)  # 5 epochs of 2 steps
        make_trainer(tmp_path / str(peak), [vcycle, watch], **loop).fit(module, datamodule=tiny_lm_data())
        lrs[peak] = watch.lrs
    assert lrs[0.05][0] == pytest.approx(1e-3)  # warmup_lr_init, absolute
    assert [lrs[0.05][s] for s in (0, 1, 6, 7, 8, 9)] == pytest.approx([lrs[0.1][s] for s in (0, 1, 6, 7, 8, 9)])


@pytest.mark.parametrize("multiplier", [{2: 4.0}, {1: 2.0, 2: 4.0}])
def test_a_timm_scheduler_gets_the_multiplier_and_continues_across_level_changes(tmp_path, multiplier):
    """timm's schedulers keep their own base_values and no step count, and Lightning leaves their stepping to the
    module's lr_scheduler_step: the multiplier was dropped at level 2 (x1 where the switch said x4) and each level
    change trained one step at warmup_lr_init (qa37-user 01). Each step's LR is now that of a timm scheduler built on
    the level's peak LR (the multiplier scales base_values; lr_min and warmup_lr_init, absolute, are kept), level 1's
    from the first step (the factor doubled warmup_lr_init at step 0, qa81-break 06)."""
    from timm.scheduler import CosineLRScheduler

    steps, peak, timm_args = (
        12,
        0.1,
        dict(t_initial=12, warmup_t=3, warmup_lr_init=1e-4, lr_min=1e-5, t_in_epochs=False),
    )

    class Module(type(tiny_gpt2())):  # type: ignore[misc]
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=peak)
            scheduler = CosineLRScheduler(optimizer, **timm_args)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def lr_scheduler_step(self, scheduler, metric):
            scheduler.step_update(num_updates=self.global_step)

    watch = TimmScheduled()
    vcycle = VCycleCallback(e_a=3, e_small=4, lr_multiplier=multiplier, width_scheme=None)
    pl.seed_everything(0)
    make_trainer(tmp_path, [vcycle, watch], max_steps=steps, max_epochs=-1).fit(
        Module(**{**TINY_GPT2, "n_layer": 4, "optimizer": sgd}), datamodule=tiny_lm_data()
    )

    def reference(lr, step):
        return CosineLRScheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr), **timm_args)._get_lr(
            step
        )[0]

    levels = [1] * 3 + [2] * 4 + [1] * 5
    expected = [reference(peak * multiplier.get(level, 1.0), step) for step, level in enumerate(levels)]
    assert watch.lrs == pytest.approx(expected) and watch.lrs[3] > 1.5 * watch.lrs[2]  # the switch: x4, or x4 / x2
