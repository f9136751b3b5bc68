"""The ``effi_*`` hooks a LightningModule or a callback may define, as :class:`typing.Protocol` classes.

All are optional and duck-typed: a module without them trains unchanged, and the accounting falls back as
``docs/architecture.md`` describes. ``isinstance`` works on them (``runtime_checkable``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["AdjustsBatchStats", "CountsTokens", "HasNumLayers", "ProvidesProgress", "ReportsSummary", "TrainingFlops"]


@runtime_checkable
class TrainingFlops(Protocol):
    """Module hook: training FLOPs (forward + backward) of one batch, a float."""

    def effi_training_flops(self, batch: Any) -> float: ...


@runtime_checkable
class CountsTokens(Protocol):
    """Module hook: the tokens of one batch that the model processes (an int; padding excluded)."""

    def effi_count_tokens(self, batch: Any) -> int: ...


@runtime_checkable
class HasNumLayers(Protocol):
    """Module attribute: the number of transformer layers (layer-tokens = tokens x layers)."""

    effi_num_layers: int


@runtime_checkable
class AdjustsBatchStats(Protocol):
    """Callback hook: lower (or raise) one batch's counted quantities, e.g. random-LTD's layer-tokens and FLOPs."""

    def effi_adjust(self, stats: Any, batch: Any, pl_module: Any) -> Any: ...


@runtime_checkable
class ReportsSummary(Protocol):
    """Callback hook: the technique's figures for the final efficiency summary and ``result.json``."""

    def effi_summary(self) -> Mapping[str, Any]: ...


@runtime_checkable
class ProvidesProgress(Protocol):
    """Callback hook: training progress in [0, 1] for LR schedules, from a technique that changes the epoch length."""

    effi_progress: Callable[[], float]
