"""The non-finite loss policy, the same for every technique.

Every technique callback and the ``EfficiencyMonitor`` take ``nonfinite_loss``: ``"raise"`` (default) stops the
fit at the first non-finite training loss (NaN or infinite), before its backward pass, with a
:class:`NonFiniteLossError` naming the step, the batch and the techniques; ``"warn"`` lets the run go on (the user's
own handling, e.g. a ``training_step`` that returns ``None`` to skip, or a loss scaler), warns once at the first one
and counts them: logged as ``effi/nonfinite_losses`` and reported at the end of fit. A technique never acts on
non-finite values either way
(InfoBatch does not score them, the V-cycle refuses to map non-finite weights).

With several techniques in one Trainer, one check runs per backward pass (by the first guarded callback in the
Trainer's list) with the strictest policy among them: ``"raise"`` if any technique asks for it. The check runs in
``on_before_backward``, so it sees the loss actually backpropagated (InfoBatch's reweighted loss, a manual
optimization's ``manual_backward`` argument).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_effi.core.checks import check_choice

__all__ = [
    "NONFINITE_POLICIES",
    "NonFiniteLossError",
    "NonFiniteLossGuard",
    "is_finite_loss",
    "nonfinite_count",
    "nonfinite_metrics",
]

Policy = Literal["raise", "warn"]
#: the values of every technique's ``nonfinite_loss`` argument
NONFINITE_POLICIES: tuple[str, ...] = ("raise", "warn")


class NonFiniteLossError(RuntimeError):
    """The training loss is NaN or infinite and the policy is ``"raise"``."""


def is_finite_loss(loss: Any) -> bool:
    """Whether ``loss`` (a tensor of any shape, or a number) is finite everywhere; ``None`` counts as finite (a
    skipped step)."""
    if loss is None:
        return True
    if isinstance(loss, torch.Tensor):
        return bool(torch.isfinite(loss.detach()).all())
    return math.isfinite(float(loss))


def nonfinite_count(callbacks: Sequence[Any]) -> int:
    """The run's non-finite training losses counted so far (``nonfinite_loss="warn"``): one check runs per backward
    pass, by the first callback of ``callbacks`` (``trainer.callbacks``) that has a ``nonfinite_guard``, so the
    run's count is the sum over their guards, whichever of them counted."""
    return sum(g.count for g in NonFiniteLossGuard._guards(callbacks))


def nonfinite_metrics(callbacks: Sequence[Any]) -> dict[str, float]:
    """The metric every writer of the count logs: ``{"effi/nonfinite_losses": n}`` with ``n`` the run's count
    (:func:`nonfinite_count`) when every guarded callback of ``callbacks`` (``trainer.callbacks``) has
    ``nonfinite_loss="warn"``; ``{}`` when one asks ``"raise"`` (the first non-finite loss stops the fit, so there is
    no count to show) or none is guarded."""
    guards = NonFiniteLossGuard._guards(callbacks)
    if not guards or any(g.policy == "raise" for g in guards):
        return {}
    return {"effi/nonfinite_losses": float(sum(g.count for g in guards))}


class NonFiniteLossGuard:
    """One technique's share of the policy: its ``nonfinite_loss`` argument and the count of non-finite losses seen
    (checkpointed through the technique's state).

    Args:
        owner: the technique's class name (for messages).
        policy: ``"raise"`` or ``"warn"``.

    Raises:
        ValueError: ``policy`` is not one of :data:`NONFINITE_POLICIES` (naming ``<owner>.nonfinite_loss``).
    """

    def __init__(self, owner: str, policy: str = "raise") -> None:
        self.owner = owner
        self.policy: str = check_choice(owner, "nonfinite_loss", policy, NONFINITE_POLICIES)
        #: non-finite training losses seen (by the checking technique) in this run
        self.count = 0
        #: the global step of the first one, or None
        self.first_step: int | None = None

    @staticmethod
    def _guards(callbacks: Sequence[Any]) -> list[NonFiniteLossGuard]:
        return [g for c in callbacks if isinstance(g := getattr(c, "nonfinite_guard", None), NonFiniteLossGuard)]

    def check(self, trainer: Any, loss: Any, batch_idx: int | None = None) -> None:
        """Apply the policy to ``loss`` (call in ``on_before_backward``). Only the first guarded technique of
        ``trainer.callbacks`` acts; the others return at once.

        Raises:
            NonFiniteLossError: ``loss`` is not finite and a technique's policy is ``"raise"``.
        """
        guards = self._guards(trainer.callbacks)
        if not guards or guards[0] is not self or is_finite_loss(loss):
            return
        step = int(trainer.global_step)
        owners = ", ".join(g.owner for g in guards)
        where = f"step {step}" + ("" if batch_idx is None else f", batch {batch_idx}")
        value = float(loss.detach().float().flatten()[0]) if isinstance(loss, torch.Tensor) else loss
        if any(g.policy == "raise" for g in guards):
            # a technique that can tell why (the curriculum's truncation left no labelled token)
            hints = [
                h
                for c in trainer.callbacks
                if callable(f := getattr(c, "effi_nonfinite_hint", None)) and (h := f(trainer))
            ]
            cause = "".join(f" {h[0].upper() + h[1:]}." for h in hints)
            advice = "Otherwise lower" if hints else "Lower"
            raise NonFiniteLossError(
                f"{owners}: the training loss is {value} at {where}; stopped before its backward pass "
                f"(nonfinite_loss='raise').{cause} {advice} the learning rate, clip gradients or check the data; "
                "nonfinite_loss='warn' on every technique lets the run go on, counting them"
            )
        self.count += 1
        if self.first_step is None:
            self.first_step = step
            rank_zero_warn(
                f"{owners}: the training loss is {value} at {where} (nonfinite_loss='warn': the run goes on; "
                "later ones are counted in effi/nonfinite_losses and reported at the end of fit)"
            )

    def log_count(self, trainer: Any) -> None:
        """Write ``effi/nonfinite_losses`` (the run's count, :func:`nonfinite_count`) to the Trainer's loggers at the
        current step, on rank zero. The curriculum, random-LTD and the V-cycle call it from ``on_train_batch_end``;
        only the checking guard (the first of ``trainer.callbacks``) writes, and only when no guard asks ``"raise"``
        (then the first non-finite loss stops the fit and the count stays 0). InfoBatch (every epoch) and the
        ``EfficiencyMonitor`` (every ``log_every_n_steps``) add the same :func:`nonfinite_metrics` to their own
        metrics. Written to the loggers directly rather than through ``LightningModule.log``: several callbacks share
        the key, and Lightning refuses one key logged twice in a hook."""
        guards = self._guards(trainer.callbacks)
        if not guards or guards[0] is not self or getattr(trainer, "global_rank", 0) != 0:
            return
        if not (metrics := nonfinite_metrics(trainer.callbacks)):
            return
        from lightning_effi.core.compat import logging_step  # Lightning's internals, read where they are needed

        for logger in trainer.loggers:  # in the rows of the module's own metrics of this batch
            logger.log_metrics(metrics, step=logging_step(trainer))

    def report(self) -> str | None:
        """The end-of-fit line (``None`` when no non-finite loss was seen)."""
        if not self.count:
            return None
        return f"{self.owner}: {self.count} non-finite training losses (the first at step {self.first_step})"

    def report_at_end(self) -> None:
        """Print :meth:`report` on rank zero, if any non-finite loss was seen (call at the end of fit)."""
        if (report := self.report()) is not None:
            rank_zero_info(report)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "first_step": self.first_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the count.

        Raises:
            ValueError: a negative count, or a first step that is not a non-negative int or None.
        """
        count, first = state.get("count", 0), state.get("first_step")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{self.owner}: checkpoint nonfinite count must be an int >= 0, got {count!r}")
        if first is not None and (isinstance(first, bool) or not isinstance(first, int) or first < 0):
            raise ValueError(f"{self.owner}: checkpoint nonfinite first_step must be an int >= 0, got {first!r}")
        self.count, self.first_step = count, first
