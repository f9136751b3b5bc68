"""unshown_warnings: the replays' warnings are not shown, and the warnings the run showed once stay shown once."""

import io
import warnings

import pytest

from lightning_effi.core.console import unshown_warnings


def warn_once() -> None:
    warnings.warn("shown once per location", UserWarning, stacklevel=1)


def test_unshown_warnings_keeps_the_once_per_location_record(monkeypatch):
    """A warning shown once is not shown again after a replay (``warnings.catch_warnings`` resets every module's
    record when it changes the filters: the monitor's FLOPs replay at each new batch shape made Lightning's
    once-per-run warnings show again, 16 times in 30 curriculum steps); the replay's own warning is not shown."""
    shown = io.StringIO()
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: shown.write(f"{message}\n"))
    with warnings.catch_warnings():  # this test's own filters: the default action (once per location)
        warnings.simplefilter("default")
        warn_once()
        with unshown_warnings():
            warnings.warn("from the replay", UserWarning, stacklevel=1)
        warn_once()
    assert shown.getvalue().splitlines() == ["shown once per location"]


def test_unshown_warnings_keeps_an_error_filter_and_restores_showwarning():
    before = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="raised"), unshown_warnings():
            warnings.warn("raised", UserWarning, stacklevel=1)
    assert warnings.showwarning is before
