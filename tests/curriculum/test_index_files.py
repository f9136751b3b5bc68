"""The curriculum reading DataAnalyzer index files: the clusters the sampler derives from the files equal those
derived from the ``index_to_sample`` rows by DeepSpeed's value / percentile rules, the
``_percentile_merged`` file gives the same percentile sets, and a fit runs from files."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_effi.callbacks import Curriculum
from lightning_effi.curriculum import CurriculumConfig, CurriculumController, CurriculumStream
from lightning_effi.curriculum.analysis import DataAnalyzer, IndexFileError, MetricIndex, MMapIndexedDataset
from lightning_effi.data import CurriculumDataModule
from lightning_effi.functional import curriculum as F
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TokenBlocks, tiny_gpt2, tiny_lm_data

N = 40  # TokenBlocks()


def first_token(batch):
    return batch["input_ids"][:, 0].long()


@pytest.fixture(scope="module")
def analysis(tmp_path_factory):
    path = tmp_path_factory.mktemp("analysis")
    DataAnalyzer(
        TokenBlocks(),
        batch_size=7,
        metric_names=["first"],
        metric_functions=[first_token],
        metric_types=["single_value_per_sample"],
        metric_dtypes=[np.int64],
        save_path=str(path),
        progress=False,
    ).run_map_reduce()
    return path / "first"


def metric(path, kind, lo, total=8, q=10, merged=False):
    m = dict(
        difficulty_type=kind,
        clustering_type="schedule_based",
        min_difficulty=lo,
        max_difficulty=100 if kind == "percentile" else 63,
        schedule_type="fixed_linear",
        schedule_config=dict(total_curriculum_step=total, difficulty_step=q),
    )
    m["index_to_sample_path"] = str(path / ("first_index_to_sample" + ("_percentile_merged" if merged else "")))
    if kind == "value":
        m["index_to_metric_path"] = str(path / "first_index_to_metric")
    return m


def clusters_over(config, index, steps):
    c = CurriculumController(config, {"first": index}, N, micro_batch_size=4)
    stream = CurriculumStream(config, c.book, c.total_samples, c.global_batch)
    out = []
    for _ in range(steps):
        gb = stream.next_global_batch()
        out.append((gb.difficulties[0], [set(x.tolist()) for x in stream.clusters]))
    return out


@pytest.mark.parametrize("merged", [False, True])
def test_percentile_clusters_match_the_formula_on_the_rows(analysis, merged):
    cfg = CurriculumConfig(
        metrics={"first": metric(analysis, "percentile", 20, merged=merged)}, percentile_rounding="proportional"
    )
    m = cfg.metrics["first"]
    index = MetricIndex.load(m.index_to_sample_path, None, num_samples=N)
    rows = [
        MMapIndexedDataset(m.index_to_sample_path)[j].tolist()
        for j in range(len(MMapIndexedDataset(m.index_to_sample_path)))
    ]
    prev = 0
    for d, clusters in clusters_over(cfg, index, 9):
        if d != prev:
            assert clusters[-1] == set(F.percentile_ids(rows, prev, d, 100, "proportional").tolist())
            prev = d
        assert set().union(*clusters) == set(F.percentile_ids(rows, 0, d, 100, "proportional").tolist())
    assert prev == 100


def test_value_clusters_match_the_metric(analysis):
    cfg = CurriculumConfig(metrics={"first": metric(analysis, "value", 10, q=1)})
    m = cfg.metrics["first"]
    index = MetricIndex.load(m.index_to_sample_path, m.index_to_metric_path, num_samples=N)
    values = TokenBlocks().data[:, 0].numpy()
    for d, clusters in clusters_over(cfg, index, 9):
        assert set().union(*clusters) == set(np.flatnonzero(values <= d).tolist())


def test_fit_from_index_files(analysis, tmp_path):
    cb = Curriculum(metrics={"first": metric(analysis, "percentile", 50)}, percentile_rounding="proportional")
    make_trainer(tmp_path, [cb], max_steps=3, max_epochs=-1).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
    )
    assert cb.controller.committed["micro"] == 3


class ManyValues(TokenBlocks):
    """600 token blocks whose first two tokens code 250 values (``first_two``): the merged index has 125 rows (merge
    step 2)."""

    def __init__(self) -> None:
        super().__init__(n=600)

    def __getitem__(self, i):
        item = dict(super().__getitem__(i))
        item["input_ids"] = item["input_ids"].clone()
        item["input_ids"][0], item["input_ids"][1] = (i % 250) % 50, (i % 250) // 50
        return item


def first_two(batch):
    return (batch["input_ids"][:, 0] + 50 * batch["input_ids"][:, 1]).long()


def test_a_merged_percentile_index_with_an_index_to_metric_file_trains_as_in_deepspeed(tmp_path):
    """Megatron-DeepSpeed's BERT script gives a percentile metric its _percentile_merged index and the
    index_to_metric file; DeepSpeed reads index_to_metric for value metrics only. The row counts (125 vs 250) were
    compared and the config refused as "files of two analyses" (qa108-break 02)."""
    from tests.helpers.tiny import TinyDataModule

    data = ManyValues()
    DataAnalyzer(
        data,
        batch_size=64,
        metric_names=["first"],
        metric_functions=[first_two],
        metric_types=["single_value_per_sample"],
        metric_dtypes=[np.int64],
        save_path=str(tmp_path / "a"),
        progress=False,
    ).run_map_reduce()
    m = metric(tmp_path / "a" / "first", "percentile", 50, merged=True)
    m["index_to_metric_path"] = str(tmp_path / "a" / "first" / "first_index_to_metric")
    cb = Curriculum(metrics={"first": m}, percentile_rounding="proportional")
    with pytest.warns(UserWarning, match=r"curriculum_metrics.first.index_to_metric_path is not read for a percentile"):
        make_trainer(tmp_path, [cb], max_steps=2, max_epochs=-1).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(data, batch_size=4))
        )
    assert cb.controller.committed["micro"] == 2


def test_index_files_of_an_older_deepspeed_are_read_with_its_dtype_table(tmp_path):
    """DeepSpeed <= 0.13.2 numbered dtypes otherwise (its code 8 is uint16, today's uint64): its files were refused
    as damaged and the Curriculum could not name the table (qa108-break 05). Read with the older table, warned."""
    from lightning_effi.curriculum.analysis.indexed_dataset import MMapIndexedDatasetBuilder
    from tests.helpers.tiny import TinyDataModule

    values = np.array([int(TokenBlocks()[i]["input_ids"][0]) for i in range(N)])
    order = np.argsort(values, kind="stable")
    uniq, counts = np.unique(values, return_counts=True)
    prefix = str(tmp_path / "first_")
    for name, items, sizes, dtype in (
        ("index_to_sample", order, counts, np.uint16),
        ("index_to_metric", uniq, np.ones(len(uniq), dtype=np.int64), np.uint8),
    ):
        builder = MMapIndexedDatasetBuilder(prefix + name + ".bin", dtype, dtype_table="legacy")
        builder.add_items_flat(items, sizes)
        builder.end_document()
        builder.finalize(prefix + name + ".idx")
    with pytest.raises(IndexFileError, match="damaged index"):  # today's table
        MetricIndex.load(prefix + "index_to_sample", prefix + "index_to_metric", num_samples=N)
    m = dict(metric(tmp_path, "value", 10), index_to_sample_path=prefix + "index_to_sample")
    m["index_to_metric_path"] = prefix + "index_to_metric"
    cb = Curriculum(metrics={"first": m})
    with pytest.warns(UserWarning, match=r"curriculum_metrics.first: the index files were read with DeepSpeed <= "):
        make_trainer(tmp_path, [cb], max_steps=2, max_epochs=-1).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
        )
    legacy = MetricIndex.load(
        prefix + "index_to_sample", prefix + "index_to_metric", num_samples=N, dtype_table="legacy"
    )
    assert cb.controller.indexes["first"].fingerprint() == legacy.fingerprint()
    # older files of another data set: the older table's reason, not "damaged" (qa109-regress 01)
    with pytest.raises(
        IndexFileError, match=r"holds 40 sample ids but the data set has 30 .*\(read with DeepSpeed <= "
    ):
        make_trainer(tmp_path, [Curriculum(metrics={"first": m})], max_steps=1).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(TokenBlocks(n=30), batch_size=4))
        )


def test_index_files_of_another_dataset_raise_in_setup(analysis, tmp_path):
    from lightning_effi.data import CurriculumDataModule as DM
    from tests.helpers.tiny import TinyDataModule

    cb = Curriculum(metrics={"first": metric(analysis, "percentile", 50)})
    with pytest.raises(IndexFileError, match="first_index_to_sample"):
        make_trainer(tmp_path, [cb], max_steps=1).fit(
            tiny_gpt2(), datamodule=DM(TinyDataModule(TokenBlocks(n=30), batch_size=4))
        )
