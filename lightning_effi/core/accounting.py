"""Efficiency accounting: what a training run consumed, so that techniques can show what they saved.

:class:`EfficiencyMonitor` counts, for every training batch, samples, tokens, layer-tokens (tokens x transformer
layers that processed them) and training FLOPs, and splits wall time into train (inside the batch: forward, backward,
optimizer), data (between batches: loading, collation, transfer) and eval (validation, sanity check included).
Counts are summed over ranks; times are the maximum over ranks. Figures are logged as ``effi/<quantity>``
(cumulative) and summarised at the end of ``fit`` as a table and in :attr:`EfficiencyMonitor.summary` (which
``lightning_effi.train`` writes to ``result.json``).

Beside what was computed, the monitor counts the **baseline**: what the same run without any technique would have
computed on the same data (the full model, full-length sequences, every sample the data pipeline drew before any
pruning), and splits the difference between the techniques.

Extension protocol (duck-typed, no base class needed; typed in :mod:`lightning_effi.core.protocols`): any callback
in ``trainer.callbacks`` that defines

- ``effi_adjust(stats: BatchStats, batch, pl_module) -> BatchStats`` (``AdjustsBatchStats``) is called for every
  training batch, in callback order, and may lower or raise the counts (random-LTD lowers layer-tokens and FLOPs);
  what it lowers is that callback's saving;
- ``effi_baseline(batch, pl_module) -> Baseline | None`` (``ProvidesBaseline``) says what the technique changed in
  the batch outside ``effi_adjust`` (the batch's length, the model, the samples drawn), so that the monitor can count
  the batch as it would have been without it (:class:`Baseline`; None: nothing to undo for this batch); the
  difference is that callback's saving. It is called in ``on_train_batch_end`` (after every callback's
  ``on_train_batch_start`` for the batch), in reverse callback order, with the batch as the callbacks after it have
  already restored it. The shipped techniques define it: the curriculum gives the untruncated batch
  (``Curriculum.effi_baseline``), the V-cycle the full model below level 1 (``VCycleCallback.effi_baseline``),
  InfoBatch the samples drawn per sample trained (``InfoBatchCallback.effi_baseline``);
- ``effi_summary() -> dict[str, float | int]`` (``ReportsSummary``) adds its figures (saved samples, ...) to the
  summary.

A callback's savings are reported as ``saved/<name>/...`` with ``name`` its ``effi_name`` attribute if it has one
(:func:`technique_name`).

The module supplies the per-batch cost through optional hooks: ``effi_count_tokens(batch) -> int``,
``effi_num_layers: int`` and ``effi_training_flops(batch) -> float`` (else Lightning's ``flops_per_batch``
attribute, as read by ``ThroughputMonitor``). Which operations the FLOPs include: :mod:`lightning_effi.core.flops`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp
from typing_extensions import override

COUNT_KEYS = ("samples", "tokens", "layer_tokens", "flops", "batches")
TIME_KEYS = ("time_train", "time_data", "time_eval")
#: the quantities of a batch (the fields of :class:`BatchStats`)
QUANTITIES = ("samples", "tokens", "layer_tokens", "flops")
BASELINE_KEYS = tuple(f"baseline_{q}" for q in QUANTITIES)
#: one value per quantity, in the order of :data:`QUANTITIES`
Counts = tuple[float, float, float, float]


@dataclasses.dataclass
class BatchStats:
    """What one training batch consumed. ``flops``: forward + backward FLOPs (float, may exceed 2**53)."""

    samples: int
    tokens: int
    layer_tokens: int
    flops: float

    def values(self) -> Counts:
        """``(samples, tokens, layer_tokens, flops)`` as floats."""
        return (float(self.samples), float(self.tokens), float(self.layer_tokens), float(self.flops))


@dataclasses.dataclass(frozen=True)
class Baseline:
    """What one technique changed in a training batch, returned by a callback's ``effi_baseline(batch, pl_module)``
    so that :class:`EfficiencyMonitor` can count the batch as the run without the technique would have computed it.
    The module's own hooks count it (``effi_count_tokens``, ``effi_num_layers``, ``effi_training_flops``), so the
    technique needs no FLOPs formula.

    Attributes:
        batch: the batch as the data pipeline without the technique would have made it; only what the module's
            counting hooks read matters (shapes, the attention mask). None: unchanged. Curriculum ``seqlen_truncate``:
            the untruncated batch.
        model: a context-manager factory; inside the context ``pl_module`` counts as the model without the technique
            (``effi_training_flops`` and ``effi_num_layers`` of the full model), and no forward runs. None: unchanged.
            V-cycle: the full model held in place of the coarse one.
        samples: samples the pipeline drew per sample trained (a float > 0; above 1 for pruning): every count of the
            batch is scaled by it. InfoBatch: ``(trained + pruned) / trained`` in the current epoch (the pruned
            samples are never in a batch; they are charged at the mean cost of the trained ones).

    Raises:
        ValueError: ``samples`` not a finite number > 0.
    """

    batch: Any = None
    model: Callable[[], AbstractContextManager[Any]] | None = None
    samples: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, (int, float)):
            raise ValueError(f"Baseline.samples must be a number, got {self.samples!r}")
        if not (math.isfinite(self.samples) and self.samples > 0):
            raise ValueError(f"Baseline.samples must be a finite number > 0, got {self.samples!r}")


@dataclasses.dataclass
class BatchAccount:
    """One training batch's counts: what was computed, the baseline, and each technique's share of the difference.

    Attributes:
        actual: what was computed (the module's counts after every ``effi_adjust``).
        baseline: ``(samples, tokens, layer_tokens, flops)`` the run without any technique would have computed for
            this batch (floats: a :class:`Baseline`'s ``samples`` scales them).
        saved: technique name -> the ``(samples, tokens, layer_tokens, flops)`` that technique saved (``baseline -
            actual`` is their sum, up to float rounding).
    """

    actual: BatchStats
    baseline: Counts
    saved: dict[str, Counts]


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


#: the summary prefix of the shipped techniques (the one their ``effi_summary`` keys use)
TECHNIQUE_NAMES = {
    "RandomLTDCallback": "random_ltd",
    "VCycleCallback": "vcycle",
    "InfoBatchCallback": "infobatch",
    "Curriculum": "curriculum",
}


def technique_name(callback: Any) -> str:
    """The name a callback's saving is reported under (``saved/<name>/...``): its ``effi_name`` attribute if it has
    one, the shipped techniques' summary prefix, else the snake-cased class name without ``Callback``."""
    name = getattr(callback, "effi_name", None)
    if isinstance(name, str) and name:
        return name
    cls = type(callback).__name__
    if cls in TECHNIQUE_NAMES:
        return TECHNIQUE_NAMES[cls]
    cls = cls.removesuffix("Callback") or cls
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", cls).lower()


def _scaled(counts: Counts, factor: float) -> Counts:
    return (counts[0] * factor, counts[1] * factor, counts[2] * factor, counts[3] * factor)


def lengthen_batch(
    batch: Mapping[str, Any], keys: Sequence[str], length: int, mask: Tensor | None = None
) -> dict[str, Any]:
    """``batch`` with every ``keys`` tensor of the batch's sequence length (``[B, S, ...]``, ``S`` from the first such
    key) widened to ``length`` columns: ``attention_mask`` with ``mask`` appended (its columns ``S..length``, e.g. the
    ones a truncation cut), else with ones (real tokens); the others with zeros (broadcast views: only their shapes
    are read). Nothing changes when ``length <= S``. The inverse, for counting, of the curriculum's
    ``truncate_batch``: a new dict, ``batch`` is not modified.

    Raises:
        ValueError: ``mask`` is not ``[B, length - S, ...]`` like the batch's ``attention_mask``.
    """
    out = dict(batch)
    seq = next((int(v.shape[1]) for k in keys if isinstance(v := batch.get(k), Tensor) and v.ndim >= 2), None)
    if seq is None or length <= seq:
        return out
    for key in keys:
        value = batch.get(key)
        if not (isinstance(value, Tensor) and value.ndim >= 2 and value.shape[1] == seq):
            continue
        shape = (value.shape[0], length, *value.shape[2:])
        if key == "attention_mask":
            extra_shape = (value.shape[0], length - seq, *value.shape[2:])
            if mask is None:
                extra = value.new_ones(extra_shape)
            elif tuple(mask.shape) == extra_shape:
                extra = mask.to(device=value.device, dtype=value.dtype)
            else:
                raise ValueError(
                    f"lengthen_batch: mask of shape {tuple(mask.shape)} cannot widen an attention_mask of shape "
                    f"{tuple(value.shape)} to {length} columns (expected {extra_shape})"
                )
            out[key] = torch.cat([value, extra], dim=1)
        else:
            out[key] = value.new_zeros(()).expand(shape)
    return out


def baseline_hook(callback: Any) -> Callable[[Any, pl.LightningModule], Baseline | None] | None:
    """The callback's ``effi_baseline`` (:class:`~lightning_effi.core.protocols.ProvidesBaseline`), else None."""
    hook = getattr(callback, "effi_baseline", None)
    return hook if callable(hook) else None


class EfficiencyMonitor(Callback):
    """Counts samples, tokens, layer-tokens, FLOPs and wall time of a fit, and the baseline without the techniques;
    logs ``effi/*``; writes a summary.

    Per training batch (in ``on_train_batch_end``): the module's counts (``effi_count_tokens``, ``effi_num_layers``,
    ``effi_training_flops`` of the batch, with the model in place), lowered by every callback's ``effi_adjust`` in
    callback order, are what was computed. The baseline undoes the techniques one at a time, in reverse callback
    order: first every ``effi_adjust`` (each callback saved what it lowered), then, for every callback with an
    ``effi_baseline`` hook (:class:`~lightning_effi.core.protocols.ProvidesBaseline`: the curriculum's untruncated
    batch, the V-cycle's full model, InfoBatch's pruned samples), the batch is counted again with that technique's
    :class:`Baseline` and those already undone applied: the difference is that technique's saving. The savings add up
    to ``baseline - computed`` exactly; where two techniques interact (random-LTD's saving on a truncated sequence)
    the share goes to the one undone first.

    Args:
        log_every_n_steps: reduce across ranks and log every this many training batches (default: the trainer's
            ``log_every_n_steps``). Must be a positive int.
        print_summary: print the summary table on rank 0 at the end of ``fit``.

    State (checkpointed, so a resumed run keeps cumulative figures): the totals below, the baseline and the savings.

    Summary keys (counts summed over ranks, times maxed):

    - ``samples, tokens, layer_tokens, flops, batches, optimizer_steps``: what was computed (FLOPs: forward +
      backward, :mod:`lightning_effi.core.flops`);
    - ``time_train_s, time_data_s, time_eval_s, time_total_s, samples_per_s, tokens_per_s``;
    - ``baseline_samples, baseline_tokens, baseline_layer_tokens, baseline_flops``: the same run without any
      technique: the full model, full-length sequences, every sample the data pipeline drew before any pruning;
    - ``samples_saved_frac, tokens_saved_frac, layer_tokens_saved_frac, flops_saved_frac``: the combined saving,
      ``1 - computed / baseline`` (0.0 for an empty baseline);
    - ``saved/<technique>/{samples,tokens,layer_tokens,flops}_frac``: each technique's share of the baseline
      (``saved / baseline``; they sum to the combined saving), for every callback with ``effi_adjust`` or a baseline
      (:func:`technique_name`: ``random_ltd``, ``vcycle``, ``infobatch``, ``curriculum``, ...);
    - every ``effi_summary()`` of other callbacks.

    Raises:
        ValueError: ``log_every_n_steps`` not a positive int, ``print_summary`` not a bool.
        KeyError: (``load_state_dict``) a checkpoint with totals this monitor does not know.
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
        self.totals: dict[str, float] = dict.fromkeys(COUNT_KEYS + TIME_KEYS + ("time_total",) + BASELINE_KEYS, 0.0)
        self.summary: dict[str, Any] = {}
        self._mark: float | None = None
        self._batch_start: float | None = None
        self._eval_start: float | None = None
        self._fit_start: float | None = None
        self._flops_warned = False
        self._module_flops: float | None = None  # the module's own flops_per_batch (we overwrite the attribute)
        self._written_flops: int | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(log_every_n_steps={self.log_every_n_steps!r}, print_summary={self.print_summary!r})"
        )

    # ----------------------------------------------------------------------------------------- per batch
    def module_stats(self, pl_module: pl.LightningModule, batch: Any) -> BatchStats:
        """The module's own counts of ``batch`` with the model in place (no ``effi_adjust``)."""
        samples = batch_size_of(batch)
        count_tokens = getattr(pl_module, "effi_count_tokens", None)
        tokens = int(count_tokens(batch)) if callable(count_tokens) else tokens_of(batch)
        layer_tokens = tokens * int(getattr(pl_module, "effi_num_layers", 0) or 0)
        flops_fn = getattr(pl_module, "effi_training_flops", None)
        if callable(flops_fn):
            flops = float(flops_fn(batch))
        else:
            value = getattr(pl_module, "flops_per_batch", None)
            if value != self._written_flops or self._module_flops is None:  # the module's own, not our last write
                self._module_flops = float(value or 0.0)
            flops = self._module_flops
            if flops == 0.0 and not self._flops_warned:
                self._flops_warned = True
                rank_zero_warn(
                    "EfficiencyMonitor: FLOPs are not counted; define `effi_training_flops(batch)` or set "
                    "`flops_per_batch` on your LightningModule"
                )
        return BatchStats(samples, tokens, layer_tokens, flops)

    def account(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> BatchAccount:
        """One training batch: what was computed, the baseline and each technique's saving (class docstring)."""
        callbacks = [c for c in trainer.callbacks if c is not self]  # type: ignore[attr-defined]
        raw = self.module_stats(pl_module, batch)
        saved: dict[str, list[float]] = {}

        def add(name: str, lower: Counts, higher: Counts) -> None:
            row = saved.setdefault(name, [0.0] * len(QUANTITIES))
            for i, (low, high) in enumerate(zip(lower, higher)):
                row[i] += high - low

        stats = raw
        for callback in callbacks:
            # the AdjustsBatchStats hook, read with getattr: a Protocol isinstance check per batch costs ~40x more
            adjust = getattr(callback, "effi_adjust", None)
            if callable(adjust):
                lowered = adjust(stats, batch, pl_module)
                add(technique_name(callback), lowered.values(), stats.values())
                stats = lowered
        actual = stats
        current: Counts = raw.values()
        scale, changed_batch = 1.0, batch
        models: list[Callable[[], AbstractContextManager[Any]]] = []
        for callback in reversed(callbacks):
            hook = baseline_hook(callback)
            change = hook(changed_batch, pl_module) if hook is not None else None
            if change is None:
                continue
            scale *= float(change.samples)
            if change.batch is None and change.model is None:
                raised = _scaled(current, float(change.samples))
            else:
                changed_batch = changed_batch if change.batch is None else change.batch
                models = models if change.model is None else [*models, change.model]
                with ExitStack() as stack:
                    for enter in models:
                        stack.enter_context(enter())
                    raised = _scaled(self.module_stats(pl_module, changed_batch).values(), scale)
            add(technique_name(callback), current, raised)
            current = raised
        return BatchAccount(actual, current, {k: (v[0], v[1], v[2], v[3]) for k, v in saved.items()})

    def batch_stats(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> BatchStats:
        """The cost of one training batch after every ``effi_adjust`` of the trainer's callbacks."""
        return self.account(trainer, pl_module, batch).actual

    def _technique_keys(self, trainer: pl.Trainer) -> list[str]:
        """``saved/<technique>/<quantity>`` for every callback that can save (the same on every rank)."""
        keys = []
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if callback is self:
                continue
            if callable(getattr(callback, "effi_adjust", None)) or baseline_hook(callback) is not None:
                keys += [f"saved/{technique_name(callback)}/{q}" for q in QUANTITIES]
        return keys

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # a new fit counts from zero; a resumed one gets its totals back from the checkpoint after setup
        if stage == "fit":
            self._check_order(trainer)
            base = COUNT_KEYS + TIME_KEYS + ("time_total",) + BASELINE_KEYS
            self.totals = dict.fromkeys([*base, *self._technique_keys(trainer)], 0.0)
            self.summary = {}
            self._module_flops = self._written_flops = None

    def _check_order(self, trainer: pl.Trainer) -> None:
        """A technique that changes the model's shapes (the V-cycle) switches models in its ``on_train_batch_end``;
        listed before the monitor, the batch that trained on one level would be counted with the next level's model.

        Raises:
            MisconfigurationException: such a technique comes before the monitor in ``trainer.callbacks``.
        """
        callbacks = list(trainer.callbacks)  # type: ignore[attr-defined]
        earlier = callbacks[: callbacks.index(self)] if self in callbacks else []
        shapers = [
            type(c).__name__
            for c in earlier
            if getattr(getattr(type(c), "requirements", None), "changes_model_shapes", False) is True
        ]
        if shapers:
            raise MisconfigurationException(
                f"{type(self).__name__} must come before {', '.join(shapers)} in Trainer(callbacks=[...]): "
                f"{shapers[0]} replaces the model in on_train_batch_end, so a monitor listed after it would count the "
                "batch just trained with the next level's model; list EfficiencyMonitor first"
            )

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
        account = self.account(trainer, pl_module, batch)
        for q, actual, baseline in zip(QUANTITIES, account.actual.values(), account.baseline):
            self.totals[q] += actual
            self.totals[f"baseline_{q}"] += baseline
        for name, values in account.saved.items():
            for q, v in zip(QUANTITIES, values):
                key = f"saved/{name}/{q}"
                self.totals[key] = self.totals.get(key, 0.0) + v
        self.totals["batches"] += 1
        # for Lightning's ThroughputMonitor (listed after this one)
        self._written_flops = int(account.actual.flops)
        pl_module.flops_per_batch = self._written_flops  # type: ignore[assignment]
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

    def _count_keys(self) -> list[str]:
        return [k for k in self.totals if k not in TIME_KEYS and k != "time_total"]

    def reduced_totals(self, trainer: pl.Trainer) -> dict[str, float]:
        """Totals summed (counts, baseline, savings) or maxed (times) over ranks. A collective: every rank must call
        it (with the same callbacks, so the same keys)."""
        self.totals["time_total"] = self._elapsed_total()
        count_keys, time_keys = self._count_keys(), TIME_KEYS + ("time_total",)
        counts = torch.tensor([self.totals[k] for k in count_keys], dtype=torch.float64)
        times = torch.tensor([self.totals[k] for k in time_keys], dtype=torch.float64)
        if trainer.world_size > 1:
            counts = trainer.strategy.reduce(counts.to(trainer.strategy.root_device), reduce_op="sum").cpu()
            times = trainer.strategy.reduce(times.to(trainer.strategy.root_device), reduce_op=ReduceOp.MAX).cpu()  # type: ignore[arg-type]
        out = dict(zip(count_keys, counts.tolist()))
        out.update(zip(time_keys, times.tolist()))
        return out

    @staticmethod
    def savings(totals: Mapping[str, float]) -> dict[str, float]:
        """The combined and per-technique saving fractions of (reduced) totals: ``<quantity>_saved_frac`` and
        ``saved/<technique>/<quantity>_frac`` (class docstring)."""

        def frac(x: float, base: float) -> float:
            return x / base if base else 0.0

        out = {
            f"{q}_saved_frac": frac(totals[f"baseline_{q}"] - totals[q], totals[f"baseline_{q}"]) for q in QUANTITIES
        }
        for key in sorted(k for k in totals if k.startswith("saved/")):
            name, q = key[len("saved/") :].rsplit("/", 1)
            out[f"saved/{name}/{q}_frac"] = frac(totals[key], totals[f"baseline_{q}"])
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
            "baseline_samples": round(t["baseline_samples"]),
            "baseline_tokens": round(t["baseline_tokens"]),
            "baseline_layer_tokens": round(t["baseline_layer_tokens"]),
            "baseline_flops": float(t["baseline_flops"]),
        }
        summary.update(self.savings(t))
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
        metrics.update({"effi/" + k: v for k, v in self.savings(t).items()})
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
        """The checkpoint's totals. Savings of a technique this run does not have are kept (it saved them before);
        a checkpoint written before the baseline was counted gets the baseline of its computed counts (no saving
        before the resume)."""
        totals = dict(state_dict.get("totals", {}))
        unknown = {k for k in totals if not k.startswith("saved/")} - set(self.totals)
        if unknown:
            raise KeyError(f"EfficiencyMonitor state has unknown keys {sorted(unknown)}")
        for q in QUANTITIES:
            totals.setdefault(f"baseline_{q}", totals.get(q, 0.0))
        self.totals.update({k: float(v) for k, v in totals.items()})
        self._fit_total_before = self.totals["time_total"]


__all__ = [
    "BASELINE_KEYS",
    "Baseline",
    "BatchAccount",
    "BatchStats",
    "EfficiencyMonitor",
    "baseline_hook",
    "batch_size_of",
    "format_summary",
    "lengthen_batch",
    "technique_name",
    "tokens_of",
]
