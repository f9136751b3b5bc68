"""Curriculum functional core: eligible sets, percentile windows, clusters, exact draws, DP slices and the
sequence-length transforms (DeepSpeed ``data_sampling/data_sampler.py`` semantics, Megatron-DeepSpeed transforms)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_effi.curriculum.analysis.index import MetricIndex
from lightning_effi.functional import curriculum as F


def value_set(index: MetricIndex, d: int) -> set[int]:
    end = F.eligible_end(
        d,
        difficulty_type="value",
        num_samples=index.num_samples,
        max_difficulty=10**9,
        offsets=index.offsets,
        values=index.values,
    )
    return set(index.ids[:end].tolist())


def test_value_slicing():
    index = MetricIndex.from_sample_to_metric(np.array([3, 1, 4, 1, 5, 9, 2, 6]))
    first = value_set(index, 3)
    assert first == {0, 1, 3, 6}
    assert value_set(index, 5) - first == {2, 4}
    assert value_set(index, 0) == set() and value_set(index, 100) == set(range(8))


def test_value_needs_per_row_values():
    with pytest.raises(ValueError, match="percentile_merged"):
        F.eligible_end(3, difficulty_type="value", num_samples=4, max_difficulty=10, offsets=np.array([0, 4]))


def test_percentile_golden():
    rows = [[0, 5], [1, 2, 3], [4], [6, 7, 8, 9]]
    assert F.percentile_ids(rows, 0, 5, 10).tolist() == [0, 5, 1, 2, 3]
    assert F.percentile_ids(rows, 5, 7, 10).tolist() == [4, 6]
    assert F.percentile_ids(rows, 7, 10, 10).tolist() == [7, 8, 9]


def test_percentile_rounding():
    kw = dict(difficulty_type="percentile", num_samples=199, max_difficulty=100)
    assert F.eligible_end(50, percentile_rounding="deepspeed", **kw) == 50
    assert F.eligible_end(50, percentile_rounding="proportional", **kw) == 99
    assert F.eligible_end(100, percentile_rounding="deepspeed", **kw) == 199
    assert F.eligible_end(100, percentile_rounding="proportional", **kw) == 199
    assert F.eligible_end(0, percentile_rounding="deepspeed", **kw) == 0
    with pytest.raises(ValueError, match="percentile_rounding"):
        F.eligible_end(5, percentile_rounding="ceil", **kw)


def test_new_cluster_is_the_increment():
    eligible = np.array([1, 1, 0, 1, 1], dtype=bool)
    assigned = np.array([1, 0, 0, 1, 0], dtype=bool)
    assert F.new_cluster(eligible, assigned).tolist() == [1, 4]


def test_exact_draws_wrap_passes():
    ids = np.array([10, 20], dtype=np.int64)
    drawn, pass_, pos, _ = F.draw_from_cluster(ids, 8, seed=3, cluster_key=0, pass_=0, position=0)
    assert len(drawn) == 8 and (pass_, pos) == (4, 0)
    for p in range(4):
        assert sorted(drawn[2 * p : 2 * p + 2].tolist()) == [10, 20]
        assert drawn[2 * p : 2 * p + 2].tolist() == F.cluster_permutation(3, 0, p, ids).tolist()


def test_draws_continue_a_pass_across_calls():
    ids = np.arange(7, dtype=np.int64)
    once, *_ = F.draw_from_cluster(ids, 12, 0, 1, 0, 0)
    a, p, q, perm = F.draw_from_cluster(ids, 5, 0, 1, 0, 0)
    b, p, q, perm = F.draw_from_cluster(ids, 4, 0, 1, p, q, perm)
    c, p, q, perm = F.draw_from_cluster(ids, 3, 0, 1, p, q, None)  # recomputing the cached permutation is the same
    assert np.concatenate([a, b, c]).tolist() == once.tolist()
    assert sorted(once[:7].tolist()) == list(range(7))  # no duplicate within a pass


def test_dp_slices():
    assert [F.dp_slice(5, 4, r) for r in range(4)] == [(0, 2), (2, 3), (3, 4), (4, 5)]
    ds = lambda L, dp: [F.dp_slice(L, dp, r, "deepspeed") for r in range(dp)]  # noqa: E731
    assert ds(5, 4) == [(0, 1), (1, 2), (2, 4), (4, 5)]
    assert ds(6, 4) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert ds(3, 4) == [(0, 1), (1, 2), (2, 2), (2, 3)]
    assert ds(10, 3) == [(0, 3), (3, 7), (7, 10)]
    for L in range(0, 30):
        for dp in range(1, 6):
            for mode in F.DP_SPLITS:
                cuts = [F.dp_slice(L, dp, r, mode) for r in range(dp)]
                assert cuts[0][0] == 0 and cuts[-1][1] == L and all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
                sizes = [e - s for s, e in cuts]
                assert max(sizes) - min(sizes) <= 1


def test_truncate_batch():
    batch = {
        "input_ids": torch.arange(20).view(2, 10),
        "attention_mask": torch.ones(2, 10, dtype=torch.long),
        "labels": torch.tensor([0, 1]),
    }
    out = F.truncate_batch(batch, 4)
    assert out["input_ids"].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]] and out["attention_mask"].shape == (2, 4)
    assert out["labels"].tolist() == [0, 1] and batch["input_ids"].shape == (2, 10)  # input untouched
    assert F.truncate_batch(batch, 4, causal_label_shift=True)["input_ids"].shape == (2, 5)  # GPT: d + 1
    assert F.truncate_batch(batch, 10)["input_ids"].shape == (2, 10)
    assert F.truncate_batch(batch, 9, causal_label_shift=True)["input_ids"].shape == (2, 10)
    with pytest.raises(ValueError, match=">= 1"):
        F.truncate_batch(batch, 0)


def test_reshape_batch_megatron_rule():
    x = torch.arange(2 * 10).view(2, 10)
    out = F.reshape_batch({"input_ids": x, "labels": x}, 3)["input_ids"]  # rows of d+1 = 4 tokens
    # floor(10/4)*4 = 8 columns -> 4 rows, + the last 4 tokens of each sample -> 6 rows; ceil(20/4)=5 -> 5, odd -> 4
    assert out.shape == (4, 4)
    assert out.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [10, 11, 12, 13], [14, 15, 16, 17]]
    assert F.reshape_batch({"input_ids": x}, 9)["input_ids"].shape == (2, 10)
    with pytest.raises(ValueError, match="2-D"):
        F.reshape_batch({"input_ids": torch.arange(5)}, 2)


def test_reshape_batch_rechunks_every_token_field_alike_and_refuses_what_cannot_follow_the_rows():
    """A causal-LM batch's labels and mask follow the ids into the same rows (they were dropped: the user's step
    read batch["labels"] and died with a KeyError, or trained without its mask); a per-sample field is refused,
    named, at the batch (at setup, where the curriculum runs its transforms on the first samples)."""
    x = torch.arange(2 * 10).view(2, 10)
    mask = (x % 7 != 0).long()
    out = F.reshape_batch({"input_ids": x, "labels": x + 100, "attention_mask": mask}, 3)
    assert sorted(out) == ["attention_mask", "input_ids", "labels"]
    assert torch.equal(out["labels"], out["input_ids"] + 100)
    assert out["attention_mask"].tolist() == [
        [int(v % 7 != 0) for v in row] for row in out["input_ids"].tolist()
    ]  # each row's mask is its own tokens'
    for extra, words in ((torch.tensor([0, 1]), r"'y' \(shape \[2\]\)"), (["a", "b"], r"'y' \(list\)")):
        with pytest.raises(ValueError, match=rf"seqlen_reshape re-chunks .*\[2, 10\].*{words} cannot follow the rows"):
            F.reshape_batch({"input_ids": x, "y": extra}, 3)


def test_trim_padding_rounds_up_to_multiple():
    mask = torch.zeros(2, 32, dtype=torch.long)
    mask[0, :9] = 1
    mask[1, :3] = 1
    out = F.trim_padding({"input_ids": torch.ones(2, 32, dtype=torch.long), "attention_mask": mask}, multiple=8)
    assert out["input_ids"].shape == (2, 16) and out["attention_mask"].shape == (2, 16)


def test_draw_from_cluster_refuses_a_position_outside_the_cluster_and_a_negative_count():
    """A position beyond the cluster returned more ids than asked (5 for n=3), a negative one none: refused."""
    ids = np.arange(5, dtype=np.int64)
    drawn, *_ = F.draw_from_cluster(ids, 3, 0, 0, 0, 4)
    assert len(drawn) == 3
    for position in (7, -2, 5):
        with pytest.raises(ValueError, match=r"position must be an int in \[0, 5\)"):
            F.draw_from_cluster(ids, 3, 0, 0, 0, position)
    with pytest.raises(ValueError, match=r"n must be an int >= 0"):
        F.draw_from_cluster(ids, -2, 0, 0, 0, 0)
