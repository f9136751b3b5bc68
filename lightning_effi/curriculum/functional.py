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

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

DIFFICULTY_TYPES = ("value", "percentile")
PERCENTILE_ROUNDING = ("deepspeed", "proportional")
DP_SPLITS = ("balanced", "deepspeed")
#: batch keys truncated by :func:`truncate_batch` when present with a sequence dimension (Megatron GPT/BERT fields)
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
def sequence_length(batch: Mapping[str, Any], keys: Sequence[str] = SEQUENCE_KEYS) -> int | None:
    """The batch's sequence length ``S``: dimension 1 of the first ``keys`` tensor with at least 2 dimensions
    (``[B, S, ...]``), None when it has none. The length :func:`truncate_batch` cuts."""
    for k in keys:
        v = batch.get(k)
        if isinstance(v, torch.Tensor) and v.ndim >= 2:
            return int(v.shape[1])
    return None


def truncate_batch(
    batch: dict[str, Any], difficulty: int, keys: Sequence[str] = SEQUENCE_KEYS, causal_label_shift: bool = False
) -> dict[str, Any]:
    """``seqlen_truncate`` (Megatron-DeepSpeed ``pretrain_{gpt,bert}.py``): keep the first ``L`` columns of every
    ``keys`` tensor with a sequence dimension (``[B, S, ...]``, ``S`` taken from the first such key), ``L = d + 1``
    with ``causal_label_shift`` (Megatron GPT: a sample holds ``seq_length + 1`` tokens, the extra one being the
    shifted label) else ``L = d``. Nothing changes when ``L >= S``. Returns a new dict (tensors are views); other keys
    are kept as they are.

    Raises:
        ValueError: ``difficulty < 1``.
    """
    if difficulty < 1:
        raise ValueError(f"seqlen_truncate: difficulty must be >= 1 token, got {difficulty}")
    out = dict(batch)
    seq = sequence_length(batch, keys)
    if seq is None:
        return out
    length = difficulty + 1 if causal_label_shift else difficulty
    if length >= seq:
        return out
    for k in keys:
        v = batch.get(k)
        if isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == seq:
            out[k] = v[:, :length]
    return out


def reshape_batch(batch: dict[str, Any], difficulty: int, key: str = "input_ids") -> dict[str, Any]:
    """``seqlen_reshape`` (GPT, Megatron-DeepSpeed ``pretrain_gpt.py``): re-chunk ``batch[key]`` (``[B, S]``) into
    rows of ``d + 1`` tokens instead of discarding: ``floor(S/(d+1))·(d+1)`` columns viewed as rows of ``d+1``, plus
    the last ``d+1`` tokens of each sample as an extra row; keep ``min(ceil(B·S/(d+1)), rows)`` rows, minus one if
    that is odd and > 1 (Megatron's rule). The micro-batch size changes. Only ``key`` is kept (other sequence fields
    have no meaning after re-chunking; non-sequence keys are dropped too).

    Raises:
        ValueError: ``difficulty < 1`` or ``key`` missing / not 2-D.
    """
    if difficulty < 1:
        raise ValueError(f"seqlen_reshape: difficulty must be >= 1 token, got {difficulty}")
    x = batch.get(key)
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise ValueError(f"seqlen_reshape needs a 2-D tensor batch[{key!r}] ([B, S])")
    b, s = x.shape
    width = difficulty + 1
    if width >= s:
        return {key: x}
    cols = (s // width) * width
    rows = x[:, :cols].reshape(-1, width)
    rows = torch.cat([rows, x[:, -width:]], dim=0)
    num_row = min(-(-(b * s) // width), rows.shape[0])
    if num_row % 2 == 1 and num_row > 1:
        num_row -= 1
    return {key: rows[:num_row].contiguous()}


def trim_padding(
    batch: dict[str, Any],
    multiple: int = 8,
    mask_key: str = "attention_mask",
    keys: Sequence[str] = SEQUENCE_KEYS,
    length: int | None = None,
) -> dict[str, Any]:
    """BERT "seqlen reorder" post-process (Megatron-DeepSpeed ``pretrain_bert.py``): cut every sequence field to the
    longest non-padding length of the batch rounded **up** to a multiple of ``multiple`` (``length`` overrides, e.g.
    the MAX all-reduced over DP ranks)."""
    mask = batch.get(mask_key)
    if length is None:
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"trim_padding needs batch[{mask_key!r}]")
        longest = int(mask.sum(dim=1).max().item()) if mask.numel() else 0
        length = max(multiple, -(-longest // multiple) * multiple)
    return truncate_batch(batch, length, keys)
