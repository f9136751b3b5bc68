"""Measure what a training run really computed: a callback that runs every training batch under
``torch.utils.flop_counter.FlopCounterMode`` and sums the FLOPs counted there, to check the analytic figures of
:class:`~lightning_effi.core.accounting.EfficiencyMonitor` against.

Under automatic optimization Lightning runs ``on_train_batch_start`` (every callback, in list order), then the
optimizer step whose closure runs ``training_step`` and ``backward``, then ``on_train_batch_end``: the window between
the two hooks of this callback holds the forward and the backward of the batch (and the optimizer update, which has no
matrix product). Put it FIRST in ``Trainer(callbacks=...)``: it exits in its own ``on_train_batch_end``, before any
later callback counts FLOPs of its own (a meta-device measurement, a V-cycle level change) in that hook.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count


def _cpu_flash_forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query, key, value))


def _cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out, query, key, value))


#: the CPU kernels of ``F.scaled_dot_product_attention``, which ``FlopCounterMode`` has no formula for (torch 2.x
#: registers the CUDA flash / efficient / cuDNN ones only): counted as those are, ``4·B·h·S·S·d`` forward (full square,
#: causal or not) and twice that backward. The math fallback decomposes into ``bmm`` and is counted anyway.
CPU_SDPA_FORMULAS: dict[Any, Any] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


def flop_counter() -> FlopCounterMode:
    """``FlopCounterMode(display=False)`` that also counts the CPU kernels of scaled-dot-product attention."""
    return FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FORMULAS)


class MeasuredFlops(Callback):
    """Sums the FLOPs :func:`flop_counter` counts inside each training batch (matmul, addmm, bmm, convolution,
    scaled-dot-product attention; forward and backward; 1 multiply-add = 2 FLOPs).

    Args:
        out_dir: if set, ``<out_dir>/measured_rank<r>.json`` (``{"per_batch": [...]}``) is written at the end of fit
            (for DDP processes started from the test, which do not update the parent's callbacks).

    Attributes:
        per_batch: the FLOPs of every training batch on this rank, in order (ints).
        total: their sum.
    """

    def __init__(self, out_dir: str | Path | None = None) -> None:
        self.out_dir = None if out_dir is None else str(out_dir)
        self.per_batch: list[int] = []
        self._mode: FlopCounterMode | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(out_dir={self.out_dir!r})"

    @property
    def total(self) -> int:
        return sum(self.per_batch)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "MeasuredFlops: the window between the batch hooks holds the backward only under automatic optimization"
            )
        self._mode = flop_counter()
        self._mode.__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._mode is not None, "on_train_batch_end without on_train_batch_start"
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self.per_batch.append(int(mode.get_total_flops()))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.out_dir is not None:
            Path(self.out_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(self.out_dir) / f"measured_rank{trainer.global_rank}.json", "w") as f:
                json.dump({"per_batch": self.per_batch}, f)


def read_measured(out_dir: str | Path, world_size: int = 2) -> list[list[int]]:
    """Per rank, the per-batch FLOPs a :class:`MeasuredFlops` with ``out_dir`` wrote."""
    out = []
    for rank in range(world_size):
        with open(Path(out_dir) / f"measured_rank{rank}.json") as f:
            out.append(json.load(f)["per_batch"])
    return out
