"""Random layerwise token dropping (random-LTD, Yao et al. 2022; DeepSpeed Data Efficiency). The method card is
``README.md`` beside this file.

- :mod:`~lightning_effi.random_ltd.functional`: the pure core (schedule, token sampling, gather / scatter, FLOPs);
- :mod:`~lightning_effi.random_ltd.patching`: instance-level patching of a model's middle layers;
- :class:`RandomLTDCallback`: the Lightning layer. Per-architecture knowledge is in :mod:`lightning_effi.models`.
"""

from lightning_effi.random_ltd import functional
from lightning_effi.random_ltd.callback import RandomLTD, RandomLTDCallback
from lightning_effi.random_ltd.config import parse_deepspeed_config
from lightning_effi.random_ltd.patching import (
    LTDController,
    LTDForward,
    PatchedLayers,
    convert,
    is_converted,
    resolve_layer_ids,
    restore,
    strip_random_ltd_keys,
)

__all__ = [
    "LTDController",
    "LTDForward",
    "PatchedLayers",
    "RandomLTD",
    "RandomLTDCallback",
    "convert",
    "functional",
    "is_converted",
    "parse_deepspeed_config",
    "resolve_layer_ids",
    "restore",
    "strip_random_ltd_keys",
]
