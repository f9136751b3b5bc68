"""End to end: a Hydra multirun of ``experiments/train.py`` (2 seeds x 2 budgets x baseline / random-LTD) with the
report callback, then the report read back and checked against the jobs' own result.json files."""

import json
from pathlib import Path

import pytest

import lightning_effi.train as train
from lightning_effi.utils import instantiate
from tests.helpers.hydra import run_train_script

EXPERIMENT = """# @package _global_
task_name: report_e2e
trainer:
  max_epochs: ${effi_scale:2,${budget}}
  max_steps: -1
  limit_train_batches: 2
  limit_val_batches: 1
  num_sanity_val_steps: 0
  enable_progress_bar: false
data:
  num_workers: 0
"""

pytestmark = pytest.mark.skipif(
    getattr(train, "RESULT_SCHEMA", None) != 2 or not hasattr(instantiate, "scale_length"),
    reason="lightning_effi.train does not write schema-2 result.json with budgets yet",
)


@pytest.mark.slow
def test_multirun_with_the_report_callback(tmp_path):
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "report_e2e.yaml").write_text(EXPERIMENT)  # budget scales the epochs: 0.5 -> 1, 1.0 -> 2
    proc = run_train_script(
        [
            "-m",
            f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
            "experiment=report_e2e",
            "seed=0,1",
            "budget=0.5,1.0",
            "callbacks=default,random_ltd",
            "+hydra.callbacks.report._target_=lightning_effi.report.hydra_callback.ReportCallback",
        ],
        tmp_path,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: lightning_effi.report" not in proc.stderr, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "logs" / "report_e2e" / "multiruns").iterdir()
    files = ["report.md", "report.csv", "report.json", "quality_vs_compute.png", "quality_vs_wall.png", "curves.png"]
    assert all((sweep / f).is_file() and (sweep / f).stat().st_size > 0 for f in [*files, "schedules.png"])
    assert "| random_ltd | 1 | 2 |" in proc.stdout and f"Sweep report: {sweep / 'report.md'}" in proc.stdout

    records = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/result.json"))]
    assert len(records) == 8
    report = json.loads((sweep / "report.json").read_text())
    rows = {(r["arm"], r["budget"]): r for r in report["rows"]}
    assert sorted(rows) == [("baseline", 0.5), ("baseline", 1.0), ("random_ltd", 0.5), ("random_ltd", 1.0)]
    assert all(r["n_seeds"] == 2 for r in rows.values())
    for seed in ("0", "1"):
        assert (
            report["frontiers"][seed]["flops"]["budgets"] == [0.5, 1.0]
            and report["frontiers"][seed]["flops"]["why"] == ""
        )

    def record(arm: str, budget: float, seed: int) -> dict:
        (rec,) = [r for r in records if (r["arm"], r["budget"], r["seed"]) == (arm, budget, seed)]
        return rec

    # the same-length saving, read independently from the jobs' records
    savings = [
        1 - record("random_ltd", 1.0, s)["efficiency"]["flops"] / record("baseline", 1.0, s)["efficiency"]["flops"]
        for s in (0, 1)
    ]
    assert rows[("random_ltd", 1.0)]["same_length_saving_mean"] == pytest.approx(sum(savings) / 2)
    assert all(s > 0 for s in savings)  # random-LTD skips tokens in the middle layers
    quality = [record("random_ltd", 1.0, s)["metric"] for s in (0, 1)]
    assert rows[("random_ltd", 1.0)]["quality_mean"] == pytest.approx(sum(quality) / 2)
    for seed in (0, 1):  # each technique run has a frontier reading with a flag
        (reading,) = [r for r in report["readings"] if (r["arm"], r["budget"], r["seed"]) == ("random_ltd", 1.0, seed)]
        assert reading["frontier_flag"] in ("inside", "beyond", "below") and reading["frontier_compute"] > 0
        assert not Path(reading["path"]).is_absolute()  # relative to the job's directory (the repository root)
        assert (tmp_path / reading["path"]).parent == sweep
