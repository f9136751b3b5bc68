"""Every non-public Lightning call lightning_effi makes, in one place, pinned to the supported Lightning range.

The techniques call these functions instead of Lightning internals, so a Lightning upgrade is checked here (and by
``tests/framework/``, which pins the behaviour relied on) rather than in every callback.
"""

from __future__ import annotations

from typing import Any

import lightning
import lightning.pytorch as pl
from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy

__all__ = [
    "SUPPORTED_LIGHTNING",
    "end_rank_processes",
    "flat_hyperparameters",
    "launches_rank_scripts",
    "lightning_version_supported",
    "logging_step",
    "optimizers_to_device",
    "rebuild_train_loader_after_restore",
    "restart_next_epoch_at_its_start",
    "rewrap_ddp",
    "uses_distributed_sampler",
    "validation_follows_batch",
]

#: Lightning versions whose non-public APIs are used below (the ``lightning`` requirement in ``pyproject.toml``).
SUPPORTED_LIGHTNING = ">=2.6.1,<2.7"


def lightning_version_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed ``lightning.__version__``) lies in :data:`SUPPORTED_LIGHTNING`."""
    from packaging.specifiers import SpecifierSet

    return (version or lightning.__version__) in SpecifierSet(SUPPORTED_LIGHTNING)


def rewrap_ddp(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Wrap ``pl_module`` in a new ``DistributedDataParallel`` after its parameters changed shape (DDP only).

    Sets ``strategy.model`` to the bare module, then calls ``DDPStrategy.configure_ddp()`` (which asserts that
    ``strategy.model`` is the bare LightningModule). Under DDP every rank must call it at the same step: the new
    wrapper broadcasts rank 0's parameters. Returns whether a DDP strategy was re-wrapped.
    """
    strategy = trainer.strategy
    if not isinstance(strategy, DDPStrategy):
        return False
    strategy.model = pl_module
    strategy.configure_ddp()
    return True


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    """Move every optimizer's state tensors to ``device`` (``lightning.fabric.utilities.optimizer``, non-public)."""
    _optimizers_to_device(optimizers, device)


def flat_hyperparameters(params: Any) -> dict[str, Any]:
    """``params`` (a mapping or ``argparse.Namespace``) flattened as Lightning's ``MLFlowLogger.log_hyperparams``
    flattens them (``lightning.fabric.utilities.logger._convert_params`` / ``_flatten_dict``, non-public): nested
    mappings, namespaces, dataclasses and lists of mappings, keys joined by ``/``."""
    return dict(_flatten_dict(_convert_params(params)))


def runs_in_spawned_processes(trainer: pl.Trainer) -> bool:
    """Whether the Trainer's strategy runs the fit in processes it spawns or forks (``ddp_spawn``, ``ddp_fork``,
    ``ddp_notebook``: Lightning's ``_MultiProcessingLauncher``): the callbacks of the launching process then see
    nothing of the fit."""
    return type(getattr(trainer.strategy, "launcher", None)).__name__ == "_MultiProcessingLauncher"


def logging_step(trainer: pl.Trainer, epoch_end: bool = False) -> int:
    """The step Lightning writes ``LightningModule.log`` values at: its fit loop's ``_batches_that_stepped``, within a
    training batch's hooks and the validation after it the batches that stepped before it (``global_step - 1`` under
    automatic optimization). With ``epoch_end`` (called from ``on_train_epoch_end`` or later, when every batch of the
    epoch has stepped): one less, where Lightning writes the epoch's ``on_epoch`` metrics (``_FitLoop.on_advance_end``
    lowers the count around that write), the row of the epoch's last batch and of an epoch-end validation. Metrics
    written to the loggers directly at this step land in the rows of the module's ``train/loss`` and ``val/loss``.
    ``global_step`` outside a fit loop (a Trainer stand-in without one)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    step = int(step) if isinstance(step, int) else int(trainer.global_step)
    return max(step - 1, 0) if epoch_end else step


def end_rank_processes(failed: bool, timeout: float = 60.0) -> None:
    """End the rank processes this process started with ``strategy=ddp`` (Lightning's ``_SubprocessScriptLauncher``)
    and the watchdog threads that follow them (``_ChildProcessObserver``): a job of a sweep is over, and the next one
    starts its own. A watchdog left running SIGKILLed this process, by then training the next job, when the ended
    job's rank 1 exited with an error. Each rank is given ``timeout`` seconds to exit (5 after a ``failed`` job,
    whose ranks may wait in a collective for ever), then killed."""
    import subprocess
    import threading

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    for thread in threading.enumerate():
        if not isinstance(thread, _ChildProcessObserver):
            continue
        thread._run = lambda: True  # type: ignore[method-assign]  # its next poll ends it, killing nothing
        thread._finished = True
        for process in thread._child_processes:
            try:
                process.wait(timeout=5.0 if failed else timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def launches_rank_scripts(trainer: pl.Trainer) -> bool:
    """Whether the Trainer starts its other ranks by running the launching script again (``strategy=ddp`` over
    several local processes: Lightning's ``_SubprocessScriptLauncher``, which under Hydra builds their command from
    ``sys.argv`` and ``HydraConfig.get().run.dir``)."""
    launcher = getattr(trainer.strategy, "launcher", None)
    if type(launcher).__name__ != "_SubprocessScriptLauncher":
        return False
    environment = getattr(trainer.strategy, "cluster_environment", None)
    return not getattr(environment, "creates_processes_externally", False) and trainer.num_devices > 1


def uses_distributed_sampler(trainer: pl.Trainer) -> bool:
    """Whether Lightning injects a ``DistributedSampler`` into the training loader
    (``Trainer(use_distributed_sampler)``, read from the trainer's non-public accelerator connector)."""
    return bool(trainer._accelerator_connector.use_distributed_sampler)


def validation_follows_batch(trainer: pl.Trainer) -> bool:
    """Whether Lightning validates after the training batch in flight (read in ``on_train_batch_end``, or in a
    checkpoint written there): the fit loop's non-public rule ``_TrainingEpochLoop._should_check_val_fx`` (the
    ``val_check_interval``, the epoch's last batch, ``check_val_every_n_epoch``, an early stop). A checkpoint written
    in ``on_train_batch_end`` (``ModelCheckpoint(every_n_train_steps=...)``) comes before that validation, and a fit
    resumed from it goes on past the validation without running it (``_TrainingEpochLoop.advance``:
    ``increment_progress_to_evaluation_end``)."""
    loop = trainer.fit_loop
    fetcher = loop._data_fetcher
    return fetcher is not None and bool(loop.epoch_loop._should_check_val_fx(fetcher))


def rebuild_train_loader_after_restore(trainer: pl.Trainer) -> bool:
    """In a fit resumed from a checkpoint, drop a training loader built before the checkpoint's loop state was
    restored, so that the fit loop builds it again afterwards and loads the checkpoint's loader state into it.

    A ``configure_optimizers`` that reads ``trainer.estimated_stepping_batches`` (of an epoch-bounded fit) builds the
    training loader during the strategy's setup, before ``restore_training_state``; the fit loop then keeps that
    loader in the resumed epoch and never loads the saved loader state (``_FitLoop.setup_data`` returns early), so a
    mid-epoch resume replays the epoch from its start (Lightning issue #20550). Call from ``on_fit_start``, which
    runs between the two. Clears the fit loop's non-public ``_combined_loader`` and tears down its data fetcher.
    Returns whether a loader was dropped (False in a fresh fit, or when nothing was built early).
    """
    loop = trainer.fit_loop
    if trainer.ckpt_path is None or loop._combined_loader is None:
        return False
    if loop._data_fetcher is not None:
        loop._data_fetcher.teardown()
        loop._data_fetcher = None
    loop._combined_loader = None
    return True


def restart_next_epoch_at_its_start(trainer: pl.Trainer) -> bool:
    """In a fit resumed from a checkpoint written at the last batch of an epoch, start the next epoch at its first
    batch, whatever its length.

    Lightning resumes such a checkpoint (``ModelCheckpoint(every_n_train_steps=...)`` firing at an epoch's last
    batch) by advancing to the next epoch while keeping the finished epoch's batch count; ``_TrainingEpochLoop.reset``
    clears that count only when it reaches the *new* epoch's ``num_training_batches``. With epochs of different
    lengths (InfoBatch's pruned epochs), a new epoch longer than the finished one is entered at the finished one's
    count: the resumed run skips its first batches. This does what Lightning does for equal lengths: the epoch
    loop's progress ``reset_on_run`` and its restart stage cleared (so its ``reset`` restarts at batch 0, still
    counting the step that was taken before the checkpoint). Call from ``on_train_start``, which runs after the fit
    loop's ``reset`` (the epoch advanced) and before the epoch loop's. Reads the loops' non-public restart stages.
    Returns whether the progress was reset (False unless resumed at an epoch's last batch).
    """
    fit_loop = trainer.fit_loop
    loop = fit_loop.epoch_loop
    if not (fit_loop.restarted_mid_epoch and loop.restarted_on_train_batch_end and loop.batch_progress.is_last_batch):
        return False
    loop.batch_progress.reset_on_run()
    loop.scheduler_progress.reset_on_run()
    loop.automatic_optimization.optim_progress.reset_on_run()
    loop.val_loop.batch_progress.total.reset()
    loop.reset_restart_stage()
    return True
