"""The V-cycle's baseline for the EfficiencyMonitor (``VCycleCallback.effi_baseline``): the full model in place of a
coarse level while the batch is counted, so the monitor's baseline is the full model on the same batches."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_effi.callbacks import VCycleCallback
from lightning_effi.core.accounting import Baseline, EfficiencyMonitor, baseline_hook
from lightning_effi.core.flops import transformer_training_flops
from lightning_effi.core.protocols import ProvidesBaseline
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import tiny_gpt2, tiny_lm_data

C1 = transformer_training_flops(8, 16, 2, 32, None, 64)  # the full tiny GPT-2 on a (8, 16) batch
C2 = transformer_training_flops(8, 16, 1, 16, None, 64)  # level 2: 1 layer, 16 wide


class Probe(Callback):
    """Before the V-cycle (which may switch levels in its ``on_train_batch_end``): per training batch the level,
    the V-cycle's baseline, and the module's counts without and with it."""

    def __init__(self, vcycle: VCycleCallback) -> None:
        self.vcycle, self.rows = vcycle, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        baseline = self.vcycle.effi_baseline(batch, pl_module)
        row = {
            "level": self.vcycle.level,
            "baseline": baseline,
            "flops": pl_module.effi_training_flops(batch),
            "layers": pl_module.effi_num_layers,
        }
        if baseline is not None:
            model = pl_module.model
            with baseline.model():
                row["full_flops"] = pl_module.effi_training_flops(batch)
                row["full_layers"] = pl_module.effi_num_layers
                row["full_model"] = pl_module.model
            assert pl_module.model is model and pl_module.effi_num_layers == row["layers"]  # back after
        self.rows.append(row)


def test_the_callback_provides_the_hook():
    cb = VCycleCallback(e_a=2, e_small=3)
    assert isinstance(cb, ProvidesBaseline) and baseline_hook(cb) == cb.effi_baseline  # the hook, not a stopgap
    assert cb.effi_baseline({"input_ids": torch.zeros(1, 2)}, None) is None  # level 1 (and before setup)


def test_the_baseline_at_level_2_is_the_full_model_on_the_batch(tmp_path: Path):
    """Levels 1, 1, 2, 2, 2, 1, 1: no baseline at level 1; at level 2 the full model's ``effi_training_flops`` on the
    batch (what level 1 counts on it) and its depth; the monitor's baseline and the V-cycle's saving follow."""
    cb = VCycleCallback(e_a=2, e_small=3)
    probe, monitor = Probe(cb), EfficiencyMonitor(print_summary=False)
    pl.seed_everything(0)
    model = tiny_gpt2()
    full = model.model
    make_trainer(tmp_path, [monitor, probe, cb], max_steps=7, max_epochs=-1).fit(model, datamodule=tiny_lm_data())
    assert [r["level"] for r in probe.rows] == [1, 1, 2, 2, 2, 1, 1]
    for row in probe.rows:
        if row["level"] == 1:
            assert row["baseline"] is None and row["flops"] == C1 and row["layers"] == 2
            continue
        assert isinstance(row["baseline"], Baseline) and row["baseline"].batch is None
        assert row["baseline"].samples == 1.0
        assert row["flops"] == C2 and row["layers"] == 1
        assert row["full_flops"] == C1 and row["full_layers"] == 2 and row["full_model"] is full
    s = monitor.summary
    assert s["baseline_flops"] == 7 * C1 and s["flops"] == 4 * C1 + 3 * C2
    assert s["baseline_layer_tokens"] == 7 * 8 * 16 * 2 and s["layer_tokens"] == (4 * 2 + 3 * 1) * 8 * 16
    assert s["saved/vcycle/flops_frac"] == pytest.approx(1 - (4 * C1 + 3 * C2) / (7 * C1))
    assert s["saved/vcycle/flops_frac"] == pytest.approx(s["vcycle/flops_saved_frac"])  # the V-cycle's own figure


class _SparseHeadNet(nn.Module):
    """A masked LM of one's own: 4 blocks in a loop of its forward, the head on the masked positions only
    (``hidden[labels != -100]``, a shape that depends on the data: the replay goes through the recorded parts)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 2, 64, batch_first=True, dropout=0.0) for _ in range(4)
        )

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        picked = labels != -100
        return F.cross_entropy(self.head(h[picked]), labels[picked])


class _SparseHeadMLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _SparseHeadNet()

    def training_step(self, batch, batch_idx):
        return self.net(*batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_the_baseline_of_a_forward_replayed_through_its_parts_runs_every_block(tmp_path: Path):
    """A forward with a data-dependent shape is replayed through its recorded parts; the baseline's full model was
    replayed with the coarse network's 2 blocks, so the V-cycle's FLOPs saving read 0 (qa54-domains 03). The
    baseline equals the FLOPs of a plain fit on the same batches."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (48, 16), generator=g)
    labels = torch.where(torch.rand(48, 16, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    loader = DataLoader(TensorDataset(ids, labels), batch_size=8)

    def fit(callbacks: list[Callback]) -> dict:
        pl.seed_everything(0)
        monitor = EfficiencyMonitor(print_summary=False)
        make_trainer(tmp_path, [monitor, *callbacks], max_steps=6, max_epochs=-1).fit(_SparseHeadMLM(), loader)
        return monitor.summary

    plain = fit([])
    vcycle = VCycleCallback(e_a=2, e_small=2, width_scheme=None)
    cycled = fit([vcycle])
    assert vcycle.switches == 2
    assert cycled["baseline_flops"] == plain["flops"] and cycled["flops"] < plain["flops"]
    assert cycled["vcycle/flops_saved_frac"] == pytest.approx(1 - cycled["flops"] / plain["flops"])
