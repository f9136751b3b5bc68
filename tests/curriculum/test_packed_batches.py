"""seqlen_truncate on packed (padding-free) batches: Hugging Face's ``DataCollatorWithFlattening`` concatenates the
sequences into one row and, with ``return_flash_attn_kwargs=True``, gives their boundaries (``cu_seq_lens_q/k``) and
longest length (``max_length_q/k``) for flash-attention's varlen kernels. Cutting the row must cut those too."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from lightning_effi.core.measure import find_batch_size
from lightning_effi.curriculum import functional as CF


def _packed(lengths: list[int], tensors: bool = False) -> dict:
    rows = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)(rows)
    return {k: torch.as_tensor(v) for k, v in batch.items()} if tensors else batch


@pytest.mark.parametrize("tensors", [False, True], ids=["hf", "all-tensors"])
def test_a_packed_rows_boundaries_are_cut_with_it_and_given_back(tensors):
    """The boundaries of the uncut row (past the end of the tensors) were left, and the monitor counted its 3
    documents in the cut row's 1 (qa51-llm 01, qa51-break 04)."""
    batch = _packed([20, 30, 25], tensors)
    assert batch["input_ids"].shape == (1, 75) and batch["cu_seq_lens_q"].tolist() == [0, 20, 50, 75]
    for length, bounds, longest in [
        (16, [0, 16], 16),
        (20, [0, 20], 20),
        (45, [0, 20, 45], 25),
        (60, [0, 20, 50, 60], 30),
    ]:
        cut = CF.truncate(batch, length)
        assert cut.batch["input_ids"].shape == (1, length) and cut.batch["position_ids"].shape == (1, length)
        for side in ("q", "k"):
            assert cut.batch[f"cu_seq_lens_{side}"].tolist() == bounds
            assert int(cut.batch[f"max_length_{side}"]) == longest
            assert type(cut.batch[f"max_length_{side}"]) is type(batch[f"max_length_{side}"])
        assert find_batch_size(cut.batch) == len(bounds) - 1
        back = CF.lengthen_batch(cut.batch, None, 75, cut.cut_mask, cut.left, dict(zip(cut.cut, cut.axes)),
                                 cut.mask_path, cut.cut_values)  # fmt: skip
        assert back["cu_seq_lens_q"].tolist() == [0, 20, 50, 75] and int(back["max_length_q"]) == 30
        assert torch.equal(back["input_ids"], batch["input_ids"]) and find_batch_size(back) == 3
    assert batch["cu_seq_lens_q"].tolist() == [0, 20, 50, 75]  # the batch itself is not modified


def test_a_packed_batch_is_refused_where_its_boundaries_cannot_follow_the_cut():
    batch = _packed([20, 30, 25], tensors=True)
    with pytest.raises(ValueError, match=r"the batch is packed .*'cu_seq_lens_q'.* return_flash_attn_kwargs=False"):
        CF.truncate(batch, 16, keep_last_token=True)
    two_rows = {
        **batch,
        "input_ids": batch["input_ids"].repeat(2, 1),
        "position_ids": batch["position_ids"].repeat(2, 1),
    }
    with pytest.raises(ValueError, match=r"the batch is packed"):
        CF.truncate(two_rows, 16)
