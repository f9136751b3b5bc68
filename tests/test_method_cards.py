"""The method cards' "## Guarantees" sections (issue #21): each technique's card lists its guarantees, each bullet a
promise followed by the tests that check it, as pytest node ids in backticks
(``tests/infobatch/test_callback.py::test_resume_at_an_epoch_boundary_and_mid_epoch_equals_uninterrupted``).

The cards are read when the tests run, so a renamed, deleted or xfail-marked test fails here instead of leaving a
promise that nothing checks. A node id exists when its file exists and defines the test (for
``file.py::Class::test`` the class and its method; a parametrized id ``test_x[param]`` names ``test_x``; the
parameter itself is not checked: collecting it would import the test module, so a parameter-level xfail mark is not
seen either; ``pytest --collect-only -q -m xfail <files>`` lists those). The sources are scanned line by line, never
imported, so the whole check runs in well under a second.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TECHNIQUES = ("infobatch", "curriculum", "random_ltd", "vcycle")
CARDS = {name: ROOT / "lightning_effi" / name / "README.md" for name in TECHNIQUES}

HEADING = "## Guarantees"
#: a pytest node id in backticks: a path under tests/ to a .py file, then ``::`` and at least one name
NODE_ID = re.compile(r"`(tests/[^`\s]+?\.py::[^`]+)`")


def guarantees_section(text: str) -> str | None:
    """The body of the card's ``## Guarantees`` section (up to the next ``#``/``##`` heading), or None without one."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.rstrip() == HEADING)
    except StopIteration:
        return None
    body = []
    for line in lines[start + 1 :]:
        if re.match(r"#{1,2} ", line):
            break
        body.append(line)
    return "\n".join(body)


def bullets(section: str) -> list[str]:
    """The section's top-level bullets (``- ...``), each with its indented continuation lines, joined by spaces;
    paragraphs outside a bullet are not guarantees and are skipped."""
    out: list[str] = []
    current: list[str] | None = None
    for line in section.splitlines():
        if line.startswith(("- ", "* ")):
            current = [line[2:].strip()]
            out.append("")
        elif current is not None and line[:1].isspace() and line.strip():
            current.append(line.strip())
        else:
            current = None
            continue
        out[-1] = " ".join(current)
    return out


def node_ids(bullet: str) -> list[str]:
    return NODE_ID.findall(bullet)


@cache
def _lines(path: Path) -> tuple[str, ...]:
    return tuple(path.read_text(encoding="utf-8").splitlines())


def _find(lines: tuple[str, ...], name: str, start: int = 0, stop: int | None = None, top: bool = True) -> int | None:
    """The line of ``def name`` / ``async def name`` / ``class name`` in ``lines[start:stop]``: at column 0 when
    ``top``, else indented (a method)."""
    indent = "" if top else r"[ \t]+"
    pattern = re.compile(rf"{indent}(?:async[ \t]+def|def|class)[ \t]+{re.escape(name)}\b")
    for i in range(start, len(lines) if stop is None else stop):
        if pattern.match(lines[i]):
            return i
    return None


def _block_end(lines: tuple[str, ...], i: int) -> int:
    """The line after the body of the class defined at line ``i`` (the next line at column 0)."""
    for j in range(i + 1, len(lines)):
        if lines[j][:1] not in ("", " ", "\t"):
            return j
    return len(lines)


XFAIL = re.compile(r"^[ \t]*@(?:pytest\.)?mark\.xfail\b", re.MULTILINE)


def _xfail(lines: tuple[str, ...], i: int) -> bool:
    """Whether the definition at line ``i`` carries ``@pytest.mark.xfail`` (a known defect: its promise is not kept),
    read from its decorators (the contiguous lines above it, from the first ``@`` line at its indentation)."""
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    j = i
    while j > 0:
        above = lines[j - 1]
        rest = above[len(indent) :] if above.startswith(indent) else ""
        if not above.strip() or not (rest.startswith(("@", ")", "]", "}")) or rest[:1].isspace()):
            break
        j -= 1
    block = lines[j:i]
    first = next((k for k, line in enumerate(block) if line.startswith(indent + "@")), len(block))
    return bool(XFAIL.search("\n".join(block[first:])))


def node_problem(node_id: str, root: Path = ROOT) -> str | None:
    """Why ``node_id`` does not name a test that checks something (None when it does): no such file, no such
    class or function (parameters stripped), not a test, or marked xfail. The file is scanned line by line, not
    imported nor parsed (fast: definitions at column 0, methods indented inside their class)."""
    file, _, rest = node_id.partition("::")
    path = root / file
    if not path.is_file():
        return f"{file} does not exist"
    parts = re.sub(r"\[.*\]$", "", rest, flags=re.DOTALL).split("::")  # parameters: only on the last name
    if len(parts) > 2 or not all(parts):
        return f"{node_id} is not a node id of a function or of a class's method"
    lines = _lines(path)
    found = _find(lines, parts[0])
    if found is None:
        return f"{file} defines no {parts[0]}"
    chain = [found]
    if len(parts) == 2:
        method = _find(lines, parts[1], found + 1, _block_end(lines, found), top=False)
        if method is None:
            return f"{file} defines no {parts[0]}::{parts[1]}"
        chain.append(method)
    if not parts[-1].startswith("test"):
        return f"{node_id} is not a test (pytest collects names starting with 'test')"
    if any(_xfail(lines, i) for i in chain):
        return f"{node_id} is marked xfail: a known defect does not check a guarantee"
    return None


def section_problems(section: str, root: Path = ROOT) -> list[str]:
    """Every problem of a Guarantees section: no bullet, a bullet without a node id, a node id that names no test."""
    found = bullets(section)
    if not found:
        return ["the section has no bullet"]
    problems = []
    for number, bullet in enumerate(found, 1):
        ids = node_ids(bullet)
        if not ids:
            problems.append(f"bullet {number} names no test: {bullet[:100]}")
        for node_id in ids:
            problem = node_problem(node_id, root)
            if problem is not None:
                problems.append(f"bullet {number}: {problem}")
    return problems


# ------------------------------------------------------------------------------------------------------ the cards
@pytest.mark.parametrize("technique", TECHNIQUES)
def test_every_guarantee_names_tests_that_exist(technique: str) -> None:
    section = guarantees_section(CARDS[technique].read_text(encoding="utf-8"))
    if section is None:
        pytest.skip(f"{CARDS[technique].relative_to(ROOT)} has no {HEADING} section yet")
    assert section_problems(section) == []


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_every_card_has_a_guarantees_section(technique: str) -> None:
    assert guarantees_section(CARDS[technique].read_text(encoding="utf-8")) is not None


# ------------------------------------------------------------------------------------------------ the checker itself
CARD = f"""# A technique

## How to use

- not a guarantee: `tests/nowhere.py::test_nothing`

{HEADING}

Each promise below is checked by the tests named after it.

- Resumes exactly: `tests/test_method_cards.py::test_every_guarantee_names_tests_that_exist[infobatch]`,
  `tests/test_method_cards.py::test_each_problem_is_named`
- Promised, untested; the code span `prune_ratio` is no node id
- Checked by a test that does not exist: `tests/test_method_cards.py::test_no_such_test`
- Checked by a helper, not a test: `tests/test_method_cards.py::node_problem`
- Checked in a missing file: `tests/missing.py::test_x`

### Details

- still the section: `tests/test_method_cards.py::TestNothing::test_x`

## Results

- `tests/nowhere.py::test_nothing`
"""


def test_the_section_is_read_up_to_the_next_heading() -> None:
    section = guarantees_section(CARD)
    assert section is not None and "## Results" not in section and "### Details" in section
    assert guarantees_section(CARD.replace(HEADING, "## Guarantees (draft)")) is None
    found = bullets(section)
    assert len(found) == 6 and found[0].endswith("test_each_problem_is_named`")
    assert node_ids(found[0]) == [
        "tests/test_method_cards.py::test_every_guarantee_names_tests_that_exist[infobatch]",
        "tests/test_method_cards.py::test_each_problem_is_named",
    ]


def test_each_problem_is_named() -> None:
    section = guarantees_section(CARD)
    assert section is not None
    assert section_problems(section) == [
        "bullet 2 names no test: Promised, untested; the code span `prune_ratio` is no node id",
        "bullet 3: tests/test_method_cards.py defines no test_no_such_test",
        "bullet 4: tests/test_method_cards.py::node_problem is not a test (pytest collects names starting with 'test')",
        "bullet 5: tests/missing.py does not exist",
        "bullet 6: tests/test_method_cards.py defines no TestNothing",
    ]
    assert section_problems("Only a paragraph.\n") == ["the section has no bullet"]


def test_class_methods_parameters_and_known_defects(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n\n"
        "class TestA:\n    def test_b(self):\n        pass\n\n"
        "@pytest.mark.xfail(strict=True, reason='bug')\nclass TestBroken:\n    def test_c(self):\n        pass\n\n"
        "@pytest.mark.xfail\ndef test_d():\n    pass\n\n\n"
        "@pytest.mark.xfail(\n    strict=True,\n    reason='bug',\n)\n@pytest.mark.parametrize('x', [1])\n"
        "def test_e(x):\n    pass\n\n\n"
        "@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.xfail)])\nasync def test_f(x):\n    pass\n"
    )
    assert node_problem("tests/test_x.py::TestA::test_b[1-2]", tmp_path) is None
    assert node_problem("tests/test_x.py::TestA::test_z", tmp_path) == "tests/test_x.py defines no TestA::test_z"
    assert node_problem("tests/test_x.py::TestA::test_b::test_c", tmp_path) == (
        "tests/test_x.py::TestA::test_b::test_c is not a node id of a function or of a class's method"
    )
    assert "marked xfail" in (node_problem("tests/test_x.py::TestBroken::test_c", tmp_path) or "")
    assert node_problem("tests/test_x.py::test_d[a]", tmp_path) == (
        "tests/test_x.py::test_d[a] is marked xfail: a known defect does not check a guarantee"
    )
    assert "marked xfail" in (node_problem("tests/test_x.py::test_e[1]", tmp_path) or "")
    assert node_problem("tests/test_x.py::test_f[1]", tmp_path) is None  # one parameter's mark: not the test's
    assert node_problem("tests/test_x.py::test_b", tmp_path) == "tests/test_x.py defines no test_b"  # a method only


@pytest.mark.parametrize("technique", ("infobatch", "curriculum", "random_ltd"))
def test_the_cards_requirements_example_holds(technique: str) -> None:
    """The card's Python block on ``.requirements`` runs: its assertions are the callback's declared requirements
    (an ``==`` against an abridged ``Requirements(...)`` read as true and was false)."""
    text = CARDS[technique].read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if ".requirements\n" in b]
    assert len(blocks) == 1, f"{technique}: expected one requirements example, found {len(blocks)}"
    exec(compile(blocks[0], f"{technique}/README.md", "exec"), {})
