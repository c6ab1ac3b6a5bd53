"""FSDP2 over tensor parallelism through Lightning (issue 42): ``ModelParallelStrategy`` on two gloo
CPU ranks, a 1 x 2 mesh (one data-parallel rank, two tensor-parallel ones) whose
``configure_model`` ``parallelize_module``s a LLaMA-style attention (``ColwiseParallel`` q/k/v,
``RowwiseParallel`` o) and ``fully_shard``s it, with the README's ``QKMonitor`` and ``QKClip``:
every scalar rank 0 writes (the loss, every engine's per-head values with the update and gradient
metrics, the layer means, minima and maxima, QK-Clip's) equals a one-process fit's of the same
model, weights and data, and the query and key weights QK-Clip scaled end equal, MHA and GQA (its
attention naming its head counts, so that its layout check gathers both projections: the ranks,
started with different string hash seeds, aborted when they gathered them in a set's order, issue
59)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from .jobs import run_script

JOB = Path(__file__).with_name("model_parallel_job.py")
#: the warnings qkmonitor's engines give (the others are torch's and Lightning's)
OURS = re.compile(r"(QKSpectrum|AttentionEntropy|EffectiveRank|QKClipEngine)\b")


def scalars(run_dir: Path) -> dict[tuple[str, int], float]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


@pytest.fixture(scope="module", params=[(4, ()), (2, ("named",))], ids=["mha", "gqa_named"])
def fits(request, tmp_path_factory):
    kv_heads, named = request.param
    out = tmp_path_factory.mktemp(f"model_parallel_{kv_heads}")
    run_script(JOB, out, kv_heads, *named, timeout=120)
    return out


@pytest.mark.slow
def test_rank_zero_writes_what_one_process_writes(fits):
    runs = sorted(p.name for p in (fits / "parallel").iterdir())
    assert runs == ["version_0"]  # rank 1 wrote no run of its own
    single = scalars(fits / "single" / "version_0")
    parallel = scalars(fits / "parallel" / "version_0")
    assert parallel.keys() == single.keys()
    tags = {tag for tag, _ in single}
    for needed in (
        "train_loss",
        "qkmonitor/q_update_ratio/layer_00_head_03",  # a head rank 1 computes
        "qkmonitor/k_grad_norm/layer_01_head_03",
        "qkmonitor/qk_update_entropy/layer_01_head_03",  # the update's spectrum: rank 1's too
        "qkmonitor/entropy/layer_01_head_03",
        "qkmonitor/clip_factor/layer_00_head_03",
    ):
        assert needed in tags, needed
    finite = 0
    for key, want in single.items():
        got = parallel[key]
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6) or (
            math.isnan(want) and math.isnan(got)
        ), (key, want, got)
        finite += math.isfinite(want)
    assert finite > 0.8 * len(single)
    factors = [v for (tag, _), v in single.items() if tag.startswith("qkmonitor/clip_factor/")]
    assert min(factors) < 1  # some heads were clipped: the weights below show where


@pytest.mark.slow
def test_qk_clip_scales_the_rows_each_rank_holds_as_one_process_scales_them(fits):
    single = torch.load(fits / "single_rank0.pt")
    ranks = [torch.load(fits / f"parallel_rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["weights"].keys() == single["weights"].keys()
    for name, want in single["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][name], want, rtol=1e-5, atol=1e-6)
    ours = [w for w in single["warnings"] if OURS.match(w)]
    assert [w for w in ranks[0]["warnings"] if OURS.match(w)] == ours, "rank 0 warns as one"
    assert [w for w in ranks[1]["warnings"] if OURS.match(w)] == []
