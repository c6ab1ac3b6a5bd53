"""An intercepted attention module under FSDP2 (two gloo ranks that ``fully_shard`` the model):
its layout is checked against the forward although FSDP2 hands ``F.linear`` unsharded parameters
of its own, and κ and entropy_norm equal those of one process over the same sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .jobs import run_script

JOB = Path(__file__).with_name("fsdp2_intercept_job.py")


def run_job(out_dir: Path, world: int) -> dict:
    out_dir.mkdir(parents=True)
    run_script(JOB, out_dir, world)
    return torch.load(out_dir / "values.pt")


@pytest.mark.slow
def test_intercepted_layouts_under_fsdp2_measure_as_one_process(tmp_path):
    single, sharded = run_job(tmp_path / "one", 1), run_job(tmp_path / "two", 2)
    for name in ("kappa_at_0", "kappa", "entropy_norm"):
        for one, two in zip(single[name], sharded[name], strict=True):
            assert torch.isfinite(one).all() and torch.isfinite(two).all(), name
            torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6)
    assert [w for w in sharded["warnings"] if "qkmonitor" in w or "layout" in w] == []
