"""What the triton backend says when triton is missing or too old (no GPU, no triton import
needed)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from qkmonitor import kernels
from qkmonitor.kernels import attention


def qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 3, 16, generator=g) for _ in range(3))


def cuda_like(q: torch.Tensor) -> SimpleNamespace:
    """What `_choose_backend` reads of a CUDA tensor, for the `auto` branch on a CPU-only
    machine."""
    return SimpleNamespace(dtype=q.dtype, shape=q.shape, is_cuda=True, device=torch.device("cuda"))


@pytest.fixture(autouse=True)
def fresh_answer():
    """`_triton_missing` is asked once per process; each test installs its own triton."""
    kernels._triton_missing.cache_clear()
    yield
    kernels._triton_missing.cache_clear()


@pytest.fixture
def no_triton(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "triton" else find_spec(name, *a),
    )


@pytest.fixture
def old_triton(monkeypatch):
    find_spec, version = importlib.util.find_spec, importlib.metadata.version
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: SimpleNamespace(name=name) if name == "triton" else find_spec(name, *a),
    )
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "3.3.1" if name == "triton" else version(name)
    )


def test_asking_for_triton_without_it_says_how_to_get_it(no_triton):
    with pytest.raises(
        ValueError,
        match=(
            r"`backend='triton'` cannot run: the `triton` package is not installed "
            r"\(CUDA builds of torch bring it; .*pip install 'qkmonitor\[triton\]'"
        ),
    ):
        attention(*qkv(), backend="triton")


def test_asking_for_triton_older_than_3_4_names_both_versions(old_triton):
    with pytest.raises(
        ValueError, match=r"triton 3\.3\.1 is installed and the kernels need triton >= 3\.4"
    ):
        attention(*qkv(), backend="triton")


@pytest.mark.parametrize("setup", ["no_triton", "old_triton"])
def test_auto_on_cuda_falls_back_to_torch_with_a_warning(setup, request):
    request.getfixturevalue(setup)
    q = qkv()[0]
    with pytest.warns(RuntimeWarning, match="the fused Triton kernel is not used: .*torch backend"):
        assert kernels._choose_backend("auto", cuda_like(q)) is False


def test_auto_on_cpu_runs_torch_quietly_without_triton(no_triton, recwarn):
    q, k, v = qkv()
    out = attention(q, k, v)
    reference = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4.0, dim=-1) @ v.double()
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-6)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
