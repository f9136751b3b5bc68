"""One honest compute figure for any stack of techniques: the EfficiencyMonitor's FLOPs equal what
``torch.utils.flop_counter`` measures in the training step (exactly, fused attention included), batch by batch, on
every technique alone and in combination; the baseline (the same run without any technique) and the combined saving
equal hand-computed figures; each technique's share adds up to the combined saving; the figures survive a resume and
sum over DDP ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback

from lightning_effi.callbacks import Curriculum, InfoBatchCallback, RandomLTDCallback, VCycleCallback
from lightning_effi.core.accounting import (
    Baseline,
    BatchStats,
    EfficiencyMonitor,
    lengthen_batch,
    technique_name,
)
from lightning_effi.core.flops import attention_recompute_flops, transformer_training_flops
from lightning_effi.data import CurriculumDataModule
from lightning_effi.infobatch.data import InfoBatchDataModule
from lightning_effi.random_ltd import functional as F
from lightning_effi.tasks import ImageClassifier
from tests.harness.settings import MONITOR_TIMES
from tests.helpers.flops import MeasuredFlops, flop_counter, read_measured
from tests.helpers.harness import assert_resume_equals_uninterrupted, fit_ddp, make_trainer
from tests.helpers.tiny import TINY_VIT, sgd, tiny_gpt2, tiny_image_data, tiny_lm_data

B, T, H, V = 8, 16, 32, 64  # tiny GPT-2: batch, block length, width, vocabulary
TRUNC = dict(  # seqlen_truncate from 2 to 16 tokens over 14 steps
    difficulty_type="value",
    clustering_type="single_cluster",
    min_difficulty=2,
    max_difficulty=16,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=14, difficulty_step=1),
)
TIMES = list(MONITOR_TIMES)


def vit4() -> ImageClassifier:
    return ImageClassifier("vit_tiny_patch16_224", model_kwargs={**TINY_VIT, "depth": 4}, optimizer=sgd)


def ltd(**kw: Any) -> RandomLTDCallback:
    return RandomLTDCallback(**{"min_value": 4, "max_value": 16, "require_steps": 8, "seq_per_step": 4, "seed": 7} | kw)


def ltd_vit() -> RandomLTDCallback:  # 16 patches + the class token
    return RandomLTDCallback(
        min_value=5, max_value=17, require_steps=8, seq_per_step=4, keep_prefix_tokens="auto", seed=7
    )


def curriculum() -> Curriculum:
    return Curriculum(metrics={"seqlen_truncate": TRUNC}, num_epochs=4)


def infobatch() -> InfoBatchCallback:
    return InfoBatchCallback(prune_ratio=0.5, delta=0.67, seed=7)


STEPS = dict(max_steps=6, max_epochs=-1)
VCYCLE_STEPS = dict(max_steps=7, max_epochs=-1)  # level 1 for 2 steps, level 2 for 3, level 1 for 2
EPOCHS = dict(max_epochs=3, max_steps=-1)  # InfoBatch: full, pruned, full


@dataclass(frozen=True)
class Config:
    model: Callable[[], pl.LightningModule]
    data: Callable[[], pl.LightningDataModule]
    callbacks: Callable[[], Sequence[Callback]]
    limits: dict[str, Any]


CONFIGS = {
    "gpt2": Config(tiny_gpt2, tiny_lm_data, lambda: [], STEPS),
    "gpt2_sdpa": Config(lambda: tiny_gpt2(attn_implementation="sdpa"), tiny_lm_data, lambda: [], STEPS),
    "gpt2+random_ltd": Config(lambda: tiny_gpt2(n_layer=4), tiny_lm_data, lambda: [ltd()], STEPS),
    "gpt2_sdpa+random_ltd": Config(
        lambda: tiny_gpt2(n_layer=4, attn_implementation="sdpa"), tiny_lm_data, lambda: [ltd()], STEPS
    ),
    "gpt2+curriculum": Config(tiny_gpt2, lambda: CurriculumDataModule(tiny_lm_data()), lambda: [curriculum()], STEPS),
    "gpt2+curriculum+random_ltd": Config(
        lambda: tiny_gpt2(n_layer=4), lambda: CurriculumDataModule(tiny_lm_data()), lambda: [curriculum(), ltd()], STEPS
    ),
    "vit": Config(vit4, tiny_image_data, lambda: [], STEPS),
    "vit+random_ltd": Config(vit4, tiny_image_data, lambda: [ltd_vit()], STEPS),
    "gpt2+vcycle": Config(tiny_gpt2, tiny_lm_data, lambda: [VCycleCallback(e_a=2, e_small=3)], VCYCLE_STEPS),
    "vit+vcycle": Config(vit4, tiny_image_data, lambda: [VCycleCallback(e_a=2, e_small=3)], VCYCLE_STEPS),
    "gpt2+infobatch": Config(tiny_gpt2, lambda: InfoBatchDataModule(tiny_lm_data()), lambda: [infobatch()], EPOCHS),
    "vit+infobatch": Config(vit4, lambda: InfoBatchDataModule(tiny_image_data()), lambda: [infobatch()], EPOCHS),
    # the two combinations made to work last
    "gpt2+vcycle+random_ltd": Config(
        lambda: tiny_gpt2(n_layer=4),
        tiny_lm_data,
        lambda: [VCycleCallback(e_a=2, e_small=3), ltd(layer_ids=[1])],  # layer 1 exists at both levels (4, 2 layers)
        VCYCLE_STEPS,
    ),
    "gpt2+infobatch+curriculum": Config(
        tiny_gpt2,
        lambda: CurriculumDataModule(InfoBatchDataModule(tiny_lm_data())),
        lambda: [infobatch(), curriculum()],
        dict(max_steps=10, max_epochs=-1),
    ),
}


class PerBatch(Callback):
    """After the monitor: the FLOPs it counted for each batch (``flops_per_batch``, which it writes) and the batch's
    sequence length."""

    def __init__(self) -> None:
        self.flops: list[int] = []
        self.lengths: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.flops.append(int(pl_module.flops_per_batch))
        ids = batch.get("input_ids")
        self.lengths.append(int(ids.shape[1]) if ids is not None else 0)


def run(config: Config, root: Path) -> tuple[pl.Trainer, dict[str, Any], MeasuredFlops, PerBatch]:
    pl.seed_everything(0, workers=True)
    measured, monitor, per_batch = MeasuredFlops(), EfficiencyMonitor(print_summary=False), PerBatch()
    techniques = list(config.callbacks())
    # the counter first: its window closes before any later callback counts FLOPs of its own in on_train_batch_end
    trainer = make_trainer(root, [measured, monitor, *techniques, per_batch], **config.limits)
    trainer.fit(config.model(), datamodule=config.data())
    return trainer, monitor.summary, measured, per_batch


def technique(trainer: pl.Trainer, cls: type) -> Any:
    return next(cb for cb in trainer.callbacks if isinstance(cb, cls))


# ------------------------------------------------------------------------------------------ measured = analytic


def test_the_counter_window_holds_forward_and_backward(tmp_path):
    """Between on_train_batch_start and on_train_batch_end (automatic optimization) the flop counter sees the forward
    and the backward of the batch: 3 x the forward of an eager GPT-2, every batch."""
    _, summary, measured, _ = run(CONFIGS["gpt2"], tmp_path)
    model = tiny_gpt2()
    with flop_counter() as counter, torch.no_grad():
        model.model(input_ids=torch.zeros(B, T, dtype=torch.long))
    assert measured.per_batch == [3 * counter.get_total_flops()] * 6
    assert summary["flops"] == measured.total


@pytest.mark.parametrize("name", list(CONFIGS))
def test_monitor_flops_equal_the_flop_counter(tmp_path, name):
    """Batch by batch and in total, exactly: random-LTD on fused attention (GPT-2 sdpa, timm ViT) counts the fused
    kernels' recompute of the scores in what it skips (``flops_per_layer(..., fused_attention=True)``)."""
    trainer, summary, measured, per_batch = run(CONFIGS[name], tmp_path)
    assert trainer.global_step > 0 and len(measured.per_batch) == summary["batches"] == len(per_batch.flops)
    assert summary["flops"] == pytest.approx(measured.total, rel=1e-9)
    assert per_batch.flops == pytest.approx(measured.per_batch, rel=1e-9)
    # the savings of the techniques add up to the combined saving, for every quantity
    for q in ("samples", "tokens", "layer_tokens", "flops"):
        shares = [v for k, v in summary.items() if k.startswith("saved/") and k.endswith(f"/{q}_frac")]
        assert sum(shares) == pytest.approx(summary[f"{q}_saved_frac"], abs=1e-12)
        assert summary[f"{q}_saved_frac"] == pytest.approx(1 - summary[q] / summary[f"baseline_{q}"])


class GQALlama(pl.LightningModule):
    """A user's module: a Hugging Face Llama with grouped-query attention (4 query heads, 1 key/value head) and a
    gated MLP, its loss the model's own, random-LTD through a ``GenericAdapter``."""

    def __init__(self, attn_implementation: str) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            num_hidden_layers=4,
            hidden_size=H,
            num_attention_heads=4,
            num_key_value_heads=1,
            intermediate_size=48,
            vocab_size=V,
            max_position_embeddings=64,
            use_cache=False,
            attn_implementation=attn_implementation,
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return sgd(self.parameters())


def gqa_ltd() -> RandomLTDCallback:
    from lightning_effi.adapters import GenericAdapter

    adapter = GenericAdapter(
        "model.model.layers",
        hidden_size=H,
        seq_args={"attention_mask": [-2, -1], "position_ids": [-1], "position_embeddings": [-2]},
        passthrough=["use_cache"],
        must_be_none=["cache"],
    )
    return ltd(adapter=adapter)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_random_ltd_saving_on_grouped_query_attention_is_measured(tmp_path, attention):
    """The FLOPs random-LTD skips are measured on the layer (its call replayed on the full sequence and on the kept
    tokens), not taken from a standard layer's formula: on grouped-query attention (key / value projections a quarter
    of the width) and the fused kernel's recompute, the monitor's FLOPs equal the flop counter's, batch by batch; the
    formula for a standard layer claims more (its key / value projections at full width)."""
    config = Config(lambda: GQALlama(attention), tiny_lm_data, lambda: [gqa_ltd()], STEPS)
    trainer, summary, measured, per_batch = run(config, tmp_path)
    assert per_batch.flops == pytest.approx(measured.per_batch, rel=1e-9)
    assert summary["flops"] == pytest.approx(measured.total, rel=1e-9)
    cb = technique(trainer, RandomLTDCallback)
    assert 0 < summary["saved/random_ltd/flops_frac"] and cb.saved_flops > 0
    lengths, inter = [cb.value_at(step) for step in range(6)], cb.adapter.intermediate_size()
    assert inter == 72  # the gated MLP's three matrices, as two of 3/2 the width
    formula = sum(2 * (F.flops_per_layer(B, T, H, inter) - F.flops_per_layer(B, r, H, inter)) for r in lengths)
    assert cb.saved_flops < 0.95 * formula


# ----------------------------------------------------------------------------------- baseline and savings by hand


def test_alone_the_baseline_is_the_run_itself(tmp_path):
    _, s, _, _ = run(CONFIGS["gpt2"], tmp_path)
    assert s["baseline_flops"] == s["flops"] == 6 * transformer_training_flops(B, T, 2, H, None, V)
    assert (s["baseline_samples"], s["baseline_tokens"], s["baseline_layer_tokens"]) == (48, 48 * T, 48 * T * 2)
    assert s["flops_saved_frac"] == s["tokens_saved_frac"] == 0.0
    assert not [k for k in s if k.startswith("saved/")]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_random_ltd_saving_on_fused_attention_by_hand(tmp_path, dropout):
    """GPT-2 sdpa with a constant r = 8 of 16 tokens on layers 1 and 2 of 4: on the CPU without attention dropout the
    fused kernel recomputes the scores, so each LTD layer also skips ``2B(S² - r²)H`` of the backward; with attention
    dropout PyTorch takes the math path (no recompute) and the saving is the eager one. Equal to the flop counter."""
    model = lambda: tiny_gpt2(n_layer=4, attn_implementation="sdpa", dropout=dropout)  # noqa: E731
    config = Config(model, tiny_lm_data, lambda: [ltd(min_value=8, max_value=8)], STEPS)
    _, s, measured, _ = run(config, tmp_path)
    fused = dropout == 0.0
    full = transformer_training_flops(B, T, 4, H, None, V, fused_attention=fused)
    skipped = 2 * 3 * (B * (T - 8) * (8 * H * H + 4 * H * 4 * H) + 4 * B * (T * T - 8 * 8) * H)
    skipped += 2 * 2 * B * (T * T - 8 * 8) * H if fused else 0
    assert s["baseline_flops"] == 6 * full and s["flops"] == 6 * (full - skipped) == measured.total
    assert s["saved/random_ltd/flops_frac"] == pytest.approx(skipped / full)


def test_curriculum_saving_by_hand(tmp_path):
    """Truncation lowers tokens, layer-tokens and FLOPs; the baseline is every batch at the full 16 tokens."""
    _, s, _, per_batch = run(CONFIGS["gpt2+curriculum"], tmp_path)
    lengths = per_batch.lengths
    assert lengths == [3, 4, 5, 6, 7, 8]  # the schedule's difficulty at steps 1..6
    f = lambda t: transformer_training_flops(B, t, 2, H, None, V)  # noqa: E731
    assert s["flops"] == sum(f(t) for t in lengths) and s["baseline_flops"] == 6 * f(T)
    assert s["flops_saved_frac"] == pytest.approx(1 - sum(f(t) for t in lengths) / (6 * f(T)))
    assert s["tokens_saved_frac"] == pytest.approx(1 - sum(lengths) / (6 * T))
    assert s["layer_tokens_saved_frac"] == s["tokens_saved_frac"]
    assert s["saved/curriculum/flops_frac"] == s["flops_saved_frac"]


def test_random_ltd_saving_by_hand(tmp_path):
    """A constant reserved length r = 8 of 16 tokens on layers 1 and 2 of 4: per batch the two layers skip
    ``3 (B (S - r)(8H^2 + 4H·4H) + 4B(S^2 - r^2)H)`` each."""
    config = Config(lambda: tiny_gpt2(n_layer=4), tiny_lm_data, lambda: [ltd(min_value=8, max_value=8)], STEPS)
    _, s, measured, _ = run(config, tmp_path)
    full = transformer_training_flops(B, T, 4, H, None, V)
    skipped = 2 * 3 * (B * (T - 8) * (8 * H * H + 4 * H * 4 * H) + 4 * B * (T * T - 8 * 8) * H)
    assert s["baseline_flops"] == 6 * full and s["flops"] == 6 * (full - skipped) == measured.total
    assert s["flops_saved_frac"] == pytest.approx(skipped / full)
    assert s["layer_tokens_saved_frac"] == pytest.approx(2 * (T - 8) / (4 * T))  # 0.25
    assert s["saved/random_ltd/flops_frac"] == s["flops_saved_frac"] and s["tokens_saved_frac"] == 0.0


def test_vcycle_saving_by_hand_and_across_a_switch(tmp_path):
    """Levels 1, 1, 2, 2, 2, 1, 1: the module counts the coarse model (its own config) after the switch, the baseline
    the full model on every batch; equal to the V-cycle's own figure."""
    trainer, s, measured, per_batch = run(CONFIGS["gpt2+vcycle"], tmp_path)
    c1, c2 = transformer_training_flops(B, T, 2, H, None, V), transformer_training_flops(B, T, 1, H // 2, None, V)
    assert per_batch.flops == measured.per_batch == [c1, c1, c2, c2, c2, c1, c1]
    assert s["baseline_flops"] == 7 * c1 and s["flops"] == 4 * c1 + 3 * c2
    assert s["saved/vcycle/flops_frac"] == pytest.approx(s["vcycle/flops_saved_frac"])
    assert s["layer_tokens_saved_frac"] == pytest.approx(3 * 1 / (7 * 2))  # 3 batches on 1 layer of 2
    assert technique(trainer, VCycleCallback).level == 1 and trainer.lightning_module.effi_num_layers == 2


def test_infobatch_saving_by_hand(tmp_path):
    """The pruned samples are charged at the trained ones' cost: with fixed-size samples every quantity saves
    ``pruned / (trained + pruned)``, InfoBatch's own ``saved_fraction``."""
    trainer, s, _, _ = run(CONFIGS["gpt2+infobatch"], tmp_path)
    history = technique(trainer, InfoBatchCallback).history
    pruned = sum(h["saved"] for h in history)
    assert pruned > 0 and s["samples"] + pruned == s["baseline_samples"] == 3 * 40
    for q in ("samples", "tokens", "layer_tokens", "flops"):
        assert s[f"{q}_saved_frac"] == pytest.approx(pruned / 120)
        assert s[f"saved/infobatch/{q}_frac"] == pytest.approx(pruned / 120)
    assert s["infobatch/saved_fraction"] == pytest.approx(pruned / 120)
    assert s["baseline_flops"] == pytest.approx(15 * transformer_training_flops(B, T, 2, H, None, V))


@pytest.mark.parametrize("order", ["curriculum_first", "vcycle_first"])
def test_combined_baseline_does_not_depend_on_the_order(tmp_path, order):
    """Truncation and the coarse model interact (the attention term): the baseline is counted with both undone at
    once, so it is the full model on full-length batches in either callback order; the shares split differently
    but add up to it."""
    stack = [curriculum(), VCycleCallback(e_a=2, e_small=3)]
    if order == "vcycle_first":
        stack.reverse()
    config = Config(tiny_gpt2, lambda: CurriculumDataModule(tiny_lm_data()), lambda: stack, VCYCLE_STEPS)
    _, s, measured, per_batch = run(config, tmp_path)
    assert s["flops"] == measured.total
    assert s["baseline_flops"] == 7 * transformer_training_flops(B, T, 2, H, None, V)
    assert s["baseline_tokens"] == 7 * B * T and s["baseline_layer_tokens"] == 7 * B * T * 2
    assert s["saved/curriculum/flops_frac"] + s["saved/vcycle/flops_frac"] == pytest.approx(s["flops_saved_frac"])


def test_fused_attention_is_counted_with_its_recompute(tmp_path):
    _, s, measured, _ = run(CONFIGS["gpt2_sdpa"], tmp_path)
    per_batch = transformer_training_flops(B, T, 2, H, None, V, fused_attention=True)
    assert per_batch == transformer_training_flops(B, T, 2, H, None, V) + attention_recompute_flops(B, T, 2, H)
    assert s["flops"] == measured.total == 6 * per_batch


# ------------------------------------------------------------------------------------------------ the protocol


class Doubles(Callback):
    """A technique that halves the samples drawn: the baseline doubles every count."""

    def effi_baseline(self, batch, pl_module):
        return Baseline(samples=2.0)


class Halves(Callback):
    def effi_adjust(self, stats, batch, pl_module):
        return BatchStats(stats.samples, stats.tokens, stats.layer_tokens // 2, stats.flops / 2)


def test_protocol_adjust_and_baseline_telescope(tmp_path):
    """Halves lowers layer-tokens and FLOPs by half, Doubles' baseline doubles everything: combined FLOPs saving
    ``1 - 0.5 / 2 = 0.75``, of which Halves 0.5 / 2 and Doubles 1 / 2."""
    pl.seed_everything(0)
    monitor = EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path, [monitor, Doubles(), Halves()], max_steps=3, max_epochs=-1)
    trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    s = monitor.summary
    assert s["flops_saved_frac"] == pytest.approx(0.75) and s["samples_saved_frac"] == pytest.approx(0.5)
    assert s["saved/halves/flops_frac"] == pytest.approx(0.25) and s["saved/doubles/flops_frac"] == pytest.approx(0.5)
    assert s["saved/halves/samples_frac"] == 0.0 and s["baseline_samples"] == 2 * s["samples"] == 48


class PrunesShortSamples(Callback):
    """A technique that skips one drawn sample per trained one, each skipped sample with twice a trained one's tokens
    on average: 2 samples, 3 tokens drawn per one trained."""

    def effi_baseline(self, batch, pl_module):
        return Baseline(samples=2.0, tokens=3.0)


def test_a_baseline_of_other_tokens_than_samples_scales_each_count_by_its_own_factor(tmp_path):
    """``Baseline.tokens`` scales the tokens, layer-tokens and FLOPs; ``samples`` the samples alone. Stacked after a
    baseline that changes the batch (the curriculum's untruncated one), both factors carry over to it."""
    for name, stack in (("alone", [PrunesShortSamples()]), ("truncated", [curriculum(), PrunesShortSamples()])):
        pl.seed_everything(0)
        monitor = EfficiencyMonitor(print_summary=False)
        data = tiny_lm_data() if name == "alone" else CurriculumDataModule(tiny_lm_data())
        trainer = make_trainer(tmp_path / name, [monitor, *stack], max_steps=2, max_epochs=-1)
        trainer.fit(tiny_gpt2(), datamodule=data)
        s = monitor.summary
        assert s["baseline_samples"] == 2 * s["samples"] == 2 * 2 * B
        assert s["baseline_tokens"] == 3 * 2 * B * T and s["baseline_layer_tokens"] == 3 * 2 * B * T * 2
        assert s["baseline_flops"] == pytest.approx(3 * 2 * transformer_training_flops(B, T, 2, H, None, V))
        ours = {q: s[f"saved/prunes_short_samples/{q}_frac"] for q in ("samples", "tokens", "layer_tokens", "flops")}
        if name == "alone":
            assert ours == pytest.approx({"samples": 1 / 2, "tokens": 2 / 3, "layer_tokens": 2 / 3, "flops": 2 / 3})
        else:  # 3 tokens per truncated one trained (this technique's share), then the curriculum's untruncated batch
            assert s["tokens"] < 2 * B * T and ours["tokens"] == pytest.approx(2 * s["tokens"] / (6 * B * T))
            assert ours["tokens"] + s["saved/curriculum/tokens_frac"] == pytest.approx(1 - s["tokens"] / (6 * B * T))


def test_protocol_helpers():
    with pytest.raises(ValueError, match="samples"):
        Baseline(samples=0)
    with pytest.raises(ValueError, match="samples"):
        Baseline(samples=float("inf"))
    for bad in (0, -1.0, float("nan"), True, "2"):
        with pytest.raises(ValueError, match=r"Baseline\.tokens must be a"):
            Baseline(samples=1.0, tokens=bad)
    assert Baseline(samples=2.0).factors() == (2.0, 2.0, 2.0, 2.0)
    assert Baseline(samples=2.0, tokens=0.5).factors() == (2.0, 0.5, 0.5, 0.5)
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3), "labels": 7}
    long = lengthen_batch(batch, ("input_ids", "attention_mask"), 5)
    assert long["input_ids"].shape == (2, 5) and long["attention_mask"].sum() == 10 and long["labels"] == 7
    assert lengthen_batch(batch, ("input_ids",), 2)["input_ids"] is batch["input_ids"]
    names = [technique_name(c) for c in (ltd(), VCycleCallback(e_a=1, e_small=1), infobatch(), curriculum(), Halves())]
    assert names == ["random_ltd", "vcycle", "infobatch", "curriculum", "halves"]


# --------------------------------------------------------------------------------------------- resume and DDP


def test_resume_keeps_baseline_and_savings(tmp_path):
    assert_resume_equals_uninterrupted(
        lambda: tiny_gpt2(n_layer=4),
        tiny_lm_data,
        tmp_path,
        total_steps=6,
        resume_step=3,
        callbacks_fn=lambda: [EfficiencyMonitor(print_summary=False), ltd()],
        ignore_state=TIMES,
    )


@pytest.mark.slow
def test_ddp_flops_are_the_sum_of_each_ranks_measured_flops(tmp_path):
    """2 ranks (gloo), random-LTD drawing other tokens on each: the summary's FLOPs (summed over ranks) equal the sum
    of what the flop counter measured on each rank."""
    monitor, measured = EfficiencyMonitor(print_summary=False), MeasuredFlops(tmp_path / "measured")
    _, per_rank = fit_ddp(
        tiny_gpt2(n_layer=4), tiny_lm_data(batch_size=5), tmp_path, [measured, monitor, ltd()], max_epochs=1
    )
    flops = read_measured(tmp_path / "measured")
    assert [len(f) for f in flops] == [4, 4]
    summary = per_rank[0]["summary"]
    assert summary == per_rank[1]["summary"]
    assert summary["flops"] == pytest.approx(sum(map(sum, flops)), rel=1e-9)
    assert summary["baseline_flops"] == 8 * transformer_training_flops(5, T, 4, H, None, V)
