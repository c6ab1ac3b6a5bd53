"""QK-Clip across processes: FSDP2's sharded parameters (two gloo ranks that ``fully_shard`` the
model scale their row shards so that the full weights are the single process's, to float
rounding), and ranks that disagree on a layer's head count."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from qkmonitor.attention.clip import local_rows

from .jobs import run_script

JOB = Path(__file__).with_name("fsdp2_clip_job.py")


def run_job(out_dir: Path, world: int) -> dict:
    out_dir.mkdir(parents=True)
    run_script(JOB, out_dir, world)
    return torch.load(out_dir / "qk.pt")


@pytest.mark.slow
def test_qk_clip_scales_fsdp2_row_shards_as_one_process_scales_the_whole(tmp_path):
    single, sharded = run_job(tmp_path / "one", 1), run_job(tmp_path / "two", 2)
    assert all(int(c.sum()) > 0 for c in single["counts"])  # every layer was clipped
    for a, b in zip(single["counts"], sharded["counts"]):
        assert torch.equal(a, b)
    assert single["weights"].keys() == sharded["weights"].keys()
    for name, weight in single["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], weight, rtol=1e-5, atol=1e-6)


def test_a_plain_tensor_is_all_its_own_rows():
    weight = torch.ones(4, 3)
    local, start = local_rows(weight)
    assert local is weight and start == 0


@pytest.mark.slow
def test_ranks_that_disagree_on_a_layers_head_count_leave_it_alone_together(tmp_path):
    """No hang and no crash: the layer every rank counts alike is reduced (a NaN reads +inf: not
    clipped), the other is NaN on every rank and named."""
    run_script(JOB.with_name("clip_ranks_job.py"), tmp_path, timeout=120)
    for rank in (0, 1):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert out["disagree"] == [1]
        layer0, layer1 = out["reduced"]
        assert layer0.tolist() == [4.0, 5.0, math.inf]
        assert layer1.shape == ((2,) if rank == 0 else (4,)) and layer1.isnan().all()
