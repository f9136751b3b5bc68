"""The Lightning features a technique may refuse, each with a detector, and the one check that applies the refusals.

A technique declares the features it cannot run with in its :class:`~lightning_effi.core.requirements.Requirements`
(``refused_features``: pairs of a feature name from :data:`FEATURES` and why, with what to do instead).
:func:`check_features` detects which features the Trainer and the module use and raises
:class:`~lightning_effi.core.requirements.IncompatibleTechniques`, naming the technique, the feature and the reason.
It runs twice: in the technique's ``setup`` (``when="setup"``: the Trainer's arguments, its callbacks, the module
and its flags are known) and in ``on_train_start`` (``when="train_start"``: the optimizers, LR schedulers and what
other callbacks built in their ``setup`` / ``on_fit_start`` are known), so a refused combination stops before the
first training step.

Every cell of the compatibility matrix (``tests/compat/``, the README's compatibility table) either works, tested
with a value, or is a refusal declared here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["FEATURES", "Feature", "check_features", "detect_features"]

When = Literal["setup", "train_start"]


@dataclass(frozen=True)
class Feature:
    """A Lightning feature a technique may refuse.

    Attributes:
        name: the key used in ``Requirements.refused_features`` and the compatibility matrix.
        title: how the refusal names it to the user (the Trainer argument, callback or flag).
        detect: ``detect(trainer, pl_module) -> bool``: whether the run uses the feature. Must not raise on a
            Trainer without a module or optimizers yet.
        when: the earliest hook at which ``detect`` can see the feature (``"setup"`` or ``"train_start"``).
    """

    name: str
    title: str
    detect: Callable[[Any, Any], bool]
    when: When = "setup"


def _callbacks_of(trainer: Any, *class_names: str) -> list[Any]:
    return [cb for cb in getattr(trainer, "callbacks", ()) if any(k.__name__ in class_names for k in type(cb).__mro__)]


def _manual_optimization(trainer: Any, pl_module: Any) -> bool:
    return pl_module is not None and not getattr(pl_module, "automatic_optimization", True)


def _overfit_batches(trainer: Any, pl_module: Any) -> bool:
    return bool(getattr(trainer, "overfit_batches", 0))


def _lr_schedulers(trainer: Any) -> list[Any]:
    return [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", None) or ()]


def _reduce_lr_on_plateau(trainer: Any, pl_module: Any) -> bool:
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    return any(isinstance(s, ReduceLROnPlateau) for s in _lr_schedulers(trainer))


#: every feature a technique may refuse, by name. Add a feature here with its detector, then name it in the
#: ``refused_features`` of the techniques that refuse it.
FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        Feature("overfit_batches", "Trainer(overfit_batches=...)", _overfit_batches),
        Feature("manual_optimization", "manual optimization (automatic_optimization=False)", _manual_optimization),
        Feature("reduce_lr_on_plateau", "a ReduceLROnPlateau LR scheduler", _reduce_lr_on_plateau, when="train_start"),
    )
}


def detect_features(trainer: Any, pl_module: Any = None, when: When | None = None) -> list[str]:
    """The names of the :data:`FEATURES` the run uses (those detectable at ``when``; default: all), in order."""
    module = pl_module if pl_module is not None else getattr(trainer, "lightning_module", None)
    return [
        name
        for name, feature in FEATURES.items()
        if (when is None or feature.when == when) and feature.detect(trainer, module)
    ]


def check_features(trainer: Any, when: When, callbacks: Sequence[Any] | None = None, pl_module: Any = None) -> None:
    """Refuse the features the run uses that a technique callback of ``trainer`` (or ``callbacks``) declares in
    ``Requirements.refused_features``.

    Raises:
        IncompatibleTechniques: ``"<Technique> cannot run with <feature title>: <why>"``.
        KeyError: a technique refuses a feature that :data:`FEATURES` does not define (a programming error).
    """
    from lightning_effi.core.requirements import IncompatibleTechniques, technique_callbacks

    techniques = technique_callbacks(trainer.callbacks if callbacks is None else callbacks)
    refusals = [(t, name, why) for t in techniques for name, why in type(t).requirements.refused_features]
    if not refusals:
        return
    used = set(detect_features(trainer, pl_module, when))
    for technique, name, why in refusals:
        feature = FEATURES[name]
        if name in used:
            raise IncompatibleTechniques(f"{type(technique).__name__} cannot run with {feature.title}: {why}")
