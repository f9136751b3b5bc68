"""Model adapters: per-architecture knowledge the techniques need (layer lists, sequence tensors, sizes).

Registered: ``hf_gpt2`` (HF GPT-2), ``hf_bert`` (HF BERT), ``timm_vit`` (timm ViT/DeiT); any other transformer
through :class:`GenericAdapter` (config only) or a registered :class:`TransformerAdapter` subclass.
"""

from lightning_effi.adapters.base import (
    MUST_BE_NONE,
    PASS,
    SeqArg,
    TransformerAdapter,
    find_adapter,
    register_adapter,
    registered_adapters,
)
from lightning_effi.adapters.generic import GenericAdapter
from lightning_effi.adapters.hf_bert import HFBertAdapter
from lightning_effi.adapters.hf_gpt2 import HFGPT2Adapter
from lightning_effi.adapters.timm_vit import TimmViTAdapter

__all__ = [
    "MUST_BE_NONE", "PASS", "GenericAdapter", "HFBertAdapter", "HFGPT2Adapter", "SeqArg", "TimmViTAdapter",
    "TransformerAdapter", "find_adapter", "register_adapter", "registered_adapters",
]
