"""Shared handling of a checkpoint written with another configuration (technique callbacks' ``strict`` option)."""

from __future__ import annotations

import warnings


def config_mismatch(owner: str, message: str, strict: bool) -> None:
    """Raise ``ValueError`` (``strict``) or warn that a checkpoint's configuration differs from the current one.

    Args:
        owner: the callback's class name, prefixed to the message. message: what differs. strict: raise or warn.

    Raises:
        ValueError: when ``strict``; the message says to pass ``strict=False`` to resume anyway.
    """
    message = f"{owner}: {message}"
    if strict:
        raise ValueError(message + "; pass strict=False to resume with this configuration")
    warnings.warn(message + "; resuming with this configuration", stacklevel=3)
