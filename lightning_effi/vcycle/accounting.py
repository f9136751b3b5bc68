"""The V-cycle's FLOPs accounting, without Lightning: :class:`FlopsAccount` adds every batch's training FLOPs with the
current level's model and with the full model, and gives the baseline and the saving that
:class:`~lightning_effi.vcycle.VCycleCallback` logs and checkpoints.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FlopsAccount", "baseline_flops"]

#: what a module's ``effi_training_flops`` may raise when it cannot count a batch: the accounting stops, the fit goes on
DISABLING_ERRORS = (NotImplementedError, TypeError, KeyError)


def baseline_flops(full_model_flops: float, flops_steps: int, baseline_steps: int | None = None) -> float:
    """Training FLOPs of the baseline the saving is measured against: ``full_model_flops`` (the full model on the
    run's own batches, ``flops_steps`` optimizer steps) or, with ``baseline_steps``, its mean per step times
    ``baseline_steps`` (0 before any step)."""
    if baseline_steps is None:
        return full_model_flops
    return full_model_flops / flops_steps * baseline_steps if flops_steps else 0.0


@dataclass
class FlopsAccount:
    """Training FLOPs of a V-cycle run and of the full model on the same batches.

    Attributes:
        baseline_steps: optimizer steps of the baseline the saving is measured against (None: as long as this run).
        flops: the FLOPs of the models that trained (checkpointed, as every counter but ``enabled``).
        full_model_flops: the full model's FLOPs on the same batches.
        flops_steps: the optimizer steps these counters cover.
        enabled: False once a batch could not be counted (for the rest of the fit).
    """

    baseline_steps: int | None = None
    flops: float = 0.0
    full_model_flops: float = 0.0
    flops_steps: int = 0
    enabled: bool = True

    def count(self, measure: Callable[[], tuple[float, float]], owner: str = "VCycleCallback") -> None:
        """Add one batch's ``(current model, full model)`` FLOPs from ``measure()``. An error of
        :data:`DISABLING_ERRORS` stops the accounting for the rest of the fit, with one warning."""
        if not self.enabled:
            return
        try:
            current, full = measure()
        except DISABLING_ERRORS as err:
            self.enabled = False
            warnings.warn(f"{owner}: FLOPs accounting disabled ({type(err).__name__}: {err})", stacklevel=3)
            return
        self.flops += float(current)
        self.full_model_flops += float(full)

    @property
    def baseline_flops(self) -> float:
        """Training FLOPs of the baseline (:func:`baseline_flops`)."""
        return baseline_flops(self.full_model_flops, self.flops_steps, self.baseline_steps)

    def saved_frac(self) -> float:
        """``1 - flops / baseline_flops``; 0 before any FLOPs are counted."""
        base = self.baseline_flops
        return 1.0 - self.flops / base if base else 0.0

    def state_dict(self) -> dict[str, Any]:
        """The counters, as plain numbers (keys of the callback's checkpointed state)."""
        return {
            "flops": float(self.flops),
            "full_model_flops": float(self.full_model_flops),
            "flops_steps": int(self.flops_steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flops = float(state["flops"])
        self.full_model_flops = float(state["full_model_flops"])
        self.flops_steps = int(state["flops_steps"])
