"""``RandomLTDCallback``: random layerwise token dropping for any transformer LightningModule.

Yao et al., "Random-LTD: Random and Layerwise Token Dropping Brings Efficient Training for Large-scale Transformers"
(NeurIPS 2022, arXiv 2211.11586), Sec. 3; DeepSpeed Data Efficiency (Li et al., arXiv 2212.03597); reference
``deepspeed/runtime/data_pipeline/data_routing/``. The method card is ``README.md`` beside this file.

The method lives in :mod:`lightning_effi.random_ltd.functional` (selection, gather/scatter, schedule, accounting) and
:mod:`lightning_effi.random_ltd` (layer patching); this callback wires them into Lightning:

- ``setup("fit")``: checks the combination with the other technique callbacks
  (:func:`~lightning_effi.core.requirements.check_trainer`), finds the one trainable transformer through an adapter
  (``hf_gpt2``, ``hf_bert``, ``timm_vit``, ``torch_transformer``, or a
  :class:`~lightning_effi.adapters.GenericAdapter`; under ``model_attr`` when given), validates ``layer_ids`` and the
  schedule, and patches the selected layers' ``forward`` on the instance (before DDP wrapping and before checkpoint
  weights load; ``state_dict`` keys are unchanged). ``teardown`` restores them, and so does ``on_exception`` when the
  fit raises (Lightning skips ``teardown`` then). A module that an earlier fit left patched (one whose
  ``on_exception`` never ran) is restored at ``setup``, with a warning; one patched by a fit still running (another
  Trainer's) or by hand is an error. Before reading the network, ``setup`` lets a technique that replaces it put back
  a full-size network an earlier fit of it left coarse (the V-cycle's ``effi_restore_network``).
- ``on_train_start``: checks the model's ``max_sequence_length`` against the sequence length peeked from the
  training data where the adapter can tell it (``min_value`` / ``max_value`` / ``seq_per_step`` are checked at the
  first training forward, against the positions the patched layers see);
  resolves a derived ``require_steps`` (a fraction or epochs) in optimizer steps, or, when a
  technique that shortens the epochs provides the run's progress clock (InfoBatch,
  :func:`~lightning_effi.core.progress.progress_clock`), as a share of its training progress; warns when the growth
  is longer than the run.
- ``on_before_backward``: the non-finite loss policy (``nonfinite_loss``, :mod:`lightning_effi.core.nonfinite`).
- ``on_train_batch_start``: a fresh index context keyed by ``(global_step, batch_idx)``, seeded with ``(seed, step,
  batch_idx, rank)``; its reserved length ``r`` for ``trainer.global_step`` (or the clock's progress; all
  micro-batches of one optimizer step share it) is read by the first LTD layer of the forward, with the sequence
  length it sees (``max_value=None``: the schedule ends at the length the layers see).
- ``on_before_optimizer_step``: adds the step's layer-tokens (summed over micro-batches and ranks) to
  ``consumed_layer_tokens``, before a step-interval LR scheduler reads it.
- ``effi_adjust``: lowers the :class:`~lightning_effi.core.accounting.EfficiencyMonitor`'s layer-tokens and FLOPs.
- ``effi_before_model_change`` / ``effi_after_model_change``
  (:class:`~lightning_effi.core.protocols.FollowsModelChanges`): a technique that replaces the network (the V-cycle)
  calls them around every change: the patched layers are restored, then the adapter is found again on the new
  network, the LTD layer ids are resolved for its depth and its layers are patched; the schedule (a function of
  ``global_step``) and the counters go on.
- ``state_dict``: counters and the resolved configuration (safe-loadable); the schedule and the draws are pure
  functions of the step (or of the clock's checkpointed progress), so a resumed run continues exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import sys
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_effi.core.accounting import BatchStats, EfficiencyMonitor
from lightning_effi.core.batch import batch_meta, unwrap
from lightning_effi.core.checks import check_bool, check_choice, check_int, check_real, is_int, is_real
from lightning_effi.core.compat import rebuild_train_loader_after_restore
from lightning_effi.core.features import optimized_parameters
from lightning_effi.core.flops import sdpa_recomputes
from lightning_effi.core.hook_ids import reserve_hook_ids
from lightning_effi.core.lr_schedules import TotalNotKnownError
from lightning_effi.core.measure import (
    FlopsMeter,
    MeasureError,
    WeakHook,
    _in_backward,
    block_runners,
    combined_parts,
    derived_from,
    find_batch_size,
    forward_trains,
    key_padding_mask,
    leaf_name,
    length_stem,
    mask_tokens,
    pass_input,
    same_values,
    share_a_residue,
    storage_ref,
    structure_key,
    tensor_leaves,
    token_source,
)
from lightning_effi.core.nonfinite import NonFiniteLossGuard
from lightning_effi.core.progress import (
    PROGRESS_TICKS,
    Duration,
    StepsPerBatchCheck,
    accumulate_grad_batches_at,
    accumulation_segments,
    clock_epochs,
    estimated_optimizer_steps,
    exact_progress_done,
    progress_clock,
    run_length,
    shorter_than_resolved,
    steps_of_epochs,
    steps_per_epoch,
)
from lightning_effi.core.protocols import PlansModelChanges, ProvidesProgressClock
from lightning_effi.core.requirements import BATCH_STRUCTURES, Requirements, check_started, check_trainer
from lightning_effi.core.settings import KeepsSettings, apply_changed_settings, given_settings, keep_settings
from lightning_effi.core.state import (
    check_coarse_vcycle_resume,
    config_mismatch,
    open_batch_skipped,
    other_state_keys,
    settings_diff,
    state_key_fields,
)
from lightning_effi.core.wrapping import live_fit, wrapper_chain
from lightning_effi.models.base import (
    TransformerAdapter,
    deferred_network_hint,
    find_adapter,
    find_candidates,
    resolve_attr,
)
from lightning_effi.models.generic import TORCH_LAYERS, GenericAdapter
from lightning_effi.random_ltd import functional as F
from lightning_effi.random_ltd.patching import (
    BatchRecord,
    LTDController,
    LTDForward,
    PatchedLayers,
    convert,
    find_patches,
    observe,
    resolve_layer_ids,
    restore,
    restore_module,
    trained,
)

#: the clocks a derived schedule is measured on: optimizer steps, or a progress clock's training progress
CLOCKS = ("step", "progress")


@contextlib.contextmanager
def _random_states_kept() -> Iterator[None]:
    """Restore the global random states (Python's ``random``, numpy's legacy generator, torch's CPU generator) on
    exit: code run inside (a dataset's random augmentation) leaves the run's draws as they were."""
    python, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)


def _require_duration(owner: str, value: Any) -> Duration:
    """``require_steps`` as a Duration of at least one step: an int (optimizer steps, DeepSpeed's key), a string
    such as ``"0.8dur"`` / ``"2ep"`` / ``"500st"``, or a Duration; floats and token durations are refused."""
    where = f"{owner}.require_steps"
    if is_real(value) and not is_int(value):
        v = float(value)
        text = str(Duration(v, "fraction")) if 0 < v <= 1 else ""
        hint = f"'{text}' for a fraction of the run" if text else "a fraction of the run such as '0.8dur'"
        raise ValueError(
            f"{where}: a float is ambiguous (a fraction of the run or a number of steps?), got {value!r}; "
            f"write {hint}, or an int of optimizer steps"
        )
    if is_int(value) and value < 1:
        raise ValueError(f"{where} must be an int >= 1 (optimizer steps), a duration or None, got {value!r}")
    duration = Duration.parse(value, where, units=("step", "epoch", "fraction"))
    if duration.unit == "token":
        raise ValueError(
            f"{where}={duration} is in tokens, which random-LTD's schedule cannot "
            "resolve (its tokens per optimizer step are not known in advance); give optimizer steps, "
            "epochs ('2ep') or a fraction of the run ('0.8dur')"
        )
    if duration.value <= 0:
        raise ValueError(
            f"{where} must be at least one step: >= 1 steps or epochs, a fraction > 0, got {str(duration)!r}"
        )
    return duration


def _refuse_router_loss(pl_module: pl.LightningModule) -> None:
    """Refuse an HF mixture-of-experts model that returns its router logits (``config.output_router_logits``): its
    load-balancing loss reads every layer's router logits against the batch's ``B x T`` tokens (and applies the
    attention mask to each), and a layer random-LTD drops tokens in routes ``B x r`` of them (a bare size mismatch
    inside transformers at the first step, qa49-moe 04).

    Raises:
        ValueError: naming the setting and the remedies.
    """
    for module in pl_module.modules():
        if getattr(getattr(module, "config", None), "output_router_logits", False) is True:
            raise ValueError(
                f"RandomLTDCallback: {type(module).__name__} returns its router logits (config.output_router_logits="
                "True) for its load-balancing loss, which reads every layer's router logits against the batch's "
                "B x T tokens (and its attention mask), while the layers random-LTD drops tokens in route only the "
                "kept B x r. Set output_router_logits=False (no router loss), or leave random-LTD out"
            )


#: new lengths at which a layer's measured FLOPs model ``B (a T + c T^2)`` must hold before it prices the other shapes
LAYER_FLOPS_CHECKS = 2


def _layer_model_checked(model: tuple[Fraction, Fraction, frozenset[int], int]) -> bool:
    """Whether a layer's FLOPs model held at :data:`LAYER_FLOPS_CHECKS` lengths besides the two it was solved from,
    with the lengths measured not all of one residue modulo some ``m > 1``."""
    return model[3] >= LAYER_FLOPS_CHECKS and not share_a_residue(model[2])


def _padded(batch: Any) -> bool:
    """Whether a training batch has padding: its ``attention_mask`` marks fewer real tokens than it has positions, so
    its rows differ in length (a batch padded per batch); or, without one, a ``[B]`` integer tensor named like the
    rows' lengths (:func:`~lightning_effi.core.measure.length_stem`: ``feature_lengths``, ``x_lens``, ``seq_len``, a
    NamedTuple's ``lengths``) holds different values, or a tensor named like a padding mask (``*padding_mask*``) has
    both values: a speech batch's padded frames, whose model builds its mask from the lengths (a right max_value was
    refused for the shorter first batch of one shuffle seed, qa48-speech 04).
    """
    inner = unwrap(batch)[0]
    source = token_source(inner)
    if source is not None and source[0] == "mask":
        rows, real = key_padding_mask(source[1]), mask_tokens(source[1])
        return rows is not None and real is not None and real < rows.numel()
    for path, value in tensor_leaves(inner):
        name = leaf_name(inner, path)
        lengths = value.ndim == 1 and length_stem(name) is not None
        mask = value.ndim >= 2 and "padding_mask" in str(name).lower()
        if (lengths or mask) and value.numel() > 1 and not value.is_complex():
            flat = value.detach().flatten()
            if bool((flat != flat[0]).any()):
                return True
    return False


#: positions the layers may see more or fewer than a seqlen curriculum's batch (label shift, added tokens)
_OFFSET_TOKENS = 2


def _finetuning_callbacks(pl_module: pl.LightningModule) -> list[Any]:
    """The Trainer's ``BaseFinetuning`` callbacks (``BackboneFinetuning``): they freeze parameters in their ``setup``
    and unfreeze them during the fit."""
    trainer = getattr(pl_module, "_trainer", None)
    return [
        cb for cb in getattr(trainer, "callbacks", ()) if any(k.__name__ == "BaseFinetuning" for k in type(cb).__mro__)
    ]


class RandomLTDCallback(KeepsSettings, Callback):
    """Random-LTD: selected layers process a random sorted subset of ``r`` tokens per sample in training.

    Args:
        min_value: reserved length at step 0 (tokens, >= 1). DeepSpeed key ``random_ltd_schedule.min_value``.
        max_value: reserved length at the end of the schedule (tokens). Default ``None``: the sequence length the
            patched layers actually see, read from the hidden states entering the first LTD layer at the first
            training batch (announced; a later, longer batch raises it to that length, so variable-length batches end
            the growth at their longest sequence; synchronised over data-parallel ranks at every optimizer step and
            checkpointed; logged as ``effi/random_ltd/max_value``); with a Curriculum's sequence-length truncation,
            its longest batch. An explicit value is checked against that first length (it must not be larger: the
            schedule would stop dropping tokens early) and, where the model has one, its maximum length.
        require_steps: length of the linear growth: an int of optimizer steps, exactly as DeepSpeed's
            ``schedule_config.require_steps`` (>= 1), or a :class:`~lightning_effi.core.progress.Duration` or what
            ``Duration.parse`` reads: ``"500st"``, ``"0.8dur"`` (a fraction in ``(0, 1]`` of the run's ``T``
            optimizer steps, ``max(1, ceil(f · T))``, ``T`` = the smaller of ``trainer.max_steps`` and
            ``trainer.estimated_stepping_batches`` (:func:`~lightning_effi.core.progress.run_length`, as the V-cycle
            reads it), read at train start), ``"2ep"`` (``n · ceil(num_training_batches /
            accumulate_grad_batches)`` steps, read at train start). No floats (write ``"0.8dur"``), no tokens.
            Default: the whole run (``"1dur"``, ``T`` steps). A fraction or epochs with a technique that shortens the
            epochs (InfoBatch: its progress clock, :func:`~lightning_effi.core.progress.progress_clock`) is measured
            on its training progress instead of in steps: see "The progress clock" below. DeepSpeed's
            ``fixed_linear`` schedule gives ``max_value`` first at ``global_step == require_steps`` and a run of
            ``T`` optimizer steps trains steps ``0 .. T - 1``, so ``max_value`` is reached within the run only for
            ``require_steps <= T - 1``: the default ``"1dur"`` (DeepSpeed's convention, ``require_steps`` = the
            run's steps) reaches it at step ``T``, after the last trained step, which runs at most
            ``ceil((max_value - min_value) / T) + seq_per_step - 1`` tokens below it (12 of 16 in a 6-step run from
            4 with ``seq_per_step=4``; 2032 of 2048 in 10,000 steps from 128 with 16); not warned. An int or epochs
            ``>= T`` (e.g. ``require_steps=1000`` in a run of 300 steps, or ``300``) warns at train start, naming the
            reserved length the run ends at and ``T - 1``; it is not an error, since a longer resumed run continues
            the schedule.
        require_fraction: deprecated (one release, ``DeprecationWarning``): ``require_fraction=f`` is
            ``require_steps="<f>dur"``.
        seq_per_step: ``r`` is a multiple of this (``schedule_config.seq_per_step``).
        layer_ids: exact indices into the adapter's layer list; default all but the first and the last (the model
            needs >= 3 layers then). With a technique that replaces the network during fit (the V-cycle's levels
            have fewer layers), the ids are resolved again for every network: the default is all but the first and
            the last layer of the network in place; at a level whose network has <= 2 layers it selects none and
            random-LTD **pauses** there (announced once at ``setup``); explicit ids are kept as they are and must
            exist at every level (ids < the smallest depth), checked in ``setup`` against the depths of all levels.
        adapter: ``"auto"``, a registered name (``hf_gpt2``, ``hf_bert``, ``timm_vit``, ``torch_transformer``) or an
            adapter instance (:class:`~lightning_effi.adapters.GenericAdapter`).
        rounding: ``"clamped"`` (default: never below ``min_value``, ``max_value`` from ``require_steps`` on) or
            ``"deepspeed"`` (DeepSpeed's arithmetic exactly).
        keep_prefix_tokens: positions always kept (counted inside ``r``); ``"auto"`` (default) = the model's prefix
            tokens (timm's ``num_prefix_tokens``: class, register and distillation tokens; 0 for language models;
            ``GenericAdapter(num_prefix_tokens=...)``).
        accounting: ``"actual"`` (layer-tokens from each batch's real length and ``min(r, S)``) or ``"deepspeed"``
            (``global_batch · (r · L_ltd + max_value · (L − L_ltd))`` per optimizer step).
        seed: seeds the token draws with the step, micro-batch and rank (global RNGs untouched).
        strict: a checkpoint written with other settings raises on load (False: warns, keeps this configuration). A
            derived ``require_steps`` (a fraction or epochs) is compared when training starts: the current arguments
            resolved in this run against the checkpoint's step count (a longer run with a fraction differs too);
            False: warns and the schedule continues with the current arguments' step count.
        model_attr: dotted attribute path from the LightningModule to the module that holds the transformer to patch
            (e.g. ``"student"``), for a module that holds more than one (a teacher and a student, two towers, an EMA
            copy that trains); a frozen transformer there is patched too. Default: the one trainable transformer
            anywhere in the module (transformers whose parameters all have ``requires_grad=False`` are skipped).
        nonfinite_loss: ``"raise"`` (default) stops the fit with a
            :class:`~lightning_effi.core.nonfinite.NonFiniteLossError` at the first NaN / infinite training loss,
            before its backward pass (the parameters are those of the step before); ``"warn"`` warns once, counts
            them (logged as ``effi/nonfinite_losses``, checkpointed, reported at the end of fit) and lets the run go
            on. With several techniques in the Trainer one check runs per backward pass, with the strictest policy
            (:mod:`lightning_effi.core.nonfinite`).

    Attributes:
        requirements: what random-LTD needs and changes (it patches the selected layers' ``forward``; it never reads
            the batch, so any batch structure), read by :func:`~lightning_effi.core.requirements.check_trainer`.

    Composition: with the V-cycle (any :class:`~lightning_effi.core.protocols.PlansModelChanges` technique) the
    patch follows every level change (the layers of the model in place are the patched ones, the reserved length
    stays a function of ``global_step`` or of the progress clock, layer-tokens count the layers of the model each
    step trained). With the default ``layer_ids``, a level whose network has <= 2 layers has no LTD layers:
    random-LTD pauses there (nothing is patched or dropped; the steps trained there count their full layer-tokens
    and FLOPs; ``effi/random_ltd/ltd_layers`` logs 0) and resumes at the next level with >= 3 layers; ``setup``
    lists the paused levels (``rank_zero_info``). A model of <= 2 layers without such a technique still raises.
    With the Curriculum's ``seqlen_truncate`` (or ``seqlen_reshape``), a batch not longer than ``r`` passes through
    unchanged.

    The progress clock: with a technique that shortens the epochs (InfoBatch alone provides
    :class:`~lightning_effi.core.protocols.ProvidesProgressClock`), ``trainer.estimated_stepping_batches`` counts
    full-length epochs, so a fraction or epochs resolved in steps would never finish growing. A derived
    ``require_steps`` is then a share ``f`` of the run's training progress (``"0.8dur"``: 0.8; ``"2ep"``:
    ``2 / max_epochs``), held exactly as a fraction (``require_share``; ``"0dur"`` as one tick of
    :data:`~lightning_effi.core.progress.PROGRESS_TICKS`, 1e-9, as the step schedule takes at least one step), and
    the batches of optimizer step ``s`` use the progress ``p`` the clock reads before that step (the ``s`` steps
    already taken, as the step schedule uses ``global_step = s``; all micro-batches of a step share it), an exact
    fraction too (:func:`~lightning_effi.core.progress.exact_progress_done`: InfoBatch's ``(e·L_e + j) / (E·L_e)``):
    ``r = ltd_value(a, min_value, max_value, b, seq_per_step, rounding)`` with ``p / f = a / b`` in lowest terms, i.e.
    linear growth over progress ``[0, f]``, ``min_value`` at progress 0 and ``max_value`` from progress ``f`` on, with
    the step schedule's ``seq_per_step`` rounding and ``rounding`` modes
    (:func:`~lightning_effi.random_ltd.functional.ltd_value`); a run whose growth ends at step ``S`` of ``T`` steps,
    ``f = S / T``, gets the step schedule's value at every step. The clock's progress is a function of its
    checkpointed state, so a resumed run uses the same ``r`` at every step. ``config()`` records ``clock``
    (``"step"`` or ``"progress"``) and ``require_progress``, the share in integer ticks (``F = max(1, round(f ·
    10⁹))``); a checkpoint of another clock or share is reported when training starts (``strict``). An int
    ``require_steps`` keeps the step schedule.

    Attention weights: a dropped layer computes them on its ``r`` kept tokens; with ``output_attentions=True`` they
    come back on the full sequence, ``[B, H, S, S]`` with zeros in the rows and columns of the tokens that layer
    dropped (Hugging Face's captured ``attentions``, or a layer's own extra output;
    :func:`~lightning_effi.random_ltd.functional.expand_attention`). One of the layer's own arguments returned as it
    is (T5's position bias, a pass-through conditioning tensor) is handed on as it was given, at full length. Other
    extra tensor outputs (a KV cache) are errors.

    Logged every step: ``effi/random_ltd/reserved_length``, ``effi/random_ltd/consumed_layer_tokens``,
    ``effi/random_ltd/flops_saved_frac``, ``effi/random_ltd/ltd_layers`` (the LTD layers of the network that trained
    the batch), ``effi/random_ltd/max_value`` (the schedule's end); with ``nonfinite_loss="warn"``,
    ``effi/nonfinite_losses`` (the run's non-finite training losses so far, counted by the Trainer's first guarded
    callback: :func:`~lightning_effi.core.nonfinite.nonfinite_count`; written to the loggers directly, on rank
    zero). Summary keys ``random_ltd/*`` (``result.json``).

    Raises:
        ValueError: (construction) a value of the wrong type or range, ``min_value > max_value``, ``seq_per_step >
            max_value`` (the reserved length would never grow), ``model_attr`` not a dotted path, ``nonfinite_loss``
            not ``"raise"`` / ``"warn"``; (``setup``) no adapter matches the model, more than one trainable
            transformer matches (the message names them and asks for ``model_attr``), ``model_attr`` not found or
            naming a module that holds no transformer, ``layer_ids`` out of range / duplicated / unsorted, an
            explicit ``max_value`` larger than the model's maximum length (the adapter's ``max_sequence_length``,
            where it has one), ``keep_prefix_tokens`` (with ``"auto"``: the adapter's ``num_prefix_tokens``) above
            ``min_value``, a layer whose ``forward`` takes arguments the adapter does not know, an unsupported
            attention implementation; the default ``layer_ids`` on a model of <= 2 layers; (the first training forward,
            before any update, against the positions the patched layers see, the longest over data-parallel ranks;
            not with a Curriculum, whose first batches are short by design; a length above the model's bound already
            at ``on_train_start``, from a peek at the data) ``min_value`` equal to or larger than that length (no token
            would ever be dropped), an explicit ``max_value`` larger than it, ``seq_per_step`` larger than it with
            ``max_value=None``, a length above the adapter's ``max_sequence_length``; (checkpoint load) a state
            field of the wrong type or range, naming it;
            (a training forward) an attention mask of a layout the adapter cannot gather; explicit ``layer_ids``
            that do not exist at a level of a technique that replaces the network (the V-cycle; every level's depth
            is checked); a reserved length that never drops a token under the
            Curriculum's sequence-length truncation (``min_value`` not below its longest truncated length,
            ``seqlen_truncate``'s ``max_difficulty``, + 1 with ``causal_label_shift``; ``seqlen_reshape``:
            ``max_difficulty + 1``); (after a model change) no adapter matches the new network; (train start)
            ``require_steps`` cannot be derived (a fraction of a run of unknown length, epochs of a train dataloader
            without a length; epochs on a progress clock without a finite ``max_epochs``); (train start,
            ``strict``) a resumed run whose ``require_steps`` resolves to another step count than the checkpoint's,
            or to another clock or share of the progress; (train start) a fit that starts at ``global_step > 0``
            without random-LTD state from a checkpoint (a second ``trainer.fit`` on the same Trainer, or random-LTD
            added on resume from a checkpoint written without it: the schedule counts from step 0 of the run, see
            :meth:`_refuse_late_start`); (``setup``) a module whose layers are patched by a
            random-LTD fit that is still running (another Trainer's, on the same module) or by hand (``convert``
            without ``restore``): the message names the layers.
        NonFiniteLossError: (before a backward pass) the training loss is NaN or infinite and ``nonfinite_loss`` is
            ``"raise"`` (here or on another technique of the Trainer).
        IncompatibleTechniques: (``setup``) combined with another technique that patches layers, see
            :data:`~lightning_effi.core.requirements.CONFLICTS` (a shape change is followed:
            ``follows_model_changes``).
    """

    requirements = Requirements(
        patches_layers=True,
        follows_model_changes=True,
        batch_structures=BATCH_STRUCTURES,
        refused_strategies=("DeepSpeedStrategy",),
        strategy_note=(
            "DeepSpeed's engine (ZeRO partitioning, its own precision and gradient steps) is not validated with "
            "random-LTD's layer patches; use strategy='ddp' or 'fsdp', or DeepSpeed's own random-LTD (the "
            "data_efficiency.data_routing section of its config)."
        ),
    )

    def __init__(
        self,
        min_value: int = 128,
        max_value: int | None = None,
        require_steps: int | str | Duration | None = None,
        require_fraction: float | None = None,
        seq_per_step: int = 16,
        layer_ids: Sequence[int] | None = None,
        adapter: str | TransformerAdapter = "auto",
        rounding: Literal["clamped", "deepspeed"] = "clamped",
        keep_prefix_tokens: int | Literal["auto"] = "auto",
        accounting: Literal["actual", "deepspeed"] = "actual",
        seed: int = 1234,
        strict: bool = True,
        model_attr: str | None = None,
        nonfinite_loss: str = "raise",
    ) -> None:
        given = given_settings(locals())  # first: the arguments as given (lightning_effi.core.settings)
        name = type(self).__name__
        self.nonfinite_guard = NonFiniteLossGuard(name, nonfinite_loss)
        #: durations resolved in batches, checked against the first batch's optimizer steps (manual optimization)
        self._steps_check = StepsPerBatchCheck(name)
        # the batch sizes of the current batch's per-loader batches (a CombinedLoader's), None for one loader
        self._part_sizes: list[int | None] | None = None
        self._resolved_against: int | None = None  # the run length a fraction require_steps was resolved against
        min_value = check_int(name, "min_value", min_value, minimum=1)
        seq_per_step = check_int(name, "seq_per_step", seq_per_step, minimum=1)
        if max_value is not None:  # None: the sequence length the patched layers see
            max_value = check_int(name, "max_value", max_value, minimum=1)
        if max_value is not None and min_value > max_value:
            raise ValueError(f"{name}: min_value ({min_value}) must be <= max_value ({max_value})")
        if max_value is not None and seq_per_step > max_value:
            raise ValueError(
                f"{name}.seq_per_step ({seq_per_step}) must be <= max_value ({max_value}): the reserved length is "
                f"rounded down to a multiple of seq_per_step, so below {seq_per_step} it never grows (it stays at "
                f"min_value until require_steps, then jumps to max_value); pass seq_per_step <= {max_value}"
            )
        duration = None if require_steps is None else _require_duration(name, require_steps)
        if require_steps is not None and require_fraction is not None:
            raise ValueError(f"{name}: give require_steps or require_fraction, not both")
        if require_fraction is not None:
            require_fraction = check_real(name, "require_fraction", require_fraction, 0, 1, low_open=True)
            duration = Duration(require_fraction, "fraction")
            warnings.warn(
                f"{name}.require_fraction is deprecated and will be removed in the next release: write "
                f"require_steps={str(duration)!r}",
                DeprecationWarning,
                stacklevel=2,
            )
        if layer_ids is not None:
            if isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, Sequence):
                raise ValueError(f"{name}.layer_ids must be a list of ints or None, got {layer_ids!r}")
            bad = [i for i in layer_ids if not is_int(i) or i < 0]
            if bad or not layer_ids:
                raise ValueError(
                    f"{name}.layer_ids must be a non-empty list of layer indices >= 0, got {list(layer_ids)!r}"
                )
            if len(set(layer_ids)) != len(layer_ids) or list(layer_ids) != sorted(layer_ids):
                raise ValueError(f"{name}.layer_ids must be sorted and unique, got {list(layer_ids)!r}")
        check_choice(name, "rounding", rounding, F.ROUNDINGS)
        if keep_prefix_tokens != "auto":  # "auto": the model's prefix tokens
            keep_prefix_tokens = check_int(name, "keep_prefix_tokens", keep_prefix_tokens, minimum=0)
        check_choice(name, "accounting", accounting, ("actual", "deepspeed"))
        seed = check_int(name, "seed", seed, minimum=0, maximum=2**64 - 1)
        if not isinstance(adapter, (str, TransformerAdapter)):
            raise ValueError(
                f"{name}.adapter must be 'auto', a registered name or a TransformerAdapter, got {adapter!r}"
            )
        if model_attr is not None and (
            not isinstance(model_attr, str)
            or not all(part and not any(c.isspace() for c in part) for part in model_attr.split("."))
        ):
            raise ValueError(
                f"{name}.model_attr must be a dotted attribute path from the LightningModule (e.g. 'student', "
                f"'model.encoder', 'towers.0' or 'towers.en-de': submodule names joined by single dots, without "
                f"spaces) or None, got {model_attr!r}"
            )
        self.model_attr = model_attr
        self.min_value = min_value
        self.max_value_arg = max_value
        # require_steps as given (repr), the Duration it means (default: the whole run), and the fixed step count
        # (None: derived from the run; the checkpoint fingerprint keeps its pre-Duration form)
        self.require_steps_given: int | str | None = None
        if duration is not None:  # a deprecated require_fraction shows in its new spelling
            self.require_steps_given = int(duration.value) if is_int(require_steps) else str(duration)
        self.require_duration: Duration = Duration(1.0, "fraction") if duration is None else duration
        self.require_steps_arg: int | None = (
            int(self.require_duration.value) if self.require_duration.unit == "step" else None
        )
        self.seq_per_step = seq_per_step
        self.layer_ids_arg = None if layer_ids is None else tuple(int(i) for i in layer_ids)
        self.adapter_arg = adapter
        self.rounding = rounding
        self.keep_prefix_arg = keep_prefix_tokens
        self.accounting = accounting
        self.seed = seed
        self.strict = check_bool(type(self).__name__, "strict", strict)
        # resolved in setup / on_train_start
        self.adapter: TransformerAdapter | None = None
        self.controller: LTDController | None = None
        self.patched: PatchedLayers | None = None
        self.num_layers = 0
        self.layer_ids: tuple[int, ...] = ()
        self.max_value: int | None = max_value
        self.keep_prefix_tokens = 0 if keep_prefix_tokens == "auto" else keep_prefix_tokens
        self._seqlen_curriculum: tuple[str, int] | None = None  # (metric, longest batch) of a truncating curriculum
        self._truncation_shift: int | None = None  # seqlen_truncate's tokens beyond the difficulty (label shift)
        #: (smallest reserved length, the curriculum's metric, its longest batch, how) of settings that never drop a
        #: token under a seqlen curriculum, refused at the first forward (_refuse_never_dropping)
        self._never_drops: tuple[int, str, int, str] | None = None
        self._first_batch_length: int | None = None  # the first batch's length under seqlen_truncate (batch units)
        self._curriculum: str | None = None  # a Curriculum in the run: its first batches may be short by design
        self._evaluating = False  # the checkpoint being restored is for validate / test / predict (state ignored)
        self._mismatch_told = False  # on_load_checkpoint warned that the checkpoint's settings differ (strict=False)
        self._ran_checked = False
        self._active = False  # between setup("fit") and the end of that fit (teardown or on_exception)
        self._running: Any = None  # live_fit of the fit in progress, stored on every patch it makes
        self._reset_progress()
        # a deprecated require_fraction as require_steps: one set on the callback later rebuilds it with that one alone
        given.update(require_steps=self.require_steps_given, require_fraction=None)
        keep_settings(self, RandomLTDCallback, given)

    def _reset_progress(self) -> None:
        """A new fit starts from step 0 with no tokens consumed (a resumed one restores these from its checkpoint)."""
        self.max_value = self.max_value_arg  # None: derived again from this run's data (or restored on resume)
        self._seen = False  # the first training forward's sequence length was checked
        self._grown = False  # a derived max_value grew to a longer batch (announced once)
        self._world = 1  # data-parallel ranks (set at train start): with several, max_value is announced once synced
        self._root_device = torch.device("cpu")  # the strategy's (set at train start): of _ranks_longest
        self._announced: int | None = None  # the synced max_value last announced (several ranks)
        self._longest_seen = 0  # the longest sequence the patched layers saw in this fit (tokens)
        self.require_steps: int | None = self.require_steps_arg
        self.clock: str = "step"  # CLOCKS: resolved at train start
        self.require_progress: int | None = None  # on the progress clock: the growth's end, in progress ticks
        self.require_share: Fraction | None = None  # ... and exactly, the share f of the run's progress
        self._clock_source: ProvidesProgressClock | None = None
        # a resumed run's derived schedule (clock, require_steps, require_progress), checked at train start
        self._saved_schedule: dict[str, Any] | None = None
        self.current_progress: Fraction | None = None  # the progress the current batch's r was read at (progress clock)
        # counters (global: summed over ranks at every optimizer step)
        self.current_step = -1
        self.current_value = self.min_value
        self.consumed_layer_tokens = 0
        self.full_layer_tokens = 0  # what the same batches cost without dropping
        self.consumed_samples = 0
        self.saved_flops = 0.0
        self.full_layer_flops = 0.0
        self.total_steps: int | None = None
        # (steps, micro-batches per step) runs of a run whose accumulation factor changes (None: every step alike)
        self._step_segments: list[tuple[int, int]] | None = None
        # the inputs of the step's passes over other data of the network running the LTD layers (their first tensor
        # argument), and the hooks that see them (:meth:`_watch_inputs`)
        self._inputs: list[torch.Tensor] = []
        # of the first block a pass runs outside a runner, for a step that runs the blocks itself; the runners' calls
        # under way and the position of the block the step ran last outside them
        self._block_inputs: list[torch.Tensor] = []
        self._runner_depth = 0
        self._last_position: int | None = None
        # where the pass under way began (the controller's records, the inputs' and outputs' counts, the last block
        # position): a pass that raises is dropped (_pass_raised)
        self._pass_mark: tuple[Any, ...] | None = None
        # id of a runner or layer -> its calls whose pre-hook of this callback ran and that have not returned: a call
        # that raised in a hook before it (a user's pre-hook) was not seen to begin anything (_block_returned)
        self._entered: dict[int, int] = {}
        # what its runners and last block returned: (grad_fn, storage, shape)
        self._block_outputs: list[tuple[Any, Any, tuple[int, ...]]] = []
        self._input_hooks: list[Any] = []
        self._runners: tuple[tuple[int, int, int], list[weakref.ref[nn.Module]]] | None = None  # (network, runners)
        self.global_batch_size = 0
        # micro-batches per step of the run's first step as expected_total_layer_tokens reads them (the first segment
        # of a GradientAccumulationScheduler's, else accumulate_grad_batches): 0 before the first step
        self.micro_batches = 0
        # this fit's first step (its first not at an epoch's end, once there is one): (samples, micro-batches it folded,
        # accumulate_grad_batches then, whether it was its epoch's last batch)
        self._fit_step_batch: tuple[int, int, int, bool] | None = None
        self._step_micro = 0  # micro-batches folded into the step under way
        self._accumulation_told = False  # warned that expected_total_layer_tokens counts another batch size's
        self._train_started = False  # on_train_start ran in this fit (expected_total_layer_tokens is known from then)
        self._total_read = False  # layer_token_lr(total_layer_tokens=None) reads expected_total_layer_tokens
        # samples, layer-tokens, full layer-tokens, saved flops, full flops; and the samples of the step's skipped
        # micro-batches (its batch size counts them)
        self._pending = [0, 0, 0, 0.0, 0.0, 0]
        self._folded = True
        self._backward_seen, self._skipped = False, False  # the current micro-batch had a backward / trained nothing
        self._batch_rows = 0  # its samples (find_batch_size)
        # the current micro-batch's costs and logged FLOPs fraction, fixed with the network it ran on when a model
        # change comes before its on_train_batch_end (cleared at the next batch)
        self._batch_costs_fixed: tuple[int, int, int, float, float] | None = None
        self._frac_fixed: float | None = None
        self._batch_ltd_layers = 0  # LTD layers of the network that trains the current batch (logged)
        self._fused = False  # that network's attention recomputes the scores in the backward (fused sdpa)
        # the LTD layers' calls replayed on fake tensors: the FLOPs a layer skips, measured (_measured_layer_flops)
        self._meter, self._measure_failed = FlopsMeter(), False
        #: (LTD layer, its structure, grad mode, its arguments' other sizes: LayerCalls.fixed) -> (a, c, the lengths
        #: measured on it, checks passed) of its training FLOPs B (a T + c T^2), or "direct"
        self._flops_models: dict[tuple[Any, ...], tuple[Fraction, Fraction, frozenset[int], int] | str] = {}
        self._predict_layer_flops = True
        self._warned_other_blocks = False
        self._data_length: int | None = None  # the sequence length peeked from the training data at train start
        self._lengths_vary = False  # the peeked samples differ in length (batches padded per batch vary too)
        self._first_padded = False  # the first training batch has padding (its rows differ in length)
        # this fit resumes a random-LTD schedule from a checkpoint (its state loaded, or one of another configuration
        # accepted with strict=False): a fit starting at global_step > 0 without it is refused at train start
        self._resumed = False
        self._check_resumed = False  # a restored, derived max_value is checked at the resumed fit's first forward
        self._first_pending: int | None = None  # the first forward ran without grad: its checks wait (_see)
        self.nonfinite_guard.load_state_dict({})  # no non-finite loss seen in this fit (a resume restores the count)

    @classmethod
    def from_deepspeed_config(cls, ds_config: Any, **kwargs: Any) -> RandomLTDCallback:
        """The callback of a DeepSpeed config's ``data_efficiency.data_routing.random_ltd`` block (a dict, or the path
        of the JSON file), :func:`lightning_effi.random_ltd.config.parse_deepspeed_config` (its table maps the keys)::

            RandomLTDCallback.from_deepspeed_config("ds_config.json", rounding="deepspeed")

        Args:
            ds_config: the config. kwargs: the callback's other arguments (``adapter``, ``rounding``, ``accounting``,
                ``seed``, ...).

        Raises:
            ValueError: the errors of ``parse_deepspeed_config``, or the config's random-LTD is not enabled; in
                ``setup``, a model whose depth is not the config's ``total_layer_num`` (its layer ids were written for
                another model).
        """
        from lightning_effi.random_ltd.config import parse_deepspeed_config

        args = parse_deepspeed_config(ds_config, **kwargs)
        if args is None:
            raise ValueError(
                f"{cls.__name__}.from_deepspeed_config: data_efficiency.data_routing.random_ltd.enabled is not true in "
                "the DeepSpeed config (DeepSpeed would not drop tokens); enable it, or leave the callback out"
            )
        callback = cls(**args)
        # the depth the config's random_ltd_layer_id were written for, compared with the model's in setup: a config of
        # a 4-layer model trained a 6-layer one with two middle layers never dropping (qa102-nlp 05)
        callback._deepspeed_total_layer_num = _deepspeed_total_layer_num(ds_config)
        return callback

    def __repr__(self) -> str:
        """Every constructor argument, so that ``eval(repr(cb))`` builds an equivalent callback (same settings):
        ``require_steps`` as given (an int, or a duration's string such as ``'0.8dur'``; a deprecated
        ``require_fraction`` in that new spelling). An adapter passed as an instance shows as its own ``repr`` (e.g.
        ``GenericAdapter(Module)``), which cannot be evaluated."""
        layer_ids = None if self.layer_ids_arg is None else list(self.layer_ids_arg)
        return (
            f"{type(self).__name__}(min_value={self.min_value!r}, max_value={self.max_value_arg!r}, "
            f"require_steps={self.require_steps_given!r}, "
            f"seq_per_step={self.seq_per_step!r}, layer_ids={layer_ids!r}, adapter={self.adapter_arg!r}, "
            f"rounding={self.rounding!r}, keep_prefix_tokens={self.keep_prefix_arg!r}, "
            f"accounting={self.accounting!r}, seed={self.seed!r}, strict={self.strict!r}, "
            f"model_attr={self.model_attr!r}, nonfinite_loss={self.nonfinite_guard.policy!r})"
        )

    @property
    @override
    def state_key(self) -> str:
        # require_steps: the fixed step count or None (derived from the run), as before durations existed
        return self._generate_state_key(
            min_value=self.min_value,
            max_value=self.max_value_arg,
            require_steps=self.require_steps_arg,
            seq_per_step=self.seq_per_step,
            layer_ids=self.layer_ids_arg,
        )

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        reserve_hook_ids(pl_module)  # hooks of its own ids (lightning_effi.core.hook_ids: a spawned rank's module)
        if stage == "fit":  # settings set on the callback since it was built (lightning_effi.core.settings)
            apply_changed_settings(self, trainer)
        if stage != "fit":
            return
        check_trainer(trainer)
        self._reset_progress()
        self._ran_checked = False  # the first training batch checks that the patched layers ran
        self._active = False  # (an earlier fit of this callback that did not end left it set)
        for other in trainer.callbacks:  # a network an earlier fit left coarse goes back to full size first (V-cycle)
            restore_network = getattr(other, "effi_restore_network", None)
            if other is not self and callable(restore_network):
                restore_network(trainer, pl_module)
        self._clear_leftovers(trainer, pl_module)
        self._active, self._running = True, live_fit(trainer)
        adapter = self._find_adapter_at_setup(pl_module)
        layers = adapter.layers()
        self.num_layers = len(layers)
        total = getattr(self, "_deepspeed_total_layer_num", None)
        if total is not None and total != self.num_layers:
            raise ValueError(
                f"{type(self).__name__}.from_deepspeed_config: the DeepSpeed config's random_ltd.total_layer_num is "
                f"{total}, but the model's {type(adapter).__name__} finds {self.num_layers} layers: its "
                f"random_ltd_layer_id {list(self.layer_ids_arg or ())} were written for another model (DeepSpeed "
                f"checks the ids against total_layer_num only); set total_layer_num to {self.num_layers} and the ids "
                "to the layers that drop tokens"
            )
        self.layer_ids = resolve_layer_ids(self.layer_ids_arg, self.num_layers)
        self._check_model_changes(trainer, pl_module, layers)
        name = type(self).__name__
        seq = adapter.max_sequence_length()
        if self.max_value_arg is not None and seq is not None and self.max_value_arg > seq:
            raise ValueError(
                f"{name}.max_value ({self.max_value_arg}) is larger than the longest sequence the model takes ({seq} "
                f"tokens, {type(adapter).__name__}'s max_sequence_length): pass max_value <= {seq}, or, if the model "
                "takes longer sequences, declare them (GenericAdapter(max_sequence_length=...))"
            )
        if self.keep_prefix_arg == "auto":
            self.keep_prefix_tokens = adapter.num_prefix_tokens()
        if self.keep_prefix_tokens > self.min_value:
            source = (
                f"keep_prefix_tokens='auto': the model's prefix tokens, {type(adapter).__name__}'s num_prefix_tokens"
                if self.keep_prefix_arg == "auto"
                else "keep_prefix_tokens"
            )
            raise ValueError(
                f"{name}: {self.keep_prefix_tokens} prefix tokens are always kept ({source}), more than min_value "
                f"({self.min_value}), the reserved length they are counted in: raise min_value to at least "
                f"{self.keep_prefix_tokens} or keep fewer prefix tokens"
            )
        _refuse_router_loss(pl_module)
        self._seqlen_curriculum = self._check_truncation(trainer)
        self._curriculum = next(
            (type(c).__name__ for c in trainer.callbacks if any(k.__name__ == "Curriculum" for k in type(c).__mro__)),
            None,
        )
        if self.max_value_arg is None and self._seqlen_curriculum is not None and self._never_drops is None:
            # the curriculum truncates the first batches by design: the schedule ends at its longest batch (below
            # min_value: at the first forward, moved by the positions in front of the batch's tokens, if any)
            metric, longest = self._seqlen_curriculum
            self.max_value = longest
            rank_zero_info(
                f"{name}: max_value = {longest} tokens, the longest batch of the curriculum's {metric} (the first "
                "batches are shorter by design); pass max_value to set another end of the schedule"
            )
        self.controller = LTDController(
            self.num_layers,
            self.layer_ids,
            seed=self.seed,
            rank=trainer.global_rank,
            keep_prefix_tokens=self.keep_prefix_tokens,
            record_calls=True,
        )
        # an EfficiencyMonitor(interpolate_flops=False) asks for every shape to be measured: no layer model either
        self._predict_layer_flops = all(getattr(c, "interpolate_flops", True) for c in trainer.callbacks)
        self._meter = FlopsMeter(interpolate=self._predict_layer_flops)
        self._measure_failed, self._flops_models = False, {}
        self._warned_other_blocks = False  # _drops_in_counted_blocks
        # the root the adapter was found and bound in (model_attr's submodule): a GenericAdapter path starts there, and
        # binding it again to the LightningModule refused every path (qa102-nlp 01)
        self.patched = convert(self._search_root(pl_module), adapter, self.controller)
        self.patched.running = self._running
        self.adapter = adapter

    def _clear_leftovers(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before patching: undo what an earlier fit left (this callback's, or another random-LTD callback's on the same
        module) when that fit is over but never undid it (its ``teardown`` and ``on_exception`` did not run, e.g. an
        earlier callback's ``on_exception`` raised), with a warning naming the layers.

        Raises:
            ValueError: the module's layers are patched by a random-LTD fit that is still running (another Trainer's
                fit on the same module) or by hand (:func:`~lightning_effi.random_ltd.patching.convert` without
                ``restore``); the message names the layers.
        """
        name = type(self).__name__
        found = find_patches(pl_module)
        own = self.patched  # this callback's earlier fit did not end: its layers may be in another module
        live = sorted({n for n, p in found if p is not None and p is not own and p.running and p.running(trainer)})
        if live:
            raise ValueError(
                f"{name}: layer{'s' if len(live) > 1 else ''} {', '.join(live)} of this module "
                f"{'are' if len(live) > 1 else 'is'} patched by another random-LTD fit that is still running (another "
                "Trainer's fit on the same module); a module is trained by one fit at a time: wait until that fit ends "
                "or train a copy of the module (copy.deepcopy before either fit)"
            )
        manual = sorted({n for n, p in found if p is not own and (p is None or p.running is None)})
        if manual:
            raise ValueError(
                f"{name}: layer{'s' if len(manual) > 1 else ''} {', '.join(manual)} of this module "
                f"{'are' if len(manual) > 1 else 'is'} already patched by random-LTD outside a fit (convert() without "
                "restore(), or a copy of a patched module); undo it first with restore(<what convert returned>) or "
                "lightning_effi.random_ltd.patching.restore_module(module)"
            )
        if own is None and not found:
            return
        names = list(dict.fromkeys(n for n, _ in found))
        if own is not None:
            restore(own)
            self.patched = None
        restore_module(pl_module)
        what = (
            f"layer{'s' if len(names) > 1 else ''} {', '.join(names)} of this module"
            if names
            else "the layers of the module of its earlier fit"
        )
        rank_zero_warn(
            f"{name}: {what} {'were' if len(names) > 1 else 'was'} still patched by an earlier random-LTD fit that "
            "did not end (interrupted before its on_exception ran?); restored the original forward before patching "
            "again"
        )

    def _release(self) -> None:
        """The end of a fit, normal (``teardown``) or not (``on_exception``): disarm the controller and restore the
        patched layers (:func:`~lightning_effi.random_ltd.patching.restore`); the counters and the controller's last
        records stay readable; remove the hooks on the network's inputs. Idempotent."""
        self._active = False
        self._unwatch_inputs()  # a fit that raised mid-step kept its hooks on the network (qa62-break 03)
        self._runners = None  # weak references: a callback pickled after its fit holds none
        if self.controller is not None:
            self.controller.end()
        if self.patched is not None:
            restore(self.patched)
            self.patched = None

    def _search_root(self, pl_module: pl.LightningModule) -> nn.Module:
        """Where the transformer is looked for: the LightningModule, or the submodule ``model_attr`` names."""
        if self.model_attr is None:
            return pl_module
        return resolve_attr(pl_module, self.model_attr, f"{type(self).__name__}.model_attr")

    def _find_adapter(self, pl_module: pl.LightningModule) -> TransformerAdapter:
        """The adapter of the one transformer random-LTD patches: :func:`~lightning_effi.models.base.find_adapter` in
        the module (frozen transformers are skipped, two trainable ones are an error asking for ``model_attr``), or
        under ``model_attr`` (where a frozen one is patched too: the user named it)."""
        root = self._search_root(pl_module)
        try:
            return find_adapter(root, self.adapter_arg, include_frozen=self.model_attr is not None)
        except ValueError as err:
            backbone = getattr(pl_module, "backbone", None)
            if (
                self.model_attr is None
                and _finetuning_callbacks(pl_module)
                and isinstance(backbone, nn.Module)
                and find_candidates(backbone, None, True)
            ):
                # BackboneFinetuning listed before this callback froze pl_module.backbone in its own setup, to
                # unfreeze it later: that backbone is the network the run trains (refused as "only frozen
                # transformers" in that order, trained in the other, qa113-peft 02); a transformer frozen for good
                # elsewhere is not (it was patched, qa115-regress 04)
                return find_adapter(backbone, self.adapter_arg, include_frozen=True)
            if self.model_attr is None:
                raise
            raise ValueError(
                f"{type(self).__name__}.model_attr={self.model_attr!r} (a {type(root).__name__}): {err}; model_attr "
                "must name the submodule that holds the one transformer to patch"
            ) from None

    def _find_adapter_at_setup(self, pl_module: pl.LightningModule) -> TransformerAdapter:
        """:meth:`_find_adapter` in ``setup``; when the module holds no transformer any registered adapter matches
        and overrides ``LightningModule.setup`` / ``configure_model`` (which Lightning runs after the callbacks'
        ``setup``), the error says so and asks for the network in ``__init__``
        (:func:`~lightning_effi.models.base.deferred_network_hint`).

        Raises:
            ValueError: see :meth:`_find_adapter`.
        """
        try:
            return self._find_adapter(pl_module)
        except ValueError as err:
            if find_candidates(pl_module, include_frozen=True):
                raise
            hint = deferred_network_hint(
                pl_module,
                type(self).__name__,
                "it patches the layers' forward and resolves layer_ids before the checkpoint's weights and its own "
                "state are restored and before DDP wraps the module",
            )
            if not hint:
                raise
            raise ValueError(f"{hint} (the search for it: {err})") from None

    def _resolve_ids(self, num_layers: int) -> tuple[int, ...]:
        """The LTD layer ids of a network of ``num_layers`` layers that a technique put in place (a V-cycle level):
        :func:`~lightning_effi.random_ltd.patching.resolve_layer_ids`, except that the default ids select none (an
        empty tuple: random-LTD pauses) in a network of <= 2 layers.

        Raises:
            ValueError: explicit ids that do not exist in the network (see ``resolve_layer_ids``).
        """
        if self.layer_ids_arg is None and num_layers <= 2:
            return ()
        return resolve_layer_ids(self.layer_ids_arg, num_layers)

    def _check_model_changes(self, trainer: pl.Trainer, pl_module: pl.LightningModule, layers: nn.Module) -> None:
        """``layer_ids`` must resolve at the depth of every network a technique that replaces the model will put in
        place (:class:`~lightning_effi.core.protocols.PlansModelChanges`, the V-cycle's levels) when the block list
        whose depth it changes holds these ``layers`` (a V-cycle on a CLIP's other tower, or on an encoder-decoder's
        encoder beside random-LTD's decoder, leaves their depth as it is: its depths were applied to them, qa50-clip 05,
        qa50-seq2seq 02); the default ids pause at a level of <= 2 layers, announced here once (``rank_zero_info``)."""
        name = type(self).__name__
        first = next(iter(layers.children()), None)
        for other in trainer.callbacks:
            if other is self or not isinstance(other, PlansModelChanges):
                continue
            blocks = getattr(other, "effi_model_blocks", None)
            replaced = blocks(pl_module) if callable(blocks) else None
            outside = isinstance(replaced, nn.Module) and not any(m is first for m in replaced.modules())
            if first is not None and outside:
                continue
            depths = [int(d) for d in other.effi_model_depths(pl_module)]
            paused = [level for level, depth in enumerate(depths, start=1) if self.layer_ids_arg is None and depth <= 2]
            for level, depth in enumerate(depths, start=1):
                try:
                    self._resolve_ids(depth)
                except ValueError as err:
                    smallest = min(depths)
                    fix = f"pass explicit layer_ids below {smallest} (the smallest depth), e.g. {[0, 1][:smallest]}"
                    raise ValueError(
                        f"{name}.layer_ids={None if self.layer_ids_arg is None else list(self.layer_ids_arg)}: "
                        f"{type(other).__name__} trains a network of {depth} layers at level {level} (layers per "
                        f"level: {depths}), where {err}; the ids are resolved again at every level (default: all but "
                        f"the first and the last layer of the network in place, explicit ids kept as given): {fix}, "
                        f"or use a deeper model or fewer levels"
                    ) from None
            if paused:
                rank_zero_info(
                    f"{name}: pauses at level{'s' if len(paused) > 1 else ''} {', '.join(map(str, paused))} of "
                    f"{type(other).__name__} (layers per level: {depths}): the default layer_ids (all but the first "
                    "and the last layer) select none in a network of <= 2 layers, so no token is dropped there and "
                    "its steps count their full layer-tokens and FLOPs; pass explicit layer_ids to drop tokens there"
                )

    def _check_truncation(self, trainer: pl.Trainer) -> tuple[str, int] | None:
        """Under the Curriculum's sequence-length truncation the longest batch has ``max_difficulty`` tokens (+ 1 with
        ``causal_label_shift``; ``seqlen_reshape``: rows of ``max_difficulty + 1``): a reserved length that never goes
        below it would never drop a token, unless the model puts positions in front of the batch's tokens; noted
        here, refused at the first training forward (:meth:`_refuse_never_dropping`). The Curriculum is found by class
        name (techniques do not import each other); its configuration is on the callback or on its DataModule.
        Returns ``(metric, longest batch)`` of such a curriculum (``None`` without one)."""
        bound = self.min_value if self.max_value is None else self.max_value  # the smallest value ignores it
        smallest = F.ltd_value(0, self.min_value, bound, 1, self.seq_per_step, self.rounding)
        found: tuple[str, int] | None = None
        self._truncation_shift = self._never_drops = None
        for other in trainer.callbacks:
            if not any(k.__name__ == "Curriculum" for k in type(other).__mro__):
                continue
            # on the callback, or on the CurriculumDataModule anywhere along the wrappers (InfoBatch's outside it)
            # the wrappers' own (a wrapper reads an attribute it lacks from the user's DataModule, which may have one)
            chain = wrapper_chain(getattr(trainer, "datamodule", None))[:-1]
            configs = [vars(dm).get("config") for dm in chain]
            config = getattr(other, "config", None) or next((c for c in configs if c is not None), None)
            metrics = getattr(config, "metrics", None) or {}
            shift = 1 if getattr(config, "causal_label_shift", False) else 0
            for metric, extra in (("seqlen_truncate", shift), ("seqlen_reshape", 1)):
                m = metrics.get(metric)
                if m is None:
                    continue
                longest = int(m.max_difficulty) + extra
                found = (metric, max(longest, found[1]) if found is not None else longest)
                if metric == "seqlen_truncate":
                    self._truncation_shift = extra
                if smallest >= longest and self._never_drops is None:
                    plus = f" + {extra} ({'causal_label_shift' if metric == 'seqlen_truncate' else 'reshaped rows'})"
                    what = f"{type(other).__name__}'s {metric}"
                    self._never_drops = (
                        smallest,
                        what,
                        longest,
                        f"max_difficulty={m.max_difficulty}{plus if extra else ''}",
                    )
        return found

    def _refuse_never_dropping(self, seq_len: int) -> None:
        """At the first training forward (``seq_len`` positions in the patched layers), a reserved length never below
        the curriculum's longest batch (:meth:`_check_truncation`), moved by the positions the layers see in front
        of the batch's tokens (an image prefix, a soft prompt: known only here; refused at setup, a VLM's valid stack
        was refused naming a min_value that would have left 3 text tokens beside its 16 image ones, qa111-multimodal
        02): random-LTD would never drop a token. Raised before the first backward.

        Raises:
            ValueError: naming both callbacks and both values.
        """
        if self._never_drops is None:
            return
        smallest, what, longest, how = self._never_drops
        front = max(0, seq_len - self._first_batch_length) if self._first_batch_length is not None else 0
        if smallest < longest + front:
            return
        ahead = f", and the patched layers see {front} positions in front of a batch's tokens" if front else ""
        raise ValueError(
            f"{type(self).__name__}: its reserved length is never below {smallest} tokens (min_value={self.min_value}, "
            f"rounding={self.rounding!r}, seq_per_step={self.seq_per_step}) but {what} makes every batch at most "
            f"{longest} tokens long ({how}){ahead}, so random-LTD would never drop a token: lower "
            f"RandomLTDCallback.min_value below {longest + front} or raise the curriculum's max_difficulty"
        )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """The fit raised (any exception, ``KeyboardInterrupt`` included; Lightning skips ``teardown`` then): restore
        the patched layers as ``teardown`` does, so the module trains and evaluates as it did before the fit. Never
        raises (a failure to restore is a warning: the fit's own exception is the one that propagates)."""
        try:
            self._release()
        except Exception as err:  # noqa: BLE001 - on_exception must not replace the fit's exception
            rank_zero_warn(
                f"{type(self).__name__}: could not restore the patched layers after the fit raised ({err!r}); "
                "undo it with lightning_effi.random_ltd.patching.restore_module(module)"
            )

    # ------------------------------------------------------------------------------------------------ model changes
    def effi_before_model_change(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Another technique (the V-cycle) is about to replace the network (:class:`~lightning_effi.core.protocols.
        FollowsModelChanges`): fix the current micro-batch's costs with the network it ran on (the layer-tokens of a
        step count the layers of the network that trained it), fold a step not folded yet (manual optimization), and
        restore the patched layers."""
        if self.patched is None:
            return
        if self.controller is not None and self.adapter is not None and self.controller.records:
            self._batch_costs_fixed = self._batch_costs()
            self._frac_fixed = self._saved_frac()
        self._fold_batch()
        if not pl_module.automatic_optimization and any(self._pending):
            self._fold_step(trainer)
        restore(self.patched)
        self.patched = None
        if self.controller is not None:  # calls of this network's layers: never replayed on the next one's
            self.controller.calls.clear()

    def effi_after_model_change(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The new network is in place: find the adapter on it again, resolve the LTD layer ids for its depth (see
        ``layer_ids``), patch its layers (none with the default ids at <= 2 layers: paused); the controller
        (schedule, seed, current context) goes on.

        Raises:
            ValueError: no adapter matches the new network, or ``layer_ids`` do not resolve at its depth.
        """
        if self.controller is None or self.patched is not None or not self._active:
            return
        arg = self.adapter_arg
        adapter = (
            arg.rebind(self._search_root(pl_module))
            if isinstance(arg, TransformerAdapter)
            else self._find_adapter(pl_module)
        )
        num_layers = len(adapter.layers())
        try:
            layer_ids = self._resolve_ids(num_layers)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: the new network has {num_layers} layers: {err}") from None
        self.controller.num_layers, self.controller.layer_ids = num_layers, layer_ids
        # no LTD layer (the default ids at <= 2 layers): paused, the shapes are only observed for the accounting
        self.patched = (convert if layer_ids else observe)(self._search_root(pl_module), adapter, self.controller)
        self.patched.running = self._running
        self.adapter, self.num_layers, self.layer_ids = adapter, num_layers, layer_ids

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """In a resumed fit, have the training loader built again once Lightning has restored the loops: one built
        earlier, by ``configure_optimizers`` reading ``trainer.estimated_stepping_batches``, would miss the
        checkpoint's mid-epoch position and replay the epoch from its start
        (:func:`~lightning_effi.core.compat.rebuild_train_loader_after_restore`, Lightning issue #20550)."""
        rebuild_train_loader_after_restore(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the sequence length peeked from the training data (:meth:`_peek_sequence_length`; not with a
        Curriculum, whose first batches are short by design) against the model's ``max_sequence_length``
        (:meth:`_check_length`; ``min_value``, ``seq_per_step`` and an explicit ``max_value`` at the first training
        forward, against the positions the layers see, prompt tokens included);
        resolve a derived ``require_steps`` (a fraction or epochs): on the run's progress clock when a technique
        provides one (found now, after every callback's ``setup``: InfoBatch hides its clock in its own ``setup``
        when it thins inside the curriculum), else in optimizer steps; on resume compare with the checkpoint's
        schedule (``strict``); refuse a fit that starts at ``global_step > 0`` without random-LTD state from a
        checkpoint (:meth:`_refuse_late_start`); warn when the growth does not end within the run
        (:meth:`_warn_beyond_run`).

        Raises:
            ValueError: see :meth:`_check_length`; a derived ``require_steps`` that cannot be resolved, or
                (``strict``) differs from the checkpoint's; a fit starting at ``global_step > 0`` without random-LTD
                state (a second ``trainer.fit`` on the same Trainer, or random-LTD added on resume).
        """
        check_started(trainer)
        self._world = trainer.world_size
        self._root_device = trainer.strategy.root_device  # of the ranks' first-batch all-reduce (_ranks_longest)
        self._announced = self.max_value if self.max_value_arg is None else None  # restored on resume: said before
        total = estimated_optimizer_steps(trainer)  # a GradientAccumulationScheduler's factors counted
        self.total_steps = int(total) if math.isfinite(total) else None
        self._step_segments = accumulation_segments(trainer)
        self._refuse_total_with_other_networks(trainer)
        self._data_length, self._lengths_vary = None, False
        if self._curriculum is None and (not self._seen or self._resumed):
            self._data_length = self._peek_sequence_length(trainer)
            if trainer.world_size > 1:  # the longest over the ranks: each may read a shard of its own (qa113-ddp 01)
                local = torch.tensor([self._data_length or 0], dtype=torch.int64, device=trainer.strategy.root_device)
                self._data_length = int(trainer.strategy.reduce(local, reduce_op="max").item()) or None
            # resumed with a max_value derived from the data of the run's start: checked at the first forward,
            # against the positions the layers see (prompts peeked, prompt + generated tokens trained: the resume was
            # refused as "on other data", qa114-rl 02)
            self._check_resumed = self._seen and self._data_length is not None
            if self._data_length is not None:
                # an explicit max_value, min_value and seq_per_step are checked at the first batch, against the
                # positions the layers see: a model may put tokens in front of the ids (a soft prompt: max_value 20
                # refused for the 16 ids, qa70-regress 03; min_value 32 for 32 ids and 64 positions, qa113-peft 03)
                self._check_length(self._data_length, self._PEEKED, explicit_max=False, at_least=True)
        self._resolve_schedule(trainer)
        if not self._resumed and trainer.global_step > 0:
            self._refuse_late_start(trainer)
        self._warn_beyond_run(trainer)
        self._train_started = True

    def note_total_reader(self) -> None:
        """Called by :func:`~lightning_effi.core.lr_schedules.layer_token_lr` built with ``total_layer_tokens=None``
        (in ``configure_optimizers``, before ``on_train_start``): the run reads :meth:`expected_total_layer_tokens`."""
        self._total_read = True

    def _refuse_total_with_other_networks(self, trainer: pl.Trainer) -> None:
        """A layer-token LR schedule reading :meth:`expected_total_layer_tokens` beside a technique that changes the
        network during the fit (the V-cycle): each level's network gives another total (3 layers' at a coarse level,
        6 at the full one), the rebuilt schedule read it at the level in place, and the LR rose again when the full
        model came back (qa93-regress 07). No total at one network's depth is the run's.

        Raises:
            ValueError: naming the technique and the fix (pass ``total_layer_tokens``).
        """
        if not self._total_read:
            return
        changing = [
            type(c).__name__
            for c in trainer.callbacks  # type: ignore[attr-defined]
            if c is not self and getattr(getattr(c, "requirements", None), "changes_model_shapes", False)
        ]
        if changing:
            raise ValueError(
                f"{type(self).__name__}: layer_token_lr(total_layer_tokens=None) reads expected_total_layer_tokens(), "
                f"the layer-tokens of the whole run at one network's depth, but {' and '.join(changing)} changes the "
                "network during the fit (another depth at each level), so no such total is the run's; pass "
                "total_layer_tokens (the layer-tokens at which the decay should end), or a step-based LR schedule"
            )

    def _check_restored_max_value(self, seq_len: int) -> None:
        """On resume, a ``max_value`` derived from the data at the run's start (``max_value=None``, taken from the
        checkpoint) against the sequence length the patched layers see now: a longer one than the data has (the run
        resumed on other data) would make the end of the growth drop nothing, as an explicit ``max_value`` above the
        data's length would (refused in a fresh fit, :meth:`_check_length`).

        Raises:
            ValueError: (``strict``; else a warning) the restored ``max_value`` is above ``seq_len``.
        """
        if self.max_value is not None and self.max_value > seq_len:
            self._mismatch(
                f"the checkpoint's max_value ({self.max_value} tokens, derived from the sequences the run started on) "
                f"is larger than the sequence length the patched layers see now ({seq_len} tokens at the resumed "
                f"fit's first training batch): the reserved length would reach {seq_len} before the end of its "
                "growth and drop nothing from then on (the run resumed on other data: resume on the data it started "
                "on, or start a fresh fit on this data)",
                fix="continue with the checkpoint's max_value",
            )

    def _refuse_late_start(self, trainer: pl.Trainer) -> None:
        """A fit that starts at ``global_step > 0`` without random-LTD state from a checkpoint: a second
        ``trainer.fit`` on a Trainer that trained before, or random-LTD added on resume from a checkpoint written
        without it. The schedule counts from step 0 of the run and a derived one is resolved for this fit's length,
        so it would start part-way (above ``min_value``) and, on a refit, lower than where the earlier fit left it
        (the schedule never decreases within a run), with the counters restarting at 0. The V-cycle refuses the same
        case (``VCycleCallback._refuse_late_start``).

        Raises:
            ValueError: naming the callback, the start step, the schedule this fit would use and the fixes.
        """
        name, step = type(self).__name__, int(trainer.global_step)
        how = (
            f"added on resume at step {step}, from a checkpoint without random-LTD state (written by a fit without "
            "this callback)"
            if getattr(trainer, "ckpt_path", None)
            else f"this fit starts at step {step} on a Trainer that trained before (a second trainer.fit on the same "
            "Trainer: random-LTD's schedule covers one fit and does not continue into another)"
        )
        given = repr(str(self.require_duration) if self.require_steps_given is None else self.require_steps_given)
        if self.clock == "progress":
            schedule = f"require_steps={given} on {type(self._clock_source).__name__}'s progress clock"
        else:
            schedule = f"require_steps={given}, {self.require_steps} optimizer steps in this fit"
            end = self.max_value_arg if self.max_value_arg is not None else self._data_length
            if end is not None and end >= self.min_value and self.require_steps is not None:
                r = F.ltd_value(step, self.min_value, end, self.require_steps, self.seq_per_step, self.rounding)
                schedule += (
                    f": r = {r} tokens at step {step}, not min_value={self.min_value}"
                    if r != self.min_value
                    else f": r = {r} tokens at step {step}, then rising on a schedule timed from step 0, not from here"
                )
        raise ValueError(
            f"{name}: {how}; its schedule counts from step 0 of the run ({schedule}) and its token counters would "
            "restart at 0, so the run would continue on another schedule than the one it started (on a refit with a "
            "derived require_steps the reserved length can drop below where the earlier fit left it). Resume from a "
            "checkpoint written with random-LTD (trainer.fit(..., ckpt_path=...), e.g. ModelCheckpoint(save_last="
            "True) and ckpt_path='last'), or start random-LTD in a fresh fit (a new Trainer without ckpt_path; load "
            "the weights into the module, e.g. with LightningModule.load_from_checkpoint)"
        )

    #: where a peeked sequence length comes from, for messages
    _PEEKED = "in the training data, read at train start"

    def _resolve_schedule(self, trainer: pl.Trainer) -> None:
        """The derived ``require_steps`` of :meth:`on_train_start` (a fixed one only sets the step clock)."""
        self._resolved_against = None
        source, share = progress_clock(trainer.callbacks), None
        if self.require_steps_arg is not None:  # a fixed step count, on the step clock
            source = None
            current = {"clock": "step", "require_steps": int(self.require_steps_arg), "require_progress": None}
        elif source is None:
            duration = {"require_steps": self.require_duration}  # resolved in batches, counted on global_step
            self._steps_check.arm(trainer, trainer.lightning_module, duration)
            current = {"clock": "step", "require_steps": self._resolve_require_steps(trainer), "require_progress": None}
            if self.require_duration.unit == "fraction":
                self._resolved_against = run_length(trainer.max_steps, estimated_optimizer_steps(trainer))
        else:
            share = self._resolve_require_share(trainer, source)
            current = {"clock": "progress", "require_steps": None, "require_progress": round(share * PROGRESS_TICKS)}
        saved = self._saved_schedule
        if saved is not None and (diff := settings_diff(saved, current)):
            step = trainer.global_step
            if saved["clock"] == current["clock"] == "step" and self._finished(saved["require_steps"], step):
                # a finished run extended (a longer run resumed from its end): the schedule stays where it ended
                rank_zero_info(
                    f"{type(self).__name__}: the checkpoint's schedule reached max_value by step {step} "
                    f"(require_steps={saved['require_steps']}); this run goes on at max_value, keeping that "
                    f"schedule (this run's require_steps={self._require_steps_shown()} would give "
                    f"{current['require_steps']} and a reserved length below max_value again)"
                )
                current = dict(saved)
            elif saved["clock"] == current["clock"] == "step":
                before, after = (self._value(saved["require_steps"], step), self._value(current["require_steps"], step))
                self._mismatch(
                    f"require_steps={self._require_steps_shown()} gives {current['require_steps']} optimizer steps "
                    f"in this run but the checkpoint's schedule has require_steps={saved['require_steps']} (another "
                    "duration, run length or gradient accumulation)",
                    fix=f"continue the schedule with require_steps={current['require_steps']} (the reserved length "
                    f"at step {step} goes from {before} to {after}), or pass require_steps={saved['require_steps']} "
                    "to keep the checkpoint's schedule",
                )
            else:
                on = "optimizer steps" if source is None else f"{type(source).__name__}'s training progress"
                self._mismatch(
                    f"the checkpoint's configuration differs (checkpoint, now): {diff} (require_steps="
                    f"{self._require_steps_shown()} on {on}; another clock, duration or run length)",
                    fix="continue the schedule with this run's clock and length",
                )
        self.clock, self._clock_source = current["clock"], source
        self.require_steps, self.require_progress = current["require_steps"], current["require_progress"]
        # on the progress clock the exact share; the checkpoint holds its ticks (compared above)
        self.require_share = share

    def _require_steps_shown(self) -> str:
        """``require_steps`` as given (``6``, ``'0.5dur'``), for messages."""
        given = self.require_steps_given
        return repr(str(self.require_duration) if given is None else given)

    def _value(self, require_steps: int, step: int) -> int | str:
        """The reserved length at ``step`` under ``require_steps`` (``"?"`` while ``max_value`` is unknown)."""
        if self.max_value is None:
            return "?"
        return F.ltd_value(step, self.min_value, self.max_value, require_steps, self.seq_per_step, self.rounding)

    def _finished(self, require_steps: int | None, step: int) -> bool:
        """The schedule of ``require_steps`` gives ``max_value`` at ``step`` (or, ``max_value`` unknown yet, a clamped
        schedule is past ``require_steps``)."""
        if require_steps is None:
            return False
        if self.max_value is None:
            return self.rounding == "clamped" and step >= require_steps
        return self._value(require_steps, step) == self.max_value

    def _warn_beyond_run(self, trainer: pl.Trainer) -> None:
        """Warn (``rank_zero_warn``) when an explicit growth does not end within the run, so that no trained step
        runs at ``max_value``: DeepSpeed's ``fixed_linear`` schedule (:func:`~lightning_effi.random_ltd.functional.
        ltd_value`) first gives ``max_value`` at ``global_step == require_steps``, and a run of ``T`` optimizer steps
        (:func:`~lightning_effi.core.progress.run_length`) trains steps ``0 .. T - 1``, so it warns for
        ``require_steps >= T`` given as an int or in epochs, naming ``T - 1``, the largest ``require_steps`` that
        reaches ``max_value`` at the last trained step. On the progress clock it warns for a share above 1.

        A fraction (``"0.8dur"``, and the default ``"1dur"``) does not warn: it is a share of this run by definition,
        and ``"1dur"`` is DeepSpeed's convention (``require_steps`` = the run's steps), documented to reach
        ``max_value`` only at step ``T``, after the last trained step (which runs at most
        ``ceil((max_value - min_value) / T) + seq_per_step - 1`` tokens below it). The run still drops tokens as the
        schedule says for the steps it has (a longer resumed run continues the schedule), so this is a warning, not
        an error; it names ``require_steps``, the run's length and the reserved length the run ends at."""
        name = type(self).__name__
        given = repr(str(self.require_duration) if self.require_steps_given is None else self.require_steps_given)
        if self.require_duration.unit == "fraction" and self.clock == "step":
            return
        if self.clock == "progress":
            if self.require_progress is not None and self.require_progress > PROGRESS_TICKS:
                share = self.require_progress / PROGRESS_TICKS
                rank_zero_warn(
                    f"{name}.require_steps={given} is longer than the run: {share:g} of its training progress on "
                    f"{type(self._clock_source).__name__}'s clock, so the reserved length ends the run below "
                    f"{1 / share:.0%} of its growth from min_value={self.min_value} to max_value, never reaching "
                    "max_value; give a share below 1 to reach it within the run (a step's reserved length is read at "
                    "the progress made before it, so '1dur' reaches max_value only at the end of the run)"
                )
            return
        source = progress_clock(trainer.callbacks)
        if source is not None and self.require_steps is not None:
            self._warn_beyond_shortened_run(trainer, source, given)
            return
        total = run_length(trainer.max_steps, estimated_optimizer_steps(trainer))
        if total is None or self.require_steps is None or self.require_steps < total:
            return
        end = self.max_value_arg if self.max_value_arg is not None else self.max_value or self._data_length
        if end is not None and end >= self.min_value:
            last = F.ltd_value(total - 1, self.min_value, end, self.require_steps, self.seq_per_step, self.rounding)
            reached = f"{last} tokens at the run's last step (step {total - 1}), {end - last} below max_value={end}"
        else:
            reached = (
                f"{(total - 1) / self.require_steps:.0%} of its growth from min_value={self.min_value} to max_value "
                f"at the run's last step (step {total - 1})"
            )
        fix = (
            f"pass require_steps <= {total - 1} (max_value from that step on, the run's last step being {total - 1})"
            if total > 1
            else "no require_steps reaches it in a run of one optimizer step (step 0 runs at min_value)"
        )
        if end is not None and self.rounding == "deepspeed" and end % self.seq_per_step:
            top = end - end % self.seq_per_step
            fix += (
                f" (with rounding='deepspeed' the schedule stops at {top} tokens, max_value rounded down to a "
                f"multiple of seq_per_step={self.seq_per_step}, whatever require_steps)"
            )
        rank_zero_warn(
            f"{name}.require_steps={given} ({self.require_steps} optimizer steps) does not end within the run "
            f"({total} optimizer steps, steps 0..{total - 1}; DeepSpeed's fixed_linear schedule reaches max_value at "
            f"step require_steps): the reserved length grows only to {reached}, never reaching max_value, so the "
            f"run drops more tokens than a schedule ending at max_value; {fix} to reach it, or keep it when a longer "
            "resumed run continues the schedule"
        )

    def _warn_beyond_shortened_run(self, trainer: pl.Trainer, source: Any, given: str) -> None:
        """:meth:`_warn_beyond_run` for a fixed ``require_steps`` beside a technique that shortens epochs (InfoBatch:
        :func:`~lightning_effi.core.progress.progress_clock`): the run's optimizer steps depend on its scores, between
        the clock's fewest (``effi_min_total_steps``) and the unshortened count, so it warns when ``require_steps``
        is at least the fewest: the growth may not end within the run. Lightning's estimate read the current epoch's
        loader, the whole one in a fresh fit and a pruned one in a fit resumed in a pruning epoch, so the same run
        warned only when resumed, naming a length it did not have (qa67-user 01)."""
        assert self.require_steps is not None
        try:
            fewest = int(source.effi_min_total_steps())
        except (RuntimeError, ValueError):  # no clock yet, or a run without steps (refused elsewhere)
            return
        if trainer.max_steps is not None and trainer.max_steps > 0:
            fewest = min(fewest, int(trainer.max_steps))
        if self.require_steps < fewest:
            return
        clock = type(source).__name__
        rank_zero_warn(
            f"{type(self).__name__}.require_steps={given} ({self.require_steps} optimizer steps) may not end within "
            f"the run: {clock} shortens its epochs by their scores, so the run has {fewest} optimizer steps or more "
            "(up to its unshortened epochs), and DeepSpeed's fixed_linear schedule reaches max_value only at step "
            f"require_steps; pass require_steps <= {fewest - 1} to reach it within any such run, or a share of the "
            f"run ('0.9dur', read on {clock}'s progress clock)"
        )

    def _peek_sequence_length(self, trainer: pl.Trainer) -> int | None:
        """The sequence length the patched layers will see, from the training data, before the first batch: samples
        ``0``, ``n // 2`` and ``n - 1`` of the training ``DataLoader``'s map-style dataset, each collated alone by its
        ``collate_fn`` (a technique's :class:`~lightning_effi.core.batch.EffiBatch` unwrapped) and measured by the
        adapter (:meth:`~lightning_effi.models.base.TransformerAdapter.sequence_length`: ``input_ids`` for the HF
        adapters, the patch count for timm). The Trainer's loader is neither iterated nor re-created, and the
        global random states (Python, numpy, torch CPU) are restored afterwards, so a random augmentation in the
        dataset does not change the run.

        Returns ``None`` (nothing to check before the first batch, which :meth:`_see` checks) when there is no
        single ``DataLoader`` over a map-style dataset, the adapter cannot tell the length from a batch (a
        ``GenericAdapter``, ``nn.TransformerEncoder``: a module may embed or prepend tokens), the samples differ in
        length (variable-length data: the first batch decides), or reading them fails (the loop reads the data
        anyway and reports it)."""
        if self.adapter is None:
            return None
        loader = trainer.train_dataloader
        dataset = getattr(loader, "dataset", None)
        if not isinstance(loader, DataLoader) or dataset is None or isinstance(dataset, IterableDataset):
            return None
        lengths: set[int] = set()
        try:
            n = len(dataset)
            with _random_states_kept():
                for i in sorted({0, n // 2, n - 1} if n else set()):
                    sample = dataset[i]
                    batch = loader.collate_fn(sample if loader.batch_sampler is None else [sample])
                    seq_len = self.adapter.sequence_length(unwrap(batch)[0])
                    if seq_len is None:
                        return None
                    lengths.add(int(seq_len))
        except Exception:  # noqa: BLE001 - a peek that cannot read the data checks nothing; the loop reports it
            return None
        self._lengths_vary = len(lengths) > 1
        return lengths.pop() if len(lengths) == 1 else None

    def _additive(self, offset: int, length: int) -> bool:
        """Whether the patched layers' ``offset`` more positions than a seqlen curriculum's batch of ``length``
        tokens (at the first training batch) stay that many at every length: a label shift or a few tokens the model
        adds (at most :data:`_OFFSET_TOKENS`, in a batch long enough for that not to be a ratio), or positions in front
        of the batch's tokens that ``keep_prefix_tokens`` keeps (an image prefix, a soft prompt: its 16 positions
        refused max_value=None, qa111-multimodal 02). Another offset may be a ratio (a frontend that downsamples)."""
        return (-1 <= offset <= _OFFSET_TOKENS and length > 4 * abs(offset)) or 0 < offset <= self.keep_prefix_tokens

    def _check_curriculum_units(self, seq_len: int, length: int) -> None:
        """``max_value`` derived from the curriculum's ``seqlen_truncate`` (its ``max_difficulty``, in the batch's
        units; ``seqlen_reshape``: its rows of ``max_difficulty + 1``) against the first batch: its layers see the
        batch's length (``length``, less the label shift at most), or one position fewer (the step's own
        ``ids[:, :-1]``) or a few more (tokens the model adds: at most :data:`_OFFSET_TOKENS`), in a batch long enough
        for that not to be a ratio, which ``max_value`` is moved by (announced). A frontend that downsamples (audio
        samples to frames, bytes to patches) or many tokens the model adds make the two differ more, and the schedule
        would end at a length the layers never see.

        Raises:
            ValueError: naming both lengths and ``max_value``.
        """
        assert self._seqlen_curriculum is not None
        # seqlen_reshape (no truncation shift): its rows' length, a step that shifts its own labels one fewer
        # (qa105-regress 02: the derived max_value stayed one above what the layers see)
        if length - (self._truncation_shift or 0) <= seq_len <= length:
            return
        metric, longest = self._seqlen_curriculum
        offset = seq_len - length
        if self._additive(offset, length):
            self.max_value = longest + offset
            rank_zero_info(
                f"{type(self).__name__}: max_value = {self.max_value} tokens: the patched layers see {seq_len} "
                f"positions of the first training batch's {length} (the step's own label shift, a token the model "
                f"adds, or the kept prefix in front of the batch's tokens; causal_label_shift=True on the curriculum "
                f"counts the shift), so the schedule ends at the curriculum's longest batch, {longest}, {offset:+d}"
            )
            return
        raise ValueError(
            f"{type(self).__name__}: max_value=None takes the end of the schedule from the curriculum's {metric} "
            f"({longest}, its longest batch), counted in the batch's units, but at the first training batch the "
            f"patched layers see {seq_len} positions where the batch is {length} long (a frontend that downsamples, "
            "e.g. audio samples to frames, or tokens the model adds): the schedule would end at a length the layers "
            f"never see; pass max_value, the positions the layers see at the curriculum's longest batch"
        )

    def _check_curriculum_end(self, seq_len: int, length: int) -> None:
        """Under the curriculum's ``seqlen_truncate`` (or ``seqlen_reshape``, rows of ``difficulty + 1`` tokens), at
        the first training batch (``length`` tokens long, ``seq_len`` positions in the patched layers), the settings
        against the longest sequence the layers will see: the curriculum's longest batch moved by the first batch's
        offset (a label shift, a token the model adds). The checks that apply without a curriculum at the first batch
        were skipped with one (the first batches are short by design), so an explicit ``max_value`` above that length
        (the last steps dropped nothing) and a ``seq_per_step`` above the derived ``max_value`` (the reserved length
        never grew) trained in silence (qa102-break 01). A layer length that is not the batch's give or take a few
        positions (a frontend that downsamples) is not checked: its units are the user's.

        Raises:
            ValueError: naming the parameter, the curriculum's longest batch and the layers' length.
        """
        assert self._seqlen_curriculum is not None
        metric, longest = self._seqlen_curriculum
        offset = seq_len - length
        if not self._additive(offset, length):
            return
        layers = longest + offset
        name = type(self).__name__
        where = (
            f"the longest sequence the patched layers see under the curriculum's {metric} ({layers} positions: its "
            f"longest batch, {longest} tokens, {offset:+d} as at the first training batch)"
        )
        if self.max_value_arg is not None and self.max_value_arg > layers:
            raise ValueError(
                f"{name}.max_value ({self.max_value_arg}) is larger than {where}: the reserved length would reach the "
                f"sequence length before the end of its growth and drop nothing from then on; leave max_value=None "
                f"(the schedule then ends at the curriculum's longest batch) or pass max_value <= {layers}"
            )
        end = self.max_value if self.max_value_arg is None else self.max_value_arg
        if self.max_value_arg is None and end is not None and self.seq_per_step > end:
            raise ValueError(
                f"{name}.seq_per_step ({self.seq_per_step}) is larger than max_value=None's end of the schedule, "
                f"{where}: the reserved length is rounded down to a multiple of seq_per_step, so it never grows "
                f"(min_value until require_steps, then {end}); pass seq_per_step <= {end}"
            )

    def _lengths_may_grow(self) -> bool:
        """Whether a later batch may be longer than the first: the samples peeked at train start differ in length, or
        the first batch has padding and no peek told the samples' length (samples padded to one fixed length, peeked
        alike, make every batch as long: an explicit ``max_value`` above it went unchecked, qa72-break 01)."""
        return self._lengths_vary or (self._first_padded and self._data_length is None)

    def _check_length(self, seq_len: int, where: str, explicit_max: bool = True, at_least: bool = False) -> None:
        """The settings against the sequence length ``S`` the patched layers see (``where``: peeked from the
        training data at train start, or the first training batch; ``explicit_max``: check an explicit
        ``max_value`` too, not when the samples vary in length, whose longest batch may come later; ``at_least``:
        ``S`` is the data's length, which the layers may see with positions in front of it, a soft prompt: only
        the model's bound is checked).

        Raises:
            ValueError: ``S`` above the model's ``max_sequence_length`` (a declared ``GenericAdapter`` bound that the
                data contradicts); an explicit ``max_value > S`` (the schedule would stop dropping before its end);
                ``min_value >= S`` (the reserved length is never below ``S``: no token is ever dropped); with
                ``max_value=None`` (it becomes ``S``), ``seq_per_step > S`` (the reserved length never grows).
        """
        name = type(self).__name__
        longest = None if self.adapter is None else self.adapter.max_sequence_length()
        if longest is not None and seq_len > longest:
            raise ValueError(
                f"{name}: the sequences the patched layers see are {seq_len} tokens long ({where}), longer than the "
                f"model's max_sequence_length ({longest}, {type(self.adapter).__name__}); declare the model's real "
                "bound (GenericAdapter(max_sequence_length=...), or None when it has none) or feed shorter sequences"
            )
        if at_least:
            return
        if explicit_max and self.max_value_arg is not None and self.max_value_arg > seq_len:
            raise ValueError(
                f"{name}.max_value ({self.max_value_arg}) is larger than the sequence length the patched layers "
                f"see ({seq_len} tokens {where}): the reserved length would reach {seq_len} before the end of its "
                f"growth and drop nothing from then on (a smaller saving than the schedule says); leave "
                f"max_value=None (the schedule then ends at the length the layers see) or pass max_value <= {seq_len}"
            )
        if self.min_value >= seq_len and not explicit_max:
            # samples of different lengths (images of changing resolution): a later batch may be longer, where the
            # reserved length drops tokens (refused or trained by which batch came first, qa114-dense 03)
            rank_zero_warn(
                f"{name}.min_value ({self.min_value}) is not below the sequence length the patched layers see "
                f"({seq_len} tokens {where}): nothing is dropped in batches that short; the samples differ in length, "
                "so longer batches drop tokens (lower min_value to drop in the short ones too)"
            )
            return
        if self.min_value >= seq_len:
            relation = "equal to" if self.min_value == seq_len else "larger than"
            raise ValueError(
                f"{name}.min_value ({self.min_value}) is {relation} the sequence length the patched layers see "
                f"({seq_len} tokens {where}): the reserved length is never below {seq_len}, so random-LTD would never "
                f"drop a token; lower min_value below {seq_len} (e.g. {max(1, seq_len // 4)} to start at a quarter of "
                "the sequence)"
            )
        if self.max_value_arg is None and self.seq_per_step > seq_len:
            raise ValueError(
                f"{name}.seq_per_step ({self.seq_per_step}) is larger than max_value=None's end of the schedule, the "
                f"sequence length the patched layers see ({seq_len} tokens {where}): the reserved length is rounded "
                f"down to a multiple of seq_per_step, so it never grows (min_value until require_steps, then "
                f"{seq_len}); pass seq_per_step <= {seq_len}"
            )

    def _resolve_require_share(self, trainer: pl.Trainer, clock: Any) -> Fraction:
        """A derived ``require_steps`` on the progress clock, the exact share ``f`` of the run's progress: the
        fraction (read as the decimal it is written as) or ``n / E`` for ``n`` epochs, ``E`` the epochs the clock runs
        over (:func:`~lightning_effi.core.progress.clock_epochs`: InfoBatch's ``num_epochs``, by default
        ``max_epochs``), so the growth ends on an epoch boundary; the V-cycle measures its stages the same way. At
        least one tick of :data:`~lightning_effi.core.progress.PROGRESS_TICKS` (``"0dur"``), as the step schedule
        takes at least one step.

        Raises:
            ValueError: epochs without a finite ``trainer.max_epochs >= 1`` (on a clock that does not say its own).
        """
        duration = self.require_duration
        source = type(clock).__name__
        if duration.unit == "fraction":
            share = Fraction(repr(float(duration.value)))
        else:
            epochs = clock_epochs(clock, trainer)
            if epochs is None or not math.isfinite(epochs) or epochs < 1:
                raise ValueError(
                    f"{type(self).__name__}.require_steps={duration} is in epochs, measured on {source}'s training "
                    f"progress as n / max_epochs of the run, but trainer.max_epochs={epochs}; set "
                    "Trainer(max_epochs=...) or give a fraction of the run ('0.8dur')"
                )
            share = Fraction(int(duration.value), int(epochs))
        return max(share, Fraction(1, PROGRESS_TICKS))

    def _resolve_require_steps(self, trainer: pl.Trainer) -> int:
        """A derived ``require_steps`` in optimizer steps (at train start): a fraction of the run's optimizer steps
        (:func:`~lightning_effi.core.progress.run_length` of ``max_steps`` and ``estimated_stepping_batches``, as the
        V-cycle reads it), rounded up; or epochs of
        :func:`~lightning_effi.core.progress.steps_per_epoch` optimizer steps."""
        where = f"{type(self).__name__}.require_steps"
        duration = self.require_duration
        if duration.unit == "epoch":
            # each epoch at its own factor: a GradientAccumulationScheduler sets the Trainer's only at the epoch's
            # start ('1ep' of {0: 2} resolved to the batches, qa59-break 02; '2ep' of {0: 1, 1: 2} to 2 x the first
            # epoch's steps, qa60-break 02)
            batches = trainer.num_training_batches

            def epoch_steps(epoch: int) -> int:
                return steps_per_epoch(batches, accumulate_grad_batches_at(trainer, epoch), f"{where}={duration}")

            return max(1, steps_of_epochs(epoch_steps, int(duration.value)))
        total = run_length(trainer.max_steps, estimated_optimizer_steps(trainer))
        if total is None:
            why = (
                "max_epochs=-1 and max_steps=-1"
                if trainer.max_epochs in (-1, None)
                else f"max_epochs={trainer.max_epochs} over a train dataloader without a length (an IterableDataset), "
                "and max_steps=-1"
            )
            raise ValueError(
                f"{where}={str(duration)!r}: a fraction of the run, whose length is unknown ({why}); set "
                "Trainer(max_steps=...) or give require_steps in optimizer steps (an int)"
            )
        return max(1, duration.to_steps(total_steps=total, name=where, rounding="ceil"))

    # ------------------------------------------------------------------------------------------------ schedule
    def value_at(self, step: int) -> int:
        """Reserved length at optimizer step ``step`` (pure; needs the resolved ``max_value`` and ``require_steps``).

        Raises:
            RuntimeError: before the schedule is resolved, or on the progress clock (see :meth:`value_at_progress`).
        """
        self._check_step_schedule("value_at")
        assert self.max_value is not None and self.require_steps is not None
        return F.ltd_value(step, self.min_value, self.max_value, self.require_steps, self.seq_per_step, self.rounding)

    def value_at_progress(self, progress: Fraction | float) -> int:
        """Reserved length at training progress ``progress`` in [0, 1] (a fraction of the run, exact as a
        :class:`~fractions.Fraction`; a float is read at its exact binary value) on the progress clock:
        ``ltd_value(a, min_value, max_value, b, seq_per_step, rounding)`` with ``progress / require_share = a / b`` in
        lowest terms (pure): the step schedule's formula at the ratio ``p / f``, so a boundary at 1/3 of the run is
        reached at the step whose progress is 1/3.

        Raises:
            RuntimeError: not on the progress clock (resolved at train start).
            ValueError: ``progress`` is not a number in [0, 1].
        """
        if self.clock != "progress" or (self.require_share is None and self.require_progress is None):
            raise RuntimeError(
                f"{type(self).__name__}.value_at_progress: the schedule is not on a progress clock (clock="
                f"{self.clock!r}; resolved at train start); use value_at(step)"
            )
        if self.max_value is None:
            raise RuntimeError(
                f"{type(self).__name__}.value_at_progress: max_value=None is resolved at the first training batch (the "
                "sequence length the patched layers see)"
            )
        if isinstance(progress, bool) or not (is_real(progress) and 0 <= progress <= 1):
            raise ValueError(
                f"{type(self).__name__}.value_at_progress: progress must be a number in [0, 1] (a fraction of the "
                f"run), got {progress!r}"
            )
        # exact: in ticks of 1e-9 both the progress and the share rounded, and the growth read at 1/3 of the run
        # (333333333 ticks) stayed a step at the last value (qa79-stack 01), at 4/9 of a run over 2/3 too (qa81-break
        # 04); read a tick later, a step less than 1.5 ticks before a boundary got the next value a step early
        # (qa82-break 03)
        share = self.require_share
        if share is None:  # restored before train start, or set by hand: the checkpoint's ticks
            assert self.require_progress is not None
            share = Fraction(self.require_progress, PROGRESS_TICKS)
        ratio = Fraction(progress) / share
        return F.ltd_value(
            ratio.numerator, self.min_value, self.max_value, ratio.denominator, self.seq_per_step, self.rounding
        )

    def _check_step_schedule(self, what: str) -> None:
        if self.clock == "progress":
            raise RuntimeError(
                f"{type(self).__name__}.{what}: the schedule is on {type(self._clock_source).__name__}'s progress "
                "clock (the epochs shorten), so it has no step count; use value_at_progress"
            )
        if self.max_value is None or self.require_steps is None:
            raise RuntimeError(
                f"{type(self).__name__}.{what}: the schedule is resolved at train start (require_steps) and, with "
                "max_value=None, at the first training batch (max_value: the sequence length the patched layers see)"
            )

    def total_layer_tokens(self, train_steps: int, global_batch_size: int) -> int:
        """Layer-tokens of ``train_steps`` optimizer steps of full-length batches (pure: the state is untouched).

        Raises:
            RuntimeError: before the schedule is resolved, or on the progress clock (no step count).
        """
        self._check_step_schedule("total_layer_tokens")
        assert self.max_value is not None and self.require_steps is not None
        return F.total_layer_tokens(
            train_steps,
            global_batch_size,
            self.num_layers,
            len(self.layer_ids),
            self.min_value,
            self.max_value,
            self.require_steps,
            self.seq_per_step,
            self.rounding,
        )

    def _first_micro_batches(self, trainer: pl.Trainer) -> int:
        """The micro-batches of the run's first optimizer step as :meth:`expected_total_layer_tokens` counts them."""
        return int(self._step_segments[0][1] if self._step_segments else trainer.accumulate_grad_batches)

    def _warn_other_accumulation(self) -> None:
        """Read by :meth:`expected_total_layer_tokens` in a resumed fit whose steps have another global batch size than
        the checkpoint's first step (another accumulation, per-device batch size or number of devices): the total
        counts the checkpoint's, so warn (once a fit). Compared per micro-batch with this fit's first step that is not
        an epoch's last batch (else its first: an epoch's last batch tells only a larger batch), times this fit's
        accumulation; before the first step nothing is known. The
        micro-batch counts were compared, which missed another per-device batch and warned of 4 x 4 against 8 x 2
        (qa93-regress 02). A fit that never reads the total is not warned: nothing in it depends on it."""
        if self._accumulation_told or not (self._resumed and self.global_batch_size and self._fit_step_batch):
            return
        samples, micro, factor, last = self._fit_step_batch
        if self._step_segments and self.micro_batches:  # each step's batch: samples per micro-batch times its count
            mine, theirs = samples * self.micro_batches, self.global_batch_size * micro
            was = f"{self.global_batch_size / self.micro_batches:g} samples per micro-batch"
            now = f"{samples / micro:g} per micro-batch"
        else:
            mine, theirs = samples * factor, self.global_batch_size * micro
            was, now = f"{self.global_batch_size} samples a step", f"{samples * factor / micro:g} samples a step"
        if mine == theirs or (last and mine < theirs):  # an epoch's last batch may be smaller: nothing told by it
            return
        self._accumulation_told = True
        rank_zero_warn(
            f"{type(self).__name__}: this fit trains {now} where the checkpoint's run trained {was} (another gradient "
            "accumulation, per-device batch size or number of devices): expected_total_layer_tokens() (the default "
            "total of a layer-token LR schedule) counts every step of the run at the checkpoint's, so the schedule "
            "ends at another point than the run; pass total_layer_tokens explicitly, or resume with the checkpoint's "
            "batch size"
        )

    def expected_total_layer_tokens(self) -> int:
        """Layer-tokens the whole run will consume at full-length batches: :meth:`total_layer_tokens` over the run's
        optimizer steps (``trainer.estimated_stepping_batches``, a ``GradientAccumulationScheduler``'s factors
        counted) at the global batch size of the first step. When the scheduler changes the factor during the run,
        each step's batch follows its micro-batch count (the first step's samples per micro-batch times the count).
        In a run resumed with another global batch size than the checkpoint's first step, warns (once a fit) that the
        total counts the checkpoint's.

        Raises:
            TotalNotKnownError: (a ``RuntimeError``) before ``on_train_start`` (``LambdaLR``'s constructor in
                ``configure_optimizers``).
            RuntimeError: before the first optimizer step, or for a run of unknown length.
        """
        if not self._train_started:
            raise TotalNotKnownError(
                "RandomLTDCallback.expected_total_layer_tokens: the run's length is read when training starts "
                "(on_train_start)"
            )
        if self.total_steps is None or not self.global_batch_size:
            raise RuntimeError(
                "RandomLTDCallback.expected_total_layer_tokens: needs a run of known length and one "
                "finished optimizer step; pass total_layer_tokens explicitly"
            )
        self._warn_other_accumulation()
        if not self._step_segments:
            return self.total_layer_tokens(self.total_steps, self.global_batch_size)
        # layer-tokens are linear in the batch size: per-sample totals over each run of steps, times its batch
        per_micro_batch = self.global_batch_size / self._step_segments[0][1]
        total, done, before = 0.0, 0, 0
        for steps, size in self._step_segments:
            done += steps
            upto = self.total_layer_tokens(done, 1)
            total += (upto - before) * per_micro_batch * size
            before = upto
        return int(round(total))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.controller is not None
        self._steps_check.batch_start(trainer)
        parts = combined_parts(trainer.train_dataloader, batch)
        self._part_sizes = [find_batch_size(part) for part in parts] if parts else None
        # the batch's samples, for a micro-batch skipped before its forward (no layer records: qa85-break 01)
        self._batch_rows = sum(n or 0 for n in self._part_sizes) if self._part_sizes else (find_batch_size(batch) or 0)
        self.controller.optimized = optimized_parameters(trainer)
        self._release_frozen_copies(trainer, pl_module)
        step = trainer.global_step
        self.current_step = step
        if self.clock == "progress":
            assert self._clock_source is not None
            # the progress of the steps taken before this one (every micro-batch of the step reads the same), exact
            self.current_progress = exact_progress_done(self._clock_source)
        if self.max_value is not None:
            self.current_value = self._scheduled_value()
        # r is read again by the first LTD layer of the forward, with the sequence length it sees (max_value=None)
        self._first_batch_length = None
        if not self._seen:  # a first batch padded per batch: its length does not bound an explicit max_value
            self._first_padded = _padded(batch)
        if not self._seen and self._seqlen_curriculum is not None:
            meta = batch_meta(trainer) or {}
            difficulty, full = meta.get("cl_difficulty"), meta.get("cl_full_length")
            difficulty = difficulty if isinstance(difficulty, Mapping) else {}
            if self._truncation_shift is not None and is_int(difficulty.get("seqlen_truncate")) and is_int(full):
                self._first_batch_length = min(int(full), int(difficulty["seqlen_truncate"]) + self._truncation_shift)
            elif self._truncation_shift is None and is_int(difficulty.get("seqlen_reshape")):
                # seqlen_reshape: rows of difficulty + 1 tokens (its end is checked as truncation's: qa104-regress 02)
                self._first_batch_length = int(difficulty["seqlen_reshape"]) + 1
        self.controller.begin(step, batch_idx, self._reserved_length)
        self._watch_inputs(pl_module)
        self._folded = False
        # the micro-batch trained (a backward ran; training_step returning None skips it under automatic optimization)
        self._backward_seen, self._skipped = False, False
        self._batch_costs_fixed, self._frac_fixed = None, None
        self._batch_ltd_layers = len(self.layer_ids)
        self._fused = self._fused_attention(pl_module)

    def _check_layout(self, trainer: pl.Trainer, batch: Any, record: BatchRecord) -> None:
        """Warn at the first training batch when a ``GenericAdapter``'s declared ``hidden_state_order`` looks swapped:
        ``[B, S, H]`` blocks declared ``seq_batch`` ran their middle layers on a subset of the samples with all their
        tokens, counted as a layer-token saving (qa102-nlp 02). Told only where the shapes leave no doubt: layers whose
        order is declared (not read from PyTorch layers' ``batch_first``), one loader whose ``batch_size`` is the
        first axis of the batch's first tensor ``[B, S, ...]`` (a seq-first batch ``[S, B]`` is not read as ``S``
        samples), and the layers reading ``S`` sequences of ``B`` tokens (a network that folds more rows into its
        batch, R-Drop's ``2B``, is not taken for a swap; qa103-regress 02)."""
        adapter = self.adapter
        if not isinstance(adapter, GenericAdapter) or any(isinstance(m, TORCH_LAYERS) for m in adapter.layers()):
            return
        if self._part_sizes is not None:
            return
        rows = getattr(trainer.train_dataloader, "batch_size", None)
        shape = _first_shape(batch)
        if not is_int(rows) or shape is None or len(shape) < 2 or shape[0] != rows:
            return
        if (record.batch_size, record.seq_len) != (shape[1], rows) or shape[1] == rows:
            return
        order = adapter.hidden_state_order
        other = "batch_seq" if order == "seq_batch" else "seq_batch"
        rank_zero_warn(
            f"{type(self).__name__}: at the first training batch the patched layers' hidden states are read as "
            f"{record.batch_size} sequences of {record.seq_len} tokens ({type(adapter).__name__}."
            f"hidden_state_order={order!r}), but the batch holds {rows} samples of {shape[1]}: the axes look "
            f"swapped, and random-LTD would drop whole samples instead of tokens. If the layers take "
            f"{'[seq, batch, hidden]' if other == 'seq_batch' else '[batch, seq, hidden]'}, declare "
            f"hidden_state_order={other!r} (GenericAdapter(hidden_state_order=...))"
        )

    def _watch_inputs(self, pl_module: pl.LightningModule) -> None:
        """Hook the modules whose call runs the LTD layers' list (:func:`~lightning_effi.core.measure.block_runners`)
        for the micro-batch: the first tensor of each call on values not seen before in it is another pass over other
        data (:meth:`_input_seen`), as the ``EfficiencyMonitor`` counts passes; a call on the same values (R-Drop)
        is not."""
        self._unwatch_inputs()
        if self.adapter is None:
            return
        layers = self.adapter.layers()
        key = (id(pl_module), id(layers), len(layers))
        if self._runners is None or self._runners[0] != key:  # searched once per network, not at every batch
            name = next((n for n, m in pl_module.named_modules() if m is layers), None)
            runners = [] if name is None else block_runners(pl_module, name, layers)
            self._runners = (key, [weakref.ref(r) for r in runners])  # weakly: no module held past its fit
        for ref in self._runners[1]:
            runner = ref()
            if runner is None:
                continue
            self._input_hooks.append(
                runner.register_forward_pre_hook(WeakHook(self, "_runner_called"), with_kwargs=True)
            )
            # also when the call raises (a call the step catches, then runs the passes: counted once, qa71-break 02)
            hook = WeakHook(self, "_output_seen", True)
            self._input_hooks.append(runner.register_forward_hook(hook, always_call=True))
        # a step that runs the blocks itself calls no runner: the first block of each pass tells it
        for position, layer in enumerate(layers):
            hook = WeakHook(self, "_block_called", position)
            self._input_hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
            # also when the call raises: the pass it began is dropped (_pass_raised)
            hook = WeakHook(self, "_block_returned", position)
            self._input_hooks.append(layer.register_forward_hook(hook, always_call=True))
        if len(layers):
            self._input_hooks.append(layers[-1].register_forward_hook(WeakHook(self, "_output_seen", False)))

    def _runner_called(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A call of a runner of the LTD layers' list: its input (:meth:`_input_seen`); the blocks it runs begin no
        pass of their own (:meth:`_block_called`)."""
        self._entered[id(module)] = self._entered.get(id(module), 0) + 1
        if not _in_backward():
            if not self._runner_depth:
                self._begin_pass()
            self._runner_depth += 1
        self._input_seen(False, module, args, kwargs)

    def _block_called(self, position: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A call of the LTD layers' list's block at ``position``, outside a runner's call: the first block the step
        runs, or one at or before the last it ran, begins a pass (:meth:`_input_seen`), whichever block that is: the
        later blocks only, run on cached hidden states, or the trained blocks after a frozen first one run under
        ``no_grad`` (one forward counted of two views, qa68-break 02, 06); a view through the network beside one
        through the step's own loop (one counted, qa68-break 03)."""
        self._entered[id(module)] = self._entered.get(id(module), 0) + 1
        if self._runner_depth or _in_backward() or not forward_trains():
            return
        last = self._last_position
        if last is None or position <= last:
            self._begin_pass()
        self._last_position = position
        if last is None or position <= last:
            self._input_seen(True, module, args, kwargs)

    def _begin_pass(self) -> None:
        """A pass begins (a runner's call outside another's, or a block the step runs itself beginning one): where it
        begins is kept, for :meth:`_pass_raised`."""
        controller = self.controller
        mark = controller.mark() if controller is not None and controller.key is not None else None
        counts = (len(self._inputs), len(self._block_inputs), len(self._block_outputs))
        self._pass_mark = (mark, *counts, self._last_position)

    def _pass_raised(self) -> None:
        """The pass under way raised (a runner's call outside another's, or a block the step runs itself, not in a
        backward: the early stop of a checkpoint's recompute raises too): what it recorded is forgotten. A step that
        catches an out-of-memory error and runs the batch again in halves trained each row once, and the failed
        attempt was counted as another forward beside the retry (512 layer-tokens for 256, qa74-regress 01)."""
        pass_mark, self._pass_mark = self._pass_mark, None
        if pass_mark is None:
            return
        mark, inputs, block_inputs, outputs, last = pass_mark
        if mark is not None and self.controller is not None and self.controller.key is not None:
            self.controller.rollback(mark)
        del self._inputs[inputs:], self._block_inputs[block_inputs:], self._block_outputs[outputs:]
        self._last_position = last

    def _block_returned(self, position: int, module: nn.Module, args: Any, output: Any) -> None:
        """The end of a call of the LTD layers' list's block at ``position``: a block the step runs itself that raised
        ends its pass (:meth:`_pass_raised`); inside a runner's call, the runner's end tells it. A call that raised in
        a hook before this callback's (a user's pre-hook) ends the pass under way where it would have continued it
        (:meth:`_continued`), and none where it would have begun another (the pass before it was dropped)."""
        entered = self._left(module)
        if (
            output is None
            and sys.exc_info()[0] is not None
            and not self._runner_depth
            and not _in_backward()
            # a block under no_grad begins no pass (_block_called): its raise ended none (a target pass's out-of-memory
            # fallback rolled back the trained pass before it, qa76-regress 01)
            and forward_trains()
            and (entered or self._continued(position, args))
        ):
            self._pass_raised()

    def _continued(self, position: int, args: Any) -> bool:
        """Whether a block call at ``position`` on ``args`` that began no pass in this callback's hooks continues the
        pass under way: a block after the last one run, or one called on what the last block returned (a
        weight-shared block called again, qa78-regress 01)."""
        if self._last_position is None:
            return False
        hidden = next((a for a in args if isinstance(a, torch.Tensor)), None) if isinstance(args, tuple) else None
        return position > self._last_position or (
            hidden is not None and not hidden.is_nested and self._continues(hidden)
        )

    def _left(self, module: nn.Module) -> bool:
        """Whether this callback's pre-hook ran for the call of ``module`` that returns (or raises) now; its count
        of calls under way drops."""
        entered = self._entered.get(id(module), 0)
        if entered:
            self._entered[id(module)] = entered - 1
        return bool(entered)

    def _input_seen(self, block: bool, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A call of a runner of the LTD layers' list (or of a block beginning a pass outside one, ``block``) that
        trains: its first tensor is remembered unless one of the same values was (R-Drop)."""
        if _in_backward() or self.controller is None or self.controller.key is None:  # a recompute; no step
            return
        if not forward_trains():  # a probe under no_grad on other ids trains no tokens (qa66-break 02)
            return
        first = pass_input(args, kwargs)
        if first is None or first.is_nested:
            return
        if self._continues(first):  # what the network or its last block returned: a loop over the blocks, one pass
            return
        if not any(same_values(earlier, first) for earlier in (*self._inputs, *self._block_inputs)):
            (self._block_inputs if block else self._inputs).append(first)

    def _output_seen(self, runner: bool, module: nn.Module, args: Any, output: Any) -> None:
        """What a runner of the list (``runner``) or its last block returned in the micro-batch (its first tensor):
        its autograd node, its storage (weakly) and its shape, for :meth:`_continues`."""
        if runner and self._left(module) and not _in_backward():
            self._runner_depth = max(0, self._runner_depth - 1)
            if output is None and sys.exc_info()[0] is not None and not self._runner_depth:
                self._pass_raised()
                return
            if not self._runner_depth:  # the pass is whole: no later raise ends it
                self._pass_mark = None
        value = output if isinstance(output, torch.Tensor) else next((v for _, v in tensor_leaves(output)), None)
        if value is not None and not value.is_nested and not _in_backward():
            self._block_outputs.append((value.grad_fn, storage_ref(value), tuple(value.shape)))

    def _continues(self, value: torch.Tensor) -> bool:
        """Whether ``value``, the input of a runner or of the first block, is what a runner or the last block
        returned in the micro-batch, or made from it of its shape (detached, viewed, normed: the monitor's rule for a
        loop over the blocks); such a second lap of a weight-shared stack was counted as another view (qa68-break
        01)."""
        returned = [r for r in self._block_outputs if r[2] == tuple(value.shape)]
        storage = storage_ref(value)
        if storage is not None and any(r[1] is not None and r[1]() is storage() for r in returned):
            return True
        # through a concatenation along the positions only where all its data comes from the output: memory slots in
        # front of a new segment (a recurrent memory transformer) are another pass of the output's shape (240
        # layer-tokens for 480, qa69-break 01), a CLS put back in front of a lap's output or a state joined on the
        # feature axis is not (qa70-break 01)
        return derived_from(value, {id(r[0]) for r in returned if r[0] is not None}, whole_cat=False)

    def _unwatch_inputs(self) -> None:
        for hook in self._input_hooks:
            hook.remove()
        self._input_hooks, self._inputs, self._block_inputs, self._block_outputs = [], [], [], []
        self._runner_depth, self._last_position, self._pass_mark, self._entered = 0, None, None, {}

    def __getstate__(self) -> dict[str, Any]:
        """The callback's state without what one step or fit holds of its network (the hooks on it, its inputs, weak
        references to its runners), rebuilt at the next batch: ``torch.save`` of the module, which reaches the
        callback through its Trainer, and a deep copy of the callback, failed mid-fit (qa67-break 02). A subclass's
        ``__slots__`` values are in the dict too, by their (mangled) names, and :meth:`__setstate__` puts them back
        (a copy lost them); a subclass extending these two methods gets and gives a dict, as before."""
        state = dict(self.__dict__)
        state.update(_input_hooks=[], _inputs=[], _block_inputs=[], _block_outputs=[], _runners=None)
        state.update(_runner_depth=0, _last_position=None, _pass_mark=None, _entered={})
        state.update(_slot_values(self))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore :meth:`__getstate__`'s dict: the names of the class's ``__slots__`` into their slots, the rest into
        ``__dict__`` (as Python's default restore does, without ``__setattr__``)."""
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots), as 01af568 pickled a slotted subclass
            state = {**(state[0] or {}), **(state[1] or {})}  # (a bare AttributeError, qa98-regress 03)
        slots = _slot_names(type(self))
        for name, value in state.items():
            if name in slots:
                object.__setattr__(self, name, value)
            else:
                self.__dict__[name] = value

    def _release_frozen_copies(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Give the original ``forward`` back to the layers of a frozen copy of the converted network that the module
        made after setup (a BYOL / MoCo / DINO momentum target or an EMA copy built with ``copy.deepcopy`` in
        ``setup``, ``on_fit_start`` or ``on_train_start``). A deep copy of a converted model is converted too (its
        layers share this callback's schedule), but a transformer whose parameters are all frozen is no candidate
        (class docstring: ``model_attr``): the copy's layers dropped tokens in silence, and the target the online
        network regresses to was another network's (qa42-user 02). A copy is told by its layers' ``LTDForward``
        without a record of :func:`convert` (``patch is None``); not trained: no optimizer holds a parameter of the
        layer list that holds them (:func:`~lightning_effi.random_ltd.patching.trained`; a target updated by hand,
        left out of ``configure_optimizers`` without ``requires_grad_(False)``, is not trained either: qa43-break 01).
        Announced once per copy (``rank_zero_info``). A copy that trains keeps the schedule. A copy outside the
        module (on a callback) or made inside a training step is told when it is called: a copy no optimizer trains
        called under ``no_grad`` passes through (:class:`~lightning_effi.random_ltd.patching.LTDForward`)."""
        copies: dict[str, list[str]] = {}
        converted: set[str] = set()
        for name, sub in pl_module.named_modules():
            forward = sub.__dict__.get("forward")
            if isinstance(forward, LTDForward) and forward.controller is self.controller:
                parent = name.rpartition(".")[0]
                if forward.patch is None:
                    copies.setdefault(parent, []).append(name)
                else:
                    converted.add(parent)
        if not copies:
            return
        for parent, names in copies.items():
            holder = pl_module.get_submodule(parent) if parent else pl_module
            if parent in converted or trained(holder, self.controller.optimized):
                continue
            restore_module(holder)
            rank_zero_info(
                f"{type(self).__name__}: {parent or 'the module'} holds a frozen copy of the converted network (its "
                f"layers {', '.join(n.rpartition('.')[2] for n in names)} were converted with it: an EMA or target "
                "network copied after setup); a frozen network drops no tokens, so they run their own forward"
            )

    def _scheduled_value(self) -> int:
        """The reserved length of the current step (or progress) with the current ``max_value``."""
        if self.clock == "progress":
            assert self.current_progress is not None
            return self.value_at_progress(self.current_progress)
        return self.value_at(self.current_step)

    def _reserved_length(self, seq_len: int) -> int:
        """``r`` of the current batch, called by the first LTD layer of a forward with the sequence length ``S`` it
        sees (:meth:`~lightning_effi.random_ltd.patching.LTDController.begin`): checks or resolves ``max_value``
        against ``S`` (:meth:`_see`), then the schedule's value."""
        self._see(int(seq_len))
        self.current_value = self._scheduled_value()
        return self.current_value

    def _see(self, seq_len: int) -> None:
        """``max_value`` against the sequence length the patched layers see.

        - ``max_value=None``: the first training forward of the run sets it to its length ``S`` (announced); a later,
          longer batch raises it to that length (variable-length batches: the schedule ends at the longest sequence
          seen, so the end of the growth drops nothing; announced once, logged as ``effi/random_ltd/max_value``;
          synchronised over data-parallel ranks at every optimizer step and checkpointed).
        - an explicit ``max_value``: checked once against the first training forward's length.

        With a Curriculum in the run (its first batches are shorter by design: truncated, or the shortest samples
        first) neither check applies to the first batch's length, and a first batch shorter than ``min_value`` passes
        through (``max_value`` is then ``min_value`` until a longer batch raises it; announced); under its
        ``seqlen_truncate`` or ``seqlen_reshape`` they apply to its longest batch instead
        (:meth:`_check_curriculum_end`).

        Raises:
            ValueError: ``min_value`` larger than the first derived length (no token would ever be dropped); an
                explicit ``max_value`` larger than the first training forward's length (the schedule would stop
                dropping early); neither with a Curriculum.
        """
        first, self._seen = not self._seen, True
        self._longest_seen = max(self._longest_seen, seq_len)
        if self._check_resumed:
            self._check_resumed = False  # set alike on every rank (the peek is reduced over them)
            longest = self._ranks_longest(seq_len) if self._world > 1 else seq_len
            if longest == self._data_length and not self._lengths_may_grow():
                # the layers see the data's own fixed length: the data's length bounds every batch. Otherwise (a
                # prefix, generated tokens of varying count) a later batch may be longer: a resume refused on an
                # 18-token first batch below the 22 the run had seen (qa115-regress 03)
                self._check_restored_max_value(longest)
        if first and not torch.is_grad_enabled() and not _in_backward():
            # a no_grad forward first (a rollout's prompt pass in train mode, or a reentrant checkpoint's forward): the
            # checks wait for the step's first forward with grad, or its backward (on_before_backward), and are run on
            # the length that trains (max_value=16 refused against an 8-token prompt, qa114-rl 04)
            self._first_pending, first = seq_len, False
        elif self._first_pending is not None and torch.is_grad_enabled() and not _in_backward():
            self._first_pending, first = None, True
        if first:
            seq_len, local = self._first_forward_checks(seq_len)
        self._derive_max_value(seq_len)

    def _first_forward_checks(self, seq_len: int) -> tuple[int, int]:
        """The checks of the run's first training forward on ``seq_len`` positions (:meth:`_see`); returns the length
        over the ranks and the rank's own."""
        first = True
        if first and self._world > 1:
            # over data-parallel ranks, the first batch is the longest of theirs (every rank calls this once): one
            # rank's shorter shard refused a valid min_value on that rank alone, and derived a max_value below it
            # there, while the others died waiting (qa113-ddp 01)
            local, seq_len = seq_len, self._ranks_longest(seq_len)
        else:
            local = seq_len
        if first and self._curriculum is None:
            # samples of different lengths: one batch's length does not bound an explicit max_value (on_train_end
            # warns when no batch reached it)
            where = "at the first training batch" + (" (the longest over the ranks)" if self._world > 1 else "")
            self._check_length(seq_len, where, explicit_max=not self._lengths_may_grow())
        if first:  # against the rank's own first batch, whose length moved by the layers' offset is read here
            self._refuse_never_dropping(local)
        if first and self._first_batch_length is not None:
            if self.max_value_arg is None:
                self._check_curriculum_units(local, self._first_batch_length)
            self._check_curriculum_end(local, self._first_batch_length)
        return seq_len, local

    def _derive_max_value(self, seq_len: int) -> None:
        """A derived ``max_value`` (``max_value=None``) follows the longest forward seen (:meth:`_see`)."""
        name = type(self).__name__
        if self.max_value_arg is not None:
            return
        if self.max_value is None:
            if self.min_value > seq_len and (self._curriculum is not None or self._lengths_may_grow()):
                self.max_value = self.min_value
                why = f"{self._curriculum} starts with short batches" if self._curriculum else "lengths vary"
                rank_zero_info(
                    f"{name}: the first training batch has {seq_len} tokens, fewer than min_value={self.min_value} "
                    f"({why}): nothing is dropped until batches are longer; "
                    "max_value follows the longest batch seen (logged as effi/random_ltd/max_value)"
                )
                return
            self.max_value = seq_len
            if self._world > 1:  # the ranks' longest is announced at the step's end (_announce_synced)
                return
            rank_zero_info(
                f"{name}: max_value = {seq_len} tokens, the sequence length the patched layers see at the first "
                f"training batch: the reserved length grows from min_value={self.min_value} to {seq_len}; pass "
                "max_value to set another end of the schedule"
            )
        elif seq_len > self.max_value:
            if not self._grown and self._world == 1:
                rank_zero_info(
                    f"{name}: a batch of {seq_len} tokens is longer than max_value={self.max_value} (derived from the "
                    "batches seen so far): the batches vary in length, so max_value follows the longest one seen "
                    "(logged as effi/random_ltd/max_value); pass max_value to fix it"
                )
                self._grown = True
            self.max_value = seq_len

    def _ranks_longest(self, seq_len: int) -> int:
        """The longest of ``seq_len`` over the data-parallel ranks (a max all-reduce; every rank calls it in its first
        training forward's first patched layer), ``seq_len`` when no process group is up."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return seq_len
        value = torch.tensor([seq_len], dtype=torch.int64, device=self._root_device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def _announce_synced(self, world: int) -> None:
        """With several data-parallel ranks, a derived ``max_value`` is the longest sequence over the ranks (synced at
        each optimizer step): announced once synced, as :meth:`_see` announces it in a single process (each rank's own
        first batch would announce a length the schedule does not use)."""
        value, name = self.max_value, type(self).__name__
        if value is None or value == self._announced:
            return
        if self._announced is None:
            if self._curriculum is None or value > self.min_value:
                rank_zero_info(
                    f"{name}: max_value = {value} tokens, the longest sequence the patched layers saw at the first "
                    f"training step over the {world} data-parallel ranks: the reserved length grows from "
                    f"min_value={self.min_value} to {value}; pass max_value to set another end of the schedule"
                )
        elif not self._grown:
            rank_zero_info(
                f"{name}: a batch of {value} tokens (on one of the {world} data-parallel ranks) is longer than "
                f"max_value={self._announced} (derived from the batches seen so far): the batches vary in length, so "
                "max_value follows the longest one seen (logged as effi/random_ltd/max_value); pass max_value to fix it"
            )
            self._grown = True
        self._announced = value

    def _fused_attention(self, pl_module: pl.LightningModule) -> bool:
        """Whether the network in place runs its attention on a fused scaled-dot-product kernel in training, whose
        backward recomputes the scores (:func:`~lightning_effi.core.flops.sdpa_recomputes`; the skipped FLOPs then
        include that recompute, :func:`~lightning_effi.random_ltd.functional.flops_per_layer`):

        - a module with ``fused_attention(dropout)`` (the reference Hugging Face tasks,
          ``lightning_effi/reference/tasks/language_models.py``), asked with the network config's attention dropout
          (``attn_pdrop``, ``attention_probs_dropout_prob`` or ``attention_dropout``);
        - timm attention modules (``fused_attn``, ``attn_drop``): any with ``fused_attn``, and
          ``sdpa_recomputes(device, attn_drop.p if training else 0)``;
        - else False (eager attention, or a module that does not say)."""
        if self.adapter is None:
            return False
        config = getattr(self.adapter.root, "config", None)
        ask = getattr(pl_module, "fused_attention", None)
        if config is not None and callable(ask):
            for key in ("attn_pdrop", "attention_probs_dropout_prob", "attention_dropout"):
                if isinstance(dropout := getattr(config, key, None), (int, float)):
                    return bool(ask(float(dropout)))
            return bool(ask(0.0))
        attention = [m for m in self.adapter.layers().modules() if isinstance(getattr(m, "fused_attn", None), bool)]
        if not any(m.fused_attn for m in attention):
            return False
        drop = next((m.attn_drop for m in attention if m.fused_attn and hasattr(m, "attn_drop")), None)
        p = float(getattr(drop, "p", 0.0)) if drop is not None and drop.training else 0.0
        return sdpa_recomputes(pl_module.device, p)

    def _note_skipped(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Tell, before the micro-batch is folded, whether it trained nothing (``training_step`` returned None under
        automatic optimization: no backward, :func:`~lightning_effi.core.state.open_batch_skipped`), as the
        EfficiencyMonitor does: its layer-tokens, samples and FLOPs are not counted (they were, and the layer-token
        figures and a layer-token LR schedule ran ahead of the monitor's on batches that trained nothing,
        qa83-compat 01)."""
        if not self._folded:
            self._skipped = open_batch_skipped(trainer, pl_module, self._backward_seen)

    def _fold_batch(self) -> None:
        """Add the current micro-batch's records to the pending step totals (once; nothing for a skipped one)."""
        if self._folded or self.controller is None or self.adapter is None:
            return
        self._folded = True
        self._step_micro += 1
        if self._skipped:  # the step's batch size still counts its samples (global_batch_size), forward run or not
            self._pending[5] += self._batch_costs()[0] or self._batch_rows
            return
        for i, value in enumerate(self._batch_costs()):
            self._pending[i] += value

    def _batch_costs(self) -> tuple[int, int, int, float, float]:
        """What the current micro-batch cost, from the shapes its LTD layers saw: ``(samples, layer-tokens,
        layer-tokens without dropping, layer FLOPs skipped, layer FLOPs without dropping)``, with the sizes of the
        network it ran on (fixed by :meth:`effi_before_model_change` when the network changed since)."""
        if self._batch_costs_fixed is not None:
            return self._batch_costs_fixed
        assert self.controller is not None and self.adapter is not None
        L, L_ltd = self.num_layers, len(self.layer_ids)
        h, inter = self.adapter.hidden_size(), self.adapter.intermediate_size()
        samples = layer_tokens = full_layer_tokens = 0
        saved = full_flops = 0.0
        # shapes only run under no_grad beside a forward that trains (a rollout's decoding steps in train mode) train
        # no tokens: 4,928 full layer-tokens counted for the 896 trained (qa114-rl 04); a step without any forward
        # with grad (a reentrant checkpoint's no_grad forward before its recompute is one with it) counts each once
        any_trained = any(any(rec.grads) for rec in self.controller.records)
        for rec in self.controller.records:
            # the forwards of this shape over other data: one per loader whose batch has its size (two loaders'
            # batches of one shape were counted once, half the monitor's layer-tokens, qa57-loops 02); a forward of
            # the same batch again (R-Drop) trains the same tokens, counted once, as the EfficiencyMonitor does
            trained = sum(1 for grad in rec.grads if grad) or (0 if any_trained and rec.grads else 1)
            loaders = self._part_sizes.count(rec.batch_size) if self._part_sizes else 1
            # or one per input of other values the network was called on: two augmented views of one loader's batch
            # (SimCLR, a contrastive pair) train two forwards' tokens (576 counted for 1,152, qa61-ideas 02)
            inputs = sum(
                1 for v in (*self._inputs, *self._block_inputs) if v.ndim and rec.batch_size in tuple(v.shape[:2])
            )
            forwards = 0 if trained == 0 else max(1, min(trained, max(loaders, inputs)))
            # the LTD layers that ran: a forward stopped before the last of them (forward_intermediates with
            # stop_early) neither computes nor saves anything in the others (qa114-dense 02)
            ran = len(rec.layers) if rec.layers else L_ltd
            samples += forwards * rec.batch_size
            layer_tokens += forwards * F.layer_tokens(
                rec.batch_size, rec.seq_len, rec.reserved_length, L - L_ltd + ran, ran
            )
            full_layer_tokens += forwards * rec.batch_size * rec.seq_len * (L - L_ltd + ran)
            for grad in rec.grads or [True]:  # each forward of the shape drops its tokens
                measured = self._measured_layer_flops(rec, grad) if rec.reserved_length < rec.seq_len else None
                if measured is not None:
                    full, skipped = measured
                    saved += skipped
                else:
                    # the formula counts forward + backward; a forward without grad is a third of it
                    share = 1.0 if grad else 1 / 3
                    full = share * F.flops_per_layer(rec.batch_size, rec.seq_len, h, inter, self._fused)
                    if rec.reserved_length < rec.seq_len:
                        kept = F.flops_per_layer(rec.batch_size, rec.reserved_length, h, inter, self._fused)
                        saved += ran * (full - share * kept)
                full_flops += (L - L_ltd + ran) * full
        return samples, layer_tokens, full_layer_tokens, saved, full_flops

    def _measured_layer_flops(self, rec: BatchRecord, grad: bool = True) -> tuple[float, float] | None:
        """``(training FLOPs of one LTD layer on the full sequence, FLOPs the LTD layers skipped)`` for one forward of
        the context ``rec`` in grad mode ``grad`` (forward and backward; without grad, the forward only), measured:
        an LTD layer's recorded call in that grad mode replayed on a fake copy of the layer under
        ``torch.utils.flop_counter`` on the full sequence and on the kept tokens (:mod:`lightning_effi.core.measure`),
        so that any attention (grouped-query, fused kernels), MLP or projection widths count as the
        ``EfficiencyMonitor`` measures the network. None where no call was recorded, or when a replay failed (then
        :func:`~lightning_effi.random_ltd.functional.flops_per_layer` is used, with one warning).

        A replay costs about a second on a CPU, and the reserved length (and a curriculum's sequence length) changes
        from step to step, so each layer is replayed at two lengths only: a transformer layer's training FLOPs on ``T``
        tokens are ``B (a T + c T²)`` (token-wise matrices, attention over token pairs), and ``a``, ``c`` are solved
        from the full and the kept call (one model for each set of the layer's argument sizes on axes other than the
        sequence and the batch, ``LayerCalls.fixed``: a decoder layer's encoder length). It is then checked, exactly, at
        recorded shapes with lengths it was not measured at, and used once it held at :data:`LAYER_FLOPS_CHECKS` new
        lengths and the lengths measured do not all share a residue modulo some ``m > 1`` (a layer that pads its tokens
        to a multiple of ``m`` follows the model at one residue only), for lengths between the shortest and the longest
        measured only (never extrapolated: a layer switching to windowed attention above some length); until then, and
        outside that range, every shape is replayed (a new length measured that way is one more check), and a layer that
        fails a check is replayed at every shape. An ``EfficiencyMonitor(interpolate_flops=False)`` in the Trainer turns
        the model off: every shape replayed."""
        if self._measure_failed or self.controller is None or self.adapter is None:
            return None
        layers = self.adapter.layers()
        full = skipped = Fraction(0)
        counted = 0
        for k, i in enumerate(self.layer_ids):
            if rec.layers and k not in rec.layers:  # an LTD layer the forward did not reach: no saving
                continue
            if i >= len(layers):
                return None
            per_layer = self._layer_flops(i, layers[i], rec, grad)
            if per_layer is None:
                return None
            full += per_layer[0]
            skipped += per_layer[0] - per_layer[1]
            counted += 1
        return (float(full / counted), float(skipped)) if counted else None

    def _layer_flops(
        self, i: int, layer: nn.Module, rec: BatchRecord, grad: bool = True
    ) -> tuple[Fraction, Fraction] | None:
        """FLOPs of LTD layer ``i`` on ``rec``'s full and kept tokens in grad mode ``grad`` (see
        :meth:`_measured_layer_flops`; each grad mode has its own calls and its own model)."""
        assert self.controller is not None
        b, s, r = rec.batch_size, rec.seq_len, rec.reserved_length
        pair = self.controller.calls.get((i, b, s, r, grad))
        # one model per set of the arguments' other sizes (a cross-attention's encoder length)
        key = (i, structure_key(layer), grad, None if pair is None else pair.fixed)
        model = self._flops_models.get(key)
        if (
            self._predict_layer_flops
            and isinstance(model, tuple)
            and _layer_model_checked(model)
            and min(model[2]) <= r < s <= max(model[2])  # never extrapolated: lengths inside those measured
        ):
            a, c = model[0], model[1]
            return b * (a * s + c * s * s), b * (a * r + c * r * r)
        if pair is None:
            return None
        root = nn.Module()
        root.layer = layer
        try:
            on_full, on_kept = (
                Fraction(self._meter.flops(root, [pair.full])),
                Fraction(self._meter.flops(root, [pair.kept])),
            )
        except MeasureError as err:
            self._measure_failed = True
            rank_zero_warn(
                f"{type(self).__name__}: the FLOPs random-LTD skips are computed by a formula for a standard "
                f"transformer layer (a layer's call could not be replayed: {err}); they may be off for this layer"
            )
            return None
        if model is None:  # solve B (a T + c T²) at T = S and T = r
            y_full, y_kept = on_full / (b * s), on_kept / (b * r)  # a + c T
            c = (y_full - y_kept) / (s - r)
            self._flops_models[key] = (y_full - c * s, c, frozenset((s, r)), 0)
        elif isinstance(model, tuple) and {s, r} - model[2]:  # a length the model was not measured at: a check
            a, c, lengths, checks = model
            exact = on_full == b * (a * s + c * s * s) and on_kept == b * (a * r + c * r * r)
            self._flops_models[key] = (a, c, lengths | {s, r}, checks + 1) if exact else "direct"
        return on_full, on_kept

    def _fold_step(self, trainer: pl.Trainer) -> None:
        self._fold_batch()
        local = torch.tensor(self._pending, dtype=torch.float64, device=trainer.strategy.root_device)
        total = trainer.strategy.reduce(local, reduce_op="sum") if trainer.world_size > 1 else local
        samples, actual, full, saved, full_flops, skipped = (float(x) for x in total.cpu())
        self._pending = [0, 0, 0, 0.0, 0.0, 0]
        if self.max_value_arg is None and trainer.world_size > 1:
            # a derived max_value follows each rank's longest batch: every rank continues with the longest of all
            seen = torch.tensor([self.max_value or 0], dtype=torch.int64, device=trainer.strategy.root_device)
            longest = int(trainer.strategy.reduce(seen, reduce_op="max").item())
            self.max_value = longest or None
            self._announce_synced(trainer.world_size)
        if self.accounting == "deepspeed" and self.max_value is not None:
            L, L_ltd = self.num_layers, len(self.layer_ids)
            self.consumed_layer_tokens += int(samples) * (self.current_value * L_ltd + self.max_value * (L - L_ltd))
        else:
            self.consumed_layer_tokens += int(round(actual))
        self.full_layer_tokens += int(round(full))
        self.consumed_samples += int(samples)
        if not self.global_batch_size:  # with a skipped micro-batch's samples (4 for 8 made the expected total half
            # the run's layer-tokens, qa84-break 01)
            self.global_batch_size = int(samples + skipped)
            self.micro_batches = self._first_micro_batches(trainer)
        last = _epochs_last_batch(trainer)
        if self._fit_step_batch is None or (self._fit_step_batch[3] and not last):
            # this fit's first step, replaced by its first that is not an epoch's last batch (a smaller one there
            # warned of another batch size, qa94-regress 04; one where every step ends an epoch warned of nothing,
            # qa95-regress 01): a resumed fit's batch may differ from the checkpoint's
            micro = max(self._step_micro, 1)
            self._fit_step_batch = (int(samples + skipped), micro, int(trainer.accumulate_grad_batches), last)
        self._step_micro = 0
        self.saved_flops += saved
        self.full_layer_flops += full_flops

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """The non-finite loss policy (``nonfinite_loss``, :class:`~lightning_effi.core.nonfinite.NonFiniteLossGuard`):
        before the backward pass of a NaN / infinite training loss, raise or count it.

        Raises:
            NonFiniteLossError: the loss is not finite and ``nonfinite_loss="raise"`` (here or on another technique).
        """
        self._backward_seen = True
        if self._first_pending is not None:  # the step ran no forward with grad beside its no_grad one (_see)
            pending, self._first_pending = self._first_pending, None
            self._first_forward_checks(max(pending, self._longest_seen))
        self.nonfinite_guard.check(trainer, loss)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._note_skipped(trainer, pl_module)
        self._fold_step(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._steps_check.batch_end(trainer)
        self._note_skipped(trainer, pl_module)
        self._fold_batch()  # micro-batches before the last one of an accumulation window
        if not pl_module.automatic_optimization and any(self._pending):
            self._fold_step(trainer)
        assert self.controller is not None
        self.controller.end()
        self._unwatch_inputs()
        if not self._ran_checked:  # the first training batch of the fit
            self._ran_checked = True
            if not self.controller.records:
                rank_zero_warn(
                    f"{type(self).__name__}: the patched layers ({type(self.adapter).__name__ if self.adapter else '?'}"
                    f" on pl_module.{self.model_attr or '<auto>'}) did not run in the first training step, so random-"
                    "LTD drops nothing: that network is not the one training_step trains (an EMA copy, a teacher?); "
                    "name the trained network with model_attr"
                )
            else:
                self._check_layout(trainer, batch, self.controller.records[0])
        frac = self._saved_frac() if self._frac_fixed is None else self._frac_fixed
        metrics = {
            "effi/random_ltd/reserved_length": float(self.current_value),
            "effi/random_ltd/consumed_layer_tokens": float(self.consumed_layer_tokens),
            "effi/random_ltd/flops_saved_frac": frac,
            "effi/random_ltd/ltd_layers": float(self._batch_ltd_layers),
            "effi/random_ltd/max_value": float(self.max_value or 0),
        }
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        self.nonfinite_guard.log_count(trainer)  # effi/nonfinite_losses, by the stack's checking guard only

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Report the non-finite training losses the run went on after (``nonfinite_loss="warn"``), if any, and warn
        when the run dropped no token at all (every batch at most as long as its reserved length: a ``min_value`` at
        or above the data's sequence length that no setup check could see, e.g. under a curriculum over a training
        set too large to read at setup)."""
        self._unwatch_inputs()
        self.nonfinite_guard.report_at_end()
        short = shorter_than_resolved(trainer, self._resolved_against)
        if short is not None and self.clock == "step" and not self._finished(self.require_steps, trainer.global_step):
            given = str(self.require_duration)
            rank_zero_warn(
                f"{type(self).__name__}: {short}: require_steps={given!r} resolved to {self.require_steps} steps, and "
                f"the reserved length ended at {self.current_value} tokens, below max_value={self.max_value}: the run "
                "never trained on the full sequences (a schedule cut short, its layer-token saving larger than the "
                "planned one's)"
            )
        explicit = self.max_value_arg
        longest, reached = self._longest_seen, self.current_value or 0
        if explicit is not None and self._lengths_may_grow() and 0 < longest < explicit and reached >= longest:
            rank_zero_warn(
                f"{type(self).__name__}: max_value={explicit}, but the longest batch the patched layers saw in this "
                f"fit was {longest} tokens: the reserved length reached {longest} before the end of its growth and "
                "dropped nothing from then on (a smaller saving than the schedule says); pass max_value <= "
                f"{longest}, or max_value=None (it follows the longest batch seen)"
            )
        if self.full_layer_tokens > 0 and self.consumed_layer_tokens >= self.full_layer_tokens:
            longest = f" (the longest this fit: {self._longest_seen} tokens)" if self._longest_seen else ""
            rank_zero_warn(
                f"{type(self).__name__}: no token was dropped in this run: the reserved length (min_value="
                f"{self.min_value} growing to max_value={self.max_value}) was never below a batch's sequence "
                f"length{longest}, so random-LTD saved nothing (random_ltd/layer_token_saving = 0). Lower min_value "
                "below the batches' length, or check the data's sequence length"
            )

    def _saved_frac(self) -> float:
        """The share of the layers' FLOPs the current micro-batch skipped (:meth:`_batch_costs`), else 0."""
        records = self.controller.records if self.controller is not None else []
        if not records or self.adapter is None:
            return 0.0
        *_, saved, full = self._batch_costs()
        return saved / full if full else 0.0

    # ------------------------------------------------------------------------------------------------ accounting
    def effi_adjust(self, stats: BatchStats, batch: Any, pl_module: pl.LightningModule) -> BatchStats:
        """Lower the EfficiencyMonitor's layer-tokens and FLOPs of the current batch by what the LTD layers skipped."""
        if self.controller is None or self.adapter is None or not self.controller.records:
            return stats
        _, ltd_lt, full_lt, saved, _ = self._batch_costs()
        layer_tokens = stats.layer_tokens
        if full_lt and self._drops_in_counted_blocks(pl_module):
            layer_tokens = round(stats.layer_tokens * ltd_lt / full_lt)
        return dataclasses.replace(stats, layer_tokens=int(layer_tokens), flops=max(0.0, stats.flops - saved))

    def _drops_in_counted_blocks(self, pl_module: pl.LightningModule) -> bool:
        """Whether the Trainer's ``EfficiencyMonitor`` counts layer-tokens on the layers random-LTD drops tokens in
        (or on a stack of the module's own definition, ``effi_num_layers`` / ``effi_count_tokens``). A decoder's LTD
        layers beside the encoder the monitor counts: the decoder's kept share lowered the encoder's layer-tokens, a
        saving of a stack that dropped nothing (qa110-seq2seq); said once, and the layer-tokens are left whole."""
        if self.adapter is None or any(
            getattr(pl_module, hook, None) is not None for hook in ("effi_num_layers", "effi_count_tokens")
        ):
            return True
        monitor = next((c for c in pl_module.trainer.callbacks if isinstance(c, EfficiencyMonitor)), None)  # type: ignore[attr-defined]
        counted = None if monitor is None else monitor.find_blocks(pl_module)
        layers = self.adapter.layers()
        if counted is None or (len(counted) == len(layers) and all(a is b for a, b in zip(counted, layers))):
            return True
        if not self._warned_other_blocks:
            self._warned_other_blocks = True
            names = {id(m): n for n, m in pl_module.named_modules()}
            rank_zero_warn(
                f"{type(self).__name__}: random-LTD drops tokens in {names.get(id(layers), '?')} ({len(layers)} "
                f"layers), but the EfficiencyMonitor counts layer-tokens on {names.get(id(counted), '?')} "
                f"({len(counted)} blocks): its layer_tokens leave random-LTD's saving out (random_ltd/"
                "layer_token_saving has it, on its own layers); the FLOPs, measured on the whole network, include it"
            )
        return False

    def effi_schedule_state(self) -> dict[str, float]:
        """``{"reserved_length": r}``: the tokens each random-LTD layer keeps now (Yao et al. 2022, Sec. 3.1)."""
        return {"reserved_length": float(self.current_value)}

    def effi_summary(self) -> dict[str, Any]:
        return {
            "random_ltd/consumed_layer_tokens": int(self.consumed_layer_tokens),
            "random_ltd/full_layer_tokens": int(self.full_layer_tokens),
            "random_ltd/layer_token_saving": 1 - self.consumed_layer_tokens / self.full_layer_tokens
            if self.full_layer_tokens
            else 0.0,
            "random_ltd/layer_flops_saved_fraction": self.saved_flops / self.full_layer_flops
            if self.full_layer_flops
            else 0.0,
        }

    # ------------------------------------------------------------------------------------------------ state
    def config(self) -> dict[str, Any]:
        return {
            "min_value": self.min_value,
            "max_value": self.max_value,
            "require_steps": self.require_steps,
            "seq_per_step": self.seq_per_step,
            "layer_ids": list(self.layer_ids),
            "rounding": self.rounding,
            "seed": self.seed,
            "keep_prefix_tokens": self.keep_prefix_tokens,
            "accounting": self.accounting,
            "clock": self.clock,
            "require_progress": self.require_progress,
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed_layer_tokens": int(self.consumed_layer_tokens),
            "full_layer_tokens": int(self.full_layer_tokens),
            "consumed_samples": int(self.consumed_samples),
            "saved_flops": float(self.saved_flops),
            "full_layer_flops": float(self.full_layer_flops),
            "current_step": int(self.current_step),
            "current_value": int(self.current_value),
            "global_batch_size": int(self.global_batch_size),
            "micro_batches": int(self.micro_batches),
            "config": self.config(),
            "nonfinite_loss": self.nonfinite_guard.state_dict(),
        }

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Lightning calls this right before :meth:`load_state_dict` whenever a checkpoint is restored, for ``fit``
        (a resumed run) and for ``validate`` / ``test`` / ``predict`` (``ckpt_path=...``). Outside ``fit`` note it
        (the state is then ignored, see :meth:`load_state_dict`) and check nothing: random-LTD drops tokens in
        training only, so the checkpoint's weights evaluate as they are. For ``fit``, detect a checkpoint written by
        a random-LTD callback with other identity arguments (stored under another ``state_key``).

        A state under another ``state_key`` whose identity arguments differ only in how ``require_steps`` is given
        (``4`` against ``"0.5dur"`` of 8 steps) is this callback's: :meth:`load_state_dict` and ``on_train_start``
        compare the resolved schedules. It is taken with a warning that says so (Lightning has just warned that the
        callback of that state is missing). With other settings it is a mismatch; ``strict=False`` warns and takes
        the state too (its counters go on).

        Raises:
            ValueError: (``fit``, ``strict``) the checkpoint holds a random-LTD state written with other settings
                (each named with both values); (``fit``) several random-LTD states, none under this ``state_key``.
        """
        self._evaluating = trainer.state.fn != TrainerFn.FITTING
        if self._evaluating:
            return
        check_coarse_vcycle_resume(type(self).__name__, trainer, checkpoint)
        others = other_state_keys(self, checkpoint)
        if len(others) > 1:
            raise ValueError(
                f"RandomLTDCallback: the checkpoint holds {len(others)} random-LTD states, none written with this "
                f"callback's settings ({self.state_key}): {others}; resume with the callbacks it was written with"
            )
        if others:
            # the state key holds require_steps as given (an int, or None for a fraction or epochs): the same steps
            # spelled otherwise ("0.6dur" for 6 of 10) were refused, though load_state_dict compares the resolved
            # schedule (qa90-resume 01). Another setting is a mismatch; with strict=False the checkpoint's state is
            # still this callback's, or its counters (consumed layer-tokens, samples) restarted at the resume step
            # and the recorded saving was wrong (qa90-resume 02)
            differ = self._key_differences(others[0])
            if list(differ) != ["require_steps"]:
                shown = "; ".join(f"{k}: {a} in the checkpoint, {b} now" for k, (a, b) in differ.items())
                self._mismatch(f"the checkpoint was written with other settings ({shown or others[0]})")
                self._mismatch_told = True
            else:  # Lightning warned just before this hook that the state's callback is missing (qa91-break 07)
                written, now = differ["require_steps"]
                rank_zero_warn(
                    f"{type(self).__name__}: the checkpoint's state {others[0]!r} is this callback's: it was written "
                    f"with require_steps={written}, given now as {self._require_steps_shown()}, and is restored "
                    "(the schedules are compared when training starts). Lightning's warning 'Please add the "
                    "following callbacks' about that state can be ignored."
                )
            checkpoint["callbacks"][self.state_key] = checkpoint["callbacks"][others[0]]

    def _key_differences(self, key: str) -> dict[str, tuple[str, str]]:
        """The identity arguments in which the state key ``key`` of a checkpoint differs from this callback's, as
        ``{name: (checkpoint's, this callback's)}`` in words ({} when ``key`` cannot be read)."""
        theirs, mine = state_key_fields(self, key), state_key_fields(self, self.state_key)
        if theirs is None or mine is None:
            return {}
        derived = {"require_steps": "a fraction or epochs of the run", "max_value": "derived from the data"}

        def said(name: str, value: Any) -> str:
            return derived.get(name, "None") if value is None and name in derived else repr(value)

        return {
            k: (said(k, theirs.get(k)), said(k, mine.get(k)))
            for k in sorted(set(theirs) | set(mine))
            if theirs.get(k) != mine.get(k)
        }

    def _mismatch(self, message: str, fix: str = "resume with this configuration") -> None:
        config_mismatch(type(self).__name__, message, self.strict, fix=fix)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the schedule's position and the token / FLOPs counters of a resumed ``fit``; the configuration is
        compared with this callback's (a derived ``max_value`` and a derived schedule are taken from the checkpoint,
        the latter compared at ``on_train_start``).

        Outside ``fit`` (``trainer.validate/test/predict(ckpt_path=...)``, told by :meth:`on_load_checkpoint`) the
        state is ignored entirely: no configuration comparison (the evaluating Trainer never ran this callback's
        ``setup``, so its layer ids are unresolved; a checkpoint written at a V-cycle's coarse level has other
        ones) and no change to this callback's state (e.g. that of the fit that ran before on the same Trainer).
        The evaluation runs the full model, as without random-LTD.

        Every field is validated like a constructor argument before anything is restored (:meth:`_checked_state`).

        Raises:
            ValueError: a field of the wrong type or range, naming it (:meth:`_checked_state`); (``fit``, ``strict``)
                the checkpoint's configuration differs.
        """
        if self._evaluating:
            self._evaluating = False
            return
        fields = self._checked_state(state_dict)
        saved, mine = dict(state_dict["config"]), self.config()
        saved.setdefault("clock", "step")  # written before the progress clock existed
        saved.setdefault("require_progress", None)
        if self.max_value_arg is None:
            # derived from the data: the run goes on with the checkpoint's value (it only grows from there)
            restored, _ = saved.pop("max_value", None), mine.pop("max_value", None)
            if restored is not None:
                # the checkpoint's value, not the larger of it and setup's: with a seqlen curriculum setup sets its
                # longest batch, and the checkpoint holds that moved by the step's own label shift (33 for 32 after a
                # resume: another schedule than the uninterrupted run's, qa49-peft 01)
                self.max_value = int(restored)
                self._seen = True
        # the schedule: on_train_start compares what the current arguments give in this run (clock too) with the
        # checkpoint's, one rule for one step count however spelled (an int was compared here, and refused where a
        # fraction giving the same count resumed at max_value, qa91-regress 04)
        schedule = {key: saved.pop(key) for key in ("clock", "require_steps", "require_progress")}
        for key in schedule:
            mine.pop(key)
        derived = self.require_steps_arg is None
        if schedule["require_steps"] is not None:
            schedule["require_steps"] = int(schedule["require_steps"])
            if derived:
                self.require_steps = schedule["require_steps"]
        if schedule["require_progress"] is not None:
            schedule["require_progress"] = int(schedule["require_progress"])
            if derived:
                self.require_progress = schedule["require_progress"]
        # a checkpoint written before the schedule was resolved (LearningRateFinder / BatchSizeFinder save one at
        # on_fit_start and restore it after their search) has nothing to compare: on_train_start resolves it
        unresolved = schedule["require_steps"] is None and schedule["require_progress"] is None
        self._saved_schedule = None if unresolved else schedule
        diff = settings_diff(saved, mine)
        if diff and not self._mismatch_told:  # strict=False: on_load_checkpoint warned of the settings already
            self._mismatch(f"the checkpoint's configuration differs (checkpoint, now): {diff}")
        self._mismatch_told = False
        for key, value in fields.items():
            setattr(self, key, value)
        self._resumed = True
        if "nonfinite_loss" in state_dict:  # written before the non-finite policy existed: nothing to restore
            self.nonfinite_guard.load_state_dict(state_dict["nonfinite_loss"])

    def _checked_state(self, state: Any) -> dict[str, Any]:
        """The counters of a checkpoint's state, validated: ``consumed_layer_tokens``, ``full_layer_tokens``,
        ``consumed_samples``, ``global_batch_size``, ``micro_batches`` (both optional, default 0) ints >= 0;
        ``saved_flops``, ``full_layer_flops`` finite floats >= 0; ``current_step`` an int >= -1 (-1: saved before the
        first training batch); ``current_value`` an int in ``[lowest, max_value]`` of the checkpoint's own
        configuration (``lowest``: ``min_value``, or with ``rounding="deepspeed"`` ``min_value`` rounded down to a
        multiple of ``seq_per_step``; ``max_value`` when it was resolved); ``config`` a mapping; ``nonfinite_loss`` a
        mapping the guard accepts (:meth:`~lightning_effi.core.nonfinite.NonFiniteLossGuard.load_state_dict`).

        Raises:
            ValueError: a missing key or a value of the wrong type or range, naming the field.
        """
        owner = f"{type(self).__name__} checkpoint"
        if not isinstance(state, dict):
            raise ValueError(f"{owner}: the state must be a dict, got {type(state).__name__}")
        required: tuple[str, ...] = ("consumed_layer_tokens", "full_layer_tokens", "consumed_samples", "saved_flops")
        required += ("full_layer_flops", "current_step", "current_value", "config")
        missing = [key for key in required if key not in state]
        if missing:
            raise ValueError(
                f"{owner}: the state lacks {', '.join(missing)} (not a random-LTD state, or a damaged one)"
            )
        config = state["config"]
        if not isinstance(config, dict):
            raise ValueError(f"{owner}.config must be a dict of the callback's settings, got {config!r}")
        # the schedule (compared at train start): int(2.5) was taken as 2 steps, a missing key raised a bare KeyError
        # (qa92-break 04)
        if "require_steps" not in config:
            raise ValueError(f"{owner}.config lacks require_steps (not a random-LTD state, or a damaged one)")
        for key in ("require_steps", "require_progress"):
            if config.get(key) is not None:
                check_int(owner, f"config.{key}", config[key], minimum=1)
        if config.get("clock", "step") not in CLOCKS:
            raise ValueError(f"{owner}.config.clock must be one of {list(CLOCKS)}, got {config['clock']!r}")
        if not isinstance(guard := state.get("nonfinite_loss", {}), dict):
            raise ValueError(f"{owner}.nonfinite_loss must be a dict (count, first_step), got {guard!r}")
        NonFiniteLossGuard(type(self).__name__).load_state_dict(guard)  # validates it (restored after the rest)
        out: dict[str, Any] = {
            key: check_int(owner, key, state[key], minimum=0)
            for key in ("consumed_layer_tokens", "full_layer_tokens", "consumed_samples")
        }
        out["global_batch_size"] = check_int(owner, "global_batch_size", state.get("global_batch_size", 0), minimum=0)
        out["micro_batches"] = check_int(owner, "micro_batches", state.get("micro_batches", 0), minimum=0)
        for key in ("saved_flops", "full_layer_flops"):
            out[key] = check_real(owner, key, state[key], low=0)
        out["current_step"] = check_int(owner, "current_step", state["current_step"], minimum=-1)
        # the bounds of the reserved length under the checkpoint's own settings (this callback's where they are bad)
        low_cfg: Any = config.get("min_value")
        high_cfg: Any = config.get("max_value")
        sps_cfg: Any = config.get("seq_per_step")
        min_value = int(low_cfg) if is_int(low_cfg) and low_cfg >= 1 else self.min_value
        sps = int(sps_cfg) if is_int(sps_cfg) and sps_cfg >= 1 else self.seq_per_step
        lowest = min_value - min_value % sps if config.get("rounding", self.rounding) == "deepspeed" else min_value
        highest = int(high_cfg) if is_int(high_cfg) and high_cfg >= min_value else None
        value = state["current_value"]
        out["current_value"] = check_int(owner, "current_value", value, minimum=lowest, maximum=highest)
        return out


def _slot_names(cls: type) -> set[str]:
    """The (mangled) names of the ``__slots__`` attributes over ``cls``'s MRO, as ``copyreg._slotnames`` lists them."""
    found: set[str] = set()
    for klass in cls.__mro__:
        names = klass.__dict__.get("__slots__", ())
        for name in (names,) if isinstance(names, str) else names:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"
            found.add(name)
    return found


def _slot_values(obj: object) -> dict[str, Any]:
    """The values of ``obj``'s ``__slots__`` attributes that are set, by their (mangled) names."""
    return {name: getattr(obj, name) for name in sorted(_slot_names(type(obj))) if hasattr(obj, name)}


def _epochs_last_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch under way is its epoch's last (maybe smaller, or closing a shorter accumulation window)."""
    progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
    return bool(getattr(progress, "is_last_batch", False))


RandomLTD = RandomLTDCallback  # the short name (``lightning_effi.callbacks.RandomLTD``, Hydra configs)


def _deepspeed_total_layer_num(ds_config: Any) -> int | None:
    """``random_ltd.total_layer_num`` of a DeepSpeed config that :func:`parse_deepspeed_config` accepted (a dict at any
    of its levels, or a JSON file's path); None where it cannot be read again."""
    from lightning_effi.random_ltd.config import _block

    try:
        with warnings.catch_warnings():  # told once, when the config was parsed
            warnings.simplefilter("ignore")
            block, _ = _block(ds_config)
    except (ValueError, OSError, TypeError):
        return None
    total = block.get("total_layer_num") if isinstance(block, Mapping) else None
    return int(total) if is_int(total) else None


def _first_shape(batch: Any, depth: int = 0) -> tuple[int, ...] | None:
    """The shape of the first tensor of a batch (a tensor, or one inside its mappings, lists and tuples, 4 levels
    deep), or None."""
    if isinstance(batch, Tensor):
        return tuple(batch.shape)
    if depth < 4 and isinstance(batch, Mapping):
        batch = list(batch.values())
    if depth < 4 and isinstance(batch, (list, tuple)):
        for item in batch:
            if (shape := _first_shape(item, depth + 1)) is not None:
                return shape
    return None
