"""Constructor settings changed on a callback after it was built (``cb.require_steps = 10`` between two notebook
cells): taken at the next fit's ``setup`` as if the callback had been built with them, or refused there with the
constructor's own error.

A technique callback turns several constructor arguments into derived attributes of the same name (random-LTD's
``max_value`` and ``require_steps`` are resolved from the run; the V-cycle's ``e_small`` is a parsed duration), so a
value set on that attribute was overwritten in silence at the next fit, or crashed an unrelated method (the
V-cycle's ``repr``, which Lightning calls when a Trainer is built). :func:`keep_settings` records the arguments a
callback was built with; :class:`KeepsSettings` (a base of the technique callbacks) notes an attribute of an
argument's name set from outside this package (the user's code: a notebook cell, a script, another callback), and
:func:`apply_changed_settings`, called at the start of the callback's ``setup("fit")``, runs the constructor again on
the same object with what was set. The callback's own writes (a fit deriving ``max_value``) are not noted: they come
from this package's code. A noted setting stays noted until a fit's setup takes it (a ``validate`` or a failed fit in
between does not drop it), and one the constructor refuses is refused at every fit until it is set right.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "KeepsSettings",
    "ReadOnlySetting",
    "apply_changed_settings",
    "changed_settings",
    "given_settings",
    "keep_settings",
]

_RECORD = "_effi_settings"  # (the class, the arguments as given, {name: value set from outside the package})
_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # lightning_effi/


@functools.lru_cache(maxsize=512)
def _inside_package(filename: str) -> bool:
    """Whether code of ``filename`` is this package's (its writes are the callback's own)."""
    return os.path.realpath(filename).startswith(_PACKAGE)


def given_settings(arguments: dict[str, Any]) -> dict[str, Any]:
    """The constructor's arguments, from ``locals()`` read as the first statement of ``__init__`` (before any is
    rebound), without ``self``: ``given = given_settings(locals())``. Read there rather than by a decorator, which
    would add a frame between the caller and the constructor's warnings (their ``stacklevel``)."""
    return {name: value for name, value in arguments.items() if name not in ("self", "__class__")}


def keep_settings(obj: Any, owner: type, given: dict[str, Any]) -> None:
    """The last statement of ``owner.__init__``: record the arguments it was called with (:func:`given_settings`; a
    deprecated spelling given as its replacement), with no setting noted yet."""
    obj.__dict__[_RECORD] = (owner, given, {})


class KeepsSettings:
    """A base of the technique callbacks: an attribute named as a constructor argument, set from code outside
    ``lightning_effi`` (the callback's own writes come from inside; the writer is the code that called
    ``__setattr__``, past a subclass's own ``__setattr__`` that passes the write on), is noted as a setting for the
    next fit (:func:`apply_changed_settings`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        record = self.__dict__.get(_RECORD)
        if record is None or name not in record[1]:
            return
        writer = sys._getframe(1)
        while writer.f_code.co_name == "__setattr__" and writer.f_back is not None:
            writer = writer.f_back  # a subclass's own __setattr__ passing the write on: its caller wrote it
        if not _inside_package(writer.f_code.co_filename):
            record[2][name] = value


def changed_settings(obj: Any) -> dict[str, Any]:
    """The constructor arguments set on ``obj`` as attributes from outside the package since it was (last) built:
    ``{name: value}``, the last value set of each."""
    record = obj.__dict__.get(_RECORD)
    return {} if record is None else dict(record[2])


def apply_changed_settings(obj: Any) -> dict[str, Any]:
    """Build ``obj`` again, in place, with the constructor arguments set on it as attributes since it was built
    (:func:`changed_settings`), the others as it was built with: the constructor checks them (its error, with a note
    naming what was set, propagates, and ``obj`` is left as it was) and derives its attributes from them. Attributes
    the constructor does not set (a subclass's own) are kept. Call at the start of ``setup("fit")``, before anything
    reads the settings. Returns what was set (``{}``: nothing, ``obj`` untouched); a refused setting stays noted.

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


class ReadOnlySetting(dict):  # type: ignore[type-arg]
    """A dict-valued setting of a callback (the V-cycle's ``lr_multiplier``), kept read-only: an in-place change
    (``vc.lr_multiplier[2] = 3.0``) would skip the constructor's check (a factor of -1 trained a level at a negative
    learning rate) and be dropped in silence when another setting made the callback build again. It raises instead,
    naming the assignment that is checked and taken at the next fit. Equal to, printed and JSON-written as a dict.

    Args:
        name: ``"<Class>.<attribute>"``, for the error.
        values: the setting's items.
    """

    def __init__(self, name: str, values: Any = ()) -> None:
        super().__init__(values)
        self.__dict__["_name"] = name

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        owner, _, attribute = self.__dict__["_name"].partition(".")
        raise TypeError(
            f"{self.__dict__['_name']} is read-only: assign a new dict instead (callback.{attribute} = {{...}}), which "
            f"{owner} checks and takes at the next fit"
        )

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple[Any, ...]:  # pickle and deepcopy (ddp_spawn, a Trainer's deepcopy)
        return (type(self), (self.__dict__["_name"], dict(self)))
