"""Functional core of lightning_effi: pure torch functions with no Lightning import, usable in any training loop
(``shared/STYLE.md``, "Two layers per technique"). Each technique is a module::

    from lightning_effi.functional import infobatch
    plan = infobatch.plan_epoch(score, seen, epoch, num_epochs, prune_ratio=0.5, delta=0.875, seed=0)
    loss = infobatch.rescale(per_sample_loss, index, plan.weights)
"""

from . import curriculum, infobatch, random_ltd, rng, schedules, vcycle

__all__ = ["curriculum", "infobatch", "random_ltd", "rng", "schedules", "vcycle"]
