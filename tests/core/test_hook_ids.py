"""Hook handle ids a module brought from another process (lightning_effi.core.hook_ids).

A module sent to a ``ddp_spawn`` rank keeps its hooks' ids while the rank's counter starts from 0 again. These tests
put the counter behind the module's ids in this process (what a spawned rank sees) and restore it afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.hooks import RemovableHandle

from lightning_effi import EfficiencyMonitor, InfoBatchCallback, RandomLTDCallback, VCycleCallback
from lightning_effi.core.hook_ids import held_hook_ids, remove_global_forward_hook, reserve_hook_ids
from lightning_effi.core.measure import CallRecorder


@pytest.fixture
def counter() -> Iterator[None]:
    """Restore torch's hook id counter to at least where it was (ids must never be handed out twice)."""
    before = RemovableHandle.next_id
    yield
    RemovableHandle.next_id = max(RemovableHandle.next_id, before) + 1000


class Calls:
    """A forward hook written ``hook(module, input, output)``; records the number of arguments of each call."""

    def __init__(self) -> None:
        self.nargs: list[int] = []

    def __call__(self, *args: Any) -> None:
        self.nargs.append(len(args))


def hooked_linear(n: int = 4) -> tuple[nn.Linear, list[Calls], int]:
    """A Linear with ``n`` user forward hooks; the counter is put back to their first id, as in a spawned rank."""
    layer, first = nn.Linear(3, 3), RemovableHandle.next_id
    hooks = [Calls() for _ in range(n)]
    for hook in hooks:
        layer.register_forward_hook(hook)
    RemovableHandle.next_id = first
    return layer, hooks, first


def test_held_ids_are_every_hook_dicts_keys(counter: None) -> None:
    layer, _, first = hooked_linear(3)
    outer = nn.Sequential(layer, nn.ReLU())
    outer[1].register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)  # id `first`: the counter was put back
    assert sorted(set(held_hook_ids(outer))) == [first, first + 1, first + 2]
    assert held_hook_ids(nn.ReLU()) == []


def test_reserve_moves_the_counter_past_held_ids_only(counter: None) -> None:
    layer, _, first = hooked_linear(5)
    reserve_hook_ids(layer)
    assert RemovableHandle.next_id == first + 5
    RemovableHandle.next_id += 10
    reserve_hook_ids(layer)  # ids below the counter: unchanged
    assert RemovableHandle.next_id == first + 15


def test_the_recorders_kwargs_hook_never_takes_a_users_hook_id(counter: None) -> None:
    """torch calls a hook with the kwargs when its id is among the process-wide kwargs hooks' ids: without the
    reservation the recorder's global hook got id ``first`` and the user's first hook was called with 4 arguments."""
    layer, hooks, _ = hooked_linear()
    recorder = CallRecorder()
    recorder.start(layer)
    layer(torch.randn(2, 3))
    recorder.stop(None)
    layer(torch.randn(2, 3))
    assert [h.nargs for h in hooks] == [[3, 3]] * 4


def test_a_removed_global_forward_hook_leaves_no_kwargs_flag(counter: None) -> None:
    from torch.nn.modules.module import register_module_forward_hook

    handle = register_module_forward_hook(lambda m, a, k, o: None, with_kwargs=True)
    assert handle.id in torch_module._global_forward_hooks_with_kwargs
    remove_global_forward_hook(handle)
    assert handle.id not in torch_module._global_forward_hooks_with_kwargs
    assert handle.id not in torch_module._global_forward_hooks


@pytest.mark.parametrize(
    "make",
    [InfoBatchCallback, RandomLTDCallback, lambda: VCycleCallback(e_a=2, e_small=2), EfficiencyMonitor],
    ids=["infobatch", "random_ltd", "vcycle", "monitor"],
)
def test_every_hooking_callback_reserves_in_setup(counter: None, make: Any) -> None:
    layer, _, first = hooked_linear(3)
    make().setup(None, layer, "predict")  # type: ignore[arg-type]
    assert RemovableHandle.next_id == first + 3


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.hooks = [Calls() for _ in range(6)]
        for hook in self.hooks:
            self.body[0].register_forward_hook(hook)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_users_hook_is_called_as_written_in_a_monitored_fit_of_a_spawned_ranks_module(counter: None) -> None:
    """The module's hooks hold ids the process's counter has not reached (as a ``ddp_spawn`` rank's module does): the
    EfficiencyMonitor's FLOP recording must not make torch call them with the kwargs (qa106-user 01: the user's
    ``hook(module, input, output)`` got ``(module, args, kwargs, output)``)."""
    torch.manual_seed(0)
    first = RemovableHandle.next_id
    net = Net()
    RemovableHandle.next_id = first
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 3, (16,)))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[EfficiencyMonitor(print_summary=False)],
    )
    trainer.fit(net, DataLoader(data, batch_size=4))
    assert all(h.nargs and set(h.nargs) == {3} for h in net.hooks), [h.nargs for h in net.hooks]
