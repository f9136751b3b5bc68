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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "FEATURES",
    "Feature",
    "check_features",
    "detect_features",
    "optimized_parameters",
    "parameter_copy_holders",
]

When = Literal["setup", "train_start"]


@dataclass(frozen=True)
class Feature:
    """A Lightning feature a technique may refuse.

    Attributes:
        name: the key used in ``Requirements.refused_features`` and the compatibility matrix.
        title: how the refusal names it to the user (the Trainer argument, callback or flag).
        detect: ``detect(trainer, pl_module) -> bool``: whether the run uses the feature. Must not raise on a
            Trainer without a module or optimizers yet.
        when: the hooks at which ``detect`` is run: the earliest one at which it can see the feature (``"setup"``
            or ``"train_start"``), or both, for a feature that may also appear after ``setup`` (a submodule
            compiled in ``configure_model``, which Lightning runs after the callbacks' ``setup``).
    """

    name: str
    title: str
    detect: Callable[[Any, Any], bool]
    when: When | tuple[When, ...] = "setup"

    def runs_at(self, when: When) -> bool:
        """Whether ``detect`` is run at the hook ``when``."""
        return when == self.when or (isinstance(self.when, tuple) and when in self.when)


def _callbacks_of(trainer: Any, *class_names: str) -> list[Any]:
    return [cb for cb in getattr(trainer, "callbacks", ()) if any(k.__name__ in class_names for k in type(cb).__mro__)]


def _overfit_batches(trainer: Any, pl_module: Any) -> bool:
    return bool(getattr(trainer, "overfit_batches", 0))


def _lr_schedulers(trainer: Any) -> list[Any]:
    return [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", None) or ()]


# --- O: optimization and the callbacks around it (accumulation schedules, LR schedules, weight copies) ---------
def _changing_accumulation(trainer: Any, pl_module: Any) -> bool:
    from lightning_effi.core.progress import accumulation_changes

    return accumulation_changes(trainer)


def _one_cycle_lr_on_a_progress_clock(trainer: Any, pl_module: Any) -> bool:
    """A ``OneCycleLR`` stepped every optimizer step in a run whose epochs a technique shortens (a progress clock,
    :func:`~lightning_effi.core.progress.progress_clock`: InfoBatch alone): its ``total_steps`` is a fixed count that
    the run's steps cannot be known to match."""
    from torch.optim.lr_scheduler import OneCycleLR

    from lightning_effi.core.progress import progress_clock

    if progress_clock(getattr(trainer, "callbacks", ())) is None:
        return False
    configs = getattr(trainer, "lr_scheduler_configs", None) or ()
    return any(isinstance(c.scheduler, OneCycleLR) and c.interval == "step" for c in configs)


def _held_tensors(obj: Any, out: list[Any], seen: set[int], depth: int = 0) -> None:
    """The tensors ``obj`` holds as its state: itself, an ``nn.Module``'s parameters and buffers, and those of the
    items of a dict, list, tuple or set it is (one level: ``{name: tensor}``, ``[module]``); other objects and deeper
    containers are not entered (a record of many past states, ``{step: {name: tensor}}``, is history, not a copy the
    callback keeps using)."""
    from torch import Tensor, nn

    if id(obj) in seen or depth > 2:
        return
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        out.append(obj)
    elif isinstance(obj, nn.Module):
        out.extend(obj.parameters())
        out.extend(obj.buffers())
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _held_tensors(value, out, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            _held_tensors(value, out, seen, depth + 1)


def _storage(tensor: Any) -> int:
    """Where a tensor's memory starts (a view shares its base's); a tensor without storage counts as its own."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return id(tensor)


def parameter_copy_holders(trainer: Any, pl_module: Any, callbacks: Sequence[Any] | None = None) -> list[Any]:
    """The callbacks of ``trainer`` (or ``callbacks``) that keep their own copy of ``pl_module``'s parameters: a
    third-party EMA or weight average (a ``{name: tensor}`` shadow, a deep copy of the model, ...). A callback counts
    when the tensors it holds (:func:`_held_tensors` of each attribute: a tensor, a module, or one container of them;
    the module's own parameters, and views of them, excluded) have the shapes of at least half of the module's
    trainable parameter tensors (each shape counted as often as the module has it). Technique callbacks and
    callbacks that follow model changes (:class:`~lightning_effi.core.protocols.FollowsModelChanges`: they are told
    before and after every change and rebuild their copy) are not counted. A callback holding a module of the same
    shapes for another purpose (a frozen teacher) counts too."""
    from collections import Counter

    from lightning_effi.core.protocols import FollowsModelChanges
    from lightning_effi.core.requirements import technique_callbacks

    if pl_module is None:
        return []
    params = [p for p in pl_module.parameters() if p.requires_grad]
    wanted = Counter(tuple(p.shape) for p in params)
    if not wanted:
        return []
    own = {_storage(p) for p in pl_module.parameters()}
    candidates = list(getattr(trainer, "callbacks", ()) if callbacks is None else callbacks)
    skip = {id(c) for c in technique_callbacks(candidates)}
    holders = []
    for callback in candidates:
        if id(callback) in skip or isinstance(callback, FollowsModelChanges):
            continue
        tensors: list[Any] = []
        for value in vars(callback).values():  # each attribute: a tensor, a module, or one container of them
            _held_tensors(value, tensors, {id(trainer), id(pl_module)}, depth=1)
        held = Counter(tuple(t.shape) for t in tensors if _storage(t) not in own)
        covered = sum(min(n, held[shape]) for shape, n in wanted.items())
        if 2 * covered >= sum(wanted.values()):
            holders.append(callback)
    return holders


def _parameter_copies(trainer: Any, pl_module: Any) -> bool:
    return bool(parameter_copy_holders(trainer, pl_module))


# --- L: the training loop, the tuner and evaluation (overfit_batches above) ---------------------------------------
def _batch_size_finder(trainer: Any, pl_module: Any) -> bool:
    """A ``BatchSizeFinder`` among the Trainer's callbacks: given by the user, or put there by
    ``Tuner(trainer).scale_batch_size`` for the ``fit`` it runs (both search in ``on_fit_start``, after ``setup``)."""
    return bool(_callbacks_of(trainer, "BatchSizeFinder"))


# --- R: how the model runs (torch.compile, precision, strategies: the strategies are Requirements.strategies) ----
def _compiled_submodule(trainer: Any, pl_module: Any) -> bool:
    """A ``torch.compile``'d submodule of the LightningModule: an ``OptimizedModule`` among its modules (e.g.
    ``self.model = torch.compile(self.model)``). ``trainer.fit(torch.compile(model))`` is not one: Lightning unwraps
    the compiled module and compiles its ``forward`` and ``*_step`` methods instead
    (``lightning.pytorch.utilities.compile.from_compiled``)."""
    if pl_module is None:
        return False
    from torch._dynamo import OptimizedModule

    return any(isinstance(m, OptimizedModule) for m in pl_module.modules())


#: every feature a technique may refuse, by name. Add a feature here with its detector, then name it in the
#: ``refused_features`` of the techniques that refuse it.
FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        Feature("overfit_batches", "Trainer(overfit_batches=...)", _overfit_batches),
        Feature(
            "gradient_accumulation_scheduler",
            "a GradientAccumulationScheduler whose factor changes during the run",
            _changing_accumulation,
        ),
        Feature(
            "one_cycle_lr",
            "a OneCycleLR stepped every optimizer step (a fixed total_steps)",
            _one_cycle_lr_on_a_progress_clock,
            when="train_start",
        ),
        Feature(
            "third_party_ema",
            "a callback that keeps its own copy of the model's parameters (a third-party EMA or weight average)",
            _parameter_copies,
            when="train_start",
        ),
        Feature(
            "batch_size_finder",
            "the batch-size finder (Tuner(trainer).scale_batch_size or a BatchSizeFinder callback)",
            _batch_size_finder,
        ),
        Feature(
            "compiled_submodule",
            "a torch.compile'd submodule (module.model = torch.compile(module.model))",
            _compiled_submodule,
            # also at train start: a network compiled in configure_model, after the callbacks' setup, went unseen and
            # failed at the first level change in a bare TypeError (qa113-cli 01)
            when=("setup", "train_start"),
        ),
    )
}


def detect_features(trainer: Any, pl_module: Any = None, when: When | None = None) -> list[str]:
    """The names of the :data:`FEATURES` the run uses (those detectable at ``when``; default: all), in order."""
    module = pl_module if pl_module is not None else getattr(trainer, "lightning_module", None)
    return [
        name
        for name, feature in FEATURES.items()
        if (when is None or feature.runs_at(when)) and feature.detect(trainer, module)
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


def optimized_parameters(trainer: Any) -> set[int] | None:
    """The ids of the parameters the Trainer's optimizers hold (None when they hold none or are not known): a module
    whose parameters require grad but no optimizer holds (a teacher or a momentum target only put in eval mode, or
    updated by hand) is not trained."""
    found = {
        id(p)
        for optimizer in getattr(trainer, "optimizers", None) or []
        for group in getattr(optimizer, "param_groups", None) or []
        for p in group.get("params", [])
    }
    return found or None
