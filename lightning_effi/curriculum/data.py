"""``CurriculumDataModule``: wraps any DataModule so that the curriculum decides which samples each step trains on.
The method card is ``lightning_effi/curriculum/README.md``. The training loader is rebuilt as

``DataLoader(CurriculumDataset(dataset), batch_sampler=CurriculumSampler(controller),
collate_fn=CurriculumCollate(collate_fn, ...), num_workers=..., ...)``

- :class:`CurriculumSampler` (a batch sampler, rank-aware: it shards by rank itself) yields lists of keys
  ``(index, curriculum_step, micro_idx, difficulties)`` from the controller's committed position.
- :class:`CurriculumDataset` returns ``(dataset[index], key)``, so the key travels with the sample into the worker.
- :class:`CurriculumCollate` collates with the user's function, applies ``seqlen_truncate`` / ``seqlen_reshape`` with
  the difficulty **that batch was drawn at** (not whatever the sampler holds when a prefetched batch arrives), and adds
  ``batch["cl_step"]``, ``batch["cl_micro"]``, ``batch["cl_difficulty"]`` (dict metric -> int). The
  :class:`~lightning_effi.callbacks.Curriculum` callback removes these keys before the user's ``training_step``.

Validation, test and predict loaders are delegated unchanged (never truncated).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from lightning_effi.core.errors import DataConfigError
from lightning_effi.core.wrapping import WrappingDataModule
from lightning_effi.curriculum import functional as F
from lightning_effi.curriculum.config import CurriculumConfig
from lightning_effi.curriculum.stream import CurriculumController

#: keys the collate wrapper adds to every training batch
BATCH_KEYS = ("cl_step", "cl_micro", "cl_difficulty")


class CurriculumDataset(Dataset):
    """``dataset[key[0]]`` paired with its key (``(index, step, micro_idx, difficulties)``)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple) -> tuple[Any, tuple]:
        return self.dataset[key[0]], key


class CurriculumCollate:
    """Collate ``(sample, key)`` pairs: the user's collate (``default_collate`` if None), then the sequence-length
    transform of the batch's own difficulty, then the ``cl_*`` keys.

    Args:
        collate_fn: the wrapped loader's collate function. metric_names: the curriculum's metric names, in order.
        truncate_keys, causal_label_shift: ``seqlen_truncate`` options (:func:`~lightning_effi.curriculum.functional
            .truncate_batch`).

    Raises:
        DataConfigError: the collated batch is not a dict; the samples of one batch carry different steps.
    """

    def __init__(
        self,
        collate_fn: Callable | None,
        metric_names: Sequence[str],
        truncate_keys: Sequence[str] = F.SEQUENCE_KEYS,
        causal_label_shift: bool = False,
    ) -> None:
        self.collate_fn = collate_fn or default_collate
        self.metric_names = tuple(metric_names)
        self.truncate_keys = tuple(truncate_keys)
        self.causal_label_shift = causal_label_shift

    def __call__(self, items: Sequence[tuple[Any, tuple]]) -> dict[str, Any]:
        keys = [k for _, k in items]
        _, step, micro, diffs = keys[0]
        if any(k[1] != step or k[2] != micro for k in keys):
            raise DataConfigError("curriculum: one batch mixes samples of different curriculum steps")
        batch = self.collate_fn([s for s, _ in items])
        if not isinstance(batch, Mapping):
            raise DataConfigError(
                f"curriculum needs dict batches (got {type(batch).__name__}): the transforms and "
                "the step/difficulty keys are added by name"
            )
        batch = dict(batch)
        difficulty = dict(zip(self.metric_names, diffs))
        if "seqlen_truncate" in difficulty:
            if not any(isinstance(batch.get(k), torch.Tensor) and batch[k].ndim >= 2 for k in self.truncate_keys):
                raise DataConfigError(
                    f"seqlen_truncate: the batch has none of truncate_keys "
                    f"{list(self.truncate_keys)} "
                    f"as a [B, S, ...] tensor (batch keys: {sorted(batch)})"
                )
            batch = F.truncate_batch(batch, difficulty["seqlen_truncate"], self.truncate_keys, self.causal_label_shift)
        if "seqlen_reshape" in difficulty:
            batch = F.reshape_batch(batch, difficulty["seqlen_reshape"])
        batch["cl_step"], batch["cl_micro"], batch["cl_difficulty"] = int(step), int(micro), difficulty
        return batch


class CurriculumSampler:
    """Batch sampler over the controller's stream (this rank's micro-batches of the current data epoch, from the
    committed position). ``len()`` is the full per-epoch count, also after a mid-epoch resume (a shorter ``len()``
    would make Lightning end the resumed epoch early)."""

    def __init__(self, controller: CurriculumController) -> None:
        self.controller = controller

    def __iter__(self) -> Iterator[list[tuple]]:
        return self.controller.micro_batches()

    def __len__(self) -> int:
        return len(self.controller)


class CurriculumDataLoader(DataLoader):
    """The curriculum's training loader. Its resume position lives in the :class:`~lightning_effi.callbacks.Curriculum`
    callback's state (the committed stream position), so the loader itself has nothing to save; it declares an empty
    state so that a checkpoint written by a stateful loader (e.g. a run without curriculum on a shipped DataModule)
    still loads (the curriculum then starts from its beginning)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Ignored: see the class docstring."""


class CurriculumDataModule(WrappingDataModule):
    """Wrap ``datamodule`` for curriculum learning. Everything but the training loader is delegated unchanged.

    Args:
        datamodule: any ``LightningDataModule`` whose ``train_dataloader()`` returns one ``DataLoader`` over a
            map-style dataset with a plain (shuffling or sequential) sampler and **dict** batches.
        metrics, **options: optionally the curriculum configuration (:class:`~lightning_effi.curriculum
            .CurriculumConfig` arguments: ``metrics={name: {difficulty_type, clustering_type, min_difficulty,
            max_difficulty, schedule_type, schedule_config, ...}}``, ``seed``, ``num_epochs``, ``rounding``, ...).
            Give it here or to the :class:`~lightning_effi.callbacks.Curriculum` callback, not both.

    The callback (required in ``Trainer(callbacks=...)``) builds the controller in its ``setup`` and attaches it. The
    rebuilt loader keeps the wrapped loader's workers, ``pin_memory``, ``prefetch_factor``, ``persistent_workers``,
    ``timeout``, ``multiprocessing_context`` and ``in_order``; its batch size is the micro-batch size. Batches are
    never dropped by the wrapped loader's ``drop_last``: the curriculum's own ``drop_last`` option governs the end of
    the sample budget.

    Raises:
        CurriculumConfigError: a bad configuration (at construction).
        DataConfigError: (first ``train_dataloader()``) a custom sampler, an iterable dataset; used without the
            callback.

    Example::

        dm = CurriculumDataModule(CausalLMDataModule(...), metrics={"seqlen_truncate": dict(
            difficulty_type="value", clustering_type="single_cluster", min_difficulty=16, max_difficulty=128,
            schedule_type="fixed_linear", schedule_config=dict(total_curriculum_step=300, difficulty_step=8))})
        pl.Trainer(max_steps=500, callbacks=[Curriculum()]).fit(model, dm)
    """

    technique = "curriculum"

    def __init__(
        self, datamodule: pl.LightningDataModule, metrics: Mapping[str, Any] | None = None, **options: Any
    ) -> None:
        super().__init__(datamodule)
        if metrics is None and options:
            raise DataConfigError(f"CurriculumDataModule: options {sorted(options)} given without metrics")
        self.config: CurriculumConfig | None = CurriculumConfig(metrics=metrics, **options) if metrics else None
        self.controller: CurriculumController | None = None  # attached by the Curriculum callback's setup()

    def train_dataloader(self) -> CurriculumDataLoader:
        if self.controller is None:
            raise DataConfigError(
                "CurriculumDataModule needs the Curriculum callback in Trainer(callbacks=[...]); "
                "without it use the wrapped DataModule directly"
            )
        t = self.template()
        if len(t["dataset"]) != t["length"]:
            raise DataConfigError(
                f"curriculum: the training dataset's length changed from {t['length']} to "
                f"{len(t['dataset'])}; it must stay constant during a run"
            )
        cfg = self.controller.config
        workers = t["num_workers"]
        return CurriculumDataLoader(
            CurriculumDataset(t["dataset"]),
            batch_sampler=CurriculumSampler(self.controller),
            collate_fn=CurriculumCollate(t["collate_fn"], list(cfg.metrics), cfg.truncate_keys, cfg.causal_label_shift),
            num_workers=workers,
            pin_memory=t["pin_memory"],
            worker_init_fn=t["worker_init_fn"],
            prefetch_factor=t["prefetch_factor"] if workers > 0 else None,
            persistent_workers=t["persistent_workers"] and workers > 0,
            timeout=t["timeout"],
            multiprocessing_context=t["multiprocessing_context"],
            in_order=t["in_order"],
        )
