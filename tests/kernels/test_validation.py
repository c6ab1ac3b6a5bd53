"""Bad inputs to ``qkmonitor.kernels.attention`` raise ValueError naming what was expected."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qkmonitor.kernels import attention


def qkv(device, b=1, h=4, h_kv=2, n=5, m=6, d=16, dtype=torch.float32):
    return (
        torch.randn(b, h, n, d, device=device, dtype=dtype),
        torch.randn(b, h_kv, m, d, device=device, dtype=dtype),
        torch.randn(b, h_kv, m, d, device=device, dtype=dtype),
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda q, k, v: (q[0], k, v), r"`q` of shape \(B, H, N, D\), got 3 dims"),
        (lambda q, k, v: (q, k[0], v), r"`k` of shape \(B, H_kv, M, D\), got 3 dims"),
        (lambda q, k, v: (q.double(), k, v), r"`k` of q's dtype torch.float64, got torch.float32"),
        (lambda q, k, v: (q, k, v.half()), r"`v` of q's dtype torch.float32, got torch.float16"),
        (lambda q, k, v: (q.long(), k.long(), v.long()), r"`q` of dtype float16, bfloat16"),
        (lambda q, k, v: (q, k, v[:, :, :3]), r"`k` and `v` of the same shape"),
        (lambda q, k, v: (q[:, :3], k, v), r"H_kv to divide the query heads H, got H=3, H_kv=2"),
        (
            lambda q, k, v: (q, k[:, :0], v[:, :0]),
            r"H_kv to divide the query heads H, got H=4, H_kv=0",
        ),
        (lambda q, k, v: (q.expand(2, -1, -1, -1), k, v), r"q's batch size 2, got 1"),
        (lambda q, k, v: (q[..., :8], k, v), r"q's head dim 8, got 16"),
        (lambda q, k, v: ("q", k, v), r"`q` to be a torch.Tensor, got str"),
    ],
)
def test_bad_tensors(device, change, match):
    with pytest.raises(ValueError, match=match):
        attention(*change(*qkv(device)), backend="torch")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"key_padding_mask": torch.ones(1, 5, dtype=torch.bool)},
            r"`key_padding_mask` of shape \(B, M\) = \(1, 6\), got \(1, 5\)",
        ),
        (
            {"key_padding_mask": torch.zeros(1, 6)},
            r"`key_padding_mask` to be a bool tensor \(True = key may be attended\), got torch\.f",
        ),
        (
            {"key_padding_mask": [[True] * 6]},
            r"`key_padding_mask` to be a \(B, M\) bool tensor, got list",
        ),
        ({"scale": float("nan")}, r"`scale` to be a finite float or None, got nan"),
        ({"scale": "1"}, r"`scale` to be a finite float or None"),
        ({"sink_tokens": -1}, r"`sink_tokens` to be a non-negative int, got -1"),
        ({"sink_tokens": 1.5}, r"`sink_tokens` to be a non-negative int, got 1.5"),
        ({"causal": 1}, r"`causal` to be a bool, got 1"),
        ({"return_stats": "yes"}, r"`return_stats` to be a bool, got 'yes'"),
        ({"backend": "cuda"}, r"`backend` to be one of \('auto', 'triton', 'torch'\), got 'cuda'"),
    ],
)
def test_bad_options(device, kwargs, match):
    if isinstance(kwargs.get("key_padding_mask"), torch.Tensor):
        kwargs = {**kwargs, "key_padding_mask": kwargs["key_padding_mask"].to(device)}
    with pytest.raises(ValueError, match=match):
        attention(*qkv(device), **kwargs)


def test_triton_rejects_what_it_cannot_run(device):
    with pytest.raises(ValueError, match=r"head dim D ≤ 256 for `backend='triton'`, got 288"):
        attention(*qkv(device, d=288), backend="triton")
    with pytest.raises(
        ValueError, match=r"float16, bfloat16 or float32 inputs for `backend='triton'`"
    ):
        attention(*qkv(device, dtype=torch.float64), backend="triton")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"CPU tensors only under the Triton interpreter"):
        attention(*qkv("cpu"), backend="triton")


def test_auto_uses_torch_on_cpu_and_float64_works_there():
    q, k, v = qkv("cpu", dtype=torch.float64)
    out = attention(q, k, v)  # auto → torch on CPU, the only backend that takes float64
    assert out.dtype == torch.float64


def test_import_does_not_import_triton():
    # Lazy import: a machine without triton can import the package, and a test's conftest can set
    # TRITON_INTERPRET before triton is first imported.
    code = "import sys, qkmonitor.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=_env_with_package_path())


def _env_with_package_path():
    import os
    from pathlib import Path

    import qkmonitor.kernels

    root = Path(qkmonitor.kernels.__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env
