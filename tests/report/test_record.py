"""``lightning_effi.report.write_result``: a run record from the user's own Trainer (no Hydra app) that the report
reads, with the same fields as the Hydra app's ``result.json``."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_effi import EfficiencyMonitor, RandomLTDCallback
from lightning_effi.report import build_report, load_runs, write_result
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import tiny_gpt2, tiny_lm_data

#: a committed record written by experiments/train.py (the Hydra app): write_result writes the same fields
APP_RECORD = Path(__file__).parents[2] / "experiments/bench/results/vit_stack_vc_ltd/runs_seed0/vcycle+random_ltd_1.6"


def fit(root: Path, steps: int, ltd: bool) -> pl.Trainer:
    pl.seed_everything(0)
    callbacks: list[pl.Callback] = [EfficiencyMonitor(print_summary=False)]
    if ltd:
        callbacks.append(RandomLTDCallback(min_value=4, max_value=16, seq_per_step=4, seed=0))
    trainer = make_trainer(
        root, callbacks, max_steps=steps, limit_val_batches=2, val_check_interval=2, check_val_every_n_epoch=None
    )
    trainer.fit(tiny_gpt2(n_layer=4), datamodule=tiny_lm_data())
    return trainer


def test_runs_of_a_users_trainer_make_a_frontier_report(tmp_path):
    for budget, steps in ((0.5, 4), (1.0, 8)):
        trainer = fit(tmp_path / f"fit_b{budget}", steps, ltd=False)
        write_result(trainer, tmp_path / "runs" / f"baseline_{budget}", metric="val/loss", budget=budget, task_name="t")
    trainer = fit(tmp_path / "fit_ltd", 8, ltd=True)
    file = write_result(trainer, tmp_path / "runs" / "ltd", metric="val/loss", task_name="t")
    record = json.loads(file.read_text())
    assert record["arm"] == "random_ltd" and record["seed"] == 0  # the seed pl.seed_everything set
    assert record["techniques"]["random_ltd"]["min_value"] == 4 and record["length"]["optimizer_steps"] == 8
    assert len(record["curve"]) == 4 and record["curve"][-1]["step"] == 8
    assert set(record) == set(json.loads((APP_RECORD / "result.json").read_text()))
    report = build_report(load_runs([tmp_path / "runs"]))
    row = next(r for r in report.rows if r["arm"] == "random_ltd")
    baseline = next(r for r in report.rows if r["arm"] == "baseline" and r["budget"] == 1.0)
    assert row["same_length_saving_mean"] == pytest.approx(1 - row["flops_mean"] / baseline["flops_mean"])
    assert row["same_length_saving_mean"] > 0 and row["frontier_n"] == 1


def test_what_cannot_make_a_record_is_refused_naming_it(tmp_path):
    trainer = fit(tmp_path / "fit", 2, ltd=False)
    with pytest.raises(ValueError, match=r"metric 'val/acc' was not logged; the run's final metrics: \[.*'val/loss'"):
        write_result(trainer, tmp_path / "r", metric="val/acc")
    with pytest.raises(ValueError, match="mode"):
        write_result(trainer, tmp_path / "r", metric="val/loss", mode="lower")
    with pytest.raises(ValueError, match="budget must be a number > 0"):
        write_result(trainer, tmp_path / "r", metric="val/loss", budget=0)
    plain = make_trainer(tmp_path / "plain", max_steps=1)
    plain.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    with pytest.raises(ValueError, match="no EfficiencyMonitor"):
        write_result(plain, tmp_path / "r", metric="val/loss")
    assert not (tmp_path / "r").exists()
