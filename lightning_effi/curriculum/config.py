"""Curriculum learning configuration (DeepSpeed Data Efficiency style): a strict frozen schema with DeepSpeed's key
names. The method card is ``lightning_effi/curriculum/README.md``.

- :class:`MetricConfig`, :class:`CurriculumConfig`: unknown or missing keys raise at parse time and the input is never
  mutated. :func:`parse_deepspeed_config` reads a DeepSpeed ``data_efficiency`` block (and rejects the legacy
  top-level ``curriculum_learning`` block).

Reference ``deepspeed/runtime/data_pipeline/{config.py, data_sampling/data_sampler.py}``; the stream these settings
drive is :mod:`lightning_effi.curriculum.stream`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_effi.core.checks import check_bool, check_choice, check_int, check_non_decreasing, plain
from lightning_effi.core.state import plain_config
from lightning_effi.curriculum import functional as F
from lightning_effi.curriculum.schedules import ROUNDING_MODES, CurriculumSchedule, ScheduleConfigError, reach_step

CLUSTERING_TYPES = ("schedule_based", "single_cluster")
#: metric names whose difficulty drives a batch transform (Megatron-DeepSpeed ``pretrain_{gpt,bert}.py`` convention)
TRANSFORM_METRICS = ("seqlen_truncate", "seqlen_reshape")


class CurriculumConfigError(ValueError):
    """A curriculum configuration that cannot run; the message names the key and what is allowed."""


# ------------------------------------------------------------------------------------------------------ schema
_METRIC_KEYS = {
    "index_to_sample_path",
    "index_to_metric_path",
    "difficulty_type",
    "clustering_type",
    "min_difficulty",
    "max_difficulty",
    "schedule_type",
    "schedule_config",
}
_METRIC_EXTRA = {"analysis", "custom_schedule"}  # lightning_effi additions
#: Curriculum(...) arguments a user may put in a metric's dict by mistake (they apply to every metric)
_CALLBACK_ARGUMENTS = frozenset(
    {
        "seed", "num_epochs", "rounding", "percentile_rounding", "dp_split", "drop_last", "truncate_keys",
        "causal_label_shift", "keep_last_token", "truncation_side", "analysis_batch_size", "total_tokens",
    }
)  # fmt: skip


#: OmegaConf containers (Hydra) to plain dicts and lists (:func:`lightning_effi.core.checks.plain`)
to_plain = plain


@dataclass(frozen=True)
class MetricConfig:
    """One entry of DeepSpeed's ``data_efficiency.data_sampling.curriculum_learning.curriculum_metrics``, DeepSpeed
    key names.

    Args:
        name: the metric's name. ``seqlen_truncate`` / ``seqlen_reshape`` (``single_cluster``, ``value``) make the
            loader truncate / re-chunk each batch to the difficulty it was drawn at.
        difficulty_type: ``value`` (absolute metric value; eligible: ``metric <= d``) or ``percentile`` (rank
            percentile in ``[0, max_difficulty]``).
        clustering_type: ``schedule_based`` (filters data through its analysis index) or ``single_cluster`` (never
            filters; only exposes its difficulty).
        min_difficulty, max_difficulty, schedule_type, schedule_config: the schedule (see
            :class:`~lightning_effi.curriculum.schedules.CurriculumSchedule`).
        index_to_sample_path, index_to_metric_path: analysis files (path prefixes, DeepSpeed ``MMapIndexedDataset``
            format); ``index_to_metric_path`` is required for ``value`` + ``schedule_based``.
        analysis: (lightning_effi) instead of index files, a registered analyzer metric (a name, or
            ``{name: ..., **factory options}``; :func:`lightning_effi.curriculum.analysis.get_metric`) or any callable
            ``fn(batch) -> int[B]`` (Hydra: a ``_partial_: true`` target), computed in memory
            over the training set at setup by every rank (:func:`lightning_effi.curriculum.analysis
            .analyze_in_memory`).
        custom_schedule: (lightning_effi) ``fn(step) -> int`` for ``schedule_type: custom``.
    """

    name: str
    difficulty_type: str
    clustering_type: str
    min_difficulty: int
    max_difficulty: int
    schedule_type: str
    schedule_config: Mapping[str, Any] = field(default_factory=dict)
    index_to_sample_path: str | None = None
    index_to_metric_path: str | None = None
    analysis: str | Mapping[str, Any] | Callable[[Any], Any] | None = None
    custom_schedule: Callable[[int], int] | None = None

    def __post_init__(self) -> None:
        where = f"curriculum_metrics.{self.name}"
        check_choice(where, "difficulty_type", self.difficulty_type, F.DIFFICULTY_TYPES, error=CurriculumConfigError)
        check_choice(where, "clustering_type", self.clustering_type, CLUSTERING_TYPES, error=CurriculumConfigError)
        schedule_config = to_plain(self.schedule_config)
        if schedule_config is not None and not isinstance(schedule_config, Mapping):
            raise CurriculumConfigError(
                f"{where}.schedule_config must be a dict of the schedule's keys (e.g. {{total_curriculum_step: 1000, "
                f"difficulty_step: 8}} for {self.schedule_type!r}), got {schedule_config!r}"
            )
        object.__setattr__(self, "schedule_config", dict(schedule_config or {}))
        object.__setattr__(self, "analysis", to_plain(self.analysis))
        if self.name in TRANSFORM_METRICS and (self.clustering_type, self.difficulty_type) != (
            "single_cluster",
            "value",
        ):
            raise CurriculumConfigError(
                f"{where}: {self.name} must be clustering_type single_cluster and difficulty_type value"
            )
        if self.name in TRANSFORM_METRICS and self.min_difficulty < 1:
            raise CurriculumConfigError(
                f"{where}.min_difficulty must be >= 1 token for {self.name}, got {self.min_difficulty}"
            )
        if self.custom_schedule is not None and self.schedule_type != "custom":
            raise CurriculumConfigError(
                f"{where}: custom_schedule is only used with schedule_type 'custom' (got {self.schedule_type!r})"
            )
        if self.schedule_type == "custom" and not callable(self.custom_schedule):
            raise CurriculumConfigError(
                f"{where}: schedule_type 'custom' needs custom_schedule, a callable fn(step) -> int, in the metric's "
                f"config (Hydra: a target with _partial_: true), got {self.custom_schedule!r}; for a DeepSpeed "
                f"config, parse_deepspeed_config(ds_config, custom_schedules={{{self.name!r}: fn}}) (what DeepSpeed's "
                "engine.set_custom_curriculum_learning_schedule receives)"
            )
        if not self.schedule_based and (self.index_to_sample_path or self.index_to_metric_path or self.analysis):
            raise CurriculumConfigError(
                f"{where}: a single_cluster metric never filters data; remove "
                "index_to_sample_path / index_to_metric_path / analysis (or use "
                "clustering_type schedule_based)"
            )
        if self.schedule_based:
            if self.index_to_sample_path is None and self.analysis is None:
                raise CurriculumConfigError(
                    f"{where}: a schedule_based metric needs index_to_sample_path (analysis "
                    "files) or analysis (a registered metric computed at setup)"
                )
            if self.index_to_sample_path is not None and self.analysis is not None:
                raise CurriculumConfigError(f"{where}: give index_to_sample_path or analysis, not both")
            if (
                self.difficulty_type == "value"
                and self.index_to_sample_path is not None
                and self.index_to_metric_path is None
            ):
                raise CurriculumConfigError(
                    f"{where}: difficulty_type 'value' with schedule_based clustering needs index_to_metric_path"
                )
            if self.difficulty_type == "percentile" and self.min_difficulty < 0:
                raise CurriculumConfigError(
                    f"{where}: percentile difficulties must be >= 0, got min_difficulty {self.min_difficulty}"
                )

    @property
    def schedule_based(self) -> bool:
        return self.clustering_type == "schedule_based"

    def schedule(self, rounding: str) -> CurriculumSchedule:
        """The metric's :class:`~lightning_effi.curriculum.schedules.CurriculumSchedule` under ``rounding``.

        Raises:
            CurriculumConfigError: what ``CurriculumSchedule`` refuses, and three schedules that can run but do not
                make the curriculum they describe: ``fixed_discrete`` difficulties that decrease (DeepSpeed's update
                rule freezes a difficulty once it reaches ``max_difficulty``, so a decreasing list either freezes at
                its first value or trains easier data later); a ``value`` metric's ``fixed_discrete`` list that ends
                below ``max_difficulty`` (it never reaches it in any run, and a ``value`` metric's
                ``max_difficulty`` has no other meaning: ``max_difficulty`` = the last difficulty is the same run; a
                ``percentile`` metric's ``max_difficulty`` is its scale, so there it is a warning at train start:
                :meth:`CurriculumConfig.reach_warnings`); and a ``difficulty_step`` above ``max_difficulty`` (every
                difficulty rounds down to a multiple of it: the schedule stays at ``min_difficulty`` and jumps to
                ``max_difficulty``).
        """
        try:
            schedule = CurriculumSchedule(
                self.schedule_type,
                self.min_difficulty,
                self.max_difficulty,
                self.schedule_config,
                rounding,
                self.custom_schedule,
                self.name,
            )
        except ScheduleConfigError as e:
            raise CurriculumConfigError(str(e)) from None
        where = f"curriculum_metrics.{self.name}.schedule_config"
        cfg = schedule.schedule_config
        if schedule.schedule_type == "fixed_discrete":
            check_non_decreasing(where, "difficulty", cfg["difficulty"], error=CurriculumConfigError)
            last, hi = cfg["difficulty"][-1], schedule.max_difficulty
            if self.difficulty_type == "value" and last < hi:
                raise CurriculumConfigError(
                    f"{where}.difficulty ends at {last}, below max_difficulty ({hi}): the last difficulty holds after "
                    f"the last max_step, so the schedule never reaches max_difficulty in any run, while for a value "
                    f"metric max_difficulty is nothing but the schedule's end (DeepSpeed's update rule freezes the "
                    f"difficulty there). End the list at {hi} (difficulty={[*cfg['difficulty'][:-1], hi]!r}), or set "
                    f"max_difficulty to {last} if the curriculum is meant to stop at {last} (the same run)"
                )
        elif schedule.schedule_type in ("fixed_linear", "fixed_root"):
            q, lo, hi = cfg["difficulty_step"], schedule.min_difficulty, schedule.max_difficulty
            # a range from 0 up needs a multiple of q in (0, max_difficulty]; one reaching below 0 (a value metric of
            # negated scores) a step within its width
            bound, named = (hi, f"max_difficulty ({hi})") if lo >= 0 else (hi - lo, f"the range's width ({hi - lo})")
            if q > bound and lo < hi:
                raise CurriculumConfigError(
                    f"{where}.difficulty_step ({q}) must be <= {named}: every difficulty rounds down to a multiple "
                    f"of {q}, so the schedule would stay at min_difficulty ({lo}) and jump to max_difficulty at "
                    "total_curriculum_step; use a difficulty_step that divides the range (e.g. 8 for token lengths, "
                    "1 for percentiles)"
                )
        return schedule

    @classmethod
    def from_dict(
        cls, name: str, raw: Mapping[str, Any], extras: bool = True, custom_schedule: Callable[[int], int] | None = None
    ) -> MetricConfig:
        """Strict parse of one metric dict (not mutated). ``extras``: accept the lightning_effi keys.
        ``custom_schedule``: the metric's ``fn(step) -> int`` given beside the dict (a DeepSpeed config)."""
        raw = to_plain(raw)
        where = f"curriculum_metrics.{name}"
        if not isinstance(raw, Mapping):
            raise CurriculumConfigError(f"{where} must be a dict, got {type(raw).__name__}")
        allowed = _METRIC_KEYS | (_METRIC_EXTRA if extras else set())
        unknown = sorted(set(raw) - allowed)
        if unknown:
            owned = sorted(set(unknown) & _CALLBACK_ARGUMENTS)
            hint = (
                f" ({', '.join(owned)}: an argument of Curriculum(...), for every metric, e.g. "
                f"Curriculum(metrics=..., {owned[0]}=...))"
                if owned
                else ""
            )
            raise CurriculumConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}{hint}")
        required = ["difficulty_type", "clustering_type", "min_difficulty", "max_difficulty", "schedule_type"]
        if raw.get("schedule_type") != "custom":
            required.append("schedule_config")
        missing = [k for k in required if k not in raw]
        if missing:
            raise CurriculumConfigError(f"{where}: missing required key(s) {missing}")
        kwargs = copy.deepcopy({k: v for k, v in raw.items() if k != "custom_schedule"})
        for k in ("min_difficulty", "max_difficulty"):
            kwargs[k] = check_int(where, k, raw[k], error=CurriculumConfigError)
        cfg = cls(name=name, **kwargs, custom_schedule=raw.get("custom_schedule", custom_schedule))
        cfg.schedule("clamped")  # validates the schedule keys now (parse time)
        return cfg


@dataclass(frozen=True)
class CurriculumConfig:
    """The whole curriculum: the metrics and the options shared by them (the ``Curriculum`` callback's arguments).

    Args:
        metrics: ``{name: MetricConfig | dict | None}`` (DeepSpeed ``curriculum_metrics``), at least one; order
            kept; a ``None`` entry is dropped (so a Hydra override can remove a metric of a composed config).
        seed: seeds every draw (global batches, cluster permutations). num_epochs: the sample budget is
            ``N × num_epochs`` (DeepSpeed default 1000: effectively endless; training length is set by ``max_steps``).
        rounding: schedule rounding, ``clamped`` (default) | ``deepspeed`` | ``deepspeed_legacy``
            (:mod:`~lightning_effi.curriculum.schedules`).
        percentile_rounding: ``deepspeed`` (``N // max`` samples per percentile) | ``proportional``
            (:func:`~lightning_effi.curriculum.functional.eligible_end`).
        dp_split: per-rank slicing of a micro-chunk, ``balanced`` | ``deepspeed``
            (:func:`~lightning_effi.curriculum.functional.dp_slice`).
        drop_last: drop a short final micro-chunk at the end of the budget.
        truncate_keys: names (dict keys, dataclass fields) of the tensors ``seqlen_truncate`` cuts; None (default):
            every ``[B, T, ...]`` tensor of the batch's sequence length, whatever the batch structure
            (:func:`~lightning_effi.curriculum.functional.truncate`).
        causal_label_shift: ``seqlen_truncate`` keeps ``d + 1`` tokens (Megatron GPT samples carry their shifted
            label); ``False`` (default) keeps ``d`` (HF models shift inside).
        keep_last_token: ``seqlen_truncate`` keeps each row's last real token (``[SEP]`` / EOS) as the last token of
            the cut row (Composer's ``preserve_end_of_sequence``; :func:`~lightning_effi.curriculum.functional
            .truncate`).
        truncation_side: ``"right"`` (default, DeepSpeed's: ``seqlen_truncate`` keeps each row's first ``d``
            positions) or ``"left"`` (its last ``d``: the most recent steps of a forecaster's look-back window, next
            to the target; HF tokenizers' name).

    Raises:
        CurriculumConfigError: no metric, unknown option values, a metric config error.
    """

    metrics: Mapping[str, Any]
    seed: int = 1234
    num_epochs: int = 1000
    rounding: str = "clamped"
    percentile_rounding: str = "deepspeed"
    dp_split: str = "balanced"
    drop_last: bool = False
    truncate_keys: Sequence[str] | None = None
    causal_label_shift: bool = False
    keep_last_token: bool = False
    truncation_side: str = "right"

    def __post_init__(self) -> None:
        metrics = to_plain(self.metrics)
        if not isinstance(metrics, Mapping):
            raise CurriculumConfigError(
                "curriculum metrics: expected a mapping of metric name -> its config (DeepSpeed's curriculum_metrics, "
                f"e.g. {{'seqlen_truncate': {{...}}}}), got a {type(metrics).__name__}: {metrics!r}"[:400]
            )
        if not metrics:
            raise CurriculumConfigError("curriculum metrics: need at least one metric, e.g. {'seqlen_truncate': {...}}")
        ds_keys = sorted(set(metrics) & {"data_efficiency", "data_sampling", "curriculum_learning", "train_batch_size"})
        if ds_keys:
            raise CurriculumConfigError(
                f"curriculum metrics: got a DeepSpeed config (keys {ds_keys}), not its curriculum_metrics; pass "
                "ds_config['data_efficiency']['data_sampling']['curriculum_learning']['curriculum_metrics'], or read "
                "the whole config with lightning_effi.parse_deepspeed_config(ds_config) and pass its metrics, seed "
                "and num_epochs"
            )
        parsed = {
            name: (m if isinstance(m, MetricConfig) else MetricConfig.from_dict(name, m))
            for name, m in metrics.items()
            if m is not None
        }  # None removes a metric composed by Hydra
        if not parsed:
            raise CurriculumConfigError("curriculum metrics: every metric is null; need at least one")
        object.__setattr__(self, "metrics", parsed)
        keys = to_plain(self.truncate_keys)
        if keys is not None and (
            isinstance(keys, str)
            or not isinstance(keys, Sequence)
            or not keys
            or not all(isinstance(k, str) for k in keys)
        ):
            raise CurriculumConfigError(
                "curriculum truncate_keys must be a non-empty list of tensor names, or None (every [B, T, ...] "
                f"tensor), got {keys!r}"
            )
        object.__setattr__(self, "truncate_keys", None if keys is None else tuple(keys))
        err = CurriculumConfigError
        for key in ("drop_last", "causal_label_shift", "keep_last_token"):
            object.__setattr__(self, key, check_bool("curriculum", key, getattr(self, key), error=err))
        check_choice("curriculum", "rounding", self.rounding, ROUNDING_MODES, error=err)
        check_choice("curriculum", "truncation_side", self.truncation_side, F.TRUNCATION_SIDES, error=err)
        if self.truncation_side != "right" and "seqlen_truncate" not in metrics:
            raise CurriculumConfigError(
                f"curriculum truncation_side={self.truncation_side!r} chooses the side seqlen_truncate cuts, and the "
                f"metrics {sorted(metrics)} have no seqlen_truncate: it would do nothing; remove it or add the metric"
            )
        check_choice("curriculum", "percentile_rounding", self.percentile_rounding, F.PERCENTILE_ROUNDING, error=err)
        check_choice("curriculum", "dp_split", self.dp_split, F.DP_SPLITS, error=err)
        object.__setattr__(self, "seed", check_int("curriculum", "seed", self.seed, 0, error=err))
        object.__setattr__(self, "num_epochs", check_int("curriculum", "num_epochs", self.num_epochs, 1, error=err))
        if self.seed >= 2**32:
            raise CurriculumConfigError(f"curriculum seed must be < 2**32, got {self.seed}")
        if "seqlen_truncate" in parsed and "seqlen_reshape" in parsed:
            raise CurriculumConfigError("curriculum metrics: use seqlen_truncate or seqlen_reshape, not both")
        _check_inert_metrics(parsed)
        for m in parsed.values():
            schedule = m.schedule(self.rounding)
            if m.name in TRANSFORM_METRICS and m.schedule_type != "custom":
                first = schedule.update(schedule.min_difficulty, 1)  # linear/root are non-decreasing in the step
                if first < 1:
                    raise CurriculumConfigError(
                        f"curriculum_metrics.{m.name}: with rounding={self.rounding!r} the first difficulty is {first} "
                        f"tokens (difficulty_step {schedule.difficulty_step} > min_difficulty {m.min_difficulty}); "
                        "use rounding 'clamped' or 'deepspeed', or a min_difficulty >= difficulty_step"
                    )

    def full_difficulty(self, name: str, length: int) -> int:
        """The ``seqlen_truncate`` / ``seqlen_reshape`` difficulty that keeps all ``length`` tokens of a batch:
        ``length`` (``length - 1`` with ``causal_label_shift``, a difficulty ``d`` keeping ``d + 1`` tokens, and for
        ``seqlen_reshape``, whose rows hold ``d + 1`` tokens)."""
        return length - (1 if name == "seqlen_reshape" or self.causal_label_shift else 0)

    def check_data_length(self, length: int, one_length: bool = True) -> list[str]:
        """Refuse a ``seqlen_truncate`` / ``seqlen_reshape`` range that does not fit the training data, whose batches
        hold ``length`` tokens (``Curriculum.setup`` reads it from the training set:
        :func:`~lightning_effi.curriculum.data.data_sequence_length`), or, with ``one_length=False``, whose longest
        batch holds ``length`` tokens (batches padded to their own longest sample:
        :func:`~lightning_effi.curriculum.data.data_longest_sequence`). Let ``full`` be the difficulty that keeps
        every token (:meth:`full_difficulty`; DeepSpeed's seqlen curriculum ends at the full sequence length: its
        GPT-2 example runs ``seqlen_truncate`` from 80 to ``max_difficulty`` 2048 = ``seq_length``, and
        Megatron-DeepSpeed ``pretrain_gpt.py`` truncates only while the difficulty is below ``seq_length``):

        - ``max_difficulty > full``: the schedule reaches the full length before its end (the step is in the
          message) and then spends its remaining steps on lengths the data does not have, logging difficulties no
          batch has;
        - ``min_difficulty >= full`` (or a first difficulty that is): no batch is ever shortened, the metric does
          nothing.

        A ``max_difficulty`` below ``full`` is accepted (a run may mean to train short sequences throughout), but the
        schedule then never reaches the data's length: every batch of the run is cut, and the tokens cut are counted
        as a saving. That is returned as a warning message (``Curriculum.setup`` warns it).

        Returns:
            the warning messages (empty when every metric's range ends at the data's full length).

        Raises:
            CurriculumConfigError: naming ``curriculum_metrics.<metric>.max_difficulty`` / ``min_difficulty``, the
                data's length and the consequence.
        """
        warnings: list[str] = []
        for name in TRANSFORM_METRICS:
            m = self.metrics.get(name)
            if m is None:
                continue
            full = self.full_difficulty(name, length)
            where = f"curriculum_metrics.{name}"
            if name == "seqlen_reshape":
                how = f"{length} tokens (seqlen_reshape: a difficulty d makes rows of d + 1 tokens)"
            elif self.causal_label_shift:
                how = f"{length} tokens (causal_label_shift: a difficulty d keeps d + 1 tokens)"
            else:
                how = f"{length} tokens"
            # batches padded to their own longest sample: the longest batch, the data's longest sample after collate
            hold = "batches hold" if one_length else "longest batch (padded to its longest sample) holds"
            schedule = m.schedule(self.rounding)
            if m.max_difficulty > full:
                reach = reach_step(schedule, full)
                cfg = schedule.schedule_config
                end = (
                    f" instead of at total_curriculum_step ({cfg['total_curriculum_step']})"
                    if "total_curriculum_step" in cfg
                    else f" instead of after its last max_step ({cfg['max_step'][-1]})"
                    if "max_step" in cfg
                    else ""
                )
                last = cfg.get("total_curriculum_step", (cfg.get("max_step") or [None])[-1])
                if reach is not None and reach == last:
                    # no earlier: "at step 8 instead of at total_curriculum_step (8)" (qa50-clip 07)
                    consequence = (
                        f"the schedule's last difficulty, {m.max_difficulty}, is one that no batch has (its "
                        f"difficulties are logged up to {m.max_difficulty}, the data's longest is {full})"
                    )
                elif reach is not None:
                    consequence = (
                        f"the schedule would reach the full length at step {reach}{end} and spend the rest on lengths "
                        f"the data does not have (logging difficulties up to {m.max_difficulty} that no batch has)"
                    )
                else:
                    consequence = (
                        f"the schedule's range goes past the full length (difficulties up to {m.max_difficulty} that "
                        "no batch has)"
                    )
                raise CurriculumConfigError(
                    f"{where}.max_difficulty ({m.max_difficulty}) is above the training data's sequence length: its "
                    f"{hold} {how}, so a difficulty of {full} already keeps every token; {consequence}. Set "
                    f"max_difficulty to {full}, the data's full length (as DeepSpeed's seqlen curriculum does), or "
                    "train on longer samples"
                )
            lowest = min(m.min_difficulty, schedule.update(m.min_difficulty, 1))
            if lowest >= full:
                raise CurriculumConfigError(
                    f"{where}.min_difficulty ({m.min_difficulty}) is at or above the training data's sequence length: "
                    f"its {hold} {how}, so a difficulty of {full} already keeps every token and {name} would "
                    f"never shorten a batch (the curriculum would do nothing to the sequence length). Set "
                    f"min_difficulty below {full} (DeepSpeed's tutorial starts at 8 tokens for M-scale models, 64 "
                    f"for B-scale ones), or remove the {name} metric"
                )
            if m.max_difficulty < full:
                cut = "every batch" if one_length else "every batch longer than max_difficulty"
                warnings.append(
                    f"{where}.max_difficulty ({m.max_difficulty}) is below the training data's sequence length: its "
                    f"{hold} {how}, so {cut} of the run is cut, also after the schedule's end (DeepSpeed's seqlen "
                    "curriculum ends at the full length), and the tokens cut are counted as the curriculum's saving. "
                    f"Set max_difficulty to {full} to train on the full sequences at the end"
                )
        return warnings

    def reach_warnings(self, first_step: int, last_step: int | None, run: str = "") -> list[str]:
        """What a run training curriculum steps ``first_step`` .. ``last_step`` (the step of its last optimizer
        step; None: the run's length is unknown) misses of each metric's schedule, one message per metric (empty:
        every schedule ends at its ``max_difficulty`` within the run). ``Curriculum.on_train_start`` warns them.
        ``run``: what makes ``last_step`` the last (e.g. ``"the last of a run of 8 optimizer steps"``), for the
        message. ``custom`` schedules (any shape) are not read.

        - Nothing to do (only when the run starts the curriculum, ``first_step == 1``): the first step's difficulty
          is already ``max_difficulty`` (``min_difficulty == max_difficulty``, ``total_curriculum_step=1``, a
          ``fixed_discrete`` whose first stage ends at ``max_step[0] = 0``, before the first step: DeepSpeed's
          curriculum steps also start at 1), so the metric never trains below its maximum: the curriculum does
          nothing for it.
        - Never reached: a ``percentile`` metric's ``fixed_discrete`` list that ends below ``max_difficulty`` (the
          samples ranked above that percentile never become eligible, in any run). DeepSpeed's
          ``CurriculumScheduler`` runs it as given, and it is the only way to write a curriculum that stops at a
          share of the data (``max_difficulty`` being the percentile scale), so it runs, with this warning (the
          same list for a ``value`` metric is refused: :meth:`MetricConfig.schedule`).
        - Not reached within the run: the schedule reaches ``max_difficulty`` only after ``last_step`` (e.g.
          ``total_curriculum_step`` longer than the run): the message gives the difficulty at the run's last step
          and the step that reaches the maximum. A longer resumed run continues the schedule, so this is a warning.
        """
        out = []
        run = f": {run}" if run else ""
        for name, schedule in self.schedules().items():
            if schedule.schedule_type == "custom":
                continue
            where, hi, cfg = f"curriculum_metrics.{name}", schedule.max_difficulty, schedule.schedule_config
            discrete = schedule.schedule_type == "fixed_discrete"
            first = schedule(first_step)
            if first_step == 1 and first >= hi:
                if schedule.min_difficulty >= hi:
                    why, fix = f"min_difficulty = max_difficulty = {hi}", "lower min_difficulty"
                elif discrete:
                    why = (
                        f"schedule_config.max_step[0] = {cfg['max_step'][0]} ends the first stage (difficulty "
                        f"{cfg['difficulty'][0]}) before curriculum step 1, the first one (DeepSpeed's curriculum "
                        "steps start at 1 too), and the next stage is at max_difficulty"
                    )
                    fix = "give max_step entries >= 1 (max_step[i] is the last step of stage i)"
                else:
                    why = f"schedule_config.total_curriculum_step = {cfg['total_curriculum_step']}"
                    fix = "give a total_curriculum_step > 1, e.g. a share of the run's steps"
                out.append(
                    f"{where}: the schedule is at max_difficulty ({hi}) from the first curriculum step ({why}), so "
                    f"every step trains at max_difficulty and the curriculum does nothing for {name}; {fix}, or "
                    f"remove the {name} metric"
                )
                continue
            if last_step is None or last_step < first_step or schedule(last_step) >= hi:
                continue
            reach = reach_step(schedule, hi)
            end = schedule(last_step)
            if reach is None:  # a percentile fixed_discrete list that ends below max_difficulty
                out.append(
                    f"{where}: schedule_config.difficulty ends at {end}, below max_difficulty ({hi}): the schedule "
                    f"never reaches max_difficulty in any run, so the samples ranked above percentile {end} of {hi} "
                    f"never become eligible and the run never trains on them; end the list at {hi} to train on "
                    "every sample (or keep it to train on the easier share only)"
                )
                continue
            if discrete:
                how = (
                    f"schedule_config.max_step = {cfg['max_step']}: the stage at max_difficulty starts at step {reach}"
                )
                fix = f"end the earlier stages by max_step {last_step - 1}"
            else:
                how = f"schedule_config.total_curriculum_step = {cfg['total_curriculum_step']}"
                fix = (
                    f"pass total_curriculum_step <= {last_step}"
                    if self.rounding == "clamped"  # reaches max_difficulty at total_curriculum_step exactly
                    else f"pass a shorter total_curriculum_step (one whose schedule reaches it by step {last_step})"
                )
            out.append(
                f"{where}: the schedule reaches max_difficulty ({hi}) only at curriculum step {reach} ({how}), after "
                f"the run's last step (curriculum step {last_step}{run}): the run ends at difficulty {end} and never "
                f"trains at max_difficulty; {fix} to reach it within the run, or keep it when a longer resumed run "
                "continues the schedule"
            )
        return out

    def schedules(self) -> dict[str, CurriculumSchedule]:
        return {name: m.schedule(self.rounding) for name, m in self.metrics.items()}

    def describe(self) -> dict[str, Any]:
        """Safe-loadable description (no callables) used as the checkpoint fingerprint (``keep_last_token`` and
        ``truncate_keys`` only when set, so checkpoints written before they were compared still match)."""
        out: dict[str, Any] = {
            k: getattr(self, k)
            for k in (
                "seed",
                "num_epochs",
                "rounding",
                "percentile_rounding",
                "dp_split",
                "drop_last",
                "causal_label_shift",
            )
        }
        if self.keep_last_token:
            out["keep_last_token"] = True
        if self.truncation_side != "right":  # only when set, as keep_last_token
            out["truncation_side"] = self.truncation_side
        if self.truncate_keys is not None:  # only when set, as keep_last_token
            out["truncate_keys"] = list(self.truncate_keys)
        out["metrics"] = {
            name: {f.name: _describe(getattr(m, f.name)) for f in dataclasses.fields(m)}
            for name, m in self.metrics.items()
        }
        return json.loads(json.dumps(out, default=str))


def _describe(value: Any) -> Any:
    """A run-independent description of a config value (callables by qualified name, not by address)."""
    if callable(value):
        func = getattr(value, "func", value)  # functools.partial
        name = f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__qualname__)}"
        keywords = getattr(value, "keywords", None)
        return {"callable": name, "keywords": {k: _describe(v) for k, v in (keywords or {}).items()}}
    if isinstance(value, Mapping):
        return {str(k): _describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    return value


_DS_KEYS = {
    "data_efficiency": {"enabled", "seed", "data_sampling", "data_routing"},
    "data_routing": {"enabled", "random_ltd"},
    "data_sampling": {"enabled", "num_epochs", "num_workers", "curriculum_learning", "pin_memory", "dynamic_batching"},
    "curriculum_learning": {"enabled", "data_cluster_path", "curriculum_metrics"},
}


def parse_deepspeed_config(
    ds_config: Mapping[str, Any] | str | os.PathLike[str],
    custom_schedules: Mapping[str, Callable[[int], int]] | None = None,
    **overrides: Any,
) -> CurriculumConfig | None:
    """Read a DeepSpeed config's ``data_efficiency`` block (parsed by DeepSpeed in
    ``deepspeed/runtime/data_pipeline/config.py``) into a :class:`CurriculumConfig`.

    Args:
        ds_config: a whole DeepSpeed config dict (other engine keys are ignored) or just its ``data_efficiency``
            block, or the path of a DeepSpeed JSON file holding one. Not mutated.
        custom_schedules: ``{metric name: fn(step) -> int}`` for the metrics of ``schedule_type: custom`` (what
            DeepSpeed's ``engine.set_custom_curriculum_learning_schedule`` receives).
        overrides: lightning_effi options (``rounding``, ``dp_split``, ...). ``rounding`` defaults to ``"clamped"``
            (never below ``min_difficulty``, ``max_difficulty`` at ``total_curriculum_step``); DeepSpeed's own
            arithmetic is ``rounding="deepspeed"``. The two differ only where ``min_difficulty`` or
            ``max_difficulty`` is not a multiple of ``difficulty_step``, and then a warning says so.

    Returns:
        the config, or ``None`` when ``curriculum_learning.enabled`` is false.

    Raises:
        CurriculumConfigError: the legacy top-level ``curriculum_learning`` block (removed in DeepSpeed PR #8566), a
            misplaced top-level ``data_sampling`` block, unknown keys, missing required keys, an ``enabled`` that is
            not a bool (a string ``"false"`` would be true), a child enabled under a disabled parent, an enabled
            ``data_sampling.dynamic_batching`` (not implemented: the DataLoader's batches are trained), a
            ``custom_schedules`` entry that is not a callable for a metric of ``schedule_type: custom``.

    Warns:
        UserWarning: ``data_efficiency.data_routing.random_ltd`` is enabled: it is not read here (random-LTD is
            :class:`lightning_effi.RandomLTDCallback`, :meth:`~lightning_effi.RandomLTDCallback
            .from_deepspeed_config`); ``data_sampling.num_workers`` / ``pin_memory`` are given (the DataLoader's own
            are used); a ``single_cluster`` metric names index files (DeepSpeed never opens them; they are dropped,
            as in Megatron-DeepSpeed's GPT and BERT scripts, which write ``"dummy"``); the default rounding trains
            another schedule than DeepSpeed's (above).
    """
    # a DeepSpeed JSON file's path (the Hydra app passes one) is read first
    ds_config = copy.deepcopy(plain_config(ds_config, "parse_deepspeed_config", error=CurriculumConfigError))
    if not isinstance(ds_config, Mapping):
        raise CurriculumConfigError(
            f"parse_deepspeed_config: expected a DeepSpeed config dict, got {type(ds_config).__name__}"
        )
    options = sorted(set(inspect.signature(CurriculumConfig).parameters) - {"metrics", "seed", "num_epochs"})
    unknown = sorted(set(overrides) - set(options) - {"metrics", "seed", "num_epochs"})
    if unknown:
        raise CurriculumConfigError(
            f"parse_deepspeed_config: unknown option(s) {unknown}; allowed: {options} and custom_schedules "
            "({metric name: fn(step) -> int})"
        )
    clash = sorted(set(overrides) & {"metrics", "seed", "num_epochs"})
    if clash:
        raise CurriculumConfigError(
            f"parse_deepspeed_config: {clash} come from the DeepSpeed config; override only "
            "the lightning_effi options (rounding, percentile_rounding, dp_split, ...)"
        )
    if "data_efficiency" in ds_config:  # a whole DeepSpeed config
        if "curriculum_learning" in ds_config:
            raise CurriculumConfigError(
                "the legacy top-level 'curriculum_learning' block has been removed (DeepSpeed PR #8566); use "
                "'data_efficiency.data_sampling.curriculum_learning' instead"
            )
        if "data_sampling" in ds_config:
            raise CurriculumConfigError(
                "'data_sampling' must sit under 'data_efficiency' (DeepSpeedExamples #696: "
                "a misplaced block is silently ignored by DeepSpeed)"
            )
        block = ds_config["data_efficiency"]
    elif "curriculum_learning" in ds_config:
        raise CurriculumConfigError(
            "the legacy top-level 'curriculum_learning' block has been removed (DeepSpeed PR #8566); use "
            "'data_efficiency.data_sampling.curriculum_learning' instead"
        )
    elif set(ds_config) and set(ds_config) <= _DS_KEYS["data_efficiency"]:  # just the data_efficiency block
        block = ds_config
    else:
        raise CurriculumConfigError("no 'data_efficiency' block in the DeepSpeed config")

    def check(section: str, d: Any) -> Mapping[str, Any]:
        if not isinstance(d, Mapping):
            raise CurriculumConfigError(f"{section} must be a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - _DS_KEYS[section])
        if unknown:
            raise CurriculumConfigError(f"{section}: unknown key(s) {unknown}; allowed: {sorted(_DS_KEYS[section])}")
        return d

    de = check("data_efficiency", block)
    check("data_routing", de.get("data_routing", {}))
    ds = check("data_sampling", de.get("data_sampling", {}))
    cl = check("curriculum_learning", ds.get("curriculum_learning", {}))

    def enabled(section: str, d: Mapping[str, Any]) -> bool:
        # DeepSpeed reads ``enabled`` with a default of false; a string "false" would be truthy
        if "enabled" not in d:
            return False
        return check_bool(section, "enabled", d["enabled"], error=CurriculumConfigError)

    de_on, ds_on, cl_on = (
        enabled("data_efficiency", de),
        enabled("data_efficiency.data_sampling", ds),
        enabled("data_efficiency.data_sampling.curriculum_learning", cl),
    )
    _warn_data_routing(de.get("data_routing"))
    if de_on and ds_on:  # DeepSpeed's data sampler, with or without a curriculum
        _check_loader_keys(ds)
    if not cl_on:
        return None
    if not de_on or not ds_on:
        raise CurriculumConfigError(
            "curriculum_learning.enabled is true but its parent "
            f"{'data_efficiency' if not de_on else 'data_sampling'}"
            ".enabled is false; enable the parents or disable curriculum_learning"
        )
    if not isinstance(cl.get("curriculum_metrics"), Mapping):
        raise CurriculumConfigError(
            "curriculum_learning.curriculum_metrics: required, a dict {metric name: metric "
            f"config}}; got {cl.get('curriculum_metrics')!r}"
        )
    if "data_cluster_path" not in cl:
        raise CurriculumConfigError("curriculum_learning: missing required key 'data_cluster_path'")
    raw_metrics = {name: _drop_unread_keys(name, m) for name, m in cl["curriculum_metrics"].items()}
    functions = _custom_schedules(custom_schedules, raw_metrics)
    metrics = {
        name: MetricConfig.from_dict(name, m, extras=False, custom_schedule=functions.get(name))
        for name, m in raw_metrics.items()
    }
    if "rounding" not in overrides:
        _warn_rounding(metrics)
    return CurriculumConfig(
        metrics=metrics, seed=de.get("seed", 1234), num_epochs=ds.get("num_epochs", 1000), **overrides
    )


def _check_loader_keys(data_sampling: Mapping[str, Any]) -> None:
    """``data_sampling``'s loader keys: an enabled ``dynamic_batching`` (DeepSpeed's token-budget batches) raises, as
    it is not implemented; ``num_workers`` / ``pin_memory`` warn, as the DataLoader's own settings are used."""
    dynamic = data_sampling.get("dynamic_batching")
    if isinstance(dynamic, Mapping) and dynamic.get("enabled") not in (None, False):
        raise CurriculumConfigError(
            "data_efficiency.data_sampling.dynamic_batching is enabled, but lightning_effi does not implement "
            "DeepSpeed's dynamic batching (batches of a token budget): the run would train your DataLoader's fixed-"
            "size batches instead; set dynamic_batching.enabled to false (or remove it) and choose the batch size in "
            "the DataLoader"
        )
    given = [k for k in ("num_workers", "pin_memory") if k in data_sampling]
    if given:
        warnings.warn(
            f"parse_deepspeed_config: data_efficiency.data_sampling {' / '.join(given)} is not read; the curriculum "
            "keeps your DataLoader's num_workers and pin_memory (set them there)",
            UserWarning,
            stacklevel=4,
        )


def _drop_unread_keys(name: str, metric: Any) -> Any:
    """A DeepSpeed metric's keys DeepSpeed never reads, dropped with a warning: a ``single_cluster`` metric's
    ``index_to_sample_path`` / ``index_to_metric_path`` (Megatron-DeepSpeed's ``examples_deepspeed/data_efficiency/
    {gpt,bert}`` scripts write ``"dummy"``) and a ``custom`` metric's ``schedule_config`` (``CurriculumScheduler``
    reads it for the ``fixed_*`` types only). Anything else is returned as it is, for :meth:`MetricConfig.from_dict`
    to check."""
    if isinstance(metric, Mapping) and metric.get("schedule_type") == "custom" and "schedule_config" in metric:
        warnings.warn(
            f"parse_deepspeed_config: curriculum_metrics.{name} is schedule_type custom, whose function is the "
            f"schedule, so its schedule_config ({metric['schedule_config']!r}) is not read, as in DeepSpeed",
            UserWarning,
            stacklevel=4,
        )
        metric = {k: v for k, v in metric.items() if k != "schedule_config"}
    if not isinstance(metric, Mapping) or metric.get("clustering_type") != "single_cluster":
        return metric
    paths = [k for k in ("index_to_sample_path", "index_to_metric_path") if k in metric]
    if not paths:
        return metric
    warnings.warn(
        f"parse_deepspeed_config: curriculum_metrics.{name} is single_cluster, which never filters data, so its "
        f"{' / '.join(paths)} ({', '.join(repr(metric[k]) for k in paths)}) are not read, as in DeepSpeed",
        UserWarning,
        stacklevel=4,
    )
    return {k: v for k, v in metric.items() if k not in paths}


def _custom_schedules(
    functions: Mapping[str, Callable[[int], int]] | None, metrics: Mapping[str, Any]
) -> dict[str, Callable[[int], int]]:
    """``parse_deepspeed_config``'s ``custom_schedules``, checked against the metrics of ``schedule_type: custom``."""
    if functions is None:
        return {}
    functions = to_plain(functions)
    if not isinstance(functions, Mapping):
        raise CurriculumConfigError(
            f"parse_deepspeed_config: custom_schedules must be a dict {{metric name: fn(step) -> int}}, got "
            f"{type(functions).__name__}"
        )
    custom = sorted(n for n, m in metrics.items() if isinstance(m, Mapping) and m.get("schedule_type") == "custom")
    for name, fn in functions.items():
        if name not in custom:
            raise CurriculumConfigError(
                f"parse_deepspeed_config: custom_schedules[{name!r}]: the DeepSpeed config has no metric {name!r} of "
                f"schedule_type 'custom' (those of schedule_type 'custom': {custom})"
            )
        if not callable(fn):
            raise CurriculumConfigError(
                f"parse_deepspeed_config: custom_schedules[{name!r}] must be a callable fn(step) -> int, got {fn!r}"
            )
    return dict(functions)


def _warn_rounding(metrics: Mapping[str, MetricConfig]) -> None:
    """Warn where the default ``rounding="clamped"`` trains another schedule than DeepSpeed's arithmetic: a
    ``fixed_linear`` / ``fixed_root`` metric whose ``min_difficulty`` or ``max_difficulty`` is not a multiple of its
    ``difficulty_step`` (DeepSpeed rounds the first value up to the next multiple and plateaus at the last multiple
    below ``max_difficulty``; ``clamped`` starts at ``min_difficulty`` and reaches ``max_difficulty`` at
    ``total_curriculum_step``)."""
    differ = []
    for name, m in metrics.items():
        if m.schedule_type not in ("fixed_linear", "fixed_root"):
            continue
        step = int(m.schedule_config.get("difficulty_step", 1))
        ds, what = m.schedule("deepspeed"), []
        first = -(-m.min_difficulty // step) * step  # DeepSpeed's first value: min_difficulty rounded up
        until = reach_step(m.schedule("clamped"), first) if m.min_difficulty % step else 1
        if until is not None and until > 1:
            steps = "step 1" if until == 2 else f"steps 1-{until - 1}"
            what.append(f"{steps} train {m.schedule('clamped')(1)} (DeepSpeed: {first})")
        if m.max_difficulty % step:
            total, reached = m.schedule_config["total_curriculum_step"], reach_step(ds, m.max_difficulty)
            what.append(
                f"{m.max_difficulty} is reached at step {total} (DeepSpeed: "
                + (f"{ds(total)} there, {m.max_difficulty} from step {reached})" if reached else "never)")
            )
        if what:
            differ.append(
                f"curriculum_metrics.{name} (min_difficulty {m.min_difficulty}, max_difficulty {m.max_difficulty}, "
                f"difficulty_step {step}): {', '.join(what)}"
            )
    if differ:
        warnings.warn(
            "parse_deepspeed_config: with lightning_effi's default rounding='clamped' the curriculum trains another "
            f"schedule than DeepSpeed for {'; '.join(differ)}; pass rounding='deepspeed' to train DeepSpeed's "
            "schedule, or rounding='clamped' to keep this one and silence this warning",
            UserWarning,
            stacklevel=3,
        )


def _check_inert_metrics(metrics: Mapping[str, MetricConfig]) -> None:
    """A ``single_cluster`` metric filters no data, and only ``seqlen_truncate`` / ``seqlen_reshape`` change the
    batches (in the reference, Megatron-DeepSpeed's ``pretrain_gpt.py`` / ``pretrain_bert.py`` post-process the batch
    for these two names alone); any other ``single_cluster`` metric only exposes its difficulty (logged, and
    ``Curriculum.last_difficulties``).

    Raises:
        CurriculumConfigError: a ``single_cluster`` metric whose name is a near miss of those two (``seqlen_truncat``,
            ``seqlen-truncate``): it would run as a plain loader, naming the intended metric.

    Warns when no metric changes training (none ``schedule_based``, none of the two transforms).
    """
    import difflib

    inert = [n for n, m in metrics.items() if not m.schedule_based and n not in TRANSFORM_METRICS]
    for name in inert:
        close = difflib.get_close_matches(name.replace("-", "_").lower(), TRANSFORM_METRICS, n=1, cutoff=0.8)
        if close:
            raise CurriculumConfigError(
                f"curriculum_metrics.{name}: not a metric name the curriculum acts on; did you mean {close[0]!r}? "
                f"A single_cluster metric filters no data, and only {' / '.join(TRANSFORM_METRICS)} change the "
                f"batches, so {name!r} would train every batch as the plain loader does"
            )
    if inert and len(inert) == len(metrics):
        warnings.warn(
            f"curriculum: no metric changes training: {', '.join(inert)} "
            f"{'is a single_cluster metric' if len(inert) == 1 else 'are single_cluster metrics'} (no data filtered) "
            f"other than {' / '.join(TRANSFORM_METRICS)} (the only ones that change the batches), so every batch "
            "trains as the plain loader's; the difficulty is only logged (effi/curriculum/<metric>_difficulty). "
            "Use clustering_type schedule_based with analysis files or an analyzer metric to order the data",
            UserWarning,
            stacklevel=2,
        )


def _warn_data_routing(routing: Any) -> None:
    """Warn when the DeepSpeed config enables random-LTD (``data_efficiency.data_routing.random_ltd``), which
    :func:`parse_deepspeed_config` does not read: in Lightning, random-LTD is its own callback."""
    if not isinstance(routing, Mapping):
        return
    ltd = routing.get("random_ltd")
    if isinstance(ltd, Mapping) and ltd.get("enabled") not in (None, False) and routing.get("enabled") is not False:
        warnings.warn(
            "parse_deepspeed_config: data_efficiency.data_routing.random_ltd is enabled in the DeepSpeed config but "
            "is not read here (this returns the curriculum only); add "
            "lightning_effi.RandomLTDCallback.from_deepspeed_config(ds_config) to the Trainer's callbacks",
            UserWarning,
            stacklevel=3,
        )
