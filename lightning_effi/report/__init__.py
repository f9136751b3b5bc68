"""Sweep reports: compare the runs of a Hydra multirun against the same-length baseline and the baseline frontier.

``python -m lightning_effi.report <run or sweep folders...> [--out DIR] [--metric NAME] [--compute flops|tokens|
samples|layer_tokens]`` reads every ``result.json`` (schema 2, written by ``experiments/train.py``) below the
folders and writes ``report.md``, ``report.csv``, ``report.json`` and figures. From Python::

    from lightning_effi.report import write_report
    report = write_report(["logs/gpt_stack/multiruns/2026-12-01_22-00-00_123456"])
    print(report.to_markdown())

From your own ``Trainer`` (no Hydra app), write each run's record with :func:`write_result` after its fit
(``write_result(trainer, "runs/baseline_0.5_seed0", metric="val/loss", seed=0, budget=0.5)``), then report the
folder.

Or after every multirun, with the Hydra callback: ``hydra.callbacks.report._target_:
lightning_effi.report.hydra_callback.ReportCallback``.

Protocol: Kaddour et al. 2023, "No Train No Gain: Revisiting Efficient Training Algorithms For Transformer-based
Language Models", NeurIPS, Sec. 3: an efficient-training method's saving is read against baselines trained at
several budgets, each with its learning-rate schedule fully decayed (the frontier), next to the saving against the
baseline of the same length. Units: FLOPs are forward + backward training FLOPs as the ``EfficiencyMonitor`` counts
them; times are seconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_effi.report.frontier import Reach, Saving, compute_to_reach, pareto_front, saving
from lightning_effi.report.load import ReportError, Run, load_runs
from lightning_effi.report.table import COLUMNS, Report, build_report, write_report

if TYPE_CHECKING:
    from lightning_effi.report.record import ResultWriter, write_result

#: names imported on first use: they need Lightning (and so torch), which the report itself starts without
_LAZY = ("ResultWriter", "write_result")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from lightning_effi.report import record

        return getattr(record, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "COLUMNS",
    "Reach",
    "Report",
    "ResultWriter",
    "ReportError",
    "Run",
    "Saving",
    "build_report",
    "compute_to_reach",
    "load_runs",
    "pareto_front",
    "saving",
    "write_report",
    "write_result",
]
