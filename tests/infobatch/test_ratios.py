"""InfoBatch in a real fit at prune ratios other than 0.5 (where the keep weight ``1/(1-r)`` and the reference
research tree's ``1/r`` would coincide). Every expectation is computed here, from the per-sample losses the module
produced, with the rules of Qin et al., ICLR 2024, Sec. 3 (reference ``infobatch/infobatch.py``):

- score of a sample = its latest raw (unweighted) loss; a pruned sample keeps its older score;
- prune epoch ``1 <= e < floor(delta * E)``: ``tau = mean(score)``, ``D1 = {score < tau}`` (strict),
  ``k = floor((1 - r) |D1|)`` kept from D1, every other sample visited;
- the loss of a batch = ``mean_i(w_i * l_i)`` with ``w = 1/(1-r)`` for the kept D1 samples, 1 otherwise (full
  epochs: all 1), not normalised by ``sum(w)``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn

from lightning_effi.callbacks import InfoBatchCallback
from lightning_effi.infobatch.data import InfoBatchDataModule
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TinyDataModule

N, BATCH, EPOCHS, DELTA = 40, 8, 5, 0.8  # floor(0.8 * 5) = 4: epochs 1, 2, 3 prune, epochs 0 and 4 full


class Points(torch.utils.data.Dataset):
    """``n`` regression samples ``{"x": float[4], "y": float, "sid": int64}`` with spread-out (heavy-tailed) noise,
    so that per-sample losses differ widely; ``sid`` is the sample's own id, carried in the user's batch."""

    def __init__(self, n: int = N, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        noise = torch.randn(n, generator=g) ** 3
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 0.0]) + noise

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "sid": torch.tensor(i)}


class Regression(pl.LightningModule):
    """Linear regression; ``training_step`` records what it saw (sample ids) and computed (raw per-sample losses)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.records: list[dict] = []

    def training_step(self, batch, batch_idx):
        per_sample = (self.lin(batch["x"]).squeeze(-1) - batch["y"]) ** 2
        self.records.append(
            {"epoch": self.current_epoch, "sid": batch["sid"].tolist(), "loss": per_sample.detach().clone()}
        )
        return {"loss": per_sample.mean(), "per_sample_loss": per_sample}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


class TrainedLoss(pl.Callback):
    """The loss Lightning trained on, per batch (the output of the wrapped ``training_step``)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def expected_epochs(records: list[dict], r: float) -> list[dict]:
    """Per epoch, from the recorded losses alone: its kind, tau, D1 and the kept count ``k``."""
    stop = math.floor(Fraction(str(DELTA)) * EPOCHS)
    score: dict[int, float] = {}
    out = []
    for e in range(EPOCHS):
        if e == 0 or e >= stop:
            out.append({"kind": "full", "d1": set(), "k": 0})
        else:
            values = np.array([score[i] for i in range(N)], dtype=np.float32)
            tau = float(values.astype(np.float64).sum() / N)
            d1 = {i for i in range(N) if float(values[i]) < tau}
            out.append({"kind": "prune", "tau": tau, "d1": d1, "k": math.floor((1 - Fraction(str(r))) * len(d1))})
        for rec in records:  # this epoch's losses become the scores of the samples it visited
            if rec["epoch"] == e:
                for sid, loss in zip(rec["sid"], rec["loss"].tolist()):
                    score[sid] = loss
    return out


@pytest.mark.parametrize("r", [0.3, 0.7])
def test_losses_are_the_weighted_means_and_the_kept_counts_follow_the_ratio(tmp_path, r):
    cb, trained, module = InfoBatchCallback(prune_ratio=r, delta=DELTA, seed=5), TrainedLoss(), Regression()
    pl.seed_everything(0)
    trainer = make_trainer(tmp_path, [cb, trained], max_epochs=EPOCHS)
    trainer.fit(module, datamodule=InfoBatchDataModule(TinyDataModule(Points(), batch_size=BATCH)))
    records = module.records
    assert len(records) == len(trained.losses)
    plans = expected_epochs(records, r)
    assert [p["kind"] for p in plans] == ["full", "prune", "prune", "prune", "full"]
    keep_weight, other_weight = 1 / (1 - r), 1 / r  # the package's keep weight, and the research tree's
    discriminating = 0
    kept_counts = []
    for e, plan in enumerate(plans):
        visited = [sid for rec in records if rec["epoch"] == e for sid in rec["sid"]]
        assert len(visited) == len(set(visited))  # each sample at most once per epoch
        d1, k = plan["d1"], plan["k"]
        kept = set(visited) & d1
        assert set(range(N)) - d1 <= set(visited)  # every sample not well learned is visited (unseen ones too)
        assert len(kept) == k and len(visited) == N - len(d1) + k
        kept_counts.append(len(kept))
        if plan["kind"] == "prune":
            assert 0 < k < len(d1) < N
        for rec, loss in ((rec, trained.losses[j]) for j, rec in enumerate(records) if rec["epoch"] == e):
            raw = rec["loss"].double()
            w = torch.tensor([keep_weight if sid in d1 else 1.0 for sid in rec["sid"]], dtype=torch.float64)
            assert loss == pytest.approx(float((w * raw).mean()), rel=2e-6, abs=1e-7), (e, rec["sid"])
            w_alt = torch.tensor([other_weight if sid in d1 else 1.0 for sid in rec["sid"]], dtype=torch.float64)
            if abs(float((w_alt * raw).mean()) - loss) > 1e-3 * max(1.0, abs(loss)):
                discriminating += 1
    assert discriminating > 0  # the batches tell 1/(1-r) from 1/r apart
    # the kept counts, as computed here, are also what the callback reports
    assert kept_counts == [plan["k"] for plan in plans]
    assert [h["kept_well_learned"] for h in cb.history] == [p["k"] for p in plans]
    assert [h["well_learned"] for h in cb.history] == [len(p["d1"]) for p in plans]
    assert [h["saved"] for h in cb.history] == [len(p["d1"]) - p["k"] for p in plans]
    for h, p in zip(cb.history, plans):
        if p["kind"] == "prune":
            assert h["threshold"] == pytest.approx(p["tau"], rel=1e-12)
