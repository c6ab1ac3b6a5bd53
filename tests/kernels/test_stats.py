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
