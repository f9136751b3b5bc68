"""MMapIndexedDataset format (DeepSpeed ``data_sampling/indexed_dataset.py``): round trip, header, dtype tables."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from lightning_effi.curriculum.analysis import (
    DTYPES_CURRENT,
    DTYPES_LEGACY,
    IndexFileError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    find_fit_int_dtype,
)

ITEMS = [[1, 2, 3], [4], []]


def _write(prefix, dtype, items=ITEMS, table="current"):
    b = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype, dtype_table=table)
    for it in items:
        b.add_item(torch.tensor(it, dtype=torch.int64))
    b.end_document()
    b.finalize(f"{prefix}.idx")
    return prefix


@pytest.mark.parametrize("code", sorted(DTYPES_CURRENT))
def test_round_trip_and_golden_header_every_current_dtype(tmp_path, code):
    """Round trip: items [1,2,3], [4], [] for every dtype of the current table; header bytes at 0/9/17/18/26."""
    dtype = DTYPES_CURRENT[code]
    prefix = _write(tmp_path / "x", dtype)
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 3 and ds.dtype == dtype
    assert [ds[i].tolist() for i in range(3)] == ITEMS
    assert ds[-3].tolist() == [1, 2, 3]
    assert all(ds[i].dtype == dtype for i in range(3))
    raw = (tmp_path / "x.idx").read_bytes()
    it = dtype.itemsize
    assert raw[0:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == code
    assert struct.unpack("<Q", raw[18:26]) == (3,)
    assert struct.unpack("<Q", raw[26:34]) == (2,)  # doc_idx [0, len] for a directly written file
    assert np.frombuffer(raw[34:46], "<i4").tolist() == [3, 1, 0]
    assert np.frombuffer(raw[46:70], "<i8").tolist() == [0, 3 * it, 4 * it]  # exclusive cumsum of size*itemsize
    assert np.frombuffer(raw[70:86], "<i8").tolist() == [0, 3]
    assert len(raw) == 34 + 12 * 3 + 8 * 2
    # the .bin is the raw little-endian concatenation, no header
    assert (tmp_path / "x.bin").read_bytes() == np.array([1, 2, 3, 4], dtype=dtype.newbyteorder("<")).tobytes()
    assert ds.sizes.tolist() == [3, 1, 0] and ds.doc_idx.tolist() == [0, 3]


def test_views_are_zero_copy_and_read_only(tmp_path):
    ds = MMapIndexedDataset(_write(tmp_path / "x", np.int32))
    view = ds[0]
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0] = 5
    assert [v.tolist() for v in ds[0:2]] == [[1, 2, 3], [4]]
    with pytest.raises(ValueError, match="contiguous"):
        ds[0:3:2]
    with pytest.raises(IndexError):
        ds[3]
    assert ds.flat.tolist() == [1, 2, 3, 4]


def test_merge_file_doc_idx_as_deepspeed(tmp_path):
    """A file merged from one chunk has doc_idx [0, len, len]; from two chunks [0, c1, c1+c2, len]."""
    a = _write(tmp_path / "a", np.uint8)
    b = _write(tmp_path / "b", np.uint8, items=[[7, 8]])
    m = MMapIndexedDatasetBuilder(tmp_path / "m1.bin", np.uint8)
    m.merge_file_(a)
    m.end_document()
    m.finalize(tmp_path / "m1.idx")
    one = MMapIndexedDataset(tmp_path / "m1")
    assert one.doc_idx.tolist() == [0, 3, 3]
    assert [x.tolist() for x in one] == ITEMS
    m = MMapIndexedDatasetBuilder(tmp_path / "m2.bin", np.uint8)
    m.merge_file_(a)
    m.merge_file_(b)
    m.end_document()
    m.finalize(tmp_path / "m2.idx")
    two = MMapIndexedDataset(tmp_path / "m2")
    assert two.doc_idx.tolist() == [0, 3, 4, 4]
    assert [x.tolist() for x in two] == ITEMS + [[7, 8]]
    assert two.pointers.tolist() == [0, 3, 4, 4]
    # another dtype cannot be merged
    m = MMapIndexedDatasetBuilder(tmp_path / "m3.bin", np.int64)
    with pytest.raises(IndexFileError, match="dtype"):
        m.merge_file_(a)


def test_add_items_flat_equals_add_item(tmp_path):
    _write(tmp_path / "a", np.uint16)
    b = MMapIndexedDatasetBuilder(tmp_path / "b.bin", np.uint16)
    b.add_items_flat(np.array([1, 2, 3, 4]), np.array([3, 1, 0]))
    b.end_document()
    b.finalize(tmp_path / "b.idx")
    assert (tmp_path / "a.idx").read_bytes() == (tmp_path / "b.idx").read_bytes()
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


def test_dtype_tables_code_8_and_9(tmp_path):
    """Dtype tables: code 8 is uint64 (current) and uint16 (legacy); code 9 under the current table is a clear error."""
    assert DTYPES_CURRENT[8] == np.uint64 and DTYPES_LEGACY[8] == np.uint16
    assert sorted(DTYPES_CURRENT) == list(range(1, 9)) and 9 not in DTYPES_CURRENT
    cur = _write(tmp_path / "cur", np.uint64)
    assert (tmp_path / "cur.idx").read_bytes()[17] == 8
    assert MMapIndexedDataset(cur).dtype == np.uint64
    assert MMapIndexedDataset(cur)[0].tolist() == [1, 2, 3]
    leg = _write(tmp_path / "leg", np.uint16, table="legacy")
    assert (tmp_path / "leg.idx").read_bytes()[17] == 8
    assert MMapIndexedDataset(leg, dtype_table="legacy").dtype == np.uint16
    assert MMapIndexedDataset(leg, dtype_table="legacy")[0].tolist() == [1, 2, 3]
    # read with the wrong table, the sizes no longer match: detected, not silently misread
    with pytest.raises(IndexFileError, match="leg"):
        MMapIndexedDataset(leg, dtype_table="current")
    c9 = _write(tmp_path / "c9", np.uint32, table="legacy")
    assert (tmp_path / "c9.idx").read_bytes()[17] == 9
    with pytest.raises(IndexFileError, match=r"c9\.idx.*unknown dtype code 9"):
        MMapIndexedDataset(c9)
    assert MMapIndexedDataset(c9, dtype_table="legacy")[1].tolist() == [4]
    with pytest.raises(ValueError, match="dtype_table"):
        MMapIndexedDataset(c9, dtype_table="megatron")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, torch.float32, "float64", np.bool_])
def test_float_dtypes_cannot_be_written(tmp_path, dtype):
    with pytest.raises(IndexFileError, match="x.bin"):
        MMapIndexedDatasetBuilder(tmp_path / "x.bin", dtype)


def test_builder_rejects_float_items_and_overflow(tmp_path):
    b = MMapIndexedDatasetBuilder(tmp_path / "x.bin", np.uint8)
    with pytest.raises(IndexFileError, match="integers"):
        b.add_item(torch.tensor([1.5]))
    with pytest.raises(IndexFileError, match="do not fit"):
        b.add_item(np.array([256]))
    with pytest.raises(IndexFileError, match="do not fit"):
        b.add_item(np.array([-1]))


def test_torch_and_numpy_dtypes_equivalent(tmp_path):
    _write(tmp_path / "a", torch.int16)
    _write(tmp_path / "b", np.int16)
    _write(tmp_path / "c", "int16")
    assert (tmp_path / "a.idx").read_bytes() == (tmp_path / "b.idx").read_bytes() == (tmp_path / "c.idx").read_bytes()


def test_reader_errors_name_the_file(tmp_path):
    prefix = _write(tmp_path / "x", np.int64)
    idx, bin_ = tmp_path / "x.idx", tmp_path / "x.bin"
    good = idx.read_bytes()
    with pytest.raises(IndexFileError, match="nothere.idx.*not found"):
        MMapIndexedDataset(tmp_path / "nothere")
    idx.write_bytes(b"XXXXXXXXX" + good[9:])
    with pytest.raises(IndexFileError, match="x.idx.*magic"):
        MMapIndexedDataset(prefix)
    idx.write_bytes(good[:9] + struct.pack("<Q", 2) + good[17:])
    with pytest.raises(IndexFileError, match="x.idx.*version 2"):
        MMapIndexedDataset(prefix)
    idx.write_bytes(good[:-5])
    with pytest.raises(IndexFileError, match="x.idx.*truncated"):
        MMapIndexedDataset(prefix)
    idx.write_bytes(good[:20])
    with pytest.raises(IndexFileError, match="x.idx.*truncated"):
        MMapIndexedDataset(prefix)
    idx.write_bytes(good)
    data = bin_.read_bytes()
    bin_.write_bytes(data[:-8])
    with pytest.raises(IndexFileError, match="x.bin.*truncated"):
        MMapIndexedDataset(prefix)
    bin_.write_bytes(data)
    bad_ptr = bytearray(good)
    bad_ptr[34 + 12 + 8] = 9  # second pointer
    idx.write_bytes(bytes(bad_ptr))
    with pytest.raises(IndexFileError, match="pointers"):
        MMapIndexedDataset(prefix)


def test_empty_dataset_round_trip(tmp_path):
    b = MMapIndexedDatasetBuilder(tmp_path / "e.bin", np.uint8)
    b.end_document()
    b.finalize(tmp_path / "e.idx")
    ds = MMapIndexedDataset(tmp_path / "e")
    assert len(ds) == 0 and ds.doc_idx.tolist() == [0, 0] and ds.flat.size == 0


def test_find_fit_int_dtype():
    assert find_fit_int_dtype(0, 255) == np.uint8
    assert find_fit_int_dtype(0, 256) == np.uint16
    assert find_fit_int_dtype(0, 65535) == np.uint16
    assert find_fit_int_dtype(0, 65536) == np.uint32
    assert find_fit_int_dtype(0, 4294967295) == np.uint32
    assert find_fit_int_dtype(0, 4294967296) == np.uint64
    assert find_fit_int_dtype(-1, 127) == np.int8
    assert find_fit_int_dtype(-129, 0) == np.int16
    assert find_fit_int_dtype(-1, 32768) == np.int32
    assert find_fit_int_dtype(-1, 2**31) == np.int64
