"""lightning_effi: training-efficiency callbacks for PyTorch Lightning.

InfoBatch (Qin et al., ICLR 2024), DeepSpeed-style curriculum learning and random-LTD (Li et al. 2022, Yao et al.
2022) and the multi-level V-cycle (Zou et al., ICLR 2024), with an efficiency accounting callback that measures what
each one saves. One folder per technique (``infobatch/``, ``curriculum/``, ``random_ltd/``, ``vcycle/``), each with
its method card; the shared core in ``core/``. See ``docs/architecture.md``.
"""

__version__ = "0.1.0"

from lightning_effi.core.accounting import BatchStats, EfficiencyMonitor  # noqa: E402
from lightning_effi.core.progress import Duration  # noqa: E402
from lightning_effi.curriculum import (  # noqa: E402
    Curriculum,
    CurriculumCallback,
    CurriculumConfig,
    CurriculumDataModule,
    DataAnalyzer,
    parse_deepspeed_config,
)
from lightning_effi.infobatch import InfoBatch, InfoBatchCallback, InfoBatchDataModule  # noqa: E402
from lightning_effi.models import GenericAdapter  # noqa: E402
from lightning_effi.random_ltd import RandomLTD, RandomLTDCallback  # noqa: E402
from lightning_effi.vcycle import VCycle, VCycleCallback  # noqa: E402

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
    "RandomLTD",
    "RandomLTDCallback",
    "VCycle",
    "VCycleCallback",
    "__version__",
    "parse_deepspeed_config",
]
