"""MetricIndex: in-memory construction, validated loading (ids of another split), stale-file detection."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from lightning_effi.curriculum.analysis import (
    INPROGRESS_NAME,
    METADATA_NAME,
    DataAnalyzer,
    IndexFileError,
    MetricIndex,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
)


def _write_rows(prefix, rows, dtype=np.uint8):
    b = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for r in rows:
        b.add_item(np.asarray(r, dtype=np.int64))
    b.end_document()
    b.finalize(f"{prefix}.idx")
    return str(prefix)


def test_from_sample_to_metric_value_example():
    """Value difficulty example: metric [3,1,4,1,5,9,2,6] -> rows by ascending value, ids ascending within a row."""
    idx = MetricIndex.from_sample_to_metric([3, 1, 4, 1, 5, 9, 2, 6])
    assert idx.values.tolist() == [1, 2, 3, 4, 5, 6, 9]
    assert [r.tolist() for r in idx.rows()] == [[1, 3], [6], [0], [2], [4], [7], [5]]
    assert idx.offsets.tolist() == [0, 2, 3, 4, 5, 6, 7, 8]
    assert idx.ids.dtype == np.int64 and idx.offsets.dtype == np.int64 and idx.values.dtype == np.int64
    eligible = idx.ids[: idx.offsets[np.searchsorted(idx.values, 3, side="right")]]
    assert sorted(eligible.tolist()) == [0, 1, 3, 6]
    assert idx.num_samples == 8 and idx.num_rows == 7
    assert not idx.ids.flags.writeable


def test_fingerprint_is_content_based():
    a = MetricIndex.from_sample_to_metric([3, 1, 4, 1])
    b = MetricIndex(np.array([1, 3, 0, 2]), np.array([0, 2, 3, 4]), np.array([1, 3, 4]))
    assert a.fingerprint() == b.fingerprint() and len(a.fingerprint()) == 16
    assert a.fingerprint() != MetricIndex(a.ids, a.offsets, None).fingerprint()
    assert a.fingerprint() != MetricIndex.from_sample_to_metric([3, 1, 4, 2]).fingerprint()


def test_constructor_validates():
    with pytest.raises(ValueError, match="offsets"):
        MetricIndex(np.array([0, 1]), np.array([0, 1]), None)
    with pytest.raises(ValueError, match="strictly increasing"):
        MetricIndex(np.array([0, 1]), np.array([0, 1, 2]), np.array([2, 2]))
    with pytest.raises(TypeError):
        MetricIndex.from_sample_to_metric(np.array([0.5, 1.0]))


def test_load_percentile_golden_rows(tmp_path):
    s = _write_rows(tmp_path / "s", [[0, 5], [1, 2, 3], [4], [6, 7, 8, 9]])
    m = _write_rows(tmp_path / "m", [[10], [11], [12], [20]])
    idx = MetricIndex.load(s, m, num_samples=10)
    assert idx.ids.tolist() == [0, 5, 1, 2, 3, 4, 6, 7, 8, 9]
    assert idx.offsets.tolist() == [0, 2, 5, 6, 10]
    assert idx.values.tolist() == [10, 11, 12, 20]
    merged = MetricIndex.load(s)
    assert merged.values is None and merged.num_samples == 10


@pytest.mark.parametrize("case", ["length", "range", "dup", "rows", "itemlen", "order", "missing", "suffix"])
def test_load_rejects_bad_files(tmp_path, case):
    rows, vals, n = [[0, 2], [1]], [[1], [2]], 3
    if case == "length":
        n = 4
    elif case == "range":
        rows = [[0, 3], [1]]
    elif case == "dup":
        rows = [[0, 1], [1]]
    elif case == "rows":
        vals = [[1], [2], [3]]
    elif case == "itemlen":
        vals = [[1, 5], [2]]
    elif case == "order":
        vals = [[2], [1]]
    s = _write_rows(tmp_path / "s", rows)
    m = _write_rows(tmp_path / "m", vals)
    name = {"rows": "m", "itemlen": "m", "order": "m"}.get(case, "s")
    if case == "missing":
        os.remove(f"{m}.bin")
    match = {
        "length": "holds 3 sample ids but the data set has 4",
        "range": r"out of range \[0, 3\)",
        "dup": "duplicated",
        "rows": "3 rows",
        "itemlen": "one \\[value\\]",
        "order": "strictly increasing",
        "missing": "m.bin.*not found",
        "suffix": "without",
    }[case]
    with pytest.raises(IndexFileError, match=match) as err:
        MetricIndex.load(f"{s}.bin" if case == "suffix" else s, m, num_samples=n)
    assert (name in str(err.value)) or case in ("missing", "suffix")


class _Rows:
    def __init__(self, n):
        self.x = np.arange(n) % 5

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": np.full((4,), 1) * self.x[i]}


def _metric(batch):
    return batch["input_ids"][:, 0].to(dtype=__import__("torch").int64)


def _analyze(tmp_path, n):
    a = DataAnalyzer(
        _Rows(n),
        batch_size=4,
        metric_names=["v"],
        metric_functions=[_metric],
        metric_types=["single_value_per_sample"],
        metric_dtypes=[np.int64],
        save_path=tmp_path,
        progress=False,
    )
    a.run_map()
    a.run_reduce()
    return str(tmp_path / "v" / "v_index_to_sample"), str(tmp_path / "v" / "v_index_to_metric")


def test_stale_files_from_another_dataset_length(tmp_path):
    s, m = _analyze(tmp_path, 30)
    assert MetricIndex.load(s, m, num_samples=30).num_samples == 30
    with pytest.raises(IndexFileError, match=r"stale analysis.*30 samples.*has 40"):
        MetricIndex.load(s, m, num_samples=40)
    with pytest.raises(IndexFileError, match="stale"):
        MetricIndex.load(s + "_percentile_merged", num_samples=40)
    meta = json.loads((tmp_path / "v" / METADATA_NAME).read_text())
    assert meta["num_samples"] == 30 and meta["metric_name"] == "v"


def test_modified_file_detected_by_digest(tmp_path):
    s, m = _analyze(tmp_path, 30)
    raw = bytearray(open(f"{s}.bin", "rb").read())
    raw[0], raw[1] = raw[1], raw[0]  # same length, same ids, different order
    open(f"{s}.bin", "wb").write(bytes(raw))
    with pytest.raises(IndexFileError, match="does not match"):
        MetricIndex.load(s, m, num_samples=30)


def test_interrupted_publish_detected(tmp_path):
    s, m = _analyze(tmp_path, 30)
    (tmp_path / "v" / INPROGRESS_NAME).write_text("{}")
    with pytest.raises(IndexFileError, match="interrupted"):
        MetricIndex.load(s, m, num_samples=30)


def test_files_without_metadata_validated_by_content(tmp_path):
    s, m = _analyze(tmp_path, 30)
    os.remove(tmp_path / "v" / METADATA_NAME)
    idx = MetricIndex.load(s, m, num_samples=30)
    assert idx.values.tolist() == [0, 1, 2, 3, 4]
    assert MMapIndexedDataset(s).dtype == np.uint8
    with pytest.raises(IndexFileError, match="holds 30"):
        MetricIndex.load(s, m, num_samples=31)
