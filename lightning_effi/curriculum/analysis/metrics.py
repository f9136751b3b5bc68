"""Analyzer metrics (Megatron-DeepSpeed ``examples_deepspeed/data_efficiency/{bert,gpt}/analyze_data.py``) and a
name registry usable from Hydra configs. The method card is ``lightning_effi/curriculum/README.md``.

A metric is a callable ``fn(batch) -> values``:

- ``single_value_per_sample``: integer array/tensor of shape ``(B,)``, one value per sample;
- ``accumulate_value_over_samples``: integer array/tensor of a fixed shape (e.g. ``(V+1,)``), summed over batches.

Batch convention (``key`` argument, default ``"input_ids"``), the batch structures the curriculum accepts
(:func:`lightning_effi.core.measure.leaves`): a tensor/ndarray batch is the token matrix itself; a batch with names
(any ``Mapping``: ``dict``, HF ``BatchEncoding``, which is a ``UserDict``; a dataclass; nested in tuples) gives its
entry named ``key`` (the house default); a tuple/list batch without that name gives its first integer (not bool)
``[B, T]`` tensor/ndarray (the token ids of ``(ids, labels)``). Token matrices are ``[B, T]`` integers. Padding: when
the batch has an entry named ``mask_key`` (default ``"attention_mask"``, 1 = real token) it is used; otherwise tokens
equal to ``pad_token_id`` are padding (``pad_token_id=None``: no padding). A batch with no such tokens raises a
``KeyError`` (a mapping or dataclass without ``key``) or a ``TypeError`` naming the metric and what the batch holds.

Built-in metrics are picklable classes (they work with spawned worker processes). Registry: ``register_metric(name,
fn)`` (or as a decorator), ``get_metric(name, **options)``, ``registered_metrics()``; the built-ins are registered as
factories, so ``get_metric("seqlen", pad_token_id=0)`` builds ``SeqLen(pad_token_id=0)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from lightning_effi.core.checks import is_int
from lightning_effi.core.measure import leaves

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


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or (hasattr(x, "detach") and hasattr(x, "cpu") and hasattr(x, "shape"))


def _is_id_matrix(x: Any) -> bool:
    """An integer (not bool) ``[B, T]`` tensor / ndarray."""
    if not _is_array(x) or len(x.shape) != 2:
        return False
    if isinstance(x, np.ndarray):
        return x.dtype.kind in "iu"
    return not x.is_floating_point() and not x.is_complex() and str(x.dtype) != "torch.bool"


def _describe(batch: Any) -> str:
    """What a batch holds, for error messages: its leaves' paths with their types and shapes (at most 8)."""
    found = []
    for path, value in leaves(batch):
        where = "".join(f"[{p!r}]" for p in path) or "<batch>"
        shape = f" {list(value.shape)} {value.dtype}" if _is_array(value) else ""
        found.append(f"{where}: {type(value).__name__}{shape}")
    more = f", ... ({len(found) - 8} more)" if len(found) > 8 else ""
    return ", ".join(found[:8]) + more if found else "nothing"


def _named_leaf(batch: Any, name: str) -> tuple[bool, Any]:
    """``(found, value)`` of the entry named ``name``: a key of a mapping or a field of a dataclass, the outermost
    first, then nested ones in order (inside mappings, dataclasses, tuples and lists)."""
    if isinstance(batch, Mapping):
        if name in batch:
            return True, batch[name]
        children: Any = batch.values()
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        if name in {f.name for f in dataclasses.fields(batch)}:
            return True, getattr(batch, name)
        children = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif isinstance(batch, (tuple, list)):
        children = batch
    else:
        return False, None
    for child in children:
        found, value = _named_leaf(child, name)
        if found:
            return True, value
    return False, None


def _tokens_and_mask(
    batch: Any, key: str, mask_key: str | None, pad_token_id: int | None, metric: str = "metric"
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(tokens[B,T], mask[B,T] bool or None)`` from a batch of any structure the curriculum accepts (module
    docstring); errors name ``metric`` and what the batch holds."""
    mask = None
    kind = type(batch).__name__
    if _is_array(batch):
        tokens = _to_numpy(batch, f"{metric}: batch")
    else:
        has_key, value = _named_leaf(batch, key)
        if has_key:
            tokens = _to_numpy(value, f"{metric}: batch[{key!r}] of the {kind} batch")
        elif isinstance(batch, (tuple, list)):
            ids = next((v for _, v in leaves(batch) if _is_id_matrix(v)), None)
            if ids is None:
                raise TypeError(
                    f"{metric}: the {kind} batch has no entry named {key!r} and no integer [B, T] tensor of token ids "
                    f"(found {_describe(batch)}); pass the metric key=<the name of the token ids> or collate them "
                    "into the batch"
                )
            tokens = _to_numpy(ids, f"{metric}: the token ids of the {kind} batch")
        elif isinstance(batch, Mapping) or (dataclasses.is_dataclass(batch) and not isinstance(batch, type)):
            names = (
                sorted(map(str, batch)) if isinstance(batch, Mapping) else [f.name for f in dataclasses.fields(batch)]
            )
            raise KeyError(
                f"{metric}: the {kind} batch has no key {key!r} (keys: {names}); set the metric's key=... to the name "
                "of the token ids"
            )
        else:
            raise TypeError(
                f"{metric}: expected a batch of token ids (a tensor / ndarray [B, T], a mapping such as a dict or "
                f"BatchEncoding, a dataclass, or a tuple / list holding an integer [B, T] tensor); got a {kind} "
                f"(found {_describe(batch)})"
            )
        if mask_key is not None:
            has_mask, value = _named_leaf(batch, mask_key)
            if has_mask:
                mask = _to_numpy(value, f"{metric}: batch[{mask_key!r}] of the {kind} batch").astype(bool)
    if tokens.ndim != 2:
        raise ValueError(f"{metric}: token batch must be [B, T]; got shape {tokens.shape}")
    if tokens.dtype.kind not in "iu":
        raise TypeError(f"{metric}: token ids must be integers; got {tokens.dtype}")
    if mask is not None and mask.shape != tokens.shape:
        raise ValueError(f"{metric}: {mask_key} shape {mask.shape} differs from {key} shape {tokens.shape}")
    if mask is None and pad_token_id is not None:
        mask = tokens != pad_token_id
    return tokens, mask


@dataclass(frozen=True)
class SeqLen:
    """``seqlen``: number of non-padding tokens per sample, ``int64[B]`` (``count_nonzero(mask, dim=1)``).

    Uses ``batch[mask_key]`` when present, else ``tokens != pad_token_id``; ``pad_token_id=None`` and no mask gives
    the full width ``T``.
    """

    metric_name: ClassVar[str] = "seqlen"
    pad_token_id: int | None = 0
    key: str = "input_ids"
    mask_key: str | None = "attention_mask"

    def __call__(self, batch: Any) -> np.ndarray:
        tokens, mask = _tokens_and_mask(batch, self.key, self.mask_key, self.pad_token_id, self.metric_name)
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

    metric_name: ClassVar[str] = "total_vocab_freq"
    vocab_size: int
    key: str = "input_ids"
    mask_key: str | None = "attention_mask"
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.vocab_size) or self.vocab_size < 1:
            raise ValueError(f"total_vocab_freq: vocab_size must be a positive int; got {self.vocab_size!r}")
        object.__setattr__(self, "vocab_size", int(self.vocab_size))

    def __call__(self, batch: Any) -> np.ndarray:
        tokens, mask = _tokens_and_mask(batch, self.key, self.mask_key, self.pad_token_id, self.metric_name)
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

    metric_name: ClassVar[str] = "vocab_rarity"

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
        tokens, mask = _tokens_and_mask(batch, self.key, self.mask_key, self.pad_token_id, self.metric_name)
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

    metric_name: ClassVar[str] = "seqlen_vocab_rarity"

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
        tokens, _ = _tokens_and_mask(batch, self.key, self.mask_key, self.pad_token_id, self.metric_name)
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
