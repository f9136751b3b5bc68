"""What each technique needs and what it changes, declared as data, and the one ``setup``-time check over them.

Every technique callback carries a class attribute ``requirements`` (a :class:`Requirements`). Its ``setup`` calls
:func:`check_trainer`, which reads the declarations of every technique callback in the Trainer and raises a
:class:`IncompatibleTechniques` error naming both callbacks, the conflict and what to change. The model is
Composer's capability flags on ``Algorithm`` (``composer/core/algorithm.py``); the rules are :data:`CONFLICTS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException

__all__ = [
    "CONFLICTS",
    "BATCH_STRUCTURES",
    "Conflict",
    "IncompatibleTechniques",
    "Requirements",
    "check_started",
    "check_trainer",
    "technique_callbacks",
]

#: batch structures a technique may declare it accepts
BATCH_STRUCTURES = ("dict", "tuple", "list", "tensor", "dataclass")


class IncompatibleTechniques(MisconfigurationException):
    """Two technique callbacks, or a technique and the Trainer, cannot run together (raised in ``setup``)."""


@dataclass(frozen=True)
class Requirements:
    """A technique's needs and effects. :func:`check_trainer` rules on ``owns_train_sampler``,
    ``changes_model_shapes``, ``patches_layers`` (through :data:`CONFLICTS`), ``strategies`` /
    ``refused_strategies`` and ``incompatible_callbacks``; the other fields are declarations for the method cards,
    ``metadata.json`` and the rules still to come (the batch is known only at the first batch).

    Attributes:
        owns_train_sampler: the technique rebuilds the training loader and decides which samples each step trains on.
        thins_within_sampler: the technique can also act *inside* another technique's sampler: it keeps a subset of
            the samples the other one draws and reweights them (InfoBatch inside the curriculum's stream).
        hosts_thinning: the technique's sampler takes a thinner (a ``thins_within_sampler`` technique) inside it (the
            curriculum's batch sampler).
        changes_epoch_length: an epoch has fewer (or more) optimizer steps than ``len(train_dataloader)`` says.
        changes_model_shapes: parameters change shape during ``fit`` (the optimizer and any wrapper are rebuilt).
        patches_layers: the model's layers are patched in place (instance-level ``forward``).
        follows_model_changes: a layer patcher that re-binds to the new model after every shape change (it
            implements ``effi_before_model_change`` / ``effi_after_model_change``).
        needs_per_sample_loss: ``training_step`` must return ``per_sample_loss`` next to ``loss``.
        edits_batch: the batch is edited before ``training_step`` (e.g. truncated).
        batch_structures: batch structures the technique accepts (a subset of :data:`BATCH_STRUCTURES`).
        strategies: names of the strategy classes supported, subclasses included (``None``: any strategy);
            ``DDPStrategy`` covers ``"ddp"``, ``"ddp_spawn"`` and ``"ddp_find_unused_parameters_true"``.
        refused_strategies: names of strategy classes refused even though they subclass a supported one (e.g.
            ``DeepSpeedStrategy``, a ``DDPStrategy`` subclass).
        strategy_note: what to do instead, appended to the refusal of another strategy.
        incompatible_callbacks: names of (non-technique) callback classes the technique cannot run with, and why.
        refused_features: Lightning features the technique cannot run with: pairs of a feature name of
            :data:`lightning_effi.core.features.FEATURES` and why, with what to do instead (checked by
            :func:`lightning_effi.core.features.check_features` in ``setup`` and ``on_train_start``).
    """

    owns_train_sampler: bool = False
    thins_within_sampler: bool = False
    hosts_thinning: bool = False
    changes_epoch_length: bool = False
    changes_model_shapes: bool = False
    patches_layers: bool = False
    follows_model_changes: bool = False
    needs_per_sample_loss: bool = False
    edits_batch: bool = False
    batch_structures: tuple[str, ...] = ("dict",)
    strategies: tuple[str, ...] | None = None
    refused_strategies: tuple[str, ...] = ()
    strategy_note: str = ""
    incompatible_callbacks: tuple[tuple[str, str], ...] = ()
    refused_features: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(f.default, bool) and not isinstance(value, bool):
                raise TypeError(f"Requirements.{f.name} must be a bool, got {value!r}")
        unknown = set(self.batch_structures) - set(BATCH_STRUCTURES)
        if unknown:
            raise ValueError(f"Requirements.batch_structures: unknown {sorted(unknown)}; allowed {BATCH_STRUCTURES}")
        from lightning_effi.core.features import FEATURES

        unknown = {name for name, _ in self.refused_features} - set(FEATURES)
        if unknown:
            raise ValueError(f"Requirements.refused_features: unknown {sorted(unknown)}; allowed {sorted(FEATURES)}")

    def as_dict(self) -> dict[str, Any]:
        """The declaration as plain values (for ``metadata.json`` and the method cards)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Conflict:
    """A rule: two declarations that cannot be combined. ``applies(a, b)`` is checked for both orders."""

    name: str
    applies: Callable[[Requirements, Requirements], bool]
    why: str
    fix: str


#: The combinations refused. Every pair of the four shipped techniques composes; what stays refused is a technique
#: twice (two samplers of the same kind, two shape changes, two layer patchers) and a layer patcher that cannot follow
#: a shape change.
CONFLICTS: tuple[Conflict, ...] = (
    Conflict(
        "two training samplers",
        lambda a, b: (
            a.owns_train_sampler
            and b.owns_train_sampler
            and not (a.thins_within_sampler and b.hosts_thinning)
            and not (b.thins_within_sampler and a.hosts_thinning)
        ),
        "both decide which samples each step trains on, and neither can act inside the other's sampler",
        "use one of them",
    ),
    Conflict(
        "two shape changes",
        lambda a, b: a.changes_model_shapes and b.changes_model_shapes,
        "each replaces the model at its own steps, so one works on the other's coarse model",
        "keep one of them",
    ),
    Conflict(
        "two layer patchers",
        lambda a, b: a.patches_layers and b.patches_layers,
        "both patch the same layers in place",
        "keep one of them",
    ),
    Conflict(
        "layer patching across shape changes",
        lambda a, b: a.changes_model_shapes and b.patches_layers and not b.follows_model_changes,
        "the patched layers belong to one model, which the shape change replaces, and the patcher does not re-bind",
        "remove one of them",
    ),
)


def _technique(callback: Any) -> bool:
    return isinstance(getattr(type(callback), "requirements", None), Requirements)


def technique_callbacks(callbacks: Iterable[Any]) -> list[Any]:
    """The callbacks that declare :class:`Requirements`, in the Trainer's order."""
    return [c for c in callbacks if _technique(c)]


def _name(callback: Any) -> str:
    return type(callback).__name__


def check_trainer(trainer: Any, callbacks: Sequence[Any] | None = None) -> None:
    """Rule on the technique callbacks of ``trainer`` (or ``callbacks``) and the Trainer they run in (called in each
    technique's ``setup``; the features visible only later are checked in ``on_train_start`` by
    :func:`check_started`).

    Raises:
        IncompatibleTechniques: a technique's strategy is not supported, a technique runs with a callback it declares
            incompatible, two techniques conflict (a rule of :data:`CONFLICTS`), or the run uses a Lightning feature a
            technique refuses (``Requirements.refused_features``); the message names both sides, the conflict and
            what to change.
    """
    all_callbacks = list(trainer.callbacks if callbacks is None else callbacks)
    techniques = technique_callbacks(all_callbacks)
    strategy_cls = type(getattr(trainer, "strategy", None))
    strategy = strategy_cls.__name__
    lineage = {k.__name__ for k in strategy_cls.__mro__}
    for t in techniques:
        req: Requirements = type(t).requirements
        supported = req.strategies is None or bool(lineage & set(req.strategies))
        if not supported or lineage & set(req.refused_strategies):
            note = f" {req.strategy_note}" if req.strategy_note else ""
            if req.strategies is None:
                raise IncompatibleTechniques(f"{_name(t)} does not support the {strategy} strategy.{note}")
            raise IncompatibleTechniques(
                f"{_name(t)} supports the strategies {list(req.strategies)}, not {strategy}.{note}"
            )
        for other in all_callbacks:
            for cls_name, why in req.incompatible_callbacks:
                if any(k.__name__ == cls_name for k in type(other).__mro__):
                    kind = "" if _name(other) == cls_name else f" (subclass of {cls_name})"
                    raise IncompatibleTechniques(
                        f"{_name(t)} cannot run with {_name(other)}{kind}: {why}; remove {_name(other)}"
                    )
    for i, a in enumerate(techniques):
        for b in techniques[i + 1 :]:
            ra, rb = type(a).requirements, type(b).requirements
            for rule in CONFLICTS:
                if rule.applies(ra, rb) or rule.applies(rb, ra):
                    raise IncompatibleTechniques(
                        f"{_name(a)} and {_name(b)} cannot be combined ({rule.name}): {rule.why}; {rule.fix}"
                    )
    from lightning_effi.core.features import check_features

    check_features(trainer, "setup", techniques)


def check_started(trainer: Any, callbacks: Sequence[Any] | None = None) -> None:
    """The second half of :func:`check_trainer`, called in each technique's ``on_train_start``: the Lightning
    features visible only once the optimizers, LR schedulers and the other callbacks' own state exist.

    Raises:
        IncompatibleTechniques: the run uses a feature a technique refuses (``Requirements.refused_features``).
    """
    from lightning_effi.core.features import check_features

    check_features(trainer, "train_start", trainer.callbacks if callbacks is None else callbacks)
