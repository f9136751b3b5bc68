"""The one rule every technique reads a batch's tensor names by: a leaf's name (a mapping key, dataclass or NamedTuple
field) and whether the name says it holds the rows' lengths. The curriculum's truncation clamps such tensors and
random-LTD reads them to tell a padded batch from one of equal rows, so both must read the same names."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from lightning_effi.core.measure import leaf_name, length_stem, tensor_leaves
from lightning_effi.random_ltd.callback import _padded


class SpeechBatch(NamedTuple):
    features: torch.Tensor
    lengths: torch.Tensor


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    x_lens: torch.Tensor


@pytest.mark.parametrize(
    ("name", "stem"),
    [
        ("feature_lengths", "feature"),
        ("x_lens", "x"),
        ("seq_len", "seq"),
        ("lengths", ""),
        ("length", ""),
        ("num_frames", ""),
        ("n_tokens", ""),
        ("input_ids", None),
        ("labels", None),
        ("", None),
        (None, None),
    ],
)
def test_length_stem(name, stem):
    assert length_stem(name) == stem


def test_leaf_names_of_mappings_dataclasses_and_named_tuples():
    f, n = torch.zeros(2, 5, 3), torch.tensor([5, 3])
    assert [leaf_name(b, p) for b in [{"a": {"feats": f}}] for p, _ in tensor_leaves(b)] == ["feats"]
    batch = SpeechBatch(f, n)
    assert [leaf_name(batch, p) for p, _ in tensor_leaves(batch)] == ["features", "lengths"]
    nested = {"audio": batch}
    assert [leaf_name(nested, p) for p, _ in tensor_leaves(nested)] == ["features", "lengths"]
    assert [leaf_name(Batch(f, n), p) for p, _ in tensor_leaves(Batch(f, n))] == ["x", "x_lens"]
    plain = (f, n)  # a plain tuple's entries have no names: class labels can look like lengths
    assert [leaf_name(plain, p) for p, _ in tensor_leaves(plain)] == [None, None]


@pytest.mark.parametrize(
    ("make", "padded"),
    [
        (lambda f, n: {"features": f, "feature_lengths": n}, True),
        (lambda f, n: {"features": f, "feature_lengths": torch.tensor([5, 5])}, False),
        (lambda f, n: SpeechBatch(f, n), True),  # a NamedTuple's lengths (read by name since this rule is shared)
        (lambda f, n: SpeechBatch(f, torch.tensor([5, 5])), False),
        (lambda f, n: Batch(f, n), True),
        (lambda f, n: (f, n), False),  # unnamed: not read as lengths
        (lambda f, n: {"x": f, "num_frames": n}, True),
    ],
)
def test_random_ltd_reads_the_lengths_the_curriculum_reads(make, padded):
    assert _padded(make(torch.zeros(2, 5, 3), torch.tensor([5, 3]))) is padded
