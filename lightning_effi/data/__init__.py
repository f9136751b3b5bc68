"""Data layer of lightning_effi: DataModules (CIFAR-10, causal LM, masked LM, SST-2), the stdlib corpus,
tokenizers, caching, index transport (:class:`IndexedDataset`) and the sample-length protocol
(:func:`sequence_lengths`). Batch structures are fixed in ``docs/architecture.md``."""

from .base import EffiDataModule, PaddingCollate, seeded_subset
from .cache import NpyFile, atomic_dir, atomic_write, cache_key, default_cache_dir, file_md5, resolve_cache_dir
from .cifar10 import CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, CIFAR10DataModule, CIFAR10Dataset, random_crop_flip
from .corpus import STDLIB_CORPUS_FILES, stdlib_corpus, stdlib_corpus_files
from .errors import DataConfigError
from .loader import EpochShuffleSampler, ResumableDataLoader
from .infobatch import InfoBatchDataModule
from .curriculum import (CurriculumCollate, CurriculumDataLoader, CurriculumDataModule, CurriculumDataset,
                         CurriculumSampler)
from .wrapping import WrappingDataModule, loader_template
from .infobatch_sampler import InfoBatchSampler
from .indexed import IndexedDataset, indexed_collate, sequence_lengths
from .sst2 import SST2DataModule, SST2Dataset, read_sst2_tsv
from .text import CausalLMDataModule, MaskedBlockDataset, MaskedLMDataModule, TokenBlockDataset, mask_tokens
from .tokenization import (BERT_SPECIAL_TOKENS, EOT_TOKEN, CharTokenizer, encode_text, load_tokenizer, save_tokenizer,
                           train_bpe_tokenizer, train_wordpiece_tokenizer)

__all__ = [
    "BERT_SPECIAL_TOKENS", "CIFAR10_CLASSES", "CIFAR10_MEAN", "CIFAR10_STD", "EOT_TOKEN", "STDLIB_CORPUS_FILES",
    "CIFAR10DataModule", "CIFAR10Dataset", "CurriculumCollate", "CurriculumDataLoader", "CurriculumDataModule", "CurriculumDataset",
    "CurriculumSampler", "WrappingDataModule", "loader_template", "CausalLMDataModule", "CharTokenizer", "DataConfigError",
    "EffiDataModule", "EpochShuffleSampler", "ResumableDataLoader", "IndexedDataset", "InfoBatchDataModule", "InfoBatchSampler", "MaskedBlockDataset", "MaskedLMDataModule", "NpyFile", "PaddingCollate",
    "SST2DataModule", "SST2Dataset", "TokenBlockDataset", "atomic_dir", "atomic_write", "cache_key",
    "default_cache_dir", "encode_text", "file_md5", "indexed_collate", "load_tokenizer", "mask_tokens",
    "random_crop_flip", "read_sst2_tsv", "resolve_cache_dir", "save_tokenizer", "seeded_subset", "sequence_lengths",
    "stdlib_corpus", "stdlib_corpus_files", "train_bpe_tokenizer", "train_wordpiece_tokenizer",
]
