"""``experiments/bench/vcycle.py --reanalyse --merge``: runs of several benchmark JSONs as one report."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "experiments" / "bench" / "vcycle.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vcycle_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, config: dict, runs: list[tuple[str, int, float]]) -> Path:
    base = {
        "tasks": ["vit"],
        "vit_steps": 1200,
        "vit_layers": 6,
        "vit_subset": 20000,
        "eval_every": 40,
        "eval_batches": 10,
        "vit_lr_mult": 2.0,
    }
    path.write_text(
        json.dumps(
            {
                "config": {**base, **config},
                "runs": [{"task": "vit", "arm": a, "seed": s, "metric_value": m} for a, s, m in runs],
            }
        )
    )
    return path


def test_later_file_replaces_same_task_arm_seed(bench, tmp_path):
    committed = _write(
        tmp_path / "a.json",
        {},
        [("baseline", 0, 0.56), ("vcycle", 0, 0.54), ("baseline", 1, 0.55), ("vcycle", 1, 0.53)],
    )
    tuning = _write(tmp_path / "b.json", {"vit_lr_mult": 4.0, "arms": ["vcycle"]}, [("vcycle", 0, 0.57)])
    config, runs = bench.merge_reports([committed, tuning], seeds=[0])
    assert sorted((r["arm"], r["seed"], r["metric_value"]) for r in runs) == [
        ("baseline", 0, 0.56),
        ("vcycle", 0, 0.57),
    ]
    assert config["vit_lr_mult"] == 4.0  # the last file's config describes the merged V-cycle arm
    assert config["seeds"] == [0] and config["arms"] == ["baseline", "vcycle"] and config["tasks"] == ["vit"]
    assert config["merged_from"] == [str(committed), str(tuning)]
    _, all_seeds = bench.merge_reports([committed, tuning], seeds=None)
    assert sorted((r["arm"], r["seed"], r["metric_value"]) for r in all_seeds) == [
        ("baseline", 0, 0.56),
        ("baseline", 1, 0.55),
        ("vcycle", 0, 0.57),
        ("vcycle", 1, 0.53),
    ]


def test_files_with_different_baselines_are_refused(bench, tmp_path):
    a = _write(tmp_path / "a.json", {}, [("baseline", 0, 0.56)])
    b = _write(tmp_path / "b.json", {"vit_steps": 600}, [("vcycle", 0, 0.5)])
    with pytest.raises(SystemExit, match="vit_steps"):
        bench.merge_reports([a, b], seeds=None)
    c = _write(tmp_path / "c.json", {"eval_every": 20}, [("vcycle", 0, 0.5)])  # curve resolution only: allowed
    assert len(bench.merge_reports([a, c], seeds=None)[1]) == 2
    with pytest.raises(SystemExit, match="no runs"):
        bench.merge_reports([a, c], seeds=[7])
    with pytest.raises(SystemExit, match="missing.json is not a file"):
        bench.merge_reports([a, tmp_path / "missing.json"], seeds=None)
    (tmp_path / "other.json").write_text(json.dumps({"summary": {}}))
    with pytest.raises(SystemExit, match="not a vcycle benchmark JSON"):
        bench.merge_reports([a, tmp_path / "other.json"], seeds=None)
