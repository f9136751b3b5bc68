"""Random layerwise token dropping (random-LTD) as pure functions.

Yao et al., "Random-LTD: Random and Layerwise Token Dropping Brings Efficient Training for Large-scale Transformers"
(arXiv 2211.11586) and "DeepSpeed Data Efficiency" (Li et al., arXiv 2212.03597); reference code
``deepspeed/runtime/data_pipeline/data_routing/{basic_layer,scheduler}.py``. The method card is ``README.md`` beside
this file.

Every selected ("LTD") transformer layer runs, in training, on a random sorted subset of ``r`` token positions per
sample (``r`` = the *reserved length*); dropped positions skip the layer unchanged:

    idx = sample_token_indices(num_ltd_layers, B, S, r, generator)   # int64 [L_ltd, B, r], rows sorted
    part = gather_tokens(x, idx[l])                                   # [B, r, H]
    y = scatter_tokens(x, idx[l], layer(part, gather_seq_tensor(mask, idx[l], (-2, -1))))

The reserved length follows the MSLG schedule (:func:`ltd_value`, DeepSpeed's ``fixed_linear``) and the compute
spent is counted in *layer-tokens* (:func:`layer_tokens`, :func:`total_layer_tokens`).

Conventions: hidden states are ``[B, S, H]`` (``seq_dim=1``, HF and timm) or ``[S, B, H]`` (``seq_dim=0``,
Megatron); token indices are int64 and sorted ascending per row; any dtype and length; native ``torch.gather`` /
out-of-place ``torch.scatter`` (autograd saves only the indices). This module imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from lightning_effi.core.checks import check_int, is_int

__all__ = [
    "MASK_KINDS",
    "ROUNDINGS",
    "MaskLayoutError",
    "expand_attention",
    "flops_per_layer",
    "gather_attention_mask",
    "gather_seq_tensor",
    "gather_tokens",
    "layer_tokens",
    "ltd_value",
    "mask_layouts",
    "sample_token_indices",
    "saved_flops_fraction",
    "scatter_tokens",
    "total_layer_tokens",
    "validate_schedule",
]

Rounding = Literal["clamped", "deepspeed"]
ROUNDINGS = ("clamped", "deepspeed")
MaskKind = Literal["self", "cross", "key_padding"]
#: the attention-mask arguments :func:`gather_attention_mask` knows: a self-attention mask (query and key axes are the
#: sequence), a cross-attention mask (query axis the sequence, key axis another one, e.g. a decoder's memory), a
#: key-padding mask ``[B, S]``
MASK_KINDS = ("self", "cross", "key_padding")


# ---------------------------------------------------------------------------------------------------------------
# Token selection
# ---------------------------------------------------------------------------------------------------------------


def sample_token_indices(
    num_layers: int,
    batch_size: int,
    seq_len: int,
    reserved_length: int,
    generator: torch.Generator | None = None,
    keep_prefix_tokens: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """Independent uniform ``r``-subsets of ``range(S)`` per (layer, sample), sorted ascending (Yao et al. 2022).

    Each row is uniform over all ``r``-subsets without replacement (``argsort`` of i.i.d. float64 uniforms). With
    ``keep_prefix_tokens = k`` positions ``0..k-1`` are always kept and the other ``r - k`` are uniform over
    ``k..S-1`` (timm ``PatchDropout`` style, e.g. a class token).

    Args:
        num_layers: ``L_ltd`` (>= 0). batch_size: ``B``. seq_len: ``S``. reserved_length: ``r``, ``k <= r <= S``.
        generator: a ``torch.Generator`` on ``device`` (default: the global generator).
        keep_prefix_tokens: ``k >= 0``. device: where the indices are made (default: the generator's device).

    Returns:
        int64 ``[L_ltd, B, r]``.

    Raises:
        ValueError: a size that is not a non-negative int, ``r > S`` or ``r < k``.
    """
    for name, v in (
        ("num_layers", num_layers),
        ("batch_size", batch_size),
        ("seq_len", seq_len),
        ("reserved_length", reserved_length),
        ("keep_prefix_tokens", keep_prefix_tokens),
    ):
        if not is_int(v) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    if reserved_length > seq_len:
        raise ValueError(f"reserved_length ({reserved_length}) is larger than the sequence length ({seq_len})")
    if reserved_length < keep_prefix_tokens:
        raise ValueError(f"reserved_length ({reserved_length}) must be >= keep_prefix_tokens ({keep_prefix_tokens})")
    if device is None:
        device = generator.device if generator is not None else torch.device("cpu")
    k = keep_prefix_tokens
    keys = torch.rand(num_layers, batch_size, seq_len - k, generator=generator, device=device, dtype=torch.float64)
    drawn = keys.argsort(dim=-1)[..., : reserved_length - k] + k
    if k:
        prefix = torch.arange(k, device=device).expand(num_layers, batch_size, k)
        drawn = torch.cat([prefix, drawn], dim=-1)
    return drawn.sort(dim=-1).values


def _check_idx(x: Tensor, idx: Tensor, seq_dim: int) -> int:
    if seq_dim not in (0, 1):
        raise ValueError(f"seq_dim must be 0 ([S, B, H]) or 1 ([B, S, H]), got {seq_dim!r}")
    if x.dim() < 2:
        raise ValueError(f"hidden states need a batch and a sequence axis, got shape {tuple(x.shape)}")
    if idx.dtype != torch.int64 or idx.dim() != 2:
        raise ValueError(f"token indices must be int64 [B, r], got {idx.dtype} {tuple(idx.shape)}")
    batch = x.shape[1 - seq_dim]
    if idx.shape[0] != batch:
        raise ValueError(f"token indices are for {idx.shape[0]} samples, the hidden states hold {batch}")
    return batch


def _expand_index(x: Tensor, idx: Tensor, seq_dim: int) -> Tensor:
    """``idx [B, r]`` laid out like ``x`` with the sequence axis of length ``r``."""
    view = idx if seq_dim == 1 else idx.t()  # [B, r] or [r, B]
    view = view.reshape(*view.shape, *([1] * (x.dim() - 2)))
    return view.expand(*view.shape[:2], *x.shape[2:])


def gather_tokens(x: Tensor, idx: Tensor, seq_dim: int = 1) -> Tensor:
    """The kept tokens: ``out[b, j] = x[b, idx[b, j]]`` (``seq_dim=1``; transposed for ``seq_dim=0``).

    Args:
        x: ``[B, S, ...]`` (or ``[S, B, ...]``), any dtype. idx: int64 ``[B, r]``.

    Returns:
        ``[B, r, ...]`` (or ``[r, B, ...]``), a new tensor (differentiable w.r.t. ``x``).
    """
    _check_idx(x, idx, seq_dim)
    return x.gather(seq_dim, _expand_index(x, idx, seq_dim))


def scatter_tokens(x: Tensor, idx: Tensor, part: Tensor, seq_dim: int = 1) -> Tensor:
    """``x`` with the kept rows replaced by ``part`` (out of place: dropped rows skip the layer unchanged).

    Gradients: dropped positions pass ``grad_out`` straight to ``x``; kept positions of ``x`` receive nothing through
    this op (their identity path is overwritten); ``part`` receives the kept rows of ``grad_out``.

    Args:
        x: ``[B, S, ...]``. idx: int64 ``[B, r]``, distinct positions per row (as :func:`sample_token_indices`
            draws them; not checked, which would read the indices: a repeated position keeps one of its rows, which
            one is unspecified). part: ``[B, r, ...]`` (same layout and trailing sizes as ``x``), cast to ``x``'s
            dtype (a layer under autocast may return a lower precision than the residual stream).

    Raises:
        ValueError: ``part`` does not have ``x``'s shape with ``r`` tokens, ``part`` is not a floating tensor while
            ``x`` is, or ``idx`` is not int64 ``[B, r]`` for ``x``'s batch.
    """
    _check_idx(x, idx, seq_dim)
    expected = list(x.shape)
    expected[seq_dim] = idx.shape[1]
    if list(part.shape) != expected:
        raise ValueError(
            f"layer output has shape {tuple(part.shape)}, expected {tuple(expected)} (the gathered "
            "input's shape): a layer under random-LTD must keep the sequence length"
        )
    if x.is_floating_point() and not part.is_floating_point():
        raise ValueError(f"layer output is {part.dtype}, the hidden states {x.dtype}: expected a floating tensor")
    return x.scatter(seq_dim, _expand_index(x, idx, seq_dim), part.to(x.dtype))


def gather_seq_tensor(
    t: Tensor, idx: Tensor, axes: Sequence[int], batch_axis: int = 0, seq_len: int | None = None
) -> Tensor:
    """Gather every sequence axis of a mask, bias or position tensor with the per-sample indices (never sliced).

    Axes of size 1 are broadcast axes and are left alone; a batch axis of size 1 is expanded to ``B`` before a
    per-sample gather. Examples: a ``[B, 1, S, S]`` mask with ``axes=(-2, -1)`` gives ``[B, 1, r, r]``; a
    ``[B, 1, 1, S]`` mask gives ``[B, 1, 1, r]``; ``position_ids [1, S]`` with ``axes=(-1,)`` gives ``[B, r]``; a
    sequence-first ``[S, B]`` tensor with ``axes=(0,)``, ``batch_axis=1`` gives ``[r, B]``.

    Args:
        t: the tensor. idx: int64 ``[B, r]`` (sorted rows). axes: the axes that index the sequence.
        batch_axis: the axis of ``t`` that indexes samples (size ``B`` or 1; before or after the sequence axes).
        seq_len: ``S``, when known: every sequence axis must then have size 1 or ``S``.

    Raises:
        ValueError: a sequence axis that is the batch axis, one whose size is neither 1 nor ``seq_len`` (when given),
            or a batch axis whose size is neither 1 nor ``B``. (An index beyond a sequence axis is torch's gather
            error: the indices are not read here, which would synchronise a GPU and break a compiled graph.)
    """
    b, r = idx.shape
    nd = t.dim()
    batch_axis %= nd
    if t.shape[batch_axis] not in (1, b):
        raise ValueError(
            f"tensor of shape {tuple(t.shape)}: batch axis {batch_axis} has size "
            f"{t.shape[batch_axis]}, expected 1 or {b}"
        )
    for axis in sorted({a % nd for a in axes}):
        if axis == batch_axis:
            raise ValueError(f"axis {axis} is the batch axis of a tensor of shape {tuple(t.shape)}")
        size = t.shape[axis]
        if size == 1:
            continue
        if seq_len is not None and size != seq_len:  # shapes only: no read of the indices (no sync, no graph break)
            raise ValueError(
                f"tensor of shape {tuple(t.shape)}: sequence axis {axis} has size {size}, expected 1 or {seq_len}"
            )
        if t.shape[batch_axis] == 1 and b != 1:
            shape = list(t.shape)
            shape[batch_axis] = b
            t = t.expand(*shape)
        shape = [1] * nd
        shape[batch_axis], shape[axis] = b, r
        index = (idx if batch_axis < axis else idx.t()).reshape(shape)  # [B, r] laid out in the axes' order
        target = list(t.shape)
        target[axis] = r
        t = t.gather(axis, index.expand(*target))
    return t


class MaskLayoutError(ValueError):
    """An attention mask whose layout :func:`gather_attention_mask` cannot read (the message names the shape seen and
    the layouts allowed)."""


def mask_layouts(kind: MaskKind, num_heads: int | None = None) -> str:
    """The layouts :func:`gather_attention_mask` accepts for ``kind`` (text for error messages and docs)."""
    key = "S" if kind == "self" else "M"
    if kind == "key_padding":
        return "[B, S] (or [1, S])"
    if num_heads is not None:  # the torch.nn.MultiheadAttention conventions
        return f"[S, {key}] or [B*num_heads, S, {key}] (num_heads={num_heads}, nn.MultiheadAttention)"
    return f"[S, {key}], [B|1, S, {key}] or [B|1, 1|H, S, {key}]"


def gather_attention_mask(
    mask: Tensor, idx: Tensor, seq_len: int, kind: MaskKind = "self", num_heads: int | None = None
) -> Tensor:
    """The rows (and, for a self-attention mask, the columns) of the kept tokens of a PyTorch attention mask, per
    sample, in a layout the same attention accepts (boolean and additive float masks alike; never sliced).

    Layouts (``S`` = ``seq_len``, ``M`` = a cross-attention's key length, ``B`` = ``idx.shape[0]``, ``r`` =
    ``idx.shape[1]``; ``K`` = ``S`` for ``kind="self"``, ``M`` for ``"cross"``):

    - ``"self"`` / ``"cross"`` with ``num_heads`` (the attention is a ``torch.nn.MultiheadAttention``, whose
      ``attn_mask`` is ``[L, K]`` or ``[B*num_heads, L, K]``): ``[S, K]`` (shared by the batch) and
      ``[B*num_heads, S, K]`` give ``[B*num_heads, r, K']`` (a shared mask becomes per-sample once each sample keeps
      other tokens);
    - ``"self"`` / ``"cross"`` without ``num_heads`` (any attention that broadcasts the mask against
      ``[B, H, S, K]`` scores, e.g. ``F.scaled_dot_product_attention``): ``[S, K]`` gives ``[B, 1, r, K']``,
      ``[B|1, S, K]`` gives ``[B, r, K']``, ``[B|1, 1|H, S, K]`` gives ``[B, 1|H, r, K']``;
    - ``"key_padding"``: ``[B|1, S]`` gives ``[B, r]``.

    ``K' = r`` for a self-attention mask (both axes gathered), ``M`` for a cross-attention mask (query axis only).
    The layouts are those ``torch.nn.MultiheadAttention`` and ``F.scaled_dot_product_attention`` document
    (``attn_mask``, ``key_padding_mask``); every sequence axis is gathered per sample with the layer's kept tokens,
    never sliced (Yao et al. 2022, Sec. 3: each layer attends among its kept tokens only).

    Args:
        mask: the mask. idx: int64 ``[B, r]`` kept positions per sample. seq_len: ``S``. kind: see above.
        num_heads: the heads of a ``torch.nn.MultiheadAttention`` consumer, or ``None``.

    Returns:
        the gathered mask, same dtype.

    Raises:
        MaskLayoutError: (a ``ValueError``) a layout not listed above for ``kind`` (the message gives the shape seen
            and the layouts allowed), or an unknown ``kind``. ValueError: ``num_heads`` not an int >= 1.
    """
    if kind not in MASK_KINDS:
        raise MaskLayoutError(f"mask kind must be one of {MASK_KINDS}, got {kind!r}")
    if num_heads is not None:
        num_heads = check_int("gather_attention_mask", "num_heads", num_heads, minimum=1)
    b, r = idx.shape
    shape = tuple(mask.shape)

    def bad() -> MaskLayoutError:
        return MaskLayoutError(
            f"a {kind} attention mask of shape {list(shape)} for S={seq_len}, B={b} is not a layout random-LTD can "
            f"gather; allowed: {mask_layouts(kind, num_heads)}"
        )

    if kind == "key_padding":
        if mask.dim() != 2 or shape[1] != seq_len or shape[0] not in (1, b):
            raise bad()
        return gather_seq_tensor(mask, idx, (-1,), batch_axis=0)
    if mask.dim() not in (2, 3, 4) or shape[-2] != seq_len or (kind == "self" and shape[-1] != seq_len):
        raise bad()
    axes = (-2, -1) if kind == "self" else (-2,)
    if mask.dim() == 2:  # [S, K], shared by every sample
        out = gather_seq_tensor(mask.unsqueeze(0), idx, axes, batch_axis=0)  # [B, r, K']
        return out.repeat_interleave(num_heads, dim=0) if num_heads is not None else out.unsqueeze(1)
    if mask.dim() == 3:
        if num_heads is not None:
            if shape[0] != b * num_heads:
                raise bad()
            per_head = gather_seq_tensor(mask.reshape(b, num_heads, *shape[1:]), idx, axes, batch_axis=0)
            return per_head.reshape(b * num_heads, *per_head.shape[2:])
        if shape[0] not in (1, b):
            raise bad()
        return gather_seq_tensor(mask, idx, axes, batch_axis=0)
    if num_heads is not None or shape[0] not in (1, b):  # 4-D: not an nn.MultiheadAttention layout
        raise bad()
    return gather_seq_tensor(mask, idx, axes, batch_axis=0)


def expand_attention(weights: Tensor, idx: Tensor, seq_len: int, keys: bool = True) -> Tensor:
    """Attention weights computed on the kept tokens, put back on the full sequence: the kept rows (and, with
    ``keys``, the kept columns) at their original positions, zeros for the dropped tokens (which attended nothing and
    were attended by nobody in that layer).

    Args:
        weights: ``[B, ..., r, K]`` (e.g. ``[B, H, r, r]``, or ``[B, r, r]`` averaged over heads). idx: int64
            ``[B, r]``. seq_len: ``S``. keys: the last axis is the kept tokens too (self-attention; ``K = r``);
            ``False`` for a cross-attention's weights (``K`` = the memory's length, left alone).

    Returns:
        ``[B, ..., S, S]`` (or ``[B, ..., S, K]``), same dtype, differentiable w.r.t. ``weights``.

    Raises:
        ValueError: ``weights`` has fewer than 3 axes, another batch size, or an axis of length ``r`` missing.
    """
    b, r = idx.shape
    if weights.dim() < 3 or weights.shape[0] != b or weights.shape[-2] != r or (keys and weights.shape[-1] != r):
        raise ValueError(
            f"attention weights of shape {tuple(weights.shape)} are not [B={b}, ..., r={r}, {'r' if keys else 'K'}]"
        )
    middle = [1] * (weights.dim() - 3)
    rows_shape = (*weights.shape[:-2], seq_len, weights.shape[-1])
    rows = weights.new_zeros(rows_shape).scatter(
        -2, idx.view(b, *middle, r, 1).expand(*weights.shape), weights
    )  # [B, ..., S, K]
    if not keys:
        return rows
    full = weights.new_zeros((*weights.shape[:-2], seq_len, seq_len))
    return full.scatter(-1, idx.view(b, *middle, 1, r).expand(*rows.shape), rows)


# ---------------------------------------------------------------------------------------------------------------
# Reserved-length schedule (MSLG) and layer-token accounting
# ---------------------------------------------------------------------------------------------------------------


def validate_schedule(
    min_value: int, max_value: int, require_steps: int, seq_per_step: int, rounding: str = "clamped"
) -> None:
    """Check MSLG schedule values (DeepSpeed config names).

    Raises:
        ValueError: ``min_value``/``max_value`` not ints ``>= 1``, ``min_value > max_value``, ``require_steps`` not an
            int ``>= 1``, ``seq_per_step`` not an int ``>= 1``, ``rounding`` not ``clamped``/``deepspeed``.
    """
    for name, v in (
        ("min_value", min_value),
        ("max_value", max_value),
        ("require_steps", require_steps),
        ("seq_per_step", seq_per_step),
    ):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if min_value > max_value:
        raise ValueError(f"min_value ({min_value}) must be <= max_value ({max_value})")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")


def ltd_value(
    step: int, min_value: int, max_value: int, require_steps: int, seq_per_step: int, rounding: Rounding = "clamped"
) -> int:
    """Reserved length ``r`` at optimizer step ``step`` (0-based), DeepSpeed's ``fixed_linear`` schedule
    (``deepspeed/runtime/data_pipeline/data_routing/scheduler.py``)::

        value = floor(step / require_steps * (max_value - min_value) + min_value)
        value -= value % seq_per_step;  value = min(value, max_value)

    ``rounding="deepspeed"`` is exactly that: it can start below ``min_value``, and when ``max_value`` is not a
    multiple of ``seq_per_step`` it is still below ``max_value`` at ``require_steps`` and reaches it some steps later
    (``min_value = 64, max_value = 200, seq_per_step = 16, require_steps = 1000``: 192 at step 1000, 200 from step
    1059; with ``min_value == max_value`` never); ``"clamped"`` (default) also keeps ``value >= min_value`` and gives
    ``max_value`` from ``require_steps`` on.
    The DeepSpeed scheduler only updates while ``current < max_value``; the formula is monotonic, so the value at a
    step does not depend on the history. ``"deepspeed"`` computes the product in float64 as DeepSpeed does
    (``floor(float(step) / require_steps * (max_value - min_value) + min_value)``, one ``seq_per_step`` below the
    exact value at rare steps: ``min_value = 173, max_value = 773, require_steps = 400`` gives 511 at step 226, the
    exact product 512); ``"clamped"`` computes it exactly (integers).

    Raises:
        ValueError: invalid schedule values (see :func:`validate_schedule`) or a negative / non-int ``step``.
    """
    validate_schedule(min_value, max_value, require_steps, seq_per_step, rounding)
    if not is_int(step) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if rounding == "deepspeed":  # DeepSpeed's float arithmetic (RandomLTDScheduler.__fixed_root_get_value, degree 1)
        value = math.floor((float(step) / require_steps) ** (1.0 / 1) * (max_value - min_value) + min_value)
    else:
        value = (step * (max_value - min_value)) // require_steps + min_value
    value -= value % seq_per_step
    value = min(value, max_value)
    if rounding == "clamped":
        value = max_value if step >= require_steps else max(value, min_value)
    return int(value)


def layer_tokens(batch_size: int, seq_len: int, reserved_length: int, num_layers: int, num_ltd_layers: int) -> int:
    """Layer-tokens one batch consumes: ``B * (min(r, S) * L_ltd + S * (L - L_ltd))`` (actual accounting).

    With ``seq_len = max_value`` this is DeepSpeed's per-step increment (``global_batch_size * (r * L_ltd +
    max_value * (L - L_ltd))``; Yao et al. 2022, Sec. 3; DeepSpeed ``data_routing/scheduler.py``).

    Args:
        batch_size: ``B``, samples (>= 0). seq_len: ``S``, tokens per sample (>= 0). reserved_length: ``r``, tokens
            each LTD layer keeps (>= 0; counted as ``min(r, S)``). num_layers: ``L`` (>= 0). num_ltd_layers:
            ``L_ltd``, in ``[0, L]``.

    Raises:
        ValueError: an argument that is not an int (Python or numpy) or is negative (naming it), or
            ``num_ltd_layers > num_layers``.
    """
    owner = "layer_tokens"
    b = check_int(owner, "batch_size", batch_size, minimum=0)
    s = check_int(owner, "seq_len", seq_len, minimum=0)
    r = check_int(owner, "reserved_length", reserved_length, minimum=0)
    n = check_int(owner, "num_layers", num_layers, minimum=0)
    n_ltd = check_int(owner, "num_ltd_layers", num_ltd_layers, minimum=0)
    if n_ltd > n:
        raise ValueError(f"need 0 <= num_ltd_layers <= num_layers, got {num_ltd_layers}, {num_layers}")
    return b * (min(r, s) * n_ltd + s * (n - n_ltd))


def total_layer_tokens(
    train_steps: int,
    global_batch_size: int,
    num_layers: int,
    num_ltd_layers: int,
    min_value: int,
    max_value: int,
    require_steps: int,
    seq_per_step: int,
    rounding: Rounding = "clamped",
) -> int:
    """Layer-tokens of ``train_steps`` optimizer steps at full-length (``max_value``) sequences: the sum of
    :func:`layer_tokens` over the schedule. Pure (DeepSpeed's ``get_total_layer_tokens`` mutates its scheduler)."""
    if not is_int(train_steps) or train_steps < 0:
        raise ValueError(f"train_steps must be a non-negative int, got {train_steps!r}")
    total = 0
    if min_value == max_value and train_steps:  # one value throughout (deepspeed rounding may keep it below max)
        r = ltd_value(0, min_value, max_value, require_steps, seq_per_step, rounding)
        return train_steps * layer_tokens(global_batch_size, max_value, r, num_layers, num_ltd_layers)
    for step in range(train_steps):  # ends by ~require_steps * (1 + seq_per_step / (max - min)) steps
        r = ltd_value(step, min_value, max_value, require_steps, seq_per_step, rounding)
        tokens = layer_tokens(global_batch_size, max_value, r, num_layers, num_ltd_layers)
        if r == max_value:  # the schedule never decreases and stops at max_value: every later step is the same
            return total + (train_steps - step) * tokens
        total += tokens
    return total


def flops_per_layer(
    batch_size: int, tokens: int, hidden: int, intermediate: int | None = None, fused_attention: bool = False
) -> int:
    """Training FLOPs (forward + backward = 3 x forward) of one transformer layer on ``tokens`` tokens per sample:
    ``3 * (B*T*(8*H^2 + 4*H*I) + 4*B*T^2*H)`` (QKV/output projections, MLP, attention scores and mixing; the
    same convention as :func:`lightning_effi.core.flops.transformer_forward_flops`), plus ``2*B*T^2*H`` when
    ``fused_attention``: a fused scaled-dot-product kernel recomputes the scores ``Q K^T`` in the backward
    (Dao et al. 2022, FlashAttention Sec. 3.1; :func:`lightning_effi.core.flops.attention_recompute_flops`, as
    ``torch.utils.flop_counter`` counts the sdpa backward). ``I`` defaults to ``4*H``.

    Raises:
        ValueError: ``batch_size`` / ``tokens`` not an int >= 0, ``hidden`` / ``intermediate`` not an int >= 1.
    """
    owner = "flops_per_layer"
    b = check_int(owner, "batch_size", batch_size, minimum=0)
    t = check_int(owner, "tokens", tokens, minimum=0)
    hidden = check_int(owner, "hidden", hidden, minimum=1)
    inter = 4 * hidden if intermediate is None else check_int(owner, "intermediate", intermediate, minimum=1)
    recompute = 2 * b * t * t * hidden if fused_attention else 0
    return 3 * (b * t * (8 * hidden * hidden + 4 * hidden * inter) + 4 * b * t * t * hidden) + recompute


def saved_flops_fraction(
    seq_len: int,
    reserved_length: int,
    num_layers: int,
    num_ltd_layers: int,
    hidden: int,
    intermediate: int | None = None,
    fused_attention: bool = False,
) -> float:
    """Fraction of the transformer layers' training FLOPs that random-LTD skips at reserved length ``r``
    (:func:`flops_per_layer`, with the fused kernels' recompute of the scores when ``fused_attention``).

    Raises:
        ValueError: an argument of the wrong type or range, naming it (``num_ltd_layers`` in ``[0, num_layers]``).
    """
    owner = "saved_flops_fraction"
    seq_len = check_int(owner, "seq_len", seq_len, minimum=0)
    reserved_length = check_int(owner, "reserved_length", reserved_length, minimum=0)
    num_layers = check_int(owner, "num_layers", num_layers, minimum=0)
    num_ltd_layers = check_int(owner, "num_ltd_layers", num_ltd_layers, minimum=0, maximum=num_layers)
    per_layer = flops_per_layer(1, seq_len, hidden, intermediate, fused_attention)
    full = num_layers * per_layer
    if full == 0:
        return 0.0
    r = min(reserved_length, seq_len)
    saved = num_ltd_layers * (per_layer - flops_per_layer(1, r, hidden, intermediate, fused_attention))
    return saved / full
