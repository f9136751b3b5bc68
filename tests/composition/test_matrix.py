"""The composition matrix: every non-empty subset of {InfoBatch, curriculum, random-LTD, V-cycle} on a tiny GPT-2, and
every subset that applies to images (no curriculum) on a tiny ViT, through the same checks: it trains to its planned
length, the run ends on the full model with no layer left patched, a resume from a mid-run checkpoint equals the
uninterrupted run, and the EfficiencyMonitor's FLOPs equal those ``torch.utils.flop_counter`` measures (within 3%).
The DataModule is wrapped as the Hydra app wraps it (each technique's ``wrap_datamodule``, in callback order).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback

from lightning_effi import (
    Curriculum,
    EfficiencyMonitor,
    InfoBatchCallback,
    RandomLTDCallback,
    VCycleCallback,
)
from lightning_effi.tasks import ImageClassifier
from tests.harness.settings import MONITOR_TIMES, seeded
from tests.helpers.flops import MeasuredFlops
from tests.helpers.harness import assert_resume_equals_uninterrupted, make_trainer
from tests.helpers.tiny import TINY_VIT, Images, TinyDataModule, TokenBlocks, sgd, tiny_gpt2

TECHNIQUES = ("infobatch", "curriculum", "random_ltd", "vcycle")
IMAGE_TECHNIQUES = ("infobatch", "random_ltd", "vcycle")
CLASSES = {
    "infobatch": InfoBatchCallback,
    "curriculum": Curriculum,
    "random_ltd": RandomLTDCallback,
    "vcycle": VCycleCallback,
}

#: 24 samples, batch 4: 6 batches per full epoch
N, BATCH = 24, 4
#: step-bounded runs (no InfoBatch, or InfoBatch inside the curriculum's stream)
STEPS, RESUME_STEP = 10, 4
#: InfoBatch alone plans by epochs: full, pruned, full (delta = 0.67 of 3 epochs)
EPOCHS, EPOCH_RESUME_STEP = 3, 8


def subsets(names: Sequence[str]) -> list[tuple[str, ...]]:
    return [s for k in range(1, len(names) + 1) for s in itertools.combinations(names, k)]


def build_callback(name: str, image: bool) -> Callback:
    if name == "infobatch":
        return InfoBatchCallback(prune_ratio=0.5, delta=0.67, seed=7)
    if name == "curriculum":
        return Curriculum(
            metrics={
                "seqlen_truncate": dict(
                    difficulty_type="value",
                    clustering_type="single_cluster",
                    min_difficulty=8,
                    max_difficulty=16,
                    schedule_type="fixed_linear",
                    schedule_config=dict(total_curriculum_step=6, difficulty_step=4),
                )
            },
            seed=3,
            num_epochs=2,
        )
    if name == "random_ltd":
        if image:  # 16 patches + the class token
            return RandomLTDCallback(min_value=5, max_value=17, seq_per_step=4, keep_prefix_tokens="auto", seed=7)
        return RandomLTDCallback(min_value=4, max_value=16, seq_per_step=4, seed=7)
    # fractions of the run: on InfoBatch's progress clock when it shortens epochs, so the cycle always completes
    return VCycleCallback(e_a="0.2dur", e_small="0.4dur", alpha_original=0.3, lr_multiplier={2: 2.0})


@dataclass(frozen=True)
class Stack:
    names: tuple[str, ...]
    image: bool

    @property
    def id(self) -> str:
        return ("vit:" if self.image else "gpt2:") + "+".join(self.names)

    @property
    def epoch_bounded(self) -> bool:
        return "infobatch" in self.names and "curriculum" not in self.names

    def callbacks(self) -> list[Callback]:
        return [build_callback(n, self.image) for n in self.names]

    def model(self) -> pl.LightningModule:
        if self.image:  # 4 blocks: the coarse V-cycle level keeps 2, random-LTD drops in the middle ones
            return seeded(
                ImageClassifier, model_name="vit_tiny_patch16_224", model_kwargs={**TINY_VIT, "depth": 4}, optimizer=sgd
            )()
        return seeded(tiny_gpt2, n_layer=4)()

    def datamodule(self, callbacks: Sequence[Callback]) -> pl.LightningDataModule:
        dm: pl.LightningDataModule = TinyDataModule(Images(n=N) if self.image else TokenBlocks(n=N), batch_size=BATCH)
        for cb in callbacks:  # as lightning_effi.train.build wraps it
            wrap = getattr(cb, "wrap_datamodule", None)
            if callable(wrap):
                dm = wrap(dm)
        return dm

    def limits(self) -> dict[str, Any]:
        limits: dict[str, Any] = (
            dict(max_epochs=EPOCHS, max_steps=-1) if self.epoch_bounded else dict(max_steps=STEPS, max_epochs=-1)
        )
        if "curriculum" in self.names:
            limits["use_distributed_sampler"] = False
        return limits


STACKS = [Stack(s, False) for s in subsets(TECHNIQUES)] + [Stack(s, True) for s in subsets(IMAGE_TECHNIQUES)]


class Probe(Callback):
    """Records, after the fit, the V-cycle's level and whether any module still has an instance-level ``forward``."""

    def __init__(self) -> None:
        self.final_level: int | None = None
        self.patched_after_fit: list[str] = []

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for cb in trainer.callbacks:
            if isinstance(cb, VCycleCallback):
                self.final_level = cb.level


def patched_modules(module: torch.nn.Module) -> list[str]:
    return [name for name, m in module.named_modules() if "forward" in m.__dict__]


def fit(stack: Stack, root: Path, extra: Sequence[Callback] = ()) -> tuple[pl.Trainer, pl.LightningModule, Probe]:
    pl.seed_everything(0, workers=True)
    callbacks = stack.callbacks()
    probe = Probe()
    model = stack.model()
    trainer = make_trainer(root, [*callbacks, *extra, probe], **stack.limits())
    trainer.fit(model, datamodule=stack.datamodule(callbacks))
    return trainer, model, probe


@pytest.mark.parametrize("stack", STACKS, ids=lambda s: s.id)
def test_stack_trains_and_ends_on_the_full_model(tmp_path, stack):
    full = stack.model()
    trainer, model, probe = fit(stack, tmp_path)
    if not stack.epoch_bounded:
        assert trainer.global_step == STEPS
    else:
        assert trainer.current_epoch == EPOCHS and trainer.global_step > 0
    if "vcycle" in stack.names:
        assert probe.final_level == 1
    assert [(k, v.shape) for k, v in model.state_dict().items()] == [(k, v.shape) for k, v in full.state_dict().items()]
    assert patched_modules(model) == []  # random-LTD restored the layers it patched
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("stack", STACKS, ids=lambda s: s.id)
def test_stack_resumes_exactly(tmp_path, stack):
    """A fresh run resumed from the checkpoint of a mid-run step (inside the V-cycle's coarse stage, inside a pruned
    epoch) ends with the same weights, optimizer state, learning rates and callback states as the uninterrupted run."""
    made: list[list[Callback]] = []

    def callbacks_fn() -> list[Callback]:
        made.append(stack.callbacks())
        return made[-1]

    kwargs = {k: v for k, v in stack.limits().items() if k not in ("max_steps", "max_epochs")}
    if stack.epoch_bounded:
        total, resume, epochs = _epoch_run_steps(stack, tmp_path / "probe"), EPOCH_RESUME_STEP, EPOCHS
    else:
        total, resume, epochs = STEPS, RESUME_STEP, None
    assert_resume_equals_uninterrupted(
        stack.model,
        lambda: stack.datamodule(made[-1]),
        tmp_path,
        total_steps=total,
        resume_step=resume,
        callbacks_fn=callbacks_fn,
        ignore_state=(*MONITOR_TIMES, "map_seconds"),
        max_epochs=epochs,
        **kwargs,
    )


_RUN_STEPS: dict[str, int] = {}


def _epoch_run_steps(stack: Stack, root: Path) -> int:
    """The optimizer steps of an epoch-bounded run (InfoBatch's epochs shorten with the scores)."""
    if stack.id not in _RUN_STEPS:
        trainer, _, _ = fit(stack, root)
        _RUN_STEPS[stack.id] = trainer.global_step
    return _RUN_STEPS[stack.id]


def test_the_matrix_covers_every_subset():
    assert len([s for s in STACKS if not s.image]) == 15
    assert len([s for s in STACKS if s.image]) == 7


@pytest.mark.parametrize("stack", STACKS, ids=lambda s: s.id)
def test_stack_compute_figure_matches_the_flop_counter(tmp_path, stack):
    """The EfficiencyMonitor's training FLOPs (the module's analytic figure on what was trained, lowered by random-LTD,
    the coarse model's during the V-cycle's small stage) equal what ``torch.utils.flop_counter`` measures on the
    stacked model, within 3%, and the summary lists each technique's own saving."""
    measured = MeasuredFlops()  # first: its window holds the forward and backward of each batch only
    monitor = EfficiencyMonitor(print_summary=False)
    pl.seed_everything(0, workers=True)
    callbacks = stack.callbacks()
    model = stack.model()
    trainer = make_trainer(tmp_path, [measured, monitor, *callbacks], **stack.limits())
    trainer.fit(model, datamodule=stack.datamodule(callbacks))
    counted = monitor.summary["flops"]
    assert measured.total > 0
    assert abs(counted - measured.total) / measured.total < 0.03, (counted, measured.total)
    assert monitor.summary["samples"] > 0 and monitor.summary["batches"] == len(measured.per_batch)
