"""A Hydra callback that writes the sweep report when a multirun ends.

Enable it for a sweep (or in ``conf/hydra/default.yaml`` under ``callbacks:``)::

    python experiments/train.py -m seed=0,1 budget=0.25,0.5,1.0 \\
        +hydra.callbacks.report._target_=lightning_effi.report.hydra_callback.ReportCallback

Hydra 1.3 instantiates it when the multirun starts (so a bad argument fails before any job runs) and calls
:meth:`ReportCallback.on_multirun_end` after the last job, on the launching machine (``hydra.experimental.callback.
Callback``). Hydra calls it only when the sweep returned: a failed job makes the sweeper raise first (Hydra's
``BasicSweeper`` reads every job's return value), so no report is written; ``python -m lightning_effi.report
<sweep folder>`` then reports the jobs that finished (and lists the job folders without a ``result.json``).
"""

from __future__ import annotations

import sys
from pathlib import Path, PurePath
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lightning_effi.report.frontier import check_mode
from lightning_effi.report.load import COMPUTE_KEYS


class ReportCallback(Callback):
    """Write :func:`lightning_effi.report.write_report` for the sweep folder (``hydra.sweep.dir``) and print its
    table when the multirun ends. A report that cannot be written (no job wrote a result.json, runs that cannot be
    compared) is printed as a warning on stderr and never raises: the jobs' results stand as they are.

    Args:
        out_dir: where to write (default: the sweep folder).
        metric: the quality metric (default: the runs' ``optimized_metric``).
        compute: ``flops`` (forward + backward training FLOPs), ``tokens``, ``samples`` or ``layer_tokens``.
        mode: ``"min"`` or ``"max"`` (default: the runs' ``optimized_mode``).
        print_table: print the Markdown table to stdout.

    Raises:
        ValueError: (at construction, so that the sweep stops before its first job) an unknown ``compute`` or
            ``mode``, ``print_table`` not a bool, ``metric`` not a string, an ``out_dir`` that is a file or lies
            beneath one, or that cannot be written (the report would be lost after every job trained).
    """

    def __init__(
        self,
        out_dir: str | None = None,
        metric: str | None = None,
        compute: str = "flops",
        mode: str | None = None,
        print_table: bool = True,
    ) -> None:
        if compute not in COMPUTE_KEYS:
            raise ValueError(f"ReportCallback compute: expected one of {list(COMPUTE_KEYS)}, got {compute!r}")
        if mode is not None:
            try:
                check_mode(mode)
            except ValueError as err:
                raise ValueError(f"ReportCallback {err}") from err
        if not isinstance(print_table, bool):
            raise ValueError(f"ReportCallback print_table: expected a bool, got {print_table!r}")
        if metric is not None and (not isinstance(metric, str) or not metric):
            raise ValueError(f"ReportCallback metric: expected a metric name (e.g. 'val/loss') or None, got {metric!r}")
        if out_dir is not None:
            from lightning_effi.report.table import check_report_folder

            if not isinstance(out_dir, str | PurePath) or not str(out_dir):
                raise ValueError(f"ReportCallback out_dir: expected a folder path or None, got {out_dir!r}")
            try:  # found after every job trained, the report was lost with a warning (qa106-break 03)
                check_report_folder(Path(out_dir).expanduser())
            except ValueError as err:
                raise ValueError(f"ReportCallback {err}") from None
        self.out_dir = out_dir
        self.metric = metric
        self.compute = compute
        self.mode = mode
        self.print_table = print_table
        self.report: Any = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Before the first job: refuse a bench sweep's command-line ``budget`` that would give every arm one length
        (:func:`~lightning_effi.utils.instantiate.check_bench_sweep`; the report at the end would find no frontier),
        a value listed twice in a basic sweep (:func:`~lightning_effi.utils.instantiate.check_sweep_duplicates`:
        two identical jobs, whose runs the report refuses), and a bench's bad technique arm (its
        ``technique_budget`` and technique settings, :func:`_check_technique_arm`): the process exits with
        ``error: <why>`` (``SystemExit``: Hydra only warns about a callback's exception, and would run the sweep)."""
        from omegaconf import OmegaConf

        from lightning_effi.utils.instantiate import (
            ConfigError,
            check_bench_sweep,
            check_sweep_duplicates,
            sweep_arm_list,
        )

        overrides = list(OmegaConf.select(config, "hydra.overrides.task", default=[]) or [])
        arms = OmegaConf.select(config, "hydra.sweeper.params.arm", default=None)
        bench = OmegaConf.select(config, "hydra.runtime.choices.bench", default=None)  # the bench group's choice
        sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
        try:
            check_bench_sweep(overrides, bench, arms)
            if sweeper.endswith("BasicSweeper"):  # Hydra's grid: each listed value is a job (qa106-break 02)
                params = OmegaConf.select(config, "hydra.sweeper.params", default=None)
                check_sweep_duplicates(overrides, OmegaConf.to_container(params) if params is not None else None)
            if bench and "technique" in sweep_arm_list(overrides, arms):
                _check_technique_arm(config, overrides)
        except ConfigError as err:  # Hydra turns a callback's exception into a warning and runs the sweep anyway
            raise SystemExit(f"error: {err}") from None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Report on ``config.hydra.sweep.dir``; a failure is printed as a warning, never raised."""
        from lightning_effi.report.table import write_report

        self.report = None
        try:
            sweep_dir = Path(str(config.hydra.sweep.dir))
            report = write_report(
                [sweep_dir], out_dir=self.out_dir, metric=self.metric, compute=self.compute, mode=self.mode
            )
        except Exception as err:  # a report is a by-product: never mask the jobs' results
            print(f"warning: lightning_effi.report: no sweep report ({type(err).__name__}: {err})", file=sys.stderr)
            return
        self.report = report
        if self.print_table:
            print(report.to_markdown())
        print("Sweep report: " + ", ".join(str(p) for p in report.files.values()), flush=True)


def _check_technique_arm(config: DictConfig, overrides: list[str]) -> None:
    """A bench sweep's technique arm (``arm=technique``, the bench's last) checked before its first job: its budget
    (``technique_budget``), the length it scales and its technique callbacks, built once from the sweep's command line
    (its sweep lists left out; of its callbacks, lightning_effi's). Found in the technique's own job, after every
    baseline had trained (qa106-break 04).

    Raises:
        ConfigError: naming ``technique_budget`` or the callback's key and what is allowed.
    """
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import InterpolationResolutionError

    from lightning_effi.train import _user_error_of
    from lightning_effi.utils.instantiate import ConfigError, instantiate_callbacks, scale_length

    name = OmegaConf.select(config, "hydra.job.config_name", default=None)
    if not GlobalHydra.instance().is_initialized() or not name:
        return
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        fixed = [o.input_line for o in parsed if not o.is_sweep_override() and o.key_or_group != "arm"]
        cfg = compose(config_name=str(name), overrides=[*fixed, "arm=technique"])
    except Exception:  # noqa: BLE001 - a command line the jobs themselves report on
        return
    where = "arm=technique (the bench's technique arm, checked before the sweep's first job)"
    try:
        budget = cfg.get("budget")
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not budget > 0:
            raise ConfigError(
                f"technique_budget: expected a number > 0 (a fraction of the reference length), got {budget!r}"
            )
        for key in ("ref_steps", "ref_epochs"):
            if cfg.get(key) is not None:
                try:
                    scale_length(cfg.get(key), budget)
                except ConfigError as err:
                    raise ConfigError(
                        "technique_budget: "
                        + str(err).removeprefix("budget: ").replace("a budget", "a technique_budget")
                    ) from None
        callbacks = cfg.get("callbacks")
        if callbacks is not None:  # the techniques and their monitor; the others (a checkpoint folder, a logger)
            with open_dict(callbacks):  # are the baselines' too
                for key in [k for k, v in callbacks.items() if not _ours(v)]:
                    del callbacks[key]
        instantiate_callbacks(callbacks)
    except InterpolationResolutionError as err:
        found = _user_error_of(err)
        if found is None:
            return
        raise ConfigError(f"{where}: {found}") from None
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def _ours(node: Any) -> bool:
    """Whether a ``callbacks`` entry builds a lightning_effi callback (its ``_target_``)."""
    from omegaconf import OmegaConf

    return str(OmegaConf.select(node, "_target_", default="") or "").startswith("lightning_effi.") if node else False
