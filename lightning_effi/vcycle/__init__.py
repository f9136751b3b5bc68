"""Multi-level V-cycle training (Zou et al., ICLR 2024). The method card is ``README.md`` beside this file.

- :mod:`~lightning_effi.vcycle.operators`: the pure core (coalescing, de-coalescing, interpolation, the level-change
  steps on models);
- :mod:`~lightning_effi.vcycle.stages`: the stage arithmetic (arguments, stage lengths in optimizer steps, FLOPs);
- :mod:`~lightning_effi.vcycle.levels`: the models of the levels (plans, parked modules, snapshots, resume);
- :mod:`~lightning_effi.vcycle.accounting`: the training FLOPs of the cycle against the full model's;
- :class:`VCycleCallback`: the Lightning layer (the 2- or 3-level cycle inside one ``fit``). Per-architecture
  parameter maps are in :mod:`lightning_effi.models`.
"""

from lightning_effi.vcycle import accounting, levels, operators, stages
from lightning_effi.vcycle.callback import VCycle, VCycleCallback

__all__ = ["VCycle", "VCycleCallback", "accounting", "levels", "operators", "stages"]
