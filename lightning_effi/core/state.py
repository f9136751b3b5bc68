"""A checkpoint written with other settings: one way for every technique to find and report it.

Each technique keeps a fingerprint of its identity-defining settings in its checkpointed state (plain values only).
On resume, :func:`settings_diff` lists what differs and :func:`config_mismatch` raises (``strict=True``, the default
of every technique) or warns and continues (``strict=False``).
"""

from __future__ import annotations

import ast
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from lightning_effi.core.checks import plain

__all__ = [
    "check_coarse_vcycle_resume",
    "config_mismatch",
    "other_state_keys",
    "settings_diff",
    "state_key_fields",
]


def settings_diff(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (checkpoint value, current value)}`` for every key whose value differs (a missing key reads None)."""
    saved = saved or {}
    keys = sorted(set(saved) | set(current), key=str)
    return {k: (saved.get(k), current.get(k)) for k in keys if saved.get(k) != current.get(k)}


def config_mismatch(
    owner: str,
    message: str,
    strict: bool,
    *,
    fix: str = "resume with this configuration",
    error: type[Exception] = ValueError,
) -> None:
    """Raise (``strict``) or warn that a checkpoint was written with other settings.

    Args:
        owner: the callback's class name, prefixed to the message.
        message: what differs.
        strict: raise, or warn and continue.
        fix: what ``strict=False`` does instead (an imperative: "resume with this configuration").
        error: the exception class raised when ``strict`` (a ``ValueError`` subclass of the technique).

    Raises:
        ValueError: (or ``error``) when ``strict``; the message says what ``strict=False`` would do.
    """
    message = f"{owner}: {message}"
    if strict:
        raise error(f"{message}; pass strict=False to {fix}")
    warnings.warn(f"{message} (strict=False: {fix})", stacklevel=3)


def other_state_keys(callback: Any, checkpoint: Mapping[str, Any]) -> list[str]:
    """The state keys of ``checkpoint`` written by a callback of the same class with other identity arguments, when
    the checkpoint has no state under ``callback.state_key`` (Lightning would then skip the callback's state
    silently): non-empty means "written with other settings". Call it from ``on_load_checkpoint``."""
    stored = checkpoint.get("callbacks", {})
    if callback.state_key in stored:
        return []
    prefix = type(callback).__qualname__ + "{"
    return [k for k in stored if isinstance(k, str) and k.startswith(prefix)]


def state_key_fields(callback: Any, key: str) -> dict[str, Any] | None:
    """The identity arguments of a state key of ``callback``'s class, ``Class{'a': 1, ...}`` as Lightning's
    ``Callback._generate_state_key`` writes it, as a dict; None when the key is another class's or its values are not
    plain literals."""
    prefix = type(callback).__qualname__
    if not key.startswith(prefix + "{"):
        return None
    try:
        fields = ast.literal_eval(key[len(prefix) :])
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return fields if isinstance(fields, dict) else None


def check_coarse_vcycle_resume(owner: str, trainer: Any, checkpoint: Mapping[str, Any]) -> None:
    """Refuse to resume a ``fit`` from a V-cycle checkpoint written below level 1 in a Trainer without the V-cycle.

    Such a checkpoint's ``state_dict`` holds the full model (de-coalesced), but its optimizer and LR-scheduler states
    are those of the coarse model, and the exact coarse weights sit in the V-cycle's state (``"weights"``, written by
    ``VCycleCallback.on_save_checkpoint``). Without the V-cycle, torch refuses the optimizer state (``loaded state
    dict contains a parameter group that doesn't match``) or, with width coalescing only, loads moments of the wrong
    shapes and fails at the first step. Called from the ``on_load_checkpoint`` of every lightning_effi callback, so
    that any of them in the Trainer stops the fit with this message first.

    Raises:
        ValueError: naming ``owner``, the checkpoint's level and what to do.
    """
    from lightning.pytorch.trainer.states import TrainerFn

    if trainer.state.fn != TrainerFn.FITTING:
        return
    if any(type(c).__qualname__ == "VCycleCallback" for c in getattr(trainer, "callbacks", [])):
        return  # the V-cycle checks its own checkpoint
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if isinstance(key, str) and key.startswith("VCycleCallback{") and isinstance(state, Mapping):
            if state.get("weights") is not None:
                raise ValueError(
                    f"{owner}: this checkpoint was written by a V-cycle at a coarse level (level "
                    f"{state.get('level', '> 1')}): its weights are "
                    "the full model's, but its optimizer and LR-scheduler states are the coarse model's, so a fit "
                    "without the VCycleCallback cannot resume it. Resume with the VCycleCallback it was written with "
                    "(same levels and settings), or start a new fit from its weights (load its state_dict into the "
                    "model and fit without ckpt_path)"
                )


def saving_in_train_batch_end(trainer: Any) -> bool:
    """Whether a checkpoint is being written inside ``on_train_batch_end``: the batch has trained (Lightning's batch
    progress counts it processed, not yet completed), e.g. by a user's callback calling ``trainer.save_checkpoint``
    there. Lightning resumes such a checkpoint after that batch (``RestartStage.RESTARTED_ON_TRAIN_BATCH_END``,
    ``loops/training_epoch_loop.py``), so a callback whose own ``on_train_batch_end`` has not run yet must write the
    state it will have after it."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    total = getattr(getattr(loop, "batch_progress", None), "total", None)
    if total is None or not getattr(trainer, "training", False):
        return False
    return bool(total.ready == total.started == total.processed == total.completed + 1)


def open_batch_skipped(trainer: Any, pl_module: Any, backward_seen: bool) -> bool:
    """Whether the batch in flight trained nothing, told before its ``on_train_batch_end`` (which receives the
    step's outputs; :func:`~lightning_effi.core.accounting.skipped_batch` reads those): under automatic optimization,
    a batch without a backward (``backward_seen``: ``on_before_backward`` ran for it) outside a forward-only epoch
    (StochasticWeightAveraging's batch-norm update, which trains nothing either but is told apart)."""
    forward_only = bool(getattr(getattr(trainer, "fit_loop", None), "_skip_backward", False))
    return bool(getattr(pl_module, "automatic_optimization", True)) and not backward_seen and not forward_only


def plain_config(config: Any, owner: str, *, error: type[Exception] = ValueError) -> Any:
    """``config`` as plain dicts and lists (:func:`~lightning_effi.core.checks.plain`); a ``str`` or
    ``os.PathLike`` is the path of a JSON file, read first (a DeepSpeed config file).

    Raises:
        error: the file cannot be read or is not JSON, naming ``owner`` and the path.
    """
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as err:
            raise error(f"{owner}: cannot read the config file {str(config)!r}: {err}") from None
    return plain(config)
