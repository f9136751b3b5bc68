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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from lightning_effi.core.measure import Path, tensor_leaves

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
            ``_percentile_merged`` index).
    """
    if difficulty_type == "value":
        if values is None or offsets is None:
            raise ValueError(
                "difficulty_type 'value' needs index_to_metric (per-row values); a _percentile_merged "
                "index is only valid for difficulty_type 'percentile'"
            )
        return int(offsets[int(np.searchsorted(values, difficulty, side="right"))])
    if difficulty_type != "percentile":
        raise ValueError(f"difficulty_type must be one of {DIFFICULTY_TYPES}, got {difficulty_type!r}")
    p = min(int(difficulty), int(max_difficulty))
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
    """
    size = len(ids)
    if size == 0:
        raise ValueError("draw_from_cluster: empty cluster")
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
    """
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
        values = [map_tensors(v, fn, (*path, i)) for i, v in enumerate(batch)]
        if all(a is b for a, b in zip(values, batch)):
            return batch
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
            return type(batch)(*values)
        return type(batch)(values)
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


def sequence_reference(batch: Any, keys: Sequence[str] | None = None) -> Tensor | None:
    """The tensor that gives the batch's size ``B`` and sequence length ``T`` (its dimensions 0 and 1), any batch
    structure:

    - ``keys`` given: the first tensor named ``keys[0]``, else ``keys[1]``, ... with at least 2 dimensions;
    - ``keys`` None (automatic): the first tensor named ``attention_mask``, else ``input_ids``, with at least 2
      dimensions, else the first integer (not bool) tensor of exactly 2 dimensions (token ids ``[B, T]``; in a tuple
      batch ``(ids, labels)``, ``ids``).

    None when there is none (images, float features only)."""
    found = [(p, v) for p, v in tensor_leaves(batch) if v.ndim >= 2]
    for name in keys if keys is not None else ("attention_mask", "input_ids"):
        for path, value in found:
            if _name(path) == name:
                return value
    if keys is None:
        for _, value in found:
            if value.ndim == 2 and _is_integer(value):
                return value
    return None


def sequence_length(batch: Any, keys: Sequence[str] | None = None) -> int | None:
    """The batch's sequence length ``T``: dimension 1 of :func:`sequence_reference`; None when it has none. The
    length :func:`truncate_batch` cuts."""
    ref = sequence_reference(batch, keys)
    return None if ref is None else int(ref.shape[1])


def _cuttable(path: Path, v: Tensor, b: int, t: int, keys: Sequence[str] | None) -> bool:
    """A ``[B, T, ...]`` tensor of the batch's size and sequence length, named in ``keys`` when ``keys`` is given."""
    if v.ndim < 2 or v.shape[0] != b or v.shape[1] != t:
        return False
    return keys is None or _name(path) in keys


def _attention_mask(batch: Any, b: int, t: int) -> Tensor | None:
    """The first tensor named ``attention_mask`` of shape ``[B, T]``, None without one."""
    for path, value in tensor_leaves(batch):
        if _name(path) == "attention_mask" and tuple(value.shape) == (b, t):
            return value
    return None


def describe_batch(batch: Any) -> str:
    """The tensors of a batch as ``path: dtype[shape]`` (for error messages)."""
    parts = [
        f"{'.'.join(map(str, p)) or 'batch'}: {str(v.dtype).replace('torch.', '')}{list(v.shape)}"
        for p, v in tensor_leaves(batch)
    ]
    return f"{type(batch).__name__} with " + (", ".join(parts) if parts else "no tensor")


class Truncation(NamedTuple):
    """What :func:`truncate` did to a batch.

    Attributes:
        batch: the truncated batch (same structure and types as the input).
        full_length: ``T``, the sequence length before (None: no sequence tensor was found, nothing was cut).
        length: the sequence length after (``min(L, T)``; None with ``full_length``).
        cut_mask: the values of the attention mask at the removed positions, ``[B, T - L]``, each row's in column
            order; None when nothing was removed or the attention mask was not cut (no tensor named
            ``attention_mask`` among the cut ones). :func:`lengthen_batch` puts them back.
        left: the batch was left-padded and its last ``L`` columns were kept.
        cut: the paths of the tensors cut (:func:`lightning_effi.core.measure.leaves` paths).
    """

    batch: Any
    full_length: int | None
    length: int | None
    cut_mask: Tensor | None
    left: bool
    cut: tuple[Path, ...]


def truncate(
    batch: Any,
    difficulty: int,
    keys: Sequence[str] | None = None,
    causal_label_shift: bool = False,
    keep_last_token: bool = False,
) -> Truncation:
    """``seqlen_truncate`` of a batch of any structure (Li et al. 2022, "DeepSpeed Data Efficiency", and the
    Megatron-DeepSpeed ``pretrain_{gpt,bert}.py`` post-process): cut every ``[B, T, ...]`` tensor of the batch's size
    ``B`` and sequence length ``T`` (:func:`sequence_reference`; with ``keys``, only tensors of those names) to ``L``
    columns, ``L = d + 1`` with ``causal_label_shift`` (Megatron GPT: a sample holds ``seq_length + 1`` tokens, the
    extra one being the shifted label) else ``L = d``. Nothing changes when ``L >= T``. Other tensors (labels
    ``[B]``, images) and leaves are kept as they are.

    Which ``L`` columns (the *real* tokens are the nonzero entries of the tensor named ``attention_mask`` of shape
    ``[B, T]``; without one every position is real):

    - **right padding or none** (default): the first ``L`` columns (views of the input).
    - **left padding**, detected from the mask: every row's real tokens end at the last column and some row starts
      with padding. The last ``L`` columns are kept: every row keeps its last ``min(n_b, L)`` real tokens, so no row
      loses all of them.
    - ``keep_last_token=True`` (right padding; Composer's ``SeqLengthWarmup(preserve_end_of_sequence=True)``,
      ``composer/algorithms/seq_length_warmup``): a row whose last real token (its ``[SEP]`` / EOS, at column
      ``n_b - 1``) lies beyond the cut keeps its first ``L - 1`` columns followed by column ``n_b - 1``; shorter rows
      are cut as by default. So in every row the last real token of the cut row is the last real token of the
      original row, at column ``min(n_b, L) - 1``. Every cut tensor's columns move the same way (copies, not views).
      Left-padded batches keep it already.

    Args:
        batch: the collated batch (any structure); not modified. difficulty: ``d`` in tokens (>= 1).
        keys: names of the tensors to cut (dict keys, dataclass fields); None: every ``[B, T, ...]`` tensor.

    Returns:
        a :class:`Truncation` (the batch, ``T``, the new length, the removed attention-mask values, the side).

    Raises:
        ValueError: ``difficulty < 1``; the cut would leave a row that has real tokens without any (an attention mask
            padded on both sides).
    """
    try:
        difficulty = operator.index(difficulty)
    except TypeError:
        raise ValueError(f"seqlen_truncate: difficulty must be an int >= 1 token, got {difficulty!r}") from None
    if isinstance(difficulty, bool) or difficulty < 1:
        raise ValueError(f"seqlen_truncate: difficulty must be an int >= 1 token, got {difficulty!r}")
    keys = None if keys is None else tuple(keys)
    ref = sequence_reference(batch, keys)
    if ref is None:
        return Truncation(batch, None, None, None, False, ())
    b, t = int(ref.shape[0]), int(ref.shape[1])
    length = difficulty + 1 if causal_label_shift else difficulty
    if length >= t:
        return Truncation(batch, t, t, None, False, ())
    mask = _attention_mask(batch, b, t)
    real = None if mask is None else mask != 0
    left = real is not None and bool(real[:, -1].all()) and not bool(real[:, 0].all())
    index: Tensor | None = None  # [B, L] columns kept per row; None: the slice `window`
    window = slice(t - length, t) if left else slice(0, length)
    if keep_last_token and not left:
        if real is None:
            last = torch.full((b,), t - 1, dtype=torch.long, device=ref.device)
        else:
            last = torch.where(real.any(1), t - 1 - real.flip(1).to(torch.int8).argmax(1), -1)
        column = last.clamp_min(length - 1)
        if bool((column != length - 1).any()):
            index = torch.arange(length, device=ref.device).repeat(b, 1)
            index[:, -1] = column
    rows = torch.arange(b, device=ref.device)[:, None]
    cut: list[Path] = []

    def cut_tensor(path: Path, v: Tensor) -> Tensor:
        if not _cuttable(path, v, b, t, keys):
            return v
        cut.append(path)
        return v[:, window] if index is None else v[rows, index.to(v.device)]

    out = map_tensors(batch, cut_tensor)
    cut_mask = None
    if real is not None and mask is not None:
        kept = torch.zeros(b, t, dtype=torch.bool, device=mask.device)
        if index is None:
            kept[:, window] = True
        else:
            kept.scatter_(1, index.to(mask.device), True)
        emptied = real.any(1) & ~(real & kept).any(1)
        if bool(emptied.any()):
            raise ValueError(
                f"seqlen_truncate: cutting the batch from {t} to {length} tokens would leave rows "
                f"{emptied.nonzero().flatten().tolist()} without a real token: the attention mask is padded on both "
                "sides (left padding is recognised when every row's real tokens end at the last column); pad every "
                "row on the same side"
            )
        if any(_name(p) == "attention_mask" for p in cut):
            if left:
                cut_mask = mask[:, : t - length]
            elif index is None:
                cut_mask = mask[:, length:]
            else:  # each row's removed columns, in column order
                cut_mask = mask[~kept].view(b, t - length)
    return Truncation(out, t, length, cut_mask, left, tuple(cut))


def truncate_batch(
    batch: Any,
    difficulty: int,
    keys: Sequence[str] | None = None,
    causal_label_shift: bool = False,
    keep_last_token: bool = False,
) -> Any:
    """The truncated batch of :func:`truncate` (same arguments; any structure, same types back).

    Raises:
        ValueError: as :func:`truncate`.
    """
    return truncate(batch, difficulty, keys, causal_label_shift, keep_last_token).batch


def lengthen_batch(
    batch: Any, keys: Sequence[str] | None, length: int, mask: Tensor | None = None, left: bool = False
) -> Any:
    """The inverse, for counting, of :func:`truncate`: every tensor :func:`truncate` would cut (``[B, S, ...]`` of
    the batch's size and sequence length ``S``, named in ``keys`` when given) widened to ``length`` columns; any batch
    structure, same types back, ``batch`` not modified. The tensor named ``attention_mask`` gets ``mask`` (the removed
    values, :attr:`Truncation.cut_mask`) appended after its columns (before them with ``left``: a left-padded cut),
    else ones (real tokens); the others zeros (broadcast views: only their shapes are meant to be read). Nothing
    changes when ``length <= S``.

    With the ``cut_mask`` of a right-padded cut (``keep_last_token`` too) or a left-padded one, the mask is the
    original one exactly; the other tensors have its shapes.

    Raises:
        ValueError: ``mask`` is not ``[B, length - S, ...]`` like the batch's ``attention_mask``.
    """
    keys = None if keys is None else tuple(keys)
    ref = sequence_reference(batch, keys)
    if ref is None or length <= ref.shape[1]:
        return batch
    b, s = int(ref.shape[0]), int(ref.shape[1])
    done: list[Path] = []

    def grow(path: Path, v: Tensor) -> Tensor:
        if not _cuttable(path, v, b, s, keys):
            return v
        if _name(path) == "attention_mask" and not done:
            done.append(path)
            extra_shape = (b, length - s, *v.shape[2:])
            if mask is None:
                extra = v.new_ones(extra_shape)
            elif tuple(mask.shape) == extra_shape:
                extra = mask.to(device=v.device, dtype=v.dtype)
            else:
                raise ValueError(
                    f"lengthen_batch: mask of shape {tuple(mask.shape)} cannot widen an attention_mask of shape "
                    f"{tuple(v.shape)} to {length} columns (expected {extra_shape})"
                )
            return torch.cat([extra, v] if left else [v, extra], dim=1)
        return v.new_zeros(()).expand(b, length, *v.shape[2:])

    return map_tensors(batch, grow)


def reshape_batch(batch: Any, difficulty: int, key: str = "input_ids") -> Any:
    """``seqlen_reshape`` (GPT, Megatron-DeepSpeed ``pretrain_gpt.py``): re-chunk the token tensor ``[B, S]``
    (``batch[key]`` of a mapping batch, or the batch itself when it is a tensor) into rows of ``d + 1`` tokens instead
    of discarding: ``floor(S/(d+1))·(d+1)`` columns viewed as rows of ``d+1``, plus the last ``d+1`` tokens of each
    sample as an extra row; keep ``min(ceil(B·S/(d+1)), rows)`` rows, minus one if that is odd and > 1 (Megatron's
    rule). The micro-batch size changes. A mapping batch comes back as ``{key: rows}`` (other sequence fields have no
    meaning after re-chunking; non-sequence keys are dropped too); a tensor batch as the rows.

    Raises:
        ValueError: ``difficulty < 1``; the batch is neither a mapping with a 2-D tensor ``batch[key]`` nor a 2-D
            tensor.
    """
    if difficulty < 1:
        raise ValueError(f"seqlen_reshape: difficulty must be >= 1 token, got {difficulty}")
    x = batch if isinstance(batch, Tensor) else batch.get(key) if isinstance(batch, Mapping) else None
    if not isinstance(x, Tensor) or x.ndim != 2:
        raise ValueError(
            f"seqlen_reshape needs a 2-D tensor batch[{key!r}] ([B, S]) or a [B, S] tensor batch; got "
            f"{describe_batch(batch)}"
        )
    b, s = x.shape
    width = difficulty + 1
    if width >= s:
        return x if isinstance(batch, Tensor) else {key: x}
    cols = (s // width) * width
    rows = x[:, :cols].reshape(-1, width)
    rows = torch.cat([rows, x[:, -width:]], dim=0)
    num_row = min(-(-(b * s) // width), rows.shape[0])
    if num_row % 2 == 1 and num_row > 1:
        num_row -= 1
    out = rows[:num_row].contiguous()
    return out if isinstance(batch, Tensor) else {key: out}


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
