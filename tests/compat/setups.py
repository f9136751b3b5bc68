"""The compatibility matrix's rows and columns: each technique (and the all-four stack) as a tiny, seeded run, a
:class:`Probe` that measures what the technique did to the training (samples pruned, sequences truncated, tokens
dropped inside layers, a smaller model trained), and the two outcomes a cell may have: it works (the technique's
effect and the feature's effect are both present) or it is refused before the first training step with a message
naming the feature (``lightning_effi.core.features``).

The model is a 4-layer GPT-2 (32 wide, 16-token blocks of a 64-token vocabulary), 24 samples in batches of 4 (6
batches per epoch), SGD with momentum. A test builds a run with :func:`build`, changes the Trainer or the module for
its feature, fits, and checks :func:`assert_effect` plus its own feature's effect.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback

from lightning_effi import Curriculum, InfoBatchCallback, RandomLTDCallback, VCycleCallback
from tests.harness.settings import seeded
from tests.helpers.harness import make_trainer
from tests.helpers.tiny import TinyDataModule, TokenBlocks, tiny_gpt2

#: the matrix's columns: each technique alone and all four stacked
TECHNIQUES = ("infobatch", "curriculum", "random_ltd", "vcycle", "stack")
STACK = ("infobatch", "curriculum", "random_ltd", "vcycle")

#: 24 samples of 16 tokens, batch 4: 6 batches per full epoch; 4 transformer blocks
N, SEQ, BATCH, LAYERS = 24, 16, 4, 4
#: a step-bounded run (every column but InfoBatch alone, which plans by epochs: 3 epochs, full / pruned / full)
STEPS, EPOCHS = 10, 3

WORKS, REFUSED = "works", "refused"


def callback(name: str, stacked: bool = False, **kw: Any) -> Callback:
    """A fresh technique callback with tiny settings whose effect shows within :data:`STEPS` steps (``stacked``: the
    settings of the all-four stack; ``kw``: more constructor arguments, e.g. ``nonfinite_loss``)."""
    if name == "infobatch":
        if stacked:  # thins the curriculum's batches of epoch 1 (scored in epoch 0) up to step floor(0.9 x 10)
            return InfoBatchCallback(prune_ratio=0.5, delta=0.9, seed=7, **kw)
        # prunes epoch 1 of 3 (delta = 0.67): half the well-learned samples dropped
        return InfoBatchCallback(prune_ratio=0.5, delta=0.67, seed=7, **kw)
    if name == "curriculum":  # truncate to 8 tokens, growing to 16 over 6 steps
        return Curriculum(
            metrics={
                "seqlen_truncate": dict(
                    difficulty_type="value",
                    clustering_type="single_cluster",
                    min_difficulty=8,
                    max_difficulty=SEQ,
                    schedule_type="fixed_linear",
                    schedule_config=dict(total_curriculum_step=6, difficulty_step=4),
                )
            },
            seed=3,
            num_epochs=2,
            **kw,
        )
    if name == "random_ltd":  # blocks 1 and 2 see 4 -> 16 tokens
        return RandomLTDCallback(min_value=4, max_value=SEQ, seq_per_step=4, seed=7, **kw)
    if name == "vcycle":  # level 2 (2 blocks) for the 2nd and 3rd fifths of the run, then back to level 1
        return VCycleCallback(e_a="0.2dur", e_small="0.4dur", alpha_original=0.3, lr_multiplier={2: 2.0}, **kw)
    raise KeyError(name)


@dataclass
class Run:
    """One cell's run: the technique callbacks, the model and DataModule, the Trainer's limits, and a probe."""

    technique: str
    callbacks: list[Callback]
    model: pl.LightningModule
    datamodule: pl.LightningDataModule
    limits: dict[str, Any]
    probe: Probe = field(default_factory=lambda: Probe())

    @property
    def names(self) -> tuple[str, ...]:
        return STACK if self.technique == "stack" else (self.technique,)

    def trainer(self, root: Path, extra: Sequence[Callback] = (), **kwargs: Any) -> pl.Trainer:
        """A quiet CPU trainer with the technique callbacks, ``extra`` callbacks and the probe (last)."""
        return make_trainer(root, [*self.callbacks, *extra, self.probe], **{**self.limits, **kwargs})

    def fit(self, root: Path, extra: Sequence[Callback] = (), **kwargs: Any) -> pl.Trainer:
        trainer = self.trainer(root, extra, **kwargs)
        trainer.fit(self.model, datamodule=self.datamodule)
        return trainer


def build(
    technique: str,
    model_fn: Callable[[], pl.LightningModule] | None = None,
    seed: int = 0,
    dataset: torch.utils.data.Dataset | None = None,
    batch_size: int = BATCH,
    options: dict[str, dict[str, Any]] | None = None,
) -> Run:
    """A fresh, seeded run of ``technique`` (a name of :data:`TECHNIQUES`): the DataModule wrapped as the Hydra app
    wraps it (each technique's ``wrap_datamodule``, in callback order). ``model_fn`` replaces the tiny GPT-2 (e.g. a
    subclass with manual optimization); ``options``: more constructor arguments per technique name."""
    pl.seed_everything(seed, workers=True)
    names = STACK if technique == "stack" else (technique,)
    callbacks = [callback(n, stacked=technique == "stack", **(options or {}).get(n, {})) for n in names]
    model = (model_fn or seeded(tiny_gpt2, n_layer=LAYERS))()
    dm: pl.LightningDataModule = TinyDataModule(
        dataset if dataset is not None else TokenBlocks(n=N, seq_len=SEQ), batch_size=batch_size
    )
    for cb in callbacks:
        wrap = getattr(cb, "wrap_datamodule", None)
        if callable(wrap):
            dm = wrap(dm)
    limits: dict[str, Any] = (
        dict(max_epochs=EPOCHS, max_steps=-1) if technique == "infobatch" else dict(max_steps=STEPS, max_epochs=-1)
    )
    if "curriculum" in names:
        limits["use_distributed_sampler"] = False
    return Run(technique, callbacks, model, dm, limits)


class Probe(Callback):
    """Measures, for every training batch, what each transformer block's first layer norm (``*.ln_1``) received:
    ``blocks[i] = [B, T, H]``, plus the epoch and the step. From these :func:`assert_effect` reads the techniques'
    effects: InfoBatch trains fewer samples in an epoch than the dataset holds, the curriculum feeds shorter
    sequences, random-LTD feeds fewer tokens to the middle blocks than to the first, the V-cycle trains fewer blocks.
    With ``out_dir`` it writes its records to ``<out_dir>/rank<r>.json`` at the end of fit (for spawned processes).
    """

    def __init__(self, out_dir: str | Path | None = None) -> None:
        self.out_dir = None if out_dir is None else str(out_dir)
        self.batches: list[dict[str, Any]] = []
        #: per epoch that ended: whether its loader was exhausted (not cut by max_steps, a limit or a stop)
        self.complete: dict[int, bool] = {}
        self._handles: list[Any] = []
        self._shapes: list[list[int]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._shapes = []
        for name, module in pl_module.named_modules():
            if name.endswith("ln_1"):
                self._handles.append(module.register_forward_pre_hook(self._record))

    def _record(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self._shapes.append(list(args[0].shape))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.batches.append(
            dict(epoch=trainer.current_epoch, step=trainer.global_step, blocks=self._shapes, batch_idx=idx)
        )

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.complete[trainer.current_epoch] = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.out_dir is not None:
            Path(self.out_dir).mkdir(parents=True, exist_ok=True)
            path = Path(self.out_dir) / f"rank{trainer.global_rank}.json"
            record = dict(batches=self.batches, complete=self.complete, global_step=trainer.global_step)
            path.write_text(json.dumps(record))

    @staticmethod
    def load(out_dir: str | Path, rank: int = 0) -> tuple[list[dict[str, Any]], dict[int, bool]]:
        """The batches and complete epochs a probe with ``out_dir`` recorded on ``rank``."""
        record = json.loads((Path(out_dir) / f"rank{rank}.json").read_text())
        return record["batches"], {int(k): v for k, v in record["complete"].items()}


def effects(
    batches: Sequence[dict[str, Any]], complete: dict[int, bool], dataset_size: int = N, world_size: int = 1
) -> dict[str, bool]:
    """Which techniques' effects the probe's ``batches`` show (keys of :data:`STACK`). InfoBatch: a complete epoch
    (its loader exhausted, ``complete``) trained fewer than ``dataset_size / world_size`` samples, or a batch was
    thinned below the batch size (InfoBatch inside the curriculum's stream). Epochs cut by ``max_steps``,
    ``limit_train_batches`` or a stop do not count: a feature that cuts every epoch needs its own measure."""
    traced = [b for b in batches if b["blocks"]]
    per_epoch: dict[int, int] = defaultdict(int)
    for b in traced:
        per_epoch[b["epoch"]] += b["blocks"][0][0]
    full_epoch = dataset_size // world_size
    pruned_epoch = any(n < full_epoch for e, n in per_epoch.items() if complete.get(e))
    return dict(
        infobatch=pruned_epoch or any(b["blocks"][0][0] < BATCH for b in traced),
        curriculum=any(b["blocks"][0][1] < SEQ for b in traced),
        random_ltd=any(any(s[1] < b["blocks"][0][1] for s in b["blocks"][1:]) for b in traced),
        vcycle=any(len(b["blocks"]) < LAYERS for b in traced),
    )


def assert_effect(
    run: Run,
    batches: Sequence[dict[str, Any]] | None = None,
    complete: dict[int, bool] | None = None,
    world_size: int = 1,
) -> None:
    """The run trained, and each of its techniques acted (:func:`effects`), measured from what the blocks received.

    InfoBatch's effect is a pruned epoch: an epoch that trained fewer samples than the dataset has (or, inside the
    curriculum's stream, batches thinned below the batch size)."""
    batches = run.probe.batches if batches is None else batches
    complete = run.probe.complete if complete is None else complete
    assert batches, "no training batch was recorded"
    seen = effects(batches, complete, world_size=world_size)
    missing = [n for n in run.names if not seen[n]]
    assert not missing, f"no effect of {missing} in the run: {seen}"


def assert_refused(run: Run, trainer: pl.Trainer, feature: str, **fit_kwargs: Any) -> None:
    """Fitting ``run`` with ``trainer`` is refused before the first training step, with an error whose message
    names ``feature`` (a substring, e.g. ``"overfit_batches"``) and one of the run's technique callbacks."""
    with pytest.raises(MisconfigurationException) as err:
        trainer.fit(run.model, datamodule=run.datamodule, **fit_kwargs)
    message = str(err.value)
    assert feature in message, message
    assert any(type(cb).__name__ in message for cb in run.callbacks), message
    assert trainer.global_step == 0 and not run.probe.batches, "refused only after training started"
