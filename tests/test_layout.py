"""The layout contract: one folder per technique with its method card, metadata and callback; cards share their
sections; the public classes import from the package top level; comments cite papers, not private codes."""

import json
import re
from pathlib import Path

import pytest

import lightning_effi

PACKAGE = Path(lightning_effi.__file__).parent
TECHNIQUES = ("infobatch", "curriculum", "random_ltd", "vcycle")
CARD_SECTIONS = [
    "How to use",
    "What it needs from your module",
    "Suggested hyperparameters",
    "Technical details",
    "Results",
    "Guarantees",
    "Composition",
    "Attribution",
    "API",
]


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_technique_folder_and_card(technique):
    folder = PACKAGE / technique
    for name in ("README.md", "metadata.json", "callback.py", "__init__.py"):
        assert (folder / name).is_file(), f"{technique}/{name} is missing"
    card = (folder / "README.md").read_text()
    assert re.findall(r"^## (.+)$", card, flags=re.M) == CARD_SECTIONS
    meta = json.loads((folder / "metadata.json").read_text())
    assert {"name", "class_name", "functional", "tldr", "attribution", "link", "requirements", "card", "hydra"} <= set(
        meta
    )
    assert hasattr(lightning_effi, meta["class_name"])
    assert (PACKAGE.parent / meta["hydra"]).is_file()


def test_public_classes_import_from_the_top_level():
    from lightning_effi import (  # noqa: F401
        CurriculumDataModule,
        DataAnalyzer,
        EfficiencyMonitor,
        InfoBatchCallback,
        InfoBatchDataModule,
        RandomLTDCallback,
        VCycleCallback,
    )

    for name in lightning_effi.__all__:
        assert hasattr(lightning_effi, name), name


def test_no_private_specification_codes_in_the_package():
    pattern = re.compile(r"§|shared/specs|acceptance test|\bspec\b|\b[VRCI][0-9]{1,2}[a-z]?\b")
    hits = [
        f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*"))
        if path.suffix in (".py", ".md", ".json")
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []
