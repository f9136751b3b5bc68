"""All four techniques on one tiny GPT-2 under 2-process DDP (CPU, gloo): the ranks agree on everything the techniques
decide (V-cycle level, InfoBatch's score table, the curriculum's position, random-LTD's counters, the final weights)
and the EfficiencyMonitor's figures are the sums over ranks of what each rank computed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_effi import EfficiencyMonitor
from tests.composition.test_matrix import Stack
from tests.helpers.flops import MeasuredFlops
from tests.helpers.harness import fit_ddp


class RankReport(MeasuredFlops):
    """Measures each batch's FLOPs on its rank (first in the callbacks) and, at the end of fit, writes the rank's
    measured total, the technique callbacks' states and a digest of the final weights to ``rank<r>.report.json``."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__()
        self.out_dir = str(out_dir)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        states: dict[str, Any] = {}
        for cb in trainer.callbacks:
            if getattr(type(cb), "requirements", None) is not None:
                states[type(cb).__name__] = _plain(cb.state_dict())
        weights = sum(float(p.double().abs().sum()) for p in pl_module.parameters())
        report = {"measured": self.total, "states": states, "weights": weights, "level": _level(trainer)}
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.out_dir) / f"rank{trainer.global_rank}.report.json").write_text(json.dumps(report))


def _level(trainer: pl.Trainer) -> int | None:
    return next((cb.level for cb in trainer.callbacks if hasattr(cb, "stage_index")), None)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _drop_rank_local(states: dict[str, Any]) -> dict[str, Any]:
    """Per-rank quantities that legitimately differ: InfoBatch's unsynced accumulators of the last epoch (summed at the
    next epoch's start) and the V-cycle's wall time spent mapping."""
    out = json.loads(json.dumps(states))
    for key in ("sum_loss", "count", "pending_tokens"):
        out.get("InfoBatchCallback", {}).pop(key, None)
    out.get("VCycleCallback", {}).pop("map_seconds", None)
    return out


@pytest.mark.slow
def test_all_four_under_ddp(tmp_path):
    stack = Stack(("infobatch", "curriculum", "random_ltd", "vcycle"), image=False)
    callbacks = stack.callbacks()
    report = RankReport(tmp_path / "reports")
    monitor = EfficiencyMonitor(print_summary=False)
    limits = {**stack.limits(), "max_steps": 6}  # the curriculum's budget on 2 ranks: 24 samples x 2 epochs / 8
    _, per_rank = fit_ddp(stack.model(), stack.datamodule(callbacks), tmp_path, [report, monitor, *callbacks], **limits)
    reports = [json.loads((tmp_path / "reports" / f"rank{r}.report.json").read_text()) for r in range(2)]
    assert [r["global_step"] for r in per_rank] == [limits["max_steps"]] * 2
    assert reports[0]["level"] == reports[1]["level"] == 1  # the cycle completed on both ranks
    assert reports[0]["weights"] == reports[1]["weights"]
    assert _drop_rank_local(reports[0]["states"]) == _drop_rank_local(reports[1]["states"])
    summaries = [{k: v for k, v in r["summary"].items() if k != "vcycle/map_seconds"} for r in per_rank]
    assert summaries[0] == summaries[1]  # counts summed, times maxed: identical on every rank (but mapping times)
    measured = reports[0]["measured"] + reports[1]["measured"]
    assert abs(summaries[0]["flops"] - measured) / measured < 0.03
    ranks_batches = [len(r["batches"]) for r in per_rank]
    assert summaries[0]["batches"] == sum(ranks_batches)
    # the V-cycle's FLOPs beside the monitor's are summed over the ranks too, in its state as well (one rank's stood
    # there, about half the monitor's, and a checkpoint went on from it on another number of processes; qa52-ddp 02,
    # qa53-break 04)
    vcycle = [r["states"]["VCycleCallback"]["flops"] for r in reports]
    assert summaries[0]["vcycle/flops"] == vcycle[0] == vcycle[1] > 0.75 * summaries[0]["flops"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("names", "resume_step", "limits"),
    [
        (("infobatch",), 4, dict(max_epochs=3, max_steps=-1)),  # 3 steps per rank and epoch: inside epoch 1
        (("infobatch", "curriculum"), 5, dict(max_steps=6, max_epochs=-1)),  # the curriculum's data epoch 1: 4-6
    ],
    ids=["infobatch", "infobatch+curriculum"],
)
def test_ddp_mid_epoch_resume_keeps_every_ranks_pending_losses(tmp_path, names, resume_step, limits):
    """A checkpoint holds rank 0's callback state only: InfoBatch writes the losses every rank recorded since the last
    score sync, summed, so a DDP run resumed mid-epoch ends with the uninterrupted run's score table on both ranks."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    stack = Stack(names, image=False)
    kwargs = {**stack.limits(), **limits}
    scores = []
    for arm in ("a", "b"):
        callbacks = stack.callbacks()
        extra: list[Any] = []
        if arm == "a":
            extra.append(
                ModelCheckpoint(
                    dirpath=tmp_path / "ckpts",
                    every_n_train_steps=1,
                    save_top_k=-1,
                    filename="{step}",
                    save_on_train_epoch_end=False,
                )
            )
        pl.seed_everything(0 if arm == "a" else 1234)
        _, per_rank = fit_ddp(
            stack.model(),
            stack.datamodule(callbacks),
            tmp_path / arm,
            [*callbacks, *extra],
            ckpt_path=None if arm == "a" else tmp_path / "ckpts" / f"step={resume_step}.ckpt",
            **kwargs,
        )
        ranks = [r["scores"]["InfoBatchCallback"] for r in per_rank]
        assert ranks[0] == ranks[1]  # identical on both ranks
        scores.append(torch.tensor(ranks[0]))
    assert torch.count_nonzero(scores[0]) > 0
    torch.testing.assert_close(scores[1], scores[0], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("infobatch", [False, True], ids=["monitor", "monitor+infobatch"])
def test_ddp_resume_in_the_first_epoch_counts_every_ranks_tokens(tmp_path, infobatch):
    """Sentences of unequal length: the ranks compute different tokens. A checkpoint holds rank 0's callback states
    only, so the monitor writes its totals summed over the ranks, and InfoBatch its per-sample token table's pending
    sums (the table fills in the first, full epoch, rank by rank): resumed at step 2, the run ends with the
    uninterrupted run's tokens and baseline tokens (before, the resumed totals counted rank 0's tokens twice:
    946 for 926)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_effi.callbacks import InfoBatchCallback
    from lightning_effi.infobatch.data import InfoBatchDataModule
    from tests.helpers.tiny import tiny_bert_cls, tiny_sentence_data

    summaries, totals = [], []
    for arm in ("a", "b"):
        # every step's checkpoint: arm a's to resume from, the last one of each arm for the unrounded totals
        extra = [
            ModelCheckpoint(dirpath=tmp_path / arm / "ckpts", every_n_train_steps=1, save_top_k=-1, filename="{step}")
        ]
        pl.seed_everything(0 if arm == "a" else 1234)
        callbacks: list[Any] = [EfficiencyMonitor(print_summary=False)]
        data: pl.LightningDataModule = tiny_sentence_data(batch_size=5)  # 40 sentences: 4 steps a rank an epoch
        if infobatch:
            callbacks.append(InfoBatchCallback(prune_ratio=0.5, delta=0.67, seed=3))
            data = InfoBatchDataModule(data)
        _, per_rank = fit_ddp(
            tiny_bert_cls(),
            data,
            tmp_path / arm,
            [*callbacks, *extra],
            ckpt_path=None if arm == "a" else tmp_path / "a" / "ckpts" / "step=2.ckpt",
            max_epochs=3,
        )
        summaries.append(per_rank[0]["summary"])
        last = torch.load(tmp_path / arm / "ckpts" / f"step={per_rank[0]['global_step']}.ckpt", weights_only=True)
        totals.append(next(v["totals"] for k, v in last["callbacks"].items() if k.startswith("EfficiencyMonitor")))
    # the summary rounds tokens to ints: a lost rank's token table moves InfoBatch's baseline by a fraction of one
    assert totals[1]["baseline_tokens"] == pytest.approx(totals[0]["baseline_tokens"], rel=1e-12)
    a, b = summaries
    assert b["samples"] == a["samples"] and b["tokens"] == a["tokens"] and b["layer_tokens"] == a["layer_tokens"]
    assert b["baseline_samples"] == a["baseline_samples"] and b["flops"] == pytest.approx(a["flops"], rel=1e-12)
    assert b["baseline_tokens"] == pytest.approx(a["baseline_tokens"], rel=1e-12)
    assert (a["samples"] < a["baseline_samples"]) == infobatch


@pytest.mark.slow
def test_a_one_device_checkpoint_resumed_under_ddp_counts_its_totals_once(tmp_path):
    """A checkpoint written on one device holds that run's totals; each of 2 DDP ranks resuming it loaded them all,
    and the summary summed them over the ranks: the first epoch was counted twice (120 samples for 80)."""
    from tests.helpers.harness import make_trainer
    from tests.helpers.tiny import tiny_gpt2, tiny_lm_data

    pl.seed_everything(0)
    one = EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path / "one", [one], max_epochs=1)
    trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    trainer.save_checkpoint(tmp_path / "one.ckpt")
    assert (one.summary["samples"], one.summary["tokens"]) == (40, 640)
    _, ranks = fit_ddp(
        tiny_gpt2(), tiny_lm_data(), tmp_path / "ddp", [EfficiencyMonitor(print_summary=False)],
        ckpt_path=tmp_path / "one.ckpt", max_epochs=2,
    )  # fmt: skip
    s = ranks[0]["summary"]
    assert (s["samples"], s["tokens"]) == (80, 1280)
