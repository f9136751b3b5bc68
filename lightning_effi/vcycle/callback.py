"""``VCycleCallback``: the multi-level V-cycle of Zou et al. (ICLR 2024) inside one ``trainer.fit``: the Lightning
hooks, the level changes, the callback's state and what it logs. The stage arithmetic is in
:mod:`lightning_effi.vcycle.stages`, the operators in :mod:`lightning_effi.vcycle.operators`; the method card
(``README.md`` beside this file) tells the long story.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from typing_extensions import override

from lightning_effi.core.checks import is_int
from lightning_effi.core.compat import optimizers_to_device, rewrap_ddp
from lightning_effi.core.progress import Duration
from lightning_effi.core.requirements import BATCH_STRUCTURES, Requirements, check_trainer
from lightning_effi.core.state import config_mismatch
from lightning_effi.vcycle import operators as V
from lightning_effi.vcycle import stages as S
from lightning_effi.vcycle.stages import stage_plan, vcycle_flops_fraction

if TYPE_CHECKING:  # the model registry imports this package's operators; import it when used
    from lightning_effi.models.vcycle_base import VCycleAdapter

__all__ = ["VCycle", "VCycleCallback", "rebuild_training_state", "stage_plan", "vcycle_flops_fraction"]


def rebuild_training_state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """After the module's parameters changed shape: re-wrap DDP, re-run ``configure_optimizers`` in the strategy
    (sets ``trainer.optimizers`` and ``trainer.lr_scheduler_configs``), move the optimizer state to the device. Under
    DDP every rank calls it at the same step. Non-public Lightning calls: :mod:`lightning_effi.core.compat`."""
    rewrap_ddp(trainer, pl_module)
    trainer.strategy.setup_optimizers(trainer)
    optimizers_to_device(trainer.optimizers, trainer.strategy.root_device)


#: the callback's checkpointed counters and their types (the rest of the state: stage ends, snapshots, config)
_COUNTERS: dict[str, type] = {
    "level": int,
    "stage_index": int,
    "stage_start_step": int,
    "flops": float,
    "full_model_flops": float,
    "flops_steps": int,
    "map_seconds": float,
    "switches": int,
}
_SHAPES_WHY = "its averaged weights belong to one model, which the V-cycle replaces at every level change"


class VCycleCallback(Callback):
    """The multi-level V-cycle inside one ``trainer.fit`` (Zou et al., ICLR 2024; details in the method card).

    Level 1 (the full model) trains for ``e_a``, is coalesced, level 2 trains for ``e_a``, ... level K for
    ``e_small``; then de-coalesce + interpolate, level K−1 for its ``up_leg``, ... level 1 for the rest of the run.
    Every level gets a fresh optimizer and scheduler (``configure_optimizers`` runs again at each switch).

    Args:
        levels: K >= 2.
        e_a: every down-leg stage (levels 1..K−1; the paper's :math:`E_a`): a
            :class:`~lightning_effi.core.progress.Duration` or what ``Duration.parse`` reads: an int of optimizer
            steps (>= 1), ``"500st"``, ``"2ep"`` (``n · ceil(num_training_batches / accumulate_grad_batches)`` steps,
            read at train start), ``"0.05dur"`` (``floor(f · T)`` of the run's ``T`` steps, at least 1). No floats.
        e_small: the coarsest level (paper: :math:`E_{small}`, half the baseline), same forms (a fraction may give 0).
        up_leg: required for K >= 3 (the paper gives no length): the up-leg stages of levels 2..K−1, one length for
            all or a list ordered by level (``[level 2, level 3, ...]``).
        width_scheme, depth_scheme, embedding_convention: the adapter's ``plan`` arguments (``"half"``,
            ``"adjacent"``, ``"official"``; explicit groups apply to level 1 → 2 only when K = 2).
        alpha_original: weight of the snapshot in the interpolation, in [0, 1]; None: the adapter's default.
        lr_multiplier: ``{level: factor}`` on the level's peak LR, e.g. ``{2: 4.0}`` (official GPT-2 example).
        model_attr: the LightningModule attribute holding the network (swapped at every level change).
        adapter: ``"auto"``, a registered V-cycle adapter name (``hf_gpt2``, ``hf_bert``, ``timm_vit``) or an instance.
        lr_schedule: ``"continue"``: the rebuilt scheduler is advanced to the current step (one LR curve, warmup in the
            first stage only); ``"restart"``: the module's schedule restarts from its step 0 at every level change.
        strict: a checkpoint written with another configuration raises on resume (False: warns).
        baseline_steps: optimizer steps of the baseline the FLOPs saving is measured against (the full model's mean
            training FLOPs per step on this run's batches times this); None: the full model on this run's batches.
        **deprecated: ``e_a_steps``, ``e_a_fraction``, ``e_a_epochs``, ``e_small_*``, ``up_leg_*``: the old spellings
            of the three lengths, accepted for one release with a ``DeprecationWarning``.

    Logged every step: ``effi/vcycle/level``, ``effi/vcycle/stage``, ``effi/vcycle/flops_cum``,
    ``effi/vcycle/flops_saved_frac``, ``effi/vcycle/map_seconds``; summary keys ``vcycle/*``.

    Attributes:
        requirements: shapes change; single device or DDP; no weight averaging (``core.requirements``).

    Raises:
        ValueError: (construction) see :func:`~lightning_effi.vcycle.stages.check_arguments`; (``setup`` or train
            start) no adapter for the model, sizes the schemes cannot halve, stages longer than the run, fractions in
            a run of unknown length, epochs with a train dataloader without a length.
        IncompatibleTechniques: (``setup``) a strategy other than single device / DDP (FSDP, DeepSpeed, ...), weight
            averaging callbacks, a technique that patches the model's layers (random-LTD).
        MisconfigurationException: (``setup``) a ``torch.compile``'d network.
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
        incompatible_callbacks=(("StochasticWeightAveraging", _SHAPES_WHY), ("WeightAveraging", _SHAPES_WHY)),
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
        model_attr: str = "model",
        adapter: str | VCycleAdapter = "auto",
        lr_schedule: Literal["continue", "restart"] = "continue",
        strict: bool = True,
        baseline_steps: int | None = None,
        **deprecated: Any,
    ) -> None:
        name = type(self).__name__
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
            deprecated=deprecated,
            stacklevel=3,
        )
        from lightning_effi.models.vcycle_base import VCycleAdapter

        if not isinstance(adapter, (str, VCycleAdapter)):
            raise ValueError(f"{name}.adapter must be 'auto', a registered name or a VCycleAdapter, got {adapter!r}")
        self.levels, self.e_a, self.e_small, self.up_leg = args.levels, args.e_a, args.e_small, args.up_leg
        self.width_scheme, self.depth_scheme = args.width_scheme, args.depth_scheme
        self.embedding_convention, self.lr_multiplier = args.embedding_convention, args.lr_multiplier
        self.alpha_arg: float | None = args.alpha_original  # None: the adapter's default, resolved in setup
        self.alpha_original: float | None = self.alpha_arg
        self.model_attr, self.adapter_arg, self.lr_schedule = args.model_attr, adapter, args.lr_schedule
        self.strict, self.baseline_steps = args.strict, args.baseline_steps
        # resolved in setup / on_train_start
        self.adapter: VCycleAdapter | None = None
        self.plans: list[V.VCyclePlan] = []  # plans[k - 1]: level k → k + 1
        self._parked: dict[int, nn.Module] = {}  # level → the module of that level (CPU) while a coarser one trains
        self._reset_progress()

    def _reset_progress(self) -> None:
        """A fresh cycle: a new fit with this callback starts from the first stage (a resumed fit then loads the
        checkpoint's progress)."""
        self.stages: list[tuple[int, int]] = []  # non-final (level, steps), resolved against this fit's length
        self.stage_ends: list[int] = []  # cumulative end step of each non-final stage
        # checkpointed: progress, snapshots pending interpolation (level → state dict), FLOPs counters
        self.level, self.stage_index, self.stage_start_step, self.switches = 1, 0, 0, 0
        self.snapshots: dict[int, dict[str, Tensor]] = {}
        self.flops, self.map_seconds = 0.0, 0.0
        self.full_model_flops, self.flops_steps = 0.0, 0  # the full model's FLOPs on the batches of these steps
        self._last_step, self._flops_ok = -1, True  # runtime only

    def __repr__(self) -> str:
        """Every constructor argument (new spelling): ``eval`` with ``VCycleCallback`` and ``Duration`` in scope
        builds an equal callback (an adapter instance needs its class in scope too)."""
        up_leg = list(self.up_leg) if isinstance(self.up_leg, tuple) else self.up_leg
        return (
            f"{type(self).__name__}(levels={self.levels!r}, e_a={self.e_a!r}, e_small={self.e_small!r}, "
            f"up_leg={up_leg!r}, width_scheme={self.width_scheme!r}, depth_scheme={self.depth_scheme!r}, "
            f"alpha_original={self.alpha_arg!r}, lr_multiplier={self.lr_multiplier!r}, "
            f"embedding_convention={self.embedding_convention!r}, model_attr={self.model_attr!r}, "
            f"adapter={self.adapter_arg!r}, lr_schedule={self.lr_schedule!r}, strict={self.strict!r}, "
            f"baseline_steps={self.baseline_steps!r})"
        )

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(levels=self.levels, model_attr=self.model_attr)

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        name = type(self).__name__
        if self.level != 1 or self._parked:
            raise RuntimeError(
                f"{name}: a previous fit with this callback stopped at level {self.level} (the coarse "
                "model is still in its module); resume from a checkpoint with a new module and callback"
            )
        self._reset_progress()
        callbacks = list(trainer.callbacks)
        check_trainer(trainer, callbacks if any(c is self for c in callbacks) else [*callbacks, self])
        model = getattr(pl_module, self.model_attr, None)
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"{name}.model_attr: {type(pl_module).__name__} has no nn.Module attribute {self.model_attr!r}"
            )
        if type(model).__name__ == "OptimizedModule":
            raise MisconfigurationException(
                f"{name}: pl_module.{self.model_attr} is torch.compile'd; compile inside "
                "the module's forward or not at all (the model is replaced mid-fit)"
            )
        from lightning_effi.models.vcycle_base import find_vcycle_adapter

        self.adapter = find_vcycle_adapter(model, self.adapter_arg)
        if self.alpha_arg is None:
            self.alpha_original = float(self.adapter.default_alpha_original)
        if self.alpha_original == 0.0:
            rank_zero_warn(
                f"{name}: alpha_original=0 keeps the de-coalesced copies symmetric; without dropout they "
                "never separate: use alpha_original > 0"
            )
        self.plans = V.plan_levels(
            model, self.adapter, self.levels, self.width_scheme, self.depth_scheme, self.embedding_convention
        )
        self._resolve_stages(trainer, at_setup=True)
        self._parked = {}
        self._install_load_hook(pl_module)

    def _resolve_stages(self, trainer: pl.Trainer, at_setup: bool) -> None:
        """Stage lengths in optimizer steps: in ``setup`` when ``trainer.max_steps`` is set and no length is in
        epochs, else when training starts (the train dataloader's length is known then)."""
        if self.stage_ends:
            return
        epochs = any(d.unit == "epoch" for d in (self.e_a, self.e_small, *S.up_leg_lengths(self.levels, self.up_leg)))
        total = S.run_length(trainer.max_steps, None if at_setup else trainer.estimated_stepping_batches)
        if not (at_setup and (epochs or total is None)):
            self.stages = S.resolve_stages(
                self.levels,
                self.e_a,
                self.e_small,
                self.up_leg,
                total,
                trainer.num_training_batches if epochs else None,
                trainer.accumulate_grad_batches,
                type(self).__name__,
            )
            self.stage_ends = S.stage_ends(self.stages)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        hook = pl_module.__dict__.get("on_load_checkpoint")
        if getattr(hook, "_vcycle_owner", None) is self:
            del pl_module.__dict__["on_load_checkpoint"]

    # ------------------------------------------------------------------------------------------------ resume
    def _install_load_hook(self, pl_module: pl.LightningModule) -> None:
        """Wrap ``pl_module.on_load_checkpoint`` on the instance: before the weights load, rebuild the level saved in
        the checkpoint (Lightning calls this hook before the strict ``load_state_dict``)."""
        original = pl_module.on_load_checkpoint
        if getattr(original, "_vcycle_owner", None) is self:
            return

        def on_load_checkpoint(checkpoint: dict[str, Any]) -> None:
            state = checkpoint.get("callbacks", {}).get(self.state_key)
            if state:
                self._restore_level(pl_module, int(state["level"]))
            original(checkpoint)

        on_load_checkpoint._vcycle_owner = self  # type: ignore[attr-defined]
        pl_module.on_load_checkpoint = on_load_checkpoint  # type: ignore[method-assign]

    def _restore_level(self, pl_module: pl.LightningModule, level: int) -> None:
        """Build fresh models down to ``level`` (random weights: the checkpoint's weights are loaded next)."""
        if not 1 <= level <= self.levels:
            raise ValueError(f"{type(self).__name__}: the checkpoint's level {level} is outside 1..{self.levels}")
        if level == self.level:
            return
        if self.level != 1:
            raise RuntimeError(f"{type(self).__name__}: cannot restore level {level} from level {self.level}")
        model, self._parked = V.build_levels(getattr(pl_module, self.model_attr), self.adapter, self.plans, level)
        self._set_level(pl_module, model, level)

    # ------------------------------------------------------------------------------------------------ training
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resolve_stages(trainer, at_setup=False)
        self._last_step = trainer.global_step
        if (expected := self.current_stage_level()) != self.level:
            raise RuntimeError(
                f"{type(self).__name__}: stage {self.stage_index} trains level {expected} but the model "
                f"is at level {self.level}"
            )

    def current_stage_level(self) -> int:
        """The level the current stage trains (1 after the last listed stage)."""
        return self.stages[self.stage_index][0] if self.stage_index < len(self.stages) else 1

    def lr_factor(self, level: int) -> float:
        return self.lr_multiplier.get(level, 1.0)

    def _count_flops(self, pl_module: pl.LightningModule, batch: Any) -> None:
        """This batch's training FLOPs (``pl_module.effi_training_flops``) with the current model and the full one."""
        fn = getattr(pl_module, "effi_training_flops", None)
        if not callable(fn) or not self._flops_ok:
            return
        current = pl_module._modules[self.model_attr]
        try:
            cur = base = float(fn(batch))
            if self.level != 1:  # the parked full model in place for the count (no forward runs)
                pl_module._modules[self.model_attr] = self._parked[1]
                base = float(fn(batch))
        except (NotImplementedError, TypeError, KeyError) as err:
            self._flops_ok = False
            warnings.warn(
                f"{type(self).__name__}: FLOPs accounting disabled ({type(err).__name__}: {err})", stacklevel=2
            )
            return
        finally:
            pl_module._modules[self.model_attr] = current
        self.flops += cur
        self.full_model_flops += base

    @property
    def baseline_flops(self) -> float:
        """Training FLOPs of the baseline (:func:`~lightning_effi.vcycle.stages.baseline_flops`)."""
        return S.baseline_flops(self.full_model_flops, self.flops_steps, self.baseline_steps)

    def flops_saved_frac(self) -> float:
        """``1 - flops / baseline_flops``; 0 before any FLOPs are counted."""
        return 1.0 - self.flops / self.baseline_flops if self.baseline_flops else 0.0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._count_flops(pl_module, batch)
        self.flops_steps = trainer.global_step
        pl_module.log_dict(
            {
                "effi/vcycle/level": float(self.level),
                "effi/vcycle/stage": float(self.stage_index),
                "effi/vcycle/flops_cum": float(self.flops),
                "effi/vcycle/flops_saved_frac": self.flops_saved_frac(),
                "effi/vcycle/map_seconds": float(self.map_seconds),
            },
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )
        step = trainer.global_step
        stepped, self._last_step = step != self._last_step, step
        if not stepped or self.stage_index >= len(self.stages) or step < self.stage_ends[self.stage_index]:
            return
        start = time.perf_counter()
        path = [self.level]
        while self.stage_index < len(self.stages) and step >= self.stage_ends[self.stage_index]:
            self.stage_index += 1
            self._change_level(pl_module, self.current_stage_level())
            path.append(self.level)
        self.stage_start_step = step
        rebuild_training_state(trainer, pl_module)
        S.scale_learning_rates(trainer.optimizers, trainer.lr_scheduler_configs, self.lr_factor(self.level))
        if self.lr_schedule == "continue":  # no re-warmup: the fresh schedulers continue the run's curve
            S.advance_schedulers(trainer.lr_scheduler_configs, trainer.global_step, trainer.current_epoch)
        self.map_seconds += time.perf_counter() - start
        self.switches += 1
        rank_zero_info(
            f"VCycle: step {step}: level {' -> '.join(map(str, path))} (stage {self.stage_index}/"
            f"{len(self.stages)}, {sum(p.numel() for p in getattr(pl_module, self.model_attr).parameters())}"
            f" parameters, lr x{self.lr_factor(self.level)}, map {time.perf_counter() - start:.2f}s)"
        )

    def _change_level(self, pl_module: pl.LightningModule, target: int) -> None:
        """One level down (snapshot, coalesce; the large model waits on the CPU) or up (de-coalesce, interpolate
        with the snapshot, into the waiting large model)."""
        assert self.adapter is not None and self.alpha_original is not None
        current = getattr(pl_module, self.model_attr)
        if target == self.level + 1:
            self.snapshots[self.level] = V.snapshot(current)
            new = V.coalesce_model(current, self.plans[self.level - 1], self.adapter)
            self._parked[self.level] = current.to("cpu")
        elif target == self.level - 1:
            new = V.decoalesce_model(
                current,
                self._parked.pop(target),
                self.plans[target - 1],
                self.snapshots.pop(target),
                self.alpha_original,
            )
        else:
            raise RuntimeError(f"{type(self).__name__}: cannot go from level {self.level} to {target}")
        self._set_level(pl_module, new, target)

    def _set_level(self, pl_module: pl.LightningModule, model: nn.Module, level: int) -> None:
        """Swap in the model of ``level``; a module's ``effi_num_layers`` (FLOPs accounting) follows it."""
        setattr(pl_module, self.model_attr, model)
        self.level = level
        if is_int(getattr(pl_module, "effi_num_layers", None)) and self.plans:
            plan, side = (self.plans[0], 0) if level == 1 else (self.plans[level - 2], 1)
            pl_module.effi_num_layers = plan.num_layers[side]

    # ------------------------------------------------------------------------------------------------ accounting
    def effi_summary(self) -> dict[str, Any]:
        return {
            "vcycle/levels": int(self.levels),
            "vcycle/switches": int(self.switches),
            "vcycle/final_level": int(self.level),
            "vcycle/flops": float(self.flops),
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
            "lr_multiplier": {str(k): v for k, v in sorted(self.lr_multiplier.items())},
            "lr_schedule": self.lr_schedule,
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            **{k: kind(getattr(self, k)) for k, kind in _COUNTERS.items()},
            "stage_ends": [int(e) for e in self.stage_ends],
            "snapshots": {str(k): dict(v) for k, v in self.snapshots.items()},
            "config": self.config(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, mine = dict(state_dict["config"]), self.config()
        if not self.stages:  # lengths resolved in on_train_start: the checkpoint's resolution is kept
            saved.pop("stages", None)
            mine.pop("stages", None)
        diff = {k: (saved.get(k), mine.get(k)) for k in mine if saved.get(k) != mine.get(k)}
        if diff:
            config_mismatch(
                type(self).__name__, f"the checkpoint's configuration differs (checkpoint, now): {diff}", self.strict
            )
        if int(state_dict["level"]) != self.level:
            raise RuntimeError(
                f"{type(self).__name__}: the checkpoint is at level {state_dict['level']} but the model "
                f"is at level {self.level}: the on_load_checkpoint wrapper installed in setup did not "
                "run (was the module's on_load_checkpoint replaced?)"
            )
        if not self.stages:
            self.stages = [(int(k), int(n)) for k, n in state_dict["config"]["stages"]]
            self.stage_ends = [int(e) for e in state_dict["stage_ends"]]
        for k, kind in _COUNTERS.items():
            if k != "level":  # rebuilt by the on_load_checkpoint wrapper, checked above
                setattr(self, k, kind(state_dict[k]))
        self.snapshots = {int(k): dict(v) for k, v in state_dict["snapshots"].items()}


VCycle = VCycleCallback  # short name, like RandomLTD / InfoBatch
