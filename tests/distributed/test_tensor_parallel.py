"""Tensor parallelism (two gloo ranks that ``parallelize_module`` a LLaMA-style attention:
``ColwiseParallel`` q/k/v, ``RowwiseParallel`` o) is measured exactly (issue 42): each rank computes
half of the heads, measures those and places them at their global index, so that every per-head
value of every engine (spectrum with its update and gradient metrics, entropy with sink mass, ranks,
QK-Clip with the rows it scales), every layer mean, min and max, and the output logits' channels
(the vocabulary projection split across the ranks too, the logits a DTensor under loss parallelism)
equal one unsharded process's on the same weights and data, MHA, GQA and MQA (its one key/value
head replicated on both ranks, its gradient summed over them as Megatron does), and GQA with its
head counts named (its layout checked on both projections gathered whole). The unsharded run is
the reference: the same job with the model left whole (every rank alike). The ranks start with
different string hash seeds, as torchrun's do: gathering the named layer's projections in a set's
order aborted them (issue 59).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from .jobs import run_script
from .tensor_parallel_job import CASES

JOB = Path(__file__).with_name("tensor_parallel_job.py")
ENGINES = ("spectrum", "entropy", "rank", "clip")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tensor_parallel")
    run_script(JOB, out)
    return [torch.load(out / f"values_{rank}.pt") for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_every_head_equals_one_process(ranks, case):
    for rank, runs in enumerate(ranks):
        single, sharded = runs[case, False], runs[case, True]
        assert not sharded["stopped"]
        torch.testing.assert_close(
            torch.tensor(sharded["losses"], dtype=torch.float64),
            torch.tensor(single["losses"], dtype=torch.float64),
            rtol=0,
            atol=1e-6,
        )
        for engine in ENGINES:
            assert sharded[engine].keys() == single[engine].keys(), engine
            for name, layers in single[engine].items():
                for layer, (want, got) in enumerate(zip(layers, sharded[engine][name])):
                    assert _close(want, got), (rank, engine, name, layer, want, got)
        # the output logits, their vocabulary split across the ranks (a DTensor, loss parallel)
        assert (
            sharded["run"].keys()
            == single["run"].keys()
            == {
                "output_lse_rms",
                "output_logit_max",
            }
        )
        for name, want in single["run"].items():
            assert math.isclose(sharded["run"][name], want, rel_tol=1e-5), (name, want)
        # QK-Clip clipped some heads (the bound is below their logits), the same ones, and
        # scaled the rows each rank holds as one process scales the whole weight
        counts = [c.tolist() for c in single["clip_counts"]]
        assert any(any(layer) for layer in counts)
        assert [c.tolist() for c in sharded["clip_counts"]] == counts
        for want, got in zip(single["q_weights"], sharded["q_weights"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        # what crosses the ranks at a probe step after the first (the first also picks where
        # the output logits come from): every engine's values in one all_gather (the spectrum's
        # split heads with the activation monitors' sums), one more for the output logits'
        # split vocabulary, and QK-Clip's two all_reduces, as without tensor parallelism
        assert single["collectives"][1] == {"all_gather": 1, "all_reduce": 2}
        assert sharded["collectives"][1] == {"all_gather": 2, "all_reduce": 2}
        said = [w for w in sharded["warnings"] if "tensor parallel" in w or "non-finite" in w]
        assert said == [], said


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_rank_zero_writes_what_one_process_writes(ranks, case):
    """Every tag and step rank 0 writes (per head by global index, and the layer mean, min and max
    over every head) and the singular-value histograms, as one process writes them."""
    single, sharded = ranks[0][case, False], ranks[0][case, True]
    assert sharded["scalars"].keys() == single["scalars"].keys()
    heads = {tag for tag, _ in single["scalars"] if "_head_03" in tag}
    assert heads, "per-head tags of the fourth head (held by rank 1) are written"
    finite = 0
    for key, want in single["scalars"].items():
        got = sharded["scalars"][key]
        assert math.isclose(want, got, rel_tol=1e-5, abs_tol=1e-6) or (
            math.isnan(want) and math.isnan(got)
        ), (key, want, got)
        finite += math.isfinite(want)
    assert finite > 0.8 * len(single["scalars"])
    assert [(t, s) for t, _, s in sharded["histograms"]] == [
        (t, s) for t, _, s in single["histograms"]
    ]
    for (_, want, _), (_, got, _) in zip(single["histograms"], sharded["histograms"]):
        assert _close(want.sort().values, got.sort().values)
    assert ranks[1][case, True]["scalars"] is None  # rank 1 was given no writer


@pytest.mark.slow
def test_the_spectrum_on_its_worker_under_tensor_parallelism_is_the_synchronous_paths(ranks):
    """background_weights=True: each rank's heads are computed on the worker from a copy of the
    rows it computes with (no collective there) and exchanged in the probe's one all_gather, as
    on the training thread: every value, scalar, histogram and collective is the synchronous
    run's."""
    for rank, runs in enumerate(ranks):
        synchronous, background = runs["mha", True], runs["mha", "background"]
        assert background["worker_jobs"] > 0 and synchronous["worker_jobs"] == 0
        assert background["collectives"] == synchronous["collectives"]
        assert background["warnings"] == synchronous["warnings"]
        for engine in ENGINES:
            for name, layers in synchronous[engine].items():
                for want, got in zip(layers, background[engine][name], strict=True):
                    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        if rank == 0:
            assert background["scalars"].keys() == synchronous["scalars"].keys()
            for key, want in synchronous["scalars"].items():
                got = background["scalars"][key]
                assert got == want or (math.isnan(got) and math.isnan(want)), key
            assert len(background["histograms"]) == len(synchronous["histograms"])
