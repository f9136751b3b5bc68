"""A user's own V-cycle adapter for blocks of their own class (a fused-qkv pre-norm GPT), written as the method card's
"An adapter of your own" says and passed as ``VCycleCallback(adapter=...)``: the built-in ``torch_blocks`` adapter
refuses these blocks for width, the user's adapter coalesces width and depth, function-preserving for width."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_effi.callbacks import VCycleCallback
from lightning_effi.functional import vcycle as V
from lightning_effi.models.torch_transformer import TorchBlocksVCycleAdapter
from lightning_effi.models.vcycle_base import ArchSizes, VCycleAdapter, input_only, linear, vector
from tests.helpers.harness import make_trainer
from tests.user_modules.modules import TokenLabels, UserData
from tests.vcycle import models as M


class FusedBlock(nn.Module):
    """Pre-norm, one fused ``[Q; K; V]`` projection, causal attention."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MyGPT(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 32, h: int = 4, layers: int = 4, length: int = 16) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.zeros(1, length, d))
        self.blocks = nn.ModuleList(FusedBlock(d, h) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.tok(x) + self.pos[:, : x.shape[1]]
        for block in self.blocks:
            z = block(z)
        return self.head(self.ln_f(z))


class MyGPTAdapter(VCycleAdapter):
    name = "my_gpt"
    models = "MyGPT"

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return type(model) is MyGPT

    def sizes(self, model: nn.Module) -> ArchSizes:
        block = model.blocks[0]
        return ArchSizes(model.tok.embedding_dim, block.h, block.fc1.out_features, len(model.blocks),
                         ("d", "h", "ffn", "layers"))  # fmt: skip

    def layer_prefix(self, model: nn.Module) -> str:
        return "blocks."

    def param_table(self, model, ctx):
        outside = {"tok.weight": vector("E", 1), "pos": vector("E", 2), "head.weight": input_only("E")}
        outside |= {f"ln_f.{p}": vector("E") for p in ("weight", "bias")}
        block = {f"{n}.{p}": vector("E") for n in ("ln1", "ln2") for p in ("weight", "bias")}
        block |= {"qkv.weight": linear("QKV", "E"), "qkv.bias": vector("QKV")}
        block |= {"proj.weight": linear("E", "V"), "proj.bias": vector("E")}
        block |= {"fc1.weight": linear("I", "E"), "fc1.bias": vector("I")}
        block |= {"fc2.weight": linear("E", "I"), "fc2.bias": vector("E")}
        return outside, block

    def build_small(self, model: nn.Module, plan) -> nn.Module:
        s = plan.info["small"]
        small = MyGPT(model.tok.num_embeddings, s["hidden"], s["heads"], s["layers"], model.pos.shape[1])
        return self._finish(model, small, plan)


def tokens() -> torch.Tensor:
    return torch.randint(0, 32, (3, 12), generator=torch.Generator().manual_seed(7))


def test_the_built_in_adapter_refuses_these_blocks_for_width_and_names_the_adapter_route():
    with pytest.raises(ValueError, match=r"cannot be mapped with certainty.*or write a V-cycle adapter"):
        TorchBlocksVCycleAdapter().plan(MyGPT())


@pytest.mark.parametrize("convention", ["official", "exact"])
def test_an_own_adapter_de_coalesces_width_function_preserving_and_round_trips(convention):
    torch.manual_seed(0)
    model, adapter = MyGPT().eval(), MyGPTAdapter()
    plan = adapter.plan(model, "half", "adjacent", convention)
    small = V.coalesce_model(model, plan, adapter)
    assert [len(small.blocks), small.tok.embedding_dim, small.blocks[0].fc1.out_features] == [2, 16, 64]
    assert torch.equal(small.blocks[0].ln1.weight, (model.blocks[0].ln1.weight + model.blocks[1].ln1.weight)[::2] / 2)
    width_only = adapter.plan(model, "half", None, convention)
    small = M.perturb(adapter.build_small(model, width_only), seed=5, std=0.3).eval()
    model.load_state_dict(V.decoalesce(small, width_only))
    with torch.no_grad():
        a, b = small(tokens()), model(tokens())
    assert a.abs().max() > 0.1
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


class LM(pl.LightningModule):
    """The user's module: tuple batches ``(tokens, label)``, trains next-token prediction on the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MyGPT()

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return F.cross_entropy(self.net(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_the_callback_trains_through_the_coarse_level_with_an_own_adapter(tmp_path):
    class Sizes(pl.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, int]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen.append((len(pl_module.net.blocks), pl_module.net.tok.embedding_dim))

    pl.seed_everything(0)
    module, sizes = LM(), Sizes()
    shapes = {k: v.shape for k, v in module.state_dict().items()}
    cb = VCycleCallback(e_a=1, e_small=2, adapter=MyGPTAdapter(), alpha_original=0.25)
    trainer = make_trainer(tmp_path, [cb, sizes], max_steps=5, max_epochs=-1)
    trainer.fit(module, datamodule=UserData(TokenLabels(), batch_size=4))
    assert trainer.global_step == 5
    assert sizes.seen == [(4, 32), (2, 16), (2, 16), (4, 32), (4, 32)]  # step 1 full, steps 2-3 coarse, then full
    assert {k: v.shape for k, v in module.state_dict().items()} == shapes
    assert all(torch.isfinite(p).all() for p in module.parameters())
