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

from lightning_effi.core.checks import is_int

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
            diff, steps = cfg["difficulty"], cfg["max_step"]
            if (
                not isinstance(diff, Sequence)
                or isinstance(diff, str)
                or not isinstance(steps, Sequence)
                or isinstance(steps, str)
            ):
                raise ScheduleConfigError(f"{sc}: difficulty and max_step must be lists of ints")
            if len(diff) == 0 or len(steps) == 0 or len(diff) != len(steps) + 1:
                raise ScheduleConfigError(
                    f"{sc}: fixed_discrete needs non-empty lists with len(difficulty) == len(max_step) + 1; got "
                    f"{len(diff)} difficulties and {len(steps)} max_steps"
                )
            for i, d in enumerate(diff):
                _int(sc, f"difficulty[{i}]", d)
                if not lo <= d <= hi:
                    raise ScheduleConfigError(
                        f"{sc}.difficulty[{i}] = {d} is outside [min_difficulty, max_difficulty] = [{lo}, {hi}]"
                    )
            for i, m in enumerate(steps):
                _int(sc, f"max_step[{i}]", m, 0)
            if any(b <= a for a, b in zip(steps, steps[1:])):
                raise ScheduleConfigError(f"{sc}.max_step must be strictly ascending, got {list(steps)}")
            cfg["difficulty"], cfg["max_step"] = [int(d) for d in diff], [int(m) for m in steps]
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
        """The schedule's difficulty at curriculum step ``step`` (>= 0), before the freeze rule."""
        cfg = self.schedule_config
        lo, hi = self.min_difficulty, self.max_difficulty
        t = self.schedule_type
        if t in ("fixed_linear", "fixed_root"):
            total, q = cfg["total_curriculum_step"], cfg["difficulty_step"]
            k = cfg["root_degree"] if t == "fixed_root" else 1
            return root_difficulty(step, lo, hi, total, q, k, self.rounding)
        if t == "fixed_discrete":
            return discrete_difficulty(step, cfg["difficulty"], cfg["max_step"])
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
    """``fixed_root`` (``fixed_linear`` with ``root_degree=1``; DeepSpeed ``__fixed_root_get_difficulty``).

    ``d = floor((s/T)^(1/k)·(max−min) + min)``, ``d −= d mod q``, then the rounding mode's lower bound, then
    ``min(d, max)``. The arithmetic (float64, same order of operations) is DeepSpeed's, so the ``deepspeed`` modes
    reproduce its values exactly.
    """
    if rounding not in ROUNDING_MODES:
        raise ScheduleConfigError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
    ratio = (float(step) / total_curriculum_step) ** (1.0 / root_degree)
    d = math.floor(ratio * (max_difficulty - min_difficulty) + min_difficulty)
    d -= d % difficulty_step
    if rounding == "deepspeed":
        d = max(d, -(-min_difficulty // difficulty_step) * difficulty_step)
    elif rounding == "clamped":
        d = max(d, min_difficulty)
        if step >= total_curriculum_step:
            d = max_difficulty
    return int(min(d, max_difficulty))


def discrete_difficulty(step: int, difficulty: Sequence[int], max_step: Sequence[int]) -> int:
    """``fixed_discrete`` (DeepSpeed ``__fixed_discrete_get_difficulty``): ``difficulty[n]`` after the last
    ``max_step``, else the first ``i`` with ``step <= max_step[i]``."""
    if step > max_step[-1]:
        return int(difficulty[-1])
    for i, m in enumerate(max_step):
        if step <= m:
            return int(difficulty[i])
    raise AssertionError("unreachable")  # pragma: no cover


def update_difficulty(current: int, max_difficulty: int, compute: Callable[[], int]) -> int:
    """DeepSpeed's ``update_difficulty``: freeze at ``max_difficulty``, else take the computed value."""
    return current if current >= max_difficulty else int(compute())


def difficulties(schedule: CurriculumSchedule, steps: Sequence[int] | range) -> list[int]:
    """The values a fresh scheduler holds after ``update(s)`` for each ``s`` in ``steps`` (in order), starting from
    ``min_difficulty``: the sequence the sampler sees."""
    current, out = schedule.min_difficulty, []
    for s in steps:
        current = schedule.update(current, s)
        out.append(current)
    return out
