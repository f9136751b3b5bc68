"""The ``torch_blocks`` V-cycle adapter (``lightning_effi/models/torch_transformer.py``) on hand-written transformers:
which block list it picks, round trips and function preservation of the operators, what width coalescing refuses,
and the callback on the user's own ``nn.TransformerEncoder`` classifier (``tests/user_modules/modules.py``): levels
visited, weights at the switches, exact resume from a coarse-stage checkpoint."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_effi.callbacks import VCycleCallback
from lightning_effi.functional import vcycle as V
from lightning_effi.models import registry
from lightning_effi.models.torch_transformer import (
    BlockList,
    TorchBlocksVCycleAdapter,
    block_lists,
    find_block_list,
    stream_ends,
)
from lightning_effi.models.vcycle_base import (
    HFGPT2VCycleAdapter,
    TimmViTVCycleAdapter,
    find_vcycle_adapter,
    find_vcycle_network,
)
from tests.helpers.harness import assert_resume_equals_uninterrupted, make_trainer
from tests.helpers.tiny import TinyDataModule
from tests.user_modules.modules import Encoder, EncoderClassifier, TokenLabels, UserData
from tests.vcycle import models as M

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's small-run and num_workers warnings
ADAPTER = TorchBlocksVCycleAdapter()


# ---------------------------------------------------------------------------------------------------------- networks
class PreNormLM(nn.Module):
    """Pre-LN causal LM: GELU layers with 4 heads, a final LayerNorm, an output head tied to the embedding or not."""

    def __init__(self, vocab: int = 40, width: int = 32, depth: int = 4, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(1, 16, width))
        layer = nn.TransformerEncoderLayer(
            width, 4, 48, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, depth, norm=nn.LayerNorm(width), enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.encoder(self.embed(tokens) + self.pos[:, : tokens.shape[1]], mask=mask, is_causal=True))


class Seq2Seq(nn.Module):
    """``nn.TransformerDecoder`` (sequence-first) whose memory is an embedding of the source tokens."""

    def __init__(self, vocab: int = 40, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.src, self.tgt = nn.Embedding(vocab, width), nn.Embedding(vocab, width)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(width, 2, 64, dropout=0.0), depth)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(self.tgt(tokens).transpose(0, 1), self.src(tokens.flip(1)).transpose(0, 1)))


class Head(nn.Module):
    def __init__(self, width: int, size: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, size, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x), is_causal=True)


class Block(nn.Module):
    """A hand-written pre-LN block whose heads are a ModuleList (longer than the block list)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.heads = nn.ModuleList(Head(width, width // heads) for _ in range(heads))
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.proj(torch.cat([head(h) for head in self.heads], -1))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Custom blocks in an ``nn.Sequential`` (6 heads each, 4 blocks), learned positions, a classifier head."""

    def __init__(self, vocab: int = 32, width: int = 24, depth: int = 4, classes: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(16, width)
        self.blocks = nn.Sequential(*(Block(width, 6) for _ in range(depth)))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.head(self.ln_f(self.blocks(h)).mean(1))


class TwoTowers(nn.Module):
    def __init__(self, depth_b: int = 2) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.a = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.b = nn.TransformerEncoder(layer, depth_b, enable_nested_tensor=False)


def encoder(seed: int = 0, **kw: Any) -> Encoder:
    torch.manual_seed(seed)
    return M.perturb(Encoder(**kw), seed=seed, std=0.2)


def tokens(n: int = 3, length: int = 12, vocab: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(7))


def assert_sd_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"not bit-identical: {bad}"


# ------------------------------------------------------------------------------------------------- which block list
def test_registered_after_the_hf_and_timm_families_which_keep_their_models():
    order = list(registry.adapters("vcycle"))
    assert order.index("torch_blocks") > max(order.index(n) for n in ("hf_gpt2", "hf_bert", "timm_vit"))
    assert registry.family("torch_blocks").supports == ("vcycle",)
    gpt, vit = M.gpt2(), M.vit()
    assert isinstance(find_vcycle_adapter(gpt), HFGPT2VCycleAdapter)
    assert isinstance(find_vcycle_adapter(vit), TimmViTVCycleAdapter)
    # both hold a list of identical blocks, but another adapter handles them (also when wrapped)
    assert block_lists(gpt) and block_lists(vit)
    assert not TorchBlocksVCycleAdapter.matches(gpt) and not TorchBlocksVCycleAdapter.matches(nn.ModuleDict({"g": gpt}))
    assert isinstance(find_vcycle_adapter(Encoder()), TorchBlocksVCycleAdapter)
    assert not TorchBlocksVCycleAdapter.matches(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))  # bare layers


def test_the_block_list_found():
    found = find_block_list(Encoder())
    assert (found.name, found.prefix, len(found.blocks)) == ("encoder.layers", "encoder.layers.", 4)
    gpt = TinyGPT()  # the 6 heads of every block form longer lists, nested inside the blocks
    assert find_block_list(gpt).name == "blocks" and len(find_block_list(gpt).blocks) == 4
    assert [c.name for c in block_lists(gpt)] == ["blocks"]
    root = nn.Sequential(Block(8, 2), Block(8, 2), Block(8, 2))  # the network is the list
    assert (find_block_list(root).name, find_block_list(root).prefix) == ("", "")
    assert find_block_list(TwoTowers(depth_b=4)).name == "b.layers"  # the longest list
    layer = nn.TransformerEncoderLayer(8, 2, 16)
    shared = nn.Sequential(layer, layer)  # one module twice: not a list of distinct blocks
    with pytest.raises(ValueError, match="holds no nn.ModuleList / nn.Sequential of at least 2 identical blocks"):
        find_block_list(shared)
    with pytest.raises(ValueError, match="1 distinct block"):
        BlockList.at(shared, "")


def test_two_equally_long_lists_are_refused_by_name(tmp_path):
    msg = (
        r"torch_blocks: TwoTowers holds 2 equally long lists of identical blocks: 'a\.layers' \(2 x "
        r"TransformerEncoderLayer\), 'b\.layers' \(2 x TransformerEncoderLayer\); the V-cycle coalesces one list and "
        r"cannot tell which\. Subclass .*TorchBlocksVCycleAdapter with block_list = "
    )
    with pytest.raises(ValueError, match=msg):
        find_block_list(TwoTowers())
    with pytest.raises(ValueError, match=msg):
        ADAPTER.plan(TwoTowers(), None)

    class Host(EncoderClassifier):  # the callback's setup raises it
        def __init__(self) -> None:
            super().__init__()
            self.net = TwoTowers()

    trainer = make_trainer(tmp_path, [VCycleCallback(e_a=1, e_small=1)], max_steps=4, max_epochs=-1)
    with pytest.raises(ValueError, match=msg):
        trainer.fit(Host(), datamodule=UserData(TokenLabels()))

    class PickA(TorchBlocksVCycleAdapter):  # the documented way out: name the list
        def block_list(self, model: nn.Module) -> BlockList:
            return BlockList.at(model, "a.layers")

    model = TwoTowers()
    plan = PickA().plan(model, None)  # width: b's layers are outside the list, unknown: depth only
    small = V.coalesce_model(model, plan, PickA())
    assert (len(small.a.layers), small.a.num_layers, len(small.b.layers)) == (1, 1, 2)
    assert_sd_equal({k: v for k, v in small.state_dict().items() if k.startswith("b.")},
                    {k: v for k, v in model.state_dict().items() if k.startswith("b.")})  # fmt: skip


# ------------------------------------------------------------------------------------------------------- round trips
ROUND_TRIPS = [
    (Encoder, "half", "adjacent", "official"),
    (Encoder, "half", "half", "exact"),
    (Encoder, [[1, 0]], [[3, 0], [1], [2]], "official"),
    (Encoder, None, "adjacent", "official"),
    (Encoder, "half", None, "official"),
    (PreNormLM, "half", "adjacent", "official"),
    (PreNormLM, [[0, 3], [2, 1]], [[0, 1, 2], [3]], "exact"),
    (lambda: PreNormLM(tied=True), "half", "adjacent", "official"),
    (Seq2Seq, "half", "adjacent", "official"),
    (TinyGPT, None, "adjacent", "official"),
    (TinyGPT, None, [[0, 1, 2], [3]], "official"),
]


@pytest.mark.parametrize("build, width, depth, convention", ROUND_TRIPS)
def test_round_trip_is_exact_and_shapes_are_the_original(build, width, depth, convention):
    torch.manual_seed(0)
    model = M.perturb(build(), seed=1, std=0.2)
    before = copy.deepcopy(model.state_dict())
    plan = ADAPTER.plan(model, width, depth, convention)
    small = V.coalesce_model(model, plan, ADAPTER)  # strict load into build_small's network
    sd = M.perturb(small, seed=2, std=0.3).state_dict()  # any small weights
    big = V.decoalesce(sd, plan)
    assert {k: tuple(v.shape) for k, v in big.items()} == {k: tuple(v.shape) for k, v in before.items()}
    assert_sd_equal(V.coalesce(big, plan), sd)  # Co(De(W)) == W bit for bit
    assert_sd_equal(model.state_dict(), before)  # pure: the large network untouched
    large = copy.deepcopy(model)
    large.load_state_dict(big)  # strict: the original parameter names
    assert type(small) is type(model) and len(find_block_list(small).blocks) == plan.num_layers[1]


def test_tied_embedding_and_head():
    model = M.perturb(PreNormLM(tied=True), seed=1)
    plan = ADAPTER.plan(model, "half", None, "official")
    sd = V.coalesce(model, plan)
    table = model.embed.weight.detach()
    assert torch.equal(sd["embed.weight"], table[:, :16] + table[:, 16:])  # average x2: the sum the head needs
    assert sd["head.weight"] is sd["embed.weight"]
    small = V.coalesce_model(model, plan, ADAPTER)
    assert small.head.weight is small.embed.weight  # the tie survives build_small and the strict load
    with pytest.raises(ValueError, match=r"(?s)embed\.weight, head\.weight: an embedding table tied to an output head "
                       r"under embedding_convention='exact'.*width_scheme=None"):  # fmt: skip
        ADAPTER.plan(model, "half", None, "exact")
    ADAPTER.plan(model, None, "adjacent", "exact")  # depth only: nothing to map


# ---------------------------------------------------------------------------------------------- function preservation
@pytest.mark.parametrize(
    "build, width",
    [(Encoder, "half"), (Encoder, [[1, 0]]), (PreNormLM, "half"), (PreNormLM, [[0, 3], [2, 1]]), (Seq2Seq, "half")],
)
@pytest.mark.parametrize("convention", ["official", "exact"])
def test_width_decoalescing_is_function_preserving(build, width, convention):
    torch.manual_seed(0)
    model = build().eval()
    plan = ADAPTER.plan(model, width, None, convention)
    small = M.perturb(ADAPTER.build_small(model, plan), seed=5, std=0.3).eval()
    model.load_state_dict(V.decoalesce(small, plan))
    x = tokens(vocab=32)
    with torch.no_grad():
        a, b = small(x), model(x)
    assert a.abs().max() > 0.1  # not a degenerate output
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_depth_operators():
    model = encoder()
    large = model.state_dict()
    key = "encoder.layers.{}.linear1.weight"
    for scheme, order in (("adjacent", [0, 0, 1, 1]), ("half", [0, 1, 0, 1])):
        plan = ADAPTER.plan(model, None, scheme)
        sd = V.coalesce(model, plan)
        first = (0, 1) if scheme == "adjacent" else (0, 2)
        assert torch.equal(sd[key.format(0)], (large[key.format(first[0])] + large[key.format(first[1])]) * 0.5)
        big = V.decoalesce(sd, plan)
        for s, i in enumerate(order):  # de-coalesced block s is a copy of small block i, every tensor of it
            prefix, small_prefix = f"encoder.layers.{s}.", f"encoder.layers.{i}."
            assert all(
                torch.equal(v, sd[small_prefix + k[len(prefix) :]]) for k, v in big.items() if k.startswith(prefix)
            )
        # outside the blocks: unchanged
        assert all(torch.equal(sd[k], large[k]) for k in ("embed.weight", "pos", "head.weight", "head.bias"))
    # adjacent blocks equal: coalescing then de-coalescing gives the network back, bit for bit
    for s in (1, 3):
        model.encoder.layers[s].load_state_dict(model.encoder.layers[s - 1].state_dict())
    plan = ADAPTER.plan(model, None, "adjacent")
    assert_sd_equal(V.decoalesce(V.coalesce(model, plan), plan), model.state_dict())
    # width and depth: a network in the image of de-coalescing comes back bit for bit
    plan = ADAPTER.plan(model, "half", "adjacent")
    image = V.decoalesce(M.perturb(ADAPTER.build_small(model, plan), seed=4).state_dict(), plan)
    assert_sd_equal(V.decoalesce(V.coalesce(image, plan), plan), image)


def test_levels_sizes_and_what_cannot_be_halved():
    model = Encoder()
    plans = V.plan_levels(model, ADAPTER, 3, None, "adjacent")
    assert [p.num_layers for p in plans] == [(4, 2), (2, 1)]
    with pytest.raises(ValueError, match=r"nhead=1 cannot be halved"):  # 2 heads -> 1 -> ?
        V.plan_levels(model, ADAPTER, 3)
    with pytest.raises(ValueError, match=r"len\(encoder\.layers\): depth scheme 'adjacent' needs an even number"):
        ADAPTER.plan(Encoder(depth=3))
    plan = ADAPTER.plan(Encoder(depth=3), "half", [[0, 1], [2]])
    assert plan.info["small"] == {"hidden": 16, "heads": 1, "ffn": 32, "layers": 2}
    assert plan.info["blocks"] == "encoder.layers" and plan.info["width"] is True


# ---------------------------------------------------------------------------------------------------- width refusals
def _pos_2d(m: Encoder) -> None:
    m.pos = nn.Parameter(torch.zeros(64, 32))


def _pe_buffer(m: Encoder) -> None:
    m.register_buffer("pe", torch.zeros(1, 64, 32))


def _square_linear(m: Encoder) -> None:
    m.proj = nn.Linear(32, 32)


def _int_attribute(m: Encoder) -> None:
    m.d_model = 32


def _attention_pool(m: Encoder) -> None:
    m.pool = nn.MultiheadAttention(32, 2, batch_first=True)


@pytest.mark.parametrize(
    "change, listed",
    [
        (_pos_2d, r"pos \(parameter of shape \[64, 32\] on Encoder\)"),
        (_pe_buffer, r"pe \(buffer of shape \[1, 64, 32\] on Encoder\): a fixed tensor"),
        (_square_linear, r"proj\.weight \(Linear 32 -> 32\): reads and writes d_model features"),
        (_int_attribute, r"<root>\.d_model = 32 \(Encoder\): equals d_model"),
        (_attention_pool, r"pool\.in_proj_weight \(parameter of shape \[96, 32\] on MultiheadAttention\)"),
    ],
)
def test_width_refuses_tensors_it_cannot_map_with_certainty(change, listed):
    model = Encoder()
    change(model)
    outside = r"(?s)torch_blocks: width coalescing of Encoder maps every tensor outside 'encoder\.layers' \(4 x "
    with pytest.raises(ValueError, match=rf"{outside}TransformerEncoderLayer\).*{listed}.*Pass width_scheme=None"):
        ADAPTER.plan(model)
    plan = ADAPTER.plan(model, None)  # depth only: everything outside the blocks is kept
    small = V.coalesce_model(model, plan, ADAPTER)
    kept = [k for k in model.state_dict() if not k.startswith("encoder.")]
    assert all(torch.equal(small.state_dict()[k], model.state_dict()[k]) for k in kept)


class SeriesNet(nn.Module):
    """A time-series network: an input projection, a learned position table ``[1, T, 32]``, 2 encoder layers, a
    head."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.inp, self.pos = nn.Linear(4, 32), nn.Parameter(torch.zeros(1, length, 32))
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.enc, self.head = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.inp(x) + self.pos[:, : x.shape[1]]).mean(1))


def test_a_position_table_as_long_as_d_model_is_refused_naming_the_ambiguity():
    """A table [1, T, d_model] is mapped on its last axis; with T = d_model the shape cannot tell it from a
    [d_model, d_model] weight, and the refusal said its d_model axis "is not the last axis" (it is)."""
    ADAPTER.plan(SeriesNet(24))  # mapped
    with pytest.raises(ValueError, match=r"pos \(parameter of shape \[1, 32, 32\].*token axis N = 32 equals d_model "
                       r"= 32.*vector\('E', -1\)"):  # fmt: skip
        ADAPTER.plan(SeriesNet(32))


def test_width_refuses_custom_blocks_and_shared_tensors():
    only = r"width coalescing maps nn\.TransformerEncoderLayer / nn\.TransformerDecoderLayer blocks only"
    with pytest.raises(ValueError, match=rf"{only} .* 'blocks' \(4 x Block\) in TinyGPT .* Pass width_scheme=None"):
        ADAPTER.plan(TinyGPT())
    # the other way out: an adapter of one's own maps the width of any block whose parameters it names
    with pytest.raises(ValueError, match=r"or write a V-cycle adapter .* subclass .*vcycle_base\.VCycleAdapter .*"
                       r"VCycleCallback\(adapter=\.\.\.\)"):  # fmt: skip
        ADAPTER.plan(TinyGPT())
    model = Encoder()
    model.last = model.encoder.layers[3].norm2  # a block's tensors reachable from outside
    with pytest.raises(ValueError, match=r"shares tensors .*'last\.weight = encoder\.layers\.3\.norm2\.weight'"):
        ADAPTER.plan(model, None)


class EmbedOnly(nn.Module):
    """An embedding and the blocks, no head: the 32-wide output is read outside the network."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 32)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True), 4, enable_nested_tensor=False
        )


class SquareProjection(EmbedOnly):
    """A CLIP text tower: the embedding, the blocks and a projection into a joint space as wide as d_model."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)


def _bare_encoder() -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)


def test_stream_ends_found_outside_the_blocks():
    found = find_block_list(Encoder())
    assert stream_ends(Encoder(), found, 32) == (["embed"], ["head"])
    gpt = TinyGPT()  # positions are an nn.Embedding of the width too; ln_f is neither
    assert stream_ends(gpt, find_block_list(gpt), 24) == (["tok", "pos"], ["head"])
    seq = Seq2Seq()
    assert stream_ends(seq, find_block_list(seq), 32) == (["src", "tgt"], ["head"])
    bare = _bare_encoder()  # the layers' own Linear / LayerNorm modules are inside the list: not counted
    assert stream_ends(bare, find_block_list(bare), 32) == ([], [])
    model = Encoder()
    model.proj = nn.Linear(32, 32)  # d_model on both sides: neither an input nor a head
    assert stream_ends(model, find_block_list(model), 32) == (["embed"], ["head"])


def test_width_coalesces_a_head_tied_to_the_embedding_as_the_refusal_advises():
    """The way out the refusal names for a head by hand (``F.linear(h, embed.weight)``): a tied ``nn.Linear``."""
    model = EmbedOnly()
    model.embed, model.head = nn.Embedding(50, 32), nn.Linear(32, 50, bias=False)
    model.head.weight = model.embed.weight
    small = V.coalesce_model(model, ADAPTER.plan(model), ADAPTER)
    assert small.embed.weight.shape == (50, 16) and small.head.weight is small.embed.weight


@pytest.mark.parametrize(
    "build, missing",
    [
        (_bare_encoder, r"no input projection to d_model=32 .*; and it has no head reading d_model=32"),
        (
            EmbedOnly,
            r"no head reading d_model=32 \(an nn\.Linear with in_features=32 and another out_features\), so its "
            r"32-wide output is read",
        ),
        # a d_model -> d_model projection was not named; the refusal read as if the tower had no head (qa111-multimodal
        # 03)
        (
            SquareProjection,
            r"no head .* \(its nn\.Linear\(32, 32\) proj reads and writes d_model features: whether its output is "
            r"the coalesced stream or a width of its own that must stay cannot be told",
        ),
        # a head by hand through the embedding's weight (qa57-seq 05): the tied nn.Linear named as the way out
        (
            EmbedOnly,
            r"no head .* \(a head written as F\.linear\(h, self\.embed\.weight\), weight tying by hand, is not "
            r"seen: hold it as a tied nn\.Linear",
        ),
    ],
)
def test_width_refuses_a_network_fed_hidden_states_from_outside(build, missing):
    """A bare nn.TransformerEncoder (the LightningModule holds the embedding and the head) is refused for width at
    plan time with what to do; depth only coalesces it and keeps its width."""
    torch.manual_seed(0)
    model = build()
    name = type(model).__name__
    with pytest.raises(
        ValueError,
        match=rf"(?s)torch_blocks: width coalescing of {name} \(the network the V-cycle coalesces, blocks .*\) is "
        rf"refused: it has {missing}.*Pass width_scheme=None \(VCycleCallback\(width_scheme=None\)\)",
    ):
        ADAPTER.plan(model)
    plan = ADAPTER.plan(model, None)
    small = V.coalesce_model(model, plan, ADAPTER)
    assert len(find_block_list(small).blocks) == 2
    assert find_block_list(small).blocks[0].self_attn.embed_dim == 32


class OuterLM(pl.LightningModule):
    """A causal LM whose embedding, positions and head belong to the LightningModule and whose encoder is
    ``self.encoder = nn.TransformerEncoder(...)`` (the V-cycle finds ``encoder``, fed 32-wide states from outside)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 32)
        self.pos = nn.Parameter(torch.zeros(1, 64, 32))
        self.encoder = _bare_encoder()
        self.head = nn.Linear(32, 32)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1] - 1)
        h = self.encoder(self.emb(x[:, :-1]) + self.pos[:, : x.shape[1] - 1], mask=mask, is_causal=True)
        return F.cross_entropy(self.head(h).transpose(1, 2), x[:, 1:])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_callback_refuses_width_on_an_encoder_fed_from_outside_at_setup(tmp_path):
    class Steps(Callback):
        def __init__(self) -> None:
            self.layers: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.layers.append(len(pl_module.encoder.layers))

    steps = Steps()
    trainer = make_trainer(tmp_path, [VCycleCallback(e_a=1, e_small=2), steps], max_steps=4, max_epochs=-1)
    with pytest.raises(ValueError, match=r"width coalescing of TransformerEncoder .*no input projection to d_model=32"):
        trainer.fit(OuterLM(), datamodule=UserData(TokenLabels()))
    assert trainer.global_step == 0 and steps.layers == []  # at setup: no step ran
    pl.seed_everything(0)
    module = OuterLM()
    shapes = {k: v.shape for k, v in module.state_dict().items()}
    cb = VCycleCallback(e_a=1, e_small=2, width_scheme=None)
    trainer = make_trainer(tmp_path, [cb, steps], max_steps=4, max_epochs=-1)
    trainer.fit(module, datamodule=UserData(TokenLabels()))
    assert cb.model_attr == "encoder" and trainer.global_step == 4
    assert steps.layers == [
        2,
        2,
        4,
        4,
    ]  # seen after each step: down at the end of step 1 (e_a=1), up at the end of step 3
    assert {k: v.shape for k, v in module.state_dict().items()} == shapes


# ----------------------------------------------------------------------------------------------------- the callback
class Sizes(Callback):
    """Per optimizer step: the network, its state dict, its depth and width, the optimizer's parameters."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, Any]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        net = pl_module.net
        self.steps[trainer.global_step] = {
            "net": net,
            "state": copy.deepcopy(net.state_dict()),
            "sizes": (len(net.encoder.layers), net.encoder.num_layers, net.embed.embedding_dim),
            "opt_ids": {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]},
            "module_ids": {id(p) for p in pl_module.parameters()},
        }


def test_callback_trains_the_users_encoder_through_the_coarse_level(tmp_path):
    pre, post = Sizes(), Sizes()
    cb = VCycleCallback(e_a="0.2dur", e_small="0.4dur", alpha_original=0.3)  # no model_attr: finds `net`
    pl.seed_everything(0)
    module = EncoderClassifier()
    original = module.net
    names = {k: tuple(v.shape) for k, v in original.state_dict().items()}
    trainer = make_trainer(tmp_path, [pre, cb, post], max_steps=10, max_epochs=-1)
    trainer.fit(module, datamodule=UserData(TokenLabels()))
    assert trainer.global_step == 10 and cb.model_attr == "net" and cb.adapter.name == "torch_blocks"
    sizes = {s: post.steps[s]["sizes"] for s in sorted(post.steps)}
    coarse, full = (2, 2, 16), (4, 4, 32)
    assert sizes == {s: coarse if 2 <= s < 6 else full for s in range(1, 11)}  # 2 full, 4 coarse, 4 full steps
    for rec in post.steps.values():  # the optimizer holds exactly the network in place
        assert rec["opt_ids"] == rec["module_ids"] == {id(p) for p in rec["net"].parameters()}
    # the weights at the switches, computed by hand with the functional operators
    plan = ADAPTER.plan(original, "half", "adjacent", "official")
    assert_sd_equal(post.steps[2]["state"], V.coalesce(pre.steps[2]["state"], plan))
    expected = V.interpolate(V.decoalesce(pre.steps[6]["state"], plan), pre.steps[2]["state"], 0.3)
    assert_sd_equal(post.steps[6]["state"], {k: v.to(post.steps[6]["state"][k].dtype) for k, v in expected.items()})
    # back on the full model: the original module, names and shapes
    assert module.net is original and cb.level == 1 and cb.switches == 2
    assert {k: tuple(v.shape) for k, v in module.net.state_dict().items()} == names
    assert list(dict(module.named_parameters())) == ["net." + k for k in dict(original.named_parameters())]


def test_callback_depth_only_on_custom_blocks(tmp_path):
    class GPTClassifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyGPT()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = make_trainer(tmp_path, [VCycleCallback(e_a=1, e_small=2)], max_steps=4, max_epochs=-1)
    with pytest.raises(ValueError, match="Pass width_scheme=None"):  # the default width scheme: a clear refusal
        trainer.fit(GPTClassifier(), datamodule=UserData(TokenLabels()))
    depths: list[int] = []

    class Depth(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            depths.append(len(pl_module.model.blocks))

    cb = VCycleCallback(e_a=1, e_small=2, width_scheme=None)
    trainer = make_trainer(tmp_path, [cb, Depth()], max_steps=4, max_epochs=-1)
    module = GPTClassifier()
    shapes = {k: v.shape for k, v in module.state_dict().items()}
    trainer.fit(module, datamodule=UserData(TokenLabels()))
    assert depths == [2, 2, 4, 4] and {k: v.shape for k, v in module.state_dict().items()} == shapes


@pytest.mark.parametrize("resume_step", [2, 4])  # right after the down-switch; inside the coarse stage
def test_resume_from_a_coarse_stage_equals_the_uninterrupted_run(tmp_path, resume_step):
    assert_resume_equals_uninterrupted(
        EncoderClassifier,
        lambda: TinyDataModule(TokenLabels(), batch_size=4),  # a resumable loader: mid-epoch resume is exact
        tmp_path,
        total_steps=10,
        resume_step=resume_step,
        callbacks_fn=lambda: [VCycleCallback(e_a="0.2dur", e_small="0.4dur", alpha_original=0.3)],
        ignore_state=("map_seconds",),
    )


def test_network_found_in_a_module_with_other_children():
    class Host(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.loss_fn = Encoder(), nn.CrossEntropyLoss()
            self.probe = nn.Linear(32, 2)

    attr, adapter = find_vcycle_network(Host())
    assert attr == "net" and isinstance(adapter, TorchBlocksVCycleAdapter)


@pytest.mark.parametrize(
    ("window_layers", "refused"),
    [(None, False), (2, True), (0, False)],  # all full; [full, full, sliding, sliding]; all sliding
)
def test_depth_coalescing_is_refused_where_a_group_holds_another_layer_kind(window_layers, refused):
    """A Hugging Face config's ``layer_types`` is read by position: the coarse block made from sliding-window layers
    2 and 3 ran as block 1, a full-attention layer, in silence (qa102-nlp 06)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, use_sliding_window=window_layers is not None, sliding_window=4,
        max_window_layers=window_layers or 0,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    assert len(set(model.config.layer_types)) == (2 if refused else 1)
    if not refused:
        assert ADAPTER.plan(model, width_scheme=None, depth_scheme="adjacent").num_layers == (4, 2)
        return
    with pytest.raises(
        ValueError,
        match=r"depth coalescing of Qwen2ForCausalLM is refused: .*config.layer_types = \['full_attention', "
        r"'full_attention', 'sliding_attention', 'sliding_attention'\].* coarse block 1 would run as a "
        r"'full_attention' layer where its group, blocks \[2, 3\]",
    ):
        ADAPTER.plan(model, width_scheme=None, depth_scheme="adjacent")
    # groups each of their coarse block's kind: block 2 <- [2, 3], both sliding
    assert ADAPTER.plan(model, width_scheme=None, depth_scheme=[[0], [1], [2, 3]]).num_layers == (4, 3)
