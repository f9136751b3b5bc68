"""``core.wrapping.live_fit``: whether an earlier fit on a module is still running, as a picklable object."""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

from lightning.pytorch.trainer.states import TrainerStatus

from lightning_effi.core.wrapping import LiveFit, live_fit


class Owner:
    """A Trainer stand-in with a status (weakly referenceable)."""

    def __init__(self, status: TrainerStatus) -> None:
        self.state = SimpleNamespace(status=status)


def test_running_while_the_other_trainer_runs_only():
    owner, other = Owner(TrainerStatus.RUNNING), Owner(TrainerStatus.RUNNING)
    running = live_fit(owner)
    assert isinstance(running, LiveFit)
    assert running(other) is True and running(owner) is False  # the same Trainer's earlier fit is over
    owner.state.status = TrainerStatus.FINISHED
    assert running(other) is False


def test_a_pickled_copy_refers_to_no_fit_and_a_deep_copy_shares_the_reference():
    owner, other = Owner(TrainerStatus.RUNNING), Owner(TrainerStatus.RUNNING)
    running = live_fit(owner)
    assert pickle.loads(pickle.dumps(running))(other) is False
    assert copy.deepcopy(running) is running and copy.deepcopy({"r": running})["r"](other) is True


def test_a_trainer_that_is_gone_runs_nothing():
    other = Owner(TrainerStatus.RUNNING)
    running = live_fit(Owner(TrainerStatus.RUNNING))  # the only reference is weak
    assert running(other) is False
