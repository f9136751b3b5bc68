"""Per-architecture knowledge, one file per model family: what random-LTD needs (layer lists, sequence tensors,
masks; :class:`TransformerAdapter`) and what the V-cycle needs (parameter maps, building the small model;
:class:`VCycleAdapter`).

Families: HF GPT-2 (``gpt2``), HF BERT (``bert``), timm ViT / DeiT (``vit``); any other transformer through
:class:`GenericAdapter` (random-LTD, config only) or a registered adapter subclass.
"""

from lightning_effi.models.base import (
    MUST_BE_NONE,
    PASS,
    SeqArg,
    TransformerAdapter,
    find_adapter,
    register_adapter,
    registered_adapters,
)
from lightning_effi.models.bert import HFBertAdapter
from lightning_effi.models.generic import GenericAdapter
from lightning_effi.models.gpt2 import HFGPT2Adapter
from lightning_effi.models.vcycle_base import (
    HFBertVCycleAdapter,
    HFGPT2VCycleAdapter,
    TimmViTVCycleAdapter,
    VCycleAdapter,
    find_vcycle_adapter,
    register_vcycle_adapter,
    registered_vcycle_adapters,
)
from lightning_effi.models.vit import TimmViTAdapter

__all__ = [
    "MUST_BE_NONE", "PASS", "GenericAdapter", "HFBertAdapter", "HFBertVCycleAdapter", "HFGPT2Adapter",
    "HFGPT2VCycleAdapter", "SeqArg", "TimmViTAdapter", "TimmViTVCycleAdapter", "TransformerAdapter", "VCycleAdapter",
    "find_adapter", "find_vcycle_adapter", "register_adapter", "register_vcycle_adapter", "registered_adapters",
    "registered_vcycle_adapters",
]
