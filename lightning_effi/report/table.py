"""The sweep report: every arm against the same-length baseline and against the baseline frontier.

Protocol (Kaddour et al. 2023, "No Train No Gain", NeurIPS, Sec. 3): the plain model (the *baseline*, no technique)
is trained at several budgets, each with its learning-rate schedule decayed to the end of that budget; per seed,
these runs' ``(compute, quality)`` points give the baseline frontier (:func:`~lightning_effi.report.frontier.
pareto_front`). An efficient-training arm is then read twice:

- against the *same-length baseline* (the baseline run of the same seed and budget): the compute saving
  ``1 - arm / baseline`` and the quality difference ``arm - baseline``;
- against the *frontier* (same seed): the compute the frontier needs to reach the arm's final quality
  (:func:`~lightning_effi.report.frontier.compute_to_reach`) and the saving ``1 - arm / that``; ``beyond``: the arm
  is better than every baseline budget (the saving is a lower bound), ``below``: worse than the smallest budget
  (an upper bound).

The same reading on training wall time (seconds of train + data time, evaluation excluded) gives the wall-time
frontier saving. Figures are aggregated over seeds as mean, sample standard deviation and count.

Units: FLOPs are forward + backward training FLOPs as the ``EfficiencyMonitor`` counts them; ``tokens``,
``samples`` and ``layer_tokens`` are its counts of what was trained; times are seconds.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from typing import Any

from lightning_effi.report.frontier import (
    Mode,
    Reach,
    Spread,
    better,
    check_mode,
    compute_to_reach,
    infer_mode,
    pareto_indices,
    saving,
    spread,
)
from lightning_effi.report.load import (
    COMPUTE_KEYS,
    ReportError,
    Run,
    folder_blocker,
    jobs_without_result,
    json_safe,
    load_runs,
    write_problem,
)

PAPER = (
    'Kaddour et al. 2023, "No Train No Gain: Revisiting Efficient Training Algorithms For Transformer-based '
    'Language Models", NeurIPS, Sec. 3'
)
#: the CSV's columns, in order (``report.rows`` dicts have these keys)
COLUMNS: tuple[str, ...] = (
    "arm",
    "budget",
    "baseline",
    "n_seeds",
    "seeds",
    "quality_mean",
    "quality_std",
    "quality_n",
    "flops_mean",
    "flops_std",
    "flops_n",
    "tokens_mean",
    "tokens_n",
    "samples_mean",
    "samples_n",
    "layer_tokens_mean",
    "train_wall_s_mean",
    "train_wall_s_std",
    "train_wall_s_n",
    "same_length_saving_mean",
    "same_length_saving_std",
    "same_length_n",
    "same_length_quality_delta_mean",
    "same_length_quality_delta_std",
    "same_length_quality_delta_n",
    "same_length_wall_saving_mean",
    "same_length_wall_saving_std",
    "frontier_compute_mean",
    "frontier_compute_std",
    "frontier_saving_mean",
    "frontier_saving_std",
    "frontier_factor_mean",
    "frontier_n",
    "frontier_flag",
    "frontier_wall_s_mean",
    "frontier_wall_saving_mean",
    "frontier_wall_saving_std",
    "frontier_wall_factor_mean",
    "frontier_wall_n",
    "frontier_wall_flag",
    "note",
)


@dataclass(frozen=True)
class SeedFrontier:
    """One seed's baseline frontier on one axis (``compute`` or ``train_wall_s``).

    Attributes:
        seed: the seed.
        axis: the compute quantity (``flops``, ``tokens``, ...) or ``train_wall_s`` (seconds).
        points: every usable baseline run of the seed: ``(compute, quality)``.
        runs: the runs behind ``points`` (same order).
        front: the Pareto front of ``points`` (sorted by compute).
        front_runs: the runs on the front.
        budgets: the distinct budgets among ``points``.
        why: why the frontier cannot be read (``""`` when it can): fewer than 2 budgets, no usable baseline.
    """

    seed: int
    axis: str
    points: tuple[tuple[float, float], ...]
    runs: tuple[Run, ...]
    front: tuple[tuple[float, float], ...]
    front_runs: tuple[Run, ...]
    budgets: tuple[float, ...]
    why: str

    @property
    def usable(self) -> bool:
        return not self.why


@dataclass
class Report:
    """The result of :func:`build_report`.

    Attributes:
        rows: one dict per arm (``(arm, budget)`` group) with the keys of :data:`COLUMNS`: baselines first, by
            budget, then the technique arms by name and budget. Savings are fractions (0.25: 25% less); NaN or
            ``""`` where a figure cannot be read (``note`` says why).
        readings: one dict per run: its quality, compute, wall time and the per-seed savings behind the rows.
        frontiers: seed -> axis (the compute quantity and ``"train_wall_s"``) -> :class:`SeedFrontier`.
        runs: every run reported.
        metric, mode: the quality metric and its direction; ``compute``: the compute quantity of the savings.
        notes: what the report left out or could not read (runs without a finite metric, seeds without a
            frontier, failed jobs), and what qualifies a reading (an arm of another configured length, or other
            model, data or trainer overrides, than its same-length baseline, or, without one, than its frontier's
            baselines; a frontier whose baselines differ in those overrides; a technique dropped or added on
            resume).
    """

    rows: list[dict[str, Any]]
    readings: list[dict[str, Any]]
    frontiers: dict[int, dict[str, SeedFrontier]]
    runs: list[Run]
    metric: str
    mode: Mode
    compute: str
    notes: list[str] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)

    # ------------------------------------------------------------------------------------------ the frontier
    def frontier_summary(self) -> str:
        """A short paragraph: what the frontier is, its budgets and seeds, and how to read the flags."""
        usable = {s: f[self.compute] for s, f in sorted(self.frontiers.items()) if f[self.compute].usable}
        budgets = sorted({b for f in usable.values() for b in f.budgets})
        direction = "lower" if self.mode == "min" else "higher"
        text = (
            f"**Baseline frontier** ({PAPER}): per seed, the baseline (no technique) trained at each budget, each "
            f"with its learning-rate schedule decayed to the end of its own budget; its Pareto points "
            f"({self.compute}, {self.metric}) are joined linearly in {self.metric} and in log-{self.compute}. "
            f"*Frontier {self.compute} needed* is what that frontier spends to reach an arm's final {self.metric} "
            f"({direction} is better); *saving vs frontier* is 1 - arm / that (and the same on training wall time). "
            f"'>=' (beyond): the arm is better than every baseline budget, so the saving (and the frontier's "
            f"{self.compute} needed) is a lower bound; '<=' (below): worse than the smallest budget, an upper bound "
            f"(also on a mean over seeds where some read inside, the counts in brackets; where some seeds read beyond "
            f"and others below, the cells show no mean). *Same-length* columns compare with the baseline run of the "
            f"same seed and budget (quality delta: arm - baseline). Figures are mean ± sample std over seeds "
            f"(n=k: read on k of them; a compute of 0, which the EfficiencyMonitor could not count, is left out); the "
            f"factor in brackets is that of the mean saving, 1 / (1 - mean). "
        )
        if usable:
            fronts = "; ".join(
                f"seed {s}: {len(f.front)} of {len(f.points)} baseline runs on the front" for s, f in usable.items()
            )
            text += (
                f"This sweep's frontier: {len(budgets)} budgets ({', '.join(f'{b:g}' for b in budgets)}), "
                f"{len(usable)} seed{'s' if len(usable) != 1 else ''} ({', '.join(str(s) for s in usable)}); {fronts}."
            )
            # the wall-time column reads a front of its own: a baseline slower than a longer one (timing noise) is
            # off it, and the savings read by hand from the compute front's runs differed (qa55-user 01)
            walls = {s: self.frontiers[s].get("train_wall_s") for s in usable}
            differ = [
                f"seed {s}: {len(w.front)} of {len(w.points)}"
                for s, w in walls.items()
                if w is not None and w.usable and len(w.front) != len(usable[s].front)
            ]
            if differ:
                text += (
                    f" On training wall time the front is its own ({'; '.join(differ)} baseline runs on it: a run "
                    "slower than a longer budget's, at a worse quality, is off it)."
                )
        else:
            text += "This sweep has no usable frontier: " + (
                "; ".join(f[self.compute].why for _, f in sorted(self.frontiers.items())) or "no baseline runs"
            )
            text += "."
        return text

    # ------------------------------------------------------------------------------------------ the table
    def to_markdown(self) -> str:
        """The Markdown table, the frontier paragraph and the notes."""
        q = self.metric
        c = self.compute
        count = "tokens" if any(r.compute("tokens") > 0 for r in self.runs) else "samples"
        header = [
            "arm",
            "budget",
            "seeds",
            f"{q} ({self.mode})",
            "FLOPs",
            count,
            "train wall (s)",
            f"saving vs same-length ({c})",
            f"Δ {q} vs same-length",
            f"frontier {c} needed",
            f"saving vs frontier ({c})",
            "saving vs frontier (wall)",
        ]
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        for row in self.rows:
            cells = [
                # a pipe would add a column, a line break end the row
                str(row["arm"]).replace("|", "\\|").replace("\r", "\\r").replace("\n", "\\n"),
                f"{row['budget']:g}",
                str(row["n_seeds"]),
                _pm(row["quality_mean"], row["quality_std"], "{:.4g}", n=row["quality_n"], of=row["n_seeds"]),
                _num(row["flops_mean"], "{:.3g}") + _of(row["flops_n"], row["n_seeds"]),
                _num(row[f"{count}_mean"], "{:.4g}") + _of(row[f"{count}_n"], row["n_seeds"]),
                _num(row["train_wall_s_mean"], "{:.1f}") + _of(row["train_wall_s_n"], row["n_seeds"]),
            ]
            if row["baseline"]:
                cells += ["(baseline)"] + ["—"] * 4
            else:
                seeds = row["n_seeds"]
                cells += [
                    _pct(row["same_length_saving_mean"], row["same_length_saving_std"], "")
                    + _of(row["same_length_n"], seeds),
                    _pm(row["same_length_quality_delta_mean"], row["same_length_quality_delta_std"], "{:+.4g}")
                    + _of(row["same_length_quality_delta_n"], seeds),
                    _needed(row["frontier_compute_mean"], row["frontier_flag"]) + _of(row["frontier_n"], seeds),
                    _pct(
                        row["frontier_saving_mean"],
                        row["frontier_saving_std"],
                        row["frontier_flag"],
                        row["frontier_factor_mean"],
                    )
                    + _of(row["frontier_n"], seeds),
                    _pct(
                        row["frontier_wall_saving_mean"],
                        row["frontier_wall_saving_std"],
                        row["frontier_wall_flag"],
                        row["frontier_wall_factor_mean"],
                    )
                    + _of(row["frontier_wall_n"], seeds),
                ]
            lines.append("| " + " | ".join(cells) + " |")
        out = "\n".join(lines) + "\n\n" + self.frontier_summary() + "\n"
        if self.notes:
            out += "\nNotes:\n" + "\n".join(f"- {n}" for n in self.notes) + "\n"
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: metric, mode, compute, rows, readings, frontiers (points, front, budgets, why), notes;
        NaN as ``null``."""
        frontiers = {
            str(seed): {
                axis: {
                    "points": [list(p) for p in f.points],
                    "runs": [shown_path(r.path) for r in f.runs],
                    "front": [list(p) for p in f.front],
                    "front_runs": [shown_path(r.path) for r in f.front_runs],
                    "budgets": list(f.budgets),
                    "why": f.why,
                }
                for axis, f in by_axis.items()
            }
            for seed, by_axis in sorted(self.frontiers.items())
        }
        out: dict[str, Any] = json_safe(
            {
                "metric": self.metric,
                "mode": self.mode,
                "compute": self.compute,
                "protocol": PAPER,
                "rows": self.rows,
                "readings": self.readings,
                "frontiers": frontiers,
                "notes": self.notes,
            }
        )
        return out

    def write_csv(self, path: Path) -> None:
        """``rows`` as CSV (:data:`COLUMNS`; floats at full precision; NaN as an empty cell)."""
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
            writer.writeheader()
            for row in self.rows:
                writer.writerow({k: _csv_cell(row[k]) for k in COLUMNS})


def _csv_cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if not math.isfinite(value) else repr(value)
    return value


def _num(value: float, fmt: str) -> str:
    return "—" if value is None or not math.isfinite(value) else fmt.format(value)


def _pm(mean: float, std: float, fmt: str, n: int | None = None, of: int | None = None) -> str:
    if not math.isfinite(mean):
        return "—"
    text = fmt.format(mean)
    if math.isfinite(std):
        std = 0.0 if std <= 1e-12 * max(1.0, abs(mean)) else std  # rounding noise of equal values
        text += " ± " + fmt.replace("+", "").format(std)
    if n is not None and of is not None and n < of:
        text += f" (n={n})"
    return text


def _of(n: int, seeds: int) -> str:
    """`` (n=2)`` after a figure read from fewer of the row's seeds (the others lacked what it needs: a same-length
    baseline, a frontier), else nothing; nothing either where no seed gave one (the cell reads —)."""
    return f" (n={n})" if 0 < n < seeds else ""


def _bound(flag: str) -> str | None:
    """How a mean of readings flagged ``flag`` (:func:`_flag`) bounds the true figure: ``""`` (estimates), ``">= "``
    (estimates and lower bounds: readings beyond the frontier's best quality), ``"<= "`` (estimates and upper bounds:
    below its worst), None (lower and upper bounds: the mean bounds nothing)."""
    kinds = {part.split()[0] for part in flag.split(", ")} if flag else set()
    if {"beyond", "below"} <= kinds:
        return None
    if "beyond" in kinds:
        return ">= "
    if "below" in kinds:
        return "<= "
    return ""


def _pct(mean: float, std: float, flag: str, factor: float = math.nan) -> str:
    bound = _bound(flag)
    if bound is None:  # a lower and an upper bound: their mean bounds nothing
        return f"— ({flag}: no bound on the mean)"
    if not math.isfinite(mean):
        return "—"
    text = f"{bound}{100 * mean:+.1f}%"
    if math.isfinite(std) and not bound:  # the spread of bounds is no spread of the saving
        text += f" ± {100 * std:.1f}%"
    if math.isfinite(factor):  # 1 / (1 - saving): bounded on the same side
        text += f" ({bound}{factor:.2f}x)"
    if ", " in flag:  # readings of several kinds: how many of each
        text += f" ({flag})"
    return text


def _needed(mean: float, flag: str) -> str:
    """The frontier's compute for the arm's quality, bounded as its saving is (:func:`_bound`, opposite side: a
    lower bound on the saving is a lower bound on the compute the frontier needs)."""
    bound = _bound(flag)
    if bound is None:
        return "— (no bound on the mean)"
    return "—" if not math.isfinite(mean) else f"{bound}{mean:.3g}"


# ---------------------------------------------------------------------------------------------- building
def _resolve_metric(runs: Sequence[Run], metric: str | None, mode: str | None) -> tuple[str, Mode]:
    if metric is None:
        names: dict[str | None, list[Run]] = defaultdict(list)
        for run in runs:
            names[run.metric_name].append(run)
        if None in names:
            raise ReportError(
                f"{len(names[None])} run(s) optimized no metric (optimized_metric: null, e.g. {names[None][0].path}); "
                "choose the metric to compare with metric= (--metric)"
            )
        if len(names) > 1:
            listing = ", ".join(
                f"{name!r} ({len(rs)} runs, e.g. {rs[0].path})"
                for name, rs in sorted(names.items(), key=lambda i: str(i[0]))
            )
            raise ReportError(
                f"runs optimize different metrics: {listing}; choose one to compare with metric= (--metric)"
            )
        metric = str(next(iter(names)))
    for run in runs:
        run.quality(metric)  # ReportError naming the file of a run that did not log it
    modes = {run.mode for run in runs if run.metric_name == metric}
    if mode is not None:
        try:
            chosen = check_mode(mode)
        except ValueError as err:
            raise ReportError(str(err)) from None
        named = infer_mode(metric)
        if not modes and named is not None and chosen != named:
            # write_result and the Hydra app refuse this contradiction; the report ranked the runs backwards without a
            # word where no run optimized the metric (a saving of +11.6% read as <= -150%, qa83-report 03)
            raise ReportError(
                f"mode={chosen!r} (--mode) contradicts metric {metric!r}, whose name says "
                f"{'lower' if named == 'min' else 'higher'} is better: the report would rank the runs backwards; "
                f"leave mode out (it reads {named!r} from the name)"
            )
        if modes and chosen not in modes:
            warnings.warn(
                f"report: mode={chosen!r} (--mode) for {metric!r}, but the runs optimized {metric!r} with "
                f"optimized_mode={sorted(modes)[0]!r}; the report ranks the runs as {chosen!r} says "
                f"({'lower' if chosen == 'min' else 'higher'} is better). Leave mode out to use the runs' own",
                UserWarning,
                stacklevel=3,
            )
        return metric, chosen
    if len(modes) > 1:
        raise ReportError(f"runs optimize {metric!r} in both directions (min and max); choose one with mode= (--mode)")
    if not modes:
        inferred = infer_mode(metric)  # as write_result reads it: min for a loss, max for an accuracy
        if inferred is None:
            raise ReportError(
                f"no run optimizes {metric!r} and its name does not say whether lower or higher is better; give "
                "mode='min' or 'max' (--mode)"
            )
        return metric, inferred
    return metric, modes.pop()


#: override keys that never tell variants of an arm apart (the seed is a column; the arm and budget are the label)
_NOT_VARIANT_KEYS = ("seed", "arm", "budget", "bench")


def _overrides(run: Run) -> dict[str, str]:
    """The run's Hydra overrides as ``key -> value``: ``+key=v`` and ``++key=v`` as ``key=v``, a removal ``~key`` (or
    ``~key=v``) as ``<removed>``."""
    items = {}
    for override in run.overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        if override.startswith("~"):
            items[key] = "<removed>"
        elif sep:
            items[key] = value
    return items


def _override_items(run: Run) -> dict[str, str]:
    """The overrides that may tell variants of an arm apart (:func:`label_variants`)."""
    return {k: v for k, v in _overrides(run).items() if k not in _NOT_VARIANT_KEYS and not k.startswith("hydra.")}


def label_variants(runs: Sequence[Run]) -> list[Run]:
    """Tell apart the variants of an arm that a sweep trained at the same budget and seed (an Optuna or grid sweep
    over a technique's settings): where two runs share arm, budget and seed, each run of that arm is relabelled
    ``arm[key=value, ...]`` with the overrides whose values differ among the arm's runs (``seed``, ``arm``, ``budget``,
    ``bench`` and ``hydra.*`` left out; ``key=default`` where a run does not override ``key``), so the trials of one
    setting over several seeds form one arm. Runs of other
    arms, and arms without such duplicates, keep their labels. Then runs of one arm and budget whose recorded
    technique settings differ are told apart by those settings (:func:`_label_setting_variants`)."""
    runs = list(runs)
    counts: dict[tuple[str, float, int], int] = defaultdict(int)
    for run in runs:
        counts[(run.arm, run.budget, run.seed)] += 1
    duplicated = {arm for (arm, _, _), n in counts.items() if n > 1}
    out = []
    for arm in duplicated:
        members = [r for r in runs if r.arm == arm]
        items = [_override_items(r) for r in members]
        keys = sorted({k for it in items for k in it})
        varying = [k for k in keys if len({it.get(k) for it in items}) > 1]
        if not varying:
            continue
        for r, it in zip(members, items):
            label = ", ".join(f"{k}={it.get(k, 'default')}" for k in varying)
            out.append((id(r), replace(r, arm=f"{arm}[{label}]")))
    relabelled = dict(out)
    return _label_setting_variants([relabelled.get(id(r), r) for r in runs])


#: the memory address in an object's default ``str()`` (`` at 0x7f3c7eab5f80``)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _flat_settings(techniques: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A run's recorded technique settings as ``technique.key[.subkey] -> repr(value)``, the draws' ``seed`` keys
    left out (a sweep over seeds sets them from the run's seed)."""
    out: dict[str, str] = {}
    for key, value in techniques.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat_settings(value, f"{path}."))
        elif key != "seed":  # an object recorded by str() before: its memory address differs between processes
            out[path] = _ADDRESS.sub("", repr(value))
    return out


def _label_setting_variants(runs: list[Run]) -> list[Run]:
    """Runs of one arm and budget whose recorded technique settings differ (a setting changed in a config file
    between seeds, or ``write_result`` called with other callbacks under one label: the overrides do not tell them
    apart) are variants, not seeds of one arm: each such arm is relabelled ``arm[technique.key=value, ...]`` with the
    settings that differ within one of its budgets. Settings that differ only between budgets (a schedule scaled with
    the run's length) do not split an arm."""
    by_arm: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_arm[run.arm].append(run)
    relabelled: dict[int, Run] = {}
    for arm, members in by_arm.items():
        settings = {id(r): _flat_settings(r.techniques) for r in members}
        varying: set[str] = set()
        for budget in {r.budget for r in members}:
            group = [settings[id(r)] for r in members if r.budget == budget]
            keys = {k for g in group for k in g}
            varying |= {k for k in keys if len({g.get(k) for g in group}) > 1}
        if not varying:
            continue
        for r in members:
            label = ", ".join(f"{k}={settings[id(r)].get(k, 'none')}" for k in sorted(varying))
            relabelled[id(r)] = replace(r, arm=f"{arm}[{label}]")
    return [relabelled.get(id(r), r) for r in runs]


#: how a run gets its own label (``arm``), for the report's errors: ``arm`` is also the app's config group
#: (``conf/arm/``), so ``arm=<name>`` on the command line selects a file and ``+arm=<name>`` is refused by Hydra
LABEL_HOW = (
    "in the Hydra app, a config file conf/arm/<name>.yaml holding '# @package _global_' and 'arm: <name>', picked "
    "with arm=<name>; from Python, write_result(..., arm='<name>')"
)


def _check_runs(runs: Sequence[Run]) -> None:
    tasks: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        tasks[run.task_name].append(run)
    if len(tasks) > 1:
        listing = ", ".join(f"{t!r} ({len(rs)} runs, e.g. {rs[0].path})" for t, rs in sorted(tasks.items()))
        raise ReportError(
            f"runs of several tasks: {listing}; report each task's sweep folder separately, or, if they are one "
            "comparison (the same model, data and quality metric), give them one task_name (the override "
            "task_name=<name>; write_result(..., task_name=...))"
        )
    for run in runs:
        if run.arm == "baseline" and run.techniques:
            raise ReportError(
                f"{run.path}: arm 'baseline' but techniques {sorted(run.techniques)}; a baseline has no technique "
                f"({LABEL_HOW})"
            )
    groups: dict[tuple[str, float, int], list[Run]] = defaultdict(list)
    for run in runs:
        groups[(run.arm, run.budget, run.seed)].append(run)
    for (arm, budget, seed), same in groups.items():
        if len(same) > 1:
            raise ReportError(
                f"{len(same)} runs of arm {arm!r}, budget {budget:g}, seed {seed}: "
                f"{', '.join(str(r.path) for r in same)}; {_lengths_differ(same)}a report compares one run per arm, "
                f"budget and seed (label each variant, a baseline's as baseline_<name> to keep it on the frontier: "
                f"{LABEL_HOW}; or report their folders separately)"
            )


def _lengths_differ(same: Sequence[Run]) -> str:
    """The start of the duplicate-runs message when the runs were set to train different lengths (``max_steps`` or
    ``max_epochs``): then they are one arm's budgets recorded without their budget (``write_result``'s default 1.0),
    not variants to label (qa102-user 02). The steps taken are not compared: variants of one length take other numbers
    of steps (InfoBatch's pruned epochs, an early stop; qa103-regress 01)."""
    for key in ("max_steps", "max_epochs"):
        values = [r.length.get(key) for r in same]
        if None not in values and len(set(values)) > 1:
            listed = ", ".join(str(v) for v in values)
            return (
                f"they trained different lengths ({key} {listed}), so each is likely a budget of its own recorded "
                "without it: give each run its budget (the fraction of the reference length it trains: "
                "ResultWriter(budget=...) / write_result(..., budget=...); in a Hydra config `budget: ${budget}`). "
                "Otherwise, "
            )
    return ""


def _seed_frontier(
    seed: int, baselines: Sequence[Run], axis: str, quality: dict[int, float], mode: Mode
) -> SeedFrontier:
    usable = [
        r for r in baselines if math.isfinite(quality[id(r)]) and math.isfinite(r.compute(axis)) and r.compute(axis) > 0
    ]
    points = tuple((r.compute(axis), quality[id(r)]) for r in usable)
    budgets = tuple(sorted({r.budget for r in usable}))
    why = ""
    unit = "training wall time" if axis == "train_wall_s" else axis
    if not baselines:
        why = f"seed {seed}: no baseline run"
    elif not usable:
        why = f"seed {seed}: no baseline run with a finite metric and a positive {unit}"
    elif len(budgets) < 2:
        why = (
            f"seed {seed}: baselines at {len(budgets)} budget ({budgets[0]:g}); the frontier needs >= 2 budgets "
            "(add baseline runs with budget=<fraction>)"
        )
    front_idx = pareto_indices(points, mode) if usable else []
    return SeedFrontier(
        seed=seed,
        axis=axis,
        points=points,
        runs=tuple(usable),
        front=tuple(points[i] for i in front_idx),
        front_runs=tuple(usable[i] for i in front_idx),
        budgets=budgets,
        why=why,
    )


def _flag(flags: Sequence[str]) -> str:
    if not flags:
        return ""
    distinct = sorted(set(flags), key=["inside", "beyond", "below"].index)
    if len(distinct) == 1:
        return distinct[0]
    return ", ".join(f"{f} {flags.count(f)}" for f in distinct)


def build_report(
    runs: Sequence[Run], metric: str | None = None, compute: str = "flops", mode: str | None = None
) -> Report:
    """Compare every arm of a sweep with the same-length baseline and with the baseline frontier (per seed;
    protocol: Kaddour et al. 2023, "No Train No Gain", Sec. 3; see the module docstring).

    Arms are the runs grouped by ``(arm, budget)``; baseline runs are those without techniques whose arm starts with
    ``baseline`` (:attr:`~lightning_effi.report.load.Run.is_baseline`; another label without a technique is the
    user's own method, an arm). With several baseline arms (e.g. a learning-rate sweep of the plain model, each
    labelled ``baseline_<name>``, :data:`LABEL_HOW`), every one of them enters the seed's frontier, and the
    same-length reference is the best of them at that budget: the tuned baseline. A seed's frontier needs baselines
    at >= 2 budgets; otherwise its frontier columns are empty and ``notes`` says why.

    Args:
        runs: the runs (:func:`~lightning_effi.report.load.load_runs`).
        metric: the quality metric (default: the runs' ``optimized_metric``, which must then be the same for all).
        compute: the compute quantity of the savings: ``flops`` (forward + backward training FLOPs), ``tokens``,
            ``samples`` or ``layer_tokens``.
        mode: ``"min"`` or ``"max"`` (default: the ``optimized_mode`` of the runs optimizing ``metric``; when none
            does, read from its name as :func:`~lightning_effi.report.record.write_result` reads it: ``min`` for a
            loss, ``max`` for an accuracy).

    Returns:
        the :class:`Report`.

    Raises:
        ReportError: no runs; runs optimizing different metrics with no ``metric`` chosen; a ``metric`` some run
            did not log (the file named), or whose direction is unknown with no ``mode``; an unknown ``compute``;
            runs of several tasks; two runs with the same arm, budget, seed and overrides (named; runs that differ in
            overrides are told apart by :func:`label_variants`); a run labelled
            ``baseline`` that has techniques; a ``mode`` other than ``"min"`` / ``"max"``, or one against the
            name of a metric no run optimized (``"min"`` for ``val/acc``, as read by
            :func:`~lightning_effi.report.frontier.infer_mode`).

    Warns:
        UserWarning: ``mode`` contradicts the ``optimized_mode`` of the runs optimizing ``metric`` (both named; the
            given ``mode`` is used).
    """
    runs = list(runs)
    if not runs:
        raise ReportError("no runs to report")
    if compute not in COMPUTE_KEYS:
        raise ReportError(f"compute: expected one of {list(COMPUTE_KEYS)}, got {compute!r}")
    metric_name, m = _resolve_metric(runs, metric, mode)
    runs = label_variants(runs)
    _check_runs(runs)
    quality = {id(r): r.quality(metric_name) for r in runs}
    notes = [
        f"{r.path}: {metric_name} is not finite (no validation, or the run diverged); left out of means and frontier"
        for r in runs
        if not math.isfinite(quality[id(r)])
    ]
    for r in runs:
        if r.compute(compute) <= 0:
            notes.append(f"{r.path}: {compute} = 0 (the EfficiencyMonitor could not count it); no saving read")
        if r.length.get("stopped_early") is True:
            steps = r.length.get("optimizer_steps")
            notes.append(
                f"{r.label}: the fit stopped early, at optimizer step {steps} (EarlyStopping, max_time or "
                f"should_stop), short of its budget {r.budget:g}; "
                + (
                    "left out of the frontier and the same-length readings (its LR schedule did not decay)"
                    if r.is_baseline
                    else "its readings are those of the compute it trained"
                )
            )
        step = r.quality_step(metric_name)
        if step is not None:
            notes.append(
                f"{r.label}: its {metric_name} is the last validation's, at optimizer step {step} of "
                f"{r.length['optimizer_steps']}, read against the compute of the whole run (validate at the last "
                "step: a val_check_interval that divides the run)"
            )
        resumed = sorted(n for n, c in r.techniques.items() if isinstance(c, dict) and c.get("resumed_without"))
        if resumed:
            notes.append(
                f"{r.label}: resumed from a checkpoint without {', '.join(resumed)}, which trained only up to that "
                "checkpoint; its readings mix the two"
            )
        added = sorted(
            (c["added_on_resume"], n)
            for n, c in r.techniques.items()
            if isinstance(c, dict) and isinstance(c.get("added_on_resume"), int)
        )
        for step, name in added:
            notes.append(
                f"{r.label}: {name} joined on resume at optimizer step {step}, from a checkpoint of a fit without it, "
                "which trained the steps before; its readings mix the two"
            )
    notes += _undecayed_baselines(runs)
    runs = [r for r in runs if not (r.is_baseline and r.length.get("stopped_early") is True)]

    seeds = sorted({r.seed for r in runs})
    axes = (compute, "train_wall_s")
    frontiers: dict[int, dict[str, SeedFrontier]] = {}
    for seed in seeds:
        baselines = [r for r in runs if r.seed == seed and r.is_baseline]
        frontiers[seed] = {axis: _seed_frontier(seed, baselines, axis, quality, m) for axis in axes}
        if frontiers[seed][compute].why:
            notes.append("frontier of " + frontiers[seed][compute].why)
        notes += _budget_order_notes(seed, baselines, compute)
        if mixed := _mixed_setups(baselines):
            notes.append(
                f"frontier of seed {seed}: its baselines' model, data or trainer overrides differ "
                f"({'; '.join(mixed)}); it joins runs of other setups, not one setup at several budgets"
            )

    notes += _plain_cost_notes([r for r in runs if math.isfinite(quality[id(r)])], seeds)

    readings = [_reading(r, runs, quality, frontiers, compute, m, metric_name) for r in runs]
    by_run = {id(r): reading for r, reading in zip(runs, readings)}

    groups: dict[tuple[str, float], list[Run]] = defaultdict(list)
    for r in runs:
        groups[(r.arm, r.budget)].append(r)
    baseline_keys = sorted((k for k in groups if groups[k][0].is_baseline), key=lambda k: (k[1], k[0]))
    order = baseline_keys + sorted(k for k in groups if not groups[k][0].is_baseline)
    rows = [_row(arm, budget, sorted(groups[(arm, budget)], key=lambda r: r.seed), by_run) for arm, budget in order]
    for r in runs:
        if not r.is_baseline and math.isfinite(quality[id(r)]) and by_run[id(r)]["same_length_baseline"] is None:
            notes.append(f"{r.label}: no baseline run of seed {r.seed} at budget {r.budget:g}; no same-length reading")
            frontier = [b for b in runs if b.is_baseline and b.seed == r.seed]
            differing = sorted({d for b in frontier for d in _setup_differences(r, b)})
            if differing:
                notes.append(
                    f"{r.label}: its model, data or trainer overrides differ from those of its frontier's baselines "
                    f"(seed {r.seed}): {'; '.join(differing)}; its frontier reading compares other setups, not only "
                    "the technique"
                )
        elif not r.is_baseline and (path := by_run[id(r)]["same_length_baseline"]) is not None:
            base = next(b for b in runs if b.is_baseline and shown_path(b.path) == path)
            mine, theirs = _configured_length(r), _configured_length(base)
            if mine != theirs:
                notes.append(
                    f"{r.label}: configured for {mine}, its same-length baseline ({path}) for {theirs}, at the same "
                    f"budget label {r.budget:g}: its same-length reading compares runs of different lengths (the "
                    "frontier reading does not depend on the label)"
                )
            if differing := _setup_differences(r, base):
                notes.append(
                    f"{r.label}: its model, data or trainer overrides differ from its same-length baseline's "
                    f"({path}): {'; '.join(differing)}; its readings compare other setups, not only the technique"
                )
    return Report(
        rows=rows,
        readings=readings,
        frontiers=frontiers,
        runs=runs,
        metric=metric_name,
        mode=m,
        compute=compute,
        notes=list(dict.fromkeys(notes)),
    )


def shown_path(path: Path | str) -> str:
    """A run folder as the report records it: relative to the current directory when it lies below it (the
    repository root of a Hydra sweep: ``logs/<task>/multiruns/<time>/<job>``), so that a committed report names no
    machine's absolute paths; else as given."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


#: override key prefixes that set up the comparison itself (an arm and its baselines should share them)
_SETUP_PREFIXES = ("model", "data", "experiment", "trainer", "optimizer")
#: trainer keys that do not change what a run trains (its length is compared by :func:`_configured_length`)
_NOT_SETUP_KEYS = frozenset(
    f"trainer.{k}"
    for k in (
        "max_steps",
        "max_epochs",
        "max_time",
        "devices",
        "num_nodes",
        "accelerator",
        "strategy",
        "enable_progress_bar",
        "enable_model_summary",
        "log_every_n_steps",
        "default_root_dir",
        "val_check_interval",
        "check_val_every_n_epoch",
        "limit_val_batches",
        "num_sanity_val_steps",
    )
)


def _setup_items(run: Run) -> dict[str, str]:
    """The model, data, experiment and trainer overrides (:func:`_setup_differences`)."""
    return {k: v for k, v in _overrides(run).items() if k.split(".")[0] in _SETUP_PREFIXES and k not in _NOT_SETUP_KEYS}


def _setup_differences(run: Run, base: Run) -> list[str]:
    """The model, data, experiment and trainer overrides (the trainer's length, devices, logging and validation
    cadence left out) in which ``run`` and its same-length baseline ``base`` differ, as ``key: value vs value``
    (``default`` where one of them does not override ``key``)."""
    mine, theirs = _setup_items(run), _setup_items(base)
    return [
        f"{k}={mine.get(k, 'default')} vs {theirs.get(k, 'default')}"
        for k in sorted(set(mine) | set(theirs))
        if mine.get(k) != theirs.get(k)
    ]


def _mixed_setups(baselines: Sequence[Run]) -> list[str]:
    """The model, data, experiment and trainer overrides whose values differ among ``baselines`` (one seed's
    frontier), as ``key: value at budget b, value at budget c`` (``default`` where a run does not override ``key``)."""
    items = [(b.budget, _setup_items(b)) for b in sorted(baselines, key=lambda b: b.budget)]
    keys = sorted({k for _, it in items for k in it})
    return [
        f"{k}: " + ", ".join(f"{it.get(k, 'default')} at budget {budget:g}" for budget, it in items)
        for k in keys
        if len({it.get(k) for _, it in items}) > 1
    ]


#: how far apart (a ratio) two runs' plain-model FLOPs per token (per sample without tokens) may be before the report
#: notes that they trained different models or data. Legitimate runs differ by up to ~15%: a curriculum that draws
#: short sentences first pads its batches less (0.86x in a QA run), InfoBatch's estimate on padded batches (1.14x);
#: an edited model (twice the layers: 1.97x) lies beyond 1.5
PLAIN_COST_TOLERANCE = 1.5

#: the same among a frontier's baselines: one model on one data set at several budgets, no technique changing their
#: batches (1.00000 in every committed sweep; a padded text data set's budgets pad their batches a little
#: differently). An edited model within 1.5x (6 -> 8 layers: 1.33x) read as one frontier under the looser bound
BASELINE_COST_TOLERANCE = 1.1


def _plain_cost(run: Run) -> tuple[float, str] | None:
    """The training FLOPs per token (per sample where the run counted no tokens) of the model without any technique,
    from the EfficiencyMonitor's baseline (``baseline_flops / baseline_tokens``; a run without a technique: its own
    ``flops / tokens``): the same on every run of one model and one data set, whatever the budget or technique. None
    where the record lacks the figures, or for a run that is neither a baseline nor trained with a technique of
    this library (a method of the user's own, recorded with ``write_result``: its own FLOPs are not the plain
    model's)."""
    e = run.efficiency
    if not run.techniques and not run.is_baseline:
        return None
    prefix = "baseline_" if run.techniques else ""

    def total(key: str) -> float:
        value = e.get(prefix + key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return float(value) if ok else 0.0

    flops, tokens, samples = total("flops"), total("tokens"), total("samples")
    if flops <= 0:
        return None
    if tokens > 0:
        return flops / tokens, "token"
    return (flops / samples, "sample") if samples > 0 else None


def _plain_cost_notes(runs: Sequence[Run], seeds: Sequence[int]) -> list[str]:
    """Notes where runs compared with each other trained another model or other data than their frontier's
    baselines, as their plain-model FLOPs per token tell (:func:`_plain_cost`): a config file edited between the
    sweeps, or a user's own module changed between fits, leaves no Hydra override to compare."""
    notes = []
    for seed in seeds:
        baselines = sorted((r for r in runs if r.seed == seed and r.is_baseline), key=lambda r: r.budget)
        costs = [(b, c) for b in baselines if (c := _plain_cost(b)) is not None]
        units = {unit for _, (_, unit) in costs}
        if not costs or len(units) > 1:
            continue
        (unit,) = units
        values = sorted(v for _, (v, _) in costs)
        if values[-1] > values[0] * BASELINE_COST_TOLERANCE:
            listed = ", ".join(f"{v:.4g} at budget {b.budget:g}" for b, (v, _) in costs)
            notes.append(
                f"frontier of seed {seed}: its baselines' training FLOPs per {unit} differ ({listed}): they trained "
                "different models or data, not one setup at several budgets"
            )
            continue
        reference = values[len(values) // 2]
        for r in runs:
            mine = _plain_cost(r) if r.seed == seed and not r.is_baseline else None
            if mine is None or mine[1] != unit:
                continue
            ratio = mine[0] / reference
            if not 1 / PLAIN_COST_TOLERANCE <= ratio <= PLAIN_COST_TOLERANCE:
                notes.append(
                    f"{r.label}: the model without its techniques costs {mine[0]:.4g} training FLOPs per {unit} "
                    f"(efficiency.baseline_flops / baseline_{unit}s: the monitor's count of the plain model on the "
                    f"run's batches), {ratio:.2f}x its baselines' {reference:.4g} "
                    f"(seed {seed}): it trained another model or other data; its readings compare other setups, not "
                    "only the technique"
                )
    return notes


def _budget_order_notes(seed: int, baselines: Sequence[Run], compute: str) -> list[str]:
    """Notes on a seed's baselines whose compute does not grow with their budget: a larger budget that spent no more
    than a smaller one (a loop of the user's own that passes ``budget=`` to the record but trains every budget for one
    length: the frontier had one point per seed, read as several budgets with no note, qa75-user 03)."""
    notes = []
    arms = sorted({b.arm for b in baselines})  # each baseline arm on its own (one at twice the batch, qa76-regress 03)
    counted = [
        sorted((b for b in baselines if b.arm == a and b.compute(compute) > 0), key=lambda b: b.budget) for a in arms
    ]
    for small, large in (pair for runs in counted for pair in zip(runs, runs[1:])):
        if large.budget > small.budget and large.compute(compute) <= small.compute(compute):
            notes.append(
                f"frontier of seed {seed}: its {large.arm} at budget {large.budget:g} spent no more {compute} than the "
                f"one at budget {small.budget:g} ({large.compute(compute):.4g} against {small.compute(compute):.4g}; "
                f"configured for {_configured_length(large)} and {_configured_length(small)}): the budgets' lengths "
                "do not follow their labels (a budget scales the run's length: max_steps or max_epochs)"
            )
    return notes


def _configured_length(run: Run) -> str:
    """The run's configured training length (``max_steps`` / ``max_epochs`` of its record), for comparing two runs
    that carry the same budget label."""
    parts = [f"{key}={run.length[key]}" for key in ("max_steps", "max_epochs") if run.length.get(key) is not None]
    return ", ".join(parts) or "an unrecorded length"


def _reading(
    run: Run,
    runs: Sequence[Run],
    quality: dict[int, float],
    frontiers: dict[int, dict[str, SeedFrontier]],
    compute: str,
    mode: Mode,
    metric: str,
) -> dict[str, Any]:
    q = quality[id(run)]
    c = run.compute(compute)
    wall = run.train_wall_s
    out: dict[str, Any] = {
        "arm": run.arm,
        "budget": run.budget,
        "seed": run.seed,
        "path": shown_path(run.path),
        "baseline": run.is_baseline,
        "quality": q,
        "compute": c,
        "flops": run.compute("flops"),
        "tokens": run.compute("tokens"),
        "samples": run.compute("samples"),
        "layer_tokens": run.compute("layer_tokens"),
        "train_wall_s": wall,
        "same_length_baseline": None,
        "same_length_saving": math.nan,
        "same_length_factor": math.nan,
        "same_length_quality_delta": math.nan,
        "same_length_wall_saving": math.nan,
        "frontier_compute": math.nan,
        "frontier_saving": math.nan,
        "frontier_factor": math.nan,
        "frontier_flag": "",
        "frontier_wall_s": math.nan,
        "frontier_wall_saving": math.nan,
        "frontier_wall_factor": math.nan,
        "frontier_wall_flag": "",
        "note": "",
    }
    if run.is_baseline:
        front = frontiers[run.seed][compute]
        out["on_frontier"] = any(r is run for r in front.front_runs)
        return out
    why: list[str] = []
    if not math.isfinite(q):
        out["note"] = f"no finite {metric} to compare"
        return out
    same = [
        r
        for r in runs
        if r.is_baseline and r.seed == run.seed and r.budget == run.budget and math.isfinite(quality[id(r)])
    ]
    if same:
        best = same[0]
        for r in same[1:]:
            if better(quality[id(r)], quality[id(best)], mode):
                best = r
        out["same_length_baseline"] = shown_path(best.path)
        out["same_length_quality_delta"] = q - quality[id(best)]
        if c > 0 and best.compute(compute) > 0:
            s = saving(c, best.compute(compute))
            out["same_length_saving"], out["same_length_factor"] = s.fraction, s.factor
        if wall > 0 and best.train_wall_s > 0:
            out["same_length_wall_saving"] = saving(wall, best.train_wall_s).fraction
    else:
        why.append(f"no baseline at budget {run.budget:g} for seed {run.seed}")
    for axis, value, prefix in ((compute, c, "frontier"), ("train_wall_s", wall, "frontier_wall")):
        front = frontiers[run.seed][axis]
        if not front.usable:
            if axis == compute:
                why.append("no frontier (" + front.why + ")")
            continue
        reach: Reach = compute_to_reach(front.front, q, mode)
        key = "frontier_compute" if axis == compute else "frontier_wall_s"
        out[key] = reach.compute
        out[f"{prefix}_flag"] = reach.flag
        if value > 0:
            s = saving(value, reach.compute)
            out[f"{prefix}_saving"], out[f"{prefix}_factor"] = s.fraction, s.factor
    out["note"] = "; ".join(why)
    return out


def _factor(mean_saving: float) -> float:
    """The factor of a mean saving, ``1 / (1 - mean)`` (NaN when the mean is NaN or a saving of 100% or more)."""
    return 1.0 / (1.0 - mean_saving) if math.isfinite(mean_saving) and mean_saving < 1.0 else math.nan


def _row(arm: str, budget: float, runs: Sequence[Run], by_run: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One row of the table: the readings of ``runs`` (an arm at a budget, one per seed) as mean, sample std and the
    number of seeds read (``*_n``).

    A compute of 0 is a quantity the EfficiencyMonitor could not count (the readings' note says so): the compute
    means leave it out, as the savings do. The frontier columns aggregate the seeds whose saving was read; their flag
    lists how each was read (``inside`` the frontier's range: an estimate; ``beyond`` its best quality: a lower bound;
    ``below`` its worst: an upper bound), and a mean of lower and upper bounds, which bounds nothing, is left out
    (NaN)."""
    readings = [by_run[id(r)] for r in runs]

    def agg(key: str, among: Sequence[dict[str, Any]] = readings) -> Spread:
        return spread(rd[key] for rd in among)

    def counted(key: str) -> Spread:
        return spread(rd[key] for rd in readings if rd[key] > 0)

    quality, flops, wall = agg("quality"), counted("flops"), counted("train_wall_s")
    tokens, samples = counted("tokens"), counted("samples")
    same, delta, same_wall = agg("same_length_saving"), agg("same_length_quality_delta"), agg("same_length_wall_saving")
    read = [rd for rd in readings if math.isfinite(rd["frontier_saving"])]
    read_wall = [rd for rd in readings if math.isfinite(rd["frontier_wall_saving"])]
    flag = _flag([rd["frontier_flag"] for rd in read if rd["frontier_flag"]])
    wall_flag = _flag([rd["frontier_wall_flag"] for rd in read_wall if rd["frontier_wall_flag"]])
    fc, fs = agg("frontier_compute", read), agg("frontier_saving", read)
    fw, fws = agg("frontier_wall_s", read_wall), agg("frontier_wall_saving", read_wall)
    if _bound(flag) is None:  # lower and upper bounds: no mean
        fc = fs = Spread(math.nan, math.nan, fs.n)
    if _bound(wall_flag) is None:
        fw = fws = Spread(math.nan, math.nan, fws.n)
    notes = list(dict.fromkeys(rd["note"] for rd in readings if rd["note"]))
    return {
        "arm": arm,
        "budget": budget,
        "baseline": runs[0].is_baseline,
        "n_seeds": len(runs),
        "seeds": ";".join(str(r.seed) for r in runs),
        "quality_mean": quality.mean,
        "quality_std": quality.std,
        "quality_n": quality.n,
        "flops_mean": flops.mean,
        "flops_std": flops.std,
        "flops_n": flops.n,
        "tokens_mean": tokens.mean,
        "tokens_n": tokens.n,
        "samples_mean": samples.mean,
        "samples_n": samples.n,
        "layer_tokens_mean": counted("layer_tokens").mean,
        "train_wall_s_mean": wall.mean,
        "train_wall_s_std": wall.std,
        "train_wall_s_n": wall.n,
        "same_length_saving_mean": same.mean,
        "same_length_saving_std": same.std,
        "same_length_n": same.n,
        "same_length_quality_delta_mean": delta.mean,
        "same_length_quality_delta_std": delta.std,
        "same_length_quality_delta_n": delta.n,
        "same_length_wall_saving_mean": same_wall.mean,
        "same_length_wall_saving_std": same_wall.std,
        "frontier_compute_mean": fc.mean,
        "frontier_compute_std": fc.std,
        "frontier_saving_mean": fs.mean,
        "frontier_saving_std": fs.std,
        # the factor of the mean saving (1 / (1 - mean)): the mean of per-seed factors can read above 1x while the
        # mean saving is negative (1 / (1 - s) is convex), and the cell shows both
        "frontier_factor_mean": _factor(fs.mean),
        "frontier_n": fs.n,
        "frontier_flag": flag,
        "frontier_wall_s_mean": fw.mean,
        "frontier_wall_saving_mean": fws.mean,
        "frontier_wall_saving_std": fws.std,
        "frontier_wall_factor_mean": _factor(fws.mean),
        "frontier_wall_n": fws.n,
        "frontier_wall_flag": wall_flag,
        "note": "; ".join(notes),
    }


def write_report(
    paths: Iterable[str | Path] | str | PurePath,
    out_dir: str | Path | None = None,
    metric: str | None = None,
    compute: str = "flops",
    mode: str | None = None,
) -> Report:
    """Load the runs under ``paths``, :func:`build_report` them and write into ``out_dir`` (default: the first
    path; a ``result.json`` path: its folder):

    - ``report.md``: the Markdown table, the frontier paragraph and the notes;
    - ``report.csv``: :attr:`Report.rows` (:data:`COLUMNS`); ``report.json``: :meth:`Report.to_dict`;
    - ``quality_vs_compute.png``, ``quality_vs_wall.png``, ``curves.png`` and, when a run recorded one,
      ``schedules.png`` (:mod:`lightning_effi.report.plots`).

    Returns the :class:`Report` (``report.files``: name -> path of what was written).

    Raises:
        FileNotFoundError: a path that does not exist or holds no ``result.json``.
        ReportError: ``out_dir`` is an existing file or lies beneath one (checked before the runs are read), or
            cannot be written (a probe file, before the report is built) or created; see
            :func:`~lightning_effi.report.load.load_runs` and :func:`build_report`.
    """
    from lightning_effi.report import plots  # matplotlib only when writing

    paths = [paths] if isinstance(paths, str | PurePath) else list(paths)  # one folder: not its letters
    # '~/runs' is the home folder's, as the shell reads it (a folder named '~' here, qa86-break 08)
    paths = [Path(p).expanduser() for p in paths]
    if out_dir is not None:
        out_dir = Path(out_dir).expanduser()
        _check_out_dir(out_dir)
    runs = load_runs(paths)
    out = Path(out_dir) if out_dir is not None else Path(paths[0])
    if out.is_file():  # the first path is a result.json: its run folder
        out = out.parent
    names = [*REPORT_FILES, *(["schedules.png"] if plots.schedule_keys(runs) else [])]  # what write_plots writes
    if out_dir is not None:
        _check_writable(out, "out_dir", names)
    else:
        _check_writable(out, "the report's folder (the first path; choose another with out_dir= / --out)", names)
    report = build_report(runs, metric=metric, compute=compute, mode=mode)
    failed = jobs_without_result(paths)
    report.notes.extend(
        f"{job}: a Hydra job folder without result.json (the job failed or is running)" for job in failed
    )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ReportError(f"out_dir: cannot create '{out}' for the report ({err.strerror or err})") from None
    files = {
        "report.md": out / "report.md",
        "report.csv": out / "report.csv",
        "report.json": out / "report.json",
    }
    try:
        files["report.md"].write_text(f"# Sweep report: {report.metric} vs {report.compute}\n\n" + report.to_markdown())
        report.write_csv(files["report.csv"])
        files["report.json"].write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        files.update(plots.write_plots(report, out))
    except OSError as err:  # a disk that filled, a folder made read-only while the report was built
        raise ReportError(f"out_dir: cannot write the report into '{out}' ({type(err).__name__}: {err})") from None
    report.files = files
    return report


#: how far above the lowest of its seed's baselines a baseline's end-of-fit LR ratio may be (of the starting rate)
LR_END_TOLERANCE = 0.05


def _undecayed_baselines(runs: Sequence[Run]) -> list[str]:
    """Notes on the baselines whose learning rate ended above the others' of their seed (``length.lr_end_ratio``,
    the rate after the last scheduler step over the starting rate, by more than :data:`LR_END_TOLERANCE`): the
    protocol wants each budget's schedule decayed over its own length, and a baseline whose schedule was sized for a
    longer run ends short of its quality, so the frontier flatters the arms (accepted in silence before, qa86-user
    02). Records written before the ratio was kept say nothing."""
    notes = []
    for seed in sorted({r.seed for r in runs}):
        ratios = {
            id(r): float(r.length["lr_end_ratio"])
            for r in runs
            if r.seed == seed
            and r.is_baseline
            and isinstance(r.length.get("lr_end_ratio"), int | float)
            and not isinstance(r.length.get("lr_end_ratio"), bool)
            and math.isfinite(r.length["lr_end_ratio"])
        }
        if len(ratios) < 2:
            continue
        low = min(ratios.values())
        for r in runs:
            ratio = ratios.get(id(r))
            if ratio is not None and ratio > low + LR_END_TOLERANCE:
                notes.append(
                    f"{r.label}: its learning rate ended at {ratio:.3g} of its starting rate, where its seed's other "
                    f"baselines' ended at {low:.3g}: its schedule did not decay over its own budget (sized for a "
                    "longer run?), so the frontier may flatter the arms"
                )
    return notes


def check_report_folder(out_dir: Path) -> None:
    """The checks :func:`write_report` makes of its ``out_dir`` before it reads the runs (:class:`~lightning_effi.
    report.hydra_callback.ReportCallback` makes them when the sweep starts).

    Raises:
        ReportError: naming ``out_dir``: a file or a link to nothing, or beneath one; a folder that cannot be
            written."""
    _check_out_dir(out_dir)
    _check_writable(out_dir, "out_dir")


def _check_out_dir(out_dir: Path) -> None:
    """Refuse an ``out_dir`` that is a file or a link to nothing, or lies beneath one, before the report is built (a
    bare ``[Errno 20] Not a directory`` came after the whole report, naming no argument: qa83-report 04).

    Raises:
        ReportError: naming ``out_dir`` and the file or link."""
    blocker = folder_blocker(out_dir)
    if blocker is None:
        return
    file, what = blocker
    where = f"is {what}" if file == out_dir else f"lies beneath {what.replace('a file', 'the file')} '{file}'"
    raise ReportError(f"out_dir: '{out_dir}' {where}; give a folder (created if missing) for the report")


#: the files every report writes (write_report; ``schedules.png`` besides when a run recorded a schedule)
REPORT_FILES = (
    "report.md",
    "report.csv",
    "report.json",
    "quality_vs_compute.png",
    "quality_vs_wall.png",
    "curves.png",
)


def _check_writable(folder: Path, name: str, files: Sequence[str] = REPORT_FILES) -> None:
    """Refuse a report folder that cannot be written, before the report is built: a probe file is made in it, or in
    its nearest existing parent when it does not exist yet (nothing is created), and removed at once; a folder where
    every one of ``files`` (the report's) exists and can be written passes where the probe cannot be made (a refresh
    in place). A pseudo file system (``/proc``), a read-only mount or a folder without write permission came after the
    whole report as ``[Errno 2] No such file or directory: '/proc/report.md'`` about a folder that exists
    (qa96-break 03).

    Raises:
        ReportError: naming ``name``, the folder and the system's reason."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        return  # _check_out_dir names a file in the way; mkdir names the rest
    problem = write_problem(existing, create=False)
    if problem is None:
        return
    if existing == folder and all((folder / f).is_file() and os.access(folder / f, os.W_OK) for f in files):
        # a report refreshed in place: every file it writes exists and can be written where no new one can
        # (qa97-regress 04); one missing (a first schedules.png) would leave new tables beside old figures
        return
    where = f"'{folder}'" if existing == folder else f"'{folder}' (its existing parent '{existing}')"
    raise ReportError(f"{name}: cannot write into {where} ({problem}); give a folder you can write to")


__all__ = ["COLUMNS", "Report", "SeedFrontier", "build_report", "write_report"]
