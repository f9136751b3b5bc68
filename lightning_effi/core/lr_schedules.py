"""Learning-rate schedules as plain functions of training progress, wrapped in ``LambdaLR``.

Training progress ``p = step / total_steps`` in [0, 1] is the time axis:
the multiplier is clamped at its end value, so a schedule can never overrun when the real number of steps differs
from the estimate. Hydra configs pass the factories with ``_partial_: true``; the task supplies
``total_steps=trainer.estimated_stepping_batches``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class TotalNotKnownError(RuntimeError):
    """Raised by ``expected_total_layer_tokens()`` before training starts (the run's length is read then), e.g. to
    ``LambdaLR``'s constructor inside ``configure_optimizers``: :func:`layer_token_lr` then sets no total yet."""


def warmup_cosine_multiplier(progress: float, warmup_fraction: float = 0.05, min_lr_ratio: float = 0.1) -> float:
    """LR multiplier at training ``progress`` in [0, 1] (values above 1 are clamped to 1).

    Linear warmup from 0 to 1 over the first ``warmup_fraction`` of training, then cosine decay to ``min_lr_ratio``
    at progress 1 (nanoGPT's ``get_lr``).

    Raises:
        ValueError: ``progress < 0``, ``warmup_fraction`` outside [0, 1), or ``min_lr_ratio`` outside [0, 1].
    """
    if progress < 0:
        raise ValueError(f"progress must be >= 0, got {progress}")
    _check(warmup_fraction, min_lr_ratio)
    p = min(progress, 1.0)
    if p < warmup_fraction:
        return p / warmup_fraction
    decay = (p - warmup_fraction) / (1.0 - warmup_fraction)
    return min_lr_ratio + 0.5 * (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * decay))


def _check(warmup_fraction: float, min_lr_ratio: float) -> None:
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")


Progress = Callable[[], float]


class ProgressLambdaLR(LambdaLR):
    """The ``LambdaLR`` of :func:`progress_lambda`. Its first LR is read when it is built, in
    ``configure_optimizers``, before a technique's progress can be told (InfoBatch's, before its first epoch's plan:
    0.0, so a warmup's first step ran at LR 0, qa76-break 05); :meth:`refresh` reads it again, at the fit's start
    (:func:`refresh_progress_schedules`)."""

    def refresh(self) -> None:
        """Set each parameter group's LR to the multiplier at the progress read now (the step counter unchanged; a
        group added to the optimizer after the scheduler was built keeps its LR)."""
        for group, base, fn in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas):
            group["lr"] = base * fn(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def progress_lambda(optimizer: Optimizer, fn: Callable[[float], float], progress: Progress) -> LambdaLR:
    """``LambdaLR`` whose multiplier is ``fn(progress())``, ignoring the scheduler's own step counter.

    ``progress()`` returns training progress in [0, 1] *after the next optimizer step* (e.g.
    ``InfoBatchCallback.effi_progress``, which tracks epochs whose length changes). Values outside [0, 1] are
    clamped, so the schedule ends exactly at ``fn(1)`` and never overruns. The first LR is read again at the start of
    a fit whose technique tells its progress only then (:class:`ProgressLambdaLR`).
    """
    return ProgressLambdaLR(optimizer, lambda _step: fn(min(max(float(progress()), 0.0), 1.0)))


def refresh_progress_schedules(schedulers: Iterable[object]) -> list[str]:
    """Read the first LR of each :class:`ProgressLambdaLR` among ``schedulers`` again (a fit's start, step 0: the
    progress source knows its first epoch now), also the one a ``SequentialLR`` runs first and the last of a
    ``ChainedScheduler`` (a ``LambdaLR`` sets the LR outright), wrappers inside wrappers too (a wrapped schedule ran its
    first step at LR 0, qa77-break 01, qa78-break 02).

    Returns:
        the class names of the wrappers whose progress schedules were not read again: a ``ChainedScheduler`` with one
        before its last scheduler (the factors of those after it at build time would be lost).
    """
    from torch.optim.lr_scheduler import ChainedScheduler, SequentialLR

    missed: list[str] = []
    for scheduler in schedulers:
        if isinstance(scheduler, ProgressLambdaLR):
            scheduler.refresh()
        elif isinstance(scheduler, SequentialLR | ChainedScheduler):
            children = list(scheduler._schedulers)
            if isinstance(scheduler, SequentialLR):
                missed += refresh_progress_schedules(children[:1])  # the first runs at step 0
            else:
                missed += refresh_progress_schedules(children[-1:])  # the last one's LR is the chain's
                if any(_holds_progress(c) for c in children[:-1]):
                    missed.append(type(scheduler).__name__)
            scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return missed


def _holds_progress(scheduler: object) -> bool:
    """Whether ``scheduler`` is a :class:`ProgressLambdaLR` or a wrapper holding one."""
    children = getattr(scheduler, "_schedulers", None)
    return isinstance(scheduler, ProgressLambdaLR) or (
        isinstance(children, list | tuple) and any(_holds_progress(c) for c in children)
    )


def warmup_cosine(
    optimizer: Optimizer,
    total_steps: int | None = None,
    warmup_fraction: float = 0.05,
    min_lr_ratio: float = 0.1,
    progress: Progress | None = None,
) -> LambdaLR:
    """``LambdaLR`` with :func:`warmup_cosine_multiplier` at progress ``(step + 1) / total_steps``, or at
    ``progress()`` when a progress source is given (see :func:`progress_lambda`; the reference tasks pass the
    ``effi_progress`` of a technique callback that changes the epoch length, e.g. InfoBatch).

    The scheduler's step counter counts optimizer steps; the first step already runs at a non-zero LR.
    ``total_steps`` is not read with a progress source (None allowed then).

    Raises:
        ValueError: ``total_steps`` not an int >= 1 without a progress source, or invalid fractions.
    """
    if progress is None and (isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1):
        raise ValueError(f"total_steps must be a positive int (or pass progress=...), got {total_steps!r}")
    _check(warmup_fraction, min_lr_ratio)
    if progress is not None:
        return progress_lambda(
            optimizer, lambda p: warmup_cosine_multiplier(p, warmup_fraction, min_lr_ratio), progress
        )
    steps = int(total_steps)  # type: ignore[arg-type]  # checked above
    return LambdaLR(optimizer, lambda step: warmup_cosine_multiplier((step + 1) / steps, warmup_fraction, min_lr_ratio))


def _cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1.0)


def _check_one_cycle(pct_start: float, div_factor: float, final_div_factor: float) -> None:
    if not 0.0 < pct_start < 1.0:
        raise ValueError(f"pct_start must be in (0, 1), got {pct_start}")
    for name, value in (("div_factor", div_factor), ("final_div_factor", final_div_factor)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value}")


def one_cycle_multiplier(
    progress: float, pct_start: float = 0.3, div_factor: float = 25.0, final_div_factor: float = 1e4
) -> float:
    """LR multiplier (of the peak LR) at training ``progress`` in [0, 1] (values above 1 are clamped to 1): the
    one-cycle policy of torch's ``OneCycleLR`` (Smith & Topin 2019; ``anneal_strategy="cos"``, two phases) on the
    progress axis: cosine from ``1 / div_factor`` up to 1 over the first ``pct_start`` of training, then cosine down to
    ``1 / (div_factor · final_div_factor)`` at progress 1.

    Raises:
        ValueError: ``progress < 0``, ``pct_start`` outside (0, 1), a factor that is not a finite number > 0.
    """
    if progress < 0:
        raise ValueError(f"progress must be >= 0, got {progress}")
    _check_one_cycle(pct_start, div_factor, final_div_factor)
    p, initial = min(progress, 1.0), 1.0 / div_factor
    if p <= pct_start:
        return _cos(initial, 1.0, p / pct_start)
    return _cos(1.0, initial / final_div_factor, (p - pct_start) / (1.0 - pct_start))


def one_cycle_step_multiplier(
    step: int, total_steps: int, pct_start: float = 0.3, div_factor: float = 25.0, final_div_factor: float = 1e4
) -> float:
    """LR multiplier (of the peak LR) of optimizer step ``step`` (0-based) of ``total_steps``: exactly torch's
    ``OneCycleLR(max_lr, total_steps, pct_start, anneal_strategy="cos", div_factor, final_div_factor,
    three_phase=False)`` (its ``get_lr``: the warmup ends at step ``pct_start · total_steps − 1``, the annealing at
    ``total_steps − 1``), but clamped at its end value past the last step instead of raising.

    Raises:
        ValueError: ``step < 0``, ``total_steps < 2``, or the arguments of :func:`one_cycle_multiplier`.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if total_steps < 2:
        raise ValueError(f"total_steps must be >= 2, got {total_steps}")
    _check_one_cycle(pct_start, div_factor, final_div_factor)
    k, initial = min(step, total_steps - 1), 1.0 / div_factor
    warm_end, last = float(pct_start * total_steps) - 1.0, float(total_steps - 1)
    if k <= warm_end:
        return _cos(initial, 1.0, k / warm_end)
    return _cos(1.0, initial / final_div_factor, (k - warm_end) / (last - warm_end))


def one_cycle(
    optimizer: Optimizer,
    total_steps: int | None = None,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    progress: Progress | None = None,
) -> LambdaLR:
    """The one-cycle LR policy as a ``LambdaLR`` (``interval="step"``) of the optimizer's LR (the peak, torch's
    ``max_lr``): at each step :func:`one_cycle_step_multiplier` (torch's ``OneCycleLR`` values, clamped past
    ``total_steps``), or with a progress source :func:`one_cycle_multiplier` at ``progress()`` (see
    :func:`progress_lambda`; e.g. ``InfoBatchCallback.effi_progress``, whose epochs are shorter than
    ``trainer.estimated_stepping_batches`` counts: the cycle ends exactly at the run's last step).

    ``total_steps`` is not read with a progress source (None allowed then).

    Raises:
        ValueError: ``total_steps`` not an int >= 2 without a progress source, or invalid policy arguments.
    """
    if progress is None and (isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 2):
        raise ValueError(f"total_steps must be an int >= 2 (or pass progress=...), got {total_steps!r}")
    _check_one_cycle(pct_start, div_factor, final_div_factor)
    if progress is not None:
        return progress_lambda(
            optimizer, lambda p: one_cycle_multiplier(p, pct_start, div_factor, final_div_factor), progress
        )
    steps = int(total_steps)  # type: ignore[arg-type]  # checked above
    return LambdaLR(
        optimizer, lambda step: one_cycle_step_multiplier(step, steps, pct_start, div_factor, final_div_factor)
    )


def constant(optimizer: Optimizer, total_steps: int, progress: Progress | None = None) -> LambdaLR:
    """A constant multiplier of 1 (``total_steps`` and ``progress`` accepted for a uniform factory signature)."""
    return LambdaLR(optimizer, lambda step: 1.0)


def layer_token_multiplier(
    consumed: float,
    warmup_layer_tokens: float,
    total_layer_tokens: float,
    decay: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> float:
    """LR multiplier at ``consumed`` layer-tokens (Yao et al. 2022, Sec. 3: the paper's layer-token LR schedule, which
    DeepSpeed never finished): linear warmup ``t / warmup`` over the first ``warmup_layer_tokens``, then ``cosine``
    or ``linear`` decay to ``min_lr_ratio`` at ``total_layer_tokens``, constant afterwards (never raises for overrun).

    Raises:
        ValueError: negative ``consumed``/``warmup_layer_tokens``, ``total_layer_tokens <= warmup_layer_tokens``,
            unknown ``decay``, ``min_lr_ratio`` outside [0, 1].
    """
    if consumed < 0 or warmup_layer_tokens < 0:
        raise ValueError(f"consumed and warmup_layer_tokens must be >= 0, got {consumed}, {warmup_layer_tokens}")
    if total_layer_tokens <= warmup_layer_tokens:
        raise ValueError(
            f"total_layer_tokens ({total_layer_tokens}) must exceed warmup_layer_tokens ({warmup_layer_tokens})"
        )
    if decay not in ("cosine", "linear"):
        raise ValueError(f"decay must be 'cosine' or 'linear', got {decay!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if consumed < warmup_layer_tokens:
        return consumed / warmup_layer_tokens
    p = min(1.0, (consumed - warmup_layer_tokens) / (total_layer_tokens - warmup_layer_tokens))
    if decay == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * p
    return min_lr_ratio + 0.5 * (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * p))


def layer_token_lr(
    optimizer: Optimizer,
    callback: object,
    warmup_layer_tokens: float,
    total_layer_tokens: float | None = None,
    decay: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """A ``LambdaLR`` (``interval="step"``) driven by ``callback.consumed_layer_tokens`` (a
    :class:`~lightning_effi.callbacks.RandomLTDCallback`), see :func:`layer_token_multiplier`.

    The callback adds a step's layer-tokens in ``on_before_optimizer_step``, before Lightning steps the scheduler, so
    the LR of step ``k+1`` reflects the tokens of steps ``0..k``. ``total_layer_tokens=None`` uses
    ``callback.expected_total_layer_tokens()`` (the schedule over the run's optimizer steps at the observed global
    batch size), read once the warmup is over. ``LambdaLR``'s constructor reads the multiplier before training starts,
    when the run's length is not known yet: there that read is 1.0 past the warmup (a fresh fit with
    ``warmup_layer_tokens=0`` starts at the peak; a resumed fit, whose restored layer-tokens are past the warmup, has
    its LR set from the checkpoint's optimizer and scheduler states right after; the callback tells it with
    :class:`TotalNotKnownError`), and the total is read at the first step. ``total_layer_tokens=None`` beside a
    technique that changes the network during the fit (the V-cycle) is refused by the callback at train start: no
    total at one network's depth is the run's.
    """
    layer_token_multiplier(
        0, warmup_layer_tokens, (total_layer_tokens or warmup_layer_tokens + 1), decay, min_lr_ratio
    )  # validate now
    if total_layer_tokens is None and callable(note := getattr(callback, "note_total_reader", None)):
        note()  # the callback refuses a total no run has (a V-cycle beside it) at train start
    state: dict[str, float] = {}

    def fn(_: int) -> float:
        consumed = float(callback.consumed_layer_tokens)  # type: ignore[attr-defined]
        if consumed < warmup_layer_tokens:
            return consumed / warmup_layer_tokens
        if "total" not in state:
            expected = total_layer_tokens
            if expected is None:
                try:
                    expected = callback.expected_total_layer_tokens()  # type: ignore[attr-defined]
                except TotalNotKnownError:
                    # LambdaLR's constructor, before train start (a fit resumed past the warmup raised here): the
                    # checkpoint's optimizer and scheduler states set the LR right after (qa92-user 01). Told by the
                    # callback, not by step 0, which a restarted schedule reads mid-run too (qa93-regress 01)
                    return 1.0
            state["total"] = float(expected)
        return layer_token_multiplier(consumed, warmup_layer_tokens, state["total"], decay, min_lr_ratio)

    return LambdaLR(optimizer, fn)


def _multiplier_fn(scheduler: object) -> Callable[[int], float] | None:
    """The LR multiplier of ``scheduler`` (first param group) as a function of its step, or None (see
    :func:`multipliers_between`)."""
    import bisect

    from torch.optim.lr_scheduler import ChainedScheduler, CosineAnnealingLR, LinearLR, PolynomialLR, SequentialLR

    if isinstance(scheduler, LambdaLR):
        fn = scheduler.lr_lambdas[0]
        return lambda step: float(fn(step))
    get_lr = getattr(scheduler, "_get_lr", None)
    base_values = getattr(scheduler, "base_values", None)
    if callable(get_lr) and isinstance(base_values, (list, tuple)) and base_values and base_values[0]:
        # a timm scheduler (timm/scheduler/scheduler.py): _get_lr(t) gives each group's LR at t (a step count when
        # stepped with step_update and t_in_epochs=False, an epoch count otherwise), without stepping
        first = float(base_values[0])
        return lambda step: float(get_lr(step)[0]) / first
    if isinstance(scheduler, CosineAnnealingLR):
        base = float(scheduler.base_lrs[0])
        floor = float(scheduler.eta_min) / base if base else 0.0
        t_max = int(scheduler.T_max)
        return lambda step: floor + (1.0 - floor) * (1.0 + math.cos(math.pi * min(step, t_max) / t_max)) / 2.0
    if isinstance(scheduler, LinearLR):
        first, last, total = float(scheduler.start_factor), float(scheduler.end_factor), int(scheduler.total_iters)
        return lambda step: first + (last - first) * min(step, total) / total
    if isinstance(scheduler, PolynomialLR):
        total, power = int(scheduler.total_iters), float(scheduler.power)
        return lambda step: float((1.0 - min(step, total) / total) ** power)
    if isinstance(scheduler, SequentialLR):  # each child restarts at its milestone (torch steps it with 0 there)
        milestones = [int(m) for m in scheduler._milestones]
        children = [_multiplier_fn(child) for child in scheduler._schedulers]
        if any(child is None for child in children):
            return None

        def sequential(step: int) -> float:
            index = bisect.bisect_right(milestones, step)
            child = children[index]
            assert child is not None
            return child(step - (milestones[index - 1] if index else 0))

        return sequential
    if isinstance(scheduler, ChainedScheduler):  # all step together, each scaling the LR the one before it set
        members = list(scheduler._schedulers)
        chainable = all(
            isinstance(m, (LinearLR, PolynomialLR)) or (isinstance(m, CosineAnnealingLR) and float(m.eta_min) == 0.0)
            for m in members
        )  # these step by ratios of the LR they find, so they multiply; a LambdaLR resets it to base_lr * lambda at
        # every step and a cosine's eta_min adds a floor: neither is a product
        factors = [_multiplier_fn(m) for m in members]
        if not members or not chainable or any(f is None for f in factors):
            return None

        def chained(step: int) -> float:
            return math.prod(f(step) for f in factors if f is not None)

        return chained
    return None


def multipliers_between(scheduler: object, start: int, end: int) -> tuple[float, float] | None:
    """The LR multiplier (of the first param group, relative to its initial LR) that ``scheduler`` gives at its steps
    ``start`` and ``end`` (``0 <= start < end``) when the schedule still changes between them, else None.

    Read without stepping: a ``LambdaLR``'s lambda called at both steps (a schedule on a technique's progress ignores
    the step and gives one value); a timm scheduler's ``_get_lr(t)``; ``CosineAnnealingLR``, ``LinearLR`` and
    ``PolynomialLR`` from their closed forms; a
    ``SequentialLR`` of these (e.g. a linear warmup then a cosine) through the child in charge at each step; a
    ``ChainedScheduler`` as the product of its members' multipliers when they scale the LR by ratios (``LinearLR``,
    ``PolynomialLR``, ``CosineAnnealingLR`` with ``eta_min=0``; not a ``LambdaLR``, which resets the LR). None for
    other schedulers (their length is not a number to read) and for a lambda that raises. Used to tell a
    step-interval schedule sized for more steps than the run will take (InfoBatch's shortened epochs).
    """
    if not 0 <= start < end:
        raise ValueError(f"multipliers_between: expected 0 <= start < end, got start={start}, end={end}")
    at = _multiplier_fn(scheduler)
    if at is None:
        return None
    try:
        a, b = at(start), at(end)
    except Exception:  # noqa: BLE001 - a user's lambda may need state it does not have yet: nothing to read
        return None
    if not (math.isfinite(a) and math.isfinite(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9):
        return None
    return a, b
