"""The main job, ``experiments/compare.py``: the baseline and the stack on the stdlib corpus, one after the other,
then the report; here in tiny form (4 steps each)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

import lightning_effi.utils.instantiate  # noqa: F401  (registers the config resolvers: effi_scale, effi_bench)
from tests.helpers.hydra import DATA_DIR, ROOT, compose_train

COMPARE = ROOT / "experiments" / "compare.py"
STACK = "curriculum+random_ltd+vcycle"


def test_compare_config_is_two_arms_of_the_stdlib_stack_at_the_same_length(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="compare", return_hydra_config=True)
        technique = compose(config_name="compare", overrides=["arm=technique"])
    assert cfg.hydra.mode.name == "MULTIRUN" and cfg.task_name == "compare"
    assert cfg.hydra.runtime.choices.bench == "gpt_stdlib_stack" and cfg.data.corpus == "stdlib"
    assert str(cfg.hydra.sweeper.params.arm) == "baseline_100,technique" and str(cfg.hydra.sweeper.params.seed) == "0"
    assert cfg.trainer.max_steps == technique.trainer.max_steps == cfg.ref_steps
    assert set(technique.callbacks) - set(cfg.callbacks) == {"curriculum", "random_ltd", "vcycle"}
    # the same model and data as the main job of train.py
    main = compose_train([], tmp_path, fast=False)
    assert cfg.model == main.model and {k: v for k, v in cfg.data.items() if k != "num_workers"} == {
        k: v for k, v in main.data.items() if k != "num_workers"
    }


@pytest.mark.slow
def test_compare_runs_both_arms_and_reports(tmp_path):
    tiny = ["ref_steps=4", "data.train_subset=64", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"]
    has_report = importlib.util.find_spec("lightning_effi.report") is not None
    if not has_report:
        tiny.append("~hydra.callbacks.report")
    cmd = [sys.executable, str(COMPARE), f"paths.data_dir={DATA_DIR}", *tiny]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweeps = list(tmp_path.glob("logs/compare/multiruns/*"))
    assert len(sweeps) == 1
    sweep = sweeps[0]
    records = [json.loads((sweep / job / "result.json").read_text()) for job in ("0", "1")]
    assert [r["efficiency"]["optimizer_steps"] for r in records] == [4, 4]
    assert records[0]["efficiency"]["flops"] > records[1]["efficiency"]["flops"] > 0  # the stack's cheaper steps
    rel = sweep.relative_to(tmp_path)
    assert f"Runs and report in {rel}/:" in proc.stdout
    if "arm" not in records[0]:
        pytest.skip("result.json has no arm yet (lightning_effi/train.py's schema 2 is not in)")
    assert [r["arm"] for r in records] == ["baseline", STACK]
    lines = proc.stdout.splitlines()
    assert any(line.split()[:2] == ["baseline", f"{rel}/0/"] for line in lines), proc.stdout[-2000:]
    assert any(line.split()[:2] == [STACK, f"{rel}/1/"] for line in lines), proc.stdout[-2000:]
    if not has_report:
        pytest.skip("lightning_effi.report is not in yet: no report to check")
    assert (sweep / "report.md").is_file() and (sweep / "curves.png").stat().st_size > 0
    table = [line for line in lines if line.startswith("| ")]
    assert any(line.startswith("| baseline |") for line in table) and any(f"| {STACK} |" in line for line in table)
    assert "  report: report.md, report.csv, report.json; plots: " in proc.stdout
