"""InfoBatch as pure functions (Qin et al., "InfoBatch: Lossless Training Speed Up by Unbiased Dynamic Data Pruning",
ICLR 2024, arXiv 2303.04947; reference implementation NUS-HPC-AI-Lab/InfoBatch ``infobatch/infobatch.py``): torch
only, no Lightning, usable in any training loop. The method card ``README.md`` beside this file tells the long story.

- :func:`plan_epoch` (with :func:`split_well_learned`, :func:`keep_count`, :func:`epoch_stop`): the
  :class:`EpochPlan` of an epoch, i.e. the shuffled dataset indices to visit and a loss weight per sample;
  :func:`full_plan`: the plan of a full epoch (epoch 0, the annealing epochs, epochs after the schedule).
- :func:`rescale`: the weighted batch loss ``mean(w[index] * per_sample_loss)``, out of place.
- :func:`update_scores` (per batch) or :func:`accumulate` / :func:`finalize` (per epoch, all-reduce friendly):
  the score table.
- :func:`auto_per_sample_loss` (with :func:`find_logits`, :func:`find_labels`, :func:`per_sample_cross_entropy`,
  :func:`losses_agree`): the per-sample loss of a module that returns a plain cross-entropy ``loss``, checked
  against it.
- :func:`expected_saving`, :func:`validate_hparams`; :func:`min_epoch_size`, :func:`rank_batches`,
  :func:`limited_batches` and :func:`min_total_steps`: the fewest optimizer steps a run can have (for the run's
  progress clock); :func:`fewest_epoch_batches`: the fewest batches an epoch can have (for ``val_check_interval``).
- Composed with the curriculum (which draws every batch): :func:`thin_micro_batch` (with :func:`drop_count`,
  :func:`keep_probabilities`, :func:`thin_generator`, :func:`check_thinning_ratio`, :func:`thin_stop_step`) thins
  each drawn micro-batch slice and weights what it keeps; :func:`thinned_loss` is its unbiased loss.

Conventions: the score table is ``float32[N]`` with a ``bool[N]`` ``seen`` mask, the weight table ``float32[N]``;
dataset indices are ``int64`` everywhere (exact beyond 2**24). Plans are computed on the CPU from a private
``torch.Generator`` seeded with :func:`hash64` of ``(seed, purpose, epoch)``; the global RNGs are never touched.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from numbers import Integral, Real
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_effi.core.checks import is_int
from lightning_effi.core.rng import hash64

__all__ = [
    "CHECKABLE_EPS",
    "IGNORE_INDEX",
    "LABEL_KEYS",
    "PER_SAMPLE_LOSS_CONTRACT",
    "PER_SAMPLE_LOSS_HINT",
    "EpochPlan",
    "ThinnedBatch",
    "accumulate",
    "AutoLoss",
    "auto_losses",
    "auto_per_sample_loss",
    "cap_applies",
    "check_thinning_ratio",
    "drop_count",
    "epoch_stop",
    "expected_saving",
    "fewest_epoch_batches",
    "find_labels",
    "labels_source",
    "find_logits",
    "finalize",
    "finite_losses_disagree",
    "full_plan",
    "hash64",
    "keep_count",
    "keep_probabilities",
    "limited_batches",
    "loss_tolerance",
    "losses_agree",
    "min_epoch_size",
    "min_total_steps",
    "per_sample_cross_entropy",
    "plan_epoch",
    "plan_generator",
    "rank_batches",
    "rank_samples",
    "record_tokens",
    "merge_tokens",
    "rescale",
    "split_well_learned",
    "thin_generator",
    "thin_micro_batch",
    "thin_stop_step",
    "thinned_loss",
    "token_ratio",
    "update_scores",
    "validate_hparams",
]

PER_SAMPLE_LOSS_CONTRACT = (
    'training_step must return {"loss": ..., "per_sample_loss": tensor of shape (B,)} '
    "(one float loss per sample of the batch, with grad), or InfoBatchCallback must compute it "
    "(per_sample_loss=fn, or the automatic cross-entropy of the forward output's logits and the batch's labels)"
)

#: Purpose key mixed into every InfoBatch seed, so another technique using the same user seed gets another stream.
_PURPOSE = int.from_bytes(b"InfoBat", "little")
_PLAN_STATE_VERSION = 1


# ---------------------------------------------------------------------------------------------------------------
# Randomness
# ---------------------------------------------------------------------------------------------------------------


def plan_generator(seed: int, epoch: int, stream: int = 0) -> torch.Generator:
    """Private CPU generator for the plan of ``epoch``: ``manual_seed(hash64(seed, PURPOSE, epoch))``;
    ``stream > 0`` gives further independent generators ``manual_seed(hash64(seed, PURPOSE, epoch, stream))``.

    ``PURPOSE`` is the constant ``int.from_bytes(b"InfoBat", "little")``.
    """
    keys = (int(seed), _PURPOSE, int(epoch)) + ((int(stream),) if stream else ())
    return torch.Generator(device="cpu").manual_seed(hash64(*keys))


_PARALLEL_FROM = 1_000_000  # epoch sizes from which the order is drawn as two half-size shuffles in two threads
_POOL: ThreadPoolExecutor | None = None


def _submit(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in a planning thread (torch releases the GIL inside its kernels)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="infobatch-plan")
    return _POOL.submit(fn, *args, **kwargs)


def _distinct(c: int, need: int, generator: torch.Generator) -> Tensor:
    """A uniform ``need``-subset of ``range(c)`` as ``int64[need]``: the first ``need`` distinct values of i.i.d.
    uniform draws (rejection; cheap for ``need << c``), or ``randperm(c)[:need]`` when ``need`` is not small."""
    if 4 * need > c:
        return torch.randperm(c, generator=generator)[:need]
    picked: dict[int, None] = {}
    while len(picked) < need:
        for d in torch.randint(0, c, (2 * (need - len(picked)) + 16,), generator=generator).tolist():
            picked.setdefault(d)
            if len(picked) == need:
                break
    return torch.tensor(list(picked), dtype=torch.int64)


def uniform_subset_of(mask: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """A uniformly random ``k``-subset of the True positions of ``mask`` (``bool[N]``), as a ``bool[N]`` mask, in
    O(N) without a shuffle.

    Each True position is included independently with probability ``k / m`` (``m`` = number of True positions; one
    ``torch.rand`` per position), which gives a uniform subset of random size ``c``; then a uniform
    ``|c - k|``-subset of the included (``c > k``) or the excluded (``c < k``) positions is flipped. Both steps are
    symmetric under any relabelling of the True positions, so the result is a uniform ``k``-subset; the correction
    touches about ``sqrt(k)`` positions. Small ``N`` use ``randperm``.

    Raises:
        ValueError: ``mask`` is not a 1-D bool tensor, or not ``0 <= k <= m``.
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
        raise ValueError(f"uniform_subset_of needs a 1-D bool mask, got {_describe(mask)}")
    m = int(mask.sum())
    if not (is_int(k) and 0 <= k <= m):
        raise ValueError(f"uniform_subset needs 0 <= k <= m, got k={k!r}, m={m!r}")
    k = int(k)
    if k == 0 or k == m:
        return mask.clone() if k == m else torch.zeros_like(mask)
    if mask.numel() < 65536:
        positions = mask.nonzero().flatten()
        out = torch.zeros_like(mask)
        out[positions[torch.randperm(m, generator=generator)[:k]]] = True
        return out
    out = mask & (torch.rand(mask.numel(), generator=generator) < k / m)
    c = int(out.sum())
    if c != k:
        candidates = (out if c > k else mask & ~out).nonzero().flatten()
        out[candidates[_distinct(candidates.numel(), abs(c - k), generator)]] = c < k
    return out


def uniform_subset(m: int, k: int, generator: torch.Generator) -> Tensor:
    """A uniformly random ``k``-subset of ``range(m)`` as a ``bool[m]`` mask: :func:`uniform_subset_of` an all-True
    mask.

    Raises:
        ValueError: not ``0 <= k <= m``.
    """
    if not (is_int(m) and is_int(k) and 0 <= k <= m):
        raise ValueError(f"uniform_subset needs 0 <= k <= m, got k={k!r}, m={m!r}")
    return uniform_subset_of(torch.ones(int(m), dtype=torch.bool), k, generator)


# ---------------------------------------------------------------------------------------------------------------
# Exact arithmetic and validation
# ---------------------------------------------------------------------------------------------------------------


def _fraction(x: Any, name: str) -> Fraction:
    """``x`` as the exact decimal it prints as (``0.1`` -> 1/10, not the binary float 0.1000000000000000055...)."""
    if isinstance(x, bool):
        raise TypeError(f"{name} must be a real number, got {x!r}")
    if isinstance(x, (Integral, Fraction, Decimal)):
        if isinstance(x, Decimal) and not x.is_finite():
            raise ValueError(f"{name} must be finite, got {x!r}")
        return Fraction(x)
    if not isinstance(x, Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    try:
        return Fraction(str(x))
    except ValueError:  # nan / inf
        raise ValueError(f"{name} must be finite, got {x!r}") from None


def _check_prune_ratio(prune_ratio: Any) -> Fraction:
    r = _fraction(prune_ratio, "prune_ratio")
    if not 0 <= r < 1:
        raise ValueError(
            f"prune_ratio must be in [0, 1) (the fraction of well-learned samples dropped), got {prune_ratio!r}"
        )
    return r


def _check_delta(delta: Any) -> Fraction:
    d = _fraction(delta, "delta")
    if not 0 < d <= 1:
        raise ValueError(
            f"delta must be in (0, 1] (annealing starts at epoch floor(delta * num_epochs)), got {delta!r}"
        )
    return d


def _check_num_epochs(num_epochs: Any) -> int:
    if not is_int(num_epochs) or num_epochs < 1:
        raise ValueError(f"num_epochs must be a positive int, got {num_epochs!r}")
    return int(num_epochs)


def validate_hparams(prune_ratio: float, delta: float, num_epochs: int | None = None) -> None:
    """Check InfoBatch hyperparameters. Values are never clamped.

    Args:
        prune_ratio: fraction ``r`` of the well-learned set dropped per prune epoch, in ``[0, 1)``.
        delta: annealing start as a fraction of ``num_epochs``, in ``(0, 1]``.
        num_epochs: total epochs ``E``, a positive int, or ``None`` (not known yet).

    Raises:
        ValueError: a value outside its range (the message names the parameter and the range); NaN or infinite.
        TypeError: a value that is not a real number.

    Warns:
        UserWarning: ``prune_ratio > 0.9`` (kept weights above 10; the reference silently clamps to 0.9) and
        ``delta == 1`` (no annealing epochs: the last epochs are not trained on full data).
    """
    r = _check_prune_ratio(prune_ratio)
    d = _check_delta(delta)
    if num_epochs is not None:
        _check_num_epochs(num_epochs)
    if r > Fraction(9, 10):
        warnings.warn(
            f"prune_ratio={prune_ratio} > 0.9: kept well-learned samples get weight "
            f"{float(1 / (1 - r)):.3g} (> 10), which makes the gradient noisy; the reference clamps to 0.9",
            UserWarning,
            stacklevel=2,
        )
    if d == 1:
        warnings.warn(
            "delta=1 disables annealing: pruning continues until the last epoch, whose residual bias is "
            "then never removed (the paper uses delta=0.875)",
            UserWarning,
            stacklevel=2,
        )


def epoch_stop(num_epochs: int, delta: float) -> int:
    """First annealing epoch ``E_stop = floor(delta * num_epochs)``, computed exactly.

    ``delta`` is read as the decimal it prints as (``Fraction(str(delta))``), so e.g. ``delta=0.57, num_epochs=100``
    gives 57 (binary floating point gives ``56.99999999999999``). Epochs ``e >= E_stop`` train on the full data.

    Raises:
        ValueError: ``num_epochs`` not a positive int, ``delta`` outside ``(0, 1]``.
    """
    e = _check_num_epochs(num_epochs)
    return math.floor(_check_delta(delta) * e)


def keep_count(n_well_learned: int, prune_ratio: float) -> int:
    """Number of well-learned samples kept in a prune epoch: ``k = floor((1 - r) * |D1|)``, exact.

    The floor prunes tiny sets slightly more than ``r`` (``|D1| = 1, r = 0.5 -> 0``), as the reference does.
    Examples: ``keep_count(10, 0.9) == 1``, ``keep_count(100, 0.71) == 29``.

    Raises:
        ValueError: ``n_well_learned`` not a non-negative int, ``prune_ratio`` outside ``[0, 1)``.
    """
    if not is_int(n_well_learned) or n_well_learned < 0:
        raise ValueError(f"n_well_learned must be a non-negative int, got {n_well_learned!r}")
    return math.floor((1 - _check_prune_ratio(prune_ratio)) * int(n_well_learned))


def min_epoch_size(epoch: int, num_epochs: int, dataset_size: int, prune_ratio: float, delta: float) -> int:
    """The fewest samples the plan of ``epoch`` can visit (:func:`plan_epoch`), whatever the scores.

    A full epoch (``epoch == 0`` or ``epoch >= epoch_stop(num_epochs, delta)``) visits all ``N``. A prune epoch visits
    ``N - |D1| + keep_count(|D1|, r)`` samples, which falls as ``|D1|`` grows; ``|D1| <= N - 1`` (the well-learned
    set is strictly below the mean of the seen scores, so at least one sample is not in it), hence the fewest is
    ``1 + keep_count(N - 1, r) = 1 + floor((1 - r)(N - 1))``. This can be one below ``ceil((1 - r) N)`` (``N = 10,
    r = 0.15``: 8, not 9).

    Raises:
        ValueError: ``epoch`` not an int in ``[0, num_epochs)``, ``dataset_size`` not a positive int, invalid
            ``num_epochs``, ``prune_ratio`` or ``delta``.
    """
    stop = epoch_stop(num_epochs, delta)
    if not is_int(epoch) or not 0 <= epoch < num_epochs:
        raise ValueError(f"epoch must be an int in [0, {num_epochs}), got {epoch!r}")
    if not is_int(dataset_size) or dataset_size < 1:
        raise ValueError(f"dataset_size must be a positive int, got {dataset_size!r}")
    n = int(dataset_size)
    if epoch == 0 or epoch >= stop:
        return n
    return 1 + keep_count(n - 1, prune_ratio)


def rank_batches(
    epoch_size: int,
    batch_size: int,
    world_size: int = 1,
    drop_last: bool = False,
    limit_batches: int | float = 1.0,
) -> int:
    """Batches one rank's training loader yields for an epoch of ``epoch_size`` samples, as Lightning counts them.

    Each rank takes ``ceil(L / W)`` samples (the :class:`~lightning_effi.infobatch.sampler.InfoBatchSampler` pads the
    stream by repeating its head), ``floor(L / W)`` with ``drop_last``; the loader makes ``ceil(share / B)`` batches
    (``floor`` with ``drop_last``); ``limit_batches`` (``Trainer(limit_train_batches=...)``) applies as Lightning
    applies it: an int caps the count, a float scales it (``int(batches · limit)``). Non-decreasing in ``L``.

    Raises:
        ValueError: a size that is not a positive int (``epoch_size`` may be 0), or ``limit_batches`` not a number
            ``>= 0``.
    """
    if not is_int(epoch_size) or epoch_size < 0:
        raise ValueError(f"epoch_size must be an int >= 0, got {epoch_size!r}")
    for name, v in (("batch_size", batch_size), ("world_size", world_size)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    size, b, w = int(epoch_size), int(batch_size), int(world_size)
    share = size // w if drop_last else -(-size // w)
    return limited_batches(share // b if drop_last else -(-share // b), limit_batches)


def rank_samples(
    epoch_size: int,
    batch_size: int,
    world_size: int = 1,
    drop_last: bool = False,
    limit_batches: int | float = 1.0,
) -> int:
    """Samples one rank trains in an epoch of ``epoch_size`` samples: its :func:`rank_batches` batches of
    ``batch_size``, the last one partial when the rank's share ends there (without ``drop_last``).

    Raises:
        ValueError: as :func:`rank_batches`.
    """
    batches = rank_batches(epoch_size, batch_size, world_size, drop_last, limit_batches)
    share = epoch_size // world_size if drop_last else -(-epoch_size // world_size)
    return batches * batch_size if drop_last else min(share, batches * batch_size)


def limited_batches(batches: int, limit_batches: int | float = 1.0) -> int:
    """``batches`` under ``Trainer(limit_train_batches=limit_batches)``, as Lightning applies it
    (``lightning.pytorch.trainer.connectors.data_connector._parse_num_batches``): an int caps the count
    (``min(batches, limit)``), a float scales it (``int(batches · limit)``).

    Raises:
        ValueError: ``batches`` not an int >= 0, ``limit_batches`` not a number >= 0.
    """
    if not is_int(batches) or batches < 0:
        raise ValueError(f"batches must be an int >= 0, got {batches!r}")
    if isinstance(limit_batches, bool) or not isinstance(limit_batches, (Integral, Real)) or limit_batches < 0:
        raise ValueError(f"limit_batches must be an int or a float >= 0, got {limit_batches!r}")
    if isinstance(limit_batches, Integral):
        return min(int(batches), int(limit_batches))
    return int(int(batches) * float(limit_batches))


def fewest_epoch_batches(
    dataset_size: int,
    num_epochs: int,
    prune_ratio: float,
    delta: float,
    batch_size: int,
    world_size: int = 1,
    drop_last: bool = False,
    limit_batches: int | float = 1.0,
) -> int:
    """The fewest training batches one rank's loader can yield in any epoch of the run, whatever the scores:
    ``min_e rank_batches(min_epoch_size(e), ...)`` (``rank_batches`` is non-decreasing in the epoch size; the full
    epochs give ``rank_batches(N)``). Every count between it and ``rank_batches(N)`` can occur: a prune epoch's size
    falls by at most one sample as its well-learned set grows by one. Lightning's ``Trainer(val_check_interval=<int>)``
    must not exceed it (``lightning.pytorch.loops.fit_loop``, ``setup_data``).

    Raises:
        ValueError: invalid sizes or hyperparameters (see :func:`min_epoch_size` and :func:`rank_batches`).
    """
    _check_num_epochs(num_epochs)
    size = min(min_epoch_size(e, num_epochs, dataset_size, prune_ratio, delta) for e in range(int(num_epochs)))
    return rank_batches(size, batch_size, world_size, drop_last, limit_batches)


def min_total_steps(
    dataset_size: int,
    num_epochs: int,
    prune_ratio: float,
    delta: float,
    batch_size: int,
    world_size: int = 1,
    drop_last: bool = False,
    accumulate_grad_batches: int | Sequence[int] = 1,
    limit_batches: int | float = 1.0,
) -> int:
    """The fewest optimizer steps a run of ``num_epochs`` InfoBatch epochs can have, whatever the scores: the sum over
    the epochs of ``ceil(rank_batches(min_epoch_size(e), ...) / a_e)`` (Lightning steps the optimizer every ``a_e``
    batches and at an epoch's last batch), with ``a_e`` the accumulation factor of epoch ``e``:
    ``accumulate_grad_batches``, or its ``e``-th item when it is a sequence of one factor per epoch (a
    ``GradientAccumulationScheduler``'s). Exact: the steps of an epoch do not decrease with its size, and each epoch
    can reach its fewest samples (:func:`min_epoch_size`).

    Raises:
        ValueError: invalid sizes or hyperparameters (see :func:`min_epoch_size` and :func:`rank_batches`), a factor
            that is not a positive int, a sequence of factors that is not one per epoch.
    """
    _check_num_epochs(num_epochs)
    given: Any = accumulate_grad_batches
    factors: list[Any] = (
        [given] * int(num_epochs) if is_int(given) else list(given) if isinstance(given, Sequence) else []
    )
    if len(factors) != int(num_epochs):
        raise ValueError(
            f"accumulate_grad_batches must be a positive int or one per epoch ({num_epochs}), got {given!r}"
        )
    for factor in factors:
        if not is_int(factor) or factor < 1:
            raise ValueError(f"accumulate_grad_batches must be a positive int, got {factor!r}")
    total = 0
    for epoch, factor in enumerate(factors):
        size = min_epoch_size(epoch, num_epochs, dataset_size, prune_ratio, delta)
        batches = rank_batches(size, batch_size, world_size, drop_last, limit_batches)
        total += -(-batches // int(factor))
    return total


def _check_tables(score: Tensor, seen: Tensor) -> None:
    if not isinstance(score, Tensor) or score.dim() != 1 or not score.is_floating_point():
        raise ValueError(f"score must be a 1-D floating-point tensor (float32[N]), got {_describe(score)}")
    if not isinstance(seen, Tensor) or seen.dtype != torch.bool or seen.shape != score.shape:
        raise ValueError(
            f"seen must be a bool tensor of the same shape as score {tuple(score.shape)}, got {_describe(seen)}"
        )


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__}"


# ---------------------------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------------------------


def split_well_learned(score: Tensor, seen: Tensor) -> tuple[float, Tensor]:
    """Threshold and well-learned set of a prune epoch (Qin et al. 2024, Sec. 3.2).

    Args:
        score: ``float32[N]``, the latest unweighted per-sample loss of every sample (any value where unseen).
        seen: ``bool[N]``, True where a score has been observed.

    Returns:
        ``(tau, well_learned)``: ``tau`` = mean of the seen scores, accumulated in float64 (a Python float; NaN if
        nothing is seen); ``well_learned = seen & (score < tau)`` (``bool[N]``, strict: a score equal to ``tau`` is
        not well learned; unseen samples never are). The comparison is exact (against the largest value of the
        table's dtype below ``tau``), without a float64 copy of the table.

    Raises:
        ValueError: wrong shapes/dtypes; a seen score is NaN or infinite (the threshold would be meaningless).
    """
    _check_tables(score, seen)
    score = score.detach().cpu()
    seen = seen.detach().cpu()
    all_seen = bool(seen.all())
    observed = score if all_seen else score[seen]
    if observed.numel() == 0:
        return math.nan, torch.zeros_like(seen)
    total = float(torch.sum(observed, dtype=torch.float64))  # float64 accumulation without a float64 copy
    if not math.isfinite(total):
        finite = torch.isfinite(observed)
        bad = int(seen.nonzero().flatten()[~finite][0])
        raise ValueError(
            f"score of sample {bad} is {float(score[bad])}: seen scores must be finite "
            "(a NaN/inf loss, or a placeholder left in the table)"
        )
    tau = total / observed.numel()
    below = score <= _largest_below(tau, score.dtype)  # == (score < tau) exactly, in the table's own dtype
    return tau, below if all_seen else seen & below


def _largest_below(tau: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` strictly below ``tau``: for x of that dtype, ``x < tau  <=>  x <= result``."""
    nearest = torch.tensor(tau, dtype=dtype)
    if float(nearest) >= tau:
        nearest = torch.nextafter(nearest, torch.tensor(-math.inf, dtype=dtype))
    return float(nearest)


@dataclass(frozen=True, eq=False, repr=False)
class EpochPlan:
    """The samples and weights of one epoch, with its saving. Treat as immutable (tensors are not copied).

    Attributes:
        epoch: 0-based epoch index.
        indices: ``int64[L]``, the dataset indices to visit, in order (already shuffled; each at most once).
        weights: ``float32[N]``, the loss weight of every sample: ``1 / (1 - r)`` for kept well-learned samples,
            1.0 otherwise (also for dropped samples, which are never visited). Exactly 1.0 everywhere in a full epoch.
        kind: ``"full"`` (all N samples, weight 1) or ``"prune"``.
        threshold: the score threshold ``tau`` of a prune epoch; NaN for a full epoch.
        num_well_learned: ``|D1|`` (0 for a full epoch).
        num_kept_well_learned: ``k = floor((1 - r) * |D1|)`` (0 for a full epoch).
        saved: samples not visited this epoch, ``N - L`` (before DDP padding / ``drop_last``).

    Raises:
        ValueError: inconsistent fields (dtypes, shapes, ``saved != N - L``, indices outside ``[0, N)``, a full plan
            with ``L != N`` or a weight other than 1.0).
    """

    epoch: int
    indices: Tensor
    weights: Tensor
    kind: Literal["full", "prune"]
    threshold: float
    num_well_learned: int
    num_kept_well_learned: int
    saved: int

    def __post_init__(self) -> None:
        if not is_int(self.epoch) or self.epoch < 0:
            raise ValueError(f"EpochPlan.epoch must be a non-negative int, got {self.epoch!r}")
        if not isinstance(self.indices, Tensor) or self.indices.dtype != torch.int64 or self.indices.dim() != 1:
            raise ValueError(f"EpochPlan.indices must be int64[L], got {_describe(self.indices)}")
        if not isinstance(self.weights, Tensor) or self.weights.dtype != torch.float32 or self.weights.dim() != 1:
            raise ValueError(f"EpochPlan.weights must be float32[N], got {_describe(self.weights)}")
        if self.kind not in ("full", "prune"):
            raise ValueError(f"EpochPlan.kind must be 'full' or 'prune', got {self.kind!r}")
        n, length = self.weights.numel(), self.indices.numel()
        if self.saved != n - length:
            raise ValueError(f"EpochPlan.saved must be N - L = {n - length}, got {self.saved!r}")
        if length and (int(self.indices.min()) < 0 or int(self.indices.max()) >= n):
            raise ValueError(f"EpochPlan.indices must lie in [0, {n})")
        if not 0 <= self.num_kept_well_learned <= self.num_well_learned <= n:
            raise ValueError(
                "EpochPlan needs 0 <= num_kept_well_learned <= num_well_learned <= N, got "
                f"{self.num_kept_well_learned}, {self.num_well_learned}, {n}"
            )
        if self.kind == "full" and (length != n or not bool((self.weights == 1.0).all())):
            raise ValueError("a full EpochPlan visits all N samples with every weight exactly 1.0")

    @property
    def dataset_size(self) -> int:
        """``N``, the size of the training set."""
        return self.weights.numel()

    @property
    def epoch_size(self) -> int:
        """``L``, the number of samples visited this epoch (``len(indices)``)."""
        return self.indices.numel()

    def to_state(self) -> dict[str, Any]:
        """The plan as a dict of tensors, ints, floats and strings (loads with ``torch.load(weights_only=True)``).

        Tensors are copies: later changes to the state do not affect the plan.
        """
        return {
            "version": _PLAN_STATE_VERSION,
            "epoch": int(self.epoch),
            "indices": self.indices.clone(),
            "weights": self.weights.clone(),
            "kind": str(self.kind),
            "threshold": float(self.threshold),
            "num_well_learned": int(self.num_well_learned),
            "num_kept_well_learned": int(self.num_kept_well_learned),
            "saved": int(self.saved),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EpochPlan:
        """Inverse of :meth:`to_state` (tensors are copied to contiguous CPU tensors).

        Raises:
            KeyError: a field is missing. ValueError: unknown state version or inconsistent fields.
        """
        version = state.get("version", _PLAN_STATE_VERSION)
        if version != _PLAN_STATE_VERSION:
            raise ValueError(f"unknown EpochPlan state version {version!r} (expected {_PLAN_STATE_VERSION})")
        return cls(
            epoch=int(state["epoch"]),
            indices=state["indices"].detach().cpu().clone().contiguous(),
            weights=state["weights"].detach().cpu().clone().contiguous(),
            kind=str(state["kind"]),  # type: ignore[arg-type]
            threshold=float(state["threshold"]),
            num_well_learned=int(state["num_well_learned"]),
            num_kept_well_learned=int(state["num_kept_well_learned"]),
            saved=int(state["saved"]),
        )

    def __eq__(self, other: object) -> bool:
        """Exact equality of every field (tensors element-wise; two NaN thresholds are equal)."""
        if not isinstance(other, EpochPlan):
            return NotImplemented
        same_tau = self.threshold == other.threshold or (math.isnan(self.threshold) and math.isnan(other.threshold))
        return (
            self.epoch == other.epoch
            and self.kind == other.kind
            and same_tau
            and self.num_well_learned == other.num_well_learned
            and self.num_kept_well_learned == other.num_kept_well_learned
            and self.saved == other.saved
            and torch.equal(self.indices, other.indices)
            and torch.equal(self.weights, other.weights)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable tensors inside

    def __repr__(self) -> str:
        return (
            f"EpochPlan(epoch={self.epoch}, kind={self.kind!r}, N={self.dataset_size}, L={self.epoch_size}, "
            f"saved={self.saved}, threshold={self.threshold:.6g}, num_well_learned={self.num_well_learned}, "
            f"num_kept_well_learned={self.num_kept_well_learned})"
        )


def full_plan(dataset_size: int, epoch: int, seed: int = 0) -> EpochPlan:
    """The :class:`EpochPlan` of a full epoch: a uniform permutation of ``range(dataset_size)`` drawn from
    :func:`plan_generator` ``(seed, epoch)``, every weight exactly 1.0. It is what :func:`plan_epoch` returns for
    epoch 0, for an epoch without any seen score and for the annealing epochs ``>= epoch_stop(num_epochs, delta)``
    (Qin et al. 2024, Sec. 3.3), and what a run longer than its schedule (``InfoBatchCallback(num_epochs=E)`` with
    ``max_epochs > E``) trains in its epochs ``>= E``.

    Args:
        dataset_size: ``N``, a positive int. epoch: 0-based epoch index (``>= 0``). seed: any int.

    Raises:
        ValueError: ``dataset_size`` not a positive int, ``epoch`` not a non-negative int, ``seed`` not an int.
    """
    if not is_int(dataset_size) or dataset_size < 1:
        raise ValueError(f"dataset_size must be a positive int, got {dataset_size!r}")
    if not is_int(epoch) or epoch < 0:
        raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
    if not is_int(seed):
        raise ValueError(f"seed must be an int, got {seed!r}")
    n = int(dataset_size)
    return EpochPlan(
        epoch=int(epoch),
        indices=torch.randperm(n, generator=plan_generator(int(seed), int(epoch))),
        weights=torch.ones(n, dtype=torch.float32),
        kind="full",
        threshold=math.nan,
        num_well_learned=0,
        num_kept_well_learned=0,
        saved=0,
    )


def plan_epoch(
    score: Tensor,
    seen: Tensor,
    epoch: int,
    num_epochs: int,
    prune_ratio: float = 0.5,
    delta: float = 0.875,
    seed: int = 0,
) -> EpochPlan:
    """The :class:`EpochPlan` of ``epoch`` (Qin et al. 2024, Sec. 3 and Algorithm 1).

    - **full** if ``epoch == 0``, no score is seen, or ``epoch >= epoch_stop(num_epochs, delta)``: a permutation of
      ``range(N)``, every weight exactly 1.0 (:func:`full_plan`);
    - **prune** otherwise: ``tau, D1 = split_well_learned(score, seen)``; ``k = keep_count(|D1|, prune_ratio)``;
      ``K`` = ``k`` samples of D1 drawn uniformly *without replacement* (:func:`uniform_subset_of`); the epoch visits
      ``D2 ∪ K`` (``D2`` = all other samples, including unseen ones) in a uniformly random order; weights
      ``1 / (1 - r)`` (float32) on ``K``, 1.0 elsewhere.

    A pure function: the same inputs give an identical plan in any process; randomness comes only from
    :func:`plan_generator` ``(seed, epoch)``; the inputs and the global RNGs are left untouched. Cost O(N) plus one
    ``randperm`` of the epoch length (two half-size ones in two threads for large epochs); computed on the CPU (the
    tables may live anywhere and are copied).

    Args:
        score: ``float[N]`` score table (latest unweighted per-sample loss). seen: ``bool[N]``.
        epoch: 0-based epoch index, in ``[0, num_epochs)``. num_epochs: total epochs ``E`` of the schedule.
        prune_ratio: ``r`` in ``[0, 1)``. delta: ``δ`` in ``(0, 1]``. seed: any int (the user's seed).

    Raises:
        ValueError: invalid tables (shape, dtype, empty, non-finite seen score) or hyperparameters
            (see :func:`validate_hparams`, which also warns; this function does not warn); ``epoch`` not an int in
            ``[0, num_epochs)``: an epoch past the schedule has no InfoBatch plan (it would be a full epoch, the
            annealing rule's ``epoch >= floor(delta * num_epochs)``, but asking for one usually means a wrong
            ``num_epochs``; :func:`full_plan` gives it explicitly).
    """
    _check_tables(score, seen)
    if score.numel() == 0:
        raise ValueError("score table is empty: InfoBatch needs a training set with at least one sample")
    if not is_int(epoch) or epoch < 0:
        raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
    if not is_int(seed):
        raise ValueError(f"seed must be an int, got {seed!r}")
    epoch, seed = int(epoch), int(seed)
    r = _check_prune_ratio(prune_ratio)
    stop = epoch_stop(num_epochs, delta)
    if epoch >= num_epochs:
        raise ValueError(
            f"epoch={epoch} is past the schedule of num_epochs={num_epochs}: epoch must be an int in [0, "
            f"{num_epochs}) (0-based); pass the run's total epochs as num_epochs, or full_plan(N, epoch, seed) for "
            "an epoch after the schedule (it trains on the full data)"
        )
    n = score.numel()
    gen = plan_generator(seed, epoch)
    seen_cpu = seen.detach().cpu()

    if epoch == 0 or epoch >= stop or not bool(seen_cpu.any()):
        return full_plan(n, epoch, seed)

    tau, well_learned = split_well_learned(score, seen_cpu)
    m = int(well_learned.sum())
    k = keep_count(m, prune_ratio)
    length = n - m + k
    # The epoch order, a uniform permutation of the L visited samples (streams 1-3), is drawn while this thread draws
    # K, a uniform k-subset of D1 (stream 0). Large epochs use one Rao-Sandelius step: each position of the order
    # goes to the first or second half by a fair coin (stream 1), each half is shuffled in its own thread (streams 2,
    # 3); the concatenation is a uniform permutation.
    order_gen = plan_generator(seed, epoch, stream=1)
    if length >= _PARALLEL_FROM:
        first = torch.rand(length, generator=order_gen) < 0.5
        c0 = int(first.sum())
        halves = [
            _submit(torch.randperm, c, generator=plan_generator(seed, epoch, stream=st))
            for c, st in ((c0, 2), (length - c0, 3))
        ]
    else:
        order = torch.randperm(length, generator=order_gen)
    kept = uniform_subset_of(well_learned, k, gen)  # bool[N]
    members = (kept | ~well_learned).nonzero().flatten()  # D2 ∪ K in index order
    weights = torch.ones(n, dtype=torch.float32).masked_fill_(kept, float(1 / (1 - r)))
    if length >= _PARALLEL_FROM:
        parts = [
            _submit(torch.index_select, group, 0, half.result())
            for group, half in zip((members[first], members[~first]), halves)
        ]
        indices = torch.cat([part.result() for part in parts])
    else:
        indices = members.index_select(0, order)
    return EpochPlan(
        epoch=epoch,
        indices=indices,
        weights=weights,
        kind="prune",
        threshold=tau,
        num_well_learned=m,
        num_kept_well_learned=k,
        saved=n - length,
    )


def expected_saving(score: Tensor, seen: Tensor, prune_ratio: float) -> float:
    """Expected fraction of N not visited in a prune epoch planned from these tables: ``r * |D1| / N``
    (about 0.316 for exponential(1) scores and r = 0.5). The realised saving
    ``|D1| - floor((1 - r) |D1|)`` is at most one sample larger.

    Raises:
        ValueError: invalid tables (or empty), ``prune_ratio`` outside ``[0, 1)``.
    """
    r = _check_prune_ratio(prune_ratio)
    _check_tables(score, seen)
    if score.numel() == 0:
        raise ValueError("score table is empty")
    _, well_learned = split_well_learned(score, seen)
    return float(r * int(well_learned.sum()) / score.numel())


# ---------------------------------------------------------------------------------------------------------------
# Per batch: rescaling and scores
# ---------------------------------------------------------------------------------------------------------------


def _check_index(index: Any, what: str) -> None:
    if not isinstance(index, Tensor):
        raise TypeError(f"{what}: index must be an int64 tensor of dataset indices, got {type(index).__name__}")
    if index.dtype != torch.int64:
        raise TypeError(
            f"{what}: index must be int64 (dataset indices never pass through another dtype), got {index.dtype}"
        )
    if index.dim() != 1:
        raise ValueError(f"{what}: index must be 1-D (B,), got shape {tuple(index.shape)}")


def _check_per_sample_loss(per_sample_loss: Any, index: Tensor, what: str, allow_empty: bool = False) -> None:
    if not isinstance(per_sample_loss, Tensor):
        raise ValueError(
            f"{what}: per_sample_loss is a {type(per_sample_loss).__name__}, not a tensor. {PER_SAMPLE_LOSS_CONTRACT}"
        )
    if not per_sample_loss.is_floating_point():
        raise ValueError(
            f"{what}: per_sample_loss has dtype {per_sample_loss.dtype}, expected a float dtype. "
            f"{PER_SAMPLE_LOSS_CONTRACT}"
        )
    b = index.numel()
    if per_sample_loss.dim() != 1 or per_sample_loss.numel() != b:
        raise ValueError(
            f"{what}: per_sample_loss has shape {tuple(per_sample_loss.shape)} but the batch has "
            f"{b} samples (expected shape ({b},)). {PER_SAMPLE_LOSS_CONTRACT}"
        )
    if b == 0 and not allow_empty:
        raise ValueError(f"{what}: empty batch (B = 0)")


def _check_finite_scores(per_sample_loss: Tensor, what: str) -> None:
    """Refuse a non-finite value among the losses about to enter the score table: one NaN seen score would make
    every later threshold NaN (:func:`split_well_learned`)."""
    finite = torch.isfinite(per_sample_loss.detach())
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten()
        first = int(bad[0])
        raise ValueError(
            f"{what}: per_sample_loss has {bad.numel()} non-finite value(s) (the first, at position {first}, is "
            f"{float(per_sample_loss.detach()[first])}); a NaN or infinite loss never becomes a score: drop those "
            "samples first (e.g. mask = torch.isfinite(loss); pass index[mask], loss[mask]: they keep their "
            "previous score), as InfoBatchCallback does"
        )


def _gather(table: Tensor, index: Tensor, device: torch.device) -> Tensor:
    """``table[index]`` moved to ``device``; ``index`` stays int64 (bounds-checked, IndexError otherwise)."""
    idx = index.to(table.device)
    n = table.numel()
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= n:
        raise IndexError(f"dataset index {lo if lo < 0 else hi} out of range for a table of {n} samples")
    return table.index_select(0, idx).to(device)


def rescale(per_sample_loss: Tensor, index: Tensor, weights: Tensor) -> Tensor:
    """InfoBatch batch loss ``mean_i(weights[index_i] * per_sample_loss_i)`` (Qin et al. 2024, Eq. 4).

    The mean is over the B samples, deliberately *not* normalised by ``sum(w)``: that is what makes the expected
    epoch update match full-data training. Computed out of place in float32 (``per_sample_loss.float()``): the
    caller's tensor is not modified and autograd works for any loss (e.g. ``exp``, whose backward needs its output).

    Args:
        per_sample_loss: ``float[B]``, with grad, one loss per sample of the batch (any device).
        index: ``int64[B]``, the dataset indices of the batch (any device).
        weights: ``float[N]``, the plan's weight table (usually CPU); gathered by ``index`` onto the loss's device.

    Returns:
        A scalar float32 tensor on ``per_sample_loss.device``.

    Raises:
        ValueError: ``per_sample_loss`` is not a 1-D float tensor of length ``len(index)`` (a scalar, a ``(1,)``
            tensor for ``B > 1``, a ``(B, T)`` tensor...), empty batch, bad ``weights``; the message states the
            ``training_step`` contract.
        TypeError: ``index`` is not an int64 tensor.
        IndexError: an index outside ``[0, N)``.
    """
    _check_index(index, "rescale")
    _check_per_sample_loss(per_sample_loss, index, "rescale")
    if not isinstance(weights, Tensor) or weights.dim() != 1 or not weights.is_floating_point():
        raise ValueError(f"rescale: weights must be a 1-D float tensor float32[N], got {_describe(weights)}")
    w = _gather(weights, index, per_sample_loss.device).float()
    return (per_sample_loss.float() * w).mean()


def update_scores(score: Tensor, seen: Tensor, index: Tensor, per_sample_loss: Tensor, momentum: float = 1.0) -> None:
    """Record a batch's raw (unweighted) losses in the score table, in place.

    ``score[index] <- loss`` (``momentum == 1``, the paper's overwrite) or, for samples already seen,
    ``score[index] <- m * loss + (1 - m) * score[index]`` (EMA, timm fork); a first observation is always a plain
    overwrite. ``seen[index] <- True``. The loss is detached and converted to the table's dtype and device.
    With duplicate indices in one batch, one of the duplicates' values is stored (use :func:`accumulate` to
    average them). An empty batch (``B = 0``, e.g. after filtering non-finite losses) is a no-op.

    Args:
        score: ``float32[N]`` table. seen: ``bool[N]``. index: ``int64[B]``. per_sample_loss: ``float[B]``.
        momentum: ``m`` in ``(0, 1]``.

    Raises:
        TypeError: ``index`` is not int64. ValueError: shapes, dtypes or ``momentum`` invalid; a NaN or infinite
            ``per_sample_loss`` (naming its position: filter non-finite losses out first, they never become scores).
        IndexError: an index outside ``[0, N)``.
    """
    _check_tables(score, seen)
    _check_index(index, "update_scores")
    _check_per_sample_loss(per_sample_loss, index, "update_scores", allow_empty=True)
    _check_finite_scores(per_sample_loss, "update_scores")
    if isinstance(momentum, bool) or not isinstance(momentum, Real) or not 0 < momentum <= 1:
        raise ValueError(f"momentum must be a number in (0, 1], got {momentum!r}")
    if index.numel() == 0:
        return
    idx = index.to(score.device)
    assert idx.dtype == torch.int64  # indices stay int64 up to the table assignment (exact beyond 2**24)
    n = score.numel()
    if int(idx.min()) < 0 or int(idx.max()) >= n:
        raise IndexError(f"dataset index out of range for a table of {n} samples")
    loss = per_sample_loss.detach().to(device=score.device, dtype=score.dtype)
    if not bool(torch.isfinite(loss).all()):
        bad = int((~torch.isfinite(loss)).nonzero()[0, 0])
        raise ValueError(
            f"update_scores: per_sample_loss[{bad}] = {float(per_sample_loss.reshape(-1)[bad])!r} overflows the "
            f"{score.dtype} score table (largest {torch.finfo(score.dtype).max:.3g})"
        )
    if momentum != 1:
        old = score.index_select(0, idx)
        loss = torch.where(seen.to(score.device).index_select(0, idx), momentum * loss + (1 - momentum) * old, loss)
    score[idx] = loss
    seen[idx.to(seen.device)] = True


def accumulate(sum_loss: Tensor, count: Tensor, index: Tensor, loss: Tensor) -> None:
    """Epoch-level score accumulation, in place: ``sum_loss[index] += loss``, ``count[index] += 1``.

    Duplicates (DDP padding) are summed correctly (``index_add_``). An empty batch is a no-op. At the end of the
    epoch, ``all_reduce(SUM)`` both buffers across ranks, then call :func:`finalize`.

    Args:
        sum_loss: ``float[N]`` (float32 or float64). count: integer ``[N]`` (int32 or int64).
        index: ``int64[B]``. loss: ``float[B]`` raw per-sample losses (detached here).

    Raises:
        TypeError: ``index`` is not int64. ValueError: shapes or dtypes invalid; a NaN or infinite ``loss`` (filter
            non-finite losses out first: they never become scores). IndexError: index out of range.
    """
    _check_buffers(sum_loss, count)
    _check_index(index, "accumulate")
    _check_per_sample_loss(loss, index, "accumulate", allow_empty=True)
    _check_finite_scores(loss, "accumulate")
    if index.numel() == 0:
        return
    idx = index.to(sum_loss.device)
    assert idx.dtype == torch.int64
    n = sum_loss.numel()
    if int(idx.min()) < 0 or int(idx.max()) >= n:
        raise IndexError(f"dataset index out of range for a table of {n} samples")
    sum_loss.index_add_(0, idx, loss.detach().to(device=sum_loss.device, dtype=sum_loss.dtype))
    count.index_add_(0, idx.to(count.device), torch.ones(idx.numel(), dtype=count.dtype, device=count.device))


def finalize(sum_loss: Tensor, count: Tensor, score: Tensor, seen: Tensor, momentum: float = 1.0) -> None:
    """Fold the (all-reduced) epoch accumulators into the score table, in place.

    Where ``count > 0``: ``new = sum_loss / count`` (the mean over the epoch's observations, e.g. DDP padding
    duplicates), then ``score <- new`` (``momentum == 1``) or ``m * new + (1 - m) * score`` for already-seen
    samples; ``seen |= count > 0``. Elsewhere nothing changes. The accumulators are not reset (zero them yourself).

    Raises:
        ValueError: shapes, dtypes or ``momentum`` invalid.
    """
    _check_buffers(sum_loss, count)
    _check_tables(score, seen)
    if sum_loss.shape != score.shape:
        raise ValueError(f"accumulators have shape {tuple(sum_loss.shape)}, score table {tuple(score.shape)}")
    if not 0 < momentum <= 1:
        raise ValueError(f"momentum must be in (0, 1], got {momentum!r}")
    hit = (count > 0).to(score.device)
    new = (sum_loss.double() / count.clamp_min(1).double()).to(device=score.device, dtype=score.dtype)
    if momentum != 1:
        new = torch.where(seen.to(score.device), momentum * new + (1 - momentum) * score, new)
    score.copy_(torch.where(hit, new, score))
    seen |= hit.to(seen.device)


def _check_buffers(sum_loss: Tensor, count: Tensor) -> None:
    if not isinstance(sum_loss, Tensor) or sum_loss.dim() != 1 or not sum_loss.is_floating_point():
        raise ValueError(f"sum_loss must be a 1-D float tensor [N], got {_describe(sum_loss)}")
    if (
        not isinstance(count, Tensor)
        or count.shape != sum_loss.shape
        or count.is_floating_point()
        or count.dtype == torch.bool
        or count.is_complex()
    ):
        raise ValueError(f"count must be an integer tensor of shape {tuple(sum_loss.shape)}, got {_describe(count)}")


# ---------------------------------------------------------------------------------------------------------------
# Per-sample tokens: the baseline of samples of unequal length (accounting only, never the method)
# ---------------------------------------------------------------------------------------------------------------


def record_tokens(pending: Tensor, index: Tensor, tokens: Tensor) -> None:
    """Add one batch's per-sample tokens to the rank-local accumulator, in place: ``pending[0, i] += tokens``,
    ``pending[1, i] += 1`` for each sample ``i`` of ``index`` (a sample seen twice, as a DDP padding duplicate, is
    averaged by :func:`merge_tokens`).

    Args:
        pending: float64 ``[2, N]``: the sums of tokens and the counts of observations since the last merge.
        index: int64 ``[B]``, dataset positions. tokens: ``[B]``, the real tokens of each sample (a number ``>= 0``).

    Raises:
        TypeError: ``index`` not an int64 tensor.
        ValueError: shapes that do not match, an index outside ``[0, N)``.
    """
    if (
        not isinstance(pending, Tensor)
        or pending.dim() != 2
        or pending.shape[0] != 2
        or not pending.is_floating_point()
    ):
        raise ValueError(f"pending must be a float tensor [2, N], got {_describe(pending)}")
    _check_index(index, "index")
    if not isinstance(tokens, Tensor) or tuple(tokens.shape) != tuple(index.shape):
        raise ValueError(
            f"tokens must be a tensor of shape {tuple(index.shape)} (one per sample), got {_describe(tokens)}"
        )
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= pending.shape[1]):
        raise ValueError(f"index holds positions outside [0, {pending.shape[1]})")
    index = index.to(pending.device)
    pending[0].index_add_(0, index, tokens.to(device=pending.device, dtype=pending.dtype))
    pending[1].index_add_(0, index, torch.ones(index.numel(), dtype=pending.dtype, device=pending.device))


def merge_tokens(table: Tensor, pending: Tensor) -> None:
    """Fold the (all-reduced) accumulator of :func:`record_tokens` into the per-sample token table, in place: where
    a sample was observed, its entry becomes the mean of its observations (its tokens when it trained last);
    elsewhere it keeps its value (``-1``: never trained). The accumulator is not reset.

    Args:
        table: float64 ``[N]``, ``-1`` where unknown. pending: float64 ``[2, N]``.
    """
    if tuple(pending.shape) != (2, *table.shape):
        raise ValueError(f"pending must have shape (2, {table.numel()}), got {tuple(pending.shape)}")
    hit = pending[1] > 0
    table.copy_(torch.where(hit, pending[0] / pending[1].clamp_min(1), table))


def token_ratio(table: Tensor, trained: Tensor) -> float | None:
    """``mean(tokens of the training set) / mean(tokens of the trained samples)``: how much longer a sample drawn
    from the whole training set is than one the epoch trains, so that the pruned samples are charged at their own
    length (InfoBatch prunes the well-learned samples, which need not have the mean length). Entries still unknown
    (``-1``: never trained yet, e.g. under ``limit_train_batches``) are left out of both means.

    Args:
        table: float64 ``[N]``, the tokens of each sample (:func:`merge_tokens`), ``-1`` where unknown.
        trained: int64 ``[K]``, the dataset positions the epoch trains.

    Returns:
        The ratio (a float > 0), or None when it cannot be read: no known entry among ``trained`` or in the table,
        or a known mean of 0 tokens.
    """
    known = table >= 0
    mine = trained[known[trained]]
    if not bool(known.any()) or mine.numel() == 0:
        return None
    every, own = float(table[known].mean()), float(table[mine].mean())
    if not (every > 0 and own > 0):
        return None
    return every / own


# ---------------------------------------------------------------------------------------------------------------
# Per-sample loss of a module that returns a plain loss (the automatic path)
# ---------------------------------------------------------------------------------------------------------------

#: the label value cross-entropy ignores (PyTorch's and Hugging Face's default)
IGNORE_INDEX = -100
#: batch keys (or attributes) that hold the labels, in the order they are looked up
LABEL_KEYS = ("labels", "label", "targets", "target", "y")
#: what a user whose module the automatic path cannot serve does instead
PER_SAMPLE_LOSS_HINT = (
    "pass InfoBatchCallback(per_sample_loss=fn) with fn(outputs, batch) -> float[B] (outputs: the forward output "
    'captured during training_step, batch: your batch), or return {"loss": ..., "per_sample_loss": ...} from '
    "training_step"
)


def find_logits(outputs: Any) -> Tensor | None:
    """The logits in a forward output: the output itself when it is a tensor, ``outputs["logits"]`` for a mapping
    (a dict, a Hugging Face ``ModelOutput``), else ``outputs.logits`` (a dataclass or any object); None otherwise
    (a tuple output is ambiguous and gives None)."""
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    else:
        logits = getattr(outputs, "logits", None)
    return logits if isinstance(logits, Tensor) else None


def _locate_labels(batch: Any) -> tuple[Tensor | None, str]:
    """The labels of ``batch`` and where they are, for messages (``batch['labels']``, ``batch.label``, ``batch[2]
    (the last element of the tuple batch)``); ``(None, "")`` when there are none. See :func:`find_labels`."""
    if isinstance(batch, Mapping):
        for key in LABEL_KEYS:
            value = batch.get(key)
            if isinstance(value, Tensor):
                return value, f"batch[{key!r}]"
        return None, ""
    for key in LABEL_KEYS:
        value = getattr(batch, key, None)
        if isinstance(value, Tensor):
            return value, f"batch.{key}"
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[-1], Tensor):
        return batch[-1], f"batch[{len(batch) - 1}] (the last element of the {type(batch).__name__} batch)"
    return None, ""


def find_labels(batch: Any) -> Tensor | None:
    """The labels in a batch: the first of :data:`LABEL_KEYS` that is a tensor key of a mapping (a dict, an HF
    ``BatchEncoding``) or a tensor attribute (a dataclass, a named tuple, any object), else the last element of a
    tuple or list batch of at least two elements (``(x, y)``); None otherwise (a bare tensor batch)."""
    return _locate_labels(batch)[0]


def labels_source(batch: Any) -> str:
    """Where :func:`find_labels` takes the labels of ``batch`` from, for messages: ``batch['labels']``,
    ``batch.label``, or ``batch[2] (the last element of the tuple batch)``; ``""`` when it finds none."""
    return _locate_labels(batch)[1]


def _check_class_indices(labels: Tensor, classes: int, ignore_index: int, shape: torch.Size) -> None:
    """Raise unless every label other than ``ignore_index`` is a class index in ``[0, classes)``: checked before the
    cross-entropy, which otherwise fails deep in torch (``IndexError: Target 1 is out of bounds`` on the CPU, a
    device-side assert that kills the process on CUDA). One device synchronisation (a flag is read)."""
    labelled = labels != ignore_index
    if not bool((labelled & ((labels < 0) | (labels >= classes))).any()):
        return
    valid = labels[labelled]
    lo, hi = int(valid.min()), int(valid.max())
    guess = (
        " ([B, 1] logits with 0/1 labels: a binary cross-entropy?)"
        if classes == 1
        else f" (negative labels: an ignore_index other than {ignore_index}?)"
        if lo < 0
        else ""
    )
    raise ValueError(
        f"the labels (other than ignore_index={ignore_index}) range over [{lo}, {hi}], outside the {classes} "
        f"class(es) [0, {classes}) of the logits {tuple(shape)}{guess}: the loss is not a cross-entropy over the "
        "logits' classes"
    )


def per_sample_cross_entropy(
    logits: Tensor, labels: Tensor, shift: bool = False, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """Cross-entropy per sample, computed in float32 (out of place, with grad through ``logits``).

    - ``logits [B, C]`` with class indices ``labels [B]`` (``ignore_index`` gives 0), or class probabilities
      ``labels [B, C]`` (float): ``F.cross_entropy(..., reduction="none")``, shape ``[B]``;
    - ``logits [B, T, V]`` with ``labels [B, T]``: the token losses averaged over each sample's tokens whose label is
      not ``ignore_index`` (a sample without one gives 0). ``shift=True`` is the causal-LM shift of Hugging Face's
      ``*ForCausalLM`` losses: ``logits[:, :-1]`` against ``labels[:, 1:]``.

    Returns:
        ``float32[B]`` on ``logits.device``.

    Raises:
        ValueError: other ranks or shapes, integer logits, float labels for ``[B, T, V]`` logits, ``shift`` with
            ``[B, C]`` logits, integer labels (other than ``ignore_index``) outside ``[0, C)`` / ``[0, V)`` (checked
            before the cross-entropy: e.g. a binary cross-entropy on ``[B, 1]`` logits, or a loss ignoring ``-1``).
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise ValueError(f"per_sample_cross_entropy: logits must be a float tensor, got {_describe(logits)}")
    if not isinstance(labels, Tensor):
        raise ValueError(f"per_sample_cross_entropy: labels must be a tensor, got {_describe(labels)}")
    if logits.dim() == 2:
        if shift:
            raise ValueError("per_sample_cross_entropy: shift applies to [B, T, V] logits, got [B, C]")
        if labels.is_floating_point() and labels.shape == logits.shape:  # class probabilities
            return F.cross_entropy(logits.float(), labels.float(), reduction="none")
        if labels.shape != logits.shape[:1] or labels.is_floating_point() or labels.dtype == torch.bool:
            raise ValueError(
                f"per_sample_cross_entropy: logits [B, C] = {tuple(logits.shape)} need integer labels [B] "
                f"or float probabilities [B, C]; got {_describe(labels)}"
            )
        _check_class_indices(labels, logits.shape[-1], ignore_index, logits.shape)
        return F.cross_entropy(logits.float(), labels.long(), reduction="none", ignore_index=ignore_index)
    if logits.dim() == 3:
        if labels.shape != logits.shape[:2] or labels.is_floating_point() or labels.dtype == torch.bool:
            raise ValueError(
                f"per_sample_cross_entropy: logits [B, T, V] = {tuple(logits.shape)} need integer labels [B, T] "
                f"= {tuple(logits.shape[:2])}; got {_describe(labels)}"
            )
        _check_class_indices(labels, logits.shape[-1], ignore_index, logits.shape)
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        b, t = labels.shape
        labels = labels.long()
        if t == 0:  # a shifted one-token sequence: no token has a label (0, with the graph kept)
            return logits.float().sum((1, 2)) * 0.0
        tokens = F.cross_entropy(
            logits.reshape(b * t, logits.shape[-1]).float(),
            labels.reshape(b * t),
            reduction="none",
            ignore_index=ignore_index,
        ).view(b, t)
        counts = (labels != ignore_index).sum(1)
        return tokens.sum(1) / counts.clamp(min=1)
    raise ValueError(f"per_sample_cross_entropy: logits must be [B, C] or [B, T, V], got shape {tuple(logits.shape)}")


#: the machine epsilon of the least precise loss dtype :func:`auto_per_sample_loss` checks: float16's, ``2**-10``
#: (a bfloat16 loss, with ``2**-7``, is refused, see there)
CHECKABLE_EPS = torch.finfo(torch.float16).eps


def loss_tolerance(*tensors: Tensor) -> float:
    """Relative tolerance of :func:`losses_agree`: ``max(1e-4, 4 eps)`` of the least precise float dtype among
    ``tensors`` (float32: 1e-4; float16: 3.9e-3; bfloat16: 3.1e-2, which is why :func:`auto_per_sample_loss` refuses
    a bfloat16 loss). With the automatic path's float32 per-sample loss, the step loss's dtype sets it: a plain
    cross-entropy computed in float16 differs from the float32 one by its rounding, measured at most 1.7e-3 (2.9
    units in the last place) over random ``[B, C]`` logits, so an extra term above 0.4% of the loss is refused."""
    eps = max((torch.finfo(t.dtype).eps for t in tensors if t.is_floating_point()), default=0.0)
    return max(1e-4, 4 * eps)


def losses_agree(per_sample_loss: Tensor, loss: Tensor, rtol: float | None = None) -> bool:
    """``|mean(per_sample_loss) - loss| <= 1e-6 + rtol · |loss|`` (float64; ``rtol``: :func:`loss_tolerance` of
    both by default). Synchronises with the device (two scalars are read)."""
    rtol = loss_tolerance(per_sample_loss, loss) if rtol is None else rtol
    mean, value = float(per_sample_loss.detach().double().mean()), float(loss.detach().double())
    return abs(mean - value) <= 1e-6 + rtol * abs(value)


def finite_losses_disagree(per_sample_loss: Tensor, loss: Tensor) -> bool:
    """Whether ``mean(per_sample_loss)`` and ``loss`` are both finite and differ beyond :func:`losses_agree`'s
    tolerance (a non-finite loss is the non-finite policy's business, not a disagreement). Computed on the device in
    float64 and read once (one synchronisation a call, for a check run at every batch)."""
    rtol = loss_tolerance(per_sample_loss, loss)
    mean = per_sample_loss.detach().double().mean()
    value = loss.detach().double().reshape(())
    finite = torch.isfinite(mean) & torch.isfinite(value)
    return bool(finite & ((mean - value).abs() > 1e-6 + rtol * value.abs()))


def _token_counts(labels: Tensor, shift: bool) -> Tensor:
    labels = labels[:, 1:] if shift else labels
    return (labels != IGNORE_INDEX).sum(1)


class AutoLoss(NamedTuple):
    """The result of :func:`auto_losses`.

    Attributes:
        per_sample: ``float32[B]`` with grad, whose mean reproduces the step's loss: each sample's cross-entropy (its
            tokens' mean for ``[B, T, V]`` logits), or, for a loss that is the mean over the batch's labelled tokens
            (``token_mean``), each sample's token sum times ``B / (the batch's labelled tokens)``.
        scores: ``float32[B]``, detached: each sample's mean token loss (its cross-entropy for ``[B, C]``), the
            score InfoBatch ranks it by; NaN for a sample without a labelled token (a masked LM's draw that masked
            none of its tokens, a sample all of whose labels are ``-100``): such a sample is not scored.
        shift: the causal-LM shift used (``[B, T, V]``; False for ``[B, C]``).
        token_mean: whether the step's loss is the mean over the batch's labelled tokens (Hugging Face's
            language-model losses over padded or masked batches; torch's ``F.cross_entropy`` over ``[B, C]`` logits
            with ``-100`` labels) rather than the mean of the samples' means; None when this batch cannot tell
            (both reproduce the loss: every sample has as many labelled tokens, or the values agree within the
            tolerance), in which case ``per_sample`` weighs by the labelled tokens, the Hugging Face and torch
            default.
    """

    per_sample: Tensor
    scores: Tensor
    shift: bool
    token_mean: bool | None


def auto_per_sample_loss(
    outputs: Any, batch: Any, loss: Tensor, shift: bool | None = None, verify: bool = True
) -> tuple[Tensor, bool]:
    """``(per_sample, shift)`` of :func:`auto_losses` (same arguments and errors)."""
    found = auto_losses(outputs, batch, loss, shift, verify=verify)
    return found.per_sample, found.shift


def _labelled(logits: Tensor, labels: Tensor, shift: bool) -> Tensor:
    """Each sample's labelled entries (not ``ignore_index``): tokens for ``[B, T, V]``, 0 / 1 for ``[B, C]`` (1 for
    class probabilities)."""
    if logits.dim() == 3:
        return _token_counts(labels, shift)
    if labels.is_floating_point():
        return torch.ones(labels.shape[0], dtype=torch.long, device=labels.device)
    return (labels != IGNORE_INDEX).long()


def _auto(per_sample: Tensor, counts: Tensor, s: bool, token_mean: bool) -> AutoLoss:
    counts = counts.to(per_sample.device)
    scores = torch.where(counts > 0, per_sample.detach(), torch.full_like(per_sample.detach(), float("nan")))
    if token_mean:
        weights = counts.to(per_sample.dtype) * (per_sample.numel() / counts.sum().clamp(min=1))
        per_sample = per_sample * weights
    return AutoLoss(per_sample, scores, s, token_mean)


def auto_losses(
    outputs: Any,
    batch: Any,
    loss: Tensor,
    shift: bool | None = None,
    token_mean: bool | None = None,
    verify: bool = True,
) -> AutoLoss:
    """The per-sample loss of a module whose ``training_step`` returns a plain cross-entropy ``loss``: the logits of
    its forward output (:func:`find_logits`) against the batch's labels (:func:`find_labels`), per sample
    (:func:`per_sample_cross_entropy`, ``ignore_index=-100``), checked against ``loss``: their mean must reproduce it
    (:func:`losses_agree`), so that InfoBatch never trains on another loss than the one the module wrote. A loss
    that is the mean over the batch's labelled tokens (a Hugging Face language model's over a padded or masked
    batch, where samples with more labelled tokens weigh more) is reproduced by weighing each sample's mean by its
    labelled tokens (:class:`AutoLoss`); the samples' scores are their mean token losses either way, and a sample
    without a labelled token is not scored.

    With ``[B, T, V]`` logits and ``shift=None`` both alignments are tried (labels as given, and the causal-LM shift
    of Hugging Face's ``*ForCausalLM``): the one that reproduces ``loss`` is returned with its ``shift``, to pass on
    the next batches.

    Args:
        outputs: the forward output (a tensor, a mapping or object with ``logits``). batch: the user's batch.
        loss: the scalar loss ``training_step`` returned for this batch. shift: None (detect), True or False.
        token_mean: the reduction detected on an earlier batch (:attr:`AutoLoss.token_mean`), which this batch
            must reproduce; None: detect (the same values can come from both reductions on one batch, with
            different gradients, so the caller keeps the first one a batch tells apart).
        verify: False skips the check against ``loss`` (for a non-finite loss, which cannot be checked); then
            ``shift`` must be given for ``[B, T, V]`` logits, and the reduction ``token_mean`` says (the samples'
            means when None) is returned.

    Returns:
        an :class:`AutoLoss`.

    The per-sample losses and the comparison are computed in float32 / float64 from the logits, whatever their
    dtype; the tolerance is :func:`loss_tolerance`, set by the loss's dtype. A bfloat16 ``loss`` (``precision=
    "bf16-true"`` with the loss computed in bfloat16) is refused: its rounding alone reaches about 1% of a plain
    cross-entropy (measured up to 1.1% against the float32 one over random ``[B, C]`` logits, 2.2 units in the last
    place), so an auxiliary term of a few percent could not be told from rounding and would be silently dropped.

    Raises:
        ValueError: no logits or no labels found, shapes that are not ``[B, C]`` / ``[B, T, V]`` with matching
            labels, labels outside the logits' classes (a binary cross-entropy on ``[B, 1]`` logits, a loss ignoring
            ``-1``...), a bfloat16 ``loss`` (or any loss dtype coarser than float16, :data:`CHECKABLE_EPS`), or a
            mean that does not reproduce ``loss`` (label smoothing, class weights, a loss over the batch's tokens
            with padding, an extra term...); each message says what to pass instead (:data:`PER_SAMPLE_LOSS_HINT`).
    """
    logits = find_logits(outputs)
    if logits is None:
        raise ValueError(
            "the automatic per-sample loss needs the forward output's logits (a tensor, outputs['logits'] or "
            f"outputs.logits); the forward output captured during training_step is {_describe(outputs)}; "
            + PER_SAMPLE_LOSS_HINT
        )
    labels = find_labels(batch)
    if labels is None:
        raise ValueError(
            f"the automatic per-sample loss needs labels in the batch (a key or attribute {list(LABEL_KEYS)}, or the "
            f"last element of a tuple batch); the batch is a {type(batch).__name__}; " + PER_SAMPLE_LOSS_HINT
        )
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(f"the automatic per-sample loss needs the step's scalar loss, got {_describe(loss)}")
    if loss.is_floating_point() and torch.finfo(loss.dtype).eps > CHECKABLE_EPS:
        bits = round(1 - math.log2(torch.finfo(loss.dtype).eps))
        raise ValueError(
            f"the automatic per-sample loss cannot check a {loss.dtype} loss (precision='bf16-true' with the loss "
            f"computed in bfloat16): with {bits} significant bits, the rounding of a plain cross-entropy alone "
            "reaches about 1% of its value, so an extra term of that size (an auxiliary loss, a regulariser) could "
            "not be told apart and InfoBatch would silently train without it; compute the loss in float32 (e.g. "
            "F.cross_entropy(logits.float(), labels) + aux, then checked to 1e-4), or " + PER_SAMPLE_LOSS_HINT
        )
    if not verify and shift is None and logits.dim() == 3:
        raise ValueError("auto_per_sample_loss: verify=False needs shift (True or False) for [B, T, V] logits")
    try:
        shifts = [False] if logits.dim() == 2 else [False, True] if shift is None else [shift]
        candidates = [(s, per_sample_cross_entropy(logits, labels, s)) for s in shifts]
    except ValueError as err:
        raise ValueError(
            f"the automatic per-sample loss does not apply: {err} (labels from {labels_source(batch)}); "
            + PER_SAMPLE_LOSS_HINT
        ) from None
    if not verify:
        s, per_sample = candidates[0]
        return _auto(per_sample, _labelled(logits, labels, s), s, bool(token_mean))
    if not bool(torch.isfinite(loss.detach())):
        raise ValueError(
            f"the automatic per-sample loss cannot be checked against a non-finite loss ({float(loss.detach())}); "
            + PER_SAMPLE_LOSS_HINT
        )
    class_probabilities = logits.dim() == 2 and labels.is_floating_point()
    reductions = [False] if class_probabilities else [False, True] if token_mean is None else [token_mean]
    for s, per_sample in candidates:
        counts = _labelled(logits, labels, s)
        agree = [r for r in reductions if losses_agree(_auto(per_sample, counts, s, r).per_sample, loss)]
        if not agree:
            continue
        if len(agree) == 2:  # both reproduce the loss on this batch: the labelled-token mean, told as undecided
            return _auto(per_sample, counts, s, True)._replace(token_mean=None)
        return _auto(per_sample, counts, s, agree[0])
    means = "; ".join(
        f"{'with' if s else 'without'} the causal shift: mean {float(p.detach().double().mean()):.6g}"
        if logits.dim() == 3
        else f"mean {float(p.detach().double().mean()):.6g}"
        for s, p in candidates
    )
    raise ValueError(
        f"the automatic per-sample loss (cross-entropy of logits {tuple(logits.shape)} against labels "
        f"{tuple(labels.shape)} from {labels_source(batch)}, ignore_index={IGNORE_INDEX}, averaged per sample) "
        "does not reproduce the loss "
        f"training_step returned ({float(loss.detach()):.6g}; {means}; relative tolerance "
        f"{loss_tolerance(candidates[0][1], loss):.2g}): your loss is not plain cross-entropy of these logits "
        f"and labels (label smoothing, class weights, an extra term, other logits, labels elsewhere in the batch: a "
        "tuple batch's labels are taken from its last element...), neither as the mean of the samples' means nor "
        "as the mean over the batch's labelled entries"
        + (
            ""
            if token_mean is None
            else f" (this run's earlier batches gave the {'labelled-token mean' if token_mean else 'samples means'}"
            ", which this one must reproduce)"
        )
        + ". InfoBatch will not train on another loss than yours: "
        + PER_SAMPLE_LOSS_HINT
    )


# ---------------------------------------------------------------------------------------------------------------
# Thinning inside another sampler's micro-batches (InfoBatch composed with the curriculum)
# ---------------------------------------------------------------------------------------------------------------

#: Purpose key of the thinning generators (another stream than the epoch plans' ``_PURPOSE``).
_THIN_PURPOSE = int.from_bytes(b"IBthin", "little")


class ThinnedBatch(NamedTuple):
    """The result of :func:`thin_micro_batch`.

    Attributes:
        ids: ``int64[B_kept]``, the kept candidates, in their candidate order (``1 <= B_kept <= B``).
        weights: ``float32[B_kept]``, ``1 / (1 - r)`` for a kept well-learned candidate, 1.0 for the others.
        capped: the slice is one where dropping ``r·k`` rounded up could empty it (every candidate well-learned and
            ``r·B > B - 1``, only possible in a slice smaller than the micro-batch size), so exactly one sample was
            kept (see :func:`drop_count`).
        keep: ``bool[B]``, which candidates were kept (``ids == candidates[keep]``).
    """

    ids: Tensor
    weights: Tensor
    capped: bool
    keep: Tensor


def thin_generator(seed: int, step: int, micro: int, rank: int) -> torch.Generator:
    """Private CPU generator of one micro-batch slice's thinning:
    ``manual_seed(hash64(seed, PURPOSE, step, micro, rank))`` with ``PURPOSE = int.from_bytes(b"IBthin", "little")``.

    A pure function of the InfoBatch seed, the curriculum step (1-based), the micro-batch index within the step and
    the data-parallel rank: the same slice is thinned identically in every run, after any resume, whatever the global
    RNGs hold.

    Raises:
        TypeError: an argument is not an int.
    """
    keys = (seed, step, micro, rank)
    if not all(is_int(k) for k in keys):
        raise TypeError(f"thin_generator needs ints (seed, step, micro, rank), got {keys!r}")
    return torch.Generator(device="cpu").manual_seed(hash64(int(seed), _THIN_PURPOSE, *(int(k) for k in keys[1:])))


def check_thinning_ratio(prune_ratio: float, micro_batch_size: int) -> None:
    """Check that thinning a full micro-batch can never empty it: ``r <= 1 - 1 / micro_batch_size`` (exact).

    With ``B = micro_batch_size`` candidates, all well-learned, :func:`drop_count` drops ``floor(r·B)`` or one more;
    ``r·B <= B - 1`` keeps at least one. (A smaller tail slice relies on the cap of :func:`drop_count`.)

    Raises:
        ValueError: ``micro_batch_size`` not a positive int, ``prune_ratio`` outside ``[0, 1)`` or above
            ``1 - 1 / micro_batch_size`` (the message names both and the largest ratio allowed).
    """
    if not is_int(micro_batch_size) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    r = _check_prune_ratio(prune_ratio)
    allowed = 1 - Fraction(1, int(micro_batch_size))
    if r > allowed:
        raise ValueError(
            f"prune_ratio={prune_ratio} is too large for micro-batches of {int(micro_batch_size)} samples: InfoBatch "
            f"thins each micro-batch drawn by the curriculum and must never empty one, so prune_ratio must be <= "
            f"1 - 1/micro_batch_size = {float(allowed):.6g} (raise the batch size or lower prune_ratio)"
        )


def thin_stop_step(total_steps: int, delta: float) -> int:
    """Last curriculum step that is thinned: ``floor(delta * total_steps)``, exact (``delta`` read as the decimal it
    prints as, as in :func:`epoch_stop`). Steps ``s > floor(delta * T)`` (1-based) train on every drawn sample.

    Raises:
        ValueError: ``total_steps`` not a positive int, ``delta`` outside ``(0, 1]``.
    """
    if not is_int(total_steps) or total_steps < 1:
        raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
    return math.floor(_check_delta(delta) * int(total_steps))


def _check_slice(num_candidates: int, num_well_learned: int) -> tuple[int, int]:
    if not is_int(num_candidates) or num_candidates < 1:
        raise ValueError(f"num_candidates must be a positive int (a slice is never empty), got {num_candidates!r}")
    if not is_int(num_well_learned) or not 0 <= num_well_learned <= num_candidates:
        raise ValueError(f"num_well_learned must be an int in [0, {num_candidates}], got {num_well_learned!r}")
    return int(num_candidates), int(num_well_learned)


def cap_applies(num_candidates: int, num_well_learned: int, prune_ratio: float) -> bool:
    """Whether :func:`drop_count` can reach ``B`` (and is capped to ``B - 1``): ``k == B`` and ``r·B > B - 1``.

    Never true for a full micro-batch that passed :func:`check_thinning_ratio`; possible for a smaller tail slice.

    Raises:
        ValueError: invalid counts or ``prune_ratio``.
    """
    b, k = _check_slice(num_candidates, num_well_learned)
    return k == b and _check_prune_ratio(prune_ratio) * b > b - 1


def drop_count(
    num_candidates: int, num_well_learned: int, prune_ratio: float, generator: torch.Generator
) -> tuple[int, bool]:
    """How many of the ``k`` well-learned candidates of a slice of ``B`` are dropped.

    ``m = floor(r·k) + Bernoulli(r·k - floor(r·k))`` (exact rational arithmetic; the Bernoulli is one float64
    ``torch.rand`` from ``generator``, drawn only when the fractional part is not 0), so ``E[m] = r·k`` exactly and
    each well-learned candidate, dropped as one of a uniform ``m``-subset, is kept with probability exactly ``1 - r``
    (Qin et al., ICLR 2024, Sec. 3: the rescaled loss is then unbiased). A slice is never emptied: when ``m`` would
    equal ``B`` (only if :func:`cap_applies`), ``m = B - 1``.

    Returns:
        ``(m, capped)`` with ``capped = cap_applies(B, k, r)``.

    Raises:
        ValueError: invalid counts or ``prune_ratio``.
    """
    b, k = _check_slice(num_candidates, num_well_learned)
    rk = _check_prune_ratio(prune_ratio) * k
    m = math.floor(rk)
    frac = rk - m
    if frac:
        m += int(float(torch.rand((), dtype=torch.float64, generator=generator)) < frac)
    capped = cap_applies(b, k, prune_ratio)
    return min(m, b - 1), capped


def _check_candidates(ids: Tensor, well_learned: Tensor, what: str) -> None:
    _check_index(ids, what)
    if not isinstance(well_learned, Tensor) or well_learned.dtype != torch.bool or well_learned.shape != ids.shape:
        raise ValueError(
            f"{what}: well_learned must be a bool tensor of the candidates' shape {tuple(ids.shape)}, got "
            f"{_describe(well_learned)}"
        )
    if ids.numel() == 0:
        raise ValueError(f"{what}: no candidates (B = 0)")


def thin_micro_batch(ids: Tensor, well_learned: Tensor, prune_ratio: float, generator: torch.Generator) -> ThinnedBatch:
    """Thin one rank's micro-batch slice drawn by another sampler (the curriculum) and weight what it keeps.

    Of the ``B`` candidates, the ``k`` well-learned ones (``well_learned[i]``: the sample's score is below the mean of
    the seen scores, :func:`split_well_learned`) lose a uniformly random subset of ``m`` (:func:`drop_count`, one
    ``torch.randperm(k)`` from ``generator``); every well-learned candidate is kept with probability exactly ``1 - r``
    (except in a capped tail slice, see :func:`keep_probabilities`) and weighted ``1 / (1 - r)``, the others are kept
    with weight 1. With :func:`thinned_loss` (the weighted sum over the kept, divided by ``B``) the expected loss and
    gradient equal the plain mean over the ``B`` candidates exactly: InfoBatch's unbiasedness (Qin et al., ICLR 2024,
    Sec. 3) within the curriculum's eligible set.

    A pure function: the inputs and the global RNGs are left untouched; the same generator state gives the same result.

    Args:
        ids: ``int64[B]``, the candidates' dataset indices (``B >= 1``). well_learned: ``bool[B]``.
        prune_ratio: ``r`` in ``[0, 1)``. generator: a CPU ``torch.Generator`` (e.g. :func:`thin_generator`).

    Returns:
        :class:`ThinnedBatch` ``(ids, weights, capped, keep)``: the kept ids in candidate order (never empty), their
        ``float32`` weights, whether the tail cap applied, and the ``bool[B]`` keep mask.

    Raises:
        TypeError: ``ids`` not int64. ValueError: shapes, an empty slice, ``prune_ratio`` outside ``[0, 1)``.
    """
    _check_candidates(ids, well_learned, "thin_micro_batch")
    r = _check_prune_ratio(prune_ratio)
    ids, well_learned = ids.detach().cpu(), well_learned.detach().cpu()
    positions = well_learned.nonzero().flatten()
    m, capped = drop_count(ids.numel(), positions.numel(), prune_ratio, generator)
    keep = torch.ones_like(well_learned)
    if m:
        keep[positions[torch.randperm(positions.numel(), generator=generator)[:m]]] = False
    weights = torch.ones(ids.numel(), dtype=torch.float32).masked_fill_(well_learned, float(1 / (1 - r)))
    return ThinnedBatch(ids[keep].clone(), weights[keep], capped, keep)


def keep_probabilities(well_learned: Tensor, prune_ratio: float) -> Tensor:
    """Exact probability that :func:`thin_micro_batch` keeps each candidate, as ``float64[B]``.

    1 for a candidate that is not well-learned; ``1 - E[m] / k`` for each of the ``k`` well-learned ones, which is
    ``1 - r`` exactly, except in a slice where :func:`cap_applies` (all ``B`` well-learned and ``r·B > B - 1``): there
    ``m = B - 1`` always and the keep probability is ``1 / B`` (its weight stays ``1 / (1 - r)``: a small bias,
    counted by the callback as ``infobatch/unpruned_tail_batches``).

    Raises:
        ValueError: ``well_learned`` not a non-empty 1-D bool tensor, ``prune_ratio`` outside ``[0, 1)``.
    """
    if not isinstance(well_learned, Tensor) or well_learned.dtype != torch.bool or well_learned.dim() != 1:
        raise ValueError(f"keep_probabilities needs a 1-D bool tensor, got {_describe(well_learned)}")
    b, k = well_learned.numel(), int(well_learned.sum())
    r = _check_prune_ratio(prune_ratio)
    _check_slice(b, k)
    expected_m = Fraction(b - 1) if cap_applies(b, k, prune_ratio) else r * k
    p_keep = 1 - expected_m / k if k else Fraction(1)
    return torch.ones(b, dtype=torch.float64).masked_fill_(well_learned.cpu(), float(p_keep))


def computed_from(tensor: Tensor, source: Tensor) -> bool:
    """Whether ``tensor`` was computed from ``source``: ``source`` is ``tensor`` or its autograd node is one of the
    nodes ``tensor``'s backward passes through (a breadth-first walk of ``tensor.grad_fn``'s graph, each node once;
    stops at the first match, so a loss built right on ``source`` is found at once). A ``source`` without a
    ``grad_fn`` (a leaf, or computed without grad) is found only as ``tensor`` itself. Used by InfoBatch to check
    that a manual-optimization step backpropagates its weighted loss."""
    if tensor is source:
        return True
    target = source.grad_fn
    if target is None or tensor.grad_fn is None:
        return False
    queue, seen = deque([tensor.grad_fn]), {id(tensor.grad_fn)}
    while queue:
        node = queue.popleft()
        if node is target:
            return True
        for parent, _ in node.next_functions:
            if parent is not None and id(parent) not in seen:
                seen.add(id(parent))
                queue.append(parent)
    return False


def thinned_loss(per_sample_loss: Tensor, weights: Tensor, num_candidates: int) -> Tensor:
    """The loss of a thinned micro-batch: ``sum_i(w_i · l_i over the kept) / B``, divided by the candidate count
    ``B``, not by the kept count (Qin et al., ICLR 2024, Sec. 3: with keep probabilities ``1 - r`` and weights
    ``1 / (1 - r)``, its expectation is the plain mean over the ``B`` candidates). Computed out of place in float32.

    Args:
        per_sample_loss: ``float[B_kept]``, with grad (any device). weights: ``float[B_kept]`` (moved to the loss's
            device). num_candidates: ``B >= B_kept``.

    Returns:
        A scalar float32 tensor on ``per_sample_loss.device``.

    Raises:
        ValueError: ``per_sample_loss`` not a 1-D float tensor of the weights' length (the message states the
            ``training_step`` contract), an empty batch, ``num_candidates < B_kept``.
    """
    if not isinstance(weights, Tensor) or weights.dim() != 1 or not weights.is_floating_point():
        raise ValueError(f"thinned_loss: weights must be a 1-D float tensor float32[B_kept], got {_describe(weights)}")
    _check_per_sample_loss(per_sample_loss, weights, "thinned_loss")
    if not is_int(num_candidates) or num_candidates < weights.numel():
        raise ValueError(
            f"thinned_loss: num_candidates must be an int >= the {weights.numel()} kept samples, got {num_candidates!r}"
        )
    w = weights.to(device=per_sample_loss.device, dtype=torch.float32)
    return (per_sample_loss.float() * w).sum() / int(num_candidates)
