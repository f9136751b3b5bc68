"""Per-architecture V-cycle maps: which parameter gets which width map, how the small model is built
(spec ``shared/specs/vcycle.md`` §3; official ``map_tools/mapper.py``).

An adapter turns a live large model into a :class:`~lightning_effi.vcycle.operators.VCyclePlan` (one level: width
and depth halving) and builds the small model from the large model's own configuration::

    from lightning_effi.models.vcycle_base import find_vcycle_adapter
    from lightning_effi.functional import vcycle

    adapter = find_vcycle_adapter(model)                    # GPT2LMHeadModel, Bert*, timm VisionTransformer
    plan = adapter.plan(model, width_scheme="half", depth_scheme="adjacent", embedding_convention="official")
    small = adapter.build_small(model, plan)
    small.load_state_dict(vcycle.coalesce(model, plan))     # strict; in-place copies keep HF ties

Registered: ``hf_gpt2`` (:class:`HFGPT2VCycleAdapter`), ``hf_bert`` (:class:`HFBertVCycleAdapter`), ``timm_vit``
(:class:`TimmViTVCycleAdapter`). To support another architecture, subclass :class:`VCycleAdapter`, implement
:meth:`~VCycleAdapter.matches`, :meth:`~VCycleAdapter.sizes`, :meth:`~VCycleAdapter.param_table` and
:meth:`~VCycleAdapter.build_small`, and decorate it with :func:`register_vcycle_adapter`.

Parameter tables use the map names ``E`` (hidden), ``QK``, ``V`` (attention outputs), ``QKV`` (fused ``[Q; K; V]``)
and ``I`` (FFN intermediate); every state-dict entry must be covered (strict, spec V9/V13): parameters outside the
table (e.g. timm ``attn.gate``, ``attn.norm``, ``mlp.norm``, a MAP pooling head, GPT-2 cross-attention) raise a
``ValueError`` listing them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, NamedTuple

from torch import nn

from lightning_effi.vcycle.operators import (
    EMBEDDING_CONVENTIONS,
    DepthScheme,
    TensorRule,
    TransformerWidthMaps,
    VCyclePlan,
    WidthScheme,
    _storage_key,
    convention_scale,
    depth_groups,
    layer_key,
    transformer_width_maps,
)

__all__ = [
    "ArchSizes", "HFBertVCycleAdapter", "HFGPT2VCycleAdapter", "ParamSpec", "TimmViTVCycleAdapter", "VCycleAdapter",
    "find_vcycle_adapter", "register_vcycle_adapter", "registered_vcycle_adapters",
]


class ParamSpec(NamedTuple):
    """One row of a parameter table: ``axes`` = ``(dim, map name, side)`` per mapped axis, ``scale`` (power of two)."""

    axes: tuple[tuple[int, str, str], ...] = ()
    scale: float = 1.0


def linear(out: str, inp: str, scale: float = 1.0) -> ParamSpec:
    """``nn.Linear.weight`` (out × in)."""
    return ParamSpec(((0, out, "out"), (1, inp, "in")), scale)


def conv1d(out: str, inp: str) -> ParamSpec:
    """HF ``Conv1D.weight`` (in × out: the Linear rule transposed)."""
    return ParamSpec(((0, inp, "in"), (1, out, "out")))


def vector(m: str, dim: int = 0, scale: float = 1.0) -> ParamSpec:
    """Bias, LayerNorm γ/β, LayerScale γ, embedding table / token parameter on axis ``dim``: output rule."""
    return ParamSpec(((dim, m, "out"),), scale)


def input_only(m: str = "E") -> ParamSpec:
    """A head whose input is the hidden state (classifier, untied LM head): input rule on axis 1."""
    return ParamSpec(((1, m, "in"),))


COPY = ParamSpec()


@dataclass(frozen=True)
class ArchSizes:
    """Sizes of a transformer and the configuration keys that hold them (named in error messages)."""

    hidden: int
    heads: int
    ffn: int
    layers: int
    keys: tuple[str, str, str, str]  # hidden, heads, ffn, layers


@dataclass(frozen=True)
class TableContext:
    """What a parameter table may depend on: the level's maps, the tie structure and the convention scales."""

    maps: TransformerWidthMaps
    convention: str
    aliases: Mapping[str, str]
    #: scale of embedding tables under ``official`` (``c``; 1 under ``exact`` or for depth-only levels)
    embedding_scale: float
    #: ``c`` under ``exact``: applied by adapters to the LayerNorm feeding a tied output head
    exact_scale: float

    def tied(self, key: str) -> bool:
        return key in self.aliases


class VCycleAdapter:
    """Base class of V-cycle adapters (one architecture family each). Subclasses set :attr:`name`,
    :attr:`default_alpha_original` and :attr:`models`, and implement the four methods below."""

    name: ClassVar[str] = ""
    #: spec §2.6 / §4.3 defaults: BERT 0.5, GPT-2 and ViT/DeiT 0.25
    default_alpha_original: ClassVar[float] = 0.25
    #: human-readable list of supported model classes (for error messages)
    models: ClassVar[str] = ""

    @classmethod
    def matches(cls, model: nn.Module) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def sizes(self, model: nn.Module) -> ArchSizes:  # pragma: no cover - abstract
        raise NotImplementedError

    def layer_prefix(self, model: nn.Module) -> str:  # pragma: no cover - abstract
        """State-dict prefix of the block list, ending in ``.`` (``"transformer.h."``)."""
        raise NotImplementedError

    def param_table(self, model: nn.Module, ctx: TableContext) -> tuple[dict[str, ParamSpec], dict[str, ParamSpec]]:
        """``(global table keyed by full state-dict key, per-block table keyed by the key after
        "<layer_prefix><i>.")``. Keys absent from the model are ignored; model keys absent from both raise."""
        raise NotImplementedError  # pragma: no cover - abstract

    def build_small(self, model: nn.Module, plan: VCyclePlan) -> nn.Module:  # pragma: no cover - abstract
        """A freshly initialised model with the plan's small shapes, same dtype, device and train/eval mode."""
        raise NotImplementedError

    # -- concrete ----------------------------------------------------------------------------------------------------

    def plan(self, model: nn.Module, width_scheme: WidthScheme | None = "half",
             depth_scheme: DepthScheme | None = "adjacent", embedding_convention: str = "official") -> VCyclePlan:
        """The plan of one level for ``model`` (spec §2.2-§2.5, §3).

        Args:
            width_scheme: ``"half"``, explicit head groups (a partition of the heads; groups of 3 allowed), or
                ``None`` (width unchanged). depth_scheme: ``"adjacent"``, ``"half"``, explicit layer groups or ``None``
                (depth unchanged). embedding_convention: ``"official"`` (embedding tables ×2 on coalesce / ×½ on
                de-coalesce) or ``"exact"`` (no embedding scaling; the LayerNorm feeding a tied output head ×2 / ×½).

        Raises:
            ValueError: unknown convention; sizes that cannot be halved by the scheme (naming the config key, e.g.
                ``n_head``); odd depth with a default depth scheme (naming e.g. ``n_layer``); groups that are not a
                partition; parameters the adapter does not map (listed).
        """
        if embedding_convention not in EMBEDDING_CONVENTIONS:
            raise ValueError(f"embedding_convention must be one of {EMBEDDING_CONVENTIONS}, got "
                             f"{embedding_convention!r}")
        s = self.sizes(model)
        kh, kn, kf, kl = s.keys
        maps = transformer_width_maps(s.hidden, s.heads, s.ffn, width_scheme, names=(kh, kn, kf))
        depth = None if depth_scheme is None else depth_groups(s.layers, depth_scheme, name=kl)
        sd = model.state_dict()
        named = {k for k, _ in model.named_parameters()} | {k for k, _ in model.named_buffers()}
        by_storage: dict[tuple, list[str]] = {}
        for k, t in sd.items():
            by_storage.setdefault(_storage_key(t), []).append(k)
        aliases: dict[str, str] = {}
        for keys in by_storage.values():
            if len(keys) > 1:
                canon = next((k for k in keys if k in named), keys[0])
                aliases.update({k: canon for k in keys if k != canon})
        c = convention_scale(maps.hidden)
        ctx = TableContext(maps, embedding_convention, aliases,
                           embedding_scale=c if embedding_convention == "official" else 1.0,
                           exact_scale=c if embedding_convention == "exact" else 1.0)
        global_table, block_table = self.param_table(model, ctx)
        named_maps = {"E": maps.hidden, "QK": maps.qk, "V": maps.v, "QKV": maps.qkv, "I": maps.ffn}
        prefix = self.layer_prefix(model)
        rules: dict[str, TensorRule] = {}
        unmapped: list[str] = []
        for k in sd:
            if k in aliases:
                continue
            lk = layer_key(k, prefix)
            if lk is not None:
                spec = block_table.get(k[len(prefix) + len(str(lk[0])) + 1:])
            else:
                spec = global_table.get(k)
            if spec is None:
                unmapped.append(k)
                continue
            axes = tuple((d, named_maps[m], side) for d, m, side in spec.axes)
            rules[k] = TensorRule(axes, spec.scale, *(lk if lk is not None else (None, "")))
        if unmapped:
            raise ValueError(f"{self.name}: the V-cycle adapter does not map {len(unmapped)} parameter(s) of "
                             f"{type(model).__name__}: {unmapped}; these options are unsupported (spec V13) — "
                             "subclass the adapter to map them")
        info = {"adapter": self.name, "model": type(model).__name__, "width_scheme": width_scheme,
                "depth_scheme": depth_scheme, "embedding_convention": embedding_convention,
                "large": {"hidden": s.hidden, "heads": s.heads, "ffn": s.ffn, "layers": s.layers},
                "small": {"hidden": maps.hidden.small, "heads": maps.small_heads, "ffn": maps.ffn.small,
                          "layers": len(depth) if depth is not None else s.layers}}
        return VCyclePlan.create({k: tuple(t.shape) for k, t in sd.items()}, rules, aliases, depth, info)

    @staticmethod
    def _finish(model: nn.Module, small: nn.Module, plan: VCyclePlan) -> nn.Module:
        p = next(model.parameters(), None)
        if p is not None:
            small = small.to(device=p.device, dtype=p.dtype)
        small.train(model.training)
        got = {k: tuple(t.shape) for k, t in small.state_dict().items()}
        if got != dict(plan.small_shapes):
            diff = sorted(set(got.items()) ^ set(plan.small_shapes.items()))
            raise RuntimeError(f"build_small: the rebuilt {type(small).__name__} does not match the plan's small "
                               f"shapes; differing (key, shape) entries: {diff[:20]}")
        return small

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_REGISTRY: dict[str, type[VCycleAdapter]] = {}


def register_vcycle_adapter(cls: type[VCycleAdapter]) -> type[VCycleAdapter]:
    """Class decorator: register a :class:`VCycleAdapter` under ``cls.name`` (tried by :func:`find_vcycle_adapter`).

    Raises:
        ValueError: empty name, or the name is registered to another class.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__}: set the class attribute `name` before registering")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"V-cycle adapter {cls.name!r} is already registered ({_REGISTRY[cls.name]!r})")
    _REGISTRY[cls.name] = cls
    return cls


def registered_vcycle_adapters() -> list[str]:
    return sorted(_REGISTRY)


def _supported() -> str:
    return "; ".join(f"{n} ({_REGISTRY[n].models})" for n in registered_vcycle_adapters())


def find_vcycle_adapter(model: nn.Module, adapter: str | VCycleAdapter = "auto") -> VCycleAdapter:
    """The V-cycle adapter for ``model`` (the model root whose state dict is mapped, e.g. ``pl_module.model``).

    Args:
        adapter: ``"auto"`` (the first registered adapter whose :meth:`~VCycleAdapter.matches` accepts ``model``),
            a registered name, or an adapter instance (returned as is).

    Raises:
        ValueError: unknown name, or no adapter matches (the message names the supported architectures and, when a
            submodule would match, the attribute to pass instead).
    """
    if isinstance(adapter, VCycleAdapter):
        return adapter
    if adapter != "auto":
        if adapter not in _REGISTRY:
            raise ValueError(f"adapter: unknown V-cycle adapter {adapter!r}; registered: {_supported()}")
        if not _REGISTRY[adapter].matches(model):
            raise ValueError(f"adapter: {adapter!r} does not handle {type(model).__name__} "
                             f"(supports {_REGISTRY[adapter].models})")
        return _REGISTRY[adapter]()
    for cls in _REGISTRY.values():
        if cls.matches(model):
            return cls()
    hint = ""
    for name, sub in model.named_modules():
        if name and any(cls.matches(sub) for cls in _REGISTRY.values()):
            hint = f" Its submodule {name!r} ({type(sub).__name__}) is supported: pass that module instead."
            break
    raise ValueError(f"no V-cycle adapter for {type(model).__name__}; supported architectures: {_supported()}."
                     f"{hint} Other architectures: subclass lightning_effi.models.vcycle_base.VCycleAdapter and "
                     "register it with register_vcycle_adapter.")


def _hf_small_config(model: nn.Module, plan: VCyclePlan, keys: tuple[str, str, str, str]) -> Any:
    small = plan.info["small"]
    cfg = copy.deepcopy(model.config)
    kh, kn, kf, kl = keys
    setattr(cfg, kh, small["hidden"])
    setattr(cfg, kn, small["heads"])
    setattr(cfg, kl, small["layers"])
    if kf == "n_inner" and cfg.n_inner is None and small["ffn"] == 4 * small["hidden"]:
        pass  # None means 4 × n_embd, still true for the small model
    else:
        setattr(cfg, kf, small["ffn"])
    return cfg


def _hf_build(model: nn.Module, plan: VCyclePlan, keys: tuple[str, str, str, str]) -> nn.Module:
    small = type(model)(_hf_small_config(model, plan, keys))
    small.tie_weights()
    return small


# ---------------------------------------------------------------------------------------------------------------------
# HF GPT-2 (spec §3.2)


@register_vcycle_adapter
class HFGPT2VCycleAdapter(VCycleAdapter):
    """HF GPT-2 (spec §3.2): ``Conv1D`` weights (in × out), fused ``c_attn`` = ``[Q; K; V]``, ``lm_head`` tied to
    ``wte`` (alias) or untied (Linear input rule). ``exact`` convention: ``ln_f`` γ, β ×c when the head is tied."""

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
            "ln_1.weight": vector("E"), "ln_1.bias": vector("E"),
            "attn.c_attn.weight": conv1d("QKV", "E"), "attn.c_attn.bias": vector("QKV"),
            "attn.c_proj.weight": conv1d("E", "V"), "attn.c_proj.bias": vector("E"),
            "ln_2.weight": vector("E"), "ln_2.bias": vector("E"),
            "mlp.c_fc.weight": conv1d("I", "E"), "mlp.c_fc.bias": vector("I"),
            "mlp.c_proj.weight": conv1d("E", "I"), "mlp.c_proj.bias": vector("E"),
        }
        return glob, block

    def build_small(self, model: nn.Module, plan: VCyclePlan) -> nn.Module:
        return self._finish(model, _hf_build(model, plan, self.KEYS), plan)


# ---------------------------------------------------------------------------------------------------------------------
# HF BERT (spec §3.1)


@register_vcycle_adapter
class HFBertVCycleAdapter(VCycleAdapter):
    """HF BERT (spec §3.1): ``BertForMaskedLM`` (decoder tied to the word embeddings, decoder bias = prediction
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
        return ArchSizes(int(c.hidden_size), int(c.num_attention_heads), int(c.intermediate_size),
                         int(c.num_hidden_layers), self.KEYS)

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
            f"{p}embeddings.LayerNorm.weight": vector("E"), f"{p}embeddings.LayerNorm.bias": vector("E"),
            f"{p}pooler.dense.weight": linear("E", "E"), f"{p}pooler.dense.bias": vector("E"),
            "cls.predictions.transform.dense.weight": linear("E", "E"),
            "cls.predictions.transform.dense.bias": vector("E"),
            "cls.predictions.transform.LayerNorm.weight": vector("E", 0, head_scale),
            "cls.predictions.transform.LayerNorm.bias": vector("E", 0, head_scale),
            "cls.predictions.decoder.weight": input_only("E"),
            "cls.predictions.decoder.bias": COPY, "cls.predictions.bias": COPY,
            "cls.seq_relationship.weight": input_only("E"), "cls.seq_relationship.bias": COPY,
            "classifier.weight": input_only("E"), "classifier.bias": COPY,
        }
        block = {
            "attention.self.query.weight": linear("QK", "E"), "attention.self.query.bias": vector("QK"),
            "attention.self.key.weight": linear("QK", "E"), "attention.self.key.bias": vector("QK"),
            "attention.self.value.weight": linear("V", "E"), "attention.self.value.bias": vector("V"),
            "attention.output.dense.weight": linear("E", "V"), "attention.output.dense.bias": vector("E"),
            "attention.output.LayerNorm.weight": vector("E"), "attention.output.LayerNorm.bias": vector("E"),
            "intermediate.dense.weight": linear("I", "E"), "intermediate.dense.bias": vector("I"),
            "output.dense.weight": linear("E", "I"), "output.dense.bias": vector("E"),
            "output.LayerNorm.weight": vector("E"), "output.LayerNorm.bias": vector("E"),
        }
        return glob, block

    def build_small(self, model: nn.Module, plan: VCyclePlan) -> nn.Module:
        return self._finish(model, _hf_build(model, plan, self.KEYS), plan)


# ---------------------------------------------------------------------------------------------------------------------
# timm ViT / DeiT (spec §3.3)


def _is_identity(m: Any) -> bool:
    return m is None or isinstance(m, nn.Identity)


@register_vcycle_adapter
class TimmViTVCycleAdapter(VCycleAdapter):
    """timm ``VisionTransformer`` / ``VisionTransformerDistilled`` (spec §3.3): ``patch_embed.proj`` (Conv2d, output
    map on dim 0), ``cls_token``/``dist_token``/``reg_token``/``pos_embed`` on their last dim (no scaling; the
    embedding convention does not apply), fused ``attn.qkv``, LayerScale, ``q_norm``/``k_norm`` copied (head dim is
    kept), ``norm``/``fc_norm``/``norm_pre``, ``head``/``head_dist`` by the input rule. Rejected (listed):
    ``attn.gate``, ``attn.norm``, ``mlp.norm``, MAP pooling (``attn_pool``); gated MLPs (SwiGLU/GluMlp) raise."""

    name = "timm_vit"
    default_alpha_original = 0.25
    models = "timm VisionTransformer (ViT, DeiT) and VisionTransformerDistilled (distilled DeiT)"
    KEYS = ("embed_dim", "num_heads", "mlp_ratio", "depth")

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        try:
            from timm.models.vision_transformer import VisionTransformer
        except ImportError:  # pragma: no cover
            return False
        return isinstance(model, VisionTransformer)

    def sizes(self, model: nn.Module) -> ArchSizes:
        from timm.layers import Mlp

        blocks = list(model.blocks)
        if not blocks:
            raise ValueError("timm_vit: the model has no blocks (depth=0)")
        b0 = blocks[0]
        if type(getattr(b0, "mlp", None)) is not Mlp:
            raise ValueError(f"timm_vit: mlp_layer {type(getattr(b0, 'mlp', None)).__name__} is not supported by the "
                             "V-cycle maps (only timm.layers.Mlp; gated FFNs such as SwiGLU/GluMlp need their own "
                             "adapter, spec V1)")
        heads = int(b0.attn.num_heads)
        ffn = int(b0.mlp.fc1.out_features)
        for i, b in enumerate(blocks):
            if int(b.attn.num_heads) != heads or int(b.mlp.fc1.out_features) != ffn:
                raise ValueError(f"timm_vit: block {i} has a different num_heads or MLP width than block 0")
        return ArchSizes(int(model.embed_dim), heads, ffn, len(blocks), self.KEYS)

    def layer_prefix(self, model: nn.Module) -> str:
        return "blocks."

    def param_table(self, model: nn.Module, ctx: TableContext) -> tuple[dict[str, ParamSpec], dict[str, ParamSpec]]:
        glob = {
            "cls_token": vector("E", -1), "dist_token": vector("E", -1), "reg_token": vector("E", -1),
            "pos_embed": vector("E", -1),
            "patch_embed.proj.weight": vector("E", 0), "patch_embed.proj.bias": vector("E"),
            "patch_embed.norm.weight": vector("E"), "patch_embed.norm.bias": vector("E"),
            "norm_pre.weight": vector("E"), "norm_pre.bias": vector("E"),
            "norm.weight": vector("E"), "norm.bias": vector("E"),
            "fc_norm.weight": vector("E"), "fc_norm.bias": vector("E"),
            "head.weight": input_only("E"), "head.bias": COPY,
            "head_dist.weight": input_only("E"), "head_dist.bias": COPY,
        }
        block = {
            "norm1.weight": vector("E"), "norm1.bias": vector("E"),
            "attn.qkv.weight": linear("QKV", "E"), "attn.qkv.bias": vector("QKV"),
            "attn.q_norm.weight": COPY, "attn.q_norm.bias": COPY,
            "attn.k_norm.weight": COPY, "attn.k_norm.bias": COPY,
            "attn.proj.weight": linear("E", "V"), "attn.proj.bias": vector("E"),
            "ls1.gamma": vector("E"), "ls2.gamma": vector("E"),
            "norm2.weight": vector("E"), "norm2.bias": vector("E"),
            "mlp.fc1.weight": linear("I", "E"), "mlp.fc1.bias": vector("I"),
            "mlp.fc2.weight": linear("E", "I"), "mlp.fc2.bias": vector("E"),
        }
        return glob, block

    def create_kwargs(self, model: nn.Module, plan: VCyclePlan) -> dict[str, Any]:
        """The ``VisionTransformer`` constructor arguments of the small model, read from the live large model (timm
        does not keep its create kwargs): halved ``embed_dim``, ``num_heads``, ``depth``; same patch size, image size,
        ``mlp_ratio``, classes, pooling, biases, norms (type and eps), activation, dropout rates and block types."""
        small = plan.info["small"]
        b0 = model.blocks[0]
        norm = b0.norm1
        kw: dict[str, Any] = dict(
            img_size=model.patch_embed.img_size, patch_size=model.patch_embed.patch_size,
            in_chans=model.patch_embed.proj.in_channels, num_classes=model.num_classes,
            global_pool=model.global_pool, embed_dim=small["hidden"], depth=small["layers"],
            num_heads=small["heads"], mlp_ratio=small["ffn"] / small["hidden"],
            qkv_bias=b0.attn.qkv.bias is not None, qk_norm=not _is_identity(getattr(b0.attn, "q_norm", None)),
            proj_bias=b0.attn.proj.bias is not None,
            init_values=1e-5 if not _is_identity(getattr(b0, "ls1", None)) else None,
            class_token=bool(model.has_class_token), no_embed_class=bool(model.no_embed_class),
            reg_tokens=int(model.num_reg_tokens), pos_embed="learn" if model.pos_embed is not None else "none",
            pre_norm=not _is_identity(model.norm_pre),
            final_norm=not (_is_identity(model.norm) and _is_identity(model.fc_norm)),
            fc_norm=not _is_identity(model.fc_norm), pool_include_prefix=bool(model.pool_include_prefix),
            dynamic_img_size=bool(model.dynamic_img_size),
            drop_rate=float(getattr(model.head_drop, "p", 0.0)), pos_drop_rate=float(getattr(model.pos_drop, "p", 0.0)),
            patch_drop_rate=float(getattr(model.patch_drop, "prob", 0.0)),
            proj_drop_rate=float(getattr(b0.attn.proj_drop, "p", 0.0)),
            attn_drop_rate=float(getattr(b0.attn.attn_drop, "p", 0.0)),
            drop_path_rate=float(getattr(model.blocks[-1].drop_path1, "drop_prob", 0.0)),
            norm_layer=partial(type(norm), eps=norm.eps) if hasattr(norm, "eps") else type(norm),
            act_layer=(partial(nn.GELU, approximate=b0.mlp.act.approximate) if type(b0.mlp.act) is nn.GELU
                       else type(b0.mlp.act)),
            block_fn=type(b0), mlp_layer=type(b0.mlp), attn_layer=type(b0.attn),
        )
        pn = getattr(model.patch_embed, "norm", None)
        if not _is_identity(pn):
            kw["embed_norm_layer"] = partial(type(pn), eps=pn.eps) if hasattr(pn, "eps") else type(pn)
        return kw

    def build_small(self, model: nn.Module, plan: VCyclePlan, **overrides: Any) -> nn.Module:
        """``type(model)(**create_kwargs(model, plan), **overrides)``; raises ``RuntimeError`` if the result's shapes
        differ from the plan (then pass the missing constructor arguments as ``overrides``)."""
        return self._finish(model, type(model)(**{**self.create_kwargs(model, plan), **overrides}), plan)
