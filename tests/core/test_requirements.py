"""Requirements as data: every technique declares them, and one setup-time check rules on the Trainer."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch import Callback

import lightning_effi
from lightning_effi.core.requirements import (
    IncompatibleTechniques,
    Requirements,
    check_trainer,
    technique_callbacks,
)

TECHNIQUES = {
    "InfoBatchCallback": "infobatch",
    "Curriculum": "curriculum",
    "RandomLTDCallback": "random_ltd",
    "VCycleCallback": "vcycle",
}


def _fake(name: str, **req) -> Callback:
    return type(name, (Callback,), {"requirements": Requirements(**req)})()


class SingleDeviceStrategy:  # stands for Lightning's class of that name (matched by name)
    pass


def _trainer(*callbacks, strategy=SingleDeviceStrategy):
    return SimpleNamespace(callbacks=list(callbacks), strategy=strategy())


def test_every_technique_declares_requirements():
    for name in TECHNIQUES:
        cls = getattr(lightning_effi, name)
        assert isinstance(getattr(cls, "requirements", None), Requirements), f"{name} declares no requirements"


def test_declarations_are_checked():
    with pytest.raises(TypeError, match="owns_train_sampler must be a bool"):
        Requirements(owns_train_sampler="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"batch_structures: unknown \['ragged'\]"):
        Requirements(batch_structures=("dict", "ragged"))


def test_two_samplers_are_refused_naming_both():
    a = _fake("SamplerA", owns_train_sampler=True)
    b = _fake("SamplerB", owns_train_sampler=True)
    with pytest.raises(
        IncompatibleTechniques,
        match=r"SamplerA and SamplerB cannot be combined \(two training "
        r"samplers\).*use one of them",
    ):
        check_trainer(_trainer(a, Callback(), b))


def test_patching_across_shape_changes_is_refused_in_either_order():
    shapes = _fake("Shapes", changes_model_shapes=True)
    patch = _fake("Patch", patches_layers=True)
    for order in ((shapes, patch), (patch, shapes)):
        with pytest.raises(IncompatibleTechniques, match="layer patching across shape changes.*does not re-bind"):
            check_trainer(_trainer(*order))
    follower = _fake("Follower", patches_layers=True, follows_model_changes=True)
    for order in ((shapes, follower), (follower, shapes)):
        check_trainer(_trainer(*order))


def test_a_thinning_sampler_composes_with_an_ordering_one():
    order = _fake("Order", owns_train_sampler=True, hosts_thinning=True)
    thin = _fake("Thin", owns_train_sampler=True, thins_within_sampler=True)
    with pytest.raises(IncompatibleTechniques, match=r"cannot be combined \(two training samplers\)"):
        check_trainer(_trainer(thin, _fake("NoHost", owns_train_sampler=True)))  # a sampler that takes no thinner
    for pair in ((order, thin), (thin, order)):
        check_trainer(_trainer(*pair))
    for a, b in (
        (order, _fake("Order2", owns_train_sampler=True)),
        (thin, _fake("Thin2", owns_train_sampler=True, thins_within_sampler=True)),
    ):
        with pytest.raises(IncompatibleTechniques, match=r"cannot be combined \(two training samplers\)"):
            check_trainer(_trainer(a, b))


@pytest.mark.parametrize(
    "flag, rule", [("changes_model_shapes", "two shape changes"), ("patches_layers", "two layer patchers")]
)
def test_a_technique_twice_is_refused(flag, rule):
    with pytest.raises(IncompatibleTechniques, match=rf"A and B cannot be combined \({rule}\)"):
        check_trainer(_trainer(_fake("A", **{flag: True}), _fake("B", **{flag: True})))


def test_compatible_techniques_pass():
    check_trainer(
        _trainer(_fake("A", owns_train_sampler=True), _fake("B", patches_layers=True), _fake("C", edits_batch=True))
    )
    assert [type(c).__name__ for c in technique_callbacks([Callback(), _fake("A")])] == ["A"]


def test_strategy_and_callback_declarations():
    only_ddp = _fake("OnlyDDP", strategies=("DDPStrategy",), strategy_note="Use one fit per stage.")
    with pytest.raises(
        IncompatibleTechniques,
        match=r"OnlyDDP supports the strategies \['DDPStrategy'\], not SingleDeviceStrategy. Use one",
    ):
        check_trainer(_trainer(only_ddp))

    class DDPStrategy:
        pass

    class MyDDP(DDPStrategy):  # a subclass of a supported strategy is supported ...
        pass

    class DeepSpeedStrategy(DDPStrategy):  # ... unless refused by name
        pass

    check_trainer(_trainer(only_ddp, strategy=MyDDP))
    any_but_ds = _fake("AnyButDS", refused_strategies=("DeepSpeedStrategy",))
    check_trainer(_trainer(any_but_ds, strategy=MyDDP))
    with pytest.raises(IncompatibleTechniques, match="AnyButDS does not support the DeepSpeedStrategy strategy"):
        check_trainer(_trainer(any_but_ds, strategy=DeepSpeedStrategy))
    no_ds = _fake("NoDS", strategies=("DDPStrategy",), refused_strategies=("DeepSpeedStrategy",))
    with pytest.raises(IncompatibleTechniques, match=r"NoDS supports the strategies \['DDPStrategy'\], not Deep"):
        check_trainer(_trainer(no_ds, strategy=DeepSpeedStrategy))
    picky = _fake("Picky", incompatible_callbacks=(("EarlyStopping", "it stops mid-stage"),))
    from lightning.pytorch.callbacks import EarlyStopping

    class MyStopping(EarlyStopping):  # subclasses are refused too
        pass

    with pytest.raises(
        IncompatibleTechniques,
        match="Picky cannot run with MyStopping \\(subclass of EarlyStopping\\): it stops mid-stage",
    ):
        check_trainer(_trainer(picky, MyStopping(monitor="x")))


def test_shipped_techniques_today():
    """The shipped rules, through check_trainer: every pair of the four techniques passes, in both orders (each class
    stands in with its declared requirements); each technique twice is refused."""

    def stand_in(name):
        return _fake(
            name,
            **{
                k: v
                for k, v in getattr(lightning_effi, name).requirements.as_dict().items()
                if k not in ("strategies", "refused_strategies", "strategy_note")
            },
        )

    refused = set()
    names = list(TECHNIQUES)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for order in ((a, b), (b, a)):
                try:
                    check_trainer(_trainer(*(stand_in(n) for n in order)))
                except IncompatibleTechniques as err:
                    assert a in str(err) and b in str(err)
                    refused.add((a, b))
    assert refused == set()
    for name in names:
        with pytest.raises(IncompatibleTechniques, match="cannot be combined"):
            check_trainer(_trainer(stand_in(name), stand_in(name)))


@pytest.mark.parametrize("name", list(TECHNIQUES))
def test_metadata_json_matches_the_declaration(name):
    folder = Path(lightning_effi.__file__).parent / TECHNIQUES[name]
    meta = json.loads((folder / "metadata.json").read_text())
    declared = json.loads(json.dumps(getattr(lightning_effi, name).requirements.as_dict()))
    assert meta["requirements"] == declared
    assert meta["class_name"] == name
    assert (Path(lightning_effi.__file__).parent.parent / meta["card"]).is_file()
