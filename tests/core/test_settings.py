"""Constructor settings set on a callback after it was built (``lightning_effi.core.settings``): taken at the next
fit as if built with them, refused there with the constructor's error, never overwritten in silence."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import yaml

from lightning_effi import Curriculum, CurriculumDataModule, InfoBatchCallback, RandomLTDCallback, VCycleCallback
from lightning_effi.core.settings import (
    KeepsSettings,
    apply_changed_settings,
    changed_settings,
    given_settings,
    keep_settings,
)
from tests.harness.settings import CURRICULUM_METRICS
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import tiny_gpt2, tiny_lm_data


class Toy(KeepsSettings):
    def __init__(self, steps: int | str = 4, ratio: float = 0.5, **deprecated: Any) -> None:
        given = given_settings(locals())
        if isinstance(steps, str):
            steps = int(steps.removesuffix("ba"))  # parsed: the attribute is not the argument as given
        if steps < 1:
            raise ValueError(f"Toy.steps must be an int >= 1, got {steps!r}")
        self.steps, self.ratio, self.deprecated = steps, float(ratio), deprecated
        self.derived: int | None = None
        self.runs = 0  # runtime state the constructor sets
        keep_settings(self, Toy, given)


class OwnToy(Toy):
    def __init__(self, note: str = "") -> None:
        super().__init__(steps="3ba")
        self.note = note


def test_nothing_set_is_nothing_changed_and_the_callbacks_own_writes_are_not_settings(tmp_path):
    toy = Toy(steps="4ba", old=1)
    assert changed_settings(toy) == {} and apply_changed_settings(toy) == {}
    ltd = RandomLTDCallback(min_value=4, seq_per_step=4)  # max_value, require_steps, layer_ids: derived by the fit
    _fit(tmp_path, ltd)
    assert ltd.max_value == 16 and ltd.require_steps == 4 and changed_settings(ltd) == {}


def test_a_subclass_that_overrides_setattr_keeps_the_callbacks_own_writes_its_own(tmp_path):
    """A user subclass with its own ``__setattr__`` (logging each write, say) passes the callback's writes on: they
    are still the callback's (the writer is the code calling ``__setattr__``), and the user's are still settings."""
    writes: list[str] = []

    class LoggedLTD(RandomLTDCallback):
        def __setattr__(self, name: str, value: Any) -> None:
            writes.append(name)
            super().__setattr__(name, value)

    ltd = LoggedLTD(min_value=4, seq_per_step=4)
    _fit(tmp_path, ltd)
    assert "max_value" in writes and ltd.max_value == 16 and changed_settings(ltd) == {}
    ltd.require_steps = 2
    assert changed_settings(ltd) == {"require_steps": 2}


def test_a_setting_set_builds_it_again_keeping_other_settings_and_a_subclass_attributes():
    toy = OwnToy(note="mine")
    toy.runs = 7
    toy.ratio = 0.25
    assert changed_settings(toy) == {"ratio": 0.25}
    assert apply_changed_settings(toy) == {"ratio": 0.25}
    assert (toy.steps, toy.ratio, toy.runs, toy.note) == (3, 0.25, 0, "mine")  # built again: state from scratch
    assert changed_settings(toy) == {}
    toy.deprecated = {"old": 2}  # a **kwargs argument set as a whole
    apply_changed_settings(toy)
    assert toy.deprecated == {"old": 2} and toy.ratio == 0.25


def test_an_attribute_of_an_arguments_name_that_the_object_never_had_is_a_setting():
    class Guarded(KeepsSettings):
        def __init__(self, policy: str = "raise") -> None:
            given = given_settings(locals())
            self.guard = policy  # kept under another name
            keep_settings(self, Guarded, given)

    obj = Guarded()
    obj.policy = "skip"
    assert changed_settings(obj) == {"policy": "skip"}
    apply_changed_settings(obj)
    assert obj.guard == "skip"


def test_a_refused_setting_raises_the_constructors_error_and_leaves_the_object_as_it_was():
    toy = Toy(steps=4)
    toy.runs = 3
    toy.steps = 0
    before = dict(vars(toy))
    with pytest.raises(ValueError, match=r"^Toy.steps must be an int >= 1, got 0\n") as info:
        apply_changed_settings(toy)
    assert "steps=0 was set on the callback after it was built" in info.value.__notes__[0]
    assert vars(toy) == before and changed_settings(toy) == {"steps": 0}
    with pytest.raises(ValueError, match=r"^Toy.steps must be an int >= 1"):  # a second try: refused again
        apply_changed_settings(toy)


class LRs(pl.Callback):
    def __init__(self) -> None:
        self.rows: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.rows.append(trainer.optimizers[0].param_groups[0]["lr"])


class ChangesInPlace(pl.Callback):
    def __init__(self, vc: VCycleCallback) -> None:
        self.vc = vc

    def on_train_batch_end(self, *args: Any) -> None:
        self.vc.lr_multiplier[2] = 3.0


def test_a_vcycle_lr_multiplier_changed_in_place_is_a_setting_of_the_next_fit(tmp_path):
    """``vc.lr_multiplier[2] = -1.0`` skipped the constructor's check (level 2 trained at a negative LR), and a factor
    changed in place was dropped when another setting rebuilt the callback (qa90-resume 03): an in-place change is a
    setting, compared with the dict as built at the next fit's setup; one made during a fit waits for the next."""
    vc = VCycleCallback(e_a=1, e_small=2, lr_multiplier={2: 2.0})
    vc.lr_multiplier[2] = -1.0
    assert changed_settings(vc) == {"lr_multiplier": {2: -1.0}}
    with pytest.raises(ValueError, match=r"lr_multiplier\[2\] must be a number > 0, got -1.0"):
        apply_changed_settings(vc)
    vc.lr_multiplier[2] = 3.0
    vc.alpha_original = 0.5  # another setting too: the factor changed in place is kept
    apply_changed_settings(vc)
    assert vc.lr_multiplier == {2: 3.0} and vc.alpha_original == 0.5 and changed_settings(vc) == {}
    for copied in (copy.deepcopy(vc), pickle.loads(pickle.dumps(vc))):
        copied.lr_multiplier[2] = 4.0  # the copy's own dict, compared with its own copy as built
        assert changed_settings(copied) == {"lr_multiplier": {2: 4.0}} and changed_settings(vc) == {}
    assert yaml.safe_dump(vc.lr_multiplier) == "2: 3.0\n"  # a plain dict (a read-only subclass was not YAML)

    vc, lrs = VCycleCallback(e_a=1, e_small=2, lr_multiplier={2: 2.0}), LRs()
    _fit(tmp_path / "a", vc, extra=[lrs, ChangesInPlace(vc)])
    base = lrs.rows[0]
    assert lrs.rows == pytest.approx([base, 2 * base, 2 * base, base])  # this fit's factors, as set up
    lrs.rows.clear()
    _fit(tmp_path / "b", vc, extra=[lrs])
    assert lrs.rows == pytest.approx([base, 3 * base, 3 * base, base]) and vc.lr_factor(2) == 3.0

    vc, lrs = VCycleCallback(e_a=1, e_small=2, lr_multiplier={2: 2.0}), LRs()
    with pytest.warns(UserWarning, match=r"VCycleCallback.lr_multiplier = \{2: -1.0\} was set during a fit"):
        _fit(tmp_path / "c", vc, extra=[lrs, SetsDuringFit(vc, lr_multiplier={2: -1.0})])
    assert min(lrs.rows) > 0 and vc.lr_multiplier == {2: 2.0}
    with pytest.raises(ValueError, match=r"lr_multiplier\[2\] must be a number > 0"):
        _fit(tmp_path / "d", vc)


def test_the_callers_dict_edited_after_the_build_is_not_a_setting():
    """The arguments are recorded with their containers copied: the caller's own dict, edited after the build (reused
    for the next experiment), was taken when another setting rebuilt the callback (qa92-break 01)."""

    class Factors(KeepsSettings):
        def __init__(self, factors: dict[int, Any] | None = None, ratio: float = 0.5) -> None:
            given = given_settings(locals())
            self.factors = copy.deepcopy(factors or {})  # the constructor's own copy
            self.ratio = ratio
            keep_settings(self, Factors, given)

    mine = {2: [2.0]}
    obj = Factors(factors=mine)
    mine[2][0], mine[3] = 8.0, [3.0]
    obj.ratio = 0.25  # an unrelated setting rebuilds it
    apply_changed_settings(obj)
    assert obj.factors == {2: [2.0]} and obj.ratio == 0.25
    vc = VCycleCallback(e_a=1, e_small=2, lr_multiplier=(factors := {2: 2.0}))
    factors[2] = 8.0
    vc.alpha_original = 0.5
    apply_changed_settings(vc)
    assert vc.lr_multiplier == {2: 2.0} and vc.alpha_original == 0.5


class SlottedLTD(RandomLTDCallback):
    __slots__ = ("tag", "__own")


class TaggedLTD(RandomLTDCallback):
    """Keeps its slot by extending the state dict: the state stays a dict (a (dict, slots) pair broke this,
    qa97-regress 01)."""

    __slots__ = ("tag",)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "tagged": self.tag}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        tag = state.pop("tagged")
        super().__setstate__(state)
        self.tag = tag


def test_a_shallow_copy_notes_its_own_settings():
    """``copy.copy`` shared the record of settings set: one set on the copy was noted on the original and trained in
    its next fit (qa92-break 02)."""
    base = RandomLTDCallback(min_value=4, seq_per_step=4)
    base.seed = 3
    variant = copy.copy(base)
    variant.min_value = 12
    assert changed_settings(variant) == {"seed": 3, "min_value": 12} and changed_settings(base) == {"seed": 3}
    apply_changed_settings(base)
    assert (base.min_value, base.seed) == (4, 3)
    apply_changed_settings(variant)
    assert (variant.min_value, variant.seed) == (12, 3)
    # the class's own copy protocol is kept: a subclass with slots, and random-LTD's __getstate__ (its per-fit hooks
    # and lists are fresh in a copy); a __copy__ of our own lost the slots (qa93-regress 04)

    class Slotted(Toy):
        __slots__ = ("tag",)

    toy = Slotted(steps=4)
    toy.tag = "mine"
    twin = copy.copy(toy)
    twin.steps = 9
    assert twin.tag == "mine" and changed_settings(twin) == {"steps": 9} and changed_settings(toy) == {}
    assert copy.copy(base)._input_hooks is not base._input_hooks
    ltd = SlottedLTD(min_value=4, seq_per_step=4)
    ltd.tag, ltd._SlottedLTD__own = "mine", 3
    # random-LTD's __getstate__ returned its __dict__ alone: a subclass's slot values were lost by every copy
    for twin in (copy.copy(ltd), copy.deepcopy(ltd), pickle.loads(pickle.dumps(ltd))):
        assert (twin.tag, twin._SlottedLTD__own) == ("mine", 3) and changed_settings(twin) == {}
    # a (dict, slots) pair, as 01af568 pickled a slotted subclass, loads (a bare AttributeError, qa98-regress 03)
    old = SlottedLTD.__new__(SlottedLTD)
    old.__setstate__(({**ltd.__getstate__(), "tag": None}, {"tag": "old"}))
    assert old.tag == "old" and old.min_value == 4 and changed_settings(old) == {}
    tagged = TaggedLTD(min_value=4, seq_per_step=4)
    tagged.tag = "mine"
    for twin in (copy.copy(tagged), copy.deepcopy(tagged), pickle.loads(pickle.dumps(tagged))):
        assert twin.tag == "mine" and twin.min_value == 4
    # a setting set on the original after the copy is not the copy's (the record was split at the copy's first use
    # and took it, qa94-regress 02)
    twin = copy.copy(base)
    base.require_steps = 10
    assert changed_settings(twin) == {} and changed_settings(base) == {"require_steps": 10}


def test_omegaconf_arguments_are_recorded_as_copies():
    """Hydra's instantiate passes DictConfig / ListConfig: kept by reference, the caller's config edited after the
    build was taken when another setting rebuilt the callback (qa93-regress 03)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"lrm": {2: 2.0}, "ids": [1, 2]})
    vc = VCycleCallback(e_a=1, e_small=2, lr_multiplier=cfg.lrm)
    ltd = RandomLTDCallback(min_value=4, seq_per_step=4, layer_ids=cfg.ids)
    cfg.lrm[2] = 9.0
    cfg.ids.append(3)
    vc.e_small, ltd.seed = 4, 1
    apply_changed_settings(vc)
    apply_changed_settings(ltd)
    assert vc.lr_multiplier == {2: 2.0} and list(ltd.layer_ids_arg) == [1, 2]


def test_a_pickled_copy_has_nothing_changed():
    """``ddp_spawn`` pickles the callback: equal plain values are not settings set (floats are copied)."""
    toy = Toy(steps=4, ratio=0.3)
    copy = pickle.loads(pickle.dumps(toy))
    assert changed_settings(copy) == {}


def _fit(root: Path, callback: pl.Callback, extra: list[pl.Callback] | None = None, **kwargs: Any) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = make_trainer(root, [callback, *(extra or [])], max_steps=4, **kwargs)
    datamodule = tiny_lm_data(batch_size=4)
    if isinstance(callback, Curriculum):
        datamodule = CurriculumDataModule(datamodule)
    trainer.fit(tiny_gpt2(n_layer=4), datamodule=datamodule)
    return trainer


METRICS = {"seqlen_truncate": CURRICULUM_METRICS["seqlen_truncate"]}  # the harness's
REFUSED = [
    (lambda: RandomLTDCallback(min_value=4, seq_per_step=4), "min_value", 0, r"RandomLTDCallback.min_value must be"),
    (lambda: RandomLTDCallback(min_value=4, seq_per_step=4), "layer_ids", "1", r"RandomLTDCallback.layer_ids must"),
    (lambda: VCycleCallback(e_a=1, e_small=2), "levels", 3, r"VCycleCallback: levels=3 requires up_leg"),
    (lambda: VCycleCallback(e_a=1, e_small=2), "alpha_original", 5.0, r"alpha_original"),
    (lambda: InfoBatchCallback(num_epochs=2), "prune_ratio", 1.5, r"InfoBatchCallback.prune_ratio"),
    (lambda: Curriculum(metrics=METRICS), "seed", -1, r"seed"),
]


@pytest.mark.parametrize(("build", "name", "value", "words"), REFUSED, ids=[f"{r[1]}={r[2]!r}" for r in REFUSED])
def test_a_bad_setting_set_after_building_is_refused_at_the_next_fit_naming_it(tmp_path, build, name, value, words):
    """A value the constructor refuses, set on the attribute afterwards, was accepted and failed later with an
    unrelated error (``vc.levels = 3``: an IndexError mid-fit; ``vc.alpha_original = 5.0``: refused 37 steps into
    the fit) or trained in silence: now the fit's setup refuses it with the constructor's error, before a step."""
    callback = build()
    setattr(callback, name, value)
    for _ in range(2):  # a rerun of the cell: refused again (the failed fit kept the setting noted)
        trainer = make_trainer(tmp_path, [callback], max_steps=4, max_epochs=2)
        with pytest.raises(ValueError, match=words) as info:
            datamodule = tiny_lm_data(batch_size=4)
            if isinstance(callback, Curriculum):
                datamodule = CurriculumDataModule(datamodule)
            trainer.fit(tiny_gpt2(n_layer=4), datamodule=datamodule)
        assert f"{name}={value!r} was set on the callback after it was built" in " ".join(info.value.__notes__)
        assert trainer.global_step == 0


def test_a_vcycle_shows_a_stage_length_set_on_it_as_set(tmp_path):
    """``vc.e_small = '0.2dur'`` made ``repr`` raise AttributeError ('str' object has no attribute 'unit'), and with
    it ``pl.Trainer(callbacks=[vc])``, which formats its arguments."""
    vc = VCycleCallback(e_a=1, e_small=2)
    vc.e_small = "0.5dur"
    assert "e_small='0.5dur'" in repr(vc)
    trainer = _fit(tmp_path, vc)
    assert "e_small='0.5dur'" in repr(vc) and trainer.global_step == 4
    assert vc.stages == [(1, 1), (2, 2)]  # e_a = 1 step, e_small = 0.5 of the 4 steps


class SetsDuringFit(pl.Callback):
    def __init__(self, target: pl.Callback, **settings: Any) -> None:
        self.target, self.settings = target, settings

    def on_train_batch_end(self, *args: Any) -> None:
        for name, value in self.settings.items():
            setattr(self.target, name, value)


def _layer_tokens(root: Path, ltd: RandomLTDCallback, **kwargs: Any) -> int:
    _fit(root, ltd, **kwargs)
    return ltd.consumed_layer_tokens


def test_a_setting_waits_for_the_next_fit_through_a_validate_a_failed_fit_or_a_fit_it_was_set_in(tmp_path):
    """A setting noted on random-LTD is taken by the next fit that reaches its setup: a ``trainer.validate()`` in
    between, a fit that failed before the callback's setup, and the fit during which another callback set it, each
    retook a snapshot that held the unapplied value, and the next fit trained the old setting in silence
    (qa89-break 01, 02, 06; qa89-regress 03)."""
    expected = _layer_tokens(tmp_path / "built", RandomLTDCallback(min_value=4, seq_per_step=4, require_steps=2))
    assert expected != _layer_tokens(tmp_path / "old", RandomLTDCallback(min_value=4, seq_per_step=4))

    ltd = RandomLTDCallback(min_value=4, seq_per_step=4)
    ltd.require_steps = 2
    make_trainer(tmp_path / "v", [ltd], limit_val_batches=1).validate(tiny_gpt2(n_layer=4), tiny_lm_data(batch_size=4))
    assert _layer_tokens(tmp_path / "after_validate", ltd) == expected

    ltd = RandomLTDCallback(min_value=4, seq_per_step=4)
    ltd.require_steps = 2

    broken = tiny_lm_data(batch_size=4)

    def no_data(stage: str) -> None:
        raise RuntimeError("no data here")

    broken.setup = no_data  # the DataModule's setup fails: before the callback's
    with pytest.raises(RuntimeError, match="no data here"):
        make_trainer(tmp_path / "f", [ltd], max_steps=4).fit(tiny_gpt2(n_layer=4), datamodule=broken)
    assert _layer_tokens(tmp_path / "after_failure", ltd) == expected

    ltd = RandomLTDCallback(min_value=4, seq_per_step=4)
    old = _layer_tokens(tmp_path / "old2", RandomLTDCallback(min_value=4, seq_per_step=4))
    # the fit it was set in goes on as it was set up, warned (the value was used at once, unchecked: qa91-break 03)
    with pytest.warns(UserWarning, match=r"RandomLTDCallback.require_steps = 2 was set during a fit: this fit goes on"):
        assert _layer_tokens(tmp_path / "during", ltd, extra=[SetsDuringFit(ltd, require_steps=2)]) == old
    assert changed_settings(ltd) == {"require_steps": 2}
    assert _layer_tokens(tmp_path / "after_during", ltd) == expected


def test_a_setting_equal_to_a_value_the_fit_derived_is_a_setting(tmp_path):
    """``max_value=None`` is derived by a fit (16, the data's length); pinning ``max_value = 16`` afterwards was read
    as nothing set (the value the fit left), and the next fit derived it again (qa89-break 10)."""
    ltd = RandomLTDCallback(min_value=4, seq_per_step=4)
    _fit(tmp_path / "first", ltd)
    assert ltd.max_value == 16 and ltd.max_value_arg is None
    ltd.max_value = 16
    _fit(tmp_path / "second", ltd)
    assert ltd.max_value_arg == 16 and "max_value=16" in repr(ltd)


def test_a_length_set_on_a_vcycle_built_with_a_deprecated_spelling_replaces_it(tmp_path):
    """``VCycleCallback(e_a_steps=1)`` then ``vc.e_a = 3``: the rebuild passed the deprecated e_a_steps beside e_a and
    was refused ("not e_a and e_a_steps", qa89-break 09). The callback records the lengths in the new spelling."""
    with pytest.warns(DeprecationWarning, match="e_a_steps is deprecated"):
        vc = VCycleCallback(e_a_steps=1, e_small=1)
    vc.e_a = 2
    trainer = _fit(tmp_path, vc)
    assert trainer.global_step == 4 and vc.stages == [(1, 2), (2, 1)] and "e_a=2" in repr(vc)
