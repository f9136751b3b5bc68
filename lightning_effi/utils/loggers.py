"""Loggers of the Hydra app (``conf/logger/*.yaml``) where Lightning's own do not fit a job that resumes.

:class:`MLFlowLogger` is Lightning's, for a job resumed into its MLflow run (``run_id``): MLflow refuses to change a
logged parameter, so a resumed job whose module hyperparameters differ from the first job's (``model.weight_decay``
changed for the resume) stopped at setup with ``MlflowException: Changing param values is not allowed`` and the run
marked FAILED.
"""

from __future__ import annotations

import warnings
from argparse import Namespace
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger as _LightningMLFlowLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_effi.core.compat import flat_hyperparameters

__all__ = ["MLFlowLogger", "new_mlflow_params"]


def new_mlflow_params(logger: Any, params: Any) -> dict[str, Any]:
    """``params`` flattened as the MLflow logger flattens them, without those ``logger``'s run already holds with
    another value (a run resumed by ``run_id``; MLflow keeps a value's first 250 characters), which are named in a
    warning: MLflow keeps a parameter's first value."""
    flat = flat_hyperparameters(params)  # as Lightning's: a list of dicts, a dataclass (qa93-regress 06)
    held = dict(logger.experiment.get_run(logger.run_id).data.params)
    kept = sorted(k for k, v in flat.items() if k in held and held[k] != str(v)[:250])
    if kept:
        warnings.warn(
            f"MLflow run {logger.run_id} already holds {kept} with other values (a resumed run): MLflow keeps a "
            "parameter's first value, so this job's values of these are not logged (result.json records the "
            "job's overrides)",
            UserWarning,
            stacklevel=3,
        )
    return {k: v for k, v in flat.items() if k not in kept}


class MLFlowLogger(_LightningMLFlowLogger):
    """Lightning's ``MLFlowLogger`` (same arguments), but in a run that already holds parameters (resumed by
    ``run_id``) a hyperparameter logged with another value than the run holds is left out, named in a warning
    (:func:`new_mlflow_params`), and the new ones are added: Lightning's stopped the job at setup with MLflow's
    ``Changing param values is not allowed`` and the run was marked FAILED."""

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace) -> None:
        super().log_hyperparams(new_mlflow_params(self, params))
