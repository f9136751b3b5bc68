"""Hydra helpers: build callbacks and loggers from dict-keyed config groups, fill model arguments from the DataModule,
and turn configuration mistakes into one readable line (lightning-hydra-template ``src/utils/instantiators.py``)."""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import hydra
from hydra.errors import InstantiationException
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


def launch_folder() -> str:
    """``${effi_cwd:}``: the folder the app was launched from, usable everywhere in the config
    (``${hydra:runtime.cwd}`` is not set yet when a multirun resolves ``hydra.sweep.dir``): the working folder, or in
    a job that Hydra moved into its output folder (``hydra.job.chdir=true``, or unset under Hydra 1.1's defaults) the
    folder Hydra moved from (the job's folder was taken for the launch folder: the data path pointed into the run,
    qa106-break 07)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        cwd = OmegaConf.select(hydra_cfg, "runtime.cwd", default=None)
        out = OmegaConf.select(hydra_cfg, "runtime.output_dir", default=None)
        # chdir unset also moves under Hydra 1.1's defaults (an app without version_base; qa107-regress 01)
        chdir = OmegaConf.select(hydra_cfg, "job.chdir", default=None)
        moved = chdir is True or (
            chdir is None and bool(out) and os.path.realpath(os.getcwd()) == os.path.realpath(str(out))
        )
        if moved and cwd:
            return str(cwd)
    return os.getcwd()


if not OmegaConf.has_resolver("effi_cwd"):
    OmegaConf.register_new_resolver("effi_cwd", launch_folder)


class ConfigError(ValueError):
    """A configuration mistake, reported as one line naming the key (raised before training starts)."""


def scale_length(reference: Any, budget: Any) -> int:
    """The training length of a run given ``budget`` (a fraction of the experiment's reference length):
    ``round(reference * budget)`` (half up), in the reference's unit (optimizer steps or epochs).

    The frontier protocol of Kaddour et al., "No Train No Gain" (NeurIPS 2023, Sec. 3): the baseline is trained at
    several budgets, each a complete run whose LR schedule decays over its own length (the reference tasks size
    their schedules by ``trainer.estimated_stepping_batches``, so scaling ``trainer.max_steps`` or
    ``trainer.max_epochs`` scales the schedule too). Used in configs as ``${effi_scale:${ref_steps},${budget}}``.

    Raises:
        ConfigError: ``budget`` is not a finite number > 0 (booleans and strings refused), ``reference`` is not an
            int >= 1, or the product rounds to less than 1 step/epoch (names ``budget`` and both values).
    """
    if isinstance(reference, bool) or not isinstance(reference, int) or reference < 1:
        raise ConfigError(
            f"budget: the reference length must be an int >= 1 (steps or epochs, e.g. ref_steps), got {reference!r}"
        )
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise ConfigError(
            f"budget: expected a number > 0 (the fraction of the reference length this run trains, e.g. 0.5), "
            f"got {budget!r}"
        )
    length = math.floor(reference * budget + 0.5)
    if length < 1:
        raise ConfigError(
            f"budget: {budget} x the reference length {reference} = {reference * budget:g} rounds to 0; "
            f"use a budget >= {0.5 / reference:g}"
        )
    return int(length)


# ``${effi_scale:<reference length>,<budget>}``: see scale_length
if not OmegaConf.has_resolver("effi_scale"):
    OmegaConf.register_new_resolver("effi_scale", scale_length)


def metric_mode(metric: Any) -> str:
    """The direction of ``metric`` read from its name (:func:`~lightning_effi.report.frontier.infer_mode`): ``"min"``
    for a loss or perplexity, ``"max"`` for an accuracy or F1; ``"min"`` without a metric (the direction is then not
    used). Used in ``conf/train.yaml`` as ``optimized_mode: ${effi_mode:${optimized_metric}}``.

    Raises:
        ValueError: the name says neither direction (or both), naming ``optimized_mode`` and the values to set.
    """
    from lightning_effi.report.frontier import infer_mode

    if metric is None:
        return "min"
    mode = infer_mode(str(metric))
    if mode is None:
        raise ValueError(
            f"optimized_mode is read from optimized_metric's name, and {str(metric)!r} says neither lower nor higher "
            "is better (misspelled? it must be a metric the model logs); set optimized_mode=min or optimized_mode=max"
        )
    return mode


# ``${effi_mode:${optimized_metric}}``: see metric_mode
if not OmegaConf.has_resolver("effi_mode"):
    OmegaConf.register_new_resolver("effi_mode", metric_mode)


def bench_techniques(bench: Any) -> str:
    """The option of ``conf/arm/techniques/`` the technique arm includes: the bench's name. Without a bench the
    returned name states the mistake, so Hydra's "Could not find 'arm/techniques/...'" error explains it (an
    exception raised here would be swallowed by Hydra's defaults-list interpolation)."""
    if bench is None:
        return "(none: arm=technique trains the techniques of a bench; add bench=<name>, one of conf/bench/)"
    return str(bench)


# ``${effi_bench:${bench}}`` in conf/arm/technique.yaml's defaults list: see bench_techniques
if not OmegaConf.has_resolver("effi_bench"):
    OmegaConf.register_new_resolver("effi_bench", bench_techniques)


def check_budget(cfg: DictConfig) -> None:
    """Refuse a ``budget`` other than 1.0 that the config does not use: the run would train its full length while
    its record says otherwise. ``budget`` must reach ``trainer.max_steps`` or ``trainer.max_epochs`` through an
    interpolation (the bench configs: ``${effi_scale:${ref_steps},${budget}}``); a length typed on the command
    line replaces it.

    Raises:
        ConfigError: naming ``budget`` and what to do.
    """
    budget = cfg.get("budget", 1.0)
    if budget is None or budget == 1.0:
        return
    trainer = cfg.get("trainer")
    raw = OmegaConf.to_container(trainer, resolve=False) if isinstance(trainer, DictConfig) else {}
    lengths = {key: raw.get(key) for key in ("max_steps", "max_epochs")}  # type: ignore[union-attr]
    if not budget_lengths(cfg):
        raise ConfigError(
            f"budget: {budget} does not scale this run's length (trainer.max_steps={lengths['max_steps']!r}, "
            f"trainer.max_epochs={lengths['max_epochs']!r}); scale trainer.max_steps (or trainer.max_epochs) by it "
            "through the effi_scale resolver and lift the other limit: in a config file, "
            "max_steps: ${effi_scale:<reference steps>,${budget}} and max_epochs: -1 (the bench configs do, e.g. "
            "bench=gpt_stack); "
            "on the command line, quoted for Hydra inside the shell's single quotes: "
            "'trainer.max_steps=\"${effi_scale:2000,${budget}}\"' trainer.max_epochs=-1; or leave budget at 1.0"
        )


def budget_lengths(cfg: DictConfig) -> list[str]:
    """The Trainer lengths (``"max_steps"``, ``"max_epochs"``) that ``cfg.trainer`` scales by ``budget``: those given
    by an interpolation that names it (``${effi_scale:2000,${budget}}``), before it is resolved."""
    trainer = cfg.get("trainer")
    raw = OmegaConf.to_container(trainer, resolve=False) if isinstance(trainer, DictConfig) else {}
    return [k for k in ("max_steps", "max_epochs") if isinstance(v := raw.get(k), str) and "budget" in v]  # type: ignore[union-attr]


def check_budget_length(scaled: Sequence[str], trainer: Any, steps_per_epoch: int) -> None:
    """At the start of training: the length scaled by ``budget`` (``scaled``, from :func:`budget_lengths`) must be
    the one that ends the run. A ``max_epochs`` reached before a budget's ``max_steps`` (the trainer config's default
    ``max_epochs: 5`` on a small dataset), or a ``max_steps`` reached before a budget's ``max_epochs``, cuts the run
    short of its budget's length in silence, and every larger budget to that same length under its own label (the
    frontier's baselines included).

    Args:
        scaled: the budget-scaled lengths; one of them is checked against the other, unscaled, limit.
        trainer: ``max_steps`` and ``max_epochs`` as the Trainer holds them (-1: no limit).
        steps_per_epoch: optimizer steps in one epoch of the training loader (batches over the accumulation, rounded
            up: Lightning steps at an epoch's last batch).

    Raises:
        ConfigError: naming ``budget``, both limits and the steps per epoch.
    """
    if len(scaled) != 1 or steps_per_epoch <= 0:
        return
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    steps_limit = max_steps if max_steps is not None and max_steps >= 0 else None
    epochs_limit = max_epochs if max_epochs is not None and max_epochs >= 0 else None
    if steps_limit is None or epochs_limit is None:
        return
    by_epochs = epochs_limit * steps_per_epoch
    if scaled[0] == "max_steps" and by_epochs < steps_limit:
        raise ConfigError(
            f"budget: trainer.max_steps={steps_limit} is scaled by the budget, but trainer.max_epochs={epochs_limit} "
            f"ends the run first, after {by_epochs} steps ({steps_per_epoch} an epoch), short of the budget's length "
            "(every budget above it would train those steps too); set trainer.max_epochs=-1"
        )
    if scaled[0] == "max_epochs" and steps_limit < by_epochs:
        raise ConfigError(
            f"budget: trainer.max_epochs={epochs_limit} ({by_epochs} steps, {steps_per_epoch} an epoch) is scaled by "
            f"the budget, but trainer.max_steps={steps_limit} ends the run first, short of the budget's length (every "
            "budget above it would train those steps too); set trainer.max_steps=-1"
        )


def check_bench_sweep(overrides: Sequence[str], bench: Any, sweep_arms: Any) -> None:
    """A bench sweep's command line (``hydra.overrides.task``, sweep lists as typed) checked before its first job:
    in a bench each arm sets ``budget`` (``conf/arm/``: ``baseline_25`` .. ``baseline_150``, ``technique``), so a
    ``budget`` on the command line of a sweep over several arms (``arm=a,b``, or the bench's own arm list
    ``sweep_arms`` when ``arm`` is not given) gives every arm that budget: the frontier's baselines would all train
    one length. One arm with budgets of its own (``arm=baseline_50 budget=0.5833,0.6667``: baselines between the
    bench's budgets) is allowed.

    Raises:
        ConfigError: naming the override and the keys to use instead.
    """
    if not bench:
        return

    def value(key: str) -> str | None:
        found = [o.partition("=")[2] for o in overrides if o.lstrip("+~").partition("=")[0] == key]
        return found[-1] if found else None

    budget = value("budget")
    if budget is None:
        return
    arms = sweep_arm_list(overrides, sweep_arms)
    if len(arms) > 1:
        raise ConfigError(
            f"budget={budget} on the command line of bench={bench} replaces the budget of each of its arms "
            f"({', '.join(arms)}), so the frontier's baselines would all train one length; set the technique arm's "
            "with technique_budget=<fraction> and the reference length with ref_steps=<steps> (or ref_epochs), or "
            "give budgets to one arm (arm=baseline_50 budget=0.5833,0.6667: baselines between the bench's budgets)"
        )


def sweep_arm_list(overrides: Sequence[str], sweep_arms: Any) -> list[str]:
    """The arms a bench sweep trains: the command line's ``arm=a,b`` (the last ``arm`` override), else the bench's own
    list ``sweep_arms`` (``hydra.sweeper.params.arm``)."""
    found = [o.partition("=")[2] for o in overrides if o.lstrip("+~").partition("=")[0] == "arm"]
    text = found[-1] if found else str(sweep_arms or "")
    return [a.strip() for a in text.split(",") if a.strip()]


def check_sweep_duplicates(overrides: Sequence[str], sweeper_params: Mapping[str, Any] | None) -> None:
    """A basic sweep's lists checked before its first job: a value listed twice for one key
    (``arm=baseline_50,baseline_50``, ``budget=0.5,0.5``, ``seed=0,0``, on the command line or in
    ``hydra.sweeper.params``) makes two identical jobs, whose two records of one arm, budget and seed the report
    refuses to compare, after both trained.

    Raises:
        ConfigError: naming the key and the repeated value.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    lines = [*(f"{k}={v}" for k, v in (sweeper_params or {}).items()), *overrides]
    try:
        parsed = OverridesParser.create().parse_overrides(lines)
    except Exception:  # noqa: BLE001 - Hydra's own sweeper reports a line it cannot parse
        return
    for override in parsed:
        value = override.value() if override.is_sweep_override() else None
        if not isinstance(value, ChoiceSweep):
            continue
        seen: list[Any] = []
        for item in value.list:
            if item in seen:
                raise ConfigError(
                    f"{override.key_or_group}: {item!r} is listed twice in the sweep ({override.input_line}): the "
                    "two jobs would train the same run, and the sweep's report refuses two runs of one arm, budget "
                    "and seed; list each value once"
                )
            seen.append(item)


def _instantiate_group(cfg: DictConfig | None, group: str, kind: type) -> list[Any]:
    if cfg is None:
        return []
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{group}: expected a dict keyed by name, got {type(cfg).__name__}")
    objects = []
    for name, node in cfg.items():
        if node is None:  # `callbacks.<name>=null`: switched off, as `~callbacks.<name>` removes it
            continue
        if not isinstance(node, Mapping) or "_target_" not in node:
            shown = OmegaConf.to_yaml(node) if isinstance(node, Mapping) else repr(node)
            raise ConfigError(
                f"{group}.{name}: expected a config with a _target_, got {shown!r} (null or ~{group}.{name} on the "
                "command line switch it off)"
            )
        obj = instantiate(node, key=f"{group}.{name}")
        if not isinstance(obj, kind):
            raise ConfigError(f"{group}.{name}: {node['_target_']} is not a {kind.__name__}")
        try:
            CONFIG_KEYS[obj] = str(name)
        except TypeError:  # an unhashable object: not found by config_key
            pass
        objects.append(obj)
    return objects


#: the config key (``callbacks.<key>``, ``logger.<key>``) each object of :func:`instantiate_callbacks` /
#: :func:`instantiate_loggers` was built from, whatever its ``_target_`` (a class or a factory)
CONFIG_KEYS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def config_key(obj: object) -> str | None:
    """The key of the config entry ``obj`` was built from by :func:`instantiate_callbacks` /
    :func:`instantiate_loggers`, or None."""
    try:
        return CONFIG_KEYS.get(obj)
    except TypeError:
        return None


def instantiate_callbacks(cfg: DictConfig | None) -> list[Callback]:
    """Instantiate every entry of the dict-keyed ``callbacks`` group (a null entry is switched off; other entries
    without ``_target_`` are errors)."""
    return _instantiate_group(cfg, "callbacks", Callback)


def instantiate_loggers(cfg: DictConfig | None) -> list[Logger]:
    """Instantiate every entry of the dict-keyed ``logger`` group, after :func:`check_tracking_servers`."""
    check_tracking_servers(cfg)
    return _instantiate_group(cfg, "logger", Logger)


#: seconds :func:`check_tracking_servers` waits for a tracking server to accept a connection
SERVER_TIMEOUT_S = 5.0


def check_tracking_servers(cfg: DictConfig | None) -> None:
    """An MLflow logger whose ``tracking_uri`` is a server (``http://`` or ``https://``) is checked to accept a
    connection (one TCP connect, :data:`SERVER_TIMEOUT_S` at most): MLflow's client retries an unreachable server
    with backoff for minutes before the run starts, with only urllib3's retry lines to say why.

    Raises:
        ConfigError: naming ``logger.<name>.tracking_uri``, the address and the connection's error.
    """
    import socket
    from urllib.parse import urlsplit

    if not isinstance(cfg, Mapping):
        return
    for name, node in cfg.items():
        if not isinstance(node, Mapping) or not str(node.get("_target_", "")).endswith("MLFlowLogger"):
            continue
        uri = node.get("tracking_uri")
        parts = urlsplit(str(uri)) if isinstance(uri, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            continue
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            with socket.create_connection((parts.hostname, port), timeout=SERVER_TIMEOUT_S):
                pass
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"logger.{name}.tracking_uri: cannot reach the tracking server {uri} ({type(err).__name__}: {err}); "
                "start it or fix the address, or log to a local store (the default: sqlite:///<run folder>/mlflow.db)"
            ) from None


def instantiate(cfg: Any, key: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that reports failures as :class:`ConfigError` naming ``key`` and the cause."""
    try:
        return hydra.utils.instantiate(cfg, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        if str(cause).startswith((f"{key}.", f"{key}:")):  # the message already names the key
            raise ConfigError(str(cause)) from exc
        target = cfg.get("_target_", "?") if isinstance(cfg, Mapping) else "?"
        raise ConfigError(f"{key} ({target}): {type(cause).__name__}: {cause}") from exc
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{key}: {exc}") from exc


def model_kwargs_from_hints(model_cfg: Mapping[str, Any], hints: Mapping[str, Any]) -> dict[str, Any]:
    """The DataModule hints (``vocab_size``, ``num_classes``, ...) for model arguments left ``null`` in the config."""
    return {k: v for k, v in hints.items() if k in model_cfg and model_cfg[k] is None}
