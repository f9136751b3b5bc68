"""A checkpoint a user's own callback writes in ``on_train_batch_end`` (``trainer.save_checkpoint``), listed before the
techniques: Lightning runs only checkpoint callbacks last, and resumes such a checkpoint after its batch
(``RestartStage.RESTARTED_ON_TRAIN_BATCH_END``). The curriculum's state was written one batch behind and the resumed
fit trained the stream one step late (qa38-break 01): it commits the batch when such a checkpoint is written. The
EfficiencyMonitor writes its totals as they stand after the batch; the V-cycle the batch's FLOPs, and the resumed fit
makes the level switch of the batch's end at its start."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_effi.callbacks import Curriculum, VCycleCallback
from lightning_effi.core.accounting import EfficiencyMonitor
from lightning_effi.data import CurriculumDataModule
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TinyDataModule, TokenBlocks, seqlen_truncate, tiny_gpt2


class SaveAt(Callback):
    """The user's "save at step k" callback."""

    def __init__(self, path, step):
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not os.path.exists(self.path):
            trainer.save_checkpoint(self.path)


class Lengths(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rows.append((trainer.global_step, int(batch["input_ids"].shape[1])))


def fit(root, callbacks, ckpt=None, **kw):
    pl.seed_everything(0)
    trace = Lengths()
    trainer = make_trainer(root, [*callbacks, trace], max_steps=10, max_epochs=-1, **kw)
    model = tiny_gpt2(n_layer=4)
    data = CurriculumDataModule(TinyDataModule(TokenBlocks(n=48), batch_size=4))
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)
    return model, trace.rows


def test_a_curriculum_checkpoint_written_in_a_users_batch_end_resumes_after_the_batch(tmp_path):
    def curriculum():
        return Curriculum(metrics=seqlen_truncate(4, 16, 6, 4), seed=3, num_epochs=2)

    path = str(tmp_path / "user.ckpt")
    whole, rows = fit(tmp_path / "a", [SaveAt(path, 4), curriculum()])
    resumed, tail = fit(tmp_path / "b", [curriculum()], ckpt=path)
    assert tail == rows[4:]  # steps 5-10 at the uninterrupted run's lengths (it trained 12, 12 where that ran 12, 16)
    assert len({length for _, length in rows}) > 2
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def fit_vcycle(root, callbacks, ckpt=None, max_steps=8):
    pl.seed_everything(0)
    vcycle = VCycleCallback(e_a=2, e_small=2)
    monitor = EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(
        root, [monitor, *callbacks, vcycle], max_steps=max_steps, max_epochs=-1, enable_checkpointing=True
    )
    model = tiny_gpt2(n_layer=4)
    trainer.fit(model, datamodule=TinyDataModule(TokenBlocks(n=48), batch_size=4), ckpt_path=ckpt)
    return model, vcycle, monitor


@pytest.mark.parametrize("step", [2, 3, 4])
def test_a_vcycle_checkpoint_written_in_a_users_batch_end_resumes_after_the_batch(tmp_path, step):
    """The user's callback listed before the V-cycle saves at step 2 (its level 1 -> 2 switch, made in its
    on_train_batch_end), 3 (inside the coarse stage) or 4 (the switch back): the resumed fit switched one step late
    (layer-tokens 2176 for 2048, qa38-break 01) and the V-cycle's FLOPs missed the batch. The checkpoint holds the
    batch's FLOPs, and the resumed fit makes the batch's switch at its start: weights, FLOPs and totals equal the
    uninterrupted run's."""
    path = str(tmp_path / "user.ckpt")
    whole, vcycle, monitor = fit_vcycle(tmp_path / "a", [SaveAt(path, step)])
    resumed, vcycle2, monitor2 = fit_vcycle(tmp_path / "b", [], ckpt=path)
    assert vcycle.switches == 2 and vcycle2.stage_index == vcycle.stage_index == 2
    assert vcycle2.flops_account.state_dict() == vcycle.flops_account.state_dict()
    assert counted(monitor2) == counted(monitor)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_vcycle_checkpoint_of_the_last_step_resumed_ends_on_the_full_model(tmp_path):
    """A fit resumed from the run's last step has no step left: Lightning skips its training loop (no
    on_train_start), so the level switch due at that batch's end (the user's checkpoint is written before the
    V-cycle's own batch end, where the cycle goes back to the full model) was never made: the module stayed coarse
    (8,128 parameters for 53,952, qa43-break 06)."""
    path = str(tmp_path / "user.ckpt")
    whole, vcycle, _ = fit_vcycle(tmp_path / "a", [SaveAt(path, 4)], max_steps=4)
    resumed, vcycle2, _ = fit_vcycle(tmp_path / "b", [], ckpt=path, max_steps=4)
    assert vcycle2.level == vcycle.level == 1 and vcycle2.switches == vcycle.switches == 2
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_vcycle_checkpoint_written_after_a_raise_in_batch_end_resumes_after_the_batch(tmp_path):
    """OnExceptionCheckpoint saves after the V-cycle's on_exception, at the step of its level 1 -> 2 switch."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    whole, vcycle, monitor = fit_vcycle(tmp_path / "a", [])
    with pytest.raises(RuntimeError, match="stop here"):
        fit_vcycle(tmp_path / "b", [RaiseAt(2), OnExceptionCheckpoint(tmp_path / "exc", filename="exc")])
    resumed, vcycle2, monitor2 = fit_vcycle(tmp_path / "c", [], ckpt=str(tmp_path / "exc" / "exc.ckpt"))
    assert vcycle2.flops_account.state_dict() == vcycle.flops_account.state_dict()
    assert counted(monitor2) == counted(monitor)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def counted(monitor):
    return {k: v for k, v in monitor.totals.items() if not k.startswith("time")}


def no_wall(schedule):
    return [{k: v for k, v in point.items() if k != "train_wall_s"} for point in schedule]


def test_the_monitors_totals_resume_after_the_batch_from_a_users_batch_end_checkpoint(tmp_path):
    """The user's callback listed before the monitor: the checkpoint's totals left out the batch it was written in,
    which the resumed fit does not train again (36 samples, 448 tokens for the uninterrupted run's 40 and 496,
    qa38-break 01). The monitor writes its state as it stands after the batch; its own totals are left alone."""

    def curriculum():
        return Curriculum(metrics=seqlen_truncate(4, 16, 6, 4), seed=3, num_epochs=2)

    path = str(tmp_path / "user.ckpt")
    plain = EfficiencyMonitor(print_summary=False)
    fit(tmp_path / "a", [plain, curriculum()], log_every_n_steps=2)
    saving = EfficiencyMonitor(print_summary=False)
    fit(tmp_path / "b", [SaveAt(path, 4), saving, curriculum()], log_every_n_steps=2)
    resumed = EfficiencyMonitor(print_summary=False)
    fit(tmp_path / "c", [resumed, curriculum()], ckpt=path, log_every_n_steps=2)
    assert counted(saving) == counted(plain)
    assert counted(resumed) == counted(plain)
    assert plain.totals["batches"] == 10 and plain.totals["saved/curriculum/tokens"] > 0
    assert no_wall(resumed.schedule) == no_wall(plain.schedule)  # the step-4 point (a logging step) is in it


def test_the_monitors_totals_resume_after_the_batch_whose_batch_end_raised(tmp_path):
    """OnExceptionCheckpoint saves after the monitor's on_exception: the trained batch is counted there."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    def curriculum():
        return Curriculum(metrics=seqlen_truncate(4, 16, 6, 4), seed=3, num_epochs=2)

    plain = EfficiencyMonitor(print_summary=False)
    fit(tmp_path / "a", [plain, curriculum()])
    with pytest.raises(RuntimeError, match="stop here"):
        saver = OnExceptionCheckpoint(tmp_path / "exc", filename="exc")
        callbacks = [RaiseAt(4), EfficiencyMonitor(print_summary=False), curriculum(), saver]
        fit(tmp_path / "b", callbacks, enable_checkpointing=True)
    resumed = EfficiencyMonitor(print_summary=False)
    fit(tmp_path / "c", [resumed, curriculum()], ckpt=str(tmp_path / "exc" / "exc.ckpt"))
    assert counted(resumed) == counted(plain)
    assert plain.totals["batches"] == 10 and plain.totals["saved/curriculum/tokens"] > 0


class RaiseAt(Callback):
    """Raises in on_train_batch_end at step k (a callback listed before the techniques, or a Ctrl-C landing there)."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("stop here")


def test_an_exception_in_batch_end_before_the_curriculum_resumes_after_the_batch(tmp_path):
    """OnExceptionCheckpoint writes the checkpoint after the curriculum's on_exception, which dropped the trained batch:
    the resumed stream ran one step late (12 tokens at step 6 where the uninterrupted run trains 16, qa39-break 06).
    The batch trained, so it is committed."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    def curriculum():
        return Curriculum(metrics=seqlen_truncate(4, 16, 6, 4), seed=3, num_epochs=2)

    _, rows = fit(tmp_path / "a", [curriculum()])
    with pytest.raises(RuntimeError, match="stop here"):
        saver = OnExceptionCheckpoint(tmp_path / "exc", filename="exc")
        fit(tmp_path / "b", [RaiseAt(4), curriculum(), saver], enable_checkpointing=True)
    _, tail = fit(tmp_path / "c", [curriculum()], ckpt=str(tmp_path / "exc" / "exc.ckpt"))
    assert tail == rows[4:]
