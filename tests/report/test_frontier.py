"""The frontier's pure functions, against hand-computed values (Kaddour et al. 2023, Sec. 3)."""

import math

import pytest

from lightning_effi.report.frontier import (
    Reach,
    compute_to_reach,
    pareto_front,
    pareto_indices,
    saving,
    spread,
)


def test_pareto_front_min_keeps_a_monotone_set_sorted_by_compute():
    points = [(4.0, 2.0), (1.0, 3.0), (2.0, 2.5)]
    assert pareto_front(points, "min") == [(1.0, 3.0), (2.0, 2.5), (4.0, 2.0)]
    assert pareto_indices(points, "min") == [1, 2, 0]


def test_pareto_front_drops_a_dominated_budget_of_a_non_monotone_set():
    # budget 2 is worse than the cheaper budget 1: dominated; equal compute 3: the better one stays; a duplicate once
    points = [(1.0, 3.0), (2.0, 3.2), (4.0, 2.0), (3.0, 2.9), (3.0, 2.6), (4.0, 2.0)]
    assert pareto_front(points, "min") == [(1.0, 3.0), (3.0, 2.6), (4.0, 2.0)]


def test_pareto_front_max_mode():
    points = [(1.0, 0.5), (2.0, 0.7), (3.0, 0.65), (4.0, 0.8)]
    assert pareto_front(points, "max") == [(1.0, 0.5), (2.0, 0.7), (4.0, 0.8)]
    assert pareto_front(points, "min") == [(1.0, 0.5)]  # read as a loss, the cheapest point dominates all


@pytest.mark.parametrize(
    "points, message",
    [([(1.0, math.nan)], r"points\[0\]: compute and quality must be finite"), ([(1.0,)], r"points\[0\]")],
)
def test_pareto_front_refuses_bad_points(points, message):
    with pytest.raises(ValueError, match=message):
        pareto_front(points, "min")


def test_pareto_front_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="mode: expected 'min'"):
        pareto_front([(1.0, 2.0)], "lower")


FRONT = [(1.0, 3.0), (2.0, 2.5), (8.0, 2.0)]


@pytest.mark.parametrize(
    "quality, compute, flag",
    [
        (2.75, math.sqrt(2.0), "inside"),  # halfway between (1, 3.0) and (2, 2.5) in loss: sqrt(1 * 2)
        (2.25, 4.0, "inside"),  # halfway between (2, 2.5) and (8, 2.0): sqrt(2 * 8)
        (2.375, 2.0 ** (0.75) * 8.0 ** (0.25), "inside"),  # a quarter of the way from 2.5 to 2.0: 2^(3/4) 8^(1/4)
        (3.0, 1.0, "inside"),  # on a point: its compute exactly
        (2.5, 2.0, "inside"),
        (2.0, 8.0, "inside"),
        (1.9, 8.0, "beyond"),  # better than the largest budget: its compute, a lower bound on the saving
        (3.1, 1.0, "below"),  # worse than the smallest budget: its compute, an upper bound
    ],
)
def test_compute_to_reach_min(quality, compute, flag):
    reach = compute_to_reach(FRONT, quality, "min")
    assert reach.flag == flag and reach.quality == quality
    assert reach.compute == pytest.approx(compute, rel=1e-12)


def test_compute_to_reach_max_interpolates_in_log_compute():
    front = [(10.0, 0.5), (1000.0, 0.7)]
    assert compute_to_reach(front, 0.6, "max").compute == pytest.approx(100.0)  # 10^(1 + 0.5 * 2)
    assert compute_to_reach(front, 0.65, "max").compute == pytest.approx(10**2.5)  # 10^(1 + 0.75 * 2)
    assert compute_to_reach(front, 0.71, "max") == Reach(1000.0, "beyond", 0.71)
    assert compute_to_reach(front, 0.4, "max") == Reach(10.0, "below", 0.4)


def test_compute_to_reach_on_a_one_point_front():
    assert compute_to_reach([(5.0, 2.0)], 2.0, "min") == Reach(5.0, "inside", 2.0)
    assert compute_to_reach([(5.0, 2.0)], 1.0, "min").flag == "beyond"
    assert compute_to_reach([(5.0, 2.0)], 3.0, "min").flag == "below"


def test_reach_bound_says_how_to_read_the_saving():
    assert [Reach(1.0, f, 0.0).bound for f in ("inside", "beyond", "below")] == [
        "estimate",
        "lower bound",
        "upper bound",
    ]


@pytest.mark.parametrize(
    "front, message",
    [
        ([], "frontier: empty"),
        ([(2.0, 2.5), (1.0, 3.0)], r"not a Pareto front"),  # unsorted
        ([(1.0, 3.0), (2.0, 3.2)], r"not a Pareto front"),  # dominated point left in
        ([(0.0, 3.0), (2.0, 2.5)], r"frontier\[0\]: compute must be > 0"),
    ],
)
def test_compute_to_reach_refuses_what_is_not_a_front(front, message):
    with pytest.raises(ValueError, match=message):
        compute_to_reach(front, 2.7, "min")


def test_compute_to_reach_refuses_a_non_finite_quality():
    with pytest.raises(ValueError, match="quality: must be finite"):
        compute_to_reach(FRONT, math.nan, "min")


def test_saving_fraction_and_factor():
    s = saving(75.0, 100.0)
    assert s.fraction == pytest.approx(0.25) and s.factor == pytest.approx(4 / 3)
    s = saving(150.0, 100.0)  # the arm spends more: a negative saving
    assert s.fraction == pytest.approx(-0.5) and s.factor == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="arm_compute: must be finite and > 0"):
        saving(0.0, 100.0)
    with pytest.raises(ValueError, match="frontier_compute"):
        saving(1.0, math.inf)


def test_spread_is_the_sample_std():
    s = spread([1.0, 2.0, 3.0, 4.0])
    assert s.mean == pytest.approx(2.5) and s.n == 4
    assert s.std == pytest.approx(math.sqrt(5 / 3))  # sum of squares 5 over n - 1 = 3
    one = spread([2.0, math.nan])
    assert one.mean == 2.0 and math.isnan(one.std) and one.n == 1
    assert spread([]).n == 0 and math.isnan(spread([]).mean)
