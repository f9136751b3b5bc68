"""Constructor settings changed on a callback after it was built (``cb.require_steps = 10`` between two notebook
cells): taken at the next fit's ``setup`` as if the callback had been built with them, or refused there with the
constructor's own error.

A technique callback turns several constructor arguments into derived attributes of the same name (random-LTD's
``max_value`` and ``require_steps`` are resolved from the run; the V-cycle's ``e_small`` is a parsed duration), so a
value set on that attribute was overwritten in silence at the next fit, or crashed an unrelated method (the
V-cycle's ``repr``, which Lightning calls when a Trainer is built). :func:`keep_settings` records the arguments a
callback was built with and a snapshot of the attributes of those names; :func:`apply_changed_settings`, called at
the start of the callback's ``setup("fit")``, finds the attributes the user set since (a value that differs from the
snapshot, or an attribute of an argument's name that the callback never had, e.g. ``nonfinite_loss``), and runs the
constructor again on the same object with them. :func:`note_settings`, called at the end of every fit (``teardown``
and ``on_exception``), takes the snapshot again, so the values a fit derived are not read as the user's.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

__all__ = ["apply_changed_settings", "changed_settings", "given_settings", "keep_settings", "note_settings"]

_RECORD = "_effi_settings"  # (the class, the arguments as given, {name: the attribute's value when last noted})


def given_settings(arguments: dict[str, Any]) -> dict[str, Any]:
    """The constructor's arguments, from ``locals()`` read as the first statement of ``__init__`` (before any is
    rebound), without ``self``: ``given = given_settings(locals())``. Read there rather than by a decorator, which
    would add a frame between the caller and the constructor's warnings (their ``stacklevel``)."""
    return {name: value for name, value in arguments.items() if name not in ("self", "__class__")}


def keep_settings(obj: Any, owner: type, given: dict[str, Any]) -> None:
    """The last statement of ``owner.__init__``: record the arguments it was called with (:func:`given_settings`)
    and the attributes of the same names, which :func:`apply_changed_settings` compares with."""
    obj.__dict__[_RECORD] = (owner, given, _snapshot(obj, given))


def _snapshot(obj: Any, given: dict[str, Any]) -> dict[str, Any]:
    return {name: obj.__dict__[name] for name in given if name in obj.__dict__}


def _same(a: Any, b: Any) -> bool:
    """The value noted and the value now: the same object, or equal plain values (an int, a float (NaN equal to
    NaN), a str, a bool, None, a tuple of them): a callback that was pickled (``ddp_spawn``) has copies."""
    if a is b:
        return True
    plain = (int, float, str, bool, type(None), tuple)
    if type(a) is not type(b) or not isinstance(a, plain):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def changed_settings(obj: Any) -> dict[str, Any]:
    """The constructor arguments set on ``obj`` as attributes since they were last noted: ``{name: value}``."""
    record = obj.__dict__.get(_RECORD)
    if record is None:
        return {}
    _, given, seen = record
    return {
        name: obj.__dict__[name]
        for name in given
        if name in obj.__dict__ and (name not in seen or not _same(obj.__dict__[name], seen[name]))
    }


def note_settings(obj: Any) -> None:
    """Take the snapshot again (the end of a fit: what it derived is the callback's own, not a user's setting)."""
    record = obj.__dict__.get(_RECORD)
    if record is not None:
        obj.__dict__[_RECORD] = (record[0], record[1], _snapshot(obj, record[1]))


def apply_changed_settings(obj: Any) -> dict[str, Any]:
    """Build ``obj`` again, in place, with the constructor arguments set on it as attributes since they were noted
    (:func:`changed_settings`), the others as it was built with: the constructor checks them (its error, with a note
    naming what was set, propagates, and ``obj`` is left as it was) and derives its attributes from them. Attributes
    the constructor does not set (a subclass's own) are kept. Call at the start of ``setup("fit")``, before anything
    reads the settings. Returns what was set (``{}``: nothing, ``obj`` untouched).

    Raises:
        ValueError, TypeError: the constructor's, for a value it refuses.
    """
    changed = changed_settings(obj)
    if not changed:
        return {}
    owner, given, _ = obj.__dict__[_RECORD]
    signature = inspect.signature(owner.__init__)
    settings = {**given, **changed}
    args, kwargs = [], {}
    for name, parameter in list(signature.parameters.items())[1:]:
        if name not in settings:
            continue
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            kwargs.update(settings[name])
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            args.extend(settings[name])
        else:
            kwargs[name] = settings[name]
    before = dict(obj.__dict__)
    obj.__dict__.clear()
    try:
        owner.__init__(obj, *args, **kwargs)  # records the settings again (keep_settings)
    except Exception as err:
        obj.__dict__.clear()
        obj.__dict__.update(before)
        shown = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        err.add_note(
            f"{type(obj).__name__}: {shown} was set on the callback after it was built; the next fit builds it again "
            "with the settings set on it, which the constructor refused"
        )
        raise
    for name, value in before.items():
        obj.__dict__.setdefault(name, value)  # a subclass's own attributes
    return changed
