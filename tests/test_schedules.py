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


def _stepped(scheduler_factory, steps):
    """The LR multiplier torch's scheduler gives after ``steps`` steps (stepped for real)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = scheduler_factory(opt)
    for _ in range(steps):
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"] / 2.0, sched


@pytest.mark.parametrize(
    "factory",
    [
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, 20) / 20))),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20, eta_min=0.2),
        lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=20),
        lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=20, power=2.0),
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=5),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=15, eta_min=0.0),
            ],
            milestones=[5],
        ),
        lambda o: torch.optim.lr_scheduler.ChainedScheduler(
            [
                torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=5),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20, eta_min=0.0),
            ]
        ),
        lambda o: torch.optim.lr_scheduler.ChainedScheduler(
            [
                torch.optim.lr_scheduler.PolynomialLR(o, total_iters=20, power=1.0),
                torch.optim.lr_scheduler.LinearLR(o, start_factor=1.0, end_factor=0.5, total_iters=10),
            ]
        ),
    ],
    ids=[
        "lambda",
        "cosine",
        "linear",
        "polynomial",
        "warmup_then_cosine",
        "chained_warmup_cosine",
        "chained_polynomial_linear",
    ],
)
def test_multipliers_between_match_the_stepped_scheduler_and_see_an_unfinished_schedule(factory):
    """Read without stepping, the multipliers at steps 14 and 20 equal those torch gives when stepped there; a
    schedule of 20 steps (a warmup of 5 then a cosine of 15 too) still changes between 14 and 20, and no longer
    between 20 and 30."""
    from lightning_effi.core.lr_schedules import multipliers_between

    at_14, sched = _stepped(factory, 14)
    at_20, _ = _stepped(factory, 20)
    a, b = multipliers_between(sched, 14, 20)
    assert a == pytest.approx(at_14, rel=1e-6) and b == pytest.approx(at_20, rel=1e-6, abs=1e-9) and a != b
    assert multipliers_between(sched, 20, 30) is None


def test_multipliers_between_is_none_for_schedules_without_a_length_to_read():
    """A schedule on a technique's progress ignores the step (one value at both steps); StepLR has no end to read;
    a lambda that raises is not read; start >= end is a programming error."""
    from lightning_effi.core.lr_schedules import multipliers_between, progress_lambda

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    assert multipliers_between(progress_lambda(opt, lambda p: 1.0 - p, lambda: 0.3), 10, 20) is None
    assert multipliers_between(torch.optim.lr_scheduler.StepLR(opt, step_size=5), 10, 20) is None
    assert multipliers_between(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s - 10)), 10, 20) is None
    # a chain with a member that is not read, or one that does not scale by ratios (a LambdaLR resets the LR at every
    # step, a cosine's floor adds) is not read either
    lin = lambda: torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=20)  # noqa: E731
    for other in (
        torch.optim.lr_scheduler.StepLR(opt, step_size=5),
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20, eta_min=0.1),
    ):
        assert multipliers_between(torch.optim.lr_scheduler.ChainedScheduler([lin(), other]), 10, 20) is None
    with pytest.raises(ValueError, match="expected 0 <= start < end, got start=5, end=5"):
        multipliers_between(torch.optim.lr_scheduler.StepLR(opt, step_size=5), 5, 5)


def test_total_steps_is_needed_only_without_a_progress_source():
    """On a progress source (InfoBatch's ``effi_progress``) ``total_steps`` is not read: it may be left out; without
    one it must be an int (a bool is refused)."""
    from lightning_effi.core.lr_schedules import one_cycle

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    on_progress = warmup_cosine(opt, progress=lambda: 1.0, warmup_fraction=0.0, min_lr_ratio=0.0)
    assert on_progress.lr_lambdas[0](0) == pytest.approx(0.0)  # progress 1: the cosine's end
    assert one_cycle(opt, progress=lambda: 0.0).lr_lambdas[0](0) == pytest.approx(1 / 25)
    with pytest.raises(ValueError, match=r"total_steps must be a positive int \(or pass progress=\.\.\.\), got None"):
        warmup_cosine(opt)
    with pytest.raises(ValueError, match=r"total_steps must be an int >= 2 \(or pass progress=\.\.\.\), got True"):
        one_cycle(opt, True)


def test_a_progress_schedule_reads_its_first_lr_again():
    """``refresh`` sets the LR at the progress read now (InfoBatch's first epoch is planned after the scheduler is
    built, at progress 0: a warmup's first step ran at LR 0, qa76-break 05); a parameter group added after the
    scheduler was built keeps its LR."""
    from lightning_effi.core.lr_schedules import ProgressLambdaLR, refresh_progress_schedules, warmup_cosine

    progress = [0.0]
    weight = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([weight], lr=1.0)
    sched = warmup_cosine(opt, warmup_fraction=0.2, min_lr_ratio=0.0, progress=lambda: progress[0])
    assert isinstance(sched, ProgressLambdaLR) and opt.param_groups[0]["lr"] == 0.0
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.5})
    progress[0] = 0.05
    assert refresh_progress_schedules([sched]) == []
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25) and opt.param_groups[1]["lr"] == 0.5
    assert sched.get_last_lr() == [pytest.approx(0.25), 0.5] and sched.last_epoch == 0
