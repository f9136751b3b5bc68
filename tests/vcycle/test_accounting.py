"""The V-cycle's FLOPs accounting without a Trainer (``lightning_effi.vcycle.accounting.FlopsAccount``)."""

from __future__ import annotations

import pytest

from lightning_effi.vcycle.accounting import FlopsAccount


def test_counts_the_current_and_the_full_model():
    account = FlopsAccount()
    assert account.baseline_flops == 0.0 and account.saved_frac() == 0.0  # nothing counted yet
    for current, full in ((10.0, 10.0), (4.0, 10.0), (4, 10)):
        account.count(lambda c=current, f=full: (c, f))
    account.flops_steps = 3
    assert account.flops == 18.0 and account.full_model_flops == 30.0
    assert account.baseline_flops == 30.0 and account.saved_frac() == pytest.approx(1 - 18 / 30)
    assert account.state_dict() == {"flops": 18.0, "full_model_flops": 30.0, "flops_steps": 3}


def test_baseline_steps():
    account = FlopsAccount(baseline_steps=5)
    assert account.baseline_flops == 0.0 and account.saved_frac() == 0.0  # no step yet
    account.count(lambda: (4.0, 10.0))
    account.count(lambda: (4.0, 10.0))
    account.flops_steps = 2
    assert account.baseline_flops == pytest.approx(50.0)  # the full model's 10 per step x 5 steps
    assert account.saved_frac() == pytest.approx(1 - 8 / 50)
    longer = FlopsAccount(baseline_steps=1, flops=8.0, full_model_flops=20.0, flops_steps=2)
    assert longer.saved_frac() == pytest.approx(1 - 8 / 10) and FlopsAccount(1, 30.0, 20.0, 2).saved_frac() < 0


@pytest.mark.parametrize("error", [NotImplementedError, TypeError, KeyError])
def test_a_batch_that_cannot_be_counted_disables_the_accounting(error):
    account = FlopsAccount()
    account.count(lambda: (1.0, 2.0))

    def fails() -> tuple[float, float]:
        raise error("no count")

    with pytest.warns(UserWarning, match=rf"Owner: FLOPs accounting disabled \({error.__name__}"):
        account.count(fails, "Owner")
    account.count(lambda: (5.0, 5.0))  # disabled for the rest of the fit: nothing added, no second warning
    assert not account.enabled and account.flops == 1.0 and account.full_model_flops == 2.0


def test_other_errors_propagate():
    def fails() -> tuple[float, float]:
        raise ValueError("a bug in the module's count")

    with pytest.raises(ValueError, match="a bug"):
        FlopsAccount().count(fails)


def test_state_round_trip():
    account = FlopsAccount(baseline_steps=4)
    account.load_state_dict({"flops": 3, "full_model_flops": 6, "flops_steps": 2, "level": 1})
    assert (account.flops, account.full_model_flops, account.flops_steps) == (3.0, 6.0, 2)
    assert isinstance(account.flops, float) and account.baseline_steps == 4
    assert FlopsAccount(**{"baseline_steps": 4, **account.state_dict()}) == account
