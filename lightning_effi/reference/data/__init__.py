"""Reference DataModules (CIFAR-10, causal LM, masked LM, SST-2), the stdlib corpus, tokenizers and caches."""

from lightning_effi.reference.data.base import EffiDataModule, PaddingCollate, seeded_subset
from lightning_effi.reference.data.cifar10 import CIFAR10DataModule, CIFAR10Dataset
from lightning_effi.reference.data.sst2 import SST2DataModule, SST2Dataset
from lightning_effi.reference.data.text import CausalLMDataModule, MaskedLMDataModule

__all__ = [
    "CIFAR10DataModule",
    "CIFAR10Dataset",
    "CausalLMDataModule",
    "EffiDataModule",
    "MaskedLMDataModule",
    "PaddingCollate",
    "SST2DataModule",
    "SST2Dataset",
    "seeded_subset",
]
