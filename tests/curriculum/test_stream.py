"""The curriculum stream without a Trainer: length, clusters, multi-metric semantics, DP sharding, commit/resume,
configuration strictness (DeepSpeed ``data_efficiency`` keys)."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

from lightning_effi.curriculum import (
    CurriculumConfig,
    CurriculumConfigError,
    CurriculumController,
    CurriculumStream,
    parse_deepspeed_config,
)
from lightning_effi.curriculum.analysis.index import MetricIndex

TRUNC = dict(
    difficulty_type="value",
    clustering_type="single_cluster",
    min_difficulty=4,
    max_difficulty=16,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=10, difficulty_step=4),
)


def pct_metric(total=12, lo=10, q=10):
    return dict(
        difficulty_type="percentile",
        clustering_type="schedule_based",
        analysis="seqlen",
        min_difficulty=lo,
        max_difficulty=100,
        schedule_type="fixed_linear",
        schedule_config=dict(total_curriculum_step=total, difficulty_step=q),
    )


def value_metric(lo, hi, total):
    return dict(
        difficulty_type="value",
        clustering_type="schedule_based",
        analysis="seqlen",
        min_difficulty=lo,
        max_difficulty=hi,
        schedule_type="fixed_linear",
        schedule_config=dict(total_curriculum_step=total, difficulty_step=1),
    )


def controller(metrics, n=64, values=None, mbs=4, dp=1, rank=0, ga=1, **opts):
    opts.setdefault("percentile_rounding", "proportional")  # N < 100: deepspeed rounding selects nothing below p=100
    config = CurriculumConfig(metrics=metrics, **opts)
    rng = np.random.default_rng(0)
    indexes = {}
    for name, m in config.metrics.items():
        if m.schedule_based:
            v = values[name] if values and name in values else rng.integers(0, 50, n)
            indexes[name] = MetricIndex.from_sample_to_metric(v)
    return CurriculumController(config, indexes, n, mbs, dp, rank, ga)


def drain(c: CurriculumController, commit: bool = True) -> list[list[tuple]]:
    out = []
    for batch in c.micro_batches():
        out.append(batch)
        if commit:
            c.commit(batch[0][1], batch[0][2])
    return out


def test_length_and_budget():
    c = controller({"seqlen_truncate": TRUNC}, n=64, mbs=4, dp=2, num_epochs=1)
    assert len(c) == 8
    per_rank = [
        drain(controller({"seqlen_truncate": TRUNC}, n=64, mbs=4, dp=2, rank=r, num_epochs=1)) for r in range(2)
    ]
    assert [len(b) for b in per_rank] == [8, 8]
    assert sum(len(mb) for rank in per_rank for mb in rank) == 64  # no extra batch (DeepSpeed's <=)
    assert drain(c) and list(c.micro_batches()) == []  # budget spent


def test_budget_with_short_final_chunk():
    c = controller({"seqlen_truncate": TRUNC}, n=10, mbs=4, num_epochs=1)
    sizes = [len(b) for b in drain(c)]
    assert sizes == [4, 4, 2] and len(controller({"seqlen_truncate": TRUNC}, n=10, mbs=4, num_epochs=1)) == 3
    c = controller({"seqlen_truncate": TRUNC}, n=10, mbs=4, num_epochs=1, drop_last=True)
    assert len(c) == 2 and [len(b) for b in drain(c)] == [4, 4] and len(c) == 0
    with pytest.raises(CurriculumConfigError, match="drop_last"):
        controller({"seqlen_truncate": TRUNC}, n=9, mbs=4, dp=2, num_epochs=1)  # last chunk of 1 for 2 ranks


def test_data_epochs_continue_the_stream():
    c = controller({"seqlen_truncate": TRUNC}, n=20, mbs=4)
    assert len(c) == 5
    first, second = drain(c), drain(c)
    assert [b[0][1] for b in first] == [1, 2, 3, 4, 5] and [b[0][1] for b in second] == [6, 7, 8, 9, 10]


def test_difficulty_attached_to_keys():
    c = controller({"seqlen_truncate": TRUNC}, n=64, mbs=4)
    sched = c.config.metrics["seqlen_truncate"].schedule("clamped")
    for batch in drain(c)[:12]:
        step = batch[0][1]
        assert batch[0][3] == (max(4, min(16, sched(step))),) or batch[0][3] == (sched(step),)


def test_single_metric_clusters_follow_the_schedule():
    values = np.arange(40) % 10  # 4 samples per value 0..9
    c = controller({"m": value_metric(2, 9, 7)}, n=40, values={"m": values}, mbs=4)
    stream = CurriculumStream(c.config, c.book, c.total_samples, c.global_batch)
    seen = []
    for _ in range(12):
        gb = stream.next_global_batch()
        d = gb.difficulties[0]
        assert set(values[gb.ids]) <= set(range(d + 1))  # only eligible samples
        assert sum(len(x) for x in stream.clusters) == int((values <= d).sum())
        seen.append(d)
    assert seen[0] == 3 and seen[-1] == 9  # step 1: floor(1/7 * 7 + 2)


def test_multi_metric_intersection_invariants():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 20, 200), rng.integers(0, 7, 200)
    metrics = {"a": value_metric(5, 19, 9), "b": pct_metric(total=9, lo=20, q=10)}
    c = controller(metrics, n=200, values={"a": a, "b": b}, mbs=5)
    stream = CurriculumStream(c.config, c.book, c.total_samples, c.global_batch)
    b_index = c.indexes["b"]
    last = None
    for _ in range(12):
        gb = stream.next_global_batch()
        da, db = gb.difficulties
        if (da, db) == last:
            continue
        last = (da, db)
        union = np.concatenate(stream.clusters)
        assert len(union) == len(set(union.tolist()))  # pairwise disjoint
        expected = set(np.flatnonzero(a <= da).tolist()) & set(
            b_index.ids[: (200 // 100) * db if db < 100 else 200].tolist()
        )
        assert set(union.tolist()) == expected
        assert set(gb.ids.tolist()) <= expected


def test_empty_first_eligible_set_raises_at_construction():
    values = np.full(30, 7)
    with pytest.raises(CurriculumConfigError, match=r"m \(value\) at difficulty 3: 0 eligible.*N = 30|N = 30.*m \("):
        controller({"m": value_metric(3, 9, 5)}, n=30, values={"m": values})
    with pytest.raises(CurriculumConfigError, match=r"p \(percentile\) at difficulty 9: 0 eligible"):
        controller({"p": pct_metric(lo=1, q=1)}, n=30, percentile_rounding="deepspeed")  # spp = 30 // 100 = 0
    a, b = np.arange(30), np.arange(30)[::-1].copy()
    with pytest.raises(CurriculumConfigError, match="intersection"):
        controller({"a": value_metric(5, 29, 5), "b": value_metric(5, 29, 5)}, n=30, values={"a": a, "b": b})


def test_ranks_share_global_batches_and_cover_each_chunk():
    metrics = {"p": pct_metric(), "seqlen_truncate": TRUNC}
    ranks = [drain(controller(metrics, n=96, mbs=3, dp=2, rank=r, ga=2, seed=5)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1])
    single = drain(controller(metrics, n=96, mbs=6, dp=1, rank=0, ga=2, seed=5))  # same global batches
    for mb0, mb1, whole in zip(ranks[0], ranks[1], single):
        ids0, ids1 = [k[0] for k in mb0], [k[0] for k in mb1]
        assert ids0 + ids1 == [k[0] for k in whole] and {k[1:] for k in mb0 + mb1} == {whole[0][1:]}


def test_resume_from_committed_positions_continues_the_stream():
    metrics = {"p": pct_metric(total=20, lo=10, q=10), "seqlen_truncate": TRUNC}
    make = lambda: controller(metrics, n=30, mbs=2, ga=2, seed=9)  # noqa: E731  (N=30: clusters reshuffle often)
    reference = make()
    stream = [b for _ in range(6) for b in drain(reference)]
    assert len(stream) > 60
    for cut in (1, 2, 7, 15, 16, 31, 44):
        a = make()
        got = []
        while len(got) < cut:  # consume `cut` micro-batches, with an iterator that ran ahead
            it = a.micro_batches()
            for b in it:
                got.append(b)
                a.commit(b[0][1], b[0][2])
                if len(got) == cut:
                    break
        state = copy.deepcopy(a.state_dict())
        b = make()
        b.load_state_dict(state)
        b.load_state_dict(state)  # idempotent
        rest = []
        while len(got) + len(rest) < len(stream):
            rest.extend(drain(b))
        assert got + rest == stream, cut


def test_load_after_iteration_started_is_idempotent():
    metrics = {"p": pct_metric()}
    a = controller(metrics, n=40)
    drain(a)
    state = copy.deepcopy(a.state_dict())
    expected = drain(a)
    b = controller(metrics, n=40)
    it = b.micro_batches()
    next(it), next(it)  # drawn but never committed
    b.load_state_dict(state)
    assert drain(b) == expected


def test_prefetched_batches_are_not_committed():
    a = controller({"p": pct_metric()}, n=40)
    it = a.micro_batches()
    first = next(it)
    a.commit(first[0][1], first[0][2])
    next(it), next(it)  # prefetched, not trained on
    b = controller({"p": pct_metric()}, n=40)
    b.load_state_dict(a.state_dict())
    assert next(b.micro_batches())[0][1] == 2


def test_load_with_other_configuration_raises():
    a = controller({"p": pct_metric()}, n=40, seed=1)
    drain(a)
    b = controller({"p": pct_metric()}, n=40, seed=2)
    with pytest.raises(CurriculumConfigError, match="another configuration"):
        b.load_state_dict(a.state_dict())
    with pytest.warns(UserWarning, match="strict=False"):
        b.load_state_dict(a.state_dict(), strict=False)


@pytest.mark.parametrize("strict", [True, False])
def test_load_on_another_training_set_size_is_refused_whatever_strict(strict):
    """The stream's clusters and position index the samples: strict=False (offered for other settings) cannot
    resume it over another N (it failed later, on clusters "not rebuilt from the analysis index")."""
    a = controller({"p": pct_metric()}, n=40)
    drain(a)
    b = controller({"p": pct_metric()}, n=32)
    with pytest.raises(CurriculumConfigError) as err:
        b.load_state_dict(a.state_dict(), strict=strict)
    assert str(err.value).startswith(
        "Curriculum: the checkpoint's stream is over a training set of 40 samples, this fit's has 32: the stream's "
        "clusters and position index the samples, so it cannot resume on another training set (strict=False does "
        "not apply)"
    )


def test_state_is_plain_python():
    a = controller({"p": pct_metric(), "seqlen_truncate": TRUNC}, n=40)
    drain(a)
    allowed = (int, float, str, bool, type(None))

    def walk(x):
        if isinstance(x, dict):
            assert all(isinstance(k, str) for k in x)
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            assert isinstance(x, allowed), type(x)

    walk(a.state_dict())
    s = a.state_dict()
    assert s["committed_micro"] == len(a) and s["consumed_samples"] == len(a) * 4


# ------------------------------------------------------------------------------------------- configuration
DS = {
    "train_batch_size": 8,
    "data_efficiency": {
        "enabled": True,
        "seed": 7,
        "data_sampling": {
            "enabled": True,
            "num_epochs": 2,
            "curriculum_learning": {
                "enabled": True,
                "data_cluster_path": "/tmp/clusters",
                "curriculum_metrics": {
                    "vocabularyrarity": {
                        "index_to_sample_path": "a",
                        "index_to_metric_path": "b",
                        "difficulty_type": "percentile",
                        "clustering_type": "schedule_based",
                        "min_difficulty": 1,
                        "max_difficulty": 100,
                        "schedule_type": "fixed_root",
                        "schedule_config": {"total_curriculum_step": 110000, "difficulty_step": 1, "root_degree": 2},
                    }
                },
            },
        },
    },
}


def test_parse_deepspeed_config():
    before = copy.deepcopy(DS)
    cfg = parse_deepspeed_config(DS, rounding="deepspeed")
    assert DS == before  # not mutated
    assert cfg.seed == 7 and cfg.num_epochs == 2 and cfg.rounding == "deepspeed"
    m = cfg.metrics["vocabularyrarity"]
    assert m.schedule("deepspeed")(27500) == 50 and m.index_to_sample_path == "a"


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: d["data_efficiency"].update(bogus=1), "unknown key"),
        (lambda d: d.update(data_sampling={"enabled": True}), "must sit under 'data_efficiency'"),
        (lambda d: d.update(curriculum_learning={"enabled": True, "curriculum_type": "seqlen"}), "legacy top-level"),
        (
            lambda d: d["data_efficiency"]["data_sampling"]["curriculum_learning"]["curriculum_metrics"][
                "vocabularyrarity"
            ].pop("schedule_config"),
            "missing required key",
        ),
        (
            lambda d: d["data_efficiency"]["data_sampling"]["curriculum_learning"]["curriculum_metrics"][
                "vocabularyrarity"
            ]["schedule_config"].pop("root_degree"),
            "root_degree",
        ),
        (
            lambda d: d["data_efficiency"]["data_sampling"]["curriculum_learning"]["curriculum_metrics"][
                "vocabularyrarity"
            ].update(schedule_type="cosine"),
            "schedule_type must be one of",
        ),
        (lambda d: d["data_efficiency"]["data_sampling"].update(enabled=False), "parent data_sampling.enabled"),
        (
            lambda d: d["data_efficiency"]["data_sampling"]["curriculum_learning"]["curriculum_metrics"][
                "vocabularyrarity"
            ].update(min_difficulty=200),
            "min_difficulty \\(200\\) > max_difficulty",
        ),
    ],
)
def test_deepspeed_config_errors(edit, match):
    d = copy.deepcopy(DS)
    edit(d)
    before = copy.deepcopy(d)
    with pytest.raises(CurriculumConfigError, match=match):
        parse_deepspeed_config(d)
    assert d == before


def test_disabled_curriculum_parses_to_none():
    d = copy.deepcopy(DS)
    d["data_efficiency"]["data_sampling"]["curriculum_learning"]["enabled"] = False
    assert parse_deepspeed_config(d) is None


@pytest.mark.parametrize(
    "metric,match",
    [
        (dict(TRUNC, bogus=1), "unknown key"),
        # a callback argument in the metric's dict names where it goes (qa43-user 04)
        (
            dict(TRUNC, percentile_rounding="proportional"),
            r"unknown key\(s\) \['percentile_rounding'\].*an argument of Curriculum\(\.\.\.\), for every metric",
        ),
        (dict(TRUNC, min_difficulty=4.0), "min_difficulty must be an int"),
        (dict(TRUNC, clustering_type="schedule_based"), "single_cluster"),
        ({k: v for k, v in TRUNC.items() if k != "difficulty_type"}, "missing required key"),
        (dict(TRUNC, difficulty_type="rank"), "difficulty_type must be one of"),
    ],
)
def test_metric_config_errors(metric, match):
    with pytest.raises(CurriculumConfigError, match=match):
        CurriculumConfig(metrics={"seqlen_truncate": metric})


def test_schedule_based_needs_an_index_source():
    m = {k: v for k, v in pct_metric().items() if k != "analysis"}
    with pytest.raises(CurriculumConfigError, match="index_to_sample_path"):
        CurriculumConfig(metrics={"p": m})
    with pytest.raises(CurriculumConfigError, match="index_to_metric_path"):
        CurriculumConfig(metrics={"v": dict(value_metric(1, 5, 5), analysis=None, index_to_sample_path="x")})
    with pytest.raises(CurriculumConfigError, match="rounding"):
        CurriculumConfig(metrics={"seqlen_truncate": TRUNC}, rounding="up")
    with pytest.raises(CurriculumConfigError, match="at least one metric"):
        CurriculumConfig(metrics={})
    with pytest.raises(CurriculumConfigError, match=r"expected a mapping of metric name .* got a list: \[\{'seqlen"):
        CurriculumConfig(metrics=[{"seqlen_truncate": TRUNC}])


# ------------------------------------------------------------------------------------- hardening (QA findings)
def test_bare_data_efficiency_block_parses():
    cfg = parse_deepspeed_config(copy.deepcopy(DS["data_efficiency"]))
    assert cfg.seed == 7 and list(cfg.metrics) == ["vocabularyrarity"]


@pytest.mark.parametrize(
    "bad,match",
    [
        (None, "expected a DeepSpeed config dict"),
        ([1, 2], "expected a DeepSpeed config dict"),
        ({"train_batch_size": 8}, "no 'data_efficiency' block"),
    ],
)
def test_deepspeed_config_input_errors(bad, match):
    with pytest.raises(CurriculumConfigError, match=match):
        parse_deepspeed_config(bad)


def test_deepspeed_config_override_clash_and_bad_metrics():
    with pytest.raises(CurriculumConfigError, match=r"\['seed'\] come from the DeepSpeed config"):
        parse_deepspeed_config(DS, seed=5)
    d = copy.deepcopy(DS)
    d["data_efficiency"]["data_sampling"]["curriculum_learning"]["curriculum_metrics"] = ["vocabularyrarity"]
    with pytest.raises(CurriculumConfigError, match="curriculum_metrics: required, a dict"):
        parse_deepspeed_config(d)


def _with_seqlen(metric: dict, **data_sampling) -> dict:
    """``DS`` with a ``seqlen_truncate`` metric (the DeepSpeed keys of ``metric`` over 8 -> 1024, q 16, linear)."""
    d = copy.deepcopy(DS)
    d["data_efficiency"]["data_sampling"].update(data_sampling)
    seqlen = {
        "difficulty_type": "value",
        "clustering_type": "single_cluster",
        "min_difficulty": 8,
        "max_difficulty": 1024,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 110000, "difficulty_step": 16},
    }
    d["data_efficiency"]["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["seqlen_truncate"] = dict(
        seqlen, **metric
    )
    return d


def test_deepspeed_rounding_that_differs_warns():
    """min_difficulty 8 under difficulty_step 16: the default rounding trains 8 tokens for 866 steps where DeepSpeed
    trains 16 from step 1 (the long-run example of DeepSpeed PR #8334); it changed in silence (qa35-user 05)."""
    d = _with_seqlen({})
    with pytest.warns(
        UserWarning, match=r"seqlen_truncate .*steps 1-866 train 8 \(DeepSpeed: 16\).*rounding='deepspeed'"
    ):
        cfg = parse_deepspeed_config(d)
    assert cfg.metrics["seqlen_truncate"].schedule(cfg.rounding)(866) == 8
    for rounding, first in (("deepspeed", 16), ("clamped", 8)):  # chosen: no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cfg = parse_deepspeed_config(d, rounding=rounding)
        assert cfg.metrics["seqlen_truncate"].schedule(cfg.rounding)(1) == first
    d = _with_seqlen(
        {
            "min_difficulty": 16,
            "max_difficulty": 1000,
            "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 16},
        }
    )
    with pytest.warns(UserWarning, match=r"1000 is reached at step 100 \(DeepSpeed: 992 there, 1000 from step 101\)"):
        parse_deepspeed_config(d)
    with warnings.catch_warnings():  # multiples of difficulty_step: the same schedule
        warnings.simplefilter("error")
        parse_deepspeed_config(_with_seqlen({"min_difficulty": 16}))


def test_deepspeed_loader_keys():
    """An enabled dynamic_batching would train fixed-size batches in silence (qa35-user 04): refused; the loader keys
    the curriculum leaves to the DataLoader warn."""
    on = {"enabled": True, "max_tokens": 40, "min_batch_size": 1, "max_batch_size": 10}
    with pytest.raises(CurriculumConfigError, match="dynamic_batching is enabled, but lightning_effi does not"):
        parse_deepspeed_config(_with_seqlen({"min_difficulty": 16}, dynamic_batching=on))
    with pytest.warns(UserWarning, match="num_workers / pin_memory is not read"):
        cfg = parse_deepspeed_config(
            _with_seqlen(
                {"min_difficulty": 16}, dynamic_batching=dict(on, enabled=False), num_workers=2, pin_memory=True
            )
        )
    assert set(cfg.metrics) == {"vocabularyrarity", "seqlen_truncate"}


def test_deepspeed_single_cluster_index_paths_are_dropped():
    """Megatron-DeepSpeed's GPT / BERT scripts give the seqlen_truncate metric "dummy" index paths, which DeepSpeed
    never opens; they were refused (qa35-user 02). Dropped with a warning; a config of our own still refuses them."""
    d = _with_seqlen({"min_difficulty": 16, "index_to_sample_path": "dummy", "index_to_metric_path": "dummy"})
    with pytest.warns(
        UserWarning, match="index_to_sample_path / index_to_metric_path \\('dummy', 'dummy'\\) are not read"
    ):
        cfg = parse_deepspeed_config(d)
    assert cfg.metrics["seqlen_truncate"].index_to_sample_path is None
    with pytest.raises(CurriculumConfigError, match="single_cluster metric never filters"):
        CurriculumConfig(metrics={"seqlen_truncate": dict(TRUNC, index_to_sample_path="dummy")})


def test_deepspeed_custom_schedule():
    """A custom schedule reaches the metric through custom_schedules (DeepSpeed's
    set_custom_curriculum_learning_schedule); the error without it names that option and custom_schedule, not a key
    that is refused (qa35-user 03)."""
    custom = {"schedule_type": "custom", "min_difficulty": 16}
    d = _with_seqlen(custom)
    del d["data_efficiency"]["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["seqlen_truncate"][
        "schedule_config"
    ]
    with pytest.raises(
        CurriculumConfigError, match=r"needs custom_schedule.*custom_schedules=\{'seqlen_truncate': fn\}"
    ):
        parse_deepspeed_config(d, rounding="deepspeed")
    cfg = parse_deepspeed_config(d, custom_schedules={"seqlen_truncate": lambda step: 16 * (1 + step // 10)})
    assert [cfg.metrics["seqlen_truncate"].schedule(cfg.rounding)(s) for s in (1, 10, 25)] == [16, 32, 48]
    with pytest.raises(CurriculumConfigError, match="no metric 'vocabularyrarity' of schedule_type 'custom'"):
        parse_deepspeed_config(d, custom_schedules={"vocabularyrarity": lambda step: 1})
    with pytest.raises(CurriculumConfigError, match=r"custom_schedules\['seqlen_truncate'\] must be a callable"):
        parse_deepspeed_config(d, custom_schedules={"seqlen_truncate": 16})
    with pytest.raises(CurriculumConfigError, match="needs custom_schedule, a callable"):
        CurriculumConfig(metrics={"seqlen_truncate": dict(TRUNC, schedule_type="custom")})


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(truncate_keys="input_ids"), "truncate_keys must be a non-empty list"),
        (dict(truncate_keys=[]), "truncate_keys must be a non-empty list"),
        (dict(drop_last="false"), "drop_last must be a bool"),
        (dict(causal_label_shift=1), "causal_label_shift must be a bool"),
        (dict(seed=2**32), "seed must be < 2\\*\\*32"),
    ],
)
def test_option_types(opts, match):
    with pytest.raises(CurriculumConfigError, match=match):
        CurriculumConfig(metrics={"seqlen_truncate": TRUNC}, **opts)


def test_metric_keys_that_would_be_ignored_raise():
    with pytest.raises(CurriculumConfigError, match="single_cluster metric never filters"):
        CurriculumConfig(metrics={"seqlen_truncate": dict(TRUNC, index_to_sample_path="x")})
    with pytest.raises(CurriculumConfigError, match="custom_schedule is only used with schedule_type 'custom'"):
        CurriculumConfig(metrics={"seqlen_truncate": dict(TRUNC, custom_schedule=lambda s: 4)})


def test_truncation_to_zero_tokens_raises_at_construction():
    legacy = dict(
        TRUNC, min_difficulty=8, max_difficulty=16, schedule_config=dict(total_curriculum_step=20, difficulty_step=16)
    )
    with pytest.raises(CurriculumConfigError, match="rounding='deepspeed_legacy' the first difficulty is 0 tokens"):
        CurriculumConfig(metrics={"seqlen_truncate": legacy}, rounding="deepspeed_legacy")
    assert (
        CurriculumConfig(metrics={"seqlen_truncate": legacy}, rounding="deepspeed").schedules()["seqlen_truncate"](1)
        == 16
    )


def test_length_is_zero_once_the_budget_is_spent():
    c = controller({"seqlen_truncate": TRUNC}, n=5, mbs=2, ga=2, num_epochs=1)
    assert len(c) == 3 and c.total_steps == 2
    drain(c)
    assert c.exhausted and len(c) == 0 and list(c.micro_batches()) == []


def test_deepspeed_custom_metric_with_a_schedule_config():
    """DeepSpeed reads schedule_config for the fixed_* types only: a custom metric's is dropped with a warning (it was
    refused with "allowed: []", qa36-break 07); in a config of our own the message says to remove it."""
    d = _with_seqlen({"schedule_type": "custom", "min_difficulty": 16})
    with pytest.warns(
        UserWarning, match="schedule_type custom, whose function is the schedule, so its schedule_config"
    ):
        cfg = parse_deepspeed_config(d, custom_schedules={"seqlen_truncate": lambda step: 16}, rounding="deepspeed")
    assert cfg.metrics["seqlen_truncate"].schedule_config == {}
    with pytest.raises(CurriculumConfigError, match="reads no schedule_config .* remove schedule_config"):
        CurriculumConfig(
            metrics={"seqlen_truncate": dict(TRUNC, schedule_type="custom", custom_schedule=lambda step: 16)}
        )
