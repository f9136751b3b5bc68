"""The Optuna sweep configs (``conf/sweep/``) and the W&B / MLflow logger configs (``conf/logger/``), all offline:
each sweep's search space names real keys with values its technique accepts, the app returns the saving at the
quality floor, a tiny Optuna sweep writes ``optimization_results.yaml`` with its best trial, and each logger writes
the same metrics as the CSV logger into the run folder (W&B: an offline run; MLflow: an SQLite store)."""

from __future__ import annotations

import csv
import json
import sqlite3
import struct
from collections import defaultdict
from pathlib import Path

import hydra
import lightning.pytorch as pl
import pytest
import torch
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from lightning_effi.train import ConfigError, check_objective, check_settings, main
from tests.helpers.hydra import CONF, compose_train, run_train_script

SWEEPS = sorted(p.stem for p in (CONF / "sweep").glob("optuna_*.yaml"))

#: GPT-2 (4 layers x 32, 4 heads) on the stdlib corpus: 2 training batches of 4 x 128 tokens, 2 validation batches,
#: every step logged
TINY = [
    "model.n_layer=4",
    "model.n_embd=32",
    "model.n_head=4",
    "data.batch_size=4",
    "trainer.max_epochs=1",
    "++trainer.limit_train_batches=2",
    "++trainer.limit_val_batches=2",
    "trainer.num_sanity_val_steps=0",
    "trainer.log_every_n_steps=1",
    "++trainer.enable_progress_bar=false",
]

#: per sweep: the overrides of a tiny sweep. InfoBatch prunes from the second epoch until floor(delta * 3): 3 epochs
#: of 8 samples (delta 0.8 prunes the second epoch), validated after the last
TINY_SWEEP = {
    "optuna_random_ltd": TINY,
    "optuna_infobatch": [
        *[o for o in TINY if "limit_train_batches" not in o and "max_epochs" not in o],
        "trainer.max_epochs=3",
        "data.train_subset=8",
        "trainer.check_val_every_n_epoch=3",
    ],
}

#: metrics every logger must hold, with the same (step, value) pairs as the CSV logger: the losses, the cumulative
#: FLOPs and random-LTD's schedule
LOGGED = ("train/loss", "val/loss", "effi/flops", "effi/random_ltd/reserved_length")


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network and nothing outside ``tmp_path``: W&B offline with its folders in tmp, no MLflow telemetry or
    tracking server from the environment, for this process and the app's subprocesses."""
    home = tmp_path / "home"
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DIR": str(home / "wandb"),
        "WANDB_CONFIG_DIR": str(home / "wandb_config"),
        "WANDB_CACHE_DIR": str(home / "wandb_cache"),
        "WANDB_DATA_DIR": str(home / "wandb_data"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    return home


# --- the sweep configs ----------------------------------------------------------------------------------------------


def search_space(cfg) -> dict[str, tuple[str, list]]:
    """``hydra.sweeper.params`` as ``{key: ("choice", values) or ("interval", [low, high])}``."""
    space = {}
    params = [f"{k}={v}" for k, v in cfg.hydra.sweeper.params.items()]
    for override in OverridesParser.create().parse_overrides(params):
        value = override.value()
        if isinstance(value, ChoiceSweep):
            space[override.get_key_element()] = ("choice", list(value.list))
        elif isinstance(value, IntervalSweep):
            space[override.get_key_element()] = ("interval", [value.start, value.end])
        else:
            raise AssertionError(f"{override.input_line}: neither choice() nor interval()")
    return space


def in_space(space: dict[str, tuple[str, list]], key: str, value) -> bool:
    kind, values = space[key]
    return value in values if kind == "choice" else values[0] <= value <= values[1]


def test_sweep_configs_exist():
    assert {"optuna_random_ltd", "optuna_infobatch"} <= set(SWEEPS)


@pytest.mark.parametrize("sweep", SWEEPS)
def test_sweep_config_is_an_optuna_search_of_its_technique(sweep, tmp_path):
    """The sweep composes into an Optuna TPE search (seeded, maximizing the saving at the floor) whose every key is a
    key of the composed config and whose every value (choices, interval ends) is accepted by the technique."""
    cfg = compose_train([f"+sweep={sweep}"], tmp_path)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_ == "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    assert sweeper.direction == "maximize" and sweeper.n_trials >= 8 and sweeper.n_jobs == 1
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler" and sweeper.sampler.seed == 0
    assert cfg.hydra.mode == RunMode.MULTIRUN and cfg.task_name == sweep
    assert cfg.objective.kind == "saving_at_floor" and cfg.objective.compute == "flops"
    check_settings(cfg)  # the mode: from the metric's name
    assert cfg.optimized_metric == "val/loss" and cfg.optimized_mode == "min" and 4.0 < cfg.objective.floor < 5.0
    technique = sweep.removeprefix("optuna_")
    space = search_space(cfg)
    assert space and all(key.startswith(f"callbacks.{technique}.") for key in space)
    for key, (_, values) in space.items():
        assert OmegaConf.select(cfg, key, default="missing") != "missing", f"{sweep}: {key} is not a config key"
        for value in values:
            trial = cfg.copy()
            with open_dict(trial):
                OmegaConf.update(trial, key, value)
            callback = hydra.utils.instantiate(trial.callbacks[technique])  # validates its arguments
            assert f"{key.rsplit('.', 1)[1]}={value!r}" in repr(callback), (key, value, callback)


@pytest.mark.parametrize("sweep", SWEEPS)
def test_the_optuna_sweeps_refuse_no_trials_before_the_first(sweep, tmp_path):
    """hydra.sweeper.n_trials=0 (or -1) ran no trial and ended in optuna's 'No trials are completed yet.' traceback,
    naming no setting (qa106-break 05): the sweeps' callback stops it at the multirun's start."""
    cfg = compose_train([f"+sweep={sweep}"], tmp_path)
    (check,) = [hydra.utils.instantiate(c) for c in cfg.hydra.callbacks.values() if c._target_.endswith("SweepCheck")]
    check.on_multirun_start(cfg)  # the config as shipped
    for key, value in (("n_trials", 0), ("n_trials", -1), ("n_jobs", 0)):
        bad = cfg.copy()
        OmegaConf.set_readonly(bad.hydra, False)
        with open_dict(bad):
            OmegaConf.update(bad, f"hydra.sweeper.{key}", value)
        with pytest.raises(SystemExit, match=rf"^error: hydra.sweeper.{key}: expected an int >= 1 .*, got {value}$"):
            check.on_multirun_start(bad)


@pytest.mark.parametrize("floor, met", [(100.0, True), (1.0, False)])
def test_app_returns_the_saving_when_the_floor_is_met(floor, met, tmp_path):
    """``main`` (the value the sweeper maximizes), with the random-LTD sweep's objective: the run's
    ``flops_saved_frac`` from result.json when val/loss <= floor, else -1.0 (a 2-step model is at val/loss ~7.6)."""
    cfg = compose_train(["+sweep=optuna_random_ltd", "callbacks.random_ltd.min_value=16", *TINY], tmp_path)
    with open_dict(cfg):
        cfg.objective.floor = floor
    value = main(cfg)
    result = json.loads((tmp_path / "result.json").read_text())
    assert 5.0 < result["metric"] < 10.0 and result["techniques"].keys() == {"random_ltd"}
    saving = result["efficiency"]["flops_saved_frac"]
    assert 0.05 < saving < 0.5  # 2 of 4 layers on 16 to 128 tokens of 128
    assert value == (saving if met else -1.0)


def test_a_saving_objective_without_the_monitor_is_refused_before_training(tmp_path, monkeypatch):
    """saving_at_floor reads the EfficiencyMonitor's summary: a run without it (~callbacks.efficiency) trained the
    whole first trial, then stopped the sweep. Refused after the Trainer is built, before any batch."""
    import lightning_effi.train as app

    batches: list[int] = []
    monkeypatch.setattr(app.TrainingStarted, "on_train_batch_start", lambda self, *args: batches.append(args[-1]))
    cfg = compose_train(
        ["+sweep=optuna_random_ltd", "callbacks.random_ltd.min_value=16", "~callbacks.efficiency"], tmp_path
    )
    with pytest.raises(SystemExit) as stop:
        main(cfg)
    assert str(stop.value.code).startswith(
        "error: objective: saving_at_floor reads the EfficiencyMonitor's summary, and this run has none; add "
        "callbacks.efficiency"
    )
    assert batches == [] and not (tmp_path / "result.json").exists()


@pytest.mark.parametrize("sweep", SWEEPS)
def test_a_sweep_direction_that_contradicts_the_objective_is_refused(sweep, tmp_path):
    """objective.kind=metric returns val/loss (optimized_mode: min): the sweep configs' ``direction: maximize`` would
    keep the worst trial as the best; refused before training, naming the direction to set. ``minimize`` passes, and
    so does ``maximize`` for the saving at the floor (the configs' own objective)."""
    cfg = compose_train([f"+sweep={sweep}", "objective.kind=metric"], tmp_path)
    with pytest.raises(
        ConfigError, match=r"hydra.sweeper.direction=maximize contradicts .* set hydra.sweeper.direction=minimize"
    ):
        check_objective(cfg)
    assert (
        check_objective(
            compose_train([f"+sweep={sweep}", "objective.kind=metric", "hydra.sweeper.direction=minimize"], tmp_path)
        )
        is None
    )
    assert check_objective(compose_train([f"+sweep={sweep}"], tmp_path)) is not None
    with pytest.raises(ConfigError, match=r"set hydra.sweeper.direction=maximize"):
        check_objective(compose_train([f"+sweep={sweep}", "hydra.sweeper.direction=minimize"], tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("sweep", SWEEPS)
def test_tiny_optuna_sweep_reports_its_best_trial(sweep, tmp_path):
    """3 trials through the app: ``optimization_results.yaml`` names the trial with the largest saving (each job's
    result.json), with parameters from the search space; the floor (100) is met by every trial."""
    proc = run_train_script(
        ["-m", f"+sweep={sweep}", "hydra.sweeper.n_trials=3", "objective.floor=100", *TINY_SWEEP[sweep]], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep_dir,) = tmp_path.glob(f"logs/{sweep}/multiruns/*")
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    space = search_space(compose_train([f"+sweep={sweep}"], tmp_path / "compose"))
    trials = []
    for job in sorted(sweep_dir.glob("[0-9]*")):
        result = json.loads((job / "result.json").read_text())
        assert result["metric"] <= 100
        params = {k: v for k, v in (o.split("=", 1) for o in result["overrides"]) if k in space}
        trials.append((result["efficiency"]["flops_saved_frac"], params))
    assert len(trials) == 3
    assert best["best_value"] == max(v for v, _ in trials)
    assert best["best_params"].keys() == space.keys()
    assert all(in_space(space, key, value) for key, value in best["best_params"].items()), best
    assert any(v == best["best_value"] and p == {k: str(x) for k, x in best["best_params"].items()} for v, p in trials)


# --- the logger configs ---------------------------------------------------------------------------------------------


def test_many_loggers_is_the_four_logger_configs(tmp_path):
    cfg = compose_train(["logger=many_loggers"], tmp_path)
    assert list(cfg.logger) == ["csv", "tensorboard", "wandb", "mlflow"]
    for name in cfg.logger:
        assert cfg.logger[name] == compose_train([f"logger={name}"], tmp_path).logger[name]


def test_wandb_and_mlflow_are_local_by_default(tmp_path):
    cfg = compose_train(["logger=[wandb,mlflow]"], tmp_path)
    wandb, mlflow = cfg.logger.wandb, cfg.logger.mlflow
    assert wandb._target_ == "lightning.pytorch.loggers.WandbLogger" and wandb.offline is True
    assert wandb.save_dir == str(tmp_path) and wandb.project == "lightning-effi" and wandb.name == cfg.task_name
    assert mlflow._target_ == "lightning_effi.utils.loggers.MLFlowLogger" and mlflow.run_name == cfg.task_name
    assert mlflow.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert mlflow.artifact_location == f"{tmp_path}/mlartifacts"


def csv_series(run_dir: Path) -> dict[str, set[tuple[int, float]]]:
    series: dict[str, set[tuple[int, float]]] = defaultdict(set)
    with open(run_dir / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key != "step" and value != "":
                    series[key].add((int(row["step"]), float(value)))
    return series


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file (``run-<id>.wandb``): a 7-byte file header, then records in 32 KiB
    blocks, each chunk behind a 7-byte header (crc32, uint16 length, type 1 full / 2 first / 3 middle / 4 last),
    the LevelDB log format W&B writes (wandb/core ``pkg/leveldb``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a header: the block's tail is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def wandb_series(run_file: Path) -> tuple[dict[str, set[tuple[int, float]]], list]:
    """``{metric: {(trainer/global_step, value)}}`` from a run file's history records, and all its records."""
    records = wandb_records(run_file)
    series: dict[str, set[tuple[int, float]]] = defaultdict(set)
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                if not key.startswith("_") and key != "trainer/global_step":
                    series[key].add((int(row["trainer/global_step"]), float(value)))
    return series, records


def mlflow_runs(db: Path) -> tuple[list[tuple[str, str, str]], dict[str, set[tuple[int, float]]]]:
    """The runs ``(id, name, status)`` of an MLflow SQLite store and ``{metric: {(step, value)}}`` of its runs."""
    with sqlite3.connect(db) as con:
        runs = con.execute("SELECT run_uuid, name, status FROM runs").fetchall()
        series: dict[str, set[tuple[int, float]]] = defaultdict(set)
        for key, step, value in con.execute("SELECT key, step, value FROM metrics"):
            series[key].add((int(step), float(value)))
    return runs, series


def assert_same_series(got: dict, want: dict, where: str) -> None:
    for key in LOGGED:
        assert want[key], f"{key} not in metrics.csv"
        mine, csvs = sorted(got[key]), sorted(want[key])
        assert [step for step, _ in mine] == [step for step, _ in csvs], f"{where}: {key}"
        assert [v for _, v in mine] == pytest.approx([v for _, v in csvs], rel=1e-6), f"{where}: {key}"


@pytest.mark.slow
def test_wandb_offline_run_holds_the_logged_metrics(offline, tmp_path):
    """``logger=[csv,wandb]``: one offline W&B run in the run folder, named after the task, whose history holds the
    same (step, value) pairs as metrics.csv, and ends with a clean exit; no run in WANDB_DIR or the launch folder."""
    proc = run_train_script(
        ["logger=[csv,wandb]", "callbacks=random_ltd", "callbacks.random_ltd.min_value=16", *TINY], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = tmp_path.glob("logs/train/runs/*")
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    series, records = wandb_series(run_file)
    assert_same_series(series, csv_series(run_dir), "wandb")
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "train" and run.project == "lightning-effi"
    config = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    assert config["effi"]["arm"] == "random_ltd" and config["effi"]["techniques"]["random_ltd"]["min_value"] == 16
    assert config["effi"]["overrides"]["callbacks.random_ltd.min_value"] == "16"
    assert records[-1].WhichOneof("record_type") == "exit" and records[-1].exit.exit_code == 0
    assert not list(offline.rglob("offline-run-*")) and not (tmp_path / "wandb").exists()  # not in WANDB_DIR or cwd


@pytest.mark.slow
def test_multirun_jobs_log_to_their_own_stores(offline, tmp_path):
    """``-m seed=1,2 logger=many_loggers``: each job's folder holds its own MLflow store with one finished run (a
    store named by the environment would collect every job: MLFlowLogger sets MLFLOW_TRACKING_URI) whose metrics
    are the job's metrics.csv, and its own offline W&B run."""
    proc = run_train_script(
        ["-m", "seed=1,2", "logger=many_loggers", "callbacks=random_ltd", "callbacks.random_ltd.min_value=16", *TINY],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(tmp_path.glob("logs/train/multiruns/*/[0-9]*"))
    assert [j.name for j in jobs] == ["0", "1"]
    for seed, job in zip((1, 2), jobs):
        runs, series = mlflow_runs(job / "mlflow.db")
        assert [(name, status) for _, name, status in runs] == [("train", "FINISHED")], job
        with sqlite3.connect(job / "mlflow.db") as con:  # the trial's settings tell the runs apart in one store
            params = dict(con.execute("SELECT key, value FROM params WHERE key LIKE 'effi/%'").fetchall())
        assert params["effi/seed"] == str(seed) and params["effi/arm"] == "random_ltd", params
        assert params["effi/techniques/random_ltd/min_value"] == "16"
        # one parameter per override: a joined string was cut at 250 characters, and trials differing after it
        # read the same (qa91-break 02)
        assert params["effi/overrides/seed"] == str(seed) and params["effi/overrides/logger"] == "many_loggers"
        assert params["effi/overrides/model.n_embd"] == "32"
        assert_same_series(series, csv_series(job), f"mlflow, job {job.name}")
        assert (job / "tensorboard").is_dir()
    wandb_runs = [sorted(job.glob("wandb/offline-run-*/run-*.wandb")) for job in jobs]
    for job, files in zip(jobs, wandb_runs):
        assert len(files) == 1, job
        assert_same_series(wandb_series(files[0])[0], csv_series(job), f"wandb, job {job.name}")


def test_the_run_settings_are_logged_as_hyperparameters(tmp_path):
    """The app logs the run's settings (seed, arm, budget, techniques, overrides) to every logger under ``effi/``,
    beside the module's hyperparameters: without them, the trials of a sweep sharing an MLflow store or a W&B
    project could not be told apart. CSV and TensorBoard keep them in their ``hparams.yaml``."""
    cfg = compose_train(
        ["logger=[csv,tensorboard]", "seed=3", "callbacks=random_ltd", "callbacks.random_ltd.min_value=16", *TINY],
        tmp_path,
    )
    main(cfg)
    for folder in ("csv", "tensorboard"):
        hparams = yaml.safe_load((tmp_path / folder / "hparams.yaml").read_text())
        run = hparams["effi"]
        assert (run["seed"], run["arm"], run["budget"], run["task_name"]) == (3, "random_ltd", 1.0, "train"), folder
        assert run["techniques"]["random_ltd"]["min_value"] == 16
        assert run["techniques"] == json.loads((tmp_path / "result.json").read_text())["techniques"]
        assert hparams["n_layer"] == 4  # the module's own, logged by Lightning beside them


def test_a_reachable_tracking_server_passes_the_check():
    """check_tracking_servers connects once to an http tracking_uri (a listening socket here) and lets the local
    stores through without a connection."""
    import socket

    from omegaconf import OmegaConf

    from lightning_effi.utils.instantiate import check_tracking_servers

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        target = "lightning.pytorch.loggers.MLFlowLogger"
        cfg = OmegaConf.create(
            {
                "online": {"_target_": target, "tracking_uri": f"http://127.0.0.1:{port}"},
                "local": {"_target_": target, "tracking_uri": "sqlite:///nowhere/mlflow.db"},
            }
        )
        check_tracking_servers(cfg)  # raises nothing


class _Tiny(pl.LightningModule):
    """A user's module with its own hyperparameters (``effi`` among them when asked)."""

    def __init__(self, **hparams):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)


def _fit_logging(logger, params, **hparams):
    from lightning_effi.train import LogRunSettings

    pl.Trainer(
        max_steps=1, logger=logger, callbacks=[LogRunSettings(params)], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    ).fit(_Tiny(**hparams))  # fmt: skip


def test_a_module_hyperparameter_named_like_the_run_settings_moves_them(tmp_path):
    """A module hyperparameter ``effi`` (Lightning logs it beside the run's settings) replaced the whole block in
    hparams.yaml, or made MLflow refuse the fit (qa91-break 05): the settings go under ``effi_run`` then."""
    from lightning.pytorch.loggers import CSVLogger

    params = {"seed": 42, "arm": "baseline", "overrides": {"seed": "42"}}
    for hparams, key in (({"lr": 0.1}, "effi"), ({"effi": "mine"}, "effi_run")):
        logger = CSVLogger(tmp_path, name=key)
        _fit_logging(logger, params, **hparams)
        saved = yaml.safe_load((Path(logger.log_dir) / "hparams.yaml").read_text())
        assert saved[key] == params and {k: saved[k] for k in hparams} == hparams


def test_the_apps_mlflow_logger_resumes_a_run_whose_module_hyperparameters_differ(offline, tmp_path):
    """The app's MLflow logger (Lightning's, conf/logger/mlflow.yaml): a job resumed into its run with another module
    hyperparameter (``model.weight_decay`` changed) stopped at setup with MLflow's "Changing param values is not
    allowed" and the run was marked FAILED (qa92-user 02). The first values are kept, named in a warning; the new
    ones are added."""
    from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger
    from mlflow.exceptions import MlflowException

    from lightning_effi.utils.loggers import MLFlowLogger

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = MLFlowLogger(experiment_name="e", tracking_uri=uri)
    _fit_logging(first, {"seed": 1}, weight_decay=0.1)
    again = MLFlowLogger(experiment_name="e", tracking_uri=uri, run_id=first.run_id)
    with pytest.warns(UserWarning, match=r"already holds \['weight_decay'\] with other values") as told:
        _fit_logging(again, {"seed": 1, "overrides": {"ckpt_path": "last.ckpt"}}, weight_decay=0.05, lr=0.3)
    assert sum("already holds" in str(w.message) for w in told) == 1
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        params = dict(con.execute("SELECT key, value FROM params").fetchall())
        status = con.execute("SELECT status FROM runs").fetchall()
    assert params == {"effi/seed": "1", "weight_decay": "0.1", "effi/overrides/ckpt_path": "last.ckpt", "lr": "0.3"}
    assert status == [("FINISHED",)]
    # flattened as Lightning flattens them: a list of dicts (groups/0/lr) was passed on and refused (qa93-regress 06)
    listed = MLFlowLogger(experiment_name="l", tracking_uri=uri)
    _fit_logging(listed, {"seed": 1}, groups=[{"lr": 0.1}])
    again = MLFlowLogger(experiment_name="l", tracking_uri=uri, run_id=listed.run_id)
    with pytest.warns(UserWarning, match=r"already holds \['groups/0/lr'\] with other values"):
        _fit_logging(again, {"seed": 1}, groups=[{"lr": 0.2}])
    lightnings = LightningMLFlowLogger(experiment_name="e", tracking_uri=uri, run_id=first.run_id)
    with pytest.raises(MlflowException, match="Changing param values is not allowed"):
        _fit_logging(lightnings, {"seed": 1}, weight_decay=0.2)  # why the app has its own


def test_a_resumed_mlflow_run_keeps_its_first_settings_and_adds_the_new_ones(offline, tmp_path):
    """Resuming into the same MLflow run (``logger.mlflow.run_id``) logs the run's settings again with the resume's
    own overrides (``ckpt_path``): MLflow refused the changed parameter and the fit stopped at setup (qa91-break 01,
    qa91-regress 02). The first values are kept, the differing ones named in a warning, the new ones logged."""
    from lightning.pytorch.loggers import MLFlowLogger

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = MLFlowLogger(experiment_name="e", tracking_uri=uri)
    _fit_logging(first, {"seed": 1, "overrides": {"trainer.max_steps": "1"}})
    again = MLFlowLogger(experiment_name="e", tracking_uri=uri, run_id=first.run_id)
    with pytest.warns(UserWarning, match=r"already holds \['effi/overrides/trainer.max_steps'\] with other values"):
        _fit_logging(again, {"seed": 1, "overrides": {"trainer.max_steps": "2", "ckpt_path": "last.ckpt"}})
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        params = dict(con.execute("SELECT key, value FROM params WHERE key LIKE 'effi/%'").fetchall())
    assert params == {
        "effi/seed": "1",
        "effi/overrides/trainer.max_steps": "1",
        "effi/overrides/ckpt_path": "last.ckpt",
    }
