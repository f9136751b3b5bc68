"""Technique callbacks. Each wires a pure method from :mod:`lightning_effi.functional` into Lightning hooks."""

from lightning_effi.callbacks.curriculum import Curriculum, CurriculumCallback
from lightning_effi.callbacks.infobatch import InfoBatch, InfoBatchCallback
from lightning_effi.callbacks.random_ltd import RandomLTD, RandomLTDCallback
from lightning_effi.callbacks.vcycle import VCycle, VCycleCallback

__all__ = ["Curriculum", "CurriculumCallback", "InfoBatch", "InfoBatchCallback", "RandomLTD", "RandomLTDCallback",
           "VCycle", "VCycleCallback"]
