"""lightning_effi: training-efficiency callbacks for PyTorch Lightning.

InfoBatch (Qin et al., ICLR 2024), DeepSpeed-style curriculum learning and random-LTD (Li et al. 2022, Yao et al.
2022) and the multi-level V-cycle (Zou et al., ICLR 2024), with an efficiency accounting callback that measures what
each one saves. See ``docs/architecture.md``.
"""

__version__ = "0.1.0"

from lightning_effi.accounting import BatchStats, EfficiencyMonitor  # noqa: E402

__all__ = ["BatchStats", "EfficiencyMonitor", "__version__"]
