"""Every public callback of ``lightning_effi`` has a settings entry in :mod:`tests.harness.settings` (so the harness
in ``test_callbacks.py`` covers it), and every entry is a public callback."""

from __future__ import annotations

from lightning.pytorch import Callback

from tests.harness.settings import SETTINGS, public_callbacks


def test_public_callbacks_are_found():
    found = public_callbacks()
    assert found and all(issubclass(cls, Callback) for cls in found)
    assert len({cls.__name__ for cls in found}) == len(found)  # aliases (InfoBatch = InfoBatchCallback) counted once


def test_every_public_callback_has_settings():
    missing = [f"{cls.__module__}.{cls.__qualname__}" for cls in public_callbacks() if cls not in SETTINGS]
    assert not missing, (
        f"public callbacks without a harness entry: {missing}; add a CallbackSettings for each to "
        "SETTINGS in tests/harness/settings.py"
    )


def test_every_entry_is_a_public_callback():
    public = set(public_callbacks())
    stale = [cls.__qualname__ for cls in SETTINGS if cls not in public]
    assert not stale, f"SETTINGS entries that lightning_effi no longer exports as callbacks: {stale}"
