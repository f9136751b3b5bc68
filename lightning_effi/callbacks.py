"""The callbacks namespace: every technique's Lightning callback under one import path (each lives in its
technique's folder: ``lightning_effi/<technique>/callback.py``)."""

from lightning_effi.core.accounting import EfficiencyMonitor
from lightning_effi.curriculum.callback import Curriculum, CurriculumCallback
from lightning_effi.infobatch.callback import InfoBatch, InfoBatchCallback
from lightning_effi.random_ltd.callback import RandomLTD, RandomLTDCallback
from lightning_effi.vcycle.callback import VCycle, VCycleCallback

__all__ = [
    "Curriculum",
    "CurriculumCallback",
    "EfficiencyMonitor",
    "InfoBatch",
    "InfoBatchCallback",
    "RandomLTD",
    "RandomLTDCallback",
    "VCycle",
    "VCycleCallback",
]
