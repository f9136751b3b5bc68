"""Hook handle ids that cannot collide with the ids a module brought from another process.

torch numbers every hook handle from one process-wide counter (``torch.utils.hooks.RemovableHandle.next_id``) and a
module keeps its hooks in dicts keyed by that number. It decides how to call a hook by looking its id up in flag dicts:
``Module._call_impl`` calls a hook as ``hook(module, args, kwargs, output)`` when its id is in the module's
``_forward_hooks_with_kwargs`` *or in the process-wide* ``_global_forward_hooks_with_kwargs`` (torch 2.x,
``torch/nn/modules/module.py``). A module unpickled in a new process (``strategy="ddp_spawn"`` sends the LightningModule
to each rank; ``torch.load`` of a whole module) keeps its hooks' ids while the new process counts from 0 again, so:

- a process-wide hook registered there with ``with_kwargs=True`` gets an id the user's own hook may hold, and the
  user's ``hook(module, input, output)`` is called with four arguments (the kwargs dict as its ``output``);
- a hook registered there on one of the module's submodules may get the id of a hook already on it and replace it in
  the dict, in silence.

:func:`reserve_hook_ids` moves the counter past every id the modules hold before lightning_effi registers a hook on them
(each callback's ``setup``, the FLOP recorder's ``start``). torch also leaves a removed process-wide hook's
``with_kwargs`` flag behind (its handle removes the hook and its ``always_call`` flag only):
:func:`remove_global_forward_hook` removes both.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

__all__ = ["held_hook_ids", "remove_global_forward_hook", "reserve_hook_ids"]


def held_hook_ids(*roots: nn.Module) -> list[int]:
    """The hook handle ids held by ``roots`` and their submodules: the integer keys of every hook dict and flag dict of
    each module (``_forward_hooks``, ``_forward_pre_hooks_with_kwargs``, ``_state_dict_hooks``...)."""
    ids: list[int] = []
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for name, value in vars(module).items():
                if "hooks" in name and isinstance(value, dict):
                    ids.extend(key for key in value if isinstance(key, int))
    return ids


def reserve_hook_ids(*roots: nn.Module) -> None:
    """Make the hook handles registered from now on take ids above every id ``roots`` and their submodules hold (module
    docstring), so that no hook registered in this process shares an id with a hook the modules brought from another.
    Nothing changes when the modules were built in this process (their ids are already below the counter)."""
    ids = held_hook_ids(*roots)
    if ids and max(ids) >= RemovableHandle.next_id:
        RemovableHandle.next_id = max(ids) + 1


def remove_global_forward_hook(handle: Any) -> None:
    """Remove a hook registered by ``torch.nn.modules.module.register_module_forward_hook`` and its ``with_kwargs``
    flag, which ``handle.remove()`` leaves in ``_global_forward_hooks_with_kwargs`` (a module hook that gets that id
    later would be called with the kwargs)."""
    handle.remove()
    flags = getattr(torch_module, "_global_forward_hooks_with_kwargs", None)
    if isinstance(flags, dict):
        flags.pop(handle.id, None)
