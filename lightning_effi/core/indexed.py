"""Index transport and the sample-length protocol (``docs/architecture.md``, "Stable index and sample length").

A sample's index is its position in the DataModule's ``train_dataset``. :class:`IndexedDataset` pairs every sample,
of any structure, with it; :class:`indexed_collate` collates the samples with the user's collate function and returns
an :class:`~lightning_effi.core.batch.EffiBatch`: the user's batch unchanged, and ``meta["index"]``: int64 ``[B]``.
Indices stay Python ints until they become an int64 tensor, so they never pass through a float tensor (exact beyond
2**24 / 2**53).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Subset, default_collate

from lightning_effi.core.batch import EffiBatch

__all__ = ["IndexedDataset", "indexed_collate", "sequence_lengths"]

#: the ``EffiBatch.meta`` key of the dataset indices
INDEX_KEY = "index"


class IndexedDataset(Dataset[tuple[int, Any]]):
    """Map-style wrapper returning ``(i, dataset[i])``: the sample's index and the sample, of any structure (a
    tensor, a tuple ``(x, y)``, a dict, a dataclass...), unchanged.

    Args:
        dataset: a map-style dataset with ``__len__``.

    Raises:
        TypeError: ``dataset`` is an ``IterableDataset`` or has no ``__len__``; an index is not an integer (``int``,
            NumPy or 0-dim torch integer; not ``bool`` or ``float``).
        IndexError: an index outside ``[-len, len)``. A negative index is normalised first, so the stored index is
            always the sample's position in ``[0, len)``.

    The wrapped dataset is available as ``.dataset``; attributes are not delegated. ``__getitems__`` uses the wrapped
    dataset's batched ``__getitems__`` when it has one, and pairs every sample with its own index.
    """

    def __init__(self, dataset: Dataset[Any]) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError("IndexedDataset needs a map-style dataset; got an IterableDataset (no stable index)")
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(f"IndexedDataset needs a map-style dataset with __len__; got {type(dataset).__name__}")
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

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

    def __getitem__(self, index: int) -> tuple[int, Any]:
        index = self._position(index, len(self.dataset))
        return index, self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[int, Any]]:
        n = len(self.dataset)
        indices = [self._position(i, n) for i in indices]
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        if len(samples) != len(indices):
            raise TypeError(
                f"{type(self.dataset).__name__}.__getitems__ returned {len(samples)} samples for {len(indices)} indices"
            )
        return list(zip(indices, samples))

    def sequence_lengths(self) -> np.ndarray | None:
        return sequence_lengths(self.dataset)

    def __repr__(self) -> str:
        return f"IndexedDataset({self.dataset!r})"


class indexed_collate:  # noqa: N801 - used like a function: indexed_collate(collate_fn)
    """Collate function for :class:`IndexedDataset` items ``(index, sample)``: collates the samples with
    ``collate_fn`` (default ``torch.utils.data.default_collate``) and returns ``EffiBatch(batch, {"index":
    int64[B]})`` (:class:`~lightning_effi.core.batch.EffiBatch`); the user's batch is whatever ``collate_fn`` returns.

    Picklable (a class, not a closure), so it works with DataLoader workers under any start method.

    Raises:
        TypeError: an item is not an ``(index, sample)`` pair of :class:`IndexedDataset`.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None = None):
        self.collate_fn = collate_fn

    def __call__(self, items: Sequence[tuple[int, Any]]) -> EffiBatch:
        indices, samples = [], []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int)):
                raise TypeError(
                    f"indexed_collate needs the (index, sample) pairs of an IndexedDataset; got a {type(item).__name__}"
                )
            indices.append(item[0])
            samples.append(item[1])
        batch = (self.collate_fn or default_collate)(samples)
        return EffiBatch(batch, {INDEX_KEY: torch.tensor(indices, dtype=torch.int64)})

    def __repr__(self) -> str:
        return f"indexed_collate({self.collate_fn!r})"


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
