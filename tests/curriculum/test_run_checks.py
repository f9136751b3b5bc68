"""The curriculum's checks that need the run (QA's refit, typo-key, reach and resume-message cases): a second
``trainer.fit()`` on the same Trainer refused (a resume with ``ckpt_path`` still continues the stream), a
``truncate_keys`` entry that names no tensor of the batch refused, schedules that do nothing or do not reach
``max_difficulty`` within the run warned with the figures (a ``value`` metric's ``fixed_discrete`` list that ends
below ``max_difficulty`` refused), and the strict-resume error naming each changed setting with both values."""

from __future__ import annotations

import re
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_effi.callbacks import Curriculum
from lightning_effi.core.batch import batch_meta
from lightning_effi.core.errors import DataConfigError
from lightning_effi.curriculum import CurriculumConfig, CurriculumConfigError
from lightning_effi.curriculum import functional as F
from lightning_effi.curriculum.data import CurriculumCollate
from lightning_effi.curriculum.stream import fingerprint_diff
from lightning_effi.data import CurriculumDataModule
from tests.curriculum.test_stream import controller, drain, pct_metric
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TinyDataModule, TokenBlocks, tiny_gpt2, tiny_lm_data


def trunc(lo: int = 4, hi: int = 16, schedule_type: str = "fixed_linear", **schedule_config: Any) -> dict[str, Any]:
    """A ``seqlen_truncate`` metric (``fixed_linear`` over 6 steps of 4 tokens unless given)."""
    config = schedule_config or dict(total_curriculum_step=6, difficulty_step=4)
    return {
        "seqlen_truncate": dict(
            difficulty_type="value",
            clustering_type="single_cluster",
            min_difficulty=lo,
            max_difficulty=hi,
            schedule_type=schedule_type,
            schedule_config=config,
        )
    }


class Record(pl.Callback):
    """Per training batch: ``(global_step, cl_step, difficulty, input_ids shape, labels shape or None, ids)``."""

    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        meta = batch_meta(trainer)
        labels = batch.get("labels")
        self.rows.append(
            (
                trainer.global_step,
                meta["cl_step"],
                meta["cl_difficulty"]["seqlen_truncate"],
                tuple(batch["input_ids"].shape),
                None if labels is None else tuple(labels.shape),
                batch["input_ids"][:, 0].tolist(),
            )
        )


def curriculum_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("Curriculum: ")]


# ------------------------------------------------------------------------------------- a refit on the same Trainer
def test_a_second_fit_on_the_same_trainer_is_refused_naming_the_remedies(tmp_path):
    """QA ``cur_refit.py``: fit 3 steps, raise ``max_steps`` to 6 and fit again on the same Trainer: refused before any
    batch (steps 3-5 would have trained steps 0-2's samples and difficulties again), naming the step and both
    remedies."""
    rec = Record()
    cb = Curriculum(metrics=trunc(), num_epochs=4)
    trainer = make_trainer(tmp_path, [rec, cb], max_steps=3, max_epochs=-1)
    dm = CurriculumDataModule(tiny_lm_data(batch_size=4))
    trainer.fit(tiny_gpt2(), datamodule=dm)
    assert [r[1] for r in rec.rows] == [1, 2, 3]
    trainer.fit_loop.epoch_loop.max_steps = 6
    with pytest.raises(CurriculumConfigError) as err:
        trainer.fit(tiny_gpt2(), datamodule=dm)
    message = str(err.value)
    assert "this fit starts at optimizer step 3 without curriculum state" in message
    assert "a second trainer.fit() on the same Trainer" in message
    assert "{'seqlen_truncate': 4}" in message  # the difficulties it would start over from
    assert "trainer.fit(..., ckpt_path=...)" in message and "a fresh Trainer and a fresh Curriculum callback" in message
    assert len(rec.rows) == 3 and trainer.global_step == 3  # refused before any batch


def test_the_same_trainer_resumed_with_ckpt_path_continues_the_stream(tmp_path):
    """The remedy the refusal names: the same Trainer fitted again with ``ckpt_path`` (a checkpoint it wrote) trains
    steps 3-5 exactly as an uninterrupted 6-step run does (same curriculum steps, difficulties and samples), with no
    warning from the curriculum."""
    ref = Record()
    make_trainer(tmp_path / "ref", [ref, Curriculum(metrics=trunc(), num_epochs=4)], max_steps=6, max_epochs=-1).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
    )
    rec = Record()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    cb = Curriculum(metrics=trunc(), num_epochs=4)
    trainer = make_trainer(tmp_path / "run", [rec, cb, ckpt], max_steps=3, max_epochs=-1)
    dm = CurriculumDataModule(tiny_lm_data(batch_size=4))
    trainer.fit(tiny_gpt2(), datamodule=dm)
    trainer.fit_loop.epoch_loop.max_steps = 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(tiny_gpt2(), datamodule=dm, ckpt_path=tmp_path / "ck" / "step=3.ckpt")
    assert curriculum_warnings(caught) == []
    assert trainer.global_step == 6 and [r[1] for r in rec.rows] == [1, 2, 3, 4, 5, 6]
    assert rec.rows == ref.rows  # global step, curriculum step, difficulty, shapes and samples


def test_a_checkpoint_without_curriculum_state_resumes_with_a_warning(tmp_path):
    """A checkpoint written by a fit without the curriculum still resumes with it (documented), the curriculum
    starting at its step 1; a warning says so, with the step it resumed at and the first difficulties."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "old", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    make_trainer(tmp_path, [ckpt], max_steps=3, max_epochs=-1).fit(tiny_gpt2(), datamodule=tiny_lm_data(batch_size=4))
    rec = Record()
    trainer = make_trainer(tmp_path, [rec, Curriculum(metrics=trunc(), num_epochs=4)], max_steps=6, max_epochs=-1)
    with pytest.warns(UserWarning, match="resumed at optimizer step 3 from a checkpoint without curriculum state") as w:
        trainer.fit(
            tiny_gpt2(),
            datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4)),
            ckpt_path=tmp_path / "old" / "step=3.ckpt",
        )
    message = next(m for m in curriculum_warnings(w.list) if "without curriculum state" in m)
    assert "starts at its step 1 (difficulties {'seqlen_truncate': 4})" in message
    assert [r[:3] for r in rec.rows] == [(3, 1, 4), (4, 2, 8), (5, 3, 8)]


# ------------------------------------------------------------------------------------------ truncate_keys typo
class WithLabels(TokenBlocks):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.data[i]
        return {"input_ids": x, "labels": x.clone()}


def test_a_truncate_key_missing_from_the_batch_is_refused_at_setup(tmp_path):
    """QA ``cur_typo_key.py``: ``truncate_keys=['input_ids', 'lables']`` is refused when the loader is built (before
    any batch), naming ``truncate_keys``, the missing key and the batch's tensors."""
    rec = Record()
    cb = Curriculum(metrics=trunc(), num_epochs=2, truncate_keys=["input_ids", "lables"])
    trainer = make_trainer(tmp_path, [rec, cb], max_steps=2, max_epochs=-1)
    with pytest.raises(DataConfigError) as err:
        trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(WithLabels(n=24), batch_size=4)))
    message = str(err.value)
    assert message.startswith("curriculum truncate_keys ['input_ids', 'lables']: ['lables'] name no tensor")
    assert "whose tensors are ['input_ids', 'labels']" in message
    assert "truncate_keys=None" in message and "[found at setup" in message
    assert rec.rows == []


def test_a_truncate_key_missing_from_a_later_batch_is_refused_at_that_batch():
    """The same check on every batch (the collate): a batch without one of the keys raises there."""
    collate = CurriculumCollate(None, ["seqlen_truncate"], truncate_keys=("input_ids", "attention_mask"))
    items = [({"input_ids": torch.arange(8)}, (i, 1, 0, (4,))) for i in range(2)]
    with pytest.raises(DataConfigError, match=r"\['attention_mask'\] name no tensor of the training batch, whose "):
        collate(items)
    batch = {"input_ids": torch.zeros(2, 3), "inner": {"mask": torch.zeros(2, 3)}, "rows": [torch.zeros(2)], "n": 3}
    assert F.tensor_names(batch) == ["input_ids", "mask"]  # a list entry has no name


def test_truncate_keys_naming_every_tensor_cut_them_all(tmp_path):
    """Correct keys are unaffected: both tensors are cut to the step's difficulty."""
    rec = Record()
    cb = Curriculum(metrics=trunc(), num_epochs=2, truncate_keys=["input_ids", "labels"])
    make_trainer(tmp_path, [rec, cb], max_steps=6, max_epochs=-1).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(WithLabels(n=24), batch_size=4))
    )
    assert [r[2] for r in rec.rows] == [4, 8, 8, 12, 12, 16]
    assert all(r[3] == r[4] == (4, r[2]) for r in rec.rows)


# --------------------------------------------------------------------------------------- schedules vs the run
def test_a_schedule_longer_than_the_run_warns_with_the_figures(tmp_path):
    """QA ``cur_reach.py``: ``total_curriculum_step=1000`` in an 8-step run trains only at min_difficulty; the warning
    names the step that reaches max_difficulty, total_curriculum_step, the run's last step and length, and the
    difficulty the run ends at."""
    rec = Record()
    cb = Curriculum(metrics=trunc(total_curriculum_step=1000, difficulty_step=4), num_epochs=4)
    trainer = make_trainer(tmp_path, [rec, cb], max_steps=8, max_epochs=-1)
    with pytest.warns(UserWarning, match="only at curriculum step 1000") as w:
        trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4)))
    (message,) = curriculum_warnings(w.list)
    assert message == (
        "Curriculum: curriculum_metrics.seqlen_truncate: the schedule reaches max_difficulty (16) only at curriculum "
        "step 1000 (schedule_config.total_curriculum_step = 1000), after the run's last step (curriculum step 8: the "
        "last of a run of 8 optimizer steps): the run ends at difficulty 4 and never trains at max_difficulty; pass "
        "total_curriculum_step <= 8 to reach it within the run, or keep it when a longer resumed run continues the "
        "schedule"
    )
    assert {r[2] for r in rec.rows} == {4}


@pytest.mark.parametrize("total, warned", [(8, False), (9, True)])
def test_a_schedule_that_ends_within_the_run_does_not_warn(tmp_path, total, warned):
    """``total_curriculum_step`` = the run's steps reaches max_difficulty at the last step: no warning; one step more
    warns (the run ends at 12)."""
    rec = Record()
    cb = Curriculum(metrics=trunc(total_curriculum_step=total, difficulty_step=4), num_epochs=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [rec, cb], max_steps=8, max_epochs=-1).fit(
            tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
        )
    found = curriculum_warnings(caught)
    assert rec.rows[-1][2] == (12 if warned else 16)
    if warned:
        assert len(found) == 1 and "the run ends at difficulty 12" in found[0]
        assert "pass total_curriculum_step <= 8" in found[0]
    else:
        assert found == []


def test_a_run_bounded_by_the_sample_budget_names_it():
    """The budget (N x num_epochs) ending the stream before max_steps is named as what makes the last step last."""
    (message,) = CurriculumConfig(metrics=trunc(total_curriculum_step=20, difficulty_step=4)).reach_warnings(
        1, 10, "the sample budget N x num_epochs = 40 samples ends the run there, at 10 steps of 4"
    )
    assert "after the run's last step (curriculum step 10: the sample budget N x num_epochs = 40 samples" in message
    assert "the run ends at difficulty 8" in message


def test_a_schedule_at_max_difficulty_from_the_first_step_warns_that_it_does_nothing():
    """QA ``cur_discrete.py``: ``max_step=[0]`` ends the first stage before step 1, so every step trains at
    max_difficulty; so do ``min_difficulty = max_difficulty`` and ``total_curriculum_step=1``. Only when the run
    starts the curriculum (a resumed stream at step 5 is past its start)."""
    discrete = CurriculumConfig(metrics=trunc(8, 16, "fixed_discrete", difficulty=[8, 16], max_step=[0]))
    (message,) = discrete.reach_warnings(1, 8)
    assert message == (
        "curriculum_metrics.seqlen_truncate: the schedule is at max_difficulty (16) from the first curriculum step "
        "(schedule_config.max_step[0] = 0 ends the first stage (difficulty 8) before curriculum step 1, the first one "
        "(DeepSpeed's curriculum steps start at 1 too), and the next stage is at max_difficulty), so every step trains "
        "at max_difficulty and the curriculum does nothing for seqlen_truncate; give max_step entries >= 1 "
        "(max_step[i] is the last step of stage i), or remove the seqlen_truncate metric"
    )
    assert discrete.reach_warnings(5, 8) == []
    (same,) = CurriculumConfig(metrics=trunc(16, 16)).reach_warnings(1, None)
    assert "(min_difficulty = max_difficulty = 16)" in same and "lower min_difficulty" in same
    (one,) = CurriculumConfig(metrics=trunc(total_curriculum_step=1, difficulty_step=4)).reach_warnings(1, 8)
    assert "(schedule_config.total_curriculum_step = 1)" in one and "total_curriculum_step > 1" in one
    # a first stage that ends at step 1 is a curriculum: nothing to say
    assert (
        CurriculumConfig(metrics=trunc(8, 16, "fixed_discrete", difficulty=[8, 16], max_step=[1])).reach_warnings(1, 8)
        == []
    )


def test_a_discrete_schedule_whose_last_stage_starts_after_the_run_warns():
    config = CurriculumConfig(metrics=trunc(8, 16, "fixed_discrete", difficulty=[8, 12, 16], max_step=[2, 20]))
    (message,) = config.reach_warnings(1, 8, "the last of a run of 8 optimizer steps")
    assert "reaches max_difficulty (16) only at curriculum step 21 (schedule_config.max_step = [2, 20]" in message
    assert "the run ends at difficulty 12" in message and "end the earlier stages by max_step 7" in message
    assert config.reach_warnings(1, 21) == []


@pytest.mark.parametrize("difficulty", [[8, 8], [8, 12]])
def test_a_value_discrete_list_ending_below_max_difficulty_is_refused(difficulty):
    """QA ``cur_discrete.py``: for a ``value`` metric the list contradicts ``max_difficulty`` (never reached in any
    run, and max_difficulty means nothing else): refused at construction, offering both consistent spellings."""
    with pytest.raises(CurriculumConfigError) as err:
        Curriculum(metrics=trunc(8, 16, "fixed_discrete", difficulty=difficulty, max_step=[3]))
    message = str(err.value)
    last = difficulty[-1]
    assert message.startswith(
        f"curriculum_metrics.seqlen_truncate.schedule_config.difficulty ends at {last}, below max_difficulty (16)"
    )
    assert "difficulty=[8, 16]" in message and f"set max_difficulty to {last}" in message
    # the consistent spelling (max_difficulty = the last difficulty) is accepted; [8, 8] is then constant: warned
    ok = CurriculumConfig(metrics=trunc(8, last, "fixed_discrete", difficulty=difficulty, max_step=[3]))
    found = ok.reach_warnings(1, 8)
    if last == 12:
        assert found == []
    else:
        assert len(found) == 1 and "(min_difficulty = max_difficulty = 8)" in found[0]


def test_a_percentile_discrete_list_ending_below_max_difficulty_warns():
    """For a ``percentile`` metric ``max_difficulty`` is the scale, so a list ending below it is the only way to
    train on the easier share only (DeepSpeed runs it): a warning, in any run length."""
    metric = dict(pct_metric(), schedule_type="fixed_discrete", schedule_config=dict(difficulty=[20, 50], max_step=[3]))
    config = CurriculumConfig(metrics={"p": metric})
    (message,) = config.reach_warnings(1, 1000)
    assert message.startswith("curriculum_metrics.p: schedule_config.difficulty ends at 50, below max_difficulty (100)")
    assert "the samples ranked above percentile 50 of 100 never become eligible" in message
    full = dict(metric, schedule_config=dict(difficulty=[20, 100], max_step=[3]))
    assert CurriculumConfig(metrics={"p": full}).reach_warnings(1, 1000) == []


def test_custom_schedules_are_not_read():
    metric = trunc(4, 16, "custom")["seqlen_truncate"]
    metric.pop("schedule_config")
    config = CurriculumConfig(metrics={"seqlen_truncate": {**metric, "custom_schedule": lambda step: 4}})
    assert config.reach_warnings(1, 8) == []


# ----------------------------------------------------------------------------------- strict resume: the setting
def test_the_strict_resume_error_names_each_changed_setting_with_both_values():
    """QA ``resume_changed.py "cur seed" "cur tcs"``: the error names ``seed`` (and a schedule key by its path)
    with the checkpoint's and the current value, not ``['config']``; the same configuration loads."""
    a = controller({"p": pct_metric()}, n=40, seed=1)
    drain(a)
    with pytest.raises(CurriculumConfigError) as err:
        controller({"p": pct_metric()}, n=40, seed=2).load_state_dict(a.state_dict())
    assert "another configuration (checkpoint, now): {'seed': (1, 2)}; resume with the same" in str(err.value)
    with pytest.raises(CurriculumConfigError) as err:
        controller({"p": pct_metric(total=8)}, n=40, seed=1).load_state_dict(a.state_dict())
    assert "{'metrics.p.schedule_config.total_curriculum_step': (12, 8)}" in str(err.value)
    with pytest.raises(CurriculumConfigError) as err:
        controller({"p": pct_metric()}, n=40, seed=1, mbs=2).load_state_dict(a.state_dict())
    assert "{'micro_batch_size': (4, 2)}" in str(err.value)
    same = controller({"p": pct_metric()}, n=40, seed=1)
    same.load_state_dict(a.state_dict())
    assert same.committed == a.committed


@pytest.mark.parametrize(
    ("setting", "before", "after", "named"),
    [
        (
            "total_tokens",
            dict(total_tokens=200),
            dict(total_tokens=120),
            "total_tokens=200, this fit has total_tokens=120",
        ),
        ("truncate_keys", dict(truncate_keys=["input_ids"]), {}, "{'truncate_keys': (['input_ids'], None)}"),
    ],
)
def test_a_resume_with_another_total_tokens_or_truncate_keys_is_refused(tmp_path, setting, before, after, named):
    """Neither was compared on resume: the token progress an LR schedule follows jumped from 0.32 at the checkpoint
    to 0.8 at the next step (total_tokens 200 -> 120), and the batches were cut on other tensors (qa32-break 03).
    strict=False warns and continues with this run's setting; the same setting resumes."""
    from tests.helpers.tiny import seqlen_truncate

    def fit(steps, ckpt=None, strict=True, **options):
        data = CurriculumDataModule(TinyDataModule(TokenBlocks(n=40, seq_len=9), batch_size=4))
        callback = Curriculum(metrics=seqlen_truncate(4, 8, 4, 4), strict=strict, **options)
        trainer = make_trainer(tmp_path, [callback], max_steps=steps)
        trainer.fit(tiny_gpt2(), datamodule=data, ckpt_path=ckpt)
        return trainer

    path = tmp_path / "first.ckpt"
    fit(3, **before).save_checkpoint(path)
    with pytest.raises(CurriculumConfigError, match=rf"{re.escape(named)}.*pass strict=False to continue with this"):
        fit(6, path, **after)
    with pytest.warns(UserWarning, match=re.escape(named)):
        assert fit(6, path, strict=False, **after).global_step == 6
    assert fit(6, path, **before).global_step == 6


class PromptMasked(torch.utils.data.Dataset):
    """Fine-tuning rows of 16 tokens whose first 12 are the prompt (labels -100)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(1, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": torch.cat([torch.full((12,), -100), ids[12:]])}


class TokenLoss(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_truncation_that_leaves_no_label_is_named_in_the_nonfinite_loss_error(tmp_path):
    """Cut to 8 tokens, a prompt-masked batch has no label left: the loss is 0/0 at step 0, and the error advised a
    lower learning rate (qa33-user 03). It now says what the truncation did and how to avoid it."""
    from lightning_effi.core.nonfinite import NonFiniteLossError
    from tests.helpers.tiny import seqlen_truncate

    data = CurriculumDataModule(TinyDataModule(PromptMasked(), batch_size=4))
    trainer = make_trainer(tmp_path, [Curriculum(metrics=seqlen_truncate(8, 16, 4, 8))], max_steps=2)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit(TokenLoss(), datamodule=data)
    assert str(err.value) == (
        "Curriculum: the training loss is nan at step 0; stopped before its backward pass (nonfinite_loss='raise'). "
        "The curriculum's seqlen_truncate cut this batch to 8 of its 16 tokens, and every label left is -100 "
        "(ignored), so a mean over its labelled tokens is 0/0: with targets after a prompt (prompt-masked "
        "fine-tuning), raise seqlen_truncate's min_difficulty above the prompts' length. Otherwise lower the learning "
        "rate, clip gradients or check the data; nonfinite_loss='warn' on every technique lets the run go on, counting "
        "them"
    )


def test_fingerprint_diff_reports_an_added_metric_as_one_entry():
    a = controller({"p": pct_metric()}, n=40).fingerprint()
    b = controller({"p": pct_metric(), "seqlen_truncate": trunc()["seqlen_truncate"]}, n=40).fingerprint()
    diff = fingerprint_diff(a, b)
    assert sorted(diff) == ["metrics.seqlen_truncate"]
    assert diff["metrics.seqlen_truncate"][0] is None and diff["metrics.seqlen_truncate"][1]["max_difficulty"] == 16
    assert fingerprint_diff(a, a) == {}
    assert "seed" in fingerprint_diff("not a dict", a)  # a damaged fingerprint: every setting differs
    # an option the fingerprint holds only when set reads as its default, not None (qa56-ts 05)
    left = controller({"seqlen_truncate": trunc()["seqlen_truncate"]}, n=40, truncation_side="left").fingerprint()
    right = controller({"seqlen_truncate": trunc()["seqlen_truncate"]}, n=40).fingerprint()
    assert fingerprint_diff(left, right) == {"truncation_side": ("left", "right")}


class _EpochLengths(pl.Callback):
    def __init__(self) -> None:
        self.lengths: dict[int, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lengths[trainer.current_epoch] = self.lengths.get(trainer.current_epoch, 0) + 1


@pytest.mark.parametrize("limit, warned", [(2, True), (5, False)])
def test_a_limit_that_does_not_divide_the_data_epoch_is_warned_with_the_epoch_lengths(tmp_path, limit, warned):
    """40 samples in batches of 8: a data epoch of 5 micro-batches. ``limit_train_batches=2`` trains epochs of
    2, 2, 1 batches (the curriculum's loader ends an epoch at its data epoch's end too), said at train start."""
    lengths = _EpochLengths()
    trainer = make_trainer(tmp_path, [Curriculum(metrics=trunc()), lengths], max_epochs=3, limit_train_batches=limit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data()))
    said = [str(w.message) for w in caught if "cuts an epoch to" in str(w.message)]
    assert list(lengths.lengths.values()) == ([2, 2, 1] if warned else [5, 5, 5])
    assert len(said) == warned
    if warned:
        assert "the epochs train [2, 2, 1] batches" in said[0] and "max_epochs=3" in said[0]


@pytest.mark.parametrize("max_steps", [-1, 7])
def test_a_run_the_sample_budget_ends_before_lightnings_step_estimate_is_warned(tmp_path, max_steps):
    """28 samples x num_epochs 3 in steps of 4 x 3 (accumulation): the stream ends the run at 7 optimizer steps,
    while Lightning estimates 3 epochs x ceil(7 batches / 3) = 9; a OneCycleLR sized by the estimate ended at LR
    2.3e-2 instead of annealing (the helper's run). Said at train start, with the max_steps that fixes it."""
    curriculum = Curriculum(metrics=trunc(), num_epochs=3)
    trainer = make_trainer(tmp_path, [curriculum], max_epochs=3, max_steps=max_steps, accumulate_grad_batches=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(tiny_gpt2(), datamodule=CurriculumDataModule(TinyDataModule(TokenBlocks(n=28), batch_size=4)))
    said = [str(w.message) for w in caught if "estimated_stepping_batches is" in str(w.message)]
    assert trainer.global_step == 7 and trainer.estimated_stepping_batches == (9 if max_steps == -1 else 7)
    if max_steps == -1:
        assert len(said) == 1 and "ends this run at 7 optimizer steps of 12 samples" in said[0]
        assert "estimated_stepping_batches is 9" in said[0] and "Set max_steps=7" in said[0]
    else:
        assert said == []
