"""The harness of the bad-input campaign (``experiments/robustness/campaign.py``, issue #21): its classifier, the
stages it records, the warnings it reads, and the verdicts on a fixed subset of real catalogue cases whose outcome
is fixed by the project's contract (errors that must name their parameter, valid numpy inputs that must pass). It
tests the harness, not every case: the whole campaign is ``python experiments/robustness/campaign.py``."""

from __future__ import annotations

import json
import logging
import warnings
from typing import Any

import pytest

from experiments.robustness.campaign import GOOD, OUTCOMES, Case, Ctx, classify, run_case, select, write_reports
from experiments.robustness.cases import catalogue


def _case(run: Any = lambda ctx: None, **kw: Any) -> Case:
    base: dict[str, Any] = dict(id="t.arg.x", api="T", argument="arg", value="1", kind="other", words=("arg",))
    return Case(run=run, **{**base, **kw})


def _error(message: str, stage: str = "construct", kind: str = "ValueError") -> dict[str, Any]:
    return {"error": {"type": kind, "message": message, "stage": stage}, "warnings": []}


# ------------------------------------------------------------------------------------------------ the classifier
@pytest.mark.parametrize(
    "case_kw, result, outcome",
    [
        ({}, _error("T.arg must be an int, got '1'"), "clear_early"),
        ({}, _error("T.arg must be an int, got '1'", stage="setup"), "clear_early"),
        ({}, _error("'<' not supported between instances of 'str' and 'int'"), "unclear_early"),
        ({}, _error("T.arg must be an int", stage="loop"), "late"),
        ({}, _error("T.arg must be an int", stage="batch"), "late"),
        ({"runtime": True}, _error("T.arg is NaN", stage="batch"), "clear_late"),
        ({"runtime": True}, _error("something broke", stage="batch"), "late"),
        ({}, {"error": None, "warnings": []}, "silent"),
        ({}, {"error": None, "warnings": ["an unrelated warning"]}, "silent"),
        ({"warn_ok": True}, {"error": None, "warnings": ["T: ARG is ignored here"]}, "warned"),
        ({}, {"error": None, "warnings": ["T: arg is ignored here"]}, "warned_only"),
        ({"kind": "valid", "valid": True}, {"error": None, "warnings": []}, "accepted_valid"),
        ({"kind": "valid", "valid": True}, _error("T.arg must be an int"), "rejected_valid"),
        ({}, {"hang": True}, "hang"),
        ({}, {"crash": True}, "crash"),
        ({}, _error("no such file", stage="prepare"), "harness_error"),
    ],
)
def test_classify(case_kw, result, outcome):
    assert classify(_case(**case_kw), result)[0] == outcome


def test_words_alternatives_and_underscores():
    case = _case(words=(("depth_scheme", "depth groups"), "pairs"))
    assert classify(case, _error("n_layer: unknown depth scheme 'pairs'"))[0] == "clear_early"  # _ read as a space
    assert classify(case, _error("unknown depth groups 'pairs'"))[0] == "clear_early"
    assert classify(case, _error("unknown scheme 'pairs'"))[0] == "unclear_early"  # no alternative named
    assert classify(case, _error("unknown depth scheme"))[0] == "unclear_early"  # both words needed


def test_every_outcome_is_listed_once_and_good_ones_are_outcomes():
    assert len(set(OUTCOMES)) == len(OUTCOMES) and set(GOOD) <= set(OUTCOMES)


# -------------------------------------------------------------------------------------- run_case: stages, warnings
def _construct_fails(ctx: Ctx) -> None:
    raise ValueError("T.arg must be >= 1, got 0")


def _loop_then_raise(ctx: Ctx) -> None:
    ctx.fitting()
    ctx.stage = "loop"  # what the marker callback does at the first on_train_epoch_start
    raise ValueError("T.arg: the batch has no tokens")


def _warns(ctx: Ctx) -> None:
    warnings.warn("T.arg=1 does nothing on this data", UserWarning, stacklevel=1)


def _logs(ctx: Ctx) -> None:
    logging.getLogger("lightning_effi.test").warning("T.arg is ignored")


def _prepare_fails(ctx: Ctx) -> None:
    with ctx.preparing():
        raise FileNotFoundError("the checkpoint the case needs")


def _setup_fails(ctx: Ctx) -> None:
    ctx.fitting()
    raise TypeError("object of type 'Stream' has no len()")


@pytest.mark.parametrize(
    "run, case_kw, outcome, stage",
    [
        (_construct_fails, {}, "clear_early", "construct"),
        (_setup_fails, {}, "unclear_early", "setup"),
        (_loop_then_raise, {}, "late", "loop"),
        (_warns, {"warn_ok": True}, "warned", None),
        (_warns, {}, "warned_only", None),
        (_logs, {"warn_ok": True}, "warned", None),
        (lambda ctx: None, {}, "silent", None),
        (lambda ctx: None, {"kind": "valid", "valid": True}, "accepted_valid", None),
        (_prepare_fails, {}, "harness_error", "prepare"),
    ],
)
def test_run_case_records_stage_and_warnings(run, case_kw, outcome, stage):
    result = run_case(_case(run, **case_kw))
    assert classify(_case(run, **case_kw), result)[0] == outcome
    assert (result["error"] or {}).get("stage") == stage


def test_run_case_leaves_no_handler_or_warning_filter_behind():
    root = logging.getLogger()
    handlers, filters = list(root.handlers), list(warnings.filters)
    run_case(_case(_logs))
    run_case(_case(_warns))
    assert root.handlers == handlers and warnings.filters == filters


# ------------------------------------------------------------------------------------------------- the catalogue
def test_catalogue_size_ids_and_kinds():
    cases = catalogue()
    ids = [c.id for c in cases]
    assert len(cases) >= 360 and len(set(ids)) == len(ids)
    assert sum(c.valid for c in cases) >= 40  # valid edge inputs, scored separately
    kinds = {c.kind for c in cases}
    assert {"wrong_type", "out_of_range", "order", "size", "files", "noop", "checkpoint", "nonfinite", "valid"} <= kinds
    apis = {c.api for c in cases}
    for api in (
        "InfoBatchCallback",
        "InfoBatchDataModule",
        "Curriculum",
        "CurriculumDataModule",
        "parse_deepspeed_config",
        "RandomLTDCallback",
        "VCycleCallback",
        "EfficiencyMonitor",
        "GenericAdapter",
        "DataAnalyzer",
        "index files",
        "Hydra app",
        "report: result.json",
    ):
        assert api in apis, api
    assert all(c.words for c in cases if not c.valid)  # every bad input says what its message must name
    assert all(c.valid == (c.kind == "valid") for c in cases)


def test_select_matches_wildcards_and_substrings():
    cases = catalogue()
    assert {c.id for c in select(cases, ["infobatch.prune_ratio.*"])} == {
        c.id for c in cases if c.id.startswith("infobatch.prune_ratio.")
    }
    found = [c.id for c in select(cases, ["prune_ratio.above1"])]  # no wildcard: a substring
    assert "infobatch.prune_ratio.above1" in found and all("prune_ratio.above1" in i for i in found)
    assert select(cases, None) == cases


#: real catalogue cases whose outcome the contract fixes (construction-only: milliseconds each)
KNOWN = {
    "infobatch.prune_ratio.above1": "clear_early",
    "infobatch.prune_ratio.str": "clear_early",
    "infobatch.delta.zero": "clear_early",
    "infobatch.strict.str_false": "clear_early",
    "random_ltd.min_value.zero": "clear_early",
    "random_ltd.layer_ids.descending": "clear_early",
    "vcycle.alpha_original.above1": "clear_early",
    "vcycle.e_a.float": "clear_early",
    "curriculum.metric.min_difficulty.str": "clear_early",
    "deepspeed.legacy_block": "clear_early",
    "monitor.log_every_n_steps.zero": "clear_early",
    "analyzer.num_workers.zero": "clear_early",
    "report.result_json.schema_1": "clear_early",
    "report.frontier.saving_zero": "clear_early",
    "functional.random_ltd.ltd_value.valid_numpy": "accepted_valid",
    "functional.schedules.CurriculumSchedule.valid_numpy": "accepted_valid",
    "functional.vcycle.interpolate.alpha_np": "accepted_valid",
    "functional.core.Duration.parse.np_int": "accepted_valid",
}


@pytest.fixture(scope="module")
def imported():
    """The library and the tiny test pieces imported once (torch, Lightning, transformers: seconds), not inside the
    first case's timing."""
    import lightning_effi.callbacks  # noqa: F401
    import lightning_effi.curriculum.analysis  # noqa: F401
    import lightning_effi.functional  # noqa: F401
    import tests.helpers.tiny  # noqa: F401


@pytest.mark.parametrize("case_id", sorted(KNOWN))
def test_known_real_cases(imported, case_id):
    (case,) = [c for c in catalogue() if c.id == case_id]
    result = run_case(case)
    outcome, message = classify(case, result)
    assert outcome == KNOWN[case_id], (outcome, message)
    if outcome == "clear_early":
        assert result["error"]["stage"] == "construct"


def test_reports_count_every_case_and_list_the_ones_to_fix(tmp_path):
    recs = [
        dict(
            id=f"t.{o}",
            api="T" if i % 2 else "U",
            argument="arg",
            value="1",
            kind="other",
            outcome=o,
            stage="x",
            steps=0,
            message=f"msg {o}",
            raised_at="",
            note="",
        )
        for i, o in enumerate(OUTCOMES)
    ]
    json_path, md_path = write_reports(recs, tmp_path, "python experiments/robustness/campaign.py", 61.0, 2)
    data = json.loads(json_path.read_text())
    assert data["summary"]["cases"] == len(OUTCOMES) and sum(data["summary"]["counts"].values()) == len(OUTCOMES)
    assert data["summary"]["by_api"]["T"] == {o: 1 for i, o in enumerate(OUTCOMES) if i % 2}
    md = md_path.read_text()
    to_fix, _, during = md.partition("## Raised during training")
    listed = {o for o in OUTCOMES if f"`t.{o}`" in to_fix}
    assert listed == set(OUTCOMES) - set(GOOD)
    assert {o for o in OUTCOMES if f"`t.{o}`" in during} == {"clear_late"}


@pytest.mark.slow
def test_worker_pool_survives_a_hang_and_a_dying_worker(tmp_path, monkeypatch):
    """The command line on the harness's own cases (``EFFI_CAMPAIGN_SELFTEST=1``): a case that sleeps past its
    timeout is a hang and one whose process exits is a crash; each worker is replaced and the next case still runs;
    both files are written."""
    from experiments.robustness.campaign import main

    monkeypatch.setenv("EFFI_CAMPAIGN_SELFTEST", "1")
    monkeypatch.setenv("EFFI_CAMPAIGN_WARM_UP", "0")
    assert main(["--only", "selftest.*", "--jobs", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "campaign.json").read_text())
    outcomes = {c["id"]: c["outcome"] for c in data["cases"]}
    assert outcomes == {"selftest.hang": "hang", "selftest.crash": "crash", "selftest.clear": "clear_early"}
    assert data["summary"]["counts"] == {"clear_early": 1, "hang": 1, "crash": 1}
    md = (tmp_path / "campaign.md").read_text()
    assert "`selftest.hang`" in md and "`selftest.crash`" in md and "`selftest.clear`" not in md
