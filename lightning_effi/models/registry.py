"""The one registry of model families: per family name (``hf_gpt2``, ``hf_bert``, ``timm_vit``, ...), the adapter
each technique uses for it (random-LTD: a :class:`~lightning_effi.models.base.TransformerAdapter`; V-cycle: a
:class:`~lightning_effi.models.vcycle_base.VCycleAdapter`).

The family files (``gpt2.py``, ``bert.py``, ``vit.py``) register their adapters through
:func:`~lightning_effi.models.base.register_adapter` and
:func:`~lightning_effi.models.vcycle_base.register_vcycle_adapter`, which are views over this registry;
:func:`registered_families` lists every family with the techniques it supports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_effi.core.checks import check_choice

__all__ = ["TECHNIQUES", "ModelFamily", "adapters", "family", "lookup", "names", "register", "registered_families"]

#: techniques that take a per-family adapter, in the order :attr:`ModelFamily.supports` lists them
TECHNIQUES = ("random_ltd", "vcycle")


@dataclass
class ModelFamily:
    """One architecture family and its adapter per technique (a class, or a factory for random-LTD)."""

    name: str
    adapters: dict[str, Any] = field(default_factory=dict)

    @property
    def supports(self) -> tuple[str, ...]:
        """The techniques with an adapter for this family, in :data:`TECHNIQUES` order."""
        return tuple(t for t in TECHNIQUES if t in self.adapters)

    def adapter(self, technique: str) -> Any:
        """The family's adapter for ``technique`` (``None`` when it has none)."""
        return self.adapters.get(technique)


#: families in registration order (``"auto"`` look-ups try them in this order)
_FAMILIES: dict[str, ModelFamily] = {}


def _check_technique(technique: str) -> None:
    check_choice("registry", "technique", technique, TECHNIQUES)


def register(technique: str, name: str, adapter: Any, what: str = "adapter") -> Any:
    """Record ``adapter`` as family ``name``'s adapter for ``technique``; returns ``adapter``.

    Raises:
        ValueError: ``name`` already has another adapter for ``technique`` (``what`` names it in the message), or
            an unknown technique.
    """
    _check_technique(technique)
    fam = _FAMILIES.setdefault(name, ModelFamily(name))
    old = fam.adapters.get(technique)
    if old is not None and old is not adapter:
        raise ValueError(f"{what} {name!r} is already registered ({old!r})")
    fam.adapters[technique] = adapter
    return adapter


def adapters(technique: str) -> dict[str, Any]:
    """``{family name: adapter}`` of the families with an adapter for ``technique``, in registration order."""
    _check_technique(technique)
    return {n: f.adapters[technique] for n, f in _FAMILIES.items() if technique in f.adapters}


def names(technique: str) -> list[str]:
    """The family names with an adapter for ``technique``, sorted."""
    return sorted(adapters(technique))


def lookup(technique: str, name: Any, what: str = "adapter", *, registered: str | None = None, hint: str = "") -> Any:
    """Family ``name``'s adapter for ``technique``.

    Args:
        what: names the adapter kind in the message. registered: the list of registered adapters in the message
            (default: :func:`names` comma-separated). hint: appended to the message (e.g. what to pass instead).

    Raises:
        ValueError: ``adapter: unknown {what} {name!r}; registered: ...`` when ``name`` is not a registered family
            name with an adapter for ``technique``.
    """
    known = adapters(technique)
    if not isinstance(name, str) or name not in known:
        listing = ", ".join(sorted(known)) if registered is None else registered
        raise ValueError(f"adapter: unknown {what} {name!r}; registered: {listing}{' ' + hint if hint else ''}")
    return known[name]


def family(name: str) -> ModelFamily:
    """The registered family ``name``.

    Raises:
        KeyError: no family of that name (the message lists the registered ones).
    """
    if name not in _FAMILIES:
        raise KeyError(f"unknown model family {name!r}; registered: {sorted(_FAMILIES)}")
    return _FAMILIES[name]


def registered_families() -> dict[str, tuple[str, ...]]:
    """``{family name: techniques it supports}``, sorted by name, e.g. ``{"hf_gpt2": ("random_ltd", "vcycle")}``."""
    return {name: _FAMILIES[name].supports for name in sorted(_FAMILIES)}
