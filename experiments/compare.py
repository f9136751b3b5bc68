"""The main job: the plain GPT-2 and the best stack (curriculum + random-LTD + V-cycle) trained one after the other
on the embedded Python stdlib corpus, then a side-by-side comparison. Run from the repository root.

python experiments/compare.py                    # about 6 min on 2 idle CPU cores
python experiments/compare.py ref_steps=500      # both arms shorter
python experiments/compare.py seed=1             # another seed

A Hydra app over ``conf/compare.yaml`` (conf/train.yaml plus two arms of ``bench=gpt_stdlib_stack`` in MULTIRUN
mode): each run writes its folder (``result.json``, ``config.yaml``, ``csv/``, ``checkpoints/``) under
``logs/compare/multiruns/<date>_<time>_<us>/<job>/``; at the end the report callback
(``lightning_effi.report.hydra_callback.ReportCallback``) prints the comparison table and writes ``report.md``,
``report.csv``, ``report.json`` and the plots into that sweep folder; this script then prints where both runs and
the report are. The baseline frontier of the same setting (5 budgets x 2 seeds):
``python experiments/train.py bench=gpt_stdlib_stack``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lightning_effi.train import main as run_main

#: the output folder of each job of this process's sweep, in launch order
RUN_DIRS: list[Path] = []
#: the sweep folder (set by the first job)
SWEEP_DIR: list[Path] = []

REPORT_FILES = ("report.md", "report.csv", "report.json")


@hydra.main(version_base="1.3", config_path="../conf", config_name="compare")
def main(cfg: DictConfig) -> float:
    hydra_cfg = HydraConfig.get()
    RUN_DIRS.append(Path(hydra_cfg.runtime.output_dir))
    SWEEP_DIR[:] = [Path(hydra_cfg.sweep.dir)]
    return run_main(cfg)


def _shown(path: Path) -> str:
    """``path`` relative to the current folder when it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def summary_lines(run_dirs: list[Path], sweep_dir: Path) -> list[str]:
    """Where each run (with its arm label and final metric, from its ``result.json``) and the report are."""
    lines = [f"Runs and report in {_shown(sweep_dir)}/:"]
    for run_dir in run_dirs:
        record_path = run_dir / "result.json"
        if not record_path.is_file():
            lines.append(f"  {_shown(run_dir)}/  (no result.json: the run did not finish)")
            continue
        record = json.loads(record_path.read_text())
        metric = record.get("metric")
        shown = f"{record.get('optimized_metric')} {metric:.4f}" if isinstance(metric, (int, float)) else "no metric"
        lines.append(f"  {record.get('arm', '?'):<30s} {_shown(run_dir)}/  ({shown})")
    reports = [name for name in REPORT_FILES if (sweep_dir / name).is_file()]
    plots = sorted(p.name for p in sweep_dir.glob("*.png"))
    if reports:
        lines.append(f"  report: {', '.join(reports)}; plots: {', '.join(plots) or 'none'}")
    else:
        lines.append(
            f"  no report was written (see the warning above); write it with: "
            f"python -m lightning_effi.report {_shown(sweep_dir)}"
        )
    return lines


if __name__ == "__main__":
    main()
    if SWEEP_DIR and os.environ.get("LOCAL_RANK", "0") == "0":
        print("\n".join(summary_lines(RUN_DIRS, SWEEP_DIR[0])), flush=True)
