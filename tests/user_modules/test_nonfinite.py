"""The non-finite loss policy on a stack of all four techniques over a module written the way users write them
(``modules.CharGPT2``: an HF GPT-2 on ``(x, y)`` character tuples, ``return out.loss``), whose loss the user's own
code makes NaN at one step. The techniques stand between that loss and its backward pass (InfoBatch reweights it
with per-sample losses it computes itself, random-LTD and the V-cycle change the model under it), yet the NaN must
reach the check, on the full model and on the V-cycle's coarse one:

- by default the fit stops at that step, before its backward pass, naming every technique, the weights untouched;
- with ``nonfinite_loss="warn"`` everywhere and the user's own handling (non-finite gradients zeroed), the run goes on
  to its last step and the NaN step is counted once.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_effi.core.nonfinite import NonFiniteLossError, nonfinite_count
from tests.helpers.nonfinite import WeightsAtBatchStart, assert_weights_unchanged, zero_nonfinite_grads
from tests.user_modules.modules import CharGPT2
from tests.user_modules.test_techniques import STACKS, prepare

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CELL = next(c for c in STACKS if c.module == "gpt2_chars")  # infobatch + curriculum + random_ltd + vcycle
#: the V-cycle's first switch (coalescing) is after 0.2 x 24 steps: step 3 is on the full model, 6 on the coarse
FULL_STEP, COARSE_STEP = 3, 6


class NaNAtStep(CharGPT2):
    """The user's module, its loss multiplied by NaN at global step ``at_step`` (e.g. a bad batch); ``clean_grads``:
    the user's own handling, non-finite gradients zeroed before each optimizer step."""

    def __init__(self, at_step: int, clean_grads: bool = False) -> None:
        super().__init__()
        self.at_step, self.clean_grads = at_step, clean_grads

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if self.global_step == self.at_step else loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.clean_grads:
            zero_nonfinite_grads(self)


def fit(tmp_path: Path, at_step: int, policy: str | None, clean_grads: bool = False) -> tuple[Any, ...]:
    snap = WeightsAtBatchStart()
    trainer, module, dm, _, _ = prepare(
        CELL,
        tmp_path,
        make_module=lambda: NaNAtStep(at_step, clean_grads),
        common=None if policy is None else {"nonfinite_loss": policy},
        extra=[snap],
    )
    return trainer, module, dm, snap


@pytest.mark.parametrize("at_step", [FULL_STEP, COARSE_STEP])
def test_the_users_nan_loss_stops_the_stack_before_its_backward(tmp_path: Path, at_step: int) -> None:
    trainer, module, dm, snap = fit(tmp_path, at_step, policy=None)
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit(module, datamodule=dm)
    message = str(err.value)
    names = "EfficiencyMonitor, InfoBatchCallback, Curriculum, RandomLTDCallback, VCycleCallback"
    assert message.startswith(f"{names}: the training loss is nan at step {at_step}"), message
    assert trainer.global_step == at_step  # the NaN step took no optimizer step
    if at_step == FULL_STEP:  # (on the coarse level the V-cycle hands back the full model's shapes at the exception)
        assert_weights_unchanged(module, snap.before[at_step])


@pytest.mark.parametrize("at_step", [FULL_STEP, COARSE_STEP])
def test_warn_with_the_users_handling_goes_on_and_counts_the_nan_step_once(tmp_path: Path, at_step: int) -> None:
    trainer, module, dm, _ = fit(tmp_path, at_step, policy="warn", clean_grads=True)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == CELL.limits()["max_steps"]
    assert nonfinite_count(trainer.callbacks) == 1
    assert all(torch.isfinite(p).all() for p in module.parameters())
