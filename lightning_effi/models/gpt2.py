"""HF GPT-2 (``transformers`` 5.x ``GPT2Model`` inside ``GPT2LMHeadModel`` and friends): the random-LTD adapter
(:class:`HFGPT2Adapter`) and the V-cycle parameter map (:class:`HFGPT2VCycleAdapter`), both registered as the family
``hf_gpt2``. The method cards are ``lightning_effi/random_ltd/README.md`` and ``lightning_effi/vcycle/README.md``."""

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
from lightning_effi.models.vcycle_base import (
    ArchSizes,
    ParamSpec,
    TableContext,
    VCycleAdapter,
    conv1d,
    hf_build_small,
    input_only,
    register_vcycle_adapter,
    vector,
)
from lightning_effi.vcycle.operators import VCyclePlan

SUPPORTED_ATTENTION = ("eager", "sdpa")


def check_attention(config: object, model: str) -> None:
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"{model}: attn_implementation={impl!r} is not supported by random-LTD (its masks are not "
            f"gatherable tensors); use one of {SUPPORTED_ATTENTION}"
        )


@register_adapter("hf_gpt2")
class HFGPT2Adapter(TransformerAdapter):
    """Layers ``transformer.h`` (``GPT2Block``). Block call in transformers 5.x:
    ``block(hidden, cache, causal_mask, encoder_hidden_states, encoder_attention_mask=, use_cache=, position_ids=)``.
    The mask (``None`` + causal flag under ``sdpa`` without padding; ``[B, 1, S, S]`` bool or additive float
    otherwise) is gathered on both axes; ``position_ids [1, S]`` on its last axis; the cache must be ``None``
    (``config.use_cache`` is switched off during fit and restored at teardown).

    Raises:
        ValueError: (construction) ``root`` is not a ``GPT2Model`` (naming the adapter, what it expects, the model
            given and the ``GPT2Model`` inside it if there is one, e.g. ``GPT2LMHeadModel.transformer``)."""

    expects = "a GPT-2 model with .h (a transformers GPT2Model)"

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

    def sequence_length(self, batch: Any) -> int | None:
        """``S`` of a batch ``{"input_ids": [B, S], ...}`` (or ``inputs_embeds``): the layers see those tokens."""
        return input_ids_length(batch)

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


@register_vcycle_adapter
class HFGPT2VCycleAdapter(VCycleAdapter):
    """V-cycle map of HF GPT-2: ``Conv1D`` weights (in × out), fused ``c_attn`` = ``[Q; K; V]``, ``lm_head``
    tied to ``wte`` (alias) or untied (Linear input rule). ``exact`` convention: ``ln_f`` γ, β ×c when the head is
    tied."""

    name = "hf_gpt2"
    default_alpha_original = 0.25
    models = "transformers GPT2LMHeadModel (tied or untied lm_head), GPT2Model, GPT2ForSequenceClassification"
    KEYS = ("n_embd", "n_head", "n_inner", "n_layer")

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        try:
            from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model
        except ImportError:  # pragma: no cover
            return False
        return type(model) in (GPT2LMHeadModel, GPT2Model, GPT2ForSequenceClassification)

    def sizes(self, model: nn.Module) -> ArchSizes:
        c = model.config
        if getattr(c, "add_cross_attention", False):
            raise ValueError("hf_gpt2: add_cross_attention=True is not supported by the V-cycle maps")
        return ArchSizes(int(c.n_embd), int(c.n_head), int(c.n_inner or 4 * c.n_embd), int(c.n_layer), self.KEYS)

    @staticmethod
    def _prefix(model: nn.Module) -> str:
        return "transformer." if hasattr(model, "transformer") else ""

    def layer_prefix(self, model: nn.Module) -> str:
        return self._prefix(model) + "h."

    def param_table(self, model: nn.Module, ctx: TableContext) -> tuple[dict[str, ParamSpec], dict[str, ParamSpec]]:
        p = self._prefix(model)
        head_tied = ctx.tied("lm_head.weight")
        ln_f_scale = ctx.exact_scale if head_tied else 1.0
        glob = {
            f"{p}wte.weight": vector("E", 1, ctx.embedding_scale),
            f"{p}wpe.weight": vector("E", 1, ctx.embedding_scale),
            f"{p}ln_f.weight": vector("E", 0, ln_f_scale),
            f"{p}ln_f.bias": vector("E", 0, ln_f_scale),
            "lm_head.weight": input_only("E"),
            "score.weight": input_only("E"),
        }
        block = {
            "ln_1.weight": vector("E"),
            "ln_1.bias": vector("E"),
            "attn.c_attn.weight": conv1d("QKV", "E"),
            "attn.c_attn.bias": vector("QKV"),
            "attn.c_proj.weight": conv1d("E", "V"),
            "attn.c_proj.bias": vector("E"),
            "ln_2.weight": vector("E"),
            "ln_2.bias": vector("E"),
            "mlp.c_fc.weight": conv1d("I", "E"),
            "mlp.c_fc.bias": vector("I"),
            "mlp.c_proj.weight": conv1d("E", "I"),
            "mlp.c_proj.bias": vector("E"),
        }
        return glob, block

    def build_small(self, model: nn.Module, plan: VCyclePlan) -> nn.Module:
        return self._finish(model, hf_build_small(model, plan, self.KEYS), plan)
