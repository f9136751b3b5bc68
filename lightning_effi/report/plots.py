"""The sweep report's figures (matplotlib, drawn on the Agg canvas: no display and no pyplot state is touched).

- ``quality_vs_compute.png``: every run's final (compute, quality) point, each arm's mean (error bars: sample std
  over seeds), each seed's baseline frontier (its Pareto points ringed and joined); log x.
- ``quality_vs_wall.png``: the same against training wall time (seconds of train + data time).
- ``curves.png``: each run's validation curve against cumulative compute (the record's ``curve``); log x.
- ``schedules.png``: each technique's schedule keys (``infobatch/kept_fraction``, ``random_ltd/reserved_length``,
  ...) against training progress (step / the run's optimizer steps), one panel per key; written only when a run
  recorded a schedule.

Colours: one per arm; an arm's budgets (the baseline's, which make the frontier) are shades of its colour, light for
the smallest budget and full for the largest (:func:`budget_colors`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

if TYPE_CHECKING:
    from lightning_effi.report.load import Run
    from lightning_effi.report.table import Report

#: schedule keys that are not a technique's state (the point's position)
POSITION_KEYS = frozenset({"step", "epoch", "flops", "samples", "tokens", "layer_tokens", "train_wall_s"})
_AXIS_LABEL = {
    "flops": "training FLOPs (forward + backward)",
    "tokens": "tokens trained",
    "samples": "samples trained",
    "layer_tokens": "layer-tokens trained",
    "train_wall_s": "training wall time (s, train + data)",
}


def _colors(report: Report) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    arms = list(dict.fromkeys(str(row["arm"]) for row in report.rows))
    return {arm: cmap(i % 10) for i, arm in enumerate(arms)}


def budget_colors(report: Report) -> dict[tuple[str, float], tuple[float, float, float, float]]:
    """One RGBA colour per ``(arm, budget)`` row: each arm its ``tab10`` colour; the baseline's budgets shades of
    the baseline's colour, from light (the smallest budget) to full (the largest), so that the frontier's budgets
    are told apart in the figures (and a technique arm at several budgets likewise)."""
    from matplotlib.colors import to_rgba

    base = _colors(report)
    budgets: dict[str, list[float]] = {}
    for row in report.rows:
        budgets.setdefault(str(row["arm"]), []).append(float(row["budget"]))
    out: dict[tuple[str, float], tuple[float, float, float, float]] = {}
    for arm, values in budgets.items():
        ordered = sorted(set(values))
        r, g, b, _ = to_rgba(base[arm])
        for i, budget in enumerate(ordered):
            light = 0.0 if len(ordered) == 1 else 0.6 * (1 - i / (len(ordered) - 1))  # 0.6: the smallest budget
            out[(arm, budget)] = (r + (1 - r) * light, g + (1 - g) * light, b + (1 - b) * light, 1.0)
    return out


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def _positive_log(ax: Any, values: Sequence[float]) -> None:
    if values and all(v > 0 for v in values):
        ax.set_xscale("log")


def quality_figure(report: Report, axis: str) -> Figure:
    """Final quality against ``axis`` (the report's compute quantity or ``"train_wall_s"``), see the module
    docstring."""
    fig = Figure(figsize=(7.5, 5.0), layout="constrained")
    ax = fig.add_subplot()
    colors = _colors(report)
    shades = budget_colors(report)
    xs: list[float] = []
    for reading in report.readings:
        x, y = reading["train_wall_s" if axis == "train_wall_s" else "compute"], reading["quality"]
        if math.isfinite(y) and x > 0:
            color = shades.get((str(reading["arm"]), float(reading["budget"])), colors[reading["arm"]])
            ax.scatter([x], [y], s=18, color=color, alpha=0.55, linewidths=0)
            xs.append(x)
    xkey = f"{axis}_mean"  # train_wall_s_mean, flops_mean, tokens_mean, ...
    xstd = f"{axis}_std" if axis in ("train_wall_s", "flops") else None  # the spreads the rows carry
    for row in report.rows:
        x, y = row[xkey], row["quality_mean"]
        if not (math.isfinite(x) and math.isfinite(y)) or x <= 0:
            continue
        xerr = row[xstd] if xstd and math.isfinite(row[xstd]) else None
        yerr = row["quality_std"] if math.isfinite(row["quality_std"]) else None
        ax.errorbar(
            [x],
            [y],
            xerr=None if xerr is None else [xerr],
            yerr=None if yerr is None else [yerr],
            marker="s" if row["baseline"] else "D",
            markersize=7,
            color=shades[(str(row["arm"]), float(row["budget"]))],
            capsize=3,
            label=f"{row['arm']}@{row['budget']:g} (mean, n={row['n_seeds']})",
        )
    first = True
    for _, by_axis in sorted(report.frontiers.items()):
        front = by_axis.get(axis)
        if front is None or not front.front:
            continue
        fx, fy = [p[0] for p in front.front], [p[1] for p in front.front]
        ax.plot(
            fx,
            fy,
            linestyle="--",
            color="black",
            linewidth=1.0,
            marker="o",
            markersize=10,
            markerfacecolor="none",
            label="baseline frontier (Pareto points, per seed)" if first else None,
        )
        first = False
    _positive_log(ax, xs)
    ax.set_xlabel(_AXIS_LABEL.get(axis, axis))
    ax.set_ylabel(f"{report.metric} ({'lower' if report.mode == 'min' else 'higher'} is better)")
    ax.set_title(f"final {report.metric} vs {_AXIS_LABEL.get(axis, axis)}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return fig


def curves_figure(report: Report) -> Figure:
    """Each run's validation curve of the report's metric against the report's compute quantity."""
    fig = Figure(figsize=(7.5, 5.0), layout="constrained")
    ax = fig.add_subplot()
    shades = budget_colors(report)
    xs: list[float] = []
    labelled: set[str] = set()
    for run in report.runs:
        points = [
            (float(p[report.compute]), float(p["metrics"][report.metric]))
            for p in run.curve
            if isinstance(p.get("metrics"), dict)
            and isinstance(p["metrics"].get(report.metric), (int, float))
            and isinstance(p.get(report.compute), (int, float))
        ]
        if not points:
            continue
        xs += [x for x, _ in points]
        label = f"{run.arm}@{run.budget:g}"
        ax.plot(
            [x for x, _ in points],
            [y for _, y in points],
            color=shades.get((run.arm, float(run.budget)), "grey"),
            alpha=0.8,
            linestyle="-" if run.is_baseline else "-.",
            marker=".",
            label=None if label in labelled else label,
        )
        labelled.add(label)
    _positive_log(ax, xs)
    ax.set_xlabel(_AXIS_LABEL.get(report.compute, report.compute))
    ax.set_ylabel(report.metric)
    ax.set_title(f"validation {report.metric} during training (one line per run)")
    ax.grid(True, which="both", alpha=0.3)
    if labelled:
        ax.legend(fontsize=7, loc="best")
    return fig


def schedule_keys(runs: Sequence[Run]) -> list[str]:
    """The technique keys (``<technique>/<name>``) with a number in some run's schedule, sorted."""
    keys = {
        k
        for run in runs
        for p in run.schedule
        for k, v in p.items()
        if k not in POSITION_KEYS and "/" in k and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return sorted(keys)


def _total_steps(run: Run) -> float:
    for value in (run.length.get("optimizer_steps"), run.efficiency.get("optimizer_steps")):
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    steps = [float(p["step"]) for p in run.schedule if isinstance(p.get("step"), (int, float))]
    return max(steps) if steps and max(steps) > 0 else 1.0


def schedules_figure(report: Report) -> Figure | None:
    """One panel per schedule key: each run's value against training progress (``step`` / its optimizer steps);
    ``None`` when no run recorded a schedule."""
    keys = schedule_keys(report.runs)
    if not keys:
        return None
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), layout="constrained")
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    scheduled = [run for run in report.runs if run.schedule]
    colors = {id(run): cmap(j % 10) for j, run in enumerate(scheduled)}  # one color per run
    for i, key in enumerate(keys):
        ax = fig.add_subplot(rows, cols, i + 1)
        for run in scheduled:
            total = _total_steps(run)
            points = [
                (float(p["step"]) / total, float(p[key]))
                for p in run.schedule
                if isinstance(p.get("step"), (int, float)) and isinstance(p.get(key), (int, float))
            ]
            if points:
                ax.plot(
                    [x for x, _ in points],
                    [y for _, y in points],
                    color=colors[id(run)],
                    alpha=0.8,
                    marker=".",
                    label=f"{run.arm}@{run.budget:g} seed {run.seed}",
                )
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("training progress (step / optimizer steps)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="best")
    return fig


def write_plots(report: Report, out_dir: Path) -> dict[str, Path]:
    """Write the figures into ``out_dir``; returns file name -> path of those written."""
    out = {
        "quality_vs_compute.png": _save(quality_figure(report, report.compute), out_dir / "quality_vs_compute.png"),
        "quality_vs_wall.png": _save(quality_figure(report, "train_wall_s"), out_dir / "quality_vs_wall.png"),
        "curves.png": _save(curves_figure(report), out_dir / "curves.png"),
    }
    schedules = schedules_figure(report)
    if schedules is not None:
        out["schedules.png"] = _save(schedules, out_dir / "schedules.png")
    return out


__all__ = ["curves_figure", "quality_figure", "schedule_keys", "schedules_figure", "write_plots"]
