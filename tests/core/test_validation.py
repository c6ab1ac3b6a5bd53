"""qkmonitor.validation: what each check accepts, and the messages the call sites rely on."""

from __future__ import annotations

import ast
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from qkmonitor import validation
from qkmonitor.validation import (
    check_bool,
    check_fraction,
    check_int_at_least,
    check_int_between,
    check_non_negative_int,
    check_optional_positive_int,
    check_positive_int,
    check_real,
    is_int,
    is_real,
)


def test_predicates_reject_bools_where_a_number_is_expected():
    assert is_real(1) and is_real(0.5) and is_real(np.float32(2)) and is_real(Fraction(1, 3))
    assert not is_real(True) and not is_real("1") and not is_real(None)
    assert is_int(0) and is_int(3, 1) and not is_int(0, 1) and not is_int(True) and not is_int(1.0)


@pytest.mark.parametrize(
    ("check", "args", "message"),
    [
        (check_bool, ("flag", 1), "Expected `flag` to be a bool, got 1"),
        (check_positive_int, ("n", 0), "Expected `n` to be a positive int, got 0"),
        (check_positive_int, ("n", True), "Expected `n` to be a positive int, got True"),
        (check_optional_positive_int, ("n", 0), "Expected `n` to be a positive int or None, got 0"),
        (check_int_at_least, ("n", 1, 2), "Expected `n` to be an int >= 2, got 1"),
        (check_non_negative_int, ("n", -1), "Expected `n` to be an int >= 0, got -1"),
        (check_int_between, ("n", 9, 0, 8), "Expected `n` to be an int in [0, 8], got 9"),
        (check_int_between, ("n", -1, 0, 8), "Expected `n` to be an int in [0, 8], got -1"),
        (check_real, ("x", float("nan")), "Expected `x` to be a finite number, got nan"),
        (check_real, ("x", 1, {"above": 1}), "Expected `x` to be a finite number > 1, got 1"),
        (check_real, ("x", -1, {"at_least": 0}), "Expected `x` to be a finite number >= 0, got -1"),
        (check_fraction, ("p", 1.0), "Expected `p` in (0, 1), got 1.0"),
        (check_fraction, ("p", False), "Expected `p` in (0, 1), got False"),
    ],
)
def test_each_check_raises_its_message(check, args, message):
    kwargs = args[-1] if isinstance(args[-1], dict) else {}
    args = args[:-1] if kwargs else args
    with pytest.raises(ValueError) as info:
        check(*args, **kwargs)
    assert str(info.value) == message


def test_valid_values_pass():
    check_bool("flag", False)
    check_positive_int("n", 1)
    check_optional_positive_int("n", None)
    check_int_at_least("n", 2, 2)
    check_int_between("n", 8, 0, 8)
    check_non_negative_int("n", 0)
    check_real("x", 2.5, above=1)
    check_real("x", 0, at_least=0)
    check_fraction("p", 0.5)


def test_imports_only_the_standard_library():
    tree = ast.parse(Path(validation.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "math", "numbers"}
