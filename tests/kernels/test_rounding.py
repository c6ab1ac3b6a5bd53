"""The rounding of the softmax weights before ``P·V`` (``attention(..., pv_rounding=...)``;
docs/kernel.md, "Rounding of the softmax weights").

On rows whose keys tie at and just below the max (several keys with the same score, others within
2^-9 of it, as similar keys give them), the "kernel" rounding (the weights rounded to bfloat16 for
``P·V``, the row sum of the unrounded ones: what FlashAttention's GPU kernels do) makes the output's
signed error against float64 lean with the values' common direction: every near-max weight
``e^{−g}``, ``g < 2^-9``, rounds up to 1, and the surplus ``Σ δ`` over the unrounded row sum ``l``
adds ``v̄ · Σ δ / l`` to the output (Qiu & Yao 2025). The "unbiased" rounding normalizes by the
rounded weights' own sum: its mean signed error is within two standard errors of 0. The torch
backend and the Triton kernel (in the interpreter on CPU, bfloat16 rounded on the bits) give the
same bits in both modes at the same block size.
"""

from __future__ import annotations

import pytest
import torch

from qkmonitor.kernels import attention

BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=pytest.mark.slow),
]
MODES = ("float32", "kernel", "unbiased")
#: The values' common direction: every coordinate's mean. The outputs, averages of values
#: ``VALUE_MEAN ± 0.5``, then lie within (−2, −1), one binade, where bfloat16's own rounding of
#: them is unbiased (near ±1 it is not: the spacing doubles there).
VALUE_MEAN = -1.5


def tied_inputs(device, batch=4, heads=8, n=16, m=32, d=16, seed=0):
    """bfloat16 (q, k, v) whose every row has 3 keys tied at its max score and 6 keys within
    2^-9 below it (gaps g · b_i / 4, g < 2^-7 uniform, b_i in [0.5, 1)), the other keys 1/2 to 8
    below; values ``VALUE_MEAN + 0.5 · N(0, 1)``, independent of the scores."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.zeros(batch, heads, n, d)
    q[..., 0] = torch.randn(batch, heads, n, generator=gen)  # shifts a row: no effect
    q[..., 1] = 0.5 + 0.5 * torch.rand(batch, heads, n, generator=gen)
    k = torch.zeros(batch, heads, m, d)
    k[..., 0] = 1.0
    k[..., 1] = -(4.0 + 28.0 * torch.rand(batch, heads, m, generator=gen))  # the far keys
    k[..., :3, 1] = 0.0  # tied at the max
    k[..., 3:9, 1] = -(2.0**-7) * torch.rand(batch, heads, 6, generator=gen)  # just below it
    v = VALUE_MEAN + 0.5 * torch.randn(batch, heads, m, d, generator=gen)
    return tuple(x.to(device=device, dtype=torch.bfloat16) for x in (q, k, v))


def signed_error(error):
    """The mean of a (B, H, ...) error and its standard error over the heads' means (the
    independent units: a head's rows share its keys and values)."""
    heads = error.double().flatten(2).mean(dim=-1).flatten()
    return heads.mean().item(), (heads.std() / heads.numel() ** 0.5).item()


def predicted_bias(q, k, scale=0.25):
    """``v̄ · mean_rows(Σ_j δ_j / l)``: the "kernel" rounding's expected mean signed error, from
    the float32 weights ``e^{s − m}`` and their bfloat16 roundings ``δ_j``."""
    s = scale * (q.float() @ k.float().transpose(-1, -2))
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    surplus = (p.bfloat16().float() - p).sum(dim=-1) / p.sum(dim=-1)
    return VALUE_MEAN * surplus.double().mean().item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_rounding_is_biased_and_unbiased_rounding_is_not(reference, device, backend):
    q, k, v = tied_inputs(device)
    ref = reference(q, k, v).out
    errors = {
        mode: signed_error(attention(q, k, v, backend=backend, pv_rounding=mode).double() - ref)
        for mode in MODES
    }
    bias, se = errors["kernel"]
    expected = predicted_bias(q, k)
    assert expected < -3e-4  # v̄ < 0: the near-max weights round up, the output leans to v̄
    assert bias < 0 and abs(bias) > 10 * se, errors
    assert bias == pytest.approx(expected, rel=0.2), (bias, expected)
    for mode in ("unbiased", "float32"):
        mean, se = errors[mode]
        assert abs(mean) < 2 * se, (mode, errors)
        assert abs(mean) < abs(bias) / 10, (mode, errors)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_query_gradient_inherits_the_bias_and_unbiased_rounding_removes_it(
    reference, device, backend
):
    """Qiu & Yao's failure: the backward's ``δ = dO · out`` carries the output's surplus, so
    ``Σ_j dS_ij ≠ 0`` and dQ gains a consistent error along the keys' common direction (here the
    coordinate that tells the near-max keys apart, with dO = 1 everywhere)."""
    q, k, v = (x.requires_grad_() for x in tied_inputs(device))
    grad = torch.ones(q.shape, dtype=q.dtype, device=device)
    (want,) = torch.autograd.grad(reference(q, k, v).out, (q,), grad.double())
    errors = {}
    for mode in MODES:
        out = attention(q, k, v, backend=backend, pv_rounding=mode)
        (got,) = torch.autograd.grad(out, (q,), grad)
        errors[mode] = signed_error((got.double() - want)[..., 1])
    bias, se = errors["kernel"]
    assert bias < 0 and abs(bias) > 8 * se, errors
    for mode in ("unbiased", "float32"):  # the triton interpreter's unbiased dQ: 2.1 SE
        assert abs(errors[mode][0]) < 3 * errors[mode][1], (mode, errors)
        assert abs(errors[mode][0]) < abs(bias) / 20, (mode, errors)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unbiased_rounding_keeps_the_max_error_of_bfloat16(reference, device, backend):
    """Not only the mean: every entry within bfloat16's output rounding and the weights'."""
    q, k, v = tied_inputs(device, batch=2, heads=4)
    ref = reference(q, k, v).out
    out = attention(q, k, v, backend=backend, pv_rounding="unbiased")
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_each_rounding_matches_the_reference_with_gradients(reference, device, backend, mode):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(2, 4, 19, 16, generator=gen).to(device=device, dtype=torch.bfloat16)
        for _ in range(3)
    )
    k, v = k[:, :2], v[:, :2]  # grouped-query heads
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    mask = torch.ones(2, 19, dtype=torch.bool, device=device)
    mask[1, :5] = False
    out = attention(q, k, v, causal=True, key_padding_mask=mask, backend=backend, pv_rounding=mode)
    grad = torch.randn(out.shape, generator=gen).to(device=device, dtype=out.dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    ref = reference(q, k, v, causal=True, key_padding_mask=mask)
    rq, rk, rv = torch.autograd.grad(ref.out, (q, k, v), grad.double())
    torch.testing.assert_close(out.double(), ref.out.detach(), atol=2e-2, rtol=0)
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(got.double(), want.double(), atol=6e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_roundings_change_nothing_for_float32_inputs(device, backend):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 21, 16, generator=gen).to(device) for _ in range(3))
    base = attention(q, k, v, causal=True, backend=backend)
    for mode in MODES:
        assert torch.equal(attention(q, k, v, causal=True, backend=backend, pv_rounding=mode), base)
    if backend == "torch":
        q, k, v = (x.double() for x in (q, k, v))
        base = attention(q, k, v, backend="torch")
        for mode in MODES:
            assert torch.equal(attention(q, k, v, backend="torch", pv_rounding=mode), base)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kernel", "unbiased"])
def test_the_torch_backend_rounds_as_the_triton_kernel(device, monkeypatch, mode):
    """At the interpreter's block of 16 keys the same bits: the CPU sees the GPU's rounding."""
    import qkmonitor.kernels._torch as torch_backend
    from qkmonitor.kernels._triton.tuning import INTERPRETED

    if not INTERPRETED:
        pytest.skip("the GPU's tiles are autotuned: no one block size to match")
    monkeypatch.setattr(torch_backend, "DEFAULT_BLOCK_SIZE", 16)
    q, k, v = tied_inputs(device, batch=1, heads=4, m=40)
    args = dict(pv_rounding=mode, causal=True)
    assert torch.equal(
        attention(q, k, v, backend="torch", **args), attention(q, k, v, backend="triton", **args)
    )


def test_an_unknown_rounding_is_an_error_naming_the_argument():
    q = torch.zeros(1, 1, 2, 16)
    with pytest.raises(ValueError, match="`pv_rounding`"):
        attention(q, q, q, pv_rounding="stochastic")


def test_a_bundled_model_passes_its_rounding_to_the_kernel(monkeypatch):
    import qkmonitor.models.attention as model_attention
    from qkmonitor.models.config import TransformerConfig

    with pytest.raises(ValueError, match="`attention_rounding`"):
        TransformerConfig(
            vocab_size=8, d_model=16, n_layers=1, n_heads=2, max_seq_len=8,
            attention_rounding="bf16",
        )  # fmt: skip
    seen = []
    original = model_attention.attention
    monkeypatch.setattr(
        model_attention,
        "attention",
        lambda *a, **kw: seen.append(kw["pv_rounding"]) or original(*a, **kw),
    )
    from qkmonitor.models import DecoderLM

    config = TransformerConfig(
        vocab_size=8, d_model=16, n_layers=1, n_heads=2, max_seq_len=8,
        attention_backend="torch", attention_rounding="unbiased",
    )  # fmt: skip
    DecoderLM(config)(torch.zeros(1, 8, dtype=torch.long))
    assert seen == ["unbiased"]
