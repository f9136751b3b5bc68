"""The deterministic curriculum sample stream: clusters, global batches and the per-rank controller. The method card
is ``lightning_effi/curriculum/README.md``.

Reference ``deepspeed/runtime/data_pipeline/data_sampling/data_sampler.py`` (``DeepSpeedDataSampler``).

- :class:`CurriculumController`: owns the per-rank view of the stream. Every quantity is a pure function of the
  configuration, the analysis indexes and the curriculum step: the global batch of step ``s`` is drawn with a
  generator from ``(seed, s)``, cluster permutations from ``(seed, cluster, pass)``, so all ranks compute the same
  global batches locally (no broadcast) and the state to checkpoint is a handful of ints.
- Commit protocol: iterators may run ahead of training (prefetching workers); only batches reported by
  :meth:`CurriculumController.commit` (from ``on_train_batch_end``) move the resume position, and every new iterator
  restarts from the committed position.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_effi.core.checks import check_int, is_int
from lightning_effi.core.state import config_mismatch, settings_diff
from lightning_effi.curriculum import functional as F
from lightning_effi.curriculum.config import CurriculumConfig, CurriculumConfigError, MetricConfig

#: what to do about a checkpoint whose curriculum state is invalid (every error of ``_check_state`` ends with it)
_CORRUPT = (
    "the checkpoint is corrupt or was edited (a stream state is written only by Curriculum.state_dict): resume from "
    "another checkpoint, or start the run afresh"
)


#: the share of the samples a ``percentile`` metric's DeepSpeed rounding may hold back until ``max_difficulty``
#: (``N % max_difficulty``) before the stream warns (CurriculumStream._warn_percentile_shortfall)
PERCENTILE_SHORTFALL = 0.05


class ClusterBook:
    """The clusters created along the (deterministic) difficulty history, memoised and shared by every iterator.

    Entry ``j`` = ``(difficulties_j, cluster ids or None when the increment was empty)``. The history is a pure
    function of the schedules, so every iterator (and every rank) walks the same entries.
    """

    def __init__(
        self, metrics: Sequence[MetricConfig], indexes: Mapping[str, Any], num_samples: int, percentile_rounding: str
    ) -> None:
        self.metrics = [m for m in metrics if m.schedule_based]
        self.indexes = indexes
        self.n = num_samples
        self.percentile_rounding = percentile_rounding
        self.entries: list[tuple[tuple[int, ...], np.ndarray | None]] = []
        self.assigned = np.zeros(num_samples, dtype=bool)

    def eligible(self, difficulties: Mapping[str, int]) -> np.ndarray:
        """Boolean ``[N]``: the intersection of the schedule_based metrics' cumulative eligible sets."""
        mask = np.ones(self.n, dtype=bool)
        for m in self.metrics:
            idx = self.indexes[m.name]
            end = F.eligible_end(
                difficulties[m.name],
                difficulty_type=m.difficulty_type,
                num_samples=self.n,
                max_difficulty=m.max_difficulty,
                offsets=idx.offsets,
                values=idx.values,
                percentile_rounding=self.percentile_rounding,
            )
            mask &= F.eligible_mask(idx.ids, end, self.n)
        return mask

    def entry(self, j: int, difficulties: tuple[int, ...], names: Sequence[str]) -> np.ndarray | None:
        if j < len(self.entries):
            if self.entries[j][0] != difficulties:
                raise RuntimeError(f"curriculum history diverged at entry {j}: {self.entries[j][0]} vs {difficulties}")
            return self.entries[j][1]
        if j != len(self.entries):
            raise RuntimeError("curriculum history entries must be built in order")
        ids = F.new_cluster(self.eligible(dict(zip(names, difficulties))), self.assigned)
        self.assigned[ids] = True
        self.entries.append((difficulties, ids if len(ids) else None))
        return self.entries[j][1]


@dataclass
class GlobalBatch:
    step: int
    difficulties: tuple[int, ...]
    ids: np.ndarray


class CurriculumStream:
    """One walk along the global-batch stream (DeepSpeed ``DeepSpeedDataSampler.get_next_global_batch``): per global
    batch, the difficulties, the newly eligible cluster and exact draws from the clusters. Cheap to create and to
    restore (clusters come from the shared :class:`ClusterBook`)."""

    def __init__(self, config: CurriculumConfig, book: ClusterBook, total_samples: int, global_batch: int) -> None:
        self.config = config
        self.names = list(config.metrics)
        self.schedules = config.schedules()
        self.book, self.total_samples, self.global_batch = book, total_samples, global_batch
        self.restore(self.initial_state(config))

    @staticmethod
    def initial_state(config: CurriculumConfig) -> dict[str, Any]:
        return {
            "step": 0,
            "difficulties": {n: m.min_difficulty for n, m in config.metrics.items()},
            "history": [],
            "clusters": [],
        }

    def state(self) -> dict[str, Any]:
        """Safe-loadable position *before* the next global batch."""
        return {
            "step": self.step,
            "difficulties": dict(self.difficulties),
            "history": [list(self.book.entries[j][0]) for j in range(self.n_history)],
            "clusters": [
                {"key": k, "size": int(len(c)), "pass": int(p), "position": int(q)}
                for k, (c, p, q) in enumerate(zip(self.clusters, self.passes, self.positions))
            ],
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.difficulties = {n: int(state["difficulties"][n]) for n in self.names}
        self.n_history = len(state["history"])
        self.clusters = []
        for j, h in enumerate(state["history"]):
            ids = self.book.entry(j, tuple(int(x) for x in h), self.names)
            if ids is not None:
                self.clusters.append(ids)
        saved = state["clusters"]
        if len(saved) != len(self.clusters) or any(int(c["size"]) != len(ids) for c, ids in zip(saved, self.clusters)):
            raise CurriculumConfigError(
                "curriculum state: the saved clusters do not match the ones rebuilt from the "
                "analysis index (different index files or configuration?)"
            )
        self.passes = [int(c["pass"]) for c in saved]
        self.positions = [int(c["position"]) for c in saved]
        self.perms: list[np.ndarray | None] = [None] * len(self.clusters)

    @property
    def eligible_samples(self) -> int:
        return int(sum(len(c) for c in self.clusters))

    def next_global_batch(self) -> GlobalBatch | None:
        """Draw the next global batch (``None`` once the sample budget is spent)."""
        size = min(self.global_batch, self.total_samples - self.step * self.global_batch)
        if size <= 0:
            return None
        self.step += 1
        new = {n: self.schedules[n].update(self.difficulties[n], self.step) for n in self.names}
        if self.step == 1 or new != self.difficulties:
            self.difficulties = new
            ids = self.book.entry(self.n_history, tuple(new[n] for n in self.names), self.names)
            self.n_history += 1
            if ids is not None:
                self.clusters.append(ids)
                self.passes.append(0)
                self.positions.append(0)
                self.perms.append(None)
        if not self.clusters:
            raise CurriculumConfigError(
                f"curriculum: no eligible sample at step {self.step} with difficulties {self.difficulties} "
                f"(N = {self.book.n})"
            )
        rng = F.batch_generator(self.config.seed, self.step)
        sizes = np.array([len(c) for c in self.clusters], dtype=np.float64)
        counts = rng.multinomial(size, sizes / sizes.sum())
        parts = []
        for k, n in enumerate(counts):
            if n == 0:
                continue
            drawn, self.passes[k], self.positions[k], self.perms[k] = F.draw_from_cluster(
                self.clusters[k], int(n), self.config.seed, k, self.passes[k], self.positions[k], self.perms[k]
            )
            parts.append(drawn)
        ids = rng.permutation(np.concatenate(parts))
        return GlobalBatch(self.step, tuple(self.difficulties[n] for n in self.names), ids)


Key = tuple  # (sample index, curriculum step, micro index, difficulties tuple)


class CurriculumController:
    """Per-rank curriculum stream with the commit protocol (DP slicing of each micro-chunk, exact ``len()``,
    resume from the last committed micro-batch).

    Args:
        config: the :class:`CurriculumConfig`.
        indexes: ``{metric name: MetricIndex}`` for every ``schedule_based`` metric (objects with ``ids``,
            ``offsets``, ``values``), already validated against ``num_samples``.
        num_samples: ``N``, the training set's length.
        micro_batch_size, dp_size, dp_rank, grad_accum: the batch geometry; one global batch of
            ``micro_batch_size × dp_size × grad_accum`` samples = one curriculum step = one optimizer step.

    Raises:
        CurriculumConfigError: bad geometry; a sample budget whose final micro-chunk would leave a rank empty (set
            ``drop_last``); an empty eligible set at the first step (names metric, difficulty and ``N``).

    Warns:
        UserWarning: (rank 0) a ``value`` metric whose ``max_difficulty`` is below some samples' values: those samples
            are never eligible, so the run never trains on them (:meth:`never_eligible`).
    """

    def __init__(
        self,
        config: CurriculumConfig,
        indexes: Mapping[str, Any],
        num_samples: int,
        micro_batch_size: int,
        dp_size: int = 1,
        dp_rank: int = 0,
        grad_accum: int = 1,
    ) -> None:
        num_samples, micro_batch_size, dp_size, grad_accum = (
            check_int("CurriculumController", key, v, 1, error=CurriculumConfigError)
            for key, v in (
                ("num_samples", num_samples),
                ("micro_batch_size", micro_batch_size),
                ("dp_size", dp_size),
                ("grad_accum", grad_accum),
            )
        )
        if not 0 <= dp_rank < dp_size:
            raise CurriculumConfigError(f"curriculum: dp_rank must be in [0, {dp_size}), got {dp_rank}")
        self.config, self.indexes, self.n = config, dict(indexes), num_samples
        self.mbs, self.dp, self.rank, self.ga = micro_batch_size, dp_size, dp_rank, grad_accum
        self.chunk = micro_batch_size * dp_size
        self.global_batch = self.chunk * grad_accum
        self.total_samples = num_samples * config.num_epochs
        full, rem = divmod(self.total_samples, self.global_batch)
        tail_full, tail_rem = divmod(rem, self.chunk)
        if tail_rem and not config.drop_last and tail_rem < dp_size:
            raise CurriculumConfigError(
                f"curriculum: the sample budget N × num_epochs = {self.total_samples} ends with a micro-chunk of "
                f"{tail_rem} samples for {dp_size} ranks (a rank would get none); set drop_last=true or change "
                "num_epochs"
            )
        self.total_micro = full * grad_accum + tail_full + (1 if tail_rem and not config.drop_last else 0)
        self.epoch_micro = -(-num_samples // self.global_batch) * grad_accum
        self.names = list(config.metrics)
        self.book = ClusterBook(list(config.metrics.values()), self.indexes, num_samples, config.percentile_rounding)
        self._check_first_step()
        if dp_rank == 0:
            self._warn_never_eligible()
            self._warn_never_filtering()
            self._warn_percentile_shortfall()
        self.committed: dict[str, Any] = {"pre": CurriculumStream.initial_state(config), "skip": 0, "micro": 0}
        self._snapshots: dict[int, dict[str, Any]] = {}
        self._stats: dict[int, tuple[int, int]] = {}

    # ---------------------------------------------------------------------------------------------- checks
    def first_difficulties(self) -> dict[str, int]:
        """``{metric: difficulty}`` of the first global batch (curriculum step 1): each schedule's update of its
        ``min_difficulty`` (the stream's starting difficulties) at step 1."""
        return {n: s.update(s.min_difficulty, 1) for n, s in self.config.schedules().items()}

    def never_eligible(self) -> dict[str, tuple[int, int]]:
        """``{metric: (samples, largest value)}`` for every ``schedule_based`` metric of ``difficulty_type`` ``value``
        whose ``max_difficulty`` is below some samples' metric value: those samples never become eligible (a sample
        is eligible at difficulty ``d`` when its value is ``<= d``, DeepSpeed ``data_sampler.py``), so the run never
        trains on them. Empty when every sample can be drawn (``percentile`` metrics reach every sample at
        ``max_difficulty``)."""
        out: dict[str, tuple[int, int]] = {}
        for m in self.book.metrics:
            idx = self.indexes[m.name]
            if m.difficulty_type != "value" or idx.values is None or len(idx.values) == 0:
                continue
            at_max = ClusterBook([m], self.indexes, self.n, self.config.percentile_rounding)
            left_out = self.n - int(at_max.eligible({m.name: m.max_difficulty}).sum())
            if left_out > 0:
                out[m.name] = (left_out, int(np.max(idx.values)))
        return out

    def _warn_never_eligible(self) -> None:
        for name, (left_out, largest) in self.never_eligible().items():
            m = self.config.metrics[name]
            warnings.warn(
                f"curriculum_metrics.{name}: {left_out} of the {self.n} training samples have a {name} value above "
                f"max_difficulty ({m.max_difficulty}), up to {largest}: they never become eligible, so the run never "
                f"trains on them; raise max_difficulty to {largest} to include every sample (or remove those "
                "samples from the training set)",
                UserWarning,
                stacklevel=2,
            )

    def _warn_never_filtering(self) -> None:
        """Warn of each ``value`` metric whose first curriculum step's difficulty is at or above every sample's value:
        every sample is eligible from the start, so the metric never filters and the run trains the plain shuffled
        data (a seqlen_truncate range copied onto a seqlen index whose values end below it, qa108-break 03)."""
        first = self.first_difficulties()
        for m in self.book.metrics:
            idx = self.indexes[m.name]
            if m.difficulty_type != "value" or idx.values is None or len(idx.values) == 0 or m.name not in first:
                continue
            low, high = int(np.min(idx.values)), int(np.max(idx.values))
            if high <= first[m.name]:
                warnings.warn(
                    f"curriculum_metrics.{m.name}: every one of the {self.n} training samples has a {m.name} value "
                    f"at or below the first curriculum step's difficulty ({first[m.name]}, from min_difficulty "
                    f"{m.min_difficulty}): every sample is eligible from the start, so this metric never filters the "
                    f"data; the values run {low}..{high}: set min_difficulty below {high} (and max_difficulty to "
                    f"{high})",
                    UserWarning,
                    stacklevel=2,
                )

    def _warn_percentile_shortfall(self) -> None:
        """Warn of each ``percentile`` metric whose DeepSpeed rounding (``percentile_rounding="deepspeed"``: ``N //
        max_difficulty`` samples a percentile) holds back more than :data:`PERCENTILE_SHORTFALL` of the samples until
        ``max_difficulty``: at difficulty ``p`` it admits ``(N // max_difficulty)·p`` samples, not the easiest ``p``
        percent (on 199 samples, 50 of them at 50 of 100), and the ``N % max_difficulty`` hardest join all at once
        at the maximum; said nowhere but in the method card's guarantees (qa97-user 02)."""
        if self.config.percentile_rounding != "deepspeed":
            return
        for m in self.book.metrics:
            held = self.n % m.max_difficulty if m.difficulty_type == "percentile" else 0
            if held > PERCENTILE_SHORTFALL * self.n:
                per = self.n // m.max_difficulty
                half = m.max_difficulty // 2
                warnings.warn(
                    f"curriculum_metrics.{m.name}: difficulty_type 'percentile' with percentile_rounding 'deepspeed' "
                    f"(DeepSpeed's arithmetic) admits N // max_difficulty = {self.n} // {m.max_difficulty} = {per} "
                    f"samples a percentile: at difficulty {half}, {per * half} of the {self.n} samples, not the "
                    f"easiest {100 * half // m.max_difficulty}%, and the {held} hardest join all at once at "
                    f"max_difficulty; Curriculum(..., percentile_rounding='proportional') admits N·p // max_difficulty "
                    "(the easiest p share)",
                    UserWarning,
                    stacklevel=2,
                )

    def _check_first_step(self) -> None:
        first = self.first_difficulties()
        if self.book.eligible(first).any():
            return
        per_metric = []
        for m in self.book.metrics:
            single = ClusterBook([m], self.indexes, self.n, self.config.percentile_rounding)
            per_metric.append(
                f"{m.name} ({m.difficulty_type}) at difficulty {first[m.name]}: "
                f"{int(single.eligible(first).sum())} eligible"
            )
        raise CurriculumConfigError(
            "curriculum: the first difficulties select no training sample (N = "
            f"{self.n}): " + "; ".join(per_metric) + ". Raise min_difficulty (or use a schedule whose first value "
            "selects data); with several schedule_based metrics the eligible set is their intersection; with "
            "N < max_difficulty, percentile_rounding 'deepspeed' gives N // max_difficulty = 0 samples per "
            "percentile below the maximum: use Curriculum(..., percentile_rounding='proportional') (an argument of the "
            "callback, for every metric; not a key of the metric's dict)"
        )

    # -------------------------------------------------------------------------------------------- iteration
    def __len__(self) -> int:
        """Micro-batches this rank yields in the current data epoch (``ceil(N / global_batch)`` global batches,
        fewer at the end of the budget). Stays the full count after a mid-epoch resume (Lightning runs the rest)."""
        if self.exhausted:
            return 0
        epoch_start = (self.committed["micro"] // self.epoch_micro) * self.epoch_micro
        return max(0, min(self.epoch_micro, self.total_micro - epoch_start))

    @property
    def data_epoch(self) -> int:
        """The data epoch (pass over the ``N`` samples) of the committed position, from 0."""
        return self.committed["micro"] // self.epoch_micro

    @property
    def exhausted(self) -> bool:
        """Whether the sample budget ``N × num_epochs`` has been trained on (nothing more will be yielded)."""
        return self.committed["micro"] >= self.total_micro

    @property
    def total_steps(self) -> int:
        """Optimizer steps the sample budget allows (a partial last accumulation window counts as one)."""
        return -(-self.total_micro // self.ga)

    def micro_batches(self) -> Iterator[list[Key]]:
        """Yield this rank's micro-batches from the committed position to the end of the current data epoch. Each
        micro-batch is a list of keys ``(index, curriculum_step, micro_idx, difficulties)``."""
        m = self.committed["micro"]
        end = min((m // self.epoch_micro + 1) * self.epoch_micro, self.total_micro)
        stream = CurriculumStream(self.config, self.book, self.total_samples, self.global_batch)
        stream.restore(self.committed["pre"])
        skip = self.committed["skip"]
        while m < end:
            pre = stream.state()
            gb = stream.next_global_batch()
            if gb is None:
                return
            self._snapshots[gb.step] = pre
            self._stats[gb.step] = (stream.eligible_samples, len(stream.clusters))
            for micro_idx, start in enumerate(range(0, len(gb.ids), self.chunk)):
                if micro_idx < skip:
                    continue
                chunk = gb.ids[start : start + self.chunk]
                if len(chunk) < self.chunk and self.config.drop_last:
                    continue
                if m >= end:
                    return
                lo, hi = F.dp_slice(len(chunk), self.dp, self.rank, self.config.dp_split)
                yield [(int(i), gb.step, micro_idx, gb.difficulties) for i in chunk[lo:hi]]
                m += 1
            skip = 0

    def commit(self, step: int, micro_idx: int) -> None:
        """Record that micro-batch ``micro_idx`` of global batch ``step`` was trained on (idempotent)."""
        pre = self._snapshots.get(step)
        if pre is None:
            if self.committed["pre"]["step"] == step - 1:
                pre = self.committed["pre"]
            else:
                raise RuntimeError(f"curriculum: commit of step {step} that no iterator produced")
        self.committed = {"pre": pre, "skip": micro_idx + 1, "micro": (step - 1) * self.ga + micro_idx + 1}
        for s in [s for s in self._snapshots if s < step]:
            del self._snapshots[s]
            self._stats.pop(s, None)

    # --------------------------------------------------------------------------------------------------- state
    def fingerprint(self) -> dict[str, Any]:
        idx = {name: getattr(i, "fingerprint", lambda: None)() for name, i in sorted(self.indexes.items())}
        return {
            "config": self.config.describe(),
            "num_samples": self.n,
            "micro_batch_size": self.mbs,
            "dp_size": self.dp,
            "grad_accum": self.ga,
            "indexes": idx,
        }

    def state_dict(self) -> dict[str, Any]:
        c = self.committed
        pre = copy.deepcopy(c["pre"])
        consumed = min(
            self.total_samples, (c["micro"] // self.ga) * self.global_batch + (c["micro"] % self.ga) * self.chunk
        )
        return {
            "curriculum_step": int(pre["step"]) + (1 if c["skip"] else 0),
            "micro_offset": int(c["skip"]),
            "consumed_samples": int(consumed),
            "committed_micro": int(c["micro"]),
            "current_difficulties": dict(pre["difficulties"]),
            "pre_state": pre,
            "config": self.fingerprint(),
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore the committed position (idempotent; callable before or after iteration started).

        The position is ``pre_state`` (the stream before the global batch in progress), ``micro_offset`` (its
        micro-batches trained) and ``committed_micro``; the other entries of :meth:`state_dict` follow from them
        and are checked against them (:meth:`_check_state`), so an edited or corrupt checkpoint is refused rather
        than resumed at a position it does not describe.

        Raises:
            CurriculumConfigError: (``strict``; else a warning) the checkpoint was written with another configuration
                or batch geometry, naming each setting that differs with the checkpoint's and the current value
                (:func:`fingerprint_diff`, e.g. ``{'seed': (3, 4)}``); (always) another training set size
                (``num_samples``: the stream indexes the samples); an invalid state: a missing entry, a
                negative or non-int position, a ``committed_micro`` that is not ``pre_state.step × grad_accum +
                micro_offset`` or beyond the sample budget, a ``curriculum_step`` / ``consumed_samples`` /
                ``current_difficulties`` that does not match the position, clusters that the analysis index does not
                rebuild.
        """
        diff = fingerprint_diff(state.get("config"), self.fingerprint())
        if "num_samples" in diff:
            saved_n, n = diff["num_samples"]
            raise CurriculumConfigError(
                f"Curriculum: the checkpoint's stream is over a training set of {saved_n} samples, this fit's has {n}: "
                "the stream's clusters and position index the samples, so it cannot resume on another training set "
                "(strict=False does not apply); resume on the training set it was written on, or start a fresh fit"
            )
        extended, budget = diff.get("num_epochs"), self.total_samples
        if set(diff) == {"num_epochs"} and all(is_int(v) for v in extended) and extended[1] > extended[0]:
            # a larger sample budget extends the run: the stream's draws do not depend on it (it only ends them)
            from lightning.pytorch.utilities import rank_zero_info

            budget = int(extended[0]) * self.n  # the checkpoint's, which its consumed_samples is bounded by
            partial = budget % self.global_batch
            rank_zero_info(
                f"Curriculum: num_epochs {extended[0]} -> {extended[1]}: the sample budget grows from "
                f"{extended[0]} to {extended[1]} passes over the data; the stream continues from the checkpoint"
                + (
                    f" (the old budget ended with a batch of {partial} of {self.global_batch} samples, which the "
                    "budget counts as a whole batch: the stream goes on from the sample after it, and the run trains "
                    f"{self.global_batch - partial} samples fewer than the new budget)"
                    if partial
                    else ""
                )
            )
            diff = {}
        if diff:
            config_mismatch(
                "Curriculum",
                f"the checkpoint was written with another configuration (checkpoint, now): {diff}; resume with the "
                "same metrics, schedules, seed, index files and batch geometry",
                strict,
                fix="continue with this configuration",
                error=CurriculumConfigError,
            )
        pre, skip, micro = self._check_state(state, same_config=not diff, budget=budget)
        try:  # validates the history and the clusters against the analysis index
            CurriculumStream(self.config, self.book, self.total_samples, self.global_batch).restore(pre)
        except CurriculumConfigError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CurriculumConfigError(
                f"Curriculum: the checkpoint's stream state pre_state is malformed ({type(e).__name__}: {e}); "
                f"{_CORRUPT}"
            ) from None
        self.committed = {"pre": pre, "skip": skip, "micro": micro}
        self._snapshots.clear()

    def _check_state(
        self, state: Mapping[str, Any], same_config: bool, budget: int | None = None
    ) -> tuple[dict[str, Any], int, int]:
        """``(pre_state, micro_offset, committed_micro)`` of a checkpoint's stream ``state``, checked: ints where
        ints belong, ``committed_micro = pre_state.step × grad_accum + micro_offset`` (the invariant
        :meth:`commit` keeps, with the checkpoint's own ``grad_accum``), ``micro_offset`` in ``[0, grad_accum]``,
        ``curriculum_step = pre_state.step + (1 if micro_offset else 0)``, ``current_difficulties =
        pre_state.difficulties`` (an int per metric) and, when the configuration is the same (``same_config``),
        ``committed_micro <= `` the budget's micro-batches and ``consumed_samples`` as :meth:`state_dict` computes
        it (bounded by ``budget`` samples, the checkpoint's: a larger ``num_epochs`` extends the run).

        Raises:
            CurriculumConfigError: naming the entry, its value and what it should be.
        """

        def bad(key: str, value: Any, why: str) -> CurriculumConfigError:
            return CurriculumConfigError(
                f"Curriculum: the checkpoint's stream state has {key}={value!r}, {why}; {_CORRUPT}"
            )

        for key in ("pre_state", "micro_offset", "committed_micro"):
            if key not in state:
                raise CurriculumConfigError(f"Curriculum: the checkpoint's stream state has no {key!r}; {_CORRUPT}")
        raw = state["pre_state"]
        if not isinstance(raw, Mapping) or not {"step", "difficulties", "history", "clusters"} <= set(raw):
            raise bad("pre_state", raw, "expected a dict with step, difficulties, history and clusters")
        pre = copy.deepcopy(dict(raw))
        step = pre["step"]
        if not is_int(step) or step < 0:
            raise bad("pre_state.step", step, "expected an int >= 0 (global batches drawn)")
        diffs = pre["difficulties"]
        if not isinstance(diffs, Mapping) or any(not is_int(diffs.get(n)) for n in self.names):
            raise bad("pre_state.difficulties", diffs, f"expected an int difficulty for each metric {self.names}")
        saved = state.get("config")
        ga = saved.get("grad_accum") if isinstance(saved, Mapping) else None
        ga = int(ga) if is_int(ga) and ga >= 1 else self.ga
        skip, micro = state["micro_offset"], state["committed_micro"]
        if not is_int(skip) or not 0 <= skip <= ga:
            raise bad("micro_offset", skip, f"expected an int in [0, {ga}] (micro-batches of a global batch)")
        if not is_int(micro) or micro != step * ga + skip:
            raise bad(
                "committed_micro",
                micro,
                f"expected pre_state.step x grad_accum + micro_offset = {step} x {ga} + {skip} = {step * ga + skip}",
            )
        if same_config and micro > self.total_micro:
            raise bad("committed_micro", micro, f"beyond the sample budget's {self.total_micro} micro-batches")
        expected: dict[str, Any] = {
            "curriculum_step": int(step) + (1 if skip else 0),
            "current_difficulties": dict(diffs),
        }
        if same_config:
            expected["consumed_samples"] = min(
                self.total_samples if budget is None else budget,
                (micro // ga) * self.global_batch + (micro % ga) * self.chunk,
            )
        for key, value in expected.items():
            if key in state and state[key] != value:
                raise bad(key, state[key], f"but the position (pre_state, micro_offset) gives {value!r}")
        if "consumed_samples" in state and (not is_int(state["consumed_samples"]) or state["consumed_samples"] < 0):
            raise bad("consumed_samples", state["consumed_samples"], "expected an int >= 0")
        return pre, int(skip), int(micro)

    def stats(self, step: int) -> tuple[int, int] | None:
        """``(eligible_samples, num_clusters)`` when global batch ``step`` was drawn (None if not drawn here)."""
        return self._stats.get(step)


def fingerprint_diff(saved: Any, current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{setting: (checkpoint value, current value)}`` for every setting of two :meth:`CurriculumController
    .fingerprint` dicts that differs, named by its path: the configuration's options at the top (``seed``,
    ``num_epochs``, ...), a metric's keys as ``metrics.<name>.<key>`` (``metrics.seqlen_truncate.schedule_config
    .total_curriculum_step``), then the geometry (``micro_batch_size``, ``dp_size``, ``grad_accum``, ``num_samples``)
    and ``indexes.<metric>``. A subtree on one side only (a metric added or removed) is one entry, ``None`` on the
    other side. A saved fingerprint that is not a dict reads as empty (every setting differs). Built on
    :func:`~lightning_effi.core.state.settings_diff`, level by level."""

    def settings(fingerprint: Any) -> dict[str, Any]:
        if not isinstance(fingerprint, Mapping):
            return {}
        config = fingerprint.get("config")
        out = {k: v for k, v in fingerprint.items() if k != "config"}
        if isinstance(config, Mapping):
            out.update(config)
            # options the fingerprint holds only when set: their defaults, not None, in the message (qa56-ts 05)
            out.setdefault("keep_last_token", False)
            out.setdefault("truncation_side", "right")
        elif "config" in fingerprint:
            out["config"] = config
        return out

    def nested(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str) -> dict[str, tuple[Any, Any]]:
        out: dict[str, tuple[Any, Any]] = {}
        for key, (x, y) in settings_diff(a, b).items():
            if isinstance(x, Mapping) and isinstance(y, Mapping):
                out.update(nested(x, y, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = (x, y)
        return out

    return nested(settings(saved), settings(current), "")


def indexes_fingerprint(indexes: Mapping[str, Any]) -> str:
    """A short hash of the index arrays (compared across DDP ranks at setup)."""
    h = hashlib.sha1()
    for name in sorted(indexes):
        idx = indexes[name]
        h.update(name.encode())
        for arr in (idx.ids, idx.offsets, idx.values if idx.values is not None else np.zeros(0, np.int64)):
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]
