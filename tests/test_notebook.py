"""The quickstart notebook's code cells run (executed as one script, without Jupyter)."""

import json
import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    code = code.replace("max_steps=30", "max_steps=3")
    notebook_dir = tmp_path / "repo" / "notebooks"
    notebook_dir.mkdir(parents=True)
    os.symlink(NOTEBOOK.parents[1] / "conf", tmp_path / "repo" / "conf")
    monkeypatch.chdir(notebook_dir)
    scope: dict = {}
    exec(compile(code, str(NOTEBOOK), "exec"), scope)
    assert scope["monitor"].summary["samples"] == 3 * 16
    assert scope["result"]["efficiency"]["batches"] == 2 * 5  # debug=limit: 2 epochs x 5 batches
