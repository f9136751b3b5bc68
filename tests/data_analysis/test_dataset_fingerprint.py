"""Index files carry a content fingerprint of the data set they were analysed from (``analysis_metadata.json``):
files analysed from another data set of the same length are refused by ``MetricIndex.load(dataset=...)`` and by the
curriculum's ``setup``; data sets that cannot be fingerprinted (random augmentations) skip the check."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_effi.curriculum.analysis import METADATA_NAME, DataAnalyzer, IndexFileError, MetricIndex
from lightning_effi.curriculum.analysis.index import dataset_fingerprint


class Rows:
    """``n`` samples ``{"input_ids": int64[4]}``, sample i holding ``values[i]``."""

    def __init__(self, values):
        self.values = np.asarray(values, dtype=np.int64)

    def __len__(self):
        return len(self.values)

    def __getitem__(self, i):
        return {"input_ids": np.full((4,), 1, dtype=np.int64) * self.values[i]}


class Augmented(Rows):
    """Random noise added at every read, as a random augmentation would."""

    def __getitem__(self, i):
        return {"input_ids": super().__getitem__(i)["input_ids"] + np.random.randint(0, 1000, 4)}


def _metric(batch):
    return batch["input_ids"][:, 0].to(dtype=__import__("torch").int64)


def _analyze(ds, tmp_path, **kwargs):
    a = DataAnalyzer(
        ds,
        batch_size=4,
        metric_names=["v"],
        metric_functions=[_metric],
        metric_types=["single_value_per_sample"],
        metric_dtypes=[np.int64],
        save_path=tmp_path,
        progress=False,
        **kwargs,
    )
    a.run_map()
    a.run_reduce()
    return str(tmp_path / "v" / "v_index_to_sample"), str(tmp_path / "v" / "v_index_to_metric")


def test_fingerprint_is_content_based_and_stable():
    a, b = Rows(np.arange(30) % 7), Rows(np.arange(30) % 7)
    assert dataset_fingerprint(a) == dataset_fingerprint(b) is not None
    assert dataset_fingerprint(Rows(np.arange(30) % 5)) != dataset_fingerprint(a)
    assert dataset_fingerprint(Rows((np.arange(30) % 7)[::-1])) != dataset_fingerprint(a)  # another order
    assert dataset_fingerprint(Augmented(np.arange(30))) is None  # items differ between two reads
    assert dataset_fingerprint(Rows([])) is None
    assert dataset_fingerprint([object()] * 3) is None  # leaves it cannot hash by content


def test_metadata_records_the_fingerprint_and_load_checks_it(tmp_path):
    analysed = Rows(np.arange(30) % 7)
    s, m = _analyze(analysed, tmp_path)
    meta = json.loads((tmp_path / "v" / METADATA_NAME).read_text())
    assert meta["dataset_fingerprint"] == dataset_fingerprint(analysed)
    assert MetricIndex.load(s, m, num_samples=30, dataset=Rows(np.arange(30) % 7)).num_samples == 30
    other = Rows(np.arange(30) % 5)  # same length, other contents
    with pytest.raises(IndexFileError, match=r"another data set.*fingerprint"):
        MetricIndex.load(s, m, num_samples=30, dataset=other)
    with pytest.raises(IndexFileError, match="another data set"):
        MetricIndex.load(s + "_percentile_merged", num_samples=30, dataset=other)
    MetricIndex.load(s, m, num_samples=30)  # no data set given: the length and digests only
    MetricIndex.load(s, m, num_samples=30, dataset=Augmented(np.arange(30) % 5))  # cannot fingerprint: skipped


def test_curriculum_setup_refuses_index_files_of_another_dataset(tmp_path):
    import lightning.pytorch as pl
    import torch

    from lightning_effi import Curriculum, CurriculumDataModule
    from tests.harness.settings import seeded
    from tests.helpers.harness import make_trainer
    from tests.helpers.tiny import TinyDataModule, TokenBlocks, tiny_gpt2

    analysed, trained = TokenBlocks(n=24, seed=0), TokenBlocks(n=24, seed=1)

    def first_token(batch):
        return batch["input_ids"][:, 0].to(torch.int64)

    a = DataAnalyzer(
        analysed,
        batch_size=4,
        metric_names=["first"],
        metric_functions=[first_token],
        metric_types=["single_value_per_sample"],
        metric_dtypes=[np.int64],
        save_path=tmp_path / "analysis",
        progress=False,
    )
    a.run_map()
    a.run_reduce()
    prefix = str(tmp_path / "analysis" / "first" / "first_index_to_sample")
    metrics = {
        "first": dict(
            difficulty_type="percentile",
            clustering_type="schedule_based",
            index_to_sample_path=prefix + "_percentile_merged",
            min_difficulty=20,
            max_difficulty=100,
            schedule_type="fixed_linear",
            schedule_config=dict(total_curriculum_step=4, difficulty_step=20),
        )
    }

    def fit(dataset):
        pl.seed_everything(0)
        trainer = make_trainer(
            tmp_path / "run",
            [Curriculum(metrics=metrics, seed=3, percentile_rounding="proportional")],
            max_steps=2,
            use_distributed_sampler=False,
        )
        trainer.fit(seeded(tiny_gpt2)(), datamodule=CurriculumDataModule(TinyDataModule(dataset, batch_size=4)))
        return trainer

    assert fit(TokenBlocks(n=24, seed=0)).global_step == 2  # the analysed data set trains
    with pytest.raises(IndexFileError, match="another data set"):
        fit(trained)


def test_remapped_ids_record_the_fingerprint_in_id_order(tmp_path):
    """With sample_indices the files index samples by id, but the fingerprint was taken in position order: the
    training set the ids index was refused ("another data set") and the analysed set accepted, its positions read as
    ids, so every step trained other difficulties (qa108-break 01)."""
    by_id = np.arange(30) * 7 % 13  # the sample with id s holds (7 s) % 13
    order = np.random.default_rng(0).permutation(30)  # position k holds the sample with id order[k]
    analysed = Rows(by_id[order])
    s, m = _analyze(analysed, tmp_path, sample_indices=order)
    meta = json.loads((tmp_path / "v" / METADATA_NAME).read_text())
    assert meta["dataset_fingerprint"] == dataset_fingerprint(Rows(by_id))
    index = MetricIndex.load(s, m, num_samples=30, dataset=Rows(by_id))  # position == id: the ids' data set
    assert all(by_id[i] == v for v, ids in zip(index.values, index.rows(), strict=True) for i in ids)
    # the analysed set itself: refused, saying its ids are not its positions (qa113-tabular 05)
    with pytest.raises(IndexFileError, match=r"the training data set is the one analysed, .* indexes its samples by "
                       r"the ids of its sample_indices, which are not their positions"):  # fmt: skip
        MetricIndex.load(s, m, num_samples=30, dataset=analysed)
    with pytest.raises(IndexFileError, match="another data set"):
        MetricIndex.load(s, m, num_samples=30, dataset=Rows(by_id[::-1]))


class Labelled(Rows):
    """``Rows`` whose samples carry an ``index`` field: a DataFrame's row label (here a permutation), not the
    sample's position."""

    def __init__(self, values, labels):
        super().__init__(values)
        self.labels = np.asarray(labels, dtype=np.int64)

    def __getitem__(self, i):
        return {**super().__getitem__(i), "index": self.labels[i]}


def test_an_index_field_read_as_ids_is_named_when_the_analysed_set_is_refused(tmp_path):
    """A dict sample's ``index`` field (a DataFrame's row label) read as its id by the default index_key: the curriculum
    refused the analysed data set's own files as "analysis of another data set" (qa113-tabular 05). The refusal names
    the field and index_key=None, which analyses by position and loads."""
    dataset = Labelled(np.arange(30) % 7, np.random.default_rng(0).permutation(30))
    s, m = _analyze(dataset, tmp_path / "field")
    with pytest.raises(IndexFileError, match=r"the ids of its index_key 'index' \(DataAnalyzer's index_key is 'index' "
                       r"by default.*run the analyzer with index_key=None"):  # fmt: skip
        MetricIndex.load(s, m, num_samples=30, dataset=dataset)
    s, m = _analyze(dataset, tmp_path / "positions", index_key=None)
    index = MetricIndex.load(s, m, num_samples=30, dataset=dataset)
    assert all(dataset.values[i] == v for v, ids in zip(index.values, index.rows(), strict=True) for i in ids)


def test_mappings_and_dataclasses_are_fingerprinted_by_content():
    """A tokenizer's BatchEncoding samples (a Mapping, not a dict) and dataclass samples had no fingerprint: the
    check was off, and a shuffled training set trained other difficulties (qa108-break 06)."""
    import dataclasses
    from collections import UserDict

    from transformers import BatchEncoding

    @dataclasses.dataclass
    class Sample:
        input_ids: np.ndarray
        sid: int

    values = np.arange(30) % 7

    def fingerprint(make, vals=values):
        return dataset_fingerprint([make(np.full(4, v), i) for i, v in enumerate(vals)])

    for make in (
        lambda ids, i: BatchEncoding({"input_ids": ids, "sid": i}),
        lambda ids, i: UserDict({"input_ids": ids, "sid": i}),
        lambda ids, i: Sample(ids, i),
    ):
        assert fingerprint(make) is not None and fingerprint(make) == fingerprint(make)
        assert fingerprint(make, values[::-1]) != fingerprint(make)  # another order
    # a mapping that is also a dataclass (HF's ModelOutput) keeps a dict's fingerprint, as analyses recorded it before
    # (read as a dataclass, its None fields counted: existing files refused; qa109-regress 02)
    from transformers.utils import ModelOutput

    @dataclasses.dataclass
    class Output(ModelOutput):
        input_ids: np.ndarray | None = None
        sid: int | None = None
        unused: np.ndarray | None = None

    assert fingerprint(lambda ids, i: Output(input_ids=ids, sid=i)) == fingerprint(
        lambda ids, i: {"input_ids": ids, "sid": i}
    )
