"""Training FLOPs: analytic for transformers, measured with ``torch.utils.flop_counter`` for everything else.

Conventions (those of ``torch.utils.flop_counter`` and of the papers: Kaplan et al. 2020 Sec. 2.1, Narayanan et al.
2021 Sec. 5.1 for the attention term, Yao et al. 2022 for random-LTD, Zou et al. 2024 for the V-cycle):

- one multiply-add = 2 FLOPs; only matrix products are counted: ``mm``/``addmm``/``bmm`` (linear layers, HF
  ``Conv1D``, eager attention), convolutions and scaled-dot-product attention. Embedding lookups, norms, activations,
  softmax, dropout, the loss, random-LTD's gather/scatter and the optimizer update cost 0.
- training = forward + backward; the backward of a matrix product costs two (input and weight gradients), so a layer
  costs 3 x its forward, except a layer whose input needs no gradient (the first convolution of an image model:
  2 x, the weight gradient only; :func:`count_training_flops` sees this, the transformer formulas need not).
- attention is counted over the full ``T x T`` square, causal or not (as the flop counter counts it). The fused
  scaled-dot-product kernels (CUDA flash / memory-efficient / cuDNN, the CPU flash kernel) recompute the scores
  ``Q K^T`` in the backward (Dao et al. 2022): one more ``2·B·T²·H`` per layer; the math fallback (PyTorch's choice
  on the CPU with attention dropout) and eager attention do not.

These are the counts ``torch.utils.flop_counter.FlopCounterMode`` reports for a real training step, once PyTorch's CPU
flash-attention kernels (which it has no formula for) are given the formulas of the CUDA ones
(:data:`CPU_SDPA_FORMULAS`, :func:`flop_counter`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, Literal
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

Head = Literal["lm", "mlm", "cls", "none"]

__all__ = [
    "CPU_SDPA_FORMULAS",
    "attention_recompute_flops",
    "count_training_flops",
    "flop_counter",
    "measured_training_flops",
    "sdpa_recomputes",
    "transformer_forward_flops",
    "transformer_training_flops",
]


def transformer_forward_flops(
    batch_size: int,
    seq_len: int,
    n_layer: int,
    hidden: int,
    intermediate: int | None = None,
    vocab_size: int = 0,
    head: Head = "lm",
    num_classes: int = 0,
) -> int:
    """Forward FLOPs of a standard (GPT-2 / BERT / ViT) transformer on ``batch_size`` sequences of ``seq_len``.

    Per layer and token: QKV and output projections ``2*4*H^2``, MLP ``2*2*H*I``, attention scores and mixing
    ``2*2*T*H`` (counted over the full T x T square, as ``torch.utils.flop_counter`` counts attention, causal or not;
    Narayanan et al. 2021). Heads: ``lm`` = tied or untied vocabulary projection on every token (``2*H*V``; GPT-2
    projects all T positions, the causal shift of the labels drops one only after the head); ``mlm`` = BERT's
    transform (``2*H^2``) plus the vocabulary projection on every token; ``cls`` = pooler (``2*H^2``) plus classifier
    (``2*H*C``) once per sequence; ``none`` = no head. Embedding lookups cost 0.

    Args:
        batch_size: B, sequences per batch. seq_len: T, tokens per sequence (padded length: padding is computed).
        n_layer: L. hidden: H. intermediate: I (default 4H). vocab_size: V. num_classes: C (``cls`` head).

    Returns:
        FLOPs as a Python int.

    Raises:
        ValueError: a negative size or an unknown head.
    """
    if min(batch_size, seq_len, n_layer, hidden, vocab_size, num_classes) < 0:
        raise ValueError("transformer_forward_flops: sizes must be >= 0")
    inter = 4 * hidden if intermediate is None else intermediate
    tokens = batch_size * seq_len
    per_layer = (
        tokens * (2 * 4 * hidden * hidden + 2 * 2 * hidden * inter) + batch_size * 4 * seq_len * seq_len * hidden
    )
    total = n_layer * per_layer
    if head == "lm":
        total += tokens * 2 * hidden * vocab_size
    elif head == "mlm":
        total += tokens * (2 * hidden * hidden + 2 * hidden * vocab_size)
    elif head == "cls":
        total += batch_size * (2 * hidden * hidden + 2 * hidden * num_classes)
    elif head != "none":
        raise ValueError(f"transformer_forward_flops: head must be one of lm, mlm, cls, none; got {head!r}")
    return total


def attention_recompute_flops(batch_size: int, seq_len: int, n_layer: int, hidden: int) -> int:
    """What the fused scaled-dot-product kernels add to a training step: the backward recomputes the scores
    ``Q K^T``, ``2·B·T²·H`` per layer (Dao et al. 2022, FlashAttention Sec. 3.1; ``torch.utils.flop_counter``'s
    ``sdpa_backward_flop_count``)."""
    return 2 * int(n_layer) * int(batch_size) * int(seq_len) ** 2 * int(hidden)


def transformer_training_flops(*args: Any, fused_attention: bool = False, **kwargs: Any) -> int:
    """Forward + backward FLOPs: ``3 * transformer_forward_flops(...)`` (same arguments), plus
    :func:`attention_recompute_flops` when ``fused_attention`` (the layers run ``F.scaled_dot_product_attention`` on a
    fused kernel, see :func:`sdpa_recomputes`).

    Raises:
        ValueError: as :func:`transformer_forward_flops`.
    """
    total = 3 * transformer_forward_flops(*args, **kwargs)
    if fused_attention:
        names = ("batch_size", "seq_len", "n_layer", "hidden")
        sizes = dict(zip(names, args))
        sizes.update({k: kwargs[k] for k in names if k in kwargs})
        total += attention_recompute_flops(**sizes)
    return total


def sdpa_recomputes(device: torch.device | str, dropout_p: float = 0.0) -> bool:
    """Whether a training-mode ``F.scaled_dot_product_attention`` on ``device`` runs a fused kernel, whose backward
    recomputes the scores: PyTorch picks flash / memory-efficient / cuDNN on CUDA and its flash kernel on the CPU, but
    the math fallback on the CPU when attention dropout is on (``dropout_p > 0``)."""
    return not (torch.device(device).type == "cpu" and dropout_p > 0)


def _cpu_flash_forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query, key, value))  # type: ignore[no-untyped-call]


def _cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out, query, key, value))  # type: ignore[no-untyped-call]


#: ``FlopCounterMode`` formulas for PyTorch's CPU flash-attention kernels of ``F.scaled_dot_product_attention``, which
#: it has none for (it registers the CUDA flash / memory-efficient / cuDNN ones): those of the CUDA kernels,
#: ``4·B·h·S·S·d`` forward (the full square, causal or not) and 2.5x that backward (the scores recomputed, Dao et al.
#: 2022). The math fallback (the CPU with attention dropout) decomposes into ``bmm`` and is counted anyway.
CPU_SDPA_FORMULAS: dict[Any, Any] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


def flop_counter() -> FlopCounterMode:
    """``FlopCounterMode(display=False)`` that also counts the CPU kernels of scaled-dot-product attention
    (:data:`CPU_SDPA_FORMULAS`): on any device, the FLOPs of the attention kernel that device runs."""
    return FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FORMULAS)


def _sdpa_math(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` as explicit matrix products (no dropout: only shapes are counted)."""
    if key.shape[-3] != query.shape[-3] and key.dim() >= 3:  # grouped-query attention
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    scores = query @ key.transpose(-2, -1) * (1.0 / math.sqrt(query.shape[-1]) if scale is None else scale)
    if is_causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores.softmax(dim=-1) @ value


class _CountedAttention(TorchFunctionMode):
    """Inside: ``F.scaled_dot_product_attention`` runs as :func:`_sdpa_math` (so a flop counter sees its matrix
    products whatever kernel the meta or CPU copy would pick) and, when the real device's kernel recomputes the scores
    (:func:`sdpa_recomputes`), :attr:`extra` collects that recompute for every call whose inputs need gradients."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.extra = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        bound = {**dict(zip(names, args)), **kwargs}
        q, k = bound["query"], bound["key"]
        if any(isinstance(t, Tensor) and t.requires_grad for t in (q, k, bound["value"])) and sdpa_recomputes(
            self.device, float(bound.get("dropout_p", 0.0))
        ):
            self.extra += 2 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
        return _sdpa_math(**bound)


def _scalar(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output.float().sum()
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits.float().sum()
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0].float().sum()
    raise TypeError(f"cannot reduce a model output of type {type(output).__name__} to a scalar")


def count_training_flops(model: nn.Module, inputs: Mapping[str, Tensor]) -> int:
    """Forward + backward FLOPs of ``model(**inputs)`` counted by ``torch.utils.flop_counter.FlopCounterMode``.

    Runs on a ``meta``-device copy (no memory, no compute, the live model and its gradients are untouched); falls
    back to a CPU copy when the model's forward needs real values (data-dependent control flow). Scaled-dot-product
    attention is counted as the model's real device runs it (module docstring): the copy runs it as explicit matrix
    products, plus the fused kernels' recompute of the scores.

    Raises:
        TypeError: the model's output is not a tensor, an object with ``logits`` or a tuple starting with a tensor.
        RuntimeError, NotImplementedError: the forward fails on the CPU copy too.
    """
    param = next(iter(model.parameters()), None)
    real_device = param.device if param is not None else torch.device("cpu")
    for device in ("meta", "cpu"):
        try:
            clone = copy.deepcopy(model).to(device)
            clone.train(model.training)
            fake = {
                k: (torch.zeros_like(v, device=device) if v.is_floating_point() else torch.ones_like(v, device=device))
                for k, v in inputs.items()
            }
            attention = _CountedAttention(real_device)
            with FlopCounterMode(display=False) as counter:
                with attention:
                    out = _scalar(clone(**fake))
                out.backward()  # type: ignore[no-untyped-call]
            return int(counter.get_total_flops()) + attention.extra
        except (NotImplementedError, RuntimeError):
            if device == "cpu":
                raise
    raise AssertionError("unreachable")


_CACHE: WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], int]] = WeakKeyDictionary()


def measured_training_flops(model: nn.Module, inputs: Mapping[str, Tensor]) -> int:
    """:func:`count_training_flops`, cached per model, training mode and input shapes (a new shape is measured once)."""
    key = (model.training, *sorted((k, tuple(v.shape), str(v.dtype)) for k, v in inputs.items()))
    per_model = _CACHE.setdefault(model, {})
    if key not in per_model:
        per_model[key] = count_training_flops(model, inputs)
    return per_model[key]
