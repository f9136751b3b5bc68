"""Read the ``result.json`` run records (schema 2) that ``experiments/train.py`` writes into each Hydra run folder.

A record holds the run's label (``arm``), its length as a fraction of the experiment's reference length
(``budget``), the seed, each technique callback's resolved config, the final optimized metric, the
``EfficiencyMonitor`` summary (``flops``: forward + backward training FLOPs; ``tokens``, ``samples``,
``layer_tokens``; times in seconds), the validation curve and the techniques' schedules (see
``lightning_effi.train``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_effi.report.frontier import Mode, check_mode

SCHEMA = 2
RESULT_FILE = "result.json"
#: cumulative compute quantities of the EfficiencyMonitor summary (and of each curve point)
COMPUTE_KEYS: tuple[str, ...] = ("flops", "tokens", "samples", "layer_tokens")


def json_safe(value: Any) -> Any:
    """``value`` made strict JSON: non-finite floats become None (``null``), mapping keys strings, tuples and other
    sequences (OmegaConf's ``ListConfig``: a Hydra app's list setting, recorded as its class name before, qa106-break
    08) lists, paths strings (nested containers converted throughout)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or (
        isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))
    ):
        return [json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


class ReportError(ValueError):
    """Run records that cannot be read or compared (the message names the file or the runs at fault)."""


@dataclass(frozen=True)
class Run:
    """One training run, as recorded in its ``result.json``.

    Attributes:
        arm: the run's label (``"baseline"`` for the plain model, else e.g. ``"curriculum+random_ltd"``).
        budget: the fraction of the experiment's reference length this run trained (1.0: the full length).
        seed: the run's seed.
        techniques: technique name -> the technique callback's resolved config (``{}`` for a baseline).
        metric_name: the optimized metric (e.g. ``"val/loss"``; None for a run of the app with
            ``optimized_metric: null``, which the report reads at a metric chosen with ``metric=``); ``mode``:
            ``"min"`` or ``"max"``.
        metric: its final value (NaN when the record holds ``null``: no validation ran, or it diverged).
        metrics: every final scalar metric.
        efficiency: the ``EfficiencyMonitor`` summary (FLOPs: forward + backward training FLOPs; seconds).
        curve: one dict per validation during fit (cumulative ``step, samples, tokens, layer_tokens, flops,
            train_wall_s`` and ``metrics``).
        schedule: the techniques' schedule states (``step``, compute so far, ``<technique>/<key>`` values).
        length: ``max_steps``, ``max_epochs``, ``optimizer_steps``.
        task_name: the run's task label; ``overrides``: its Hydra task overrides.
        path: the run folder (the one holding ``result.json``).
    """

    arm: str
    budget: float
    seed: int
    techniques: Mapping[str, Any] = field(hash=False)
    metric_name: str | None
    mode: Mode
    metric: float
    metrics: Mapping[str, float] = field(hash=False)
    efficiency: Mapping[str, Any] = field(hash=False)
    curve: tuple[Mapping[str, Any], ...] = field(hash=False)
    schedule: tuple[Mapping[str, Any], ...] = field(hash=False)
    length: Mapping[str, Any] = field(hash=False)
    task_name: str
    overrides: tuple[str, ...]
    path: Path

    @property
    def is_baseline(self) -> bool:
        """A run without any technique (its ``techniques`` is empty) whose label starts with ``baseline``
        (``baseline``, ``baseline_lr_high``, ``baseline[lr=...]``: the baseline and its variants, all on the frontier).
        A run without a library technique under another label (``arm="mytrick"``: the user's own method) is an arm,
        compared with the frontier, not part of it."""
        return not self.techniques and self.arm.startswith("baseline")

    @property
    def train_wall_s(self) -> float:
        """Training wall time in seconds: the monitor's train + data time (evaluation excluded)."""
        return float(self.efficiency["time_train_s"]) + float(self.efficiency["time_data_s"])

    def compute(self, quantity: str) -> float:
        """The run's total of ``quantity`` (``flops``, ``tokens``, ``samples``, ``layer_tokens``; ``train_wall_s``:
        seconds). Raises ``ReportError`` for an unknown quantity."""
        if quantity == "train_wall_s":
            return self.train_wall_s
        if quantity not in COMPUTE_KEYS:
            raise ReportError(f"compute: expected one of {list(COMPUTE_KEYS)}, got {quantity!r}")
        return float(self.efficiency[quantity])

    def quality(self, metric: str | None = None) -> float:
        """The final value of ``metric`` (default: the optimized one); NaN for a ``null`` value. Raises
        ``ReportError`` naming the file when the run did not log it."""
        if metric is None and self.metric_name is None:
            raise ReportError(
                f"{self.path / RESULT_FILE}: the run optimized no metric (optimized_metric: null); choose the metric "
                "to compare with metric= (--metric)"
            )
        if metric is None or metric == self.metric_name:
            return self.metric
        if metric not in self.metrics:
            raise ReportError(
                f"{self.path / RESULT_FILE}: no final {metric!r} among its metrics {sorted(self.metrics)}"
            )
        return _number(self.metrics[metric])

    def quality_step(self, metric: str | None = None) -> int | None:
        """The optimizer step of the last validation when the final ``metric`` is that validation's value and the
        run trained past it (the run ended between two validations: its quality is read before its compute ends);
        None otherwise (a metric validated at the last step, a test metric, a run without a curve)."""
        name = self.metric_name if metric is None else metric
        steps = self.length.get("optimizer_steps")
        if not self.curve or not isinstance(steps, int):
            return None
        last = self.curve[-1]
        value, step = (last.get("metrics") or {}).get(name), last.get("step")
        if not isinstance(value, (int, float)) or not isinstance(step, int) or step >= steps:
            return None
        final = self.quality(metric)
        return step if math.isfinite(final) and math.isclose(float(value), final, rel_tol=1e-9, abs_tol=1e-12) else None

    @property
    def label(self) -> str:
        """``arm@budget seed N``: how figures and messages name the run."""
        return f"{self.arm}@{self.budget:g} seed {self.seed}"


def _missing_value(value: Any) -> bool:
    """A metric the run has no number for: ``null`` (how a record writes NaN) or NaN."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def _require(record: Mapping[str, Any], key: str, types: type | tuple[type, ...], file: Path, what: str) -> Any:
    if key not in record:
        raise ReportError(f"{file}: no {key!r} ({what}); not a schema-{SCHEMA} run record")
    value = record[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ReportError(f"{file}: {key!r} must be {what}, got {value!r}")
    if not isinstance(value, types):
        raise ReportError(f"{file}: {key!r} must be {what}, got {value!r}")
    return value


def read_run(file: Path) -> Run:
    """One :class:`Run` from a ``result.json`` file.

    Raises:
        ReportError: the file is not JSON, has no ``"schema"`` or one other than 2 (a record written by an older
            version of ``lightning_effi.train``: rerun it), or lacks a field of the record or holds a wrong type
            there (an empty ``arm``, a ``seed`` outside ``[0, 2**32)``, ``overrides`` that are not a list of strings,
            a ``length`` entry that is not an int or null), or an ``efficiency`` total
            (``flops``, ``tokens``, ``samples``, ``layer_tokens``, ``time_train_s``, ``time_data_s``) that is not a
            finite number >= 0, or a top-level copy (``flops``, ``wall_clock``) that differs from its ``efficiency``
            total (the message names the file and the field).
    """
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ReportError(f"{file}: unreadable run record ({type(err).__name__}: {err})") from err
    if not isinstance(record, dict):
        raise ReportError(f"{file}: a run record is a JSON object, got {type(record).__name__}")
    schema = record.get("schema")
    if schema is None:
        raise ReportError(
            f"{file}: no 'schema' (no arm, budget or curve): written by an older version of lightning_effi.train; "
            "rerun the job to compare it"
        )
    if schema != SCHEMA:
        raise ReportError(f"{file}: run record schema {schema!r}; this report reads schema {SCHEMA}")
    number = (int, float)
    arm = _require(record, "arm", str, file, "the arm label, a string")
    if not arm.strip():
        raise ReportError(f"{file}: 'arm' must be a non-empty label (as write_result writes it), got {arm!r}")
    budget = float(_require(record, "budget", number, file, "the budget, a number"))
    if not (math.isfinite(budget) and budget > 0):
        raise ReportError(f"{file}: 'budget' must be a positive number, got {budget!r}")
    budget = budget_key(budget)
    seed = _require(record, "seed", int, file, "the seed, an int")
    if not 0 <= seed < 2**32:
        raise ReportError(f"{file}: 'seed' must be an int in [0, 2**32) (as write_result writes it), got {seed!r}")
    techniques = _require(record, "techniques", dict, file, "technique name -> config, an object")
    metric_name = _require(
        record, "optimized_metric", (str, type(None)), file, "the optimized metric's name, a string (or null)"
    )
    mode = _require(record, "optimized_mode", str, file, "'min' or 'max'")
    try:
        checked_mode = check_mode(mode)
    except ValueError as err:
        raise ReportError(f"{file}: 'optimized_mode' {err}") from err
    metric = _require(record, "metric", (int, float, type(None)), file, "the final metric, a number or null")
    metrics = _require(record, "metrics", dict, file, "name -> final value, an object")
    if metric_name is not None and metric_name in metrics:
        # 'metric' is a copy of metrics[optimized_metric] (write_result writes both); the report reads the copy
        final = metrics[metric_name]
        if final != metric and not (_missing_value(final) and _missing_value(metric)):
            raise ReportError(
                f"{file}: 'metric' is {metric!r} but 'metrics.{metric_name}' is {final!r}; the first is a copy of the "
                f"second (the optimized metric's final value), which the report reads: edit both, or the record is "
                "damaged"
            )
    efficiency = _require(record, "efficiency", dict, file, "the EfficiencyMonitor summary, an object")
    missing = [k for k in (*COMPUTE_KEYS, "time_train_s", "time_data_s") if k not in efficiency]
    if missing:
        raise ReportError(
            f"{file}: 'efficiency' lacks {missing} (was the EfficiencyMonitor among the callbacks? "
            "callbacks=default has it)"
        )
    for key in (*COMPUTE_KEYS, "time_train_s", "time_data_s"):
        value = efficiency[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ReportError(
                f"{file}: 'efficiency.{key}' must be a finite number >= 0 (the EfficiencyMonitor's total), "
                f"got {value!r}"
            )
    for key, total in (("flops", "flops"), ("wall_clock", "time_total_s")):
        # copies of efficiency totals at the top level (for readers of Hydra's job result); the report reads the
        # efficiency block, so a copy that disagrees with it (a hand-edited record) is refused, not ignored
        copy = record.get(key)
        if copy is not None and copy != efficiency.get(total):
            raise ReportError(
                f"{file}: {key!r} is {copy!r} but 'efficiency.{total}' is {efficiency.get(total)!r}; the first is a "
                f"copy of the second, and the report reads 'efficiency.{total}': edit both, or the record is damaged"
            )
    curve = _require(record, "curve", list, file, "the validation curve, a list")
    schedule = _require(record, "schedule", list, file, "the schedule states, a list")
    for key, points in (("curve", curve), ("schedule", schedule)):
        for i, point in enumerate(points):
            if not isinstance(point, dict):
                raise ReportError(f"{file}: {key}[{i}] must be an object, got {point!r}")
            if key == "curve" and not isinstance(point.get("metrics", {}), dict | None):  # qa106-break 06
                raise ReportError(
                    f"{file}: curve[{i}].metrics must be an object (metric name -> value) or null, got "
                    f"{point['metrics']!r}"
                )
    length = record.get("length")
    if length is None:
        length = {}
    if not isinstance(length, dict):
        raise ReportError(f"{file}: 'length' must be an object (max_steps, max_epochs, ...), got {length!r}")
    for key in ("max_steps", "max_epochs", "optimizer_steps"):
        value = length.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ReportError(f"{file}: 'length.{key}' must be an int or null, got {value!r}")
    overrides = record.get("overrides")
    if overrides is None:
        overrides = []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ReportError(f"{file}: 'overrides' must be a list of strings (the Hydra overrides), got {overrides!r}")
    return Run(
        arm=arm,
        budget=budget,
        seed=seed,
        techniques=techniques,
        metric_name=metric_name,
        mode=checked_mode,
        metric=_number(metric),
        metrics={
            k: _number(v)
            for k, v in metrics.items()
            if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
        },
        efficiency=efficiency,
        curve=tuple(curve),
        schedule=tuple(schedule),
        length=length,
        task_name=str(record.get("task_name") or ""),
        overrides=tuple(overrides),
        path=file.parent,
    )


def find_results(path: str | Path) -> list[Path]:
    """The ``result.json`` files at ``path``: the file itself, the one in a run folder, or every one below a sweep
    (or any) folder, linked folders included, sorted by path (job numbers in numeric order).

    Raises:
        FileNotFoundError: ``path`` does not exist, or holds no ``result.json`` (named in the message).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or folder")
    if p.is_file():
        if p.name != RESULT_FILE:
            raise FileNotFoundError(f"{p}: not a {RESULT_FILE}; give a run folder or a sweep folder")
        return [p]
    files = sorted(_below(p, RESULT_FILE), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"{p}: no {RESULT_FILE} in this folder or below (is it a run or sweep folder?)")
    return files


def _below(root: Path, name: str) -> list[Path]:
    """Every ``name`` (a file or a folder) in ``root`` or below, following linked folders (a run linked into a sweep
    folder is part of it; ``Path.rglob`` skips links), each real folder visited once (a link cycle ends)."""
    out, visited = [], set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in visited:
            subfolders[:] = []
            continue
        visited.add(real)
        if name in files or name in subfolders:
            out.append(Path(folder) / name)
    return out


def _natural_key(path: Path) -> list[tuple[int, int | str]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in path.parts]


def jobs_without_result(paths: Iterable[str | Path]) -> list[Path]:
    """Hydra job folders (holding ``.hydra/``) below ``paths`` without a run record: jobs that failed or are still
    running, each once. A job's record is a ``result.json`` in its folder or below it (a ``ResultWriter`` without
    ``out_dir`` writes into the logger's version folder, e.g. ``<job>/csv/result.json``) and not in a deeper job's
    folder; an evaluation (``train=false``) writes ``eval.json`` instead, which counts the same."""
    out, seen = [], set()
    for path in paths:
        p = Path(path)
        if not p.is_dir():
            continue
        jobs = [h.parent for h in sorted(_below(p, ".hydra"), key=_natural_key) if h.is_dir()]
        job_set = set(jobs)
        recorded = set()
        for record in (*_below(p, RESULT_FILE), *_below(p, "eval.json")):
            # the record belongs to the nearest job folder at or above it (a job nested in another is its own)
            owner = next((f for f in record.parents if f in job_set), None)
            if owner is not None:
                recorded.add(owner)
        for job in jobs:
            # one job once, however often it lies below the paths (a folder given twice, a sweep and a job in
            # it: the report read its runs once and told the failed job twice, qa96-break 02)
            if job not in recorded and (key := job.resolve()) not in seen:
                seen.add(key)
                out.append(job)
    return out


def folder_blocker(folder: Path) -> tuple[Path, str] | None:
    """What keeps ``folder`` from being made: the first of it and its parents that exists and is not a folder, or is
    a symbolic link to nothing, with what it is (``"a file"``, ``"a special file"`` (a FIFO, a device: ``/dev/null``)
    or ``"a link to nothing"``); None when nothing does (permissions aside). Read before a record or a report is
    written into ``folder``, so the error names the argument up front instead of a bare ``[Errno 20] Not a
    directory`` after the run."""
    for path in (folder, *folder.parents):
        if path.is_symlink() and not path.exists():
            return path, "a link to nothing"
        if path.exists() and not path.is_dir():
            return path, "a file" if path.is_file() else "a special file"
    return None


def write_problem(folder: Path, create: bool = True) -> str | None:
    """Why a file cannot be written into ``folder``, or None: makes the folder (with its parents; ``create=False``:
    an existing folder only, nothing made) and a probe file in it, removed at once. What :func:`folder_blocker` cannot
    see from the paths: no write permission, a read-only or immutable folder, a pseudo file system (``/proc``). Read
    at a fit's start, so that the record is not lost after the whole fit with a bare ``PermissionError``, and before a
    report is built (:func:`~lightning_effi.report.table.write_report`)."""
    import tempfile

    try:
        if create:
            folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".effi-probe-"):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return None


def budget_key(budget: float) -> float:
    """``budget`` rounded to 12 significant digits: runs group by ``(arm, budget)``, and one budget reached by two
    float computations (``0.1 * 3`` and ``3 / 10``) must be one budget."""
    return float(f"{float(budget):.12g}")


def load_runs(paths: Iterable[str | Path] | str | os.PathLike[str]) -> list[Run]:
    """The runs recorded under ``paths`` (each a run folder, a sweep folder or any folder above, searched
    recursively for ``result.json``; a file found twice is read once), in path order.

    Raises:
        FileNotFoundError: a path that does not exist or holds no ``result.json`` (named).
        ReportError: an unreadable record, one without a schema (an older version wrote it: rerun), or one lacking
            a field (the file and the field named).
    """
    seen: set[Path] = set()
    runs = []
    paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)  # one folder: not its letters
    if not paths:
        raise FileNotFoundError("no run or sweep folder given")
    for path in paths:
        for file in find_results(path):
            key = file.resolve()
            if key in seen:
                continue
            seen.add(key)
            runs.append(read_run(file))
    return runs


__all__ = ["COMPUTE_KEYS", "RESULT_FILE", "SCHEMA", "ReportError", "Run", "find_results", "load_runs", "read_run"]
