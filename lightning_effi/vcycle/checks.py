"""The V-cycle's checks that need no Lightning: the fields of a checkpointed state (:func:`check_state`, every field
checked like a constructor argument before anything is rebuilt from it) and the optimizers a rebuilt training state
got after a level change (:func:`optimizer_mismatch`), the hooks the coarse networks would not carry
(:func:`user_hooks`). :class:`~lightning_effi.vcycle.VCycleCallback` calls them; the method card (``README.md`` beside
this file) lists what they refuse or warn of.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from lightning_effi.core.checks import check_bool, check_int, check_list, check_real, plain
from lightning_effi.vcycle.stages import stage_ends, stage_level, stage_plan

__all__ = ["STATE_FIELDS", "check_state", "optimizer_mismatch", "user_hooks"]

#: the fields every V-cycle state has (:meth:`VCycleCallback.state_dict`); ``weights`` and ``nonfinite_loss`` are
#: optional (``weights`` below level 1 only; ``nonfinite_loss`` missing from checkpoints written before the policy)
STATE_FIELDS = (
    "level",
    "stage_index",
    "stage_start_step",
    "map_seconds",
    "switches",
    "flops",
    "full_model_flops",
    "flops_steps",
    "stage_ends",
    "snapshots",
    "config",
)


def check_state(state: Any, levels: int, owner: str = "VCycleCallback") -> list[tuple[int, int]]:
    """Check a V-cycle state read from a checkpoint (:meth:`~lightning_effi.vcycle.VCycleCallback.state_dict`) of a
    cycle of ``levels`` levels, field by field, as the constructor checks its arguments; returns its stages
    (``config["stages"]``) as ``(level, length)`` tuples.

    Checked: every field of :data:`STATE_FIELDS` is present; ``level`` an int in ``1..levels``; ``config["stages"]`` a
    list of ``[level, length]`` pairs with ints ``length >= 0`` whose levels go down and up as
    :func:`~lightning_effi.vcycle.stages.stage_plan` says (or empty: written before the stages were resolved);
    ``stage_index`` an int in ``0..len(stages)`` whose stage trains ``level``; ``stage_ends`` the cumulative lengths
    of the stages; ``stage_start_step``, ``switches`` and ``flops_steps`` ints >= 0; ``map_seconds``, ``flops`` and
    ``full_model_flops`` finite numbers >= 0; ``snapshots`` a mapping with one state dict for each level above
    ``level`` (``"1"`` .. ``str(level - 1)``: the snapshots pending interpolation on the way up); ``weights`` (when
    present) a mapping of tensors; ``level_one_lr_scaled`` and ``batch_end_due`` (when present) bools;
    ``levels_due`` (when present) a list of levels; ``nonfinite_loss`` (when present) a mapping (its counts are checked
    by :meth:`~lightning_effi.core.nonfinite.NonFiniteLossGuard.load_state_dict`).

    Raises:
        ValueError: naming the field (``VCycleCallback: checkpoint.stage_index must be an int >= 0 and <= 2, got
            -1``), what is allowed and the value found.
    """
    where = f"{owner}: checkpoint"
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}: the V-cycle's state must be a mapping of its fields, got {type(state).__name__}")
    missing = [k for k in STATE_FIELDS if k not in state]
    if missing:
        raise ValueError(
            f"{where}: the V-cycle's state lacks the field(s) {missing} (a state written by another version or "
            "edited by hand); resume from a checkpoint written by VCycleCallback"
        )
    level = check_int(where, "level", state["level"], 1, levels)
    config = state["config"]
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}.config must be a mapping of the V-cycle's settings, got {config!r}")
    stages = _stages(where, config.get("stages"), levels)
    index = check_int(where, "stage_index", state["stage_index"], 0, len(stages))
    if stages and stage_level(stages, index) != level:
        raise ValueError(
            f"{where}.stage_index={index} is a stage of level {stage_level(stages, index)} (stages {stages}; the "
            f"stage after the last one is level 1), but the checkpoint's level is {level}: the state does not describe "
            "one moment of a V-cycle (edited by hand, or saved after a run cut short went back up to the full model)"
        )
    if not stages and (index, level) != (0, 1):
        raise ValueError(
            f"{where}: a state without stages (written before they were resolved) is at stage 0 on level 1, got "
            f"stage_index={index}, level={level}"
        )
    listed = check_list(where, "stage_ends", state["stage_ends"], what="ints")
    ends = [check_int(where, f"stage_ends[{i}]", e, 0) for i, e in enumerate(listed)]
    if ends != stage_ends(stages):
        raise ValueError(
            f"{where}.stage_ends must be the cumulative lengths of the stages {stages}, i.e. {stage_ends(stages)}, got "
            f"{ends}"
        )
    for key in ("stage_start_step", "switches", "flops_steps"):
        check_int(where, key, state[key], 0)
    for key in ("map_seconds", "flops", "full_model_flops"):
        check_real(where, key, state[key], 0.0)
    _snapshots(where, state["snapshots"], level)
    weights = state.get("weights")
    if weights is not None and not (
        isinstance(weights, Mapping) and all(isinstance(t, Tensor) for t in weights.values())
    ):
        raise ValueError(f"{where}.weights must be a mapping of tensors (the level's exact weights), got {weights!r}")
    if "level_one_lr_scaled" in state:  # bool("no") was True (qa92-break 04)
        check_bool(where, "level_one_lr_scaled", state["level_one_lr_scaled"])
    if "batch_end_due" in state:
        check_bool(where, "batch_end_due", state["batch_end_due"])
    if "levels_due" in state:
        due = check_list(where, "levels_due", state["levels_due"], what="levels")
        for i, k in enumerate(due):
            check_int(where, f"levels_due[{i}]", k, 1, levels)
    guard = state.get("nonfinite_loss")
    if guard is not None and not isinstance(guard, Mapping):
        raise ValueError(f"{where}.nonfinite_loss must be a mapping (the non-finite loss count), got {guard!r}")
    return stages


def _stages(where: str, value: Any, levels: int) -> list[tuple[int, int]]:
    """``config["stages"]`` as ``(level, length)`` tuples (see :func:`check_state`)."""
    entries = check_list(where, "config.stages", value, what="[level, length] pairs")
    stages: list[tuple[int, int]] = []
    for i, entry in enumerate(entries):
        pair = plain(entry)
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{where}.config.stages[{i}] must be a [level, length] pair, got {entry!r}")
        level = check_int(where, f"config.stages[{i}][0] (a level)", pair[0], 1, levels)
        stages.append((level, check_int(where, f"config.stages[{i}][1] (a length)", pair[1], 0)))
    order = [k for k, _ in stage_plan(levels, 0, 0, [0] * (levels - 2))]
    if stages and [k for k, _ in stages] != order:
        raise ValueError(
            f"{where}.config.stages must go through the levels {order} (down, then up) with levels={levels}, got "
            f"{[list(s) for s in stages]}"
        )
    return stages


def _snapshots(where: str, value: Any, level: int) -> None:
    """``snapshots``: one state dict for each level 1..level−1 (see :func:`check_state`)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}.snapshots must be a mapping {{level: state dict}}, got {value!r}")
    keys = []
    for key in value:
        text = str(key)
        if not text.isdigit():
            raise ValueError(f"{where}.snapshots: keys must be levels ('1', '2', ...), got {key!r}")
        keys.append(int(text))
    if sorted(keys) != list(range(1, level)):
        raise ValueError(
            f"{where}.snapshots must hold the snapshots of the levels above level {level} (pending interpolation on "
            f"the way up), i.e. levels {list(range(1, level))}, got levels {sorted(keys)}"
        )
    for key, snap in value.items():
        if not isinstance(snap, Mapping) or not all(isinstance(t, Tensor) for t in snap.values()):
            raise ValueError(f"{where}.snapshots[{key!r}] must be a state dict (a mapping of tensors)")


def optimizer_mismatch(
    optimizers: Sequence[Any],
    module: nn.Module,
    network: nn.Module,
    kept: Iterable[int] = (),
    known: Mapping[int, tuple[str, str]] | None = None,
) -> str | None:
    """What is wrong with the parameters of the optimizers a level change rebuilt (``configure_optimizers`` called
    again), or None. Compared by identity, over every param group of every optimizer:

    - a parameter that is not one of ``module``'s (of the network that was replaced: ``configure_optimizers``
      returned an optimizer built before, e.g. cached at its first call, or built from a stored list of parameters);
      ``known`` names some of them (``id -> (whose, name)``, e.g. ``("the parked level-1 network", "wte.weight")``);
    - a trainable parameter of ``network`` (the level's model, ``requires_grad``) in no optimizer: it would not train;
    - a parameter of ``module`` outside ``network`` that the optimizers held before the change (``kept``: their ids)
      and no longer hold.

    Frozen parameters in an optimizer are fine (``SGD(self.parameters())`` holds them), as are trainable parameters
    outside the network that the optimizers did not hold before. No optimizer at all (``configure_optimizers``
    returned None) is not checked: None is returned.

    >>> import torch
    >>> old, new = nn.Linear(2, 2), nn.Linear(1, 1)
    >>> found = optimizer_mismatch([torch.optim.SGD(old.parameters(), lr=0.1)], new, new)
    >>> found.split("; ")[0]
    "2 parameter(s) that are not the module's"
    >>> found.split("; ")[1]
    "2 of the new network's 2 trainable parameters are in no optimizer (weight, bias)"
    """
    if not optimizers:
        return None
    held: dict[int, None] = {}  # ordered: the optimizers' own order, for the message
    for opt in optimizers:
        for group in getattr(opt, "param_groups", ()):
            held.update((id(p), None) for p in group["params"])
    names: dict[int, str] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)  # a tied parameter by its first name
    own = {id(p) for p in network.parameters()}
    problems = []
    stale = [i for i in held if i not in names]
    if stale:
        whose: dict[str, list[str]] = {}
        for i in stale:
            if known and i in known:
                whose.setdefault(known[i][0], []).append(known[i][1])
        described = "; ".join(f"{len(n)} of {w}: {_listed(n)}" for w, n in whose.items())
        problems.append(
            f"{len(stale)} parameter(s) that are not the module's" + (f" ({described})" if described else "")
        )
    trainable = [(n, p) for n, p in network.named_parameters() if p.requires_grad]
    missing = [names.get(id(p), n) for n, p in trainable if id(p) not in held]  # named in the module
    if missing:
        problems.append(
            f"{len(missing)} of the new network's {len(trainable)} trainable parameters are in no optimizer "
            f"({_listed(missing)})"
        )
    lost = [names[i] for i in kept if i in names and i not in own and i not in held]
    if lost:
        problems.append(
            f"{len(lost)} parameter(s) outside the network that the optimizers held before the change are in none "
            f"now ({_listed(lost)})"
        )
    return "; ".join(problems) if problems else None


def _listed(names: Sequence[str], most: int = 3) -> str:
    """The first ``most`` names, then ``...`` when there are more."""
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


#: module hook dictionaries of ``nn.Module`` and the kind each holds
_MODULE_HOOKS = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
    ("_backward_hooks", "backward hook"),
)


def _hook_name(fn: Any) -> tuple[str, str]:
    """A hook's ``(module, name)``: of the function behind a bound method or a ``functools.partial`` too."""
    target = getattr(fn, "func", None) or getattr(fn, "__func__", None) or fn
    return str(getattr(target, "__module__", "") or ""), str(getattr(target, "__qualname__", type(fn).__name__))


#: packages whose hooks come with the network (its model library builds a coarse network with its own) or are the
#: frameworks' (this library's techniques and monitor, torch, Lightning)
_BUILT_WITH_THE_NETWORK = frozenset(
    {"lightning_effi", "torch", "lightning", "lightning_fabric", "pytorch_lightning", "transformers", "timm"}
)


def user_hooks(network: nn.Module) -> list[str]:
    """The hooks registered on ``network``'s modules and parameters from outside it (a forward hook the
    LightningModule put on a block to capture activations for an auxiliary loss, ``WandbLogger.watch``'s), as
    ``"<module path>: <kind> <function>"`` (``<root>`` for ``network`` itself). Hooks of the network's own code (a
    method of one of its modules; a function of ``transformers`` or ``timm``), of ``lightning_effi``, torch and
    Lightning are left out. The V-cycle trains a newly built network at each level
    >= 2 (Zou et al. 2024, Sec. 3: coalescing builds a smaller model), which carries none of them; the full network's
    modules, and so their hooks, come back at level 1.

    Covers ``register_forward_pre_hook`` / ``register_forward_hook`` / ``register_full_backward_pre_hook`` /
    ``register_full_backward_hook`` on modules and ``Tensor.register_hook`` /
    ``register_post_accumulate_grad_hook`` on parameters; not global hooks (``nn.modules.module.register_module_*``).
    """
    found: list[str] = []
    inside = {id(m) for m in network.modules()}

    def add(where: str, kind: str, fn: Any) -> None:
        module, name = _hook_name(fn)
        if module.split(".")[0] in _BUILT_WITH_THE_NETWORK or id(getattr(fn, "__self__", None)) in inside:
            return  # the network's own code (a coarse network built from its class has its own) or ours
        found.append(f"{where or '<root>'}: {kind} {name}")

    for path, module in network.named_modules():
        for attr, kind in _MODULE_HOOKS:
            for fn in (getattr(module, attr, None) or {}).values():
                add(path, kind, fn)
        for pname, param in module.named_parameters(recurse=False):
            where = f"{path}.{pname}" if path else pname
            for fn in (getattr(param, "_backward_hooks", None) or {}).values():
                add(where, "gradient hook", fn)
            for fn in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
                add(where, "post-accumulate-grad hook", fn)
    return found
