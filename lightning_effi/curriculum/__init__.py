"""Curriculum learning (DeepSpeed Data Efficiency, Li et al. 2022). The method card is ``README.md`` beside this file.

- :mod:`~lightning_effi.curriculum.schedules` and :mod:`~lightning_effi.curriculum.functional`: the pure core
  (difficulty schedules, eligibility, clusters, seqlen transforms);
- :mod:`~lightning_effi.curriculum.config` (DeepSpeed-keyed schema) and :mod:`~lightning_effi.curriculum.stream`
  (the deterministic per-rank sample stream);
- :class:`CurriculumDataModule` and :class:`Curriculum`: the Lightning layer;
- :mod:`~lightning_effi.curriculum.analysis`: the offline :class:`DataAnalyzer`, DeepSpeed's index files and the
  in-memory :func:`analyze_in_memory`.
"""

from lightning_effi.curriculum import functional, schedules
from lightning_effi.curriculum.analysis import DataAnalyzer, MetricIndex, analyze_in_memory
from lightning_effi.curriculum.callback import Curriculum, CurriculumCallback
from lightning_effi.curriculum.config import (
    CLUSTERING_TYPES,
    TRANSFORM_METRICS,
    CurriculumConfig,
    CurriculumConfigError,
    MetricConfig,
    parse_deepspeed_config,
    to_plain,
)
from lightning_effi.curriculum.data import (
    CurriculumCollate,
    CurriculumDataLoader,
    CurriculumDataModule,
    CurriculumDataset,
    CurriculumSampler,
)
from lightning_effi.curriculum.schedules import CurriculumSchedule, ScheduleConfigError
from lightning_effi.curriculum.stream import (
    ClusterBook,
    CurriculumController,
    CurriculumStream,
    GlobalBatch,
    indexes_fingerprint,
)

__all__ = [
    "CLUSTERING_TYPES",
    "TRANSFORM_METRICS",
    "ClusterBook",
    "Curriculum",
    "CurriculumCallback",
    "CurriculumCollate",
    "CurriculumConfig",
    "CurriculumConfigError",
    "CurriculumController",
    "CurriculumDataLoader",
    "CurriculumDataModule",
    "CurriculumDataset",
    "CurriculumSampler",
    "CurriculumSchedule",
    "CurriculumStream",
    "DataAnalyzer",
    "GlobalBatch",
    "MetricConfig",
    "MetricIndex",
    "ScheduleConfigError",
    "analyze_in_memory",
    "functional",
    "indexes_fingerprint",
    "parse_deepspeed_config",
    "schedules",
    "to_plain",
]
