"""``RandomLTDCallback``: random layerwise token dropping for any transformer LightningModule.

Yao et al., "Random-LTD: Random and Layerwise Token Dropping Brings Efficient Training for Large-scale Transformers"
(NeurIPS 2022, arXiv 2211.11586), Sec. 3; DeepSpeed Data Efficiency (Li et al., arXiv 2212.03597); reference
``deepspeed/runtime/data_pipeline/data_routing/``. The method card is ``README.md`` beside this file.

The method lives in :mod:`lightning_effi.random_ltd.functional` (selection, gather/scatter, schedule, accounting) and
:mod:`lightning_effi.random_ltd` (layer patching); this callback wires them into Lightning:

- ``setup("fit")``: checks the combination with the other technique callbacks
  (:func:`~lightning_effi.core.requirements.check_trainer`), finds the model through an adapter (``hf_gpt2``,
  ``hf_bert``, ``timm_vit``, or a :class:`~lightning_effi.adapters.GenericAdapter`), validates ``layer_ids`` and the
  schedule, and patches the selected layers' ``forward`` on the instance (before DDP wrapping and before checkpoint
  weights load; ``state_dict`` keys are unchanged). ``teardown`` restores them.
- ``on_train_batch_start``: reserved length ``r`` for ``trainer.global_step`` (all micro-batches of one optimizer step
  share it) and a fresh index context keyed by ``(global_step, batch_idx)``, seeded with ``(seed, step, batch_idx,
  rank)``.
- ``on_before_optimizer_step``: adds the step's layer-tokens (summed over micro-batches and ranks) to
  ``consumed_layer_tokens``, before a step-interval LR scheduler reads it.
- ``effi_adjust``: lowers the :class:`~lightning_effi.core.accounting.EfficiencyMonitor`'s layer-tokens and FLOPs.
- ``effi_before_model_change`` / ``effi_after_model_change``
  (:class:`~lightning_effi.core.protocols.FollowsModelChanges`): a technique that replaces the network (the V-cycle)
  calls them around every change: the patched layers are restored, then the adapter is found again on the new
  network, the LTD layer ids are resolved for its depth and its layers are patched; the schedule (a function of
  ``global_step``) and the counters go on.
- ``state_dict``: counters and the resolved configuration (safe-loadable); the schedule and the draws are pure
  functions of the step, so a resumed run continues exactly.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_effi.core.accounting import BatchStats
from lightning_effi.core.checks import check_bool, check_choice, check_int, check_real, is_int, is_real
from lightning_effi.core.progress import Duration, run_length, steps_per_epoch
from lightning_effi.core.protocols import PlansModelChanges
from lightning_effi.core.requirements import BATCH_STRUCTURES, Requirements, check_trainer
from lightning_effi.core.state import config_mismatch, other_state_keys, settings_diff
from lightning_effi.models.base import TransformerAdapter, find_adapter
from lightning_effi.random_ltd import functional as F
from lightning_effi.random_ltd.patching import LTDController, PatchedLayers, convert, resolve_layer_ids, restore


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


class RandomLTDCallback(Callback):
    """Random-LTD: selected layers process a random sorted subset of ``r`` tokens per sample in training.

    Args:
        min_value: reserved length at step 0 (tokens, >= 1). DeepSpeed key ``random_ltd_schedule.min_value``.
        max_value: reserved length at the end of the schedule; default: the model's sequence length (HF
            ``n_positions`` / ``max_position_embeddings``, ViT patches + prefix tokens).
        require_steps: length of the linear growth: an int of optimizer steps, exactly as DeepSpeed's
            ``schedule_config.require_steps`` (>= 1), or a :class:`~lightning_effi.core.progress.Duration` or what
            ``Duration.parse`` reads: ``"500st"``, ``"0.8dur"`` (a fraction in ``(0, 1]`` of the run's ``T``
            optimizer steps, ``max(1, ceil(f · T))``, ``T`` = the smaller of ``trainer.max_steps`` and
            ``trainer.estimated_stepping_batches`` (:func:`~lightning_effi.core.progress.run_length`, as the V-cycle
            reads it), read at train start), ``"2ep"`` (``n · ceil(num_training_batches /
            accumulate_grad_batches)`` steps, read at train start). No floats (write ``"0.8dur"``), no tokens.
            Default: the whole run (``"1dur"``).
        require_fraction: deprecated (one release, ``DeprecationWarning``): ``require_fraction=f`` is
            ``require_steps="<f>dur"``.
        seq_per_step: ``r`` is a multiple of this (``schedule_config.seq_per_step``).
        layer_ids: exact indices into the adapter's layer list; default all but the first and the last. With a
            technique that replaces the network during fit (the V-cycle's levels have fewer layers), the ids are
            resolved again for every network: the default is all but the first and the last layer of the network
            in place (so every level needs >= 3 layers); explicit ids are kept as they are and must exist at every
            level (ids < the smallest depth), checked in ``setup`` against the depths of all levels.
        adapter: ``"auto"``, a registered name (``hf_gpt2``, ``hf_bert``, ``timm_vit``) or an adapter instance.
        rounding: ``"clamped"`` (default: never below ``min_value``, ``max_value`` from ``require_steps`` on) or
            ``"deepspeed"`` (DeepSpeed's arithmetic exactly).
        keep_prefix_tokens: positions always kept (counted inside ``r``); ``"auto"`` = the model's prefix tokens
            (ViT class token).
        accounting: ``"actual"`` (layer-tokens from each batch's real length and ``min(r, S)``) or ``"deepspeed"``
            (``global_batch · (r · L_ltd + max_value · (L − L_ltd))`` per optimizer step).
        seed: seeds the token draws with the step, micro-batch and rank (global RNGs untouched).
        strict: a checkpoint written with other settings raises on load (False: warns, keeps this configuration). A
            derived ``require_steps`` (a fraction or epochs) is compared when training starts: the current arguments
            resolved in this run against the checkpoint's step count (a longer run with a fraction differs too);
            False: warns and the schedule continues with the current arguments' step count.

    Attributes:
        requirements: what random-LTD needs and changes (it patches the selected layers' ``forward``; it never reads
            the batch, so any batch structure), read by :func:`~lightning_effi.core.requirements.check_trainer`.

    Composition: with the V-cycle (any :class:`~lightning_effi.core.protocols.PlansModelChanges` technique) the
    patch follows every level change (the layers of the model in place are the patched ones, the reserved length
    stays a function of ``global_step``, layer-tokens count the layers of the model each step trained). With the
    Curriculum's ``seqlen_truncate`` (or ``seqlen_reshape``), a batch not longer than ``r`` passes through unchanged.

    Logged every step: ``effi/random_ltd/reserved_length``, ``effi/random_ltd/consumed_layer_tokens``,
    ``effi/random_ltd/flops_saved_frac``. Summary keys ``random_ltd/*`` (``result.json``).

    Raises:
        ValueError: (construction) a value of the wrong type or range, ``min_value > max_value``; (``setup``) no
            adapter matches the model, ``layer_ids`` out of range / duplicated / unsorted, ``min_value`` or
            ``max_value`` larger than the model's sequence length, a layer whose ``forward`` takes arguments the
            adapter does not know, an unsupported attention implementation; ``layer_ids`` (explicit, or the default
            selecting none) that do not exist at a level of a technique that replaces the network (the V-cycle;
            every level's depth is checked); a reserved length that never drops a token under the Curriculum's
            sequence-length truncation (``min_value`` not below its longest truncated length,
            ``seqlen_truncate``'s ``max_difficulty``, + 1 with ``causal_label_shift``; ``seqlen_reshape``:
            ``max_difficulty + 1``); (after a model change) no adapter matches the new network; (train start)
            ``require_steps`` cannot be derived (a fraction of a run of unknown length, epochs of a train dataloader
            without a length); (train start, ``strict``) a resumed run whose ``require_steps`` resolves to another
            step count than the checkpoint's.
        IncompatibleTechniques: (``setup``) combined with another technique that patches layers, see
            :data:`~lightning_effi.core.requirements.CONFLICTS` (a shape change is followed:
            ``follows_model_changes``).
    """

    requirements = Requirements(patches_layers=True, follows_model_changes=True, batch_structures=BATCH_STRUCTURES)

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
        keep_prefix_tokens: int | Literal["auto"] = 0,
        accounting: Literal["actual", "deepspeed"] = "actual",
        seed: int = 1234,
        strict: bool = True,
    ) -> None:
        name = type(self).__name__
        min_value = check_int(name, "min_value", min_value, minimum=1)
        seq_per_step = check_int(name, "seq_per_step", seq_per_step, minimum=1)
        if max_value is not None:  # None: the model's length
            max_value = check_int(name, "max_value", max_value, minimum=1)
        if max_value is not None and min_value > max_value:
            raise ValueError(f"{name}: min_value ({min_value}) must be <= max_value ({max_value})")
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
        seed = check_int(name, "seed", seed)
        if not isinstance(adapter, (str, TransformerAdapter)):
            raise ValueError(
                f"{name}.adapter must be 'auto', a registered name or a TransformerAdapter, got {adapter!r}"
            )
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
        self._reset_progress()

    def _reset_progress(self) -> None:
        """A new fit starts from step 0 with no tokens consumed (a resumed one restores these from its checkpoint)."""
        self.require_steps: int | None = self.require_steps_arg
        self._saved_require_steps: int | None = None  # a resumed run's derived require_steps, checked at train start
        # counters (global: summed over ranks at every optimizer step)
        self.current_step = -1
        self.current_value = self.min_value
        self.consumed_layer_tokens = 0
        self.full_layer_tokens = 0  # what the same batches cost without dropping
        self.consumed_samples = 0
        self.saved_flops = 0.0
        self.full_layer_flops = 0.0
        self.total_steps: int | None = None
        self.global_batch_size = 0
        self._pending = [0, 0, 0, 0.0, 0.0]  # samples, layer-tokens, full layer-tokens, saved flops, full flops
        self._folded = True
        # the current micro-batch's costs and logged FLOPs fraction, fixed with the network it ran on when a model
        # change comes before its on_train_batch_end (cleared at the next batch)
        self._batch_costs_fixed: tuple[int, int, int, float, float] | None = None
        self._frac_fixed: float | None = None

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
            f"accounting={self.accounting!r}, seed={self.seed!r}, strict={self.strict!r})"
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
        if stage != "fit":
            return
        check_trainer(trainer)
        self._reset_progress()
        if self.patched is not None:
            return
        adapter = find_adapter(pl_module, self.adapter_arg)
        layers = adapter.layers()
        self.num_layers = len(layers)
        self.layer_ids = resolve_layer_ids(self.layer_ids_arg, self.num_layers)
        self._check_model_changes(trainer, pl_module)
        seq = adapter.max_sequence_length()
        self.max_value = seq if self.max_value_arg is None else self.max_value_arg
        name = type(self).__name__
        if self.max_value > seq:
            raise ValueError(f"{name}.max_value ({self.max_value}) is larger than the model's sequence length ({seq})")
        if self.min_value > self.max_value:
            raise ValueError(
                f"{name}: min_value ({self.min_value}) must be <= max_value ({self.max_value}, "
                f"{'the model length' if self.max_value_arg is None else 'given'})"
            )
        if self.keep_prefix_arg == "auto":
            self.keep_prefix_tokens = adapter.num_prefix_tokens()
        if self.keep_prefix_tokens > self.min_value:
            raise ValueError(
                f"{name}.keep_prefix_tokens ({self.keep_prefix_tokens}) must be <= min_value ({self.min_value})"
            )
        self._check_truncation(trainer)
        self.controller = LTDController(
            self.num_layers,
            self.layer_ids,
            seed=self.seed,
            rank=trainer.global_rank,
            keep_prefix_tokens=self.keep_prefix_tokens,
        )
        self.patched = convert(pl_module, adapter, self.controller)
        self.adapter = adapter

    def _check_model_changes(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``layer_ids`` must resolve at the depth of every network a technique that replaces the model will put in
        place (:class:`~lightning_effi.core.protocols.PlansModelChanges`, the V-cycle's levels)."""
        name = type(self).__name__
        for other in trainer.callbacks:
            if other is self or not isinstance(other, PlansModelChanges):
                continue
            depths = [int(d) for d in other.effi_model_depths(pl_module)]
            for level, depth in enumerate(depths, start=1):
                try:
                    resolve_layer_ids(self.layer_ids_arg, depth)
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

    def _check_truncation(self, trainer: pl.Trainer) -> None:
        """Under the Curriculum's sequence-length truncation the longest batch has ``max_difficulty`` tokens (+ 1 with
        ``causal_label_shift``; ``seqlen_reshape``: rows of ``max_difficulty + 1``): a reserved length that never goes
        below it would never drop a token. The Curriculum is found by class name (techniques do not import each
        other); its configuration is on the callback or on its DataModule."""
        name = type(self).__name__
        assert self.max_value is not None
        smallest = F.ltd_value(0, self.min_value, self.max_value, 1, self.seq_per_step, self.rounding)
        for other in trainer.callbacks:
            if not any(k.__name__ == "Curriculum" for k in type(other).__mro__):
                continue
            config = getattr(other, "config", None) or getattr(getattr(trainer, "datamodule", None), "config", None)
            metrics = getattr(config, "metrics", None) or {}
            shift = 1 if getattr(config, "causal_label_shift", False) else 0
            for metric, extra in (("seqlen_truncate", shift), ("seqlen_reshape", 1)):
                m = metrics.get(metric)
                if m is None:
                    continue
                longest = int(m.max_difficulty) + extra
                if smallest >= longest:
                    plus = f" + {extra} ({'causal_label_shift' if metric == 'seqlen_truncate' else 'reshaped rows'})"
                    raise ValueError(
                        f"{name}: its reserved length is never below {smallest} tokens (min_value={self.min_value}, "
                        f"rounding={self.rounding!r}, seq_per_step={self.seq_per_step}) but {type(other).__name__}'s "
                        f"{metric} makes every batch at most {longest} tokens long (max_difficulty="
                        f"{m.max_difficulty}{plus if extra else ''}), so random-LTD would never drop a token: lower "
                        f"RandomLTDCallback.min_value below {longest} or raise the curriculum's max_difficulty"
                    )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.patched is not None:
            restore(self.patched)
            self.patched = None

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

    def effi_after_model_change(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The new network is in place: find the adapter on it again, resolve the LTD layer ids for its depth (see
        ``layer_ids``), patch its layers; the controller (schedule, seed, current context) goes on.

        Raises:
            ValueError: no adapter matches the new network, or ``layer_ids`` do not resolve at its depth.
        """
        if self.controller is None or self.patched is not None:
            return
        arg = self.adapter_arg
        adapter = arg.rebind(pl_module) if isinstance(arg, TransformerAdapter) else find_adapter(pl_module, arg)
        num_layers = len(adapter.layers())
        try:
            layer_ids = resolve_layer_ids(self.layer_ids_arg, num_layers)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: the new network has {num_layers} layers: {err}") from None
        self.controller.num_layers, self.controller.layer_ids = num_layers, layer_ids
        self.patched = convert(pl_module, adapter, self.controller)
        self.adapter, self.num_layers, self.layer_ids = adapter, num_layers, layer_ids

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = trainer.estimated_stepping_batches
        self.total_steps = int(total) if math.isfinite(total) else None
        if self.require_steps_arg is not None:
            return  # a fixed step count: compared with the checkpoint's in load_state_dict
        saved, current = self._saved_require_steps, self._resolve_require_steps(trainer)
        if saved is not None and saved != current:
            self._mismatch(
                f"require_steps={str(self.require_duration)!r} gives {current} optimizer steps in this run but the "
                f"checkpoint's schedule has require_steps={saved} (another duration or another run length)",
                fix=f"continue the schedule with require_steps={current}",
            )
        self.require_steps = current

    def _resolve_require_steps(self, trainer: pl.Trainer) -> int:
        """A derived ``require_steps`` in optimizer steps (at train start): a fraction of the run's optimizer steps
        (:func:`~lightning_effi.core.progress.run_length` of ``max_steps`` and ``estimated_stepping_batches``, as the
        V-cycle reads it), rounded up; or epochs of
        :func:`~lightning_effi.core.progress.steps_per_epoch` optimizer steps."""
        where = f"{type(self).__name__}.require_steps"
        duration = self.require_duration
        if duration.unit == "epoch":
            spe = steps_per_epoch(trainer.num_training_batches, trainer.accumulate_grad_batches, f"{where}={duration}")
            return max(1, duration.to_steps(steps_per_epoch=spe, name=where))
        total = run_length(trainer.max_steps, trainer.estimated_stepping_batches)
        if total is None:
            raise ValueError(
                f"{where}: the run's length is unknown (max_epochs=-1 and max_steps=-1); set require_steps"
            )
        return max(1, duration.to_steps(total_steps=total, name=where, rounding="ceil"))

    # ------------------------------------------------------------------------------------------------ schedule
    def value_at(self, step: int) -> int:
        """Reserved length at optimizer step ``step`` (pure; needs the resolved ``max_value`` and ``require_steps``)."""
        if self.max_value is None or self.require_steps is None:
            raise RuntimeError("RandomLTDCallback: the schedule is resolved in setup / on_train_start")
        return F.ltd_value(step, self.min_value, self.max_value, self.require_steps, self.seq_per_step, self.rounding)

    def total_layer_tokens(self, train_steps: int, global_batch_size: int) -> int:
        """Layer-tokens of ``train_steps`` optimizer steps of full-length batches (pure: the state is untouched)."""
        if self.max_value is None or self.require_steps is None:
            raise RuntimeError("RandomLTDCallback: the schedule is resolved in setup / on_train_start")
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

    def expected_total_layer_tokens(self) -> int:
        """Layer-tokens the whole run will consume at full-length batches: :meth:`total_layer_tokens` over the run's
        optimizer steps (``trainer.estimated_stepping_batches``) at the global batch size of the first step.

        Raises:
            RuntimeError: before the first optimizer step, or for a run of unknown length.
        """
        if self.total_steps is None or not self.global_batch_size:
            raise RuntimeError(
                "RandomLTDCallback.expected_total_layer_tokens: needs a run of known length and one "
                "finished optimizer step; pass total_layer_tokens explicitly"
            )
        return self.total_layer_tokens(self.total_steps, self.global_batch_size)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.controller is not None
        step = trainer.global_step
        self.current_step = step
        self.current_value = self.value_at(step)
        self.controller.begin(step, batch_idx, self.current_value)
        self._folded = False
        self._batch_costs_fixed, self._frac_fixed = None, None

    def _fold_batch(self) -> None:
        """Add the current micro-batch's records to the pending step totals (once)."""
        if self._folded or self.controller is None or self.adapter is None:
            return
        self._folded = True
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
        for rec in self.controller.records:
            samples += rec.batch_size
            layer_tokens += F.layer_tokens(rec.batch_size, rec.seq_len, rec.reserved_length, L, L_ltd)
            full_layer_tokens += rec.batch_size * rec.seq_len * L
            full = F.flops_per_layer(rec.batch_size, rec.seq_len, h, inter)
            saved += L_ltd * (full - F.flops_per_layer(rec.batch_size, rec.reserved_length, h, inter))
            full_flops += L * full
        return samples, layer_tokens, full_layer_tokens, saved, full_flops

    def _fold_step(self, trainer: pl.Trainer) -> None:
        self._fold_batch()
        local = torch.tensor(self._pending, dtype=torch.float64, device=trainer.strategy.root_device)
        total = trainer.strategy.reduce(local, reduce_op="sum") if trainer.world_size > 1 else local
        samples, actual, full, saved, full_flops = (float(x) for x in total.cpu())
        self._pending = [0, 0, 0, 0.0, 0.0]
        if self.accounting == "deepspeed":
            assert self.max_value is not None
            L, L_ltd = self.num_layers, len(self.layer_ids)
            self.consumed_layer_tokens += int(samples) * (self.current_value * L_ltd + self.max_value * (L - L_ltd))
        else:
            self.consumed_layer_tokens += int(round(actual))
        self.full_layer_tokens += int(round(full))
        self.consumed_samples += int(samples)
        if not self.global_batch_size:
            self.global_batch_size = int(samples)
        self.saved_flops += saved
        self.full_layer_flops += full_flops

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._fold_step(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._fold_batch()  # micro-batches before the last one of an accumulation window
        if not pl_module.automatic_optimization and any(self._pending):
            self._fold_step(trainer)
        assert self.controller is not None
        self.controller.end()
        frac = self._saved_frac() if self._frac_fixed is None else self._frac_fixed
        pl_module.log_dict(
            {
                "effi/random_ltd/reserved_length": float(self.current_value),
                "effi/random_ltd/consumed_layer_tokens": float(self.consumed_layer_tokens),
                "effi/random_ltd/flops_saved_frac": frac,
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )

    def _saved_frac(self) -> float:
        """The share of the layers' FLOPs the current micro-batch skipped (its first forward's shapes), else 0."""
        records = self.controller.records if self.controller is not None else []
        if not records or self.adapter is None:
            return 0.0
        r = records[0]
        return F.saved_flops_fraction(
            r.seq_len,
            r.reserved_length,
            self.num_layers,
            len(self.layer_ids),
            self.adapter.hidden_size(),
            self.adapter.intermediate_size(),
        )

    # ------------------------------------------------------------------------------------------------ accounting
    def effi_adjust(self, stats: BatchStats, batch: Any, pl_module: pl.LightningModule) -> BatchStats:
        """Lower the EfficiencyMonitor's layer-tokens and FLOPs of the current batch by what the LTD layers skipped."""
        if self.controller is None or self.adapter is None or not self.controller.records:
            return stats
        _, ltd_lt, full_lt, saved, _ = self._batch_costs()
        layer_tokens = round(stats.layer_tokens * ltd_lt / full_lt) if full_lt else stats.layer_tokens
        return dataclasses.replace(stats, layer_tokens=int(layer_tokens), flops=max(0.0, stats.flops - saved))

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
            "config": self.config(),
        }

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if others := other_state_keys(self, checkpoint):
            self._mismatch(f"the checkpoint was written with other settings ({others[0]}), not {self.state_key}")

    def _mismatch(self, message: str, fix: str = "resume with this configuration") -> None:
        config_mismatch(type(self).__name__, message, self.strict, fix=fix)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, mine = dict(state_dict["config"]), self.config()
        if self.require_steps_arg is None:
            # derived from the run: on_train_start compares what the current arguments give in this run
            mine.pop("require_steps")
            saved_steps = saved.pop("require_steps", None)
            if saved_steps is not None:
                self.require_steps = self._saved_require_steps = int(saved_steps)
        diff = settings_diff(saved, mine)
        if diff:
            self._mismatch(f"the checkpoint's configuration differs (checkpoint, now): {diff}")
        self.consumed_layer_tokens = int(state_dict["consumed_layer_tokens"])
        self.full_layer_tokens = int(state_dict["full_layer_tokens"])
        self.consumed_samples = int(state_dict["consumed_samples"])
        self.saved_flops = float(state_dict["saved_flops"])
        self.full_layer_flops = float(state_dict["full_layer_flops"])
        self.current_step = int(state_dict["current_step"])
        self.current_value = int(state_dict["current_value"])
        self.global_batch_size = int(state_dict.get("global_batch_size", 0))


RandomLTD = RandomLTDCallback  # the short name (``lightning_effi.callbacks.RandomLTD``, Hydra configs)
