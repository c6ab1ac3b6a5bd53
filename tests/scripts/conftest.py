"""The scripts in ``benchmarks/`` imported as modules, for tests of their logic on known numbers."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def benchmark_module():
    """``benchmark_module(name)``: ``benchmarks/{name}.py`` as a module (``benchmarks/`` is on
    ``sys.path`` for the test module's duration, as the scripts import each other)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCHMARKS))
