"""Index transport and the sample-length protocol (``docs/architecture.md``, "Stable index and sample length").

A sample's index is its position in the DataModule's ``train_dataset``. :class:`IndexedDataset` pairs every sample,
of any structure, with it; :class:`indexed_collate` collates the samples with the user's collate function and returns
an :class:`~lightning_effi.core.batch.EffiBatch`: the user's batch unchanged, and ``meta["index"]``: int64 ``[B]``.
Indices stay Python ints until they become an int64 tensor, so they never pass through a float tensor (exact beyond
2**24 / 2**53).
"""

from __future__ import annotations

import contextlib
import operator
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Subset, default_collate

from lightning_effi.core.batch import EffiBatch
from lightning_effi.core.errors import DataConfigError
from lightning_effi.core.measure import tensor_leaves

__all__ = ["IndexedDataset", "collate_reorders", "indexed_collate", "sequence_lengths"]

#: the ``EffiBatch.meta`` key of the dataset indices
INDEX_KEY = "index"

#: the first batches of a loader (in each worker) whose collate is checked for reordered rows
#: (:func:`collate_reorders`): a batch whose samples all sort alike (documents cut to one length) keeps its order
#: under a sorting collate and tells nothing (qa46-break 02)
ORDER_CHECKS = 8


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
        self._order_checks = ORDER_CHECKS  # its first batches are checked (collate_reorders; in each loader worker)

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
        if self._order_checks > 0 and self.collate_fn is not None:
            self._order_checks -= 1
            if collate_reorders(self.collate_fn, samples, batch):
                raise DataConfigError(reorder_message(self.collate_fn))
        return EffiBatch(batch, {INDEX_KEY: torch.tensor(indices, dtype=torch.int64)})

    def __repr__(self) -> str:
        return f"indexed_collate({self.collate_fn!r})"


def _row_keys(batch: Any, b: int) -> tuple[list[tuple[Any, ...]], list[tuple[bytes, ...]]]:
    """The batch's ``[b, ...]`` tensors (path, shape, dtype) and each of its ``b`` rows as the bytes of those tensors'
    rows."""
    found: list[tuple[Any, ...]] = []
    rows: list[list[bytes]] = [[] for _ in range(b)]
    for path, v in tensor_leaves(batch):
        if v.ndim == 0 or v.shape[0] != b or v.numel() == 0 or v.layout != torch.strided or v.is_meta:
            continue
        if getattr(v, "is_nested", False):
            continue
        raw = v.detach().cpu().contiguous().reshape(b, -1).view(torch.uint8).numpy()
        found.append((path, tuple(v.shape), v.dtype))
        for i in range(b):
            rows[i].append(raw[i].tobytes())
    return found, [tuple(r) for r in rows]


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """Put back the CPU random states (torch, ``random``, NumPy's global one) a probe used, so that the probe changes
    no draw of the run."""
    state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(state)
            np.random.set_state(np_state)


def collate_reorders(collate_fn: Callable[[list[Any]], Any], samples: Sequence[Any], batch: Any) -> bool:
    """Whether ``collate_fn`` puts the samples in another order than it was given them (a collate that sorts them by
    length for ``pack_padded_sequence(enforce_sorted=True)``, or buckets them): ``batch`` is ``collate_fn(samples)``;
    the samples are collated again in reverse order (the random states put back after), and the batch's
    ``[B, ...]`` tensors' rows compared. True when the rows come back the same but not reversed, and the first sample
    collated ``B`` times gives ``B`` equal rows (the rows follow the samples); False when they come back reversed
    (the order kept), when their content differs (a random transform in the collate), when rows do not follow the
    samples, or when nothing can be compared (one row, rows all equal, no ``[B, ...]`` tensor, a collate that
    raises). A collate that draws at random per sample before it sorts (a random crop) gives other rows in reverse
    order and is not told; one with a random generator or counter of its own sees them advance by the probes.

    InfoBatch scores and weighs row ``k`` as the ``k``-th sample drawn: a collate that reorders the rows would send
    every score and ``1/(1-r)`` weight to another sample, in silence (qa45-break 01: 20 of 24 scores were another
    sample's loss).
    """
    b = len(samples)
    if b < 2:
        return False
    found, rows = _row_keys(batch, b)
    if not found or len(set(rows)) < 2:
        return False
    try:
        with _random_state_kept():
            again = collate_fn(list(samples)[::-1])
    except Exception:  # noqa: BLE001 - the user's collate: its own errors are the loader's to raise
        return False
    found_again, rows_again = _row_keys(again, b)
    if found_again != found or rows_again == rows[::-1] or sorted(rows_again) != sorted(rows):
        return False
    try:  # the rows follow the samples: one sample b times gives b equal rows (not rows made whatever the samples)
        with _random_state_kept():
            _, rows_one = _row_keys(collate_fn([samples[0]] * b), b)
    except Exception:  # noqa: BLE001
        return False
    return len(set(rows_one)) == 1


def reorder_message(collate_fn: Any) -> str:
    """The error for a collate that reorders the samples (:func:`collate_reorders`)."""
    name = getattr(collate_fn, "__qualname__", type(collate_fn).__name__)
    return (
        f"InfoBatchCallback: the training loader's collate_fn ({name}) puts the samples of a batch in another order "
        "than it is given them (it sorts them, e.g. by length for pack_padded_sequence). InfoBatch scores and weighs "
        "each row of the batch as the sample drawn at its position, so every score and 1/(1-r) weight would go to "
        "another sample. Keep the samples' order in the collate: pack_padded_sequence(..., enforce_sorted=False) "
        "sorts inside and gives the outputs back in the batch's order"
    )


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
