"""random-LTD from a DeepSpeed config (``data_efficiency.data_routing.random_ltd``): the key translation, its
refusals, and a fit that follows DeepSpeed's schedule (a migrating user had to guess the mapping, qa35-user 07)."""

from __future__ import annotations

import copy
import json
import warnings

import lightning.pytorch as pl
import pytest

from lightning_effi.adapters import GenericAdapter
from lightning_effi.callbacks import RandomLTDCallback
from lightning_effi.curriculum import parse_deepspeed_config as parse_curriculum
from lightning_effi.functional import random_ltd as F
from lightning_effi.random_ltd import parse_deepspeed_config
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import tiny_gpt2, tiny_lm_data

#: Megatron-DeepSpeed's GPT-3 1.3B setting (24 layers, ids 1..22, 128 -> 2048 over 200,000 steps, q 16)
GPT3 = {
    "train_batch_size": 512,
    "data_efficiency": {
        "enabled": True,
        "seed": 1234,
        "data_routing": {
            "enabled": True,
            "random_ltd": {
                "enabled": True,
                "total_layer_num": 24,
                "random_ltd_layer_num": 22,
                "random_ltd_layer_id": list(range(1, 23)),
                "model_mask_name": "attention_mask",
                "model_type": "decoder",
                "hidden_state_order": "seq_batch_dim",
                "random_ltd_schedule": {
                    "min_value": 128,
                    "max_value": 2048,
                    "schedule_type": "fixed_linear",
                    "schedule_config": {"require_steps": 200000, "seq_per_step": 16},
                },
                "layer_token_lr_schedule": {"enabled": False},
            },
        },
    },
}


def block(cfg: dict) -> dict:
    return cfg["data_efficiency"]["data_routing"]["random_ltd"]


def edited(**changes) -> dict:
    cfg = copy.deepcopy(GPT3)
    for key, value in changes.items():
        node, *path = key.split("__")
        target = block(cfg)
        for part in [node, *path][:-1]:
            target = target[part]
        target[[node, *path][-1]] = value
    return cfg


def schedule_config(min_value: int, max_value: int, require_steps: int, seq_per_step: int, **changes) -> dict:
    """The reference config with another fixed_linear schedule, and no model_mask_name / model_type /
    hidden_state_order (their warnings aside)."""
    schedule = {"require_steps": require_steps, "seq_per_step": seq_per_step}
    return edited(
        random_ltd_schedule={"min_value": min_value, "max_value": max_value, "schedule_config": schedule},
        model_mask_name=None,
        model_type=None,
        hidden_state_order=None,
        **changes,
    )


def test_the_reference_gpt3_config_translates_to_the_callbacks_arguments(tmp_path):
    before = copy.deepcopy(GPT3)
    with pytest.warns(UserWarning, match="model_mask_name / model_type / hidden_state_order are not read"):
        args = parse_deepspeed_config(GPT3)
    assert GPT3 == before  # not mutated
    assert args == {
        "layer_ids": list(range(1, 23)),
        "min_value": 128,
        "max_value": 2048,
        "require_steps": 200000,
        "seq_per_step": 16,
    }
    # the same from each level of the config and from a JSON file
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(GPT3))
    routing = GPT3["data_efficiency"]["data_routing"]
    for given in (GPT3["data_efficiency"], routing, block(GPT3), str(path)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert parse_deepspeed_config(given) == args
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        callback = RandomLTDCallback.from_deepspeed_config(GPT3, rounding="deepspeed", seed=3)
    assert (callback.min_value, callback.max_value_arg, callback.seq_per_step) == (128, 2048, 16)
    assert (callback.require_steps_given, callback.layer_ids_arg, callback.rounding) == (
        200000,
        tuple(range(1, 23)),
        "deepspeed",
    )


def test_disabled_gives_none_and_the_callback_refuses_it():
    assert parse_deepspeed_config(edited(enabled=False)) is None
    assert parse_deepspeed_config({"data_efficiency": {"enabled": True}}) is None  # no data_routing at all
    with pytest.raises(ValueError, match="random_ltd.enabled is not true"):
        RandomLTDCallback.from_deepspeed_config(edited(enabled=False))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(bogus_key=1), r"random_ltd: unknown key\(s\) \['bogus_key'\]"),
        (dict(random_ltd_schedule__schedule_type="fixed_root"), "must be 'fixed_linear'.*got 'fixed_root'"),
        (dict(random_ltd_schedule__schedule_config__root_degree=2), r"unknown key\(s\) \['root_degree'\]"),
        (dict(random_ltd_layer_num=20), "random_ltd_layer_num = 20, but random_ltd_layer_id lists 22 layers"),
        (dict(random_ltd_layer_id=[1, 24]), r"random_ltd_layer_id \[24\] outside \[0, total_layer_num=24\)"),
        (dict(layer_token_lr_schedule={"enabled": True}), "layer_token_lr_schedule.enabled: not supported"),
        (dict(random_ltd_schedule={"min_value": 128, "max_value": 2048}), r"missing required key\(s\) \['require"),
        (dict(enabled="false"), "enabled must be a bool"),
    ],
)
def test_what_deepspeed_would_not_run_is_refused(changes, match):
    with pytest.raises(ValueError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parse_deepspeed_config(edited(**changes))


def test_an_override_of_the_configs_values_and_a_config_without_the_block_are_refused():
    with pytest.raises(ValueError, match=r"\['min_value'\] come from the DeepSpeed config"):
        parse_deepspeed_config(GPT3, min_value=64)
    with pytest.raises(ValueError, match="no random-LTD block in the DeepSpeed config"):
        parse_deepspeed_config({"train_batch_size": 8})


def test_rounding_that_differs_from_deepspeeds_warns():
    """ViT-S/16 (32 -> 197, q 8): the default trains 197 from step 3910, DeepSpeed 192 until step 3981 (its value
    goes on growing past require_steps: floor(3982 / 3910 * 165 + 32) = 200, capped at 197); the warning names the
    whole range (it named step 3910 alone, qa90-docs 02)."""
    vit = schedule_config(32, 197, 3910, 8)
    assert [F.ltd_value(s, 32, 197, 3910, 8, "deepspeed") for s in (3909, 3910, 3981, 3982)] == [192, 192, 192, 197]
    assert [F.ltd_value(s, 32, 197, 3910, 8) for s in (3909, 3910)] == [192, 197]
    with pytest.warns(UserWarning, match=r"\(steps 3910-3981: 197 \(DeepSpeed: 192\)\); pass rounding='deepspeed'"):
        parse_deepspeed_config(vit)
    # min 5 is not a multiple of 4: steps 0 and 1 train 5, DeepSpeed 4 (rounded down)
    small = schedule_config(5, 16, 4, 4)
    assert [F.ltd_value(s, 5, 16, 4, 4) for s in range(3)] == [5, 5, 8]
    with pytest.warns(UserWarning, match=r"\(steps 0-1: 5 \(DeepSpeed: 4\)\); pass"):
        parse_deepspeed_config(small)
    # every step differs (min 100 rounds down to 96, max 105 is never a multiple of 16): one run, each step named once
    # (require_steps was in two runs, qa91-break 06), up to the bound on DeepSpeed reaching 105, which it never does
    flat = schedule_config(100, 105, 2000, 16)
    with pytest.warns(UserWarning, match=r"DeepSpeed \(steps 0-4799 \(step 0: 100, DeepSpeed: 96\)\); pass"):
        parse_deepspeed_config(flat)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_deepspeed_config(vit, rounding="deepspeed")["max_value"] == 197


@pytest.mark.parametrize("lo, hi, steps, q", [(32, 197, 391, 8), (173, 773, 400, 1), (5, 16, 4, 4), (100, 105, 50, 16)])
def test_the_warnings_schedules_are_ltd_value_at_every_step(lo, hi, steps, q):
    from lightning_effi.random_ltd.config import _schedules

    clamped, deepspeed = _schedules(lo, hi, steps, q, 0, 3 * steps)
    assert clamped.tolist() == [F.ltd_value(s, lo, hi, steps, q) for s in range(3 * steps)]
    assert deepspeed.tolist() == [F.ltd_value(s, lo, hi, steps, q, "deepspeed") for s in range(3 * steps)]


def test_a_fit_from_a_deepspeed_config_follows_deepspeeds_schedule(tmp_path):
    cfg = schedule_config(5, 16, 4, 4, total_layer_num=4, random_ltd_layer_num=2, random_ltd_layer_id=[1, 2])
    pl.seed_everything(0)
    callback = RandomLTDCallback.from_deepspeed_config(cfg, rounding="deepspeed", seed=7)
    seen = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(callback.current_value)

    make_trainer(tmp_path, [callback, Watch()], max_steps=6, max_epochs=-1).fit(
        tiny_gpt2(n_layer=4), datamodule=tiny_lm_data()
    )
    # DeepSpeed's values: 5 rounded down to 4 at step 0, 16 from step 4 (min 5 is not a multiple of 4)
    assert seen == [F.ltd_value(s, 5, 16, 4, 4, "deepspeed") for s in range(6)] == [4, 4, 8, 12, 16, 16]


def test_a_deepspeed_config_written_for_another_depth_is_refused_in_setup(tmp_path):
    """total_layer_num was checked against the ids only: a 4-layer config trained a 6-layer model, its layers 3 and 4
    never dropping tokens (qa102-nlp 05). setup compares it with the model's depth."""
    cfg = schedule_config(5, 16, 4, 4, total_layer_num=4, random_ltd_layer_num=2, random_ltd_layer_id=[1, 2])
    callback = RandomLTDCallback.from_deepspeed_config(cfg, rounding="deepspeed")
    trainer = make_trainer(tmp_path, [callback], max_steps=1, max_epochs=-1)
    with pytest.raises(
        ValueError,
        match=r"^RandomLTDCallback.from_deepspeed_config: the DeepSpeed config's random_ltd.total_layer_num is 4, but "
        r"the model's HFGPT2Adapter finds 6 layers: its random_ltd_layer_id \[1, 2\] were written for another model",
    ):
        trainer.fit(tiny_gpt2(n_layer=6), datamodule=tiny_lm_data())
    assert trainer.global_step == 0


def test_deepspeeds_hidden_state_order_spellings_and_the_curriculums_pointer():
    assert GenericAdapter("blocks", hidden_state_order="seq_batch_dim").hidden_state_order == "seq_batch"
    assert GenericAdapter("blocks", hidden_state_order="batch_seq_dim").hidden_state_order == "batch_seq"
    with pytest.raises(ValueError, match="hidden_state_order must be"):
        GenericAdapter("blocks", hidden_state_order="seq_first")
    with pytest.warns(UserWarning, match=r"RandomLTDCallback.from_deepspeed_config\(ds_config\)"):
        parse_curriculum(GPT3)


def test_disabled_parents_and_a_misplaced_block_are_refused():
    """DeepSpeed reads random_ltd.enabled alone; a child on under a parent switched off is refused, as the curriculum's
    parser refuses its own, and a data_routing beside the engine keys (ignored by DeepSpeed) too (qa36-break 04)."""
    for parent in ("data_efficiency", "data_routing"):
        cfg = copy.deepcopy(GPT3)
        node = cfg["data_efficiency"] if parent == "data_efficiency" else cfg["data_efficiency"]["data_routing"]
        node["enabled"] = False
        with pytest.raises(ValueError, match=rf"random_ltd.enabled is true but its parent .*{parent}.enabled is not"):
            parse_deepspeed_config(cfg)
    misplaced = {"train_batch_size": 8, "data_routing": GPT3["data_efficiency"]["data_routing"]}
    with pytest.raises(ValueError, match="'data_routing' must sit under 'data_efficiency'"):
        parse_deepspeed_config(misplaced)


def test_dynamic_batching_is_named_by_either_parser():
    """With random-LTD and no curriculum, an enabled dynamic_batching was dropped by both parsers (qa36-break 05)."""
    cfg = copy.deepcopy(GPT3)
    cfg["data_efficiency"]["data_sampling"] = {"enabled": True, "dynamic_batching": {"enabled": True}}
    with pytest.warns(UserWarning, match="dynamic_batching is enabled .* fixed-size batches"):
        assert parse_deepspeed_config(cfg) is not None
    with pytest.raises(ValueError, match="dynamic_batching is enabled, but lightning_effi does not"):
        parse_curriculum(cfg)


def test_the_default_rounding_can_differ_from_deepspeeds_float_at_a_rare_step():
    """All values multiples of seq_per_step, the products exact in clamped and float64 in DeepSpeed: they differ at
    step 226, which the parse now names (qa36-break 08); the reference GPT-3 schedule has no such step."""
    assert F.ltd_value(226, 173, 773, 400, 1) == 512 and F.ltd_value(226, 173, 773, 400, 1, "deepspeed") == 511
    rare = schedule_config(173, 773, 400, 1)
    with pytest.warns(UserWarning, match=r"float64, .*\(step 226: 512 \(DeepSpeed: 511\)"):
        parse_deepspeed_config(rare)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_deepspeed_config(edited(model_mask_name=None, model_type=None, hidden_state_order=None))


def test_layer_ids_as_deepspeed_reads_them():
    """DeepSpeed sorts random_ltd_layer_id; a count that is not an int is refused as such (qa36-break notes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert parse_deepspeed_config(edited(random_ltd_layer_id=[3, 1, 2], random_ltd_layer_num=3))["layer_ids"] == [
            1,
            2,
            3,
        ]
        with pytest.raises(ValueError, match="random_ltd_layer_num must be an int"):
            parse_deepspeed_config(edited(random_ltd_layer_num=22.0))
        with pytest.raises(ValueError, match="lists a layer twice"):
            parse_deepspeed_config(edited(random_ltd_layer_id=[1, 1], random_ltd_layer_num=2))
