"""The V-cycle's level changes in a real fit against expectations built here, without the package's operators.

1. Weights: the coalescing and de-coalescing matrices of Zou, Zhang, Deng, ICLR 2024, Sec. 3-4 (official code
   ``map_tools/mapper.py``) are written out as dense float64 matrices for a tiny GPT-2 -- for a width partition with
   groups ``g(i)``: ``F[i, j] = 1/|g(i)|`` (coalesce, output side: average), ``S[j, i] = 1`` (coalesce, input side:
   sum), ``T[j, i] = 1`` (de-coalesce, output side: copy), ``H[i, j] = 1/|g(i)|`` (de-coalesce, input side: split) --
   and applied per parameter (``W_s = F_out W S_in``, ``W_L = T_out W_s H_in``; biases and LayerNorms ``F b`` /
   ``T b``; the tied embedding tables ``2 E F^T`` / ``E T^T / 2``, the official convention), depth by averaging
   adjacent layers and copying them back, and the interpolation ``(1 - a) de-coalesced + a snapshot``. The callback's
   weights at each switch must equal them.
2. Dropout on: the V-cycle builds its smaller models without touching the global RNG (``torch.random.fork_rng`` in
   ``lightning_effi/vcycle/operators.py``; method card: "The global RNG is not touched by building the small
   models"), so a switch consumes nothing of the dropout stream, and a fit with the V-cycle draws the same dropout
   masks as one without it until its models differ.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_effi.callbacks import VCycleCallback
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import tiny_gpt2, tiny_lm_data

D, HEADS, FFN, LAYERS = 32, 4, 128, 2  # tiny GPT-2: n_embd 32, 4 heads of 8, n_inner 4 x 32, 2 layers; vocab 64
ALPHA = 0.3


# ------------------------------------------------------------------------------------------ the maps, by hand
def groups_half(size: int) -> list[list[int]]:
    """The paper's instance ``F = [I/2, I/2]``: small index ``j`` <- large ``j`` and ``j + size/2``."""
    return [[j, j + size // 2] for j in range(size // 2)]


def groups_by_chunks(size: int, head_groups: list[list[int]], heads: int) -> list[list[int]]:
    """Explicit head groups applied to chunks of ``size / heads`` (official ``MapMatrix`` layout): small chunk ``c``
    element ``t`` <- large chunks ``head_groups[c]``, element ``t`` of each."""
    chunk = size // heads
    return [[g * chunk + t for g in group] for group in head_groups for t in range(chunk)]


def maps(groups: list[list[int]], large: int) -> dict[str, torch.Tensor]:
    """Dense ``F (d x D)``, ``S (D x d)``, ``T (D x d)``, ``H (d x D)`` of a partition, float64."""
    small = len(groups)
    F, S = torch.zeros(small, large, dtype=torch.float64), torch.zeros(large, small, dtype=torch.float64)
    for i, g in enumerate(groups):
        for j in g:
            F[i, j] = 1.0 / len(g)
            S[j, i] = 1.0
    return {"F": F, "S": S, "T": S.clone(), "H": F.clone()}


def block_diag3(m: torch.Tensor) -> torch.Tensor:
    return torch.block_diag(m, m, m)


def expected_coalesce(sd: dict[str, np.ndarray], E: dict, FF: dict) -> dict[str, torch.Tensor]:
    """Large GPT-2 state dict -> small, float64. GPT-2's ``Conv1D`` stores ``W^T`` (in x out): ``W_s^T = S_in^T W^T
    F_out^T``. ``c_attn`` is ``[Q; K; V]``, each mapped by the head map (= E here)."""
    x = {k: torch.from_numpy(v) for k, v in sd.items()}
    qkv_F = block_diag3(E["F"])
    width: dict[str, torch.Tensor] = {
        "transformer.wte.weight": 2.0 * x["transformer.wte.weight"] @ E["F"].T,  # official convention: x 2
        "transformer.wpe.weight": 2.0 * x["transformer.wpe.weight"] @ E["F"].T,
        "transformer.ln_f.weight": E["F"] @ x["transformer.ln_f.weight"],
        "transformer.ln_f.bias": E["F"] @ x["transformer.ln_f.bias"],
    }
    for layer in range(LAYERS):
        p = f"transformer.h.{layer}."
        for ln in ("ln_1", "ln_2"):
            for t in ("weight", "bias"):
                width[f"{p}{ln}.{t}"] = E["F"] @ x[f"{p}{ln}.{t}"]
        width[f"{p}attn.c_attn.weight"] = E["S"].T @ x[f"{p}attn.c_attn.weight"] @ qkv_F.T
        width[f"{p}attn.c_attn.bias"] = qkv_F @ x[f"{p}attn.c_attn.bias"]
        width[f"{p}attn.c_proj.weight"] = E["S"].T @ x[f"{p}attn.c_proj.weight"] @ E["F"].T
        width[f"{p}attn.c_proj.bias"] = E["F"] @ x[f"{p}attn.c_proj.bias"]
        width[f"{p}mlp.c_fc.weight"] = E["S"].T @ x[f"{p}mlp.c_fc.weight"] @ FF["F"].T
        width[f"{p}mlp.c_fc.bias"] = FF["F"] @ x[f"{p}mlp.c_fc.bias"]
        width[f"{p}mlp.c_proj.weight"] = FF["S"].T @ x[f"{p}mlp.c_proj.weight"] @ E["F"].T
        width[f"{p}mlp.c_proj.bias"] = E["F"] @ x[f"{p}mlp.c_proj.bias"]
    out = {k: v for k, v in width.items() if ".h." not in k}
    for k in width:  # depth, adjacent pairs: small layer 0 = mean of large layers 0 and 1
        if k.startswith("transformer.h.0."):
            rest = k[len("transformer.h.0.") :]
            out[k] = (width[k] + width[f"transformer.h.1.{rest}"]) / 2
    out["lm_head.weight"] = out["transformer.wte.weight"]  # tied
    return out


def expected_decoalesce(sd: dict[str, np.ndarray], E: dict, FF: dict) -> dict[str, torch.Tensor]:
    """Small GPT-2 state dict (1 layer) -> large (2 layers), float64: depth copy, then ``W_L^T = H_in^T W_s^T
    T_out^T``, vectors ``T b``, embeddings ``E_s T^T / 2``."""
    x = {k: torch.from_numpy(v) for k, v in sd.items()}
    qkv_T = block_diag3(E["T"])
    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": 0.5 * x["transformer.wte.weight"] @ E["T"].T,
        "transformer.wpe.weight": 0.5 * x["transformer.wpe.weight"] @ E["T"].T,
        "transformer.ln_f.weight": E["T"] @ x["transformer.ln_f.weight"],
        "transformer.ln_f.bias": E["T"] @ x["transformer.ln_f.bias"],
    }
    s = "transformer.h.0."
    for layer in range(LAYERS):  # both large layers are copies of small layer 0
        p = f"transformer.h.{layer}."
        for ln in ("ln_1", "ln_2"):
            for t in ("weight", "bias"):
                out[f"{p}{ln}.{t}"] = E["T"] @ x[f"{s}{ln}.{t}"]
        out[f"{p}attn.c_attn.weight"] = E["H"].T @ x[f"{s}attn.c_attn.weight"] @ qkv_T.T
        out[f"{p}attn.c_attn.bias"] = qkv_T @ x[f"{s}attn.c_attn.bias"]
        out[f"{p}attn.c_proj.weight"] = E["H"].T @ x[f"{s}attn.c_proj.weight"] @ E["T"].T
        out[f"{p}attn.c_proj.bias"] = E["T"] @ x[f"{s}attn.c_proj.bias"]
        out[f"{p}mlp.c_fc.weight"] = E["H"].T @ x[f"{s}mlp.c_fc.weight"] @ FF["T"].T
        out[f"{p}mlp.c_fc.bias"] = FF["T"] @ x[f"{s}mlp.c_fc.bias"]
        out[f"{p}mlp.c_proj.weight"] = FF["H"].T @ x[f"{s}mlp.c_proj.weight"] @ E["T"].T
        out[f"{p}mlp.c_proj.bias"] = E["T"] @ x[f"{s}mlp.c_proj.bias"]
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def assert_state_close(actual: dict[str, np.ndarray], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for k, v in expected.items():
        assert tuple(actual[k].shape) == tuple(v.shape), k
        got = torch.from_numpy(actual[k])
        torch.testing.assert_close(got, v, rtol=2e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------------------------------------- the fit
class Weights(Callback):
    """Per optimizer step (at ``on_train_batch_end``): the network's state dict as float64 NumPy arrays (exact for
    float32 weights; not tensors, so the V-cycle does not take this recorder for an EMA holding a copy of the
    parameters) and its width."""

    def __init__(self) -> None:
        self.state: dict[int, dict[str, np.ndarray]] = {}
        self.width: dict[int, int] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sd = pl_module.model.state_dict()
        self.state[trainer.global_step] = {k: v.detach().cpu().double().numpy().copy() for k, v in sd.items()}
        self.width[trainer.global_step] = pl_module.model.config.n_embd


SCHEMES = {
    "half": ("half", groups_half(D), groups_half(FFN)),
    "head_groups": ([[0, 3], [1, 2]], groups_by_chunks(D, [[0, 3], [1, 2]], HEADS), None),
}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_switch_weights_equal_the_hand_built_maps(tmp_path, scheme):
    width_scheme, e_groups, i_groups = SCHEMES[scheme]
    if i_groups is None:
        i_groups = groups_by_chunks(FFN, width_scheme, HEADS)
    E, FF = maps(e_groups, D), maps(i_groups, FFN)
    pre, post = Weights(), Weights()
    cb = VCycleCallback(e_a=2, e_small=3, alpha_original=ALPHA, width_scheme=width_scheme, depth_scheme="adjacent")
    pl.seed_everything(0)
    trainer = make_trainer(tmp_path, [pre, cb, post], max_steps=7, max_epochs=-1)
    trainer.fit(tiny_gpt2(n_head=HEADS), datamodule=tiny_lm_data())
    assert [post.width[s] for s in range(1, 8)] == [32, 16, 16, 16, 32, 32, 32]
    assert pre.width[2] == 32 and pre.width[5] == 16  # before the callback acted at steps 2 and 5
    # down at step 2: the trained large model, coalesced
    assert_state_close(post.state[2], expected_coalesce(pre.state[2], E, FF))
    # up at step 5: the trained small model, de-coalesced, interpolated with the snapshot of step 2
    deco = expected_decoalesce(pre.state[5], E, FF)
    snapshot = {k: torch.from_numpy(v) for k, v in pre.state[2].items()}
    assert_state_close(post.state[5], {k: (1 - ALPHA) * deco[k] + ALPHA * snapshot[k] for k in deco})
    # the hand-built maps themselves: F T = H S = H T = I (coalescing a de-coalesced model returns it)
    for m in (E, FF):
        eye = torch.eye(m["F"].shape[0], dtype=torch.float64)
        assert (
            torch.equal(m["F"] @ m["T"], eye)
            and torch.equal(m["H"] @ m["S"], eye)
            and torch.equal(m["H"] @ m["T"], eye)
        )
    # and they are not trivially satisfied: the two schemes pair different dims
    assert groups_half(D) != groups_by_chunks(D, [[0, 3], [1, 2]], HEADS)


# ------------------------------------------------------------------------------------------- RNG isolation
class Rng(Callback):
    """The global torch RNG state at ``on_train_batch_start`` and ``on_train_batch_end`` of every batch, the
    network's width and train mode."""

    def __init__(self) -> None:
        self.start: dict[int, torch.Tensor] = {}
        self.end: dict[int, torch.Tensor] = {}
        self.width: dict[int, int] = {}
        self.training: dict[int, bool] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start[trainer.global_step + 1] = torch.get_rng_state()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end[trainer.global_step] = torch.get_rng_state()
        self.width[trainer.global_step] = pl_module.model.config.n_embd
        self.training[trainer.global_step] = pl_module.model.training


def dropout_gpt2():
    return tiny_gpt2(n_layer=4, n_head=4, dropout=0.1)  # 3 levels: (4 layers, 32) -> (2, 16) -> (1, 8)


def fit(root: Path, callbacks, steps: int) -> None:
    pl.seed_everything(0)
    make_trainer(root, callbacks, max_steps=steps, max_epochs=-1).fit(dropout_gpt2(), datamodule=tiny_lm_data())


def test_switches_consume_nothing_of_the_dropout_rng_stream(tmp_path):
    """Three levels, switches at steps 2 (1 -> 2), 4 (2 -> 3), 6 (3 -> 2) and 8 (2 -> 1): the global RNG state
    right before the callback acts equals the state right after it, at every step; dropout draws from it at every
    level (the state moves during each training step); and the fit draws exactly the masks of a fit without the
    V-cycle until its model first differs (steps 1-3: the level-2 model built in setup and the one built at the step-2
    switch took nothing from the stream)."""
    before, after = Rng(), Rng()
    cb = VCycleCallback(levels=3, e_a=2, e_small=2, up_leg=2, alpha_original=0.25)
    fit(tmp_path / "vcycle", [before, cb, after], 10)
    assert [after.width[s] for s in range(1, 11)] == [32, 16, 16, 8, 8, 16, 16, 32, 32, 32]
    assert cb.switches == 4
    for step in range(1, 11):
        assert torch.equal(before.end[step], after.end[step]), f"the callback moved the global RNG at step {step}"
        assert not torch.equal(after.start[step], after.end[step]), f"no dropout draw in step {step}"
        assert after.training[step], step  # every level trains in train mode: dropout on
    plain = Rng()
    fit(tmp_path / "plain", [plain], 3)
    for step in (1, 2, 3):
        assert torch.equal(plain.start[step], after.start[step]), f"RNG stream differs from a plain fit at {step}"
    assert torch.equal(plain.end[2], after.end[2])  # step 2 trained the same full model on the same masks
    assert not torch.equal(plain.end[3], after.end[3])  # step 3 (level 2) draws fewer numbers: the check can fail
