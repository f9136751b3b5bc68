"""Each technique, and the stacks, on modules written the way users write them (``modules.py``: an HF GPT-2 on
character tuples, a timm ViT on ``(x, y)``, an HF BERT classifier with a padding collate, a hand-written
``nn.TransformerEncoder``), with nothing added to the module: no ``effi_*`` hook, no ``per_sample_loss``, a plain
``loss`` return. Every cell trains, shows the technique's effect (samples pruned, sequences truncated, tokens dropped,
levels visited), ends on the full model with nothing patched, and the EfficiencyMonitor's figures are non-zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_effi import Curriculum, EfficiencyMonitor, InfoBatchCallback, RandomLTDCallback, VCycleCallback
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import seqlen_truncate
from tests.user_modules.modules import USER_MODULES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: the sequence modules' lengths: (shortest schedule start, longest sequence)
SEQ = {"gpt2_chars": (8, 32), "bert_cls": (8, 24), "torch_encoder": (4, 16)}
#: the ViT of modules.py: 16 patches and the class token
VIT_TOKENS = 17


def infobatch(**kw: Any) -> InfoBatchCallback:
    return InfoBatchCallback(prune_ratio=0.5, delta=0.67, seed=0, **kw)


def curriculum(name: str, **kw: Any) -> Curriculum:
    low, high = SEQ[name]
    return Curriculum(metrics=seqlen_truncate(low, high, total_curriculum_step=6, difficulty_step=4), seed=3, **kw)


def random_ltd(name: str, **kw: Any) -> RandomLTDCallback:
    low = 5 if name == "timm_vit" else SEQ[name][0]
    return RandomLTDCallback(min_value=low, seq_per_step=4, seed=0, **kw)  # max_value: from the data


def vcycle(**kw: Any) -> VCycleCallback:
    return VCycleCallback(e_a="0.2dur", e_small="0.4dur", alpha_original=0.3, **kw)


@dataclasses.dataclass(frozen=True)
class Cell:
    module: str
    techniques: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.module}:{'+'.join(self.techniques)}"

    def callbacks(self, **common: Any) -> list[pl.Callback]:
        """The cell's technique callbacks; ``common``: arguments every one of them takes (e.g. ``nonfinite_loss``)."""
        build: dict[str, Callable[..., pl.Callback]] = {
            "infobatch": infobatch,
            "curriculum": lambda **kw: curriculum(self.module, **kw),
            "random_ltd": lambda **kw: random_ltd(self.module, **kw),
            "vcycle": vcycle,
        }
        return [build[t](**common) for t in self.techniques]

    def limits(self) -> dict[str, Any]:
        if "infobatch" in self.techniques and "curriculum" not in self.techniques:
            return dict(max_epochs=3)  # InfoBatch alone plans by epochs: full, pruned, full
        # with the curriculum, InfoBatch thins from the second pass over the data (scores seen): 32 samples, batch 4
        steps = 24 if "infobatch" in self.techniques else 10
        out: dict[str, Any] = dict(max_steps=steps, max_epochs=-1)
        if "curriculum" in self.techniques:
            out["use_distributed_sampler"] = False
        return out


SINGLE = [Cell(m, (t,)) for m in USER_MODULES for t in ("infobatch", "curriculum", "random_ltd", "vcycle")]
SINGLE = [c for c in SINGLE if not (c.module == "timm_vit" and c.techniques == ("curriculum",))]  # no sequence
STACKS = [
    Cell("gpt2_chars", ("infobatch", "curriculum", "random_ltd", "vcycle")),
    Cell("bert_cls", ("infobatch", "curriculum", "random_ltd")),
    Cell("timm_vit", ("infobatch", "random_ltd", "vcycle")),
    Cell("torch_encoder", ("infobatch", "curriculum", "random_ltd")),
]


class Spy(pl.Callback):
    """What ``training_step`` receives (types and shapes)."""

    def __init__(self) -> None:
        self.shapes: list[tuple] = []
        self.types: set[type] = set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.types.add(type(batch))
        tensors = list(batch.values()) if isinstance(batch, dict) else list(batch)
        self.shapes.append(tuple(tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor)))


def prepare(
    cell: Cell,
    root,
    *,
    make_module: Callable[[], pl.LightningModule] | None = None,
    common: dict[str, Any] | None = None,
    extra: Sequence[pl.Callback] = (),
) -> tuple[pl.Trainer, pl.LightningModule, Any, EfficiencyMonitor, list[pl.Callback]]:
    """The cell's user module (``make_module`` in its place, built after the same seed) and DataModule, the DataModule
    wrapped by each technique that owns the loader, and a Trainer with ``[monitor, *techniques, *extra]``;
    ``common``: arguments the monitor and every technique take (e.g. ``nonfinite_loss``)."""
    module_fn, data_fn = USER_MODULES[cell.module]
    common = common or {}
    torch.manual_seed(0)
    module, dm = (make_module or module_fn)(), data_fn()
    callbacks = cell.callbacks(**common)
    for cb in callbacks:  # each technique that owns the loader wraps the user's DataModule
        wrap = getattr(cb, "wrap_datamodule", None)
        if callable(wrap):
            dm = wrap(dm)
    monitor = EfficiencyMonitor(print_summary=False, **common)
    trainer = make_trainer(root, callbacks=[monitor, *callbacks, *extra], **cell.limits())
    return trainer, module, dm, monitor, callbacks


def run(cell: Cell, root) -> tuple[pl.Trainer, EfficiencyMonitor, Spy, list[pl.Callback]]:
    spy = Spy()
    trainer, module, dm, monitor, callbacks = prepare(cell, root, extra=[spy])
    trainer.fit(module, datamodule=dm)
    spy.patched_after = [n for n, m in module.named_modules() if "forward" in m.__dict__]  # after teardown
    return trainer, monitor, spy, callbacks


def check_effects(cell: Cell, trainer: pl.Trainer, monitor: EfficiencyMonitor, spy: Spy) -> None:
    s = monitor.summary
    assert s["samples"] > 0 and s["flops"] > 0, s
    if cell.module != "timm_vit" or "random_ltd" in cell.techniques:
        assert s["tokens"] > 0 and s["layer_tokens"] > 0, s
    assert not spy.patched_after, spy.patched_after
    if "infobatch" in cell.techniques:
        assert s["infobatch/saved_samples"] > 0, s
    if "random_ltd" in cell.techniques:
        assert s["saved/random_ltd/layer_tokens_frac"] > 0, s
    if "vcycle" in cell.techniques:
        assert s["saved/vcycle/flops_frac"] > 0, s
    if "curriculum" in cell.techniques:
        low, high = SEQ[cell.module]
        lengths = [shape[0][1] for shape in spy.shapes]  # the first tensor: the token ids [B, T]
        assert lengths[0] <= low + 4 and max(lengths) <= high, lengths  # one difficulty_step after the start
        assert s["saved/curriculum/tokens_frac"] > 0, s


@pytest.mark.parametrize("cell", SINGLE, ids=lambda c: c.id)
def test_each_technique_on_each_user_module(cell, tmp_path):
    trainer, monitor, spy, _ = run(cell, tmp_path)
    check_effects(cell, trainer, monitor, spy)
    assert len(spy.types) == 1 and spy.types <= {tuple, list, dict}  # the user's batch type, never an EffiBatch


@pytest.mark.slow
@pytest.mark.parametrize("cell", STACKS, ids=lambda c: c.id)
def test_stacks_on_user_modules(cell, tmp_path):
    trainer, monitor, spy, _ = run(cell, tmp_path)
    check_effects(cell, trainer, monitor, spy)
