"""Shared pieces of the DataModules: argument checks, seeded subsets, the padding collate and the base class."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from lightning_effi.core.checks import is_int, is_real
from lightning_effi.core.errors import DataConfigError
from lightning_effi.core.loader import EpochShuffleSampler, ResumableDataLoader

from .cache import discard_entry

__all__ = [
    "EffiDataModule",
    "PaddingCollate",
    "check_bool",
    "check_int",
    "check_choice",
    "check_fraction",
    "seeded_subset",
]


def check_int(name: str, value: Any, minimum: int = 1, optional: bool = False) -> int | None:
    """``value`` as an int >= ``minimum`` (``None`` allowed if ``optional``), else :class:`DataConfigError`."""
    if value is None and optional:
        return None
    if not is_int(value) or value < minimum:
        none = " or null" if optional else ""
        raise DataConfigError(f"data.{name}: {value!r} is invalid; expected an integer >= {minimum}{none}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a real boolean (Python ``bool`` or ``numpy.bool_``), else :class:`DataConfigError` (a
    string such as ``"no"`` would otherwise be silently true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise DataConfigError(f"data.{name}: {value!r} is invalid; expected true or false")
    return bool(value)


def check_fraction(name: str, value: Any) -> float:
    """``value`` as a float in the open interval (0, 1), else :class:`DataConfigError`."""
    if not is_real(value) or not 0 < value < 1:
        raise DataConfigError(f"data.{name}: {value!r} is invalid; expected a number in the open interval (0, 1)")
    return float(value)


def check_choice(name: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise DataConfigError(f"data.{name}: {value!r} is invalid; expected one of {', '.join(map(repr, allowed))}")
    return value


def check_file(name: str, path: str | os.PathLike | None) -> Path:
    if path is None:
        raise DataConfigError(f"data.{name}: not set; expected the path of an existing file")
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataConfigError(f"data.{name}: '{path}' does not exist or is not a file")
    return path


def seeded_subset(dataset: Dataset, n: int | None, seed: int, salt: int, name: str = "subset") -> Dataset:
    """The first ``n`` samples of a permutation seeded by ``(seed, salt)`` as a ``Subset`` (all of it if ``n`` is
    ``None`` or ``len(dataset)``). Used by tests and benchmarks to run on a small, fixed part of a split.

    Raises:
        DataConfigError: ``n`` above ``len(dataset)`` (named ``data.<name>``: a run would train on the whole split
            under a subset's setting, e.g. ``train_subset=1e9``).
    """
    size = len(dataset)  # type: ignore[arg-type]
    if n is not None and n > size:
        raise DataConfigError(
            f"data.{name}: {n} is more samples than the split has ({size}); give at most {size}, or null for all of it"
        )
    if n is None or n == size:
        return dataset
    perm = np.random.default_rng([seed, salt]).permutation(len(dataset))[:n]
    return Subset(dataset, perm.tolist())


class PaddingCollate:
    """Collate dict samples with variable-length 1-D ``input_ids``.

    Output: ``input_ids[B,T]`` right-padded with ``pad_token_id``, ``attention_mask[B,T]`` (int64, 1 = real token),
    where ``T`` is the longest sample of the batch; ``labels`` is stacked when scalar (``labels[B]``) or padded with
    ``label_pad_id`` when 1-D (``labels[B,T]``); other keys go through ``default_collate``. Picklable.
    """

    def __init__(self, pad_token_id: int, label_pad_id: int = -100):
        self.pad_token_id = int(pad_token_id)
        self.label_pad_id = int(label_pad_id)

    def __call__(self, samples: Sequence[dict]) -> dict:
        ids = [s["input_ids"] for s in samples]
        lengths = torch.tensor([len(x) for x in ids], dtype=torch.int64)
        input_ids = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=self.pad_token_id)
        mask = torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]
        batch = {"input_ids": input_ids, "attention_mask": mask.to(torch.int64)}
        labels = [s["labels"] for s in samples] if "labels" in samples[0] else None
        if labels is not None:
            batch["labels"] = (
                torch.stack(labels)
                if labels[0].dim() == 0
                else torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=self.label_pad_id)
            )
        rest = [{k: v for k, v in s.items() if k not in batch} for s in samples]
        if rest[0]:
            batch.update(default_collate(rest))
        return batch

    def __repr__(self) -> str:
        return f"PaddingCollate(pad_token_id={self.pad_token_id}, label_pad_id={self.label_pad_id})"


class EffiDataModule(LightningDataModule):
    """Base of the shipped DataModules.

    Subclasses implement ``_prepare() -> Any`` (the expensive, cached work; idempotent and cheap on a cache hit) and
    ``_setup(prepared)`` (builds ``train_dataset``, ``val_dataset``, ``test_dataset``, may set ``collate_fn``).
    ``prepare_data()`` runs ``_prepare()``; ``setup()`` runs it again lazily (a cache hit), so the DataModule also
    works without a Trainer. The dataloaders call ``setup()`` if needed.

    When ``_prepare()`` returns a cache entry folder and ``_setup`` cannot read it (``OSError``/``ValueError``, e.g. a
    truncated ``.npy`` or an empty ``tokenizer.json``; :class:`DataConfigError` is not such a failure), the entry is
    considered damaged: it is deleted with a warning naming it and prepared again, once; a second failure raises
    :class:`DataConfigError` naming the entry.
    """

    def __init__(
        self,
        batch_size: int,
        num_workers: int,
        seed: int,
        cache_dir: str | os.PathLike | None,
        pin_memory: bool = False,
    ):
        super().__init__()
        self.batch_size = check_int("batch_size", batch_size)
        self.num_workers = check_int("num_workers", num_workers, minimum=0)
        self.seed = check_int("seed", seed, minimum=0)
        self.cache_dir = cache_dir
        self.pin_memory = check_bool("pin_memory", pin_memory)
        self.collate_fn: Callable | None = None
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None

    def _prepare(self) -> Any:
        raise NotImplementedError

    def _setup(self, prepared: Any) -> None:
        raise NotImplementedError

    def prepare_data(self) -> None:
        self._prepare()

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        for rebuilt in (False, True):
            entry = self._prepare()
            try:
                self._setup(entry)
                return
            except DataConfigError:
                raise
            except (OSError, ValueError) as err:
                if not isinstance(entry, Path):
                    raise
                if rebuilt:
                    raise DataConfigError(
                        f"data.cache_dir: the cache entry '{entry}' cannot be read even after "
                        f"rebuilding it ({type(err).__name__}: {err}); delete the folder '{entry}' "
                        "and run again, or use another cache_dir"
                    ) from err
                warnings.warn(
                    f"cache entry '{entry}' is damaged ({type(err).__name__}: {err}); deleting and rebuilding it",
                    RuntimeWarning,
                    stacklevel=2,
                )
                discard_entry(entry)

    def model_hints(self) -> dict:
        """Values for model arguments left ``null`` in the config (``vocab_size``, ``num_classes``...)."""
        raise NotImplementedError

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
            collate_fn=self.collate_fn,
        )

    def train_dataloader(self) -> ResumableDataLoader:
        """Shuffled per epoch (seeded by ``seed`` and the epoch), sharded by the trainer's rank under DDP, and
        resumable mid-epoch (:class:`~lightning_effi.core.loader.ResumableDataLoader`)."""
        self.setup("fit")
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = EpochShuffleSampler(self.train_dataset, num_replicas=world, rank=rank, shuffle=True, seed=self.seed)
        return ResumableDataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
            collate_fn=self.collate_fn,
        )

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return self._loader(self.val_dataset, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        self.setup("test")
        return self._loader(self.test_dataset, shuffle=False)
