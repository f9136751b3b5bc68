"""Pure InfoBatch core (``lightning_effi.infobatch.functional``): plans, annealing, keep counts, expected saving,
unbiased weights, private RNG, int64 indices, rescaling and score updates (no Trainer)."""

import ast
import dataclasses
import importlib
import io
import math
import random
import warnings
from decimal import ROUND_FLOOR, Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_effi.functional import infobatch
from lightning_effi.infobatch.functional import EpochPlan

GOLDEN = [0.5, 0.5, 0.5, 0.5, 1.0, 2.0, 3.0, 4.0]


def tables(values, seen=None):
    score = torch.tensor(values, dtype=torch.float32)
    return score, (torch.ones(len(values), dtype=torch.bool) if seen is None else torch.tensor(seen))


def is_full(plan, n):
    return (
        plan.kind == "full"
        and sorted(plan.indices.tolist()) == list(range(n))
        and plan.weights.dtype == torch.float32
        and bool((plan.weights == 1.0).all())
        and plan.saved == 0
        and math.isnan(plan.threshold)
    )


# ------------------------------------------------------------------------------------------------ 1, 2: full epochs


def test_epoch_zero_is_full():
    score, seen = tables(GOLDEN[:] + [9.0, 9.0])
    plan = infobatch.plan_epoch(score, seen, epoch=0, num_epochs=4, prune_ratio=0.5)
    assert is_full(plan, 10) and plan.num_well_learned == 0 and plan.num_kept_well_learned == 0
    assert plan.dataset_size == plan.epoch_size == 10


def test_no_observed_scores_is_full():
    score = torch.zeros(10)
    plan = infobatch.plan_epoch(score, torch.zeros(10, dtype=torch.bool), epoch=2, num_epochs=10)
    assert is_full(plan, 10)
    assert plan.indices.tolist() != list(range(10))  # a fresh permutation, not the identity


# ------------------------------------------------------------------------------------------------ 3-6: the prune rule


def test_golden_prune():
    score, seen = tables(GOLDEN)
    tau, d1 = infobatch.split_well_learned(score, seen)
    assert tau == 1.5 and d1.tolist() == [True] * 5 + [False] * 3
    for seed in range(20):
        plan = infobatch.plan_epoch(score, seen, epoch=1, num_epochs=10, prune_ratio=0.5, seed=seed)
        idx = plan.indices.tolist()
        assert plan.kind == "prune" and plan.threshold == 1.5
        assert plan.num_well_learned == 5 and plan.num_kept_well_learned == 2
        assert len(idx) == 5 == len(set(idx)) and plan.saved == 3 and plan.epoch_size == 5
        kept = [i for i in idx if i < 5]
        assert len(kept) == 2 and all(plan.weights[i] == 2.0 for i in kept)
        assert {5, 6, 7} <= set(idx) and all(plan.weights[i] == 1.0 for i in (5, 6, 7))
        dropped = set(range(5)) - set(kept)
        assert all(plan.weights[i] == 1.0 for i in dropped)  # never visited; table stays 1.0 there


def test_strict_less_than():
    score, seen = tables([1, 1, 2, 2, 3, 3])
    tau, d1 = infobatch.split_well_learned(score, seen)
    assert tau == 2.0 and d1.nonzero().flatten().tolist() == [0, 1]
    for seed in range(20):
        plan = infobatch.plan_epoch(score, seen, epoch=1, num_epochs=10, prune_ratio=0.5, seed=seed)
        assert plan.num_kept_well_learned == 1 and plan.num_well_learned == 2
        assert {2, 3, 4, 5} <= set(plan.indices.tolist())
        assert plan.weights[2:].eq(1.0).all()


def test_threshold_over_seen_only_and_unseen_in_d2():
    # an unseen +inf placeholder (as in the latent-diffusion fork) must not make tau infinite; unseen samples are
    # always visited with weight 1
    score, seen = tables([1.0, 2.0, 3.0, float("inf"), 0.0], seen=[True, True, True, False, False])
    tau, d1 = infobatch.split_well_learned(score, seen)
    assert tau == 2.0 and d1.tolist() == [True, False, False, False, False]
    plan = infobatch.plan_epoch(score, seen, 1, 10, prune_ratio=0.5)
    assert set(plan.indices.tolist()) == {1, 2, 3, 4} and plan.saved == 1  # k = floor(0.5 * 1) = 0


def test_threshold_accumulates_in_float64():
    # next to 1e7, float32 accumulation would round away the 0.1 terms (spacing 1.0); float64 keeps them
    score = torch.full((1000,), 0.1, dtype=torch.float32)
    score[0] = 1e7
    tau, _ = infobatch.split_well_learned(score, torch.ones(1000, dtype=torch.bool))
    expected = (float(np.float32(1e7)) + 999 * float(np.float32(0.1))) / 1000
    assert tau == pytest.approx(expected, rel=1e-12)


def test_nonfinite_seen_score_raises():
    score, seen = tables([1.0, float("nan"), 2.0])
    with pytest.raises(ValueError, match="finite"):
        infobatch.plan_epoch(score, seen, 1, 10)


def test_without_replacement():
    n1 = 1000
    score = torch.cat([torch.zeros(n1), torch.full((1000,), 10.0)])
    plan = infobatch.plan_epoch(score, torch.ones(2000, dtype=torch.bool), 1, 10, prune_ratio=0.3, seed=7)
    kept = [i for i in plan.indices.tolist() if i < n1]
    assert plan.num_well_learned == n1 and len(kept) == 700 == len(set(kept)) == plan.num_kept_well_learned
    assert len(set(plan.indices.tolist())) == plan.epoch_size == 1700
    assert plan.weights[kept].eq(torch.tensor(1 / 0.7, dtype=torch.float32)).all()


@pytest.mark.parametrize(
    "n, r, k",
    [
        (10, 0.9, 1),
        (100, 0.71, 29),
        (1, 0.5, 0),
        (0, 0.5, 0),
        (7, 0.0, 7),
        (100, 0.57, 43),
        (1000, 0.3, 700),
        (3, 0.1, 2),
    ],
)
def test_exact_keep_count(n, r, k):
    assert infobatch.keep_count(n, r) == k


def test_keep_count_is_exact_where_float_is_not():
    assert math.floor((1 - 0.9) * 10) == 0 and math.floor((1 - 0.9) * 1000) == 99  # the binary-float trap
    assert infobatch.keep_count(10, 0.9) == 1 and infobatch.keep_count(1000, 0.9) == 100


# ------------------------------------------------------------------------------------------------ 7: annealing

DELTAS = [0.01, 0.1, 0.29, 0.3, 0.5, 0.57, 0.7, 0.825, 0.875, 0.9, 0.99, 1.0]


def exact_stop(num_epochs, delta):
    return int((Decimal(str(delta)) * num_epochs).to_integral_value(rounding=ROUND_FLOOR))


@pytest.mark.parametrize("delta", DELTAS)
def test_epoch_stop_exact_grid(delta):
    for e in range(1, 201):
        assert infobatch.epoch_stop(e, delta) == exact_stop(e, delta)


def test_epoch_stop_examples():
    assert infobatch.epoch_stop(8, 0.875) == 7
    assert infobatch.epoch_stop(200, 0.875) == 175
    assert infobatch.epoch_stop(100, 0.57) == 57 and math.floor(0.57 * 100) == 56
    assert infobatch.epoch_stop(100, 0.29) == 29 and math.floor(0.29 * 100) == 28
    assert infobatch.epoch_stop(1000, 0.825) == 825
    assert infobatch.epoch_stop(5, 1) == 5 and infobatch.epoch_stop(3, 0.1) == 0
    assert infobatch.epoch_stop(np.int64(8), np.float32(0.875)) == 7
    assert infobatch.epoch_stop(10, Decimal("0.3")) == 3 and infobatch.epoch_stop(10, Fraction(1, 3)) == 3


@pytest.mark.parametrize("delta", DELTAS)
def test_annealing_grid(delta):
    n = 6
    score, seen = tables([0.1, 0.2, 0.3, 5.0, 6.0, 7.0])  # |D1| = 3, k = 1 at r = 0.5: every prune epoch prunes
    for num_epochs in range(1, 51):
        stop = exact_stop(num_epochs, delta)
        epochs = {0, 1, stop - 1, stop, stop + 1, num_epochs - 1, num_epochs}
        for e in sorted(x for x in epochs if x >= 0):
            if e >= num_epochs:  # past the schedule: no InfoBatch plan; the run's later epochs are full_plan's
                with pytest.raises(ValueError, match=rf"epoch={e} is past the schedule of num_epochs={num_epochs}"):
                    infobatch.plan_epoch(score, seen, e, num_epochs, prune_ratio=0.5, delta=delta, seed=e)
                plan = infobatch.full_plan(n, e, seed=e)
                assert is_full(plan, n) and plan.epoch == e
                continue
            plan = infobatch.plan_epoch(score, seen, e, num_epochs, prune_ratio=0.5, delta=delta, seed=e)
            if e == 0 or e >= stop:
                assert is_full(plan, n), (num_epochs, delta, e)
                assert plan.weights.tolist() == [1.0] * n
            else:
                assert plan.kind == "prune" and plan.saved == 2, (num_epochs, delta, e)
                assert sorted(set(plan.weights.tolist())) == [1.0, 2.0]


# ------------------------------------------------------------------------------------------------ 8, 9: statistics


def test_expected_saving_exponential():
    n = 100_000
    gen = torch.Generator().manual_seed(0)
    score = -torch.log(torch.rand(n, generator=gen))  # exponential(1)
    seen = torch.ones(n, dtype=torch.bool)
    plan = infobatch.plan_epoch(score, seen, 1, 100, prune_ratio=0.5, seed=3)
    assert abs(plan.saved / n - 0.316) < 0.01
    assert abs(infobatch.expected_saving(score, seen, 0.5) - 0.316) < 0.01
    assert abs(plan.saved / n - infobatch.expected_saving(score, seen, 0.5)) <= 1 / n


def test_expected_saving_golden():
    score, seen = tables(GOLDEN)
    assert infobatch.expected_saving(score, seen, 0.5) == 0.5 * 5 / 8
    assert infobatch.expected_saving(score, torch.zeros(8, dtype=torch.bool), 0.5) == 0.0


def test_unbiased_weights():
    # r = 0.3: sd of each mean is sqrt(r / (1 - r) / 2000) = 0.015, so 0.05 is a 3.4-sigma bound (r = 0.5 would be
    # only 2.2 sigma per sample and flaky over 10 samples)
    n, r = 20, 0.3
    score = torch.arange(n, dtype=torch.float32)  # tau = 9.5, D1 = 0..9, k = 7 = 10 * (1 - r) exactly
    seen = torch.ones(n, dtype=torch.bool)
    total = torch.zeros(n, dtype=torch.float64)
    plans = 2000
    for seed in range(plans):
        plan = infobatch.plan_epoch(score, seen, 1, 10, prune_ratio=r, seed=seed)
        visited = torch.zeros(n, dtype=torch.bool)
        visited[plan.indices] = True
        total += plan.weights.double() * visited
    mean = total / plans
    assert (mean[:10] - 1.0).abs().max() < 0.05, mean[:10]
    assert mean[:10].mean().item() == pytest.approx(1.0, abs=1e-6)  # exactly 7 of 10 kept, weight 1 / 0.7
    assert mean[10:].eq(1.0).all()  # D2: always visited with weight 1


# ------------------------------------------------------------------------------------------------ 10: private RNG


def test_private_rng_and_determinism():
    score, seen = tables(GOLDEN * 4)
    np_state, torch_state, py_state = np.random.get_state(), torch.get_rng_state(), random.getstate()
    a = infobatch.plan_epoch(score, seen, 1, 10, seed=1)
    b = infobatch.plan_epoch(score, seen, 1, 10, seed=2)
    full = infobatch.plan_epoch(score, seen, 0, 10, seed=1)
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
    after = np.random.get_state()
    assert after[0] == np_state[0] and np.array_equal(after[1], np_state[1]) and after[2:] == np_state[2:]
    assert not torch.equal(a.indices, b.indices)
    torch.manual_seed(123)
    np.random.seed(123)
    assert infobatch.plan_epoch(score, seen, 1, 10, seed=1) == a  # global seeds are irrelevant
    assert infobatch.plan_epoch(score.clone(), seen.clone(), 1, 10, seed=1) == a
    assert infobatch.plan_epoch(score, seen, 2, 10, seed=1) != a  # the epoch is part of the key
    assert infobatch.plan_epoch(score, seen, 0, 10, seed=1) == full


def test_planning_does_not_touch_inputs():
    score, seen = tables(GOLDEN)
    s0, m0 = score.clone(), seen.clone()
    infobatch.plan_epoch(score, seen, 1, 10)
    assert torch.equal(score, s0) and torch.equal(seen, m0)


def test_hash64_golden_and_generator():
    # pinned values: the seed mix is pure integer arithmetic, identical in every process and platform
    assert infobatch.hash64() == 0
    assert infobatch.hash64(0) == 0xE220A8397B1DCDAF
    assert infobatch.hash64(-1) == infobatch.hash64(2**64 - 1)
    assert len({infobatch.hash64(s, e) for s in range(30) for e in range(30)}) == 900
    g1, g2 = infobatch.plan_generator(5, 3), infobatch.plan_generator(5, 3)
    assert torch.equal(torch.randperm(50, generator=g1), torch.randperm(50, generator=g2))
    with pytest.raises(TypeError):
        infobatch.hash64(1.0)


def test_large_plan_runs():
    n = 1_000_000
    score = torch.rand(n, generator=torch.Generator().manual_seed(0))
    plan = infobatch.plan_epoch(score, torch.ones(n, dtype=torch.bool), 1, 10, prune_ratio=0.5, seed=0)
    assert plan.kind == "prune" and plan.epoch_size + plan.saved == n
    assert plan.saved == plan.num_well_learned - plan.num_kept_well_learned
    assert 0.2 < plan.saved / n < 0.3
    # the large-N path (order drawn in the planning thread, subset by selection) keeps every plan invariant
    assert torch.equal(torch.unique(plan.indices), plan.indices.sort().values)  # each sample at most once
    visited = torch.zeros(n, dtype=torch.bool)
    visited[plan.indices] = True
    well = score < plan.threshold
    assert torch.equal(visited | well, torch.ones(n, dtype=torch.bool))  # D2 always visited
    assert int((visited & well).sum()) == plan.num_kept_well_learned
    assert torch.equal(plan.weights == 2.0, visited & well) and bool(((plan.weights == 1.0) | well).all())
    assert plan == infobatch.plan_epoch(score, torch.ones(n, dtype=torch.bool), 1, 10, prune_ratio=0.5, seed=0)


@pytest.mark.parametrize(("m", "k"), [(10, 3), (70_000, 1), (70_000, 69_999), (70_000, 35_000), (200_003, 123_457)])
def test_uniform_subset_exact_size(m, k):
    g = torch.Generator().manual_seed(m + k)
    for _ in range(3):
        mask = infobatch.uniform_subset(m, k, g)
        assert mask.dtype == torch.bool and mask.shape == (m,) and int(mask.sum()) == k


def test_uniform_subset_is_uniform():
    # selection path (m >= 65536): every position is included with probability k/m, whatever its place
    m, k, draws = 70_000, 21_000, 300
    g = torch.Generator().manual_seed(0)
    count = torch.zeros(m)
    for _ in range(draws):
        count += infobatch.uniform_subset(m, k, g)
    p = k / m
    z = (count / draws - p) / math.sqrt(p * (1 - p) / draws)  # ~ N(0, 1) per position
    assert abs(float(z.mean())) < 0.05 and 0.95 < float(z.std()) < 1.05
    blocks = (count.view(70, 1000).sum(1) / (1000 * draws) - p).abs()  # no drift along the index range
    assert float(blocks.max()) < 6 * math.sqrt(p * (1 - p) / (1000 * draws))


def test_uniform_subset_rejects_bad_sizes():
    for m, k in [(5, 6), (5, -1), (5.0, 2)]:
        with pytest.raises(ValueError, match="0 <= k <= m"):
            infobatch.uniform_subset(m, k, torch.Generator())


# ------------------------------------------------------------------------------------------------ 13, 14: per batch


def test_rescale_equals_weighted_mean_and_backward_through_exp():
    weights = torch.tensor([1.0, 2.0, 1.0, 2.0, 1.0])
    index = torch.tensor([3, 0, 1, 4], dtype=torch.int64)
    x = torch.tensor([0.1, -0.2, 0.3, 0.4], requires_grad=True)
    loss = torch.exp(x)
    before = loss.detach().clone()
    out = infobatch.rescale(loss, index, weights)
    w = weights[index]
    assert out.dim() == 0 and out.dtype == torch.float32
    assert torch.allclose(out, (w * before).mean())
    out.backward()
    assert torch.allclose(x.grad, w * torch.exp(x.detach()) / 4)
    assert torch.equal(loss.detach(), before)  # input not modified
    assert out.item() != pytest.approx(before.mean().item())  # not normalised away


def test_rescale_half_precision_upcasts():
    loss = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    out = infobatch.rescale(loss, torch.tensor([0, 1]), torch.tensor([2.0, 1.0]))
    assert out.dtype == torch.float32 and out.item() == 2.5


@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor(1.0),
        torch.ones(1),
        torch.ones(4, 7),
        torch.ones(3),
        torch.ones(4, dtype=torch.int64),
        [1.0, 2.0, 3.0, 4.0],
    ],
)
def test_rescale_contract_errors(bad):
    with pytest.raises(ValueError, match=r'training_step must return \{"loss": \.\.\., "per_sample_loss"'):
        infobatch.rescale(bad, torch.arange(4), torch.ones(10))


def test_rescale_index_errors():
    loss = torch.ones(3)
    with pytest.raises(TypeError, match="int64"):
        infobatch.rescale(loss, torch.arange(3, dtype=torch.int32), torch.ones(10))
    with pytest.raises(TypeError, match="int64"):
        infobatch.rescale(loss, torch.arange(3).float(), torch.ones(10))
    with pytest.raises(IndexError):
        infobatch.rescale(loss, torch.tensor([0, 1, 10]), torch.ones(10))
    with pytest.raises(IndexError):
        infobatch.rescale(loss, torch.tensor([0, -1, 2]), torch.ones(10))
    with pytest.raises(ValueError, match="weights"):
        infobatch.rescale(loss, torch.arange(3), torch.ones(10, 2))


def test_rescale_index_beyond_float_precision():
    # indices up to 2**40 go through the gather as int64 (a float32 detour would merge 2**40 and 2**40 + 1)
    n = 2**41
    weights = torch.ones(1).expand(n)  # stride-0 view: a huge table without memory
    index = torch.tensor([2**40, 2**40 + 1, n - 1, 0], dtype=torch.int64)
    out = infobatch.rescale(torch.tensor([1.0, 2.0, 3.0, 4.0]), index, weights)
    assert out.item() == 2.5
    assert index.tolist() == [2**40, 2**40 + 1, n - 1, 0]


def test_update_scores_overwrite_and_ema():
    score, seen = torch.zeros(5), torch.zeros(5, dtype=torch.bool)
    infobatch.update_scores(score, seen, torch.tensor([1, 3]), torch.tensor([2.0, 4.0], requires_grad=True))
    assert score.tolist() == [0, 2, 0, 4, 0] and seen.tolist() == [False, True, False, True, False]
    infobatch.update_scores(score, seen, torch.tensor([1]), torch.tensor([6.0]))
    assert score[1] == 6.0  # plain overwrite at m = 1
    infobatch.update_scores(score, seen, torch.tensor([1, 2]), torch.tensor([2.0, 8.0]), momentum=0.25)
    assert score[1] == 0.25 * 2.0 + 0.75 * 6.0  # EMA for a seen sample
    assert score[2] == 8.0  # first observation: overwrite even with m < 1
    assert score.dtype == torch.float32 and not score.requires_grad


def test_update_scores_index_dtype_and_errors():
    score, seen = torch.zeros(5), torch.zeros(5, dtype=torch.bool)
    for bad in (torch.tensor([1, 2], dtype=torch.int32), torch.tensor([1.0, 2.0])):
        with pytest.raises(TypeError, match="int64"):
            infobatch.update_scores(score, seen, bad, torch.ones(2))
    with pytest.raises(ValueError, match="per_sample_loss"):
        infobatch.update_scores(score, seen, torch.tensor([1, 2]), torch.ones(2, 3))
    with pytest.raises(ValueError, match="momentum"):
        infobatch.update_scores(score, seen, torch.tensor([1, 2]), torch.ones(2), momentum=0.0)
    with pytest.raises(IndexError):
        infobatch.update_scores(score, seen, torch.tensor([1, 5]), torch.ones(2))
    with pytest.raises(ValueError, match=r"momentum must be a number in \(0, 1\], got '0.5'"):
        infobatch.update_scores(score, seen, torch.tensor([1, 2]), torch.ones(2), momentum="0.5")
    big = torch.tensor([1.0, 1e39], dtype=torch.float64)  # finite in float64, inf in the float32 table
    with pytest.raises(ValueError, match=r"per_sample_loss\[1\] = 1e\+39 overflows the torch.float32 score table"):
        infobatch.update_scores(score, seen, torch.tensor([1, 2]), big)
    assert not seen.any() and not score.any()  # nothing written by failed calls


def test_accumulate_finalize_matches_all_reduce():
    n = 6
    # two "ranks"; rank 1 holds a padding duplicate of index 0
    bufs = [(torch.zeros(n), torch.zeros(n, dtype=torch.int32)) for _ in range(2)]
    infobatch.accumulate(*bufs[0], torch.tensor([0, 2, 0]), torch.tensor([1.0, 5.0, 3.0]))
    infobatch.accumulate(*bufs[1], torch.tensor([4, 0]), torch.tensor([7.0, 2.0]))
    sum_loss = bufs[0][0] + bufs[1][0]  # what all_reduce(SUM) gives
    count = bufs[0][1] + bufs[1][1]
    assert count.tolist() == [3, 0, 1, 0, 1, 0] and count.dtype == torch.int32
    score = torch.full((n,), 9.0)
    seen = torch.tensor([False, True, False, False, False, False])
    infobatch.finalize(sum_loss, count, score, seen)
    assert score.tolist() == [2.0, 9.0, 5.0, 9.0, 7.0, 9.0]
    assert seen.tolist() == [True, True, True, False, True, False]
    with pytest.raises(TypeError, match="int64"):
        infobatch.accumulate(*bufs[0], torch.tensor([0], dtype=torch.int32), torch.ones(1))


def test_empty_batches_are_no_ops_for_scores_but_not_for_rescale():
    score, seen = torch.zeros(3), torch.zeros(3, dtype=torch.bool)
    sum_loss, count = torch.zeros(3), torch.zeros(3, dtype=torch.int32)
    empty_index, empty_loss = torch.zeros(0, dtype=torch.int64), torch.zeros(0)
    infobatch.update_scores(score, seen, empty_index, empty_loss)
    infobatch.accumulate(sum_loss, count, empty_index, empty_loss)
    assert not seen.any() and not count.any()
    with pytest.raises(ValueError, match="empty"):
        infobatch.rescale(empty_loss, empty_index, torch.ones(3))


def test_finalize_momentum():
    score, seen = torch.tensor([4.0, 0.0]), torch.tensor([True, False])
    infobatch.finalize(torch.tensor([2.0, 6.0]), torch.tensor([1, 2]), score, seen, momentum=0.5)
    assert score.tolist() == [3.0, 3.0] and seen.all()


# ------------------------------------------------------------------------------------------------ plan object


@pytest.mark.parametrize("epoch", [0, 1])
def test_plan_state_round_trip_weights_only(epoch):
    score, seen = tables(GOLDEN)
    plan = infobatch.plan_epoch(score, seen, epoch, 10, prune_ratio=0.5, seed=4)
    buf = io.BytesIO()
    torch.save(plan.to_state(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    restored = EpochPlan.from_state(state)
    assert restored == plan and restored.kind == ("full" if epoch == 0 else "prune")
    assert restored.indices.dtype == torch.int64 and restored.weights.dtype == torch.float32
    state["indices"][0] = 99  # the restored plan owns its tensors
    assert restored == plan


def test_plan_validation():
    good = dict(
        epoch=1,
        indices=torch.tensor([2, 0]),
        weights=torch.tensor([2.0, 1.0, 1.0]),
        kind="prune",
        threshold=1.0,
        num_well_learned=2,
        num_kept_well_learned=1,
        saved=1,
    )
    EpochPlan(**good)
    for change in (
        dict(saved=0),
        dict(indices=torch.tensor([2.0, 0.0])),
        dict(indices=torch.tensor([3, 0])),
        dict(weights=torch.ones(3, dtype=torch.float64)),
        dict(kind="half"),
        dict(epoch=-1),
        dict(num_kept_well_learned=3),
        dict(kind="full"),
    ):
        with pytest.raises(ValueError):
            EpochPlan(**{**good, **change})
    with pytest.raises(dataclasses.FrozenInstanceError):
        EpochPlan(**good).epoch = 2  # frozen


# ------------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(prune_ratio=1.0, delta=0.875), "prune_ratio"),
        (dict(prune_ratio=-0.1, delta=0.875), "prune_ratio"),
        (dict(prune_ratio=float("nan"), delta=0.875), "prune_ratio"),
        (dict(prune_ratio=0.5, delta=0.0), "delta"),
        (dict(prune_ratio=0.5, delta=1.5), "delta"),
        (dict(prune_ratio=0.5, delta=float("inf")), "delta"),
        (dict(prune_ratio=0.5, delta=0.875, num_epochs=0), "num_epochs"),
        (dict(prune_ratio=0.5, delta=0.875, num_epochs=-1), "num_epochs"),
        (dict(prune_ratio=0.5, delta=0.875, num_epochs=2.5), "num_epochs"),
        (dict(prune_ratio=0.5, delta=0.875, num_epochs=True), "num_epochs"),
        (dict(prune_ratio=Decimal("NaN"), delta=0.875), "prune_ratio"),
    ],
)
def test_validate_hparams_errors(kwargs, name):
    with pytest.raises(ValueError, match=name):
        infobatch.validate_hparams(**kwargs)


def test_validate_hparams_warnings_and_no_clamp():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        infobatch.validate_hparams(0.5, 0.875, 200)
        infobatch.validate_hparams(0.9, 0.875)
        infobatch.validate_hparams(0.0, 0.5, None)
    with pytest.warns(UserWarning, match="prune_ratio"):
        infobatch.validate_hparams(0.95, 0.875)
    with pytest.warns(UserWarning, match="annealing"):
        infobatch.validate_hparams(0.5, 1.0)
    # not clamped: r = 0.95 keeps floor(0.05 * 100) = 5 samples with weight 20
    score = torch.cat([torch.zeros(100), torch.ones(100)])
    plan = infobatch.plan_epoch(score, torch.ones(200, dtype=torch.bool), 1, 10, prune_ratio=0.95)
    assert plan.num_kept_well_learned == 5 and plan.weights.max().item() == pytest.approx(20.0)


@pytest.mark.parametrize(
    "kwargs",
    [dict(prune_ratio=1.0), dict(delta=0.0), dict(num_epochs=0), dict(epoch=-1), dict(seed=1.5), dict(epoch=1.0)],
)
def test_plan_epoch_rejects_bad_arguments(kwargs):
    score, seen = tables(GOLDEN)
    args = dict(score=score, seen=seen, epoch=1, num_epochs=10, prune_ratio=0.5, delta=0.875, seed=0)
    with pytest.raises(ValueError):
        infobatch.plan_epoch(**{**args, **kwargs})


@pytest.mark.parametrize("epoch, num_epochs", [(9, 4), (4, 4), (10, 10)])
def test_an_epoch_past_the_schedule_is_refused_naming_epoch_and_num_epochs(epoch, num_epochs):
    """The campaign's ``functional.infobatch.plan_epoch.epoch_beyond``: epochs are 0-based in ``[0, num_epochs)``;
    a later one (a wrong ``num_epochs``, or a 1-based epoch) is an error, not a silent full epoch."""
    score, seen = tables(GOLDEN)
    with pytest.raises(
        ValueError,
        match=rf"epoch={epoch} is past the schedule of num_epochs={num_epochs}: epoch must be an int in "
        rf"\[0, {num_epochs}\)",
    ):
        infobatch.plan_epoch(score, seen, epoch, num_epochs)
    # the last epoch of the schedule is planned (full: epochs >= floor(delta * E) anneal)
    assert is_full(infobatch.plan_epoch(score, seen, num_epochs - 1, num_epochs), len(GOLDEN))


def test_full_plan_is_plan_epochs_full_epoch():
    score, seen = tables(GOLDEN)
    n = len(GOLDEN)
    for epoch, num_epochs in ((0, 10), (9, 10), (5, 6)):  # epoch 0 and annealing epochs (floor(0.875 E) <= e)
        assert infobatch.plan_epoch(score, seen, epoch, num_epochs, seed=3) == infobatch.full_plan(n, epoch, seed=3)
    plan = infobatch.full_plan(n, 12, seed=3)  # an epoch after the schedule: full, keyed by (seed, epoch)
    assert is_full(plan, n) and plan.epoch == 12 and plan != infobatch.full_plan(n, 13, seed=3)
    for bad in (dict(dataset_size=0), dict(epoch=-1), dict(seed=1.5), dict(epoch=2.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            infobatch.full_plan(**{"dataset_size": n, "epoch": 1, "seed": 0, **bad})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_loss_never_becomes_a_score(bad):
    """The campaign's ``functional.infobatch.update_scores.loss_nan``: refused, naming the per-sample loss and the
    position, with the tables untouched (also by :func:`accumulate`, the per-epoch path)."""
    score, seen = tables([0.5, 0.5, 0.5, 0.5], seen=[False] * 4)
    index, loss = torch.tensor([0, 2]), torch.tensor([1.0, bad])
    with pytest.raises(
        ValueError,
        match=rf"update_scores: per_sample_loss has 1 non-finite value\(s\) \(the first, at "
        rf"position 1, is {bad}\)",
    ):
        infobatch.update_scores(score, seen, index, loss)
    assert score.tolist() == [0.5] * 4 and seen.tolist() == [False] * 4
    sum_loss, count = torch.zeros(4), torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"accumulate: per_sample_loss has 1 non-finite value"):
        infobatch.accumulate(sum_loss, count, index, loss)
    assert sum_loss.tolist() == [0.0] * 4 and count.tolist() == [0] * 4
    # the finite part, filtered as the callback filters, is scored
    keep = torch.isfinite(loss)
    infobatch.update_scores(score, seen, index[keep], loss[keep])
    assert score.tolist() == [1.0, 0.5, 0.5, 0.5] and seen.tolist() == [True, False, False, False]


def test_plan_epoch_rejects_bad_tables():
    with pytest.raises(ValueError, match="seen"):
        infobatch.plan_epoch(torch.zeros(3), torch.ones(4, dtype=torch.bool), 1, 10)
    with pytest.raises(ValueError, match="score"):
        infobatch.plan_epoch(torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.bool), 1, 10)
    with pytest.raises(ValueError, match="empty"):
        infobatch.plan_epoch(torch.zeros(0), torch.ones(0, dtype=torch.bool), 1, 10)


PURE_CORE = ("lightning_effi.core.checks", "lightning_effi.core.rng")


def test_module_imports_no_lightning():
    source = Path(infobatch.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            # the functional core may use the pure core helpers (seeds, argument checks), nothing else of ours
            imported.add("<pure core>" if module in PURE_CORE else module.split(".")[0])
    stdlib = {
        "__future__",
        "math",
        "warnings",
        "dataclasses",
        "decimal",
        "fractions",
        "numbers",
        "typing",
        "concurrent",
        "collections",
    }
    assert imported <= stdlib | {"torch", "<pure core>"}
    for name in PURE_CORE:  # and those helpers import the standard library only
        tree = ast.parse(Path(importlib.import_module(name).__file__).read_text())
        modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert {m.split(".")[0] for m in modules} <= stdlib, (name, modules)


# ------------------------------------------------------------------------------------------ the fewest steps of a run


def test_min_epoch_size_is_reached_by_a_plan():
    """A prune epoch visits ``N - |D1| + floor((1 - r)|D1|)`` samples, fewest at ``|D1| = N - 1`` (one sample above
    the mean): ``1 + floor((1 - r)(N - 1))``; N = 10, r = 0.15 gives 8 (``ceil((1 - r) N)`` would say 9)."""
    assert infobatch.min_epoch_size(1, 4, 10, 0.15, 0.75) == 1 + math.floor(0.85 * 9) == 8
    assert infobatch.min_epoch_size(0, 4, 10, 0.15, 0.75) == infobatch.min_epoch_size(3, 4, 10, 0.15, 0.75) == 10
    for n, r in ((10, 0.15), (40, 0.5), (7, 0.3), (1, 0.5), (25, 0.0)):
        score, seen = tables([0.0] * (n - 1) + [1.0])  # N - 1 samples below the mean
        plan = infobatch.plan_epoch(score, seen, 1, 4, r, 0.75, seed=3)
        assert plan.epoch_size == infobatch.min_epoch_size(1, 4, n, r, 0.75)
        g = torch.Generator().manual_seed(n)
        for _ in range(20):  # any other table keeps at least as many
            score, seen = torch.rand(n, generator=g), torch.rand(n, generator=g) < 0.8
            plan = infobatch.plan_epoch(score, seen, 1, 4, r, 0.75, seed=3)
            assert plan.epoch_size >= infobatch.min_epoch_size(1, 4, n, r, 0.75)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # N = 40, E = 4, delta = 0.75: epochs 0 and 3 full (40 samples), 1 and 2 keep >= 1 + floor(0.5 * 39) = 20
        (dict(), 5 + 3 + 3 + 5),  # batches of 8: ceil(40 / 8), ceil(20 / 8)
        (dict(accumulate_grad_batches=2), 3 + 2 + 2 + 3),  # ceil(5 / 2), ceil(3 / 2)
        (dict(limit_batches=4), 4 + 3 + 3 + 4),  # an int caps the batches
        (dict(limit_batches=0.5), 2 + 1 + 1 + 2),  # a float scales them: int(5 * 0.5), int(3 * 0.5)
        (dict(world_size=2), 3 + 2 + 2 + 3),  # per rank: ceil(40 / 2) = 20 -> 3 batches, ceil(20 / 2) = 10 -> 2
        (dict(world_size=3, drop_last=True), 1 + 0 + 0 + 1),  # floor(40 / 3) = 13 -> 1, floor(20 / 3) = 6 -> 0
        (dict(world_size=3), 2 + 1 + 1 + 2),  # padded: ceil(40 / 3) = 14 -> 2, ceil(20 / 3) = 7 -> 1
    ],
)
def test_min_total_steps_by_hand(kwargs, expected):
    assert infobatch.min_total_steps(40, 4, 0.5, 0.75, 8, **kwargs) == expected


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        # N = 40, E = 4, delta = 0.75: epochs 1 and 2 keep >= 1 + floor(0.5 * 39) = 20 samples
        ((40, 4, 0.5, 0.75, 8), dict(), 3),  # ceil(20 / 8)
        ((40, 4, 0.5, 0.75, 8), dict(world_size=2), 2),  # ceil(20 / 2) = 10 per rank -> 2
        ((40, 4, 0.5, 0.75, 8), dict(world_size=3, drop_last=True), 0),  # floor(20 / 3) = 6 -> 0
        ((40, 4, 0.5, 0.75, 8), dict(limit_batches=2), 2),  # an int caps every epoch
        ((40, 4, 0.5, 0.75, 8), dict(limit_batches=0.5), 1),  # int(3 * 0.5)
        ((40, 4, 0.9, 0.75, 8), dict(), 1),  # 1 + floor(0.1 * 39) = 4 samples
        ((40, 4, 0.0, 0.75, 8), dict(), 5),  # nothing pruned: every epoch has 40
        ((40, 2, 0.5, 0.5, 8), dict(), 5),  # floor(0.5 * 2) = 1: epoch 1 anneals, no prune epoch
    ],
)
def test_fewest_epoch_batches_by_hand(args, kwargs, expected):
    assert infobatch.fewest_epoch_batches(*args, **kwargs) == expected


def test_rank_batches_and_limits():
    assert infobatch.rank_batches(41, 5, world_size=2) == 5  # 21 per rank (one padded duplicate)
    assert infobatch.rank_batches(41, 5, world_size=2, drop_last=True) == 4  # 20 per rank, 4 full batches
    assert infobatch.rank_batches(0, 5) == 0
    assert infobatch.limited_batches(5, 3) == 3 and infobatch.limited_batches(5, 1.0) == 5
    assert infobatch.limited_batches(5, 0.3) == 1 and infobatch.limited_batches(2, 10) == 2
    for bad in (dict(limit_batches=-1), dict(limit_batches=True), dict(batch_size=0), dict(world_size=0)):
        with pytest.raises(ValueError, match="|".join(bad)):
            infobatch.rank_batches(**{"epoch_size": 10, "batch_size": 2, **bad})
    with pytest.raises(ValueError, match=r"epoch must be an int in \[0, 4\)"):
        infobatch.min_epoch_size(4, 4, 10, 0.5, 0.75)
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        infobatch.min_total_steps(10, 4, 0.5, 0.75, 2, accumulate_grad_batches=0)


def test_finite_losses_disagree_reads_the_mean_against_the_loss_within_the_tolerance():
    """``mean(l)`` vs the loss: within ``1e-6 + 1e-4 |loss|`` (float32) they agree; beyond, they disagree; a
    non-finite side is never a disagreement (the non-finite policy's business)."""
    per_sample = torch.tensor([1.0, 2.0, 3.0])
    assert not infobatch.finite_losses_disagree(per_sample, torch.tensor(2.0))
    assert not infobatch.finite_losses_disagree(per_sample, torch.tensor(2.0 + 1e-4))  # 1e-4 <= 1e-6 + 2e-4
    assert infobatch.finite_losses_disagree(per_sample, torch.tensor(2.001))
    assert not infobatch.finite_losses_disagree(torch.tensor([1.0, float("nan")]), torch.tensor(5.0))
    assert not infobatch.finite_losses_disagree(per_sample, torch.tensor(float("inf")))


def test_token_table_records_merges_and_gives_the_ratio_by_hand():
    """Each sample's tokens when it last trained (a duplicate seen twice in one epoch is averaged), unknown ones
    (-1) left out; the ratio is the training set's mean over the trained samples' mean."""
    table, pending = torch.full((5,), -1.0, dtype=torch.float64), torch.zeros(2, 5, dtype=torch.float64)
    infobatch.record_tokens(pending, torch.tensor([0, 1, 2]), torch.tensor([4, 10, 6]))
    infobatch.record_tokens(pending, torch.tensor([2, 3]), torch.tensor([8, 2]))  # sample 2 twice: 6 and 8
    infobatch.merge_tokens(table, pending)
    assert table.tolist() == [4.0, 10.0, 7.0, 2.0, -1.0]
    pending.zero_()
    infobatch.record_tokens(pending, torch.tensor([1]), torch.tensor([12]))  # only what trained changes
    infobatch.merge_tokens(table, pending)
    assert table.tolist() == [4.0, 12.0, 7.0, 2.0, -1.0]
    # mean of the known (25 / 4) over the mean of the trained ones: samples 0 and 3 (3 tokens)
    assert infobatch.token_ratio(table, torch.tensor([0, 3, 4])) == pytest.approx(25 / 4 / 3)
    assert infobatch.token_ratio(table, torch.tensor([4])) is None  # none of them known
    assert infobatch.token_ratio(torch.full((3,), -1.0, dtype=torch.float64), torch.tensor([0])) is None
    assert infobatch.token_ratio(torch.zeros(3, dtype=torch.float64), torch.tensor([0])) is None  # 0 tokens
    with pytest.raises(ValueError, match=r"index holds positions outside \[0, 5\)"):
        infobatch.record_tokens(pending, torch.tensor([5]), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"tokens must be a tensor of shape \(2,\)"):
        infobatch.record_tokens(pending, torch.tensor([0, 1]), torch.tensor([1]))
    with pytest.raises(TypeError, match="int64"):
        infobatch.record_tokens(pending, torch.tensor([0], dtype=torch.int32), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"pending must be a float tensor \[2, N\]"):
        infobatch.record_tokens(torch.zeros(5), torch.tensor([0]), torch.tensor([1]))
