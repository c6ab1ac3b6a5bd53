"""Tensor parallelism (two gloo ranks that ``parallelize_module`` a LLaMA-style attention:
``ColwiseParallel`` q/k/v, ``RowwiseParallel`` o) is refused by name, never measured wrong: each
rank computes half of the heads, so no per-head value of one rank is the model's (issue 42).
Training goes on as in one process; the entropy and spectrum metrics are NaN, with one warning
per layer and engine, naming tensor parallelism, on rank 0 alone. FSDP2 alone, whose forward
computes with unsharded weights, is still measured (tests/distributed/test_fsdp2_intercept.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .jobs import run_script

JOB = Path(__file__).with_name("tensor_parallel_job.py")
LAYERS = ("layers.0.attn", "layers.1.attn")


@pytest.mark.slow
def test_tensor_parallel_heads_are_refused_by_name(tmp_path):
    run_script(JOB, tmp_path)
    ranks = [torch.load(tmp_path / f"values_{rank}.pt") for rank in range(2)]
    for rank, runs in enumerate(ranks):
        for kv_heads in (4, 2):  # MHA, GQA
            single, sharded = runs[kv_heads, False], runs[kv_heads, True]
            for name in ("entropy_norm", "max_logit"):  # unsharded, every head is measured
                for values in single["entropy"][name]:
                    assert values.shape == (4,) and torch.isfinite(values).all(), name
            assert not sharded["stopped"]
            torch.testing.assert_close(
                torch.tensor(sharded["losses"], dtype=torch.float64),
                torch.tensor(single["losses"], dtype=torch.float64),
                rtol=0,
                atol=1e-6,
            )
            for engine in ("entropy", "spectrum"):
                assert sharded[engine], engine
                for name, layers in sharded[engine].items():
                    for values in layers:  # never a finite per-head number
                        assert torch.isnan(values).all(), (rank, kv_heads, engine, name, values)
            told = [w for w in sharded["warnings"] if "tensor parallel" in w]
            if rank > 0:
                assert told == [], told
                continue
            for engine, count in (("AttentionEntropy:", 1), ("QKSpectrum:", 2)):  # its layout,
                for layer in LAYERS:  # and the update metrics that read its rows
                    said = [w for w in told if w.startswith(engine) and repr(layer) in w]
                    assert len(said) == count, said
                    assert "across 2 ranks" in said[0], said[0]
                    assert "each rank computes 2 of its 4 heads" in said[0], said[0]
            assert not [w for w in sharded["warnings"] if "layout check failed" in w]
