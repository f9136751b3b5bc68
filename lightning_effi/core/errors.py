"""Configuration errors of the data layer."""

from __future__ import annotations

__all__ = ["DataConfigError"]


class DataConfigError(ValueError):
    """A data argument or data file is invalid.

    The message names the offending parameter (as ``data.<name>``, the Hydra key) or file and states what was
    expected, e.g. ``data.block_size: 4096 is larger than the validation split (1,200 tokens); expected <= 1200``.
    """
