"""Fit under DDP on CPU with 2 processes (gloo): disjoint shards, summed accounting."""

import pytest
import torch

from lightning_effi.core.accounting import EfficiencyMonitor
from tests.helpers.harness import fit_ddp, make_trainer
from tests.helpers.tiny import HandLM, TokenBlocks, tiny_gpt2, tiny_lm_data


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


@pytest.mark.slow
def test_ddp_counts_the_flops_of_a_module_without_a_flops_hook(tmp_path):
    """A user's module with no FLOPs hook, ``training_step`` calling ``self(ids)``: under DDP Lightning calls the module
    with ``(batch, batch_idx)`` and points its ``forward`` at ``training_step`` for that call (its forward
    redirection); the monitor recorded that call as the model's, could not replay it and read 0 FLOPs, so every FLOPs
    saving read 0. The same 40 samples in one process and on 2 ranks: the same FLOPs (summed over ranks)."""
    single = EfficiencyMonitor(print_summary=False)
    make_trainer(tmp_path / "one", [single], max_epochs=1).fit(HandLM(), datamodule=tiny_lm_data(batch_size=5))
    expected = 3 * 40 * 16 * 2 * (16 * 64)  # the head's matmul, forward and backward (x2 for the input gradient)
    assert single.summary["flops"] == expected
    _, per_rank = fit_ddp(
        HandLM(), tiny_lm_data(batch_size=5), tmp_path / "ddp", [EfficiencyMonitor(print_summary=False)], max_epochs=1
    )
    assert [r["summary"]["flops"] for r in per_rank] == [expected, expected]
    assert per_rank[0]["summary"]["baseline_flops"] == expected
