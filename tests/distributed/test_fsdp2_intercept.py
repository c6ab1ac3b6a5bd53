"""An intercepted attention module under FSDP2 (two gloo ranks that ``fully_shard`` the model):
its layout is checked against the forward although FSDP2 hands ``F.linear`` unsharded parameters
of its own, and κ and entropy_norm equal those of one process over the same sequences. Where the
attention's projections are sharded on their own, FSDP2's hooks run inside the probed attention
forward (out of the interceptor's sight, ``qkmonitor.attention.parallel_hooks``) and swap each
weight there: entropy_norm is still exact, and κ is refused by name (NaN, one warning a layer
naming the sharded projection), never read from weights the forward did not compute with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .jobs import run_script

JOB = Path(__file__).with_name("fsdp2_intercept_job.py")


def run_job(out_dir: Path, world: int, *extra: str) -> dict:
    out_dir.mkdir(parents=True)
    run_script(JOB, out_dir, world, *extra)
    return torch.load(out_dir / "values.pt")


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run_job(tmp_path_factory.mktemp("fsdp2") / "one", 1)


@pytest.mark.slow
def test_intercepted_layouts_under_fsdp2_measure_as_one_process(tmp_path, single):
    sharded = run_job(tmp_path / "two", 2)
    for name in ("kappa_at_0", "kappa", "entropy_norm"):
        for one, two in zip(single[name], sharded[name], strict=True):
            assert torch.isfinite(one).all() and torch.isfinite(two).all(), name
            torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6)
    assert [w for w in sharded["warnings"] if "qkmonitor" in w or "layout" in w] == []
    # with background_weights=True the DTensors are gathered on the training thread as before
    # (a collective, in the ranks' common order), and the worker computes the spectrum of the
    # gathered copy read after step 1 (step 0's waits for the layout check, as without it): the
    # values are the synchronous run's, bit for bit
    background = torch.load(tmp_path / "two" / "values_background.pt")
    assert (background["worker_jobs"], sharded["worker_jobs"]) == (1, 0)
    assert background["warnings"] == sharded["warnings"]
    for name in ("kappa_at_0", "kappa", "entropy_norm"):
        for want, got in zip(sharded[name], background[name], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow
def test_projections_sharded_on_their_own_measure_entropy_and_refuse_kappa_by_name(
    tmp_path, single
):
    sharded = run_job(tmp_path / "two", 2, "projections")
    for one, two in zip(single["entropy_norm"], sharded["entropy_norm"], strict=True):
        assert torch.isfinite(two).all()
        torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6)
    for name in ("kappa_at_0", "kappa"):
        assert all(torch.isnan(two).all() for two in sharded[name]), name
    refusals = [w for w in sharded["warnings"] if "sharded by FSDP2 on its own" in w]
    assert len(refusals) == 2  # one a layer, each naming its projection
    assert "'c_attn'" in refusals[0] and "blocks.0.attn" in refusals[0]
    assert "blocks.1.attn" in refusals[1]
