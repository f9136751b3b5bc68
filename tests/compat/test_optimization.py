"""The compatibility matrix, optimization rows: gradient accumulation (fixed and scheduled), clipping, manual
optimization, LR schedulers (step, epoch, plateau, one-cycle), early stopping, checkpoints (best, periodic + resume)
and weight averaging (Lightning's and a third-party EMA), each with every technique column.

A working cell asserts the technique's effect (:func:`~tests.compat.setups.assert_effect`) and the feature's with a
value computed independently in the test: the learning rate of every step against torch's own scheduler replayed on
the same inputs (times the V-cycle's ``lr_multiplier`` at level 2), the averaged weights against an average of the
weights recorded after every step, the resumed run against the uninterrupted one, the gradient norms against the
clipping bound. A refused cell asserts the refusal before the first step, naming the feature.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    EarlyStopping,
    GradientAccumulationScheduler,
    LambdaCallback,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
    WeightAveraging,
)
from torch.optim.swa_utils import get_ema_multi_avg_fn

from lightning_effi import Curriculum, InfoBatchCallback, RandomLTDCallback, VCycleCallback
from lightning_effi.core.features import FEATURES, detect_features, parameter_copy_holders
from lightning_effi.core.lr_schedules import one_cycle, one_cycle_multiplier
from lightning_effi.core.progress import (
    accumulate_grad_batches_at,
    accumulation_changes,
    accumulation_segments,
    steps_of_epochs,
)
from lightning_effi.core.requirements import IncompatibleTechniques
from lightning_effi.data import CurriculumDataModule
from lightning_effi.infobatch import functional as ib
from lightning_effi.infobatch import weighted_loss
from lightning_effi.reference.tasks.language_models import GPT2CausalLM
from lightning_effi.vcycle import stages as S
from tests.compat.registry import Row, expect, works
from tests.compat.setups import (
    LAYERS,
    REFUSED,
    SEQ,
    STEPS,
    TECHNIQUES,
    WORKS,
    N,
    Run,
    assert_effect,
    assert_refused,
    build,
)
from tests.harness.settings import seeded
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TINY_GPT2, TinyDataModule, TokenBlocks, sgd

LR = 0.05  # the tiny GPT-2's SGD learning rate
TINY = {**TINY_GPT2, "optimizer": sgd}  # the keyword arguments of tests.helpers.tiny.tiny_gpt2
#: the V-cycle column's lr_multiplier at level 2 (tests/compat/setups.py), read at each step from the model's depth
LEVEL_2_DEPTH, LEVEL_2_FACTOR = 2, 2.0

ROWS: list[Row] = [
    Row(
        "accumulate_grad_batches",
        "Trainer(accumulate_grad_batches=2)",
        works(),
        "the micro-batches of an optimizer step are trained alike (one difficulty, one reserved length, one level) "
        "and each step equals the same step without accumulation; InfoBatch counts ceil(batches / 2) steps per epoch",
    ),
    Row(
        "gradient_accumulation_scheduler",
        "GradientAccumulationScheduler({0: 1, 1: 2})",
        works(curriculum=REFUSED, stack=REFUSED),
        "a factor that changes mid-run is refused by the curriculum (its stream lays out each step's micro-batches "
        "once; one step would mix difficulties); one factor for the whole run works with it. InfoBatch's progress "
        "counts each epoch's own factor. A fit resumed mid-epoch after the factor changed is not exact in Lightning "
        "2.6 itself, with or without a technique: the scheduler sets the factor in on_train_epoch_start, which "
        "Lightning skips for the resumed epoch (a 15-step run resumed at step 8 took 16)",
    ),
    Row(
        "gradient_clipping",
        "Trainer(gradient_clip_val=..., gradient_clip_algorithm='norm' / 'value')",
        works(),
        "every step's clipped gradient is within the bound, and clipping acted",
    ),
    Row(
        "manual_optimization",
        "manual optimization (automatic_optimization=False)",
        works(),
        "trains exactly what automatic optimization trains (InfoBatch's loss through weighted_loss, which every "
        "manual_backward must contain: a second loss with its own backward, a GAN's discriminator, is refused); "
        "self.optimizers() follows the V-cycle's rebuilt optimizers. With several "
        "optimizers stepped a batch (global_step counts each step), schedules in epochs or fractions are refused at "
        "the first batch, and with one optimizer stepped every k batches (gradients accumulated by hand) at the "
        "third step: give optimizer steps (the curriculum, which counts batches under manual "
        "optimization, warns instead); InfoBatch's progress counts a batch as one step",
    ),
    Row(
        "step_lr_scheduler",
        "a step-interval LR scheduler (StepLR)",
        works(),
        "each step's LR is torch's StepLR value (times lr_multiplier at the V-cycle's level 2)",
    ),
    Row(
        "epoch_lr_scheduler",
        "an epoch-interval LR scheduler (StepLR)",
        works(),
        "each step's LR is torch's StepLR value for its epoch (a V-cycle switch at an epoch's last batch included)",
    ),
    Row(
        "reduce_lr_on_plateau",
        "ReduceLROnPlateau with monitor",
        works(),
        "each step's LR is a reference ReduceLROnPlateau fed the same monitored values: the V-cycle carries the "
        "scheduler's state and reduced LR across its level changes",
    ),
    Row(
        "one_cycle_lr",
        "OneCycleLR(total_steps=trainer.estimated_stepping_batches)",
        works(infobatch=REFUSED),
        "each step's LR is torch's OneCycleLR value (V-cycle: its start, peak and end scaled at level 2). InfoBatch "
        "alone makes the run's steps unknown until its end: refused, use lr_schedules.one_cycle(progress=...). "
        "The curriculum warns at train start when its sample budget ends a run bounded by epochs before the "
        "estimate (set the max_steps it names)",
    ),
    Row(
        "early_stopping",
        "EarlyStopping",
        works(),
        "the fit stops at the second validation; a V-cycle stopped at level 2 ends with the full model restored "
        "(and its optimizer)",
    ),
    Row(
        "checkpoint_best",
        "ModelCheckpoint(monitor=..., save_top_k=1), then load the best",
        works(),
        "the best checkpoint has the lowest logged score and loads into a plain model that validates to it. "
        "V-cycle: a checkpoint written below level 1 holds the de-coalesced full model, another function with "
        "depth coalescing: it warns at train start (here the best is written at level 1)",
    ),
    Row(
        "checkpoint_periodic",
        "ModelCheckpoint(every_n_train_steps / every_n_epochs), then resume from one",
        works(),
        "the resumed fit ends with the uninterrupted run's weights and trains the same shapes after the resume; "
        "InfoBatch from every step (its epochs have different lengths), and every technique with an LR schedule "
        "sized from trainer.estimated_stepping_batches, which builds the training loader before the checkpoint is "
        "restored (the technique has it rebuilt, so the saved mid-epoch position is not lost: Lightning issue "
        "#20550)",
    ),
    Row(
        "weight_averaging",
        "WeightAveraging (EMA) and StochasticWeightAveraging",
        works(vcycle=REFUSED, stack=REFUSED),
        "the module ends with the average of the weights recorded at each update; the V-cycle replaces the model "
        "at every level change, so an average of its weights is refused. StochasticWeightAveraging's added "
        "forward-only epoch (the batch-norm update) is not counted as training by the EfficiencyMonitor",
    ),
    Row(
        "finetuning",
        "BackboneFinetuning / a BaseFinetuning callback (freeze, then unfreeze into the optimizer)",
        works(vcycle=REFUSED, stack=REFUSED),
        "the frozen blocks keep their initial weights through epoch 0 and train from epoch 1 while the rest trains "
        "throughout; the V-cycle rebuilds the optimizer (dropping the unfrozen group) and keeps requires_grad across "
        "levels, so the blocks would never train: refused at setup",
    ),
    Row(
        "model_pruning",
        "ModelPruning (l1_unstructured, made permanent at the end)",
        works(vcycle=REFUSED, stack=REFUSED),
        "half the pruned weights are exactly zero at the end and the rest trained; the V-cycle's coalescing does not "
        "map the pruning re-parametrization (weight_orig, weight_mask): refused at setup",
    ),
    Row(
        "third_party_ema",
        "a third-party EMA callback (a shadow copy of the parameters)",
        works(vcycle=REFUSED, stack=REFUSED),
        "the shadow is the EMA of the weights recorded after each step; with the V-cycle a callback holding a copy "
        "of the parameters is refused at train start (or, built lazily, before the first level change)",
    ),
]


# --------------------------------------------------------------------------------------------------- helpers
class Steps(pl.Callback):
    """Per training batch, at its start: the optimizer step it belongs to (``global_step`` before it), the epoch,
    the LR of the first param group and the model's depth (the V-cycle's level); per epoch end, the value of
    ``record_epoch(trainer)`` when given."""

    def __init__(self, record_epoch: Callable[[pl.Trainer], Any] | None = None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.epochs: list[Any] = []
        self.record_epoch = record_epoch

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.rows.append(
            dict(
                step=trainer.global_step,
                epoch=trainer.current_epoch,
                lr=float(trainer.optimizers[0].param_groups[0]["lr"]),
                depth=len(pl_module.model.transformer.h),
            )
        )

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.record_epoch is not None:
            self.epochs.append(self.record_epoch(trainer))


def lengths(run: Run) -> list[list[int]]:
    """Per training batch: the sequence length each block received (the batch dimension left out)."""
    return [[s[1] for s in b["blocks"]] for b in run.probe.batches]


def per_step(run: Run, steps: Steps) -> dict[int, list[list[int]]]:
    """Optimizer step -> the block lengths of each of its micro-batches."""
    out: dict[int, list[list[int]]] = defaultdict(list)
    assert len(steps.rows) == len(run.probe.batches)
    for row, shape in zip(steps.rows, lengths(run), strict=True):
        out[row["step"]].append(shape)
    return dict(out)


def level_factor(row: dict[str, Any]) -> float:
    """The V-cycle column's lr_multiplier for the level whose model trained this batch."""
    return LEVEL_2_FACTOR if row["depth"] == LEVEL_2_DEPTH else 1.0


def callback_of(run: Run, kind: type) -> Any:
    return next(c for c in run.callbacks if isinstance(c, kind))


def scheduled(make: Callable[[torch.optim.Optimizer, pl.LightningModule], dict[str, Any]]) -> Callable[[], Any]:
    """A seeded tiny GPT-2 whose ``configure_optimizers`` returns SGD (one param group) and ``make(opt, module)``
    as its LR scheduler configuration (rebuilt at every V-cycle level change)."""

    class Scheduled(GPT2CausalLM):
        def configure_optimizers(self) -> Any:
            opt = sgd(self.parameters())
            return {"optimizer": opt, "lr_scheduler": make(opt, self)}

    return seeded(lambda: Scheduled(**{**TINY, "n_layer": LAYERS}))


def reference_lrs(
    make: Callable[[torch.optim.Optimizer], Any], n: int, metrics: list[float] | None = None
) -> list[float]:
    """The LR torch's scheduler ``make(optimizer)`` gives each of ``n`` steps on a dummy SGD optimizer (stepped after
    each step, with ``metrics[k]`` for a plateau scheduler)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR, momentum=0.9)
    scheduler = make(opt)
    out = []
    for k in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        if k < n - 1:  # (a OneCycleLR raises when stepped past its total_steps)
            scheduler.step(metrics[k]) if metrics is not None else scheduler.step()
    return out


def plain_data() -> TinyDataModule:
    """The matrix's data without any technique's wrapper (for validating loaded checkpoints)."""
    return TinyDataModule(TokenBlocks(n=N, seq_len=SEQ), batch_size=4)


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


# ------------------------------------------------------------------------------------- gradient accumulation
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_accumulate_grad_batches(tmp_path: Path, technique: str) -> None:
    assert expect("accumulate_grad_batches", technique) == WORKS
    # the curriculum's sample budget (2 data epochs) holds 6 steps of 8 samples: 5 steps for every step-bounded run
    limits = {} if technique == "infobatch" else dict(max_steps=5)
    run, steps = build(technique), Steps()
    trainer = run.fit(tmp_path / "accumulated", [steps], accumulate_grad_batches=2, **limits)
    assert_effect(run)
    if technique == "infobatch":
        batches = [sum(r["epoch"] == e for r in steps.rows) for e in range(3)]
        assert batches[1] < batches[0] == 6  # the pruned epoch
        assert trainer.global_step == sum(math.ceil(b / 2) for b in batches)
        assert callback_of(run, InfoBatchCallback).effi_progress_done() == 1.0
        return
    assert trainer.global_step == 5 and len(run.probe.batches) == 10
    grouped = per_step(run, steps)
    plain = build(technique)
    plain_steps = Steps()
    plain.fit(tmp_path / "plain", [plain_steps], **limits)
    plain_grouped = per_step(plain, plain_steps)
    for step, micro in grouped.items():
        assert len(micro) == 2 and micro[0] == micro[1], (step, micro)  # one difficulty / length / level per step
        assert micro[0] == plain_grouped[step][0], (step, micro, plain_grouped[step])


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_gradient_accumulation_scheduler(tmp_path: Path, technique: str) -> None:
    schedule = GradientAccumulationScheduler({0: 1, 1: 2})
    run = build(technique)
    if expect("gradient_accumulation_scheduler", technique) == REFUSED:
        trainer = run.trainer(tmp_path, [schedule])
        assert_refused(run, trainer, "GradientAccumulationScheduler whose factor changes")
        return
    ib_cb = next((c for c in run.callbacks if isinstance(c, InfoBatchCallback)), None)
    steps = Steps(lambda t: ib_cb.effi_progress_done() if ib_cb is not None else None)
    fewest: list[int] = []
    at_start = LambdaCallback(on_train_start=lambda t, m: fewest.append(ib_cb.effi_min_total_steps()) if ib_cb else 0)
    trainer = run.fit(tmp_path, [schedule, steps, at_start])
    assert_effect(run)
    grouped = per_step(run, steps)
    for step, micro in grouped.items():
        assert all(m == micro[0] for m in micro), (step, micro)
    epochs = sorted({r["epoch"] for r in steps.rows})
    batches = [sum(r["epoch"] == e for r in steps.rows) for e in epochs]
    factors = [1 if e == 0 else 2 for e in epochs]
    if technique == "infobatch":  # 3 whole epochs: epoch e takes ceil(batches / factor_e) steps
        assert trainer.global_step == sum(math.ceil(b / f) for b, f in zip(batches, factors))
        assert steps.epochs == pytest.approx([1 / 3, 2 / 3, 1.0])  # progress counts each epoch's own factor
        # the fewest steps the run can have, read at train start (before the scheduler set any factor on the Trainer):
        # epoch 0 full (6 batches, factor 1), epoch 1 pruned to at least 1 + floor(0.5 * 23) = 12 samples (3
        # batches, factor 2), epoch 2 full (6 batches, factor 2)
        assert fewest == [6 + 2 + 3] and fewest[0] <= trainer.global_step
    else:
        assert (
            trainer.global_step == STEPS and batches[0] == 6 and all(len(m) == 2 for s, m in grouped.items() if s > 6)
        )


def test_a_constant_accumulation_schedule_trains_the_curriculum_like_accumulate_grad_batches(tmp_path: Path) -> None:
    """A scheduler with one factor for the whole run is not refused: the curriculum lays out its steps with that
    factor (read from the scheduler at setup, before Lightning sets it on the Trainer) and trains exactly as
    ``Trainer(accumulate_grad_batches=2)``."""
    results = []
    for name, kwargs, extra in (
        ("scheduled", {}, [GradientAccumulationScheduler({0: 2})]),
        ("trainer", dict(accumulate_grad_batches=2), []),
    ):
        run, steps = build("curriculum"), Steps()
        run.fit(tmp_path / name, [*extra, steps], max_steps=5, **kwargs)
        grouped = per_step(run, steps)
        assert all(len(m) == 2 and m[0] == m[1] for m in grouped.values()), grouped
        results.append((grouped, params(run.model)))
    assert results[0][0] == results[1][0]
    for k, v in results[0][1].items():
        assert torch.equal(v, results[1][1][k]), k


def test_vcycle_fractions_count_a_changing_accumulation_factor(tmp_path: Path) -> None:
    """A run bounded by epochs with a GradientAccumulationScheduler: the V-cycle's fractions are of the steps the run
    really has (6 + ceil(6 / 2) = 9; Lightning's estimated_stepping_batches counts 12 with the factor of 1 it shows
    at train start): e_a = floor(0.2 * 9) = 1 and e_small = floor(0.4 * 9) = 3 steps, level 2 for steps 2 to 4."""
    run, steps = build("vcycle"), Steps()
    trainer = run.fit(tmp_path, [GradientAccumulationScheduler({0: 1, 1: 2}), steps], max_epochs=2, max_steps=-1)
    assert trainer.global_step == 9 and callback_of(run, VCycleCallback).stages == [(1, 1), (2, 3)]
    assert sorted({r["step"] for r in steps.rows if r["depth"] == LEVEL_2_DEPTH}) == [1, 2, 3]


def test_accumulation_helpers() -> None:
    """Which factor Lightning applies in an epoch, and whether a schedule changes it within the run's epochs."""
    schedule = GradientAccumulationScheduler({0: 1, 2: 4})
    trainer = SimpleNamespace(callbacks=[schedule], accumulate_grad_batches=1, max_epochs=5)
    assert [accumulate_grad_batches_at(trainer, e) for e in range(4)] == [1, 1, 4, 4]
    assert accumulation_changes(trainer)
    assert not accumulation_changes(SimpleNamespace(callbacks=[schedule], max_epochs=2))  # the change comes later
    assert not accumulation_changes(SimpleNamespace(callbacks=[GradientAccumulationScheduler({0: 3})], max_epochs=-1))
    assert not accumulation_changes(SimpleNamespace(callbacks=[], accumulate_grad_batches=2, max_epochs=3))
    assert accumulate_grad_batches_at(SimpleNamespace(callbacks=[], accumulate_grad_batches=2), 7) == 2
    # the steps as (count, micro-batches) runs: 5 batches per epoch, factors 1, 1, 4, 4, 4 (5 = 4 + 1 at the end)
    loader = {"num_training_batches": 5, "max_steps": -1}
    segments = [(5, 1), (5, 1), (1, 4), (1, 1), (1, 4), (1, 1), (1, 4), (1, 1)]
    assert accumulation_segments(SimpleNamespace(**vars(trainer), **loader)) == segments
    assert accumulation_segments(SimpleNamespace(**vars(trainer), **loader | {"max_steps": 12})) == segments[:4]
    assert accumulation_segments(SimpleNamespace(**vars(trainer), **loader | {"max_steps": 8})) == [(5, 1), (3, 1)]
    assert accumulation_segments(SimpleNamespace(callbacks=[schedule], max_epochs=2, **loader)) is None  # no change
    # bounded by max_steps alone (qa61-break 01: None, so the first step's batch was taken for every step)
    steps_only = SimpleNamespace(callbacks=[schedule], max_epochs=-1, num_training_batches=5, max_steps=12)
    assert accumulation_segments(steps_only) == segments[:4]
    assert accumulation_segments(SimpleNamespace(**vars(steps_only) | {"max_epochs": None})) == segments[:4]
    assert accumulation_segments(SimpleNamespace(**vars(steps_only) | {"max_steps": -1})) is None  # no end
    assert accumulation_segments(SimpleNamespace(**vars(trainer), num_training_batches=float("inf"))) is None
    # epochs of their own lengths: 5, 3, 3 steps ({0: 1, 1: 2} over 5 batches); a start inside an epoch keeps its
    # fraction of the epoch; one length gives n x that length from anywhere
    three = [5, 3, 3, 3]
    assert [steps_of_epochs(three.__getitem__, n) for n in range(4)] == [0, 5, 8, 11]
    assert steps_of_epochs(three.__getitem__, 1, start_step=5) == 3 and steps_of_epochs(three.__getitem__, 1, 1) == 4
    assert all(steps_of_epochs(lambda e: 4, n, s) == 4 * n for n in range(4) for s in range(9))
    with pytest.raises(ValueError, match="epoch 0 has 0 optimizer steps"):
        steps_of_epochs(lambda e: 0, 1)
    # InfoBatch's fewest steps with one factor per epoch: 3 epochs of 24 samples, batch 4, the middle one pruned
    fewest = ib.min_epoch_size(1, 3, 24, 0.5, 0.67)
    assert (
        ib.min_total_steps(24, 3, 0.5, 0.67, 4, accumulate_grad_batches=[1, 2, 2])
        == 6 + math.ceil(math.ceil(fewest / 4) / 2) + 3
    )
    with pytest.raises(ValueError, match="one per epoch"):
        ib.min_total_steps(24, 3, 0.5, 0.67, 4, accumulate_grad_batches=[1, 2])


# ------------------------------------------------------------------------------------------- gradient clipping
class ClipRecorder(GPT2CausalLM):
    """Records, at every optimizer step, the largest gradient norm / value before and after Lightning's clipping."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.clips: list[tuple[float, float]] = []

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        algorithm = gradient_clip_algorithm
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

        def size() -> float:
            if algorithm == "value":
                return max(float(g.abs().max()) for g in grads)
            return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

        before = size()
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.clips.append((before, size()))


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_gradient_clipping(tmp_path: Path, technique: str) -> None:
    assert expect("gradient_clipping", technique) == WORKS
    for algorithm, bound in (("norm", 0.5), ("value", 0.01)):
        run = build(technique, seeded(lambda: ClipRecorder(**{**TINY, "n_layer": LAYERS})))
        trainer = run.fit(tmp_path / algorithm, gradient_clip_val=bound, gradient_clip_algorithm=algorithm)
        assert_effect(run)
        clips = run.model.clips
        assert len(clips) == trainer.global_step > 0
        assert all(after <= bound * (1 + 1e-5) for _, after in clips), clips  # within the bound at every step
        assert sum(before > bound for before, _ in clips) >= len(clips) // 2, clips  # and it clipped


# ------------------------------------------------------------------------------------------ manual optimization
class Manual(GPT2CausalLM):
    """The tiny GPT-2 with manual optimization: InfoBatch's loss through ``weighted_loss`` (the plain mean without
    InfoBatch), one ``manual_backward`` and one step of ``self.optimizers()`` per batch. Records whether that
    optimizer holds exactly the module's trainable parameters (the V-cycle rebuilds it at every level change).
    ``backward="mean"``: backpropagates the plain mean and computes the weighted loss beside it (for logging)."""

    def __init__(self, backward: str = "weighted", **kw: Any) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False
        self.backprop = backward
        self.followed: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        opt = self.optimizers()
        held = {id(p) for g in opt.optimizer.param_groups for p in g["params"]}
        self.followed.append(held == {id(p) for p in self.parameters() if p.requires_grad})
        per_sample, _ = self.per_sample_loss(batch)
        loss = weighted_loss(self, per_sample)
        opt.zero_grad()
        self.manual_backward(loss if self.backprop == "weighted" else per_sample.mean())
        opt.step()
        return loss


def manual(backward: str = "weighted") -> Callable[[], Manual]:
    return seeded(lambda: Manual(backward, **{**TINY, "n_layer": LAYERS}))


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_manual_optimization(tmp_path: Path, technique: str) -> None:
    assert expect("manual_optimization", technique) == WORKS
    run = build(technique, manual())
    trainer = run.fit(tmp_path / "manual")
    assert_effect(run)
    assert trainer.global_step == len(run.probe.batches) > 0 and all(run.model.followed)
    if technique in ("vcycle", "stack"):
        assert callback_of(run, VCycleCallback).switches == 2
    automatic = build(technique)
    automatic.fit(tmp_path / "automatic")
    assert lengths(automatic) == lengths(run)
    for k, v in params(automatic.model).items():  # the same training, step for step
        torch.testing.assert_close(params(run.model)[k], v, rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.parametrize("technique", ["infobatch", "stack"])
def test_manual_step_backpropagating_an_unweighted_loss_is_refused(tmp_path: Path, technique: str) -> None:
    """The issue's bug: a manual step that computes InfoBatch's weighted loss (e.g. to log it) but backpropagates the
    plain mean trained the pruned epochs on unweighted losses, silently. Now its first ``manual_backward`` raises."""
    run = build(technique, manual("mean"))
    with pytest.raises(ValueError, match="not computed from the result of weighted_loss.*A second loss with its own "
                       "manual_backward \\(a GAN's discriminator.*not supported with InfoBatch"):  # fmt: skip
        run.fit(tmp_path)
    assert len(run.model.followed) == 1  # the first step


class TwoOptimizers(Manual):
    """Manual optimization stepping two optimizers once a batch (a GAN's pattern): global_step advances 2 a batch."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.other = torch.nn.Parameter(torch.ones(2))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        first, second = self.optimizers()
        per_sample, _ = self.per_sample_loss(batch)
        loss = weighted_loss(self, per_sample) + self.other.square().sum()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        return loss

    def configure_optimizers(self) -> Any:
        return [sgd(self.model.parameters()), torch.optim.SGD([self.other], lr=0.1)]


@pytest.mark.parametrize(
    "callback, words",
    [
        (lambda: VCycleCallback(e_a="1ep", e_small="1ep", width_scheme=None), ("VCycleCallback", "e_a='1ep', ")),
        (lambda: RandomLTDCallback(min_value=4, max_value=16, seq_per_step=4), ("RandomLTDCallback", "'1dur'")),
    ],
)
def test_schedules_in_epochs_or_fractions_are_refused_with_two_optimizer_steps_a_batch(tmp_path, callback, words):
    """global_step advances 2 a batch, while epochs and fractions resolve in batches: the V-cycle's '1ep' stage ended
    after half an epoch and random-LTD's growth at half its length (the helper's runs). Refused at train start; in
    optimizer steps (global_step's unit, as max_steps counts) the schedule trains."""
    model = seeded(lambda: TwoOptimizers(**{**TINY, "n_layer": 4}))
    data = TinyDataModule(TokenBlocks(n=32), batch_size=8)  # 4 batches an epoch
    trainer = make_trainer(tmp_path / "refused", [callback()], max_epochs=2)
    owner, given = words
    with pytest.raises(ValueError, match=rf"{owner}: manual optimization stepped 2 optimizers in the first batch.*"
                       rf"{given}"):  # fmt: skip
        trainer.fit(model(), datamodule=data)
    assert trainer.global_step == 2  # refused at the end of the first batch
    vcycle = VCycleCallback(e_a=2, e_small=4, width_scheme=None)
    trainer = make_trainer(tmp_path / "steps", [vcycle], max_epochs=2)
    trainer.fit(model(), datamodule=data)
    assert trainer.global_step == 16 and vcycle.switches == 2


class AccumulatesByHand(Manual):
    """Manual optimization accumulating gradients by hand: one optimizer stepped every second batch."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        opt = self.optimizers()
        per_sample, _ = self.per_sample_loss(batch)
        loss = weighted_loss(self, per_sample)
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()
        return loss


def test_accumulation_by_hand_is_refused_or_warned_where_the_units_differ(tmp_path):
    """global_step advances once every 2 batches: random-LTD's '1ep' growth took two epochs and ended below
    max_value (14 of 16), and the curriculum, which counts batches under manual optimization, ran twice as fast,
    the two micro-batches of one step at difficulties of their own, in silence (qa45-break 02). Random-LTD refuses a
    duration resolved in batches once the third step shows it; the curriculum says its unit."""
    model = seeded(lambda: AccumulatesByHand(**{**TINY, "n_layer": 4}))
    data = TinyDataModule(TokenBlocks(n=32), batch_size=4)  # 8 batches an epoch
    ltd = RandomLTDCallback(min_value=4, max_value=16, seq_per_step=2, require_steps="1ep")
    trainer = make_trainer(tmp_path / "ltd", [ltd], max_epochs=2)
    with pytest.raises(ValueError, match=r"RandomLTDCallback: manual optimization stepped the optimizer once every 2 "
                       r"batches.*require_steps='1ep'.*2 times as slow"):  # fmt: skip
        trainer.fit(model(), datamodule=data)
    assert trainer.global_step == 3  # k = 2: refused at the third step (two equal gaps)
    trainer = make_trainer(tmp_path / "ltd_steps", [RandomLTDCallback(min_value=4, max_value=16, seq_per_step=2,
                                                                      require_steps=4)], max_epochs=1)  # fmt: skip
    trainer.fit(model(), datamodule=data)  # in optimizer steps: trains
    assert trainer.global_step == 4
    metrics = {"seqlen_truncate": dict(difficulty_type="value", clustering_type="single_cluster", min_difficulty=4,
               max_difficulty=16, schedule_type="fixed_linear",
               schedule_config=dict(total_curriculum_step=6, difficulty_step=2))}  # fmt: skip
    trainer = make_trainer(tmp_path / "cl", [Curriculum(metrics=metrics)], max_steps=4)
    with pytest.warns(UserWarning, match=r"Curriculum: manual optimization stepped the optimizer once every 2 batches"
                      r".*runs 2 times as fast.*accumulate_grad_batches=2"):  # fmt: skip
        trainer.fit(model(), datamodule=CurriculumDataModule(data))


def test_computed_from_walks_the_autograd_graph() -> None:
    x = torch.randn(4, requires_grad=True)
    per_sample = x * 2
    weighted = (per_sample * torch.tensor([1.0, 2.0, 1.0, 2.0])).mean()
    assert ib.computed_from(weighted, weighted) and ib.computed_from(weighted / 4 + x.sum(), weighted)
    assert not ib.computed_from(per_sample.mean(), weighted) and not ib.computed_from(x.sum(), weighted)
    assert not ib.computed_from(per_sample.mean(), torch.tensor(1.0))  # no graph: only itself


# ------------------------------------------------------------------------------------------------ LR schedulers
def assert_lrs(steps: Steps, expected: list[float]) -> None:
    """Each batch trained at ``expected[step]`` times the V-cycle level's lr_multiplier."""
    got = [r["lr"] for r in steps.rows]
    want = [expected[r["step"]] * level_factor(r) for r in steps.rows]
    assert got == pytest.approx(want, rel=1e-6), list(zip(got, want))


def step_lr(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_step_lr_scheduler(tmp_path: Path, technique: str) -> None:
    assert expect("step_lr_scheduler", technique) == WORKS
    run, steps = build(technique, scheduled(lambda o, m: {"scheduler": step_lr(o), "interval": "step"})), Steps()
    trainer = run.fit(tmp_path, [steps])
    assert_effect(run)
    assert_lrs(steps, reference_lrs(step_lr, trainer.global_step))
    assert len({r["lr"] for r in steps.rows}) >= 3  # the schedule changed the LR


def epoch_lr(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_epoch_lr_scheduler(tmp_path: Path, technique: str) -> None:
    """The V-cycle column switches back to level 1 at step 6, the last batch of epoch 0, after Lightning stepped the
    epoch scheduler: the rebuilt one must continue at epoch 1's LR (it was advanced by ``current_epoch``, one step
    short, before the fix)."""
    assert expect("epoch_lr_scheduler", technique) == WORKS
    run, steps = build(technique, scheduled(lambda o, m: {"scheduler": epoch_lr(o), "interval": "epoch"})), Steps()
    run.fit(tmp_path, [steps])
    assert_effect(run)
    got = [r["lr"] for r in steps.rows]
    want = [LR * 0.5 ** r["epoch"] * level_factor(r) for r in steps.rows]
    assert got == pytest.approx(want, rel=1e-6), list(zip(got, want))
    assert {r["epoch"] for r in steps.rows} >= {0, 1}


class Monitored(pl.Callback):
    """The monitored value after each training batch (what a step-interval plateau scheduler is stepped with)."""

    def __init__(self, key: str) -> None:
        self.key, self.values = key, []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.values.append(float(trainer.callback_metrics[self.key]))


def plateau(opt: torch.optim.Optimizer) -> Any:  # nearly every step is "bad": a reduction every other step
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1, threshold=0.5)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_reduce_lr_on_plateau(tmp_path: Path, technique: str) -> None:
    """The issue's bug: the V-cycle rebuilt a fresh ReduceLROnPlateau at every level change, so the LR jumped back to
    its initial value and the plateau's count restarted. Now every step's LR is that of a reference plateau
    scheduler fed the same monitored values, across the switches."""
    assert expect("reduce_lr_on_plateau", technique) == WORKS
    config = {"interval": "step", "monitor": "train/loss"}
    run = build(technique, scheduled(lambda o, m: {"scheduler": plateau(o), **config}))
    steps, monitored = Steps(), Monitored("train/loss")
    trainer = run.fit(tmp_path, [steps, monitored])
    assert_effect(run)
    assert_lrs(steps, reference_lrs(plateau, trainer.global_step, monitored.values))
    assert min(r["lr"] for r in steps.rows) <= LR / 4  # reduced twice at least


def one_cycle_lr(total: int) -> Callable[[torch.optim.Optimizer], Any]:
    return lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=total)


def one_cycle_config(opt: torch.optim.Optimizer, module: pl.LightningModule) -> dict[str, Any]:
    total = int(module.trainer.estimated_stepping_batches)
    return {"scheduler": one_cycle_lr(total)(opt), "interval": "step"}


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_one_cycle_lr(tmp_path: Path, technique: str) -> None:
    """Each step's LR is torch's OneCycleLR value; at the V-cycle's level 2 the whole cycle is scaled by its
    lr_multiplier (before the fix only the start was: ``max_lr`` / ``min_lr`` kept the full model's). InfoBatch alone
    is refused: see ``test_infobatch_one_cycle_on_its_progress``."""
    run = build(technique, scheduled(one_cycle_config))
    if expect("one_cycle_lr", technique) == REFUSED:
        assert_refused(run, run.trainer(tmp_path), "OneCycleLR stepped every optimizer step")
        return
    steps = Steps()
    trainer = run.fit(tmp_path, [steps])
    assert_effect(run)
    assert trainer.global_step == STEPS
    assert_lrs(steps, reference_lrs(one_cycle_lr(STEPS), STEPS))


def test_infobatch_one_cycle_on_its_progress(tmp_path: Path) -> None:
    """What InfoBatch's refusal of OneCycleLR proposes: ``lr_schedules.one_cycle`` on ``effi_progress`` ends exactly
    at the cycle's final LR on the run's last step, however many steps the pruned epochs took; every step's LR is
    the one-cycle multiplier at InfoBatch's progress (``effi_progress``, counted here from the batches each epoch
    trained). A OneCycleLR sized with ``expected_total_steps()`` (an estimate) is refused before
    the first step, as any step-interval OneCycleLR is."""

    def progress_config(opt: torch.optim.Optimizer, module: pl.LightningModule) -> dict[str, Any]:
        cb = next(c for c in module.trainer.callbacks if isinstance(c, InfoBatchCallback))
        return {"scheduler": one_cycle(opt, 100, progress=cb.effi_progress), "interval": "step"}

    run, steps = build("infobatch", scheduled(progress_config)), Steps()
    trainer = run.fit(tmp_path / "progress", [steps])
    assert_effect(run)
    per_epoch = [sum(r["epoch"] == e for r in steps.rows) for e in range(3)]
    assert per_epoch[1] < per_epoch[0] and trainer.global_step == sum(per_epoch)
    # the LR of a step is set after the previous one, at the progress after the next step by the epoch plan known
    # then: (e + (j + 1) / L_e) / 3 after step j (1-based) of epoch e; the first step's at train start, once epoch 0
    # is planned: (0 + 1 / L_0) / 3 (it was read when the scheduler was built, at progress 0, qa76-break 05)
    want, done = [LR * one_cycle_multiplier(1 / per_epoch[0] / 3)], defaultdict[int, int](int)
    for r in steps.rows[:-1]:
        done[r["epoch"]] += 1
        want.append(
            LR * one_cycle_multiplier(min(1.0, (r["epoch"] + (done[r["epoch"]] + 1) / per_epoch[r["epoch"]]) / 3))
        )
    assert [r["lr"] for r in steps.rows] == pytest.approx(want, rel=1e-9)
    assert steps.rows[-1]["lr"] == pytest.approx(LR / 25 / 1e4) and max(want) > 0.95 * LR

    def expected_config(opt: torch.optim.Optimizer, module: pl.LightningModule) -> dict[str, Any]:
        cb = next(c for c in module.trainer.callbacks if isinstance(c, InfoBatchCallback))
        return {"scheduler": one_cycle_lr(cb.expected_total_steps(4))(opt), "interval": "step"}

    sized = build("infobatch", scheduled(expected_config))
    assert_refused(sized, sized.trainer(tmp_path / "expected"), "OneCycleLR")


def test_one_cycle_schedule_is_torchs_and_clamps() -> None:
    """``lr_schedules.one_cycle`` without a progress source gives torch's OneCycleLR values and holds the final LR
    past ``total_steps`` (torch raises)."""
    for total in (2, 10, 33):
        ours = reference_lrs(lambda o, total=total: one_cycle(o, total), total + 3)  # type: ignore[misc]
        assert ours[:total] == pytest.approx(reference_lrs(one_cycle_lr(total), total), rel=1e-12)
        assert ours[total:] == pytest.approx([LR / 25 / 1e4] * 3)
    assert one_cycle_multiplier(0.0) == pytest.approx(1 / 25) and one_cycle_multiplier(0.3) == 1.0
    assert one_cycle_multiplier(2.0) == one_cycle_multiplier(1.0) == pytest.approx(1 / 25 / 1e4)
    with pytest.raises(ValueError, match="pct_start"):
        one_cycle_multiplier(0.5, pct_start=1.0)


def test_level_change_continues_each_scheduler() -> None:
    """``stages.continue_schedulers`` without a Trainer: a fresh scheduler is stepped as often as the one it replaces
    (an epoch scheduler already stepped at the epoch's end included); a plateau scheduler gets the old one's best
    value, bad-epoch count and reduced LR times the level ratio; ``scale_learning_rates`` scales OneCycleLR's start,
    peak and end, and the schedulers a SequentialLR drives."""

    def config(scheduler: Any, interval: str = "step", plateau: bool = False) -> Any:
        return SimpleNamespace(scheduler=scheduler, interval=interval, frequency=1, reduce_on_plateau=plateau)

    def sgd_opt() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)

    old_opt = sgd_opt()
    old = [config(epoch_lr(old_opt), "epoch"), config(plateau(old_opt), plateau=True)]
    old[0].scheduler.step()  # one epoch ended
    for value in (1.0, 2.0, 3.0):  # best 1.0, then 2 bad steps: reduced once (patience 1)
        old[1].scheduler.step(value)
    progress = S.scheduler_progress(old)
    new_opt = sgd_opt()
    new = [config(epoch_lr(new_opt), "epoch"), config(plateau(new_opt), plateau=True)]
    S.continue_schedulers(new, progress, global_step=6, current_epoch=0, lr_ratio=2.0)
    assert new[0].scheduler.last_epoch == 1  # not current_epoch = 0
    assert new[1].scheduler.best == 1.0 and new[1].scheduler.num_bad_epochs == 0
    assert new_opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5 * 0.5 * 2.0)  # StepLR's, then the plateau's
    new[1].scheduler.step(4.0)
    new[1].scheduler.step(5.0)  # two more bad steps: reduced again
    assert new_opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5 * 0.5 * 2.0 * 0.5)

    cycle_opt = sgd_opt()
    cycle = torch.optim.lr_scheduler.OneCycleLR(cycle_opt, max_lr=LR, total_steps=10)
    S.scale_learning_rates([cycle_opt], [config(cycle)], 2.0)
    group = cycle_opt.param_groups[0]
    assert (group["initial_lr"], group["max_lr"], group["min_lr"]) == pytest.approx(
        (2 * LR / 25, 2 * LR, 2 * LR / 25e4)
    )
    seq_opt = sgd_opt()
    inner = torch.optim.lr_scheduler.LambdaLR(seq_opt, lambda k: 1.0)
    seq = torch.optim.lr_scheduler.SequentialLR(seq_opt, [inner, torch.optim.lr_scheduler.ConstantLR(seq_opt)], [2])
    S.scale_learning_rates([seq_opt], [config(seq)], 4.0)
    assert inner.base_lrs == [pytest.approx(4 * LR)]


def test_level_change_continues_a_chained_scheduler() -> None:
    """A ``ChainedScheduler`` has no ``last_epoch``: read as 0 steps, its replacement was never stepped forward and
    the chained warmup restarted at every level change (3.5x the LR at the end, qa100-user 01). Its members' count is
    read: the new chain continues at the old one's LR, and steps on as it would have."""
    from torch.optim.lr_scheduler import ChainedScheduler, ExponentialLR, LinearLR

    def chain(opt: torch.optim.Optimizer) -> Any:
        scheduler = ChainedScheduler([LinearLR(opt, 0.1, total_iters=4), ExponentialLR(opt, 0.9)])
        return SimpleNamespace(scheduler=scheduler, interval="step", frequency=1, reduce_on_plateau=False)

    old_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    old = [chain(old_opt)]
    for _ in range(6):
        old_opt.step()
        old[0].scheduler.step()
    progress = S.scheduler_progress(old)
    assert progress[0].steps == 6
    new_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    new = [chain(new_opt)]
    S.continue_schedulers(new, progress, global_step=6, current_epoch=0)
    assert new_opt.param_groups[0]["lr"] == pytest.approx(old_opt.param_groups[0]["lr"], rel=1e-12)
    assert new_opt.param_groups[0]["lr"] == pytest.approx(LR * 0.9**6, rel=1e-12)  # past the 4-step warmup
    import numpy as np  # a last_epoch held as a numpy integer is a count, as int() read it before

    scheduler = SimpleNamespace(last_epoch=np.int64(5), optimizer=old_opt)
    assert S.scheduler_progress([SimpleNamespace(scheduler=scheduler, reduce_on_plateau=False)])[0].steps == 5


# ------------------------------------------------------------------------------------------------ early stopping
def validation(technique: str, every: int = 2) -> dict[str, Any]:
    """Trainer arguments validating on one batch every ``every`` optimizer steps (InfoBatch alone: at every epoch's
    end, since its epochs have no fixed length)."""
    if technique == "infobatch":
        return dict(limit_val_batches=1)
    return dict(limit_val_batches=1, val_check_interval=every, check_val_every_n_epoch=None)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_early_stopping(tmp_path: Path, technique: str) -> None:
    """Stopped by EarlyStopping at its second validation: step 4 (the V-cycle at level 2: the issue's bug left the
    coarse model in the module; it is restored to the full model, its optimizer rebuilt, with a warning), step 8 in
    the stack (after InfoBatch thinned), the end of the pruned epoch 1 for InfoBatch alone."""
    assert expect("early_stopping", technique) == WORKS
    stop = EarlyStopping(monitor="val/loss", min_delta=1e9, patience=1)  # only the first check improves
    run, steps = build(technique), Steps()
    every = 4 if technique == "stack" else 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = run.fit(tmp_path, [stop, steps], **validation(technique, every))
    assert_effect(run)
    assert trainer.should_stop and stop.stopped_epoch == steps.rows[-1]["epoch"]  # stopped by EarlyStopping
    if technique == "infobatch":
        assert {r["epoch"] for r in steps.rows} == {0, 1} and trainer.global_step == len(steps.rows)
        return
    assert trainer.global_step == 2 * every < STEPS
    if technique in ("vcycle", "stack"):
        vcycle = callback_of(run, VCycleCallback)
        assert vcycle.level == 1 and vcycle.cut_short_level == (2 if technique == "vcycle" else 0)
        network = run.model.model
        assert len(network.transformer.h) == LAYERS and network.transformer.wte.weight.shape == (64, 32)
        held = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
        assert held == {id(p) for p in run.model.parameters() if p.requires_grad}
        assert (technique == "vcycle") == any("the run ended at level 2" in str(w.message) for w in caught)


# ---------------------------------------------------------------------------------------------------- checkpoints
class Scores(pl.Callback):
    """The monitored validation score at every validation: ``{global_step: value}``."""

    def __init__(self) -> None:
        self.values: dict[int, float] = {}

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.values[trainer.global_step] = float(trainer.callback_metrics["val/loss"])


def validate_plain(root: Path, model: pl.LightningModule, batches: int) -> float:
    """The validation loss of ``model`` on the matrix's data, with a plain Trainer (no technique)."""
    result = make_trainer(root, limit_val_batches=batches).validate(model, datamodule=plain_data(), verbose=False)
    return float(result[0]["val/loss"])


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_checkpoint_best(tmp_path: Path, technique: str) -> None:
    assert expect("checkpoint_best", technique) == WORKS
    best = ModelCheckpoint(tmp_path / "ckpts", monitor="val/loss", save_top_k=1, filename="{step}")
    run, scores = build(technique), Scores()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(tmp_path / "fit", [best, scores], **{**validation(technique), "limit_val_batches": 2})
    assert_effect(run)
    assert len(scores.values) >= 3 and float(best.best_model_score) == min(scores.values.values())
    step = min(scores.values, key=lambda s: scores.values[s])
    assert Path(best.best_model_path).name == f"step={step}.ckpt" and len(list((tmp_path / "ckpts").iterdir())) == 1
    loaded = GPT2CausalLM.load_from_checkpoint(best.best_model_path)  # full model, no technique, full sequences
    assert validate_plain(tmp_path / "validate", loaded, 2) == pytest.approx(scores.values[step], rel=1e-6)
    if technique in ("vcycle", "stack"):
        vcycle = callback_of(run, VCycleCallback)
        state = torch.load(best.best_model_path, weights_only=True)["callbacks"][vcycle.state_key]
        assert state["level"] == 1  # written at level 1: the model that scored (below it: the warning)
        assert any("ranks checkpoints by a score that, below level 1" in str(w.message) for w in caught)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_checkpoint_periodic(tmp_path: Path, technique: str) -> None:
    """Checkpoints every 3 steps (InfoBatch alone: every epoch); a new run resumed from the one of step 3 (the
    V-cycle at level 2; InfoBatch: the end of epoch 0, before the pruned epoch) ends with the uninterrupted run's
    weights, after training the same shapes."""
    assert expect("checkpoint_periodic", technique) == WORKS
    every = dict(every_n_epochs=1) if technique == "infobatch" else dict(every_n_train_steps=3)
    periodic = ModelCheckpoint(tmp_path / "ckpts", save_top_k=-1, filename="{step}", **every)
    first = build(technique)
    trainer = first.fit(tmp_path / "first", [periodic])
    assert_effect(first)
    saved = sorted(int(p.stem.split("=")[1]) for p in (tmp_path / "ckpts").iterdir())
    resume_step = saved[0]
    if technique == "infobatch":  # the ends of epochs 0 (6 steps), 1 (pruned) and 2
        assert len(saved) == 3 and resume_step == 6 and saved[-1] == trainer.global_step
    else:
        assert saved == [3, 6, 9]
    second = build(technique)
    second.trainer(tmp_path / "second").fit(
        second.model, datamodule=second.datamodule, ckpt_path=tmp_path / "ckpts" / f"step={resume_step}.ckpt"
    )
    after = [b for b in first.probe.batches if b["step"] > resume_step]
    assert [b["blocks"] for b in second.probe.batches] == [b["blocks"] for b in after]
    for k, v in params(first.model).items():
        assert torch.equal(params(second.model)[k], v), k


def cosine_over_estimate(opt: torch.optim.Optimizer, module: pl.LightningModule) -> dict[str, Any]:
    """A step-interval cosine LambdaLR sized with ``trainer.estimated_stepping_batches``, Lightning's documented
    recipe: reading it builds the training loader inside ``configure_optimizers``, before a resumed fit's loops are
    restored."""
    total = max(1, int(module.trainer.estimated_stepping_batches))
    cosine = lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total))  # noqa: E731
    return {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, cosine), "interval": "step"}


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_checkpoint_periodic_estimated_steps(tmp_path: Path, technique: str) -> None:
    """``checkpoint_periodic`` with an LR schedule sized from ``trainer.estimated_stepping_batches``: resumed from a
    checkpoint in the middle of epoch 0 (step 2 of 6) and from one in the middle of a later epoch (InfoBatch: its
    pruned epoch 1), the fit ends with the uninterrupted run's weights after training the same shapes. Before the
    fix, InfoBatch planned epoch 0 again over the restored plan (a mid-epoch resume then raised, or trained other
    samples), and in epoch 0 the checkpoint's loader state was dropped (Lightning issue #20550), so the epoch was
    replayed from its start."""
    assert expect("checkpoint_periodic", technique) == WORKS
    periodic = ModelCheckpoint(tmp_path / "ckpts", save_top_k=-1, filename="{step}", every_n_train_steps=1)
    # epoch-bounded (a step-bounded fit's estimate is max_steps, read without building the loader)
    limits = {} if technique == "infobatch" else dict(max_epochs=2, max_steps=-1)
    first = build(technique, scheduled(cosine_over_estimate))
    trainer = first.fit(tmp_path / "first", [periodic], **limits)
    assert_effect(first)
    epochs = {b["step"]: b["epoch"] for b in first.probe.batches}
    later = next(s for s in sorted(epochs) if epochs[s] == 1 and epochs.get(s + 1) == 1 and s > 0)
    for resume_step in (2, later):
        assert 0 < resume_step < trainer.global_step
        second = build(technique, scheduled(cosine_over_estimate))
        second.trainer(tmp_path / f"second{resume_step}", **limits).fit(
            second.model, datamodule=second.datamodule, ckpt_path=tmp_path / "ckpts" / f"step={resume_step}.ckpt"
        )
        after = [b for b in first.probe.batches if b["step"] > resume_step]
        assert [b["blocks"] for b in second.probe.batches] == [b["blocks"] for b in after], resume_step
        for k, v in params(first.model).items():
            assert torch.equal(params(second.model)[k], v), (resume_step, k)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_infobatch_resume_from_every_step(tmp_path: Path, accumulate: int) -> None:
    """InfoBatch alone, resumed from the checkpoint of every optimizer step (``every_n_train_steps=1``), ends with
    the uninterrupted run's weights after training the same batches. Among them the last batch of the pruned epoch 1,
    after which a longer epoch follows: Lightning entered that epoch at the finished one's batch count (it compares
    it with the new epoch's length) and skipped all but its last batch(es), silently, before the fix."""
    periodic = ModelCheckpoint(tmp_path / "ckpts", save_top_k=-1, filename="{step}", every_n_train_steps=1)
    first = build("infobatch")
    trainer = first.fit(tmp_path / "first", [periodic], accumulate_grad_batches=accumulate)
    assert_effect(first)
    per_epoch = defaultdict(int)
    for b in first.probe.batches:
        per_epoch[b["epoch"]] += 1
    assert per_epoch[1] < per_epoch[2] == per_epoch[0]  # a pruned epoch, then a longer full one
    for step in range(1, trainer.global_step):
        second = build("infobatch")
        second.trainer(tmp_path / f"second{step}", accumulate_grad_batches=accumulate).fit(
            second.model, datamodule=second.datamodule, ckpt_path=tmp_path / "ckpts" / f"step={step}.ckpt"
        )
        trained = [(b["epoch"], b["batch_idx"]) for b in second.probe.batches]
        # the checkpoint is written at the batch that took optimizer step `step`; the resume trains what followed
        at = next(i for i, b in enumerate(first.probe.batches) if b["step"] == step)
        expected = [(b["epoch"], b["batch_idx"]) for b in first.probe.batches[at + 1 :]]
        assert trained == expected, step
        for k, v in params(first.model).items():
            assert torch.equal(params(second.model)[k], v), (step, k)


# ---------------------------------------------------------------------------------------------- weight averaging
class Snapshots(pl.Callback):
    """The module's parameters after every optimizer step (``steps``) and at every epoch's start (``epochs``): a
    record of past states (lists and dicts of state dicts), which the V-cycle does not take for a copy it keeps using
    (``parameter_copy_holders`` looks one container deep)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.epochs: dict[int, dict[str, torch.Tensor]] = {}
        self._last = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step > self._last:
            self._last = trainer.global_step
            self.steps.append(params(pl_module))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.epochs[trainer.current_epoch] = params(pl_module)


def ema(snapshots: list[dict[str, torch.Tensor]], decay: float, start: dict[str, torch.Tensor] | None = None) -> Any:
    """The exponential moving average of ``snapshots`` (from ``start``, else from the first snapshot)."""
    avg = dict(start if start is not None else snapshots[0])
    for snap in snapshots if start is not None else snapshots[1:]:
        avg = {k: decay * avg[k] + (1 - decay) * snap[k] for k in avg}
    return avg


def assert_params(module: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = params(module)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_weight_averaging(tmp_path: Path, technique: str) -> None:
    """Lightning's WeightAveraging (an EMA updated after every optimizer step, put in the module at the end) and
    StochasticWeightAveraging (the mean of the weights at the start of every epoch from ``swa_epoch_start``)."""

    def averaging() -> list[pl.Callback]:
        return [
            WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.9)),
            StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2),
        ]

    if expect("weight_averaging", technique) == REFUSED:
        for callback in averaging():
            run = build(technique)
            assert_refused(run, run.trainer(tmp_path / type(callback).__name__, [callback]), "WeightAveraging")
        return
    ema_cb, swa_cb = averaging()
    run, snaps = build(technique), Snapshots()
    run.fit(tmp_path / "ema", [ema_cb, snaps])
    assert_effect(run)
    assert len(snaps.steps) >= STEPS
    assert_params(run.model, ema(snaps.steps, 0.9))
    run, snaps = build(technique), Snapshots()
    run.fit(tmp_path / "swa", [swa_cb, snaps])
    assert_effect(run)
    averaged = [snaps.epochs[e] for e in sorted(snaps.epochs) if e >= 1]  # swa_epoch_start=2: from epoch index 1
    assert len(averaged) == (2 if technique == "infobatch" else 1)
    assert_params(run.model, {k: sum(s[k] for s in averaged) / len(averaged) for k in averaged[0]})


class BlogEMA(pl.Callback):
    """A third-party EMA as users copy it from a blog: a shadow copy of the parameters made in ``on_fit_start``
    (``lazy``: at the first batch's end), updated after every training batch, swapped in for validation."""

    def __init__(self, decay: float = 0.9, lazy: bool = False) -> None:
        self.decay, self.lazy = decay, lazy
        self.shadow: dict[str, torch.Tensor] = {}
        self.backup: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if not self.lazy:
            self.shadow = params(pl_module)

    @torch.no_grad()
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if not self.shadow:
            self.shadow = params(pl_module)
            return
        for k, p in pl_module.named_parameters():
            self.shadow[k].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    @torch.no_grad()
    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.backup = params(pl_module)
        for k, p in pl_module.named_parameters():
            p.copy_(self.shadow[k])

    @torch.no_grad()
    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        for k, p in pl_module.named_parameters():
            p.copy_(self.backup[k])


class FollowingEMA(BlogEMA):
    """A third-party EMA that follows model changes (``FollowsModelChanges``): it starts its shadow afresh from the
    new model after every level change."""

    def effi_before_model_change(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.shadow = {}

    def effi_after_model_change(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.shadow = params(pl_module)


class ValidationWeights(pl.Callback):
    """The module's parameters when validation starts (after the EMA's swap: later in the callback order)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.seen.append(params(pl_module))


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_third_party_ema(tmp_path: Path, technique: str) -> None:
    """The shadow is the EMA of the weights after each step and validation runs on it; with the V-cycle (whose level
    changes would leave the shadow with the old shapes: the issue's crash at the first switch) a callback holding a
    copy of the parameters is refused at train start."""
    ema_cb, run = BlogEMA(), build(technique)
    if expect("third_party_ema", technique) == REFUSED:
        assert_refused(run, run.trainer(tmp_path, [ema_cb]), "own copy of the model's parameters")
        return
    initial, snaps, at_validation = params(run.model), Snapshots(), ValidationWeights()
    run.fit(tmp_path, [ema_cb, snaps, at_validation], **validation(technique, every=STEPS))
    assert_effect(run)
    expected = ema(snaps.steps, 0.9, start=initial)
    for k, v in expected.items():
        torch.testing.assert_close(ema_cb.shadow[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert at_validation.seen  # the last validation ran on the shadow, at the end of the run
    for k, v in at_validation.seen[-1].items():
        torch.testing.assert_close(v, expected[k], rtol=1e-5, atol=1e-6, msg=k)
    assert_params(run.model, snaps.steps[-1])  # and the trained weights came back after it


def test_a_lazy_ema_is_refused_before_the_vcycles_first_level_change(tmp_path: Path) -> None:
    """An EMA that makes its shadow at its first batch is not visible at train start: the V-cycle refuses it at the
    first level change (step 2), naming it, before the change; the module is put back at full size."""
    run = build("vcycle")
    with pytest.raises(IncompatibleTechniques, match=r"VCycleCallback cannot run with BlogEMA: at step 2"):
        run.fit(tmp_path, [BlogEMA(lazy=True)])
    assert len(run.probe.batches) == 1 and len(run.model.model.transformer.h) == LAYERS  # raised at step 2's end


def test_an_ema_that_follows_model_changes_runs_with_the_vcycle(tmp_path: Path) -> None:
    """A callback holding a copy of the parameters that follows model changes (it implements
    ``effi_before_model_change`` / ``effi_after_model_change``) is not refused: after the cycle its shadow has the
    full model's shapes and is the EMA of the steps since the last level change."""
    ema_cb, run, snaps = FollowingEMA(), build("vcycle"), Snapshots()
    run.fit(tmp_path, [ema_cb, snaps])
    assert callback_of(run, VCycleCallback).switches == 2
    last_switch = 6  # level 2 -> 1 at step 6: the shadow restarts from the weights then
    expected = ema(snaps.steps[last_switch:], 0.9, start=snaps.steps[last_switch - 1])
    for k, v in expected.items():
        torch.testing.assert_close(ema_cb.shadow[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_parameter_copy_detector() -> None:
    """Which callbacks count as holding their own copy of the parameters."""
    module = seeded(lambda: GPT2CausalLM(**{**TINY, "n_layer": 2}))()
    shadow, lazy, following = BlogEMA(), BlogEMA(lazy=True), FollowingEMA()
    shadow.on_fit_start(None, module)  # type: ignore[arg-type]
    following.on_fit_start(None, module)  # type: ignore[arg-type]
    holder = SimpleNamespace(model=module, copy=copy.deepcopy(module.model), one=torch.zeros(32))
    reference = SimpleNamespace(model=module, inner=module.model, views=[p[:1] for p in module.parameters()])
    partial = SimpleNamespace(few={k: v for k, v in list(params(module).items())[:3]})
    vcycle = VCycleCallback(e_a=1, e_small=1)
    vcycle.__dict__["copies"] = params(module)  # a technique's own copies (snapshots) do not count
    callbacks = [shadow, lazy, following, holder, reference, partial, vcycle]
    trainer = SimpleNamespace(callbacks=callbacks)
    assert parameter_copy_holders(trainer, module) == [shadow, holder]
    assert parameter_copy_holders(trainer, module, [lazy, reference]) == []
    assert FEATURES["third_party_ema"].when == "train_start"
    assert detect_features(SimpleNamespace(callbacks=[shadow], lr_scheduler_configs=[]), module) == ["third_party_ema"]


# ------------------------------------------------------------------------------------ fine-tuning and pruning
class UnfreezeBlocks(BaseFinetuning):
    """A fine-tuning callback as users write it (``BackboneFinetuning`` does the same for a ``backbone``): the
    transformer blocks frozen before training, unfrozen into the optimizer at epoch 1."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.model.transformer.h)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.transformer.h, optimizer)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_finetuning(tmp_path: Path, technique: str) -> None:
    """Through epoch 0 the blocks keep their initial weights while the embeddings train; from epoch 1 the blocks
    train too. The V-cycle refuses the callback at setup: its level changes rebuild the
    optimizer and keep each parameter's requires_grad, so the unfrozen blocks would not train."""
    run = build(technique)
    if expect("finetuning", technique) == REFUSED:
        assert_refused(run, run.trainer(tmp_path, [UnfreezeBlocks()]), "BaseFinetuning")
        return
    initial, snaps = params(run.model), Snapshots()
    run.fit(tmp_path, [UnfreezeBlocks(), snaps])
    assert_effect(run)
    epochs = [b["epoch"] for b in run.probe.batches]
    first_epoch = epochs.count(0)
    blocks = [k for k in initial if ".transformer.h." in k]
    assert blocks and len(snaps.steps) == len(epochs)
    for step in snaps.steps[:first_epoch]:
        assert all(torch.equal(step[k], initial[k]) for k in blocks)
    assert not torch.equal(snaps.steps[0]["model.transformer.wte.weight"], initial["model.transformer.wte.weight"])
    assert first_epoch < len(epochs)  # every column reaches epoch 1: the blocks trained from there
    assert any(not torch.equal(snaps.steps[-1][k], initial[k]) for k in blocks)
    assert all(p.requires_grad for p in run.model.model.transformer.h.parameters())


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_model_pruning(tmp_path: Path, technique: str) -> None:
    """Lightning's ModelPruning (global l1_unstructured over the blocks' MLP input weights, amount 0.5 at every
    epoch end, made permanent at the end): at least half of those weights end exactly zero, the rest trained. The
    V-cycle refuses it at setup (its coalescing does not map weight_orig / weight_mask)."""
    run = build(technique)

    def pruning() -> ModelPruning:
        targets = [(block.mlp.c_fc, "weight") for block in run.model.model.transformer.h]
        return ModelPruning(
            "l1_unstructured", parameters_to_prune=targets, amount=0.5, use_lottery_ticket_hypothesis=False
        )

    if expect("model_pruning", technique) == REFUSED:
        assert_refused(run, run.trainer(tmp_path, [pruning()]), "ModelPruning")
        return
    initial = params(run.model)
    run.fit(tmp_path, [pruning()])
    assert_effect(run)
    weights = [block.mlp.c_fc.weight for block in run.model.model.transformer.h]
    zeros = sum(int((w == 0).sum()) for w in weights)
    total = sum(w.numel() for w in weights)
    assert zeros >= total // 2 and zeros < total
    assert not any(n.endswith("_orig") for n, _ in run.model.named_parameters())  # made permanent
    trained = [w[w != 0] for w in weights]
    before = [initial[f"model.transformer.h.{i}.mlp.c_fc.weight"][w != 0] for i, w in enumerate(weights)]
    assert any(not torch.equal(a, b) for a, b in zip(trained, before))
