"""The curriculum's last silent cases (issue #21): the functional schedules' arguments, a ``seqlen_truncate`` /
``seqlen_reshape`` range checked against the training data's sequence length at setup, a checkpoint's own entries,
and the non-finite loss policy (``nonfinite_loss``)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.multiprocessing.spawn import ProcessRaisedException
from torch.utils.data import Dataset

import lightning_effi.curriculum.data as curriculum_data
from lightning_effi.callbacks import Curriculum
from lightning_effi.core.nonfinite import NonFiniteLossError
from lightning_effi.curriculum import CurriculumConfig, CurriculumConfigError
from lightning_effi.curriculum.data import data_sequence_length
from lightning_effi.curriculum.schedules import (
    CurriculumSchedule,
    ScheduleConfigError,
    discrete_difficulty,
    reach_step,
    root_difficulty,
)
from lightning_effi.data import CurriculumDataModule
from lightning_effi.reference.data.base import PaddingCollate
from lightning_effi.tasks import GPT2CausalLM
from tests.helpers.harness import MetricsCapture, fit_ddp, make_trainer
from tests.helpers.tiny import TINY_GPT2, Images, Sentences, TinyDataModule, TokenBlocks, sgd, tiny_lm_data

TRUNC = dict(
    difficulty_type="value",
    clustering_type="single_cluster",
    min_difficulty=4,
    max_difficulty=16,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=6, difficulty_step=4),
)


def trunc(**changes: Any) -> dict[str, Any]:
    return {"seqlen_truncate": {**TRUNC, **changes}}


# ------------------------------------------------------------------------------------------- functional schedules
@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((3, 8, 16, 0, 4), {}, r"root_difficulty\.total_curriculum_step must be an int >= 1, got 0"),
        ((3, 8, 16, 6, 0), {}, r"root_difficulty\.difficulty_step must be an int >= 1, got 0"),
        ((3, 8, 16, 6, 4), dict(root_degree=0), r"root_difficulty\.root_degree must be an int >= 1, got 0"),
        ((-2, 8, 16, 6, 4), {}, r"root_difficulty\.step must be an int >= 0, got -2"),
        ((1.5, 8, 16, 6, 4), {}, r"root_difficulty\.step must be an int >= 0, got 1\.5"),
        ((3, 16, 8, 6, 4), {}, r"root_difficulty: min_difficulty \(16\) must be <= max_difficulty \(8\)"),
        ((3, 8.0, 16, 6, 4), {}, r"root_difficulty\.min_difficulty must be an int, got 8\.0"),
        ((3, 8, 16, 6, 4), dict(rounding="x"), r"root_difficulty\.rounding must be one of"),
    ],
)
def test_root_difficulty_refuses_bad_arguments_naming_them(args, kwargs, match):
    with pytest.raises(ScheduleConfigError, match=match) as info:
        root_difficulty(*args, **kwargs)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "difficulty, max_step, match",
    [
        ([], [], r"non-empty lists with len\(difficulty\) == len\(max_step\) \+ 1.*got 0 difficulties"),
        ([8], [], r"non-empty lists.*got 1 difficulties \[8\] and 0 max_steps"),
        ([8], [5], r"len\(difficulty\) == len\(max_step\) \+ 1.*got 1 difficulties \[8\] and 1 max_steps \[5\]"),
        ([8, 12, 16], [6, 2], r"discrete_difficulty\.max_step must be strictly ascending, got \[6, 2\]"),
        ([8, 12, 16], [2, 2], r"discrete_difficulty\.max_step must be strictly ascending"),
        ([8, 16], [-1], r"discrete_difficulty\.max_step\[0\] must be an int >= 0, got -1"),
        (["8", 16], [2], r"discrete_difficulty\.difficulty\[0\] must be an int, got '8'"),
        ("816", [2], r"discrete_difficulty\.difficulty must be a list of ints"),
    ],
)
def test_discrete_difficulty_refuses_bad_lists_naming_them(difficulty, max_step, match):
    with pytest.raises(ScheduleConfigError, match=match):
        discrete_difficulty(3, difficulty, max_step)


def test_discrete_difficulty_refuses_a_negative_step():
    with pytest.raises(ScheduleConfigError, match=r"discrete_difficulty\.step must be an int >= 0, got -1"):
        discrete_difficulty(-1, [8, 16], [2])


@pytest.mark.parametrize("rounding", ["clamped", "deepspeed", "deepspeed_legacy"])
@pytest.mark.parametrize("k", [1, 2])
def test_the_checked_functions_give_the_schedules_values(rounding, k):
    """The validated public functions and the schedule object (validated once, unchecked per step) agree."""
    s = CurriculumSchedule(
        "fixed_root", 10, 100, dict(total_curriculum_step=20, difficulty_step=8, root_degree=k), rounding
    )
    assert [root_difficulty(t, 10, 100, 20, 8, k, rounding) for t in range(30)] == [s(t) for t in range(30)]
    d = CurriculumSchedule("fixed_discrete", 1, 5, dict(difficulty=[1, 3, 5], max_step=[2, 4]))
    assert [discrete_difficulty(t, (1, 3, 5), (2, 4)) for t in range(7)] == [d(t) for t in range(7)]
    assert [d(t) for t in range(7)] == [1, 1, 1, 3, 3, 5, 5]


def test_a_schedule_refuses_a_negative_or_float_step():
    s = CurriculumSchedule("fixed_linear", 8, 16, dict(total_curriculum_step=6, difficulty_step=4), name="m")
    for step in (-1, 2.0):
        with pytest.raises(ScheduleConfigError, match=r"curriculum_metrics\.m: step must be an int >= 0"):
            s(step)


def test_reach_step_is_the_first_step_at_a_difficulty():
    s = CurriculumSchedule("fixed_root", 8, 1000, dict(total_curriculum_step=300, difficulty_step=8, root_degree=2))
    values = [s(t) for t in range(1, 301)]
    for target in (8, 9, 16, 17, 100, 512, 993, 1000):
        assert reach_step(s, target) == next(t for t, v in enumerate(values, 1) if v >= target)
    assert reach_step(s, 1001) is None  # above max_difficulty: never
    d = CurriculumSchedule("fixed_discrete", 4, 16, dict(difficulty=[4, 8, 16], max_step=[3, 9]))
    assert (reach_step(d, 8), reach_step(d, 9), reach_step(d, 16)) == (4, 10, 10)
    assert reach_step(CurriculumSchedule("custom", 1, 5, {}, custom_fn=lambda t: 5), 5) is None


# ----------------------------------------------------------------------------------- the data's sequence length
def test_max_difficulty_above_the_data_length_is_refused_naming_the_step():
    config = CurriculumConfig(metrics=trunc(max_difficulty=1024))
    with pytest.raises(CurriculumConfigError) as info:
        config.check_data_length(16)
    message = str(info.value)
    assert "curriculum_metrics.seqlen_truncate.max_difficulty (1024) is above the training data's sequence " in message
    assert "hold 16 tokens, so a difficulty of 16 already keeps every token" in message
    # linear 4 -> 1024 over 6 steps in multiples of 4: step 1 gives 4 + 1020 / 6 = 174 -> 172 >= 16
    assert "reach the full length at step 1 instead of at total_curriculum_step (6)" in message
    assert "Set max_difficulty to 16" in message
    assert CurriculumConfig(metrics=trunc()).check_data_length(16) == []  # max_difficulty = the data's length
    # reached only at its last step: no "at step 8 instead of at total_curriculum_step (8)" (qa50-clip 07)
    late_schedule = dict(total_curriculum_step=8, difficulty_step=8)
    late = CurriculumConfig(metrics=trunc(min_difficulty=8, max_difficulty=40, schedule_config=late_schedule))
    with pytest.raises(CurriculumConfigError) as info:
        late.check_data_length(39)
    assert "instead of" not in str(info.value)
    assert "the schedule's last difficulty, 40, is one that no batch has" in str(info.value)


def test_max_difficulty_below_the_data_length_is_accepted_with_a_warning():
    """Longer data than max_difficulty: every batch of the run is cut, after the schedule's end too (a run may mean
    it, so it is not refused), and the cut tokens count as a saving: the message says so and names the full length."""
    (message,) = CurriculumConfig(metrics=trunc()).check_data_length(40)
    assert message.startswith(
        "curriculum_metrics.seqlen_truncate.max_difficulty (16) is below the training data's sequence length: its "
        "batches hold 40 tokens, so every batch of the run is cut"
    )
    assert message.endswith("Set max_difficulty to 40 to train on the full sequences at the end")


def test_min_difficulty_at_the_data_length_is_refused():
    config = CurriculumConfig(metrics=trunc(min_difficulty=16, max_difficulty=16))
    with pytest.raises(CurriculumConfigError, match=r"seqlen_truncate\.min_difficulty \(16\) is at or above") as info:
        config.check_data_length(16)
    assert "seqlen_truncate would never shorten a batch" in str(info.value)
    CurriculumConfig(metrics=trunc(min_difficulty=15)).check_data_length(16)  # one token cut at first: accepted


def test_the_label_shift_and_reshape_keep_one_token_more():
    """With ``causal_label_shift`` (and for ``seqlen_reshape``) a difficulty d keeps d + 1 tokens: the full length
    of 16-token batches is 15."""
    with pytest.raises(
        CurriculumConfigError, match=r"max_difficulty \(16\).*causal_label_shift.*Set max_difficulty to 15"
    ):
        CurriculumConfig(metrics=trunc(), causal_label_shift=True).check_data_length(16)
    CurriculumConfig(metrics=trunc(max_difficulty=15), causal_label_shift=True).check_data_length(16)
    reshape = {"seqlen_reshape": {**TRUNC, "max_difficulty": 16}}
    with pytest.raises(CurriculumConfigError, match=r"seqlen_reshape\.max_difficulty \(16\).*rows of d \+ 1 tokens"):
        CurriculumConfig(metrics=reshape).check_data_length(16)
    with pytest.raises(CurriculumConfigError, match=r"seqlen_reshape\.min_difficulty \(15\) is at or above"):
        CurriculumConfig(
            metrics={"seqlen_reshape": {**TRUNC, "min_difficulty": 15, "max_difficulty": 15}}
        ).check_data_length(16)


def test_a_metric_that_only_chooses_samples_is_not_compared_with_the_length():
    percentile = dict(
        difficulty_type="percentile",
        clustering_type="schedule_based",
        analysis="seqlen",
        min_difficulty=10,
        max_difficulty=100,
        schedule_type="fixed_linear",
        schedule_config=dict(total_curriculum_step=6, difficulty_step=10),
    )
    CurriculumConfig(metrics={"seqlen": percentile}).check_data_length(16)


class Ragged(Dataset):
    """Variable-length token sequences (3 to 16 tokens), no labels: ``{"input_ids": int64[L_i]}``."""

    def __init__(self, n: int = 40) -> None:
        self.items = Sentences(n=n, max_len=16).items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i]}


class PadTo:
    """Pads every batch to ``length`` tokens (as a tokenizer's ``padding="max_length"``)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        ids = torch.zeros(len(samples), self.length, dtype=torch.int64)
        for row, s in enumerate(samples):
            ids[row, : len(s["input_ids"])] = s["input_ids"]
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}


class Broken(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        raise OSError("opened in the workers only")


def test_data_sequence_length_reads_one_length_or_none():
    assert data_sequence_length(TokenBlocks(n=40, seq_len=16), None, 40) == 16
    assert data_sequence_length(TokenBlocks(n=1, seq_len=7), None, 1) == 7
    pad_to_longest = PaddingCollate(pad_token_id=0)
    assert data_sequence_length(Ragged(), pad_to_longest, 40) is None  # padded per batch: no one length
    assert data_sequence_length(Ragged(), PadTo(24), 40) == 24
    assert data_sequence_length(Images(), None, len(Images())) is None  # no sequence tensor
    assert data_sequence_length(Broken(), None, 4) is None  # left to the training loader
    assert data_sequence_length(TokenBlocks(), None, 0) is None


class NoBatch(pl.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1


def test_setup_refuses_a_range_beyond_the_data_before_any_batch(tmp_path):
    seen = NoBatch()
    trainer = make_trainer(tmp_path, [seen, Curriculum(metrics=trunc(max_difficulty=1024))], max_steps=2)
    with pytest.raises(CurriculumConfigError, match=r"max_difficulty \(1024\).*hold 16 tokens"):
        trainer.fit(tiny_gpt2_nan(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4)))
    assert seen.batches == 0


def test_batches_padded_to_their_longest_sample_are_checked_against_the_longest(tmp_path):
    """Per-batch padding has no one data length, but no batch is longer than the data's longest sample (16 tokens
    here): a max_difficulty above it would spend the schedule's end on lengths no batch has (and a random-LTD stacked
    on it would take that as its longest batch and drop nothing), so it is refused at setup, naming the longest batch;
    max_difficulty at the longest trains. A fixed-length collate is compared by its one length."""
    seen = NoBatch()
    data = TinyDataModule(Ragged(), collate_fn=PaddingCollate(pad_token_id=0), batch_size=4)
    with pytest.raises(CurriculumConfigError) as err:
        make_trainer(tmp_path, [seen, Curriculum(metrics=trunc(max_difficulty=32))], max_steps=2).fit(
            tiny_gpt2_nan(), datamodule=CurriculumDataModule(data)
        )
    assert str(err.value).startswith(
        "curriculum_metrics.seqlen_truncate.max_difficulty (32) is above the training data's sequence length: its "
        "longest batch (padded to its longest sample) holds 16 tokens, so a difficulty of 16 already keeps every token"
    )
    assert seen.batches == 0
    callback = Curriculum(metrics=trunc(max_difficulty=16))
    make_trainer(tmp_path, [callback], max_steps=2).fit(tiny_gpt2_nan(), datamodule=CurriculumDataModule(data))
    assert callback.last_difficulties == {"seqlen_truncate": 8}  # step 2: floor(4 + 12 * 2 / 6) = 8
    with pytest.raises(
        CurriculumConfigError, match=r"max_difficulty \(32\).*batches hold 24 tokens"
    ):  # padded to 24: one length
        fixed = TinyDataModule(Ragged(), collate_fn=PadTo(24), batch_size=4)
        make_trainer(tmp_path, [Curriculum(metrics=trunc(max_difficulty=32))], max_steps=2).fit(
            tiny_gpt2_nan(), datamodule=CurriculumDataModule(fixed)
        )


class TwoLengths(Dataset):
    """99 rows alternating 8 tokens (even rows) and 16 tokens (odd rows): every row the 8 length probes read is even."""

    def __len__(self) -> int:
        return 99

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(1, (16 if i % 2 else 8) + 1)}


def test_probes_of_one_length_are_confirmed_by_the_pass_over_the_data(tmp_path):
    """The probed rows (0, 14, ..., 98) all held 8 tokens, so the data was read as one length of 8: max_difficulty=16,
    the data's longest batch, was refused, and the advised 8 cut every 16-token row in silence (qa106-user 02)."""
    assert data_sequence_length(TwoLengths(), PaddingCollate(pad_token_id=0), 99) == 8  # what the probes see
    data = TinyDataModule(TwoLengths(), collate_fn=PaddingCollate(pad_token_id=0), batch_size=4)
    callback = Curriculum(metrics=trunc(max_difficulty=16))
    make_trainer(tmp_path, [callback], max_steps=2).fit(tiny_gpt2_nan(), datamodule=CurriculumDataModule(data))
    assert callback.last_difficulties == {"seqlen_truncate": 8}
    with pytest.warns(
        UserWarning,
        match=r"max_difficulty \(8\) is below the training data's sequence length: its "
        r"longest batch \(padded to its longest sample\) holds 16 tokens",
    ):
        make_trainer(tmp_path, [Curriculum(metrics=trunc(max_difficulty=8))], max_steps=2).fit(
            tiny_gpt2_nan(), datamodule=CurriculumDataModule(data)
        )


class CountedReads(Ragged):
    """:class:`Ragged` that appends the reading process's global rank to ``log`` at each ``__getitem__``."""

    def __init__(self, log: Path) -> None:
        super().__init__()
        self.log = log

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        with open(self.log, "a") as f:
            f.write(f"{torch.distributed.get_rank() if torch.distributed.is_initialized() else -1}\n")
        return super().__getitem__(i)


@pytest.mark.slow
def test_ddp_reads_the_longest_batch_on_rank_zero_only(tmp_path):
    """Under DDP the longest-batch pass reads the training set once, on global rank 0, and every rank gets its length:
    both ranks refuse a max_difficulty above it with the same error, and the set was read whole once, not once a
    rank (the error comes at setup, before the training loader reads)."""
    log = tmp_path / "reads.txt"
    data = TinyDataModule(CountedReads(log), collate_fn=PaddingCollate(pad_token_id=0), batch_size=4)
    with pytest.raises(ProcessRaisedException, match=r"max_difficulty \(32\).*longest batch.*holds 16 tokens"):
        fit_ddp(
            tiny_gpt2_nan(),
            CurriculumDataModule(data),
            tmp_path,
            callbacks=[Curriculum(metrics=trunc(max_difficulty=32))],
            use_distributed_sampler=False,
            max_steps=2,
        )
    ranks = log.read_text().split()
    # both ranks probe the same few samples for one length (data_sequence_length); only rank 0 reads all 40
    assert ranks.count("0") - ranks.count("1") == 40 and ranks.count("1") > 0


def test_data_longest_sequence_reads_every_sample_in_chunks(monkeypatch):
    """The longest sample after the collate (its cap included), read in chunks; None past the size limit, without a
    sequence tensor, or when the data raises."""
    pad_to_longest = PaddingCollate(pad_token_id=0)
    data = Ragged(n=40)
    longest = max(len(data[i]["input_ids"]) for i in range(40))
    monkeypatch.setattr(curriculum_data, "LONGEST_SCAN_CHUNK", 3)
    assert curriculum_data.data_longest_sequence(data, pad_to_longest, 40) == longest == 16
    assert curriculum_data.data_longest_sequence(data, pad_to_longest, 5) == max(
        len(data[i]["input_ids"]) for i in range(5)
    )
    assert curriculum_data.data_longest_sequence(data, PadTo(24), 40) == 24

    def capped(samples):
        return {k: v[:, :10] for k, v in pad_to_longest(samples).items()}

    assert curriculum_data.data_longest_sequence(data, capped, 40) == 10
    assert curriculum_data.data_longest_sequence(Images(), None, len(Images())) is None
    assert curriculum_data.data_longest_sequence(Broken(), None, 4) is None
    monkeypatch.setattr(curriculum_data, "LONGEST_SCAN_LIMIT", 39)
    assert curriculum_data.data_longest_sequence(data, pad_to_longest, 40) is None


# ------------------------------------------------------------------------------------------------ checkpoint entries
def state(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"stream": {}, "consumed_tokens": 64, "last_difficulties": {"seqlen_truncate": 8}}
    base.update(changes)
    return base


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(consumed_tokens=-100), r"consumed_tokens must be an int >= 0 \(tokens trained so far\), got -100"),
        (dict(consumed_tokens=1.5), r"consumed_tokens must be an int >= 0.*got 1\.5"),
        (dict(last_difficulties={"seqlen_truncate": math.nan}), r"last_difficulties must be a dict metric name -> int"),
        (dict(last_difficulties=[8]), r"last_difficulties must be a dict"),
        (dict(stream=None), r"the checkpoint's stream must be a dict"),
        (dict(nonfinite_loss=-4), r"nonfinite_loss must be a dict \{count, first_step\}, got -4"),
        (dict(added_on_resume=0), r"added_on_resume must be null or an int >= 1 .*, got 0"),
        (dict(added_on_resume="4"), r"added_on_resume must be null or an int >= 1 .*, got '4'"),
    ],
)
def test_a_checkpoints_entries_are_checked_naming_them(changes, match):
    callback = Curriculum(metrics=trunc())
    with pytest.raises(CurriculumConfigError, match=match):
        callback.load_state_dict(state(**changes))
    assert callback.state_dict() == {}  # nothing kept


def test_a_negative_nonfinite_count_is_refused():
    with pytest.raises(ValueError, match=r"Curriculum: checkpoint nonfinite count must be an int >= 0, got -4"):
        Curriculum(metrics=trunc()).load_state_dict(state(nonfinite_loss={"count": -4, "first_step": None}))


def test_a_refused_checkpoint_leaves_the_fitted_state_unchanged(tmp_path):
    callback = Curriculum(metrics=trunc())
    make_trainer(tmp_path, [callback], max_steps=3).fit(
        tiny_gpt2_nan(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=4))
    )
    before = callback.state_dict()
    assert before["consumed_tokens"] == callback.consumed_tokens == 4 * (4 + 8 + 8)  # steps 1, 2, 3: 4, 8, 8 tokens
    with pytest.raises(CurriculumConfigError, match=r"consumed_tokens must be an int >= 0"):
        callback.load_state_dict({**before, "consumed_tokens": -100})
    assert callback.state_dict() == before
    old = {k: v for k, v in before.items() if k != "nonfinite_loss"}  # written before the policy existed
    callback.nonfinite_guard.count = 3
    callback.load_state_dict(old)
    assert callback.state_dict() == before and callback.nonfinite_guard.count == 0


# ----------------------------------------------------------------------------------------- non-finite loss policy
class NanAt(GPT2CausalLM):
    """The tiny GPT-2 whose training loss is NaN at the given global steps. Under ``"warn"`` it handles them itself
    (its own skip: a step with a non-finite gradient does not update the parameters)."""

    def __init__(self, nan_steps: tuple[int, ...] = ()) -> None:
        super().__init__(**{**TINY_GPT2, "optimizer": sgd})
        self.nan_steps = set(nan_steps)

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if self.global_step in self.nan_steps:
            out = {**out, "loss": out["loss"] * float("nan")}
        return out

    def on_before_optimizer_step(self, optimizer):
        if any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in self.parameters()):
            for p in self.parameters():
                p.grad = None


def tiny_gpt2_nan(nan_steps: tuple[int, ...] = ()) -> NanAt:
    pl.seed_everything(0)
    return NanAt(nan_steps)


class Snapshot(pl.Callback):
    """The parameters before each training batch; the curriculum's non-finite count at the start of training."""

    def __init__(self, curriculum: Curriculum) -> None:
        self.curriculum = curriculum
        self.params: dict[int, dict[str, torch.Tensor]] = {}
        self.at_start: dict[str, Any] | None = None

    def on_train_start(self, trainer, pl_module):
        self.at_start = self.curriculum.nonfinite_guard.state_dict()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.params[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def data() -> CurriculumDataModule:
    return CurriculumDataModule(tiny_lm_data(batch_size=4))


def test_raise_stops_before_the_backward_of_a_nan_loss(tmp_path):
    curriculum = Curriculum(metrics=trunc())
    snap = Snapshot(curriculum)
    model = tiny_gpt2_nan((2,))
    trainer = make_trainer(tmp_path, [snap, curriculum], max_steps=6)
    with pytest.raises(NonFiniteLossError, match=r"^Curriculum: the training loss is nan at step 2; stopped before"):
        trainer.fit(model, datamodule=data())
    after = model.state_dict()
    assert sorted(snap.params) == [0, 1, 2]
    assert all(torch.equal(after[k], v) for k, v in snap.params[2].items())  # the NaN step changed nothing
    assert not all(torch.equal(after[k], v) for k, v in snap.params[1].items())  # step 1 did train
    assert curriculum.consumed_tokens == 4 * (4 + 8)  # the stopped batch is not counted


def test_warn_counts_each_nan_step_logs_and_reports_it(tmp_path, caplog):
    curriculum = Curriculum(metrics=trunc(), nonfinite_loss="warn")
    capture = MetricsCapture()
    trainer = make_trainer(tmp_path, [curriculum], max_steps=6, logger=capture)
    with (
        pytest.warns(UserWarning, match=r"Curriculum: the training loss is nan at step 2 \(nonfinite_loss='warn'"),
        caplog.at_level(logging.INFO),
    ):
        trainer.fit(tiny_gpt2_nan((2, 4)), datamodule=data())
    assert trainer.global_step == 6
    assert curriculum.state_dict()["nonfinite_loss"] == {"count": 2, "first_step": 2}
    # the running count, once per step (written straight to the loggers by the checking guard)
    # (in each batch's row of the module's own metrics: Lightning's logging step, the batches that stepped before it)
    assert capture.series("effi/nonfinite_losses") == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0)]
    assert "Curriculum: 2 non-finite training losses (the first at step 2)" in caplog.text


def test_raise_does_not_log_the_count(tmp_path):
    curriculum = Curriculum(metrics=trunc())
    capture = MetricsCapture()
    trainer = make_trainer(tmp_path, [curriculum], max_steps=2, logger=capture, log_every_n_steps=1)
    trainer.fit(tiny_gpt2_nan(), datamodule=data())
    assert capture.series("effi/curriculum/consumed_tokens")  # the curriculum's own metrics are logged
    assert capture.series("effi/nonfinite_losses") == []
    assert curriculum.state_dict()["nonfinite_loss"] == {"count": 0, "first_step": None}


def test_warn_count_is_restored_exactly_on_resume(tmp_path):
    """NaN at steps 2 and 4, a checkpoint after step 3 (one counted): the resumed run starts from that count and
    ends with both, as an uninterrupted run counts them (``test_warn_counts_each_nan_step_logs_and_reports_it``)."""
    first = Curriculum(metrics=trunc(), nonfinite_loss="warn")
    trainer = make_trainer(tmp_path / "a", [first], max_steps=3)
    trainer.fit(tiny_gpt2_nan((2, 4)), datamodule=data())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert first.state_dict()["nonfinite_loss"] == {"count": 1, "first_step": 2}
    resumed = Curriculum(metrics=trunc(), nonfinite_loss="warn")
    snap = Snapshot(resumed)
    make_trainer(tmp_path / "b", [snap, resumed], max_steps=5).fit(
        tiny_gpt2_nan((2, 4)), datamodule=data(), ckpt_path=tmp_path / "a.ckpt"
    )
    assert snap.at_start == {"count": 1, "first_step": 2}  # restored before training resumed
    assert sorted(snap.params) == [3, 4]
    assert resumed.state_dict()["nonfinite_loss"] == {"count": 2, "first_step": 2}
    assert resumed.consumed_tokens == 4 * (4 + 8 + 8 + 12 + 12)  # steps 1-5 at 4, 8, 8, 12, 12 tokens


def test_a_bad_policy_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"Curriculum\.nonfinite_loss must be one of \('raise', 'warn'\), got 'skip'"):
        Curriculum(metrics=trunc(), nonfinite_loss="skip")
    assert "nonfinite_loss='warn'" in repr(Curriculum(metrics=trunc(), nonfinite_loss="warn"))


def test_a_curriculum_datamodule_wrapped_twice_is_refused_when_built():
    """The callback attached its stream to the outer wrapper, and the inner one's loader said the callback was
    missing from the Trainer, where it was (qa48-break 03): nesting is refused when the wrapper is built, also with
    InfoBatch's wrapper between the two."""
    from lightning_effi.core.errors import DataConfigError
    from lightning_effi.data import CurriculumDataModule, InfoBatchDataModule
    from tests.helpers.tiny import tiny_lm_data

    once = CurriculumDataModule(tiny_lm_data())
    for outer in (lambda: CurriculumDataModule(once), lambda: CurriculumDataModule(InfoBatchDataModule(once))):
        with pytest.raises(DataConfigError, match=r"is a CurriculumDataModule already .* wrap your DataModule once"):
            outer()
    assert InfoBatchDataModule(once).datamodule is once
