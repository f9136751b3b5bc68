"""The harness on real data: mid-epoch resume equals the uninterrupted run, and DDP shards a real DataModule."""

import pytest
import torch

from lightning_effi.core.accounting import EfficiencyMonitor
from lightning_effi.data import CausalLMDataModule, SST2DataModule
from tests.harness.settings import MONITOR_TIMES
from tests.helpers.harness import assert_resume_equals_uninterrupted, fit_ddp
from tests.helpers.tiny import tiny_bert_cls, tiny_gpt2


def shakespeare_chars(data_root, **kw):
    kw = {"train_subset": 48, "val_subset": 8, "block_size": 32, "batch_size": 8, **kw}
    return CausalLMDataModule(text_path=data_root / "tinyshakespeare" / "input.txt", tokenizer="char", **kw)


def test_mid_epoch_resume_on_shakespeare_equals_uninterrupted(tmp_path, data_root):
    vocab = shakespeare_chars(data_root).model_hints()["vocab_size"]
    assert vocab == 65
    # 48 blocks / bs 8 = 6 batches per epoch: resume after step 4 (mid-epoch 0), train to step 9 (mid-epoch 1)
    assert_resume_equals_uninterrupted(
        lambda: tiny_gpt2(vocab_size=vocab, n_positions=32),
        lambda: shakespeare_chars(data_root),
        tmp_path,
        total_steps=9,
        resume_step=4,
        callbacks_fn=lambda: [EfficiencyMonitor(print_summary=False)],
        ignore_state=MONITOR_TIMES,
    )


def test_mid_epoch_resume_on_sst2_with_padding_equals_uninterrupted(tmp_path, data_root):
    dm_fn = lambda: SST2DataModule(
        data_root / "sst2",
        train_subset=40,
        val_subset=8,
        batch_size=8,  # noqa: E731
        vocab_size=1000,
    )
    hints = dm_fn().model_hints() if hasattr(dm_fn(), "model_hints") else {}
    assert hints["num_classes"] == 2
    assert_resume_equals_uninterrupted(
        lambda: tiny_bert_cls(vocab_size=hints["vocab_size"], pad_token_id=hints["pad_token_id"], max_length=80),
        dm_fn,
        tmp_path,
        total_steps=7,
        resume_step=3,
    )


@pytest.mark.slow
def test_ddp_on_a_real_datamodule(tmp_path, data_root):
    dm = shakespeare_chars(data_root, batch_size=6)
    dm.setup("fit")
    blocks = torch.stack([dm.train_dataset[i]["input_ids"] for i in range(len(dm.train_dataset))]).double()
    trainer, per_rank = fit_ddp(
        tiny_gpt2(vocab_size=65, n_positions=32), dm, tmp_path, [EfficiencyMonitor(print_summary=False)], max_epochs=1
    )
    weights = torch.linspace(1.0, 2.0, blocks.shape[1], dtype=torch.float64) ** 7
    expected = sorted((blocks * weights).sum(1).tolist())
    seen = [sorted(x for b in r["batches"] for x in b["fingerprint"]) for r in per_rank]
    assert len(seen[0]) == len(seen[1]) == 24 and sorted(seen[0] + seen[1]) == expected
    assert per_rank[0]["summary"]["samples"] == 48 and per_rank[0]["summary"]["tokens"] == 48 * 32
