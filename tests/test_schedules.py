import math

import pytest
import torch

from lightning_effi.core.lr_schedules import warmup_cosine, warmup_cosine_multiplier


def test_multiplier_golden_values():
    assert warmup_cosine_multiplier(0.0, 0.1, 0.0) == 0.0
    assert warmup_cosine_multiplier(0.05, 0.1, 0.0) == pytest.approx(0.5)
    assert warmup_cosine_multiplier(0.1, 0.1, 0.0) == pytest.approx(1.0)
    assert warmup_cosine_multiplier(0.55, 0.1, 0.0) == pytest.approx(0.5)
    assert warmup_cosine_multiplier(1.0, 0.1, 0.2) == pytest.approx(0.2)
    assert warmup_cosine_multiplier(7.0, 0.1, 0.2) == pytest.approx(0.2)  # clamped, never overruns


@pytest.mark.parametrize("total", [1, 2, 3, 10, 101])
def test_lambda_lr_ends_at_min_and_never_errors(total):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = warmup_cosine(opt, total_steps=total, warmup_fraction=0.1, min_lr_ratio=0.1)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[-1] == pytest.approx(0.1) and all(0 < lr <= 1.0 + 1e-12 for lr in lrs)
    assert not any(math.isnan(x) for x in lrs)


@pytest.mark.parametrize(
    "kwargs", [dict(total_steps=0), dict(total_steps=5, warmup_fraction=1.0), dict(total_steps=5, min_lr_ratio=-0.1)]
)
def test_bad_arguments_raise(kwargs):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError):
        warmup_cosine(opt, **kwargs)
