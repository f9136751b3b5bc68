"""random-LTD on real model layers without a Trainer: layer equivalence for every adapter and mask form, causality,
bitwise identity at r >= S, eval pass-through, exact binding, key stability, recomputation, rotary positions, bad
input, and the model-family registry."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lightning_effi.adapters import (
    GenericAdapter,
    HFBertAdapter,
    HFBertVCycleAdapter,
    HFGPT2Adapter,
    HFGPT2VCycleAdapter,
    TimmViTAdapter,
    TimmViTVCycleAdapter,
    find_adapter,
    register_adapter,
    register_vcycle_adapter,
    registered_adapters,
    registered_families,
    registered_vcycle_adapters,
)
from lightning_effi.models import registry
from lightning_effi.random_ltd import LTDController, LTDForward, convert, restore, strip_random_ltd_keys

VOCAB = 50


def gpt2(impl="sdpa"):
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=4,
        n_embd=32,
        n_head=2,
        n_positions=64,
        vocab_size=VOCAB,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=impl,
    )
    return GPT2LMHeadModel(cfg).train()


def bert(impl="sdpa"):
    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=4,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation=impl,
    )
    return BertForMaskedLM(cfg).train()


def vit():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=4, num_classes=10).train()


def llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=4,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        use_cache=False,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).train()


def llama_adapter():
    return GenericAdapter(
        "model.layers",
        max_sequence_length=64,
        hidden_size=32,
        intermediate_size=64,
        seq_args={"attention_mask": [-2, -1], "position_ids": [-1], "position_embeddings": [-2]},
        passthrough=["use_cache"],
        must_be_none=["cache"],
    )


def converted(model, layer_ids=(1, 2), adapter="auto", **kw):
    ad = find_adapter(model, adapter)
    ctl = LTDController(len(ad.layers()), tuple(layer_ids), seed=0, **kw)
    return convert(model, ad, ctl), ctl


def tokens(b=3, s=16, seed=0):
    return torch.randint(1, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def right_padding(b=3, s=16):
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    return mask


class Recorder:
    """Records what a layer receives (before the LTD patch gathers) and what it returns (after the scatter)."""

    def __init__(self, layer):
        self.calls = []
        self.handles = [
            layer.register_forward_pre_hook(self.pre, with_kwargs=True),
            layer.register_forward_hook(self.post, with_kwargs=True),
        ]

    def pre(self, module, args, kwargs):
        self.calls.append({"args": args, "kwargs": dict(kwargs)})

    def post(self, module, args, kwargs, output):
        self.calls[-1]["output"] = output

    def remove(self):
        for h in self.handles:
            h.remove()


def rows(t, idx, axis):
    """Reference per-sample gather by advanced indexing (independent of the implementation)."""
    out = []
    for b in range(idx.shape[0]):
        tb = t[b if t.shape[0] > 1 else 0]
        out.append(tb.index_select(axis - 1 if axis > 0 else axis, idx[b]))
    return torch.stack(out)


def gathered_mask(mask, idx):
    if mask is None:
        return None
    m = rows(mask, idx, -2) if mask.shape[-2] > 1 else mask.expand(idx.shape[0], *mask.shape[1:])
    return rows(m, idx, -1)


# ------------------------------------------------------------------------------------------------ layer equivalence


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("mask_kind", ["none", "ones", "padding"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_hf_layer_equivalence(family, impl, mask_kind):
    model = gpt2(impl) if family == "gpt2" else bert(impl)
    _, ctl = converted(model)
    layers = model.transformer.h if family == "gpt2" else model.bert.encoder.layer
    layer = layers[2]  # the second LTD layer (ordinal 1)
    rec = Recorder(layer)
    x = tokens()
    mask = {"none": None, "ones": torch.ones(3, 16, dtype=torch.long), "padding": right_padding()}[mask_kind]
    ctl.begin(0, 0, 6)
    model(x, attention_mask=mask)
    call = rec.calls[0]
    idx = ctl.last_indices()[1]
    hidden, out = call["args"][0], call["output"]
    keep = torch.zeros(3, 16, dtype=torch.bool).scatter_(1, idx, True)
    assert torch.equal(out[~keep], hidden[~keep])  # dropped positions pass through unchanged

    args = list(call["args"])
    kwargs = dict(call["kwargs"])
    if family == "gpt2":
        assert args[1] is None  # no cache reaches the blocks
        mask_arg = args[2]
        assert mask_arg is None or mask_arg.shape[-2:] == (16, 16)
        ref_args = [rows(hidden, idx, 1), None, gathered_mask(mask_arg, idx), *args[3:]]
    else:
        mask_arg = args[1]
        ref_args = [rows(hidden, idx, 1), gathered_mask(mask_arg, idx), *args[2:]]
    if mask_kind == "padding":
        assert mask_arg is not None  # the padding mask arrives positionally and is gathered, not sliced
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = rows(kwargs["position_ids"].expand(3, 16), idx, 1)
    with torch.no_grad():
        ref = type(layer).forward(layer, *ref_args, **kwargs)
    torch.testing.assert_close(rows(out, idx, 1), ref, rtol=1e-6, atol=1e-6)
    rec.remove()


def test_vit_layer_equivalence_and_prefix():
    model = vit()
    _, ctl = converted(model, keep_prefix_tokens=1)
    layer = model.blocks[1]
    rec = Recorder(layer)
    ctl.begin(0, 0, 20)
    model(torch.randn(2, 3, 32, 32))
    idx = ctl.last_indices()[0]
    assert bool((idx[:, 0] == 0).all())  # the class token is kept
    hidden, out = rec.calls[0]["args"][0], rec.calls[0]["output"]
    assert hidden.shape == (2, 65, 192)
    with torch.no_grad():
        ref = type(layer).forward(layer, rows(hidden, idx, 1))
    torch.testing.assert_close(rows(out, idx, 1), ref, rtol=1e-6, atol=1e-6)
    keep = torch.zeros(2, 65, dtype=torch.bool).scatter_(1, idx, True)
    assert torch.equal(out[~keep], hidden[~keep])


def test_rotary_positions_are_gathered():
    model = llama()
    _, ctl = converted(model, adapter=llama_adapter())
    layer = model.model.layers[1]
    rec = Recorder(layer)
    ctl.begin(0, 0, 5)
    model(tokens(2, 12))
    call = rec.calls[0]
    idx = ctl.last_indices()[0]
    kwargs = dict(call["kwargs"])
    cos, sin = kwargs["position_embeddings"]
    kwargs["position_embeddings"] = (rows(cos, idx, 1), rows(sin, idx, 1))  # original positions of the kept tokens
    kwargs["attention_mask"] = gathered_mask(kwargs["attention_mask"], idx)
    kwargs["position_ids"] = rows(kwargs["position_ids"].expand(2, 12), idx, 1)
    hidden = call["args"][0]
    with torch.no_grad():
        ref = type(layer).forward(layer, rows(hidden, idx, 1), **kwargs)
        wrong = type(layer).forward(
            layer, rows(hidden, idx, 1), **{**kwargs, "position_embeddings": (cos[:, :5], sin[:, :5])}
        )  # positions 0..r-1 (DeepSpeed's fault)
    torch.testing.assert_close(rows(call["output"], idx, 1), ref, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ref, wrong)


# ---------------------------------------------------------------------------------------- causality, identity, eval


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gpt2_output_at_t_never_depends_on_later_tokens(impl):
    model = gpt2(impl)
    _, ctl = converted(model)
    x = tokens(2, 24)
    ctl.begin(3, 0, 8)
    base = model(x).logits
    for t in (0, 7, 15, 22):
        y = x.clone()
        y[:, t + 1 :] = (y[:, t + 1 :] + 7) % VOCAB
        assert torch.equal(model(y).logits[:, : t + 1], base[:, : t + 1])


def family_setup(family):
    """A converted model of ``family``, an unconverted copy, the controller, an input, its sequence length and the
    logits getter."""
    model = {"gpt2": gpt2, "bert": bert, "vit": vit}[family]()
    ref = copy.deepcopy(model)
    _, ctl = converted(model)
    if family == "vit":
        return model, ref, ctl, torch.randn(2, 3, 32, 32), 65, lambda o: o
    return model, ref, ctl, tokens(), 16, lambda o: o.logits


@pytest.mark.parametrize("family", ["gpt2", "bert", "vit"])
def test_reserved_length_at_sequence_length_is_bitwise_identical(family):
    model, ref, ctl, x, seq, get = family_setup(family)
    ctl.begin(0, 0, seq)
    logits, logits_ref = get(model(x)), get(ref(x))
    assert torch.equal(logits, logits_ref)
    logits.square().mean().backward()
    logits_ref.square().mean().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert ctl.draws == 0


@pytest.mark.parametrize("family", ["gpt2", "bert", "vit"])
def test_eval_and_disarmed_never_drop(family):
    model, ref, ctl, x, _, get = family_setup(family)
    ctl.begin(0, 0, 4)
    model.eval()
    ref.eval()
    assert torch.equal(get(model(x)), get(ref(x)))
    model.train()
    ref.train()
    assert not torch.equal(get(model(x)), get(ref(x)))  # armed and training: tokens are dropped
    ctl.end()
    assert torch.equal(get(model(x)), get(ref(x)))  # outside a training batch


def test_bert_all_padding_subset_is_finite():
    for impl in ("eager", "sdpa"):
        model = bert(impl)
        _, ctl = converted(model)
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[0, 2:] = 0  # 90% padding
        for trial in range(20):
            ctl.begin(trial, 0, 4)
            out = model(tokens(2, 20), attention_mask=mask).logits
            assert torch.isfinite(out).all()
            if bool((ctl.last_indices()[:, 0] >= 2).all(-1).any()):  # a layer kept only padding for sample 0
                break
        else:
            pytest.fail("no draw kept only padding tokens")


# ------------------------------------------------------------------------------------------------ binding, keys


def test_exact_layer_binding_and_teardown():
    model = gpt2()
    blocks = list(model.transformer.h)
    originals = [b.forward for b in blocks]
    patched, _ = converted(model, layer_ids=(1, 2))
    assert [isinstance(b.__dict__.get("forward"), LTDForward) for b in blocks] == [False, True, True, False]
    assert patched.layers[0] is blocks[1] and patched.layers[1] is blocks[2]
    assert model.config.use_cache is False
    restore(patched)
    assert all("forward" not in b.__dict__ for b in blocks)
    assert [b.forward for b in blocks] == originals


@pytest.mark.parametrize(
    ("ids", "match"), [((1, 4), "out of range"), ((2, 2), "duplicate"), ((2, 1), "sorted"), ((), "at least one")]
)
def test_bad_layer_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        converted(gpt2(), layer_ids=ids)


def test_state_dict_keys_unchanged_and_deepspeed_keys_import():
    model = gpt2()
    before = model.state_dict()
    patched, _ = converted(model)
    after = model.state_dict()
    assert list(before) == list(after) and all(before[k].shape == after[k].shape for k in before)
    plain = gpt2()
    plain.load_state_dict(after)  # a checkpoint of the converted model loads into the plain one and back
    model.load_state_dict(plain.state_dict())
    wrapped = {k.replace("transformer.h.1.", "transformer.h.1.random_ltd_layer."): v for k, v in after.items()}
    assert any(".random_ltd_layer." in k for k in wrapped)
    plain.load_state_dict(strip_random_ltd_keys(wrapped))
    restore(patched)


def test_deepcopy_of_a_converted_model_patches_the_copy():
    model = gpt2()
    _, ctl = converted(model)
    clone = copy.deepcopy(model)
    fwd = clone.transformer.h[1].__dict__["forward"]
    assert isinstance(fwd, LTDForward) and fwd.original.__self__ is clone.transformer.h[1] and fwd.controller is ctl
    ctl.begin(0, 0, 8)
    assert torch.equal(clone(tokens()).logits, model(tokens()).logits)


# ------------------------------------------------------------------------------------------------ recomputation


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_activation_checkpointing_gives_the_same_gradients(reentrant):
    grads = []
    for ckpt in (False, True):
        model = gpt2()
        if ckpt:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        _, ctl = converted(model)
        ctl.begin(5, 1, 8)
        model(tokens(), labels=tokens()).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        assert ctl.draws == 1
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize("record_calls", [False, True])
def test_timm_checkpointing_reuses_the_indices(record_calls):
    """With the callback's call recording on (record_calls=True, for its FLOPs accounting) too: the note's extra
    gather inside timm's non-reentrant checkpoint made torch's recompute count fewer saved tensors (CheckpointError
    at the first backward); each LTD layer's call is noted once, in the forward, not in the recompute."""
    grads, lookups = [], []
    for ckpt in (False, True):
        model = vit()
        model.set_grad_checkpointing(ckpt)
        _, ctl = converted(model, record_calls=record_calls)
        ctl.begin(2, 0, 24)
        model(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        lookups.append(ctl.lookups)
        assert ctl.draws == 1
        assert sorted(key[0] for key in ctl.calls) == ([1, 2] if record_calls else [])
    assert lookups == [2, 4]  # the recompute looks the indices up again and does not redraw
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=1e-7, msg=name)


# ------------------------------------------------------------------------------------------------ bad input


def test_unknown_positional_arguments_are_rejected_at_conversion():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, rope, *extra):
            return self.lin(x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    ad = GenericAdapter("blocks", max_sequence_length=16, hidden_size=8)
    with pytest.raises(ValueError, match="'rope' that adapter"):
        convert(Net(), ad, LTDController(3, (1,)))
    ad = GenericAdapter("blocks", max_sequence_length=16, hidden_size=8, passthrough=["rope"])
    with pytest.raises(ValueError, match=r"\*extra"):
        convert(Net(), ad, LTDController(3, (1,)))


def test_undeclared_sequence_tensor_in_kwargs_is_rejected():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, **kwargs):
            return self.lin(x)

    net = torch.nn.Module()
    net.blocks = torch.nn.ModuleList(Block() for _ in range(3))
    ad = GenericAdapter("blocks", max_sequence_length=16, hidden_size=8)
    ctl = LTDController(3, (1,))
    convert(net, ad, ctl)
    ctl.begin(0, 0, 4)
    x = torch.randn(2, 10, 8)
    net.blocks[1](x, scale=2.0)  # non-tensors pass
    with pytest.raises(RuntimeError, match="'bias' of shape"):
        net.blocks[1](x, bias=torch.randn(2, 10, 10))


def test_unknown_adapter_and_unsupported_attention():
    with pytest.raises(ValueError, match="no model inside"):
        find_adapter(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="unknown adapter 'gpt3'"):
        find_adapter(gpt2(), "gpt3")
    from types import SimpleNamespace

    from lightning_effi.models.gpt2 import check_attention

    with pytest.raises(ValueError, match="flex_attention"):
        check_attention(SimpleNamespace(_attn_implementation="flex_attention"), "hf_gpt2")
    check_attention(SimpleNamespace(_attn_implementation="sdpa"), "hf_gpt2")


def test_cache_while_dropping_is_an_error():
    model = gpt2()
    _, ctl = converted(model)
    model.config.use_cache = True  # a user turning the cache back on
    ctl.begin(0, 0, 4)
    with pytest.raises(RuntimeError, match="use_cache=False"):
        model(tokens(), use_cache=True)


# ------------------------------------------------------------------------------------------------ family registry


def test_registered_families_list_what_each_supports():
    families = registered_families()
    assert {name: families[name] for name in ("hf_gpt2", "hf_bert", "timm_vit")} == {
        "hf_gpt2": ("random_ltd", "vcycle"),
        "hf_bert": ("random_ltd", "vcycle"),
        "timm_vit": ("random_ltd", "vcycle"),
    }
    assert list(families) == sorted(families)
    expected = {
        "hf_gpt2": (HFGPT2Adapter, HFGPT2VCycleAdapter),
        "hf_bert": (HFBertAdapter, HFBertVCycleAdapter),
        "timm_vit": (TimmViTAdapter, TimmViTVCycleAdapter),
    }
    for name, (ltd_cls, vcycle_cls) in expected.items():
        fam = registry.family(name)
        assert fam.adapter("random_ltd") is ltd_cls and fam.adapter("vcycle") is vcycle_cls
        assert vcycle_cls.name == name
    # the four per-technique functions are views over the one registry
    assert registered_adapters() == sorted(n for n, t in families.items() if "random_ltd" in t)
    assert registered_vcycle_adapters() == sorted(n for n, t in families.items() if "vcycle" in t)
    with pytest.raises(KeyError, match="unknown model family 'gpt3'"):
        registry.family("gpt3")


def test_registering_a_family_adapter_twice_raises_and_a_new_family_is_listed():
    with pytest.raises(ValueError, match="adapter 'hf_gpt2' is already registered"):
        register_adapter("hf_gpt2", TimmViTAdapter)
    with pytest.raises(ValueError, match="V-cycle adapter 'hf_bert' is already registered"):
        register_vcycle_adapter(type("Other", (HFBertVCycleAdapter,), {}))
    assert register_adapter("hf_gpt2", HFGPT2Adapter) is HFGPT2Adapter  # the same class again is a no-op
    name = "test_only_family"
    try:
        register_adapter(name, HFGPT2Adapter)
        assert registered_families()[name] == ("random_ltd",)
        assert name in registered_adapters() and name not in registered_vcycle_adapters()
    finally:
        registry._FAMILIES.pop(name, None)
    assert name not in registered_families()
