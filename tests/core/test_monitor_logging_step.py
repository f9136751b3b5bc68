"""The EfficiencyMonitor's ``effi/*`` metrics land in the loggers' rows of the module's own metrics of the same batch
and validation: a user plots ``val/loss`` against ``effi/flops`` from TensorBoard, W&B, MLflow or a CSV."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_effi import EfficiencyMonitor, InfoBatchCallback, RandomLTDCallback
from lightning_effi.core.nonfinite import NonFiniteLossGuard
from tests.helpers.harness import MetricsCapture, make_trainer
from tests.helpers.tiny import tiny_gpt2, tiny_lm_data


def test_effi_metrics_share_the_rows_of_the_modules_metrics_of_the_same_batch_and_validation(tmp_path):
    """Lightning writes ``self.log`` values at its fit loop's batches that stepped before the batch (``global_step -
    1`` within the batch and the validation after it); the monitor wrote at ``global_step``, one row later, so
    ``val/loss`` (after 5 steps, row 4) never met its ``effi/flops`` (row 5), and with ``log_every_n_steps=2`` row 4
    held the validation after 5 steps beside the samples of 4 (64 for 80) (qa88-sweeps 02)."""
    pl.seed_everything(0)
    capture = MetricsCapture()
    monitor = EfficiencyMonitor(log_every_n_steps=1, print_summary=False)
    trainer = make_trainer(
        tmp_path,
        [monitor, RandomLTDCallback(min_value=4, seq_per_step=4)],
        logger=capture,
        max_steps=10,
        log_every_n_steps=1,
        val_check_interval=5,
        limit_val_batches=1,
    )
    trainer.fit(tiny_gpt2(n_layer=4), datamodule=tiny_lm_data(batch_size=4))
    val = dict(capture.series("val/loss"))
    train = dict(capture.series("train/loss"))
    samples = dict(capture.series("effi/samples"))
    assert sorted(val) == [4, 9] and sorted(train) == list(range(10))
    assert set(train) <= set(samples)  # every batch's row holds its compute
    assert [samples[step] for step in sorted(val)] == [20.0, 40.0]  # 4 samples a step: after 5 and 10 steps
    curve = [(point["samples"], point["metrics"]["val/loss"]) for point in monitor.curve]
    assert curve == [(samples[step], val[step]) for step in sorted(val)]  # the rows pair as the record does


def test_the_nonfinite_count_is_written_at_the_modules_logging_step():
    class Loop:
        _batches_that_stepped = 6

    class FitLoop:
        epoch_loop = Loop()

    class Trainer:
        global_step, global_rank, fit_loop = 7, 0, FitLoop()

        def __init__(self, callbacks, loggers):
            self.callbacks, self.loggers = callbacks, loggers

    class Technique:
        def __init__(self):
            self.nonfinite_guard = NonFiniteLossGuard("Curriculum", "warn")

    capture, technique = MetricsCapture(), Technique()
    technique.nonfinite_guard.count = 1
    technique.nonfinite_guard.log_count(Trainer([technique], [capture]))
    assert capture.logged == [(6, {"effi/nonfinite_losses": 1.0})]


def _val_rows_hold_the_curve(capture: MetricsCapture, monitor: EfficiencyMonitor) -> list[int]:
    """Each validation's row holds the compute trained before it, as the monitor's curve records it."""
    val = capture.series("val/loss")
    samples = {}
    for step, value in capture.series("effi/samples"):
        samples.setdefault(step, value)  # the row's first writer
    assert [samples.get(step) for step, _ in val] == [point["samples"] for point in monitor.curve]
    return [step for step, _ in val]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_epochs=2, log_every_n_steps=3),  # epoch-end validation, a logging interval that skips its row
        dict(max_epochs=1, accumulate_grad_batches=2, val_check_interval=3, log_every_n_steps=1),  # mid-window
    ],
    ids=["epoch_end", "inside_an_accumulation_window"],
)
def test_a_validations_row_holds_the_compute_trained_before_it(tmp_path, kwargs):
    """An epoch-end validation's row had no effi/* figures (the monitor wrote them one row later, at the epoch's
    end), and a validation inside an accumulation window shared its row with the figures of the step ending after it
    (16 samples for 12) (qa89-break 03, 08; qa89-regress 02)."""
    pl.seed_everything(0)
    capture = MetricsCapture()
    monitor = EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path, [monitor], logger=capture, limit_val_batches=1, **kwargs)
    trainer.fit(tiny_gpt2(n_layer=2), datamodule=tiny_lm_data(batch_size=4))
    assert len(_val_rows_hold_the_curve(capture, monitor)) >= 2


def test_infobatch_writes_an_epochs_figures_in_the_row_of_its_epoch_end_validation(tmp_path):
    """InfoBatch's per-epoch metrics land in the row of the epoch's last batch, where Lightning writes the epoch's
    metrics and its epoch-end validation (they were one row later)."""
    pl.seed_everything(0)
    capture = MetricsCapture()
    monitor, ib = EfficiencyMonitor(print_summary=False), InfoBatchCallback(prune_ratio=0.5, delta=0.75)
    trainer = make_trainer(tmp_path, [monitor, ib], logger=capture, max_epochs=3, limit_val_batches=1)
    trainer.fit(tiny_gpt2(n_layer=2), datamodule=ib.wrap_datamodule(tiny_lm_data(batch_size=4)))
    val_steps = _val_rows_hold_the_curve(capture, monitor)
    epoch_rows = [step for step, _ in capture.series("effi/infobatch/saved_samples_epoch")]
    assert epoch_rows[: len(val_steps)] == val_steps
