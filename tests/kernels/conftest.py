"""Fixtures for the attention kernel tests (the float64 reference is in ``tests/conftest.py``).

Without CUDA the Triton kernels run in the interpreter: ``TRITON_INTERPRET`` must be set before
triton is first imported (``triton.jit`` reads it when the kernels are decorated), so it is set
here, at conftest import, before any test module imports the triton backend. With CUDA the same
tests run the compiled kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def device() -> str:
    """Where the tests put their tensors: the GPU when there is one, else the CPU (interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"
