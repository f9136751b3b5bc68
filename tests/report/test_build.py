"""load_runs and build_report on synthetic result.json files: savings against the frontier and the same-length
baseline equal hand computations; the spread is the sample std."""

import functools
import json
import math
import os
import warnings

import pytest

from lightning_effi.report import ReportError, build_report, load_runs
from tests.report import ARM, BASELINES, write_record, write_sweep


@pytest.fixture
def sweep(tmp_path):
    return write_sweep(tmp_path / "sweep")


def _row(report, arm, budget):
    (row,) = [r for r in report.rows if r["arm"] == arm and r["budget"] == budget]
    return row


def test_load_runs_reads_every_job_of_a_sweep(sweep):
    runs = load_runs([sweep])
    assert len(runs) == 10
    assert [r.path.name for r in runs] == [str(i) for i in range(10)]  # job order, not string order (10 jobs)
    first = runs[0]
    assert (first.arm, first.budget, first.seed, first.metric, first.mode) == ("baseline", 0.25, 0, 3.0, "min")
    assert first.is_baseline and first.compute("flops") == 1e12 and first.train_wall_s == 10.0
    assert not runs[-1].is_baseline and runs[-1].techniques["random_ltd"]["min_value"] == 32
    assert len(runs[-1].curve) == 2 and runs[-1].schedule[-1]["random_ltd/reserved_length"] == 128
    assert load_runs([sweep / "3"])[0].path == sweep / "3"  # a run folder
    assert len(load_runs([sweep, sweep / "3"])) == 10  # a file found twice is read once


def test_a_run_folder_linked_into_a_sweep_is_read_and_a_link_cycle_ends(tmp_path, sweep):
    """A run linked into a sweep folder (a baseline shared by several sweeps) is one of its runs (``Path.rglob``
    skipped linked folders: the run was left out without a word), and so is a linked job without a record; a link
    back to the sweep is read once, not looped over."""
    from lightning_effi.report.load import jobs_without_result

    shared = write_record(tmp_path / "elsewhere" / "technique", arm="random_ltd", seed=2, loss=2.4, flops=2e12)
    (sweep / "10").symlink_to(shared, target_is_directory=True)
    (tmp_path / "failed" / ".hydra").mkdir(parents=True)
    (sweep / "11").symlink_to(tmp_path / "failed", target_is_directory=True)
    (sweep / "9" / "loop").symlink_to(sweep, target_is_directory=True)
    runs = load_runs([sweep])
    assert len(runs) == 11 and runs[-1].path == sweep / "10" and runs[-1].seed == 2
    assert jobs_without_result([sweep]) == [sweep / "11"]
    assert len(build_report(runs).readings) == 11


def test_a_job_whose_record_lies_in_its_logger_folder_is_not_told_failed(tmp_path):
    """A ``ResultWriter`` without ``out_dir`` writes into the logger's version folder (``<job>/csv/result.json``): the
    report read that record and also noted the job as one without ``result.json`` (qa102-user 01). A record below a
    job (and not in a deeper job's folder) is the job's; a job with none is still told."""
    from lightning_effi.report.load import jobs_without_result

    sweep = tmp_path / "sweep"
    for job in ("0", "1", "2", "2/inner"):
        (sweep / job / ".hydra").mkdir(parents=True)
    write_record(sweep / "0" / "csv")  # the logger's version folder
    write_record(sweep / "2" / "inner" / "csv")  # a nested job's record is not its outer job's
    assert jobs_without_result([sweep]) == [sweep / "1", sweep / "2"]
    assert len(load_runs([sweep])) == 2


def test_frontier_and_same_length_savings_equal_hand_computations(sweep):
    report = build_report(load_runs([sweep]))
    assert (report.metric, report.mode, report.compute) == ("val/loss", "min", "flops")
    assert [(r["arm"], r["budget"]) for r in report.rows] == [
        ("baseline", 0.25),
        ("baseline", 0.5),
        ("baseline", 0.75),
        ("baseline", 1.0),
        ("random_ltd", 1.0),
    ]
    row = _row(report, "random_ltd", 1.0)
    # seed 0: loss 2.5 lies halfway (in loss) between the baselines (2e12, 2.6) and (3e12, 2.4): sqrt(2e12 * 3e12)
    # seed 1: loss 2.55 lies 3/4 of the way from (2e12, 2.7) to (3e12, 2.5): 2e12^(1/4) * 3e12^(3/4)
    need = [math.sqrt(2e12 * 3e12), 2e12**0.25 * 3e12**0.75]
    assert need[0] == pytest.approx(2.449489742783178e12)
    savings = [1 - 2e12 / need[0], 1 - 2e12 / need[1]]
    assert savings[0] == pytest.approx(0.18350341907227397)
    assert row["frontier_compute_mean"] == pytest.approx(sum(need) / 2)
    assert row["frontier_saving_mean"] == pytest.approx(sum(savings) / 2)
    assert row["frontier_saving_std"] == pytest.approx(abs(savings[0] - savings[1]) / math.sqrt(2))  # n - 1 = 1
    assert row["frontier_factor_mean"] == pytest.approx(1 / (1 - sum(savings) / 2))  # the mean saving's factor
    assert row["frontier_flag"] == "inside" and row["frontier_n"] == 2
    # wall time: seed 0 between (20 s, 2.6) and (30 s, 2.4) -> sqrt(600); seed 1 between (21, 2.7) and (31, 2.5)
    wall_need = [math.sqrt(20 * 30), 21**0.25 * 31**0.75]
    wall_savings = [1 - 15 / wall_need[0], 1 - 16 / wall_need[1]]
    assert row["frontier_wall_s_mean"] == pytest.approx(sum(wall_need) / 2)
    assert row["frontier_wall_saving_mean"] == pytest.approx(sum(wall_savings) / 2)
    assert row["frontier_wall_saving_std"] == pytest.approx(abs(wall_savings[0] - wall_savings[1]) / math.sqrt(2))
    assert row["frontier_wall_factor_mean"] == pytest.approx(1 / (1 - sum(wall_savings) / 2))
    line = next(x for x in report.to_markdown().splitlines() if x.startswith("| random_ltd |"))
    wall_cell = line.rsplit("|", 2)[-2].strip()  # the last column
    assert (
        wall_cell == f"{100 * sum(wall_savings) / 2:+.1f}% ± {100 * row['frontier_wall_saving_std']:.1f}% "
        f"({1 / (1 - sum(wall_savings) / 2):.2f}x)"
    )
    # same length: the budget-1.0 baselines, 4e12 FLOPs, 40 / 41 s, loss 2.3 / 2.35
    assert row["same_length_saving_mean"] == pytest.approx(0.5) and row["same_length_saving_std"] == pytest.approx(0)
    assert row["same_length_quality_delta_mean"] == pytest.approx(((2.5 - 2.3) + (2.55 - 2.35)) / 2)
    assert row["same_length_wall_saving_mean"] == pytest.approx(((1 - 15 / 40) + (1 - 16 / 41)) / 2)
    assert row["same_length_n"] == 2
    # quality: mean and sample std over the two seeds
    assert row["quality_mean"] == pytest.approx(2.525) and row["quality_std"] == pytest.approx(0.05 / math.sqrt(2))
    assert (row["n_seeds"], row["seeds"], row["note"]) == (2, "0;1", "")
    base = _row(report, "baseline", 0.5)
    assert base["baseline"] and base["quality_mean"] == pytest.approx(2.65) and math.isnan(base["frontier_saving_mean"])
    assert base["flops_mean"] == 2e12 and base["train_wall_s_mean"] == pytest.approx(20.5)
    assert [len(report.frontiers[s]["flops"].front) for s in (0, 1)] == [4, 4]


def test_beyond_and_below_the_frontier_are_flagged_as_bounds(tmp_path):
    sweep = write_sweep(tmp_path / "s", arm={0: (3e12, 2.2, 30.0), 1: (1e12, 3.3, 9.0)})
    report = build_report(load_runs([sweep]))
    seed0, seed1 = [r for r in report.readings if r["arm"] == "random_ltd"]
    assert (seed0["frontier_flag"], seed0["frontier_compute"]) == ("beyond", 4e12)  # better than loss 2.3
    assert seed0["frontier_saving"] == pytest.approx(1 - 3 / 4)  # a lower bound
    assert (seed1["frontier_flag"], seed1["frontier_compute"]) == ("below", 1e12)  # worse than loss 3.1
    assert seed1["frontier_saving"] == pytest.approx(0.0)  # an upper bound
    row = _row(report, "random_ltd", 1.0)
    assert row["frontier_flag"] == "beyond 1, below 1"
    assert "| — (beyond 1, below 1: no bound on the mean) |" in report.to_markdown()  # no ± and factor
    # nor in the CSV, the JSON and the compute column: a mean of a lower and an upper bound (qa42-break 01, 05)
    assert math.isnan(row["frontier_saving_mean"]) and math.isnan(row["frontier_factor_mean"])
    assert math.isnan(row["frontier_compute_mean"]) and row["frontier_n"] == 2
    assert "| — (no bound on the mean) | — (beyond 1, below 1: no bound on the mean) |" in report.to_markdown()
    one = build_report(load_runs([sweep / "8"] + [sweep / str(i) for i in range(4)]))  # seed 0 only: all beyond
    assert _row(one, "random_ltd", 1.0)["frontier_flag"] == "beyond"
    # the frontier needs at least its largest budget's compute, as the saving is at least 25%
    assert "| >= 4e+12 | >= +25.0% (>= 1.33x) |" in one.to_markdown()


def test_a_seed_whose_flops_were_not_counted_is_left_out_of_the_compute_columns(tmp_path):
    """Seed 1's FLOPs are 0 (the EfficiencyMonitor could not count them): its savings are not read, so the row's
    FLOPs, its frontier compute and the flag come from seed 0 alone (the FLOPs mean read 1e12, half seed 0's, and
    seed 1's lower bound turned seed 0's estimate into '>= ...', qa42-break 02-04). Its quality is read: the
    same-length quality delta is a mean over both seeds."""
    sweep = write_sweep(tmp_path / "s", arm={0: (2e12, 2.5, 15.0), 1: (2e12, 2.2, 16.0)})
    record = sweep / "9" / "result.json"
    data = json.loads(record.read_text())
    assert data["seed"] == 1
    data["efficiency"]["flops"] = 0
    record.write_text(json.dumps(data))
    report = build_report(load_runs([sweep]))
    row = _row(report, "random_ltd", 1.0)
    need = math.sqrt(2e12 * 3e12)  # seed 0, as in test_frontier_and_same_length_savings_equal_hand_computations
    assert (row["flops_mean"], row["flops_n"]) == (2e12, 1) and math.isnan(row["flops_std"])
    assert row["frontier_compute_mean"] == pytest.approx(need) and row["frontier_flag"] == "inside"
    assert row["frontier_saving_mean"] == pytest.approx(1 - 2e12 / need) and row["frontier_n"] == 1
    assert row["same_length_quality_delta_mean"] == pytest.approx(((2.5 - 2.3) + (2.2 - 2.35)) / 2)
    assert (row["same_length_quality_delta_n"], row["same_length_n"]) == (2, 1)
    line = next(x for x in report.to_markdown().splitlines() if x.startswith("| random_ltd |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4] == "2e+12 (n=1)" and cells[5] == "1000"  # its tokens were counted
    data["efficiency"]["tokens"], data["efficiency"]["time_train_s"], data["efficiency"]["time_data_s"] = 0, 0, 0
    record.write_text(json.dumps(data))
    again = _row(build_report(load_runs([sweep])), "random_ltd", 1.0)  # nor its tokens and wall time now
    assert (again["tokens_mean"], again["tokens_n"], again["train_wall_s_n"]) == (1000, 1, 1)
    line = next(x for x in build_report(load_runs([sweep])).to_markdown().splitlines() if x.startswith("| random_ltd"))
    assert [c.strip() for c in line.strip("|").split("|")][5:7] == ["1000 (n=1)", "15.0 (n=1)"]
    assert cells[8] == "+0.025 ± 0.2475"  # both seeds: no (n=1)
    assert cells[9] == f"{need:.3g} (n=1)"
    assert cells[10] == f"{100 * (1 - 2e12 / need):+.1f}% ({1 / (2e12 / need):.2f}x) (n=1)"  # an estimate


def test_a_mean_over_exact_readings_and_upper_bounds_is_an_upper_bound_with_the_mean_savings_factor(tmp_path):
    """Seed 0 inside the frontier (2e12 FLOPs at loss 2.5: needs sqrt(2e12 * 3e12), saving 0.1835, 1.22x), seed 1
    below it (3e12 at loss 3.3, worse than the smallest budget's 1e12: saving 1 - 3 = -2, an upper bound, 0.33x). The
    mean saving -0.908 is an upper bound ('<='), and the factor shown is the mean saving's, 1 / 1.908 = 0.52x, not the
    mean of the factors (0.78x, which reads as if the two agreed less than they do)."""
    sweep = write_sweep(tmp_path / "s", arm={0: (2e12, 2.5, 20.0), 1: (3e12, 3.3, 30.0)})
    report = build_report(load_runs([sweep]))
    row = _row(report, "random_ltd", 1.0)
    mean = (1 - 2e12 / math.sqrt(2e12 * 3e12) + (1 - 3)) / 2
    assert row["frontier_saving_mean"] == pytest.approx(mean) and mean == pytest.approx(-0.9082482904638631)
    assert row["frontier_factor_mean"] == pytest.approx(1 / (1 - mean)) and row["frontier_flag"] == "inside 1, below 1"
    # no ± (the spread of a reading and a bound is no spread of the saving); the factor is bounded on the same side
    assert "| <= -90.8% (<= 0.52x) (inside 1, below 1) |" in report.to_markdown()


def test_a_dominated_baseline_budget_leaves_the_frontier(tmp_path):
    # budget 0.75 (3e12, 2.7) is worse than budget 0.5 (2e12, 2.6): the front skips it
    for i, (budget, flops, loss) in enumerate([(0.25, 1e12, 3.0), (0.5, 2e12, 2.6), (0.75, 3e12, 2.7), (1, 4e12, 2.2)]):
        write_record(tmp_path / str(i), budget=budget, flops=flops, loss=loss)
    write_record(tmp_path / "arm", arm="random_ltd", flops=2e12, loss=2.4)
    report = build_report(load_runs([tmp_path]))
    front = report.frontiers[0]["flops"]
    assert front.front == ((1e12, 3.0), (2e12, 2.6), (4e12, 2.2))
    assert [r.budget for r in front.front_runs] == [0.25, 0.5, 1.0]
    # 2.4 is halfway between (2e12, 2.6) and (4e12, 2.2): sqrt(8e24)
    (reading,) = [r for r in report.readings if r["arm"] == "random_ltd"]
    assert reading["frontier_compute"] == pytest.approx(math.sqrt(8) * 1e12)
    on_front = {r["budget"]: r["on_frontier"] for r in report.readings if r["baseline"]}
    assert on_front == {0.25: True, 0.5: True, 0.75: False, 1.0: True}


def test_the_wall_time_front_of_its_own_is_stated_where_it_differs(tmp_path):
    """The paragraph named the compute front's count only; the wall-time column reads a front of its own, from which
    a baseline slower than a longer budget's (timing noise) drops out, and the wall savings read by hand from the
    compute front's runs differed (qa55-user 01)."""
    # budget 0.5 trained longer (30 s) than budget 0.75 (25 s) at a worse loss: off the wall front only
    rows = [(0.25, 1e12, 10.0, 3.0), (0.5, 2e12, 30.0, 2.6), (0.75, 3e12, 25.0, 2.4), (1, 4e12, 40.0, 2.2)]
    for i, (budget, flops, wall, loss) in enumerate(rows):
        write_record(tmp_path / str(i), budget=budget, flops=flops, loss=loss, time_train_s=wall)
    write_record(tmp_path / "arm", arm="random_ltd", flops=2e12, loss=2.4)
    report = build_report(load_runs([tmp_path]))
    assert len(report.frontiers[0]["flops"].front) == 4 and len(report.frontiers[0]["train_wall_s"].front) == 3
    text = report.to_markdown()
    assert "seed 0: 4 of 4 baseline runs on the front" in text
    assert "On training wall time the front is its own (seed 0: 3 of 4 baseline runs on it" in text
    # one front on both axes: no such sentence
    for i, (budget, flops, _, loss) in enumerate(rows):
        write_record(tmp_path / str(i), budget=budget, flops=flops, loss=loss, time_train_s=10.0 * (i + 1))
    assert "On training wall time" not in build_report(load_runs([tmp_path])).to_markdown()


def test_max_mode_metric(tmp_path):
    for i, (budget, flops, acc) in enumerate([(0.5, 10.0, 0.5), (1.0, 1000.0, 0.7)]):
        write_record(tmp_path / str(i), budget=budget, flops=flops, loss=acc, metric="val/acc", mode="max")
    write_record(tmp_path / "arm", arm="random_ltd", flops=50.0, loss=0.6, metric="val/acc", mode="max")
    report = build_report(load_runs([tmp_path]))
    (reading,) = [r for r in report.readings if r["arm"] == "random_ltd"]
    assert reading["frontier_compute"] == pytest.approx(100.0)  # 10^(1 + 0.5 * 2)
    assert reading["frontier_saving"] == pytest.approx(0.5) and reading["frontier_factor"] == pytest.approx(2.0)
    assert reading["same_length_quality_delta"] == pytest.approx(0.6 - 0.7)
    assert reading["same_length_saving"] == pytest.approx(1 - 50 / 1000)


def test_one_budget_gives_empty_frontier_columns_and_says_why(tmp_path):
    write_record(tmp_path / "0", seed=0, flops=4e12, loss=2.3)
    write_record(tmp_path / "1", arm="random_ltd", seed=0, flops=2e12, loss=2.5)
    report = build_report(load_runs([tmp_path]))
    row = _row(report, "random_ltd", 1.0)
    assert math.isnan(row["frontier_saving_mean"]) and row["frontier_flag"] == "" and row["frontier_n"] == 0
    assert row["same_length_saving_mean"] == pytest.approx(0.5)
    assert "the frontier needs >= 2 budgets" in row["note"]
    assert any("frontier of seed 0: baselines at 1 budget (1)" in n for n in report.notes)
    assert "no usable frontier" in report.to_markdown()


def test_compute_tokens_reads_the_token_counts(tmp_path):
    write_record(tmp_path / "0", budget=0.5, tokens=500, loss=2.6)
    write_record(tmp_path / "1", budget=1.0, tokens=1000, loss=2.2)
    write_record(tmp_path / "2", arm="random_ltd", tokens=400, loss=2.4)
    report = build_report(load_runs([tmp_path]), compute="tokens")
    (reading,) = [r for r in report.readings if r["arm"] == "random_ltd"]
    assert reading["frontier_compute"] == pytest.approx(math.sqrt(500 * 1000))
    assert reading["same_length_saving"] == pytest.approx(1 - 400 / 1000)


def test_mixed_metrics_need_a_chosen_metric(tmp_path):
    write_record(tmp_path / "a", loss=2.0)
    write_record(tmp_path / "b", arm="random_ltd", metric="val/acc", mode="max", loss=0.5)
    runs = load_runs([tmp_path])
    with pytest.raises(ReportError, match=r"runs optimize different metrics: 'val/acc' \(1 runs.*'val/loss'"):
        build_report(runs)
    with pytest.raises(ReportError, match=r"b/result.json: no final 'val/loss' among its metrics \['train/loss'"):
        build_report(runs, metric="val/loss")
    # a metric both runs logged and neither optimized: its direction is read from its name, as write_result reads it
    report = build_report(runs, metric="train/loss")
    assert report.mode == "min" and [r["quality"] for r in report.readings] == [2.5, 2.5]
    assert build_report(runs, metric="train/loss", mode="min").mode == "min"


def test_a_metric_no_run_optimizes_takes_its_direction_from_its_name(tmp_path):
    """``metric="val/acc"`` over runs that optimized the loss: max by its name (as ``write_result`` reads it); a name
    that says neither must be given a mode."""
    for arm, acc in (("baseline", 0.8), ("random_ltd", 0.9)):
        write_record(tmp_path / arm, arm=arm, metrics={"val/loss": 2.0, "val/acc": acc, "val/z": 1.0})
    runs = load_runs([tmp_path])
    report = build_report(runs, metric="val/acc")
    assert report.mode == "max" and sorted(r["quality"] for r in report.readings) == [0.8, 0.9]
    with pytest.raises(ReportError, match=r"no run optimizes 'val/z' and its name does not say whether lower or high"):
        build_report(runs, metric="val/z")
    assert build_report(runs, metric="val/z", mode="min").mode == "min"
    # a mode against the name, which write_result refuses, ranked the runs backwards without a word (qa83-report 03)
    with pytest.raises(ReportError, match=r"mode='min' \(--mode\) contradicts metric 'val/acc', whose name says high"):
        build_report(runs, metric="val/acc", mode="min")
    assert build_report(runs, metric="val/acc", mode="max").mode == "max"


def test_errors_name_the_file_or_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere: no such file or folder"):
        load_runs([tmp_path / "nowhere"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no result.json in this folder or below"):
        load_runs([tmp_path / "empty"])
    old = tmp_path / "old"
    old.mkdir()
    (old / "result.json").write_text(json.dumps({"seed": 0, "metric": 2.0, "optimized_metric": "val/loss"}))
    with pytest.raises(ReportError, match=r"old/result.json: no 'schema'.*older version.*rerun"):
        load_runs([old])
    (old / "result.json").write_text("{not json")
    with pytest.raises(ReportError, match=r"old/result.json: unreadable run record \(JSONDecodeError"):
        load_runs([old])
    write_record(tmp_path / "noarm", arm="baseline")
    record = json.loads((tmp_path / "noarm" / "result.json").read_text())
    del record["curve"]
    (tmp_path / "noarm" / "result.json").write_text(json.dumps(record))
    with pytest.raises(ReportError, match=r"noarm/result.json: no 'curve'"):
        load_runs([tmp_path / "noarm"])
    write_record(tmp_path / "mode", optimized_mode="lower")
    with pytest.raises(ReportError, match=r"mode/result.json: 'optimized_mode' mode: expected 'min'"):
        load_runs([tmp_path / "mode"])


def test_runs_without_an_optimized_metric_are_read_at_a_chosen_metric(tmp_path):
    """The app accepts optimized_metric=null (e.g. a test-only run) and records null: the report refused such a
    record even with --metric. It reads it at the chosen metric, and without one says to choose."""
    for seed in (0, 1):
        loss = 2.0 + seed
        write_record(tmp_path / f"b{seed}", seed=seed, loss=loss, metric=None, metrics={"val/loss": loss})
    runs = load_runs([tmp_path])
    assert [r.metric_name for r in runs] == [None, None]
    report = build_report(runs, metric="val/loss")
    assert report.metric == "val/loss" and report.mode == "min"  # from the name: a loss
    assert [r["quality"] for r in report.readings] == [2.0, 3.0]
    with pytest.raises(ReportError, match=r"2 run\(s\) optimized no metric \(optimized_metric: null.*--metric"):
        build_report(runs)


def test_runs_that_cannot_be_compared_are_refused(tmp_path):
    write_record(tmp_path / "a", seed=0)
    write_record(tmp_path / "b", seed=0)
    with pytest.raises(ReportError, match=r"2 runs of arm 'baseline', budget 1, seed 0: .*a, .*b; ") as err:
        build_report(load_runs([tmp_path]))
    # the advice works in the Hydra app (arm is a config group there: +arm=<name> is refused) and from Python
    assert "a config file conf/arm/<name>.yaml holding '# @package _global_' and 'arm: <name>'" in str(err.value)
    assert "+arm" not in str(err.value) and "write_result(..., arm='<name>')" in str(err.value)
    assert "different lengths" not in str(err.value)  # equal lengths: variants to label
    # runs of different lengths at one budget are budgets recorded without theirs (write_result's default 1.0): the
    # message named only labels, which would put each length on the frontier as an arm of its own (qa102-user 02)
    write_record(tmp_path / "a", seed=0, length={"max_steps": -1, "max_epochs": 2, "optimizer_steps": 8})
    write_record(tmp_path / "b", seed=0, length={"max_steps": -1, "max_epochs": 4, "optimizer_steps": 16})
    with pytest.raises(
        ReportError, match=r"trained different lengths \(max_epochs 2, 4\).*write_result\(\.\.\., budget"
    ):
        build_report(load_runs([tmp_path]))
    # one length set, other steps taken (InfoBatch's shorter epochs, an early stop): variants, not budgets
    # (qa103-regress 01)
    write_record(tmp_path / "b", seed=0, length={"max_steps": -1, "max_epochs": 2, "optimizer_steps": 6})
    with pytest.raises(ReportError, match=r"2 runs of arm 'baseline'") as err:
        build_report(load_runs([tmp_path]))
    assert "different lengths" not in str(err.value)
    write_record(tmp_path / "b", seed=1, techniques={"random_ltd": {}})
    with pytest.raises(ReportError, match=r"b: arm 'baseline' but techniques \['random_ltd'\]"):
        build_report(load_runs([tmp_path]))
    write_record(tmp_path / "b", seed=1, task_name="vit_stack")
    with pytest.raises(ReportError, match=r"runs of several tasks: 'gpt_stack' \(1 runs"):
        build_report(load_runs([tmp_path]))
    with pytest.raises(ReportError, match="compute: expected one of"):
        build_report(load_runs([tmp_path / "a"]), compute="steps")


def test_a_run_without_a_finite_metric_is_left_out_and_noted(tmp_path):
    sweep = write_sweep(tmp_path / "s")
    write_record(sweep / "3", budget=1.0, seed=0, loss=None, flops=4e12)  # seed 0's full baseline diverged
    report = build_report(load_runs([sweep]))
    assert any("3: val/loss is not finite" in n for n in report.notes)
    assert _row(report, "baseline", 1.0)["quality_n"] == 1
    assert "(n=1)" in report.to_markdown()
    seed0 = [r for r in report.readings if r["arm"] == "random_ltd"][0]
    assert math.isnan(seed0["same_length_saving"])  # no usable same-length baseline for seed 0
    assert any("random_ltd@1 seed 0: no baseline run of seed 0 at budget 1" in n for n in report.notes)
    assert seed0["frontier_compute"] == pytest.approx(math.sqrt(6) * 1e12)  # the 3 other budgets still frame it
    # the arm's same-length figures come from seed 1 alone: its cells say so; its frontier reading has both seeds
    arm = _row(report, "random_ltd", 1.0)
    assert (arm["n_seeds"], arm["same_length_n"], arm["frontier_n"]) == (2, 1, 2)
    line = next(x for x in report.to_markdown().splitlines() if x.startswith("| random_ltd | 1 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[7].endswith("(n=1)") and cells[8].endswith("(n=1)")  # same-length saving and quality delta
    assert "(n=" not in cells[9] and "(n=" not in cells[10]  # frontier compute and saving: every seed


def test_several_baseline_arms_use_the_best_at_each_budget(tmp_path):
    write_record(tmp_path / "0", budget=0.5, flops=2e12, loss=2.6)
    write_record(tmp_path / "1", budget=1.0, flops=4e12, loss=2.3)
    write_record(tmp_path / "2", arm="baseline_lr_high", techniques={}, budget=1.0, flops=4e12, loss=2.2)
    write_record(tmp_path / "3", arm="random_ltd", budget=1.0, flops=2e12, loss=2.4)
    report = build_report(load_runs([tmp_path]))
    (reading,) = [r for r in report.readings if r["arm"] == "random_ltd"]
    assert reading["same_length_baseline"].endswith("2")
    assert reading["same_length_quality_delta"] == pytest.approx(2.4 - 2.2)
    assert report.frontiers[0]["flops"].front == ((2e12, 2.6), (4e12, 2.2))
    assert [r["arm"] for r in report.rows] == ["baseline", "baseline", "baseline_lr_high", "random_ltd"]
    assert ARM and BASELINES  # the shared sweep constants are importable


def test_variants_of_an_arm_from_a_settings_sweep_are_told_apart(sweep):
    """An Optuna or grid sweep trains the same arm at the same budget and seed with other settings: each setting is
    its own arm, ``arm[key=value]``, and its seeds are aggregated together."""
    for job, (seed, min_value, loss) in enumerate(((0, 32, 2.5), (1, 32, 2.55), (0, 64, 2.4), (1, 64, 2.45))):
        write_record(
            sweep / f"trial{job}",
            arm="random_ltd",
            seed=seed,
            loss=loss,
            flops=2e12,
            overrides=[f"seed={seed}", f"callbacks.random_ltd.min_value={min_value}", "hydra.sweeper.n_trials=4"],
        )
    # the sweep's own random_ltd runs have the default overrides (no min_value): a third variant
    report = build_report(load_runs([sweep]))
    arms = {r["arm"] for r in report.rows}
    assert {"random_ltd[callbacks.random_ltd.min_value=32]", "random_ltd[callbacks.random_ltd.min_value=64]"} <= arms
    row = _row(report, "random_ltd[callbacks.random_ltd.min_value=64]", 1.0)
    assert row["seeds"] == "0;1" and math.isclose(row["quality_mean"], 2.425)
    assert "random_ltd[callbacks.random_ltd.min_value=default]" in arms  # the sweep's runs without the override


def test_runs_of_one_arm_with_other_recorded_settings_are_variants_not_seeds(sweep):
    """Two seeds of random_ltd whose recorded settings differ (min_value 32 at seed 0, 64 at seed 1: changed in a
    config file, so the overrides are the same) were averaged as 2 seeds of one arm; each setting is now its own arm.
    The draws' seed keys differ with the run's seed and split nothing; nor do settings that differ between budgets."""
    for seed, min_value in ((0, 32), (1, 64)):
        settings = {"random_ltd": {"min_value": min_value, "seed": seed, "require_steps": 10}}
        write_record(sweep / f"a{seed}", arm="random_ltd", seed=seed, loss=2.5, flops=2e12, techniques=settings)
        longer = {"random_ltd": {"min_value": 32, "seed": seed, "require_steps": 20}}
        write_record(sweep / f"b{seed}", arm="random_ltd", budget=2.0, seed=seed, flops=4e12, techniques=longer)
    for job in (8, 9):  # the sweep's own random_ltd arm (budget 1.0): moved aside
        (sweep / str(job) / "result.json").unlink()
    report = build_report(load_runs([sweep]))
    arms = sorted({(r["arm"], r["budget"], r["n_seeds"]) for r in report.rows if not r["baseline"]})
    assert arms == [
        ("random_ltd[random_ltd.min_value=32]", 1.0, 1),
        ("random_ltd[random_ltd.min_value=32]", 2.0, 2),
        ("random_ltd[random_ltd.min_value=64]", 1.0, 1),
    ]


def test_a_removed_setting_tells_variants_apart(sweep):
    """``~key`` (a setting removed from the arm's config) is a variant of its own, ``key=<removed>``, beside the runs
    that keep the default; ``++key=v`` reads as ``key=v``."""
    for job, (seed, override) in enumerate(
        ((0, "~callbacks.random_ltd.min_value"), (0, "++callbacks.random_ltd.min_value=8"))
    ):
        write_record(sweep / f"trial{job}", arm="random_ltd", seed=seed, loss=2.5, flops=2e12, overrides=[override])
    arms = {r["arm"] for r in build_report(load_runs([sweep])).rows}
    assert {
        "random_ltd[callbacks.random_ltd.min_value=<removed>]",
        "random_ltd[callbacks.random_ltd.min_value=8]",
    } <= arms


def test_baselines_whose_compute_does_not_grow_with_their_budget_are_noted(tmp_path):
    """Two baseline budgets that trained one length (a loop of the user's own passing ``budget=`` to the record but
    not scaling ``max_steps``) made a frontier of one point per seed, read as two budgets with no note (qa75-user
    03)."""
    write_record(tmp_path / "0", budget=0.5, flops=4e12, loss=2.35)
    write_record(tmp_path / "1", budget=1.0, flops=4e12, loss=2.3)
    write_record(tmp_path / "2", arm="random_ltd", budget=1.0, flops=3e12, loss=2.4)
    notes = build_report(load_runs([tmp_path])).notes
    assert [n for n in notes if "budget" in n and "spent no more" in n] == [
        "frontier of seed 0: its baseline at budget 1 spent no more flops than the one at budget 0.5 (4e+12 against "
        "4e+12; configured for max_steps=10, max_epochs=-1 and max_steps=10, max_epochs=-1): the budgets' lengths do "
        "not follow their labels (a budget scales the run's length: max_steps or max_epochs)"
    ]
    write_record(tmp_path / "0", budget=0.5, flops=2e12, loss=2.6)  # half the compute: no note
    assert not [n for n in build_report(load_runs([tmp_path])).notes if "spent no more" in n]
    # another baseline arm (twice the batch) is read on its own: its budget 0.5 against the baseline's budget 1 was
    # noted (qa76-regress 03)
    write_record(tmp_path / "3", arm="baseline_bs2x", techniques={}, budget=0.5, flops=4e12, loss=2.4)
    write_record(tmp_path / "4", arm="baseline_bs2x", techniques={}, budget=1.0, flops=8e12, loss=2.2)
    assert not [n for n in build_report(load_runs([tmp_path])).notes if "spent no more" in n]


def test_run_folders_below_the_current_directory_are_recorded_relative_to_it(tmp_path, monkeypatch):
    """A sweep under the repository (the Hydra report callback passes its absolute folder): the readings name the
    runs relative to the current directory, so a committed report.json holds no machine's paths."""
    sweep = tmp_path / "logs" / "sweep"
    write_record(sweep / "0", budget=0.5, flops=2e12, loss=2.6)
    write_record(sweep / "1", budget=1.0, flops=4e12, loss=2.3)
    write_record(sweep / "2", arm="random_ltd", budget=1.0, flops=2e12, loss=2.4)
    monkeypatch.chdir(tmp_path)
    report = build_report(load_runs([sweep.resolve()]))
    (reading,) = [r for r in report.readings if r["arm"] == "random_ltd"]
    assert (reading["path"], reading["same_length_baseline"]) == ("logs/sweep/2", "logs/sweep/1")
    # and so do the frontiers' run lists (they were absolute, qa75-user 01)
    (frontier,) = report.to_dict()["frontiers"].values()
    assert frontier["flops"]["runs"] == ["logs/sweep/0", "logs/sweep/1"]
    assert frontier["flops"]["front_runs"] == ["logs/sweep/0", "logs/sweep/1"]
    monkeypatch.chdir(tmp_path / "logs" / "sweep" / "0")  # the runs are not below it: kept as given
    report = build_report(load_runs([sweep.resolve()]))
    (reading,) = [r for r in report.readings if r["arm"] == "random_ltd"]
    assert reading["path"] == str(sweep.resolve() / "2")


def test_a_users_own_method_without_a_library_technique_is_an_arm_and_a_resume_without_one_is_noted(tmp_path):
    """``arm="mytrick"`` with no technique callback is the user's own method: read against the frontier, not part of
    it (it was a third baseline point). A record whose technique was dropped on resume is noted."""
    write_record(tmp_path / "0", budget=0.5, flops=2e12, loss=2.6)
    write_record(tmp_path / "1", budget=1.0, flops=4e12, loss=2.3)
    write_record(tmp_path / "2", arm="mytrick", techniques={}, budget=1.0, flops=3e12, loss=2.2)
    write_record(
        tmp_path / "3",
        arm="random_ltd",
        budget=1.0,
        flops=2e12,
        loss=2.4,
        techniques={"random_ltd": {"resumed_without": True}},
    )
    report = build_report(load_runs([tmp_path]))
    assert report.frontiers[0]["flops"].points == ((2e12, 2.6), (4e12, 2.3))
    (mine,) = [r for r in report.readings if r["arm"] == "mytrick"]
    assert (
        not mine["baseline"] and mine["frontier_flag"] == "beyond" and mine["same_length_saving"] == pytest.approx(0.25)
    )
    assert any(n.startswith("random_ltd@1 seed 0: resumed from a checkpoint without random_ltd") for n in report.notes)


def test_an_arm_of_another_length_than_its_same_length_baseline_is_noted(tmp_path):
    """An arm labelled budget 1.0 that trained 16 steps (trainer.max_steps overridden), read against the budget-1.0
    baselines of 10: its same-length reading compares runs of different lengths, said in a note; an arm of the same
    length gets none."""
    sweep = write_sweep(tmp_path / "s")
    assert not [n for n in build_report(load_runs([sweep])).notes if "same-length baseline (" in n]
    arm = json.loads((sweep / "8" / "result.json").read_text())
    assert (arm["arm"], arm["seed"]) == ("random_ltd", 0)
    arm["length"] = {"max_steps": 16, "max_epochs": -1, "optimizer_steps": 16}
    (sweep / "8" / "result.json").write_text(json.dumps(arm))
    notes = build_report(load_runs([sweep])).notes
    (note,) = [n for n in notes if "same-length baseline (" in n]
    assert note.startswith("random_ltd@1 seed 0: configured for max_steps=16, max_epochs=-1, its same-length baseline")
    assert "for max_steps=10, max_epochs=-1, at the same budget label 1" in note


def test_an_arm_with_other_model_or_data_overrides_than_its_same_length_baseline_is_noted(tmp_path):
    """An arm trained on a wider model and a larger batch than its baselines: the same-length reading compares two
    setups, said in a note naming each differing key; a technique setting or a length override is not such a key."""
    base = ["arm=baseline_100", "seed=0", "trainer.max_steps=10", "model.optimizer.lr=0.001"]
    write_record(tmp_path / "0", budget=0.5, flops=2e12, loss=2.6, overrides=base)
    write_record(tmp_path / "1", budget=1.0, flops=4e12, loss=2.3, overrides=base)
    same = ["arm=technique", "seed=0", "callbacks.random_ltd.min_value=32", "trainer.max_steps=12"]
    write_record(tmp_path / "2", arm="random_ltd", budget=1.0, flops=3e12, loss=2.4, overrides=[*same, base[-1]])
    assert not [n for n in build_report(load_runs([tmp_path])).notes if "overrides differ" in n]
    other = [*same, "model.n_embd=128", "data.batch_size=16", "~trainer.gradient_clip_val"]
    write_record(tmp_path / "2", arm="random_ltd", budget=1.0, flops=3e12, loss=2.4, overrides=other)
    (note,) = [n for n in build_report(load_runs([tmp_path])).notes if "overrides differ" in n]
    assert note.startswith("random_ltd@1 seed 0: its model, data or trainer overrides differ from its same-length")
    assert (
        "data.batch_size=16 vs default; model.n_embd=128 vs default; model.optimizer.lr=default vs 0.001; "
        "trainer.gradient_clip_val=<removed> vs default;" in note
    )


def test_an_arm_without_a_same_length_baseline_is_compared_with_its_frontiers_setup(tmp_path):
    """An arm at a budget no baseline trained (its frontier reading only) on a smaller model and batch than the
    frontier's baselines: noted, naming each key; the frontier itself joining baselines of two datasets is noted."""
    for budget, flops, loss in ((0.5, 1e12, 3.0), (1.0, 2e12, 2.5)):
        tokens = int(1000 * budget)  # one model: the FLOPs per token of both budgets are the same
        write_record(
            tmp_path / f"b{budget}", budget=budget, flops=flops, tokens=tokens, loss=loss, overrides=["model.n_layer=4"]
        )
    other = ["model.n_layer=2", "data.batch_size=8", "callbacks.random_ltd.min_value=32"]
    write_record(tmp_path / "arm", arm="random_ltd", budget=2.0, flops=1.5e12, loss=2.4, overrides=other)
    notes = build_report(load_runs([tmp_path])).notes
    assert (
        "random_ltd@2 seed 0: its model, data or trainer overrides differ from those of its frontier's baselines "
        "(seed 0): data.batch_size=8 vs default; model.n_layer=2 vs 4; its frontier reading compares other setups, "
        "not only the technique"
    ) in notes
    write_record(tmp_path / "arm", arm="random_ltd", budget=2.0, flops=1.5e12, loss=2.4, overrides=["model.n_layer=4"])
    assert not [n for n in build_report(load_runs([tmp_path])).notes if "differ" in n]
    write_record(tmp_path / "b0.5", budget=0.5, flops=1e12, loss=3.0, overrides=["model.n_layer=4", "data=other"])
    assert (
        "frontier of seed 0: its baselines' model, data or trainer overrides differ (data: other at budget 0.5, "
        "default at budget 1); it joins runs of other setups, not one setup at several budgets"
    ) in build_report(load_runs([tmp_path])).notes


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("overrides", "seed=0", r"'overrides' must be a list of strings \(the Hydra overrides\), got 'seed=0'"),
        ("overrides", [1], r"'overrides' must be a list of strings"),
        ("length", {"max_steps": "10"}, r"'length\.max_steps' must be an int or null, got '10'"),
        ("length", [10], r"'length' must be an object"),
        # a crash (AttributeError) reading the arm's quality step (qa106-break 06)
        ("curve", [{"step": 1, "metrics": ["val/loss", 3.5]}], r"curve\[0\]\.metrics must be an object \(metric"),
        ("curve", [{"step": 1, "metrics": None}, {"metrics": "val/loss=3"}], r"curve\[1\]\.metrics must be an"),
    ],
)
def test_a_record_field_of_the_wrong_type_is_refused_naming_it(tmp_path, field, value, message):
    """A hand-edited record: a string of overrides was read character by character, a text max_steps compared as
    text; both are refused naming the file and the field."""
    write_record(tmp_path / "0", **{field: value})
    with pytest.raises(ReportError, match=r"0/result\.json: " + message):
        load_runs([tmp_path])


def _with_baseline(folder, plain_flops, tokens=1000, samples=10):
    """Add the EfficiencyMonitor's baseline figures (the model without the technique) to a technique's record."""
    file = folder / "result.json"
    record = json.loads(file.read_text())
    record["efficiency"].update(baseline_flops=plain_flops, baseline_tokens=tokens, baseline_samples=samples)
    file.write_text(json.dumps(record))
    return folder


def test_an_arm_of_another_model_than_its_baselines_is_noted(tmp_path):
    """A user who edited the model (4 -> 8 layers) between the baselines and the technique run got a clean saving
    and no note: nothing in the overrides differed. The monitor's baseline FLOPs per token tell the models apart."""
    for budget, flops in ((0.5, 5e11), (1.0, 1e12)):
        write_record(tmp_path / f"b{budget}", budget=budget, flops=flops, tokens=int(1000 * budget), loss=3 - budget)
    same = _with_baseline(write_record(tmp_path / "same", arm="random_ltd", flops=7e11, loss=2.1), 1e12)
    other = _with_baseline(write_record(tmp_path / "other", arm="vcycle", flops=1.4e12, loss=2.1), 2e12)
    notes = build_report(load_runs([tmp_path])).notes
    plain = [n for n in notes if "training FLOPs per token" in n]
    assert len(plain) == 1 and plain[0].startswith("vcycle@1 seed 0: the model without its techniques costs 2e+09")
    assert "2.00x its baselines' 1e+09" in plain[0]
    # within 1.5x (a curriculum's less padded batches: 0.86x, InfoBatch's estimate on padded text: 1.14x, in QA
    # runs) nothing is noted; nor a method of the user's own recorded from a plain Trainer (no technique: its FLOPs
    # are not the plain model's)
    _with_baseline(other, 1.14e12)
    write_record(tmp_path / "own", arm="progressive_freezing", techniques={}, flops=6e11, loss=2.2)
    assert not [n for n in build_report(load_runs([tmp_path])).notes if "FLOPs per" in n]
    assert same.exists()


@pytest.mark.parametrize(("flops", "noted"), [(2e12, True), (1.33e12, True), (1.05e12, False)])
def test_baselines_of_different_models_in_one_frontier_are_noted(tmp_path, flops, noted):
    """Twice the FLOPs per token, or 1.33x (6 -> 8 layers: read as one frontier under the arms' 1.5x bound, with a
    saving and no note, qa60-audit 01); 1.05x (a padded data set's budgets) is one setup."""
    write_record(tmp_path / "b0.5", budget=0.5, flops=5e11, tokens=500, loss=2.5)
    write_record(tmp_path / "b1", budget=1.0, flops=flops, tokens=1000, loss=2.0)
    notes = build_report(load_runs([tmp_path])).notes
    told = [n for n in notes if n.startswith("frontier of seed 0: its baselines' training FLOPs per token differ")]
    assert len(told) == noted
    if noted:
        assert f"(1e+09 at budget 0.5, {flops / 1000:.4g} at budget 1)" in told[0]


def test_a_configuration_recorded_by_write_result_is_compared_like_overrides(tmp_path):
    """write_result(config=...) (a LightningCLI run's config, ResultWriter's default) records the setup as overrides:
    a random-LTD arm left at n_layer=3 and lr=0.01 read +30.7% against 4-layer baselines with no note (qa39-user
    03). The technique's DataModule wrapper, the callbacks and the length are not setup keys."""
    from lightning_effi.report.record import config_overrides

    def config(n_layer, lr, steps, wrapped=False):
        user = {"class_path": "my.DM", "init_args": {"batch_size": 16}}
        wrapper = {"class_path": "lightning_effi.CurriculumDataModule", "init_args": {"datamodule": user}}
        data = wrapper if wrapped else user
        return {
            "seed_everything": 0,
            "model": {"class_path": "my.GPT", "init_args": {"n_layer": n_layer, "lr": lr}},
            "data": data,
            "trainer": {"max_steps": steps, "callbacks": [{"class_path": "lightning_effi.EfficiencyMonitor"}]},
            # an LR schedule sized to each run's length, as the protocol asks: not a setup difference (qa40-break 03)
            "lr_scheduler": {"class_path": "CosineAnnealingLR", "init_args": {"T_max": steps}},
        }

    overrides = config_overrides(config(4, 0.001, 30))
    assert [o for o in overrides if not o.startswith("lr_scheduler.")] == [
        'data.class_path="my.DM"',
        "data.init_args.batch_size=16",
        'model.class_path="my.GPT"',
        "model.init_args.lr=0.001",
        "model.init_args.n_layer=4",
        "trainer.max_steps=30",
    ]
    assert config_overrides(config(4, 0.001, 30, wrapped=True)) == overrides
    write_record(tmp_path / "0", budget=0.5, flops=2e12, loss=2.6, overrides=config_overrides(config(4, 0.001, 30)))
    write_record(tmp_path / "1", budget=1.0, flops=4e12, loss=2.3, overrides=config_overrides(config(4, 0.001, 60)))
    same = config_overrides(config(4, 0.001, 60, wrapped=True))
    write_record(tmp_path / "2", arm="random_ltd", budget=1.0, flops=3e12, loss=2.4, overrides=same)
    assert not [n for n in build_report(load_runs([tmp_path])).notes if "overrides differ" in n]
    other = config_overrides(config(3, 0.01, 60, wrapped=True))
    write_record(tmp_path / "2", arm="random_ltd", budget=1.0, flops=3e12, loss=2.4, overrides=other)
    (note,) = [n for n in build_report(load_runs([tmp_path])).notes if "overrides differ" in n]
    assert "model.init_args.lr=0.01 vs 0.001; model.init_args.n_layer=3 vs 4" in note


def test_a_hydra_configs_list_settings_are_recorded_by_value():
    """A Hydra app's cfg (a DictConfig) passed as config: every list setting was recorded as the text
    "omegaconf.listconfig.ListConfig(...)", so runs differing only in betas or depths read alike (qa106-break 08)."""
    from omegaconf import OmegaConf

    from lightning_effi.report.load import json_safe
    from lightning_effi.report.record import config_overrides

    cfg = OmegaConf.create({"model": {"lr": 0.1, "betas": [0.9, 0.95], "depths": [[2, 2], "${model.lr}"]}})
    assert config_overrides(cfg) == ["model.betas=[0.9, 0.95]", "model.depths=[[2, 2], 0.1]", "model.lr=0.1"]
    assert config_overrides({"model": cfg.model}) == config_overrides(cfg)
    assert json_safe(OmegaConf.create([1, float("nan"), {"a": (2, 3)}])) == [1, None, {"a": [2, 3]}]
    assert json_safe("ab") == "ab" and json_safe(b"ab") == b"ab" and json_safe(range(2)) == [0, 1]


def test_write_result_takes_a_configuration_as_override_strings_and_refuses_other_types(tmp_path):
    """config may also be a list of key=value strings (as Hydra's overrides; a CLI user's sweep script had them:
    qa39-user 03 passed such a list and got a bare "dictionary update sequence" error); anything else is refused
    naming the parameter."""
    from lightning_effi.report.record import _config_overrides

    assert _config_overrides(["model.n_layer=3", "data.batch_size=16"]) == ["data.batch_size=16", "model.n_layer=3"]
    assert _config_overrides(None) is None
    # Hydra's own overrides list (HydraConfig.get().overrides.task) is a ListConfig (qa48-break 01)
    from omegaconf import OmegaConf

    assert _config_overrides(OmegaConf.create(["model.n_layer=3", "data.batch_size=16"])) == [
        "data.batch_size=16",
        "model.n_layer=3",
    ]
    from lightning_effi.report import ResultWriter

    assert ResultWriter(metric="val/loss", config=OmegaConf.create(["a=1"])).config == ["a=1"]
    with pytest.raises(ValueError, match=r"ResultWriter: config must be 'cli', a mapping, a list of 'key=value'"):
        ResultWriter(metric="val/loss", config=["a"])
    with pytest.raises(ValueError, match=r"write_result: config must be a mapping .* or a list of 'key=value' strings"):
        _config_overrides(["n_layer"])
    with pytest.raises(ValueError, match=r"write_result: config must be a mapping"):
        _config_overrides(3)


class _BytesPath:
    """An os.PathLike whose path is bytes."""

    def __fspath__(self) -> bytes:
        return b"runs/r1"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(metric="val/loss", budget=0), r"ResultWriter: budget must be a number > 0"),
        (dict(metric="val/loss", mode="max"), r"ResultWriter: mode='max' contradicts metric 'val/loss'"),
        (dict(metric="val/widgets"), r"ResultWriter: mode: the metric name 'val/widgets' does not say"),
        (dict(metric="val/loss", arm="a\nb"), r"ResultWriter: arm must be None"),
        (dict(metric="val/loss", seed=-1), r"ResultWriter: seed must be None or an int"),
        (dict(metric="val/loss", config=3), r"ResultWriter: config must be 'cli', a mapping, a list of"),
        (dict(metric=None), r"ResultWriter: metric must be the name of a logged metric \(a non-empty str\), got None"),
        (dict(metric=""), r"ResultWriter: metric must be the name of a logged metric"),
        (dict(metric="val/loss", out_dir=1.5), r"ResultWriter: out_dir must be None, a str or a path .*got 1\.5"),
        # a path to bytes failed in pathlib after the fit (qa61-ideas 05)
        (dict(metric="val/loss", out_dir=_BytesPath()), r"ResultWriter: out_dir must be .*a path to a str"),
        # an existing file: refused after the whole fit (qa62-break 07)
        (dict(metric="val/loss", out_dir=__file__), r"ResultWriter: out_dir must be a folder .*, a file$"),
        # a folder beneath a file, which cannot be made (qa63-break 04)
        (dict(metric="val/loss", out_dir=f"{__file__}/seed0"), r"ResultWriter: out_dir must be .*beneath a file: "),
        # a Hydra interpolation never resolved, a link to nothing (qa65-break 07, 08)
        (dict(metric="val/loss", out_dir="${hydra:runtime.output_dir}"), r"holds an unresolved interpolation"),
    ],
)
def test_a_result_writer_refuses_bad_settings_when_built(kwargs, message):
    """Refused when the callback is built, not after the whole fit it would have recorded."""
    from lightning_effi.report import ResultWriter

    with pytest.raises(ValueError, match=message):
        ResultWriter(**kwargs)


def _fit_with_result_writer(root, seed, metric="val/loss", **trainer_kwargs):
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_effi import EfficiencyMonitor
    from lightning_effi.report import ResultWriter

    class Linear(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 3)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val/loss", torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    pl.seed_everything(seed)
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    writer = ResultWriter(metric=metric, seed=seed)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        default_root_dir=root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[EfficiencyMonitor(print_summary=False), writer],
        **trainer_kwargs,
    )
    trainer.fit(Linear(), DataLoader(data, batch_size=16), DataLoader(data, batch_size=16))
    return writer


def test_a_result_writer_of_a_fit_that_never_validated_names_the_cause(tmp_path):
    """A fit that ends before its first validation failed with only "metric 'val/loss' was not logged" (qa102-user
    03): the error says no validation ran and how to validate at the end; a test metric, that the record is written
    before trainer.test()."""
    with pytest.raises(ValueError, match=r"was not logged; .*; this fit ran no validation .*val_check_interval") as err:
        _fit_with_result_writer(tmp_path, 0, max_steps=1)
    assert "trainer.test" not in str(err.value)
    with pytest.raises(
        ValueError, match=r"'test/acc' was not logged; .*\['val/loss'\]; the record is written at"
    ) as err:
        _fit_with_result_writer(tmp_path, 0, metric="test/acc")
    assert "write_result(trainer, ..., metrics=trainer.test(...)[0])" in str(err.value)
    assert "no validation" not in str(err.value)  # this fit validated


def test_a_result_writer_refuses_a_file_or_no_seed_before_the_fit(tmp_path, monkeypatch):
    """An out_dir that is a file, or no seed, was refused after the whole fit, with no record written
    (qa58-args 02): now at the fit's start, before a step."""
    import lightning.pytorch as pl

    from lightning_effi import EfficiencyMonitor
    from lightning_effi.report import ResultWriter
    from tests.helpers.tiny import tiny_gpt2, tiny_lm_data

    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    late = ResultWriter(metric="val/loss", seed=0, out_dir=tmp_path / "file")  # a file made after it was built
    (tmp_path / "file").write_text("mine")
    for writer, message in (
        (late, r"out_dir must be a folder .*, a file$"),
        (ResultWriter(metric="val/loss", out_dir=tmp_path / "run"), r"seed=None, and pl.seed_everything was never"),
        (ResultWriter(metric="val/loss", seed=0, out_dir=tmp_path / "run"), r"the Trainer has no EfficiencyMonitor"),
    ):
        monitor = [] if "no EfficiencyMonitor" in message else [EfficiencyMonitor(print_summary=False)]
        trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             callbacks=[*monitor, writer])  # fmt: skip
        with pytest.raises(ValueError, match="^ResultWriter: " + message):
            trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
        assert trainer.global_step == 0
    assert (tmp_path / "file").read_text() == "mine"


def test_a_result_writer_refuses_a_bad_setting_set_after_it_was_built_before_the_fit(tmp_path, monkeypatch):
    """A value set on the writer after it was built (a notebook cell) was refused only by write_result, after the
    whole fit, the record lost: now at the fit's start, before a step, with the constructor's error."""
    import lightning.pytorch as pl

    from lightning_effi import EfficiencyMonitor
    from lightning_effi.report import ResultWriter
    from tests.helpers.tiny import tiny_gpt2, tiny_lm_data

    for name, value, message in (
        ("mode", "max", r"mode='max' contradicts metric 'val/loss'"),
        ("budget", 0, r"budget must be a number > 0"),
        ("seed", -1, r"seed must be None or an int"),
        ("arm", "a\nb", r"arm must be None"),
        ("config", 3, r"config must be 'cli', a mapping"),
        ("out_dir", __file__, r"out_dir must be a folder .*, a file$"),
    ):
        writer = ResultWriter(metric="val/loss", seed=0, out_dir=tmp_path / "run")
        setattr(writer, name, value)
        trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             callbacks=[EfficiencyMonitor(print_summary=False), writer])  # fmt: skip
        with pytest.raises(ValueError, match="^ResultWriter: " + message):
            trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
        assert trainer.global_step == 0, name
    writer = ResultWriter(metric="val/loss", seed=0)
    writer.out_dir = "~/runs/x"  # taken as the constructor takes it
    monitor = EfficiencyMonitor(print_summary=False)
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         callbacks=[monitor, writer], val_check_interval=1, limit_val_batches=1)  # fmt: skip
    monkeypatch.setenv("HOME", str(tmp_path))
    trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    assert writer.path == tmp_path / "runs" / "x" / "result.json" and writer.path.exists()


def test_a_result_writer_setting_set_during_a_fit_is_the_next_fits(tmp_path):
    """A value set on the writer from a callback's hook was passed to write_result unchecked: a bad one lost the record
    after the whole fit, a good one was recorded as the fit's, out_dir was ignored in silence (qa92-break 03). It is
    warned of where it is set, the record holds the fit's settings, and the next fit's start takes or refuses it."""
    import json

    import lightning.pytorch as pl

    from lightning_effi import EfficiencyMonitor
    from lightning_effi.report import ResultWriter
    from tests.helpers.tiny import tiny_gpt2, tiny_lm_data

    class SetsAt(pl.Callback):
        def __init__(self, writer, **settings):
            self.writer, self.settings = writer, settings

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                for name, value in self.settings.items():
                    setattr(self.writer, name, value)

    def fit(writer, *extra):
        pl.seed_everything(0)
        trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             callbacks=[EfficiencyMonitor(print_summary=False), writer, *extra],
                             val_check_interval=2, limit_val_batches=1)  # fmt: skip
        trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
        return trainer

    writer = ResultWriter(metric="val/loss", seed=0, budget=0.5, out_dir=tmp_path / "a")
    with pytest.warns(UserWarning, match=r"ResultWriter.seed = -5 was set during a fit: .* with seed=0") as told:
        fit(writer, SetsAt(writer, seed=-5, budget=2.0, out_dir=tmp_path / "b"))
    assert sum("was set during a fit" in str(w.message) for w in told) == 3
    record = json.loads((tmp_path / "a" / "result.json").read_text())
    assert (record["seed"], record["budget"]) == (0, 0.5) and not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match=r"^ResultWriter: seed must be None or an int"):
        fit(writer)
    writer.seed = 1  # after the fit that raised: the next fit's, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        writer.seed = 2
    fit(writer)
    record = json.loads((tmp_path / "b" / "result.json").read_text())
    assert (record["seed"], record["budget"]) == (2, 2.0)

    class Appends(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            writer.config.append("a note")  # in place: lost the record after the whole fit (qa93-regress 05)

    writer = ResultWriter(metric="val/loss", seed=0, out_dir=tmp_path / "c", config=["model.lr=0.1"])
    with pytest.warns(UserWarning, match=r"ResultWriter: config changed in place during the fit"):
        fit(writer, Appends())
    assert json.loads((tmp_path / "c" / "result.json").read_text())["overrides"] == ["model.lr=0.1"]
    # a config that cannot be copied (a lock) trains and writes its record (the copy stopped the fit with a bare
    # TypeError, qa94-regress 01); one unequal to its own copy (a tensor) is not told changed (qa94-regress 03)
    import threading

    import torch

    class EditsOther(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            writer.config["lr"] = 9.0

    # a config unequal to its copy (a partial) still records the fit-start copy (qa95-regress 02)
    config = {"lr": 0.1, "f": functools.partial(max)}
    writer = ResultWriter(metric="val/loss", seed=0, out_dir=tmp_path / "f", config=config)
    fit(writer, EditsOther())
    assert "lr=0.1" in json.loads((tmp_path / "f" / "result.json").read_text())["overrides"]
    for name, config in (("d", {"lock": threading.Lock()}), ("e", {"scale": torch.ones(2)})):
        writer = ResultWriter(metric="val/loss", seed=0, out_dir=tmp_path / name, config=config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(writer)
        assert (tmp_path / name / "result.json").exists()
        assert not [w for w in caught if "changed in place" in str(w.message)]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_result_writer_refuses_a_folder_it_cannot_write_into_before_the_fit(tmp_path):
    """A folder the paths do not block but that cannot be written (/proc, no permission, read-only) trained the whole
    fit, then lost the record with a bare OS error (qa90-docs 01): the writer tries at the fit's start."""
    import lightning.pytorch as pl

    from lightning_effi import EfficiencyMonitor
    from lightning_effi.report import ResultWriter
    from tests.helpers.tiny import tiny_gpt2, tiny_lm_data

    for out_dir in ("/proc/lightning_effi_run", "/proc/self/lightning_effi_run"):
        trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             callbacks=[EfficiencyMonitor(print_summary=False),
                                        ResultWriter("val/loss", seed=0, out_dir=out_dir)])  # fmt: skip
        with pytest.raises(ValueError, match=rf"^ResultWriter: out_dir {out_dir} cannot be written into \(\w+Error: "):
            trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
        assert trainer.global_step == 0
    writer = ResultWriter("val/loss", seed=0, out_dir=tmp_path / "a" / "run")  # made at the fit's start, probe gone
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         callbacks=[EfficiencyMonitor(print_summary=False), writer], val_check_interval=1,
                         limit_val_batches=1)  # fmt: skip
    trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    assert sorted(p.name for p in (tmp_path / "a" / "run").iterdir()) == ["result.json"]


def test_a_result_writer_refuses_a_default_root_dir_beneath_a_file_or_fifo_before_the_fit(tmp_path):
    """Without out_dir and a logger the record goes to default_root_dir. One beneath a file or a FIFO failed with a
    bare [Errno 20] after the whole fit, the record lost: now refused at the fit's start, naming what is in the way
    (the check out_dir gets at construction)."""
    import lightning.pytorch as pl

    from lightning_effi import EfficiencyMonitor
    from lightning_effi.report import ResultWriter
    from tests.helpers.tiny import tiny_gpt2, tiny_lm_data

    (tmp_path / "file").write_text("mine")
    os.mkfifo(tmp_path / "fifo")
    for kwargs, blocker in (
        (dict(logger=False, default_root_dir=tmp_path / "file" / "runs"), r"a file: .*file"),
        (dict(logger=False, default_root_dir=tmp_path / "fifo" / "runs"), r"a special file: .*fifo"),
    ):
        callbacks = [EfficiencyMonitor(print_summary=False), ResultWriter("val/loss", seed=0)]
        trainer = pl.Trainer(max_steps=2, enable_checkpointing=False, enable_progress_bar=False, **kwargs,
                             callbacks=callbacks)  # fmt: skip
        message = rf"^ResultWriter: out_dir must be a folder .*, beneath {blocker} \(the logger's or default_root_dir"
        with pytest.raises(ValueError, match=message):
            trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
        assert trainer.global_step == 0
    assert (tmp_path / "file").read_text() == "mine"


def test_a_result_writer_does_not_replace_another_runs_record_in_silence(tmp_path):
    """Without a logger the record goes to default_root_dir, which runs of a loop or a sweep share: the second run
    replaced the first's result.json in silence and the report saw one run (qa48-hydra 02). The earlier record is
    kept as result.previous.json, with a warning naming the remedy."""
    first = _fit_with_result_writer(tmp_path, 0, logger=False)
    assert first.path == tmp_path / "result.json"
    with pytest.warns(UserWarning, match=r"held an earlier run's record .* give each run its own out_dir"):
        second = _fit_with_result_writer(tmp_path, 1, logger=False)
    assert second.path == tmp_path / "result.json"
    assert json.loads((tmp_path / "result.json").read_text())["seed"] == 1
    assert json.loads((tmp_path / "result.previous.json").read_text())["seed"] == 0
    # a third keeps both earlier records (qa49-break 08)
    with pytest.warns(UserWarning, match=r"moved to result\.previous\.2\.json"):
        _fit_with_result_writer(tmp_path, 2, logger=False)
    seeds = [json.loads((tmp_path / f).read_text())["seed"] for f in ("result.json", "result.previous.2.json")]
    assert seeds == [2, 1] and json.loads((tmp_path / "result.previous.json").read_text())["seed"] == 0


def test_a_result_writer_writes_into_the_loggers_version_folder_or_the_hydra_jobs_folder(tmp_path, monkeypatch):
    """A CSVLogger's version folders are one per run; without one, a Hydra job's output folder (its jobs share the
    launch folder, the default_root_dir)."""
    from hydra.core.hydra_config import HydraConfig
    from lightning.pytorch.loggers import CSVLogger
    from omegaconf import OmegaConf

    a = _fit_with_result_writer(tmp_path, 0, logger=CSVLogger(tmp_path / "logs"))
    b = _fit_with_result_writer(tmp_path, 1, logger=CSVLogger(tmp_path / "logs"))
    assert (a.path, b.path) == (tmp_path / "logs/lightning_logs/version_0/result.json", b.path)
    assert b.path == tmp_path / "logs/lightning_logs/version_1/result.json"

    job = tmp_path / "multirun/0"
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    config = OmegaConf.create({"runtime": {"output_dir": str(job)}, "overrides": {"task": ["model.lr=0.5", "seed=2"]}})
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: config))
    c = _fit_with_result_writer(tmp_path, 2, logger=False)
    assert c.path == job / "result.json" and not (tmp_path / "result.json").exists()
    # the job's overrides are its record's (your own @hydra.main app: none were recorded, and the report could not
    # note a technique run's other model.lr, qa86-user 03)
    assert json.loads(c.path.read_text())["overrides"] == ["model.lr=0.5", "seed=2"]
    # the job's folder is read where the callback is built: a ddp_spawn fit's processes have no Hydra
    # configuration (their records went to the launch folder, qa49-break 06)
    from lightning_effi.report import ResultWriter

    writer = ResultWriter(metric="val/loss")
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: False))
    assert writer._hydra_dir == str(job)
    # a logger's folder outside the job's is not taken: the sweep's report would not find the record there (it went
    # there with a warning, and the README's own Hydra app, a Trainer with its default logger, left every job of its
    # sweep without a record: qa102-user 04)
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    from lightning_effi.report import record as record_module

    monkeypatch.setattr(record_module, "_JOB_FITS", {})  # this process's fits per job: none yet
    d = _fit_with_result_writer(tmp_path, 3, logger=CSVLogger(tmp_path / "logs"))
    assert d.path == job / "result.json" and json.loads(d.path.read_text())["seed"] == 3
    assert not (tmp_path / "logs/lightning_logs/version_2/result.json").exists()
    # a job that fits several times (seeds in a loop) keeps a record per fit (the job's folder alone kept the last
    # one, the others moved aside: qa103-regress 03)
    d2 = _fit_with_result_writer(tmp_path, 5, logger=CSVLogger(tmp_path / "logs"))
    assert d2.path == job / "fit_2/result.json"
    assert json.loads(d.path.read_text())["seed"] == 3 and json.loads(d2.path.read_text())["seed"] == 5
    # the sweep launched again into its folder (a new process): the same folders, each earlier record moved aside
    # (the logger's version, global to the launch folder, put the rerun's record beside the first's, and the report
    # refused the two: qa104-regress 01)
    monkeypatch.setattr(record_module, "_JOB_FITS", {})
    d3 = _fit_with_result_writer(tmp_path, 6, logger=CSVLogger(tmp_path / "logs"))
    assert d3.path == job / "result.json" and json.loads(d3.path.read_text())["seed"] == 6
    assert sorted(p.name for p in job.glob("result*.json")) == [
        "result.json",
        "result.previous.2.json",
        "result.previous.json",
    ]
    # one inside the job's folder is (its version folder: one per run)
    e = _fit_with_result_writer(tmp_path, 4, logger=CSVLogger(job / "csv"))
    assert e.path == job / "csv/lightning_logs/version_0/result.json"


def test_a_hydra_jobs_fits_are_read_from_its_folders_since_it_started(tmp_path, monkeypatch):
    """With a logger outside the job's folder, the job's k-th fit goes to <job>/fit_<k>, counted from the records
    written since the job started (its .hydra/hydra.yaml): fits in processes that share no counter (a loop under
    ddp_spawn: every record went to <job>/result.json, qa105-regress 01) count, and a sweep launched again finds the
    earlier launch's records older, reuses the folders and says so (qa105-regress 03)."""
    import os

    from hydra.core.hydra_config import HydraConfig
    from lightning.pytorch.loggers import CSVLogger
    from omegaconf import OmegaConf

    from lightning_effi.report import record as record_module

    job = tmp_path / "sweep/0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra/hydra.yaml").write_text("hydra: {}")
    os.utime(job / ".hydra/hydra.yaml", (1e9, 1e9))  # the job started long before its fits
    config = OmegaConf.create({"runtime": {"output_dir": str(job)}, "overrides": {"task": ["seed=0"]}})
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: config))
    paths = []
    for seed in (0, 1, 2):
        monkeypatch.setattr(record_module, "_JOB_FITS", {})  # as in a process of its own
        paths.append(_fit_with_result_writer(tmp_path, seed, logger=CSVLogger(tmp_path / "logs")).path)
    assert paths == [job / "result.json", job / "fit_2/result.json", job / "fit_3/result.json"]
    # launched again: the job starts after the records were written
    now = max(p.stat().st_mtime for p in paths) + 10
    os.utime(job / ".hydra/hydra.yaml", (now, now))
    for p in paths:
        os.utime(p, (now - 5, now - 5))
    with pytest.warns(UserWarning, match=r"written before this Hydra job started: the sweep was launched again"):
        again = _fit_with_result_writer(tmp_path, 3, logger=CSVLogger(tmp_path / "logs"))
    assert again.path == job / "result.json" and (job / "result.previous.json").is_file()


def test_a_result_writer_warns_at_the_first_validation_of_a_metric_not_logged(tmp_path):
    """A misspelt metric is told at the fit's first validation, naming the logged ones (the error came after the
    whole fit, with no record written, qa86-user 05); a logged one is not warned of."""
    with pytest.warns(
        UserWarning, match=r"metric 'val/accuracy' was not logged by the fit's first validation .*'val/loss'"
    ):
        with pytest.raises(ValueError, match="metric 'val/accuracy' was not logged"):
            _fit_with_result_writer(tmp_path / "typo", 0, metric="val/accuracy", logger=False, num_sanity_val_steps=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*was not logged by the fit's first validation")
        _fit_with_result_writer(tmp_path / "ok", 0, logger=False, num_sanity_val_steps=1)


def test_a_result_writer_beside_a_logger_without_a_folder_writes_in_the_root_dir(tmp_path, monkeypatch):
    """A logger with no local folder (an MLFlowLogger on an sqlite or http tracking URI: its save_dir is None) made
    the record go to a folder named "None" in the working directory, shared by every such run (qa75-user 04). It goes
    to the Trainer's default_root_dir."""
    from lightning.pytorch.loggers.logger import DummyLogger

    class RemoteLogger(DummyLogger):
        @property
        def save_dir(self):
            return None

    monkeypatch.chdir(tmp_path)
    writer = _fit_with_result_writer(tmp_path / "root", 0, logger=RemoteLogger())
    assert writer.path == tmp_path / "root" / "result.json" and not (tmp_path / "None").exists()


def test_a_result_writer_expands_the_home_folder_and_refuses_a_link_to_nothing(tmp_path, monkeypatch):
    """'~/runs/x' wrote to a folder named '~' in the working directory, and a link to nothing failed after the whole
    fit (qa65-break 07, 08)."""
    from lightning_effi.report import ResultWriter

    monkeypatch.setenv("HOME", str(tmp_path))
    assert ResultWriter(metric="val/loss", out_dir="~/runs/x").out_dir == str(tmp_path / "runs" / "x")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"ResultWriter: out_dir must be a folder .*, a link to nothing$"):
        ResultWriter(metric="val/loss", out_dir=tmp_path / "link")


@pytest.mark.parametrize("mis_sized", [False, True])
def test_a_baseline_whose_lr_did_not_decay_over_its_budget_is_noted(tmp_path, mis_sized):
    """Each record keeps the LR at the end of the fit over the starting rate (length.lr_end_ratio); the report notes
    a baseline whose rate ended above its seed's other baselines' (a cosine sized for the full length at budget 0.5
    ends at 0.5: accepted in silence, qa86-user 02), and nothing when each decayed over its own budget."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_effi import EfficiencyMonitor
    from lightning_effi.report import write_report, write_result
    from tests.helpers.harness import make_trainer

    class Linear(pl.LightningModule):
        def __init__(self, schedule_steps):
            super().__init__()
            self.net, self.schedule_steps = torch.nn.Linear(8, 3), schedule_steps

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val/loss", torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.5)
            cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.schedule_steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 3, (256,), generator=g)), 16)
    ratios = {}
    for budget in (0.5, 1.0):
        pl.seed_everything(0)
        steps = int(16 * budget)
        trainer = make_trainer(
            tmp_path / f"fit{budget}",
            [EfficiencyMonitor(print_summary=False)],
            max_steps=steps,
            val_check_interval=steps,
            limit_val_batches=1,
        )
        trainer.fit(Linear(16 if mis_sized else steps), data, data)
        path = write_result(trainer, tmp_path / "runs" / f"baseline_{budget}", metric="val/loss", seed=0, budget=budget)
        ratios[budget] = json.loads(path.read_text())["length"]["lr_end_ratio"]
    assert ratios == ({0.5: pytest.approx(0.5), 1.0: 0.0} if mis_sized else {0.5: 0.0, 1.0: 0.0})
    notes = [n for n in write_report([tmp_path / "runs"], out_dir=tmp_path / "report").notes if "learning rate" in n]
    assert notes == (
        ["baseline@0.5 seed 0: its learning rate ended at 0.5 of its starting rate, where its seed's other baselines' "
         "ended at 0: its schedule did not decay over its own budget (sized for a longer run?), so the frontier may "
         "flatter the arms"] if mis_sized else []
    )  # fmt: skip
