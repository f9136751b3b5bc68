"""``InfoBatchSampler`` (``lightning_effi.infobatch.sampler``, without processes): pure iteration, exact lengths,
sharding, padding, resume offset, int64 indices."""

import copy
import math
import pickle

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_effi.functional import infobatch
from lightning_effi.infobatch.functional import EpochPlan
from lightning_effi.infobatch.sampler import InfoBatchSampler


def prune_plan(n=100, seed=0, epoch=1):
    score = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    plan = infobatch.plan_epoch(score, torch.ones(n, dtype=torch.bool), epoch, 10, prune_ratio=0.5, seed=seed)
    assert plan.kind == "prune" and plan.epoch_size < n
    return plan


def plan_of(indices, n=None, epoch=1):
    indices = torch.as_tensor(indices, dtype=torch.int64)
    n = int(indices.max()) + 1 if n is None else n
    return EpochPlan(
        epoch=epoch,
        indices=indices,
        weights=torch.ones(1).expand(n),
        kind="prune",
        threshold=0.0,
        num_well_learned=0,
        num_kept_well_learned=0,
        saved=n - indices.numel(),
    )


def test_is_a_distributed_sampler_with_plan_epoch():
    s = InfoBatchSampler(prune_plan(epoch=3))
    assert isinstance(s, DistributedSampler) and s.epoch == 3 and s.padded == 0 and s.dropped == 0
    assert list(s) == s.plan.indices.tolist() and all(type(i) is int for i in s)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_purity_and_idempotence(world, drop_last):
    plan = prune_plan()
    before = plan.to_state()
    samplers = [InfoBatchSampler(plan, world, r, drop_last) for r in range(world)]
    for s in samplers:
        state = {k: v for k, v in vars(s).items() if not isinstance(v, torch.Tensor)}
        first, second = list(iter(s)), list(iter(s))
        assert first == second and len(first) == len(s)
        assert {k: v for k, v in vars(s).items() if not isinstance(v, torch.Tensor)} == state
    assert EpochPlan.from_state(before) == plan  # iteration never touches the plan


@pytest.mark.parametrize("drop_last", [False, True])
def test_dataloader_batch_counts(drop_last):
    n = 100
    plan = prune_plan(n)
    length = plan.epoch_size
    assert length % 10  # a partial last batch exists
    snapshot = plan.to_state()
    ds = TensorDataset(torch.arange(n))
    sampler = InfoBatchSampler(plan)
    loader = DataLoader(ds, batch_size=10, sampler=sampler, drop_last=drop_last)
    expected = length // 10 if drop_last else math.ceil(length / 10)
    assert len(loader) == expected
    for _ in range(2):  # a second epoch pass over the same loader gives the same batches
        batches = [b[0] for b in loader]
        assert len(batches) == expected
        seen = torch.cat(batches).tolist()
        assert seen == plan.indices.tolist()[: len(seen)]
    assert EpochPlan.from_state(snapshot) == plan


@pytest.mark.parametrize("length", [1, 2, 5, 7, 10, 11, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_sharding_padding_and_truncation(length, world):
    plan = plan_of(torch.randperm(200, generator=torch.Generator().manual_seed(length))[:length], n=200)
    order = plan.indices.tolist()
    # pad: every rank gets ceil(L / W); the union is the plan plus its head repeated (cyclically)
    shards = [list(InfoBatchSampler(plan, world, r)) for r in range(world)]
    per_rank = math.ceil(length / world)
    assert all(len(s) == per_rank == len(InfoBatchSampler(plan, world, r)) for r, s in enumerate(shards))
    padded = InfoBatchSampler(plan, world, 0).padded
    assert padded == per_rank * world - length
    stream = [shards[p % world][p // world] for p in range(per_rank * world)]  # interleave ranks back
    assert stream == (order * (1 + padded // length + 1))[: length + padded]
    assert sorted(sum(shards, [])) == sorted(order + stream[length:])
    # drop_last: floor(L / W) per rank, the union is the plan's head, disjoint
    shards = [list(InfoBatchSampler(plan, world, r, drop_last=True)) for r in range(world)]
    per_rank = length // world
    assert all(len(s) == per_rank for s in shards)
    union = sum(shards, [])
    assert len(set(union)) == len(union) and sorted(union) == sorted(order[: per_rank * world])
    assert InfoBatchSampler(plan, world, 0, drop_last=True).dropped == length - per_rank * world


def test_two_rank_shards_are_disjoint_when_divisible():
    plan = prune_plan(101)
    if plan.epoch_size % 2:
        plan = plan_of(plan.indices[:-1], n=101)
    a, b = list(InfoBatchSampler(plan, 2, 0)), list(InfoBatchSampler(plan, 2, 1))
    assert not set(a) & set(b) and sorted(a + b) == sorted(plan.indices.tolist())


@pytest.mark.parametrize("drop_last", [False, True])
def test_start_skips_but_len_stays_full(drop_last):
    plan = prune_plan()
    full = InfoBatchSampler(plan, 2, 1, drop_last)
    resumed = InfoBatchSampler(plan, 2, 1, drop_last, start=20)
    assert len(resumed) == len(full)
    assert list(resumed) == list(full)[20:]
    assert list(InfoBatchSampler(plan, 2, 1, drop_last, start=len(full))) == []
    for bad in (-1, len(full) + 1, 1.5):
        with pytest.raises(ValueError, match="start"):
            InfoBatchSampler(plan, 2, 1, drop_last, start=bad)
    resumed.start = 10**6  # set later by a loader: checked at iteration
    with pytest.raises(ValueError, match="start"):
        iter(resumed)


def test_set_epoch_checks_the_plan():
    s = InfoBatchSampler(prune_plan(epoch=4))
    s.set_epoch(4)
    assert s.epoch == 4
    with pytest.raises(ValueError, match="epoch 4"):
        s.set_epoch(5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_replicas=0),
        dict(num_replicas=2, rank=2),
        dict(rank=-1),
        dict(num_replicas=2.0),
        dict(num_replicas=True),
        dict(rank=0.0),
    ],
)
def test_rejects_bad_world(kwargs):
    with pytest.raises(ValueError):
        InfoBatchSampler(prune_plan(), **kwargs)


def test_rejects_non_plan():
    with pytest.raises(TypeError):
        InfoBatchSampler(torch.arange(10))


def test_indices_beyond_float_precision():
    big = [2**40, 2**40 + 1, 2**40 + 3, 5]
    plan = plan_of(big, n=2**41)
    assert list(InfoBatchSampler(plan)) == big
    assert list(InfoBatchSampler(plan, 2, 1)) == [2**40 + 1, 5]


def test_sampler_copies_the_plan_indices_and_pickles():
    plan = prune_plan()
    s = InfoBatchSampler(plan)
    expected = list(s)
    plan.indices[0] = plan.indices[1]  # an outside mutation must not change the sampler's stream
    assert list(s) == expected
    assert list(pickle.loads(pickle.dumps(s))) == expected and list(copy.deepcopy(s)) == expected
