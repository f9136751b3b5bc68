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

The module supplies the per-batch cost through optional hooks: ``effi_count_samples(batch) -> int``,
``effi_count_tokens(batch) -> int``,
``effi_num_layers: int`` and ``effi_training_flops(batch) -> float`` (else Lightning's ``flops_per_batch``
attribute, as read by ``ThroughputMonitor``: one figure for every batch, so the FLOPs saving of a technique that
shortens the batches or shrinks the model, the curriculum's truncation or the V-cycle, reads 0, with one warning).
A module without them (any LightningModule as users write it, any batch
structure) is counted by :mod:`lightning_effi.core.measure`:

- samples: the batch's first dimension (:func:`batch_size_of`; the second of a sequence-first ``[T, B]`` batch whose
  first block reads ``[T, B, H]``, ``batch_first=False``; a warning when the batch's tensors disagree on their first
  dimension, a graph batch's nodes, edges and graphs); a batch of several training loaders (a mapping or
  list of loaders: Lightning's ``CombinedLoader``) is counted per loader and summed, tokens as well;
- tokens: the batch's ``attention_mask`` sum, else the real tokens of another padding mask beside token ids (a
  tuple batch's 0/1 entry), else its ``input_ids`` / first integer ``[B, T]`` tensor's size (:func:`tokens_of`;
  plus the positions the first block sees in front of them: a vision-language model's image tokens, a prefix; a
  front end that pools the ids, so that the blocks see fewer positions, is warned of, not scaled),
  else the positions in the hidden states the network's first transformer block was called with in the training
  step (``[B, T, H]``: a ViT's patches and prefix tokens, a series of continuous features, padding included: a
  padding mask of such a batch is read only when named ``attention_mask``, with one warning otherwise; a batch a
  technique lengthened along one axis, the curriculum's untruncated one, scaled by its length), summed over the
  network's passes in the step (each call of a module that runs the blocks on other data, outside the backward:
  SimCLR's two views encoded one call each, a multi-crop step's crops, a view augmented in place after a pass; not
  a loop over the blocks inside one call, nor a call on the same values (R-Drop) or on an input of the network's
  output's shape made from that output (recycling; a memory beside a new segment is another pass));
- layer-tokens: tokens x the network's transformer blocks (:func:`lightning_effi.core.measure.block_candidates`: a
  registered random-LTD adapter's layer list, else the ``nn.ModuleList`` / ``nn.Sequential`` lists of identical
  blocks, trainable before frozen, then by parameters; of those, the first whose first block the step runs with
  ``[B, T, H]`` hidden states: not an EMA copy never run, nor an MLP head on pooled features; of two towers, the
  one the token ids, or their embedding, feed);
- FLOPs: the network's calls in the training step replayed on a fake-tensor copy under ``FlopCounterMode``, once per
  input shape (:class:`lightning_effi.core.measure.FlopsMeter`; forward + backward, no forward on real data).

A figure that cannot be found reads 0 with one warning per quantity that names the hook to define; never a silent 0.
A batch whose ``training_step`` returned None (Lightning skips it under automatic optimization: no backward, no
update) is not counted, with one warning (:func:`skipped_batch`).
Which operations the FLOPs include: :mod:`lightning_effi.core.flops`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import sys
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed import ReduceOp
from typing_extensions import override

from lightning_effi.core.batch import unwrap
from lightning_effi.core.checks import check_bool, check_choice, check_int, is_int, is_real
from lightning_effi.core.compat import logging_step, rebuild_train_loader_after_restore, validation_follows_batch
from lightning_effi.core.console import print_block
from lightning_effi.core.features import optimized_parameters
from lightning_effi.core.hook_ids import reserve_hook_ids
from lightning_effi.core.measure import (
    CallRecord,
    CallRecorder,
    FlopsMeter,
    MeasureError,
    OutsideProducts,
    WeakHook,
    _in_backward,
    block_candidates,
    block_runners,
    combined_parts,
    derived_from,
    find_batch_size,
    find_blocks,
    find_tokens,
    forward_trains,
    hidden_tokens,
    key_padding_mask,
    mask_is_additive,
    opaque_holder,
    other_first_dims,
    pass_input,
    real_positions,
    same_values,
    sequence_groups,
    storage_ref,
    tensor_leaves,
    token_source,
)
from lightning_effi.core.nonfinite import NONFINITE_POLICIES, NonFiniteLossGuard, nonfinite_count, nonfinite_metrics
from lightning_effi.core.state import check_coarse_vcycle_resume, open_batch_skipped, saving_in_train_batch_end

COUNT_KEYS = ("samples", "tokens", "layer_tokens", "flops", "batches")
#: ``time_monitor``: the monitor's own work around each batch (setting its hooks before it, counting and measuring the
#: FLOPs of each new batch shape after it), outside ``time_train`` and ``time_data``
TIME_KEYS = ("time_train", "time_data", "time_eval", "time_monitor")
#: the quantities of a batch (the fields of :class:`BatchStats`)
QUANTITIES = ("samples", "tokens", "layer_tokens", "flops")
BASELINE_KEYS = tuple(f"baseline_{q}" for q in QUANTITIES)
#: the most schedule points a fit adds where a technique's state changed between two logging steps (a level switch, a
#: new difficulty); past it only the logging steps' points are added, so a state that changes at every step keeps
#: ``result.json`` small
MAX_CHANGE_POINTS = 1000
#: one value per quantity, in the order of :data:`QUANTITIES`
Counts = tuple[float, float, float, float]
#: the module attribute (in its ``__dict__``) where :class:`EfficiencyMonitor` keeps ``(the module's own
#: flops_per_batch, the value it wrote to flops_per_batch)``: the written value is never read back as the module's own
WRITTEN_FLOPS = "_effi_written_flops_per_batch"
#: the module attribute where :class:`EfficiencyMonitor` keeps the instance's own ``flops_per_batch`` (the value before
#: its first write in a fit, or one set since; :data:`_ABSENT`: none), put back at the fit's end
ORIGINAL_FLOPS = "_effi_original_flops_per_batch"
_ABSENT = object()


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
    The module's own hooks count it (``effi_count_tokens``, ``effi_num_layers``, ``effi_training_flops``), or, for a
    module without them, the monitor's measurement (the network's recorded calls replayed with ``batch``'s shapes and
    on ``model``'s network, the block list found again inside ``model``'s context), so the technique needs no FLOPs
    formula.

    Attributes:
        batch: the batch as the data pipeline without the technique would have made it; only what the module's
            counting hooks read matters (shapes, the attention mask). None: unchanged. Curriculum ``seqlen_truncate``:
            the untruncated batch.
        model: a context-manager factory; inside the context ``pl_module`` counts as the model without the technique
            (``effi_training_flops`` and ``effi_num_layers`` of the full model), and no forward runs. None: unchanged.
            V-cycle: the full model held in place of the coarse one.
        samples: samples the pipeline drew per sample trained (a float > 0; above 1 for pruning): the batch's
            sample count is scaled by it, and its tokens, layer-tokens and FLOPs too unless ``tokens`` is given.
            InfoBatch: ``(trained + pruned) / trained`` in the current epoch (the pruned samples are never in a
            batch).
        tokens: tokens the pipeline drew per token trained (a float > 0, or None: ``samples``): scales the batch's
            tokens, layer-tokens and FLOPs, for samples of unequal length. InfoBatch: ``samples`` times the mean
            tokens of a sample of the training set over the mean of the epoch's trained samples (the pruned samples
            charged at their own length, not at the trained ones' mean; the FLOPs of a padded batch taken as
            following its real tokens).

    Raises:
        ValueError: ``samples`` or ``tokens`` not a finite number > 0.
    """

    batch: Any = None
    model: Callable[[], AbstractContextManager[Any]] | None = None
    samples: float = 1.0
    tokens: float | None = None

    def __post_init__(self) -> None:
        for name in ("samples", "tokens"):
            value = getattr(self, name)
            if name == "tokens" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"Baseline.{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"Baseline.{name} must be a finite number > 0, got {value!r}")

    def factors(self) -> Counts:
        """The factors of ``(samples, tokens, layer_tokens, flops)``: ``samples`` for the first, ``tokens`` (else
        ``samples``) for the others."""
        per_token = float(self.samples if self.tokens is None else self.tokens)
        return (float(self.samples), per_token, per_token, per_token)


@dataclasses.dataclass
class BatchAccount:
    """One training batch's counts: what was computed, the baseline, and each technique's share of the difference.

    Attributes:
        actual: what was computed (the module's counts after every ``effi_adjust``).
        baseline: ``(samples, tokens, layer_tokens, flops)`` the run without any technique would have computed for
            this batch (floats: a :class:`Baseline`'s factors scale them).
        saved: technique name -> the ``(samples, tokens, layer_tokens, flops)`` that technique saved (``baseline -
            actual`` is their sum, up to float rounding).
    """

    actual: BatchStats
    baseline: Counts
    saved: dict[str, Counts]


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch of any structure (dicts, HF ``BatchEncoding``, tuples, lists, dataclasses,
    nested): the first dimension of ``labels``, ``input_ids`` or ``pixel_values`` (in that order) of a dict batch,
    else of its first tensor with a dimension (:func:`lightning_effi.core.measure.find_batch_size`).

    Raises:
        TypeError: the batch has no tensor with a dimension.
    """
    size = find_batch_size(batch)
    if size is None:
        raise TypeError(f"cannot infer the batch size of a {type(batch).__name__} batch (no tensor with a dimension)")
    return size


def tokens_of(batch: Any) -> int:
    """Tokens in a batch of any structure (:func:`lightning_effi.core.measure.find_tokens`): the real tokens of its
    ``attention_mask`` if it has one (padding excluded), else of another padding mask beside the token ids (a tuple
    batch's 0/1 or bool ``[B, T]`` entry, as the curriculum reads it), else the size of ``input_ids``, else of its
    first integer ``[B, T]`` tensor (token ids), else 0.

    Which tokens of an ``attention_mask`` are real (:func:`lightning_effi.core.measure.mask_tokens`), summed over the
    samples: a ``bool`` mask: ``True``; a numeric (integer or floating) mask with no negative value: the positive
    entries (HF ``0 / 1`` masks: ``1``); a numeric mask with a negative value (``-inf``, ``torch.finfo(dtype).min``)
    or with none positive: additive, the entries ``>= 0`` (an all-zero additive mask: every token). Layout
    (:func:`lightning_effi.core.measure.key_padding_mask`): ``[B, T]`` as it is; ``[B, 1, 1, T]`` (and ``[B, 1, T]``):
    the broadcast key-padding row; ``[B, 1, T, T]`` / ``[B, T, T]`` (heads beyond the first ignored): the diagonal,
    a token is real when it may attend to itself. A mask that says neither (``[B, 1, Q, T]`` with ``1 != Q != T``, a
    complex dtype) counts the ids, padding included, with one warning. Never raises on the mask's values."""
    tokens = find_tokens(batch)
    return 0 if tokens is None else tokens


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
    one, the shipped techniques' summary prefix, else the snake-cased class name without ``Callback``. A class
    gives the name of its instances (when ``effi_name`` is a class attribute)."""
    name = getattr(callback, "effi_name", None)
    if isinstance(name, str) and name:
        return name
    cls = (callback if isinstance(callback, type) else type(callback)).__name__
    if cls in TECHNIQUE_NAMES:
        return TECHNIQUE_NAMES[cls]
    cls = cls.removesuffix("Callback") or cls
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", cls).lower()


def schedule_states(trainer: pl.Trainer) -> dict[str, float]:
    """Every technique's schedule state now, ``{"<technique>/<key>": value}`` (e.g. ``infobatch/kept_fraction``,
    ``curriculum/difficulty``, ``random_ltd/reserved_length``, ``vcycle/level``), from the callbacks'
    ``effi_schedule_state()`` hooks (:class:`~lightning_effi.core.protocols.ReportsScheduleState`)."""
    out: dict[str, float] = {}
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        hook = getattr(callback, "effi_schedule_state", None)
        if callable(hook):
            name = technique_name(callback)
            out.update({f"{name}/{key}": float(value) for key, value in hook().items()})
    return out


def _is_compiled(pl_module: nn.Module) -> bool:
    """Whether the module runs compiled: given to the Trainer as ``torch.compile(model)`` (Lightning's
    ``_compiler_ctx``), or holding an ``OptimizedModule`` (a compiled submodule). The V-cycle, the one technique that
    replaces the network, refuses a compiled submodule, so this holds for the whole fit."""
    from torch._dynamo import OptimizedModule

    return isinstance(getattr(pl_module, "_compiler_ctx", None), dict) or any(
        isinstance(m, OptimizedModule) for m in pl_module.modules()
    )


def skipped_batch(pl_module: pl.LightningModule, outputs: Any) -> bool:
    """Whether Lightning skipped the batch whose ``on_train_batch_end`` received ``outputs``: under automatic
    optimization a ``training_step`` that returns None gets no backward and no update, and its hooks receive ``{}``
    (or None). Under manual optimization a None return is the norm (the step did its own backward): never skipped."""
    if not getattr(pl_module, "automatic_optimization", True):
        return False
    return outputs is None or (isinstance(outputs, Mapping) and "loss" not in outputs)


def _progress_bar_names(states: Mapping[str, float]) -> dict[str, str]:
    """The progress bar's short names for :func:`schedule_states`' keys: the key without the technique, unless two
    techniques share it."""
    short = [key.rsplit("/", 1)[-1] for key in states]
    return {key: (s if short.count(s) == 1 else key) for s, key in zip(short, states)}


#: a network's transformer block list
Blocks = nn.ModuleList | nn.Sequential


def _shapes(batch: Any) -> list[tuple[Any, tuple[int, ...]]]:
    """The paths and shapes of a batch's tensors (:func:`lightning_effi.core.measure.leaves`)."""
    return [(path, tuple(value.shape)) for path, value in tensor_leaves(batch)]


def _has_token_ids(batch: Any, shape: tuple[int, ...]) -> bool:
    """Whether the batch holds token ids beside its mask of ``shape``: an integer (not bool) tensor of that shape
    whose name is not a mask's (a CTC target of its own length is not)."""
    for path, value in tensor_leaves(batch):
        name = str(path[-1]) if isinstance(path, tuple) and path else ""
        integer = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        if tuple(value.shape) == shape and integer and "mask" not in name.lower():
            return True
    return False


def _length_ratio(before: list[tuple[Any, tuple[int, ...]]], after: list[tuple[Any, tuple[int, ...]]]) -> float | None:
    """How much longer the batch of shapes ``after`` is than the one of shapes ``before`` (:func:`_shapes`), when the
    two hold the same tensors and every dimension that differs went from one length ``T`` to one length ``S``
    (a sequence axis cut or restored, the curriculum's untruncated batch): ``S / T``; 1.0 for equal shapes; None
    otherwise (another batch size, several lengths)."""
    if [path for path, _ in before] != [path for path, _ in after]:
        return None
    changed = set()
    for (_, old), (_, new) in zip(before, after):
        if len(old) != len(new):
            return None
        changed |= {(a, b) for a, b in zip(old, new) if a != b}
    if not changed:
        return 1.0
    if len(changed) > 1:
        return None
    ((short, long),) = changed
    return long / short if short > 0 else None


#: tensor names of a graph batch (PyG's ``Batch`` layout): ``edge_index [2, E]``, the graph of each node ``batch``,
#: the graphs' boundaries ``ptr``
GRAPH_NAMES = frozenset({"edge_index", "batch", "ptr"})


def _graph_like(batch: Any) -> bool:
    """Whether the batch holds a tensor named like a graph batch's (:data:`GRAPH_NAMES`): the first-dimension warning
    is for those; per-object rows beside per-sample ones (CTC's concatenated targets, YOLO's ``[n_objects, 6]``) are
    counted right and were warned too (qa47-break 05)."""
    return any(path and str(path[-1]) in GRAPH_NAMES for path, _ in tensor_leaves(batch))


def _flat_first(batch: Any, size: int) -> bool:
    """Whether the samples were read (:func:`find_batch_size`) from the batch's first tensor, a 1-D one of ``size``
    entries, not from a named ``labels`` / ``input_ids`` / ``pixel_values``: an ``nn.EmbeddingBag``'s flat ids
    ``[L]`` beside their offsets ``[B]`` (415 history items counted as the samples for 64 users, in silence,
    qa113-tabular 04), or a per-batch constant put first."""
    if isinstance(batch, Mapping) and any(
        isinstance(batch.get(k), Tensor) for k in ("labels", "input_ids", "pixel_values")
    ):
        return False
    first = next((v for _, v in tensor_leaves(batch) if v.ndim > 0), None)
    return first is not None and first.ndim == 1 and int(first.shape[0]) == size


#: the candidate block lists whose first block the monitor watches in a step (:meth:`EfficiencyMonitor._candidates`)
WATCHED_LISTS = 4


def _submodule(root: nn.Module, name: str) -> nn.Module | None:
    """``root.get_submodule(name)``, None when there is none at that path now."""
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None


def _is_encoder_decoder(module: nn.Module) -> bool:
    """``torch.nn.Transformer``, or a Hugging Face model whose config says ``is_encoder_decoder``."""
    config = getattr(module, "config", None)
    return isinstance(module, nn.Transformer) or getattr(config, "is_encoder_decoder", False) is True


def _scaled(counts: Counts, factors: Counts) -> Counts:
    return (counts[0] * factors[0], counts[1] * factors[1], counts[2] * factors[2], counts[3] * factors[3])


def lengthen_batch(
    batch: Mapping[str, Any], keys: Sequence[str], length: int, mask: Tensor | None = None
) -> dict[str, Any]:
    """``batch`` with every ``keys`` tensor of the batch's sequence length (``[B, S, ...]``, ``S`` from the first such
    key) widened to ``length`` columns: ``attention_mask`` with ``mask`` appended (its columns ``S..length``, e.g. the
    ones a truncation cut), else with real tokens (ones; zeros in an additive mask,
    :func:`lightning_effi.core.measure.mask_is_additive`); the others with zeros (broadcast views: only their shapes
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
            if mask is None:  # real tokens: ones in a keep mask, zeros in an additive one
                extra = value.new_zeros(extra_shape) if mask_is_additive(value) else value.new_ones(extra_shape)
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


def _image_batch(batch: Any) -> bool:
    """Whether ``batch`` holds a floating tensor of 4 or more dimensions (images ``[B, C, H, W]``, video) and no
    integer ``[B, T]`` tensor of token ids."""
    found = False
    for _, tensor in tensor_leaves(batch):
        if tensor.is_floating_point() and tensor.dim() >= 4:
            found = True
        elif tensor.dim() == 2 and not tensor.is_floating_point() and tensor.dtype != torch.bool:
            return False
    return found


class EfficiencyMonitor(Callback):
    """Counts samples, tokens, layer-tokens, FLOPs and wall time of a fit, and the baseline without the techniques;
    logs ``effi/*``; writes a summary.

    Per training batch (in ``on_train_batch_end``): the module's counts (``effi_count_tokens``, ``effi_num_layers``,
    ``effi_training_flops`` of the batch, with the model in place; where the module lacks a hook, the figure found or
    measured as the module docstring says), lowered by every callback's ``effi_adjust`` in callback order, are what
    was computed. The baseline undoes the techniques one at a time, in reverse callback
    order: first every ``effi_adjust`` (each callback saved what it lowered), then, for every callback with an
    ``effi_baseline`` hook (:class:`~lightning_effi.core.protocols.ProvidesBaseline`: the curriculum's untruncated
    batch, the V-cycle's full model, InfoBatch's pruned samples), the batch is counted again with that technique's
    :class:`Baseline` and those already undone applied: the difference is that technique's saving. The savings add up
    to ``baseline - computed`` exactly; where two techniques interact (random-LTD's saving on a truncated sequence)
    the share goes to the one undone first.

    Args:
        log_every_n_steps: reduce across ranks and log every this many optimizer steps, after the step (default:
            the trainer's ``log_every_n_steps``; with gradient accumulation, at the last micro-batch of the step).
            Must be a positive int.
        print_summary: print the summary table on rank 0 at the end of ``fit``.
        nonfinite_loss: what a NaN or infinite training loss does (:mod:`lightning_effi.core.nonfinite`; the monitor
            is in every run, baselines included, so a baseline without any technique stops on NaN too):
            ``"raise"`` (default) stops the fit at that step, before its backward pass, with a
            :class:`~lightning_effi.core.nonfinite.NonFiniteLossError` naming the step; ``"warn"`` warns once,
            counts them (logged as ``effi/nonfinite_losses``: the run's count, :func:`nonfinite_count`; checkpointed,
            reported at the end of fit) and lets the run go on. With technique callbacks in the Trainer, one check
            runs per backward pass (by the first of them and the monitor in ``trainer.callbacks``), with the
            strictest policy among them.
        interpolate_flops: read the FLOPs of a padded length between replayed ones off the quadratic they fit
            (:class:`~lightning_effi.core.measure.FlopsMeter`: after 5 replayed lengths of one family, all on the
            quadratic and not all of one residue modulo some ``m > 1``), instead of replaying each length (0.3-0.8 s
            each for a 3-layer BERT on a CPU core). False: replay every new shape, for a model whose FLOPs depend
            on the length otherwise (a branch above some length).

    State (checkpointed, so a resumed run keeps cumulative figures): the totals below, the baseline and the savings,
    the curve and the schedule.

    Records (lists of dicts, for reports and notebooks; written to ``result.json`` by the Hydra app):

    - :attr:`curve`: one point per validation run during ``fit`` (the sanity check excluded): ``step, epoch,
      samples, tokens, layer_tokens, flops`` (cumulative, summed over ranks), ``train_wall_s`` (training + data
      time so far, seconds, evaluation excluded) and ``metrics`` (every ``val*`` scalar logged). A fit resumed from a
      checkpoint written before a step's validation ended (at its batch end, ``ModelCheckpoint(every_n_train_steps=
      ...)``, or during it, ``OnExceptionCheckpoint``) has no point at that step: Lightning resumes past that
      validation without running it (warned, naming the step);
    - :attr:`schedule`: every ``log_every_n_steps`` optimizer steps and at every validation, the same cumulative
      figures and each technique's schedule state ``"<technique>/<key>"`` from its ``effi_schedule_state()``
      (:func:`schedule_states`): ``infobatch/kept_fraction``, ``curriculum/difficulty``,
      ``random_ltd/reserved_length``, ``vcycle/level``; and where a state changed between two of those steps, a
      point at the last step before the change and one at the change (at most :data:`MAX_CHANGE_POINTS` per fit;
      under DDP these hold only ``step``, ``epoch`` and the states). The same states are shown in the progress bar
      on every batch under their short names (``kept_fraction``, ``difficulty``, ...; logged with ``logger=False``).

    Summary keys (counts summed over ranks, times maxed):

    - ``samples, tokens, layer_tokens, flops, batches, optimizer_steps``: what was computed (FLOPs: forward +
      backward, :mod:`lightning_effi.core.flops`);
    - ``time_train_s, time_data_s, time_eval_s, time_total_s, samples_per_s, tokens_per_s``;
    - ``time_monitor_s``: the monitor's own time (in ``time_total_s`` only): setting its hooks before each batch
      (finding the model's block lists at the first), counting each batch, and measuring the
      FLOPs of each new batch shape (the replay on fake tensors costs tens to hundreds of forward-backward passes'
      Python overhead: 0.3-0.8 s for a 3-layer BERT on a CPU core). Every padded length is a new shape; of batches
      padded to their longest sequence, lengths between 5 replayed ones are read off the quadratic those fit exactly
      (:class:`~lightning_effi.core.measure.FlopsMeter`), so a run pays a few replays, not one per length; batches
      that differ in several sizes (a graph batch's nodes and edges) replay at most batches, warned once; define
      ``effi_training_flops(batch)`` to pay none;
    - ``baseline_samples, baseline_tokens, baseline_layer_tokens, baseline_flops``: the same run without any
      technique: the full model, full-length sequences, every sample the data pipeline drew before any pruning;
    - ``samples_saved_frac, tokens_saved_frac, layer_tokens_saved_frac, flops_saved_frac``: the combined saving,
      ``1 - computed / baseline`` (0.0 for an empty baseline);
    - ``saved/<technique>/{samples,tokens,layer_tokens,flops}_frac``: each technique's share of the baseline
      (``saved / baseline``; they sum to the combined saving), for every callback with ``effi_adjust`` or a baseline
      (:func:`technique_name`: ``random_ltd``, ``vcycle``, ``infobatch``, ``curriculum``, ...);
    - every ``effi_summary()`` of other callbacks.

    A figure that cannot be found (no hook, nothing in the batch, no transformer blocks, a network that cannot be
    replayed) reads 0 and warns once per quantity, naming the hook to define. In a baseline (a technique's
    :class:`Baseline` with another batch or model), a figure that cannot be found keeps the value before that
    technique was undone (no saving claimed), with the same warning.

    Measuring FLOPs (a module without ``effi_training_flops`` and ``flops_per_batch``) records the network's calls
    between ``on_train_batch_start`` and ``on_train_batch_end`` with process-wide module forward hooks, present only
    in that window (:class:`~lightning_effi.core.measure.CallRecorder`); finding tokens in the hidden states puts a
    forward pre-hook on the first transformer block for the same window. Only the work of those module calls is
    counted: arithmetic in ``training_step``'s own code outside any module call (``h @ self.weight`` on a
    parameter, a loss's matrix product) is not in the measured FLOPs and is not detected (no warning); a module with
    such work defines ``effi_training_flops(batch)``. The baseline's FLOPs on a batch of other shapes (the
    curriculum's untruncated batch) replay the recorded calls with each batch tensor argument at its shape in that
    batch, and a slice of one leaving out at most 2 entries per dimension (the causal ``ids[:, :-1]``, ``ids[:, 1:]``,
    a BOS / EOS strip ``ids[:, 1:-1]``) shortened by as many entries; an argument computed from the batch (a copy, a
    sum) or a slice to a fixed size (``ids[:, :8]``, a chunk) has no known shape there: that baseline reads as the
    trained FLOPs, with a warning.

    The monitor writes each batch's FLOPs (after every ``effi_adjust``) to ``pl_module.flops_per_batch`` for
    Lightning's ``ThroughputMonitor``, and keeps on the module which value it wrote and the module's own value it
    replaced (:data:`WRITTEN_FLOPS`), so that no later batch takes the written value for the module's own; at the
    fit's end (or its exception) the module's own value is put back (or the attribute removed), so a later fit
    without the monitor does not read the last batch's FLOPs. A ``flops_per_batch`` property of the module's class is
    its own figure and never written.

    Raises:
        ValueError: ``log_every_n_steps`` not a positive int, ``print_summary`` not a bool, ``nonfinite_loss`` not
            ``"raise"`` or ``"warn"``.
        NonFiniteLossError: (a training batch, ``nonfinite_loss="raise"``) the training loss is NaN or infinite.
        MisconfigurationException: (``setup``) the monitor listed after a technique that changes the model's
            shapes; a fit that starts at a step > 0 of a Trainer whose earlier training this monitor did not count
            to its end (a further fit of a Trainer it counted goes on counting: the totals are cumulative).
        KeyError: (``load_state_dict``) a checkpoint with totals this monitor does not know.
        ValueError: (``load_state_dict``) a checkpoint total that is not a finite number, or a negative count or
            time (only a ``saved/...`` total may be negative); a non-finite loss count that is not an int >= 0.
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        print_summary: bool = True,
        nonfinite_loss: str = "raise",
        interpolate_flops: bool = True,
    ) -> None:
        self.log_every_n_steps = log_every_n_steps  # the settings' properties check them
        self.print_summary = print_summary
        #: the non-finite loss policy (lightning_effi.core.nonfinite) and its count, checkpointed as "nonfinite_loss"
        self.nonfinite_guard = NonFiniteLossGuard(type(self).__name__, nonfinite_loss)
        self.totals: dict[str, float] = dict.fromkeys(COUNT_KEYS + TIME_KEYS + ("time_total",) + BASELINE_KEYS, 0.0)
        self.summary: dict[str, Any] = {}
        self.curve: list[dict[str, Any]] = []
        self.schedule: list[dict[str, Any]] = []
        # the steps of validations that Lightning skips in this resumed fit: the checkpoint was written before one
        # ended, at its step's batch end (compat.validation_follows_batch) or during it; carried into the checkpoints
        # written until a validation past them tells whether the curve lacks them (_check_skipped_points)
        self._skipped_validations: list[int] = []
        self._mark: float | None = None
        self._batch_start: float | None = None
        self._step_at_batch_start: int | None = None  # trainer.global_step when the current batch started
        self._open_batch: Any = None  # the batch between on_train_batch_start and on_train_batch_end
        self._backward_seen = False  # whether that batch has had a backward (on_before_backward)
        # the technique states after the last optimizer step and that step's position, for the schedule's change
        # points (_record_change); the change points this fit added
        self._last_states: dict[str, float] | None = None
        self._last_position: dict[str, Any] | None = None
        self._change_points = 0
        # a technique state's progress-bar name, chosen at its first batch of the fit (:meth:`_bar_name`)
        self._bar_names: dict[str, str] = {}
        self._warned_skip = False  # a batch skipped by its training_step was warned of
        self._warned_forward_only = False  # a forward-only epoch (SWA's batch-norm update) was warned of
        self._logged_step: int | None = None  # the logging step (core.compat.logging_step) of the last log
        self._eval_start: float | None = None
        self._fit_start: float | None = None
        #: (id of the Trainer, its global_step) at the end of the last fit this monitor counted completely
        self._ended_at: tuple[int, int] | None = None
        self._late_start: int | None = None  # a fit of a Trainer trained without this monitor (setup, on_train_start)
        #: write_result calls made in on_fit_end before this monitor summed the fit up, run at the end of its own
        self.after_summary: list[Callable[[], Any]] = []
        self._loading_rank = 0  # the rank restoring a checkpoint (on_load_checkpoint, for load_state_dict)
        self._evaluating = False  # the checkpoint being restored is for validate / test / predict (its state ignored)
        self._warned: set[str] = set()  # the quantities already warned about
        #: ``trainer.train_dataloader`` this epoch: several loaders (a mapping / list) combine their batches
        self._train_loaders: Any = None
        self._recorder = CallRecorder()
        self._meter = FlopsMeter(interpolate=check_bool("EfficiencyMonitor", "interpolate_flops", interpolate_flops))
        self._warned_replays, self._replayed_batches = False, 0  # this fit's batches that ran a replay
        self._calls: list[CallRecord] | None = None  # the network's calls in the current batch (None: not recorded)
        self._batch_shapes: list[tuple[Any, tuple[int, ...]]] | None = None  # the shapes of the recorded batch
        self._observed_tokens: int | None = None  # tokens in the first block's hidden states in the current batch
        self._observed_shape: tuple[int, ...] | None = None  # those hidden states' shape
        self._observed_sequence_first = False  # that block reads [T, B, H] (an nn.MultiheadAttention's batch_first)
        self._rnn_input: tuple[int, ...] | None = None  # the [T, B, H] input of a sequence-first nn.RNNBase
        self._prepended: int | None = None  # positions a row the blocks see in front of the batch's tokens
        self._prepended_rows: tuple[int, ...] | None = None  # the shape of the token ids they were counted beside
        self._observed_width = False  # whose last dimension is a width of the block ([B, T, H], not [B, C, T])
        self._recorded_lists: dict[str, int] = {}  # the module lists of the network the recorded step trained
        self._mask_scale: float | None = None  # first block positions per attention-mask position (a downsampler)
        self._observed_fed = False  # the list whose positions were observed is the one the batch's token ids feed
        # its positions in the step's passes with grad (not a generate() or a no_grad probe inside the step)
        self._observed_trained: int | None = None
        self._trained_positions: dict[int, int] = {}
        self._optimized: set[int] | None = None  # the ids of the parameters the optimizers held at the watched step
        # the shapes of the first block's hidden states at each of those passes, by watched list, and the observed one's
        self._trained_shapes: dict[int, list[tuple[int, ...]]] = {}
        # a pass whose first block ran without grad (a frozen stem): its positions and shape, counted as trained when a
        # later block of the pass trains
        self._untrained_pass: dict[int, tuple[int, tuple[int, ...]]] = {}
        # what the counts of watched list index were before its current pass began, restored when a block of it
        # raises (a forward the step catches and retries, :meth:`_failed`)
        self._pass_marks: dict[int, tuple[Any, ...]] = {}
        self._observed_passes: list[tuple[int, ...]] = []
        self._ids_scale = 1.0  # passes over other data per token-id position (a contrastive pair's second input)
        self._block_hooks: list[Any] = []
        # the candidate block lists watched in the current step (path, list), what the first block run of each was
        # called with ((tokens, shape, width) by index), the query shape of its sequence-first attention, and the
        # path of the list the last step ran with [B, T, H] hidden states (find_blocks returns it while in place)
        self._watched: list[tuple[str, Blocks]] = []
        self._seen: dict[int, tuple[int | None, tuple[int, ...] | None, bool]] = {}
        self._attention_seen: dict[int, tuple[int, ...]] = {}
        # the watched lists whose network began another pass in the step (its module that runs the blocks
        # was called again), whose first block call adds its positions to _seen's tokens (_observe)
        self._next_pass: set[int] = set()
        # in the step, for each watched list: the tensors its network began a pass on (held until the step ends), the
        # tensors its network or its blocks returned (weak references: not kept alive), the calls of its network under
        # way, and the position in the list of the block it ran last
        self._pass_values: dict[int, list[Any]] = {}
        # watched list -> what its network and blocks returned in the step: the tensor and its storage (weakly held),
        # its autograd node (held to the step's end: an output re-fed inline is freed at once) and its shape
        self._outputs: dict[int, list[_Returned]] = {}
        self._running: dict[int, int] = {}  # watched list -> calls of its runners under way (nested ones run no pass)
        # id of a runner or block -> its calls whose pre-hook of this monitor ran and that have not returned: a call
        # that raised in a hook before it (a user's pre-hook) was not seen to begin anything (_returned)
        self._entered: dict[int, int] = {}
        self._last_block: dict[int, int] = {}
        # the (B, T) of the step's token ids, and the watched lists whose network was called with an integer tensor of
        # that shape (the tower the ids feed, when two towers see as many positions)
        self._rows: tuple[int, int] | None = None
        self._fed_ids: set[int] = set()
        self._embedded: list[_Returned] = []  # embeddings of the batch's token ids in the step
        self._chosen: str | None = None
        self._ranked: tuple[tuple[Any, ...], list[tuple[str, Blocks]]] | None = None  # _candidates' cache
        #: a compiled module's last recorded batch: (its batch shapes, the network's parameter shapes); see _watch
        self._recorded_key: tuple[Any, ...] | None = None
        #: a compiled module's records by regime (the fields of _RECORD_FIELDS), the last MAX_COMPILED_RECORDS used
        self._records: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
        self._pending_key: tuple[Any, ...] | None = None  # the key of the batch being recorded
        self._eager: Any = None  # the compiler stance set for a compiled module's recorded step (_watch)
        # the check for matrix products of the step's own code outside module calls: active on the first recorded
        # batch of a fit (_watch), read at its end (_check_outside_products)
        self._outside: OutsideProducts | None = None
        self._outside_checked = False
        self._compiled = False  # this fit's module is compiled (setup)
        self._blocks: dict[
            tuple[int, ...], tuple[list[weakref.ref[nn.Module]], weakref.ref[Blocks] | None, str | None]
        ] = {}

    # The settings, also when set after the monitor was built (a notebook cell): checked as the constructor checks
    # them, and read where the monitor uses them (``nonfinite_loss`` is its guard's policy, ``interpolate_flops`` its
    # FLOPs meter's), so that a value set on the monitor is the value it runs with.

    @property
    def log_every_n_steps(self) -> int | None:
        """Steps between two ``effi/*`` rows; None: the Trainer's ``log_every_n_steps``."""
        return self._log_every_n_steps

    @log_every_n_steps.setter
    def log_every_n_steps(self, value: int | None) -> None:
        self._log_every_n_steps = (
            None if value is None else check_int("EfficiencyMonitor", "log_every_n_steps", value, 1)
        )

    @property
    def print_summary(self) -> bool:
        """Whether the fit's end prints the efficiency summary (rank 0)."""
        return self._print_summary

    @print_summary.setter
    def print_summary(self, value: bool) -> None:
        self._print_summary = check_bool("EfficiencyMonitor", "print_summary", value)

    @property
    def nonfinite_loss(self) -> str:
        """The non-finite training loss policy, ``"raise"`` or ``"warn"`` (its guard's)."""
        return self.nonfinite_guard.policy

    @nonfinite_loss.setter
    def nonfinite_loss(self, value: str) -> None:
        self.nonfinite_guard.policy = check_choice("EfficiencyMonitor", "nonfinite_loss", value, NONFINITE_POLICIES)

    @property
    def interpolate_flops(self) -> bool:
        """Whether FLOPs of a padded length between replayed ones are read off the quadratic they fit."""
        return self._meter.interpolate

    @interpolate_flops.setter
    def interpolate_flops(self, value: bool) -> None:
        value = check_bool("EfficiencyMonitor", "interpolate_flops", value)
        if value != self._meter.interpolate:  # a new meter: the old one cached the lengths it interpolated
            self._meter = FlopsMeter(interpolate=value)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(log_every_n_steps={self.log_every_n_steps!r}, "
            f"print_summary={self.print_summary!r}, nonfinite_loss={self.nonfinite_guard.policy!r}, "
            f"interpolate_flops={self.interpolate_flops!r})"
        )

    # ----------------------------------------------------------------------------------------- per batch
    def _downsampled_mask(self, batch: Any) -> float | None:
        """``T / L`` when the batch's tokens are read from an ``attention_mask`` of ``L`` positions per row beside no
        token ids, and the first transformer block sees fewer positions, ``T``, in ``[B, T, H]`` (or ``[T, B, H]``)
        hidden states whose ``H`` is a width of the block (a ``Linear`` or ``LayerNorm`` of it): a frontend that
        downsamples, as an HF audio batch's mask marks audio samples and the blocks see frames. The mask's count is
        scaled by it, with one warning. None otherwise (token ids: the mask marks them, whatever a model's blocks see;
        a model that prepends tokens sees more)."""
        self._mask_scale = None
        source = token_source(batch)
        shape = self._observed_shape
        if source is None or source[0] != "mask" or shape is None or combined_parts(self._train_loaders, batch):
            return None
        rows = key_padding_mask(source[1])
        if rows is None or rows.ndim != 2:
            return None
        if not self._observed_width or _has_token_ids(batch, tuple(rows.shape)):
            # token ids beside the mask: it marks them (a decoder's blocks, a step's ids[:, :-1]); hidden states
            # that are not [B, T, H] (a convolution's [B, C, T])
            return None
        size, length = int(rows.shape[0]), int(rows.shape[1])
        seq = shape[1] if shape[0] == size else shape[0] if shape[1] == size else None
        if seq is None or seq >= length:
            return None
        self._mask_scale = seq / length
        self._warn(
            "tokens/downsampled_mask",
            f"the batch's attention_mask has {length} positions per row, but the first transformer block sees {seq} "
            f"(a frontend that downsamples, e.g. audio samples to frames): tokens are the mask's real positions "
            f"scaled by {seq}/{length}, the positions the blocks process; define `effi_count_tokens(batch) -> int` "
            "on your LightningModule to count your own way",
        )
        return self._mask_scale

    def _warn_unread_mask(self, batch: Any) -> None:
        """Once: the tokens of a batch without token ids are the hidden states' positions, padding included, while
        the batch holds what looks like a padding mask (a 2-D bool tensor, or a 2-D tensor with ``mask`` in its
        name), which is read only beside token ids (without them its polarity, ``True`` real or padded, is
        unknown). A batch that holds its tensors in an object of its own class, not looked into, is said to be
        counted that way too (512 positions counted for 314 real tokens, qa45-break 04)."""
        if "tokens/unread_mask" in self._warned:  # said once: no walk of every later batch
            return
        holder = opaque_holder(batch)
        if holder is not None:
            self._warn(
                "tokens/unread_mask",
                f"the batch holds its tensors in a {holder}, which is not looked into (tensors are found in tuples, "
                "lists, mappings and dataclasses): its tokens are the positions of the hidden states the first "
                "transformer block receives, padding included. Make it a dataclass (its `attention_mask` is then "
                "read), or define `effi_count_tokens(batch) -> int` on your LightningModule",
            )
            return
        for path, value in tensor_leaves(batch):
            name = ".".join(str(p) for p in path) if isinstance(path, tuple) else str(path)
            if value.ndim == 2 and (value.dtype == torch.bool or "mask" in name.lower()):
                self._warn(
                    "tokens/unread_mask",
                    f"the batch has no token ids, so its tokens are the positions of the hidden states the first "
                    f"transformer block receives, padding included; its [B, T] tensor at {name!r} looks like a "
                    "padding mask, which is read only beside token ids (its polarity is unknown without them). Name "
                    "it `attention_mask` (1 or True = a real position) to count the real positions, or define "
                    "`effi_count_tokens(batch) -> int` on your LightningModule",
                )
                return

    def _prepended_positions(self, pl_module: pl.LightningModule, batch: Any) -> int | None:
        """Positions a row the first transformer block sees beyond the batch's token ids, ``T' - T``, when the step
        runs the blocks batch-first on ``[B, T', H]`` hidden states whose ``H`` is their width and ``T' > T``: image
        tokens a vision-language model puts in front of the text (``inputs_embeds``), a soft prompt, a BOS the model
        adds. The blocks process them, so tokens count them, with one warning (16 image tokens a row were left out
        of layer_tokens: 2,772 counted for 4,308, qa47-user 01). None otherwise (and for an encoder-decoder, whose
        blocks see another sequence). Kept for the batch's baseline (:attr:`_prepended`)."""
        self._prepended = None
        source = token_source(batch)
        shape = self._observed_shape
        if source is None or shape is None or len(shape) != 3 or not self._observed_width:
            return None
        rows = key_padding_mask(source[1]) if source[0] == "mask" else source[1]
        if rows is None or rows.ndim != 2 or self._observed_sequence_first or shape[0] != rows.shape[0]:
            return None
        extra = int(shape[1]) - int(rows.shape[1])
        if extra <= 0 or any(_is_encoder_decoder(m) for m in pl_module.modules()):
            return None
        self._prepended, self._prepended_rows = extra, tuple(rows.shape)
        # a speech batch's CTC targets [B, L] beside its frames were told "image tokens or a prefix" (qa48-speech 06)
        self._warn(
            "tokens/prepended",
            f"the first transformer block sees {shape[1]} positions a row, {extra} more than the batch's "
            f"{rows.shape[1]} token positions (image tokens or a prefix the model puts in front; or the batch's "
            "integer tensor is no input of the blocks, e.g. CTC targets beside audio features): tokens "
            f"count the positions the blocks see, {shape[1]} a row; define `effi_count_tokens(batch) -> int` on your "
            "LightningModule to count your own way",
        )
        return extra

    def _passes_over_ids(self, pl_module: pl.LightningModule, batch: Any, found: int, prepended: int = 0) -> float:
        """Tokens the step's passes of the blocks the token ids feed processed, per token of the batch's ids (``found``,
        with the first pass's ``prepended`` positions a row; 1.0 when not more; kept for the batch's baseline,
        :attr:`_ids_scale`). More passes: the network ran over other ids in the step, a contrastive pair's positive
        (``{"anchor", "positive"}``, supervised SimCSE) or two masked views of the ids, whose second pass was not
        counted (192 tokens for 384, qa61-ideas 01); tokens are scaled by it. Each pass counts on its own shape
        (:meth:`_pass_tokens`): a prefix the model puts in front of one pass only (a VLM's image + text pass beside
        text-only ones, 83 or 45 tokens for 68 by the order of the passes, qa67-break 05), views trimmed to the
        longest real row (38 or 57 tokens for 76, qa67-break 04). One pass processing fewer positions than the
        ``found`` tokens, by more than a position a row (a label shift): a front end that pools the ids (a stride-2
        k-mer convolution), warned once (layer_tokens 768 for the 384 positions the blocks process, qa57-seq 03); not
        a step that trims padding or runs the blocks over chunks of the ids (qa61-break 03). Read over the passes run
        with grad (a generate() in the step is none, qa62-break 01), only for blocks the ids or their embedding feed,
        one loader's batch, one sequence a row (not a preference pair's ``chosen_*`` / ``rejected_*``, counted as
        their sum)."""
        # the passes with grad: a generate() in the step (its prompt and decode steps) trains nothing (qa62-break 01)
        positions, source = self._observed_trained, token_source(batch)
        if not self._observed_fed or not positions or positions < 0 or source is None or sequence_groups(batch):
            return 1.0
        rows = key_padding_mask(source[1]) if source[0] == "mask" else source[1]
        if rows is None or rows.ndim != 2 or not rows.numel():
            return 1.0
        size, length = int(rows.shape[0]), int(rows.shape[1])
        real = real_positions(source[1], (size, length)) if source[0] == "mask" else None
        columns = length if real is None else int(real.any(0).sum())
        tokens = found - prepended * size
        total = sum(self._pass_tokens(shape, (size, length), tokens, columns) for shape in self._observed_passes)
        if total > found:
            self._ids_scale = total / found
        elif positions < found - int(rows.shape[0]) and "tokens/fewer_positions" not in self._warned:
            if any(_is_encoder_decoder(m) for m in pl_module.modules()):  # its blocks see another sequence
                self._warned.add("tokens/fewer_positions")
            else:
                self._warn(
                    "tokens/fewer_positions",
                    f"the transformer blocks process {positions} positions in the step, fewer than the batch's "
                    f"{found} tokens (a strided front end pooling the ids, or a step that runs the blocks on part of "
                    f"them): tokens count the ids, so layer_tokens are {found / positions:.3g} times the positions the "
                    "blocks process (saving fractions are not affected); define `effi_count_tokens(batch) -> int` "
                    "on your LightningModule to count the blocks' positions",
                )
        return self._ids_scale

    def _pass_tokens(self, shape: tuple[int, ...], rows: tuple[int, int], tokens: int, columns: int) -> float:
        """The tokens of one pass whose first block saw hidden states of ``shape`` (``[B', T', H]``, or ``[T', B',
        H]`` for a sequence-first block), beside token ids of ``rows`` ``(B, T)`` holding ``tokens`` real ones in
        ``columns`` columns that some row uses: over the ids' rows, the ids' tokens and, when ``T' > T``, the
        ``T' - T`` positions a row put in front (a CLS, image tokens); when ``columns <= T' < T``, the ids trimmed to
        their longest real row (the padding no row uses cut off), their tokens; else the ids' share of real
        positions in the pass's ``B' T'`` (chunks of the ids, another input's pass)."""
        if len(shape) != 3:
            return tokens * math.prod(shape[:-1]) / (rows[0] * rows[1])
        size, length = (shape[1], shape[0]) if self._observed_sequence_first else (shape[0], shape[1])
        if size == rows[0] and length >= rows[1]:
            return tokens + (length - rows[1]) * size
        if size == rows[0] and columns <= length:
            return tokens
        return tokens * size * length / (rows[0] * rows[1])

    def _lengthened_positions(self, batch: Any) -> int | None:
        """The baseline's tokens when the trained batch's blocks saw more positions than its token ids
        (:meth:`_prepended_positions`) and the technique cut another tensor than the ids: CTC targets ``[B, U]``
        beside audio features ``[B, T, F]`` cut to ``T' < T`` frames. The targets are no input of the blocks, whose
        positions follow the frames: the trained positions scaled by the batch's length ratio ``T / T'`` (a
        subsampling front end, ``T' / 4`` positions, scales alike). The saving read 0 (baseline 744 tokens for the
        744 trained, where the uncut batches have 1,048 positions; qa53-asr 02). None when the ids themselves
        changed length (a prefix in front of cut text keeps its count) or the shapes changed otherwise."""
        source = token_source(batch)
        if source is None or self._batch_shapes is None or self._observed_tokens is None:
            return None
        rows = key_padding_mask(source[1]) if source[0] == "mask" else source[1]
        if rows is None or tuple(rows.shape) != self._prepended_rows:
            return None
        ratio = _length_ratio(self._batch_shapes, _shapes(batch))
        return None if ratio is None or ratio == 1.0 else round(self._observed_tokens * ratio)

    def _warn_sequence_groups(self, batch: Any) -> None:
        """Once: a batch of several prefixed sequences (a preference pair's ``chosen_*`` / ``rejected_*``, TRL's
        ``prompt_*`` beside them) has its tokens counted as the sum of theirs (:func:`~lightning_effi.core.measure.
        sequence_groups`), which is what the network processes only when it runs each sequence once (qa46-user 01:
        TRL's prompt is run with each completion)."""
        groups = sequence_groups(batch)
        if groups is None:
            return
        shown = ", ".join(f"{name}: {n}" for name, n in groups)
        self._warn(
            "tokens/sequences",
            f"the batch holds several sequences ({shown} real tokens in the first batch): tokens count each once, "
            "their sum. If the network runs them otherwise (a prompt run with each of two completions, as TRL's "
            "DPO does), define `effi_count_tokens(batch) -> int` on your LightningModule",
        )

    def _warn_encoder_decoder(self, pl_module: pl.LightningModule, own_tokens: bool, batch: Any) -> None:
        """Warn once when the network is an encoder-decoder (a Hugging Face model whose config has
        ``is_encoder_decoder``, or ``torch.nn.Transformer``) and the module does not count its own tokens and layers:
        ``tokens`` are then read from the batch (its ``attention_mask``, the encoder's input; the tensor is named, a
        Whisper batch's only ids are its ``labels``) and ``layer_tokens`` are
        ``tokens`` times the depth of one block list, so both leave out the other side (a BART of 2 + 3 layers on
        512 source and 1,536 target tokens: 1,536 layer-tokens counted for 5,632, qa38-user 05). FLOPs are measured
        on the whole network and are exact."""
        if own_tokens and getattr(pl_module, "effi_num_layers", None) is not None:
            return
        found = next((m for m in pl_module.modules() if _is_encoder_decoder(m)), None)
        if found is None:
            self._warned.add("encoder_decoder")  # checked: nothing to say
            return
        blocks = self.find_blocks(pl_module)
        depth = ""
        if blocks is not None:
            where = next((n for n, m in pl_module.named_modules() if m is blocks), "")
            depth = f", {where} ({len(blocks)} blocks)" if where else f" ({len(blocks)} blocks)"
        # the tensor they are read from, named: a Whisper batch's only ids are its decoder's labels (the warning said
        # "the encoder's input", qa111-audio 01)
        source = token_source(batch)
        path = next((p for p, v in tensor_leaves(batch) if source is not None and v is source[1]), None)
        name = ".".join(map(str, path)) if path else ""
        read = f"`{name}`" if name else "token ids"
        if name.split(".")[-1] == "labels" or name.split(".")[-1].startswith("decoder_"):
            read += " (the decoder's targets, padding included; the encoder's input is not counted)"
        self._warn(
            "encoder_decoder",
            f"{type(found).__name__} in {type(pl_module).__name__} is an encoder-decoder: `tokens` count the batch's "
            f"{read} and `layer_tokens` multiply them by the depth of one block list{depth}, so both leave out the "
            "other side (its tokens, the other stack's layers); FLOPs are measured on the whole network and are "
            "exact: compare the runs on FLOPs, or define `effi_count_tokens(batch)` and `effi_num_layers` on your "
            "LightningModule to count your own way",
        )

    def _warn_other_blocks(self, pl_module: pl.LightningModule, own_tokens: bool) -> None:
        """Warn once when the module trains transformer blocks outside the block list ``layer_tokens`` counts (a
        Segmenter's mask decoder beside its ViT, a second tower): ``layer_tokens`` are the tokens times that list's
        depth, so they leave the other blocks out (8,320 counted for 12,672 with a 2-layer decoder, and random-LTD's
        layer-token saving read 0.254 for 0.167, qa44-user 03). Frozen blocks (a teacher, forward only) and lists inside
        the counted one are not named; an encoder-decoder has its own warning. FLOPs are measured on the whole
        network and are exact."""
        if own_tokens and getattr(pl_module, "effi_num_layers", None) is not None:
            return
        counted = self.find_blocks(pl_module)
        if counted is None or any(_is_encoder_decoder(m) for m in pl_module.modules()):
            return
        inside = {id(m) for m in counted.modules()}
        above = {id(m) for name, m in pl_module.named_modules() if any(x is counted for x in m.modules())}
        optimized = optimized_parameters(getattr(pl_module, "_trainer", None))  # a teacher out of them: not trained
        others: list[tuple[str, int]] = []
        for name, sub in pl_module.named_modules():
            if id(sub) in inside or id(sub) in above or not isinstance(sub, (nn.ModuleList, nn.Sequential)):
                continue
            entries = list(sub.children())
            if (
                len(entries) < 1
                or len({type(e) for e in entries}) != 1
                or not any(p.requires_grad and (optimized is None or id(p) in optimized) for p in sub.parameters())
            ):
                continue
            if not any(
                isinstance(m, nn.MultiheadAttention) or "attention" in type(m).__name__.lower() for m in sub.modules()
            ):
                continue
            if any(name.startswith(o + ".") for o, _ in others):
                continue  # a list inside one already named
            others.append((name, len(entries)))
        if not others:
            return
        path = next((n for n, m in pl_module.named_modules() if m is counted), "?")
        named = ", ".join(f"{n} ({d} blocks)" for n, d in others[:3])
        self._warn(
            "other_blocks",
            f"`layer_tokens` count the {len(counted)} blocks of {path}; {type(pl_module).__name__} also trains the "
            f"transformer blocks of {named}, which they leave out (and a technique's layer-token saving reads as a "
            "share of the first stack only); FLOPs are measured on the whole network and are exact: compare the runs "
            "on FLOPs, or define `effi_count_tokens(batch)` and `effi_num_layers` on your LightningModule",
        )

    def _end_outside_check(self) -> None:
        outside = self._outside
        if outside is not None and outside.active:
            outside.active = False
            try:
                outside.__exit__(None, None, None)
            except Exception as err:  # noqa: BLE001 - another function mode entered after it and still active
                rank_zero_warn(f"{type(self).__name__}: could not end its check of the step's products ({err!r})")

    def _check_outside_products(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, account: BatchAccount
    ) -> None:
        """At the end of the batch the check ran on (:class:`~lightning_effi.core.measure.OutsideProducts`): warn
        when the step's own code ran matrix products outside every module call worth more than 1% of the FLOPs
        counted for the batch's network calls. They are not counted (a replay measures module calls), so the FLOPs
        read low and every technique's FLOPs saving, a share of the network's, reads high."""
        outside, self._outside = self._outside, None
        if outside is None:
            return
        counted = float(account.baseline[QUANTITIES.index("flops")])
        if outside.flops <= 0.01 * max(counted, 1.0):
            return
        share = outside.flops / (outside.flops + counted)
        self._warn(
            "flops/outside_products",
            f"training_step runs matrix products outside any module call ({', '.join(outside.examples)}; "
            f"{outside.flops:.3g} FLOPs with their backward in the fit's first measured batch, {share:.0%} of the "
            f"batch's with the {counted:.3g} counted for the network's calls), which the FLOPs leave out: they read "
            "low, and the FLOPs saving of a technique on the network reads high. Compute them inside a module's "
            f"forward (an nn.Module head called by {type(pl_module).__name__}), or define "
            "effi_training_flops(batch) on the module",
        )

    def _warn(self, quantity: str, message: str) -> None:
        if quantity not in self._warned:
            self._warned.add(quantity)
            rank_zero_warn(f"{type(self).__name__}: {message}")

    @staticmethod
    def _own_flops(pl_module: pl.LightningModule) -> float:
        """The module's own ``flops_per_batch`` (0.0 if none), not a value an EfficiencyMonitor wrote there: while the
        attribute still holds the value last written (:data:`WRITTEN_FLOPS`, kept on the module instance, so across
        batches, fits and monitor instances), the module's own value from before that write."""
        value = getattr(pl_module, "flops_per_batch", None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return 0.0
        written = pl_module.__dict__.get(WRITTEN_FLOPS)
        if written is not None and value == written[1]:
            return float(written[0])
        return float(value)

    @classmethod
    def _write_flops(cls, pl_module: pl.LightningModule, flops: int) -> None:
        """Set ``pl_module.flops_per_batch`` (for Lightning's ``ThroughputMonitor``), remembering on the module the
        module's own value it replaces. A ``flops_per_batch`` the class defines as a property (Lightning's docs
        allow one) is the module's own figure and is left alone."""
        if isinstance(inspect.getattr_static(type(pl_module), "flops_per_batch", None), property):
            return
        own = cls._own_flops(pl_module)
        current, written = pl_module.__dict__.get("flops_per_batch", _ABSENT), pl_module.__dict__.get(WRITTEN_FLOPS)
        if written is None or current != written[1]:  # the first write, or a value set since: put back at the end
            pl_module.__dict__[ORIGINAL_FLOPS] = current
        pl_module.flops_per_batch = flops  # type: ignore[assignment]
        pl_module.__dict__[WRITTEN_FLOPS] = (own, flops)

    @staticmethod
    def _restore_flops(pl_module: pl.LightningModule) -> None:
        """The fit's end: ``pl_module.flops_per_batch`` back to the module's own (or removed, when it had none), unless
        something else set it since the last write, so that a later fit without the monitor (a ThroughputMonitor at
        another batch size) does not read the last batch's FLOPs as the module's."""
        written = pl_module.__dict__.pop(WRITTEN_FLOPS, None)
        original = pl_module.__dict__.pop(ORIGINAL_FLOPS, _ABSENT)
        if written is None or pl_module.__dict__.get("flops_per_batch", _ABSENT) != written[1]:
            return
        if original is _ABSENT:
            del pl_module.__dict__["flops_per_batch"]
        else:
            pl_module.__dict__["flops_per_batch"] = original

    def find_blocks(self, pl_module: nn.Module) -> Blocks | None:
        """The transformer block list of the network now in ``pl_module``
        (:func:`lightning_effi.core.measure.find_blocks`), cached per set of ``pl_module``'s direct children while
        the list found is still at its place in ``pl_module`` (a technique that swaps the network or its block list,
        the V-cycle at a level change, gets the new one's: with the full network's list kept, the coarse steps'
        tokens read 0 on a DiT, qa45-user 01)."""
        if self._chosen is not None:  # the list the last step ran with [B, T, H] hidden states, if still there
            chosen = _submodule(pl_module, self._chosen)
            if isinstance(chosen, (nn.ModuleList, nn.Sequential)) and len(chosen) > 0:
                return chosen
        children = list(pl_module.children())
        key = (id(pl_module), *map(id, children))
        cached = self._blocks.get(key)
        if cached is not None and all(r() is c for r, c in zip(cached[0], children)):
            found = None if cached[1] is None else cached[1]()
            if found is None and cached[2] is None:
                return None
            if found is not None and cached[2] is not None and _submodule(pl_module, cached[2]) is found:
                return found
        blocks = find_blocks(pl_module)
        name = None if blocks is None else next((n for n, m in pl_module.named_modules() if m is blocks), None)
        if len(self._blocks) >= 16:
            self._blocks.clear()
        self._blocks[key] = (
            [weakref.ref(c) for c in children],
            None if blocks is None else weakref.ref(blocks),
            name,
        )
        return blocks

    def _every_block(self, pl_module: pl.LightningModule, calls: list[CallRecord]) -> list[CallRecord]:
        """``calls`` on a network whose module lists hold more entries than when the step was recorded (the V-cycle's
        full model held in place of the coarse one, :class:`Baseline`), for each list whose every entry the step
        called itself (``for block in self.blocks``): the calls of the entries it has beyond them too, as those of
        the recorded entries (blocks of one shape). Otherwise ``calls`` as they are."""
        grown = [
            (name, len(m), self._recorded_lists[name])
            for name, m in pl_module.named_modules()
            if isinstance(m, nn.ModuleList | nn.Sequential) and len(m) > self._recorded_lists.get(name, len(m))
        ]
        if not grown:
            return calls

        def moved(call: CallRecord, old: str, new: str) -> CallRecord:
            target = new + call.target[len(old) :]
            return dataclasses.replace(call, target=target, parts=[moved(p, old, new) for p in call.parts])

        def grow(calls: list[CallRecord]) -> list[CallRecord]:
            # the parts too: a data-dependent forward is replayed through them, and its loop over the blocks was
            # replayed with the coarse network's blocks only (the V-cycle's FLOPs saving read 0, qa54-domains 03)
            calls = [dataclasses.replace(c, parts=grow(c.parts)) if c.parts else c for c in calls]
            extra: list[CallRecord] = []
            for name, length, depth in grown:
                prefix = f"{name}." if name else ""
                called: dict[int, list[CallRecord]] = {}
                for call in calls:
                    index = call.target[len(prefix) :] if call.target.startswith(prefix) else ""
                    if index.isdigit():
                        called.setdefault(int(index), []).append(call)
                if set(called) != set(range(depth)):
                    continue
                for j in range(depth, length):
                    extra += [moved(call, f"{prefix}{j % depth}", f"{prefix}{j}") for call in called[j % depth]]
            return [*calls, *extra]

        return grow(calls)

    def num_layers(self, pl_module: pl.LightningModule) -> int | None:
        """The module's ``effi_num_layers``, else the length of the network's block list (:meth:`find_blocks`),
        else None."""
        value = getattr(pl_module, "effi_num_layers", None)
        if value is not None:
            return int(value)
        blocks = self.find_blocks(pl_module)
        return None if blocks is None else len(blocks)

    def training_flops(self, pl_module: pl.LightningModule, batch: Any) -> float:
        """Training FLOPs (forward + backward) of ``batch`` on the network now in ``pl_module``, before any
        ``effi_adjust``: the module's ``effi_training_flops(batch)``, else its own ``flops_per_batch``, else the
        network's calls recorded in the current training batch replayed (module docstring), with the shapes of
        ``batch`` where they differ from the trained batch's. Valid from this monitor's ``on_train_batch_end`` until
        the next batch starts (inside a technique's ``Baseline.model`` context: that model's FLOPs).

        Raises:
            NotImplementedError: the FLOPs cannot be counted (the message says why and names the hook to define).
        """
        fn = getattr(pl_module, "effi_training_flops", None)
        if callable(fn):
            return float(fn(batch))
        own = self._own_flops(pl_module)
        if own:
            return own
        hint = "define `effi_training_flops(batch)` on your LightningModule (or set `flops_per_batch`)"
        if self._calls is None:
            raise NotImplementedError(f"no training step was recorded for this batch; {hint}")
        if not self._calls:
            raise NotImplementedError(
                f"no call of {type(pl_module).__name__} or of a submodule was seen in the training step; {hint}"
            )
        calls = self._every_block(pl_module, self._calls)
        try:
            if self._batch_shapes is not None and _shapes(batch) != self._batch_shapes:
                calls = [call.on_batch(batch, self._batch_shapes) for call in calls]
            flops = float(self._meter.flops(pl_module, calls))
        except MeasureError as err:
            raise NotImplementedError(f"{err}; {hint}") from err
        for name, (kind, why) in self._meter.left_out.items():
            self._warn(
                f"flops/left_out/{name}",
                f"the call of {kind} ({name}) in the training step is left out of the FLOPs: it has no parameters "
                f"and its outputs take no part in the backward (a data augmentation: preparation of the data, not "
                f"the network's compute), and it cannot be replayed ({why})",
            )
        for name, (kind, unused, parts) in self._meter.partial.items():
            self._warn(
                f"flops/partial/{name}",
                f"{kind} ({name}) makes a data-dependent shape in its forward, so its FLOPs are measured through the "
                f"module calls inside it ({', '.join(parts)}); the operations its own forward runs on its parameters "
                f"{', '.join(unused)} are not counted. If they are matrix products (a mixture-of-experts' experts held "
                f"as parameters), the FLOPs are too low: {hint}",
            )
        return flops

    def _samples_of(self, batch: Any, actual: bool) -> int | None:
        """The samples of one loader's batch (:func:`find_batch_size`): the second dimension of a sequence-first
        batch (``[T, B]`` ids, PyTorch's word-language-model layout) whose first block was called with ``[T, B, H]``
        hidden states and reads them sequence first (``batch_first=False``: ``T`` was counted as the samples, 72 for
        24, qa45-break 05); a warning, once, when the batch's tensors disagree on their first dimension (a graph
        batch: nodes read as the samples, qa45-break 03). ``actual``: the trained batch (not a baseline's)."""
        size = find_batch_size(batch)
        if size is None:
            return None
        shape = self._observed_shape if self._observed_sequence_first else None
        rnn = self._rnn_input if self._observed_shape is None else None  # no block list read the batch
        if (shape is not None and shape[0] != shape[1]) or rnn is not None:
            # the batch's [T, B] tensor: its first dimension is the one read as the samples
            lead = next((v for _, v in tensor_leaves(batch) if v.ndim >= 2 and int(v.shape[0]) == size), None)
            if lead is not None and shape is not None and tuple(lead.shape[:2]) == tuple(shape[:2]):
                return int(lead.shape[1])
            # a sequence-first RNN's rows are on axis 1, whatever steps the RNN runs (a BOS step in front, a strided
            # front end: qa58-break 07)
            if lead is not None and rnn is not None and int(lead.shape[1]) == rnn[1] != int(lead.shape[0]):
                return int(lead.shape[1])
        if actual and "samples/first_dims" not in self._warned:
            # a graph batch's first tensor may be 1-D (QM9's atomic numbers): the graph warning (qa115-regress 06)
            graph = _graph_like(batch)
            others = other_first_dims(batch, size) if graph or _flat_first(batch, size) else []
            if others:
                shown = ", ".join(f"{path}: {n}" for path, n in others[:4])
                self._warn(
                    "samples/first_dims",
                    f"samples are read as {size} a batch, a first dimension of the batch (labels, input_ids, "
                    "pixel_values or its first tensor), but its tensors disagree on their first dimension "
                    f"({shown}): if a sample is not a row of that tensor "
                    "(a graph batch's nodes, a sequence-first [T, B] batch), define `effi_count_samples(batch) -> "
                    "int` on your LightningModule"
                    if graph
                    else f"samples are read as {size} a batch, the length of its first tensor, a flat [{size}] one, "
                    f"but its other tensors disagree ({shown}): if a sample is not an entry of that tensor (an "
                    "EmbeddingBag's flat ids beside their offsets [B], a per-batch constant such as class weights "
                    "first in the batch), define `effi_count_samples(batch) -> int` on your LightningModule",
                )
        return size

    def module_stats(
        self, pl_module: pl.LightningModule, batch: Any, fallback: BatchStats | None = None, baseline: str = ""
    ) -> BatchStats:
        """The module's own counts of ``batch`` with the model in place (no ``effi_adjust``); a figure that cannot
        be found is ``fallback``'s (0 without one), with a warning (class docstring). ``baseline``: what the counts
        are of, for the warning, when they are a technique's baseline (``fallback`` given)."""

        def missing(quantity: str, message: str) -> int:
            self._warn(quantity, message)
            return 0 if fallback is None else int(getattr(fallback, quantity))

        kind = type(batch).__name__
        # several training loaders (Lightning's CombinedLoader): a batch of each, counted each and summed
        parts = combined_parts(self._train_loaders, batch) or [batch]
        count_samples = getattr(pl_module, "effi_count_samples", None)
        if callable(count_samples):
            size: int | None = int(count_samples(batch))
        else:
            sizes = [self._samples_of(part, fallback is None) for part in parts]
            size = None if all(n is None for n in sizes) else sum(n for n in sizes if n is not None)
        if size is None:
            holder = opaque_holder(batch)
            size = missing(
                "samples",
                f"samples cannot be counted: the {kind} batch "
                + (
                    ("is" if holder == kind else f"holds its tensors in a {holder}, which is")
                    + " not looked into (tensors are found in tuples, lists, mappings and dataclasses): make it a "
                    "dataclass, or define"
                    if holder is not None
                    else "has no tensor with a dimension; define"
                )
                + " `effi_count_samples(batch) -> int` on your LightningModule",
            )
        count_tokens = getattr(pl_module, "effi_count_tokens", None)
        if callable(count_tokens):
            found: int | None = int(count_tokens(batch))
        else:
            if fallback is None and "tokens/sequences" not in self._warned:
                self._warn_sequence_groups(batch)
            counts = [find_tokens(part) for part in parts]
            found = None if all(n is None for n in counts) else sum(n for n in counts if n is not None)
            scale = self._downsampled_mask(batch) if fallback is None else self._mask_scale
            if found is not None and scale is not None:
                found = round(found * scale)
            prepended = self._prepended_positions(pl_module, batch) if fallback is None else self._prepended
            lengthened = self._lengthened_positions(batch) if fallback is not None and prepended else None
            if fallback is None:
                self._ids_scale = 1.0
            if lengthened is not None:
                found = lengthened
            elif found is not None and len(parts) == 1:
                if prepended:
                    found += prepended * (find_batch_size(batch) or 0)
                passes = (
                    self._passes_over_ids(pl_module, batch, found, prepended or 0)
                    if fallback is None
                    else self._ids_scale
                )
                found = round(found * passes)
            if found is None and self._batch_shapes is not None and self._observed_tokens is not None:
                # the positions of the first block's hidden states (continuous features: no token ids); the batch
                # of a technique that restored a cut sequence axis (the curriculum's) scaled by its length
                ratio = _length_ratio(self._batch_shapes, _shapes(batch))
                if ratio is not None:
                    found = round(self._observed_tokens * ratio)
                    self._warn_unread_mask(batch)
        tokens = found
        if tokens is None and fallback is None and _image_batch(batch) and self.num_layers(pl_module) is None:
            # images (a float [B, C, H, W] tensor) through a network without transformer blocks: no tokens to count,
            # said once; a CNN was told to define effi_count_tokens in every run (qa86-user 04)
            if "tokens" not in self._warned:
                self._warned.add("tokens")
                rank_zero_info(
                    f"{type(self).__name__}: the {kind} batch holds images and {type(pl_module).__name__} no "
                    "transformer blocks: tokens and layer-tokens are 0 (samples and FLOPs are counted); define "
                    "`effi_count_tokens(batch) -> int` on your LightningModule if its samples have tokens"
                )
            tokens = 0
        if tokens is None:
            tokens = missing(
                "tokens",
                f"tokens (and layer-tokens) cannot be counted: the {kind} batch has no `attention_mask`, `input_ids` "
                "or integer [B, T] tensor, and no transformer block of the network was called with [B, T, H] hidden "
                "states; define `effi_count_tokens(batch) -> int` on your LightningModule",
            )
        layers = self.num_layers(pl_module)
        if "encoder_decoder" not in self._warned and fallback is None:
            self._warn_encoder_decoder(pl_module, callable(count_tokens), batch)
            self._warn_other_blocks(pl_module, callable(count_tokens))
        if layers is not None:
            layer_tokens = tokens * layers
        elif found is None:  # already warned about tokens
            layer_tokens = 0 if fallback is None else fallback.layer_tokens
        else:
            layer_tokens = missing(
                "layer_tokens",
                f"layer-tokens cannot be counted: no transformer block list was found in {type(pl_module).__name__} "
                "(no registered adapter matches, no nn.ModuleList / nn.Sequential of identical blocks); set "
                "`effi_num_layers` (int) on your LightningModule",
            )
        try:
            flops = self.training_flops(pl_module, batch)
        except NotImplementedError as err:
            if fallback is None:
                self._warn("flops", f"training FLOPs cannot be counted: {err}")
                flops = 0.0
            else:  # the baseline's batch (before a technique changed its shapes); the trained FLOPs were counted
                self._warn(
                    "baseline_flops",
                    f"the baseline's training FLOPs ({baseline or 'the run without a technique'}) cannot be "
                    f"counted: {err}. The trained FLOPs are counted; the baseline's are taken as equal to them, so "
                    "the FLOPs saving of that technique reads 0 (baseline_flops understates a plain run's)",
                )
                flops = fallback.flops
        return BatchStats(size, tokens, layer_tokens, flops)

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
        scale: Counts = (1.0, 1.0, 1.0, 1.0)
        changed_batch, before = batch, raw
        models: list[Callable[[], AbstractContextManager[Any]]] = []
        for callback in reversed(callbacks):
            hook = baseline_hook(callback)
            change = hook(changed_batch, pl_module) if hook is not None else None
            if change is None:
                continue
            scale = _scaled(scale, change.factors())
            if change.batch is None and change.model is None:
                raised = _scaled(current, change.factors())
            else:
                if not callable(getattr(pl_module, "effi_training_flops", None)) and self._own_flops(pl_module):
                    what = "a smaller model" if change.model is not None else "shorter batches"
                    name = technique_name(callback)
                    self._warn(
                        f"constant_flops/{name}",
                        f"{name} trains {what}, but {type(pl_module).__name__}.flops_per_batch is one figure for "
                        f"every batch, so the FLOPs saving of {name} reads 0 (its tokens and layer-tokens are "
                        "counted); define `effi_training_flops(batch)` on the module (the FLOPs of that batch on the "
                        "network in place), or remove flops_per_batch to have the monitor measure them",
                    )
                changed_batch = changed_batch if change.batch is None else change.batch
                models = models if change.model is None else [*models, change.model]
                with ExitStack() as stack:
                    for enter in models:
                        stack.enter_context(enter())
                    what = (
                        f"{technique_name(callback)}'s full model in place of the smaller one it trains"
                        if change.model is not None
                        else f"the batch before {technique_name(callback)} changed its shapes"
                    )
                    before = self.module_stats(pl_module, changed_batch, fallback=before, baseline=what)
                raised = _scaled(before.values(), scale)
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
        reserve_hook_ids(pl_module)  # hooks of its own ids (lightning_effi.core.hook_ids: a spawned rank's module)
        # a new fit counts from zero; a resumed one gets its totals back from the checkpoint after setup; a further
        # fit of the Trainer whose last fit this monitor counted to its end goes on counting
        if stage == "fit":
            self._check_order(trainer)
            self._recorded_key = None  # a compiled module is recorded again in every fit (_watch)
            self._records.clear()
            self._outside_checked = False
            self._chosen, self._ranked = None, None  # the block list is seen again in this fit's steps
            # the summary is of a fit that ended: a further fit of the Trainer that stops on an error or Ctrl+C
            # left the one before's, which write_result then recorded with this fit's length (qa110-notebook 01)
            self.summary = {}
            self._late_start = None
            if trainer.global_step > 0:
                if self._ended_at == (id(trainer), trainer.global_step):
                    return
                # refused at train start unless a checkpoint gives the totals back (on_load_checkpoint, after setup):
                # a fit of this Trainer resumed with ckpt_path= after its last one raised was refused here, advising
                # that very call (qa110-regress 06)
                self._late_start = trainer.global_step
            self._logged_step = None  # a new fit logs its own rows (this monitor may have logged another Trainer's)
            base = COUNT_KEYS + TIME_KEYS + ("time_total",) + BASELINE_KEYS
            self.totals = dict.fromkeys([*base, *self._technique_keys(trainer)], 0.0)
            self.curve, self.schedule = [], []
            self._skipped_validations = []
            self._last_states = self._last_position = None
            self._change_points = 0
            self.nonfinite_guard.count, self.nonfinite_guard.first_step = 0, None

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
        """Start the fit's clock. In a resumed fit, also have the training loader built again once Lightning has
        restored the loops: one built earlier, by ``configure_optimizers`` reading
        ``trainer.estimated_stepping_batches`` (a OneCycle or cosine schedule sized by it), would miss the
        checkpoint's mid-epoch position and replay the epoch from its start, silently, in a run without a technique
        (which would do the same: :func:`~lightning_effi.core.compat.rebuild_train_loader_after_restore`, Lightning
        issue #20550)."""
        rebuild_train_loader_after_restore(trainer)
        self._compiled = _is_compiled(pl_module)  # after the module's setup / configure_model, which may compile
        self._bar_names, self._warned_skip = {}, False
        self._fit_start = time.perf_counter()
        self._fit_total_before = self.totals["time_total"]

    def _bar_name(self, trainer: pl.Trainer, key: str, short: str) -> str:
        """The name technique state ``key`` is shown under in the progress bar (and so in
        ``trainer.callback_metrics``): ``short``, unless the module already logged a metric of that name this fit
        (a ``level`` of its own, which it would overwrite there, and so in a ``ModelCheckpoint(monitor=...)``): then
        ``key`` (``vcycle/level``). Chosen at the state's first batch of the fit."""
        name = self._bar_names.get(key)
        if name is None:
            name = key if short != key and short in trainer.callback_metrics else short
            self._bar_names[key] = name
        return name

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._late_start is not None:
            step, self._late_start = self._late_start, None
            raise MisconfigurationException(
                f"{type(self).__name__}: this fit starts at step {step} of a Trainer that has trained before, but "
                "the monitor did not count that training to its end (it was not in that fit, or the fit stopped on "
                "an error), so its totals (samples, tokens, FLOPs, time) would cover only this fit while "
                "optimizer_steps counts them all; add the monitor to the first fit, resume from a checkpoint with "
                "trainer.fit(..., ckpt_path=...), or train on a fresh Trainer"
            )
        # Lightning skips on_train_epoch_start for the epoch a mid-epoch checkpoint resumes into: the loaders of a
        # CombinedLoader were unknown there, and the rest of that epoch was counted as one loader's (qa57-loops 01)
        self._train_loaders = trainer.train_dataloader
        self._mark = self._now(pl_module)
        lbfgs = [o for o in trainer.optimizers if isinstance(o, torch.optim.LBFGS)]
        if lbfgs and "flops/closure" not in self._warned:
            # LBFGS re-evaluates the closure, training_step and its backward, up to max_iter times a step, which the
            # counts of one batch cannot see (the FLOPs of 10 calls read as 2, qa62-break 06)
            max_iter = max(int(o.defaults.get("max_iter", 1)) for o in lbfgs)
            self._warn(
                "flops/closure",
                f"{type(lbfgs[0]).__name__} evaluates its closure (training_step, forward and backward) up to "
                f"max_iter={max_iter} times an optimizer step, and the monitor counts each batch once: flops, tokens "
                "and samples count one evaluation a step, up to that many times fewer than the run computed",
            )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train_loaders = trainer.train_dataloader  # built (or rebuilt) for this epoch by now
        self._mark = self._now(pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = self._now(pl_module)
        if self._mark is not None:
            self.totals["time_data"] += now - self._mark
        # the monitor's own work, not the data's: the first batch's search of the model for its block lists took
        # ~1 s of time_data (it imports timm; qa48-hydra 01)
        self._watch(pl_module, batch)
        self._step_at_batch_start = trainer.global_step
        self._open_batch, self._backward_seen = batch, False
        self._batch_start = self._now(pl_module)
        self.totals["time_monitor"] += self._batch_start - now

    def _watch(self, pl_module: pl.LightningModule, batch: Any) -> None:
        """Before the training step: record the network's calls when FLOPs must be measured, and the first
        transformer block's hidden states when the batch does not tell the tokens (class docstring).

        A compiled module (``trainer.fit(torch.compile(model))``, or a compiled submodule) is recorded once per
        regime: at a batch of the shapes of a recorded one (among the last :data:`MAX_COMPILED_RECORDS` regimes),
        on a network of the same parameter shapes, that record stands and no hook is set; the recorded step runs
        uncompiled (``torch.compiler.set_stance("force_eager")``, restored after the step). The recording hooks run
        at every module call and break dynamo's graph there: compiled with them, the model trained as some twenty
        small graphs at every step. Only the last regime was kept: dynamically padded batches, whose length changes
        from one step to the next among a few, ran 39 of 40 steps uncompiled (qa97-user 01)."""
        self._unwatch(None)
        key = self._compiled_key(pl_module, batch)
        if key is not None and key == self._recorded_key:
            return  # the record of this regime stands
        if key is not None and (record := self._records.get(key)) is not None:
            self._records.move_to_end(key)
            for name, value in record.items():
                setattr(self, name, value)
            self._recorded_key = key
            return
        self._recorded_key, self._pending_key = None, key
        # the parameters the optimizers hold: a teacher left requires_grad=True but out of them, run under no_grad,
        # is no trained stack (_choose_observed; its 8 blocks counted for the student's 4, qa113-distill 03)
        self._optimized = optimized_parameters(getattr(pl_module, "_trainer", None))
        self._calls, self._batch_shapes, self._observed_tokens, self._observed_shape = None, None, None, None
        self._observed_sequence_first = False
        self._observed_width = False
        self._observed_fed, self._observed_trained, self._observed_passes = False, None, []
        self._rnn_input = None
        if not callable(getattr(pl_module, "effi_count_samples", None)):
            # a sequence-first recurrent network (nn.LSTM / nn.GRU with batch_first=False, PyTorch's word-language
            # model): its [T, B, H] input tells the samples of a [T, B] batch (T was counted, 140 for 24, qa57-seq 02)
            # a cell (nn.LSTMCell / nn.GRUCell / nn.RNNCell) stepped over a [T, B] batch's rows reads [B, H]
            # (the seq2seq tutorials' decoder loop: 16 counted for 4, qa60-break 01)
            for module in pl_module.modules():
                if (isinstance(module, nn.RNNBase) and not module.batch_first) or isinstance(module, nn.RNNCellBase):
                    self._block_hooks.append(module.register_forward_pre_hook(WeakHook(self, "_observe_rnn")))
        if key is not None:  # the recorded step runs uncompiled: the hooks would break the graph dynamo keeps
            self._eager = torch.compiler.set_stance("force_eager")
        if not callable(getattr(pl_module, "effi_training_flops", None)) and not self._own_flops(pl_module):
            self._recorder.start(pl_module, batch)
            if not self._outside_checked and key is None:  # once per fit; not under torch.compile
                self._outside_checked = True
                self._outside = OutsideProducts(self._recorder)
                self._outside.__enter__()
                self._outside.active = True
            self._recorded_lists = {
                name: len(m) for name, m in pl_module.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential)
            }
        if not callable(getattr(pl_module, "effi_count_tokens", None)):  # positions, and a mask's downsampling
            self._watched, self._seen, self._attention_seen = self._candidates(pl_module), {}, {}
            self._next_pass, self._fed_ids, self._rows = set(), set(), _token_rows(batch)
            self._last_block = {}
            self._outputs, self._pass_values, self._running, self._embedded = {}, {}, {}, []
            self._entered = {}
            self._trained_positions, self._trained_shapes, self._untrained_pass = {}, {}, {}
            self._pass_marks = {}
            if self._rows is not None:  # the ids' embeddings: which tower they feed, and passes over other ids
                for module in pl_module.modules():
                    if isinstance(module, nn.Embedding):
                        self._block_hooks.append(module.register_forward_hook(WeakHook(self, "_embedded_ids")))
            for i, (name, blocks) in enumerate(self._watched):
                for runner in block_runners(pl_module, name, blocks):
                    hook = runner.register_forward_pre_hook(WeakHook(self, "_pass", i), with_kwargs=True)
                    self._block_hooks.append(hook)
                    # also when the call raises (one the step catches: its count of calls under way stayed up and no
                    # later pass was read, 128 tokens for 256, qa71-break 02)
                    hook = runner.register_forward_hook(WeakHook(self, "_ran", i), always_call=True)
                    self._block_hooks.append(hook)
                # every block: the first one the step runs (a LayerDrop may skip block 0, qa47-break 02)
                for position, block in enumerate(blocks.children()):
                    # also when the call raises: the pass it began is dropped (_failed)
                    hook = block.register_forward_hook(WeakHook(self, "_returned", i), always_call=True)
                    self._block_hooks.append(hook)
                    observe = WeakHook(self, "_observe", i, position)
                    hook = block.register_forward_pre_hook(observe, with_kwargs=True)
                    self._block_hooks.append(hook)
                    attention = next((m for m in block.modules() if isinstance(m, nn.MultiheadAttention)), None)
                    if attention is not None and not attention.batch_first:
                        hook = attention.register_forward_pre_hook(
                            WeakHook(self, "_observe_attention", i), with_kwargs=True
                        )
                        self._block_hooks.append(hook)

    def _compiled_key(self, pl_module: pl.LightningModule, batch: Any) -> tuple[Any, ...] | None:
        """For a compiled module (:func:`_is_compiled`, read at setup), what a record depends on: the batch's shapes
        and the network's parameter shapes (a V-cycle level changes them); None for a module that is not compiled
        (recorded at every step: its step may call other modules on other batches)."""
        if not self._compiled:
            return None
        return (repr(_shapes(batch)), tuple(tuple(p.shape) for p in pl_module.parameters()))

    def _candidates(self, pl_module: nn.Module) -> list[tuple[str, Blocks]]:
        """The block lists of the network now in ``pl_module`` (:func:`~lightning_effi.core.measure.
        block_candidates`: the first :data:`WATCHED_LISTS`, and the one chosen at the steps before wherever it
        ranks) with their paths, each watched in the step."""
        # cached per set of module lists (a V-cycle level change or a swapped network makes another): finding them
        # walks every module and reads an adapter, ~0.1 s a step on a 12-layer GPT-2
        key = (
            id(pl_module),
            *((id(m), len(m)) for m in pl_module.modules() if isinstance(m, nn.ModuleList | nn.Sequential)),
        )
        if self._ranked is None or self._ranked[0] != key:
            lists = block_candidates(pl_module)
            names = {id(m): n for n, m in pl_module.named_modules() if any(m is x for x in lists)}
            self._ranked = (key, [(names[id(x)], x) for x in lists if id(x) in names])
        ranked = self._ranked[1]
        return ranked[:WATCHED_LISTS] + [r for r in ranked[WATCHED_LISTS:] if r[0] == self._chosen]

    def _pass(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A call of a module that runs watched list ``index`` (:func:`~lightning_effi.core.measure.block_runners`),
        outside a backward (not a recompute of activation checkpointing). Called on a tensor it was not called on
        before in the step (a view of the batch, or one made in the step by augmentation), it is another pass of the
        network over other data, whose first block call adds its positions (SimCLR's second view, qa50-clip 04,
        qa53-break 02); called again on the same tensor or one of the same values (R-Drop, a probe without grad) or on
        what it returned (a weight-shared core applied to its own output), it adds none: those positions are counted
        once, as token ids are (qa52-break 05)."""
        self._entered[id(module)] = self._entered.get(id(module), 0) + 1
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        if self._rows is not None and any(
            not a.is_floating_point() and tuple(a.shape[:2]) == self._rows for a in tensors
        ):
            self._fed_ids.add(index)
        elif tensors and self._embedded and self._from_embedded(tensors[0]):
            self._fed_ids.add(index)
        running = self._running.get(index, 0)
        self._running[index] = running + 1
        if running or _in_backward():  # a runner inside another's call (a model holding its encoder's list too)
            return
        # the pass before is whole: a raise in this call drops what this call adds, from here (the values it was
        # called on too: a retry on the same values read as R-Drop, one view of two counted, qa78-break 01), and keeps
        # the pass before
        self._pass_marks[index] = self._counts_before(index)
        first = pass_input(args, kwargs)
        if first is None or self._returned_before(index, first):
            return
        # another tensor of the same values (R-Drop embedding the same batch again) is the same data
        if not self._seen_values(index, first) and index in self._seen:
            self._next_pass.add(index)

    def _ran(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        """The end of a call of a module that runs watched list ``index`` (:meth:`_pass`; a call that raised in a hook
        before this monitor's was not counted under way)."""
        if self._entered.get(id(module), 0):
            self._running[index] = max(0, self._running.get(index, 0) - 1)
        self._returned(index, module, args, output)

    def _embedded_ids(self, module: nn.Module, args: Any, output: Any) -> None:
        """An ``nn.Embedding`` called on integers of the batch's token ids' rows ``(B, T)``, or on ``(B, T')``,
        ``T' < T`` (the ids with the padding no row uses trimmed off before the embedding: two trimmed views were one
        pass, qa67-break 04): its output, for :meth:`_from_embedded`."""
        ids = args[0] if args and isinstance(args[0], Tensor) else None
        if (
            ids is not None
            and self._rows is not None
            and not ids.is_floating_point()
            and ids.ndim >= 2
            and ids.shape[0] == self._rows[0]
            and 0 < ids.shape[1] <= self._rows[1]
            and isinstance(output, Tensor)
            and not output.is_nested
        ):
            self._embedded.append(_Returned(weakref.ref(output), storage_ref(output), output.grad_fn, output.shape))

    def _from_embedded(self, value: Tensor) -> bool:
        """Whether ``value`` is the embedding of the batch's token ids (:meth:`_embedded_ids`) or computed from it (a
        position embedding added, a dropout): a tower called on ``self.tok(ids)``, the token embedding held outside
        it (tied with a head, shared with a decoder), is the tower the ids feed, and the image tower was counted
        instead (layer-tokens 1,024 for 512, qa54-break 08)."""
        if any(r.tensor() is value for r in self._embedded):
            return True
        storage = storage_ref(value)
        if storage is not None and any(r.storage is not None and r.storage() is storage() for r in self._embedded):
            return True
        return derived_from(value, {id(r.grad_fn) for r in self._embedded if r.grad_fn is not None})

    def _seen_values(self, index: int, value: Tensor) -> bool:
        """Whether watched list ``index`` began a pass in the step on ``value`` or on a tensor of the same values;
        ``value`` is remembered."""
        earlier = self._pass_values.setdefault(index, [])
        # an earlier tensor changed in place since (x.mul_(-1): a strong augmentation of the same tensor after a
        # pass on it) holds other values now, a new one (qa54-break 07)
        same = any(_version(e) == version and same_values(e, value) for e, version in earlier)
        earlier.append((value, _version(value)))
        return same

    def _returned(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        """The tensor a watched list's network or one of its blocks returned (its first tensor leaf): a later call
        on it continues the pass (a loop over the blocks), it begins none (:meth:`_pass`, :meth:`_observe`)."""
        entered = self._entered.get(id(module), 0)
        if entered:
            self._entered[id(module)] = entered - 1
        if output is None and sys.exc_info()[0] is not None:  # the call raised
            # not the early stop of a checkpoint's recompute, which raises to end it; a call that raised before this
            # monitor's pre-hook (a user's pre-hook) ends the pass under way only where it would have continued it
            # (_continues_pass; where it would have begun another, the pass before it was dropped: a trained view
            # lost, qa77-regress 01)
            if not _in_backward() and (entered or self._continues_pass(index, module, args)):
                self._failed(index)
            return
        value = output if isinstance(output, Tensor) else next((v for _, v in tensor_leaves(output)), None)
        if value is not None and not value.is_nested:  # a nested tensor (a fast path's padded output) has no shape
            returned = _Returned(weakref.ref(value), storage_ref(value), value.grad_fn, tuple(value.shape))
            self._outputs.setdefault(index, []).append(returned)

    def _continues_pass(self, index: int, module: nn.Module, args: Any) -> bool:
        """Whether a call of ``module`` on ``args`` continues the pass under way of watched list ``index``: a block
        after the last one run in the step, or one called on what a block returned (a weight-shared block called
        again, qa78-regress 01)."""
        last = self._last_block.get(index)
        blocks = self._watched[index][1] if index < len(self._watched) else None
        if last is None or blocks is None:
            return False
        position = next((p for p, b in enumerate(blocks.children()) if b is module), None)
        if position is None:
            return False
        hidden = next((a for a in args if isinstance(a, Tensor)), None) if isinstance(args, tuple) else None
        return position > last or (hidden is not None and self._returned_before(index, hidden))

    def _keep_mark(self, index: int, mark: tuple[Any, ...]) -> None:
        """Keep ``mark`` as where the pass of watched list ``index`` begun now began (:meth:`_failed`), unless a call
        of the list's network under way marked it, before its blocks (:meth:`_pass`)."""
        if not self._running.get(index, 0) or index not in self._pass_marks:
            self._pass_marks[index] = mark

    def _counts_before(self, index: int) -> tuple[Any, ...]:
        """What watched list ``index``'s counts are before a pass begins (:meth:`_failed` restores them)."""
        return (
            self._seen.get(index),
            self._trained_positions.get(index),
            len(self._trained_shapes.get(index, ())),
            len(self._pass_values.get(index, ())),
            self._untrained_pass.get(index),
            self._last_block.get(index),
        )

    def _failed(self, index: int) -> None:
        """A block (or the network) of watched list ``index`` raised: the pass it began is not counted, and the step's
        retry begins its own (a caught out-of-memory error, the batch rerun in halves: 256 tokens for 128,
        qa74-regress 01)."""
        mark = self._pass_marks.pop(index, None)
        if mark is None:
            return
        seen, trained, shapes, values, untrained, last = mark
        for store, value in ((self._seen, seen), (self._trained_positions, trained), (self._untrained_pass, untrained)):
            if value is None:
                store.pop(index, None)
            else:
                store[index] = value
        del self._trained_shapes.get(index, [])[shapes:]
        del self._pass_values.get(index, [])[values:]
        if last is None:
            self._last_block.pop(index, None)
        else:
            self._last_block[index] = last
        self._next_pass.discard(index)

    def _returned_before(self, index: int, value: Tensor) -> bool:
        """Whether ``value`` is a tensor watched list ``index``'s network or one of its blocks returned in the step,
        or one made from it of its shape: a detached or viewed one (the same storage), or one computed from it in the
        graph (:func:`~lightning_effi.core.measure.derived_from`: a clone, a norm or a step embedding between the loops
        of a weight-shared stack, recycling; such a loop counted a second pass, qa54-break 03, 04). An input of another
        shape made from an output holds other positions too (a memory beside a new segment, an encoder's output beside
        a decoder's input): another pass (qa55-break 01)."""
        if value.is_nested:
            return False
        returned = [r for r in self._outputs.get(index, ()) if r.shape == tuple(value.shape)]
        if any(r.tensor() is value for r in returned):
            return True
        # the storage is held weakly: it lives while a tensor uses it (the detached one), never mistaken for a new
        # tensor at a freed address
        storage = storage_ref(value)
        if storage is not None and any(r.storage is not None and r.storage() is storage() for r in returned):
            return True
        # through a concatenation along the positions only where all its data comes from the output: a memory of the
        # output's shape in front of a new segment is another pass (80 tokens for 160, qa69-break 02), a CLS put back
        # in front of a lap's output or a state joined to the embeddings on the feature axis is not (qa70-break 01)
        return derived_from(value, {id(r.grad_fn) for r in returned if r.grad_fn is not None}, whole_cat=False)

    def _observe(
        self, index: int, position: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """The first call, in the step, of a block of watched list ``index`` (block 0 unless a LayerDrop skipped it):
        its hidden states' tokens and shape, and whether their last dimension is a width of the block; at each later
        pass of the network (:meth:`_pass`), the tokens of its first block call are added. A block the step runs
        itself, outside a call of the list's network (blocks the LightningModule holds, run by a method of its own;
        a view through the network beside one through the step's own loop was one pass, qa68-break 03), begins
        another pass where it is at or before the last block run, outside a backward. A pass counts when it trains
        (:meth:`_add_trained`)."""
        self._entered[id(module)] = self._entered.get(id(module), 0) + 1
        hidden = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if hidden is not None and hidden.is_nested and not forward_trains():
            # a no_grad probe on PyTorch's fast path trains nothing and has no shape: not observed (before the views
            # it left the step unread, 58 tokens for 116, qa66-break 03, qa67-break 07)
            return
        mark = self._counts_before(index)
        last, self._last_block[index] = self._last_block.get(index), position
        if hidden is not None and hidden.is_nested:  # no shape to count: the passes are not read (qa65-break 02)
            self._trained_positions[index] = -1
        if index in self._seen:
            again = (
                not self._running.get(index, 0)  # a block the step runs itself (beside a pass through the runner)
                and last is not None
                and position <= last
                and not _in_backward()
                and hidden is not None
                and not self._returned_before(index, hidden)  # not a loop over the blocks
                and not self._seen_values(index, hidden)  # not the same data again (R-Drop)
            )
            if index in self._next_pass or again:
                self._keep_mark(index, mark)
                self._next_pass.discard(index)
                first, shape, wide = self._seen[index]
                more = hidden_tokens(args, kwargs)
                self._untrained_pass.pop(index, None)
                if first is not None and more is not None and hidden is not None:
                    self._seen[index] = (first + more, shape, wide)
                    self._add_trained(index, more, tuple(hidden.shape))
            elif last is not None and position <= last:  # another lap, or a pass over the same data: not counted
                self._untrained_pass.pop(index, None)  # a held pass that trained nothing (a probe) ends
            elif (
                index in self._untrained_pass
                and forward_trains()
                and not _in_backward()
                and hidden is not None
                # not computed from a block's output with grad (another pass going on: targets run block by block
                # beside the trained view, qa71-break 05); a trainable adapter after the frozen blocks is this pass
                # (qa72-break 03)
                and not derived_from(hidden, {id(r.grad_fn) for r in self._outputs.get(index, ()) if r.grad_fn})
            ):
                self._add_trained(index, *self._untrained_pass.pop(index))  # trained after a frozen first block
            return
        self._keep_mark(index, mark)
        tokens = hidden_tokens(args, kwargs)  # None for a nested tensor
        if hidden is not None and not self._running.get(index, 0):
            self._seen_values(index, hidden)
        if (
            hidden is not None
            and not hidden.is_nested  # a nested tensor (a fast path's padded input) has no shape
            and (
                (self._embedded and self._from_embedded(hidden))  # blocks run by the step itself
                # the only list, on hidden states of the ids' rows: a frozen embedding has no graph to follow, and a
                # position embedding added makes new storage (two views counted once, qa62-break 02)
                or (len(self._watched) == 1 and self._rows is not None and tuple(hidden.shape[:2]) == self._rows)
            )
        ):
            self._fed_ids.add(index)
        if tokens is not None and hidden is not None:
            self._add_trained(index, tokens, tuple(hidden.shape))
        if tokens is None or hidden is None:
            self._seen[index] = (None, None, False)
            return
        width = int(hidden.shape[-1])
        self._seen[index] = (
            tokens,
            tuple(hidden.shape),
            any(
                (isinstance(m, nn.Linear) and m.in_features == width)
                or (isinstance(m, nn.LayerNorm) and tuple(m.normalized_shape) == (width,))
                for m in module.modules()
            ),
        )

    def _add_trained(self, index: int, positions: int, shape: tuple[int, ...]) -> None:
        """A pass of watched list ``index`` over ``positions`` positions, whose first block saw hidden states of
        ``shape``: counted when it trains; a pass begun under ``no_grad`` (a frozen first block, or a probe) is held
        until a later block of it trains (two views through a frozen stem counted as one pass, qa68-break 06)."""
        if not forward_trains():
            self._untrained_pass[index] = (positions, shape)
        elif self._trained_positions.get(index, 0) >= 0:
            self._trained_positions[index] = self._trained_positions.get(index, 0) + positions
            self._trained_shapes.setdefault(index, []).append(shape)

    def _observe_rnn(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """The input shape of the step's first call of a sequence-first ``nn.RNNBase``: ``[T, B, H]``, or of a
        ``PackedSequence`` its steps and rows (``pack_padded_sequence``'s, the usual way to feed one: T was counted as
        the samples, qa58-break 04); of an ``nn.RNNCellBase`` (one step), ``(1, B, H)`` from its ``[B, H]`` input."""
        if self._rnn_input is not None or not args:
            return
        value = args[0]
        if isinstance(module, nn.RNNCellBase):
            if isinstance(value, torch.Tensor) and value.ndim == 2:  # one step of every row: [B, H]
                self._rnn_input = (1, int(value.shape[0]), int(value.shape[1]))
            return
        if isinstance(value, torch.Tensor) and value.ndim == 3:
            self._rnn_input = tuple(int(d) for d in value.shape)
        elif isinstance(value, nn.utils.rnn.PackedSequence) and value.batch_sizes.numel():
            steps, rows = int(value.batch_sizes.numel()), int(value.batch_sizes[0])
            self._rnn_input = (steps, rows, int(value.data.shape[-1]))

    def _observe_attention(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The query shape of the first call of a sequence-first ``nn.MultiheadAttention`` in that block: the block
        passes its ``[T, B, H]`` input on when it is the block's own input shape (a block that transposes a
        batch-first input gives it another, qa46-break 04)."""
        query = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if index not in self._attention_seen and query is not None:
            self._attention_seen[index] = tuple(query.shape)

    def _choose_observed(self, trained: bool, batch: Any = None) -> None:
        """After the step: the hidden states of the list remembered from the steps before when the step ran it with
        ``[B, T, H]`` ones (a V-cycle's coarse network keeps its place beside a bigger second tower, qa47-user 03),
        else of the best watched list the step ran with them, one whose last dimension is a width of its blocks first
        (a list never run, an EMA copy, or run on pooled ``[B, H]`` features, a probe's MLP head, is passed over; a
        convolutional feature encoder's ``[B, C, S]`` comes last, qa47-break 02), and of those first a list whose
        hidden states have the rows and positions of the batch's token ids (``batch``'s; of two, one whose network
        was called with an integer tensor of that shape): the tower the ids feed, so
        that tokens and layer-tokens count one tower (a CLIP's text tokens times its image tower's depth, and the
        image tower's 17 positions a row added to 10 text positions as a prefix, qa50-clip 01, 02); that list is
        remembered (``trained``: the step trained) for :meth:`find_blocks`."""
        run = [i for i in range(len(self._watched)) if (self._seen.get(i) or (None,))[0] is not None]
        wide = [i for i in run if self._seen[i][2]]
        index = next((i for i in run if self._watched[i][0] == self._chosen and (self._seen[i][2] or not wide)), None)
        if index is None:
            if not run:
                return
            rows = _token_rows(batch)
            pool = wide or run
            optimized = self._optimized
            trainable = [
                i
                for i in pool
                if any(
                    p.requires_grad and (optimized is None or id(p) in optimized)
                    for p in self._watched[i][1].parameters()
                )
            ]
            # of those, the lists the step ran with grad: a teacher left requires_grad=True, run under no_grad
            trained_now = [i for i in trainable if self._trained_positions.get(i, 0) != 0]
            # among the trainable lists first: a frozen text encoder the ids feed beside a trained DiT (qa52-break 01)
            fed = [i for i in (trained_now or trainable or pool) if rows is not None and self._sees_rows(i, rows)]
            index = ([i for i in fed if i in self._fed_ids] or fed or pool)[0]
        tokens, shape, width = self._seen[index]
        self._observed_tokens, self._observed_shape, self._observed_width = tokens, shape, width
        self._observed_sequence_first = shape is not None and self._attention_seen.get(index) == shape
        self._observed_fed = index in self._fed_ids
        self._observed_trained = self._trained_positions.get(index)
        self._observed_passes = self._trained_shapes.get(index, [])
        if trained:
            self._chosen = self._watched[index][0]

    def _sees_rows(self, index: int, rows: tuple[int, int]) -> bool:
        """Whether watched list ``index`` was called with ``[B, T, H]`` hidden states of ``rows`` ``(B, T)`` (or
        ``[T, B, H]`` ones read by a sequence-first attention)."""
        shape = self._seen[index][1]
        if shape is None or len(shape) != 3:
            return False
        if self._attention_seen.get(index) == shape:
            return (shape[1], shape[0]) == rows
        return (shape[0], shape[1]) == rows

    def _unwatch(self, batch: Any) -> None:
        """After the training step (``batch``: the trained batch) or on an error (None): remove the hooks."""
        if self._eager is not None:
            self._eager.__exit__(None, None, None)  # the stance before the recorded step
            self._eager = None
        if self._outside is not None:  # the check ends with the step (read by _check_outside_products)
            self._end_outside_check()
            if batch is None:  # an error, or a batch Lightning skipped after its start: the next batch checks
                self._outside, self._outside_checked = None, False
        if self._recorder.active:
            self._recorder.stop(batch)
            self._calls = self._recorder.calls
        for hook in self._block_hooks:
            hook.remove()
        self._block_hooks, self._pass_values, self._outputs, self._embedded = [], {}, {}, []
        if self._watched:
            self._choose_observed(batch is not None, batch)
            self._watched = []
        if batch is not None:
            self._batch_shapes = _shapes(batch)
            if self._pending_key is not None:  # a compiled module's record of this regime (_watch)
                self._recorded_key = self._pending_key
                self._records[self._pending_key] = {name: getattr(self, name) for name in _RECORD_FIELDS}
                self._records.move_to_end(self._pending_key)
                while len(self._records) > MAX_COMPILED_RECORDS:
                    self._records.popitem(last=False)
        self._pending_key = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._count_batch(trainer, pl_module, batch, batch_idx, skipped_batch(pl_module, outputs))
        states = schedule_states(trainer)
        for (key, name), value in zip(_progress_bar_names(states).items(), states.values()):
            # the techniques' state in the progress bar
            bar = self._bar_name(trainer, key, name)
            pl_module.log(bar, value, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)
        self._end_step(trainer, states, lambda: self._log(trainer, pl_module))
        self._mark = self._now(pl_module)

    def _count_batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, skipped: bool
    ) -> None:
        """Add the trained ``batch`` to :attr:`totals` (``skipped``: Lightning trained nothing on it)."""
        now = self._now(pl_module)
        if self._batch_start is not None:
            self.totals["time_train"] += now - self._batch_start
        self._unwatch(batch)
        self._open_batch = None
        if skipped:  # training_step returned None: Lightning trained nothing on it
            if not self._warned_skip:
                rank_zero_warn(
                    f"EfficiencyMonitor: training_step returned None at batch {batch_idx} (Lightning skips such a "
                    "batch: no backward, no update); skipped batches are not counted as trained (samples, tokens, "
                    "FLOPs, batches)"
                )
                self._warned_skip = True
            if self._outside is not None:  # nothing trained: the check runs on the next batch
                self._outside, self._outside_checked = None, False
            self._write_flops(pl_module, 0)
        elif getattr(trainer.fit_loop, "_skip_backward", False):
            # a forward-only epoch: StochasticWeightAveraging's batch-norm update of the averaged weights (no backward,
            # no optimizer step); counted, it read as a training epoch (samples 200 for 160 trained, and with
            # InfoBatch two savings for one run)
            if not self._warned_forward_only:
                rank_zero_warn(
                    f"EfficiencyMonitor: epoch {trainer.current_epoch} runs forward passes only (Lightning skips the "
                    "backward and the optimizer step: StochasticWeightAveraging's batch-norm update); its batches are "
                    "not counted as trained (samples, tokens, FLOPs, batches), in the run and in its baseline alike"
                )
                self._warned_forward_only = True
            self._outside = None
            self._write_flops(pl_module, 0)
        else:
            started, replays = time.perf_counter(), self._meter.replays
            account = self.account(trainer, pl_module, batch)
            self.totals["time_monitor"] += time.perf_counter() - started
            self._replayed_batches += int(self._meter.replays > replays)
            self._check_outside_products(trainer, pl_module, account)
            for q, actual, baseline in zip(QUANTITIES, account.actual.values(), account.baseline):
                self.totals[q] += actual
                self.totals[f"baseline_{q}"] += baseline
            for name, values in account.saved.items():
                for q, v in zip(QUANTITIES, values):
                    key = f"saved/{name}/{q}"
                    self.totals[key] = self.totals.get(key, 0.0) + v
            self.totals["batches"] += 1
            # for Lightning's ThroughputMonitor (listed after this one)
            self._write_flops(pl_module, int(account.actual.flops))
            self._warn_replays()

    #: batches with a replay of the FLOPs after which a run that replays at most of its batches is warned about
    #: (:meth:`_warn_replays`)
    MANY_REPLAYS = 20

    def _warn_replays(self) -> None:
        """Warn once when the FLOPs replay runs at most batches: their shapes differ in more than one size (a graph
        batch's nodes and edges, which no length interpolation reads), and the monitor's time grows with the run:
        28 replays in 40 batches, 1.27 s of the monitor for 0.08 s of training (qa54-domains 04)."""
        replays, batches = self._replayed_batches, int(self.totals["batches"])
        if self._warned_replays or replays < self.MANY_REPLAYS or replays * 2 < batches:
            return
        self._warned_replays = True
        rank_zero_warn(
            f"EfficiencyMonitor: the training FLOPs were measured by a replay at {replays} of the {batches} batches "
            "so far (their shapes differ in more than one size, e.g. a graph batch's nodes and edges, so no length "
            f"interpolation applies); the monitor has spent {self.totals['time_monitor']:.1f} s against "
            f"{self.totals['time_train']:.1f} s of training (time_monitor_s), and each new shape replays again. "
            "Define `effi_training_flops(batch) -> float` on your LightningModule (or set flops_per_batch) to "
            "count them without replays"
        )

    def _end_step(self, trainer: pl.Trainer, states: dict[str, float], log: Callable[[], dict[str, float]]) -> None:
        """After a batch is counted: at an optimizer step, the schedule's change points (and the fit's first step,
        where the schedules start) and, every ``log_every_n_steps`` steps, ``log()`` (the cumulative totals, logged)
        and a schedule point."""
        every = self.log_every_n_steps or trainer.log_every_n_steps  # type: ignore[attr-defined]
        # logged after the optimizer step, every `every` steps: never a micro-batch inside an accumulation window
        # (its cumulative figures would be logged at the step before, next to that step's own)
        stepped = self._step_at_batch_start is not None and trainer.global_step != self._step_at_batch_start
        self._step_at_batch_start = None
        if stepped:
            logging_step = trainer.global_step % max(every, 1) == 0
            if states and self._last_states is None and not self.schedule and not logging_step:
                # the fit's first step: where the schedules start (a 30-step run logging every 50 began its plot at
                # the first change, step 10; qa48-ts 02)
                self._add_schedule(self._local_point(trainer) | states)
                self._change_points += 1
            self._record_change(trainer, states, logging_step)
            if logging_step:
                totals = log()
                if states:
                    self._add_schedule(self._point(trainer, totals) | states)
            self._last_states, self._last_position = states, self._local_point(trainer)

    def _record_change(self, trainer: pl.Trainer, states: dict[str, float], logging_step: bool) -> None:
        """Schedule points where a technique's state changed since the last optimizer step (a V-cycle level switch, a
        new difficulty or reserved length): the last step with the old state and, unless this is a logging step
        (which adds its own point), this step with the new one, so that a switch between two logging steps is seen
        where it happened. At most :data:`MAX_CHANGE_POINTS` per fit. These points hold the cumulative figures on
        one device; under DDP only ``step``, ``epoch`` and the states (the figures are summed over the ranks at the
        logging steps only: a state of one rank may change alone, so no collective is taken here)."""
        previous = self._last_states
        if not states or previous is None or states == previous or self._change_points >= MAX_CHANGE_POINTS:
            return
        before = self._last_position
        if before is not None and (not self.schedule or self.schedule[-1]["step"] < before["step"]):
            self._add_schedule(before | previous)
            self._change_points += 1
        if not logging_step and self._change_points < MAX_CHANGE_POINTS:
            self._add_schedule(self._local_point(trainer) | states)
            self._change_points += 1

    def _local_point(self, trainer: pl.Trainer) -> dict[str, Any]:
        """A schedule point's position without a collective: :meth:`_point` on one device, ``step`` and ``epoch``
        under DDP."""
        if trainer.world_size > 1:
            return {"step": int(trainer.global_step), "epoch": int(trainer.current_epoch)}
        return self._point(trainer, self.totals)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """The non-finite loss policy (``nonfinite_loss``; :class:`~lightning_effi.core.nonfinite.NonFiniteLossGuard`).

        Raises:
            NonFiniteLossError: ``loss`` is NaN or infinite and the policy is ``"raise"``.
        """
        self._backward_seen = True
        if self._outside is not None:  # the step's forward is done: the backward and the optimizer's products are not
            self._end_outside_check()  # the step's own code (an optimizer such as Muon multiplies matrices)
        self.nonfinite_guard.check(trainer, loss)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """The fit raised: remove the hooks. A batch that trained, whose ``on_train_batch_end`` raised in a callback
        listed before this monitor, is counted: Lightning resumes a checkpoint written now (``OnExceptionCheckpoint``,
        run after this hook) after that batch."""
        if self._open_batch is not None and saving_in_train_batch_end(trainer):
            skipped = open_batch_skipped(trainer, pl_module, self._backward_seen)
            self._count_batch(trainer, pl_module, self._open_batch, trainer.fit_loop.epoch_loop.batch_idx, skipped)
            if trainer.world_size == 1:  # no collective here: the other ranks may not have raised
                self._end_step(trainer, schedule_states(trainer), lambda: dict(self.totals))
        self._unwatch(None)
        self._open_batch = None
        self._restore_flops(pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unwatch(None)
        if stage == "fit":
            self._restore_flops(pl_module)
            self._ranked = None  # its lists hold the fit's modules: not kept alive after it

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start = self._now(pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._eval_start is not None:
            self.totals["time_eval"] += self._now(pl_module) - self._eval_start
            self._eval_start = None
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            totals = self.reduced_totals(trainer)  # a collective: every rank validates
            logged = trainer.callback_metrics.items()
            metrics = {k: float(v) for k, v in logged if k.startswith("val") and v.numel() == 1}
            self.curve.append(self._point(trainer, totals) | {"metrics": dict(sorted(metrics.items()))})
            self._check_skipped_points(trainer.global_step)
            # the states that trained this step, as the training batch's end read them: a technique may have
            # changed its state since (the V-cycle switches levels in its on_train_batch_end, before validation)
            last = self._last_position
            states = self._last_states if last is not None and last["step"] == trainer.global_step else None
            if states := states or schedule_states(trainer):
                self._add_schedule(self._point(trainer, totals) | states)
            # the row of this validation's val/loss holds the compute trained before it (an epoch-end validation's
            # row is not an epoch end's, nor a logging step's; qa89-break 03, 08)
            self._log(trainer, pl_module, totals)
        self._mark = self._now(pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._logged_step != logging_step(trainer, epoch_end=True):  # the epoch's last row, if not logged yet
            self._log(trainer, pl_module, epoch_end=True)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ended_at = (id(trainer), int(trainer.global_step))
        self._check_skipped_points(None)
        self.summary = self.compute_summary(trainer)
        if self.print_summary and trainer.is_global_zero:
            print_block(format_summary(self.summary))  # one write: safe under a live rich display (console.py)
        self.nonfinite_guard.report_at_end()
        pending, self.after_summary = self.after_summary, []
        for write in pending:  # write_result called in on_fit_end by a callback listed before this one
            write()

    def _check_skipped_points(self, step: int | None) -> None:
        """Once a resumed fit has validated at or past a step of :attr:`_skipped_validations` (``step``; None: at the
        fit's end), warn if the curve lacks that step's point. A checkpoint written before a step's validation ended
        (at the batch's end, as ``ModelCheckpoint(every_n_train_steps=...)`` writes it with ``val_check_interval`` at
        the same steps, or during the validation, as ``OnExceptionCheckpoint`` does) is resumed past the validation,
        which never runs: the curve, and ``result.json``'s, had a gap at that step, told nowhere (qa96-break 01,
        qa97-regress 03)."""
        pending = []
        for due in self._skipped_validations:
            if step is not None and step < due:
                pending.append(due)
            elif step != due and not any(point.get("step") == due for point in self.curve):
                self._warn(
                    f"curve/skipped_validation/{due}",
                    f"this run resumed a checkpoint written before step {due}'s validation ended (at that step's "
                    "batch end, or during the validation), and Lightning resumes such a checkpoint past the "
                    f"validation without running it: the curve (result.json's validation curve, its plot) has no "
                    f"point at step {due}. Its totals and the other points are the uninterrupted run's. A "
                    "checkpoint written after the validation keeps the point (ModelCheckpoint(monitor=...), which "
                    "saves at validation end, or every_n_train_steps at steps without a validation)",
                )
        self._skipped_validations = pending

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
            "time_monitor_s": t["time_monitor"],
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
            settle = getattr(callback, "effi_before_summary", None)  # ReportsSummary's optional hook (every rank)
            if callable(settle) and callback is not self:
                settle(trainer)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            extra = getattr(callback, "effi_summary", None)  # the ReportsSummary hook
            if callable(extra) and callback is not self:
                summary.update(extra())
        return summary

    def _add_schedule(self, point: dict[str, Any]) -> None:
        """One schedule point per optimizer step: a second one at the same step (a validation right after a logging
        step) replaces the first."""
        if self.schedule and self.schedule[-1]["step"] == point["step"]:
            self.schedule[-1] = point
        else:
            self.schedule.append(point)

    @staticmethod
    def _point(trainer: pl.Trainer, totals: Mapping[str, float]) -> dict[str, Any]:
        """The cumulative figures of a curve or schedule point (:attr:`curve`)."""
        return {
            "step": int(trainer.global_step),
            "epoch": int(trainer.current_epoch),
            "samples": int(totals["samples"]),
            "tokens": int(totals["tokens"]),
            "layer_tokens": int(totals["layer_tokens"]),
            "flops": float(totals["flops"]),
            "train_wall_s": float(totals["time_train"] + totals["time_data"]),
        }

    def _log(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        totals: dict[str, float] | None = None,
        epoch_end: bool = False,
    ) -> dict[str, float]:
        """Write the cumulative totals (``totals``, else summed over the ranks now: every rank calls this) to the
        loggers at Lightning's logging step (:func:`~lightning_effi.core.compat.logging_step`), once per step: the
        first writer of a row keeps it. A validation writes the compute trained before it into its row (the row of
        its ``val/loss``), which a training step ending later at the same logging step (inside an accumulation
        window) does not overwrite."""
        t = self.reduced_totals(trainer) if totals is None else totals
        step = logging_step(trainer, epoch_end)
        if self._logged_step == step:
            return t
        self._logged_step = step
        if not trainer.loggers or not trainer.is_global_zero:
            return t
        metrics = {"effi/" + k.replace("time_", "time/"): v for k, v in t.items() if k != "batches"}
        metrics.update({"effi/" + k: v for k, v in self.savings(t).items()})
        metrics.update(nonfinite_metrics(trainer.callbacks))  # type: ignore[attr-defined]  # {} if one asks "raise"
        for logger in trainer.loggers:  # in the rows of the module's own metrics of this batch (qa88-sweeps 02)
            logger.log_metrics(metrics, step=step)
        return t

    @staticmethod
    def _now(pl_module: pl.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    # ---------------------------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        self.totals["time_total"] = self._elapsed_total()
        return {
            "totals": {k: float(v) for k, v in self.totals.items()},
            "curve": [dict(p) for p in self.curve],
            "schedule": [dict(p) for p in self.schedule],
            # where the schedule's change points stand (_record_change), so that a resumed fit records the same ones
            "last_states": None if self._last_states is None else dict(self._last_states),
            "last_position": None if self._last_position is None else dict(self._last_position),
            "change_points": self._change_points,
            "nonfinite_loss": self.nonfinite_guard.state_dict(),
        }

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Under DDP, write the totals of ALL ranks: each rank counts what it computed, and a checkpoint holds rank 0's
        callback state only, so a resumed run would give every rank rank 0's counts (a run whose ranks computed
        different tokens or FLOPs, e.g. sentences of unequal length, resumed with other totals than the uninterrupted
        run's). The counts are summed and the times maxed over ranks here (Lightning builds the checkpoint on every
        rank: the collective runs everywhere), as :meth:`reduced_totals` does; on load rank 0 takes the sums and
        the other ranks' counts start from zero, so the summed totals go on as the uninterrupted run's. A checkpoint
        written on one device is marked the same way, so that a DDP fit resumed from it counts its totals once."""
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if not isinstance(state, dict):
            return
        if self._open_batch is not None and saving_in_train_batch_end(trainer):
            state.update(self._state_after_batch(trainer, pl_module))  # summed over the ranks under DDP
        elif trainer.world_size > 1:
            state["totals"] = self.reduced_totals(trainer)
        # on one device too: a DDP fit resumed from it must not give every rank the whole run's counts
        state["totals_over_ranks"] = True
        # the validations a fit resumed from this checkpoint goes past without running: this step's, when the
        # checkpoint comes before its end and its point; and those still pending from this fit's own resume (a run
        # resumed again before it validated past them: qa97-regress 02)
        step, skipped = int(trainer.global_step), list(self._skipped_validations)
        before_end = (saving_in_train_batch_end(trainer) and validation_follows_batch(trainer)) or (
            trainer.validating and not trainer.sanity_checking and trainer.state.fn == "fit"
        )
        if before_end and not any(point.get("step") == step for point in self.curve):
            skipped.append(step)
        if skipped:
            state["skipped_validations"] = sorted(set(skipped))

    def _state_after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """:meth:`state_dict` as it will stand after the open batch's ``on_train_batch_end``, for a checkpoint written
        inside ``on_train_batch_end`` before this monitor's own (a user's callback listed before the monitor calls
        ``trainer.save_checkpoint`` there, or raised there and ``OnExceptionCheckpoint`` saved). Lightning resumes
        such a checkpoint after the batch, so the batch is counted in it (its totals left the batch out, and the
        resumed fit's totals missed one batch: qa38-break 01). The monitor's own state is left as it was: its
        ``on_train_batch_end`` counts the batch and logs as at every batch."""
        kept = {
            name: getattr(self, name)
            for name in (
                "_batch_start",
                "_step_at_batch_start",
                "_last_states",
                "_last_position",
                "_change_points",
                "_warned_skip",
                "_warned_forward_only",
            )
        }
        totals, schedule, batch = dict(self.totals), list(self.schedule), self._open_batch
        try:
            skipped = open_batch_skipped(trainer, pl_module, self._backward_seen)
            self._count_batch(trainer, pl_module, batch, trainer.fit_loop.epoch_loop.batch_idx, skipped)
            self._end_step(trainer, schedule_states(trainer), lambda: self.reduced_totals(trainer))
            state = self.state_dict()
            if trainer.world_size > 1:
                state["totals"] = self.reduced_totals(trainer)
            return state
        finally:
            for name, value in kept.items():
                setattr(self, name, value)
            self.totals, self.schedule, self._open_batch = totals, schedule, batch

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A resumed ``fit`` from a checkpoint without this monitor's state (written by a fit without it) at a step
        above 0 is refused (``MisconfigurationException``): the totals would start at 0 there, as in a further fit
        of a Trainer the monitor did not count (:meth:`setup`). A resumed ``fit`` whose checkpoint holds the state of
        a shipped technique (:data:`TECHNIQUE_NAMES`) that this Trainer does not have warns, naming it: the run goes on
        without it (Lightning only says that callback states were not loaded), its savings so far stay in the
        totals, and the run's record names the technique (:func:`~lightning_effi.report.record.make_record`), so
        that the report never takes it for a baseline.

        Outside ``fit`` (``trainer.validate / test / predict(ckpt_path=...)``) the checkpoint's state is ignored
        (:meth:`load_state_dict`): the monitor keeps the counts, curve and summary of the fit it counted. A
        ``trainer.test(ckpt_path="best")`` after the fit (Lightning's default for a ``ModelCheckpoint`` with a
        monitor) rolled them back to the best checkpoint's step, and ``write_result`` recorded that step's validation
        as the fit's final one beside the whole fit's FLOPs (qa83-report 01)."""
        from lightning.pytorch.trainer.states import TrainerFn

        self._loading_rank = trainer.global_rank  # load_state_dict, called next: rank 0 takes the summed counts
        self._evaluating = trainer.state.fn != TrainerFn.FITTING
        if self._evaluating:
            return
        self._late_start = None  # the checkpoint's totals replace this Trainer's uncounted training (setup)
        check_coarse_vcycle_resume("EfficiencyMonitor", trainer, checkpoint)
        step = checkpoint.get("global_step", 0)
        if self.state_key not in checkpoint.get("callbacks", {}) and isinstance(step, int) and step > 0:
            raise MisconfigurationException(
                f"{type(self).__name__}: this fit resumes a checkpoint at step {step} written by a fit without an "
                "EfficiencyMonitor, so its totals (samples, tokens, FLOPs, time) would cover only the steps after "
                f"{step} while optimizer_steps counts them all; resume from a checkpoint of a fit with the monitor, or "
                "train from the start with it (load the weights into a fresh fit to measure only what follows)"
            )
        present = {type(c).__qualname__ for c in trainer.callbacks}  # type: ignore[attr-defined]
        dropped = sorted(
            {key.split("{", 1)[0] for key in checkpoint.get("callbacks", {}) if isinstance(key, str)}
            & set(TECHNIQUE_NAMES) - present
        )
        if dropped:
            rank_zero_warn(
                f"EfficiencyMonitor: this fit resumes a checkpoint trained with {', '.join(dropped)}, which this "
                f"Trainer does not have: the run goes on without {'it' if len(dropped) == 1 else 'them'}. Its "
                "savings so far stay in the totals, and the run's record names it as a technique of the run (not a "
                "baseline); to continue the technique, resume with the same callbacks"
            )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The checkpoint's totals. Savings of a technique this run does not have are kept (it saved them before);
        a checkpoint written before the baseline was counted gets the baseline of its computed counts (no saving
        before the resume); one written before the non-finite loss policy (no ``"nonfinite_loss"``) counts none.
        Everything is checked before anything is restored (see Raises in the class docstring). Ignored for a
        checkpoint restored outside ``fit`` (:meth:`on_load_checkpoint`)."""
        if self._evaluating:
            self._evaluating, self._loading_rank = False, 0
            return
        if not isinstance(state_dict.get("totals"), Mapping):
            raise ValueError(
                "EfficiencyMonitor.load_state_dict: the checkpoint's monitor state has no totals dict (a damaged or "
                "edited checkpoint: resume from another one)"
            )
        totals = dict(state_dict["totals"])
        unknown = {k for k in totals if not k.startswith("saved/")} - set(self.totals)
        if unknown:
            raise KeyError(f"EfficiencyMonitor state has unknown keys {sorted(unknown)}")
        totals.setdefault("time_monitor", 0.0)  # a checkpoint written before it was counted
        missing = [k for k in (*COUNT_KEYS, *TIME_KEYS, "time_total") if k not in totals]
        if missing:
            raise ValueError(
                f"EfficiencyMonitor.load_state_dict: the checkpoint's totals lack {missing}; resumed, they would "
                "restart at 0 (a damaged or edited checkpoint: resume from another one)"
            )
        for name in ("curve", "schedule"):
            points = state_dict.get(name, [])
            if not isinstance(points, (list, tuple)) or not all(isinstance(p, Mapping) for p in points):
                raise ValueError(
                    f"EfficiencyMonitor.load_state_dict: the checkpoint's {name} must be a list of dicts, got "
                    f"{type(points).__name__} {points!r:.80} (a damaged or edited checkpoint: resume from another one)"
                )
        for key, value in totals.items():
            # counts, baseline counts and times are sums of non-negative amounts; a saving may be negative (a
            # technique that raised a count) but is finite
            saving = key.startswith("saved/")
            if not is_real(value) or (not saving and value < 0):
                allowed = "a finite number" if saving else "a finite number >= 0"
                raise ValueError(
                    f"EfficiencyMonitor.load_state_dict: the checkpoint's totals.{key} is {value!r}; it must be "
                    f"{allowed} (a damaged or edited checkpoint: resume from another one)"
                )
        # absent in checkpoints written before the schedule's change points: none recorded across the resume
        last_states, last_position = state_dict.get("last_states"), state_dict.get("last_position")
        change_points = state_dict.get("change_points", 0)
        if not (
            (last_states is None or (isinstance(last_states, Mapping) and all(map(is_real, last_states.values()))))
            and (last_position is None or (isinstance(last_position, Mapping) and is_int(last_position.get("step"))))
            and is_int(change_points)
            and change_points >= 0
        ):
            raise ValueError(
                "EfficiencyMonitor.load_state_dict: the checkpoint's last_states (a dict of numbers or None), "
                "last_position (a dict with an int step, or None) and change_points (an int >= 0) are not valid: "
                f"{_brief_value(last_states)}, {_brief_value(last_position)}, {change_points!r} (a damaged or edited "
                "checkpoint: resume from another one)"
            )
        skipped = state_dict.get("skipped_validations", [])
        if "skipped_validation" in state_dict and "skipped_validations" not in state_dict:
            # one step, as a3ea8c7's checkpoints wrote it (a resume lost its warning, qa98-regress 01)
            old = state_dict["skipped_validation"]
            skipped = [] if old is None else [old] if is_int(old) else old
        if not isinstance(skipped, (list, tuple)) or not all(is_int(v) and v >= 0 for v in skipped):
            raise ValueError(
                "EfficiencyMonitor.load_state_dict: the checkpoint's skipped_validations must be a list of steps "
                f"(ints >= 0), got {_brief_value(skipped)} (a damaged or edited checkpoint: resume from another one)"
            )
        guard = NonFiniteLossGuard(type(self).__name__, self.nonfinite_guard.policy)
        nonfinite = state_dict.get("nonfinite_loss")
        if nonfinite is not None:
            if not isinstance(nonfinite, Mapping):
                raise ValueError(
                    f"EfficiencyMonitor.load_state_dict: the checkpoint's nonfinite_loss must be a dict (the "
                    f"non-finite loss count), got {type(nonfinite).__name__} (a damaged or edited checkpoint)"
                )
            guard.load_state_dict(dict(nonfinite))
        for q in QUANTITIES:
            totals.setdefault(f"baseline_{q}", totals.get(q, 0.0))
        rank, self._loading_rank = self._loading_rank, 0
        if state_dict.get("totals_over_ranks") and rank > 0:  # rank 0 holds every rank's counts (on_save_checkpoint)
            totals.update({k: 0.0 for k in totals if k not in TIME_KEYS and k != "time_total"})
        self.nonfinite_guard.count, self.nonfinite_guard.first_step = guard.count, guard.first_step
        self.totals.update({k: float(v) for k, v in totals.items()})
        self._fit_total_before = self.totals["time_total"]
        self.curve = [dict(p) for p in state_dict.get("curve", [])]
        self.schedule = [dict(p) for p in state_dict.get("schedule", [])]
        # absent in checkpoints written before the schedule's change points: none recorded across the resume
        self._last_states = None if last_states is None else dict(last_states)
        self._last_position = None if last_position is None else dict(last_position)
        self._change_points = change_points
        self._skipped_validations = sorted({int(v) for v in skipped})


#: the regimes of a compiled module whose records are kept (EfficiencyMonitor._watch)
MAX_COMPILED_RECORDS = 64

#: what one recorded step leaves for the steps of its regime (set by EfficiencyMonitor._watch and _unwatch)
_RECORD_FIELDS = (
    "_calls",
    "_batch_shapes",
    "_observed_tokens",
    "_observed_shape",
    "_observed_sequence_first",
    "_observed_width",
    "_observed_fed",
    "_observed_trained",
    "_observed_passes",
    "_rnn_input",
    "_recorded_lists",
)


class _Returned(NamedTuple):
    """A tensor a watched list's network or block returned (:meth:`EfficiencyMonitor._returned`)."""

    tensor: weakref.ref[Tensor]
    storage: weakref.ref[Any] | None
    grad_fn: Any
    shape: tuple[int, ...]


def _version(value: Tensor) -> int:
    """``value``'s in-place change counter (-1 for an inference tensor, which keeps none)."""
    try:
        return int(value._version)
    except RuntimeError:
        return -1


def _token_rows(batch: Any) -> tuple[int, int] | None:
    """``(B, T)`` of a batch's token ids or attention mask (:func:`~lightning_effi.core.measure.token_source`),
    batch-first; None for a batch without them."""
    if batch is None:
        return None
    source = token_source(unwrap(batch)[0])
    if source is None:
        return None
    rows = key_padding_mask(source[1]) if source[0] == "mask" else source[1]
    if rows is None or rows.ndim != 2:
        return None
    return int(rows.shape[0]), int(rows.shape[1])


def _brief_value(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}"


__all__ = [
    "BASELINE_KEYS",
    "MAX_CHANGE_POINTS",
    "Baseline",
    "BatchAccount",
    "BatchStats",
    "EfficiencyMonitor",
    "baseline_hook",
    "batch_size_of",
    "format_summary",
    "lengthen_batch",
    "nonfinite_count",
    "schedule_states",
    "technique_name",
    "tokens_of",
]
