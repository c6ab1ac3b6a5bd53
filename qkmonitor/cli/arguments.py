"""The command line's argument types (each refuses a bad value in plain words, naming what it
expected), the options that several commands share, and its help formatter."""

from __future__ import annotations

import argparse
import math
import os

__all__ = [
    "HelpFormatter",
    "add_directory_option",
    "any_int",
    "directory_argument",
    "directory_problem",
    "fraction",
    "non_negative_float",
    "positive_float",
    "positive_int",
    "run_name",
    "unwritable",
]


def _number(text: str, kind: type, what: str, ok) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, "a positive integer", lambda v: v >= 1)


def positive_float(text: str) -> float:
    return _number(text, float, "a positive number", lambda v: v > 0 and math.isfinite(v))


def non_negative_float(text: str) -> float:
    return _number(text, float, "a number >= 0", lambda v: v >= 0 and math.isfinite(v))


def fraction(text: str) -> float:
    return _number(text, float, "a number between 0 and 1", lambda v: 0 < v < 1)


def any_int(text: str) -> int:
    return _number(text, int, "an integer", lambda v: True)


def run_name(text: str) -> str:
    """A run's folder name under the log directory: one path part, never one that leaves it."""
    separators = {"/", os.sep, *([os.altsep] if os.altsep else [])}
    if not text or text in (".", "..") or any(sep in text for sep in separators):
        raise argparse.ArgumentTypeError(
            f"expected a run name without '/' that is not '.' or '..' (a folder under "
            f"--log-dir), got {text!r}"
        )
    return text


def directory_problem(path: str) -> str | None:
    """Why ``path`` cannot be a directory to write into, in words, or None: it is a file, or a
    part of it is (a directory that is missing is made; its permissions are found out at the
    write)."""
    if os.path.isdir(path):
        return None
    if os.path.exists(path):
        return "it is a file"
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        return f"{parent!r} in it is a file"
    return None


def unwritable(path: str) -> str | None:
    """Why nothing can be written into the folder ``path``, in words naming where it failed, or
    None: the folder is made where it is missing (as a run's logger would make it) and a file is
    made in it and removed. A read-only mount, a folder without write permission, or one whose
    parent cannot take it; asked before a run starts, rather than learnt from the traceback of
    the logger's first write."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:  # named by the folder that could not be made
        where = os.fsdecode(err.filename) if err.filename is not None else path
        return f"{err.strerror or type(err).__name__}: {where!r}"
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:  # named by the folder, not by the file's made-up name
        return f"{err.strerror or type(err).__name__}: {path!r}"
    return None


def directory_argument(text: str) -> str:
    """An argparse type (``report --out``, ``train --log-dir``): a directory to write into, one
    that is or one to make (no part of it a file)."""
    problem = directory_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"expected a directory, got {text!r}: {problem}")
    return text


def add_directory_option(parser: argparse.ArgumentParser, flag: str, **kwargs) -> None:
    """A ``DIR`` option (``report --out``, ``scan --log-dir``): a directory to write into, checked
    by :func:`directory_argument`; ``kwargs`` go to ``add_argument`` (help, required)."""
    parser.add_argument(flag, type=directory_argument, metavar="DIR", **kwargs)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default once: appended unless the help text already speaks of it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = (None, False, argparse.SUPPRESS)
        if "default" in text or action.default in quiet or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"
