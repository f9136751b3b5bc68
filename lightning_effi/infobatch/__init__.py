"""InfoBatch: unbiased dynamic data pruning (Qin et al., ICLR 2024). The method card is ``README.md`` beside this file.

- :mod:`~lightning_effi.infobatch.functional`: the pure core (epoch plans, rescaling, score updates);
- :class:`InfoBatchSampler`, :class:`InfoBatchDataModule`: the training loader built from the plan;
- :class:`InfoBatchCallback`: the Lightning layer (per-sample-loss wrapper, scores, plans, logging, resume);
  :func:`weighted_loss`: InfoBatch's loss for a ``training_step`` with manual optimization.
"""

from lightning_effi.infobatch import functional
from lightning_effi.infobatch.callback import InfoBatch, InfoBatchCallback, weighted_loss
from lightning_effi.infobatch.data import InfoBatchDataModule
from lightning_effi.infobatch.sampler import InfoBatchSampler

__all__ = ["InfoBatch", "InfoBatchCallback", "InfoBatchDataModule", "InfoBatchSampler", "functional", "weighted_loss"]
