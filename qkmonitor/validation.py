"""Argument checks shared by the core, the engines, the callbacks and the bundled models.

Each ``check_*`` function raises ``ValueError`` naming the argument, in one form:
``Expected `name` to be <what>, got <value!r>``. Tests match on these messages, so a check is
used only where its message is the one the call site gives. Bools are rejected wherever a
number is expected (``True`` is an ``int`` in Python). The ``is_*`` predicates answer the same
questions for call sites that word their own message.

This module imports only the standard library.
"""

from __future__ import annotations

import math
from numbers import Real

__all__ = [
    "check_bool",
    "check_fraction",
    "check_int_at_least",
    "check_int_between",
    "check_non_negative_int",
    "check_optional_positive_int",
    "check_positive_int",
    "check_real",
    "is_int",
    "is_real",
]


def is_real(value: object) -> bool:
    """Whether ``value`` is a real number (``numbers.Real``: int, float, NumPy scalars), not a
    bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


def is_int(value: object, minimum: int | None = None) -> bool:
    """Whether ``value`` is an int (not a bool), and ``>= minimum`` when a minimum is given."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return minimum is None or value >= minimum


def check_bool(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a bool: "Expected `name` to be a bool"."""
    if not isinstance(value, bool):
        raise ValueError(f"Expected `{name}` to be a bool, got {value!r}")


def check_positive_int(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 1: "to be a positive int"."""
    if not is_int(value, 1):
        raise ValueError(f"Expected `{name}` to be a positive int, got {value!r}")


def check_optional_positive_int(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is None or an int >= 1: "to be a positive int or
    None"."""
    if value is not None and not is_int(value, 1):
        raise ValueError(f"Expected `{name}` to be a positive int or None, got {value!r}")


def check_int_at_least(name: str, value: object, minimum: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= ``minimum``: "to be an int >= minimum"."""
    if not is_int(value, minimum):
        raise ValueError(f"Expected `{name}` to be an int >= {minimum}, got {value!r}")


def check_int_between(name: str, value: object, low: int, high: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an int with ``low <= value <= high``: "to be an
    int in [low, high]"."""
    if not is_int(value, low) or value > high:
        raise ValueError(f"Expected `{name}` to be an int in [{low}, {high}], got {value!r}")


def check_non_negative_int(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 0: "to be an int >= 0"."""
    check_int_at_least(name, value, 0)


def check_real(
    name: str, value: object, *, above: float | None = None, at_least: float | None = None
) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number within the bound given.

    Args:
        name: the argument's name, as the message shows it.
        value: the value to check.
        above: if given, ``value`` must be ``> above`` ("to be a finite number > above").
        at_least: if given, ``value`` must be ``>= at_least`` ("to be a finite number >= at_least").
            Give at most one of ``above`` and ``at_least``; with neither the message is "to be a
            finite number".
    """
    if above is not None and at_least is not None:
        raise TypeError("Give at most one of `above` and `at_least`")
    ok = is_real(value) and math.isfinite(value)
    if ok and above is not None:
        ok = value > above
    if ok and at_least is not None:
        ok = value >= at_least
    if not ok:
        bound = f" > {above}" if above is not None else ""
        bound += f" >= {at_least}" if at_least is not None else ""
        raise ValueError(f"Expected `{name}` to be a finite number{bound}, got {value!r}")


def check_fraction(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a real number with ``0 < value < 1``: "in (0,
    1)"."""
    if not is_real(value) or not 0.0 < value < 1.0:
        raise ValueError(f"Expected `{name}` in (0, 1), got {value!r}")
