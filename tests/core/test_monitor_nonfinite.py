"""The EfficiencyMonitor and the non-finite loss policy (``lightning_effi.core.nonfinite``). The monitor is in every
run, baselines without any technique included, so it carries the policy too: ``nonfinite_loss="raise"`` (default) stops
the fit at the first NaN training loss, before its backward pass; ``"warn"`` warns once, counts each NaN step once
(checkpointed and restored exactly, logged as ``effi/nonfinite_losses``, reported at the end of fit)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_effi.callbacks import InfoBatchCallback
from lightning_effi.core.accounting import EfficiencyMonitor, nonfinite_count
from lightning_effi.core.nonfinite import NonFiniteLossError
from lightning_effi.infobatch.data import InfoBatchDataModule
from tests.helpers.harness import MetricsCapture, make_trainer
from tests.helpers.nonfinite import PoisonedGPT2, WeightsAtBatchStart, assert_weights_unchanged
from tests.helpers.tiny import TinyDataModule, TokenBlocks

STEPS = 6


def data() -> TinyDataModule:
    return TinyDataModule(TokenBlocks(n=16), batch_size=4)  # 4 batches per epoch


def test_a_baseline_run_stops_at_the_nan_step_before_its_backward(tmp_path: Path) -> None:
    monitor, snap, model = EfficiencyMonitor(print_summary=False), WeightsAtBatchStart(), PoisonedGPT2(nan_steps=(2,))
    assert monitor.nonfinite_guard.policy == "raise"
    trainer = make_trainer(tmp_path, [monitor, snap], max_steps=STEPS, max_epochs=-1)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit(model, datamodule=data())
    assert str(err.value).startswith("EfficiencyMonitor: the training loss is nan at step 2;"), str(err.value)
    assert trainer.global_step == 2
    assert_weights_unchanged(model, snap.before[2])  # the weights the NaN step started from: no backward ran


def test_warn_goes_on_counts_logs_and_reports(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    monitor, logger = (
        EfficiencyMonitor(log_every_n_steps=1, print_summary=False, nonfinite_loss="warn"),
        MetricsCapture(),
    )
    trainer = make_trainer(tmp_path, [monitor], max_steps=STEPS, max_epochs=-1, logger=logger)
    with (
        pytest.warns(
            UserWarning, match=r"EfficiencyMonitor: the training loss is nan at step 2 \(nonfinite_loss='warn'"
        ),
        caplog.at_level(logging.INFO),
    ):
        trainer.fit(PoisonedGPT2(nan_steps=(2, 4), clean_grads=True), datamodule=data())
    assert trainer.global_step == STEPS
    assert (monitor.nonfinite_guard.count, monitor.nonfinite_guard.first_step) == (2, 2)
    # logged with the monitor's figures (after every batch, and at the epoch's end): 0 before step 2, 1 from it,
    # 2 from step 4
    counts = [m["effi/nonfinite_losses"] for m in logger.metrics if "effi/samples" in m]
    assert counts[:3] == [0.0, 0.0, 1.0] and counts[-1] == 2.0 and counts == sorted(counts)
    assert sorted(set(counts)) == [0.0, 1.0, 2.0]
    assert "EfficiencyMonitor: 2 non-finite training losses (the first at step 2)" in caplog.text


def test_raise_logs_no_count(tmp_path: Path) -> None:
    logger = MetricsCapture()
    monitor = EfficiencyMonitor(log_every_n_steps=1, print_summary=False)
    make_trainer(tmp_path, [monitor], max_steps=2, max_epochs=-1, logger=logger).fit(PoisonedGPT2(), datamodule=data())
    assert logger.metrics and not any("effi/nonfinite_losses" in m for m in logger.metrics)


@pytest.mark.slow  # two fits with checkpoints
def test_warn_count_is_restored_exactly_on_resume(tmp_path: Path) -> None:
    """NaN at steps 1 and 4: the uninterrupted run counts (2, first at step 1); resumed from step 3 it restores
    (1, step 1) from the checkpoint and counts step 4: the same (2, 1)."""

    def run(root: Path, ckpt_path: Any = None, extra: tuple[pl.Callback, ...] = ()) -> EfficiencyMonitor:
        monitor = EfficiencyMonitor(print_summary=False, nonfinite_loss="warn")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            trainer = make_trainer(root, [monitor, *extra], max_steps=STEPS, max_epochs=-1)
            trainer.fit(PoisonedGPT2(nan_steps=(1, 4), clean_grads=True), datamodule=data(), ckpt_path=ckpt_path)
        return monitor

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    whole = run(tmp_path / "whole", extra=(saver,))
    assert (whole.nonfinite_guard.count, whole.nonfinite_guard.first_step) == (2, 1)
    path = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    state = torch.load(path, weights_only=True)["callbacks"]["EfficiencyMonitor"]
    assert state["nonfinite_loss"] == {"count": 1, "first_step": 1}
    resumed = run(tmp_path / "resumed", ckpt_path=path)
    assert (resumed.nonfinite_guard.count, resumed.nonfinite_guard.first_step) == (2, 1)
    assert resumed.totals["batches"] == whole.totals["batches"] == STEPS


def test_the_strictest_policy_of_monitor_and_technique_wins(tmp_path: Path) -> None:
    """The monitor listed first runs the one check of the backward pass, with the strictest policy: InfoBatch's
    "warn" does not let the run go on while the monitor says "raise"; the message names both."""
    cb = InfoBatchCallback(nonfinite_loss="warn")
    trainer = make_trainer(tmp_path, [EfficiencyMonitor(print_summary=False), cb], max_epochs=1)
    with pytest.raises(NonFiniteLossError, match=r"^EfficiencyMonitor, InfoBatchCallback: the training loss is nan"):
        trainer.fit(PoisonedGPT2(nan_steps=(1,)), datamodule=InfoBatchDataModule(data()))
    assert trainer.global_step == 1 and cb.nonfinite_guard.count == 0


def test_with_warn_everywhere_every_figure_is_the_runs_count(tmp_path: Path) -> None:
    """The monitor (first) counts the NaN step; InfoBatch, which never saw it, reports and logs the run's count all
    the same (``nonfinite_count``): one value under one key."""
    monitor, logger = EfficiencyMonitor(print_summary=False, nonfinite_loss="warn"), MetricsCapture()
    cb = InfoBatchCallback(nonfinite_loss="warn")
    trainer = make_trainer(tmp_path, [monitor, cb], max_epochs=1, logger=logger)
    with pytest.warns(UserWarning, match=r"^EfficiencyMonitor, InfoBatchCallback: the training loss is nan at step 1"):
        trainer.fit(PoisonedGPT2(nan_steps=(1,), clean_grads=True), datamodule=InfoBatchDataModule(data()))
    assert (monitor.nonfinite_guard.count, cb.nonfinite_guard.count) == (1, 0)
    assert monitor.summary["infobatch/nonfinite_losses"] == 1
    assert nonfinite_count(trainer.callbacks) == 1
    by_infobatch = [m["effi/nonfinite_losses"] for m in logger.metrics if "effi/infobatch/saved_fraction" in m]
    by_monitor = [m["effi/nonfinite_losses"] for m in logger.metrics if "effi/samples" in m]
    assert by_infobatch == [1.0] and by_monitor[-1] == 1.0


@pytest.mark.parametrize("policy", ["RAISE", "off", None, 1])
def test_a_bad_policy_is_refused_at_construction(policy: Any) -> None:
    with pytest.raises(ValueError, match=r"EfficiencyMonitor\.nonfinite_loss must be one of \('raise', 'warn'\)"):
        EfficiencyMonitor(nonfinite_loss=policy)


def test_repr_names_the_policy() -> None:
    monitor = EfficiencyMonitor(
        log_every_n_steps=3, print_summary=False, nonfinite_loss="warn", interpolate_flops=False
    )
    assert repr(monitor) == (
        "EfficiencyMonitor(log_every_n_steps=3, print_summary=False, nonfinite_loss='warn', interpolate_flops=False)"
    )
    again = eval(repr(monitor), {"EfficiencyMonitor": EfficiencyMonitor})
    assert again.nonfinite_guard.policy == "warn" and repr(again) == repr(monitor) and not again.interpolate_flops


def _state(**extra: Any) -> dict[str, Any]:
    counts = ("samples", "tokens", "layer_tokens", "flops", "batches")
    base = {k: 10.0 for k in (*counts, "time_train", "time_data", "time_eval", "time_total")}
    return {"totals": base, "curve": [], "schedule": [], **extra}


@pytest.mark.parametrize(
    "value, match",
    [
        ({"count": -4, "first_step": None}, r"EfficiencyMonitor: checkpoint nonfinite count must be an int >= 0"),
        ({"count": 1, "first_step": 2.5}, r"EfficiencyMonitor: checkpoint nonfinite first_step must be an int >= 0"),
        (3, r"EfficiencyMonitor\.load_state_dict: the checkpoint's nonfinite_loss must be a dict"),
    ],
)
def test_a_damaged_count_is_refused_and_nothing_is_loaded(value: Any, match: str) -> None:
    monitor = EfficiencyMonitor()
    before = dict(monitor.totals)
    with pytest.raises(ValueError, match=match):
        monitor.load_state_dict(_state(nonfinite_loss=value))
    assert monitor.totals == before and monitor.nonfinite_guard.count == 0


def test_a_checkpoint_written_before_the_policy_loads_with_no_count() -> None:
    monitor = EfficiencyMonitor(nonfinite_loss="warn")
    monitor.nonfinite_guard.count = 5  # what an earlier fit left: replaced by the checkpoint's (none)
    monitor.load_state_dict(_state())
    assert monitor.nonfinite_guard.state_dict() == {"count": 0, "first_step": None}
    assert monitor.totals["samples"] == 10.0
    monitor.load_state_dict(_state(nonfinite_loss={"count": 3, "first_step": 7}))
    assert (monitor.nonfinite_guard.count, monitor.nonfinite_guard.first_step) == (3, 7)
