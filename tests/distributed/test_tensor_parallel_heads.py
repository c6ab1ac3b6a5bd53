"""Tensor parallelism whose attention calls do not hold this rank's heads (issue 59): two gloo
ranks with different string hash seeds split tensor_parallel_job's LLaMA-style attention so that
each rank's call holds every head (q/k/v ``ColwiseParallel(output_layouts=Replicate())``, o left
whole), or views its rows with the global head count and ``-1`` (``view(b, t, self.num_heads,
-1)``: 4 "heads" of 4 features, halves of its 2 heads of 8). The monitors log the model's 4 heads,
never 8: every head of the gathered outputs is measured on every rank and equals one unsharded
process's (to 1e-5), and the halves are refused by name (NaN, one warning per layer and engine on
rank 0, naming tensor parallelism), as the spectrum refuses both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .jobs import run_script

JOB = Path(__file__).with_name("tensor_parallel_heads_job.py")
LAYERS = ("layers.0.attn", "layers.1.attn")
#: the metrics of the attention calls, per head (the hidden states' are the model's output either
#: way: the global view changes what the model computes)
PER_HEAD = {
    "entropy": ("entropy", "entropy_norm", "max_prob", "max_logit"),
    "rank": ("attn_erank", "attn_erank_norm", "attn_entropy_norm"),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tensor_parallel_heads")
    run_script(JOB, out)
    return [torch.load(out / f"values_{rank}.pt") for rank in range(2)]


def _heads(tags: list[str]) -> set[int]:
    return {int(tag.rsplit("_head_", 1)[1]) for tag in tags if "_head_" in tag}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["replicated", "replicated_named"])
def test_every_head_on_every_rank_is_measured_once_as_one_process_measures_it(ranks, case):
    for rank, runs in enumerate(ranks):
        single, split = runs[case, False], runs[case, True]
        assert not split["stopped"]
        assert split["losses"] == pytest.approx(single["losses"], abs=1e-6)
        for engine in ("entropy", "rank"):
            assert split[engine].keys() == single[engine].keys(), engine
            for name, layers in single[engine].items():
                for layer, (want, got) in enumerate(zip(layers, split[engine][name])):
                    assert got.shape == want.shape, (rank, engine, name, layer, got.shape)
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
        for engine, names in PER_HEAD.items():
            for name in names:
                assert all(t.shape == (4,) for t in split[engine][name]), (engine, name)
        said = [w for w in split["warnings"] if "not measured" in w or "non-finite" in w]
        assert said == [], said
    tags = ranks[0][case, True]["tags"]
    assert _heads(tags) == {0, 1, 2, 3}, sorted(_heads(tags))


@pytest.mark.slow
def test_a_view_of_this_ranks_rows_by_the_global_head_count_is_refused_by_name(ranks):
    for rank, runs in enumerate(ranks):
        single, split = runs["global_view", False], runs["global_view", True]
        assert not split["stopped"]
        for engine, names in PER_HEAD.items():
            for name in names:
                for want, got in zip(single[engine][name], split[engine][name], strict=True):
                    assert torch.isfinite(want).all(), (engine, name, want)
                    assert got.shape == (4,) and torch.isnan(got).all(), (rank, engine, name, got)
        refused = [w for w in split["warnings"] if "tensor parallelism" in w]
        if rank > 0:
            assert refused == [], refused
            continue
        for engine in ("AttentionEntropy", "EffectiveRank", "QKSpectrum"):
            for layer in LAYERS:
                said = [w for w in refused if w.startswith(f"{engine}: layer {layer!r}: ")]
                assert len(said) == 1, (engine, layer, refused)
                assert "4 query heads on this rank hold 4 features each" in said[0], said[0]
    tags = ranks[0]["global_view", True]["tags"]
    assert _heads(tags) == {0, 1, 2, 3}, sorted(_heads(tags))
