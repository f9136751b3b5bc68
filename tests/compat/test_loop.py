"""The compatibility matrix, loop rows: the training loop's limits (``overfit_batches``, ``limit_train_batches``,
``max_time``), when validation runs (``val_check_interval``, ``check_val_every_n_epoch``), Lightning's tuner (the LR
finder, the batch-size finder) and evaluation after a fit or from a checkpoint, for every technique column.

A working cell asserts the technique's effect (:func:`~tests.compat.setups.assert_effect`, or its own measure where
the feature cuts every epoch) and the feature's effect with values: the batches each epoch trained, the steps
validation ran at, the step the clock stopped the run at, a run after a tuner's search equal to one that started with
the tuner's answer, and evaluation numbers equal to those of the same weights in a plain Trainer, on the full model
(every block, every token, every sample). A refused cell asserts the refusal before the first step.

Below the rows: the fixes behind them (a resumable loader that takes the ``SequentialSampler`` of
``overfit_batches``; the wrappers' ``batch_size``; InfoBatch's per-epoch reload that no longer rebuilds the
validation loader).
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder, ModelCheckpoint
from lightning.pytorch.callbacks import timer as timer_module
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, SequentialSampler

from lightning_effi import InfoBatchCallback
from lightning_effi.core.batch import batch_meta
from lightning_effi.core.loader import ResumableDataLoader, SkippableSampler
from lightning_effi.core.wrapping import wrapper_chain
from lightning_effi.data import CurriculumDataModule, InfoBatchDataModule
from lightning_effi.reference.tasks.base import param_groups
from lightning_effi.tasks import GPT2CausalLM
from tests.compat.registry import Row, expect, works
from tests.compat.setups import (
    BATCH,
    LAYERS,
    REFUSED,
    SEQ,
    STEPS,
    TECHNIQUES,
    N,
    Run,
    assert_effect,
    assert_refused,
    build,
    effects,
)
from tests.harness.settings import seeded
from tests.helpers.harness import assert_nested_equal, make_trainer
from tests.helpers.tiny import TINY_GPT2, TinyDataModule, TokenBlocks, seqlen_truncate

ROWS = [
    Row(
        "overfit_batches",
        "Trainer(overfit_batches=...)",
        works(infobatch=REFUSED, curriculum=REFUSED, stack=REFUSED),
        "every epoch trains the dataset's same first batches, in order; InfoBatch and the curriculum choose each "
        "step's samples themselves (pruned, or drawn at a growing difficulty), which overfitting contradicts",
    ),
    Row(
        "limit_train_batches",
        "Trainer(limit_train_batches=...)",
        works(),
        "every epoch trains that many batches; InfoBatch's limited epochs train the head of its (pruned) plan; the "
        "curriculum also ends an epoch at its data epoch's end (a limit that does not divide it gives a shorter "
        "epoch there, warned at train start)",
    ),
    Row(
        "val_check_interval",
        "Trainer(val_check_interval=...) (an int or a float, within an epoch)",
        works(),
        "validation runs at the steps Lightning's rule gives for each epoch's length (InfoBatch's pruned epochs are "
        "shorter), on every token of every sample",
    ),
    Row(
        "check_val_every_n_epoch",
        "Trainer(check_val_every_n_epoch=...)",
        works(),
        "validation runs at the end of every n-th epoch only",
    ),
    Row(
        "max_time",
        "Trainer(max_time=...)",
        works(),
        "the run stops at the step its time runs out (a V-cycle cut short at a coarse level goes back to the full "
        "model)",
    ),
    Row(
        "lr_find",
        "the LR finder (LearningRateFinder, Tuner(trainer).lr_find)",
        works(),
        "the module's lr is the suggestion, and the fit after the search equals a fit that started with that lr "
        "(the search leaves no technique state behind)",
    ),
    Row(
        "batch_size_finder",
        "the batch-size finder (BatchSizeFinder, Tuner(trainer).scale_batch_size)",
        works(infobatch=REFUSED, curriculum=REFUSED, stack=REFUSED),
        "the suggested size is the largest the search trained, and the fit after it equals a fit at that size; "
        "InfoBatch's loader holds one epoch's plan, which the search's epoch resets make stale, and the curriculum "
        "lays out its stream for one batch size at setup (its first, shortest batches would also understate the "
        "memory): find the size without them",
    ),
    Row(
        "evaluate_after_fit",
        "trainer.validate / test / predict after fit (the same Trainer)",
        works(),
        "the numbers equal those of the trained weights in a plain Trainer, on the full model, every token and "
        "every sample",
    ),
    Row(
        "evaluate_from_checkpoint",
        "validate / test / predict(ckpt_path=...) in a new Trainer with the same callbacks",
        works(),
        "a mid-run checkpoint (the V-cycle's at a coarse level) evaluates as its weights do in a plain Trainer, on "
        "the full model, every token and every sample",
    ),
]


# ------------------------------------------------------------------------------------------------------- helpers
class LoopGPT2(GPT2CausalLM):
    """The matrix's tiny GPT-2 (:data:`~tests.compat.setups.LAYERS` blocks) with an ``lr`` attribute the LR finder
    sets (SGD with momentum at ``lr``, as :func:`tests.helpers.tiny.sgd`), a record of the batch size of every
    training step it ran (the tuners' trials included: their callbacks are off during a search) and a predict step
    (the per-sample losses, ``float[B]``)."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(**{**TINY_GPT2, "n_layer": LAYERS})
        self.lr = lr
        self.train_batch_sizes: list[int] = []

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(param_groups(self, self.weight_decay), lr=self.lr, momentum=0.9)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.train_batch_sizes.append(int(batch["input_ids"].shape[0]))
        return super().training_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self.per_sample_loss(batch)[0]


def make_run(technique: str, lr: float = 0.05, seed: int = 0, batch_size: int = BATCH) -> Run:
    """:func:`~tests.compat.setups.build` with :class:`LoopGPT2` (initialised from ``seed``) and the user's DataModule
    given test and predict loaders (5 samples a batch: the last batch is partial)."""
    run = build(technique, model_fn=seeded(LoopGPT2, seed=seed, lr=lr), batch_size=batch_size)
    user = wrapper_chain(run.datamodule)[-1]
    data = user.train_dataset
    user.test_dataloader = lambda: DataLoader(data, batch_size=5)
    user.predict_dataloader = lambda: DataLoader(data, batch_size=5)
    return run


def user_datamodule(run: Run) -> pl.LightningDataModule:
    return wrapper_chain(run.datamodule)[-1]


def epoch_lengths(run: Run) -> list[int]:
    """Training batches per epoch, from the probe."""
    counts = Counter(b["epoch"] for b in run.probe.batches)
    return [counts[e] for e in range(max(counts) + 1)]


def infobatch_callback(run: Run) -> InfoBatchCallback:
    return next(cb for cb in run.callbacks if isinstance(cb, InfoBatchCallback))


class Batches(Callback):
    """Every training batch's token ids (the user's batch, as ``training_step`` receives it), with its epoch."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.batches.append((trainer.current_epoch, batch["input_ids"].clone()))


class Plans(Callback):
    """InfoBatch alone: each epoch's plan (its kind and sample order) and the samples each epoch trained."""

    def __init__(self, infobatch: InfoBatchCallback) -> None:
        self.infobatch = infobatch
        self.plans: dict[int, tuple[str, list[int]]] = {}
        self.trained: dict[int, list[int]] = defaultdict(list)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plan = self.infobatch.plan
        assert plan is not None and plan.epoch == trainer.current_epoch
        self.plans[trainer.current_epoch] = (plan.kind, plan.indices.tolist())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        meta = batch_meta(trainer)
        assert meta is not None
        self.trained[trainer.current_epoch].extend(meta["index"].tolist())


class EvalProbe(Callback):
    """What each transformer block's first layer norm received in every evaluation batch: ``batches[(fn, stage)]``
    is a list of per-batch ``[[B, T, H] per block]``, ``fn`` the Trainer's function (``"fit"`` for the validation
    inside a fit) and ``stage`` ``"validate"``, ``"test"`` or ``"predict"``; ``steps[(fn, stage)]``: the global step
    at the start of each evaluation run."""

    def __init__(self) -> None:
        self.batches: dict[tuple[str, str], list[list[list[int]]]] = defaultdict(list)
        self.steps: dict[tuple[str, str], list[int]] = defaultdict(list)
        self.epochs: dict[tuple[str, str], list[int]] = defaultdict(list)
        self._handles: list[Any] = []
        self._shapes: list[list[int]] = []

    @staticmethod
    def _key(trainer: pl.Trainer, stage: str) -> tuple[str, str]:
        return (str(trainer.state.fn.value if trainer.state.fn is not None else None), stage)

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.sanity_checking:
            return
        self.steps[self._key(trainer, stage)].append(trainer.global_step)
        self.epochs[self._key(trainer, stage)].append(trainer.current_epoch)
        self._handles = [
            m.register_forward_pre_hook(self._record) for n, m in pl_module.named_modules() if n.endswith("ln_1")
        ]

    def _record(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self._shapes.append(list(args[0].shape))

    def _batch_start(self) -> None:
        self._shapes = []

    def _batch_end(self, trainer: pl.Trainer, stage: str) -> None:
        if not trainer.sanity_checking:
            self.batches[self._key(trainer, stage)].append(self._shapes)

    def _end(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, pl_module, "validate")

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, pl_module, "test")

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, pl_module, "predict")

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._batch_start()

    def on_test_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._batch_start()

    def on_predict_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._batch_start()

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._batch_end(trainer, "validate")

    def on_test_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._batch_end(trainer, "test")

    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._batch_end(trainer, "predict")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end()

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end()

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end()


def assert_full_evaluation(batches: list[list[list[int]]], samples: int = N) -> None:
    """Every evaluation batch ran every block (:data:`LAYERS`) on every token (:data:`SEQ`), and the batches hold
    ``samples`` samples in all."""
    assert batches, "no evaluation batch was recorded"
    for shapes in batches:
        assert len(shapes) == LAYERS, f"an evaluation batch ran {len(shapes)} of {LAYERS} blocks"
        assert all(s[1] == SEQ for s in shapes), f"an evaluation batch saw fewer than {SEQ} tokens: {shapes}"
        assert len({s[0] for s in shapes}) == 1, f"the blocks saw different batch sizes: {shapes}"
    assert sum(shapes[0][0] for shapes in batches) == samples


def evaluate(trainer: pl.Trainer, model: pl.LightningModule, datamodule: Any, **kwargs: Any) -> dict[str, Any]:
    """``validate``, ``test`` and ``predict`` of ``model`` on ``datamodule`` with ``trainer`` (``kwargs``: e.g.
    ``ckpt_path``): the metrics and the concatenated predictions."""
    val = trainer.validate(model, datamodule=datamodule, verbose=False, **kwargs)
    test = trainer.test(model, datamodule=datamodule, verbose=False, **kwargs)
    predictions = trainer.predict(model, datamodule=datamodule, **kwargs)
    assert predictions is not None
    return dict(val=val, test=test, predict=torch.cat([p for p in predictions if isinstance(p, torch.Tensor)]))


def plain_evaluation(root: Path, state_dict: dict[str, Any]) -> dict[str, Any]:
    """:func:`evaluate` of ``state_dict`` loaded into a fresh :class:`LoopGPT2`, in a Trainer without callbacks, on
    the matrix's dataset (unwrapped)."""
    model = LoopGPT2()
    model.load_state_dict(state_dict)
    dm = TinyDataModule(TokenBlocks(n=N, seq_len=SEQ), batch_size=BATCH)
    dm.test_dataloader = lambda: DataLoader(dm.train_dataset, batch_size=5)  # type: ignore[method-assign]
    dm.predict_dataloader = lambda: DataLoader(dm.train_dataset, batch_size=5)  # type: ignore[method-assign]
    return evaluate(make_trainer(root, limit_val_batches=1.0), model, dm)


def assert_same_evaluation(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["val"] == want["val"] and got["test"] == want["test"], (got, want)
    assert torch.equal(got["predict"], want["predict"])
    assert got["predict"].shape == (N,)


# ------------------------------------------------------------------------------------------------------ the rows
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_overfit_batches(technique: str, tmp_path: Path) -> None:
    """Works: the 10 steps are 5 epochs of the dataset's first 2 batches, in order (samples 0-3 and 4-7), every
    epoch; the technique acted. Refused: InfoBatch and the curriculum choose each step's samples themselves."""
    run = make_run(technique)
    if expect("overfit_batches", technique) == REFUSED:
        assert_refused(run, run.trainer(tmp_path, overfit_batches=2), "overfit_batches")
        return
    seen = Batches()
    trainer = run.fit(tmp_path, extra=[seen], overfit_batches=2)
    assert trainer.global_step == STEPS
    data = TokenBlocks(n=N, seq_len=SEQ).data
    first = [data[0:BATCH], data[BATCH : 2 * BATCH]]
    assert [e for e, _ in seen.batches] == [e for e in range(STEPS // 2) for _ in range(2)]
    for i, (_, ids) in enumerate(seen.batches):
        assert torch.equal(ids, first[i % 2]), f"batch {i} is not one of the first two batches"
    assert_effect(run)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_limit_train_batches(technique: str, tmp_path: Path) -> None:
    """Every epoch trains 3 batches (InfoBatch: 3 epochs of 3; the others: 10 steps = 3 + 3 + 3 + 1). Every epoch is
    cut, so InfoBatch's effect is measured on its plan: the pruned epoch trained the first 12 samples of a plan that
    left samples out (alone), or thinned batches (inside the curriculum's stream)."""
    run = make_run(technique)
    plans = Plans(infobatch_callback(run)) if technique == "infobatch" else None
    trainer = run.fit(tmp_path, extra=[plans] if plans else [], limit_train_batches=3)
    lengths = epoch_lengths(run)
    if technique == "infobatch":
        assert lengths == [3, 3, 3] and trainer.global_step == 9
        assert plans is not None
        kinds = {e: kind for e, (kind, _) in plans.plans.items()}
        assert kinds == {0: "full", 1: "prune", 2: "full"}, kinds
        assert len(plans.plans[1][1]) < N and len(plans.plans[0][1]) == N
        for epoch in range(3):
            assert plans.trained[epoch] == plans.plans[epoch][1][: 3 * BATCH]
        return
    assert lengths == [3, 3, 3, 1] and trainer.global_step == STEPS
    seen = effects(run.probe.batches, run.probe.complete)
    for name in run.names:
        if name == "infobatch":  # inside the curriculum's stream: batches thinned below the batch size
            assert any(b["blocks"][0][0] < BATCH for b in run.probe.batches), "no thinned batch"
        else:
            assert seen[name], f"no effect of {name}: {seen}"


def expected_validations(lengths: list[int], interval: int | float) -> list[int]:
    """The global steps after which Lightning validates, for epochs of ``lengths`` loader batches (all trained) and
    ``val_check_interval=interval`` (with ``check_val_every_n_epoch`` set): after every ``k``-th batch of an epoch,
    ``k = interval`` (an int) or ``max(1, int(L * interval))`` (a float)."""
    steps, start = [], 0
    for length in lengths:
        k = interval if isinstance(interval, int) else max(1, int(length * interval))
        steps += [start + i for i in range(k, length + 1, k)]
        start += length
    return steps


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_val_check_interval(technique: str, tmp_path: Path) -> None:
    """``val_check_interval=2`` and ``0.5``: validation after every 2nd batch of an epoch, and twice an epoch
    (every ``int(L / 2)``-th batch). Step-bounded runs: epochs of 6 batches, the second cut at 4 by ``max_steps``
    (the loader still has 6): ``[2, 4, 6, 8, 10]`` and ``[3, 6, 9]``; InfoBatch: its pruned middle epoch is
    shorter, so the steps follow the epochs' lengths. Validation sees every token of every sample it reads; the
    technique acted."""
    for interval, fixed in ((2, [2, 4, 6, 8, 10]), (0.5, [3, 6, 9])):
        run = make_run(technique)
        probe = EvalProbe()
        run.fit(tmp_path / str(interval), extra=[probe], val_check_interval=interval, limit_val_batches=1)
        if technique == "infobatch":
            lengths = epoch_lengths(run)
            assert lengths[0] == lengths[2] == N // BATCH and lengths[1] < N // BATCH, lengths
            want = expected_validations(lengths, interval)
        else:
            want = fixed
        assert probe.steps[("fit", "validate")] == want
        validations = probe.batches[("fit", "validate")]
        if "vcycle" in run.names:  # validation runs the level being trained
            assert_full_sequences(validations)
        else:
            assert_full_evaluation(validations, samples=BATCH * len(want))
        assert_effect(run)


def assert_full_sequences(batches: list[list[list[int]]]) -> None:
    """Every evaluation batch saw every token in every block it ran (a V-cycle validates the level it trains)."""
    assert batches
    for shapes in batches:
        assert all(s[1] == SEQ for s in shapes), shapes


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_check_val_every_n_epoch(technique: str, tmp_path: Path) -> None:
    """``check_val_every_n_epoch=2``: one validation, at the end of epoch 1 (step-bounded runs get 12 steps: two
    full epochs of 6; InfoBatch: after its pruned epoch 1, none after epochs 0 and 2); the technique acted."""
    run = make_run(technique)
    probe = EvalProbe()
    limits = {} if technique == "infobatch" else dict(max_steps=2 * N // BATCH)
    run.fit(tmp_path, extra=[probe], check_val_every_n_epoch=2, limit_val_batches=1, **limits)
    lengths = epoch_lengths(run)
    if technique == "infobatch":
        assert len(lengths) == 3 and lengths[1] < N // BATCH
    else:
        assert lengths == [N // BATCH] * 2
    assert probe.epochs[("fit", "validate")] == [1]
    assert probe.steps[("fit", "validate")] == [lengths[0] + lengths[1]]
    assert_effect(run)


class Clock(Callback):
    """A fake ``time.monotonic`` for Lightning's Timer: one second passes at the start of every training batch."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.now += 1.0


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_max_time(technique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``max_time`` on a clock that ticks a second per batch: the run stops after the batch at which the time is up,
    before its own limit: step 5 of 10 (the V-cycle at its coarse level then, which goes back to the full model at
    the end), InfoBatch's step 13 of 17 (after its pruned epoch), the stack's step 8 of 10 (InfoBatch thins from
    step 7). The technique acted."""
    clock = Clock()
    monkeypatch.setattr(timer_module, "time", SimpleNamespace(monotonic=clock.monotonic))
    stop = {"infobatch": 13, "stack": 8}.get(technique, 5)
    run = make_run(technique)
    trainer = run.fit(tmp_path, extra=[clock], max_time={"seconds": stop})
    assert trainer.global_step == stop and len(run.probe.batches) == stop
    assert_effect(run)
    if technique == "vcycle":
        assert len(run.probe.batches[-1]["blocks"]) < LAYERS, "the run was not cut at the coarse level"
    if "vcycle" in run.names:
        assert run.model.model.config.n_layer == LAYERS and len(run.model.model.transformer.h) == LAYERS


#: the LR finder's search: 16 LRs from 1e-4 to 1 (InfoBatch's 3 epochs have 17 steps), no early stop (a suggestion
#: always exists)
LR_SEARCH: dict[str, Any] = dict(min_lr=1e-4, max_lr=1.0, early_stop_threshold=None)
LR_STEPS = 16


def assert_same_fit(a: Run, b: Run) -> None:
    """Two fits trained the same batches (shapes, steps) to the same weights."""
    assert [(x["step"], x["blocks"]) for x in a.probe.batches] == [(x["step"], x["blocks"]) for x in b.probe.batches]
    assert_nested_equal(a.model.state_dict(), b.model.state_dict(), "model")


@pytest.mark.slow  # a tuner's search and two fits
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_lr_find(technique: str, tmp_path: Path) -> None:
    """``Tuner(trainer).lr_find`` (its search is a fit of its own: the technique's data and patches are in place,
    its callbacks are not), then ``trainer.fit`` on the same Trainer: the module's ``lr`` is the suggestion, and the
    fit equals a fresh fit that started with that ``lr`` (same batches, same weights: the search left no technique
    state advanced: no random-LTD schedule, V-cycle level, curriculum position or InfoBatch score)."""
    run = make_run(technique)
    trainer = run.trainer(tmp_path / "search")
    result = Tuner(trainer).lr_find(run.model, datamodule=run.datamodule, num_training=LR_STEPS, **LR_SEARCH)
    assert result is not None
    lr = result.suggestion()
    assert lr is not None and run.model.lr == lr and lr != 0.05
    assert len(run.model.train_batch_sizes) == LR_STEPS and not run.probe.batches  # the search, without callbacks
    trainer.fit(run.model, datamodule=run.datamodule)
    reference = make_run(technique, lr=lr)
    reference.fit(tmp_path / "reference")
    assert_same_fit(run, reference)
    assert_effect(run)


@pytest.mark.slow  # a tuner's search and two fits
@pytest.mark.parametrize(
    "technique",
    TECHNIQUES,
)
def test_lr_find_as_a_callback(technique: str, tmp_path: Path) -> None:
    """A ``LearningRateFinder`` callback searches at the start of the fit and the fit goes on: the module's ``lr`` is
    the suggestion and the fit equals a fresh fit at that ``lr``."""
    run = make_run(technique)
    finder = LearningRateFinder(num_training_steps=LR_STEPS, **LR_SEARCH)
    run.fit(tmp_path / "search", extra=[finder])
    assert finder.optimal_lr is not None
    lr = finder.optimal_lr.suggestion()
    assert lr is not None and run.model.lr == lr
    assert len(run.model.train_batch_sizes) == LR_STEPS + len(run.probe.batches)  # the search's steps, the fit's
    reference = make_run(technique, lr=lr)
    reference.fit(tmp_path / "reference")
    assert_same_fit(run, reference)
    assert_effect(run)


#: the batch-size finder's search: one step each at 4 (the DataModule's size), 8 and 16 samples (power mode); the
#: suggestion is 16. (Lightning's first trial runs the loader built before ``init_val`` is set, so ``init_val`` is the
#: DataModule's size here: every trial size is one the search really trained.)
BS_SEARCH: dict[str, Any] = dict(mode="power", steps_per_trial=1, init_val=BATCH, max_trials=3)


@pytest.mark.slow  # a tuner's search and two fits
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_batch_size_finder(technique: str, tmp_path: Path) -> None:
    """Works: ``Tuner(trainer).scale_batch_size`` trains one step at 4, 8 and 16 samples and suggests 16 (the
    largest it trained), the user's DataModule then has ``batch_size=16``, and ``trainer.fit`` equals a fresh fit at
    batch size 16 (epochs of a 16 and an 8). Refused: with InfoBatch or the curriculum, as a ``BatchSizeFinder``
    callback and through ``Tuner(trainer).scale_batch_size`` (Lightning's own ``setup`` check passes: the wrappers
    read and write the user's ``batch_size``)."""
    run = make_run(technique)
    if expect("batch_size_finder", technique) == REFUSED:
        assert_refused(run, run.trainer(tmp_path, extra=[BatchSizeFinder(**BS_SEARCH)]), "batch-size finder")
        assert run.datamodule.batch_size == BATCH  # read through the wrappers (Lightning's setup check)
        tuner_run = make_run(technique)
        with pytest.raises(MisconfigurationException, match="batch-size finder"):
            Tuner(tuner_run.trainer(tmp_path / "tuner")).scale_batch_size(
                tuner_run.model, datamodule=tuner_run.datamodule, **BS_SEARCH
            )
        assert not tuner_run.model.train_batch_sizes
        return
    trainer = run.trainer(tmp_path / "search")
    size = Tuner(trainer).scale_batch_size(run.model, datamodule=run.datamodule, **BS_SEARCH)
    assert size == 16 and user_datamodule(run).batch_size == 16
    assert run.model.train_batch_sizes == [4, 8, 16] and not run.probe.batches
    trainer.fit(run.model, datamodule=run.datamodule)
    assert [b["blocks"][0][0] for b in run.probe.batches] == [16, 8] * (STEPS // 2)
    reference = make_run(technique, batch_size=16)
    reference.fit(tmp_path / "reference")
    assert_same_fit(run, reference)
    assert_effect(run)


@pytest.mark.slow  # a tuner's search and two fits
@pytest.mark.parametrize("technique", ["random_ltd", "vcycle"])
def test_batch_size_finder_as_a_callback(technique: str, tmp_path: Path) -> None:
    """A ``BatchSizeFinder`` callback searches at the start of the fit and the fit goes on at the suggested size,
    equal to a fresh fit at that size."""
    run = make_run(technique)
    finder = BatchSizeFinder(**BS_SEARCH)
    run.fit(tmp_path / "search", extra=[finder])
    assert finder.optimal_batch_size == 16 and run.model.train_batch_sizes[:3] == [4, 8, 16]
    reference = make_run(technique, batch_size=16)
    reference.fit(tmp_path / "reference")
    assert_same_fit(run, reference)
    assert_effect(run)


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_evaluate_after_fit(technique: str, tmp_path: Path) -> None:
    """``trainer.validate / test / predict`` after the fit, on the same Trainer and (wrapped) DataModule: every block
    sees every token of all 24 samples, and the numbers equal those of the trained weights in a plain Trainer."""
    run = make_run(technique)
    probe = EvalProbe()
    trainer = run.fit(tmp_path / "fit", extra=[probe], limit_val_batches=1.0)
    assert_effect(run)
    got = evaluate(trainer, run.model, run.datamodule)
    for stage in ("validate", "test", "predict"):
        assert_full_evaluation(probe.batches[(stage, stage)])
    assert_same_evaluation(got, plain_evaluation(tmp_path / "plain", run.model.state_dict()))


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_evaluate_from_checkpoint(technique: str, tmp_path: Path) -> None:
    """The checkpoint of step 4 (the V-cycle's at its coarse level: it stores the full-size weights) evaluated by a
    new Trainer with fresh callbacks of the same configuration and a differently initialised module
    (``validate / test / predict(ckpt_path=...)``): every block sees every token of all 24 samples, and the numbers
    equal those of the checkpoint's weights in a plain Trainer."""
    run = make_run(technique)
    saver = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    run.fit(tmp_path / "fit", extra=[saver])
    assert_effect(run)
    path = tmp_path / "ckpt" / "step=4.ckpt"
    if "vcycle" in run.names:
        assert len(run.probe.batches[3]["blocks"]) < LAYERS, "step 4 did not train the coarse level"
    other = make_run(technique, seed=1)
    probe = EvalProbe()
    trainer = other.trainer(tmp_path / "eval", extra=[probe], limit_val_batches=1.0)
    got = evaluate(trainer, other.model, other.datamodule, ckpt_path=str(path))
    for stage in ("validate", "test", "predict"):
        assert_full_evaluation(probe.batches[(stage, stage)])
    state = torch.load(path, weights_only=True)["state_dict"]
    assert_same_evaluation(got, plain_evaluation(tmp_path / "plain", state))


# ------------------------------------------------------------------------------------------- the fixes behind them
def test_a_resumable_loader_takes_a_plain_sampler_and_resumes_it_exactly() -> None:
    """Lightning rebuilds the training loader with a ``SequentialSampler`` for ``overfit_batches``: the
    ``ResumableDataLoader`` wraps it in a ``SkippableSampler``, so a mid-epoch resume skips the consumed samples and
    reports the full length."""
    data = list(range(10))
    loader = ResumableDataLoader(data, sampler=SequentialSampler(data), batch_size=3)
    assert isinstance(loader.sampler, SkippableSampler) and len(loader) == 4
    it = iter(loader)
    assert [next(it).tolist() for _ in range(2)] == [[0, 1, 2], [3, 4, 5]]
    state = loader.state_dict()
    assert state == {"epoch": 0, "batches": 2, "batch_size": 3, "samples": 10, "sampler": "SkippableSampler"}
    resumed = ResumableDataLoader(data, sampler=SequentialSampler(data), batch_size=3)
    resumed.load_state_dict(state)
    assert len(resumed) == 4
    assert [b.tolist() for b in resumed] == [[6, 7, 8], [9]]
    assert [b.tolist() for b in resumed] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]  # the next epoch is whole
    with pytest.raises(TypeError, match="length"):
        ResumableDataLoader(data, sampler=iter(range(10)), batch_size=3)


def test_a_skippable_sampler_passes_set_epoch_on() -> None:
    """``set_epoch`` reaches a wrapped sampler that has one (a shuffling sampler's order follows it) and is recorded
    (``state_dict()["epoch"]``)."""

    class Shuffled(torch.utils.data.Sampler):
        def __init__(self) -> None:
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(torch.randperm(6, generator=torch.Generator().manual_seed(self.epoch)).tolist())

        def __len__(self) -> int:
            return 6

    inner = Shuffled()
    sampler = SkippableSampler(inner)
    sampler.set_epoch(3)
    assert inner.epoch == sampler.epoch == 3
    sampler.start = 2
    assert list(sampler) == torch.randperm(6, generator=torch.Generator().manual_seed(3)).tolist()[2:]


def test_the_wrappers_read_and_write_the_users_batch_size() -> None:
    """``batch_size`` of a wrapped DataModule is the user's (the innermost of the chain): set through the outer
    wrapper, the next training loader is built with it. A user's DataModule without one has none (Lightning's
    ``lightning_hasattr`` is False)."""
    user = TinyDataModule(TokenBlocks(n=N, seq_len=SEQ), batch_size=4)
    dm = CurriculumDataModule(InfoBatchDataModule(user))
    assert dm.batch_size == 4 and dm.template()["batch_size"] == 4
    dm.batch_size = 6
    assert user.batch_size == 6 and dm.datamodule.batch_size == 6
    assert dm.template()["batch_size"] == 6 and dm.datamodule.template()["batch_size"] == 6

    class NoBatchSize(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(list(range(4)))

    bare = InfoBatchDataModule(NoBatchSize())
    assert not hasattr(bare, "batch_size")
    with pytest.raises(AttributeError, match="no batch_size"):
        bare.batch_size = 3


class CountingDataModule(TinyDataModule):
    """Counts its ``val_dataloader()`` calls; its validation loader has one persistent worker whose starts are
    counted in ``<root>/workers`` (one line per start)."""

    def __init__(self, root: Path, **kwargs: Any) -> None:
        super().__init__(TokenBlocks(n=N, seq_len=SEQ), batch_size=BATCH, **kwargs)
        self.root = root
        self.val_calls = 0

    def val_dataloader(self) -> DataLoader:
        self.val_calls += 1
        return DataLoader(
            self.val_dataset,
            batch_size=BATCH,
            num_workers=1,
            persistent_workers=True,
            worker_init_fn=functools.partial(_count_worker, self.root / "workers"),
        )


def _count_worker(path: Path, worker_id: int) -> None:
    with open(path, "a") as f:
        f.write(f"{worker_id}\n")


@pytest.mark.slow  # three epochs with validation and a validation worker process
@pytest.mark.parametrize("user_reloads", [0, 1])
def test_infobatch_rebuilds_only_the_training_loader_every_epoch(user_reloads: int, tmp_path: Path) -> None:
    """InfoBatch rebuilds the training loader every epoch (Lightning's ``reload_dataloaders_every_n_epochs=1``,
    which would rebuild the validation loader too). Over 3 epochs, each validated, with a validation loader whose
    worker persists: the training loader is built 3 times, the user's ``val_dataloader()`` runs once and its worker
    starts once (before the fix: 3 and 3). A user who asked for reloads (``reload_dataloaders_every_n_epochs=1``)
    still gets a fresh validation loader every epoch."""
    pl.seed_everything(0, workers=True)
    user = CountingDataModule(tmp_path)
    dm = InfoBatchDataModule(user)
    built: list[int] = []
    original = dm.train_dataloader

    def train_dataloader() -> Any:
        built.append(dm.trainer.current_epoch if dm.trainer is not None else -1)
        return original()

    dm.train_dataloader = train_dataloader  # type: ignore[method-assign]
    trainer = make_trainer(
        tmp_path,
        [InfoBatchCallback(prune_ratio=0.5, delta=0.67, seed=7)],
        max_epochs=3,
        limit_val_batches=2,
        reload_dataloaders_every_n_epochs=user_reloads,
    )
    trainer.fit(seeded(LoopGPT2)(), datamodule=dm)
    assert built == [0, 1, 2]
    assert trainer.reload_dataloaders_every_n_epochs == user_reloads  # put back at the end
    workers = (tmp_path / "workers").read_text().splitlines()
    if user_reloads:
        assert user.val_calls == 3 and len(workers) == 3
    else:
        assert user.val_calls == 1 and len(workers) == 1


def technique_over(technique: str, data: pl.LightningDataModule) -> tuple[Callback, pl.LightningDataModule]:
    """``technique``'s callback ("infobatch" or "curriculum") and ``data`` wrapped in its DataModule."""
    from lightning_effi import Curriculum

    if technique == "infobatch":
        return InfoBatchCallback(prune_ratio=0.5, delta=0.67, seed=7), InfoBatchDataModule(data)
    metrics = seqlen_truncate(total_curriculum_step=4, difficulty_step=4)  # 8 to 16 tokens over 4 steps
    return Curriculum(metrics=metrics, seed=3), CurriculumDataModule(data)


class NewSubsetEachEpoch(pl.LightningDataModule):
    """A ``train_dataloader()`` that serves the next 16 token blocks each epoch (a resampled subset); ``same=True``
    serves one dataset object made in ``setup`` (a loader rebuilt over it each epoch)."""

    def __init__(self, same: bool = False, ramp: bool = False) -> None:
        super().__init__()
        self.same, self.ramp, self.blocks, self.calls = same, ramp, TokenBlocks(n=48), 0

    def train_dataloader(self) -> DataLoader:
        start, self.calls = 16 * self.calls, self.calls + 1
        # the same samples: a new Subset view of the same indices at each call
        subset = torch.utils.data.Subset(self.blocks, range(16) if self.same else range(start, start + 16))
        return DataLoader(subset, batch_size=4 * self.calls if self.ramp else 8)


@pytest.mark.parametrize("technique", ["infobatch", "curriculum"])
def test_a_new_training_set_at_a_reload_is_refused_and_the_same_one_trains(technique: str, tmp_path: Path) -> None:
    """With reload_dataloaders_every_n_epochs=1 and a train_dataloader() serving another subset each epoch, InfoBatch
    and the curriculum trained epoch 0's samples every epoch, silently (they build each epoch's loader from the
    dataset the fit started on). A loader over another dataset object at a reload is now refused; the same dataset
    object (a loader rebuilt over it) trains."""
    from lightning_effi.core.errors import DataConfigError

    def fit(data: NewSubsetEachEpoch, root: Path) -> pl.Trainer:
        callback, wrapped = technique_over(technique, data)
        trainer = make_trainer(root, [callback], max_epochs=3, reload_dataloaders_every_n_epochs=1)
        trainer.fit(seeded(LoopGPT2)(), datamodule=wrapped)
        return trainer

    with pytest.raises(DataConfigError, match=r"at epoch 1 your train_dataloader\(\) returned a loader over another"):
        fit(NewSubsetEachEpoch(), tmp_path / "new")
    # a batch-size ramp over the same samples trained epoch 0's batch size every epoch: refused too
    with pytest.raises(DataConfigError, match=r"at epoch 1 .* a loader with batch_size=8 \(was 4\)"):
        fit(NewSubsetEachEpoch(same=True, ramp=True), tmp_path / "ramp")
    same = NewSubsetEachEpoch(same=True)
    assert fit(same, tmp_path / "same").current_epoch == 3 and same.calls == 3  # read once, then at each reload


class LoaderChangesAtReload(pl.LightningDataModule):
    """One dataset object; from epoch 1 on, ``train_dataloader()`` returns a loader with a custom sampler
    (``sampler=True``) or another collate function, which zeroes the token ids."""

    def __init__(self, sampler: bool) -> None:
        super().__init__()
        self.sampler, self.blocks, self.calls = sampler, TokenBlocks(n=16), 0

    def train_dataloader(self) -> DataLoader:
        self.calls += 1
        if self.calls == 1:
            return DataLoader(self.blocks, batch_size=8, shuffle=True)
        if self.sampler:
            return DataLoader(self.blocks, batch_size=8, sampler=torch.utils.data.SubsetRandomSampler(range(4)))
        zeroed = functools.partial(zero_ids, torch.utils.data.default_collate)
        return DataLoader(self.blocks, batch_size=8, shuffle=True, collate_fn=zeroed)


def zero_ids(collate: Any, items: list[Any]) -> Any:
    batch = collate(items)
    return {**batch, "input_ids": torch.zeros_like(batch["input_ids"])}


@pytest.mark.parametrize("technique", ["infobatch", "curriculum"])
def test_a_loader_returned_at_a_reload_is_checked_and_its_collate_taken(technique: str, tmp_path: Path) -> None:
    """At a reload (``reload_dataloaders_every_n_epochs=1``) a loader over the same dataset with a custom sampler was
    dropped in silence, and another collate function was ignored: every epoch trained with the first loader's
    (qa98-break 02, 03). The sampler is refused as at the fit's start; the collate trains from that epoch on."""
    from lightning_effi.core.errors import DataConfigError

    class Sums(Callback):
        def __init__(self) -> None:
            self.by_epoch: dict[int, int] = defaultdict(int)

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.by_epoch[trainer.current_epoch] += int(batch["input_ids"].sum())

    def fit(data: LoaderChangesAtReload, root: Path) -> Sums:
        callback, wrapped = technique_over(technique, data)
        sums = Sums()
        trainer = make_trainer(root, [callback, sums], max_epochs=3, reload_dataloaders_every_n_epochs=1)
        trainer.fit(seeded(LoopGPT2)(), datamodule=wrapped)
        return sums

    # named as a reload's refusal (the start-of-fit message alone named neither, qa99-regress 02)
    reload = r"reload_dataloaders_every_n_epochs=1\), and the loader your train_dataloader\(\) returned at epoch 1"
    with pytest.raises(DataConfigError, match=reload + r".* uses SubsetRandomSampler / BatchSampler \(a custom"):
        fit(LoaderChangesAtReload(sampler=True), tmp_path / "sampler")
    sums = fit(LoaderChangesAtReload(sampler=False), tmp_path / "collate")
    assert sums.by_epoch[0] > 0 and sums.by_epoch[1] == sums.by_epoch[2] == 0


class ZeroedFromEpoch(pl.LightningDataModule):
    """One dataset object; the loaders built from epoch ``start`` on zero the token ids."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start, self.blocks, self.calls = start, TokenBlocks(n=16), []

    def train_dataloader(self) -> DataLoader:
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        self.calls.append(epoch)
        collate = torch.utils.data.default_collate
        late = functools.partial(zero_ids, collate) if epoch >= self.start else collate
        return DataLoader(self.blocks, batch_size=8, shuffle=True, collate_fn=late)


def tag_with_epoch(epoch: int, items: list[Any]) -> Any:
    """A collate marking each row with the epoch its loader was returned at (token 0 = 50 + epoch)."""
    batch = torch.utils.data.default_collate(items)
    ids = batch["input_ids"].clone()
    ids[:, 0] = 50 + epoch
    return {**batch, "input_ids": ids}


class TaggedByEpoch(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = TokenBlocks(n=16)

    def train_dataloader(self) -> DataLoader:
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        return DataLoader(self.blocks, batch_size=8, shuffle=True, collate_fn=functools.partial(tag_with_epoch, epoch))


@pytest.mark.parametrize(
    ("technique", "case"), [("curriculum", "lr_finder"), ("infobatch", "lr_finder"), ("curriculum", "resume")]
)
def test_each_epoch_trains_the_loader_lightning_would_train(technique: str, case: str, tmp_path: Path) -> None:
    """The epoch whose loader trains each epoch equals plain Lightning's: after a ``LearningRateFinder`` search that
    ran several epochs, then set the fit back to epoch 0 (the wrapper read none after it: every epoch trained the
    search's last loader, qa100-regress 01); and in a fit resumed mid-epoch 1 with ``reload_dataloaders_every_n_epochs
    =2`` (its first epochs trained the loader read in setup, before the restore, qa100-regress 02)."""
    from lightning.pytorch.callbacks import LearningRateFinder

    every = 1 if case == "lr_finder" else 2

    class Trained(Callback):
        def __init__(self) -> None:
            self.by_epoch: dict[int, set[int]] = defaultdict(set)

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.by_epoch[trainer.current_epoch] |= set((batch["input_ids"][:, 0] - 50).tolist())

    def fit(root: Path, wrapped: bool, epochs: int = 4, ckpt: str | None = None, save: bool = False) -> Any:
        trained, data = Trained(), TaggedByEpoch()
        callbacks: list[Callback] = [trained]
        if case == "lr_finder":
            callbacks.append(
                LearningRateFinder(num_training_steps=8, min_lr=1e-3, max_lr=1e-1, early_stop_threshold=None)
            )
        if save:
            callbacks.append(ModelCheckpoint(dirpath=root / "ck", every_n_train_steps=3, save_top_k=-1, monitor=None))
        dm: pl.LightningDataModule = data
        if wrapped:
            callback, dm = technique_over(technique, data)
            callbacks.append(callback)
        model = seeded(LoopGPT2)()
        model.lr = 0.05
        trainer = make_trainer(root, callbacks, max_epochs=epochs, reload_dataloaders_every_n_epochs=every)
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
        return {e: sorted(v) for e, v in sorted(trained.by_epoch.items())}

    runs = {}
    for wrapped in (False, True):
        root = tmp_path / str(wrapped)
        if case == "resume":  # 2 batches an epoch: step 3 is in epoch 1
            fit(root / "first", wrapped, epochs=2, save=True)
            runs[wrapped] = fit(root, wrapped, epochs=5, ckpt=str(next((root / "first" / "ck").glob("*step=3*"))))
        else:
            runs[wrapped] = fit(root, wrapped)
    assert runs[True] == runs[False], runs
    assert runs[False] == ({e: [e] for e in range(4)} if case == "lr_finder" else {1: [1], 2: [1], 3: [3], 4: [3]})


def test_a_curriculum_resumed_at_an_odd_epoch_reads_the_loader_at_lightnings_reloads(tmp_path: Path) -> None:
    """``reload_dataloaders_every_n_epochs=2``, resumed from the end of epoch 1: Lightning reloads n epochs after the
    resume's loader (epochs 3, 5), and the curriculum read the user's loader at even epochs only, so never after the
    resume (qa99-regress 01). The zeroing collate returned from epoch 4 on trains at Lightning's next reload, epoch 5,
    as in the same run without the curriculum."""

    class Sums(Callback):
        def __init__(self) -> None:
            self.by_epoch: dict[int, int] = defaultdict(int)

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.by_epoch[trainer.current_epoch] += int(batch["input_ids"].sum())

    def fit(root: Path, epochs: int, curriculum: bool, ckpt: str | None = None) -> dict[int, int]:
        sums, data = Sums(), ZeroedFromEpoch(start=4)
        every = ModelCheckpoint(dirpath=root / "ck", save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        callbacks: list[Callback] = [sums, every]
        dm: pl.LightningDataModule = data
        if curriculum:
            callback, dm = technique_over("curriculum", data)
            callbacks.append(callback)
        trainer = make_trainer(root, callbacks, max_epochs=epochs, reload_dataloaders_every_n_epochs=2)
        trainer.fit(seeded(LoopGPT2)(), datamodule=dm, ckpt_path=ckpt)
        return {e: int(v > 0) for e, v in sums.by_epoch.items()}  # 1: real ids, 0: zeroed

    for curriculum in (False, True):
        root = tmp_path / str(curriculum)
        fit(root, 2, curriculum)
        trained = fit(root, 6, curriculum, ckpt=str(root / "ck" / "epoch=1.ckpt"))
        assert trained == {2: 1, 3: 1, 4: 1, 5: 0}, (curriculum, trained)
