"""The Triton kernels compiled for the GPU (not interpreted), on CUDA.

Against ``F.scaled_dot_product_attention`` in the same dtype, forward and backward: the kernel's
error from the float64 reference may be at most twice SDPA's own plus one unit of the dtype's
precision (SDPA is the yardstick of what the dtype allows). The statistics, and the non-finite
contract (the GPU's max drops NaN where the interpreter's numpy keeps it), against the float64
reference. Autotuned tile sizes are exercised by lengths above 128 (below, one tile is used).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qkmonitor.kernels import attention

pytestmark = pytest.mark.gpu

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
STATS_TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}


def cuda_inputs(seed, batch, heads, kv_heads, n, m, d, dtype, spread=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        x = torch.randn(*shape, generator=gen, device="cuda") * spread
        return x.to(dtype).requires_grad_()

    return randn(batch, heads, n, d), randn(batch, kv_heads, m, d), randn(batch, kv_heads, m, d)


def max_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    return (x.double() - reference).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [128, 1000, 4096])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_against_sdpa(reference, dtype, d, n, causal):
    batch, heads = max(1, 4096 // n), 4
    q, k, v = cuda_inputs(n + d, batch, heads, heads, n, n, d, dtype)
    dout = torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(1),
                       device="cuda").to(dtype)  # fmt: skip
    ours = attention(q, k, v, causal=causal, backend="triton")
    ours_grads = torch.autograd.grad(ours, (q, k, v), dout)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    sdpa_grads = torch.autograd.grad(sdpa, (q, k, v), dout)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = reference(*leaves, causal=causal)
    ref_grads = torch.autograd.grad(ref.out, leaves, dout.double())
    assert ours.dtype == dtype and all(g.dtype == dtype for g in ours_grads)
    unit = torch.finfo(dtype).eps
    for name, x, yardstick, r in [("out", ours, sdpa, ref.out.detach())] + [
        (f"d{name}", g, s, r) for name, g, s, r in zip("qkv", ours_grads, sdpa_grads, ref_grads)
    ]:
        scale = max(r.abs().max().item(), 1.0)
        allowed = 2 * max_error(yardstick, r) + unit * scale
        assert max_error(x, r) <= allowed, (name, max_error(x, r), max_error(yardstick, r))


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    "dtype, n, m, d, heads, kv_heads, causal, padded, sink",
    [
        # tuned tiles (a sequence above 128), in variants gpu_check.sh builds ahead
        (BF16, 1000, 1000, 64, 4, 4, True, False, 0),
        (FP16, 1500, 1500, 128, 4, 4, False, False, 0),
        # one tile (sequences of at most 128): the other constexpr variants and float32
        (FP32, 128, 128, 80, 4, 1, False, True, 4),  # MQA, a head dim padded to 128
        (BF16, 100, 128, 128, 8, 2, True, True, 4),  # GQA, cross lengths, key padding
        (FP16, 64, 128, 64, 4, 4, False, False, 4),
    ],
    ids=["bf16-tuned", "fp16-tuned", "fp32-mqa-d80", "bf16-gqa-pad", "fp16-sink"],
)
def test_statistics_against_float64(reference, dtype, n, m, d, heads, kv_heads, causal, padded,
                                    sink):  # fmt: skip
    q, k, v = cuda_inputs(n + m, 2, heads, kv_heads, n, m, d, dtype, spread=1.5)
    mask = None
    if padded:
        mask = torch.rand(2, m, generator=torch.Generator().manual_seed(m)) > 0.25
        mask[0, m // 2 :] = False  # batch 0: a long padded tail, as in a real batch
        mask = mask.cuda()
    out, stats = attention(q, k, v, causal=causal, key_padding_mask=mask, return_stats=True,
                           sink_tokens=sink, backend="triton")  # fmt: skip
    ref = reference(q.detach(), k.detach(), v.detach(), causal=causal, key_padding_mask=mask,
                    sink_tokens=sink)  # fmt: skip
    tol = STATS_TOLERANCE[dtype]
    names = ("lse", "entropy", "max_prob", "max_logit", "attended") + (
        ("sink_mass",) if sink else ()
    )
    for name in names:
        value = getattr(stats, name)
        assert value.dtype == torch.float32 and value.device.type == "cuda", name
        torch.testing.assert_close(value.double(), getattr(ref, name), atol=tol, rtol=tol, msg=name)
    out_tol = 2e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), ref.out, atol=out_tol, rtol=out_tol)


@pytest.mark.parametrize("case", ["nan_query", "nan_key", "posinf_query"])
def test_nonfinite_scores_on_the_gpu(reference, case):
    """The compiled kernels' max returns the non-NaN operand: the NaN contract must not rely on
    m."""
    # at most 128 long: one tile, no tuning; the GPU's NaN handling is the same in every tile
    q, k, v = (x.detach() for x in cuda_inputs(5, 2, 4, 2, 100, 128, 64, torch.bfloat16))
    if case == "nan_query":
        q[0, 1, 7, 3] = math.nan
    elif case == "nan_key":
        k[1, 0, 100, 0] = math.nan  # causal below: rows 72.. see key 100 and turn NaN
    else:
        q[0, 2, 11, 0] = math.inf
    causal = case == "nan_key"
    out, stats = attention(q, k, v, causal=causal, return_stats=True, sink_tokens=2,
                           backend="triton")  # fmt: skip
    ref = reference(q, k, v, causal=causal, sink_tokens=2)
    broken = ref.entropy.isnan()
    assert broken.any() and not broken.all()
    for name in ("lse", "entropy", "max_prob", "max_logit", "attended", "sink_mass"):
        torch.testing.assert_close(getattr(stats, name).double(), getattr(ref, name), atol=1e-3,
                                   rtol=1e-3, equal_nan=True, msg=name)  # fmt: skip
    tol = 4 * torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(out[~broken].double(), ref.out[~broken], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_autocast_on_cuda(reference, dtype):
    q, k, v = cuda_inputs(9, 2, 4, 4, 512, 512, 64, torch.float32)
    with torch.autocast("cuda", dtype=dtype):
        out, stats = attention(q, k, v, causal=True, return_stats=True, backend="auto")
        expected_dtype = F.scaled_dot_product_attention(q, k, v, is_causal=True).dtype
        out.float().square().sum().backward()
    assert out.dtype == expected_dtype == dtype and stats.entropy.dtype == torch.float32
    ref = reference(q.detach(), k.detach(), v.detach(), causal=True)
    live = ref.attended > 1
    torch.testing.assert_close(stats.entropy[live].double() / ref.attended[live].log(),
                               ref.entropy[live] / ref.attended[live].log(),
                               atol=0.05, rtol=0)  # fmt: skip
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
