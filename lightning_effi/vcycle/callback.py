"""``VCycleCallback``: the multi-level V-cycle (coalesce → train small → de-coalesce + interpolate) inside one
``trainer.fit``.

Zou, Zhang, Deng, "A Multi-Level Framework for Accelerating Training Transformer Models" (ICLR 2024, arXiv
2404.07999); official code ``Photooon/Multi-Level-Training-Framework``. Specification: ``shared/specs/vcycle.md``
§4 (schedule), §5 (FLOPs), §7.1 (Lightning mechanics). The operators live in
:mod:`lightning_effi.vcycle.operators` and :mod:`lightning_effi.models.vcycle_base`; this callback wires them into
Lightning:

- ``setup("fit")``: checks the strategy (single device or DDP), finds the V-cycle adapter of
  ``pl_module.<model_attr>``, computes every level's plan (odd or unsupported sizes raise here, before training),
  resolves the stage lengths when ``trainer.max_steps`` is set, and installs an instance-level wrapper of
  ``pl_module.on_load_checkpoint`` that rebuilds the checkpoint's level before the weights load (spec §7.1).
- ``on_train_batch_end``: on a batch that stepped the optimizer (``trainer.global_step`` changed) and reached the
  current stage's end, changes level (zero-length stages cascade in the same call): down = snapshot (CPU fp32) +
  coalesce + swap in the small model; up = de-coalesce + interpolate with the snapshot + swap the large model back.
  Then the DDP wrapper (if any) and the optimizers/schedulers are rebuilt (:func:`rebuild_training_state`), the
  level's LR multiplier is applied and, with ``lr_schedule="continue"``, the new scheduler is advanced to the current
  step (no re-warmup).
- ``state_dict``: level, stage, resolved stage ends, snapshots pending interpolation (tensors), FLOPs counters and
  the configuration: safe-loadable (``torch.load(weights_only=True)``); resume is exact in every stage.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from typing_extensions import override

from lightning_effi.core.state import config_mismatch
from lightning_effi.vcycle import operators as V

if TYPE_CHECKING:  # the model registry imports this package's operators; import it when used
    from lightning_effi.models.vcycle_base import VCycleAdapter

__all__ = ["VCycle", "VCycleCallback", "rebuild_training_state", "stage_plan", "vcycle_flops_fraction"]

#: Lightning versions whose semi-private APIs :func:`rebuild_training_state` uses (strategy.model setter,
#: DDPStrategy.configure_ddp, lightning.fabric.utilities.optimizer._optimizers_to_device).
SUPPORTED_LIGHTNING = ">=2.6,<2.7"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))


def _plain(x: Any) -> Any:
    """OmegaConf containers (Hydra) → plain dicts/lists; tuples → lists."""
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        return [_plain(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------------------------------------
# helpers (pure / small)


def stage_plan(levels: int, e_a: int, e_small: int, up_leg: Sequence[int] = ()) -> list[tuple[int, int]]:
    """The V-cycle's non-final stages as ``(level, steps)`` (spec §4.1); the final stage (level 1, the rest of the
    run) is not listed. ``up_leg[i]`` is the length of the up-leg stage of level ``i + 2``.

    >>> stage_plan(3, 2, 4, [3])
    [(1, 2), (2, 2), (3, 4), (2, 3)]
    """
    down = [(k, e_a) for k in range(1, levels)]
    up = [(k, up_leg[k - 2]) for k in range(levels - 1, 1, -1)]
    return [*down, (levels, e_small), *up]


def vcycle_flops_fraction(stages: Sequence[tuple[int, float]], baseline_steps: int, baseline_cost: float) -> float:
    """``Σ steps_s · C_s / (baseline_steps · C_1)`` (spec §5): the V-cycle's training FLOPs as a fraction of the
    baseline's. ``stages`` = ``(steps, per-step cost)``; the saving is ``1 −`` this."""
    if baseline_steps <= 0 or baseline_cost <= 0:
        raise ValueError("vcycle_flops_fraction: baseline_steps and baseline_cost must be > 0")
    return sum(s * c for s, c in stages) / (baseline_steps * baseline_cost)


def rebuild_training_state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """After the module's parameters changed shape: re-wrap DDP, re-run ``configure_optimizers`` in the strategy
    (sets ``trainer.optimizers`` and ``trainer.lr_scheduler_configs``) and move optimizer state to the device.

    Uses semi-private Lightning APIs (supported range :data:`SUPPORTED_LIGHTNING`): ``strategy.model = pl_module``
    then ``DDPStrategy.configure_ddp()`` (which asserts that ``strategy.model`` is the bare LightningModule), and
    ``_optimizers_to_device``. Under DDP every rank must call it at the same step (the new wrapper broadcasts rank
    0's parameters).
    """
    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy):
        strategy.model = pl_module
        strategy.configure_ddp()
    strategy.setup_optimizers(trainer)
    _optimizers_to_device(trainer.optimizers, strategy.root_device)


@contextlib.contextmanager
def _module_attr(pl_module: nn.Module, attr: str, module: nn.Module) -> Iterator[None]:
    """Temporarily register ``module`` as ``pl_module.<attr>`` (no forward runs meanwhile)."""
    old = pl_module._modules[attr]
    pl_module._modules[attr] = module
    try:
        yield
    finally:
        pl_module._modules[attr] = old


def _snapshot(model: nn.Module) -> dict[str, Tensor]:
    """CPU fp32 copy of the state dict (floating tensors; others copied as is), ties kept as shared tensors."""
    out: dict[str, Tensor] = {}
    seen: dict[tuple, Tensor] = {}
    for k, t in model.state_dict().items():
        key = V._storage_key(t)
        if key not in seen:
            t = t.detach()
            seen[key] = t.to("cpu", torch.float32, copy=True) if t.is_floating_point() else t.to("cpu", copy=True)
        out[k] = seen[key]
    return out


# ---------------------------------------------------------------------------------------------------------------------


class VCycleCallback(Callback):
    """The multi-level V-cycle inside one ``trainer.fit`` (spec §4.1, §7.1).

    Stages: level 1 (the full model) for ``e_a`` steps, coalesce, level 2 for ``e_a`` steps, ... level K for
    ``e_small`` steps, de-coalesce + interpolate, level K−1 for its ``up_leg`` steps, ... level 1 for the rest of the
    run. Every level has a fresh optimizer and scheduler (``configure_optimizers`` is called again, as the official
    code starts a new run per stage); the level's ``lr_multiplier`` scales their peak LR.

    Args:
        levels: K >= 2.
        e_a_steps / e_a_fraction / e_a_epochs: optimizer steps of every down-leg stage (levels 1..K−1), or that
            fraction of the run (``floor(f · T)``, at least 1), or that many epochs (the paper's :math:`E_a`; ``n ·
            S`` steps, where ``S = ceil(trainer.num_training_batches / accumulate_grad_batches)`` is the optimizer
            steps of one epoch, read when training starts, so a switch falls on an epoch boundary). Give exactly one.
        e_small_steps / e_small_fraction / e_small_epochs: steps of the coarsest level (paper: :math:`E_{small}`,
            half the baseline's length), a fraction (``floor(f · T)``, may be 0), or epochs. Give exactly one.
        up_leg_steps / up_leg_fraction / up_leg_epochs: required for K >= 3 (no silent default): the up-leg stage of
            levels 2..K−1, one int for all or a list ordered by level (``[level 2, level 3, ...]``), one fraction,
            or epochs (one int or a list by level).
        width_scheme, depth_scheme, embedding_convention: the adapter's :meth:`plan` arguments (``"half"``,
            ``"adjacent"``, ``"official"``; explicit groups apply to level 1 → 2 only when K = 2).
        alpha_original: weight of the snapshot in the interpolation, in [0, 1]; None = the adapter's default
            (BERT 0.5, GPT-2 / ViT 0.25).
        lr_multiplier: ``{level: factor}`` applied to the level's optimizer (param groups' ``lr``/``initial_lr`` and
            the schedulers' ``base_lrs``); e.g. ``{2: 4.0}`` (official GPT-2 example). Level 1 defaults to 1.
        lr_schedule: ``"continue"`` (default): the rebuilt scheduler is advanced to the current step, so the run
            follows one LR curve (warmup in the first stage only); ``"restart"``: it starts from its step 0 (the
            module's schedule, warmup included, restarts at every level change).
        model_attr: the LightningModule attribute holding the network (swapped at every level change).
        adapter: ``"auto"``, a registered V-cycle adapter name (``hf_gpt2``, ``hf_bert``, ``timm_vit``) or an
            instance.
        strict: a checkpoint written with another configuration raises on resume (False: warns).
        baseline_steps: optimizer steps of the baseline run the FLOPs saving is measured against (spec §4.3, §5):
            ``vcycle/baseline_flops`` is then the full model's mean training FLOPs per optimizer step on this run's
            batches times ``baseline_steps`` (the baseline may be shorter or longer than the V-cycle run); None
            (default): the full model on this run's own batches (a baseline of the same length).

    Logged every step: ``effi/vcycle/level``, ``effi/vcycle/stage``, ``effi/vcycle/flops_cum``,
    ``effi/vcycle/flops_saved_frac``, ``effi/vcycle/map_seconds``. Summary keys ``vcycle/*``.

    Raises:
        ValueError: (construction) wrong types or ranges, missing / duplicated stage lengths, K >= 3 without up-leg
            lengths, ``alpha_original`` outside [0, 1]; (``setup``) no adapter for the model, sizes the schemes
            cannot halve, stages that do not fit in ``trainer.max_steps``; (train start, when the length comes from
            the epochs) stages that do not fit in the epochs' optimizer steps, ``*_fraction`` lengths in a run of
            unknown length, ``*_epochs`` lengths with a train dataloader without a length.
        MisconfigurationException: (``setup``) an unsupported strategy (FSDP, DeepSpeed, ...) or a callback that
            cannot survive shape changes (SWA / weight averaging, random-LTD).
    """

    def __init__(
        self,
        levels: int = 2,
        e_a_steps: int | None = None,
        e_small_steps: int | None = None,
        up_leg_steps: int | Sequence[int] | None = None,
        width_scheme: Any = "half",
        depth_scheme: Any = "adjacent",
        alpha_original: float | None = None,
        lr_multiplier: Mapping[int, float] | None = None,
        embedding_convention: str = "official",
        model_attr: str = "model",
        adapter: str | VCycleAdapter = "auto",
        e_a_fraction: float | None = None,
        e_small_fraction: float | None = None,
        up_leg_fraction: float | None = None,
        lr_schedule: Literal["continue", "restart"] = "continue",
        strict: bool = True,
        baseline_steps: int | None = None,
        e_a_epochs: int | None = None,
        e_small_epochs: int | None = None,
        up_leg_epochs: int | Sequence[int] | None = None,
    ) -> None:
        name = type(self).__name__
        if not _is_int(levels) or levels < 2:
            raise ValueError(f"{name}.levels must be an int >= 2, got {levels!r}")

        def one_of(steps: Any, frac: Any, epochs: Any, key: str) -> None:
            given = [f"{key}_{kind}" for kind, v in (("steps", steps), ("fraction", frac), ("epochs", epochs))
                     if v is not None]
            if len(given) > 1:
                raise ValueError(f"{name}: give one of {key}_steps, {key}_fraction or {key}_epochs, not "
                                 f"{' and '.join(given)}")
            if not given:
                raise ValueError(f"{name}: {key}_steps (or {key}_fraction, {key}_epochs) is required")
            if frac is not None and not (_is_real(frac) and 0 <= frac <= 1):
                raise ValueError(f"{name}.{key}_fraction must be a number in [0, 1], got {frac!r}")
            for kind, v in (("steps", steps), ("epochs", epochs)):
                if v is None:
                    continue
                if key == "up_leg" and isinstance(v, list):
                    if len(v) != levels - 2 or not all(_is_int(s) and s >= 1 for s in v):
                        raise ValueError(f"{name}.up_leg_{kind} must be one int >= 1 or a list of {levels - 2} ints "
                                         f">= 1 (levels 2..{levels - 1}), got {v!r}")
                elif not _is_int(v) or v < 1:
                    raise ValueError(f"{name}.{key}_{kind} must be an int >= 1, got {v!r}")

        up_leg_steps, up_leg_epochs = _plain(up_leg_steps), _plain(up_leg_epochs)
        one_of(e_a_steps, e_a_fraction, e_a_epochs, "e_a")
        one_of(e_small_steps, e_small_fraction, e_small_epochs, "e_small")
        if levels >= 3:
            if up_leg_steps is None and up_leg_fraction is None and up_leg_epochs is None:
                raise ValueError(f"{name}: levels={levels} requires up_leg_steps (or up_leg_fraction, up_leg_epochs): "
                                 "the length of the intermediate up-leg stages is not given by the paper (spec §4.1)")
            one_of(up_leg_steps, up_leg_fraction, up_leg_epochs, "up_leg")
        elif up_leg_steps is not None or up_leg_fraction is not None or up_leg_epochs is not None:
            raise ValueError(f"{name}: up_leg_steps / up_leg_fraction / up_leg_epochs apply to levels >= 3 only "
                             f"(levels={levels})")
        if alpha_original is not None:
            if not _is_real(alpha_original) or not 0.0 <= float(alpha_original) <= 1.0:
                raise ValueError(f"{name}.alpha_original must be in [0, 1] (None = the adapter's default), got "
                                 f"{alpha_original!r}")
        mult: dict[int, float] = {}
        for k, v in dict(_plain(lr_multiplier) or {}).items():
            try:
                level = int(k)
            except (TypeError, ValueError):
                level = -1
            if not 1 <= level <= levels or str(level) != str(k).strip():
                raise ValueError(f"{name}.lr_multiplier: keys must be levels in 1..{levels}, got {k!r}")
            if not _is_real(v) or v <= 0:
                raise ValueError(f"{name}.lr_multiplier[{level}] must be a number > 0, got {v!r}")
            mult[level] = float(v)
        if embedding_convention not in V.EMBEDDING_CONVENTIONS:
            raise ValueError(f"{name}.embedding_convention must be one of {V.EMBEDDING_CONVENTIONS}, got "
                             f"{embedding_convention!r}")
        if lr_schedule not in ("continue", "restart"):
            raise ValueError(f"{name}.lr_schedule must be 'continue' or 'restart', got {lr_schedule!r}")
        if not isinstance(model_attr, str) or not model_attr.isidentifier():
            raise ValueError(f"{name}.model_attr must be an attribute name, got {model_attr!r}")
        if baseline_steps is not None and (not _is_int(baseline_steps) or baseline_steps < 1):
            raise ValueError(f"{name}.baseline_steps must be an int >= 1 or None (a baseline as long as this run), "
                             f"got {baseline_steps!r}")
        from lightning_effi.models.vcycle_base import VCycleAdapter

        if not isinstance(adapter, (str, VCycleAdapter)):
            raise ValueError(f"{name}.adapter must be 'auto', a registered name or a VCycleAdapter, got {adapter!r}")
        self.levels = levels
        self.e_a_steps, self.e_a_fraction = e_a_steps, e_a_fraction
        self.e_small_steps, self.e_small_fraction = e_small_steps, e_small_fraction
        self.up_leg_steps, self.up_leg_fraction = up_leg_steps, up_leg_fraction
        self.e_a_epochs, self.e_small_epochs, self.up_leg_epochs = e_a_epochs, e_small_epochs, up_leg_epochs
        self.width_scheme = _plain(width_scheme)
        self.depth_scheme = _plain(depth_scheme)
        self.alpha_arg = None if alpha_original is None else float(alpha_original)
        self.alpha_original: float | None = self.alpha_arg
        self.lr_multiplier = mult
        self.embedding_convention = embedding_convention
        self.model_attr = model_attr
        self.adapter_arg = adapter
        self.lr_schedule = lr_schedule
        self.strict = strict
        self.baseline_steps = baseline_steps
        # resolved in setup / on_train_start
        self.adapter: VCycleAdapter | None = None
        self.plans: list[V.VCyclePlan] = []  # plans[k - 1]: level k → k + 1
        self._parked: dict[int, nn.Module] = {}  # level → the module of that level (CPU) while a coarser one trains
        self._module: pl.LightningModule | None = None
        self._reset_progress()

    def _reset_progress(self) -> None:
        """A fresh cycle: a new fit with this callback starts from the first stage (a resumed fit then loads the
        checkpoint's progress)."""
        # resolved again against this fit's length
        self.stages: list[tuple[int, int]] = []  # non-final (level, steps)
        self.stage_ends: list[int] = []  # cumulative end step of each non-final stage
        # progress (checkpointed)
        self.level = 1
        self.stage_index = 0
        self.stage_start_step = 0
        self.snapshots: dict[int, dict[str, Tensor]] = {}  # level → snapshot pending interpolation
        self.flops = 0.0
        self.full_model_flops = 0.0  # the full model's training FLOPs on every batch trained so far
        self.flops_steps = 0  # optimizer steps those FLOPs cover
        self.map_seconds = 0.0
        self.switches = 0
        # runtime only
        self._last_step = -1
        self._flops_ok = True

    def __repr__(self) -> str:
        return (f"VCycleCallback(levels={self.levels}, e_a_steps={self.e_a_steps}, e_a_fraction={self.e_a_fraction}, "
                f"e_a_epochs={self.e_a_epochs}, e_small_steps={self.e_small_steps}, "
                f"e_small_fraction={self.e_small_fraction}, e_small_epochs={self.e_small_epochs}, "
                f"up_leg_steps={self.up_leg_steps}, up_leg_fraction={self.up_leg_fraction}, "
                f"up_leg_epochs={self.up_leg_epochs}, alpha_original={self.alpha_arg}, "
                f"lr_multiplier={self.lr_multiplier}, model_attr={self.model_attr!r})")

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(levels=self.levels, model_attr=self.model_attr)

    # ------------------------------------------------------------------------------------------------ setup
    def _check_environment(self, trainer: pl.Trainer) -> None:
        name = type(self).__name__
        strategy = trainer.strategy
        if type(strategy).__name__.startswith("DeepSpeed") or not isinstance(strategy, (SingleDeviceStrategy,
                                                                                           DDPStrategy)):
            raise MisconfigurationException(
                f"{name} supports the single-device and DDP strategies (strategy='auto' on one device, 'ddp', "
                f"'ddp_spawn', 'ddp_find_unused_parameters_true'), not {type(strategy).__name__}: FSDP / DeepSpeed / "
                "model-parallel wrappers cannot be rebuilt mid-fit. Run one fit per stage instead (spec §7.2, "
                "VCycleRunner) with the functional operators in lightning_effi.vcycle.operators.")
        from lightning_effi.random_ltd.callback import RandomLTDCallback

        try:
            from lightning.pytorch.callbacks import WeightAveraging
        except ImportError:  # pragma: no cover - lightning < 2.6
            WeightAveraging = ()  # type: ignore[assignment,misc]
        from lightning.pytorch.callbacks import StochasticWeightAveraging

        bad = [type(c).__name__ for c in trainer.callbacks
               if isinstance(c, (StochasticWeightAveraging, WeightAveraging, RandomLTDCallback))]
        if bad:
            raise MisconfigurationException(f"{name}: {bad} cannot follow the V-cycle's shape changes (their averaged "
                                            "weights / patched layers belong to one model); remove them")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        name = type(self).__name__
        if self.level != 1 or self._parked:
            raise RuntimeError(f"{name}: a previous fit with this callback stopped at level {self.level} (the coarse "
                               "model is still in its module); resume from a checkpoint with a new module and callback")
        self._reset_progress()
        self._check_environment(trainer)
        model = getattr(pl_module, self.model_attr, None)
        if not isinstance(model, nn.Module):
            raise ValueError(f"{name}.model_attr: {type(pl_module).__name__} has no nn.Module attribute "
                             f"{self.model_attr!r}")
        if type(model).__name__ == "OptimizedModule":
            raise MisconfigurationException(f"{name}: pl_module.{self.model_attr} is torch.compile'd; compile inside "
                                            "the module's forward or not at all (the model is replaced mid-fit)")
        from lightning_effi.models.vcycle_base import find_vcycle_adapter

        self.adapter = find_vcycle_adapter(model, self.adapter_arg)
        if self.alpha_arg is None:
            self.alpha_original = float(self.adapter.default_alpha_original)
        if self.alpha_original == 0.0:
            rank_zero_warn(f"{name}: alpha_original=0 keeps the de-coalesced copies symmetric; without dropout they "
                           "never separate (spec V16): use alpha_original > 0")
        self.plans = self._make_plans(model)
        self._resolve_stages(trainer, at_setup=True)
        self._module = pl_module
        self._parked = {}
        self._install_load_hook(pl_module)

    def _make_plans(self, model: nn.Module) -> list[V.VCyclePlan]:
        """Plans of every level, from the full model (small models are built to plan the next level)."""
        assert self.adapter is not None
        plans: list[V.VCyclePlan] = []
        current = model
        for k in range(1, self.levels):
            plan = self.adapter.plan(current, self.width_scheme, self.depth_scheme, self.embedding_convention)
            plans.append(plan)
            if k < self.levels - 1:
                with torch.random.fork_rng(devices=[]):
                    current = self.adapter.build_small(current, plan)
        return plans

    def _run_length(self, trainer: pl.Trainer, at_setup: bool) -> int | None:
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return int(trainer.max_steps)
        if at_setup:
            return None
        total = trainer.estimated_stepping_batches
        return int(total) if math.isfinite(total) and total > 0 else None

    def _resolve_stages(self, trainer: pl.Trainer, at_setup: bool) -> None:
        if self.stage_ends:
            return
        name = type(self).__name__
        epochs = any(e is not None for e in (self.e_a_epochs, self.e_small_epochs, self.up_leg_epochs))
        fractions = any(f is not None for f in (self.e_a_fraction, self.e_small_fraction, self.up_leg_fraction))
        total = self._run_length(trainer, at_setup)
        if at_setup and (epochs or total is None):
            return  # resolved in on_train_start, once the train dataloader's length is known
        if total is None and fractions:
            raise ValueError(f"{name}: the run's length is unknown (max_steps=-1 and max_epochs=-1, or a train "
                             "dataloader without a length), so *_fraction stage lengths cannot resolve; set "
                             "trainer.max_steps or give the stage lengths in steps (*_steps) or epochs (*_epochs)")
        T = total or 0
        S = self._steps_per_epoch(trainer) if epochs else 0

        def length(steps: Any, frac: float | None, n_epochs: Any, at_least: int) -> int:
            if steps is not None:
                return int(steps)
            if n_epochs is not None:
                return int(n_epochs) * S
            return max(at_least, math.floor(frac * T))

        e_a = length(self.e_a_steps, self.e_a_fraction, self.e_a_epochs, 1)
        e_small = length(self.e_small_steps, self.e_small_fraction, self.e_small_epochs, 0)
        up: list[int] = []
        if self.levels >= 3:
            for i in range(self.levels - 2):
                pick = [v[i] if isinstance(v, list) else v for v in (self.up_leg_steps, self.up_leg_epochs)]
                up.append(length(pick[0], self.up_leg_fraction, pick[1], 0))
        stages = stage_plan(self.levels, e_a, e_small, up)
        need = sum(s for _, s in stages)
        if total is not None and need > total:
            detail = f"e_a_steps × (levels − 1) = {e_a} × {self.levels - 1}, e_small_steps = {e_small}"
            if up:
                detail += f", up_leg_steps = {up}"
            if epochs:
                detail += f"; {S} optimizer steps per epoch"
            raise ValueError(f"{name}: the V-cycle's stages need {need} optimizer steps ({detail}) but the run has "
                             f"{total} (trainer.max_steps or the epochs' optimizer steps); lower e_a_steps / "
                             "e_small_steps / up_leg_steps (or the *_fraction / *_epochs keys) or raise "
                             "trainer.max_steps / max_epochs")
        self.stages = stages
        ends, acc = [], 0
        for _, s in stages:
            acc += s
            ends.append(acc)
        self.stage_ends = ends

    def _steps_per_epoch(self, trainer: pl.Trainer) -> int:
        """Optimizer steps of one epoch: ``ceil(num_training_batches / accumulate_grad_batches)`` (as Lightning's
        ``estimated_stepping_batches`` counts them; ``limit_train_batches`` applies)."""
        batches = trainer.num_training_batches
        if not math.isfinite(batches) or batches <= 0:
            raise ValueError(f"{type(self).__name__}: *_epochs stage lengths need a train dataloader with a length "
                             f"(trainer.num_training_batches = {batches}); give the stage lengths in steps instead")
        return math.ceil(int(batches) / max(1, int(trainer.accumulate_grad_batches)))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        hook = pl_module.__dict__.get("on_load_checkpoint")
        if getattr(hook, "_vcycle_owner", None) is self:
            del pl_module.__dict__["on_load_checkpoint"]
        self._module = None

    # ------------------------------------------------------------------------------------------------ resume
    def _install_load_hook(self, pl_module: pl.LightningModule) -> None:
        """Wrap ``pl_module.on_load_checkpoint`` on the instance: before the weights load, rebuild the level saved in
        the checkpoint (spec §7.1: Lightning calls this hook before the strict ``load_state_dict``)."""
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
        assert self.adapter is not None
        current = getattr(pl_module, self.model_attr)
        for k in range(1, level):
            with torch.random.fork_rng(devices=[]):
                small = self.adapter.build_small(current, self.plans[k - 1])
            self._parked[k] = current.to("cpu")
            current = small
        setattr(pl_module, self.model_attr, current)
        self.level = level
        self._update_module_info(pl_module)

    # ------------------------------------------------------------------------------------------------ training
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resolve_stages(trainer, at_setup=False)
        self._last_step = trainer.global_step
        if self.stage_index < len(self.stages):
            expected = self.stages[self.stage_index][0]
        else:
            expected = 1
        if expected != self.level:
            raise RuntimeError(f"{type(self).__name__}: stage {self.stage_index} trains level {expected} but the model "
                               f"is at level {self.level}")

    def current_stage_level(self) -> int:
        return self.stages[self.stage_index][0] if self.stage_index < len(self.stages) else 1

    def lr_factor(self, level: int) -> float:
        return self.lr_multiplier.get(level, 1.0)

    def _count_flops(self, pl_module: pl.LightningModule, batch: Any) -> None:
        fn = getattr(pl_module, "effi_training_flops", None)
        if not callable(fn) or not self._flops_ok:
            return
        try:
            cur = float(fn(batch))
            if self.level == 1:
                base = cur
            else:
                with _module_attr(pl_module, self.model_attr, self._parked[1]):
                    base = float(fn(batch))
        except (NotImplementedError, TypeError, KeyError) as err:
            self._flops_ok = False
            warnings.warn(f"{type(self).__name__}: FLOPs accounting disabled ({type(err).__name__}: {err})",
                          stacklevel=2)
            return
        self.flops += cur
        self.full_model_flops += base

    @property
    def baseline_flops(self) -> float:
        """Training FLOPs of the baseline: the full model on this run's batches, or (``baseline_steps``) its mean
        per optimizer step times ``baseline_steps``."""
        if self.baseline_steps is None:
            return self.full_model_flops
        return self.full_model_flops / self.flops_steps * self.baseline_steps if self.flops_steps else 0.0

    def flops_saved_frac(self) -> float:
        """``1 - flops / baseline_flops`` (spec §5); 0 before any FLOPs are counted."""
        base = self.baseline_flops
        return 1.0 - self.flops / base if base else 0.0

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._count_flops(pl_module, batch)
        self.flops_steps = trainer.global_step
        pl_module.log_dict({
            "effi/vcycle/level": float(self.level),
            "effi/vcycle/stage": float(self.stage_index),
            "effi/vcycle/flops_cum": float(self.flops),
            "effi/vcycle/flops_saved_frac": self.flops_saved_frac(),
            "effi/vcycle/map_seconds": float(self.map_seconds),
        }, on_step=True, on_epoch=False, batch_size=1)
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
        self._adjust_optimizers(trainer)
        self.map_seconds += time.perf_counter() - start
        self.switches += 1
        rank_zero_info(f"VCycle: step {step}: level {' -> '.join(map(str, path))} (stage {self.stage_index}/"
                       f"{len(self.stages)}, {sum(p.numel() for p in getattr(pl_module, self.model_attr).parameters())}"
                       f" parameters, lr x{self.lr_factor(self.level)}, map {time.perf_counter() - start:.2f}s)")

    @torch.no_grad()
    def _change_level(self, pl_module: pl.LightningModule, target: int) -> None:
        assert self.adapter is not None and self.alpha_original is not None
        current = getattr(pl_module, self.model_attr)
        if target == self.level + 1:  # down: snapshot, coalesce
            plan = self.plans[self.level - 1]
            self.snapshots[self.level] = _snapshot(current)
            with torch.random.fork_rng(devices=[]):
                small = self.adapter.build_small(current, plan)
            small.load_state_dict(V.coalesce(current, plan))
            self._parked[self.level] = current.to("cpu")
            setattr(pl_module, self.model_attr, small)
        elif target == self.level - 1:  # up: de-coalesce, interpolate with the snapshot
            plan = self.plans[target - 1]
            p = next(current.parameters())
            merged = V.interpolate(V.decoalesce(current, plan), self.snapshots.pop(target), self.alpha_original)
            large = self._parked.pop(target).to(p.device)
            large.load_state_dict(merged)
            large.train(current.training)
            setattr(pl_module, self.model_attr, large)
        elif target != self.level:
            raise RuntimeError(f"VCycleCallback: cannot go from level {self.level} to {target}")
        self.level = target
        self._update_module_info(pl_module)

    def _update_module_info(self, pl_module: pl.LightningModule) -> None:
        if _is_int(getattr(pl_module, "effi_num_layers", None)) and self.plans:
            large, _ = self.plans[0].num_layers
            layers = large if self.level == 1 else self.plans[self.level - 2].num_layers[1]
            pl_module.effi_num_layers = layers

    def _adjust_optimizers(self, trainer: pl.Trainer) -> None:
        """The level's LR multiplier on the fresh optimizers/schedulers, then (``continue``) advance the schedulers to
        the current step."""
        m = self.lr_factor(self.level)
        if m != 1.0:
            for opt in trainer.optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * m
                    if "initial_lr" in group:
                        group["initial_lr"] = group["initial_lr"] * m
            for cfg in trainer.lr_scheduler_configs:
                if hasattr(cfg.scheduler, "base_lrs"):
                    cfg.scheduler.base_lrs = [b * m for b in cfg.scheduler.base_lrs]
        if self.lr_schedule != "continue":
            return
        for cfg in trainer.lr_scheduler_configs:
            if cfg.reduce_on_plateau:
                continue
            count = trainer.global_step if cfg.interval == "step" else trainer.current_epoch
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(count // max(1, cfg.frequency)):
                    cfg.scheduler.step()

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
        return {"levels": self.levels, "stages": [list(s) for s in self.stages], "width_scheme": self.width_scheme,
                "depth_scheme": self.depth_scheme, "alpha_original": self.alpha_original,
                "embedding_convention": self.embedding_convention, "model_attr": self.model_attr,
                "lr_multiplier": {str(k): v for k, v in sorted(self.lr_multiplier.items())},
                "lr_schedule": self.lr_schedule}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "level": int(self.level),
            "stage_index": int(self.stage_index),
            "stage_start_step": int(self.stage_start_step),
            "stage_ends": [int(e) for e in self.stage_ends],
            "snapshots": {str(k): dict(v) for k, v in self.snapshots.items()},
            "flops": float(self.flops),
            "full_model_flops": float(self.full_model_flops),
            "flops_steps": int(self.flops_steps),
            "map_seconds": float(self.map_seconds),
            "switches": int(self.switches),
            "config": self.config(),
        }

    def _mismatch(self, message: str) -> None:
        config_mismatch(type(self).__name__, message, self.strict)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, mine = dict(state_dict["config"]), self.config()
        if not self.stages:  # lengths resolved in on_train_start: the checkpoint's resolution is kept
            saved.pop("stages", None)
            mine.pop("stages", None)
        diff = {k: (saved.get(k), mine.get(k)) for k in mine if saved.get(k) != mine.get(k)}
        if diff:
            self._mismatch(f"the checkpoint's configuration differs (checkpoint, now): {diff}")
        if int(state_dict["level"]) != self.level:
            raise RuntimeError(f"{type(self).__name__}: the checkpoint is at level {state_dict['level']} but the model "
                               f"is at level {self.level}: the on_load_checkpoint wrapper installed in setup did not "
                               "run (was the module's on_load_checkpoint replaced?)")
        if not self.stages:
            self.stages = [tuple(s) for s in state_dict["config"]["stages"]]  # type: ignore[misc]
            self.stage_ends = [int(e) for e in state_dict["stage_ends"]]
        self.stage_index = int(state_dict["stage_index"])
        self.stage_start_step = int(state_dict["stage_start_step"])
        self.snapshots = {int(k): dict(v) for k, v in state_dict["snapshots"].items()}
        self.flops = float(state_dict["flops"])
        self.full_model_flops = float(state_dict["full_model_flops"])
        self.flops_steps = int(state_dict["flops_steps"])
        self.map_seconds = float(state_dict["map_seconds"])
        self.switches = int(state_dict["switches"])


VCycle = VCycleCallback  # short name, like RandomLTD / InfoBatch
