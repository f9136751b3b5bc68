"""What a training batch computed, found without the module's help: the batch size and tokens of any batch
structure, the transformer blocks of a network, and training FLOPs measured by replaying the network's calls.

Used by :class:`~lightning_effi.core.accounting.EfficiencyMonitor` for a LightningModule that does not define the
counting hooks (``effi_count_tokens``, ``effi_num_layers``, ``effi_training_flops``). No Lightning here.

**Batches** (:func:`leaves`): dicts and other mappings (HF ``BatchEncoding``), tuples, lists, named tuples and
dataclasses, nested; a leaf's *path* is the keys, indices and field names leading to it.

**FLOPs** (:class:`CallRecorder`, :class:`FlopsMeter`): during the real training step the recorder notes every outermost
call of a module inside the LightningModule (the LightningModule itself when ``training_step`` calls ``self(...)``, else
its submodules: ``self.model(**batch)``, ``self.backbone.forward_features(x)``'s blocks, a head called on the features;
not the calls autograd makes in the backward, activation checkpointing's recompute, which the replay of the outer call
repeats): the argument shapes, dtypes, ``requires_grad``, the grad mode, and which outputs received a gradient in the
backward. A ``torch.utils.checkpoint`` the step's own code puts around a call (``checkpoint(block, x)``) is replayed as
torch runs it: a non-reentrant one by replaying the call inside such a checkpoint (:attr:`CallRecord.recompute`), a
reentrant one (whose forward runs without grad) by recording its recompute in the backward as a call of its own. Nothing
of the data is kept. The meter then replays each call on a copy of the module whose parameters, buffers and tensor
attributes are ``FakeTensor`` s on the call's device (no memory, no compute) under
``torch.utils.flop_counter.FlopCounterMode``: the forward, then a backward from the outputs that had a gradient (none:
forward only, e.g. a frozen teacher under ``no_grad``). FLOPs are counted as :mod:`lightning_effi.core.flops` says, by
its :func:`~lightning_effi.core.flops.flop_counter` (matrix products, convolutions, and the attention kernel the call's
device picks for fake tensors of its device, as for real ones). The copy keeps every module's training mode (so gradient
checkpointing recomputes and attention dropout picks the kernel as in the real step), has no hooks (no user hook,
random-LTD's or anybody's, runs; HF's ``enable_input_require_grads`` hook, which makes the backward run through frozen
layers, has a stand-in) and has random-LTD's token dropping undone (its layers run their original ``forward``:
the FLOPs are those of the unpatched network, which random-LTD's ``effi_adjust`` lowers); the RNG states are restored
after it, and the copy is dropped. Nothing runs on the real module or data. ``FakeTensor`` rather than the ``meta``
device: HF models skip their data-dependent mask checks on fake tensors (they fail on ``meta``). A call is measured once
per (argument shapes, grad mode, outputs used, the module's type, training mode and parameter shapes /
``requires_grad``) and cached.

What is not measured: matrix products in the LightningModule's own code outside any module call (``x @ self.weight``
in ``training_step``); torchmetrics metrics called in the step (``self.train_acc(preds, y)``: counters updated
from real values, not the network's compute) are not recorded. A call whose forward makes a data-dependent shape
(``hidden[labels != -100]``: a masked-LM head on the masked positions only) is measured through the module calls made
inside it (three levels down, :data:`MAX_PART_DEPTH`), each on the shapes it was called with (:attr:`CallRecord.parts`;
its own operations between them are not counted: a warning names the parameters of its own none of those calls holds,
:attr:`FlopsMeter.partial`); one without such calls, or whose forward needs real values
otherwise (data-dependent control flow), fails to replay and is reported (:class:`MeasureError`). Checkpoints nested
inside a non-reentrant checkpoint are replayed as the innermost one only; a non-reentrant checkpoint's early stop is
replayed at the end of the last module call inside it (operations of its own after that call that save tensors make
torch recompute the call whole: a few percent more), and a call measured through its parts inside such a
checkpoint has them recomputed whole.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import enum
import functools
import math
import random
import sys
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from fractions import Fraction
from types import CodeType, FrameType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes

from lightning_effi.core.console import unshown_warnings
from lightning_effi.core.flops import flop_counter
from lightning_effi.core.hook_ids import remove_global_forward_hook, reserve_hook_ids

__all__ = [
    "block_runners",
    "forward_trains",
    "WeakHook",
    "derived_from",
    "storage_ref",
    "same_values",
    "MAX_PART_DEPTH",
    "CallRecord",
    "CallRecorder",
    "FlopsMeter",
    "MeasureError",
    "Recompute",
    "TensorInfo",
    "combined_parts",
    "describe_call",
    "find_batch_size",
    "find_blocks",
    "find_tokens",
    "hidden_tokens",
    "key_padding_mask",
    "leaf_name",
    "leaves",
    "length_stem",
    "mask_is_additive",
    "mask_tokens",
    "pass_input",
    "real_positions",
    "row_tokens",
    "share_a_residue",
    "tensor_leaves",
    "token_source",
]

Path = tuple[Any, ...]


class MeasureError(RuntimeError):
    """A figure that cannot be measured (the message says why).

    Attributes:
        data_dependent: the replay failed on a shape that depends on the data's values (boolean-mask indexing,
            ``nonzero``), which no replay on fake tensors can know.
    """

    def __init__(self, message: str, data_dependent: bool = False) -> None:
        super().__init__(message)
        self.data_dependent = data_dependent


# --------------------------------------------------------------------------------------------------- batches
def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _is_named_tuple(obj: tuple[Any, ...]) -> bool:
    fields = getattr(obj, "_fields", None)
    return isinstance(fields, tuple) and len(fields) == len(obj) and all(isinstance(f, str) for f in fields)


def leaves(obj: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """``(path, leaf)`` of every leaf of a nested batch, depth first in order: mappings by key (HF ``BatchEncoding``,
    HF ``ModelOutput`` included), named tuples and dataclass instances by field name, other tuples and lists by index;
    anything else is a leaf (tensors, numbers, strings, ``None``)."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from leaves(value, (*path, key))
    elif isinstance(obj, tuple) and _is_named_tuple(obj):  # by field name, as a dataclass
        for key, value in zip(getattr(obj, "_fields"), obj, strict=True):  # noqa: B009
            yield from leaves(value, (*path, key))
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            yield from leaves(value, (*path, i))
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            yield from leaves(getattr(obj, f.name), (*path, f.name))
    else:
        yield path, obj


def tensor_leaves(obj: Any) -> Iterator[tuple[Path, Tensor]]:
    """The tensor leaves of :func:`leaves`."""
    return ((p, v) for p, v in leaves(obj) if isinstance(v, Tensor))


def leaf_name(batch: Any, path: Path) -> str | None:
    """The name of the leaf of ``batch`` at ``path`` (from :func:`leaves`): its mapping key, dataclass or named tuple
    field; None for a plain tuple's or list's entry."""
    return path[-1] if path and isinstance(path[-1], str) else None


#: words a tensor's name ends with when it holds each row's length (``feature_lengths``, ``x_lens``, ``seq_len``)
LENGTH_WORDS = ("lengths", "length", "lens", "len")
#: whole names of a tensor that holds each row's length without a length word
LENGTH_NAMES = ("num_frames", "n_frames", "num_tokens", "n_tokens")


def length_stem(name: str | None) -> str | None:
    """What a tensor's name says it holds the rows' lengths of: the name without its length word
    (:data:`LENGTH_WORDS`; ``feature_lengths`` -> ``"feature"``, ``seq_len`` -> ``"seq"``, ``lengths`` and
    ``num_frames`` -> ``""``); None for a name that does not say it holds lengths (or no name)."""
    if not name:
        return None
    lowered = name.lower()
    if lowered in LENGTH_NAMES:
        return ""
    for word in LENGTH_WORDS:
        if lowered.endswith(word):
            return lowered[: -len(word)].strip("_")
    return None


def combined_parts(loaders: Any, batch: Any) -> list[Any] | None:
    """The per-loader batches of a training batch Lightning combined from several loaders, else ``None``.

    ``loaders`` is ``trainer.train_dataloader``: what ``train_dataloader()`` returned. A mapping or a list / tuple of
    loaders (Lightning's ``CombinedLoader``; any nesting) gives batches of the same structure, one batch of each
    loader at each step (modes ``max_size_cycle``, ``min_size``, ``max_size``; in ``max_size`` an exhausted loader's
    entry is ``None`` and is left out). ``None`` when ``loaders`` is a single loader, or when ``batch`` does not have
    the loaders' structure (a ``training_step`` hook cannot change it; then the batch is counted whole)."""
    if not isinstance(loaders, (Mapping, list, tuple)):
        return None
    parts: list[Any] = []

    def walk(node: Any, value: Any) -> bool:
        if isinstance(node, Mapping):
            if not isinstance(value, Mapping) or set(value) != set(node):
                return False
            return all(walk(node[k], value[k]) for k in node)
        if isinstance(node, (list, tuple)):
            if not isinstance(value, (list, tuple)) or len(value) != len(node):
                return False
            return all(walk(n, v) for n, v in zip(node, value, strict=True))
        if value is not None:
            parts.append(value)
        return True

    return parts if walk(loaders, batch) else None


def packed_sequences(batch: Mapping[str, Any]) -> int | None:
    """Sequences in a packed batch (Hugging Face's ``DataCollatorWithFlattening``: the sequences concatenated into
    ``input_ids [1, N]``, without padding; SFT rows of several documents): ``len(cu_seq_lens_q) - 1`` when the batch
    carries the sequence boundaries; else the restarts of its ``position_ids`` (each sequence starts at position 0)
    when they restart inside a row, counted at the real tokens of its ``attention_mask`` where it has one (a padding
    mask ``[B, T]``, or a document mask ``[B, 1, T, T]`` whose diagonal marks the real tokens: padding given position 0
    is no sequence); else, for a ``[B, T]`` integer ``attention_mask`` numbering the documents of each row ``1..k``
    (``0``: padding), the documents it numbers. None for a batch that is not packed (one row per sequence), and for
    one with a mask of another name (``padding_mask``: its polarity is unknown)."""
    bounds = batch.get("cu_seq_lens_q")
    if isinstance(bounds, Tensor) and bounds.ndim == 1 and bounds.numel() > 1:
        return int(bounds.numel()) - 1
    positions = batch.get("position_ids")
    mask = batch.get("attention_mask")
    if mask is None and any(isinstance(k, str) and "mask" in k.lower() for k in batch):
        return None  # a mask of another name, whose polarity is unknown: a padded batch, one row per sequence
    if isinstance(positions, Tensor) and positions.ndim == 2 and positions.shape[1] >= 2:
        starts = positions == 0
        if mask is not None:
            real = real_positions(mask, tuple(positions.shape))
            if real is None:
                return None
            starts = starts & real
        if bool(starts[:, 1:].any()):
            return int(starts.sum())
    if isinstance(mask, Tensor) and mask.ndim == 2 and mask.dtype not in (torch.bool,) and not mask.is_floating_point():
        if mask.numel() and int(mask.max()) > 1 and int(mask.min()) >= 0:  # document numbers, not a 0/1 padding mask
            return sum(int(torch.unique(row[row > 0]).numel()) for row in mask)
    return None


def real_positions(mask: Any, shape: tuple[int, ...]) -> Tensor | None:
    """``bool [B, T]``: the real (not padded) positions of a mask (:func:`key_padding_mask`, either polarity), or
    None when it is not a tensor of those rows."""
    if not isinstance(mask, Tensor):
        return None
    rows = key_padding_mask(mask)
    if rows is None or tuple(rows.shape) != shape:
        return None
    return rows == 0 if mask_is_additive(rows) else rows != 0


def find_batch_size(batch: Any) -> int | None:
    """Samples in a batch: the sequences of a packed batch (:func:`packed_sequences`); else the first dimension of
    the ``labels``, ``input_ids`` or ``pixel_values`` entry (in that order) of a mapping batch (for a list of tensors
    there: its length when their first dimensions differ, as per-sample sequences of a collate that does not pad;
    their shared first dimension otherwise, as one tensor per task or per crop); else of its first tensor leaf with
    at least one dimension (:func:`leaves` order); None when the batch has no such tensor."""
    if isinstance(batch, Mapping):
        packed = packed_sequences(batch)
        if packed is not None:
            return packed
        for key in ("labels", "input_ids", "pixel_values"):
            value = batch.get(key)
            if isinstance(value, Tensor) and value.ndim > 0:
                return int(value.shape[0])
            if isinstance(value, list | tuple) and value and all(isinstance(v, Tensor) and v.ndim > 0 for v in value):
                # per-sample tensors (a collate that does not pad) differ in length; batched entries (one per task
                # or per crop: [B, ...] each) share their first dimension
                firsts = {int(v.shape[0]) for v in value}
                if len(firsts) > 1 or _per_sample_images(value, batch.values()):
                    return len(value)
                return firsts.pop()
    if isinstance(batch, list | tuple) and batch:
        # torchvision's detection layout: (images, targets), a list of [C, H, W] images beside a list of dicts
        for value in batch:
            if (
                isinstance(value, list | tuple)
                and value
                and all(isinstance(v, Tensor) for v in value)
                and _per_sample_images(value, batch)
            ):
                return len(value)
    for _, value in tensor_leaves(batch):
        if value.ndim > 0:
            return int(value.shape[0])
    return None


def _per_sample_images(value: Sequence[Tensor], siblings: Any) -> bool:
    """Whether a list of tensors holds one image per sample ``[C, H, W]`` (torchvision's detection collate; the first
    dimensions are channels): 3-D tensors with 1, 3 or 4 channels that differ in size, or beside a list of as many
    mappings (their targets); a list of images counted by its first tensor read 3 samples a batch (qa44-user 02)."""
    if not all(v.ndim == 3 and int(v.shape[0]) in (1, 3, 4) for v in value):
        return False
    if len({tuple(v.shape) for v in value}) > 1:
        return True
    return any(
        isinstance(other, list | tuple) and len(other) == len(value) and all(isinstance(t, Mapping) for t in other)
        for other in siblings
    )


def _named(batch: Any, name: str) -> Tensor | None:
    for path, value in tensor_leaves(batch):
        if path and path[-1] == name:
            return value
    return None


def _ids(batch: Any) -> Tensor | None:
    """The batch's token ids: the first leaf named ``input_ids``, else its first integer (not bool) ``[B, T]``
    tensor whose ``B`` is the first dimension of the batch's first tensor (a graph batch's ``edge_index [2, E]``
    beside node features ``[N, F]`` is no token ids: read as 570 tokens for 285 edges, qa45-break 03); None when it
    has neither."""
    ids = _named(batch, "input_ids")
    if ids is not None:
        return ids
    lead: int | None = None
    for _, value in tensor_leaves(batch):
        if value.ndim == 0:
            continue
        lead = int(value.shape[0]) if lead is None else lead
        if (
            value.ndim == 2
            and int(value.shape[0]) == lead
            and not value.is_floating_point()
            and not value.is_complex()
            and value.dtype != torch.bool
        ):
            return value
    return None


def other_first_dims(batch: Any, size: int) -> list[tuple[str, int]]:
    """The tensors of ``batch`` (``path``, first dimension) whose first dimension is not ``size``, the samples read
    (:func:`find_batch_size`); what a list or tuple of ``size`` entries holds (one entry per sample: images, a
    detection batch's target dicts) is left out, and a packed batch (:func:`packed_sequences`) has none (its
    sequences are counted from its boundaries: a false warning, qa46-break 05). A graph batch (node features
    ``[N, F]``, ``edge_index [2, E]``, graph labels ``[G]``) has several: the samples read from the first (``N``
    nodes) may not be the samples (``G`` graphs, qa45-break 03)."""
    found: list[tuple[str, int]] = []
    if isinstance(batch, Mapping) and packed_sequences(batch) is not None:
        return found

    def walk(node: Any, path: Path) -> None:
        if isinstance(node, Tensor):
            if node.ndim > 0 and int(node.shape[0]) != size:
                found.append((".".join(map(str, path)) or "batch", int(node.shape[0])))
        elif isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, (*path, key))
        elif isinstance(node, (list, tuple)):
            if len(node) == size and len(node) > 1 and not all(isinstance(v, (int, float, str)) for v in node):
                return  # one entry per sample
            for i, value in enumerate(node):
                walk(value, (*path, i))
        elif _is_dataclass_instance(node):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name), (*path, f.name))

    walk(batch, ())
    return found


def opaque_holder(batch: Any) -> str | None:
    """The class name of the first object in ``batch`` that holds tensors in its attributes but is not looked into
    (a class of one's own with ``to()``: tensors are found in tuples, lists, mappings and dataclasses, :func:`leaves`);
    None when there is none."""
    for _, value in leaves(batch):
        if isinstance(value, Tensor) or value is None or isinstance(value, (str, bytes, int, float, bool)):
            continue
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict) and any(isinstance(v, Tensor) for v in attributes.values()):
            return type(value).__name__
    return None


def token_source(batch: Any) -> tuple[str, Tensor] | None:
    """Where :func:`find_tokens` reads a batch's tokens: ``("mask", attention_mask)`` or ``("ids", tensor)``; None
    when the batch has no such tensor. Reads no values (no device synchronization)."""
    mask = _named(batch, "attention_mask")
    if mask is not None:
        return "mask", mask
    ids = _ids(batch)
    return None if ids is None else ("ids", ids)


def key_padding_mask(mask: Tensor) -> Tensor | None:
    """The per-token rows (``[B, T]``) of an attention mask: a 0-D to 2-D mask as it is; a mask of 3 or more
    dimensions (``[B, Q, T]``, ``[B, 1, Q, T]``, ``[B, H, Q, T]``) at index 0 of every dimension between the first
    and the last two (heads share the padding), then the query row when ``Q == 1`` (``[B, 1, 1, T]``: the broadcast
    key-padding row), else, when ``Q == T``, the diagonal (token ``t`` is real when it may attend to itself: true of
    causal, bidirectional and ``mask[:, :, None] * mask[:, None, :]`` masks); None when ``Q`` is neither ``1`` nor
    ``T`` (a query block of another length, as with a KV cache: no row says which tokens are real)."""
    if mask.ndim <= 2:
        return mask
    while mask.ndim > 3:
        mask = mask.select(1, 0)
    queries, keys = int(mask.shape[1]), int(mask.shape[2])
    if queries == 1:
        return mask[:, 0]
    if queries == keys:
        return mask.diagonal(dim1=1, dim2=2)
    return None


def mask_is_additive(mask: Tensor) -> bool:
    """Whether an attention mask is additive (``0`` real, negative or ``-inf`` masked) rather than a keep mask
    (``True`` / non-zero real): a non-bool mask with a negative value or without a positive one (an additive mask of
    a batch without padding is all zeros). Reads the values (one device synchronization)."""
    if mask.dtype == torch.bool or mask.is_complex():
        return False
    negative, positive = torch.stack([(mask < 0).any(), (mask > 0).any()]).tolist()
    return bool(negative) or not positive


def mask_tokens(mask: Tensor) -> int | None:
    """Real tokens in an attention mask of any dtype and layout (:func:`key_padding_mask`), summed over the batch:

    - ``bool``: ``True`` is real;
    - numbers (integer or floating) with no negative value and some positive one: a keep mask, positive is real
      (HF ``0 / 1`` masks);
    - numbers with a negative value (``-inf``, ``torch.finfo(dtype).min``), or none positive: an additive mask,
      ``>= 0`` is real (``0`` added to the score), negative masked (an all-zero mask: every token real);
    - ``NaN`` never counts. None for a complex mask or a ``[B, ..., Q, T]`` mask with ``1 != Q != T``.

    One device synchronization; never raises on the mask's values."""
    rows = key_padding_mask(mask)
    if rows is None or rows.is_complex():
        return None
    if rows.dtype == torch.bool:
        return int(rows.sum().item())
    positive, non_negative, negative = torch.stack([(rows > 0).sum(), (rows >= 0).sum(), (rows < 0).sum()]).tolist()
    return int(non_negative if negative or not positive else positive)


_warned_masks: set[Any] = set()  # the mask layouts (and unreadable masks) already warned about (one warning each)


def sequence_groups(batch: Any) -> list[tuple[str, int]] | None:
    """The real tokens of each sequence of a batch that holds several under prefixed names and none plain
    (``chosen_input_ids`` / ``chosen_attention_mask`` beside ``rejected_*``: a preference pair; TRL's
    ``prompt_*`` / ``chosen_*`` / ``rejected_*``; a two-tower ``query_*`` / ``doc_*``): ``(name, tokens)`` for each
    integer ``[B, T]`` tensor whose name ends with ``input_ids``, its tokens those of the mask of the same prefix
    (``<prefix>attention_mask``, :func:`mask_tokens`), else its size. None when the batch is not a mapping, has a
    plain ``input_ids`` or ``attention_mask``, or fewer than two such tensors (the chosen side alone was counted:
    356 of 688 tokens, qa46-user 01)."""
    if not isinstance(batch, Mapping) or "input_ids" in batch or "attention_mask" in batch:
        return None
    found: list[tuple[str, int]] = []
    for key, value in batch.items():
        if not (isinstance(key, str) and key.endswith("input_ids") and isinstance(value, Tensor)):
            continue
        if value.ndim != 2 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            continue
        mask = batch.get(key[: -len("input_ids")] + "attention_mask")
        tokens = mask_tokens(mask) if isinstance(mask, Tensor) and tuple(mask.shape) == tuple(value.shape) else None
        found.append((key, int(value.numel()) if tokens is None else tokens))
    return found if len(found) >= 2 else None


def find_tokens(batch: Any) -> int | None:
    """Tokens of a batch, found in its tensors (:func:`leaves`, any structure): the real tokens of the first leaf
    named ``attention_mask`` (padding excluded; any dtype, keep or additive, ``[B, T]``, ``[B, 1, 1, T]``,
    ``[B, 1, T, T]``, ``[B, T, T]``: :func:`mask_tokens`), else the size of the first leaf named ``input_ids``, else
    of the first integer (not bool) tensor of shape ``[B, T]`` (token ids); None when the batch has none of these
    (images, float features). Without ``attention_mask`` the padding mask the curriculum truncates by is read as
    well (:func:`lightning_effi.curriculum.functional.padding_mask`: another tensor whose name holds ``mask``, or, in
    a tuple batch ``(ids, mask, y)``, a bool or 0/1 ``[B, T]`` entry padded on one side of each row with one pad id
    in the ids): its real tokens are counted, else the ids' size (padding included). A mask whose real tokens cannot
    be read (``[B, 1, Q, T]`` with ``1 != Q != T``, complex) counts the ids instead, with one warning per mask
    layout. A batch of several prefixed sequences (``chosen_input_ids`` beside ``rejected_input_ids``) counts them all
    (:func:`sequence_groups`)."""
    groups = sequence_groups(batch)
    if groups is not None:
        return sum(n for _, n in groups)
    source = token_source(batch)
    if source is None:
        return None
    kind, tensor = source
    if kind == "ids":
        from lightning_effi.curriculum.functional import padding_mask  # the curriculum's reading of padding

        try:
            found = padding_mask(batch)
        except ValueError as err:  # a mask the curriculum refuses to read: count the ids, once said
            found = None
            if str(err) not in _warned_masks:
                _warned_masks.add(str(err))
                warnings.warn(
                    f"token counting: {err}; counting the size of the token ids, padding included (or define "
                    "`effi_count_tokens(batch) -> int` on your LightningModule)",
                    stacklevel=2,
                )
        real = int(found[2].sum()) if found is not None and tuple(found[2].shape) == tuple(tensor.shape) else 0
        return real if real > 0 else int(tensor.numel())  # no real token: not a padding mask (a placeholder batch)
    tokens = mask_tokens(tensor)
    if tokens is not None:
        return tokens
    ids = _ids(batch)
    layout = (tensor.ndim, *tensor.shape[1:])
    if layout not in _warned_masks:
        _warned_masks.add(layout)
        warnings.warn(
            f"token counting: the attention_mask of shape {tuple(tensor.shape)} and dtype {tensor.dtype} does not say "
            "which tokens are real (expected [B, T], [B, 1, 1, T], or [B, 1, T, T] / [B, T, T]); counting "
            + ("the size of the token ids, padding included" if ids is not None else "nothing: the batch has no ids")
            + "; define `effi_count_tokens(batch) -> int` on your LightningModule",
            stacklevel=2,
        )
    return None if ids is None else int(ids.numel())


def row_tokens(batch: Any) -> Tensor | None:
    """Tokens of each sample of a batch, int64 ``[B]`` on the CPU, read as :func:`find_tokens` reads the batch's
    total (their sum is that total): the real tokens of each row of the ``attention_mask`` (:func:`mask_tokens`'s
    reading: bool, keep or additive, any layout :func:`key_padding_mask` reads), else of the padding mask the
    curriculum reads (:func:`lightning_effi.curriculum.functional.padding_mask`), else the ids' length ``T`` for
    every row (padding included, as the total counts it; also where the mask says nothing per row: a
    ``[B, 1, Q, T]`` mask with ``1 != Q != T``, a complex one). None when the batch has no tokens (images) or its
    rows cannot be told apart (1-D ids, no ids beside an unreadable mask). One device synchronization; never raises,
    never warns."""
    source = token_source(batch)
    if source is None:
        return None
    kind, tensor = source

    def ids_length(ids: Tensor | None) -> Tensor | None:
        if ids is None or ids.ndim != 2:
            return None
        return torch.full((int(ids.shape[0]),), int(ids.shape[1]), dtype=torch.int64)

    if kind == "ids":
        from lightning_effi.curriculum.functional import padding_mask

        try:
            found = padding_mask(batch)
        except ValueError:
            found = None
        if found is not None and tuple(found[2].shape) == tuple(tensor.shape):
            real = found[2].sum(dim=1).cpu().long()
            if int(real.sum()) > 0:
                return real
        return ids_length(tensor)
    rows = key_padding_mask(tensor)
    if rows is None or rows.is_complex() or rows.ndim != 2:
        return ids_length(_ids(batch))
    if rows.dtype == torch.bool:
        return rows.sum(dim=1).cpu().long()
    additive = mask_is_additive(rows)
    return (rows >= 0 if additive else rows > 0).sum(dim=1).cpu().long()


def hidden_tokens(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """Tokens in the hidden states a transformer block is called with: the product of all but the last dimension of
    its first tensor argument when that is 3-D (``[B, T, H]`` or ``[T, B, H]``); None otherwise (a nested tensor too:
    ``nn.TransformerEncoder``'s padded inference path, which has no shape)."""
    hidden = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
    if hidden is None or hidden.is_nested or hidden.ndim != 3:
        return None
    return int(math.prod(hidden.shape[:-1]))


# ---------------------------------------------------------------------------------------------------- blocks
def block_runners(pl_module: nn.Module, name: str, blocks: nn.ModuleList | nn.Sequential) -> list[nn.Module]:
    """The modules whose call runs the block list at ``name`` in ``pl_module`` once: an ``nn.Sequential`` list itself,
    else every module holding the list (the LightningModule for a list it holds itself: its ``forward``), not a
    container. A list shared by two networks (two stems over one trunk of blocks, VATT / ImageBind-style) has two
    holders, each call of either a pass; the first holder's alone counted one pass of two (qa53-break 05)."""
    if isinstance(blocks, nn.Sequential):
        return [blocks]
    holders = [
        module
        for module in pl_module.modules()
        if any(child is blocks for child in module._modules.values())
        and not isinstance(module, nn.ModuleList | nn.ModuleDict | nn.Sequential)
    ]
    parent = name.rpartition(".")[0]
    try:
        first = pl_module.get_submodule(parent) if parent else pl_module
    except AttributeError:
        return holders
    return [first, *(h for h in holders if h is not first)] if first in holders else holders


def _has_params(module: nn.Module) -> bool:
    return next(iter(module.parameters()), None) is not None


def find_blocks(module: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    """The transformer block list of a network: the first of :func:`block_candidates`, None when there is none (an
    MLP of ``Linear`` layers, a CNN of mixed layers). Read only: nothing is bound or changed."""
    candidates = block_candidates(module, limit=1)
    return candidates[0] if candidates else None


def block_candidates(module: nn.Module, limit: int | None = None) -> list[nn.ModuleList | nn.Sequential]:
    """The lists of a network that may be its transformer blocks, best first: the layer list of the first registered
    random-LTD adapter that matches a submodule (:func:`lightning_effi.models.base.find_adapter`: HF GPT-2, HF BERT,
    timm ViT), then every ``nn.ModuleList`` (at least 1 entry) and ``nn.Sequential`` (at least 2) whose entries are
    modules of one class, each with submodules and parameters: one with trainable parameters before a frozen one
    (the network, not a frozen teacher or EMA copy beside it), then the one holding the most parameters (the layer
    stack rather than, say, the experts inside one layer), longer first on a tie; at most ``limit``. Which of them a
    step runs with ``[B, T, H]`` hidden states is for the caller to see (:class:`~lightning_effi.core.accounting.
    EfficiencyMonitor`: a DiT's EMA copy is never run, a probe's residual MLP head runs on pooled ``[B, H]``
    features, qa45-user 01, qa46-break 06, 11). Read only."""
    found: list[nn.ModuleList | nn.Sequential] = []
    try:
        from lightning_effi.models import find_adapter

        layers = find_adapter(module, "auto").layers()
        if len(layers):
            found.append(layers)
    except Exception:  # no registered adapter matches (ValueError) or one cannot read this model: use the shapes
        pass
    ranked: list[tuple[bool, int, int, int, nn.ModuleList | nn.Sequential]] = []
    for order, sub in enumerate(module.modules()):
        if not isinstance(sub, (nn.ModuleList, nn.Sequential)) or any(sub is f for f in found):
            continue
        entries = list(sub.children())
        if len(entries) < (1 if isinstance(sub, nn.ModuleList) else 2) or len(entries) != len(sub):
            continue
        kind = type(entries[0])
        if not all(type(e) is kind and next(e.children(), None) is not None and _has_params(e) for e in entries):
            continue
        params = list(sub.parameters())
        ranked.append((any(p.requires_grad for p in params), sum(p.numel() for p in params), len(entries), -order, sub))
    ranked.sort(key=lambda r: r[:4], reverse=True)
    found.extend(r[4] for r in ranked)
    return found if limit is None else found[:limit]


# ------------------------------------------------------------------------------------------------------ calls
@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A tensor argument of a recorded call, without its values.

    Attributes:
        shape, dtype, device, requires_grad: of the real tensor.
        path: where the same tensor object sits in the training batch (:func:`leaves`), or the batch tensor it is a
            slice of (:func:`slice_trim`); None if it is neither (set by :meth:`CallRecorder.stop`; not part of the
            cache key).
        trim: for a slice of a batch tensor, the entries it leaves out of each dimension (``ids[:, :-1]``:
            ``(0, 1)``); None for the batch tensor itself.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool
    path: Path | None = dataclasses.field(default=None, compare=False)
    trim: tuple[int, ...] | None = dataclasses.field(default=None, compare=False)


#: the most entries per dimension a slice of a batch tensor may leave out to be replayed on a batch of other shapes
#: (:func:`slice_trim`): the causal shift (1) or a BOS / EOS strip (2); a slice to a fixed size (``ids[:, :8]``) or a
#: chunk (``ids.chunk(2, 1)[0]``) leaves out more, and its size on another batch is unknown
MAX_TRIM = 2


def slice_trim(tensor: Tensor, source: Tensor) -> tuple[int, ...] | None:
    """The entries ``tensor`` leaves out of each dimension of ``source`` when it is a basic slice of it with step 1
    that leaves out at most :data:`MAX_TRIM` entries per dimension (``source[:, :-1]``, ``source[:, 1:]``,
    ``source[1:-1]``: a view of the same storage with the same strides, starting inside ``source``); None otherwise
    (a copy, a step, a transpose, an index with fewer dimensions, a fixed-size slice or chunk leaving out more)."""
    if (
        tensor.dim() != source.dim()
        or tensor.dim() == 0
        or tensor.stride() != source.stride()
        or tensor.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
        or tensor.shape == source.shape
    ):
        return None
    trim = tuple(int(s) - int(t) for s, t in zip(source.shape, tensor.shape))
    if min(trim) < 0 or max(trim) > MAX_TRIM:
        return None
    offset = int(tensor.storage_offset()) - int(source.storage_offset())
    for size, stride, cut in sorted(zip(source.shape, source.stride(), trim), key=lambda d: -d[1]):
        if stride <= 0:
            return None
        start, offset = divmod(offset, stride) if size > 1 else (0, offset)
        if not 0 <= start <= cut:
            return None
    return trim if offset == 0 else None


def copy_of(tensor: Tensor, batch_tensors: Sequence[tuple[Path, Tensor]]) -> Path | None:
    """The path of the batch tensor ``tensor`` is a copy of: of its shape and, converted to ``tensor``'s dtype and
    device, of its values (``.contiguous()``, ``.clone()``, ``.long()``, ``.float()`` of a mask, ``.to(device)`` in a
    ``training_step``), the first such in the batch's order; None when there is none. Its shape on another batch (the
    curriculum's untruncated one) is then that batch tensor's. Read once per recorded call (the values of a few
    ``[B, T]`` tensors)."""
    if tensor.is_meta or tensor.dim() == 0:
        return None
    data = tensor.detach()
    for path, value in batch_tensors:
        if value.shape != tensor.shape or value.is_meta:
            continue
        try:
            if torch.equal(value.detach().to(device=data.device, dtype=data.dtype), data):
                return path
        except (RuntimeError, TypeError, NotImplementedError):  # no conversion (complex to bool), a sparse layout
            continue
    return None


@dataclasses.dataclass(frozen=True)
class _Fields:
    """A dataclass instance or named tuple among the arguments: its class and its described fields."""

    cls: type
    fields: tuple[tuple[str, Any], ...]
    positional: bool = False  # a named tuple: built as cls(*values)

    def build(self) -> Any:
        if self.positional:
            return self.cls(*(value for _, value in self.fields))
        out: Any = object.__new__(self.cls)
        for name, value in self.fields:
            object.__setattr__(out, name, value)
        return out


@dataclasses.dataclass(frozen=True)
class _Opaque:
    """An argument the replay cannot rebuild (not a tensor, container or plain value)."""

    kind: str


#: argument values passed to the replay as they are
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum, slice)


def _describe(value: Any, refs: list[tuple[TensorInfo, weakref.ref[Tensor]]]) -> Any:
    """``value`` with every tensor replaced by a :class:`TensorInfo` (and its weak reference appended to
    ``refs``), containers rebuilt (mappings as dicts, dataclass instances as :class:`_Fields`), plain values kept,
    anything else an :class:`_Opaque`."""
    if isinstance(value, Tensor):
        if value.is_nested:  # PyTorch's padded inference path between nn.TransformerEncoder's layers: no shape
            return _Opaque("nested tensor")
        info = TensorInfo(tuple(value.shape), value.dtype, str(value.device), bool(value.requires_grad))
        refs.append((info, weakref.ref(value)))
        return info
    if isinstance(value, Mapping):
        return {k: _describe(v, refs) for k, v in value.items()}
    names = getattr(type(value), "_fields", None)
    if isinstance(value, tuple) and isinstance(names, tuple):  # a named tuple
        return _Fields(type(value), tuple((f, _describe(v, refs)) for f, v in zip(names, value)), True)
    if isinstance(value, tuple):
        return tuple(_describe(v, refs) for v in value)
    if isinstance(value, list):
        return [_describe(v, refs) for v in value]
    if _is_dataclass_instance(value):
        return _Fields(
            type(value), tuple((f.name, _describe(getattr(value, f.name), refs)) for f in dataclasses.fields(value))
        )
    if isinstance(value, _PLAIN) or value is Ellipsis:
        return value
    return _Opaque(type(value).__name__)


def _freeze(info: Any) -> Any:
    """A hashable key of described arguments."""
    if isinstance(info, _Fields):
        return (info.cls, tuple((k, _freeze(v)) for k, v in info.fields), info.positional)
    if isinstance(info, dict):
        return ("dict", tuple((k, _freeze(v)) for k, v in info.items()))
    if isinstance(info, (tuple, list)):
        return (type(info).__name__, tuple(_freeze(v) for v in info))
    try:
        hash(info)
    except TypeError:
        return ("unhashable", type(info).__name__, id(info))
    return info


def _map_tensors(info: Any, fn: Callable[[TensorInfo], Any]) -> Any:
    if isinstance(info, TensorInfo):
        return fn(info)
    if isinstance(info, dict):
        return {k: _map_tensors(v, fn) for k, v in info.items()}
    if isinstance(info, tuple):
        return tuple(_map_tensors(v, fn) for v in info)
    if isinstance(info, list):
        return [_map_tensors(v, fn) for v in info]
    if isinstance(info, _Fields):
        return _Fields(info.cls, tuple((k, _map_tensors(v, fn)) for k, v in info.fields), info.positional)
    return info


def _described_leaves(info: Any) -> Iterator[Any]:
    if isinstance(info, dict):
        for v in info.values():
            yield from _described_leaves(v)
    elif isinstance(info, (tuple, list)):
        for v in info:
            yield from _described_leaves(v)
    elif isinstance(info, _Fields):
        for _, v in info.fields:
            yield from _described_leaves(v)
    else:
        yield info


@dataclasses.dataclass
class CallRecord:
    """One outermost module call of a training step, as :meth:`FlopsMeter.flops` replays it.

    Attributes:
        target: the module's name in the LightningModule (``""``: the LightningModule itself), resolved again at
            replay (so a technique that holds another network in place, the V-cycle's full model, is measured).
        args, kwargs: the arguments, tensors as :class:`TensorInfo`.
        grad: whether grad mode was on.
        used: the paths (:func:`leaves`) of the outputs that received a gradient in the real backward.
        parts: the module calls made directly inside this one (recorded by :class:`CallRecorder`), replayed in its
            place when it cannot be (:attr:`MeasureError.data_dependent`: a head on the masked positions only,
            ``hidden[labels != -100]``); its own operations outside them are then not counted.
        recompute: ``None``, or how the backward recomputed this call, made by the step's own code inside a
            non-reentrant ``torch.utils.checkpoint`` (:class:`Recompute`). The replay runs the call inside such a
            checkpoint, so that its recompute is counted as torch runs it.
    """

    target: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grad: bool
    used: set[Path] = dataclasses.field(default_factory=set)
    recompute: Recompute | None = None
    parts: list[CallRecord] = dataclasses.field(default_factory=list)

    def key(self) -> tuple[Any, ...]:
        return (
            self.target,
            _freeze(self.args),
            _freeze(self.kwargs),
            self.grad,
            tuple(sorted(map(repr, self.used))),
            None if self.recompute is None else (self.recompute.mode, _callable_key(self.recompute.context_fn)),
        )

    def opaque(self) -> list[str]:
        """The kinds of the arguments the replay cannot rebuild."""
        return [v.kind for v in _described_leaves((self.args, self.kwargs)) if isinstance(v, _Opaque)]

    def tensors(self) -> list[TensorInfo]:
        return [v for v in _described_leaves((self.args, self.kwargs)) if isinstance(v, TensorInfo)]

    def on_batch(self, batch: Any, recorded: Sequence[tuple[Path, tuple[int, ...]]] | None = None) -> CallRecord:
        """This call with every batch tensor argument (``path`` set) given the shape of ``batch`` at that path (the
        baseline's batch of a technique that changed the batch's shapes, e.g. the curriculum's untruncated batch). A
        slice of a batch tensor (``trim`` set, at most :data:`MAX_TRIM` entries per dimension: ``ids[:, :-1]``,
        ``ids[:, 1:]``, ``ids[:, 1:-1]``) is taken to leave out as many entries of that tensor in ``batch`` (the
        causal shift at any length); a slice to a fixed size is not such a slice (a :class:`MeasureError`).
        ``recorded``: the paths and shapes of the batch the call was recorded on; a computed argument none of whose
        sizes is one the batch's tensors change (a tower's pooled ``[B, H]`` output fed to a projection in
        ``training_step``, beside captions cut from 39 to 8 tokens, qa50-clip 03) keeps its shape.

        Raises:
            MeasureError: a tensor argument that is neither a batch tensor nor a slice of one (a tensor computed from
                the batch) and has a size the batch's tensors change (without ``recorded``: any), a path that ``batch``
                lacks, or a slice that leaves nothing of it.
        """
        found = dict(tensor_leaves(batch))
        changed: set[int] | None = None
        if recorded is not None:
            changed = set()
            for path, old in recorded:
                new = found.get(path)
                if new is None or new.ndim != len(old):
                    changed = None  # the batch's structure differs: no computed shape is known
                    break
                changed.update(o for o, n in zip(old, new.shape) if o != n)

        def reshape(info: TensorInfo) -> TensorInfo:
            if info.path is None and changed is not None and not changed & set(info.shape):
                return info
            if info.path is None:
                raise MeasureError(
                    f"an argument of {self.target or 'the LightningModule'} is not a tensor of the batch itself nor a "
                    "slice of one leaving out at most 2 entries per dimension (a tensor computed from the batch, a "
                    "copy with other values, or a slice to a fixed size), so its shape on a batch of other shapes is "
                    "unknown"
                )
            value = found.get(info.path)
            if value is None:
                raise MeasureError(f"the batch has no tensor at {info.path}")
            shape = tuple(value.shape)
            if info.trim is not None:
                if len(info.trim) != len(shape) or any(n <= t for n, t in zip(shape, info.trim)):
                    raise MeasureError(
                        f"an argument of {self.target or 'the LightningModule'} is a slice of the batch tensor at "
                        f"{info.path} leaving out {info.trim} entries per dimension, which the batch's {shape} cannot "
                        "give"
                    )
                shape = tuple(n - t for n, t in zip(shape, info.trim))
            return dataclasses.replace(info, shape=shape)

        return dataclasses.replace(
            self,
            args=_map_tensors(self.args, reshape),
            kwargs=_map_tensors(self.kwargs, reshape),
            used=set(self.used),
            parts=_parts_on_batch(self.parts, batch, recorded),
        )


def _callable_key(fn: Any) -> Any:
    """A description of a callable that is the same for the same code and arguments (a ``functools.partial`` built
    afresh at every step, as ``context_fn=partial(create_selective_checkpoint_contexts, policy)`` in a forward is, is
    one key): its module and qualified name, and a partial's arguments described alike."""
    import functools

    if fn is None:
        return None
    if isinstance(fn, functools.partial):
        keywords = tuple(sorted((k, _callable_key(v) if callable(v) else repr(v)) for k, v in fn.keywords.items()))
        return (
            "partial",
            _callable_key(fn.func),
            tuple(_callable_key(a) if callable(a) else repr(a) for a in fn.args),
            keywords,
        )
    name = getattr(fn, "__qualname__", None)
    return (getattr(fn, "__module__", None), name) if name is not None else repr(fn)


def _parts_on_batch(
    parts: list[CallRecord], batch: Any, recorded: Sequence[tuple[Path, tuple[int, ...]]] | None = None
) -> list[CallRecord]:
    """:attr:`CallRecord.parts` on another batch (:meth:`CallRecord.on_batch`); none when a part's shapes on it are
    unknown (a part called on hidden states: the outer call must then be replayed)."""
    try:
        return [part.on_batch(batch, recorded) for part in parts]
    except MeasureError:
        return []


def describe_call(
    target: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    grad: bool,
    used: set[Path],
    recompute: Recompute | None = None,
) -> CallRecord:
    """A :class:`CallRecord` of a call made by hand (not recorded by :class:`CallRecorder`): ``target`` the module's
    name under the root it is replayed in, the arguments described without their values, ``grad`` the grad mode,
    ``used`` the output paths (:func:`leaves`) the backward starts from, ``recompute`` as
    :attr:`CallRecord.recompute`."""
    args_info, kwargs_info = _describe(tuple(args), []), _describe(dict(kwargs), [])
    return CallRecord(target, args_info, kwargs_info, bool(grad), set(used), recompute)


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward (e.g. activation checkpointing recomputing a forward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and int(task()) != -1


#: how far up the Python stack :func:`_checkpoint_recompute` looks for the ``torch.utils.checkpoint`` call
_MAX_FRAMES = 64


def same_values(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor or hold the same values (shape, dtype, device and every element): a
    network called again on them runs over the same data (R-Drop), not over other data (a second view)."""
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))


#: how many autograd nodes :func:`derived_from` walks back from a tensor
GRAPH_NODES = 64


#: keyword arguments of a network's call that hold no data of the pass (:func:`pass_input`)
_NOT_PASS_DATA = ("mask", "position", "type", "cache", "past", "encoder")


def pass_input(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Tensor | None:
    """The tensor a call of a network runs its pass over: of its positional tensors, then its keyword tensors whose
    name is no attention mask, position or token-type ids, cache or encoder output, the first that is not learned
    tokens (:func:`_learned`), else the first of them, else its first tensor. A Hugging Face model hands its base
    model ``input_ids=None`` and the attention mask before ``inputs_embeds``: two views with the same mask read as one
    pass over the same data (R-Drop), 105 tokens for 210 (qa70-regress 02); a Perceiver's latents, positional before
    its inputs, alike (qa72-break 04)."""
    named = [(k, v) for k, v in kwargs.items() if isinstance(v, Tensor)]
    candidates = [a for a in args if isinstance(a, Tensor)]
    candidates += [v for k, v in named if not any(word in k for word in _NOT_PASS_DATA)]
    # learned tokens first (a Perceiver's latents, then its inputs by keyword) are the same in every pass
    data = next((v for v in candidates if not _learned(v)), None)
    if data is not None:
        return data
    return candidates[0] if candidates else (named[0][1] if named else None)


def _learned(value: Tensor) -> bool:
    """Whether ``value`` is a parameter or computed from parameters only (:func:`_learned_only`)."""
    return isinstance(value, nn.Parameter) or (value.grad_fn is not None and _learned_only(value.grad_fn))


def derived_from(value: Tensor, nodes: set[int], limit: int = GRAPH_NODES, *, whole_cat: bool = True) -> bool:
    """Whether ``value``'s autograd graph reaches one of ``nodes`` (``id`` of a ``grad_fn``) within ``limit`` nodes
    walked back, breadth first: a tensor computed from another in the graph. ``whole_cat=False``: through a
    concatenation (``torch.cat``) along another axis than the last only when every part of it holding data comes from
    ``nodes`` (:func:`_cat_data`): a CLS put back in front of a lap's output (learned, frozen, or pooled from that
    output) continues it, memory slots in front of the next segment's embeddings (a recurrent memory transformer) do
    not."""
    if not nodes or value.grad_fn is None:
        return False
    return _reaches(value.grad_fn, nodes, limit, whole_cat)


def _reaches(start: Any, nodes: set[int], limit: int, whole_cat: bool) -> bool:
    """:func:`derived_from` from the autograd node ``start``."""
    queue, seen = [start], set[int]()
    while queue and len(seen) < limit:
        node = queue.pop(0)
        if id(node) in nodes:
            return True
        if id(node) in seen:
            continue
        seen.add(id(node))
        data = None if whole_cat or node.name() != "CatBackward0" else _cat_data(node)
        if data is not None:  # along the positions: continued only where all its data comes from the nodes
            if data and all(part is not None and _reaches(part, nodes, limit, whole_cat) for part in data):
                return True
            continue
        queue.extend(n for n, _ in node.next_functions if n is not None)
    return False


#: autograd nodes of a lookup in a table by data (an embedding of token ids): computed from data, not parameters only
_LOOKUPS = ("Embedding", "IndexSelect", "Index", "Gather")


def _learned_only(node: Any, limit: int = 64) -> bool:
    """Whether an autograd node computes from parameters only (a learned CLS, register or memory tokens, expanded to
    the batch, or made by a small MLP of a parameter, qa73-break 02): its walk ends in parameters within ``limit``
    nodes, with no input that takes no grad and no lookup in a table (an embedding of ids). An input without grad
    reads as data (frames, a frozen part's output), a buffer added to learned tokens too: the graph does not tell
    them apart."""
    queue, count = [node], 0
    while queue:
        current = queue.pop()
        count += 1
        if current is None or count > limit or current.name().startswith(_LOOKUPS):
            return False
        if not hasattr(current, "variable"):  # a parameter (AccumulateGrad) ends the walk
            queue.extend(n for n, _ in current.next_functions)
    return True


def _cat_data(node: Any) -> list[Any] | None:
    """The parts of a ``torch.cat`` node along another axis than the last that hold data (its ``next_functions``'
    nodes; None for a part without grad): not learned tokens only (:func:`_learned_only`), nor, without grad (a
    frozen CLS, a zeros placeholder), fewer than half of the positions (qa72-break 02). None for a cat along the last
    axis (features: a state beside the input embeddings, each a whole sequence) or whose axis cannot be read: every
    part is walked."""
    try:
        dim, shape = int(node._saved_dim), node._input_metadata[0].shape
        dim = (dim - 2**64 if dim >= 2**63 else dim) % len(shape)  # a negative dim is saved as an unsigned integer
        if dim == len(shape) - 1:
            return None
        sizes = [int(n._input_metadata[nr].shape[dim]) for n, nr in node.next_functions if n is not None]
    except (AttributeError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return None
    without_grad = int(shape[dim]) - sum(sizes)  # the positions of the parts that take no grad
    return [
        n
        for n, _ in node.next_functions
        if (n is None and 2 * without_grad >= int(shape[dim])) or (n is not None and not _learned_only(n))
    ]


def storage_ref(value: Tensor) -> weakref.ref[Any] | None:
    """A weak reference to ``value``'s storage (a detached tensor or a view shares it; torch keeps one Python object
    per storage while a tensor uses it); None where it has none (a fake or sparse tensor)."""
    try:
        return weakref.ref(value.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _gone() -> None:
    """A dead reference: what a copied or unpickled :class:`WeakHook` holds."""
    return None


class WeakHook:
    """A module hook that calls the method ``name`` of ``owner`` (a callback), ``args`` first, through a weak
    reference; uncompiled (traced into a compiled network, one frame for calls of other arguments recompiled per
    call). A bound method or a partial of one would make a deep copy of the network mid-step (a momentum or EMA copy
    made lazily in ``training_step``) copy the callback with the step's non-leaf tensors, which failed, and
    ``torch.save`` of the module fail on its weak references (qa67-break 02, qa68-break 04): a copy or an unpickled
    hook holds no callback and does nothing (the copy is another network)."""

    def __init__(self, owner: Any, name: str, *args: Any) -> None:
        self.owner: Callable[[], Any] = weakref.ref(owner)
        self.name, self.args = name, args

    def _call(self, *call_args: Any, **kwargs: Any) -> Any:
        owner = self.owner()
        return None if owner is None else getattr(owner, self.name)(*self.args, *call_args, **kwargs)

    __call__ = torch.compiler.disable(_call)  # type: ignore[no-untyped-call]

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.owner, self.name, self.args = _gone, state["name"], ()


def _frame_running(code: CodeType) -> FrameType | None:
    """The nearest frame of the Python stack, within :data:`_MAX_FRAMES` of the caller, that runs ``code``."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None or frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def _reentrant_recompute() -> bool:
    """Whether the current call runs in the backward's recompute of a reentrant ``torch.utils.checkpoint``
    (``CheckpointFunction.backward`` on the Python stack): the forward of that call ran without grad, so its
    recompute (a forward and a backward) is compute of its own. A non-reentrant checkpoint's recompute is not: it is
    counted with the call's replay (:attr:`CallRecord.recompute`)."""
    from torch.utils.checkpoint import CheckpointFunction

    return _frame_running(CheckpointFunction.backward.__code__) is not None


def _in_reentrant_checkpoint() -> bool:
    """Whether the current call runs in the forward of a reentrant ``torch.utils.checkpoint``
    (``CheckpointFunction.forward`` on the Python stack) that trains: it runs without grad, and an input of it
    requires grad (a no_grad probe through a model that checkpoints its blocks does not: qa65-break 01)."""
    from torch.utils.checkpoint import CheckpointFunction

    frame = _frame_running(CheckpointFunction.forward.__code__)
    return frame is not None and any(isinstance(a, Tensor) and a.requires_grad for a in frame.f_locals.get("args", ()))


def forward_trains() -> bool:
    """Whether a forward running now trains: grad enabled, or the forward of a reentrant activation checkpoint, which
    runs without grad (two views under it were counted as one pass, qa63-break 01); not a ``generate()`` or a probe
    under ``no_grad``."""
    return torch.is_grad_enabled() or _in_reentrant_checkpoint()


@dataclasses.dataclass(frozen=True)
class Recompute:
    """How the backward recomputes a call made inside a non-reentrant ``torch.utils.checkpoint`` by the step's own
    code (:func:`_checkpoint_recompute`).

    Attributes:
        mode: ``"early_stop"`` (torch's default: the recompute stops once it has rebuilt the tensors the backward
            needs) or ``"full"`` (``early_stop=False``, or a call that is not the last one of its checkpoint, whose
            recompute goes on into the next call).
        context_fn: the checkpoint's ``context_fn`` (selective activation checkpointing: a policy saving some
            operations' outputs, which the recompute then skips), or None for torch's default.
        region: the checkpoint's own state, which the calls made inside one checkpoint share (kept during the step
            only: :meth:`CallRecorder.stop` drops it).
    """

    mode: str
    context_fn: Any = None
    region: Any = dataclasses.field(default=None, compare=False, hash=False)


def _checkpoint_recompute(module: nn.Module) -> Recompute | None:
    """How the backward recomputes the current call of ``module`` (:attr:`CallRecord.recompute`) when the caller made
    it inside a non-reentrant ``torch.utils.checkpoint`` (``checkpoint(block, x, use_reentrant=False)`` in the
    step's own code), found on the Python stack: the nearest enclosing frame of ``torch.utils.checkpoint``'s
    ``checkpoint``. ``None`` when there is none, when it is reentrant (the recompute runs as a call of its own in the
    backward, recorded then), or when the checkpoint is inside the module's own ``__call__`` (an HF
    ``GradientCheckpointingLayer``: the replay of the call runs that checkpoint again)."""
    import torch.utils.checkpoint as checkpointing

    call_impl = nn.Module._call_impl.__code__
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        if code is call_impl and frame.f_locals.get("self") is not module:
            return None  # the call of the module it is made in: no checkpoint between the two
        if code.co_filename == checkpointing.__file__ and code.co_name in ("_checkpoint_impl", "checkpoint"):
            local = frame.f_locals
            if "use_reentrant" not in local or local["use_reentrant"] is not False:
                return None
            outer = frame.f_back
            for _ in range(4):  # checkpoint() <- the module's own __call__
                if outer is None:
                    break
                if outer.f_code.co_name == "__call__" and outer.f_locals.get("self") is module:
                    return None
                outer = outer.f_back
            forced = getattr(checkpointing, "_enable_checkpoint_early_stop", None)  # set_checkpoint_early_stop(...)
            early_stop = bool(local.get("early_stop", True)) if forced is None else bool(forced)
            context = local.get("context_fn")
            context = None if context is getattr(checkpointing, "noop_context_fn", None) else context
            return Recompute("early_stop" if early_stop else "full", context, local.get("gen", frame))
        frame = frame.f_back
    return None


#: the depth of calls kept as :attr:`CallRecord.parts` below an outermost call (its calls, theirs, and theirs): an MoE
#: layer's experts, inside its block, inside the network (at 2 a hand-written MoE LM was counted 0 FLOPs, qa49-moe 01;
#: a 12-layer GPT-2's step time with 3 is within the noise of 2's: 0.385-0.391 s against 0.381-0.390 s on a CPU core)
MAX_PART_DEPTH = 3


def _is_fake(tensor: Tensor) -> bool:
    return type(tensor).__name__ == "FakeTensor"


def _einsum_flops(equation: str, operands: Sequence[Any]) -> int:
    """Forward FLOPs of ``torch.einsum(equation, *operands)``: 2 x the product of every index's size, for a
    contraction of two operands (one multiply-add per combination of the indices); 0 for other forms."""
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    if len(inputs) != 2 or len(operands) != 2 or "." in equation:
        return 0
    sizes: dict[str, int] = {}
    for letters, tensor in zip(inputs, operands):
        if not isinstance(tensor, Tensor) or len(letters) != tensor.dim():
            return 0
        sizes.update(zip(letters, (int(n) for n in tensor.shape)))
    return 2 * math.prod(sizes.values())


def _matmul_flops(a: Tensor, b: Tensor) -> int:
    """Forward FLOPs of ``a @ b`` (``torch.matmul``'s broadcasting; 1 multiply-add = 2 FLOPs)."""
    sa = tuple(a.shape) if a.dim() > 1 else (1, *a.shape)
    sb = tuple(b.shape) if b.dim() > 1 else (*b.shape, 1)
    batch = math.prod(torch.broadcast_shapes(sa[:-2], sb[:-2]))  # type: ignore[no-untyped-call]
    return 2 * batch * sa[-2] * sa[-1] * sb[-1]


class OutsideProducts(torch.overrides.TorchFunctionMode):
    """While active, sums the FLOPs of the matrix products the training step's own code runs outside every module
    call that ``recorder`` sees (``h @ self.item_emb.weight.T``, ``torch.mm(z1, z2.T)``, ``F.linear(h, W)``): the
    FLOPs replay measures module calls only (module docstring), so those products are left out of the counts. Forward
    FLOPs, plus one product of the same size per operand that requires grad (its backward). A check, run on one step:
    the monitor warns with the figure (qa43-user 03: an item-scoring head in a recommender's ``training_step`` was 47%
    of the step's FLOPs, and random-LTD's saving read 1.9x too high).

    Attributes:
        flops: the products' forward and backward FLOPs so far. examples: a few of them (``"matmul [8, 32, 64] @
            [64, 3000]"``).
    """

    def __init__(self, recorder: CallRecorder) -> None:
        super().__init__()
        self.recorder, self.flops = recorder, 0
        self.examples: list[str] = []
        self.active = False  # entered and not yet exited (set by its user)
        self._depth = 0  # module calls in progress, of any module (a technique's measurement on a copy included)
        self._handles: list[Any] = []

    def __enter__(self) -> OutsideProducts:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        root = self.recorder._root() if self.recorder._root is not None else None  # noqa: SLF001
        if root is not None:
            reserve_hook_ids(root)
        self._handles = [
            register_module_forward_pre_hook(self._before),
            register_module_forward_hook(self._after, always_call=True),
        ]
        return super().__enter__()  # type: ignore[no-untyped-call,no-any-return]

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            remove_global_forward_hook(handle)
        self._handles = []
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def _before(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.recorder._names:  # noqa: SLF001 - a module of the LightningModule: its calls are replayed
            self._depth += 1

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in self.recorder._names:  # noqa: SLF001
            self._depth = max(self._depth - 1, 0)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not self._depth and not self.recorder._stack:  # noqa: SLF001 - outside every call of the module's
            try:
                self._note(func, args, kwargs)
            except Exception:  # noqa: BLE001 - a check never breaks the step (a shape it does not know: skipped)
                pass
        return func(*args, **kwargs)

    def _note(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = getattr(func, "__name__", "")
        if name == "einsum":
            equation, operands = args[0], args[1:]
            if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
                operands = tuple(operands[0])
            self._add(name, _einsum_flops(str(equation), operands), operands)
            return
        if name == "tensordot":
            a, b = args[0], args[1]
            dims = args[2] if len(args) > 2 else kwargs.get("dims", 2)
            contracted = list(dims[1]) if isinstance(dims, (list, tuple)) else list(range(int(dims)))
            free = [d for i, d in enumerate(b.shape) if i not in {c % b.dim() for c in contracted}]
            self._add(name, 2 * a.numel() * math.prod(free), (a, b))
            return
        if name in ("matmul", "__matmul__", "mm", "bmm", "linalg_matmul"):
            a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
        elif name == "__rmatmul__":
            b, a = args[0], args[1]
        elif name in ("addmm", "baddbmm", "addbmm"):
            a, b = args[1], args[2]
        elif name == "linear":
            a, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            b = w.transpose(-1, -2) if isinstance(w, Tensor) else None
        else:
            return
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.dim() == 0 or b.dim() == 0:
            return
        self._add(name, _matmul_flops(a, b), (a, b))

    def _add(self, name: str, forward: int, operands: Sequence[Any]) -> None:
        """Count a product of ``forward`` FLOPs on ``operands``: once more per operand that requires grad."""
        tensors = [t for t in operands if isinstance(t, Tensor)]
        if not tensors or any(t.is_meta or _is_fake(t) for t in tensors):  # a measurement's replay, not the step's
            return
        levels = [_functorch_levels(t) for t in tensors]  # a tensor inside vmap does not say it requires grad
        grads = sum(any(bool(x.requires_grad) for x in chain) for chain in levels) if torch.is_grad_enabled() else 0
        copies = max(max(1, chain[-1].numel() // t.numel()) if t.numel() else 1 for t, chain in zip(tensors, levels))
        self.flops += forward * (1 + grads) * copies
        if len(self.examples) < 3:
            shapes = " @ ".join(str(list(t.shape)) for t in tensors)
            self.examples.append(f"{name.strip('_')} {shapes}" + (f" (x{copies}, under vmap)" if copies > 1 else ""))


def _functorch_levels(t: Tensor) -> list[Tensor]:
    """``t`` and the tensors ``torch.func`` transforms wrap it around, outermost first: inside ``vmap`` a tensor's
    shape is one sample's, so a product's FLOPs from it are the batch's over its size (qa44-break 09: 12% of the step
    for 46%); inside ``grad`` (``vmap(grad(f))``: per-sample gradients, qa46-break 10) the wrapper tracks the
    gradient. ``[t]`` outside any transform."""
    functorch = getattr(torch._C, "_functorch", None)  # noqa: SLF001 - functorch's own test of a wrapped tensor
    wrapped = getattr(functorch, "is_functorch_wrapped_tensor", None) or getattr(functorch, "is_batchedtensor", None)
    chain = [t]
    if functorch is None or wrapped is None:
        return chain
    while wrapped(chain[-1]):
        chain.append(functorch.get_unwrapped(chain[-1]))
    return chain


class CallRecorder:
    """Records the outermost module calls inside ``root`` between :meth:`start` and :meth:`stop` (module docstring),
    with process-wide module forward hooks (``torch.nn.modules.module.register_module_forward_pre_hook``) that do
    nothing for modules outside ``root``; each with the calls made inside it down to :data:`MAX_PART_DEPTH` levels
    (:attr:`CallRecord.parts`). A call the autograd engine makes during a backward outside every call recorded in
    grad mode (the recompute of a reentrant ``torch.utils.checkpoint`` of the step's own code) is recorded as a call;
    one inside such a call (activation checkpointing's recompute within it, which its replay repeats) is recorded as a
    part of it when it is a reentrant checkpoint's (its forward ran without grad), for the replay of its parts.

    Attributes:
        calls: the calls recorded since the last :meth:`start`.
    """

    def __init__(self) -> None:
        self.calls: list[CallRecord] = []
        self._names: dict[int, str] = {}
        self._root: weakref.ref[nn.Module] | None = None
        self._outside: set[int] = set()  # modules called in the step found not to be in root (after a new look)
        # the calls in progress: (module, grad mode, the calls made inside it so far, the recorded call it is a
        # recompute inside of, if any)
        self._stack: list[tuple[nn.Module, bool, list[CallRecord], CallRecord | None]] = []
        self._replayed: list[tuple[nn.Module, CallRecord, bool]] = []  # calls whose replay runs their backward
        self._replayed_ids: dict[int, CallRecord] | None = None  # their modules and submodules (found when needed)
        self._regions: list[CallRecord] = []  # the calls made inside a non-reentrant checkpoint, in order
        self._refs: list[tuple[TensorInfo, weakref.ref[Tensor]]] = []
        self._handles: list[Any] = []
        self._batch_tensors: list[tuple[Path, Tensor]] = []
        self._slices: dict[int, tuple[Path, tuple[int, ...] | None]] = {}  # id(TensorInfo) -> the batch tensor it
        # slices (with the entries it leaves out) or copies (None)

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def start(self, root: nn.Module, batch: Any = None) -> None:
        """Start recording the calls of ``root`` and its submodules (a new list of :attr:`calls`); ``batch``: the
        training batch, whose slices among the arguments (``ids[:, :-1]``) are noted while they exist."""
        self.stop(None)
        self.calls, self._refs, self._stack, self._slices = [], [], [], {}
        self._replayed, self._replayed_ids, self._regions = [], None, []
        self._batch_tensors = list(tensor_leaves(batch)) if batch is not None else []
        self._names = {id(m): name for name, m in root.named_modules()}
        self._root, self._outside = weakref.ref(root), set()
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        reserve_hook_ids(root)  # ids of its own (a module sent to a spawned rank keeps its hooks' ids)
        self._handles = [
            register_module_forward_pre_hook(self._before),
            register_module_forward_hook(self._after, with_kwargs=True, always_call=True),
        ]

    def stop(self, batch: Any) -> None:
        """Stop recording; the tensor arguments that are tensors of ``batch`` get their path (:class:`TensorInfo`)."""
        for handle in self._handles:
            remove_global_forward_hook(handle)
        self._handles, self._stack, self._replayed, self._replayed_ids = [], [], [], None
        self._close_regions()
        slices, self._slices, self._batch_tensors = self._slices, {}, []
        if batch is None or not self._refs:
            self._refs = []
            return
        batch_tensors = list(tensor_leaves(batch))
        paths = {id(v): (p, v) for p, v in batch_tensors}
        found: dict[int, tuple[Path, tuple[int, ...] | None]] = {}
        for info, ref in self._refs:
            tensor = ref()
            if tensor is None:  # a temporary of the step (a slice was noted when the call was made)
                continue
            entry = paths.get(id(tensor))
            if entry is not None and entry[1] is tensor:
                found[id(info)] = (entry[0], None)
                continue
        for key, (path, trim) in slices.items():
            found.setdefault(key, (path, trim))
        self._refs = []

        def with_path(info: TensorInfo) -> TensorInfo:
            path, trim = found.get(id(info), (None, None))
            return dataclasses.replace(info, path=path, trim=trim)

        def walk(calls: list[CallRecord]) -> None:
            for each in calls:
                each.args = _map_tensors(each.args, with_path)
                each.kwargs = _map_tensors(each.kwargs, with_path)
                walk(each.parts)

        walk(self.calls)

    def _close_regions(self) -> None:
        """Calls made inside one non-reentrant checkpoint: its early stop ends the recompute of its last call only
        (the others are recomputed whole); then drop the checkpoints' state."""
        last: dict[int, CallRecord] = {}
        for call in self._regions:
            assert call.recompute is not None
            last[id(call.recompute.region)] = call
        for call in self._regions:
            assert call.recompute is not None
            mode = call.recompute.mode if last[id(call.recompute.region)] is call else "full"
            call.recompute = Recompute(mode, call.recompute.context_fn)
        self._regions = []

    def _known(self, module: nn.Module) -> bool:
        """Whether ``module`` is in root: named at :meth:`start`, or made since, in the step (a momentum teacher
        copied in the first ``training_step``: its calls were left out of the first shape's FLOPs, qa51-distill 02),
        found by a new look at root's modules once per module not found."""
        if id(module) in self._names:
            return True
        if id(module) in self._outside:
            return False
        root = self._root() if self._root is not None else None
        if root is not None:
            self._names = {id(m): name for name, m in root.named_modules()}
        if id(module) in self._names:
            return True
        self._outside.add(id(module))
        return False

    def _before(self, module: nn.Module, args: Any) -> None:
        if not self._known(module) or _redirected(module):
            return
        into = None
        if not self._stack and _in_backward():
            into = self._replayed_call(module)
            if into is not None:
                name = self._names[id(module)]
                direct = any(p.target == name and not p.grad for p in into.parts)
                if not (direct and _reentrant_recompute()):
                    # activation checkpointing's recompute inside a call (or a part of it) whose replay repeats it
                    return
        self._stack.append((module, torch.is_grad_enabled(), [], into))

    def _replayed_call(self, module: nn.Module) -> CallRecord | None:
        """The call recorded in grad mode whose module is ``module`` or holds it: its replay runs its backward, with
        any recompute of activation checkpointing inside it (HF's ``gradient_checkpointing_enable()``, or a
        non-reentrant checkpoint around it, :attr:`CallRecord.recompute`); for a call recorded in the backward (a
        reentrant checkpoint's recompute), a module it holds, not its own (a block applied again is recomputed again).
        None for a module called in the backward outside those (a reentrant ``torch.utils.checkpoint`` around a call
        of the step's own code, whose forward ran without grad): its recompute is compute of the step."""
        if self._replayed_ids is None:
            self._replayed_ids = {}
            for root, call, in_backward in self._replayed:
                self._replayed_ids.update((id(m), call) for m in root.modules() if not (in_backward and m is root))
        return self._replayed_ids.get(id(module))

    def _after(self, module: nn.Module, args: Any, *rest: Any) -> None:
        if not self._stack or self._stack[-1][0] is not module:
            return
        _, grad, parts, into = self._stack.pop()
        depth = len(self._stack)
        if depth > MAX_PART_DEPTH or len(rest) != 2:  # nested deeper, or the forward raised (hook(module, args, out))
            return
        if _is_metric(module):  # a torchmetrics metric (its update needs real values; no network compute)
            return
        kwargs, output = rest
        call = self._record(module, args, kwargs, output, grad)
        call.parts = parts
        if grad and not _in_backward():
            call.recompute = _checkpoint_recompute(module)
            if call.recompute is not None:
                self._regions.append(call)
        if depth > 0:  # a call made inside another one: one of its parts
            self._stack[-1][2].append(call)
        elif into is not None:  # a reentrant checkpoint's recompute inside a recorded call: one of its parts
            into.parts.append(call)
        else:
            if grad:
                self._replayed.append((module, call, _in_backward()))
                self._replayed_ids = None
            self.calls.append(call)

    def _record(self, module: nn.Module, args: Any, kwargs: Any, output: Any, grad: bool) -> CallRecord:
        """The :class:`CallRecord` of a call that just returned ``output``: its arguments described (the batch's
        slices among them noted), and, in grad mode, a hook on each output that marks it used when it gets a
        gradient."""
        first = len(self._refs)
        call = CallRecord(
            self._names[id(module)], _describe(tuple(args), self._refs), _describe(dict(kwargs), self._refs), grad
        )
        for info, ref in self._refs[first:]:
            tensor = ref()
            if tensor is None or any(v is tensor for _, v in self._batch_tensors):
                continue
            slices = [(p, v.shape, t) for p, v in self._batch_tensors if (t := slice_trim(tensor, v)) is not None]
            if slices and all(shape == slices[0][1] and t == slices[0][2] for _, shape, t in slices):
                self._slices[id(info)] = (slices[0][0], slices[0][2])  # a slice of one batch tensor (or its aliases)
            elif not slices and (path := copy_of(tensor, self._batch_tensors)) is not None:
                self._slices[id(info)] = (path, None)  # a copy: the batch tensor's shape on another batch
        if not grad:
            return call
        for path, value in tensor_leaves(output):
            if value.requires_grad and value.grad_fn is None:  # a leaf (a parameter returned): a hook would stay on it
                call.used.add(path)
            elif value.requires_grad:
                value.register_hook(_MarkUsed(call.used, path))  # type: ignore[no-untyped-call]
        return call


def _is_metric(module: nn.Module) -> bool:
    """Whether ``module`` is a torchmetrics ``Metric`` (``MetricCollection`` included): its calls update counters
    from the real values (``unique`` and other data-dependent shapes, which no fake replay can run) and are not the
    network's compute, so they are not recorded (nor the calls nested in them)."""
    try:
        from torchmetrics import Metric, MetricCollection
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return False
    return isinstance(module, (Metric, MetricCollection))


def _redirected(module: nn.Module) -> bool:
    """Whether this call of ``module`` is Lightning's forward redirection (DDP and other wrapping strategies: the
    strategy calls the wrapper with ``(batch, batch_idx)`` and the LightningModule's ``forward``, patched for that one
    call, runs ``training_step``; ``lightning.pytorch.strategies.strategy._ForwardRedirection``). Not a model call:
    the calls ``training_step`` makes inside it are the ones to record."""
    forward = vars(module).get("forward")
    return getattr(forward, "__qualname__", "").endswith("_ForwardRedirection.__call__.<locals>.wrapped_forward")


class _MarkUsed:
    """Tensor hook: the output at ``path`` received a gradient (adds it to ``used``; the gradient is unchanged)."""

    def __init__(self, used: set[Path], path: Path) -> None:
        self.used, self.path = used, path

    def __call__(self, grad: Tensor) -> None:
        self.used.add(self.path)


# ------------------------------------------------------------------------------------------------------ replay
_SHARED_ATTRIBUTES = ("_modules", "_parameters", "_buffers")


#: the methods Lightning replaces with compiled wrappers on a LightningModule given as ``torch.compile(model)``
_COMPILED_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")


def fake_copy(
    module: nn.Module, mode: Any, share_attributes: bool = False, device: torch.device | None = None
) -> nn.Module:
    """A deep copy of ``module`` whose parameters, buffers and tensor attributes are fake tensors of ``mode`` (a
    ``FakeTensorMode``) on their real devices, or on ``device`` if given (tied parameters stay tied), with no hooks
    (but a stand-in for HF's ``enable_input_require_grads`` hook, which changes what the backward computes), and with
    random-LTD's patched layers back on their original ``forward`` (and a LightningModule given to the
    Trainer as ``torch.compile(model)`` on its uncompiled methods). ``share_attributes``: the copy shares
    ``module``'s own non-module attributes instead of copying them (for a LightningModule: its data; its trainer
    reference is None)."""

    def fake(tensor: Tensor) -> Tensor:
        out = mode.from_tensor(tensor.detach())
        if device is not None and out.device != device:
            with mode:
                out = out.to(device)
        return out  # type: ignore[no-any-return]

    memo: dict[int, Any] = {}
    for sub in module.modules():
        for name, value in vars(sub).items():
            if "hooks" in name and isinstance(value, dict):  # _forward_hooks, _state_dict_pre_hooks, ...
                memo[id(value)] = type(value)()
            elif isinstance(value, Tensor) and id(value) not in memo:
                memo[id(value)] = fake(value)
        for p in sub._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(fake(p), requires_grad=p.requires_grad)
        for b in sub._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = fake(b)
    if share_attributes:
        for name, value in vars(module).items():
            if name not in _SHARED_ATTRIBUTES and id(value) not in memo:
                # containers and random generators of its own for the copy: a forward that appends to a list on
                # self (a memory bank), counts in a dict, or draws from its own generator would change the module's
                # during a replay
                memo[id(value)] = _private(value)
    clone = copy.deepcopy(module, memo)
    # a method of a module of the original set on an instance (Lightning's forward redirection under DDP leaves the
    # LightningModule's own `forward` there after the first step), shared with ``share_attributes``, ran the real
    # network in the replay: random-LTD's armed layers dropped tokens in it, and the FLOPs were those of the kept
    # tokens (a quarter short under DDP, qa52-ddp 01); it runs the copy's
    copies = {id(a): b for a, b in zip(module.modules(), clone.modules(), strict=True)}
    for sub in clone.modules():
        for name, value in list(vars(sub).items()):
            if callable(value) and not isinstance(value, nn.Module):
                sub.__dict__[name] = _rebound(value, copies)
    if share_attributes:  # the containers made private hold the real modules: their copies (`self.stages = [...]`)
        for name, value in list(vars(clone).items()):
            if isinstance(value, list | tuple | dict) and name not in _SHARED_ATTRIBUTES:
                clone.__dict__[name] = _copies_in(value, copies)
    for original in module.modules():
        # HF's enable_input_require_grads (gradient_checkpointing_enable() calls it; PEFT's k-bit preparation has its
        # own) makes the input embeddings' output require grad, so that the backward runs through frozen layers and
        # recomputes the checkpointed ones: without it the copy's backward stopped at the first trainable layer
        # (0.68x the step's FLOPs with the embeddings and two layers frozen, qa107-user 01)
        if any(_makes_inputs_require_grad(hook) for hook in original._forward_hooks.values()):
            copies[id(original)].register_forward_hook(_inputs_require_grad)
    if isinstance(getattr(module, "_compiler_ctx", None), dict):
        # trainer.fit(torch.compile(model)): Lightning set forward and the *_step methods on the instance to compiled
        # wrappers of the real module's (lightning.pytorch.utilities.compile.from_compiled); shared, they would run
        # the real network (random-LTD's layers armed) instead of the copy: the copy runs its class's methods
        for name in _COMPILED_METHODS:
            clone.__dict__.pop(name, None)
    try:
        from lightning_effi.random_ltd.patching import LTDForward
    except ImportError:  # pragma: no cover - the package ships random-LTD
        return clone
    for sub in clone.modules():
        forward = sub.__dict__.get("forward")
        if isinstance(forward, LTDForward):
            sub.__dict__["forward"] = forward.original
    return clone


def _makes_inputs_require_grad(hook: Any) -> bool:
    """Whether a forward hook is HF's ``enable_input_require_grads`` hook (``make_inputs_require_grads``) or PEFT's
    (``make_inputs_require_grad``), by its name."""
    return str(getattr(hook, "__name__", "")).startswith("make_inputs_require_grad")


def _inputs_require_grad(module: nn.Module, args: Any, output: Any) -> None:
    """The copy's stand-in for :func:`_makes_inputs_require_grad`'s hooks: the output requires grad."""
    if isinstance(output, Tensor) and output.is_floating_point():
        output.requires_grad_(True)


#: how deep :func:`_rebound` looks into partials, closures and wrapped functions
_REBIND_DEPTH = 4


def _rebound(value: Any, copies: Mapping[int, nn.Module], depth: int = 0) -> Any:
    """``value`` (a callable set on a module instance) calling the copies of the original modules (``copies``: id of
    an original module -> its copy) instead: a method bound to one rebound; a ``functools.partial`` of one, a closure
    over one (a lambda, ``torch.autocast(...)(self.forward)``), a function wrapping one (``__wrapped__``, as
    ``torch.compile(self.forward)`` keeps it) rebuilt around the copy (qa53-break 01). Anything else as it is."""
    if depth > _REBIND_DEPTH:
        return value
    if isinstance(value, nn.Module):
        return copies.get(id(value), value)
    if isinstance(value, types.MethodType):
        owner = copies.get(id(value.__self__))
        return types.MethodType(value.__func__, owner) if owner is not None else value
    if isinstance(value, functools.partial):
        func = _rebound(value.func, copies, depth + 1)
        args = tuple(_rebound(a, copies, depth + 1) for a in value.args)
        return value if func is value.func and args == value.args else functools.partial(func, *args, **value.keywords)
    if isinstance(value, types.FunctionType):
        cells = value.__closure__ or ()
        contents = []
        for cell in cells:
            try:
                contents.append(cell.cell_contents)
            except ValueError:  # an empty cell
                contents.append(cell)
        new = [c if c is cell else _rebound(c, copies, depth + 1) for c, cell in zip(contents, cells, strict=True)]
        wrapped = getattr(value, "__wrapped__", None)
        if all(n is c for n, c in zip(new, contents, strict=True)):
            # no closure over the network: a wrapper (functools.wraps) of a method of it runs the copy's method; a
            # wrapper of anything else stays as it is
            inner = _rebound(wrapped, copies, depth + 1) if wrapped is not None and callable(wrapped) else wrapped
            return inner if inner is not wrapped else value
        closure = tuple(cell if n is cell else types.CellType(n) for n, cell in zip(new, cells, strict=True))
        rebuilt = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, closure)
        rebuilt.__kwdefaults__ = value.__kwdefaults__
        rebuilt.__dict__.update(value.__dict__)
        return rebuilt
    wrapped = getattr(value, "__wrapped__", None) or getattr(value, "_torchdynamo_orig_callable", None)
    if wrapped is not None and callable(wrapped):  # a compiled wrapper of a method of the network: the copy's method
        inner = _rebound(wrapped, copies, depth + 1)
        return inner if inner is not wrapped else value
    return value


def _copies_in(value: Any, copies: Mapping[int, nn.Module], depth: int = 0) -> Any:
    """``value`` (a private container of :func:`_private`) with each module of the original (``copies``: id -> its
    copy) replaced by its copy, in place, to a few levels."""
    if isinstance(value, nn.Module):
        return copies.get(id(value), value)
    if depth >= 4:
        return value
    if isinstance(value, dict):
        for k, v in value.items():
            value[k] = _copies_in(v, copies, depth + 1)
        return value
    if type(value) is list:
        value[:] = [_copies_in(v, copies, depth + 1) for v in value]
        return value
    if type(value) is tuple:
        return tuple(_copies_in(v, copies, depth + 1) for v in value)
    return value


def _private(value: Any, depth: int = 0) -> Any:
    """``value`` for a replay's copy of a module to change freely: containers (lists, tuples, dicts, sets, deques;
    nested, to a few levels) rebuilt around their items, random generators (Python's ``random.Random``, NumPy's
    ``Generator`` / ``RandomState``, ``torch.Generator``) copied with their state; anything else shared."""
    if isinstance(value, random.Random) or type(value).__module__.startswith("numpy.random"):
        try:
            return copy.deepcopy(value)
        except Exception:  # pragma: no cover - a generator that cannot be copied is shared
            return value
    if isinstance(value, torch.Generator):
        clone = torch.Generator(device=value.device)
        clone.set_state(value.get_state())
        return clone
    if depth >= 4:
        return value
    if isinstance(value, dict):
        out = copy.copy(value)  # its class (OrderedDict, defaultdict) kept
        for k, v in value.items():
            out[k] = _private(v, depth + 1)
        return out
    if isinstance(value, collections.deque):
        return collections.deque((_private(v, depth + 1) for v in value), maxlen=value.maxlen)
    if type(value) is list:
        return [_private(v, depth + 1) for v in value]
    if isinstance(value, set):
        return set(value)
    if type(value) is tuple:
        return tuple(_private(v, depth + 1) for v in value)
    return value


def _fake_tensor_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _materialize(info: Any) -> Any:
    """Build the replay arguments (inside the fake mode: ``torch.empty`` makes fake tensors, nothing is allocated)."""

    def build(t: TensorInfo) -> Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        return out.requires_grad_(True) if t.requires_grad and (out.is_floating_point() or out.is_complex()) else out

    def rebuild(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: rebuild(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(rebuild(v) for v in value)
        if isinstance(value, _Fields):
            return _Fields(value.cls, tuple((k, rebuild(v)) for k, v in value.fields), value.positional).build()
        return value

    return rebuild(_map_tensors(info, build))


def structure_key(module: nn.Module) -> tuple[Any, ...]:
    """What the training FLOPs of a call depend on besides its arguments: the module's class and training mode, and
    its parameters' shapes and ``requires_grad``."""
    return (
        type(module).__qualname__,
        module.training,
        tuple((tuple(p.shape), p.requires_grad) for p in module.parameters()),
    )


@contextlib.contextmanager
def _fake_tensor_log_quiet() -> Iterator[None]:
    """torch's fake-tensor logger prints a kernel's failure on fake tensors (a 30-line traceback for HF Mixtral's
    ``aten._grouped_mm`` on float32, qa49-moe 02) though the replay's :class:`MeasureError` reports it once."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _replayed(clone: nn.Module, mode: Any, call: CallRecord) -> int:
    """The training FLOPs of ``call`` run on ``clone`` (a :func:`fake_copy` in ``mode``): its forward, as the real
    step ran it, and the backward of the outputs the step used."""
    with mode, flop_counter() as counter:
        args, kwargs = _materialize(call.args), _materialize(call.kwargs)
        with torch.set_grad_enabled(call.grad):
            if call.recompute is None:
                output = clone(*args, **kwargs)
            else:  # as the real step ran it: the backward recomputes the forward
                from torch.utils.checkpoint import checkpoint, noop_context_fn

                early_stop = call.recompute.mode == "early_stop"
                context = call.recompute.context_fn or noop_context_fn
                output = checkpoint(
                    clone, *args, use_reentrant=False, early_stop=early_stop, context_fn=context, **kwargs
                )
        used = [v for p, v in tensor_leaves(output) if p in call.used and v.requires_grad]
        if used:
            loss = used[0].float().sum()
            for value in used[1:]:
                loss = loss + value.float().sum().to(loss.device)
            loss.backward()  # type: ignore[no-untyped-call]
    return int(counter.get_total_flops())


@contextlib.contextmanager
def _ltd_disarmed(root: nn.Module) -> Iterator[None]:
    """Random-LTD's patched layers of ``root`` on their original ``forward`` for the time of a replay (restored
    after): a replay that reaches the real network through a wrapper its copy cannot rebind counts every token, as
    the copy's layers do (:func:`fake_copy`)."""
    try:
        from lightning_effi.random_ltd.patching import LTDForward
    except ImportError:  # pragma: no cover - the package ships random-LTD
        yield
        return
    patched = [(m, f) for m in root.modules() if isinstance(f := m.__dict__.get("forward"), LTDForward)]
    for module, forward in patched:
        module.__dict__["forward"] = forward.original
    try:
        yield
    finally:
        for module, forward in patched:
            module.__dict__["forward"] = forward


def replay_flops(root: nn.Module, call: CallRecord) -> int:
    """Training FLOPs of ``call`` replayed on a fake copy of its target inside ``root`` (module docstring).

    Raises:
        MeasureError: the target is gone, an argument cannot be rebuilt, or the replay fails (the message has the
            error).
    """
    if opaque := call.opaque():
        cache = [kind for kind in opaque if kind.endswith("Cache")]
        hint = (
            f" (an HF {cache[0]}: a model trained with use_cache=True builds one in every forward; pass "
            "use_cache=False in training_step, or set config.use_cache = False)"
            if cache and call.grad
            # a call without grad: a generate() rollout or decoding loop in the step, which builds a cache whatever
            # the config says (the advice named the trained pass, already without one, qa114-rl 01)
            else f" (an HF {cache[0]} in a call without grad: a generate() rollout or a decoding loop in "
            "training_step builds one whatever config.use_cache says; its calls cannot be replayed: pass "
            "use_cache=False to generate() (each step then runs the whole sequence, measured exactly), or define "
            "`effi_training_flops(batch)` on your LightningModule)"
            if cache
            else ""
        )
        raise MeasureError(
            f"{call.target or 'the LightningModule'} was called with {', '.join(opaque)} arguments{hint}"
        )
    try:
        target = root.get_submodule(call.target) if call.target else root
    except AttributeError as err:
        raise MeasureError(f"no module {call.target!r} in {type(root).__name__}") from err
    # the device the call ran on: its arguments'; a module held elsewhere for counting (the V-cycle's parked full
    # model, on the CPU) is measured as if it were there
    own = {t.device for t in (*target.parameters(), *target.buffers())}
    given = {torch.device(t.device) for t in call.tensors()}
    device = next(iter(given)) if len(given) == 1 else next(iter(own), torch.device("cpu"))
    move = device if len(own) == 1 and device not in own else None
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        # outside any dispatch mode of the caller (a FlopCounterMode measuring the real step must not count the replay)
        with (
            _disable_current_modes(),
            torch.random.fork_rng(devices=cuda),
            _python_rng_kept(),
            unshown_warnings(),
            _attention_fastpath_off(),
            _causal_mask_detection_off(),
            _fake_tensor_log_quiet(),
            # Trainer(detect_anomaly=True): the anomaly mode's checks of the backward read fake tensors' data, and
            # every replay failed, taken for a data-dependent shape (FLOPs 0, qa54-extras 02)
            torch.autograd.set_detect_anomaly(False),
        ):
            # a function set on a module of the network that the copy cannot follow (a callable object, a closure
            # over a dict or a namespace holding a module) runs the real modules: random-LTD's layers among them
            # pass every token through while the replay runs, so the real network counts as its copy would
            # (their armed layers dropped tokens: a saving of 0.494 for 0.248, qa54-break 05)
            with _ltd_disarmed(root):
                mode = _fake_tensor_mode()
                clone = fake_copy(target, mode, share_attributes=target is root, device=move)
                return _replayed(clone, mode, call)
    except MeasureError:
        raise
    except Exception as err:
        kinds = {k.__name__ for k in type(err).__mro__}
        if kinds & _DATA_DEPENDENT:
            # torch names a value read on the host (.item(), float(t): aten._local_scalar_dense) a data-dependent
            # output too: torchvision's MixUp reads its random mixing weight so, and was said to make a shape
            # (qa96-user 01)
            raise MeasureError(
                f"replaying {type(target).__name__} failed: its forward makes a shape that depends on the data's "
                f"values, or reads a value on the host ({type(err).__name__}: {err}; boolean-mask indexing such as "
                "hidden[labels != -100], torch.nonzero, masked_select, pack_padded_sequence's lengths, a Python "
                "branch or number read from a tensor such as .item(), float(t) or bool(mask.all())), which a replay "
                "on fake tensors cannot know",
                data_dependent=True,
            ) from err
        raise MeasureError(f"replaying {type(target).__name__} failed ({type(err).__name__}: {err})") from err


#: the exceptions of a fake-tensor replay at an operation whose output shape depends on the data's values
_DATA_DEPENDENT = {"DynamicOutputShapeException", "DataDependentOutputException", "GuardOnDataDependentSymNode"}


@contextlib.contextmanager
def _attention_fastpath_off() -> Iterator[None]:
    """PyTorch's fused inference path of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` off: a frozen
    transformer in eval mode under ``no_grad`` (a teacher, a frozen backbone) runs its forward as one fused op
    (``_transformer_encoder_layer_fwd``, ``_native_multi_head_attention``) that ``FlopCounterMode`` has no formula for:
    a teacher of 67.1M FLOPs a step was counted as 8,192 (qa42-user 01). Off, the replay runs the same products as
    separate ops, which it counts (``torch.backends.mha.set_fastpath_enabled``; restored afterwards)."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


@contextlib.contextmanager
def _causal_mask_detection_off() -> Iterator[None]:
    """``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` given a mask and no ``is_causal`` compare the mask's values
    with a causal one (``torch.nn.modules.transformer._detect_is_causal_mask``), which a fake tensor cannot: every
    replay of a hand-written causal encoder (SASRec, PyTorch's language-model tutorial) failed as a data-dependent
    shape, and the curriculum's FLOPs saving read 0 (qa57-seq 01). While a replay runs, a fake mask reads as not
    causal: the layers then apply the mask itself, whose products ``FlopCounterMode`` counts as the causal path's
    (its attention formula counts the full ``T x T`` scores either way)."""
    from torch.nn.modules import transformer

    detect = transformer._detect_is_causal_mask
    from torch._subclasses.fake_tensor import FakeTensor

    def by_hint(mask: Tensor | None, is_causal: bool | None = None, size: int | None = None) -> bool:
        if isinstance(mask, FakeTensor) and is_causal is None:
            return False
        return detect(mask, is_causal, size)

    transformer._detect_is_causal_mask = by_hint
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect


@contextlib.contextmanager
def _python_rng_kept() -> Iterator[None]:
    """Put Python's ``random`` and NumPy's global random state back afterwards: a replayed forward that draws from
    them (a LayerDrop written with ``random.random()``) must not change the draws of the training that follows."""
    state = random.getstate()
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(state)
        if numpy is not None:
            numpy.random.set_state(np_state)


def _split_key(key: Any) -> tuple[Any, tuple[int, ...]]:
    """``(skeleton, dims)`` of a cache key: the key with the shape of every tensor argument left out (its dtype,
    device, ``requires_grad`` and number of dimensions kept), and those shapes' sizes in order."""
    dims: list[int] = []

    def walk(value: Any) -> Any:
        if isinstance(value, TensorInfo):
            dims.extend(int(d) for d in value.shape)
            return ("tensor", value.dtype, value.device, value.requires_grad, len(value.shape))
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        return value

    return walk(key), tuple(dims)


def share_a_residue(lengths: Sequence[int]) -> bool:
    """Whether the distinct ``lengths`` all leave one remainder modulo some ``m > 1`` (the greatest common divisor
    of their differences is not 1). A cost measured only at such lengths cannot tell a smooth function of the
    length from one that steps every ``m`` (padding to a multiple of ``m``, chunks of ``m``)."""
    xs = sorted(set(lengths))
    return math.gcd(*(b - a for a, b in zip(xs, xs[1:]))) != 1


def _quadratic_at(points: dict[int, int], x: int) -> int | None:
    """The value at ``x`` of the quadratic through three of ``points`` (``{length: FLOPs}``, >= 4 of them: the
    smallest, a middle and the largest length) when every point lies on it exactly, the lengths do not all share a
    residue modulo some ``m > 1`` (the greatest common divisor of their differences is 1) and the value is a whole
    number >= 0; else None.

    The residue condition: FLOPs that are a step function of the length (a model padding it to a multiple of ``m``,
    chunked attention, strided convolutions rounding odd sizes up) lie exactly on a quadratic at lengths of one
    residue modulo ``m`` (``13, 21, 29, 37`` padded to ``16, 24, 32, 40``) and off it in between; lengths of
    different residues show the steps."""
    xs = sorted(points)
    if share_a_residue(xs):
        return None
    chosen = (xs[0], xs[len(xs) // 2], xs[-1])

    def at(v: int) -> Fraction:
        total = Fraction(0)
        for i, xi in enumerate(chosen):
            term = Fraction(points[xi])
            for j, xj in enumerate(chosen):
                if i != j:
                    term *= Fraction(v - xj, xi - xj)
            total += term
        return total

    if any(at(v) != points[v] for v in xs):
        return None
    value = at(x)
    return int(value) if value.denominator == 1 and value >= 0 else None


def _parameters_unused_by(root: nn.Module, target: nn.Module, parts: Sequence[CallRecord]) -> tuple[str, ...]:
    """The names of ``target``'s own parameters (not its submodules') that none of the modules ``parts`` called
    holds (a tied one does) and that a matrix product may use (at least 2 dimensions, the first and the last above 1):
    what ``target``'s forward used in operations of its own, not measured through its parts. A submodule that was not
    called (an expert no token was routed to) is not ``target``'s own; neither is a called module's weight the
    forward also uses itself (a tied ``h @ self.emb.weight.T``: left out, not said)."""
    held: set[int] = set()
    for part in parts:
        try:
            held.update(id(p) for p in root.get_submodule(part.target).parameters())
        except AttributeError:
            continue
    # a matrix or a stack of them ([E, d, f] experts); not a bias or scale ([D]) nor a tensor broadcast over the
    # batch ([1, N, D] cls_token / pos_embed, added: no FLOPs in the real step's count either; qa110-regress 01)
    return tuple(
        name
        for name, p in target.named_parameters(recurse=False)
        if id(p) not in held and p.ndim >= 2 and p.shape[0] > 1 and p.shape[-1] > 1
    )


class FlopsMeter:
    """Training FLOPs of recorded calls (:class:`CallRecorder`), each replayed once per cache key
    (:meth:`CallRecord.key` and :func:`structure_key` of its target) and cached, failures included.

    Lengths between measured ones are interpolated (``interpolate``): calls that differ only in one size (the same
    value at every place it appears in the tensor arguments' shapes, e.g. the padded sequence length ``T`` of
    batches padded to their longest sequence) form a family; once :data:`MIN_FIT_POINTS` lengths of a family were
    replayed and all lie exactly on one quadratic in that size (a transformer's FLOPs are ``a T + b T^2``), and the
    replayed lengths do not all share a residue modulo some ``m > 1`` (:func:`_quadratic_at`: FLOPs that step with
    the length, as with internal padding to a multiple of ``m``, fit a quadratic at one residue only), a length
    strictly between the shortest and the longest replayed one is read off it (a whole number) instead of replayed.
    A length outside that range, or a family whose replays fit no quadratic, is replayed. ``replays`` counts the
    replays. A model whose FLOPs depend on the length otherwise than through a quadratic and such steps (a branch
    taken above some length inside the replayed range with all replayed lengths on one side of it) is measured
    wrongly between its replays: turn interpolation off (``EfficiencyMonitor(interpolate_flops=False)``) or define
    ``effi_training_flops``."""

    #: replayed lengths of a family before lengths between them are interpolated (three fit, the others check)
    MIN_FIT_POINTS = 5

    def __init__(self, interpolate: bool = True) -> None:
        self._cache: OrderedDict[tuple[Any, ...], int | MeasureError] = OrderedDict()
        self._families: dict[Any, list[tuple[tuple[int, ...], int]]] = {}
        self.max_entries = 4096
        self.interpolate = interpolate
        self.replays = 0
        #: calls left out of the FLOPs (:meth:`flops`), by module name: the module's class and why it was not replayed
        self.left_out: dict[str, tuple[str, str]] = {}
        #: calls measured through the module calls inside them (:meth:`flops`) whose module holds parameters of its
        #: own that none of those calls uses, by module name: the module's class, those parameters and the calls
        self.partial: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {}

    def _interpolated(self, key: tuple[Any, ...]) -> int | None:
        """The FLOPs of ``key`` read off its family's replays (class docstring), or None."""
        skeleton, dims = _split_key(key)
        points = self._families.get(skeleton, [])
        for reference, _ in points:
            varying = [j for j, (a, b) in enumerate(zip(reference, dims, strict=True)) if a != b]
            if not varying or len({dims[j] for j in varying}) != 1 or len({reference[j] for j in varying}) != 1:
                continue
            fixed = [j for j in range(len(dims)) if j not in set(varying)]
            family: dict[int, int] = {}
            for other, flops in points:
                values = {other[j] for j in varying}
                if len(values) == 1 and all(other[j] == dims[j] for j in fixed):
                    family[values.pop()] = flops
            if len(family) < self.MIN_FIT_POINTS:
                return None
            length = dims[varying[0]]
            if not min(family) < length < max(family):
                return None
            return _quadratic_at(family, length)
        return None

    def _record(self, key: tuple[Any, ...], flops: int) -> None:
        skeleton, dims = _split_key(key)
        if skeleton not in self._families and len(self._families) >= self.max_entries:
            self._families.clear()
        points = self._families.setdefault(skeleton, [])
        if len(points) < 256:
            points.append((dims, flops))

    def flops(self, root: nn.Module, calls: Sequence[CallRecord]) -> int:
        """The sum over ``calls`` of their training FLOPs on the modules now inside ``root``. A call that cannot be
        replayed for a data-dependent value, of a module without parameters whose outputs received no gradient
        (a data augmentation such as torchvision's ``MixUp``), counts 0 and is noted in :attr:`left_out`.

        Raises:
            MeasureError: a call cannot be replayed (:func:`replay_flops`).
        """
        total = 0
        for call in calls:
            try:
                target = root.get_submodule(call.target) if call.target else root
            except AttributeError as err:
                raise MeasureError(f"no module {call.target!r} in {type(root).__name__}") from err
            key = (call.key(), structure_key(target))
            result = self._cache.get(key)
            if result is None:
                result = self._interpolated(key) if self.interpolate else None
            if result is None:
                self.replays += 1
                try:
                    result = replay_flops(root, call)
                    self._record(key, result)
                except MeasureError as err:
                    result = err
            if key not in self._cache:
                self._cache[key] = result
                if len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
            if isinstance(result, MeasureError):
                patched = getattr(target.__dict__.get("forward"), "drops_tokens", False)
                if result.data_dependent and call.parts and patched:
                    # a random-LTD layer: its parts ran on the kept tokens, and random-LTD's effi_adjust took its
                    # saving off them again (an MoE block's FLOPs 22% low, baseline included; qa49-moe 05)
                    raise MeasureError(
                        f"{type(target).__name__} ({call.target}) is a layer random-LTD drops tokens in, and its "
                        f"forward makes a data-dependent shape ({result}): measured through the module calls inside "
                        "it, it would count the kept tokens' FLOPs, not the full layer's. Define "
                        "`effi_training_flops(batch)` on your LightningModule to give the step's FLOPs"
                    ) from result
                if result.data_dependent and call.parts:
                    # the calls made inside it, each replayed on its recorded shapes (a head on the masked
                    # positions: on this batch's count of them), inside the checkpoint it was made in, if any; its
                    # own operations on parameters of its own are not (an MoE's experts held as [E, d, f]
                    # parameters: 0.21x of the step's FLOPs with nothing said, qa110-seq2seq 01)
                    unused = _parameters_unused_by(root, target, call.parts)
                    if unused:
                        kind = type(target).__name__
                        self.partial.setdefault(call.target, (kind, unused, tuple(p.target for p in call.parts)))
                    parts = [
                        part
                        if part.recompute is not None or call.recompute is None or not part.grad
                        else dataclasses.replace(part, recompute=Recompute("full", call.recompute.context_fn))
                        for part in call.parts
                    ]
                    total += self.flops(root, parts)
                    continue
                if result.data_dependent and not call.used and next(target.parameters(), None) is None:
                    # a module without parameters whose outputs took no part in the backward: preparation of the
                    # data (torchvision's MixUp / CutMix in training_step, which read their random weight on the
                    # host), not the network's compute; its failed replay dropped the whole step's FLOPs (0 for every
                    # run, every saving 0.0; qa96-user 01)
                    self.left_out.setdefault(call.target, (type(target).__name__, str(result)))
                    continue
                raise result
            total += result
        return total
