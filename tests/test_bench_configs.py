"""The benchmark sweeps (conf/bench/, conf/arm/): the frontier protocol of Kaddour et al., "No Train No Gain"
(NeurIPS 2023, Sec. 3) as Hydra configs. Every bench composes into >= 4 baseline budgets and a technique arm at
>= 2 seeds; the baseline arms carry no technique, the technique arm exactly the bench's; ``budget`` scales each run's
length (and so its LR schedule); a tiny multirun writes one result.json per job and the report."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict

from lightning_effi.callbacks import Curriculum, InfoBatchCallback, RandomLTDCallback, VCycleCallback
from lightning_effi.train import BudgetLength
from lightning_effi.utils.instantiate import (
    ConfigError,
    budget_lengths,
    check_budget,
    check_budget_length,
    instantiate_callbacks,
    scale_length,
)
from tests.helpers.hydra import CONF, compose_train, run_train_script

BENCHES = sorted(p.stem for p in (CONF / "bench").glob("*.yaml"))
BASELINE_ARMS = sorted(p.stem for p in (CONF / "arm").glob("baseline_*.yaml"))
TECHNIQUE_CLASSES = {
    Curriculum: "curriculum",
    InfoBatchCallback: "infobatch",
    RandomLTDCallback: "random_ltd",
    VCycleCallback: "vcycle",
}
TECHNIQUE_TARGETS = {f"lightning_effi.callbacks.{cls.__name__}": name for cls, name in TECHNIQUE_CLASSES.items()}

#: per bench: its techniques, the length key it scales, the reference length and the technique arm's length
EXPECTED = {
    "infobatch_cifar10": ({"infobatch"}, "max_epochs", 40, 40),
    "infobatch_cifar10_fit": ({"infobatch"}, "max_epochs", 100, 100),
    "infobatch_cifar10_1k": ({"infobatch"}, "max_epochs", 200, 200),
    "curriculum_seqlen": ({"curriculum"}, "max_steps", 400, 400),
    "random_ltd_gpt": ({"random_ltd"}, "max_steps", 400, 400),
    "random_ltd_vit": ({"random_ltd"}, "max_steps", 400, 400),
    "vcycle_gpt": ({"vcycle"}, "max_steps", 1200, 1920),
    "vcycle_vit": ({"vcycle"}, "max_steps", 1200, 1920),
    "gpt_stack": ({"curriculum", "random_ltd", "vcycle"}, "max_steps", 2000, 3000),
    "gpt_stack_6l": ({"curriculum", "random_ltd", "vcycle"}, "max_steps", 1200, 1560),
    "vit_stack": ({"infobatch", "random_ltd", "vcycle"}, "max_epochs", 12, 18),
    "vit_stack_ib_ltd": ({"infobatch", "random_ltd"}, "max_epochs", 12, 12),
    "vit_stack_vc_ltd": ({"random_ltd", "vcycle"}, "max_steps", 1200, 1920),
    "gpt_stdlib_stack": ({"curriculum", "random_ltd", "vcycle"}, "max_steps", 1000, 1500),
}
#: benches that share another bench's task (its baseline runs, read in one report), bench -> the task's bench
SHARED_TASK = {"vit_stack_ib_ltd": "vit_stack", "vit_stack_vc_ltd": "vcycle_vit"}


def _compose(tmp_path: Path, bench: str, *overrides: str):
    return compose_train([f"bench={bench}", *overrides], tmp_path, fast=False)


def _sweep(cfg) -> tuple[list[str], list[int]]:
    params = cfg.hydra.sweeper.params
    return str(params.arm).split(","), [int(s) for s in str(params.seed).split(",")]


def _technique_targets(callbacks_cfg) -> set[str]:
    return {TECHNIQUE_TARGETS[n._target_] for n in callbacks_cfg.values() if n._target_ in TECHNIQUE_TARGETS}


def test_every_bench_of_the_protocol_exists():
    assert set(BENCHES) == set(EXPECTED)
    assert BASELINE_ARMS == ["baseline_100", "baseline_150", "baseline_25", "baseline_50", "baseline_75"]


@pytest.mark.parametrize("bench", BENCHES)
def test_bench_sweeps_a_baseline_frontier_and_the_technique_arm(bench, tmp_path):
    cfg = _compose(tmp_path, bench)
    assert cfg.hydra.mode.name == "MULTIRUN"
    assert cfg.hydra.callbacks.report._target_ == "lightning_effi.report.hydra_callback.ReportCallback"
    arms, seeds = _sweep(cfg)
    baselines = [a for a in arms if a.startswith("baseline_")]
    assert set(baselines) <= set(BASELINE_ARMS) and len(set(baselines)) >= 4
    assert "technique" in arms and len(set(seeds)) >= 2
    assert cfg.task_name == f"bench_{SHARED_TASK.get(bench, bench)}"
    header = (CONF / "bench" / f"{bench}.yaml").read_text()
    assert f"python experiments/train.py bench={bench}" in header and "about" in header  # command and CPU time


@pytest.mark.parametrize(("bench", "owner"), sorted(SHARED_TASK.items()))
def test_a_bench_sharing_a_task_trains_the_same_baselines(bench, owner, tmp_path):
    """The report reads runs of one task against each other: a bench whose task_name is another bench's must compose
    the very same baseline runs (only the tags and the technique arm's budget may differ)."""
    arms, seeds = _sweep(_compose(tmp_path, bench))
    owner_arms, owner_seeds = _sweep(_compose(tmp_path, owner))
    baselines = [a for a in arms if a.startswith("baseline_")]
    assert len(baselines) >= 4 and set(baselines) <= set(owner_arms) and set(seeds) <= set(owner_seeds)
    for arm in baselines:
        mine, theirs = (OmegaConf.to_container(_compose(tmp_path, b, f"arm={arm}", "seed=1")) for b in (bench, owner))
        for cfg in (mine, theirs):
            for key in ("hydra", "tags", "technique_budget"):
                cfg.pop(key)
        assert mine == theirs, arm
    arm_of = {b: _compose(tmp_path, b, "arm=technique") for b in (bench, owner)}
    assert len({(c.technique_budget, frozenset(_technique_targets(c.callbacks))) for c in arm_of.values()}) == 2


@pytest.mark.parametrize("bench", BENCHES)
def test_baseline_arms_have_no_technique_and_the_technique_arm_has_the_benchs(bench, tmp_path):
    techniques, key, ref, technique_length = EXPECTED[bench]
    arms, _ = _sweep(_compose(tmp_path, bench))
    for arm in arms:
        cfg = _compose(tmp_path, bench, f"arm={arm}")
        built = {
            TECHNIQUE_CLASSES[type(c)] for c in instantiate_callbacks(cfg.callbacks) if type(c) in TECHNIQUE_CLASSES
        }
        want = techniques if arm == "technique" else set()
        assert _technique_targets(cfg.callbacks) == want, arm
        assert built == want, arm
        assert {"efficiency", "model_checkpoint"} <= set(cfg.callbacks), arm  # the default callbacks stay


@pytest.mark.parametrize("bench", BENCHES)
def test_budget_scales_the_length_and_the_last_step_is_validated(bench, tmp_path):
    _, key, ref, technique_length = EXPECTED[bench]
    other = "max_epochs" if key == "max_steps" else "max_steps"
    arms, _ = _sweep(_compose(tmp_path, bench))
    for arm in arms:
        cfg = _compose(tmp_path, bench, f"arm={arm}")
        budget = int(arm.split("_")[1]) / 100 if arm.startswith("baseline_") else cfg.technique_budget
        assert cfg.budget == budget
        length = cfg.trainer[key]
        assert length == (technique_length if arm == "technique" else math.floor(ref * budget + 0.5)), arm
        assert cfg.trainer[other] == -1  # the scaled key alone ends the run
        if arm == "baseline_25":
            assert length * 4 == ref
        every = cfg.trainer.val_check_interval if key == "max_steps" else cfg.trainer.check_val_every_n_epoch
        assert every is not None and length % every == 0, (arm, length, every)  # the final metric is the last point
        assert 2 <= length // every <= 40, (arm, length // every)
    assert _compose(tmp_path, bench, "arm=baseline_50", f"ref_{key[4:]}=8").trainer[key] == 4


def test_schedules_sized_by_the_run_follow_the_budget(tmp_path):
    cfg = _compose(tmp_path, "gpt_stack", "arm=technique")
    assert cfg.trainer.max_steps == 3000
    assert cfg.callbacks.curriculum.metrics.seqlen_truncate.schedule_config.total_curriculum_step == 1200  # 40%
    cfg = _compose(tmp_path, "curriculum_seqlen", "arm=technique", "technique_budget=0.5")
    assert cfg.trainer.max_steps == 200
    assert cfg.callbacks.curriculum.metrics.seqlen_truncate.schedule_config.total_curriculum_step == 120  # 60%


def test_scale_length_rounds_half_up_and_refuses_bad_budgets():
    assert [scale_length(400, b) for b in (0.25, 0.5, 0.75, 1.0, 1.5, 1.6)] == [100, 200, 300, 400, 600, 640]
    assert scale_length(10, 0.25) == 3 and scale_length(10, 0.24) == 2 and scale_length(4, 1) == 4
    for budget in (0, -0.5, float("nan"), float("inf"), True, "half", None):
        with pytest.raises(ConfigError, match="^budget: expected a number > 0"):
            scale_length(400, budget)
    with pytest.raises(ConfigError, match=r"^budget: 0.001 x the reference length 400 = 0.4 rounds to 0"):
        scale_length(400, 0.001)
    for reference in (0, 2.5, "400", True):
        with pytest.raises(ConfigError, match="^budget: the reference length must be an int >= 1"):
            scale_length(reference, 0.5)


def test_a_bad_budget_or_a_technique_arm_without_bench_is_named(tmp_path):
    cfg = _compose(tmp_path, "gpt_stack", "budget=0")
    with pytest.raises(Exception, match="budget: expected a number > 0"):
        OmegaConf.to_container(cfg.trainer, resolve=True)
    with pytest.raises(HydraException, match=r"arm=technique trains the techniques of a bench; add bench=<name>"):
        compose_train(["arm=technique"], tmp_path, fast=False)
    with pytest.raises(ConfigError, match=r"^budget: 0.5 does not scale this run's length") as refused:
        check_budget(compose_train(["budget=0.5"], tmp_path))
    # the command-line form the message gives works as the shell passes it (its single quotes removed)
    typed = re.search(r"single quotes: '([^']+)'", str(refused.value)).group(1)
    cfg = compose_train(["budget=0.5", typed], tmp_path)
    check_budget(cfg)
    assert cfg.trainer.max_steps == 1000
    check_budget(_compose(tmp_path, "gpt_stack", "budget=0.5"))
    check_budget(compose_train([], tmp_path))
    # the message's command line lifts the other limit too (the default max_epochs: 5 cut it short, qa106-break 01)
    assert "trainer.max_epochs=-1" in str(refused.value)
    assert budget_lengths(compose_train(["budget=0.5", typed], tmp_path)) == ["max_steps"]
    assert budget_lengths(_compose(tmp_path, "gpt_stack", "budget=0.5")) == ["max_steps"]
    assert budget_lengths(_compose(tmp_path, "infobatch_cifar10", "budget=0.5")) == ["max_epochs"]
    assert budget_lengths(compose_train([], tmp_path)) == []


def test_a_budget_length_cut_short_by_the_other_limit_is_refused_at_the_start_of_training():
    """budget=0.5 with max_steps scaled to 20 and max_epochs=2 on 5 steps an epoch trained 10 steps, what budget 1.0
    trained too, each recorded under its budget (qa106-break 01)."""
    limits = SimpleNamespace(max_steps=20, max_epochs=2)
    with pytest.raises(
        ConfigError,
        match=r"^budget: trainer.max_steps=20 is scaled by the budget, but "
        r"trainer.max_epochs=2 ends the run first, after 10 steps \(5 an epoch\).*max_epochs=-1$",
    ):
        check_budget_length(["max_steps"], limits, 5)
    check_budget_length(["max_steps"], limits, 10)  # 2 epochs of 10: max_steps ends it
    check_budget_length(["max_steps"], SimpleNamespace(max_steps=20, max_epochs=-1), 5)
    check_budget_length(["max_steps"], SimpleNamespace(max_steps=20, max_epochs=None), 5)
    check_budget_length(["max_steps", "max_epochs"], limits, 5)  # both scaled: the budget ends it either way
    limits = SimpleNamespace(max_steps=30, max_epochs=4)
    with pytest.raises(
        ConfigError,
        match=r"^budget: trainer.max_epochs=4 \(40 steps, 10 an epoch\) is scaled.*"
        r"trainer.max_steps=30 ends the run first.*max_steps=-1$",
    ):
        check_budget_length(["max_epochs"], limits, 10)
    check_budget_length(["max_epochs"], SimpleNamespace(max_steps=-1, max_epochs=4), 10)
    check_budget_length(["max_epochs"], SimpleNamespace(max_steps=40, max_epochs=4), 10)


def test_the_app_checks_the_budget_length_with_the_loaders_steps(tmp_path):
    """The app adds BudgetLength where the config scales a length by budget; it counts an epoch's optimizer steps as
    Lightning does (the last, partial accumulation steps too)."""
    cfg = compose_train(
        ["budget=0.5", 'trainer.max_steps="${effi_scale:40,${budget}}"', "trainer.max_epochs=2"], tmp_path
    )
    assert budget_lengths(cfg) == ["max_steps"]
    callback = BudgetLength(budget_lengths(cfg))
    module = SimpleNamespace(automatic_optimization=True)
    trainer = SimpleNamespace(max_steps=20, max_epochs=2, num_training_batches=9, accumulate_grad_batches=2)
    with pytest.raises(ConfigError, match=r"after 10 steps \(5 an epoch\)"):
        callback.on_train_start(trainer, module)
    trainer.num_training_batches = 19  # 10 steps an epoch: max_steps=20 ends it
    callback.on_train_start(trainer, module)
    trainer.num_training_batches = float("inf")  # a loader without a length: not known
    callback.on_train_start(trainer, module)
    trainer.num_training_batches, module.automatic_optimization = 9, False  # the module's own steps
    callback.on_train_start(trainer, module)


def _header_commands(bench: str) -> list[tuple[list[str], str]]:
    """The ``python experiments/train.py ...`` commands of a bench file's header: (overrides, trailing comment),
    line continuations joined."""
    commands: list[tuple[list[str], str]] = []
    current: list[str] | None = None
    for line in (CONF / "bench" / f"{bench}.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        text, _, comment = line[1:].partition("  # ")
        text = text.strip().rstrip("\\").strip()
        if text.startswith("python experiments/train.py "):
            current = text.removeprefix("python experiments/train.py ").split()
            commands.append((current, comment))
        elif current is not None:
            current.extend(text.split())
            commands[-1] = (current, comment)
        if not line.split("  # ")[0].rstrip().endswith("\\"):
            current = None
    return commands


@pytest.mark.parametrize("bench", BENCHES)
def test_header_commands_compose_and_the_tiny_one_is_tiny(bench, tmp_path):
    commands = _header_commands(bench)
    assert [f"bench={bench}"] in [c for c, _ in commands]
    assert sum("tiny" in comment for _, comment in commands) == 1
    _, key, _, _ = EXPECTED[bench]
    arms = _sweep(_compose(tmp_path, bench))[0]
    for command, comment in commands:
        for arm in arms:
            cfg = compose_train([*command, f"arm={arm}"], tmp_path, fast=False)
            OmegaConf.to_container(cfg.trainer, resolve=True)  # every key exists and every length resolves
            OmegaConf.to_container(cfg.callbacks, resolve=True)
            if "tiny" in comment:
                assert cfg.trainer[key] <= 7 and cfg.data.train_subset <= 256, (command, arm)


TINY = ["ref_steps=4", "data.train_subset=64", "trainer.val_check_interval=1", "trainer.limit_val_batches=1"]


@pytest.mark.slow
def test_tiny_bench_multirun_writes_one_record_per_job_and_the_report(tmp_path):
    has_report = importlib.util.find_spec("lightning_effi.report") is not None
    args = ["-m", "bench=gpt_stack", *TINY, "arm=baseline_50,technique", "seed=0,1"]
    if not has_report:
        args.append("~hydra.callbacks.report")
    proc = run_train_script(args, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweeps = list(tmp_path.glob("logs/bench_gpt_stack/multiruns/*"))
    assert len(sweeps) == 1
    records = [json.loads(p.read_text()) for p in sorted(sweeps[0].glob("*/result.json"))]
    assert len(records) == 4
    assert {(r["seed"], r["efficiency"]["optimizer_steps"]) for r in records} == {(0, 2), (1, 2), (0, 6), (1, 6)}
    if "arm" not in records[0]:
        pytest.skip("result.json has no arm/budget yet (lightning_effi/train.py's schema 2 is not in)")
    got = {(r["arm"], r["budget"], r["seed"], r["length"]["max_steps"]) for r in records}
    stack = "curriculum+random_ltd+vcycle"
    assert got == {("baseline", 0.5, 0, 2), ("baseline", 0.5, 1, 2), (stack, 1.5, 0, 6), (stack, 1.5, 1, 6)}
    if not has_report:
        pytest.skip("lightning_effi.report is not in yet: the sweep ran without its report callback")
    assert (sweeps[0] / "report.md").is_file() and (sweeps[0] / "quality_vs_compute.png").stat().st_size > 0
    assert stack in (sweeps[0] / "report.md").read_text()


def test_a_budget_on_a_bench_sweeps_command_line_is_refused_before_its_first_job(tmp_path):
    """In a bench each arm sets ``budget``; ``budget=0.5`` on the command line gave every arm that budget, so the
    frontier's baselines all trained one length and the report found none at the end. Refused at the sweep's
    start (the report callback's ``on_multirun_start``); one arm with budgets of its own stays allowed."""
    from lightning_effi.report.hydra_callback import ReportCallback

    cfg = _compose(tmp_path, "gpt_stack")
    assert cfg.hydra.runtime.choices.bench == "gpt_stack"

    def start(*overrides: str) -> None:
        config = OmegaConf.create(OmegaConf.to_container(cfg.hydra, resolve=False))
        config = OmegaConf.create({"hydra": config})
        config.hydra.overrides.task = ["bench=gpt_stack", *overrides]
        ReportCallback().on_multirun_start(config)

    with pytest.raises(SystemExit) as stop:
        start("budget=0.5")  # the bench's own arm list
    assert str(stop.value.code).startswith(
        "error: budget=0.5 on the command line of bench=gpt_stack replaces the budget of each of its arms "
        "(baseline_25, baseline_50, baseline_75, baseline_100, baseline_150, technique), so the frontier's baselines "
        "would all train one length; set the technique arm's with technique_budget=<fraction>"
    )
    with pytest.raises(SystemExit, match=r"its arms \(baseline_25, baseline_50\)"):
        start("arm=baseline_25,baseline_50", "budget=0.5")
    start("arm=baseline_50", "budget=0.5833,0.6667")  # baselines between the bench's budgets (vit_stack_9ep)
    start("technique_budget=0.75", "ref_steps=4")


def _start_sweep(tmp_path: Path, *overrides: str, params: dict[str, str] | None = None) -> None:
    """The report callback's ``on_multirun_start`` for ``bench=random_ltd_gpt`` with ``overrides`` on the command line,
    inside Hydra's initialized state (as when a multirun starts)."""
    from hydra import compose, initialize_config_dir

    from lightning_effi.report.hydra_callback import ReportCallback

    task = ["bench=random_ltd_gpt", *overrides]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        fixed = [o for o in task if "," not in o]
        config = compose(config_name="train", overrides=fixed, return_hydra_config=True)
        with open_dict(config):
            config.hydra.overrides.task = task
            config.hydra.job.config_name = "train"
            config.hydra.sweeper.params.update(params or {})
        ReportCallback().on_multirun_start(config)


def test_a_sweep_listing_a_value_twice_is_refused_before_its_first_job(tmp_path):
    """Two identical jobs trained, then the report refused their two runs of one arm, budget and seed and the sweep
    exited 0 without one (qa106-break 02)."""
    with pytest.raises(SystemExit) as stop:
        _start_sweep(tmp_path, "arm=baseline_50,baseline_50")
    assert str(stop.value.code) == (
        "error: arm: 'baseline_50' is listed twice in the sweep (arm=baseline_50,baseline_50): the two jobs would "
        "train the same run, and the sweep's report refuses two runs of one arm, budget and seed; list each value once"
    )
    with pytest.raises(SystemExit, match=r"^error: budget: 0.5 is listed twice in the sweep \(budget=0.5,0.5\)"):
        _start_sweep(tmp_path, "arm=baseline_50", "budget=0.5,0.5")
    with pytest.raises(SystemExit, match=r"^error: seed: 0 is listed twice in the sweep \(seed=0,1,0\)"):
        _start_sweep(tmp_path, params={"seed": "0,1,0"})
    _start_sweep(tmp_path, "arm=baseline_50", "budget=0.5,0.75", params={"seed": "0,1"})


def test_a_bad_technique_arm_is_refused_before_the_baselines_train(tmp_path):
    """A bench's technique arm comes last: technique_budget=0 or ltd_min_value=0 was refused in its own job, after
    every baseline had trained, naming budget instead of technique_budget (qa106-break 04)."""
    where = r"^error: arm=technique \(the bench's technique arm, checked before the sweep's first job\): "
    with pytest.raises(SystemExit, match=where + r"technique_budget: expected a number > 0.*got 0$"):
        _start_sweep(tmp_path, "technique_budget=0")
    with pytest.raises(
        SystemExit,
        match=where + r"technique_budget: 0.1 x the reference length 2 = 0.2 rounds to 0; "
        r"use a technique_budget >= 0.25$",
    ):
        _start_sweep(tmp_path, "technique_budget=0.1", "ref_steps=2")
    with pytest.raises(SystemExit, match=where + r"callbacks.random_ltd .*min_value must be an int >= 1, got 0"):
        _start_sweep(tmp_path, "ltd_min_value=0", "arm=baseline_50,technique")
    _start_sweep(tmp_path, "ltd_min_value=0", "arm=baseline_50,baseline_75")  # no technique arm in this sweep
    _start_sweep(tmp_path, "technique_budget=0.5", "ref_steps=2", "seed=0,1")


@pytest.mark.slow
def test_the_bench_budget_refusal_stops_the_hydra_sweep(tmp_path):
    """Hydra turns a callback's exception into a warning and runs the sweep; the refusal exits before any job."""
    proc = run_train_script(["bench=gpt_stack", "budget=0.5", "ref_steps=2"], tmp_path, timeout=300)
    assert proc.returncode != 0
    assert "error: budget=0.5 on the command line of bench=gpt_stack" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.rglob("result.json")) and not list(tmp_path.rglob(".hydra"))
