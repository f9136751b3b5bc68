"""One way to find and report a checkpoint written with other settings."""

import pytest

from lightning_effi.core.state import config_mismatch, other_state_keys, settings_diff


def test_settings_diff_lists_both_sides():
    assert settings_diff({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == {"b": (2, 3), "c": (None, 4)}
    assert settings_diff(None, {"a": 1}) == {"a": (None, 1)}
    assert settings_diff({"a": 1}, {"a": 1}) == {}


def test_config_mismatch_raises_or_warns():
    with pytest.raises(KeyError, match=r"Owner: differs; pass strict=False to start afresh"):
        config_mismatch("Owner", "differs", True, fix="start afresh", error=KeyError)
    with pytest.warns(UserWarning, match=r"Owner: differs \(strict=False: resume with this configuration\)"):
        config_mismatch("Owner", "differs", False)


class Cb:
    state_key = "Cb{'a': 1}"


def test_other_state_keys():
    assert other_state_keys(Cb(), {"callbacks": {"Cb{'a': 2}": {}, "Other{}": {}}}) == ["Cb{'a': 2}"]
    assert other_state_keys(Cb(), {"callbacks": {"Cb{'a': 1}": {}, "Cb{'a': 2}": {}}}) == []
    assert other_state_keys(Cb(), {}) == []
