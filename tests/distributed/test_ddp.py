"""The monitors under Lightning DDP on CPU (gloo, 2 processes) against one process on the same
data."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from .jobs import run_script

JOB = Path(__file__).with_name("ddp_job.py")


def run_job(out_dir: Path, devices: int, batch_per_device: int, *extra: str) -> None:
    run_script(JOB, out_dir, devices, batch_per_device, *extra)


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_ddp_logs_the_same_entropy_as_one_process_and_only_rank_zero_writes(tmp_path):
    run_job(tmp_path / "single", devices=1, batch_per_device=8)
    run_job(tmp_path / "ddp", devices=2, batch_per_device=4)  # 2 x 4 = the same 8 samples per step

    versions = sorted(p.name for p in (tmp_path / "ddp" / "run").iterdir())
    assert versions == ["version_0"]  # one run directory: rank 1 wrote nothing
    assert len(list((tmp_path / "ddp" / "run" / "version_0").glob("events.out.tfevents.*"))) == 1

    single = scalars(tmp_path / "single" / "run" / "version_0")
    ddp = scalars(tmp_path / "ddp" / "run" / "version_0")
    tags = [t for t in single if t.startswith("qkmonitor/")]
    assert (
        "qkmonitor/entropy/layer_00_head_03" in tags
        and "qkmonitor/hidden_collapse/layer_01" in tags
    )
    for tag in tags:
        # step 0: the same weights, the same 8 sequences split over two ranks
        first_single, first_ddp = single[tag][0], ddp[tag][0]
        assert first_single[0] == first_ddp[0] == 0, tag
        # the rank metrics too: max_probe_sequences (4) is a total, dealt 2 + 2 over the ranks
        if tag.startswith(
            (
                "qkmonitor/entropy",
                "qkmonitor/max_",
                "qkmonitor/kappa",
                "qkmonitor/qk_",
                "qkmonitor/hidden_",
                "qkmonitor/attn_",
            )
        ):
            assert first_ddp[1] == pytest.approx(first_single[1], rel=1e-5, abs=1e-6), tag


@pytest.mark.slow
def test_qk_clip_under_ddp_scales_every_rank_alike_and_as_one_process_does(tmp_path):
    """Each rank sees half the batch, so its own largest logits differ; the clip takes the largest
    over the ranks, so both ranks scale by the same factors (their weights stay equal, bit for bit)
    and by the single process's (the same 8 sequences in one batch)."""
    import torch

    run_job(tmp_path / "single", 1, 8, "clip")
    run_job(tmp_path / "ddp", 2, 4, "clip")
    rank0, rank1 = (torch.load(tmp_path / "ddp" / f"qk_rank{r}.pt") for r in (0, 1))
    single = torch.load(tmp_path / "single" / "qk_rank0.pt")
    assert rank0.keys() == rank1.keys() == single.keys() and rank0
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
        assert torch.allclose(rank0[name], single[name], rtol=1e-4, atol=1e-6), name
    ddp = scalars(tmp_path / "ddp" / "run" / "version_0")
    one = scalars(tmp_path / "single" / "run" / "version_0")
    factor = "qkmonitor/clip_factor/layer_00_head_01"
    assert [s for s, _ in ddp[factor]] == [0, 1, 2]
    for (_, a), (_, b) in zip(ddp[factor], one[factor]):
        assert a < 1 and a == pytest.approx(b, rel=1e-4)


@pytest.mark.slow
def test_qk_monitor_under_ddp_reduces_every_probe_in_one_collective(tmp_path):
    """The entropy and rank aggregates of a probe go across the ranks together in one all_gather
    (torchmetrics would gather each state apart), and the logged values are the single process's
    on the same 8 sequences."""
    import json

    run_job(tmp_path / "single", 1, 8, "qkmonitor")
    single = scalars(tmp_path / "single" / "run" / "version_0")
    tags = [t for t in single if t.startswith("qkmonitor/") and "/alerts/" not in t]
    assert "qkmonitor/max_logit/layer_00_head_01" in tags and "qkmonitor/kappa/layer_00" in tags
    # and the same on a GPU's paths: the spectrum on its worker thread (background_weights), each
    # probe logged at the end of the next batch (defer_reads), the collectives where they were
    for mode in ("qkmonitor", "qkmonitor-background"):
        run_job(tmp_path / mode, 2, 4, mode)
        for rank in (0, 1):
            counts = json.loads((tmp_path / mode / f"collectives_rank{rank}.json").read_text())
            assert counts == {"0": {"all_gather": 1}, "2": {"all_gather": 1}}, (mode, counts)
        ddp = scalars(tmp_path / mode / "run" / "version_0")
        assert sorted(tags) == sorted(
            t for t in ddp if t.startswith("qkmonitor/") and "/alerts/" not in t
        )
        for tag in tags:
            assert [s for s, _ in ddp[tag]] == [s for s, _ in single[tag]], (mode, tag)
            for (_, got), (_, want) in zip(ddp[tag], single[tag]):
                assert got == pytest.approx(want, rel=1e-5, abs=1e-6, nan_ok=True), (mode, tag)
