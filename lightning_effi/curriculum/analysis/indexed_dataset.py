"""DeepSpeed/Megatron ``MMapIndexedDataset`` files: a zero-copy reader and a byte-exact builder.

Source: DeepSpeed 0.19.8 ``deepspeed/runtime/data_pipeline/data_sampling/indexed_dataset.py`` (itself from
Megatron-LM / fairseq), layout verified on files it wrote. The method card is ``lightning_effi/curriculum/README.md``.

A dataset is a pair of files sharing a path prefix:

- ``{prefix}.bin``: the raw concatenation of all items in the file dtype (C order, little-endian), no header.
- ``{prefix}.idx`` (little-endian)::

      offset 0        9 bytes   magic b"MMIDIDX\\x00\\x00"
      offset 9        <Q        version = 1
      offset 17       <B        dtype code (table below)
      offset 18       <Q        len = number of items
      offset 26       <Q        doc_count
      offset 34       int32[len]         sizes (elements per item)
      34 + 4·len      int64[len]         pointers: byte offsets = exclusive cumsum of size × itemsize
      34 + 12·len     int64[doc_count]   doc_idx

``doc_idx`` starts at ``[0]``; :meth:`MMapIndexedDatasetBuilder.end_document` appends the current item count and
:meth:`MMapIndexedDatasetBuilder.merge_file_` appends the merged file's boundaries (shifted). Readers must not
interpret it for analyzer files; writers reproduce DeepSpeed's values for byte-identical output.

Two incompatible dtype-code tables exist (:data:`DTYPES_CURRENT`, DeepSpeed >= 0.13.3; :data:`DTYPES_LEGACY`,
DeepSpeed <= 0.13.2 and Megatron-LM); the reader takes the table as a parameter and defaults to the current one.
Every error about a file is an :class:`IndexFileError` (a ``ValueError``) naming the file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from lightning_effi.core.checks import is_int

__all__ = [
    "DTYPES_CURRENT",
    "DTYPES_LEGACY",
    "HDR_MAGIC",
    "HEADER_SIZE",
    "IndexFileError",
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "data_file_path",
    "dtype_code",
    "find_fit_int_dtype",
    "index_file_path",
    "normalize_int_dtype",
    "write_index_file",
]

HDR_MAGIC = b"MMIDIDX\x00\x00"
HEADER_SIZE = 34  # magic 9 + version 8 + code 1 + len 8 + doc_count 8

#: DeepSpeed >= 0.13.3 (PR #5108), verified on 0.19.8: exactly codes 1-8.
DTYPES_CURRENT: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.uint16),
    7: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}
#: DeepSpeed <= 0.13.2 and Megatron-LM (6 = ``np.float``, 7 = ``np.double``: both float64 in those sources; some
#: readers map one of them to float32 -- check the producing version). Floats are readable, never written.
DTYPES_LEGACY: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float64),
    8: np.dtype(np.uint16),
    9: np.dtype(np.uint32),
    10: np.dtype(np.uint64),
}
_TABLES = {"current": DTYPES_CURRENT, "legacy": DTYPES_LEGACY}
_INT32_MAX = 2**31 - 1
_CHUNK = 1 << 22  # elements per chunk when streaming large index arrays


class IndexFileError(ValueError):
    """A missing, damaged, stale or otherwise unusable index/data file (the message names the file), or a dtype
    that cannot be written."""


def index_file_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def data_file_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def _table(dtype_table: str | dict) -> dict[int, np.dtype]:
    if isinstance(dtype_table, dict):
        return dtype_table
    if dtype_table not in _TABLES:
        raise ValueError(f"dtype_table must be one of {sorted(_TABLES)}; got {dtype_table!r}")
    return _TABLES[dtype_table]


def normalize_int_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    """``dtype`` (NumPy type or dtype, ``torch`` dtype, or a string such as ``"int64"``) as a NumPy integer dtype.

    NumPy and torch integer dtypes are equivalent (``torch.int64`` == ``np.int64``; DeepSpeed 0.19.8 asserts that the
    metric's output dtype object equals the declared one, so a ``torch.int64`` result declared ``np.int64`` fails).

    Raises:
        TypeError: ``dtype`` is not an integer dtype (floats, bool, complex, objects), naming ``name``.
    """
    np_dtype = None
    try:
        import torch

        if isinstance(dtype, torch.dtype):
            if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
                raise TypeError(
                    f"{name}: {dtype} is not an integer dtype; analyzer values must be integers "
                    "(uint8/int8/int16/int32/int64/uint16/uint32/uint64)"
                )
            np_dtype = np.dtype(str(dtype).replace("torch.", ""))
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if np_dtype is None:
        if isinstance(dtype, str) and dtype.startswith("torch."):
            dtype = dtype[len("torch.") :]
        try:
            np_dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(
                f"{name}: {dtype!r} is not a dtype; expected an integer dtype such as np.int64, torch.int64 or 'int64'"
            ) from None
    if np_dtype.kind not in "iu":
        raise TypeError(
            f"{name}: {np_dtype} is not an integer dtype; analyzer values must be integers "
            "(uint8/int8/int16/int32/int64/uint16/uint32/uint64); scale float values explicitly"
        )
    return np_dtype


def dtype_code(dtype: Any, dtype_table: str = "current", path: str | os.PathLike | None = None) -> int:
    """Code of ``dtype`` in ``dtype_table``. Raises :class:`IndexFileError` (naming ``path``) when the dtype cannot
    be written: floats and anything outside the table."""
    where = f" for '{os.fspath(path)}'" if path is not None else ""
    try:
        np_dtype = normalize_int_dtype(dtype)
    except TypeError as err:
        raise IndexFileError(f"cannot write dtype {dtype!r}{where}: {err}") from None
    for code, table_dtype in _table(dtype_table).items():
        if table_dtype == np_dtype:
            return code
    raise IndexFileError(
        f"cannot write dtype {np_dtype}{where}: not in the {dtype_table} dtype table "
        f"({_table_str(_table(dtype_table))})"
    )


def _table_str(table: dict[int, np.dtype]) -> str:
    return ", ".join(f"{c}={d}" for c, d in table.items())


def find_fit_int_dtype(min_value: int, max_value: int) -> type:
    """Smallest integer NumPy type holding ``[min_value, max_value]`` (DeepSpeed ``utils.find_fit_int_dtype``,
    used by its reduce): ``min >= 0`` -> uint8 / uint16 / uint32 / uint64, else the smallest of int8/16/32/64."""
    min_value, max_value = int(min_value), int(max_value)
    if min_value > max_value:
        raise ValueError(f"find_fit_int_dtype: min_value {min_value} > max_value {max_value}")
    if min_value >= 0:
        for t in (np.uint8, np.uint16, np.uint32):
            if max_value <= np.iinfo(t).max:
                return t
        if max_value > np.iinfo(np.uint64).max:
            raise ValueError(f"find_fit_int_dtype: {max_value} does not fit in uint64")
        return np.uint64
    for t in (np.int8, np.int16, np.int32):
        if min_value >= np.iinfo(t).min and max_value <= np.iinfo(t).max:
            return t
    if min_value < np.iinfo(np.int64).min or max_value > np.iinfo(np.int64).max:
        raise ValueError(f"find_fit_int_dtype: [{min_value}, {max_value}] does not fit in int64")
    return np.int64


def _pointer_chunks(sizes: np.ndarray, itemsize: int) -> Iterable[np.ndarray]:
    """Exclusive cumsum of ``sizes * itemsize`` as int64, in chunks (bounded temporary memory)."""
    total = 0
    for start in range(0, len(sizes), _CHUNK):
        chunk = np.asarray(sizes[start : start + _CHUNK], dtype=np.int64) * itemsize
        csum = np.cumsum(chunk)
        out = np.empty_like(csum)
        out[0:1] = total
        out[1:] = csum[:-1] + total
        total += int(csum[-1]) if len(csum) else 0
        yield out


def write_index_file(
    path: str | os.PathLike,
    dtype: Any,
    sizes: Sequence[int] | np.ndarray,
    doc_idx: Sequence[int] | np.ndarray,
    dtype_table: str = "current",
) -> None:
    """Write a ``.idx`` file byte-identical to DeepSpeed's ``MMapIndexedDataset.Index.writer``.

    Args:
        path: the ``.idx`` file (overwritten).
        dtype: item dtype of the matching ``.bin`` (an integer dtype of ``dtype_table``).
        sizes: elements per item, each in ``[0, 2**31)``; streamed in chunks, so a memmap works.
        doc_idx: document boundaries as DeepSpeed's builder produces them.

    Raises:
        IndexFileError: unsupported dtype, or an item size outside ``[0, 2**31)``.
    """
    code = dtype_code(dtype, dtype_table, path)
    itemsize = _table(dtype_table)[code].itemsize
    sizes = np.asarray(sizes)
    doc = np.asarray(doc_idx, dtype=np.int64)
    if len(sizes):
        lo, hi = int(sizes.min()), int(sizes.max())
        if lo < 0 or hi > _INT32_MAX:
            raise IndexFileError(
                f"'{os.fspath(path)}': item sizes must be in [0, 2**31) (they are stored as int32); "
                f"got min {lo}, max {hi}"
            )
    with open(path, "wb") as f:
        f.write(HDR_MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc)))
        for start in range(0, len(sizes), _CHUNK):
            f.write(np.asarray(sizes[start : start + _CHUNK], dtype="<i4").tobytes(order="C"))
        for chunk in _pointer_chunks(sizes, itemsize):
            f.write(chunk.astype("<i8", copy=False).tobytes(order="C"))
        f.write(doc.astype("<i8", copy=False).tobytes(order="C"))


class MMapIndexedDataset:
    """Read-only reader of an ``MMapIndexedDataset`` (``{path_prefix}.idx`` + ``{path_prefix}.bin``).

    Args:
        path_prefix: path without ``.bin``/``.idx``.
        dtype_table: ``"current"`` (DeepSpeed >= 0.13.3, default) or ``"legacy"`` (DeepSpeed <= 0.13.2, Megatron).

    ``ds[i]`` is a zero-copy, read-only 1-D view (``np.ndarray`` of :attr:`dtype`, length ``sizes[i]``); negative
    ``i`` counts from the end; ``ds[a:b]`` (step 1 only) is a list of such views. :attr:`sizes` (int32),
    :attr:`pointers` (int64, byte offsets), :attr:`doc_idx` (int64) and :attr:`flat` (all items concatenated) are
    read-only views of the mapped files.

    Raises:
        IndexFileError: a file is missing; bad magic or version; a dtype code outside the table (e.g. 9 with the
            current table); the ``.idx`` is truncated or longer than its header says; pointers are not the exclusive
            cumsum of ``size × itemsize``; the ``.bin`` size differs from the sum of the item sizes.
    """

    def __init__(self, path_prefix: str | os.PathLike, dtype_table: str = "current"):
        self.path_prefix = os.fspath(path_prefix)
        self.dtype_table = dtype_table
        table = _table(dtype_table)
        idx_path, bin_path = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise IndexFileError(
                    f"'{p}': file not found (an MMapIndexedDataset needs both "
                    f"'{self.path_prefix}.idx' and '{self.path_prefix}.bin')"
                )
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < 9 or header[:9] != HDR_MAGIC:
            raise IndexFileError(
                f"'{idx_path}': not an MMapIndexedDataset index (magic {header[:9]!r}, expected {HDR_MAGIC!r})"
            )
        if len(header) < HEADER_SIZE:
            raise IndexFileError(f"'{idx_path}': truncated header ({len(header)} of {HEADER_SIZE} bytes)")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != 1:
            raise IndexFileError(f"'{idx_path}': unsupported version {version} (only version 1 exists)")
        code = header[17]
        if code not in table:
            raise IndexFileError(
                f"'{idx_path}': unknown dtype code {code} for the {dtype_table} dtype table "
                f"({_table_str(table)}); a file from another DeepSpeed/Megatron version may need "
                f"dtype_table='{'legacy' if dtype_table == 'current' else 'current'}'"
            )
        self._dtype = table[code]
        self.dtype_code = code
        (n,) = struct.unpack("<Q", header[18:26])
        (doc_count,) = struct.unpack("<Q", header[26:34])
        expected = HEADER_SIZE + 12 * n + 8 * doc_count
        if idx_size != expected:
            what = "truncated" if idx_size < expected else "longer than its header says"
            raise IndexFileError(
                f"'{idx_path}': {what}: {idx_size} bytes, expected {expected} "
                f"(34 + 12·len + 8·doc_count with len {n}, doc_count {doc_count})"
            )
        self._len = int(n)
        idx_map = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self._idx_map = idx_map
        self._sizes = np.frombuffer(idx_map, dtype="<i4", count=n, offset=HEADER_SIZE)
        self._pointers = np.frombuffer(idx_map, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
        self._doc_idx = np.frombuffer(idx_map, dtype="<i8", count=doc_count, offset=HEADER_SIZE + 12 * n)
        itemsize = self._dtype.itemsize
        if n and int(self._sizes.min()) < 0:
            raise IndexFileError(f"'{idx_path}': negative item size")
        start = 0
        for chunk in _pointer_chunks(self._sizes, itemsize):
            if not np.array_equal(chunk, self._pointers[start : start + len(chunk)]):
                raise IndexFileError(
                    f"'{idx_path}': pointers are not the exclusive cumsum of size × itemsize (damaged index)"
                )
            start += len(chunk)
        total_elems = int(self._sizes.sum(dtype=np.int64)) if n else 0
        bin_size = os.path.getsize(bin_path)
        if bin_size != total_elems * itemsize:
            what = "truncated" if bin_size < total_elems * itemsize else "longer than its index says"
            raise IndexFileError(
                f"'{bin_path}': {what}: {bin_size} bytes, expected {total_elems * itemsize} "
                f"({total_elems} elements of {self._dtype}) from '{idx_path}'"
            )
        # an empty file cannot be memory-mapped (DeepSpeed PR #5106)
        self._flat = (
            np.memmap(bin_path, mode="r", dtype=self._dtype.newbyteorder("<"))
            if bin_size
            else np.empty(0, dtype=self._dtype)
        )

    def __len__(self) -> int:
        return self._len

    def _view(self, i: int) -> np.ndarray:
        itemsize = self._dtype.itemsize
        start = int(self._pointers[i]) // itemsize
        view = np.asarray(self._flat[start : start + int(self._sizes[i])])
        view.flags.writeable = False
        return view

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(self._len)
            if step != 1:
                raise ValueError("slices into an MMapIndexedDataset must be contiguous (step 1)")
            return [self._view(i) for i in range(start, stop)]
        if not is_int(idx):
            raise TypeError(f"MMapIndexedDataset index must be an int or a slice; got {type(idx).__name__}")
        i = int(idx)
        if not -self._len <= i < self._len:
            raise IndexError(f"index {i} out of range for '{self.path_prefix}' with {self._len} items")
        return self._view(i + self._len if i < 0 else i)

    def __iter__(self):
        return (self._view(i) for i in range(self._len))

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    @property
    def flat(self) -> np.ndarray:
        """All items concatenated (the whole ``.bin``), a read-only view."""
        view = np.asarray(self._flat)
        view.flags.writeable = False
        return view

    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix, "dtype_table": self.dtype_table}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path_prefix"], state["dtype_table"])

    def __repr__(self) -> str:
        return f"MMapIndexedDataset('{self.path_prefix}', len={self._len}, dtype={self._dtype})"

    @staticmethod
    def exists(path_prefix: str | os.PathLike) -> bool:
        return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(data_file_path(path_prefix))


def _to_numpy(item: Any) -> np.ndarray:
    if hasattr(item, "detach") and hasattr(item, "cpu"):  # torch.Tensor
        return item.detach().cpu().numpy()
    return np.asarray(item)


class MMapIndexedDatasetBuilder:
    """Writes an ``MMapIndexedDataset`` exactly as DeepSpeed 0.19.8's ``MMapIndexedDatasetBuilder`` does.

    Args:
        bin_path: the ``.bin`` file (created/truncated now).
        dtype: integer item dtype (NumPy, torch or string); floats raise :class:`IndexFileError`.
        dtype_table: code table used by :meth:`finalize` (``"current"`` by default).

    ``add_item(x)`` appends one item (tensor/array/list, flattened in C order, cast to ``dtype`` after a range
    check); ``add_items_flat(flat, sizes)`` appends many items at once; ``end_document()`` appends the current item
    count to ``doc_idx``; ``merge_file_(prefix)`` appends another dataset (same dtype) and its shifted ``doc_idx[1:]``;
    ``finalize(idx_path)`` closes the ``.bin`` and writes the ``.idx``. The builder is a context manager that closes
    the ``.bin`` on error.
    """

    def __init__(self, bin_path: str | os.PathLike, dtype: Any = np.int64, dtype_table: str = "current"):
        self.bin_path = os.fspath(bin_path)
        self.dtype_table = dtype_table
        self._code = dtype_code(dtype, dtype_table, self.bin_path)
        self._dtype = _table(dtype_table)[self._code]
        self._data_file = open(self.bin_path, "wb")
        self._sizes: list[np.ndarray] = []
        self._pending: list[int] = []
        self._count = 0
        self._bytes = 0
        self._doc_idx: list[int] = [0]

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def __len__(self) -> int:
        return self._count

    def __enter__(self) -> MMapIndexedDatasetBuilder:
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._data_file.closed:
            self._data_file.close()

    def _cast(self, arr: np.ndarray) -> np.ndarray:
        if arr.dtype == self._dtype:
            return arr
        if arr.size and arr.dtype.kind not in "iu":
            raise IndexFileError(
                f"'{self.bin_path}': cannot store {arr.dtype} values in a {self._dtype} file; items must be integers"
            )
        if arr.size:
            info = np.iinfo(self._dtype)
            lo, hi = arr.min(), arr.max()
            if lo < info.min or hi > info.max:
                raise IndexFileError(f"'{self.bin_path}': values [{lo}, {hi}] do not fit in {self._dtype}")
        return arr.astype(self._dtype)

    def _flush_pending(self) -> None:
        if self._pending:
            self._sizes.append(np.asarray(self._pending, dtype=np.int64))
            self._pending = []

    def add_item(self, item: Any) -> None:
        """Append one item (any shape; stored flattened)."""
        arr = self._cast(np.ascontiguousarray(_to_numpy(item)).reshape(-1))
        self._data_file.write(arr.astype(self._dtype.newbyteorder("<"), copy=False).tobytes(order="C"))
        self._pending.append(arr.size)
        self._count += 1
        self._bytes += arr.nbytes

    def add_items_flat(self, flat: np.ndarray, sizes: np.ndarray) -> None:
        """Append ``len(sizes)`` items whose concatenation is ``flat`` (``sum(sizes) == len(flat)``), in chunks."""
        sizes = np.asarray(sizes, dtype=np.int64)
        flat = np.asarray(flat).reshape(-1)
        if int(sizes.sum()) != len(flat) or (len(sizes) and int(sizes.min()) < 0):
            raise ValueError(f"add_items_flat: sizes sum to {int(sizes.sum())} but flat has {len(flat)} elements")
        for start in range(0, len(flat), _CHUNK):
            arr = self._cast(np.asarray(flat[start : start + _CHUNK]))
            self._data_file.write(arr.astype(self._dtype.newbyteorder("<"), copy=False).tobytes(order="C"))
            self._bytes += arr.nbytes
        self._flush_pending()
        self._sizes.append(sizes)
        self._count += len(sizes)

    def end_document(self) -> None:
        self._doc_idx.append(self._count)

    def merge_file_(self, other_prefix: str | os.PathLike) -> None:
        """Append the dataset at ``other_prefix`` (same dtype): its items, and ``offset + doc_idx[1:]``.

        The ``.bin`` is flushed and its size checked afterwards (DeepSpeed PR #5106: an unflushed merge left an empty
        memory map).

        Raises:
            IndexFileError: the other file is unreadable or has another dtype; the merged size is wrong.
        """
        other = MMapIndexedDataset(other_prefix, self.dtype_table)
        if other.dtype != self._dtype:
            raise IndexFileError(
                f"'{other.path_prefix}': dtype {other.dtype} differs from the builder's "
                f"{self._dtype} ('{self.bin_path}')"
            )
        offset = self._count
        self._flush_pending()
        self._sizes.append(np.asarray(other.sizes, dtype=np.int64))
        self._count += len(other)
        self._doc_idx.extend(int(x) + offset for x in other.doc_idx[1:])
        with open(data_file_path(other_prefix), "rb") as f:
            while True:
                buf = f.read(1 << 24)
                if not buf:
                    break
                self._data_file.write(buf)
                self._bytes += len(buf)
        self._data_file.flush()
        actual = os.stat(self.bin_path).st_size
        if actual != self._bytes:
            raise IndexFileError(
                f"'{self.bin_path}': {actual} bytes on disk after merging '{other.path_prefix}', expected {self._bytes}"
            )

    def _all_sizes(self) -> np.ndarray:
        self._flush_pending()
        return np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int64)

    def finalize(self, idx_path: str | os.PathLike, fsync: bool = False) -> None:
        """Close the ``.bin`` and write the ``.idx`` (``fsync=True`` also syncs both files to disk)."""
        self._data_file.flush()
        if fsync:
            os.fsync(self._data_file.fileno())
        self._data_file.close()
        write_index_file(idx_path, self._dtype, self._all_sizes(), self._doc_idx, self.dtype_table)
        if fsync:
            fd = os.open(idx_path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
