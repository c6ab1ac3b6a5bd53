"""The module paths of before the package was grouped by concern still import, as the same module
objects (so a monkeypatch through an old path patches the module the code uses)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from qkmonitor._moved import MOVED


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_path_is_the_module_at_its_new_home(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_old_names_import_in_a_fresh_interpreter():
    code = (
        "from qkmonitor.report import read_run\n"
        "from qkmonitor.hf_trainer import QKMonitorCallback\n"
        "import qkmonitor.intercept, qkmonitor.attention.intercept as new\n"
        "assert qkmonitor.intercept is new\n"
        "from qkmonitor.output.report import read_run as again\n"
        "assert read_run is again\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_package_has_no_module_left_at_an_old_path():
    import qkmonitor

    root = __import__("pathlib").Path(qkmonitor.__file__).parent
    for old in MOVED:
        assert not (root.parent / (old.replace(".", "/") + ".py")).exists(), old
