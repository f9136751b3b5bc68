"""HF BERT (``transformers`` 5.x ``BertModel`` inside ``BertForMaskedLM``, ``BertForSequenceClassification``, ...):
the random-LTD adapter (:class:`HFBertAdapter`) and the V-cycle parameter map (:class:`HFBertVCycleAdapter`), both
registered as the family ``hf_bert``. The method cards are ``lightning_effi/random_ltd/README.md`` and
``lightning_effi/vcycle/README.md``."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_effi.models.base import (
    MUST_BE_NONE,
    PASS,
    ArgSpec,
    SeqArg,
    TransformerAdapter,
    input_ids_length,
    register_adapter,
)
from lightning_effi.models.gpt2 import check_attention
from lightning_effi.models.vcycle_base import (
    COPY,
    ArchSizes,
    ParamSpec,
    TableContext,
    VCycleAdapter,
    hf_build_small,
    input_only,
    linear,
    register_vcycle_adapter,
    vector,
)
from lightning_effi.vcycle.operators import VCyclePlan


@register_adapter("hf_bert")
class HFBertAdapter(TransformerAdapter):
    """Layers ``encoder.layer`` (``BertLayer``). Layer call in transformers 5.x:
    ``layer(hidden, attention_mask, encoder_hidden_states, encoder_attention_mask=, cache=, **kwargs)``. The mask is
    ``None`` without padding and ``[B, 1, S, S]`` with it (a ``[B, 1, 1, S]`` form is gathered on its key axis only);
    ``position_ids`` (when passed) on its last axis; the cache must be ``None``. Heads (MLM, pooler + classifier)
    run on the full sequence.

    Raises:
        ValueError: (construction) ``root`` is not a ``BertModel`` (naming the adapter, what it expects, the model
            given and a ``BertModel`` inside it if there is one)."""

    expects = "a BERT-style model with .encoder.layer (a transformers BertModel)"

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        from transformers import BertModel

        return isinstance(module, BertModel)

    def layers(self) -> nn.ModuleList:
        return self.root.encoder.layer

    @property
    def layer_arguments(self) -> dict[str, ArgSpec]:
        return {
            "attention_mask": SeqArg((-2, -1)),
            "encoder_hidden_states": PASS,
            "encoder_attention_mask": SeqArg((-2,), only_matching=True),
            "cache": MUST_BE_NONE,
            "past_key_values": MUST_BE_NONE,
            "position_ids": SeqArg((-1,)),
            "output_attentions": PASS,
            "use_cache": PASS,
        }

    def max_sequence_length(self) -> int:
        return int(self.root.config.max_position_embeddings)

    def sequence_length(self, batch: Any) -> int | None:
        """``S`` of a batch ``{"input_ids": [B, S], ...}`` (or ``inputs_embeds``): the layers see those tokens."""
        return input_ids_length(batch)

    def hidden_size(self) -> int:
        return int(self.root.config.hidden_size)

    def intermediate_size(self) -> int:
        return int(self.root.config.intermediate_size)

    def check(self) -> None:
        check_attention(self.root.config, "hf_bert")


@register_vcycle_adapter
class HFBertVCycleAdapter(VCycleAdapter):
    """V-cycle map of HF BERT: ``BertForMaskedLM`` (decoder tied to the word embeddings, decoder bias = prediction
    bias, copied), ``BertForSequenceClassification`` (pooler: E × in(E); classifier: in(E), bias copied),
    ``BertForPreTraining`` (+ NSP head), ``BertModel``. ``exact`` convention: the MLM head's
    ``transform.LayerNorm`` γ, β ×c when the decoder is tied."""

    name = "hf_bert"
    default_alpha_original = 0.5
    models = "transformers BertForMaskedLM, BertForSequenceClassification, BertForPreTraining, BertModel"
    KEYS = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers")

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        try:
            from transformers import (
                BertForMaskedLM,
                BertForPreTraining,
                BertForSequenceClassification,
                BertModel,
            )
        except ImportError:  # pragma: no cover
            return False
        return type(model) in (BertForMaskedLM, BertForSequenceClassification, BertForPreTraining, BertModel)

    def sizes(self, model: nn.Module) -> ArchSizes:
        c = model.config
        if getattr(c, "add_cross_attention", False):
            raise ValueError("hf_bert: add_cross_attention=True is not supported by the V-cycle maps")
        return ArchSizes(
            int(c.hidden_size),
            int(c.num_attention_heads),
            int(c.intermediate_size),
            int(c.num_hidden_layers),
            self.KEYS,
        )

    @staticmethod
    def _prefix(model: nn.Module) -> str:
        return "bert." if hasattr(model, "bert") else ""

    def layer_prefix(self, model: nn.Module) -> str:
        return self._prefix(model) + "encoder.layer."

    def param_table(self, model: nn.Module, ctx: TableContext) -> tuple[dict[str, ParamSpec], dict[str, ParamSpec]]:
        p = self._prefix(model)
        e = ctx.embedding_scale
        head_scale = ctx.exact_scale if ctx.tied("cls.predictions.decoder.weight") else 1.0
        glob = {
            f"{p}embeddings.word_embeddings.weight": vector("E", 1, e),
            f"{p}embeddings.position_embeddings.weight": vector("E", 1, e),
            f"{p}embeddings.token_type_embeddings.weight": vector("E", 1, e),
            f"{p}embeddings.LayerNorm.weight": vector("E"),
            f"{p}embeddings.LayerNorm.bias": vector("E"),
            f"{p}pooler.dense.weight": linear("E", "E"),
            f"{p}pooler.dense.bias": vector("E"),
            "cls.predictions.transform.dense.weight": linear("E", "E"),
            "cls.predictions.transform.dense.bias": vector("E"),
            "cls.predictions.transform.LayerNorm.weight": vector("E", 0, head_scale),
            "cls.predictions.transform.LayerNorm.bias": vector("E", 0, head_scale),
            "cls.predictions.decoder.weight": input_only("E"),
            "cls.predictions.decoder.bias": COPY,
            "cls.predictions.bias": COPY,
            "cls.seq_relationship.weight": input_only("E"),
            "cls.seq_relationship.bias": COPY,
            "classifier.weight": input_only("E"),
            "classifier.bias": COPY,
        }
        block = {
            "attention.self.query.weight": linear("QK", "E"),
            "attention.self.query.bias": vector("QK"),
            "attention.self.key.weight": linear("QK", "E"),
            "attention.self.key.bias": vector("QK"),
            "attention.self.value.weight": linear("V", "E"),
            "attention.self.value.bias": vector("V"),
            "attention.output.dense.weight": linear("E", "V"),
            "attention.output.dense.bias": vector("E"),
            "attention.output.LayerNorm.weight": vector("E"),
            "attention.output.LayerNorm.bias": vector("E"),
            "intermediate.dense.weight": linear("I", "E"),
            "intermediate.dense.bias": vector("I"),
            "output.dense.weight": linear("E", "I"),
            "output.dense.bias": vector("E"),
            "output.LayerNorm.weight": vector("E"),
            "output.LayerNorm.bias": vector("E"),
        }
        return glob, block

    def build_small(self, model: nn.Module, plan: VCyclePlan) -> nn.Module:
        return self._finish(model, hf_build_small(model, plan, self.KEYS), plan)
