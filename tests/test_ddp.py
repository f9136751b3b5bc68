"""Fit under DDP on CPU with 2 processes (gloo): disjoint shards, summed accounting."""

import pytest
import torch

from lightning_effi.core.accounting import EfficiencyMonitor
from tests.helpers.harness import fit_ddp
from tests.helpers.tiny import TokenBlocks, tiny_gpt2, tiny_lm_data


@pytest.mark.slow
def test_ddp_shards_are_disjoint_and_accounting_sums_ranks(tmp_path):
    monitor = EfficiencyMonitor(print_summary=False)
    trainer, per_rank = fit_ddp(tiny_gpt2(), tiny_lm_data(batch_size=5), tmp_path, [monitor], max_epochs=1)
    # 40 samples, 2 ranks, bs 5 -> 4 batches per rank
    assert [len(r["batches"]) for r in per_rank] == [4, 4]
    seen = [sorted(x for b in r["batches"] for x in b["fingerprint"]) for r in per_rank]
    data = TokenBlocks().data.double()
    expected = sorted((data * torch.linspace(1.0, 2.0, data.shape[1], dtype=torch.float64) ** 7).sum(1).tolist())
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == expected
    assert [r["global_step"] for r in per_rank] == [4, 4]
    summaries = [r["summary"] for r in per_rank]
    assert summaries[0] == summaries[1]  # counts summed, times maxed: identical on every rank
    assert summaries[0]["samples"] == 40 and summaries[0]["tokens"] == 40 * 16 and summaries[0]["batches"] == 8
