"""One set of argument checks for every public class: each returns the value in its plain Python type or raises a
``ValueError`` (or the technique's own subclass, ``error=``) that names the parameter (``Owner.name``) and what is
allowed.

Integers are :class:`numbers.Integral` (Python or numpy) but never ``bool``; reals are finite and never ``bool``.
OmegaConf containers coming from Hydra are turned into plain ones with :func:`plain`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from numbers import Integral, Real
from typing import Any, TypeVar

__all__ = [
    "check_bool",
    "check_choice",
    "check_int",
    "check_list",
    "check_non_decreasing",
    "check_real",
    "check_str",
    "is_int",
    "is_real",
    "plain",
]

T = TypeVar("T")


def is_int(x: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    """A finite real number (Python or numpy int / float), not a bool, nor an int too large for a float."""
    if not isinstance(x, Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an int beyond float range: the float arithmetic of every caller would overflow
        return False


def _where(owner: str, name: str) -> str:
    return f"{owner}.{name}" if owner else name


def _type_note(value: Any, kind: type) -> str:
    """For a value that is no number of ``kind`` at all: its type, and how to pass one (a 0-d tensor's value in
    range was refused as if it were out of it: "must be a finite number in (0, 1], got tensor(0.5000)", qa48-break
    02); empty for a number."""
    if isinstance(value, kind) and not isinstance(value, bool):
        return ""
    if callable(getattr(value, "item", None)) and getattr(value, "ndim", None) == 0:
        # value.item() of a float tensor or numpy float is a float, refused again as an int (qa49-break 10)
        cast = "int(value)" if kind is Integral else "float(value)"
        return f" (a {type(value).__name__}: pass its value as a Python number, {cast})"
    return "" if value is None or isinstance(value, bool | int | float) else f" (a {type(value).__name__})"


def check_int(
    owner: str,
    name: str,
    value: Any,
    minimum: int | None = None,
    maximum: int | None = None,
    *,
    error: type[Exception] = ValueError,
) -> int:
    """``value`` as a Python ``int`` within ``[minimum, maximum]`` (either bound optional).

    Raises:
        ValueError: not an integer (bools and floats such as ``2.0`` included) or out of range.
    """
    ok = is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        bounds = [f">= {minimum}" if minimum is not None else "", f"<= {maximum}" if maximum is not None else ""]
        what = " and ".join(b for b in bounds if b)
        note = _type_note(value, Integral)
        raise error(f"{_where(owner, name)} must be an int{' ' + what if what else ''}, got {value!r}{note}")
    return int(value)


def check_real(
    owner: str,
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    *,
    error: type[Exception] = ValueError,
) -> float:
    """``value`` as a finite Python ``float`` in the interval given by ``low`` / ``high`` (closed unless ``*_open``).

    Raises:
        ValueError: not a finite real number or outside the interval.
    """
    ok = is_real(value)
    if ok:
        v = float(value)
        ok = (low is None or (v > low if low_open else v >= low)) and (
            high is None or (v < high if high_open else v <= high)
        )
    if not ok:
        interval = ""
        if low is not None or high is not None:
            lo = "(" if low_open else "["
            hi = ")" if high_open else "]"
            interval = f" in {lo}{'-inf' if low is None else low}, {'inf' if high is None else high}{hi}"
        raise error(f"{_where(owner, name)} must be a finite number{interval}, got {value!r}{_type_note(value, Real)}")
    return float(value)


def check_bool(owner: str, name: str, value: Any, *, error: type[Exception] = ValueError) -> bool:
    """``value`` if it is a real boolean (Python ``bool`` or ``numpy.bool_``); a string such as ``"false"`` would
    otherwise be silently true.

    Raises:
        ValueError: anything else.
    """
    if type(value).__name__ not in ("bool", "bool_"):
        raise error(f"{_where(owner, name)} must be a bool (true / false), got {value!r}")
    return bool(value)


def check_choice(owner: str, name: str, value: Any, choices: Iterable[T], *, error: type[Exception] = ValueError) -> T:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: naming the allowed values.
    """
    allowed = tuple(choices)
    if not isinstance(value, (str, int, float, bool, type(None))) or value not in allowed:
        raise error(f"{_where(owner, name)} must be one of {allowed}, got {value!r}")
    return value


def check_list(
    owner: str, name: str, value: Any, *, what: str = "values", error: type[Exception] = ValueError
) -> list[Any]:
    """``value`` as a plain ``list`` when it is a list or tuple (an OmegaConf ``ListConfig`` included, via
    :func:`plain`). A string, a mapping, a set, a generator or a single value is refused: ``list("first")`` or a
    function passed for a list of functions would otherwise turn into something else. ``what`` says what the entries
    are (``"metric names"``), for the message.

    Raises:
        ValueError: anything else.
    """
    value = plain(value)
    if not isinstance(value, list):
        raise error(f"{_where(owner, name)} must be a list of {what}, got {value!r}")
    return value


def check_str(
    owner: str, name: str, value: Any, *, none_ok: bool = False, error: type[Exception] = ValueError
) -> str | None:
    """``value`` if it is a ``str`` (or ``None`` with ``none_ok``).

    Raises:
        ValueError: anything else (a number, a list, ``None`` without ``none_ok``).
    """
    if value is None and none_ok:
        return None
    if not isinstance(value, str):
        raise error(f"{_where(owner, name)} must be a str{' or None' if none_ok else ''}, got {value!r}")
    return value


def check_non_decreasing(
    owner: str, name: str, values: Sequence[Any], *, strict: bool = False, error: type[Exception] = ValueError
) -> None:
    """Refuse ``values`` (numbers) that decrease somewhere (``strict``: that do not increase everywhere); the
    message names the first offending position.

    Raises:
        ValueError: naming the position and both values.
    """
    for i in range(1, len(values)):
        a, b = values[i - 1], values[i]
        if b < a or (strict and b == a):
            order = "strictly ascending" if strict else "non-decreasing"
            raise error(
                f"{_where(owner, name)} must be {order}, got {list(values)!r} ({name}[{i}] = {b!r} after "
                f"{name}[{i - 1}] = {a!r})"
            )


def plain(x: Any) -> Any:
    """OmegaConf containers (Hydra) and tuples to plain dicts and lists, recursively; other values unchanged."""
    if isinstance(x, Mapping):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        return [plain(v) for v in x]
    return x
