"""Write a run record (``result.json``, schema 2) from your own ``Trainer``, so that ``python -m
lightning_effi.report`` compares runs that did not go through ``experiments/train.py``.

After ``trainer.fit(...)`` with an :class:`~lightning_effi.core.accounting.EfficiencyMonitor` among the callbacks::

    from lightning_effi.report import write_result
    write_result(trainer, "runs/ltd_seed0", metric="val/loss", seed=0, budget=1.0)

Run it for the baseline at several budgets (each a complete run with its LR decayed over its own length) and for
the technique runs, each into its own folder, then ``python -m lightning_effi.report runs/`` reads the frontier
(Kaddour et al. 2023, "No Train No Gain", NeurIPS, Sec. 3). The record holds the same fields as the Hydra app's
(``lightning_effi.train.run``): the techniques (callbacks with an ``effi_adjust``, ``effi_baseline`` or
``effi_schedule_state`` hook, each with its ``config()``), the monitor's summary, curve and schedule, the final
metrics and the run's length; ``overrides`` are your ``config`` flattened (none without it) and paths are relative to
``out_dir``. :class:`ResultWriter` writes it from a callback, for a ``LightningCLI`` run.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_effi.core.accounting import EfficiencyMonitor, technique_name
from lightning_effi.core.checks import is_int, is_real
from lightning_effi.core.compat import runs_in_spawned_processes
from lightning_effi.report.frontier import check_mode, infer_mode
from lightning_effi.report.load import SCHEMA, budget_key, folder_blocker, json_safe, write_problem

__all__ = [
    "TECHNIQUE_HOOKS",
    "ResultWriter",
    "config_overrides",
    "make_record",
    "save_record",
    "scalar_metrics",
    "stopped_early",
    "write_result",
]

#: the hooks that make a callback a technique (it changes what is computed, or has a schedule)
TECHNIQUE_HOOKS = ("effi_adjust", "effi_baseline", "effi_schedule_state")


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The entries of ``metrics`` that convert to a float (tensors of one element, numbers), sorted by key."""
    out = {}
    for key, value in metrics.items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            continue
    return dict(sorted(out.items()))


def technique_settings(callback: object) -> dict[str, Any]:
    """A technique callback's resolved settings as plain JSON values: its ``effi_settings()`` (the curriculum, whose
    ``config`` is its parsed configuration) or ``config()``; ``{}`` when it has neither."""
    read = getattr(callback, "effi_settings", None)
    read = read if callable(read) else getattr(callback, "config", None)
    settings = read() if callable(read) else {}
    return json.loads(json.dumps(json_safe(dict(settings)), default=describe_object))  # type: ignore[no-any-return]


def describe_object(value: Any) -> str:
    """A setting that is not JSON (a function, a class, a ``functools.partial``, a collator or other object) as text
    that is the same in every process: its qualified name (``module.qualname``; a partial with its arguments; an
    instance by its class), never ``str()``, whose memory address (``<function f at 0x7f...>``) differs between the
    processes of a sweep, so that the report took two seeds of one arm for two settings (qa39-break 04)."""
    if isinstance(value, functools.partial):
        args = [describe_object(a) if callable(a) else repr(a) for a in value.args]
        args += [f"{k}={describe_object(v) if callable(v) else repr(v)}" for k, v in sorted(value.keywords.items())]
        return f"functools.partial({', '.join([describe_object(value.func), *args])})"
    target = value if isinstance(value, type) or hasattr(value, "__qualname__") else type(value)
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__name__)}"
    return name if target is value else f"{name}(...)"


def _techniques(trainer: pl.Trainer) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, EfficiencyMonitor) or not any(hasattr(callback, h) for h in TECHNIQUE_HOOKS):
            continue
        out[technique_name(callback)] = technique_settings(callback)
    return out


def _check_settings(who: str, metric: str, mode: str | None, budget: Any, arm: Any, task_name: Any) -> str:
    """The checks of :func:`write_result`'s settings that need no Trainer (also run by :class:`ResultWriter` when
    it is built, not after a whole fit); returns the mode (read from the metric's name when None).

    Raises:
        ValueError: as :func:`write_result`, naming ``who``.
    """
    if not isinstance(metric, str) or not metric:  # None was told its name does not say a direction (qa48-break)
        raise ValueError(f"{who}: metric must be the name of a logged metric (a non-empty str), got {metric!r}")
    if mode is None:
        mode = infer_mode(metric)
        if mode is None:
            raise ValueError(
                f"{who}: mode: the metric name {metric!r} does not say whether lower or higher is better; "
                "pass mode='min' (lower is better, e.g. a loss) or mode='max' (higher is better, e.g. an accuracy)"
            )
    try:
        checked_mode = check_mode(mode)
    except ValueError as err:
        raise ValueError(f"{who}: {err}") from None
    said = infer_mode(metric)
    if said is not None and said != checked_mode:
        raise ValueError(
            f"{who}: mode={checked_mode!r} contradicts metric {metric!r}, whose name says "
            f"{'lower' if said == 'min' else 'higher'} is better: the report would rank the runs backwards; pass "
            f"mode={said!r} (or mode=None, read from the name)"
        )
    if not is_real(budget) or not (math.isfinite(float(budget)) and float(budget) > 0):
        raise ValueError(f"{who}: budget must be a number > 0 (a fraction of the reference length), got {budget!r}")
    if arm is not None and (not isinstance(arm, str) or not arm.strip() or not arm.isprintable()):
        raise ValueError(f"{who}: arm must be None (named after the techniques) or a one-line label, got {arm!r}")
    if not isinstance(task_name, str):
        raise ValueError(f"{who}: task_name must be a string (runs of one comparison share it), got {task_name!r}")
    return checked_mode


def write_result(
    trainer: pl.Trainer,
    out_dir: str | os.PathLike[str],
    metric: str,
    mode: str | None = None,
    seed: int | None = None,
    budget: float = 1.0,
    arm: str | None = None,
    task_name: str = "",
    metrics: Mapping[str, float] | None = None,
    config: Mapping[str, Any] | Sequence[str] | None = None,
) -> Path:
    """Write ``<out_dir>/result.json`` for the fit ``trainer`` just ran (on rank 0; other ranks write nothing).
    Call it after ``trainer.fit(...)``, or from a callback's ``on_fit_end`` (:class:`ResultWriter` does, for a
    ``LightningCLI`` run), wherever that callback is listed: before the ``EfficiencyMonitor``, the record is written
    once the monitor has summed the fit up, at the end of its own ``on_fit_end``.

    Args:
        trainer: a Trainer after ``fit`` (and ``test`` if you want test metrics), with an ``EfficiencyMonitor``.
        out_dir: the run's folder (created); one folder per run, e.g. ``runs/<arm>_<budget>_seed<s>``: a
            ``result.json`` of another fit there is moved to ``result.previous.json`` (``result.previous.2.json``,
            ... when taken) with a warning; the same fit's (written again, e.g. with a test's metrics) is replaced.
        metric: the quality the report compares (a key of ``trainer.callback_metrics`` or of ``metrics``, e.g.
            ``"val/loss"``). mode: ``"min"`` (lower is better) or ``"max"``; None (the default) reads it from the
            metric's name (:func:`~lightning_effi.report.frontier.infer_mode`: ``min`` for a loss, error or
            perplexity, ``max`` for an accuracy, F1, AUC, ...) and refuses a name that says neither.
        seed: the run's seed (an int in ``[0, 2**32)``); None reads the one ``pl.seed_everything`` set
            (``PL_GLOBAL_SEED``).
        budget: the fraction of the experiment's reference length this run trained (> 0; the baseline frontier
            is its runs at several budgets; recorded to 12 significant digits, so ``0.1 * 3`` and ``0.3`` are one
            budget). arm: the run's label, one line; None: ``"baseline"`` without a technique, else the techniques'
            names, sorted, joined by ``+`` (one label for one stack, whatever the callbacks' order). task_name: runs
            of one comparison share it (the report refuses to mix tasks). metrics: more final scalar metrics (e.g.
            ``trainer.test(...)[0]``), added to the Trainer's (its ``callback_metrics``) and to the fit's last
            validation metrics (the monitor's curve: kept when a ``trainer.test`` after the fit replaced the
            Trainer's). config: the run's configuration (a nested mapping: ``LightningCLI``'s config as a dict, or
            your own settings; or a list of ``key=value`` strings, as Hydra's overrides), recorded as ``overrides``
            (``key=value``, dotted keys; :func:`config_overrides`) so that the report notes runs whose model, data or
            trainer settings differ, as it does for the Hydra app's runs; None records none.

    Returns:
        The path of the written ``result.json``.

    Raises:
        ValueError: ``config`` neither a mapping nor a list of ``key=value`` strings; no ``EfficiencyMonitor`` in
            ``trainer.callbacks`` (or it has no summary: the fit did not end),
            ``mode`` not ``"min"``/``"max"`` (or None with a metric name that does not say which, or against the
            metric's name: ``"max"`` for ``val/loss``), ``budget``
            not a number > 0, ``out_dir`` an existing file, ``arm`` not a one-line string or ``"baseline"`` on a
            run with a technique, ``task_name`` not a string, ``metrics`` not a mapping, ``seed`` not an int in
            ``[0, 2**32)`` or None while ``pl.seed_everything`` was never called, or ``metric`` in none of the
            fit's last validation, the Trainer's metrics and ``metrics`` (the message lists those there are).

    Warns when the fit stopped early (``EarlyStopping``, ``max_time``): the record marks it
    (``length.stopped_early``) and the report leaves such a baseline out of its frontier (:func:`make_record`).
    """
    overrides = _config_overrides(config)
    checked_mode = _check_settings("write_result", metric, mode, budget, arm, task_name)
    if isinstance(
        out_dir, str | os.PathLike
    ):  # '~/runs' is the home folder's, as ResultWriter reads it (qa86-break 08)
        out_dir = os.path.expanduser(os.fspath(out_dir))
    monitor = next((c for c in trainer.callbacks if isinstance(c, EfficiencyMonitor)), None)  # type: ignore[attr-defined]
    if monitor is not None and not monitor.summary and monitor.totals.get("batches") and trainer.fit_loop.done:
        # called in on_fit_end by a callback listed before the monitor, which sums up the fit in its own
        # (qa39-user 02): written once it has. Not summed up here: under DDP that is a collective, which a caller on
        # rank 0 only would enter alone (qa41-break 02)
        monitor.after_summary.append(
            functools.partial(
                write_result, trainer, out_dir, metric, mode, seed, budget, arm, task_name, metrics, config
            )
        )
        return Path(out_dir) / "result.json"
    running_fit = trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING
    if (
        monitor is not None
        and not monitor.summary
        and monitor.totals.get("batches")
        and not trainer.fit_loop.done
        and not running_fit  # called during the fit: "after trainer.fit(...) ends" (qa110-regress 05)
    ):
        # stopped by an error or an interrupt, also after a later validate / test (qa112-regress 02)
        raise ValueError(
            f"write_result: the Trainer's last fit did not end (stopped by an error or an interrupt at step "
            f"{trainer.global_step}), and its EfficiencyMonitor sums up a fit at its end; resume it from a "
            "checkpoint (trainer.fit(..., ckpt_path=...)) and record it once it ends"
        )
    if monitor is None or not monitor.summary:
        spawned = runs_in_spawned_processes(trainer)
        raise ValueError(
            "write_result: the Trainer has no EfficiencyMonitor with a summary; add EfficiencyMonitor() to "
            "Trainer(callbacks=[...]) and call write_result after trainer.fit(...) ends"
            + (
                f" (with {type(trainer.strategy).__name__} in spawned processes the fit's callbacks live in the "
                "workers: this process's monitor has no summary; use strategy='ddp')"
                if monitor is not None and spawned
                else ""
            )
        )
    blocker = folder_blocker(Path(out_dir))
    if blocker is not None:
        file, what = blocker
        raise ValueError(
            f"write_result: out_dir must be a folder (the run's; created if missing), got {out_dir}, "
            + (what if file == Path(out_dir) else f"beneath {what}: {file}")
        )
    if metrics is not None and not isinstance(metrics, Mapping):
        raise ValueError(
            "write_result: metrics must be a mapping name -> value (e.g. trainer.test(...)[0]) or None, "
            f"got {metrics!r}"
        )
    if seed is None:
        env = os.environ.get("PL_GLOBAL_SEED")
        if env is None:
            raise ValueError("write_result: seed=None, and pl.seed_everything was never called; pass seed=<int>")
        seed = int(env)
    if isinstance(seed, bool) or not is_int(seed) or not 0 <= seed < 2**32:
        raise ValueError(f"write_result: seed must be an int in [0, 2**32), got {seed!r}")
    # the fit's last validation (a later trainer.test() replaces the Trainer's metrics), then the Trainer's, then yours
    last = monitor.curve[-1].get("metrics", {}) if monitor.curve else {}
    values = {
        **scalar_metrics(dict(last)),
        **scalar_metrics(dict(trainer.callback_metrics)),
        **scalar_metrics(dict(metrics or {})),
    }
    if metric not in values:
        raise ValueError(
            f"write_result: metric {metric!r} was not logged; the run's final metrics: {sorted(values)}"
            + _why_not_logged(metric, monitor, metrics)
        )
    techniques = _techniques(trainer)
    if arm is not None and arm.strip() == "baseline" and techniques:
        raise ValueError(
            f"write_result: arm='baseline', but the run has techniques {sorted(techniques)}; a baseline has no "
            "technique (the report would refuse it). Label it after the technique, or leave arm=None"
        )
    record = make_record(
        trainer,
        run_dir=out_dir,
        output_dir=".",
        task_name=task_name,
        seed=int(seed),
        arm=arm.strip() if arm else None,
        budget=float(budget),
        techniques=techniques,
        metric=metric,
        mode=checked_mode,
        metrics=values,
        overrides=overrides,
    )
    if trainer.is_global_zero:
        _keep_another_runs_record(Path(out_dir) / "result.json", record)
    return save_record(trainer, record, out_dir)


#: the fields that tell one fit's record from another's: a record written again for the same fit (after a test,
#: with more metrics) has the same
_SAME_FIT = ("seed", "arm", "budget", "wall_clock", "flops")


def _keep_another_runs_record(path: Path, record: Mapping[str, Any]) -> None:
    """Move ``path``, a record of another fit than ``record``'s, to ``result.previous.json`` (:func:`_previous_name`)
    with a warning, as :class:`ResultWriter` and the Hydra app do: a loop calling ``write_result`` for several seeds
    with one ``out_dir`` kept the last seed's record alone, and the report averaged one seed where two ran
    (qa83-report 02). The same fit's record (written again, e.g. with a test's metrics) is replaced."""
    if not path.is_file():
        return
    try:
        earlier = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        earlier = None
    mine = json.loads(json.dumps(json_safe({key: record.get(key) for key in _SAME_FIT}), default=str))
    if isinstance(earlier, Mapping) and {key: earlier.get(key) for key in _SAME_FIT} == mine:
        return
    kept = _previous_name(path.parent)
    path.replace(kept)
    rank_zero_warn(
        f"write_result: {path} held another run's record; it is moved to {kept.name} and this run's record takes its "
        "place. Runs that share a folder replace each other's records: give each run its own out_dir (e.g. "
        "runs/<arm>_<budget>_seed<seed>)"
    )


#: configuration keys that are not the run's setup: the callbacks and loggers (the techniques are recorded apart),
#: where it writes, and LightningCLI's own entries
_NOT_CONFIG_KEYS = frozenset(
    {
        "trainer.callbacks",
        "trainer.logger",
        "trainer.default_root_dir",
        "trainer.enable_checkpointing",
        "ckpt_path",
        "config",
        "seed_everything",
        "seed",
    }
)


def _config_overrides(config: Any) -> list[str] | None:
    """``write_result``'s ``config`` as the record's overrides (None: none)."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        return config_overrides(config)
    if isinstance(config, Sequence) and not isinstance(config, str | bytes):  # a list, tuple or ListConfig (Hydra's
        # overrides, HydraConfig.get().overrides.task, was refused with a message that allowed it: qa48-break 01)
        overrides = list(config)
        if all(isinstance(o, str) and "=" in o for o in overrides):
            return sorted(overrides)
    raise ValueError(
        "write_result: config must be a mapping (the run's configuration, e.g. LightningCLI's as a dict) or a list "
        f"of 'key=value' strings, got {config!r:.200}"
    )


def config_overrides(config: Mapping[str, Any]) -> list[str]:
    """A run's configuration as the ``key=value`` overrides of its record (sorted; dotted keys, lists and other
    leaves as JSON): ``LightningCLI``'s ``{"model": {"class_path": ..., "init_args": {...}}, "data": ...,
    "trainer": {...}}`` gives ``model.init_args.n_layer=4``, ``trainer.max_steps=400``, ... The report compares the
    ``model``, ``data``, ``trainer`` and ``optimizer`` keys across runs, the length left out (and the
    ``lr_scheduler`` entry, whose lengths follow each run's budget: a setting of your LR schedule that does not is
    not checked).

    Left out: the callbacks, loggers and output folder (the techniques are recorded from the callbacks themselves),
    the seed, ``ckpt_path`` and the CLI's ``config`` files; and the technique DataModules a ``data`` entry wraps
    your DataModule in (``lightning_effi.CurriculumDataModule`` / ``InfoBatchDataModule``): ``data`` is your
    DataModule's entry, so a technique run and its baselines compare on the same keys."""
    from lightning_effi.core.wrapping import WrappingDataModule, _resolve

    items: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if prefix in _NOT_CONFIG_KEYS or prefix.rsplit(".", 1)[-1].startswith("__"):
            return
        if isinstance(value, Mapping):
            if prefix == "data" and isinstance(value.get("init_args"), Mapping):
                cls = _resolve(value.get("class_path"))
                inner = value["init_args"].get("datamodule")
                if isinstance(cls, type) and issubclass(cls, WrappingDataModule) and isinstance(inner, Mapping):
                    walk("data", inner)  # the user's DataModule, not the technique's wrapper
                    return
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
            return
        items[prefix] = json.dumps(json_safe(value), sort_keys=True, default=describe_object)

    walk("", dict(config))
    return [f"{k}={v}" for k, v in sorted(items.items())]


def _hydra_output_dir() -> str | None:
    """The running Hydra job's output folder; None outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    return str(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def _hydra_overrides() -> list[str] | None:
    """The running Hydra job's overrides (``HydraConfig.get().overrides.task``: ``model.lr=0.5``, ...); None outside
    a Hydra job."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return None
    task = OmegaConf.select(HydraConfig.get(), "overrides.task", default=None)
    return [str(o) for o in task] if task is not None else None


def _previous_name(folder: Path) -> Path:
    """``result.previous.json``, or the first of ``result.previous.2.json``, ``.3``, ... not taken yet: each earlier
    record is kept (three runs in one folder kept the last two, qa49-break 08)."""
    name, n = folder / "result.previous.json", 2
    while name.exists():
        name, n = folder / f"result.previous.{n}.json", n + 1
    return name


def _why_not_logged(metric: str, monitor: Any, metrics: Mapping[str, Any] | None) -> str:
    """The likely cause of a metric missing at the end of fit, for the error's end: a fit that never validated (its
    loss was not logged; the error named no cause, qa102-user 03), or a test metric asked of a fit."""
    hints = []
    if not monitor.curve and metrics is None:
        hints.append(
            "this fit ran no validation (the EfficiencyMonitor's curve is empty: no validation loader, "
            "limit_val_batches=0, or a run that ends before its first validation, e.g. max_steps before the first "
            "epoch's end): validate at the run's last step (a val_check_interval that divides the run, or "
            "check_val_every_n_epoch=None with val_check_interval=<training batches>), or pass the metric yourself: "
            "write_result(trainer, ..., metrics=trainer.validate(...)[0])"
        )
    if metric.split("/")[0].split("_")[0] == "test" and metrics is None:
        hints.append(
            "the record is written at the end of fit, before any trainer.test(): record a test metric after the "
            "test with write_result(trainer, ..., metrics=trainer.test(...)[0])"
        )
    return "".join(f"; {h}" for h in hints)


#: fits per Hydra job folder in this process whose record went to the job's folder for want of a logger folder inside
#: it (:meth:`ResultWriter._resolve_dir`), where the job has no ``.hydra/hydra.yaml`` to date its start
_JOB_FITS: dict[str, int] = {}


def _earlier_launch(record: Path) -> bool:
    """Whether ``record`` lies in a Hydra job's folder (or its ``fit_<k>``) and was written before the job started:
    an earlier launch's, the sweep launched again into its folder (the advice to give each run its own folder did
    not apply: qa105-regress 03)."""
    for folder in (record.parent, record.parent.parent):
        started_file = folder / ".hydra" / "hydra.yaml"
        if started_file.is_file():
            return record.stat().st_mtime < started_file.stat().st_mtime
    return False


def _job_fit_folder(job: str) -> str:
    """The folder of a Hydra job's next fit whose logger writes outside the job's folder: the job's folder for its
    first fit, ``<job>/fit_<k>`` for its k-th. The fits this job run made are the records written since it started
    (Hydra writes ``.hydra/hydra.yaml`` at a job's start): read from the folders, so that the fits of a loop under
    ``ddp_spawn`` (whose processes do not share a counter; qa105-regress 01) count, and a sweep launched again into
    its folder finds the earlier launch's records older and takes the same folders (its records are moved aside).
    Without that file (``hydra.output_subdir=null``) the fits are counted in this process."""
    started_file = Path(job) / ".hydra" / "hydra.yaml"
    if not started_file.is_file():
        key = str(Path(job).resolve())
        count = _JOB_FITS[key] = _JOB_FITS.get(key, 0) + 1
        return job if count == 1 else str(Path(job) / f"fit_{count}")
    started, k = started_file.stat().st_mtime, 1
    while True:
        folder = Path(job) if k == 1 else Path(job) / f"fit_{k}"
        record = folder / "result.json"
        if not (record.is_file() and record.stat().st_mtime >= started):
            return str(folder)
        k += 1


def _check_writer(
    metric: Any, out_dir: Any, mode: Any, seed: Any, budget: Any, arm: Any, task_name: Any, config: Any
) -> str | None:
    """The settings of a :class:`ResultWriter`, checked where it is built and again at each fit's start (a value set
    on the writer after it was built was refused only after the whole fit, the record lost); returns ``out_dir``
    with ``~`` expanded."""
    if config is not None and config != "cli" and not isinstance(config, Mapping):
        try:
            _config_overrides(config)
        except ValueError:
            raise ValueError(
                f"ResultWriter: config must be 'cli', a mapping, a list of 'key=value' strings or None, got "
                f"{config!r:.200}"
            ) from None
    _check_settings("ResultWriter", metric, mode, budget, arm, task_name)  # here, not after a whole fit
    if seed is not None and (isinstance(seed, bool) or not is_int(seed) or not 0 <= seed < 2**32):
        raise ValueError(f"ResultWriter: seed must be None or an int in [0, 2**32), got {seed!r}")
    # a path object whose __fspath__ gives bytes failed in pathlib after the whole fit, the record lost
    # (qa61-ideas 05)
    if out_dir is not None and (not isinstance(out_dir, str | os.PathLike) or not isinstance(os.fspath(out_dir), str)):
        raise ValueError(
            f"ResultWriter: out_dir must be None, a str or a path to a str (the run's folder), got {out_dir!r}"
        )
    if out_dir is not None and "${" in os.fspath(out_dir):
        # an interpolation Hydra never resolved: a folder of that literal name (qa65-break 07)
        raise ValueError(
            f"ResultWriter: out_dir {out_dir!r} holds an unresolved interpolation; pass the resolved path (in a "
            "Hydra app, resolve the config first, or give it from the job: HydraConfig.get().runtime.output_dir)"
        )
    if out_dir is not None:
        out_dir = os.path.expanduser(os.fspath(out_dir))  # '~/runs' was a folder named '~' (qa65-break 07)
    # a file, or a folder beneath one, or a link to nothing, which cannot be made: refused after the whole fit,
    # the record lost (qa62-break 07, qa63-break 04, qa65-break 08)
    blocker = folder_blocker(Path(out_dir)) if out_dir else None
    if blocker is not None:
        file, what = blocker
        raise ValueError(
            f"ResultWriter: out_dir must be a folder (the run's; created if missing), got {out_dir}, "
            + (what if file == Path(out_dir) else f"beneath {what}: {file}")
        )
    return out_dir


class ResultWriter(pl.Callback):
    """Writes the run's ``result.json`` at the end of ``fit`` (:func:`write_result`): for runs whose ``fit`` you do
    not call yourself, e.g. ``LightningCLI``'s ``fit`` subcommand, where it goes in the YAML beside the
    ``EfficiencyMonitor`` (anywhere in the list)::

        trainer:
          callbacks:
            - class_path: lightning_effi.EfficiencyMonitor
            - class_path: lightning_effi.report.ResultWriter
              init_args: {metric: val/loss, budget: 0.5}

    Args:
        metric, mode, seed, budget, arm, task_name: as :func:`write_result`.
        out_dir: the run's folder; None: the folder of the run's first logger when that is a ``TensorBoardLogger``
            or ``CSVLogger`` (its version folder, one per run; in a Hydra job, when it lies outside the job's output
            folder, the job's folder, ``<job>/fit_<k>`` for the k-th fit since the job started), else the Hydra job's
            output folder in a Hydra job,
            else ``trainer.log_dir`` (another logger's ``save_dir``), else ``trainer.default_root_dir`` (no logger, or
            one without a local folder: MLflow on an sqlite or http tracking URI). A folder that
            already holds a ``result.json`` when the fit starts (another run's: runs of a loop or a sweep sharing one
            folder) has it moved to ``result.previous.json`` (``result.previous.2.json``, ... when taken) with a
            warning: give each run its own ``out_dir``. In a Hydra job, a logger's folder outside the job's is not
            taken (the sweep's report would not find the record there).
        config: ``"cli"`` (default): the ``LightningCLI`` configuration when the Trainer has its
            ``SaveConfigCallback`` (recorded as overrides, :func:`config_overrides`); else, built in a Hydra job (your
            own ``@hydra.main`` app), the job's overrides (``HydraConfig.get().overrides.task``, so that the report
            notes a run whose settings differ from its baselines'); else none. A mapping: that configuration; a list
            of ``key=value`` strings (Hydra's overrides): those; None: none.

    Raises:
        ValueError: (when built, and at a fit's start for a value set on the writer after it was built) a
            ``mode``, ``budget``, ``arm``, ``task_name``, ``seed``, ``config`` or ``out_dir`` that
            :func:`write_result` would refuse; (at the end of fit) the others, as :func:`write_result`.

    A setting set on the writer during a fit (from a callback's hook) is warned of there and taken at the next fit's
    start: the fit's record is written with the settings the fit started with.
    """

    def __init__(
        self,
        metric: str,
        out_dir: str | None = None,
        mode: str | None = None,
        seed: int | None = None,
        budget: float = 1.0,
        arm: str | None = None,
        task_name: str = "",
        config: str | Mapping[str, Any] | Sequence[str] | None = "cli",
    ) -> None:
        super().__init__()
        out_dir = _check_writer(metric, out_dir, mode, seed, budget, arm, task_name, config)
        self.metric, self.out_dir, self.mode, self.seed = metric, out_dir, mode, seed
        self.budget, self.arm, self.task_name, self.config = budget, arm, task_name, config
        #: the path of the last result.json written
        self.path: Path | None = None
        self._dir: str | os.PathLike[str] | None = None
        self._earlier = False  # the folder held a result.json when the fit started
        # the Hydra job's folder, read where the callback is built: processes a ddp_spawn fit starts have no Hydra
        # configuration, and wrote into the launch folder that the sweep's jobs share (qa49-break 06)
        self._hydra_dir = _hydra_output_dir()
        # ... and its overrides, recorded with the default config="cli" outside the LightningCLI (an own Hydra app's
        # records held none, and the report could not note a technique run's other model.lr, qa86-user 03)
        self._hydra_task = _hydra_overrides()
        self._metric_checked = False  # the metric was looked for among the first validation's (on_validation_end)
        #: the settings of the fit under way (on_fit_start to teardown), which its record is written with
        self._fit_settings: dict[str, Any] | None = None
        self._compared: set[str] = set()  # those whose in-place change is told at the fit's end

    _SETTINGS = ("metric", "out_dir", "mode", "seed", "budget", "arm", "task_name", "config")

    def __setattr__(self, name: str, value: Any) -> None:
        fit = self.__dict__.get("_fit_settings")
        if fit is not None and name in self._SETTINGS:
            # the record was written with a value set during the fit, unchecked: a bad one lost it after the whole
            # fit, a good one was recorded as the fit's, and out_dir was ignored (qa92-break 03)
            self.__dict__.setdefault("_set_in_fit", set()).add(name)
            warnings.warn(
                f"ResultWriter.{name} = {value!r:.80} was set during a fit: this fit's record is written with "
                f"{name}={fit[name]!r:.80}; the next fit's start takes the new value (or refuses it, naming why)",
                UserWarning,
                stacklevel=2,
            )
        super().__setattr__(name, value)

    def _resolve_dir(self, trainer: pl.Trainer) -> str | os.PathLike[str]:
        if self.out_dir:
            return self.out_dir
        from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

        job = self._hydra_dir or _hydra_output_dir()
        if trainer.loggers and isinstance(trainer.loggers[0], TensorBoardLogger | CSVLogger):
            folder = str(trainer.log_dir)  # the version folder: one per run
            if job is None or Path(folder).resolve().is_relative_to(Path(job).resolve()):
                return folder
            # a logger's folder outside the job's (Lightning's default ./lightning_logs under Hydra's chdir=false):
            # the record went there with a warning, and the sweep's report found none of its jobs' (qa102-user 04).
            # The job's folder for its first fit, <job>/fit_<k> for its k-th (_job_fit_folder): one folder per fit of
            # a job that fits several times (seeds in a loop: qa103-regress 03), and the same folders when the sweep
            # is launched again into the same folder (the logger's version, global to the launch folder, gave a
            # rerun's record a new folder beside the first run's, and the report refused the two: qa104-regress 01)
            target = _job_fit_folder(job)
            rank_zero_info(
                f"ResultWriter: this run's record goes to {target}, in the Hydra job's folder (its logger's folder "
                f"{folder} lies outside it, where a report of the sweep folder would not find it)"
            )
            return target
        if job is not None:  # a Hydra job: its own folder, where a sweep's jobs share the launch folder
            return job
        # another logger's save_dir, or default_root_dir: maybe shared by runs; a logger without a local folder (an
        # MLFlowLogger on an sqlite or http tracking URI) gives None, and the record went to a folder named "None"
        # (qa75-user 04)
        folder = trainer.log_dir
        return str(folder) if folder is not None else trainer.default_root_dir

    def _config(self, trainer: pl.Trainer, config: Any) -> Mapping[str, Any] | Sequence[str] | None:
        if config != "cli":
            return config  # type: ignore[no-any-return]
        from lightning.pytorch.cli import SaveConfigCallback

        saver = next((c for c in trainer.callbacks if isinstance(c, SaveConfigCallback)), None)  # type: ignore[attr-defined]
        if saver is None:
            return self._hydra_task
        config = saver.config
        return config.as_dict() if hasattr(config, "as_dict") else dict(config)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Choose the run's folder (``out_dir``), and note whether it already holds a record. A folder that is a file,
        or one rank 0 cannot make or write a file into (a probe file, removed at once), or no seed (``seed=None``
        without ``pl.seed_everything``), or no ``EfficiencyMonitor`` is refused here, not after the whole fit with no
        record written (qa58-args 02, qa59-break 04). So are settings set on the writer after it was built that the
        constructor would refuse."""
        self.out_dir = _check_writer(
            self.metric, self.out_dir, self.mode, self.seed, self.budget, self.arm, self.task_name, self.config
        )
        self._dir = self._resolve_dir(trainer)  # on every rank: trainer.log_dir broadcasts
        # the logger's or Hydra's folder, checked as out_dir is at construction: a folder beneath a file or a FIFO,
        # or a link to nothing, failed with a bare [Errno 20] after the whole fit, the record lost
        blocker = folder_blocker(Path(self._dir))
        if blocker is not None:
            file, what = blocker
            raise ValueError(
                f"ResultWriter: out_dir must be a folder (the run's; created if missing), got {self._dir}, "
                + (what if file == Path(self._dir) else f"beneath {what}: {file}")
                + ("" if self.out_dir else " (the logger's or default_root_dir's folder): pass out_dir=<a folder>")
            )
        if not any(isinstance(c, EfficiencyMonitor) for c in trainer.callbacks):  # type: ignore[attr-defined]
            # refused after the whole fit before, with no record written (qa59-break 04)
            raise ValueError(
                "ResultWriter: the Trainer has no EfficiencyMonitor, whose summary the record holds; add "
                "EfficiencyMonitor() to Trainer(callbacks=[...])"
            )
        if self.seed is None and os.environ.get("PL_GLOBAL_SEED") is None:
            raise ValueError(
                "ResultWriter: seed=None, and pl.seed_everything was never called: the record needs the run's seed; "
                "pass ResultWriter(seed=<int>) or call pl.seed_everything(<int>) before the fit"
            )
        # a folder it cannot write into (no permission, read-only, /proc): the paths say nothing of it, and the record
        # was lost after the whole fit with a bare PermissionError (qa90-docs 01). Rank 0 writes the record: it tries
        problem = write_problem(Path(self._dir)) if trainer.is_global_zero else None
        problem = trainer.strategy.broadcast(problem)
        if problem:
            raise ValueError(
                f"ResultWriter: out_dir {self._dir} cannot be written into ({problem}): pass out_dir=<a folder you "
                "can write>" + ("" if self.out_dir else " (the logger's or default_root_dir's folder)")
            )
        self._earlier = (Path(self._dir) / "result.json").exists()
        self._metric_checked = False
        # copied: a config changed in place from a hook went into the record unchecked, or lost it (qa93-regress 05)
        self._fit_settings, self._compared = {}, set()
        for name in self._SETTINGS:
            self._fit_settings[name], comparable = _fit_copy(getattr(self, name))
            if comparable:
                self._compared.add(name)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The fit is over (ended or raised): a setting set from now on is the next fit's, without a warning."""
        if stage == "fit":
            self._fit_settings = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._fit_settings = None  # as teardown: a fit that raised is over

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At the fit's first validation (not the sanity check), warn when ``metric`` is not among the metrics logged
        so far: a misspelt name (``val/accuracy`` for ``val_acc``) was told only by the error after the whole fit,
        with no record written (qa86-user 05). A warning, not an error: a metric logged later (at the end of a
        training epoch, or every few validations) is legitimate."""
        if self._metric_checked or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._metric_checked = True
        logged = set(trainer.callback_metrics) | set(trainer.logged_metrics)
        if self.metric not in logged:
            rank_zero_warn(
                f"ResultWriter: metric {self.metric!r} was not logged by the fit's first validation (logged so far: "
                f"{sorted(logged)}); the record at the end of the fit needs it, and is not written without it. If "
                "the name is right and it is logged later in the fit, ignore this"
            )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the record (listed before the ``EfficiencyMonitor``: once the monitor has summed the fit up), with the
        settings the fit started with (a setting set during the fit, warned of where it is set, is the next fit's)."""
        fit = self._fit_settings or {name: getattr(self, name) for name in self._SETTINGS}
        told = self.__dict__.pop("_set_in_fit", set())
        changed = [
            n
            for n in self._SETTINGS
            if self._fit_settings and n not in told and n in self._compared and _differs(getattr(self, n), fit[n])
        ]
        if changed and trainer.is_global_zero:
            # changed in place during the fit (a config dict edited from a hook; a setting set is warned where set):
            # the next fit's; this record holds what the fit started with
            rank_zero_warn(
                f"ResultWriter: {', '.join(changed)} changed in place during the fit; this fit's record is written "
                "with the value the fit started with, and the next fit's start takes (or refuses) the new one"
            )
        out_dir = self._dir if self._dir is not None else self._resolve_dir(trainer)
        earlier = Path(out_dir) / "result.json"
        if self._earlier and trainer.is_global_zero and earlier.exists():
            # runs of a loop or a sweep writing into one folder (no logger, Hydra's launch folder): the second
            # replaced the first's record in silence, and the report saw one run (qa48-hydra 02)
            kept = _previous_name(earlier.parent)
            relaunch = _earlier_launch(earlier)
            earlier.replace(kept)
            rank_zero_warn(
                f"ResultWriter: {earlier} held an earlier run's record when this fit started; it is moved to "
                f"{kept.name} and this run's record takes its place. "
                + (
                    "It was written before this Hydra job started: the sweep was launched again into the same "
                    "folder (a new hydra.sweep.dir keeps the launches apart)"
                    if relaunch
                    else "Runs that share a folder replace each other's records: give each run its own out_dir (e.g. "
                    "runs/<arm>_<budget>_seed<seed>; under Hydra ${hydra:runtime.output_dir}), or a TensorBoardLogger "
                    "/ CSVLogger, whose version folders are one a run"
                )
            )
        self.path = write_result(
            trainer,
            out_dir,
            metric=fit["metric"],
            mode=fit["mode"],
            seed=fit["seed"],
            budget=fit["budget"],
            arm=fit["arm"],
            task_name=fit["task_name"],
            config=self._config(trainer, fit["config"]),
        )


def _differs(now: Any, then: Any) -> bool:
    """Whether a setting differs from the copy taken at the fit's start (a comparison that fails counts as a
    change)."""
    try:
        return bool(now != then)
    except Exception:
        return True


def _fit_copy(value: Any) -> tuple[Any, bool]:
    """A setting as a fit starts: ``(a deep copy, whether it compares equal to it)`` (the record holds the copy; an
    in-place change is told at the fit's end where the comparison can tell one: a partial or a tensor was told
    changed at every fit, qa94-regress 03), or ``(value, False)`` when it cannot be copied (a config holding a lock
    stopped the fit with a bare TypeError, qa94-regress 01)."""
    try:
        copied = copy.deepcopy(value)
    except Exception:
        return value, False
    return copied, not _differs(value, copied)


def make_record(
    trainer: pl.Trainer,
    *,
    run_dir: str | os.PathLike[str],
    output_dir: str | None,
    task_name: str | None,
    seed: int | None,
    arm: str | None,
    budget: float,
    techniques: Mapping[str, Any],
    metric: str | None,
    mode: str,
    metrics: Mapping[str, float],
    tags: list[str] | None = None,
    overrides: list[str] | None = None,
    length: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The schema-2 run record of the fit ``trainer`` ran (the one :func:`write_result` and the Hydra app write).

    ``arm`` None: ``"baseline"`` without a technique, else the techniques' names, sorted, joined by ``+``. ``budget``
    is recorded to 12 significant digits (:func:`~lightning_effi.report.load.budget_key`). A technique whose
    savings the monitor counted (``saved/<name>/..._frac`` not 0) but that is not in ``techniques`` (the run resumed
    a checkpoint of a fit that had it, without it) is added as ``{name: {"resumed_without": True}}``: such a run is
    not a baseline. A technique that joined on resume (a callback whose ``effi_added_on_resume`` is the step it
    resumed at from a checkpoint without its state, e.g. the curriculum) gets ``"added_on_resume": step`` in its
    settings; the report notes both.

    The efficiency summary, curve and schedule come from the Trainer's ``EfficiencyMonitor`` (empty without one);
    ``metric`` is ``metrics[metric]`` (NaN when absent or ``metric`` is None); ``length`` defaults to the Trainer's
    ``max_steps`` and ``max_epochs``, with ``optimizer_steps`` always the Trainer's ``global_step``; the checkpoint
    paths of its first ``ModelCheckpoint`` are relative to ``run_dir``. ``output_dir`` is the run folder as the
    record names it (relative to a root the caller chooses).
    """
    monitor = next((c for c in trainer.callbacks if isinstance(c, EfficiencyMonitor)), None)  # type: ignore[attr-defined]
    efficiency = dict(monitor.summary) if monitor is not None else {}
    checkpoint = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)  # type: ignore[attr-defined]

    def relative(path: str | None) -> str | None:
        return os.path.relpath(path, run_dir) if path else None

    if length is None:
        length = {"max_steps": trainer.max_steps, "max_epochs": trainer.max_epochs}
    techniques = dict(techniques)
    for key, value in efficiency.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "saved" and parts[2].endswith("_frac") and value:
            techniques.setdefault(parts[1], {"resumed_without": True})
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        step = getattr(callback, "effi_added_on_resume", None)
        if isinstance(step, int) and not isinstance(step, bool):  # trained without it up to that step
            name = technique_name(callback)
            settings = techniques.get(name)
            techniques[name] = {**(settings if isinstance(settings, dict) else {}), "added_on_resume": step}
    if not arm:  # sorted: one stack gets one label whatever the order of its callbacks
        arm = "+".join(sorted(techniques)) if techniques else "baseline"
    early = stopped_early(trainer)
    if early and trainer.is_global_zero:
        rank_zero_warn(
            f"the fit stopped early, at optimizer step {trainer.global_step} (completed epochs: "
            f"{trainer.current_epoch}; "
            f"max_steps={trainer.max_steps}, max_epochs={trainer.max_epochs}): EarlyStopping, max_time or "
            f"trainer.should_stop. Its record keeps budget={budget:g} as a label, with length.stopped_early = true; "
            "the report notes it. A frontier baseline should train its whole budget"
        )
    last = monitor.curve[-1] if monitor is not None and monitor.curve else None
    if (
        metric
        and last is not None
        and metric in (last.get("metrics") or {})
        and last.get("step", 0) < trainer.global_step
        and trainer.is_global_zero
    ):
        rank_zero_warn(
            f"the final {metric} is the last validation's, at optimizer step {last.get('step')} of "
            f"{trainer.global_step}: the record pairs it with the compute of the whole run, and the report notes it. "
            "Validate at the last step (a val_check_interval that divides the run) to read the quality the compute "
            "bought"
        )
    return {
        "schema": SCHEMA,
        "task_name": task_name,
        "tags": list(tags or []),
        "seed": seed,
        "arm": arm,
        "budget": budget_key(budget),
        "techniques": techniques,
        "overrides": list(overrides or []),
        "optimized_metric": metric,
        "optimized_mode": mode,
        "metric": metrics.get(metric, math.nan) if metric else math.nan,
        "wall_clock": efficiency.get("time_total_s"),
        "flops": efficiency.get("flops"),
        "metrics": dict(metrics),
        "efficiency": efficiency,
        "length": {
            **length,
            "optimizer_steps": int(trainer.global_step),
            "stopped_early": early,
            "lr_end_ratio": lr_end_ratio(trainer),
        },
        "curve": list(monitor.curve) if monitor is not None else [],
        "schedule": list(monitor.schedule) if monitor is not None else [],
        "output_dir": output_dir,
        "last_checkpoint": relative(getattr(checkpoint, "last_model_path", "") or None),
        "best_checkpoint": relative(getattr(checkpoint, "best_model_path", "") or None),
    }


def lr_end_ratio(trainer: pl.Trainer) -> float | None:
    """The learning rate at the end of the fit (after its last scheduler step) over the rate its schedule started
    from: the first optimizer's first parameter group's ``lr`` over its ``initial_lr`` (what a torch scheduler
    scales; 1.0 without a scheduler, a constant rate). The schedule's floor for one decayed over the run (0 for a
    cosine to 0, 0.1 for ``warmup_cosine``'s default), more for one sized for a longer run (0.5 for a cosine of
    twice the run's steps): the report notes a baseline whose rate ended above the others' (its schedule did not
    decay over its own budget, and the frontier would flatter the arms, qa86-user 02). None without an optimizer or
    with a rate of 0 to start from."""
    optimizers = getattr(trainer, "optimizers", None) or []
    if not optimizers or not optimizers[0].param_groups:
        return None
    group = optimizers[0].param_groups[0]
    end = float(group["lr"]) if is_real(group.get("lr")) else None
    start = float(group["initial_lr"]) if is_real(group.get("initial_lr")) else end
    if end is None or start is None or not start > 0 or not math.isfinite(end / start):
        return None
    return end / start


def stopped_early(trainer: pl.Trainer) -> bool:
    """Whether the fit ended before its length (``max_steps``, else ``max_epochs``) because something set
    ``trainer.should_stop`` (``EarlyStopping``, ``max_time``'s ``Timer``, a callback or the module); not when a
    callback says the run reached its configured end (``effi_run_complete``: the curriculum's sample budget)."""
    if not trainer.should_stop:
        return False
    if any(getattr(c, "effi_run_complete", False) for c in trainer.callbacks):  # type: ignore[attr-defined]
        return False
    if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
        return False
    epochs = trainer.max_epochs
    return not (epochs is not None and epochs != -1 and trainer.current_epoch >= epochs)


def save_record(
    trainer: pl.Trainer, record: Mapping[str, Any], run_dir: str | os.PathLike[str], name: str = "result.json"
) -> Path:
    """Write ``record`` to ``<run_dir>/<name>`` (``result.json``, the record the report reads) as strict JSON
    (non-finite numbers as null) on rank 0 (the folder is created); other ranks write nothing. The file appears whole:
    written to a temporary file beside it and renamed (a report read while a job writes its record sees none, never
    half of one). Returns the file's path."""
    file = Path(run_dir) / name
    if trainer.is_global_zero:
        file.parent.mkdir(parents=True, exist_ok=True)
        partial = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(json_safe(record), indent=2, default=str), encoding="utf-8")
        os.replace(partial, file)
    return file
