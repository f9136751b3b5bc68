"""The curriculum's baseline for the EfficiencyMonitor (``Curriculum.effi_baseline``): the collate records what
``seqlen_truncate`` removed (``cl_full_length``, ``cl_cut_mask``), the callback gives the untruncated batch back, so
the baseline and the curriculum's saving are exact for fixed-length blocks and for variable-length padded sentences
alike."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_effi.callbacks import Curriculum
from lightning_effi.core.accounting import Baseline, EfficiencyMonitor, baseline_hook, lengthen_batch
from lightning_effi.core.batch import EffiBatch, batch_meta
from lightning_effi.core.protocols import ProvidesBaseline
from lightning_effi.curriculum.analysis.metrics import register_metric
from lightning_effi.curriculum.data import BATCH_KEYS, CurriculumCollate
from lightning_effi.data import CurriculumDataModule
from lightning_effi.reference.data.base import PaddingCollate
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import HandLM, Sentences, TinyDataModule, tiny_bert_cls, tiny_gpt2, tiny_lm_data

B = 4
TRUNC = dict(  # seqlen_truncate from 3 to 16 tokens over 14 steps (3, 4, 5, ...)
    difficulty_type="value",
    clustering_type="single_cluster",
    min_difficulty=2,
    max_difficulty=16,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=14, difficulty_step=1),
)


FIRST_TOKEN = dict(  # chooses samples only: from the 50% with the smallest first token to all of them
    difficulty_type="percentile",
    clustering_type="schedule_based",
    analysis="curriculum_test_baseline_first_token",
    min_difficulty=50,
    max_difficulty=100,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=4, difficulty_step=10),
)
register_metric("curriculum_test_baseline_first_token", lambda batch: batch["input_ids"][:, 0].long())


class IndexedSentences(Sentences):
    """:class:`Sentences` (3..16 tokens) with each sample's index, to recompute its untruncated batch by hand."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(i), "idx": torch.tensor(i)}


def sentence_data() -> CurriculumDataModule:
    return CurriculumDataModule(TinyDataModule(IndexedSentences(), batch_size=B, collate_fn=PaddingCollate(0)))


def flat(collated: EffiBatch) -> dict:
    """A collated curriculum batch as one dict: the user's batch and the metadata beside it."""
    assert isinstance(collated, EffiBatch) and not set(collated.batch) & set(collated.meta)
    return {**collated.batch, **collated.meta}


def padded(dataset: IndexedSentences, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch the user's loader makes of the samples ``idx`` (no curriculum)."""
    return PaddingCollate(0)([dataset[int(i)] for i in idx])


class Before(pl.Callback):
    """The curriculum's ``cl_*`` metadata (``batch_meta``) and the samples of every training batch."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch = {**batch, **batch_meta(trainer)}  # the user's batch and the curriculum's metadata
        self.seen.append(
            {
                "idx": batch["idx"].clone(),
                "length": int(batch["input_ids"].shape[1]),
                "full_length": batch["cl_full_length"],
                "cut_mask": batch["cl_cut_mask"],
            }
        )


class After(pl.Callback):
    """After Curriculum (no ``cl_*`` key ever reaches a batch): its ``effi_baseline`` of every
    training batch, and the module's counts of it."""

    def __init__(self, curriculum: Curriculum) -> None:
        self.curriculum, self.baselines, self.keys_left = curriculum, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.keys_left.append(sorted(k for k in batch if k.startswith("cl_")))
        self.baselines.append(self.curriculum.effi_baseline(batch, pl_module))


# ------------------------------------------------------------------------------------------------- the collate


def test_the_collate_records_what_truncation_removed():
    data = IndexedSentences()
    lengths = [len(data.items[i]) for i in range(6)]
    collate = CurriculumCollate(PaddingCollate(0), ["seqlen_truncate"])
    batch = flat(collate([(data[i], (i, 1, 0, (5,))) for i in range(6)]))
    full = padded(data, torch.arange(6))
    s = max(lengths)
    assert s > 5 and batch["cl_full_length"] == s and batch["input_ids"].shape == (6, 5)
    assert torch.equal(batch["cl_cut_mask"], full["attention_mask"][:, 5:])
    assert torch.equal(batch["attention_mask"], full["attention_mask"][:, :5])
    assert batch["cl_step"] == 1 and batch["cl_micro"] == 0 and batch["cl_difficulty"] == {"seqlen_truncate": 5}
    assert set(BATCH_KEYS) <= set(batch)
    # a difficulty at or above the batch's length cuts nothing
    whole = flat(collate([(data[i], (i, 1, 0, (s,))) for i in range(6)]))
    assert whole["cl_full_length"] == s and whole["cl_cut_mask"] is None and whole["input_ids"].shape == (6, s)
    # without an attention mask among the truncated keys: the length only; without truncation: the length too
    ids_only = CurriculumCollate(PaddingCollate(0), ["seqlen_truncate"], truncate_keys=("input_ids",))
    b = flat(ids_only([(data[i], (i, 1, 0, (5,))) for i in range(6)]))
    assert b["cl_full_length"] == s and b["cl_cut_mask"] is None and b["attention_mask"].shape == (6, s)
    other = flat(CurriculumCollate(PaddingCollate(0), ["first_token"])([(data[i], (i, 1, 0, (50,))) for i in range(6)]))
    assert other["cl_full_length"] == s and other["cl_cut_mask"] is None


def test_lengthen_batch_with_the_cut_mask():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": mask[:, :3], "labels": torch.ones(2)}
    long = lengthen_batch(batch, ("input_ids", "attention_mask"), 5, mask=mask[:, 3:])
    assert torch.equal(long["attention_mask"], mask) and long["input_ids"].shape == (2, 5)
    assert long["labels"] is batch["labels"] and batch["attention_mask"].shape == (2, 3)  # the input is unchanged
    assert lengthen_batch(batch, ("input_ids", "attention_mask"), 5)["attention_mask"].sum() == 2 * 3 - 1 + 4
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1\)"):
        lengthen_batch(batch, ("input_ids", "attention_mask"), 5, mask=mask[:, 4:])


# ------------------------------------------------------------------------------------------------- the hook


def test_the_callback_provides_the_hook():
    cb = Curriculum(metrics={"seqlen_truncate": TRUNC})
    assert isinstance(cb, ProvidesBaseline) and baseline_hook(cb) == cb.effi_baseline  # the hook, not a stopgap
    assert cb.effi_baseline({"input_ids": torch.ones(2, 3)}, None) is None  # before setup


def test_a_truncated_batch_has_the_full_length_in_its_baseline(tmp_path):
    """Variable-length padded sentences: every truncated batch's baseline is the user's own padded batch (its
    length, its attention mask); a batch the truncation left whole has none; the cl_* keys are gone."""
    cb = Curriculum(metrics={"seqlen_truncate": TRUNC}, num_epochs=4)
    before, after = Before(), After(cb)
    pl.seed_everything(0)
    make_trainer(tmp_path, [before, cb, after], max_steps=12, max_epochs=-1).fit(
        tiny_bert_cls(), datamodule=sentence_data()
    )
    data = IndexedSentences()
    assert len(before.seen) == len(after.baselines) == 12 and after.keys_left == [[]] * 12
    truncated = 0
    for seen, baseline in zip(before.seen, after.baselines):
        full = padded(data, seen["idx"])
        assert seen["full_length"] == full["input_ids"].shape[1]
        if seen["length"] == seen["full_length"]:
            assert baseline is None and seen["cut_mask"] is None
            continue
        truncated += 1
        assert isinstance(baseline, Baseline) and baseline.model is None and baseline.samples == 1.0
        assert baseline.batch["input_ids"].shape == full["input_ids"].shape  # the full length
        assert torch.equal(baseline.batch["attention_mask"], full["attention_mask"])  # its padding too
        assert baseline.batch["labels"].shape == (B,)
    assert truncated >= 6


def test_the_monitor_counts_variable_length_sentences_exactly(tmp_path):
    """The baseline is the user's untruncated padded batches: tokens = their real tokens (not the padded length,
    not the first sample's length, as a reading of the data set would give), FLOPs = the model's count of them."""
    cb = Curriculum(metrics={"seqlen_truncate": TRUNC}, num_epochs=4)
    before, monitor = Before(), EfficiencyMonitor(print_summary=False)
    pl.seed_everything(0)
    model = tiny_bert_cls()
    make_trainer(tmp_path, [monitor, before, cb], max_steps=12, max_epochs=-1).fit(model, datamodule=sentence_data())
    data = IndexedSentences()
    fulls = [padded(data, seen["idx"]) for seen in before.seen]
    flops = lambda b, t: model.effi_training_flops({"input_ids": torch.zeros(b, t, dtype=torch.long)})  # noqa: E731
    s = monitor.summary
    tokens = sum(int(f["attention_mask"].sum()) for f in fulls)
    assert s["baseline_tokens"] == tokens < 12 * B * 16 and s["baseline_samples"] == 12 * B
    assert s["baseline_layer_tokens"] == 2 * tokens
    assert s["baseline_flops"] == pytest.approx(sum(flops(B, f["input_ids"].shape[1]) for f in fulls), rel=1e-12)
    trained = sum(int(f["attention_mask"][:, : seen["length"]].sum()) for f, seen in zip(fulls, before.seen))
    assert s["tokens"] == trained < tokens
    assert s["saved/curriculum/tokens_frac"] == pytest.approx(1 - trained / tokens)
    assert s["flops_saved_frac"] > 0 and s["saved/curriculum/flops_frac"] == pytest.approx(s["flops_saved_frac"])


def test_fixed_length_blocks_and_no_truncation(tmp_path):
    """Token blocks of 16: the baseline is every batch at 16 tokens; a curriculum without seqlen_truncate has no
    baseline of its own (it only chooses samples)."""
    cb = Curriculum(metrics={"seqlen_truncate": TRUNC}, num_epochs=4)
    monitor = EfficiencyMonitor(print_summary=False)
    pl.seed_everything(0)
    make_trainer(tmp_path, [monitor, cb], max_steps=4, max_epochs=-1).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=B))
    )
    assert monitor.summary["baseline_tokens"] == 4 * B * 16 and monitor.summary["tokens"] == B * (3 + 4 + 5 + 6)
    plain = Curriculum(metrics={"first_token": FIRST_TOKEN}, percentile_rounding="proportional")
    after, monitor = After(plain), EfficiencyMonitor(print_summary=False)
    pl.seed_everything(0)
    make_trainer(tmp_path / "plain", [monitor, plain, after], max_steps=3, max_epochs=-1).fit(
        tiny_gpt2(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=B))
    )
    assert after.baselines == [None] * 3 and monitor.summary["baseline_tokens"] == monitor.summary["tokens"]


def _fit_hand_lm(tmp_path, model):
    """``model`` under a seqlen_truncate curriculum for 6 steps on blocks of 16 tokens; returns the monitor's summary
    and the lengths of the truncated batches."""
    cb = Curriculum(metrics={"seqlen_truncate": TRUNC}, num_epochs=4)
    lengths: list[int] = []

    class Lengths(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            lengths.append(int(batch["input_ids"].shape[1]))

    before, monitor = Lengths(), EfficiencyMonitor(print_summary=False)
    pl.seed_everything(0)
    make_trainer(tmp_path, [monitor, before, cb], max_steps=6, max_epochs=-1).fit(
        model, datamodule=CurriculumDataModule(tiny_lm_data(batch_size=B))
    )
    assert lengths == [3, 4, 5, 6, 7, 8]  # truncated to the schedule's difficulty (tokens)
    return monitor.summary, lengths


def test_a_module_feeding_the_causal_slice_has_its_baseline_counted_at_the_full_length(tmp_path):
    """The module feeds ``ids[:, :-1]`` (a slice of the batch tensor, not the tensor itself): the untruncated
    baseline's FLOPs are those of the same slice of the untruncated batch, ``16 - 1`` positions per row, counted by
    hand: the head's matmul, forward and backward (before, the baseline could not be replayed and the curriculum's
    FLOPs saving read 0)."""
    s, lengths = _fit_hand_lm(tmp_path, HandLM(shift=True))
    trained = sum(3 * 2 * B * (n - 1) * 16 * 64 for n in lengths)
    assert s["flops"] == trained and s["baseline_flops"] == 6 * 3 * 2 * B * (16 - 1) * 16 * 64
    assert s["flops_saved_frac"] == pytest.approx(1 - trained / s["baseline_flops"])
    assert s["saved/curriculum/flops_frac"] == pytest.approx(s["flops_saved_frac"])


class CopyingLM(HandLM):
    """Feeds a copy of the causal slice (``ids[:, :-1].clone()``): a tensor computed from the batch."""

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        logits = self(ids[:, :-1].clone())
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


class CopiedBatchLM(HandLM):
    """Feeds a copy of the batch tensor (``.clone()``, ``.contiguous()`` on a view, ``.int()``, ``.to(device)``):
    as a Hugging Face user's ``self.model(**{k: v.contiguous() for k, v in batch.items()})``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        copy = {"clone": ids.clone(), "int": ids.int(), "to": ids.to("cpu", copy=True)}[self.how]
        return torch.nn.functional.cross_entropy(self(copy).flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("how", ["clone", "int", "to"])
def test_a_module_feeding_a_copy_of_the_batch_has_its_baseline_counted_at_the_full_length(tmp_path, how):
    """A copy of a batch tensor (its shape and values) is replayed at that tensor's shape on the untruncated batch:
    its baseline was the trained FLOPs, with a warning, and the curriculum's FLOPs saving read 0 (0.344 for a
    direct call, qa38-user 01)."""
    s, lengths = _fit_hand_lm(tmp_path, CopiedBatchLM(how))
    trained = sum(3 * 2 * B * n * 16 * 64 for n in lengths)  # the head's matmul, forward and backward
    assert s["flops"] == trained and s["baseline_flops"] == 6 * 3 * 2 * B * 16 * 16 * 64
    assert s["saved/curriculum/flops_frac"] == pytest.approx(1 - trained / s["baseline_flops"])


class FixedSliceLM(HandLM):
    """Feeds the first 4 columns (``ids[:, :4]``): a slice to a fixed size, the same on the untruncated batch."""

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        logits = self(ids[:, :4])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, :4].flatten())


def test_a_fixed_size_slice_is_not_replayed_as_a_shift(tmp_path):
    """``ids[:, :4]`` of batches cut to 8..13 tokens leaves out 4 to 9 columns: replayed as "drop as many" its
    baseline read a large saving where the module computes the same at any length (0.84 in a breaker's run). A slice
    leaving out more than 2 entries is not replayed as a shift; its [B, 4] shape has no size the cut changes, so the
    baseline replays it as it is (a computed argument keeps such a shape, qa50-clip 03): the baseline is the trained
    FLOPs, saving 0, right here, now without a warning. A fixed slice within 2 entries of the batch's length cannot
    be told from the causal shift."""
    cb = Curriculum(metrics={"seqlen_truncate": {**TRUNC, "min_difficulty": 7}}, num_epochs=4)
    monitor = EfficiencyMonitor(print_summary=False)
    pl.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [monitor, cb], max_steps=6, max_epochs=-1).fit(
            FixedSliceLM(), datamodule=CurriculumDataModule(tiny_lm_data(batch_size=B))
        )
    assert not [w for w in caught if "baseline's training FLOPs" in str(w.message)]
    s = monitor.summary
    assert s["flops"] == 6 * 3 * 2 * B * 4 * 16 * 64 == s["baseline_flops"] and s["flops_saved_frac"] == 0


def test_a_baseline_whose_flops_cannot_be_replayed_says_so_and_keeps_the_trained_flops(tmp_path):
    """The trained FLOPs are counted (the head's matmul on every truncated batch); the untruncated baseline's cannot
    be, so they are taken as the trained ones (the curriculum's FLOPs saving reads 0 while its token saving is
    counted). The warning names the baseline's figure, not the trained one. The module feeds a copy of a slice, a
    tensor computed from the batch, so its shape on the untruncated batch is unknown."""
    with pytest.warns(
        UserWarning,
        match=r"EfficiencyMonitor: the baseline's training FLOPs \(the batch before curriculum changed its "
        r"shapes\) cannot be counted.*not a tensor of the batch itself nor a slice of one leaving out",
    ):
        s, lengths = _fit_hand_lm(tmp_path, CopyingLM(shift=True))
    trained = sum(3 * 2 * B * (n - 1) * 16 * 64 for n in lengths)  # the head's matmul, forward and backward
    assert s["flops"] == trained and s["baseline_flops"] == trained and s["flops_saved_frac"] == 0
    assert s["saved/curriculum/tokens_frac"] > 0
