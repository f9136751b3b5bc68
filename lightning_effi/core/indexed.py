"""Index transport and the sample-length protocol (``docs/architecture.md``, "Stable index and sample length").

A sample's index is its position in the DataModule's ``train_dataset``. :class:`IndexedDataset` adds it to every
(dict) sample, :class:`indexed_collate` turns the indices into ``batch["index"]: int64[B]``. Indices stay Python
ints until they become an int64 tensor, so they never pass through a float tensor (exact beyond 2**24 / 2**53).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Subset, default_collate

__all__ = ["IndexedDataset", "indexed_collate", "sequence_lengths"]


def _check_key(index_key: Any) -> str:
    if not isinstance(index_key, str):
        raise TypeError(f"index_key must be a str; got {index_key!r}")
    return index_key


def _check_sample(sample: Any, index: int) -> dict[str, Any]:
    if not isinstance(sample, Mapping):
        raise TypeError(f"IndexedDataset needs dict samples; sample {index} is a {type(sample).__name__}")
    return dict(sample)


class IndexedDataset(Dataset[dict[str, Any]]):
    """Map-style wrapper returning ``{**dataset[i], index_key: i}`` (a copy; the wrapped sample is not mutated).

    Args:
        dataset: a map-style dataset with ``__len__`` whose samples are dicts (``Mapping``).
        index_key: key under which the index (a Python ``int``) is stored.

    Raises:
        TypeError: ``dataset`` is an ``IterableDataset`` or has no ``__len__``; ``index_key`` is not a str; an index
            is not an integer (``int``, NumPy or 0-dim torch integer; not ``bool`` or ``float``); a sample is not a
            dict; the sample already contains ``index_key``.
        IndexError: an index outside ``[-len, len)``. A negative index is normalised first, so the stored index is
            always the sample's position in ``[0, len)``.

    The wrapped dataset is available as ``.dataset``; attributes are not delegated. ``__getitems__`` uses the wrapped
    dataset's batched ``__getitems__`` when it has one, and pairs every sample with its own index.
    """

    def __init__(self, dataset: Dataset[Any], index_key: str = "index") -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError("IndexedDataset needs a map-style dataset; got an IterableDataset (no stable index)")
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(f"IndexedDataset needs a map-style dataset with __len__; got {type(dataset).__name__}")
        self.dataset = dataset
        self.index_key = _check_key(index_key)

    def __len__(self) -> int:
        return len(self.dataset)

    def _with_index(self, sample: Any, index: int) -> dict[str, Any]:
        out = _check_sample(sample, index)
        if self.index_key in out:
            raise TypeError(f"sample {index} already has a key {self.index_key!r}; choose another index_key")
        out[self.index_key] = index
        return out

    def _position(self, index: Any, n: int) -> int:
        """``index`` as the position in ``[0, n)``: integers only, negative ones counted from the end."""
        if isinstance(index, (bool, np.bool_)):
            raise TypeError(f"IndexedDataset index must be an integer; got {index!r}")
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"IndexedDataset index must be an integer; got {type(index).__name__} {index!r}") from None
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n} samples")
        return i + n if i < 0 else i

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = self._position(index, len(self.dataset))
        return self._with_index(self.dataset[index], index)

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        n = len(self.dataset)
        indices = [self._position(i, n) for i in indices]
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        if len(samples) != len(indices):
            raise TypeError(
                f"{type(self.dataset).__name__}.__getitems__ returned {len(samples)} samples for {len(indices)} indices"
            )
        return [self._with_index(s, i) for s, i in zip(samples, indices)]

    def sequence_lengths(self) -> np.ndarray | None:
        return sequence_lengths(self.dataset)

    def __repr__(self) -> str:
        return f"IndexedDataset({self.dataset!r}, index_key={self.index_key!r})"


class indexed_collate:  # noqa: N801 - used like a function: indexed_collate(collate_fn)
    """Collate function for :class:`IndexedDataset` samples: pops ``index_key`` from each sample, collates the rest
    with ``collate_fn`` (default ``torch.utils.data.default_collate``) and sets ``batch[index_key] = int64[B]``.

    Picklable (a class, not a closure), so it works with DataLoader workers under any start method.

    Raises:
        KeyError: a sample lacks ``index_key``.
        TypeError: ``collate_fn`` does not return a dict; ``index_key`` is not a str.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None = None, index_key: str = "index"):
        self.collate_fn = collate_fn
        self.index_key = _check_key(index_key)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        indices, rest = [], []
        for sample in samples:
            sample = dict(sample)
            indices.append(int(sample.pop(self.index_key)))
            rest.append(sample)
        batch = (self.collate_fn or default_collate)(rest)
        if not isinstance(batch, dict):
            raise TypeError(f"indexed_collate needs collate_fn to return a dict batch; got {type(batch).__name__}")
        batch[self.index_key] = torch.tensor(indices, dtype=torch.int64)
        return batch

    def __repr__(self) -> str:
        return f"indexed_collate({self.collate_fn!r}, index_key={self.index_key!r})"


def sequence_lengths(dataset: Any) -> np.ndarray | None:
    """Length in tokens (before padding) of every sample of ``dataset`` as ``int64[len(dataset)]``, or ``None``.

    Uses ``dataset.sequence_lengths()`` when defined (shipped text datasets, vectorised), follows
    ``torch.utils.data.Subset`` (indexing the base lengths) and :class:`IndexedDataset`; image datasets and
    anything else give ``None``.
    """
    if isinstance(dataset, Subset):
        base = sequence_lengths(dataset.dataset)
        return None if base is None else base[np.asarray(dataset.indices, dtype=np.int64)]
    fn = getattr(dataset, "sequence_lengths", None)
    if fn is None:
        return None
    lengths = fn()
    return None if lengths is None else np.asarray(lengths, dtype=np.int64)
