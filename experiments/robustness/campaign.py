"""The bad-input campaign of issue #21 ("Nothing silent"), re-runnable after every fix.

Runs every case of the catalogue (:mod:`experiments.robustness.cases`: bad inputs to each public constructor, the
DeepSpeed-style curriculum config, the functional core, the DataAnalyzer and its index files, the report and the Hydra
app, plus valid edge inputs that must be accepted), each under a timeout in a worker process, and classifies what
happened:

- ``clear_early``: raised at construction or before the training loop started (setup, ``on_train_start``, a
  checkpoint's state being loaded), and the message contains every word the case lists (the parameter or cause);
- ``unclear_early``: raised as early, but the message lacks a listed word;
- ``late``: raised after the training loop started (its first epoch began: the first batch was being drawn or
  trained, or later);
- ``clear_late``: only for causes that first exist during training (``runtime`` cases: a loss that becomes NaN at
  step 2): raised after training started, with a message naming the cause;
- ``warned``: accepted with a warning naming the cause, for a case that declares ``warn_ok`` (a no-op setting that
  can still run);
- ``warned_only``: accepted with a warning naming the cause, where the case expects an error (not ``warn_ok``);
- ``silent``: accepted with no error and no warning naming the cause;
- ``hang``: no answer within the case's timeout (the worker is killed and replaced);
- ``crash``: the worker process died (a segfault, the memory killer);
- ``accepted_valid`` / ``rejected_valid``: a valid edge input (numpy numbers, OmegaConf containers) accepted /
  refused;
- ``harness_error``: the campaign's own preparation failed (a bug of the harness, not a finding).

"The training loop started" is measured by a marker callback placed first in ``trainer.callbacks``: its
``on_train_epoch_start`` (before the first batch is drawn) and ``on_train_batch_start``.

Usage (from the repository root)::

    python experiments/robustness/campaign.py --out experiments/robustness/results [--only PATTERN] [--jobs N]

writes ``campaign.json`` (every case: id, api, argument, value, kind, expected, outcome, stage, message excerpt) and
``campaign.md`` (counts by outcome, overall and per API; every case that is not ``clear_early``, ``warned`` or
``accepted_valid``, grouped by API, with its message).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository root holds lightning_effi, tests and experiments
    sys.path.insert(0, str(ROOT))

#: every outcome, in the order the report lists them
OUTCOMES = (
    "clear_early",
    "warned",
    "accepted_valid",
    "clear_late",
    "unclear_early",
    "late",
    "warned_only",
    "silent",
    "hang",
    "crash",
    "rejected_valid",
    "harness_error",
)
#: the outcomes that are the right answer for their case (``clear_late`` is only given to ``runtime`` cases: a cause
#: that first exists during training, named when it happens); campaign.md lists every other outcome under "Cases to
#: fix" and the ``clear_late`` cases in a section of their own
GOOD = ("clear_early", "warned", "accepted_valid", "clear_late")
#: the stages of a case: construction and setup are "early"; "loop" (the first epoch started) and "batch" are late
EARLY_STAGES = ("construct", "setup")
EXCERPT = 400

Word = str | tuple[str, ...]


@dataclass
class Case:
    """One input tried as a careful user would.

    Attributes:
        id: unique, ``<api>.<argument>.<what>`` (``--only`` matches it with shell wildcards).
        api: the public class, function or app the input goes to. argument: the parameter (or config key).
        value: how the input reads (a repr). kind: ``wrong_type``, ``out_of_range``, ``order``, ``size``,
            ``files``, ``noop``, ``checkpoint``, ``nonfinite``, ``other`` or ``valid``.
        run: performs the case with a :class:`Ctx`: builds the object (construction), and when that passes fits a
            tiny seeded run with it (``ctx.fit``/``ctx.app``); returns nothing, raises what the library raised.
        words: what the message (error or warning) must contain, case-insensitive; a tuple entry is a set of
            alternatives.
        warn_ok: a warning naming the cause is a right outcome (no-op settings that can still run).
        valid: a valid input that must be accepted. runtime: the cause first exists during training (a late error
            naming it is right). timeout: seconds before the case counts as a hang.
    """

    id: str
    api: str
    argument: str
    value: str
    kind: str
    run: Callable[[Ctx], Any]
    words: tuple[Word, ...] = ()
    warn_ok: bool = False
    valid: bool = False
    runtime: bool = False
    timeout: float = 150.0
    note: str = ""

    @property
    def expected(self) -> str:
        if self.valid:
            return "accepted"
        if self.runtime:
            return "error or warning naming the cause (during training)"
        return "clear error before training" + (", or a warning naming the cause" if self.warn_ok else "")


@dataclass
class Ctx:
    """What a case's ``run`` gets: a scratch folder and the stage it is at (``construct`` until it fits, then
    ``setup``; the marker callback moves it to ``loop`` / ``batch``; ``prepare`` while the harness makes a
    checkpoint the case needs)."""

    tmp: Path
    stage: str = "construct"
    steps: int = 0
    _counter: int = 0

    def folder(self) -> Path:
        self._counter += 1
        path = self.tmp / f"run{self._counter}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """A block the harness runs to prepare the case (a checkpoint to corrupt): its errors are harness errors
        (the stage stays ``prepare`` when it raises)."""
        before = self.stage
        self.stage = "prepare"
        yield
        self.stage = before

    def fitting(self) -> None:
        """A fit starts (construction is over): its errors until the training loop starts are ``setup`` errors."""
        if self.stage != "prepare":
            self.stage = "setup"

    def marker(self) -> Any:
        """A fresh marker callback (put it first in ``trainer.callbacks``)."""
        return _marker_class()(self)


_MARKER: type | None = None


def _marker_class() -> type:
    global _MARKER
    if _MARKER is None:
        from lightning.pytorch import Callback

        class Marker(Callback):
            """Moves the case's stage to ``loop`` when the first training epoch starts and to ``batch`` when a batch
            starts training; counts optimizer steps."""

            def __init__(self, ctx: Ctx) -> None:
                self.ctx = ctx

            def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
                if self.ctx.stage == "setup":
                    self.ctx.stage = "loop"

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
                if self.ctx.stage in ("setup", "loop"):
                    self.ctx.stage = "batch"

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                self.ctx.steps = int(trainer.global_step)

        _MARKER = Marker
    return _MARKER


# ----------------------------------------------------------------------------------------------- classification
def _norm(text: str) -> str:
    """Lower case, ``_`` read as a space (``depth scheme`` names ``depth_scheme``)."""
    return text.lower().replace("_", " ")


def _matches(text: str, words: Sequence[Word]) -> bool:
    low = _norm(text)
    return all(any(_norm(w) in low for w in word) if isinstance(word, tuple) else _norm(word) in low for word in words)


def classify(case: Case, result: dict[str, Any]) -> tuple[str, str]:
    """The outcome of ``case`` from what its run reported, and the message excerpt that decided it.

    ``result``: ``hang`` / ``crash`` (bools), ``error`` (None or ``{"type", "message", "stage"}``), ``warnings``
    (messages of the warnings and WARNING log records seen). A pure function (tested on its own)."""
    if result.get("hang"):
        return "hang", f"no answer within {case.timeout:g} s"
    if result.get("crash"):
        return "crash", str(result.get("detail", "the worker process died"))[:EXCERPT]
    error = result.get("error")
    found = [w for w in result.get("warnings", []) if case.words and _matches(w, case.words)]
    if error is not None and error.get("stage") == "prepare":
        return "harness_error", f"{error['type']}: {error['message']}"[:EXCERPT]
    if case.valid:
        if error is None:
            return "accepted_valid", ""
        return "rejected_valid", f"{error['type']}: {error['message']}"[:EXCERPT]
    if error is not None:
        message = f"{error['type']}: {error['message']}"
        clear = _matches(message, case.words)
        if error.get("stage") in EARLY_STAGES:
            return ("clear_early" if clear else "unclear_early"), message[:EXCERPT]
        if case.runtime and clear:
            return "clear_late", message[:EXCERPT]
        return "late", message[:EXCERPT]
    if found:
        return ("warned" if case.warn_ok or case.runtime else "warned_only"), found[0][:EXCERPT]
    seen = result.get("warnings", [])
    return "silent", ("warnings seen: " + " | ".join(w[:150] for w in seen[:3])) if seen else ""


# --------------------------------------------------------------------------------------------------- one case
class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            self.messages.append(record.getMessage())


_LOGGERS = ("", "lightning", "lightning.pytorch", "lightning.fabric", "lightning_effi")

#: warnings Lightning and torch give on every tiny run, whatever the input (never a case's answer)
NOISE = (
    "but have no logger configured",
    "isinstance(treespec, LeafSpec)",
    "does not have many workers",
    "is smaller than the logging interval",
    "Seed set to",
    "The total number of parameters detected",
    "_fork_rng",
    "callbacks used to create the checkpoint need to be provided",  # a resume without the ModelCheckpoint
)


def _noise(message: str) -> bool:
    return any(n in message for n in NOISE)


def run_case(case: Case) -> dict[str, Any]:
    """Run ``case`` in this process: its error (type, message, stage) or None, the warnings seen, the wall time."""
    start = time.perf_counter()
    handler = _LogCapture()
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    for lg in loggers:
        lg.addHandler(handler)
    error: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="effi_campaign_") as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = Ctx(Path(tmp))
        try:
            case.run(ctx)
        except BaseException as exc:  # noqa: BLE001 - every outcome is recorded, KeyboardInterrupt included
            if isinstance(exc, KeyboardInterrupt):
                raise
            error = {
                "type": type(exc).__name__,
                "message": str(exc) if not isinstance(exc, SystemExit) else f"SystemExit({exc.code!r})",
                "stage": ctx.stage,
                "steps": ctx.steps,
                "where": _where(exc),
            }
        finally:
            for lg in loggers:
                lg.removeHandler(handler)
        messages = [m for m in [str(w.message) for w in caught] + handler.messages if not _noise(m)]
    return {
        "error": error,
        "warnings": list(dict.fromkeys(messages)),
        "steps": ctx.steps,
        "stage": ctx.stage,
        "seconds": round(time.perf_counter() - start, 3),
    }


def _where(exc: BaseException) -> str:
    """The innermost frame of the library (or the last frame) that raised ``exc``: ``file:line``."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "lightning_effi" in f.filename] or frames
    if not ours:
        return ""
    f = ours[-1]
    return f"{os.path.relpath(f.filename, ROOT) if f.filename.startswith(str(ROOT)) else f.filename}:{f.lineno}"


# ------------------------------------------------------------------------------------------------- the workers
def _worker(conn: Connection, quiet: bool) -> None:
    """A worker process: imports the catalogue once, then runs the case ids it is sent."""
    if quiet:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ["OMP_NUM_THREADS"] = "1"  # tiny models: one thread per worker is many times faster on shared cores
    import torch

    torch.set_num_threads(1)
    from experiments.robustness.cases import catalogue, warm_up

    cases = {c.id: c for c in catalogue()}
    if os.environ.get("EFFI_CAMPAIGN_WARM_UP", "1") == "1":
        with warnings.catch_warnings(), contextlib.suppress(Exception):
            warnings.simplefilter("ignore")
            warm_up()  # imports and first-call costs, so that a case's time is its own
    conn.send("ready")
    while True:
        case_id = conn.recv()
        if case_id is None:
            return
        try:
            result = run_case(cases[case_id])
        except BaseException as exc:  # noqa: BLE001
            result = {"crash": True, "detail": f"{type(exc).__name__}: {exc}"}
        conn.send(result)


class Worker:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, quiet), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(300) or self.conn.recv() != "ready":
            raise RuntimeError("a campaign worker did not start")
        self.case: Case | None = None
        self.started = 0.0

    def send(self, case: Case) -> None:
        self.case, self.started = case, time.monotonic()
        self.conn.send(case.id)

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.join(10)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(None)
            self.proc.join(10)
        self.kill()


def run_all(cases: Sequence[Case], jobs: int, quiet: bool = True, progress: bool = True) -> dict[str, dict[str, Any]]:
    """Run ``cases`` on ``jobs`` worker processes (each case under its timeout); ``{id: result}``."""
    results: dict[str, dict[str, Any]] = {}
    pending = list(cases)
    workers = [Worker(quiet) for _ in range(max(1, min(jobs, len(pending))))]
    done = 0
    try:
        for w in workers:
            if pending:
                w.send(pending.pop(0))
        while any(w.case is not None for w in workers):
            for i, w in enumerate(workers):
                if w.case is None:
                    continue
                case = w.case
                result: dict[str, Any] | None = None
                if w.conn.poll(0.05):
                    try:
                        result = w.conn.recv()
                    except (EOFError, OSError):
                        result = {"crash": True, "detail": f"worker exit code {w.proc.exitcode}"}
                elif not w.proc.is_alive():
                    result = {"crash": True, "detail": f"worker exit code {w.proc.exitcode}"}
                elif time.monotonic() - w.started > case.timeout:
                    result = {"hang": True, "seconds": case.timeout}
                if result is None:
                    continue
                results[case.id] = result
                done += 1
                if progress:
                    outcome, _ = classify(case, result)
                    print(f"[{done}/{len(cases)}] {case.id}: {outcome}", flush=True)
                if result.get("hang") or result.get("crash"):
                    w.kill()
                    workers[i] = w = Worker(quiet)
                w.case = None
                if pending:
                    w.send(pending.pop(0))
    finally:
        for w in workers:
            w.close()
    return results


# ----------------------------------------------------------------------------------------------------- reports
def records(cases: Sequence[Case], results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for case in cases:
        result = results[case.id]
        outcome, message = classify(case, result)
        error = result.get("error") or {}
        out.append(
            dict(
                id=case.id,
                api=case.api,
                argument=case.argument,
                value=case.value,
                kind=case.kind,
                expected=case.expected,
                words=[list(w) if isinstance(w, tuple) else w for w in case.words],
                outcome=outcome,
                stage=error.get("stage") if error else ("accepted" if not result.get("hang") else None),
                steps=error.get("steps", result.get("steps")),
                error_type=error.get("type"),
                raised_at=error.get("where"),
                message=message,
                seconds=result.get("seconds"),
                note=case.note,
            )
        )
    return out


def _md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def write_reports(
    recs: Sequence[dict[str, Any]], out: Path, command: str, seconds: float, jobs: int
) -> tuple[Path, Path]:
    """Write ``campaign.json`` and ``campaign.md`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    counts = Counter(r["outcome"] for r in recs)
    by_api: dict[str, Counter[str]] = defaultdict(Counter)
    for r in recs:
        by_api[r["api"]][r["outcome"]] += 1
    summary = {
        "command": command,
        "seconds": round(seconds, 1),
        "jobs": jobs,
        "cases": len(recs),
        "bad_inputs": sum(1 for r in recs if r["kind"] != "valid"),
        "valid_inputs": sum(1 for r in recs if r["kind"] == "valid"),
        "counts": {k: counts[k] for k in OUTCOMES if counts[k]},
        "by_api": {api: {k: c[k] for k in OUTCOMES if c[k]} for api, c in sorted(by_api.items())},
    }
    json_path = out / "campaign.json"
    json_path.write_text(json.dumps({"summary": summary, "cases": list(recs)}, indent=1) + "\n")

    used = [k for k in OUTCOMES if any(c[k] for c in by_api.values())]
    lines = [
        "# Bad-input campaign (issue #21)",
        "",
        f"Command: `{command}` ({len(recs)} cases: {summary['bad_inputs']} bad inputs, {summary['valid_inputs']} "
        f"valid edge inputs; {seconds / 60:.1f} min with {jobs} worker(s)).",
        "",
        "Outcomes: `clear_early` an error before training naming the cause; `warned` accepted with a warning "
        "naming the cause (no-op settings that may run); `accepted_valid` a valid input accepted; `clear_late` "
        "a cause that only exists during training, named when it happens; `unclear_early` an error before "
        "training that does not name the cause; `late` an error after the training loop started; `warned_only` "
        "a warning where an error is expected; `silent` accepted without a word; `hang` no answer within the "
        "timeout; `crash` the worker died; `rejected_valid` a valid input refused; `harness_error` a bug of the "
        "campaign itself.",
        "",
        "## Counts",
        "",
        "| outcome | cases |",
        "|---|---:|",
        *[f"| {k} | {counts[k]} |" for k in OUTCOMES if counts[k]],
        f"| **total** | {len(recs)} |",
        "",
        "## Per API",
        "",
        "| API | " + " | ".join(used) + " | total |",
        "|---|" + "---:|" * (len(used) + 1),
    ]
    for api, c in sorted(by_api.items()):
        lines.append(f"| {api} | " + " | ".join(str(c[k] or "") for k in used) + f" | {sum(c.values())} |")
    bad = [r for r in recs if r["outcome"] not in GOOD]
    lines += ["", f"## Cases to fix ({len(bad)}: every outcome but {', '.join(GOOD)})", ""]
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in bad:
        grouped[r["api"]].append(r)
    for api, rows in sorted(grouped.items()):
        lines += [f"### {api}", "", "| case | value | outcome | stage | message seen |", "|---|---|---|---|---|"]
        for r in rows:
            msg = r["message"] or "(nothing)"
            where = f" [{r['raised_at']}]" if r.get("raised_at") else ""
            stage = r["stage"] or ""
            if r["outcome"] == "late" and r.get("steps") is not None:
                stage = f"{stage} (step {r['steps']})"
            lines.append(
                f"| `{r['id']}` | `{_md_cell(r['value'])[:110]}` | {r['outcome']} | {stage} | "
                f"{_md_cell(msg)[:300]}{where} |"
            )
        lines.append("")
    late = [r for r in recs if r["outcome"] == "clear_late"]
    lines += [
        f"## Raised during training ({len(late)}: causes that first exist then, named when they happen)",
        "",
        "| case | value | stage | message seen |",
        "|---|---|---|---|",
    ]
    for r in late:
        stage = r["stage"] or ""
        if r.get("steps") is not None:
            stage = f"{stage} (step {r['steps']})"
        lines.append(
            f"| `{r['id']}` | `{_md_cell(r['value'])[:110]}` | {stage} | {_md_cell(r['message'] or '')[:300]} |"
        )
    lines.append("")
    md_path = out / "campaign.md"
    md_path.write_text("\n".join(lines))
    return json_path, md_path


def select(cases: Sequence[Case], only: Sequence[str] | None) -> list[Case]:
    """The cases whose id matches one of the ``only`` patterns (shell wildcards; a pattern without a wildcard
    matches as a substring)."""
    if not only:
        return list(cases)
    pats = [p if any(ch in p for ch in "*?[") else f"*{p}*" for p in only]
    return [c for c in cases if any(fnmatch.fnmatchcase(c.id, p) for p in pats)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="run the cases whose id matches (wildcards; repeatable)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "robustness" / "results"))
    parser.add_argument("--verbose", action="store_true", help="let the workers print (Lightning's output)")
    parser.add_argument("--list", action="store_true", help="list the selected cases and exit")
    args = parser.parse_args(argv)
    from experiments.robustness.cases import catalogue

    cases = select(catalogue(), args.only)
    if args.list:
        for c in cases:
            print(f"{c.id}\t{c.value}\t{c.expected}")
        print(f"{len(cases)} cases")
        return 0
    if not cases:
        print("no case matches", file=sys.stderr)
        return 1
    command = "python experiments/robustness/campaign.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:])
    )
    start = time.perf_counter()
    results = run_all(cases, args.jobs, quiet=not args.verbose)
    seconds = time.perf_counter() - start
    recs = records(cases, results)
    json_path, md_path = write_reports(recs, Path(args.out), command.strip(), seconds, args.jobs)
    counts = Counter(r["outcome"] for r in recs)
    print(", ".join(f"{k}: {counts[k]}" for k in OUTCOMES if counts[k]) + f" ({len(recs)} cases, {seconds:.0f} s)")
    print(f"Wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
