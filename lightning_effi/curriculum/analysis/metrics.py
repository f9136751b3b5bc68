"""Analyzer metrics (Megatron-DeepSpeed ``examples_deepspeed/data_efficiency/{bert,gpt}/analyze_data.py``) and a
name registry usable from Hydra configs. The method card is ``lightning_effi/curriculum/README.md``.

A metric is a callable ``fn(batch) -> values``:

- ``single_value_per_sample``: integer array/tensor of shape ``(B,)``, one value per sample;
- ``accumulate_value_over_samples``: integer array/tensor of a fixed shape (e.g. ``(V+1,)``), summed over batches.

Batch convention (``key`` argument, default ``"input_ids"``): a dict batch gives ``batch[key]`` (the house default);
a tensor/ndarray batch is the token matrix itself; a tuple/list batch gives its first field. Token matrices are
``[B, T]`` integers. Padding: when the dict batch has ``mask_key`` (default ``"attention_mask"``, 1 = real token) it
is used; otherwise tokens equal to ``pad_token_id`` are padding (``pad_token_id=None``: no padding).

Built-in metrics are picklable classes (they work with spawned worker processes). Registry: ``register_metric(name,
fn)`` (or as a decorator), ``get_metric(name, **options)``, ``registered_metrics()``; the built-ins are registered as
factories, so ``get_metric("seqlen", pad_token_id=0)`` builds ``SeqLen(pad_token_id=0)``.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_effi.core.checks import is_int

__all__ = [
    "METRIC_TYPES",
    "SeqLen",
    "SeqLenVocabRarity",
    "TotalVocabFreq",
    "VocabRarity",
    "get_metric",
    "load_vocab_freq",
    "register_metric",
    "registered_metrics",
    "seqlen",
    "seqlen_vocab_rarity",
    "total_vocab_freq",
    "vocab_rarity",
    "vocab_rarity_table",
]

METRIC_TYPES = ("single_value_per_sample", "accumulate_value_over_samples")


def _to_numpy(x: Any, what: str) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    raise TypeError(f"{what}: expected a tensor or ndarray, got {type(x).__name__}")


def _tokens_and_mask(
    batch: Any, key: str, mask_key: str | None, pad_token_id: int | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(tokens[B,T], mask[B,T] bool or None)`` from a dict / tensor / tuple batch (module docstring)."""
    mask = None
    if isinstance(batch, dict):
        if key not in batch:
            raise KeyError(f"metric: batch has no key {key!r} (keys: {sorted(batch)}); set key=...")
        tokens = _to_numpy(batch[key], f"batch[{key!r}]")
        if mask_key is not None and mask_key in batch:
            mask = _to_numpy(batch[mask_key], f"batch[{mask_key!r}]").astype(bool)
    elif isinstance(batch, (tuple, list)):
        if not batch:
            raise ValueError("metric: empty tuple/list batch")
        tokens = _to_numpy(batch[0], "batch[0]")
    else:
        tokens = _to_numpy(batch, "batch")
    if tokens.ndim != 2:
        raise ValueError(f"metric: token batch must be [B, T]; got shape {tokens.shape}")
    if tokens.dtype.kind not in "iu":
        raise TypeError(f"metric: token ids must be integers; got {tokens.dtype}")
    if mask is not None and mask.shape != tokens.shape:
        raise ValueError(f"metric: {mask_key} shape {mask.shape} differs from {key} shape {tokens.shape}")
    if mask is None and pad_token_id is not None:
        mask = tokens != pad_token_id
    return tokens, mask


@dataclass(frozen=True)
class SeqLen:
    """``seqlen``: number of non-padding tokens per sample, ``int64[B]`` (``count_nonzero(mask, dim=1)``).

    Uses ``batch[mask_key]`` when present, else ``tokens != pad_token_id``; ``pad_token_id=None`` and no mask gives
    the full width ``T``.
    """

    pad_token_id: int | None = 0
    key: str = "input_ids"
    mask_key: str | None = "attention_mask"

    def __call__(self, batch: Any) -> np.ndarray:
        tokens, mask = _tokens_and_mask(batch, self.key, self.mask_key, self.pad_token_id)
        if mask is None:
            return np.full(tokens.shape[0], tokens.shape[1], dtype=np.int64)
        return np.count_nonzero(mask, axis=1).astype(np.int64)


@dataclass(frozen=True)
class TotalVocabFreq:
    """``total_vocab_freq`` (accumulate): ``bincount(tokens, minlength=V+1)`` over the non-padding tokens,
    ``int64[vocab_size + 1]`` per batch (summed by the analyzer into one vector).

    Raises:
        ValueError: a token id outside ``[0, vocab_size]`` (the vector would change shape).
    """

    vocab_size: int
    key: str = "input_ids"
    mask_key: str | None = "attention_mask"
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.vocab_size) or self.vocab_size < 1:
            raise ValueError(f"total_vocab_freq: vocab_size must be a positive int; got {self.vocab_size!r}")
        object.__setattr__(self, "vocab_size", int(self.vocab_size))

    def __call__(self, batch: Any) -> np.ndarray:
        tokens, mask = _tokens_and_mask(batch, self.key, self.mask_key, self.pad_token_id)
        flat = tokens[mask] if mask is not None else tokens.reshape(-1)
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) > self.vocab_size):
            raise ValueError(
                f"total_vocab_freq: token ids must be in [0, vocab_size={self.vocab_size}]; got "
                f"[{int(flat.min())}, {int(flat.max())}]"
            )
        return np.bincount(flat.astype(np.int64), minlength=self.vocab_size + 1).astype(np.int64)


def load_vocab_freq(freq: Any) -> np.ndarray:
    """The frequency vector ``f`` as ``int64[V+1]``: an array/tensor, or the path prefix of an analyzer
    ``total_vocab_freq_metric_value`` file (``save_path/total_vocab_freq/total_vocab_freq_metric_value``)."""
    if isinstance(freq, (str, os.PathLike)):
        from .indexed_dataset import MMapIndexedDataset

        ds = MMapIndexedDataset(freq)
        if len(ds) != 1:
            raise ValueError(f"'{os.fspath(freq)}': a metric_value file has exactly one item; got {len(ds)}")
        freq = np.array(ds[0])
    arr = _to_numpy(freq, "freq") if not isinstance(freq, (list, tuple)) else np.asarray(freq)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"vocab frequency must be a non-empty 1-D vector; got shape {arr.shape}")
    if np.any(arr < 0):
        raise ValueError("vocab frequency must be non-negative")
    return arr.astype(np.int64)


def vocab_rarity_table(freq: Any) -> np.ndarray:
    """``ρ[v] = −ln(f[v] / Σf)`` as float64, zero counts replaced by 1 first (Megatron ``analyze_data.py``: ``f[f ==
    0] = 1; ρ = −log(f / sum(f))``)."""
    f = load_vocab_freq(freq).astype(np.float64)
    f[f == 0] = 1
    return -np.log(f / f.sum())


class VocabRarity:
    """``vocab_rarity`` ("voc"): per sample, the **sum** of ``ρ`` over its (non-padding) tokens in float64, truncated
    to int64 (larger = harder). ``freq``: the ``total_vocab_freq`` vector or its file prefix (two-pass analysis).
    GPT data (fixed length, no mask, ``pad_token_id=None``) sums all tokens."""

    def __init__(
        self,
        freq: Any,
        key: str = "input_ids",
        mask_key: str | None = "attention_mask",
        pad_token_id: int | None = None,
    ):
        self.freq_source = freq if isinstance(freq, (str, os.PathLike)) else None
        self.rarity = vocab_rarity_table(freq)
        self.key, self.mask_key, self.pad_token_id = key, mask_key, pad_token_id

    def _rarity_sum(self, batch: Any) -> tuple[np.ndarray, np.ndarray | None]:
        tokens, mask = _tokens_and_mask(batch, self.key, self.mask_key, self.pad_token_id)
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= len(self.rarity)):
            raise ValueError(
                f"vocab_rarity: token ids must be in [0, {len(self.rarity)}) (the frequency vector's "
                f"length); got [{int(tokens.min())}, {int(tokens.max())}]"
            )
        r = self.rarity[tokens]
        if mask is not None:
            r = r * mask
        return r.sum(axis=1), mask

    def __call__(self, batch: Any) -> np.ndarray:
        return self._rarity_sum(batch)[0].astype(np.int64)


class SeqLenVocabRarity(VocabRarity):
    """``seqlen_vocab_rarity`` (BERT): ``seqlen·C + vocab_rarity`` with ``C = 10^(ceil(log10(seq_length · max ρ)) +
    1)`` so that length dominates and rarity breaks ties. ``seq_length``: the model's maximum sequence length."""

    def __init__(
        self,
        freq: Any,
        seq_length: int,
        key: str = "input_ids",
        mask_key: str | None = "attention_mask",
        pad_token_id: int | None = 0,
    ):
        super().__init__(freq, key, mask_key, pad_token_id)
        if not is_int(seq_length) or seq_length < 1:
            raise ValueError(f"seqlen_vocab_rarity: seq_length must be a positive int; got {seq_length!r}")
        self.seq_length = int(seq_length)
        max_possible = self.seq_length * float(self.rarity.max())
        self.coeff = 10 ** (math.ceil(math.log10(max_possible)) + 1) if max_possible > 0 else 1

    def __call__(self, batch: Any) -> np.ndarray:
        rarity, mask = self._rarity_sum(batch)
        tokens, _ = _tokens_and_mask(batch, self.key, self.mask_key, self.pad_token_id)
        lengths = (
            np.count_nonzero(mask, axis=1) if mask is not None else np.full(tokens.shape[0], tokens.shape[1])
        ).astype(np.int64)
        return lengths * np.int64(self.coeff) + rarity.astype(np.int64)


def seqlen(pad_token_id: int | None = 0, key: str = "input_ids", mask_key: str | None = "attention_mask") -> SeqLen:
    """Factory of the ``seqlen`` metric (:class:`SeqLen`)."""
    return SeqLen(pad_token_id, key, mask_key)


def total_vocab_freq(
    vocab_size: int, key: str = "input_ids", mask_key: str | None = "attention_mask", pad_token_id: int | None = None
) -> TotalVocabFreq:
    """Factory of the ``total_vocab_freq`` accumulate metric (:class:`TotalVocabFreq`)."""
    return TotalVocabFreq(vocab_size, key, mask_key, pad_token_id)


def vocab_rarity(
    freq: Any, key: str = "input_ids", mask_key: str | None = "attention_mask", pad_token_id: int | None = None
) -> VocabRarity:
    """Factory of the ``vocab_rarity`` metric (:class:`VocabRarity`)."""
    return VocabRarity(freq, key, mask_key, pad_token_id)


def seqlen_vocab_rarity(
    freq: Any,
    seq_length: int,
    key: str = "input_ids",
    mask_key: str | None = "attention_mask",
    pad_token_id: int | None = 0,
) -> SeqLenVocabRarity:
    """Factory of the ``seqlen_vocab_rarity`` metric (:class:`SeqLenVocabRarity`)."""
    return SeqLenVocabRarity(freq, seq_length, key, mask_key, pad_token_id)


@dataclass(frozen=True)
class _Entry:
    fn: Callable
    metric_type: str
    factory: bool


_REGISTRY: dict[str, _Entry] = {}


def register_metric(
    name: str,
    fn: Callable | None = None,
    *,
    metric_type: str = "single_value_per_sample",
    factory: bool = False,
    overwrite: bool = False,
) -> Callable:
    """Register ``fn`` under ``name`` (returns ``fn``; without ``fn`` it is a decorator).

    Args:
        name: registry name (what a Hydra config lists).
        fn: a metric ``fn(batch) -> values`` or, with ``factory=True``, a callable ``fn(**options) -> metric``.
        metric_type: ``"single_value_per_sample"`` or ``"accumulate_value_over_samples"``.
        factory: whether ``fn`` builds the metric from options.
        overwrite: allow replacing an existing name.

    Raises:
        ValueError: empty name, name already registered (without ``overwrite``), unknown ``metric_type``.
        TypeError: ``fn`` not callable.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_metric: name must be a non-empty str; got {name!r}")
    if metric_type not in METRIC_TYPES:
        raise ValueError(f"register_metric: metric_type must be one of {METRIC_TYPES}; got {metric_type!r}")

    def decorator(f: Callable) -> Callable:
        if not callable(f):
            raise TypeError(f"register_metric({name!r}): {f!r} is not callable")
        if name in _REGISTRY and not overwrite and _REGISTRY[name].fn is not f:
            raise ValueError(f"register_metric: {name!r} is already registered; pass overwrite=True to replace it")
        _REGISTRY[name] = _Entry(f, metric_type, factory)
        return f

    return decorator if fn is None else decorator(fn)


def get_metric(name: str, **options: Any) -> Callable:
    """The metric registered as ``name``: a factory is called with ``options``; a plain function is returned as is
    (or as ``functools.partial(fn, **options)`` when options are given).

    Raises:
        KeyError: unknown name (the message lists the registered names).
    """
    if name not in _REGISTRY:
        raise KeyError(
            f"unknown metric {name!r}; registered metrics: {sorted(_REGISTRY)} (add one with "
            "lightning_effi.curriculum.analysis.register_metric)"
        )
    entry = _REGISTRY[name]
    if entry.factory:
        return entry.fn(**options)
    return functools.partial(entry.fn, **options) if options else entry.fn


def registered_metrics() -> dict[str, str]:
    """``{name: metric_type}`` of every registered metric."""
    return {name: e.metric_type for name, e in sorted(_REGISTRY.items())}


register_metric("seqlen", seqlen, factory=True)
register_metric("total_vocab_freq", total_vocab_freq, metric_type="accumulate_value_over_samples", factory=True)
register_metric("vocab_rarity", vocab_rarity, factory=True)
register_metric("seqlen_vocab_rarity", seqlen_vocab_rarity, factory=True)
