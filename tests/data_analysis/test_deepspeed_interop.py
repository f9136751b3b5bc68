"""DeepSpeed interoperability: files made by lightning_effi and by deepspeed 0.19.8's
DataAnalyzer / MMapIndexedDatasetBuilder for the same small synthetic data set are byte-identical and read back the
same. Skipped when deepspeed is not importable (it is not a project dependency; e.g. run with
``PYTHONPATH=/path/to/a/deepspeed/site``)."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

ds_an = pytest.importorskip(
    "deepspeed.runtime.data_pipeline.data_sampling.data_analyzer", reason="deepspeed not importable"
)
ds_idx = pytest.importorskip("deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset")

from lightning_effi.curriculum.analysis import (  # noqa: E402
    DTYPES_CURRENT,
    DataAnalyzer,
    MetricIndex,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
)

FILES = ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=257, width=12, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(1, 30, (n, width), generator=g)
        lengths = torch.randint(1, width + 1, (n,), generator=g)
        x[torch.arange(width)[None, :] >= lengths[:, None]] = 0
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


def seqlen_metric(batch):
    return torch.count_nonzero(batch, dim=1).to(torch.int64)


def hist_metric(batch):
    return torch.bincount(batch.reshape(-1), minlength=31)


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


@pytest.mark.parametrize("code", sorted(DTYPES_CURRENT))
def test_builder_bytes_identical(tmp_path, code):
    dtype = DTYPES_CURRENT[code]
    theirs = ds_idx.MMapIndexedDatasetBuilder(str(tmp_path / "ds.bin"), dtype=dtype)
    ours = MMapIndexedDatasetBuilder(tmp_path / "le.bin", dtype)
    for item in ([1, 2, 3], [4], []):
        theirs.add_item(torch.tensor(item, dtype=torch.int64))
        ours.add_item(torch.tensor(item, dtype=torch.int64))
    theirs.end_document()
    ours.end_document()
    theirs.finalize(str(tmp_path / "ds.idx"))
    ours.finalize(tmp_path / "le.idx")
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ds.{ext}").read_bytes() == (tmp_path / f"le.{ext}").read_bytes()
    assert [x.tolist() for x in MMapIndexedDataset(tmp_path / "ds")] == [[1, 2, 3], [4], []]


@pytest.mark.parametrize("threads,reduce_threads", [(1, 1), (2, 2)])
def test_analyzer_outputs_identical(tmp_path, threads, reduce_threads):
    data = Tokens()
    kw = dict(
        num_threads=threads,
        num_threads_reduce=reduce_threads,
        batch_size=10,
        metric_names=["seqlen", "hist"],
        metric_functions=[seqlen_metric, hist_metric],
        metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
        metric_dtypes=[torch.int64, torch.int64],
    )
    ds_an.DataAnalyzer(data, save_path=str(tmp_path / "ds"), **kw).run_map()
    ds_an.DataAnalyzer(data, save_path=str(tmp_path / "ds"), **kw).run_reduce()
    DataAnalyzer(data, save_path=str(tmp_path / "le"), progress=False, **kw).run_map_reduce()
    for name in FILES:
        for ext in ("bin", "idx"):
            a = (tmp_path / "ds" / "seqlen" / f"seqlen_{name}.{ext}").read_bytes()
            b = (tmp_path / "le" / "seqlen" / f"seqlen_{name}.{ext}").read_bytes()
            assert a == b, f"seqlen_{name}.{ext} differs"
    for ext in ("bin", "idx"):
        assert (tmp_path / "ds" / "hist" / f"hist_metric_value.{ext}").read_bytes() == (
            tmp_path / "le" / "hist" / f"hist_metric_value.{ext}"
        ).read_bytes()
    # the index the sampler derives from DeepSpeed's files equals ours and the value / percentile rules on the raw rows
    theirs = MetricIndex.load(
        tmp_path / "ds" / "seqlen" / "seqlen_index_to_sample",
        tmp_path / "ds" / "seqlen" / "seqlen_index_to_metric",
        num_samples=len(data),
    )
    ours = MetricIndex.load(
        tmp_path / "le" / "seqlen" / "seqlen_index_to_sample",
        tmp_path / "le" / "seqlen" / "seqlen_index_to_metric",
        num_samples=len(data),
    )
    assert theirs.fingerprint() == ours.fingerprint()
    ds_rows = ds_idx.MMapIndexedDataset(str(tmp_path / "ds" / "seqlen" / "seqlen_index_to_sample"), skip_warmup=True)
    ds_values = ds_idx.MMapIndexedDataset(
        str(tmp_path / "ds" / "seqlen" / "seqlen_index_to_metric"), skip_warmup=True
    )  # keep both alive: their views die with the mmap
    rows = [np.array(ds_rows[i]) for i in range(len(ds_rows))]
    values = [int(ds_values[i][0]) for i in range(len(ds_values))]
    d = 5  # value difficulty: eligible = rows with value <= d
    formula = np.concatenate([r for r, v in zip(rows, values) if v <= d]).tolist()
    assert ours.ids[: ours.offsets[np.searchsorted(ours.values, d, side="right")]].tolist() == formula
    n, max_d = len(data), 100  # percentile difficulty (DeepSpeed rounding): [spp·p0, spp·p1)
    spp = n // max_d
    flat = np.concatenate(rows)
    assert ours.ids[spp * 10 : spp * 40].tolist() == flat[spp * 10 : spp * 40].tolist()
    assert os.path.exists(tmp_path / "le" / "seqlen" / "analysis_metadata.json")
