"""DataAnalyzer map/reduce: sample ids for every batch structure, partitions, the reduce's files, accumulate metrics,
re-runnable partitions, and the DeepSpeed analyzer defects it avoids (ragged accumulate batches, float metrics, tuple
batches, a reduce before the maps finished, invalid splits, fewer than 100 distinct values)."""

from __future__ import annotations

import json
import os
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from lightning_effi.curriculum.analysis import (
    AnalyzerError,
    DataAnalyzer,
    MetricIndex,
    MMapIndexedDataset,
    split_dataset,
    split_index,
)

N = 50
SINGLE = "single_value_per_sample"
ACC = "accumulate_value_over_samples"


def _tokens(n=N, width=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 20, (n, width), generator=g)


def value_of(tokens: torch.Tensor) -> torch.Tensor:
    """Metric on a token matrix [B, T]: row sum mod 7 (many ties)."""
    return tokens.sum(dim=-1) % 7


class TensorDS:
    def __init__(self, n=N):
        self.x = _tokens(n)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


class TupleDS(TensorDS):
    def __getitem__(self, i):
        return (self.x[i], torch.tensor(i % 2))


class ListDS(TensorDS):
    def __getitem__(self, i):
        return [self.x[i], torch.tensor(1), torch.tensor(2)]


class DictDS(TensorDS):
    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": torch.tensor(0)}


class BatchedDS(TensorDS):
    """Batched fetching: __getitems__ returns the [B, T] matrix directly (used with passthrough collate)."""

    def __getitems__(self, indices):
        return self.x[torch.as_tensor(indices)]


Batch = namedtuple("Batch", ["tokens", "size"])


def custom_collate(samples):
    """Custom collate: a namedtuple (len 2, whatever B is)."""
    return Batch(torch.stack([s["input_ids"] for s in samples]), len(samples))


def passthrough(x):
    return x


def metric_tensor(batch):
    return value_of(batch)


def metric_first_field(batch):
    return value_of(batch[0])


def metric_dict(batch):
    return value_of(batch["input_ids"])


def metric_custom(batch):
    return value_of(batch.tokens)


def _expected(ds):
    return np.array([int(value_of(ds.x[i][None])[0]) for i in range(len(ds))])


def _analyzer(ds, fn, tmp_path, **kw):
    args = dict(
        batch_size=4,
        metric_names=["v"],
        metric_functions=[fn],
        metric_types=[SINGLE],
        metric_dtypes=[np.int64],
        save_path=str(tmp_path),
        progress=False,
    )
    args.update(kw)
    return DataAnalyzer(ds, **args)


def _read_s2m(tmp_path, m="v"):
    return np.array(MMapIndexedDataset(tmp_path / m / f"{m}_sample_to_metric").flat, dtype=np.int64)


def _rows(tmp_path, m="v", merged=False):
    prefix = tmp_path / m / (f"{m}_index_to_sample" + ("_percentile_merged" if merged else ""))
    return [r.tolist() for r in MMapIndexedDataset(prefix)]


STRUCTURES = [
    (TensorDS, metric_tensor, None),
    (TupleDS, metric_first_field, None),
    (ListDS, metric_first_field, None),
    (DictDS, metric_dict, None),
    (DictDS, metric_custom, custom_collate),
    (BatchedDS, metric_tensor, passthrough),
]


@pytest.mark.parametrize("batch_size", [1, 3, 7, 16, 64])
@pytest.mark.parametrize("structure", STRUCTURES, ids=lambda s: f"{s[0].__name__}-{s[1].__name__}")
def test_ids_equal_positions_for_every_batch_structure(tmp_path, structure, batch_size):
    """sample_to_metric[i] == metric(dataset[i]) for all i; index_to_sample rows form a permutation."""
    cls, fn, collate = structure
    ds = cls()
    a = _analyzer(ds, fn, tmp_path, batch_size=batch_size, collate_fn=collate)
    a.run_map()
    a.run_reduce()
    expected = _expected(ds)
    assert _read_s2m(tmp_path).tolist() == expected.tolist()
    rows = _rows(tmp_path)
    assert sorted(sum(rows, [])) == list(range(N))
    assert (
        MetricIndex.load(
            tmp_path / "v" / "v_index_to_sample", tmp_path / "v" / "v_index_to_metric", num_samples=N
        ).fingerprint()
        == MetricIndex.from_sample_to_metric(expected).fingerprint()
    )


def test_index_field_and_sample_indices_remap(tmp_path):
    perm = np.random.default_rng(0).permutation(N)

    class Indexed(DictDS):
        def __getitem__(self, i):
            return {"input_ids": self.x[i], "index": torch.tensor([int(perm[i])])}  # Megatron: index[B, 1]

    ds = Indexed()
    a = _analyzer(ds, metric_dict, tmp_path / "a", batch_size=6)
    a.run_map()
    a.run_reduce()
    by_id = np.empty(N, dtype=np.int64)
    by_id[perm] = _expected(ds)
    assert _read_s2m(tmp_path / "a").tolist() == by_id.tolist()
    b = _analyzer(DictDS(), metric_dict, tmp_path / "b", batch_size=6, sample_indices=perm)
    b.run_map()
    b.run_reduce()
    assert _read_s2m(tmp_path / "b").tolist() == by_id.tolist()
    with pytest.raises(ValueError, match="permutation"):
        _analyzer(DictDS(), metric_dict, tmp_path / "c", sample_indices=np.zeros(N, dtype=int))


def test_partitions_golden_and_n_smaller_than_workers(tmp_path):
    """DeepSpeed's ``split_index`` boundaries; fewer samples than partitions works."""
    assert split_index(0, 20, 4) == [(0, 5), (5, 10), (10, 15), (15, 20)]
    _, threads = split_dataset(20, 4, 1, 8)
    assert threads == [(5, 5), (5, 6), (6, 6), (6, 7), (7, 8), (8, 8), (8, 9), (9, 10)]
    ds = TensorDS(3)
    for w in range(4):
        _analyzer(ds, metric_tensor, tmp_path, num_workers=4, worker_id=w).run_map()
    _analyzer(ds, metric_tensor, tmp_path, num_workers=4, worker_id=0).run_reduce()
    assert _read_s2m(tmp_path).tolist() == _expected(ds).tolist()
    # N = 3 with 4 workers × 3 threads (most partitions empty), the map in worker processes
    for w in range(4):
        _analyzer(ds, metric_tensor, tmp_path / "t", num_workers=4, worker_id=w, num_threads=3).run_map()
    _analyzer(ds, metric_tensor, tmp_path / "t", num_workers=4, num_threads=3).run_reduce()
    assert _read_s2m(tmp_path / "t").tolist() == _expected(ds).tolist()


def test_worker_processes_and_specific_threads(tmp_path):
    """Arbitrary partition subsets are re-runnable (``specific_threads``); two workers × three local processes give
    the single-process result."""
    ds = DictDS(101)
    _analyzer(ds, metric_dict, tmp_path, num_workers=2, worker_id=0, num_threads=3, batch_size=5).run_map()
    # worker 1: run thread 2 first, then the rest
    b = _analyzer(ds, metric_dict, tmp_path, num_workers=2, worker_id=1, num_threads=3, specific_threads=[2])
    assert [r["thread_id"] for r in b.run_map()] == [2]
    with pytest.raises(AnalyzerError, match=r"worker1_thread0: missing.*worker_id=1 specific_threads=\[0, 1\]"):
        _analyzer(ds, metric_dict, tmp_path, num_workers=2, num_threads=3).run_reduce()
    _analyzer(ds, metric_dict, tmp_path, num_workers=2, worker_id=1, num_threads=3, specific_threads=[0, 1]).run_map()
    _analyzer(ds, metric_dict, tmp_path, num_workers=2, num_threads=3).run_reduce()
    assert _read_s2m(tmp_path).tolist() == _expected(ds).tolist()
    assert not [p for p in os.listdir(tmp_path / "v") if p.startswith("worker")]  # temps deleted


@pytest.mark.slow
def test_spawn_start_method(tmp_path):
    ds = DictDS(40)
    a = _analyzer(ds, metric_dict, tmp_path, num_threads=2, start_method="spawn", batch_size=8)
    res = a.run_map()
    assert sum(r["count"] for r in res) == 40
    a.run_reduce()
    assert _read_s2m(tmp_path).tolist() == _expected(ds).tolist()


def test_reduce_merge_step_and_rows(tmp_path):
    """3 distinct values -> 3 merged rows; 250 distinct values -> merge_step 2, 125 rows."""
    ds3 = DictDS(60)
    _analyzer(ds3, lambda b: b["input_ids"][:, 0] % 3, tmp_path / "a", batch_size=9).run_map()
    _analyzer(ds3, lambda b: b["input_ids"][:, 0] % 3, tmp_path / "a").run_reduce()
    merged = _rows(tmp_path / "a", merged=True)
    assert len(merged) == 3 and merged == _rows(tmp_path / "a")
    meta = json.loads((tmp_path / "a" / "v" / "analysis_metadata.json").read_text())
    assert meta["merge_step"] == 1 and meta["num_distinct_values"] == 3

    class Ranked(DictDS):
        def __getitem__(self, i):
            return {"input_ids": torch.tensor([i % 250, 1000 + i])}

    def rank(b):
        return b["input_ids"][:, 0].numpy().astype(np.int64)  # numpy output

    ds = Ranked(500)
    a = _analyzer(ds, rank, tmp_path / "b", batch_size=33)
    a.run_map()
    meta = a.run_reduce()["v"]
    assert meta["merge_step"] == 2 and meta["merged_rows"] == 125
    merged = _rows(tmp_path / "b", merged=True)
    assert len(merged) == 125
    assert merged[0] == [0, 250, 1, 251]
    assert sum(len(r) for r in merged) == 500
    idx = MetricIndex.load(
        tmp_path / "b" / "v" / "v_index_to_sample", tmp_path / "b" / "v" / "v_index_to_metric", num_samples=500
    )
    assert idx.values.tolist() == list(range(250))
    assert np.all(np.diff(idx.values) > 0)
    assert idx.row(7).tolist() == [7, 257]
    assert MMapIndexedDataset(tmp_path / "b" / "v" / "v_index_to_sample").dtype == np.uint16  # ids up to 499
    assert MMapIndexedDataset(tmp_path / "b" / "v" / "v_index_to_metric").dtype == np.uint8


@pytest.mark.parametrize("declared", [np.int64, torch.int64, "int64"])
@pytest.mark.parametrize("returns", ["numpy", "torch"])
def test_numpy_and_torch_int64_equivalent(tmp_path, declared, returns):
    def fn(b):
        v = value_of(b["input_ids"])
        return v.numpy() if returns == "numpy" else v

    a = _analyzer(DictDS(), fn, tmp_path, metric_dtypes=[declared])
    a.run_map()
    a.run_reduce()
    assert _read_s2m(tmp_path).tolist() == _expected(DictDS()).tolist()


def test_float_metric_raises_naming_it(tmp_path):
    a = _analyzer(DictDS(), lambda b: b["input_ids"].float().mean(1), tmp_path, metric_names=["meanval"])
    with pytest.raises(TypeError, match="metric 'meanval'.*float32.*integers"):
        a.run_map()
    with pytest.raises(TypeError, match=r"metric_dtypes\['v'\].*float64"):
        _analyzer(DictDS(), metric_dict, tmp_path, metric_dtypes=[np.float64])
    with pytest.raises(TypeError, match="float32"):
        _analyzer(DictDS(), metric_dict, tmp_path, metric_dtypes=[torch.float32])


def test_per_sample_shape_and_dtype_range_validated(tmp_path):
    a = _analyzer(DictDS(), lambda b: value_of(b["input_ids"])[:, None], tmp_path)
    with pytest.raises(ValueError, match=r"returned shape \(4, 1\).*expected \(4,\)"):
        a.run_map()
    a = _analyzer(DictDS(), lambda b: value_of(b["input_ids"]) + 300, tmp_path, metric_dtypes=[np.uint8])
    with pytest.raises(ValueError, match="outside its declared metric_dtype uint8"):
        a.run_map()


def test_accumulate_histogram(tmp_path):
    """Accumulate metric: 1004 samples, batch 3, (V+1,) histogram == full-data histogram; per-sample return raises."""
    V = 19
    ds = DictDS(1004)

    def hist(b):
        return torch.bincount(b["input_ids"].reshape(-1), minlength=V + 1)

    a = _analyzer(ds, hist, tmp_path, batch_size=3, metric_names=["hist"], metric_types=[ACC])
    a.run_map()
    a.run_reduce()
    out = MMapIndexedDataset(tmp_path / "hist" / "hist_metric_value")
    assert len(out) == 1 and out.doc_idx.tolist() == [0, 1]
    assert out[0].tolist() == np.bincount(ds.x.reshape(-1).numpy(), minlength=V + 1).tolist()
    assert out.dtype == np.uint16  # fitted: counts up to a few hundred
    # per-sample shaped "accumulate" metric: caught at the ragged last batch (1004 = 3·334 + 2)
    bad = _analyzer(ds, lambda b: value_of(b["input_ids"]), tmp_path / "bad", batch_size=3, metric_types=[ACC])
    with pytest.raises(ValueError, match=r"shape \(2,\).*after \(3,\).*per-sample shaped"):
        bad.run_map()


def test_accumulate_shapes_compared_across_partitions(tmp_path):
    def rows_as_accumulate(b):
        return value_of(b["input_ids"])

    # 4 processes × batches of 4 that always divide their partition (48 = 4 × 12): each partition looks consistent
    ds = DictDS(48)
    a = _analyzer(ds, rows_as_accumulate, tmp_path, batch_size=4, metric_types=[ACC], num_threads=4)
    a.run_map()
    meta = a.run_reduce()  # shapes (4,) everywhere: undetectable, documented limitation
    assert meta["v"]["shape"] == [4]
    b = _analyzer(
        ds, rows_as_accumulate, tmp_path / "b", batch_size=12, metric_types=[ACC], num_threads=2, specific_threads=[0]
    )
    b.run_map()
    c = _analyzer(
        ds, rows_as_accumulate, tmp_path / "b", batch_size=8, metric_types=[ACC], num_threads=2, specific_threads=[1]
    )
    c.run_map()
    with pytest.raises(AnalyzerError, match="produced shape"):
        _analyzer(ds, rows_as_accumulate, tmp_path / "b", metric_types=[ACC], num_threads=2).run_reduce()


def failing_metric(batch):
    if bool((batch["input_ids"][:, -1] == -5).any()):
        raise RuntimeError("boom")
    return value_of(batch["input_ids"])


class PoisonDS(DictDS):
    """Sample 45 (in thread 1 of 2) makes failing_metric raise."""

    def __getitem__(self, i):
        x = self.x[i].clone()
        if i == 45 and getattr(self, "poison", True):
            x[-1] = -5
        return {"input_ids": x, "labels": torch.tensor(0)}


def test_failed_partition_reported_and_never_merged(tmp_path):
    ds = PoisonDS()
    a = _analyzer(ds, failing_metric, tmp_path, num_threads=2, batch_size=5)
    with pytest.raises(AnalyzerError, match=r"worker0_thread1: RuntimeError: boom.*specific_threads=\[1\]"):
        a.run_map()
    assert os.path.exists(tmp_path / "v" / "worker0_thread1" / "map_failed.json")
    assert os.path.exists(tmp_path / "v" / "worker0_thread0" / "map_done.json")
    with pytest.raises(AnalyzerError, match=r"worker0_thread1: failed \(RuntimeError: boom\)"):
        a.run_reduce()
    assert not os.path.exists(tmp_path / "v" / "v_index_to_sample.idx")
    ds.poison = False
    _analyzer(ds, failing_metric, tmp_path, num_threads=2, specific_threads=[1]).run_map()
    _analyzer(ds, failing_metric, tmp_path, num_threads=2).run_reduce()
    assert _read_s2m(tmp_path).tolist() == _expected(ds).tolist()


def dying_metric(batch):
    if int(batch["labels"][0]) == 1:
        os._exit(3)
    return value_of(batch["input_ids"])


class DieDS(DictDS):
    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": torch.tensor(int(i >= 40))}


def test_dead_worker_process_does_not_hang(tmp_path):
    a = _analyzer(DieDS(), dying_metric, tmp_path, num_threads=2, batch_size=5)
    with pytest.raises(AnalyzerError, match="died|terminated"):
        a.run_map()
    with pytest.raises(AnalyzerError, match="worker0_thread1"):
        a.run_reduce()


def test_stale_and_partial_partitions_detected(tmp_path):
    _analyzer(TensorDS(40), metric_tensor, tmp_path, num_threads=2, keep_temp=True).run_map()
    # a later run over a data set of another length finds the old partitions: stale, never merged
    with pytest.raises(AnalyzerError, match="stale"):
        _analyzer(TensorDS(41), metric_tensor, tmp_path, num_threads=2).run_reduce()
    # another metric function is another run too
    with pytest.raises(AnalyzerError, match="stale"):
        _analyzer(TensorDS(40), metric_first_field, tmp_path, num_threads=2).run_reduce()
    # partial output (values file lost) is detected
    os.remove(tmp_path / "v" / "worker0_thread1" / "v_values.npy")
    with pytest.raises(AnalyzerError, match="worker0_thread1: partial"):
        _analyzer(TensorDS(40), metric_tensor, tmp_path, num_threads=2).run_reduce()
    _analyzer(TensorDS(40), metric_tensor, tmp_path, num_threads=2, specific_threads=[1], keep_temp=True).run_map()
    _analyzer(TensorDS(40), metric_tensor, tmp_path, num_threads=2, keep_temp=True).run_reduce()
    assert os.path.exists(tmp_path / "v" / "worker0_thread1" / "map_done.json")  # keep_temp


def test_duplicate_ids_from_index_field_rejected(tmp_path):
    class Dup(DictDS):
        def __getitem__(self, i):
            return {"input_ids": self.x[i], "index": torch.tensor(i // 2)}

    a = _analyzer(Dup(), metric_dict, tmp_path)
    a.run_map()
    with pytest.raises(AnalyzerError, match="not a permutation"):
        a.run_reduce()

    class Out(DictDS):
        def __getitem__(self, i):
            return {"input_ids": self.x[i], "index": torch.tensor(i + 100)}

    with pytest.raises(ValueError, match="out of range"):
        _analyzer(Out(), metric_dict, tmp_path / "o").run_map()


def test_deepspeed_file_names_and_doc_idx(tmp_path):
    ds = TensorDS(30)
    a = _analyzer(ds, metric_tensor, tmp_path, num_threads=2, num_threads_reduce=2, batch_size=4)
    a.run_map()
    a.run_reduce()
    files = sorted(os.listdir(tmp_path / "v"))
    assert files == sorted(
        ["analysis_metadata.json"]
        + [
            f"v_{k}.{e}"
            for k in ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged")
            for e in ("bin", "idx")
        ]
    )
    s2m = MMapIndexedDataset(tmp_path / "v" / "v_sample_to_metric")
    assert s2m.doc_idx.tolist() == [0, 15, 30, 30]  # two reduce chunks of the two map partitions
    rows = len(MMapIndexedDataset(tmp_path / "v" / "v_index_to_metric"))
    half = split_index(0, rows, 2)[0][1]
    assert MMapIndexedDataset(tmp_path / "v" / "v_index_to_sample").doc_idx.tolist() == [0, half, rows, rows]
    assert MMapIndexedDataset(tmp_path / "v" / "v_index_to_sample_percentile_merged").doc_idx.tolist() == [0, rows]
    assert s2m.dtype == np.uint8 and set(s2m.sizes.tolist()) == {1}


def test_bad_arguments(tmp_path):
    ds = TensorDS()
    with pytest.raises(ValueError, match="worker_id"):
        _analyzer(ds, metric_tensor, tmp_path, num_workers=2, worker_id=2)
    with pytest.raises(ValueError, match="specific_threads"):
        _analyzer(ds, metric_tensor, tmp_path, specific_threads=[3])
    with pytest.raises(ValueError, match="metric_types"):
        _analyzer(ds, metric_tensor, tmp_path, metric_types=["per_sample"])
    with pytest.raises(ValueError, match="same length"):
        _analyzer(ds, metric_tensor, tmp_path, metric_names=["a", "b"])
    # an unknown registered name: a ValueError naming the parameter and the metric (was a bare KeyError)
    with pytest.raises(ValueError, match=r"DataAnalyzer\.metric_functions \(metric 'v'\): unknown metric 'nope'; "):
        _analyzer(ds, "nope", tmp_path)
    with pytest.raises(ValueError, match="empty"):
        _analyzer(TensorDS(0), metric_tensor, tmp_path)
    with pytest.raises(ValueError, match="batch_size"):
        _analyzer(ds, metric_tensor, tmp_path, batch_size=0)


def test_registry_name_and_default_collate_dict(tmp_path):
    ds = DictDS()
    ds.x[:, 4:] = 0  # padding
    ds.x[:10, 3] = 0
    a = _analyzer(ds, "seqlen", tmp_path, metric_names=["seqlen"])
    a.run_map()
    a.run_reduce()
    assert _read_s2m(tmp_path, "seqlen").tolist() == (ds.x != 0).sum(1).tolist()


def test_map_reduce_single_call_and_default_collate(tmp_path):
    ds = TensorDS()
    meta = _analyzer(ds, metric_tensor, tmp_path).run_map_reduce()
    assert meta["v"]["num_samples"] == N
    assert _read_s2m(tmp_path).tolist() == _expected(ds).tolist()
    assert default_collate  # the documented default


class AugmentedDS(TensorDS):
    """Augments in ``__getitem__`` (a torchvision-style random transform): the first token is drawn at each fetch."""

    def __getitem__(self, i):
        x = self.x[i].clone()
        x[0] = int(torch.randint(0, 1000, ()))
        return x


def test_a_dataset_that_augments_at_random_is_refused(tmp_path):
    """Each sample's difficulty would be one random draw of its augmentation (qa51-vision 01); refused before any file
    is written, naming the dataset. The same samples without the random transform analyse as before."""
    ds = AugmentedDS()
    with pytest.raises(
        AnalyzerError, match=r"DataAnalyzer metric 'v': the dataset \(AugmentedDS\) gives other samples"
    ):
        _analyzer(ds, metric_tensor, tmp_path).run_map()
    assert not any(tmp_path.iterdir())
    plain = TensorDS()
    _analyzer(plain, metric_tensor, tmp_path).run_map_reduce()
    assert _read_s2m(tmp_path).tolist() == _expected(plain).tolist()
