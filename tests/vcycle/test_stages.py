"""The V-cycle's stage arithmetic without a Trainer: arguments, Duration lengths resolved into optimizer steps, the
fit check, the FLOPs fraction and the learning rate at a level change (``lightning_effi.vcycle.stages``)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from lightning_effi.core.flops import transformer_training_flops
from lightning_effi.core.progress import PROGRESS_TICKS, Duration, progress_ticks, run_length, steps_per_epoch
from lightning_effi.vcycle import stages as S
from lightning_effi.vcycle.stages import stage_plan, vcycle_flops_fraction


def resolve(total, levels=2, e_a=2, e_small=3, up_leg=None, batches=None, accumulate=1, **deprecated):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        args = S.check_arguments(levels=levels, e_a=e_a, e_small=e_small, up_leg=up_leg, deprecated=deprecated)
    return S.resolve_stages(args.levels, args.e_a, args.e_small, args.up_leg, total, batches, accumulate)


def test_stage_plan_ends_and_flops_fraction():
    assert stage_plan(2, 5, 50) == [(1, 5), (2, 50)]
    assert stage_plan(3, 2, 4, [3]) == [(1, 2), (2, 2), (3, 4), (2, 3)]
    assert stage_plan(4, 1, 5, [2, 3]) == [(1, 1), (2, 1), (3, 1), (4, 5), (3, 3), (2, 2)]
    assert S.stage_ends([(1, 2), (2, 2), (3, 4), (2, 3)]) == [2, 4, 8, 11]
    # official GPT-2 example: 12 layers x 768 -> 6 x 384, T 512, V 50257; 55K large + 50K small steps vs 100K
    big = transformer_training_flops(1, 512, 12, 768, None, 50257)
    small = transformer_training_flops(1, 512, 6, 384, None, 50257)
    assert vcycle_flops_fraction([(55_000, big), (50_000, small)], 100_000, big) == pytest.approx(0.671, abs=0.002)
    assert vcycle_flops_fraction([(4, 10.0), (3, 2.5)], 7, 10.0) == pytest.approx(47.5 / 70)
    with pytest.raises(ValueError, match="must be > 0"):
        vcycle_flops_fraction([(1, 1.0)], 0, 1.0)


@pytest.mark.parametrize(
    "kwargs, total, stages",
    [
        (dict(e_a=2, e_small=3), 7, [(1, 2), (2, 3)]),  # int = optimizer steps
        (dict(e_a="2st", e_small="3ba"), None, [(1, 2), (2, 3)]),  # steps, run length unknown
        (dict(e_a="1ep", e_small="2ep", batches=5), 20, [(1, 5), (2, 10)]),  # epochs: n * steps per epoch
        (dict(e_a="1ep", e_small="1ep", batches=5, accumulate=2), 9, [(1, 3), (2, 3)]),  # ceil(5 / 2) = 3 per epoch
        (dict(e_a="0.3dur", e_small=3), 7, [(1, 2), (2, 3)]),  # floor(0.3 * 7) = 2
        (dict(e_a="0.3dur", e_small=3), 10, [(1, 3), (2, 3)]),
        (dict(e_a="0.05dur", e_small="0.5dur"), 1, [(1, 1), (2, 0)]),  # e_a at least 1, e_small may be 0
        (dict(e_a="0.2dur", e_small="0.5dur"), 10, [(1, 2), (2, 5)]),
        (dict(e_a=Duration(2), e_small=Duration(0.5, "fraction")), 10, [(1, 2), (2, 5)]),
        (dict(levels=3, e_a=2, e_small=2, up_leg=2), 9, [(1, 2), (2, 2), (3, 2), (2, 2)]),
        (dict(levels=3, e_a="1ep", e_small="1ep", up_leg=["2ep"], batches=2), 12, [(1, 2), (2, 2), (3, 2), (2, 4)]),
        (dict(levels=4, e_a=1, e_small=2, up_leg=[3, "0.1dur"]), 20, [(1, 1), (2, 1), (3, 1), (4, 2), (3, 2), (2, 3)]),
        (dict(levels=3, e_a=1, e_small=1, up_leg="0.25dur"), 8, [(1, 1), (2, 1), (3, 1), (2, 2)]),
    ],
)
def test_lengths_resolve_to_steps(kwargs, total, stages):
    assert resolve(total, **kwargs) == stages


@pytest.mark.parametrize(
    "old, new",
    [
        (dict(e_a_steps=2, e_small_steps=3), dict(e_a=2, e_small=3)),
        (dict(e_a_fraction=0.3, e_small_fraction=0.5), dict(e_a="0.3dur", e_small="0.5dur")),
        (dict(e_a_epochs=1, e_small_epochs=2), dict(e_a="1ep", e_small="2ep")),
        (dict(levels=3, e_a_steps=1, e_small_steps=1, up_leg_steps=[2]), dict(levels=3, e_a=1, e_small=1, up_leg=[2])),
        (
            dict(levels=3, e_a_steps=1, e_small_steps=1, up_leg_fraction=0.2),
            dict(levels=3, e_a=1, e_small=1, up_leg="0.2dur"),
        ),
        (
            dict(levels=4, e_a_epochs=1, e_small_epochs=1, up_leg_epochs=2),
            dict(levels=4, e_a="1ep", e_small="1ep", up_leg="2ep"),
        ),
    ],
)
def test_deprecated_spellings_map_to_the_same_duration(old, new):
    with pytest.warns(DeprecationWarning) as record:
        a = S.check_arguments(deprecated={k: v for k, v in old.items() if k != "levels"}, levels=old.get("levels", 2))
    assert len(record) == len(old) - ("levels" in old)
    assert all("is deprecated" in str(w.message) and "use " in str(w.message) for w in record)
    b = S.check_arguments(**new)
    assert (a.e_a, a.e_small, a.up_leg) == (b.e_a, b.e_small, b.up_leg)
    for total in (53, 100, 1000):
        assert S.resolve_stages(a.levels, a.e_a, a.e_small, a.up_leg, total, 5, 1) == S.resolve_stages(
            b.levels, b.e_a, b.e_small, b.up_leg, total, 5, 1
        )


def test_deprecation_message_names_the_replacement():
    with pytest.warns(DeprecationWarning, match=r"e_a_fraction is deprecated.*use e_a='0.05dur'"):
        S.check_arguments(e_small=1, deprecated=dict(e_a_fraction=0.05))
    with pytest.warns(DeprecationWarning, match=r"up_leg_epochs is deprecated.*use up_leg=\['1ep', '2ep'\]"):
        S.check_arguments(levels=4, e_a=1, e_small=1, deprecated=dict(up_leg_epochs=[1, 2]))
    with pytest.warns(DeprecationWarning, match=r"e_small_steps is deprecated.*use e_small=3"):
        S.check_arguments(e_a=1, deprecated=dict(e_small_steps=3))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(e_a=0.3, e_small=1), r"VCycleCallback\.e_a must be an int .*got 0\.3"),  # a float is ambiguous
        (dict(e_a=1, e_small=2.0), r"VCycleCallback\.e_small must be an int .*got 2\.0"),
        (dict(levels=3, e_a=1, e_small=1, up_leg=[0.5]), r"VCycleCallback\.up_leg\[0\] must be an int"),
        (dict(e_a=True, e_small=1), r"VCycleCallback\.e_a must be an int"),
        (dict(e_a="2 epochs", e_small=1), r"VCycleCallback\.e_a: cannot read '2 epochs'"),
        (dict(e_a="1.5ep", e_small=1), r"VCycleCallback\.e_a: epochs must be whole"),
        (dict(e_a="1.5dur", e_small=1), r"VCycleCallback\.e_a: .*\[0, 1\]"),
        (dict(e_a=0, e_small=1), r"VCycleCallback\.e_a must be at least 1 step"),
        # a negative length names the same bound (the message offered 0, refused in turn)
        (dict(e_a=-3, e_small=1), r"VCycleCallback\.e_a must be at least 1 step, got -3"),
        (dict(e_a=1, e_small=-2), r"VCycleCallback\.e_small must be at least 1 step, got -2"),
        (dict(levels=3, e_a=1, e_small=1, up_leg=-1), r"VCycleCallback\.up_leg must be at least 1 step, got -1"),
        (dict(e_a="0ep", e_small=1), r"VCycleCallback\.e_a must be at least 1 epoch"),
        # '0dur' trained 1 step and was recorded as 0 (qa58-args 03)
        (dict(e_a="0dur", e_small=1), r"VCycleCallback\.e_a must be more than 0 of the run .*got '0dur'"),
        # refused at setup only (qa60-break 05)
        (dict(e_a=1, e_small="0dur"), r"VCycleCallback\.e_small must be more than 0 of the run .*got '0dur'"),
        (
            dict(levels=3, e_a=1, e_small=1, up_leg="0.0dur"),
            r"VCycleCallback\.up_leg must be more than 0 of the run \(its level would never train\)",
        ),
        (dict(e_a="1e6tok", e_small=1), r"VCycleCallback\.e_a: a stage length in tokens is not supported"),
        (dict(e_small=1), r"VCycleCallback: e_a is required"),
        (dict(e_a=1), r"VCycleCallback: e_small is required"),
        (dict(levels=3, e_a=1, e_small=1), r"levels=3 requires up_leg"),
        (dict(levels=3, e_a=1, e_small=1, up_leg=[1, 2]), r"up_leg must be one duration or a list of 1"),
        (dict(e_a=1, e_small=1, up_leg=1), r"levels >= 3 only"),
        (dict(e_a=1, e_small=1, deprecated=dict(e_a_steps=1)), r"give one of e_a, .* not e_a and e_a_steps"),
        (dict(e_a=1, e_small="1ep", deprecated=dict(e_small_fraction=0.5)), r"not e_small and e_small_fraction"),
        (dict(levels=3, e_a=1, e_small=1, up_leg=1, deprecated=dict(up_leg_epochs=1)), r"not up_leg and up_leg_epochs"),
        (dict(e_small=1, deprecated=dict(e_a_fraction=0.1, e_a_epochs=1)), r"not e_a_fraction and e_a_epochs"),
        (dict(e_a=1, e_small=1, strict="false"), r"strict must be a bool"),
        (dict(e_a=1, e_small=1, lr_schedule="cosine"), r"lr_schedule must be one of"),
        (dict(e_a=1, e_small=1, lr_multiplier={"x": 2.0}), r"keys must be levels"),
        (dict(e_a=1, e_small=1, lr_multiplier=[4.0]), r"lr_multiplier must be a mapping \{level: factor\}"),
        (dict(e_a=1, e_small=1, lr_multiplier=[(2, 4.0)]), r"lr_multiplier must be a mapping .*got \[\(2, 4\.0\)\]"),
        (dict(e_a=1, e_small=1, lr_multiplier=4.0), r"lr_multiplier must be a mapping"),
    ],
)
def test_bad_lengths_and_arguments(kwargs, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match=match):
            S.check_arguments(**kwargs)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="e_a_step"):
        S.check_arguments(e_a=1, e_small=1, deprecated=dict(e_a_step=1))
    for value in (None, 0, "2ep"):  # whatever its value, None included (a misspelling is never dropped)
        with pytest.raises(TypeError, match=r"unexpected keyword arguments \['e_a_stepz'\]"):
            S.check_arguments(e_a=1, e_small=1, deprecated=dict(e_a_stepz=value))
    S.check_arguments(e_a=1, e_small=1, deprecated=dict(e_a_steps=None))  # a deprecated name given None: not given


def test_arguments_are_normalised():
    a = S.check_arguments(
        levels=4,
        e_a="5st",
        e_small=Duration(2, "epoch"),
        up_leg=("0.1dur", 4),
        lr_multiplier={"2": 4, 3: 2.5},
        alpha_original=1,
        baseline_steps=100,
        width_scheme=((0, 1), (2, 3)),
    )
    assert a.e_a == Duration(5, "step") and a.e_small == Duration(2, "epoch")
    assert a.up_leg == (Duration(0.1, "fraction"), Duration(4, "step"))
    assert a.lr_multiplier == {2: 4.0, 3: 2.5} and a.alpha_original == 1.0 and a.baseline_steps == 100
    assert a.width_scheme == [[0, 1], [2, 3]]
    assert S.up_leg_lengths(4, a.up_leg) == [Duration(0.1, "fraction"), Duration(4, "step")]
    assert S.up_leg_lengths(4, Duration(3)) == [Duration(3), Duration(3)] and S.up_leg_lengths(2, None) == []


def test_run_length_and_steps_per_epoch():
    """The V-cycle reads the run's length and an epoch's steps from ``core.progress`` (one reading for every
    technique)."""
    assert S.run_length is run_length and S.steps_per_epoch is steps_per_epoch
    assert run_length(10) == 10 and run_length(10, 99.0) == 10 and run_length(10, 10.0) == 10
    assert run_length(-1) is None and run_length(-1, 42.0) == 42 and run_length(-1, float("inf")) is None
    # epochs or limit_train_batches end the run before max_steps: the estimated length is the run's
    assert run_length(100, 3.0) == 3 and run_length(1000, 5) == 5 and run_length(10, float("inf")) == 10
    assert run_length(None, -1) is None and run_length(7, -1) == 7  # an iterable dataset: -1 is unknown
    assert steps_per_epoch(5, 1) == 5 and steps_per_epoch(5, 2) == 3 and steps_per_epoch(4, 4) == 1
    with pytest.raises(ValueError, match="in epochs .*needs a train dataloader with a length"):
        S.resolve_stages(2, Duration(1, "epoch"), Duration(1), None, 10, float("inf"))


def test_stages_in_epochs_span_the_epochs_of_their_factors():
    """A GradientAccumulationScheduler's factor per epoch: each stage in epochs counts the steps of the epochs it
    spans (5 batches, factors 1, 2, 2, then 4: epochs of 5, 3, 3, 2, 2 steps); a stage in steps moves the next
    one's start inside an epoch, which keeps its fraction of the epoch. One factor for every epoch gives the plan of
    an int (qa60-break 02)."""

    def at(epoch):
        return [1, 2, 2][epoch] if epoch < 3 else 4

    assert resolve(20, e_a="1ep", e_small="1ep", batches=5, accumulate=at) == [(1, 5), (2, 3)]
    three = dict(levels=3, e_a="1ep", e_small="1ep", up_leg=["2ep"], batches=5)
    assert resolve(20, **three, accumulate=at) == [(1, 5), (2, 3), (3, 3), (2, 4)]
    # 4 steps, then one epoch from inside epoch 0 (4/5 of it): to 4/5 into epoch 1 (5 + 2.4 steps)
    assert resolve(20, e_a=4, e_small="1ep", batches=5, accumulate=at) == [(1, 4), (2, 3)]
    assert resolve(20, **three, accumulate=lambda e: 2) == resolve(20, **three, accumulate=2)
    with pytest.raises(ValueError, match=r"need 15 optimizer steps \(stages of \[5, 3, 3, 4\] steps, each epoch"):
        resolve(14, **three, accumulate=at)


@pytest.mark.parametrize(
    "kwargs, total, match",
    [
        (
            dict(e_a=2, e_small=3),
            4,
            r"need 5 optimizer steps \(e_a × \(levels − 1\) = 2 × 1, e_small = 3\) but the run "
            r"has 4 .*max_steps",
        ),
        (dict(e_a=4, e_small=7), 10, r"need 11 optimizer steps .* run has 10"),
        (
            dict(e_a="1ep", e_small="2ep", batches=5),
            10,
            r"need 15 optimizer steps .*; 5 optimizer steps per epoch\) but "
            "the run has 10",
        ),
        (dict(levels=3, e_a=2, e_small=2, up_leg=[3]), 8, r"need 9 optimizer steps .*up_leg = \[3\]"),
        (dict(e_a="0.1dur", e_small="0.5dur"), None, r"run's length is unknown.*_fraction"),
        (dict(e_a="1ep", e_small=2), 10, r"in epochs .*needs a train dataloader with a length"),
    ],
)
def test_stages_that_cannot_resolve_or_fit(kwargs, total, match):
    with pytest.raises(ValueError, match=match):
        resolve(total, **kwargs)


def test_learning_rate_at_a_level_change():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))
    plateau = SimpleNamespace(scheduler=None, reduce_on_plateau=True, interval="step", frequency=1)
    cfg = SimpleNamespace(scheduler=sched, reduce_on_plateau=False, interval="step", frequency=2)
    S.scale_learning_rates([opt], [cfg], 4.0)
    assert opt.param_groups[0]["initial_lr"] == pytest.approx(0.4) and sched.base_lrs == [pytest.approx(0.4)]
    S.advance_schedulers([plateau, cfg], global_step=6, current_epoch=0)  # 6 // 2 = 3 scheduler steps
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.4 / 4)
    S.scale_learning_rates([opt], [cfg], 1.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_fit_stages_reads_the_trainer_when_it_can():
    """In ``setup`` only ``max_steps`` is read (None when a length is in epochs or the run's length is unknown); at
    train start the estimated length and the batches per epoch resolve the rest."""

    class Trainer(SimpleNamespace):
        @property
        def estimated_stepping_batches(self) -> float:
            self.read = True
            return 20.0

    steps, epochs, fraction = Duration(2, "step"), Duration(1, "epoch"), Duration(0.25, "fraction")
    t = Trainer(max_steps=10, num_training_batches=6, accumulate_grad_batches=2, read=False)
    assert S.fit_stages(t, 2, steps, Duration(3, "step"), None, at_setup=True) == [(1, 2), (2, 3)] and not t.read
    assert S.fit_stages(t, 2, epochs, steps, None, at_setup=True) is None
    assert S.fit_stages(t, 2, epochs, steps, None, at_setup=False) == [(1, 3), (2, 2)]  # 6 batches / 2 per step
    t = Trainer(max_steps=-1, num_training_batches=6, accumulate_grad_batches=1, read=False)
    assert S.fit_stages(t, 2, fraction, steps, None, at_setup=True) is None and not t.read
    assert S.fit_stages(t, 2, fraction, steps, None, at_setup=False) == [(1, 5), (2, 2)] and t.read
    with pytest.raises(ValueError, match="Owner: the V-cycle's stages need 22"):
        S.fit_stages(t, 2, steps, Duration(20, "step"), None, at_setup=False, owner="Owner")


def test_fit_stages_at_train_start_take_the_estimated_length():
    """At train start the run's length is ``estimated_stepping_batches`` when epochs or ``limit_train_batches`` end
    the run before ``max_steps``: fractions resolve against it and stages that end after it raise; in ``setup`` only
    ``max_steps`` is checked, and a run bounded by ``max_steps`` resolves exactly as before."""
    t = SimpleNamespace(max_steps=1000, estimated_stepping_batches=5, num_training_batches=5, accumulate_grad_batches=1)
    half, fifth = Duration(0.5, "fraction"), Duration(0.2, "fraction")
    assert S.fit_stages(t, 2, half, fifth, None, at_setup=True) == [(1, 500), (2, 200)]  # setup: max_steps only
    assert S.fit_stages(t, 2, half, fifth, None, at_setup=False) == [(1, 2), (2, 1)]
    t = SimpleNamespace(max_steps=100, estimated_stepping_batches=3, num_training_batches=3, accumulate_grad_batches=1)
    two = Duration(2, "step")
    assert S.fit_stages(t, 2, two, two, None, at_setup=True) == [(1, 2), (2, 2)]
    with pytest.raises(ValueError, match=r"need 4 optimizer steps .* run has 3 \(trainer\.max_steps, or max_epochs"):
        S.fit_stages(t, 2, two, two, None, at_setup=False)
    t = SimpleNamespace(max_steps=10, estimated_stepping_batches=10, num_training_batches=4, accumulate_grad_batches=1)
    assert S.fit_stages(t, 2, Duration(0.3, "fraction"), half, None, at_setup=False) == [(1, 3), (2, 5)]


def test_stage_level_and_levels_due():
    stages = [(1, 2), (2, 2), (3, 0), (2, 3)]  # ends [2, 4, 4, 7]
    ends = S.stage_ends(stages)
    assert [S.stage_level(stages, i) for i in range(5)] == [1, 2, 3, 2, 1]
    assert S.levels_due(stages, ends, 0, 1) == [] and S.levels_due(stages, ends, 0, 2) == [2]
    assert S.levels_due(stages, ends, 1, 4) == [3, 2]  # the zero-length stage of level 3 is passed through
    assert S.levels_due(stages, ends, 3, 6) == [] and S.levels_due(stages, ends, 3, 7) == [1]
    assert S.levels_due(stages, ends, 4, 100) == []  # after the last listed stage: level 1 to the end
    assert S.levels_due([(1, 1), (2, 0)], [1, 1], 0, 1) == [2, 1]  # fast_dev_run: down and up at step 1


def test_stages_mismatch():
    assert S.stages_mismatch([[1, 2], [2, 3]], [(1, 2), (2, 3)]) is None
    assert S.stages_mismatch([(1, 2), (2, 3)], [(1, 2), (2, 3)]) is None
    message = S.stages_mismatch([[1, 5], [2, 3]], [(1, 10), (2, 3)])
    assert message is not None and "[(1, 5), (2, 3)]" in message and "[(1, 10), (2, 3)]" in message
    assert S.stages_mismatch([[1, 2], [2, 3]], [(1, 2), (2, 1)]) is not None


# ------------------------------------------------------------------------------------------------ progress clock
def D(text):
    return Duration.parse(text)


def test_stage_clock_follows_the_units_and_a_progress_source():
    assert S.stage_clock(2, D("0.3dur"), D("2ep"), None, None, "V") == "step"  # no source: resolved into steps
    assert S.stage_clock(2, D("0.3dur"), D("2ep"), None, "Src", "V") == "progress"
    assert S.stage_clock(2, D(3), D("4st"), None, "Src", "V") == "step"
    with pytest.raises(ValueError, match=r"V: Src changes the epoch lengths.*got e_a=3, e_small='1ep'. Give every"):
        S.stage_clock(2, D(3), D("1ep"), None, "Src", "V")
    with pytest.raises(ValueError, match=r"got e_a='0.1dur', e_small='0.2dur', up_leg=\[2\]"):
        S.stage_clock(3, D("0.1dur"), D("0.2dur"), (D(2),), "Src", "V")


def test_progress_stages_are_exact_cumulative_ticks():
    T = PROGRESS_TICKS
    assert S.resolve_progress_stages(2, D("0.3dur"), D("0.5dur"), None, None) == [(1, 3 * T // 10), (2, T // 2)]
    assert S.resolve_progress_stages(2, D("0.2dur"), D("0.8dur"), None, None) == [(1, T // 5), (2, 4 * T // 5)]  # = 1
    # epochs are n / max_epochs; thirds round per cumulative end, so the ends are round(k / 3 · 10⁹)
    stages = S.resolve_progress_stages(3, D("1ep"), D("0.1dur"), (D("1ep"),), 6)
    assert S.stage_ends(stages) == [166_666_667, 333_333_333, 433_333_333, 600_000_000]
    assert [level for level, _ in stages] == [1, 2, 3, 2]
    assert S.resolve_progress_stages(2, D("0dur"), D("0dur"), None, None) == [(1, 1), (2, 0)]  # e_a: >= 1 tick
    with pytest.raises(ValueError, match=r"need 1.1 of the run on Src's progress clock .*lower e_a"):
        S.resolve_progress_stages(2, D("0.6dur"), D("0.5dur"), None, None, "V", "Src")
    with pytest.raises(ValueError, match=r"1/3 of the run\) but the run is 1"):
        S.resolve_progress_stages(2, D("2ep"), D("2ep"), None, 3, "V", "Src")
    for epochs in (None, -1, float("inf")):
        with pytest.raises(ValueError, match=r"epochs are measured on Src's training progress .*max_epochs="):
            S.resolve_progress_stages(2, D("1ep"), D("0.5dur"), None, epochs, "V", "Src")
    with pytest.raises(ValueError, match="fractions or epochs only"):
        S.resolve_progress_stages(2, D(2), D("0.5dur"), None, None)


def test_progress_ends_meet_the_source_at_epoch_boundaries():
    """A source reading (e + j / L) / E: the step that ends epoch n reads exactly the end of an 'n ep' stage."""
    lengths, E = [7, 3, 3, 3, 7, 7], 6
    stages = S.resolve_progress_stages(3, D("1ep"), D("2ep"), (D("1ep"),), E)
    ends = S.stage_ends(stages)
    readings = []
    for e, length in enumerate(lengths):
        for j in range(1, length + 1):
            readings.append(progress_ticks((e + j / length) / E))
    switches = [next(i + 1 for i, t in enumerate(readings) if t >= end) for end in ends]
    assert switches == [7, 10, 16, 23]  # the last steps of epochs 0, 1, 3, 4


def test_step_stages_must_fit_the_fewest_steps():
    S.check_min_steps([(1, 5), (2, 9)], 14, "V", "Src")
    with pytest.raises(ValueError, match=r"V: .*need 15 optimizer steps \(\[5, 10\]\) but Src shortens .*as few as 14"):
        S.check_min_steps([(1, 5), (2, 10)], 14, "V", "Src")
    for bad in (0, 2.5, None):
        with pytest.raises(ValueError, match="effi_min_total_steps\\(\\) must be an int >= 1"):
            S.check_min_steps([(1, 1)], bad, "V", "Src")
