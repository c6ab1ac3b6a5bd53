"""Every public callback's docstring shows it at work in an example that runs (issue 62, item 5).

The examples themselves are run by pytest's ``--doctest-modules`` over ``qkmonitor`` (pyproject's
``[tool.pytest.ini_options]``); these tests see that each callback has one, that it trains, and
that the configuration still collects them.
"""

from __future__ import annotations

import doctest
import importlib.util
from pathlib import Path

import pytest

import qkmonitor.callbacks
from qkmonitor.engine import Monitoring

#: the bases the callbacks are made from; each concrete callback shows them at work
BASES = {"ActivationMonitor", "AttentionMonitor"}
ROOT = Path(__file__).resolve().parents[2]


def public_callbacks() -> list[type]:
    found = [getattr(qkmonitor.callbacks, name) for name in qkmonitor.callbacks.__all__]
    callbacks = [c for c in found if isinstance(c, type) and c.__name__ not in BASES]
    if importlib.util.find_spec("transformers") is not None:
        from qkmonitor.callbacks.hf_trainer import HFQKMonitorCallback

        callbacks.append(HFQKMonitorCallback)
    return callbacks


def examples_of(obj: type) -> list[doctest.Example]:
    tests = doctest.DocTestFinder(recurse=False).find(obj, obj.__name__)
    return [example for test in tests for example in test.examples]


@pytest.mark.parametrize("cls", [*public_callbacks(), Monitoring], ids=lambda c: c.__name__)
def test_each_public_callback_has_an_example_that_trains(cls):
    examples = examples_of(cls)
    assert examples, f"{cls.__name__}'s docstring has no >>> example"
    source = "".join(example.source for example in examples)
    assert f"{cls.__name__}(" in source, f"{cls.__name__}'s example does not make one"
    trains = (".fit(", ".train()", "optimizer.step()")
    assert any(call in source for call in trains), f"{cls.__name__}'s example trains nothing"


def test_no_literal_example_is_left_in_the_callbacks():
    for path in sorted((ROOT / "qkmonitor" / "callbacks").glob("*.py")):
        text = path.read_text()
        for block in text.split("Example::")[1:]:
            assert block.lstrip().startswith(">>>"), f"{path.name}: an Example:: block with no >>>"


def test_pytest_collects_the_package_doctests(pytestconfig):
    assert "--doctest-modules" in pytestconfig.getini("addopts")
    assert "qkmonitor" in pytestconfig.getini("testpaths")
