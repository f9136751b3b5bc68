"""Curriculum schedules: golden vectors of DeepSpeed's ``CurriculumScheduler`` (reproduced on deepspeed 0.19.8), the
clamped mode's bounds, the freeze rule and validation."""

from __future__ import annotations

import itertools

import pytest

from lightning_effi.curriculum.schedules import CurriculumSchedule, ScheduleConfigError, difficulties


def linear(lo, hi, total, q, rounding="clamped"):
    return CurriculumSchedule("fixed_linear", lo, hi, dict(total_curriculum_step=total, difficulty_step=q), rounding)


def root(lo, hi, total, q, k, rounding="clamped"):
    return CurriculumSchedule(
        "fixed_root", lo, hi, dict(total_curriculum_step=total, difficulty_step=q, root_degree=k), rounding
    )


# rounding modes: max 1024, T 100, linear, s = 0..5 -> (deepspeed_legacy, deepspeed, clamped)
TABLE = {
    (8, 8): ([8, 16, 24, 32, 48, 56],) * 3,
    (8, 16): ([0, 16, 16, 32, 48, 48], [16, 16, 16, 32, 48, 48], [8, 16, 16, 32, 48, 48]),
    (64, 16): ([64, 64, 80, 80, 96, 112],) * 3,
    (1, 8): ([0, 8, 16, 24, 40, 48], [8, 8, 16, 24, 40, 48], [1, 8, 16, 24, 40, 48]),
    (10, 8): ([8, 16, 24, 40, 48, 56], [16, 16, 24, 40, 48, 56], [10, 16, 24, 40, 48, 56]),
}


@pytest.mark.parametrize("lo,q", list(TABLE))
@pytest.mark.parametrize("col,rounding", list(enumerate(["deepspeed_legacy", "deepspeed", "clamped"])))
def test_rounding_table(lo, q, col, rounding):
    s = linear(lo, 1024, 100, q, rounding)
    assert [s(step) for step in range(6)] == TABLE[(lo, q)][col]


@pytest.mark.parametrize("rounding", ["deepspeed", "deepspeed_legacy", "clamped"])
def test_golden_vectors(rounding):
    assert [linear(2, 10, 8, 2, rounding)(s) for s in range(11)] == [2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 10]
    d = CurriculumSchedule("fixed_discrete", 1, 5, dict(difficulty=[1, 2, 3, 4, 5], max_step=[2, 4, 6, 8]), rounding)
    assert [d(s) for s in range(1, 11)] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    d = CurriculumSchedule("fixed_discrete", 1, 3, dict(difficulty=[1, 2, 3], max_step=[5, 10]), rounding)
    assert [d(s) for s in range(1, 14)] == [1] * 5 + [2] * 5 + [3] * 3
    voc = root(1, 100, 110000, 1, 2, rounding)
    assert {s: voc(s) for s in (1, 10, 100, 1000, 10000, 27500, 55000, 100000, 110000)} == {
        1: 1,
        10: 1,
        100: 3,
        1000: 10,
        10000: 30,
        27500: 50,
        55000: 71,
        100000: 95,
        110000: 100,
    }
    seq = linear(80, 2048, 110000, 8, rounding)
    assert {s: seq(s) for s in (0, 1, 100, 1000, 55000, 109999, 110000)} == {
        0: 80,
        1: 80,
        100: 80,
        1000: 96,
        55000: 1064,
        109999: 2040,
        110000: 2048,
    }
    bert = root(5, 100, 960000, 1, 2, rounding)
    assert {s: bert(s) for s in (1, 10000, 240000, 960000)} == {1: 5, 10000: 14, 240000: 52, 960000: 100}
    assert linear(128, 512, 960000, 8, rounding)(480000) == 320


def test_long_run_example():
    legacy, ds, clamped = (linear(8, 1024, 110000, 16, r) for r in ("deepspeed_legacy", "deepspeed", "clamped"))
    assert {legacy(s) for s in range(1, 867)} == {0} and legacy(867) == 16
    assert {ds(s) for s in range(1, 868)} == {16}
    assert {clamped(s) for s in range(1, 867)} == {8} and clamped(867) == 16
    assert clamped(110000) == 1024 and clamped(1) == 8 and clamped(866) == 8


def test_clamped_reaches_max_that_is_not_a_multiple_of_the_step():
    s = linear(8, 100, 50, 16)
    assert s(49) == 96 and s(50) == 100 and s(10**6) == 100
    ds = linear(8, 100, 50, 16, "deepspeed")  # DeepSpeed stays below max at T and only reaches it once the
    assert [ds(s) for s in (50, 51, 56, 57)] == [96, 96, 96, 100]  # ratio s/T > 1 has grown past the next multiple


@pytest.mark.parametrize(
    "lo,hi,q,total,k",
    [
        (lo, hi, q, total, k)
        for lo, hi, q, total, k in itertools.product(
            [1, 7, 8, 64], [64, 100, 1024], [1, 3, 8, 16], [1, 5, 100], [1, 2, 3]
        )
        if lo <= hi
    ],
)
def test_clamped_stays_in_bounds(lo, hi, q, total, k):
    s = root(lo, hi, total, q, k)
    values = [s(step) for step in range(0, 2 * total + 3)]
    assert all(lo <= v <= hi for v in values)
    assert s(total) == hi and s(total + 7) == hi
    assert values == sorted(values)  # monotone


def test_freeze_at_max_custom():
    seq = iter([1, 5, 10, 3])
    s = CurriculumSchedule("custom", 1, 10, {}, custom_fn=lambda step: next(seq))
    assert difficulties(s, range(1, 5)) == [1, 5, 10, 10]


def test_custom_may_decrease_before_max():
    values = {1: 4, 2: 2, 3: 6}
    s = CurriculumSchedule("custom", 1, 10, {}, custom_fn=values.__getitem__)
    assert difficulties(s, [1, 2, 3]) == [4, 2, 6]


@pytest.mark.parametrize(
    "cfg,match",
    [
        (dict(difficulty=[1, 2], max_step=[5, 6]), "len\\(difficulty\\) == len\\(max_step\\) \\+ 1"),
        (dict(difficulty=[1, 2, 3], max_step=[6, 5]), "strictly ascending"),
        (dict(difficulty=[1, 2, 3], max_step=[5, 5]), "strictly ascending"),
        (dict(difficulty=[], max_step=[]), "non-empty"),
        (dict(difficulty=[1, 20], max_step=[5]), "outside"),
        (dict(difficulty=[1, 2]), "missing key"),
        (dict(difficulty=[1, 2], max_step=[3], total_curriculum_step=3), "unknown key"),
    ],
)
def test_discrete_validation(cfg, match):
    with pytest.raises(ScheduleConfigError, match=match):
        CurriculumSchedule("fixed_discrete", 1, 10, cfg)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(schedule_type="fixed_cosine"), "schedule_type must be one of"),
        (dict(min_difficulty=20, max_difficulty=10), "min_difficulty \\(20\\) > max_difficulty \\(10\\)"),
        (dict(schedule_config=dict(total_curriculum_step=10)), "missing key\\(s\\) \\['difficulty_step'\\]"),
        (dict(schedule_config=dict(total_curriculum_step=10, difficulty_step=0)), "difficulty_step must be >= 1"),
        (
            dict(schedule_config=dict(total_curriculum_step=1.5, difficulty_step=8)),
            "total_curriculum_step must be an int",
        ),
        (dict(rounding="nearest"), "rounding must be one of"),
        (dict(schedule_type="custom", schedule_config={}), "needs a callable"),
        (dict(min_difficulty=1.0), "min_difficulty must be an int"),
    ],
)
def test_bad_schedules(kwargs, match):
    args = dict(
        schedule_type="fixed_linear",
        min_difficulty=8,
        max_difficulty=64,
        schedule_config=dict(total_curriculum_step=10, difficulty_step=8),
    )
    args.update(kwargs)
    with pytest.raises(ScheduleConfigError, match=match):
        CurriculumSchedule(**args)


def test_custom_out_of_range_or_float_raises():
    with pytest.raises(ScheduleConfigError, match="outside"):
        CurriculumSchedule("custom", 1, 10, {}, custom_fn=lambda s: 11)(1)
    with pytest.raises(ScheduleConfigError, match="must return an int"):
        CurriculumSchedule("custom", 1, 10, {}, custom_fn=lambda s: 2.5)(1)
