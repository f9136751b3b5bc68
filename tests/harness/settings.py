"""Per-callback settings for the cross-technique harness (model: Composer's ``tests/algorithms/algorithm_settings.py``).

Every public :class:`~lightning.pytorch.Callback` exported by ``lightning_effi`` has one :class:`CallbackSettings`
entry in :data:`SETTINGS`: how to build it with tiny arguments, a tiny seeded LightningModule, its DataModule (already
wrapped where the technique needs it), the run's length and where to take a resume checkpoint. The tests in
``tests/harness/test_callbacks.py`` run the same checks over every entry; ``test_registry.py`` fails when a public
callback has no entry here. The tiny argument choices come from each technique's own tests.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback

import lightning_effi
import lightning_effi.callbacks
from lightning_effi import (
    Curriculum,
    CurriculumDataModule,
    EfficiencyMonitor,
    InfoBatchCallback,
    InfoBatchDataModule,
    RandomLTDCallback,
    VCycleCallback,
)
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TinyDataModule, TokenBlocks, tiny_gpt2, tiny_lm_data

#: wall-time counters: they differ between any two runs, so the state comparisons leave them out
MONITOR_TIMES = (
    "totals.time_train",
    "totals.time_data",
    "totals.time_eval",
    "totals.time_monitor",
    "totals.time_total",
    # the training wall time of the records' points
    "curve.*.train_wall_s",
    "schedule.*.train_wall_s",
    "last_position.train_wall_s",
)


@dataclass(frozen=True)
class CallbackSettings:
    """How the harness exercises one public callback class.

    Attributes:
        callback: builds the callback (tiny, fast arguments; a fresh instance per call).
        model: builds a tiny LightningModule; its initialisation is seeded (the global RNG is left alone).
        datamodule: builds the DataModule, wrapped where the technique needs it.
        steps: optimizer steps of a run (``trainer.global_step`` at its end). A run is bounded by ``max_steps=steps``
            unless ``max_epochs`` is set; then it is bounded by epochs and ``steps`` is what those epochs take.
        resume_step: the step whose checkpoint the resume test restarts from (0 < resume_step < steps).
        max_epochs: bound the run by epochs instead of steps (techniques that plan by epochs: InfoBatch).
        trainer_kwargs: any further ``Trainer`` arguments (also used under DDP).
        ignore_state: dotted ``state_dict`` keys left out of state comparisons between runs or ranks (wall times).
        stateful: whether the callback keeps training state (its ``state_dict`` is compared across DDP ranks).
        changed: constructor settings that change the run, set on the callback's attributes between two fits (a
            notebook's habit); the second fit must train as a callback built with them (``callback(**changed)``).
    """

    callback: Callable[..., Callback]
    model: Callable[[], pl.LightningModule]
    datamodule: Callable[[], pl.LightningDataModule]
    steps: int
    resume_step: int
    max_epochs: int | None = None
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    ignore_state: tuple[str, ...] = ()
    stateful: bool = True
    changed: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert 0 < self.resume_step < self.steps, "resume_step must fall inside the run"

    def limits(self) -> dict[str, Any]:
        """The run's bound: ``max_steps`` or ``max_epochs`` (``max_steps=-1``)."""
        if self.max_epochs is None:
            return dict(max_steps=self.steps, max_epochs=-1)
        return dict(max_epochs=self.max_epochs, max_steps=-1)

    def trainer(self, root: Path, callbacks: list[Callback], **kwargs: Any) -> pl.Trainer:
        """A quiet CPU trainer (:func:`tests.helpers.harness.make_trainer`) for this entry's run."""
        return make_trainer(root, callbacks, **{**self.limits(), **self.trainer_kwargs, **kwargs})

    def fit(
        self, root: Path, callback: Callback | None = None, seed: int = 0, extra: list[Callback] | None = None
    ) -> tuple[pl.Trainer, pl.LightningModule]:
        """Seed, then fit a fresh module and DataModule with ``callback`` (default: a fresh one) for the whole run."""
        pl.seed_everything(seed, workers=True)
        model = self.model()
        trainer = self.trainer(root, [callback if callback is not None else self.callback(), *(extra or [])])
        trainer.fit(model, datamodule=self.datamodule())
        return trainer, model


def seeded(build: Callable[..., pl.LightningModule], seed: int = 0, **kw: Any) -> Callable[[], pl.LightningModule]:
    """``build(**kw)`` with its initialisation drawn from ``seed`` (the caller's global RNG state is untouched)."""

    def make() -> pl.LightningModule:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build(**kw)

    return make


# ---------------------------------------------------------------------------------------------------- per technique
# Curriculum (tests/curriculum/test_callback.py): a percentile metric computed in memory at setup (schedule_based:
# reshuffled clusters; a built-in analyzer metric given by name, so the callback's repr stays eval-able and
# ddp_spawn needs no registration) and seqlen truncation, both changing over the first steps.
CURRICULUM_METRICS = {
    "rarity": dict(
        difficulty_type="percentile",
        clustering_type="schedule_based",
        analysis={"name": "vocab_rarity", "vocab_size": 64},
        min_difficulty=20,
        max_difficulty=100,
        schedule_type="fixed_linear",
        schedule_config=dict(total_curriculum_step=6, difficulty_step=20),
    ),
    "seqlen_truncate": dict(
        difficulty_type="value",
        clustering_type="single_cluster",
        min_difficulty=4,
        max_difficulty=16,
        schedule_type="fixed_linear",
        schedule_config=dict(total_curriculum_step=6, difficulty_step=2),
    ),
}

# V-cycle stage lengths (durations; optimizer steps here)
VCYCLE_STAGES = dict(e_a=1, e_small=2)

SETTINGS: dict[type[Callback], CallbackSettings] = {
    EfficiencyMonitor: CallbackSettings(
        callback=lambda: EfficiencyMonitor(log_every_n_steps=2, print_summary=False),
        model=seeded(tiny_gpt2),
        datamodule=lambda: tiny_lm_data(batch_size=4),
        steps=4,
        resume_step=2,
        ignore_state=MONITOR_TIMES,
    ),
    # tests/infobatch/test_callback.py: 16 samples, batch 4 -> 4 batches in full epochs; E = 3, delta = 2/3: epochs
    # full, prune, full (annealing from epoch 2). The step count is what the seeded run takes (4 + 3 + 4).
    InfoBatchCallback: CallbackSettings(
        callback=lambda **kw: InfoBatchCallback(**{**dict(prune_ratio=0.5, delta=0.67, seed=7, momentum=0.5), **kw}),
        model=seeded(tiny_gpt2),
        datamodule=lambda: InfoBatchDataModule(TinyDataModule(TokenBlocks(n=16), batch_size=4)),
        steps=11,
        resume_step=6,
        max_epochs=3,
        changed=dict(prune_ratio=0.25, seed=3),
    ),
    # 40 samples, batch 4: 10 micro-batches per data epoch; resume while both difficulties still grow
    Curriculum: CallbackSettings(
        callback=lambda **kw: Curriculum(
            **{**dict(metrics=CURRICULUM_METRICS, percentile_rounding="proportional", seed=3, total_tokens=1000), **kw}
        ),
        model=seeded(tiny_gpt2),
        datamodule=lambda: CurriculumDataModule(tiny_lm_data(batch_size=4)),
        steps=6,
        resume_step=3,
        trainer_kwargs=dict(use_distributed_sampler=False),
        changed=dict(seed=5),  # kept in the callback's config: an attribute set was ignored
    ),
    # tests/random_ltd/test_callback.py: 4 layers (2 LTD layers), r = 4, 8, 12, 16 over the run
    RandomLTDCallback: CallbackSettings(
        callback=lambda **kw: RandomLTDCallback(
            **{
                **dict(min_value=4, max_value=16, require_steps=4, seq_per_step=4, seed=7, accounting="deepspeed"),
                **kw,
            }
        ),
        model=seeded(tiny_gpt2, n_layer=4),
        datamodule=lambda: tiny_lm_data(batch_size=4),
        steps=5,
        resume_step=3,
        changed=dict(require_steps=2, max_value=12),  # resolved attributes of these names: a set was overwritten
    ),
    # tests/vcycle/test_callback.py: level 1 for step 1, level 2 for steps 2-3, level 1 again from step 4: the run
    # crosses both switches; the resume checkpoint (step 2) is inside the small stage (a snapshot is pending)
    VCycleCallback: CallbackSettings(
        callback=lambda **kw: VCycleCallback(
            **{**VCYCLE_STAGES, "alpha_original": 0.3, "lr_multiplier": {2: 4.0}, **kw}
        ),
        model=seeded(tiny_gpt2),
        datamodule=lambda: tiny_lm_data(batch_size=4),
        steps=5,
        resume_step=2,
        ignore_state=("map_seconds",),
        changed=dict(e_small=1, alpha_original=0.9),  # a parsed duration (repr crashed) and a value set at setup
    ),
}


def public_callbacks() -> list[type[Callback]]:
    """Every public Callback subclass exported by ``lightning_effi`` and ``lightning_effi.callbacks`` (aliases such as
    ``InfoBatch = InfoBatchCallback`` counted once), sorted by name."""
    found: dict[type, None] = {}
    for module in (lightning_effi, lightning_effi.callbacks):
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if inspect.isclass(obj) and issubclass(obj, Callback):
                found[obj] = None
    return sorted(found, key=lambda cls: cls.__name__)


def public_namespace() -> dict[str, Any]:
    """The public names of ``lightning_effi`` and ``lightning_effi.callbacks`` (for ``eval(repr(cb), namespace)``)."""
    ns: dict[str, Any] = {}
    for module in (lightning_effi, lightning_effi.callbacks):
        ns.update({name: getattr(module, name) for name in getattr(module, "__all__", ()) if hasattr(module, name)})
    return ns
