"""The shared argument checks: accepted values come back in their plain type, the rest raise naming the parameter."""

import numpy as np
import pytest
from omegaconf import OmegaConf

from lightning_effi.core.checks import (
    check_bool,
    check_choice,
    check_int,
    check_list,
    check_non_decreasing,
    check_real,
    check_str,
    is_int,
    is_real,
    plain,
)


def test_is_int_and_is_real():
    assert [is_int(x) for x in (3, np.int64(3), True, 3.0, "3", None)] == [True, True, False, False, False, False]
    assert [is_real(x) for x in (3, 0.5, np.float32(0.5), True, float("nan"), float("inf"), "1")] == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]


def test_check_int_returns_python_int():
    v = check_int("Owner", "steps", np.int64(7), minimum=1)
    assert v == 7 and type(v) is int


@pytest.mark.parametrize(
    "value, match",
    [
        (0, r"Owner.steps must be an int >= 1 and <= 9, got 0"),
        (10, r"Owner.steps must be an int >= 1 and <= 9, got 10"),
        (2.0, r"Owner.steps must be an int >= 1 and <= 9, got 2.0"),
        (True, r"got True"),
    ],
)
def test_check_int_errors(value, match):
    with pytest.raises(ValueError, match=match):
        check_int("Owner", "steps", value, minimum=1, maximum=9)


def test_check_real():
    assert check_real("O", "p", 1, low=0, high=1) == 1.0
    with pytest.raises(ValueError, match=r"O.p must be a finite number in \[0, 1\), got 1"):
        check_real("O", "p", 1, low=0, high=1, high_open=True)
    with pytest.raises(ValueError, match=r"O.p must be a finite number in \(0, inf\], got 0"):
        check_real("O", "p", 0, low=0, low_open=True)
    with pytest.raises(ValueError, match="got nan"):
        check_real("O", "p", float("nan"))


def test_check_bool_refuses_strings():
    assert check_bool("O", "strict", np.bool_(False)) is False
    with pytest.raises(ValueError, match=r"O.strict must be a bool \(true / false\), got 'false'"):
        check_bool("O", "strict", "false")


def test_check_choice():
    assert check_choice("O", "mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"O.mode must be one of \('a', 'b'\), got 'c'"):
        check_choice("O", "mode", "c", ("a", "b"))
    with pytest.raises(ValueError, match="must be one of"):
        check_choice("O", "mode", ["a"], ("a", "b"))


def test_plain_unwraps_omegaconf_and_tuples():
    cfg = OmegaConf.create({"a": [1, (2, 3)], "b": {"c": "x"}})
    out = plain(cfg)
    assert out == {"a": [1, [2, 3]], "b": {"c": "x"}} and type(out) is dict and type(out["a"]) is list
    assert plain("abc") == "abc" and plain((1, 2)) == [1, 2]


def test_check_list_takes_lists_tuples_and_listconfigs_only():
    assert check_list("O", "names", ("a", "b")) == ["a", "b"]
    out = check_list("O", "names", OmegaConf.create(["a", {"k": 1}]))
    assert out == ["a", {"k": 1}] and type(out) is list and type(out[1]) is dict
    for bad in ("ab", {"a": 1}, {"a"}, 3, None, (x for x in "ab")):
        with pytest.raises(ValueError, match=r"^O\.names must be a list of metric names, got "):
            check_list("O", "names", bad, what="metric names")


def test_check_str():
    assert check_str("O", "key", "index") == "index" and check_str("O", "key", None, none_ok=True) is None
    with pytest.raises(ValueError, match=r"^O\.key must be a str or None, got 3$"):
        check_str("O", "key", 3, none_ok=True)
    with pytest.raises(ValueError, match=r"^O\.key must be a str, got None$"):
        check_str("O", "key", None)


def test_check_non_decreasing_names_the_first_offending_position():
    check_non_decreasing("O", "d", [1, 1, 2])
    check_non_decreasing("O", "d", [])
    with pytest.raises(
        ValueError, match=r"^O\.d must be non-decreasing, got \[1, 3, 2\] \(d\[2\] = 2 after d\[1\] = 3\)$"
    ):
        check_non_decreasing("O", "d", [1, 3, 2])
    with pytest.raises(ValueError, match=r"must be strictly ascending, got \[1, 1\]"):
        check_non_decreasing("O", "d", [1, 1], strict=True)


def test_a_value_of_another_type_is_named_with_its_type():
    """A 0-d tensor in range read as out of range ("must be a finite number in (0, 1], got tensor(0.5000)",
    qa48-break 02): the message names its type and how to pass its value."""
    import torch

    with pytest.raises(
        ValueError, match=r"in \(0, 1\], got tensor\(0\.5000\) \(a Tensor: pass its value as a Python number, float"
    ):
        check_real("O", "momentum", torch.tensor(0.5), 0, 1, low_open=True)
    with pytest.raises(ValueError, match=r"^O\.n must be an int >= 1, got tensor\(4\) \(a Tensor: .*, int\(value\)\)$"):
        check_int("O", "n", torch.tensor(4), 1)
    with pytest.raises(ValueError, match=r"^O\.r must be a finite number, got '0\.5' \(a str\)$"):
        check_real("O", "r", "0.5")
    with pytest.raises(ValueError, match=r"^O\.r must be a finite number in \[0, 1\], got 2$"):  # a number: no note
        check_real("O", "r", 2, 0, 1)
    with pytest.raises(ValueError, match=r"^O\.n must be an int, got 2\.0$"):
        check_int("O", "n", 2.0)
