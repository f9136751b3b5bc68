"""Efficiency accounting: what a training run consumed, so that techniques can show what they saved.

:class:`EfficiencyMonitor` counts, for every training batch, samples, tokens, layer-tokens (tokens x transformer
layers that processed them) and training FLOPs, and splits wall time into train (inside the batch: forward, backward,
optimizer), data (between batches: loading, collation, transfer) and eval (validation, sanity check included).
Counts are summed over ranks; times are the maximum over ranks. Figures are logged as ``effi/<quantity>``
(cumulative) and summarised at the end of ``fit`` as a table and in :attr:`EfficiencyMonitor.summary` (which
``lightning_effi.train`` writes to ``result.json``).

Extension protocol (duck-typed, no base class needed; typed in :mod:`lightning_effi.core.protocols`): any callback
in ``trainer.callbacks`` that defines

- ``effi_adjust(stats: BatchStats, batch, pl_module) -> BatchStats`` is called for every training batch, in callback
  order, and may lower or raise the counts (random-LTD lowers layer-tokens and FLOPs);
- ``effi_summary() -> dict[str, float | int]`` adds its figures (saved samples, ...) to the summary.

The module supplies the per-batch cost through optional hooks: ``effi_count_tokens(batch) -> int``,
``effi_num_layers: int`` and ``effi_training_flops(batch) -> float`` (else Lightning's ``flops_per_batch``
attribute, as read by ``ThroughputMonitor``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp
from typing_extensions import override

COUNT_KEYS = ("samples", "tokens", "layer_tokens", "flops", "batches")
TIME_KEYS = ("time_train", "time_data", "time_eval")


@dataclasses.dataclass
class BatchStats:
    """What one training batch consumed. ``flops``: forward + backward FLOPs (float, may exceed 2**53)."""

    samples: int
    tokens: int
    layer_tokens: int
    flops: float


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch: the first dimension of ``labels``, ``input_ids`` or ``pixel_values`` (in that
    order) of a dict batch, else of its first tensor; for a tuple/list batch, of its first element."""
    if isinstance(batch, Mapping):
        for key in ("labels", "input_ids", "pixel_values"):
            value = batch.get(key)
            if isinstance(value, Tensor) and value.ndim > 0:
                return int(value.shape[0])
        values: Sequence[Any] = list(batch.values())
    elif isinstance(batch, (tuple, list)):
        values = batch
    else:
        values = [batch]
    for value in values:
        if isinstance(value, Tensor) and value.ndim > 0:
            return int(value.shape[0])
        if isinstance(value, (Mapping, tuple, list)):
            return batch_size_of(value)
    raise TypeError(f"cannot infer the batch size of a {type(batch).__name__} batch")


def tokens_of(batch: Any) -> int:
    """Non-padding tokens in a dict batch: ``attention_mask.sum()`` if present, else ``input_ids.numel()``, else 0."""
    if not isinstance(batch, Mapping):
        return 0
    mask = batch.get("attention_mask")
    if isinstance(mask, Tensor):
        return int(mask.sum().item())
    ids = batch.get("input_ids")
    return int(ids.numel()) if isinstance(ids, Tensor) else 0


def format_summary(summary: Mapping[str, Any]) -> str:
    """Render a summary dict as an aligned two-column text table."""
    rows = []
    for key, value in summary.items():
        if isinstance(value, float):
            text = f"{value:.4g}" if abs(value) < 1e6 else f"{value:.4e}"
        else:
            text = str(value)
        rows.append((key, text))
    width = max((len(k) for k, _ in rows), default=0)
    line = "-" * (width + 16)
    body = "\n".join(f"{k.ljust(width)}  {v:>12}" for k, v in rows)
    return f"{line}\nEfficiency summary\n{line}\n{body}\n{line}"


class EfficiencyMonitor(Callback):
    """Counts samples, tokens, layer-tokens, FLOPs and wall time of a fit; logs ``effi/*``; writes a summary.

    Args:
        log_every_n_steps: reduce across ranks and log every this many training batches (default: the trainer's
            ``log_every_n_steps``). Must be a positive int.
        print_summary: print the summary table on rank 0 at the end of ``fit``.

    State (checkpointed, so a resumed run keeps cumulative figures): the totals below.
    Summary keys: ``samples, tokens, layer_tokens, flops, batches, optimizer_steps, time_train_s, time_data_s,
    time_eval_s, time_total_s, samples_per_s, tokens_per_s`` plus every ``effi_summary()`` of other callbacks.

    Raises:
        ValueError: ``log_every_n_steps`` not a positive int, ``print_summary`` not a bool.
    """

    def __init__(self, log_every_n_steps: int | None = None, print_summary: bool = True) -> None:
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(
                f"EfficiencyMonitor.log_every_n_steps must be a positive int or None, got {log_every_n_steps!r}"
            )
        if not isinstance(print_summary, bool):
            raise ValueError(f"EfficiencyMonitor.print_summary must be true or false, got {print_summary!r}")
        self.log_every_n_steps = log_every_n_steps
        self.print_summary = print_summary
        self.totals: dict[str, float] = dict.fromkeys(COUNT_KEYS + TIME_KEYS + ("time_total",), 0.0)
        self.summary: dict[str, Any] = {}
        self._mark: float | None = None
        self._batch_start: float | None = None
        self._eval_start: float | None = None
        self._fit_start: float | None = None
        self._flops_warned = False

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(log_every_n_steps={self.log_every_n_steps!r}, print_summary={self.print_summary!r})"
        )

    # ----------------------------------------------------------------------------------------- per batch
    def batch_stats(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> BatchStats:
        """The cost of one training batch after every ``effi_adjust`` of the trainer's callbacks."""
        samples = batch_size_of(batch)
        count_tokens = getattr(pl_module, "effi_count_tokens", None)
        tokens = int(count_tokens(batch)) if callable(count_tokens) else tokens_of(batch)
        layer_tokens = tokens * int(getattr(pl_module, "effi_num_layers", 0) or 0)
        flops_fn = getattr(pl_module, "effi_training_flops", None)
        if callable(flops_fn):
            flops = float(flops_fn(batch))
        else:
            flops = float(getattr(pl_module, "flops_per_batch", None) or 0.0)
            if flops == 0.0 and not self._flops_warned:
                self._flops_warned = True
                rank_zero_warn(
                    "EfficiencyMonitor: FLOPs are not counted; define `effi_training_flops(batch)` or set "
                    "`flops_per_batch` on your LightningModule"
                )
        stats = BatchStats(samples, tokens, layer_tokens, flops)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            # the AdjustsBatchStats hook, read with getattr: a Protocol isinstance check per batch costs ~40x more
            adjust = getattr(callback, "effi_adjust", None)
            if callable(adjust) and callback is not self:
                stats = adjust(stats, batch, pl_module)
        return stats

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # a new fit counts from zero; a resumed one gets its totals back from the checkpoint after setup
        if stage == "fit":
            self.totals = dict.fromkeys(self.totals, 0.0)
            self.summary = {}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()
        self._fit_total_before = self.totals["time_total"]

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark = self._now(pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = self._now(pl_module)
        if self._mark is not None:
            self.totals["time_data"] += now - self._mark
        self._batch_start = now

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = self._now(pl_module)
        if self._batch_start is not None:
            self.totals["time_train"] += now - self._batch_start
        stats = self.batch_stats(trainer, pl_module, batch)
        for key in ("samples", "tokens", "layer_tokens", "flops"):
            self.totals[key] += getattr(stats, key)
        self.totals["batches"] += 1
        # for Lightning's ThroughputMonitor (listed after this one)
        pl_module.flops_per_batch = int(stats.flops)  # type: ignore[assignment]
        every = self.log_every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
        if int(self.totals["batches"]) % max(every, 1) == 0:
            self._log(trainer, pl_module)
        self._mark = self._now(pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start = self._now(pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._eval_start is not None:
            self.totals["time_eval"] += self._now(pl_module) - self._eval_start
            self._eval_start = None
        self._mark = self._now(pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.summary = self.compute_summary(trainer)
        if self.print_summary and trainer.is_global_zero:
            print(format_summary(self.summary), flush=True)

    # ------------------------------------------------------------------------------------------- summary
    def _elapsed_total(self) -> float:
        if self._fit_start is None:
            return self.totals["time_total"]
        return self._fit_total_before + (time.perf_counter() - self._fit_start)

    def reduced_totals(self, trainer: pl.Trainer) -> dict[str, float]:
        """Totals summed (counts) or maxed (times) over ranks. A collective: every rank must call it."""
        self.totals["time_total"] = self._elapsed_total()
        counts = torch.tensor([self.totals[k] for k in COUNT_KEYS], dtype=torch.float64)
        times = torch.tensor([self.totals[k] for k in TIME_KEYS + ("time_total",)], dtype=torch.float64)
        if trainer.world_size > 1:
            counts = trainer.strategy.reduce(counts.to(trainer.strategy.root_device), reduce_op="sum").cpu()
            times = trainer.strategy.reduce(times.to(trainer.strategy.root_device), reduce_op=ReduceOp.MAX).cpu()  # type: ignore[arg-type]
        out = dict(zip(COUNT_KEYS, counts.tolist()))
        out.update(zip(TIME_KEYS + ("time_total",), times.tolist()))
        return out

    def compute_summary(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The final figures (see the class docstring); a collective under DDP."""
        t = self.reduced_totals(trainer)
        busy = t["time_train"] + t["time_data"]
        summary: dict[str, Any] = {
            "samples": int(t["samples"]),
            "tokens": int(t["tokens"]),
            "layer_tokens": int(t["layer_tokens"]),
            "flops": float(t["flops"]),
            "batches": int(t["batches"]),
            "optimizer_steps": int(trainer.global_step),
            "time_train_s": t["time_train"],
            "time_data_s": t["time_data"],
            "time_eval_s": t["time_eval"],
            "time_total_s": t["time_total"],
            "samples_per_s": t["samples"] / busy if busy > 0 else math.nan,
            "tokens_per_s": t["tokens"] / busy if busy > 0 else math.nan,
        }
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            extra = getattr(callback, "effi_summary", None)  # the ReportsSummary hook
            if callable(extra) and callback is not self:
                summary.update(extra())
        return summary

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        t = self.reduced_totals(trainer)
        if not trainer.loggers or not trainer.is_global_zero:
            return
        metrics = {"effi/" + k.replace("time_", "time/"): v for k, v in t.items() if k != "batches"}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @staticmethod
    def _now(pl_module: pl.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    # ---------------------------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        self.totals["time_total"] = self._elapsed_total()
        return {"totals": {k: float(v) for k, v in self.totals.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        unknown = set(state_dict.get("totals", {})) - set(self.totals)
        if unknown:
            raise KeyError(f"EfficiencyMonitor state has unknown keys {sorted(unknown)}")
        self.totals.update({k: float(v) for k, v in state_dict["totals"].items()})
        self._fit_total_before = self.totals["time_total"]


__all__ = ["BatchStats", "EfficiencyMonitor", "batch_size_of", "format_summary", "tokens_of"]
