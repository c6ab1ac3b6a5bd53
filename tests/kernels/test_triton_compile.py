"""Every Triton kernel configuration autotuning may pick, built for sm_90 and sm_80 without a GPU.

Runs ``scripts/compile_kernels.py`` (its docstring says what is built and why that set covers the
search space): the real Triton compiler and the ``ptxas`` shipped in the ``triton`` wheel, for
``GPUTarget("cuda", 90, 64)`` and ``GPUTarget("cuda", 80, 32)``. A build fails the test on a
compile error, on shared memory above the target's opt-in limit (227 KiB, 163 KiB) or above
``smem_bytes``' estimate (which pruning trusts), or on any register spill: the bound is 0 bytes,
since a spill in a FlashAttention tile spills the accumulators the inner loop touches every
iteration, and every tile that spilled was pruned or re-tiled instead (``_triton.tuning``).

The script runs in a subprocess: the kernels must be built as GPU kernels, which the
interpreter flag (set for this test session by the conftest) would prevent. About 100 builds,
hence the ``slow`` marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", minversion="3.4")  # the kernel's own bound (pyproject)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compile_kernels.py"


def test_ptxas_ships_with_triton():
    """The compile needs ptxas; the wheel carries it (a missing one is a broken install, not a
    reason to skip)."""
    import inspect

    from triton.backends.nvidia.compiler import get_ptxas

    takes_arch = bool(inspect.signature(get_ptxas).parameters)  # triton >= 3.5 picks ptxas per arch
    for arch in (80, 90):
        path = Path((get_ptxas(arch) if takes_arch else get_ptxas()).path)
        assert path.is_file() and os.access(path, os.X_OK), f"no ptxas for sm_{arch} at {path}"


@pytest.mark.slow
def test_every_autotuned_tile_compiles_for_sm90_and_sm80(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    report = tmp_path / "builds.json"
    jobs = str(min(2, os.cpu_count() or 1))
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "90", "80", "--jobs", jobs, "--json", str(report)],
        env=env, capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    assert report.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    builds = json.loads(report.read_text())
    kernels = {(b["arch"], b["kernel"]) for b in builds}
    assert kernels == {(a, k) for a in (90, 80) for k in ("fwd", "dkdv", "dq", "delta")}
    failing = [
        f"sm_{b['arch']} {b['kernel']} {b['variant']} {b['config']}: {'; '.join(b['problems'])}"
        for b in builds
        if b["problems"]
    ]
    assert not failing, "\n".join(failing)
    assert run.returncode == 0, run.stderr[-3000:]
    for build in builds:  # the script's verdict, checked on the numbers themselves
        assert build["spill_stores"] == build["spill_loads"] == 0, build
        assert build["smem"] <= build["smem_limit"], build
