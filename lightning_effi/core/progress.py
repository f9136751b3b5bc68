"""Training progress, from one source, and one :class:`Duration` type for every length a technique is given.

A duration is a number and a unit (Composer's ``Time``: ``"10ep"``, ``"100ba"``, ``"0.5dur"``):

======================  =========================  ==============================================================
written                 unit                       resolves to optimizer steps as
======================  =========================  ==============================================================
``500``, ``"500st"``    ``step`` (optimizer steps)  ``500``
``"2ep"``               ``epoch``                  ``2 * steps_per_epoch`` (a switch falls on an epoch boundary)
``"0.3dur"``            ``fraction`` of the run     ``floor(0.3 * total_steps)``
``"1e6tok"``            ``token``                   ``ceil(1e6 / tokens_per_step)``
======================  =========================  ==============================================================

A Python ``int`` is steps; a ``float`` is refused (``0.3`` could mean a fraction or 0.3 steps): write ``"0.3dur"``
or ``Duration(0.3, "fraction")``. DeepSpeed config keys (``total_curriculum_step``, random-LTD's ``require_steps``)
keep their meaning: an int is a step count, exactly as DeepSpeed spells it.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, get_args

from lightning_effi.core.checks import check_int, is_int, is_real
from lightning_effi.core.protocols import ProvidesProgress, ProvidesProgressClock

__all__ = [
    "EXACT_DENOMINATOR",
    "PROGRESS_TICKS",
    "UNITS",
    "Duration",
    "accumulate_grad_batches_at",
    "accumulation_changes",
    "accumulation_scheduler",
    "accumulation_segments",
    "estimated_optimizer_steps",
    "progress_clock",
    "progress_source",
    "clock_epochs",
    "step_progress",
    "BatchesPerStep",
    "StepsPerBatchCheck",
    "batch_resolved_durations",
    "progress_ticks",
    "exact_progress_done",
    "run_length",
    "shorter_than_resolved",
    "steps_of_epochs",
    "steps_per_epoch",
    "training_progress",
]

Unit = Literal["step", "epoch", "fraction", "token"]
UNITS: tuple[str, ...] = get_args(Unit)
#: per unit: its suffix when written, an example, and the values it takes
_UNIT_SUFFIX = {"step": "st", "epoch": "ep", "fraction": "dur", "token": "tok"}
_EXAMPLES = {"step": "500st", "epoch": "2ep", "fraction": "0.3dur", "token": "1e6tok"}
_DOMAIN = {"step": "an int >= 0", "epoch": "an int >= 0", "fraction": "a number in [0, 1]", "token": "a number > 0"}
_SUFFIX = {**{s: u for u, s in _UNIT_SUFFIX.items()}, "ba": "step"}  # "ba" (batches): Composer's spelling
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(st|ba|ep|dur|tok)\s*$")


@dataclass(frozen=True)
class Duration:
    """A length of training: ``value`` in ``unit``.

    ``step`` and ``epoch`` values are ints >= 0, ``fraction`` values are in [0, 1], ``token`` values are > 0.

    Raises:
        ValueError: (construction) an unknown unit or a value outside its unit's domain.
    """

    value: int | float  # int first: a config parser (jsonargparse) keeps a step count an int
    unit: Unit = "step"

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"Duration.unit must be one of {UNITS}, got {self.unit!r}")
        v = self.value
        # numpy scalars become plain numbers, so the repr evaluates and the checkpoint holds plain values
        if is_int(v) and self.unit in ("step", "epoch"):
            object.__setattr__(self, "value", v := int(v))
        elif is_real(v) and self.unit in ("fraction", "token"):
            object.__setattr__(self, "value", v := float(v))
        if self.unit in ("step", "epoch"):
            ok = is_int(v) and v >= 0
        elif self.unit == "fraction":
            ok = is_real(v) and 0 <= v <= 1
        else:
            ok = is_real(v) and v > 0
        if not ok:
            domain = _DOMAIN[self.unit]
            raise ValueError(f"a duration in {self.unit}s must be {domain}, got {v!r}")

    @classmethod
    def parse(cls, value: Any, name: str = "duration", units: tuple[str, ...] = UNITS) -> Duration:
        """A :class:`Duration` from an int (steps), a string such as ``"2ep"`` / ``"0.3dur"`` / ``"500st"`` /
        ``"1e6tok"``, or a Duration. ``units``: the units the caller accepts, named in the error messages (a caller
        refuses the others itself, with its own reason).

        Raises:
            ValueError: naming ``name``: a float, a bool, an unknown suffix or a value outside the unit's domain.
        """
        examples = ", ".join(repr(e) for u, e in _EXAMPLES.items() if u in units)
        if isinstance(value, Duration):
            return value
        if is_int(value):
            if value < 0:
                raise ValueError(f"{name} must be >= 0 optimizer steps, got {value!r}")
            return cls(int(value), "step")
        if isinstance(value, str):
            m = _PATTERN.match(value)
            if m is None:
                raise ValueError(
                    f"{name}: cannot read {value!r} as a duration; write an int (optimizer steps) or a "
                    f"number with a unit: {examples}"
                )
            number, unit = m.group(1), _SUFFIX[m.group(2)]
            if not math.isfinite(float(number)):
                raise ValueError(f"{name}: {value!r} is too large to be a duration")
            if unit in ("step", "epoch"):
                f = float(number)
                if not f.is_integer():
                    raise ValueError(f"{name}: {unit}s must be whole, got {value!r}")
                return cls._checked(int(f), unit, name)
            return cls._checked(float(number), unit, name)
        raise ValueError(f"{name} must be an int (optimizer steps) or a string with a unit ({examples}), got {value!r}")

    @classmethod
    def _checked(cls, value: float, unit: str, name: str) -> Duration:
        try:
            return cls(value, unit)  # type: ignore[arg-type]
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None

    def to_steps(
        self,
        steps_per_epoch: int | None = None,
        total_steps: float | None = None,
        tokens_per_step: float | None = None,
        name: str = "duration",
        rounding: Literal["floor", "ceil"] = "floor",
    ) -> int:
        """Optimizer steps of this duration.

        Args:
            steps_per_epoch: optimizer steps of one epoch (needed for ``epoch``).
            total_steps: optimizer steps of the whole run (needed for ``fraction``).
            tokens_per_step: tokens of one optimizer step (needed for ``token``).
            name: the argument's name, for the error message.
            rounding: how a ``fraction`` of the run rounds to whole steps (``token`` durations always round up).

        Raises:
            ValueError: the quantity the unit needs is unknown (None, or not finite), negative, or the result does
                not fit in an int.
        """
        for what, v in (("steps_per_epoch", steps_per_epoch), ("total_steps", total_steps)):
            # None or inf: unknown (an error below only if the unit needs it)
            if v is not None and v != math.inf and not (is_real(v) and v >= 0):
                raise ValueError(f"{name}: {what} must be a number >= 0, got {v!r}")
        if tokens_per_step is not None and not (is_real(tokens_per_step) and tokens_per_step > 0):
            raise ValueError(f"{name}: tokens_per_step must be a finite number > 0, got {tokens_per_step!r}")
        try:
            return self._steps(steps_per_epoch, total_steps, tokens_per_step, name, rounding)
        except OverflowError:
            raise ValueError(f"{name}={self} is too large to count in optimizer steps") from None

    def _steps(
        self,
        steps_per_epoch: int | None,
        total_steps: float | None,
        tokens_per_step: float | None,
        name: str,
        rounding: str,
    ) -> int:
        if self.unit == "step":
            return int(self.value)
        if self.unit == "epoch":
            if steps_per_epoch is None or not math.isfinite(steps_per_epoch):
                raise ValueError(
                    f"{name}={self} is in epochs, but the epoch length in optimizer steps is unknown "
                    "(a train dataloader without a length?)"
                )
            return int(self.value) * int(steps_per_epoch)
        if self.unit == "fraction":
            if total_steps is None or not math.isfinite(total_steps):
                raise ValueError(
                    f"{name}={self} is a fraction of the run, but the run's length is unknown: set "
                    "trainer.max_steps or trainer.max_epochs"
                )
            steps = float(self.value) * int(total_steps)
            return math.ceil(steps) if rounding == "ceil" else math.floor(steps)
        if tokens_per_step is None or not tokens_per_step > 0:
            raise ValueError(f"{name}={self} is in tokens, but the tokens per optimizer step are unknown")
        return math.ceil(float(self.value) / tokens_per_step)

    def __str__(self) -> str:
        """The parseable spelling, exact: ``"2ep"``, ``"0.123456789dur"``, ``"1000000tok"``."""
        suffix = _UNIT_SUFFIX[self.unit]
        v = self.value
        text = str(int(v)) if is_int(v) or float(v).is_integer() else repr(float(v))
        return f"{text}{suffix}"


def progress_source(callbacks: Iterable[Any]) -> Callable[[], float] | None:
    """``effi_progress`` of the first callback that provides one (a technique that changes the epoch length, so
    ``trainer.estimated_stepping_batches`` is not the run's length); None when no callback does."""
    for callback in callbacks:
        if isinstance(callback, ProvidesProgress) and callable(callback.effi_progress):
            return callback.effi_progress
    return None


def clock_epochs(source: Any, trainer: Any) -> float | None:
    """The epochs a progress clock's progress runs over, by which an epoch count of another technique on it is a
    share (``"2ep"`` is ``2 / E``): the clock's ``effi_clock_epochs()`` when it has one (InfoBatch's ``num_epochs``,
    after which it trains on the full data and its progress stays at 1), else ``trainer.max_epochs`` (None or
    infinite when unset). ``"1ep"`` on InfoBatch with ``num_epochs=2`` and ``max_epochs=4`` was a quarter of the
    clock's two epochs, half an epoch (qa86-break 11)."""
    read = getattr(source, "effi_clock_epochs", None)
    if callable(read):
        epochs = read()
        if is_int(epochs) and epochs >= 1:
            return int(epochs)
    return trainer.max_epochs  # type: ignore[no-any-return]


def step_progress(trainer: Any, total_steps: int | None = None) -> Callable[[], float]:
    """A plain run's training progress after the next optimizer step, ``(trainer.global_step + 1) / T`` with ``T =
    total_steps`` or ``trainer.estimated_stepping_batches`` (read at the first call, in ``configure_optimizers``
    or later): the convention of a technique's ``effi_progress`` (step ``k`` of ``T`` trains at the schedule's
    value at ``(k + 1) / T``, as ``warmup_cosine(total_steps=T)``), so that one progress-based schedule built on
    ``progress_source(trainer.callbacks) or step_progress(trainer)`` trains the same LR at every step in a plain arm
    and in a technique arm that changes nothing (a torch scheduler reads ``k / T``: the technique arm ran one step
    ahead of it, qa86-user 01). Past ``T`` the progress exceeds 1; the schedules of
    :mod:`lightning_effi.core.lr_schedules` clamp it.

    Raises:
        ValueError: ``total_steps`` not None or an int >= 1; (at the call) a run of no finite length
            (``estimated_stepping_batches`` infinite: pass ``total_steps``).
    """
    if total_steps is not None:
        check_int("step_progress", "total_steps", total_steps, 1)
    length: list[int] = [] if total_steps is None else [int(total_steps)]

    def progress() -> float:
        if not length:
            estimate = trainer.estimated_stepping_batches
            if not math.isfinite(estimate) or estimate < 1:
                raise ValueError(
                    f"step_progress: the run has no finite length (estimated_stepping_batches={estimate}); pass "
                    "total_steps=<the run's optimizer steps>"
                )
            length.append(int(estimate))
        return (int(trainer.global_step) + 1) / length[0]

    return progress


def progress_clock(callbacks: Iterable[Any]) -> ProvidesProgressClock | None:
    """The first callback that provides the run's clock (:class:`~lightning_effi.core.protocols.ProvidesProgressClock`:
    ``effi_progress``, ``effi_progress_done`` and ``effi_min_total_steps``), a technique that changes the epoch
    length; None when none does (a callback with ``effi_progress`` only, such as the Curriculum's token progress,
    is not a clock: its run is as long as its optimizer steps say)."""
    for callback in callbacks:
        if isinstance(callback, ProvidesProgressClock) and all(
            callable(getattr(callback, name, None))
            for name in ("effi_progress", "effi_progress_done", "effi_min_total_steps")
        ):
            return callback
    return None


#: progress in [0, 1] read as an integer clock: ``progress_ticks(p) = round(p · PROGRESS_TICKS)``
PROGRESS_TICKS = 10**9


def progress_ticks(progress: float) -> int:
    """``progress`` in [0, 1] as integer ticks of :data:`PROGRESS_TICKS` (1 tick = 1e-9 of the run; a run's step is
    far longer), so that stage ends and checkpoints stay integers: ``round(p · 10⁹)``.

    >>> progress_ticks(0.3), progress_ticks(1 / 3), progress_ticks(1.0)
    (300000000, 333333333, 1000000000)

    Raises:
        ValueError: ``progress`` is not a number in [0, 1] (a progress source out of its range is a bug to report,
            not a value to clamp).
    """
    if not (is_real(progress) and 0.0 <= float(progress) <= 1.0):
        raise ValueError(f"training progress must be a number in [0, 1], got {progress!r}")
    return round(float(progress) * PROGRESS_TICKS)


#: the largest denominator :func:`exact_progress_done` recovers from a clock that gives floats only (runs of up to
#: 2²⁵ optimizer steps: the float of ``(e + j / L) / E`` is within 3.3e-16 of it, closer than any other fraction of
#: denominator <= 2²⁵, so ``Fraction(p).limit_denominator(2**25)`` is that fraction exactly)
EXACT_DENOMINATOR = 2**25


def exact_progress_done(clock: Any) -> Fraction:
    """The progress after the optimizer steps taken, as an exact fraction in [0, 1], from a progress clock
    (:class:`~lightning_effi.core.protocols.ProvidesProgressClock`): its ``effi_progress_done_exact()`` where it has
    one (InfoBatch: ``(e·L_e + j) / (E·L_e)`` in whole numbers), else its float ``effi_progress_done()`` read as the
    nearest fraction of denominator <= :data:`EXACT_DENOMINATOR` (exact for a progress ``k / n`` with ``n <= 2²⁵``,
    and within the float's own error of the progress otherwise). A schedule proportional to ``p / f`` then reaches a
    boundary ``p = f`` at the step that reaches it, where ticks (:func:`progress_ticks`) round both ``p`` and ``f``.

    >>> class Clock:
    ...     def effi_progress_done(self):
    ...         return (1 + 2 / 3) / 5
    >>> exact_progress_done(Clock())
    Fraction(1, 3)

    Raises:
        ValueError: the clock's progress is not a number in [0, 1].
    """
    exact = getattr(clock, "effi_progress_done_exact", None)
    value = exact() if callable(exact) else clock.effi_progress_done()
    if isinstance(value, Fraction) or is_int(value):
        progress = Fraction(value)
    elif is_real(value) and math.isfinite(float(value)):
        progress = Fraction(float(value)).limit_denominator(EXACT_DENOMINATOR)
    else:  # a tensor, None, a string: the protocol's progress is a Python float (a tensor was told "out of range")
        raise ValueError(
            f"{type(clock).__name__}'s training progress must be a float in [0, 1] (ProvidesProgressClock), got "
            f"{type(value).__name__} {value!r:.80}"
        )
    if not 0 <= progress <= 1:
        raise ValueError(
            f"{type(clock).__name__}'s training progress must be a number in [0, 1], got {value!r} (a progress clock "
            "out of its range is a bug to report, not a value to clamp)"
        )
    return progress


def training_progress(trainer: Any) -> float:
    """Training progress in [0, 1]: a technique's ``effi_progress`` where one changes the epoch length, else
    ``global_step / estimated_stepping_batches`` (0 when the length is unknown or infinite)."""
    source = progress_source(getattr(trainer, "callbacks", ()))
    if source is not None:
        return min(max(float(source()), 0.0), 1.0)
    total = trainer.estimated_stepping_batches
    if not total or not math.isfinite(total):
        return 0.0
    return min(float(trainer.global_step) / float(total), 1.0)


def batch_resolved_durations(trainer: Any, pl_module: Any, durations: dict[str, Duration]) -> dict[str, Duration]:
    """The durations of ``durations`` resolved from the batches while their schedule counts ``trainer.global_step``,
    where the two units can differ: under manual optimization (``global_step`` counts every ``optimizer.step()``: a
    GAN stepping its discriminator and its generator once a batch advances it by 2, one optimizer stepped every
    second batch, gradients accumulated by hand, by 1/2), the durations in epochs (an epoch is
    ``trainer.num_training_batches`` batches) and the fractions of a run whose length comes from the batches
    (``trainer.estimated_stepping_batches`` below ``max_steps``, or no ``max_steps``; a fraction of ``max_steps`` is
    in ``global_step``'s unit). Empty under automatic optimization. :class:`StepsPerBatchCheck` checks them against
    the first batches."""
    if getattr(pl_module, "automatic_optimization", True):
        return {}
    max_steps, estimated = getattr(trainer, "max_steps", -1), getattr(trainer, "estimated_stepping_batches", None)
    from_batches = max_steps in (-1, None) or (
        estimated is not None and math.isfinite(estimated) and int(estimated) < int(max_steps)
    )
    return {name: d for name, d in durations.items() if d.unit == "epoch" or (d.unit == "fraction" and from_batches)}


class BatchesPerStep:
    """How often a fit's optimizer steps, read off ``trainer.global_step`` over its first batches: the steps the first
    batch took when more than one (several optimizers stepped once a batch), or the batches between steps of one
    when more than one (one optimizer stepped every ``k`` batches: gradients accumulated by hand), read off the
    first three steps: two equal gaps (a NaN guard's skipped steps, once or twice in a row, give gaps that differ
    and say nothing, qa46-break 08, qa47-break 03). Call :meth:`batch_start` and :meth:`batch_end`
    in the training batch hooks; :meth:`batch_end` returns ``("steps", n)`` or ``("batches", k)`` once, when found,
    else None. Watches at most ``limit`` batches (``k`` up to ``limit / 3``).
    """

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self.done = False
        self._last: int | None = None
        self._batches = 0
        self._stepped_at: list[int] = []  # the batches (counted from 1) at whose end global_step moved by one

    def batch_start(self, trainer: Any) -> None:
        if not self.done and self._last is None:
            self._last = int(trainer.global_step)

    def batch_end(self, trainer: Any) -> tuple[str, int] | None:
        if self.done or self._last is None:
            return None
        now = int(trainer.global_step)
        moved, self._last = now - self._last, now
        self._batches += 1
        if moved > 1:
            self.done = True
            return ("steps", moved) if self._batches == 1 else None
        if moved == 1:
            self._stepped_at.append(self._batches)
        if len(self._stepped_at) == 2 and self._stepped_at[1] - self._stepped_at[0] == 1:
            self.done = True  # one step a batch
            return None
        if len(self._stepped_at) == 3:
            self.done = True
            first, second = (b - a for a, b in zip(self._stepped_at, self._stepped_at[1:]))
            return ("batches", first) if first == second > 1 else None
        if self._batches >= self.limit:
            self.done = True
        return None


class StepsPerBatchCheck:
    """The durations of :func:`batch_resolved_durations` checked against the optimizer steps the fit's first
    batches take (:class:`BatchesPerStep`): more than one a batch (each of several optimizers stepped once a batch)
    and the schedule would run that many times as fast; one every ``k`` batches (gradients accumulated by hand:
    random-LTD's ``"1ep"`` took two epochs and ended below ``max_value``, qa45-break 02) and it would run ``k`` times
    as slow: the fit is refused at the end of the batch that shows it (the third step's, for the latter).
    One a batch (optimizers stepped in turn) and the durations are right. ``arm`` in ``on_train_start``, then
    ``batch_start`` / ``batch_end`` in the training batch hooks.

    Raises:
        ValueError: (``batch_end``) naming the owner, the durations, the optimizer steps per batch and the fix.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.durations: dict[str, Duration] = {}
        self._watch = BatchesPerStep()

    def arm(self, trainer: Any, pl_module: Any, durations: dict[str, Duration]) -> None:
        self.durations, self._watch = batch_resolved_durations(trainer, pl_module, durations), BatchesPerStep()

    def batch_start(self, trainer: Any) -> None:
        if self.durations:
            self._watch.batch_start(trainer)

    def batch_end(self, trainer: Any) -> None:
        if not self.durations:
            return
        found = self._watch.batch_end(trainer)
        durations = self.durations
        if self._watch.done:
            self.durations = {}
        if found is None:
            return
        given = ", ".join(f"{name}={str(d)!r}" for name, d in durations.items())
        kind, n = found
        if kind == "steps":
            raise ValueError(
                f"{self.owner}: manual optimization stepped {n} optimizers in the first batch, so "
                f"trainer.global_step, which this schedule counts, advances {n} a batch, while {given} is resolved "
                "from the batches (an epoch, or the run's estimated_stepping_batches, counts a batch as one step): "
                f"the schedule would run {n} times as fast. Give it in optimizer steps as trainer.global_step counts "
                "them (an int: the epochs you mean x the batches of an epoch x the optimizer steps of a batch), or as "
                "a fraction of a run bounded by Trainer(max_steps=...)"
            )
        raise ValueError(
            f"{self.owner}: manual optimization stepped the optimizer once every {n} batches (gradients accumulated "
            f"by hand), so trainer.global_step, which this schedule counts, advances once every {n} batches, while "
            f"{given} is resolved from the batches (an epoch, or the run's estimated_stepping_batches, counts a batch "
            f"as one step): the schedule would run {n} times as slow. Give it in optimizer steps as "
            f"trainer.global_step counts them (an int: the epochs you mean x the batches of an epoch / {n}), or as a "
            "fraction of a run bounded by Trainer(max_steps=...)"
        )


def run_length(max_steps: int | None, estimated_steps: float | None = None) -> int | None:
    """Optimizer steps of the run: the smaller of ``max_steps`` (when > 0) and ``estimated_steps`` (Lightning's
    ``trainer.estimated_stepping_batches``, which counts ``max_epochs`` and ``limit_train_batches`` too; when finite
    and > 0); None when neither is known. With ``max_steps`` bounding the run both are ``max_steps``. A ``fraction``
    :class:`Duration` is a fraction of this.

    >>> run_length(100, 3.0), run_length(10), run_length(-1, 42.0), run_length(-1, float("inf"))
    (3, 10, 42, None)
    """
    known = [int(n) for n in (max_steps, estimated_steps) if n is not None and math.isfinite(n) and n > 0]
    return min(known) if known else None


def shorter_than_resolved(trainer: Any, resolved_against: int | None) -> str | None:
    """At the end of a fit, what to tell when it trained fewer optimizer steps than the run length a fraction was
    resolved against (:func:`run_length` at train start: Lightning's ``estimated_stepping_batches``), else None.
    That estimate is ``max_epochs x limit_train_batches`` for a loader without a length: a stream shorter than an int
    ``limit_train_batches`` ends each epoch sooner, and a schedule sized on the estimate ended unfinished, in silence
    (12 of 20 steps, qa57-loops 03). An early stop (``EarlyStopping``, ``max_time``) ends it sooner too."""
    step = int(getattr(trainer, "global_step", 0))
    if resolved_against is None or step >= resolved_against:
        return None
    from lightning.fabric.utilities.data import has_len

    loader = getattr(trainer, "train_dataloader", None)
    stream = loader is not None and not has_len(loader)
    if stream:
        why = (
            "the train dataloader has no length, so Lightning estimated the run as max_epochs x limit_train_batches "
            "batches, more than the stream gave; set Trainer(max_steps=...) to the steps the run has, or give the "
            "lengths in optimizer steps (ints)"
        )
    elif getattr(trainer, "should_stop", False):
        why = (
            "the run was stopped early (an EarlyStopping, max_time or should_stop); give the lengths in optimizer "
            "steps (ints) to keep them whatever the run's length"
        )
    else:
        why = (
            "Lightning's estimate of the run's optimizer steps, trainer.estimated_stepping_batches, was above the "
            "steps it ran; set Trainer(max_steps=...) or give the lengths in optimizer steps (ints)"
        )
    return (
        f"the run ended at step {step}, before the {resolved_against} optimizer steps its fractions of the run were "
        f"resolved against ({why})"
    )


def steps_per_epoch(num_training_batches: float, accumulate_grad_batches: int, what: str = "an epoch length") -> int:
    """Optimizer steps of one epoch: ``ceil(num_training_batches / accumulate_grad_batches)``, as Lightning's
    ``estimated_stepping_batches`` counts them (``limit_train_batches`` applies). An ``epoch`` :class:`Duration` is
    a multiple of this.

    Raises:
        ValueError: the number of batches is not finite and > 0 (a train dataloader without a length); ``what``
            names what needed it.
    """
    if not math.isfinite(num_training_batches) or num_training_batches <= 0:
        raise ValueError(
            f"{what} needs a train dataloader with a length (trainer.num_training_batches = "
            f"{num_training_batches}); give optimizer steps instead"
        )
    return math.ceil(int(num_training_batches) / accumulate_grad_batches)


def steps_of_epochs(epoch_steps: Callable[[int], int], epochs: int, start_step: int = 0) -> int:
    """Optimizer steps of ``epochs`` epochs from optimizer step ``start_step``, where epoch ``e`` (0-based) has
    ``epoch_steps(e)`` steps (:func:`steps_per_epoch` at that epoch's accumulation factor: a
    ``GradientAccumulationScheduler``'s epochs differ). A start inside an epoch continues from the same fraction of
    the epoch ``epochs`` later (rounded down), so one factor gives ``epochs * steps_per_epoch`` from anywhere.

    Raises:
        ValueError: ``epochs`` or ``start_step`` not an int >= 0, or an epoch of fewer than 1 step.

    >>> steps_of_epochs(lambda e: 5 if e == 0 else 3, 2)  # 5 batches, factors {0: 1, 1: 2}: epochs end at 5, 8
    8
    >>> steps_of_epochs(lambda e: 4, 2, start_step=2)
    8
    """
    epochs = check_int("steps_of_epochs", "epochs", epochs, minimum=0)
    start_step = check_int("steps_of_epochs", "start_step", start_step, minimum=0)

    def length(e: int) -> int:
        n = epoch_steps(e)
        if not is_int(n) or n < 1:
            raise ValueError(f"steps_of_epochs: epoch {e} has {n!r} optimizer steps, expected an int >= 1")
        return int(n)

    epoch, before = 0, 0  # the epoch holding start_step, and the steps of the epochs before it
    while before + length(epoch) <= start_step:
        before += length(epoch)
        epoch += 1
    into = Fraction(start_step - before, length(epoch))  # how far into its epoch the start lies
    end = before + sum(length(e) for e in range(epoch, epoch + epochs)) + into * length(epoch + epochs)
    return math.floor(end) - start_step


def accumulation_scheduler(callbacks: Iterable[Any]) -> Any | None:
    """The run's ``GradientAccumulationScheduler`` (Lightning's callback, or a subclass) among ``callbacks``; None
    when there is none."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    return next((c for c in callbacks if isinstance(c, GradientAccumulationScheduler)), None)


def accumulate_grad_batches_at(trainer: Any, epoch: int) -> int:
    """The gradient accumulation factor Lightning applies in ``epoch`` (0-based): the
    ``GradientAccumulationScheduler``'s factor for that epoch when the Trainer has one, else
    ``trainer.accumulate_grad_batches``.

    The scheduler sets ``trainer.accumulate_grad_batches`` only in ``on_train_epoch_start``: in ``setup``, in
    ``on_train_start`` and while an epoch's training loader is built (Lightning reloads it before
    ``on_train_epoch_start``) the Trainer still shows the previous epoch's factor (1 before the first epoch), so a
    technique that plans by the factor reads it here.
    """
    scheduler = accumulation_scheduler(getattr(trainer, "callbacks", ()))
    if scheduler is not None:
        return int(scheduler.get_accumulate_grad_batches(int(epoch)))
    return int(getattr(trainer, "accumulate_grad_batches", 1))


def accumulation_changes(trainer: Any) -> bool:
    """Whether the gradient accumulation factor changes during the run: the Trainer's
    ``GradientAccumulationScheduler`` gives more than one factor over the epochs ``0 .. max_epochs - 1`` (over all
    the epochs of its schedule when ``max_epochs`` is unbounded). A scheduler with one factor for the whole run (e.g.
    ``{0: 4}``) does not change it."""
    scheduler = accumulation_scheduler(getattr(trainer, "callbacks", ()))
    if scheduler is None:
        return False
    max_epochs = getattr(trainer, "max_epochs", None)
    starts = [int(e) for e in scheduler.scheduling]
    if max_epochs is not None and max_epochs >= 0:
        starts = [e for e in starts if e < max_epochs] or [0]
    return len({scheduler.get_accumulate_grad_batches(e) for e in [0, *starts]}) > 1


def accumulation_segments(trainer: Any) -> list[tuple[int, int]] | None:
    """The run's optimizer steps as ``(steps, micro_batches_per_step)`` runs, in order, when a
    ``GradientAccumulationScheduler`` changes the factor during the run (:func:`accumulation_changes`), the
    training loader has a length and ``max_epochs`` or ``max_steps`` is finite: epoch ``e`` of ``n`` batches and
    factor ``f_e`` takes ``n // f_e`` steps of ``f_e`` micro-batches and, when ``f_e`` does not divide ``n``, one of
    ``n % f_e`` (Lightning steps at the epoch's end); capped at ``max_steps`` when set. None otherwise (one factor:
    every step alike)."""
    scheduler = accumulation_scheduler(getattr(trainer, "callbacks", ()))
    batches, max_epochs = getattr(trainer, "num_training_batches", math.inf), getattr(trainer, "max_epochs", None)
    max_steps = getattr(trainer, "max_steps", -1)
    bounded_steps = max_steps is not None and max_steps > 0
    if max_epochs is None or max_epochs < 0:
        # a run bounded by max_steps alone (qa61-break 01): its epochs go on until the steps are taken
        max_epochs = None if bounded_steps else -1
    if (
        scheduler is None
        or not accumulation_changes(trainer)
        or (max_epochs is not None and max_epochs < 0)
        or not math.isfinite(batches)
        or batches <= 0
    ):
        return None
    left = max_steps if bounded_steps else math.inf
    segments: list[tuple[int, int]] = []
    for epoch in range(int(max_epochs)) if max_epochs is not None else itertools.count():
        factor = int(scheduler.get_accumulate_grad_batches(epoch))
        full, rest = divmod(int(batches), factor)
        for steps, size in ((full, factor), (1 if rest else 0, rest)):
            take = int(min(steps, left))
            if take:
                segments.append((take, size))
                left -= take
        if not left:
            break
    return segments


def estimated_optimizer_steps(trainer: Any) -> float:
    """``trainer.estimated_stepping_batches`` with a ``GradientAccumulationScheduler``'s factors counted: Lightning's
    estimate divides every epoch's batches by the Trainer's current factor (1 before the first epoch, when a
    technique reads it), so with a scheduler that raises the factor it counts too many steps. With a scheduler, a
    finite ``max_epochs`` and a training loader with a length: the sum over the epochs of
    ``ceil(num_training_batches / factor_e)``, capped by ``max_steps`` when set; otherwise Lightning's estimate."""
    estimate = float(trainer.estimated_stepping_batches)
    scheduler = accumulation_scheduler(getattr(trainer, "callbacks", ()))
    batches, max_epochs = getattr(trainer, "num_training_batches", math.inf), getattr(trainer, "max_epochs", None)
    if scheduler is None or max_epochs is None or max_epochs < 0 or not math.isfinite(batches) or batches <= 0:
        return estimate
    steps = sum(math.ceil(int(batches) / scheduler.get_accumulate_grad_batches(e)) for e in range(int(max_epochs)))
    max_steps = getattr(trainer, "max_steps", -1)
    return float(min(steps, max_steps) if max_steps is not None and max_steps > 0 else steps)
