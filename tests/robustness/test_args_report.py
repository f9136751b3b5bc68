"""The sweep report's inputs (issue #21): an ``efficiency`` total of ``result.json`` that is not a finite number
>= 0 refused naming the file and key; a ``--mode`` contradicting the runs' ``optimized_mode`` warned about, naming
both."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from lightning_effi.report import build_report, load_runs
from lightning_effi.report.load import ReportError
from tests.report import write_record, write_sweep


@pytest.mark.parametrize(
    "key, value",
    [("flops", "1e12"), ("flops", -1.0), ("tokens", None), ("samples", True), ("time_train_s", -0.5)],
)
def test_an_efficiency_total_must_be_a_finite_number_at_least_zero(tmp_path, key, value):
    folder = write_record(tmp_path / "run")
    record = json.loads((folder / "result.json").read_text())
    record["efficiency"][key] = value
    (folder / "result.json").write_text(json.dumps(record))
    with pytest.raises(ReportError, match=rf"run/result.json: 'efficiency\.{key}' must be a finite number >= 0"):
        load_runs([folder])


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("arm", "", r"'arm' must be a non-empty label"),
        ("arm", " ", r"'arm' must be a non-empty label"),
        ("seed", -1, r"'seed' must be an int in \[0, 2\*\*32\)"),
    ],
)
def test_what_write_result_refuses_is_refused_when_read(tmp_path, key, value, match):
    """A hand-edited record with an empty arm (label "@1 seed 0") or a negative seed was read; the
    reader now refuses what write_result refuses; a boolean final metric is not read as 1.0."""
    folder = write_record(tmp_path / "run")
    record = json.loads((folder / "result.json").read_text())
    record[key] = value
    (folder / "result.json").write_text(json.dumps(record))
    with pytest.raises(ReportError, match=match):
        load_runs([folder])
    record = json.loads((folder / "result.json").read_text())
    record.update(arm="baseline", seed=0, metrics={**record["metrics"], "flag": True})
    (folder / "result.json").write_text(json.dumps(record))
    (run,) = load_runs([folder])
    assert "flag" not in run.metrics


def test_a_nan_total_is_refused_and_valid_totals_load_as_written(tmp_path):
    folder = write_record(tmp_path / "run", flops=2.5e12, tokens=0)
    (run,) = load_runs([folder])
    assert run.compute("flops") == 2.5e12 and run.compute("tokens") == 0.0
    record = json.loads((folder / "result.json").read_text())
    record["efficiency"]["flops"] = math.nan
    (folder / "result.json").write_text(json.dumps(record))  # written as NaN, which Python's json reads back
    with pytest.raises(ReportError, match=r"'efficiency\.flops' must be a finite number >= 0 .*got nan"):
        load_runs([folder])


def test_a_mode_against_the_runs_optimized_mode_is_warned_about(tmp_path):
    runs = load_runs([write_sweep(tmp_path / "sweep")])  # every run optimizes val/loss with mode min
    with pytest.warns(
        UserWarning,
        match=r"mode='max' \(--mode\) for 'val/loss', but the runs optimized 'val/loss' "
        r"with optimized_mode='min'",
    ):
        report = build_report(runs, mode="max")
    assert report.mode == "max"  # the user's choice is applied
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build_report(runs, mode="min").mode == "min" and build_report(runs).mode == "min"
    with pytest.raises(ReportError, match=r"mode: expected 'min' \(lower is better\) or 'max'"):
        build_report(runs, mode="maximize")


def test_the_cli_warns_on_a_contradicting_mode_and_still_writes_the_report(tmp_path):
    from lightning_effi.report.__main__ import main

    sweep = write_sweep(tmp_path / "sweep")
    with pytest.warns(UserWarning, match=r"optimized_mode='min'"):
        assert main([str(sweep), "--mode", "max", "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.md").is_file()


@pytest.mark.parametrize(("key", "total"), [("flops", "flops"), ("wall_clock", "time_total_s")])
def test_a_top_level_copy_that_disagrees_with_its_efficiency_total_is_refused(tmp_path, key, total):
    """The record keeps top-level copies of two efficiency totals; the report reads the efficiency block, so a
    hand-edited copy (the user halving the FLOPs where they first see them) was silently ignored."""
    folder = write_record(tmp_path / "run", flops=2.5e12)
    record = json.loads((folder / "result.json").read_text())
    record["efficiency"]["time_total_s"] = 12.0
    record["flops"], record["wall_clock"] = 2.5e12, 12.0  # the copies as write_result writes them
    (folder / "result.json").write_text(json.dumps(record))
    (run,) = load_runs([folder])
    assert run.compute("flops") == 2.5e12
    record[key] = 1.0
    (folder / "result.json").write_text(json.dumps(record))
    with pytest.raises(ReportError, match=rf"'{key}' is 1\.0 but 'efficiency\.{total}' is .*edit both"):
        load_runs([folder])


def test_a_final_metric_that_disagrees_with_its_metrics_entry_is_refused(tmp_path):
    """'metric' is a copy of metrics[optimized_metric]; the report reads the copy, so a re-evaluated value edited
    into the metrics alone (0.30 for 0.525) was silently ignored (qa60-audit 04). A metric logged as null in both
    (NaN) is one value."""
    folder = write_record(tmp_path / "run", loss=2.0)
    record = json.loads((folder / "result.json").read_text())
    name = record["optimized_metric"]
    assert record["metric"] == record["metrics"][name] == 2.0
    record["metric"], record["metrics"][name] = None, None
    (folder / "result.json").write_text(json.dumps(record))
    (run,) = load_runs([folder])
    assert math.isnan(run.quality())
    record["metric"], record["metrics"][name] = 2.0, 1.5
    (folder / "result.json").write_text(json.dumps(record))
    with pytest.raises(ReportError, match=rf"'metric' is 2\.0 but 'metrics\.{name}' is 1\.5; the first is a copy"):
        load_runs([folder])
