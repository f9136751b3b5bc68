"""timm Vision Transformers (``timm.models.vision_transformer.VisionTransformer``: ViT, DeiT, ...)."""

from __future__ import annotations

from torch import nn

from lightning_effi.models.base import PASS, ArgSpec, SeqArg, TransformerAdapter, register_adapter


@register_adapter("timm_vit")
class TimmViTAdapter(TransformerAdapter):
    """Layers ``blocks`` (``Block``, called as ``blocks(x)``; ``Block.forward(x, attn_mask=None, is_causal=False)``).
    No mask by default (an ``attn_mask`` keyword is gathered on both axes). Sequence length = patches + prefix tokens
    (class, distillation and register tokens: ``model.num_prefix_tokens``)."""

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        from timm.models.vision_transformer import VisionTransformer

        return isinstance(module, VisionTransformer)

    def layers(self) -> nn.Sequential:
        return self.root.blocks

    @property
    def layer_arguments(self) -> dict[str, ArgSpec]:
        return {"attn_mask": SeqArg((-2, -1)), "is_causal": PASS}

    def max_sequence_length(self) -> int:
        return int(self.root.patch_embed.num_patches) + self.num_prefix_tokens()

    def num_prefix_tokens(self) -> int:
        return int(getattr(self.root, "num_prefix_tokens", 0))

    def hidden_size(self) -> int:
        return int(self.root.embed_dim)

    def intermediate_size(self) -> int:
        fc1 = getattr(getattr(self.root.blocks[0], "mlp", None), "fc1", None)
        return int(fc1.out_features) if isinstance(fc1, nn.Linear) else 4 * self.hidden_size()
