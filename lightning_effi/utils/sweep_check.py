"""A Hydra callback that checks an Optuna sweep's own settings before its first trial.

The Optuna sweeper (``hydra-optuna-sweeper``) runs ``n_trials`` trials in batches of ``n_jobs``; with
``hydra.sweeper.n_trials=0`` (or a negative number) it runs none and ends in optuna's own traceback,
``ValueError: No trials are completed yet.``, which names neither setting. The project's Optuna sweeps
(``conf/sweep/optuna_*.yaml``) enable this callback::

    hydra:
      callbacks:
        sweep_check:
          _target_: lightning_effi.utils.sweep_check.OptunaSweepCheck
"""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


class OptunaSweepCheck(Callback):
    """At the multirun's start: ``hydra.sweeper.n_trials`` and ``hydra.sweeper.n_jobs`` must be ints >= 1. A wrong
    value ends the process with ``error: <key>: ...`` (``SystemExit``: Hydra turns a callback's exception into a
    warning and runs the sweep)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        for key, what in (("n_trials", "the number of trials"), ("n_jobs", "the trials asked per batch")):
            value = OmegaConf.select(config, f"hydra.sweeper.{key}", default=None)
            if value is None and key == "n_jobs":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SystemExit(f"error: hydra.sweeper.{key}: expected an int >= 1 ({what}), got {value!r}")
