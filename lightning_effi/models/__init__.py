"""Per-architecture knowledge, one file per model family: what random-LTD needs (layer lists, sequence tensors,
masks; :class:`TransformerAdapter`) and what the V-cycle needs (parameter maps, building the small model;
:class:`VCycleAdapter`).

Families: HF GPT-2 (``gpt2.py``, ``hf_gpt2``), HF BERT (``bert.py``, ``hf_bert``), timm ViT / DeiT (``vit.py``,
``timm_vit``), each registered once in :mod:`~lightning_effi.models.registry` with its adapter per technique
(:func:`registered_families`); any other transformer through :class:`GenericAdapter` (random-LTD, config only) or a
registered adapter subclass. Shared pieces: ``base.py`` (random-LTD) and ``vcycle_base.py`` (V-cycle).
"""

from lightning_effi.models.base import (
    MUST_BE_NONE,
    PASS,
    AttentionMask,
    SeqArg,
    TransformerAdapter,
    find_adapter,
    find_candidates,
    register_adapter,
    registered_adapters,
    resolve_attr,
)
from lightning_effi.models.bert import HFBertAdapter, HFBertVCycleAdapter
from lightning_effi.models.generic import GenericAdapter, TorchTransformerAdapter
from lightning_effi.models.gpt2 import HFGPT2Adapter, HFGPT2VCycleAdapter
from lightning_effi.models.registry import ModelFamily, registered_families
from lightning_effi.models.vcycle_base import (
    VCycleAdapter,
    find_vcycle_adapter,
    register_vcycle_adapter,
    registered_vcycle_adapters,
)
from lightning_effi.models.vit import TimmViTAdapter, TimmViTVCycleAdapter

# isort: split
# registered after the HF / timm families: "auto" look-ups try them first
from lightning_effi.models.torch_transformer import TorchBlocksVCycleAdapter

__all__ = [
    "MUST_BE_NONE",
    "PASS",
    "AttentionMask",
    "GenericAdapter",
    "HFBertAdapter",
    "HFBertVCycleAdapter",
    "HFGPT2Adapter",
    "HFGPT2VCycleAdapter",
    "ModelFamily",
    "SeqArg",
    "TimmViTAdapter",
    "TimmViTVCycleAdapter",
    "TorchBlocksVCycleAdapter",
    "TorchTransformerAdapter",
    "TransformerAdapter",
    "VCycleAdapter",
    "find_adapter",
    "find_candidates",
    "find_vcycle_adapter",
    "register_adapter",
    "register_vcycle_adapter",
    "registered_adapters",
    "registered_families",
    "registered_vcycle_adapters",
    "resolve_attr",
]
