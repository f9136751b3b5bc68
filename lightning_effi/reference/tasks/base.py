"""Base class of the reference tasks: the per-sample-loss contract, optimizers and accounting hooks.

Contract (``docs/architecture.md``, "Per-sample losses"):
``training_step`` returns ``{"loss": per_sample_loss.mean(), "per_sample_loss": per_sample_loss}`` where
``per_sample_loss`` has shape ``(B,)``. A plain ``Trainer`` only uses ``"loss"``; loss-driven callbacks read
``"per_sample_loss"``. Batches are dicts; unknown keys (for example ``"index"``) are ignored.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from numbers import Real
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_effi.core.flops import measured_training_flops
from lightning_effi.core.progress import progress_source

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., Any]


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW(lr=1e-3, weight_decay=0.01): used when a task is built without an optimizer factory."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def param_groups(model: nn.Module, weight_decay: float | None) -> list[dict[str, Any]]:
    """Split parameters into decayed (matrices, ndim >= 2) and non-decayed (biases, norms) groups (nanoGPT style).

    With ``weight_decay=None`` the optimizer's own default applies to the first group.
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    first: dict[str, Any] = {"params": decay}
    if weight_decay is not None:
        first["weight_decay"] = weight_decay
    return [first, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(factory: OptimizerFactory, model: nn.Module, weight_decay: float | None) -> torch.optim.Optimizer:
    """``factory`` over :func:`param_groups` (decayed matrices, undecayed biases and norms); an optimizer that takes
    one group only (``LBFGS``: "doesn't support per-parameter options") gets the trainable parameters as one group,
    which is the same run when nothing is decayed (it has no weight decay). Then :func:`check_weight_decay_applies`.

    Raises:
        ValueError: see :func:`check_weight_decay_applies`; the factory's own errors.
    """
    try:
        optimizer = factory(param_groups(model, weight_decay))
    except ValueError as err:
        if "per-parameter options" not in str(err):
            raise
        # LBFGS could not be built at all, whatever weight_decay (qa61-break 05)
        optimizer = factory([p for p in model.parameters() if p.requires_grad])
    check_weight_decay_applies(optimizer, weight_decay)
    return optimizer


def check_weight_decay_applies(optimizer: torch.optim.Optimizer, weight_decay: float | None) -> None:
    """Refuse a positive ``weight_decay`` for an optimizer that has no such setting (``Rprop``, ``LBFGS``): it keeps
    the group key and never reads it, so the run would train without decay.

    Raises:
        ValueError: naming ``model.weight_decay`` and the optimizer.
    """
    if weight_decay and "weight_decay" not in optimizer.defaults:
        raise ValueError(
            f"model.weight_decay: {type(optimizer).__name__} has no weight decay, so weight_decay={weight_decay!r} "
            "would be ignored; set model.weight_decay=null (or 0), or choose an optimizer that takes weight_decay"
        )


class EffiTask(pl.LightningModule):
    """A LightningModule that follows the per-sample-loss contract.

    Subclasses implement :meth:`per_sample_loss` (returns ``(per_sample_loss (B,), model_output)``) and
    :meth:`validation_metrics`. Optimizer and scheduler are Hydra partials (``_partial_: true``) so
    :meth:`configure_optimizers` can be called again after a model change (V-cycle).

    Args:
        optimizer: ``callable(params) -> Optimizer``; default AdamW(lr=1e-3, weight_decay=0.01).
        scheduler: ``callable(optimizer, total_steps=int) -> LRScheduler`` stepped every optimizer step, or None.
        weight_decay: if not None, applied to matrix parameters only (biases and norm weights get 0).

    Raises:
        ValueError: ``weight_decay`` not None or a finite number >= 0 (when built), or positive for an optimizer that
            has no weight decay, such as ``Rprop`` (when the optimizer is built).
    """

    #: number of transformer layers, for layer-token accounting (0 for non-transformer models)
    effi_num_layers: int = 0

    def __init__(
        self,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        weight_decay: float | None = None,
    ) -> None:
        super().__init__()
        # NaN / inf stopped the fit at step 1 blamed on the learning rate, and a negative value trained in silence:
        # torch checks a default weight_decay, not one set in a parameter group (qa58-args 05)
        if weight_decay is not None and (
            isinstance(weight_decay, bool)
            or not isinstance(weight_decay, Real)
            or not 0 <= float(weight_decay) < float("inf")
        ):
            raise ValueError(f"model.weight_decay: expected None or a finite number >= 0, got {weight_decay!r}")
        self.optimizer_factory = optimizer or default_optimizer
        self.scheduler_factory = scheduler
        self.weight_decay = weight_decay
        self.model: nn.Module

    # ----------------------------------------------------------------------------------------------- contract
    def per_sample_loss(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, Any]:
        """Return ``(loss (B,) float with grad, model output)`` for a batch. Implemented by subclasses."""
        raise NotImplementedError

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        per_sample, _ = self.per_sample_loss(batch)
        loss = per_sample.mean()
        self.log("train/loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=False, batch_size=len(per_sample))
        return {"loss": loss, "per_sample_loss": per_sample}

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def _eval_step(self, batch: Mapping[str, Tensor], stage: str) -> None:
        per_sample, output = self.per_sample_loss(batch)
        self.log(f"{stage}/loss", per_sample.mean(), prog_bar=True, batch_size=len(per_sample), sync_dist=True)
        self.update_metrics(stage, batch, output)

    def update_metrics(self, stage: str, batch: Mapping[str, Tensor], output: Any) -> None:
        """Update and log the task's torchmetrics for ``stage`` in {"val", "test"}."""

    # ------------------------------------------------------------------------------------------ optimization
    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer(self.optimizer_factory, self, self.weight_decay)
        if self.scheduler_factory is None:
            return optimizer
        progress = self.effi_progress_source()
        takes_progress = progress is not None and "progress" in inspect.signature(self.scheduler_factory).parameters
        total = self.trainer.estimated_stepping_batches
        finite = isinstance(total, int) or (total == total and total != float("inf"))
        if not finite and not takes_progress:
            raise ValueError(
                "model.scheduler needs a finite training length: set trainer.max_epochs or trainer.max_steps"
            )
        # with a technique's progress the schedule's length is the technique's (InfoBatch's num_epochs under
        # max_epochs=-1 and max_time was refused here, qa76-break 07)
        kwargs: dict[str, Any] = {"total_steps": int(total) if finite else None}
        if progress is not None and not takes_progress:
            rank_zero_warn(
                "A callback changes the epoch length (e.g. InfoBatch) but model.scheduler does not accept "
                "`progress`: its length comes from trainer.estimated_stepping_batches and will not match"
            )
        elif takes_progress:
            kwargs["progress"] = progress
        scheduler = self.scheduler_factory(optimizer, **kwargs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def effi_progress_source(self) -> Callable[[], float] | None:
        """``effi_progress`` of the first trainer callback that defines one (a technique that changes the epoch
        length), passed to progress-aware scheduler factories; None otherwise."""
        return progress_source(self.trainer.callbacks)  # type: ignore[attr-defined]

    def effi_data_limits(self) -> dict[str, int]:
        """What the model can take: ``vocab_size`` / ``max_length`` (upper bounds) and ``num_classes`` (exact)."""
        return {}

    def check_data_hints(self, hints: Mapping[str, Any]) -> None:
        """Check the model against the DataModule's ``model_hints()`` before training.

        Raises:
            ValueError: the data's vocabulary or sequence length exceeds the model's, or the class counts differ
                (naming the ``model.`` key).
        """
        for key, limit in self.effi_data_limits().items():
            need = hints.get(key)
            if need is None:
                continue
            if key == "num_classes" and need != limit:
                raise ValueError(f"model.num_classes: the model has {limit} classes, the data {need}")
            if key != "num_classes" and need > limit:
                raise ValueError(f"model.{key}: the model takes at most {limit}, the data needs {need}")

    def check_optimization(self) -> None:
        """Build the optimizer and scheduler once on the current parameters, so invalid values (a negative
        learning rate, a warmup fraction above 1) fail before training with the config key named.

        Raises:
            ValueError: naming ``model.optimizer`` or ``model.scheduler`` (and the argument, ``model.optimizer.lr``,
                where one whose default is a number was given something else).
        """
        _check_number_arguments(self.optimizer_factory, "model.optimizer")
        if self.scheduler_factory is not None:
            _check_number_arguments(self.scheduler_factory, "model.scheduler")
        try:
            optimizer = build_optimizer(self.optimizer_factory, self, self.weight_decay)
        except (ValueError, TypeError) as err:
            if str(err).startswith("model.weight_decay:"):
                raise
            raise ValueError(f"model.optimizer: {err}") from err
        if self.scheduler_factory is not None:
            try:
                self.scheduler_factory(optimizer, total_steps=1)
            except (ValueError, TypeError) as err:
                raise ValueError(f"model.scheduler: {err}") from err

    # ----------------------------------------------------------------------------------------- accounting
    def effi_training_flops(self, batch: Mapping[str, Tensor]) -> float:
        """Training FLOPs (forward + backward) of one batch. Default: measured with ``torch.utils.flop_counter``
        on a meta-device copy of the model, cached per input shape (see :mod:`lightning_effi.core.flops`)."""
        inputs = self.model_inputs(batch)
        return measured_training_flops(self.model, inputs)

    def effi_count_tokens(self, batch: Mapping[str, Tensor]) -> int:
        """Tokens in a training batch (for token and layer-token accounting). Default:
        :func:`lightning_effi.core.accounting.tokens_of`."""
        from lightning_effi.core.accounting import tokens_of

        return tokens_of(batch)

    def model_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The keyword arguments given to ``self.model`` for ``batch`` (used by FLOP measurement)."""
        raise NotImplementedError


def _check_number_arguments(factory: Callable[..., Any], key: str) -> None:
    """A partial's keyword arguments (Hydra's ``_partial_: true``) whose default in the target's signature is a
    number must be numbers (a tensor learning rate included): ``lr=abc`` would otherwise fail inside the optimizer
    with a comparison error that names neither the key nor the value.

    Raises:
        ValueError: ``<key>.<argument>: expected a number ...``.
    """
    target, keywords = getattr(factory, "func", None), getattr(factory, "keywords", None)
    if target is None or not isinstance(keywords, Mapping):
        return
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return
    for name, value in keywords.items():
        default = parameters[name].default if name in parameters else None
        if isinstance(default, bool) or not isinstance(default, (int, float)):
            continue
        if isinstance(value, bool) or not isinstance(value, (Real, Tensor)):  # numpy numbers are Real too
            raise ValueError(f"{key}.{name}: expected a number (its default is {default!r}), got {value!r}")
