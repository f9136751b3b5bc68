"""random-LTD functional core without a Trainer: schedule golden values, token selection, gather/scatter, masks,
layer-token accounting."""

from __future__ import annotations

import ast
import importlib
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_effi.functional import random_ltd as F

# ------------------------------------------------------------------------------------------------ schedule golden

GOLDEN = [
    # (min, max, require, q), {step: deepspeed value}, {step: clamped value where it differs}
    ((32, 197, 3910, 8), {0: 32, 1955: 112, 3909: 192, 3910: 192, 3980: 192, 4000: 197}, {3910: 197, 3980: 197}),
    ((128, 2048, 200000, 16), {0: 128, 100000: 1088, 199999: 2032, 200000: 2048}, {}),
    ((128, 1024, 400, 8), {0: 128, 200: 576, 400: 1024}, {}),
    ((3, 10, 7, 2), dict(enumerate([2, 4, 4, 6, 6, 8, 8, 10, 10, 10])), {0: 3}),
]


@pytest.mark.parametrize(("cfg", "deepspeed", "clamped_diff"), GOLDEN)
def test_schedule_golden(cfg, deepspeed, clamped_diff):
    for step, value in deepspeed.items():
        assert F.ltd_value(step, *cfg, rounding="deepspeed") == value
        assert F.ltd_value(step, *cfg, rounding="clamped") == clamped_diff.get(step, value)


@pytest.mark.parametrize(
    ("step", "cfg", "deepspeed", "exact"),
    [
        (226, (173, 773, 400, 1), 511, 512),
        (17, (44, 1552, 29, 8), 920, 928),
        (17, (107, 1528, 29, 1), 939, 940),
        (2254, (137, 1497, 3910, 1), 920, 921),
    ],
)
def test_deepspeed_rounding_is_deepspeeds_float_arithmetic(step, cfg, deepspeed, exact):
    """DeepSpeed's scheduler computes ``floor(float(step) / require_steps * (max - min) + min)`` in float64; where the
    exact product is an integer the float lands just below it (qa35-user 06, values of its float64 formula). The
    clamped mode keeps the exact product."""
    assert F.ltd_value(step, *cfg, rounding="deepspeed") == deepspeed
    assert F.ltd_value(step, *cfg, rounding="clamped") == exact


def test_schedule_is_monotonic_and_bounded():
    for cfg in [(32, 197, 3910, 8), (3, 10, 7, 2), (5, 5, 3, 4), (1, 64, 10, 16)]:
        values = [F.ltd_value(s, *cfg) for s in range(cfg[2] + 20)]
        assert values == sorted(values)
        assert min(values) >= cfg[0] and max(values) == cfg[1] == values[-1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(min_value=0), "min_value"),
        (dict(min_value=10, max_value=5), "min_value .* <= max_value"),
        (dict(require_steps=0), "require_steps"),
        (dict(seq_per_step=0), "seq_per_step"),
        (dict(rounding="floor"), "rounding"),
        (dict(min_value=2.0), "min_value"),
    ],
)
def test_schedule_rejects_bad_values(kwargs, match):
    cfg = dict(min_value=2, max_value=8, require_steps=4, seq_per_step=2) | kwargs
    rounding = cfg.pop("rounding", "clamped")
    with pytest.raises(ValueError, match=match):
        F.ltd_value(0, **cfg, rounding=rounding)
    with pytest.raises(ValueError, match="step"):
        F.ltd_value(-1, 2, 8, 4, 2)


# ------------------------------------------------------------------------------------------------ selection


def test_index_shape_order_and_independence():
    g = torch.Generator().manual_seed(0)
    idx = F.sample_token_indices(3, 5, 16, 6, g)
    assert idx.dtype == torch.int64 and idx.shape == (3, 5, 6)
    assert bool((idx[..., 1:] > idx[..., :-1]).all()) and int(idx.min()) >= 0 and int(idx.max()) < 16
    rows = {tuple(r.tolist()) for r in idx.reshape(15, 6)}
    assert len(rows) > 10  # rows differ across layers and samples
    same = F.sample_token_indices(3, 5, 16, 6, torch.Generator().manual_seed(0))
    assert torch.equal(idx, same)


def test_uniform_over_subsets():
    draws = F.sample_token_indices(1, 20000, 10, 3, torch.Generator().manual_seed(1))[0]
    counts = torch.bincount(draws.flatten(), minlength=10).double() / 20000
    assert bool(((counts - 0.3).abs() < 0.015).all())
    subsets = list(itertools.combinations(range(10), 3))
    code = {s: i for i, s in enumerate(subsets)}
    observed = np.bincount([code[tuple(r)] for r in draws.tolist()], minlength=len(subsets))
    expected = 20000 / len(subsets)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    # p > 0.001 for 119 degrees of freedom  <=>  chi2 < 173.6 (scipy.stats.chi2.ppf(0.999, 119))
    assert chi2 < 173.6, chi2


def test_keep_prefix_tokens():
    idx = F.sample_token_indices(2, 4000, 10, 4, torch.Generator().manual_seed(2), keep_prefix_tokens=1)
    assert bool((idx[..., 0] == 0).all()) and bool((idx[..., 1:] >= 1).all())
    counts = torch.bincount(idx[..., 1:].flatten(), minlength=10)[1:].double() / (2 * 4000)
    assert bool(((counts - 3 / 9).abs() < 0.02).all())


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((1, 2, 8, 9), "larger than the sequence"),
        ((1, 2, 8, 1, None, 2), "keep_prefix_tokens"),
        ((1, -1, 8, 4), "batch_size"),
        ((1, 2, 8.0, 4), "seq_len"),
    ],
)
def test_index_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        F.sample_token_indices(*args)


def test_private_generator_leaves_global_rng_alone():
    state = torch.get_rng_state()
    F.sample_token_indices(2, 3, 8, 4, torch.Generator().manual_seed(0))
    assert torch.equal(state, torch.get_rng_state())


# ------------------------------------------------------------------------------------------------ gather/scatter


def test_identity_layer_returns_input_exactly():
    x = torch.randn(3, 12, 5)
    idx = F.sample_token_indices(1, 3, 12, 7, torch.Generator().manual_seed(0))[0]
    assert torch.equal(F.scatter_tokens(x, idx, F.gather_tokens(x, idx)), x)
    full = torch.arange(12).expand(3, 12).contiguous()
    y = torch.randn(3, 12, 5)
    assert torch.equal(F.scatter_tokens(x, full, y), y)  # r = S replaces everything


def test_gather_scatter_semantics_and_seq_batch_order():
    x = torch.randn(2, 6, 3)
    idx = torch.tensor([[0, 2, 5], [1, 3, 4]])
    part = F.gather_tokens(x, idx)
    assert torch.equal(part[1, 2], x[1, 4])
    out = F.scatter_tokens(x, idx, part * 2)
    assert torch.equal(out[0, 2], 2 * x[0, 2]) and torch.equal(out[0, 1], x[0, 1])
    xs = x.transpose(0, 1).contiguous()  # [S, B, H]
    assert torch.equal(F.gather_tokens(xs, idx, seq_dim=0), part.transpose(0, 1))
    assert torch.equal(F.scatter_tokens(xs, idx, (part * 2).transpose(0, 1), seq_dim=0), out.transpose(0, 1))


def test_gradients_gradcheck_and_identity_path():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).double()
    idx = torch.tensor([[0, 2, 3], [1, 2, 4]])

    def f(x):
        return F.scatter_tokens(x, idx, torch.nn.functional.gelu(lin(F.gather_tokens(x, idx))))

    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (x,))
    grad_out = torch.randn(2, 5, 4, dtype=torch.float64)
    f(x).backward(grad_out)
    dropped = torch.ones(2, 5, dtype=torch.bool)
    dropped[0, [0, 2, 3]] = False
    dropped[1, [1, 2, 4]] = False
    assert torch.equal(x.grad[dropped], grad_out[dropped])
    # parameter gradients equal the explicit reference on the gathered rows
    lin.zero_grad()
    f(x).backward(grad_out)
    g_ltd = lin.weight.grad.clone()
    lin.zero_grad()
    rows = torch.stack([x[0, [0, 2, 3]], x[1, [1, 2, 4]]]).detach()
    torch.nn.functional.gelu(lin(rows)).backward(torch.stack([grad_out[0, [0, 2, 3]], grad_out[1, [1, 2, 4]]]))
    torch.testing.assert_close(g_ltd, lin.weight.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_half_precision_equals_advanced_indexing(dtype):
    x = torch.randn(3, 33, 7).to(dtype)
    idx = F.sample_token_indices(1, 3, 33, 11, torch.Generator().manual_seed(0))[0]
    rows = torch.arange(3)[:, None]
    assert torch.equal(F.gather_tokens(x, idx), x[rows, idx])
    y = torch.randn(3, 11, 7).to(dtype)
    ref = x.clone()
    ref[rows, idx] = y
    assert torch.equal(F.scatter_tokens(x, idx, y), ref)


def test_long_sequences_any_hidden_size():
    x = torch.randn(1, 4096, 100)
    idx = F.sample_token_indices(1, 1, 4096, 3000, torch.Generator().manual_seed(0))[0]
    part = F.gather_tokens(x, idx)
    assert part.shape == (1, 3000, 100)
    assert torch.equal(F.scatter_tokens(x, idx, part), x)


def test_scatter_rejects_a_length_changing_layer():
    x = torch.randn(2, 6, 3)
    idx = torch.tensor([[0, 2, 5], [1, 3, 4]])
    with pytest.raises(ValueError, match="keep the sequence length"):
        F.scatter_tokens(x, idx, torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="expected a floating tensor"):
        F.scatter_tokens(x, idx, torch.ones(2, 3, 3, dtype=torch.int64))
    # a lower-precision layer output (autocast) is cast to the residual stream's dtype
    part = torch.randn(2, 3, 3).to(torch.bfloat16)
    out = F.scatter_tokens(x, idx, part)
    assert out.dtype == x.dtype and torch.equal(out[0, 2], part[0, 1].float())


# ------------------------------------------------------------------------------------------------ masks and positions


def test_gather_seq_tensor_forms():
    b, s = 2, 6
    idx = torch.tensor([[0, 2, 5], [1, 3, 4]])
    full = torch.randn(b, 1, s, s)
    g = F.gather_seq_tensor(full, idx, (-2, -1))
    for i in range(b):
        assert torch.equal(g[i, 0], full[i, 0][idx[i]][:, idx[i]])
    key_only = torch.randn(b, 1, 1, s)
    assert torch.equal(
        F.gather_seq_tensor(key_only, idx, (-2, -1))[:, 0, 0],
        torch.stack([key_only[i, 0, 0, idx[i]] for i in range(b)]),
    )
    shared = torch.randn(1, 1, s, s)  # broadcast batch axis is expanded per sample
    gs = F.gather_seq_tensor(shared, idx, (-2, -1))
    assert gs.shape == (b, 1, 3, 3) and torch.equal(gs[1, 0], shared[0, 0][idx[1]][:, idx[1]])
    pos = torch.arange(s)[None]
    assert torch.equal(F.gather_seq_tensor(pos, idx, (-1,)), idx)
    pad2d = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert torch.equal(F.gather_seq_tensor(pad2d, idx, (-1,)), torch.tensor([[1, 1, 0], [1, 1, 1]]))
    boolean = torch.ones(b, 1, s, s, dtype=torch.bool).tril()
    assert F.gather_seq_tensor(boolean, idx, (-2, -1)).dtype == torch.bool
    with pytest.raises(ValueError, match="batch axis"):
        F.gather_seq_tensor(torch.randn(3, 1, s, s), idx, (-2, -1))


def test_gather_seq_tensor_with_the_sequence_before_the_batch_axis():
    """A sequence-first tensor (``[S, B, D]``, ``[S, S, B]``) keeps each sample's own tokens (hand loop); before, the
    indices were laid out for batch-first tensors and scrambled across samples."""
    b, s = 3, 7
    idx = torch.tensor([[0, 2, 5], [1, 3, 4], [4, 5, 6]])
    seq_first = torch.randn(s, b, 2)
    g = F.gather_seq_tensor(seq_first, idx, (0,), batch_axis=1)
    assert g.shape == (3, b, 2)
    for i in range(b):
        assert torch.equal(g[:, i], seq_first[idx[i], i])
    pair = torch.randn(s, s, b)
    g = F.gather_seq_tensor(pair, idx, (0, 1), batch_axis=2)
    for i in range(b):
        assert torch.equal(g[:, :, i], pair[:, :, i][idx[i]][:, idx[i]])
    with pytest.raises(ValueError, match=r"sequence axis 1 has size 9, expected 1 or 7"):
        F.gather_seq_tensor(torch.randn(b, 9), idx, (1,), seq_len=7)


def _per_sample(mask, idx, both=True):
    """Reference gather by advanced indexing: ``mask[..., idx_b, :][..., idx_b]`` per sample (batch axis 0)."""
    out = []
    for b in range(idx.shape[0]):
        m = mask[b if mask.shape[0] > 1 else 0][..., idx[b], :]
        out.append(m[..., idx[b]] if both else m)
    return torch.stack(out)


def test_gather_attention_mask_layouts():
    b, s, h = 2, 6, 3
    idx = torch.tensor([[0, 2, 5], [1, 3, 4]])
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(s, s, generator=g)
    # nn.MultiheadAttention layouts: [S, S] and [B*H, S, S] give [B*H, r, r] (batch-major, as MHA reads them)
    mha = F.gather_attention_mask(shared, idx, s, "self", num_heads=h)
    assert torch.equal(mha, _per_sample(shared[None], idx).repeat_interleave(h, dim=0))
    per_head = torch.randn(b * h, s, s, generator=g)
    got = F.gather_attention_mask(per_head, idx, s, "self", num_heads=h).view(b, h, 3, 3)
    assert torch.equal(got, _per_sample(per_head.view(b, h, s, s), idx))
    # broadcast layouts (F.scaled_dot_product_attention): [S, S] -> [B, 1, r, r], [B|1, S, S], [B|1, 1|H, S, S]
    assert torch.equal(F.gather_attention_mask(shared, idx, s), _per_sample(shared[None, None], idx))
    three = torch.randn(b, s, s, generator=g)
    assert torch.equal(F.gather_attention_mask(three, idx, s), _per_sample(three, idx))
    four = torch.ones(1, 1, s, s, dtype=torch.bool).tril()
    got = F.gather_attention_mask(four, idx, s)
    assert got.dtype == torch.bool and torch.equal(got, _per_sample(four, idx))
    # cross-attention: the query axis only (7 memory keys)
    cross = torch.randn(s, 7, generator=g)
    got = F.gather_attention_mask(cross, idx, s, "cross", num_heads=h)
    assert got.shape == (b * h, 3, 7) and torch.equal(got[h], cross[idx[1]])
    # key padding [B, S] -> [B, r]
    pad = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(
        F.gather_attention_mask(pad, idx, s, "key_padding"), torch.stack([pad[i, idx[i]] for i in range(b)])
    )


@pytest.mark.parametrize(
    ("shape", "kind", "heads", "allowed"),
    [
        ((2, 6, 6), "self", 3, r"\[S, S\] or \[B\*num_heads, S, S\] \(num_heads=3"),  # [B, S, S] is not MHA's
        ((2, 1, 6, 6), "self", 3, r"\[B\*num_heads, S, S\]"),  # nn.MultiheadAttention takes no 4-D mask
        ((6, 5), "self", None, r"\[S, S\], \[B\|1, S, S\] or \[B\|1, 1\|H, S, S\]"),  # not square
        ((5, 7), "cross", None, r"\[S, M\]"),  # the query axis is not the sequence
        ((3, 6, 6), "self", None, r"\[B\|1, S, S\]"),  # a batch of 3 for 2 samples
        ((2, 1, 1, 6, 6), "self", None, r"\[B\|1, 1\|H, S, S\]"),
        ((2, 5), "key_padding", None, r"\[B, S\]"),
    ],
)
def test_gather_attention_mask_rejects_unknown_layouts(shape, kind, heads, allowed):
    idx = torch.tensor([[0, 2, 5], [1, 3, 4]])
    with pytest.raises(F.MaskLayoutError, match=rf"a {kind} attention mask of shape \[.*\] for S=6, B=2 .*{allowed}"):
        F.gather_attention_mask(torch.zeros(shape), idx, 6, kind, num_heads=heads)


def test_expand_attention_puts_the_kept_rows_and_columns_back():
    idx = torch.tensor([[0, 2, 5], [1, 3, 4]])
    w = torch.rand(2, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    full = F.expand_attention(w, idx, 6)
    assert full.shape == (2, 4, 6, 6)
    for b in range(2):
        assert torch.equal(full[b][:, idx[b]][:, :, idx[b]], w[b])
        dropped = torch.ones(6, dtype=torch.bool)
        dropped[idx[b]] = False
        assert not full[b][:, dropped].any() and not full[b][:, :, dropped].any()
    full.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
    rows = F.expand_attention(torch.rand(2, 3, 7), idx, 6, keys=False)  # cross-attention: 7 memory keys stay
    assert rows.shape == (2, 6, 7) and not rows[0, 1].any() and rows[0, 2].all()
    with pytest.raises(ValueError, match="not \\[B=2, ..., r=3, r\\]"):
        F.expand_attention(torch.rand(2, 3, 4), idx, 6)


# ------------------------------------------------------------------------------------------------ accounting


def test_layer_tokens_golden():
    assert F.layer_tokens(512, 2048, 128, 24, 22) == 3_538_944
    assert F.layer_tokens(4, 64, 128, 24, 22) == 4 * 64 * 24  # truncated batches: LTD layers count the real 64
    assert F.layer_tokens(4, 64, 32, 4, 2) == 4 * (32 * 2 + 64 * 2)
    with pytest.raises(ValueError):
        F.layer_tokens(1, 8, 4, 2, 3)


def test_total_layer_tokens_is_pure_and_sums_the_schedule():
    cfg = dict(
        global_batch_size=4,
        num_layers=12,
        num_ltd_layers=10,
        min_value=128,
        max_value=1024,
        require_steps=400,
        seq_per_step=8,
    )
    a = F.total_layer_tokens(450, **cfg)
    b = F.total_layer_tokens(450, **cfg)
    brute = sum(F.layer_tokens(4, 1024, F.ltd_value(s, 128, 1024, 400, 8), 12, 10) for s in range(450))
    assert a == b == brute
    assert F.total_layer_tokens(0, **cfg) == 0


@pytest.mark.parametrize("min_value, max_value", [(64, 200), (100, 100), (7, 50)])
def test_total_layer_tokens_with_deepspeed_rounding_sums_the_steps_past_require_steps(min_value, max_value):
    """With DeepSpeed's rounding a max_value that is no multiple of seq_per_step is still below max_value at
    require_steps (192 of 200 at step 1000 for 64..200) and reaches it later (step 1059), or never (min == max):
    the total is the sum over every step (before, the steps from require_steps on were counted at its value, 1.9%
    short here, so layer_token_lr ended its decay early)."""
    assert F.ltd_value(1000, 64, 200, 1000, 16, "deepspeed") == 192
    assert (
        F.ltd_value(1058, 64, 200, 1000, 16, "deepspeed") == 192
        and F.ltd_value(1059, 64, 200, 1000, 16, "deepspeed") == 200
    )
    cfg = dict(
        global_batch_size=16,
        num_layers=4,
        num_ltd_layers=2,
        min_value=min_value,
        max_value=max_value,
        require_steps=1000,
        seq_per_step=16,
        rounding="deepspeed",
    )
    brute = sum(
        F.layer_tokens(16, max_value, F.ltd_value(s, min_value, max_value, 1000, 16, "deepspeed"), 4, 2)
        for s in range(2000)
    )
    assert F.total_layer_tokens(2000, **cfg) == brute


def test_flops_per_layer_matches_the_foundation_convention():
    from lightning_effi.core.flops import transformer_training_flops

    per_layer = transformer_training_flops(2, 16, 1, 32, 64, 0, head="none")
    assert F.flops_per_layer(2, 16, 32, 64) == per_layer
    assert F.saved_flops_fraction(16, 16, 4, 2, 32) == 0.0
    assert 0 < F.saved_flops_fraction(16, 8, 4, 2, 32) < 0.5


def test_flops_per_layer_with_fused_attention_adds_the_recompute_of_the_scores():
    """A fused sdpa kernel recomputes ``Q K^T`` in the backward: ``2·B·T²·H`` more per layer, the same as
    ``transformer_training_flops(..., fused_attention=True)`` for one layer; the saved fraction counts it too."""
    from lightning_effi.core.flops import attention_recompute_flops, transformer_training_flops

    assert F.flops_per_layer(2, 16, 32, 64, True) - F.flops_per_layer(2, 16, 32, 64) == 2 * 2 * 16 * 16 * 32
    assert F.flops_per_layer(2, 16, 32, 64, fused_attention=True) == transformer_training_flops(
        2, 16, 1, 32, 64, 0, head="none", fused_attention=True
    )
    assert F.flops_per_layer(3, 8, 32, fused_attention=True) == F.flops_per_layer(3, 8, 32) + attention_recompute_flops(
        3, 8, 1, 32
    )
    full, part = F.flops_per_layer(1, 16, 32, None, True), F.flops_per_layer(1, 8, 32, None, True)
    assert F.saved_flops_fraction(16, 8, 4, 2, 32, fused_attention=True) == 2 * (full - part) / (4 * full)
    assert F.saved_flops_fraction(16, 8, 4, 2, 32, fused_attention=True) > F.saved_flops_fraction(16, 8, 4, 2, 32)


#: the pure core helpers the functional module may use (argument checks; they import the standard library only)
PURE_CORE = ("lightning_effi.core.checks",)


def test_module_imports_no_lightning():
    tree = ast.parse(Path(F.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(name.startswith("lightning") for name in names - set(PURE_CORE))
    for name in PURE_CORE:
        core = ast.parse(Path(importlib.import_module(name).__file__).read_text())
        modules = {a.name for n in ast.walk(core) if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module for n in ast.walk(core) if isinstance(n, ast.ImportFrom) and n.module}
        assert not any(m.startswith(("lightning", "torch", "numpy")) for m in modules)


def test_flops_helpers_and_mask_heads_refuse_values_out_of_range():
    """Negative sizes gave negative FLOPs, more LTD layers than layers a saving above 1 (1.086), num_heads=0 an
    empty mask: each is refused, naming the argument."""
    with pytest.raises(ValueError, match=r"flops_per_layer.*batch_size"):
        F.flops_per_layer(-1, 8, 16)
    with pytest.raises(ValueError, match=r"saved_flops_fraction.*num_ltd_layers"):
        F.saved_flops_fraction(16, 8, 2, 3, 16)
    assert 0 < F.saved_flops_fraction(16, 8, 2, 2, 16) < 1
    with pytest.raises(ValueError, match=r"gather_attention_mask.*num_heads"):
        F.gather_attention_mask(torch.zeros(4, 4, dtype=torch.bool), torch.tensor([[0, 2]]), 4, num_heads=0)
