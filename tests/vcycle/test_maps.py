"""Width/depth partitions and map identities: coalescing after de-coalescing returns the original, per adapter."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_effi.functional import vcycle as V
from lightning_effi.vcycle.operators import _mean_list


def random_partition(n: int, sizes: list[int], seed: int) -> list[list[int]]:
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    out, i = [], 0
    for s in sizes:
        out.append(idx[i : i + s])
        i += s
    assert i == n
    return out


PARTITIONS = [random_partition(12, [2] * 6, s) for s in range(3)] + [
    random_partition(12, [3, 2, 1, 3, 2, 1], s) for s in range(3)
]


@pytest.mark.parametrize("groups", PARTITIONS)
def test_matrix_identities_exact(groups):
    m = V.width_groups(12, groups)
    F, S, T, H = m.matrices(torch.float64)
    eye = torch.eye(m.small, dtype=torch.float64)
    assert torch.equal(F @ T, eye) and torch.equal(H @ S, eye) and torch.equal(H @ T, eye)
    for i, g in enumerate(groups):
        assert torch.equal(F[i, g], torch.full((len(g),), 1.0 / len(g), dtype=torch.float64))
        assert F[i].count_nonzero() == len(g) and torch.equal(H[i], F[i])
        assert torch.equal(S[:, i], T[:, i]) and S[g, i].eq(1).all() and S[:, i].sum() == len(g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups", PARTITIONS[:1] + PARTITIONS[3:4])
def test_tensor_ops_match_matrices_and_round_trip_exactly(groups, dtype):
    m = V.width_groups(12, groups)
    g = torch.Generator().manual_seed(0)
    small = torch.randn(5, m.small, 7, generator=g, dtype=torch.float64).to(dtype)
    large = torch.randn(5, 12, 7, generator=g, dtype=torch.float64).to(dtype)
    # exact round trips along dim 1: F∘T = I, S∘H = I (bit for bit, groups of 3 included)
    assert torch.equal(m.average(m.copy(small, 1), 1), small)
    assert torch.equal(m.sum(m.split(small, 1), 1), small)
    # against the dense matrices (float64 reference)
    F, S, T, H = m.matrices(torch.float64)
    ref = lambda M, x: torch.einsum("ij,bjk->bik", M, x.double())  # noqa: E731
    tol = dict(atol=1e-2, rtol=1e-2) if dtype in (torch.bfloat16, torch.float16) else dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(m.average(large, 1).double(), ref(F, large), **tol)
    torch.testing.assert_close(m.sum(large, 1).double(), ref(S.T, large), **tol)
    torch.testing.assert_close(m.copy(small, 1).double(), ref(T, small), **tol)
    torch.testing.assert_close(m.split(small, 1).double(), ref(H.T, small), **tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_average_of_16_bit_floats_near_their_largest_value_does_not_overflow(dtype):
    big = torch.finfo(dtype).max
    x = torch.tensor([[big, big, -big, big * 0.5, big, big, big]], dtype=dtype)
    # pairs (0, 1), (2, 3) and a group of three (4, 5, 6): the sums overflow in the 16-bit dtype itself
    m = V.width_groups(7, [[0, 1], [2, 3], [4, 5, 6]])
    out = m.average(x, 1)
    assert out.dtype == dtype and torch.isfinite(out).all()
    expect = torch.stack([x[0, :2].double().mean(), x[0, 2:4].double().mean(), x[0, 4:].double().mean()])
    assert torch.equal(out[0], expect.to(dtype))
    # depth averaging of two layers at the largest value
    a = torch.full((3,), big, dtype=dtype)
    assert torch.equal(_mean_list([a, a]), a)


def test_split_pairs_is_exact_half_and_last_member_takes_remainder():
    pairs = V.width_groups(4, "half")
    x = torch.randn(3, 2)
    assert torch.equal(pairs.split(x, 1), torch.cat([x / 2, x / 2], 1))
    triple = V.width_groups(3, [[0, 1, 2]])
    w = torch.tensor([[1.0], [0.1], [-7.3]])
    out = triple.split(w, 1)
    assert torch.equal(out[:, 0], w[:, 0] / 3) and torch.equal(out[:, 1], w[:, 0] / 3)
    assert torch.equal(out[:, 2], w[:, 0] - (w[:, 0] / 3 + w[:, 0] / 3))
    assert (out[:, 2] - w[:, 0] / 3).abs().max() < 1e-6


def test_half_scheme_pairs_j_with_j_plus_half_at_unit_granularity():
    assert V.width_groups(8, "half").groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    # 4 heads of size 2: head h <-> h + 2, element-wise inside the head
    assert V.width_groups(8, "half", unit=2).groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert V.width_groups(12, "half", unit=2).groups == ((0, 6), (1, 7), (2, 8), (3, 9), (4, 10), (5, 11))
    assert V.width_groups(6, [[2, 0], [1]], unit=2).groups == ((4, 0), (5, 1), (2,), (3,))


def test_concat_offsets_groups():
    a, b = V.width_groups(4, "half"), V.width_groups(2, [[0, 1]])
    c = V.WidthMap.concat(a, a, b)
    assert c.large == 10 and c.small == 5
    assert c.groups == ((0, 2), (1, 3), (4, 6), (5, 7), (8, 9))


def test_transformer_width_maps_half_and_explicit():
    m = V.transformer_width_maps(32, 4, 64, "half")
    assert (m.hidden.small, m.qk.small, m.ffn.small, m.small_heads) == (16, 16, 32, 2)
    assert m.hidden.groups[0] == (0, 16) and m.qk.groups[0] == (0, 16) and m.ffn.groups[0] == (0, 32)
    assert m.qkv.large == 96 and m.qkv.groups[16] == (32, 48)
    e = V.transformer_width_maps(32, 4, 64, [[0, 1, 2], [3]])
    assert (e.hidden.small, e.ffn.small, e.small_heads) == (16, 32, 2)
    assert e.qk.groups[0] == (0, 8, 16) and e.qk.groups[8] == (24,)
    assert e.ffn.groups[0] == (0, 16, 32) and e.ffn.groups[16] == (48,)
    ident = V.transformer_width_maps(32, 4, 64, None)
    assert ident.hidden.is_identity and ident.ffn.is_identity and ident.small_heads == 4


def test_depth_groups():
    assert V.depth_groups(6, "adjacent") == ((0, 1), (2, 3), (4, 5))
    assert V.depth_groups(6, "half") == ((0, 3), (1, 4), (2, 5))
    assert V.depth_groups(5, [[0, 1], [2, 3, 4]]) == ((0, 1), (2, 3, 4))


def test_convention_scale_is_power_of_two():
    assert V.convention_scale(V.width_groups(8, "half")) == 2.0
    assert V.convention_scale(V.WidthMap.identity(8)) == 1.0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: V.width_groups(7, "half", name="n_embd"), r"n_embd: width scheme 'half' needs an even size, got 7"),
        (lambda: V.width_groups(12, "half", unit=4, name="n_head"), r"n_head: .*3 units of 4"),
        (lambda: V.width_groups(8, "quarter"), r"unknown width scheme 'quarter'"),
        (lambda: V.width_groups(4, [[0, 1], [1, 2], [3]]), r"partition.*duplicated \[1\], missing \[\]"),
        (lambda: V.width_groups(4, [[0, 1], [2]]), r"missing \[3\]"),
        (lambda: V.width_groups(4, [[0, 1, 2, 3], []]), r"non-empty"),
        (lambda: V.width_groups(4, [[0, 4], [1, 2], [3]]), r"out of range \[4\]"),
        (lambda: V.width_groups(4, [[0, 1.5], [2, 3]]), r"integers"),
        (lambda: V.width_groups(10, "half", unit=4), r"not a positive multiple of the unit 4"),
        (lambda: V.depth_groups(5, "adjacent", name="n_layer"), r"n_layer: depth scheme 'adjacent' needs an even"),
        (lambda: V.depth_groups(5, "half", name="depth"), r"depth: depth scheme 'half' needs an even"),
        (lambda: V.depth_groups(4, "interleave"), r"unknown depth scheme"),
        (
            lambda: V.depth_groups(4, [[0, 1], [1, 2, 3]], name="n_layer"),
            r"depth_scheme \(n_layer=4\).*duplicated \[1\]",
        ),
        (
            lambda: V.transformer_width_maps(24, 3, 96, "half", names=("n_embd", "n_head", "n_inner")),
            r"n_head=3 cannot be halved",
        ),
        (
            lambda: V.transformer_width_maps(32, 4, 63, "half", names=("n_embd", "n_head", "n_inner")),
            r"n_inner: width scheme 'half' needs an even size, got 63",
        ),
        (
            lambda: V.transformer_width_maps(32, 4, 66, [[0, 1], [2, 3]], names=("n_embd", "n_head", "n_inner")),
            r"n_inner=66 is not divisible by n_head=4",
        ),
        (
            lambda: V.transformer_width_maps(30, 4, 64, "half", names=("n_embd", "n_head", "n_inner")),
            r"n_embd=30 is not divisible by n_head=4",
        ),
        (lambda: V.transformer_width_maps(32, 4, 64, [[0, 1], [2]]), r"width_scheme.*missing \[3\]"),
    ],
)
def test_partition_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
