"""``qkmonitor.kernels.attention`` against naive float64 attention, on both backends.

Outputs, every statistic and the gradients of q, k and v are compared with
``reference_attention`` (conftest). The triton backend runs in the interpreter without a GPU, which
is slow: its tests are marked ``slow`` and keep shapes small.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkmonitor.kernels import AttentionStats, attention, attention_stats
from qkmonitor.kernels import _torch as torch_backend

BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=pytest.mark.slow),
]

# (out atol/rtol, statistics atol/rtol, gradient tolerance relative to the gradient's max |value|)
TOLERANCES = {
    torch.float32: {"out": 2e-5, "stats": 2e-5, "grad": 2e-4},
    torch.float16: {"out": 3e-3, "stats": 1e-3, "grad": 2e-2},
    torch.bfloat16: {"out": 2e-2, "stats": 1e-3, "grad": 6e-2},
}
STAT_NAMES = ("lse", "entropy", "max_prob", "max_logit", "attended")


def make_inputs(seed, batch, heads, kv_heads, n, m, d, device, dtype=torch.float32, spread=1.0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        x = torch.randn(*shape, generator=gen) * spread
        return x.to(device=device, dtype=dtype).requires_grad_()

    return randn(batch, heads, n, d), randn(batch, kv_heads, m, d), randn(batch, kv_heads, m, d)


def run_and_check(
    reference,
    q,
    k,
    v,
    *,
    backend,
    causal=False,
    key_padding_mask=None,
    scale=None,
    sink_tokens=0,
    seed=0,
    tolerances=None,
):
    """Run ``attention`` with statistics and its backward; assert all of it against the reference.

    ``tolerances`` overrides entries of the dtype's :data:`TOLERANCES`.
    Returns the kernel's (out, stats, (dq, dk, dv)) for extra checks.
    """
    tol = TOLERANCES[q.dtype] | (tolerances or {})
    out, stats = attention(
        q,
        k,
        v,
        causal=causal,
        key_padding_mask=key_padding_mask,
        scale=scale,
        return_stats=True,
        sink_tokens=sink_tokens,
        backend=backend,
    )
    assert isinstance(stats, AttentionStats)
    assert out.shape == q.shape and out.dtype == q.dtype
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = reference(
        *leaves,
        causal=causal,
        key_padding_mask=key_padding_mask,
        scale=scale,
        sink_tokens=sink_tokens,
    )
    torch.testing.assert_close(
        out.double(), ref.out.detach(), atol=tol["out"], rtol=tol["out"], msg="out"
    )
    for name in STAT_NAMES:
        value = getattr(stats, name)
        assert value.shape == q.shape[:3] and value.dtype == torch.float32, name
        assert not value.requires_grad, name
        assert not value.isnan().any(), name
        torch.testing.assert_close(
            value.double(), getattr(ref, name), atol=tol["stats"], rtol=tol["stats"], msg=name
        )
    assert (stats.entropy >= 0).all()
    if sink_tokens == 0:
        assert stats.sink_mass is None
    else:
        torch.testing.assert_close(
            stats.sink_mass.double(), ref.sink_mass, atol=tol["stats"], rtol=tol["stats"]
        )

    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref.out, leaves, dout.double())
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape and g.dtype == q.dtype, name
        assert torch.isfinite(g).all(), f"d{name} not finite"
        scale_g = max(r.abs().max().item(), 1.0)
        torch.testing.assert_close(
            g.double(), r, atol=tol["grad"] * scale_g, rtol=tol["grad"], msg=f"d{name}"
        )
    return out, stats, grads


@st.composite
def attention_cases(draw, max_len):
    kv_heads = draw(st.integers(1, 2))
    m = draw(st.integers(1, max_len))
    mask_kind = draw(st.sampled_from(["none", "random", "one_batch_empty"]))
    return {
        "seed": draw(st.integers(0, 2**16)),
        "batch": draw(st.integers(1, 2)),
        "kv_heads": kv_heads,
        "heads": kv_heads * draw(st.integers(1, 3)),
        "n": draw(st.integers(1, max_len)),
        "m": m,
        "d": draw(st.sampled_from([8, 16, 24, 32, 64, 80])),
        "causal": draw(st.booleans()),
        "mask_kind": mask_kind,
        "scale": draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        "sink_tokens": draw(st.integers(0, m + 1)),
    }


def make_mask(kind, batch, m, seed, device):
    if kind == "none":
        return None
    gen = torch.Generator().manual_seed(seed + 2)
    mask = torch.rand(batch, m, generator=gen) > 0.3
    if kind == "one_batch_empty":
        mask[0] = False  # every row of batch element 0 is fully masked
    return mask.to(device)


def check_case(reference, device, backend, case):
    q, k, v = make_inputs(
        case["seed"], case["batch"], case["heads"], case["kv_heads"], case["n"], case["m"],
        case["d"], device,
    )  # fmt: skip
    run_and_check(
        reference,
        q,
        k,
        v,
        backend=backend,
        causal=case["causal"],
        key_padding_mask=make_mask(
            case["mask_kind"], case["batch"], case["m"], case["seed"], device
        ),
        scale=case["scale"],
        sink_tokens=case["sink_tokens"],
        seed=case["seed"],
    )


@settings(max_examples=40, deadline=None, derandomize=True)
@given(case=attention_cases(max_len=70), block=st.sampled_from([5, 16, 64]))
def test_torch_random_shapes(reference, device, case, block):
    # Small key blocks so that the online rescaling runs over many blocks, and the blockwise
    # backward where SDPA would otherwise give the gradients.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_backend, "DEFAULT_BLOCK_SIZE", block)
        mp.setattr(torch_backend, "SDPA_WITH_STATS", False)
        check_case(reference, device, "torch", case)


@pytest.mark.slow
@settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(case=attention_cases(max_len=64))
def test_triton_random_shapes(reference, device, case):
    check_case(reference, device, "triton", case)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_by_padding(reference, device, backend):
    q, k, v = make_inputs(1, 2, 2, 1, 9, 21, 16, device)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[0] = False
    mask[1, ::3] = False
    out, stats, (dq, dk, dv) = run_and_check(
        reference, q, k, v, backend=backend, key_padding_mask=mask.to(device), sink_tokens=2
    )
    assert (out[0] == 0).all() and (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()
    assert (dk[1, :, ::3] == 0).all() and (dv[1, :, ::3] == 0).all()
    assert (stats.entropy[0] == 0).all() and (stats.max_prob[0] == 0).all()
    assert (stats.attended[0] == 0).all() and (stats.sink_mass[0] == 0).all()
    assert torch.isneginf(stats.lse[0]).all() and torch.isneginf(stats.max_logit[0]).all()


def test_a_batch_beyond_the_grid_limit_runs_in_slices_that_equal_the_reference(
    reference, device, monkeypatch
):
    """B·H above the grid's second axis (65,535; lowered to 4 here, so that B = 3, H = 2 takes
    two launches of two and one sequence) is split over the batch, the padding mask with it:
    outputs, statistics and gradients as the float64 reference, as one launch gives them."""
    pytest.importorskip("triton", minversion="3.4")  # the kernel's own bound (pyproject)
    import qkmonitor.kernels._triton.autograd as triton_autograd

    q, k, v = make_inputs(3, 3, 2, 1, 7, 11, 16, device)
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[2, :4] = False
    monkeypatch.setattr(triton_autograd, "_MAX_GRID_Y", 4)
    calls = []
    original = triton_autograd.TritonAttention.apply
    monkeypatch.setattr(
        triton_autograd.TritonAttention,
        "apply",
        lambda *args: calls.append(args[0].shape[0]) or original(*args),
    )
    run_and_check(
        reference, q, k, v, backend="triton", causal=True, key_padding_mask=mask.to(device),
        sink_tokens=1,
    )  # fmt: skip
    assert calls[:2] == [2, 1]  # two launches: sequences 0-1, then 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_by_causal_with_more_queries(reference, device, backend):
    n, m = 23, 6  # bottom-right aligned: rows i < n - m see no key
    q, k, v = make_inputs(2, 1, 2, 2, n, m, 24, device)
    out, stats, (dq, _, _) = run_and_check(reference, q, k, v, backend=backend, causal=True)
    empty = slice(0, n - m)
    assert (out[:, :, empty] == 0).all() and (dq[:, :, empty] == 0).all()
    assert (stats.attended[:, :, empty] == 0).all() and (stats.entropy[:, :, empty] == 0).all()
    assert torch.isneginf(stats.lse[:, :, empty]).all()
    assert (stats.attended[0, 0, n - m :] == torch.arange(1, m + 1, device=device)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_and_causal_leave_first_row_empty(reference, device, backend):
    q, k, v = make_inputs(3, 2, 2, 2, 18, 18, 16, device)
    mask = torch.ones(2, 18, dtype=torch.bool)
    mask[:, 0] = False  # row 0 may only see key 0 under the causal rule
    out, stats, _ = run_and_check(
        reference, q, k, v, backend=backend, causal=True, key_padding_mask=mask.to(device)
    )
    assert (out[:, :, 0] == 0).all() and (stats.attended[:, :, 0] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_peaked_logits(reference, device, backend):
    # q = k and a large scale: each row's softmax is (nearly) one-hot on its own key.
    q, _, v = make_inputs(4, 1, 2, 2, 33, 33, 32, device)
    k = q.detach().clone().requires_grad_()
    out, stats, _ = run_and_check(reference, q, k, v, backend=backend, scale=4.0, causal=True)
    assert stats.max_prob.min() > 0.99 and stats.entropy.max() < 0.05
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_logits_stay_finite(reference, device, backend, monkeypatch):
    # Scores in the thousands: every exponent must be taken relative to the running max. The
    # blockwise backward, not SDPA's: SDPA's float32 dq is off by 4e-4 relative here.
    monkeypatch.setattr(torch_backend, "SDPA_WITH_STATS", False)
    q, k, v = make_inputs(5, 1, 1, 1, 20, 40, 16, device, spread=10.0)
    # a float32 logit of size S is known to S * 2^-24 at best; through the softmax that is a
    # relative error of that order on the output and the gradients (here S ~ 4e3: ~2.4e-4), in
    # whatever order a backend sums (the Triton interpreter's numpy matmul differs by release)
    eps = (
        float((q.detach().double() @ k.detach().double().transpose(-1, -2)).abs().max())
        * 3.0
        * 2.0**-24
    )
    tol = {name: max(TOLERANCES[torch.float32][name], 4 * eps) for name in ("out", "grad")}
    run_and_check(reference, q, k, v, backend=backend, scale=3.0, tolerances=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision(reference, device, backend, dtype):
    q, k, v = make_inputs(6, 2, 4, 2, 35, 29, 24, device, dtype=dtype)
    mask = torch.rand(2, 29, generator=torch.Generator().manual_seed(6)) > 0.2
    run_and_check(
        reference, q, k, v, backend=backend, key_padding_mask=mask.to(device), causal=True
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [16, 24, 80, 128, 256])
def test_head_dims(reference, device, backend, d):
    q, k, v = make_inputs(7, 1, 2, 1, 17, 19, d, device)
    run_and_check(reference, q, k, v, backend=backend, causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_heads", [1, 2, 6], ids=["mqa", "gqa", "mha"])
def test_grouped_heads(reference, device, backend, kv_heads):
    q, k, v = make_inputs(8, 2, 6, kv_heads, 20, 26, 16, device)
    run_and_check(reference, q, k, v, backend=backend, causal=True, sink_tokens=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(reference, device, backend):
    # (B, N, H, D) storage viewed as (B, H, N, D), as a model's projections produce it.
    gen = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(2, l, h, 16, generator=gen).to(device).transpose(1, 2).requires_grad_()
        for l, h in ((21, 4), (17, 2), (17, 2))
    )
    assert not q.is_contiguous()
    run_and_check(reference, q, k, v, backend=backend, causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_statistics_do_not_change_output(device, backend):
    q, k, v = make_inputs(10, 1, 2, 1, 30, 30, 24, device)
    mask = (torch.arange(30) % 7 != 0).expand(1, 30).to(device)
    plain = attention(q, k, v, causal=True, key_padding_mask=mask, backend=backend)
    with_stats, _ = attention(
        q,
        k,
        v,
        causal=True,
        key_padding_mask=mask,
        backend=backend,
        return_stats=True,
        sink_tokens=3,
    )
    torch.testing.assert_close(with_stats, plain, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_probed_training_step_trains_exactly_as_an_unprobed_one(
    reference, device, causal, kv_heads
):
    """Torch backend, gradients needed, no row can be empty: SDPA gives the output and gradients
    with statistics as without (bit for bit), and the statistics still match the reference."""
    q, k, v = make_inputs(12, 2, 4, kv_heads, 33, 33, 16, device)
    plain = attention(q, k, v, causal=causal, backend="torch")
    plain_grads = torch.autograd.grad(plain.square().sum(), (q, k, v))
    out, stats = attention(
        q, k, v, causal=causal, backend="torch", return_stats=True, sink_tokens=2
    )
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert torch.equal(out, plain) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    ref = reference(
        *(x.detach().double() for x in (q, k, v)),
        causal=causal,
        key_padding_mask=None,
        scale=None,
        sink_tokens=2,
    )
    tol = TOLERANCES[torch.float32]["stats"]
    for name in STAT_NAMES:
        torch.testing.assert_close(
            getattr(stats, name).double(), getattr(ref, name), atol=tol, rtol=tol, msg=name
        )
        assert not getattr(stats, name).requires_grad


@pytest.mark.parametrize(
    "n", [33, 40], ids=["sdpa", "blockwise"]
)  # N > M: causal rows without a key
def test_statistics_change_neither_output_nor_themselves_with_the_grad_mode(device, n):
    """Torch backend: with or without statistics, under ``no_grad`` or not (a reentrant checkpoint
    runs a forward under ``no_grad`` and again with grad in the backward), the output is the same
    bit for bit, and so are the statistics."""
    q, k, v = make_inputs(13, 2, 4, 2, n, 33, 16, device)
    runs = {}
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            plain = attention(q, k, v, causal=True, backend="torch")
            out, stats = attention(
                q, k, v, causal=True, backend="torch", return_stats=True, sink_tokens=2
            )
        assert plain.requires_grad == out.requires_grad == grad
        runs[grad] = plain, out, stats
    for grad, (plain, out, stats) in runs.items():
        assert torch.equal(out, plain) and torch.equal(out, runs[False][0]), grad
        for name in STAT_NAMES:
            assert torch.equal(getattr(stats, name), getattr(runs[False][2], name)), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_without_statistics(reference, device, backend, causal):
    # The torch backend may take F.scaled_dot_product_attention here (no row can be empty).
    q, k, v = make_inputs(11, 2, 4, 2, 24, 24, 16, device)
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, 5:9] = False
    mask = None if causal else mask.to(device)
    out = attention(q, k, v, causal=causal, key_padding_mask=mask, backend=backend)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = reference(*leaves, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out.double(), ref.out.detach(), atol=2e-5, rtol=2e-5)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(device)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for g, r in zip(grads, torch.autograd.grad(ref.out, leaves, dout.double())):
        torch.testing.assert_close(g.double(), r, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_mask_and_sink_covering_all_keys(reference, device, backend):
    q, k, v = make_inputs(12, 1, 2, 2, 8, 10, 16, device)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 0, 1, 1]], device=device)
    _, stats, _ = run_and_check(
        reference, q, k, v, backend=backend, key_padding_mask=mask, sink_tokens=12
    )
    torch.testing.assert_close(stats.sink_mass, torch.ones_like(stats.sink_mass))
    assert (stats.attended == 8).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n, m", [(0, 5), (4, 0)])
def test_empty_sequences(device, backend, n, m):
    q, k, v = make_inputs(13, 1, 2, 1, n, m, 16, device)
    out, stats = attention(q, k, v, return_stats=True, backend=backend)
    assert out.shape == (1, 2, n, 16) and (out == 0).all()
    assert torch.isneginf(stats.lse).all() and (stats.entropy == 0).all()
    out.sum().backward()
    assert q.grad.shape == q.shape and (q.grad == 0).all()


def test_uniform_attention_has_maximal_entropy(device):
    # All scores equal: p = 1/M, entropy = log M, max_prob = 1/M, lse = max_logit + log M.
    q = torch.zeros(1, 1, 5, 16, device=device)
    k = torch.randn(1, 1, 13, 16, device=device)
    _, stats = attention(q, k, k, return_stats=True, backend="torch")
    torch.testing.assert_close(stats.entropy, torch.full_like(stats.entropy, math.log(13)))
    torch.testing.assert_close(stats.max_prob, torch.full_like(stats.max_prob, 1 / 13))
    torch.testing.assert_close(stats.lse, stats.max_logit + math.log(13))


@pytest.mark.parametrize(
    "causal, masked", [(True, "some"), (False, "none"), (False, "one sequence")]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_stats_alone_equal_those_beside_the_output(device, backend, causal, masked):
    # On the torch backend the statistics alone take a one-block path when all keys fit in one
    # block, the output's path the online loop: the two must agree, masks and empty rows included.
    q, k, _ = make_inputs(11, 2, 4, 2, 9, 13, 16, device)
    mask = torch.rand(2, 13, generator=torch.Generator().manual_seed(11)) > 0.3
    if masked == "one sequence":
        mask[1] = False  # every key of sequence 1 masked: empty rows
    mask = None if masked == "none" else mask.to(device)
    _, with_out = attention(
        q,
        k,
        k,
        causal=causal,
        key_padding_mask=mask,
        return_stats=True,
        sink_tokens=2,
        backend=backend,
    )
    alone = attention_stats(
        q, k, causal=causal, key_padding_mask=mask, sink_tokens=2, backend=backend
    )
    for name in STAT_NAMES + ("sink_mass",):
        torch.testing.assert_close(
            getattr(alone, name), getattr(with_out, name), rtol=1e-6, atol=1e-6, msg=name
        )
        assert not getattr(alone, name).requires_grad
