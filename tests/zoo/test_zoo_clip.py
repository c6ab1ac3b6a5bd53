"""QK-Clip's rescaling on every model of the zoo, against the zoo's own float64 reading of W_Q, W_K.

``layer.qk_rows().scale_logits(γ)`` must scale head h's bilinear form ``W_Q^h (W_K^{g(h)})ᵀ`` by
exactly ``γ_h`` (to float32 rounding) and leave every head with ``γ_h = 1`` bit for bit as it was,
on every layout the zoo reads: fused and separate projections, GQA, MQA, x-transformers' tiled key
heads, Conv1D, per-head interleaves.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.testing import assert_close

from qkmonitor.attention.adapters import find_attention_layers
from qkmonitor.attention.probes import ProbeRequest

from .models import ZOO
from .test_zoo import build


def checked_layers(built):
    """The model's attention layers, their layouts checked by one probed forward where needed; the
    layers whose κ the entry expects refused (by the reason it names) are left out."""
    layers = find_attention_layers(built.model)
    waiting = [layer for layer in layers if layer.needs_layout_check]
    probes = [layer.open_probe(ProbeRequest(stats=False, layout=True)) for layer in waiting]
    try:
        with torch.no_grad():
            built.loss(built.model)
    finally:
        results = [probe.close() for probe in probes]
    for layer, result in zip(waiting, results):
        verdict = layer.check_layout(result)
        refused = built.kappa_refused.get(layer.name)
        assert (verdict is None) if refused is None else re.search(refused, verdict), layer.name
    return [layer for layer in layers if layer.name not in built.kappa_refused]


def factors(num_heads: int) -> torch.Tensor:
    """Head 0 clipped to a quarter, the last head (when there are two or more) to 0.3."""
    gamma = torch.ones(num_heads, dtype=torch.float64)
    gamma[0] = 0.25
    if num_heads > 1:
        gamma[-1] = 0.3
    return gamma


@pytest.mark.parametrize("name", list(ZOO))
def test_each_heads_qk_product_is_scaled_by_its_factor_and_the_others_are_untouched(name):
    built = build(name)
    layers = checked_layers(built)
    before = {n: qk for n, qk in built.qk(built.model).items() if n not in built.kappa_refused}
    assert set(before) == {layer.name for layer in layers}
    gammas = {}
    for layer in layers:
        rows = layer.qk_rows()
        gammas[layer.name] = factors(rows.num_heads)
        rows.scale_logits(gammas[layer.name])
    after = built.qk(built.model)
    for layer_name, (wq, wk) in before.items():
        gamma = gammas[layer_name]
        wq_after, wk_after = after[layer_name]
        product, product_after = wq @ wk.transpose(-1, -2), wq_after @ wk_after.transpose(-1, -2)
        scale = product.abs().amax()
        assert_close(product_after, gamma[:, None, None] * product, rtol=1e-5, atol=1e-6 * scale)
        healthy = gamma == 1
        assert torch.equal(wq_after[healthy], wq[healthy]), layer_name
        assert torch.equal(wk_after[healthy], wk[healthy]), layer_name


@pytest.mark.parametrize("name", list(ZOO))
def test_the_max_only_probe_reads_what_the_statistics_read(name, leftovers):
    """QKClip's probe (the largest logits alone, no softmax) on every layout the zoo reads: the same
    per-call, per-head maxima as the statistics' path, and nothing left installed."""
    built = build(name)
    layers = find_attention_layers(built.model)
    measurable = [
        layer for layer in layers if layer.supports_stats and layer.name not in built.stats_refused
    ]
    assert measurable, name
    max_only = [
        layer.open_probe(ProbeRequest(stats=False, max_logits=True)) for layer in measurable
    ]
    with_stats = [layer.open_probe(ProbeRequest(stats=True)) for layer in measurable]
    try:
        with torch.no_grad():
            built.loss(built.model)
    finally:
        results = [(a.close(), b.close()) for a, b in zip(max_only, with_stats)]
    assert leftovers(built.model) == []
    for layer, (largest, stats) in zip(measurable, results):
        assert not largest.failures and not stats.failures, (layer.name, largest.failures)
        assert largest.calls == stats.calls > 0, layer.name
        assert len(largest.max_logits) == len(stats.stats), layer.name
        for got, call in zip(largest.max_logits, stats.stats):
            expected = call.max_logit.amax(dim=-1)
            scale = expected[torch.isfinite(expected)].abs().amax()
            assert_close(got.float(), expected.float(), rtol=1e-5, atol=1e-5 * scale)
