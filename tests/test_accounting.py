"""EfficiencyMonitor: exact counts, the extension protocol, logging, and exact resume of its totals."""

import csv
import dataclasses
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from transformers import BatchEncoding

from lightning_effi.core.accounting import BatchStats, EfficiencyMonitor, batch_size_of, format_summary, tokens_of
from lightning_effi.core.flops import transformer_training_flops
from tests.harness.settings import MONITOR_TIMES
from tests.helpers.harness import assert_resume_equals_uninterrupted, fit_steps, make_trainer
from tests.helpers.tiny import (
    TINY_GPT2,
    HandLM,
    TokenBlocks,
    seqlen_truncate,
    tiny_bert_cls,
    tiny_cnn,
    tiny_gpt2,
    tiny_image_data,
    tiny_lm_data,
    tiny_sentence_data,
)


class HalveLayerTokens(pl.Callback):
    def effi_adjust(self, stats, batch, pl_module):
        return BatchStats(stats.samples, stats.tokens, stats.layer_tokens // 2, stats.flops / 2)

    def effi_summary(self):
        return {"halver/active": 1}


def test_counts_are_exact_for_a_fixed_length_lm(tmp_path):
    # 40 blocks of 16 tokens, bs 8 -> 5 batches per epoch; 7 steps = 1 epoch + 2 batches
    trainer, _ = fit_steps(tiny_gpt2, tiny_lm_data, 7, tmp_path, callbacks_fn=lambda: [EfficiencyMonitor()])
    s = trainer.callbacks[0].summary
    assert s["samples"] == 7 * 8 and s["tokens"] == 7 * 8 * 16 and s["batches"] == 7
    assert s["layer_tokens"] == s["tokens"] * TINY_GPT2["n_layer"]
    per_batch = transformer_training_flops(8, 16, 2, 32, None, 64, head="lm")
    assert s["flops"] == 7 * per_batch
    assert s["optimizer_steps"] == 7
    assert s["time_train_s"] > 0 and s["time_data_s"] > 0
    assert s["time_monitor_s"] > 0  # the first batch's FLOPs measurement at least
    assert s["time_train_s"] + s["time_data_s"] + s["time_eval_s"] + s["time_monitor_s"] <= s["time_total_s"]
    assert s["samples_per_s"] == pytest.approx(56 / (s["time_train_s"] + s["time_data_s"]))


def test_the_monitors_own_work_before_a_batch_is_not_data_time(tmp_path, monkeypatch):
    # the first batch's search of the model for its block lists (it imports timm: ~1 s) read as data time, so the
    # first run of each sweep process looked slower (qa48-hydra 01)
    import time

    watch = EfficiencyMonitor._watch

    def slow_watch(self, pl_module, batch):
        time.sleep(0.25)
        watch(self, pl_module, batch)

    monkeypatch.setattr(EfficiencyMonitor, "_watch", slow_watch)
    trainer, _ = fit_steps(tiny_gpt2, tiny_lm_data, 3, tmp_path, callbacks_fn=lambda: [EfficiencyMonitor()])
    s = trainer.callbacks[0].summary
    assert s["time_monitor_s"] >= 0.75
    assert s["time_data_s"] < 0.25 and s["time_train_s"] < 0.25 * 3


class _TwoSources(pl.LightningModule):
    """A user's module training on a batch of each of two loaders (Lightning's CombinedLoader)."""

    def __init__(self, structure: str) -> None:
        super().__init__()
        self.structure, self.lm = structure, HandLM()

    def train_dataloader(self):
        a = torch.utils.data.DataLoader(TokenBlocks(n=40), batch_size=8)
        b = torch.utils.data.DataLoader(TokenBlocks(n=40, seq_len=12, seed=1), batch_size=4)
        return {"a": a, "b": b} if self.structure == "dict" else [a, [b]]

    def training_step(self, batch, batch_idx):
        a, b = (batch["a"], batch["b"]) if self.structure == "dict" else (batch[0], batch[1][0])
        return self.lm.training_step(a, batch_idx) + self.lm.training_step(b, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("structure", ["dict", "nested list"])
def test_a_batch_of_several_training_loaders_counts_every_loader(tmp_path, structure):
    trainer, _ = fit_steps(lambda: _TwoSources(structure), lambda: None, 6, tmp_path, lambda: [EfficiencyMonitor()])
    s = trainer.callbacks[0].summary
    assert s["samples"] == 6 * (8 + 4) and s["tokens"] == 6 * (8 * 16 + 4 * 12)
    assert s["flops"] == 6 * 3 * 2 * (8 * 16 + 4 * 12) * 16 * 64  # the head's matmuls on both loaders' batches


class _TwoResumableSources(_TwoSources):
    """:class:`_TwoSources` with loaders that resume mid-epoch."""

    def train_dataloader(self):
        from lightning_effi.core.loader import EpochShuffleSampler, ResumableDataLoader

        a, b = TokenBlocks(n=40), TokenBlocks(n=40, seq_len=12, seed=1)
        return {
            "a": ResumableDataLoader(a, batch_size=8, sampler=EpochShuffleSampler(a, seed=0)),
            "b": ResumableDataLoader(b, batch_size=4, sampler=EpochShuffleSampler(b, seed=1)),
        }


def test_a_mid_epoch_resume_counts_every_loader_of_the_resumed_epoch(tmp_path):
    """Lightning skips on_train_epoch_start for the epoch a mid-epoch checkpoint resumes into: the rest of that
    epoch was counted as one loader's batches (tokens 1,408 for 1,536, qa57-loops 01)."""
    _, resumed = assert_resume_equals_uninterrupted(
        lambda: _TwoResumableSources("dict"),
        lambda: None,
        tmp_path,
        total_steps=8,
        resume_step=3,
        callbacks_fn=lambda: [EfficiencyMonitor(print_summary=False)],
        ignore_state=MONITOR_TIMES,
    )
    s = resumed.callbacks[0].summary
    assert s["samples"] == 8 * (8 + 4) and s["tokens"] == 8 * (8 * 16 + 4 * 12)


def test_tokens_count_real_tokens_only_with_padding(tmp_path):
    dm = tiny_sentence_data()
    expected = int(dm.train_dataset.sequence_lengths().sum())
    trainer, _ = fit_steps(tiny_bert_cls, lambda: dm, 5, tmp_path, callbacks_fn=lambda: [EfficiencyMonitor()])
    assert trainer.callbacks[0].summary["tokens"] == expected  # one epoch of 40 sentences


def test_extension_protocol_adjusts_counts_and_adds_summary(tmp_path):
    trainer, _ = fit_steps(
        tiny_gpt2, tiny_lm_data, 3, tmp_path, callbacks_fn=lambda: [EfficiencyMonitor(), HalveLayerTokens()]
    )
    s = trainer.callbacks[0].summary
    assert s["layer_tokens"] == 3 * 8 * 16 * 2 // 2 and s["halver/active"] == 1
    # what an effi_adjust lowers is its callback's saving, of the baseline (the run without it)
    assert s["baseline_layer_tokens"] == 3 * 8 * 16 * 2 and s["baseline_flops"] == 2 * s["flops"]
    assert s["flops_saved_frac"] == s["saved/halve_layer_tokens/flops_frac"] == 0.5
    assert s["tokens_saved_frac"] == s["saved/halve_layer_tokens/tokens_frac"] == 0.0


class StaticFlops(pl.LightningModule):
    """A module without effi_training_flops: its cost is the ``flops_per_batch`` attribute."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_gpt2()
        self.flops_per_batch = 1000

    def training_step(self, batch, batch_idx):
        return self.inner.per_sample_loss(batch)[0].mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_flops_per_batch_is_read_from_the_module_not_from_the_monitors_own_write(tmp_path):
    """The monitor writes the adjusted FLOPs to ``flops_per_batch`` for ThroughputMonitor; the next batch still
    counts the module's own value (regression: random-LTD's saving compounded batch after batch)."""
    trainer, _ = fit_steps(
        StaticFlops, tiny_lm_data, 4, tmp_path, callbacks_fn=lambda: [EfficiencyMonitor(), HalveLayerTokens()]
    )
    s = trainer.callbacks[0].summary
    assert s["flops"] == 4 * 500 and s["baseline_flops"] == 4 * 1000


def test_a_constant_flops_per_batch_with_a_technique_that_shortens_batches_is_warned(tmp_path):
    """A module's own ``flops_per_batch`` (Lightning's ThroughputMonitor convention) is one figure for every batch:
    with the curriculum's truncated batches its FLOPs saving reads 0 (tokens 45% lower), said once, naming the hook."""
    from lightning_effi.callbacks import Curriculum
    from lightning_effi.data import CurriculumDataModule

    monitor = EfficiencyMonitor(print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_steps(
            StaticFlops,
            lambda: CurriculumDataModule(tiny_lm_data()),
            6,
            tmp_path,
            callbacks_fn=lambda: [monitor, Curriculum(metrics=seqlen_truncate(total_curriculum_step=6))],
        )
    said = [str(w.message) for w in caught if "flops_per_batch is one figure" in str(w.message)]
    assert len(said) == 1 and "curriculum trains shorter batches" in said[0] and "effi_training_flops" in said[0]
    s = monitor.summary
    assert s["flops_saved_frac"] == 0.0 and s["tokens_saved_frac"] > 0.2


def test_a_checkpoint_without_baseline_resumes_with_no_saving_before(tmp_path):
    monitor = EfficiencyMonitor()
    counts = ("samples", "tokens", "layer_tokens", "flops", "batches", "time_train", "time_data", "time_eval")
    old = {"totals": {k: 10.0 for k in (*counts, "time_total")}}
    monitor.load_state_dict(old)
    assert monitor.totals["baseline_flops"] == 10.0 and monitor.totals["baseline_tokens"] == 10.0
    monitor.load_state_dict({"totals": {**old["totals"], "saved/gone/flops": 3.0}})  # an earlier technique's: kept
    assert monitor.totals["saved/gone/flops"] == 3.0
    with pytest.raises(KeyError, match="unknown"):
        monitor.load_state_dict({"totals": {**old["totals"], "bogus": 1.0}})


@pytest.mark.parametrize(
    "damage, match",
    [
        ({"totals": None}, "no totals dict"),
        ({"drop": "flops"}, r"totals lack \['flops'\]; resumed, they would restart at 0"),
        ({"curve": 5}, "curve must be a list of dicts, got int 5"),
        ({"schedule": [1.0]}, "schedule must be a list of dicts"),
        ({"skipped_validations": [2.5]}, r"skipped_validations must be a list of steps \(ints >= 0\), got list"),
        ({"skipped_validations": 4}, r"skipped_validations must be a list of steps \(ints >= 0\), got int 4"),
    ],
)
def test_a_monitor_state_missing_totals_or_with_damaged_curves_is_refused(damage, match):
    """An edited checkpoint whose totals lack a count would resume it from 0 (the steps before the checkpoint lost
    from it, silently); one whose curve is not a list would fail later with a bare TypeError."""
    state = {"totals": dict.fromkeys(EfficiencyMonitor().totals, 1.0), "curve": [], "schedule": []}
    state.update({k: v for k, v in damage.items() if k != "drop"})
    if "drop" in damage:
        del state["totals"][damage["drop"]]
    monitor = EfficiencyMonitor()
    before = dict(monitor.totals)
    with pytest.raises(ValueError, match=match):
        monitor.load_state_dict(state)
    assert monitor.totals == before  # nothing restored


def test_a_checkpoints_single_skipped_validation_is_read():
    """Checkpoints of a3ea8c7 held one pending step as ``skipped_validation`` (an int): read as the list it is now
    (ignored, the resumed fit lost its warning, qa98-regress 01)."""
    state = {"totals": dict.fromkeys(EfficiencyMonitor().totals, 1.0), "curve": [], "schedule": []}
    monitor = EfficiencyMonitor()
    monitor.load_state_dict({**state, "skipped_validation": 2})
    assert monitor._skipped_validations == [2]
    monitor.load_state_dict({**state, "skipped_validation": None})
    assert monitor._skipped_validations == []
    with pytest.raises(ValueError, match="skipped_validations must be a list of steps"):
        monitor.load_state_dict({**state, "skipped_validation": 2.5})


def _logged_rows(tmp_path, monitor: EfficiencyMonitor, **trainer_kwargs) -> list[dict[str, str]]:
    """Fit the tiny GPT-2 for 4 optimizer steps with ``monitor`` and a CSV logger; its rows that hold effi metrics."""
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=CSVLogger(tmp_path, name="csv", version=""),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    with open(tmp_path / "csv" / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("effi/samples")]


def test_metrics_are_logged(tmp_path):
    rows = _logged_rows(tmp_path, EfficiencyMonitor(log_every_n_steps=2))
    assert [float(r["effi/samples"]) for r in rows][:2] == [16.0, 32.0]
    assert {
        "effi/tokens",
        "effi/layer_tokens",
        "effi/flops",
        "effi/time/train",
        "effi/time/data",
        "effi/time/eval",
    } <= set(rows[0])


def test_metrics_are_logged_once_per_optimizer_step_under_gradient_accumulation(tmp_path):
    """accumulate_grad_batches=2: one row per optimizer step, after its last micro-batch (never a micro-batch's
    count at the step before), and no second row for the epoch's last step."""
    rows = _logged_rows(
        tmp_path, EfficiencyMonitor(print_summary=False), accumulate_grad_batches=2, log_every_n_steps=1
    )
    # 8 samples a micro-batch, 2 micro-batches a step, 5 batches an epoch (its last step has one micro-batch); rows
    # at Lightning's logging step (the steps taken before the batch), beside the module's own train/loss
    assert [(int(r["step"]), float(r["effi/samples"])) for r in rows] == [(0, 16.0), (1, 32.0), (2, 40.0), (3, 56.0)]


class _Levels(pl.Callback):
    """A technique's schedule state, ``levels/level`` = 7.0 (``effi_schedule_state``), for the progress bar."""

    effi_name = "levels"

    def effi_schedule_state(self) -> dict[str, float]:
        return {"level": 7.0}


class _LogsLevel(type(tiny_gpt2())):  # type: ignore[misc]
    def training_step(self, batch, batch_idx):
        self.log("level", 123.0, prog_bar=True)  # the user's own metric of the same name
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("own_level", [False, True])
def test_technique_states_in_the_progress_bar_never_overwrite_a_metric_of_the_module(tmp_path, own_level):
    """A technique state is shown under its short name (``level``), or under ``levels/level`` when the module logs a
    ``level`` of its own: the module's value stays in ``callback_metrics`` (a ModelCheckpoint may monitor it)."""
    pl.seed_everything(0)
    model = tiny_gpt2()
    if own_level:
        model.__class__ = _LogsLevel
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        callbacks=[_Levels(), EfficiencyMonitor(print_summary=False)],
        enable_progress_bar=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=tiny_lm_data())
    bar = trainer.progress_bar_metrics
    if own_level:
        assert float(trainer.callback_metrics["level"]) == 123.0 and bar["levels/level"] == 7.0
    else:
        assert bar["level"] == 7.0 and "levels/level" not in bar


class _SkipsOddBatches(type(tiny_gpt2())):  # type: ignore[misc]
    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)  # None: Lightning skips the batch


def test_batches_a_training_step_skips_are_not_counted_as_trained(tmp_path):
    """A training_step that returns None for every other batch (Lightning trains nothing on it) counts half the
    samples, tokens and FLOPs of a run that trains them all, with one warning."""
    summaries = []
    for skip in (False, True):
        pl.seed_everything(0)
        model = tiny_gpt2()
        if skip:
            model.__class__ = _SkipsOddBatches
        monitor = EfficiencyMonitor(print_summary=False)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=4,
            logger=False,
            callbacks=[monitor],
            enable_progress_bar=False,
            enable_checkpointing=False,
            limit_val_batches=0,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, datamodule=tiny_lm_data())
        skipped = [w for w in caught if "training_step returned None at batch 1" in str(w.message)]
        assert len(skipped) == skip
        summaries.append(monitor.summary)
    full, half = summaries
    for key in ("samples", "tokens", "layer_tokens", "flops", "batches"):
        assert half[key] == full[key] / 2 > 0, key


def test_resume_mid_epoch_keeps_exact_counts(tmp_path):
    assert_resume_equals_uninterrupted(
        tiny_gpt2,
        tiny_lm_data,
        tmp_path,
        total_steps=8,
        resume_step=3,
        callbacks_fn=lambda: [EfficiencyMonitor(print_summary=False)],
        ignore_state=MONITOR_TIMES,
    )


def test_resume_from_the_last_batch_of_an_epoch(tmp_path):
    """A checkpoint taken after an epoch's last batch (before its epoch end) resumes into the next epoch with that
    epoch's data (regression: the loader skipped the whole next epoch)."""
    assert_resume_equals_uninterrupted(
        tiny_gpt2,
        tiny_lm_data,
        tmp_path,
        total_steps=8,
        resume_step=5,  # 5 batches per epoch
        callbacks_fn=lambda: [EfficiencyMonitor(print_summary=False)],
        ignore_state=MONITOR_TIMES,
    )


def test_helpers_and_validation():
    assert batch_size_of({"input_ids": torch.zeros(3, 5)}) == 3
    assert batch_size_of((torch.zeros(4, 2), torch.zeros(4))) == 4
    assert tokens_of({"input_ids": torch.zeros(2, 5), "attention_mask": torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])}) == 7
    assert tokens_of({"pixel_values": torch.zeros(2, 3)}) == 0
    # any batch structure: dataclasses, nested tuples of dicts, BatchEncoding, text beside the tensors
    batch = Pair(text=["a", "b", "c"], ids=torch.ones(3, 6, dtype=torch.long))
    assert batch_size_of(batch) == 3 and tokens_of(batch) == 18
    nested = (["x"], {"enc": BatchEncoding({"input_ids": torch.ones(2, 4, dtype=torch.long)})})
    assert batch_size_of(nested) == 2 and tokens_of(nested) == 8
    assert tokens_of((torch.randn(2, 3, 8, 8), torch.zeros(2, dtype=torch.long))) == 0  # images: no token ids
    with pytest.raises(TypeError, match="no tensor"):
        batch_size_of(["some", "text"])
    assert "samples" in format_summary({"samples": 3, "flops": 1.5e12})
    with pytest.raises(ValueError, match="log_every_n_steps"):
        EfficiencyMonitor(log_every_n_steps=0)


@dataclasses.dataclass
class Pair:
    text: list[str]
    ids: torch.Tensor


def test_what_cannot_be_counted_reads_zero_with_one_warning_per_quantity():
    """A batch of strings on a module with no network: samples, tokens and FLOPs read 0, each warned once."""
    monitor = EfficiencyMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert monitor.module_stats(pl.LightningModule(), ["some", "text"]) == BatchStats(0, 0, 0, 0.0)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3
    assert "samples cannot be counted" in messages[0]
    assert "`effi_count_tokens(batch) -> int`" in messages[1] and "`effi_training_flops(batch)`" in messages[2]


def test_resume_check_detects_a_non_resumable_loader(tmp_path):
    """Negative control: a plain shuffled DataLoader replays the epoch head on a mid-epoch resume, and the harness
    must notice."""
    from tests.helpers.tiny import TinyDataModule, TokenBlocks

    class PlainLoaderData(TinyDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.train_dataset, batch_size=8, shuffle=True)

    with pytest.raises(AssertionError):
        assert_resume_equals_uninterrupted(
            tiny_gpt2, lambda: PlainLoaderData(TokenBlocks()), tmp_path, total_steps=4, resume_step=2
        )


def test_the_monitor_must_come_before_a_technique_that_changes_model_shapes(tmp_path):
    """The V-cycle replaces the model in its on_train_batch_end: a monitor listed after it would count the batch just
    trained with the next level's model, so that order is refused at setup, naming both."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_effi import VCycleCallback
    from tests.helpers.harness import make_trainer
    from tests.helpers.tiny import tiny_gpt2, tiny_lm_data

    trainer = make_trainer(
        tmp_path, [VCycleCallback(e_a=1, e_small=1), EfficiencyMonitor(print_summary=False)], max_steps=3
    )
    with pytest.raises(MisconfigurationException, match="EfficiencyMonitor must come before VCycleCallback"):
        trainer.fit(tiny_gpt2(), datamodule=tiny_lm_data(batch_size=4))


def test_a_further_fit_of_the_same_trainer_goes_on_counting(tmp_path):
    """Fit 3 steps, raise max_steps to 7, fit again on the same Trainer: the totals are those of 7 steps (before the
    fix they covered only the second fit's 4 while optimizer_steps said 7). A monitor that did not count a Trainer's
    earlier training refuses a further fit of it, naming the remedies."""
    from tests.helpers.harness import make_trainer

    monitor = EfficiencyMonitor(print_summary=False)
    model, data = tiny_gpt2(), tiny_lm_data()
    trainer = make_trainer(tmp_path / "a", [monitor], max_steps=3)
    trainer.fit(model, datamodule=data)
    trainer.fit_loop.epoch_loop.max_steps = 7
    trainer.fit(model, datamodule=data)
    s = monitor.summary
    per_batch = transformer_training_flops(8, 16, 2, 32, None, 64, head="lm")
    assert (s["optimizer_steps"], s["batches"], s["samples"], s["flops"]) == (7, 7, 56, 7 * per_batch)
    first = make_trainer(tmp_path / "c", max_steps=2)
    first.fit(tiny_gpt2(), datamodule=tiny_lm_data())
    first.callbacks.append(EfficiencyMonitor(print_summary=False))
    first.fit_loop.epoch_loop.max_steps = 4
    with pytest.raises(pl.utilities.exceptions.MisconfigurationException, match="starts at step 2 of a Trainer"):
        first.fit(tiny_gpt2(), datamodule=tiny_lm_data())


def test_a_fit_that_raised_resumes_from_its_checkpoint_on_the_same_trainer(tmp_path):
    """A fit that raised at step 4, resumed on the same Trainer with ckpt_path= (as the refusal advises): refused by
    the monitor's setup as a further fit of a Trainer it did not count to its end (qa110-regress 06). The checkpoint
    gives the totals back (its step 2): all 6 steps are counted, as in a fit that never stopped."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers.harness import make_trainer

    class Raise(pl.Callback):
        armed = True

        def on_train_batch_end(self, trainer, *args):
            if self.armed and trainer.global_step == 4:
                self.armed = False
                raise RuntimeError("stopped by the test")

    monitor = EfficiencyMonitor(print_summary=False)
    every = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = make_trainer(tmp_path / "a", [monitor, every, Raise()], max_steps=6)
    model = tiny_gpt2()
    with pytest.raises(RuntimeError, match="stopped by the test"):
        trainer.fit(model, datamodule=tiny_lm_data())
    trainer.fit(model, datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=2.ckpt"))
    s = monitor.summary
    per_batch = transformer_training_flops(8, 16, 2, 32, None, 64, head="lm")
    assert (s["optimizer_steps"], s["batches"], s["samples"], s["flops"]) == (6, 6, 48, 6 * per_batch)


def test_a_monitor_added_on_resume_is_refused(tmp_path):
    """A checkpoint at step 2 of a fit without the monitor, resumed with one: its totals would start at 0 at step 2
    (a summary of 2 steps' FLOPs and samples beside optimizer_steps=4, and a result.json that reads as a cheaper run).
    Refused before any batch, as a further fit of a Trainer the monitor did not count; a checkpoint of a fit with the
    monitor resumes with the totals of all 4 steps."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers.harness import make_trainer

    every = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    make_trainer(tmp_path / "a", [every], max_steps=2).fit(tiny_gpt2(), datamodule=tiny_lm_data())
    monitor = EfficiencyMonitor(print_summary=False)
    with pytest.raises(pl.utilities.exceptions.MisconfigurationException) as err:
        make_trainer(tmp_path / "b", [monitor], max_steps=4).fit(
            tiny_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck" / "step=2.ckpt")
        )
    assert str(err.value).startswith(
        "EfficiencyMonitor: this fit resumes a checkpoint at step 2 written by a fit without an EfficiencyMonitor, so "
        "its totals (samples, tokens, FLOPs, time) would cover only the steps after 2"
    )
    assert monitor.totals["batches"] == 0
    counted = ModelCheckpoint(dirpath=tmp_path / "ck2", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    make_trainer(tmp_path / "c", [EfficiencyMonitor(print_summary=False), counted], max_steps=2).fit(
        tiny_gpt2(), datamodule=tiny_lm_data()
    )
    resumed = EfficiencyMonitor(print_summary=False)
    make_trainer(tmp_path / "d", [resumed], max_steps=4).fit(
        tiny_gpt2(), datamodule=tiny_lm_data(), ckpt_path=str(tmp_path / "ck2" / "step=2.ckpt")
    )
    per_batch = transformer_training_flops(8, 16, 2, 32, None, 64, head="lm")
    assert (resumed.summary["optimizer_steps"], resumed.summary["flops"]) == (4, 4 * per_batch)


def test_stochastic_weight_averagings_batch_norm_epoch_is_not_counted_as_training(tmp_path):
    """Lightning's StochasticWeightAveraging adds a forward-only epoch (no backward, no optimizer step) to update the
    averaged weights' batch-norm statistics. It was counted as a training epoch: samples 200 for the 160 trained,
    FLOPs x1.25 on a module with its own FLOPs formula. Now it is skipped, with one warning."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    summaries = []
    for swa in (False, True):
        pl.seed_everything(0)
        monitor = EfficiencyMonitor(print_summary=False)
        extra = [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)] if swa else []
        trainer = make_trainer(tmp_path / str(swa), [monitor, *extra], max_epochs=4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(tiny_cnn(), datamodule=tiny_image_data())
        forward_only = [w for w in caught if "runs forward passes only" in str(w.message)]
        assert len(forward_only) == swa and trainer.current_epoch == 4 + swa
        summaries.append(monitor.summary)
    plain, averaged = summaries
    for key in ("samples", "flops", "batches"):
        assert averaged[key] == plain[key] > 0, key


def test_a_cnn_on_image_batches_counts_no_tokens_without_a_warning(tmp_path):
    """A plain CNN on ``(images, labels)`` batches has no tokens: it is said once as information, not a warning to
    define ``effi_count_tokens`` in every run (qa86-user 04); samples and FLOPs are counted."""

    class SmallCNN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 10)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    pl.seed_everything(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3, 8, 8), torch.randint(0, 10, (32,)))
    monitor = EfficiencyMonitor(print_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [monitor], max_steps=4).fit(SmallCNN(), torch.utils.data.DataLoader(data, batch_size=8))
    assert not [str(w.message) for w in caught if "effi_count_tokens" in str(w.message)]
    assert monitor.totals["samples"] == 32 and monitor.totals["tokens"] == 0 and monitor.totals["flops"] > 0
