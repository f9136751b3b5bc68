"""lightning_effi: training-efficiency callbacks for PyTorch Lightning.

InfoBatch (Qin et al., ICLR 2024), DeepSpeed-style curriculum learning and random-LTD (Li et al. 2022, Yao et al.
2022) and the multi-level V-cycle (Zou et al., ICLR 2024), with an efficiency accounting callback that measures what
each one saves. One folder per technique (``infobatch/``, ``curriculum/``, ``random_ltd/``, ``vcycle/``), each with
its method card; the shared core in ``core/``. See ``docs/architecture.md``.
"""

__version__ = "0.1.0"

from importlib import import_module
from typing import TYPE_CHECKING, Any

#: the public names and the module each comes from; imported on first use (PEP 562), so that the report
#: (``python -m lightning_effi.report``) and the config tools start without importing torch and Lightning
_EXPORTS = {
    "BatchStats": "lightning_effi.core.accounting",
    "EfficiencyMonitor": "lightning_effi.core.accounting",
    "Duration": "lightning_effi.core.progress",
    "NonFiniteLossError": "lightning_effi.core.nonfinite",
    "Curriculum": "lightning_effi.curriculum",
    "CurriculumCallback": "lightning_effi.curriculum",
    "CurriculumConfig": "lightning_effi.curriculum",
    "CurriculumDataModule": "lightning_effi.curriculum",
    "DataAnalyzer": "lightning_effi.curriculum",
    "parse_deepspeed_config": "lightning_effi.curriculum",
    "InfoBatch": "lightning_effi.infobatch",
    "InfoBatchCallback": "lightning_effi.infobatch",
    "InfoBatchDataModule": "lightning_effi.infobatch",
    "GenericAdapter": "lightning_effi.models",
    "RandomLTD": "lightning_effi.random_ltd",
    "RandomLTDCallback": "lightning_effi.random_ltd",
    "VCycle": "lightning_effi.vcycle",
    "VCycleCallback": "lightning_effi.vcycle",
}

if TYPE_CHECKING:
    from lightning_effi.core.accounting import BatchStats, EfficiencyMonitor
    from lightning_effi.core.nonfinite import NonFiniteLossError
    from lightning_effi.core.progress import Duration
    from lightning_effi.curriculum import (
        Curriculum,
        CurriculumCallback,
        CurriculumConfig,
        CurriculumDataModule,
        DataAnalyzer,
        parse_deepspeed_config,
    )
    from lightning_effi.infobatch import InfoBatch, InfoBatchCallback, InfoBatchDataModule
    from lightning_effi.models import GenericAdapter
    from lightning_effi.random_ltd import RandomLTD, RandomLTDCallback
    from lightning_effi.vcycle import VCycle, VCycleCallback


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_effi' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "BatchStats",
    "Curriculum",
    "Duration",
    "CurriculumCallback",
    "CurriculumConfig",
    "CurriculumDataModule",
    "DataAnalyzer",
    "EfficiencyMonitor",
    "GenericAdapter",
    "InfoBatch",
    "InfoBatchCallback",
    "InfoBatchDataModule",
    "NonFiniteLossError",
    "RandomLTD",
    "RandomLTDCallback",
    "VCycle",
    "VCycleCallback",
    "__version__",
    "parse_deepspeed_config",
]
