"""Context parallelism (two gloo ranks that run each step inside torch's ``context_parallel``: the
sequence split over the ranks, SDPA handed DTensors sharded along it) is refused by name, never
measured from part of the keys (issue 42): each row's softmax is over keys both ranks hold. Training
goes on as in one process; the entropy metrics are NaN, with one warning per layer, naming context
parallelism, on rank 0 alone; so are the rank monitor's, whose hidden states are each rank's part of
the sequence (issue 59), with one warning a run; kappa, a property of the weights, is read as in one
process on every rank (its layout checked at sequence position 0, RoPE's identity, as the first rank
computed it)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from .jobs import run_script

JOB = Path(__file__).with_name("context_parallel_job.py")
LAYERS = ("layers.0.attn", "layers.1.attn")


@pytest.mark.slow
def test_context_parallel_keys_are_refused_by_name_and_kappa_is_read(tmp_path):
    start = time.perf_counter()
    run_script(JOB, tmp_path)
    assert time.perf_counter() - start < 60
    ranks = [torch.load(tmp_path / f"values_{rank}.pt") for rank in range(2)]
    for rank, runs in enumerate(ranks):
        single, split = runs[False], runs[True]
        for name in ("entropy_norm", "max_logit"):  # one process: every head is measured
            for values in single["entropy"][name]:
                assert values.shape == (4,) and torch.isfinite(values).all(), name
        assert not split["stopped"]
        torch.testing.assert_close(
            torch.tensor(split["losses"], dtype=torch.float64),
            torch.tensor(single["losses"], dtype=torch.float64),
            rtol=0,
            atol=1e-5,
        )
        assert split["entropy"]
        for name, layers in split["entropy"].items():
            for values in layers:  # never a number from this rank's part of the keys
                assert torch.isnan(values).all(), (rank, name, values)
        for name in ("kappa", "kappa_eig"):
            for got, want in zip(split["spectrum"][name], single["spectrum"][name], strict=True):
                assert torch.isfinite(got).all(), (rank, name, got)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # the rank monitor: its attention metrics refused with the calls, and the hidden states
        # too, which are this rank's half of each sequence (issue 59: 5.66 for one process's 9.43)
        for name in ("hidden_erank", "hidden_collapse"):
            for values in single["rank"][name]:
                assert torch.isfinite(values).all(), (name, values)
        assert split["rank"].keys() == single["rank"].keys()
        for name, layers in split["rank"].items():
            for values in layers:  # never a number from this rank's part of the sequence
                assert torch.isnan(values).all(), (rank, name, values)
        hidden = [w for w in split["warnings"] if "hidden_erank" in w]
        told = [
            w
            for w in split["warnings"]
            if "context parallelism" in w and w.startswith("AttentionEntropy")
        ]
        assert not [w for w in split["warnings"] if "layout" in w], split["warnings"]
        assert not [w for w in split["warnings"] if "non-finite" in w], split["warnings"]
        if rank > 0:
            assert told == hidden == [], told + hidden
            continue
        assert len(hidden) == 1, hidden  # one warning a run, naming the layers and why
        assert hidden[0].startswith(f"EffectiveRank: layer(s) {list(LAYERS)}: "), hidden
        assert "(context parallelism" in hidden[0] and "hidden_collapse" in hidden[0], hidden
        for layer in LAYERS:
            said = [w for w in told if repr(layer) in w]
            assert len(said) == 1, said
            assert said[0].startswith(f"AttentionEntropy: layer {layer!r}: its keys are split "), (
                said
            )
            assert "across 2 ranks (context parallelism" in said[0], said[0]
            assert "entropy not measured" in said[0], said[0]
