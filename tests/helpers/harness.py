"""The shared test harness: train k steps, checkpoint mid-epoch and resume, compare with the uninterrupted run; fit
under DDP on CPU (2 processes, gloo) and collect what each rank saw.

Every technique's tests reuse these (``docs/architecture.md``; Composer's ``test_algorithm_resumption.py``).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch.multiprocessing.spawn import ProcessExitedException

ModelFn = Callable[[], pl.LightningModule]
DataFn = Callable[[], pl.LightningDataModule]
CallbacksFn = Callable[[], Sequence[Callback]]


class MetricsCapture(Logger):
    """A logger that keeps every ``log_metrics`` call: ``logged`` is a list of ``(step, metrics)``; :meth:`series`
    reads one key's values in order (for metrics written straight to the loggers, which ``callback_metrics`` never
    holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @property
    def metrics(self) -> list[dict[str, float]]:
        """The logged metric dicts, in order (without their steps)."""
        return [m for _, m in self.logged]

    def series(self, key: str) -> list[tuple[int | None, float]]:
        """``(step, value)`` of every logged ``key``, in order."""
        return [(step, float(m[key])) for step, m in self.logged if key in m]


def make_trainer(root: Path, callbacks: Sequence[Callback] = (), **kwargs: Any) -> pl.Trainer:
    """A quiet, deterministic CPU trainer writing under ``root``."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
        default_root_dir=str(root),
        limit_val_batches=0,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **defaults)


def fit_steps(
    model_fn: ModelFn,
    data_fn: DataFn,
    steps: int,
    root: Path,
    callbacks_fn: CallbacksFn = lambda: (),
    seed: int = 0,
    **trainer_kwargs: Any,
) -> tuple[pl.Trainer, pl.LightningModule]:
    """Seed, build and fit for ``steps`` optimizer steps; returns ``(trainer, model)``."""
    pl.seed_everything(seed, workers=True)
    model = model_fn()
    trainer = make_trainer(root, callbacks_fn(), max_steps=steps, max_epochs=-1, **trainer_kwargs)
    trainer.fit(model, datamodule=data_fn())
    return trainer, model


def optimizer_state(trainer: pl.Trainer) -> list[dict[str, Any]]:
    return [opt.state_dict() for opt in trainer.optimizers]


def assert_nested_equal(a: Any, b: Any, path: str = "") -> None:
    """Exact equality of nested dicts/lists/tensors/numbers (tensors with ``torch.equal``; NaN equals NaN)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, f"tensors differ at {path}"
        same = torch.equal(a, b) or (
            a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        )
        assert same, f"tensors differ at {path}"
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"keys differ at {path}: {set(a) ^ set(b)}"
        for key in a:
            assert_nested_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"lengths differ at {path}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_nested_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"values differ at {path}: {a!r} != {b!r}"


def callback_states(trainer: pl.Trainer, skip: tuple[type, ...] = (ModelCheckpoint,)) -> dict[str, Any]:
    """``state_dict()`` of every callback except ``skip`` (ModelCheckpoint paths differ between runs)."""
    return {cb.state_key: cb.state_dict() for cb in trainer.callbacks if not isinstance(cb, skip)}


def assert_resume_equals_uninterrupted(
    model_fn: ModelFn,
    data_fn: DataFn,
    root: Path,
    total_steps: int,
    resume_step: int,
    callbacks_fn: CallbacksFn = lambda: (),
    ignore_state: Sequence[str] = (),
    max_epochs: int | None = None,
    **trainer_kwargs: Any,
) -> tuple[pl.Trainer, pl.Trainer]:
    """Train ``total_steps`` uninterrupted (checkpointing every step), then resume a fresh run from the checkpoint
    taken after ``resume_step`` steps and train to ``total_steps``. With ``max_epochs``, both runs are bounded by
    epochs instead (``max_steps=-1``; for techniques that plan by epochs) and ``total_steps`` is only checked.
    Asserts that weights, optimizer state, learning
    rates and callback states (minus ``ignore_state`` keys, e.g. wall-time counters) are exactly equal, and that the
    checkpoint loads with ``torch.load(weights_only=True)``. Returns ``(uninterrupted, resumed)`` trainers."""
    ckpt_dir = root / "ckpts"
    checkpoint = lambda: ModelCheckpoint(
        dirpath=ckpt_dir,
        every_n_train_steps=1,
        save_top_k=-1,  # noqa: E731
        filename="{step}",
        save_on_train_epoch_end=False,
    )
    limits = dict(max_steps=total_steps, max_epochs=-1) if max_epochs is None else dict(max_epochs=max_epochs)
    pl.seed_everything(0, workers=True)
    model_a = model_fn()
    trainer_a = make_trainer(root / "a", [*callbacks_fn(), checkpoint()], **limits, **trainer_kwargs)
    trainer_a.fit(model_a, datamodule=data_fn())

    path = ckpt_dir / f"step={resume_step}.ckpt"
    assert path.exists(), f"no checkpoint at step {resume_step}: {sorted(os.listdir(ckpt_dir))}"
    torch.load(path, weights_only=True)  # safe loading must work

    pl.seed_everything(1234, workers=True)  # a different global seed: resume must not depend on it
    model_b = model_fn()
    trainer_b = make_trainer(root / "b", [*callbacks_fn()], **limits, **trainer_kwargs)
    trainer_b.fit(model_b, datamodule=data_fn(), ckpt_path=path)

    assert trainer_b.global_step == trainer_a.global_step == total_steps
    assert_nested_equal(model_a.state_dict(), model_b.state_dict(), "model")
    assert_nested_equal(optimizer_state(trainer_a), optimizer_state(trainer_b), "optimizer")
    lrs = lambda t: [g["lr"] for o in t.optimizers for g in o.param_groups]  # noqa: E731
    assert lrs(trainer_a) == lrs(trainer_b)
    state_a, state_b = callback_states(trainer_a), callback_states(trainer_b)
    for states in (state_a, state_b):
        for state in states.values():
            for key in ignore_state:
                _drop(state, key)
    assert_nested_equal(state_a, state_b, "callbacks")
    return trainer_a, trainer_b


def _drop(state: Any, dotted: str) -> None:
    """Delete the entry at ``dotted`` (``*`` stands for every element of a list)."""
    head, _, rest = dotted.partition(".")
    if head == "*" and isinstance(state, list):
        for item in state:
            _drop(item, rest)
    elif isinstance(state, dict) and head in state:
        if rest:
            _drop(state[head], rest)
        else:
            del state[head]


class RecordBatches(Callback):
    """Records, per rank, every training batch's epoch, ``index`` (from the step's outputs or the batch, if present),
    a fingerprint of each sample and the loss, and dumps them with the final global step, the efficiency summary
    and the ``score`` table of any callback that has one to ``<out_dir>/rank<r>.json`` at the end of fit (works
    across ``ddp_fork`` / ``ddp_spawn`` processes). Add it after the EfficiencyMonitor."""

    def __init__(self, out_dir: str | Path):
        self.out_dir = str(out_dir)
        self.batches: list[dict[str, Any]] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        record: dict[str, Any] = {
            "batch_idx": batch_idx,
            "epoch": trainer.current_epoch,
            "loss": float(outputs["loss"]),
        }
        index = outputs.get("index") if isinstance(outputs, dict) else None
        if index is None and isinstance(batch, dict):
            index = batch.get("index")
        if index is not None:
            record["index"] = index.tolist()
        if isinstance(batch, dict):
            for key in ("input_ids", "pixel_values"):
                if key in batch:  # a position-weighted sum: distinct samples give distinct fingerprints
                    flat = batch[key].flatten(1).double()
                    weights = torch.linspace(1.0, 2.0, flat.shape[1], dtype=torch.float64) ** 7
                    record["fingerprint"] = (flat * weights).sum(1).tolist()
        self.batches.append(record)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        summaries = [getattr(cb, "summary", None) for cb in trainer.callbacks if hasattr(cb, "compute_summary")]
        scores = {
            type(cb).__name__: cb.score.tolist()
            for cb in trainer.callbacks
            if isinstance(getattr(cb, "score", None), torch.Tensor)
        }
        tokens = {  # InfoBatch's per-sample token table
            type(cb).__name__: cb.sample_tokens.tolist()
            for cb in trainer.callbacks
            if isinstance(getattr(cb, "sample_tokens", None), torch.Tensor)
        }
        record = {
            "batches": self.batches,
            "global_step": trainer.global_step,
            "summary": (summaries or [None])[0],
            "scores": scores,
            "sample_tokens": tokens,
        }
        with open(Path(self.out_dir) / f"rank{trainer.global_rank}.json", "w") as f:
            json.dump(record, f)


def fit_ddp(
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule,
    root: Path,
    callbacks: Sequence[Callback] = (),
    ckpt_path: str | Path | None = None,
    start_method: str = "fork",
    **kwargs: Any,
) -> tuple[pl.Trainer, list[dict[str, Any]]]:
    """Fit under DDP on CPU with 2 processes (gloo) that Lightning starts from this one: forked by default
    (``strategy="ddp_fork"``, no re-import: about 2 s a fit instead of 30 on 2 CPU cores), or spawned
    (``start_method="spawn"``: ``strategy="ddp_spawn"``, which pickles the model, data and callbacks into fresh
    interpreters; the tests of that path use it). Returns the trainer and, per rank, what a :class:`RecordBatches`
    callback added here recorded: ``{"batches": [...], "global_step": int, "summary": the EfficiencyMonitor summary or
    None}``. ``ckpt_path`` resumes from that checkpoint. (The processes do not update the parent's trainer and
    callbacks.)"""
    if start_method not in ("fork", "spawn"):
        raise ValueError(f"start_method must be 'fork' or 'spawn', got {start_method!r}")
    record_dir = root / "ddp_records"
    strategy = "ddp_fork" if start_method == "fork" else "ddp_spawn"
    trainer = make_trainer(root, [*callbacks, RecordBatches(record_dir)], strategy=strategy, devices=2, **kwargs)
    for stale in record_dir.glob("rank*.json"):  # records of an earlier fit in the same folder
        stale.unlink()
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    except ProcessExitedException as err:
        # gloo on torch 2.14 sometimes aborts a worker as it exits ("terminate called without an active exception",
        # SIGABRT), after the fit and its on_fit_end ran: accepted only when every rank wrote its records, i.e.
        # the run itself completed on both ranks
        complete = all((record_dir / f"rank{rank}.json").exists() for rank in range(2))
        if "SIGABRT" not in str(err) or not complete:
            raise
        warnings.warn(f"fit_ddp: a worker aborted at exit after the fit completed ({err})", stacklevel=2)
    per_rank = []
    for rank in range(2):
        with open(record_dir / f"rank{rank}.json") as f:
            per_rank.append(json.load(f))
    return trainer, per_rank
