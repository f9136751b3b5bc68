"""The curriculum on LightningModules as users write them (issue #18): any batch structure (tensor, tuple, list, dict
with any names, dataclass, HF ``BatchEncoding``), a plain ``loss`` return, HF models built from a config (never
downloaded). ``seqlen_truncate`` cuts every ``[B, T, ...]`` tensor of the batch's sequence length, handles left
padding, can keep each row's last real token, and fails clearly when there is nothing to cut."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import BatchEncoding, BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from lightning_effi.callbacks import Curriculum
from lightning_effi.core.accounting import Baseline, EfficiencyMonitor
from lightning_effi.core.batch import EffiBatch, batch_meta
from lightning_effi.core.errors import DataConfigError
from lightning_effi.curriculum import CurriculumConfigError
from lightning_effi.curriculum import functional as F
from lightning_effi.curriculum.analysis.metrics import register_metric
from lightning_effi.curriculum.data import CurriculumCollate
from lightning_effi.data import CurriculumDataModule
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TinyDataModule

B, T, V = 4, 16, 32
TRUNC = dict(  # seqlen_truncate 3, 4, 5, ... tokens at steps 1, 2, 3, ... (16 from step 14 on)
    difficulty_type="value",
    clustering_type="single_cluster",
    min_difficulty=2,
    max_difficulty=16,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=14, difficulty_step=1),
)
SCHEDULE = [3, 4, 5, 6, 7, 8]  # the lengths of steps 1..6, by hand: min + (max - min) * s / 14 = 2 + s
CLS, SEP, PAD = 1, 2, 0


def ids_and_mask(lengths: list[int], side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of distinct token ids (row b: 100·b + column) and their attention mask, padded on ``side``."""
    t = max(lengths)
    ids = torch.arange(len(lengths))[:, None] * 100 + torch.arange(t)[None, :]
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "right":
            mask[b, :n] = 1
        else:
            mask[b, t - n :] = 1
    return ids, mask


# --------------------------------------------------------------------------------------- the functional core


def test_a_dict_with_any_names_truncates_every_sequence_tensor():
    ids = torch.arange(B * T).view(B, T)
    batch = {"input_ids": ids, "targets": ids + 1, "emb": torch.ones(B, T, 3), "label": torch.arange(B), "n": 7}
    out = F.truncate_batch(batch, 5)
    assert torch.equal(out["input_ids"], ids[:, :5]) and torch.equal(out["targets"], ids[:, :5] + 1)
    assert out["emb"].shape == (B, 5, 3) and out["label"] is batch["label"] and out["n"] == 7
    assert batch["targets"].shape == (B, T)  # the input is not modified
    # truncate_keys restricts the cut to the tensors of those names
    only = F.truncate_batch(batch, 5, keys=["input_ids"])
    assert only["input_ids"].shape == (B, 5) and only["targets"] is batch["targets"]
    # causal_label_shift keeps d + 1 tokens; a difficulty at or above T changes nothing
    assert F.truncate_batch(batch, 5, causal_label_shift=True)["targets"].shape == (B, 6)
    assert F.truncate_batch(batch, T)["targets"] is batch["targets"]


def test_the_cut_tensors_are_contiguous_for_a_models_own_view():
    """Hugging Face's ``BertForMaskedLM`` computes its loss with ``labels.view(-1)``: on the cut batch's narrowed
    views it failed at the first step with torch's "view size is not compatible" (qa38-user 02). The cut tensors are
    contiguous, and the model's loss on them is its loss on the first 6 columns."""
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(
        BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    ).eval()  # no dropout: the two losses compare exactly
    ids = torch.randint(5, 40, (B, T))
    labels = torch.where(torch.rand(B, T) < 0.3, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]  # a labelled token in every row's cut
    batch = {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long), "labels": labels}
    out = F.truncate_batch(batch, 6)
    assert all(v.is_contiguous() and v.shape == (B, 6) for v in out.values())
    expected = model(**{k: v[:, :6].clone() for k, v in batch.items()}).loss
    assert torch.equal(model(**out).loss, expected)


class Pair(NamedTuple):
    ids: torch.Tensor
    labels: torch.Tensor


@pytest.mark.parametrize("kind", [tuple, list, Pair])
def test_tuple_and_list_batches_truncate_every_entry(kind):
    ids = torch.arange(B * T).view(B, T)
    batch = kind([ids, ids.clone(), torch.arange(B)]) if kind is not Pair else Pair(ids, ids.clone())
    out = F.truncate_batch(batch, 4)
    assert type(out) is kind and len(out) == len(batch)
    assert torch.equal(out[0], ids[:, :4]) and torch.equal(out[1], ids[:, :4])
    if kind is not Pair:
        assert out[2] is batch[2]  # the [B] labels stay
    assert F.sequence_length(batch) == T and F.sequence_length(out) == 4


@dataclasses.dataclass(frozen=True)
class UserBatch:
    tokens: torch.Tensor
    mask: torch.Tensor
    label: torch.Tensor
    note: str = "kept"


def test_a_dataclass_and_a_batch_encoding_keep_their_type():
    ids, mask = ids_and_mask([7, 5, 3])
    user = UserBatch(ids, mask, torch.tensor([0, 1, 0]))
    out = F.truncate_batch(user, 4)
    assert type(out) is UserBatch and out.note == "kept" and out.label is user.label
    assert torch.equal(out.tokens, ids[:, :4]) and torch.equal(out.mask, mask[:, :4]) and user.tokens.shape == (3, 7)
    enc = BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 0])})
    out = F.truncate_batch(enc, 4)
    assert type(out) is BatchEncoding and out is not enc and enc["input_ids"].shape == (3, 7)
    assert torch.equal(out.input_ids, ids[:, :4]) and torch.equal(out["attention_mask"], mask[:, :4])
    assert out.labels is enc.labels


def test_left_padding_keeps_every_rows_real_tokens_at_the_end():
    lengths = [7, 2, 4, 5]
    ids, mask = ids_and_mask(lengths, side="left")
    cut = F.truncate({"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}, 3)
    assert cut.left and cut.full_length == 7 and cut.length == 3
    assert torch.equal(cut.batch["input_ids"], ids[:, 4:]) and torch.equal(cut.batch["labels"], ids[:, 4:])
    kept = cut.batch["attention_mask"]
    assert kept.sum(1).tolist() == [min(n, 3) for n in lengths] and bool(kept[:, -1].all())  # no empty row
    for b, n in enumerate(lengths):  # each row's last min(n, 3) real tokens, in order
        assert cut.batch["input_ids"][b, 3 - min(n, 3) :].tolist() == ids[b, 7 - min(n, 3) :].tolist()
    # the right-padded cut of the same rows would have emptied row 1: it keeps the first 3 columns instead
    right = F.truncate({"input_ids": ids, "attention_mask": ids_and_mask(lengths)[1]}, 3)
    assert not right.left and torch.equal(right.batch["input_ids"], ids[:, :3])
    # the baseline puts the removed mask columns back where they were
    assert torch.equal(cut.cut_mask, mask[:, :4])
    assert torch.equal(F.lengthen_batch(cut.batch, None, 7, cut.cut_mask, left=True)["attention_mask"], mask)


def test_left_padding_without_a_mask_is_refused_and_text_opening_with_a_repeated_token_is_cut():
    """SASRec's (seq, pos, neg) histories, padded on the left with item 0 and no mask in the batch: every position
    counts as real, and the cut kept the padding and the oldest items (4 of 8 rows all padding, qa43-user 01). Rows
    opening with a run of one id that never comes back after their other ids are refused, naming the remedy; a row
    that opens with a repeated token that recurs later (indentation, a poly-A stretch) is text."""
    lengths = [7, 2, 4, 5]
    ids, mask = ids_and_mask(lengths, side="left")
    seq = torch.where(mask.bool(), ids + 1, 0)  # item 0 pads
    for length in (3, 6):  # rows emptied by the cut, or only their last items cut away
        with pytest.raises(ValueError, match=r"no padding mask, and rows \[1, 2, 3\] open with a run of id 0 .*mask"):
            F.truncate((seq, seq.roll(-1, 1), seq + 7), length, check_left_padding=True)
    assert F.truncate(seq, 3).length == 3  # checked only when asked: the curriculum asks at its first cut
    cut = F.truncate((seq, mask), 3, check_left_padding=True)  # with the mask in the tuple: each row's last items
    assert cut.left and torch.equal(cut.batch[0], seq[:, 4:])
    code = torch.tensor([[32, 32, 32, 32, 105, 102, 32, 120], [100, 101, 102, 32, 32, 103, 104, 105]])
    assert torch.equal(F.truncate(code, 4, check_left_padding=True).batch, code[:, :4])  # spaces come back
    # text whose rows open with a doubled letter that never comes back ("ll" of "I'll"): 2 rows of 64 are not a
    # quarter of the batch (a run of Tiny Shakespeare stopped at step 322, qa44-break 02)
    text = torch.randint(3, 60, (64, 16), generator=torch.Generator().manual_seed(0))
    text[:2, :2], text[:2, 2:] = 1, text[:2, 2:].clamp_min(2)
    assert F.truncate(text, 8, check_left_padding=True).length == 8
    # GPT-2's convention: padded on the left with the end-of-text id, which also ends every row (qa44-break 06: 3 of
    # 4 rows all padding after a cut to 8 of 32)
    eos, g = 50256, torch.Generator().manual_seed(0)
    gpt2 = torch.stack(
        [
            torch.cat([torch.full((32 - n,), eos), torch.randint(0, 50000, (n - 1,), generator=g), torch.tensor([eos])])
            for n in (32, 12, 6, 20)
        ]
    )
    with pytest.raises(ValueError, match=r"rows \[1, 2, 3\] open with a run of id 50256 .*but as their last token"):
        F.truncate({"input_ids": gpt2}, 8, check_left_padding=True)
    right = torch.cat([gpt2[:, -12:], torch.full((4, 20), eos)], 1)  # the same rows padded on the right: cut as text
    assert torch.equal(F.truncate({"input_ids": right}, 8, check_left_padding=True).batch["input_ids"], right[:, :8])


def test_a_mask_padded_on_both_sides_is_refused():
    ids, mask = ids_and_mask([6, 2, 4])
    mask[1] = torch.tensor([0, 0, 0, 0, 1, 1])  # row 1 left-padded among right-padded rows
    with pytest.raises(ValueError, match=r"seqlen_truncate: .* rows \[1\] without a real token.*both sides"):
        F.truncate({"input_ids": ids, "attention_mask": mask}, 3)


def test_keep_last_token_keeps_each_rows_last_real_token():
    lengths = [9, 2, 4, 6]
    ids, mask = ids_and_mask(lengths)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids + 1000}
    cut = F.truncate(batch, 4, keep_last_token=True)
    out = cut.batch
    assert out["input_ids"].shape == (4, 4) and not cut.left
    for b, n in enumerate(lengths):
        last = min(n, 4) - 1
        assert out["input_ids"][b, last] == ids[b, n - 1]  # the last real token ([SEP] / EOS) stays last
        assert out["input_ids"][b, :last].tolist() == ids[b, :last].tolist()
        assert int(out["attention_mask"][b].sum()) == min(n, 4)
    assert torch.equal(out["labels"], out["input_ids"] + 1000)  # every cut tensor moves the same way
    assert torch.equal(F.truncate_batch(batch, 4)["input_ids"], ids[:, :4])  # the default keeps the first 4
    # the removed mask values go back after the kept ones: the user's mask exactly
    assert torch.equal(F.lengthen_batch(out, None, 9, cut.cut_mask)["attention_mask"], mask)
    # without a mask every position is real: the last column ends every cut row
    tup = F.truncate_batch((ids, ids + 1000), 4, keep_last_token=True)
    assert torch.equal(tup[0][:, :3], ids[:, :3]) and torch.equal(tup[0][:, 3], ids[:, -1])
    assert torch.equal(tup[1], tup[0] + 1000)


# --------------------------------------------------------------------------------------------- the collate


def test_nothing_truncatable_is_a_clear_error_at_the_first_batch(tmp_path):
    images = [(torch.randn(3, 8, 8), torch.tensor(i % 2)) for i in range(B)]
    collate = CurriculumCollate(None, ["seqlen_truncate"])
    with pytest.raises(DataConfigError, match=r"seqlen_truncate: nothing to truncate.*float32\[4, 3, 8, 8\]"):
        collate([(s, (i, 1, 0, (4,))) for i, s in enumerate(images)])
    # a tuple series of continuous features (x, padding, y): the message names what such a batch can do
    series = [(torch.randn(T, 4), torch.zeros(T, dtype=torch.bool), torch.tensor(1)) for _ in range(B)]
    with pytest.raises(DataConfigError, match=r"continuous features \[B, S, D\] without token ids: a dict batch "
                       r"\{'x': \.\.\., 'attention_mask'"):  # fmt: skip
        collate([(s, (i, 1, 0, (4,))) for i, s in enumerate(series)])
    named = CurriculumCollate(None, ["seqlen_truncate"], truncate_keys=["tokens"])
    samples = [{"input_ids": torch.arange(T)} for _ in range(B)]
    with pytest.raises(DataConfigError, match=r"none of truncate_keys \['tokens'\].*input_ids: int64\[4, 16\]"):
        named([(s, (i, 1, 0, (4,))) for i, s in enumerate(samples)])

    # a graph batch (PyG's layout): its edge_index [2, E] was read as token ids [B=2, T=E] and every graph lost
    # edges, in silence (qa54-domains 01)
    def graphs(items):
        sizes = [len(x) for x, _ in items]
        offsets = torch.tensor([0, *sizes[:-1]]).cumsum(0)
        edges = torch.cat([e + o for (_, e), o in zip(items, offsets)], 1)
        batch = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
        return {"x": torch.cat([x for x, _ in items]), "edge_index": edges, "batch": batch,
                "y": torch.arange(len(items))}  # fmt: skip

    g = torch.Generator().manual_seed(0)
    samples = [(torch.randn(6, 3, generator=g), torch.randint(0, 6, (2, 20), generator=g)) for _ in range(B)]
    with pytest.raises(
        DataConfigError, match=r"a graph batch: its edge_index \[2, E\] is no sequence.*edge_index: int64\[2, 80\]"
    ):
        CurriculumCollate(graphs, ["seqlen_truncate"])([(s, (i, 1, 0, (4,))) for i, s in enumerate(samples)])
    # edge_index first (qa55-break 04), position ids [1, T] beside the tokens, a task id [1] before them
    from lightning_effi.curriculum import functional as CF

    x, edges = torch.randn(24, 3), torch.randint(0, 24, (2, 30))
    assert CF.sequence_reference({"edge_index": edges, "x": x, "batch": torch.zeros(24, dtype=torch.long)}) is None
    # an unnamed (edge_index, x) tuple: its edge list was cut to [2, 5] (qa55-break 04); token ids [2, T] beside
    # labels [2], or beside features of their own batch size, stay ids
    assert CF.sequence_reference((edges, x)) is None and CF.truncate_batch((edges, x), 5)[0] is edges
    assert CF.truncate_batch((edges, x, torch.tensor([0, 1])), 5)[0] is edges  # labels of 2 graphs (qa58-break 03)
    assert CF.truncate_batch((edges, x, torch.randn(2, 1)), 5)[0] is edges  # regression targets (qa59-break 07)
    with pytest.raises(DataConfigError, match=r"a graph batch: its edge_index \[2, E\] is no sequence"):
        CurriculumCollate(lambda items: (edges, x), ["seqlen_truncate"])([(s, (i, 1, 0, (4,))) for i, s in
                                                                        enumerate(samples)])  # fmt: skip
    pair = torch.randint(0, 9, (2, T))
    assert CF.sequence_reference((pair, torch.tensor([0, 1]))) is pair
    assert CF.sequence_reference((pair, torch.randn(2, 3))) is pair
    assert CF.sequence_reference((pair,)) is pair
    ids = torch.randint(0, 9, (B, T))
    assert CF.sequence_reference({"position_ids": torch.arange(T)[None], "tokens": ids}) is ids
    assert CF.sequence_reference({"task": torch.tensor([1]), "ids": ids}) is ids
    # time ids of another name first, broadcast [1, T]: cut with the tokens; a word holding "position" is no index
    # (qa56-break 04)
    cut = CF.truncate_batch({"timestep_ids": torch.arange(T)[None], "tokens": ids}, 4)
    assert cut["tokens"].shape == (B, 4) and cut["timestep_ids"].tolist() == [[0, 1, 2, 3]]
    # unnamed in a tuple: left whole, the model crashed on 4 vs 8 positions (qa57-break)
    times, kept = CF.truncate_batch((torch.arange(T)[None], ids), 4)
    assert times.tolist() == [[0, 1, 2, 3]] and torch.equal(kept, ids[:, :4])
    assert CF.truncate_batch({"composition": ids}, 4)["composition"].shape == (B, 4)
    # through the Trainer: the first training batch raises, before any step
    data = CurriculumDataModule(TinyDataModule(ImagePairs(), batch_size=B))
    trainer = make_trainer(tmp_path, [Curriculum(metrics={"seqlen_truncate": TRUNC})], max_steps=2, max_epochs=-1)
    with pytest.raises(DataConfigError, match="seqlen_truncate: nothing to truncate"):
        trainer.fit(TupleGPT2(), datamodule=data)
    assert trainer.global_step == 0


def test_the_collate_truncates_tuple_batches_and_records_the_full_length():
    samples = [(torch.arange(T) + i, torch.arange(T) - i) for i in range(B)]
    out = CurriculumCollate(stack_pairs, ["seqlen_truncate"])([(s, (i, 3, 0, (5,))) for i, s in enumerate(samples)])
    assert isinstance(out, EffiBatch) and type(out.batch) is tuple
    assert torch.equal(out.batch[0], torch.stack([s[0] for s in samples])[:, :5])
    assert torch.equal(out.batch[1], torch.stack([s[1] for s in samples])[:, :5])
    assert out.meta["cl_full_length"] == T and out.meta["cl_cut_mask"] is None and out.meta["cl_cut_left"] is False
    assert out.meta["cl_step"] == 3 and out.meta["cl_difficulty"] == {"seqlen_truncate": 5}
    # default_collate makes a list of tuple samples: cut too
    listed = CurriculumCollate(None, ["seqlen_truncate"])([(s, (i, 3, 0, (5,))) for i, s in enumerate(samples)])
    assert type(listed.batch) is list and [x.shape for x in listed.batch] == [(B, 5), (B, 5)]


def seq2seq_batch(source: int, target: int) -> dict[str, torch.Tensor]:
    ids, mask = ids_and_mask([source] * B, "right")
    return {"input_ids": ids % V, "attention_mask": mask, "labels": torch.arange(B * target).view(B, target) % V}


def test_a_tensor_cut_in_one_batch_and_left_whole_in_another_is_refused_naming_truncate_keys():
    """An encoder-decoder batch: the targets have a length of their own. The automatic rule cut them exactly where
    their padded length equalled the source's (5 of 15 batches in the helper's run, without a word): the first
    batch that shows a tensor both ways is refused, naming it and truncate_keys; named keys cut the source only."""
    collate = CurriculumCollate(None, ["seqlen_truncate"])
    key = lambda i: (i, 1, 0, (4,))  # noqa: E731
    first = collate._transform(seq2seq_batch(8, 6), [key(i) for i in range(B)])  # targets of their own length
    assert first.batch["labels"].shape == (B, 6) and first.batch["input_ids"].shape == (B, 4)
    with pytest.raises(
        DataConfigError,
        match=r"'labels' is left whole in a batch of sequence length 8 \(its shape \[4, 6\]\) but cut on axes \[1\] "
        r"in a batch of sequence length 8 \(its shape \[4, 8\]\).*truncate_keys=\['input_ids', 'attention_mask'\]",
    ):
        collate._transform(seq2seq_batch(8, 8), [key(i) for i in range(B)])  # the same length: would be cut
    named = CurriculumCollate(None, ["seqlen_truncate"], truncate_keys=["input_ids", "attention_mask"])
    for target in (6, 8):
        out = named._transform(seq2seq_batch(8, target), [key(i) for i in range(B)])
        assert out.batch["labels"].shape == (B, target) and out.batch["input_ids"].shape == (B, 4)
    causal = CurriculumCollate(None, ["seqlen_truncate"])  # labels of the ids' length: cut in every batch, alike
    for length in (8, 12, 6):
        out = causal._transform(seq2seq_batch(length, length), [key(i) for i in range(B)])
        assert out.batch["labels"].shape == (B, 4)
    # a [B, T, D] feature is cut on its feature axis too where D equals the batch's length: refused there
    features = CurriculumCollate(None, ["seqlen_truncate"])
    with_features = lambda t: {**seq2seq_batch(t, t), "feats": torch.zeros(B, t, 12)}  # noqa: E731
    features._transform(with_features(8), [key(i) for i in range(B)])
    with pytest.raises(DataConfigError, match=r"'feats' is cut on axes \[1\] .* but cut on axes \[1, 2\]"):
        features._transform(with_features(12), [key(i) for i in range(B)])


def test_named_sequences_padded_each_to_its_own_length_are_refused():
    """A preference pair's chosen_* and rejected_*, each padded to its own length, all named in truncate_keys: the
    batch's length was read from the first, and rejected was left whole wherever its width differed (4 of 8 steps
    trained a cut chosen against a whole rejected, qa46-user 02). Refused, naming the tensors and the two remedies;
    the pair concatenated along the batch axis is cut alike."""
    pair = lambda c, r: {  # noqa: E731
        "chosen_input_ids": torch.ones(B, c, dtype=torch.long),
        "chosen_attention_mask": torch.ones(B, c, dtype=torch.long),
        "rejected_input_ids": torch.ones(B, r, dtype=torch.long),
        "rejected_attention_mask": torch.ones(B, r, dtype=torch.long),
    }
    keys = list(pair(1, 1))
    with pytest.raises(ValueError, match=r"names 'rejected_input_ids' \[4, 9\], 'rejected_attention_mask' \[4, 9\], "
                       r"with no axis of the batch's sequence length 12 \(read from 'chosen_input_ids'\).*"
                       r"concatenate them along the batch axis"):  # fmt: skip
        F.truncate(pair(12, 9), 6, keys)
    cut = F.truncate(pair(12, 12), 6, keys)  # one length: both cut alike
    assert all(v.shape == (B, 6) for v in cut.batch.values())
    both = {"input_ids": torch.ones(2 * B, 12, dtype=torch.long)}  # [2B, T]: chosen rows, then rejected rows
    assert F.truncate(both, 6).batch["input_ids"].shape == (2 * B, 6)
    # T on an axis the cut does not take: said as such, not "no axis of that length" (qa47-break 04)
    features = {"attention_mask": torch.ones(B, 10), "input_features": torch.zeros(B, 8, 10)}
    with pytest.raises(ValueError, match=r"'input_features' \[4, 8, 10\], whose axis of the batch's sequence length 10 "
                       r"\(read from 'attention_mask'\) is not one seqlen_truncate cuts.*\[B, T, D\]"):  # fmt: skip
        F.truncate(features, 4, ["attention_mask", "input_features"])
    # one name for two sequences of a nested batch (the text's input_ids and the image's): the text is cut
    nested = {"text": {"input_ids": torch.ones(B, 10, dtype=torch.long), "attention_mask": torch.ones(B, 10)},
              "image": {"input_ids": torch.ones(B, 16, dtype=torch.long)}}  # fmt: skip
    out = F.truncate(nested, 4, ["input_ids", "attention_mask"]).batch
    assert out["text"]["input_ids"].shape == (B, 4) and out["image"]["input_ids"].shape == (B, 16)


def test_a_pair_padded_each_to_its_own_length_is_refused_without_truncate_keys():
    """The same pair with truncate_keys=None: the chosen tensors were cut, the rejected ones (their mask of another
    length) left whole in every batch, in silence (qa113-distill 01). Refused, naming the mask and the remedies; an
    encoder-decoder's source named in truncate_keys is still cut alone."""
    pair = {
        "chosen_input_ids": torch.ones(B, 12, dtype=torch.long),
        "chosen_attention_mask": torch.ones(B, 12, dtype=torch.long),
        "rejected_input_ids": torch.ones(B, 9, dtype=torch.long),
        "rejected_attention_mask": torch.ones(B, 9, dtype=torch.long),
    }
    with pytest.raises(ValueError, match=r"read from 'chosen_input_ids', beside the padding mask "
                       r"'rejected_attention_mask' \[4, 9\] of a sequence padded to its own length.*"
                       r"concatenate them along the batch axis.*name its tensors in truncate_keys"):  # fmt: skip
        F.truncate(pair, 6)
    assert F.truncate(pair, 12).batch is pair  # nothing cut: nothing refused
    source = F.truncate(pair, 6, ["chosen_input_ids", "chosen_attention_mask"]).batch
    assert source["chosen_input_ids"].shape == (B, 6) and source["rejected_input_ids"].shape == (B, 9)
    # a mask of another name (a completion mask, a loss mask) is no sequence's padding
    other = {"input_ids": torch.ones(B, 12, dtype=torch.long), "loss_mask": torch.ones(B, 9)}
    assert F.truncate(other, 6).batch["input_ids"].shape == (B, 6)


def test_a_pair_is_cut_on_the_side_every_mask_is_padded_on():
    """A left-padded preference pair (TRL-style decoder-only padding) whose chosen rows all fill the length: the side
    was read from chosen_attention_mask alone, the batch cut as right-padded, and the rejected rows kept their
    padding only, in silence (qa113-distill 02). Every padding mask the cut takes says the side: the last columns
    are kept, and every rejected row its last min(n, L) real tokens. Masks padded on two sides are refused."""
    t, lengths = 16, torch.tensor([4, 9, 6, 16])
    rejected_mask = (torch.arange(t) >= t - lengths[:, None]).long()  # left padded
    pair = {
        "chosen_input_ids": torch.arange(1, t + 1).repeat(B, 1),
        "chosen_attention_mask": torch.ones(B, t, dtype=torch.long),
        "rejected_input_ids": rejected_mask * 7,
        "rejected_attention_mask": rejected_mask,
    }
    cut = F.truncate(pair, 8)
    assert cut.left
    assert cut.batch["rejected_attention_mask"].sum(1).tolist() == torch.clamp(lengths, max=8).tolist()
    assert cut.batch["chosen_input_ids"][0].tolist() == list(range(9, 17))
    restored = F.lengthen_batch(
        cut.batch, None, t, cut.cut_mask, cut.left, dict(zip(cut.cut, cut.axes)), cut.mask_path, cut.cut_values
    )
    assert all(torch.equal(restored[k], v) for k, v in pair.items())
    right = (torch.arange(t) < lengths[:, None]).long()  # chosen right-padded, rejected left-padded
    mixed = {**pair, "chosen_attention_mask": right, "chosen_input_ids": right * 3}
    with pytest.raises(ValueError, match=r"leave rows \[0, 1, 2\] without a real token: the masks 'chosen_attention_"
                       r"mask', 'rejected_attention_mask' are, together, padded on both sides"):  # fmt: skip
        F.truncate(mixed, 4)
    # keep_last_token moves one column per row for every cut tensor: the rejected rows lost their EOS to the chosen
    # rows' (qa113-distill 05); refused where the masks put it at other columns, cut where they agree
    both_right = {**mixed, "rejected_attention_mask": right.flip(0), "rejected_input_ids": right.flip(0) * 7}
    with pytest.raises(ValueError, match=r"keep_last_token=True moves each row's last real token .* the padding masks "
                       r"'chosen_attention_mask', 'rejected_attention_mask' put it at other columns"):  # fmt: skip
        F.truncate(both_right, 8, keep_last_token=True)
    same = {**both_right, "rejected_attention_mask": right, "rejected_input_ids": right * 7}
    kept = F.truncate(same, 8, keep_last_token=True).batch
    assert kept["rejected_attention_mask"].sum(1).tolist() == [4, 8, 6, 8]
    assert kept["rejected_input_ids"][:, -1].tolist() == [0, 7, 0, 7]  # rows 1, 3: their last token, moved


def test_images_whose_side_is_the_texts_length_are_not_cut():
    """32 x 32 images beside text padded to 32 were cropped as a pairwise [B, H, T, T] tensor, in silence, and timm
    then failed on the image size (qa47-user 02). A pairwise mask is still cut on both axes."""
    batch = {
        "pixel_values": torch.randn(B, 3, 32, 32),
        "input_ids": torch.ones(B, 32, dtype=torch.long),
        "pairwise_mask": torch.ones(B, 1, 32, 32),
    }
    out = F.truncate(batch, 8).batch
    assert out["pixel_values"].shape == (B, 3, 32, 32) and out["input_ids"].shape == (B, 8)
    assert out["pairwise_mask"].shape == (B, 1, 8, 8)
    assert F.truncate((torch.ones(B, 32, dtype=torch.long), torch.randn(B, 3, 32, 32)), 8).batch[1].shape[-1] == 32


def test_an_images_features_whose_patch_count_is_the_texts_length_are_not_cut():
    """A VLM's 16 image patches beside 16 text tokens were cut to the text's length, in silence: 8 patches, then 12
    (qa111-multimodal 01). A feature tensor named like an image's is left whole, unless truncate_keys names it; an
    audio model's frames are its sequence, and are cut."""
    batch = {
        "image_embeds": torch.randn(B, 16, 24),
        "vision_features": torch.randn(B, 16, 24),
        "input_ids": torch.ones(B, 16, dtype=torch.long),
        "input_frames": torch.randn(B, 16, 24),
    }
    out = F.truncate(batch, 8).batch
    assert out["image_embeds"].shape == out["vision_features"].shape == (B, 16, 24)
    assert out["input_ids"].shape == (B, 8) and out["input_frames"].shape == (B, 8, 24)
    named = F.truncate(batch, 8, ["input_ids", "image_embeds"]).batch
    assert named["image_embeds"].shape == (B, 8, 24) and named["vision_features"].shape == (B, 16, 24)
    # a video model's frames, without token ids, are its sequence: cut with their mask (qa112-regress 01)
    video = {"video_features": torch.randn(B, 16, 24), "attention_mask": torch.ones(B, 16, dtype=torch.long)}
    assert {k: tuple(v.shape) for k, v in F.truncate(video, 8).batch.items()} == {
        "video_features": (B, 8, 24),
        "attention_mask": (B, 8),
    }


class T5Seq2Seq(pl.LightningModule):
    """A user's module over a tiny HF T5 (no download)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, decoder_start_token_id=0)
        self.net = T5ForConditionalGeneration(cfg)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_hf_encoder_decoder_with_the_automatic_truncate_keys_is_refused_at_setup(tmp_path):
    items = [seq2seq_batch(8, 6) for _ in range(2)]
    samples = [{k: v[i] for k, v in b.items()} for b in items for i in range(B)]
    trainer = make_trainer(tmp_path, [Curriculum(metrics={"seqlen_truncate": TRUNC})], max_steps=2)
    with pytest.raises(
        CurriculumConfigError,
        match=r"encoder-decoder \(T5ForConditionalGeneration at net\).*"
        r"truncate_keys=\['input_ids', 'attention_mask'\] for text; a model whose source is fixed-length audio "
        r"features \(Whisper pads every clip to 30 s\) cannot be cut: order its samples by a difficulty metric",
    ):
        trainer.fit(T5Seq2Seq(), datamodule=CurriculumDataModule(TinyDataModule(samples, batch_size=B)))
    assert trainer.global_step == 0
    short = {**TRUNC, "max_difficulty": 8}  # the sources' 8 tokens
    named = Curriculum(metrics={"seqlen_truncate": short}, truncate_keys=["input_ids", "attention_mask"])
    make_trainer(tmp_path / "named", [named], max_steps=2).fit(
        T5Seq2Seq(), datamodule=CurriculumDataModule(TinyDataModule(samples, batch_size=B))
    )


class TorchSeq2Seq(pl.LightningModule):
    """A user's module over PyTorch's own nn.Transformer (or, ``split``, its encoder beside its decoder)."""

    def __init__(self, split: bool = False) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(V, 16), torch.nn.Linear(16, V)
        if split:
            layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
            self.decoder = torch.nn.TransformerDecoder(torch.nn.TransformerDecoderLayer(16, 2, 32, batch_first=True), 1)
        else:
            self.net = torch.nn.Transformer(16, 2, 1, 1, 32, batch_first=True)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        src, tgt = self.embed(batch["input_ids"]), self.embed(batch["labels"])  # teacher forcing, unshifted here
        out = self.decoder(tgt, self.encoder(src)) if hasattr(self, "decoder") else self.net(src, tgt)
        return torch.nn.functional.cross_entropy(self.head(out).flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("split", [False, True])
def test_a_torch_encoder_decoder_with_the_automatic_truncate_keys_is_refused_at_setup(tmp_path, split):
    """PyTorch's nn.Transformer (or its encoder beside its decoder) was not refused as HF's T5 is: its targets, padded
    to the sources' length, were cut to the source's curriculum length at every step (qa50-seq2seq 01)."""
    items = [seq2seq_batch(8, 8) for _ in range(2)]
    samples = [{k: v[i] for k, v in b.items()} for b in items for i in range(B)]
    trainer = make_trainer(tmp_path, [Curriculum(metrics={"seqlen_truncate": TRUNC})], max_steps=2)
    where = r"TransformerDecoder at decoder" if split else r"Transformer at net"
    with pytest.raises(CurriculumConfigError, match=rf"encoder-decoder \({where}\)"):
        trainer.fit(TorchSeq2Seq(split), datamodule=CurriculumDataModule(TinyDataModule(samples, batch_size=B)))
    assert trainer.global_step == 0


# ------------------------------------------------------------------------------------------- user modules


def stack_pairs(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The user's collate function: a tuple ``(ids [B, T], labels [B, T])``."""
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


class CharPairs(Dataset):
    """Character-token blocks as tuple samples ``(ids, labels)`` (labels = ids: HF shifts inside)."""

    def __init__(self, n: int = 32):
        self.data = torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i], self.data[i].clone()


class ImagePairs(Dataset):
    """Image classification samples ``(x [3, 8, 8], y)``: nothing to truncate."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(3, 8, 8), torch.tensor(i % 2)


class TupleGPT2(pl.LightningModule):
    """An HF GPT-2 (from a config) on tuple batches ``(ids, labels)``; ``training_step`` returns the plain loss."""

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=V, n_positions=T, n_embd=16, n_layer=1, n_head=2, attn_implementation="eager")
        self.model = GPT2LMHeadModel(config)
        self.seen: list[tuple[type, tuple[int, ...], tuple[int, ...]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        self.seen.append((type(batch), tuple(ids.shape), tuple(labels.shape)))
        return self.model(input_ids=ids, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_plain_loss_module_with_tuple_batches_follows_the_schedule(tmp_path):
    pl.seed_everything(0)
    model = TupleGPT2()
    data = CurriculumDataModule(TinyDataModule(CharPairs(), batch_size=B, collate_fn=stack_pairs))
    curriculum = Curriculum(metrics={"seqlen_truncate": TRUNC})
    make_trainer(tmp_path, [curriculum], max_steps=6, max_epochs=-1).fit(model, datamodule=data)
    assert model.seen == [(tuple, (B, n), (B, n)) for n in SCHEDULE]
    assert curriculum.consumed_tokens == B * sum(SCHEDULE)


class EpochPairs(CharPairs):
    """CharPairs that record the epoch the loader told them (``set_epoch``, as an augmentation seeded per epoch
    would read it) at every read."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = -1
        self.reads: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads.append(self.epoch)
        return super().__getitem__(i)


def test_the_curriculum_loader_tells_the_dataset_its_data_epoch(tmp_path):
    """32 samples in batches of 4: steps 1-8 draw data epoch 0, steps 9-12 epoch 1 (the datasets' ``set_epoch``, which
    seeds e.g. the CIFAR-10 augmentation per sample and epoch, so a resume draws the same)."""
    pl.seed_everything(0)
    dataset = EpochPairs()
    data = CurriculumDataModule(TinyDataModule(dataset, batch_size=B, collate_fn=stack_pairs))
    curriculum = Curriculum(metrics={"seqlen_truncate": TRUNC})
    make_trainer(tmp_path, [curriculum], max_steps=12, max_epochs=-1).fit(TupleGPT2(), datamodule=data)
    assert (
        dataset.reads[-12 * B :] == [0] * 8 * B + [1] * 4 * B
    )  # the last 48 reads are the steps' (the first probe the data)


FIRST_TOKEN = dict(  # value-based, chooses samples: first token <= 10, 15, 20, 25, 31
    difficulty_type="value",
    clustering_type="schedule_based",
    analysis="curriculum_test_user_first_token",
    min_difficulty=10,
    max_difficulty=31,
    schedule_type="fixed_linear",
    schedule_config=dict(total_curriculum_step=4, difficulty_step=5),
)
register_metric("curriculum_test_user_first_token", lambda batch: batch[0][:, 0])  # a tuple batch (ids, labels)


class Meta(pl.Callback):
    """The curriculum's metadata of every training batch (``batch_meta``) and the batch's first tokens."""

    def __init__(self) -> None:
        self.rows: list[tuple[dict[str, int], list[int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rows.append((batch_meta(trainer)["cl_difficulty"], batch[0][:, 0].tolist()))


def test_a_value_metric_chooses_tuple_samples(tmp_path):
    """A value-based metric computed in memory over tuple batches, with seqlen_truncate: every batch holds only
    samples whose first token is within the difficulty it was drawn at, and is cut to its length."""
    pl.seed_everything(0)
    model, meta = TupleGPT2(), Meta()
    data = CurriculumDataModule(TinyDataModule(CharPairs(), batch_size=B, collate_fn=stack_pairs))
    curriculum = Curriculum(metrics={"first_token": FIRST_TOKEN, "seqlen_truncate": TRUNC})
    make_trainer(tmp_path, [meta, curriculum], max_steps=5, max_epochs=-1).fit(model, datamodule=data)
    assert [d["first_token"] for d, _ in meta.rows] == [15, 20, 25, 31, 31]
    assert [d["seqlen_truncate"] for d, _ in meta.rows] == SCHEDULE[:5]
    for d, first in meta.rows:
        assert max(first) <= d["first_token"]
    assert int(CharPairs().data[:, 0].max()) > 15  # the first steps' filter did exclude samples
    assert [s[1] for s in model.seen] == [(B, n) for n in SCHEDULE[:5]]


class Tagger(pl.LightningModule):
    """A hand-written ``nn.TransformerEncoder`` token tagger on dict batches ``{"input_ids", "targets"}`` (names the
    old truncation did not know: ``targets`` stayed long and the loss failed with a shape error)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(16, 2)
        self.lengths: list[int] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        self.lengths.append(int(batch["input_ids"].shape[1]))
        logits = self.head(self.encoder(self.embed(batch["input_ids"])))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Tagged(CharPairs):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"input_ids": self.data[i], "targets": self.data[i] % 2}


def test_a_dict_batch_with_its_own_names_trains(tmp_path):
    pl.seed_everything(0)
    model = Tagger()
    data = CurriculumDataModule(TinyDataModule(Tagged(), batch_size=B))
    make_trainer(tmp_path, [Curriculum(metrics={"seqlen_truncate": TRUNC})], max_steps=4, max_epochs=-1).fit(
        model, datamodule=data
    )
    assert model.lengths == SCHEDULE[:4]


class Sentences(Dataset):
    """``[CLS] w1 .. wk [SEP]`` sentences of 4..16 tokens with a binary label."""

    def __init__(self, n: int = 32):
        g = torch.Generator().manual_seed(1)
        self.items = [torch.randint(3, V, (int(k),), generator=g) for k in torch.randint(2, T - 1, (n,), generator=g)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"ids": [CLS, *self.items[i].tolist(), SEP], "label": i % 2}


class PadCollate:
    """A tokenizer-style padding collate: an HF ``BatchEncoding`` padded on ``side``."""

    def __init__(self, side: str) -> None:
        self.side = side

    def __call__(self, samples: list[dict[str, Any]]) -> BatchEncoding:
        t = max(len(s["ids"]) for s in samples)
        ids = torch.full((len(samples), t), PAD)
        mask = torch.zeros(len(samples), t, dtype=torch.long)
        for b, s in enumerate(samples):
            cols = slice(0, len(s["ids"])) if self.side == "right" else slice(t - len(s["ids"]), t)
            ids[b, cols], mask[b, cols] = torch.tensor(s["ids"]), 1
        return BatchEncoding(
            {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([s["label"] for s in samples])}
        )


class BertClassifier(pl.LightningModule):
    """An HF BERT classifier (from a config) on ``BatchEncoding`` batches; records what ``training_step`` got."""

    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(
            vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=T + 2, attn_implementation="eager",
        )  # fmt: skip
        self.model = BertForSequenceClassification(config)
        self.batches: list[BatchEncoding] = []

    def training_step(self, batch: BatchEncoding, batch_idx: int) -> torch.Tensor:
        self.batches.append(batch)
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_bert_classifier_keeps_its_batch_encoding_and_every_sep(tmp_path, side):
    """Right padding with keep_last_token, left padding (detected; without the option): every cut row keeps a real
    token and ends with its [SEP]; the module receives a BatchEncoding."""
    pl.seed_everything(0)
    model = BertClassifier()
    data = CurriculumDataModule(TinyDataModule(Sentences(), batch_size=B, collate_fn=PadCollate(side)))
    curriculum = Curriculum(metrics={"seqlen_truncate": TRUNC}, keep_last_token=side == "right")
    make_trainer(tmp_path, [curriculum], max_steps=4, max_epochs=-1).fit(model, datamodule=data)
    assert len(model.batches) == 4
    for batch, length in zip(model.batches, SCHEDULE):
        assert type(batch) is BatchEncoding and batch["input_ids"].shape[1] <= length
        ids, mask = batch["input_ids"], batch["attention_mask"]
        n = mask.sum(1)
        assert bool((n >= 1).all()) and batch["labels"].shape == (B,)
        last = (n - 1) if side == "right" else torch.full_like(n, ids.shape[1] - 1)
        assert ids[torch.arange(B), last].tolist() == [SEP] * B  # each row's last real token is its [SEP]
        if side == "right":
            assert ids[:, 0].tolist() == [CLS] * B  # the right-padded cut keeps the beginning


# -------------------------------------------------------------------------------------------- the baseline


class After(pl.Callback):
    def __init__(self, curriculum: Curriculum) -> None:
        self.curriculum, self.baselines = curriculum, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.baselines.append((batch, self.curriculum.effi_baseline(batch, pl_module)))


def test_effi_baseline_counts_the_untruncated_tuple_batch(tmp_path):
    pl.seed_everything(0)
    curriculum = Curriculum(metrics={"seqlen_truncate": TRUNC})
    after, monitor = After(curriculum), EfficiencyMonitor(print_summary=False)
    data = CurriculumDataModule(TinyDataModule(CharPairs(), batch_size=B, collate_fn=stack_pairs))
    make_trainer(tmp_path, [monitor, curriculum, after], max_steps=4, max_epochs=-1).fit(TupleGPT2(), datamodule=data)
    for (batch, baseline), n in zip(after.baselines, SCHEDULE):
        assert isinstance(baseline, Baseline) and type(baseline.batch) is tuple
        assert [x.shape for x in batch] == [(B, n)] * 2 and [x.shape for x in baseline.batch] == [(B, T)] * 2
    s = monitor.summary
    assert s["baseline_tokens"] == 4 * B * T and s["tokens"] == B * sum(SCHEDULE[:4])  # no mask: every position
    assert s["saved/curriculum/tokens_frac"] == pytest.approx(1 - sum(SCHEDULE[:4]) / (4 * T))
    assert s["baseline_flops"] > s["flops"] > 0


# ------------------------------------------------- masks, layouts and tensors the first truncation did not know


def left_rows(lengths: list[int], t: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded token ids (pad 0; row b's real tokens 10·(b+1) + column) and their 0/1 mask."""
    ids, mask = ids_and_mask(lengths, side="left")
    ids = torch.where(mask.bool(), (torch.arange(len(lengths))[:, None] + 1) * 10 + torch.arange(t), PAD)
    return ids, mask


def assert_kept_last(ids: torch.Tensor, out: torch.Tensor, lengths: list[int], length: int) -> None:
    """Every row kept its last ``min(n, length)`` real tokens (the last ``length`` columns)."""
    assert torch.equal(out, ids[:, -length:])
    for b, n in enumerate(lengths):
        assert (out[b] != PAD).sum() == min(n, length) and out[b, -1] == ids[b, -1] != PAD


def test_left_padding_is_read_from_a_tuple_mask_and_from_padding_mask_names():
    lengths = [8, 2, 5, 1]
    ids, mask = left_rows(lengths)
    y = torch.tensor([0, 1, 0, 1])
    # a tuple (ids, mask, y): the 0/1 entry is the mask (before: cut from the right, rows 1 and 3 all padding)
    cut = F.truncate((ids, mask, y), 3)
    assert cut.left and cut.batch[2] is y
    assert_kept_last(ids, cut.batch[0], lengths, 3)
    assert torch.equal(cut.batch[1], mask[:, -3:])
    # a bool tuple mask in PyTorch's convention (True = padding): its reading is the one the pad ids fit
    assert_kept_last(ids, F.truncate((ids, mask == 0, y), 3).batch[0], lengths, 3)
    # PyTorch names: *padding_mask* is True = padding
    for name in ("src_key_padding_mask", "padding_mask"):
        cut = F.truncate({"src": ids, name: mask == 0, "y": y}, 3)
        assert cut.left and torch.equal(cut.batch[name], (mask == 0)[:, -3:])
        assert_kept_last(ids, cut.batch["src"], lengths, 3)
    # any other *mask* name is read like attention_mask (nonzero = real): a dataclass field `mask`
    user = F.truncate(UserBatch(ids, mask, y), 3)
    assert user.left and torch.equal(user.batch.tokens, ids[:, -3:])
    # a padding_mask holding 1 at the real tokens contradicts its name: refused, not cut from the wrong side
    with pytest.raises(ValueError, match=r"mask 'padding_mask' reads.*True / nonzero = padding.*invert the mask"):
        F.truncate({"input_ids": ids, "padding_mask": mask, "labels": y}, 3)
    # a 0/1 [B, T] tuple entry that is not a padding mask (token tags, varying ids under its zeros) is not taken
    tags = torch.tensor([[0, 1, 0, 0, 1, 1, 0, 1]] * 4)
    right = F.truncate((ids.flip(1), tags, y), 3)
    assert not right.left and torch.equal(right.batch[0], ids.flip(1)[:, :3])
    assert F.padding_mask((ids.flip(1), tags, y)) is None


def test_4d_3d_and_pairwise_tensors_are_cut_on_every_sequence_axis():
    lengths = [8, 2, 5, 1]
    ids, mask = left_rows(lengths)
    m4 = mask[:, None, None, :]  # HF's expanded [B, 1, 1, T]
    pair = torch.arange(4 * 8 * 8, dtype=torch.float32).view(4, 8, 8)
    batch = {"input_ids": ids, "attention_mask": m4, "pair_bias": pair, "sq": mask[:, None, :] * mask[:, :, None]}
    assert F.sequence_length(batch) == 8  # before: 1 (dimension 1 of the 4-D mask), nothing was ever cut
    cut = F.truncate(batch, 3)
    assert cut.left and cut.full_length == 8 and cut.length == 3
    assert_kept_last(ids, cut.batch["input_ids"], lengths, 3)
    assert torch.equal(cut.batch["attention_mask"], m4[..., -3:])
    assert torch.equal(cut.batch["pair_bias"], pair[:, -3:, -3:])  # before: (4, 3, 8)
    assert torch.equal(cut.batch["sq"], batch["sq"][:, -3:, -3:])
    assert dict(zip(cut.cut, cut.axes)) == {
        ("input_ids",): (1,),
        ("attention_mask",): (3,),
        ("pair_bias",): (1, 2),
        ("sq",): (1, 2),
    }
    # the baseline gets the 4-D mask back exactly, and every tensor its shape, on the axes that were cut
    assert torch.equal(cut.cut_mask, m4[..., :5])
    long = F.lengthen_batch(cut.batch, None, 8, cut.cut_mask, left=True, axes=dict(zip(cut.cut, cut.axes)))
    assert torch.equal(long["attention_mask"], m4)
    assert long["pair_bias"].shape == (4, 8, 8) and long["sq"].shape == (4, 8, 8)
    # a [B, 1, T, T] mask (HF 4-D, causal) is cut on its last two axes
    causal = torch.ones(8, 8).tril().expand(4, 1, 8, 8)
    out = F.truncate_batch({"input_ids": ids.flip(1), "attention_mask": causal}, 3)
    assert out["input_ids"].shape == (4, 3) and torch.equal(out["attention_mask"], causal[..., :3, :3])
    # lengthen_batch given the axes widens a [B, L, D] feature tensor with D == L on its sequence axis only
    feats = {"input_ids": ids[:, :3], "h": torch.ones(4, 3, 3)}
    assert F.lengthen_batch(feats, None, 8, axes={("input_ids",): (1,), ("h",): (1,)})["h"].shape == (4, 8, 3)


def test_an_additive_float_mask_is_read_as_0_real_and_negative_masked():
    lengths = [8, 2, 5, 1]
    ids, mask = left_rows(lengths)
    additive = torch.zeros(4, 8).masked_fill(mask == 0, float("-inf"))
    cut = F.truncate({"input_ids": ids, "attention_mask": additive}, 3)
    assert cut.left and torch.equal(cut.cut_mask, additive[:, :5])  # before: read as all real, cut on the right
    assert_kept_last(ids, cut.batch["input_ids"], lengths, 3)
    # keep_last_token on a right-padded additive mask: each row's last real token ends its cut row
    r_ids, r_mask = ids_and_mask([8, 2, 6, 4])
    r_add = torch.zeros(4, 8).masked_fill(r_mask == 0, torch.finfo(torch.float32).min)
    out = F.truncate({"input_ids": r_ids, "attention_mask": r_add}, 3, keep_last_token=True)
    kept = out.batch["input_ids"]  # rows of 8, 2, 6, 4 real tokens: the last one at column min(n, 3) - 1
    assert [kept[0, 2], kept[1, 1], kept[2, 2], kept[3, 2]] == [7, 101, 205, 303] and kept[:, 0].tolist() == [
        0,
        100,
        200,
        300,
    ]
    assert (out.batch["attention_mask"] == 0).sum(1).tolist() == [3, 2, 3, 3]
    # all zeros: additive, every token real (not "all padding")
    assert bool(F.padding_mask({"input_ids": r_ids, "attention_mask": torch.zeros(4, 8)})[2].all())
    # a float mask that is neither additive nor 0/1 is refused, naming it
    for bad in (torch.full((4, 8), 0.5), torch.ones(4, 8).masked_fill(r_mask == 0, -1.0)):
        with pytest.raises(ValueError, match=r"float mask 'attention_mask'"):
            F.truncate({"input_ids": r_ids, "attention_mask": bad}, 3)


def test_a_sequence_first_batch_is_refused_at_the_first_batch(tmp_path):
    samples = [torch.arange(T) + i for i in range(8)]

    def seq_first(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # [T, B] (batch_first=False)
        x = torch.stack(xs).t().contiguous()
        return x, x.roll(-1, 0)

    for metric in ("seqlen_truncate", "seqlen_reshape"):
        collate = CurriculumCollate(seq_first, [metric])
        with pytest.raises(
            DataConfigError, match=rf"{metric}: the batch is sequence-first.*\[16, 8\].*batch_first=True"
        ):
            collate([(s, (i, 1, 0, (4,))) for i, s in enumerate(samples)])
    # the batch-first layout of the same samples is cut (a [B, T] batch is never mistaken for [T, B])
    ok = CurriculumCollate(stack_pairs, ["seqlen_truncate"])([((s, s), (i, 1, 0, (4,))) for i, s in enumerate(samples)])
    assert [x.shape for x in ok.batch] == [(8, 4), (8, 4)]
    with pytest.raises(ValueError, match="sequence-first"):
        F.truncate(seq_first(samples), 4, batch_size=8)
    # through the Trainer: before any step
    data = CurriculumDataModule(
        TinyDataModule(CharPairs(), batch_size=B, collate_fn=lambda xs: seq_first([x for x, _ in xs]))
    )
    trainer = make_trainer(tmp_path, [Curriculum(metrics={"seqlen_truncate": TRUNC})], max_steps=2, max_epochs=-1)
    with pytest.raises(DataConfigError, match="sequence-first"):
        trainer.fit(TupleGPT2(), datamodule=data)
    assert trainer.global_step == 0


class PairBiasModel(pl.LightningModule):
    """Attention with a ``[B, T, T]`` pairwise bias and an HF-style ``[B, 1, 1, T]`` mask from the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(V, 8), nn.Linear(8, 2)
        self.shapes: list[tuple[tuple[int, ...], ...]] = []
        self.real: list[tuple[int, int]] = []  # (real tokens kept, real tokens of the whole samples) per batch

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.shapes.append(tuple(tuple(batch[k].shape) for k in ("input_ids", "pair_bias", "attention_mask")))
        self.real.append((int(batch["attention_mask"].sum()), int(batch["n"].sum())))
        h = self.embed(batch["input_ids"])
        mask = batch["attention_mask"][:, 0]  # [B, 1, T]
        scores = (h @ h.transpose(1, 2) + batch["pair_bias"]).masked_fill(mask == 0, -1e9)
        return nn.functional.cross_entropy(self.head((scores.softmax(-1) @ h).mean(1)), batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class PairSamples(CharPairs):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        n = 3 + i % (T - 3)  # right-padded: n real tokens
        real = torch.arange(T) < n
        return {
            "input_ids": torch.where(real, self.data[i], PAD),
            "attention_mask": real.long()[None, None, :],
            "pair_bias": torch.zeros(T, T),
            "labels": torch.tensor(i % 2),
            "n": torch.tensor(n),
        }


def test_a_module_with_a_pairwise_bias_and_a_4d_mask_trains_and_counts_its_real_tokens(tmp_path):
    pl.seed_everything(0)
    model, monitor = PairBiasModel(), EfficiencyMonitor(print_summary=False)
    curriculum = Curriculum(metrics={"seqlen_truncate": TRUNC})
    data = CurriculumDataModule(TinyDataModule(PairSamples(), batch_size=B))
    make_trainer(tmp_path, [monitor, curriculum], max_steps=3, max_epochs=-1).fit(model, datamodule=data)
    assert model.shapes == [((B, n), (B, n, n), (B, 1, 1, n)) for n in SCHEDULE[:3]]
    s = monitor.summary  # the mask's real tokens, cut and whole (the 4-D mask put back on its last axis)
    assert s["tokens"] == sum(kept for kept, _ in model.real)
    assert s["baseline_tokens"] == sum(whole for _, whole in model.real) > s["tokens"]


def test_a_max_difficulty_below_the_data_length_warns_at_setup(tmp_path):
    """Blocks of 16 tokens and max_difficulty 8: every batch of the run is cut to at most 8 tokens; the fit trains,
    and setup says so."""
    pl.seed_everything(0)
    model = TupleGPT2()
    data = CurriculumDataModule(TinyDataModule(CharPairs(), batch_size=B, collate_fn=stack_pairs))
    curriculum = Curriculum(
        metrics={
            "seqlen_truncate": {
                **TRUNC,
                "max_difficulty": 8,
                "schedule_config": dict(total_curriculum_step=6, difficulty_step=1),
            }
        }
    )
    with pytest.warns(
        UserWarning,
        match=r"^Curriculum: curriculum_metrics\.seqlen_truncate\.max_difficulty \(8\) is "
        r"below the training data's sequence length: its batches hold 16 tokens",
    ):
        make_trainer(tmp_path, [curriculum], max_steps=8, max_epochs=-1).fit(model, datamodule=data)
    assert [s[1][1] for s in model.seen] == [3, 4, 5, 6, 7, 8, 8, 8]


class PaddedTriples(Dataset):
    """Tuple samples ``(ids [T], mask [T], length)``: ``length`` (3..16) real tokens (ids 1..) then padding 0, the
    0/1 mask unnamed (a tuple entry); the label is the sample's own real length, so a batch tells its true tokens."""

    def __init__(self, n: int = 32) -> None:
        self.lengths = torch.randint(3, T + 1, (n,), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = int(self.lengths[i])
        mask = (torch.arange(T) < n).long()
        return (torch.arange(T) % (V - 1) + 1) * mask, mask, torch.tensor(n)


class TripleGPT2(TupleGPT2):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, mask, _ = batch
        return self.model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss


def test_the_baseline_of_a_tuple_batch_puts_back_its_unnamed_mask(tmp_path):
    """``(ids, mask, y)`` batches: the untruncated baseline gets the mask values the truncation removed back in the
    tuple's mask entry, so it counts each sample's real tokens (its label), not every position (before, the mask was
    put back only in a tensor named attention_mask: the tuple's baseline counted its padding, which inflated the token
    saving about 7x in a user's SST-2 run)."""
    pl.seed_everything(0)
    curriculum = Curriculum(metrics={"seqlen_truncate": TRUNC})
    after, monitor = After(curriculum), EfficiencyMonitor(print_summary=False)
    data = CurriculumDataModule(TinyDataModule(PaddedTriples(), batch_size=B))
    make_trainer(tmp_path, [monitor, curriculum, after], max_steps=4, max_epochs=-1).fit(TripleGPT2(), datamodule=data)
    real = 0
    for batch, baseline in after.baselines:
        ids, mask, lengths = baseline.batch
        assert mask.shape == (B, T) and torch.equal(mask.sum(1), lengths)  # the untruncated mask, exactly
        assert torch.equal(mask[:, : batch[1].shape[1]], batch[1])
        real += int(lengths.sum())
    s = monitor.summary
    assert s["baseline_tokens"] == real and s["tokens"] == sum(int(b[1].sum()) for b, _ in after.baselines)
    assert s["saved/curriculum/tokens_frac"] == pytest.approx(1 - s["tokens"] / real)


class TupleVariants(Dataset):
    """Right-padded tuple samples of 3..16 real tokens, pad id 5, in three layouts users write: ``(ids, token_types,
    mask, length)`` for single sentences (token types all 0), ``(ids, mask, token_types, length)`` for sentence
    pairs (types 0 then 1), and ``(ids, padding_mask, length)`` with True = padding; the label is the real length."""

    def __init__(self, kind: str, n: int = 32) -> None:
        self.kind = kind
        self.lengths = torch.randint(3, T + 1, (n,), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        n = int(self.lengths[i])
        real = torch.arange(T) < n
        ids = torch.where(real, torch.arange(T) % 20 + 6, torch.tensor(5))
        if self.kind == "padding_true":
            return ids, ~real, torch.tensor(n)
        types = torch.zeros(T, dtype=torch.long)
        if self.kind == "pair":
            types[n // 2 : n] = 1
        if self.kind == "pair":  # the mask first: at 3 tokens the pairs' types [0, 1, 1] would fit as a mask too
            return ids, real.long(), types, torch.tensor(n)
        return ids, types, real.long(), torch.tensor(n)


class IdsOnlyGPT2(TupleGPT2):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss


@pytest.mark.parametrize("kind", ["single", "pair", "padding_true"])
def test_the_baseline_of_bert_style_and_padding_true_tuples_counts_their_real_tokens(tmp_path, kind):
    """(ids, token_types, mask, y) and (ids, padding_mask, y) tuples, pad id 5: the trained batches count their real
    tokens (before, the all-0 token types of single sentences were read as the mask: padding counted, left padding
    unseen) and the untruncated baseline gets every cut column back (ids, types, mask), so it counts each sample's
    real tokens, its label (before: 93 or 288 where 195 were real)."""
    pl.seed_everything(0)
    curriculum = Curriculum(metrics={"seqlen_truncate": TRUNC})
    after, monitor = After(curriculum), EfficiencyMonitor(print_summary=False)
    data = CurriculumDataModule(TinyDataModule(TupleVariants(kind), batch_size=B))
    make_trainer(tmp_path, [monitor, curriculum, after], max_steps=4, max_epochs=-1).fit(IdsOnlyGPT2(), datamodule=data)
    real = trained = 0
    for batch, baseline in after.baselines:
        lengths = baseline.batch[-1]
        assert all(x.shape == (B, T) for x in baseline.batch[:-1])
        real += int(lengths.sum())
        trained += int(lengths.clamp(max=batch[0].shape[1]).sum())
    s = monitor.summary
    assert s["baseline_tokens"] == real and s["tokens"] == trained < real


class CausalEncoderLM(pl.LightningModule):
    """A causal LM on ``nn.TransformerEncoder`` with its causal mask given (PyTorch's tutorial, SASRec), tuple
    batches ``(x, y)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, 16), nn.Linear(16, V)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        return self.head(self.encoder(self.emb(x), mask=causal))

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).transpose(1, 2), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_causal_encoder_given_its_mask_counts_the_curriculums_flops_saving(tmp_path):
    """nn.TransformerEncoder compares a given mask's values with a causal one, which the replay's fake tensors
    cannot: the untruncated batch's replay failed, blamed on boolean-mask indexing, and the FLOPs saving read 0 for
    a tokens saving of 0.25 (qa57-seq 01). The baseline now reads what a run on the whole batches measures."""
    import warnings

    class Pairs(Dataset):
        def __init__(self) -> None:
            self.data = torch.randint(0, V, (32, T + 1), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i: int) -> tuple:
            return self.data[i, :-1], self.data[i, 1:]

    summaries = []
    for curriculum in (False, True):
        monitor = EfficiencyMonitor(print_summary=False)
        callbacks = [monitor, Curriculum(metrics={"seqlen_truncate": TRUNC})] if curriculum else [monitor]
        trainer = make_trainer(tmp_path / str(curriculum), callbacks, max_steps=4, max_epochs=-1)
        data = TinyDataModule(Pairs(), batch_size=B)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(CausalEncoderLM(), datamodule=CurriculumDataModule(data) if curriculum else data)
        assert not [str(w.message) for w in caught if "cannot be counted" in str(w.message)]
        summaries.append(monitor.summary)
    plain, cut = summaries
    assert cut["baseline_flops"] == pytest.approx(plain["flops"], rel=1e-12)
    assert 0 < cut["flops"] < plain["flops"] and cut["flops_saved_frac"] > cut["tokens_saved_frac"] > 0.5


def test_masks_of_other_kinds_beside_the_padding_mask_are_left_to_it():
    """Longformer's global_attention_mask (1 on the CLS only) was read as a second sequence's padding mask: a
    left-padded batch was cut from the right, and keep_last_token refused as a pair (qa115-regress 01); a VLM's
    image_attention_mask of the patches' length was refused as a sequence padded to its own length (qa115-regress
    02). Both are left to the text's attention_mask: the left-padded batch keeps its last columns, the image's mask
    stays whole."""
    lengths = torch.tensor([4, 9, 6, 16])
    mask = (torch.arange(16) >= 16 - lengths[:, None]).long()  # left padded
    batch = {
        "input_ids": mask * 5,
        "attention_mask": mask,
        "global_attention_mask": torch.zeros(B, 16, dtype=torch.long).index_fill(1, torch.tensor([0]), 1),
    }
    cut = F.truncate(batch, 8)
    assert cut.left and cut.batch["attention_mask"].sum(1).tolist() == [4, 8, 6, 8]
    right = {**batch, "attention_mask": mask.flip(1), "input_ids": mask.flip(1) * 5}
    kept = F.truncate(right, 8, keep_last_token=True).batch
    assert kept["input_ids"][:, -1].tolist() == [0, 5, 0, 5]  # rows 1 and 3: their last token kept
    vlm = {
        "input_ids": torch.ones(B, 12, dtype=torch.long),
        "attention_mask": torch.ones(B, 12, dtype=torch.long),
        "image_embeds": torch.zeros(B, 9, 8),
        "image_attention_mask": torch.ones(B, 9, dtype=torch.long),
    }
    out = F.truncate(vlm, 6).batch
    assert out["input_ids"].shape == (B, 6) and out["image_attention_mask"].shape == (B, 9)
