"""DeepSpeed parity without DeepSpeed: ``tests/data_analysis/deepspeed_files/`` holds index files written by
DeepSpeed 0.19.8's ``DataAnalyzer`` and ``MMapIndexedDatasetBuilder`` (made by
``experiments/tools/make_deepspeed_index_files.py``, described by its ``MANIFEST.json``). Here lightning_effi's
analyzer and builder rerun the same recipe and must write byte-identical files, and its readers (``MMapIndexedDataset``,
``MetricIndex``, the curriculum's index loading) must read DeepSpeed's files to the values computed here from the data
set. The manifest's digests pin the files: a file regenerated (or edited) without updating the manifest fails."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_effi.callbacks import Curriculum
from lightning_effi.curriculum.analysis import DataAnalyzer, MetricIndex, MMapIndexedDataset, MMapIndexedDatasetBuilder
from lightning_effi.data import CurriculumDataModule
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TinyDataModule, tiny_gpt2

ROOT = Path(__file__).resolve().parents[2]
FILES = Path(__file__).resolve().parent / "deepspeed_files"
SCRIPT = ROOT / "experiments" / "tools" / "make_deepspeed_index_files.py"


def _load_script():
    """The generator script as a module (it imports DeepSpeed only in ``main``); registered in ``sys.modules`` so its
    metric functions pickle by reference in the analyzer's worker processes."""
    name = "make_deepspeed_index_files"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gen = _load_script()
MANIFEST = json.loads((FILES / "MANIFEST.json").read_text())
RECIPE = {k: MANIFEST["recipe"][k] for k in ("num_samples", "width", "vocab", "seed")}
N = RECIPE["num_samples"]
SINGLE = [m for m, t in zip(MANIFEST["metrics"]["names"], MANIFEST["metrics"]["types"]) if t.startswith("single")]
PLAIN_CONFIGS = sorted(c for c, cfg in MANIFEST["configs"].items() if "sample_indices" not in cfg)
SI_CONFIGS = sorted(c for c, cfg in MANIFEST["configs"].items() if "sample_indices" in cfg)


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return gen.make_tokens(**RECIPE)


@pytest.fixture(scope="module")
def expected(tokens) -> dict[str, np.ndarray]:
    """Per-sample metric values computed here with numpy from the token matrix (not by any analyzer)."""
    weights = np.arange(1, tokens.shape[1] + 1, dtype=np.int64)
    return {
        "seqlen": (tokens != 0).sum(axis=1).astype(np.int64),
        "wsum": (tokens * weights).sum(axis=1) - MANIFEST["recipe"]["wsum_offset"],
        "hist": np.bincount(tokens.reshape(-1), minlength=RECIPE["vocab"] + 1).astype(np.int64),
    }


def rows_of(values: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """DeepSpeed's reduce by hand: one row per distinct value (ascending), the ids of that value ascending."""
    uniq = np.unique(values)
    return [np.flatnonzero(values == v).astype(np.int64) for v in uniq], uniq


def fitted(lo: int, hi: int) -> np.dtype:
    """DeepSpeed ``find_fit_int_dtype``, written out."""
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64) if lo >= 0 else (np.int8, np.int16, np.int32, np.int64):
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return np.dtype(dt)
    raise AssertionError((lo, hi))


def run_ours(tokens: np.ndarray, config: dict, save_path: Path) -> None:
    """lightning_effi's analyzer with the configuration DeepSpeed ran: the map of every worker, then one reduce."""
    kw = dict(
        num_workers=config["num_workers"],
        num_threads=config["num_threads"],
        num_threads_reduce=config["num_threads_reduce"],
        batch_size=config["batch_size"],
        metric_names=MANIFEST["metrics"]["names"],
        metric_functions=gen.METRIC_FUNCTIONS,
        metric_types=MANIFEST["metrics"]["types"],
        metric_dtypes=MANIFEST["metrics"]["dtypes"],
        save_path=str(save_path),
        sample_indices=gen.sample_indices(config.get("sample_indices"), len(tokens)),
        progress=False,
    )
    dataset = gen.Tokens(tokens)
    for worker_id in range(config["num_workers"]):
        DataAnalyzer(dataset, worker_id=worker_id, **kw).run_map()
    DataAnalyzer(dataset, worker_id=0, **kw).run_reduce()


def stems(config: str):
    """``(metric, relative path of the file without extension)`` of every analyzer file of ``config``."""
    for metric, mtype in zip(MANIFEST["metrics"]["names"], MANIFEST["metrics"]["types"]):
        for stem in gen.analyzer_files(metric, mtype):
            yield metric, f"{metric}/{stem}"


# ------------------------------------------------------------------------------------------------------ manifest
def test_manifest_pins_every_file():
    listed = MANIFEST["files"]
    on_disk = {p.relative_to(FILES).as_posix() for p in FILES.rglob("*") if p.is_file()} - {"MANIFEST.json"}
    assert on_disk == set(listed)  # nothing unlisted, nothing missing
    for rel, entry in listed.items():
        data = (FILES / rel).read_bytes()
        assert len(data) == entry["bytes"], rel
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], f"{rel} differs from its MANIFEST digest"
    total = sum((FILES / rel).stat().st_size for rel in listed) + (FILES / "MANIFEST.json").stat().st_size
    assert total == MANIFEST["total_bytes"] + (FILES / "MANIFEST.json").stat().st_size < 200_000
    assert MANIFEST["deepspeed_version"] == "0.19.8"
    assert MANIFEST["command"].endswith("experiments/tools/make_deepspeed_index_files.py")
    expected_files = {
        f"analyzer/{c}/{rel}.{ext}" for c in MANIFEST["configs"] for _, rel in stems(c) for ext in ("bin", "idx")
    } | {f"builder/{d}.{ext}" for d in MANIFEST["builder"]["dtypes"] for ext in ("bin", "idx")}
    assert set(listed) == expected_files


def test_the_script_and_the_manifest_describe_the_same_data(tokens):
    """The data set rebuilt here is the one DeepSpeed analysed (digest), and the script's recipe, metrics,
    configurations and builder items are those the files were made with."""
    assert gen.tokens_digest(tokens) == MANIFEST["recipe"]["tokens_sha256"]
    assert {k: MANIFEST["recipe"][k] for k in gen.RECIPE} == gen.RECIPE
    assert MANIFEST["recipe"]["wsum_offset"] == gen.WSUM_OFFSET
    assert MANIFEST["metrics"] == gen.METRICS and MANIFEST["configs"] == gen.CONFIGS
    assert MANIFEST["builder"]["items"] == gen.BUILDER_ITEMS
    assert MANIFEST["builder"]["dtypes"] == list(gen.BUILDER_DTYPES)
    assert tokens.shape == (N, RECIPE["width"]) and tokens.min() == 0 and tokens.max() == RECIPE["vocab"]


# ------------------------------------------------------------------------------------------- byte-for-byte output
@pytest.mark.parametrize("config", PLAIN_CONFIGS)
def test_analyzer_writes_deepspeeds_bytes(tmp_path, tokens, config):
    run_ours(tokens, MANIFEST["configs"][config], tmp_path)
    theirs = FILES / "analyzer" / config
    for _, rel in stems(config):
        for ext in ("bin", "idx"):
            assert (tmp_path / f"{rel}.{ext}").read_bytes() == (theirs / f"{rel}.{ext}").read_bytes(), f"{rel}.{ext}"


@pytest.mark.parametrize("dtype", MANIFEST["builder"]["dtypes"])
def test_builder_writes_deepspeeds_bytes(tmp_path, dtype):
    builder = MMapIndexedDatasetBuilder(tmp_path / f"{dtype}.bin", dtype)
    for k, item in enumerate(MANIFEST["builder"]["items"]):
        builder.add_item(torch.tensor(item, dtype=torch.int64))
        if k in MANIFEST["builder"]["end_document_after"]:
            builder.end_document()
    builder.finalize(tmp_path / f"{dtype}.idx")
    for ext in ("bin", "idx"):
        assert (tmp_path / f"{dtype}.{ext}").read_bytes() == (FILES / "builder" / f"{dtype}.{ext}").read_bytes(), ext
    theirs = MMapIndexedDataset(FILES / "builder" / dtype)
    assert theirs.dtype == np.dtype(dtype)
    assert [x.tolist() for x in theirs] == MANIFEST["builder"]["items"]
    assert theirs.doc_idx.tolist() == [0, 2, 4]


@pytest.mark.parametrize("config", SI_CONFIGS)
def test_with_sample_indices_ours_is_deepspeeds_in_id_order(tmp_path, tokens, expected, config):
    """With ``sample_indices`` DeepSpeed writes ``sample_to_metric`` in position order (item k: the sample at
    position k) and each ``index_to_sample`` row in position order; lightning_effi writes both in id order (item i:
    sample id i; rows ascending). Everything else is byte-identical. This pins the relation exactly."""
    cfg = MANIFEST["configs"][config]
    si = gen.sample_indices(cfg["sample_indices"], N)
    run_ours(tokens, cfg, tmp_path)
    theirs = FILES / "analyzer" / config
    for metric, rel in stems(config):
        for ext in ("bin", "idx"):
            same = (tmp_path / f"{rel}.{ext}").read_bytes() == (theirs / f"{rel}.{ext}").read_bytes()
            assert same == (ext == "idx" or metric == "hist" or rel.endswith("_index_to_metric")), f"{rel}.{ext}"
    for metric in SINGLE:
        ds_s2m = np.asarray(MMapIndexedDataset(theirs / metric / f"{metric}_sample_to_metric").flat, dtype=np.int64)
        le_s2m = np.asarray(MMapIndexedDataset(tmp_path / metric / f"{metric}_sample_to_metric").flat, dtype=np.int64)
        assert ds_s2m.tolist() == expected[metric].tolist()  # DeepSpeed: the value of the sample at position k
        assert le_s2m[si].tolist() == ds_s2m.tolist()  # ours: the value of sample id si[k]
        ds_rows = MMapIndexedDataset(theirs / metric / f"{metric}_index_to_sample")
        le_rows = MMapIndexedDataset(tmp_path / metric / f"{metric}_index_to_sample")
        position = np.argsort(si)  # position of each sample id
        for j in range(len(ds_rows)):
            ds_row, le_row = ds_rows[j].astype(np.int64), le_rows[j].astype(np.int64)
            assert le_row.tolist() == sorted(ds_row.tolist())
            assert ds_row.tolist() == le_row[np.argsort(position[le_row], kind="stable")].tolist()


# -------------------------------------------------------------------------------------- reading DeepSpeed's files
@pytest.mark.parametrize("config", PLAIN_CONFIGS)
def test_readers_read_deepspeeds_files_to_the_metric_values(expected, config):
    folder = FILES / "analyzer" / config
    id_dtype = fitted(0, N - 1)
    for metric in SINGLE:
        values = expected[metric]
        rows, uniq = rows_of(values)
        p = folder / metric / metric
        s2m = MMapIndexedDataset(f"{p}_sample_to_metric")
        assert s2m.dtype == fitted(int(values.min()), int(values.max()))
        assert len(s2m) == N and s2m.sizes.tolist() == [1] * N
        assert np.asarray(s2m.flat, dtype=np.int64).tolist() == values.tolist()
        i2s = MMapIndexedDataset(f"{p}_index_to_sample")
        assert i2s.dtype == id_dtype
        assert [r.tolist() for r in i2s] == [r.tolist() for r in rows]
        i2m = MMapIndexedDataset(f"{p}_index_to_metric")
        assert [r.tolist() for r in i2m] == [[int(v)] for v in uniq]
        step = max(1, len(rows) // 100)
        merged = MMapIndexedDataset(f"{p}_index_to_sample_percentile_merged")
        assert [r.tolist() for r in merged] == [
            np.concatenate(rows[j : j + step]).tolist() for j in range(0, len(rows), step)
        ]
        for ds in (s2m, i2s, i2m, merged):  # DeepSpeed's doc_idx: chunk boundaries of its reduce threads
            doc = ds.doc_idx.tolist()
            assert doc[0] == 0 and doc[-1] == len(ds) and doc == sorted(doc)
        # the validated index the curriculum sampler uses
        index = MetricIndex.load(f"{p}_index_to_sample", f"{p}_index_to_metric", num_samples=N)
        assert index.ids.tolist() == np.concatenate(rows).tolist()
        assert index.offsets.tolist() == [0, *np.cumsum([len(r) for r in rows]).tolist()]
        assert index.values.tolist() == uniq.tolist()
        assert index.fingerprint() == MetricIndex.from_sample_to_metric(values).fingerprint()
        merged_index = MetricIndex.load(f"{p}_index_to_sample_percentile_merged", None, num_samples=N)
        assert merged_index.values is None and merged_index.ids.tolist() == index.ids.tolist()
    hist = MMapIndexedDataset(folder / "hist" / "hist_metric_value")
    assert len(hist) == 1 and hist[0].astype(np.int64).tolist() == expected["hist"].tolist()
    assert hist.dtype == fitted(int(expected["hist"].min()), int(expected["hist"].max()))


def test_merged_rows_really_are_merged(expected):
    """The recipe's ``wsum`` has more than 200 distinct values, so DeepSpeed merged its rows in pairs (the
    ``_percentile_merged`` file is not a copy of ``index_to_sample``)."""
    rows, _ = rows_of(expected["wsum"])
    merged = MMapIndexedDataset(
        FILES / "analyzer" / PLAIN_CONFIGS[0] / "wsum" / "wsum_index_to_sample_percentile_merged"
    )
    assert len(rows) >= 200 and len(merged) == -(-len(rows) // 2)
    assert fitted(int(expected["wsum"].min()), int(expected["wsum"].max())) == np.int16


class DictTokens(torch.utils.data.Dataset):
    def __init__(self, tokens: np.ndarray) -> None:
        self.x = torch.from_numpy(tokens)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i]}


def test_curriculum_trains_from_deepspeeds_files(tmp_path, tokens, expected):
    """A fit whose curriculum reads DeepSpeed's files (``seqlen`` by value from ``index_to_sample`` +
    ``index_to_metric``, ``wsum`` by percentile from the ``_percentile_merged`` file): the indexes it loaded hold the
    rows computed here, and the eligible sets follow DeepSpeed's value rule (``metric <= d``) and percentile rule (the
    first ``(N // 100) · p`` ids of the rows walked in order, all of them at 100)."""
    folder = FILES / "analyzer" / PLAIN_CONFIGS[0]
    schedule = dict(schedule_type="fixed_linear", schedule_config=dict(total_curriculum_step=8, difficulty_step=1))
    metrics = {
        "seqlen": dict(
            difficulty_type="value",
            clustering_type="schedule_based",
            min_difficulty=3,
            max_difficulty=12,
            index_to_sample_path=str(folder / "seqlen" / "seqlen_index_to_sample"),
            index_to_metric_path=str(folder / "seqlen" / "seqlen_index_to_metric"),
            **schedule,
        ),
        "wsum": dict(
            difficulty_type="percentile",
            clustering_type="schedule_based",
            min_difficulty=10,
            max_difficulty=100,
            index_to_sample_path=str(folder / "wsum" / "wsum_index_to_sample_percentile_merged"),
            **schedule,
        ),
    }
    cb = Curriculum(metrics=metrics)
    trainer = make_trainer(tmp_path, [cb], max_steps=2, max_epochs=-1)
    trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(DictTokens(tokens), batch_size=4)))
    assert trainer.global_step == 2
    seqlen_rows, seqlen_values = rows_of(expected["seqlen"])
    loaded = cb.controller.indexes
    assert loaded["seqlen"].ids.tolist() == np.concatenate(seqlen_rows).tolist()
    assert loaded["seqlen"].values.tolist() == seqlen_values.tolist()
    wsum_flat = np.concatenate(rows_of(expected["wsum"])[0])
    assert loaded["wsum"].values is None and loaded["wsum"].ids.tolist() == wsum_flat.tolist()
    book = cb.controller.book
    for d in range(1, 13):
        eligible = set(np.flatnonzero(book.eligible({"seqlen": d, "wsum": 100})).tolist())
        assert eligible == set(np.flatnonzero(expected["seqlen"] <= d).tolist()), d
    per_percentile = N // 100
    for p in (1, 10, 37, 99, 100):
        eligible = set(np.flatnonzero(book.eligible({"seqlen": 12, "wsum": p})).tolist())
        assert eligible == set(wsum_flat[: N if p == 100 else per_percentile * p].tolist()), p
