"""Hydra helpers: build callbacks and loggers from dict-keyed config groups, fill model arguments from the DataModule,
and turn configuration mistakes into one readable line (lightning-hydra-template ``src/utils/instantiators.py``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import hydra
from hydra.errors import InstantiationException
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

# ``${effi_cwd:}``: the launch folder, usable everywhere in the config (``${hydra:runtime.cwd}`` is not set yet when
# a multirun resolves ``hydra.sweep.dir``)
if not OmegaConf.has_resolver("effi_cwd"):
    OmegaConf.register_new_resolver("effi_cwd", os.getcwd)


class ConfigError(ValueError):
    """A configuration mistake, reported as one line naming the key (raised before training starts)."""


def _instantiate_group(cfg: DictConfig | None, group: str, kind: type) -> list[Any]:
    if cfg is None:
        return []
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{group}: expected a dict keyed by name, got {type(cfg).__name__}")
    objects = []
    for name, node in cfg.items():
        if not isinstance(node, Mapping) or "_target_" not in node:
            raise ConfigError(f"{group}.{name}: expected a config with a _target_, got {OmegaConf.to_yaml(node)!r}")
        obj = instantiate(node, key=f"{group}.{name}")
        if not isinstance(obj, kind):
            raise ConfigError(f"{group}.{name}: {node['_target_']} is not a {kind.__name__}")
        objects.append(obj)
    return objects


def instantiate_callbacks(cfg: DictConfig | None) -> list[Callback]:
    """Instantiate every entry of the dict-keyed ``callbacks`` group (entries without ``_target_`` are errors)."""
    return _instantiate_group(cfg, "callbacks", Callback)


def instantiate_loggers(cfg: DictConfig | None) -> list[Logger]:
    """Instantiate every entry of the dict-keyed ``logger`` group."""
    return _instantiate_group(cfg, "logger", Logger)


def instantiate(cfg: Any, key: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that reports failures as :class:`ConfigError` naming ``key`` and the cause."""
    try:
        return hydra.utils.instantiate(cfg, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        if str(cause).startswith((f"{key}.", f"{key}:")):  # the message already names the key
            raise ConfigError(str(cause)) from exc
        target = cfg.get("_target_", "?") if isinstance(cfg, Mapping) else "?"
        raise ConfigError(f"{key} ({target}): {type(cause).__name__}: {cause}") from exc
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{key}: {exc}") from exc


def model_kwargs_from_hints(model_cfg: Mapping[str, Any], hints: Mapping[str, Any]) -> dict[str, Any]:
    """The DataModule hints (``vocab_size``, ``num_classes``, ...) for model arguments left ``null`` in the config."""
    return {k: v for k, v in hints.items() if k in model_cfg and model_cfg[k] is None}
