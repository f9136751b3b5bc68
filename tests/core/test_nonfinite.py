"""The shared non-finite loss policy (``lightning_effi.core.nonfinite``): one check per backward pass, by the first
guarded technique, with the strictest policy; counts checkpointed; bad policies and bad loaded state refused."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from lightning_effi.core.nonfinite import (
    NonFiniteLossError,
    NonFiniteLossGuard,
    is_finite_loss,
    nonfinite_count,
    nonfinite_metrics,
)
from tests.helpers.harness import MetricsCapture


class Technique:
    def __init__(self, name: str, policy: str = "raise") -> None:
        self.nonfinite_guard = NonFiniteLossGuard(name, policy)


def trainer_of(*callbacks, step=3, loggers=()):
    return SimpleNamespace(callbacks=[object(), *callbacks], global_step=step, global_rank=0, loggers=list(loggers))


def test_is_finite_loss():
    assert is_finite_loss(torch.tensor(1.5)) and is_finite_loss(None) and is_finite_loss(2.0)
    assert not is_finite_loss(torch.tensor(float("nan")))
    assert not is_finite_loss(torch.tensor([1.0, math.inf]))
    assert not is_finite_loss(float("-inf"))


def test_raise_stops_at_the_first_nonfinite_loss_naming_step_batch_and_techniques():
    a, b = Technique("InfoBatchCallback"), Technique("VCycleCallback")
    trainer = trainer_of(a, b, step=7)
    a.nonfinite_guard.check(trainer, torch.tensor(2.0), batch_idx=1)  # finite: nothing
    with pytest.raises(
        NonFiniteLossError, match=r"InfoBatchCallback, VCycleCallback: the training loss is nan at step 7, batch 4"
    ):
        a.nonfinite_guard.check(trainer, torch.tensor(float("nan")), batch_idx=4)
    b.nonfinite_guard.check(trainer, torch.tensor(float("nan")))  # not the first technique: no second check


def test_warn_counts_and_warns_once():
    a = Technique("RandomLTDCallback", "warn")
    trainer = trainer_of(a, step=2)
    with pytest.warns(
        UserWarning, match=r"RandomLTDCallback: the training loss is inf at step 2.*nonfinite_loss='warn'"
    ):
        a.nonfinite_guard.check(trainer, torch.tensor(float("inf")))
    trainer.global_step = 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        a.nonfinite_guard.check(trainer, torch.tensor(float("nan")))
        a.nonfinite_guard.check(trainer, torch.tensor(1.0))
    assert (a.nonfinite_guard.count, a.nonfinite_guard.first_step) == (2, 2)
    assert a.nonfinite_guard.report() == "RandomLTDCallback: 2 non-finite training losses (the first at step 2)"
    fresh = NonFiniteLossGuard("RandomLTDCallback", "warn")
    fresh.load_state_dict(a.nonfinite_guard.state_dict())
    assert (fresh.count, fresh.first_step) == (2, 2)


def test_the_strictest_policy_of_a_stack_applies():
    a, b = Technique("Curriculum", "warn"), Technique("VCycleCallback", "raise")
    with pytest.raises(NonFiniteLossError, match="Curriculum, VCycleCallback"):
        a.nonfinite_guard.check(trainer_of(a, b), torch.tensor(float("nan")))


def test_only_the_checking_guard_logs_the_run_count_and_only_under_warn():
    a, b = Technique("Curriculum", "warn"), Technique("VCycleCallback", "warn")
    capture = MetricsCapture()
    trainer = trainer_of(a, b, step=4, loggers=[capture])
    a.nonfinite_guard.count, b.nonfinite_guard.count = 2, 1  # e.g. b counted before it was moved behind a
    assert nonfinite_count(trainer.callbacks) == 3
    b.nonfinite_guard.log_count(trainer)  # not the checking guard: writes nothing
    assert capture.logged == []
    a.nonfinite_guard.log_count(trainer)
    assert capture.logged == [(4, {"effi/nonfinite_losses": 3.0})]
    raising = Technique("RandomLTDCallback", "raise")
    strict = trainer_of(a, raising, loggers=[capture])
    a.nonfinite_guard.log_count(strict)  # a "raise" in the stack: the first non-finite loss stops, nothing to count
    assert len(capture.logged) == 1
    trainer.global_rank = 1
    a.nonfinite_guard.log_count(trainer)  # rank zero only
    assert len(capture.logged) == 1


def test_every_writer_of_the_count_logs_the_same_metric_and_nothing_when_one_asks_raise():
    a, b = Technique("InfoBatchCallback", "warn"), Technique("EfficiencyMonitor", "warn")
    a.nonfinite_guard.count = 2
    assert nonfinite_metrics([object(), a, b]) == {"effi/nonfinite_losses": 2.0}
    assert nonfinite_metrics([a, b, Technique("VCycleCallback", "raise")]) == {}
    assert nonfinite_metrics([object()]) == {}  # no guarded callback


@pytest.mark.parametrize("policy", ["skip", "Raise", None, True])
def test_a_bad_policy_is_refused(policy):
    with pytest.raises(ValueError, match=r"VCycleCallback.nonfinite_loss must be one of \('raise', 'warn'\)"):
        NonFiniteLossGuard("VCycleCallback", policy)


@pytest.mark.parametrize(
    "state", [{"count": -1, "first_step": None}, {"count": 1.5, "first_step": 0}, {"count": 1, "first_step": -2}]
)
def test_bad_loaded_state_is_refused(state):
    with pytest.raises(ValueError, match="checkpoint nonfinite"):
        NonFiniteLossGuard("X").load_state_dict(state)
