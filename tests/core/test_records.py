"""The EfficiencyMonitor's records (validation curve, technique schedules, progress bar) and the app's result.json
(schema 2: arm, budget, techniques, overrides, length, curve, schedule, relative paths; the sweep objective)."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

from lightning_effi import Curriculum, EfficiencyMonitor, InfoBatchCallback, RandomLTDCallback, VCycleCallback
from lightning_effi.core import accounting
from lightning_effi.core.accounting import schedule_states
from lightning_effi.report import build_report, load_runs
from lightning_effi.train import check_objective, objective, run, techniques_of
from lightning_effi.utils.instantiate import ConfigError
from tests.helpers.harness import make_trainer
from tests.helpers.hydra import compose_train
from tests.helpers.tiny import TinyDataModule, TokenBlocks, seqlen_truncate, tiny_gpt2

STEPS = 6


class ValRecorder(pl.Callback):
    """What Lightning itself reports at each validation (the monitor's curve must say the same)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.seen.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))


def _fit(tmp_path, callbacks, steps=STEPS, ckpt_path=None, extra=()):
    pl.seed_everything(0, workers=True)
    monitor = EfficiencyMonitor(log_every_n_steps=1, print_summary=False)
    recorder = ValRecorder()
    trainer = make_trainer(
        tmp_path,
        [monitor, *callbacks, recorder, *extra],
        max_steps=steps,
        max_epochs=-1,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
    )
    dm = TinyDataModule(TokenBlocks(n=64), batch_size=8)
    for cb in callbacks:  # as lightning_effi.train.build wraps it
        wrap = getattr(cb, "wrap_datamodule", None)
        dm = wrap(dm) if callable(wrap) else dm
    trainer.fit(tiny_gpt2(n_layer=4), datamodule=dm, ckpt_path=ckpt_path)
    return trainer, monitor, recorder


def _stack():
    return [
        RandomLTDCallback(min_value=4, max_value=16, seq_per_step=4, seed=7),
        VCycleCallback(e_a=1, e_small=2, alpha_original=0.3),
    ]


def test_curve_has_one_point_per_validation_with_cumulative_figures(tmp_path):
    trainer, monitor, recorder = _fit(tmp_path, _stack())
    curve = monitor.curve
    assert [p["step"] for p in curve] == [2, 4, 6] == [s for s, _ in recorder.seen]
    assert [p["metrics"]["val/loss"] for p in curve] == pytest.approx([v for _, v in recorder.seen])
    for key in ("samples", "tokens", "layer_tokens", "flops", "train_wall_s"):
        values = [p[key] for p in curve]
        assert all(b > a for a, b in zip(values, values[1:])), (key, values)
    assert [p["samples"] for p in curve] == [16, 32, 48]  # batch 8, cumulative
    last, summary = curve[-1], monitor.summary
    assert last["flops"] == pytest.approx(summary["flops"]) and last["tokens"] == summary["tokens"]
    assert last["train_wall_s"] <= summary["time_train_s"] + summary["time_data_s"] + 1e-9


def test_schedule_records_each_technique_state_and_the_progress_bar_shows_it(tmp_path):
    trainer, monitor, _ = _fit(tmp_path, _stack())
    schedule = monitor.schedule
    assert [p["step"] for p in schedule] == list(range(1, STEPS + 1))  # one point per step (log every step)
    levels = [p["vcycle/level"] for p in schedule]
    # e_a = 1 step on the full model, e_small = 2 on level 2; the monitor records before the switch at the step end
    assert levels == [1.0, 2.0, 2.0, 1.0, 1.0, 1.0]
    reserved = [p["random_ltd/reserved_length"] for p in schedule]
    assert reserved == sorted(reserved) and reserved[0] >= 4 and reserved[-1] <= 16
    assert schedule[-1]["flops"] == pytest.approx(monitor.summary["flops"])
    bar = trainer.progress_bar_metrics
    assert bar["level"] == 1.0 and bar["reserved_length"] == reserved[-1]


def _sparse_fit(root, log_every, ckpt_path=None, extra=()):
    """The V-cycle alone for STEPS steps, no validation, the monitor logging every ``log_every`` steps."""
    pl.seed_everything(0, workers=True)
    monitor = EfficiencyMonitor(log_every_n_steps=log_every, print_summary=False)
    vcycle = VCycleCallback(e_a=1, e_small=2, alpha_original=0.3)
    trainer = make_trainer(root, [monitor, vcycle, *extra], max_steps=STEPS, max_epochs=-1)
    trainer.fit(tiny_gpt2(n_layer=4), datamodule=TinyDataModule(TokenBlocks(n=64), batch_size=8), ckpt_path=ckpt_path)
    return monitor


def test_a_state_change_between_logging_steps_is_recorded_where_it_happened(tmp_path, monkeypatch):
    """A run shorter than the logging interval recorded one schedule point, so a V-cycle that spent steps 2-3 at
    level 2 read as level 1 throughout. The steps before and at each change are now recorded, with the figures
    the every-step schedule holds at those steps."""
    dense = _sparse_fit(tmp_path / "dense", 1).schedule
    assert [p["vcycle/level"] for p in dense] == [1.0, 2.0, 2.0, 1.0, 1.0, 1.0]
    sparse = _sparse_fit(tmp_path / "sparse", 50).schedule
    assert [p["step"] for p in sparse] == [1, 2, 3, 4]  # before and at each of the two switches

    def strip(points):  # wall times differ between runs
        return [{k: v for k, v in p.items() if k != "train_wall_s"} for p in points]

    assert strip(sparse) == strip(dense[:4])
    # a logging step at a change adds its own point, with the step before it
    assert [p["step"] for p in _sparse_fit(tmp_path / "every2", 2).schedule] == [1, 2, 3, 4, 6]
    monkeypatch.setattr(accounting, "MAX_CHANGE_POINTS", 2)
    assert [p["step"] for p in _sparse_fit(tmp_path / "capped", 50).schedule] == [1, 2]


def test_the_schedule_starts_at_the_first_step(tmp_path):
    """A run shorter than its logging interval whose first change came late began its schedule (and its plot) at
    that change: a 30-step random-LTD run's at step 10 (qa48-ts 02). The first step is a point."""
    pl.seed_everything(0, workers=True)
    monitor = EfficiencyMonitor(log_every_n_steps=50, print_summary=False)
    vcycle = VCycleCallback(e_a=3, e_small=2, alpha_original=0.3)
    trainer = make_trainer(tmp_path, [monitor, vcycle], max_steps=STEPS, max_epochs=-1)
    trainer.fit(tiny_gpt2(n_layer=4), datamodule=TinyDataModule(TokenBlocks(n=64), batch_size=8))
    assert [(p["step"], p["vcycle/level"]) for p in monitor.schedule] == [
        (1, 1.0),
        (3, 1.0),
        (4, 2.0),
        (5, 2.0),
        (6, 1.0),
    ]


def test_a_validation_at_a_switch_records_the_level_that_trained_its_step(tmp_path):
    """A validation at the step a V-cycle stage ends read the states after the switch (the V-cycle switches in its
    on_train_batch_end, before validation): the point showed the next level at that step and the change point
    before it was dropped, so with e_a='1ep' and end-of-epoch validation level 1 never appeared (the helper's run).
    Every point now shows the level that trained its step, as the every-step schedule does."""
    pl.seed_everything(0, workers=True)

    def fit(root, log_every):
        pl.seed_everything(0, workers=True)
        monitor = EfficiencyMonitor(log_every_n_steps=log_every, print_summary=False)
        vcycle = VCycleCallback(e_a=2, e_small=2, alpha_original=0.3)
        trainer = make_trainer(root, [monitor, vcycle], max_steps=STEPS, max_epochs=-1, val_check_interval=2,
                               check_val_every_n_epoch=None, limit_val_batches=1)  # fmt: skip
        trainer.fit(tiny_gpt2(n_layer=4), datamodule=TinyDataModule(TokenBlocks(n=64), batch_size=8))
        return {p["step"]: p["vcycle/level"] for p in monitor.schedule}

    dense, sparse = fit(tmp_path / "dense", 1), fit(tmp_path / "sparse", 50)
    assert list(dense.values()) == [1.0, 1.0, 2.0, 2.0, 1.0, 1.0]  # steps 3-4 at level 2
    assert sparse == {step: dense[step] for step in sparse} and set(sparse) >= {2, 3, 4, 5}


def test_a_resumed_fit_records_the_change_points_of_an_uninterrupted_one(tmp_path):
    every = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, monitor=None)
    full = _sparse_fit(tmp_path / "full", 50, extra=[every]).schedule
    ckpt = next((tmp_path / "ck").glob("*step=3.ckpt"))  # the last step at level 2: the switch back comes next
    resumed = _sparse_fit(tmp_path / "resumed", 50, ckpt_path=str(ckpt)).schedule
    assert [p["step"] for p in resumed] == [p["step"] for p in full] == [1, 2, 3, 4]
    assert [p["vcycle/level"] for p in resumed] == [1.0, 2.0, 2.0, 1.0]
    state = EfficiencyMonitor().state_dict() | {"change_points": -1}
    with pytest.raises(ValueError, match=r"change_points \(an int >= 0\) are not valid"):
        EfficiencyMonitor().load_state_dict(state)


def test_infobatch_and_curriculum_states(tmp_path):
    infobatch = InfoBatchCallback(prune_ratio=0.3, delta=0.75, num_epochs=4, seed=7)
    pl.seed_everything(0, workers=True)
    monitor = EfficiencyMonitor(log_every_n_steps=1, print_summary=False)
    trainer = make_trainer(tmp_path, [monitor, infobatch], max_epochs=4, max_steps=-1)
    dm = infobatch.wrap_datamodule(TinyDataModule(TokenBlocks(n=64), batch_size=8))
    trainer.fit(tiny_gpt2(), datamodule=dm)
    by_epoch: dict[int, set[float]] = {}
    for p in monitor.schedule:
        by_epoch.setdefault(p["epoch"], set()).add(round(p["infobatch/kept_fraction"], 9))
    expected = [round(1.0 - h["saved"] / 64, 9) for h in infobatch.history]  # the plan's kept share of 64 samples
    assert [by_epoch[e] for e in sorted(by_epoch)] == [{k} for k in expected]
    assert expected[0] == 1.0 and min(expected) < 1.0  # epoch 0 trains everything, a later one prunes

    curriculum = Curriculum(
        metrics={
            "seqlen_truncate": dict(
                difficulty_type="value",
                clustering_type="single_cluster",
                min_difficulty=8,
                max_difficulty=16,
                schedule_type="fixed_linear",
                schedule_config=dict(total_curriculum_step=4, difficulty_step=4),
            )
        },
        seed=3,
    )
    trainer, monitor, _ = _fit(tmp_path / "cl", [curriculum], extra=())
    difficulties = [p["curriculum/difficulty"] for p in monitor.schedule]
    assert difficulties == sorted(difficulties) and difficulties[0] == 8 and difficulties[-1] == 16
    assert schedule_states(trainer)["curriculum/difficulty"] == 16


def test_records_resume_exactly(tmp_path):
    every = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, monitor=None)
    _, full, _ = _fit(tmp_path / "full", _stack(), extra=[every])
    ckpt = next((tmp_path / "ck").glob("*step=3*.ckpt"))  # inside the coarse V-cycle stage
    _, resumed, _ = _fit(tmp_path / "second", _stack(), ckpt_path=str(ckpt))

    def strip(points):  # wall times differ between runs
        return [{k: v for k, v in p.items() if k != "train_wall_s"} for p in points]

    assert len(resumed.curve) == 3 and strip(resumed.curve) == strip(full.curve)
    assert len(resumed.schedule) == STEPS and strip(resumed.schedule) == strip(full.schedule)


@pytest.mark.parametrize("step", [2, 3])
def test_a_resume_past_a_skipped_validation_says_the_curve_lacks_its_point(tmp_path, step):
    """A checkpoint written at a validation step's batch end comes before the validation, and Lightning resumes it past
    the validation without running it: the resumed curve lacks that point. It was told nowhere (the docs said the curve
    resumes exactly; qa96-break 01); now a warning names the step. A checkpoint at a step without a validation (3:
    validations at 2, 4, 6) resumes the whole curve, with no warning."""
    every = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, monitor=None)
    _, full, _ = _fit(tmp_path / "full", [], extra=[every])
    ckpt = next((tmp_path / "ck").glob(f"*step={step}*.ckpt"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, resumed, _ = _fit(tmp_path / "second", [], ckpt_path=str(ckpt))
    told = [str(w.message) for w in caught if "no point at step" in str(w.message)]
    steps = [p["step"] for p in resumed.curve]
    if step == 2:
        assert steps == [4, 6] and [p["step"] for p in full.curve] == [2, 4, 6]
        assert len(told) == 1 and "written before step 2's validation ended" in told[0]
    else:
        assert steps == [2, 4, 6] and told == []
    assert resumed.summary["flops"] == full.summary["flops"]  # the totals are the uninterrupted run's either way


class _StopInValidation(pl.Callback):
    def on_validation_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == 2 and not trainer.sanity_checking:
            raise RuntimeError("stopped in validation")


def test_a_skipped_validation_is_told_after_a_stop_inside_it_and_after_a_second_resume(tmp_path):
    """Two more ways to resume past a validation (qa97-regress 02, 03): ``OnExceptionCheckpoint`` written during the
    step-2 validation; and a run resumed again from a checkpoint its first resume wrote before validating past step
    2 (the pending step is carried into it). Each resumed fit whose curve lacks step 2 says so."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    def every_step(folder: str) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=1, save_top_k=-1, monitor=None)

    with pytest.raises(RuntimeError, match="stopped in validation"):
        _fit(tmp_path / "first", [], extra=[every_step("ck1"), OnExceptionCheckpoint(tmp_path), _StopInValidation()])
    _fit(tmp_path / "full", [], extra=[every_step("ck")])
    _fit(
        tmp_path / "to3", [], steps=3, ckpt_path=str(next((tmp_path / "ck").glob("*step=2*"))), extra=[every_step("c3")]
    )
    again = next((tmp_path / "c3").glob("*step=3*"))
    assert torch.load(again, weights_only=False)["callbacks"]["EfficiencyMonitor"]["skipped_validations"] == [2]
    for ckpt in (tmp_path / "on_exception.ckpt", again):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, resumed, _ = _fit(tmp_path / ckpt.stem, [], ckpt_path=str(ckpt))
        told = [str(w.message) for w in caught if "no point at step" in str(w.message)]
        assert [p["step"] for p in resumed.curve] == [4, 6], ckpt
        assert len(told) == 1 and "before step 2's validation ended" in told[0], ckpt


def test_a_checkpoint_written_after_the_validation_resumes_the_whole_curve(tmp_path):
    """``ModelCheckpoint(monitor=...)`` saves at validation end, after the point: no gap, no warning."""
    best = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="val/loss", save_top_k=-1, filename="{step}")
    _, full, _ = _fit(tmp_path / "full", [], extra=[best])
    ckpt = next((tmp_path / "ck").glob("step=2*.ckpt"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, resumed, _ = _fit(tmp_path / "second", [], ckpt_path=str(ckpt))
    assert [p["step"] for p in resumed.curve] == [p["step"] for p in full.curve] == [2, 4, 6]
    assert not [w for w in caught if "no point at step" in str(w.message)]


def test_result_json_schema_2(tmp_path):
    overrides = ["callbacks=random_ltd", "callbacks.random_ltd.min_value=32", "seed=3"]
    cfg = compose_train(overrides, tmp_path)
    result = run(cfg)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["schema"] == 2 and saved["seed"] == 3 and saved["budget"] == 1.0
    assert saved["arm"] == "random_ltd" and list(saved["techniques"]) == ["random_ltd"]
    assert saved["techniques"]["random_ltd"]["min_value"] == 32
    assert saved["techniques"]["random_ltd"]["_target_"] == "lightning_effi.callbacks.RandomLTDCallback"
    assert saved["optimized_mode"] == "min" and saved["length"]["optimizer_steps"] == 3
    assert len(saved["curve"]) == 1 and saved["curve"][0]["metrics"]["val/loss"] == pytest.approx(saved["metric"])
    assert saved["schedule"] and all("random_ltd/reserved_length" in p for p in saved["schedule"])
    # no absolute path of the machine: the checkpoint is named relative to the run's folder
    assert saved["last_checkpoint"] == "checkpoints/last.ckpt" and (tmp_path / saved["last_checkpoint"]).exists()
    assert not os.path.isabs(saved["output_dir"])
    assert (Path(cfg.paths.root_dir) / saved["output_dir"]).resolve() == tmp_path.resolve()
    assert result["arm"] == saved["arm"]


def test_baseline_arm_and_explicit_labels(tmp_path):
    cfg = compose_train(["budget=0.5", "trainer.max_epochs=-1"], tmp_path)
    cfg.arm = "plain"  # a label set in a config file (on the command line, arm=<name> picks a conf/arm/ file)
    cfg.trainer.max_steps = "${effi_scale:4,${budget}}"  # as the bench configs scale the length
    saved = run(cfg)
    assert saved["arm"] == "plain" and saved["budget"] == 0.5 and saved["techniques"] == {}
    assert saved["length"]["optimizer_steps"] == 2
    with pytest.raises(ConfigError, match="budget: 0.5 does not scale this run's length"):
        run(compose_train(["budget=0.5", "trainer.max_steps=2"], tmp_path / "c"))
    default = run(compose_train(["trainer.max_steps=2"], tmp_path / "b"))
    assert default["arm"] == "baseline" and default["techniques"] == {}


def test_techniques_of_skips_lightning_callbacks_and_the_monitor():
    cfg = OmegaConf.create(
        {
            "efficiency": {"_target_": "lightning_effi.core.accounting.EfficiencyMonitor"},
            "lr_monitor": {"_target_": "lightning.pytorch.callbacks.LearningRateMonitor"},
            "vcycle": {"_target_": "lightning_effi.callbacks.VCycleCallback", "levels": 2},
            "curriculum": {"_target_": "lightning_effi.callbacks.Curriculum", "seed": 1},
        }
    )
    assert techniques_of(cfg) == {
        "vcycle": {"_target_": "lightning_effi.callbacks.VCycleCallback", "levels": 2},
        "curriculum": {"_target_": "lightning_effi.callbacks.Curriculum", "seed": 1},
    }


def test_techniques_of_reads_a_factory_target():
    """A technique built by a classmethod (the curriculum card's ``Curriculum.from_config``) or by a function that
    says what it returns is a technique with its settings (it was left out, and the report then took the run for one
    resumed without its curriculum, qa35-user 01); a function returning something else is not."""
    factory = {"_target_": "lightning_effi.Curriculum.from_config", "config": {"seed": 3}}
    cfg = OmegaConf.create(
        {
            "curriculum": factory,
            "parse": {"_target_": "lightning_effi.curriculum.parse_deepspeed_config", "ds_config": {}},
            "missing": {"_target_": "lightning_effi.no_such_thing"},
        }
    )
    assert techniques_of(cfg) == {"curriculum": factory}


def _cfg(**objective_spec):
    return OmegaConf.create({"optimized_metric": "val/loss", "optimized_mode": "min", "objective": objective_spec})


def test_objective_saving_at_floor():
    result = {"metric": 1.9, "efficiency": {"flops_saved_frac": 0.31, "tokens_saved_frac": 0.12}}
    assert objective(_cfg(kind="saving_at_floor", floor=2.0), result) == 0.31
    assert objective(_cfg(kind="saving_at_floor", floor=2.0, compute="tokens"), result) == 0.12
    assert objective(_cfg(kind="saving_at_floor", floor=1.5), result) == -1.0  # above a loss floor: missed
    maxed = OmegaConf.create(
        {"optimized_metric": "val/acc", "optimized_mode": "max", "objective": {"kind": "saving_at_floor", "floor": 0.5}}
    )
    assert objective(maxed, {"metric": 0.6, "efficiency": {"flops_saved_frac": 0.2}}) == 0.2
    assert objective(maxed, {"metric": 0.4, "efficiency": {"flops_saved_frac": 0.2}}) == -1.0
    assert objective(OmegaConf.create({}), {"metric": 1.25}) == 1.25
    assert math.isnan(objective(_cfg(kind="metric"), {"metric": math.nan}))


@pytest.mark.parametrize(
    "spec, message",
    [
        (dict(kind="best"), "objective.kind"),
        (dict(kind="saving_at_floor", floor=1.0, compute="watts"), "objective.compute"),
        (dict(kind="saving_at_floor"), "objective.floor"),
        (dict(kind="saving_at_floor", floor="low"), "objective.floor"),
        (dict(kind="saving_at_floor", floor=True), "objective.floor"),
        (dict(kind="saving_at_floor", floor=1.0, floors=2), "unknown keys"),
    ],
)
def test_objective_bad_input_is_named_before_training(spec, message):
    with pytest.raises(ConfigError, match=message):
        check_objective(_cfg(**spec))


@pytest.mark.parametrize("budget", [0, -0.5, "half", True])
def test_bad_budget_is_named(tmp_path, budget):
    with pytest.raises(ConfigError, match="budget"):
        run(compose_train([f"budget={budget}"], tmp_path))


def test_a_deepspeed_json_through_the_hydra_app(tmp_path):
    """The curriculum card's recipe: a callbacks config whose curriculum is ``Curriculum.from_config`` of
    ``parse_deepspeed_config(<a DeepSpeed JSON file>)``. The run trains the DeepSpeed schedule and its record holds the
    settings (it held ``resumed_without`` and no settings, qa35-user 01)."""
    metric = {
        "difficulty_type": "value",
        "clustering_type": "single_cluster",
        "min_difficulty": 8,
        "max_difficulty": 64,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8},
    }
    learning = {"enabled": True, "data_cluster_path": "unused", "curriculum_metrics": {"seqlen_truncate": metric}}
    ds = {"data_efficiency": {"enabled": True, "data_sampling": {"enabled": True, "curriculum_learning": learning}}}
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    (tmp_path / "conf" / "callbacks").mkdir(parents=True)
    (tmp_path / "conf" / "callbacks" / "ds_curriculum.yaml").write_text(
        "defaults:\n  - default\n  - _self_\ncurriculum:\n  _target_: lightning_effi.Curriculum.from_config\n"
        "  config:\n    _target_: lightning_effi.curriculum.parse_deepspeed_config\n"
        f"    ds_config: {tmp_path / 'ds_config.json'}\n    rounding: deepspeed\n"
    )
    overrides = ["callbacks=ds_curriculum", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"]
    run(compose_train(overrides, tmp_path / "sweep" / "0"))
    saved = json.loads((tmp_path / "sweep" / "0" / "result.json").read_text())
    assert saved["arm"] == "curriculum"
    assert saved["techniques"]["curriculum"]["config"]["ds_config"] == str(tmp_path / "ds_config.json")
    # DeepSpeed's schedule, 8 + 56 s / 4 rounded down to a multiple of 8, and batches truncated to it
    assert [p["curriculum/difficulty"] for p in saved["schedule"]] == [16, 32, 48]
    assert [p["tokens"] for p in saved["schedule"]] == [16 * 16, 16 * (16 + 32), 16 * (16 + 32 + 48)]
    # the record also holds the schedule the file gave (the path alone named it, qa36-break): a second sweep made by
    # editing the file is another arm to the report, not a second seed of the first
    built = saved["techniques"]["curriculum"]["built"]["metrics"]["seqlen_truncate"]
    assert (built["min_difficulty"], built["max_difficulty"], built["schedule_config"]["total_curriculum_step"]) == (
        8,
        64,
        4,
    )
    metric["max_difficulty"] = 32
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    run(compose_train(overrides, tmp_path / "sweep" / "1"))
    arms = {r["arm"] for r in build_report(load_runs([tmp_path / "sweep"])).rows}
    assert arms == {
        "curriculum[curriculum.built.metrics.seqlen_truncate.max_difficulty=32]",
        "curriculum[curriculum.built.metrics.seqlen_truncate.max_difficulty=64]",
    }


def make_random_ltd(**kwargs):  # a user's factory that says nothing of what it builds
    from lightning_effi.callbacks import RandomLTDCallback

    return RandomLTDCallback(**kwargs)


def test_a_factory_without_a_return_annotation_is_recorded_with_its_settings(tmp_path):
    """The technique a factory built is known from the Trainer's callbacks: the record held ``resumed_without`` and
    no settings for a fresh run (qa36-break 03)."""
    overrides = [
        "callbacks=random_ltd",
        "callbacks.random_ltd._target_=tests.core.test_records.make_random_ltd",
        "callbacks.random_ltd.min_value=32",
    ]
    saved = run(compose_train(overrides, tmp_path))
    assert saved["arm"] == "random_ltd" and saved["techniques"]["random_ltd"]["min_value"] == 32
    assert saved["techniques"]["random_ltd"]["built"]["min_value"] == 32  # the settings of the callback it built
    assert "resumed_without" not in saved["techniques"]["random_ltd"]


def test_a_callable_setting_is_recorded_by_its_name_not_its_address():
    """Curriculum(analysis_collate_fn=collate) was recorded as "<function collate at 0x7f...>", an address that differs
    between a sweep's processes: the report split two seeds of one arm into two one-seed arms (qa39-break 04)."""
    import functools

    from lightning_effi.report.record import technique_settings
    from lightning_effi.report.table import _flat_settings

    metrics = seqlen_truncate()
    cb = Curriculum(metrics=metrics, analysis_collate_fn=torch.utils.data.default_collate)
    assert technique_settings(cb)["analysis_collate_fn"] == "torch.utils.data._utils.collate.default_collate"
    cb = Curriculum(metrics=metrics, analysis_collate_fn=functools.partial(torch.utils.data.default_collate))
    assert technique_settings(cb)["analysis_collate_fn"] == (
        "functools.partial(torch.utils.data._utils.collate.default_collate)"
    )
    old = {"curriculum": {"analysis_collate_fn": "<function collate at 0x7f3c7eab5f80>"}}
    other = {"curriculum": {"analysis_collate_fn": "<function collate at 0x7f0cdf395f80>"}}
    assert _flat_settings(old) == _flat_settings(other)  # records written before: the address is left out
