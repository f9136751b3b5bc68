"""Bad inputs to the curriculum's configuration (``parse_deepspeed_config``, ``MetricConfig``) and its functional core
(``dp_slice``, ``eligible_end``, ``reshape_batch``) refused at once, naming the key and what is allowed (issue #21);
the valid inputs next to them still accepted with their exact values."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from lightning_effi.curriculum import functional as F
from lightning_effi.curriculum.config import (
    CurriculumConfig,
    CurriculumConfigError,
    MetricConfig,
    parse_deepspeed_config,
)

TRUNC: dict[str, Any] = dict(
    difficulty_type="value",
    clustering_type="single_cluster",
    min_difficulty=8,
    max_difficulty=16,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=6, difficulty_step=4),
)


def ds_config(enabled: Any = True, de: Any = True, dsamp: Any = True) -> dict[str, Any]:
    return {
        "train_batch_size": 4,
        "data_efficiency": {
            "enabled": de,
            "seed": 1234,
            "data_sampling": {
                "enabled": dsamp,
                "num_epochs": 1000,
                "curriculum_learning": {
                    "enabled": enabled,
                    "data_cluster_path": "/tmp/data_clusters",
                    "curriculum_metrics": {"seqlen_truncate": dict(TRUNC)},
                },
            },
        },
    }


# ------------------------------------------------------------------------------------------ parse_deepspeed_config
@pytest.mark.parametrize("flag", ["enabled", "de", "dsamp"])
@pytest.mark.parametrize("value", ["false", "true", None, 1])
def test_enabled_must_be_a_bool(flag, value):
    section = {
        "enabled": "data_efficiency.data_sampling.curriculum_learning",
        "de": "data_efficiency",
        "dsamp": "data_efficiency.data_sampling",
    }[flag]
    with pytest.raises(CurriculumConfigError, match=rf"{section}\.enabled must be a bool .*got {value!r}"):
        parse_deepspeed_config(ds_config(**{flag: value}))


def test_enabled_bools_and_numpy_bools_parse():
    cfg = parse_deepspeed_config(ds_config(enabled=np.bool_(True)))
    assert cfg is not None and list(cfg.metrics) == ["seqlen_truncate"] and cfg.seed == 1234
    assert parse_deepspeed_config(ds_config(enabled=False)) is None
    missing = ds_config()
    del missing["data_efficiency"]["data_sampling"]["curriculum_learning"]["enabled"]  # DeepSpeed's default: off
    assert parse_deepspeed_config(missing) is None


def test_random_ltd_in_the_deepspeed_config_is_named_not_dropped():
    cfg = ds_config()
    cfg["data_efficiency"]["data_routing"] = {"enabled": True, "random_ltd": {"enabled": True}}
    before = copy.deepcopy(cfg)
    with pytest.warns(UserWarning, match=r"data_routing\.random_ltd .*RandomLTDCallback"):
        parsed = parse_deepspeed_config(cfg)
    assert parsed is not None and cfg == before  # the curriculum is still parsed; the input is not mutated
    cfg["data_efficiency"]["data_routing"]["random_ltd"]["enabled"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a disabled random-LTD block: nothing to say
        parse_deepspeed_config(cfg)


def test_typos_in_data_routing_and_in_the_options_and_a_whole_deepspeed_config_as_metrics_are_named():
    """A typo under data_routing is refused like one anywhere else (it was accepted silently); a typo in an option
    override lists the options (it was a raw TypeError); a whole DeepSpeed config passed as the metrics names the
    block to pass instead."""
    cfg = ds_config()
    cfg["data_efficiency"]["data_routing"] = {"enabled": True, "randm_ltd": {"enabled": True}}
    with pytest.raises(CurriculumConfigError, match=r"data_routing: unknown key\(s\) \['randm_ltd'\]; allowed: \["):
        parse_deepspeed_config(cfg)
    with pytest.raises(CurriculumConfigError, match=r"unknown option\(s\) \['dp_splt'\]; allowed: \[.*'dp_split'"):
        parse_deepspeed_config(ds_config(), dp_splt="balanced")
    assert parse_deepspeed_config(ds_config(), dp_split="deepspeed").dp_split == "deepspeed"
    with pytest.raises(CurriculumConfigError, match=r"got a DeepSpeed config \(keys \['data_efficiency', 'train_batch"):
        CurriculumConfig(metrics=ds_config())


# --------------------------------------------------------------------------------------------------- MetricConfig
def metric(**changes: Any) -> MetricConfig:
    return MetricConfig.from_dict("seqlen_truncate", {**TRUNC, **changes})


@pytest.mark.parametrize("value", [[6, 4], "fixed", 3])
def test_schedule_config_must_be_a_dict(value):
    with pytest.raises(CurriculumConfigError, match=r"seqlen_truncate\.schedule_config must be a dict"):
        metric(schedule_config=value)


def test_difficulty_step_above_max_difficulty_is_refused():
    with pytest.raises(CurriculumConfigError, match=r"difficulty_step \(64\) must be <= max_difficulty \(16\)"):
        metric(schedule_config=dict(total_curriculum_step=6, difficulty_step=64))
    with pytest.raises(CurriculumConfigError, match="difficulty_step"):  # through the callback's config too
        CurriculumConfig(
            metrics={
                "seqlen_truncate": {**TRUNC, "schedule_config": {**TRUNC["schedule_config"], "difficulty_step": 17}}
            }
        )
    assert metric(schedule_config=dict(total_curriculum_step=6, difficulty_step=16)).schedule("clamped")(6) == 16


def test_a_value_metric_of_negative_difficulties_takes_a_step_within_its_width():
    """Negated scores (-log-likelihood): [-400, -1] with difficulty_step 1 was refused as "must be <= max_difficulty
    (-1)", although every int is a multiple of 1 (qa32-break 02). A range at or below 0 now needs a step within its
    width, and its schedule grows from min_difficulty to max_difficulty."""
    value = dict(
        difficulty_type="value", clustering_type="schedule_based", schedule_type="fixed_linear", analysis="seqlen"
    )
    for hi in (-1, 0):
        config = dict(value, min_difficulty=-400, max_difficulty=hi)
        schedule = MetricConfig.from_dict(
            "score", {**config, "schedule_config": dict(total_curriculum_step=4, difficulty_step=1)}
        ).schedule("clamped")
        assert [schedule(step) for step in range(5)] == [
            -400,
            -400 + (hi + 400) // 4,
            -400 + (hi + 400) // 2,
            -400 + 3 * (hi + 400) // 4,
            hi,
        ]
    # a range across 0 too: multiples of 100 from -300 up, then max_difficulty (it was refused, qa33-break 09)
    across = {**value, "min_difficulty": -300, "max_difficulty": 80}
    schedule = MetricConfig.from_dict(
        "score", {**across, "schedule_config": dict(total_curriculum_step=10, difficulty_step=100)}
    ).schedule("clamped")
    assert [schedule(step) for step in range(11)] == [-300] * 3 + [-200] * 3 + [-100] * 2 + [0] * 2 + [80]
    with pytest.raises(CurriculumConfigError, match=r"difficulty_step \(500\) must be <= the range's width \(399\)"):
        MetricConfig.from_dict(
            "score",
            {
                **value,
                "min_difficulty": -400,
                "max_difficulty": -1,
                "schedule_config": dict(total_curriculum_step=4, difficulty_step=500),
            },
        )


@pytest.mark.parametrize(
    "difficulty, max_step, match",
    [
        ([16, 12, 8], [2, 4], r"difficulty must be non-decreasing, got \[16, 12, 8\] \(difficulty\[1\] = 12 after"),
        ([8, 16, 12], [2, 4], r"difficulty\[2\] = 12 after difficulty\[1\] = 16"),
        ([8, 12, 16], [4, 2], r"max_step must be strictly ascending"),
        ([8, 16], [2, 4], r"len\(difficulty\) == len\(max_step\) \+ 1"),
        ([], [], r"non-empty lists"),
    ],
)
def test_fixed_discrete_lists_in_order_and_of_matching_sizes(difficulty, max_step, match):
    with pytest.raises(CurriculumConfigError, match=match):
        metric(schedule_type="fixed_discrete", schedule_config={"difficulty": difficulty, "max_step": max_step})


def test_fixed_discrete_non_decreasing_lists_run_as_given():
    m = metric(schedule_type="fixed_discrete", schedule_config={"difficulty": [8, 8, 16], "max_step": [2, 4]})
    assert [m.schedule("clamped")(s) for s in range(7)] == [8, 8, 8, 8, 8, 16, 16]


# ------------------------------------------------------------------------------------------------ functional core
def test_dp_slice_refuses_a_rank_outside_the_group_and_an_empty_group():
    with pytest.raises(ValueError, match=r"dp_slice\.rank must be an int >= 0 and <= 1, got 5"):
        F.dp_slice(8, 2, 5)
    with pytest.raises(ValueError, match=r"dp_slice\.dp_size must be an int >= 1, got 0"):
        F.dp_slice(8, 0, 0)
    with pytest.raises(ValueError, match=r"dp_slice\.length must be an int >= 0"):
        F.dp_slice(-1, 2, 0)
    # the shares of every rank tile [0, length) exactly (numpy ints accepted)
    for mode in F.DP_SPLITS:
        shares = [F.dp_slice(np.int64(11), 3, r, mode) for r in range(3)]
        assert shares[0][0] == 0 and shares[-1][1] == 11
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    assert [F.dp_slice(11, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 11)]


def test_eligible_end_refuses_a_percentile_above_max_difficulty():
    kw = dict(difficulty_type="percentile", num_samples=40, max_difficulty=100)
    with pytest.raises(ValueError, match=r"percentile difficulty 150 is above max_difficulty 100"):
        F.eligible_end(150, **kw)
    with pytest.raises(ValueError, match=r"eligible_end\.difficulty must be an int, got 2\.5"):
        F.eligible_end(2.5, **kw)
    with pytest.raises(ValueError, match=r"eligible_end\.max_difficulty must be an int >= 1, got 0"):
        F.eligible_end(0, difficulty_type="percentile", num_samples=40, max_difficulty=0)
    assert F.eligible_end(100, **kw) == 40 and F.eligible_end(50, **kw) == 0  # deepspeed rounding: 40 // 100 = 0
    assert F.eligible_end(np.int64(50), **{**kw, "percentile_rounding": "proportional"}) == 20


def test_reshape_batch_needs_an_int_difficulty_and_rechunks_any_one():
    x = torch.arange(16).view(2, 8)
    for bad in (2.5, True, 0, "2"):
        with pytest.raises(ValueError, match=r"seqlen_reshape: difficulty must be an int >= 1 token"):
            F.reshape_batch({"input_ids": x}, bad)
    rows = F.reshape_batch(x, np.int64(2))  # d + 1 = 3 does not divide 8: Megatron's extra rows of the last 3
    assert rows.tolist() == [[0, 1, 2], [3, 4, 5], [8, 9, 10], [11, 12, 13], [5, 6, 7], [13, 14, 15]]


# ------------------------------------------------------------------------------------------ metrics that do nothing
@pytest.mark.parametrize(
    "name, meant",
    [
        ("seqlen_truncat", "seqlen_truncate"),
        ("seqlen-truncate", "seqlen_truncate"),
        ("Seqlen_Reshape", "seqlen_reshape"),
    ],
)
def test_a_near_miss_of_a_transform_metric_is_refused_naming_it(name, meant):
    """A misspelt ``seqlen_truncate`` is a single_cluster metric that filters nothing and changes no batch: the run
    trained every batch at full length with tokens_saved_frac 0 and no warning. Refused, with the intended name."""
    with pytest.raises(
        CurriculumConfigError,
        match=rf"^curriculum_metrics\.{name}: not a metric name the curriculum "
        rf"acts on; did you mean '{meant}'\? .* so '{name}' would train every batch as the plain loader",
    ):
        CurriculumConfig(metrics={name: dict(TRUNC)})


def test_a_curriculum_whose_metrics_change_nothing_warns():
    """Only single_cluster metrics other than the two transforms: the run is the plain loader's, with a warning
    naming them; one transform or one schedule_based metric beside them changes training, so no warning."""
    with pytest.warns(UserWarning, match=r"^curriculum: no metric changes training: seqlen, mine are single_cluster "):
        CurriculumConfig(metrics={"seqlen": dict(TRUNC), "mine": dict(TRUNC)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = CurriculumConfig(metrics={"seqlen_truncate": dict(TRUNC), "mine": dict(TRUNC)})
    assert set(cfg.metrics) == {"seqlen_truncate", "mine"}


def test_a_parsed_deepspeed_config_builds_the_callback_with_all_its_settings():
    """parse_deepspeed_config returned a CurriculumConfig that neither Curriculum nor CurriculumDataModule took:
    ``Curriculum(cfg)`` was refused, ``Curriculum(**asdict(cfg))`` failed, and ``Curriculum(metrics=cfg.metrics,
    seed=cfg.seed)`` dropped the other options. ``Curriculum.from_config`` keeps every setting."""
    from lightning_effi.callbacks import Curriculum

    cfg = parse_deepspeed_config(ds_config(), rounding="deepspeed", dp_split="deepspeed")
    assert cfg is not None
    cb = Curriculum.from_config(cfg, total_tokens=1000, strict=False)
    assert cb.config == cfg and cb.total_tokens == 1000 and cb.strict is False
    with pytest.raises(CurriculumConfigError, match=r"from_config: \['seed'\] are the config's"):
        Curriculum.from_config(cfg, seed=3)
    with pytest.raises(CurriculumConfigError, match=r"expected a CurriculumConfig, got NoneType .*disabled"):
        Curriculum.from_config(parse_deepspeed_config(ds_config(enabled=False)))
