"""Mixed precision and non-finite scores (docs/architecture.md, "Precision and non-finite values").

Under ``torch.autocast`` the kernels take the autocast dtype as ``F.scaled_dot_product_attention``
does and still accumulate the statistics in float32. A row whose allowed scores hold a NaN gives
NaN statistics (zeros stay reserved for fully masked rows); +inf and −inf scores follow the rules
in ``attention``'s docstring. Every backend is checked against the float64 reference of conftest.
"""

from __future__ import annotations

import math

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


# --------------------------------------------------------------------------------------------------
# non-finite scores

N_QUERIES, N_KEYS = 20, 40  # with 16-wide tiles: unmasked key tiles and a ragged tail


def corrupt(case: str, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of q (B=2, H=2, N, D) and k (B=2, H_kv=1, M, D) with non-finite scores planted."""
    q, k = q.clone(), k.clone()
    if case == "nan_query":  # one row of head 1, batch 0: every score of it is NaN
        q[0, 1, 3, 2] = math.nan
    elif case == "nan_key":  # key 35 (the ragged tail tile): rows 15..19 of batch 1 see it
        k[1, 0, 35, 0] = math.nan
    elif case == "posinf_query":  # q_i0 = +inf: scores ±inf over the keys, by the sign of k_j0
        q[0, 0, 4, 0] = math.inf
    elif case == "neginf_key":  # k_j0 = −inf with q_i0 > 0: score −inf for that key in every row
        q[..., 0] = q[..., 0].abs() + 0.1
        k[0, 0, 7, 0] = -math.inf  # batch 0: a key in the first, unmasked tile
        k[1, 0, 36, 0] = -math.inf  # batch 1: a key in the masked tail
    return q, k


def nonfinite_inputs(device):
    gen = torch.Generator().manual_seed(22)
    q = randn(gen, 2, 2, N_QUERIES, 16, device=device)
    k, v = (randn(gen, 2, 1, N_KEYS, 16, device=device) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["nan_query", "nan_key", "posinf_query", "neginf_key"])
def test_nonfinite_scores(reference, device, backend, case):
    q_clean, k_clean, v = nonfinite_inputs(device)
    q, k = corrupt(case, q_clean, k_clean)
    causal = case == "nan_key"
    out, stats = attention(
        q, k, v, causal=causal, return_stats=True, sink_tokens=3, backend=backend
    )
    ref = reference(q, k, v, causal=causal, sink_tokens=3)
    broken = ref.entropy.isnan()
    if case != "neginf_key":
        assert broken.any() and not broken.all()  # the case plants what it says
    for name in STAT_NAMES:
        value, expected = getattr(stats, name).double(), getattr(ref, name)
        if backend == "triton" and case == "neginf_key" and name == "entropy":
            # Documented: p·(t − m) = 0·(−inf) in a tile without masks makes the entropy NaN
            # there; it must never be a wrong number.
            exact = ~value.isnan()
            assert exact[1].all()  # batch 1's −inf key lies in the masked tail: exact
            value, expected = value[exact], expected[exact]
        torch.testing.assert_close(value, expected, atol=2e-5, rtol=2e-5, equal_nan=True, msg=name)
    torch.testing.assert_close(
        out[~broken].double(), ref.out[~broken], atol=2e-5, rtol=2e-5, msg="out"
    )
    if case != "neginf_key":  # the healthy rows' output is untouched by the broken ones
        clean, _ = attention(
            q_clean, k_clean, v, causal=causal, return_stats=True, sink_tokens=3, backend=backend
        )  # the same code path (without statistics the torch backend may call SDPA instead)
        torch.testing.assert_close(out[~broken], clean[~broken], atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_row_next_to_fully_masked_row(reference, device, backend):
    """NaN and "no key" stay distinguishable: NaN statistics versus zeros and −inf."""
    q, k, v = nonfinite_inputs(device)
    q[1, 0, 2, 0] = math.nan
    mask = torch.ones(2, N_KEYS, dtype=torch.bool, device=device)
    mask[0] = False  # batch 0: every row fully masked
    _, stats = attention(q, k, v, key_padding_mask=mask, return_stats=True, backend=backend)
    assert (stats.entropy[0] == 0).all() and (stats.max_prob[0] == 0).all()
    assert torch.isneginf(stats.lse[0]).all() and torch.isneginf(stats.max_logit[0]).all()
    for name in ("lse", "entropy", "max_prob", "max_logit"):
        value = getattr(stats, name)[1, 0]
        assert value[2].isnan() and not value[3:].isnan().any(), name
    assert (stats.attended[1] == N_KEYS).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_scores_backward_runs(device, backend):
    q, k, v = (x.requires_grad_() for x in nonfinite_inputs(device))
    q_bad = q.detach().clone()
    q_bad[0, 1, 3, 2] = math.nan
    q_bad.requires_grad_()
    out, _ = attention(q_bad, k, v, return_stats=True, backend=backend)
    out.sum().backward()
    # A NaN row's gradient is NaN (softmax's own); the other rows' dq are finite.
    assert q_bad.grad[0, 1, 3].isnan().any()
    healthy = torch.ones(q.shape[:3], dtype=torch.bool, device=device)
    healthy[0, 1, 3] = False
    assert torch.isfinite(q_bad.grad[healthy]).all()
