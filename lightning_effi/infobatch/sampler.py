"""``InfoBatchSampler``: this rank's share of one epoch's frozen plan
(:class:`~lightning_effi.infobatch.functional.EpochPlan`). The method card ``README.md`` beside this file tells the
long story.

The training loader is rebuilt every epoch with that epoch's plan, so ``len()`` is right before iteration starts
(Lightning caches it), and iteration never re-plans (the reference's sampler re-plans in ``__iter__`` and builds a
new plan at every access). It subclasses ``DistributedSampler`` so that Lightning leaves it alone under DDP.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from torch.utils.data import DistributedSampler

from lightning_effi.core.checks import is_int
from lightning_effi.infobatch.functional import EpochPlan

__all__ = ["InfoBatchSampler"]


class InfoBatchSampler(DistributedSampler):
    """Yields this rank's share of ``plan.indices`` (Python ints), in plan order.

    With ``L = len(plan.indices)`` and ``W = num_replicas``, the global stream is ``plan.indices`` padded to
    ``W * ceil(L / W)`` by repeating its head (cycling if ``W > L``), or truncated to ``W * floor(L / W)`` with
    ``drop_last=True``; rank ``r`` takes ``stream[r::W]`` and skips its first ``start`` entries (mid-epoch resume).
    The ranks' shares are disjoint as positions of the stream, and their union is the plan plus the ``padded``
    duplicates (or minus the ``dropped`` tail).

    ``__iter__`` is pure and idempotent: it needs no ``set_epoch``, changes no state, and two calls give the same
    stream. ``len()`` is always the full per-rank count ``ceil(L / W)`` (``floor`` with ``drop_last``), also when
    ``start > 0``, as Lightning expects for a resumed epoch.

    Args:
        plan: the epoch's plan (its indices are copied; weights are not used here).
        num_replicas: world size ``W`` (positive int). rank: this process's rank in ``[0, W)``.
        drop_last: truncate instead of pad when ``W`` does not divide ``L``.
        start: entries of this rank's share to skip, in ``[0, len(self)]``; a plain attribute that a resumable
            loader may set before iterating.

    Attributes:
        plan, epoch (``plan.epoch``), num_samples (per-rank count), total_size (``W * num_samples``),
        padded: duplicates added over all ranks (``total_size - L`` without ``drop_last``, else 0),
        dropped: plan entries never visited because of ``drop_last`` (``L - total_size``, else 0).

    Raises:
        TypeError: ``plan`` is not an ``EpochPlan``.
        ValueError: invalid ``num_replicas``, ``rank`` or ``start``; ``set_epoch`` with an epoch other than the plan's.
    """

    def __init__(
        self, plan: EpochPlan, num_replicas: int = 1, rank: int = 0, drop_last: bool = False, start: int = 0
    ) -> None:
        if not isinstance(plan, EpochPlan):
            raise TypeError(f"InfoBatchSampler needs an EpochPlan, got {type(plan).__name__}")
        if not is_int(num_replicas) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
        if not is_int(rank) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be an int in [0, {num_replicas}), got {rank!r}")
        num_replicas, rank, start = int(num_replicas), int(rank), int(start) if is_int(start) else start
        indices = plan.indices.detach().cpu().clone().contiguous()
        # DistributedSampler only takes len() of the dataset; ``shuffle=True`` is informational (the plan is shuffled).
        super().__init__(
            range(indices.numel()),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=True,
            seed=0,
            drop_last=bool(drop_last),
        )
        length = indices.numel()
        self.num_samples = length // num_replicas if drop_last else math.ceil(length / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.plan = plan
        self.epoch = plan.epoch
        self.padded = max(self.total_size - length, 0)
        self.dropped = max(length - self.total_size, 0)
        self._indices = indices
        self.start = start
        self._check_start()

    def _check_start(self) -> None:
        if not is_int(self.start) or not 0 <= self.start <= self.num_samples:
            raise ValueError(
                f"start must be an int in [0, {self.num_samples}] (the per-rank length), got {self.start!r}"
            )

    def __iter__(self) -> Iterator[int]:
        self._check_start()
        stream = self._indices
        length = stream.numel()
        if self.total_size > length:  # pad with the head of the plan (cycled when the world exceeds L)
            reps = math.ceil(self.total_size / length)
            stream = stream.repeat(reps)[: self.total_size]
        else:
            stream = stream[: self.total_size]
        share = stream[self.rank : self.total_size : self.num_replicas]
        return iter(share[self.start :].tolist())

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Check that Lightning's epoch matches the plan's; the order is already in the plan (no reshuffle).

        Raises:
            ValueError: ``epoch != plan.epoch`` (a loader served with a stale plan).
        """
        if int(epoch) != self.plan.epoch:
            raise ValueError(
                f"InfoBatchSampler holds the plan of epoch {self.plan.epoch} but set_epoch({epoch}) "
                "was called: the train loader must be rebuilt with the plan of each epoch "
                "(reload_dataloaders_every_n_epochs=1)"
            )

    def __repr__(self) -> str:
        return (
            f"InfoBatchSampler(epoch={self.epoch}, L={self._indices.numel()}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, drop_last={self.drop_last}, start={self.start}, len={self.num_samples}, "
            f"padded={self.padded})"
        )
