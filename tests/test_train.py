"""The Hydra training app end to end: result.json, resume, sweeps, and one-line errors for bad input."""

import json

import pytest
import torch

from lightning_effi.train import main, run
from lightning_effi.utils.instantiate import ConfigError
from tests.helpers.hydra import CONF, compose_train, run_train_script


def test_main_job_writes_result_json(tmp_path):
    cfg = compose_train([], tmp_path)  # the default experiment: GPT-2 on the stdlib corpus
    result = run(cfg)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["optimized_metric"] == "val/loss" and saved["metric"] == pytest.approx(result["metric"])
    assert 0 < saved["metric"] < 20
    eff = saved["efficiency"]
    bs, block, layers = cfg.data.batch_size, cfg.data.block_size, cfg.model.n_layer
    assert (
        eff["samples"] == 3 * bs and eff["tokens"] == 3 * bs * block and eff["layer_tokens"] == 3 * bs * block * layers
    )
    assert eff["flops"] > 0 and saved["flops"] == eff["flops"]
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert (tmp_path / "csv" / "metrics.csv").exists()


def test_resume_from_last_checkpoint_continues(tmp_path):
    first = run(
        compose_train(
            ["trainer.max_steps=3", "trainer.max_epochs=-1", "++trainer.limit_train_batches=null"], tmp_path / "a"
        )
    )
    ckpt = tmp_path / "a" / first["last_checkpoint"]  # relative to the run's folder
    torch.load(ckpt, weights_only=True)
    cfg = compose_train(
        ["trainer.max_steps=5", "trainer.max_epochs=-1", "++trainer.limit_train_batches=null", f"ckpt_path={ckpt}"],
        tmp_path / "b",
    )
    second = run(cfg)
    assert second["efficiency"]["optimizer_steps"] == 5
    assert second["efficiency"]["batches"] == 5  # accounting totals continue across the resume


def test_train_false_test_true_evaluates_the_checkpoint(tmp_path):
    """``train=false test=true ckpt_path=<ckpt>`` (lightning-hydra-template's eval) tested the freshly built,
    untrained model: test/loss = ln(vocab) written as the result. It now tests the checkpoint's weights, which give the
    trained run's figure; ``train=false test=false`` with a checkpoint is refused (nothing would read it)."""
    steps = ["trainer.max_steps=3", "trainer.max_epochs=-1", "++trainer.limit_train_batches=null", "test=true"]
    first = run(compose_train(steps, tmp_path / "a"))
    ckpt = tmp_path / "a" / first["last_checkpoint"]
    again = run(compose_train(["train=false", "test=true", f"ckpt_path={ckpt}"], tmp_path / "b"))
    assert again["metrics"]["test/loss"] == pytest.approx(first["metrics"]["test/loss"], rel=1e-6)
    # the evaluation's record is no training run's: written as eval.json, so the report of the folder holding both
    # reads the training run (an evaluation's result.json made it fail, qa58-args 08)
    assert (tmp_path / "b" / "eval.json").exists() and not (tmp_path / "b" / "result.json").exists()
    from lightning_effi.report import load_runs

    assert len(load_runs([tmp_path])) == 1
    with pytest.raises(ConfigError, match=r"with train=false and test=false: nothing would read the checkpoint"):
        run(compose_train(["train=false", f"ckpt_path={ckpt}"], tmp_path / "c"))
    # without a checkpoint: an untrained model tested as a baseline, or nothing done, both exited 0 (qa58-args 06)
    for test in ("true", "false"):
        with pytest.raises(ConfigError, match=r"train=false without ckpt_path: there is no trained model"):
            run(compose_train(["train=false", f"test={test}"], tmp_path / f"d{test}"))


def test_test_true_without_a_test_step_is_refused_before_training(tmp_path):
    """``test=true`` with a model that has no ``test_step``: Lightning raised only after the whole fit, and the run
    wrote no record. Refused before training, naming the model and the override."""
    cfg = compose_train(["test=true", "model._target_=tests.helpers.tiny.GPT2WithoutTest"], tmp_path)
    with pytest.raises(
        ConfigError, match=r"^test: true, but GPT2WithoutTest defines no test_step .*run with test=false"
    ):
        run(cfg)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "result.json").exists()


def test_a_refusal_at_a_resumed_fits_start_is_a_config_error(tmp_path):
    """random-LTD added to a resumed run is refused in on_train_start, before this fit's first batch but at
    global_step 3: a ConfigError (one line from the app), not a traceback. The failed run went into the first run's
    folder: the first run's result.json is moved aside (result.previous.json), never read as the failed run's."""
    base = ["trainer.max_epochs=-1", "++trainer.limit_train_batches=null", "model.n_layer=4"]
    first = run(compose_train([*base, "trainer.max_steps=3"], tmp_path / "a"))
    ckpt = tmp_path / "a" / first["last_checkpoint"]
    ltd = ["callbacks=[default,random_ltd]", "callbacks.random_ltd.min_value=8", f"ckpt_path={ckpt}"]
    with pytest.raises(ConfigError, match="RandomLTDCallback"):
        run(compose_train([*base, "trainer.max_steps=5", *ltd], tmp_path / "a"))
    assert not (tmp_path / "a" / "result.json").exists()
    previous = json.loads((tmp_path / "a" / "result.previous.json").read_text())
    assert previous["techniques"] == {} and previous["efficiency"]["optimizer_steps"] == 3  # the first run's


@pytest.mark.slow
def test_multirun_sweep_writes_one_result_per_job(tmp_path):
    proc = run_train_script(["-m", "seed=1,2", "debug=fdr"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted(tmp_path.glob("logs/debug/multiruns/*/*/result.json"))
    assert [json.loads(p.read_text())["seed"] for p in results] == [1, 2]


#: bad input that the app stops with one line, checked in this process through the app's task function
#: (``lightning_effi.train.main``, what ``experiments/train.py`` calls): its ``SystemExit`` message is that line
APP_ERRORS = [
    (["experiment=cifar10_cnn", "model.model_name=resnet_bogus"], "model.model_name: unknown timm model"),
    (["data.text_path=/nonexistent.txt", "data.corpus=file"], "data.text_path"),
    (["data.block_size=0"], "data.block_size"),
    (["callbacks.efficiency.log_every_n_steps=0"], "log_every_n_steps"),
    (["data.block_size=300"], "model.max_length: the model takes at most 256, the data needs 300"),
    (["model.optimizer.lr=-1"], "model.optimizer"),
    (["model.optimizer.lr=abc"], "model.optimizer.lr: expected a number (its default is 0.001), got 'abc'"),
    (["model.scheduler.warmup_fraction=x"], "model.scheduler.warmup_fraction: expected a number"),
    (["model.scheduler.warmup_fraction=2"], "model.scheduler"),
    (["optimized_metric=val/los", "optimized_mode=min"], "optimized_metric: 'val/los' is not logged"),
    # without a mode, the name is read for one first: the typo is refused before anything is built
    (["optimized_metric=val/los"], "optimized_mode is read from optimized_metric's name, and 'val/los' says neither"),
    (["seed=-1"], "seed: expected an int"),
    # MLflow's client retried an unreachable server for minutes before training, naming nothing
    (
        ["logger=mlflow", "logger.mlflow.tracking_uri=http://127.0.0.1:9"],
        "logger.mlflow.tracking_uri: cannot reach the tracking server http://127.0.0.1:9 (ConnectionRefusedError",
    ),
    (["model.n_layer=abc"], "model.n_layer"),
    (
        ["experiment=sst2_infobatch", "trainer.max_epochs=-1", "++trainer.fast_dev_run=false", "trainer.max_steps=2"],
        "InfoBatchCallback needs a finite number of epochs",
    ),
    # raised inside the ${effi_scale:...} resolver: a 65-line InterpolationResolutionError before
    (["bench=random_ltd_gpt", "ref_steps=2.5"], "error: budget: the reference length must be an int >= 1 (steps"),
]


@pytest.mark.parametrize("args, message", APP_ERRORS)
def test_bad_input_stops_with_one_clear_line(tmp_path, args, message):
    with pytest.raises(SystemExit) as stop:
        main(compose_train(["debug=fdr", *args], tmp_path, fast=False))
    text = str(stop.value.code)
    assert message in text and text.startswith("error: ") and "Traceback" not in text, text
    assert text.splitlines()[1:] == ["(set EFFI_FULL_ERROR=1 for the traceback)"], text


@pytest.mark.parametrize(
    "group", [*(f"experiment={p.stem}" for p in (CONF / "experiment").glob("*.yaml")), "bench=gpt_stack"]
)
def test_an_experiments_metric_override_reads_its_mode_from_the_name(tmp_path, group):
    """The README's ``experiment=cifar10_cnn model=my_vit optimized_metric=<what it logs>`` was refused: every
    experiment and bench file set ``optimized_mode`` beside its metric, so ``optimized_metric=val/loss`` contradicted
    ``max`` (qa75-user 02). The mode is read from the metric's name, the experiment's or the override's."""
    from lightning_effi.train import _resolve_mode

    cfg = compose_train([group], tmp_path)
    _resolve_mode(cfg)
    assert cfg.optimized_mode == ("min" if "loss" in cfg.optimized_metric else "max")
    for metric, mode in (("val/loss", "min"), ("val/acc", "max")):
        cfg = compose_train([group, f"optimized_metric={metric}"], tmp_path)
        _resolve_mode(cfg)
        assert cfg.optimized_mode == mode


def test_debug_limit_refuses_a_misspelled_metric_before_training(tmp_path, monkeypatch):
    """debug=limit runs one sanity-check batch, so a metric the model does not log stops the run before its first
    training batch (it had num_sanity_val_steps=0: a whole epoch trained first)."""
    import lightning_effi.train as app

    batches: list[int] = []
    monkeypatch.setattr(app.TrainingStarted, "on_train_batch_start", lambda self, *args: batches.append(args[-1]))
    overrides = [
        "debug=limit",
        "optimized_metric=val/los",
        "optimized_mode=min",
        "data.num_workers=0",
        "+trainer.enable_progress_bar=false",
    ]
    with pytest.raises(SystemExit) as stop:
        main(compose_train(overrides, tmp_path, fast=False))
    assert str(stop.value.code).startswith("error: optimized_metric: 'val/los' is not logged by this model")
    assert batches == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [  # a data error, an override Hydra refuses, a missing file: the script's own stderr
        (["experiment=cifar10_cnn", "paths.data_dir=/nonexistent"], "error: data.root: '/nonexistent/cifar10'"),
        (["trainer.max_epoch=1"], "trainer.max_epoch"),
        (["ckpt_path=/nonexistent.ckpt"], "ckpt_path: '/nonexistent.ckpt' does not exist"),
    ],
)
def test_bad_input_stops_the_script_with_one_clear_line(tmp_path, args, message):
    proc = run_train_script(["debug=fdr", *args], tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_checkpoint_of_another_model_or_a_damaged_file_is_named(tmp_path):
    first = run(compose_train(["trainer.max_steps=1", "trainer.max_epochs=-1"], tmp_path / "a"))
    ckpt = tmp_path / "a" / first["last_checkpoint"]
    with pytest.raises(SystemExit, match="holds weights of a different model"):
        main(compose_train(["debug=fdr", f"ckpt_path={ckpt}", "model.n_layer=3"], tmp_path / "b", fast=False))
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(open(ckpt, "rb").read()[:1000])
    with pytest.raises(SystemExit, match="is not a readable Lightning checkpoint"):
        main(compose_train(["debug=fdr", f"ckpt_path={damaged}"], tmp_path / "c", fast=False))


VCYCLE_APP = [  # a tiny GPT-2 (4 layers x 32, 4 heads) with the V-cycle: level 2 trains steps 3 to 5 of 6
    "callbacks=vcycle",
    "callbacks.vcycle.e_a=2",
    "callbacks.vcycle.e_small=3",
    "model.n_layer=4",
    "model.n_embd=32",
    "model.n_head=4",
    "data.batch_size=4",
    "data.block_size=32",
    "trainer.max_steps=6",
    "trainer.max_epochs=-1",
    "++trainer.limit_train_batches=null",
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.model_checkpoint.every_n_epochs=null",
    "callbacks.model_checkpoint.save_top_k=-1",
    "callbacks.model_checkpoint.monitor=null",
]


@pytest.mark.slow
def test_resume_from_a_coarse_vcycle_checkpoint(tmp_path):
    """The app resumed from a checkpoint written while the V-cycle's level 2 trains (step 3) ends with the weights of
    the uninterrupted run; the checkpoint holds the full model's shapes (it passes the app's check against the
    configured model). Resuming it with another number of levels is one clear configuration error."""
    first = run(compose_train(VCYCLE_APP, tmp_path / "a"))
    coarse = tmp_path / "a" / "checkpoints" / "epoch000-step000003.ckpt"
    checkpoint = torch.load(coarse, weights_only=True)
    assert checkpoint["state_dict"]["model.transformer.wte.weight"].shape[1] == 32
    assert checkpoint["callbacks"]["VCycleCallback{'levels': 2, 'model_attr': 'model'}"]["level"] == 2
    second = run(compose_train([*VCYCLE_APP, f"ckpt_path={coarse}"], tmp_path / "b"))
    a, b = (torch.load(tmp_path / d / r["last_checkpoint"], weights_only=True) for d, r in zip("ab", (first, second)))
    assert a["global_step"] == b["global_step"] == 6 and a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert second["efficiency"]["vcycle/switches"] == 2 and second["efficiency"]["vcycle/final_level"] == 1
    other = [
        "callbacks.vcycle.levels=3",
        "callbacks.vcycle.e_a=1",
        "callbacks.vcycle.e_small=1",
        "callbacks.vcycle.up_leg=1",
    ]
    with pytest.raises(ConfigError, match=r"written by a V-cycle with levels=2, .*this callback has levels=3"):
        run(compose_train([*VCYCLE_APP, *other, f"ckpt_path={coarse}"], tmp_path / "c"))


def test_a_spawning_strategy_is_refused_before_training(tmp_path):
    """trainer=ddp_sim (ddp_spawn): the app writes the record in the launching process, which the spawned workers do
    not update, so result.json held no FLOPs, no curve and 0 steps. Refused before training, naming trainer=ddp."""
    with pytest.raises(ConfigError, match=r"^trainer\.strategy: a fit in spawned processes .*use trainer=ddp "):
        run(compose_train(["trainer=ddp_sim"], tmp_path))
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "result.json").exists()


def test_the_command_of_a_sweeps_other_ranks_runs_its_job_alone():
    """``trainer=ddp`` in a sweep: Lightning starts rank 1 with this script's ``sys.argv``, so it ran a sweep of its
    own (qa88-sweeps 04). The command given instead keeps the config flags and the job's overrides, and runs it in
    RUN mode."""
    from lightning_effi.train import rank_command

    argv = ["train.py", "-m", "--config-name", "train", "-cp=/conf", "seed=0,1", "+sweep=optuna_random_ltd"]
    hydra = ["hydra.sweeper.n_trials=2", "hydra.mode=MULTIRUN", "hydra.searchpath=[file:///mine]"]
    task = ["seed=1", "+sweep=optuna_random_ltd", "callbacks.random_ltd.min_value=32"]
    assert rank_command(argv, hydra, task) == [
        "train.py",
        "--config-name",
        "train",
        "-cp=/conf",
        "hydra.sweeper.n_trials=2",
        "hydra.searchpath=[file:///mine]",
        "seed=1",
        "+sweep=optuna_random_ltd",
        "callbacks.random_ltd.min_value=32",
        "hydra.mode=RUN",
    ]


def test_ddp_in_a_sweep_runs_each_job_on_both_ranks_and_one_sweep(tmp_path):
    """``-m model.optimizer.lr=1e30,2e-3 trainer=ddp``: rank 1 ran the whole sweep again (a second sweep folder; with
    Optuna, a study of its own whose trials could train other settings than rank 0's in the same DDP job,
    qa88-sweeps 04). Now each job's rank 1 runs that job, writing its log in the job's folder, and there is one
    sweep. Job 0 fails (a non-finite loss): the watchdog Lightning left behind SIGKILLed the sweep while it trained
    job 1, whose rank 1 then hung (qa89-break 07); job 1 now trains to its record, and the sweep exits 1 for job 0."""
    done = run_train_script(
        ["-m", "model.optimizer.lr=1e30,2e-3", "trainer=ddp", "debug=limit", f"paths.log_dir={tmp_path}/logs"],
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr[-3000:]  # job 0's error, not a SIGKILL (-9)
    sweeps = sorted((tmp_path / "logs").glob("*/multiruns/*"))
    assert len(sweeps) == 1, sweeps
    record = json.loads((sweeps[0] / "1" / "result.json").read_text())
    assert record["efficiency"]["samples"] == 2 * 16 * record["efficiency"]["optimizer_steps"] > 0  # both ranks
    assert (sweeps[0] / "1" / "train_ddp_process_1.log").exists()  # rank 1 ran in the job's folder
    assert not (sweeps[0] / "0" / "result.json").exists()
