"""Curriculum data sampling (DeepSpeed Data Efficiency) as pure functions: eligible sets, clusters, draws, DP
slices, and the sequence-length batch transforms. The method card is ``lightning_effi/curriculum/README.md``.

Reference: ``deepspeed/runtime/data_pipeline/data_sampling/data_sampler.py`` (``DeepSpeedDataSampler``) and
Megatron-DeepSpeed ``pretrain_{gpt,bert}.py`` (the sequence-length transforms).

An analysis index is given as ``(ids, offsets, values)`` (see
:class:`lightning_effi.curriculum.analysis.MetricIndex`): ``ids`` int64 ``[N]`` are the ``index_to_sample`` rows
concatenated (ascending metric), ``offsets`` int64 ``[R+1]`` the row boundaries, ``values`` int64 ``[R]`` the
per-row metric value (``None`` for a ``_percentile_merged`` index). A difficulty selects a *prefix* of ``ids``:
``eligible_end`` gives its length.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from lightning_effi.core.checks import check_int, is_int
from lightning_effi.core.measure import Path, leaf_name, leaves, length_stem, opaque_holder, tensor_leaves

DIFFICULTY_TYPES = ("value", "percentile")
PERCENTILE_ROUNDING = ("deepspeed", "proportional")
DP_SPLITS = ("balanced", "deepspeed")
#: the sequence fields of Megatron GPT/BERT batches (a ready ``truncate_keys`` list; by default every ``[B, T, ...]``
#: tensor is cut, whatever its name: :func:`truncate`)
SEQUENCE_KEYS = (
    "input_ids",
    "attention_mask",
    "labels",
    "token_type_ids",
    "position_ids",
    "loss_mask",
    "special_tokens_mask",
)


# --------------------------------------------------------------------------------------------- eligible sets
def eligible_end(
    difficulty: int,
    *,
    difficulty_type: str,
    num_samples: int,
    max_difficulty: int,
    offsets: np.ndarray | None = None,
    values: np.ndarray | None = None,
    percentile_rounding: str = "deepspeed",
) -> int:
    """Number of leading entries of the concatenated ``index_to_sample`` ids eligible at ``difficulty``.

    - ``value``: samples with ``metric <= difficulty``: ``offsets[searchsorted(values, d, "right")]``.
    - ``percentile``: ``deepspeed`` rounding: ``spp = N // max_difficulty``, end ``spp·p`` (``N`` at
      ``p == max_difficulty``); ``proportional``: ``floor(N·p / max_difficulty)``. ``p <= 0`` selects nothing.

    Args:
        difficulty: the current difficulty (int). num_samples: ``N``, the total ids of the index.
        offsets, values: the index rows (``value`` needs both).

    Returns:
        an int in ``[0, N]``.

    Raises:
        ValueError: unknown ``difficulty_type``/``percentile_rounding``; ``value`` without per-row values (a
            ``_percentile_merged`` index); a ``difficulty`` or ``num_samples`` that is not an int; ``max_difficulty``
            not an int >= 1 for ``percentile``; a ``percentile`` difficulty above ``max_difficulty`` (a percentile
            is at most ``max_difficulty``: a schedule that goes past it is misconfigured, not clamped).
    """
    difficulty = check_int("eligible_end", "difficulty", difficulty)
    num_samples = check_int("eligible_end", "num_samples", num_samples, 0)
    if difficulty_type == "value":
        if values is None or offsets is None:
            raise ValueError(
                "difficulty_type 'value' needs index_to_metric (per-row values); a _percentile_merged "
                "index is only valid for difficulty_type 'percentile'"
            )
        return int(offsets[int(np.searchsorted(values, difficulty, side="right"))])
    if difficulty_type != "percentile":
        raise ValueError(f"difficulty_type must be one of {DIFFICULTY_TYPES}, got {difficulty_type!r}")
    max_difficulty = check_int("eligible_end", "max_difficulty", max_difficulty, 1)
    if difficulty > max_difficulty:
        raise ValueError(
            f"eligible_end: percentile difficulty {difficulty} is above max_difficulty {max_difficulty} (a percentile "
            f"difficulty is in [0, max_difficulty]); keep the schedule within [min_difficulty, max_difficulty]"
        )
    p = difficulty
    if p <= 0:
        return 0
    if p >= max_difficulty:
        return int(num_samples)
    if percentile_rounding == "deepspeed":
        return int((num_samples // max_difficulty) * p)
    if percentile_rounding == "proportional":
        return int((num_samples * p) // max_difficulty)
    raise ValueError(f"percentile_rounding must be one of {PERCENTILE_ROUNDING}, got {percentile_rounding!r}")


def percentile_ids(
    rows: Sequence[Sequence[int]], p_start: int, p_end: int, max_difficulty: int, percentile_rounding: str = "deepspeed"
) -> np.ndarray:
    """DeepSpeed's percentile window: ids at cumulative positions ``[start(p_start), end(p_end))`` of the
    rows walked in order (the increment from ``p_start`` to ``p_end``), int64, row order kept."""
    ids = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]) if len(rows) else np.zeros(0, np.int64)
    n = len(ids)
    kw: dict[str, Any] = dict(
        difficulty_type="percentile",
        num_samples=n,
        max_difficulty=max_difficulty,
        percentile_rounding=percentile_rounding,
    )
    return ids[eligible_end(p_start, **kw) : eligible_end(p_end, **kw)]


def eligible_mask(ids: np.ndarray, end: int, num_samples: int) -> np.ndarray:
    """Boolean ``[N]`` mask of the samples ``ids[:end]``."""
    mask = np.zeros(num_samples, dtype=bool)
    mask[ids[:end]] = True
    return mask


def new_cluster(eligible: np.ndarray, assigned: np.ndarray) -> np.ndarray:
    """The newly eligible samples (DeepSpeed's cluster construction): ``eligible & ~assigned`` as sorted int64 ids.
    ``eligible`` is the intersection of the ``schedule_based`` metrics' cumulative sets (all ``True`` without such a
    metric); clusters are therefore pairwise disjoint, their union is the eligible set, and a lower difficulty adds
    nothing."""
    return np.flatnonzero(eligible & ~assigned).astype(np.int64)


# --------------------------------------------------------------------------------------------------- draws
def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(w) & 0xFFFFFFFF for w in words]))


def cluster_permutation(seed: int, cluster_key: int, pass_: int, ids: np.ndarray) -> np.ndarray:
    """Pass ``pass_`` of cluster ``cluster_key`` (its ordinal in creation order): a permutation of ``ids`` that is a
    pure function of ``(seed, cluster_key, pass_)``."""
    return _rng(seed, 0xC1, cluster_key, pass_).permutation(ids)


def batch_generator(seed: int, step: int) -> np.random.Generator:
    """The generator of global batch ``step`` (counter-based: ``SeedSequence([seed, step])``, nothing to checkpoint)."""
    return _rng(seed, 0xB0, step)


def draw_from_cluster(
    ids: np.ndarray, n: int, seed: int, cluster_key: int, pass_: int, position: int, perm: np.ndarray | None = None
) -> tuple[np.ndarray, int, int, np.ndarray]:
    """Exactly ``n`` ids from a cluster walked along its per-pass permutations (fixes DeepSpeed PR #8520, where a
    request larger than the cluster returned fewer ids).

    Args:
        ids: the cluster's ids (int64 ``[C]``, ``C >= 1``). n: ids to draw (>= 0).
        pass_, position: where the walk stands (pass number, entries of that pass already taken).
        perm: the permutation of ``pass_`` if already computed (a cache; must equal :func:`cluster_permutation`).

    Returns:
        ``(drawn int64[n], pass, position, perm)`` after the draw. Within one pass no id repeats; a request larger
        than the cluster wraps as many passes as needed.

    Raises:
        ValueError: an empty cluster, ``n`` not an int >= 0, ``position`` not in ``[0, C)``.
    """
    size = len(ids)
    if size == 0:
        raise ValueError("draw_from_cluster: empty cluster")
    if not is_int(n) or n < 0:
        raise ValueError(f"draw_from_cluster: n must be an int >= 0, got {n!r}")
    if not is_int(position) or not 0 <= position < size:
        raise ValueError(
            f"draw_from_cluster: position must be an int in [0, {size}) (the cluster's size), got {position!r}"
        )
    if perm is None:
        perm = cluster_permutation(seed, cluster_key, pass_, ids)
    out = []
    while n > 0:
        take = min(n, size - position)
        out.append(perm[position : position + take])
        position, n = position + take, n - take
        if position == size:
            pass_, position = pass_ + 1, 0
            perm = cluster_permutation(seed, cluster_key, pass_, ids)
    drawn = np.concatenate(out) if out else np.zeros(0, np.int64)
    return drawn.astype(np.int64, copy=False), pass_, position, perm


# ------------------------------------------------------------------------------------------------ DP slices
def dp_slice(length: int, dp_size: int, rank: int, mode: str = "balanced") -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s share of a chunk of ``length`` samples.

    ``balanced`` (default, ``np.array_split``): the first ``length mod dp`` ranks get one more. ``deepspeed``:
    Python ``round`` (banker's rounding) of ``r·length/dp``. Sizes differ by at most one either way.

    Raises:
        ValueError: ``length`` not an int >= 0, ``dp_size`` not an int >= 1, ``rank`` not in ``[0, dp_size)``, an
            unknown ``mode``.
    """
    length = check_int("dp_slice", "length", length, 0)
    dp_size = check_int("dp_slice", "dp_size", dp_size, 1)
    rank = check_int("dp_slice", "rank", rank, 0, dp_size - 1)
    if mode == "balanced":
        base, extra = divmod(length, dp_size)
        start = rank * base + min(rank, extra)
        return start, start + base + (1 if rank < extra else 0)
    if mode == "deepspeed":
        return round(rank * length / dp_size), round((rank + 1) * length / dp_size)
    raise ValueError(f"dp_split must be one of {DP_SPLITS}, got {mode!r}")


# ------------------------------------------------------------------------------------------- batch transforms
# A batch is whatever the user's collate function made: a tensor, a tuple ``(x, y)``, a list, a dict, a dataclass, an
# HF ``BatchEncoding``, nested. It is walked like :func:`lightning_effi.core.measure.leaves` (mappings by key, tuples
# and lists by index, dataclass instances by field name) and rebuilt with the same types (:func:`map_tensors`). A
# tensor's *name* is the last dict key or field name on its path (a tuple entry has none).


def _name(path: Path) -> str | None:
    return path[-1] if path and isinstance(path[-1], str) else None


def _rebuild_mapping(batch: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    if all(items[k] is v for k, v in batch.items()):
        return batch
    try:  # dict, OrderedDict, defaultdict, BatchEncoding (its other attributes kept), ...: a shallow copy, then set
        out = copy.copy(batch)
        for k, v in items.items():
            if v is not batch[k]:
                out[k] = v  # type: ignore[index]
        return out
    except TypeError:  # a read-only mapping: its type built from the new items
        return type(batch)(items)  # type: ignore[call-arg]


def map_tensors(batch: Any, fn: Callable[[Path, Tensor], Tensor], path: Path = ()) -> Any:
    """``batch`` with every tensor leaf ``v`` at ``path`` replaced by ``fn(path, v)``, rebuilt with the same types:
    mappings (``dict``, ``OrderedDict``, HF ``BatchEncoding``, ...: a shallow copy with the new values, other
    attributes kept), tuples (named tuples by field), lists, dataclass instances (a shallow copy with the new field
    values, frozen ones included); other leaves as they are. Containers whose tensors all come back unchanged are
    returned as they are (the same object); ``batch`` itself is never modified."""
    if isinstance(batch, Tensor):
        return fn(path, batch)
    if isinstance(batch, Mapping):
        return _rebuild_mapping(batch, {k: map_tensors(v, fn, (*path, k)) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        named = isinstance(batch, tuple) and hasattr(batch, "_fields")  # by field name, as leaves() walks it
        keys = list(getattr(batch, "_fields")) if named else range(len(batch))  # noqa: B009
        values = [map_tensors(v, fn, (*path, k)) for k, v in zip(keys, batch, strict=True)]
        if all(a is b for a, b in zip(values, batch)):
            return batch
        return type(batch)(*values) if named else type(batch)(values)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        new = {f.name: map_tensors(getattr(batch, f.name), fn, (*path, f.name)) for f in dataclasses.fields(batch)}
        if all(new[k] is getattr(batch, k) for k in new):
            return batch
        out = copy.copy(batch)
        for k, v in new.items():
            object.__setattr__(out, k, v)  # frozen dataclasses too
        return out
    return batch


def _is_integer(v: Tensor) -> bool:
    return not (v.is_floating_point() or v.is_complex() or v.dtype == torch.bool)


#: mask names that do not mark padding: never read as a padding mask (:func:`padding_mask`)
NON_PADDING_MASKS = ("loss_mask", "special_tokens_mask")


def _is_mask_name(name: str | None) -> bool:
    """A padding-mask name: contains ``mask`` (any case), not one of :data:`NON_PADDING_MASKS`."""
    return name is not None and "mask" in name.lower() and name.lower() not in NON_PADDING_MASKS


def _reference(batch: Any, keys: Sequence[str] | None) -> tuple[Path, Tensor] | None:
    found = [(p, v) for p, v in tensor_leaves(batch) if v.ndim >= 2]
    for name in keys if keys is not None else ("attention_mask", "input_ids"):
        for path, value in found:
            if _name(path) == name:
                return path, value
    if keys is None:
        # token ids [B, T] whose B is the batch's (the first dimension of its first tensor of 2 dimensions or more,
        # not an index of its own): a graph batch's edge_index [2, E] beside node features [N, F] is none (its edge
        # lists were cut to the scheduled length in silence, qa54-domains 01, qa55-break 04), nor position ids [1, T]
        # beside tokens [B, T]; a task id [1] before the ids is no batch size
        found = [(p, v) for p, v in found if not _index_name(_name(p))]
        # a broadcast [1, T] tensor (position or time ids of another name) is no batch size beside [B, T] ones
        lead = next((int(v.shape[0]) for _, v in found if int(v.shape[0]) > 1), 1 if found else None)
        for path, value in found:
            if value.ndim == 2 and _is_integer(value) and int(value.shape[0]) == lead:
                return None if is_edge_list(batch, value) else (path, value)
    return None


def channel_first_window(batch: Any, keys: Sequence[str] | None, max_difficulty: int) -> str | None:
    """A description of the batch's sequence tensor (:func:`sequence_reference`) when it reads as channel first
    ``[B, C, T]`` against ``max_difficulty``: a float ``[B, S, D]`` tensor whose axis 1 (read as the sequence) is longer
    than ``max_difficulty`` while its last axis is ``max_difficulty`` itself (a forecaster's look-back window held
    ``[B, channels, steps]``, as PatchTST and DLinear code bases hold it, had its channels cut, qa56-ts 03); None
    otherwise. Used by ``Curriculum.setup`` with ``seqlen_truncate``'s ``max_difficulty`` (tokens)."""
    found = _reference(batch, keys)
    if found is None:
        return None
    path, v = found
    if v.ndim != 3 or not v.is_floating_point() or _is_mask_name(_name(path)):
        return None
    if int(v.shape[1]) > max_difficulty == int(v.shape[2]):
        return f"{'.'.join(map(str, path)) or 'batch'}: {str(v.dtype).replace('torch.', '')}{list(v.shape)}"
    return None


def is_edge_list(batch: Any, value: Tensor) -> bool:
    """Whether the integer ``[2, E]`` tensor ``value`` of ``batch`` reads as a graph's edge list (PyG's
    ``edge_index``) rather than token ids ``[B=2, T]``: no other tensor ``[2, E, ...]`` beside it (graph-level
    targets ``[2]``, ``[2, 1]`` of 2 graphs may be), and a float tensor ``[N, F]`` of ``N != 2`` rows
    (node features) has a row for every index of ``value`` (all in ``[0, N)``). An unnamed ``(edge_index, x)``
    tuple had its edge list cut to the scheduled length in silence (qa55-break 04, qa58-break 03)."""
    if value.ndim != 2 or int(value.shape[0]) != 2 or not _is_integer(value) or value.numel() == 0:
        return False
    others = [v for _, v in tensor_leaves(batch) if v is not value and v.ndim >= 1]
    # a [2, E, ...] partner of 2 rows of ids (their labels, their mask) vetoes; graph-level targets y [2] or [2, 1] of a
    # batch of 2 graphs do not (qa58-break 03, qa59-break 07)
    width = int(value.shape[1])
    if any(int(v.shape[0]) == 2 and v.ndim >= 2 and int(v.shape[1]) == width for v in others):
        return False
    low, high = int(value.min()), int(value.max())
    return low >= 0 and any(v.ndim == 2 and v.is_floating_point() and high < int(v.shape[0]) for v in others)


def _index_name(name: str | None) -> bool:
    """A name of an index tensor that is no token ids: a graph's ``edge_index`` (:data:`GRAPH_INDEX_NAMES`) or
    position or time ids (:data:`POSITION_NAMES`, or a name ending in ``position_ids``); not a word holding one of
    them (``composition``, qa56-break 04)."""
    lowered = str(name or "").lower()
    return lowered in GRAPH_INDEX_NAMES or lowered in POSITION_NAMES or lowered.endswith("position_ids")


#: names of a token's position in its row, which restarts at a packed row's next document (torchtune's ``input_pos``)
PACKED_POSITION_NAMES = ("pos", "pos_id", "pos_ids", "positions", "token_positions", "input_pos")
#: names of a token's document index in a packed row (it changes at the next document)
PACKED_DOCUMENT_NAMES = ("document_ids", "doc_ids", "document_id", "doc_id")

#: names of position or time ids beside token ids
POSITION_NAMES = ("pos", "pos_ids", "positions", "time_ids", "timestep_ids", "timesteps", "token_positions")


#: the names of a graph batch's index tensors (PyG's ``Batch``)
GRAPH_INDEX_NAMES = ("edge_index", "batch", "ptr", "edge_attr_index")


def _sizes(path: Path, ref: Tensor) -> tuple[int, int]:
    """``(B, T)`` of the reference: its dimensions 0 and 1, or 0 and -1 for a mask of more than 2 dimensions."""
    if ref.ndim > 2 and _is_mask_name(_name(path)):
        return int(ref.shape[0]), int(ref.shape[-1])
    return int(ref.shape[0]), int(ref.shape[1])


def sequence_reference(batch: Any, keys: Sequence[str] | None = None) -> Tensor | None:
    """The tensor that gives the batch's size ``B`` (its dimension 0) and sequence length ``T`` (its dimension 1;
    its last dimension for a mask of more than 2 dimensions: ``[B, 1, 1, T]``, ``[B, 1, T, T]``, ``[B, T, T]``), any
    batch structure:

    - ``keys`` given: the first tensor named ``keys[0]``, else ``keys[1]``, ... with at least 2 dimensions;
    - ``keys`` None (automatic): the first tensor named ``attention_mask``, else ``input_ids``, with at least 2
      dimensions, else the first integer (not bool) tensor of exactly 2 dimensions whose first dimension is that of
      the batch's first tensor of 2 dimensions or more (token ids ``[B, T]``; in a tuple batch ``(ids, labels)``,
      ``ids``; a broadcast ``[1, T]`` tensor gives no batch size beside ``[B, T]`` ones); tensors named
      ``edge_index`` or like position ids are none (a graph batch's ``edge_index [2, E]`` beside node features
      ``[N, F]``, ``position_ids [1, T]`` beside tokens), nor an unnamed integer ``[2, E]`` tensor that reads as an
      edge list (:func:`is_edge_list`).

    The batch must be batch-first (``[B, T]``, ``batch_first=True``): a sequence-first ``[T, B]`` tensor reads as
    ``B = T`` (:func:`truncate` refuses it when given the batch size). None when there is none (images, float
    features only)."""
    found = _reference(batch, keys)
    return None if found is None else found[1]


def sequence_path(batch: Any, keys: Sequence[str] | None = None) -> str | None:
    """The dotted path (dict keys, field names, tuple indices) of the batch's sequence tensor
    (:func:`sequence_reference`), ``"batch"`` for a bare tensor; None when it has none."""
    found = _reference(batch, keys)
    return None if found is None else ".".join(map(str, found[0])) or "batch"


def sequence_length(batch: Any, keys: Sequence[str] | None = None) -> int | None:
    """The batch's sequence length ``T`` of :func:`sequence_reference` (its dimension 1, the last one for a mask of
    more than 2 dimensions); None when it has none. The length :func:`truncate_batch` cuts."""
    found = _reference(batch, keys)
    return None if found is None else _sizes(*found)[1]


def has_token_ids(batch: Any, b: int, t: int) -> bool:
    """Whether ``batch`` holds token ids of its sequence: an integer ``[B, T]`` tensor not named like a mask (text;
    an image's or a video's features beside it are not its sequence, :func:`cut_axes`)."""
    return any(
        v.ndim == 2 and tuple(v.shape) == (b, t) and _is_integer(v) and not _is_mask_name(_name(p))
        for p, v in tensor_leaves(batch)
    )


def cut_axes(
    path: Path, v: Tensor, b: int, t: int, keys: Sequence[str] | None = None, text: bool = False
) -> tuple[int, ...]:
    """The axes of ``v`` (at ``path`` in a batch of size ``b`` and sequence length ``t``) that :func:`truncate` cuts;
    ``()`` for a tensor it leaves alone (fewer than 2 dimensions, another batch size, not named in ``keys`` when
    ``keys`` is given, no axis of length ``t`` where one is looked for):

    - ``[B, T, ...]``: axis 1, and axis 2 too when it has length ``T`` (a pairwise ``[B, T, T, ...]`` tensor: an
      attention bias, a 3-D mask). A ``[B, T, D]`` feature tensor whose width ``D`` happens to equal ``T`` is
      therefore cut on both axes. Not, in a batch of token ids (``text``, :func:`has_token_ids`) and unless named in
      ``keys``, a tensor of 3 or more dimensions named like an image's or a video's features (:data:`VISUAL_NAMES`:
      ``image_embeds``, ``vision_features`` beside the text; a video model's ``video_features`` without ids are its
      sequence, cut).
    - position ids broadcast over the batch (``[1, T]``, :func:`_index_name`, or unnamed in a tuple): axis 1.
    - otherwise, with at least 3 dimensions and the last of length ``T``, a tensor named like a mask
      (``*mask*``: ``[B, 1, 1, T]``) or whose last two axes have length ``T`` (``[B, 1, T, T]``, ``[B, H, T, T]``;
      not images, :func:`_looks_like_images`): the last axis, and the one before it when it has length ``T``.
    """
    if keys is not None and _name(path) not in keys:
        return ()
    name = str(_name(path) or "").lower()
    if v.ndim == 2 and v.shape[0] == 1 < b and v.shape[1] == t:
        # position ids broadcast over the batch, [1, T]: cut with the tokens; an unnamed one too (a tuple batch's
        # (time_ids, ids) crashed the model on 4 vs 8 positions, qa57-break)
        if _name(path) is None or (_index_name(name) and name not in GRAPH_INDEX_NAMES):
            return (1,)
    if v.ndim < 2 or v.shape[0] != b:
        return ()
    if v.shape[1] == t:
        if keys is None and text and v.ndim >= 3 and any(part in name for part in VISUAL_NAMES):
            # an image's features beside the text ([B, P, D] image_embeds / vision_features): its patch count that
            # equals the text's length is no sequence axis (a VLM's image cut to the text's 8 tokens, qa111-multimodal
            # 01); named in truncate_keys, it is cut
            return ()
        return (1, 2) if v.ndim >= 3 and v.shape[2] == t else (1,)
    if v.ndim >= 3 and v.shape[-1] == t:
        if v.shape[-2] == t and not _looks_like_images(path, v):
            return (v.ndim - 2, v.ndim - 1)
        if _is_mask_name(_name(path)):
            return (v.ndim - 1,)
    return ()


#: parts of a tensor's name that say it holds images (``pixel_values``, ``images``): a ``[B, C, S, S]`` image
#: whose side equals the text's padded length is no pairwise ``[B, H, T, T]`` tensor (32 x 32 images were cropped
#: beside text padded to 32, qa47-user 02)
IMAGE_NAMES = ("pixel", "image", "img", "video", "frame")
#: parts of a feature tensor's name that say it holds an image's or a video's features, never cut along its second
#: axis unless named in ``truncate_keys`` (not ``frame``: an audio model's frames are its sequence)
VISUAL_NAMES = ("pixel", "image", "img", "video", "vision")


def _looks_like_images(path: Path, v: Tensor) -> bool:
    """An image tensor: named like one (:data:`IMAGE_NAMES`), or, not named like a mask, a float ``[B, 3, S, S]``."""
    name = str(_name(path) or "").lower()
    if any(part in name for part in IMAGE_NAMES):
        return True
    return v.ndim == 4 and v.shape[1] == 3 and v.is_floating_point() and not _is_mask_name(_name(path))


def _real_named(path: Path, v: Tensor) -> Tensor:
    """``[B, T]`` bool: the real (non-padding) positions of a named mask (``[B, T]``, or ``[B, ..., T]``: a key
    position is real when any query may attend to it)."""
    name = str(_name(path))
    pad_convention = "padding_mask" in name.lower()  # PyTorch key_padding_mask: True / nonzero = padding
    if v.is_floating_point():
        additive = bool((v < 0).any()) or not bool((v != 0).any())  # 0 = attend, negative = masked
        if additive:
            if bool((v > 0).any()):
                raise ValueError(
                    f"seqlen_truncate: the float mask {'.'.join(map(str, path))!r} mixes positive and negative "
                    "values: a float mask must be additive (0 = attend, negative / -inf = masked) or hold only 0 and 1"
                )
            allowed = v == 0
        elif bool(((v != 0) & (v != 1)).any()):
            raise ValueError(
                f"seqlen_truncate: the float mask {'.'.join(map(str, path))!r} holds values other than 0 and 1: a "
                "float mask must be additive (0 = attend, negative / -inf = masked) or hold only 0 and 1"
            )
        else:
            allowed = v == 0 if pad_convention else v != 0
    else:
        allowed = v == 0 if pad_convention else v != 0
    return allowed.flatten(1, -2).any(1) if v.ndim > 2 else allowed


def _plausible_padding(real: Tensor, ids: Tensor | None) -> bool:
    """Every row's real positions are one run touching an end (a prefix or a suffix), and the ids at the padding
    positions all hold one value (the pad id)."""
    if real.shape[1] > 1 and bool(((real[:, 1:] != real[:, :-1]).sum(1) > 1).any()):
        return False
    if ids is None:
        return True
    pads = ids[~real]
    return pads.numel() == 0 or bool((pads == pads[0]).all())


def padding_mask(batch: Any, keys: Sequence[str] | None = None) -> tuple[Path, Tensor, Tensor] | None:
    """The batch's padding mask, which :func:`truncate` reads, as ``(path, mask, real)``: ``real`` is bool ``[B, T]``,
    True at the real (non-padding) tokens. The first of, in this order:

    1. a tensor named ``attention_mask``; 2. a tensor whose name contains ``padding_mask`` (``padding_mask``,
       ``key_padding_mask``, ``src_key_padding_mask``); 3. any other tensor whose name contains ``mask`` (any case;
       not ``loss_mask`` / ``special_tokens_mask``, :data:`NON_PADDING_MASKS`). Of shape ``[B, T]`` or ``[B, ..., T]``
       (a key position is real when any query may attend to it). Read by name: ``*padding_mask*`` follows PyTorch's
       ``key_padding_mask`` (True / nonzero = padding), every other name HF's ``attention_mask`` (nonzero = real).
       A float mask is additive when it has a negative value or is all zero (0 = real, negative / ``-inf`` =
       masked, either name), else it must hold only 0 and 1 (read as above).
    4. in a tuple or list batch (entries have no name): a bool or 0/1 (integer or float) ``[B, T]`` entry other than
       the token ids (:func:`sequence_reference`) whose every row is padded on one side, with one pad id in the ids
       at the padding positions. Its convention (1 = real or 1 = padding) is the one for which that holds (1 = real
       when both do). An all-0 entry (the ``token_type_ids`` of single sentences, or a True = padding mask of a batch
       without padding) yields to a later entry that fits. At a few tokens the token types of sentence pairs may
       fit too: give a tuple's mask before its token types (or name the entries, or define the module's
       ``effi_count_tokens``).

    None when there is none: then every position counts as real (so a left-padded tuple batch needs its mask in the
    batch).

    Raises:
        ValueError: a float mask that is neither additive nor 0/1; a named ``[B, T]`` mask whose reading by name
            contradicts the token ids (its padding positions hold varying ids, every row padded on one side with one
            pad id under the opposite reading: a ``padding_mask`` holding 1 at the real tokens).
    """
    keys = None if keys is None else tuple(keys)
    found = _reference(batch, keys)
    if found is None:
        return None
    b, t = _sizes(*found)
    ref = found[1]
    leaves = [
        (p, v)
        for p, v in tensor_leaves(batch)
        if v.ndim >= 2 and v.shape[0] == b and v.shape[-1] == t and (v.ndim > 2 or v.shape[1] == t)
    ]
    # an observed-values mask (HF time series' past_observed_mask: 0 at a missing value) is no padding mask: a gap
    # read as padding refused a forecaster's window (qa56-ts 01)
    named = [(p, v) for p, v in leaves if _is_mask_name(_name(p)) and "observed" not in str(_name(p)).lower()]

    def rank(p: Path) -> int:
        name = str(_name(p)).lower()
        return 0 if name == "attention_mask" else 1 if "padding_mask" in name else 2

    ids = ref if ref.ndim == 2 and _is_integer(ref) and tuple(ref.shape) == (b, t) else None
    if named:
        path, value = min(named, key=lambda pv: rank(pv[0]))  # min is stable: the first of the best rank
        real = _real_named(path, value)
        if (
            ids is not None
            and value is not ids
            and not _plausible_padding(real, ids)
            and _plausible_padding(~real, ids)
        ):
            where = ".".join(map(str, path))
            raise ValueError(
                f"seqlen_truncate: the mask {where!r} reads, by its name, as "
                + (
                    "True / nonzero = padding (a *padding_mask* name: PyTorch's key_padding_mask convention)"
                    if "padding_mask" in where.lower()
                    else "nonzero = real token (HF's attention_mask convention)"
                )
                + ", but the token ids at its padding positions vary while the opposite reading fits the ids: "
                "invert the mask or rename it (attention_mask for 1 = real, padding_mask for 1 = padding)"
            )
        return path, value, real
    first: tuple[Path, Tensor, Tensor] | None = None
    for path, value in leaves:
        if not path or isinstance(path[-1], str) or value is ref or value.ndim != 2:
            continue
        binary = (_is_integer(value) or value.is_floating_point()) and bool(((value == 0) | (value == 1)).all())
        if value.dtype != torch.bool and not binary:
            continue
        zeros = not bool(value.bool().any())
        for real in (value != 0, value == 0):
            if _plausible_padding(real, ids):
                if not zeros:
                    return path, value, real
                first = first or (path, value, real)  # all 0: single sentences' token types, or no padding
    return first  # only all-0 entries: no padding is marked, every position real


def check_batch_first(batch: Any, batch_size: int, keys: Sequence[str] | None = None, technique: str = "") -> None:
    """Refuse a sequence-first batch: the reference tensor (:func:`sequence_reference`) is ``[T, B]`` (its dimension 1,
    not 0, is the number of samples collated, ``batch_size``; PyTorch's ``batch_first=False`` layout).

    Raises:
        ValueError: naming ``technique``, the tensors found and ``batch_first=True``.
    """
    found = _reference(batch, keys)
    if found is None:
        return
    b, t = _sizes(*found)
    if b != batch_size and t == batch_size:
        raise ValueError(
            f"{technique or 'curriculum'}: the batch is sequence-first: {batch_size} samples were collated, but the "
            f"sequence tensor {'.'.join(map(str, found[0])) or 'batch'} has shape {list(found[1].shape)} ([T, B]); "
            f"found a {describe_batch(batch)}. The curriculum cuts dimension 1 of [B, T] tensors: collate "
            "batch-first tensors (batch_first=True; transpose inside training_step if the model wants [T, B])"
        )


def tensor_names(batch: Any) -> list[str]:
    """The names (dict keys, dataclass fields) of the batch's tensors, in batch order, each once: what
    ``truncate_keys`` can name (an unnamed tuple entry has none)."""
    names: list[str] = []
    for path, _ in tensor_leaves(batch):
        name = _name(path)
        if name is not None and name not in names:
            names.append(name)
    return names


def describe_batch(batch: Any) -> str:
    """The tensors of a batch as ``path: dtype[shape]`` (for error messages)."""
    parts = [
        f"{'.'.join(map(str, p)) or 'batch'}: {str(v.dtype).replace('torch.', '')}{list(v.shape)}"
        for p, v in tensor_leaves(batch)
    ]
    if parts:
        return f"{type(batch).__name__} with " + ", ".join(parts)
    holder = opaque_holder(batch)
    if holder is not None:  # a class of one's own holding tensors (qa45-break 04: "a Custom with no tensor")
        where = "" if holder == type(batch).__name__ else f" that holds its tensors in a {holder}, which is"
        return (
            f"{type(batch).__name__}{where or ','} not looked into (tensors are found in tuples, lists, mappings and "
            "dataclasses: make it a dataclass)"
        )
    return f"{type(batch).__name__} with no tensor"


def _take(v: Tensor, axis: int, window: slice, index: Tensor | None) -> Tensor:
    """``v`` cut on ``axis`` to ``window``, or to each row's columns ``index`` (``[B, L]``): a contiguous copy either
    way (a narrowed view of ``[B, T]`` is not contiguous, and a model's own ``labels.view(-1)``, as in Hugging Face's
    ``BertForMaskedLM`` loss, would fail on it)."""
    if index is None:
        return v.narrow(axis, window.start, window.stop - window.start).contiguous()
    moved = v.movedim(axis, 1)
    rows = torch.arange(v.shape[0], device=v.device)[:, None]
    return moved[rows, index.to(v.device)].movedim(1, axis)


class Truncation(NamedTuple):
    """What :func:`truncate` did to a batch.

    Attributes:
        batch: the truncated batch (same structure and types as the input).
        full_length: ``T``, the sequence length before (None: no sequence tensor was found, nothing was cut).
        length: the sequence length after (``min(L, T)``; None with ``full_length``).
        cut_mask: the values of the batch's padding mask (:func:`padding_mask`: ``attention_mask``, a
            ``*padding_mask*``, a tuple's unnamed 0/1 entry, ...) at the removed positions (``[B, T - L]`` for a
            ``[B, T]`` mask; its shape with ``T - L`` on the cut axis for ``[B, 1, 1, T]``), each row's in column
            order; None when nothing was removed, the batch has no padding mask, or it was cut on two axes (a
            pairwise ``[B, ..., T, T]`` mask). :func:`lengthen_batch` puts them back at ``mask_path``.
        left: the batch was left-padded and its last ``L`` columns were kept.
        cut: the paths of the tensors cut (:func:`lightning_effi.core.measure.leaves` paths).
        axes: the axes cut of each of ``cut`` (:func:`cut_axes`), in the same order.
        mask_path: the path of the padding mask whose values ``cut_mask`` holds (None with it).
        cut_values: path -> the removed values of every ``[B, T]`` tensor cut (token ids, token types, 0/1 masks,
            labels: ``[B, T - L]``, each row's in column order; the small per-token tensors), so that
            :func:`lengthen_batch` gives them back exactly; wider tensors (``[B, T, D]``, pairwise masks) are not
            kept; and the original of every ``[B]`` tensor of the rows' lengths that was clamped to the kept length
            (:func:`row_lengths`), and of a packed batch's sequence boundaries and longest length (an int or a
            tensor, :func:`_cut_packed`). None when nothing was cut.
    """

    batch: Any
    full_length: int | None
    length: int | None
    cut_mask: Tensor | None
    left: bool
    cut: tuple[Path, ...]
    axes: tuple[tuple[int, ...], ...] = ()
    mask_path: Path | None = None
    cut_values: Mapping[Path, Any] | None = None


#: names of the sequence boundaries of a packed batch (Hugging Face's ``DataCollatorWithFlattening(
#: return_flash_attn_kwargs=True)``, flash-attention's varlen kernels): ``[n + 1]`` offsets into the flattened row
BOUNDARY_NAMES = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "cu_seqlens_q", "cu_seqlens_k")
#: names of a packed batch's longest sequence (an int or a 0-d tensor) beside its boundaries
LONGEST_NAMES = ("max_length_q", "max_length_k", "max_seqlen", "max_seqlen_q", "max_seqlen_k")


def _packed_leaves(batch: Any) -> list[tuple[Path, Any]]:
    """The boundaries and longest lengths of a packed batch (:data:`BOUNDARY_NAMES`, :data:`LONGEST_NAMES`)."""
    return [(path, v) for path, v in leaves(batch) if _name(path) in (*BOUNDARY_NAMES, *LONGEST_NAMES)]


def _replace_leaf(batch: Any, path: Path, value: Any) -> Any:
    """``batch`` with its leaf at ``path`` replaced (mappings, dataclasses, lists and tuples rebuilt along the path;
    ``batch`` not modified)."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(batch, Mapping):
        items = dict(batch.items())
        items[key] = _replace_leaf(batch[key], rest, value)
        return _rebuild_mapping(batch, items)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{key: _replace_leaf(getattr(batch, key), rest, value)})
    if isinstance(key, str):  # a named tuple's field
        return batch._replace(**{key: _replace_leaf(getattr(batch, key), rest, value)})
    items_list = list(batch)
    items_list[key] = _replace_leaf(items_list[key], rest, value)
    return type(batch)(items_list)


def _cut_packed(batch: Any, out: Any, b: int, t: int, length: int, plain: bool, values: dict[Path, Any]) -> Any:
    """The cut of a packed batch's sequence boundaries (:func:`_packed_leaves`): offsets clamped to the ``length``
    kept (the first ``length`` positions of its one row), the repeated ones dropped, the longest length the longest
    sequence left; the originals kept in ``values`` for :func:`lengthen_batch`. A flash-attention varlen kernel was
    given the boundaries of the uncut row, past the end of the tensors, and the monitor counted its documents
    (qa51-llm 01, qa51-break 04).

    Raises:
        ValueError: boundaries that are not ``0 .. t`` offsets of one row, or a cut that does not keep the first
            positions (left padding, ``keep_last_token``).
    """
    found = _packed_leaves(batch)
    if not found:
        return out
    bounds = next((v for path, v in found if _name(path) in BOUNDARY_NAMES), None)
    if not isinstance(bounds, Tensor) or bounds.ndim != 1 or bounds.numel() < 2:
        return out
    valid = int(bounds[0]) == 0 and int(bounds[-1]) == b * t and bool((bounds[1:] >= bounds[:-1]).all())
    if b != 1 or not valid or not plain:
        names = ", ".join(repr(_name(path)) for path, _ in found)
        raise ValueError(
            f"seqlen_truncate: the batch is packed (its {names} give the sequences' boundaries in a row of "
            f"{t} positions, {bounds.tolist()[:8]}), and only the first positions of a single row can be cut with "
            "them (a batch [1, T] with right padding, no keep_last_token): collate one packed row a batch, or "
            "return_flash_attn_kwargs=False (the boundaries are then read from position_ids)"
        )
    for path, v in found:
        if _name(path) in BOUNDARY_NAMES and isinstance(v, Tensor):
            kept = torch.unique_consecutive(v.clamp_max(length))
            values[path] = v
            out = _replace_leaf(out, path, kept)
    longest = int((kept[1:] - kept[:-1]).max())
    for path, v in found:
        if _name(path) in LONGEST_NAMES:
            values[path] = v
            new = torch.tensor(longest, dtype=v.dtype, device=v.device) if isinstance(v, Tensor) else type(v)(longest)
            out = _replace_leaf(out, path, new)
    return out


#: the sides ``seqlen_truncate`` cuts: ``"right"`` keeps each row's first positions, ``"left"`` its last
TRUNCATION_SIDES = ("right", "left")


def truncate(
    batch: Any,
    difficulty: int,
    keys: Sequence[str] | None = None,
    causal_label_shift: bool = False,
    keep_last_token: bool = False,
    batch_size: int | None = None,
    check_left_padding: bool = False,
    truncation_side: str = "right",
) -> Truncation:
    """``seqlen_truncate`` of a batch of any structure (Li et al. 2022, "DeepSpeed Data Efficiency", and the
    Megatron-DeepSpeed ``pretrain_{gpt,bert}.py`` post-process): cut every tensor of the batch's size ``B`` and
    sequence length ``T`` (:func:`sequence_reference`; with ``keys``, only tensors of those names) to ``L`` positions
    on its sequence axes (:func:`cut_axes`: axis 1 of ``[B, T, ...]``, both axes of a pairwise ``[B, T, T, ...]``,
    the last axis (two for ``[.., T, T]``) of a mask ``[B, 1, 1, T]`` / ``[B, 1, T, T]``), ``L = d + 1`` with
    ``causal_label_shift`` (Megatron GPT: a sample holds ``seq_length + 1`` tokens, the extra one being the shifted
    label) else ``L = d``. Nothing changes when ``L >= T``. The cut tensors are contiguous copies (a model's own
    ``labels.view(-1)`` works on them). A ``[B]`` tensor named as the rows' lengths (:func:`row_lengths`:
    ``feature_lengths``, ``seq_len``, an HF ``length`` column) is clamped to ``L``, what each cut row holds. Other
    tensors (labels ``[B]``, images) and leaves are kept as they are; integer targets of another length (a CTC
    transcript) beside cut float features are refused. Tensors must be batch-first (``[B, T]``): pass
    ``batch_size`` to have a sequence-first ``[T, B]`` batch refused (:func:`check_batch_first`).

    Which ``L`` columns (the *real* tokens are those of the batch's padding mask, :func:`padding_mask`: a tensor named
    ``attention_mask``, ``*padding_mask*`` (True = padding) or ``*mask*``, bool, 0/1 or additive float (0 = real,
    negative = masked), or an unnamed mask entry of a tuple batch; without one every position is real):

    - **right padding or none** (default): the first ``L`` columns.
    - **left padding**, detected from the mask: every row's real tokens end at the last column and some row starts
      with padding. The last ``L`` columns are kept: every row keeps its last ``min(n_b, L)`` real tokens, so no row
      loses all of them. Without a mask in the batch left padding cannot be seen.
    - ``keep_last_token=True`` (right padding; Composer's ``SeqLengthWarmup(preserve_end_of_sequence=True)``,
      ``composer/algorithms/seq_length_warmup``): a row whose last real token (its ``[SEP]`` / EOS, at column
      ``n_b - 1``) lies beyond the cut keeps its first ``L - 1`` columns followed by column ``n_b - 1``; shorter rows
      are cut as by default. So in every row the last real token of the cut row is the last real token of the
      original row, at column ``min(n_b, L) - 1``. Every cut tensor's columns move the same way. Left-padded
      batches keep it already.
    - ``truncation_side="left"`` (HF tokenizers' name): the last ``L`` columns of every row, the most recent steps
      of a look-back window (a forecaster's ``past [B, T, C]`` beside its ``future``: the first ``L`` steps would end
      ``T - L`` steps before the target). Refused for a right-padded batch, whose last columns are padding.

    Args:
        batch: the collated batch (any structure); not modified. difficulty: ``d`` in tokens (>= 1).
        keys: names of the tensors to cut (dict keys, dataclass fields); None: every tensor of the batch's sequence
            length. batch_size: the number of samples collated, when known (refuses a ``[T, B]`` layout).
        check_left_padding: refuse a batch without a padding mask whose rows look padded on the left (the
            curriculum checks its first cut).
        truncation_side: ``"right"`` (default: cut the end of each row, keep its first positions) or ``"left"``
            (cut the start, keep its last positions).

    Returns:
        a :class:`Truncation` (the batch, ``T``, the new length, the removed attention-mask values, the side, the
        tensors and axes cut).

    Raises:
        ValueError: ``difficulty < 1``; the cut would leave a row that has real tokens without any (a mask padded on
            both sides); a float mask neither additive nor 0/1; a sequence-first batch (with ``batch_size``);
            ``truncation_side`` not ``"right"`` / ``"left"``, or ``"left"`` with a right-padded batch.
    """
    if truncation_side not in TRUNCATION_SIDES:
        raise ValueError(f"seqlen_truncate: truncation_side must be one of {TRUNCATION_SIDES}, got {truncation_side!r}")
    try:
        difficulty = operator.index(difficulty)
    except TypeError:
        raise ValueError(f"seqlen_truncate: difficulty must be an int >= 1 token, got {difficulty!r}") from None
    if isinstance(difficulty, bool) or difficulty < 1:
        raise ValueError(f"seqlen_truncate: difficulty must be an int >= 1 token, got {difficulty!r}")
    keys = None if keys is None else tuple(keys)
    found = _reference(batch, keys)
    if found is None:
        return Truncation(batch, None, None, None, False, ())
    if batch_size is not None:
        check_batch_first(batch, batch_size, keys, "seqlen_truncate")
    ref = found[1]
    b, t = _sizes(*found)
    if keys is not None:
        _refuse_named_of_another_length(batch, keys, found[0], b, t)
    length = difficulty + 1 if causal_label_shift else difficulty
    if length >= t:
        return Truncation(batch, t, t, None, False, ())
    pm = padding_mask(batch, keys)
    real = None if pm is None else pm[2]
    if check_left_padding and real is None and ref.ndim == 2 and _is_integer(ref):
        _refuse_unmarked_left_padding(ref, length)
    if real is not None and pm is not None:
        # the rows of every padding mask the cut takes: a preference pair's chosen_attention_mask beside its
        # rejected_attention_mask, each padded on its side (left-padded rejected rows were cut from the right to
        # nothing but padding when every chosen row was full, qa113-distill 02)
        others = [_real_named(p, v).to(real.device) for p, v in _other_padding_masks(batch, keys, pm[0], b, t)]
        real = torch.cat([real, *others])
    left = real is not None and bool(real[:, -1].all()) and not bool(real[:, 0].all())
    if truncation_side == "left":
        _refuse_right_padding_for_left_side(batch, real, left, b, t)
        left = True
    index: Tensor | None = None  # [B, L] columns kept per row; None: the slice `window`
    window = slice(t - length, t) if left else slice(0, length)
    if keep_last_token and not left:
        if real is None:
            last = torch.full((b,), t - 1, dtype=torch.long, device=ref.device)
        else:
            last = torch.where(real.any(1), t - 1 - real.flip(1).to(torch.int8).argmax(1), -1)
        column = last.clamp_min(length - 1)
        if column.shape[0] > b:  # several padding masks (a preference pair's): one column moved per row of the batch
            groups = column.view(-1, b)
            if bool((groups != groups[:1]).any()):
                masks = [p for p, _ in _other_padding_masks(batch, keys, pm[0], b, t)] if pm is not None else []
                named = ", ".join(repr(".".join(map(str, p))) for p in ([pm[0]] if pm is not None else []) + masks)
                raise ValueError(
                    f"seqlen_truncate: keep_last_token=True moves each row's last real token to the end of the cut, "
                    f"and the padding masks {named} put it at other columns of the same rows (the sequences of a "
                    "preference pair, each of its own length): every cut tensor moves the same columns, so one of "
                    "them would lose its last token. Concatenate the sequences along the batch axis ([2B, T], "
                    "TRL's concatenated layout), or use keep_last_token=False"
                )
            column = groups[0]
        if bool((column != length - 1).any()):
            index = torch.arange(length, device=ref.device).repeat(b, 1)
            index[:, -1] = column
    kept = torch.zeros(b, t, dtype=torch.bool, device=ref.device)
    if index is None:
        kept[:, window] = True
    else:
        kept.scatter_(1, index.to(ref.device), True)
    removed = (~kept).nonzero()[:, 1].view(b, t - length)  # each row's removed columns, in column order
    cut: dict[Path, tuple[int, ...]] = {}
    values: dict[Path, Any] = {}

    text = has_token_ids(batch, b, t)

    def cut_tensor(path: Path, v: Tensor) -> Tensor:
        axes = cut_axes(path, v, b, t, keys, text)
        if not axes:
            return v
        cut[path] = axes
        if v.ndim == 2 and axes == (1,):  # ids, token types, masks, labels: their removed values are kept
            values[path] = _take(v, 1, window, removed)
        for axis in axes:
            v = _take(v, axis, window, index)
        return v

    out = map_tensors(batch, cut_tensor)
    _refuse_forecast_cuts(batch, keys, cut, b, t)
    _refuse_channel_first(batch, cut)
    out = _cut_packed(batch, out, b, t, length, not left and index is None, values)
    if keys is None and _name(found[0]) not in ("attention_mask", "input_ids"):
        _refuse_another_sequence(batch, found[0], b, t, cut)
    if keys is None:
        _refuse_padded_to_another_length(batch, found[0], b, t, cut)
    # with truncate_keys, what is cut is the user's choice, warned (clip-level class indices beside frames)
    _refuse_whole_targets(batch, b, t, cut, warn=keys is not None)
    lengths = row_lengths(batch, b, t, cut)
    if lengths:
        # a [B] tensor of the rows' lengths says what the cut rows hold, min(n, L) in every mode (right and left
        # padding, keep_last_token); its original comes back in lengthen_batch (feature_lengths said 117 of 48 frames
        # kept, qa48-speech 01, 02; an HF `length` column, qa49-break 03)
        for path in lengths:
            values[path] = _leaf(batch, path)
        out = map_tensors(out, lambda path, v: clamp_lengths(v, t, length) if path in lengths else v)
    cut_mask, mask_path = None, None
    if real is not None and pm is not None:
        kept = kept.to(real.device)
        emptied = real.any(1) & ~(real & kept.repeat(real.shape[0] // b, 1)).any(1)
        if bool(emptied.any()):
            masks = [pm[0], *(p for p, _ in _other_padding_masks(batch, keys, pm[0], b, t))]
            which = (
                f"the mask {'.'.join(map(str, pm[0])) or 'batch'} is"
                if len(masks) == 1
                else f"the masks {', '.join(repr('.'.join(map(str, p))) for p in masks)} are, together,"
            )
            rows = sorted({int(i) % b for i in emptied.nonzero().flatten().tolist()})
            raise ValueError(
                f"seqlen_truncate: cutting the batch from {t} to {length} tokens would leave rows {rows} without a "
                f"real token: {which} padded on both sides (left padding is recognised when every row's real tokens "
                "end at the last column); pad every row on the same side"
            )
        path, mask = pm[0], pm[1]
        if len(cut.get(path, ())) == 1:
            cut_mask, mask_path = _take(mask, cut[path][0], window, removed.to(mask.device)), path
    return Truncation(out, t, length, cut_mask, left, tuple(cut), tuple(cut.values()), mask_path, values)


#: mel-filterbank sizes of speech features; parts of such a tensor's name
MEL_BINS = (40, 64, 80, 128)
SPECTRAL_NAMES = ("feature", "mel", "spectr", "fbank")


#: frames of Whisper's 30 s input features (100 a second), the length of its channel-first ``[B, n_mels, 3000]``
WHISPER_FRAMES = 3000


def _padded_to_fewer_frames(longest: float, n: int, frames: int, value: Tensor, lengths: Tensor) -> bool:
    """Whether a ``[B, n, frames]`` tensor ``value`` whose own ``lengths``' longest is ``longest`` is a channel-first
    batch padded to its longest clip, of fewer frames than mel bins (qa57-break 04): ``longest == frames < n`` and
    ``n`` a mel-bin count, whatever ``frames`` (64 is a bin count too: cut on its bins, qa59-break 01), unless its
    padding says it is batch first (:func:`_padding_layout`: ``[B, 128, 80]`` padded to 128 frames, a batch whose
    longest clip is 80, was refused mid-run, qa60-break 04; by repeating the last frame too, qa61-break 04); not a
    batch-first tensor padded to a fixed length of no bin count whose longest clip is as long as its bins
    (qa58-break 06)."""
    return longest == frames < n and n in MEL_BINS and _padding_layout(value, lengths) != 1


def _padding_layout(value: Tensor, lengths: Tensor) -> int | None:
    """Which axis of the ``[B, n, S]`` tensor ``value`` its padding lies on, by the rows' ``lengths``: 1 when every
    clip's steps beyond its length on axis 1, ``value[i, L:, :]``, are one step repeated (zeros, a log floor, the last
    frame: ``F.pad``'s constant and replicate modes) and axis 2 shows no such padding; 2 the other way round; None
    when neither or both do (noise padding; a channel-first clip whose upper bins sit at a floor shows padding on axis
    2 beyond its shorter clips' lengths, not on axis 1, qa61-break 02)."""
    on: dict[int, bool] = {}
    for i, length in enumerate(lengths.tolist()):
        if length != int(length) or length < 1:
            return None
        for axis in (1, 2):
            if int(length) < int(value.shape[axis]):
                beyond = value[i, int(length) :, :] if axis == 1 else value[i, :, int(length) :].transpose(0, 1)
                on[axis] = on.get(axis, True) and bool((beyond == beyond[:1]).all())
    first, second = on.get(1, False), on.get(2, False)
    return 1 if first and not second else 2 if second and not first else None


def _frames_axis(batch: Any, path: Path, value: Tensor) -> int | None:
    """Which axis of the ``[b, n, frames]`` tensor at ``path`` the batch says holds the frames: 2 for Whisper's
    3,000 frames, a mask ``[b, frames]`` beside it, or a ``[b]`` tensor of its lengths (a name with a length word,
    :func:`~lightning_effi.core.measure.length_stem`, whose stem is empty or in the tensor's name: ``lengths``,
    ``mel_lens``; not a transcript's ``text_lengths``; integer or float) with a value above ``n`` and none above
    ``frames``, or whose longest is ``frames`` (below ``n``, a mel-bin count); 1 for a mask ``[b, n]`` or
    lengths whose longest is ``n``; None when the batch does not say (no lengths, or relative ones)."""
    b, n, frames = (int(d) for d in value.shape)
    if frames == WHISPER_FRAMES:
        return 2
    others = [
        (str(leaf_name(batch, other) or "").lower(), v)
        for other, v in tensor_leaves(batch)
        if other != path and v.ndim > 0 and int(v.shape[0]) == b and not (v.dtype == torch.bool and v.ndim == 1)
    ]
    for other_name, v in others:  # a mask first, wherever it lies in the batch (qa61-break 04: after the lengths)
        if v.ndim == 2 and "mask" in other_name and int(v.shape[1]) in (n, frames) and n != frames:
            return 2 if int(v.shape[1]) == frames else 1
    for other_name, v in others:
        stem = length_stem(other_name) if other_name else None
        own = stem is not None and (not stem or stem in str(leaf_name(batch, path) or "").lower())
        if v.ndim == 1 and own and v.numel() and not _relative(v):
            longest = float(v.max())
            if n < longest <= frames:
                return 2
            if longest == n:
                return 1
            if _padded_to_fewer_frames(longest, n, frames, value, v):
                return 2
    return None


#: parts of a tensor's name that say it holds a spectrogram (not generic features of a frame)
SPECTROGRAM_NAMES = ("mel", "spectr", "fbank")


def _own_lengths_beyond(batch: Any, path: Path, name: str, value: Tensor) -> bool:
    """Whether a ``[b]`` tensor of lengths of the tensor at ``path`` (a length word, its stem empty or in ``name``:
    ``lengths``, ``spec_lens``; integer or float, not relative) has a value above ``n`` and none above ``frames``
    (a batch-first tensor's lengths never exceed its axis 1), or a longest of exactly ``frames`` below ``n``, ``n`` a
    mel-bin count (a batch padded to its longest clip, of fewer frames than mel bins: ``[B, 128, 100]`` with lengths
    up to 100, qa57-break 04, or ``[B, 80, 64]``, qa59-break 01; a batch-first ``[B, 200, 80]`` padded to 200 frames
    whose longest clip has 80 is none, qa58-break 06)."""
    b, n, frames = (int(d) for d in value.shape)
    for other, v in tensor_leaves(batch):
        other_name = str(leaf_name(batch, other) or "").lower()
        if other == path or v.ndim != 1 or int(v.shape[0]) != b or not other_name or not v.numel():
            continue
        stem = length_stem(other_name)
        if stem is None or (stem and stem not in name) or v.dtype == torch.bool or _relative(v):
            continue
        longest = float(v.max())
        if n < longest <= frames or _padded_to_fewer_frames(longest, n, frames, value, v):
            return True
    return False


def _channel_first(batch: Any, path: Path, name: str, v: Tensor) -> bool:
    """Whether the spectral ``[B, n, S]`` tensor ``v`` at ``path`` is channel first: as the batch says
    (:func:`_frames_axis`), else when its name says it is a spectrogram (:data:`SPECTROGRAM_NAMES`, torchaudio's
    ``MelSpectrogram`` gives ``[..., n_mels, frames]``) and ``S`` is no mel-bin count itself (a ``[B, 40, 128]`` mel of
    40 frames is batch first); generic features (``features [B, 64, 2048]``) only on the batch's word."""
    b, n, frames = (int(d) for d in v.shape)
    axis = _frames_axis(batch, path, v)
    if axis is not None:
        return axis == 2
    return any(part in name for part in SPECTROGRAM_NAMES) and frames not in MEL_BINS


def _refuse_channel_first(batch: Any, cut: Mapping[Path, tuple[int, ...]]) -> None:
    """Refuse a cut of spectral features laid out channel first, ``[B, n_mels, T]`` (Whisper's ``input_features``
    ``[B, 80, 3000]``, torchaudio's ``MelSpectrogram``): axis 1 is their mel bins, not their frames, and the cut
    kept the first bins of every frame (qa53-asr 04). Told by a name of :data:`SPECTRAL_NAMES`, a float ``[B, n, S]``
    tensor cut on axis 1 only, ``n`` in :data:`MEL_BINS`, ``S`` more than twice ``n``, and :func:`_channel_first`.
    The shape alone cannot tell them from batch-first features of ``n`` frames (64 frames of 2,048-dimensional video
    features, 128 of HuBERT's 768), which were refused when a padded batch happened to be that long (qa54-break 01);
    the lengths beside them tell, and a spectrogram's name without them (qa55-break 03). Lengths of the tensor above
    its axis 1 tell for any name and bins; a spectral tensor left whole beside a cut mask of its axis 2 is refused
    too."""
    cut_length = next((int(_leaf(batch, p).shape[a]) for p, axes in cut.items() for a in axes[:1]), None)
    for path, v in tensor_leaves(batch):
        name = str(_name(path) or "").lower()
        spectral = any(part in name for part in SPECTRAL_NAMES)
        if v.ndim != 3 or not v.is_floating_point():
            continue
        # left whole beside a cut mask of its axis 2 (Whisper's features with their frames' attention_mask: only the
        # mask was cut, in silence, qa56-break 06)
        whole = path not in cut and spectral and cut_length is not None and int(v.shape[2]) == cut_length
        if cut.get(path) == (1,):
            _, n, frames = (int(d) for d in v.shape)
            named = spectral and n in MEL_BINS and frames > 2 * n and _channel_first(batch, path, name, v)
            # lengths of this tensor beyond its axis 1: its frames are on axis 2, whatever its name or bins
            # (n_mels=96, a tensor named `x`, qa56-break 07)
            # (not a tensor whose frames' mask [B, n] says they are on axis 1, qa61-break 04)
            told = _own_lengths_beyond(batch, path, name, v) and _frames_axis(batch, path, v) != 1
            if not (named or told):
                continue
        elif not whole:
            continue
        raise ValueError(
            f"seqlen_truncate: {name!r} {list(v.shape)} looks channel first, [B, n_mels, frames] (Whisper's "
            f"input_features): its axis 1 holds {v.shape[1]} mel bins, and a cut "
            + (
                "there keeps the first bins of every frame, not the first frames"
                if not whole
                else "of its frames' mask alone leaves the features whole beside it"
            )  # fmt: skip
            + ". seqlen_truncate cuts axis 1: give the features as [B, frames, n_mels] in your collate (and transpose "
            "back in the model), or order the samples by a difficulty metric of their duration instead of cutting "
            "them (Whisper pads every clip to 30 s)"
        )


def _refuse_named_of_another_length(batch: Any, keys: Sequence[str], reference: Path, b: int, t: int) -> None:
    """Refuse a tensor named in ``keys`` (``[B, ...]``, two dimensions or more) that would be left whole while the
    others are cut: one with no axis of the batch's sequence length ``T`` (read from the first key found: a
    preference pair's ``rejected_*`` padded to its own length, 4 of 8 steps trained a cut chosen against a whole
    rejected, qa46-user 02), or with ``T`` on an axis the cut does not take (``[B, D, T]`` features). A tensor whose
    name is also that of a tensor cut (the image's ``input_ids`` beside the text's in a nested batch) is another
    sequence under one name and is left whole, as keys cannot tell the two apart (qa47-break 04)."""
    named = [(path, v) for path, v in tensor_leaves(batch) if v.ndim >= 2 and v.shape[0] == b and _name(path) in keys]
    cut_names = {_name(path) for path, v in named if cut_axes(path, v, b, t, keys)}
    other = [(path, v) for path, v in named if not cut_axes(path, v, b, t, keys) and _name(path) not in cut_names]
    if not other:
        return
    where = ".".join(map(str, reference)) or "batch"
    shown = ", ".join(f"{'.'.join(map(str, p))!r} {list(v.shape)}" for p, v in other)
    if all(t not in tuple(v.shape[1:]) for _, v in other):
        raise ValueError(
            f"seqlen_truncate: truncate_keys {list(keys)} names {shown}, with no axis of the batch's sequence length "
            f"{t} (read from {where!r}): left whole while the others are cut to the scheduled length. seqlen_truncate "
            "cuts one length per batch: pad the sequences to one length in the collate (a preference pair's "
            "chosen_* and rejected_* to the longer of the two), or concatenate them along the batch axis ([2B, T], "
            "TRL's concatenated layout)"
        )
    raise ValueError(
        f"seqlen_truncate: truncate_keys {list(keys)} names {shown}, whose axis of the batch's sequence length {t} "
        f"(read from {where!r}) is not one seqlen_truncate cuts: axis 1 ([B, T, ...]), or the last axes of a tensor "
        "named like a mask ([B, 1, 1, T], [B, H, T, T]); it would be left whole while the others are cut. Put the "
        "sequence on axis 1 (a [B, D, T] feature as [B, T, D]), name a mask or bias so that it holds 'mask', or "
        "leave it out of truncate_keys"
    )


#: stems of a lengths tensor's name that name no tensor of its own (``token_lengths``, ``text_len``): of any sequence
ANY_SEQUENCE_STEMS = ("", "seq", "sequence", "token", "tokens", "text", "input", "inputs", "src", "source")


def _leaf(batch: Any, path: Path) -> Tensor:
    for p, v in tensor_leaves(batch):
        if p == path:
            return v
    raise KeyError(path)


def row_lengths(batch: Any, b: int, t: int, cut: Mapping[Path, Any]) -> list[Path]:
    """The ``[B]`` tensors of a batch cut from ``t`` positions that hold its rows' lengths, named so (a dict
    key, dataclass or NamedTuple field, :func:`~lightning_effi.core.measure.length_stem`): a name ending in a length
    word whose stem is in a cut tensor's name (``feature_lengths`` of ``input_features``), or is empty or one of
    :data:`ANY_SEQUENCE_STEMS` and in no tensor's name (``lengths``, ``seq_len``, ``token_lengths``; an HF ``length``
    column), every value in ``[0, t]``, integer or float (or relative lengths, :func:`clamp_lengths`).
    :func:`truncate` clamps them to the kept length. A plain tuple's entry is never read as lengths (class labels can
    look like them), nor the lengths of a tensor that is not cut (ESPnet's ``text_lengths`` of ``text``)."""
    if not cut:
        return []
    cut_names = [str(leaf_name(batch, path) or "").lower() for path in cut]
    names = [str(leaf_name(batch, path) or "").lower() for path, v in tensor_leaves(batch) if v.ndim >= 2]
    found = []
    for path, v in tensor_leaves(batch):
        name = leaf_name(batch, path)
        if name is None or v.ndim != 1 or v.shape[0] != b or path in cut or v.dtype == torch.bool or v.is_complex():
            continue
        stem = length_stem(name)
        if stem is None:
            continue
        if stem and not any(stem in n for n in cut_names):
            # the lengths of a tensor of its own that is not cut (ESPnet's text_lengths of its transcript `text`,
            # clamped with the speech, qa50-break 08), or of no tensor of the batch (seq_len, token_lengths)
            if any(stem in n for n in names) or stem not in ANY_SEQUENCE_STEMS:
                continue
        if v.numel() and (_relative(v) or (0 <= float(v.min()) and float(v.max()) <= t)):
            found.append(path)
    return found


def _relative(v: Tensor) -> bool:
    """Lengths relative to the padded length (SpeechBrain's ``wav_lens``: float, in ``[0, 1]``, the longest row 1,
    or less in a batch padded past its longest row, or 0.99999994 after rounding; qa54-break 06)."""
    return v.is_floating_point() and v.numel() > 0 and float(v.min()) >= 0 and 0 < float(v.max()) <= 1.0


def clamp_lengths(v: Tensor, t: int, length: int) -> Tensor:
    """A ``[B]`` tensor of the rows' lengths (:func:`row_lengths`) after a cut from ``t`` to ``length`` positions:
    ``min(n, length)`` (integer, or float lengths in positions, 16000.0); relative lengths (:func:`_relative`)
    ``min(r * t, length) / length`` (SpeechBrain's ``wav_lens`` of a clip cut to half: 1, 1, 1, 0.5 for 1, 0.75,
    0.5, 0.25, qa53-asr 01)."""
    if _relative(v):
        return (v * t).clamp_max(length) / length
    return v.clamp_max(length)


#: words of an integer tensor's name that say it holds a sample's targets (a CTC transcript); ``text`` as the whole
#: name or its last word (ESPnet's ``text`` beside ``speech``, qa50-break 08), not inside one (a CLAP's
#: ``text_input_ids``, the other tower's input)
TARGET_WORDS = ("label", "target", "transcript")


def _target_name(name: str | None) -> bool:
    """A name of targets: with a word of :data:`TARGET_WORDS`, ``text`` as the whole name or its last word, or
    ``tokens`` / ``token_ids`` as the whole name or its last word (NeMo's and SpeechBrain's ``tokens``, icefall's
    ``token_ids``, beside the audio they transcribe: read only where float features are cut and no integer tensor is,
    qa53-asr 03)."""
    lowered = str(name or "").lower()
    return (
        any(word in lowered for word in TARGET_WORDS)
        or lowered in ("text", "texts", "tokens", "token_ids")
        or lowered.endswith(("_text", "_tokens", "_token_ids"))
    )


def _refuse_whole_targets(batch: Any, b: int, t: int, cut: Mapping[Path, Any], warn: bool = False) -> None:
    """Refuse a cut of float features (audio frames, no integer ids among the tensors cut) beside an integer
    ``[B, U]`` tensor named like targets (:data:`TARGET_WORDS`), of another length, left whole: a CTC transcript of the
    whole sample beside a cut input is no longer its target (loss 0 with ``zero_infinity``, qa49-break 01); a name
    whose last word is ``text`` too (ESPnet's transcript). ``warn`` (the tensors to cut named in ``truncate_keys``):
    a warning instead, once for each set of names (clip-level class indices beside frames are valid, qa50-break 07).
    A list of ``B`` strings named so (lhotse's ``supervisions["text"]``) is such a transcript too."""
    cut_leaves = [(p, v) for p, v in tensor_leaves(batch) if p in cut]
    if not any(v.is_floating_point() and v.ndim >= 2 and not _is_mask_name(_name(p)) for p, v in cut_leaves):
        return
    if any(_is_integer(v) and not _is_mask_name(_name(p)) for p, v in cut_leaves):
        return  # token ids were cut: text, whose labels are its positions'
    whole = [
        (p, v)
        for p, v in tensor_leaves(batch)
        if p not in cut
        and v.ndim == 2
        and v.shape[0] == b
        and v.shape[1] not in (1, t)
        and _is_integer(v)
        and _target_name(_name(p))
        and bool((v > 1).any())  # token ids: multi-hot labels (audio tagging's 0 / 1 classes) are no transcript
    ]
    # transcripts as text: a list of B strings named like targets (lhotse's supervisions["text"], qa51-break 03)
    texts: dict[Path, int] = {}
    for p, v in leaves(batch):
        if isinstance(v, str) and len(p) >= 2 and isinstance(p[-1], int) and _target_name(_name(p[:-1])):
            texts[p[:-1]] = texts.get(p[:-1], 0) + 1
    whole_shown = [(p, list(v.shape)) for p, v in whole] + [(p, [n, "str"]) for p, n in texts.items() if n == b]
    if not whole_shown:
        return
    shown = ", ".join(f"{'.'.join(map(str, p))!r} {shape}" for p, shape in whole_shown)
    message = (
        f"seqlen_truncate: the cut takes float features (audio frames?) from {t} positions and leaves {shown}, "
        "targets of the whole sample, as they are: a transcript beside a cut input is no longer its target (CTC "
        "gives an infinite loss, or 0 with zero_infinity, and trains nothing). seqlen_truncate is for sequences "
        "whose targets are aligned with their positions; order such samples by a difficulty metric of their length "
        "(e.g. the number of frames) instead of cutting them"
    )
    if warn:  # the names only: Python shows a warning once for each text, and the shapes change from batch to batch
        names = ", ".join(repr(".".join(map(str, p))) for p, _ in whole_shown)
        warnings.warn(
            f"seqlen_truncate: the cut takes float features (audio frames?) and leaves {names}, targets of the whole "
            "sample, as they are: a transcript beside a cut input is no longer its target (CTC gives an infinite "
            "loss, or 0 with zero_infinity). (Warned, not refused: truncate_keys names the tensors to cut.)",
            stacklevel=3,
        )
        return
    raise ValueError(message)


#: words of a 2-D float tensor's name that say it holds raw audio ``[B, S]`` (HF wav2vec2's ``input_values``,
#: SpeechBrain's ``sig``), each a whole word of the name (split at ``_``)
AUDIO_WORDS = ("audio", "wav", "wavs", "waveform", "waveforms", "speech", "signal", "sig")
#: words of such a name that say it holds something else (a pooled embedding ``audio_emb [B, 512]``)
NOT_AUDIO_WORDS = ("emb", "embed", "embeds", "embedding", "embeddings", "feat", "feats", "features", "logits", "probs")


def _raw_audio(batch: Any, path: Path, v: Tensor, b: int, t: int) -> bool:
    """A float ``[B, S]`` tensor longer than ``t`` that holds raw audio: beside a ``[B]`` integer tensor whose largest
    value is ``S`` (its lengths, padded to the longest: NeMo's ``(audio, audio_len, transcript, transcript_len)``,
    ``{"x", "x_lens", "y"}``), or named so (``input_values``, or with a word of :data:`AUDIO_WORDS` and none of
    :data:`NOT_AUDIO_WORDS`); not a ``[B, D]`` embedding or soft labels (qa52-break 02, 03)."""
    if v.ndim != 2 or v.shape[0] != b or v.shape[1] <= t or not v.is_floating_point():
        return False
    if any(
        u.ndim == 1 and u.shape[0] == b and _is_integer(u) and u.numel() > 0 and int(u.max()) == v.shape[1]
        for _, u in tensor_leaves(batch)
    ):
        return True
    name = str(leaf_name(batch, path) or "").lower()
    words = set(name.split("_"))
    return name == "input_values" or (bool(words & set(AUDIO_WORDS)) and not words & set(NOT_AUDIO_WORDS))


def other_sequences(batch: Any, b: int, t: int) -> list[tuple[Path, Tensor]]:
    """The float sequences ``[B, S, ...]`` (3 dimensions or more, ``S != t``; not images, :func:`_looks_like_images`,
    nor masks; or raw audio ``[B, S]``, :func:`_raw_audio`) of a batch of size ``b`` whose integer ``[B, t]`` tensor
    was read as its tokens: audio or other features beside their CTC targets, whose length is not the features'
    (qa48-speech 03, 05; wav2vec2's ``input_values`` beside its ``labels``, qa51-break 01)."""
    return [
        (path, v)
        for path, v in tensor_leaves(batch)
        if (
            v.ndim >= 3
            and v.shape[0] == b
            and v.shape[1] != t
            and t not in tuple(v.shape[2:])  # an attention bias [B, H, T, T] (qa50-break 06)
            and v.is_floating_point()
            and not _is_mask_name(_name(path))
            and not _looks_like_images(path, v)
        )
        or _raw_audio(batch, path, v, b, t)
    ]


#: parts of a mask's name that say it is no padding mask of another text sequence cut alike: Longformer's
#: ``global_attention_mask`` (1 on the tokens with global attention), an image's or video's mask beside the text
#: (:data:`VISUAL_NAMES`), an encoder's or a cross-attention's mask (qa115-regress 01, 02)
OTHER_MASKS = ("global", "encoder", "cross", *("pixel", "image", "img", "video", "vision"))


def _sequence_mask_name(name: str | None) -> bool:
    """A name that says the tensor is a sequence's padding mask: ``attention_mask`` or ``*padding_mask*`` in it
    (``chosen_attention_mask``, ``src_key_padding_mask``); not a ``completion_mask`` / ``loss_mask``, whose zeros
    are no padding, nor one of :data:`OTHER_MASKS` (``global_attention_mask``, ``image_attention_mask``)."""
    low = str(name or "").lower()
    return ("attention_mask" in low or "padding_mask" in low) and not any(part in low for part in OTHER_MASKS)


def _other_padding_masks(
    batch: Any, keys: Sequence[str] | None, mask_path: Path, b: int, t: int
) -> list[tuple[Path, Tensor]]:
    """The ``[B, T]`` padding masks of the batch (:func:`_sequence_mask_name`; named in ``keys`` when given) other
    than the one :func:`padding_mask` read (``mask_path``): the masks of the other sequences the cut takes (a
    preference pair's ``rejected_attention_mask`` beside ``chosen_attention_mask``)."""
    return [
        (path, v)
        for path, v in tensor_leaves(batch)
        if path != mask_path
        and v.ndim == 2
        and tuple(v.shape) == (b, t)
        and _sequence_mask_name(_name(path))
        and (keys is None or _name(path) in keys)
    ]


def _refuse_padded_to_another_length(batch: Any, reference: Path, b: int, t: int, cut: Mapping[Path, Any]) -> None:
    """Without ``truncate_keys``, refuse a batch holding a padding mask ``[B, S]`` (:func:`_sequence_mask_name`) of
    another length than the ``T`` read from ``reference``: a second sequence padded to its own length, left whole
    in every batch while the others are cut (a preference pair's ``rejected_*`` padded to 20 beside ``chosen_*``
    padded to 16: the chosen answers were cut, the rejected ones not, in silence, qa113-distill 01)."""
    other = [
        (path, v)
        for path, v in tensor_leaves(batch)
        if v.ndim == 2 and v.shape[0] == b and v.shape[1] != t and path not in cut and _sequence_mask_name(_name(path))
    ]
    if not other:
        return
    where = ".".join(map(str, reference)) or "batch"
    shown = ", ".join(f"{'.'.join(map(str, p)) or 'batch'!r} {list(v.shape)}" for p, v in other)
    raise ValueError(
        f"seqlen_truncate: the batch's sequence length {t} was read from {where!r}, beside the padding mask {shown} "
        "of a sequence padded to its own length, which the cut would leave whole while the others are cut to the "
        "scheduled length. seqlen_truncate cuts one length per batch: pad the sequences to one length in the "
        "collate (a preference pair's chosen_* and rejected_* to the longer of the two), or concatenate them along "
        "the batch axis ([2B, T], TRL's concatenated layout); to cut one sequence only (the source of an "
        "encoder-decoder), name its tensors in truncate_keys"
    )


def _refuse_another_sequence(batch: Any, reference: Path, b: int, t: int, cut: Mapping[Path, Any]) -> None:
    """Without ``truncate_keys``, refuse a batch whose length was read from its first integer ``[B, T]`` tensor
    beside a float sequence ``[B, S, ...]`` of another length that the cut leaves whole: a speech batch's CTC
    targets were cut and its audio features not (qa48-speech 03)."""
    other = [(path, v) for path, v in other_sequences(batch, b, t) if path not in cut]
    if other and _name(reference) is None:
        # a tuple's entries cannot be named in truncate_keys: image or other features beside token ids may be right
        # (a refusal had no remedy, qa49-break 09)
        where = ".".join(map(str, reference)) or "batch"
        shown = ", ".join(repr(".".join(map(str, p)) or "batch") for p, _ in other)  # no shapes: warned once
        warnings.warn(
            f"seqlen_truncate: the batch's sequence length was read from its entry {where!r}, its first integer "
            f"[B, T] tensor (token ids), beside entry {shown}, a sequence of another length the cut leaves whole; if "
            "that is the sequence to cut (audio features beside their targets), return a dict batch and name it in "
            "truncate_keys",
            stacklevel=2,
        )
        return
    if not other:
        return
    where = ".".join(map(str, reference)) or "batch"
    shown = ", ".join(f"{'.'.join(map(str, p)) or 'batch'!r} {list(v.shape)}" for p, v in other)
    raise ValueError(
        f"seqlen_truncate: the batch's sequence length {t} was read from {where!r}, its first integer [B, T] tensor "
        f"(token ids, when truncate_keys is not given), beside {shown}, a sequence of another length that the cut "
        "would leave whole (audio or other features beside their CTC targets). Name the tensors to cut in "
        "truncate_keys (a dict or dataclass batch), e.g. truncate_keys=[the features' name]"
    )


def _unmarked_padding(ids: Tensor) -> tuple[list[int], list[int]] | None:
    """The rows of ``ids`` that open with a run of one id, two positions or more, that never comes back after the
    row's other ids but as its last token, the same id in all of them, when they are a quarter of the rows or more
    (two at least): ``(rows, [the id])``; None otherwise (:func:`_refuse_unmarked_left_padding`; on ``ids.flip(1)``,
    rows padded on the right)."""
    same = ids == ids[:, :1]  # [B, T]: the row's first id
    other = ~same
    run = other.to(torch.int8).argmax(1)  # where the leading run of that id ends (0 when the row is one id)
    later = same & (torch.arange(ids.shape[1], device=ids.device) >= run[:, None])
    padded = other.any(1) & (run >= 2) & ~later[:, :-1].any(1)  # the last column: padding that is also the EOS
    pads = sorted({int(v) for v in ids[padded, 0].tolist()})
    # a few rows of text can open that way ("ll" of "I'll" in a window with no other "l": 2 rows of 64, qa44-break 02)
    if int(padded.sum()) < max(2, -(-ids.shape[0] // 4)) or len(pads) != 1:
        return None
    return padded.nonzero().flatten().tolist(), pads


def _refuse_unmarked_left_padding(ids: Tensor, length: int) -> None:
    """Refuse a batch without a padding mask whose rows look padded on the left: a quarter of its rows or more, two at
    least, open with a run of one id, two positions or more, that never comes back after the row's other ids but as
    its last token, the same id in all of them (SASRec's item histories, padded on the left with item 0, with no mask
    in the batch; GPT-2's, padded on the left with the end-of-text id that also ends each row). Without a mask every
    position is real and the first ``length`` columns are kept: the padding and the oldest items, the most recent
    ones cut away (4 of 8 rows all padding in qa43-user 01). Text that opens with a repeated token (indentation, a
    poly-A stretch) has it again inside the row."""
    found = _unmarked_padding(ids)
    if found is None:
        return
    rows, pads = found
    raise ValueError(
        f"seqlen_truncate: the batch has no padding mask, and rows {rows[:8]}{' ...' if len(rows) > 8 else ''} open "
        f"with a run of id {pads[0]} that never comes back after their other ids (but as their last token): they "
        "look padded on the left. "
        f"Without a mask the cut keeps the first {length} columns: the padding and the oldest tokens, and the last "
        "ones (the most recent) are cut away. Put the padding mask in the batch (a tensor named attention_mask, 1 = "
        "real, or key_padding_mask, True = padding; a tuple's bool [B, T] entry): the cut then keeps each row's last "
        "real tokens. For rows that are not padded, a mask of ones keeps the first columns"
    )


#: words of a tensor's name that say it holds a forecast's target steps, never cut with the look-back window
FORECAST_WORDS = ("future", "horizon")
#: the prefix of a look-back window's tensors (Hugging Face's and GluonTS's ``past_values``, ``past_time_features``,
#: ``past_observed_mask``, ``past_target``): cut together
LOOK_BACK_PREFIXES = ("past_",)


def _refuse_forecast_cuts(
    batch: Any, keys: Sequence[str] | None, cut: Mapping[Path, tuple[int, ...]], b: int, t: int
) -> None:
    """Refuse a cut of a forecast's target (a name with a word of :data:`FORECAST_WORDS`: ``future [B, H, C]``
    whose horizon equals the look-back's ``T``, cut to its last or first steps in silence, qa56-ts 02), and, with
    ``keys``, a mask of a named tensor left whole (``past_mask [B, T]`` beside ``past`` cut: qa56-ts 04), or a tensor
    of the look-back's ``T`` steps beside a named one (:data:`LOOK_BACK_PREFIXES`: ``past_observed_mask``,
    ``past_time_features`` beside ``past_values``, Hugging Face's time-series batch)."""
    for path in cut:
        name = str(_name(path) or "").lower()
        if keys is None and any(word in name for word in FORECAST_WORDS):
            raise ValueError(
                f"seqlen_truncate: {name!r} holds a forecast's target steps and has the batch's sequence length {t}, "
                "so it would be cut with the look-back window; name the window's tensors in truncate_keys "
                "(truncate_keys=['past', ...])"
            )
    if keys is None:
        return
    for path, v in tensor_leaves(batch):
        name = str(_name(path) or "")
        if path in cut or v.ndim < 2 or int(v.shape[0]) != b:
            continue
        mask, lowered = _is_mask_name(name), name.lower()
        owner = None
        if mask and t in tuple(v.shape[1:]):
            owner = next((k for k in keys if lowered.startswith(f"{k.lower()}_")), None)
        if owner is None and int(v.shape[1]) == t and lowered.startswith(LOOK_BACK_PREFIXES):
            # a tensor of the look-back window's steps beside the named one: Hugging Face's time-series batch
            # past_values, past_observed_mask, past_time_features (qa57-break); only the look-back's own prefix (a
            # first word such as x_ also begins an Informer's decoder input x_dec, another range, qa58-break 02)
            owner = next((k for k in keys if k.lower().startswith(LOOK_BACK_PREFIXES)), None)
        if owner is not None:
            what = f"its mask {name!r}" if mask and lowered.startswith(f"{owner.lower()}_") else repr(name)
            raise ValueError(
                f"seqlen_truncate: truncate_keys {list(keys)} names {owner!r} but not {what} {list(v.shape)}, of its "
                f"{t} steps, which would be left whole beside it; add {name!r} to truncate_keys"
            )


def _refuse_right_padding_for_left_side(batch: Any, real: Tensor | None, left: bool, b: int, t: int) -> None:
    """Refuse ``truncation_side="left"`` for a batch padded on the right: its mask's rows are real from column 0 to
    their end, then padding, some row padded (a gap of missing values inside a row is none, qa56-ts 01); or, without
    a mask, a ``[B]`` tensor of the rows' lengths (:func:`row_lengths`) says a row is shorter than ``t`` (the cut
    kept padding only, in silence, qa56-break 03). Its last columns are padding, and the rows would lose their
    tokens. A packed row's position ids (restarting inside a row) are refused too: its first kept sequence would
    start inside a document (qa56-break 05)."""
    why = None
    if real is not None and not left:
        prefix = bool((real[:, 1:] <= real[:, :-1]).all()) and bool(real[:, 0].all())
        if prefix and not bool(real.all()):
            why = "its mask ends rows with padding"
    ref = sequence_reference(batch)
    if why is None and real is None and ref is not None and ref.ndim == 2 and _is_integer(ref):
        unmarked = _unmarked_padding(ref.flip(1))
        if unmarked is not None:
            why = f"no mask, and rows {unmarked[0][:8]} end with a run of id {unmarked[1][0]}, padding"
    if why is None and real is None:
        for path in row_lengths(batch, b, t, {p: (1,) for p, v in tensor_leaves(batch) if v.ndim >= 2}):
            lengths = _leaf(batch, path)
            if not _relative(lengths) and float(lengths.min()) < t:
                why = f"its {'.'.join(map(str, path))!r} says rows are shorter than the {t} columns"
                break
            if _relative(lengths) and float(lengths.min()) < 1:
                why = f"its relative lengths {'.'.join(map(str, path))!r} say rows are shorter than the {t} columns"
                break
    if why is not None:
        raise ValueError(
            f"seqlen_truncate: truncation_side='left' keeps each row's last positions, and this batch is padded on "
            f"the right ({why}): its rows would keep padding and lose their tokens. Pad on the left, or use "
            "truncation_side='right'"
        )
    for path, v in tensor_leaves(batch):
        name = str(_name(path) or "").lower()
        # a token position's names (pos_ids and positions were left whole, qa61-ideas 03); not time ids, which may wrap
        token_positions = name.endswith("position_ids") or name in PACKED_POSITION_NAMES
        documents = name in PACKED_DOCUMENT_NAMES  # a row's document index: packed where it changes
        if (token_positions or documents) and v.ndim == 2 and int(v.shape[-1]) == t and not v.is_floating_point():
            # a restart between two real positions: not after a one-token document either ([0, 0, 1, ...]), and not
            # a left-padded row's pad positions (Hugging Face fills them with 1: [1, 1, 0, 1, ...], qa57-break)
            restarts = (v[:, 1:] != v[:, :-1]) if documents else (v[:, 1:] <= v[:, :-1])
            if documents:  # a pad row's document id of -1 is no document (qa65-break 06)
                restarts &= (v[:, 1:] >= 0) & (v[:, :-1] >= 0)
            if real is not None and tuple(real.shape) == tuple(v.shape):
                restarts &= real[:, 1:].bool() & real[:, :-1].bool()
            if bool(restarts.any()) and (documents or _counts_positions(v, real)):
                raise ValueError(
                    f"seqlen_truncate: truncation_side='left' on packed rows ({name!r} "
                    f"{'change' if documents else 'restart'} inside a row): the "
                    "first sequence kept would start inside a document, its position ids not at 0. Use "
                    "truncation_side='right' for packed batches"
                )


def _counts_positions(v: Tensor, real: Tensor | None) -> bool:
    """Whether the ``[B, T]`` integers ``v`` read as positions in each row: over its real entries (``real``'s, else all)
    each steps up by one or restarts at the row's first value (0, 1 or RoBERTa's 2; after pads of -1, at the
    smallest value of 0 or more: qa65-break 05). Part-of-speech
    tags named ``pos`` or ``pos_id`` do not (they were refused as packed rows, qa63-break 03)."""
    for i, row in enumerate(v.tolist()):
        if real is not None and tuple(real.shape) == tuple(v.shape):
            row = [x for x, keep in zip(row, real[i].tolist()) if keep]
        # a restart goes back to the row's first position, or to the smallest of 0 or more after pads of -1
        starts = {row[0], min((x for x in row if x >= 0), default=row[0])} if row else set()
        if any(b != a + 1 and b not in starts for a, b in zip(row, row[1:])):
            return False
    return True


def truncate_batch(
    batch: Any,
    difficulty: int,
    keys: Sequence[str] | None = None,
    causal_label_shift: bool = False,
    keep_last_token: bool = False,
    truncation_side: str = "right",
) -> Any:
    """The truncated batch of :func:`truncate` (same arguments; any structure, same types back).

    Raises:
        ValueError: as :func:`truncate`.
    """
    return truncate(batch, difficulty, keys, causal_label_shift, keep_last_token, truncation_side=truncation_side).batch


def _real_fill(v: Tensor) -> float:
    """The value of a real token in an attention mask: 0 in an additive float mask, else 1."""
    additive = v.is_floating_point() and (bool((v < 0).any()) or not bool((v != 0).any()))
    return 0.0 if additive else 1.0


def _widen(v: Tensor, axes: Sequence[int], length: int, left: bool, fill: float | None) -> Tensor:
    shape = list(v.shape)
    for a in axes:
        shape[a] = length
    if fill is None:  # shapes only: a broadcast view
        return v.new_zeros(()).expand(shape)
    out = v.new_full(shape, fill)
    block = tuple(
        (slice(length - v.shape[a], length) if left else slice(0, v.shape[a])) if a in axes else slice(None)
        for a in range(v.ndim)
    )
    out[block] = v
    return out


def lengthen_batch(
    batch: Any,
    keys: Sequence[str] | None,
    length: int,
    mask: Tensor | None = None,
    left: bool = False,
    axes: Mapping[Path, Sequence[int]] | None = None,
    mask_path: Path | None = None,
    values: Mapping[Path, Any] | None = None,
) -> Any:
    """The inverse, for counting, of :func:`truncate`: every tensor :func:`truncate` cut widened to ``length`` on the
    axes it cut (``axes``: path -> axes, :attr:`Truncation.cut` / :attr:`Truncation.axes`; without it, the tensors
    and axes :func:`cut_axes` finds at the batch's sequence length ``S``, named in ``keys`` when given, which guesses
    wrong for a ``[B, S, D]`` tensor with ``D == S``); any batch structure, same types back, ``batch`` not modified.
    The padding mask at ``mask_path`` (:attr:`Truncation.mask_path`; without it, the tensor named
    ``attention_mask``) gets ``mask`` (the removed values, :attr:`Truncation.cut_mask`) appended after its kept
    positions on its cut axis (before them with ``left``: a left-padded cut); without ``mask``, a tensor named
    ``attention_mask`` gets real tokens (1; 0 in an additive float mask); the others zeros (broadcast views: only
    their shapes are meant to be read). Nothing changes when ``length <= S``.

    A tensor whose removed values are in ``values`` (:attr:`Truncation.cut_values`: the ``[B, T]`` ones) gets them
    back the same way, so the token ids, token types and 0/1 masks are the original ones exactly, and reading the
    padding from the lengthened batch gives the original's real tokens. With the ``cut_mask`` of a right-padded cut
    (``keep_last_token`` too) or a left-padded one, the mask is the original one exactly; the other tensors have its
    shapes.

    Raises:
        ValueError: ``mask`` does not fit the batch's mask (its shape with ``length - S`` on the cut axis).
    """
    keys = None if keys is None else tuple(keys)
    found = _reference(batch, keys)
    if found is None:
        return batch
    b, s = _sizes(*found)
    if length <= s:
        return batch
    done: list[Path] = []
    text = has_token_ids(batch, b, s)

    def grow(path: Path, v: Tensor) -> Tensor:
        original = values.get(path) if values else None
        if _name(path) in (*BOUNDARY_NAMES, *LONGEST_NAMES):
            return v  # given back whole below
        if isinstance(original, Tensor) and original.ndim == 1 and v.ndim == 1 and original.shape == v.shape:
            return original.to(device=v.device, dtype=v.dtype)  # the rows' lengths :func:`truncate` clamped
        where = cut_axes(path, v, b, s, keys, text) if axes is None else tuple(axes.get(path, ()))
        if not where:
            return v
        kept = values.get(path) if values else None
        if (
            kept is not None
            and len(where) == 1
            and list(kept.shape) == [*v.shape[: where[0]], length - s, *v.shape[where[0] + 1 :]]
        ):
            if path == mask_path or (mask_path is None and _name(path) == "attention_mask"):
                done.append(path)
            extra = kept.to(device=v.device, dtype=v.dtype)
            return torch.cat([extra, v] if left else [v, extra], dim=where[0])
        is_mask = path == mask_path if mask_path is not None else _name(path) == "attention_mask"
        if is_mask and not done:
            done.append(path)
            if mask is None or len(where) != 1:
                return _widen(v, where, length, left, _real_fill(v) if _name(path) == "attention_mask" else None)
            extra_shape = list(v.shape)
            extra_shape[where[0]] = length - s
            if list(mask.shape) != extra_shape:
                raise ValueError(
                    f"lengthen_batch: mask of shape {tuple(mask.shape)} cannot widen the mask of shape "
                    f"{tuple(v.shape)} to {length} positions (expected {tuple(extra_shape)})"
                )
            extra = mask.to(device=v.device, dtype=v.dtype)
            return torch.cat([extra, v] if left else [v, extra], dim=where[0])
        return _widen(v, where, length, left, None)

    out = map_tensors(batch, grow)
    for path, _ in _packed_leaves(batch):  # a packed batch's boundaries and longest length (_cut_packed)
        if values and path in values:
            out = _replace_leaf(out, path, values[path])
    return out


def reshape_batch(batch: Any, difficulty: int, key: str = "input_ids") -> Any:
    """``seqlen_reshape`` (GPT, Megatron-DeepSpeed ``pretrain_gpt.py``): re-chunk the token tensor ``[B, S]``
    (``batch[key]`` of a mapping batch, or the batch itself when it is a tensor) into rows of ``d + 1`` tokens instead
    of discarding: ``floor(S/(d+1))·(d+1)`` columns viewed as rows of ``d+1``, plus the last ``d+1`` tokens of each
    sample as an extra row; keep ``min(ceil(B·S/(d+1)), rows)`` rows, minus one if that is odd and > 1 (Megatron's
    rule). The micro-batch size changes. A tensor batch comes back as the rows. A mapping batch comes back as a dict
    with every ``[B, S]`` tensor re-chunked into the same rows (``labels``, ``attention_mask``, ``position_ids``
    follow the ids, token for token).

    Any ``d`` works: when ``d + 1`` does not divide ``S`` the tail columns come back through the extra rows.

    Raises:
        ValueError: ``difficulty`` not an int >= 1; the batch is neither a mapping with a 2-D tensor ``batch[key]``
            nor a 2-D tensor; a mapping entry that cannot follow the rows (anything but a ``[B, S]`` tensor: a
            per-sample label ``[B]``, text), named: it would be dropped or no longer match its row.
    """
    if not is_int(difficulty) or difficulty < 1:
        raise ValueError(f"seqlen_reshape: difficulty must be an int >= 1 token, got {difficulty!r}")
    difficulty = int(difficulty)
    x = batch if isinstance(batch, Tensor) else batch.get(key) if isinstance(batch, Mapping) else None
    if not isinstance(x, Tensor) or x.ndim != 2:
        raise ValueError(
            f"seqlen_reshape needs a 2-D tensor batch[{key!r}] ([B, S]) or a [B, S] tensor batch; got "
            f"{describe_batch(batch)}"
        )
    b, s = x.shape
    if isinstance(batch, Mapping):
        others = [k for k, v in batch.items() if not (isinstance(v, Tensor) and tuple(v.shape) == (b, s))]
        if others:
            kinds = {
                k: f"shape {list(v.shape)}" if isinstance(v, Tensor) else type(v).__name__
                for k, v in batch.items()
                if k in others
            }
            shapes = ", ".join(f"{k!r} ({kind})" for k, kind in kinds.items())
            raise ValueError(
                f"seqlen_reshape re-chunks the batch's [B, S] = {[b, s]} tensors into rows of difficulty + 1 tokens "
                f"that are no longer samples; {shapes} cannot follow the rows. Keep only [B, S] token fields in the "
                "batch (input_ids, labels, attention_mask), or use seqlen_truncate, which keeps the samples"
            )
    width = difficulty + 1

    def rechunk(t: Tensor) -> Tensor:
        if width >= s:
            return t
        cols = (s // width) * width
        rows = torch.cat([t[:, :cols].reshape(-1, width), t[:, -width:]], dim=0)
        num_row = min(-(-(b * s) // width), rows.shape[0])
        if num_row % 2 == 1 and num_row > 1:
            num_row -= 1
        return rows[:num_row].contiguous()

    if isinstance(batch, Tensor):
        return rechunk(batch)
    return {k: rechunk(v) for k, v in batch.items()}


def trim_padding(
    batch: Any,
    multiple: int = 8,
    mask_key: str = "attention_mask",
    keys: Sequence[str] | None = None,
    length: int | None = None,
) -> Any:
    """BERT "seqlen reorder" post-process (Megatron-DeepSpeed ``pretrain_bert.py``): cut every sequence field
    (:func:`truncate_batch`, any structure) to the longest non-padding length of the batch rounded **up** to a
    multiple of ``multiple`` (``length`` overrides, e.g. the MAX all-reduced over DP ranks).

    Raises:
        ValueError: no ``length`` and no tensor named ``mask_key``.
    """
    if length is None:
        mask = next((v for p, v in tensor_leaves(batch) if _name(p) == mask_key), None)
        if mask is None:
            raise ValueError(f"trim_padding needs batch[{mask_key!r}]")
        longest = int(mask.sum(dim=1).max().item()) if mask.numel() else 0
        length = max(multiple, -(-longest // multiple) * multiple)
    return truncate_batch(batch, length, keys)
