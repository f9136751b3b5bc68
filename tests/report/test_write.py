"""write_report's files, the CLI (in process and as ``python -m lightning_effi.report``) and the Hydra callback."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import hydra.utils
import pytest
from omegaconf import OmegaConf

from lightning_effi.report import COLUMNS, ReportError, write_report
from lightning_effi.report.__main__ import main
from lightning_effi.report.hydra_callback import ReportCallback
from tests.report import write_record, write_sweep

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def sweep(tmp_path):
    return write_sweep(tmp_path / "sweep")


def _png(path: Path) -> bool:
    return path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG


def test_write_report_writes_md_csv_json_and_figures(sweep, tmp_path):
    (sweep / "10" / ".hydra").mkdir(parents=True)  # a job that wrote no result.json
    report = write_report([sweep], out_dir=tmp_path / "out")
    out = tmp_path / "out"
    names = ["report.md", "report.csv", "report.json", "quality_vs_compute.png", "quality_vs_wall.png", "curves.png"]
    assert sorted(report.files) == sorted([*names, "schedules.png"])
    assert all(report.files[n] == out / n for n in report.files)
    assert all(_png(out / n) for n in report.files if n.endswith(".png"))

    with open(out / "report.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == COLUMNS
        rows = list(reader)
    assert [(r["arm"], r["budget"], r["baseline"], r["n_seeds"]) for r in rows] == [
        ("baseline", "0.25", "True", "2"),
        ("baseline", "0.5", "True", "2"),
        ("baseline", "0.75", "True", "2"),
        ("baseline", "1.0", "True", "2"),
        ("random_ltd", "1.0", "False", "2"),
    ]
    arm = rows[-1]
    savings = [1 - 2e12 / math.sqrt(2e12 * 3e12), 1 - 2e12 / (2e12**0.25 * 3e12**0.75)]  # test_build's hand values
    assert float(arm["frontier_saving_mean"]) == pytest.approx(sum(savings) / 2, rel=1e-12)
    assert float(arm["same_length_saving_mean"]) == pytest.approx(0.5)
    assert float(arm["quality_mean"]) == pytest.approx(2.525) and arm["frontier_flag"] == "inside"
    assert rows[0]["frontier_saving_mean"] == "" and float(rows[0]["flops_mean"]) == 1e12  # NaN: an empty cell

    saved = json.loads((out / "report.json").read_text())
    assert saved["metric"] == "val/loss" and saved["mode"] == "min" and saved["compute"] == "flops"
    assert saved["rows"][-1]["frontier_saving_mean"] == pytest.approx(sum(savings) / 2)
    assert saved["rows"][0]["frontier_saving_mean"] is None  # NaN as null: strict JSON
    assert saved["frontiers"]["0"]["flops"]["front"][0] == [1e12, 3.0]
    assert any("10: a Hydra job folder without result.json" in n for n in saved["notes"])

    md = (out / "report.md").read_text()
    assert "| random_ltd | 1 | 2 | 2.525 ± 0.03536 |" in md
    assert "Kaddour et al. 2023" in md and "4 budgets (0.25, 0.5, 0.75, 1), 2 seeds (0, 1)" in md
    assert md.count("\n| ") == 6  # header + 5 rows


def test_write_report_defaults_to_the_first_path_and_skips_schedules_when_none(tmp_path):
    write_record(tmp_path / "a", budget=0.5, flops=1e12, loss=2.5)
    write_record(tmp_path / "b", budget=1.0, flops=2e12, loss=2.0)
    report = write_report(str(tmp_path))  # one folder as a str: not read letter by letter (qa58-args 07)
    from pathlib import PurePosixPath

    assert len(write_report(PurePosixPath(tmp_path)).rows) == 2  # a path of another class (qa59-break 06)
    assert (tmp_path / "report.md").is_file() and _png(tmp_path / "quality_vs_wall.png")
    assert "schedules.png" not in report.files and not (tmp_path / "schedules.png").exists()
    assert len(report.rows) == 2 and all(r["baseline"] for r in report.rows)


def test_write_report_reads_a_home_folder_as_the_shell_does(tmp_path, monkeypatch):
    """'~/runs' and out_dir='~/report' are the home folder's (a folder named '~' in the working directory, as
    ResultWriter already read them, qa86-break 08)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    write_record(tmp_path / "home" / "runs" / "a", budget=0.5, flops=1e12, loss=2.5)
    write_record(tmp_path / "home" / "runs" / "b", budget=1.0, flops=2e12, loss=2.0)
    report = write_report("~/runs", out_dir="~/report")
    assert len(report.rows) == 2 and (tmp_path / "home" / "report" / "report.md").is_file()
    assert not (tmp_path / "~").exists()


def test_cli_in_process(sweep, tmp_path, capsys):
    assert main([str(sweep), "--out", str(tmp_path / "o"), "--compute", "tokens"]) == 0
    printed = capsys.readouterr().out
    assert "| arm | budget | seeds |" in printed and "saving vs same-length (tokens)" in printed
    assert f"Wrote: {tmp_path / 'o' / 'report.md'}" in printed
    assert main([str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'missing'}: no such file or folder\n"


def test_cli_metric_error_is_one_line(sweep, capsys):
    assert main([str(sweep), "--metric", "val/acc"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no final 'val/acc' among its metrics" in err and err.count("\n") == 1


def test_cli_out_that_is_a_file_is_refused_and_a_pipe_in_an_arm_label_is_escaped(sweep, tmp_path, capsys):
    """``--out`` naming an existing file is one error line (the report went to its folder); an arm labelled
    ``ltd|lr=1e-3`` keeps its table row at the header's column count."""
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    assert main([str(sweep), "--out", str(taken)]) == 1
    assert (
        capsys.readouterr().err
        == f"error: out_dir: '{taken}' is a file; give a folder (created if missing) for the report\n"
    )
    assert taken.read_text() == "mine" and not (tmp_path / "report.md").exists()
    # beneath a file: named before the runs are read (a bare "[Errno 20] Not a directory" after the whole report,
    # qa83-report 04)
    assert main([str(tmp_path / "missing"), "--out", str(taken / "sub")]) == 1
    assert (
        capsys.readouterr().err
        == f"error: out_dir: '{taken / 'sub'}' lies beneath the file '{taken}'; give a folder (created if missing) "
        "for the report\n"
    )
    # a link to nothing, or beneath one: named up front as well (a "cannot create" came after the whole report)
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for out, where in (
        (tmp_path / "gone", "is a link to nothing"),
        (tmp_path / "gone" / "sub", f"lies beneath a link to nothing '{tmp_path / 'gone'}'"),
    ):
        assert main([str(tmp_path / "missing"), "--out", str(out)]) == 1
        assert (
            capsys.readouterr().err
            == f"error: out_dir: '{out}' {where}; give a folder (created if missing) for the report\n"
        )
    # beneath a FIFO: named up front too (the whole report was built first, qa86-break 03)
    os.mkfifo(tmp_path / "pipe")
    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "pipe" / "r")]) == 1
    assert "lies beneath a special file" in capsys.readouterr().err
    write_record(sweep / "99", arm="ltd|lr=1e-3", budget=1.0, seed=0, loss=2.5, flops=2e12)
    table = write_report([sweep], out_dir=tmp_path / "o").to_markdown().split("\n\n")[0].splitlines()
    row = next(line for line in table if line.startswith("| ltd"))
    assert row.startswith("| ltd\\|lr=1e-3 |") and row.replace("\\|", "").count("|") == table[0].count("|")


def test_a_failed_job_below_two_of_the_paths_is_noted_once(sweep, tmp_path):
    """The runs below a folder given twice (or a sweep and a folder in it) are read once; the note on a failed job
    was written once per path (qa96-break 02)."""
    (sweep / "10" / ".hydra").mkdir(parents=True)
    for paths in ([sweep, sweep], [sweep, sweep / "0"], [sweep, Path(f"{sweep}/")], [sweep, sweep / ".." / "sweep"]):
        notes = write_report(paths, out_dir=tmp_path / "o").notes
        assert len([n for n in notes if "without result.json" in n]) == 1, paths


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_folder_that_cannot_be_written_is_refused_before_the_report(sweep, tmp_path, capsys, monkeypatch):
    """``--out /proc`` (a folder that exists, where no file can be made) built the whole report, then said
    ``[Errno 2] No such file or directory: '/proc/report.md'``, naming neither the argument nor the cause
    (qa96-break 03); a folder to be made below it is refused alike, and so is the default folder (the first path)."""
    from lightning_effi.report import table

    built = []
    monkeypatch.setattr(table, "build_report", lambda *a, **k: built.append(1))
    for out, where in (("/proc", "'/proc'"), ("/proc/new/sub", "'/proc/new/sub' (its existing parent '/proc')")):
        assert main([str(sweep), "--out", out]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: out_dir: cannot write into {where} (") and "give a folder you can" in err
    assert built == [] and not Path("/proc/new").exists()
    if os.geteuid() != 0:  # root writes into a read-only folder
        sweep.chmod(0o555)
        try:
            assert main([str(sweep)]) == 1
            assert "the report's folder (the first path; choose another" in capsys.readouterr().err
        finally:
            sweep.chmod(0o755)


def test_a_report_refreshed_in_a_folder_that_takes_no_new_file_is_written(sweep, tmp_path, monkeypatch):
    """A folder where no new file can be made but the last report's files can be written (someone else's results
    folder) is refreshed in place, as before the write probe (qa97-regress 04); a new folder of the kind is refused."""
    import tempfile

    def no_new_file(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    write_report([sweep], out_dir=tmp_path / "out")
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", no_new_file)
    assert (tmp_path / "out" / "report.md").is_file()
    assert "report.md" in write_report([sweep], out_dir=tmp_path / "out").files
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match=r"out_dir: cannot write into '.*empty' \(PermissionError: Permission denied"):
        write_report([sweep], out_dir=tmp_path / "empty")
    # a figure of this report missing there (its first schedules.png): refused before anything is written, not new
    # tables beside the old figures (qa98-regress 02)
    (tmp_path / "out" / "schedules.png").unlink()
    before = {f.name: f.stat().st_mtime_ns for f in (tmp_path / "out").iterdir()}
    with pytest.raises(ReportError, match=r"out_dir: cannot write into '.*out' \(PermissionError"):
        write_report([sweep], out_dir=tmp_path / "out")
    assert {f.name: f.stat().st_mtime_ns for f in (tmp_path / "out").iterdir()} == before


@pytest.mark.slow
def test_cli_subprocess(sweep, tmp_path):
    cmd = [sys.executable, "-m", "lightning_effi.report"]
    ok = subprocess.run([*cmd, str(sweep), "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "| random_ltd | 1 | 2 | 2.525 ± 0.03536 |" in ok.stdout and (tmp_path / "o" / "report.csv").is_file()
    bad = subprocess.run([*cmd, str(tmp_path / "missing")], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip() == f"error: {tmp_path / 'missing'}: no such file or folder"


def test_hydra_callback_reports_on_the_sweep_dir(sweep, capsys):
    callback = hydra.utils.instantiate({"_target_": "lightning_effi.report.hydra_callback.ReportCallback"})
    assert isinstance(callback, ReportCallback)
    callback.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}), config_name="train")
    out = capsys.readouterr().out
    assert "| random_ltd | 1 | 2 |" in out and f"Sweep report: {sweep / 'report.md'}" in out
    assert (sweep / "report.csv").is_file() and callback.report.rows[-1]["arm"] == "random_ltd"


def test_hydra_callback_warns_instead_of_raising(tmp_path, capsys):
    (tmp_path / "0" / ".hydra").mkdir(parents=True)  # the only job failed before writing result.json
    callback = ReportCallback()
    callback.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    err = capsys.readouterr().err
    assert err == (
        f"warning: lightning_effi.report: no sweep report (FileNotFoundError: {tmp_path}: no result.json in this "
        "folder or below (is it a run or sweep folder?))\n"
    )
    assert callback.report is None and not (tmp_path / "report.md").exists()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compute": "steps"}, "ReportCallback compute: expected one of"),
        ({"mode": "lower"}, "ReportCallback mode: expected 'min'"),
        ({"print_table": "yes"}, "ReportCallback print_table: expected a bool"),
    ],
)
def test_hydra_callback_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReportCallback(**kwargs)


def test_hydra_callback_refuses_an_out_dir_it_cannot_write_when_the_sweep_starts(tmp_path):
    """Found at the sweep's end, after every job trained, the report was lost with a warning (qa106-break 03); Hydra
    builds the callback when the multirun starts, so a constructor's error stops the sweep before its first job."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=rf"^ReportCallback out_dir: '{afile}' is a file; give a folder"):
        ReportCallback(out_dir=str(afile))
    with pytest.raises(ValueError, match=rf"^ReportCallback out_dir: '{afile / 'r'}' lies beneath the file"):
        ReportCallback(out_dir=str(afile / "r"))
    with pytest.raises(ValueError, match="^ReportCallback out_dir: '/dev/null' is a special file"):
        ReportCallback(out_dir="/dev/null")
    for bad in (5, ""):
        with pytest.raises(ValueError, match=r"^ReportCallback out_dir: expected a folder path or None"):
            ReportCallback(out_dir=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^ReportCallback metric: expected a metric name"):
            ReportCallback(metric=bad)  # type: ignore[arg-type]
    assert ReportCallback(out_dir=str(tmp_path / "new" / "report"), metric="val/loss").out_dir is not None
    assert not (tmp_path / "new").exists()  # nothing created before the sweep's end


def test_budget_colors_tell_the_frontiers_budgets_apart(sweep):
    """Each baseline budget a shade of the baseline's colour, lighter for a smaller budget (the four budgets of the
    frontier were one colour); a technique arm at one budget keeps its own colour."""
    from matplotlib.colors import to_rgba

    from lightning_effi.report import build_report, load_runs
    from lightning_effi.report.plots import _colors, budget_colors

    report = build_report(load_runs([sweep]))
    shades, base = budget_colors(report), _colors(report)
    baseline = [shades[("baseline", b)] for b in (0.25, 0.5, 0.75, 1.0)]
    assert len(set(baseline)) == 4 and baseline[-1] == to_rgba(base["baseline"])
    assert [sum(c[:3]) for c in baseline] == sorted((sum(c[:3]) for c in baseline), reverse=True)  # light to full
    assert shades[("random_ltd", 1.0)] == to_rgba(base["random_ltd"])
    assert set(shades) == {("baseline", b) for b in (0.25, 0.5, 0.75, 1.0)} | {("random_ltd", 1.0)}


def test_the_report_starts_without_torch_and_write_result_still_imports():
    """lightning_effi.report imported write_result eagerly, which loads Lightning and torch (4.6 s in the helper's
    run; docs/architecture.md says the report starts without them). It is now imported on first use."""
    import subprocess
    import sys

    code = (
        "import sys; import lightning_effi.report as r; assert 'torch' not in sys.modules, 'torch loaded'; "
        "from lightning_effi.report import write_result; assert callable(write_result) and 'torch' in sys.modules; "
        "assert 'write_result' in r.__all__"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
