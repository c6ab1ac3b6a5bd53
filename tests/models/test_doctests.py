"""Run the docstring examples of the packages mapped from other folders (models/, callbacks/).

pytest's --doctest-modules collects only `qkmonitor/`; these modules are imported through their
installed names so that they are not loaded twice under a top-level `models` name.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import qkmonitor.callbacks
import qkmonitor.models

MODULES = sorted(
    info.name
    for package in (qkmonitor.models, qkmonitor.callbacks)
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
