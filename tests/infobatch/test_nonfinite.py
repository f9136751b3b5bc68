"""InfoBatch and the non-finite loss policy (``lightning_effi.core.nonfinite``): ``nonfinite_loss="raise"`` (default)
stops the fit at the first NaN training loss, before its backward pass; ``"warn"`` warns once, counts each NaN step
once (checkpointed, restored exactly on resume, logged as ``effi/nonfinite_losses``) and never scores the NaN
batch's samples; the campaign's ``per_sample_loss=fn`` returning NaN stops under the default policy (issue #21)."""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_effi.callbacks import InfoBatchCallback
from lightning_effi.core.batch import batch_meta
from lightning_effi.core.nonfinite import NonFiniteLossError
from lightning_effi.infobatch.data import InfoBatchDataModule
from tests.helpers.harness import MetricsCapture, make_trainer
from tests.helpers.nonfinite import PoisonedGPT2, WeightsAtBatchStart, assert_weights_unchanged
from tests.helpers.tiny import TinyDataModule, TokenBlocks

N, BATCH = 24, 8  # 3 batches per epoch


class LabeledBlocks(TokenBlocks):
    """``{"input_ids": int64[T], "labels": int64[T]}``: labels in the batch, for the automatic per-sample loss."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def ib_data() -> InfoBatchDataModule:
    return InfoBatchDataModule(TinyDataModule(LabeledBlocks(n=N), batch_size=BATCH))


class Snapshot(WeightsAtBatchStart):
    """The module's parameters at the start of each training batch, and the sample indices of each step's batch."""

    def __init__(self) -> None:
        super().__init__()
        self.index: dict[int, torch.Tensor] = {}
        self.seen_after_epoch: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, idx)
        self.index[trainer.global_step] = batch_meta(trainer)["index"].clone()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        cb = next(c for c in trainer.callbacks if isinstance(c, InfoBatchCallback))  # type: ignore[attr-defined]
        self.seen_after_epoch.append(cb.seen.clone())  # listed after InfoBatch: its epoch's scores are merged


def test_raise_is_the_default_and_stops_at_the_nan_step_before_its_backward(tmp_path: Path) -> None:
    model, snap, cb = PoisonedGPT2(plain_loss=True, nan_steps=(2,)), Snapshot(), InfoBatchCallback()
    assert cb.nonfinite_guard.policy == "raise"
    trainer = make_trainer(tmp_path, [cb, snap], max_epochs=2)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit(model, datamodule=ib_data())
    message = str(err.value)
    assert message.startswith("InfoBatchCallback: the training loss is nan at step 2;"), message
    assert "nonfinite_loss='warn'" in message
    assert trainer.global_step == 2  # the NaN step took no optimizer step
    assert_weights_unchanged(model, snap.before[2])  # the weights the NaN step started from: no backward ran
    assert "training_step" not in model.__dict__  # on_exception put the module's own step back
    assert cb.nonfinite_guard.count == 0


def test_warn_goes_on_counts_each_nan_step_once_and_never_scores_it(tmp_path: Path) -> None:
    model, snap, logger = PoisonedGPT2(plain_loss=True, nan_steps=(2,), clean_grads=True), Snapshot(), MetricsCapture()
    cb = InfoBatchCallback(nonfinite_loss="warn")
    trainer = make_trainer(tmp_path, [cb, snap], max_epochs=2, logger=logger)
    with pytest.warns(
        UserWarning, match=r"InfoBatchCallback: the training loss is nan at step 2 \(nonfinite_loss='warn'"
    ):
        trainer.fit(model, datamodule=ib_data())
    assert trainer.global_step == 6  # two full epochs of 3 batches (delta=0.875 of 2 epochs: no prune epoch)
    assert (cb.nonfinite_guard.count, cb.nonfinite_guard.first_step) == (1, 2)
    assert cb.effi_summary()["infobatch/nonfinite_losses"] == 1
    # epoch 0 visits every sample once: all are scored but the NaN step's batch, which keeps "unseen"
    nan_batch = snap.index[2]
    expected = torch.ones(N, dtype=torch.bool)
    expected[nan_batch] = False
    assert torch.equal(snap.seen_after_epoch[0], expected)
    assert torch.isfinite(cb.score).all()
    # logged with InfoBatch's epoch figures, once per epoch, only with "warn"
    counts = [m["effi/nonfinite_losses"] for m in logger.metrics if "effi/infobatch/saved_fraction" in m]
    assert counts == [1.0, 1.0]


def test_raise_logs_no_nonfinite_count(tmp_path: Path) -> None:
    logger = MetricsCapture()
    make_trainer(tmp_path, [InfoBatchCallback()], max_epochs=1, logger=logger).fit(
        PoisonedGPT2(plain_loss=True), datamodule=ib_data()
    )
    epoch_logs = [m for m in logger.metrics if "effi/infobatch/saved_fraction" in m]
    assert len(epoch_logs) == 1 and "effi/nonfinite_losses" not in epoch_logs[0]


def test_warn_reports_the_count_at_the_end_of_fit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = InfoBatchCallback(nonfinite_loss="warn")
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        make_trainer(tmp_path, [cb], max_epochs=1).fit(
            PoisonedGPT2(plain_loss=True, nan_steps=(0, 2), clean_grads=True), datamodule=ib_data()
        )
    assert "InfoBatchCallback: 2 non-finite training losses (the first at step 0)" in caplog.text


@pytest.mark.slow  # two fits with checkpoints
def test_warn_count_is_restored_exactly_on_resume(tmp_path: Path) -> None:
    """NaN at steps 2 and 4 (3 steps per epoch): the uninterrupted run counts (2, first at step 2); a run resumed
    from the end of epoch 0 restores (1, step 2) from the checkpoint, then counts step 4: the same (2, 2)."""

    def run(root: Path, ckpt_path: Any = None, extra: tuple[pl.Callback, ...] = ()) -> InfoBatchCallback:
        cb = InfoBatchCallback(nonfinite_loss="warn")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            trainer = make_trainer(root, [cb, *extra], max_epochs=2)
            trainer.fit(
                PoisonedGPT2(plain_loss=True, nan_steps=(2, 4), clean_grads=True),
                datamodule=ib_data(),
                ckpt_path=ckpt_path,
            )
        return cb

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    whole = run(tmp_path / "whole", extra=(saver,))
    assert (whole.nonfinite_guard.count, whole.nonfinite_guard.first_step) == (2, 2)
    first_epoch = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    saved = torch.load(first_epoch, weights_only=True)["callbacks"]
    state = next(v for k, v in saved.items() if k.startswith("InfoBatchCallback"))
    assert state["nonfinite_loss"] == {"count": 1, "first_step": 2} and "nonfinite" not in state
    resumed = run(tmp_path / "resumed", ckpt_path=first_epoch)  # restores 1 at step 2, then counts step 4
    assert (resumed.nonfinite_guard.count, resumed.nonfinite_guard.first_step) == (2, 2)


def test_a_nan_first_batch_with_warn_detects_the_causal_shift_at_the_next_one(tmp_path: Path) -> None:
    """The automatic per-sample loss cannot be checked against a NaN loss (nor its causal shift detected): with
    "warn" the NaN batch is counted, not scored, and the next finite batch detects the shift."""
    cb, snap = InfoBatchCallback(nonfinite_loss="warn"), Snapshot()
    with pytest.warns(UserWarning, match="the training loss is nan at step 0"):
        make_trainer(tmp_path, [cb, snap], max_epochs=1).fit(
            PoisonedGPT2(plain_loss=True, nan_steps=(0,), clean_grads=True), datamodule=ib_data()
        )
    assert (cb.nonfinite_guard.count, cb.nonfinite_guard.first_step) == (1, 0)
    assert cb.per_sample_source == "auto" and cb._shift is True  # GPT-2's causal-LM loss
    assert not bool(snap.seen_after_epoch[0][snap.index[0]].any()) and int(snap.seen_after_epoch[0].sum()) == N - BATCH


class TokenClassifier(pl.LightningModule):
    """A user's module (mean-pooled token embeddings, 4 classes) whose per-sample loss is given by ``fn``."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(64, 16)
            self.head = torch.nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch["input_ids"]), batch["input_ids"][:, 0] % 4)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_per_sample_loss_fn_returning_nan_stops_under_the_default_policy(tmp_path: Path) -> None:
    """The campaign's ``infobatch.per_sample_loss.returns_nan``: stopped at the first batch by the policy, without
    the misleading "fn's mean differs from the step's loss" warning."""

    def nan_loss(outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(outputs, batch["input_ids"][:, 0] % 4, reduction="none") * math.nan

    model = TokenClassifier()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(tmp_path, [InfoBatchCallback(per_sample_loss=nan_loss)], max_epochs=1)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(NonFiniteLossError, match="nan at step 0"):
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=ib_data())
    assert not [w for w in seen if "differs" in str(w.message)], [str(w.message) for w in seen]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("policy", ["Raise", "ignore", None, True, ["warn"]])
def test_a_bad_policy_is_refused_at_construction(policy: Any) -> None:
    with pytest.raises(ValueError, match=r"InfoBatchCallback\.nonfinite_loss must be one of \('raise', 'warn'\)"):
        InfoBatchCallback(nonfinite_loss=policy)
