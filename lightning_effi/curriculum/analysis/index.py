"""In-memory form of a difficulty index (what the curriculum sampler consumes) and its validated loader. The method
card is ``lightning_effi/curriculum/README.md``.

It reads the analyzer's ``{m}_index_to_sample`` / ``{m}_index_to_metric`` / ``{m}_index_to_sample_percentile_merged``
files (DeepSpeed ``data_sampling/data_analyzer.py`` output), rejects ids out of range (e.g. an analysis of another
split), and gives the digest the curriculum compares across DDP ranks.

The analyzer (:mod:`lightning_effi.curriculum.analysis.analyzer`) writes, next to its final files, a metadata file
(:data:`METADATA_NAME`) with the data-set length and a digest of every final file; :meth:`MetricIndex.load` uses it to
reject stale files (an earlier analysis of a data set of another length, or files changed after the analysis), and
refuses a folder whose reduce was interrupted while publishing (:data:`INPROGRESS_NAME` present). The metadata also
holds :func:`dataset_fingerprint` of the analysed data set, so files analysed from another data set of the same
length are refused when the training data set is given. Files without metadata (e.g. made by DeepSpeed) are
validated by content only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .indexed_dataset import IndexFileError, MMapIndexedDataset, data_file_path, index_file_path

__all__ = ["INPROGRESS_NAME", "METADATA_NAME", "MetricIndex", "dataset_fingerprint", "file_digest", "read_metadata"]

#: samples read by :func:`dataset_fingerprint` (evenly spaced over the data set)
FINGERPRINT_SAMPLES = 16

#: metadata written by the analyzer next to a metric's final files (``save_path/{m}/analysis_metadata.json``)
METADATA_NAME = "analysis_metadata.json"
#: present while a reduce publishes its files; a folder holding it has a mix of old and new files
INPROGRESS_NAME = "reduce.inprogress"


def file_digest(prefix: str | os.PathLike) -> dict[str, Any]:
    """Sizes and a BLAKE2b digest of ``{prefix}.idx`` + ``{prefix}.bin`` (streamed; used in the metadata)."""
    h = hashlib.blake2b(digest_size=16)
    sizes = {}
    for kind, path in (("idx", index_file_path(prefix)), ("bin", data_file_path(prefix))):
        sizes[f"{kind}_bytes"] = os.path.getsize(path)
        with open(path, "rb") as f:
            while True:
                buf = f.read(1 << 24)
                if not buf:
                    break
                h.update(buf)
    return {**sizes, "blake2b": h.hexdigest()}


def _hash_item(h: Any, item: Any) -> bool:
    """Fold one sample into ``h``; False when it holds a leaf that cannot be hashed by content. Any mapping (HF's
    ``BatchEncoding``, a ``UserDict``: a dict-only walk left the check off for a tokenizer's samples, qa108-break 06)
    and dataclass walks by its keys / fields."""
    if not isinstance(item, Mapping) and dataclasses.is_dataclass(item) and not isinstance(item, type):
        # a mapping that is also a dataclass (HF's ModelOutput) keeps its mapping's keys, as before (qa109-regress 02)
        item = {f.name: getattr(item, f.name) for f in dataclasses.fields(item)}
    if isinstance(item, Mapping):
        for key in sorted(item, key=str):
            h.update(repr(key).encode())
            if not _hash_item(h, item[key]):
                return False
        return True
    if isinstance(item, (list, tuple)):
        h.update(f"{type(item).__name__}{len(item)}".encode())
        return all(_hash_item(h, x) for x in item)
    if hasattr(item, "detach") and hasattr(item, "cpu"):  # a torch tensor
        item = item.detach().cpu().numpy()
    if isinstance(item, np.ndarray) or isinstance(item, np.generic):
        arr = np.ascontiguousarray(item)
        h.update(f"{arr.dtype.str}{arr.shape}".encode())
        h.update(arr.tobytes())
        return True
    if isinstance(item, (str, bytes, int, float, bool)) or item is None:
        h.update(repr(item).encode())
        return True
    return False


def _fingerprint_once(dataset: Any, positions: np.ndarray) -> str | None:
    h = hashlib.blake2b(digest_size=8)
    h.update(str(len(dataset)).encode())
    for i in positions:
        h.update(int(i).to_bytes(8, "little"))
        if not _hash_item(h, dataset[int(i)]):
            return None
    return h.hexdigest()


def dataset_fingerprint(dataset: Any, samples: int = FINGERPRINT_SAMPLES) -> str | None:
    """A content fingerprint of a map-style data set: BLAKE2b of its length and of ``samples`` items at evenly spaced
    indices (first and last included; tensors, arrays, numbers and strings, through dicts, lists and tuples).

    Two data sets of the same length with different contents (another split, another order, another tokenizer) get
    different fingerprints with near certainty when the differences reach the items read. Returns ``None`` when the
    data set cannot be fingerprinted: it is empty, an item holds a leaf of another type, or reading the items twice
    gives two fingerprints (random augmentations in ``__getitem__``); the check is then skipped.
    """
    try:
        n = len(dataset)
    except TypeError:
        return None
    if n == 0:
        return None
    positions = np.unique(np.linspace(0, n - 1, min(n, samples)).round().astype(np.int64))
    first = _fingerprint_once(dataset, positions)
    if first is None or _fingerprint_once(dataset, positions) != first:
        return None
    return first


def read_metadata(folder: str | os.PathLike) -> dict | None:
    """The analyzer metadata of ``folder`` (a metric directory), or ``None`` when there is none.

    Raises:
        IndexFileError: a reduce was interrupted in ``folder`` (:data:`INPROGRESS_NAME`), or the metadata is unreadable.
    """
    folder = os.fspath(folder)
    marker = os.path.join(folder, INPROGRESS_NAME)
    if os.path.exists(marker):
        raise IndexFileError(
            f"'{marker}': a reduce was interrupted while publishing its files in '{folder}'; the "
            "files there may mix two analyses: run the reduce again"
        )
    path = os.path.join(folder, METADATA_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise IndexFileError(f"'{path}': unreadable analysis metadata ({err})") from None
    if not isinstance(meta, dict) or "num_samples" not in meta or "files" not in meta:
        raise IndexFileError(f"'{path}': not an analysis metadata file (needs 'num_samples' and 'files')")
    return meta


def _check_against_metadata(prefix: str, num_samples: int | None, dataset: Any = None) -> None:
    folder = os.path.dirname(os.path.abspath(prefix))
    meta = read_metadata(folder)
    if meta is None:
        return
    meta_path = os.path.join(folder, METADATA_NAME)
    if num_samples is not None and int(meta["num_samples"]) != int(num_samples):
        raise IndexFileError(
            f"'{prefix}': stale analysis: '{meta_path}' says it was made for a data set of "
            f"{meta['num_samples']} samples, this data set has {num_samples}; run the analyzer on "
            "this data set (same split and order as training)"
        )
    recorded_data = meta.get("dataset_fingerprint")
    if dataset is not None and recorded_data is not None:
        found = dataset_fingerprint(dataset)
        ids_from = meta.get("ids_from")
        if found is not None and found != recorded_data and ids_from and found == meta.get("positions_fingerprint"):
            # the analysed data set itself, in its own order: its ids were not its positions
            field = (
                " (DataAnalyzer's index_key is 'index' by default: a dict sample's 'index' field, such as a "
                "DataFrame's row label, is read as its id)"
                if str(ids_from).startswith("index_key")
                else ""
            )
            raise IndexFileError(
                f"'{prefix}': the training data set is the one analysed, but '{meta_path}' indexes its samples by "
                f"the ids of its {ids_from}{field}, which are not their positions in this data set, so the files "
                "point at other samples; run the analyzer with index_key=None and no sample_indices (ids = "
                "positions), or train on the data set in the order of those ids"
            )
        if found is not None and found != recorded_data:
            raise IndexFileError(
                f"'{prefix}': analysis of another data set: '{meta_path}' records the data set fingerprint "
                f"{recorded_data}, the training data set has {found} (same length, other contents: another split, "
                "order or tokenization?); run the analyzer on this data set"
            )
    stem = os.path.basename(prefix)
    recorded = meta["files"].get(stem)
    if recorded is None:
        return
    actual = file_digest(prefix)
    if actual != recorded:
        raise IndexFileError(
            f"'{prefix}': stale or modified file: its content does not match '{meta_path}' "
            f"(recorded {recorded}, found {actual}); it was changed after the analysis or comes "
            "from another one: run the analyzer again"
        )


def _as_int64(values: np.ndarray, what: str, path: str) -> np.ndarray:
    if values.dtype == np.uint64 and len(values) and int(values.max()) > np.iinfo(np.int64).max:
        raise IndexFileError(f"'{path}': {what} above int64 max")
    return np.asarray(values, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class MetricIndex:
    """A difficulty index: rows of sample ids in ascending metric order.

    Attributes:
        ids: ``int64[N]``, all rows concatenated (ascending metric; within a row ascending id for analyzer output).
        offsets: ``int64[R+1]``, row ``j`` is ``ids[offsets[j]:offsets[j+1]]``; ``offsets[0] == 0``,
            ``offsets[-1] == N``.
        values: ``int64[R]`` metric value of each row (strictly increasing), or ``None`` for a
            ``_percentile_merged`` index (row ↔ value lost: valid only for percentile difficulty).
    """

    ids: np.ndarray
    offsets: np.ndarray
    values: np.ndarray | None = None

    def __post_init__(self) -> None:
        ids = np.asarray(self.ids, dtype=np.int64)
        offsets = np.asarray(self.offsets, dtype=np.int64)
        values = None if self.values is None else np.asarray(self.values, dtype=np.int64)
        if ids.ndim != 1 or offsets.ndim != 1 or len(offsets) < 1:
            raise ValueError("MetricIndex: ids must be 1-D and offsets 1-D with at least one entry")
        if offsets[0] != 0 or offsets[-1] != len(ids) or np.any(np.diff(offsets) < 0):
            raise ValueError(
                f"MetricIndex: offsets must start at 0, be non-decreasing and end at len(ids) = {len(ids)}"
            )
        if values is not None:
            if values.shape != (len(offsets) - 1,):
                raise ValueError(
                    f"MetricIndex: values must have one entry per row ({len(offsets) - 1}); got shape {values.shape}"
                )
            if len(values) > 1 and np.any(values[1:] <= values[:-1]):  # no np.diff: it overflows at the int64 ends
                raise ValueError("MetricIndex: values must be strictly increasing")
        for arr in (ids, offsets) + (() if values is None else (values,)):
            arr.flags.writeable = False
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "values", values)

    @property
    def num_samples(self) -> int:
        return len(self.ids)

    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1

    def row(self, j: int) -> np.ndarray:
        """Ids of row ``j`` (a read-only view)."""
        return self.ids[self.offsets[j] : self.offsets[j + 1]]

    def rows(self) -> list[np.ndarray]:
        return [self.row(j) for j in range(self.num_rows)]

    def fingerprint(self) -> str:
        """Short hash (16 hex digits) of ids, offsets and values; equal indexes give equal fingerprints on every
        rank/machine (little-endian int64 bytes are hashed)."""
        h = hashlib.blake2b(digest_size=8)
        h.update(self.ids.astype("<i8", copy=False).tobytes())
        h.update(b"|")
        h.update(self.offsets.astype("<i8", copy=False).tobytes())
        h.update(b"|")
        h.update(b"none" if self.values is None else self.values.astype("<i8", copy=False).tobytes())
        return h.hexdigest()

    @classmethod
    def from_sample_to_metric(cls, values_per_sample: Any) -> MetricIndex:
        """Index of ``values_per_sample`` (integer ``[N]``, value of sample ``i`` at position ``i``) with the row
        order of the analyzer's reduce: rows ascending by value, ids ascending within a row.

        Raises:
            TypeError: non-integer values.  ValueError: not 1-D.
        """
        if hasattr(values_per_sample, "detach"):
            values_per_sample = values_per_sample.detach().cpu().numpy()
        v = np.asarray(values_per_sample)
        if v.ndim != 1:
            raise ValueError(f"values_per_sample must be 1-D [N]; got shape {v.shape}")
        if len(v) and v.dtype.kind not in "iu":
            raise TypeError(f"values_per_sample must be integers; got {v.dtype}")
        v = v.astype(np.int64)
        order = np.argsort(v, kind="stable")
        sorted_v = v[order]
        if len(v):
            starts = np.flatnonzero(np.concatenate(([True], sorted_v[1:] != sorted_v[:-1])))
        else:
            starts = np.zeros(0, dtype=np.int64)
        offsets = np.concatenate((starts, [len(v)])).astype(np.int64)
        return cls(order.astype(np.int64), offsets, sorted_v[starts])

    @classmethod
    def load(
        cls,
        index_to_sample_path: str | os.PathLike,
        index_to_metric_path: str | os.PathLike | None = None,
        num_samples: int | None = None,
        dtype_table: str = "current",
        dataset: Any = None,
    ) -> MetricIndex:
        """Load and validate analyzer (or DeepSpeed) index files.

        Args:
            index_to_sample_path: prefix (no ``.bin``/``.idx``) of ``{m}_index_to_sample`` or
                ``{m}_index_to_sample_percentile_merged``.
            index_to_metric_path: prefix of ``{m}_index_to_metric`` (one ``[value]`` item per row); ``None`` gives
                ``values=None`` (percentile difficulty only).
            num_samples: the training data set's length ``N``; ``None`` takes the number of ids in the file.
            dtype_table: ``"current"`` or ``"legacy"`` (:mod:`.indexed_dataset`).
            dataset: the training data set; when given and the analyzer metadata records a
                :func:`dataset_fingerprint`, the two must match.

        Raises:
            IndexFileError (naming the file): missing or damaged files; total ids != ``num_samples``; an id outside
                ``[0, N)`` or duplicated; row counts differing between the two files; an ``index_to_metric`` item not
                of length 1; values not strictly increasing; stale files (the analyzer metadata next to them names
                another data-set length or another data-set fingerprint, or a file differs from the digest recorded
                there); an interrupted reduce.
        """
        return _load_validated(
            index_to_sample_path, index_to_metric_path, num_samples, dtype_table, check_metadata=True, dataset=dataset
        )

    def __repr__(self) -> str:
        kind = "merged" if self.values is None else "per-value"
        return f"MetricIndex(N={self.num_samples}, rows={self.num_rows}, {kind}, fingerprint={self.fingerprint()})"


def _load_validated(
    index_to_sample_path: str | os.PathLike,
    index_to_metric_path: str | os.PathLike | None,
    num_samples: int | None,
    dtype_table: str,
    check_metadata: bool,
    dataset: Any = None,
) -> MetricIndex:
    """:meth:`MetricIndex.load`; ``check_metadata=False`` skips the analyzer-metadata checks (used by the reduce to
    verify its temporary files before publishing them)."""
    s_path = os.fspath(index_to_sample_path)
    for suffix in (".bin", ".idx"):
        if s_path.endswith(suffix):
            raise IndexFileError(f"'{s_path}': pass the path prefix without '{suffix}'")
    if num_samples is not None and (isinstance(num_samples, bool) or int(num_samples) < 0):
        raise ValueError(f"num_samples must be a non-negative int or None; got {num_samples!r}")
    if check_metadata:
        _check_against_metadata(s_path, num_samples, dataset)
    samples = MMapIndexedDataset(s_path, dtype_table)
    if samples.dtype.kind not in "iu":
        raise IndexFileError(f"'{s_path}': ids stored as {samples.dtype}; expected an integer dtype")
    ids = _as_int64(samples.flat, "ids", s_path)
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(samples.sizes, out=offsets[1:])
    n = len(ids) if num_samples is None else int(num_samples)
    if len(ids) != n:
        raise IndexFileError(
            f"'{s_path}': holds {len(ids)} sample ids but the data set has {n} samples (an "
            "analysis of another data set or split?)"
        )
    if len(ids):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= n:
            bad = ids[(ids < 0) | (ids >= n)][:5].tolist()
            raise IndexFileError(
                f"'{s_path}': sample ids out of range [0, {n}): e.g. {bad} (an analysis of another data set or split?)"
            )
        counts = np.bincount(ids, minlength=n)
        if np.any(counts > 1):
            dup = np.flatnonzero(counts > 1)[:5].tolist()
            raise IndexFileError(f"'{s_path}': duplicated sample ids, e.g. {dup}; every id must appear once")
    values = None
    if index_to_metric_path is not None:
        m_path = os.fspath(index_to_metric_path)
        if check_metadata:
            _check_against_metadata(m_path, num_samples, dataset)
        metric = MMapIndexedDataset(m_path, dtype_table)
        if len(metric) != len(samples):
            raise IndexFileError(
                f"index_to_metric_path '{m_path}': {len(metric)} rows but index_to_sample_path '{s_path}' has "
                f"{len(samples)}; the two files must come from the same analysis (index_to_metric_path is the "
                "<metric>_index_to_metric file, one row per distinct value; <metric>_sample_to_metric has one row per "
                "sample)"
            )
        if len(metric) and np.any(metric.sizes != 1):
            j = int(np.flatnonzero(metric.sizes != 1)[0])
            raise IndexFileError(
                f"index_to_metric_path '{m_path}': item {j} has {int(metric.sizes[j])} elements; every "
                "index_to_metric item must be one [value]"
            )
        if metric.dtype.kind not in "iu":
            raise IndexFileError(
                f"index_to_metric_path '{m_path}': values stored as {metric.dtype}; expected an integer dtype"
            )
        values = _as_int64(metric.flat, "values", m_path)
        if len(values) > 1 and np.any(values[1:] <= values[:-1]):
            j = int(np.flatnonzero(values[1:] <= values[:-1])[0])
            raise IndexFileError(
                f"index_to_metric_path '{m_path}': values are not strictly increasing (row {j + 1}: "
                f"{int(values[j + 1])} after {int(values[j])})"
            )
    return MetricIndex(ids, offsets, values)
