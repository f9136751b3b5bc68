"""Tiny seeded models for the V-cycle operator tests (configs only, no downloads, dropout 0)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB = 64


def perturb(model: nn.Module, seed: int = 0, std: float = 0.1) -> nn.Module:
    """Add seeded noise to every parameter in place (HF inits LayerNorm to 1/0 and biases to 0, which would hide
    mapping errors); tied parameters stay tied (one Parameter)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * std)
    return model


def gpt2(tied: bool = True, n_layer: int = 4, n_embd: int = 32, n_head: int = 4, **kw: Any) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
        **kw,
    )
    torch.manual_seed(0)
    return perturb(GPT2LMHeadModel(cfg).eval())


def gpt2_cls() -> nn.Module:
    from transformers import GPT2Config, GPT2ForSequenceClassification

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_layer=4,
        n_embd=32,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
        num_labels=3,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return perturb(GPT2ForSequenceClassification(cfg).eval())


def _bert_cfg(**kw: Any) -> Any:
    from transformers import BertConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    return BertConfig(**{**base, **kw})


def bert_mlm(tied: bool = True, **kw: Any) -> nn.Module:
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    return perturb(BertForMaskedLM(_bert_cfg(tie_word_embeddings=tied, **kw)).eval())


def bert_cls(**kw: Any) -> nn.Module:
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    return perturb(BertForSequenceClassification(_bert_cfg(num_labels=3, **kw)).eval())


def vit(name: str = "vit_tiny_patch16_224", **kw: Any) -> nn.Module:
    import timm

    base = dict(img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=4, num_classes=10)
    torch.manual_seed(0)
    return perturb(timm.create_model(name, **{**base, **kw}).eval())


def deit_distilled(**kw: Any) -> nn.Module:
    return vit("deit_tiny_distilled_patch16_224", **kw)


def vit_rich(**kw: Any) -> nn.Module:
    """LayerScale, q/k norm, register tokens, pre-norm, average pooling with fc_norm."""
    return vit(init_values=0.1, qk_norm=True, reg_tokens=2, pre_norm=True, global_pool="avg", fc_norm=True, **kw)


#: name -> (builder, model input builder, logits function)
def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def _images() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def hf_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits


def timm_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], Callable[..., torch.Tensor]]] = {
    "gpt2_tied": (lambda: gpt2(True), _tokens, hf_logits),
    "gpt2_untied": (lambda: gpt2(False), _tokens, hf_logits),
    "gpt2_cls": (gpt2_cls, _tokens, hf_logits),
    "bert_mlm_tied": (lambda: bert_mlm(True), _tokens, hf_logits),
    "bert_mlm_untied": (lambda: bert_mlm(False), _tokens, hf_logits),
    "bert_cls": (bert_cls, _tokens, hf_logits),
    "vit": (vit, _images, timm_logits),
    "deit_distilled": (deit_distilled, _images, timm_logits),
    "vit_rich": (vit_rich, _images, timm_logits),
}

_CACHE: dict[str, nn.Module] = {}


def model(name: str) -> nn.Module:
    """A fresh deep copy of the cached model ``name`` (building is the slow part)."""
    if name not in _CACHE:
        _CACHE[name] = MODELS[name][0]()
    return copy.deepcopy(_CACHE[name])


def logits(name: str, m: nn.Module) -> torch.Tensor:
    _, inp, fn = MODELS[name]
    return fn(m, inp())
