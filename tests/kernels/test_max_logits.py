"""The largest logit alone (QK-Clip's input): blocks of scores without the softmax, against float64
scores, against the statistics' running max, and through every kind of observed call."""

from __future__ import annotations

import math

import pytest
import torch

from qkmonitor.attention.calls import FailedCall, MaskedCall, ScoresCall
from qkmonitor.attention.probes import KernelCall, Probe, ProbeRequest
from qkmonitor.kernels import attention_max_logits, attention_stats
from qkmonitor.kernels._torch import max_logits


def reference(q, k, *, scale, causal=False, padding=None, allowed=None) -> torch.Tensor:
    """(B, H) largest of the float64 scores over the allowed (row, key) pairs, -inf where none."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = scale * q @ k.transpose(-1, -2)  # (B, H, N, M)
    n, m = scores.shape[-2:]
    ok = torch.ones(scores.shape, dtype=torch.bool)
    if causal:
        ok &= torch.ones(n, m, dtype=torch.bool).tril(m - n)
    if padding is not None:
        ok &= padding[:, None, None, :]
    if allowed is not None:
        ok &= allowed
    return torch.where(ok, scores, -math.inf).flatten(2).amax(-1)


def inputs(b=3, h=4, h_kv=2, n=7, m=9, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, d, generator=g) * 3, torch.randn(b, h_kv, m, d, generator=g) * 3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_elements", [1, 40, None])  # one row a block, a few rows, all
def test_blocks_of_rows_give_the_float64_maximum(causal, block_elements):
    q, k = inputs()
    padding = torch.ones(3, 9, dtype=torch.bool)
    padding[1, 6:] = False
    padding[2] = False  # a sequence that may attend nothing: -inf, not an error
    got = max_logits(
        q, k, causal=causal, key_padding_mask=padding, scale=0.3, block_elements=block_elements
    )
    expected = reference(q, k, scale=0.3, causal=causal, padding=padding)
    assert got.shape == (3, 4) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(got[2]).all()


def test_it_is_the_statistics_running_max_over_rows():
    q, k = inputs(n=9, m=9)
    stats = attention_stats(q, k, causal=True, scale=0.25)
    got = attention_max_logits(q, k, causal=True, scale=0.25)
    torch.testing.assert_close(got, stats.max_logit.amax(-1), rtol=1e-6, atol=1e-6)


def test_float64_inputs_stay_float64_and_a_nan_score_is_reported():
    q, k = inputs()
    q = q.double()
    got = attention_max_logits(q, k.double(), scale=1.0)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, reference(q, k, scale=1.0), rtol=1e-12, atol=1e-12)
    q[0, 1, 3, 0] = math.nan
    got = attention_max_logits(q, k.double(), scale=1.0)
    assert math.isnan(got[0, 1]) and torch.isfinite(got[1:]).all()


def test_half_inputs_are_scored_in_float32():
    q, k = inputs(h_kv=4)
    got = attention_max_logits(q.bfloat16(), k.bfloat16(), scale=0.5)
    assert got.dtype == torch.float32
    expected = reference(q.bfloat16().float(), k.bfloat16().float(), scale=0.5)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"q": torch.ones(2, 3, 4)}, "`q`"),
        ({"k": "keys"}, "`k`"),
        ({"q": torch.ones(1, 2, 3, 4, dtype=torch.int64)}, "`q`"),
    ],
)
def test_bad_input_is_named(kwargs, match):
    args = {"q": torch.ones(1, 2, 3, 4), "k": torch.ones(1, 2, 3, 4), **kwargs}
    with pytest.raises(ValueError, match=match):
        attention_max_logits(args["q"], args["k"])


def test_a_masked_call_beyond_the_kernel_cases_scores_a_few_rows_at_a_time():
    """A 4-D mask with an additive bias, a window and soft-capping: explicit scores, reduced without
    the softmax, equal to the statistics' path."""
    q, k = inputs(b=2, n=6, m=6)
    g = torch.Generator().manual_seed(1)
    allowed = torch.rand(2, 1, 6, 6, generator=g) > 0.3
    allowed[..., 0] = True
    bias = torch.randn(2, 1, 6, 6, generator=g)
    call = MaskedCall(q, k, 0.4, True, None, allowed, bias, window=3, softcap=5.0)
    from_stats = call.stats().max_logit.amax(-1)
    torch.testing.assert_close(call.max_logits(), from_stats, rtol=1e-6, atol=1e-6)
    assert call.max_logits() is call.max_logits()  # computed once however many probes ask


def test_a_masked_call_of_the_kernel_cases_uses_the_blocks():
    q, k = inputs(b=2)
    padding = torch.tensor([[True] * 9, [True] * 4 + [False] * 5])
    call = MaskedCall(q, k, 0.3, True, padding, None, None)
    expected = reference(q, k, scale=0.3, causal=True, padding=padding)
    torch.testing.assert_close(call.max_logits().double(), expected, rtol=1e-5, atol=1e-5)


def test_explicit_scores_and_kernel_calls_and_failed_calls():
    q, k = inputs(h_kv=4)
    scores = 0.5 * q @ k.transpose(-1, -2)
    scores[0, :, :, 5:] = -math.inf  # blocked keys
    expected = scores.flatten(2).amax(-1)
    torch.testing.assert_close(ScoresCall(scores).max_logits(), expected)
    kernel = KernelCall(q, k, scale=0.5, causal=True)
    torch.testing.assert_close(
        kernel.max_logits().double(), reference(q, k, scale=0.5, causal=True), rtol=1e-5, atol=1e-5
    )
    stats = attention_stats(q, k, scale=0.5)  # statistics the forward computed: read, not redone
    with_stats = KernelCall(q * 0, k, scale=0.5, stats=stats)
    torch.testing.assert_close(with_stats.max_logits(), stats.max_logit.amax(-1))
    with pytest.raises(RuntimeError, match="unreadable"):
        FailedCall(RuntimeError("unreadable")).max_logits()


def test_a_max_only_probe_records_the_largest_logits_and_no_statistics():
    q, k = inputs(h_kv=4)
    probe = Probe("layer", ProbeRequest(stats=False, max_logits=True))
    probe.observe(KernelCall(q, k, scale=0.5))
    probe.observe(FailedCall(ValueError("no keys")))  # recorded as a failure, not raised
    result = probe.close()
    assert result.stats == [] and result.probs == [] and result.calls == 2
    assert len(result.max_logits) == 1 and result.max_logits[0].shape == (3, 4)
    assert result.failures == ["ValueError: no keys"]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_max_logits_request_is_named(value):
    with pytest.raises(ValueError, match="`max_logits`"):
        ProbeRequest(max_logits=value)


def test_the_bundled_attention_skips_its_statistics_pass_for_a_max_only_probe(monkeypatch):
    """On the torch backend a QK-Clip probe costs the forward no statistics pass; the largest
    logits it reads are those the statistics would give."""
    import qkmonitor.models.attention as bundled
    from qkmonitor.attention.adapters import find_attention_layers
    from qkmonitor.models import DecoderLM, TransformerConfig

    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2))
    tokens = torch.randint(0, 11, (2, 7))
    calls = []
    real = bundled.attention
    monkeypatch.setattr(
        bundled,
        "attention",
        lambda *a, **kw: calls.append(kw.get("return_stats")) or real(*a, **kw),
    )
    (layer,) = find_attention_layers(model)
    max_only = layer.open_probe(ProbeRequest(stats=False, max_logits=True))
    with torch.no_grad():
        model(tokens)
    largest = max_only.close().max_logits
    assert calls == [None]  # no statistics asked of the kernel
    with_stats = layer.open_probe(ProbeRequest(stats=True))
    with torch.no_grad():
        model(tokens)
    (stats,) = with_stats.close().stats
    assert calls == [None, True]
    torch.testing.assert_close(largest[0], stats.max_logit.amax(-1), rtol=1e-6, atol=1e-6)
    assert not layer.module._observers  # both probes removed what they installed
