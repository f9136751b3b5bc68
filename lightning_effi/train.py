"""The Hydra training task: build DataModule, model, callbacks, loggers and Trainer from the config, fit (and
test), and write ``result.json`` to the run's output folder: the arm, budget, techniques and their settings, the
overrides, the seed, the final metrics, the efficiency summary, the validation curve against cumulative compute and
each technique's schedule (:func:`run` documents the keys; ``python -m lightning_effi.report`` compares runs).

Entry point: ``python experiments/train.py [overrides]`` (see ``conf/train.yaml`` and the README).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import pickle
import re
import sys
import typing
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_object
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError

from lightning_effi.core.accounting import EfficiencyMonitor, technique_name
from lightning_effi.core.checks import check_bool, check_choice, check_int, check_str
from lightning_effi.core.errors import DataConfigError
from lightning_effi.report.frontier import infer_mode
from lightning_effi.report.load import SCHEMA
from lightning_effi.report.record import (
    TECHNIQUE_HOOKS,
    make_record,
    save_record,
    scalar_metrics,
    technique_settings,
)
from lightning_effi.utils.instantiate import (
    ConfigError,
    budget_lengths,
    check_budget,
    check_budget_length,
    config_key,
    instantiate,
    instantiate_callbacks,
    instantiate_loggers,
    metric_mode,
    model_kwargs_from_hints,
)

# lightning 2.6.6 on torch 2.14 warns on every run about its own pytree use; nothing a user can act on
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")

#: errors shown as one line instead of a traceback (set EFFI_FULL_ERROR=1 to see the traceback)
USER_ERRORS = (ConfigError, DataConfigError, FileNotFoundError)


def build(cfg: DictConfig) -> tuple[pl.LightningDataModule, pl.LightningModule, pl.Trainer]:
    """Instantiate DataModule, model (with ``null`` arguments filled from ``datamodule.model_hints()``), callbacks,
    loggers and Trainer. Raises :class:`ConfigError` / ``DataConfigError`` naming the key or file at fault."""
    for group in ("data", "model", "trainer"):
        if group not in cfg or cfg[group] is None:
            raise ConfigError(f"{group}: missing config group; choose one with {group}=<name>")
    datamodule = instantiate(cfg.data, key="data")
    datamodule.prepare_data()
    hints = datamodule.model_hints() if hasattr(datamodule, "model_hints") else {}
    model = instantiate(cfg.model, key="model", **model_kwargs_from_hints(cfg.model, hints))
    try:  # fail before training, naming the model. key (EffiTask hooks; other modules may not have them)
        if hasattr(model, "check_data_hints"):
            model.check_data_hints(hints)
        if hasattr(model, "check_optimization"):
            model.check_optimization()
    except ValueError as err:
        raise ConfigError(str(err)) from err
    callbacks = instantiate_callbacks(cfg.get("callbacks"))
    for callback in callbacks:  # techniques that own the training loader wrap the DataModule (InfoBatch)
        wrap = getattr(callback, "wrap_datamodule", None)
        if callable(wrap):
            datamodule = wrap(datamodule)
    loggers = instantiate_loggers(cfg.get("logger"))
    if cfg.get("optimized_metric"):
        callbacks.append(MetricCheck(cfg.optimized_metric))
    callbacks.append(TrainingStarted())
    if budget_lengths(cfg):
        callbacks.append(BudgetLength(budget_lengths(cfg)))
    callbacks.append(LogRunSettings(run_params(cfg, callbacks)))
    trainer = instantiate(cfg.trainer, key="trainer", callbacks=callbacks, logger=loggers or False)
    return datamodule, model, trainer


class TrainingStarted(pl.Callback):
    """Whether this fit reached its first training batch: an error before it is a setup error (one line, exit 1),
    also in a resumed fit (whose ``global_step`` starts above 0)."""

    def __init__(self) -> None:
        self.started = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.started = True


class BudgetLength(pl.Callback):
    """At the start of training, :func:`~lightning_effi.utils.instantiate.check_budget_length`: the length the config
    scales by ``budget`` (``scaled``) must be the one that ends the run. Skipped for a training loader without a length
    and for manual optimization (its steps are the module's)."""

    def __init__(self, scaled: Sequence[str]) -> None:
        self.scaled = list(scaled)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        batches = trainer.num_training_batches
        if not pl_module.automatic_optimization or not math.isfinite(batches):
            return
        check_budget_length(self.scaled, trainer, math.ceil(int(batches) / trainer.accumulate_grad_batches))


#: the top-level key of the run's settings among a logger's hyperparameters, and the one used when the module's (or
#: DataModule's) own hyperparameters hold that key
RUN_PARAMS_KEYS = ("effi", "effi_run")


def run_params(cfg: DictConfig, callbacks: Sequence[object] = ()) -> dict[str, Any]:
    """The run's settings as logger hyperparameters: ``task_name``, ``seed``, ``arm`` (as in result.json:
    ``cfg.arm``, else ``"baseline"`` without a technique or the techniques' names joined by ``+``), ``budget``,
    ``overrides`` (Hydra's task overrides as ``{key: value}``, one parameter each: ``+sweep=x`` and ``++sweep=x`` are
    ``{"sweep": "x"}``, ``~key`` is ``{"key": "(deleted)"}``) and ``techniques`` (:func:`techniques_of`).
    :class:`LogRunSettings` logs them under ``effi``; Lightning's loggers flatten them to ``effi/seed``,
    ``effi/overrides/model.optimizer.lr``, ``effi/techniques/random_ltd/min_value`` ... (MLflow params, TensorBoard
    and CSV ``hparams.yaml``, the W&B run's config), so that the trials of a sweep logging into one MLflow store or
    W&B project can be told apart, and filtered, by their settings (one parameter per override: MLflow keeps 250
    characters of a value)."""
    techniques = techniques_of(cfg.get("callbacks"), callbacks)
    arm = cfg.get("arm") or ("+".join(sorted(techniques)) if techniques else "baseline")
    budget = cfg.get("budget", 1.0)
    overrides = {}
    for override in _overrides():
        key, _, value = override.partition("=")
        # MLflow's keys hold letters, digits, _ - . space : / only: Hydra's +, ++ and ~ prefixes are left out of the key
        # (a deletion reads "(deleted)"), and another character (a package's @) is written _
        name = re.sub(r"[^\w\-. :/]", "_", key.lstrip("+~"))
        overrides[name] = "(deleted)" if key.startswith("~") else value
    return {
        "task_name": cfg.get("task_name"),
        "seed": cfg.get("seed"),
        "arm": str(arm),
        "budget": float(budget) if budget is not None else 1.0,
        "overrides": overrides,
        "techniques": techniques,
    }


class LogRunSettings(pl.Callback):
    """Logs :func:`run_params` to each of the Trainer's loggers once, at the first ``setup`` (a logger's
    ``log_hyperparams`` writes on global rank 0 only), under ``effi`` (``effi_run`` when the module's or DataModule's
    hyperparameters hold ``effi``, which Lightning logs beside them and would replace the block with, or with MLflow
    refuse as a parameter logged twice with two values). An MLflow run resumed by ``run_id`` already holds the first
    job's parameters: a setting that differs now (the resume's ``ckpt_path`` override) is logged only where new, and
    the others are named in a warning (MLflow refuses to change a logged parameter)."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params
        self.logged = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.logged:
            return
        self.logged = True
        datamodule = getattr(trainer, "datamodule", None)
        taken = {*dict(getattr(pl_module, "hparams", {}) or {}), *dict(getattr(datamodule, "hparams", {}) or {})}
        key = next((k for k in RUN_PARAMS_KEYS if k not in taken), None)
        if key is None:
            warnings.warn(
                f"the module's hyperparameters hold {' and '.join(RUN_PARAMS_KEYS)}: the run's settings are not logged "
                "as hyperparameters (result.json records them)",
                UserWarning,
                stacklevel=2,
            )
            return
        from lightning.pytorch.loggers import MLFlowLogger

        from lightning_effi.utils.loggers import MLFlowLogger as ResumableMLFlowLogger
        from lightning_effi.utils.loggers import new_mlflow_params

        for logger in trainer.loggers:
            params = {key: self.params}
            if isinstance(logger, MLFlowLogger) and not isinstance(logger, ResumableMLFlowLogger):
                if trainer.is_global_zero:  # Lightning's own (a config naming its class): the run's settings only
                    params = new_mlflow_params(logger, params)
            logger.log_hyperparams(params)


class MetricCheck(pl.Callback):
    """Fails at the first validation when ``optimized_metric`` is not logged, instead of after a whole epoch in
    ModelCheckpoint or as a NaN in result.json. The first validation is Lightning's sanity check, before any training
    step; with ``trainer.num_sanity_val_steps=0`` (and under ``fast_dev_run``) it is the first epoch's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.checked = False

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.checked:
            return
        self.checked = True
        if self.name not in trainer.callback_metrics:
            logged = sorted(k for k in trainer.callback_metrics if not k.startswith("train/"))
            raise ConfigError(f"optimized_metric: {self.name!r} is not logged by this model; it logs {logged}")


def check_launcher(trainer: pl.Trainer) -> None:
    """Refuse a strategy that runs the fit in processes it spawns or forks (``ddp_spawn``, ``ddp_fork``,
    ``ddp_notebook``: Lightning's ``_MultiProcessingLauncher``): the app writes ``result.json`` in the launching
    process, whose EfficiencyMonitor, step count and checkpoint paths the workers do not update, so the record would
    be empty (no FLOPs, no curve, 0 steps). ``strategy=ddp`` relaunches this script once per rank, and rank 0 writes
    the record.

    Raises:
        ConfigError: naming the strategy and the one to use.
    """
    from lightning_effi.core.compat import runs_in_spawned_processes

    if runs_in_spawned_processes(trainer):
        method = getattr(trainer.strategy.launcher, "_start_method", "spawn")
        raise ConfigError(
            f"trainer.strategy: a fit in {method}ed processes ({type(trainer.strategy).__name__}, start method "
            f"{method!r}) leaves this app's record empty (the EfficiencyMonitor's totals, the curve and the step count "
            "stay in the workers); use trainer=ddp (trainer.strategy=ddp: the script runs once per rank, and rank 0 "
            "writes result.json)"
        )


#: Hydra's command-line flags that choose the config, kept (with their value) in the command of the other ranks
CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def rank_command(argv: Sequence[str], hydra_overrides: Sequence[str], task_overrides: Sequence[str]) -> list[str]:
    """The command line that runs one job of a Hydra sweep on its own (``hydra.mode=RUN``): the script, the flags
    choosing the config (:data:`CONFIG_FLAGS`), the job's Hydra overrides but its mode, and its task overrides (the
    sweep's values for this job: ``seed=1``, an Optuna trial's ``callbacks.random_ltd.min_value=32``). ``-m`` and
    the sweep's own overrides (``seed=0,1``) are left out."""
    flags: list[str] = []
    rest = list(argv[1:])
    while rest:
        arg = rest.pop(0)
        name = arg.split("=", 1)[0]
        if name in CONFIG_FLAGS:
            flags.append(arg)
            if "=" not in arg and rest:
                flags.append(rest.pop(0))
    hydra = [o for o in hydra_overrides if not o.lstrip("+~").startswith("hydra.mode=")]
    return [argv[0], *flags, *hydra, *task_overrides, "hydra.mode=RUN"]


@contextlib.contextmanager
def relaunch_this_job(trainer: pl.Trainer) -> Iterator[None]:
    """Within a Hydra sweep (``-m``, or a sweep config's ``hydra.mode: MULTIRUN``), make ``trainer=ddp`` start its
    other ranks on this job. Lightning starts them by running this script again with ``sys.argv`` and
    ``hydra.run.dir=<hydra.run.dir>`` (``_hydra_subprocess_cmd``): each rank ran a sweep of its own (its own Optuna
    study, whose trial could draw other settings than rank 0's in the same DDP job; its own sweep folder). Here
    ``sys.argv`` is :func:`rank_command` of this job and ``hydra.run.dir`` its folder while the Trainer launches,
    both put back after. Nothing changes outside a sweep, or for a strategy that starts no script."""
    from lightning_effi.core.compat import launches_rank_scripts

    if not HydraConfig.initialized() or not launches_rank_scripts(trainer):
        yield
        return
    from hydra.types import RunMode
    from omegaconf import read_write

    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN:
        yield
        return
    argv, run_dir = sys.argv, hydra.run.dir
    sys.argv = rank_command(argv, list(hydra.overrides.hydra), list(hydra.overrides.task))
    with read_write(hydra), open_dict(hydra):
        hydra.run.dir = hydra.runtime.output_dir
    try:
        yield
    finally:
        sys.argv = argv
        with read_write(hydra), open_dict(hydra):
            hydra.run.dir = run_dir


def check_testable(model: pl.LightningModule, datamodule: pl.LightningDataModule | None) -> None:
    """``test=true`` needs the model's ``test_step`` and a ``test_dataloader`` (the datamodule's or the model's):
    refused before training (Lightning would raise only after the whole fit, and the run would write no record).

    Raises:
        ConfigError: naming what is missing and the override that skips the test.
    """
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden("test_step", model):
        raise ConfigError(
            f"test: true, but {type(model).__name__} defines no test_step (Lightning would refuse the test after the "
            "whole fit); add test_step to the model, or run with test=false"
        )
    holders = [h for h in (datamodule, model) if h is not None]
    if not any(is_overridden("test_dataloader", h) for h in holders):
        names = " or ".join(type(h).__name__ for h in holders)
        raise ConfigError(f"test: true, but {names} defines no test_dataloader; add one, or run with test=false")


#: model settings the weights' names and shapes do not show, compared between a checkpoint and the model: attention
#: head counts (an int, or a list of ints per stage: timm's PVT), the experts a token is routed to, an attention
#: window, a rotary base, and a timm model's name. A name that only holds one of these words (head_lr_mult, a metric's
#: top_k) is not compared (qa65-break 03); nor is ``max_position_embeddings``: a learned position table shows in the
#: weights, and a rotary model tested at a longer context is the same model (qa67-break 08)
ARCHITECTURE_SETTINGS = (
    "n_head",
    "n_heads",
    "nhead",
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "n_kv_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_top_k",
    "moe_router_topk",
    "sliding_window",
    "attention_window",
    "window_size",
    "rope_theta",
    "model_name",
)


def _architecture_differences(saved: Any, mine: Any, prefix: str = "") -> list[str]:
    """``"key saved vs mine"`` for the model settings a checkpoint's weights do not show
    (:data:`ARCHITECTURE_SETTINGS`) that differ between the checkpoint's ``hyper_parameters`` and the model's, nested
    in ``model_kwargs`` too (a 2-head checkpoint tested as a 4-head model, qa61-ideas 04; a timm ViT's
    ``num_heads``, qa62-break 04). Other settings may differ (a resume that extends the run's ``max_epochs`` or
    ``warmup_steps``, ``dropout=0`` for a test: qa62-break 05, qa63-break 02). A setting written on one side only
    differs too (``"(not set)"``: the model's default, unknown here); write it on both sides, or on neither."""
    if not isinstance(saved, Mapping | DictConfig) or not isinstance(mine, Mapping | DictConfig):
        return []
    found = []
    for key in [*mine, *(k for k in saved if k not in mine)]:
        name = str(key)
        if key not in saved or key not in mine:
            # written on one side only: the other is the model's default, which may differ (a timm ViT saved with
            # its default 3 heads, resumed with num_heads=6, loaded the weights into the 6-head model, qa67-break 03)
            if name in ARCHITECTURE_SETTINGS:
                shown = [repr(_plain(side[key])) if key in side else "(not set)" for side in (saved, mine)]
                found.append(f"{prefix}{name} {shown[0]} vs {shown[1]}")
            continue
        other, value = saved[key], mine[key]
        if isinstance(value, Mapping | DictConfig):
            found += _architecture_differences(other, value, f"{prefix}{name}.")
        elif name in ARCHITECTURE_SETTINGS and _plain(other) != _plain(value):
            found.append(f"{prefix}{name} {_plain(other)!r} vs {_plain(value)!r}")
    return found


def _plain(value: Any) -> Any:
    """A setting as plain Python (an OmegaConf list as a list, a tuple as a list) for comparing."""
    if isinstance(value, ListConfig):
        value = OmegaConf.to_container(value)
    return list(value) if isinstance(value, list | tuple) else value


def check_checkpoint(path: str, model: pl.LightningModule) -> None:
    """Fail before training when ``ckpt_path`` is unreadable or holds weights of another model (named, with the
    first differing parameters), or of one whose settings the weights do not show differ (a head count:
    :func:`_architecture_differences`)."""
    if not os.path.isfile(path):
        raise ConfigError(f"ckpt_path: '{path}' does not exist or is not a file")
    try:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:  # objects beside the weights (an OmegaConf node among the hyperparameters):
            # the resume itself unpickles the whole file (Lightning loads it with weights_only=False), so may this
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        weights = checkpoint["state_dict"]
    except Exception as err:  # torch raises many types for a damaged file
        raise ConfigError(
            f"ckpt_path: '{path}' is not a readable Lightning checkpoint ({type(err).__name__}: {err})"
        ) from err
    mine = model.state_dict()
    missing = sorted(set(mine) - set(weights))
    unexpected = sorted(set(weights) - set(mine))
    shapes = [
        f"{k} {tuple(weights[k].shape)} vs {tuple(v.shape)}"
        for k, v in mine.items()
        if k in weights and tuple(weights[k].shape) != tuple(v.shape)
    ]
    # a setting of the architecture the weights' names and shapes do not show: n_head (qa61-ideas 04: a 2-head
    # checkpoint tested as a 4-head model)
    saved = checkpoint.get("hyper_parameters")
    settings = _architecture_differences(saved, getattr(model, "hparams", {}))
    if missing or unexpected or shapes or settings:
        detail = "; ".join(
            filter(
                None,
                [
                    f"missing {missing[:3]}" if missing else "",
                    f"unexpected {unexpected[:3]}" if unexpected else "",
                    f"shape (checkpoint vs model) {shapes[:3]}" if shapes else "",
                    f"model settings (checkpoint vs model) {settings[:3]}" if settings else "",
                ],
            )
        )
        raise ConfigError(
            f"ckpt_path: '{path}' holds weights of a different model ({detail}); resume with the "
            "model and data settings it was written with"
        )


#: ``result.json``'s format version (2: arm, budget, techniques, overrides, length, curve, schedule, relative paths)
RESULT_SCHEMA = SCHEMA

#: the compute quantities an objective may read (``efficiency[<q>_saved_frac]``)
OBJECTIVE_COMPUTE = ("flops", "tokens", "samples", "layer_tokens")


def techniques_of(callbacks_cfg: Any, callbacks: Sequence[object] = ()) -> dict[str, dict[str, Any]]:
    """The technique callbacks of a ``callbacks`` config (a dict of ``_target_`` nodes), ``{name: resolved
    settings}``, named as the EfficiencyMonitor names their savings (``infobatch``, ``curriculum``, ``random_ltd``,
    ``vcycle``). A technique is a callback class with an ``effi_adjust``, ``effi_baseline`` or ``effi_schedule_state``
    hook; the EfficiencyMonitor and Lightning's own callbacks are not.

    A node's class is its ``_target_`` (a class, a classmethod factory, a function annotated to return a class), or,
    for a factory that says nothing of what it builds, the class of the callback among ``callbacks`` (the Trainer's)
    that :func:`~lightning_effi.utils.instantiate.instantiate_callbacks` built from it.

    A node whose ``_target_`` is a factory also records, under ``"built"``, the settings of the callback it built
    (:func:`~lightning_effi.report.record.technique_settings`): the node alone may name only a file
    (``parse_deepspeed_config(<path>)``), and two sweeps made by editing that file would read as one arm."""
    out: dict[str, dict[str, Any]] = {}
    if not callbacks_cfg:
        return out
    built = {key: c for c in callbacks if (key := config_key(c)) is not None}
    for key, node in callbacks_cfg.items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        target = _target_object(str(node._target_))
        instance = built.get(str(key))
        cls = _target_class(target) or (type(instance) if instance is not None else None)
        if cls is None or not _is_technique(cls):
            continue
        settings: dict[str, Any] = OmegaConf.to_container(node, resolve=True)  # type: ignore[assignment]
        if not isinstance(target, type) and instance is not None and isinstance(instance, cls):
            settings["built"] = technique_settings(instance)
        out[technique_name(cls)] = settings
    return out


def _is_technique(cls: type) -> bool:
    return not issubclass(cls, EfficiencyMonitor) and any(hasattr(cls, h) for h in TECHNIQUE_HOOKS)


def _target_object(target: str) -> object:
    """The object a ``_target_`` names (None where it does not import)."""
    try:
        return get_object(target)  # instantiation already succeeded, so the target exists
    except Exception:
        return None


def _target_class(obj: object) -> type | None:
    """The class a ``_target_``'s object builds: the class itself, the class of a classmethod factory
    (``lightning_effi.Curriculum.from_config``), or the class a function's return annotation names; None otherwise.
    """
    if obj is None:
        return None
    if isinstance(obj, type):
        return obj
    if inspect.ismethod(obj) and isinstance(obj.__self__, type):
        return obj.__self__
    try:
        returned = typing.get_type_hints(obj).get("return") if callable(obj) else None
    except Exception:  # an annotation that does not resolve
        return None
    return returned if isinstance(returned, type) else None


def _overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _relative(path: str | os.PathLike[str] | None, start: str | os.PathLike[str]) -> str | None:
    return os.path.relpath(path, start) if path else None


def _check_sweep_direction(cfg: DictConfig, setting: Any) -> None:
    """A sweeper's ``direction`` (Optuna's ``minimize`` / ``maximize``) must fit what :func:`objective` returns: the
    metric itself (``minimize`` for ``optimized_mode: min``) or a saving (``maximize``); the other direction would
    pick the worst trial as the best, silently.

    Raises:
        ConfigError: the direction contradicts the objective, naming ``hydra.sweeper.direction`` and the value to use.
    """
    if not HydraConfig.initialized():
        return
    direction = OmegaConf.select(HydraConfig.get(), "sweeper.direction", default=None)
    if not isinstance(direction, str):  # absent, or a list (a multi-objective study: the user's own)
        return
    kind = setting.get("kind", "metric") if isinstance(setting, DictConfig) else "metric"
    mode = cfg.get("optimized_mode", "min")
    if kind == "metric":
        expected, what = ("minimize" if mode == "min" else "maximize"), f"{cfg.get('optimized_metric')} ({mode})"
    else:
        expected, what = "maximize", "the saving at the floor"
    if direction.lower() != expected:
        raise ConfigError(
            f"hydra.sweeper.direction={direction} contradicts the objective: objective.kind={kind} returns {what}, "
            f"so the sweep would keep the worst trial as its best; set hydra.sweeper.direction={expected}"
        )


def check_objective(cfg: DictConfig) -> tuple[str, float] | None:
    """``cfg.objective`` checked before training: None for the metric, else ``(compute, floor)`` of
    ``saving_at_floor`` (:func:`objective`).

    Raises:
        ConfigError: an unknown key, ``kind`` or ``compute``, or a ``floor`` that is not a finite number.
    """
    setting = cfg.get("objective")
    _check_sweep_direction(cfg, setting)
    if setting is None:
        return None
    if not isinstance(setting, DictConfig):
        raise ConfigError(f"objective: expected a mapping with kind, compute, floor; got {setting!r}")
    unknown = sorted(set(setting) - {"kind", "compute", "floor"})
    if unknown:
        raise ConfigError(f"objective: unknown keys {unknown}; allowed: kind, compute, floor")
    kind = setting.get("kind", "metric")
    if kind == "metric":
        return None
    if kind != "saving_at_floor":
        raise ConfigError(f"objective.kind: expected 'metric' or 'saving_at_floor', got {kind!r}")
    compute = setting.get("compute", "flops")
    if compute not in OBJECTIVE_COMPUTE:
        raise ConfigError(f"objective.compute: expected one of {list(OBJECTIVE_COMPUTE)}, got {compute!r}")
    floor = setting.get("floor")
    if isinstance(floor, bool) or not isinstance(floor, int | float) or not math.isfinite(floor):
        metric = cfg.get("optimized_metric")
        raise ConfigError(f"objective.floor: expected a finite number (in {metric}'s units), got {floor!r}")
    return str(compute), float(floor)


def objective(cfg: DictConfig, result: dict[str, Any]) -> float:
    """The value returned to a Hydra sweeper, as ``cfg.objective`` says:

    - absent, or ``kind: metric``: the final ``optimized_metric`` (NaN when it was not logged);
    - ``kind: saving_at_floor``: the run's ``efficiency["<compute>_saved_frac"]`` (its saving against the same run
      without the techniques, ``compute`` one of :data:`OBJECTIVE_COMPUTE`, default ``flops``) when the final
      metric meets ``floor`` (``<= floor`` for ``optimized_mode: min``, ``>= floor`` for ``max``), else -1.0: for a
      sweeper maximizing the saving at a quality floor (``conf/sweep/``).

    Raises:
        ConfigError: an unknown ``kind`` or ``compute``, a ``floor`` that is not a number, or a run without an
            EfficiencyMonitor (no saving to read).
    """
    setting = check_objective(cfg)
    if setting is None:
        return float(result["metric"])
    compute, floor = setting
    key = f"{compute}_saved_frac"
    if key not in result["efficiency"]:
        raise ConfigError("objective: saving_at_floor reads the EfficiencyMonitor's summary; add callbacks.efficiency")
    metric = float(result["metric"])
    met = metric <= floor if cfg.get("optimized_mode", "min") == "min" else metric >= floor
    return float(result["efficiency"][key]) if met else -1.0


#: the Trainer's integer settings checked before anything is built: ``key: (minimum, None allowed)`` (Lightning
#: compares them with ints, so a string such as ``ten`` would fail with a TypeError that names no key)
TRAINER_INTS: dict[str, tuple[int, bool]] = {
    "max_steps": (-1, False),
    "max_epochs": (-1, True),
    "min_steps": (0, True),
    "min_epochs": (0, True),
    "check_val_every_n_epoch": (1, True),
    "log_every_n_steps": (1, True),
    "accumulate_grad_batches": (1, False),
    "num_sanity_val_steps": (-1, True),
}


def _resolve_mode(cfg: DictConfig) -> None:
    """``optimized_mode`` checked against ``optimized_metric``'s name, and set from it when null (see
    :func:`check_settings`)."""
    metric = cfg.get("optimized_metric")
    try:
        mode = cfg.get("optimized_mode", "min")
    except InterpolationResolutionError as err:  # the default, ${effi_mode:...}: a name that says neither
        message = str(err).partition("\n")[0]
        raise ConfigError(message.removeprefix("ValueError raised while resolving interpolation: ")) from None
    if mode is not None:
        check_choice("", "optimized_mode", mode, ("min", "max"), error=ConfigError)
    inferred = infer_mode(metric) if metric else None
    if mode is None:  # optimized_mode=null: read from the name, as the default ${effi_mode:...} does
        try:
            resolved = metric_mode(metric)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        with open_dict(cfg):
            cfg.optimized_mode = resolved
    elif inferred is not None and mode != inferred:
        raise ConfigError(
            f"optimized_mode={mode} contradicts optimized_metric={metric}, whose name says "
            f"{'lower' if inferred == 'min' else 'higher'} is better: the checkpoint callback would keep the worst "
            f"weights and the report would rank the runs backwards; set optimized_mode={inferred} (or null: read "
            "from the name)"
        )


def run_tags(cfg: DictConfig) -> list[str]:
    """The run's ``tags`` as a list of strings: a list of strings or numbers (``tags=[a,b]``), one string or number
    (``tags=mytag``: one tag, not its characters), or null (none).

    Raises:
        ConfigError: naming ``tags``, the value and what is allowed.
    """
    tags = cfg.get("tags")
    if tags is None:
        return []
    if isinstance(tags, str | int | float) and not isinstance(tags, bool):
        return [str(tags)]
    if isinstance(tags, ListConfig | list | tuple) and all(
        isinstance(t, str | int | float) and not isinstance(t, bool) for t in tags
    ):
        return [str(t) for t in tags]
    raise ConfigError(f"tags: expected a list of strings (tags='[a,b]'), one string (tags=a) or null, got {tags!r}")


def check_settings(cfg: DictConfig) -> None:
    """The run's own keys and the Trainer's lengths, checked at the start of :func:`run` (before anything is built):
    ``train`` and ``test`` are bools (a string ``'no'`` or ``'false'`` would be true), ``optimized_metric`` a string
    (or null), ``optimized_mode`` ``min``, ``max`` or null (set here from the metric's name:
    :func:`~lightning_effi.report.frontier.infer_mode`, ``min`` for a loss, ``max`` for an accuracy) and not
    contradicting the metric's name, and the integer settings of ``trainer`` (:data:`TRAINER_INTS`: ``max_steps``,
    ``max_epochs``, ...) are ints in range.

    Raises:
        ConfigError: naming the key, the value and what is allowed; ``optimized_mode`` null for a metric whose name
            says neither direction, or ``optimized_mode`` against the metric's name (``min`` for ``val/acc``: the
            checkpoint callback would keep the worst weights and the report would rank the runs backwards).
    """
    for key, default in (("train", True), ("test", False)):
        check_bool("", key, cfg.get(key, default), error=ConfigError)
    check_str("", "optimized_metric", cfg.get("optimized_metric"), none_ok=True, error=ConfigError)
    _resolve_mode(cfg)
    run_tags(cfg)
    trainer = cfg.get("trainer")
    if not isinstance(trainer, DictConfig):
        return  # build() names the missing group
    for key, (minimum, none_ok) in TRAINER_INTS.items():
        if key not in trainer:
            continue
        value = trainer.get(key)
        if value is None and none_ok:
            continue
        check_int("trainer", key, value, minimum, error=ConfigError)
    if trainer.get("max_steps") == 0 and cfg.get("train", True):
        # a run of 0 steps: the LR schedule's error named its own total_steps, or, without one, an empty record was
        # written as a training run (qa58-args 09)
        raise ConfigError("trainer.max_steps=0 trains nothing: give an int >= 1, or -1 (max_epochs bounds the run)")
    if trainer.get("max_epochs") == 0 and cfg.get("train", True):
        # the same empty record written as a training run (qa60-break 03)
        raise ConfigError("trainer.max_epochs=0 trains nothing: give an int >= 1, or -1 (max_steps bounds the run)")
    limit = trainer.get("limit_train_batches")
    if cfg.get("train", True) and not isinstance(limit, bool) and isinstance(limit, int | float) and limit == 0:
        # it failed with the LR schedule's "total_steps must be a positive int ... got -1" (qa60-break 03)
        raise ConfigError(
            f"trainer.limit_train_batches={limit!r} trains nothing: give an int >= 1 (batches an epoch), a fraction "
            "in (0, 1] of the training set, or null (all of it)"
        )
    clip = trainer.get("gradient_clip_val")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, int | float) or not clip >= 0):
        # Lightning skips clipping at a value <= 0: a sign typo (-1 for 1.0) would train unclipped without a word
        raise ConfigError(f"trainer.gradient_clip_val: expected a number >= 0 (0 or null: no clipping), got {clip!r}")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train (and optionally test) as configured; returns the result dict that is also written to
    ``<paths.output_dir>/result.json`` on rank 0.

    Keys: ``schema`` (:data:`RESULT_SCHEMA`), ``task_name``, ``tags``, ``seed``, ``arm`` (``cfg.arm``; default
    ``"baseline"`` without a technique, else the techniques' names joined by ``+``), ``budget`` (``cfg.budget``, the
    fraction of the experiment's reference length; default 1.0), ``techniques`` (:func:`techniques_of`),
    ``overrides`` (Hydra's task overrides), ``optimized_metric``, ``optimized_mode``, ``metric`` (its final value),
    ``metrics``, ``efficiency`` (the EfficiencyMonitor's summary), ``length`` (``max_steps``, ``max_epochs``,
    ``optimizer_steps``), ``curve`` and ``schedule`` (the monitor's records: metrics and technique states against
    cumulative samples, tokens, layer-tokens, FLOPs and train wall time), ``output_dir`` (relative to
    ``paths.root_dir``), ``last_checkpoint`` and ``best_checkpoint`` (relative to ``output_dir``). Non-finite
    numbers are written as null.

    Raises:
        ConfigError: before anything is built: a ``seed`` or ``budget`` out of range, an unused ``budget``, a bad
            ``objective``, or a setting :func:`check_settings` refuses; then what :func:`build` and the Trainer's
            setup refuse (naming the key); ``test=true`` with a model or data without a test step / loader
            (:func:`check_testable`), a spawning strategy (:func:`check_launcher`), before training."""
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError(f"seed: expected an int in [0, 2**32), got {seed!r}")
    budget = cfg.get("budget", 1.0)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int | float) or not budget > 0):
        raise ConfigError(f"budget: expected a number > 0 (a fraction of the reference length), got {budget!r}")
    check_budget(cfg)  # a budget the config does not use would train the full length under a budget's label
    check_settings(cfg)  # resolves optimized_mode, which the objective's check reads
    saving_objective = check_objective(cfg)
    pl.seed_everything(seed, workers=True)
    datamodule, model, trainer = build(cfg)
    check_launcher(trainer)
    if saving_objective is not None and not any(isinstance(c, EfficiencyMonitor) for c in trainer.callbacks):  # type: ignore[attr-defined]
        raise ConfigError(
            "objective: saving_at_floor reads the EfficiencyMonitor's summary, and this run has none; add "
            "callbacks.efficiency (or use objective.kind=metric)"
        )
    if cfg.get("test", False):
        check_testable(model, datamodule)
    if cfg.get("ckpt_path"):
        check_checkpoint(str(cfg.ckpt_path), model)
        if not cfg.get("train", True) and not cfg.get("test", False):
            raise ConfigError(
                f"ckpt_path={cfg.ckpt_path} with train=false and test=false: nothing would read the checkpoint; set "
                "test=true to evaluate it, or train=true to resume from it"
            )
    elif not cfg.get("train", True):
        # test=true tested freshly built weights (test/loss = ln(vocab)) recorded as a baseline, test=false did
        # nothing; both exited 0 (qa58-args 06)
        raise ConfigError(
            "train=false without ckpt_path: there is no trained model to "
            + ("test (test=true would test freshly built weights)" if cfg.get("test", False) else "use")
            + "; set ckpt_path=<a checkpoint> with test=true to evaluate it, or train=true"
        )
    output_dir = Path(cfg.paths.output_dir)
    if trainer.is_global_zero:
        output_dir.mkdir(parents=True, exist_ok=True)
        stale = output_dir / "result.json"
        if cfg.get("train", True) and stale.exists():  # an earlier run's record here: never read as this run's
            stale.replace(output_dir / "result.previous.json")
            print(f"Moved the earlier run's record to {output_dir / 'result.previous.json'}", flush=True)
        job_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])  # Hydra's own part: see .hydra/
        OmegaConf.save(job_cfg, output_dir / "config.yaml", resolve=True)

    with relaunch_this_job(trainer):  # trainer=ddp in a sweep: the other ranks run this job, not a sweep of theirs
        if cfg.get("train", True):
            started = next(c for c in trainer.callbacks if isinstance(c, TrainingStarted))  # type: ignore[attr-defined]
            try:
                trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
            except (ValueError, TypeError, MisconfigurationException) as err:
                if started.started or isinstance(err, ConfigError):
                    raise
                # raised while setting up (callback/strategy checks, configure_optimizers, a resume's checks), before
                # this fit's first training batch
                raise ConfigError(str(err)) from err
        metrics = scalar_metrics(dict(trainer.callback_metrics))
        if cfg.get("test", False):
            # without a fit, test the weights of ckpt_path (lightning-hydra-template's eval); after one, the final
            # weights
            weights = None if cfg.get("train", True) else cfg.get("ckpt_path")
            test_results = trainer.test(model, datamodule=datamodule, ckpt_path=weights, verbose=False)
            for results in test_results:
                metrics.update(scalar_metrics(results))

    techniques = techniques_of(cfg.get("callbacks"), trainer.callbacks)  # type: ignore[attr-defined]
    budget = cfg.get("budget", 1.0)
    root = cfg.paths.get("root_dir") or os.getcwd()
    result = make_record(
        trainer,
        run_dir=output_dir,
        output_dir=_relative(output_dir, root),
        task_name=cfg.get("task_name"),
        tags=run_tags(cfg),
        seed=cfg.get("seed"),
        arm=str(cfg.get("arm")) if cfg.get("arm") else None,
        budget=float(budget) if budget is not None else 1.0,
        techniques=techniques,
        overrides=_overrides(),
        metric=cfg.get("optimized_metric"),
        mode=cfg.get("optimized_mode", "min"),
        metrics=metrics,
        length={"max_steps": cfg.trainer.get("max_steps"), "max_epochs": cfg.trainer.get("max_epochs")},
    )
    # an evaluation (train=false) is no training run: its record, without a fit's efficiency figures, made the
    # report of its folder fail (qa58-args 08); it is written beside, as eval.json
    name = "result.json" if cfg.get("train", True) else "eval.json"
    save_record(trainer, result, output_dir, name)  # strict JSON: NaN/inf become null
    if trainer.is_global_zero:
        shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.startswith(("val/", "test/")))
        print(f"Final metrics: {shown or 'none (no validation ran)'}\nResults: {output_dir / name}", flush=True)
    return result


def main(cfg: DictConfig) -> float:
    """Hydra task function: :func:`run`, with configuration mistakes reported as one line (exit status 1).
    Returns :func:`objective` (by default the optimized metric) for sweepers."""
    environment = {key: os.environ.get(key) for key in DDP_ENVIRONMENT}
    failed = True
    try:
        try:
            result = run(cfg)
            failed = False
            return objective(cfg, result)
        except InterpolationResolutionError as exc:
            raise _user_error_of(exc) or exc from exc
    except USER_ERRORS as exc:
        if os.environ.get("EFFI_FULL_ERROR") == "1":
            raise
        raise SystemExit(f"error: {exc}\n(set EFFI_FULL_ERROR=1 for the traceback)") from None
    finally:
        _finish_wandb()
        _end_job_processes(environment, failed)


#: what Lightning's DDP launcher sets in the launching process's environment for the ranks it starts
DDP_ENVIRONMENT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK")


def _end_job_processes(environment: Mapping[str, str | None], failed: bool) -> None:
    """The end of a job of a Hydra sweep trained with ``trainer=ddp``: end its rank processes and their watchdog
    (:func:`~lightning_effi.core.compat.end_rank_processes`; after a ``failed`` job the watchdog killed this process
    while it trained the next job, and the next job's rank 1 hung), its process group, and put back the environment
    the launcher set, so that the next job starts its own ranks (:func:`relaunch_this_job`). Lightning keeps a
    process group for the life of the process: the next job's rank 0 kept the last job's, whose rank 1 had exited,
    and the next rank 1 could not join it."""
    if not HydraConfig.initialized():
        return
    from hydra.types import RunMode

    if HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    from lightning_effi.core.compat import end_rank_processes

    end_rank_processes(failed)  # none when the job started no ranks
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in environment.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _user_error_of(exc: InterpolationResolutionError) -> ConfigError | None:
    """A configuration mistake raised inside a resolver (``${effi_scale:${ref_steps},${budget}}`` with
    ``ref_steps=2.5``), as a :class:`ConfigError` naming the key being resolved; None for any other error."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, USER_ERRORS):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    key = getattr(exc, "full_key", None)
    return ConfigError(f"{key}: {cause}" if key else str(cause))


def _finish_wandb() -> None:
    """Close the W&B run of this job: Lightning's WandbLogger reuses an open run, so without this every later job of
    a multirun would log into the first job's run."""
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


if __name__ == "__main__":
    # `python -m lightning_effi.train <overrides>` did nothing and exited 0 (qa58-args 01): the same app as
    # experiments/train.py, with the repository's conf/
    import hydra as _hydra

    _CONF = str(Path(__file__).resolve().parents[1] / "conf")
    _hydra.main(version_base="1.3", config_path=_CONF, config_name="train")(main)()
