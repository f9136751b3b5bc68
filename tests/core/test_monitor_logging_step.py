"""The EfficiencyMonitor's ``effi/*`` metrics land in the loggers' rows of the module's own metrics of the same batch
and validation: a user plots ``val/loss`` against ``effi/flops`` from TensorBoard, W&B, MLflow or a CSV."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_effi import EfficiencyMonitor, RandomLTDCallback
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
