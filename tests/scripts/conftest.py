"""The scripts in ``benchmarks/`` imported as modules, for tests of their logic on known numbers."""

from __future__ import annotations

import argparse
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


@pytest.fixture(scope="module")
def instability(benchmark_module):
    """``benchmarks/instability.py`` as a module."""
    return benchmark_module("instability")


@pytest.fixture(scope="module")
def sweep_args(instability):
    """``sweep_args(**changes)``: the sweep's command-line arguments by default (every family and
    seed, both warmups, no QK-norm), with ``changes``."""

    def make(**changes):
        base = {
            "families": list(instability.FAMILIES), "quick": False,
            "seeds": list(instability.SEEDS), "warmups": [instability.WARMUP, 0], "qk_norm": False,
        }  # fmt: skip
        return argparse.Namespace(**{**base, **changes})

    return make
