"""Analyzer metrics (Megatron-DeepSpeed ``analyze_data.py``) and the metric registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_effi.curriculum.analysis import (
    DataAnalyzer,
    MMapIndexedDataset,
    SeqLen,
    get_metric,
    register_metric,
    registered_metrics,
    seqlen,
    seqlen_vocab_rarity,
    total_vocab_freq,
    vocab_rarity,
    vocab_rarity_table,
)

TOKENS = torch.tensor([[1, 1, 2, 0], [2, 0, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


def test_seqlen_mask_pad_and_structures():
    assert seqlen()({"input_ids": TOKENS, "attention_mask": MASK}).tolist() == [3, 1]
    assert seqlen()({"input_ids": TOKENS}).tolist() == [3, 1]  # pad id 0
    assert seqlen(pad_token_id=2)(TOKENS).tolist() == [3, 3]
    assert seqlen(pad_token_id=None)((TOKENS, torch.zeros(2))).tolist() == [4, 4]
    assert seqlen(key="ids")({"ids": TOKENS.numpy()}).dtype == np.int64
    with pytest.raises(KeyError, match="input_ids"):
        seqlen()({"ids": TOKENS})
    with pytest.raises(TypeError, match="integers"):
        seqlen()(TOKENS.float())


def test_total_vocab_freq_masks_padding():
    f = total_vocab_freq(3)({"input_ids": TOKENS, "attention_mask": MASK})
    assert f.tolist() == [0, 2, 2, 0] and f.shape == (4,)
    assert total_vocab_freq(3)(TOKENS).tolist() == [4, 2, 2, 0]
    with pytest.raises(ValueError, match=r"\[0, vocab_size=1\]"):
        total_vocab_freq(1)(TOKENS)


def test_vocab_rarity_definition():
    freq = np.array([0, 3, 1])  # zero replaced by 1: f = [1, 3, 1], sum 5
    rho = vocab_rarity_table(freq)
    assert rho.dtype == np.float64
    np.testing.assert_allclose(rho, [-math.log(0.2), -math.log(0.6), -math.log(0.2)])
    batch = {"input_ids": TOKENS, "attention_mask": MASK}
    expected = [int(2 * rho[1] + rho[2]), int(rho[2])]  # sums truncated to int64
    assert vocab_rarity(freq)(batch).tolist() == expected == [2, 1]
    assert vocab_rarity(freq)(TOKENS).tolist() == [int(2 * rho[1] + rho[2] + rho[0]), int(rho[2] + 3 * rho[0])]
    m = seqlen_vocab_rarity(freq, seq_length=4)
    c = 10 ** (math.ceil(math.log10(4 * rho.max())) + 1)
    assert m.coeff == c == 100
    assert m(batch).tolist() == [3 * c + 2, 1 * c + 1]


def test_vocab_rarity_from_analyzer_file(tmp_path):
    class DS:
        x = torch.randint(1, 9, (30, 5), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return 30

        def __getitem__(self, i):
            return {"input_ids": self.x[i]}

    DataAnalyzer(
        DS(),
        batch_size=4,
        metric_names=["total_vocab_freq"],
        metric_functions=[total_vocab_freq(9)],
        metric_types=["accumulate_value_over_samples"],
        metric_dtypes=[np.int64],
        save_path=tmp_path,
        progress=False,
    ).run_map_reduce()
    prefix = tmp_path / "total_vocab_freq" / "total_vocab_freq_metric_value"
    freq = np.bincount(DS.x.reshape(-1).numpy(), minlength=10)
    assert MMapIndexedDataset(prefix)[0].tolist() == freq.tolist()
    a = get_metric("vocab_rarity", freq=str(prefix))
    b = vocab_rarity(freq)
    batch = {"input_ids": DS.x[:6]}
    assert a(batch).tolist() == b(batch).tolist()


def test_registry():
    assert registered_metrics()["seqlen"] == "single_value_per_sample"
    assert registered_metrics()["total_vocab_freq"] == "accumulate_value_over_samples"
    assert get_metric("seqlen", pad_token_id=5) == SeqLen(pad_token_id=5)

    @register_metric("test_first_token")
    def first_token(batch, key="input_ids"):
        return batch[key][:, 0]

    assert get_metric("test_first_token") is first_token
    assert get_metric("test_first_token", key="x")({"x": TOKENS}).tolist() == [1, 2]
    with pytest.raises(ValueError, match="already registered"):
        register_metric("test_first_token", lambda b: b)
    register_metric("test_first_token", lambda b: b, overwrite=True)
    with pytest.raises(KeyError, match=r"unknown metric 'nope'; registered metrics: \[.*'seqlen'"):
        get_metric("nope")
    with pytest.raises(ValueError, match="metric_type"):
        register_metric("x", lambda b: b, metric_type="per_batch")


# ------------------------------------------------------------------------------------- batch structures (curriculum)
def test_metrics_read_a_batchencoding_like_a_dict():
    """HF ``DataCollatorWithPadding`` returns a ``BatchEncoding`` (a ``UserDict``, not a ``dict``): read by name."""
    from transformers import BatchEncoding

    batch = BatchEncoding({"input_ids": TOKENS, "token_type_ids": torch.zeros_like(TOKENS), "attention_mask": MASK})
    assert not isinstance(batch, dict)
    plain = {"input_ids": TOKENS, "attention_mask": MASK}
    assert seqlen()(batch).tolist() == [3, 1]  # the mask: 3 and 1 real tokens
    assert seqlen(pad_token_id=None)(BatchEncoding({"input_ids": TOKENS})).tolist() == [4, 4]
    assert total_vocab_freq(3)(batch).tolist() == [0, 2, 2, 0]
    freq = np.array([0, 3, 1])
    assert vocab_rarity(freq)(batch).tolist() == vocab_rarity(freq)(plain).tolist() == [2, 1]
    assert seqlen_vocab_rarity(freq, seq_length=4)(batch).tolist() == [302, 101]
    with pytest.raises(KeyError, match=r"seqlen: the BatchEncoding batch has no key 'ids' \(keys: \['attention_mask'"):
        seqlen(key="ids")(batch)


def test_metrics_read_tuple_dataclass_and_nested_batches():
    from dataclasses import dataclass

    labels = torch.tensor([5, 6])
    # a tuple: the first integer [B, T] tensor (labels [B] and float features skipped)
    assert seqlen()((labels, TOKENS)).tolist() == [3, 1]  # pad id 0
    assert seqlen()((torch.zeros(2, 4), TOKENS.numpy(), labels)).tolist() == [3, 1]
    assert seqlen(pad_token_id=2)([TOKENS, TOKENS + 1]).tolist() == [3, 3]
    assert total_vocab_freq(3)((labels, TOKENS)).tolist() == [4, 2, 2, 0]
    # names inside a tuple or a dataclass: by name, with the mask
    assert seqlen(pad_token_id=None)(({"input_ids": TOKENS, "attention_mask": MASK}, labels)).tolist() == [3, 1]

    @dataclass
    class Batch:
        labels: torch.Tensor
        input_ids: torch.Tensor
        attention_mask: torch.Tensor

    assert seqlen(pad_token_id=None)(Batch(labels, TOKENS, MASK)).tolist() == [3, 1]
    with pytest.raises(KeyError, match=r"seqlen: the Batch batch has no key 'ids' \(keys: \['labels', 'input_ids'"):
        seqlen(key="ids")(Batch(labels, TOKENS, MASK))


def test_metrics_refuse_a_batch_without_token_ids_naming_the_metric_and_what_was_found():
    with pytest.raises(
        TypeError,
        match=r"seqlen: the tuple batch has no entry named 'input_ids' and no integer \[B, T\] tensor of token ids "
        r"\(found \[0\]: Tensor \[2, 4\] torch\.float32, \[1\]: Tensor \[2\] torch\.int64\)",
    ):
        seqlen()((torch.zeros(2, 4), torch.tensor([0, 1])))
    with pytest.raises(TypeError, match=r"vocab_rarity: the tuple batch has no entry named 'input_ids'.*bool"):
        vocab_rarity(np.array([1, 1, 1]))((TOKENS.bool(),))  # a bool [B, T] tensor is a mask, not token ids
    with pytest.raises(TypeError, match=r"total_vocab_freq: expected a batch of token ids .*got a str"):
        total_vocab_freq(3)("not a batch")
    with pytest.raises(TypeError, match=r"seqlen: batch\['input_ids'\] of the dict batch: expected a tensor or "
                       r"ndarray, got list"):  # fmt: skip
        seqlen()({"input_ids": [[1, 2], [3, 0]]})


def test_in_memory_analysis_on_batchencoding_and_tuple_batches():
    """The curriculum's ``analysis="seqlen"`` on the batches of a ``DataCollatorWithPadding``-like collate (a
    ``BatchEncoding``) and of an ``(ids, labels)`` collate: the per-sample real lengths, in data set order."""
    from transformers import BatchEncoding

    from lightning_effi.curriculum.analysis import analyze_in_memory
    from lightning_effi.curriculum.config import CurriculumConfigError

    lengths = [3, 7, 1, 5, 6, 2, 4]
    items = [list(range(1, n + 1)) for n in lengths]

    def pad(batch_items):
        width = max(len(i) for i in batch_items)
        ids = torch.tensor([i + [0] * (width - len(i)) for i in batch_items])
        return ids, (ids != 0).long()

    def hf_collate(batch_items):
        ids, mask = pad(batch_items)
        return BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": torch.zeros(len(ids))})

    def tuple_collate(batch_items):
        ids, _ = pad(batch_items)
        return torch.zeros(len(ids)), ids

    for collate in (hf_collate, tuple_collate):
        values = analyze_in_memory(items, "seqlen", collate_fn=collate, batch_size=3)
        assert values.dtype == np.int64 and values.tolist() == lengths
    with pytest.raises(
        CurriculumConfigError,
        match=r"curriculum analysis 'seqlen' on a tuple batch of the training loader \(its collate_fn\): seqlen: the "
        r"tuple batch has no entry named 'input_ids' and no integer \[B, T\] tensor .*torch\.float32",
    ):
        analyze_in_memory(items, "seqlen", collate_fn=lambda b: (pad(b)[0].float(), torch.zeros(len(b))))
