"""Hugging Face transformer tasks built from configs (no pretrained weights): GPT-2 causal LM, BERT masked LM and
BERT sequence classification. All follow the per-sample-loss contract of
:class:`~lightning_effi.reference.tasks.base.EffiTask`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch.nn.functional as F
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
)

from lightning_effi.core.flops import sdpa_recomputes, transformer_training_flops
from lightning_effi.reference.tasks.base import EffiTask, OptimizerFactory, SchedulerFactory

IGNORE_INDEX = -100
AttnImpl = Literal["eager", "sdpa"]


def _require(name: str, value: Any, cond: bool, allowed: str) -> None:
    if not cond:
        raise ValueError(f"model.{name}: expected {allowed}, got {value!r}")


def _is_int(x: Any) -> bool:
    """A Python int (not numpy's, not a bool): these values go into HF configs and the saved hyperparameters."""
    return isinstance(x, int) and not isinstance(x, bool)


def _check_transformer(
    vocab_size: Any,
    n_layer: Any,
    hidden: Any,
    n_head: Any,
    attn: Any,
    positions: Any,
    dropout: Any,
    positions_key: str,
    pad_token_id: Any = 0,
) -> None:
    _require(
        "vocab_size",
        vocab_size,
        _is_int(vocab_size) and vocab_size > 0,
        "a positive int (left null in the config, it is filled from the DataModule's model_hints())",
    )
    _require("n_layer", n_layer, _is_int(n_layer) and n_layer >= 1, "an int >= 1")
    _require("n_embd", hidden, _is_int(hidden) and hidden >= 1, "an int >= 1")
    _require(
        "n_head",
        n_head,
        _is_int(n_head) and n_head >= 1 and hidden % n_head == 0,
        f"a positive divisor of n_embd={hidden}",
    )
    _require(positions_key, positions, _is_int(positions) and positions >= 2, "an int >= 2")
    _require(
        "dropout",
        dropout,
        isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1,
        "a number in [0, 1)",
    )
    _require(
        "pad_token_id",
        pad_token_id,
        _is_int(pad_token_id) and 0 <= pad_token_id < vocab_size,
        f"an int in [0, vocab_size={vocab_size})",
    )
    _require("attn_implementation", attn, attn in ("eager", "sdpa"), "'eager' or 'sdpa'")


def token_losses_per_sample(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over each sample's counted tokens.

    Args:
        logits: ``(B, T, V)`` float. targets: ``(B, T)`` int64, ``-100`` = not counted.

    Returns:
        ``(B,)`` float32; a sample with no counted token gets 0.
    """
    loss = F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")
    counted = (targets != IGNORE_INDEX).sum(dim=1)
    return loss.sum(dim=1) / counted.clamp(min=1)


class _HFTransformerTask(EffiTask):
    """Shared FLOPs bookkeeping of the Hugging Face tasks."""

    def fused_attention(self, attention_dropout: float) -> bool:
        """Whether the model's attention runs on a fused scaled-dot-product kernel in training, whose backward
        recomputes the scores (:func:`~lightning_effi.core.flops.sdpa_recomputes`): ``attn_implementation="sdpa"``
        on CUDA, or on the CPU without attention dropout. Read from the current model (a V-cycle level keeps the
        implementation of the full model)."""
        impl = getattr(self.model.config, "_attn_implementation", "eager")
        dropout = attention_dropout if self.model.training else 0.0
        return impl == "sdpa" and sdpa_recomputes(self.device, dropout)


class _LanguageModelTask(_HFTransformerTask):
    """Shared perplexity bookkeeping for the two language-model tasks."""

    def _init_perplexity(self) -> None:
        self.val_ppl = Perplexity(ignore_index=IGNORE_INDEX)
        self.test_ppl = Perplexity(ignore_index=IGNORE_INDEX)

    def update_metrics(self, stage: str, batch: Mapping[str, Tensor], output: tuple[Tensor, Tensor]) -> None:
        logits, targets = output
        metric = self.val_ppl if stage == "val" else self.test_ppl
        metric(logits.float(), targets)
        self.log(f"{stage}/ppl", metric, prog_bar=True, on_step=False, on_epoch=True)


class GPT2CausalLM(_LanguageModelTask):
    """GPT-2 causal language model (HF ``GPT2LMHeadModel``) built from a config.

    Batch: ``{"input_ids": int64 (B, T)}``, optionally ``"attention_mask"`` (B, T) and ``"labels"`` (B, T) with
    ``-100`` for ignored positions (default: the inputs). Per-sample loss: mean next-token cross-entropy over the
    T-1 predicted positions of each sample. Metrics: ``val/loss``, ``val/ppl`` (torchmetrics Perplexity).

    Args:
        vocab_size: tokenizer vocabulary (null in configs: filled from the DataModule). n_positions: max T.
        n_layer, n_embd, n_head: depth, width and heads. dropout: residual/embedding/attention dropout.
        attn_implementation: ``"eager"`` or ``"sdpa"``. tie_word_embeddings: tie the LM head to the embedding.

    Raises:
        ValueError: a missing or invalid size (message names the ``model.`` key).
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        n_positions: int = 256,
        n_layer: int = 4,
        n_embd: int = 128,
        n_head: int = 4,
        dropout: float = 0.0,
        attn_implementation: AttnImpl = "sdpa",
        tie_word_embeddings: bool = True,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        weight_decay: float | None = 0.1,
    ) -> None:
        super().__init__(optimizer, scheduler, weight_decay)
        _check_transformer(
            vocab_size, n_layer, n_embd, n_head, attn_implementation, n_positions, dropout, "n_positions"
        )
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        config = GPT2Config(
            vocab_size=vocab_size,
            n_positions=n_positions,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            use_cache=False,
            bos_token_id=vocab_size - 1,  # GPT-2's 50256 lies outside small vocabularies
            eos_token_id=vocab_size - 1,
            tie_word_embeddings=tie_word_embeddings,
            attn_implementation=attn_implementation,
        )
        self.model = GPT2LMHeadModel(config)
        self.effi_num_layers = n_layer
        self._init_perplexity()

    def model_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        inputs = {"input_ids": batch["input_ids"]}
        if "attention_mask" in batch:
            inputs["attention_mask"] = batch["attention_mask"]
        return inputs

    def per_sample_loss(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        logits = self.model(**self.model_inputs(batch)).logits
        labels = batch.get("labels", batch["input_ids"])
        if "attention_mask" in batch:
            labels = labels.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        logits, targets = logits[:, :-1], labels[:, 1:]
        return token_losses_per_sample(logits, targets), (logits, targets)

    def effi_training_flops(self, batch: Mapping[str, Tensor]) -> float:
        """Training FLOPs of one batch ``{"input_ids": (B, T), ...}`` with the current model (its config: a V-cycle
        level reads its own sizes): :func:`~lightning_effi.core.flops.transformer_training_flops` with the ``lm``
        head on all T positions (the labels' causal shift happens after the head), padding included, plus the fused
        attention kernels' recompute under ``sdpa``."""
        b, t = batch["input_ids"].shape
        cfg = self.model.config
        return transformer_training_flops(
            b,
            t,
            cfg.n_layer,
            cfg.n_embd,
            cfg.n_inner,
            cfg.vocab_size,
            head="lm",
            fused_attention=self.fused_attention(cfg.attn_pdrop),
        )

    def effi_data_limits(self) -> dict[str, int]:
        return {"vocab_size": self.model.config.vocab_size, "max_length": self.model.config.n_positions}


def _bert_config(
    vocab_size: int,
    n_layer: int,
    hidden: int,
    n_head: int,
    max_length: int,
    pad_token_id: int,
    dropout: float,
    attn: str,
    **extra: Any,
) -> BertConfig:
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        intermediate_size=4 * hidden,
        max_position_embeddings=max_length,
        type_vocab_size=1,
        pad_token_id=pad_token_id,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        attn_implementation=attn,
        **extra,
    )


class BertMaskedLM(_LanguageModelTask):
    """BERT masked language model (HF ``BertForMaskedLM``) built from a config.

    Batch: ``{"input_ids": int64 (B, T), "labels": int64 (B, T) (-100 = not masked), "attention_mask": (B, T)}``.
    Per-sample loss: mean cross-entropy over each sample's masked tokens (0 if it has none). Metrics: ``val/ppl``
    over masked tokens.

    Args: see :class:`GPT2CausalLM`; ``max_length`` = position embeddings, ``pad_token_id`` from the tokenizer.
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        max_length: int = 128,
        pad_token_id: int = 0,
        n_layer: int = 4,
        n_embd: int = 128,
        n_head: int = 4,
        dropout: float = 0.1,
        attn_implementation: AttnImpl = "sdpa",
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        weight_decay: float | None = 0.01,
    ) -> None:
        super().__init__(optimizer, scheduler, weight_decay)
        _check_transformer(
            vocab_size, n_layer, n_embd, n_head, attn_implementation, max_length, dropout, "max_length", pad_token_id
        )
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.model = BertForMaskedLM(
            _bert_config(vocab_size, n_layer, n_embd, n_head, max_length, pad_token_id, dropout, attn_implementation)
        )
        self.effi_num_layers = n_layer
        self._init_perplexity()

    def model_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        inputs = {"input_ids": batch["input_ids"]}
        if "attention_mask" in batch:
            inputs["attention_mask"] = batch["attention_mask"]
        return inputs

    def per_sample_loss(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        logits = self.model(**self.model_inputs(batch)).logits
        return token_losses_per_sample(logits, batch["labels"]), (logits, batch["labels"])

    def effi_training_flops(self, batch: Mapping[str, Tensor]) -> float:
        """Training FLOPs of one batch ``{"input_ids": (B, T), ...}``: the ``mlm`` head on all T positions (BERT
        projects every token, masked or not), padding included, plus the fused attention kernels' recompute."""
        b, t = batch["input_ids"].shape
        cfg = self.model.config
        return transformer_training_flops(
            b,
            t,
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.vocab_size,
            head="mlm",
            fused_attention=self.fused_attention(cfg.attention_probs_dropout_prob),
        )

    def effi_data_limits(self) -> dict[str, int]:
        cfg = self.model.config
        return {"vocab_size": cfg.vocab_size, "max_length": cfg.max_position_embeddings}


class BertSequenceClassifier(_HFTransformerTask):
    """BERT sequence classifier (HF ``BertForSequenceClassification``) built from a config.

    Batch: ``{"input_ids": int64 (B, T), "attention_mask": (B, T), "labels": int64 (B,)}``. Per-sample loss:
    cross-entropy ``(B,)``. Metrics: ``val/acc``, ``test/acc``.

    Args: see :class:`BertMaskedLM`; ``num_classes`` >= 2.
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        num_classes: int = 2,
        max_length: int = 128,
        pad_token_id: int = 0,
        n_layer: int = 4,
        n_embd: int = 128,
        n_head: int = 4,
        dropout: float = 0.1,
        attn_implementation: AttnImpl = "sdpa",
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        weight_decay: float | None = 0.01,
    ) -> None:
        super().__init__(optimizer, scheduler, weight_decay)
        _check_transformer(
            vocab_size, n_layer, n_embd, n_head, attn_implementation, max_length, dropout, "max_length", pad_token_id
        )
        _require("num_classes", num_classes, _is_int(num_classes) and num_classes >= 2, "an int >= 2")
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        config = _bert_config(
            vocab_size,
            n_layer,
            n_embd,
            n_head,
            max_length,
            pad_token_id,
            dropout,
            attn_implementation,
            num_labels=num_classes,
        )
        self.model = BertForSequenceClassification(config)
        self.effi_num_layers = n_layer
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def model_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def per_sample_loss(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        logits = self.model(**self.model_inputs(batch)).logits
        return F.cross_entropy(logits.float(), batch["labels"], reduction="none"), logits

    def update_metrics(self, stage: str, batch: Mapping[str, Tensor], output: Tensor) -> None:
        metric = self.val_acc if stage == "val" else self.test_acc
        metric(output.argmax(dim=-1), batch["labels"])
        self.log(f"{stage}/acc", metric, prog_bar=True, on_step=False, on_epoch=True)

    def effi_training_flops(self, batch: Mapping[str, Tensor]) -> float:
        """Training FLOPs of one batch ``{"input_ids": (B, T), ...}``: the ``cls`` head (pooler and classifier on
        the first token), padding included, plus the fused attention kernels' recompute."""
        b, t = batch["input_ids"].shape
        cfg = self.model.config
        return transformer_training_flops(
            b,
            t,
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            0,
            head="cls",
            num_classes=cfg.num_labels,
            fused_attention=self.fused_attention(cfg.attention_probs_dropout_prob),
        )

    def effi_data_limits(self) -> dict[str, int]:
        cfg = self.model.config
        return {"vocab_size": cfg.vocab_size, "max_length": cfg.max_position_embeddings, "num_classes": cfg.num_labels}


__all__ = ["GPT2CausalLM", "BertMaskedLM", "BertSequenceClassifier", "token_losses_per_sample"]
