"""Reference tasks (LightningModules) following the per-sample-loss contract (``docs/architecture.md``)."""

from lightning_effi.reference.tasks.base import EffiTask, param_groups
from lightning_effi.reference.tasks.image_classifier import ImageClassifier, SmallCNN, create_timm_model
from lightning_effi.reference.tasks.language_models import (
    BertMaskedLM,
    BertSequenceClassifier,
    GPT2CausalLM,
    token_losses_per_sample,
)

__all__ = [
    "BertMaskedLM",
    "BertSequenceClassifier",
    "EffiTask",
    "GPT2CausalLM",
    "ImageClassifier",
    "SmallCNN",
    "create_timm_model",
    "param_groups",
    "token_losses_per_sample",
]
