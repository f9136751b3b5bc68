"""The non-finite loss policy across a stack (``lightning_effi.core.nonfinite``): all four techniques on one tiny
GPT-2 (the compatibility matrix's stack, ``tests/compat/setups.py``), a loss that becomes NaN at a chosen step.

- by default (every technique ``nonfinite_loss="raise"``) the fit stops at that step, before its backward pass, with
  one :class:`NonFiniteLossError` naming every technique, and the weights are those of the step before;
- the strictest policy wins: one technique asking ``"raise"`` stops the run even when the others say ``"warn"``;
- with ``"warn"`` everywhere and the user's own handling (non-finite gradients zeroed before the optimizer step),
  the run goes on and the NaN step is counted once (one check per backward pass, not one per technique);
- with ``"warn"`` and no handling the weights become NaN, and the V-cycle refuses to map them at its next switch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_effi.core.nonfinite import NonFiniteLossError, NonFiniteLossGuard
from tests.compat.setups import LAYERS, STACK, STEPS, build
from tests.harness.settings import seeded
from tests.helpers.nonfinite import WeightsAtBatchStart, assert_weights_unchanged, zero_nonfinite_grads
from tests.helpers.tiny import tiny_gpt2

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def poisoned(at_step: int, clean_grads: bool = False) -> Any:
    """A tiny GPT-2 whose per-sample losses are NaN at global step ``at_step`` (``clean_grads``: the user zeroes
    non-finite gradients before each optimizer step, their own handling of a bad step)."""

    def make() -> pl.LightningModule:
        model = seeded(tiny_gpt2, n_layer=LAYERS)()
        per_sample_loss = model.per_sample_loss

        def poisoned_loss(batch: Any) -> Any:
            per_sample, extra = per_sample_loss(batch)
            if model.training and model.trainer.global_step == at_step:
                per_sample = per_sample * float("nan")
            return per_sample, extra

        model.per_sample_loss = poisoned_loss  # type: ignore[method-assign]
        if clean_grads:

            def on_before_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
                zero_nonfinite_grads(model)

            model.on_before_optimizer_step = on_before_optimizer_step  # type: ignore[method-assign]
        return model

    return make


def policies(**by_name: str) -> dict[str, dict[str, Any]]:
    return {name: {"nonfinite_loss": by_name.get(name, by_name.get("default", "raise"))} for name in STACK}


def test_stack_stops_at_the_first_nan_loss_naming_every_technique(tmp_path: Path) -> None:
    # step 1: before the V-cycle's first switch (step 2), so the module holds the full model throughout
    run = build("stack", model_fn=poisoned(1))
    snap = WeightsAtBatchStart()
    trainer = run.trainer(tmp_path, extra=[snap])
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit(run.model, datamodule=run.datamodule)
    message = str(err.value)
    for cb in run.callbacks:
        assert type(cb).__name__ in message, message
    assert "step 1" in message and "nan" in message.lower()
    assert trainer.global_step == 1  # the NaN step took no optimizer step
    # the weights are those the NaN step started from (its backward never ran)
    assert_weights_unchanged(run.model, snap.before[1])


def test_the_strictest_policy_of_the_stack_wins(tmp_path: Path) -> None:
    # only the last technique asks "raise"; the first in the Trainer's list (which runs the check) says "warn"
    run = build("stack", model_fn=poisoned(2), options=policies(default="warn", vcycle="raise"))
    assert type(run.callbacks[0]).__name__ == "InfoBatchCallback"
    trainer = run.trainer(tmp_path)
    with pytest.raises(NonFiniteLossError, match="step 2"):
        trainer.fit(run.model, datamodule=run.datamodule)
    assert trainer.global_step == 2


def test_warn_counts_each_nan_step_once_and_the_run_goes_on(tmp_path: Path) -> None:
    run = build("stack", model_fn=poisoned(3, clean_grads=True), options=policies(default="warn"))
    trainer = run.trainer(tmp_path)
    with pytest.warns(UserWarning, match="step 3"):
        trainer.fit(run.model, datamodule=run.datamodule)
    assert trainer.global_step == STEPS
    guards = [cb.nonfinite_guard for cb in run.callbacks]
    assert all(isinstance(g, NonFiniteLossGuard) for g in guards)
    # one check per backward pass: the first guarded technique counts, the others never see it
    assert [g.count for g in guards] == [1, 0, 0, 0]
    assert guards[0].first_step == 3
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


def test_warn_without_handling_the_vcycle_never_maps_nan_weights(tmp_path: Path) -> None:
    # NaN at step 0: the weights are NaN from step 1 on; the V-cycle's first switch (coalescing at 0.2 x 10 steps)
    # must refuse them rather than coalesce NaN into the small model
    run = build("stack", model_fn=poisoned(0), options=policies(default="warn"))
    trainer = run.trainer(tmp_path)
    with pytest.raises(Exception, match=r"(?i)finite") as err:
        trainer.fit(run.model, datamodule=run.datamodule)
    assert not isinstance(err.value, NonFiniteLossError), "the warn policy raised at the loss itself"
    assert "VCycle" in str(err.value), str(err.value)
    assert trainer.global_step == 2  # stopped at the switch after step 2, not later
