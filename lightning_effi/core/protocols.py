"""The ``effi_*`` hooks a LightningModule or a callback may define, as :class:`typing.Protocol` classes.

All are optional and duck-typed: a module without them trains unchanged, and the accounting falls back as
``docs/architecture.md`` describes. ``isinstance`` works on them (``runtime_checkable``: it checks that the members
exist, not their signatures).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "AdjustsBatchStats",
    "CountsSamples",
    "CountsTokens",
    "FollowsModelChanges",
    "HasNumLayers",
    "PlansModelChanges",
    "ProvidesBaseline",
    "ProvidesProgress",
    "ProvidesProgressClock",
    "ReportsScheduleState",
    "ReportsSummary",
    "TrainingFlops",
]


@runtime_checkable
class TrainingFlops(Protocol):
    """Module hook: training FLOPs (forward + backward) of one batch, a float."""

    def effi_training_flops(self, batch: Any) -> float: ...


@runtime_checkable
class CountsSamples(Protocol):
    """Module hook: the samples of one batch (an int), where they are not its tensors' first dimension (a graph
    batch's graphs, a batch class of one's own)."""

    def effi_count_samples(self, batch: Any) -> int: ...


@runtime_checkable
class CountsTokens(Protocol):
    """Module hook: the tokens of one batch that the model processes (an int; padding excluded)."""

    def effi_count_tokens(self, batch: Any) -> int: ...


@runtime_checkable
class HasNumLayers(Protocol):
    """Module attribute: the number of transformer layers (layer-tokens = tokens x layers)."""

    effi_num_layers: int


@runtime_checkable
class AdjustsBatchStats(Protocol):
    """Callback hook: lower (or raise) one batch's counted quantities, e.g. random-LTD's layer-tokens and FLOPs; what
    it lowers is counted as the callback's saving (``saved/<name>/...``)."""

    def effi_adjust(self, stats: Any, batch: Any, pl_module: Any) -> Any: ...


@runtime_checkable
class ProvidesBaseline(Protocol):
    """Callback hook: what the technique changed in one training batch outside ``effi_adjust`` (the batch, the
    model, the samples drawn) as a :class:`~lightning_effi.core.accounting.Baseline`, or None. The EfficiencyMonitor
    counts the batch again with it (reverse callback order) for the baseline and the technique's saving."""

    def effi_baseline(self, batch: Any, pl_module: Any) -> Any: ...


@runtime_checkable
class ReportsSummary(Protocol):
    """Callback hook: the technique's figures for the final efficiency summary and ``result.json``. Optional beside
    it: ``effi_before_summary(trainer)``, called on every rank at the fit's end just before the summary is read (it
    may run a collective): figures still pending are settled there (InfoBatch with the curriculum merges the last
    epoch's, which a fit resumed from the run's last batch never reaches an epoch's end for)."""

    def effi_summary(self) -> Mapping[str, Any]: ...


@runtime_checkable
class ReportsScheduleState(Protocol):
    """Callback hook: the technique's schedule state now, ``{key: number}`` (e.g. ``{"reserved_length": 48}``);
    recorded by the EfficiencyMonitor in its ``schedule`` and shown in the progress bar. Empty before the technique
    has a state (before the first batch)."""

    def effi_schedule_state(self) -> Mapping[str, float]: ...


@runtime_checkable
class ProvidesProgress(Protocol):
    """Callback hook: training progress in [0, 1] for LR schedules, from a technique that changes the epoch length.

    ``effi_progress()`` is the progress *after the next* optimizer step (a step-interval LR scheduler reads it when it
    steps, i.e. it sets the learning rate of the coming step), 1.0 at the run's last step. The Curriculum's token
    progress (``Curriculum(total_tokens=...)``) provides only this; a technique whose epochs have another length
    than ``len(train_dataloader)`` says provides the whole :class:`ProvidesProgressClock`.
    """

    effi_progress: Callable[[], float]


@runtime_checkable
class ProvidesProgressClock(ProvidesProgress, Protocol):
    """Callback hooks: the run's clock, from a technique that changes the epoch length (InfoBatch), so that
    ``trainer.estimated_stepping_batches`` (full-length epochs) is not the run's length. Read by the V-cycle to place
    its stage switches (:func:`lightning_effi.core.progress.progress_clock`).

    - ``effi_progress() -> float``: as :class:`ProvidesProgress` (after the *next* optimizer step).
    - ``effi_progress_done() -> float``: the progress in [0, 1] after the optimizer steps taken so far: 0.0 before
      the first step, non-decreasing, exactly ``n / E`` once the first ``n`` of the run's ``E`` epochs are done and
      exactly 1.0 after the run's last step (whatever the epochs' lengths). Valid from ``on_train_start`` on and in
      every later hook; after a step it already counts that step in ``on_train_batch_end`` (it is advanced in
      ``on_before_optimizer_step``). A resumed run reads the same values as the uninterrupted one at the same step.
    - ``effi_progress_done_exact() -> Fraction`` (optional): ``effi_progress_done()`` as an exact fraction, read by
      :func:`~lightning_effi.core.progress.exact_progress_done` where present (a float-only clock is read as the
      nearest fraction of a small denominator).
    - ``effi_min_total_steps() -> int``: the fewest optimizer steps the run can have (>= 1), whatever the technique
      decides during the run, counted as Lightning counts them (``ceil(batches / accumulate_grad_batches)`` per epoch,
      ``limit_train_batches`` applied, per rank under DDP); called at ``on_train_start`` (the first training loader
      is built by then). A stage plan in optimizer steps that fits in it fits in every run.
    """

    def effi_progress_done(self) -> float: ...

    def effi_min_total_steps(self) -> int: ...


@runtime_checkable
class FollowsModelChanges(Protocol):
    """Callback hooks: a technique bound to the model's layers (random-LTD patches them) that follows a technique
    replacing the model during fit (the V-cycle). The technique that replaces ``pl_module``'s network calls them on
    every callback of ``trainer.callbacks`` that has them, in the Trainer's order, on every rank at the same step:

    - ``effi_before_model_change(trainer, pl_module)``: before the current network is replaced (it is still in place
      and unchanged): release what is bound to it (e.g. restore its patched layers) and finish the accounting of the
      current batch with the current network's sizes.
    - ``effi_after_model_change(trainer, pl_module)``: once the new network is in place, before the optimizer and the
      DDP wrapper are rebuilt: bind to the new network (e.g. patch its layers).

    Both also run when a checkpoint taken at another model is loaded (the V-cycle rebuilds the checkpoint's level
    before its weights load) and at the end of a fit that stopped at another model (the V-cycle restores the full one).
    """

    def effi_before_model_change(self, trainer: Any, pl_module: Any) -> None: ...

    def effi_after_model_change(self, trainer: Any, pl_module: Any) -> None: ...


@runtime_checkable
class PlansModelChanges(Protocol):
    """Callback hook of a technique that replaces the model during fit (the V-cycle): ``effi_model_depths(pl_module)``
    gives the number of layers of every model the fit will train, in the order they come (the V-cycle: levels 1..K),
    computed from ``pl_module``'s current network without changing anything, so that a :class:`FollowsModelChanges`
    technique can check its settings against every depth in its own ``setup`` (whichever ``setup`` runs first).

    Raises (from the implementation): ``ValueError`` when the network cannot be planned (it names the reason).
    """

    def effi_model_depths(self, pl_module: Any) -> Sequence[int]: ...
