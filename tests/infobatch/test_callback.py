"""InfoBatchCallback in Lightning: epoch lengths, the training_step wrapper, annealing, resume, DDP, LR progress,
validation, requirements and metadata (no processes except the DDP test)."""

from __future__ import annotations

import functools
import inspect
import json
import math
import warnings
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

import lightning_effi.infobatch
from lightning_effi.callbacks import InfoBatchCallback
from lightning_effi.core.accounting import EfficiencyMonitor
from lightning_effi.core.lr_schedules import warmup_cosine
from lightning_effi.core.progress import progress_clock, progress_source
from lightning_effi.core.protocols import ProvidesProgressClock
from lightning_effi.core.requirements import BATCH_STRUCTURES, IncompatibleTechniques, Requirements
from lightning_effi.functional import infobatch as ib
from lightning_effi.infobatch.data import InfoBatchDataModule
from lightning_effi.tasks import GPT2CausalLM
from tests.harness.settings import MONITOR_TIMES
from tests.helpers.harness import MetricsCapture, assert_resume_equals_uninterrupted, fit_ddp, make_trainer
from tests.helpers.tiny import TINY_GPT2, TinyDataModule, TokenBlocks, sgd, tiny_bert_cls, tiny_gpt2, tiny_sentence_data


def ib_data(n=40, batch_size=8, num_workers=0):
    return InfoBatchDataModule(TinyDataModule(TokenBlocks(n=n), batch_size=batch_size, num_workers=num_workers))


class FixedLengths(InfoBatchCallback):
    """Plans of prescribed lengths."""

    def __init__(self, lengths, **kw):
        super().__init__(**kw)
        self.lengths = lengths

    def plan_for(self, epoch):
        if self.plan is None or self.plan.epoch != epoch:
            n, length = self.dataset_size, self.lengths[epoch]
            weights = torch.ones(n)
            self.plan = ib.EpochPlan(
                epoch,
                torch.arange(length),
                weights,
                "prune" if length < n else "full",
                0.0 if length < n else math.nan,
                n - length if length < n else 0,
                0,
                n - length,
            )
            self.history.append(
                {
                    "epoch": epoch,
                    "kind": self.plan.kind,
                    "saved": n - length,
                    "padded": 0,
                    "threshold": 0.0,
                    "well_learned": 0,
                    "kept_well_learned": 0,
                    "size": length,
                }
            )
        return self.plan


class CountBatches(pl.Callback):
    def __init__(self):
        self.per_epoch: list[int] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.per_epoch.append(0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_epoch[-1] += 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epoch_lengths_follow_the_plan_every_epoch(tmp_path, num_workers):
    counter = CountBatches()
    trainer = make_trainer(tmp_path, [FixedLengths([100, 60, 80, 100, 30]), counter], max_epochs=5)
    trainer.fit(tiny_gpt2(), datamodule=ib_data(n=100, batch_size=10, num_workers=num_workers))
    assert counter.per_epoch == [10, 6, 8, 10, 3]


class SpyModule(GPT2CausalLM):
    """A tiny GPT-2 that records what its training_step saw and returned."""

    def __init__(self):
        super().__init__(**TINY_GPT2, optimizer=sgd)
        self.seen_keys: list[set] = []
        self.returned: list[dict] = []

    def training_step(self, batch, batch_idx):
        self.seen_keys.append(set(batch))
        out = super().training_step(batch, batch_idx)
        self.returned.append({k: v.detach().clone() for k, v in out.items()})
        return out


class CaptureOutputs(pl.Callback):
    def __init__(self):
        self.outputs: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.outputs.append({"loss": outputs["loss"], "index": outputs["index"], "epoch": trainer.current_epoch})


def test_wrapper_hides_the_index_and_rescales_the_loss(tmp_path):
    cb, capture, module = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=3), CaptureOutputs(), SpyModule()
    trainer = make_trainer(tmp_path, [cb, capture], max_epochs=4)
    trainer.fit(module, datamodule=ib_data())
    assert all(keys == {"input_ids"} for keys in module.seen_keys)  # the module never sees the index
    kinds = [h["kind"] for h in cb.history]
    assert kinds == ["full", "prune", "prune", "full"]  # E=4, delta=0.75 -> annealing from epoch 3
    sizes = [h["size"] for h in cb.history]
    assert sizes[0] == sizes[3] == 40 and sizes[1] < 40 and sizes[2] < 40
    # the returned loss of the last (full) epoch equals the plain mean; prune epochs use mean(w * l) with w in {1, 2}
    last = [(r, c) for r, c in zip(module.returned, capture.outputs) if c["epoch"] == 3]
    assert all(torch.allclose(c["loss"], r["per_sample_loss"].mean()) for r, c in last)
    prune = [(r, c) for r, c in zip(module.returned, capture.outputs) if c["epoch"] == 1]
    for r, c in prune:
        ratio = c["loss"] / r["per_sample_loss"].mean()
        assert 1.0 <= float(ratio) <= 2.0 + 1e-6
    assert any(float(c["loss"] / r["per_sample_loss"].mean()) > 1.0 + 1e-6 for r, c in prune)


def test_annealing_epochs_are_full_with_unit_weights(tmp_path):
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.875)
    make_trainer(tmp_path, [cb], max_epochs=8).fit(tiny_gpt2(), datamodule=ib_data())
    assert [h["kind"] for h in cb.history] == ["full"] + ["prune"] * 6 + ["full"]
    assert torch.equal(cb.plan.weights, torch.ones(40))
    assert cb.effi_summary()["infobatch/saved_samples"] == sum(h["saved"] for h in cb.history) > 0


def test_epochs_after_a_shorter_schedule_are_full(tmp_path):
    """num_epochs=4 < max_epochs=5: epochs 1-2 prune, 3 anneals, and epoch 4, past the schedule (which
    functional.plan_epoch refuses), trains the full data set with weight 1 (functional.full_plan)."""
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.75, num_epochs=4, seed=3)
    make_trainer(tmp_path, [cb], max_epochs=5).fit(tiny_gpt2(), datamodule=ib_data(n=16))
    assert [(h["epoch"], h["kind"]) for h in cb.history] == [
        (0, "full"),
        (1, "prune"),
        (2, "prune"),
        (3, "full"),
        (4, "full"),
    ]
    assert cb.plan == ib.full_plan(16, 4, seed=3)


def test_resume_at_an_epoch_boundary_and_mid_epoch_equals_uninterrupted(tmp_path):
    # E = 8, delta = 0.875: 40 samples, bs 8 -> 5 batches in full epochs, fewer in prune epochs.
    common = dict(
        model_fn=tiny_gpt2,
        data_fn=ib_data,
        total_steps=0,
        max_epochs=8,
        callbacks_fn=lambda: [InfoBatchCallback(prune_ratio=0.5, delta=0.875, seed=7)],
    )
    pl.seed_everything(0, workers=True)  # as the harness does: the probe's run length equals run A's
    trainer_a = make_trainer(
        tmp_path / "probe", [InfoBatchCallback(prune_ratio=0.5, delta=0.875, seed=7)], max_epochs=8
    )
    trainer_a.fit(tiny_gpt2(), datamodule=ib_data())
    total = trainer_a.global_step
    for name, step in (("boundary", 5), ("mid", 7), ("late", total - 6)):
        assert_resume_equals_uninterrupted(root=tmp_path / name, resume_step=step, **{**common, "total_steps": total})


def test_state_survives_safe_loading_and_detects_other_settings(tmp_path):
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.75)
    trainer = make_trainer(tmp_path, [cb], max_epochs=2)
    trainer.fit(tiny_gpt2(), datamodule=ib_data())
    path = tmp_path / "ib.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["callbacks"][cb.state_key]
    assert torch.equal(state["score"], cb.score) and state["seen"].all()
    other = InfoBatchCallback(prune_ratio=0.3, delta=0.75)
    with pytest.raises(ValueError, match="other settings"):
        make_trainer(tmp_path, [other], max_epochs=3).fit(tiny_gpt2(), datamodule=ib_data(), ckpt_path=path)


def test_state_keys_differ_by_identity_arguments():
    assert InfoBatchCallback(prune_ratio=0.3).state_key != InfoBatchCallback(prune_ratio=0.5).state_key
    assert InfoBatchCallback(seed=1).state_key != InfoBatchCallback(seed=2).state_key


def test_repr_round_trips():
    cb = InfoBatchCallback(
        prune_ratio=0.3, delta=0.9, num_epochs=10, seed=4, momentum=0.5, strict=False, nonfinite_loss="warn"
    )
    again = eval(repr(cb), {"InfoBatchCallback": InfoBatchCallback})
    assert repr(again) == repr(cb) and again.nonfinite_guard.policy == "warn"
    assert repr(InfoBatchCallback()) == (
        "InfoBatchCallback(prune_ratio=0.5, delta=0.875, num_epochs=None, seed=0, momentum=1.0, strict=True, "
        "per_sample_loss=None, nonfinite_loss='raise')"
    )
    # every constructor argument appears, and numpy numbers are stored as plain Python numbers
    names = list(inspect.signature(InfoBatchCallback).parameters)
    assert [part.split("=")[0] for part in repr(cb)[len("InfoBatchCallback(") : -1].split(", ")] == names
    numpy_cb = InfoBatchCallback(prune_ratio=np.float32(0.5), num_epochs=np.int64(8), seed=np.int64(3))
    again = eval(repr(numpy_cb), {"InfoBatchCallback": InfoBatchCallback})
    assert repr(again) == repr(numpy_cb) and type(again.seed) is int and type(again.num_epochs) is int


def test_requirements_are_declared_and_match_metadata():
    req = InfoBatchCallback.requirements
    assert isinstance(req, Requirements)
    assert req.owns_train_sampler and req.changes_epoch_length and not req.needs_per_sample_loss
    assert req.batch_structures == BATCH_STRUCTURES and not req.changes_model_shapes and not req.patches_layers
    folder = Path(lightning_effi.infobatch.__file__).parent
    metadata = json.loads((folder / "metadata.json").read_text())
    assert metadata["requirements"] == json.loads(json.dumps(req.as_dict()))  # tuples as lists
    assert metadata["class_name"] == InfoBatchCallback.__name__
    root = folder.parent.parent
    assert (root / metadata["card"]).is_file() and (root / metadata["hydra"]).is_file()


class OtherThinner(pl.Callback):
    """A stand-in technique that, like InfoBatch, owns the training sampler or thins inside another one."""

    requirements = Requirements(owns_train_sampler=True, thins_within_sampler=True, changes_epoch_length=True)


def test_setup_refuses_another_technique_of_the_same_kind(tmp_path):
    # the curriculum (a sampler that hosts InfoBatch's thinning) is accepted: tests/composition
    with pytest.raises(IncompatibleTechniques, match="InfoBatchCallback and OtherThinner cannot be combined"):
        make_trainer(tmp_path, [InfoBatchCallback(), OtherThinner()], max_epochs=2).fit(
            tiny_gpt2(), datamodule=ib_data()
        )


class ProgressLR(GPT2CausalLM):
    def __init__(self):
        super().__init__(**TINY_GPT2)
        self.lrs: list[float] = []
        self.first_lr: float | None = None

    def on_train_batch_start(self, batch, batch_idx):
        if self.first_lr is None:
            self.first_lr = self.trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        progress = next(cb.effi_progress for cb in self.trainer.callbacks if hasattr(cb, "effi_progress"))
        sched = warmup_cosine(opt, total_steps=1, warmup_fraction=0.0, min_lr_ratio=0.0, progress=progress)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_progress_based_lr_ends_exactly_at_its_end_value_with_shrinking_epochs(tmp_path):
    module = ProgressLR()
    make_trainer(tmp_path, [InfoBatchCallback(prune_ratio=0.7, delta=1.0)], max_epochs=4).fit(
        module, datamodule=ib_data()
    )
    assert module.lrs[-1] == pytest.approx(0.0, abs=1e-8)  # cosine to 0 at progress 1, no scheduler error
    # the first step runs at the schedule at progress (0 + 1/5)/4 = 0.05 (5 batches in the full epoch 0, 4 epochs),
    # the next at (0 + 2/5)/4 = 0.1. The scheduler is built before the first loader exists, at progress 0, and reads
    # its first LR again at train start (it ran the first step at progress 0: a warmup's LR 0, qa76-break 05)
    cosine = lambda p: 0.5 * (1 + math.cos(math.pi * p))  # noqa: E731
    assert module.first_lr == pytest.approx(cosine(0.05)) and module.lrs[0] == pytest.approx(cosine(0.1))
    assert all(b <= a + 1e-12 for a, b in zip(module.lrs, module.lrs[1:]))  # monotone decay


class WrappedProgressLR(ProgressLR):
    """The progress schedule of :class:`ProgressLR` (a warmup over the first 20% here) inside a ``SequentialLR`` or a
    ``ChainedScheduler``."""

    def __init__(self, wrap: str):
        super().__init__()
        self.wrap = wrap

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        progress = next(cb.effi_progress for cb in self.trainer.callbacks if hasattr(cb, "effi_progress"))
        sched = warmup_cosine(opt, total_steps=1, warmup_fraction=0.2, min_lr_ratio=0.0, progress=progress)
        if self.wrap == "sequential":
            constant = torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=1)
            sched = torch.optim.lr_scheduler.SequentialLR(opt, [sched, constant], milestones=[1000])
        elif self.wrap == "chained_alone":
            sched = torch.optim.lr_scheduler.ChainedScheduler([sched])
        elif self.wrap == "chained_last":  # a LambdaLR last in a chain sets the LR outright
            constant = torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=1)
            sched = torch.optim.lr_scheduler.ChainedScheduler([constant, sched])
        elif self.wrap == "nested":
            constant = torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=1)
            sequential = torch.optim.lr_scheduler.SequentialLR(opt, [sched, constant], milestones=[1000])
            sched = torch.optim.lr_scheduler.ChainedScheduler([sequential])
        else:
            sched = torch.optim.lr_scheduler.ChainedScheduler(
                [sched, torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=1)]
            )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("wrap", ["sequential", "chained_alone", "chained_last", "nested", "chained"])
def test_a_wrapped_progress_schedule_reads_its_first_lr_at_the_start(tmp_path, wrap):
    """A progress schedule inside a SequentialLR or a ChainedScheduler ran its first step at the LR read before
    InfoBatch's first epoch, 0 for a warmup (qa77-break 01): read again at the start (the first step at progress
    (0 + 1/5)/4 = 0.05 of a warmup to 0.2: 0.25), a SequentialLR in a ChainedScheduler too (qa78-break 02), or, before
    another scheduler in a chain, warned of."""
    module = WrappedProgressLR(wrap)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [InfoBatchCallback(prune_ratio=0.7, delta=1.0)], max_epochs=4).fit(
            module, datamodule=ib_data()
        )
    warned = [str(w.message) for w in caught if "inside a ChainedScheduler, before its last" in str(w.message)]
    if wrap == "chained":
        assert module.first_lr == 0.0 and len(warned) == 1
    else:
        assert module.first_lr == pytest.approx(0.25) and not warned


class EstimatedCosineLR(ProgressLR):
    """The usual recipe: a cosine ``LambdaLR`` to 0 over ``trainer.estimated_stepping_batches`` (full epochs),
    stepped every ``frequency`` optimizer steps."""

    frequency = 1

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        total = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": self.frequency}}


def test_a_step_schedule_sized_with_estimated_stepping_batches_warns_at_train_start(tmp_path):
    """Pruned epochs end the run before the step count ``estimated_stepping_batches`` gives (20: 4 epochs of 5 batches
    of 8 of 40 samples): a cosine sized with it stops short of 0, and a warning at train start says so, with the
    steps and the multipliers (estimate: epoch 0 and the last full, the two prune epochs ``0.7/2`` pruned: 5 + 4 + 4 +
    5 = 18 steps, cosine(18/20) = 0.0245). A schedule on InfoBatch's progress ends at 0 and is not warned of."""
    module = EstimatedCosineLR()
    with pytest.warns(UserWarning) as record:
        make_trainer(tmp_path / "a", [InfoBatchCallback(prune_ratio=0.7, delta=0.75)], max_epochs=4).fit(
            module, datamodule=ib_data()
        )
    warned = [str(w.message) for w in record if "still changes after" in str(w.message)]
    assert warned == [
        "InfoBatchCallback: the step-interval LR scheduler LambdaLR still changes after the about 18 optimizer steps "
        "this run is expected to take (pruned epochs; trainer.estimated_stepping_batches counts 20, full epochs): "
        "sized with that estimate, its LR multiplier would end near 0.0245 instead of 0. Put it on InfoBatch's "
        "progress, which ends exactly at the run's last step: in configure_optimizers, progress = "
        "lightning_effi.core.progress.progress_source(self.trainer.callbacks), then lightning_effi.core.lr_schedules."
        "progress_lambda(optimizer, fn, progress) with your multiplier fn of progress in [0, 1], or warmup_cosine("
        "optimizer, progress=progress, warmup_fraction=f, min_lr_ratio=0) for a cosine to 0 after your warmup's "
        "fraction f of the run (0: none); or step it every epoch (interval='epoch'). See the LR schedules section of "
        "the InfoBatch README"
    ]
    assert module.trainer.global_step < 20 and module.lrs[-1] > 1e-3  # what it warned of: the cosine did not end
    progress = ProgressLR()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer(tmp_path / "b", [InfoBatchCallback(prune_ratio=0.7, delta=0.75)], max_epochs=4).fit(
            progress, datamodule=ib_data()
        )
    assert not [w for w in record if "still changes after" in str(w.message)]
    assert progress.lrs[-1] == pytest.approx(0.0, abs=1e-8)
    rare = EstimatedCosineLR()
    rare.frequency = 25  # stepped never within 18 or 20 steps: nothing to warn of
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer(tmp_path / "c", [InfoBatchCallback(prune_ratio=0.7, delta=0.75)], max_epochs=4).fit(
            rare, datamodule=ib_data()
        )
    assert not [w for w in record if "still changes after" in str(w.message)]


# ------------------------------------------------------------------------------------------------ the progress clock
class ClockLog(pl.Callback):
    """Per training batch: ``(epoch, global_step after it, effi_progress_done() at its start and at its end)``, and
    ``effi_min_total_steps()`` at train start. Checkpointed, so a resumed run's final state holds both halves' rows."""

    def __init__(self) -> None:
        self.rows: list[list] = []
        self.exact: list[Fraction] = []  # effi_progress_done_exact() at each batch's end (not checkpointed)
        self.min_steps: int | None = None
        self._start = -1.0

    @staticmethod
    def clock(trainer: pl.Trainer) -> InfoBatchCallback:
        return next(cb for cb in trainer.callbacks if isinstance(cb, InfoBatchCallback))

    def on_train_start(self, trainer, pl_module):
        self.min_steps = self.clock(trainer).effi_min_total_steps()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = self.clock(trainer).effi_progress_done()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        done = self.clock(trainer).effi_progress_done()
        self.rows.append([trainer.current_epoch, trainer.global_step, self._start, done])
        self.exact.append(self.clock(trainer).effi_progress_done_exact())

    def state_dict(self):
        return {"rows": [list(r) for r in self.rows]}

    def load_state_dict(self, state_dict):
        self.rows = [list(r) for r in state_dict["rows"]]


@pytest.mark.parametrize(
    ("trainer_kwargs", "min_steps"),
    [
        # N = 40, batch 8, E = 4, delta = 0.75: epochs 1 and 2 keep >= 1 + floor(0.5 * 39) = 20 samples
        (dict(), 5 + 3 + 3 + 5),
        (dict(accumulate_grad_batches=2), 3 + 2 + 2 + 3),  # ceil(batches / 2) optimizer steps
        (dict(limit_train_batches=3), 3 + 3 + 3 + 3),  # at most 3 batches an epoch
    ],
)
def test_progress_done_per_step_and_the_fewest_steps(tmp_path, trainer_kwargs, min_steps):
    """``effi_progress_done()`` after every optimizer step is ``(e + j / L_e) / E`` with ``L_e`` the epoch's optimizer
    steps (the plan's batches, limited and accumulated as Lightning does): exactly ``n / E`` at the end of epoch
    ``n - 1`` and at the start of epoch ``n``, 1.0 after the last step; ``effi_min_total_steps()`` is the hand count,
    and the run has at least that many steps."""
    pl.seed_everything(0)
    cb, log = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7), ClockLog()
    trainer = make_trainer(tmp_path, [cb, log], max_epochs=4, **trainer_kwargs)
    trainer.fit(tiny_gpt2(), datamodule=ib_data())
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    limit = trainer_kwargs.get("limit_train_batches", 10**9)
    sizes = [h["size"] for h in cb.history]
    assert [h["kind"] for h in cb.history] == ["full", "prune", "prune", "full"] and sizes[1] < 40 and sizes[2] < 40
    steps = [math.ceil(min(math.ceil(size / 8), limit) / accumulate) for size in sizes]  # L_e
    expected, exact, step = [], [], 0
    for epoch, length in enumerate(steps):
        for j in range(1, length + 1):
            step += 1
            micro = min(math.ceil(sizes[epoch] / 8), limit) - (length - 1) * accumulate if j == length else accumulate
            start, done = (epoch + (j - 1) / length) / 4, (epoch + j / length) / 4
            expected += [[epoch, step - 1, start, start]] * (micro - 1) + [[epoch, step, start, done]]
            exact += [Fraction(epoch * length + j - 1, 4 * length)] * (micro - 1) + [
                Fraction(epoch * length + j, 4 * length)
            ]
    assert log.rows == expected  # exact floats, every micro-batch
    # and as fractions, which the floats are read back as by a reader without them (the floats round: 5/12 is
    # 0.41666666666666663 here, float(Fraction(5, 12)) 0.4166666666666667)
    assert log.exact == exact == [Fraction(row[3]).limit_denominator(2**25) for row in expected]
    epochs = [[row for row in log.rows if row[0] == epoch] for epoch in range(4)]
    assert [rows[-1][3] for rows in epochs] == [0.25, 0.5, 0.75, 1.0] == [n / 4 for n in range(1, 5)]
    assert [rows[0][2] for rows in epochs] == [0.0, 0.25, 0.5, 0.75] and cb.effi_progress_done() == 1.0
    assert log.min_steps == min_steps <= trainer.global_step == sum(steps)


class EndsEpochOneEarly(type(tiny_gpt2())):  # type: ignore[misc]
    """``on_train_batch_start`` returns -1 at batch 2 of epoch 1: Lightning ends that epoch there."""

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if self.current_epoch == 1 and batch_idx == 2 else None


def test_an_epoch_ended_early_counts_the_share_of_its_plan_it_trained(tmp_path):
    """An epoch that ends before its plan does (the module's ``on_train_batch_start`` returned -1) trained 2 of its
    batches: its saving counts by the share of its samples trained, as an early stop's does, and as the
    EfficiencyMonitor counts it; the whole plan's saving was counted (8 samples where 2.67 were saved, qa83-compat
    03)."""
    pl.seed_everything(0)
    cb, monitor = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7), EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path, [monitor, cb], max_epochs=4)
    trainer.fit(EndsEpochOneEarly(**tiny_gpt2().hparams), datamodule=ib_data())
    kinds = [(h["kind"], h.get("share")) for h in cb.history]
    size, saved = cb.history[1]["size"], cb.history[1]["saved"]
    assert kinds == [("full", None), ("prune", 16 / size), ("prune", None), ("full", None)] and saved > 0
    later = sum(cb._epoch_saving(h)[0] for h in cb.history[2:])
    expected = saved * 16 / size + later
    assert cb.totals()["saved_samples_total"] == pytest.approx(expected)
    drawn = 40 + 40 * 16 / size + 40 + 40
    assert cb.totals()["saved_fraction"] == pytest.approx(expected / drawn)
    assert monitor.summary["saved/infobatch/samples_frac"] == pytest.approx(
        expected / (expected + monitor.totals["samples"])
    )


class EndsEpochOneInsideAWindow(type(tiny_gpt2())):  # type: ignore[misc]
    """``on_train_batch_start`` returns -1 at batch 3 of epoch 1: with ``accumulate_grad_batches=2``, batches 0-2
    trained and one optimizer step was taken."""

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if self.current_epoch == 1 and batch_idx == 3 else None


def test_an_epoch_ended_inside_an_accumulation_window_counts_the_micro_batches_it_trained(tmp_path):
    """The epoch ended by -1 at batch 3 of a window of 2 trained 3 micro-batches (24 samples) for 1 optimizer step
    (16): its saving counts by the 24 samples trained, as the EfficiencyMonitor counts them (it counted the step's
    16, and the two figures of one summary disagreed: 2.67 saved for 4.00, qa84-break 06); the epoch's logged saving
    counts by the same share."""
    pl.seed_everything(0)
    cb, monitor = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7), EfficiencyMonitor(print_summary=False)
    capture = MetricsCapture()
    trainer = make_trainer(tmp_path, [monitor, cb], max_epochs=4, accumulate_grad_batches=2, logger=capture)
    trainer.fit(EndsEpochOneInsideAWindow(**tiny_gpt2().hparams), datamodule=ib_data())
    size, saved = cb.history[1]["size"], cb.history[1]["saved"]
    assert size > 24 and saved > 0 and cb.history[1]["share"] == 24 / size
    assert [h.get("share") for h in cb.history] == [None, 24 / size, None, None]
    expected = saved * 24 / size + sum(cb._epoch_saving(h)[0] for h in cb.history[2:])
    assert cb.totals()["saved_samples_total"] == pytest.approx(expected)
    assert monitor.summary["saved/infobatch/samples_frac"] == pytest.approx(
        expected / (expected + monitor.totals["samples"])
    )
    assert monitor.totals["samples"] == 40 + 24 + cb.history[2]["size"] + 40
    logged = [value for _, value in capture.series("effi/infobatch/saved_samples_epoch")]
    assert logged == pytest.approx([0.0, saved * 24 / size, cb.history[2]["saved"], 0.0])


class StopsInsideAWindow(pl.Callback):
    """Stops the fit after batch 2 of epoch 1 (as ``Timer(interval="step")`` or an ``EarlyStopping`` on a mid-epoch
    validation do): with ``accumulate_grad_batches=2``, one optimizer step and an open window."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 1 and batch_idx == 2:
            trainer.should_stop = True


class SkipsABatch(type(tiny_gpt2())):  # type: ignore[misc]
    """``training_step`` returns None at batch 0 of epoch 1 (Lightning trains nothing on it)."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return None if self.current_epoch == 1 and batch_idx == 0 else out


def _monitor_saved(monitor):
    frac = monitor.summary["saved/infobatch/samples_frac"]
    return frac * monitor.summary["samples"] / (1 - frac)


def test_the_saving_counts_the_samples_trained_in_the_last_epoch_after_a_skipped_batch_and_after_the_fit(tmp_path):
    """The saving counts each epoch by the samples it trained, as the EfficiencyMonitor does, in the summary too:
    a fit stopped inside an accumulation window in its last epoch (24 of 29 samples; its optimizer step's 16 were
    counted, 6 saved for 9.10, qa86-break 01), an epoch with a batch whose step returned None (not trained, 04), and
    read after the fit (the figures changed once the Trainer was gone, 05)."""
    pl.seed_everything(0)
    cb, monitor = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7), EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(
        tmp_path / "stop", [monitor, cb, StopsInsideAWindow()], max_epochs=4, accumulate_grad_batches=2
    )
    trainer.fit(type(tiny_gpt2())(**tiny_gpt2().hparams), datamodule=ib_data())
    size, saved = cb.history[1]["size"], cb.history[1]["saved"]
    assert len(cb.history) == 2 and cb.history[1]["share"] == 24 / size and saved > 0
    assert monitor.summary["infobatch/saved_samples"] == int(saved * 24 / size)
    assert (
        cb.totals()["saved_samples_total"] == pytest.approx(saved * 24 / size) == pytest.approx(_monitor_saved(monitor))
    )
    assert cb.effi_summary()["infobatch/saved_fraction"] == monitor.summary["infobatch/saved_fraction"]

    pl.seed_everything(0)
    cb, monitor = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7), EfficiencyMonitor(print_summary=False)
    make_trainer(tmp_path / "skip", [monitor, cb], max_epochs=4).fit(
        SkipsABatch(**tiny_gpt2().hparams), datamodule=ib_data()
    )
    size, saved = cb.history[1]["size"], cb.history[1]["saved"]
    assert cb.history[1]["share"] == (size - 8) / size  # the skipped batch's 8 samples trained nothing
    assert [h.get("share") for h in cb.history[2:]] == [None, None]
    assert cb.totals()["saved_samples_total"] == pytest.approx(_monitor_saved(monitor))


def test_with_drop_last_the_saving_is_the_samples_a_full_epoch_trains_more(tmp_path):
    """A ``drop_last`` loader trains the full batches only: a pruned epoch of 29 samples trains 24, a full one 40,
    so it saves 16, not the plan's 11 pruned samples (counted only under a ``limit_train_batches``, qa86-break 07)."""
    pl.seed_everything(0)
    cb, monitor = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7), EfficiencyMonitor(print_summary=False)
    data = InfoBatchDataModule(DropLastData(TokenBlocks(n=40), batch_size=8))
    make_trainer(tmp_path, [monitor, cb], max_epochs=4).fit(tiny_gpt2(), datamodule=data)
    hand = sum(40 - h["size"] // 8 * 8 for h in cb.history)
    assert hand > sum(h["saved"] for h in cb.history)
    assert cb.totals()["saved_samples_total"] == hand == pytest.approx(monitor.totals["saved/infobatch/samples"])
    assert cb.totals()["saved_fraction"] == pytest.approx(hand / 160) and monitor.totals["samples"] == 160 - hand


def test_progress_clock_resumes_exactly(tmp_path):
    """A run resumed mid-epoch inside a prune epoch reads the same progress at every later step as the uninterrupted
    run (the log is part of the compared callback states)."""
    pl.seed_everything(0, workers=True)
    probe = make_trainer(tmp_path / "probe", [InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7)], max_epochs=4)
    probe.fit(tiny_gpt2(), datamodule=ib_data())
    a, b = assert_resume_equals_uninterrupted(
        tiny_gpt2,
        ib_data,
        tmp_path,
        total_steps=probe.global_step,
        resume_step=7,  # the second step of epoch 1 (5 full-epoch steps first)
        callbacks_fn=lambda: [InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7), ClockLog()],
        max_epochs=4,
    )
    rows = next(cb for cb in b.callbacks if isinstance(cb, ClockLog)).rows
    assert len(rows) == probe.global_step and rows[-1][3] == 1.0
    assert next(cb for cb in b.callbacks if isinstance(cb, ClockLog)).min_steps == 16


def test_the_callback_is_the_runs_progress_clock_alone_only(tmp_path):
    cb = InfoBatchCallback()
    assert isinstance(cb, ProvidesProgressClock) and progress_clock([cb]) is cb
    assert cb.effi_progress_done() == 0.0 and cb.effi_progress_done_exact() == 0  # before any plan
    with pytest.raises(RuntimeError, match="not set up yet"):
        cb.effi_min_total_steps()
    cb._hide_clock()  # what setup does when the callback thins inside the curriculum
    assert progress_clock([cb]) is None and progress_source([cb]) is None
    cb._show_clock()
    assert progress_clock([cb]) is cb


def test_effi_baseline_charges_the_pruned_samples(tmp_path):
    """In a prune epoch each trained sample stands for ``(L + padded + saved) / (L + padded)`` (the plan's length,
    its DDP duplicates and its pruned samples); nothing in a full epoch."""

    class Baselines(pl.Callback):
        def __init__(self) -> None:
            self.rows: list = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            base = cb.effi_baseline(batch, pl_module)
            self.rows.append((trainer.current_epoch, None if base is None else base.samples))

    pl.seed_everything(0)
    cb, baselines = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7), Baselines()
    make_trainer(tmp_path, [cb, baselines], max_epochs=4).fit(tiny_gpt2(), datamodule=ib_data())
    for epoch, samples in baselines.rows:
        h = cb.history[epoch]
        if h["kind"] == "full":
            assert samples is None
        else:
            assert h["padded"] == 0 and samples == (h["size"] + h["saved"]) / h["size"] == 40 / h["size"] > 1


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prune_ratio=1.0),
        dict(prune_ratio=-0.1),
        dict(delta=0.0),
        dict(delta=1.5),
        dict(num_epochs=0),
        dict(momentum=0.0),
    ],
)
def test_bad_hyperparameters_raise_at_construction(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=rf"^InfoBatchCallback\.{name} must be"):  # the callback and the parameter
        InfoBatchCallback(**kwargs)


@pytest.mark.parametrize(
    "trainer_kwargs, match",
    [
        (dict(max_epochs=-1, max_steps=10), r"finite number of epochs.* \(and leave max_steps=-1: a step budget"),
        (dict(max_epochs=3, max_steps=10), "max_steps"),
        (dict(max_epochs=3, reload_dataloaders_every_n_epochs=2), "reload_dataloaders_every_n_epochs"),
        # num_epochs with max_epochs=-1 and nothing else to end the fit: it trained for ever (qa75-infobatch 02)
        (
            dict(max_epochs=-1, num_epochs=2),
            r"num_epochs=2 with Trainer\(max_epochs=-1\): nothing ends the fit, .* set Trainer\(max_epochs=2\)",
        ),
        # a Timer without a duration measures time only (qa76-break 02)
        (dict(max_epochs=-1, num_epochs=2, timer=True), r"num_epochs=2 with Trainer\(max_epochs=-1\): nothing ends"),
    ],
)
def test_bad_runs_raise_at_setup(tmp_path, trainer_kwargs, match):
    from lightning.pytorch.callbacks import Timer

    callbacks = [InfoBatchCallback(num_epochs=trainer_kwargs.pop("num_epochs", None))]
    callbacks += [Timer()] if trainer_kwargs.pop("timer", False) else []
    with pytest.raises(ValueError, match=match):
        make_trainer(tmp_path, callbacks, **trainer_kwargs).fit(tiny_gpt2(), datamodule=ib_data())


def test_num_epochs_under_lightnings_default_max_epochs_warns(tmp_path):
    """num_epochs with the Trainer's max_epochs left unset: Lightning's default of 1000 epochs, 997 of them on the full
    data at the LR schedule's final value after InfoBatch's 3, with no word (qa76-break 01)."""
    trainer = make_trainer(tmp_path, [InfoBatchCallback(num_epochs=3)], max_epochs=None, limit_train_batches=0)
    with pytest.warns(
        UserWarning, match=r"num_epochs=3 < max_epochs=1000 \(1000 is Lightning's default .*max_epochs=3"
    ):
        trainer.fit(tiny_gpt2(), datamodule=ib_data())


class _StopAfterFiveEpochs(pl.Callback):
    """Ends the fit after 5 epochs, as the time limit would."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.should_stop = trainer.should_stop or trainer.current_epoch >= 4


@pytest.mark.parametrize("end", ["max_time", "early_stopping"])
def test_num_epochs_with_an_unbounded_trainer_runs_where_something_ends_the_fit(tmp_path, end):
    """num_epochs with max_epochs=-1 is accepted where max_time or an EarlyStopping callback ends the fit; the fit
    trains InfoBatch's epochs, then the full data."""
    from lightning.pytorch.callbacks import EarlyStopping

    class PlateauAfterFiveEpochs(EarlyStopping):  # ends the fit after 5 epochs, as a plateau would
        on_train_epoch_end = _StopAfterFiveEpochs.on_train_epoch_end

    callback = InfoBatchCallback(num_epochs=4)
    if end == "max_time":  # the Timer is what makes the fit bounded; the plain callback stops it first here
        stop, kwargs = _StopAfterFiveEpochs(), dict(max_time={"minutes": 30})
    else:
        stop, kwargs = PlateauAfterFiveEpochs(monitor="unused", check_on_train_epoch_end=False), {}
    trainer = make_trainer(tmp_path, [callback, stop], max_epochs=-1, **kwargs)
    # a reference task with an LR schedule takes InfoBatch's progress for its length: it was refused for the infinite
    # estimated_stepping_batches (qa76-break 07)
    module = tiny_gpt2(scheduler=functools.partial(warmup_cosine, warmup_fraction=0.1, min_lr_ratio=0.0))
    with pytest.warns(UserWarning, match=r"num_epochs=4 with max_epochs=-1 \(no epoch limit\): the epochs after Info"):
        trainer.fit(module, datamodule=ib_data())
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.0  # the cosine ended at InfoBatch's 4 epochs
    assert trainer.current_epoch == 5
    assert [h["kind"] for h in callback.history] == ["full", "prune", "prune", "full", "full"]
    assert [h["size"] < 40 for h in callback.history] == [False, True, True, False, False]  # 40 samples


def test_a_fit_on_loaders_without_a_datamodule_is_told_how_to_wrap_datasets(tmp_path):
    loader = TinyDataModule(TokenBlocks(n=40), batch_size=8).train_dataloader()
    with pytest.raises(ValueError, match=r"got no datamodule \(with datasets only: InfoBatchDataModule\(Lightning"):
        make_trainer(tmp_path, [InfoBatchCallback()], max_epochs=2).fit(tiny_gpt2(), loader)


@pytest.mark.parametrize(
    "epochs, delta, warns, fewest",
    [(1, 0.875, True, 3), (2, 0.875, True, 3), (3, 0.875, False, None), (5, 0.3, True, 7), (7, 0.3, False, None)],
)
def test_a_schedule_without_a_pruning_epoch_warns_with_its_figures(tmp_path, epochs, delta, warns, fewest):
    """floor(delta * E) <= 1 leaves no pruning epoch (epoch 0 scores, the annealing epochs train on the full data):
    the run trains every sample and InfoBatch saves nothing. A warning at setup gives the annealing epoch and the
    fewest epochs that prune at this delta; a schedule with a pruning epoch does not warn, and does prune."""
    cb = InfoBatchCallback(delta=delta)
    trainer = make_trainer(tmp_path, [cb], max_epochs=epochs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(tiny_gpt2(), datamodule=ib_data())
    messages = [str(w.message) for w in caught if "no epoch of this run prunes" in str(w.message)]
    saved = sum(h["saved"] for h in cb.history)
    if warns:
        stop = math.floor(delta * epochs)
        assert len(messages) == 1 and f"floor(delta * epochs) = {stop}" in messages[0]
        assert f"train at least {fewest} epochs" in messages[0]
        assert ib.epoch_stop(fewest, delta) == 2 and ib.epoch_stop(fewest - 1, delta) <= 1
        assert saved == 0
    else:
        assert messages == [] and saved > 0


def test_prune_ratio_zero_warns_that_it_prunes_nothing(tmp_path):
    """prune_ratio=0 over a schedule that has pruning epochs: the run trains every sample at weight 1 (saves nothing);
    one warning says so, and not the no-pruning-epoch one."""
    cb = InfoBatchCallback(prune_ratio=0.0, delta=0.875)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [cb], max_epochs=4).fit(tiny_gpt2(), datamodule=ib_data())
    messages = [str(w.message) for w in caught if str(w.message).startswith("InfoBatchCallback: prune")]
    assert messages == [
        "InfoBatchCallback: prune_ratio=0 prunes nothing: every epoch trains every sample at weight 1, as without "
        "InfoBatch (a control run: the monitor reads no saving); the paper's setting is prune_ratio=0.5"
    ]
    assert not any("no epoch of this run prunes" in str(w.message) for w in caught)
    assert sum(h["saved"] for h in cb.history) == 0 and len(cb.history) == 4


@pytest.mark.parametrize("interval", [4, 5])
def test_an_int_val_check_interval_above_the_shortest_epoch_is_refused_at_setup(tmp_path, interval):
    """N = 40, batches of 8, E = 3, delta = 0.875: epoch 1 prunes and can have as few as ceil(20 / 8) = 3 batches;
    Lightning raises (without naming InfoBatch) at the first epoch shorter than ``val_check_interval``."""
    counter = CountBatches()
    trainer = make_trainer(
        tmp_path, [InfoBatchCallback(), counter], max_epochs=3, val_check_interval=interval, limit_val_batches=1
    )
    with pytest.raises(
        ValueError,
        match=rf"InfoBatchCallback: Trainer\(val_check_interval={interval}\).*as few as 3 "
        r"batches per rank .*a full epoch has 5.*val_check_interval=<float>.*val_check_interval <= 3",
    ):
        trainer.fit(tiny_gpt2(), datamodule=ib_data())
    assert counter.per_epoch == []


def test_a_pruned_epoch_without_a_batch_is_refused_at_setup(tmp_path):
    """N = 10, batches of 8 with drop_last, prune_ratio 0.5: a pruned epoch can visit as few as 1 + floor(0.5 * 9) = 5
    samples, no batch; Lightning would end the whole fit there (the annealing epoch never trained). A float
    limit_train_batches that keeps int(3 * 0.34) = 1 batch of a full epoch (N = 17) and 0 of a pruned one (2 batches
    in the helper's run, 1 + floor(0.1 * 16) = 2 samples at the fewest) made Lightning raise after epoch 0. Both are
    refused before any step, with the figures and the way out."""
    counter = CountBatches()
    data = InfoBatchDataModule(DropLastData(TokenBlocks(n=10), batch_size=8))
    with pytest.raises(
        ValueError,
        match=r"as few as 5 of the 10 samples \(prune_ratio=0.5\), fewer than one batch of 8 with the loader's "
        r"drop_last=True.*use drop_last=False, a batch size of at most 5, or a lower prune_ratio",
    ):
        make_trainer(tmp_path, [InfoBatchCallback(delta=0.75), counter], max_epochs=4).fit(tiny_gpt2(), datamodule=data)
    with pytest.raises(
        ValueError,
        match=r"Trainer\(limit_train_batches=0.34\) keeps int\(1 \* 0.34\) = 0 batches of a pruned epoch, which can "
        r"have as few as 1 batch \(.*a full epoch has 1 after the limit.*or a fraction of at least 1$",
    ):
        trainer = make_trainer(
            tmp_path, [InfoBatchCallback(prune_ratio=0.9), counter], max_epochs=3, limit_train_batches=0.34
        )
        trainer.fit(tiny_gpt2(), datamodule=ib_data(n=17))
    assert counter.per_epoch == []
    # where every pruned epoch keeps a batch (N = 20: 1 + floor(0.5 * 19) = 10 samples), the run trains every epoch
    cb = InfoBatchCallback(delta=0.75)
    data = InfoBatchDataModule(DropLastData(TokenBlocks(n=20), batch_size=8))
    make_trainer(tmp_path, [cb, counter], max_epochs=4).fit(tiny_gpt2(), datamodule=data)
    assert [h["kind"] for h in cb.history] == ["full", "prune", "prune", "full"] and len(counter.per_epoch) == 4


@pytest.mark.parametrize(
    "trainer_kwargs",
    [
        dict(val_check_interval=2),  # N = 24: the fewest batches an epoch can have, ceil((1 + 11) / 8)
        dict(val_check_interval=0.5),  # a fraction of each epoch
        dict(val_check_interval=3, check_val_every_n_epoch=None),  # counted across epochs
        dict(val_check_interval=3, limit_val_batches=0),  # no validation
    ],
)
def test_val_check_intervals_every_epoch_can_hold_are_accepted(tmp_path, trainer_kwargs):
    counter = CountBatches()
    cb = InfoBatchCallback()
    kw = dict(limit_val_batches=1) | trainer_kwargs
    make_trainer(tmp_path, [cb, counter], max_epochs=3, **kw).fit(tiny_gpt2(), datamodule=ib_data(n=24))
    assert [h["kind"] for h in cb.history] == ["full", "prune", "full"]
    assert counter.per_epoch == [math.ceil(h["size"] / 8) for h in cb.history] and cb.history[1]["size"] < 24


class StopAtTrainStart(Exception):
    pass


class PeekLoader(pl.Callback):
    """Reads the rebuilt training loader's settings, then stops the run before any worker starts."""

    def on_train_start(self, trainer, pl_module):
        loader = trainer.train_dataloader
        context = loader.multiprocessing_context
        self.settings = dict(
            num_workers=loader.num_workers,
            timeout=loader.timeout,
            multiprocessing_context=context.get_start_method() if context is not None else None,
            prefetch_factor=loader.prefetch_factor,
            in_order=loader.in_order,
            pin_memory=loader.pin_memory,
        )
        raise StopAtTrainStart


class LoaderOptions(TinyDataModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=1,
            timeout=30,
            multiprocessing_context="spawn",
            in_order=False,
            prefetch_factor=3,
        )


def test_the_rebuilt_loader_keeps_the_users_loader_settings(tmp_path):
    """``timeout``, ``multiprocessing_context`` and ``in_order`` (with the other settings) survive the rebuild."""
    peek = PeekLoader()
    trainer = make_trainer(tmp_path, [InfoBatchCallback(), peek], max_epochs=2)
    with pytest.raises(StopAtTrainStart):
        trainer.fit(tiny_gpt2(), datamodule=InfoBatchDataModule(LoaderOptions(TokenBlocks(n=16))))
    assert peek.settings == dict(
        num_workers=1, timeout=30, multiprocessing_context="spawn", prefetch_factor=3, in_order=False, pin_memory=False
    )


def test_unwrapped_datamodule_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="InfoBatchDataModule"):
        make_trainer(tmp_path, [InfoBatchCallback()], max_epochs=2).fit(
            tiny_gpt2(), datamodule=TinyDataModule(TokenBlocks())
        )


class NoPerSampleLoss(GPT2CausalLM):
    def __init__(self):
        super().__init__(**TINY_GPT2, optimizer=sgd)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)["loss"]


def test_a_plain_loss_without_labels_fails_on_the_first_batch_asking_for_fn(tmp_path):
    """A plain loss (no ``per_sample_loss``) on a batch without labels: the automatic cross-entropy has nothing to
    compare the logits with (tests/infobatch/test_user_modules.py covers the modules it serves)."""
    counter = CountBatches()
    with pytest.raises(ValueError, match=r"needs labels in the batch.*per_sample_loss=fn"):
        make_trainer(tmp_path, [InfoBatchCallback(), counter], max_epochs=2).fit(
            NoPerSampleLoss(), datamodule=ib_data()
        )
    assert counter.per_epoch == [0]


def test_nonfinite_losses_never_enter_the_score_table():
    cb = InfoBatchCallback(nonfinite_loss="warn")
    cb.dataset_size, cb.epochs = 4, 2
    cb.score, cb.seen = torch.zeros(4), torch.zeros(4, dtype=torch.bool)
    cb.sum_loss, cb.count = torch.zeros(4), torch.zeros(4, dtype=torch.int32)
    out = cb.rescale_output(
        {"loss": None, "per_sample_loss": torch.tensor([1.0, float("nan"), float("inf"), 2.0])},
        torch.tensor([0, 1, 2, 3]),
    )
    ib.finalize(cb.sum_loss, cb.count, cb.score, cb.seen)
    assert cb.seen.tolist() == [True, False, False, True] and cb.score.tolist() == [1.0, 0.0, 0.0, 2.0]
    # the batch's training loss is non-finite too: the "warn" policy warns once and counts the step (once)
    assert math.isnan(float(out["loss"]))
    trainer = SimpleNamespace(callbacks=[cb], global_step=5)
    with pytest.warns(UserWarning, match=r"InfoBatchCallback: the training loss is nan at step 5"):
        cb.on_before_backward(trainer, SimpleNamespace(automatic_optimization=True), out["loss"])
    assert (cb.nonfinite_guard.count, cb.nonfinite_guard.first_step) == (1, 5)


@pytest.mark.slow
@pytest.mark.parametrize("n", [41, 40])
def test_ddp_ranks_share_plans_and_scores_and_shard_disjointly(tmp_path, n):
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=1)
    monitor = EfficiencyMonitor(print_summary=False)
    # 41 samples: an uneven split (padding) on every epoch; 40: padding only where a pruned plan is odd; bs 5
    _, per_rank = fit_ddp(tiny_gpt2(), ib_data(n=n, batch_size=5), tmp_path, [monitor, cb], max_epochs=4)
    by_epoch = [{}, {}]
    for rank, record in enumerate(per_rank):
        for batch in record["batches"]:
            by_epoch[rank].setdefault(batch["epoch"], []).extend(batch["index"])
    assert per_rank[0]["global_step"] == per_rank[1]["global_step"]
    for epoch in range(4):
        a, b = by_epoch[0][epoch], by_epoch[1][epoch]
        assert len(a) == len(b)  # equal per-rank lengths: no hang
        union = sorted(set(a) | set(b))
        assert len(a) + len(b) - len(union) <= 1  # at most one padded duplicate (odd plan length)
    full, pruned = len(by_epoch[0][0]), len(by_epoch[0][1])
    assert full == -(-n // 2) and pruned < full  # per-rank steps drop on prune epochs
    assert per_rank[0]["scores"] == per_rank[1]["scores"]  # identical score tables after the last epoch
    summaries = [r["summary"] for r in per_rank]
    assert summaries[0]["infobatch/saved_samples"] == summaries[1]["infobatch/saved_samples"] > 0
    # the baseline is a plain DDP run: n padded to a multiple of 2 per epoch, whatever the pruned epochs' duplicates
    trained = sum(len(by_epoch[0][e]) + len(by_epoch[1][e]) for e in range(4))
    assert summaries[0]["samples"] == trained and summaries[0]["baseline_samples"] == 4 * 2 * full


@pytest.mark.slow
def test_ddp_ranks_share_the_token_table_and_the_baseline_tokens_of_a_plain_run(tmp_path):
    """Each rank trains half of every epoch: the token table is summed over the ranks at each epoch's end, so both
    hold every sentence's length, and the baseline tokens come within a pruned epoch's DDP duplicate of a plain
    2-rank run's (40 sentences in batches of 5: no duplicate in a full epoch, at most one in a pruned one)."""
    lengths = [float(len(x)) for x in sentence_data().train_dataset.items]
    cb, monitor = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=1), EfficiencyMonitor(print_summary=False)
    _, per_rank = fit_ddp(
        tiny_bert_cls(),
        InfoBatchDataModule(tiny_sentence_data(batch_size=5)),
        tmp_path / "ib",
        [monitor, cb],
        max_epochs=4,
    )
    assert (
        per_rank[0]["sample_tokens"]["InfoBatchCallback"]
        == per_rank[1]["sample_tokens"]["InfoBatchCallback"]
        == lengths
    )
    s = per_rank[0]["summary"]
    assert s["baseline_samples"] == 4 * 40 and s["samples"] < 4 * 40
    assert s["baseline_tokens"] == pytest.approx(4 * sum(lengths), abs=2 * max(lengths))


class BatchNormClassifier(pl.LightningModule):
    """A user's MLP with BatchNorm1d on ``[B, C]`` features, tuple batches ``(x, y)``, a plain loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Vectors(torch.utils.data.Dataset):
    def __init__(self, n: int = 24) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_batchnorm1d_with_partial_batches_warns_at_setup_and_its_error_names_the_cause(tmp_path):
    """24 samples in batches of 8 (no partial batch in the user's loader); epoch 1 planned at 17 samples ends with a
    batch of one, on which BatchNorm1d raises. Setup warns (BatchNorm1d, drop_last=False), and the error carries a
    note naming the pruned epoch's last batch and drop_last=True."""
    data = InfoBatchDataModule(TinyDataModule(Vectors(), batch_size=8))
    with pytest.warns(UserWarning, match=r"has BatchNorm1d layers \(net\.1\) and the training loader keeps partial"):
        with pytest.raises(ValueError, match="Expected more than 1 value per channel") as err:
            make_trainer(tmp_path, [FixedLengths([24, 17, 24], prune_ratio=0.5, delta=0.67)], max_epochs=3).fit(
                BatchNormClassifier(), datamodule=data
            )
    assert err.value.__notes__ == [
        "InfoBatchCallback: a pruned epoch's size varies, so its last batch can hold a single sample; set "
        "drop_last=True on your training loader (InfoBatch keeps it)"
    ]


class DropLastData(TinyDataModule):
    """The tiny DataModule's loader with ``drop_last=True``."""

    def train_dataloader(self):
        from lightning_effi.core.loader import EpochShuffleSampler, ResumableDataLoader

        sampler = EpochShuffleSampler(self.train_dataset, num_replicas=1, rank=0, seed=self.seed)
        return ResumableDataLoader(self.train_dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True)


def test_with_drop_last_the_baseline_is_what_the_plain_loader_trains(tmp_path):
    """40 samples in batches of 6 with drop_last: a full epoch trains 36. The monitor's baseline over 4 epochs is
    exactly the 144 samples the same run without InfoBatch trains (the pruned epochs' dropped remainders were counted
    as pruned-sample stand-ins before: 727 of 768 in the helper's run)."""
    monitor = EfficiencyMonitor(print_summary=False)
    pl.seed_everything(0)
    make_trainer(tmp_path / "ib", [InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7), monitor], max_epochs=4).fit(
        tiny_gpt2(), datamodule=InfoBatchDataModule(DropLastData(TokenBlocks(n=40), batch_size=6))
    )
    plain = EfficiencyMonitor(print_summary=False)
    pl.seed_everything(0)
    make_trainer(tmp_path / "plain", [plain], max_epochs=4).fit(
        tiny_gpt2(), datamodule=DropLastData(TokenBlocks(n=40), batch_size=6)
    )
    assert plain.summary["samples"] == 4 * 36
    assert monitor.summary["baseline_samples"] == 4 * 36 and monitor.summary["samples"] < 4 * 36
    assert monitor.summary["samples_saved_frac"] == pytest.approx(1 - monitor.summary["samples"] / 144)


def sentence_data() -> TinyDataModule:
    """40 sentences of 3-16 tokens, padded per batch of 8 (an ``attention_mask``)."""
    return tiny_sentence_data(batch_size=8)


def test_on_sentences_of_unequal_length_the_baseline_tokens_are_a_plain_runs(tmp_path):
    """InfoBatch prunes well-learned samples, whose length need not be the mean: each pruned sample is charged at its
    own tokens (the token table), so the monitor's baseline tokens and layer-tokens over 4 epochs are exactly those of
    the same run without InfoBatch (charged at the trained samples' mean length they read 1,365 for 1,356 here)."""
    monitor, plain = EfficiencyMonitor(print_summary=False), EfficiencyMonitor(print_summary=False)
    pl.seed_everything(0)
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7)
    make_trainer(tmp_path / "ib", [cb, monitor], max_epochs=4).fit(
        tiny_bert_cls(), datamodule=InfoBatchDataModule(sentence_data())
    )
    pl.seed_everything(0)
    make_trainer(tmp_path / "plain", [plain], max_epochs=4).fit(tiny_bert_cls(), datamodule=sentence_data())
    s, p = monitor.summary, plain.summary
    lengths = torch.tensor([len(x) for x in sentence_data().train_dataset.items], dtype=torch.float64)
    assert p["tokens"] == 4 * lengths.sum() and [h["kind"] for h in cb.history] == ["full", "prune", "prune", "full"]
    assert torch.equal(cb.sample_tokens, lengths)  # every sample's tokens, as it trained
    assert s["tokens"] < p["tokens"] and s["samples"] < p["samples"]
    assert s["baseline_samples"] == p["samples"]
    assert s["baseline_tokens"] == pytest.approx(p["tokens"], rel=1e-12)
    assert s["baseline_layer_tokens"] == pytest.approx(p["layer_tokens"], rel=1e-12)
    # the pruned epochs' samples are not of the mean length: charged at it, the baseline would read otherwise
    trained = [h for h in cb.history if h["kind"] == "prune"]
    assert trained and all(ib.token_ratio(lengths, cb.plan_for(h["epoch"]).indices) != 1.0 for h in trained)


def test_resuming_mid_prune_epoch_keeps_the_token_table_and_the_baseline_exact(tmp_path):
    """The token table and its rank-local sums are checkpointed: a run resumed inside a prune epoch counts the same
    baseline as one never stopped (the monitor's and InfoBatch's states equal, the harness's check)."""
    assert_resume_equals_uninterrupted(
        tiny_bert_cls,
        lambda: InfoBatchDataModule(sentence_data()),
        tmp_path,
        total_steps=18,  # epochs of 40, 31, 29, 40 samples: 5 + 4 + 4 + 5 batches
        resume_step=7,  # inside epoch 1, the first pruned one
        max_epochs=4,
        callbacks_fn=lambda: [
            InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7),
            EfficiencyMonitor(print_summary=False),
        ],
        ignore_state=MONITOR_TIMES,
    )


def test_a_fit_stopped_inside_a_pruned_epoch_reports_infobatchs_saving_as_the_monitor_does(tmp_path):
    """Stopped early (EarlyStopping, max_time) inside epoch 1, the first pruned one: InfoBatch's own saved_fraction
    divided by the planned run (6 epochs x 40) and took the cut epoch's pruned samples whole (0.0417 next to the
    monitor's 0.0526 in the helper's run). Both now count the share of the cut epoch trained."""

    class StopAt(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = trainer.global_step == 7  # 5 steps of epoch 0, 2 of epoch 1

    pl.seed_everything(0)
    cb, monitor = InfoBatchCallback(prune_ratio=0.5, delta=0.875, seed=7), EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path, [cb, monitor, StopAt()], max_epochs=6)
    trainer.fit(tiny_gpt2(), datamodule=ib_data())
    s, h = monitor.summary, cb.history[-1]
    assert trainer.global_step == 7 and h["kind"] == "prune" and h["saved"] > 0
    assert s["samples"] == 40 + 16 < s["baseline_samples"]
    assert s["infobatch/saved_fraction"] == pytest.approx(s["samples_saved_frac"])
    assert s["infobatch/saved_fraction"] == pytest.approx(h["saved"] * 16 / h["size"] / (40 + 40 * 16 / h["size"]))


def test_stochastic_weight_averagings_added_epoch_is_not_in_infobatchs_saving(tmp_path):
    """StochasticWeightAveraging adds a forward-only epoch past InfoBatch's schedule: it entered InfoBatch's
    saved_fraction as a trained epoch (0.1548 against the monitor's 0.1625 in the helper's run)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from tests.helpers.tiny import tiny_cnn, tiny_image_data

    pl.seed_everything(0)
    cb, monitor = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7), EfficiencyMonitor(print_summary=False)
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)
    trainer = make_trainer(tmp_path, [monitor, cb, swa], max_epochs=4)
    trainer.fit(tiny_cnn(), datamodule=InfoBatchDataModule(tiny_image_data()))
    assert [h["epoch"] for h in cb.history] == [0, 1, 2, 3, 4]  # the 5th: SWA's batch-norm epoch
    s = monitor.summary
    assert s["infobatch/saved_fraction"] == pytest.approx(s["samples_saved_frac"]) and s["samples_saved_frac"] > 0


@pytest.mark.parametrize("seed", [-1, 2**64, 10**30])
def test_a_seed_outside_the_generators_range_is_refused(seed):
    """Seeds are hashed to 64 bits: ``2**64`` drew seed 0's plans and ``-1`` those of ``2**64 - 1``, silently (the
    curriculum and the app refuse negative seeds). The range is [0, 2**64 - 1]."""
    with pytest.raises(ValueError, match=r"InfoBatchCallback.seed must be an int >= 0 and <= 18446744073709551615"):
        InfoBatchCallback(seed=seed)
    assert InfoBatchCallback(seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize("limit", [3, 0.8])
def test_the_baseline_under_limit_train_batches_is_a_full_epoch_under_the_limit(tmp_path, limit):
    """``limit_train_batches=3`` on 5-batch epochs: a full epoch and a pruned one (25-39 of 40 samples) both train
    3 batches, so InfoBatch saves nothing, and the record says 0 (it read a saving from the unlimited epochs).
    ``0.8``: a full epoch trains int(5 · 0.8) = 4 batches, a pruned one int(4 · 0.8) = 3 or int(5 · 0.8) = 4: the
    saving is those batches, by hand. The int limit is warned at setup: its pruned epochs save nothing and train
    their kept well-learned samples at twice their weight (qa113-tabular 06); the fraction is not."""
    pl.seed_everything(0)
    cb, monitor = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7), EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path, [monitor, cb], max_epochs=4, limit_train_batches=limit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(tiny_gpt2(), datamodule=ib_data())
    fixed = [str(w.message) for w in caught if "limit_train_batches" in str(w.message)]
    if isinstance(limit, int):
        assert len(fixed) == 1 and fixed[0].startswith(
            "InfoBatchCallback: Trainer(limit_train_batches=3) trains at most 3 batches an epoch, fewer than a full "
            "epoch's 5: a pruned epoch longer than that trains as many samples as a full one (nothing saved) and its "
            "first 3 batches keep InfoBatch's rescaled weights (1 / (1 - prune_ratio) = 2 on"
        ), fixed
    else:
        assert not fixed, fixed
    s, sizes = monitor.summary, [h["size"] for h in cb.history]
    assert [h["kind"] for h in cb.history] == ["full", "prune", "prune", "full"] and 24 < min(sizes[1:3]) < 40

    def trained(size: int) -> int:  # samples of an epoch of `size` under the limit, by hand
        batches = math.ceil(size / 8)
        batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
        return min(size, batches * 8)

    assert s["samples"] == sum(trained(n) for n in sizes)
    assert s["baseline_samples"] == pytest.approx(4 * trained(40))
    if limit == 3:  # every epoch trains its first 3 batches
        assert s["samples"] == s["baseline_samples"] == 4 * 24 and s["flops_saved_frac"] == 0.0
    else:  # 4 batches of a full epoch, 3 or 4 of a pruned one (25-32 samples: 4 batches, 33-39: 5)
        assert s["samples_saved_frac"] == pytest.approx(1 - s["samples"] / (4 * 32))


def test_a_second_fit_on_the_same_trainer_is_refused_with_the_fixes_for_that_case(tmp_path):
    """The same callback trained the first fit: the refusal says the Trainer trained before and that InfoBatch plans
    one fit (not that the fit has no InfoBatch state), and offers training the whole length in one fit."""
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=0)
    trainer = make_trainer(tmp_path, [cb], max_epochs=2)
    model = tiny_gpt2()
    trainer.fit(model, datamodule=ib_data())
    trainer.fit_loop.max_epochs = 4
    with pytest.raises(ValueError) as refused:
        trainer.fit(model, datamodule=ib_data())
    message = str(refused.value)
    assert message.startswith(
        "InfoBatchCallback: this fit starts at step 10 on a Trainer that trained before (a second trainer.fit on the "
        "same Trainer: InfoBatch plans one fit and does not continue into another)"
    )
    assert "train the whole length in one fit (max_epochs)" in message and "without InfoBatch state" not in message


@pytest.mark.parametrize("limit", [2, 4, 0.5])
def test_saved_samples_under_limit_train_batches_are_the_samples_not_trained(tmp_path, limit):
    """Under ``limit_train_batches`` a limited epoch may stop before the samples a plan left out: InfoBatch's own
    ``saved_samples`` (in result.json next to the monitor's figures) counted the plan's pruned samples (43 of 128
    with a limit of 2 batches, where both runs train 16 samples an epoch). It now equals the monitor's saving."""
    cb, monitor = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=0), EfficiencyMonitor(print_summary=False)
    make_trainer(tmp_path, [monitor, cb], max_epochs=4, limit_train_batches=limit).fit(
        tiny_gpt2(), datamodule=ib_data()
    )
    s = monitor.summary
    assert s["infobatch/saved_samples"] == s["baseline_samples"] - s["samples"]
    if limit == 2:  # 2 batches of 8 whatever the plan
        assert s["infobatch/saved_samples"] == 0 and s["samples"] == 4 * 16


class TimmCosine(ProgressLR):
    """The timm recipe: ``CosineLRScheduler(t_initial=estimated_stepping_batches)`` stepped in lr_scheduler_step."""

    def configure_optimizers(self):
        from timm.scheduler import CosineLRScheduler

        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        sched = CosineLRScheduler(opt, t_initial=self.trainer.estimated_stepping_batches, lr_min=0.0, t_in_epochs=False)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric):
        scheduler.step_update(num_updates=self.global_step)


def test_a_timm_schedule_sized_with_estimated_stepping_batches_warns_too(tmp_path):
    """torch's cosine was warned of, timm's not: the run ended with the LR at 4-11% of its peak (qa37-user 05)."""
    module = TimmCosine()
    with pytest.warns(
        UserWarning,
        match=r"scheduler CosineLRScheduler still changes after the about 18 .*near "
        r"0\.0245 instead of 0.*scheduler\.step_update\(num_updates=round\(progress\(\)",
    ):
        make_trainer(tmp_path, [InfoBatchCallback(prune_ratio=0.7, delta=0.75)], max_epochs=4).fit(
            module, datamodule=ib_data()
        )
    assert module.trainer.global_step < 20 and module.lrs[-1] > 1e-3


def test_the_threshold_is_logged_in_pruned_epochs_only(tmp_path):
    """A full epoch (epoch 0, the annealing ones) has no threshold: it was logged as NaN, which trips plotting scripts
    reading the CSV (qa39-user note)."""
    from lightning.pytorch.loggers import Logger

    class Rows(Logger):
        name, version, rows = "rows", 0, []

        def log_metrics(self, metrics, step=None):
            self.rows.append(dict(metrics))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    rows = Rows()
    cb = InfoBatchCallback(prune_ratio=0.5, delta=0.75)
    make_trainer(tmp_path, [cb], max_epochs=4, logger=rows).fit(tiny_gpt2(), datamodule=ib_data())
    epochs = [r for r in rows.rows if "effi/infobatch/well_learned_frac" in r]
    assert len(epochs) == 4 and [h["kind"] for h in cb.history] == ["full", "prune", "prune", "full"]
    thresholds = [r.get("effi/infobatch/threshold") for r in epochs]
    assert thresholds[0] is None and thresholds[3] is None
    assert thresholds[1:3] == [cb.history[1]["threshold"], cb.history[2]["threshold"]]
    assert all(math.isfinite(v) for r in rows.rows for v in r.values() if isinstance(v, float))


def test_the_summary_read_after_the_fit_keeps_the_limit_of_the_fit(tmp_path):
    """``effi_summary()`` read after the fit forgot ``limit_train_batches`` (the Trainer is let go at teardown): its
    saved fraction read 0.0486 where the monitor's, written at the fit's end, read 0.0556 (qa57-loops 05)."""
    from lightning_effi import EfficiencyMonitor

    pl.seed_everything(0)
    cb, monitor = InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7), EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path, [monitor, cb], max_epochs=4, limit_train_batches=0.5)
    trainer.fit(tiny_gpt2(), datamodule=ib_data(n=48, batch_size=4))
    during = monitor.summary["infobatch/saved_fraction"]
    assert during > 0 and cb.effi_summary()["infobatch/saved_fraction"] == during
