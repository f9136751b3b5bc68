"""Training FLOPs: analytic for transformers, measured with ``torch.utils.flop_counter`` for everything else.

Conventions: one multiply-add = 2 FLOPs; training = forward + backward = 3 x forward (the backward of a matmul costs
two matmuls). Only matrix products are counted (the convention of ``torch.utils.flop_counter`` and of the papers:
Kaplan et al. 2020 Sec. 2.1, Megatron-LM, Yao et al. 2022 for random-LTD, Zou et al. 2024 for the V-cycle); norms,
activations and softmax are ignored.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Literal
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

Head = Literal["lm", "mlm", "cls", "none"]


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
    ``2*2*T*H`` (counted over the full T x T square, as ``torch.utils.flop_counter`` counts attention, causal or not).
    Heads: ``lm`` = tied or untied vocabulary projection on every token (``2*H*V``); ``mlm`` = BERT's transform
    (``2*H^2``) plus the vocabulary projection on every token; ``cls`` = pooler (``2*H^2``) plus classifier
    (``2*H*C``) once per sequence; ``none`` = no head. Embedding lookups cost 0.

    Args:
        batch_size: B, sequences per batch. seq_len: T, tokens per sequence (padded length: padding is computed).
        n_layer: L. hidden: H. intermediate: I (default 4H). vocab_size: V. num_classes: C (``cls`` head).

    Returns:
        FLOPs as a Python int. Raises ``ValueError`` for negative sizes or an unknown head.
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


def transformer_training_flops(*args: Any, **kwargs: Any) -> int:
    """Forward + backward FLOPs: ``3 * transformer_forward_flops(...)`` (same arguments)."""
    return 3 * transformer_forward_flops(*args, **kwargs)


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
    back to a CPU copy when the model's forward needs real values (data-dependent control flow).
    """
    for device in ("meta", "cpu"):
        try:
            clone = copy.deepcopy(model).to(device)
            clone.train(model.training)
            fake = {
                k: (torch.zeros_like(v, device=device) if v.is_floating_point() else torch.ones_like(v, device=device))
                for k, v in inputs.items()
            }
            with FlopCounterMode(display=False) as counter:
                _scalar(clone(**fake)).backward()  # type: ignore[no-untyped-call]
            return int(counter.get_total_flops())
        except (NotImplementedError, RuntimeError):
            if device == "cpu":
                raise
    raise AssertionError("unreachable")


_CACHE: WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], int]] = WeakKeyDictionary()


def measured_training_flops(model: nn.Module, inputs: Mapping[str, Tensor]) -> int:
    """:func:`count_training_flops`, cached per model and input shapes (a new shape is measured once)."""
    key = tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in inputs.items()))
    per_model = _CACHE.setdefault(model, {})
    if key not in per_model:
        per_model[key] = count_training_flops(model, inputs)
    return per_model[key]
