"""The baseline frontier and the savings read from it: pure functions, no I/O.

Protocol (Kaddour et al. 2023, "No Train No Gain: Revisiting Efficient Training Algorithms For Transformer-based
Language Models", NeurIPS, Sec. 3): an efficient-training method is compared with the *baseline frontier*, the plain
model trained at several budgets, each with its learning-rate schedule decayed to the end of that budget, not only
with the baseline that trains as long as the method. A method that saves compute against the same-length baseline
may save nothing against a shorter, fully decayed baseline run; the frontier reading tells the two apart.

Compute is any positive cumulative cost (training FLOPs, forward + backward, as the ``EfficiencyMonitor`` counts
them; tokens; samples; seconds of training wall time); quality is the final value of the optimized metric, with a
direction: ``mode="min"`` (lower is better: a loss) or ``mode="max"`` (higher is better: an accuracy).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

Mode = Literal["min", "max"]
Flag = Literal["inside", "beyond", "below"]
MODES: tuple[str, ...] = ("min", "max")


def check_mode(mode: str) -> Mode:
    """``mode`` itself when it is ``"min"`` or ``"max"``. Raises ``ValueError`` otherwise."""
    if mode not in MODES:
        raise ValueError(f"mode: expected 'min' (lower is better) or 'max' (higher is better), got {mode!r}")
    return "min" if mode == "min" else "max"


#: name parts (``val/loss`` -> ``val``, ``loss``; trailing digits dropped: ``acc1``) that say lower is better
LOWER_IS_BETTER = frozenset(
    {
        "loss", "losses", "nll", "ppl", "perplexity", "error", "errors", "err", "mse", "mae", "rmse", "wer", "cer",
        "bpc", "bpb", "fid", "kid", "brier", "ece", "lpips", "distance",
    }
)  # fmt: skip
#: ... and higher is better
HIGHER_IS_BETTER = frozenset(
    {
        "acc", "accuracy", "accuracies", "top", "f", "auc", "auroc", "auprc", "precision", "recall", "bleu",
        "rouge", "map", "iou", "miou", "dice", "r2", "mcc", "spearman", "pearson", "corr", "score", "ndcg", "dcg",
        "mrr", "hit", "hits", "psnr", "ssim", "jaccard", "ap", "ar", "mar", "pq", "cider", "meteor", "spice",
        "exact",
    }
)  # fmt: skip


#: the parts of :data:`LOWER_IS_BETTER` and :data:`HIGHER_IS_BETTER` that name a direction only on their own: in a
#: compound name they are a kind of metric, either way (``ContinuousRankedProbabilityScore`` is lower-is-better,
#: ``DistanceIntersectionOverUnion`` and ``davies_bouldin_score`` are not what their last word says: a correct mode
#: was refused, qa86-break 02), so beside other words (but :data:`STAGE_WORDS`) they say nothing sure; but a
#: segment ending in ``distance`` (``edit_distance``, ``cosine_distance``) is one, lower-is-better (qa87-regress 02)
WEAK = frozenset({"score", "distance"})
#: words of a name that say where or how a metric was read, not what it is (``val_score``, ``epoch/mean_distance``)
STAGE_WORDS = frozenset(
    {
        "val", "valid", "validation", "train", "training", "test", "eval", "evaluation", "epoch", "step", "mean",
        "avg", "average", "final", "best", "ema", "macro", "micro", "weighted", "total", "overall", "dataloader",
        "idx",
    }
)  # fmt: skip

#: name parts that turn a metric around, make it a difference or a spread, or measure something else about it
#: (``neg_mse``, ``accuracy_drop``, ``loss_scale``, ``1-acc``, ``acc_degradation``, ``time_to_acc``,
#: ``accuracy_variance``): a name with one says nothing sure (the mode was read from ``acc`` in the last three, and a
#: correct ``mode="min"`` refused as against the name, qa84-break 03)
MODIFIERS = frozenset(
    {
        "neg", "negative", "inv", "inverse", "drop", "gap", "diff", "delta", "change", "improvement", "increase",
        "decrease", "gain", "reduction", "scale", "std", "var", "minus", "one", "degradation", "degrade", "regret",
        "variance", "spread", "deviation", "stdev", "range", "time", "latency", "cost", "steps", "epochs",
        "forgetting",
    }
)  # fmt: skip


def infer_mode(metric: str) -> Mode | None:
    """``"min"`` when the metric's name says lower is better (a part in :data:`LOWER_IS_BETTER`: ``val/loss``,
    ``val_ppl``), ``"max"`` when it says higher is better (:data:`HIGHER_IS_BETTER`: ``val/acc``, ``test_f1``,
    ``acc_top5``, ``val/r2``, ``val/ndcg@10``, ``val/MulticlassJaccardIndex``: a number after the name is a cut-off,
    ``hr`` is a hit rate only with one), None when it says neither or both, names a direction only by a word of
    :data:`WEAK` beside other words (``val/davies_bouldin_score``), or holds a part of :data:`MODIFIERS`
    (``neg_mse``, ``accuracy_drop``, ``loss_scale``) or a number opening a segment (``1-acc``): the caller must be
    told."""
    # path segments (val/ndcg@10/dataloader_idx_0), their words (torchmetrics' MulticlassJaccardIndex: multiclass,
    # jaccard, index; mAP: m, ap)
    segments = [
        [p for p in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", seg).lower()) if p]
        for seg in str(metric).split("/")
    ]
    raw = [p for seg in segments for p in seg]
    parts = {p for p in raw if not p.isdigit()} | {p.rstrip("0123456789") for p in raw if not p.isdigit()}
    parts.discard("")
    # hit rate: "hr" with a cut-off (hr@10), not hours (gpu_hr)
    parts |= {"hit" for seg in segments for i, p in enumerate(seg[:-1]) if p == "hr" and seg[i + 1].isdigit()}
    # a number opening a segment turns it around (1-acc); one after a name is a cut-off (recall@20, acc@1_ema, map@0.5)
    leading = any(len(seg) > 1 and seg[0].isdigit() for seg in segments)
    # a modifier counts from the first segment that names a direction on: a namespace before it (time_series/val_mae,
    # cost_sensitive/val_acc) modifies nothing (refused without a mode, qa85-break 04)
    directed = LOWER_IS_BETTER | HIGHER_IS_BETTER | {"hr"}
    first = next(
        (i for i, seg in enumerate(segments) if {p.rstrip("0123456789") for p in seg} & directed), len(segments)
    )
    modifiers = {p.rstrip("0123456789") for seg in segments[first:] for p in seg} & MODIFIERS
    if modifiers or leading:
        return None
    if parts & WEAK and not parts & (LOWER_IS_BETTER | HIGHER_IS_BETTER) - WEAK:
        for seg in segments:  # a weak word with a word of another kind in its segment: a compound name
            ordered = [p.rstrip("0123456789") for p in seg if not p.isdigit()]
            words, weak = set(ordered), set(ordered) & WEAK
            if ordered and ordered[-1] == "distance":  # <x>_distance (edit, hamming, cosine, l2): lower is better
                weak.discard("distance")
            if weak and words - WEAK - STAGE_WORDS:
                return None
    lower, higher = bool(parts & LOWER_IS_BETTER), bool(parts & HIGHER_IS_BETTER)
    return "min" if lower and not higher else "max" if higher and not lower else None


def better(a: float, b: float, mode: Mode) -> bool:
    """Whether quality ``a`` is strictly better than ``b`` under ``mode``."""
    return a < b if mode == "min" else a > b


def _check_points(points: Sequence[tuple[float, float]], name: str) -> None:
    for i, point in enumerate(points):
        if len(point) != 2:
            raise ValueError(f"{name}[{i}]: expected a (compute, quality) pair, got {point!r}")
        compute, quality = point
        if not (math.isfinite(compute) and math.isfinite(quality)):
            raise ValueError(f"{name}[{i}]: compute and quality must be finite, got {point!r}")


def pareto_indices(points: Sequence[tuple[float, float]], mode: str) -> list[int]:
    """Indices of the non-dominated ``points``, ordered by compute (see :func:`pareto_front`)."""
    m = check_mode(mode)
    _check_points(points, "points")
    sign = 1.0 if m == "min" else -1.0
    order = sorted(range(len(points)), key=lambda i: (points[i][0], sign * points[i][1], i))
    kept: list[int] = []
    for i in order:
        if not kept or better(points[i][1], points[kept[-1]][1], m):
            kept.append(i)
    return kept


def pareto_front(points: Sequence[tuple[float, float]], mode: str) -> list[tuple[float, float]]:
    """The non-dominated ``(compute, quality)`` points, sorted by compute (increasing; quality then strictly improves).

    A point is dominated when another one costs at most as much and is at least as good, one of the two strictly
    (of identical points one is kept). A baseline budget that is worse than a cheaper one (a non-monotone set: an
    unlucky seed, a too-short warmup) leaves the front.

    Args:
        points: ``(compute, quality)`` pairs, finite.
        mode: ``"min"`` or ``"max"``: the better direction of quality.

    Raises:
        ValueError: an unknown ``mode``; a point that is not a pair of finite numbers.
    """
    return [points[i] for i in pareto_indices(points, mode)]


@dataclass(frozen=True)
class Reach:
    """What the frontier spends to reach a quality (:func:`compute_to_reach`).

    Attributes:
        compute: the frontier's compute at that quality (units of the frontier's compute).
        flag: ``"inside"`` (interpolated between two frontier points or equal to one: an estimate), ``"beyond"``
            (better than every frontier point: the frontier's largest compute, so a saving read from it is a lower
            bound) or ``"below"`` (worse than the cheapest frontier point: its compute, so a saving is an upper
            bound).
        quality: the quality asked for.
    """

    compute: float
    flag: Flag
    quality: float

    @property
    def bound(self) -> str:
        """How to read a saving computed from :attr:`compute`: ``"estimate"``, ``"lower bound"`` or
        ``"upper bound"``."""
        return {"inside": "estimate", "beyond": "lower bound", "below": "upper bound"}[self.flag]


def compute_to_reach(frontier: Sequence[tuple[float, float]], quality: float, mode: str) -> Reach:
    """The compute at which the baseline ``frontier`` reaches ``quality``.

    Between the two frontier points around ``quality`` the reading is interpolated **linearly in quality and in
    log-compute** (``log c = log c_a + t (log c_b - log c_a)``, ``t = (quality - q_a) / (q_b - q_a)``, i.e. the
    geometric interpolation ``c = c_a^(1 - t) c_b^t``): losses fall roughly linearly in log compute over a
    budget sweep, and the reading is independent of the compute unit. A quality equal to a frontier point's returns
    that point's compute. A quality better than every point is ``"beyond"`` (the largest compute is returned; the
    frontier would need more, so the saving is a lower bound); one worse than the cheapest point is ``"below"`` (the
    smallest compute; the saving is an upper bound).

    Args:
        frontier: the output of :func:`pareto_front`: ``(compute, quality)`` points with compute > 0, sorted by
            compute, quality strictly improving; at least one point.
        quality: the quality to reach (finite).
        mode: ``"min"`` or ``"max"``.

    Raises:
        ValueError: an empty frontier, a non-positive or non-finite compute, points out of order or dominated
            (pass :func:`pareto_front` of the baselines), a non-finite ``quality``, an unknown ``mode``.
    """
    m = check_mode(mode)
    if not frontier:
        raise ValueError("frontier: empty; it needs at least one baseline (compute, quality) point")
    _check_points(frontier, "frontier")
    if not math.isfinite(quality):
        raise ValueError(f"quality: must be finite, got {quality!r}")
    for i, (compute, _) in enumerate(frontier):
        if compute <= 0:
            raise ValueError(f"frontier[{i}]: compute must be > 0 (it is read in log-compute), got {compute!r}")
    for i, (a, b) in enumerate(zip(frontier, frontier[1:])):
        if not (b[0] > a[0] and better(b[1], a[1], m)):
            raise ValueError(
                f"frontier[{i}], frontier[{i + 1}] = {a!r}, {b!r}: not a Pareto front (compute must increase and "
                f"quality strictly improve under mode={m!r}); pass pareto_front(points, mode)"
            )
    first, last = frontier[0], frontier[-1]
    if better(quality, last[1], m):
        return Reach(compute=float(last[0]), flag="beyond", quality=quality)
    if better(first[1], quality, m):
        return Reach(compute=float(first[0]), flag="below", quality=quality)
    for (ca, qa), (cb, qb) in zip(frontier, frontier[1:]):
        if quality == qa:
            return Reach(compute=float(ca), flag="inside", quality=quality)
        if not better(quality, qb, m):  # qa worse than quality, quality at most as good as qb: between them
            t = (quality - qa) / (qb - qa)
            log_compute = math.log(ca) + t * (math.log(cb) - math.log(ca))
            return Reach(compute=math.exp(log_compute), flag="inside", quality=quality)
    return Reach(compute=float(last[0]), flag="inside", quality=quality)  # equal to the last point's quality


class Saving(NamedTuple):
    """A compute saving: ``fraction = 1 - arm / reference`` (0.25: a quarter less; negative: the arm spends more)
    and ``factor = reference / arm`` (1.33: the reference needs 1.33 times the arm's compute)."""

    fraction: float
    factor: float


def saving(arm_compute: float, frontier_compute: float) -> Saving:
    """The arm's saving against a reference compute (the frontier's at the arm's quality, or a baseline's):
    ``1 - arm_compute / frontier_compute`` and the factor ``frontier_compute / arm_compute``.

    Raises:
        ValueError: either compute not finite and > 0 (a figure the monitor could not count reads 0).
    """
    for name, value in (("arm_compute", arm_compute), ("frontier_compute", frontier_compute)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: must be finite and > 0, got {value!r}")
    return Saving(fraction=1.0 - arm_compute / frontier_compute, factor=frontier_compute / arm_compute)


class Spread(NamedTuple):
    """Mean, sample standard deviation (``n - 1`` in the denominator; NaN for ``n < 2``) and count."""

    mean: float
    std: float
    n: int


def spread(values: Iterable[float]) -> Spread:
    """:class:`Spread` of the finite ``values`` (non-finite ones are left out of all three figures; none left:
    NaN, NaN, 0)."""
    kept = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not kept:
        return Spread(math.nan, math.nan, 0)
    return Spread(statistics.fmean(kept), statistics.stdev(kept) if len(kept) > 1 else math.nan, len(kept))


__all__ = [
    "Flag",
    "Mode",
    "Reach",
    "Saving",
    "Spread",
    "better",
    "check_mode",
    "compute_to_reach",
    "pareto_front",
    "pareto_indices",
    "saving",
    "spread",
]
