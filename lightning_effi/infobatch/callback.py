"""``InfoBatchCallback``: the Lightning layer of InfoBatch, unbiased dynamic data pruning (Qin et al., ICLR 2024).
The method itself lives in :mod:`lightning_effi.infobatch.functional`; the method card ``README.md`` beside this file
tells the long story.

- ``setup``: validates the run, attaches itself to the :class:`~lightning_effi.data.InfoBatchDataModule` (which
  rebuilds the training loader from this callback's plan every epoch) and wraps the module's ``training_step`` at
  the instance level: the wrapper reads the batch's sample index from the batch metadata
  (:func:`~lightning_effi.core.batch.batch_meta`; the user's step receives its own batch, of any structure,
  unchanged), calls the user's step, takes the per-sample loss (returned by the step, computed by
  ``per_sample_loss=fn`` from the step's forward output, or the automatic cross-entropy of its logits, checked
  against the step's loss) and returns the weighted mean as ``"loss"`` (the module never sees indices or weights);
  with manual optimization the step calls :func:`weighted_loss` itself; ``teardown``, and ``on_exception`` when the fit
  raises (Lightning skips ``teardown`` then), undo all of it: the module's own ``training_step``, the DataModules
  detached, the Trainer's ``reload_dataloaders_every_n_epochs`` as it was; a module whose ``training_step`` an
  earlier fit left wrapped (its ``on_exception`` never ran) is unwrapped at ``setup``, with a warning;
- every batch: records the raw per-sample losses (rank-local sums and counts);
- ``on_train_epoch_end``: sums the records over ranks (one collective per epoch) into the score table, identical
  on every rank, and logs the epoch's figures; the next epoch's plan is a pure function of
  ``(seed, epoch, score table)``;
- ``state_dict``: tables, the current plan, accumulators, counters: a resumed run (mid-epoch too) continues exactly;
- the run's progress clock (:class:`~lightning_effi.core.protocols.ProvidesProgressClock`: :meth:`effi_progress`,
  :meth:`effi_progress_done`, :meth:`effi_min_total_steps`), so that the V-cycle's stages and random-LTD's schedule
  follow the shortened epochs; :meth:`effi_baseline` tells the EfficiencyMonitor the samples each batch stands for.

Composed with the curriculum (a :class:`~lightning_effi.data.CurriculumDataModule` in the DataModule chain and the
:class:`~lightning_effi.callbacks.Curriculum` callback in the Trainer), the curriculum draws every batch and this
callback thins each drawn micro-batch inside the curriculum's sampler (it attaches itself as the
``CurriculumDataModule``'s ``thinner``): the well-learned set of an epoch is frozen from the score table at the
epoch's start (:meth:`InfoBatchCallback.prepare_epoch`), each rank's slice is thinned by
:func:`~lightning_effi.infobatch.functional.thin_micro_batch` with a generator of ``(seed, step, micro, rank)``, and
the loss is :func:`~lightning_effi.infobatch.functional.thinned_loss`. See "Composition" in the method card.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn
from typing_extensions import override

from lightning_effi.core.accounting import Baseline
from lightning_effi.core.batch import batch_meta
from lightning_effi.core.checks import check_bool, check_int, check_real, is_int
from lightning_effi.core.compat import (
    logging_step,
    rebuild_train_loader_after_restore,
    restart_next_epoch_at_its_start,
)
from lightning_effi.core.features import optimized_parameters
from lightning_effi.core.hook_ids import reserve_hook_ids
from lightning_effi.core.lr_schedules import refresh_progress_schedules
from lightning_effi.core.measure import find_batch_size, row_tokens, tensor_leaves
from lightning_effi.core.nonfinite import NonFiniteLossError, NonFiniteLossGuard, nonfinite_count, nonfinite_metrics
from lightning_effi.core.progress import accumulate_grad_batches_at, run_length, steps_per_epoch
from lightning_effi.core.requirements import (
    BATCH_STRUCTURES,
    IncompatibleTechniques,
    Requirements,
    check_started,
    check_trainer,
)
from lightning_effi.core.settings import KeepsSettings, apply_changed_settings, given_settings, keep_settings
from lightning_effi.core.state import check_coarse_vcycle_resume, config_mismatch, other_state_keys, settings_diff
from lightning_effi.core.wrapping import find_wrapper, live_fit, wrapper_chain
from lightning_effi.curriculum.data import THINNED_KEYS, CurriculumDataModule
from lightning_effi.infobatch import functional as ib
from lightning_effi.infobatch.data import InfoBatchDataModule

CONTRACT = (
    'training_step must return a loss (a scalar tensor, or {"loss": ...}), and InfoBatch needs one loss per sample: '
    'returned next to it ({"loss": ..., "per_sample_loss": float[B]}), computed by per_sample_loss=fn, or the '
    "automatic cross-entropy of the forward output's logits against the batch's labels (see the method card, "
    '"What it needs from your module")'
)

#: what a training_step with manual optimization does for InfoBatch
MANUAL = (
    "with manual optimization, training_step must compute its loss as lightning_effi.infobatch.weighted_loss(self, "
    "per_sample_loss) (per_sample_loss: float[B], one loss per sample, with grad) and manual_backward that loss"
)
#: why a second loss with its own backward is refused (said with the refusals of a manual step)
SECOND_LOSS = (
    ". A second loss with its own manual_backward (a GAN's discriminator, a critic, an auxiliary head with its own "
    "optimizer) is not supported with InfoBatch: it scores, prunes and reweights the samples by one per-sample loss, "
    "and a backward that does not carry that loss's weighting would train the pruned epochs on unweighted samples; "
    "train such a module without InfoBatch"
)


def _ends_itself(trainer: pl.Trainer) -> bool:
    """Whether something other than ``max_epochs`` / ``max_steps`` ends the fit: ``max_time`` (Lightning's
    ``Timer`` with a duration; one without measures time only, qa76-break 02) or an ``EarlyStopping`` callback."""
    from lightning.pytorch.callbacks import EarlyStopping, Timer

    return any(
        isinstance(c, EarlyStopping) or (isinstance(c, Timer) and getattr(c, "_duration", None) is not None)
        for c in trainer.callbacks  # type: ignore[attr-defined]
    )


#: where a per-sample loss came from (:attr:`InfoBatchCallback.per_sample_source`), for the error messages
SOURCES = {
    "returned": 'the "per_sample_loss" returned by training_step',
    "fn": "the per-sample loss returned by per_sample_loss=fn",
    "auto": "the automatic per-sample cross-entropy",
    "manual": "the per-sample loss passed to weighted_loss",
}


try:
    from torchmetrics import Metric as _Metric
except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
    _Metric = ()  # type: ignore[assignment,misc]

#: module types whose calls are never the forward output (a criterion ``self.loss_fn(logits, y)``, a metric
#: ``self.train_acc(logits, y)``, both often called after the model in ``training_step``)
#: the most tokens a checkpoint's per-sample table may hold for one sample: float64 counts whole numbers exactly up
#: to 2**53; a larger entry can only come from a damaged checkpoint, and would inflate the token baseline
MAX_SAMPLE_TOKENS = float(2**53)
NOT_FORWARD: tuple[type, ...] = (nn.modules.loss._Loss, *((_Metric,) if isinstance(_Metric, type) else ()))


def _top_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module`` and the modules a ``training_step`` may call directly: its children, looking through
    ``ModuleList`` / ``ModuleDict`` containers (which have no forward of their own), without loss and metric modules
    (:data:`NOT_FORWARD`); each once, with its attribute path from ``module`` (``""`` for ``module`` itself)."""
    out, seen, queue = [("", module)], {id(module)}, list(module.named_children())
    while queue:
        name, child = queue.pop(0)
        if id(child) in seen or isinstance(child, NOT_FORWARD):
            continue
        seen.add(id(child))
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            queue.extend((f"{name}.{sub}", grandchild) for sub, grandchild in child.named_children())
        else:
            out.append((name, child))
    return out


def _trainable(module: nn.Module, optimized: set[int] | None = None) -> bool:
    """Whether ``module`` has a parameter with ``requires_grad`` (a frozen teacher, an EMA copy, a parameterless
    activation or dropout module have none) that, with ``optimized`` (the ids of the optimizers' parameters) given,
    an optimizer trains (a teacher only put in eval mode and left out of ``configure_optimizers`` trains none)."""
    return any(p.requires_grad and (optimized is None or id(p) in optimized) for p in module.parameters())


class ForwardCapture:
    """Records the output of the last outermost module call made while it is active: the LightningModule's own
    ``forward`` (``self(x)``) or, when ``training_step`` calls a submodule directly (``self.model(**batch)``), that
    submodule's (children of the module, through ``ModuleList`` / ``ModuleDict``). Not recorded: calls nested inside
    another watched call, calls of loss modules (``nn.CrossEntropyLoss()``...) and torchmetrics metrics
    (:data:`NOT_FORWARD`), and calls of modules without a trainable parameter when the capture starts (a frozen
    teacher ``self.teacher(x)`` called before or after the student, an EMA copy, a parameterless ``nn.Dropout``):
    their output carries no gradient to the model, so it is never the output a per-sample loss is computed from.
    Forward hooks, registered on entry and removed on exit (so they follow a model that changes, or is frozen or
    unfrozen, between steps and cost nothing outside the step). With ``optimized`` (:func:`optimized_parameters`),
    a module whose trainable parameters no optimizer holds is not recorded either (a teacher put in eval mode under
    ``no_grad`` but not frozen, called after the student: its logits were taken, and the fit refused, qa42-user 03).

    Attributes:
        output: the recorded output (None before any call). captured: whether any watched call happened.
        source: which module's output was recorded, for error messages: ``"self (ClassName)"`` for the module's own
            forward, ``"self.<path> (ClassName)"`` for a submodule (None before any call).
    """

    def __init__(self, module: nn.Module, optimized: set[int] | None = None) -> None:
        self.module, self.optimized = module, optimized
        self.output: Any = None
        self.captured = False
        self.source: str | None = None
        self.sources: list[str] = []  # every recorded call's, in order
        self._depth = 0
        self._handles: list[Any] = []

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._depth += 1

    def _exit(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.output, self.captured = output, True
            self.source = f"self{'.' + name if name else ''} ({type(module).__name__})"
            self.sources.append(self.source)

    def _exit_frozen(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0 and any(isinstance(v, Tensor) and v.requires_grad for _, v in tensor_leaves(output)):
            self._fallback = (output, f"self{'.' + name if name else ''} ({type(module).__name__})")

    def __enter__(self) -> ForwardCapture:
        self._depth = 0
        self._fallback: tuple[Any, str] | None = None
        top = list(_top_modules(self.module))
        watched = [(n, m) for n, m in top if _trainable(m, self.optimized)]
        if not watched:  # optimizers holding other tensors than the modules' parameters: requires_grad alone
            watched = [(n, m) for n, m in top if _trainable(m)]
        for name, m in watched:
            self._handles.append(m.register_forward_pre_hook(self._enter))
            self._handles.append(m.register_forward_hook(partial(self._exit, name)))
        # a frozen network fed a trained input (a soft prompt, model reprogramming, prefix tuning of a frozen model):
        # its output carries the gradient, and is taken when no module with trained parameters was called (refused,
        # and fn was given None, qa113-peft 01)
        chosen = {id(m) for _, m in watched}
        for name, m in top:
            if id(m) not in chosen and next(m.parameters(), None) is not None:
                self._handles.append(m.register_forward_pre_hook(self._enter))
                self._handles.append(m.register_forward_hook(partial(self._exit_frozen, name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if not self.captured and self._fallback is not None:
            self.output, self.source = self._fallback
            self.captured = True
            self.sources.append(self.source)


@dataclass
class _Step:
    """The training batch being processed: its dataset indices (int64 ``[B]``), with the curriculum its thinning
    weights (float32 ``[B]``) and candidate count, and whether its loss was weighted (manual optimization: the
    weighted loss, whose graph every ``manual_backward`` of the step must contain)."""

    index: Tensor
    weights: Tensor | None = None
    candidates: int = 0
    weighted: bool = False
    loss: Tensor | None = None
    rows: int | None = None  # the samples the collated batch holds (find_batch_size), None when unknown


def weighted_loss(
    pl_module: pl.LightningModule, per_sample_loss: Tensor, per_sample_score: Tensor | None = None
) -> Tensor:
    """InfoBatch's loss for a module with **manual optimization**: call it in ``training_step`` on the batch's
    per-sample loss and ``manual_backward`` the result. With an :class:`InfoBatchCallback` in the module's Trainer it
    is :meth:`InfoBatchCallback.weighted_loss` (the weighted mean, Qin et al. 2024, Eq. 4, and the scores recorded);
    without one (the same module trained without InfoBatch), ``per_sample_loss.mean()``.

    Args:
        pl_module: the LightningModule being trained. per_sample_loss: ``float[B]``, with grad, one loss per sample
            of the batch ``training_step`` received. per_sample_score: optional ``float[B]``, the scores in place
            of the losses (NaN: that sample is not scored this time), as a returned ``"per_sample_score"``.

    Returns:
        A scalar tensor.

    Raises:
        ValueError, RuntimeError: see :meth:`InfoBatchCallback.weighted_loss`.
    """
    trainer = getattr(pl_module, "_trainer", None)
    callback = next((c for c in getattr(trainer, "callbacks", []) if isinstance(c, InfoBatchCallback)), None)
    if callback is None:
        return per_sample_loss.mean()
    return callback.weighted_loss(per_sample_loss, per_sample_score)


class InfoBatchCallback(KeepsSettings, Callback):
    """InfoBatch (Qin et al., "InfoBatch: Lossless Training Speed Up by Unbiased Dynamic Data Pruning", ICLR 2024,
    Sec. 3 and Algorithm 1; reference: NUS-HPC-AI-Lab/InfoBatch ``infobatch/infobatch.py``).

    Use with ``trainer.fit(model, datamodule=InfoBatchDataModule(your_datamodule))``, any batch structure (the
    module's hooks and ``training_step`` receive their batch as their collate function made it; the sample index
    travels in the batch metadata). The Hydra app (``experiments/train.py``) wraps the DataModule itself when this
    callback is configured.

    **The per-sample loss** ``l`` (``float[B]``, with grad, one loss per sample of the batch), first of:

    1. ``per_sample_loss=fn``: ``fn(outputs, batch)``, with ``outputs`` the forward output captured during
       ``training_step`` (:class:`ForwardCapture`: the output of the last outermost module call, the module's own
       ``self(x)`` or a submodule called directly such as ``self.model(**batch)``, skipping modules without a
       trainable parameter such as a frozen teacher; None when no such module was called)
       and ``batch`` the user's batch. A warning at the first batch where ``mean(l)`` differs from the step's loss
       (every batch is checked until one does).
    2. ``training_step`` returns ``{"loss": ..., "per_sample_loss": l}``.
    3. Automatic (a module that returns a plain cross-entropy loss, a tensor or ``{"loss": ...}``): the cross-entropy
       of the forward output's logits (a tensor ``[B, C]`` / ``[B, T, V]``, ``outputs["logits"]`` or
       ``outputs.logits``) against the batch's labels (``labels``/``label``/``targets``/``target``/``y`` key or
       attribute, or the last element of a tuple batch), ``ignore_index=-100``, token losses averaged per sample over
       the non-ignored tokens; for ``[B, T, V]`` the causal shift of Hugging Face's ``*ForCausalLM`` losses is
       detected on the first batch (:func:`~lightning_effi.infobatch.functional.auto_per_sample_loss`). On every
       batch ``mean(l)`` must reproduce the step's loss (computed in float32 from the logits; relative tolerance
       :func:`~lightning_effi.infobatch.functional.loss_tolerance` of the loss's dtype), else a ``ValueError`` asks
       for ``per_sample_loss=fn``: InfoBatch never trains on another loss than the module's. Labels outside the
       logits' classes (other than -100) and a bfloat16 loss (``precision="bf16-true"``: its rounding hides an extra
       term of a percent) are refused the same way.

    The step's ``"loss"`` is then replaced by ``mean(w · l)`` (Qin et al. 2024, Eq. 4; with the curriculum
    ``sum(w · l) / B``, see below). **Manual optimization** (``automatic_optimization = False``): the step computes
    ``loss = lightning_effi.infobatch.weighted_loss(self, per_sample)`` and calls ``manual_backward(loss)``; a step
    that does not call it exactly once raises, and so does a ``manual_backward`` of a loss not computed from it (the
    plain mean with the weighted loss computed beside it would train on unweighted losses).

    **With the curriculum** (:class:`~lightning_effi.callbacks.Curriculum` in the Trainer, the DataModule wrapped
    once in a :class:`~lightning_effi.data.CurriculumDataModule`, with or without an ``InfoBatchDataModule`` inside
    or outside it, callbacks in any order), the two are one data pipeline: the curriculum decides which samples are
    eligible and draws every batch (its stream, steps, difficulty schedule and truncation are unchanged); InfoBatch
    thins each drawn micro-batch and reweights what it keeps. The well-learned set of Lightning epoch ``e`` is
    ``seen & (score < mean(score[seen]))`` of the table at the start of ``e`` (frozen for the epoch, the same on every
    rank); each rank drops exactly ``m = floor(r·k) + Bernoulli(frac(r·k))`` of the ``k`` well-learned candidates of
    its slice, chosen uniformly with a generator of ``(seed, curriculum step, micro index, rank)``, so each is kept
    with probability exactly ``1 - r`` and weighted ``1 / (1 - r)``; the loss is ``sum(w · l over the kept) / B``
    (``B`` candidates), unbiased for the plain mean (Qin et al., ICLR 2024, Sec. 3). Steps after
    ``floor(δ·T)`` are not thinned (``T``: the run's optimizer steps, the smallest of ``max_steps``, the curriculum's
    sample budget and ``max_epochs`` data epochs). ``num_epochs`` must stay ``None`` and ``max_steps`` is allowed
    in this mode; ``effi_progress`` is not provided, nor the progress clock (the steps are the curriculum's).
    ``seqlen_reshape`` is refused.

    **The progress clock** (alone, not with the curriculum): the callback is the run's
    :class:`~lightning_effi.core.protocols.ProvidesProgressClock`, found by
    :func:`~lightning_effi.core.progress.progress_clock`: :meth:`effi_progress` (after the next optimizer step, for
    LR schedules), :meth:`effi_progress_done` (after the steps taken, ``(e + j / L_e) / E``) and
    :meth:`effi_min_total_steps` (the fewest steps the run can have). The V-cycle measures its fractions and epochs
    on it, random-LTD its derived schedule.

    Args:
        prune_ratio: ``r``, fraction of the well-learned samples dropped per prune epoch, in ``[0, 1)``
            (the paper's default 0.5; above 0.9 warns: weights exceed 10).
        delta: ``δ`` in ``(0, 1]``: epochs ``>= floor(δ·E)`` use the full data (annealing). 1.0 = no annealing.
        num_epochs: ``E``; default ``trainer.max_epochs`` (with the curriculum: not used, leave it ``None``).
        seed: seeds every plan (with the epoch); the global RNGs are never used.
        momentum: score update ``m·loss + (1-m)·score`` in ``(0, 1]``; 1.0 (default) = the paper's overwrite.
        strict: a checkpoint written with other ``prune_ratio/delta/seed/num_epochs`` raises on load (False: warns
            and uses the checkpoint's tables with this callback's settings). Another dataset size raises either way.
        per_sample_loss: ``fn(outputs, batch) -> float[B]`` (see above), or None (the loss returned by
            ``training_step``, else the automatic cross-entropy).
        nonfinite_loss: what a NaN or infinite training loss does (:mod:`lightning_effi.core.nonfinite`):
            ``"raise"`` (default) stops the fit at that step, before its backward pass, with a
            :class:`~lightning_effi.core.nonfinite.NonFiniteLossError` naming the step; ``"warn"`` warns once, counts
            them (``effi/nonfinite_losses``, checkpointed, reported at the end of fit) and lets the run go on (your
            own handling: a skipped step, a loss scaler). Either way a non-finite per-sample loss never enters the
            score table (the sample keeps its previous score). With several techniques, one check runs per backward
            pass, with the strictest policy among them.

    Logged every epoch (``effi/infobatch/...``): ``threshold``, ``well_learned_frac``, ``kept_well_learned``,
    ``pruned_fraction_epoch``, ``saved_samples_epoch``, ``saved_samples_total``, ``saved_fraction``,
    ``padded_samples_epoch``. Summary (``result.json``): ``infobatch/saved_samples``, ``infobatch/saved_fraction``,
    ``infobatch/padded_samples``, ``infobatch/prune_epochs`` (``saved_samples`` counts the samples the plans pruned,
    under ``limit_train_batches`` those a full epoch would have trained under the limit less the pruned one's;
    with the loader's ``drop_last`` the samples trained differ from a full epoch's by that count plus or minus the
    dropped partial batches, which the ``EfficiencyMonitor``'s baseline counts exactly). With the curriculum:
    ``threshold``, ``well_learned_frac``, ``pruned_fraction_epoch`` (dropped / drawn), ``saved_samples_epoch``,
    ``drawn_samples_epoch``, ``unpruned_tail_batches_epoch``, ``saved_samples_total``, ``saved_fraction`` (dropped /
    drawn, summed over ranks); summary ``infobatch/saved_samples``, ``infobatch/saved_fraction``,
    ``infobatch/drawn_samples``, ``infobatch/unpruned_tail_batches``, ``infobatch/thin_stop_step``. Both modes:
    ``effi/nonfinite_losses`` every epoch with ``nonfinite_loss="warn"``, and the summary's
    ``infobatch/nonfinite_losses`` (the run's non-finite training losses, counted by the Trainer's first guarded
    callback).

    Attributes:
        requirements: what InfoBatch needs and changes (it owns the training sampler and shortens epochs; any batch
            structure, no ``per_sample_loss`` needed from a module that returns a plain cross-entropy loss), read by
            :func:`~lightning_effi.core.requirements.check_trainer`.

    Raises:
        ValueError: (construction) ``prune_ratio``, ``delta``, ``num_epochs``, ``seed``, ``momentum`` invalid or out of
            range, ``per_sample_loss`` not callable, ``nonfinite_loss`` not ``"raise"`` or ``"warn"``; (``setup``)
            ``max_epochs=-1`` without ``num_epochs``, or with it and neither ``max_time`` nor an ``EarlyStopping``
            callback (nothing would end the fit), ``num_epochs > max_epochs``, a run capped by ``max_steps``,
            ``reload_dataloaders_every_n_epochs > 1``, a DataModule that is not an ``InfoBatchDataModule``, an
            unsupported strategy (DeepSpeed, model-parallel; resuming under FSDP),
            ``per_sample_loss=fn`` with manual optimization, an int ``val_check_interval`` above the fewest batches an
            epoch can have (:func:`~lightning_effi.infobatch.functional.fewest_epoch_batches`); with the curriculum:
            ``num_epochs`` set, or ``prune_ratio > 1 - 1/micro_batch_size`` (a micro-batch could be emptied); (a batch)
            metadata without ``"index"`` (with the curriculum: without
            ``"infobatch_weight"``/``"infobatch_candidates"``), a ``training_step`` output without a loss, a per-sample
            loss that is not ``float[B]`` with grad (a ``grad_fn``), ``per_sample_loss=fn`` together with a returned
            ``"per_sample_loss"``, an automatic per-sample loss that cannot be computed or does not reproduce the step's
            loss, a manual-optimization step that does not call :func:`weighted_loss` once; (``setup``) a
            ``training_step`` wrapped by another InfoBatch callback whose fit is still running (another Trainer's, on
            the same module, or a second InfoBatch callback in this Trainer); (resuming a ``fit``) a checkpoint state
            field missing, of the wrong type or size, or out of range (:func:`validate_state`).
        NonFiniteLossError: (a batch, ``nonfinite_loss="raise"``) the training loss is NaN or infinite.
        IncompatibleTechniques: (``setup``) another technique callback in the Trainer that also owns the training
            sampler and cannot host this one's thinning, see :data:`~lightning_effi.core.requirements.CONFLICTS`;
            (``on_train_start``, alone) a step-interval ``OneCycleLR`` (``requirements.refused_features``: its fixed
            ``total_steps`` cannot match the pruned run; use :func:`lightning_effi.core.lr_schedules.one_cycle` with
            ``progress=callback.effi_progress``).
    """

    requirements = Requirements(
        owns_train_sampler=True,
        thins_within_sampler=True,
        changes_epoch_length=True,
        batch_structures=BATCH_STRUCTURES,
        refused_strategies=("DeepSpeedStrategy", "ModelParallelStrategy"),
        strategy_note=(
            "DeepSpeed's engine and model-parallel wrappers are not validated with InfoBatch's sampler and loss "
            "weights; use a single device, strategy='ddp', 'ddp_spawn' or 'fsdp' (FSDP: fresh fits only)."
        ),
        refused_features=(
            (
                "one_cycle_lr",
                "OneCycleLR counts a fixed total_steps, but alone InfoBatch prunes epochs by the scores, so the "
                "run's optimizer steps are known only at its end: sized with trainer.estimated_stepping_batches "
                "(full epochs) the cycle never finishes its annealing, sized with expected_total_steps() (an "
                "estimate) the run can take more steps and OneCycleLR raises 'Tried to step'. Use the one-cycle "
                "schedule on InfoBatch's progress: lightning_effi.core.lr_schedules.one_cycle(optimizer, "
                "total_steps, progress=callback.effi_progress) (ends exactly at the run's end), or step the "
                "scheduler every epoch (interval='epoch', total_steps=max_epochs)",
            ),
            (
                "overfit_batches",
                "overfit_batches trains the dataset's first batches, in order, every epoch (Lightning puts a "
                "SequentialSampler into the training loader), while InfoBatch chooses each epoch's samples from "
                "their losses (it prunes well-learned ones): Lightning's sampler would replace InfoBatch's plan and "
                "nothing would be pruned. Check that the model overfits without InfoBatch, then train with it",
            ),
            (
                "batch_size_finder",
                "the finder resets Lightning's epoch to 0 between its trials without rebuilding the training loader, "
                "whose InfoBatch plan belongs to the epoch it was built for, so a trial runs a stale plan. InfoBatch "
                "changes neither the batches' shape nor the model, so the size found without it is the one to use: "
                "run Tuner(trainer).scale_batch_size on the unwrapped DataModule in a Trainer without InfoBatch, "
                "then fit with InfoBatch at that batch size",
            ),
        ),
    )

    def __init__(
        self,
        prune_ratio: float = 0.5,
        delta: float = 0.875,
        num_epochs: int | None = None,
        seed: int = 0,
        momentum: float = 1.0,
        strict: bool = True,
        per_sample_loss: Callable[..., Any] | None = None,
        nonfinite_loss: str = "raise",
    ) -> None:
        given = given_settings(locals())  # first: the arguments as given (lightning_effi.core.settings)
        try:
            ib.validate_hparams(prune_ratio, delta, num_epochs)
        except (ValueError, TypeError) as err:
            raise type(err)(f"InfoBatchCallback.{err}") from None
        if per_sample_loss is not None and not callable(per_sample_loss):
            raise ValueError(
                "InfoBatchCallback: per_sample_loss must be a function fn(outputs, batch) -> float[B] or None, got "
                f"{type(per_sample_loss).__name__}"
            )
        self.per_sample_loss = per_sample_loss
        self.prune_ratio = float(prune_ratio)
        self.delta = float(delta)
        self.num_epochs = int(num_epochs) if num_epochs is not None else None
        self.seed = check_int("InfoBatchCallback", "seed", seed, minimum=0, maximum=2**64 - 1)
        self.momentum = check_real("InfoBatchCallback", "momentum", momentum, 0, 1, low_open=True)
        self.strict = check_bool(type(self).__name__, "strict", strict)
        #: the non-finite loss policy (lightning_effi.core.nonfinite) and its count, checkpointed as "nonfinite_loss"
        self.nonfinite_guard = NonFiniteLossGuard(type(self).__name__, nonfinite_loss)
        self.epochs: int = 0  # resolved E
        self.dataset_size: int = 0
        self.score = self.seen = self.sum_loss = self.count = torch.empty(0)
        #: float64 [N], each sample's real tokens when it last trained (-1: not yet), and the rank-local [2, N]
        #: sums and counts since the last merge: the baseline of samples of unequal length (effi_baseline)
        self.sample_tokens = self.pending_tokens = torch.empty(0, dtype=torch.float64)
        self._token_ratio: tuple[int, float | None] | None = None  # (plan epoch, token_ratio) cached for the epoch
        self.plan: ib.EpochPlan | None = None
        self.steps_in_epoch = 0
        #: the samples this rank trained in the plan's epoch (micro-batches whose step did not return None); None
        #: from a checkpoint written before it was kept (the share is then read from the optimizer steps)
        self.samples_in_epoch: int | None = 0
        self.steps_per_epoch = 1
        self.history: list[dict[str, Any]] = []
        # composed with the curriculum (attached in setup): the wrapper whose sampler this callback thins
        self.curriculum_dm: CurriculumDataModule | None = None
        self.micro_batch_size = 0
        self.table_epoch = -1  # the Lightning epoch whose start the score table stands for (its losses are pending)
        self.synced_epoch = -1  # the last epoch whose losses were merged into the table
        self.thin_stats = torch.zeros(3, dtype=torch.int64)  # rank-local since the last merge: drawn, dropped, capped
        self._mask: Tensor | None = None  # bool[N], the well-learned set of epoch _mask_epoch (recomputed, not saved)
        self._mask_epoch = -1
        self._stop_step: int | None = None
        self._checkpoint_step: int | None = None  # the global step of a checkpoint being restored
        self._train_epochs: int | None = None  # the run's max_epochs at setup (None: bounded by max_steps)
        self._run_steps: int | None = None  # composed mode: T, the run's optimizer steps (see thin_stop)
        self._original_step: Any = None
        self._previous_step: Any = None  # an instance-level training_step of the module's own, put back at the end
        self._module: pl.LightningModule | None = None  # the module whose training_step is wrapped
        self._running: Callable[[Any], bool] | None = None  # live_fit of the fit in progress
        self._reload_before: int | None = None  # the Trainer's reload_dataloaders_every_n_epochs before setup
        self._trainer: pl.Trainer | None = None
        self._ended_run: tuple[int | float, int] | None = None  # the last fit's (limit_train_batches, world_size)
        self._batch_stepped = False  # under manual optimization: this batch already counted a step
        self._datamodule: InfoBatchDataModule | None = None
        self._last_thin: tuple[int, int] | None = None  # composed mode: (candidates, kept) of the latest micro-batch
        #: where the run's per-sample losses come from ("fn", "returned", "auto"; "manual"), decided at the first batch
        self.per_sample_source: str | None = None
        self._shift: bool | None = None  # automatic path: the causal shift detected at the first batch
        # automatic path: the loss's reduction (the labelled-token mean or the samples' means), detected at the first
        # batch that tells them apart
        self._token_mean: bool | None = None
        self._step: _Step | None = None  # the batch being trained (set by the training_step wrapper)
        self._evaluating = False  # the checkpoint being restored is for validate / test / predict (state ignored)
        self._checkpoint_epoch: int | None = None  # the Lightning epoch of the checkpoint being restored (fit)
        self._resumed = False  # this fit restored InfoBatch state from a checkpoint (load_state_dict)
        # a given per-sample loss whose mean differed from the step's loss was warned of (checked at every batch
        # until then: a term outside the per-sample losses may be 0 at first, e.g. a penalty on the distance to the
        # initial weights, or warmed up later)
        self._loss_mismatch_warned = False
        self._negative_warned = False  # negative per-sample losses warned once (their sign may not be the fit)
        self._mixed_warned = False  # the class-probability targets warning (once per callback)
        keep_settings(self, InfoBatchCallback, given)

    def __repr__(self) -> str:
        fn = self.per_sample_loss
        return (
            f"InfoBatchCallback(prune_ratio={self.prune_ratio!r}, delta={self.delta!r}, "
            f"num_epochs={self.num_epochs!r}, seed={self.seed!r}, momentum={self.momentum!r}, "
            f"strict={self.strict!r}, per_sample_loss={getattr(fn, '__qualname__', fn)!s}, "
            f"nonfinite_loss={self.nonfinite_guard.policy!r})"
        )

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(prune_ratio=self.prune_ratio, delta=self.delta, seed=self.seed)

    # ----------------------------------------------------------------------------------------------- setup
    def wrap_datamodule(self, datamodule: pl.LightningDataModule) -> pl.LightningDataModule:
        """``InfoBatchDataModule(datamodule)`` unless ``datamodule`` or a DataModule it wraps is one already (used by
        the Hydra app; with the curriculum, either nesting trains identically)."""
        return datamodule if find_wrapper(datamodule, InfoBatchDataModule) else InfoBatchDataModule(datamodule)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        reserve_hook_ids(pl_module)  # hooks of its own ids (lightning_effi.core.hook_ids: a spawned rank's module)
        if stage == "fit":  # settings set on the callback since it was built (lightning_effi.core.settings)
            apply_changed_settings(self, trainer)
        if stage != "fit":
            return
        check_trainer(trainer)
        self._resumed = False  # set by load_state_dict when this fit restores InfoBatch's state
        if self.per_sample_loss is not None and not pl_module.automatic_optimization:
            raise ValueError(
                "InfoBatchCallback: per_sample_loss=fn does not apply with manual optimization (the step "
                "backpropagates its own loss); leave it None and compute the loss as "
                "lightning_effi.infobatch.weighted_loss(self, per_sample) in training_step"
            )
        self._clear_leftovers(trainer, pl_module)
        self._running = live_fit(trainer)
        self._show_clock()  # a provider of progress again (composed mode hides it)
        curriculum = find_wrapper(trainer.datamodule, CurriculumDataModule)
        if curriculum is not None:
            self._setup_within_curriculum(trainer, pl_module, curriculum)
            return
        self.curriculum_dm = None
        from lightning_effi.curriculum.callback import Curriculum  # the curriculum imports none of InfoBatch's modules

        if any(isinstance(c, Curriculum) for c in trainer.callbacks):  # type: ignore[attr-defined]
            # listed before the curriculum, InfoBatch gave its own advice for a standalone run (max_epochs, where the
            # stack's step budget is right) where the curriculum's wrapper was missing (qa83-compat 02)
            got = trainer.datamodule
            raise ValueError(
                "InfoBatchCallback: the Trainer has a Curriculum, inside whose pipeline InfoBatch thins: fit with "
                "datamodule=CurriculumDataModule(your_datamodule) (InfoBatchDataModule around it is optional); got "
                f"{type(got).__name__ if got is not None else 'no datamodule'}"
            )
        epochs = self.num_epochs if self.num_epochs is not None else trainer.max_epochs
        if epochs is None or epochs < 1:
            raise ValueError(
                "InfoBatchCallback needs a finite number of epochs: set Trainer(max_epochs=...) or "
                f"InfoBatchCallback(num_epochs=...); got max_epochs={trainer.max_epochs}"
                + (
                    f" (and leave max_steps=-1: a step budget, max_steps={trainer.max_steps}, is refused too, as it "
                    "hides InfoBatch's saving)"
                    if trainer.max_steps not in (-1, None)
                    else ""
                )
            )
        if trainer.max_steps not in (-1, None) and not trainer.fast_dev_run:  # fast_dev_run sets max_steps itself
            raise ValueError(
                f"InfoBatchCallback: the run is capped by trainer.max_steps={trainer.max_steps}; InfoBatch saves "
                "compute by shortening epochs, so a step budget hides the saving (and the annealing point may never "
                "come). Use max_epochs and leave max_steps=-1"
            )
        if self.num_epochs is not None and trainer.max_epochs in (None, -1) and not _ends_itself(trainer):
            # the card's "num_epochs with max_epochs=-1": the fit went on over the full data for ever (qa75-infobatch
            # 02)
            raise ValueError(
                f"InfoBatchCallback: num_epochs={epochs} with Trainer(max_epochs={trainer.max_epochs}): nothing ends "
                f"the fit, which trains on the full data after InfoBatch's {epochs} epochs until it is stopped; set "
                f"Trainer(max_epochs={epochs}) (num_epochs may then be left None), or end the run with "
                "Trainer(max_time=...) or an EarlyStopping callback"
            )
        if self.num_epochs is not None and (trainer.max_epochs in (None, -1) or trainer.max_epochs > epochs):
            default = (
                " (1000 is Lightning's default when max_epochs is not set: set Trainer(max_epochs="
                f"{epochs}) for a run of InfoBatch's epochs)"
                if trainer.max_epochs == 1000
                else ""
            )
            # the epochs after the schedule: at an LR schedule's final value (0 for a cosine to 0, qa76-break 03, 06)
            limit = (
                f"< max_epochs={trainer.max_epochs}{default}"
                if trainer.max_epochs not in (None, -1)
                else f"with max_epochs={trainer.max_epochs} (no epoch limit)"
            )
            rank_zero_warn(
                f"InfoBatchCallback: num_epochs={epochs} {limit}: the epochs after "
                f"InfoBatch's {epochs} train on the full data, and the schedules that follow InfoBatch's progress (an "
                "LR schedule given `progress`, random-LTD's growth, the V-cycle's stages) have ended there: an LR "
                "schedule stays at its final value"
            )
        if self.num_epochs is not None and trainer.max_epochs not in (None, -1) and trainer.max_epochs < epochs:
            raise ValueError(
                f"InfoBatchCallback: num_epochs={epochs} > max_epochs={trainer.max_epochs}: the run would end before "
                "InfoBatch's schedule does (its annealing epochs, and the progress that LR schedules, the V-cycle's "
                "stages and random-LTD's growth follow would never reach the end); set num_epochs <= max_epochs or "
                "leave it None (= max_epochs)"
            )
        reload = trainer.reload_dataloaders_every_n_epochs
        if reload > 1:
            raise ValueError(
                f"InfoBatchCallback needs the training loader rebuilt every epoch; "
                f"reload_dataloaders_every_n_epochs={reload} is not supported (use 0 or 1)"
            )
        datamodule = trainer.datamodule
        if not isinstance(datamodule, InfoBatchDataModule):
            raise ValueError(
                "InfoBatchCallback needs trainer.fit(..., datamodule=InfoBatchDataModule(your_datamodule)); got "
                + (
                    type(datamodule).__name__
                    if datamodule is not None
                    else "no datamodule (with datasets only: InfoBatchDataModule(LightningDataModule.from_datasets("
                    "train_dataset=..., val_dataset=..., batch_size=...)))"
                )
            )
        if reload == 0:
            rank_zero_info("InfoBatchCallback: setting trainer.reload_dataloaders_every_n_epochs = 1")
        self._trainer, self._reload_before = trainer, reload  # put back at the end of the fit
        trainer.reload_dataloaders_every_n_epochs = 1
        datamodule.planner = self
        self._datamodule = datamodule
        n = len(datamodule.train_dataset)
        if n < 1:
            raise ValueError("InfoBatchCallback: the training set is empty")
        self.epochs, self.dataset_size = int(epochs), n
        # the run's training epochs, read before StochasticWeightAveraging adds its forward-only one (on_fit_start)
        self._train_epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        self._warn_no_prune_epoch(trainer)
        self._new_tables(n)
        self._check_val_check_interval(trainer, datamodule)
        self._check_empty_epochs(trainer, datamodule)
        self._warn_fixed_epoch_length(trainer, datamodule)
        self._warn_single_sample_batches(pl_module, datamodule)
        self._reset_run_state()
        self._trainer = trainer
        self._wrap_training_step(pl_module)

    def _warn_single_sample_batches(self, pl_module: pl.LightningModule, datamodule: InfoBatchDataModule) -> None:
        """Warn when the module has ``BatchNorm1d`` layers and the training loader keeps partial batches: a pruned
        epoch's size varies, so its last batch can hold a single sample (your loader's may never), on which
        ``BatchNorm1d`` over ``[B, C]`` features raises in training. ``drop_last=True`` (kept by the rebuilt loader)
        avoids it."""
        t = datamodule.template()
        if bool(t["drop_last"]) or int(t["batch_size"]) < 2 or self.prune_ratio == 0:
            return
        norms = [n for n, m in pl_module.named_modules() if isinstance(m, nn.BatchNorm1d)]
        if norms:
            rank_zero_warn(
                f"InfoBatchCallback: {type(pl_module).__name__} has BatchNorm1d layers ({', '.join(norms[:3])}) and "
                "the training loader keeps partial batches (drop_last=False): a pruned epoch's size varies, so its "
                "last batch can hold a single sample, on which BatchNorm1d over [B, C] features raises 'Expected more "
                "than 1 value per channel when training'. If your model cannot train on one sample, set "
                "drop_last=True on your training loader (InfoBatch keeps it)"
            )

    def _warn_no_prune_epoch(self, trainer: pl.Trainer) -> None:
        """Warn when the run prunes nothing: ``prune_ratio=0``, or a schedule without a pruning epoch: epochs
        ``1 .. floor(delta·E) - 1`` prune (epoch 0 has no
        scores yet, the annealing epochs from ``floor(delta·E)`` train on the full data), so with
        ``floor(delta·E) <= 1`` the run trains every sample of every epoch and InfoBatch saves nothing (not under
        ``fast_dev_run``, whose single epoch is a smoke test)."""
        if self.prune_ratio == 0 and not trainer.fast_dev_run:
            rank_zero_warn(
                "InfoBatchCallback: prune_ratio=0 prunes nothing: every epoch trains every sample at weight 1, as "
                "without InfoBatch (a control run: the monitor reads no saving); the paper's setting is "
                "prune_ratio=0.5"
            )
            return
        stop = ib.epoch_stop(self.epochs, self.delta)
        if stop > 1 or self.prune_ratio == 0 or trainer.fast_dev_run:
            return
        fewest = next(e for e in itertools.count(self.epochs + 1) if ib.epoch_stop(e, self.delta) > 1)
        rank_zero_warn(
            f"InfoBatchCallback: no epoch of this run prunes: with {self.epochs} epoch(s) and delta={self.delta}, "
            f"annealing (full data) starts at epoch floor(delta * epochs) = {stop}, and epoch 0 trains on the full "
            f"data to score every sample, so InfoBatch saves nothing; train at least {fewest} epochs at this delta "
            "(the paper's runs: 200 epochs, delta=0.875)"
        )

    def _check_val_check_interval(self, trainer: pl.Trainer, datamodule: InfoBatchDataModule) -> None:
        """Refuse ``Trainer(val_check_interval=<int>)`` above the fewest training batches an epoch of this run can
        have (:func:`~lightning_effi.infobatch.functional.fewest_epoch_batches`): Lightning requires it to be at most
        each epoch's batches (when ``check_val_every_n_epoch`` is set and validation runs) and would stop the run at
        the first pruned epoch that is shorter."""
        interval = trainer.val_check_interval
        if (
            not isinstance(interval, int)
            or isinstance(interval, bool)
            or trainer.check_val_every_n_epoch is None
            or not trainer.limit_val_batches > 0
        ):
            return
        t = datamodule.template()
        args = (int(t["batch_size"]), trainer.world_size, bool(t["drop_last"]), trainer.limit_train_batches)
        fewest = ib.fewest_epoch_batches(self.dataset_size, self.epochs, self.prune_ratio, self.delta, *args)
        if interval > max(1, fewest):
            full = ib.rank_batches(self.dataset_size, *args)
            raise ValueError(
                f"InfoBatchCallback: Trainer(val_check_interval={interval}) counts training batches within an epoch, "
                f"but InfoBatch's epochs can have as few as {fewest} batches per rank (prune_ratio="
                f"{self.prune_ratio}, {self.dataset_size} samples, batch size {args[0]}; a full epoch has {full}), "
                "and Lightning raises at the first epoch shorter than val_check_interval; use "
                "val_check_interval=<float> (a fraction of each epoch), check_val_every_n_epoch=<int> with the "
                f"default val_check_interval, or val_check_interval <= {max(1, fewest)} (or "
                "check_val_every_n_epoch=None to count batches across epochs)"
            )

    def _warn_fixed_epoch_length(self, trainer: pl.Trainer, datamodule: InfoBatchDataModule) -> None:
        """Warn when an int ``Trainer(limit_train_batches=...)`` cuts a full epoch: every epoch longer than the limit
        trains the limit's batches, a pruned one as many samples as a full one (nothing saved), and its kept
        well-learned samples still carry their ``1 / (1 - prune_ratio)`` weight, so such an epoch's expected gradient
        is about ``N / |S_e|`` times the plain limited epoch's (1.33x on 100 rows at prune_ratio 0.5, in silence,
        qa113-tabular 06). A fraction scales every epoch alike and keeps both."""
        limit = trainer.limit_train_batches
        if isinstance(limit, float) or trainer.fast_dev_run:
            return
        t = datamodule.template()
        full = ib.rank_batches(self.dataset_size, int(t["batch_size"]), trainer.world_size, bool(t["drop_last"]))
        if limit >= full:
            return
        rank_zero_warn(
            f"InfoBatchCallback: Trainer(limit_train_batches={limit}) trains at most {limit} batches an epoch, fewer "
            f"than a full epoch's {full}: a pruned epoch longer than that trains as many samples as a full one "
            f"(nothing saved) and its first {limit} batches keep InfoBatch's rescaled weights (1 / (1 - prune_ratio) "
            f"= {1 / (1 - self.prune_ratio):.3g} on the kept well-learned samples), so its gradient is up to "
            "N / |kept| times the plain run's. Use a fraction (e.g. limit_train_batches=0.25) to train the same "
            "share of every epoch, which keeps both the saving and the expected gradient"
        )

    def _check_empty_epochs(self, trainer: pl.Trainer, datamodule: InfoBatchDataModule) -> None:
        """Refuse a run whose pruned epochs can have no training batch (:func:`~lightning_effi.infobatch.functional.
        fewest_epoch_batches` is 0) while a full epoch has some: the loader's ``drop_last`` with a pruned epoch smaller
        than a batch (Lightning then ends the whole fit, annealing epochs included, with an info line), or a float
        ``Trainer(limit_train_batches=...)`` that leaves less than one batch of it (Lightning raises mid-run)."""
        t = datamodule.template()
        limit = trainer.limit_train_batches
        args = (int(t["batch_size"]), trainer.world_size, bool(t["drop_last"]), limit)
        full = ib.rank_batches(self.dataset_size, *args)
        fewest = ib.fewest_epoch_batches(self.dataset_size, self.epochs, self.prune_ratio, self.delta, *args)
        if fewest > 0 or full == 0:
            return
        size = min(
            ib.min_epoch_size(e, self.epochs, self.dataset_size, self.prune_ratio, self.delta)
            for e in range(self.epochs)
        )
        unlimited = ib.rank_batches(size, *args[:3])
        if unlimited == 0:
            world = f" per rank ({trainer.world_size} ranks)" if trainer.world_size > 1 else ""
            raise ValueError(
                f"InfoBatchCallback: a pruned epoch can visit as few as {size} of the {self.dataset_size} samples "
                f"(prune_ratio={self.prune_ratio}), fewer than one batch of {args[0]}{world} with the loader's "
                "drop_last=True: that epoch would have no training batch, and Lightning ends the whole fit there "
                "(the annealing epochs on the full data never run); use drop_last=False, a batch size of at most "
                f"{max(1, size // trainer.world_size)}, or a lower prune_ratio"
            )
        batches = f"{unlimited} batch{'es' if unlimited > 1 else ''}"
        raise ValueError(
            f"InfoBatchCallback: Trainer(limit_train_batches={limit}) keeps int({unlimited} * {limit}) = 0 batches of "
            f"a pruned epoch, which can have as few as {batches} (prune_ratio={self.prune_ratio}, "
            f"{self.dataset_size} samples, batch size {args[0]}; a full epoch has {full} after the limit), and "
            f"Lightning raises at that epoch; use limit_train_batches=<int> (a number of batches), or a fraction of "
            f"at least {1 / unlimited:.3g}"
        )

    def _new_tables(self, n: int) -> None:
        self.score = torch.zeros(n, dtype=torch.float32)
        self.seen = torch.zeros(n, dtype=torch.bool)
        self.sum_loss = torch.zeros(n, dtype=torch.float32)
        self.count = torch.zeros(n, dtype=torch.int32)
        self.sample_tokens = torch.full((n,), -1.0, dtype=torch.float64)
        self.pending_tokens = torch.zeros(2, n, dtype=torch.float64)
        self._token_ratio = None

    def _reset_run_state(self) -> None:
        self.plan, self.history, self.steps_in_epoch, self.samples_in_epoch = None, [], 0, 0
        self.nonfinite_guard.count, self.nonfinite_guard.first_step = 0, None
        self.steps_per_epoch, self._last_thin = 1, None
        self.table_epoch, self.synced_epoch = -1, -1
        self.thin_stats = torch.zeros(3, dtype=torch.int64)
        self._mask, self._mask_epoch, self._stop_step, self._run_steps = None, -1, None, None
        self.per_sample_source, self._shift, self._step = None, None, None
        self._token_mean = None
        self._loss_mismatch_warned = False

    def _setup_within_curriculum(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, curriculum: CurriculumDataModule
    ) -> None:
        """Composed mode: attach as the curriculum's thinner (and as the planner of an ``InfoBatchDataModule`` in the
        chain, which then delegates its loader to the curriculum). Independent of the callbacks' order: only the
        user's loader is read here; the curriculum's controller is needed from the first batch on."""
        if self.num_epochs is not None:
            raise ValueError(
                f"InfoBatchCallback: num_epochs={self.num_epochs} is not used with the curriculum: the curriculum "
                "draws every batch and InfoBatch anneals after curriculum step floor(delta * T) (T: the run's "
                "optimizer steps); leave num_epochs=None"
            )
        template = curriculum.template()
        try:
            ib.check_thinning_ratio(self.prune_ratio, template["batch_size"])
        except ValueError as err:
            raise ValueError(f"InfoBatchCallback with the curriculum: {err}") from None
        n = int(template["length"])
        if n < 1:
            raise ValueError("InfoBatchCallback: the training set is empty")
        outer = find_wrapper(trainer.datamodule, InfoBatchDataModule)
        if outer is not None:
            outer.planner = self
        curriculum.thinner = self
        self.curriculum_dm = curriculum
        self.micro_batch_size = int(template["batch_size"])
        self.epochs, self.dataset_size = 0, n
        self._new_tables(n)
        self._reset_run_state()
        self._trainer = trainer
        self._datamodule = None
        self._hide_clock()  # the run's steps are the curriculum's: no progress, no clock
        self._wrap_training_step(pl_module)

    def _hide_clock(self) -> None:
        """Composed mode: shadow ``effi_progress`` with None on the instance, so that
        :func:`~lightning_effi.core.progress.progress_source` and :func:`~lightning_effi.core.progress.progress_clock`
        (which needs all three hooks) do not take this callback for a progress source or the run's clock."""
        self.effi_progress = None  # type: ignore[assignment]

    def _show_clock(self) -> None:
        self.__dict__.pop("effi_progress", None)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """The fit raised (any exception, ``KeyboardInterrupt`` included; Lightning skips ``teardown`` then): undo what
        ``setup`` did, as ``teardown`` does (:meth:`_release`), so a later fit of the module, with or without
        InfoBatch, runs as on a module that never met it. Never raises (a failure is a warning: the fit's own
        exception is the one that propagates). BatchNorm's error on a batch of one sample gets a note naming the
        cause (a pruned epoch's last batch) and the remedy."""
        if isinstance(exception, ValueError) and "Expected more than 1 value per channel" in str(exception):
            exception.add_note(
                "InfoBatchCallback: a pruned epoch's size varies, so its last batch can hold a single sample; set "
                "drop_last=True on your training loader (InfoBatch keeps it)"
            )
        elif isinstance(exception, AssertionError) and "batch size should be even" in str(exception).lower():
            exception.add_note(  # timm's Mixup / CutMix
                "InfoBatchCallback: a pruned epoch's size varies, so its last batch can hold any number of samples "
                "(an odd one too); set drop_last=True on your training loader (InfoBatch keeps it)"
            )
        try:
            self._release()
        except Exception as err:  # noqa: BLE001 - on_exception must not replace the fit's exception
            rank_zero_warn(f"InfoBatchCallback: could not undo its changes after the fit raised ({err!r})")

    def _release(self) -> None:
        """The end of a fit, normal or not: the module's ``training_step`` back to what it was (the class's method, or
        the module's own instance-level one), this callback detached from the DataModules it planned or thinned
        for, the Trainer's ``reload_dataloaders_every_n_epochs`` back to its value before ``setup``, the progress
        clock shown again. The score tables, history and counters stay readable. Idempotent."""
        module = self._module
        if module is not None and getattr(module.__dict__.get("training_step"), "_infobatch_owner", None) is self:
            if self._previous_step is not None:
                module.training_step = self._previous_step  # type: ignore[method-assign]
            else:
                del module.training_step  # back to the class's method
        if self.curriculum_dm is not None and self.curriculum_dm.thinner is self:
            self.curriculum_dm.thinner = None
        trainer = self._trainer
        for dm in wrapper_chain(trainer.datamodule if trainer is not None else self._datamodule):
            if isinstance(dm, InfoBatchDataModule) and dm.planner is self:
                dm.planner = None
        if trainer is not None and self._reload_before is not None:
            trainer.reload_dataloaders_every_n_epochs = self._reload_before
        self._show_clock()
        self._original_step = self._previous_step = self._module = self._reload_before = None
        if trainer is not None:  # effi_summary() read after the fit keeps its figures (qa57-loops 05)
            self._ended_run = (trainer.limit_train_batches, trainer.world_size)
        self._trainer, self._step = None, None

    def _clear_leftovers(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before wrapping: undo what an earlier InfoBatch fit left on this module (its wrapped ``training_step``, its
        DataModules and Trainer settings) when that fit is over but never undid it (its ``teardown`` and
        ``on_exception`` did not run, e.g. an earlier callback's ``on_exception`` raised), with a warning.

        Raises:
            ValueError: the ``training_step`` is wrapped by another InfoBatch callback whose fit is still running
                (another Trainer's fit on the same module), or by another InfoBatch callback of this Trainer.
        """
        if self._module is not None and self._module is not pl_module:
            self._release()  # this callback's earlier fit, on another module, did not end: let it go
        owner = getattr(pl_module.__dict__.get("training_step"), "_infobatch_owner", None)
        if owner is None:
            return
        if owner is not self and owner in trainer.callbacks:
            raise ValueError(
                "InfoBatchCallback: two InfoBatch callbacks in one Trainer wrap this module's training_step; keep one"
            )
        if owner is not self and owner._running is not None and owner._running(trainer):
            raise ValueError(
                "InfoBatchCallback: this module's training_step is wrapped by another InfoBatchCallback whose fit is "
                "still running (another Trainer's fit on the same module); a module is trained by one fit at a time: "
                "wait until that fit ends or train a copy of the module (copy.deepcopy before either fit)"
            )
        owner._release()
        rank_zero_warn(
            "InfoBatchCallback: this module's training_step was still wrapped by an earlier InfoBatch fit that did "
            "not end (interrupted before its on_exception ran?); put back the module's own training_step (and "
            "detached that fit's DataModules) before wrapping it again"
        )

    def _wrap_training_step(self, pl_module: pl.LightningModule) -> None:
        previous = pl_module.__dict__.get("training_step")
        if getattr(previous, "_infobatch_owner", None) is not None:  # _clear_leftovers let a live one through
            raise ValueError("InfoBatchCallback: training_step is already wrapped by another InfoBatchCallback")
        original = pl_module.training_step
        if is_param_in_hook_signature(original, "dataloader_iter", explicit=True):
            # Lightning hands such a step the loader's iterator (through the wrapper's __wrapped__): InfoBatch reads
            # each batch's sample index and weights the step's losses, which a step fetching its own batches hides
            # (it failed at the first batch, asking for the InfoBatchDataModule it had: qa84-break 02)
            raise ValueError(
                "InfoBatchCallback: training_step(self, dataloader_iter) fetches its own batches; InfoBatch weights "
                "the losses of the batch Lightning hands the step: take training_step(self, batch, batch_idx)"
            )
        self._original_step, self._previous_step, self._module = original, previous, pl_module

        def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            trainer = self._trainer
            if trainer is None or not trainer.training:
                # the step called outside Lightning's training step: a validation_step (or a sanity check) reusing it
                # takes the module's own step, untouched (its losses became the last training batch's samples'
                # scores, or it failed asking for the InfoBatchDataModule the run had, qa86-break 10)
                return original(batch, *args, **kwargs)
            self._step = self._current_step()
            self._step.rows = find_batch_size(batch)
            if self.curriculum_dm is None:
                self._note_tokens(batch, self._step.index)
            try:
                if not pl_module.automatic_optimization:
                    return self._manual_step(original, batch, *args, **kwargs)
                capture = self.per_sample_loss is not None or self.per_sample_source in (None, "auto")
                optimized = optimized_parameters(trainer) if capture and trainer is not None else None
                with ForwardCapture(pl_module, optimized) if capture else nullcontext() as forward:
                    output = original(batch, *args, **kwargs)
                if output is None:  # the step skipped the batch (Lightning's automatic optimization allows it)
                    return None
                self._count_trained(self._step)
                output = self._with_per_sample_loss(output, batch, forward)
                return self._weigh(output, self._step)
            finally:
                self._step = None

        training_step._infobatch_owner = self  # type: ignore[attr-defined]
        # Lightning reads a step's signature (through __wrapped__) to pass batch_idx only to a step that takes it: read
        # as (batch, *args) it passed batch_idx to a `def training_step(self, batch)` (a TypeError, qa83-compat 04)
        training_step.__wrapped__ = original  # type: ignore[attr-defined]
        pl_module.training_step = training_step  # type: ignore[method-assign]

    def _note_tokens(self, batch: Any, index: Tensor) -> None:
        """Record each sample's real tokens (:func:`~lightning_effi.core.measure.row_tokens`, as the
        EfficiencyMonitor reads the batch) for :meth:`effi_baseline`; nothing for a batch without tokens (images) or
        one whose rows do not match its index."""
        tokens = row_tokens(batch)
        if tokens is not None and tuple(tokens.shape) == tuple(index.shape):
            ib.record_tokens(self.pending_tokens, index.cpu(), tokens)

    def _current_step(self) -> _Step:
        """The batch's sample index (and, with the curriculum, its thinning) from the batch metadata."""
        meta = batch_meta(self._trainer) or {}
        if self.curriculum_dm is not None:
            if any(k not in meta for k in THINNED_KEYS):
                raise ValueError(
                    f"InfoBatchCallback: with the curriculum, the training batch must carry {list(THINNED_KEYS)} "
                    "(added by the CurriculumDataModule's loader with InfoBatch attached); got "
                    f"{sorted(meta)}"
                )
            index, weights, candidates = (meta[k] for k in THINNED_KEYS)
            return _Step(index, weights, int(candidates))
        if "index" not in meta:
            raise ValueError(
                "InfoBatchCallback: the training batch carries no sample index; train with "
                "datamodule=InfoBatchDataModule(...)"
            )
        return _Step(meta["index"])

    def _manual_step(self, original: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Manual optimization: the step weights its own loss with :meth:`weighted_loss` (checked before its
        backward, :meth:`on_before_backward`, and after it)."""
        self.per_sample_source = "manual"
        output = original(batch, *args, **kwargs)
        assert self._step is not None
        if not self._step.weighted:
            raise ValueError(
                f"InfoBatchCallback: {MANUAL}; this step did not call it (no score recorded for its samples)"
            )
        self._count_trained(self._step)  # under manual optimization a None return is the norm: the batch trained
        return output

    def _count_trained(self, step: _Step) -> None:
        """Count the samples of a batch its step trained (:attr:`samples_in_epoch`: the epoch's share trained, as
        the EfficiencyMonitor counts the samples, leaving out a batch whose ``training_step`` returned None)."""
        if self.samples_in_epoch is not None and self.curriculum_dm is None:  # thinning has no epoch plan to share
            self.samples_in_epoch += int(step.index.numel())

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """First the non-finite loss policy (:class:`~lightning_effi.core.nonfinite.NonFiniteLossGuard`: with
        ``nonfinite_loss="raise"`` a NaN or infinite loss stops the fit here, before its backward pass). Then, with
        manual optimization: refuse a ``manual_backward`` before :meth:`weighted_loss` in the step, and one of a
        loss not computed from :meth:`weighted_loss`'s result (e.g. the plain mean, with the weighted loss computed
        for logging only): either would train on unweighted losses.

        Raises:
            NonFiniteLossError: ``loss`` is not finite and the policy is ``"raise"``.
            ValueError: (manual optimization) see above.
        """
        self.nonfinite_guard.check(trainer, loss)
        step = self._step
        if step is None or pl_module.automatic_optimization:
            return
        if not step.weighted:
            raise ValueError(
                f"InfoBatchCallback: {MANUAL}; this step calls manual_backward before weighted_loss (it would train "
                f"on unweighted losses){SECOND_LOSS}"
            )
        if step.loss is not None and isinstance(loss, Tensor) and not ib.computed_from(loss, step.loss):
            raise ValueError(
                f"InfoBatchCallback: {MANUAL}; this step backpropagates a loss that is not computed from the result "
                "of weighted_loss (e.g. per_sample_loss.mean(), with the weighted loss computed beside it): it would "
                f"train on unweighted losses{SECOND_LOSS}"
            )

    def _with_per_sample_loss(self, output: Any, batch: Any, forward: ForwardCapture | None) -> dict[str, Any]:
        """The step's output as a dict with its ``"loss"`` and the batch's ``"per_sample_loss"`` (class docstring:
        from ``per_sample_loss=fn``, the step's output or the automatic cross-entropy), checked."""
        if isinstance(output, Tensor):
            output = {"loss": output}
        if not isinstance(output, Mapping) or "loss" not in output:
            raise ValueError(
                f"InfoBatchCallback: {CONTRACT}; got {type(output).__name__}"
                + (f" with keys {sorted(output)}" if isinstance(output, Mapping) else "")
            )
        output, loss = dict(output), output["loss"]
        returned = output.get("per_sample_loss")
        scores = output.get("per_sample_score")
        outputs = forward.output if forward is not None else None
        if self.per_sample_loss is not None:
            if returned is not None:
                raise ValueError(
                    'InfoBatchCallback: training_step returns "per_sample_loss" and per_sample_loss=fn is given; use '
                    "one of them"
                )
            where = self._fn_input(forward)
            try:
                per_sample = self.per_sample_loss(outputs, batch)
            except Exception as err:
                err.add_note(f"InfoBatchCallback: per_sample_loss=fn raised; {where}")
                raise
            source = "fn"
        elif returned is not None:
            source, per_sample = "returned", returned
        elif self.per_sample_source == "returned":
            raise ValueError(
                'InfoBatchCallback: training_step returned "per_sample_loss" on the first batch but not on this one; '
                + CONTRACT
            )
        else:
            source = "auto"
            if forward is None or not forward.captured:
                raise ValueError(
                    "InfoBatchCallback: training_step returns a plain loss and called no module with a trainable "
                    "parameter, nor a frozen one whose output carries a gradient (no forward output to take logits "
                    'from); return {"loss": ..., "per_sample_loss": ...} from training_step'
                )
            try:
                if not isinstance(loss, Tensor) or bool(torch.isfinite(loss.detach()).all()):
                    found = ib.auto_losses(outputs, batch, loss, self._shift, self._token_mean)
                    undecided = self._token_mean is None
                    if undecided and self._trainer is not None and self._trainer.world_size > 1:
                        agreed = self._agree_on_reduction(self._trainer, found.token_mean)
                        if agreed is not None and found.token_mean is None:  # another rank's batch told them apart
                            found = ib.auto_losses(outputs, batch, loss, found.shift, agreed)
                    per_sample, self._shift = found.per_sample, found.shift
                    if found.token_mean is not None:  # the first batch that tells the reductions apart decides
                        self._token_mean = found.token_mean
                    scores = scores if scores is not None else found.scores  # a returned "per_sample_score" wins
                else:  # a non-finite loss cannot be checked (a causal shift not yet detected is detected at the
                    # next finite loss). The per-sample losses carry it (NaN), so that the weighted loss is as
                    # non-finite as the module's: the non-finite policy (on_before_backward) stops the fit or counts
                    # the step, never a finite cross-entropy trained in place of the module's NaN loss; nothing of
                    # the batch is scored (_record)
                    shift = self._shift if self._shift is not None else False
                    if self._token_mean is None and self._trainer is not None and self._trainer.world_size > 1:
                        self._agree_on_reduction(self._trainer, None)  # the other ranks' collective of this step
                    per_sample, _ = ib.auto_per_sample_loss(outputs, batch, loss, shift, verify=False)
                    per_sample = per_sample + loss.detach().reshape(()).to(per_sample.dtype) * 0
            except ValueError as err:
                raise ValueError(
                    f"InfoBatchCallback: {err} (the logits: the output of {forward.source}, the last module with "
                    "trained parameters that training_step called; a network called after the one whose loss you "
                    "return, e.g. a teacher, is passed over once it is frozen, requires_grad_(False), or out of the "
                    "optimizers)"
                ) from None
            self._warn_mixed_targets(batch)
        self._check_per_sample(per_sample, source, forward)
        self._check_finite_per_sample(per_sample, loss, source)
        if scores is not None:
            self._check_scores(scores, source)
            output["per_sample_score"] = scores.detach()
        elif not self._negative_warned and bool((per_sample.detach() < 0).any()):
            # a score below the mean is "well learned": a loss whose sign is not the sample's fit (a policy-gradient
            # loss, -advantage x log-prob) pruned samples by their advantage's sign, in silence (qa114-rl 06)
            self._negative_warned = True
            rank_zero_warn(
                f"InfoBatchCallback: {SOURCES[source]} holds negative values ({int((per_sample < 0).sum())} of "
                f"{per_sample.numel()} in this batch): InfoBatch scores each sample by its loss and prunes those below "
                "the mean as well learned. That holds for a loss that is lower the better a sample is fit (a Gaussian "
                "negative log-likelihood can be negative); a loss whose sign says something else (a policy-gradient "
                "loss, -advantage x log-prob: its sign is the advantage's) prunes by it: return "
                '"per_sample_score" (e.g. the negative log-likelihood of the sample) beside the loss'
            )
        if (
            not self._loss_mismatch_warned
            and source in ("fn", "returned")
            and isinstance(loss, Tensor)
            and isinstance(per_sample, Tensor)
            and ib.finite_losses_disagree(per_sample, loss)  # one device read a batch
        ):
            what = "per_sample_loss=fn's values" if source == "fn" else 'the "per_sample_loss" training_step returned'
            if source == "fn":
                what += f" ({self._fn_input(forward)})"
            values = per_sample.detach().float()
            inside = float(values.min()) <= float(loss.detach()) <= float(values.max())
            rank_zero_warn(
                f"InfoBatchCallback: the mean of {what} ({float(values.mean()):.6g}) differs from the "
                f'"loss" training_step returned ({float(loss.detach()):.6g}); InfoBatch trains on the weighted mean '
                "of the per-sample losses in place of that loss. Either a term outside them (a regulariser, an "
                "auxiliary loss) is not trained: add it to each sample's loss"
                + (
                    "; or the loss weighs the samples unequally, e.g. a mean over every token (position, item) of "
                    "the batch where the per-sample losses are each sample's mean (the loss lies within their range): "
                    "InfoBatch then trains the mean over samples, a sample of 2 tokens weighing as much as one of 40. "
                    "To keep the token mean, return \"per_sample_loss\" = each sample's summed loss x B / the batch's "
                    'tokens (their mean is the token mean) and "per_sample_score" = each sample\'s mean loss'
                    if inside
                    else ""
                )
            )
            self._loss_mismatch_warned = True
        self.per_sample_source = source
        output["per_sample_loss"] = per_sample
        return output

    def _agree_on_reduction(self, trainer: pl.Trainer, mine: bool | None) -> bool | None:
        """Under DDP, while the loss's reduction is undecided (every rank calls this at each step until then): the
        reduction some rank's batch told apart this step, the same on every rank (each rank decided from its own
        batches, and a rank whose batches could not tell trained the labelled-token mean while another trained the
        samples' means, qa41-break 01).

        Raises:
            ValueError: ranks told different reductions apart (their modules' losses differ).
        """
        votes = torch.tensor([int(mine is False), int(mine is True)], device=trainer.strategy.root_device)
        means, tokens = (int(v) for v in trainer.strategy.reduce(votes, reduce_op="sum").tolist())
        if means and tokens:
            raise ValueError(
                f"the step's loss is the mean of the samples' means on {means} rank(s) and the mean "
                f"over the batch's labelled tokens on {tokens}: the ranks' modules compute their loss differently; "
                + ib.PER_SAMPLE_LOSS_HINT
            )
        return False if means else True if tokens else None

    def _warn_mixed_targets(self, batch: Any) -> None:
        """Warn once when the batch's targets are class probabilities (a float ``[B, C]`` tensor): in-batch mixing in
        the collate function (CutMix / MixUp) gives them, and a mixed row carries other samples' content, which
        InfoBatch's per-sample scores and weights do not follow (the rescaling is then not unbiased)."""
        if self._mixed_warned:
            return
        labels = ib.find_labels(batch)
        if isinstance(labels, Tensor) and labels.is_floating_point() and labels.dim() == 2:
            self._mixed_warned = True
            rank_zero_warn(
                f"InfoBatchCallback: the batch's targets are class probabilities {tuple(labels.shape)} (CutMix / "
                "MixUp in the collate function?): InfoBatch scores and weights each row as the sample at its index, "
                "but a mixed row also carries its partners' content and a pruned sample is never a partner, so the "
                "rescaling is no longer unbiased (InfoBatch card: in-batch mixing); soft labels of the samples' own "
                "(distillation) are fine"
            )

    def _check_scores(self, scores: Any, source: str) -> None:
        """Raise unless the returned ``"per_sample_score"`` is a float tensor ``[B]`` (NaN: the sample is not
        scored), beside a returned ``"per_sample_loss"``, a plain loss (the automatic path) or ``weighted_loss``;
        with ``per_sample_loss=fn`` it is refused."""
        assert self._step is not None
        b = int(self._step.index.numel())
        if source == "fn":
            raise ValueError(
                'InfoBatchCallback: training_step returns "per_sample_score" and per_sample_loss=fn is given; return '
                '"per_sample_loss" beside it instead of fn'
            )
        if not isinstance(scores, Tensor) or not scores.is_floating_point() or tuple(scores.shape) != (b,):
            what = f"a {scores.dtype} tensor of shape {tuple(scores.shape)}" if isinstance(scores, Tensor) else scores
            raise ValueError(
                f'InfoBatchCallback: "per_sample_score" must be a float tensor of shape ({b},), one score per sample '
                f"of the batch (NaN: that sample is not scored this time and keeps its score), got {what}"
            )

    @staticmethod
    def _fn_input(forward: ForwardCapture | None) -> str:
        """What ``per_sample_loss=fn`` received, for messages: the output of the last module with trained parameters
        that ``training_step`` called, named, with the others it called (an auxiliary head called after the main one
        gave fn its output, and the main head never trained, qa44-user 01)."""
        if forward is None or not forward.captured:
            return (
                "fn received outputs=None: training_step called no module with trained parameters, nor a frozen one "
                'whose output carries a gradient; return "per_sample_loss" from training_step instead of fn'
            )
        others = [s for s in dict.fromkeys(forward.sources) if s != forward.source]
        text = f"fn received the output of {forward.source}, the last module with trained parameters called"
        if others:
            text += (
                f" (it also called {', '.join(others)}); if your loss is computed from another output, return "
                '"per_sample_loss" from training_step instead of fn'
            )
        return text

    def _check_finite_per_sample(self, per_sample: Tensor, loss: Any, source: str) -> None:
        """Refuse non-finite per-sample losses beside a finite loss: a sample whose loss is a mean over nothing (an
        image whose pixels are all ``ignore_index``: 0 / 0). InfoBatch's weighted mean was NaN, and the fit stopped
        with advice to lower the learning rate (qa44-user 05).

        Raises:
            NonFiniteLossError: (``nonfinite_loss="raise"``) naming the source, the rows and the remedy.
        """
        if self.nonfinite_guard.policy != "raise" or not isinstance(loss, Tensor):
            return  # "warn": the weighted loss is counted as non-finite and the step skipped, as the policy says
        if not bool(torch.isfinite(loss.detach()).all()):
            return  # a non-finite loss: the policy's own error (on_before_backward)
        bad = ~torch.isfinite(per_sample.detach())
        if not bool(bad.any()):
            return
        assert self._step is not None
        rows = bad.nonzero().flatten().tolist()
        indices = self._step.index[bad.to(self._step.index.device)].tolist()
        step = self._trainer.global_step if self._trainer is not None else "?"
        raise NonFiniteLossError(
            f"InfoBatchCallback: the weighted loss would be nan at step {step}: {SOURCES[source]} is not finite for "
            f"rows {rows[:8]} of the batch (dataset indices {indices[:8]}) while the loss training_step returned is "
            f"finite ({float(loss.detach()):.6g}): a sample's "
            "loss that is a mean over none of its elements (an image whose pixels are all ignore_index, a sequence "
            "without a labelled token) is 0 / 0. Give such a sample the loss your own loss gives it (0, or leave it "
            'out of the mean with a weight of 0), and return "per_sample_score" NaN for it to leave it unscored'
        )

    def _check_per_sample(self, per_sample: Any, source: str, forward: ForwardCapture | None = None) -> None:
        """Raise unless ``per_sample`` is a float tensor ``[B]`` (``B``: the batch's samples) with grad: computed
        from the model (a ``grad_fn``; a detached tensor or a fresh leaf with ``requires_grad=True`` is refused).
        For ``fn`` and the automatic path the "no grad" error names the module whose forward output was used
        (``forward.source``)."""
        assert self._step is not None
        b = int(self._step.index.numel())
        what = SOURCES[source]
        used = ""
        if source in ("fn", "auto") and forward is not None:
            used = (
                f"; it was computed from the output of {forward.source}, the last trainable module training_step called"
                if forward.captured
                else "; training_step called no trainable module (outputs=None)"
            )
        # the way to give one, unless that is the way taken (a per_sample_loss=fn told to pass per_sample_loss=fn)
        hint = {"manual": "see weighted_loss", "fn": "fn(outputs, batch) must return it"}.get(
            source, ib.PER_SAMPLE_LOSS_HINT
        )
        contract = (
            f"a per-sample loss is a float tensor of shape ({b},), one loss per sample of the batch, with grad "
            f"(not detached); {hint}"
        )
        if not isinstance(per_sample, Tensor) or not per_sample.is_floating_point():
            kind = f"{per_sample.dtype} tensor" if isinstance(per_sample, Tensor) else type(per_sample).__name__
            raise ValueError(f"InfoBatchCallback: {what} is a {kind}; {contract}")
        rows = self._step.rows
        if rows is not None and rows != b and per_sample.numel() == rows:
            owner = self._datamodule if self._datamodule is not None else self.curriculum_dm
            found = owner.template().get("collate_fn") if owner is not None else None
            collate = getattr(found, "__qualname__", type(found).__name__)
            several = (
                f" If each sample is {rows // b} rows on purpose (a preference pair's chosen and rejected rows "
                f"concatenated, [2B, T], or two views of an image), return one loss per drawn sample: {b} values, "
                f"e.g. per_sample.view({rows // b}, {b}).mean(0) for rows stacked block by block"
                if rows % b == 0 and rows > b
                else ""
            )
            raise ValueError(
                f"InfoBatchCallback: the training batch holds {rows} rows for the {b} samples InfoBatch drew, and "
                f"{what} one value per row: the loader's collate_fn ({collate}) returned another number of rows than "
                "the samples it was given. InfoBatch weighs and scores each drawn sample, so the per-sample loss holds "
                "one value per drawn sample, in the order drawn; a collate must not leave samples out (leave them out "
                "of the dataset beforehand, torch.utils.data.Subset, or keep them in the batch with a zero per-sample "
                f"loss).{several}"
            )
        if per_sample.dim() != 1 or per_sample.numel() != b:
            if per_sample.numel() == 1 and b > 1:  # the batch's loss: the default reduction (qa75-infobatch 01)
                packed = (
                    " (one value: a loss reduced over the batch, as F.cross_entropy and nn.CrossEntropyLoss give with "
                    "their default reduction='mean'; compute it with reduction='none', and average token losses per "
                    "sample"
                    + (
                        "; or a collate that packs the samples into one row, as HF's DataCollatorWithFlattening: "
                        "return one loss per drawn sample)"
                        if per_sample.dim() == 1
                        else ")"
                    )
                )
            elif 0 < per_sample.numel() < b:
                packed = (
                    " (fewer values than samples: a collate that packs the samples into fewer rows, as HF's "
                    "DataCollatorWithFlattening, gives a loss per row; return one loss per drawn sample, e.g. the "
                    "token losses averaged per sequence, the sequences told by the restarts of position_ids)"
                )
            else:
                packed = ""
            raise ValueError(
                f"InfoBatchCallback: {what} has shape {tuple(per_sample.shape)} for a batch of {b} samples{packed}; "
                f"{contract}"
            )
        if b > 1 and per_sample.stride(0) == 0:  # loss.expand(B): every sample scored by the batch's mean
            raise ValueError(
                f"InfoBatchCallback: {what} is one value broadcast to the batch's {b} samples (an expand of the "
                "batch's loss: every sample would be scored by the batch's mean, and pruning would be random by "
                f"batch); compute the loss with reduction='none', one value per sample; {contract}"
            )
        if torch.is_grad_enabled() and not per_sample.requires_grad:
            raise ValueError(
                f"InfoBatchCallback: {what} has no grad (detached, or computed under no_grad{used}); {contract}"
            )
        if torch.is_grad_enabled() and per_sample.grad_fn is None:
            raise ValueError(
                f"InfoBatchCallback: {what} is a leaf tensor (requires_grad=True but no grad_fn: a fresh tensor, not "
                f"computed from the model's output, so no gradient would reach the model); {contract}"
            )

    def _weigh(self, output: dict[str, Any], step: _Step) -> dict[str, Any]:
        if self.curriculum_dm is not None:
            assert step.weights is not None
            return self.thinned_output(output, step.index, step.weights, step.candidates)
        return self.rescale_output(output, step.index)

    def weighted_loss(self, per_sample_loss: Tensor, per_sample_score: Tensor | None = None) -> Tensor:
        """Manual optimization: InfoBatch's loss of the batch being trained, to ``manual_backward``: ``mean(w · l)``
        (Qin et al. 2024, Eq. 4; with the curriculum ``sum(w · l) / B``); the raw losses are recorded as the batch's
        scores. Call it once per ``training_step`` (:func:`weighted_loss` finds this callback from the module).

        Args:
            per_sample_loss: ``float[B]``, with grad, one loss per sample of the batch ``training_step`` received.
            per_sample_score: optional ``float[B]``: the samples' scores in place of their losses (NaN: not scored
                this time; a masked LM's sample without a masked token), as a returned ``"per_sample_score"``.

        Returns:
            A scalar float32 tensor on ``per_sample_loss.device``.

        Every ``manual_backward`` of the step must then backpropagate a loss computed from the result (scaled,
        summed with other terms: anything whose autograd graph contains it); another loss raises in
        :meth:`on_before_backward` (it would train on the unweighted losses).

        Raises:
            RuntimeError: called outside the ``training_step`` of a fit with this callback.
            ValueError: ``per_sample_loss`` not ``float[B]`` with grad, ``per_sample_score`` not ``float[B]``; a
                second call in the same step.
        """
        step = self._step
        if step is None:
            raise RuntimeError(
                "InfoBatchCallback.weighted_loss: call it inside training_step, during trainer.fit with this callback"
            )
        if step.weighted:
            raise ValueError(
                "InfoBatchCallback.weighted_loss: called twice in one training_step; call it once, on the whole "
                "batch's per-sample loss"
            )
        self._check_per_sample(per_sample_loss, "manual")
        output: dict[str, Any] = {"per_sample_loss": per_sample_loss}
        if per_sample_score is not None:
            self._check_scores(per_sample_score, "manual")
            output["per_sample_score"] = per_sample_score.detach()
        step.weighted = True
        step.loss = self._weigh(output, step)["loss"]
        return step.loss

    # ----------------------------------------------------------------------------------------- per batch
    def rescale_output(self, output: Any, index: Tensor) -> dict[str, Any]:
        """Validate a ``training_step`` output, record the raw per-sample losses, and return it with ``"loss"``
        replaced by ``mean(w · per_sample_loss)`` (Qin et al. 2024, Eq. 4). ``index``: int64 ``(B,)`` dataset
        positions."""
        if not isinstance(output, Mapping) or "per_sample_loss" not in output:
            raise ValueError(
                f"InfoBatchCallback: {CONTRACT}; got {type(output).__name__}"
                + (f" with keys {sorted(output)}" if isinstance(output, Mapping) else "")
            )
        per_sample = output["per_sample_loss"]
        weights = self.current_weights()
        loss = ib.rescale(per_sample, index, weights)  # validates shape/dtype against the contract
        self._record(per_sample, index, output.get("per_sample_score"))
        return {**output, "loss": loss, "per_sample_loss": per_sample.detach(), "index": index}

    def thinned_output(self, output: Any, index: Tensor, weights: Tensor, candidates: int) -> dict[str, Any]:
        """Composed mode: validate a ``training_step`` output, record the raw per-sample losses and the thinning
        figures, and return it with ``"loss"`` replaced by ``sum(w · per_sample_loss) / B``
        (:func:`~lightning_effi.infobatch.functional.thinned_loss`). ``index``: int64 ``(B_kept,)``; ``weights``:
        float32 ``(B_kept,)``; ``candidates``: ``B``, the slice's size before thinning."""
        if not isinstance(output, Mapping) or "per_sample_loss" not in output:
            raise ValueError(
                f"InfoBatchCallback: {CONTRACT}; got {type(output).__name__}"
                + (f" with keys {sorted(output)}" if isinstance(output, Mapping) else "")
            )
        per_sample = output["per_sample_loss"]
        loss = ib.thinned_loss(per_sample, weights, candidates)  # validates shape/dtype against the contract
        self._record(per_sample, index, output.get("per_sample_score"))
        kept = int(index.numel())
        # the tail cap kept one well-learned sample of an all-well-learned slice (see ib.cap_applies)
        capped = kept == 1 and float(weights[0]) != 1.0 and ib.cap_applies(candidates, candidates, self.prune_ratio)
        self.thin_stats += torch.tensor([candidates, candidates - kept, int(capped)], dtype=torch.int64)
        self._last_thin = (int(candidates), kept)
        return {
            **output,
            "loss": loss,
            "per_sample_loss": per_sample.detach(),
            "index": index,
            "infobatch_weight": weights,
        }

    def _record(self, per_sample: Tensor, index: Tensor, scores: Tensor | None = None) -> None:
        """Accumulate the batch's scores for the score table: ``scores`` (the automatic path's mean token losses, or
        a returned ``"per_sample_score"``), else the raw per-sample losses. A NaN score (a sample without a labelled
        token) and a non-finite per-sample loss are never recorded (the sample keeps its previous score); a
        non-finite loss makes the step's training loss non-finite too, which the non-finite policy
        (:meth:`on_before_backward`, ``nonfinite_loss``) stops or warns about and counts."""
        losses = per_sample.detach().float().cpu()
        values = losses if scores is None else scores.detach().float().cpu()
        finite = torch.isfinite(values) & torch.isfinite(losses)
        ib.accumulate(self.sum_loss, self.count, index.cpu()[finite], values[finite])

    def current_weights(self) -> Tensor:
        """``float32[N]`` loss weights of the current plan (all 1.0 before the first plan)."""
        return self.plan.weights if self.plan is not None else torch.ones(self.dataset_size)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_stepped = False

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Count the step in the epoch's progress (before the LR scheduler steps: progress counts this step). Under
        manual optimization a batch counts once, whatever the optimizers it steps (a GAN's discriminator and
        generator): the epoch's length is counted in batches (:meth:`record_loader`), as Lightning's
        ``estimated_stepping_batches`` counts them, while ``optimizer.step()`` runs once per optimizer."""
        if not pl_module.automatic_optimization:
            if self._batch_stepped:
                return
            self._batch_stepped = True
        self.steps_in_epoch += 1

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Under manual optimization, count a batch that stepped no optimizer (a step accumulating its gradients,
        ``opt.step()`` every k-th batch): the epoch's length is counted in batches, so progress ended the run at
        ``1 - (k-1)/k`` of it, never reaching 1 (0.90, qa86-break 09)."""
        if not pl_module.automatic_optimization and not self._batch_stepped:
            self._batch_stepped = True
            self.steps_in_epoch += 1

    # -------------------------------------------------------------------------------------------- plans
    def plan_for(self, epoch: int) -> ib.EpochPlan:
        """The plan of ``epoch``: cached if already made (or restored), else computed from the score table
        (:func:`~lightning_effi.infobatch.functional.plan_epoch`; an epoch at or after ``E``, in a run of
        ``max_epochs > num_epochs``, is a full epoch: :func:`~lightning_effi.infobatch.functional.full_plan`).

        Losses still pending from the previous epoch are merged first: this happens after resuming from a checkpoint
        written at an epoch's last batch, whose ``on_train_epoch_end`` Lightning does not run again. Called on every
        rank at the same point (``train_dataloader()``), so the merge's collective is safe.

        A resumed fit whose ``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` builds the training
        loader before Lightning restores its loops, at ``trainer.current_epoch == 0``, while this callback already
        holds the checkpoint's later plan: epoch 0 is then answered with the full plan a fresh fit makes there
        (:func:`~lightning_effi.infobatch.functional.full_plan`, so the estimate equals the uninterrupted run's) and
        the state (plan, scores, history) is left as restored."""
        if epoch == 0 and self.plan is not None and self.plan.epoch > 0:
            return ib.full_plan(self.dataset_size, 0, self.seed)
        if self.plan is None or self.plan.epoch != epoch:
            self._close_epoch_share()  # the previous epoch's, when its end did not run (a resumed fit)
            if self._trainer is not None and self._pending_anywhere(self._trainer):
                self.sync_scores(self._trainer)
            if epoch < self.epochs:
                self.plan = ib.plan_epoch(
                    self.score, self.seen, epoch, self.epochs, self.prune_ratio, self.delta, self.seed
                )
            else:  # num_epochs < max_epochs: the epochs after InfoBatch's schedule train on the full data
                self.plan = ib.full_plan(self.dataset_size, epoch, self.seed)
            self.steps_in_epoch, self.samples_in_epoch = 0, 0
            self.history.append(
                {
                    "epoch": epoch,
                    "kind": self.plan.kind,
                    "saved": self.plan.saved,
                    "padded": 0,
                    "threshold": self.plan.threshold,
                    "well_learned": self.plan.num_well_learned,
                    "kept_well_learned": self.plan.num_kept_well_learned,
                    "size": self.plan.epoch_size,
                }
            )
        return self.plan

    def record_loader(self, epoch: int, padded: int, batches: int) -> None:
        """Called by the DataModule for each loader it builds: the DDP duplicates added to the plan of ``epoch``
        (counted, not subtracted from the saving) and the loader's batches per rank, which give the epoch's
        optimizer steps ``L_e = ceil(batches / a_e)`` for :meth:`effi_progress` and :meth:`effi_progress_done`
        (known before the scheduler is built), with ``limit_train_batches`` applied as Lightning applies it
        (:func:`~lightning_effi.infobatch.functional.limited_batches`) and ``a_e`` the accumulation factor of
        ``epoch`` (:func:`~lightning_effi.core.progress.accumulate_grad_batches_at`: a
        ``GradientAccumulationScheduler`` sets the Trainer's only after the epoch's loader is built). A loader of
        another epoch than the current plan's (the provisional one of :meth:`plan_for`) changes nothing."""
        if self.plan is not None and self.plan.epoch != epoch:
            return
        if self.history and self.history[-1]["epoch"] == epoch:
            self.history[-1]["padded"] = int(padded)
        accumulate, limit = 1, 1.0
        if self._trainer is not None:
            accumulate = accumulate_grad_batches_at(self._trainer, epoch)
            limit = self._trainer.limit_train_batches
        batches = ib.limited_batches(int(batches), limit)
        # an empty loader (0 batches on this rank) counts as one step, so progress stays finite
        self.steps_per_epoch = steps_per_epoch(max(1, batches), accumulate, f"{type(self).__name__}.record_loader")

    def effi_clock_epochs(self) -> int:
        """The epochs its progress runs over, ``E`` (``num_epochs``, by default ``max_epochs``; after them it trains
        on the full data and its progress stays at 1): an epoch count of another technique on this clock is a share
        ``n / E`` of it (:func:`~lightning_effi.core.progress.clock_epochs`). 0 before ``setup``."""
        return self.epochs

    def effi_progress(self) -> float:
        """Training progress in [0, 1] after the next optimizer step: ``(e + (j + 1) / L_e) / E`` with ``j`` the
        steps done in epoch ``e`` and ``L_e`` its number of optimizer steps. Drives progress-based LR
        schedules so they end exactly at the end of training whatever the epochs' lengths."""
        if self.plan is None or self.epochs < 1:
            return 0.0
        p = (self.plan.epoch + (self.steps_in_epoch + 1) / self.steps_per_epoch) / self.epochs
        return min(max(p, 0.0), 1.0)

    def effi_progress_done(self) -> float:
        """Training progress in [0, 1] after the optimizer steps taken so far
        (:class:`~lightning_effi.core.protocols.ProvidesProgressClock`): ``(e + j / L_e) / E``, clamped to [0, 1],
        with ``e`` the current plan's epoch, ``j`` the optimizer steps taken in it (advanced in
        ``on_before_optimizer_step``, so ``on_train_batch_end`` already counts its step), ``L_e`` its optimizer steps
        (:meth:`record_loader`) and ``E`` the epochs. 0.0 before the first plan; exactly ``n / E`` after the last step
        of epoch ``n - 1`` (``j = L_e``) and at the start of epoch ``n`` (``j = 0``), 1.0 after the run's last step.
        Reads only checkpointed state (the plan, ``steps_in_epoch``) and the rebuilt loader's length, so a resumed run
        (mid-epoch too) reads the same values as the uninterrupted one. (The clamp only guards ``j > L_e``, which a
        loader of the plan cannot produce.)

        With the curriculum the callback is not the run's clock (``effi_progress`` is None, so
        :func:`~lightning_effi.core.progress.progress_clock` finds none after this callback's ``setup``); a technique
        that looked for a clock before that ``setup`` (an earlier callback) reads the curriculum's steps here:
        ``global_step / T`` (``T``: the run's optimizer steps, :meth:`thin_stop`), and ``T`` from
        :meth:`effi_min_total_steps`."""
        if self.curriculum_dm is not None:
            total = self._composed_run_steps()
            return 0.0 if total is None or self._trainer is None else min(self._trainer.global_step / total, 1.0)
        if self.plan is None or self.epochs < 1:
            return 0.0
        p = (self.plan.epoch + self.steps_in_epoch / self.steps_per_epoch) / self.epochs
        return min(max(p, 0.0), 1.0)

    def effi_progress_done_exact(self) -> Fraction:
        """:meth:`effi_progress_done` as an exact fraction, ``(e·L_e + j) / (E·L_e)`` (with the curriculum
        ``global_step / T``), clamped to [0, 1]: read by
        :func:`~lightning_effi.core.progress.exact_progress_done` (random-LTD's growth over a share of the progress
        then reaches its boundaries at the steps that reach them, 1/3 of the run included, which a float or a tick
        count rounds below)."""
        if self.curriculum_dm is not None:
            total = self._composed_run_steps()
            if total is None or self._trainer is None:
                return Fraction(0)
            return min(Fraction(self._trainer.global_step, total), Fraction(1))
        if self.plan is None or self.epochs < 1:
            return Fraction(0)
        length = self.steps_per_epoch
        p = Fraction(self.plan.epoch * length + self.steps_in_epoch, self.epochs * length)
        return min(max(p, Fraction(0)), Fraction(1))

    def _composed_run_steps(self) -> int | None:
        """Composed mode: ``T``, the run's optimizer steps (:meth:`thin_stop`), None before the curriculum's
        controller exists."""
        self.thin_stop()
        return self._run_steps

    def effi_min_total_steps(self) -> int:
        """The fewest optimizer steps the run can have, whatever the scores
        (:class:`~lightning_effi.core.protocols.ProvidesProgressClock`; called at ``on_train_start``):
        :func:`~lightning_effi.infobatch.functional.min_total_steps` over the ``E`` epochs, each at its fewest samples
        (:func:`~lightning_effi.infobatch.functional.min_epoch_size`: ``N`` in the full epochs 0 and
        ``>= floor(delta·E)``, ``1 + floor((1 - r)(N - 1))`` in the pruning epochs), per rank (padded as the sampler
        pads, or dropped with the loader's ``drop_last``) at the loader's batch size, with ``limit_train_batches``
        and each epoch's accumulation factor (``accumulate_grad_batches``, or a ``GradientAccumulationScheduler``'s
        factor of the epoch) applied as Lightning applies them.

        With the curriculum (see :meth:`effi_progress_done`): ``T``, the run's optimizer steps (:meth:`thin_stop`).

        Raises:
            RuntimeError: before ``setup`` (with the curriculum: before its controller exists).
            ValueError: the run can have no optimizer step at all (``drop_last`` with fewer samples than ranks or
                than the batch size).
        """
        if self.curriculum_dm is not None and (total := self._composed_run_steps()) is not None:
            return total
        dm, trainer = self._datamodule, self._trainer
        if dm is None or trainer is None:
            raise RuntimeError(
                "InfoBatchCallback.effi_min_total_steps: the callback is not set up yet (call it from on_train_start "
                "on)"
            )
        t = dm.template()
        steps = ib.min_total_steps(
            self.dataset_size,
            self.epochs,
            self.prune_ratio,
            self.delta,
            int(t["batch_size"]),
            trainer.world_size,
            bool(t["drop_last"]),
            [accumulate_grad_batches_at(trainer, e) for e in range(self.epochs)],
            trainer.limit_train_batches,
        )
        if steps < 1:
            raise ValueError(
                f"InfoBatchCallback: the run can have no optimizer step ({self.dataset_size} samples, batch size "
                f"{t['batch_size']}, {trainer.world_size} ranks, drop_last={t['drop_last']}, limit_train_batches="
                f"{trainer.limit_train_batches})"
            )
        return steps

    def effi_baseline(self, batch: Any, pl_module: pl.LightningModule) -> Baseline | None:
        """What InfoBatch changed in the current batch, for :class:`~lightning_effi.core.accounting.EfficiencyMonitor`
        (:class:`~lightning_effi.core.accounting.Baseline`): the samples, and the tokens, each trained one stands for.

        - Alone, in a prune epoch: ``samples = full / trained`` with ``trained`` the plan's samples plus the DDP
          duplicates (``padded``, summed over ranks) and ``full`` what a full epoch trains, the ``N`` samples padded
          to a multiple of the ranks (as a plain run's distributed sampler pads them). With the loader's
          ``drop_last``, the samples a full epoch trains over those the pruned one trains, each rank's last partial
          batch dropped from both. Under ``Trainer(limit_train_batches=...)``, the samples a full epoch trains under
          the limit over those the pruned one trains (1 when the limit cuts both to the same batches). ``tokens =
          samples * token_ratio`` (:func:`~lightning_effi.infobatch.functional.token_ratio`: the training set's mean
          tokens per sample over the epoch's trained samples', from each sample's tokens when it last trained), so
          that the pruned samples are charged at their own length; ``tokens`` is left None (= ``samples``) for
          samples without tokens (images). None in a full epoch.
        - With the curriculum: ``candidates / kept`` samples of the micro-batch slice this rank thinned last
          (:meth:`thinned_output`; the dropped samples charged at the kept ones' mean cost); None when nothing was
          dropped.
        """
        if self.curriculum_dm is not None:
            if self._last_thin is None:
                return None
            candidates, kept = self._last_thin
            return Baseline(samples=candidates / kept) if 0 < kept < candidates else None
        plan = self.plan
        if plan is None or not plan.saved:
            return None
        samples = self._sample_factor(plan)
        if samples is None:
            return None
        if self._token_ratio is None or self._token_ratio[0] != plan.epoch:  # the table changes between epochs only
            self._token_ratio = (plan.epoch, ib.token_ratio(self.sample_tokens, plan.indices))
        ratio = self._token_ratio[1]
        tokens = None if ratio is None else samples * ratio
        if samples == 1 and tokens in (None, 1):
            return None
        return Baseline(samples=samples, tokens=tokens)

    def _sample_factor(self, plan: ib.EpochPlan) -> float | None:
        """The samples a full epoch draws per sample this pruned epoch trains (:meth:`effi_baseline`); None when
        the pruned epoch trains none."""
        history = self.history
        padded = history[-1]["padded"] if history and history[-1]["epoch"] == plan.epoch else 0
        trained = int(plan.indices.numel()) + int(padded)
        t = self._datamodule.template() if self._datamodule is not None else None
        limited = self._limited_samples(int(plan.indices.numel()))
        if limited is not None:
            # Trainer(limit_train_batches=...): a full epoch would train as many batches as the limit lets it, so
            # the baseline is the samples a full epoch trains under the limit over those this pruned one trains
            full, kept = limited
            return full / kept if kept else None
        if t is not None and bool(t["drop_last"]) and self._trainer is not None:
            # the loader drops each rank's last partial batch, of the full epoch and of the pruned one alike: the
            # samples a full epoch trains over those this pruned epoch trains (all ranks)
            world, size = self._trainer.world_size, int(t["batch_size"])
            full = (math.ceil(self.dataset_size / world) // size) * size * world
            kept = (math.ceil(trained / world) // size) * size * world
            return full / kept if kept else None
        # a full epoch trains every sample, padded by the distributed sampler to a multiple of the ranks as a plain
        # run is: the pruned epoch's own duplicates are not samples of the baseline
        world = self._trainer.world_size if self._trainer is not None else 1
        full = math.ceil((int(plan.indices.numel()) + int(plan.saved)) / world) * world
        return full / trained if trained else None

    def _pending_anywhere(self, trainer: pl.Trainer) -> bool:
        """Whether any rank holds recorded losses not yet merged into the score table. Under DDP a collective (every
        rank calls it at the same point): after a resume only rank 0 holds the pending sums (the other ranks' are
        zeroed, :meth:`load_state_dict`), so a rank-local test had rank 0 alone enter the merge's collective, and the
        fit hung (a resume from a checkpoint written at an epoch's last batch, qa41-break 03)."""
        pending = bool(self.count.any())
        if trainer.world_size <= 1:
            return pending
        flag = torch.tensor([int(pending)], device=trainer.strategy.root_device)
        return bool(trainer.strategy.reduce(flag, reduce_op="sum").item() > 0)

    def sync_scores(self, trainer: pl.Trainer | None) -> None:
        """Sum the epoch's recorded losses over ranks (one collective per epoch) into the score table, identical on
        every rank, and clear the accumulators. With the curriculum the epoch's thinning figures (drawn, dropped,
        capped slices) travel in the same reduction as the counts and are added to the epoch's history entry."""
        sum_loss, count = self.sum_loss, self.count
        composed = self.curriculum_dm is not None
        stats = self.thin_stats
        world = trainer.world_size if trainer is not None else 1
        if world > 1:
            assert trainer is not None
            device = trainer.strategy.root_device
            sum_loss = trainer.strategy.reduce(sum_loss.to(device), reduce_op="sum").cpu()
            if composed:
                both = trainer.strategy.reduce(torch.cat([count.long(), stats]).to(device), reduce_op="sum").cpu()
                count, stats = both[: count.numel()], both[count.numel() :]
            else:
                count = trainer.strategy.reduce(count.to(device), reduce_op="sum").cpu()
        ib.finalize(sum_loss, count, self.score, self.seen, self.momentum)
        self.sum_loss.zero_()
        self.count.zero_()
        if not composed:  # the tokens of the epoch's samples (effi_baseline)
            pending = self.pending_tokens
            if world > 1:
                assert trainer is not None
                pending = trainer.strategy.reduce(pending.to(device), reduce_op="sum").cpu()
            ib.merge_tokens(self.sample_tokens, pending)
            self.pending_tokens.zero_()
        if composed:
            if self.history and self.history[-1]["epoch"] == self.table_epoch:
                h = self.history[-1]
                for key, value in zip(("drawn", "saved", "tail"), stats.tolist()):
                    h[key] += int(value)
            self.thin_stats = torch.zeros(3, dtype=torch.int64)
            self.synced_epoch = self.table_epoch

    # --------------------------------------------------------------------------- composed with the curriculum
    def thin_stop(self) -> int | None:
        """Composed mode: the last curriculum step that is thinned, ``floor(δ·T)``
        (:func:`~lightning_effi.infobatch.functional.thin_stop_step`), ``T`` the run's optimizer steps: the smallest of
        ``trainer.max_steps``, the curriculum's sample budget (``controller.total_steps``) and ``max_epochs`` data
        epochs of the curriculum (``limit_train_batches`` applied;
        :func:`~lightning_effi.core.progress.run_length`). None before the curriculum's
        controller exists."""
        if self._stop_step is None:
            controller = self.curriculum_dm.controller if self.curriculum_dm is not None else None
            if controller is None or self._trainer is None:
                return None
            budget = controller.total_steps
            max_epochs = self._trainer.max_epochs
            if max_epochs is not None and max_epochs > 0:  # Lightning epochs of limit_train_batches micro-batches
                micro = ib.limited_batches(controller.epoch_micro, self._trainer.limit_train_batches)
                budget = min(budget, max_epochs * max(1, -(-micro // controller.ga)))
            total = run_length(self._trainer.max_steps, budget)
            assert total is not None  # the budget is at least one step
            self._stop_step, self._run_steps = ib.thin_stop_step(total, self.delta), total
        return self._stop_step

    def prepare_epoch(self, epoch: int) -> Tensor:
        """Composed mode: the well-learned set of Lightning epoch ``epoch``, ``bool[N]``: ``seen & (score <
        mean(score[seen]))`` of the table as it stands at the epoch's start
        (:func:`~lightning_effi.infobatch.functional.split_well_learned`, as the epoch plans use). Frozen for the
        epoch: computed once (at ``on_train_epoch_start``, or at the epoch's first micro-batch after a mid-epoch
        resume, where the table still is the one of the epoch's start).

        Losses still pending from a finished epoch are merged first (after a resume from a checkpoint written at an
        epoch's last batch, whose ``on_train_epoch_end`` Lightning does not run again): the same rule as
        :meth:`plan_for`. The decision to merge depends on checkpointed state only (``table_epoch``,
        ``synced_epoch``), so every rank takes the collective at the same point."""
        if self._mask is not None and self._mask_epoch == epoch:
            return self._mask
        if self.table_epoch != epoch:
            if self.table_epoch >= 0 and self.synced_epoch != self.table_epoch:
                self.sync_scores(self._trainer)
            self.table_epoch = epoch
            tau, mask = ib.split_well_learned(self.score, self.seen)
            self.history.append(
                {"epoch": epoch, "kind": "thin", "threshold": tau, "well_learned": int(mask.sum())}
                | {"drawn": 0, "saved": 0, "tail": 0}
            )
        else:  # resumed mid-epoch: the table has not changed since the epoch's start
            _, mask = ib.split_well_learned(self.score, self.seen)
        self._mask, self._mask_epoch = mask, epoch
        return mask

    def thin_keys(self, keys: list[tuple], rank: int) -> list[tuple]:
        """Composed mode, called by the curriculum's sampler for each micro-batch slice of this rank: keys ``(index,
        step, micro_idx, difficulties)`` in, the kept keys with ``(weight, candidates)`` appended out
        (:func:`~lightning_effi.infobatch.functional.thin_micro_batch` with the epoch's well-learned set and
        :func:`~lightning_effi.infobatch.functional.thin_generator` ``(seed, step, micro_idx, rank)``). Steps after
        :meth:`thin_stop` keep every key with weight 1. Pure given the epoch's frozen set, so a sampler running ahead
        of training (prefetch) and a resumed run thin identically; the figures are counted when a batch trains."""
        if not keys:
            return keys
        b = len(keys)
        step, micro = int(keys[0][1]), int(keys[0][2])
        stop = self.thin_stop()
        if stop is None:
            raise RuntimeError("InfoBatchCallback: thin_keys called before the curriculum's controller was attached")
        mask = self.prepare_epoch(self._trainer.current_epoch if self._trainer is not None else 0)
        if step > stop or self.prune_ratio == 0:
            return [(*k, 1.0, b) for k in keys]
        ids = torch.tensor([int(k[0]) for k in keys], dtype=torch.int64)
        thinned = ib.thin_micro_batch(ids, mask[ids], self.prune_ratio, ib.thin_generator(self.seed, step, micro, rank))
        kept = [k for k, keep in zip(keys, thinned.keep.tolist()) if keep]
        return [(*k, w, b) for k, w in zip(kept, thinned.weights.tolist())]

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """In a resumed fit, have the training loader built again once Lightning has restored the loops (one built
        earlier, by ``configure_optimizers`` reading ``trainer.estimated_stepping_batches``, would miss the
        checkpoint's mid-epoch position: :func:`~lightning_effi.core.compat.rebuild_train_loader_after_restore`)."""
        rebuild_train_loader_after_restore(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse the Lightning features visible only now (``core.requirements.check_started``). Resumed from a
        checkpoint written at an epoch's last batch, start the next epoch (of another length than the finished one)
        at its first batch (:func:`~lightning_effi.core.compat.restart_next_epoch_at_its_start`). Warn of step-interval
        LR schedules that still change after the steps the pruned run is expected to take
        (:meth:`_warn_unfinished_lr_schedules`). At step 0, an LR schedule on this callback's progress reads its first
        LR again (:func:`~lightning_effi.core.lr_schedules.refresh_progress_schedules`: it was read before the first
        epoch's plan, as 0.0)."""
        check_started(trainer)
        if trainer.global_step > 0 and not self._resumed:
            step = int(trainer.global_step)
            how = (
                f"added on resume at step {step}, from a checkpoint without InfoBatch state (written by a fit "
                "without this callback)"
                if getattr(trainer, "ckpt_path", None)
                else f"this fit starts at step {step} on a Trainer that trained before (a second trainer.fit on the "
                "same Trainer: InfoBatch plans one fit and does not continue into another)"
            )
            fixes = (
                "train with InfoBatch from the start, resume from a checkpoint written with it"
                if getattr(trainer, "ckpt_path", None)
                else "train the whole length in one fit (max_epochs), resume from a checkpoint of that fit"
            )
            raise ValueError(
                f"InfoBatchCallback: {how}. Its score table would start empty part-way through the run, its epochs "
                f"(num_epochs={self.num_epochs!r}, the annealing at the end) counted from epoch 0 of the run, and "
                f"the run's record would read as pruned from its start: {fixes}, or start a new fit from the "
                "checkpoint's weights (LightningModule.load_from_checkpoint) on a new Trainer without ckpt_path"
            )
        if self.curriculum_dm is None:
            restart_next_epoch_at_its_start(trainer)
            self._warn_unfinished_lr_schedules(trainer)
            if trainer.global_step == 0:  # the first epoch's plan is made: a schedule on effi_progress reads its LR
                missed = refresh_progress_schedules(c.scheduler for c in trainer.lr_scheduler_configs)
                if missed:
                    rank_zero_warn(
                        f"InfoBatchCallback: an LR schedule on InfoBatch's progress inside a {missed[0]}, before its "
                        "last scheduler, runs its first step at the LR read when it was built, before InfoBatch's "
                        "first epoch (progress 0: a warmup's LR 0); put it last, or give it the whole schedule "
                        "(warmup_cosine, one_cycle)"
                    )

    def _warn_unfinished_lr_schedules(self, trainer: pl.Trainer) -> None:
        """Warn, naming it and the multipliers, of each step-interval LR scheduler that still changes between the
        optimizer steps this run is expected to take (:meth:`expected_total_steps`, scaled to the Trainer's batches
        per epoch, capped by ``max_steps``) and ``trainer.estimated_stepping_batches`` (full epochs): the usual
        schedule sized with that estimate (a cosine to ``estimated_stepping_batches``) would stop before its end, the
        LR not decayed. Read without stepping (:func:`~lightning_effi.core.lr_schedules.multipliers_between`): a
        schedule on InfoBatch's progress (``effi_progress``) does not change with the step and is not warned of."""
        from lightning_effi.core.lr_schedules import multipliers_between

        configs = [c for c in trainer.lr_scheduler_configs if c.interval == "step"]
        estimate = trainer.estimated_stepping_batches
        batches = trainer.num_training_batches
        if not configs or not math.isfinite(estimate) or not math.isfinite(batches) or batches < 1:
            return
        t = self._datamodule.template() if self._datamodule is not None else None
        if t is None:
            return
        world, accumulate = trainer.world_size, accumulate_grad_batches_at(trainer, 0)
        pruned = self.expected_total_steps(int(t["batch_size"]), world, accumulate)
        full = self.epochs * math.ceil(
            math.ceil(math.ceil(self.dataset_size / world) / int(t["batch_size"])) / accumulate
        )
        expected = int(pruned * self.epochs * math.ceil(batches / accumulate) / full)
        if trainer.max_steps != -1:
            expected = min(expected, trainer.max_steps)
        estimate = int(estimate)
        if expected >= estimate:
            return
        for config in configs:
            every = max(1, int(config.frequency))
            if expected // every >= estimate // every:
                continue  # the scheduler steps every `every` optimizer steps: the same step count either way
            ends = multipliers_between(config.scheduler, expected // every, estimate // every)
            if ends is None:
                continue
            rank_zero_warn(
                f"{type(self).__name__}: the step-interval LR scheduler {type(config.scheduler).__name__} still "
                f"changes after the about {expected} optimizer steps this run is expected to take (pruned epochs; "
                f"trainer.estimated_stepping_batches counts {estimate}, full epochs): sized with that estimate, its "
                f"LR multiplier would end near {ends[0]:.3g} instead of {ends[1]:.3g}. Put it on InfoBatch's "
                "progress, which ends exactly at the run's last step: in configure_optimizers, progress = "
                "lightning_effi.core.progress.progress_source(self.trainer.callbacks), then lightning_effi.core."
                "lr_schedules.progress_lambda(optimizer, fn, progress) with your multiplier fn of progress in [0, 1], "
                "or warmup_cosine(optimizer, progress=progress, warmup_fraction=f, min_lr_ratio=0) for a cosine to 0 "
                "after your warmup's fraction f of the run (0: none); "
                + (
                    "for a timm scheduler, step it on that progress in lr_scheduler_step (scheduler.step_update("
                    "num_updates=round(progress() * scheduler.t_initial))); "
                    if callable(getattr(config.scheduler, "step_update", None))
                    else ""
                )
                + "or step it every epoch (interval='epoch'). See the LR schedules section of the InfoBatch README"
            )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.curriculum_dm is not None:
            self.prepare_epoch(trainer.current_epoch)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.sync_scores(trainer)
        self._close_epoch_share()
        self._log_epoch(pl_module)

    def _close_epoch_share(self) -> None:
        """Record, in the history entry of the plan's epoch, the share of its samples trained when it is below 1:
        an epoch ended before its plan did (``on_train_batch_start`` returned -1, an early stop), or
        with batches whose ``training_step`` returned None. Its saving counts by that share, as the
        EfficiencyMonitor counts the samples trained (the whole plan's was counted, 8 samples for 2.67, qa83-compat
        03; then its optimizer steps, which leave out the micro-batches of a window the cut left open, 2.67 for
        4.00, qa84-break 06 and qa86-break 01, and count a skipped batch, qa86-break 04). Called at the epoch's end,
        and before the next epoch's plan (a fit resumed from a checkpoint of an epoch's last batch skips that
        epoch's end)."""
        h = self.history[-1] if self.history and self.curriculum_dm is None else None
        if h is None or self.plan is None or h["epoch"] != self.plan.epoch or "share" in h:
            return
        share = self._epoch_share(h)
        if share < 1.0:
            h["share"] = share

    def _log_epoch(self, pl_module: pl.LightningModule) -> None:
        if not self.history:
            return
        if self.curriculum_dm is not None:
            self._log_thinned_epoch(pl_module)
            return
        h, n = self.history[-1], self.dataset_size
        saved, full = self._epoch_saving(h)
        metrics = {
            "effi/infobatch/well_learned_frac": h["well_learned"] / n,
            "effi/infobatch/kept_well_learned": float(h["kept_well_learned"]),
            "effi/infobatch/pruned_fraction_epoch": saved / max(1, full),
            # an epoch the module ended early counts by the share it trained, as totals() does
            "effi/infobatch/saved_samples_epoch": saved * float(h.get("share", 1.0)),
            "effi/infobatch/padded_samples_epoch": float(h["padded"]),
            **{f"effi/infobatch/{k}": float(v) for k, v in self.totals().items()},
            **self._nonfinite_metrics(),
        }
        if h["kind"] == "prune" and math.isfinite(h["threshold"]):  # a full epoch has none (no NaN in a CSV column)
            metrics["effi/infobatch/threshold"] = h["threshold"]
        for logger in pl_module.loggers if pl_module.trainer.is_global_zero else []:
            logger.log_metrics(metrics, step=logging_step(pl_module.trainer, epoch_end=True))

    def _log_thinned_epoch(self, pl_module: pl.LightningModule) -> None:
        h, n = self.history[-1], self.dataset_size
        metrics = {
            "effi/infobatch/well_learned_frac": h["well_learned"] / n,
            "effi/infobatch/pruned_fraction_epoch": h["saved"] / max(1, h["drawn"]),
            "effi/infobatch/saved_samples_epoch": float(h["saved"]),
            "effi/infobatch/drawn_samples_epoch": float(h["drawn"]),
            "effi/infobatch/unpruned_tail_batches_epoch": float(h["tail"]),
            **{f"effi/infobatch/{k}": float(v) for k, v in self.totals().items()},
            **self._nonfinite_metrics(),
        }
        if math.isfinite(h["threshold"]):  # epoch 0 has no scores yet (no NaN in a CSV column)
            metrics["effi/infobatch/threshold"] = h["threshold"]
        for logger in pl_module.loggers if pl_module.trainer.is_global_zero else []:
            logger.log_metrics(metrics, step=logging_step(pl_module.trainer, epoch_end=True))

    def _nonfinite_metrics(self) -> dict[str, float]:
        """``effi/nonfinite_losses`` (the run's non-finite training losses so far) when every technique of the run
        has ``nonfinite_loss="warn"``; nothing when one asks ``"raise"`` (the first one stops the fit)."""
        return nonfinite_metrics(getattr(self._trainer, "callbacks", None) or [self])

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Report the non-finite training losses counted (``nonfinite_loss="warn"``), on rank 0."""
        self.nonfinite_guard.report_at_end()

    def effi_before_summary(self, trainer: pl.Trainer) -> None:
        """At the fit's end, on every rank, before the summary is read (the EfficiencyMonitor calls it; so does
        :meth:`on_fit_end`): with the curriculum, merge the figures still pending from the last epoch. A fit resumed
        from the checkpoint of the run's last batch has no batch left (Lightning runs no epoch, no ``on_train_end``):
        its summary, and ResultWriter's record, left out the last data epoch's drawn and dropped samples
        (qa106-user 03). The decision rests on checkpointed state (``table_epoch``, ``synced_epoch``), as in
        :meth:`prepare_epoch`, so every rank takes the collective."""
        if self.curriculum_dm is not None and self.table_epoch >= 0 and self.synced_epoch != self.table_epoch:
            self.sync_scores(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.effi_before_summary(trainer)

    def _limited_samples(self, epoch_size: int) -> tuple[int, int] | None:
        """Under ``Trainer(limit_train_batches=...)``: ``(full, kept)``, the samples one rank trains in a full epoch
        and in an epoch of ``epoch_size`` samples, each cut by the limit
        (:func:`~lightning_effi.infobatch.functional.rank_samples`); None without a limit (or before the loader's
        settings are known)."""
        t = self._datamodule.template() if self._datamodule is not None else None
        trainer = self._trainer
        limit, world = (
            (trainer.limit_train_batches, trainer.world_size) if trainer is not None else self._ended_run or (1.0, 1)
        )
        if t is None or limit is None or (isinstance(limit, float) and limit == 1.0 and not t["drop_last"]):
            # without a limit, a loader keeping its last partial batch trains the plan (with its DDP duplicates);
            # with drop_last it trains the full batches only, a full epoch's too (the plan's pruned samples were
            # counted, 20 saved where the run trained 32 fewer, qa86-break 07)
            return None
        size, drop = int(t["batch_size"]), bool(t["drop_last"])
        full = ib.rank_samples(self.dataset_size, size, world, drop, limit)
        return full, ib.rank_samples(epoch_size, size, world, drop, limit)

    def _epoch_saving(self, h: dict[str, Any]) -> tuple[int, int]:
        """``(saved, full)`` samples of a history entry (all ranks): the plan's pruned samples and ``N``; under
        ``Trainer(limit_train_batches=...)``, the samples a full epoch trains under the limit less those the plan
        trains under it, and the former (a limited epoch may not reach the samples the plan left out)."""
        limited = self._limited_samples(int(h["size"]))
        if limited is None:
            return int(h["saved"]), self.dataset_size
        world = self._trainer.world_size if self._trainer is not None else (self._ended_run or (1.0, 1))[1]
        full, kept = (n * world for n in limited)
        return max(0, full - kept), full

    def _epoch_share(self, h: dict[str, Any]) -> float:
        """The share of the plan's epoch's samples trained so far (1.0 at the end of an epoch that trained every
        batch): the samples this rank trained (:attr:`samples_in_epoch`) times the ranks, over the samples the epoch
        trains in full (its plan and DDP duplicates; under ``drop_last`` or ``limit_train_batches`` the samples of
        the batches it keeps, :meth:`_limited_samples`). From a checkpoint written before that count was kept: its
        optimizer steps times the samples of a step, or the share of its steps when the loader is unknown."""
        world = self._trainer.world_size if self._trainer is not None else (self._ended_run or (1.0, 1))[1]
        if self.samples_in_epoch is not None:
            limited = self._limited_samples(int(h["size"]))
            epoch = limited[1] * world if limited is not None else int(h["size"]) + int(h["padded"])
            return min(1.0, self.samples_in_epoch * world / epoch) if epoch else 1.0
        steps, total = self.steps_in_epoch, max(1, self.steps_per_epoch)
        t = self._datamodule.template() if self._datamodule is not None else None
        if t is None or self._trainer is None:
            return min(1.0, steps / total)
        per_step = int(t["batch_size"]) * accumulate_grad_batches_at(self._trainer, int(h["epoch"])) * world
        epoch = min(int(h["size"]) + int(h["padded"]), total * per_step)
        return min(1.0, steps * per_step / epoch) if epoch else 1.0

    def totals(self) -> dict[str, float]:
        if self.curriculum_dm is not None:  # over the samples the curriculum drew (all ranks)
            saved = sum(h["saved"] for h in self.history)
            drawn = sum(h["drawn"] for h in self.history)
            return {"saved_samples_total": saved, "saved_fraction": saved / max(1, drawn)}
        # epochs past the run's (StochasticWeightAveraging's added forward-only epoch) are not training epochs; those
        # past InfoBatch's schedule (num_epochs < max_epochs, or a finished run extended) are, on the full data
        last = self._train_epochs
        history = self.history if last is None else [h for h in self.history if h["epoch"] < last]
        # an epoch that ended before its plan did counts by the share of its samples trained (on_train_epoch_end)
        shares = [float(h.get("share", 1.0)) for h in history]
        if history and self.plan is not None and history[-1]["epoch"] == self.plan.epoch and "share" not in history[-1]:
            # the epoch in progress counts by the share of its samples trained so far (an ended one has its share)
            shares[-1] = self._epoch_share(history[-1])
        per_epoch = [(s * share, f * share) for (s, f), share in zip(map(self._epoch_saving, history), shares)]
        saved = sum(s for s, _ in per_epoch)
        drawn = sum(f for _, f in per_epoch)
        return {"saved_samples_total": saved, "saved_fraction": saved / drawn if drawn else 0.0}

    def effi_schedule_state(self) -> dict[str, float]:
        """``{"kept_fraction": f}``: the fraction of the current epoch's samples that are trained (1.0 in a full
        epoch; with the curriculum, of the samples drawn so far this epoch: the epoch's merged figures and this
        rank's since the last merge, which the epoch's end adds to them). Empty before the first epoch's plan."""
        if not self.history:
            return {}
        h = self.history[-1]
        if h["kind"] == "thin":
            pending = self.thin_stats.tolist() if self.synced_epoch != h["epoch"] else [0, 0, 0]
            drawn, saved = h["drawn"] + pending[0], h["saved"] + pending[1]
            return {"kept_fraction": 1.0 - saved / drawn if drawn else 1.0}
        drawn = h["saved"] + h["size"]
        return {"kept_fraction": h["size"] / drawn if drawn else 1.0}

    def effi_summary(self) -> dict[str, Any]:
        """Figures for :class:`~lightning_effi.core.accounting.EfficiencyMonitor`'s summary (with the curriculum:
        samples drawn by the curriculum and dropped by InfoBatch, summed over ranks and merged epochs)."""
        t = self.totals()
        if self.curriculum_dm is not None:
            return {
                "infobatch/saved_samples": int(t["saved_samples_total"]),
                "infobatch/saved_fraction": t["saved_fraction"],
                "infobatch/drawn_samples": int(sum(h["drawn"] for h in self.history)),
                "infobatch/unpruned_tail_batches": int(sum(h["tail"] for h in self.history)),
                "infobatch/thin_stop_step": self.thin_stop(),
                "infobatch/nonfinite_losses": self._run_nonfinite(),
            }
        return {
            "infobatch/saved_samples": int(t["saved_samples_total"]),
            "infobatch/saved_fraction": t["saved_fraction"],
            "infobatch/padded_samples": int(sum(h["padded"] for h in self.history)),
            "infobatch/prune_epochs": sum(h["kind"] == "prune" for h in self.history),
            "infobatch/nonfinite_losses": self._run_nonfinite(),
        }

    def _run_nonfinite(self) -> int:
        """The run's non-finite training losses (``nonfinite_loss="warn"``): one check runs per backward pass, by the
        first guarded callback of the Trainer (maybe not this one), so the count is the sum over the Trainer's
        guards (this callback's own before setup or after teardown)."""
        return nonfinite_count(getattr(self._trainer, "callbacks", None) or [self])

    def expected_total_steps(self, batch_size: int, world_size: int = 1, accumulate_grad_batches: int = 1) -> int:
        """An estimate of the run's optimizer steps from the current score table (before any score: ``r/2`` of each
        prune epoch pruned). An estimate, not a bound: the scores decide each prune epoch's size, so the run can take
        more steps than this (up to ``trainer.estimated_stepping_batches``, its full epochs) or fewer (down to
        :meth:`effi_min_total_steps`). Never size a schedule that fails past its end with it (torch's ``OneCycleLR``
        raises "Tried to step"; a step-interval ``OneCycleLR`` is refused at train start): use a schedule on
        InfoBatch's progress (:meth:`effi_progress`, e.g. :func:`lightning_effi.core.lr_schedules.one_cycle`), which
        ends exactly at the run's end.

        Raises:
            ValueError: composed with the curriculum (the curriculum's steps are the run's steps)."""
        if self.curriculum_dm is not None:
            raise ValueError(
                "InfoBatchCallback.expected_total_steps: with the curriculum, thinning does not change the number of "
                "steps; the curriculum's controller.total_steps and the Trainer's max_steps give it"
            )
        n, stop = self.dataset_size, ib.epoch_stop(self.epochs, self.delta)
        seen_any = bool(self.seen.any())
        frac = ib.expected_saving(self.score, self.seen, self.prune_ratio) if seen_any else self.prune_ratio / 2
        steps = 0
        for e in range(self.epochs):
            size = n if e == 0 or e >= stop else round(n * (1 - frac))
            steps += math.ceil(math.ceil(math.ceil(size / world_size) / batch_size) / accumulate_grad_batches)
        return steps

    # ---------------------------------------------------------------------------------------------- state
    def config(self) -> dict[str, Any]:
        if self.curriculum_dm is not None:
            return {
                "dataset_size": self.dataset_size,
                "prune_ratio": self.prune_ratio,
                "delta": self.delta,
                "num_epochs": None,
                "seed": self.seed,
                "momentum": self.momentum,
                "within": "curriculum",
                "micro_batch_size": self.micro_batch_size,
                "thin_stop_step": self.thin_stop(),
            }
        return {
            "dataset_size": self.dataset_size,
            "prune_ratio": self.prune_ratio,
            "delta": self.delta,
            "num_epochs": self.epochs,
            "seed": self.seed,
            "momentum": self.momentum,
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self.config(),
            "score": self.score.clone(),
            "seen": self.seen.clone(),
            "sum_loss": self.sum_loss.clone(),
            "count": self.count.clone(),
            "plan": self.plan.to_state() if self.plan is not None else {},
            "steps_in_epoch": self.steps_in_epoch,
            "samples_in_epoch": self.samples_in_epoch,
            "history": [dict(h) for h in self.history],
            "nonfinite_loss": self.nonfinite_guard.state_dict(),
            "table_epoch": self.table_epoch,
            "synced_epoch": self.synced_epoch,
            "thin_stats": self.thin_stats.clone(),
            "sample_tokens": self.sample_tokens.clone(),
            "pending_tokens": self.pending_tokens.clone(),
            # the automatic path's detections, so that a resumed run trains the same reduction (qa40-break 04)
            "causal_shift": self._shift,
            "token_mean": self._token_mean,
        }

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Write the pending accumulators of ALL ranks (the losses recorded since the last score sync, and the
        thinning counters): a checkpoint holds rank 0's callback state only, so each rank's own would be lost (and
        rank 0's counted once per rank) on a mid-epoch resume. Summed over ranks here (Lightning builds the checkpoint
        on every rank, before rank 0 writes it: the collectives run everywhere); on load rank 0 takes the sums and the
        other ranks start from zero, so the next sync gives what the uninterrupted run's would have."""
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if not isinstance(state, dict):
            return
        if trainer.world_size > 1:
            device = trainer.strategy.root_device
            # a copy: the reduction is in place, and this rank goes on accumulating its own losses
            state["sum_loss"] = trainer.strategy.reduce(self.sum_loss.clone().to(device), reduce_op="sum").cpu()
            counts = torch.cat([self.count.long(), self.thin_stats.long()]).to(device)
            counts = trainer.strategy.reduce(counts, reduce_op="sum").cpu()
            state["count"] = counts[: self.count.numel()].to(self.count.dtype)
            state["thin_stats"] = counts[self.count.numel() :].to(self.thin_stats.dtype)
            pending = self.pending_tokens.clone().to(device)
            state["pending_tokens"] = trainer.strategy.reduce(pending, reduce_op="sum").cpu()
        state["pending_over_ranks"] = True

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Lightning calls this right before :meth:`load_state_dict` whenever a checkpoint is restored, for ``fit``
        (a resumed run) and for ``validate`` / ``test`` / ``predict`` (``ckpt_path=...``). Outside ``fit`` note it
        (the state is then ignored, see :meth:`load_state_dict`) and check nothing: InfoBatch changes only training,
        so the checkpoint's weights evaluate as they are, whatever InfoBatch settings wrote it. For ``fit``, detect
        a checkpoint written by an InfoBatch callback with other identity arguments (its state is stored under
        another ``state_key`` and would otherwise be ignored silently).

        Raises:
            ValueError: (``fit``, ``strict``) the checkpoint holds an InfoBatch state under another ``state_key``
                (``strict=False``: a warning, and that state is loaded as this callback's).
            IncompatibleTechniques: (``fit``) a resume under a strategy that restores checkpoints after setup (FSDP).
        """
        self._evaluating = trainer.state.fn != TrainerFn.FITTING
        if self._evaluating:
            return
        check_coarse_vcycle_resume(type(self).__name__, trainer, checkpoint)
        epoch, step = checkpoint.get("epoch"), checkpoint.get("global_step")
        self._checkpoint_epoch = int(epoch) if is_int(epoch) and epoch >= 0 else None
        self._checkpoint_step = int(step) if is_int(step) and step >= 0 else None
        if trainer.strategy.restore_checkpoint_after_setup:
            raise IncompatibleTechniques(
                f"InfoBatchCallback cannot resume a fit under the {type(trainer.strategy).__name__} strategy: "
                "Lightning restores its checkpoints only after setup and on_fit_start "
                "(restore_checkpoint_after_setup), later than InfoBatch's resume needs (its epoch plan is built "
                "from the restored scores at setup); resume on a single device or with strategy='ddp', or start a "
                "fresh fit (fresh FSDP fits are supported)"
            )
        if others := other_state_keys(self, checkpoint):
            config_mismatch(
                type(self).__name__,
                f"the checkpoint was written with other settings ({others[0]}), not {self.state_key}",
                self.strict,
                fix="resume its scores and plan with this configuration",
            )
            # strict=False: the other settings' state is this callback's (load_state_dict compares the rest)
            checkpoint["callbacks"][self.state_key] = checkpoint["callbacks"][others[0]]

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the tables, plan, accumulators and counters of a resumed ``fit`` (mid-epoch too).

        Outside ``fit`` (``trainer.validate/test/predict(ckpt_path=...)``, told by :meth:`on_load_checkpoint`) the
        state is ignored entirely: no configuration comparison (the evaluating Trainer never ran this callback's
        ``setup``, so its dataset size and epochs are unknown) and no change to this callback's state (e.g. that of
        the fit that ran before on the same Trainer). Evaluation does not involve InfoBatch, so the numbers are
        those of a Trainer without it.

        Every field is validated before anything is restored (:func:`validate_state`; a damaged or edited
        checkpoint changes nothing). A checkpoint written before the non-finite loss policy carries the count as
        ``"nonfinite"`` (an int): it becomes the count of ``nonfinite_guard``.

        Raises:
            ValueError: (``fit``, ``strict``) the checkpoint was written with other settings (``prune_ratio``,
                ``delta``, ``seed``, ``num_epochs``, ...); (``fit``) another dataset size (whatever ``strict``: the
                score table is per sample), a field that is missing, of the wrong type, shape or size, or out of range
                (:func:`validate_state`, naming the field).
        """
        if self._evaluating:
            self._evaluating = False
            return
        checkpoint_epoch, self._checkpoint_epoch = self._checkpoint_epoch, None
        if not isinstance(state_dict.get("config"), Mapping):
            raise ValueError(
                f"InfoBatchCallback: the checkpoint's config must be a dict of settings, got "
                f"{_brief(state_dict.get('config'))} (a damaged or edited checkpoint: resume from another one)"
            )
        diff = settings_diff(state_dict["config"], self.config())
        if "dataset_size" in diff:
            saved_n, n = diff["dataset_size"]
            raise ValueError(
                f"InfoBatchCallback: the checkpoint's state is for a training set of {saved_n} samples, this fit's "
                f"has {n}: its score table holds one score per sample, so it cannot resume on another training set "
                "(strict=False does not apply); resume on the training set it was written on, or start a fresh fit"
            )
        step, self._checkpoint_step = self._checkpoint_step, None
        if diff and self._extends_finished(state_dict["config"], diff, checkpoint_epoch, step):
            diff = {}
        if diff:
            config_mismatch(
                type(self).__name__,
                f"the checkpoint was written with other settings (checkpoint, now): {diff}",
                self.strict,
                fix="resume anyway (the pruning is planned again for this run's length: epochs the checkpoint's run "
                "annealed can be pruned again)"
                if {"num_epochs", "thin_stop_step"} & set(diff)
                else "resume anyway",
            )
        validate_state(state_dict, self.dataset_size, checkpoint_epoch)
        guard = NonFiniteLossGuard(type(self).__name__, self.nonfinite_guard.policy)
        if isinstance(state_dict.get("nonfinite_loss"), Mapping):
            guard.load_state_dict(dict(state_dict["nonfinite_loss"]))
        elif "nonfinite" in state_dict:  # a checkpoint written before the non-finite loss policy
            guard.count = int(state_dict["nonfinite"])
        self.score = state_dict["score"].clone()
        self.seen = state_dict["seen"].clone()
        self.sum_loss = state_dict["sum_loss"].clone()
        self.count = state_dict["count"].clone()
        self.plan = ib.EpochPlan.from_state(state_dict["plan"]) if state_dict["plan"] else None
        self.steps_in_epoch = int(state_dict["steps_in_epoch"])
        samples = state_dict.get("samples_in_epoch")  # absent from a checkpoint written before it was kept
        self.samples_in_epoch = None if samples is None else int(samples)
        self.history = [dict(h) for h in state_dict["history"]]
        self.nonfinite_guard.count, self.nonfinite_guard.first_step = guard.count, guard.first_step
        self.table_epoch = int(state_dict.get("table_epoch", -1))
        self.synced_epoch = int(state_dict.get("synced_epoch", -1))
        self.thin_stats = state_dict.get("thin_stats", torch.zeros(3, dtype=torch.int64)).clone()
        self._shift = state_dict.get("causal_shift", self._shift)
        self._token_mean = state_dict.get("token_mean", self._token_mean)
        n = self.dataset_size  # a checkpoint written before the token table: every sample's tokens unknown
        self.sample_tokens = state_dict.get("sample_tokens", torch.full((n,), -1.0)).double().clone()
        self.pending_tokens = state_dict.get("pending_tokens", torch.zeros(2, n)).double().clone()
        self._token_ratio = None
        if state_dict.get("pending_over_ranks") and self._trainer is not None and self._trainer.global_rank > 0:
            self.sum_loss.zero_()  # rank 0 holds every rank's pending sums (see on_save_checkpoint)
            self.count.zero_()
            self.thin_stats.zero_()
            self.pending_tokens.zero_()
        self._mask, self._mask_epoch = None, -1  # recomputed from the restored table
        self._resumed = True

    def _extends_finished(
        self, saved: Mapping[str, Any], diff: Mapping[str, Any], epoch: int | None, step: int | None
    ) -> bool:
        """A run resumed with another length (``num_epochs``, the only difference) whose epochs so far are those a
        run of that length trains, announced; False otherwise (the difference is then refused, or warned about under
        ``strict=False``):

        - the checkpoint is in or past its annealing epochs (``epoch >= floor(delta * num_epochs)``; with the
          curriculum, past its last thinned step), and the run is longer (the README's "to extend a finished run
          raise ``trainer.max_epochs``"): the checkpoint's schedule is kept, so every further epoch trains the full
          data (planning it again would prune epochs after the annealing);
        - the checkpoint's epoch is pruned under both lengths (``epoch < floor(delta * E)`` for the old and the new
          ``E``): the pruning of an epoch does not depend on ``E``, only where the annealing starts, so the resumed
          run is the run of the new length, which anneals from its own ``floor(delta * E)``.
        """
        name = type(self).__name__
        if set(diff) == {"num_epochs"} and epoch is not None and is_int(saved["num_epochs"]):
            stop = ib.epoch_stop(int(saved["num_epochs"]), self.delta)
            if epoch < stop:
                new_stop = ib.epoch_stop(self.epochs, self.delta)
                if epoch >= new_stop:
                    return False  # the checkpoint's pruned epoch would be an annealing epoch of the new length
                rank_zero_info(
                    f"{name}: the checkpoint's run ({saved['num_epochs']} epochs) was still pruning (epoch {epoch}, "
                    f"annealing from epoch {stop}); its epochs so far are those of a run of {self.epochs} epochs, "
                    f"which this run now is: it prunes until epoch {new_stop} and anneals from there"
                )
                return True
            rank_zero_info(
                f"{name}: the checkpoint's run ({saved['num_epochs']} epochs) had ended its pruning (annealing from "
                f"epoch {stop}, the checkpoint's epoch {epoch}); this longer run keeps that schedule, so every further "
                f"epoch trains the full data (num_epochs={saved['num_epochs']})"
            )
            self.epochs = int(saved["num_epochs"])
            return True
        if set(diff) == {"thin_stop_step"} and step is not None and is_int(saved["thin_stop_step"]):
            if step < int(saved["thin_stop_step"]):
                return False
            rank_zero_info(
                f"{name}: the checkpoint's run had thinned its last step ({saved['thin_stop_step']}) by step {step}; "
                "this longer run keeps that schedule, so every further step trains each drawn sample"
            )
            self._stop_step = int(saved["thin_stop_step"])
            return True
        return False


def _brief(value: Any) -> str:
    """``value`` for an error message: a tensor by its shape and dtype, anything else by its (short) repr."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_state(state: Mapping[str, Any], dataset_size: int, checkpoint_epoch: int | None = None) -> None:
    """Check an :class:`InfoBatchCallback` checkpoint state (:meth:`InfoBatchCallback.state_dict`) field by field, as
    the constructor checks its arguments, before anything is restored. A pure function.

    Args:
        state: the state as loaded. dataset_size: ``N``, the training set of the resumed fit.
        checkpoint_epoch: the Lightning epoch the checkpoint was written in (its ``"epoch"``), or None (unknown: the
            epoch fields are then only checked to be ``>= -1``).

    Fields (``N`` = ``dataset_size``; ``e`` = ``checkpoint_epoch``): ``score`` float ``[N]``, finite where seen;
    ``seen`` bool ``[N]``; ``sum_loss`` float ``[N]``, finite; ``count`` integer ``[N]``, ``>= 0``; ``plan`` ``{}``
    or an :class:`~lightning_effi.infobatch.functional.EpochPlan` state over ``N`` samples of an epoch ``<= e``;
    ``steps_in_epoch`` int ``>= 0``; ``history`` a list of dicts; ``table_epoch`` int in ``[-1, e]`` (the epoch whose
    start the score table stands for: never after the checkpoint's own); ``synced_epoch`` int in ``[-1,
    table_epoch]``; ``thin_stats`` integer ``[3]``, ``>= 0``; ``sample_tokens`` float ``[N]``, in ``[0, 2**53]``
    or ``-1``; ``pending_tokens`` float ``[2, N]``, ``>= 0``, whole counts, sums ``<= 2**53`` per count;
    ``causal_shift``, ``token_mean`` (the automatic per-sample loss's detections) None or a bool;
    ``pending_over_ranks`` a bool;
    ``nonfinite`` (checkpoints written before the non-finite
    loss policy) int ``>= 0``; ``nonfinite_loss`` a dict (checked by
    :meth:`~lightning_effi.core.nonfinite.NonFiniteLossGuard.load_state_dict`). The last ten may be absent (older
    checkpoints).

    Raises:
        ValueError: a field missing, of the wrong type, shape or size, or out of range; the message names the field
            (``InfoBatchCallback: the checkpoint's <field> ...``) and what is allowed.
    """
    owner, damaged = "InfoBatchCallback", " (a damaged or edited checkpoint: resume from another one)"

    def refuse(field: str, allowed: str, value: Any) -> ValueError:
        return ValueError(f"{owner}: the checkpoint's {field} must be {allowed}, got {_brief(value)}{damaged}")

    n = int(dataset_size)
    missing = [k for k in ("score", "seen", "sum_loss", "count", "plan", "steps_in_epoch", "history") if k not in state]
    if missing:
        raise ValueError(f"{owner}: the checkpoint's state lacks {missing}{damaged}")
    score, seen, sum_loss, count = (state[k] for k in ("score", "seen", "sum_loss", "count"))
    if not isinstance(score, Tensor) or score.dim() != 1 or not score.is_floating_point():
        raise refuse("score", f"a float tensor of shape ({n},)", score)
    if len(score) != n:
        raise ValueError(f"{owner}: the checkpoint's score table has {len(score)} entries, the training set {n}")
    if not isinstance(seen, Tensor) or seen.dtype != torch.bool or tuple(seen.shape) != (n,):
        raise refuse("seen", f"a bool tensor of shape ({n},)", seen)
    bad = seen & ~torch.isfinite(score)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"{owner}: the checkpoint's score of seen sample {i} is {float(score[i])}; a seen score must be finite "
            f"({int(bad.sum())} are not){damaged}"
        )
    if not isinstance(sum_loss, Tensor) or not sum_loss.is_floating_point() or tuple(sum_loss.shape) != (n,):
        raise refuse("sum_loss", f"a float tensor of shape ({n},)", sum_loss)
    if not bool(torch.isfinite(sum_loss).all()):
        raise refuse("sum_loss", "finite everywhere (pending losses are finite)", sum_loss)
    integer = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    if not isinstance(count, Tensor) or count.dtype not in integer or tuple(count.shape) != (n,):
        raise refuse("count", f"an integer tensor of shape ({n},)", count)
    if bool((count < 0).any()):
        raise refuse("count", "an integer tensor >= 0 everywhere", count)
    top = "" if checkpoint_epoch is None else f", <= the checkpoint's epoch {checkpoint_epoch}"
    plan_state = state["plan"]
    if not isinstance(plan_state, Mapping):
        raise refuse("plan", "an epoch plan's state or {}", plan_state)
    if plan_state:
        try:
            plan = ib.EpochPlan.from_state(dict(plan_state))
        except (KeyError, ValueError, TypeError, AttributeError) as err:
            raise ValueError(f"{owner}: the checkpoint's plan is not a valid epoch plan ({err!r}){damaged}") from None
        if plan.dataset_size != n:
            raise refuse("plan", f"a plan over the {n} samples of the training set", f"{plan.dataset_size} samples")
        if checkpoint_epoch is not None and plan.epoch > checkpoint_epoch:
            raise refuse("plan", f"the plan of an epoch{top}", f"the plan of epoch {plan.epoch}")
    steps = state["steps_in_epoch"]
    if not is_int(steps) or steps < 0:
        raise refuse("steps_in_epoch", "an int >= 0 (optimizer steps taken in the plan's epoch)", steps)
    samples = state.get("samples_in_epoch")
    if samples is not None and (not is_int(samples) or samples < 0):
        raise refuse("samples_in_epoch", "None or an int >= 0 (samples this rank trained in the plan's epoch)", samples)
    history = state["history"]
    if not isinstance(history, list) or not all(isinstance(h, Mapping) for h in history):
        raise refuse("history", "a list of dicts (one per planned epoch)", history)
    table_epoch = state.get("table_epoch", -1)
    if not is_int(table_epoch) or table_epoch < -1 or (checkpoint_epoch is not None and table_epoch > checkpoint_epoch):
        raise refuse("table_epoch", f"an int >= -1{top} (-1: no epoch yet)", table_epoch)
    synced = state.get("synced_epoch", -1)
    if not is_int(synced) or not -1 <= synced <= table_epoch:
        raise refuse("synced_epoch", f"an int in [-1, table_epoch={table_epoch}]", synced)
    for key in ("causal_shift", "token_mean"):
        if state.get(key) is not None and not isinstance(state.get(key), bool):
            raise refuse(key, "None (not detected yet) or a bool", state.get(key))
    # present: a tensor (None passed here and failed at restore with a bare AttributeError, qa92-break 04)
    stats = state.get("thin_stats")
    if "thin_stats" in state and (
        not isinstance(stats, Tensor)
        or stats.dtype not in integer
        or tuple(stats.shape) != (3,)
        or bool((stats < 0).any())
    ):
        raise refuse("thin_stats", "an integer tensor of shape (3,), >= 0 (drawn, dropped, capped)", stats)
    tokens = state.get("sample_tokens")
    if "sample_tokens" in state and (
        not isinstance(tokens, Tensor)
        or not tokens.is_floating_point()
        or tuple(tokens.shape) != (n,)
        or not bool(torch.isfinite(tokens).all())
        or bool(((tokens < 0) & (tokens != -1)).any())
        or bool((tokens > MAX_SAMPLE_TOKENS).any())
    ):
        raise refuse("sample_tokens", f"a float tensor of shape ({n},), in [0, 2**53], or -1 (not yet trained)", tokens)
    pending = state.get("pending_tokens")
    if "pending_tokens" in state and (
        not isinstance(pending, Tensor)
        or not pending.is_floating_point()
        or tuple(pending.shape) != (2, n)
        or not bool(torch.isfinite(pending).all())
        or bool((pending < 0).any())
        or bool((pending[1] != pending[1].round()).any())
        or bool((pending[0] > MAX_SAMPLE_TOKENS * pending[1]).any())
    ):
        raise refuse(
            "pending_tokens",
            f"a float tensor of shape (2, {n}), >= 0: token sums of at most 2**53 per count, whole counts",
            pending,
        )
    if "pending_over_ranks" in state and not isinstance(state["pending_over_ranks"], bool):
        raise refuse(
            "pending_over_ranks", "a bool (the pending counts are summed over ranks)", state["pending_over_ranks"]
        )
    if "nonfinite" in state and (not is_int(state["nonfinite"]) or state["nonfinite"] < 0):
        raise refuse("nonfinite", "an int >= 0 (the non-finite losses counted)", state["nonfinite"])
    guard = state.get("nonfinite_loss")
    if guard is not None:
        if not isinstance(guard, Mapping):
            raise refuse("nonfinite_loss", "a dict (the non-finite loss count)", guard)
        NonFiniteLossGuard(owner).load_state_dict(dict(guard))


InfoBatch = InfoBatchCallback  # short alias (``lightning_effi.callbacks.InfoBatch``)
