"""Data analysis for curriculum learning (DeepSpeed Data Efficiency): the difficulty metrics and the index of the
training set sorted by difficulty. The method card is ``lightning_effi/curriculum/README.md``.

- :class:`DataAnalyzer`: offline map/reduce over a data set, writing DeepSpeed-named, DeepSpeed-format index files;
- :func:`analyze_in_memory`: the same per-sample values computed in this process, at ``setup``, without files;
- :class:`MMapIndexedDataset` / :class:`MMapIndexedDatasetBuilder`: the on-disk format (both dtype tables);
- :class:`MetricIndex`: the validated in-memory index (``ids``, ``offsets``, ``values``) the curriculum sampler uses;
- metrics (``seqlen``, ``total_vocab_freq``, ``vocab_rarity``, ``seqlen_vocab_rarity``) and a name registry.
"""

from .analyzer import AnalyzerError, DataAnalyzer, split_dataset, split_index
from .in_memory import analyze_in_memory
from .index import INPROGRESS_NAME, METADATA_NAME, MetricIndex, read_metadata
from .indexed_dataset import (
    DTYPES_CURRENT,
    DTYPES_LEGACY,
    IndexFileError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    find_fit_int_dtype,
    normalize_int_dtype,
    write_index_file,
)
from .metrics import (
    METRIC_TYPES,
    SeqLen,
    SeqLenVocabRarity,
    TotalVocabFreq,
    VocabRarity,
    get_metric,
    load_vocab_freq,
    register_metric,
    registered_metrics,
    seqlen,
    seqlen_vocab_rarity,
    total_vocab_freq,
    vocab_rarity,
    vocab_rarity_table,
)

__all__ = [
    "DTYPES_CURRENT",
    "DTYPES_LEGACY",
    "INPROGRESS_NAME",
    "METADATA_NAME",
    "METRIC_TYPES",
    "AnalyzerError",
    "DataAnalyzer",
    "IndexFileError",
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "MetricIndex",
    "SeqLen",
    "SeqLenVocabRarity",
    "TotalVocabFreq",
    "VocabRarity",
    "analyze_in_memory",
    "find_fit_int_dtype",
    "get_metric",
    "load_vocab_freq",
    "normalize_int_dtype",
    "read_metadata",
    "register_metric",
    "registered_metrics",
    "seqlen",
    "seqlen_vocab_rarity",
    "split_dataset",
    "split_index",
    "total_vocab_freq",
    "vocab_rarity",
    "vocab_rarity_table",
    "write_index_file",
]
