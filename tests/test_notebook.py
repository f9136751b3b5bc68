"""The quickstart notebook, executed under a real Jupyter kernel (``nbclient`` + ``ipykernel``) from ``notebooks/``
as a user runs it, with the Trainer's default progress bar (``RichProgressBar`` when ``rich`` is installed); and
:func:`lightning_effi.core.console.print_block`, which keeps the efficiency summary printable under that bar.

The notebook's runs are shortened by ``QUICKSTART_STEPS`` and its Hydra run writes under ``QUICKSTART_OUT`` (a
temporary folder): nothing is written into the repository. The kernel talks to the test over IPC sockets in the
temporary folder (no TCP port), and nothing touches the network.
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from lightning_effi.core.console import print_block

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"

#: the notebook's run length in the test: 4 epochs of 4 batches of 16 blocks of 64 tokens
STEPS, EPOCHS, BATCH, BLOCK = 16, 4, 16, 64
SAMPLES = STEPS * BATCH  # every epoch draws all of its STEPS // EPOCHS * BATCH samples
#: the Hydra cell: debug=limit, 2 epochs of 5 batches of the default data (16 blocks of 128 tokens)
HYDRA_BATCHES, HYDRA_BATCH, HYDRA_BLOCK = 2 * 5, 16, 128


def execute(nb: nbformat.NotebookNode, cwd: Path, tmp_path: Path, timeout: int = 300) -> None:
    """Run every cell of ``nb`` in a fresh ``python3`` kernel started in ``cwd`` (outputs stay in ``nb``; errors
    stay as error outputs, asserted by the callers)."""
    km = KernelManager(kernel_name="python3", transport="ipc", connection_file=str(tmp_path / "kernel.json"))
    client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=True, resources={"metadata": {"path": str(cwd)}})
    client.execute()


def errors(nb: nbformat.NotebookNode) -> list[str]:
    return [
        f"cell {i}: {o.ename}: {o.evalue}"
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for o in cell.outputs
        if o.output_type == "error"
    ]


def text_of(cell: nbformat.NotebookNode) -> str:
    """Everything a code cell printed or displayed as text."""
    parts = []
    for o in cell.outputs:
        if o.output_type == "stream":
            parts.append(o.text)
        elif "text/plain" in o.get("data", {}):
            parts.append(o.data["text/plain"])
    return "\n".join(parts)


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")} if folder.exists() else set()


# ------------------------------------------------------------------------------------------------ the notebook
def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert len(code) >= 8
    assert [(c.outputs, c.execution_count) for c in code] == [([], None)] * len(code)
    assert nb.metadata.kernelspec.name == "python3"
    # the test shortens the runs and moves the outputs through these two variables
    assert 'os.environ.get("QUICKSTART_STEPS"' in code[0].source
    assert 'os.environ.get("QUICKSTART_OUT"' in code[0].source


def schedule_values(records: dict[str, Any], run: str, key: str) -> list[float]:
    return [p[key] for p in records[run]["schedule"] if key in p]


@pytest.mark.slow
def test_quickstart_notebook_runs_under_a_kernel(tmp_path, monkeypatch):
    out, records_path = tmp_path / "out", tmp_path / "records.json"
    monkeypatch.setenv("QUICKSTART_STEPS", str(STEPS))
    monkeypatch.setenv("QUICKSTART_OUT", str(out))
    # a tiny model: one thread each (two threads on a busy 2-core machine make every step ~10x slower)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    watched = [NOTEBOOK.parent, ROOT / "conf", ROOT / "logs" / "quickstart"]
    before = [files_under(folder) for folder in watched]

    nb = nbformat.read(NOTEBOOK, as_version=4)
    n_cells = len(nb.cells)
    # appended in the test only: every run's records, for the assertions below
    nb.cells.append(
        new_code_cell(
            "import json\n"
            "from hydra.core.hydra_config import HydraConfig\n"
            "records = {name: {'summary': m.summary, 'curve': m.curve, 'schedule': m.schedule} "
            "for name, m in runs.items()}\n"
            "records['hydra_left_set'] = HydraConfig.initialized()\n"
            f"Path({str(records_path)!r}).write_text(json.dumps(records))"
        )
    )
    execute(nb, NOTEBOOK.parent, tmp_path)

    assert errors(nb) == []
    code = [c for c in nb.cells[:n_cells] if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    # one figure per run, the comparison and the Hydra run
    figures = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(figures) == 7
    # the baseline's summary table, printed by the EfficiencyMonitor at the end of fit (the notebook's fits run without
    # the progress bar, which cost 8-15x the training time of these tiny fits inside a kernel)
    baseline_text = next(text_of(c) for c in code if 'runs["baseline"] = train(' in c.source)
    assert "Efficiency summary" in baseline_text
    table = dict(line.split() for line in baseline_text.splitlines() if len(line.split()) == 2)
    assert (table["samples"], table["optimizer_steps"]) == (str(SAMPLES), str(STEPS))

    records = json.loads(records_path.read_text())
    # the Hydra cell leaves no Hydra job behind: a plain Trainer's ResultWriter in a later cell wrote into its run's
    # folder and recorded its overrides (qa102-user 05)
    assert records.pop("hydra_left_set") is False
    assert list(records) == ["baseline", "infobatch", "curriculum", "random_ltd", "vcycle"]
    base = records["baseline"]["summary"]
    assert (base["optimizer_steps"], base["samples"], base["tokens"]) == (STEPS, SAMPLES, SAMPLES * BLOCK)
    assert base["flops"] == base["baseline_flops"] > 0 and base["flops_saved_frac"] == 0.0
    for name, record in records.items():
        curve = record["curve"]
        # val_check_interval=0.5: every 2 batches (InfoBatch's 3-batch pruned epochs: every batch)
        assert len(curve) == (10 if name == "infobatch" else 2 * EPOCHS), name
        assert all(a["flops"] < b["flops"] and a["step"] < b["step"] for a, b in zip(curve, curve[1:])), name
        assert all(math.isfinite(p["metrics"]["val/loss"]) for p in curve), name
        summary = record["summary"]
        assert summary["baseline_samples"] == SAMPLES, name  # every technique is measured against the same data
        if name != "baseline":
            assert 0 < summary["flops_saved_frac"] < 1 and summary["flops"] < summary["baseline_flops"], name

    # InfoBatch pruned samples in the middle epochs: the first (no scores yet) and the last (delta=0.75) are full
    ib = records["infobatch"]["summary"]
    kept = schedule_values(records, "infobatch", "infobatch/kept_fraction")
    assert ib["infobatch/saved_samples"] > 0 and ib["infobatch/prune_epochs"] == 2
    assert ib["samples"] + ib["infobatch/saved_samples"] == SAMPLES
    assert kept[0] == kept[-1] == 1.0 and min(kept) < 1.0
    assert ib["optimizer_steps"] < STEPS  # the pruned epochs are shorter
    # the curriculum's difficulty (tokens per sample) grew from 16 to the full block (by step 9 of 16)
    difficulty = schedule_values(records, "curriculum", "curriculum/difficulty")
    assert 16 <= difficulty[0] < BLOCK and difficulty[-1] == BLOCK and difficulty == sorted(difficulty)
    cl = records["curriculum"]["summary"]
    assert cl["tokens"] < SAMPLES * BLOCK and cl["curriculum/consumed_tokens"] == cl["tokens"]
    # random-LTD dropped layer-tokens in the middle layers while its reserved length grew from 16 to 64
    reserved = schedule_values(records, "random_ltd", "random_ltd/reserved_length")
    assert reserved[0] == 16 and reserved[-1] == BLOCK and reserved == sorted(reserved)
    ltd = records["random_ltd"]["summary"]
    assert ltd["layer_tokens"] < ltd["baseline_layer_tokens"] and ltd["random_ltd/layer_token_saving"] > 0
    assert ltd["tokens"] == SAMPLES * BLOCK  # it drops tokens inside layers, not from the batch
    # the V-cycle went down to level 2 and back to the full model
    levels = schedule_values(records, "vcycle", "vcycle/level")
    assert levels[0] == levels[-1] == 1 and 2 in levels
    vc = records["vcycle"]["summary"]
    assert vc["vcycle/switches"] == 2 and vc["vcycle/final_level"] == 1

    # the Hydra cell wrote its run record under QUICKSTART_OUT
    result = json.loads((out / "hydra" / "result.json").read_text())
    assert result["arm"] == "random_ltd" and list(result["techniques"]) == ["random_ltd"]
    eff = result["efficiency"]
    assert (eff["batches"], eff["samples"]) == (HYDRA_BATCHES, HYDRA_BATCHES * HYDRA_BATCH)
    assert eff["tokens"] == HYDRA_BATCHES * HYDRA_BATCH * HYDRA_BLOCK
    assert eff["layer_tokens"] < eff["baseline_layer_tokens"]
    assert [p["step"] for p in result["curve"]] == [5, 10]
    reserved = [p["random_ltd/reserved_length"] for p in result["schedule"] if "random_ltd/reserved_length" in p]
    assert len(reserved) >= HYDRA_BATCHES  # trainer.log_every_n_steps=1
    assert 32 <= reserved[0] < reserved[-1] <= HYDRA_BLOCK and reserved == sorted(reserved)  # min_value=32, growing

    # nothing written into the repository
    assert [files_under(folder) for folder in watched] == before


# ------------------------------------------------------------------------------------------------ print_block
class FlushingConsole:
    """A ``rich`` console as it behaves in a Jupyter kernel: ``print`` publishes display data, and ipykernel flushes
    ``sys.stdout`` before it publishes anything (``ZMQDisplayPublisher._flush_streams``)."""

    def __init__(self) -> None:
        self.printed: list[str] = []

    def __enter__(self) -> FlushingConsole:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def print(self, renderable: Any) -> None:
        sys.stdout.flush()
        self.printed.append(str(renderable))


def test_print_block_under_a_proxied_stdout(monkeypatch):
    from rich.file_proxy import FileProxy

    console = FlushingConsole()
    monkeypatch.setattr(sys, "stdout", FileProxy(console, io.StringIO()))  # type: ignore[arg-type]
    print_block("line one\nline two")
    print_block("one line")
    assert console.printed == ["line one\nline two", "one line"]
    # the cause, pinned: print writes the text and its newline separately, so the flush finds "line two" buffered
    with pytest.raises(RecursionError):
        print("line one\nline two", flush=True)


def test_print_block_prints_what_print_prints():
    ours, theirs = io.StringIO(), io.StringIO()
    for text in ("a\nb\n", "a", "", "x\n\ny"):
        print_block(text, file=ours)
        print(text, file=theirs, flush=True)
    assert ours.getvalue() == theirs.getvalue()
    with pytest.raises(TypeError, match="print_block: text must be a str, got bytes"):
        print_block(b"a")  # type: ignore[arg-type]


@pytest.mark.slow
def test_print_block_under_a_live_rich_display_in_a_kernel(tmp_path):
    """The RecursionError itself, in a real kernel: a multi-line ``print`` under a live ``rich`` progress display
    fails, :func:`print_block` prints the same text."""
    nb = new_notebook(
        cells=[
            new_code_cell(
                "from rich.progress import Progress\n"
                "from lightning_effi.core.console import print_block\n"
                "with Progress():\n"
                "    print_block('line one\\nline two')"
            ),
            new_code_cell("with Progress():\n    print('line one\\nline two')"),
        ]
    )
    execute(nb, tmp_path, tmp_path, timeout=120)
    assert "line one\nline two" in text_of(nb.cells[0])
    assert not [o for o in nb.cells[0].outputs if o.output_type == "error"]
    assert [o.ename for o in nb.cells[1].outputs if o.output_type == "error"] == ["RecursionError"]
