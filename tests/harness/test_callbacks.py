"""The same checks over every public callback (settings in :mod:`tests.harness.settings`; Composer's
``tests/algorithms/`` is the model): training twice with one instance, exact resume, 2-process DDP, an eval-able
``repr`` and a safe, round-tripping ``state_dict``."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback

from lightning_effi import EfficiencyMonitor
from tests.harness.settings import SETTINGS, CallbackSettings, public_namespace
from tests.helpers.harness import _drop, assert_nested_equal, assert_resume_equals_uninterrupted, fit_ddp

#: (test name, callback class) -> the exact defect that makes that check fail today (strict xfail: remove the entry
#: once the defect is fixed, the check then passes)
KNOWN_DEFECTS: dict[tuple[str, type], str] = {}


def entries(test: str) -> list[Any]:
    """One ``pytest.param`` per settings entry, with the strict xfail of a known defect of that check."""
    out = []
    for cls, settings in SETTINGS.items():
        reason = KNOWN_DEFECTS.get((test, cls))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(cls, settings, id=cls.__name__, marks=marks))
    return out


def comparable(state: dict[str, Any], settings: CallbackSettings) -> dict[str, Any]:
    """A deep copy of ``state`` without the entry's wall-time keys."""
    state = copy.deepcopy(state)
    for key in settings.ignore_state:
        _drop(state, key)
    return state


def the_callback(trainer: pl.Trainer, cls: type) -> Callback:
    (cb,) = [c for c in trainer.callbacks if type(c) is cls]
    return cb


# ---------------------------------------------------------------------------------------------------- train twice
_TWICE: dict[type, dict[str, Any]] = {}


def fit_twice(cls: type, settings: CallbackSettings, root: Path) -> dict[str, Any]:
    """Fit with a callback, fit again with a fresh Trainer, module and DataModule but the same callback instance, and
    fit a fresh callback from the same seed (cached per class: two tests read the runs)."""
    if cls not in _TWICE:
        cb = settings.callback()
        first, _ = settings.fit(root / "first", cb)
        first_state = cb.state_dict()
        second, model_second = settings.fit(root / "second", cb)
        fresh_cb = settings.callback()
        fresh, model_fresh = settings.fit(root / "fresh", fresh_cb)
        _TWICE[cls] = dict(
            steps=(first.global_step, second.global_step, fresh.global_step),
            params=(model_second.state_dict(), model_fresh.state_dict()),
            states=(first_state, cb.state_dict(), fresh_cb.state_dict()),
        )
    return _TWICE[cls]


@pytest.mark.parametrize(("cls", "settings"), entries("test_fit_twice_matches_a_fresh_callback"))
def test_fit_twice_matches_a_fresh_callback(tmp_path_factory, cls, settings):
    """A second ``fit`` with the same callback instance runs to its end and trains exactly as a fresh callback."""
    runs = fit_twice(cls, settings, tmp_path_factory.mktemp(f"twice_{cls.__name__}"))
    assert runs["steps"] == (settings.steps,) * 3
    assert_nested_equal(*runs["params"], "params (second fit vs fresh callback)")


@pytest.mark.parametrize(("cls", "settings"), entries("test_fit_twice_carries_no_stale_state"))
def test_fit_twice_carries_no_stale_state(tmp_path_factory, cls, settings):
    """After the second ``fit`` the reused callback's state equals a fresh callback's after one ``fit`` (wall times
    aside): nothing of the first fit is carried over."""
    runs = fit_twice(cls, settings, tmp_path_factory.mktemp(f"twice_{cls.__name__}"))
    first, second, fresh = (comparable(s, settings) for s in runs["states"])
    assert_nested_equal(first, fresh, "callback state (first fit vs fresh callback)")  # the runs are deterministic
    assert_nested_equal(second, fresh, "callback state (second fit vs fresh callback)")


@pytest.mark.parametrize(
    ("cls", "settings"), [p for p in entries("test_a_setting_set_between_fits") if p.values[1].changed]
)
def test_a_setting_set_between_fits_trains_as_a_callback_built_with_it(tmp_path, cls, settings):
    """Settings set on the callback's attributes between two fits (``cb.require_steps = 2`` in a notebook cell)
    train the second fit as a callback built with them: several were overwritten in silence at the next fit (the
    attribute of that name is derived: random-LTD's ``require_steps``, ``max_value``; the curriculum's ``seed``
    lives in its config), or crashed the V-cycle's ``repr`` when the Trainer was built (``e_small``)."""
    cb = settings.callback()
    settings.fit(tmp_path / "first", cb)
    for name, value in settings.changed.items():
        setattr(cb, name, value)
    assert repr(cb).startswith(f"{cls.__name__}(")
    second, model = settings.fit(tmp_path / "second", cb)
    fresh, model_fresh = settings.fit(tmp_path / "fresh", settings.callback(**settings.changed))
    _, model_unchanged = settings.fit(tmp_path / "unchanged")
    assert second.global_step == fresh.global_step
    assert_nested_equal(model.state_dict(), model_fresh.state_dict(), "params (set between fits vs built with it)")
    assert repr(cb) == repr(settings.callback(**settings.changed))
    unchanged = model_unchanged.state_dict()
    assert any(not torch.equal(v, unchanged[k]) for k, v in model.state_dict().items())  # the settings matter


# ---------------------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize(("cls", "settings"), entries("test_resume_equals_uninterrupted"))
def test_resume_equals_uninterrupted(tmp_path, cls, settings):
    """A run resumed from the checkpoint of ``resume_step`` ends with the same parameters, optimizer state, learning
    rates and callback state as the uninterrupted run."""
    assert_resume_equals_uninterrupted(
        settings.model,
        settings.datamodule,
        tmp_path,
        total_steps=settings.steps,
        resume_step=settings.resume_step,
        callbacks_fn=lambda: [settings.callback()],
        ignore_state=settings.ignore_state,
        max_epochs=settings.max_epochs,
        **settings.trainer_kwargs,
    )


# ------------------------------------------------------------------------------------------------------------- DDP
class DumpState(Callback):
    """At the end of fit, saves the ``state_dict`` of the trainer's ``cls`` callback to ``<out>/state<rank>.pt``
    (each DDP process has its own copy of the callbacks)."""

    def __init__(self, cls: type, out: Path):
        self.cls, self.out = cls, str(out)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        Path(self.out).mkdir(parents=True, exist_ok=True)
        torch.save(the_callback(trainer, self.cls).state_dict(), Path(self.out) / f"state{trainer.global_rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize(("cls", "settings"), entries("test_ddp_two_processes"))
def test_ddp_two_processes(tmp_path, cls, settings):
    """Under DDP (2 processes, gloo) the run completes on both ranks at the same step, and a stateful callback ends
    with the same state on both ranks. The EfficiencyMonitor's processes are spawned (its callback, model and data
    pickled into fresh interpreters); the techniques' are forked, their ``ddp_spawn`` runs being
    ``tests/compat/test_runtime.py::test_ddp_spawn``."""
    pl.seed_everything(0, workers=True)
    _, ranks = fit_ddp(
        settings.model(),
        settings.datamodule(),
        tmp_path,
        [settings.callback(), DumpState(cls, tmp_path / "states")],
        start_method="spawn" if cls is EfficiencyMonitor else "fork",
        **settings.limits(),
        **settings.trainer_kwargs,
    )
    steps = [r["global_step"] for r in ranks]
    assert steps[0] == steps[1] > 0
    if settings.max_epochs is None:
        assert steps[0] == settings.steps
    if settings.stateful:
        states = [torch.load(tmp_path / "states" / f"state{r}.pt", weights_only=True) for r in range(2)]
        assert_nested_equal(*(comparable(s, settings) for s in states), "callback state (rank 0 vs rank 1)")


# ------------------------------------------------------------------------------------------------------------ repr
def rebuilt(cb: Callback) -> Callback:
    """``eval(repr(cb))`` with the public names of ``lightning_effi`` (a public callback must define ``__repr__``)."""
    assert type(cb).__repr__ is not object.__repr__, f"{type(cb).__name__} has no __repr__ of its own"
    return eval(repr(cb), public_namespace())  # noqa: S307 - the point of the test


@pytest.mark.parametrize(("cls", "settings"), entries("test_repr_round_trips"))
def test_repr_round_trips(cls, settings):
    """``eval(repr(cb))`` with the package's public names gives a callback of the same type and the same repr."""
    cb = settings.callback()
    again = rebuilt(cb)
    assert type(again) is type(cb)
    assert repr(again) == repr(cb)


@pytest.mark.parametrize(("cls", "settings"), entries("test_repr_keeps_every_argument"))
def test_repr_keeps_every_argument(cls, settings):
    """The callback rebuilt from its repr is configured like the original (the entries pass non-default arguments):
    the same state key and the same fresh ``state_dict()`` (which holds the configuration)."""
    cb = settings.callback()
    again = rebuilt(cb)
    assert again.state_key == cb.state_key
    assert_nested_equal(again.state_dict(), cb.state_dict(), "fresh state (rebuilt vs original)")


# ------------------------------------------------------------------------------------------------------ state_dict
class _Loaded(Exception):
    """Ends a fit right after the callbacks' setup (see :func:`load_after_setup`)."""


class LoadAfterSetup(Callback):
    """Listed after the callback under test: in ``setup`` (after the callback's own ``setup``) restores ``state`` as
    Lightning restores a checkpoint (``LightningModule.on_load_checkpoint``, then the callback's
    ``on_load_checkpoint`` and ``load_state_dict``), records the callback's ``state_dict()`` and ends the fit."""

    def __init__(self, target: Callback, state: dict[str, Any]):
        self.target, self.state = target, state
        self.reloaded: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        checkpoint = {"callbacks": {self.target.state_key: self.state}}
        pl_module.on_load_checkpoint(checkpoint)
        self.target.on_load_checkpoint(trainer, pl_module, checkpoint)
        self.target.load_state_dict(self.state)
        self.reloaded = self.target.state_dict()
        raise _Loaded


def load_after_setup(settings: CallbackSettings, root: Path, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` loaded into a fresh callback that went through ``setup`` of a fresh run of the entry (as Lightning
    loads callback states when resuming); returns the fresh callback's ``state_dict()`` after loading."""
    probe = LoadAfterSetup(settings.callback(), state)
    pl.seed_everything(0, workers=True)
    with pytest.raises(_Loaded):
        settings.trainer(root, [probe.target, probe]).fit(settings.model(), datamodule=settings.datamodule())
    return probe.reloaded


class CaptureState(Callback):
    """Listed after the callback under test: a deep copy of its ``state_dict()`` after the batch that completes
    optimizer step ``step`` (mid-run state: pending accumulators, snapshots, partial epochs)."""

    def __init__(self, target: Callback, step: int):
        self.target, self.step = target, step
        self.state: dict[str, Any] | None = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step and self.state is None:
            self.state = copy.deepcopy(self.target.state_dict())


@pytest.mark.parametrize(("cls", "settings"), entries("test_state_dict_round_trips"))
def test_state_dict_round_trips(tmp_path, cls, settings):
    """The state after ``resume_step`` steps survives ``torch.save`` / ``torch.load(weights_only=True)`` unchanged,
    and loading it into a fresh callback gives back an equal ``state_dict()``."""
    cb = settings.callback()
    capture = CaptureState(cb, settings.resume_step)
    settings.fit(tmp_path / "fit", cb, extra=[capture])
    state = capture.state
    assert state is not None, f"no optimizer step {settings.resume_step} in the run"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    safe = torch.load(buffer, weights_only=True)  # only safe types
    assert_nested_equal(state, safe, "state (saved vs loaded)")
    reloaded = load_after_setup(settings, tmp_path / "load", safe)
    assert_nested_equal(state, reloaded, "state (original vs loaded into a fresh callback)")


@pytest.mark.parametrize("cls, settings", entries("test_strict_must_be_a_bool"))
def test_strict_must_be_a_bool(cls, settings):
    """``strict`` decides whether a changed configuration raises on resume: a string such as "false" is refused."""
    text = repr(settings.callback())
    if "strict=True" not in text:
        pytest.skip(f"{cls.__name__} has no strict argument")
    for bad in ("'false'", "0", "None"):
        with pytest.raises(ValueError, match=r"\.strict must be a bool"):
            eval(text.replace("strict=True", f"strict={bad}"), public_namespace())
