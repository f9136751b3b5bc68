"""``lightning_effi.report.write_result``: a run record from the user's own Trainer (no Hydra app) that the report
reads, with the same fields as the Hydra app's ``result.json``."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_effi import EfficiencyMonitor, RandomLTDCallback
from lightning_effi.report import build_report, load_runs, write_result
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import seqlen_truncate, tiny_gpt2, tiny_lm_data

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
    with pytest.raises(ValueError, match=r"^write_result: mode: expected 'min' \(lower is better\) or 'max'"):
        write_result(trainer, tmp_path / "r", metric="val/loss", mode="lower")
    with pytest.raises(
        ValueError,
        match=r"^write_result: mode: the metric name 'val/foo' does not say whether lower "
        r"or higher is better; pass mode='min'",
    ):
        write_result(trainer, tmp_path / "r", metric="val/foo", metrics={"val/foo": 1.0})


class _StopAt(pl.Callback):
    """Raises in the training step's end at ``step`` (an error in the user's code, or Ctrl+C in a notebook)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("stopped by the test")


def test_a_further_fit_that_did_not_end_is_not_recorded_with_the_fit_before(tmp_path):
    """A second fit of the Trainer (max_epochs raised: "continue training" in a notebook) stopped by an error left the
    monitor's summary of the first fit, which write_result recorded with the second fit's length (16 steps' FLOPs
    for 20 steps, not stopped early; qa110-notebook 01). The summary is of a fit that ended: refused, as after a
    first fit that did not end."""
    trainer = fit(tmp_path / "fit", 2, ltd=False)
    monitor = next(c for c in trainer.callbacks if isinstance(c, EfficiencyMonitor))
    assert monitor.summary["optimizer_steps"] == 2
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.callbacks.append(_StopAt(4))
    with pytest.raises(RuntimeError, match="stopped by the test"):
        trainer.fit(trainer.lightning_module, datamodule=tiny_lm_data())
    assert trainer.global_step == 4 and monitor.summary == {} and monitor.totals["batches"] == 4
    with pytest.raises(
        ValueError,
        match=r"^write_result: the Trainer's last fit did not end \(stopped by an error or an interrupt at step 4\)",
    ):
        write_result(trainer, tmp_path / "r", metric="val/loss")
    # also after a validation of the weights, which ends with its own status (qa112-regress 02)
    trainer.validate(trainer.lightning_module, datamodule=tiny_lm_data(), verbose=False)
    with pytest.raises(ValueError, match=r"^write_result: the Trainer's last fit did not end"):
        write_result(trainer, tmp_path / "r", metric="val/loss")
    assert not (tmp_path / "r").exists()


def test_the_mode_is_read_from_the_metric_name_when_not_given(tmp_path, monkeypatch):
    """A user's ``write_result(metric="val/acc")`` recorded mode "min" (the old default): the report then read a
    better accuracy as worse than every baseline. None now reads the name: max for accuracy-like names, min for
    losses; an explicit mode stays as given, unless the name says the opposite."""
    from lightning_effi.report.frontier import infer_mode

    assert [infer_mode(m) for m in ("val/loss", "val_ppl", "val/error", "val/acc", "test/acc_top5", "val/f1")] == [
        "min",
        "min",
        "min",
        "max",
        "max",
        "max",
    ]
    assert infer_mode("val/foo") is None and infer_mode("val/loss_acc") is None  # neither, or both: ask
    # a spread, a regret, a time or a degradation of an accuracy is lower-is-better: read as "acc" (max), a correct
    # mode="min" was refused as against the name (qa84-break 03); the name says nothing sure
    for measured in ("val/acc_degradation", "val/time_to_acc", "val/acc_regret", "val/acc_spread", "val/acc_variance"):
        assert infer_mode(measured) is None, measured
    assert infer_mode("train/loss_step") == "min" and infer_mode("val/acc_epoch") == "max"  # Lightning's suffixes
    # ... but a namespace before the metric's own segment modifies nothing (qa85-break 04)
    assert [infer_mode(m) for m in ("time_series/val_mae", "cost_sensitive/val_acc", "val/accuracy/variance")] == [
        "min",
        "max",
        None,
    ]
    assert infer_mode("val/r2") == "max"  # digits are part of some names
    # a cut-off after the name (recommenders, retrieval, top-k accuracy) was read as "1-acc" (qa43-user 02)
    for ranked in ("val/recall@20", "val/ndcg@10", "val/hr@10", "val/mrr", "val/map_at_5", "val/acc@1", "top_5_acc"):
        assert infer_mode(ranked) == "max", ranked
    # ... also followed by more name (qa44-break 04), and torchmetrics' / COCO's names (qa44-user 06)
    for ranked in ("val/ndcg@10/dataloader_idx_0", "train/acc@1_epoch", "val/map@0.5", "val/task_2_acc"):
        assert infer_mode(ranked) == "max", ranked
    for dense in ("val/MulticlassJaccardIndex", "val/MulticlassAccuracy", "bbox/AP50", "val/mAP@0.5", "val/pq"):
        assert infer_mode(dense) == "max", dense
    # plurals: TRL's DPO / reward-model keys (qa46-user 04)
    assert [infer_mode(m) for m in ("val/rewards/accuracies", "eval_rewards/accuracies", "val/losses")] == [
        "max",
        "max",
        "min",
    ]
    # COCO caption metrics beside Bleu_4 / ROUGE_L, and exact match (qa47-user 04)
    for caption in ("val/CIDEr", "val/METEOR", "val/SPICE", "val/cider", "val/exact_match"):
        assert infer_mode(caption) == "max", caption
    # hr is a hit rate with a cut-off only: hours were read as higher-is-better (qa44-break 11)
    assert infer_mode("val/gpu_hr") is None and infer_mode("val/time_to_target_hr") is None
    assert infer_mode("val/1-recall@10") is None and infer_mode("val/err@5") == "min"
    # "score" and "distance" name a direction only on their own: torchmetrics' CRPS is lower-is-better, DIoU
    # higher-is-better (a correct mode was refused, qa86-break 02)
    for compound in (
        "val/ContinuousRankedProbabilityScore", "val/DistanceIntersectionOverUnion", "val/davies_bouldin_score",
        "val/silhouette_score",
    ):  # fmt: skip
        assert infer_mode(compound) is None, compound
    assert [infer_mode(n) for n in ("val/score", "val_mean_distance", "val/f1_score", "val/MulticlassF1Score")] == [
        "max", "min", "max", "max"
    ]  # fmt: skip
    # ... and a name ending in "distance" is a distance: lower is better (qa87-regress 02)
    for distance in ("val/edit_distance", "val/EditDistance", "val/hamming_distance", "val/cosine_distance"):
        assert infer_mode(distance) == "min", distance
    for turned in ("val/neg_mse", "val/1-acc", "val/accuracy_drop", "train/loss_scale", "val/loss_improvement"):
        assert infer_mode(turned) is None, turned  # scikit-learn's neg_*, differences, scales: ask
    trainer = fit(tmp_path / "fit", 2, ltd=False)
    read = lambda p: json.loads(p.read_text())["optimized_mode"]  # noqa: E731
    assert read(write_result(trainer, tmp_path / "a", metric="val/acc", metrics={"val/acc": 0.5})) == "max"
    assert read(write_result(trainer, tmp_path / "l", metric="val/loss")) == "min"
    assert read(write_result(trainer, tmp_path / "m", metric="val/foo", mode="min", metrics={"val/foo": 0.5})) == "min"
    # a mode against the name was recorded as given: the report then ranked the sweep backwards (the QA helper's
    # bench records read +20.4% saving with min, <= -208% with max), as the app refuses it
    with pytest.raises(ValueError, match=r"write_result: mode='min' contradicts metric 'val/acc', whose name says "):
        write_result(trainer, tmp_path / "c", metric="val/acc", mode="min", metrics={"val/acc": 0.5})
    with pytest.raises(ValueError, match=r"mode='max' contradicts metric 'val/loss'.*pass mode='min'"):
        write_result(trainer, tmp_path / "c", metric="val/loss", mode="max")
    with pytest.raises(ValueError, match="budget must be a number > 0"):
        write_result(trainer, tmp_path / "r", metric="val/loss", budget=0)
    (tmp_path / "file").write_text("mine")
    os.mkfifo(tmp_path / "fifo")
    bad = [
        (
            dict(out_dir=tmp_path / "file"),
            r"out_dir must be a folder \(the run's; created if missing\), got .*, a file$",
        ),
        # a folder beneath a FIFO or a device: a bare "[Errno 20] Not a directory" after the fit (qa86-break 03)
        (dict(out_dir=tmp_path / "fifo" / "run"), r"out_dir must be a folder .*, beneath a special file: .*fifo$"),
        (dict(out_dir="/dev/null/run"), r"out_dir must be a folder .*, beneath a special file: /dev/null$"),
        (
            dict(arm="my\nstack"),
            r"arm must be None \(named after the techniques\) or a one-line label, got 'my\\nstack'",
        ),
        (dict(arm=" "), r"arm must be None .* one-line label, got ' '"),
        (dict(task_name=3), r"task_name must be a string \(runs of one comparison share it\), got 3"),
        (
            dict(metrics=[1.0]),
            r"metrics must be a mapping name -> value \(e\.g\. trainer\.test\(\.\.\.\)\[0\]\) or None",
        ),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match="^write_result: " + match):
            write_result(trainer, **{"out_dir": tmp_path / "r", "metric": "val/loss", **kwargs})
    assert (tmp_path / "file").read_text() == "mine"
    # '~/runs' is the home folder's, as ResultWriter reads it (a folder named '~' in the working directory,
    # qa86-break 08)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    home = write_result(trainer, "~/runs/a", metric="val/loss")
    assert home == tmp_path / "home" / "runs" / "a" / "result.json" and home.exists() and not (tmp_path / "~").exists()
    plain = make_trainer(tmp_path / "plain", max_steps=1)
    plain.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    with pytest.raises(ValueError, match="no EfficiencyMonitor"):
        write_result(plain, tmp_path / "r", metric="val/loss")
    assert not (tmp_path / "r").exists()


def test_one_stack_one_label_and_one_budget_however_they_were_computed(tmp_path):
    """The default arm label sorts the techniques (callbacks listed in another order gave another arm, so one stack
    split into two 1-seed rows); a numpy budget is a budget; budgets reached by two float computations (``0.1 * 3``
    and ``3 / 10``) are one, so the arm finds its same-length baseline; ``arm='baseline'`` on a run with a technique
    is refused when written (the report would refuse the record later); a label with a line break read from a record
    is escaped in the Markdown table (it split the row)."""
    import numpy as np

    from lightning_effi.report.record import make_record

    base = fit(tmp_path / "fit_b", 4, ltd=False)
    write_result(base, tmp_path / "runs" / "b", metric="val/loss", budget=0.1 * 3)
    ltd = fit(tmp_path / "fit_l", 4, ltd=True)
    record = json.loads(
        write_result(ltd, tmp_path / "runs" / "l", metric="val/loss", budget=np.float64(3 / 10)).read_text()
    )
    assert record["budget"] == 0.3 and json.loads((tmp_path / "runs/b/result.json").read_text())["budget"] == 0.3
    for budget in (np.float32(0.5), np.int64(1)):  # numpy scalars were refused as "not a number > 0"
        assert json.loads(write_result(base, tmp_path / "np", metric="val/loss", budget=budget).read_text())[
            "budget"
        ] == float(budget)
    row = next(r for r in build_report(load_runs([tmp_path / "runs"])).rows if r["arm"] == "random_ltd")
    assert row["budget"] == 0.3 and row["same_length_n"] == 1 and row["same_length_saving_mean"] > 0
    kwargs = dict(run_dir=tmp_path, output_dir=".", task_name="", seed=0, arm=None, budget=1.0, metric=None)
    for order in (["vcycle", "random_ltd"], ["random_ltd", "vcycle"]):
        techniques = {name: {} for name in order}
        assert make_record(ltd, techniques=techniques, mode="min", metrics={}, **kwargs)["arm"] == "random_ltd+vcycle"
    with pytest.raises(ValueError, match=r"^write_result: arm='baseline', but the run has techniques \['random_ltd'\]"):
        write_result(ltd, tmp_path / "bad", metric="val/loss", arm="baseline")
    assert not (tmp_path / "bad").exists()
    file = tmp_path / "runs" / "l" / "result.json"
    file.write_text(file.read_text().replace('"arm": "random_ltd"', '"arm": "my\\nstack|x"'))
    table = build_report(load_runs([tmp_path / "runs"])).to_markdown()
    assert "\n| my\\nstack\\|x | 0.3 | 1 | " in table


def test_seed_is_checked_and_the_fits_validation_metric_survives_a_later_test(tmp_path):
    """``trainer.test`` after the fit replaces the Trainer's metrics with the test ones: the record still reads
    ``val/loss`` from the fit's last validation (the monitor's curve), next to ``test/loss``. A seed that is not an int
    in [0, 2**32) is refused, naming it (1.7 and True were recorded as 1, '5' as 5)."""
    trainer = fit(tmp_path / "fit", 4, ltd=False)
    val_loss = float(trainer.callback_metrics["val/loss"])
    data = tiny_lm_data()
    data.test_dataloader = data.val_dataloader  # type: ignore[method-assign]
    trainer.test(trainer.lightning_module, datamodule=data, verbose=False)
    assert "val/loss" not in trainer.callback_metrics
    record = json.loads(write_result(trainer, tmp_path / "r", metric="val/loss").read_text())
    assert record["metric"] == pytest.approx(val_loss) and "test/loss" in record["metrics"]
    for seed in (1.7, True, "5", -1, 2**32):
        with pytest.raises(ValueError, match=r"write_result: seed must be an int in \[0, 2\*\*32\), got "):
            write_result(trainer, tmp_path / "bad", metric="val/loss", seed=seed)
    assert not (tmp_path / "bad").exists()


def test_a_test_of_the_best_checkpoint_leaves_the_fits_record_whole(tmp_path):
    """``trainer.test(ckpt_path="best")`` after the fit (Lightning's default with a monitoring ``ModelCheckpoint``)
    restored the monitor's state from the best checkpoint: its curve rolled back to that step, and ``write_result``
    recorded that step's val/loss as the fit's final one beside the whole fit's FLOPs (qa83-report 01). Outside
    ``fit`` the monitor keeps its own state."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    monitor = EfficiencyMonitor(print_summary=False)
    best = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="val/loss", mode="max")  # the worst: the first validation
    trainer = make_trainer(
        tmp_path / "fit",
        [monitor, best],
        max_steps=8,
        limit_val_batches=2,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        enable_checkpointing=True,
    )
    data = tiny_lm_data()
    trainer.fit(tiny_gpt2(n_layer=4), datamodule=data)
    final = float(trainer.callback_metrics["val/loss"])
    curve, totals, summary = [dict(p) for p in monitor.curve], dict(monitor.totals), dict(monitor.summary)
    assert [p["step"] for p in curve] == [2, 4, 6, 8] and "step=2" in best.best_model_path
    data.test_dataloader = data.val_dataloader  # type: ignore[method-assign]
    tested = trainer.test(datamodule=data, ckpt_path="best", verbose=False)[0]
    assert trainer.ckpt_path == best.best_model_path and tested["test/loss"] != pytest.approx(final)
    assert monitor.curve == curve and monitor.totals == totals and monitor.summary == summary
    record = json.loads(write_result(trainer, tmp_path / "r", metric="val/loss", metrics=tested).read_text())
    assert record["metric"] == pytest.approx(final) and [p["step"] for p in record["curve"]] == [2, 4, 6, 8]
    assert record["efficiency"]["flops"] == summary["flops"] and record["metrics"]["test/loss"] == tested["test/loss"]


def test_write_result_keeps_another_runs_record_and_replaces_the_same_fits(tmp_path):
    """A loop writing two seeds into one folder kept only the last record, in silence, and the report read one seed
    (qa83-report 02): the earlier run's is moved to result.previous.json with a warning, as ResultWriter does. The
    same fit's record written again (with a test's metrics) replaces it without one."""
    first = fit(tmp_path / "a", 2, ltd=False)
    write_result(first, tmp_path / "runs", metric="val/loss", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same fit again: no warning, no earlier record kept
        write_result(first, tmp_path / "runs", metric="val/loss", seed=0, metrics={"test/loss": 1.5})
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["result.json"]
    assert json.loads((tmp_path / "runs" / "result.json").read_text())["metrics"]["test/loss"] == 1.5
    second = fit(tmp_path / "b", 2, ltd=False)
    with pytest.warns(UserWarning, match=r"held another run's record; it is moved to result\.previous\.json"):
        write_result(second, tmp_path / "runs", metric="val/loss", seed=1)
    assert json.loads((tmp_path / "runs" / "result.json").read_text())["seed"] == 1
    assert json.loads((tmp_path / "runs" / "result.previous.json").read_text())["seed"] == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "result.json").write_text("{not json")  # a damaged record is kept too
    with pytest.warns(UserWarning, match=r"moved to result\.previous\.json"):
        write_result(second, tmp_path / "other", metric="val/loss", seed=1)
    assert (tmp_path / "other" / "result.previous.json").read_text() == "{not json"


class StopAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_a_fit_stopped_early_is_marked_and_its_baseline_left_out_of_the_frontier(tmp_path):
    """A baseline stopped at step 3 of 8 (what EarlyStopping and max_time do: ``trainer.should_stop``): write_result
    warns, the record says ``stopped_early``, and the report leaves it out of the frontier (its LR did not decay),
    with a note; the same run to its end is not marked."""
    for budget, steps in ((0.5, 4), (1.0, 8)):
        trainer = fit(tmp_path / f"b{budget}", steps, ltd=False)
        record = json.loads(
            write_result(trainer, tmp_path / "runs" / f"b{budget}", metric="val/loss", budget=budget).read_text()
        )
        assert record["length"]["stopped_early"] is False
    pl.seed_everything(0)
    early = make_trainer(
        tmp_path / "early",
        [EfficiencyMonitor(print_summary=False), StopAt(3)],
        max_steps=8,
        limit_val_batches=2,
        val_check_interval=2,
        check_val_every_n_epoch=None,
    )
    early.fit(tiny_gpt2(n_layer=4), datamodule=tiny_lm_data())
    assert early.global_step == 3
    with pytest.warns(UserWarning, match=r"the fit stopped early, at optimizer step 3 .*budget=1\.5 as a label"):
        file = write_result(early, tmp_path / "runs" / "early", metric="val/loss", budget=1.5)
    assert json.loads(file.read_text())["length"]["stopped_early"] is True
    report = build_report(load_runs([tmp_path / "runs"]))
    assert sorted(r["budget"] for r in report.rows) == [0.5, 1.0]
    assert any(
        "baseline@1.5 seed 0: the fit stopped early, at optimizer step 3" in n and "left out of the frontier" in n
        for n in report.notes
    )


def test_resuming_without_a_technique_warns_and_the_record_is_not_a_baseline(tmp_path):
    """A random-LTD fit checkpointed at step 4, resumed to step 8 without random-LTD: the monitor warns, naming it,
    and the record names random-LTD (``resumed_without``) and its arm, so the report never reads it as a baseline."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    ltd = RandomLTDCallback(min_value=4, max_value=16, seq_per_step=4, seed=0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    first = make_trainer(tmp_path / "a", [EfficiencyMonitor(print_summary=False), ltd, ckpt], max_steps=4)
    first.fit(tiny_gpt2(n_layer=4), datamodule=tiny_lm_data())
    pl.seed_everything(0)
    second = make_trainer(tmp_path / "b", [EfficiencyMonitor(print_summary=False)], max_steps=8, limit_val_batches=2)
    with pytest.warns(UserWarning, match=r"resumes a checkpoint trained with RandomLTDCallback, which this Trainer"):
        second.fit(
            tiny_gpt2(n_layer=4),
            datamodule=tiny_lm_data(),
            ckpt_path=ckpt.last_model_path or str(next((tmp_path / "ckpt").glob("*.ckpt"))),
        )
    record = json.loads(write_result(second, tmp_path / "r", metric="val/loss").read_text())
    assert record["arm"] == "random_ltd" and record["techniques"] == {"random_ltd": {"resumed_without": True}}
    assert record["efficiency"]["saved/random_ltd/flops_frac"] > 0


def test_a_curriculum_run_that_spends_its_sample_budget_is_not_stopped_early(tmp_path, monkeypatch):
    """The curriculum stops the fit when its data budget (2 epochs of 24 samples, 12 steps of 4) is spent, in a run
    bounded by neither max_steps nor its 50 epochs: that is the run's configured end (``effi_run_complete``), not an
    early stop."""
    from lightning_effi.report.record import stopped_early
    from tests.compat.setups import build

    run = build("curriculum")
    trainer = run.fit(tmp_path, max_steps=-1, max_epochs=50)
    assert trainer.should_stop and trainer.global_step == 12
    assert not stopped_early(trainer)
    monkeypatch.setattr(type(run.callbacks[0]), "effi_run_complete", property(lambda self: False))
    assert stopped_early(trainer)  # the same stop without the spent budget would be early


def test_a_quality_read_before_the_run_ended_is_warned_and_noted(tmp_path):
    """5 steps validated every 2: the final val/loss is step 4's, paired with the compute of 5 steps (a frontier
    baseline read so would skew every saving off it). write_result warns; the report notes it with both steps. A
    run validated at its last step (4 steps) gets neither."""
    trainer = fit(tmp_path / "fit5", 5, ltd=False)
    with pytest.warns(UserWarning, match=r"the final val/loss is the last validation's, at optimizer step 4 of 5: "):
        write_result(trainer, tmp_path / "runs" / "b5", metric="val/loss", budget=1.0)
    trainer = fit(tmp_path / "fit4", 4, ltd=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="the final val/loss")
        write_result(trainer, tmp_path / "runs" / "b4", metric="val/loss", budget=0.8)
    runs = load_runs([tmp_path / "runs"])
    assert sorted((r.budget, r.quality_step()) for r in runs) == [(0.8, None), (1.0, 4)]
    notes = build_report(runs).notes
    assert notes == [
        "baseline@1 seed 0: its val/loss is the last validation's, at optimizer step 4 of 5, read against the compute "
        "of the whole run (validate at the last step: a val_check_interval that divides the run)"
    ]


def test_a_curriculum_added_on_resume_is_marked_in_the_record_and_noted_by_the_report(tmp_path):
    """A baseline fit checkpointed at step 4, resumed to step 8 with a Curriculum (which warns and starts at its step
    1): the record keeps the curriculum's settings with ``added_on_resume: 4``, and the report notes that its readings
    mix the two; a curriculum from step 0 is not marked."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_effi.curriculum import Curriculum, CurriculumDataModule

    metrics = seqlen_truncate(min_difficulty=8, max_difficulty=16)
    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    first = make_trainer(tmp_path / "a", [EfficiencyMonitor(print_summary=False), ckpt], max_steps=4)
    first.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    pl.seed_everything(0)
    cl = Curriculum(metrics=metrics)
    second = make_trainer(tmp_path / "b", [EfficiencyMonitor(print_summary=False), cl], max_steps=8)
    with pytest.warns(UserWarning, match=r"Curriculum: resumed at optimizer step 4 from a checkpoint without"):
        path = str(next((tmp_path / "ckpt").glob("*.ckpt")))
        second.fit(tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data()), ckpt_path=path)
    record = json.loads(write_result(second, tmp_path / "runs" / "r", metric="train/loss").read_text())
    settings = record["techniques"]["curriculum"]
    assert record["arm"] == "curriculum" and settings["added_on_resume"] == 4
    assert settings["metrics"]["seqlen_truncate"]["max_difficulty"] == 16  # the settings, not {}
    # resumed again, from a checkpoint the curriculum wrote: the record of the run's end keeps the mark
    ckpt2 = ModelCheckpoint(dirpath=tmp_path / "ckpt2", every_n_train_steps=6, save_top_k=-1)
    pl.seed_everything(0)
    third = make_trainer(
        tmp_path / "b2", [EfficiencyMonitor(print_summary=False), Curriculum(metrics=metrics), ckpt2], max_steps=6
    )
    with pytest.warns(UserWarning, match=r"Curriculum: resumed at optimizer step 4"):
        third.fit(tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data()), ckpt_path=path)
    pl.seed_everything(0)
    fourth = make_trainer(
        tmp_path / "b3", [EfficiencyMonitor(print_summary=False), Curriculum(metrics=metrics)], max_steps=8
    )
    fourth.fit(
        tiny_gpt2(),
        datamodule=CurriculumDataModule(tiny_lm_data()),
        ckpt_path=str(next((tmp_path / "ckpt2").glob("*.ckpt"))),
    )
    again = json.loads(write_result(fourth, tmp_path / "again", metric="train/loss").read_text())
    assert again["techniques"]["curriculum"]["added_on_resume"] == 4
    notes = build_report(load_runs([tmp_path / "runs"])).notes
    assert any(
        n.startswith("curriculum@1 seed 0: curriculum joined on resume at optimizer step 4, from a checkpoint of a fit")
        for n in notes
    )
    callbacks = [EfficiencyMonitor(print_summary=False), Curriculum(metrics=metrics)]
    fresh = make_trainer(tmp_path / "c", callbacks, max_steps=4)
    fresh.fit(tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data()))
    record = json.loads(write_result(fresh, tmp_path / "fresh", metric="train/loss").read_text())
    assert "added_on_resume" not in record["techniques"]["curriculum"]


def test_the_record_appears_whole(tmp_path, monkeypatch):
    """result.json is written beside itself and renamed into place (a report read while a job writes it read half
    a file and failed for the whole sweep): the rename is the only way the file appears, and no partial file is
    left behind."""
    import os

    from lightning_effi.report import record as record_module

    renames: list[tuple[str, str]] = []
    real = os.replace

    def replace(src, dst):
        assert not Path(dst).exists() and json.loads(Path(src).read_text())["seed"] == 0  # whole before it appears
        renames.append((Path(src).name, Path(dst).name))
        real(src, dst)

    monkeypatch.setattr(record_module.os, "replace", replace)
    trainer = fit(tmp_path / "fit", 2, ltd=False)
    file = write_result(trainer, tmp_path / "run", metric="val/loss", task_name="t")
    assert len(renames) == 1 and renames[0][1] == "result.json" and renames[0][0].endswith(".tmp")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["result.json"]
    assert json.loads(file.read_text())["length"]["optimizer_steps"] == 2
