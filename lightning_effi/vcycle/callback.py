"""``VCycleCallback``: the multi-level V-cycle of Zou et al. (ICLR 2024) inside one ``trainer.fit``: the Lightning
hooks, the callback's state and what it logs. The stage arithmetic is in :mod:`lightning_effi.vcycle.stages`, the
models of the levels in :mod:`lightning_effi.vcycle.levels`, the operators in :mod:`lightning_effi.vcycle.operators`;
the method card (``README.md`` beside this file) tells the long story.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from typing_extensions import override

from lightning_effi.core.accounting import Baseline, EfficiencyMonitor, skipped_batch
from lightning_effi.core.compat import optimizers_to_device, rebuild_train_loader_after_restore, rewrap_ddp
from lightning_effi.core.features import parameter_copy_holders
from lightning_effi.core.hook_ids import reserve_hook_ids
from lightning_effi.core.nonfinite import NonFiniteLossGuard
from lightning_effi.core.progress import (
    Duration,
    StepsPerBatchCheck,
    clock_epochs,
    estimated_optimizer_steps,
    progress_clock,
    progress_ticks,
    run_length,
    shorter_than_resolved,
)
from lightning_effi.core.protocols import FollowsModelChanges, ProvidesProgressClock
from lightning_effi.core.requirements import (
    BATCH_STRUCTURES,
    IncompatibleTechniques,
    Requirements,
    check_started,
    check_trainer,
    technique_callbacks,
)
from lightning_effi.core.settings import KeepsSettings, apply_changed_settings, given_settings, keep_settings
from lightning_effi.core.state import config_mismatch, open_batch_skipped, saving_in_train_batch_end, settings_diff
from lightning_effi.core.wrapping import live_fit
from lightning_effi.vcycle import operators as V
from lightning_effi.vcycle import stages as S
from lightning_effi.vcycle.accounting import FlopsAccount
from lightning_effi.vcycle.checks import check_state, optimizer_mismatch, user_hooks
from lightning_effi.vcycle.levels import LevelStack, level_depths
from lightning_effi.vcycle.stages import stage_plan, vcycle_flops_fraction

if TYPE_CHECKING:  # the model registry imports this package's operators; import it when used
    from lightning_effi.models.vcycle_base import VCycleAdapter

__all__ = [
    "VCycle",
    "VCycleCallback",
    "notify_model_change",
    "rebuild_training_state",
    "stage_plan",
    "vcycle_flops_fraction",
]


def notify_model_change(trainer: pl.Trainer, pl_module: pl.LightningModule, when: Literal["before", "after"]) -> None:
    """Call ``effi_before_model_change`` (``when="before"``) or ``effi_after_model_change`` (``"after"``) on every
    callback of ``trainer.callbacks`` that follows model changes
    (:class:`~lightning_effi.core.protocols.FollowsModelChanges`, e.g. random-LTD), in the Trainer's order."""
    for callback in trainer.callbacks:
        if isinstance(callback, FollowsModelChanges):
            hook = callback.effi_before_model_change if when == "before" else callback.effi_after_model_change
            hook(trainer, pl_module)


def rebuild_training_state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """After the module's parameters changed shape: re-wrap DDP, re-run ``configure_optimizers`` in the strategy
    (sets ``trainer.optimizers`` and ``trainer.lr_scheduler_configs``), move the optimizer state to the device. Under
    DDP every rank calls it at the same step. Non-public Lightning calls: :mod:`lightning_effi.core.compat`."""
    rewrap_ddp(trainer, pl_module)
    trainer.strategy.setup_optimizers(trainer)
    optimizers_to_device(trainer.optimizers, trainer.strategy.root_device)


#: the configuration entries whose argument None means "resolved in setup" (the adapter's default, the network found)
_AUTO_ARGUMENTS = ("alpha_original", "model_attr")
#: the callback's checkpointed counters and their types (the rest: FLOPs counters, stage ends, snapshots, config)
_COUNTERS: dict[str, type] = dict(level=int, stage_index=int, stage_start_step=int, map_seconds=float, switches=int)
_SHAPES_WHY = "its averaged weights belong to one model, which the V-cycle replaces at every level change"
_COPIES_WHY = (
    "its copy has the parameter shapes of one level's model, and the V-cycle replaces the model with one of other "
    "shapes at every level change (the copy then fails to update, or averages weights of different models); average "
    "after the cycle (a second fit from the V-cycle's final weights), or make the callback follow the level changes "
    "(implement effi_before_model_change / effi_after_model_change, lightning_effi.core.protocols."
    "FollowsModelChanges, and rebuild its copy there)"
)
_FINETUNING_WHY = (
    "it freezes modules before training and later unfreezes them into the optimizer as a new param group, but the "
    "V-cycle rebuilds the optimizer from configure_optimizers at every level change (dropping that group) and keeps "
    "each parameter's requires_grad across levels, so the unfrozen modules would not train; freeze and unfreeze in "
    "your module (configure_optimizers builds its groups from requires_grad), or fine-tune after the cycle (a second "
    "fit from the V-cycle's final weights)"
)
_PRUNING_WHY = (
    "its pruning re-parametrizes the weights (weight_orig and a weight_mask buffer), which the V-cycle's coalescing "
    "and de-coalescing do not map (the first level change would fail loading the state_dict); prune after the cycle "
    "(a second fit from the V-cycle's final weights)"
)


class VCycleCallback(KeepsSettings, Callback):
    """The multi-level V-cycle inside one ``trainer.fit`` (Zou et al., ICLR 2024; details in the method card).

    Level 1 (the full model) trains for ``e_a``, is coalesced, level 2 trains for ``e_a``, ... level K for
    ``e_small``; then de-coalesce + interpolate, level K−1 for its ``up_leg``, ... level 1 for the rest of the run.
    Every level gets a fresh optimizer and scheduler (``configure_optimizers`` runs again at each switch).

    Args:
        levels: K >= 2.
        e_a: every down-leg stage (levels 1..K−1; the paper's :math:`E_a`): a
            :class:`~lightning_effi.core.progress.Duration` or what ``Duration.parse`` reads: an int of optimizer
            steps (>= 1), ``"500st"``, ``"2ep"`` (``n · ceil(num_training_batches / accumulate_grad_batches)`` steps,
            read at train start), ``"0.05dur"`` (``floor(f · T)``, at least 1, of the run's ``T`` optimizer steps:
            ``trainer.estimated_stepping_batches`` at train start, so ``max_epochs`` and ``limit_train_batches``
            count as well as ``max_steps``; the stages must end within ``T``). No floats.
            With a technique that changes the epoch lengths (a callback providing the run's progress clock,
            :class:`~lightning_effi.core.protocols.ProvidesProgressClock`, e.g. InfoBatch), fractions and epochs are
            measured on its progress instead (:func:`~lightning_effi.vcycle.stages.resolve_progress_stages`: a stage
            ends after the first optimizer step at which its ``effi_progress_done()`` has reached the sum of the
            stage lengths so far; ``"2ep"`` is ``2 / max_epochs`` of the run), so the cycle completes however short
            the epochs get; lengths in optimizer steps keep the step clock and must fit in its
            ``effi_min_total_steps()``; steps mixed with fractions or epochs are refused.
        e_small: the coarsest level (paper: :math:`E_{small}`, half the baseline), same forms; a fraction that gives 0
            steps (``floor(f · T) = 0``, e.g. ``"0.05dur"`` of 10 steps, or ``"0dur"``) is refused outside
            ``fast_dev_run`` (the level would never train while the switches into and out of it still map the
            weights); with ``fast_dev_run`` (``T = 1``) it keeps the smoke test of the switches.
        up_leg: required for K >= 3 (the paper gives no length): the up-leg stages of levels 2..K−1, one length for
            all or a list ordered by level (``[level 2, level 3, ...]``); 0 steps refused as for ``e_small``.
        width_scheme, depth_scheme, embedding_convention: the adapter's ``plan`` arguments (``"half"``,
            ``"adjacent"``, ``"official"``; explicit groups apply to level 1 → 2 only when K = 2).
        alpha_original: weight of the snapshot in the interpolation, in [0, 1]; None: the adapter's default.
        lr_multiplier: ``{level: factor}`` on the level's peak LR, e.g. ``{2: 4.0}`` (official GPT-2 example); level
            1's from the fit's first step (the optimizers ``configure_optimizers`` built), the others' at the switch
            to their level.
        model_attr: the LightningModule attribute holding the network (swapped at every level change); None (default):
            found in ``setup`` (:func:`~lightning_effi.models.vcycle_base.find_vcycle_network`): the one direct
            submodule an adapter handles that has a trainable parameter (a frozen teacher is not a candidate); a
            ``model_attr`` naming a frozen module is refused. Each parameter's ``requires_grad`` is kept at every level
            (a partly frozen network: :func:`~lightning_effi.vcycle.operators.coalesced_requires_grad`; one your module
            changes at a coarse level passes on to the full network,
            :func:`~lightning_effi.vcycle.operators.decoalesced_requires_grad`). The network
            must exist at this callback's ``setup``: built in ``__init__`` (Lightning runs ``LightningModule.setup``
            and ``configure_model`` after the callbacks' ``setup``); when the width changes it must hold its own head
            (trainable parameters of the module outside it with an axis of its hidden size are refused, frozen ones
            warned of, unless named in ``unrelated_params``).
        adapter: ``"auto"``, a registered V-cycle adapter name (``hf_gpt2``, ``hf_bert``, ``timm_vit``,
            ``torch_blocks``) or an instance.
        lr_schedule: ``"continue"``: each rebuilt scheduler continues the one it replaces (stepped as often as it was:
            one LR curve, warmup in the first stage only, step- and epoch-interval alike; a ``ReduceLROnPlateau``
            keeps its best value, bad epochs, cooldown and reduced learning rates, times the ratio of the levels'
            ``lr_multiplier``); ``"restart"``: the module's schedule restarts from its step 0 at every level change
            (a plateau scheduler afresh).
        strict: a checkpoint written with another configuration raises on resume (False: warns and continues with
            this one; other stages, from other lengths or another run length, are found at train start and the run
            goes on with the current arguments' stages from the checkpoint's stage index).
        baseline_steps: optimizer steps of the baseline the FLOPs saving is measured against (the full model's mean
            training FLOPs per step on this run's batches times this); None: the full model on this run's batches.
        nonfinite_loss: the non-finite loss policy (:mod:`lightning_effi.core.nonfinite`): ``"raise"`` (default)
            stops the fit at the first NaN / infinite training loss, before its backward pass, with a
            :class:`~lightning_effi.core.nonfinite.NonFiniteLossError`; ``"warn"`` warns once, counts them
            (``effi/nonfinite_losses``, checkpointed, reported at the end of fit) and lets the run go on. Either way
            a level change never maps non-finite weights: it raises
            :class:`~lightning_effi.vcycle.levels.NonFiniteWeightsError` naming the switch, the stage and the first
            non-finite parameter.
        unrelated_params: names of the LightningModule's parameters outside the network, or ``fnmatch`` patterns
            (``["side.*"]``), that neither read nor feed the network's hidden states (a side branch over other
            features that happens to share the hidden width). The check for a head outside a network whose width
            changes goes by shape (an axis of the hidden size), so such a branch would be refused; the parameters
            named here are left out of that check and are trained as they are at every level. Each entry must match a
            parameter outside the network (else ``ValueError`` at ``setup``). A parameter named here that does read the
            hidden states fails at the first coarse step with a shape error, which then names it.
        **deprecated: ``e_a_steps``, ``e_a_fraction``, ``e_a_epochs``, ``e_small_*``, ``up_leg_*``: the old spellings
            of the three lengths, accepted for one release with a ``DeprecationWarning``; any other keyword raises
            ``TypeError``.

    A run cut short at a coarse level (``max_time``, ``EarlyStopping``, ``trainer.should_stop``, a data budget that ends
    early) is brought back to the full model in ``on_train_end``: de-coalesced and interpolated level by level with the
    pending snapshots (the operators of a normal up-switch; the optimizer is rebuilt for the full model), with a warning
    that the full model was not trained after it. A fit that raises (any exception, ``KeyboardInterrupt`` included;
    Lightning skips ``teardown`` then) is ended in ``on_exception``: below level 1, a full-size network is put back in
    the module, the coarse level's weights de-coalesced up to the full shapes without interpolation (the weights a
    checkpoint written at that moment holds; on the CPU, where Lightning's teardown puts the module next;
    :meth:`LevelStack.restore_full_size <lightning_effi.vcycle.levels.LevelStack.restore_full_size>`), with one warning
    naming the levels; the resume hooks come off the module. The callback's ``state_dict`` and checkpoint weights keep
    describing the interrupted level, so a checkpoint written after the exception (``OnExceptionCheckpoint``) is the one
    written just before it and resumes the cycle exactly. A module that an earlier fit left at a coarse level (its
    ``on_exception`` never ran) is put back at full size the same way in ``setup``, with a warning; one held by a
    V-cycle fit that is still running is an error. Techniques bound to the network's layers follow every level change
    (:class:`~lightning_effi.core.protocols.FollowsModelChanges`, e.g. random-LTD): they are told before the network is
    replaced and after the new one is in place (before the optimizer is rebuilt), also when a checkpoint's coarse level
    is rebuilt and at that final restore; :meth:`effi_model_depths` gives them the depth of every level in their
    ``setup``. For the :class:`~lightning_effi.core.accounting.EfficiencyMonitor`, :meth:`effi_baseline` puts the full
    model in place of a coarse level while the monitor counts the batch, so the monitor's ``saved/vcycle/...`` is the
    V-cycle's saving against the full model on the same batches.

    Checkpoints hold the full model's weights at every level: below level 1 the ``state_dict`` holds the level's
    network de-coalesced up to the full shapes (:meth:`~lightning_effi.vcycle.levels.LevelStack.full_state_dict`, no
    interpolation; also in ``save_weights_only`` checkpoints), so ``load_from_checkpoint`` and
    ``trainer.validate/test/predict(ckpt_path=...)`` need neither the V-cycle nor user code; it computes the coarse
    model's function where de-coalescing preserves it (widths halved with pairs under a function-preserving
    convention, not depths: the method card's "Checkpoints and resume"). The level's exact weights are in this
    callback's state (``"weights"``, with the pending snapshots): a fit resumed from the checkpoint rebuilds the level
    and loads them, and continues exactly like the uninterrupted run.

    Logged every step: ``effi/vcycle/level``, ``effi/vcycle/stage``, ``effi/vcycle/flops_cum``,
    ``effi/vcycle/flops_saved_frac``, ``effi/vcycle/map_seconds``, and with ``nonfinite_loss="warn"``
    ``effi/nonfinite_losses`` (the run's non-finite training losses so far, counted by the Trainer's first guarded
    callback: :func:`~lightning_effi.core.nonfinite.nonfinite_count`); summary keys ``vcycle/*``.

    Attributes:
        requirements: shapes change; single device or DDP; no weight averaging (``core.requirements``).

    Raises:
        ValueError: (construction) see :func:`~lightning_effi.vcycle.stages.check_arguments`; (``setup`` or train start)
            no network found or several candidates without ``model_attr`` (a module that overrides ``setup`` /
            ``configure_model`` and holds no network then: the message names the hook order and asks for the network in
            ``__init__``), no adapter for ``model_attr``'s network, ``model_attr`` naming a frozen module (no trainable
            parameter), another attribute sharing its parameters or a plain Python container (list, tuple, dict, set)
            holding its modules or parameters (:func:`~lightning_effi.models.vcycle_base.find_vcycle_network`), sizes
            the schemes cannot halve, ``levels`` deeper than the model allows (naming the level that cannot be
            coalesced, why, and the deepest ``levels`` allowed; :func:`~lightning_effi.vcycle.operators.plan_levels`),
            stages longer than the run, fractions in a run of unknown length, epochs with a train dataloader without a
            length, a coarse stage (``e_small``, ``up_leg``) given as a fraction that resolves to 0 steps outside
            ``fast_dev_run`` (:meth:`_refuse_untrained_levels`), with ``width_scheme`` changing the width: trainable
            parameters of the module outside the network with an axis of its hidden size (a head of the module's own
            over a ``GPT2Model``: :meth:`_check_outside_width`), an ``unrelated_params`` entry that matches no parameter
            outside the network; with a progress clock (a technique that changes the epoch lengths): stage lengths in
            optimizer steps mixed with fractions or epochs, steps that do not fit in its ``effi_min_total_steps()``,
            fractions and epochs that add up to more than the run, epochs without ``max_epochs``; (resume, before the
            weights load) a checkpoint written by a V-cycle with another number of levels or network attribute, a state
            field out of range (naming it: :func:`~lightning_effi.vcycle.checks.check_state`), level weights that do not
            fit the rebuilt level; (``on_train_start``) the callback added on resume (the checkpoint holds no V-cycle
            state) at a step its first switch has already passed; (resume, ``strict``) a checkpoint written with another
            configuration (another clock included) or other stages; (``setup``) a module whose network is held by
            another V-cycle fit that is still running (another Trainer's, on the same module).
        TypeError: (construction) an unknown keyword argument.
        NonFiniteLossError: (training, ``nonfinite_loss="raise"``) a NaN or infinite training loss, before its
            backward pass (:class:`~lightning_effi.core.nonfinite.NonFiniteLossGuard`).
        NonFiniteWeightsError: (a level change, any ``nonfinite_loss``) a NaN or infinite weight in the network or the
            snapshot the change would map (:meth:`~lightning_effi.vcycle.levels.LevelStack.check_finite`).
        IncompatibleTechniques: (``setup``) a strategy other than single device / DDP (FSDP, DeepSpeed, ...), weight
            averaging callbacks, a ``BaseFinetuning`` callback (``BackboneFinetuning``), ``ModelPruning``, a
            technique that patches the model's layers without following model changes;
            (``on_train_start``, or before a level change when it made its copy later) a callback that keeps its own
            copy of the model's parameters (a third-party EMA; :func:`~lightning_effi.core.features.
            parameter_copy_holders`) without following model changes.
        MisconfigurationException: (``setup``) a ``torch.compile``'d network; the optimizer of LightningCLI's
            ``--optimizer`` / ``optimizer:`` (built once before the fit: :func:`_refuse_cli_optimizer`); (the first
            level change, during
            training: the earliest the cause exists) optimizers from ``configure_optimizers`` that do not hold the new
            network's trainable parameters or hold parameters that are not the module's (one built before and
            returned again, e.g. cached at its first call; :func:`~lightning_effi.vcycle.checks.optimizer_mismatch`).
    """

    requirements = Requirements(
        changes_model_shapes=True,
        batch_structures=BATCH_STRUCTURES,
        strategies=("SingleDeviceStrategy", "DDPStrategy"),
        refused_strategies=("DeepSpeedStrategy",),
        strategy_note=(
            "Use strategy='auto' on one device, 'ddp', 'ddp_spawn' or 'ddp_find_unused_parameters_true': "
            "FSDP / DeepSpeed / model-parallel wrappers cannot be rebuilt mid-fit. Run one fit per stage "
            "instead, with the functional operators in lightning_effi.vcycle.operators."
        ),
        incompatible_callbacks=(
            ("StochasticWeightAveraging", _SHAPES_WHY),
            ("WeightAveraging", _SHAPES_WHY),
            ("BaseFinetuning", _FINETUNING_WHY),
            ("ModelPruning", _PRUNING_WHY),
        ),
        refused_features=(
            ("third_party_ema", _COPIES_WHY),
            (
                "compiled_submodule",
                "the V-cycle replaces the network at every level change, so a compiled network would be dropped (the "
                "levels would train uncompiled, and back at level 1 a plain full network would replace the compiled "
                "one); compile the whole module instead, trainer.fit(torch.compile(model)), which recompiles once "
                "per level",
            ),
        ),
    )

    def __init__(
        self,
        levels: int = 2,
        e_a: Duration | int | str | None = None,
        e_small: Duration | int | str | None = None,
        up_leg: Duration | int | str | Sequence[Duration | int | str] | None = None,
        width_scheme: Any = "half",
        depth_scheme: Any = "adjacent",
        alpha_original: float | None = None,
        lr_multiplier: Mapping[int, float] | None = None,
        embedding_convention: str = "official",
        model_attr: str | None = None,
        adapter: str | VCycleAdapter = "auto",
        lr_schedule: Literal["continue", "restart"] = "continue",
        strict: bool = True,
        baseline_steps: int | None = None,
        nonfinite_loss: str = "raise",
        unrelated_params: Sequence[str] = (),
        **deprecated: Any,
    ) -> None:
        given = given_settings(locals())  # first: the arguments as given (lightning_effi.core.settings)
        name = type(self).__name__
        self.nonfinite_guard = NonFiniteLossGuard(name, nonfinite_loss)  # checks the policy first
        #: durations resolved in batches, checked against the first batch's optimizer steps (manual optimization)
        self._steps_check = StepsPerBatchCheck(name)
        args = S.check_arguments(
            name,
            levels=levels,
            e_a=e_a,
            e_small=e_small,
            up_leg=up_leg,
            width_scheme=width_scheme,
            depth_scheme=depth_scheme,
            alpha_original=alpha_original,
            lr_multiplier=lr_multiplier,
            embedding_convention=embedding_convention,
            lr_schedule=lr_schedule,
            model_attr=model_attr,
            strict=strict,
            baseline_steps=baseline_steps,
            unrelated_params=unrelated_params,
            deprecated=deprecated,
            stacklevel=3,
        )
        from lightning_effi.models.vcycle_base import VCycleAdapter

        if not isinstance(adapter, (str, VCycleAdapter)):
            raise ValueError(f"{name}.adapter must be 'auto', a registered name or a VCycleAdapter, got {adapter!r}")
        self.levels, self.e_a, self.e_small, self.up_leg = args.levels, args.e_a, args.e_small, args.up_leg
        self.width_scheme, self.depth_scheme = args.width_scheme, args.depth_scheme
        self.embedding_convention = args.embedding_convention
        self.lr_multiplier: dict[int, float] = dict(args.lr_multiplier)
        #: the factors the running fit uses, taken at its setup: a dict changed in place during a fit waits for the
        #: next fit (lightning_effi.core.settings compares it then, and the constructor checks it)
        self._fit_lr_multiplier: dict[int, float] | None = None
        self.alpha_arg: float | None = args.alpha_original  # None: the adapter's default, resolved in setup
        self.alpha_original: float | None = self.alpha_arg
        self.adapter_arg, self.lr_schedule = adapter, args.lr_schedule
        self.model_attr_arg: str | None = args.model_attr  # None: found in setup
        self.model_attr: str | None = args.model_attr  # the attribute in use (resolved in setup)
        self.strict, self.baseline_steps = args.strict, args.baseline_steps
        self.unrelated_params: tuple[str, ...] = args.unrelated_params
        # resolved in setup / on_train_start
        self.adapter: VCycleAdapter | None = None
        self._stack = LevelStack(self.levels, name)  # the models of the levels: plans, parked modules, snapshots
        self.nonfinite_loss: str = self.nonfinite_guard.policy
        self._reset_progress()
        # the lengths as the new spelling gives them (a deprecated e_a_steps=1 is e_a=1): a length set on the callback
        # later rebuilds it with that one alone
        given.update(e_a=S.spelled(self.e_a), e_small=S.spelled(self.e_small), up_leg=S.spelled(self.up_leg))
        given["deprecated"] = {}
        keep_settings(self, VCycleCallback, given)

    def _reset_progress(self) -> None:
        """A fresh cycle: a new fit with this callback starts from the first stage (a resumed fit then loads the
        checkpoint's progress)."""
        self.stages: list[tuple[int, int]] = []  # non-final (level, steps), resolved against this fit's length
        self.stage_ends: list[int] = []  # cumulative end step of each non-final stage
        self._resolved_against: int | None = None  # the run length fractions of the run were resolved against
        # checkpointed: progress, FLOPs counters (and the level and snapshots of the level stack)
        self.stage_index, self.stage_start_step, self.switches = 0, 0, 0
        self.map_seconds, self.flops_account = 0.0, FlopsAccount(self.baseline_steps)
        self._last_step = -1  # runtime only, like the checkpoint's stages (compared with this run's at train start)
        self._batch_open = False  # between on_train_batch_start and this callback's on_train_batch_end
        self._open_batch: Any = None  # that batch
        # a checkpoint written inside on_train_batch_end before this callback's own, restored: its batch's end
        # (a level switch) is due at train start
        self._batch_end_due = False
        self._backward_seen = False  # the open batch has had a backward (on_before_backward)
        self._due_at_exception = False  # the fit raised inside a stepped batch's end before this callback's
        self._levels_due_at_exception: list[int] = []
        self._levels_due: list[int] = []  # the restored batch end's levels (a resumed fit without a step left)
        self._train_started = False  # this fit's on_train_start ran (Lightning skips it when no step is left)
        self._restored = False  # this fit loaded a V-cycle state from a checkpoint
        # level 1's lr_multiplier is on the optimizers the fit holds (checkpointed: a checkpoint written before train
        # start, a tuner's, holds optimizers without it)
        self._level_one_scaled = False
        # the learning rates lr_multiplier set on optimizers without a scheduler, per optimizer index, and whether a
        # change made to them outside the V-cycle was warned of (:meth:`on_before_optimizer_step`)
        self._lrs_set: dict[int, list[float]] = {}
        self._lr_change_warned = False
        # the non-finite losses of this fit (checkpointed: a resumed fit loads the count)
        self.nonfinite_guard = NonFiniteLossGuard(type(self).__name__, self.nonfinite_loss)
        self._flops_warned = False  # the "FLOPs not counted" warning, once per fit
        self._saved_stages: list[tuple[int, int]] | None = None
        self._saved_clock: str | None = None
        self._config_checked = False  # the resume hook compared the checkpoint's configuration before the weights
        self._evaluating = False  # the checkpoint being restored is for validate / test / predict (state ignored)
        # the clock the stage ends count (chosen at train start): "step", or "progress" of a technique's progress clock
        self.clock: str = "step"
        self._clock_source: ProvidesProgressClock | None = None
        self.cut_short_level = 0  # the level a run cut short ended at, before on_train_end restored the full model
        # a fit that raised below level 1: the level, its exact weights and the snapshots, still reported by state_dict
        # and on_save_checkpoint after on_exception put the full-size network back (OnExceptionCheckpoint)
        self._interrupted: dict[str, Any] | None = None
        self._frozen_outside: tuple[list[str], list[str], int, Any] | None = None
        self._copies: list[str] = []  # modules of the network's class outside it (an EMA copy), for messages
        # at a coarse level: each copy's parameters' sums at the end of this callback's on_train_batch_end, after the
        # optimizer step (_check_copies_unchanged compares them at the next batch's start)
        self._copy_sums: dict[str, Tensor] | None = None

    def __repr__(self) -> str:
        """Every constructor argument (new spelling; a length as random-LTD's ``require_steps``: an int of steps, else
        the duration's string such as ``'0.5dur'``): ``eval`` with ``VCycleCallback`` in scope builds an equal
        callback (an adapter instance needs its class in scope too)."""
        return (
            f"{type(self).__name__}(levels={self.levels!r}, e_a={S.spelled(self.e_a)!r}, "
            f"e_small={S.spelled(self.e_small)!r}, up_leg={S.spelled(self.up_leg)!r}, "
            f"width_scheme={self.width_scheme!r}, depth_scheme={self.depth_scheme!r}, "
            f"alpha_original={self.alpha_arg!r}, lr_multiplier={self.lr_multiplier!r}, "
            f"embedding_convention={self.embedding_convention!r}, model_attr={self.model_attr_arg!r}, "
            f"adapter={self.adapter_arg!r}, lr_schedule={self.lr_schedule!r}, strict={self.strict!r}, "
            f"baseline_steps={self.baseline_steps!r}, nonfinite_loss={self.nonfinite_loss!r}, "
            f"unrelated_params={list(self.unrelated_params)!r})"
        )

    @property
    def level(self) -> int:
        """The level whose model is in ``pl_module.<model_attr>`` (1: the full model)."""
        return self._stack.level

    @property
    def plans(self) -> list[V.VCyclePlan]:
        """``plans[k - 1]``: the plan of level ``k`` → ``k + 1`` (made in ``setup``)."""
        return self._stack.plans

    @property
    def snapshots(self) -> dict[int, dict[str, Tensor]]:
        """Level → the state dict saved before coalescing it, pending interpolation (checkpointed)."""
        return self._stack.snapshots

    @property
    @override
    def state_key(self) -> str:
        """``VCycleCallback{'levels': K, 'model_attr': name}`` with the attribute in use (found in ``setup`` when
        ``model_attr`` is None; before that, ``"model"``, the attribute of every ``lightning_effi.tasks`` module). A
        checkpoint written with another K or attribute has another key, which the resume hook refuses
        (:meth:`_check_checkpoint`)."""
        return self._generate_state_key(levels=self.levels, model_attr=self.model_attr or "model")

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        reserve_hook_ids(pl_module)  # hooks of its own ids (lightning_effi.core.hook_ids: a spawned rank's module)
        if stage == "fit":  # settings set on the callback since it was built (lightning_effi.core.settings)
            apply_changed_settings(self, trainer)
        if stage != "fit":
            return
        self._fit_lr_multiplier = dict(self.lr_multiplier)  # this fit's factors (lr_factor)
        name = type(self).__name__
        self._reset_progress()
        check_trainer(trainer)
        self._clear_leftovers(trainer, pl_module)
        for attr, child in pl_module._modules.items():
            if type(child).__name__ == "OptimizedModule" and self.model_attr_arg in (None, attr):
                raise MisconfigurationException(
                    f"{name}: pl_module.{attr} is torch.compile'd; compile inside "
                    "the module's forward or not at all (the model is replaced mid-fit)"
                )
        _refuse_cli_optimizer(pl_module)
        self.model_attr, self.adapter = self._find_network(pl_module)
        self._stack.bind(pl_module, self.model_attr)
        self._stack.running = live_fit(trainer)
        if self.alpha_arg is None:
            self.alpha_original = float(self.adapter.default_alpha_original)
        if self.alpha_original == 0.0:
            rank_zero_warn(
                f"{name}: alpha_original=0 keeps the de-coalesced copies symmetric; without dropout they "
                "never separate: use alpha_original > 0"
            )
        elif self.alpha_original == 1.0:
            rank_zero_warn(
                f"{name}: alpha_original=1 interpolates entirely to the original weights at every up-switch: the "
                "training done at the coarse levels is thrown away (the fit trains the full model for fewer steps, "
                "while the FLOPs of the coarse levels count as saved); use alpha_original < 1 (Zou et al. 2024 "
                "interpolate with a fraction of the original model)"
            )
        self._stack.plan(self.adapter, self.width_scheme, self.depth_scheme, self.embedding_convention)
        # the clock is chosen at train start, once every callback's setup ran (a technique may publish a clock or
        # withdraw it in its own setup, e.g. InfoBatch inside the curriculum); without a technique that changes the
        # epoch length the stages are on the step clock: a first check against max_steps here
        self.clock, self._clock_source = "step", None
        if not any(type(c).requirements.changes_epoch_length for c in technique_callbacks(trainer.callbacks)):
            self._refuse_untrained_levels(trainer, self._fit_stages(trainer, at_setup=True), at_setup=True)
        self._check_outside_width(pl_module)
        self._warn_mixed_depth_groups(pl_module)
        self._warn_network_copies(pl_module)
        hooks = user_hooks(getattr(pl_module, self.model_attr))
        if hooks:
            listed = "; ".join(hooks[:6]) + (f"; and {len(hooks) - 6} more" if len(hooks) > 6 else "")
            rank_zero_warn(
                f"{name}: pl_module.{self.model_attr} carries hooks registered outside the V-cycle ({listed}). The "
                "coarse networks trained at levels >= 2 are new modules without them, so these hooks do not run "
                "there (an auxiliary loss or statistic they feed is missing at those levels) and run again at level "
                "1. Register them on pl_module itself, or compute the term in training_step from the network's "
                "outputs"
            )
        self._install_load_hook(pl_module)

    def _warn_mixed_depth_groups(self, pl_module: pl.LightningModule) -> None:
        """Warn when depth coalescing merges frozen layers with trainable ones (:func:`~lightning_effi.vcycle.
        operators.mixed_depth_groups`): the frozen ones are restored frozen at de-coalescing, and a
        ``requires_grad_(True)`` of the module at a coarse level cannot reach them (the merged tensor was trainable
        already): gradual unfreezing by hand at level 2 left block 0 frozen, with its initial weights, for the rest of
        the fit (qa54-break 02)."""
        if not self._stack.plans:
            return
        flags = V.requires_grad_flags(getattr(pl_module, self.model_attr))
        groups = V.mixed_depth_groups(flags, self._stack.plans[0])
        if not groups:
            return
        shown = "; ".join(
            f"layers {layers}: {', '.join(keys[:2])}" + (f" and {len(keys) - 2} more" if len(keys) > 2 else "")
            for layers, keys in groups[:3]
        ) + (f"; and {len(groups) - 3} more groups" if len(groups) > 3 else "")
        rank_zero_warn(
            f"{type(self).__name__}: depth coalescing merges layers of pl_module.{self.model_attr} whose parameters "
            f"are frozen beside trainable ones of the same depth group ({shown} frozen). The merged coarse layer "
            "trains, and de-coalescing gives the frozen parameters back their weights, still frozen: a "
            "requires_grad_(True) your module calls at a coarse level (level >= 2) cannot reach them. Unfreeze them "
            "at level 1 (before the cycle or after it), freeze whole depth groups (depth_scheme), or keep the depth "
            "(depth_scheme=None)"
        )

    def _leftover_stacks(self, pl_module: pl.LightningModule) -> list[LevelStack]:
        """This callback's stack when still bound (its earlier fit did not end, or this fit's setup ran), and the stack
        of another V-cycle whose resume hooks are on ``pl_module``."""
        stacks = [self._stack] if self._stack.host is not None else []
        other = getattr(vars(pl_module).get("on_load_checkpoint"), "_vcycle_owner", None)
        if isinstance(other, LevelStack) and other is not self._stack and other.host is pl_module:
            stacks.append(other)
        return stacks

    def _check_not_running(self, stack: LevelStack, trainer: pl.Trainer) -> None:
        if stack is not self._stack and stack.running is not None and stack.running(trainer):
            raise ValueError(
                f"{type(self).__name__}: this module's network (pl_module.{stack.attr}) is held by another V-cycle fit "
                "that is still running (another Trainer's fit on the same module); a module is trained by one fit at "
                "a time: wait until that fit ends or train a copy of the module (copy.deepcopy before either fit)"
            )

    def effi_restore_network(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put a full-size network back where an earlier V-cycle fit that did not end (its ``teardown`` and
        ``on_exception`` never ran, e.g. an earlier callback's ``on_exception`` raised) left a coarse level: in
        ``pl_module`` (this callback's stack or another V-cycle's bound to it) or in the module of this callback's
        earlier fit, as ``on_exception`` does (:meth:`~lightning_effi.vcycle.levels.LevelStack.restore_full_size`; the
        techniques that follow model changes are told before and after), with a warning naming the levels.
        Called by this callback's ``setup`` and by a technique that reads the network in its own ``setup``
        (random-LTD), whichever runs first; a no-op at level 1 (a fit's setup never finds its own V-cycle below level
        1, so a coarse level found then is a leftover).

        Raises:
            ValueError: the module is held by another V-cycle fit that is still running (another Trainer's fit on the
                same module).
            RuntimeError: the full-size network cannot be put back (a level change failed half-way).
        """
        name = type(self).__name__
        for stack in self._leftover_stacks(pl_module):
            if stack.level == 1:
                continue
            self._check_not_running(stack, trainer)
            host, level = stack.host, stack.level
            if host is pl_module:
                notify_model_change(trainer, pl_module, "before")
            path = stack.restore_full_size()
            if host is pl_module:
                notify_model_change(trainer, pl_module, "after")
            where = "this module" if host is pl_module else f"the module of its earlier fit ({type(host).__name__})"
            rank_zero_warn(
                f"{name}: an earlier V-cycle fit that did not end (interrupted before its on_exception ran?) left "
                f"{where} at level {level}; put a full-size network back in pl_module.{stack.attr} (level "
                f"{' -> '.join(map(str, path))}: the level-{level} weights de-coalesced to the full shapes, no "
                "interpolation, not trained after) before starting a new cycle"
            )

    def _clear_leftovers(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before binding: end what an earlier V-cycle fit that did not end left (this callback's, or another V-cycle's
        bound to this module): a full-size network back in place (:meth:`effi_restore_network`), the resume hooks off.

        Raises:
            ValueError: the module is held by another V-cycle fit that is still running.
            RuntimeError: the full-size network cannot be put back.
        """
        self.effi_restore_network(trainer, pl_module)
        for stack in self._leftover_stacks(pl_module):
            self._check_not_running(stack, trainer)
            stack.remove_resume_hook()
            stack.running = None

    def _warn_network_copies(self, pl_module: pl.LightningModule) -> None:
        """Warn once when the module holds, outside the network, another module of the network's class (an EMA copy
        such as timm's ``ModelEmaV3``, or a teacher): the V-cycle replaces only ``pl_module.<model_attr>``, so an
        average that copies the network's weights into it fails at the first level change (the shapes differ). The
        copies are remembered, so that a shape error at a coarse level names them (:meth:`_explain_shape_error`), and
        watched at the coarse levels (:meth:`_check_copies_unchanged`). Frozen copies (every parameter
        ``requires_grad=False``: a DPO reference, a distillation teacher) are not warned about: every DPO run was told
        to "train without it" (qa46-user 03); a frozen EMA updated at a coarse level is refused there."""
        network = getattr(pl_module, self.model_attr)
        inside = {id(m) for m in network.modules()}
        self._copies = [
            name for name, m in pl_module.named_modules() if type(m) is type(network) and id(m) not in inside
        ]
        trainable = [
            name for name in self._copies if any(p.requires_grad for p in pl_module.get_submodule(name).parameters())
        ]
        if trainable:
            rank_zero_warn(
                f"{type(self).__name__}: {type(pl_module).__name__} holds another {type(network).__name__} beside "
                f"pl_module.{self.model_attr}: {', '.join(trainable[:3])} (an EMA copy, a teacher?). The V-cycle "
                "trains a smaller network at its coarse levels and coalesces only that one: an average that copies "
                "its weights fails at the first level change (timm's ModelEma.update, on the shapes; one by parameter "
                "name, DiT's update_ema, is refused at the first coarse step it changes the copy), as EMA and "
                "weight-averaging callbacks are refused; update it only while VCycleCallback.level == 1, average "
                "after the V-cycle, or train without it. A frozen teacher is fine."
            )

    def _check_outside_width(self, pl_module: pl.LightningModule) -> None:
        """When the levels change the width (``width_scheme`` not None and the plan's hidden size changes), refuse
        trainable parameters of the LightningModule outside the network the V-cycle coalesces that have an axis of the
        network's hidden size (a head such as ``self.head = nn.Linear(hidden, vocab)`` over a ``GPT2Model``, an input
        embedding feeding it, a norm over its output): the V-cycle replaces only ``pl_module.<model_attr>``, so at
        level 2 they would read or feed states of the coarse width (a shape error at the first level change). Other
        networks an adapter handles (a teacher, a second tower trained alongside) make and read their own hidden
        states and are not counted. Frozen parameters of that width outside the network get a warning naming them
        (a frozen head would fail the same way; a frozen table the forward does not use is fine), and are remembered
        so that a shape error at a coarse level names them (:meth:`on_exception`). The check goes by shape, so the
        parameters named in ``unrelated_params`` (a side branch that shares the width) are left out of it; those of
        the hidden width are remembered for the shape error's note too.

        Raises:
            ValueError: naming the parameters and their shapes, the widths, and the remedies (the head inside the
                network, ``width_scheme=None``, or ``unrelated_params``); an ``unrelated_params`` entry that matches
                no parameter outside the network (:meth:`_match_unrelated`).
        """
        from lightning_effi.models.vcycle_base import holds_vcycle_network

        self._frozen_outside = None
        if self.model_attr is None:
            return
        attr = self.model_attr
        network = getattr(pl_module, attr)
        own = {id(p) for p in network.parameters()}
        names = {n: p for n, p in pl_module.named_parameters() if id(p) not in own}
        declared = self._match_unrelated(pl_module, names)
        if self.width_scheme is None or not self._stack.plans:
            return
        info = self._stack.plans[0].info
        large, small = info.get("large"), info.get("small")
        if not isinstance(large, Mapping) or not isinstance(small, Mapping):
            return  # an adapter that does not describe its sizes
        hidden, coarse = large.get("hidden"), small.get("hidden")
        if not isinstance(hidden, int) or hidden == coarse:
            return
        others = {n for n, m in pl_module.named_children() if n != attr and holds_vcycle_network(m)}
        wide = [
            (f"{n} {list(p.shape)}", p.requires_grad)
            for n, p in names.items()
            if n.split(".")[0] not in others and hidden in p.shape and n not in declared
        ]
        unrelated = [f"{n} {list(p.shape)}" for n, p in names.items() if n in declared and hidden in p.shape]
        outside = [n for n, trainable in wide if trainable]
        frozen = [n for n, trainable in wide if not trainable]
        host, name = type(pl_module).__name__, type(self).__name__
        self._frozen_outside = (frozen, unrelated, hidden, coarse) if frozen or unrelated else None
        if frozen and not outside:
            listed = ", ".join(frozen[:5]) + (f" and {len(frozen) - 5} more" if len(frozen) > 5 else "")
            rank_zero_warn(
                f"{name}: width_scheme={self.width_scheme!r} changes the hidden size of pl_module.{attr} from {hidden} "
                f"to {coarse} at level 2, and {host} holds frozen parameters outside that network with a {hidden}-wide "
                f"axis: {listed}. If they read or feed the network's hidden states (a frozen head), level 2 fails at "
                "its first step with a shape error: put the head inside the network, or pass width_scheme=None; if "
                "they do not (a table the forward never uses), name them in unrelated_params to silence this"
            )
        if not outside:
            return
        listed = ", ".join(outside[:5]) + (f" and {len(outside) - 5} more" if len(outside) > 5 else "")
        raise ValueError(
            f"{name}: width_scheme={self.width_scheme!r} changes the hidden size of pl_module.{attr} "
            f"({type(network).__name__}) from {hidden} to {coarse} at level 2, but {host} holds trainable parameters "
            f"outside that network with a {hidden}-wide axis, which read or feed its hidden states: {listed}. The "
            f"V-cycle coalesces only pl_module.{attr}: at level 2 these would meet {coarse}-wide states (a shape error "
            "at the first level change, e.g. 'mat1 and mat2 shapes cannot be multiplied'). Put the head inside the "
            "network (a model with its own head, e.g. GPT2LMHeadModel, GPT2ForSequenceClassification, "
            f"BertForSequenceClassification, a timm ViT with num_classes), or pass width_scheme=None (depth only: the "
            f"width stays {hidden}); parameters that do not touch its hidden states (another network's, such as a "
            "second tower's head or projection, or a side branch over other features of the same width) can be named "
            "in unrelated_params=[...] (names or patterns such as 'side.*')"
        )

    def _match_unrelated(self, pl_module: pl.LightningModule, outside: Mapping[str, Any]) -> set[str]:
        """The names of the parameters outside the network that ``unrelated_params`` names (exact names or
        ``fnmatch`` patterns).

        Raises:
            ValueError: an entry that matches no parameter outside the network (naming it, and whether it matches
                parameters of the network itself, with the names it could mean).
        """
        import fnmatch

        declared: set[str] = set()
        for pattern in self.unrelated_params:
            hits = {n for n in outside if n == pattern or fnmatch.fnmatchcase(n, pattern)}
            if hits:
                declared |= hits
                continue
            host, name = type(pl_module).__name__, type(self).__name__
            inside = [
                f"{self.model_attr}.{n}"
                for n, _ in getattr(pl_module, str(self.model_attr)).named_parameters()
                if fnmatch.fnmatchcase(f"{self.model_attr}.{n}", pattern)
            ]
            where = (
                f"it matches only parameters of the network pl_module.{self.model_attr} itself ({inside[0]}, ...), "
                "which the V-cycle coalesces"
                if inside
                else f"the parameters of {host} outside pl_module.{self.model_attr} are: "
                + (
                    ", ".join(list(outside)[:8]) + (f" and {len(outside) - 8} more" if len(outside) > 8 else "")
                    or "none"
                )
            )
            raise ValueError(
                f"{name}.unrelated_params: {pattern!r} matches no parameter of {host} outside the network; {where}"
            )
        return declared

    def _refuse_untrained_levels(
        self, trainer: pl.Trainer, stages: Sequence[tuple[int, int]] | None, at_setup: bool
    ) -> None:
        """A coarse stage (``e_small``, or an ``up_leg`` stage) given as a fraction that resolves to 0 optimizer steps
        (``floor(f · T)``; or 0 ticks of a progress clock) in a run that is not ``fast_dev_run``: the level would
        never train, while the level change into it and out of it still maps the weights (coalesce, then de-coalesce
        and interpolate with the snapshot), which changes the full model for nothing. ``fast_dev_run`` (a smoke test
        of the switches, ``T = 1``) keeps zero-length coarse stages. On the step clock, stages that end at the run's
        last step (the final full-model stage has 0 steps) get a warning (a longer resumed fit may continue them).

        Raises:
            ValueError: naming the argument, what it resolved to in this run, the step of the switch and the
                smallest fraction that gives one step.
        """
        if not stages or getattr(trainer, "fast_dev_run", False):
            return
        ends = S.stage_ends(stages)
        ups = S.up_leg_lengths(self.levels, self.up_leg)
        for index, (level, length) in enumerate(stages):
            if level == 1 or length > 0:
                continue
            if index == self.levels - 1:
                key, given = "e_small", self.e_small
            else:
                key = f"up_leg[{level - 2}]" if isinstance(self.up_leg, tuple) else "up_leg"
                given = ups[level - 2]
            at = ends[index]
            name = type(self).__name__
            what = f"{name}.{key}={S.spelled(given)!r}"
            if self.clock == "progress":
                source = type(self._clock_source).__name__ if self._clock_source is not None else "the progress source"
                raise ValueError(
                    f"{what} resolves to 0 of the run's training progress on {source}'s clock: level {level} would "
                    f"never train, while the cycle still changes to it and out of it at once (coalesce, then "
                    "de-coalesce and interpolate with the snapshot), which changes the model's weights for nothing; "
                    f"give {key} a share > 0 (e.g. '0.05dur'). Zero-length coarse stages are kept only with "
                    "fast_dev_run (a smoke test of the switches)"
                )
            total = run_length(trainer.max_steps, None if at_setup else estimated_optimizer_steps(trainer))
            smallest = ""
            if total:
                f = math.ceil(10_000 / total) / 10_000
                while Duration(f, "fraction").to_steps(total_steps=total) < 1:
                    f += 1e-4
                smallest = f" a fraction >= 1/{total} (e.g. '{round(f, 4):g}dur'), or"
            figures = f"floor(f · T) = 0 in this run of T = {total} optimizer steps" if total else "0 steps"
            raise ValueError(
                f"{what} resolves to 0 optimizer steps ({figures}): level {level} would never train, while the "
                f"cycle still changes to it and out of it at step {at} (coalesce, then de-coalesce and interpolate "
                "with the snapshot taken before coalescing), which changes the full model's weights without the coarse "
                f"model training a step. Give {key}{smallest} an int of optimizer steps >= 1; zero-length coarse "
                "stages are kept only with fast_dev_run (a smoke test of the switches)"
            )
        if self.clock != "step":
            return
        total = run_length(trainer.max_steps, None if at_setup else estimated_optimizer_steps(trainer))
        if total and ends and ends[-1] == total:
            lengths = ", ".join(f"level {level}: {n}" for level, n in stages)
            rank_zero_warn(
                f"{type(self).__name__}: the stages ({lengths} optimizer steps) end at step {ends[-1]}, the run's last "
                f"(T = {total}): the full model, de-coalesced and interpolated at that last switch, does not train in "
                "this fit (the V-cycle ends by training the full model; Zou et al. 2024, Alg. 1). Shorten e_a / "
                "e_small" + (" / up_leg" if self.levels > 2 else "") + " or lengthen the run, unless a resumed, "
                "longer fit continues it"
            )

    def _fit_stages(self, trainer: pl.Trainer, at_setup: bool) -> list[tuple[int, int]] | None:
        """:func:`~lightning_effi.vcycle.stages.fit_stages` with this callback's lengths."""
        return S.fit_stages(trainer, self.levels, self.e_a, self.e_small, self.up_leg, at_setup, type(self).__name__)

    def _find_network(self, pl_module: pl.LightningModule) -> tuple[str, VCycleAdapter]:
        """``(attribute, adapter)`` of the network: :func:`~lightning_effi.models.vcycle_base.find_vcycle_network`
        with ``model_attr`` (None: found) and ``adapter``. When the module holds no network an adapter handles and
        overrides ``LightningModule.setup`` / ``configure_model`` (which Lightning runs after the callbacks'
        ``setup``), the error says so and asks for the network in ``__init__``
        (:func:`~lightning_effi.models.base.deferred_network_hint`).

        Raises:
            ValueError: see :func:`~lightning_effi.models.vcycle_base.find_vcycle_network`.
        """
        from lightning_effi.models.base import deferred_network_hint
        from lightning_effi.models.vcycle_base import find_vcycle_network, holds_vcycle_network

        name = type(self).__name__
        try:
            return find_vcycle_network(pl_module, self.model_attr_arg, self.adapter_arg, name)
        except ValueError as err:
            adapter = "auto" if isinstance(self.adapter_arg, str) else self.adapter_arg
            if holds_vcycle_network(pl_module, adapter):  # a network is there: the error is about it, not hook order
                raise
            hint = deferred_network_hint(
                pl_module,
                name,
                "it plans the levels from the network, and a resumed fit rebuilds the checkpoint's coarse level "
                "before the weights load, which Lightning does right after configure_model",
            )
            if not hint:
                raise
            raise ValueError(f"{hint} (the search for it: {err})") from None

    def _install_load_hook(self, pl_module: pl.LightningModule) -> None:
        """Checkpoints: wrap ``pl_module.on_load_checkpoint`` and ``on_save_checkpoint`` (the bound host;
        :meth:`~lightning_effi.vcycle.levels.LevelStack.install_resume_hook`). Saving below level 1 writes the
        network's weights at full size (de-coalesced), the exact ones go in this callback's state; loading checks the
        checkpoint (:meth:`_check_checkpoint`), rebuilds its level and puts the exact weights back before the strict
        load, telling the techniques that follow model changes before and after the rebuild."""
        self._stack.install_resume_hook(
            self.state_key,
            before=lambda: notify_model_change(pl_module.trainer, pl_module, "before"),
            after=lambda: notify_model_change(pl_module.trainer, pl_module, "after"),
            check=self._check_checkpoint,
        )

    def _check_checkpoint(self, checkpoint: Mapping[str, Any]) -> None:
        """Before a resumed fit loads the weights: refuse a checkpoint written by a V-cycle with another number of
        levels or network attribute (another state key: its state would not be loaded and the run would start a new
        cycle on the checkpoint's weights), and compare the configuration (but for the stages, compared at train
        start) as :meth:`load_state_dict` would, before the level is rebuilt.

        Raises:
            ValueError: a V-cycle state under another key (always); a field of its state out of range
                (:func:`~lightning_effi.vcycle.checks.check_state`, naming it); another configuration (with
                ``strict``; else a warning).
        """
        states = checkpoint.get("callbacks") or {}
        name = type(self).__name__
        mine = states.get(self.state_key)
        if mine is None:
            others = {k: v for k, v in states.items() if _is_vcycle_state(v)}
            if others:
                key, state = next(iter(others.items()))
                cfg = state.get("config", {})
                raise ValueError(
                    f"{name}: the checkpoint was written by a V-cycle with levels={cfg.get('levels')!r}, "
                    f"model_attr={cfg.get('model_attr')!r} (state {key!r}, at level {state.get('level')}), this "
                    f"callback has levels={self.levels}, model_attr={self.model_attr!r}: its weights and cycle cannot "
                    "be continued with another number of levels or network; resume with the configuration it was "
                    "written with"
                )
            return
        check_state(mine, self.levels, name)  # every field, before the level is rebuilt from it
        self._compare_config(mine)
        self._config_checked = True

    def _compare_config(self, state: Mapping[str, Any]) -> None:
        """The checkpoint's configuration against this callback's, but for the stages and the clock (compared at train
        start, once the run's length and clock are known) and ``unrelated_params`` (a check at setup, free to change
        on resume): :func:`~lightning_effi.core.state.config_mismatch`. An
        argument left to be resolved automatically (``alpha_original`` or ``model_attr`` None) and not resolved yet
        (before ``setup("fit")``) matches any value: None stands for the value it will resolve to, not for None."""
        now = self.config()
        skip = {"stages", "clock", "unrelated_params", *(k for k in _AUTO_ARGUMENTS if now[k] is None)}
        saved = {k: v for k, v in state["config"].items() if k not in skip}
        if diff := settings_diff(saved, {k: v for k, v in now.items() if k not in skip}):
            config_mismatch(
                type(self).__name__, f"the checkpoint's configuration differs (checkpoint, now): {diff}", self.strict
            )

    def effi_model_blocks(self, pl_module: pl.LightningModule) -> nn.Module:
        """The block list whose depth the levels change (the adapter's ``layer_prefix`` in ``pl_module.<model_attr>``,
        found as :meth:`setup` finds it): a technique whose layers lie outside it (random-LTD on a two-tower model's
        other tower, on an encoder-decoder's decoder where the V-cycle coalesces the encoder) keeps its depth.

        Raises:
            ValueError: no network found (see :func:`~lightning_effi.models.vcycle_base.find_vcycle_network`).
        """
        attr, adapter = self._find_network(pl_module)
        model = getattr(pl_module, attr)
        prefix = adapter.layer_prefix(model).rstrip(".")
        return model.get_submodule(prefix) if prefix else model

    def effi_model_depths(self, pl_module: pl.LightningModule) -> list[int]:
        """The number of layers of the model of every level 1..K
        (:class:`~lightning_effi.core.protocols.PlansModelChanges`): from the plans once this callback's ``setup``
        ran on ``pl_module``, else planned from ``pl_module.<model_attr>`` now without changing anything (a
        technique whose ``setup`` runs first checks its settings against them).

        Raises:
            ValueError: no network found (see :func:`~lightning_effi.models.vcycle_base.find_vcycle_network`), sizes
                the schemes cannot halve.
        """
        if self._stack.host is pl_module and self._stack.plans:
            return self._stack.depths()
        attr, adapter = self._find_network(pl_module)
        model = getattr(pl_module, attr)
        plans = V.plan_levels(
            model,
            adapter,
            self.levels,
            self.width_scheme,
            self.depth_scheme,
            self.embedding_convention,
            owner=type(self).__name__,
        )
        return level_depths(plans)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()
            self._fit_lr_multiplier = None

    def _explain_shape_error(self, exception: BaseException) -> None:
        """Add a note to a shape or size ``RuntimeError`` raised below level 1 when frozen parameters of the full width
        sit outside the network (:meth:`_check_outside_width` warned of them): the likely cause of the mismatch."""
        if self._stack.level == 1:
            return
        text = str(exception).lower()
        if isinstance(exception, (AssertionError, IndexError, KeyError, ValueError)) and any(
            word in text for word in ("index", "range", "indices")
        ):
            # a head reading blocks by index (timm's forward_intermediates(indices=[1, 3]): "feature index 3 is out of
            # range (0 to 1)" at the first coarse step, qa44-user 04)
            depths = self._stack.depths()
            exception.add_note(
                f"{type(self).__name__}: this step ran at level {self._stack.level}, where pl_module.{self.model_attr} "
                f"has {depths[self._stack.level - 1]} of its {depths[0]} blocks: code that picks blocks by index (a "
                "head on intermediate blocks, forward_intermediates(indices=...)) must use indices valid at every "
                "level (negative ones, or a fraction of the depth), or keep the depth (depth_scheme=None: width only)"
            )
            return
        if not isinstance(exception, RuntimeError):
            return
        if not any(word in text for word in ("shape", "size")):
            return  # not a shape mismatch (e.g. out of memory)
        if self._copies:
            exception.add_note(
                f"{type(self).__name__}: this step ran at level {self._stack.level}, where pl_module.{self.model_attr} "
                f"is a smaller network; {', '.join(self._copies[:3])} kept the full network's shapes (an EMA copy "
                "cannot follow the V-cycle's levels: average after the V-cycle, or train without it)"
            )
        if self._frozen_outside is None:
            return
        frozen, unrelated, hidden, coarse = self._frozen_outside
        named = []
        if frozen:
            named.append(f"the frozen parameters outside it with a {hidden}-wide axis ({', '.join(frozen[:5])})")
        if unrelated:
            named.append(f"the {hidden}-wide parameters named in unrelated_params ({', '.join(unrelated[:5])})")
        exception.add_note(
            f"{type(self).__name__}: this step ran at level {self._stack.level}, where pl_module.{self.model_attr} is "
            f"{coarse} wide (full width {hidden}); {' and '.join(named)} cannot read its states. Put the head inside "
            "the network, or pass width_scheme=None (depth only)"
            + ("; take from unrelated_params what reads or feeds its hidden states" if unrelated else "")
        )

    def _release(self) -> None:
        """The end of a fit: the resume hooks come off the module and the stack lets it go; the clock source too."""
        self._stack.remove_resume_hook()  # and releases the module
        self._stack.running = None
        self._clock_source = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """The fit raised (any exception, ``KeyboardInterrupt`` included; Lightning skips ``teardown`` then): below
        level 1, put a full-size network back in the module (the class docstring; one warning naming the levels),
        then end the fit as ``teardown`` does. The techniques that follow model changes are not told (they undo their
        own changes in their ``on_exception``), and the optimizer is not rebuilt (a new fit builds its own; the one
        in place matches the interrupted level that this callback's state still describes). Never raises (a failure
        is a warning: the fit's own exception is the one that propagates)."""
        name = type(self).__name__
        self._explain_shape_error(exception)
        if self._batch_open and saving_in_train_batch_end(trainer):
            # a batch that trained, whose on_train_batch_end raised in a callback before this one: Lightning resumes a
            # checkpoint written now (OnExceptionCheckpoint) after it, so its FLOPs are counted and its end is due
            try:
                self._count_open_batch(trainer, pl_module)
            except Exception as err:  # noqa: BLE001 - on_exception must not replace the fit's exception
                rank_zero_warn(f"{name}: could not count the FLOPs of the batch in flight ({err!r})")
            self._due_at_exception = trainer.global_step != self._last_step
            self._levels_due_at_exception = self._levels_due_now(trainer) if self._due_at_exception else []
        self._batch_open, self._open_batch = False, None
        try:
            stack = self._stack
            if stack.host is pl_module and stack.level != 1:
                level, stage = stack.level, self.stage_index
                interrupted = {
                    "level": level,
                    "weights": stack.exact_weights(device="cpu"),
                    "snapshots": stack.state_dict()["snapshots"],
                }
                path = stack.restore_full_size()
                self._interrupted = interrupted
                rank_zero_warn(
                    f"{name}: the fit raised {type(exception).__name__} at step {trainer.global_step}, at level "
                    f"{level} (stage {stage + 1} of {len(self.stages) + 1}); put a full-size network back in "
                    f"pl_module.{stack.attr} (level {' -> '.join(map(str, path))}: the level-{level} weights "
                    "de-coalesced to the full shapes, no interpolation: the weights a checkpoint of this step holds; "
                    "the pending snapshots were dropped). A new fit starts a new cycle on these weights; to continue "
                    "the interrupted cycle exactly, resume from a checkpoint"
                )
        except Exception as err:  # noqa: BLE001 - on_exception must not replace the fit's exception
            rank_zero_warn(
                f"{name}: could not put a full-size network back after the fit raised ({err!r}); the module holds the "
                f"level-{self._stack.level} network"
            )
        finally:
            try:
                self._release()
            except Exception as err:  # noqa: BLE001
                rank_zero_warn(f"{name}: could not remove its resume hooks after the fit raised ({err!r})")

    # ------------------------------------------------------------------------------------------------ training
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """In a resumed fit, have the training loader built again once Lightning has restored the loops: one built
        earlier, by ``configure_optimizers`` reading ``trainer.estimated_stepping_batches``, would miss the
        checkpoint's mid-epoch position and replay the epoch from its start
        (:func:`~lightning_effi.core.compat.rebuild_train_loader_after_restore`, Lightning issue #20550)."""
        rebuild_train_loader_after_restore(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resolve the stages against the run's length (``estimated_stepping_batches``), or on a technique's progress
        clock; on resume compare them with the checkpoint's (other stages: raise when strict, else warn and continue
        with these). Warns when a ``ModelCheckpoint`` ranks checkpoints by a monitored metric and the levels change
        the depth (:meth:`_warn_monitored_checkpoints`)."""
        check_started(trainer)
        self._train_started = True
        self._warn_monitored_checkpoints(trainer)
        self._clock_source = progress_clock(trainer.callbacks)
        source = None if self._clock_source is None else type(self._clock_source).__name__
        self.clock = S.stage_clock(self.levels, self.e_a, self.e_small, self.up_leg, source, type(self).__name__)
        if self.clock == "step":  # epochs and fractions resolved in batches, counted on global_step
            ups = list(self.up_leg) if isinstance(self.up_leg, (list, tuple)) else [self.up_leg]
            named = {"e_a": self.e_a, "e_small": self.e_small}
            if self.levels >= 3:
                named |= {f"up_leg[{i}]" if len(ups) > 1 else "up_leg": d for i, d in enumerate(ups)}
            durations = {k: d for k, d in named.items() if isinstance(d, Duration)}
            self._steps_check.arm(trainer, pl_module, durations)
        if self._saved_clock is not None and self._saved_clock != self.clock:
            config_mismatch(
                type(self).__name__,
                f"the checkpoint's stages count the {self._saved_clock!r} clock, this run's the {self.clock!r} clock "
                f"({'no technique publishes a progress clock' if source is None else source + ' publishes one'})",
                self.strict,
                fix="continue on this run's clock",
            )
        stages = self._resolve_stages(trainer)
        self._refuse_untrained_levels(trainer, stages, at_setup=False)
        if self._saved_stages is not None and (diff := S.stages_mismatch(self._saved_stages, stages)):
            if self.stage_index >= len(self._saved_stages):
                # a finished run extended (a longer run resumed after its last switch): its plan is kept, so the
                # rest of the run trains the full model
                rank_zero_info(
                    f"{type(self).__name__}: the checkpoint's run had made its last switch back to the full model "
                    f"(stages {list(self._saved_stages)}); this longer run keeps that plan and trains the full model "
                    f"from here (this run's arguments would give stages {stages})"
                )
                stages = list(self._saved_stages)
            else:
                config_mismatch(
                    type(self).__name__,
                    diff,
                    self.strict,
                    fix="continue with the current arguments' stages from the checkpoint's stage "
                    f"{self.stage_index + 1} (its level is kept)",
                )
        self.stages, self.stage_ends, self._last_step = stages, S.stage_ends(stages), trainer.global_step
        if not self._restored and trainer.global_step > 0:
            self._refuse_late_start(trainer)
        if not self._level_one_scaled and self.stage_index == 0:
            self._scale_level_one(trainer)
        elif self._restored:  # the restored optimizers' rates, for on_before_optimizer_step (qa85-break 03)
            self._remember_lrs(trainer)
        if (expected := self.current_stage_level()) != self.level:
            raise RuntimeError(
                f"{type(self).__name__}: stage {self.stage_index + 1} of {len(stages) + 1} trains level {expected} "
                "but the model "
                f"is at level {self.level}"
            )
        if self._batch_end_due:  # the checkpoint was written inside its last batch's end, before this callback's
            self._batch_end_due = False
            self._switch_if_due(trainer, pl_module)

    def _scale_level_one(self, trainer: pl.Trainer) -> None:
        """Level 1's ``lr_multiplier`` on the optimizers the fit starts with, in its first stage (a checkpoint written
        after it holds them scaled, one a tuner wrote before train start and restores does not: the finder callbacks
        lost the factor, qa81-break 01). It was applied only at the switch back to level 1, and the first stage trained
        at the unscaled LR (qa79-vcycle 01). A timm scheduler then sets the LR of the current step or epoch itself
        (``step(current_epoch)`` and ``step_update(global_step)``: each acts in its own mode only): its warmup starts
        at ``warmup_lr_init``, unscaled, which the factor doubled at step 0 (qa81-break 06); the module's
        ``lr_scheduler_step`` may step it to the next epoch (``step(epoch=current_epoch + 1)``: epoch 0 trained at
        epoch 1's LR, qa82-break 01)."""
        self._level_one_scaled = True
        if self.lr_factor(1) == 1.0:
            return
        S.scale_learning_rates(trainer.optimizers, trainer.lr_scheduler_configs, self.lr_factor(1))
        for cfg in trainer.lr_scheduler_configs:
            if S.is_timm_scheduler(cfg.scheduler):
                cfg.scheduler.step(int(trainer.current_epoch))
                cfg.scheduler.step_update(int(trainer.global_step))
        self._remember_lrs(trainer)

    def _remember_lrs(self, trainer: pl.Trainer) -> None:
        """The learning rates the level's ``lr_multiplier`` (other than 1) set on the optimizers no scheduler drives,
        for :meth:`on_before_optimizer_step`."""
        self._lrs_set = {}
        if self.lr_factor(self.level) == 1.0:
            return
        scheduled = {id(getattr(cfg.scheduler, "optimizer", None)) for cfg in trainer.lr_scheduler_configs}
        self._lrs_set = {
            i: [float(g["lr"]) for g in o.param_groups]
            for i, o in enumerate(trainer.optimizers)
            if id(o) not in scheduled
        }

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Warn once a fit when the learning rates of an optimizer without a scheduler change at a level whose
        ``lr_multiplier`` is not 1: the module (a warm-up written into ``param_groups`` in ``optimizer_step``,
        Lightning's documented pattern) or a callback writes its own rate, which replaces the one the V-cycle scaled
        when it built the level's optimizer, so the level trains without the multiplier unless that rate includes it
        (4e-3 at the switch, then 1e-3 where 4e-3 was due, in silence: qa83-compat 06). Whether a written rate
        includes the factor cannot be told from its value (a scaled decay sits at the unscaled rate too, qa84-break
        04, qa85-break 02), so the warning says what the V-cycle does and what to include. A scheduler's changes are
        the schedule's, scaled through its ``base_lrs``. A resumed fit records the restored rates at train start."""
        if self._lr_change_warned or not self._lrs_set:
            return
        index = next((i for i, o in enumerate(trainer.optimizers) if o is optimizer), None)
        if index is None or index not in self._lrs_set:
            return
        now, before = [float(g["lr"]) for g in optimizer.param_groups], self._lrs_set[index]
        if len(now) == len(before) and all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(now, before)):
            return
        self._lr_change_warned = True
        rank_zero_warn(
            f"{type(self).__name__}: the learning rate of optimizer {index} changed outside an LR scheduler at step "
            f"{trainer.global_step}, from {before[0]:g} to {now[0]:g}, at level {self.level} (lr_multiplier="
            f"{self.lr_factor(self.level):g}): a rate written into param_groups (a warm-up in optimizer_step, or a "
            "callback) replaces the one the V-cycle scaled when it built the level's optimizer; include the factor "
            "(the V-cycle's lr_factor(level), with .level the current one) or use an LR scheduler, whose base_lrs the "
            "V-cycle scales"
        )

    def _refuse_late_start(self, trainer: pl.Trainer) -> None:
        """A fit that starts at ``global_step > 0`` without V-cycle state (resumed from a checkpoint written by a fit
        without this callback, or a Trainer that trained before), while the stages count from step 0: refuse it when
        the first switch is already due (its step, or its progress on a progress clock, is reached), since it would
        come late and the rest of the plan with it.

        Raises:
            ValueError: naming the callback, the start step, the switch steps and the fixes.
        """
        now, step = self._clock_now(trainer), int(trainer.global_step)
        if not self.stage_ends or now < self.stage_ends[0]:
            return
        unit = "optimizer step" if self.clock == "step" else "progress tick"
        how = (
            "added on resume at step {step}, from a checkpoint without V-cycle state (written by a fit without this "
            "callback)"
            if getattr(trainer, "ckpt_path", None)
            else "this fit starts at step {step} without V-cycle state (its Trainer trained before)"
        ).format(step=step)
        raise ValueError(
            f"{type(self).__name__}: {how}, but its stages count from the start of the run: the switch out of "
            f"stage 1 (level 1 -> 2) was due at {unit} {self.stage_ends[0]} and the last switch back to the full "
            f"model at {self.stage_ends[-1]} (stages {self.stages}); at {now} those switches would never happen on "
            "time: the stage plan is out of reach. Start the V-cycle in a fresh fit (a new Trainer, no ckpt_path; "
            "load the checkpoint's weights into the module, e.g. with LightningModule.load_from_checkpoint), resume "
            "from a checkpoint written with the V-cycle, or give e_a / e_small / up_leg whose first stage ends after "
            f"step {step}"
        )

    def _warn_monitored_checkpoints(self, trainer: pl.Trainer) -> None:
        """One warning when a ``ModelCheckpoint(monitor=...)`` ranks the checkpoints and the levels halve the depth:
        below level 1 the monitored score is the coarse model's, while a checkpoint written then holds its weights
        de-coalesced to the full shapes, which compute another function (a duplicated block runs twice), so a "best"
        checkpoint written below level 1 is not the model that scored (the method card, "Checkpoints and resume")."""
        checkpoints = [c for c in getattr(trainer, "callbacks", ()) if isinstance(c, ModelCheckpoint)]
        monitored = sorted({str(c.monitor) for c in checkpoints if c.monitor})
        if not monitored or self.depth_scheme is None:
            return
        rank_zero_warn(
            f"{type(self).__name__}: ModelCheckpoint(monitor={', '.join(map(repr, monitored))}) ranks checkpoints by "
            "a score that, below level 1, is the coarse model's, while a checkpoint written then holds the level's "
            f"weights de-coalesced to the full model's shapes, which with depth_scheme={self.depth_scheme!r} compute "
            "another function (a duplicated block runs twice): a 'best' checkpoint written below level 1 is not the "
            "model that scored (fit(ckpt_path=...) from it resumes that level exactly; checkpoints written at level 1 "
            "hold the model that scored). depth_scheme=None with a function-preserving width convention keeps them "
            "equal"
        )

    def _resolve_stages(self, trainer: pl.Trainer) -> list[tuple[int, int]]:
        """The non-final stages ``(level, length on self.clock)`` of this fit."""
        source = self._clock_source
        self._resolved_against = None
        if source is None:
            if any(d.unit == "fraction" for d in (self.e_a, self.e_small, *S.up_leg_lengths(self.levels, self.up_leg))):
                self._resolved_against = run_length(trainer.max_steps, estimated_optimizer_steps(trainer))
            return self._fit_stages(trainer, at_setup=False) or []
        name, source_name = type(self).__name__, type(source).__name__
        if self.clock == "progress":
            return S.resolve_progress_stages(
                self.levels, self.e_a, self.e_small, self.up_leg, clock_epochs(source, trainer), name, source_name
            )
        # all in optimizer steps: they must fit in the fewest steps the run can have (and in max_steps when set)
        stages = S.resolve_stages(
            self.levels, self.e_a, self.e_small, self.up_leg, run_length(trainer.max_steps), owner=name
        )
        S.check_min_steps(stages, source.effi_min_total_steps(), name, source_name)
        return stages

    def _clock_now(self, trainer: pl.Trainer) -> int:
        """The current reading of the stages' clock: ``global_step``, or the progress source's
        ``effi_progress_done()`` in ticks (:func:`~lightning_effi.core.progress.progress_ticks`)."""
        if self.clock == "progress":
            assert self._clock_source is not None
            return progress_ticks(self._clock_source.effi_progress_done())
        return int(trainer.global_step)

    def current_stage_level(self) -> int:
        """The level the current stage trains (1 after the last listed stage)."""
        return S.stage_level(self.stages, self.stage_index)

    def _lr_factors(self) -> dict[int, float]:
        return self._fit_lr_multiplier if self._fit_lr_multiplier is not None else self.lr_multiplier

    def lr_factor(self, level: int) -> float:
        """The ``lr_multiplier`` factor of ``level`` (1.0 where none is given): during a fit, the factors it was set up
        with."""
        return self._lr_factors().get(level, 1.0)

    @property
    def baseline_flops(self) -> float:
        """Training FLOPs of the baseline (:func:`~lightning_effi.vcycle.accounting.baseline_flops`)."""
        return self.flops_account.baseline_flops

    def flops_saved_frac(self) -> float:
        """``1 - flops / baseline_flops``; 0 before any FLOPs are counted."""
        return self.flops_account.saved_frac()

    def _flops_counter(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        """What counts a batch's training FLOPs with the model in place: the module's ``effi_training_flops``, else
        the :class:`~lightning_effi.core.accounting.EfficiencyMonitor`'s measurement (``torch.utils.flop_counter``
        on the step's recorded calls; the monitor precedes this callback, so its figures of the batch are ready);
        None, with one warning, when there is neither."""
        fn = getattr(pl_module, "effi_training_flops", None)
        if callable(fn):
            return fn
        monitor = next((c for c in trainer.callbacks if isinstance(c, EfficiencyMonitor)), None)  # type: ignore[attr-defined]
        if monitor is not None:
            return lambda batch: monitor.training_flops(pl_module, batch)
        if not self._flops_warned:
            self._flops_warned = True
            rank_zero_warn(
                "VCycleCallback: the FLOPs saving is not counted (vcycle/flops_saved_frac stays 0): define "
                "`effi_training_flops(batch)` on your LightningModule or add an EfficiencyMonitor to the callbacks"
            )
        return None

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """The non-finite loss policy (:class:`~lightning_effi.core.nonfinite.NonFiniteLossGuard`), before the
        backward pass.

        Raises:
            NonFiniteLossError: ``loss`` is NaN or infinite and the policy is ``"raise"``.
        """
        self._backward_seen = True
        self.nonfinite_guard.check(trainer, loss)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._steps_check.batch_start(trainer)
        self._batch_open, self._open_batch, self._backward_seen = True, batch, False
        self._check_copies_unchanged(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch_open, self._open_batch = False, None
        self._steps_check.batch_end(trainer)
        self._count_flops(trainer, pl_module, batch, skipped_batch(pl_module, outputs))
        metrics = {
            "effi/vcycle/level": float(self.level),
            "effi/vcycle/stage": float(self.stage_index),
            "effi/vcycle/flops_saved_frac": self.flops_saved_frac(),
            "effi/vcycle/map_seconds": float(self.map_seconds),
        }
        metrics["effi/vcycle/flops_cum"] = float(self.flops_account.flops)  # every rank's (_count_flops)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        self.nonfinite_guard.log_count(trainer)  # effi/nonfinite_losses, by the stack's checking guard only
        step = trainer.global_step
        stepped, self._last_step = step != self._last_step, step
        if stepped:
            self._switch_if_due(trainer, pl_module)
        self._take_copy_sums(pl_module)

    def _count_flops(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, skipped: bool) -> None:
        """Count the trained ``batch``'s FLOPs with the current model and the full one (held in place, no forward
        runs); a batch its training_step skipped (``skipped``: returned None) trained nothing and is not counted, as
        the EfficiencyMonitor does not count it. Under data parallelism every rank's batch is counted, summed over
        the ranks (a collective every rank makes at its batch end; not while an exception is handled, where the
        ranks may not all be there: then the rank's own), so the counts, the summary and a checkpoint hold the
        run's, as the monitor's do (one rank's stood beside the monitor's, and a checkpoint resumed on another number
        of processes went on from one rank's share, qa52-ddp 02, qa53-break 04)."""
        fn = self._flops_counter(trainer, pl_module)
        before = (self.flops_account.flops, self.flops_account.full_model_flops)
        if fn is not None and not skipped:
            self.flops_account.count(lambda: self._stack.training_flops(fn, batch), type(self).__name__)
        if trainer.world_size > 1 and trainer.state.status != TrainerStatus.INTERRUPTED:
            local = torch.tensor(
                [self.flops_account.flops - before[0], self.flops_account.full_model_flops - before[1]],
                dtype=torch.float64,
                device=trainer.strategy.root_device,
            )
            total = trainer.strategy.reduce(local, reduce_op="sum")
            self.flops_account.flops = before[0] + float(total[0])
            self.flops_account.full_model_flops = before[1] + float(total[1])
        self.flops_account.flops_steps = trainer.global_step

    def _count_open_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """:meth:`_count_flops` for the batch in flight, before its ``on_train_batch_end`` (a checkpoint written there
        before this callback's, or an exception raised there)."""
        skipped = open_batch_skipped(trainer, pl_module, self._backward_seen)
        self._count_flops(trainer, pl_module, self._open_batch, skipped)

    def _levels_due_now(self, trainer: pl.Trainer) -> list[int]:
        """The levels the open batch's end switches to (none: no stage has ended)."""
        return S.levels_due(self.stages, self.stage_ends, self.stage_index, self._clock_now(trainer))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A fit resumed from a checkpoint of the run's last step has no step left: Lightning skips its training
        loop, so neither :meth:`on_train_start` (which makes a level switch due at the checkpoint's batch end) nor
        :meth:`on_train_end` (which takes a run cut short back to the full model) runs, and the module stayed at the
        checkpoint's coarse level (8,128 parameters for the uninterrupted run's 53,952, qa43-break 06). Both are made
        here, as the uninterrupted run made them."""
        if not self._restored or self._train_started:
            return
        if self._batch_end_due and self._levels_due:
            self._switch(trainer, pl_module, self._levels_due)
        self._batch_end_due, self._levels_due = False, []
        if self.level != 1:
            self.on_train_end(trainer, pl_module)

    def _switch_if_due(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After an optimizer step: change levels when a stage has ended (:func:`~lightning_effi.vcycle.stages.
        levels_due`), then a fresh optimizer and schedulers for the new level (:meth:`_new_training_state`)."""
        if path := self._levels_due_now(trainer):
            self._switch(trainer, pl_module, path)

    def _switch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, levels: list[int]) -> None:
        """Change to ``levels`` in turn (the stages that have ended), then a fresh training state."""
        step = trainer.global_step
        self._refuse_parameter_copies(trainer, pl_module, step)
        start, path = time.perf_counter(), [self.level, *levels]
        assert self.alpha_original is not None  # resolved in setup
        first, total = self.stage_index + 1, len(self.stages) + 1
        where = f"at step {step}, the switch from stage {first} to stage {first + len(path) - 1} of {total}"
        self._stack.check_finite(path[1:], where)  # before anything changes (the techniques are told next)
        notify_model_change(trainer, pl_module, "before")
        for level in path[1:]:
            self._stack.change_to(level, self.alpha_original, where)
        notify_model_change(trainer, pl_module, "after")
        self.stage_index, self.stage_start_step = self.stage_index + len(path) - 1, step
        self._new_training_state(trainer, pl_module, path[0], where)
        self.map_seconds += time.perf_counter() - start
        self.switches += 1
        rank_zero_info(
            f"VCycle: step {step}: level {' -> '.join(map(str, path))} (stage {self.stage_index + 1} of "
            # the module's, not the block list's when model_attr is one (17,088 read for 21,808; qa48-ts 03)
            f"{len(self.stages) + 1}, {sum(p.numel() for p in pl_module.parameters())} parameters in the module, "
            f"lr x{self.lr_factor(self.level)}, map {time.perf_counter() - start:.2f}s)"
        )

    def _check_copies_unchanged(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At a coarse level, refuse a copy of the network held beside it (:meth:`_warn_network_copies`) that changed
        between this callback's ``on_train_batch_end`` (after the optimizer step) and the next batch's start: an
        average the module updates in its own ``on_train_batch_end`` (DiT's ``update_ema``, by parameter name) took
        the coarse network's weights into it, its first blocks averaged towards the merged ones and the others left
        as they were, in silence (qa45-user 02); one that zips the parameters fails on the shapes. A copy an
        optimizer trains changes within the batch (whatever its gradients after: ``zero_grad()`` after ``step()``,
        qa46-break 07; an EMA an optimizer holds that never gets a gradient is still told, qa47-break 01).

        Raises:
            IncompatibleTechniques: such a copy, named, with the step and the level.
        """
        before, self._copy_sums = self._copy_sums, None
        if self.level == 1 or not self._copies or before is None:
            return
        network = getattr(pl_module, self.model_attr)
        for name in self._copies:
            if name not in before or torch.equal(before[name], _parameter_sums(pl_module.get_submodule(name))):
                continue
            depths = self._stack.depths()
            raise IncompatibleTechniques(
                f"{type(self).__name__}: pl_module.{name} (a {type(network).__name__} beside pl_module."
                f"{self.model_attr}: an EMA copy?) changed after the optimizer step of step {trainer.global_step}, at "
                f"level {self.level}, where pl_module.{self.model_attr} is the coarse network ({depths[self.level - 1]}"
                f" of its {depths[0]} blocks, {sum(p.numel() for p in network.parameters())} parameters): the average "
                "took the coarse network's weights in (an update by parameter name averages its first blocks towards "
                "the merged ones and leaves the others as they were). Update it only while the V-cycle is at level 1 "
                "(VCycleCallback.level == 1), average after the V-cycle, or train without it"
            )

    def _take_copy_sums(self, pl_module: pl.LightningModule) -> None:
        """At a coarse level, after the optimizer step: the copies' fingerprints for :meth:`_check_copies_unchanged`."""
        if self.level > 1 and self._copies:
            self._copy_sums = {name: _parameter_sums(pl_module.get_submodule(name)) for name in self._copies}

    def _refuse_parameter_copies(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """Before a level change: refuse a callback that made its own copy of the model's parameters after train start
        (a third-party EMA that builds its shadow lazily, at its first batch; one built by ``on_train_start`` is
        refused there, ``Requirements.refused_features``), naming it, before the change leaves its copy with the old
        shapes.

        Raises:
            IncompatibleTechniques: such a callback (:func:`~lightning_effi.core.features.parameter_copy_holders`).
        """
        holders = parameter_copy_holders(trainer, pl_module)
        if holders:
            names = ", ".join(sorted({type(c).__name__ for c in holders}))
            raise IncompatibleTechniques(
                f"{type(self).__name__} cannot run with {names}: at step {step}, before the level change, it holds "
                f"its own copy of the model's parameters (a third-party EMA or weight average): {_COPIES_WHY}"
            )

    def _new_training_state(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, previous_level: int, where: str
    ) -> None:
        """After a level change (from ``previous_level``; ``where`` says when, for messages): a fresh optimizer and
        schedulers for the level's model (:func:`rebuild_training_state`), checked to hold the new network's
        parameters (:meth:`_check_optimizers`), its ``lr_multiplier``, and with ``lr_schedule="continue"`` the
        schedulers continuing the old ones (:func:`~lightning_effi.vcycle.stages.continue_schedulers`: stepped as
        often as the old ones were; a ``ReduceLROnPlateau`` keeps its progress and reduced learning rates, rescaled by
        the ratio of the two levels' ``lr_multiplier``).

        Raises:
            MisconfigurationException: see :meth:`_check_optimizers`.
        """
        previous = S.scheduler_progress(trainer.lr_scheduler_configs)
        module_ids = {id(p) for p in pl_module.parameters()}
        kept = {id(p) for o in trainer.optimizers for g in o.param_groups for p in g["params"]} & module_ids
        rebuild_training_state(trainer, pl_module)
        self._check_optimizers(trainer, pl_module, previous_level, where, kept)
        S.scale_learning_rates(trainer.optimizers, trainer.lr_scheduler_configs, self.lr_factor(self.level))
        if self.lr_schedule == "continue":  # no re-warmup: the fresh schedulers continue the run's curve
            ratio = self.lr_factor(self.level) / self.lr_factor(previous_level)
            S.continue_schedulers(
                trainer.lr_scheduler_configs, previous, trainer.global_step, trainer.current_epoch, ratio
            )
            for cfg in trainer.lr_scheduler_configs:
                if S.is_timm_scheduler(cfg.scheduler):
                    # a timm scheduler holds no step count: the module's own lr_scheduler_step (which Lightning
                    # calls for it after every step) sets the LR of the step to come, as it would have without the
                    # change (its constructor left the groups at warmup_lr_init)
                    pl_module.lr_scheduler_step(cfg.scheduler, None)
        self._remember_lrs(trainer)

    def _check_optimizers(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, previous_level: int, where: str, kept: set[int]
    ) -> None:
        """The optimizers ``configure_optimizers`` returned after a level change must hold the new network's
        trainable parameters and only the module's (by identity, every param group;
        :func:`~lightning_effi.vcycle.checks.optimizer_mismatch`), ``kept``: the ids of the module's parameters
        the old optimizers held (those outside the network must stay held).

        Raises:
            MisconfigurationException: naming ``configure_optimizers``, the level change and what was found. Raised
                at the first level change, during training: the earliest moment the cause exists (before it, the
                optimizer built at the first call holds the right parameters).
        """
        network = getattr(pl_module, self.model_attr or "model")
        known = {
            id(p): (f"the level-{k} network (parked)", n)
            for k, m in self._stack.parked.items()
            for n, p in m.named_parameters()
        }
        problem = optimizer_mismatch(trainer.optimizers, pl_module, network, kept, known)
        if problem is None:
            return
        raise MisconfigurationException(
            f"{type(self).__name__}: {where} (level {previous_level} -> {self.level}), the optimizers "
            f"configure_optimizers returned hold {problem}. The V-cycle replaces pl_module.{self.model_attr} at every "
            "level change and calls configure_optimizers again: it must build new optimizers (and schedulers) from "
            "self.parameters() at every call, not return ones built before (e.g. cached at its first call) nor a "
            "stored list of parameters. Raised at the first level change, during training: the earliest moment the "
            "cause exists (until then the optimizer holds the full model's parameters)"
        )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A run that ended at a coarse level (cut short) goes back up to the full model (see the class docstring);
        the non-finite losses counted (``nonfinite_loss="warn"``) are reported (rank zero)."""
        self.nonfinite_guard.report_at_end()
        if self.level == 1:
            short = shorter_than_resolved(trainer, self._resolved_against)
            if short is not None and self.stage_ends and self.clock == "step":
                last = self.stage_ends[-1]
                rank_zero_warn(
                    f"{type(self).__name__}: {short}: the full model's last leg, after the switch back at step {last}, "
                    f"trained {max(0, trainer.global_step - last)} of its planned "
                    f"{(self._resolved_against or last) - last} optimizer steps"
                )
            return
        assert self.alpha_original is not None  # resolved in setup
        level, stage = self.level, self.stage_index
        start = time.perf_counter()
        where = f"at the end of the run (step {trainer.global_step}, cut short in stage {stage + 1} of "
        where += f"{len(self.stages) + 1}), going back up to the full model"
        self._stack.check_finite(list(range(level - 1, 0, -1)), where)
        notify_model_change(trainer, pl_module, "before")
        path = self._stack.up_to_full(self.alpha_original, where)
        notify_model_change(trainer, pl_module, "after")
        self._new_training_state(trainer, pl_module, level, where)  # an optimizer of the full model
        self.map_seconds += time.perf_counter() - start
        self.switches += 1
        self.cut_short_level = level
        rank_zero_warn(
            f"{type(self).__name__}: the run ended at level {level} in stage {stage + 1} of {len(self.stages) + 1} "
            f"(step {trainer.global_step}, before the cycle was back on the full model); the full model was restored "
            f"(level {' -> '.join(map(str, path))}: de-coalesced and interpolated with the pending snapshots, "
            f"alpha_original={self.alpha_original}) WITHOUT TRAINING after the up-switch. Lengthen the run or shorten "
            "e_a / e_small / up_leg so that the cycle ends before the run does"
        )

    # ------------------------------------------------------------------------------------------------ accounting
    def effi_baseline(self, batch: Any, pl_module: pl.LightningModule) -> Baseline | None:
        """The model the run without the V-cycle would have trained on this batch
        (:class:`~lightning_effi.core.protocols.ProvidesBaseline`, read by the
        :class:`~lightning_effi.core.accounting.EfficiencyMonitor` in ``on_train_batch_end``): below level 1,
        ``Baseline(model=...)`` with :meth:`~lightning_effi.vcycle.levels.LevelStack.full_model` (the full model held
        in ``pl_module.<model_attr>`` and its depth in an integer ``effi_num_layers``, no forward runs), so the
        module's ``effi_training_flops`` and layer-tokens count the full model on the batch; the difference is the
        V-cycle's saving (``saved/vcycle/...``). None at level 1 (the full model trains) and before ``setup``.
        """
        if self.level == 1 or self._stack.host is not pl_module:
            return None
        return Baseline(model=self._stack.full_model)

    def effi_schedule_state(self) -> dict[str, float]:
        """``{"level": k}``: the level being trained (1 = the full model, ``levels`` = the coarsest)."""
        return {"level": float(self.level)}

    def effi_summary(self) -> dict[str, Any]:
        """The V-cycle's figures; FLOPs summed over the data-parallel ranks (:meth:`_count_flops`)."""
        return {
            "vcycle/levels": int(self.levels),
            "vcycle/switches": int(self.switches),
            "vcycle/final_level": int(self.level),
            "vcycle/cut_short_level": int(self.cut_short_level),
            "vcycle/flops": float(self.flops_account.flops),
            "vcycle/baseline_flops": float(self.baseline_flops),
            "vcycle/flops_saved_frac": self.flops_saved_frac(),
            "vcycle/map_seconds": float(self.map_seconds),
        }

    # ------------------------------------------------------------------------------------------------ state
    def config(self) -> dict[str, Any]:
        return {
            "levels": self.levels,
            "stages": [list(s) for s in self.stages],
            "width_scheme": self.width_scheme,
            "depth_scheme": self.depth_scheme,
            "alpha_original": self.alpha_original,
            "embedding_convention": self.embedding_convention,
            "model_attr": self.model_attr,
            "lr_multiplier": {str(k): v for k, v in sorted(self._lr_factors().items())},
            "lr_schedule": self.lr_schedule,
            "clock": self.clock,
            "unrelated_params": list(self.unrelated_params),  # recorded; not compared on resume (a setup check only)
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        """Progress, FLOPs counters, stage ends, pending snapshots and configuration. After a fit raised below level 1
        (:meth:`on_exception`), the level and snapshots of the interrupted fit (a checkpoint written then resumes
        it)."""
        state = {
            **{k: kind(getattr(self, k)) for k, kind in _COUNTERS.items()},
            **self.flops_account.state_dict(),  # "flops", "full_model_flops", "flops_steps"
            "stage_ends": [int(e) for e in self.stage_ends],
            **self._stack.state_dict(),  # "snapshots"
            "config": self.config(),
            "nonfinite_loss": self.nonfinite_guard.state_dict(),
            "level_one_lr_scaled": self._level_one_scaled,
        }
        if self._interrupted is not None:
            state["level"], state["snapshots"] = self._interrupted["level"], self._interrupted["snapshots"]
        if self._due_at_exception:  # see on_exception
            state["batch_end_due"], state["levels_due"] = True, list(self._levels_due_at_exception)
        return state

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Below level 1, the exact weights of the coarse level beside this callback's state (``"weights"``; a resumed
        fit puts them back, the checkpoint's ``state_dict`` holds the full-size de-coalesced model). Kept out of
        :meth:`state_dict`, which holds the callback's own progress only."""
        state = (checkpoint.get("callbacks") or {}).get(self.state_key)
        if self._batch_open and saving_in_train_batch_end(trainer) and state is not None:
            # written inside on_train_batch_end before this callback's own (a user's callback listed before the
            # V-cycle calls trainer.save_checkpoint there, or raised there and OnExceptionCheckpoint saved): Lightning
            # resumes it after the batch, so the state holds the batch's FLOPs, and a level switch the batch's end
            # makes is made by the resumed fit at its start, on the same weights, optimizer and schedulers (the
            # checkpoint holds them as they are now). It was written one batch behind, and the resumed fit switched
            # one step late (qa38-break 01).
            account = self.flops_account.state_dict()
            try:
                self._count_open_batch(trainer, pl_module)
                state.update(self.flops_account.state_dict())
            finally:
                self.flops_account.load_state_dict(account)
            state["batch_end_due"] = stepped = trainer.global_step != self._last_step  # a switch may be due
            # the levels it switches to, for a resumed fit without a step left (on_fit_end)
            state["levels_due"] = self._levels_due_now(trainer) if stepped else []
        weights = self._stack.exact_weights() if self._interrupted is None else self._interrupted["weights"]
        if weights is not None and state is not None:
            state["weights"] = weights

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Lightning calls this right before :meth:`load_state_dict` whenever a checkpoint is restored: note whether
        it is restored for ``fit`` (a resumed cycle) or for ``validate`` / ``test`` / ``predict`` (the callback does
        nothing outside ``fit``: the checkpoint's full-size ``state_dict`` loads into the full model as it is)."""
        self._evaluating = trainer.state.fn != TrainerFn.FITTING

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The checkpoint's progress; its configuration was checked by the resume hook before the weights loaded
        (here when the hook did not run) but for the stages, which on_train_start compares with those of the current
        arguments once the run's length is known.

        Outside ``fit`` (``trainer.validate/test/predict(ckpt_path=...)``, told by :meth:`on_load_checkpoint`) the
        state is ignored, whatever its level or configuration: the checkpoint's ``state_dict`` holds the full model
        (de-coalesced below level 1) and loads into the full model in place; no coarse level is rebuilt and this
        callback's state (e.g. of the fit that ran before on the same Trainer) is left as it is.

        Raises:
            ValueError: (``fit``) a field out of range (:func:`~lightning_effi.vcycle.checks.check_state`, naming it;
                also the non-finite loss count); (``fit``, ``strict``) another configuration, when the resume hook
                did not compare it.
            RuntimeError: (``fit``) the checkpoint's level is not in place (the module's resume hook did not run).
        """
        if self._evaluating:
            self._evaluating = False
            return
        check_state(state_dict, self.levels, type(self).__name__)
        self._restored = True
        # a checkpoint without the field was written before level 1's factor applied from the first stage: its fit
        # goes on as it trained
        self._level_one_scaled = bool(state_dict.get("level_one_lr_scaled", True))
        self._saved_clock = str(state_dict["config"].get("clock", "step"))
        if not self._config_checked:
            self._compare_config(state_dict)
        self._config_checked = False
        self._stack.load_state_dict(state_dict)  # checks the level (rebuilt by the resume hook), loads the snapshots
        self._saved_stages = [(int(k), int(n)) for k, n in state_dict["config"]["stages"]]
        self.stages, self.stage_ends = self._saved_stages, [int(e) for e in state_dict["stage_ends"]]
        if not self._saved_stages:
            # written before on_train_start resolved the stages (LearningRateFinder / BatchSizeFinder save a checkpoint
            # at on_fit_start and restore it after their search): nothing to compare, on_train_start resolves them
            self._saved_stages = self._saved_clock = None
        self.flops_account.load_state_dict(state_dict)
        for k, kind in _COUNTERS.items():
            if k != "level":  # rebuilt by the on_load_checkpoint wrapper, checked above
                setattr(self, k, kind(state_dict[k]))
        self.nonfinite_guard.load_state_dict(state_dict.get("nonfinite_loss") or {})  # older checkpoints: none
        self._batch_end_due = bool(state_dict.get("batch_end_due", False))
        self._levels_due = [int(level) for level in state_dict.get("levels_due", [])]


def _is_vcycle_state(state: object) -> bool:
    """Whether a checkpoint's callback state is a V-cycle's (:meth:`VCycleCallback.state_dict`), whatever its key."""
    return isinstance(state, Mapping) and {"level", "stage_index", "snapshots", "config"} <= set(state)


VCycle = VCycleCallback  # short name, like RandomLTD / InfoBatch


def _parameter_sums(module: Any) -> Tensor:
    """Each parameter's sum (float64, on the CPU): a cheap fingerprint that an average's update changes."""
    params = [p.detach() for p in module.parameters()]
    if not params:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([p.double().sum() for p in params]).cpu()


def _refuse_cli_optimizer(pl_module: pl.LightningModule) -> None:
    """Refuse the ``configure_optimizers`` LightningCLI sets on the module for its ``optimizer:`` / ``lr_scheduler:``
    arguments (``LightningCLI.configure_optimizers`` with an optimizer built from the module's parameters once, before
    the fit, and returned at every call): the V-cycle calls ``configure_optimizers`` at every level change for the new
    network's parameters, and the fit failed at the first one, with advice about caching (qa52-cli 01).

    Raises:
        MisconfigurationException: naming the remedy (an optimizer built in the module's own ``configure_optimizers``,
            its class given as an ``OptimizerCallable`` init argument).
    """
    method = getattr(pl_module, "configure_optimizers", None)
    fn = getattr(method, "__func__", None)
    keywords = getattr(fn, "keywords", None)
    target = getattr(fn, "func", None)
    if not isinstance(keywords, dict) or "optimizer" not in keywords:
        return
    if getattr(target, "__qualname__", "").split(".")[-2:] != ["LightningCLI", "configure_optimizers"]:
        return
    raise MisconfigurationException(
        f"VCycleCallback: {type(pl_module).__name__}.configure_optimizers is LightningCLI's, for its `optimizer:` "
        f"(`--optimizer`) argument: it returns the one {type(keywords['optimizer']).__name__} LightningCLI built from "
        "the full model's parameters before the fit, and the V-cycle calls configure_optimizers at every level change "
        "for the new network's parameters. Build the optimizer in your module's configure_optimizers instead, e.g. "
        "take `optimizer: lightning.pytorch.cli.OptimizerCallable` in __init__ and return "
        "`self.optimizer(self.parameters())` (Lightning's dependency injection; the YAML keeps its class_path and "
        "init_args under model.init_args.optimizer)"
    )
