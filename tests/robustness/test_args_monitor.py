"""``EfficiencyMonitor`` arguments (numpy numbers accepted, strings refused) and its checkpoint state (a damaged
total refused by ``load_state_dict``, naming the key, with the monitor left as it was) (issue #21)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_effi.core.accounting import EfficiencyMonitor


def test_numpy_ints_and_bools_are_accepted_as_plain_values():
    m = EfficiencyMonitor(log_every_n_steps=np.int64(5), print_summary=np.False_)
    assert m.log_every_n_steps == 5 and type(m.log_every_n_steps) is int
    assert m.print_summary is False
    assert EfficiencyMonitor().log_every_n_steps is None
    assert EfficiencyMonitor(interpolate_flops=np.False_)._meter.interpolate is False
    assert EfficiencyMonitor()._meter.interpolate is True


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"log_every_n_steps": "5"}, r"EfficiencyMonitor\.log_every_n_steps must be an int >= 1, got '5'"),
        ({"log_every_n_steps": 0}, r"EfficiencyMonitor\.log_every_n_steps must be an int >= 1, got 0"),
        ({"log_every_n_steps": True}, r"got True"),
        ({"print_summary": "false"}, r"EfficiencyMonitor\.print_summary must be a bool .*got 'false'"),
        ({"print_summary": 1}, r"EfficiencyMonitor\.print_summary must be a bool"),
        ({"interpolate_flops": "no"}, r"EfficiencyMonitor\.interpolate_flops must be a bool .*got 'no'"),
    ],
)
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        EfficiencyMonitor(**kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"log_every_n_steps": 0}, r"EfficiencyMonitor\.log_every_n_steps must be an int >= 1, got 0"),
        ({"print_summary": "false"}, r"EfficiencyMonitor\.print_summary must be a bool .*got 'false'"),
        ({"interpolate_flops": "no"}, r"EfficiencyMonitor\.interpolate_flops must be a bool .*got 'no'"),
        ({"nonfinite_loss": "skip"}, r"EfficiencyMonitor\.nonfinite_loss must be one of"),
    ],
)
def test_a_bad_setting_set_after_building_is_refused_where_it_is_set(kw, match):
    """A setting set on a built monitor (a notebook cell) is checked as the constructor checks it; it was taken
    without a word (``log_every_n_steps=0``) or ignored (``nonfinite_loss``, ``interpolate_flops``)."""
    monitor = EfficiencyMonitor()
    ((name, value),) = kw.items()
    before = getattr(monitor, name)
    with pytest.raises(ValueError, match=match):
        setattr(monitor, name, value)
    assert getattr(monitor, name) == before


def test_a_setting_set_after_building_is_the_one_the_monitor_runs_with():
    monitor = EfficiencyMonitor()
    monitor.nonfinite_loss = "warn"  # the policy its guard applies
    assert monitor.nonfinite_guard.policy == "warn" and "nonfinite_loss='warn'" in repr(monitor)
    meter = monitor._meter
    monitor.interpolate_flops = np.False_
    assert monitor._meter.interpolate is False and monitor._meter is not meter  # no interpolated length cached
    monitor.log_every_n_steps = np.int64(3)
    assert monitor.log_every_n_steps == 3 and type(monitor.log_every_n_steps) is int
    assert repr(monitor) == repr(EfficiencyMonitor(log_every_n_steps=3, nonfinite_loss="warn", interpolate_flops=False))


def _state(**totals: float) -> dict:
    counts = ("samples", "tokens", "layer_tokens", "flops", "batches")
    base = {k: 10.0 for k in (*counts, "time_train", "time_data", "time_eval", "time_total")}
    return {"totals": {**base, **totals}, "curve": [], "schedule": []}


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("flops", math.nan, "a finite number >= 0"),
        ("samples", -10.0, "a finite number >= 0"),
        ("time_train", math.inf, "a finite number >= 0"),
        ("baseline_tokens", "1e3", "a finite number >= 0"),
        ("saved/random_ltd/flops", math.nan, "a finite number"),
    ],
)
def test_a_damaged_checkpoint_total_is_refused_and_nothing_is_loaded(key, value, allowed):
    monitor = EfficiencyMonitor()
    before = dict(monitor.totals)
    with pytest.raises(
        ValueError, match=rf"load_state_dict: the checkpoint's totals\.{key} is .*; it must be {allowed}"
    ):
        monitor.load_state_dict(_state(**{key: value}))
    assert monitor.totals == before


def test_a_negative_saving_is_a_valid_total():
    monitor = EfficiencyMonitor()
    monitor.load_state_dict(_state(**{"saved/grower/tokens": -4.0}))  # a technique that raised the token count
    assert monitor.totals["saved/grower/tokens"] == -4.0 and monitor.totals["flops"] == 10.0
