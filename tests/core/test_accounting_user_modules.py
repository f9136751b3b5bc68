"""EfficiencyMonitor on LightningModules as users write them (issue #18, item 4): no ``effi_*`` hooks, plain ``loss``
returns, tuple / ``BatchEncoding`` batches. Tokens, layer-tokens and FLOPs are found or measured
(:mod:`lightning_effi.core.measure`) and equal hand counts and the flop counter on the real training step; what
cannot be found warns once, naming the hook to define."""

from __future__ import annotations

import copy
import csv
import dataclasses
import io
import random
import re
import types
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from lightning_effi.callbacks import RandomLTDCallback, VCycleCallback
from lightning_effi.core.accounting import Baseline, EfficiencyMonitor, lengthen_batch
from lightning_effi.core.flops import attention_recompute_flops, transformer_forward_flops, transformer_training_flops
from lightning_effi.core.measure import CallRecorder, FlopsMeter, find_blocks, find_tokens, leaves, row_tokens
from tests.helpers.flops import MeasuredFlops
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import HandLM, HFMixtralLM

B, T, V = 4, 16, 64
QUANTITIES = (
    "samples",
    "tokens",
    "layer_tokens",
    "flops",
    "baseline_tokens",
    "baseline_layer_tokens",
    "baseline_flops",
)


# ------------------------------------------------------------------------------------------- user modules
class UserModule(pl.LightningModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class UserGPT2(UserModule):
    """``(input_ids, labels)`` tuples, the HF loss."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        cfg = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=64, bos_token_id=0, eos_token_id=0)
        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**cfg, **config}))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss


class UserViT(UserModule):
    """``(images, labels)`` tuples, cross-entropy on the timm model's logits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            img_size=32,
            patch_size=8,
            depth=2,
            embed_dim=32,
            num_heads=2,
            num_classes=10,
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)


class UserBert(UserModule):
    """``BatchEncoding`` batches from a padding collate, ``self.model(**batch).loss``."""

    def __init__(self) -> None:
        super().__init__()
        cfg = transformers.BertConfig(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=2,
        )
        self.model = transformers.BertForSequenceClassification(cfg)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss


class UserEncoder(UserModule):
    """A hand-written ``nn.TransformerEncoder`` classifier called as ``self(ids)``."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 32)
        block = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(dim=1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, y = batch
        return F.cross_entropy(self(ids), y)


class UserMLP(UserModule):
    """Float features: no tokens anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.mlp(x), y)


class MetricMLP(UserMLP):
    """UserMLP updating torchmetrics metrics in ``training_step`` (a ``MetricCollection`` and a ``Metric`` called as
    modules): their updates run ``unique`` on the real predictions, which no fake replay can run."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.train_acc = torchmetrics.classification.BinaryAccuracy()
        self.metrics = torchmetrics.MetricCollection({"f1": torchmetrics.classification.MulticlassF1Score(3)})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.mlp(x)
        self.log("train_acc", self.train_acc(logits[:, 0].sigmoid(), (y == 0).long()))
        self.log_dict(self.metrics(logits, y))
        return F.cross_entropy(logits, y)


class BagOfWords(UserModule):
    """Token ids but no transformer blocks; its forward drops the padding id 0 with a data-dependent index."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids[ids > 0]).mean(dim=0, keepdim=True)).expand(ids.shape[0], -1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, y = batch
        return F.cross_entropy(self(ids), y)


class TopKMoE(nn.Module):
    """A top-2 of 4 experts MLP, each expert's rows found with ``nonzero`` (a data-dependent shape); the experts held
    as ``[E, d, f]`` parameters of this module (``as_parameters``, as transformers 5 stores Mixtral's) or as
    modules."""

    def __init__(self, as_parameters: bool, d: int = 16, f: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.as_parameters = as_parameters
        if as_parameters:
            self.w1 = nn.Parameter(torch.randn(experts, d, f) * 0.1)
            self.w2 = nn.Parameter(torch.randn(experts, f, d) * 0.1)
        else:
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(d, f, bias=False), nn.GELU(), nn.Linear(f, d, bias=False))
                for _ in range(experts)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weight, chosen = self.router(h).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(h)
        for e in range(self.router.out_features):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if self.as_parameters:
                y = F.gelu(h[rows] @ self.w1[e]) @ self.w2[e]
            else:
                y = self.experts[e](h[rows])
            out = out.index_add(0, rows, y * weight[rows, slot, None])
        return out.reshape(x.shape)


class MoELM(UserModule):
    def __init__(self, as_parameters: bool) -> None:
        super().__init__()
        self.embed, self.moe, self.head = nn.Embedding(V, 16), TopKMoE(as_parameters), nn.Linear(16, V)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, y = batch
        h = self.embed(ids)
        return F.cross_entropy(self.head(h + self.moe(h)).flatten(0, 1), y.flatten())


# -------------------------------------------------------------------------------------------------- data
def token_loader(n: int = 3 * B, seq: int = T, labels: str = "lm") -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (n, seq), generator=g)
    y = ids if labels == "lm" else torch.randint(0, 10, (n,), generator=g)
    return DataLoader(TensorDataset(ids, y), batch_size=B)


def masked_lm_loader(n: int = 3 * B, masked: bool = True) -> DataLoader:
    """``(ids, labels)`` with about 30% of the positions labelled (the others -100), a different number per batch;
    ``masked=False``: every position labelled."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (n, T), generator=g)
    labels = torch.where(torch.rand(n, T, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    return DataLoader(TensorDataset(ids, labels if masked else ids), batch_size=B)


def image_loader(n: int = 3 * B) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,))), batch_size=B)


def sentences(n: int = 3 * B) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, T + 1, (n,), generator=g)
    return [(torch.randint(1, V, (int(k),), generator=g), i % 2) for i, k in enumerate(lengths)]


def pad_collate(items: list[tuple[torch.Tensor, int]]) -> transformers.BatchEncoding:
    """Pads to the longest sentence of the batch, as ``DataCollatorWithPadding`` does."""
    longest = max(len(ids) for ids, _ in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (x, _) in enumerate(items):
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    labels = torch.tensor([label for _, label in items])
    return transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": labels})


class PerBatch(Callback):
    """After the monitor: what it added to its totals for each training batch."""

    def __init__(self, monitor: EfficiencyMonitor) -> None:
        self.monitor, self.rows = monitor, []
        self._last: dict[str, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        totals = dict(self.monitor.totals)
        self.rows.append({q: totals[q] - self._last.get(q, 0.0) for q in QUANTITIES})
        self._last = totals


def fit(
    module: pl.LightningModule, loader: DataLoader, root: Path, steps: int = 3, extra: tuple[Callback, ...] = ()
) -> tuple[EfficiencyMonitor, MeasuredFlops, PerBatch]:
    """Fit ``steps`` batches with [MeasuredFlops (the flop counter on the real step), EfficiencyMonitor, PerBatch,
    *extra]."""
    measured, monitor = MeasuredFlops(), EfficiencyMonitor(print_summary=False)
    per_batch = PerBatch(monitor)
    make_trainer(root, [measured, monitor, per_batch, *extra], max_steps=steps, max_epochs=-1).fit(module, loader)
    return monitor, measured, per_batch


def monitor_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("EfficiencyMonitor:")]


# --------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpt2_on_tuple_batches(tmp_path: Path, checkpointing: bool) -> None:
    """With activation checkpointing the blocks' forward runs twice: the replay repeats it (not recorded twice)."""
    pl.seed_everything(0)
    module = UserGPT2()
    if checkpointing:
        module.model.activation_checkpointing_enable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, measured, per_batch = fit(module, token_loader(), tmp_path)
    assert monitor_warnings(caught) == []
    # sdpa with attention dropout on the CPU: the math kernel, no recompute of the scores
    hand = transformer_training_flops(B, T, 2, 32, None, V, head="lm")
    if checkpointing:
        hand += transformer_forward_flops(B, T, 2, 32, None, head="none")
    for row, real in zip(per_batch.rows, measured.per_batch, strict=True):
        assert row["tokens"] == B * T and row["layer_tokens"] == 2 * B * T and row["samples"] == B
        assert row["flops"] == hand == real


@pytest.mark.parametrize("frozen", ["embeddings", "embeddings_and_layer_0", "every_layer"])
def test_frozen_layers_under_hf_checkpointing_count_the_backward_through_them(tmp_path: Path, frozen: str) -> None:
    """HF's gradient_checkpointing_enable() registers a hook making the input embeddings' output require grad: the
    backward runs through the frozen layers and recomputes them. The replay's copy had no hooks, so its backward
    stopped at the first trainable layer: 0.68x the step's FLOPs with the embeddings and two layers frozen, 0.32x
    with every layer (qa107-user 01)."""
    pl.seed_everything(0)
    module = UserGPT2()
    gpt = module.model.transformer
    frozen_parts = [gpt.wte, gpt.wpe] + {"embeddings": [], "embeddings_and_layer_0": [gpt.h[0]]}.get(
        frozen, list(gpt.h)
    )
    for part in frozen_parts:
        part.requires_grad_(False)
    module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    monitor, measured, per_batch = fit(module, token_loader(), tmp_path)
    for row, real in zip(per_batch.rows, measured.per_batch, strict=True):
        assert row["flops"] == real


def test_timm_vit_on_tuple_batches(tmp_path: Path) -> None:
    """Tokens are the patches and the class token the first block was called with; layers the ViT's blocks."""
    pl.seed_everything(0)
    monitor, measured, per_batch = fit(UserViT(), image_loader(), tmp_path)
    tokens = B * ((32 // 8) ** 2 + 1)
    patch_embed = 2 * B * 16 * (3 * 8 * 8) * 32  # a convolution on the images: no input gradient, 2x its forward
    hand = (
        3 * transformer_forward_flops(B, 17, 2, 32, None, head="none")
        + attention_recompute_flops(B, 17, 2, 32)  # timm's fused attention, no dropout: the CPU flash kernel
        + 2 * patch_embed
        + 3 * 2 * B * 32 * 10  # the classifier on the class token
    )
    for row, real in zip(per_batch.rows, measured.per_batch, strict=True):
        assert row["tokens"] == tokens and row["layer_tokens"] == 2 * tokens
        assert row["flops"] == hand == real


def test_bert_with_a_padding_collate(tmp_path: Path) -> None:
    """``BatchEncoding`` batches padded per batch: tokens are the attention mask's, the FLOPs each padded length's
    (HF's data-dependent mask checks are skipped on fake tensors)."""
    pl.seed_everything(0)
    loader = DataLoader(sentences(), batch_size=B, collate_fn=pad_collate)
    batches = list(loader)
    monitor, measured, per_batch = fit(UserBert(), loader, tmp_path)
    assert len({b["input_ids"].shape[1] for b in batches}) > 1  # the padded lengths differ
    for row, real, batch in zip(per_batch.rows, measured.per_batch, batches, strict=True):
        tokens = int(batch["attention_mask"].sum())
        assert tokens < batch["input_ids"].numel()
        assert row["tokens"] == tokens and row["layer_tokens"] == 2 * tokens
        length = batch["input_ids"].shape[1]
        assert row["flops"] == transformer_training_flops(B, length, 2, 32, 64, head="cls", num_classes=2) == real


class UserBart(pl.LightningModule):
    """An encoder-decoder the way users write one: HF ``BartForConditionalGeneration`` from its config, a dict batch
    of source ids, their mask and target labels, ``self.model(**batch).loss``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.BartConfig(
            vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        )  # fmt: skip
        self.model = transformers.BartForConditionalGeneration(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_encoder_decoder_says_what_its_tokens_and_layer_tokens_leave_out(tmp_path: Path) -> None:
    """tokens read the encoder's attention mask and layer-tokens one stack's depth: a BART's target tokens and its
    other stack were left out with no word (qa38-user 05). A warning names the encoder-decoder once; the FLOPs are the
    whole network's (measured on the real step)."""
    g = torch.Generator().manual_seed(0)
    source, target = torch.randint(3, V, (2 * B, 8), generator=g), torch.randint(3, V, (2 * B, 12), generator=g)
    rows = [{"input_ids": s, "attention_mask": torch.ones_like(s), "labels": t} for s, t in zip(source, target)]
    loader = DataLoader(rows, batch_size=B)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, measured, per_batch = fit(UserBart(), loader, tmp_path, steps=2)
    said = [w for w in monitor_warnings(caught) if "encoder-decoder" in w]
    assert len(said) == 1 and said[0].startswith("EfficiencyMonitor: BartForConditionalGeneration in UserBart is an")
    assert "compare the runs on FLOPs" in said[0]
    assert "`tokens` count the batch's `attention_mask` and `layer_tokens` multiply them" in said[0]
    assert [row["tokens"] for row in per_batch.rows] == [B * 8] * 2  # the source side, as the warning says
    assert [row["flops"] for row in per_batch.rows] == measured.per_batch
    # a source given as features (Whisper's input_features, here inputs_embeds): the only ids are the targets, which
    # the warning called "the encoder's input" (qa111-audio 01); it names them
    features = [{"inputs_embeds": torch.randn(8, 16, generator=g), "labels": t} for t in target]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, measured, per_batch = fit(UserBart(), DataLoader(features, batch_size=B), tmp_path / "f", steps=2)
    (said,) = [w for w in monitor_warnings(caught) if "encoder-decoder" in w]
    assert "count the batch's `labels` (the decoder's targets, padding included; the encoder's input is not" in said
    assert [row["tokens"] for row in per_batch.rows] == [B * 12] * 2
    with warnings.catch_warnings(record=True) as caught:  # a decoder-only model: nothing to say
        warnings.simplefilter("always")
        fit(UserGPT2(), DataLoader(TensorDataset(source, source), batch_size=B), tmp_path / "gpt", steps=1)
    assert not [w for w in monitor_warnings(caught) if "encoder-decoder" in w]


def test_hand_written_transformer_encoder_called_as_self(tmp_path: Path) -> None:
    """``training_step`` calls ``self(ids)``: the LightningModule's own call is replayed."""
    pl.seed_everything(0)
    monitor, measured, per_batch = fit(UserEncoder(), token_loader(labels="cls"), tmp_path)
    hand = 3 * (transformer_forward_flops(B, T, 3, 32, 64, head="none") + 2 * B * 32 * 10)
    for row, real in zip(per_batch.rows, measured.per_batch, strict=True):
        assert row["tokens"] == B * T and row["layer_tokens"] == 3 * B * T
        assert row["flops"] == hand == real
    assert monitor.summary["flops"] == 3 * hand


def test_what_cannot_be_found_warns_once_naming_the_hook(tmp_path: Path) -> None:
    """An MLP on float features: tokens (and so layer-tokens) read 0 with one warning naming effi_count_tokens, the
    FLOPs are still measured. Token ids without transformer blocks and a forward that cannot be replayed: the
    layer-tokens warning names effi_num_layers, the FLOPs are those of the calls inside it; the fit goes on."""
    g = torch.Generator().manual_seed(0)
    features = DataLoader(TensorDataset(torch.randn(3 * B, 8, generator=g), torch.randint(0, 3, (3 * B,))), B)
    pl.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, measured, per_batch = fit(UserMLP(), features, tmp_path / "mlp")
    messages = monitor_warnings(caught)
    assert len(messages) == 1 and "tokens" in messages[0] and "`effi_count_tokens(batch) -> int`" in messages[0]
    hand = 2 * (2 * B * 8 * 16) + 3 * (2 * B * 16 * 3)  # the first layer's input needs no gradient
    assert [r["flops"] for r in per_batch.rows] == [hand] * 3 == measured.per_batch
    assert monitor.summary["tokens"] == monitor.summary["layer_tokens"] == 0 and monitor.summary["samples"] == 3 * B

    pl.seed_everything(0)  # torchmetrics metrics in the step: not the network's compute, not replayed
    monitor = EfficiencyMonitor(print_summary=False)
    per_batch = PerBatch(monitor)  # (torch's FlopCounterMode on the real step fails on torchmetrics' module calls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path / "metrics", [monitor, per_batch], max_steps=3, max_epochs=-1).fit(MetricMLP(), features)
    assert len(monitor_warnings(caught)) == 1  # tokens only, as above (before: FLOPs could not be replayed, 0)
    assert [r["flops"] for r in per_batch.rows] == [hand] * 3

    pl.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, measured, per_batch = fit(BagOfWords(), token_loader(labels="cls"), tmp_path / "bow")
    (layers,) = monitor_warnings(caught)
    assert layers.startswith("EfficiencyMonitor: layer-tokens") and "`effi_num_layers`" in layers
    s = monitor.summary
    assert s["tokens"] == 3 * B * T and s["layer_tokens"] == 0 and s["batches"] == 3
    # its own call cannot be replayed (ids[ids > 0]: a data-dependent shape), so the calls made directly inside it
    # are, on their recorded shapes: the head on [1, 16], forward and both gradients (the FLOPs read 0 before)
    assert [r["flops"] for r in per_batch.rows] == [3 * 2 * 16 * 10] * 3 == measured.per_batch


class MaskedPatches(UserModule):
    """A masked-autoencoder-style encoder: a class token and position embeddings of its own ([1, 1, D], [1, N, D]:
    added, no FLOPs), its visible patches kept with a boolean index (a data-dependent shape), then a block."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 16)
        self.cls_token, self.pos_embed = nn.Parameter(torch.zeros(1, 1, 16)), nn.Parameter(torch.zeros(1, 8, 16))
        self.block, self.head = nn.Linear(16, 16), nn.Linear(16, 10)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.embed(patches) + self.pos_embed
        visible = x[patches[..., 0] > 0].reshape(x.shape[0], -1, 16)  # every row keeps as many (data built so)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), visible], 1)
        return self.head(self.block(x)[:, 0])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


def test_parameters_a_data_dependent_forward_only_adds_are_not_warned_of(tmp_path: Path) -> None:
    """A cls_token / pos_embed of the module measured through its parts were named as not counted, "the FLOPs too
    low", where they were exact (qa110-regress 01): only a matrix or a stack of them is named."""
    g = torch.Generator().manual_seed(0)
    patches = torch.randn(3 * B, 8, 12, generator=g)
    patches[..., 0] = torch.where(torch.arange(8) % 2 == 0, 1.0, -1.0)  # half the patches visible in every row
    loader = DataLoader(TensorDataset(patches, torch.randint(0, 10, (3 * B,), generator=g)), batch_size=B)
    pl.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, measured, per_batch = fit(MaskedPatches(), loader, tmp_path)
    assert [m for m in monitor_warnings(caught) if "data-dependent shape" in m] == []
    assert [r["flops"] for r in per_batch.rows] == measured.per_batch


@pytest.mark.parametrize("as_parameters", [False, True])
def test_an_moe_measured_through_its_parts_names_the_parameters_its_own_code_uses(
    tmp_path: Path, as_parameters: bool
) -> None:
    """A top-k MoE cannot be replayed (its experts' rows: a data-dependent shape): it is measured through the module
    calls inside it. Experts held as modules are among those calls: exact. Experts held as parameters of the MoE
    module are used by its own code, which is not measured: 0.21x of the step's FLOPs with nothing said
    (qa110-seq2seq 01); a warning now names them and the hook to define."""
    pl.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, measured, per_batch = fit(MoELM(as_parameters), token_loader(), tmp_path)
    partial = [m for m in monitor_warnings(caught) if "data-dependent shape" in m]
    if not as_parameters:
        assert partial == []
        assert [r["flops"] for r in per_batch.rows] == measured.per_batch
        return
    (said,) = partial
    assert said.startswith("EfficiencyMonitor: TopKMoE (moe) makes a data-dependent shape in its forward")
    assert "(moe.router)" in said and "its parameters w1, w2 are not counted" in said
    assert "`effi_training_flops(batch)`" in said
    # what was counted: the network without the experts' products (each expert's rows differ per batch)
    assert all(0 < counted < real for counted, real in zip((r["flops"] for r in per_batch.rows), measured.per_batch))


class Lengthen(Callback):
    """A technique that trained ``batch`` truncated: its baseline is the batch widened to ``length``."""

    def __init__(self, length: int) -> None:
        self.length = length

    def effi_baseline(self, batch: Any, pl_module: pl.LightningModule) -> Baseline:
        return Baseline(batch=lengthen_batch(batch, ["input_ids", "labels"], self.length))


class DictGPT2(UserGPT2):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def test_a_baseline_batch_of_other_shapes_is_measured_with_its_shapes(tmp_path: Path) -> None:
    """The network was called with the batch's own tensors: a technique's baseline batch (the curriculum's
    untruncated one) is measured with its shapes."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (3 * B, T), generator=g)
    loader = DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=B)
    pl.seed_everything(0)
    monitor, measured, per_batch = fit(DictGPT2(), loader, tmp_path, extra=(Lengthen(24),))
    full = transformer_training_flops(B, 24, 2, 32, None, V)
    for row, real in zip(per_batch.rows, measured.per_batch, strict=True):
        assert row["flops"] == transformer_training_flops(B, T, 2, 32, None, V) == real
        assert row["baseline_flops"] == full and row["baseline_tokens"] == B * 24
        assert row["baseline_layer_tokens"] == 2 * B * 24


class Probe(Callback):
    """After the monitor, before the V-cycle: the monitor's training_flops of the batch, with the V-cycle's baseline
    model in place too (what the V-cycle could read for a module without effi_training_flops)."""

    def __init__(self, monitor: EfficiencyMonitor, vcycle: VCycleCallback) -> None:
        self.monitor, self.vcycle, self.rows = monitor, vcycle, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        row = [self.vcycle.level, self.monitor.training_flops(pl_module, batch)]
        baseline = self.vcycle.effi_baseline(batch, pl_module)
        if baseline is not None:
            with baseline.model():
                row.append(self.monitor.training_flops(pl_module, batch))
        self.rows.append(tuple(row))


def test_vcycle_saving_on_a_user_gpt2(tmp_path: Path) -> None:
    """Levels 1, 2, 2, 1 (as tests/vcycle/test_baseline.py, shorter): the monitor measures the coarse model that
    trained and the full model the V-cycle holds in place for the baseline; the saving is the hand figure."""
    vcycle, monitor = VCycleCallback(e_a=1, e_small=2), EfficiencyMonitor(print_summary=False)
    probe = Probe(monitor, vcycle)
    pl.seed_everything(0)
    loader = DataLoader(token_loader(n=8 * 4).dataset, batch_size=8)
    make_trainer(tmp_path, [monitor, probe, vcycle], max_steps=4, max_epochs=-1).fit(UserGPT2(), loader)
    c1 = transformer_training_flops(8, T, 2, 32, None, V)  # the full model
    c2 = transformer_training_flops(8, T, 1, 16, None, V)  # level 2: 1 layer, 16 wide
    assert probe.rows == [(1, c1), (2, c2, c1), (2, c2, c1), (1, c1)]
    s = monitor.summary
    assert s["flops"] == 2 * c1 + 2 * c2 and s["baseline_flops"] == 4 * c1
    assert s["flops_saved_frac"] > 0
    assert s["flops_saved_frac"] == pytest.approx(1 - (2 * c1 + 2 * c2) / (4 * c1)) == s["saved/vcycle/flops_frac"]
    assert s["layer_tokens"] == (2 * 2 + 2 * 1) * 8 * T and s["baseline_layer_tokens"] == 4 * 2 * 8 * T
    # the V-cycle's own figure (logged as effi/vcycle/flops_saved_frac) measures through the monitor too
    assert vcycle.flops_saved_frac() == pytest.approx(s["flops_saved_frac"]) and s["vcycle/flops_saved_frac"] > 0


def test_random_ltd_lowers_the_unpatched_networks_flops(tmp_path: Path) -> None:
    """The replayed copy runs random-LTD's layers unpatched: the raw (baseline) FLOPs are the full network's and
    random-LTD's effi_adjust lowers them (a 4-layer GPT-2, layers 1-2 keep 8 of 16 tokens)."""
    ltd = RandomLTDCallback(min_value=8, max_value=16, require_steps=100, seq_per_step=8)
    pl.seed_everything(0)
    monitor, measured, per_batch = fit(
        UserGPT2(n_layer=4, attn_implementation="eager"), token_loader(), tmp_path, 2, (ltd,)
    )
    full = transformer_training_flops(B, T, 4, 32, None, V)
    for row, real in zip(per_batch.rows, measured.per_batch, strict=True):
        assert row["baseline_flops"] == full
        assert row["flops"] < full and row["flops"] == pytest.approx(real, rel=0.01)
        assert row["baseline_layer_tokens"] == 4 * B * T and row["layer_tokens"] < 4 * B * T


class OwnBlock(nn.Module):
    """A pre-norm-free transformer block of one's own: attention by hand, an MLP."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + self.out((q @ k.transpose(1, 2) / q.shape[-1] ** 0.5).softmax(-1) @ v)
        return x + self.mlp(x)


class PerBlockCheckpoint(UserModule):
    """``training_step`` wraps each of its own blocks in ``torch.utils.checkpoint`` (the nanoGPT-style pattern)."""

    def __init__(self, reentrant: bool | None, early_stop: bool = True) -> None:
        super().__init__()
        self.reentrant, self.early_stop = reentrant, early_stop
        self.embed, self.blocks, self.head = (
            nn.Embedding(V, 32),
            nn.ModuleList(OwnBlock() for _ in range(3)),
            nn.Linear(32, V),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        x = self.embed(ids)
        for block in self.blocks:
            if self.reentrant is None:
                x = block(x)
            elif self.reentrant:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, early_stop=self.early_stop)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("ltd", [False, True], ids=["plain", "random_ltd"])
@pytest.mark.parametrize(
    ("reentrant", "early_stop"),
    [(None, True), (True, True), (False, True), (False, False)],
    ids=["no_checkpoint", "reentrant", "non_reentrant", "non_reentrant_no_early_stop"],
)
def test_blocks_the_step_checkpoints_itself_count_their_recompute(
    tmp_path: Path, reentrant: bool | None, early_stop: bool, ltd: bool
) -> None:
    """``checkpoint(block, x)`` in the step's own code: a reentrant checkpoint runs the block's forward without grad
    and recomputes it (forward and backward) in the backward; a non-reentrant one records the forward with grad and
    recomputes it in the backward up to the last tensor the backward needs (torch's early stop), or all of it. Each
    batch's FLOPs, and random-LTD's lowered ones, equal the flop counter's on the real step (they read 0.27x and 0.81x
    of it before)."""
    from lightning_effi.adapters import GenericAdapter

    extra: tuple[Callback, ...] = ()
    if ltd:
        adapter = GenericAdapter("blocks", hidden_size=32)
        extra = (RandomLTDCallback(min_value=8, max_value=T, seq_per_step=4, require_steps=4, adapter=adapter),)
    pl.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, measured, per_batch = fit(
            PerBlockCheckpoint(reentrant, early_stop), token_loader(), tmp_path, 3, extra
        )
    assert monitor_warnings(caught) == []
    forward = 3 * (2 * B * T * 32 * 32 * 12 + 2 * 2 * B * T * T * 32)  # the blocks' forward: 12 h^2 and the scores
    full = 3 * forward + 3 * 2 * B * T * 32 * V  # forward and backward of the blocks and the head, no recompute
    for i, (row, real) in enumerate(zip(per_batch.rows, measured.per_batch, strict=True)):
        assert row["flops"] == real, (i, row["flops"] / real)
        if not ltd:
            recompute = {None: 0, True: forward, False: forward if not early_stop else None}[reentrant]
            if recompute is not None:
                assert real == full + recompute
            else:  # the early stop leaves out the blocks' last product, whose output the backward does not need
                assert full < real < full + forward


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


class OtherCheckpoints(UserModule):
    """Other ways users checkpoint: one block applied three times (shared weights, ALBERT-style) in a reentrant
    checkpoint each time; selective activation checkpointing (the matrix products saved); one non-reentrant
    checkpoint around two blocks at a time."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.embed, self.head = nn.Embedding(V, 32), nn.Linear(32, V)
        self.blocks = nn.ModuleList(OwnBlock() for _ in range(1 if mode == "shared" else 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        from functools import partial

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        ids, labels = batch
        x = self.embed(ids)
        if self.mode == "shared":
            for _ in range(3):
                x = checkpoint(self.blocks[0], x, use_reentrant=True)
        elif self.mode == "selective":
            context = partial(create_selective_checkpoint_contexts, _save_matmuls)
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False, context_fn=context)
        else:
            for pair in (self.blocks[:2], self.blocks[2:]):
                x = checkpoint(lambda h, pair=pair: pair[1](pair[0](h)), x, use_reentrant=False)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("mode", ["shared", "selective", "segments"])
def test_other_checkpointing_patterns_count_their_recompute(tmp_path: Path, mode: str) -> None:
    """Each batch's FLOPs equal the flop counter's: a shared block's three recomputes (read 0.52x before), a selective
    checkpoint's policy (1.22x: replayed as a plain checkpoint), a checkpoint's early stop ending the recompute of its
    last call only (0.96x: each call was replayed as if it stopped early) (qa33-break 01-03)."""
    pl.seed_everything(0)
    _, measured, per_batch = fit(OtherCheckpoints(mode), token_loader(), tmp_path, 2)
    assert [row["flops"] for row in per_batch.rows] == measured.per_batch


class CheckpointsItsBlocks(nn.Module):
    """An encoder of one's own that wraps each of its blocks in a reentrant checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(OwnBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        return x


class NestedCheckpoints(UserModule):
    """The step wraps that encoder in a reentrant checkpoint of its own (``nested``), or runs a masked-LM head on
    the masked positions after it (``masked``: measured through its parts, the checkpoints two levels down)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embed, self.encoder, self.head = nn.Embedding(V, 32), CheckpointsItsBlocks(), nn.Linear(32, V)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(ids))
        picked = labels != -100
        return F.cross_entropy(self.head(hidden[picked]), labels[picked])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        if self.how == "masked":
            return self(ids, labels)
        x = torch.utils.checkpoint.checkpoint(self.encoder, self.embed(ids), use_reentrant=True)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("how", ["nested", "masked"])
def test_reentrant_checkpoints_inside_a_recorded_call_are_counted_once(tmp_path: Path, how: str) -> None:
    """The inner recomputes were counted twice: 1.57x (nested) and 1.74x (two levels down in a call measured
    through its parts) (qa34-break 01, 02)."""
    pl.seed_everything(0)
    _, measured, per_batch = fit(NestedCheckpoints(how), masked_lm_loader(2 * B, masked=how == "masked"), tmp_path, 2)
    assert [row["flops"] for row in per_batch.rows] == measured.per_batch


@pytest.mark.parametrize("how", ["inside", "around"])
def test_a_checkpointed_head_on_the_masked_positions_counts_its_recompute(tmp_path: Path, how: str) -> None:
    """A call measured through its parts (a data-dependent shape) with a non-reentrant checkpoint inside it or around
    it: the parts are replayed inside it (read 0.82x and 0.75x before, qa33-break 04)."""

    class Checkpointed(SparseMLM):
        def masked_lm(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            from torch.utils.checkpoint import checkpoint

            if how == "around":
                return super().masked_lm(ids, labels)
            hidden = checkpoint(lambda i: self.bert(input_ids=i).last_hidden_state, ids, use_reentrant=False)
            picked = labels != -100
            return F.cross_entropy(self.head(hidden[picked]), labels[picked])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            from torch.utils.checkpoint import checkpoint

            ids, labels = batch
            return checkpoint(self, ids, labels, use_reentrant=False) if how == "around" else self(ids, labels)

    pl.seed_everything(0)
    _, measured, per_batch = fit(Checkpointed(), masked_lm_loader(2 * B), tmp_path, 2)
    assert [row["flops"] for row in per_batch.rows] == measured.per_batch


class UserSpeech(UserModule):
    """HF audio layout: ``input_values`` ``[B, L]`` samples and an ``attention_mask`` marking them; a strided
    convolution turns 4 samples into one frame, the blocks run on the frames."""

    def __init__(self) -> None:
        super().__init__()
        self.frontend = nn.Conv1d(1, 32, kernel_size=4, stride=4)
        self.blocks, self.head = nn.ModuleList(OwnBlock() for _ in range(3)), nn.Linear(32, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = self.frontend(batch["input_values"][:, None]).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x.mean(1)), batch["labels"])


def test_a_mask_of_audio_samples_is_scaled_to_the_frames_the_blocks_see(tmp_path: Path) -> None:
    """The mask marks 104 of 128 audio samples; the blocks see 8 frames per row of 32 samples: tokens are
    104 * 8 / 32 = 26 (the monitor read 104, the samples, 4x the frames the blocks processed; 12-16x in the
    helper's run), with one warning naming the scale and the hook."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, 32, dtype=torch.long)
    mask[1, 24:], mask[2, 16:] = 0, 0
    batch = {"input_values": torch.randn(B, 32, generator=g), "attention_mask": mask, "labels": torch.arange(B) % 2}
    # a CTC target of its own length, [B, 5], is no token ids beside the mask (it turned the scale off, qa34-break 06)
    batch["ctc_labels"] = torch.randint(0, 10, (B, 5), generator=g)
    pl.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, measured, per_batch = fit(UserSpeech(), DataLoader([batch] * 2, batch_size=None), tmp_path, 2)
    assert monitor_warnings(caught) == [
        "EfficiencyMonitor: the batch's attention_mask has 32 positions per row, but the first transformer block sees "
        "8 (a frontend that downsamples, e.g. audio samples to frames): tokens are the mask's real positions scaled by "
        "8/32, the positions the blocks process; define `effi_count_tokens(batch) -> int` on your LightningModule to "
        "count your own way"
    ]
    for row in per_batch.rows:
        assert row["tokens"] == 26 and row["layer_tokens"] == 3 * 26 and row["samples"] == B


class SparseMLM(UserModule):
    """A masked-LM head on the masked positions only (ModernBERT's ``sparse_prediction``): ``hidden[labels != -100]``,
    a shape that depends on the data. ``sparse=False`` runs the head outside any module call of its own."""

    def __init__(self, wrapped: bool = True) -> None:
        super().__init__()
        cfg = dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
        self.bert = transformers.BertModel(transformers.BertConfig(vocab_size=V, hidden_size=32, **cfg))
        self.head = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, V))
        self.wrapped = wrapped

    def masked_lm(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=ids).last_hidden_state
        picked = labels != -100
        return F.cross_entropy(self.head(hidden[picked]), labels[picked])

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.masked_lm(ids, labels)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return self(ids, labels) if self.wrapped else self.masked_lm(ids, labels)


def test_a_head_on_the_masked_positions_only_is_counted_on_their_number(tmp_path: Path) -> None:
    """``self(ids, labels)`` cannot be replayed on fake tensors (``nonzero`` of the mask: FLOPs read 0 for the run,
    qa32-user 04); the calls made directly inside it are: the encoder on the batch, the head on each batch's masked
    positions. Each batch's FLOPs equal the flop counter's; the batches mask different numbers of positions."""
    loader = masked_lm_loader()
    counts = [int((batch[1] != -100).sum()) for batch in loader]
    assert len(set(counts)) > 1
    for wrapped in (True, False):
        pl.seed_everything(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, measured, per_batch = fit(SparseMLM(wrapped), loader, tmp_path / str(wrapped))
        assert monitor_warnings(caught) == []
        assert [row["flops"] for row in per_batch.rows] == measured.per_batch
        assert all(flops > 0 for flops in measured.per_batch)


class PickPositive(nn.Module):
    """One module whose own forward has a data-dependent shape, with no module call inside to replay instead."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0]


def test_a_data_dependent_shape_without_calls_inside_is_named_in_the_warning(tmp_path: Path) -> None:
    class Module(UserMLP):
        def __init__(self) -> None:
            super().__init__()
            self.pick = PickPositive()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            # on the network's output: a part of the backward (a module without parameters whose outputs get no
            # gradient is data preparation, left out: the next test)
            return super().training_step(batch, batch_idx) + self.pick(self.mlp(batch[0])).sum() * 0

    g = torch.Generator().manual_seed(0)
    features = DataLoader(TensorDataset(torch.randn(3 * B, 8, generator=g), torch.randint(0, 3, (3 * B,))), B)
    pl.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(Module(), features, tmp_path)
    (flops,) = [m for m in monitor_warnings(caught) if "training FLOPs" in m]
    assert "replaying PickPositive failed: its forward makes a shape that depends on the data's values" in flops
    assert "boolean-mask indexing such as hidden[labels != -100]" in flops and "`effi_training_flops(batch)`" in flops


class MixUpMLP(UserMLP):
    """The vision recipe: torchvision's ``v2.MixUp`` held as a submodule and applied in ``training_step`` (soft
    targets) to images of 2 x 2 x 2 (its 8 features); it draws its mixing weight as a tensor and reads it on the
    host, which no fake replay can."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.transforms import v2

        self.mixer = v2.MixUp(num_classes=3, alpha=1.0)
        self.mlp.insert(0, nn.Flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self.mixer(*batch)
        return F.cross_entropy(self.mlp(x), y)


def test_a_data_augmentation_module_in_the_step_is_left_out_of_the_flops(tmp_path: Path) -> None:
    """MixUp's failed replay dropped the whole step's FLOPs: 0 for the run, every saving 0.0 (qa96-user 01). A module
    without parameters whose outputs take no part in the backward is data preparation: left out, named once in a
    warning, and the network's FLOPs are counted (the flop counter's on the real step, which counts no elementwise
    op of the mixing either)."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(3 * B, 2, 2, 2, generator=g)
    features = DataLoader(TensorDataset(images, torch.randint(0, 3, (3 * B,))), B)
    pl.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, measured, per_batch = fit(MixUpMLP(), features, tmp_path)
    said = monitor_warnings(caught)
    assert [row["flops"] for row in per_batch.rows] == measured.per_batch and all(f > 0 for f in measured.per_batch)
    assert monitor.summary["flops"] == sum(measured.per_batch)
    (left_out,) = said
    assert left_out.startswith("EfficiencyMonitor: the call of MixUp (mixer) in the training step is left out")
    assert "reads a value on the host" in left_out


class ShiftedIds(UserModule):
    """Token ids and their mask; the blocks see ``ids[:, :-1]``, one position fewer than the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = (
            nn.Embedding(V, 32),
            nn.ModuleList(OwnBlock() for _ in range(2)),
            nn.Linear(32, V),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = self.embed(batch["input_ids"][:, :-1])
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), batch["input_ids"][:, 1:].flatten())


def test_a_mask_beside_token_ids_is_not_scaled_to_the_blocks_positions(tmp_path: Path) -> None:
    """Token ids beside the mask: the mask marks the tokens, whatever length the blocks see (a decoder's block
    list, a step's ids[:, :-1]); the downsampling scale read 45 for 47 here, with a false warning (qa33-break 06)."""
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 13:] = 0
    batch = {
        "input_ids": torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(0)),
        "attention_mask": mask,
    }
    pl.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, per_batch = fit(ShiftedIds(), DataLoader([batch] * 2, batch_size=None), tmp_path, 2)
    assert monitor_warnings(caught) == [] and [row["tokens"] for row in per_batch.rows] == [int(mask.sum())] * 2


class OwnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = (
            nn.Embedding(V, 32),
            nn.ModuleList(OwnBlock() for _ in range(4)),
            nn.Linear(32, V),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LoopsOverBlocks(UserModule):
    """``self.net(ids)``, or the step iterating the blocks itself (the nanoGPT / per-block checkpoint pattern)."""

    def __init__(self, loop: bool) -> None:
        super().__init__()
        self.loop, self.net = loop, OwnNet()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        if self.loop:
            x = self.net.embed(ids)
            for block in self.net.blocks:
                x = block(x)
            logits = self.net.head(x)
        else:
            logits = self.net(ids)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class TwoBlockLists(LoopsOverBlocks):
    """An encoder and a decoder block list, both iterated by the step."""

    def __init__(self) -> None:
        super().__init__(loop=True)
        self.decoder = nn.ModuleList(OwnBlock() for _ in range(4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        x = self.net.embed(ids)
        for block in [*self.net.blocks, *self.decoder]:
            x = block(x)
        return F.cross_entropy(self.net.head(x).flatten(0, 1), labels.flatten())


def test_the_vcycle_baseline_prices_every_block_when_the_step_iterates_them(tmp_path: Path) -> None:
    """At the coarse level (2 of 4 blocks) the baseline replays the recorded calls on the full model: the step's own
    loop over the blocks recorded blocks 0 and 1 only, so the baseline was the small model's and the saving 0
    (qa33-break 11). Both spellings of the step now read the full model's FLOPs and the same saving."""
    rows = {}
    for loop in (False, True):
        pl.seed_everything(0)
        vcycle = VCycleCallback(e_a=1, e_small=2, width_scheme=None)
        monitor, _, per_batch = fit(LoopsOverBlocks(loop), token_loader(n=40), tmp_path / str(loop), 4, (vcycle,))
        rows[loop] = ([row["baseline_flops"] for row in per_batch.rows], monitor.summary["flops_saved_frac"])
    assert rows[True] == rows[False] and rows[True][1] > 0.2
    # two block lists the step iterates: the V-cycle coarsens the one it finds, the other is priced as it is (the
    # baseline read the small model's, qa34-break 05)
    pl.seed_everything(0)
    vcycle = VCycleCallback(e_a=1, e_small=2, width_scheme=None, model_attr="net")
    monitor, measured, per_batch = fit(TwoBlockLists(), token_loader(n=40), tmp_path / "two", 4, (vcycle,))
    coarse = [row for row in per_batch.rows if row["baseline_flops"] > row["flops"]]
    assert coarse and monitor.summary["flops_saved_frac"] > 0.1


class PatchNet(OwnNet):
    """A network on continuous inputs (a DiT's patch tokens, no token ids): a projection, :class:`OwnBlock` s."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, 32), nn.Linear(32, 8)


class WithEMA(UserModule):
    """A diffusion-style module: the network and a frozen EMA copy of it beside (DiT's ``self.ema``), updated by the
    user after each step; no token ids in the batch."""

    def __init__(self, frozen: bool = True) -> None:
        super().__init__()
        self.net = PatchNet()
        self.ema = copy.deepcopy(self.net).requires_grad_(not frozen)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return F.mse_loss(self.net(x), x)


@pytest.mark.parametrize("frozen", [True, False])
def test_tokens_of_the_vcycles_coarse_network_beside_a_frozen_copy(tmp_path: Path, frozen: bool) -> None:
    """At the coarse level the block list found was the frozen EMA copy's (4 blocks, more parameters than the
    2-block network trained), never called: the coarse steps counted 0 tokens and 0 layer-tokens, the baseline lost
    the same steps, and the layer-token saving read 0 for 0.1875 (qa45-user 01); also with a copy not frozen
    (qa46-break 06). The list the step runs is taken."""
    from lightning_effi.core.measure import find_blocks

    module = WithEMA()
    assert find_blocks(module) is module.net.blocks
    module.net.blocks = module.net.blocks[:2]  # the coarse network: the trained list, though smaller
    assert find_blocks(module) is module.net.blocks
    pl.seed_everything(0)
    loader = DataLoader(TensorDataset(torch.randn(8 * B, T, 8)), batch_size=B)
    depths = Depths()
    vcycle = VCycleCallback(e_a=1, e_small=2, width_scheme=None, model_attr="net")
    monitor, _, per_batch = fit(WithEMA(frozen), loader, tmp_path, 5, (vcycle, depths))
    assert depths.seen == [4, 2, 2, 4, 4]
    assert [row["tokens"] for row in per_batch.rows] == [B * T] * 5
    assert [row["layer_tokens"] for row in per_batch.rows] == [d * B * T for d in depths.seen]
    assert monitor.summary["layer_tokens_saved_frac"] == pytest.approx(1 - 16 / 20)


class Depths(Callback):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.seen.append(len(pl_module.net.blocks))


class HalveFlops(Callback):
    """A technique that lowers every batch's FLOPs to half (``effi_adjust``)."""

    def effi_adjust(self, stats, batch, pl_module):  # type: ignore[no-untyped-def]
        return dataclasses.replace(stats, flops=stats.flops / 2)


class ReadsFlopsPerBatch(Callback):
    """After the monitor, as Lightning's ThroughputMonitor: ``pl_module.flops_per_batch`` at each batch's end."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.seen.append(getattr(pl_module, "flops_per_batch", None))


@pytest.mark.parametrize("same_monitor", [True, False])
def test_a_second_fit_of_the_same_module_counts_the_same(tmp_path: Path, same_monitor: bool) -> None:
    """The monitor writes each batch's FLOPs to ``flops_per_batch`` (for ThroughputMonitor); a later fit of the same
    module, with the same monitor or a new one, must not read that back as the module's own FLOPs (regression: fit 2
    charged every batch the halved FLOPs of fit 1's last batch, a saving of 0 against a wrong baseline). At the fit's
    end the attribute is removed again (a plain fit's ThroughputMonitor read the last batch's figure, qa35-break 05)."""
    module, hand = UserEncoder(), 3 * (transformer_forward_flops(B, T, 3, 32, 64, head="none") + 2 * B * 32 * 10)
    monitor = EfficiencyMonitor(print_summary=False)
    summaries = []
    for k in range(2):
        if k and not same_monitor:
            monitor = EfficiencyMonitor(print_summary=False)
        pl.seed_everything(0)
        reader = ReadsFlopsPerBatch()
        make_trainer(tmp_path / str(k), [monitor, HalveFlops(), reader], max_steps=2, max_epochs=-1).fit(
            module, token_loader(labels="cls")
        )
        summaries.append({q: monitor.summary[q] for q in ("flops", "baseline_flops", "flops_saved_frac")})
        assert reader.seen == [hand // 2, hand // 2]  # what ThroughputMonitor reads
        assert not hasattr(module, "flops_per_batch")
    assert summaries[0] == summaries[1] == {"flops": hand, "baseline_flops": 2 * hand, "flops_saved_frac": 0.5}


def test_the_modules_own_flops_per_batch_survives_the_monitors_writes(tmp_path: Path) -> None:
    """A module's own ``flops_per_batch`` is its cost in every fit, and its value again after each; one the user sets
    between fits replaces it."""
    module = UserEncoder()
    module.flops_per_batch = 1000
    for k, own in enumerate((1000, 1000, 600)):
        if own == 600:
            module.flops_per_batch = 600
        monitor = EfficiencyMonitor(print_summary=False)
        make_trainer(tmp_path / str(k), [monitor, HalveFlops()], max_steps=2, max_epochs=-1).fit(
            module, token_loader(labels="cls")
        )
        assert (monitor.summary["flops"], monitor.summary["baseline_flops"]) == (own, 2 * own)
        assert module.flops_per_batch == own


@pytest.mark.parametrize("before", [None, 1000])
def test_a_flops_per_batch_set_during_the_fit_is_the_one_kept(tmp_path: Path, before: int | None) -> None:
    """The module's own value is the latest it set, also during the fit (the monitor put back the one from before the
    fit, or deleted it, qa36-break 04)."""

    class SetsItsOwn(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            if trainer.global_step == 1:
                pl_module.flops_per_batch = 600

    module = UserEncoder()
    if before is not None:
        module.flops_per_batch = before
    monitor = EfficiencyMonitor(print_summary=False)
    make_trainer(tmp_path, [monitor, SetsItsOwn(), HalveFlops()], max_steps=3, max_epochs=-1).fit(
        module, token_loader(labels="cls")
    )
    assert module.flops_per_batch == 600
    if before is not None:  # batch 0 at the module's 1000, batches 1 and 2 at its 600 (halved by HalveFlops)
        assert (monitor.summary["baseline_flops"], monitor.summary["flops"]) == (1000 + 2 * 600, 500 + 2 * 300)


def test_a_flops_per_batch_property_is_read_and_never_written(tmp_path: Path) -> None:
    """Lightning's ThroughputMonitor takes ``flops_per_batch`` as an attribute or a property; a read-only property
    crashed the monitor's write at the first batch (qa35-break 04). It is the module's own figure."""

    class WithProperty(UserEncoder):
        @property
        def flops_per_batch(self) -> int:
            return 1000

    monitor = EfficiencyMonitor(print_summary=False)
    make_trainer(tmp_path, [monitor, HalveFlops()], max_steps=2, max_epochs=-1).fit(
        WithProperty(), token_loader(labels="cls")
    )
    assert (monitor.summary["flops"], monitor.summary["baseline_flops"]) == (1000, 2000)


def test_a_reused_monitor_logs_its_rows_in_a_new_trainer(tmp_path: Path) -> None:
    """A notebook cell run again (or an in-process sweep) with the same monitor: a fit whose only log point falls on
    the step of the last fit's last log logged no ``effi/*`` row (qa35-break 03)."""
    from lightning.pytorch.loggers import CSVLogger

    monitor, logged = EfficiencyMonitor(print_summary=False), []
    for k in range(2):
        logger = CSVLogger(tmp_path, name=str(k))
        trainer = make_trainer(tmp_path / str(k), [monitor], max_steps=3, max_epochs=1, logger=logger)
        trainer.fit(UserEncoder(), token_loader(labels="cls"))
        with open(Path(logger.log_dir) / "metrics.csv") as f:
            logged.append([int(row["step"]) for row in csv.DictReader(f) if row.get("effi/flops")])
    assert logged == [[2], [2]]  # at the epoch's end, in its third step's row (where Lightning writes the epoch's)


def test_tokens_of_any_attention_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep masks (bool, 0/1 integer or float), additive masks (0 real, -inf or finfo.min masked, all-zero: no
    padding) and 4-D / 3-D layouts count the same real tokens; a mask that does not say falls back to the ids with
    one warning; never an error from the mask's values."""
    lengths = torch.tensor([5, 2, 3])
    real = torch.arange(5)[None] < lengths[:, None]  # [3, 5], right padding: 10 real tokens
    ids = torch.ones(3, 5, dtype=torch.long)
    neg = torch.finfo(torch.float16).min
    masks = {
        "bool": real,
        "long": real.long(),
        "float": real.float(),
        "additive -inf": torch.where(real, 0.0, float("-inf")),
        "additive finfo.min fp16": torch.where(real, 0.0, neg).half(),
        "[B, 1, 1, T]": real.long()[:, None, None, :],
        "[B, 1, 1, T] additive": torch.where(real, 0.0, float("-inf"))[:, None, None, :],
        "[B, 1, T, T] causal": (real[:, None, None, :] & torch.ones(5, 5, dtype=torch.bool).tril()),
        "[B, 1, T, T] causal additive": torch.where(
            real[:, None, None, :] & torch.ones(5, 5, dtype=torch.bool).tril(), 0.0, float("-inf")
        ),
        "[B, T, T] outer": real.long()[:, :, None] * real.long()[:, None, :],
        "[B, H, T, T] broadcast": real[:, None, None, :].expand(3, 2, 5, 5),
        "left padded": real.flip(1).long(),
    }
    for name, mask in masks.items():
        assert find_tokens({"input_ids": ids, "attention_mask": mask}) == 10, name
    assert find_tokens({"input_ids": ids, "attention_mask": torch.zeros(3, 5)}) == 15  # additive, no padding
    assert find_tokens({"attention_mask": torch.full((3, 5), float("nan"))}) == 0
    assert find_tokens({"attention_mask": torch.zeros(0, 5, dtype=torch.long)}) == 0
    odd = {"input_ids": ids, "attention_mask": torch.ones(3, 1, 2, 5)}  # 2 queries of 5 keys: says nothing
    # warned once a process: another test of this worker may have met this layout first
    monkeypatch.setattr("lightning_effi.core.measure._warned_masks", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert find_tokens(odd) == 15 and find_tokens(odd) == 15
    assert len(caught) == 1 and "attention_mask of shape (3, 1, 2, 5)" in str(caught[0].message)
    # the curriculum's baseline widens an additive mask with real (0) columns
    short = {"input_ids": ids[:, :3], "attention_mask": torch.where(real[:, :3], 0.0, float("-inf"))}
    assert find_tokens(lengthen_batch(short, ["input_ids", "attention_mask"], 5)) == 8 + 2 * 3


def test_the_monitor_counts_an_additive_float_mask(tmp_path: Path) -> None:
    """A padding collate with an additive float mask (0 / -inf): the monitor counts the same tokens as with the
    0/1 mask (regression: OverflowError converting -inf to int)."""
    loader = DataLoader(sentences(), batch_size=B, collate_fn=pad_collate)
    expected = sum(int(b["attention_mask"].sum()) for b in loader)

    def additive(items: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
        batch = dict(pad_collate(items))
        batch["attention_mask"] = torch.zeros(batch["attention_mask"].shape).masked_fill(
            batch["attention_mask"] == 0, float("-inf")
        )
        return batch

    class Counted(UserEncoder):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.cross_entropy(self(batch["input_ids"]), batch["labels"])

    pl.seed_everything(0)
    monitor, _, _ = fit(Counted(), DataLoader(sentences(), batch_size=B, collate_fn=additive), tmp_path)
    assert monitor.summary["tokens"] == expected < 3 * B * T


# ------------------------------------------------------------------------------------- the functional core
def test_find_tokens_and_blocks_on_any_structure() -> None:
    ids, mask = torch.ones(2, 5, dtype=torch.long), torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])
    assert find_tokens(transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask})) == 7
    assert find_tokens([torch.randn(2, 3), (ids, torch.zeros(2, dtype=torch.long))]) == 10  # the first int [B, T]
    assert find_tokens((torch.randn(2, 3, 8, 8), torch.zeros(2, dtype=torch.long))) is None  # images
    assert find_tokens((mask.bool(),)) is None  # a bool mask alone is not token ids
    assert [p for p, _ in leaves({"a": [1, {"b": 2}]})] == [("a", 0), ("a", 1, "b")]

    class Mixture(nn.Module):  # 8 experts inside each of 2 layers: the layer stack holds more parameters
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(8))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe, self.proj = Mixture(), nn.Linear(4, 4)

    net = nn.Sequential(nn.Embedding(4, 4), nn.ModuleList(Layer() for _ in range(2)))
    assert find_blocks(net) is net[1]
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) is None


def test_find_tokens_reads_the_padding_mask_of_a_tuple_batch() -> None:
    """A tuple ``(ids, mask, y)`` has no ``attention_mask`` name: the 0/1 entry that pads each row on one side, with
    one pad id in the ids there, is read as the curriculum reads it (right or left padding, bool or int); without
    such an entry, or with a placeholder batch of zeros (no real token), the ids are counted, padding included."""
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 0, 0, 0]])
    mask = (ids != 0).long()
    y = torch.tensor([1, 0])
    assert find_tokens((ids, mask, y)) == 5 and find_tokens([ids, mask.bool(), y]) == 5
    assert find_tokens((ids, mask.float(), y)) == 5  # a float 0/1 mask too
    assert find_tokens((ids.flip(1), mask.flip(1), y)) == 5  # left padding
    assert find_tokens((ids, y)) == 10  # no mask: every position
    tags = torch.tensor([[1, 0, 1, 0, 1], [0, 1, 1, 0, 1]])  # 0/1 token labels, not a padding pattern
    assert find_tokens((ids.clamp(min=3), tags)) == 10
    zeros = torch.zeros(2, 5, dtype=torch.long)
    assert find_tokens((zeros, zeros.clone())) == 10  # shapes only (a curriculum's untruncated placeholder)
    # a mask named against its convention (True at the padding, a name read as 1 = real): the ids, with a warning
    with pytest.warns(UserWarning, match=r"token counting: seqlen_truncate: the mask 'pad_mask' reads, by its name"):
        assert find_tokens({"input_ids": ids, "pad_mask": ids == 0}) == 10


def test_samples_of_packed_batches_and_of_lists_of_sequences() -> None:
    """A packed batch (HF DataCollatorWithFlattening: 4 sequences in one row of 28 tokens) counted 1 sample, and a
    collate that does not pad ({"input_ids": [t0, t1, ...]}) counted the first sequence's length: now the sequences."""
    from lightning_effi.core.measure import find_batch_size

    collate = transformers.DataCollatorWithFlattening(return_tensors="pt")
    lengths = [11, 3, 5, 9]
    packed = collate([{"input_ids": list(range(1, n + 1))} for n in lengths])
    assert tuple(packed["input_ids"].shape) == (1, 28) and find_batch_size(packed) == 4 and find_tokens(packed) == 28
    bounds = {"input_ids": packed["input_ids"], "cu_seq_lens_q": torch.tensor([0, 11, 14, 19, 28])}
    assert find_batch_size(bounds) == 4
    padded = {"input_ids": torch.ones(3, 6, dtype=torch.long), "position_ids": torch.arange(6).repeat(3, 1)}
    assert find_batch_size(padded) == 3  # one sequence a row: not packed
    assert find_batch_size({**padded, "attention_mask": torch.ones(3, 6)}) == 3
    listed = {"input_ids": [torch.arange(n) for n in lengths]}
    assert find_batch_size(listed) == 4
    # but one tensor per task or per crop, each [B, ...], is a batch of B (the QA helper's multi-task labels read 8)
    assert find_batch_size({"labels": [torch.zeros(32), torch.zeros(32, 3)], "x": torch.zeros(32, 5)}) == 32
    crops = [torch.zeros(4, 3, 32, 32), torch.zeros(4, 3, 16, 16), torch.zeros(4, 3, 16, 16)]
    assert find_batch_size({"pixel_values": crops}) == 4
    # a padded batch with position ids beside a mask of another name is not packed (it read 14 for 4)
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0], [1, 1] + [0] * 4])
    padded_mask = {"input_ids": torch.ones(4, 6, dtype=torch.long), "padding_mask": mask == 0}
    assert find_batch_size({**padded_mask, "position_ids": torch.arange(6) * mask}) == 4
    # packed SFT rows with the document mask that keeps their documents apart (the helper's rows read 16 for 48):
    # [B, 1, T, T] block-diagonal and causal, or [B, T] document numbers 1..k; padding given position 0 is no document
    docs = [[3, 2, 1], [4, 2], [6]]  # the last row: 4 tokens, then 2 of padding
    positions = torch.stack(
        [torch.cat([torch.arange(n) for n in row]) for row in docs[:2]] + [torch.tensor([0, 1, 2, 3, 0, 0])]
    )
    numbers = torch.stack(
        [torch.cat([torch.full((n,), k + 1) for k, n in enumerate(row)]) for row in docs[:2]]
        + [torch.tensor([1, 1, 1, 1, 0, 0])]
    )
    block = (
        (numbers[:, :, None] == numbers[:, None, :])
        & (numbers[:, :, None] > 0)
        & torch.ones(6, 6, dtype=torch.bool).tril()
    )
    rows = {"input_ids": torch.ones(3, 6, dtype=torch.long), "position_ids": positions}
    assert find_batch_size({**rows, "attention_mask": block[:, None]}) == 3 + 2 + 1
    assert find_batch_size({**rows, "attention_mask": (numbers > 0).long()}) == 6
    assert find_batch_size({"input_ids": rows["input_ids"], "attention_mask": numbers}) == 6
    assert find_batch_size({**rows, "padding_mask": numbers == 0}) == 3  # another name: polarity unknown, rows


def test_row_tokens_reads_each_sample_as_find_tokens_reads_the_batch() -> None:
    """Per sample, the same reading as the batch total (InfoBatch charges its pruned samples by it): every mask
    layout and dtype, tuple batches with their padding mask, ids alone (every row its length, padding included); no
    figure for images. The rows always sum to :func:`find_tokens`."""
    lengths = torch.tensor([5, 2, 3])
    real = torch.arange(5)[None] < lengths[:, None]
    ids = torch.ones(3, 5, dtype=torch.long)
    masks = [
        real,
        real.long(),
        torch.where(real, 0.0, float("-inf")),
        torch.where(real, 0.0, torch.finfo(torch.float16).min).half(),
        real.long()[:, None, None, :],
        real[:, None, None, :] & torch.ones(5, 5, dtype=torch.bool).tril(),
        real[:, None, None, :].expand(3, 2, 5, 5),
        real.flip(1).long(),
    ]
    for mask in masks:
        batch = {"input_ids": ids, "attention_mask": mask}
        assert row_tokens(batch).tolist() == [5, 2, 3] and int(row_tokens(batch).sum()) == find_tokens(batch)
    assert row_tokens({"input_ids": ids, "attention_mask": torch.zeros(3, 5)}).tolist() == [5, 5, 5]  # additive
    pad_ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 0, 0, 0]])
    pad, y = (pad_ids != 0).long(), torch.tensor([1, 0])
    for batch in ((pad_ids, pad, y), (pad_ids.flip(1), pad.flip(1).bool(), y)):
        assert row_tokens(batch).tolist() == [3, 2] and find_tokens(batch) == 5
    assert row_tokens((pad_ids, y)).tolist() == [5, 5]  # ids alone: every position, as the total counts them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # find_tokens warns of the mask that says nothing; row_tokens never does
        odd = {"input_ids": ids, "attention_mask": torch.ones(3, 1, 2, 5)}
        assert row_tokens(odd).tolist() == [5, 5, 5] and find_tokens(odd) == 15
    assert row_tokens((torch.randn(2, 3, 8, 8), torch.zeros(2, dtype=torch.long))) is None  # images
    assert row_tokens({"input_ids": torch.ones(4, dtype=torch.long)}) is None  # no rows to tell apart
    assert row_tokens({"input_ids": ids, "attention_mask": real}).dtype == torch.int64


class BankAndLayerDrop(pl.LightningModule):
    """A user's module whose forward keeps a memory bank and a call count on ``self`` and drops its second layer
    with Python's ``random`` (a LayerDrop written the plain way)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mid, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 2)
        self.bank: list[torch.Tensor] = []
        self.seen = {"calls": 0, "log": [[]]}
        self.rng = np.random.default_rng(0)  # a generator of its own (the QA helper's second LayerDrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        if random.random() < 0.5:
            h = self.mid(h).relu()
        if self.rng.random() < 0.5:
            h = h * 2
        self.bank.append(h.detach())
        self.seen["calls"] += 1
        self.seen["log"][0].append(1)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_replay_of_a_modules_own_forward_leaves_its_state_and_python_random_alone(tmp_path: Path) -> None:
    """The monitor replays the module's forward to measure a new shape. Before, the replay appended a fake tensor
    to the module's own list (its first real use then failed), counted one call too many, and drew from Python's
    ``random`` or the module's own generator, so the LayerDrop trained other layers than without the monitor (weights
    0.020 apart in the helper's run). Now the run with the monitor trains exactly the run without it."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(20, 8, generator=g), torch.randint(0, 2, (20,), generator=g))
    runs = []
    for callbacks in ([], [EfficiencyMonitor(print_summary=False)]):
        pl.seed_everything(0)
        random.seed(0)
        module = BankAndLayerDrop()
        make_trainer(tmp_path / str(len(callbacks)), callbacks, max_steps=5, max_epochs=-1).fit(
            module, DataLoader(data, batch_size=4)
        )
        runs.append(module)
    plain, monitored = runs
    assert monitored.seen == plain.seen == {"calls": 5, "log": [[1] * 5]}
    assert monitored.rng.random() == plain.rng.random()
    assert all(type(t) is torch.Tensor for t in monitored.bank) and float(torch.stack(monitored.bank).sum()) == float(
        torch.stack(plain.bank).sum()
    )
    for a, b in zip(plain.parameters(), monitored.parameters(), strict=True):
        assert torch.equal(a, b)


def test_replay_has_no_side_effects_and_counts_what_the_step_computed() -> None:
    """A student trained on a frozen teacher's output under no_grad (forward only), with dropout and batch norm:
    the replay equals the flop counter on the real step, and leaves the RNG, the statistics and the gradients alone."""

    class Distill(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.teacher = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
            self.student = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), nn.Linear(16, 4))

    torch.manual_seed(0)
    root, x = Distill().train(), torch.randn(6, 8)
    recorder = CallRecorder()
    recorder.start(root)
    with FlopCounterMode(display=False) as counter:
        with torch.no_grad():
            target = root.teacher(x)
        F.mse_loss(root.student(x), target).backward()
    recorder.stop((x,))
    assert [(c.target, c.grad, c.args[0].path) for c in recorder.calls] == [
        ("teacher", False, (0,)),
        ("student", True, (0,)),
    ]
    state = {k: v.clone() for k, v in root.state_dict().items()}
    grads = [p.grad.clone() for p in root.student.parameters()]
    rng = torch.get_rng_state()
    flops = FlopsMeter().flops(root, recorder.calls)
    assert flops == counter.get_total_flops() == 2 * 6 * (8 * 32 + 32 * 4) + 2 * 2 * 6 * 8 * 16 + 3 * 2 * 6 * 16 * 4
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(v, root.state_dict()[k]) for k, v in state.items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, root.student.parameters()))


def test_a_module_held_on_another_device_is_measured_on_the_device_of_the_call() -> None:
    """The V-cycle holds its parked full model (on the CPU) in place for the baseline while the batch is on the
    accelerator: the copy goes to the call's device (here: a network moved to ``meta`` after a CPU call)."""
    root, x = nn.Module(), torch.randn(3, 8)
    root.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    recorder = CallRecorder()
    recorder.start(root)
    root.net(x).sum().backward()
    recorder.stop((x,))
    hand = 2 * 2 * 3 * 8 * 16 + 3 * 2 * 3 * 16 * 4
    assert FlopsMeter().flops(root, recorder.calls) == hand
    root.net = root.net.to("meta")
    assert FlopsMeter().flops(root, recorder.calls) == hand


@dataclasses.dataclass(frozen=True)
class Inputs:
    x: torch.Tensor
    scale: float


class NamedInputs(NamedTuple):
    x: torch.Tensor
    scale: float


class ScaledLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, inputs: Inputs | NamedInputs) -> torch.Tensor:
        return self.linear(inputs.x) * inputs.scale


@pytest.mark.parametrize("kind", [Inputs, NamedInputs])
def test_dataclass_and_named_tuple_arguments_are_rebuilt_for_the_replay(kind: type) -> None:
    root = nn.Module()
    root.net = ScaledLinear()
    x = torch.randn(5, 8)
    recorder = CallRecorder()
    recorder.start(root)
    root.net(kind(x, 2.0)).sum().backward()
    recorder.stop({"inputs": kind(x, 2.0)})
    # where the argument's tensor sits in the batch: a named tuple's leaves are named by field, as a dataclass's
    assert recorder.calls[0].args[0].fields[0][1].path == ("inputs", "x")
    assert FlopsMeter().flops(root, recorder.calls) == 2 * 2 * 5 * 8 * 4  # no input gradient: 2x the forward


def _bert_calls(root: nn.Module, length: int, batch: int = 3) -> list:
    """The recorded calls of one training step of ``root.net`` (a tiny HF BERT) on a padded batch of ``length``."""
    ids = torch.randint(1, 64, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, length // 2 :] = 0
    recorder = CallRecorder()
    recorder.start(root)
    root.net(input_ids=ids, attention_mask=mask).logits.sum().backward()
    recorder.stop({"input_ids": ids, "attention_mask": mask})
    return recorder.calls


def test_padded_lengths_between_replayed_ones_are_interpolated_exactly() -> None:
    """Batches padded to their longest sequence give one shape per length, each a replay on fake tensors (0.3-0.8 s
    for a small BERT on a CPU core). Once 5 lengths of one call were replayed, lie on one quadratic and are not all
    of one residue modulo some m > 1, the lengths between them are read off it: every figure equals the replayed
    one, with fewer replays."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, attn_implementation="eager", num_labels=2,
    )  # fmt: skip
    root = nn.Module()
    root.net = transformers.BertForSequenceClassification(config)
    lengths = [8, 40, 17, 31, 23, 12, 24, 20, 36, 28, 9, 33]
    calls = {n: _bert_calls(root, n) for n in lengths}
    exact, fast = FlopsMeter(interpolate=False), FlopsMeter()
    figures = [(exact.flops(root, calls[n]), fast.flops(root, calls[n])) for n in lengths]
    assert all(a == b > 0 for a, b in figures)
    # 8, 40, 17, 31 and 23 replayed (the first 5 of the call); the others lie strictly between 8 and 40
    assert exact.replays == len(lengths) and fast.replays == 5
    longer = _bert_calls(root, 48)  # outside the replayed range: replayed, and it widens the range
    assert fast.flops(root, longer) == exact.flops(root, longer) and fast.replays == 6
    # lengths all multiples of 4 (a collate's pad_to_multiple_of=4) are never interpolated: each is replayed
    fours = FlopsMeter()
    for n in (8, 40, 16, 32, 12, 24, 20):
        fours.flops(root, calls[n] if n in calls else _bert_calls(root, n))
    assert fours.replays == 7


def test_a_length_is_read_off_a_quadratic_only_when_every_replayed_length_lies_on_it() -> None:
    from lightning_effi.core.measure import _quadratic_at

    quadratic = {t: 7 * t * t + 120 * t for t in (8, 13, 24, 40)}
    assert _quadratic_at(quadratic, 30) == 7 * 900 + 120 * 30
    # a model padding to a multiple of 8 inside: at lengths of one residue (13, 21, 29, 37 -> 16, 24, 32, 40) the
    # FLOPs lie on a quadratic, which priced 14 or 15 as padded to 17 or 18 (+2.9% in the QA helper's run): lengths
    # that all share a residue modulo some m > 1 are never interpolated
    padded = {t: 7 * (-(-t // 8) * 8) ** 2 for t in (13, 21, 29, 37)}
    assert _quadratic_at(padded, 15) is None
    assert _quadratic_at({**padded, 30: 7 * 32**2}, 15) is None  # another residue shows the steps
    cubic = {t: t**3 for t in (8, 16, 24, 40)}  # three points fit a quadratic, the fourth does not: replayed
    assert _quadratic_at(cubic, 30) is None
    stepped = {8: 100, 16: 100, 24: 200, 40: 200}  # blocks of 16 (ceil(T / 16)): no quadratic through all
    assert _quadratic_at(stepped, 30) is None


def test_a_baseline_that_cannot_be_counted_names_its_technique(tmp_path: Path) -> None:
    """At half width the step's own loop recorded the blocks with 16-wide hidden states, which the full model's 32-wide
    blocks cannot take: the warning names the V-cycle's full model (it blamed the curriculum's batch, qa34-break), and
    the saving reads 0 as it says."""
    pl.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = LoopsOverBlocks(True)
        module.net.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True) for _ in range(4)
        )
        monitor, _, _ = fit(module, token_loader(n=40), tmp_path, 4, (VCycleCallback(e_a=1, e_small=2),))
    [message] = [m for m in monitor_warnings(caught) if "baseline's training FLOPs" in m]
    assert "(vcycle's full model in place of the smaller one it trains) cannot be counted" in message
    assert "curriculum" not in message and monitor.summary["flops_saved_frac"] == 0.0


class LinearProbe(pl.LightningModule):
    """A frozen PyTorch transformer (eval mode, under no_grad: a teacher, a pretrained backbone) and a trained head."""

    def __init__(self, nested: bool = False) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.embed = nn.Embedding(V, 32).requires_grad_(False)
        self.backbone = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval().requires_grad_(False)
        self.head = nn.Linear(32, 10)
        self.nested = nested

    def train(self, mode: bool = True) -> LinearProbe:
        super().train(mode)
        self.backbone.eval()
        return self

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, y = batch
        with torch.no_grad():
            padding = (torch.arange(ids.shape[1]) >= ids.shape[1] // 2).expand_as(ids) if self.nested else None
            features = self.backbone(self.embed(ids), src_key_padding_mask=padding).mean(1)
        return F.cross_entropy(self.head(features), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


@pytest.mark.parametrize("nested", [False, True], ids=["dense", "nested_with_padding_mask"])
def test_a_frozen_pytorch_transformer_in_eval_mode_is_counted(tmp_path: Path, nested: bool) -> None:
    """In eval mode under no_grad, nn.TransformerEncoderLayer runs PyTorch's fused inference op, which the flop
    counter has no formula for: the backbone's 2 layers were counted as 8,192 FLOPs (qa42-user 01). The replay runs
    them unfused: the monitor counts the backbone's forward as the flop counter does on the unfused path, plus the head
    (forward and weight gradient). With its default enable_nested_tensor and a padding mask, the encoder hands its
    layers nested tensors, which stopped the fit (no shape, qa43-break 05): counted as the dense forward."""
    from lightning_effi.core.flops import flop_counter

    pl.seed_everything(0)
    module = LinearProbe(nested)
    ids = torch.randint(0, V, (3 * B, T))
    loader = DataLoader(TensorDataset(ids, torch.arange(3 * B) % 10), batch_size=B)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        padding = (torch.arange(T) >= T // 2).expand(B, T) if nested else None
        with torch.no_grad(), flop_counter() as counter:
            module.backbone(module.embed(ids[:B]), src_key_padding_mask=padding)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    backbone = counter.get_total_flops()
    assert backbone > 4 * transformer_forward_flops(B, T, 2, 32, 64, head="none") // 5  # the layers' products
    # (the flop counter of fit()'s MeasuredFlops cannot run the nested path of the real step)
    monitor = EfficiencyMonitor(print_summary=False)
    per_batch = PerBatch(monitor)
    make_trainer(tmp_path, [monitor, per_batch], max_steps=3, max_epochs=-1).fit(module, loader)
    for row in per_batch.rows:
        assert row["flops"] == backbone + 2 * (2 * B * 32 * 10)  # the head: forward, weight gradient
    assert torch.backends.mha.get_fastpath_enabled() == fastpath  # the replay put it back


class ScoresInStep(pl.LightningModule):
    """A sequential recommender written the usual way: the network returns hidden states and ``training_step`` scores
    them against the item-embedding table with a matrix product of its own (SASRec, BERT4Rec)."""

    def __init__(self, items: int = 500, how: str = "matmul") -> None:
        super().__init__()
        self.items = nn.Embedding(items, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.how = how

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        if self.how == "skip_first" and batch_idx == 0:
            return None  # Lightning trains nothing on it: the check waits for a batch that trains
        hidden = self.blocks(self.items(ids))
        if self.how == "einsum":
            logits = torch.einsum("btd,vd->btv", hidden, self.items.weight)
        elif self.how == "loss_module":  # a module outside the LightningModule, built in the step
            logits = Scores()(hidden, self.items.weight)
        elif self.how == "vmap":  # per sample: the shapes inside vmap are one sample's
            logits = torch.func.vmap(lambda h: h @ self.items.weight.T)(hidden)
        else:
            logits = hidden @ self.items.weight.T
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Scores(nn.Module):
    def forward(self, hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return hidden @ table.T


@pytest.mark.parametrize("how", ["matmul", "einsum", "loss_module", "skip_first", "vmap"])
def test_matrix_products_of_the_steps_own_code_are_told(tmp_path: Path, how: str) -> None:
    """The replay measures module calls: a product in the step's own code is left out of the FLOPs (an item-scoring
    head was 47% of a recommender's step, and random-LTD's saving read 1.9x too high, qa43-user 03). The monitor
    warns once with the product's FLOPs, forward and the backward of both operands: 3 x 2 x B*T x 32 x 500; also
    for an einsum, a module outside the LightningModule (not replayed either), after a first batch that trained
    nothing, and under torch.func.vmap (one sample's shapes: told as the batch's, qa44-break 01, 07, 08, 09)."""
    pl.seed_everything(0)
    ids = torch.randint(0, 500, (4 * B, T))
    loader = DataLoader(TensorDataset(ids, ids.roll(-1, 1)), batch_size=B)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, measured, per_batch = fit(ScoresInStep(how=how), loader, tmp_path)
    told = [m for m in monitor_warnings(caught) if "outside any module call" in m]
    head = 3 * 2 * B * T * 32 * 500
    name = "einsum" if how == "einsum" else "matmul"
    shape = (
        f"[{T}, 32] @ [32, 500] (x{B}, under vmap)"
        if how == "vmap"
        else f"[{B}, {T}, 32] @ [{500 if how == 'einsum' else 32}, "
    )
    assert len(told) == 1 and f"{name} {shape}" in told[0]
    assert f"; {head:.3g} FLOPs" in told[0]
    row = 1 if how == "skip_first" else 0
    counted = per_batch.rows[row]["flops"]
    assert measured.per_batch[row] - counted >= head  # what the real step ran beyond the counted network calls
    assert f"{head / (head + counted):.0%} of the batch's" in told[0]


def test_an_optimizers_own_products_are_not_blamed_on_the_step(tmp_path: Path) -> None:
    """Muon orthogonalizes its updates with matrix products in optimizer.step: they are no product of training_step
    (reported as 72% of the batch's, with advice to move them into a module, qa44-break 03). The check ends with the
    step's forward."""

    class WithMuon(ScoresInStep):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids, labels = batch
            return F.cross_entropy(self.blocks(self.items(ids)).flatten(0, 1) @ self.items.weight.T, labels.flatten())

        def configure_optimizers(self) -> Any:
            for p in self.parameters():  # Muon trains matrices only: biases and norms stay as they are
                p.requires_grad_(p.ndim == 2)
            return torch.optim.Muon([p for p in self.parameters() if p.ndim == 2], lr=0.01)

    pl.seed_everything(0)
    ids = torch.randint(0, 500, (2 * B, T))
    loader = DataLoader(TensorDataset(ids, ids.roll(-1, 1)), batch_size=B)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(WithMuon(), loader, tmp_path, steps=2)
    told = [m for m in monitor_warnings(caught) if "outside any module call" in m]
    assert len(told) == 1 and "matmul" in told[0] and "[32, 500]" in told[0]  # the head, not Muon's products


def test_samples_of_a_list_of_images_are_the_images() -> None:
    """torchvision's detection collate: a list of [3, H, W] images and a list of target dicts. The samples were read
    from the first image's first dimension, its channels: 3 a batch whatever the batch size (qa44-user 02). Lists of
    per-crop batches ([B, 3, H, W] each) and per-task [B, T, D] tensors keep their shared first dimension."""
    from lightning_effi.core.measure import find_batch_size

    images = [torch.zeros(3, 32, 32) for _ in range(4)]
    targets = [{"boxes": torch.zeros(1, 4), "labels": torch.zeros(1, dtype=torch.long)} for _ in range(4)]
    assert find_batch_size((images, targets)) == 4
    assert find_batch_size({"pixel_values": images, "labels": targets}) == 4
    sizes = [torch.zeros(3, 32 + i, 40) for i in range(2)]  # no targets, but sizes that differ
    assert find_batch_size({"pixel_values": sizes}) == 2
    crops = [torch.zeros(8, 3, 32, 32), torch.zeros(8, 3, 16, 16)]
    assert find_batch_size({"pixel_values": crops}) == 8 and find_batch_size((crops, torch.zeros(8))) == 8
    assert find_batch_size({"input_ids": [torch.zeros(3, 5, 2), torch.zeros(3, 5, 2)]}) == 3  # per task, B = 3


class WithDecoder(pl.LightningModule):
    """An encoder and a trained transformer decoder head (Segmenter's mask decoder), and a frozen teacher."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 32)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, 0.0, batch_first=True), 4)
        self.decoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, 0.0, batch_first=True), 2)
        teacher = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, 0.0, batch_first=True), 3)
        self.teacher = teacher.requires_grad_(False)
        self.head = nn.Linear(32, V)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return F.cross_entropy(self.head(self.decoder(self.encoder(self.embed(ids)))).flatten(0, 1), labels.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trained_blocks_outside_the_counted_list_are_told(tmp_path: Path) -> None:
    """layer_tokens count one block list: a trained decoder head's blocks were left out in silence (8,320 counted for
    12,672, qa44-user 03). The warning names them; the frozen teacher's are not named."""
    pl.seed_everything(0)
    ids = torch.randint(0, V, (2 * B, T))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, per_batch = fit(WithDecoder(), DataLoader(TensorDataset(ids, ids), batch_size=B), tmp_path, steps=2)
    told = [m for m in monitor_warnings(caught) if "`layer_tokens` count the" in m]
    assert len(told) == 1 and "the 4 blocks of encoder.layers" in told[0] and "decoder.layers (2 blocks)" in told[0]
    assert "teacher" not in told[0] and per_batch.rows[0]["layer_tokens"] == 4 * B * T


# ------------------------------------------------------------------------- samples that are not the first dimension
def graph_collate(graphs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """PyG's ``Batch`` layout by hand: node features ``[N, F]``, ``edge_index [2, E]`` offset per graph, the graph of
    each node ``[N]``, one label per graph ``[G]``."""
    xs, edges, owner, offset = [], [], [], 0
    for g, (x, edge_index, _) in enumerate(graphs):
        xs.append(x)
        edges.append(edge_index + offset)
        owner.append(torch.full((len(x),), g))
        offset += len(x)
    y = torch.stack([label for _, _, label in graphs])
    return {"x": torch.cat(xs), "edge_index": torch.cat(edges, 1), "batch": torch.cat(owner), "y": y}


class GraphNet(pl.LightningModule):
    """Message passing on node features, mean pooling per graph, a label per graph."""

    def __init__(self, own_count: bool = False) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(8, 16), nn.Linear(16, 2)
        if own_count:
            self.effi_count_samples = lambda batch: int(batch["y"].numel())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        h = self.lin(batch["x"]).relu()
        src, dst = batch["edge_index"]
        h = h + torch.zeros_like(h).index_add_(0, dst, h[src])
        graphs = int(batch["y"].numel())
        pooled = torch.zeros(graphs, 16).index_add_(0, batch["batch"], h)
        pooled = pooled / torch.bincount(batch["batch"], minlength=graphs)[:, None]
        return F.cross_entropy(self.head(pooled), batch["y"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("own_count", [False, True])
def test_a_graph_batch_is_warned_and_counted_by_the_modules_own_samples(tmp_path: Path, own_count: bool) -> None:
    """Nodes were counted as the samples (202 for 24 graphs) and ``edge_index [2, E]`` read as token ids (570 tokens
    for 285 edges), without a word (qa45-break 03). The disagreeing first dimensions are warned, naming
    ``effi_count_samples``, which the module can define; ``edge_index`` is no token ids."""
    g = torch.Generator().manual_seed(0)
    graphs = []
    for _ in range(4 * B):
        n = int(torch.randint(5, 12, (1,), generator=g))
        edges = torch.randint(0, n, (2, int(torch.randint(6, 20, (1,), generator=g))), generator=g)
        graphs.append((torch.randn(n, 8, generator=g), edges, torch.randint(0, 2, (), generator=g)))
    loader = DataLoader(graphs, batch_size=B, collate_fn=graph_collate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, _, per_batch = fit(GraphNet(own_count), loader, tmp_path, 4)
    told = [m for m in monitor_warnings(caught) if "disagree on their first dimension" in m]
    nodes = [int(b["x"].shape[0]) for b in loader]
    if own_count:
        assert told == [] and [row["samples"] for row in per_batch.rows] == [B] * 4
    else:
        assert len(told) == 1 and f"read as {nodes[0]} a batch" in told[0] and "(edge_index: 2, y: 4)" in told[0]
        assert "effi_count_samples(batch) -> int" in told[0]
        assert [row["samples"] for row in per_batch.rows] == nodes
    assert monitor.totals["tokens"] == 0  # no token ids and no transformer block: not the edges' endpoints


class SequenceFirstLM(pl.LightningModule):
    """PyTorch's word-language-model layout: ``[T, B]`` ids and targets, ``nn.TransformerEncoder`` with its default
    ``batch_first=False``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(V, 32), nn.Linear(32, V)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self.head(self.blocks(self.embed(ids))).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_sequence_first_batch_counts_its_second_dimension_as_the_samples(tmp_path: Path) -> None:
    """``[T, B]`` batches counted T as the samples (72 for 24 sequences, qa45-break 05): the first block is called
    with ``[T, B, H]`` and reads them sequence first, so the samples are the batch's second dimension."""
    ids = torch.randint(0, V, (3 * B, T + 1), generator=torch.Generator().manual_seed(0))
    pairs = [(row[:-1], row[1:]) for row in ids]
    loader = DataLoader(pairs, batch_size=B, collate_fn=lambda rows: tuple(torch.stack(x, 1) for x in zip(*rows)))
    assert next(iter(loader))[0].shape == (T, B)
    monitor, _, per_batch = fit(SequenceFirstLM(), loader, tmp_path, 3)
    assert [row["samples"] for row in per_batch.rows] == [B] * 3
    assert [row["tokens"] for row in per_batch.rows] == [B * T] * 3


class SequenceFirstRNN(SequenceFirstLM):
    """The word-language-model example's LSTM: ``nn.LSTM`` with its default ``batch_first=False``, no block list."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks, self.mode = nn.LSTM(32, 32, 2), "plain"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        x = self.embed(ids)
        if self.mode == "packed":  # pad_sequence's [T, B] rows, each of its own length
            lengths = torch.arange(ids.shape[1], 0, -1).clamp_min(1) % ids.shape[0] + 1
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
            x = nn.utils.rnn.pad_packed_sequence(self.blocks(packed)[0], total_length=ids.shape[0])[0]
        elif self.mode == "bos":  # a start step in front of the sequence
            x = self.blocks(torch.cat([torch.zeros_like(x[:1]), x]))[0][1:]
        elif self.mode == "cell":  # the seq2seq tutorials' decoder loop: an nn.LSTMCell stepped over [B, H] rows
            h = c = x.new_zeros(x.shape[1], 32)
            steps = []
            for step in x:
                h, c = self.cell(step, (h, c))
                steps.append(h)
            x = torch.stack(steps)
        else:
            x = self.blocks(x)[0]
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_a_sequence_first_batch_of_a_recurrent_network_counts_its_second_dimension(tmp_path: Path) -> None:
    """An ``nn.LSTM`` reading ``[T, B]`` batches sequence first counted T as the samples (140 for 24, samples_per_s
    5.8x high, qa57-seq 02): no block list told the layout; the LSTM's ``[T, B, H]`` input tells it."""
    ids = torch.randint(0, V, (3 * B, T + 1), generator=torch.Generator().manual_seed(0))
    pairs = [(row[:-1], row[1:]) for row in ids]
    loader = DataLoader(pairs, batch_size=B, collate_fn=lambda rows: tuple(torch.stack(x, 1) for x in zip(*rows)))
    monitor, _, per_batch = fit(SequenceFirstRNN(), loader, tmp_path, 3)
    assert [row["samples"] for row in per_batch.rows] == [B] * 3
    assert [row["tokens"] for row in per_batch.rows] == [B * T] * 3
    # fed through pack_padded_sequence, or with a BOS step in front (qa58-break 04, 07: T counted again), or to an
    # nn.LSTMCell one step at a time (qa60-break 01: 16 for 4)
    for mode in ("packed", "bos", "cell"):
        module = SequenceFirstRNN()
        module.mode = mode
        if mode == "cell":
            module.cell = nn.LSTMCell(32, 32)
        _, _, per_batch = fit(module, loader, tmp_path / mode, 3)
        assert [row["samples"] for row in per_batch.rows] == [B] * 3, mode
    batch_first = DataLoader(pairs, batch_size=B, collate_fn=lambda rows: tuple(torch.stack(x) for x in zip(*rows)))
    module = SequenceFirstRNN()
    module.blocks = nn.LSTM(32, 32, 2, batch_first=True)
    _, _, per_batch = fit(module, batch_first, tmp_path / "batch_first", 3)
    assert [row["samples"] for row in per_batch.rows] == [B] * 3


class OwnBatch:
    """A batch class of one's own (Lightning moves it with its ``to``)."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.input_ids, self.attention_mask = ids, mask

    def to(self, device: Any) -> OwnBatch:
        return OwnBatch(self.input_ids.to(device), self.attention_mask.to(device))


class OwnBatchLM(SequenceFirstLM):
    def __init__(self, own_count: bool) -> None:
        super().__init__()
        self.blocks = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, 0.0, batch_first=True), 2)
        if own_count:
            self.effi_count_samples = lambda batch: int(batch.input_ids.shape[0])
            self.effi_count_tokens = lambda batch: int(batch.attention_mask.sum())

    def training_step(self, batch: OwnBatch, batch_idx: int) -> torch.Tensor:
        ids = batch.input_ids
        return F.cross_entropy(self.head(self.blocks(self.embed(ids))).flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("own_count", [False, True])
def test_a_batch_class_of_ones_own_is_named_not_looked_into(tmp_path: Path, own_count: bool) -> None:
    """The samples read 0 with "has no tensor with a dimension" though the batch held three; its tokens were the
    hidden states' positions, padding included, without a word (qa45-break 04). Both warnings now say the class is
    not looked into and what to do; the module's own counts are used."""
    mask = (torch.arange(T) < torch.tensor([T, 5, 9, 12])[:, None]).long()
    loader = DataLoader(
        [0] * (2 * B), batch_size=B, collate_fn=lambda rows: OwnBatch(torch.randint(0, V, (B, T)), mask)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, _, per_batch = fit(OwnBatchLM(own_count), loader, tmp_path, 2)
    told = [m for m in monitor_warnings(caught) if "OwnBatch" in m]
    if own_count:
        assert told == [] and [row["samples"] for row in per_batch.rows] == [B, B]
        assert [row["tokens"] for row in per_batch.rows] == [int(mask.sum())] * 2
        return
    assert any("the OwnBatch batch is not looked into" in m and "effi_count_samples" in m for m in told)
    assert any("holds its tensors in a OwnBatch" in m and "padding included" in m for m in told)


def test_tokens_of_a_preference_pair_batch_are_both_sequences(tmp_path: Path) -> None:
    """``chosen_*`` beside ``rejected_*`` (each padded to its own length): the chosen side alone was counted, 356 of
    688 tokens, without a word (qa46-user 01). Every prefixed sequence is counted, with a warning naming the hook for
    a network that runs them otherwise (TRL's prompt, run with each completion)."""
    from lightning_effi.core.measure import find_tokens, sequence_groups

    chosen_mask = (torch.arange(6) < torch.tensor([6, 3, 4, 2])[:, None]).long()
    rejected_mask = (torch.arange(9) < torch.tensor([9, 5, 1, 7])[:, None]).long()
    batch = {
        "chosen_input_ids": torch.randint(1, V, (B, 6)),
        "chosen_attention_mask": chosen_mask,
        "rejected_input_ids": torch.randint(1, V, (B, 9)),
        "rejected_attention_mask": rejected_mask,
    }
    assert sequence_groups(batch) == [("chosen_input_ids", 15), ("rejected_input_ids", 22)]
    assert find_tokens(batch) == 37
    assert sequence_groups({**batch, "input_ids": batch["chosen_input_ids"]}) is None  # a plain input_ids: as before

    class PairLM(UserModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = OwnNet()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids = [batch["chosen_input_ids"], batch["rejected_input_ids"]]
            return sum(F.cross_entropy(self.net(x).flatten(0, 1), x.flatten()) for x in ids)

    loader = DataLoader([0] * (2 * B), batch_size=B, collate_fn=lambda rows: batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, _, per_batch = fit(PairLM(), loader, tmp_path, 2)
    assert [row["tokens"] for row in per_batch.rows] == [37, 37]
    assert [row["layer_tokens"] for row in per_batch.rows] == [4 * 37] * 2
    told = [m for m in monitor_warnings(caught) if "holds several sequences" in m]
    assert len(told) == 1 and "(chosen_input_ids: 15, rejected_input_ids: 22 real tokens" in told[0]


def test_no_first_dimension_warning_on_detection_or_packed_batches() -> None:
    """Batches whose samples were already counted right got the graph warning (qa46-break 05): a detection batch's
    per-image target dicts (boxes [n, 4]) and a packed batch ([1, total] ids, cu_seq_lens)."""
    from lightning_effi.core.measure import find_batch_size, other_first_dims

    images = [torch.randn(3, 8, 8) for _ in range(B)]
    targets = [{"boxes": torch.rand(3, 4), "labels": torch.randint(0, 5, (3,))} for _ in range(B)]
    assert find_batch_size((images, targets)) == B and other_first_dims((images, targets), B) == []
    packed = {
        "input_ids": torch.randint(0, V, (1, 16)),
        "position_ids": torch.cat([torch.arange(n) for n in (5, 7, 4)])[None],
        "cu_seq_lens_q": torch.tensor([0, 5, 12, 16]),
    }
    assert find_batch_size(packed) == 3 and other_first_dims(packed, 3) == []
    graph = {"x": torch.randn(30, 8), "edge_index": torch.randint(0, 30, (2, 50)), "y": torch.randint(0, 2, (4,))}
    assert other_first_dims(graph, 30) == [("edge_index", 2), ("y", 4)]
    # the warning is for graph batches: CTC's concatenated targets and YOLO's [n_objects, 6] rows are counted right
    # beside per-sample tensors and were warned (qa47-break 05)
    from lightning_effi.core.accounting import _graph_like

    ctc = (torch.randn(8, 20, 13), torch.randint(1, 5, (23,)), torch.full((8,), 20), torch.randint(1, 5, (8,)))
    yolo = (torch.randn(8, 3, 16, 16), torch.rand(7, 6))
    assert _graph_like(graph) and not _graph_like(ctc) and not _graph_like(yolo)


class TransposingBlock(nn.Module):
    """A batch-first block of one's own around a sequence-first ``nn.MultiheadAttention``: it transposes inside."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.norm = nn.MultiheadAttention(32, 2), nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).transpose(0, 1)
        return x + self.attn(h, h, h, need_weights=False)[0].transpose(0, 1)


class TransposingLM(SequenceFirstLM):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(TransposingBlock(), TransposingBlock())


def test_a_batch_first_block_around_a_sequence_first_attention_counts_the_rows(tmp_path: Path) -> None:
    """Its hidden states are [B, T, H]: read as sequence-first, T was counted as the samples (72 for 24,
    qa46-break 04). The attention's own query shows whether the block passes its input on."""
    ids = torch.randint(0, V, (3 * B, T + 1), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=B)
    monitor, _, per_batch = fit(TransposingLM(), loader, tmp_path, 3)
    assert [row["samples"] for row in per_batch.rows] == [B] * 3


class FrozenBackboneProbe(UserModule):
    """A frozen backbone of blocks of one's own run under no_grad, a trainable head whose first part is a list of
    two residual MLP blocks on pooled [B, H] features; an EMA copy of the backbone, not frozen, never run."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = PatchNet().requires_grad_(False)
        self.head = nn.Sequential(nn.Sequential(ResidualMLP(), ResidualMLP()), nn.Linear(8, 2))
        self.shadow = copy.deepcopy(self.head)  # not frozen, out of the optimizer, bigger than nothing

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            features = self.backbone(x).mean(1)
        return F.cross_entropy(self.head(features), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


def test_the_block_list_is_the_one_the_step_runs_with_hidden_states(tmp_path: Path) -> None:
    """A trainable head of residual MLP blocks on pooled [B, H] features was taken for the blocks (trainable before
    frozen): tokens read 0 (qa46-break 11). The list whose first block the step runs with [B, T, H] hidden states
    is taken: the frozen backbone's."""
    loader = DataLoader(TensorDataset(torch.randn(3 * B, T, 8), torch.randint(0, 2, (3 * B,))), batch_size=B)
    monitor, _, per_batch = fit(FrozenBackboneProbe(), loader, tmp_path, 3)
    assert [row["tokens"] for row in per_batch.rows] == [B * T] * 3
    assert [row["layer_tokens"] for row in per_batch.rows] == [4 * B * T] * 3


class PerSampleGradients(ScoresInStep):
    """Per-sample gradient norms of a scoring product (a GraNd-like score) beside the training loss."""

    def __init__(self, vmapped: bool) -> None:
        super().__init__()
        self.vmapped = vmapped

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        hidden = self.blocks(self.items(ids))
        table = self.items.weight.detach()

        def loss_of(w: torch.Tensor, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(h @ w.T, y)

        h, y = hidden.detach(), labels
        if self.vmapped:
            grads = torch.func.vmap(torch.func.grad(loss_of), in_dims=(None, 0, 0))(table, h, y)
        else:
            grads = torch.stack([torch.func.grad(loss_of)(table, h[k], y[k]) for k in range(len(h))])
        self.score = grads.flatten(1).norm(dim=1)
        return F.cross_entropy(self.blocks(self.items(ids)).flatten(0, 1) @ self.items.weight.T, labels.flatten())


def test_products_under_vmap_of_grad_are_told_for_the_batch(tmp_path: Path) -> None:
    """vmap(grad(f)) (per-sample gradients): the operand is a gradient-tracking wrapper around the batched tensor,
    and the product was told for one sample, 16x low against the same gradients as a loop (qa46-break 10)."""
    ids = torch.randint(0, 500, (2 * B, T))
    loader = DataLoader(TensorDataset(ids, ids.roll(-1, 1)), batch_size=B)
    figures = []
    for vmapped in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(PerSampleGradients(vmapped), loader, tmp_path / str(vmapped), steps=1)
        told = [m for m in monitor_warnings(caught) if "outside any module call" in m]
        figures.append(float(re.search(r"; ([0-9.e+]+) FLOPs", told[0]).group(1)))
    assert figures[0] == figures[1] > 0


class ConvLayer(nn.Module):
    def __init__(self, channels_in: int) -> None:
        super().__init__()
        self.conv, self.act = nn.Conv1d(channels_in, 32, 9, padding=4), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x))


class LayerDropSpeech(UserModule):
    """A wav2vec2-like network: a convolutional feature encoder (a list of layers holding more parameters than the
    transformer blocks) on [B, 1, S] audio, then blocks with a LayerDrop that skips block 0 on odd batches."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.ModuleList([ConvLayer(1), *(ConvLayer(32) for _ in range(6))])
        self.blocks = nn.ModuleList(OwnBlock() for _ in range(4))
        self.head = nn.Linear(32, 5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (audio,) = batch
        x = audio
        for layer in self.features:
            x = layer(x)
        x = x.transpose(1, 2)
        for i, block in enumerate(self.blocks):
            if not (batch_idx % 2 and i == 0):
                x = block(x)
        return self.head(x).square().mean()


def test_a_layerdrop_that_skips_the_first_block_counts_the_blocks_tokens(tmp_path: Path) -> None:
    """A step that skipped block 0 was counted on the convolutional feature encoder ([B, 1, S] read as 1 position a
    row: 4 tokens x 7 layers for 16 x 4, qa47-break 02). Every block of a list is watched, and a list whose blocks'
    width is the hidden states' last dimension comes first."""
    loader = DataLoader(TensorDataset(torch.randn(4 * B, 1, T)), batch_size=B)
    monitor, _, per_batch = fit(LayerDropSpeech(), loader, tmp_path, 4)
    assert [row["tokens"] for row in per_batch.rows] == [B * T] * 4
    assert [row["layer_tokens"] for row in per_batch.rows] == [4 * B * T] * 4


class PrefixLM(UserModule):
    """A vision-language model's pattern: 6 image tokens (a projection of image features) put in front of the text's
    embeddings before the blocks; the batch holds the text's ids and mask."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.project = OwnNet(), nn.Linear(8, 32)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = torch.cat([self.project(batch["image_features"]), self.net.embed(batch["input_ids"])], 1)
        for block in self.net.blocks:
            x = block(x)
        logits = self.net.head(x[:, 6:])
        return F.cross_entropy(logits.flatten(0, 1), batch["input_ids"].flatten())


def test_tokens_a_model_puts_in_front_of_the_text_are_counted(tmp_path: Path) -> None:
    """16 image tokens a row in front of the text were left out of tokens and layer_tokens (2,772 counted for
    4,308), in silence (qa47-user 01): the positions the first block sees beyond the batch's are counted, warned."""
    mask = (torch.arange(T) < torch.tensor([T, 5, 9, 12])[:, None]).long()
    batch = {"image_features": torch.randn(B, 6, 8), "input_ids": torch.randint(1, V, (B, T)), "attention_mask": mask}
    loader = DataLoader([0] * (2 * B), batch_size=B, collate_fn=lambda rows: batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, _, per_batch = fit(PrefixLM(), loader, tmp_path, 2)
    tokens = int(mask.sum()) + B * 6
    assert [row["tokens"] for row in per_batch.rows] == [tokens] * 2
    assert [row["layer_tokens"] for row in per_batch.rows] == [4 * tokens] * 2
    told = [m for m in monitor_warnings(caught) if "more than the batch's" in m]
    assert len(told) == 1 and f"sees {T + 6} positions a row, 6 more than the batch's {T} token positions" in told[0]


class StridedLM(UserModule):
    """A DNA / protein LM's pattern: a stride-2 convolution pools the ids' embeddings (k-mers) before the blocks,
    which see T / 2 positions; a step shifting its labels (``ids[:, :-1]``) sees one fewer, which is no pooling."""

    def __init__(self, stride: int) -> None:
        super().__init__()
        self.net, self.stride = OwnNet(), stride
        self.pool = nn.Conv1d(32, 32, stride, stride=stride)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch[0] if self.stride == 2 else batch[0][:, :-1]
        x = self.pool(self.net.embed(ids).transpose(1, 2)).transpose(1, 2)
        for block in self.net.blocks:
            x = block(x)
        return self.net.head(x).logsumexp(-1).mean()


def test_a_front_end_that_pools_the_ids_is_told(tmp_path: Path) -> None:
    """A stride-2 front end before the blocks: layer_tokens count the ids' tokens, twice the positions the blocks
    process (768 for 384), in silence (qa57-seq 03): said once, naming effi_count_tokens; not for a label shift."""
    told = {}
    for stride in (2, 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            monitor, _, per_batch = fit(StridedLM(stride), token_loader(), tmp_path / str(stride), 2)
        assert [row["layer_tokens"] for row in per_batch.rows] == [4 * B * T] * 2  # the ids' tokens, as said
        told[stride] = [m for m in monitor_warnings(caught) if "fewer than the batch's" in m]
    shown = f"process {B * T // 2} positions in the step, fewer than the batch's {B * T} tokens"
    assert len(told[2]) == 1 and shown in told[2][0]
    assert "layer_tokens are 2 times the positions" in told[2][0] and "effi_count_tokens" in told[2][0]
    assert told[1] == []


class PairEncoder(UserModule):
    """A contrastive step over two inputs of ids (supervised SimCSE's anchor and positive, or two masked views), or
    over the ids trimmed to the longest real row, or over chunks of them."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.net, self.mode = OwnNet(), mode
        if mode == "frozen":
            self.net.embed.requires_grad_(False)
            self.pos = nn.Parameter(torch.zeros(T, 32))
        if mode == "cls_views":
            self.cls = nn.Parameter(torch.zeros(1, 1, 32))
        if mode in ("prefix_one_view", "prefix_last_view"):  # a 16-position prefix (a soft prompt, image tokens)
            self.cls = nn.Parameter(torch.zeros(1, T, 32))

    def encode(self, ids: torch.Tensor, cls: bool = True) -> torch.Tensor:
        x = self.net.embed(ids)
        if self.mode == "frozen":  # a frozen embedding, a position embedding added: no graph back to the ids
            x = x + self.pos
        if self.mode in ("cls_views", "prefix_one_view", "prefix_last_view") and cls:  # more positions a row
            x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1)
        if self.mode in ("checkpointed", "checkpointed_probe"):  # a reentrant checkpoint runs without grad
            for block in self.net.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
            return x.mean(1)
        return self.encode_embedded(x)

    def encode_embedded(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.net.blocks:
            x = block(x)
        return x.mean(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if self.mode == "pair":
            z1, z2 = self.encode(ids), self.encode(batch["positive_ids"])
        elif self.mode in ("views", "frozen", "checkpointed", "cls_views"):
            z1, z2 = self.encode(ids.masked_fill(ids % 3 == 0, 0)), self.encode(ids.masked_fill(ids % 3 == 1, 0))
        elif self.mode == "prefix_one_view":  # two more views without the prefix: passes of two shapes
            z1, z2 = self.encode(ids.masked_fill(ids % 3 == 0, 0)), self.encode(ids.masked_fill(ids % 3 == 1, 0), False)
            z2 = z2 + self.encode(ids.masked_fill(ids % 3 == 2, 0), False)
        elif self.mode == "prefix_last_view":  # the prefixed view runs last
            z1, z2 = self.encode(ids.masked_fill(ids % 3 == 0, 0), False), self.encode(ids.masked_fill(ids % 3 == 1, 0))
            z1 = z1 + self.encode(ids.masked_fill(ids % 3 == 2, 0), False)
        elif self.mode in ("trimmed_views", "trimmed_views_ids"):  # the padding no row uses cut off in each view
            length = int(mask.sum(1).max())
            views = [ids.masked_fill(ids % 3 == k, 0) for k in (0, 1)]
            if self.mode == "trimmed_views_ids":
                z1, z2 = (self.encode(view[:, :length]) for view in views)
            else:
                z1, z2 = (self.encode_embedded(self.net.embed(view)[:, :length]) for view in views)
        elif self.mode in ("probe", "checkpointed_probe"):  # a pass without grad over other ids trains none
            with torch.no_grad():
                self.encode(batch["positive_ids"])
            return self.encode(ids).pow(2).mean()
        elif self.mode == "trim":
            return self.encode(ids[:, : int(mask.sum(1).max())]).pow(2).mean()
        else:
            return torch.cat([self.encode(ids[:, s : s + 4]) for s in range(0, T, 4)]).pow(2).mean()
        return F.cross_entropy(z1 @ z2.T, torch.arange(len(z1)))


@pytest.mark.parametrize(
    ("mode", "passes"),
    [
        ("pair", 2),
        ("views", 2),
        ("frozen", 2),
        ("checkpointed", 2),
        ("cls_views", 2),
        ("probe", 1),
        ("checkpointed_probe", 1),
        ("trim", 1),
        ("chunks", 1),
    ],
)
def test_a_pass_over_other_ids_counts_again(tmp_path: Path, mode: str, passes: int) -> None:
    """Two inputs of ids in one step (a supervised-SimCSE pair, two masked views): the second pass was not counted,
    192 tokens for 384 (qa61-ideas 01). A step trimming the padding, or running the blocks over chunks of the ids,
    is one pass and no pooling front end (the warning was said, qa61-break 03). Two views through a frozen embedding
    were one pass (qa62-break 02); a pass without grad, a generate() in the step, trains no tokens (qa62-break 01),
    but the forward of a reentrant checkpoint, which runs without grad, does (qa63-break 01), unless no input of it
    requires grad (a no_grad probe through checkpointed blocks, qa65-break 01). Two views behind a CLS the model
    puts in front were one pass: 68 tokens for 136 (qa66-break 01)."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(T) < torch.tensor([T, 5, 9, 12])[:, None]).long()
    batch = {"input_ids": torch.randint(1, V, (B, T), generator=g) * mask, "attention_mask": mask,
             "positive_ids": torch.randint(1, V, (B, T), generator=g)}  # fmt: skip
    loader = DataLoader([0] * (2 * B), batch_size=B, collate_fn=lambda rows: batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor, _, per_batch = fit(PairEncoder(mode), loader, tmp_path, 2)
    tokens = int(mask.sum()) * passes  # the second input's as many as the first's (the mask's) in the count
    if mode == "cls_views":  # the CLS of each row, each pass
        tokens += B * passes
    assert [row["tokens"] for row in per_batch.rows] == [tokens] * 2
    assert [row["layer_tokens"] for row in per_batch.rows] == [4 * tokens] * 2
    assert not [m for m in monitor_warnings(caught) if "fewer than the batch's" in m]


@pytest.mark.parametrize("mode", ["prefix_one_view", "prefix_last_view"])
def test_passes_of_two_shapes_beside_a_prefix_count_each_on_its_shape(tmp_path: Path, mode: str) -> None:
    """A prefix in front of one view of three, on a padded batch: the passes' positions (4 x 32 + 2 x 4 x 16) are
    twice those of one pass with the prefix (4 x 16 + 16 x 4), so they were scaled by 2, over-counting (a VLM's
    image + text pass and two text-only views: 164 tokens for 118, qa68-break 05; 83 for 68, qa67-break 05); then
    passes of two shapes read no scale (the first pass's tokens only, 45 for 68 with the text pass first). Each pass
    counts on its own shape now: the three views' real tokens and the one prefix, whatever the order."""
    mask = (torch.arange(T) < torch.tensor([T, 5, 9, 12])[:, None]).long()
    batch = {"input_ids": torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(0)) * mask,
             "attention_mask": mask}  # fmt: skip
    loader = DataLoader([0] * (2 * B), batch_size=B, collate_fn=lambda rows: batch)
    _, _, per_batch = fit(PairEncoder(mode), loader, tmp_path, 2)
    processed = 3 * int(mask.sum()) + T * B  # the three views' tokens and one prefix a row
    assert [row["tokens"] for row in per_batch.rows] == [processed] * 2
    assert [row["layer_tokens"] for row in per_batch.rows] == [4 * processed] * 2


@pytest.mark.parametrize("trim_ids", [True, False])
def test_views_trimmed_to_the_longest_real_row_count_each(tmp_path: Path, trim_ids: bool) -> None:
    """Two masked views of a padded batch, each trimmed in the step to the longest real row (12 of 16 columns)
    before the blocks: 38 tokens a step (one pass) for 76 when the ids were trimmed before the embedding (the blocks
    were not told to be the ids'), 57 (the positions' ratio 2 x 4 x 12 / 4 x 16) when the embedding was trimmed
    (qa67-break 04). Each trimmed view holds every real token: the views' tokens."""
    mask = (torch.arange(T) < torch.tensor([12, 5, 9, 12])[:, None]).long()
    batch = {"input_ids": torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(0)) * mask,
             "attention_mask": mask}  # fmt: skip
    loader = DataLoader([0] * (2 * B), batch_size=B, collate_fn=lambda rows: batch)
    _, _, per_batch = fit(PairEncoder("trimmed_views_ids" if trim_ids else "trimmed_views"), loader, tmp_path, 2)
    assert [row["tokens"] for row in per_batch.rows] == [2 * int(mask.sum())] * 2
    assert [row["layer_tokens"] for row in per_batch.rows] == [8 * int(mask.sum())] * 2


class RetriedOnOutOfMemory(UserModule):
    """The out-of-memory fallback: the whole batch, whose second block raises once, caught, then the rows again in
    halves (``"halves"``) or whole (``"whole"``), or two views each retried so (``"views"``); or two views whose
    second raises in the embedding, inside the network's call before its blocks (``"embedding"``)."""

    def __init__(self, retry: str) -> None:
        super().__init__()
        self.net, self.retry, self.fail = OwnNet(), retry, False
        (self.net.embed if retry == "embedding" else self.net.blocks[1]).register_forward_pre_hook(self.flaky)

    def flaky(self, module: nn.Module, args: Any) -> None:
        if self.fail:
            self.fail = False
            raise torch.OutOfMemoryError("simulated: out of memory")

    def attempt(self, ids: torch.Tensor, fail: bool = True) -> torch.Tensor:
        self.fail = fail
        try:
            return self.net(ids)
        except torch.OutOfMemoryError:
            whole = self.retry in ("whole", "views_whole")
            return self.net(ids) if whole else torch.cat([self.net(part) for part in ids.split(2)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch[0]
        views = [ids, ids.flip(1)] if self.retry in ("views", "views_whole", "embedding") else [ids]
        return sum(
            self.attempt(view, self.retry != "embedding" or k == 1).logsumexp(-1).mean() for k, view in enumerate(views)
        )


@pytest.mark.parametrize(
    ("retry", "passes"), [("halves", 1), ("whole", 1), ("views", 2), ("views_whole", 2), ("embedding", 2)]
)
def test_a_forward_that_raised_and_was_retried_counts_once(tmp_path: Path, retry: str, passes: int) -> None:
    """A forward whose block raised (an out-of-memory error the step catches, then the batch again in halves) was
    counted as a pass beside its retry: 256 tokens for 128 since blocks the step runs begin a pass wherever they are
    (qa74-regress 01). The pass a raising block began is dropped, and the values the network's call was called on:
    two views each retried whole counted one, the retry read as R-Drop of the failed attempt (qa78-break 01)."""
    _, _, per_batch = fit(RetriedOnOutOfMemory(retry), token_loader(), tmp_path, 2)
    assert [row["tokens"] for row in per_batch.rows] == [passes * B * T] * 2
    assert [row["layer_tokens"] for row in per_batch.rows] == [4 * passes * B * T] * 2


class LazyMomentum(UserModule):
    """A momentum (EMA) copy of the network made lazily in the first ``training_step``, after its forward, and a whole
    module snapshot (``torch.save``) in every step."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.momentum, self.saved = OwnNet(), None, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = self.net.embed(batch[0])
        for block in self.net.blocks:
            x = block(x)
        if self.momentum is None:
            self.momentum = [copy.deepcopy(self.net)]  # in a list: not a submodule of this module
        torch.save(self, io.BytesIO())
        self.saved += 1
        with torch.no_grad():  # the copy runs too: another network, not observed
            self.momentum[0].blocks[0](x.detach())
        return self.net.head(x).logsumexp(-1).mean()


def test_a_copy_of_the_network_made_mid_step_is_another_network(tmp_path: Path) -> None:
    """The monitor's hooks on the blocks were bound methods and partials of the monitor: a deep copy of the network
    mid-step (a lazily made momentum copy) copied the monitor with the step's non-leaf tensors and failed ("Only
    Tensors created explicitly by the user"), and ``torch.save`` of the module failed on weak references
    (qa68-break 04). The copy's hooks hold no monitor; the counts are the network's."""
    module = LazyMomentum()
    monitor, _, per_batch = fit(module, token_loader(), tmp_path, 2)
    assert module.saved == 2 and module.momentum is not None
    assert [row["tokens"] for row in per_batch.rows] == [B * T] * 2
    assert [row["layer_tokens"] for row in per_batch.rows] == [4 * B * T] * 2
    hooks = [*module.momentum[0].blocks[0]._forward_pre_hooks.values()]
    assert hooks and all(h.owner() is None for h in hooks)  # copied during a recorded step: dead


class ViewsBesideAProbe(UserModule):
    """Two masked views through an ``nn.TransformerEncoder`` with a padding mask (trained: no fast path), and an
    eval-mode probe under no_grad in the step, which PyTorch's fast path runs on nested tensors."""

    def __init__(self, probe_first: bool) -> None:
        super().__init__()
        self.embed, self.probe_first = nn.Embedding(V, 32), probe_first
        layer = nn.TransformerEncoderLayer(32, 2, 64, batch_first=True, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)

    def encode(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.enc(self.embed(ids), src_key_padding_mask=pad).mean(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, pad = batch["input_ids"], ~batch["attention_mask"].bool()
        if self.probe_first:
            self.probe(ids, pad)
        z1 = self.encode(ids.masked_fill(ids % 3 == 0, 0), pad)
        z2 = self.encode(ids.masked_fill(ids % 3 == 1, 0), pad)
        if not self.probe_first:
            self.probe(ids, pad)
        return F.cross_entropy(z1 @ z2.T, torch.arange(len(z1)))

    def probe(self, ids: torch.Tensor, pad: torch.Tensor) -> None:
        self.enc.eval()
        with torch.no_grad():
            self.encode(ids, pad)
        self.enc.train()


@pytest.mark.parametrize("probe_first", [False, True])
def test_a_probe_on_the_nested_fast_path_leaves_the_passes_read(tmp_path: Path, probe_first: bool) -> None:
    """A no_grad probe on PyTorch's nested-tensor fast path trains nothing, yet its nested input marked the step's
    passes unread: tokens 58 for 116 from the second step on (qa66-break 03; run before the views, qa67-break 07)."""
    mask = (torch.arange(T) < torch.tensor([T, 10, T, T])[:, None]).long()
    batch = {
        "input_ids": torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(0)),
        "attention_mask": mask,
    }
    loader = DataLoader([0] * (3 * B), batch_size=B, collate_fn=lambda rows: batch)
    monitor = EfficiencyMonitor(print_summary=False)
    per_batch = PerBatch(monitor)  # no flop counter on the real step: it cannot run the fast path's nested tensors
    make_trainer(tmp_path, [monitor, per_batch], max_steps=3, max_epochs=-1).fit(ViewsBesideAProbe(probe_first), loader)
    assert [row["tokens"] for row in per_batch.rows] == [2 * int(mask.sum())] * 3


class _MoE(nn.Module):
    """Top-2 of 4 experts, tokens dispatched with nonzero / index_add (a data-dependent shape)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.router = nn.Linear(d, 4)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)


class _MoEBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm, self.mix, self.moe = nn.LayerNorm(d), nn.Linear(d, d), _MoE(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm(x))
        return x + self.moe(x)


class _MoELM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.blocks = nn.ModuleList(_MoEBlock() for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return F.cross_entropy(self(ids).flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_an_moe_lms_experts_three_levels_down_are_counted(tmp_path):
    """The network -> a block -> its MoE layer -> the experts: the MoE's data-dependent dispatch is measured through
    the calls inside it, which were kept two levels down only, so the experts were not: 0 FLOPs for the whole run
    (qa49-moe 01). They are the FLOPs torch's counter measures on the real step (the active experts only)."""
    pl.seed_everything(0)
    module = _MoELM()
    ids = torch.randint(0, 32, (16, 12))
    probe = copy.deepcopy(module)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(probe(ids[:8]).flatten(0, 1), ids[:8].flatten()).backward()
    monitor = EfficiencyMonitor(print_summary=False)
    trainer = make_trainer(tmp_path, [monitor], max_steps=1, max_epochs=-1)
    trainer.fit(module, DataLoader(TensorDataset(ids), batch_size=8))
    assert monitor.summary["flops"] == counter.get_total_flops() > 0


@pytest.mark.parametrize("kept", ["attribute", "dict", "list", "buffer"])
def test_the_vcycle_copies_an_moe_lm_whose_layers_keep_their_aux_loss(tmp_path, kept):
    """An MoE layer keeps its load-balancing loss as an attribute (self.aux_loss, a tensor of the step's graph, read by
    training_step): the coarse network's deepcopy failed with torch's bare "Only Tensors created explicitly by the
    user (graph leaves) support the deepcopy protocol" at the first level change (qa49-moe 03); kept in a dict
    (fairseq's l_aux), a list or a buffer slot, it still did (qa51-break 06)."""

    class AuxMoE(_MoE):
        def __init__(self) -> None:
            super().__init__()
            self.losses: dict[str, torch.Tensor] = {}
            self.history: list[torch.Tensor] = []
            if kept == "buffer":
                self.register_buffer("aux_loss", None, persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            aux = self.router(x).softmax(-1).pow(2).mean()
            if kept == "dict":
                self.losses["aux"] = aux
            elif kept == "list":
                self.history[:] = [aux]
            else:
                self.aux_loss = aux
            return super().forward(x)

        def aux(self) -> torch.Tensor:
            return {"dict": lambda: self.losses["aux"], "list": lambda: self.history[0]}.get(
                kept, lambda: self.aux_loss
            )()

    class AuxLM(_MoELM):
        def __init__(self) -> None:
            super().__init__()
            for block in self.blocks:
                block.moe = AuxMoE()

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss + 0.01 * sum(block.moe.aux() for block in self.blocks)

    class Depths(Callback):
        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen.append(len(pl_module.blocks))

    pl.seed_everything(0)
    depths = Depths()
    vcycle = VCycleCallback(e_a=1, e_small=2, width_scheme=None, alpha_original=0.3)
    trainer = make_trainer(tmp_path, [vcycle, depths], max_steps=4, max_epochs=-1)
    trainer.fit(AuxLM(), DataLoader(TensorDataset(torch.randint(0, 32, (32, 12))), batch_size=8))
    assert depths.seen == [2, 1, 1, 2]


def test_a_cache_argument_names_use_cache_false(tmp_path):
    """An HF MoE LM trained with its config's default use_cache=True calls its layers with a DynamicCache, which the
    monitor cannot replay: the warning said only "was called with DynamicCache arguments" (qa50-break 04); it names
    the remedy."""

    monitor = EfficiencyMonitor(print_summary=False)
    data = TensorDataset(torch.randint(0, 32, (8, 16)))
    with pytest.warns(UserWarning, match=r"DynamicCache arguments \(an HF DynamicCache: .* pass use_cache=False"):
        make_trainer(tmp_path, [monitor], max_steps=1, max_epochs=-1).fit(
            HFMixtralLM(experts_implementation="eager"), DataLoader(data, batch_size=4)
        )


def test_a_cache_of_a_rollout_without_grad_names_generate(tmp_path):
    """A REINFORCE step generating its rollout with generate() under no_grad (HF's cache on by default), then a trained
    pass with use_cache=False: the warning advised use_cache=False in training_step, which the trained pass had
    (qa114-rl 01). It names the rollout and generate(use_cache=False)."""

    class Rollout(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            config = transformers.GPT2Config(vocab_size=32, n_positions=32, n_embd=16, n_layer=2, n_head=2)
            self.model = transformers.GPT2LMHeadModel(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (prompt,) = batch
            with torch.no_grad():
                ids = self.model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
            return self.model(input_ids=ids, labels=ids, use_cache=False).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randint(1, 32, (8, 6)))
    with pytest.warns(UserWarning, match=r"an HF DynamicCache in a call without grad: a generate\(\) rollout .* pass "
                      r"use_cache=False to generate\(\)"):  # fmt: skip
        make_trainer(tmp_path, [EfficiencyMonitor(print_summary=False)], max_steps=1, max_epochs=-1).fit(
            Rollout(), DataLoader(data, batch_size=4)
        )


class _Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class _PatchEncoder(nn.Module):
    """Images [B, 3, 8, 8] -> 4 patches of 4x4 -> 2 blocks (``loops`` times over the list in one call) -> [B, 8]."""

    def __init__(self, loops: int = 1, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.loops, self.checkpointed = loops, checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(2).transpose(1, 2)
        for _ in range(self.loops):
            for block in self.blocks:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return h.mean(1)


class _TwoViews(pl.LightningModule):
    """SimCLR's step: two views of each image, encoded in one call each (``per_view``) or in one call together."""

    def __init__(
        self,
        per_view: bool,
        loops: int = 1,
        checkpointed: bool = False,
        no_grad_pass: bool = False,
        r_drop: bool = False,
        own_blocks: bool = False,
        augment: bool = False,
        shared_trunk: bool = False,
        alias: bool = False,
        between: str | None = None,
        in_place: bool = False,
    ):
        super().__init__()
        self.enc = _PatchEncoder(loops, checkpointed)
        self.enc2 = None
        if shared_trunk:  # a second stem over the same blocks, for the second view (VATT / ImageBind-style)
            self.enc2 = _PatchEncoder(loops, checkpointed)
            self.enc2.blocks = self.enc.blocks
        self.alias, self.between, self.in_place = alias, between, in_place
        if alias:  # the LightningModule holds its encoder's blocks too, and its forward calls the encoder
            self.trunk = self.enc.blocks
        self.per_view, self.no_grad_pass, self.r_drop, self.own_blocks = per_view, no_grad_pass, r_drop, own_blocks
        self.augment, self.loops = augment, loops
        if own_blocks:  # the blocks on the LightningModule, run by a method of its own (qa52-break 04)
            self.embed, self.blocks = self.enc.embed, self.enc.blocks
            del self.enc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x)

    def encode(self, x: torch.Tensor, second: bool = False) -> torch.Tensor:
        if self.enc2 is not None and second:
            return self.enc2(x)
        if self.alias:
            return self(x)
        if not self.own_blocks:
            return self.enc(x)
        h = self.embed(x).flatten(2).transpose(1, 2)
        for loop in range(self.loops):
            if loop:  # between the loops of a weight-shared stack: still one pass (qa54-break 03)
                h = {None: h, "norm": F.layer_norm(h, (8,)), "detach": h.detach(), "clone": h.clone()}[self.between]
            for block in self.blocks:
                h = block(h)
        return h.mean(1)

    def training_step(self, batch, batch_idx):
        v1, v2 = batch["view1"], batch["view2"]
        if self.in_place:  # FixMatch: pseudo-labels of the weak view, then the same tensor augmented in place
            with torch.no_grad():
                self.encode(v1)
            v1.mul_(-1).add_(0.1)  # other data in the same tensor: the pass after it counts (qa54-break 07)
        if self.augment:  # both views made in the step from one image (kornia-style augmentation, qa53-break 02)
            v1, v2 = batch["view1"] * 0.5, batch["view1"].flip(-2)
        if self.no_grad_pass:  # a probe of the same network on the same data, without grad: no other positions
            with torch.no_grad():
                self.encode(v1)
        if self.r_drop:  # R-Drop: the same input twice (a consistency term), its positions counted once
            z1, z2 = self.encode(v1), self.encode(v1)
        else:
            z1, z2 = (
                (self.encode(v1), self.encode(v2, second=True))
                if self.per_view
                else self.encode(torch.cat([v1, v2])).chunk(2)
            )
        z = F.normalize(torch.cat([z1, z2]), dim=-1)
        n = len(z1)
        return F.cross_entropy(z @ z.t(), torch.cat([torch.arange(n, 2 * n), torch.arange(n)]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize(
    ("kwargs", "passes"),
    [
        ({"per_view": False}, 2),  # both views in one call: 2 x 4 positions an image
        ({"per_view": True}, 2),  # one call a view: the second call's positions were left out (qa50-clip 04)
        ({"per_view": True, "checkpointed": True}, 2),  # the backward's recompute is not another pass
        ({"per_view": True, "no_grad_pass": True}, 2),  # nor a probe of the first view again
        ({"per_view": True, "r_drop": True}, 1),  # R-Drop: one view twice, counted once (as token ids are)
        ({"per_view": True, "own_blocks": True}, 2),  # blocks the LightningModule runs itself, one call a view
        ({"per_view": True, "augment": True}, 2),  # views made in the step: other data, each counted
        ({"per_view": True, "own_blocks": True, "r_drop": True}, 1),  # R-Drop there too: the same data once
        ({"per_view": False, "own_blocks": True, "loops": 2}, 2),  # a loop over its own blocks: one pass
        ({"per_view": False, "loops": 2}, 2),  # a loop over the blocks inside one call is one pass (shared weights)
        ({"per_view": False, "own_blocks": True, "loops": 2, "between": "norm"}, 2),
        ({"per_view": False, "own_blocks": True, "loops": 2, "between": "detach"}, 2),
        ({"per_view": False, "own_blocks": True, "loops": 2, "between": "clone"}, 2),
        ({"per_view": True, "in_place": True}, 3),  # the weak view, its in-place augmentation and the second view
        ({"per_view": True, "shared_trunk": True}, 2),  # two stems over one list of blocks: a view each (qa53-break 05)
        ({"per_view": True, "alias": True}, 2),  # the module's call runs its encoder's: one pass, not two
        ({"per_view": False, "alias": True}, 2),
    ],
)
def test_tokens_of_continuous_inputs_count_every_pass_of_the_network(tmp_path, kwargs, passes):
    images = torch.randn(16, 3, 8, 8)
    data = [{"view1": x, "view2": x.flip(-1)} for x in images]
    monitor = EfficiencyMonitor(print_summary=False)
    make_trainer(tmp_path, [monitor], max_steps=2, max_epochs=-1).fit(_TwoViews(**kwargs), DataLoader(data, 4))
    tokens = 2 * 4 * passes * 4  # 2 steps x 4 images x passes over an image x 4 patches
    assert monitor.summary["tokens"] == tokens
    assert monitor.summary["layer_tokens"] == 2 * tokens


class _Refeeds(pl.LightningModule):
    """An image-to-image network held in a submodule (``trunk``: 2 blocks over [B, 4, 8] patches), applied to its own
    output again, through ``between`` (recycling, AlphaFold-style): one pass of data, whatever is between."""

    def __init__(self, between: str | None) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4)
        self.trunk = nn.Module()
        self.trunk.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.trunk.forward = types.MethodType(_run_blocks, self.trunk)
        self.between = between

    def training_step(self, batch, batch_idx):
        e = self.embed(batch["view1"]).flatten(2).transpose(1, 2)
        if self.between == "inline_clone":  # nothing holds the first output: freed before the second call
            return self.trunk(self.trunk(e).clone()).pow(2).mean()
        if self.between == "inline_add":
            return self.trunk(self.trunk(e) + e).pow(2).mean()
        if self.between == "memory":  # the next segment beside the last 2 positions of the first: other positions
            e2 = self.embed(batch["view1"].flip(-1)).flatten(2).transpose(1, 2)
            return self.trunk(torch.cat([self.trunk(e)[:, -2:], e2], 1)).pow(2).mean()
        h = self.trunk(e)
        h = {None: h, "detach": h.detach(), "clone": h.clone(), "norm": F.layer_norm(h, (8,))}[self.between]
        return self.trunk(h).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _run_blocks(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
    for block in self.blocks:
        h = block(h)
    return h


@pytest.mark.parametrize(
    ("between", "positions"),
    [(None, 4), ("detach", 4), ("clone", 4), ("norm", 4), ("inline_clone", 4), ("inline_add", 4), ("memory", 10)],
)
def test_a_network_applied_to_its_own_output_counts_one_pass(tmp_path, between, positions):
    """Its output detached or cloned before the second call was taken for other data: tokens twice (qa54-break 04),
    also written inline, where nothing holds the first output (qa55-break 02). An input of other positions made
    from an output (a memory of 2 positions beside the next segment's 4) is another pass: it counted none
    (qa55-break 01)."""
    data = [{"view1": x} for x in torch.randn(16, 3, 8, 8)]
    monitor = EfficiencyMonitor(print_summary=False)
    make_trainer(tmp_path, [monitor], max_steps=2, max_epochs=-1).fit(_Refeeds(between), DataLoader(data, 4))
    assert monitor.summary["tokens"] == 2 * 4 * positions  # 2 steps x 4 images x the patch positions run
    assert monitor.summary["layer_tokens"] == 2 * 2 * 4 * positions


class _AttentionBlock(_Block):
    def __init__(self, d: int = 8) -> None:
        super().__init__(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.attn(x, x, x, need_weights=False)[0])


class _TextTower(nn.Module):
    def __init__(self, depth: int, embed: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 8) if embed else None
        self.layers = nn.ModuleList(_AttentionBlock() for _ in range(depth))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) if self.embed is not None else ids
        for layer in self.layers:
            h = layer(h)
        return h.mean(1)


class _CLIP(pl.LightningModule):
    """Two towers: images [B, 3, 8, 8] -> 4 patches through 2 (or ``image_depth``) blocks; captions [B, T] ids with an
    attention mask through ``text_depth`` blocks; a contrastive loss."""

    def __init__(self, image_depth: int, text_depth: int, outside: bool = False) -> None:
        super().__init__()
        self.visual = _PatchEncoder()
        self.visual.blocks = nn.ModuleList(_AttentionBlock() for _ in range(image_depth))
        self.text = _TextTower(text_depth, embed=not outside)
        # the token embedding held outside the tower (tied with a head, shared with a decoder: CoCa), with a
        # position embedding added before the tower
        self.tok, self.pos = (nn.Embedding(V, 8), nn.Parameter(torch.zeros(8))) if outside else (None, None)

    def training_step(self, batch, batch_idx):
        zi = F.normalize(self.visual(batch["pixel_values"]), dim=-1)
        ids = batch["input_ids"]
        zt = F.normalize(self.text(ids if self.tok is None else self.tok(ids) + self.pos), dim=-1)
        logits = zi @ zt.t()
        return F.cross_entropy(logits, torch.arange(len(logits)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("outside", [False, True])
@pytest.mark.parametrize("caption_length", [2, 4, 6])  # fewer, as many (the ids tell) and more positions than 4
@pytest.mark.parametrize(("image_depth", "text_depth"), [(4, 2), (1, 3)])
def test_two_towers_count_the_tower_the_token_ids_feed(tmp_path, caption_length, image_depth, text_depth, outside):
    """Tokens were the captions' mask sum, and layer-tokens those times the image tower's depth when it was the
    deeper (qa50-clip 01); captions shorter than the image's positions had the difference added as a "prefix"
    (qa50-clip 02). Both now count the text tower: its tokens, times its depth; also when it is called on the ids'
    embedding, made outside it (qa54-break 08)."""
    g = torch.Generator().manual_seed(0)
    data = []
    for i in range(8):
        mask = torch.ones(caption_length, dtype=torch.long)
        mask[caption_length - i % 2 :] = 0  # every other caption padded by one
        ids = torch.randint(1, V, (caption_length,), generator=g)
        data.append({"pixel_values": torch.randn(3, 8, 8, generator=g), "input_ids": ids, "attention_mask": mask})
    monitor = EfficiencyMonitor(print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(tmp_path, [monitor], max_steps=2, max_epochs=-1)
        trainer.fit(_CLIP(image_depth, text_depth, outside), DataLoader(data, batch_size=4))
    tokens = sum(int(d["attention_mask"].sum()) for d in data)
    assert monitor.summary["tokens"] == tokens
    assert monitor.summary["layer_tokens"] == tokens * text_depth
    assert not [w for w in caught if "positions a row" in str(w.message)]  # no prefix was taken
    other = [str(w.message) for w in caught if "also trains the transformer blocks" in str(w.message)]
    assert other and f"count the {text_depth} blocks of text.layers" in other[0] and "visual.blocks" in other[0]


class _LazyTeacher(pl.LightningModule):
    """A student and its momentum teacher (``copy.deepcopy`` of the student, frozen, run under ``no_grad``), made in
    ``__init__`` or, as BYOL / DINO recipes often do, in the first ``training_step``."""

    def __init__(self, lazy: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = _PatchEncoder()
        self.teacher = None if lazy else copy.deepcopy(self.student).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        if self.teacher is None:
            self.teacher = copy.deepcopy(self.student).requires_grad_(False)
        (x,) = batch
        with torch.no_grad():
            target = self.teacher(x)
        return F.mse_loss(self.student(x), target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.student.parameters(), lr=0.01)


def test_a_network_made_in_the_first_training_step_is_counted_at_that_step(tmp_path):
    """The recorder named the root's modules at the step's start: a teacher made inside the first step was not, so its
    calls were left out of the FLOPs of that step (and of every step of its shape until the structure changed): 9.16e8
    for 9.75e8 over 4 steps (qa51-distill 02)."""
    data = TensorDataset(torch.randn(16, 3, 8, 8))
    flops = []
    for lazy in (False, True):
        monitor = EfficiencyMonitor(print_summary=False)
        make_trainer(tmp_path, [monitor], max_steps=2, max_epochs=-1).fit(_LazyTeacher(lazy), DataLoader(data, 4))
        flops.append(monitor.summary["flops"])
    assert flops[1] == flops[0] > 0


def test_a_frozen_tower_the_token_ids_feed_is_not_counted_over_the_trained_one(tmp_path):
    """The tower the ids feed is preferred among the trained lists only: a frozen text encoder reading the captions
    beside a trained network (a text-conditioned DiT) was counted instead of it (qa52-break 01)."""
    data = [{"pixel_values": torch.randn(3, 8, 8), "input_ids": torch.randint(1, V, (4,)),
             "attention_mask": torch.ones(4, dtype=torch.long)} for _ in range(8)]  # fmt: skip
    module = _CLIP(image_depth=3, text_depth=2)
    module.text.requires_grad_(False)
    monitor = EfficiencyMonitor(print_summary=False)
    make_trainer(tmp_path, [monitor], max_steps=2, max_epochs=-1).fit(module, DataLoader(data, batch_size=4))
    assert monitor.summary["tokens"] == 2 * 4 * 4
    assert monitor.summary["layer_tokens"] == 3 * monitor.summary["tokens"]  # the trained image tower's depth


def test_a_computed_argument_of_a_size_the_batch_keeps_is_replayed_on_the_baseline_batch():
    """A projection applied in training_step to a tower's pooled [B, H] output: its argument is computed, not a batch
    tensor, so its shape on the curriculum's untruncated batch was unknown and the baseline's FLOPs were taken as
    the trained ones (saving 0, qa50-clip 03). A computed argument without a size the batch's tensors change keeps its
    shape; one with such a size is still refused."""
    from lightning_effi.core.accounting import _shapes
    from lightning_effi.core.measure import MeasureError

    class Tower(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.proj = nn.Embedding(V, 32), nn.Linear(32, 16)

    module = Tower()
    cut, whole = {"input_ids": torch.randint(0, V, (4, 8))}, {"input_ids": torch.randint(0, V, (4, 39))}
    recorder = CallRecorder()
    recorder.start(module, cut)
    hidden = module.embed(cut["input_ids"])
    module.proj(hidden.mean(1))  # [4, 32]: no size of the cut axis
    module.proj(hidden[:, :, :32].transpose(1, 2).flatten(0, 1).reshape(4, 8, 32).mean(1))  # computed alike
    recorder.stop(cut)
    embed, proj, _ = recorder.calls
    assert embed.on_batch(whole, _shapes(cut)).tensors()[0].shape == (4, 39)
    assert proj.on_batch(whole, _shapes(cut)).tensors()[0].shape == (4, 32)
    with pytest.raises(MeasureError, match="not a tensor of the batch itself"):
        proj.on_batch(whole)  # without the recorded shapes: unknown, as before
    recorder.start(module, cut)
    module.proj(module.embed(cut["input_ids"]))  # [4, 8, 32]: a size of the cut axis
    recorder.stop(cut)
    with pytest.raises(MeasureError, match="not a tensor of the batch itself"):
        recorder.calls[1].on_batch(whole, _shapes(cut))


def test_callables_set_on_a_module_are_rebound_to_the_replay_copy_and_nothing_else_is_unwrapped():
    """The FLOPs replay's copy calls the copy's modules through a bound method, a partial, a closure or a wrapper of
    one set on an instance (qa52-ddp 01, qa53-break 01); a wrapper of anything else keeps its wrapper."""
    import functools

    from lightning_effi.core.measure import _rebound

    real, copy_ = nn.Linear(2, 2), nn.Linear(2, 2)
    copies = {id(real): copy_}

    def doubled(fn):
        @functools.wraps(fn)
        def wrapper(*args):
            return fn(*args) * 2

        return wrapper

    assert _rebound(real.forward, copies).__self__ is copy_
    assert _rebound(functools.partial(real.forward), copies).func.__self__ is copy_
    wrapped = _rebound(doubled(real.forward), copies)
    assert wrapped.__closure__[0].cell_contents.__self__ is copy_
    x = torch.randn(3, 2)
    assert torch.equal(wrapped(x), copy_(x) * 2)  # the wrapper kept, around the copy's method
    closure = _rebound((lambda x: real(x)), copies)
    assert closure.__closure__[0].cell_contents is copy_
    other = doubled(torch.relu)
    assert _rebound(other, copies) is other and _rebound(torch.relu, copies) is torch.relu


def test_training_flops_are_counted_under_detect_anomaly(tmp_path):
    """Trainer(detect_anomaly=True): the anomaly mode's backward checks failed on the replay's fake tensors, taken for
    a data-dependent shape, and FLOPs read 0 (qa54-extras 02). They equal the plain run's."""

    def flops(anomaly: bool) -> float:
        pl.seed_everything(0)
        monitor = EfficiencyMonitor(print_summary=False)
        trainer = make_trainer(tmp_path / str(anomaly), [monitor], max_steps=2, max_epochs=-1, detect_anomaly=anomaly)
        trainer.fit(HandLM(), DataLoader([{"input_ids": torch.randint(0, 64, (12,))} for _ in range(8)], 4))
        return monitor.summary["flops"]

    assert flops(True) == flops(False) == 2 * 3 * 2 * 4 * 12 * 16 * 64  # the head's matmul, 2 steps (HandLM)


class _GraphConv(pl.LightningModule):
    """A hand-written GNN on PyG-style batches ``{x [N, 4], edge_index [2, E], batch [N], y [G]}``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.conv, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        h, edges = self.inp(batch["x"]), batch["edge_index"]
        h = F.relu(self.conv(h + torch.zeros_like(h).index_add(0, edges[1], h[edges[0]])))
        pooled = torch.zeros(len(batch["y"]), 8).index_add(0, batch["batch"], h)
        return F.cross_entropy(self.head(pooled), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_run_that_replays_most_of_its_batches_is_warned_once(tmp_path):
    """Graph batches differ in their nodes and edges, two sizes no length interpolation reads: the FLOPs replay ran at
    28 of 40 batches, the monitor's time 15x the training's, in silence (qa54-domains 04). A warning names
    effi_training_flops."""
    g = torch.Generator().manual_seed(0)
    data = []
    for i in range(24):  # two graphs a batch, of 3 + i nodes and 5 + 2 i edges in all
        n, e = 3 + i, 5 + 2 * i
        data.append({"x": torch.randn(n, 4, generator=g), "edge_index": torch.randint(0, n, (2, e), generator=g),
                     "batch": (torch.arange(n) >= n // 2).long(), "y": torch.tensor([0, 1])})  # fmt: skip
    monitor = EfficiencyMonitor(print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [monitor], max_steps=24, max_epochs=-1).fit(
            _GraphConv(), DataLoader(data, batch_size=None)
        )
    said = [str(w.message) for w in caught if "measured by a replay at" in str(w.message)]
    assert len(said) == 1 and "at 20 of the 20 batches" in said[0] and "effi_training_flops" in said[0]
    assert monitor.summary["flops"] > 0


class _HeldElsewhere(UserModule):
    """Its blocks reached through a plain object (a ``SimpleNamespace``), or its ``forward`` set on the instance to a
    callable object around another method of its own (one that runs the blocks twice)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        import types as _types

        self.embed, self.head = nn.Embedding(V, 32), nn.Linear(32, V)
        self.blocks = nn.ModuleList(OwnBlock() for _ in range(2))
        self.held = _types.SimpleNamespace(blocks=self.blocks)
        if how == "object":
            self.forward = _Calls(self.forward_twice)  # type: ignore[method-assign]
        self.how = how

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.held.blocks:
            h = block(h)
        return self.head(h)

    def forward_twice(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in [*self.blocks, *self.blocks]:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return F.cross_entropy(self(ids).flatten(0, 1), labels.flatten())


class _Calls:
    def __init__(self, f: Any) -> None:
        self.f = f

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.f(*args, **kwargs)


@pytest.mark.parametrize("how", ["namespace", "object"])
def test_a_replay_reaching_the_real_network_counts_what_the_step_ran(tmp_path: Path, how: str) -> None:
    """A replay that runs the real modules (reached through a plain object, or a callable object set as the
    forward) read 0 FLOPs, or the class's other forward, while a guard against it was in place (qa56-break 01, 09):
    each batch's FLOPs equal the flop counter's on the real step."""
    pl.seed_everything(0)
    _, measured, per_batch = fit(_HeldElsewhere(how), token_loader(), tmp_path, 2)
    assert [row["flops"] for row in per_batch.rows] == measured.per_batch and measured.per_batch[0] > 0


def test_a_teacher_out_of_the_optimizer_run_under_no_grad_is_not_the_counted_stack(tmp_path):
    """A distillation teacher left ``requires_grad=True`` but out of ``configure_optimizers`` and run under
    ``torch.no_grad``: its 8 blocks were counted as the trained stack (layer-tokens 2x the student's 4, and the
    warning said the module "also trains" the student's blocks; qa113-distill 03). Counted: the student's, as with
    the teacher frozen; no other-blocks warning; random-LTD in the student saves layer-tokens."""

    def gpt2(seed: int, n_layer: int) -> transformers.GPT2LMHeadModel:
        torch.manual_seed(seed)
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=n_layer, n_head=2)
        return transformers.GPT2LMHeadModel(config)

    class Distill(pl.LightningModule):
        def __init__(self, frozen: bool) -> None:
            super().__init__()
            self.teacher = gpt2(1, 8).eval().requires_grad_(not frozen)
            self.student = gpt2(0, 4)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            with torch.no_grad():
                target = self.teacher(input_ids=ids).logits
            out = self.student(input_ids=ids, labels=ids)
            kl = F.kl_div(F.log_softmax(out.logits, -1), F.log_softmax(target, -1), log_target=True)
            return out.loss + kl

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.student.parameters(), lr=0.01)

    ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
    summaries = []
    for frozen, ltd in ((True, False), (False, False), (False, True)):
        monitor = EfficiencyMonitor(print_summary=False)
        extra = [RandomLTDCallback(model_attr="student", min_value=4, seq_per_step=4, require_steps=8)] if ltd else []
        trainer = make_trainer(tmp_path, [monitor, *extra], max_steps=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(Distill(frozen), DataLoader(TensorDataset(ids), batch_size=8))
        assert not [w for w in caught if "also trains" in str(w.message)], [str(w.message) for w in caught]
        summaries.append(monitor.summary)
    assert summaries[0]["layer_tokens"] == summaries[1]["layer_tokens"] == 2 * 8 * 16 * 4  # the student's 4 blocks
    assert summaries[2]["layer_tokens_saved_frac"] > 0.2  # 2 of 4 blocks on 4 of 16 tokens: 3/8 saved


def test_an_embedding_bag_batch_read_from_its_flat_ids_is_warned(tmp_path):
    """PyTorch's ``nn.EmbeddingBag`` input, ``(flat ids [L], offsets [B], y [B])``: the samples were read as the ``L``
    history items, in silence (qa113-tabular 04). A warning names the shapes and ``effi_count_samples``, which counts
    the users; a batch whose tensors agree is not warned."""

    class Recommender(pl.LightningModule):
        def __init__(self, own_count: bool) -> None:
            super().__init__()
            self.bag, self.head = nn.EmbeddingBag(50, 8, mode="mean"), nn.Linear(8, 2)
            if own_count:
                self.effi_count_samples = lambda batch: int(batch[1].shape[0])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids, offsets, y = batch
            return F.cross_entropy(self.head(self.bag(ids, offsets)), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    histories = [torch.randint(0, 50, (int(n),), generator=g) for n in torch.randint(1, 8, (16,), generator=g)]

    def collate(rows: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lengths = torch.tensor([0] + [len(h) for h, _ in rows[:-1]])
        return torch.cat([h for h, _ in rows]), lengths.cumsum(0), torch.tensor([y for _, y in rows])

    rows = [(h, i % 2) for i, h in enumerate(histories)]
    for own in (False, True):
        monitor = EfficiencyMonitor(print_summary=False)
        trainer = make_trainer(tmp_path, [monitor], max_steps=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(Recommender(own), DataLoader(rows, batch_size=8, collate_fn=collate))
        warned = [str(w.message) for w in caught if "a flat [" in str(w.message)]
        if own:
            assert not warned and monitor.summary["samples"] == 16
        else:
            assert len(warned) == 1 and "effi_count_samples" in warned[0] and "1: 8, 2: 8" in warned[0], warned
            assert monitor.summary["samples"] == sum(len(h) for h in histories)  # read as the items, warned
    agree = make_trainer(tmp_path, [EfficiencyMonitor(print_summary=False)], max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        users = torch.arange(16)
        data = DataLoader(list(zip(users, users % 2)), batch_size=8)
        agree.fit(UserIds(), data)
    assert not [w for w in caught if "a flat [" in str(w.message)]


class UserIds(pl.LightningModule):
    """A recommender over user ids ``[B]`` and labels ``[B]``: a flat first tensor whose length is the samples."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 4), nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        users, y = batch
        return F.cross_entropy(self.head(self.emb(users)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_graph_batch_with_a_flat_first_tensor_gets_the_graph_warning():
    """A PyG-style batch whose first tensor is 1-D (QM9's atomic numbers ``z [N]``, then ``pos``, ``edge_index``,
    ``batch``, ``y [G]``) was explained as an EmbeddingBag's ids or a per-batch constant (qa115-regress 06): the
    graph batch's warning is given."""
    batch = {
        "z": torch.ones(41, dtype=torch.long),
        "pos": torch.zeros(41, 3),
        "edge_index": torch.zeros(2, 80, dtype=torch.long),
        "batch": torch.zeros(41, dtype=torch.long),
        "y": torch.zeros(8),
    }
    monitor = EfficiencyMonitor(print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert monitor._samples_of(batch, actual=True) == 41
    told = [str(w.message) for w in caught]
    assert len(told) == 1 and "disagree on their first dimension" in told[0] and "EmbeddingBag" not in told[0]
