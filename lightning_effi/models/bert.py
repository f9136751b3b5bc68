"""HF BERT (``transformers`` 5.x ``BertModel`` inside ``BertForMaskedLM``, ``BertForSequenceClassification``, ...)."""

from __future__ import annotations

from torch import nn

from lightning_effi.models.base import MUST_BE_NONE, PASS, ArgSpec, SeqArg, TransformerAdapter, register_adapter
from lightning_effi.models.gpt2 import check_attention


@register_adapter("hf_bert")
class HFBertAdapter(TransformerAdapter):
    """Layers ``encoder.layer`` (``BertLayer``). Layer call in transformers 5.x:
    ``layer(hidden, attention_mask, encoder_hidden_states, encoder_attention_mask=, cache=, **kwargs)``. The mask is
    ``None`` without padding and ``[B, 1, S, S]`` with it (a ``[B, 1, 1, S]`` form is gathered on its key axis only);
    ``position_ids`` (when passed) on its last axis; the cache must be ``None``. Heads (MLM, pooler + classifier)
    run on the full sequence."""

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

    def hidden_size(self) -> int:
        return int(self.root.config.hidden_size)

    def intermediate_size(self) -> int:
        return int(self.root.config.intermediate_size)

    def check(self) -> None:
        check_attention(self.root.config, "hf_bert")
