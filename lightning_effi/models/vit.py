"""timm Vision Transformers (``timm.models.vision_transformer.VisionTransformer``: ViT, DeiT, ...): the random-LTD
adapter (:class:`TimmViTAdapter`) and the V-cycle parameter map (:class:`TimmViTVCycleAdapter`), both registered as
the family ``timm_vit``. The method cards are ``lightning_effi/random_ltd/README.md`` and
``lightning_effi/vcycle/README.md``."""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from lightning_effi.models.base import PASS, ArgSpec, SeqArg, TransformerAdapter, register_adapter
from lightning_effi.models.vcycle_base import (
    COPY,
    ArchSizes,
    ParamSpec,
    TableContext,
    VCycleAdapter,
    input_only,
    linear,
    register_vcycle_adapter,
    vector,
)
from lightning_effi.vcycle.operators import VCyclePlan


@register_adapter("timm_vit")
class TimmViTAdapter(TransformerAdapter):
    """Layers ``blocks`` (``Block``, called as ``blocks(x)``; ``Block.forward(x, attn_mask=None, is_causal=False)``).
    No mask by default (an ``attn_mask`` keyword is gathered on both axes). Sequence length = patches + prefix tokens
    (class, distillation and register tokens: ``model.num_prefix_tokens``).

    Raises:
        ValueError: (construction) ``root`` is not a timm ``VisionTransformer`` (naming the adapter, what it expects,
            the model given and a ``VisionTransformer`` inside it if there is one)."""

    expects = "a timm VisionTransformer with .blocks (ViT, DeiT)"

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        from timm.models.vision_transformer import VisionTransformer

        return isinstance(module, VisionTransformer)

    def layers(self) -> nn.Sequential:
        return self.root.blocks

    @property
    def layer_arguments(self) -> dict[str, ArgSpec]:
        return {"attn_mask": SeqArg((-2, -1)), "is_causal": PASS}

    def max_sequence_length(self) -> int | None:
        """Patch tokens plus prefix tokens at the model's image size; None with ``dynamic_img_size=True`` (any image
        size: the length is the one random-LTD sees at the first batch)."""
        if getattr(self.root, "dynamic_img_size", False):
            return None
        return int(self.root.patch_embed.num_patches) + self.num_prefix_tokens()

    def num_prefix_tokens(self) -> int:
        return int(getattr(self.root, "num_prefix_tokens", 0))

    def sequence_length(self, batch: Any) -> int | None:
        """Every batch of a ViT of fixed image size has :meth:`max_sequence_length` tokens (patches + prefix);
        ``None`` with ``dynamic_img_size=True``."""
        return self.max_sequence_length()

    def hidden_size(self) -> int:
        return int(self.root.embed_dim)

    def intermediate_size(self) -> int:
        fc1 = getattr(getattr(self.root.blocks[0], "mlp", None), "fc1", None)
        return int(fc1.out_features) if isinstance(fc1, nn.Linear) else 4 * self.hidden_size()


def _is_identity(m: Any) -> bool:
    return m is None or isinstance(m, nn.Identity)


@register_vcycle_adapter
class TimmViTVCycleAdapter(VCycleAdapter):
    """V-cycle map of timm ``VisionTransformer`` / ``VisionTransformerDistilled``: ``patch_embed.proj`` (Conv2d,
    output map on dim 0), ``cls_token``/``dist_token``/``reg_token``/``pos_embed`` on their last dim (no scaling; the
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
            raise ValueError(
                f"timm_vit: mlp_layer {type(getattr(b0, 'mlp', None)).__name__} is not supported by the "
                "V-cycle maps (only timm.layers.Mlp; gated FFNs such as SwiGLU/GluMlp need their own "
                "adapter)"
            )
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
            "cls_token": vector("E", -1),
            "dist_token": vector("E", -1),
            "reg_token": vector("E", -1),
            "pos_embed": vector("E", -1),
            "patch_embed.proj.weight": vector("E", 0),
            "patch_embed.proj.bias": vector("E"),
            "patch_embed.norm.weight": vector("E"),
            "patch_embed.norm.bias": vector("E"),
            "norm_pre.weight": vector("E"),
            "norm_pre.bias": vector("E"),
            "norm.weight": vector("E"),
            "norm.bias": vector("E"),
            "fc_norm.weight": vector("E"),
            "fc_norm.bias": vector("E"),
            "head.weight": input_only("E"),
            "head.bias": COPY,
            "head_dist.weight": input_only("E"),
            "head_dist.bias": COPY,
        }
        block = {
            "norm1.weight": vector("E"),
            "norm1.bias": vector("E"),
            "attn.qkv.weight": linear("QKV", "E"),
            "attn.qkv.bias": vector("QKV"),
            "attn.q_norm.weight": COPY,
            "attn.q_norm.bias": COPY,
            "attn.k_norm.weight": COPY,
            "attn.k_norm.bias": COPY,
            "attn.proj.weight": linear("E", "V"),
            "attn.proj.bias": vector("E"),
            "ls1.gamma": vector("E"),
            "ls2.gamma": vector("E"),
            "norm2.weight": vector("E"),
            "norm2.bias": vector("E"),
            "mlp.fc1.weight": linear("I", "E"),
            "mlp.fc1.bias": vector("I"),
            "mlp.fc2.weight": linear("E", "I"),
            "mlp.fc2.bias": vector("E"),
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
            img_size=model.patch_embed.img_size,
            patch_size=model.patch_embed.patch_size,
            in_chans=model.patch_embed.proj.in_channels,
            num_classes=model.num_classes,
            global_pool=model.global_pool,
            embed_dim=small["hidden"],
            depth=small["layers"],
            num_heads=small["heads"],
            mlp_ratio=small["ffn"] / small["hidden"],
            qkv_bias=b0.attn.qkv.bias is not None,
            qk_norm=not _is_identity(getattr(b0.attn, "q_norm", None)),
            proj_bias=b0.attn.proj.bias is not None,
            init_values=1e-5 if not _is_identity(getattr(b0, "ls1", None)) else None,
            class_token=bool(model.has_class_token),
            no_embed_class=bool(model.no_embed_class),
            reg_tokens=int(model.num_reg_tokens),
            pos_embed="learn" if model.pos_embed is not None else "none",
            pre_norm=not _is_identity(model.norm_pre),
            final_norm=not (_is_identity(model.norm) and _is_identity(model.fc_norm)),
            fc_norm=not _is_identity(model.fc_norm),
            pool_include_prefix=bool(model.pool_include_prefix),
            dynamic_img_size=bool(model.dynamic_img_size),
            # padding of sides that are no multiple of the patch: the coarse ViT refused the full one's inputs
            # (qa114-dense 01)
            dynamic_img_pad=bool(getattr(model.patch_embed, "dynamic_img_pad", False)),
            drop_rate=float(getattr(model.head_drop, "p", 0.0)),
            pos_drop_rate=float(getattr(model.pos_drop, "p", 0.0)),
            patch_drop_rate=float(getattr(model.patch_drop, "prob", 0.0)),
            proj_drop_rate=float(getattr(b0.attn.proj_drop, "p", 0.0)),
            attn_drop_rate=float(getattr(b0.attn.attn_drop, "p", 0.0)),
            drop_path_rate=float(getattr(model.blocks[-1].drop_path1, "drop_prob", 0.0)),
            norm_layer=partial(type(norm), eps=norm.eps) if hasattr(norm, "eps") else type(norm),
            act_layer=(
                partial(nn.GELU, approximate=b0.mlp.act.approximate)
                if type(b0.mlp.act) is nn.GELU
                else type(b0.mlp.act)
            ),
            block_fn=type(b0),
            mlp_layer=type(b0.mlp),
            attn_layer=type(b0.attn),
        )
        pn = getattr(model.patch_embed, "norm", None)
        if not _is_identity(pn):
            kw["embed_norm_layer"] = partial(type(pn), eps=pn.eps) if hasattr(pn, "eps") else type(pn)
        return kw

    def build_small(self, model: nn.Module, plan: VCyclePlan, **overrides: Any) -> nn.Module:
        """``type(model)(**create_kwargs(model, plan), **overrides)``; raises ``RuntimeError`` if the result's shapes
        differ from the plan (then pass the missing constructor arguments as ``overrides``)."""
        return self._finish(model, type(model)(**{**self.create_kwargs(model, plan), **overrides}), plan)
