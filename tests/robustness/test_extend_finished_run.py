"""Extending a finished run: a longer fit resumed from the checkpoint a fit wrote at its end (the README's "to extend a
finished run raise trainer.max_epochs"). Each technique's schedule had ended, so the longer run goes on where it
ended (full data, max_value, the full model, the grown sample budget), announced, instead of a refusal whose only
remedy (strict=False) planned the ended schedule again for the new length (qa35-break 02)."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_effi.callbacks import Curriculum, InfoBatchCallback, RandomLTDCallback, VCycleCallback
from lightning_effi.data import CurriculumDataModule, InfoBatchDataModule
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TinyDataModule, TokenBlocks, seqlen_truncate, tiny_gpt2


class Trace(Callback):
    """Per training batch: (epoch, samples, random-LTD's reserved length, V-cycle level, the first token ids)."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ltd = next((c for c in trainer.callbacks if isinstance(c, RandomLTDCallback)), None)
        vc = next((c for c in trainer.callbacks if isinstance(c, VCycleCallback)), None)
        ids = batch["input_ids"]
        self.rows.append(
            (
                trainer.current_epoch,
                ids.shape[0],
                None if ltd is None else ltd.current_value,
                None if vc is None else vc.level,
                tuple(ids[:, 0].tolist()),
            )
        )


def fit(root, make, data, length, ckpt=None, extra=()):
    pl.seed_everything(0)
    trace = Trace()
    trainer = make_trainer(root, [make(), trace, *extra], **length)
    trainer.fit(tiny_gpt2(n_layer=4), datamodule=data(), ckpt_path=ckpt)
    return trainer, trace.rows


def plain(n=48):
    return TinyDataModule(TokenBlocks(n=n), batch_size=4)


CASES = {
    "infobatch": (
        lambda: InfoBatchCallback(prune_ratio=0.5, delta=0.67, seed=7),
        lambda: InfoBatchDataModule(plain()),
        "max_epochs",
        3,
        "had ended its pruning",
    ),
    "random_ltd": (
        lambda: RandomLTDCallback(min_value=4, max_value=16, seq_per_step=4, seed=7),
        plain,
        "max_steps",
        10,
        "reached max_value by step 10",
    ),
    "vcycle": (
        lambda: VCycleCallback(e_a="0.2dur", e_small="0.4dur"),
        plain,
        "max_steps",
        10,
        "had made its last switch back to the full model",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_finished_run_extended_goes_on_where_its_schedule_ended(tmp_path, caplog, name):
    make, data, key, n, said = CASES[name]
    other = {"max_steps": -1} if key == "max_epochs" else {"max_epochs": -1}
    first, rows = fit(tmp_path / "a", make, data, {key: n, **other})
    path = tmp_path / "end.ckpt"
    first.save_checkpoint(path)
    with caplog.at_level(logging.INFO):
        _, more = fit(tmp_path / "b", make, data, {key: 2 * n, **other}, ckpt=str(path))
    assert said in caplog.text
    if name == "infobatch":  # epoch 2 annealed (full data); the added epochs train the full data too
        per_epoch = {}
        for epoch, size, *_ in rows + more:
            per_epoch[epoch] = per_epoch.get(epoch, 0) + size
        assert per_epoch[1] < 48 and [per_epoch[e] for e in (2, 3, 4, 5)] == [48, 48, 48, 48]
    if name == "random_ltd":  # 12 at the last step of the finished run, max_value after it
        assert rows[-1][2] == 12 and {r[2] for r in more} == {16}
    if name == "vcycle":  # the coarse level trained inside the finished run; the full model after it
        assert 2 in {r[3] for r in rows} and {r[3] for r in more} == {1}


def test_an_unfinished_schedule_with_another_length_is_still_refused_naming_the_jump(tmp_path):
    """Mid-schedule, a changed run length would move the reserved length: refused, naming the jump and the way to
    keep the checkpoint's schedule."""
    make = CASES["random_ltd"][0]
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1, filename="{step}")
    fit(tmp_path / "a", make, plain, {"max_steps": 10, "max_epochs": -1}, extra=(every,))
    # step 5 of require_steps=10: 4 + 5 * 12 / 10 = 10 (rounded to 8); of 20: 4 + 5 * 12 / 20 = 7 (rounded to 4)
    with pytest.raises(ValueError, match=r"goes from 8 to 4\), or pass require_steps=10 to keep"):
        fit(tmp_path / "b", make, plain, {"max_steps": 20, "max_epochs": -1}, ckpt=str(tmp_path / "ckpt/step=5.ckpt"))


def test_a_curriculum_run_extended_with_a_larger_sample_budget_continues_its_stream(tmp_path, caplog):
    """A larger num_epochs (the sample budget) on resume was refused as another configuration; the stream's draws do
    not depend on it, so the extended run trains what a run with that budget from the start trains."""

    def make(num_epochs):
        return lambda: Curriculum(metrics=seqlen_truncate(4, 16, 6, 4), seed=3, num_epochs=num_epochs)

    def data():
        return CurriculumDataModule(plain(n=24))

    first, head = fit(tmp_path / "a", make(1), data, {"max_steps": 6, "max_epochs": -1})
    path = tmp_path / "end.ckpt"
    first.save_checkpoint(path)
    with caplog.at_level(logging.INFO):
        _, tail = fit(tmp_path / "b", make(2), data, {"max_steps": 12, "max_epochs": -1}, ckpt=str(path))
    assert "num_epochs 1 -> 2: the sample budget grows" in caplog.text
    _, whole = fit(tmp_path / "c", make(2), data, {"max_steps": 12, "max_epochs": -1})
    assert [r[4] for r in head + tail] == [r[4] for r in whole] and len(whole) == 12


def test_infobatch_within_the_curriculum_extended_trains_every_drawn_sample(tmp_path, caplog):
    """With the curriculum, InfoBatch thins steps up to floor(delta * T): T grows with the run, and the refusal (on
    thin_stop_step) had no remedy; a run that had thinned its last step goes on unthinned."""

    def make():
        return [
            Curriculum(metrics=seqlen_truncate(4, 16, 4, 4), seed=3, num_epochs=4),
            InfoBatchCallback(prune_ratio=0.5, delta=0.75, seed=7),
        ]

    def run(root, steps, ckpt=None):
        pl.seed_everything(0)
        trace = Trace()
        trainer = make_trainer(root, [*make(), trace], max_steps=steps, max_epochs=-1)
        trainer.fit(tiny_gpt2(n_layer=4), datamodule=CurriculumDataModule(plain(n=24)), ckpt_path=ckpt)
        return trainer, trace.rows

    first, rows = run(tmp_path / "a", 12)  # thins steps 7-9 (the second data epoch's, up to floor(0.75 * 12))
    path = tmp_path / "end.ckpt"
    first.save_checkpoint(path)
    with caplog.at_level(logging.INFO):
        _, more = run(tmp_path / "b", 16, str(path))
    assert "had thinned its last step (9)" in caplog.text
    assert any(size < 4 for _, size, *_ in rows[6:9]) and [size for _, size, *_ in more] == [4] * 4


def test_a_curriculum_budget_that_ended_on_a_partial_batch_is_extended(tmp_path, caplog):
    """26 samples in batches of 4 end the budget with a batch of 2: the end checkpoint's consumed_samples (26, bounded
    by the old budget) was checked against the new budget's position (28) and refused as corrupt (qa36-break 01)."""

    def make(num_epochs):
        return lambda: Curriculum(metrics=seqlen_truncate(4, 16, 6, 4), seed=3, num_epochs=num_epochs)

    def data():
        return CurriculumDataModule(plain(n=26))

    first, head = fit(tmp_path / "a", make(1), data, {"max_steps": -1, "max_epochs": -1})
    assert [r[1] for r in head] == [4] * 6 + [2]
    path = tmp_path / "end.ckpt"
    first.save_checkpoint(path)
    with caplog.at_level(logging.INFO):
        _, tail = fit(tmp_path / "b", make(2), data, {"max_steps": -1, "max_epochs": -1}, ckpt=str(path))
    assert "ended with a batch of 2 of 4 samples" in caplog.text
    # 50 samples in all: the new budget's 52, less the 2 the partial batch was counted as (the message says so)
    assert [r[1] for r in tail] == [4] * 6 and sum(r[1] for r in head + tail) == 50


@pytest.mark.parametrize("how", ["extended", "num_epochs"])
def test_infobatchs_saving_counts_the_full_epochs_after_its_schedule(tmp_path, how):
    """Epochs past InfoBatch's num_epochs train the full data: its saved_fraction left them out (0.0972 where the
    monitor's saved/infobatch/samples_frac read 0.0486 after an extension, qa36-break 02). The same with num_epochs
    below max_epochs from the start."""
    from lightning_effi.core.accounting import EfficiencyMonitor

    def run(root, epochs, num_epochs=None, ckpt=None):
        monitor = EfficiencyMonitor(print_summary=False)
        callback = InfoBatchCallback(prune_ratio=0.5, delta=0.67, seed=7, num_epochs=num_epochs)
        trainer = make_trainer(root, [monitor, callback], max_epochs=epochs, max_steps=-1)
        pl.seed_everything(0)
        trainer.fit(tiny_gpt2(n_layer=4), datamodule=InfoBatchDataModule(plain()), ckpt_path=ckpt)
        return trainer, monitor.summary

    if how == "extended":
        first, _ = run(tmp_path / "a", 3)
        first.save_checkpoint(tmp_path / "end.ckpt")
        _, summary = run(tmp_path / "b", 6, ckpt=str(tmp_path / "end.ckpt"))
    else:
        _, summary = run(tmp_path / "a", 6, num_epochs=3)
    saved = summary["infobatch/saved_samples"]
    assert saved > 0 and summary["infobatch/saved_fraction"] == pytest.approx(saved / (6 * 48))
    assert summary["infobatch/saved_fraction"] == pytest.approx(summary["saved/infobatch/samples_frac"])


def test_an_infobatch_run_still_pruning_resumed_longer_is_the_longer_run(tmp_path, caplog):
    """A checkpoint of an epoch that both lengths prune (epoch 0: 3 epochs anneal from floor(0.67 * 3) = 2, 6 from 4)
    was refused as another num_epochs, and strict=False was the only remedy; an epoch's pruning does not depend on the
    run's length, so the resumed run is the 6-epoch run from the start (qa36-break note). A shorter run that would
    anneal the checkpoint's pruned epoch (epoch 1 of a 2-epoch run, annealing from 1) is still refused."""
    make, data = CASES["infobatch"][0], CASES["infobatch"][1]
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    fit(tmp_path / "a", make, data, {"max_epochs": 3, "max_steps": -1}, extra=(every,))
    with caplog.at_level(logging.INFO):
        longer, tail = fit(tmp_path / "b", make, data, {"max_epochs": 6}, ckpt=str(tmp_path / "ckpt/epoch=0.ckpt"))
    assert "its epochs so far are those of a run of 6 epochs" in caplog.text
    whole, rows = fit(tmp_path / "c", make, data, {"max_epochs": 6})
    assert tail == [r for r in rows if r[0] > 0]  # epochs 1-5: the same samples in the same batches
    per_epoch = [sum(r[1] for r in rows if r[0] == e) for e in range(6)]
    # epoch 0 scores every sample; 1-3 pruned (the 3-epoch run annealed from epoch 2); 4-5 anneal
    assert per_epoch[0] == 48 and all(n < 48 for n in per_epoch[1:4]) and per_epoch[4:] == [48, 48]
    for a, b in zip(longer.lightning_module.parameters(), whole.lightning_module.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"other settings \(checkpoint, now\): \{'num_epochs': \(3, 2\)\}"):
        fit(tmp_path / "d", make, data, {"max_epochs": 2}, ckpt=str(tmp_path / "ckpt/epoch=1.ckpt"))
