"""HF GPT-2 (``transformers`` 5.x ``GPT2Model`` inside ``GPT2LMHeadModel`` and friends)."""

from __future__ import annotations

from torch import nn

from lightning_effi.models.base import MUST_BE_NONE, PASS, ArgSpec, SeqArg, TransformerAdapter, register_adapter

SUPPORTED_ATTENTION = ("eager", "sdpa")


def check_attention(config: object, model: str) -> None:
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(f"{model}: attn_implementation={impl!r} is not supported by random-LTD (its masks are not "
                         f"gatherable tensors); use one of {SUPPORTED_ATTENTION}")


@register_adapter("hf_gpt2")
class HFGPT2Adapter(TransformerAdapter):
    """Layers ``transformer.h`` (``GPT2Block``). Block call in transformers 5.x:
    ``block(hidden, cache, causal_mask, encoder_hidden_states, encoder_attention_mask=, use_cache=, position_ids=)``.
    The mask (``None`` + causal flag under ``sdpa`` without padding; ``[B, 1, S, S]`` bool or additive float
    otherwise) is gathered on both axes; ``position_ids [1, S]`` on its last axis; the cache must be ``None``
    (``config.use_cache`` is switched off during fit and restored at teardown)."""

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        from transformers import GPT2Model

        return isinstance(module, GPT2Model)

    def layers(self) -> nn.ModuleList:
        return self.root.h

    @property
    def layer_arguments(self) -> dict[str, ArgSpec]:
        return {
            "cache": MUST_BE_NONE,
            "layer_past": MUST_BE_NONE,
            "attention_mask": SeqArg((-2, -1)),
            "encoder_hidden_states": PASS,
            "encoder_attention_mask": SeqArg((-2,), only_matching=True),
            "use_cache": PASS,
            "position_ids": SeqArg((-1,)),
            "output_attentions": PASS,
        }

    def max_sequence_length(self) -> int:
        return int(self.root.config.n_positions)

    def hidden_size(self) -> int:
        return int(self.root.config.n_embd)

    def intermediate_size(self) -> int:
        inner = self.root.config.n_inner
        return int(inner) if inner is not None else 4 * self.hidden_size()

    def check(self) -> None:
        check_attention(self.root.config, "hf_gpt2")

    def on_setup(self) -> None:
        self._use_cache = self.root.config.use_cache
        self.root.config.use_cache = False

    def on_teardown(self) -> None:
        if hasattr(self, "_use_cache"):
            self.root.config.use_cache = self._use_cache
