"""Coalesce / de-coalesce / interpolate on GPT-2, BERT and timm ViT/DeiT: round trips, function preservation, tied
weights, embedding conventions, odd sizes and unmapped parameters (expected values as in the official
``map_tools/testbench.py``), and the model-level steps the callback uses."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_effi.functional import vcycle as V
from lightning_effi.models.vcycle_base import (
    HFBertVCycleAdapter,
    HFGPT2VCycleAdapter,
    TimmViTVCycleAdapter,
    find_vcycle_adapter,
)
from tests.vcycle import models as M

ALL = list(M.MODELS)
# explicit head groups for 4 heads: a permuted pair partition and a partition with a group of 3
WIDTH_SCHEMES = {"half": "half", "pairs": [[0, 3], [2, 1]], "triple": [[0, 1, 2], [3]], "none": None}
DEPTH_SCHEMES = {"adjacent": "adjacent", "half": "half", "explicit": [[3, 0], [1], [2]], "none": None}


def small_state(name: str, plan: V.VCyclePlan, seed: int = 3) -> dict[str, torch.Tensor]:
    """A state dict of the small model with random values (tied keys share one tensor)."""
    m = M.model(name)
    small = find_vcycle_adapter(m).build_small(m, plan)
    return M.perturb(small, seed=seed, std=0.3).state_dict()


def assert_sd_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"not bit-identical: {bad}"


# ---------------------------------------------------------------------------------------------------------------------
# 1. round trip Co(De(W)) == W, exactly


ROUND_TRIPS = (
    # GPT-2 (tied): every width scheme x every depth scheme x both conventions
    [("gpt2_tied", w, d, c) for w in WIDTH_SCHEMES for d in DEPTH_SCHEMES for c in ("official", "exact")]
    # every other model: each width scheme and each depth scheme at least once, both conventions on the HF ones
    + [
        (n, w, d, "official")
        for n in ALL[1:]
        for w, d in (
            ("half", "adjacent"),
            ("pairs", "half"),
            ("triple", "explicit"),
            ("none", "adjacent"),
            ("half", "none"),
        )
    ]
    + [(n, "triple", "adjacent", "exact") for n in ALL[1:6]]
)


@pytest.mark.parametrize("name, width, depth, convention", ROUND_TRIPS)
def test_round_trip_exact(name, width, depth, convention):
    m = M.model(name)
    plan = find_vcycle_adapter(m).plan(m, WIDTH_SCHEMES[width], DEPTH_SCHEMES[depth], convention)
    small = V.coalesce(m, plan)  # a valid small state dict (the averaged large model)
    big = V.decoalesce(small, plan)
    assert {k: tuple(v.shape) for k, v in big.items()} == dict(plan.large_shapes)
    assert_sd_equal(V.coalesce(big, plan), small)


@pytest.mark.parametrize("name", ["gpt2_tied", "bert_mlm_tied", "vit"])
def test_round_trip_exact_from_random_small_model(name):
    m = M.model(name)
    plan = find_vcycle_adapter(m).plan(m, [[0, 1, 2], [3]], [[0, 1], [2, 3]])
    sd = small_state(name, plan)
    assert_sd_equal(V.coalesce(V.decoalesce(sd, plan), plan), sd)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_round_trip_exact_other_dtypes(dtype):
    m = M.model("gpt2_tied").to(dtype)
    for conv in ("official", "exact"):
        plan = find_vcycle_adapter(m).plan(m, "half", "adjacent", conv)
        sd = V.coalesce(m, plan)
        assert all(v.dtype == dtype for v in sd.values())
        assert_sd_equal(V.coalesce(V.decoalesce(sd, plan), plan), sd)


def test_round_trip_odd_depth_and_mixing_weights():
    m = M.gpt2(n_layer=5)
    ad = find_vcycle_adapter(m)
    plan = ad.plan(m, None, [[0, 1], [2, 3, 4]])
    assert plan.num_layers == (5, 2)
    sd = V.coalesce(m, plan)
    large = m.state_dict()
    key = "transformer.h.{}.mlp.c_fc.weight"
    assert torch.equal(sd[key.format(0)], (large[key.format(0)] + large[key.format(1)]) * 0.5)
    torch.testing.assert_close(sd[key.format(1)], sum(large[key.format(s)] for s in (2, 3, 4)) / 3, atol=1e-7, rtol=0)
    assert_sd_equal(V.coalesce(V.decoalesce(sd, plan), plan), sd)
    ad.build_small(m, plan).load_state_dict(sd)  # strict


# ---------------------------------------------------------------------------------------------------------------------
# 2. function preservation of width de-coalescing


def decoalesced_model(name: str, width="half", convention="official", depth=None):
    """(small model with random weights, large model loaded with its de-coalesced weights)."""
    m = M.model(name)
    ad = find_vcycle_adapter(m)
    plan = ad.plan(m, width, depth, convention)
    small = M.perturb(ad.build_small(m, plan), seed=5, std=0.3).eval()
    m.load_state_dict(V.decoalesce(small, plan))
    return small, m


PRESERVING = [
    ("bert_mlm_tied", "official", "half"),
    ("bert_mlm_tied", "official", "pairs"),
    ("bert_mlm_untied", "official", "half"),
    ("bert_cls", "official", "half"),
    ("bert_mlm_tied", "exact", "half"),
    ("gpt2_tied", "exact", "half"),
    ("gpt2_tied", "exact", "pairs"),
    ("gpt2_untied", "exact", "half"),
    ("gpt2_cls", "exact", "half"),
    ("vit", "official", "half"),
    ("vit", "official", "pairs"),
    ("deit_distilled", "official", "half"),
    ("vit_rich", "official", "half"),
]


@pytest.mark.parametrize("name, convention, width", PRESERVING)
def test_width_decoalesce_is_function_preserving(name, convention, width):
    small, large = decoalesced_model(name, WIDTH_SCHEMES[width], convention)
    a, b = M.logits(name, small), M.logits(name, large)
    assert a.abs().max() > 0.1  # non-trivial logits
    assert (a - b).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["gpt2_tied", "gpt2_untied", "gpt2_cls"])
def test_gpt2_official_convention_is_not_function_preserving(name):
    # pre-LN: the ½-scaled embeddings meet unscaled block outputs in the residual stream (official testbench ≈9e-2)
    small, large = decoalesced_model(name, "half", "official")
    assert (M.logits(name, small) - M.logits(name, large)).abs().max() > 1e-3


def test_width_decoalesce_float64_bert_is_exact_to_rounding():
    m = M.model("bert_mlm_tied").double()
    ad = find_vcycle_adapter(m)
    plan = ad.plan(m, "half", None)
    small = M.perturb(ad.build_small(m, plan), seed=5, std=0.3).eval()
    m.load_state_dict(V.decoalesce(small, plan))
    # only the LayerNorm eps (1e-12) sees the official ½ embedding scale
    assert (M.logits("bert_mlm_tied", small) - M.logits("bert_mlm_tied", m)).abs().max() < 1e-10


# ---------------------------------------------------------------------------------------------------------------------
# 5. depth de-coalescing: not function-preserving, layer order by scheme


@pytest.mark.parametrize("name", ["gpt2_tied", "bert_mlm_tied", "bert_cls", "vit"])
def test_depth_decoalesce_not_function_preserving(name):
    small, large = decoalesced_model(name, None, "exact", depth="adjacent")
    assert (M.logits(name, small) - M.logits(name, large)).abs().max() > 1e-3


@pytest.mark.parametrize(
    "scheme, owner", [("adjacent", [0, 0, 1, 1]), ("half", [0, 1, 0, 1]), ([[3, 0], [1], [2]], [0, 1, 2, 0])]
)
def test_depth_decoalesce_layer_order(scheme, owner):
    m = M.model("vit")
    plan = find_vcycle_adapter(m).plan(m, None, scheme)
    sd = small_state("vit", plan)
    big = V.decoalesce(sd, plan)
    for s, i in enumerate(owner):
        for suffix in ("attn.qkv.weight", "norm2.bias", "mlp.fc1.weight"):
            assert torch.equal(big[f"blocks.{s}.{suffix}"], sd[f"blocks.{i}.{suffix}"])
    # copies are distinct tensors (not aliases), so interpolation treats every layer separately
    assert big["blocks.0.mlp.fc1.weight"].data_ptr() != big["blocks.1.mlp.fc1.weight"].data_ptr()


# ---------------------------------------------------------------------------------------------------------------------
# per-rule checks (GPT-2 Conv1D / fused qkv, conventions, tokens, patch embedding)


def test_gpt2_rules_conv1d_fused_qkv_and_conventions():
    m = M.model("gpt2_tied")
    large = m.state_dict()
    D, d = 32, 16
    for conv, emb_scale, lnf_scale in (("official", 2.0, 1.0), ("exact", 1.0, 2.0)):
        plan = find_vcycle_adapter(m).plan(m, "half", None, conv)
        sd = V.coalesce(m, plan)
        W = large["transformer.h.1.attn.c_attn.weight"]  # (D, 3D): in x out
        w = sd["transformer.h.1.attn.c_attn.weight"]
        assert w.shape == (d, 3 * d)
        # rows (input, hidden map): sum over {i, i+d}; columns (output): average over {j, j+d} inside each of
        # the Q, K, V chunks (small head 0 = large heads 0 and 2); the K chunk starts at D (large) / d (small)
        Ws = W[:d] + W[d:]
        for col_s, col_l in ((3, 3), (d + 5, D + 5), (2 * d + 7, 2 * D + 7)):
            assert torch.equal(w[:, col_s], (Ws[:, col_l] + Ws[:, col_l + d]) * 0.5)
        wte = large["transformer.wte.weight"]
        assert torch.equal(sd["transformer.wte.weight"], (wte[:, :d] + wte[:, d:]) * 0.5 * emb_scale)
        g = large["transformer.ln_f.weight"]
        assert torch.equal(sd["transformer.ln_f.weight"], (g[:d] + g[d:]) * 0.5 * lnf_scale)
        assert sd["lm_head.weight"] is sd["transformer.wte.weight"]


def test_gpt2_untied_head_uses_linear_input_rule_and_no_ln_f_scale():
    m = M.model("gpt2_untied")
    assert m.lm_head.weight is not m.transformer.wte.weight
    large = m.state_dict()
    plan = find_vcycle_adapter(m).plan(m, "half", None, "exact")
    assert "lm_head.weight" not in plan.aliases
    sd = V.coalesce(m, plan)
    h = large["lm_head.weight"]
    assert torch.equal(sd["lm_head.weight"], h[:, :16] + h[:, 16:])
    g = large["transformer.ln_f.weight"]
    assert torch.equal(sd["transformer.ln_f.weight"], (g[:16] + g[16:]) * 0.5)


def test_vit_tokens_patch_embed_layerscale_qknorm_and_heads():
    m = M.model("vit_rich")
    large = m.state_dict()
    plan = find_vcycle_adapter(m).plan(m, "half", None)
    sd = V.coalesce(m, plan)
    for k in ("cls_token", "reg_token", "pos_embed"):
        x = large[k]
        assert torch.equal(sd[k], (x[..., :16] + x[..., 16:]) * 0.5)  # last dim, no scaling
    p = large["patch_embed.proj.weight"]
    assert sd["patch_embed.proj.weight"].shape == (16, 3, 8, 8)
    assert torch.equal(sd["patch_embed.proj.weight"], (p[:16] + p[16:]) * 0.5)
    g = large["blocks.2.ls1.gamma"]
    assert torch.equal(sd["blocks.2.ls1.gamma"], (g[:16] + g[16:]) * 0.5)
    assert torch.equal(sd["blocks.2.attn.q_norm.weight"], large["blocks.2.attn.q_norm.weight"])  # head dim kept
    h = large["head.weight"]
    assert torch.equal(sd["head.weight"], h[:, :16] + h[:, 16:])
    assert torch.equal(sd["head.bias"], large["head.bias"])


def test_deit_distilled_tokens_and_head_dist():
    m = M.model("deit_distilled")
    plan = find_vcycle_adapter(m).plan(m)
    assert plan.small_shapes["dist_token"] == (1, 1, 16) and plan.small_shapes["pos_embed"] == (1, 18, 16)
    assert plan.small_shapes["head_dist.weight"] == (10, 16)


def test_bert_mlm_tied_decoder_and_shared_bias_are_aliases():
    m = M.model("bert_mlm_tied")
    plan = find_vcycle_adapter(m).plan(m)
    assert plan.aliases["cls.predictions.decoder.weight"] == "bert.embeddings.word_embeddings.weight"
    assert {plan.aliases.get("cls.predictions.decoder.bias"), plan.aliases.get("cls.predictions.bias")} & {
        "cls.predictions.bias",
        "cls.predictions.decoder.bias",
    }
    sd = V.coalesce(m, plan)
    assert sd["cls.predictions.decoder.weight"] is sd["bert.embeddings.word_embeddings.weight"]
    assert sd["cls.predictions.decoder.bias"] is sd["cls.predictions.bias"]
    assert torch.equal(sd["cls.predictions.bias"], m.cls.predictions.bias.detach())  # vocabulary bias copied
    w = m.bert.embeddings.word_embeddings.weight.detach()
    assert torch.equal(sd["bert.embeddings.word_embeddings.weight"], (w[:, :16] + w[:, 16:]) * 0.5 * 2.0)


# ---------------------------------------------------------------------------------------------------------------------
# 3. small models: configs, shapes, ties after loading


@pytest.mark.parametrize("name", ALL)
def test_small_model_halves_config_and_loads_strictly(name):
    m = M.model(name)
    ad = find_vcycle_adapter(m)
    plan = ad.plan(m)
    small = ad.build_small(m, plan)
    small.load_state_dict(V.coalesce(m, plan), strict=True)
    assert plan.info["small"] == {"hidden": 16, "heads": 2, "ffn": plan.info["large"]["ffn"] // 2, "layers": 2}
    if isinstance(ad, HFGPT2VCycleAdapter):
        c = small.config
        assert (c.n_embd, c.n_head, c.n_layer) == (16, 2, 2) and c.n_embd // c.n_head == 32 // 4
    elif isinstance(ad, HFBertVCycleAdapter):
        c = small.config
        assert (c.hidden_size, c.num_attention_heads, c.intermediate_size, c.num_hidden_layers) == (16, 2, 32, 2)
    else:
        assert isinstance(ad, TimmViTVCycleAdapter)
        assert (small.embed_dim, small.blocks[0].attn.num_heads, len(small.blocks)) == (16, 2, 2)
        assert small.blocks[0].attn.head_dim == m.blocks[0].attn.head_dim and type(small) is type(m)
    assert small.training == m.training


def test_non_embedding_parameter_count_ratio():
    # hidden 64: width-only ≈ 1/4, width + depth ≈ 1/8 of the non-embedding parameters
    m = M.gpt2(n_embd=64, n_head=4)
    ad = find_vcycle_adapter(m)

    def count(model):
        return sum(p.numel() for n, p in model.named_parameters() if "wte" not in n and "wpe" not in n)

    for depth, ratio in ((None, 0.25), ("adjacent", 0.125)):
        small = ad.build_small(m, ad.plan(m, "half", depth))
        assert abs(count(small) / count(m) / ratio - 1) < 0.02


@pytest.mark.parametrize(
    "name, pairs",
    [
        ("gpt2_tied", [("lm_head.weight", "transformer.wte.weight")]),
        (
            "bert_mlm_tied",
            [
                ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
                ("cls.predictions.decoder.bias", "cls.predictions.bias"),
            ],
        ),
    ],
)
def test_ties_survive_build_load_and_interpolate(name, pairs):
    m = M.model(name)
    saved = {k: v.clone() for k, v in m.state_dict().items()}
    saved[pairs[0][0]] = saved[pairs[0][1]]  # the snapshot keeps the tie as one tensor
    ad = find_vcycle_adapter(m)
    plan = ad.plan(m)
    small = ad.build_small(m, plan)
    small.load_state_dict(V.coalesce(m, plan))
    sm = dict(small.named_parameters(remove_duplicate=False))
    for a, b in pairs:
        assert sm[a] is sm[b]
    de = V.decoalesce(small, plan)
    assert de[pairs[0][0]] is de[pairs[0][1]]
    out = V.interpolate(de, saved, 0.25)
    for a, b in pairs:
        assert out[a] is out[b]
    m.load_state_dict(out)
    lm = dict(m.named_parameters(remove_duplicate=False))
    for a, b in pairs:
        assert lm[a] is lm[b]
        assert torch.equal(lm[a].detach(), out[a])


# ---------------------------------------------------------------------------------------------------------------------
# interpolation


def test_interpolate_endpoints_and_midpoint():
    m = M.model("gpt2_tied")
    plan = find_vcycle_adapter(m).plan(m)
    saved = {k: v.clone() for k, v in m.state_dict().items()}
    de = V.decoalesce(small_state("gpt2_tied", plan), plan)
    assert_sd_equal(V.interpolate(de, saved, 0), de)
    assert_sd_equal(V.interpolate(de, saved, 1.0), {k: saved[k] for k in de})
    out = V.interpolate(de, saved, 0.25)
    for k in de:
        assert torch.equal(out[k], 0.75 * de[k] + 0.25 * saved[k])
    # results are new tensors, never views of the inputs
    for res in (V.interpolate(de, saved, 0), V.interpolate(de, saved, 1)):
        assert all(res[k].data_ptr() not in (de[k].data_ptr(), saved[k].data_ptr()) for k in de)


def test_interpolate_accepts_modules_and_keeps_dtype():
    m = M.model("vit")
    other = M.perturb(copy.deepcopy(m), seed=9)
    out = V.interpolate(m.to(torch.bfloat16), other, 0.5)
    assert all(v.dtype == torch.bfloat16 for v in out.values())
    k = "blocks.0.attn.qkv.weight"
    expect = (m.state_dict()[k].float() * 0.5 + other.state_dict()[k].float() * 0.5).to(torch.bfloat16)
    assert torch.equal(out[k], expect)


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan"), float("inf"), True, "0.5", None])
def test_interpolate_rejects_bad_alpha(alpha):
    sd = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match="alpha_original"):
        V.interpolate(sd, sd, alpha)


def test_interpolate_rejects_mismatched_inputs():
    a = {"w": torch.zeros(2), "v": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"only in decoalesced \['v'\]"):
        V.interpolate(a, {"w": torch.zeros(2)}, 0.5)
    with pytest.raises(ValueError, match="shape mismatch"):
        V.interpolate(a, {"w": torch.zeros(2), "v": torch.zeros(4)}, 0.5)
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="tied in decoalesced but differ in saved_original"):
        V.interpolate({"a": t, "b": t}, {"a": torch.zeros(2), "b": torch.ones(2)}, 0.5)


# ---------------------------------------------------------------------------------------------------------------------
# purity


def test_operators_do_not_modify_inputs():
    m = M.model("bert_mlm_tied")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    plan = find_vcycle_adapter(m).plan(m, [[0, 1, 2], [3]], "half")
    sd = V.coalesce(m, plan)
    sd_before = {k: v.clone() for k, v in sd.items()}
    de = V.decoalesce(sd, plan)
    de_before = {k: v.clone() for k, v in de.items()}
    V.interpolate(de, m.state_dict(), 0.5)
    for ref, cur in ((before, m.state_dict()), (sd_before, sd), (de_before, de)):
        assert all(torch.equal(ref[k], cur[k]) for k in ref)
    large_ptrs = {v.data_ptr() for v in m.state_dict().values()}
    assert not large_ptrs & {v.data_ptr() for v in sd.values()}


# ---------------------------------------------------------------------------------------------------------------------
# 4. bad input


@pytest.mark.parametrize(
    "build, kw, match",
    [
        (lambda: M.gpt2(n_embd=24, n_head=3), {}, r"n_head=3 cannot be halved"),
        (lambda: M.gpt2(n_inner=62 + 1), {}, r"n_inner: width scheme 'half' needs an even size, got 63"),
        (lambda: M.gpt2(n_inner=66), {"width_scheme": [[0, 1], [2, 3]]}, r"n_inner=66 is not divisible by n_head=4"),
        (
            lambda: M.gpt2(n_layer=5),
            {},
            r"n_layer: depth scheme 'adjacent' needs an even number of layers, got 5; pass explicit groups as "
            r"depth_scheme \(VCycleCallback\(depth_scheme=...\)\), e.g. \[\[0, 1\], \[2, 3, 4\]\]",
        ),
        (lambda: M.gpt2(n_layer=5), {"depth_scheme": "half"}, r"n_layer: depth scheme 'half'"),
        (
            lambda: M.bert_cls(num_attention_heads=2, hidden_size=30, intermediate_size=60, num_hidden_layers=2),
            {"width_scheme": [[0], [1]], "depth_scheme": [[0], [1]]},
            None,
        ),
        (lambda: M.bert_cls(num_attention_heads=1), {}, r"num_attention_heads=1 cannot be halved"),
        (lambda: M.bert_cls(intermediate_size=63), {}, r"intermediate_size"),
        (lambda: M.bert_cls(num_hidden_layers=3), {}, r"num_hidden_layers: depth scheme 'adjacent'"),
        (lambda: M.vit(num_heads=2, embed_dim=24, depth=2), {"width_scheme": [[0, 1], [2]]}, r"width_scheme"),
        (lambda: M.vit(num_heads=1, embed_dim=24, depth=2), {}, r"num_heads=1 cannot be halved"),
        (lambda: M.vit(depth=3), {}, r"depth: depth scheme 'adjacent'"),
        (lambda: M.vit(depth=4), {"depth_scheme": [[0, 1], [1, 2, 3]]}, r"depth_scheme \(depth=4\).*duplicated \[1\]"),
        (lambda: M.vit(depth=2), {"width_scheme": [[0, 1], [2]]}, r"width_scheme.*missing \[3\]"),
        (lambda: M.vit(depth=2), {"embedding_convention": "paper"}, r"embedding_convention"),
    ],
)
def test_plan_errors_name_the_parameter(build, kw, match):
    m = build()
    ad = find_vcycle_adapter(m)
    if match is None:  # identity groups on a model that cannot be halved are fine
        plan = ad.plan(m, **kw)
        assert plan.info["small"]["hidden"] == 30
        return
    with pytest.raises(ValueError, match=match):
        ad.plan(m, **kw)


@pytest.mark.parametrize(
    "kw, names",
    [
        ({"scale_attn_norm": True}, ["blocks.0.attn.norm.weight", "blocks.0.attn.norm.bias"]),
        ({"scale_mlp_norm": True}, ["blocks.0.mlp.norm.weight"]),
        ({"global_pool": "map"}, ["attn_pool."]),
    ],
)
def test_unsupported_timm_options_raise_listing_parameters(kw, names):
    m = M.vit(depth=2, **kw)
    with pytest.raises(ValueError, match="does not map") as e:
        find_vcycle_adapter(m).plan(m)
    assert all(n in str(e.value) for n in names)


def test_unknown_parameter_raises_listing_it():
    m = M.model("gpt2_tied")
    m.register_parameter("extra_scale", nn.Parameter(torch.ones(3)))
    with pytest.raises(ValueError, match=r"does not map 1 parameter\(s\) of GPT2LMHeadModel: \['extra_scale'\]"):
        find_vcycle_adapter(m).plan(m)


def test_a_parameter_in_every_layer_is_listed_once():
    """An adapter of one's own in every layer (a LoRA matrix): the message listed each layer's name (64 names, 3,253
    characters in the helper's run, qa33-user); now the first and the pattern of the others."""
    m = M.model("gpt2_tied")
    for block in m.transformer.h:
        block.attn.register_parameter("lora_A", nn.Parameter(torch.zeros(2)))
    layers = len(m.transformer.h)
    with pytest.raises(ValueError) as e:
        find_vcycle_adapter(m).plan(m)
    assert (
        f"does not map {layers} parameter(s) of GPT2LMHeadModel: "
        f"['transformer.h.0.attn.lora_A (+{layers - 1} more: transformer.h.*.attn.lora_A)']"
    ) in str(e.value)


def test_a_replaced_timm_head_is_refused_with_the_ways_out():
    """A user's own head inside a timm ViT (net.head = Sequential(Dropout, Linear)) was refused with "these options
    are unsupported - subclass the adapter", no way out a user could act on; the message now gives them."""
    m = M.vit(depth=2)
    m.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(m.head.in_features, 10))
    with pytest.raises(ValueError, match=r"\['head\.1\.weight', 'head\.1\.bias'\] \(a module of your own") as e:
        find_vcycle_adapter(m).plan(m, None)  # depth only too: the small model is rebuilt from the configuration
    for way_out in ("reset_classifier", "onto the LightningModule", "TimmViTVCycleAdapter", "VCycleCallback(adapter="):
        assert way_out in str(e.value)


def test_unknown_architecture_names_supported_ones():
    with pytest.raises(
        ValueError,
        match=r"no V-cycle adapter for Linear; supported architectures: hf_bert .*"
        r"hf_gpt2 .*timm_vit",
    ):
        find_vcycle_adapter(nn.Linear(2, 2))
    wrapper = nn.Module()
    wrapper.model = M.model("vit")
    with pytest.raises(ValueError, match=r"submodule 'model' \(VisionTransformer\) is supported"):
        find_vcycle_adapter(wrapper)
    with pytest.raises(ValueError, match=r"unknown V-cycle adapter 'llama'"):
        find_vcycle_adapter(wrapper.model, "llama")
    with pytest.raises(ValueError, match=r"'hf_gpt2' does not handle VisionTransformer"):
        find_vcycle_adapter(wrapper.model, "hf_gpt2")
    assert isinstance(find_vcycle_adapter(wrapper.model, "timm_vit"), TimmViTVCycleAdapter)


def test_state_dict_mismatches_raise():
    m = M.model("gpt2_tied")
    plan = find_vcycle_adapter(m).plan(m)
    sd = dict(m.state_dict())
    del sd["transformer.h.0.ln_1.bias"]
    with pytest.raises(ValueError, match=r"missing \['transformer.h.0.ln_1.bias'\]"):
        V.coalesce(sd, plan)
    small = dict(V.coalesce(m, plan))
    with pytest.raises(ValueError, match=r"shape mismatch.*'transformer.h.1.ln_2.weight': \(\(32,\), \(16,\)\)"):
        V.decoalesce({**small, "transformer.h.1.ln_2.weight": torch.zeros(32)}, plan)
    small["lm_head.weight"] = small["lm_head.weight"] + 1
    with pytest.raises(ValueError, match=r"'lm_head.weight' is tied to 'transformer.wte.weight'"):
        V.decoalesce(small, plan)


def test_plan_create_validates_rules():
    hidden = V.width_groups(4, "half")
    with pytest.raises(ValueError, match=r"no rule for 1 state-dict entries: \['b'\]"):
        V.VCyclePlan.create({"a": (4,), "b": (4,)}, {"a": V.TensorRule(((0, hidden, "out"),))})
    with pytest.raises(ValueError, match=r"map of size 4 does not fit axis 0"):
        V.VCyclePlan.create({"a": (6,)}, {"a": V.TensorRule(((0, hidden, "out"),))})
    with pytest.raises(ValueError, match=r"power of two"):
        V.VCyclePlan.create({"a": (4,)}, {"a": V.TensorRule(((0, hidden, "out"),), scale=3.0)})
    rules = {
        "l.0.w": V.TensorRule((), 1.0, 0, "l.{}.w"),
        "l.1.w": V.TensorRule((), 1.0, 1, "l.{}.w"),
        "l.1.b": V.TensorRule((), 1.0, 1, "l.{}.b"),
    }
    with pytest.raises(ValueError, match=r"different parameter sets.*'l.\{\}.b': \[0\]"):
        V.VCyclePlan.create({"l.0.w": (1,), "l.1.w": (1,), "l.1.b": (1,)}, rules)


def test_model_level_steps():
    """The steps the callback takes at a level change, on models: a CPU fp32 snapshot with ties kept, the plans of
    every level, coalescing into a fresh small model, de-coalescing + interpolation back into the large one, and the
    fresh models of a level (resume); the global RNG is untouched."""
    m = M.model("gpt2_tied")
    ad = find_vcycle_adapter(m)
    before = copy.deepcopy(m.state_dict())
    saved = V.snapshot(m)
    assert saved["lm_head.weight"] is saved["transformer.wte.weight"]
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in saved.values() if t.is_floating_point())
    assert V.snapshot(m.half())["transformer.wte.weight"].dtype == torch.float32
    wide = V.snapshot(m.double())["transformer.wte.weight"]  # float64 kept: interpolating at alpha=1 gives it back
    assert wide.dtype == torch.float64 and torch.equal(wide, m.transformer.wte.weight.detach())
    m.float().load_state_dict(before)
    rng = torch.random.get_rng_state()
    plans = V.plan_levels(m, ad, 3)
    assert [p.num_layers for p in plans] == [(4, 2), (2, 1)] and torch.equal(rng, torch.random.get_rng_state())
    small = V.coalesce_model(m, plans[0], ad)
    assert torch.equal(rng, torch.random.get_rng_state())
    for k, v in V.coalesce(m, plans[0]).items():
        assert torch.equal(small.state_dict()[k], v), k
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())  # the large model is not modified
    large, parked = V.build_levels(m, ad, plans, 3)  # fresh models of levels 2 and 3
    assert large.config.n_layer == 1 and sorted(parked) == [1, 2] and parked[1] is m
    assert parked[2].config.n_layer == 2 and torch.equal(rng, torch.random.get_rng_state())
    small.train()
    back = V.decoalesce_model(small, m, plans[0], saved, 0.25)
    assert back is m and back.training and back.lm_head.weight is back.transformer.wte.weight
    expected = V.interpolate(V.decoalesce(small, plans[0]), saved, 0.25)
    for k, v in expected.items():
        assert torch.equal(back.state_dict()[k], v), k


def test_width_map_average_and_split_refuse_integer_tensors():
    """A mean or a split of integers would round (index_put also failed on the float result): refused, naming the op;
    sum and copy keep integers."""
    m = V.WidthMap(((0, 1), (2, 3)), 4)
    x = torch.arange(8).view(2, 4)
    for op, t in (("average", x), ("split", x[:, :2])):
        with pytest.raises(ValueError, match=rf"WidthMap\.{op}: needs a floating-point tensor, got torch.int64"):
            getattr(m, op)(t, 1)
    assert m.sum(x, 1).tolist() == [[1, 5], [9, 13]]
    assert m.average(x.float(), 1).tolist() == [[0.5, 2.5], [4.5, 6.5]]


@pytest.mark.parametrize("tied", [True, False])
def test_triples_of_heads_with_a_tied_head_warn_and_scale_its_logits_by_three_quarters(tied):
    """Equal groups of 3 heads: the power-of-two convention factor (4) is not the group size (3), so a tied head's
    logits come out at 3/4 of the small model's after de-coalescing; ``plan`` warns (qa79-vcycle 02: the card blamed a
    LayerNorm over unevenly duplicated features). Untied, the same groups preserve the function, without a warning."""
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=13, n_positions=8, n_layer=2, n_embd=12, n_head=6, tie_word_embeddings=tied)
    config.bos_token_id = config.eos_token_id = 0
    m = GPT2LMHeadModel(config).eval()
    ad = find_vcycle_adapter(m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = ad.plan(m, [[0, 1, 2], [3, 4, 5]], None, "exact")
    warned = [w for w in caught if "width groups of 12/4 = 3 features" in str(w.message)]
    assert len(warned) == (1 if tied else 0)
    small = M.perturb(ad.build_small(m, plan), seed=5, std=0.3).eval()
    m.load_state_dict(V.decoalesce(small, plan))
    x = torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = small(x).logits, m(x).logits
    assert a.abs().max() > 0.1
    if tied:
        torch.testing.assert_close(b, a * 0.75, atol=1e-5, rtol=1e-5)
    else:
        assert (a - b).abs().max() <= 1e-5


def test_the_coarse_vit_takes_the_inputs_the_full_one_takes():
    """A timm ViT with dynamic_img_size and dynamic_img_pad takes images whose sides are no multiple of the patch; the
    coarse ViT was built without dynamic_img_pad and refused them at the first coarse step (qa114-dense 01)."""
    import timm

    m = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=(32, 48), patch_size=8, embed_dim=32, depth=4,
        num_heads=4, num_classes=3, dynamic_img_size=True, dynamic_img_pad=True,
    )  # fmt: skip
    ad = find_vcycle_adapter(m)
    plan = ad.plan(m)
    small = ad.build_small(m, plan)
    small.load_state_dict(V.coalesce(m, plan), strict=True)
    assert small.patch_embed.dynamic_img_pad and small.dynamic_img_size
    assert small(torch.randn(2, 3, 30, 44)).shape == m(torch.randn(2, 3, 30, 44)).shape == (2, 3)
