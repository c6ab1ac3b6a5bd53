"""Hugging Face attention under tensor parallelism (issue 42): two gloo ranks split a tiny
``LlamaForCausalLM``'s attention by heads, with a user's ``parallelize_module`` plan and with
transformers' own ``tp_plan="auto"``; each rank measures the heads its rows compute, read through
transformers' attention dispatch, and places them at their global index, so that every per-head
value of every engine (spectrum with its update and gradient metrics, entropy with sink mass,
ranks, QK-Clip with the rows it scales), and every tag rank 0 writes, equal one unsharded
process's on the same weights and data, MHA and GQA. qkmonitor's own attention split the same way
is refused by name: NaN, one warning per layer on rank 0, training goes on.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from .jobs import run_script

pytest.importorskip("transformers")

JOB = Path(__file__).with_name("hf_tensor_parallel_job.py")
ENGINES = ("spectrum", "entropy", "rank", "clip")
SPLITS = ("plan", "tp_plan")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_tensor_parallel")
    run_script(JOB, out)
    return [torch.load(out / f"values_{rank}.pt") for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_every_head_equals_one_process(ranks, kv_heads, split):
    for rank, runs in enumerate(ranks):
        single, sharded = runs[kv_heads, "whole"], runs[kv_heads, split]
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
        # QK-Clip clipped some heads, the same ones, and scaled the rows each rank holds as one
        # process scales the whole weight
        counts = [c.tolist() for c in single["clip_counts"]]
        assert any(any(layer) for layer in counts)
        assert [c.tolist() for c in sharded["clip_counts"]] == counts
        for want, got in zip(single["q_weights"], sharded["q_weights"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        said = [w for w in sharded["warnings"] if "tensor parallel" in w or "non-finite" in w]
        assert said == [], said


@pytest.mark.slow
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_rank_zero_writes_what_one_process_writes(ranks, kv_heads, split):
    """Every tag and step rank 0 writes (per head by global index, and the layer mean, min and max
    over every head) and the singular-value histograms, as one process writes them."""
    single, sharded = ranks[0][kv_heads, "whole"], ranks[0][kv_heads, split]
    assert sharded["scalars"].keys() == single["scalars"].keys()
    assert {tag for tag, _ in single["scalars"] if "_head_03" in tag}, "rank 1's heads written"
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
    assert ranks[1][kv_heads, split]["scalars"] is None  # rank 1 was given no writer


@pytest.mark.slow
def test_bundled_attention_split_is_refused_by_name(ranks):
    """qkmonitor's own attention with its heads split across ranks (its projections by rows, its
    head counts this rank's part): every value NaN, one warning per layer and engine on rank 0
    naming tensor parallelism, none on rank 1, none a "please report" one; training goes on."""
    for rank, runs in enumerate(ranks):
        run = runs["bundled"]
        assert not run["stopped"] and all(math.isfinite(x) for x in run["losses"])
        for engine in ("spectrum", "entropy", "clip"):
            for name, layers in run[engine].items():
                if name != "clip_count":  # a count of clips: none
                    assert all(bool(t.isnan().all()) for t in layers), (engine, name)
        said = [w for w in run["warnings"] if "tensor parallelism" in w]
        if rank == 0:
            for layer in ("blocks.0.attn", "blocks.1.attn"):
                mine = [w for w in said if repr(layer) in w]
                # one a layer for each engine, and the spectrum's update metrics' one
                engines = sorted(w.split(":")[0] for w in mine)
                assert engines == sorted(
                    [
                        "AttentionEntropy",
                        "EffectiveRank",
                        "QKClipEngine",
                        "QKSpectrum",
                        "QKSpectrum",
                    ]
                ), mine
                assert all("split across ranks" in w for w in mine)
        else:
            assert said == []
        assert not [w for w in run["warnings"] if "please report" in w]
