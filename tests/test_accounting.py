"""EfficiencyMonitor: exact counts, the extension protocol, logging, and exact resume of its totals."""

import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_effi.core.accounting import BatchStats, EfficiencyMonitor, batch_size_of, format_summary, tokens_of
from lightning_effi.core.flops import transformer_training_flops
from tests.helpers.harness import assert_resume_equals_uninterrupted, fit_steps
from tests.helpers.tiny import TINY_GPT2, tiny_bert_cls, tiny_gpt2, tiny_lm_data, tiny_sentence_data


class HalveLayerTokens(pl.Callback):
    def effi_adjust(self, stats, batch, pl_module):
        return BatchStats(stats.samples, stats.tokens, stats.layer_tokens // 2, stats.flops / 2)

    def effi_summary(self):
        return {"halver/active": 1}


def test_counts_are_exact_for_a_fixed_length_lm(tmp_path):
    # 40 blocks of 16 tokens, bs 8 -> 5 batches per epoch; 7 steps = 1 epoch + 2 batches
    trainer, _ = fit_steps(tiny_gpt2, tiny_lm_data, 7, tmp_path, callbacks_fn=lambda: [EfficiencyMonitor()])
    s = trainer.callbacks[0].summary
    assert s["samples"] == 7 * 8 and s["tokens"] == 7 * 8 * 16 and s["batches"] == 7
    assert s["layer_tokens"] == s["tokens"] * TINY_GPT2["n_layer"]
    per_batch = transformer_training_flops(8, 16, 2, 32, None, 64, head="lm")
    assert s["flops"] == 7 * per_batch
    assert s["optimizer_steps"] == 7
    assert s["time_train_s"] > 0 and s["time_data_s"] > 0
    assert s["time_train_s"] + s["time_data_s"] + s["time_eval_s"] <= s["time_total_s"]
    assert s["samples_per_s"] == pytest.approx(56 / (s["time_train_s"] + s["time_data_s"]))


def test_tokens_count_real_tokens_only_with_padding(tmp_path):
    dm = tiny_sentence_data()
    expected = int(dm.train_dataset.sequence_lengths().sum())
    trainer, _ = fit_steps(tiny_bert_cls, lambda: dm, 5, tmp_path, callbacks_fn=lambda: [EfficiencyMonitor()])
    assert trainer.callbacks[0].summary["tokens"] == expected  # one epoch of 40 sentences


def test_extension_protocol_adjusts_counts_and_adds_summary(tmp_path):
    trainer, _ = fit_steps(
        tiny_gpt2, tiny_lm_data, 3, tmp_path, callbacks_fn=lambda: [EfficiencyMonitor(), HalveLayerTokens()]
    )
    s = trainer.callbacks[0].summary
    assert s["layer_tokens"] == 3 * 8 * 16 * 2 // 2 and s["halver/active"] == 1


def test_metrics_are_logged(tmp_path):
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=CSVLogger(tmp_path, name="csv", version=""),
        callbacks=[EfficiencyMonitor(log_every_n_steps=2)],
        enable_progress_bar=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("effi/samples")]
    assert [float(r["effi/samples"]) for r in rows][:2] == [16.0, 32.0]
    assert {
        "effi/tokens",
        "effi/layer_tokens",
        "effi/flops",
        "effi/time/train",
        "effi/time/data",
        "effi/time/eval",
    } <= set(rows[0])


def test_resume_mid_epoch_keeps_exact_counts(tmp_path):
    assert_resume_equals_uninterrupted(
        tiny_gpt2,
        tiny_lm_data,
        tmp_path,
        total_steps=8,
        resume_step=3,
        callbacks_fn=lambda: [EfficiencyMonitor(print_summary=False)],
        ignore_state=["totals.time_train", "totals.time_data", "totals.time_eval", "totals.time_total"],
    )


def test_resume_from_the_last_batch_of_an_epoch(tmp_path):
    """A checkpoint taken after an epoch's last batch (before its epoch end) resumes into the next epoch with that
    epoch's data (regression: the loader skipped the whole next epoch)."""
    assert_resume_equals_uninterrupted(
        tiny_gpt2,
        tiny_lm_data,
        tmp_path,
        total_steps=8,
        resume_step=5,  # 5 batches per epoch
        callbacks_fn=lambda: [EfficiencyMonitor(print_summary=False)],
        ignore_state=["totals.time_train", "totals.time_data", "totals.time_eval", "totals.time_total"],
    )


def test_helpers_and_validation():
    assert batch_size_of({"input_ids": torch.zeros(3, 5)}) == 3
    assert batch_size_of((torch.zeros(4, 2), torch.zeros(4))) == 4
    assert tokens_of({"input_ids": torch.zeros(2, 5), "attention_mask": torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])}) == 7
    assert tokens_of({"pixel_values": torch.zeros(2, 3)}) == 0
    assert "samples" in format_summary({"samples": 3, "flops": 1.5e12})
    with pytest.raises(ValueError, match="log_every_n_steps"):
        EfficiencyMonitor(log_every_n_steps=0)


def test_resume_check_detects_a_non_resumable_loader(tmp_path):
    """Negative control: a plain shuffled DataLoader replays the epoch head on a mid-epoch resume, and the harness
    must notice."""
    from tests.helpers.tiny import TinyDataModule, TokenBlocks

    class PlainLoaderData(TinyDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.train_dataset, batch_size=8, shuffle=True)

    with pytest.raises(AssertionError):
        assert_resume_equals_uninterrupted(
            tiny_gpt2, lambda: PlainLoaderData(TokenBlocks()), tmp_path, total_steps=4, resume_step=2
        )
