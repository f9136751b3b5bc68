"""Exception safety: a fit that raises (an error in a callback or in ``training_step``, Ctrl+C) leaves the module and
the Trainer as a normal end of fit does, and ``setup`` on a module that an earlier fit left changed restores it (or
refuses it, naming what it found).

Lightning 2.6 (``trainer/call.py``, ``_call_and_handle_interrupt``): on any exception it calls every callback's
``on_exception``, then the (outermost) DataModule's, then tears the strategy down (the module goes to the CPU) and
re-raises, without calling the callbacks' ``teardown``; a ``KeyboardInterrupt`` takes the same path and ends in
``sys.exit(1)`` (``SystemExit``). An ``on_exception`` that raises stops the remaining ones (and the strategy's
teardown): the tests use that to leave a module changed, as a process where ``on_exception`` could not run would.

Stacks: each technique alone and the four together on a tiny 4-layer GPT-2, built as in
``tests/composition/test_matrix.py``. The failure comes inside the V-cycle's coarse stage (step 3 of 10: level 2
from step 2 to step 6) and, for InfoBatch alone, inside its pruned epoch (step 5, epoch 1 of 3 on 16 samples).
"""

from __future__ import annotations

import contextlib
import copy
import signal
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from torch.nn.modules import module as torch_module

from lightning_effi import (
    EfficiencyMonitor,
    RandomLTDCallback,
    VCycleCallback,
)
from lightning_effi.core.wrapping import wrapper_chain
from lightning_effi.models.base import find_adapter
from lightning_effi.random_ltd.patching import LTDController, convert, find_patches, restore_module
from lightning_effi.tasks import GPT2CausalLM
from tests.composition.test_matrix import Stack
from tests.harness.settings import seeded
from tests.helpers.harness import assert_nested_equal, make_trainer
from tests.helpers.tiny import TINY_GPT2, TinyDataModule, TokenBlocks, sgd

N, BATCH = 24, 4
#: InfoBatch alone plans by epochs: a smaller training set keeps its three epochs short
N_EPOCHS = 16
ALL = ("infobatch", "curriculum", "random_ltd", "vcycle")
STACKS = [("infobatch",), ("curriculum",), ("random_ltd",), ("vcycle",), ALL]
#: where the fit fails: a RuntimeError in a callback, an out-of-memory error in training_step, Ctrl+C in training_step
KINDS = ("callback", "training_step_oom", "keyboard_interrupt")
#: what the fit's own code raises for each kind
RAISED: dict[str, type[BaseException]] = {
    "callback": RuntimeError,
    "training_step_oom": torch.OutOfMemoryError,
    "keyboard_interrupt": KeyboardInterrupt,
}
#: what an earlier fit that did not end leaves, as the next fit's setup reports it
LEFTOVER_WARNINGS = {
    "random_ltd": "still patched by an earlier random-LTD fit that did not end",
    "infobatch": "still wrapped by an earlier InfoBatch fit that did not end",
    "vcycle": "left this module at level 2",
}


class FailingGPT2(GPT2CausalLM):
    """The tiny GPT-2 of the composition matrix, whose ``training_step`` raises ``fail`` at optimizer step
    ``fail_at`` (None: never)."""

    fail_at: int | None = None
    fail: type[BaseException] = RuntimeError

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.fail_at is not None and self.trainer.global_step == self.fail_at:
            raise self.fail("training_step failed")
        return super().training_step(batch, batch_idx)


def make_model() -> FailingGPT2:
    return seeded(FailingGPT2, **{**TINY_GPT2, "n_layer": 4, "optimizer": sgd})()


class RecordingData(TinyDataModule):
    """The user's DataModule: records the exception its ``on_exception`` receives."""

    def __init__(self, n: int) -> None:
        super().__init__(TokenBlocks(n=n), batch_size=BATCH)
        self.exceptions: list[BaseException] = []

    def on_exception(self, exception: BaseException) -> None:
        self.exceptions.append(exception)


def datamodule(callbacks: Sequence[Callback]) -> pl.LightningDataModule:
    """The user's DataModule wrapped as the Hydra app wraps it (each technique's ``wrap_datamodule``): :data:`N`
    samples, :data:`N_EPOCHS` for InfoBatch alone."""
    names = {type(cb).__name__ for cb in callbacks}
    epochs = "InfoBatchCallback" in names and "Curriculum" not in names
    dm: pl.LightningDataModule = RecordingData(N_EPOCHS if epochs else N)
    for cb in callbacks:
        wrap = getattr(cb, "wrap_datamodule", None)
        if callable(wrap):
            dm = wrap(dm)
    return dm


class Failure(Callback):
    """At the start of optimizer step ``step``: records the epoch and the V-cycle's level, writes a checkpoint (what
    the run holds at that moment) and raises ``exc`` (None: the module's ``training_step`` raises next)."""

    def __init__(self, step: int, ckpt: Path, exc: type[BaseException] | None = None) -> None:
        self.step, self.ckpt, self.exc = step, ckpt, exc
        self.epoch: int | None = None
        self.level: int | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step != self.step or self.epoch is not None:
            return
        self.epoch = trainer.current_epoch
        self.level = next((cb.level for cb in trainer.callbacks if isinstance(cb, VCycleCallback)), None)
        trainer.save_checkpoint(self.ckpt)
        if self.exc is not None:
            raise self.exc("callback failed")


class BrokenOnException(Callback):
    """Listed first, its ``on_exception`` raises: Lightning then calls no later ``on_exception`` (nor any teardown),
    so the techniques' changes stay on the module, as after a process where ``on_exception`` could not run."""

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        raise RuntimeError("on_exception failed")


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, b: Any, i: int) -> None:
        self.losses.append(float(out["loss"]))


@pytest.fixture(autouse=True)
def sigint_handler() -> Iterator[None]:
    """Lightning ignores SIGINT while it shuts down after a KeyboardInterrupt; whatever happens, the test session gets
    its handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def fail_step(stack: Stack) -> int:
    return 5 if stack.epoch_bounded else 3


def shapes(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(k, tuple(v.shape)) for k, v in module.state_dict().items()]


def global_hooks() -> list[int]:
    """How many process-wide module hooks are registered (the EfficiencyMonitor's call recorder uses them)."""
    return [
        len(torch_module._global_forward_pre_hooks),
        len(torch_module._global_forward_hooks),
        len(torch_module._global_backward_hooks),
    ]


def assert_nothing_left(model: pl.LightningModule) -> None:
    """No submodule with an instance-level ``forward`` or a random-LTD hook, the class's ``training_step``, no V-cycle
    resume hook."""
    assert [name for name, m in model.named_modules() if "forward" in m.__dict__] == []
    assert find_patches(model) == []
    for hook in ("training_step", "on_load_checkpoint", "on_save_checkpoint"):
        assert hook not in vars(model), hook


def plain_run(module: pl.LightningModule, root: Path) -> tuple[float, list[float], dict[str, torch.Tensor]]:
    """No technique: the validation loss, then a 2-step fit's training losses and final weights."""
    pl.seed_everything(0, workers=True)
    losses = Losses()
    trainer = make_trainer(root, [losses], max_steps=2, max_epochs=-1, limit_val_batches=2)
    data = TinyDataModule(TokenBlocks(n=N), batch_size=BATCH)
    val = trainer.validate(module, datamodule=data, verbose=False)[0]["val/loss"]
    trainer.fit(module, datamodule=data)  # the epoch does not end: no validation inside
    return float(val), losses.losses, copy.deepcopy(module.state_dict())


def assert_like_fresh(model: pl.LightningModule, root: Path) -> None:
    """A plain validate and fit of ``model`` give exactly what they give on a fresh module with its weights."""
    fresh = make_model()
    fresh.load_state_dict(model.state_dict())
    val, losses, weights = plain_run(model, root / "module")
    fresh_val, fresh_losses, fresh_weights = plain_run(fresh, root / "fresh")
    assert (val, losses) == (fresh_val, fresh_losses)
    assert_nested_equal(weights, fresh_weights, "weights")


def refit(stack: Stack, module: pl.LightningModule, root: Path, steps: int = 4) -> tuple[int, dict[str, Any]]:
    """A new fit of ``module`` with new callbacks of ``stack`` (``steps`` optimizer steps, or InfoBatch's epochs):
    ``(global_step, final weights)``."""
    pl.seed_everything(0, workers=True)
    callbacks = stack.callbacks()
    limits = stack.limits() if stack.epoch_bounded else {**stack.limits(), "max_steps": steps}
    trainer = make_trainer(root, callbacks, **limits)
    trainer.fit(module, datamodule=datamodule(callbacks))
    assert_nothing_left(module)
    return trainer.global_step, copy.deepcopy(module.state_dict())


def fail(
    stack: Stack,
    kind: str,
    model: FailingGPT2,
    root: Path,
    first: Sequence[Callback] = (),
    match: str = "failed",
    **trainer_kwargs: Any,
) -> Any:
    """Fit ``model`` with the stack's callbacks (after ``first``) until the failure of ``kind`` at :func:`fail_step`;
    the fit must raise an exception matching ``match``. Returns ``(trainer, callbacks, datamodule, failure,
    raised)``."""
    step = fail_step(stack)
    exc = RAISED[kind] if kind == "callback" else None
    model.fail = RAISED[kind]
    model.fail_at = None if kind == "callback" else step
    failure = Failure(step, root / "at_failure.ckpt", exc)
    pl.seed_everything(0, workers=True)
    callbacks = stack.callbacks()
    dm = datamodule(callbacks)
    trainer = make_trainer(root / "run", [*first, *callbacks, failure], **stack.limits(), **trainer_kwargs)
    expected = SystemExit if kind == "keyboard_interrupt" else RuntimeError
    with pytest.raises(expected, match=None if kind == "keyboard_interrupt" else match) as raised:
        trainer.fit(model, datamodule=dm)
    model.fail_at = None
    return trainer, callbacks, dm, failure, raised


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("names", STACKS, ids="+".join)
def test_a_fit_that_raises_leaves_the_module_as_a_fresh_one(tmp_path, names, kind):
    stack = Stack(names, False)
    model = make_model()
    original = shapes(model)
    warns = pytest.warns(UserWarning, match="put a full-size network back in pl_module.model")
    with warns if "vcycle" in names else contextlib.nullcontext():
        trainer, callbacks, dm, failure, raised = fail(stack, kind, model, tmp_path)

    # it failed where planned: inside the coarse stage, inside InfoBatch's pruned epoch
    assert trainer.global_step == fail_step(stack)
    assert failure.level == (2 if "vcycle" in names else None)
    assert failure.epoch == (1 if stack.epoch_bounded else 0)
    if kind == "keyboard_interrupt":  # Lightning's graceful shutdown: on_exception ran, then sys.exit(1)
        assert raised.value.code == 1

    # nothing left on the module, the Trainer or the DataModules
    assert_nothing_left(model)
    assert shapes(model) == original
    assert trainer.reload_dataloaders_every_n_epochs == 0
    for wrapper in wrapper_chain(dm)[:-1]:
        assert wrapper.effi_batch_meta is None
        assert getattr(wrapper, "planner", None) is None and getattr(wrapper, "thinner", None) is None
    user_dm = wrapper_chain(dm)[-1]
    assert [type(e) for e in user_dm.exceptions] == [RAISED[kind]]  # passed on through the technique DataModules
    for cb in callbacks:
        if isinstance(cb, RandomLTDCallback):
            assert cb.patched is None and cb.controller is not None and not cb.controller.armed
        if isinstance(cb, VCycleCallback):  # back at full size; its state still describes the interrupted level
            assert cb.level == 1 and cb.state_dict()["level"] == 2
    # the weights are those of the step that failed (at level 2: de-coalesced to full size, as its checkpoint holds)
    checkpoint = torch.load(failure.ckpt, weights_only=True)
    assert_nested_equal(model.state_dict(), checkpoint["state_dict"], "state_dict")

    # a plain validate and fit afterwards give what they give on a fresh module with these weights
    assert_like_fresh(model, tmp_path / "plain")


@pytest.mark.parametrize("names", STACKS, ids="+".join)
def test_a_refit_after_a_raise_trains_as_on_a_fresh_module(tmp_path, names):
    """A new fit with new callbacks of the same techniques, on the module a failed fit left (the three failures leave
    the same state, checked above), works without a leftover warning and ends with exactly the weights of the same fit
    on a fresh module with the same weights."""
    stack = Stack(names, False)
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the V-cycle's warning: tested above
        fail(stack, "callback", model, tmp_path)
    fresh = make_model()
    fresh.load_state_dict(model.state_dict())
    with leftover_warnings([]):
        steps, weights = refit(stack, model, tmp_path / "refit")
    fresh_steps, fresh_weights = refit(stack, fresh, tmp_path / "refit_fresh")
    assert steps == fresh_steps > 0
    assert_nested_equal(weights, fresh_weights, "refit")


@pytest.mark.parametrize("names", STACKS, ids="+".join)
def test_setup_restores_what_a_fit_without_on_exception_left(tmp_path, names):
    """An earlier callback's ``on_exception`` raised, so the techniques could not undo anything: the next fit's setup
    finds what they left, undoes it with a warning naming it, and trains as on a fresh module with those weights."""
    stack = Stack(names, False)
    model = make_model()
    fail(stack, "callback", model, tmp_path, first=[BrokenOnException()], match="on_exception failed")
    checkpoint = torch.load(tmp_path / "at_failure.ckpt", weights_only=True)
    # left behind: the patched layers (random-LTD paused at the coarse level: its hook), the wrapped training_step,
    # the coarse network
    if "random_ltd" in names:
        assert find_patches(model)
    assert ("training_step" in vars(model)) == ("infobatch" in names)
    assert (shapes(model) != shapes(make_model())) == ("vcycle" in names)

    expected = [LEFTOVER_WARNINGS[n] for n in names if n in LEFTOVER_WARNINGS]
    if "vcycle" in names and "random_ltd" in names:  # its hook was on the coarse network, which is gone
        expected.remove(LEFTOVER_WARNINGS["random_ltd"])
    with leftover_warnings(expected):
        steps, weights = refit(stack, model, tmp_path / "refit")
    fresh = make_model()
    fresh.load_state_dict(checkpoint["state_dict"])  # the failed step's weights, at full size
    fresh_steps, fresh_weights = refit(stack, fresh, tmp_path / "refit_fresh")
    assert steps == fresh_steps > 0
    assert_nested_equal(weights, fresh_weights, "refit")


@contextlib.contextmanager
def leftover_warnings(expected: Sequence[str]) -> Iterator[None]:
    """Each of the ``expected`` :data:`LEFTOVER_WARNINGS` is in exactly one warning raised in the block, the others in
    none."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield
    messages = [str(w.message) for w in record]
    for pattern in LEFTOVER_WARNINGS.values():
        assert sum(pattern in m for m in messages) == (pattern in expected), (pattern, messages)


class NestedFit(Callback):
    """At step 1 of a fit, starts a second fit of the same module with ``inner`` callbacks (a module stacked into two
    fits at once)."""

    def __init__(self, inner: Stack, root: Path) -> None:
        self.inner, self.root = inner, root

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == 1:
            callbacks = self.inner.callbacks()
            inner = make_trainer(self.root, callbacks, **self.inner.limits())
            inner.fit(pl_module, datamodule=datamodule(callbacks))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("random_ltd", r"layers model\.transformer\.h\.1, model\.transformer\.h\.2 of this module are patched by "),
        ("infobatch", "training_step is wrapped by another InfoBatchCallback whose fit is still running"),
        ("vcycle", r"network \(pl_module\.model\) is held by another V-cycle fit that is still running"),
    ],
)
def test_setup_refuses_a_module_that_a_running_fit_changed(tmp_path, name, message):
    """A fit started on a module that another fit is training (here from inside it) stops at setup with a message
    naming what the running fit changed; then both fits end and nothing is left on the module."""
    stack = Stack((name,), False)
    model = make_model()
    callbacks = stack.callbacks()
    trainer = make_trainer(tmp_path / "outer", [*callbacks, NestedFit(stack, tmp_path / "inner")], **stack.limits())
    with pytest.raises(ValueError, match=message):
        trainer.fit(model, datamodule=datamodule(callbacks))
    assert_nothing_left(model)
    assert shapes(model) == shapes(make_model())


def test_setup_refuses_layers_patched_by_hand_until_they_are_restored(tmp_path):
    model = make_model()
    adapter = find_adapter(model)
    patched = convert(model, adapter, LTDController(4, (1, 2)))
    assert patched.running is None  # made outside a fit
    callbacks = Stack(("random_ltd",), False).callbacks()
    trainer = make_trainer(tmp_path, callbacks, max_steps=2, max_epochs=-1)
    message = r"layers model\.transformer\.h\.1, model\.transformer\.h\.2 of this module are already patched by "
    with pytest.raises(ValueError, match=message + "random-LTD outside a fit"):
        trainer.fit(model, datamodule=datamodule(callbacks))
    assert find_patches(model) == [("model.transformer.h.1", patched), ("model.transformer.h.2", patched)]
    assert restore_module(model) == ["model.transformer.h.1", "model.transformer.h.2"]
    assert_nothing_left(model)
    trainer = make_trainer(tmp_path, callbacks, max_steps=2, max_epochs=-1)
    trainer.fit(model, datamodule=datamodule(callbacks))
    assert trainer.global_step == 2
    assert_nothing_left(model)


def test_a_checkpoint_written_after_the_exception_resumes_the_interrupted_level(tmp_path):
    """``OnExceptionCheckpoint`` writes its checkpoint after the techniques' ``on_exception`` (Lightning puts checkpoint
    callbacks last): the V-cycle has put the full-size network back by then, yet the checkpoint is the one written
    just before the exception (the level's exact weights, snapshots, optimizer), so a resumed fit continues the cycle
    exactly."""
    stack = Stack(("vcycle",), False)
    model = make_model()
    with pytest.warns(UserWarning, match="put a full-size network back"):
        on_exception = OnExceptionCheckpoint(tmp_path, filename="on_exception")
        fail(stack, "callback", model, tmp_path, first=[on_exception], enable_checkpointing=True)
    before = torch.load(tmp_path / "at_failure.ckpt", weights_only=True)
    after = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    for key in ("state_dict", "callbacks", "optimizer_states", "lr_schedulers", "epoch", "global_step"):
        assert_nested_equal(after[key], before[key], key)
    (state,) = [s for k, s in after["callbacks"].items() if k.startswith("VCycleCallback")]
    assert state["level"] == 2 and set(state["snapshots"]) == {"1"} and state["weights"]


def test_the_monitor_removes_its_process_wide_hooks(tmp_path):
    """A module without ``effi_training_flops`` is measured with process-wide module hooks during each batch: a
    failure inside the batch removes them, and the ``flops_per_batch`` the monitor wrote is removed again (the module
    had none), so no later fit takes it for the module's own."""

    class Unmeasured(FailingGPT2):
        effi_training_flops = None  # type: ignore[assignment]

    before = global_hooks()
    model = seeded(Unmeasured, **{**TINY_GPT2, "n_layer": 4, "optimizer": sgd})()
    model.fail_at = 2
    callbacks = [EfficiencyMonitor(print_summary=False), RandomLTDCallback(min_value=4, seq_per_step=4)]
    trainer = make_trainer(tmp_path, callbacks, max_steps=4, max_epochs=-1)
    with pytest.raises(RuntimeError, match="training_step failed"):
        trainer.fit(model, datamodule=datamodule(callbacks))
    assert global_hooks() == before
    assert not hasattr(model, "flops_per_batch") and EfficiencyMonitor._own_flops(model) == 0.0
    assert_nothing_left(model)


def test_infobatch_puts_back_a_training_step_of_the_instance(tmp_path):
    """A module with its own instance-level ``training_step`` gets it back after the fit, also when it raises."""
    model = make_model()
    calls: list[int] = []

    def own_step(batch: Any, batch_idx: int) -> Any:
        calls.append(batch_idx)
        return FailingGPT2.training_step(model, batch, batch_idx)

    model.training_step = own_step  # type: ignore[method-assign]
    stack = Stack(("infobatch",), False)
    for kind in ("callback", None):
        callbacks = stack.callbacks()
        extra = [Failure(2, tmp_path / "x.ckpt", RuntimeError)] if kind else []
        trainer = make_trainer(tmp_path / str(kind), [*callbacks, *extra], max_epochs=1)
        with pytest.raises(RuntimeError) if kind else contextlib.nullcontext():
            trainer.fit(model, datamodule=datamodule(callbacks))
        assert vars(model)["training_step"] is own_step and calls
