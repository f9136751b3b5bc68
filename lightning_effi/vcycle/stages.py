"""The V-cycle's stage arithmetic, without Lightning: the checks of :class:`~lightning_effi.vcycle.VCycleCallback`'s
arguments, the stage list, the stage lengths (:class:`~lightning_effi.core.progress.Duration`) resolved into optimizer
steps, the check that the stages fit the run, the FLOPs fraction of a planned cycle, and the learning-rate changes at
a level change.

The schedule and its parameters are described in the method card, ``README.md`` beside this file.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from lightning_effi.core.checks import check_bool, check_choice, check_int, check_real, is_int, is_real, plain
from lightning_effi.core.console import unshown_warnings
from lightning_effi.core.progress import (
    PROGRESS_TICKS,
    Duration,
    accumulate_grad_batches_at,
    estimated_optimizer_steps,
    run_length,
    steps_of_epochs,
    steps_per_epoch,
)
from lightning_effi.vcycle.operators import EMBEDDING_CONVENTIONS

__all__ = [
    "DEPRECATED_LENGTHS",
    "LENGTHS",
    "VCycleArgs",
    "CLOCKS",
    "advance_schedulers",
    "check_arguments",
    "check_min_steps",
    "continue_schedulers",
    "fit_stages",
    "levels_due",
    "resolve_progress_stages",
    "resolve_stages",
    "scale_learning_rates",
    "scheduler_progress",
    "SchedulerProgress",
    "spelled",
    "stage_clock",
    "stage_ends",
    "stage_level",
    "stage_plan",
    "stages_mismatch",
    "up_leg_lengths",
    "vcycle_flops_fraction",
]

#: The stage lengths: every down-leg stage (the paper's E_a), the coarsest level (E_small), the up-leg stages.
LENGTHS = ("e_a", "e_small", "up_leg")
#: Deprecated keyword arguments (one release): ``name -> (replacement, the Duration unit it maps to)``.
DEPRECATED_LENGTHS: dict[str, tuple[str, str]] = {
    f"{key}_{kind}": (key, unit)
    for key in LENGTHS
    for kind, unit in (("steps", "step"), ("fraction", "fraction"), ("epochs", "epoch"))
}
#: ``up_leg``: one length for every up-leg stage, or one per level ``(level 2, level 3, ...)``.
UpLeg = Duration | tuple[Duration, ...] | None
#: What the stage ends count: ``"step"`` (optimizer steps, ``trainer.global_step``) or ``"progress"`` (ticks of a
#: progress source's ``effi_progress_done``, :func:`~lightning_effi.core.progress.progress_ticks`).
CLOCKS = ("step", "progress")


# ---------------------------------------------------------------------------------------------------------------------
# the cycle


def stage_plan(levels: int, e_a: int, e_small: int, up_leg: Sequence[int] = ()) -> list[tuple[int, int]]:
    """The V-cycle's non-final stages as ``(level, steps)`` (Zou et al., ICLR 2024): ``e_a`` steps
    on each of the levels 1..K−1, ``e_small`` on level K, then ``up_leg[i]`` steps on level ``i + 2`` going up. The
    final stage (level 1, the rest of the run) is not listed.

    Args:
        levels: K, an int >= 2 (Python or numpy). e_a, e_small: ints >= 0 (optimizer steps, or ticks of a progress
            clock; a zero-length stage is passed through at once). up_leg: K − 2 ints >= 0 ordered by level
            ``[level 2, ..., level K−1]`` (empty for K = 2).

    Raises:
        ValueError: naming the argument: ``levels`` not an int >= 2 (levels=1 is a cycle without a coarser level),
            a length that is not an int >= 0, ``up_leg`` not a list of K − 2 lengths.

    >>> stage_plan(3, 2, 4, [3])
    [(1, 2), (2, 2), (3, 4), (2, 3)]
    """
    owner = "stage_plan"
    if not is_int(levels) or levels < 2:
        raise ValueError(
            f"{owner}.levels must be an int >= 2 (levels=1 has no coarser level: a V-cycle that changes nothing), "
            f"got {levels!r}"
        )
    levels = int(levels)
    e_a, e_small = check_int(owner, "e_a", e_a, minimum=0), check_int(owner, "e_small", e_small, minimum=0)
    ups = plain(up_leg)
    if not isinstance(ups, list) or len(ups) != levels - 2:
        need = (
            "empty (levels=2 has no up-leg stage)"
            if levels == 2
            else f"a list of levels - 2 = {levels - 2} length(s), one per up-leg stage "
            + ("(level 2)" if levels == 3 else f"(levels 2 to {levels - 1}, in that order)")
        )
        raise ValueError(f"{owner}.up_leg must be {need} with levels={levels}, got {up_leg!r}")
    up = [check_int(owner, f"up_leg[{i}]", v, minimum=0) for i, v in enumerate(ups)]
    down = [(k, e_a) for k in range(1, levels)]
    up_stages = [(k, up[k - 2]) for k in range(levels - 1, 1, -1)]
    return [*down, (levels, e_small), *up_stages]


def stage_ends(stages: Sequence[tuple[int, int]]) -> list[int]:
    """The optimizer step at which each stage ends (cumulative lengths).

    >>> stage_ends([(1, 2), (2, 2), (3, 4), (2, 3)])
    [2, 4, 8, 11]
    """
    ends, acc = [], 0
    for _, steps in stages:
        acc += int(steps)
        ends.append(acc)
    return ends


def stage_level(stages: Sequence[tuple[int, int]], index: int) -> int:
    """The level stage ``index`` trains: ``stages[index]``'s, 1 after the last listed stage (the rest of the run)."""
    return stages[index][0] if index < len(stages) else 1


def levels_due(stages: Sequence[tuple[int, int]], ends: Sequence[int], index: int, step: int) -> list[int]:
    """The levels to change to, in order, once optimizer step ``step`` is done in stage ``index``: one per stage that
    has ended (zero-length stages are passed through); the new stage index is ``index + len(result)``.

    >>> levels_due([(1, 2), (2, 0)], [2, 2], 0, 2)
    [2, 1]
    """
    path: list[int] = []
    while index + len(path) < len(stages) and step >= ends[index + len(path)]:
        path.append(stage_level(stages, index + len(path) + 1))
    return path


def vcycle_flops_fraction(stages: Sequence[tuple[int, float]], baseline_steps: int, baseline_cost: float) -> float:
    """``Σ steps_s · C_s / (baseline_steps · C_1)``: the V-cycle's training FLOPs as a fraction of the baseline's
    (``stages`` = ``(steps, per-step cost)``; the saving is ``1 −`` this). For the official GPT-2 example (55K steps
    of 12 × 768 and 50K of 6 × 384 against 100K) it is 0.671.

    Raises:
        ValueError: ``baseline_steps`` or ``baseline_cost`` not > 0.
    """
    if baseline_steps <= 0 or baseline_cost <= 0:
        raise ValueError("vcycle_flops_fraction: baseline_steps and baseline_cost must be > 0")
    return sum(s * c for s, c in stages) / (baseline_steps * baseline_cost)


# ---------------------------------------------------------------------------------------------------------------------
# arguments


@dataclass(frozen=True)
class VCycleArgs:
    """The checked constructor arguments of :class:`~lightning_effi.vcycle.VCycleCallback` (see
    :func:`check_arguments`); ``alpha_original=None`` means the adapter's default."""

    levels: int
    e_a: Duration
    e_small: Duration
    up_leg: UpLeg
    width_scheme: Any
    depth_scheme: Any
    alpha_original: float | None
    lr_multiplier: dict[int, float]
    embedding_convention: str
    lr_schedule: str
    model_attr: str | None
    strict: bool
    baseline_steps: int | None
    unrelated_params: tuple[str, ...] = ()


def _scheme(owner: str, key: str, value: Any, names: tuple[str, ...]) -> Any:
    """A width or depth scheme: None, one of ``names``, or explicit groups (a list of non-empty lists of integer
    indices; whether they partition the model's units is checked in ``setup``, against its sizes)."""
    value = plain(value)
    if value is None or (isinstance(value, str) and value in names):
        return value
    groups = (
        not isinstance(value, (str, bytes))
        and isinstance(value, Sequence)
        and len(value) > 0
        and all(
            not isinstance(g, (str, bytes)) and isinstance(g, Sequence) and len(g) > 0 and all(is_int(j) for j in g)
            for g in value
        )
    )
    if not groups:
        allowed = " | ".join(repr(n) for n in names)
        raise ValueError(
            f"{owner}.{key} must be {allowed}, None (keep the model's {key.split('_')[0]}) or explicit groups of "
            f"indices such as [[0, 1], [2, 3]], got {value!r}"
        )
    return value


def _keeps(scheme: Any) -> bool:
    """Whether a checked scheme leaves its dimension as it is: None, or explicit groups of one unit each."""
    return scheme is None or (not isinstance(scheme, str) and all(len(group) == 1 for group in scheme))


def _duration(owner: str, key: str, value: Any) -> Duration:
    """A new-style stage length: steps or epochs >= 1, or a fraction of the run in [0, 1]."""
    if is_int(value) and value < 1:  # Duration.parse's own bound (>= 0) would offer 0, refused just below
        raise ValueError(f"{owner}.{key} must be at least 1 step, got {value!r}")
    d = Duration.parse(value, f"{owner}.{key}", units=("step", "epoch", "fraction"))
    if d.unit == "token":
        raise ValueError(
            f"{owner}.{key}: a stage length in tokens is not supported (stages end at optimizer steps); "
            f"give steps, epochs ('2ep') or a fraction of the run ('0.05dur'), got {value!r}"
        )
    if d.unit in ("step", "epoch") and d.value < 1:
        raise ValueError(f"{owner}.{key} must be at least 1 {d.unit}, got {value!r}")
    if key == "e_a" and d.unit == "fraction" and d.value == 0:
        # resolved to the 1 step a small fraction rounds up to, recorded as '0dur' (qa58-args 03), where e_a=0 and
        # '0ep' are refused
        raise ValueError(
            f"{owner}.e_a must be more than 0 of the run (the full model trains before the first coalescing): give a "
            f"fraction > 0 ('0.05dur') or steps >= 1, got {value!r}"
        )
    if d.unit == "fraction" and d.value == 0:
        # refused at setup as resolving to 0 steps; 0 and '0ep' are refused here (qa60-break 05)
        raise ValueError(
            f"{owner}.{key} must be more than 0 of the run (its level would never train): give a fraction > 0 "
            f"('0.05dur'), steps >= 1 or epochs >= 1, got {value!r}"
        )
    return d


def _new_length(owner: str, key: str, value: Any, levels: int) -> Duration | tuple[Duration, ...]:
    if key == "up_leg" and isinstance(value, list):
        if len(value) != levels - 2:
            raise ValueError(
                f"{owner}.up_leg must be one duration or a list of {levels - 2} (levels 2..{levels - 1}), got {value!r}"
            )
        return tuple(_duration(owner, f"up_leg[{i}]", v) for i, v in enumerate(value))
    return _duration(owner, key, value)


def _old_length(owner: str, name: str, value: Any, levels: int) -> Duration | tuple[Duration, ...]:
    """A deprecated ``*_steps`` / ``*_fraction`` / ``*_epochs`` value as the same Duration (checks as before)."""
    key, unit = DEPRECATED_LENGTHS[name]
    if unit == "fraction":
        return Duration(check_real(owner, name, value, 0, 1), "fraction")
    if key == "up_leg" and isinstance(value, list):
        if len(value) != levels - 2 or not all(is_int(s) and s >= 1 for s in value):
            raise ValueError(
                f"{owner}.{name} must be one int >= 1 or a list of {levels - 2} ints >= 1 (levels "
                f"2..{levels - 1}), got {value!r}"
            )
        return tuple(Duration(int(s), unit) for s in value)  # type: ignore[arg-type]
    return Duration(check_int(owner, name, value, minimum=1), unit)  # type: ignore[arg-type]


def spelled(length: Duration | tuple[Duration, ...] | None) -> Any:
    """How the new argument writes ``length``: an int for steps, else the duration's string (``'2ep'``,
    ``'0.5dur'``), a list for one length per level (the deprecation message, the callback's ``repr``)."""
    if isinstance(length, tuple):
        return [spelled(d) for d in length]
    if not isinstance(length, Duration):  # None, or a value set on the callback since (shown as set: repr)
        return length
    return int(length.value) if length.unit == "step" else str(length)


def _length(
    owner: str, key: str, new: Any, deprecated: Mapping[str, Any], levels: int, stacklevel: int
) -> Duration | tuple[Duration, ...] | None:
    """The one length given for ``key``: the new argument or one deprecated spelling (which warns)."""
    olds = [f"{key}_{kind}" for kind in ("steps", "fraction", "epochs")]
    given = ([key] if new is not None else []) + [n for n in olds if deprecated.get(n) is not None]
    if len(given) > 1:
        raise ValueError(f"{owner}: give one of {key}, {', '.join(olds[:2])} or {olds[2]}, not {' and '.join(given)}")
    if not given:
        return None
    if new is not None:
        return _new_length(owner, key, plain(new), levels)
    name = given[0]
    length = _old_length(owner, name, plain(deprecated[name]), levels)
    warnings.warn(
        f"{owner}: {name} is deprecated and will be removed in the next release; use {key}={spelled(length)!r}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return length


def check_arguments(
    owner: str = "VCycleCallback",
    *,
    levels: Any = 2,
    e_a: Any = None,
    e_small: Any = None,
    up_leg: Any = None,
    width_scheme: Any = "half",
    depth_scheme: Any = "adjacent",
    alpha_original: Any = None,
    lr_multiplier: Any = None,
    embedding_convention: Any = "official",
    lr_schedule: Any = "continue",
    model_attr: Any = None,
    strict: Any = True,
    baseline_steps: Any = None,
    unrelated_params: Any = (),
    deprecated: Mapping[str, Any] | None = None,
    stacklevel: int = 2,
) -> VCycleArgs:
    """Check and normalise the V-cycle's arguments (see :class:`~lightning_effi.vcycle.VCycleCallback`).

    ``e_a``, ``e_small`` and ``up_leg`` are anything :meth:`Duration.parse` reads (int = optimizer steps, ``"2ep"``,
    ``"0.05dur"``, ``"500st"``); steps and epochs are >= 1, fractions in [0, 1]; ``up_leg`` may be a list ordered by
    level. ``deprecated`` holds the old ``*_steps`` / ``*_fraction`` / ``*_epochs`` keywords (None = not given):
    each maps to the same Duration and emits a ``DeprecationWarning`` (``stacklevel`` as if ``warnings.warn`` were
    called here: 2 points at the caller).

    Raises:
        ValueError: naming the argument: a wrong type or range, a missing ``e_a`` / ``e_small``, two spellings of one
            length, ``levels >= 3`` without ``up_leg`` (the paper gives no length for it) or ``up_leg`` with
            ``levels = 2``, a float or a token count as a length, an ``lr_multiplier`` that is not ``{level: factor}``,
            ``width_scheme`` and ``depth_scheme`` that both keep their dimension (None, or groups of one unit each).
        TypeError: a key of ``deprecated`` that is not one of the nine old spellings (whatever its value).
    """
    unknown = sorted(set(deprecated or {}) - set(DEPRECATED_LENGTHS))  # whatever the value, None included
    if unknown:
        raise TypeError(f"{owner}: unexpected keyword arguments {unknown}")
    deprecated = {k: v for k, v in (deprecated or {}).items() if v is not None}
    levels = check_int(owner, "levels", levels, minimum=2)
    lengths: dict[str, Any] = {}
    for key, new in (("e_a", e_a), ("e_small", e_small)):
        lengths[key] = _length(owner, key, new, deprecated, levels, stacklevel)
        if lengths[key] is None:
            raise ValueError(
                f"{owner}: {key} is required (an int of optimizer steps, '2ep' or '0.05dur'; formerly "
                f"{key}_steps / {key}_fraction / {key}_epochs)"
            )
    up_given = up_leg is not None or any(f"up_leg_{kind}" in deprecated for kind in ("steps", "fraction", "epochs"))
    if levels >= 3:
        if not up_given:
            raise ValueError(
                f"{owner}: levels={levels} requires up_leg (or the deprecated up_leg_steps / "
                "up_leg_fraction / up_leg_epochs): the paper does not give the length of the intermediate "
                "up-leg stages"
            )
        lengths["up_leg"] = _length(owner, "up_leg", up_leg, deprecated, levels, stacklevel)
    elif up_given:
        raise ValueError(
            f"{owner}: up_leg (or up_leg_steps / up_leg_fraction / up_leg_epochs) applies to levels >= 3 "
            f"only (levels={levels})"
        )
    if alpha_original is not None and not (is_real(alpha_original) and 0.0 <= float(alpha_original) <= 1.0):
        raise ValueError(
            f"{owner}.alpha_original must be in [0, 1] (None = the adapter's default), got {alpha_original!r}"
        )
    mult: dict[int, float] = {}
    if lr_multiplier is not None and not isinstance(plain(lr_multiplier), Mapping):
        raise ValueError(
            f"{owner}.lr_multiplier must be a mapping {{level: factor}} such as {{2: 4.0}} (or None), "
            f"got {lr_multiplier!r}"
        )
    for k, v in (plain(lr_multiplier) or {}).items():
        try:
            level = int(k)
        except (TypeError, ValueError):
            level = -1
        if not 1 <= level <= levels or str(level) != str(k).strip():
            raise ValueError(f"{owner}.lr_multiplier: keys must be levels in 1..{levels}, got {k!r}")
        if not is_real(v) or v <= 0:  # kept: tests assert this message
            raise ValueError(f"{owner}.lr_multiplier[{level}] must be a number > 0, got {v!r}")
        mult[level] = float(v)
    width_scheme = _scheme(owner, "width_scheme", width_scheme, ("half",))
    depth_scheme = _scheme(owner, "depth_scheme", depth_scheme, ("adjacent", "half"))
    if _keeps(width_scheme) and _keeps(depth_scheme):
        # a coarse level equal to the full model: the run rebuilt the optimizer and interpolated at every level change
        # (and trained the full model at lr_multiplier) while it reported no saving (qa102-nlp 04)
        raise ValueError(
            f"{owner}: width_scheme={width_scheme!r} and depth_scheme={depth_scheme!r} keep both the width and the "
            "depth, so the coarse levels would be the full model: coalesce at least one of them (width_scheme='half' "
            "and/or depth_scheme='adjacent' | 'half', or explicit groups merging some units)"
        )
    check_choice(owner, "embedding_convention", embedding_convention, EMBEDDING_CONVENTIONS)
    check_choice(owner, "lr_schedule", lr_schedule, ("continue", "restart"))
    if model_attr is not None and (not isinstance(model_attr, str) or not model_attr.isidentifier()):
        raise ValueError(
            f"{owner}.model_attr must be an attribute name of the LightningModule or None (found in setup), got "
            f"{model_attr!r}; the V-cycle replaces that attribute's network whole. To coalesce one list of blocks "
            "inside it (one stage of a CNN, say), pass adapter=<a lightning_effi.models.torch_transformer."
            "TorchBlocksVCycleAdapter subclass whose block_list(model) returns that list>"
        )
    if baseline_steps is not None:  # None: a baseline as long as this run
        baseline_steps = check_int(owner, "baseline_steps", baseline_steps, minimum=1)
    unrelated = plain(unrelated_params if unrelated_params is not None else ())
    if isinstance(unrelated, str):
        unrelated = [unrelated]
    if not isinstance(unrelated, (list, tuple)) or not all(isinstance(u, str) and u.strip() for u in unrelated):
        raise ValueError(
            f"{owner}.unrelated_params must be a list of parameter names of the LightningModule or fnmatch patterns "
            f"(e.g. ['side.*']), got {unrelated_params!r}"
        )
    return VCycleArgs(
        levels=levels,
        e_a=lengths["e_a"],
        e_small=lengths["e_small"],
        up_leg=lengths.get("up_leg"),
        width_scheme=width_scheme,
        depth_scheme=depth_scheme,
        alpha_original=None if alpha_original is None else float(alpha_original),
        lr_multiplier=mult,
        embedding_convention=embedding_convention,
        lr_schedule=lr_schedule,
        model_attr=model_attr,
        strict=check_bool(owner, "strict", strict),
        baseline_steps=None if baseline_steps is None else int(baseline_steps),
        unrelated_params=tuple(u.strip() for u in unrelated),
    )


# ---------------------------------------------------------------------------------------------------------------------
# resolution into optimizer steps


def up_leg_lengths(levels: int, up_leg: UpLeg) -> list[Duration]:
    """The length of each up-leg stage, ordered by level ``[level 2, ..., level K−1]`` (empty for K = 2)."""
    if levels < 3 or up_leg is None:
        return []
    return list(up_leg) if isinstance(up_leg, tuple) else [up_leg] * (levels - 2)


def resolve_stages(
    levels: int,
    e_a: Duration,
    e_small: Duration,
    up_leg: UpLeg,
    total_steps: int | None,
    num_training_batches: float | None = None,
    accumulate_grad_batches: int | Callable[[int], int] = 1,
    owner: str = "VCycleCallback",
    unknown_because: str | None = None,
) -> list[tuple[int, int]]:
    """The non-final stages ``(level, optimizer steps)`` of a run of ``total_steps`` (None: unknown).

    Steps are taken as given, ``n`` epochs are ``n · steps_per_epoch(num_training_batches, accumulate_grad_batches)``
    (so a switch falls on an epoch boundary) and a fraction ``f`` is ``floor(f · total_steps)`` (``e_a`` at least 1).
    ``accumulate_grad_batches`` may be a function of the 0-based epoch (a ``GradientAccumulationScheduler``'s
    factors): a stage in epochs then counts the steps of the epochs it spans
    (:func:`~lightning_effi.core.progress.steps_of_epochs`).

    Raises:
        ValueError: fractions in a run of unknown length, epochs without a finite number of batches, or stages that
            need more than ``total_steps`` optimizer steps.
    """
    ups = up_leg_lengths(levels, up_leg)
    units = {d.unit for d in (e_a, e_small, *ups)}
    if total_steps is None and "fraction" in units:
        # a loader without a length has no epochs to give either (qa57-loops 04: the advice of '2ep' failed next)
        streamed = unknown_because is not None and "without a length" in unknown_because
        raise ValueError(
            f"{owner}: the run's length is unknown ("
            f"{unknown_because or 'max_steps=-1 and max_epochs=-1, or a train dataloader without a length'}), so "
            "stage lengths given as fractions of the run ('0.05dur', *_fraction) cannot resolve; set "
            "Trainer(max_steps=...) or give the stage lengths in optimizer steps (ints)"
            + ("" if streamed else " or epochs ('2ep')")
        )
    spe = None
    if callable(accumulate_grad_batches):
        factor_at = accumulate_grad_batches
    else:
        factor, factor_at = int(accumulate_grad_batches), None
    if "epoch" in units:

        def epoch_steps(epoch: int) -> int:
            return steps_per_epoch(
                num_training_batches if num_training_batches is not None else math.inf,
                max(1, int(factor_at(epoch) if factor_at is not None else factor)),
                f"{owner}: a stage length in epochs ('1ep', e_a_epochs, ...)",
            )

        spe = epoch_steps(0)

    def steps(d: Duration, at_least: int) -> int:
        n = d.to_steps(steps_per_epoch=spe, total_steps=total_steps)
        return max(at_least, n) if d.unit == "fraction" else n

    a, small, up = steps(e_a, 1), steps(e_small, 0), [steps(d, 0) for d in ups]
    stages = stage_plan(levels, a, small, up)
    plain_stages = list(stages)
    if factor_at is not None and "epoch" in units:
        # each stage in epochs spans its own epochs, at their factors: lay the stages out one after another
        durations = [e_a] * (levels - 1) + [e_small] + [ups[level - 2] for level, _ in stages[levels:]]
        start = 0
        for i, ((level, n), d) in enumerate(zip(stages, durations)):
            if d.unit == "epoch":
                n = steps_of_epochs(epoch_steps, int(d.value), start)
                stages[i] = (level, n)
            start += n
    need = sum(s for _, s in stages)
    if total_steps is not None and need > total_steps:
        detail = f"e_a × (levels − 1) = {a} × {levels - 1}, e_small = {small}"
        if up:
            detail += f", up_leg = {up}"
        if stages != plain_stages:  # epochs of other lengths (a GradientAccumulationScheduler's factors)
            detail = f"stages of {[n for _, n in stages]} steps, each epoch at its accumulation factor"
        elif spe is not None:
            detail += f"; {spe} optimizer steps per epoch"
        raise ValueError(
            f"{owner}: the V-cycle's stages need {need} optimizer steps ({detail}) but the run has "
            f"{total_steps} (trainer.max_steps, or max_epochs × the optimizer steps of an epoch with "
            "limit_train_batches, whichever ends the run first: trainer.estimated_stepping_batches); lower e_a / "
            "e_small / up_leg or raise trainer.max_steps / max_epochs / limit_train_batches: the run would end "
            "before the cycle is back on the full model"
        )
    return stages


def fit_stages(
    trainer: Any,
    levels: int,
    e_a: Duration,
    e_small: Duration,
    up_leg: UpLeg,
    at_setup: bool,
    owner: str = "VCycleCallback",
) -> list[tuple[int, int]] | None:
    """:func:`resolve_stages` for a fit, from a Lightning trainer's ``max_steps``, ``estimated_stepping_batches``
    (read when ``at_setup`` is False; a ``GradientAccumulationScheduler``'s factors counted:
    :func:`~lightning_effi.core.progress.estimated_optimizer_steps`), ``num_training_batches`` (read when a length is
    in epochs) and ``accumulate_grad_batches``.

    In ``setup`` (``at_setup``) the run's length is ``max_steps`` (a first check; None when a length is in epochs or
    ``max_steps`` is not set). At train start it is :func:`run_length`: ``estimated_stepping_batches``, which is
    ``max_steps`` when that bounds the run and fewer steps when ``max_epochs`` or ``limit_train_batches`` end it
    sooner, so fractions resolve against the steps the run really has and stages that end after it raise.

    Raises:
        ValueError: see :func:`resolve_stages`.
    """
    epochs = any(d.unit == "epoch" for d in (e_a, e_small, *up_leg_lengths(levels, up_leg)))
    total = run_length(trainer.max_steps, None if at_setup else estimated_optimizer_steps(trainer))
    if at_setup and (epochs or total is None):
        return None
    batches = trainer.num_training_batches if epochs else None
    max_epochs = getattr(trainer, "max_epochs", None)
    why = (
        None
        if total is not None
        else "max_epochs=-1 and max_steps=-1"
        if max_epochs in (-1, None)
        else f"max_epochs={max_epochs} over a train dataloader without a length (an IterableDataset), and max_steps=-1"
    )
    return resolve_stages(
        levels,
        e_a,
        e_small,
        up_leg,
        total,
        batches,
        lambda epoch: accumulate_grad_batches_at(trainer, epoch),
        owner,
        unknown_because=why,
    )


def stages_mismatch(saved: Sequence[Sequence[int]], current: Sequence[tuple[int, int]]) -> str | None:
    """None when a checkpoint's stages (its ``config()["stages"]``) are the stages the current arguments resolve to
    in this run (the same optimizer steps however they are spelled: ``2``, ``"2st"``, a fraction giving 2), else
    what differs (for :func:`~lightning_effi.core.state.config_mismatch`).

    >>> stages_mismatch([[1, 2], [2, 3]], [(1, 2), (2, 3)]) is None
    True
    """
    saved = [(int(k), int(n)) for k, n in saved]
    if saved == list(current):
        return None
    return (
        f"the checkpoint's stages (level, optimizer steps) {saved} differ from those of the current e_a / e_small / "
        f"up_leg in this run {list(current)}"
    )


# ---------------------------------------------------------------------------------------------------------------------
# the progress clock: a technique that changes the epoch lengths (InfoBatch) is present


def _stage_durations(levels: int, e_a: Duration, e_small: Duration, up_leg: UpLeg) -> list[Duration]:
    """The length of each non-final stage, in the order of :func:`stage_plan`."""
    ups = up_leg_lengths(levels, up_leg)
    return [*([e_a] * (levels - 1)), e_small, *(ups[k - 2] for k in range(levels - 1, 1, -1))]


def stage_clock(levels: int, e_a: Duration, e_small: Duration, up_leg: UpLeg, source: str | None, owner: str) -> str:
    """The clock the stages are measured on (one of :data:`CLOCKS`).

    Without a progress source (``source`` None: no callback changes the epoch lengths) it is ``"step"``, whatever
    the units (epochs and fractions resolve into optimizer steps, :func:`resolve_stages`). With one (``source``: its
    class name), lengths given as fractions (``"0.3dur"``) or epochs (``"2ep"``) are measured on its progress
    (``"progress"``), lengths given in optimizer steps on the step clock (``"step"``; they must then fit in the
    source's fewest steps, :func:`check_min_steps`).

    Raises:
        ValueError: with a progress source, optimizer steps mixed with fractions or epochs (the message names the
            source and the fix).
    """
    durations = _stage_durations(levels, e_a, e_small, up_leg)
    units = {d.unit for d in durations}
    if source is None or units == {"step"}:
        return "step"
    if "step" not in units:
        return "progress"
    given = f"e_a={spelled(e_a)!r}, e_small={spelled(e_small)!r}" + (
        f", up_leg={spelled(up_leg)!r}" if levels >= 3 else ""
    )
    raise ValueError(
        f"{owner}: {source} changes the epoch lengths, so the stage lengths are measured on one clock: all in "
        f"optimizer steps (which must fit in the fewest steps {source}'s run can have) or all as fractions ('0.3dur') "
        f"or epochs ('2ep') of its training progress; got {given}. Give every stage length as a fraction of the run, "
        "e.g. e_a='0.05dur', e_small='0.5dur'"
    )


def _progress_of(d: Duration, max_epochs: int | None) -> Fraction:
    """A fraction or epoch duration as an exact share of the run: ``f``, or ``n / max_epochs``."""
    if d.unit == "fraction":
        return Fraction(repr(float(d.value)))  # the decimal written ("0.2dur" is 1/5), so shares add up exactly
    assert max_epochs is not None
    return Fraction(int(d.value), max_epochs)


def resolve_progress_stages(
    levels: int,
    e_a: Duration,
    e_small: Duration,
    up_leg: UpLeg,
    max_epochs: float | None,
    owner: str = "VCycleCallback",
    source: str = "the progress source",
) -> list[tuple[int, int]]:
    """The non-final stages ``(level, ticks)`` on the progress clock: a stage ends once the source's
    ``effi_progress_done()`` (in ticks of :data:`~lightning_effi.core.progress.PROGRESS_TICKS`, 1e-9 of the run)
    reaches the sum of the stage lengths so far. A fraction ``f`` is ``f`` of the run's progress; ``n`` epochs are
    ``n / max_epochs`` of it, so a switch falls on an epoch boundary when the source's progress runs over
    ``max_epochs`` epochs (InfoBatch's does with its default ``num_epochs``). The ends are rounded from the exact
    cumulative share (``round(share · 10⁹)``); every ``e_a`` stage is at least one tick (it ends after the first
    optimizer step that makes progress), as it is at least one step on the step clock. The switch therefore comes
    after the first optimizer step at which the progress has reached the stage's end (a fraction of a run of ``T``
    equal steps ends at ``ceil(f · T)``, where the step clock takes ``floor(f · T)``).

    Raises:
        ValueError: a length in optimizer steps (see :func:`stage_clock`); epochs without a finite
            ``max_epochs`` >= 1; stages that need more than the whole run (the cycle would not be back on the full
            model when the run ends).
    """
    durations = _stage_durations(levels, e_a, e_small, up_leg)
    if any(d.unit not in ("fraction", "epoch") for d in durations):
        raise ValueError(f"{owner}: the progress clock takes stage lengths as fractions or epochs only")
    epochs: int | None = None
    if any(d.unit == "epoch" for d in durations):
        if max_epochs is None or not math.isfinite(max_epochs) or max_epochs < 1:
            raise ValueError(
                f"{owner}: stage lengths in epochs are measured on {source}'s training progress as n / max_epochs "
                f"of the run, but trainer.max_epochs={max_epochs}; set Trainer(max_epochs=...) or give the stage "
                "lengths as fractions of the run ('0.3dur')"
            )
        epochs = int(max_epochs)
    kinds = [*(["e_a"] * (levels - 1)), "e_small", *(["up_leg"] * (levels - 2))]
    stages, share, previous = [], Fraction(0), 0
    for (level, _), kind, d in zip(stage_plan(levels, 0, 0, [0] * (levels - 2)), kinds, durations):
        share += _progress_of(d, epochs)
        end = max(previous + (1 if kind == "e_a" else 0), round(share * PROGRESS_TICKS))
        stages.append((level, end - previous))
        previous = end
    if previous > PROGRESS_TICKS:
        detail = ", ".join(f"{k}={d}" for k, d in zip(kinds, durations))
        raise ValueError(
            f"{owner}: the V-cycle's stages need {float(share):.6g} of the run on {source}'s progress clock ({detail}"
            f"{f'; an epoch is 1/{epochs} of the run' if epochs else ''}) but the run is 1; lower e_a / e_small / "
            "up_leg: the run would end before the cycle is back on the full model"
        )
    return stages


def check_min_steps(
    stages: Sequence[tuple[int, int]], min_total_steps: int, owner: str = "VCycleCallback", source: str = "the source"
) -> None:
    """Stages in optimizer steps must fit in the fewest optimizer steps a run whose epochs another technique shortens
    can have (``source``'s ``effi_min_total_steps()``).

    Raises:
        ValueError: they need more; the message names both callbacks and the fix (fractions of the run).
    """
    need = sum(int(n) for _, n in stages)
    if not is_int(min_total_steps) or min_total_steps < 1:
        raise ValueError(f"{owner}: {source}.effi_min_total_steps() must be an int >= 1, got {min_total_steps!r}")
    if need > min_total_steps:
        raise ValueError(
            f"{owner}: the V-cycle's stages need {need} optimizer steps ({[n for _, n in stages]}) but {source} "
            f"shortens the epochs and its run can have as few as {min_total_steps} optimizer steps "
            "(effi_min_total_steps), so the run could end before the cycle is back on the full model. Give the stage "
            f"lengths as fractions of the run (e.g. e_a='0.05dur', e_small='0.5dur'; measured on {source}'s "
            f"training progress) or lower them to fit in {min_total_steps} steps"
        )


# ---------------------------------------------------------------------------------------------------------------------
# learning rate at a level change


def _schedulers_within(scheduler: Any) -> list[Any]:
    """``scheduler`` and the schedulers it drives (``SequentialLR`` / ``ChainedScheduler``'s ``_schedulers``)."""
    out = [scheduler]
    for inner in getattr(scheduler, "_schedulers", None) or ():
        out.extend(_schedulers_within(inner))
    return out


#: per-group learning rates a scheduler keeps in the optimizer's param groups (``initial_lr``: every ``LRScheduler``;
#: ``max_lr`` / ``min_lr``: ``OneCycleLR``), scaled with the group's ``lr``
_GROUP_LRS = ("initial_lr", "max_lr", "min_lr")
#: per-group learning rates a scheduler keeps as lists (``base_lrs``: every ``LRScheduler``; ``max_lrs``: ``CyclicLR``;
#: ``base_values``: timm's schedulers, ``timm.scheduler.Scheduler``)
_SCHEDULER_LRS = ("base_lrs", "max_lrs", "base_values")


def scale_learning_rates(optimizers: Sequence[Any], scheduler_configs: Sequence[Any], factor: float) -> None:
    """Multiply the peak learning rate of freshly built optimizers by ``factor`` (a level's ``lr_multiplier``): the
    param groups' ``lr`` and the learning rates schedulers keep in them (``initial_lr``; ``OneCycleLR``'s ``max_lr``
    and ``min_lr``), and the schedulers' own lists (``base_lrs``, ``CyclicLR``'s ``max_lrs``; also of the schedulers
    a ``SequentialLR`` / ``ChainedScheduler`` drives), so the whole curve is scaled (a ``LambdaLR``'s, a
    ``OneCycleLR``'s: its start, peak and end). A ``ReduceLROnPlateau``'s ``min_lrs`` (an absolute floor) and a
    ``CosineAnnealingLR``'s ``eta_min`` are kept. ``scheduler_configs``: objects with a ``scheduler`` (Lightning's
    ``LRSchedulerConfig``)."""
    if factor == 1.0:
        return
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["lr"] * factor
            for key in _GROUP_LRS:
                if key in group:
                    group[key] = group[key] * factor
    for cfg in scheduler_configs:
        for scheduler in _schedulers_within(cfg.scheduler):
            for key in _SCHEDULER_LRS:
                values = getattr(scheduler, key, None)
                if isinstance(values, (list, tuple)):
                    setattr(scheduler, key, [v * factor for v in values])
            if is_timm_scheduler(scheduler) and getattr(scheduler, "warmup_t", None):
                # timm derives its warmup increments from base_values at construction (timm/scheduler/*_lr.py)
                start = float(getattr(scheduler, "warmup_lr_init", 0.0))
                scheduler.warmup_steps = [(v - start) / scheduler.warmup_t for v in scheduler.base_values]


def is_timm_scheduler(scheduler: Any) -> bool:
    """A timm scheduler (``timm.scheduler.Scheduler``: ``base_values``, stepped by ``step`` / ``step_update``, which
    Lightning leaves to the module's ``lr_scheduler_step``), told by its interface, without importing timm."""
    return hasattr(scheduler, "base_values") and callable(getattr(scheduler, "step_update", None))


@dataclass(frozen=True)
class SchedulerProgress:
    """Where a scheduler was when its level's training state was replaced (:func:`scheduler_progress`).

    Attributes:
        kind: the scheduler's class. steps: its ``last_epoch`` (the steps it took, the advance of the initial
            ``last_epoch`` included; a ``ChainedScheduler``'s, which has none, its members'), None when it has
            none. plateau: a ``ReduceLROnPlateau``'s progress (``best``, ``num_bad_epochs``,
            ``cooldown_counter``, ``last_epoch``), else None. lrs: the learning rate of each param group of its
            optimizer.
    """

    kind: type
    steps: int | None
    plateau: dict[str, Any] | None
    lrs: tuple[float, ...]


#: the entries of a ``ReduceLROnPlateau``'s state that are its progress (the rest is its configuration)
_PLATEAU_PROGRESS = ("best", "num_bad_epochs", "cooldown_counter", "last_epoch")


def scheduler_progress(scheduler_configs: Sequence[Any]) -> list[SchedulerProgress]:
    """The progress of every scheduler of ``scheduler_configs`` (Lightning's ``LRSchedulerConfig``), read before a
    level change replaces them (:func:`continue_schedulers` hands it to the new ones)."""
    out = []
    for cfg in scheduler_configs:
        scheduler = cfg.scheduler
        plateau = None
        if cfg.reduce_on_plateau:
            state = scheduler.state_dict()
            plateau = {k: state[k] for k in _PLATEAU_PROGRESS if k in state}
        lrs = tuple(float(g["lr"]) for g in scheduler.optimizer.param_groups)
        out.append(SchedulerProgress(type(scheduler), _step_count(scheduler), plateau, lrs))
    return out


def _step_count(scheduler: Any) -> int | None:
    """The steps ``scheduler`` took (its ``last_epoch``); a ``ChainedScheduler``, which has none, steps all its
    members together: theirs, when they agree (read as 0, it was never stepped forward, and a chained warmup restarted
    at every level change: qa100-user 01); None when it cannot be told."""
    last: Any = getattr(scheduler, "last_epoch", None)
    if is_int(last):  # a numpy integer too, as int() read it
        return int(last)
    members = getattr(scheduler, "_schedulers", None)
    if members:
        counts = {_step_count(m) for m in members}
        if len(counts) == 1:
            return counts.pop()
    return None


def continue_schedulers(
    scheduler_configs: Sequence[Any],
    previous: Sequence[SchedulerProgress],
    global_step: int,
    current_epoch: int,
    lr_ratio: float = 1.0,
) -> None:
    """Make freshly built schedulers continue where the ones they replace were (``lr_schedule="continue"``), so the
    run follows one LR curve across level changes. ``previous``: :func:`scheduler_progress` of the old schedulers,
    matched by position (a scheduler of another class counts as new).

    - A scheduler that replaces one of its class is stepped as many times as the old one was (its ``last_epoch``):
      exact whatever its ``interval`` and ``frequency`` (an epoch-interval scheduler already stepped at the end of
      the epoch whose last batch triggers the change is not stepped once too few). Without a match:
      :func:`advance_schedulers`' count.
    - A ``ReduceLROnPlateau`` gets its predecessor's progress (best value, bad epochs, cooldown) and its reduced
      learning rates times ``lr_ratio`` (the new level's ``lr_multiplier`` over the old one's; per param group, when
      the optimizers have as many groups), so a plateau's reductions are kept across the change. Without a match it
      starts afresh.

    Steps run with warnings silenced (a fresh scheduler stepped before its optimizer).
    """
    for i, cfg in enumerate(scheduler_configs):
        prev = previous[i] if i < len(previous) and previous[i].kind is type(cfg.scheduler) else None
        scheduler = cfg.scheduler
        if is_timm_scheduler(scheduler):  # no step count: the module's lr_scheduler_step sets it (the callback)
            continue
        if cfg.reduce_on_plateau:
            if prev is None or prev.plateau is None:
                continue
            scheduler.load_state_dict({**scheduler.state_dict(), **prev.plateau})
            groups = scheduler.optimizer.param_groups
            if len(groups) == len(prev.lrs):
                for group, lr in zip(groups, prev.lrs):
                    group["lr"] = lr * lr_ratio
                scheduler._last_lr = [float(g["lr"]) for g in groups]
            continue
        now = _step_count(scheduler)
        if prev is not None and prev.steps is not None and now is not None:
            count = prev.steps - now
        else:
            count = (global_step if cfg.interval == "step" else current_epoch) // max(1, cfg.frequency)
        with unshown_warnings():  # torch's "scheduler.step() before optimizer.step()": not the user's order
            for _ in range(max(0, count)):
                scheduler.step()


def advance_schedulers(scheduler_configs: Sequence[Any], global_step: int, current_epoch: int) -> None:
    """Step freshly built schedulers to the current optimizer step (``interval="step"``) or epoch, every
    ``frequency`` of them; ``ReduceLROnPlateau`` schedulers are left alone. ``scheduler_configs``: Lightning's
    ``LRSchedulerConfig``. (A level change uses :func:`continue_schedulers`, which counts the old schedulers' own
    steps; this is its fallback.)"""
    for cfg in scheduler_configs:
        if cfg.reduce_on_plateau or is_timm_scheduler(cfg.scheduler):
            continue
        count = global_step if cfg.interval == "step" else current_epoch
        with unshown_warnings():  # torch's "scheduler.step() before optimizer.step()": not the user's order
            for _ in range(count // max(1, cfg.frequency)):
                cfg.scheduler.step()
