"""Curriculum difficulty schedules (DeepSpeed Data Efficiency), as pure functions of the curriculum step. The method
card is ``lightning_effi/curriculum/README.md``.

Reference: ``deepspeed/runtime/data_pipeline/curriculum_scheduler.py`` (``CurriculumScheduler``). Config keys are
DeepSpeed's: ``schedule_type`` one of ``fixed_linear``, ``fixed_root``, ``fixed_discrete``, ``custom``;
``schedule_config`` with ``total_curriculum_step``, ``difficulty_step``, ``root_degree`` (root/linear) or
``difficulty``, ``max_step`` (discrete).

Rounding modes, which only differ in how the rounded value is bounded:

- ``"deepspeed"``: current DeepSpeed (0.19.x, PR #8334): floor to an absolute multiple of ``difficulty_step``, raise
  to the first multiple at or above ``min_difficulty``, cap at ``max_difficulty``.
- ``"deepspeed_legacy"``: DeepSpeed before PR #8334: no lower bound (a schedule can start at 0).
- ``"clamped"`` (default): ``max(d, min_difficulty)`` after rounding and ``max_difficulty`` for every step
  ``>= total_curriculum_step`` (so a ``max_difficulty`` that is not a multiple of the step is still reached).

DeepSpeed's update rule is :func:`update_difficulty`: the value freezes once ``max_difficulty`` is reached.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_effi.core.checks import check_int, check_list, check_non_decreasing, is_int

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")
ROUNDING_MODES = ("clamped", "deepspeed", "deepspeed_legacy")
#: ``schedule_config`` keys per schedule type (all required)
SCHEDULE_KEYS: dict[str, tuple[str, ...]] = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),
}


class ScheduleConfigError(ValueError):
    """A curriculum schedule configuration that cannot run (unknown type, missing/unknown keys, bad values)."""


def _int(where: str, key: str, value: Any, minimum: int | None = None) -> int:
    if not is_int(value):
        raise ScheduleConfigError(f"{where}.{key} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ScheduleConfigError(f"{where}.{key} must be >= {minimum}, got {value}")
    return int(value)


@dataclass(frozen=True)
class CurriculumSchedule:
    """One metric's difficulty schedule (DeepSpeed ``CurriculumScheduler``).

    Args:
        schedule_type: ``fixed_linear`` | ``fixed_root`` | ``fixed_discrete`` | ``custom``.
        min_difficulty, max_difficulty: ints, ``min <= max``; ``min`` is the value before the first update.
        schedule_config: the DeepSpeed ``schedule_config`` dict (not mutated; copied). Keys per type in
            :data:`SCHEDULE_KEYS`; unknown keys raise.
        rounding: ``clamped`` (default) | ``deepspeed`` | ``deepspeed_legacy`` (module docstring).
        custom_fn: for ``custom`` only: ``fn(step: int) -> int`` (required; Hydra: a ``_partial_: true`` target).
        name: the metric name, used in error messages.

    Raises:
        ScheduleConfigError: unknown type or rounding, missing/unknown ``schedule_config`` keys, non-int or
            non-positive values, ``min_difficulty > max_difficulty``, ``fixed_discrete`` lists of wrong lengths,
            not strictly ascending ``max_step`` or difficulties outside ``[min, max]``, ``custom`` without a
            callable.
    """

    schedule_type: str
    min_difficulty: int
    max_difficulty: int
    schedule_config: Mapping[str, Any] = field(default_factory=dict)
    rounding: str = "clamped"
    custom_fn: Callable[[int], int] | None = None
    name: str = "metric"

    def __post_init__(self) -> None:
        where = f"curriculum_metrics.{self.name}"
        if self.schedule_type not in SCHEDULE_TYPES:
            raise ScheduleConfigError(
                f"{where}.schedule_type must be one of {SCHEDULE_TYPES}, got {self.schedule_type!r}"
            )
        if self.rounding not in ROUNDING_MODES:
            raise ScheduleConfigError(f"curriculum rounding must be one of {ROUNDING_MODES}, got {self.rounding!r}")
        lo = _int(where, "min_difficulty", self.min_difficulty)
        hi = _int(where, "max_difficulty", self.max_difficulty)
        if lo > hi:
            raise ScheduleConfigError(f"{where}: min_difficulty ({lo}) > max_difficulty ({hi})")
        object.__setattr__(self, "min_difficulty", lo)
        object.__setattr__(self, "max_difficulty", hi)
        cfg = dict(self.schedule_config or {})
        object.__setattr__(self, "schedule_config", cfg)
        needed = SCHEDULE_KEYS[self.schedule_type]
        unknown = sorted(set(cfg) - set(needed))
        if unknown and not needed:  # custom: the function is the schedule
            raise ScheduleConfigError(
                f"{where}.schedule_config: schedule_type {self.schedule_type!r} reads no schedule_config (its "
                f"function is the schedule), got the key(s) {unknown}; remove schedule_config"
            )
        if unknown:
            raise ScheduleConfigError(
                f"{where}.schedule_config: unknown key(s) {unknown} for schedule_type "
                f"{self.schedule_type!r}; allowed: {list(needed)}"
            )
        missing = [k for k in needed if k not in cfg]
        if missing:
            raise ScheduleConfigError(
                f"{where}.schedule_config: missing key(s) {missing} for schedule_type {self.schedule_type!r}"
            )
        sc = f"{where}.schedule_config"
        if self.schedule_type in ("fixed_linear", "fixed_root"):
            for key in SCHEDULE_KEYS[self.schedule_type]:
                cfg[key] = _int(sc, key, cfg[key], 1)
        elif self.schedule_type == "fixed_discrete":
            diff, steps = check_discrete(cfg["difficulty"], cfg["max_step"], sc)
            for i, d in enumerate(diff):
                if not lo <= d <= hi:
                    raise ScheduleConfigError(
                        f"{sc}.difficulty[{i}] = {d} is outside [min_difficulty, max_difficulty] = [{lo}, {hi}]"
                    )
            cfg["difficulty"], cfg["max_step"] = diff, steps
        else:  # custom
            if not callable(self.custom_fn):
                raise ScheduleConfigError(
                    f"{where}: schedule_type 'custom' needs a callable custom_fn(step) -> int at construction "
                    "(Hydra: a target with _partial_: true)"
                )

    @property
    def difficulty_step(self) -> int:
        return int(self.schedule_config.get("difficulty_step", 1))

    def __call__(self, step: int) -> int:
        """The schedule's difficulty at curriculum step ``step`` (>= 0), before the freeze rule.

        Raises:
            ScheduleConfigError: ``step`` is not an int >= 0; a ``custom`` function's value is not an int or (with
                ``rounding="clamped"``) outside ``[min_difficulty, max_difficulty]``.
        """
        if not is_int(step) or step < 0:  # the configuration was checked at construction: O(1) per step
            raise ScheduleConfigError(f"curriculum_metrics.{self.name}: step must be an int >= 0, got {step!r}")
        cfg = self.schedule_config
        lo, hi = self.min_difficulty, self.max_difficulty
        t = self.schedule_type
        if t in ("fixed_linear", "fixed_root"):
            total, q = cfg["total_curriculum_step"], cfg["difficulty_step"]
            k = cfg["root_degree"] if t == "fixed_root" else 1
            return _root(int(step), lo, hi, total, q, k, self.rounding)
        if t == "fixed_discrete":
            return _discrete(int(step), cfg["difficulty"], cfg["max_step"])
        value = self.custom_fn(step)  # type: ignore[misc]
        if hasattr(value, "item"):
            value = value.item()
        if not is_int(value):
            raise ScheduleConfigError(
                f"curriculum_metrics.{self.name}: custom schedule returned {value!r} at step "
                f"{step}; it must return an int"
            )
        if self.rounding == "clamped" and not lo <= value <= hi:
            raise ScheduleConfigError(
                f"curriculum_metrics.{self.name}: custom schedule returned {value} at step "
                f"{step}, outside [min_difficulty, max_difficulty] = [{lo}, {hi}]"
            )
        return int(value)

    def update(self, current: int, step: int) -> int:
        """DeepSpeed's update rule: ``current`` if it already reached ``max_difficulty``, else the value at
        ``step``."""
        return update_difficulty(current, self.max_difficulty, lambda: self(step))


def root_difficulty(
    step: int,
    min_difficulty: int,
    max_difficulty: int,
    total_curriculum_step: int,
    difficulty_step: int,
    root_degree: int = 1,
    rounding: str = "clamped",
) -> int:
    """``fixed_root`` (``fixed_linear`` with ``root_degree=1``; DeepSpeed ``__fixed_root_get_difficulty``,
    ``deepspeed/runtime/data_pipeline/curriculum_scheduler.py``).

    ``d = floor((s/T)^(1/k)·(max−min) + min)``, ``d −= d mod q``, then the rounding mode's lower bound, then
    ``min(d, max)``. The arithmetic (float64, same order of operations) is DeepSpeed's, so the ``deepspeed`` modes
    reproduce its values exactly.

    Args:
        step: the curriculum step ``s`` (an int >= 0; optimizer steps, the first global batch is step 1).
        min_difficulty, max_difficulty: ints, ``min <= max`` (tokens for ``seqlen_*``, else the metric's unit).
        total_curriculum_step: ``T``, the step at which the schedule reaches ``max`` (an int >= 1).
        difficulty_step: ``q``, difficulties are multiples of it (an int >= 1).
        root_degree: ``k`` (an int >= 1; 1 is ``fixed_linear``).
        rounding: one of :data:`ROUNDING_MODES` (module docstring).

    Returns:
        the difficulty, an int in ``[min, max]`` (``deepspeed_legacy``: possibly below ``min``).

    Raises:
        ScheduleConfigError: (a ``ValueError``) naming the argument: a ``step`` that is not an int >= 0, a
            ``total_curriculum_step`` / ``difficulty_step`` / ``root_degree`` that is not an int >= 1 (each would
            divide by zero), ``min_difficulty`` / ``max_difficulty`` that are not ints or with ``min > max``, an
            unknown ``rounding``. The checks are O(1); :class:`CurriculumSchedule` validates its configuration once
            and skips them on every step.
    """
    where, err = "root_difficulty", ScheduleConfigError
    step = check_int(where, "step", step, 0, error=err)
    lo = check_int(where, "min_difficulty", min_difficulty, error=err)
    hi = check_int(where, "max_difficulty", max_difficulty, error=err)
    if lo > hi:
        raise ScheduleConfigError(f"{where}: min_difficulty ({lo}) must be <= max_difficulty ({hi})")
    total = check_int(where, "total_curriculum_step", total_curriculum_step, 1, error=err)
    q = check_int(where, "difficulty_step", difficulty_step, 1, error=err)
    k = check_int(where, "root_degree", root_degree, 1, error=err)
    if rounding not in ROUNDING_MODES:
        raise ScheduleConfigError(f"{where}.rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
    return _root(step, lo, hi, total, q, k, rounding)


def _root(step: int, lo: int, hi: int, total: int, q: int, k: int, rounding: str) -> int:
    """:func:`root_difficulty` on validated arguments (the per-step path of :class:`CurriculumSchedule`)."""
    ratio = (float(step) / total) ** (1.0 / k)
    d = math.floor(ratio * (hi - lo) + lo)
    d -= d % q
    if rounding == "deepspeed":
        d = max(d, -(-lo // q) * q)
    elif rounding == "clamped":
        d = max(d, lo)
        if step >= total:
            d = hi
    return int(min(d, hi))


def check_discrete(
    difficulty: Any, max_step: Any, owner: str = "discrete_difficulty", error: type[Exception] = ScheduleConfigError
) -> tuple[list[int], list[int]]:
    """``(difficulty, max_step)`` of a ``fixed_discrete`` schedule as lists of ints, checked as DeepSpeed's
    ``CurriculumScheduler`` asserts them: both non-empty, ``len(max_step) == len(difficulty) - 1`` (the last
    difficulty holds after the last ``max_step``), ints, ``max_step`` entries ``>= 0`` and strictly ascending.

    Raises:
        ScheduleConfigError: (or ``error``) naming the argument (``<owner>.difficulty`` / ``<owner>.max_step``) and
            what is allowed.
    """
    diff = check_list(owner, "difficulty", difficulty, what="ints (one per stage)", error=error)
    steps = check_list(owner, "max_step", max_step, what="ints (the last step of each stage but the last)", error=error)
    if not diff or not steps or len(steps) != len(diff) - 1:
        raise error(
            f"{owner}: difficulty and max_step must be non-empty lists with len(difficulty) == len(max_step) + 1 "
            f"(the last difficulty holds after the last max_step; DeepSpeed fixed_discrete), got {len(diff)} "
            f"difficulties {diff!r} and {len(steps)} max_steps {steps!r}"
        )
    diff = [check_int(owner, f"difficulty[{i}]", d, error=error) for i, d in enumerate(diff)]
    steps = [check_int(owner, f"max_step[{i}]", m, 0, error=error) for i, m in enumerate(steps)]
    check_non_decreasing(owner, "max_step", steps, strict=True, error=error)
    return diff, steps


def discrete_difficulty(step: int, difficulty: Sequence[int], max_step: Sequence[int]) -> int:
    """``fixed_discrete`` (DeepSpeed ``__fixed_discrete_get_difficulty``,
    ``deepspeed/runtime/data_pipeline/curriculum_scheduler.py``): ``difficulty[n]`` after the last ``max_step``,
    else ``difficulty[i]`` for the first ``i`` with ``step <= max_step[i]``.

    Args:
        step: the curriculum step (an int >= 0).
        difficulty: ``n + 1`` ints, one per stage. max_step: ``n >= 1`` strictly ascending ints >= 0, the last step
            of each stage but the last.

    Raises:
        ScheduleConfigError: (a ``ValueError``) naming the argument: a ``step`` that is not an int >= 0, empty lists,
            ``len(max_step) != len(difficulty) - 1``, non-int entries, a ``max_step`` that is negative or not strictly
            ascending (:func:`check_discrete`; O(n) per call: :class:`CurriculumSchedule` checks its lists once).
    """
    step = check_int("discrete_difficulty", "step", step, 0, error=ScheduleConfigError)
    diff, steps = check_discrete(difficulty, max_step)
    return _discrete(step, diff, steps)


def _discrete(step: int, difficulty: Sequence[int], max_step: Sequence[int]) -> int:
    """:func:`discrete_difficulty` on validated arguments."""
    if step > max_step[-1]:
        return int(difficulty[-1])
    for i, m in enumerate(max_step):
        if step <= m:
            return int(difficulty[i])
    raise AssertionError("unreachable")  # pragma: no cover


def update_difficulty(current: int, max_difficulty: int, compute: Callable[[], int]) -> int:
    """DeepSpeed's ``update_difficulty``: freeze at ``max_difficulty``, else take the computed value."""
    return current if current >= max_difficulty else int(compute())


def reach_step(schedule: CurriculumSchedule, difficulty: int, limit: int = 2**40) -> int | None:
    """The first curriculum step ``s >= 1`` at which ``schedule`` gives at least ``difficulty`` (an exponential then
    binary search: O(log s) evaluations, the schedules ``fixed_linear`` / ``fixed_root`` / ``fixed_discrete`` being
    non-decreasing in the step; ``fixed_discrete`` lists are checked non-decreasing by
    :meth:`~lightning_effi.curriculum.MetricConfig.schedule`). ``None`` for a ``custom`` schedule (any shape), or
    when no step up to ``limit`` reaches it."""
    if schedule.schedule_type == "custom":
        return None
    hi = 1
    while schedule(hi) < difficulty:
        if hi >= limit:
            return None
        hi *= 2
    lo = hi // 2 + 1 if hi > 1 else 1  # schedule(hi // 2) < difficulty (or hi == 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if schedule(mid) >= difficulty:
            hi = mid
        else:
            lo = mid + 1
    return hi


def difficulties(schedule: CurriculumSchedule, steps: Sequence[int] | range) -> list[int]:
    """The values a fresh scheduler holds after ``update(s)`` for each ``s`` in ``steps`` (in order), starting from
    ``min_difficulty``: the sequence the sampler sees."""
    current, out = schedule.min_difficulty, []
    for s in steps:
        current = schedule.update(current, s)
        out.append(current)
    return out
