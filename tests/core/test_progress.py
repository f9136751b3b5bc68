"""Duration: one type for every length a technique is given; and the single source of training progress."""

import math
import random
from fractions import Fraction
from types import SimpleNamespace

import pytest

from lightning_effi.core.progress import (
    EXACT_DENOMINATOR,
    PROGRESS_TICKS,
    Duration,
    exact_progress_done,
    progress_clock,
    progress_source,
    progress_ticks,
    training_progress,
)
from lightning_effi.core.protocols import ProvidesProgress, ProvidesProgressClock


@pytest.mark.parametrize(
    "value, unit, number, steps",
    [
        (5, "step", 5, 5),
        ("500st", "step", 500, 500),
        ("500ba", "step", 500, 500),
        ("2ep", "epoch", 2, 20),
        ("0.3dur", "fraction", 0.3, 30),
        ("0.999dur", "fraction", 0.999, 99),  # floor(0.999 * 100)
        ("1e3tok", "token", 1000.0, 4),  # ceil(1000 / 300)
        (Duration(1, "fraction"), "fraction", 1, 100),
    ],
)
def test_parse_and_resolve(value, unit, number, steps):
    d = Duration.parse(value)
    assert (d.unit, d.value) == (unit, number)
    assert d.to_steps(steps_per_epoch=10, total_steps=100, tokens_per_step=300) == steps


@pytest.mark.parametrize(
    "value, match",
    [
        (0.3, r"e_a must be an int \(optimizer steps\) or a string with a unit"),
        (True, "e_a must be an int"),
        (-1, "e_a must be >= 0 optimizer steps"),
        ("2.5ep", "e_a: epochs must be whole"),
        ("1.5dur", r"e_a: a duration in fractions must be a number in \[0, 1\]"),
        ("10 minutes", "e_a: cannot read '10 minutes' as a duration"),
        ("1e400st", "e_a: '1e400st' is too large to be a duration"),
    ],
)
def test_parse_errors_name_the_argument(value, match):
    with pytest.raises(ValueError, match=match):
        Duration.parse(value, "e_a")


def test_construction_checks_the_domain():
    with pytest.raises(ValueError, match="Duration.unit must be one of"):
        Duration(1, "second")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="in steps must be an int >= 0"):
        Duration(1.5, "step")


@pytest.mark.parametrize(
    "d, kwargs, match",
    [
        (Duration(2, "epoch"), {}, "epoch length in optimizer steps is unknown"),
        (Duration(0.5, "fraction"), {"total_steps": math.inf}, "run's length is unknown"),
        (Duration(10.0, "token"), {}, "tokens per optimizer step are unknown"),
    ],
)
def test_resolution_needs_its_quantity(d, kwargs, match):
    with pytest.raises(ValueError, match=match):
        d.to_steps(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"total_steps": -5}, "total_steps must be a number >= 0, got -5"),
        ({"steps_per_epoch": -3}, "steps_per_epoch must be a number >= 0, got -3"),
        ({"steps_per_epoch": float("nan")}, "steps_per_epoch must be a number >= 0"),
        ({"tokens_per_step": math.inf}, "tokens_per_step must be a finite number > 0"),
        ({"tokens_per_step": 0}, "tokens_per_step must be a finite number > 0"),
    ],
)
def test_resolution_refuses_bad_quantities(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Duration(1, "step").to_steps(**kwargs)


def test_resolution_of_unknown_or_huge_quantities():
    with pytest.raises(ValueError, match="epoch length in optimizer steps is unknown"):
        Duration(2, "epoch").to_steps(steps_per_epoch=math.inf)
    with pytest.raises(ValueError, match="too large to count in optimizer steps"):
        Duration(1e308, "token").to_steps(tokens_per_step=1e-10)


def test_numpy_values_become_plain_numbers():
    import numpy as np

    d = Duration(np.int64(3))
    assert type(d.value) is int and repr(d) == "Duration(value=3, unit='step')"
    assert type(Duration(np.float32(0.5), "fraction").value) is float
    assert eval(repr(d), {"Duration": Duration}) == d


def test_fraction_rounding():
    assert Duration.parse("0.25dur").to_steps(total_steps=10) == 2
    assert Duration.parse("0.25dur").to_steps(total_steps=10, rounding="ceil") == 3
    assert Duration.parse("0.3dur").to_steps(total_steps=10, rounding="ceil") == 3  # 0.3 * 10 is exactly 3.0


def test_str_round_trips():
    assert str(Duration(1e6, "token")) == "1000000tok" and str(Duration(0.123456789, "fraction")) == "0.123456789dur"
    for text in ("7st", "2ep", "0.25dur", "1000tok", "0.123456789dur", "1e-07dur"):
        assert str(Duration.parse(text)) == text
        assert Duration.parse(str(Duration.parse(text))) == Duration.parse(text)


def test_training_progress_has_one_source():
    class Shortens:
        def effi_progress(self) -> float:
            return 0.75

    plain = SimpleNamespace(callbacks=[object()], estimated_stepping_batches=40, global_step=10)
    assert training_progress(plain) == 0.25
    assert progress_source(plain.callbacks) is None
    technique = Shortens()
    with_technique = SimpleNamespace(callbacks=[object(), technique], estimated_stepping_batches=40, global_step=10)
    assert training_progress(with_technique) == 0.75
    assert progress_source(with_technique.callbacks)() == 0.75
    unknown = SimpleNamespace(callbacks=[], estimated_stepping_batches=math.inf, global_step=10)
    assert training_progress(unknown) == 0.0


def test_run_length_and_steps_per_epoch():
    from lightning_effi.core.progress import run_length, steps_per_epoch

    assert (run_length(100, 3.0), run_length(10), run_length(-1, 42.0), run_length(-1, math.inf)) == (3, 10, 42, None)
    assert run_length(None, None) is None and run_length(0, 0) is None
    assert steps_per_epoch(10, 3) == 4 and steps_per_epoch(9, 3) == 3
    with pytest.raises(ValueError, match="e_a needs a train dataloader with a length"):
        steps_per_epoch(math.inf, 1, "e_a")


def test_progress_clock_needs_the_whole_protocol():
    class Clock:
        def effi_progress(self) -> float:
            return 0.5

        def effi_progress_done(self) -> float:
            return 0.25

        def effi_min_total_steps(self) -> int:
            return 7

    class TokensOnly:  # the Curriculum's token progress: for LR schedules, not a clock
        def effi_progress(self) -> float:
            return 0.5

    clock = Clock()
    assert isinstance(clock, ProvidesProgressClock) and isinstance(clock, ProvidesProgress)
    assert not isinstance(TokensOnly(), ProvidesProgressClock)
    assert progress_clock([object(), TokensOnly(), clock]) is clock
    assert progress_clock([TokensOnly()]) is None and progress_clock([]) is None
    assert progress_source([TokensOnly(), clock])() == 0.5  # LR schedules still read the first effi_progress


def test_progress_ticks():
    assert PROGRESS_TICKS == 10**9
    assert progress_ticks(0.0) == 0 and progress_ticks(1) == PROGRESS_TICKS and progress_ticks(0.3) == 300_000_000
    assert progress_ticks((2 + 1 / 1) / 10) == progress_ticks(0.3)  # an epoch boundary read as a float
    for bad in (-0.1, 1.5, float("nan"), None, True):
        with pytest.raises(ValueError, match="training progress must be a number in \\[0, 1\\]"):
            progress_ticks(bad)


def test_durations_resolved_in_batches_are_checked_against_the_first_batchs_optimizer_steps():
    """A GAN steps two optimizers a batch, so global_step advances 2 a batch: a V-cycle stage of '1ep' ended after
    half an epoch, random-LTD's '2ep' growth after one (the helper's runs). Epochs, and fractions of a run whose
    length comes from the batches, are refused once the first batch took more than one optimizer step; optimizers
    stepped in turn (one a batch), steps, and fractions of max_steps count in global_step's unit."""
    from types import SimpleNamespace

    from lightning_effi.core.progress import StepsPerBatchCheck, batch_resolved_durations

    def trainer(max_steps=-1, estimated=40):
        two = [object(), object()]
        return SimpleNamespace(optimizers=two, max_steps=max_steps, estimated_stepping_batches=estimated, global_step=0)

    manual, automatic = SimpleNamespace(automatic_optimization=False), SimpleNamespace(automatic_optimization=True)
    given = {"e_a": Duration(1, "epoch"), "e_small": Duration(0.5, "fraction"), "up_leg": Duration(7, "step")}
    assert list(batch_resolved_durations(trainer(), manual, given)) == ["e_a", "e_small"]
    assert list(batch_resolved_durations(trainer(max_steps=20), manual, given)) == ["e_a"]  # 0.5 of max_steps
    assert batch_resolved_durations(trainer(), automatic, given) == {}
    one = SimpleNamespace(optimizers=[object()], max_steps=-1, estimated_stepping_batches=40, global_step=0)
    assert list(batch_resolved_durations(one, manual, given)) == ["e_a", "e_small"]  # accumulation by hand

    check, t = StepsPerBatchCheck("Owner"), trainer()
    check.arm(t, manual, given)
    check.batch_start(t)
    t.global_step = 2  # both optimizers stepped in the first batch
    with pytest.raises(ValueError, match=r"Owner: manual optimization stepped 2 optimizers in the first batch.*"
                       r"e_a='1ep', e_small='0.5dur' is resolved from the batches"):  # fmt: skip
        check.batch_end(t)
    check, t = StepsPerBatchCheck("Owner"), trainer()
    check.arm(t, manual, given)
    for step in (1, 2, 3):  # in turn: one step a batch; checked on the first batch only
        check.batch_start(t)
        t.global_step = step
        check.batch_end(t)


def test_one_optimizer_stepped_every_k_batches_is_refused_for_durations_resolved_in_batches():
    """Gradients accumulated by hand (one optimizer stepped every second batch): global_step advances once every 2
    batches, so random-LTD's '1ep' growth took two epochs and ended below max_value (qa45-break 02). Read off the
    batches between the first two steps (a first batch that steps nothing is not enough: a skipped batch)."""
    from types import SimpleNamespace

    from lightning_effi.core.progress import BatchesPerStep, StepsPerBatchCheck

    def run(steps_after_each_batch: list[int]) -> list[tuple[str, int] | None]:
        watch, t, found = BatchesPerStep(), SimpleNamespace(global_step=0), []
        for step in steps_after_each_batch:
            watch.batch_start(t)
            t.global_step = step
            found.append(watch.batch_end(t))
        return found

    assert run([0, 1, 1, 2, 2, 3]) == [None] * 5 + [("batches", 2)]  # two equal gaps of 2
    assert run([0, 1, 2, 3]) == [None] * 4  # a first batch skipped, then one step a batch
    # a step skipped once (a NaN guard) between the first steps: gaps 2 and 1, nothing said (qa46-break 08)
    assert run([1, 1, 2, 3, 4]) == [None] * 5
    forty = [(i + 1) // 40 for i in range(120)]  # k = 40 (qa46-break 09: not seen in 64 batches)
    assert run(forty)[-1] == ("batches", 40)  # said at the third step
    assert run([0, 0, 1, 2, 2, 3]) == [None] * 6  # two batches skipped in a row, then gaps of 1 (qa47-break 03)
    assert run([2, 4]) == [("steps", 2), None]  # two optimizers a batch: said once, at the first batch
    assert run([0] * 1030 + [1]) == [None] * 1031  # watched 1024 batches at most
    manual = SimpleNamespace(automatic_optimization=False)
    t = SimpleNamespace(optimizers=[object()], max_steps=-1, estimated_stepping_batches=40, global_step=0)
    check = StepsPerBatchCheck("Owner")
    check.arm(t, manual, {"require_steps": Duration(1, "epoch")})
    with pytest.raises(ValueError, match=r"Owner: manual optimization stepped the optimizer once every 3 batches "
                       r"\(gradients accumulated by hand\).*require_steps='1ep'.*3 times as slow"):  # fmt: skip
        for step in (0, 0, 1, 1, 1, 2, 2, 2, 3):  # two equal gaps of 3
            check.batch_start(t)
            t.global_step = step
            check.batch_end(t)


@pytest.mark.parametrize("technique", ["random_ltd", "vcycle"])
def test_a_stream_shorter_than_its_limit_warns_that_the_schedule_ended_unfinished(tmp_path, technique):
    """A loader without a length whose epochs an int limit_train_batches sets: Lightning estimates max_epochs x limit
    steps (20), the stream gives 8; schedules resolved as fractions of the estimate ended unfinished in silence
    (random-LTD at 8 of 16 tokens, the V-cycle's full model trained 0 steps after its last switch, qa57-loops 03)."""
    import warnings

    import lightning.pytorch as pl

    from lightning_effi.callbacks import RandomLTDCallback, VCycleCallback
    from tests.helpers.harness import make_trainer
    from tests.helpers.tiny import TokenStreamData, tiny_gpt2

    told = []
    for limit in (10, 4):  # the stream's 4 batches an epoch: 20 steps estimated, 8 trained; then 8 of 8
        pl.seed_everything(0)
        if technique == "random_ltd":
            callback = RandomLTDCallback(min_value=4)
            model = tiny_gpt2(n_layer=4)
        else:
            callback, model = VCycleCallback(e_a="0.2dur", e_small="0.2dur"), tiny_gpt2(n_layer=4)
        trainer = make_trainer(tmp_path / str(limit), [callback], max_epochs=2, limit_train_batches=limit)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, datamodule=TokenStreamData())
        assert trainer.global_step == 8
        told.append([str(w.message) for w in caught if "before the" in str(w.message)])
    assert len(told[0]) == 1 and "the run ended at step 8, before the 20 optimizer steps" in told[0][0]
    assert "the train dataloader has no length" in told[0][0] and told[1] == []
    if technique == "random_ltd":
        assert "require_steps='1dur' resolved to 20 steps" in told[0][0]
    else:
        assert "the full model's last leg, after the switch back at step 8, trained 0 of its planned 12" in told[0][0]


def test_shorter_than_resolved_names_why_the_run_was_shorter():
    """The end-of-run message says which of the three reasons applies; nothing for a run that reached the length (or
    had none resolved)."""
    from lightning_effi.core.progress import shorter_than_resolved

    loader = [1, 2, 3]  # a loader with a length
    done = SimpleNamespace(global_step=20, train_dataloader=loader, should_stop=False)
    assert shorter_than_resolved(done, 20) is None and shorter_than_resolved(done, None) is None
    stopped = SimpleNamespace(global_step=12, train_dataloader=loader, should_stop=True)
    assert "before the 20 optimizer steps" in shorter_than_resolved(stopped, 20)
    assert "stopped early (an EarlyStopping" in shorter_than_resolved(stopped, 20)
    estimate = SimpleNamespace(global_step=12, train_dataloader=loader, should_stop=False)
    assert "trainer.estimated_stepping_batches, was above the steps it ran" in shorter_than_resolved(estimate, 20)
    stream = SimpleNamespace(global_step=12, train_dataloader=iter(loader), should_stop=False)
    assert "the train dataloader has no length" in shorter_than_resolved(stream, 20)


class FloatClock:
    """A clock that gives its progress ``(e + j / L) / E`` as a float only, as a user's own may."""

    def __init__(self, value):
        self.value = value

    def effi_progress_done(self):
        return self.value


def test_exact_progress_done_reads_a_float_clock_as_the_fraction_it_computes():
    """A float ``(e + j / L) / E`` is read back as ``(e·L + j) / (E·L)`` exactly for every run of up to 2²⁵ optimizer
    steps (sampled here, with the largest epoch lengths and counts included), where ticks round it (1/3: 333333333)."""
    assert EXACT_DENOMINATOR == 2**25
    rng = random.Random(0)
    shapes = [(3, 1), (1, 3), (9, 7), (7, 9), (2**12, 2**13), (200, 167_772), (2**25, 1), (1, 2**25)]
    shapes += [(rng.randint(1, 5000), rng.randint(1, 6000)) for _ in range(40)]
    checked = 0
    for epochs, length in shapes:
        assert epochs * length <= EXACT_DENOMINATOR
        for _ in range(50):
            e, j = rng.randrange(epochs), rng.randrange(length + 1)
            assert exact_progress_done(FloatClock((e + j / length) / epochs)) == Fraction(
                e * length + j, epochs * length
            )
            checked += 1
    assert checked == 50 * len(shapes)
    assert exact_progress_done(FloatClock(1 / 3)) == Fraction(1, 3) and progress_ticks(1 / 3) == 333_333_333
    assert exact_progress_done(FloatClock(0)) == 0 and exact_progress_done(FloatClock(1.0)) == 1


def test_exact_progress_done_prefers_the_clocks_exact_fraction_and_checks_its_range():
    class ExactClock(FloatClock):
        def effi_progress_done_exact(self):
            return Fraction(372_367, 999_998)  # its own fraction, whatever its float reads

    assert exact_progress_done(ExactClock(0.0)) == Fraction(372_367, 999_998)
    for bad in (-0.1, 1.5, Fraction(3, 2)):
        with pytest.raises(ValueError, match="FloatClock's training progress must be a number in \\[0, 1\\], got "):
            exact_progress_done(FloatClock(bad))
    # not a number: named by its type (a tensor in range was told "out of its range", qa84-break 05)
    for bad, kind in ((float("nan"), "float"), (float("inf"), "float"), (None, "NoneType"), ("0.5", "str")):
        with pytest.raises(ValueError, match=f"must be a float in \\[0, 1\\] \\(ProvidesProgressClock\\), got {kind} "):
            exact_progress_done(FloatClock(bad))
    import torch

    with pytest.raises(ValueError, match=r"must be a float in \[0, 1\] \(ProvidesProgressClock\), got Tensor tensor"):
        exact_progress_done(FloatClock(torch.tensor(0.0)))


def test_step_progress_gives_a_plain_arm_the_technique_arms_lr_at_every_step(tmp_path):
    """One progress-based schedule on ``progress_source(callbacks) or step_progress(trainer)`` trains the same LR at
    every step with and without an InfoBatch that prunes nothing, and the plain arm's is ``warmup_cosine``'s on the
    steps (the card paired a torch ``CosineAnnealingLR`` with it, one step behind: the InfoBatch arm's last step
    trained at LR 0, qa86-user 01)."""
    import math

    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_effi.callbacks import InfoBatchCallback
    from lightning_effi.core.lr_schedules import progress_lambda, warmup_cosine
    from lightning_effi.core.progress import progress_source, step_progress
    from lightning_effi.data import InfoBatchDataModule
    from tests.helpers.harness import make_trainer

    class Data(pl.LightningDataModule):
        def setup(self, stage: str) -> None:
            g = torch.Generator().manual_seed(0)
            self.data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=16, shuffle=True)

    class Model(pl.LightningModule):
        def __init__(self, reference: bool = False) -> None:
            super().__init__()
            self.net, self.reference, self.lrs = nn.Linear(8, 3), reference, []

        def training_step(self, batch, batch_idx):
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            steps = self.trainer.estimated_stepping_batches
            if self.reference:
                sched = warmup_cosine(opt, total_steps=steps, warmup_fraction=0, min_lr_ratio=0)
            else:
                progress = progress_source(self.trainer.callbacks) or step_progress(self.trainer)
                sched = progress_lambda(opt, lambda p: 0.5 * (1 + math.cos(math.pi * p)), progress)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    runs = []
    for reference, infobatch in ((True, False), (False, False), (False, True)):
        pl.seed_everything(0)
        model = Model(reference)
        callbacks = [InfoBatchCallback(prune_ratio=1e-9, delta=0.5)] if infobatch else []
        data = InfoBatchDataModule(Data()) if infobatch else Data()
        make_trainer(tmp_path / str(len(runs)), callbacks, max_epochs=4).fit(model, datamodule=data)
        runs.append(model.lrs)
    assert len(runs[0]) == 16 and runs[0] == runs[1] == runs[2]
    assert runs[0][0] == 0.5 * (1 + math.cos(math.pi / 16)) and runs[0][-1] == 0.0
    with pytest.raises(ValueError, match="total_steps"):
        step_progress(object(), total_steps=0)


def test_clock_epochs_are_the_clocks_own_when_it_says_them():
    """An epoch count on a progress clock is a share of the clock's own epochs (InfoBatch's num_epochs), else of
    max_epochs (qa86-break 11); a clock that says none, or 0 before its setup, gives max_epochs."""
    from types import SimpleNamespace

    from lightning_effi.callbacks import InfoBatchCallback
    from lightning_effi.core.progress import clock_epochs

    trainer = SimpleNamespace(max_epochs=4)
    ib = InfoBatchCallback(num_epochs=2)
    assert clock_epochs(ib, trainer) == 4  # before setup: E unresolved
    ib.epochs = 2  # what setup resolves
    assert clock_epochs(ib, trainer) == 2 and clock_epochs(object(), trainer) == 4
    assert clock_epochs(SimpleNamespace(effi_clock_epochs=lambda: 2.5), trainer) == 4  # not an epoch count
