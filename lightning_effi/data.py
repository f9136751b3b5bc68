"""The data namespace: every DataModule, dataset and data helper of lightning_effi under one import path.

Technique pieces (:class:`InfoBatchDataModule`, :class:`CurriculumDataModule`, ...) live in their technique's folder,
the shared pieces (:class:`IndexedDataset`, :class:`WrappingDataModule`, ...) in :mod:`lightning_effi.core` and the
reference DataModules in :mod:`lightning_effi.reference.data`; this module re-exports them so documented import
paths keep working. Batch structures are fixed in ``docs/architecture.md``.
"""

from lightning_effi.core.errors import DataConfigError
from lightning_effi.core.indexed import IndexedDataset, indexed_collate, sequence_lengths
from lightning_effi.core.loader import EpochShuffleSampler, ResumableDataLoader
from lightning_effi.core.wrapping import WrappingDataModule, loader_template
from lightning_effi.curriculum.data import (
    CurriculumCollate,
    CurriculumDataLoader,
    CurriculumDataModule,
    CurriculumDataset,
    CurriculumSampler,
)
from lightning_effi.infobatch.data import InfoBatchDataModule
from lightning_effi.infobatch.sampler import InfoBatchSampler
from lightning_effi.reference.data.base import EffiDataModule, PaddingCollate, seeded_subset
from lightning_effi.reference.data.cache import (
    NpyFile,
    atomic_dir,
    atomic_write,
    cache_key,
    default_cache_dir,
    file_md5,
    resolve_cache_dir,
)
from lightning_effi.reference.data.cifar10 import (
    CIFAR10_CLASSES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10DataModule,
    CIFAR10Dataset,
    random_crop_flip,
)
from lightning_effi.reference.data.corpus import STDLIB_CORPUS_FILES, stdlib_corpus, stdlib_corpus_files
from lightning_effi.reference.data.sst2 import SST2DataModule, SST2Dataset, read_sst2_tsv
from lightning_effi.reference.data.text import (
    CausalLMDataModule,
    MaskedBlockDataset,
    MaskedLMDataModule,
    TokenBlockDataset,
    mask_tokens,
)
from lightning_effi.reference.data.tokenization import (
    BERT_SPECIAL_TOKENS,
    EOT_TOKEN,
    CharTokenizer,
    encode_text,
    load_tokenizer,
    save_tokenizer,
    train_bpe_tokenizer,
    train_wordpiece_tokenizer,
)

__all__ = [
    "BERT_SPECIAL_TOKENS",
    "CIFAR10_CLASSES",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "EOT_TOKEN",
    "STDLIB_CORPUS_FILES",
    "CIFAR10DataModule",
    "CIFAR10Dataset",
    "CurriculumCollate",
    "CurriculumDataLoader",
    "CurriculumDataModule",
    "CurriculumDataset",
    "CurriculumSampler",
    "WrappingDataModule",
    "loader_template",
    "CausalLMDataModule",
    "CharTokenizer",
    "DataConfigError",
    "EffiDataModule",
    "EpochShuffleSampler",
    "ResumableDataLoader",
    "IndexedDataset",
    "InfoBatchDataModule",
    "InfoBatchSampler",
    "MaskedBlockDataset",
    "MaskedLMDataModule",
    "NpyFile",
    "PaddingCollate",
    "SST2DataModule",
    "SST2Dataset",
    "TokenBlockDataset",
    "atomic_dir",
    "atomic_write",
    "cache_key",
    "default_cache_dir",
    "encode_text",
    "file_md5",
    "indexed_collate",
    "load_tokenizer",
    "mask_tokens",
    "random_crop_flip",
    "read_sst2_tsv",
    "resolve_cache_dir",
    "save_tokenizer",
    "seeded_subset",
    "sequence_lengths",
    "stdlib_corpus",
    "stdlib_corpus_files",
    "train_bpe_tokenizer",
    "train_wordpiece_tokenizer",
]
