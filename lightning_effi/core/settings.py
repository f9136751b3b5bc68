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

A setting set while a fit runs (from a callback's hook, the module's ``setup``) is noted, with a warning, and the
attribute keeps the value the fit runs with: it is taken at the next fit's ``setup``, never mid-fit without the
constructor's check. A dict or list setting changed in place (``vc.lr_multiplier[2] = 3.0``) is seen at the next fit's
``setup`` by comparing it with a copy taken when the callback was built.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

__all__ = [
    "KeepsSettings",
    "apply_changed_settings",
    "changed_settings",
    "given_settings",
    "keep_settings",
]

#: (the class, the arguments as given, {name: value set from outside the package}, {name: (the dict or list
#: attribute the constructor set, a copy of it)}, id of the object it is the record of)
_RECORD = "_effi_settings"
#: the Trainer of each callback's last fit (apply_changed_settings): a setting set while it runs waits for the next
_FITS: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()
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


def _containers_copied(value: Any) -> Any:
    """``value`` with its dicts, lists, tuples and sets copied, at every depth, OmegaConf containers (which Hydra's
    ``instantiate`` passes) deep-copied (qa93-regress 03), and everything else (an adapter, a function, a dataset)
    shared."""
    if type(value) is dict:
        return {k: _containers_copied(v) for k, v in value.items()}
    if type(value) in (list, tuple, set, frozenset):
        return type(value)(_containers_copied(v) for v in value)
    if type(value).__module__.startswith("omegaconf"):
        return copy.deepcopy(value)  # a DictConfig / ListConfig: plain data
    return copy.copy(value) if isinstance(value, dict) else value  # a dict subclass (OrderedDict): its own copy


def keep_settings(obj: Any, owner: type, given: dict[str, Any]) -> None:
    """The last statement of ``owner.__init__``: record the arguments it was called with (:func:`given_settings`; a
    deprecated spelling given as its replacement), with no setting noted yet, and a copy of each dict or list the
    constructor set as an argument's attribute (an in-place change is a setting, :func:`changed_settings`). The
    arguments are recorded with their dicts and lists copied: the caller's own dict edited after the build (reused for
    the next experiment) was taken at the next fit that rebuilt the callback for another setting (qa92-break 01)."""
    containers = {
        name: (value, copy.deepcopy(value))
        for name in given
        if isinstance(value := obj.__dict__.get(name), dict | list | set)
    }
    obj.__dict__[_RECORD] = (owner, {k: _containers_copied(v) for k, v in given.items()}, {}, containers, id(obj))


def _record(obj: Any) -> tuple[Any, ...] | None:
    """``obj``'s record of settings (:func:`keep_settings`); one that came with a copy of another object
    (``copy.copy`` shares ``__dict__``'s values, whatever the class's copy protocol: slots, ``__getstate__``) is
    copied first, so that a setting set on the copy is not noted on the original (qa92-break 02)."""
    record: tuple[Any, ...] | None = obj.__dict__.get(_RECORD)
    if record is not None and (len(record) < 5 or record[4] != id(obj)):
        record = (*record[:2], dict(record[2]), *(record[3:4] or ({},)), id(obj))
        obj.__dict__[_RECORD] = record
    return record


def _running_fit(obj: Any) -> Any:
    """The Trainer whose fit ``obj`` is in (set up by :func:`apply_changed_settings` and still running), or None."""
    try:
        ref = _FITS.get(obj)
    except TypeError:  # an unhashable subclass (its own __eq__)
        return None
    trainer = ref() if ref is not None else None
    state = getattr(trainer, "state", None)
    fn, status = getattr(state, "fn", None), getattr(state, "status", None)
    return (
        trainer
        if str(getattr(fn, "value", fn)) == "fit" and str(getattr(status, "value", status)) == "running"
        else None
    )


class KeepsSettings:
    """A base of the technique callbacks: an attribute named as a constructor argument, set from code outside
    ``lightning_effi`` (the callback's own writes come from inside; the writer is the code that called
    ``__setattr__``, past a subclass's own ``__setattr__`` that passes the write on), is noted as a setting for the
    next fit (:func:`apply_changed_settings`)."""

    def __copy__(self) -> Any:
        """``copy.copy`` as the class's protocol makes it (slots, ``__getstate__``: ``copy._reconstruct``, what
        ``copy.copy`` runs without this method), with a record of its own from now on: a record split at the copy's
        first use took settings set on the original in between (qa94-regress 02)."""
        new = copy._reconstruct(self, None, *self.__reduce_ex__(4))  # type: ignore[attr-defined]
        _record(new)
        return new

    def __setattr__(self, name: str, value: Any) -> None:
        record = _record(self)
        if record is not None and name in record[1]:
            writer = sys._getframe(1)
            while writer.f_code.co_name == "__setattr__" and writer.f_back is not None:
                writer = writer.f_back  # a subclass's own __setattr__ passing the write on: its caller wrote it
            if not _inside_package(writer.f_code.co_filename):
                record[2][name] = value
                if _running_fit(self) is not None:
                    # the running fit keeps what it was set up with: a value used at once skipped the constructor's
                    # check (vc.lr_multiplier = {2: -1.0} trained at a negative LR, qa91-break 03)
                    warnings.warn(
                        f"{type(self).__name__}.{name} = {value!r:.80} was set during a fit: this fit goes on with "
                        f"{getattr(self, name, None)!r:.80}, and the next fit's setup takes the new value (or refuses "
                        "it, naming why)",
                        UserWarning,
                        stacklevel=2,
                    )
                    return
        super().__setattr__(name, value)


def changed_settings(obj: Any) -> dict[str, Any]:
    """The constructor arguments set on ``obj`` as attributes from outside the package since it was (last) built:
    ``{name: value}``, the last value set of each."""
    record = _record(obj)
    if record is None:
        return {}
    changed = dict(record[2])
    for name, (built, kept) in (record[3] if len(record) > 3 else {}).items():
        if name not in changed and obj.__dict__.get(name) is built and built != kept:
            changed[name] = built  # changed in place since it was built
    return changed


def apply_changed_settings(obj: Any, trainer: Any = None) -> dict[str, Any]:
    """Build ``obj`` again, in place, with the constructor arguments set on it as attributes since it was built
    (:func:`changed_settings`), the others as it was built with: the constructor checks them (its error, with a note
    naming what was set, propagates, and ``obj`` is left as it was) and derives its attributes from them. Attributes
    the constructor does not set (a subclass's own) are kept. Call at the start of ``setup("fit")``, before anything
    reads the settings, with the fit's ``trainer``: while its fit runs, a setting set on ``obj`` waits for the next fit
    (:class:`KeepsSettings`). Returns what was set (``{}``: nothing, ``obj`` untouched); a refused setting stays noted.

    Raises:
        ValueError, TypeError: the constructor's, for a value it refuses.
    """
    if trainer is not None:
        try:
            _FITS[obj] = weakref.ref(trainer)
        except TypeError:  # unhashable: a setting set during its fits is used at once, as on any object
            pass
    changed = changed_settings(obj)
    if not changed:
        return {}
    owner, given = obj.__dict__[_RECORD][:2]
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
