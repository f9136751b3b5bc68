"""Bad inputs to the offline ``DataAnalyzer`` and its index files refused at construction (or load), naming the
parameter and what is allowed (issue #21); valid numpy / OmegaConf inputs still accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

from lightning_effi.curriculum.analysis import DataAnalyzer, IndexFileError, MetricIndex
from tests.helpers.tiny import TokenBlocks


def first_token(batch: Any) -> Any:
    return batch["input_ids"][:, 0].long()


def analyzer(**kw: Any) -> DataAnalyzer:
    base: dict[str, Any] = dict(
        metric_names=["first"],
        metric_functions=[first_token],
        metric_types=["single_value_per_sample"],
        metric_dtypes=[np.int64],
        batch_size=8,
        progress=False,
        save_path="unused",
    )
    dataset = kw.pop("dataset", None) or TokenBlocks(n=12, seq_len=4)
    return DataAnalyzer(dataset, **{**base, **kw})


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"specific_threads": "0"}, r"DataAnalyzer\.specific_threads must be a list of ints, got '0'"),
        ({"specific_threads": [0.5]}, r"specific_threads must be distinct int thread ids in \[0, num_threads=1\)"),
        ({"specific_threads": [True]}, r"specific_threads must be distinct int thread ids"),
        ({"keep_temp": "false"}, r"DataAnalyzer\.keep_temp must be a bool .*got 'false'"),
        ({"keep_temp": "true"}, r"DataAnalyzer\.keep_temp must be a bool"),
        ({"progress": "false"}, r"DataAnalyzer\.progress must be a bool"),
        ({"index_key": 3}, r"DataAnalyzer\.index_key must be a str or None, got 3"),
        ({"run_tag": 3}, r"DataAnalyzer\.run_tag must be a str or None, got 3"),
        ({"metric_functions": ["bogus"]}, r"DataAnalyzer\.metric_functions \(metric 'first'\): unknown metric 'bogus'"),
        ({"metric_functions": first_token}, r"DataAnalyzer\.metric_functions must be a list of functions"),
        ({"metric_names": "first"}, r"DataAnalyzer\.metric_names must be a list of metric names"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(kw, match):
    with pytest.raises(ValueError, match=match):
        analyzer(**kw)


@pytest.mark.parametrize("value", [None, 3])
def test_save_path_must_be_a_path(value):
    with pytest.raises(TypeError, match=rf"DataAnalyzer\.save_path must be a folder path .*got {value!r}"):
        analyzer(save_path=value)


def test_valid_inputs_are_kept_in_their_plain_types(tmp_path):
    a = analyzer(
        num_threads=3,
        specific_threads=[np.int64(2), 0],
        metric_names=OmegaConf.create(["first"]),
        keep_temp=np.bool_(True),
        save_path=tmp_path,
        run_tag="data-v1",
        index_key=None,
    )
    assert a.specific_threads == [2, 0] and all(type(t) is int for t in a.specific_threads)
    assert a.metric_names == ["first"] and a.keep_temp is True and a.save_path == str(tmp_path)
    assert analyzer(num_threads=2, specific_threads=None).specific_threads == [0, 1]
    assert analyzer(num_threads=2, specific_threads=[]).specific_threads == [0, 1]


def test_index_to_metric_path_of_another_file_names_the_parameter(tmp_path: Path):
    analyzer(dataset=TokenBlocks(n=12, seq_len=4, vocab_size=3), save_path=tmp_path).run_map_reduce()
    folder = tmp_path / "first"
    good = MetricIndex.load(str(folder / "first_index_to_sample"), str(folder / "first_index_to_metric"), 12)
    assert good.num_samples == 12 and good.values is not None and good.num_rows <= 3  # 3 distinct first tokens
    with pytest.raises(IndexFileError, match=r"index_to_metric_path '.*first_sample_to_metric': 12 rows but "):
        MetricIndex.load(str(folder / "first_index_to_sample"), str(folder / "first_sample_to_metric"), 12)
