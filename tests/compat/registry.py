"""The compatibility matrix as data: one :class:`Row` per Lightning feature, with the expected outcome of each
technique column (:data:`~tests.compat.setups.TECHNIQUES`): ``"works"`` (the test asserts the technique's and the
feature's effects) or ``"refused"`` (the test asserts the refusal before the first step, naming the feature).

Each test module of :data:`MODULES` defines ``ROWS`` and, for every row, a test ``test_<feature>`` parametrized over
the techniques that reads its expectation with :func:`expect`. The README's compatibility table is rendered from these
rows: ``python -m tests.compat.registry --write`` rewrites it, ``tests/compat/test_registry.py`` fails when it drifts.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from pathlib import Path

from tests.compat.setups import REFUSED, TECHNIQUES, WORKS

#: the test modules holding rows, in the table's order
MODULES = ("tests.compat.test_loop", "tests.compat.test_optimization", "tests.compat.test_runtime")

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN, END = "<!-- compat-table:begin -->", "<!-- compat-table:end -->"
HEADERS = {
    "infobatch": "InfoBatch",
    "curriculum": "Curriculum",
    "random_ltd": "random-LTD",
    "vcycle": "V-cycle",
    "stack": "all four",
}


@dataclass(frozen=True)
class Row:
    """One feature of the matrix.

    Attributes:
        feature: the key (``test_<feature>`` is its test), e.g. ``"overfit_batches"``.
        title: the README's label, e.g. ``"Trainer(overfit_batches=...)"``.
        cells: the expected outcome per technique column: ``"works"`` or ``"refused"``.
        note: what the working cells check, or why a refusal (one sentence, shown under the table).
    """

    feature: str
    title: str
    cells: dict[str, str]
    note: str = ""

    def __post_init__(self) -> None:
        assert set(self.cells) == set(TECHNIQUES), f"{self.feature}: cells for {sorted(self.cells)}"
        assert set(self.cells.values()) <= {WORKS, REFUSED}, f"{self.feature}: {self.cells}"


def works(**refused: str) -> dict[str, str]:
    """Cells: every technique works except those given as ``technique="refused"``."""
    return {t: refused.get(t, WORKS) for t in TECHNIQUES}


def rows() -> list[Row]:
    """Every row of every module in :data:`MODULES` (modules not written yet are skipped)."""
    out: list[Row] = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        out.extend(module.ROWS)
    return out


def expect(feature: str, technique: str) -> str:
    """The expected outcome of the cell (``"works"`` or ``"refused"``)."""
    for row in rows():
        if row.feature == feature:
            return row.cells[technique]
    raise KeyError(feature)


def render(table_rows: list[Row] | None = None) -> str:
    """The README's compatibility table (Markdown), with the notes as a list under it."""
    table_rows = rows() if table_rows is None else table_rows
    mark = {WORKS: "yes", REFUSED: "refused"}
    lines = [
        "| feature | " + " | ".join(HEADERS[t] for t in TECHNIQUES) + " |",
        "|---|" + "---|" * len(TECHNIQUES),
    ]
    for row in table_rows:
        lines.append(f"| {row.title} | " + " | ".join(mark[row.cells[t]] for t in TECHNIQUES) + " |")
    notes = [f"- **{row.title}**: {row.note}" for row in table_rows if row.note]
    return "\n".join([*lines, "", *notes]) if notes else "\n".join(lines)


def readme_table(text: str | None = None) -> str:
    """The table between the README's markers."""
    text = README.read_text() if text is None else text
    head, sep, rest = text.partition(BEGIN)
    table, sep2, _ = rest.partition(END)
    assert sep and sep2, f"README.md lacks the markers {BEGIN} / {END}"
    return table.strip("\n")


def write_readme() -> None:
    """Replace the README's table with :func:`render`'s."""
    text = README.read_text()
    readme_table(text)  # the markers are there
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    README.write_text(f"{head}{BEGIN}\n{render()}\n{END}{tail}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the README's table (default: print it)")
    if parser.parse_args().write:
        write_readme()
    else:
        print(render())
