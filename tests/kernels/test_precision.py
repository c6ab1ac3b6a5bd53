"""Mixed precision and non-finite scores (DESIGN.md, "Precision and non-finite values").

Under ``torch.autocast`` the kernels take the autocast dtype as ``F.scaled_dot_product_attention``
does and still accumulate the statistics in float32. A row whose allowed scores hold a NaN gives
NaN statistics (zeros stay reserved for fully masked rows); +inf and −inf scores follow the rules
in ``attention``'s docstring. Every backend is checked against the float64 reference of conftest.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkmonitor.kernels import attention

BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=pytest.mark.slow),
]
STAT_NAMES = ("lse", "entropy", "max_prob", "max_logit", "attended", "sink_mass")


def randn(gen, *shape, device, dtype=torch.float32, spread=1.0):
    return (torch.randn(*shape, generator=gen) * spread).to(device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# autocast


def normalized_entropy(entropy: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """``H / log n`` on rows with more than one allowed key (others have no spread to measure)."""
    return entropy[attended > 1] / attended[attended > 1].log()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "input_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["in32", "in-bf16", "in16"]
)
def test_statistics_under_autocast(reference, device, backend, autocast_dtype, input_dtype):
    gen = torch.Generator().manual_seed(20)
    batch, heads, kv_heads, n, d = 2, 4, 2, 29, 16
    q = randn(gen, batch, heads, n, d, device=device, dtype=input_dtype, spread=1.5)
    k, v = (randn(gen, batch, kv_heads, n, d, device=device, dtype=input_dtype) for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    mask = (torch.rand(batch, n, generator=gen) > 0.2).to(device)
    mask[:, -1] = True  # the last row sees at least its own key
    with torch.autocast(device, dtype=autocast_dtype):
        out, stats = attention(
            q, k, v, causal=True, key_padding_mask=mask, return_stats=True, sink_tokens=3,
            backend=backend,
        )  # fmt: skip
        sdpa_dtype = F.scaled_dot_product_attention(q[:, :1], q[:, :1], q[:, :1]).dtype
        out.float().square().sum().backward()  # the backward runs under autocast too
    ref = reference(
        q.detach(), k.detach(), v.detach(), causal=True, key_padding_mask=mask, sink_tokens=3
    )
    assert out.dtype == sdpa_dtype == autocast_dtype
    live = stats.attended > 0
    for name in STAT_NAMES:
        value = getattr(stats, name)
        assert value.dtype == torch.float32, name
        assert torch.isfinite(value[live]).all(), name
    torch.testing.assert_close(stats.attended.double(), ref.attended, atol=0, rtol=0)
    torch.testing.assert_close(
        normalized_entropy(stats.entropy.double(), ref.attended),
        normalized_entropy(ref.entropy, ref.attended),
        atol=0.05,
        rtol=0,
    )
    for name in ("max_prob", "sink_mass"):
        torch.testing.assert_close(
            getattr(stats, name)[live].double(), getattr(ref, name)[live], atol=0.05, rtol=0
        )
    for x in (q, k, v):
        assert x.grad.dtype == input_dtype and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_off_keeps_input_dtype(device, backend):
    """Outside autocast nothing is cast: float32 in, float32 out (SDPA agrees)."""
    gen = torch.Generator().manual_seed(21)
    q, k, v = (randn(gen, 1, 2, 17, 16, device=device) for _ in range(3))
    with torch.autocast(device, dtype=torch.bfloat16, enabled=False):
        out = attention(q, k, v, backend=backend)
    assert out.dtype == F.scaled_dot_product_attention(q, k, v).dtype == torch.float32
