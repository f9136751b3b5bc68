"""The functional namespace: each technique's pure core (torch and numpy, no Lightning), usable in any training loop::

    from lightning_effi.functional import infobatch
    plan = infobatch.plan_epoch(score, seen, epoch, num_epochs, prune_ratio=0.5, delta=0.875, seed=0)
    loss = infobatch.rescale(per_sample_loss, index, plan.weights)

``infobatch``, ``curriculum`` (eligibility, clusters, transforms), ``schedules`` (curriculum difficulty schedules),
``random_ltd``, ``vcycle`` (the operators) and ``rng`` are the modules in the technique folders and in ``core/``.
"""

from lightning_effi.core import rng
from lightning_effi.curriculum import functional as curriculum
from lightning_effi.curriculum import schedules
from lightning_effi.infobatch import functional as infobatch
from lightning_effi.random_ltd import functional as random_ltd
from lightning_effi.vcycle import operators as vcycle

__all__ = ["curriculum", "infobatch", "random_ltd", "rng", "schedules", "vcycle"]
