"""InfoBatch's checkpointed state is validated field by field when it loads, like constructor arguments: a damaged or
edited field raises a ``ValueError`` naming it and changes nothing; an old checkpoint's ``nonfinite`` count becomes
the non-finite guard's count (issue #21: the campaign's ``checkpoint.infobatch.*`` cases)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_effi.callbacks import InfoBatchCallback
from lightning_effi.functional import infobatch as ib
from lightning_effi.infobatch.callback import validate_state
from lightning_effi.infobatch.data import InfoBatchDataModule
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TinyDataModule, TokenBlocks, tiny_gpt2

N = 8


def set_up(cb: InfoBatchCallback) -> InfoBatchCallback:
    """``cb`` as ``setup`` leaves it for an 8-sample training set and 4 epochs, in epoch 1 (a prune epoch) after two
    of its optimizer steps."""
    cb.dataset_size, cb.epochs = N, 4
    cb.score = torch.linspace(0.1, 0.8, N)
    cb.seen = torch.ones(N, dtype=torch.bool)
    cb.sum_loss, cb.count = torch.zeros(N), torch.zeros(N, dtype=torch.int32)
    cb.sample_tokens = torch.tensor([5.0, 7.0, -1.0, 3.0, 9.0, 4.0, 6.0, 8.0], dtype=torch.float64)
    cb.pending_tokens = torch.zeros(2, N, dtype=torch.float64)
    cb.pending_tokens[:, 1] = torch.tensor([7.0, 1.0])
    cb.plan = ib.plan_epoch(cb.score, cb.seen, 1, 4, seed=cb.seed)
    cb.steps_in_epoch = 2
    return cb


def good_state() -> dict[str, Any]:
    return set_up(InfoBatchCallback()).state_dict()


def same(a: Any, b: Any) -> bool:
    """Exact equality of two states (tensors element-wise and of the same dtype, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


NAN = math.nan
T = "the checkpoint's "
CASES = [
    # (field, damaged value, what the message says after "InfoBatchCallback: ")
    ("steps_in_epoch", -3, T + "steps_in_epoch must be an int >= 0"),
    ("steps_in_epoch", 2.0, T + "steps_in_epoch must be an int >= 0"),
    ("samples_in_epoch", -1, T + r"samples_in_epoch must be None or an int >= 0 \(samples this rank trained"),
    ("samples_in_epoch", 4.0, T + "samples_in_epoch must be None or an int >= 0"),
    ("samples_in_epoch", "8", T + "samples_in_epoch must be None or an int >= 0"),
    ("table_epoch", 99, T + "table_epoch must be an int >= -1, <= the checkpoint's epoch 1"),
    ("table_epoch", -2, T + "table_epoch must be an int >= -1"),
    ("synced_epoch", 0, T + r"synced_epoch must be an int in \[-1, table_epoch=-1\]"),
    ("nonfinite", -4, T + "nonfinite must be an int >= 0"),
    ("nonfinite", "3", T + "nonfinite must be an int >= 0"),
    ("nonfinite_loss", {"count": -1, "first_step": None}, "checkpoint nonfinite count must be an int >= 0"),
    ("nonfinite_loss", {"count": 1, "first_step": -2}, "checkpoint nonfinite first_step must be an int >= 0"),
    ("nonfinite_loss", 3, T + "nonfinite_loss must be a dict"),
    ("sum_loss", torch.full((N,), NAN), T + "sum_loss must be finite everywhere"),
    ("sum_loss", torch.zeros(N - 1), T + r"sum_loss must be a float tensor of shape \(8,\)"),
    ("count", torch.full((N,), -1, dtype=torch.int32), T + "count must be an integer tensor >= 0"),
    ("count", torch.zeros(N), T + r"count must be an integer tensor of shape \(8,\)"),
    ("seen", torch.ones(N, dtype=torch.int64), T + r"seen must be a bool tensor of shape \(8,\)"),
    ("score", torch.full((N,), NAN), T + "score of seen sample 0 is nan; a seen score must be finite"),
    ("score", torch.zeros(N - 2), T + "score table has 6 entries, the training set 8"),
    ("score", [0.0] * N, T + r"score must be a float tensor of shape \(8,\)"),
    ("thin_stats", torch.tensor([5, -1, 0]), T + r"thin_stats must be an integer tensor of shape \(3,\), >= 0"),
    # None (present): failed at restore with a bare AttributeError (qa92-break 04)
    ("thin_stats", None, T + r"thin_stats must be an integer tensor of shape \(3,\), >= 0 .*got None"),
    ("sample_tokens", None, T + r"sample_tokens must be a float tensor of shape \(8,\).*got None"),
    ("pending_tokens", None, T + r"pending_tokens must be a float tensor of shape \(2, 8\).*got None"),
    ("pending_over_ranks", "x", T + r"pending_over_ranks must be a bool .*got 'x'"),
    (
        "sample_tokens",
        torch.full((N,), -2.0),
        T + r"sample_tokens must be a float tensor of shape \(8,\), in \[0, 2\*\*53\]",
    ),
    (
        "sample_tokens",
        torch.full((N,), NAN),
        T + r"sample_tokens must be a float tensor of shape \(8,\), in \[0, 2\*\*53\]",
    ),
    ("sample_tokens", torch.full((N,), 1e30), T + r"sample_tokens must be .*or -1 \(not yet trained\), got"),
    (
        "pending_tokens",
        torch.tensor([[1e30] * N, [1.0] * N]),
        T + r"pending_tokens must be .*at most 2\*\*53 per count",
    ),
    ("pending_tokens", torch.tensor([[3.0] * N, [0.5] * N]), T + r"pending_tokens must be .*whole counts"),
    ("sample_tokens", torch.zeros(N + 1), T + r"sample_tokens must be a float tensor of shape \(8,\)"),
    ("pending_tokens", torch.full((2, N), -1.0), T + r"pending_tokens must be a float tensor of shape \(2, 8\)"),
    ("pending_tokens", torch.zeros(N), T + r"pending_tokens must be a float tensor of shape \(2, 8\)"),
    ("history", "epoch 0", T + "history must be a list of dicts"),
    ("plan", {"epoch": 0}, T + "plan is not a valid epoch plan"),
    (
        "plan",
        ib.plan_epoch(torch.linspace(0, 1, N), torch.ones(N, dtype=torch.bool), 3, 4).to_state(),
        T + "plan must be the plan of an epoch, <= the checkpoint's epoch 1, got 'the plan of epoch 3'",
    ),
    ("plan", ib.full_plan(N + 1, 1).to_state(), T + "plan must be a plan over the 8 samples of the training set"),
    ("config", None, T + "config must be a dict of settings"),
]


@pytest.mark.parametrize("field, value, words", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_damaged_field_is_refused_naming_it_and_nothing_is_loaded(field: str, value: Any, words: str) -> None:
    state = good_state()
    state[field] = value
    if field == "config":  # checked by load_state_dict before the settings comparison
        cb = set_up(InfoBatchCallback())
    else:
        with pytest.raises(ValueError, match=rf"InfoBatchCallback: {words}"):
            validate_state(state, N, checkpoint_epoch=1)
        cb = set_up(InfoBatchCallback())
    before = cb.state_dict()
    cb._checkpoint_epoch = 1  # as on_load_checkpoint notes it from the checkpoint's "epoch"
    with pytest.raises(ValueError, match=rf"InfoBatchCallback: {words}"):
        cb.load_state_dict(state)
    assert same(cb.state_dict(), before)


def test_a_valid_state_loads_and_round_trips() -> None:
    state = good_state()
    validate_state(state, N, checkpoint_epoch=1)
    validate_state(state, N)  # the checkpoint's epoch unknown: epochs only checked to be >= -1
    cb = set_up(InfoBatchCallback())
    cb.score = torch.zeros(N)
    cb.load_state_dict(state)
    assert torch.equal(cb.score, state["score"]) and cb.steps_in_epoch == 2
    assert cb.plan == ib.EpochPlan.from_state(state["plan"])
    assert cb.nonfinite_guard.state_dict() == {"count": 0, "first_step": None}


def test_an_unseen_nan_score_is_not_refused() -> None:
    state = good_state()
    state["seen"][3] = False
    state["score"][3] = NAN  # never read: the threshold is over seen samples only
    validate_state(state, N, checkpoint_epoch=1)


def test_an_old_checkpoints_nonfinite_count_becomes_the_guards() -> None:
    state = good_state()
    del state["nonfinite_loss"]
    state["nonfinite"] = 3  # written before the non-finite loss policy
    cb = set_up(InfoBatchCallback(nonfinite_loss="warn"))
    cb.load_state_dict(state)
    assert (cb.nonfinite_guard.count, cb.nonfinite_guard.first_step) == (3, None)
    assert cb.nonfinite_guard.policy == "warn"  # the policy is the constructor's, never the checkpoint's
    # and a new checkpoint's own count wins over a stray old key (both validated)
    state["nonfinite_loss"] = {"count": 5, "first_step": 7}
    cb.load_state_dict(state)
    assert (cb.nonfinite_guard.count, cb.nonfinite_guard.first_step) == (5, 7)


def test_the_token_tables_round_trip_and_an_older_checkpoint_without_them_loads_them_unknown() -> None:
    state = good_state()
    cb = set_up(InfoBatchCallback())
    cb.sample_tokens, cb.pending_tokens = torch.zeros(N, dtype=torch.float64), torch.ones(2, N, dtype=torch.float64)
    cb.load_state_dict(state)
    assert torch.equal(cb.sample_tokens, state["sample_tokens"]) and torch.equal(
        cb.pending_tokens, state["pending_tokens"]
    )
    del state["sample_tokens"], state["pending_tokens"]  # written before the token table
    validate_state(state, N, checkpoint_epoch=1)
    cb.load_state_dict(state)
    assert cb.sample_tokens.tolist() == [-1.0] * N and cb.pending_tokens.abs().sum() == 0
    assert cb.sample_tokens.dtype == cb.pending_tokens.dtype == torch.float64


@pytest.fixture(scope="module")
def first_epoch_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint written at the end of epoch 0 of a 3-epoch InfoBatch fit (16 samples, batches of 8)."""
    root = tmp_path_factory.mktemp("ib_ckpt")
    saver = ModelCheckpoint(dirpath=root / "ckpt", every_n_epochs=1, save_top_k=-1)
    trainer = make_trainer(root, [InfoBatchCallback(seed=7), saver], max_epochs=3)
    trainer.fit(tiny_gpt2(), datamodule=InfoBatchDataModule(TinyDataModule(TokenBlocks(n=16), batch_size=8)))
    return root / "ckpt" / "epoch=0-step=2.ckpt"


@pytest.mark.parametrize(
    "field, value",
    [("steps_in_epoch", -3), ("table_epoch", 99), ("nonfinite", -4)],  # the campaign's cases
)
def test_resuming_from_a_damaged_checkpoint_stops_at_the_load_naming_the_field(
    first_epoch_checkpoint: Path, tmp_path: Path, field: str, value: int
) -> None:
    ckpt = torch.load(first_epoch_checkpoint, weights_only=True)
    key = next(k for k in ckpt["callbacks"] if k.startswith("InfoBatchCallback"))
    assert ckpt["epoch"] == 0 and ckpt["callbacks"][key]["table_epoch"] == -1
    ckpt["callbacks"][key][field] = value
    path = tmp_path / "damaged.ckpt"
    torch.save(ckpt, path)
    trainer = make_trainer(tmp_path, [InfoBatchCallback(seed=7)], max_epochs=3)
    model = tiny_gpt2()
    with pytest.raises(ValueError, match=rf"InfoBatchCallback: the checkpoint's {field} must be an int >= "):
        trainer.fit(
            model,
            datamodule=InfoBatchDataModule(TinyDataModule(TokenBlocks(n=16), batch_size=8)),
            ckpt_path=path,
        )
    assert trainer.global_step == 0  # refused while the callbacks' states load, before the loops' and any batch
