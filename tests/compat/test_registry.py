"""The matrix covers every feature of the compatibility issue for every technique column, each row has its test,
and the README's table is the one the rows render (``python -m tests.compat.registry --write`` after a change)."""

from __future__ import annotations

import importlib

from tests.compat import registry
from tests.compat.setups import TECHNIQUES

#: the features every technique is checked against
REQUIRED = {
    # the training loop, the tuner and evaluation (test_loop.py)
    "overfit_batches",
    "limit_train_batches",
    "val_check_interval",
    "check_val_every_n_epoch",
    "max_time",
    "lr_find",
    "batch_size_finder",
    "evaluate_after_fit",
    "evaluate_from_checkpoint",
    # optimization and the callbacks around it (test_optimization.py)
    "accumulate_grad_batches",
    "gradient_accumulation_scheduler",
    "gradient_clipping",
    "manual_optimization",
    "step_lr_scheduler",
    "epoch_lr_scheduler",
    "reduce_lr_on_plateau",
    "one_cycle_lr",
    "early_stopping",
    "checkpoint_best",
    "checkpoint_periodic",
    "weight_averaging",
    "third_party_ema",
    # how the model runs (test_runtime.py)
    "torch_compile",
    "bf16_mixed",
    "bf16_true",
    "fp16_mixed",
    "fp64_true",
    "ddp",
    "ddp_spawn",
    "fsdp",
    "deepspeed",
}


def test_every_feature_has_a_row_for_every_technique():
    rows = registry.rows()
    features = [r.feature for r in rows]
    assert len(features) == len(set(features)), "a feature has two rows"
    assert REQUIRED <= set(features), sorted(REQUIRED - set(features))
    for row in rows:
        assert set(row.cells) == set(TECHNIQUES)


def test_every_row_has_its_test():
    for name in registry.MODULES:
        module = importlib.import_module(name)
        for row in module.ROWS:
            assert callable(getattr(module, f"test_{row.feature}", None)), f"{name} has no test_{row.feature}"


def test_the_readme_table_is_the_rendered_one():
    assert registry.readme_table() == registry.render(), "run: python -m tests.compat.registry --write"
