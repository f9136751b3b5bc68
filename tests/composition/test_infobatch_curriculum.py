"""InfoBatch inside the curriculum's stream, as one data pipeline: the curriculum decides which samples are eligible and
draws every batch; InfoBatch thins each drawn micro-batch and reweights what it keeps (method cards, "Composition").

The pure thinning (exact keep probabilities, unbiasedness, weights, never empty, determinism), then Lightning runs on a
tiny GPT-2 over 40 token blocks (micro-batch 4: 10 steps per data epoch): difficulty bounds and the subset of the
curriculum's own draws, the saving and the annealing, the three nestings and both callback orders, mid-epoch resume,
DDP (slow) and bad input.
"""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_effi.callbacks import Curriculum, InfoBatchCallback, VCycleCallback
from lightning_effi.core.accounting import EfficiencyMonitor
from lightning_effi.core.batch import batch_meta
from lightning_effi.core.errors import DataConfigError
from lightning_effi.core.progress import progress_clock, progress_source
from lightning_effi.core.wrapping import find_wrapper, wrapper_chain
from lightning_effi.curriculum import CurriculumConfig, CurriculumConfigError, CurriculumController
from lightning_effi.curriculum.analysis.index import MetricIndex
from lightning_effi.data import CurriculumDataModule, InfoBatchDataModule
from lightning_effi.infobatch import functional as ib
from tests.helpers.harness import assert_resume_equals_uninterrupted, fit_ddp, make_trainer
from tests.helpers.tiny import TokenBlocks, tiny_gpt2, tiny_lm_data

# ------------------------------------------------------------------------------------------------ the pure thinning


def _generators(count, base=0):
    return (ib.thin_generator(base, s, 0, 0) for s in range(count))


@pytest.mark.parametrize("prune_ratio", [0.25, 0.3, 0.5, 0.75])
def test_keep_probability_is_exactly_one_minus_r(prune_ratio):
    r = Fraction(str(prune_ratio))
    for b in range(1, 9):
        for k in range(b + 1):
            mask = torch.zeros(b, dtype=torch.bool)
            mask[:k] = True
            p = ib.keep_probabilities(mask, prune_ratio)
            assert p[k:].tolist() == [1.0] * (b - k)  # never dropped unless well-learned
            if ib.cap_applies(b, k, prune_ratio):  # a tail slice (r > 1 - 1/b): one kept out of k = b
                assert k == b and r * b > b - 1 and p.tolist() == [1 / b] * b
            else:  # E[m] = floor(r k) + frac(r k) = r k, each of k dropped uniformly: 1 - r exactly
                assert p[:k].tolist() == [float(1 - r)] * k
    # the full micro-batches allowed for this ratio are never capped
    mbs = math.ceil(1 / (1 - r))
    ib.check_thinning_ratio(prune_ratio, mbs)
    assert all(not ib.cap_applies(b, k, prune_ratio) for b in range(mbs, 12) for k in range(b + 1))


def test_drop_count_takes_floor_or_ceil_with_the_exact_mean():
    b, k, r = 8, 5, 0.3  # r k = 1.5
    drops = [ib.drop_count(b, k, r, g)[0] for g in _generators(4000)]
    assert set(drops) == {1, 2}
    assert abs(np.mean(drops) - 1.5) < 4 * 0.5 / math.sqrt(4000)
    assert [ib.drop_count(b, 4, 0.5, g)[0] for g in _generators(50)] == [2] * 50  # r k = 2: no randomness


def test_keep_frequencies_and_weights_monte_carlo():
    ids = torch.arange(100, 108, dtype=torch.int64)
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    draws, kept = 6000, torch.zeros(8)
    for g in _generators(draws):
        out = ib.thin_micro_batch(ids, mask, 0.3, g)
        assert out.ids.numel() >= 1 and torch.equal(out.ids, ids[out.keep])
        assert out.weights.dtype == torch.float32
        assert torch.equal(out.weights, torch.where(mask[out.keep], torch.tensor(1 / 0.7), torch.tensor(1.0)))
        kept += out.keep.float()
    freq = kept / draws
    assert torch.equal(freq[~mask], torch.ones(3))
    assert (freq[mask] - 0.7).abs().max() < 4 * math.sqrt(0.7 * 0.3 / draws)


@pytest.mark.parametrize("prune_ratio,k", [(0.5, 5), (0.3, 7), (0.75, 8), (0.5, 0)])
def test_weighted_loss_over_candidates_is_unbiased(prune_ratio, k):
    g0 = torch.Generator().manual_seed(11)
    losses = torch.rand(8, generator=g0, dtype=torch.float64) * 3
    ids = torch.arange(8, dtype=torch.int64)
    mask = torch.zeros(8, dtype=torch.bool)
    mask[torch.randperm(8, generator=g0)[:k]] = True
    # exactly, from the keep probabilities: sum(p w l) / B == mean(l)
    w_all = torch.ones(8, dtype=torch.float64).masked_fill(mask, 1 / (1 - prune_ratio))
    exact = (ib.keep_probabilities(mask, prune_ratio) * w_all * losses).sum() / 8
    assert float(exact) == pytest.approx(float(losses.mean()), rel=1e-12)
    # Monte Carlo over many seed tuples, through thinned_loss
    values = []
    for g in _generators(8000, base=5):
        out = ib.thin_micro_batch(ids, mask, prune_ratio, g)
        values.append(float(ib.thinned_loss(losses[out.ids].float(), out.weights, 8)))
    values = np.array(values)
    stderr = values.std() / math.sqrt(len(values))
    assert abs(values.mean() - float(losses.mean())) <= 4 * stderr + 1e-6
    assert abs(values.mean() - float(losses.mean())) < 0.01 * float(losses.mean())


def test_never_empty_and_the_tail_cap():
    ids = torch.arange(3, dtype=torch.int64)
    every = torch.ones(3, dtype=torch.bool)
    for g in _generators(300):  # r 3 = 2.7 > B - 1: the Bernoulli would drop all 3 in 70% of the draws
        out = ib.thin_micro_batch(ids, every, 0.9, g)
        assert out.ids.numel() == 1 and out.capped and out.weights.tolist() == [pytest.approx(10.0)]
    one = ib.thin_micro_batch(ids[:1], every[:1], 0.5, ib.thin_generator(0, 1, 0, 0))
    assert one.ids.tolist() == [0] and one.capped
    full = ib.thin_micro_batch(torch.arange(4), torch.ones(4, dtype=torch.bool), 0.75, ib.thin_generator(0, 1, 0, 0))
    assert full.ids.numel() == 1 and not full.capped  # r B = B - 1 exactly: allowed, never capped


def test_thinning_is_deterministic_per_seed_tuple():
    ids = torch.arange(10, 26, dtype=torch.int64)
    mask = torch.arange(16) % 3 != 0
    a = ib.thin_micro_batch(ids, mask, 0.5, ib.thin_generator(7, 12, 1, 0))
    b = ib.thin_micro_batch(ids, mask, 0.5, ib.thin_generator(7, 12, 1, 0))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)
    others = [ib.thin_micro_batch(ids, mask, 0.5, ib.thin_generator(*t)).ids.tolist() for t in
              [(8, 12, 1, 0), (7, 13, 1, 0), (7, 12, 0, 0), (7, 12, 1, 1)]]  # fmt: skip
    assert all(o != a.ids.tolist() for o in others)
    state = torch.random.get_rng_state()
    ib.thin_micro_batch(ids, mask, 0.5, ib.thin_generator(7, 12, 1, 0))
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is never used


def test_thinned_loss_divides_by_the_candidates():
    losses = torch.tensor([1.0, 2.0, 4.0], requires_grad=True)
    loss = ib.thinned_loss(losses, torch.tensor([2.0, 1.0, 2.0]), 5)
    assert float(loss) == pytest.approx((2 + 2 + 8) / 5)
    loss.backward()
    assert losses.grad.tolist() == pytest.approx([0.4, 0.2, 0.4])
    with pytest.raises(ValueError, match="num_candidates"):
        ib.thinned_loss(losses, torch.ones(3), 2)
    with pytest.raises(ValueError, match="per_sample_loss"):
        ib.thinned_loss(losses[:2], torch.ones(3), 5)


def test_thinning_ratio_and_stop_step():
    ib.check_thinning_ratio(0.75, 4)
    with pytest.raises(ValueError, match=r"prune_ratio=0.8 .* micro-batches of 4 samples.*<= 1 - 1/micro_batch_size"):
        ib.check_thinning_ratio(0.8, 4)
    with pytest.raises(ValueError, match="micro-batches of 1 samples"):
        ib.check_thinning_ratio(0.1, 1)
    assert ib.thin_stop_step(100, 0.57) == 57 and ib.thin_stop_step(30, 0.75) == 22


def test_the_callback_thins_keys_and_counts_a_capped_tail_slice():
    """The sampler-facing ``thin_keys`` and the figures counted when a batch trains, without a Trainer."""
    cb = infobatch(prune_ratio=0.7, delta=0.875)
    n = 10
    cb.dataset_size, cb.micro_batch_size = n, 4
    cb.score, cb.seen = torch.arange(n, dtype=torch.float32), torch.ones(n, dtype=torch.bool)  # 0..4 below 4.5
    cb.sum_loss, cb.count = torch.zeros(n), torch.zeros(n, dtype=torch.int32)
    cb.curriculum_dm = SimpleNamespace(controller=SimpleNamespace(total_steps=100, epoch_micro=10, ga=1))
    cb._trainer = SimpleNamespace(max_steps=40, max_epochs=-1, current_epoch=1, world_size=1)
    assert cb.thin_stop() == 35  # floor(0.875 * min(40, 100))
    key = lambda i, step: (i, step, 0, (16,))  # noqa: E731
    full = cb.thin_keys([key(i, 5) for i in (0, 1, 2, 7)], rank=0)  # 3 well-learned: drop 2 or 3 of them
    assert cb.history[-1]["well_learned"] == 5 and cb.history[-1]["threshold"] == 4.5
    assert 1 <= len(full) <= 2 and all(k[5] == 4 for k in full) and (7, 5, 0, (16,), 1.0, 4) in full
    assert cb.thin_keys([key(i, 36) for i in (0, 1, 2, 7)], rank=0) == [(*key(i, 36), 1.0, 4) for i in (0, 1, 2, 7)]
    tail = cb.thin_keys([key(3, 6), key(4, 6)], rank=0)  # 2 candidates, both well-learned, 0.7 x 2 > 1: capped
    assert len(tail) == 1 and tail[0][4] == pytest.approx(1 / 0.3) and tail[0][5] == 2
    out = cb.thinned_output(
        {"loss": None, "per_sample_loss": torch.tensor([0.5], requires_grad=True)},
        torch.tensor([tail[0][0]]),
        torch.tensor([tail[0][4]], dtype=torch.float32),
        2,
    )
    assert float(out["loss"]) == pytest.approx(0.5 / 0.3 / 2)
    assert cb.thin_stats.tolist() == [2, 1, 1]
    cb.sync_scores(None)
    assert cb.history[-1] | {"threshold": None} == {
        "epoch": 1, "kind": "thin", "threshold": None, "well_learned": 5, "drawn": 2, "saved": 1, "tail": 1
    }  # fmt: skip
    assert cb.effi_summary()["infobatch/unpruned_tail_batches"] == 1 and cb.synced_epoch == 1


# ----------------------------------------------------------------------------------------------- Lightning runs


def first_token(batch):
    """The analysis metric: a sample's first token (a module-level function: pickled by reference under DDP)."""
    return batch["input_ids"][:, 0].long()


#: the samples whose first token is <= the difficulty (16 -> 63 over 20 steps), truncated to 3 -> 16 tokens
VALUE = dict(
    difficulty_type="value",
    clustering_type="schedule_based",
    analysis=first_token,
    min_difficulty=16,
    max_difficulty=63,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=20, difficulty_step=1),
)
TRUNC = dict(
    difficulty_type="value",
    clustering_type="single_cluster",
    min_difficulty=2,
    max_difficulty=16,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=14, difficulty_step=1),
)
METRICS = {"first": VALUE, "seqlen_truncate": TRUNC}
MBS, STEPS, DELTA = 4, 30, 0.75  # 10 steps per data epoch; thinning stops after step floor(0.75 * 30) = 22


def curriculum():
    return Curriculum(metrics=METRICS, seed=3)


def infobatch(**kw):
    return InfoBatchCallback(**{"prune_ratio": 0.5, "delta": DELTA, "seed": 1, **kw})


class Record(pl.Callback):
    """Sees the ``cl_*`` and InfoBatch metadata (``batch_meta``). Per batch: step, micro, difficulty, kept
    indices, weights, candidates, shape; the loss; and the curriculum's own draws ``(step, micro) -> indices`` (a spy
    on the stream)."""

    def __init__(self):
        self.train, self.losses, self.stream, self.kept = [], [], {}, []

    def on_fit_start(self, trainer, pl_module):  # before the first loader is iterated
        controller = find_wrapper(trainer.datamodule, CurriculumDataModule).controller
        original = controller.micro_batches

        def spy():
            for keys in original():
                self.stream[(keys[0][1], keys[0][2])] = [k[0] for k in keys]
                yield keys

        controller.micro_batches = spy

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch = {**batch, **batch_meta(trainer)}  # the user's batch and the techniques' metadata
        self.train.append(
            {
                "epoch": trainer.current_epoch,
                "step": batch["cl_step"],
                "micro": batch["cl_micro"],
                "difficulty": dict(batch["cl_difficulty"]),
                "index": batch["index"].tolist() if "index" in batch else None,
                "weight": batch["infobatch_weight"].tolist() if "infobatch_weight" in batch else None,
                "candidates": batch.get("infobatch_candidates"),
                "shape": tuple(batch["input_ids"].shape),
            }
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        ib_cb = next((c for c in trainer.callbacks if isinstance(c, InfoBatchCallback)), None)
        if ib_cb is not None:  # the progress bar's and the schedule's reading
            self.kept.append(ib_cb.effi_schedule_state()["kept_fraction"])


NESTINGS = {
    "infobatch_outside": lambda dm: InfoBatchDataModule(CurriculumDataModule(dm)),
    "curriculum_outside": lambda dm: CurriculumDataModule(InfoBatchDataModule(dm)),
    "curriculum_only": lambda dm: CurriculumDataModule(dm),
}


def run(tmp_path, with_infobatch=True, nesting="infobatch_outside", infobatch_first=True, steps=STEPS, **ib_kw):
    rec = Record()
    techniques = [infobatch(**ib_kw), curriculum()] if with_infobatch else [curriculum()]
    if not infobatch_first:
        techniques.reverse()
    pl.seed_everything(0, workers=True)
    monitor = EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path, [rec, monitor, *techniques], max_steps=steps, max_epochs=-1)
    trainer.fit(tiny_gpt2(), datamodule=NESTINGS[nesting](tiny_lm_data(batch_size=MBS)))
    ib_cb = next((c for c in trainer.callbacks if isinstance(c, InfoBatchCallback)), None)
    return trainer, rec, ib_cb, monitor.summary


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ib_cl")
    return {
        "composed": run(root / "composed"),
        "curriculum": run(root / "curriculum", with_infobatch=False, nesting="curriculum_only"),
    }


def test_trained_samples_respect_the_difficulty_and_come_from_the_curriculums_draws(runs):
    _, rec, _, _ = runs["composed"]
    _, rec_cl, _, _ = runs["curriculum"]
    data = TokenBlocks().data
    assert [r["step"] for r in rec.train] == list(range(1, STEPS + 1)) == [r["step"] for r in rec_cl.train]
    assert rec.stream == rec_cl.stream  # the curriculum's stream is unchanged by the thinning
    for r, r_cl in zip(rec.train, rec_cl.train):
        d = r["difficulty"]
        assert d == r_cl["difficulty"]  # the same difficulty schedule
        assert all(int(data[i, 0]) <= d["first"] for i in r["index"])  # eligible at the batch's own difficulty
        assert r["shape"] == (len(r["index"]), d["seqlen_truncate"])  # truncation unchanged
        drawn = rec_cl.stream[(r["step"], r["micro"])]  # what the curriculum alone drew at this step
        assert r["candidates"] == len(drawn) == MBS and r_cl["shape"] == (MBS, d["seqlen_truncate"])
        assert not Counter(r["index"]) - Counter(drawn)  # a sub-multiset of the curriculum-only draw


class Baselines(pl.Callback):
    """The progress clock the run sees at train start, and InfoBatch's ``effi_baseline`` of every batch."""

    def __init__(self):
        self.clock, self.samples = "unset", []

    def on_train_start(self, trainer, pl_module):
        self.clock = (progress_clock(trainer.callbacks), progress_source(trainer.callbacks))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ib_cb = next(c for c in trainer.callbacks if isinstance(c, InfoBatchCallback))
        baseline = ib_cb.effi_baseline(batch, pl_module)
        self.samples.append(None if baseline is None else baseline.samples)


@pytest.mark.parametrize("infobatch_first", [True, False])
def test_no_progress_clock_and_each_slice_stands_for_its_candidates(tmp_path, infobatch_first):
    """Thinning inside the curriculum changes no step: InfoBatch is no progress source or clock then (in either
    callback order). Its baseline charges each micro-batch ``candidates / kept`` (None when nothing was dropped), so
    the EfficiencyMonitor's baseline counts every sample the curriculum drew."""
    rec, probe = Record(), Baselines()
    techniques = [infobatch(), curriculum()] if infobatch_first else [curriculum(), infobatch()]
    pl.seed_everything(0, workers=True)
    monitor = EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path, [rec, monitor, *techniques, probe], max_steps=20, max_epochs=-1)
    trainer.fit(tiny_gpt2(), datamodule=NESTINGS["infobatch_outside"](tiny_lm_data(batch_size=MBS)))
    assert probe.clock == (None, None)
    kept = [len(r["index"]) for r in rec.train]
    assert probe.samples == [MBS / k if k < MBS else None for k in kept]
    assert any(k < MBS for k in kept)
    s = monitor.summary
    assert s["samples"] == sum(kept) and s["baseline_samples"] == MBS * len(kept) == 80
    assert s["saved/infobatch/samples_frac"] == pytest.approx(1 - sum(kept) / 80)


class StepsAndLevels(pl.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ib_cb = next(c for c in trainer.callbacks if isinstance(c, InfoBatchCallback))
        vc = next(c for c in trainer.callbacks if isinstance(c, VCycleCallback))
        self.rows.append((trainer.global_step, ib_cb.effi_progress_done(), vc.level))


def test_a_vcycle_before_infobatch_reads_the_curriculums_steps(tmp_path):
    """A V-cycle earlier in the callback list looks for a progress clock in its setup, before InfoBatch's setup hides
    it: for it InfoBatch's clock reads the curriculum's steps (``global_step / T``, ``T`` = 20), so the stages
    ('0.2dur', '0.4dur') switch after steps 4 and 12 and the run ends on the full model."""
    probe = StepsAndLevels()
    vc = VCycleCallback(e_a="0.2dur", e_small="0.4dur")
    pl.seed_everything(0, workers=True)
    trainer = make_trainer(tmp_path, [vc, infobatch(), curriculum(), probe], max_steps=20, max_epochs=-1)
    trainer.fit(tiny_gpt2(n_layer=4), datamodule=NESTINGS["infobatch_outside"](tiny_lm_data(batch_size=MBS)))
    assert [p for _, p, _ in probe.rows] == [s / 20 for s in range(1, 21)]
    assert [level for *_, level in probe.rows] == [1] * 3 + [2] * 8 + [1] * 9
    assert trainer.global_step == 20 and vc.switches == 2 and vc.level == 1


def test_later_epochs_train_fewer_samples_and_annealing_stops_the_thinning(runs):
    trainer, rec, cb, summary = runs["composed"]
    _, rec_cl, _, _ = runs["curriculum"]
    sizes = [len(r["index"]) for r in rec.train]
    stop = cb.thin_stop()
    assert stop == math.floor(DELTA * STEPS) == 22
    assert sizes[:10] == [MBS] * 10  # epoch 0: no score yet, nothing thinned
    assert all(r["weight"] == [1.0] * MBS for r in rec.train[:10])
    thinned = sizes[10:stop]
    assert sum(thinned) < MBS * len(thinned) and min(thinned) >= 1  # fewer than the curriculum-only run (4 each)
    assert [r["shape"][0] for r in rec_cl.train] == [MBS] * STEPS
    assert sizes[stop:] == [MBS] * (STEPS - stop)  # after floor(delta T): the full draws, weight 1
    assert all(r["weight"] == [1.0] * MBS for r in rec.train[stop:])
    for r in rec.train[10:stop]:  # kept well-learned samples weigh 1 / (1 - r) = 2
        assert set(r["weight"]) <= {1.0, 2.0}
    saved = sum(MBS - s for s in sizes)
    assert saved > 0
    assert summary["infobatch/saved_samples"] == saved == sum(h["saved"] for h in cb.history)
    assert summary["infobatch/drawn_samples"] == MBS * STEPS
    assert summary["infobatch/saved_fraction"] == pytest.approx(saved / (MBS * STEPS))
    assert summary["infobatch/unpruned_tail_batches"] == 0 and summary["infobatch/thin_stop_step"] == 22
    assert summary["samples"] == sum(sizes)  # the accounting counts what was trained
    assert [h["epoch"] for h in cb.history] == [0, 1, 2] and trainer.global_step == STEPS
    # kept_fraction: of the samples drawn so far in the batch's epoch (it read 1.0 at every step, qa38-break 03)
    drawn, kept, expected = {}, {}, []
    for r, size in zip(rec.train, sizes, strict=True):
        drawn[r["epoch"]] = drawn.get(r["epoch"], 0) + MBS
        kept[r["epoch"]] = kept.get(r["epoch"], 0) + size
        expected.append(kept[r["epoch"]] / drawn[r["epoch"]])
    assert rec.kept == pytest.approx(expected) and min(rec.kept) < 1.0


def test_the_well_learned_set_is_frozen_per_epoch_from_the_table_at_its_start(tmp_path):
    seen_tables = {}

    class Snap(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            cb = next(c for c in trainer.callbacks if isinstance(c, InfoBatchCallback))
            seen_tables[trainer.current_epoch] = (cb.score.clone(), cb.seen.clone())

    rec = Record()
    cb = infobatch()
    trainer = make_trainer(tmp_path, [rec, Snap(), cb, curriculum()], max_steps=20, max_epochs=-1)
    trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=MBS)))
    score, seen = seen_tables[1]
    tau = float(score[seen].double().mean())
    well = seen & (score < tau)
    assert cb.history[1]["well_learned"] == int(well.sum()) > 0 and cb.history[1]["threshold"] == pytest.approx(tau)
    stop = cb.thin_stop()
    assert stop == 15
    for r in rec.train[10:stop]:
        drawn = rec.stream[(r["step"], r["micro"])]
        dropped = Counter(drawn) - Counter(r["index"])
        assert all(bool(well[i]) for i in dropped)  # only well-learned samples are ever dropped
        assert [w == 2.0 for w in r["weight"]] == [bool(well[i]) for i in r["index"]]
        k = sum(bool(well[i]) for i in drawn)
        assert sum(dropped.values()) in (math.floor(0.5 * k), math.ceil(0.5 * k))


@pytest.mark.parametrize(
    "nesting,infobatch_first",
    [
        ("infobatch_outside", False),
        ("curriculum_outside", True),
        ("curriculum_outside", False),
        ("curriculum_only", True),
    ],
)
def test_every_nesting_and_callback_order_trains_identically(tmp_path, runs, nesting, infobatch_first):
    _, reference, ref_cb, _ = runs["composed"]  # InfoBatchDataModule(CurriculumDataModule(dm)), InfoBatch first
    _, rec, cb, _ = run(tmp_path, nesting=nesting, infobatch_first=infobatch_first)
    assert rec.losses == reference.losses
    assert rec.train == reference.train
    assert torch.equal(cb.score, ref_cb.score) and cb.history == ref_cb.history


def test_the_wrapper_chain_and_the_innermost_loader():
    user = tiny_lm_data(batch_size=MBS)
    inner = InfoBatchDataModule(user)
    outer = CurriculumDataModule(inner)
    assert wrapper_chain(outer) == [outer, inner, user] and wrapper_chain(user) == [user]
    assert find_wrapper(outer, InfoBatchDataModule) is inner and find_wrapper(outer, CurriculumDataModule) is outer
    assert find_wrapper(inner, CurriculumDataModule) is None and find_wrapper(None, CurriculumDataModule) is None
    t = outer.template()  # the user's loader, not the InfoBatch wrapper's
    assert t["dataset"] is user.train_dataset and t["batch_size"] == MBS and t["length"] == 40


def test_hydra_style_wrapping_gives_both_nestings():
    for callbacks in ([infobatch(), curriculum()], [curriculum(), infobatch()]):
        dm = tiny_lm_data()
        for cb in callbacks:  # as lightning_effi.train.build does
            dm = cb.wrap_datamodule(dm)
        assert type(dm) is type(callbacks[-1].wrap_datamodule(tiny_lm_data()))
        assert find_wrapper(dm, CurriculumDataModule) and find_wrapper(dm, InfoBatchDataModule)
        assert callbacks[0].wrap_datamodule(dm) is dm and callbacks[1].wrap_datamodule(dm) is dm  # wrapped once


@pytest.mark.parametrize("resume_step,num_workers", [(10, 0), (15, 0), (14, 2)])
def test_resume_mid_epoch_equals_uninterrupted(tmp_path, resume_step, num_workers):
    # 10: the last batch of epoch 0 (its losses are merged when epoch 1 starts); 15 and 14: mid-epoch while thinning
    a, b = assert_resume_equals_uninterrupted(
        tiny_gpt2,
        lambda: InfoBatchDataModule(CurriculumDataModule(tiny_lm_data(batch_size=MBS, num_workers=num_workers))),
        tmp_path,
        total_steps=24,
        resume_step=resume_step,
        callbacks_fn=lambda: [Record(), infobatch(), curriculum()],
    )
    rec_a = next(c for c in a.callbacks if isinstance(c, Record))
    rec_b = next(c for c in b.callbacks if isinstance(c, Record))
    assert rec_b.train == rec_a.train[resume_step:] and rec_b.losses == rec_a.losses[resume_step:]
    assert any(len(r["index"]) < MBS for r in rec_b.train)  # the resumed part thins
    cb_a = next(c for c in a.callbacks if isinstance(c, InfoBatchCallback))
    cb_b = next(c for c in b.callbacks if isinstance(c, InfoBatchCallback))
    assert cb_a.effi_summary() == cb_b.effi_summary() and cb_a.effi_summary()["infobatch/saved_samples"] > 0


def test_a_fit_resumed_from_the_runs_last_batch_ends_with_the_uninterrupted_summary(tmp_path):
    """The checkpoint of the run's last batch holds the last data epoch's figures unmerged (its epoch end came after);
    the fit resumed from it has no batch left, so no epoch end: its summary (and ResultWriter's record) counted one
    data epoch of drawn and dropped samples, saved 0 (qa106-user 03). The monitor is listed first: the figures are
    settled before it reads them."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def data():
        return InfoBatchDataModule(CurriculumDataModule(tiny_lm_data(batch_size=MBS)))

    every = ModelCheckpoint(
        dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}", save_on_train_epoch_end=False
    )
    monitor, cb = EfficiencyMonitor(print_summary=False), infobatch()
    make_trainer(tmp_path, [monitor, cb, curriculum(), every], max_steps=15, max_epochs=-1).fit(tiny_gpt2(), data())
    state = torch.load(tmp_path / "ck/step=15.ckpt", weights_only=True)["callbacks"][cb.state_key]
    assert state["synced_epoch"] < state["table_epoch"] and state["thin_stats"][0] > 0  # the last epoch: pending
    resumed_monitor, resumed = EfficiencyMonitor(print_summary=False), infobatch()
    make_trainer(tmp_path, [resumed_monitor, resumed, curriculum()], max_steps=15, max_epochs=-1).fit(
        tiny_gpt2(), data(), ckpt_path=tmp_path / "ck/step=15.ckpt"
    )
    assert resumed.effi_summary() == cb.effi_summary() and cb.effi_summary()["infobatch/saved_samples"] > 0
    keys = [k for k in monitor.summary if k.startswith(("infobatch/", "saved/infobatch/"))]
    assert {k: resumed_monitor.summary[k] for k in keys} == {k: monitor.summary[k] for k in keys}


def test_checkpointed_state_names_the_table_epoch(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    cb = infobatch()
    every = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=5, save_top_k=-1, filename="{step}")
    trainer = make_trainer(tmp_path, [cb, curriculum(), every], max_steps=15, max_epochs=-1)
    trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=MBS)))
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["callbacks"][cb.state_key]
    assert state["table_epoch"] == state["synced_epoch"] == 1 and state["thin_stats"].tolist() == [0, 0, 0]
    assert state["config"]["within"] == "curriculum" and state["config"]["thin_stop_step"] == math.floor(DELTA * 15)
    # a longer run (T = 20) from step 5, before the last thinned step: refused, the thinning would move
    with pytest.raises(ValueError, match=r"other settings.*thin_stop_step.*\(11, 15\)"):
        make_trainer(tmp_path, [infobatch(), curriculum()], max_steps=20, max_epochs=-1).fit(
            tiny_gpt2(),
            datamodule=CurriculumDataModule(tiny_lm_data(batch_size=MBS)),
            ckpt_path=tmp_path / "ck/step=5.ckpt",
        )
    # from the end of the run, past it: the run is extended unthinned (tests/robustness/test_extend_finished_run.py)
    extended = infobatch()
    make_trainer(tmp_path, [extended, curriculum()], max_steps=20, max_epochs=-1).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=MBS)), ckpt_path=path
    )
    assert extended.thin_stop() == 11


@pytest.mark.slow
def test_ddp_ranks_thin_their_own_slices_and_agree_on_the_scores(tmp_path):
    monitor = EfficiencyMonitor(print_summary=False)
    steps = 15  # global batch 8: 5 steps per data epoch, thinning from step 6 to floor(0.75 * 15) = 11
    _, per_rank = fit_ddp(
        tiny_gpt2(),
        InfoBatchDataModule(CurriculumDataModule(tiny_lm_data(batch_size=MBS))),
        tmp_path,
        [monitor, infobatch(), curriculum()],
        use_distributed_sampler=False,
        max_steps=steps,
        max_epochs=-1,
    )
    assert [r["global_step"] for r in per_rank] == [steps, steps]
    assert per_rank[0]["scores"] == per_rank[1]["scores"]  # one merge per epoch, identical tables
    sizes = [[len(b["index"]) for b in r["batches"]] for r in per_rank]
    for rank in range(2):
        assert sizes[rank][:5] == [MBS] * 5 and sizes[rank][11:] == [MBS] * 4 and min(sizes[rank]) >= 1
    assert sum(sizes[0][5:11]) + sum(sizes[1][5:11]) < 2 * MBS * 6
    # each rank keeps a subset of its own slice of the global batch, as one process computes the slices
    data = TokenBlocks().data
    index = MetricIndex.from_sample_to_metric(data[:, 0].numpy())
    config = CurriculumConfig(metrics=METRICS, seed=3)
    for rank, record in enumerate(per_rank):
        controller = CurriculumController(config, {"first": index}, len(data), MBS, dp_size=2, dp_rank=rank)
        slices = []
        while len(slices) < steps:  # data epoch after data epoch, committing as training does
            for keys in controller.micro_batches():
                slices.append([k[0] for k in keys])
                controller.commit(keys[0][1], keys[0][2])
        for batch, drawn in zip(record["batches"], slices, strict=True):
            assert not Counter(batch["index"]) - Counter(drawn)
    summaries = [r["summary"] for r in per_rank]
    saved = sum(MBS - s for rank in sizes for s in rank)
    assert summaries[0]["infobatch/saved_samples"] == summaries[1]["infobatch/saved_samples"] == saved > 0
    assert summaries[0]["infobatch/drawn_samples"] == 2 * MBS * steps


def test_bad_input_raises_at_setup(tmp_path):
    dm = lambda: CurriculumDataModule(tiny_lm_data(batch_size=MBS))  # noqa: E731
    with pytest.raises(ValueError, match=r"prune_ratio=0.8 is too large for micro-batches of 4 samples.*<= .*0.75"):
        make_trainer(tmp_path, [curriculum(), infobatch(prune_ratio=0.8)], max_steps=2).fit(
            tiny_gpt2(), datamodule=dm()
        )
    with pytest.raises(ValueError, match="num_epochs=3 is not used with the curriculum"):
        make_trainer(tmp_path, [infobatch(num_epochs=3), curriculum()], max_steps=2).fit(tiny_gpt2(), datamodule=dm())
    reshape = {"seqlen_reshape": dict(TRUNC, min_difficulty=3, max_difficulty=15)}
    with pytest.raises(DataConfigError, match="seqlen_reshape"):
        make_trainer(tmp_path, [infobatch(), Curriculum(metrics=reshape)], max_steps=2).fit(
            tiny_gpt2(), datamodule=dm()
        )
    nested = CurriculumDataModule(InfoBatchDataModule(tiny_lm_data(batch_size=MBS)))
    with pytest.raises(DataConfigError, match="InfoBatchDataModule needs an InfoBatchCallback"):
        make_trainer(tmp_path, [curriculum()], max_steps=2).fit(tiny_gpt2(), datamodule=nested)
    outer = InfoBatchDataModule(CurriculumDataModule(tiny_lm_data(batch_size=MBS)))
    with pytest.raises(DataConfigError, match="CurriculumDataModule needs the Curriculum callback"):
        make_trainer(tmp_path, [infobatch()], max_steps=2).fit(tiny_gpt2(), datamodule=outer)
    # the curriculum's wrapper missing, InfoBatch listed first: the wrapper is named, in either order (InfoBatch
    # asked for max_epochs, where the stack's step budget is right: qa83-compat 02)
    for callbacks in ([infobatch(), curriculum()], [curriculum(), infobatch()]):
        for data in (tiny_lm_data(batch_size=MBS), InfoBatchDataModule(tiny_lm_data(batch_size=MBS))):
            with pytest.raises(ValueError, match=r"datamodule=CurriculumDataModule\(your_datamodule\)"):
                make_trainer(tmp_path, callbacks, max_steps=2).fit(tiny_gpt2(), datamodule=data)


def _by_first_token(samples):  # a collate that sorts its samples (by their first token)
    return torch.utils.data.default_collate(sorted(samples, key=lambda s: int(s["input_ids"][0])))


def test_a_collate_that_reorders_the_rows_is_refused(tmp_path):
    """InfoBatch weighs each row of a thinned batch as the sample kept at its position: a collate that sorts the
    samples would send the weights and scores to other samples (qa45-break 01). The curriculum alone has no per-row
    record, but its analysis read each sample's difficulty at its position in the collated batch: refused too, unless
    an analysis_collate_fn keeps the order (then it trains with the sorting collate)."""
    keep_order = torch.utils.data.default_collate
    data = tiny_lm_data(batch_size=MBS, collate_fn=_by_first_token)
    with pytest.raises(DataConfigError, match=r"collate_fn \(_by_first_token\) puts the samples of a batch in another"):
        make_trainer(
            tmp_path, [Curriculum(metrics=METRICS, seed=3, analysis_collate_fn=keep_order), infobatch()], max_steps=2
        ).fit(tiny_gpt2(), datamodule=CurriculumDataModule(data))
    with pytest.raises(CurriculumConfigError, match=r"the collate puts the samples of a batch in another order"):
        make_trainer(tmp_path, [curriculum()], max_steps=2).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=MBS, collate_fn=_by_first_token))
        )
    trainer = make_trainer(tmp_path, [Curriculum(metrics=METRICS, seed=3, analysis_collate_fn=keep_order)], max_steps=2)
    trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=MBS, collate_fn=_by_first_token)))
    assert trainer.global_step == 2
