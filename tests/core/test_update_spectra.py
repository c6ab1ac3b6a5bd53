"""The spectrum of one update to each head's query-key form (``measures/update_spectra.py``):
against float64 math that forms the d x d first-order update ``ΔA^T B + A^T ΔB`` of every head and
takes its singular values (MHA, GQA, a key input width of its own, float32 weights and an update
10^-5 the size of its weights, one side frozen); zero updates undefined, broken ones NaN."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.measures.update_spectra import (
    qk_update_metrics,
    qk_update_singular_values,
    update_spectra,
)


def reference(before: QKWeights, after: QKWeights) -> tuple[torch.Tensor, int]:
    """(H, r) singular values of each head's dense float64 first-order update, and r (their
    count: min(2 d_k, d, d'))."""
    heads, kv_heads = before.num_heads, before.num_kv_heads
    d_k = before.w_q.shape[0] // heads
    out = []
    for h in range(heads):
        g = h // (heads // kv_heads)
        q, k = slice(h * d_k, (h + 1) * d_k), slice(g * d_k, (g + 1) * d_k)
        a, b = before.w_q[q].double(), before.w_k[k].double()
        da, db = after.w_q[q].double() - a, after.w_k[k].double() - b
        out.append(torch.linalg.svdvals(da.T @ b + a.T @ db))  # d x d': W_QK^h's update
    r = min(2 * d_k, before.w_q.shape[1], before.w_k.shape[1])
    return torch.stack(out)[:, :r], r


def metrics_reference(sv: torch.Tensor, r: int) -> dict[str, torch.Tensor]:
    p = sv / sv.sum(-1, keepdim=True)
    entropy = -torch.xlogy(p, p).sum(-1) / math.log(r)
    return {"qk_update_entropy": entropy, "qk_update_top_share": p[:, 0]}


def layer(heads, kv_heads, d_k, d, d_kv=None, dtype=torch.float64, size=1e-2, seed=0):
    """(before, after): random weights and an update of relative size ``size``."""
    gen = torch.Generator().manual_seed(seed)
    w_q = torch.randn(heads * d_k, d, generator=gen, dtype=torch.float64)
    w_k = torch.randn(kv_heads * d_k, d_kv or d, generator=gen, dtype=torch.float64)
    new_q = w_q + size * torch.randn(w_q.shape, generator=gen, dtype=torch.float64)
    new_k = w_k + size * torch.randn(w_k.shape, generator=gen, dtype=torch.float64)
    before = QKWeights(w_q.to(dtype), w_k.to(dtype), heads, kv_heads, 1.0)
    return before, QKWeights(new_q.to(dtype), new_k.to(dtype), heads, kv_heads, 1.0)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d_k", "d", "d_kv"),
    [(4, 4, 8, 48, None), (6, 2, 8, 40, None), (4, 1, 6, 32, None), (2, 2, 8, 24, 20)],
    ids=["mha", "gqa", "mqa", "kdim"],
)
def test_float64_weights_give_the_dense_updates_spectrum(heads, kv_heads, d_k, d, d_kv):
    before, after = layer(heads, kv_heads, d_k, d, d_kv)
    sv = qk_update_singular_values(before, after)
    want, r = reference(before, after)
    assert sv.shape == (heads, 2 * d_k) and sv.dtype == torch.float64
    assert_close(sv[:, :r], want, rtol=1e-10, atol=1e-12 * float(want.max()))
    assert (sv[:, r:] == 0).all()  # beyond the rank bound (d' < 2 d_k: kdim): exact zeros
    metrics, undefined = qk_update_metrics(before, after)
    for name, value in metrics_reference(want, r).items():
        assert_close(metrics[name], value, rtol=1e-10, atol=1e-12)
    assert not undefined.any()


def test_an_update_far_below_its_weights_is_resolved_in_float32():
    """An update 10^-5 the size of its weights: a Gram matrix of the unbalanced factors would
    resolve nothing below about 10^-3 of the weights (sqrt of float32's rounding); the balanced
    one keeps the update's own relative accuracy."""
    before, after = layer(4, 2, 8, 64, dtype=torch.float32, size=1e-5)
    sv = qk_update_singular_values(before, after)
    want, r = reference(before, after)  # from the float32 weights, in float64
    assert_close(sv[:, :r], want, rtol=0, atol=1e-4 * float(want[:, 0].min()))
    metrics, _ = qk_update_metrics(before, after)
    for name, value in metrics_reference(want, r).items():
        assert_close(metrics[name], value, rtol=0, atol=1e-4)


def test_a_frozen_key_side_leaves_an_update_of_rank_d_k():
    before, after = layer(4, 4, 8, 48)
    after = QKWeights(after.w_q, before.w_k, 4, 4, 1.0)  # ΔB = 0: the update is ΔA^T B
    sv = qk_update_singular_values(before, after)
    want, r = reference(before, after)
    assert_close(sv[:, :r], want, rtol=1e-10, atol=1e-12 * float(want.max()))
    assert (sv[:, 8:] == 0).all()  # exact zeros, not rounding noise
    metrics, _ = qk_update_metrics(before, after)
    assert (metrics["qk_update_entropy"] <= math.log(8) / math.log(16) + 1e-12).all()


def test_the_first_order_term_does_not_depend_on_the_updates_scale():
    """Linear in the update: scaling it scales every σ alike, the shares and entropy stay."""
    before, after = layer(4, 2, 8, 32)
    metrics, _ = qk_update_metrics(before, after)
    for c in (1e-3, 30.0):
        scaled = QKWeights(
            before.w_q + c * (after.w_q - before.w_q),
            before.w_k + c * (after.w_k - before.w_k),
            4,
            2,
            1.0,
        )
        again, _ = qk_update_metrics(before, scaled)
        for name, value in metrics.items():
            assert_close(again[name], value, rtol=1e-9, atol=0)


def test_no_update_is_undefined_and_a_broken_one_nan():
    before, after = layer(4, 2, 8, 32)
    metrics, undefined = qk_update_metrics(before, before)  # a frozen step
    assert undefined.all() and all(v.isnan().all() for v in metrics.values())
    broken = after.w_q.clone()
    broken[0, 0] = math.nan  # head 0
    metrics, undefined = qk_update_metrics(before, QKWeights(broken, after.w_k, 4, 2, 1.0))
    assert not undefined.any()
    assert all(v[0].isnan() and v[1:].isfinite().all() for v in metrics.values())


def test_layers_without_a_pair_are_nan_and_undefined():
    pair = layer(4, 4, 8, 32)
    values, undefined = update_spectra([None, pair], [3, 4])
    assert [v.shape for v in values["qk_update_entropy"]] == [(3,), (4,)]
    assert (
        values["qk_update_top_share"][0].isnan().all() and undefined["qk_update_entropy"][0].all()
    )
    assert values["qk_update_top_share"][1].isfinite().all()
    assert not undefined["qk_update_top_share"][1].any()
