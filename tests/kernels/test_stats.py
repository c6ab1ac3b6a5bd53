"""``attended_keys`` (the count behind ``AttentionStats.attended``) against an explicit mask."""

from __future__ import annotations

import pytest
import torch

from qkmonitor.kernels import attended_keys


def explicit_count(b, h, n, m, causal, mask):
    allowed = torch.ones(b, h, n, m, dtype=torch.bool)
    if causal:
        allowed &= torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n)
    if mask is not None:
        allowed &= mask[:, None, None, :]
    return allowed.sum(-1).float()


@pytest.mark.parametrize("n, m", [(7, 7), (3, 9), (9, 3), (1, 1), (4, 0)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_attended_keys(n, m, causal, with_mask):
    mask = torch.rand(2, m, generator=torch.Generator().manual_seed(n * 10 + m)) > 0.4
    mask = mask if with_mask else None
    counts = attended_keys(
        2, 3, n, m, causal=causal, key_padding_mask=mask, device=torch.device("cpu")
    )
    assert counts.dtype == torch.float32 and counts.shape == (2, 3, n)
    torch.testing.assert_close(counts, explicit_count(2, 3, n, m, causal, mask), atol=0, rtol=0)


@pytest.mark.parametrize("runs", [1, 3, 8])
def test_statistics_in_parts_of_the_batch_are_those_of_the_whole(monkeypatch, runs):
    """The CPU path cuts a large batch into parts that fit the caches, and causal rows into runs
    that stop at their diagonal; every statistic is the same number as from the whole batch and
    every key at once (causal, padding, grouped heads, sink mass): parts of the batch bit for bit,
    runs of rows to the rounding of sums over fewer (masked, zero) terms."""
    import qkmonitor.kernels._torch_forward as backend
    from qkmonitor.kernels import attention_stats

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 24, 8, generator=gen)
    k = torch.randn(5, 2, 24, 8, generator=gen)
    pad = torch.rand(5, 24, generator=gen) > 0.2
    pad[:, 0] = True
    cases = [
        (q, {"causal": True, "sink_tokens": 2}),
        (q, {"key_padding_mask": pad}),
        (q[:, :, :19], {"causal": True, "key_padding_mask": pad}),  # M > N: the diagonal shifted
    ]
    # parts of a quarter of a sequence's scores: `runs` runs (of 20 parts), each over parts of
    # the batch (one sequence whole, two of a run of 8)
    monkeypatch.setattr(backend, "_SCORES_PER_PART", 4 * 24 * 24 // 4)
    monkeypatch.setattr(backend, "_CAUSAL_ROW_RUNS", runs)
    parts = [attention_stats(x, k, backend="torch", **case) for x, case in cases]
    monkeypatch.setattr(backend, "_SCORES_PER_PART", 1 << 40)
    monkeypatch.setattr(backend, "_CAUSAL_ROW_RUNS", 1)
    whole = [attention_stats(x, k, backend="torch", **case) for x, case in cases]
    for a, b in zip(parts, whole):
        for name in ("lse", "entropy", "max_prob", "max_logit", "attended", "sink_mass"):
            x, y = getattr(a, name, None), getattr(b, name, None)
            assert (x is None) == (y is None), name
            if x is not None and runs == 1:
                assert torch.equal(x, y), name
            elif x is not None:
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, equal_nan=True, msg=name)
