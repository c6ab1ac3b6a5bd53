"""Each module has one path: those of before the package was grouped by concern (2026-12-03) no
longer import, and nothing is left at them."""

from __future__ import annotations

import importlib
import pathlib

import pytest

import qkmonitor

OLD_PATHS = [
    "qkmonitor.adapters",
    "qkmonitor.intercept",
    "qkmonitor.report",
    "qkmonitor.tags",
    "qkmonitor.hf_trainer",
    "qkmonitor.engine.sinks",
]


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_module_path_does_not_import(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_no_finder_of_qkmonitor_is_on_the_import_path():
    import sys

    assert not [f for f in sys.meta_path if type(f).__module__.startswith("qkmonitor")]


def test_the_package_has_no_module_left_at_an_old_path():
    root = pathlib.Path(qkmonitor.__file__).parent
    for old in OLD_PATHS:
        assert not (root.parent / (old.replace(".", "/") + ".py")).exists(), old
