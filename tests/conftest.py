"""Shared by every test folder: the float64 attention reference, the ``gpu`` marker's skip,
``leftovers``: what a probe could have left on a model, ``train_recall_miniature``: the
instability miniature of ``benchmarks/miniature.py``, and ``read_only_dir``: a folder on a
read-only mount.

``reference_attention`` is what the kernel tests (``tests/kernels``, and ``tests/gpu`` on CUDA)
trust. Tests marked ``gpu`` are skipped, with the reason, where no CUDA device is visible; run
them with ``pytest -m gpu`` on a GPU machine (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import errno
import importlib.util
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass(frozen=True)
class Reference:
    """Naive float64 attention, every (B, H, N) statistic, from the full (B, H, N, M) matrix."""

    out: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor
    max_prob: torch.Tensor
    max_logit: torch.Tensor
    attended: torch.Tensor
    sink_mass: torch.Tensor


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    sink_tokens: int = 0,
) -> Reference:
    """Attention by the definition, in float64, forming P explicitly.

    ``allowed[b, h, i, j]`` = key_padding_mask[b, j] and (not causal or j ≤ i + M − N);
    ``p_ij = exp(s_ij) / Σ_{allowed} exp(s_ij')`` with ``s = scale · q kᵀ``; a row with nothing
    allowed has p = 0, out = 0, lse = max_logit = −inf. Non-finite scores on allowed keys follow
    the kernel's contract: a NaN makes every statistic of the row NaN; otherwise a +inf makes
    ``lse = max_logit = +inf`` and entropy, max_prob, sink_mass NaN; a −inf is probability 0. The
    output of such a NaN/+inf row is NaN here (the kernels may give anything non-finite there).
    Differentiable in q, k, v (its gradient is the reference for the kernels' backward).
    """
    q, k, v = q.double(), k.double(), v.double()
    batch, heads, n, d = q.shape
    m = k.shape[2]
    groups = heads // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = scale * q @ k.transpose(-1, -2)  # (B, H, N, M)
    allowed = torch.ones(batch, heads, n, m, dtype=torch.bool, device=q.device)
    if causal:
        rows = torch.arange(n, device=q.device)[:, None]
        cols = torch.arange(m, device=q.device)[None, :]
        allowed = allowed & (cols <= rows + (m - n))
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.bool()[:, None, None, :]
    with torch.no_grad():
        has_nan = (s.isnan() & allowed).any(dim=-1)  # (B, H, N)
        has_inf = (torch.isposinf(s) & allowed).any(dim=-1) & ~has_nan
    broken = has_nan | has_inf
    # The healthy rows by the formula; broken rows are computed on zeros and overwritten below.
    s = torch.where(broken[..., None], 0.0, s).masked_fill(~allowed, -math.inf)
    row_max = s.amax(dim=-1, keepdim=True) if m > 0 else s.new_full((batch, heads, n, 1), -math.inf)
    shift = torch.where(torch.isinf(row_max), 0.0, row_max).detach()  # any shift is exact
    e = torch.exp(s - shift)
    z = e.sum(dim=-1, keepdim=True)
    has_keys = z > 0
    p = torch.where(has_keys, e / torch.where(has_keys, z, 1.0), 0.0)
    out = torch.where(broken[..., None], math.nan, p @ v)
    with torch.no_grad():
        plogp = torch.where(p > 0, p * torch.log(torch.where(p > 0, p, 1.0)), 0.0)
        lse = torch.where(has_keys, shift + torch.log(torch.where(has_keys, z, 1.0)), -math.inf)
        lse, row_max = lse.squeeze(-1), row_max.squeeze(-1)
        max_prob = p.amax(dim=-1) if m > 0 else torch.zeros_like(lse)

        def nan_where_broken(x):
            return torch.where(broken, math.nan, x)

        return Reference(
            out=out,
            lse=torch.where(has_inf, math.inf, nan_where_broken(lse)),
            entropy=nan_where_broken(-plogp.sum(dim=-1)),
            max_prob=nan_where_broken(max_prob),
            max_logit=torch.where(has_inf, math.inf, nan_where_broken(row_max)),
            attended=allowed.sum(dim=-1).double(),
            sink_mass=nan_where_broken(p[..., :sink_tokens].sum(dim=-1)),
        )


@pytest.fixture(scope="session")
def reference():
    """:func:`reference_attention`, for test modules (conftest is not importable from them)."""
    return reference_attention


def probe_leftovers(model: torch.nn.Module) -> list[str]:
    """Everything a probe could have left on the model, named; empty when clean."""
    left = []
    for name, module in model.named_modules():
        if module._forward_pre_hooks or module._forward_hooks:
            left.append(f"hooks on {name!r}")
        if getattr(module, "probing", False):
            left.append(f"observers on {name!r}")
        if "_qkmonitor_route" in module.__dict__:
            left.append(f"route on {name!r}")
        if "_qkmonitor_installs" in module.__dict__ or "__getstate__" in module.__dict__:
            left.append(f"installs ledger on {name!r}")
        if getattr(module.__dict__.get("forward"), "__qkmonitor_switch__", None) is not None:
            left.append(f"switched forward on {name!r}")
        config = module.__dict__.get("config")
        if config is not None and "_qkmonitor_original_attn_implementation" in config.__dict__:
            left.append(f"probe config on {name!r}")
    if torch._C._len_torch_function_stack():
        left.append(f"{torch._C._len_torch_function_stack()} torch function mode(s) still entered")
    return left


@pytest.fixture
def leftovers():
    """:func:`probe_leftovers`, for the failure-path tests."""
    return probe_leftovers


@pytest.fixture
def read_only_dir(tmp_path):
    """An empty folder on a read-only file system (a tmpfs mounted read-only there, unmounted
    after the test): every write under it fails with EROFS, also as root, where chmod stops
    none. Skipped, with the reason, where no mount can be made (not root, no mount permission in
    a container)."""
    path = tmp_path / "read-only"
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a read-only mount needs root and mount(8); neither a chmod nor a fake is one")
    command = ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "qkmonitor-test", str(path)]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"no read-only mount can be made here ({done.stderr.strip()})")
    try:
        try:
            (path / "written").touch()
        except OSError as err:
            if err.errno != errno.EROFS:
                raise
        else:
            pytest.skip(f"the mount at {path} took a write: not read-only here")
        yield path
    finally:
        if subprocess.run(["umount", str(path)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it is given and the calls of them, and
    runs them unchanged (as the ``"eager"`` backend does)."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return graph_module.forward(*args)

        return run


@pytest.fixture(scope="session")
def train_recall_miniature():
    """``benchmarks/miniature.py``'s ``train_recall_miniature``: a run that drives the monitors, so
    it lives beside the scripts that run it, not in ``qkmonitor.models`` (docs/architecture.md,
    "Layers")."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "miniature.py"
    spec = importlib.util.spec_from_file_location("miniature", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.train_recall_miniature


@pytest.fixture
def counting_backend():
    """A new :class:`CountingBackend` for each call."""
    return CountingBackend
