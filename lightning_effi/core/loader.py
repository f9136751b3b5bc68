"""A training loader that resumes exactly, mid-epoch, under one process or DDP.

Lightning 2.6 resumes a plain map-style loader mid-epoch from a *fresh* iterator: the resumed epoch replays the first
batches and never sees its tail (pinned in ``tests/framework/test_lightning_facts.py``). A loader object with
``state_dict()/load_state_dict()`` is saved with the loop state and restored before ``iter()``; its ``len()`` must
stay the full epoch length. :class:`ResumableDataLoader` does this:

- its sampler is a :class:`EpochShuffleSampler`, a ``DistributedSampler`` subclass (Lightning leaves those alone
  under DDP) whose order is a pure function of ``(seed, epoch)`` and which shards itself by rank;
- it counts the batches it has handed out in the current epoch; ``state_dict()`` returns ``{"epoch", "batches"}``
  (plain ints: safe for ``torch.load(weights_only=True)``);
- after ``load_state_dict`` the next iteration skips the consumed samples *in the sampler* (no sample is loaded
  twice) and still reports the full length.

Lightning rebuilds a training loader with another sampler in a few places (``Trainer(overfit_batches=...)`` puts a
``SequentialSampler`` in, so that every epoch trains the same first batches): a sampler without a skippable start is
wrapped in a :class:`SkippableSampler`, which skips in the index stream, so such a loader resumes exactly too.

A dataset whose samples depend on the epoch (a random augmentation seeded per sample and epoch, like the shipped
CIFAR-10 dataset's) defines ``set_epoch(epoch)``: before each epoch's first batch the loader tells it (and every
dataset it wraps, along ``.dataset``: ``Subset``, ``IndexedDataset``, ..., and ``.datasets``: ``ConcatDataset``) the
epoch, in the main process (:func:`set_dataset_epoch`); an :class:`EpochCell` carries the value into the loader's
worker processes, persistent ones included. The augmentation is then a function of ``(seed, epoch, sample)`` (and of
the draw, :func:`sample_draw`, for a loader that may draw a sample twice in an epoch), which a resume restores: no
random state of a worker is involved.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler

__all__ = [
    "EpochCell",
    "EpochShuffleSampler",
    "ResumableDataLoader",
    "SkippableSampler",
    "check_map_style",
    "current_draw",
    "sample_draw",
    "set_dataset_epoch",
    "skippable",
]


class EpochCell:
    """An epoch number that a dataset's copies in DataLoader worker processes read as the main process sets it.

    Persistent workers hold a copy of the dataset made when they started, so a plain attribute set at a later epoch
    would never reach them. The cell is a one-element int64 tensor in shared memory, allocated by the first
    :meth:`set` in each process (a DDP rank started by spawning gets its own, not its launcher's), before that
    process's workers start; workers only :meth:`get`. The loader sets it between epochs, when no worker is loading.
    ``get()`` is ``-1`` until the first ``set``.
    """

    def __init__(self) -> None:
        self._value: torch.Tensor | None = None
        self._pid: int | None = None

    def set(self, epoch: int) -> None:
        if self._value is None or self._pid != os.getpid():
            self._value = torch.zeros((), dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
            self._pid = os.getpid()
        self._value.fill_(int(epoch))

    def get(self) -> int:
        return -1 if self._value is None else int(self._value.item())

    def __repr__(self) -> str:
        return f"EpochCell({self.get()})"


_DRAW: tuple[int, ...] = ()  # this process's current draw (sample_draw); each loader worker has its own


@contextlib.contextmanager
def sample_draw(*draw: int) -> Iterator[None]:
    """Mark the sample read inside the block as draw ``draw`` of the epoch (ints; the curriculum's
    ``(step, micro-batch)``), for a loader that may draw one sample several times in an epoch: a dataset seeding its
    augmentation per sample and epoch adds it (:func:`current_draw`), so every draw gets its own augmentation, the
    same on resume. Process-local: a loader worker sets it around its own read."""
    global _DRAW
    before, _DRAW = _DRAW, tuple(int(d) for d in draw)
    try:
        yield
    finally:
        _DRAW = before


def current_draw() -> tuple[int, ...]:
    """The draw set by :func:`sample_draw` around the current read (empty outside one)."""
    return _DRAW


def set_dataset_epoch(dataset: Any, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on ``dataset`` and on every dataset it wraps, along ``.dataset`` (``Subset``,
    :class:`~lightning_effi.core.indexed.IndexedDataset`, ...) and ``.datasets`` (``ConcatDataset``), that defines it;
    datasets without one are left alone. Called by the resumable loader (and the curriculum's) in the main process
    before an epoch's first batch."""
    seen: set[int] = set()
    todo = [dataset]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        set_epoch = getattr(current, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(int(epoch))
        todo.append(getattr(current, "dataset", None))
        inner = getattr(current, "datasets", None)
        if isinstance(inner, (list, tuple)):
            todo.extend(inner)


def check_map_style(owner: str, dataset: Any) -> None:
    """Refuse a dataset a sampler cannot draw indices into: an ``IterableDataset`` (it yields its samples itself, in
    its own order) or any object without ``len()``.

    Args:
        owner: who asks, for the message (``"EpochShuffleSampler"``, ``"ResumableDataLoader"``).
        dataset: the dataset to check.

    Raises:
        TypeError: naming ``owner``, the dataset's class and what is needed (a map-style dataset: ``__len__`` and
            ``__getitem__``, e.g. a ``torch.utils.data.Dataset`` subclass).
    """
    if isinstance(dataset, IterableDataset):
        raise TypeError(
            f"{owner}.dataset: {type(dataset).__name__} is an IterableDataset (it yields its samples itself, in its "
            f"own order), but {owner} draws sample indices, so it needs a map-style dataset with __len__ and "
            "__getitem__ (a torch.utils.data.Dataset); load the samples into one (a list, a Dataset over them), or "
            "pass the IterableDataset to a plain DataLoader without a sampler (InfoBatch and the curriculum, which "
            "choose the samples, need a map-style training set)"
        )
    if not isinstance(dataset, Sized):
        raise TypeError(
            f"{owner}.dataset: {type(dataset).__name__} has no __len__; {owner} draws sample indices, so it needs a "
            "map-style dataset with __len__ and __getitem__ (a torch.utils.data.Dataset that defines __len__)"
        )


class EpochShuffleSampler(DistributedSampler):  # type: ignore[type-arg]
    """``DistributedSampler`` with a skippable start: the per-rank stream of epoch ``e`` is the standard
    ``DistributedSampler`` stream (permutation from ``seed + e``, padded to a multiple of ``num_replicas``, then
    ``[rank::num_replicas]``) with its first ``start`` entries left out. ``len()`` is always the full per-rank count.

    Args:
        dataset: the map-style dataset (only ``len()`` is used).
        num_replicas, rank: world size and this process's rank (1, 0 for a single process).
        shuffle: permute per epoch (False: dataset order). seed: base seed. drop_last: as ``DistributedSampler``.

    Raises:
        TypeError: ``dataset`` is an ``IterableDataset`` or has no ``len()`` (:func:`check_map_style`).
        ValueError: ``num_replicas`` not a positive int, ``rank`` not an int in ``[0, num_replicas)``.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        check_map_style("EpochShuffleSampler", dataset)
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"EpochShuffleSampler.num_replicas must be a positive int, got {num_replicas!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"EpochShuffleSampler.rank must be an int in [0, {num_replicas}), got {rank!r}")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start :])


class SkippableSampler(Sampler[Any]):
    """Any sized sampler with a skippable start: yields ``sampler``'s stream without its first ``start`` entries (the
    skipped indices are drawn, never loaded); ``len()`` is always ``len(sampler)``. ``set_epoch`` is passed on to a
    sampler that has one and recorded in ``epoch`` (read by :meth:`ResumableDataLoader.state_dict`).

    :class:`ResumableDataLoader` wraps a sampler in it when the sampler has no ``start`` / ``epoch`` / ``set_epoch``
    of its own, e.g. the ``SequentialSampler`` that ``Trainer(overfit_batches=...)`` puts into the training loader
    (Lightning's ``_resolve_overfit_batches``).

    Args:
        sampler: a sampler (or any sized iterable of indices).

    Raises:
        TypeError: ``sampler`` has no ``len()`` (an epoch's length must be known to resume within it).
    """

    def __init__(self, sampler: Any) -> None:
        if not isinstance(sampler, Sized):
            raise TypeError(
                f"ResumableDataLoader needs a sampler with a length, got {type(sampler).__name__} (no __len__)"
            )
        self.sampler: Any = sampler
        self.start = 0
        self.epoch = int(getattr(sampler, "epoch", 0))

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __repr__(self) -> str:
        return f"SkippableSampler({self.sampler!r}, start={self.start}, epoch={self.epoch})"


def skippable(sampler: Any) -> Any:
    """``sampler`` itself when it has a skippable start (``start``, ``epoch`` and ``set_epoch``: an
    :class:`EpochShuffleSampler`, InfoBatch's sampler, a :class:`SkippableSampler`), else ``SkippableSampler(sampler)``.

    Raises:
        TypeError: ``sampler`` has no ``len()``.
    """
    if all(hasattr(sampler, a) for a in ("start", "epoch", "set_epoch")):
        return sampler
    return SkippableSampler(sampler)


#: the techniques whose loaders draw with a sampler of that name, for a resume without them
_SAMPLERS_WRITTEN_BY = {"InfoBatchSampler": "InfoBatch's pruned epochs: InfoBatchCallback and InfoBatchDataModule"}


class ResumableDataLoader(DataLoader):  # type: ignore[type-arg]
    """``DataLoader`` whose mid-epoch position is checkpointed by Lightning (see the module docstring).

    Built like a ``DataLoader`` but with a ``sampler`` (required) and no ``batch_sampler``. The sampler should have a
    *skippable* start: an int attribute ``start`` (entries of its per-rank stream to leave out, ``len()``
    unchanged), an ``epoch`` attribute and ``set_epoch`` — :class:`EpochShuffleSampler` or InfoBatch's sampler. Any
    other sized sampler (a ``SequentialSampler``, e.g. the one ``Trainer(overfit_batches=...)`` puts in when Lightning
    rebuilds the loader) is wrapped in a :class:`SkippableSampler` (:func:`skippable`), so the loader stays resumable.
    Iteration is lazy: the sampler is read at the first ``next()``, after Lightning's ``set_epoch``.

    Raises:
        TypeError: the sampler has no ``len()``; the dataset is an ``IterableDataset`` or has no ``len()``
            (:func:`check_map_style`).
    """

    def __init__(self, dataset: Dataset[Any], *args: Any, sampler: Any, **kwargs: Any) -> None:
        check_map_style("ResumableDataLoader", dataset)
        super().__init__(dataset, *args, sampler=skippable(sampler), **kwargs)  # type: ignore[misc]
        self._batches = 0
        self._resume_batches = 0
        self._resume_epoch: int | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._generate()

    def _generate(self) -> Iterator[Any]:
        sampler: Any = self.sampler
        # skip only in the epoch the checkpoint was written in: a checkpoint taken after the last batch Lightning
        # runs of an epoch (Trainer(limit_train_batches=...) ends it before the sampler's end) resumes in the next one
        skip = self._resume_batches if self._resume_epoch == int(sampler.epoch) else 0
        self._resume_batches, self._resume_epoch = 0, None
        sampler.start = skip * int(self.batch_size or 1)
        self._batches = skip
        set_dataset_epoch(self.dataset, int(sampler.epoch))
        try:
            for batch in super().__iter__():
                self._batches += 1
                yield batch
        finally:
            sampler.start = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batches" (handed out in this epoch), "batch_size", "samples" (per-rank epoch length),
        "sampler" (its class name: a resume with another one is told which)}``."""
        sampler: Any = self.sampler
        return {
            "epoch": int(sampler.epoch),
            "batches": int(self._batches),
            "batch_size": int(self.batch_size or 1),
            "samples": len(sampler),
            "sampler": type(sampler).__name__,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at ``state_dict["batches"]`` of epoch ``state_dict["epoch"]`` on the next iteration.

        Raises:
            ValueError: the checkpoint was written with another batch size or epoch length (the skipped samples
                would not be the consumed ones), its batch count is out of range, or it holds another loader's
                state (no ``"batches"``: e.g. the curriculum's loader, whose position lives in its callback).
        """
        if "batches" not in state_dict:
            raise ValueError(
                "cannot resume the training loader: the checkpoint holds another loader's state (keys "
                f"{sorted(state_dict)}, not this loader's epoch, batches, batch_size and samples), e.g. the "
                "curriculum's, whose position "
                "lives in the Curriculum callback's state. Resume with the callbacks and DataModule the checkpoint was "
                "written with (a Curriculum and a CurriculumDataModule), or start a new fit from its weights"
            )
        batches = int(state_dict["batches"])
        saved, sampler = state_dict.get("sampler"), type(self.sampler).__name__
        if isinstance(saved, str) and saved != sampler and state_dict.get("samples") != len(self.sampler):  # type: ignore[arg-type]
            # a checkpoint of InfoBatch's pruned epoch resumed without InfoBatch was blamed on the data settings
            # (qa48-break 04)
            written = _SAMPLERS_WRITTEN_BY.get(saved, f"the DataModule whose loader draws with {saved}")
            raise ValueError(
                f"cannot resume the training loader mid-epoch: the checkpoint's epoch was drawn by {saved} "
                f"({state_dict.get('samples')} samples), this run's by {sampler} ({len(self.sampler)} samples); "  # type: ignore[arg-type]
                f"resume with the callbacks and DataModule the checkpoint was written with ({written}), or start a "
                "new fit from its weights"
            )
        for key, now in (("batch_size", int(self.batch_size or 1)), ("samples", len(self.sampler))):  # type: ignore[arg-type]
            if key in state_dict and int(state_dict[key]) != now:
                raise ValueError(
                    f"cannot resume the training loader mid-epoch: the checkpoint has {key}={state_dict[key]}, the "
                    f"run now {now}; resume with the same data settings (batch size, subset, number of devices)"
                )
        if not 0 <= batches <= len(self):
            raise ValueError(
                f"cannot resume the training loader: {batches} consumed batches is outside [0, {len(self)}]"
            )
        if batches == len(self):
            # the checkpoint was taken after the epoch's last batch: Lightning resumes in the next epoch (and calls
            # set_epoch for it), so there is nothing to skip. Skipping here would empty that epoch and lose its data.
            self._resume_batches = self._batches = 0
            return
        self.sampler.set_epoch(int(state_dict["epoch"]))  # type: ignore[attr-defined]
        self._resume_batches, self._resume_epoch = batches, int(state_dict["epoch"])
        self._batches = batches
