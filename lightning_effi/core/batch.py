"""What the techniques carry beside a training batch, out of the user's sight (``docs/architecture.md``, "Batch
metadata").

A technique that owns the training loader (InfoBatch, the curriculum) needs to know, for every batch, which samples
it holds (their dataset indices), at which curriculum step it was drawn, how each sample is weighted... The user's
batch may be anything their collate function returns: a tensor, a tuple ``(x, y)``, a list, a dict, a dataclass, an
HF ``BatchEncoding``. So the technique's collate function returns an :class:`EffiBatch`, the user's batch and a
``meta`` dict side by side, and the technique's DataModule wrapper takes it apart in ``on_before_batch_transfer``,
the first hook Lightning calls with the batch (:meth:`~lightning_effi.core.wrapping.WrappingDataModule
.on_before_batch_transfer`): the ``meta`` dict is kept for the callbacks (:func:`batch_meta`) and every hook of the
user, ``training_step`` included, receives exactly the batch their collate function made.

``EffiBatch`` is a dataclass, so Lightning's precision plugin (``convert_input``, before ``on_before_batch_transfer``)
converts the user's batch inside it as it would the bare batch, and ``pin_memory=True`` pins it. Its ``meta`` field
is declared ``init=False``, which Lightning's ``apply_to_collection`` leaves as it is: the metadata stays on the CPU
in the dtype the technique chose (a ``bf16-true`` run does not round InfoBatch's weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

__all__ = ["EffiBatch", "batch_meta", "unwrap"]


@dataclasses.dataclass(init=False)
class EffiBatch:
    """A training batch as the user's collate function made it (``batch``, any structure) and what the techniques
    carry beside it (``meta``: name -> value, e.g. ``"index"``: int64 ``[B]`` dataset positions, on the CPU).

    Made by a technique's collate function; taken apart by the technique's DataModule wrapper before any user hook.
    """

    batch: Any
    meta: dict[str, Any] = dataclasses.field(init=False)  # init=False: Lightning's apply_to_collection skips it

    def __init__(self, batch: Any, meta: dict[str, Any]) -> None:
        self.batch = batch
        self.meta = meta

    def pin_memory(self, device: Any = None) -> EffiBatch:
        """Pin the user's batch (called by the DataLoader's pin-memory thread when ``pin_memory=True``)."""
        return EffiBatch(_pin_memory(self.batch, device), dict(self.meta))  # type: ignore[no-untyped-call]


def unwrap(batch: Any) -> tuple[Any, dict[str, Any] | None]:
    """``(user batch, meta)`` of an :class:`EffiBatch`; ``(batch, None)`` for any other batch."""
    if isinstance(batch, EffiBatch):
        return batch.batch, batch.meta
    return batch, None


def batch_meta(trainer: Any) -> Mapping[str, Any] | None:
    """The ``meta`` of the training batch being processed, as the technique DataModule wrapper of
    ``trainer.datamodule`` took it apart in ``on_before_batch_transfer``; None when the current training batch came
    without one (not from a technique's loader) or the Trainer has no technique DataModule.

    Valid from ``on_before_batch_transfer`` to the end of the batch (``on_train_batch_end``).
    """
    datamodule = getattr(trainer, "datamodule", None)
    return getattr(datamodule, "effi_batch_meta", None)
