"""Attention-scale policies and the masked stable softmax, against formulas written out here."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from qkmonitor.models.scaling import (
    CriticalAttentionScaling,
    PolylogScale,
    StandardScale,
    make_attention_scale,
    stable_softmax,
)

N = torch.tensor([1, 2, 8, 64, 100, 128, 129, 1000, 4096, 10**6], dtype=torch.float64)


def test_standard_is_constant():
    policy = StandardScale(64)
    out = policy(N)
    assert out.dtype == torch.float64 and out.shape == N.shape
    assert torch.all(out == 1 / math.sqrt(64))
    assert policy.constant
    assert policy(torch.tensor([3, 4])).dtype == torch.float32  # integer counts -> float32


def test_log_n_is_standard_up_to_train_len_then_grows_like_log_n():
    d, length = 32, 128
    out = CriticalAttentionScaling(d, train_len=length)(N)
    ref = torch.tensor(
        [max(1.0, math.log(n) / math.log(length)) / math.sqrt(d) for n in N.tolist()],
        dtype=torch.float64,
    )
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)
    standard = 1 / math.sqrt(d)
    inside, beyond = N <= length, N > length
    assert torch.all(out[inside] == standard)
    assert torch.all(out[beyond] > standard)
    per_log = out[beyond] / N[beyond].log()  # λ(n) / log n is the constant 1 / (sqrt(d) log L)
    torch.testing.assert_close(
        per_log, torch.full_like(per_log, 1 / (math.sqrt(d) * math.log(length))), rtol=1e-12, atol=0
    )
    assert not CriticalAttentionScaling(d, train_len=length).constant


def test_polylog_below_standard_and_decreasing():
    d, c, p = 16, 0.5, 1.5
    out = PolylogScale(d, c=c, p=p)(N)
    ref = torch.tensor(
        [1 / math.sqrt(d * (1 + c * math.log(n) ** p)) for n in N.tolist()], dtype=torch.float64
    )
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)
    assert out[0] == 1 / math.sqrt(d)  # log 1 = 0: standard at a single key
    assert torch.all(out[1:] < 1 / math.sqrt(d))
    assert torch.all(out[1:] < out[:-1])


def test_policies_treat_zero_keys_as_one():
    for policy in (StandardScale(4), CriticalAttentionScaling(4, 8), PolylogScale(4, p=1.5)):
        out = policy(torch.tensor([0.0, 1.0]))
        assert torch.isfinite(out).all() and out[0] == out[1]


def test_entropy_direction_on_long_rows():
    torch.manual_seed(0)
    d, n = 16, 4096
    logits = torch.randn(8, n, dtype=torch.float64) * math.sqrt(
        d
    )  # q·k with unit-variance q, k entries

    def entropy(scale: float) -> torch.Tensor:
        p = torch.softmax(logits * scale, dim=-1)
        return -(p * p.log()).sum(-1).mean()

    keys = torch.tensor(float(n), dtype=torch.float64)
    h_std = entropy(StandardScale(d)(keys).item())
    h_log = entropy(CriticalAttentionScaling(d, train_len=64)(keys).item())
    h_poly = entropy(PolylogScale(d)(keys).item())
    assert h_log < h_std < h_poly  # log_n sharpens, polylog flattens


def test_factory_builds_each_policy_and_ignores_other_policies_options():
    options = {"train_len": 256, "c": 2.0, "p": 1.5}
    assert make_attention_scale("standard", 64, **options) == StandardScale(64)
    assert make_attention_scale("log_n", 64, **options) == CriticalAttentionScaling(64, 256)
    assert make_attention_scale("polylog", 64, **options) == PolylogScale(64, c=2.0, p=1.5)
    assert make_attention_scale("polylog", 64) == PolylogScale(64, c=1.0, p=1.0)
    for policy in ("standard", "log_n", "polylog"):
        assert policy in make_attention_scale(policy, 8, train_len=16).describe()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: make_attention_scale("sqrt", 64),
            r"supported: \['log_n', 'polylog', 'standard'\]",
        ),
        (lambda: make_attention_scale("log_n", 64), "needs `train_len`"),
        (
            lambda: make_attention_scale("standard", 64, temperature=2.0),
            r"Unknown attention scale options \['temperature'\]",
        ),
        (lambda: StandardScale(0), "`head_dim`"),
        (lambda: CriticalAttentionScaling(64, 1), "`train_len` to be an int >= 2"),
        (lambda: PolylogScale(64, c=-1.0), "`c`"),
        (lambda: PolylogScale(64, p=0.0), "`p`"),
    ],
)
def test_scale_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------- stable_softmax


def _ref_softmax(x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Row by row in float64 with the row max subtracted; rows with nothing allowed are zero."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for idx in itertools.product(*(range(s) for s in x.shape[:-1])):
        row, ok = x[idx].double(), allowed[idx]
        if ok.any():
            e = torch.where(ok, (row - row[ok].max()).exp(), torch.zeros_like(row))
            out[idx] = e / e.sum()
    return out


def test_stable_softmax_equals_torch_softmax_on_finite_rows():
    torch.manual_seed(1)
    x = torch.randn(3, 5, 7, dtype=torch.float64) * 10
    torch.testing.assert_close(stable_softmax(x), torch.softmax(x, dim=-1), rtol=0, atol=1e-14)
    torch.testing.assert_close(
        stable_softmax(x, dim=1), torch.softmax(x, dim=1), rtol=0, atol=1e-14
    )


def test_stable_softmax_masked_rows():
    torch.manual_seed(2)
    x = torch.randn(4, 6, dtype=torch.float64)
    mask = torch.rand(4, 6) > 0.4
    mask[1] = False  # a fully masked row
    mask[2] = True
    out = stable_softmax(x, mask=mask)
    torch.testing.assert_close(out, _ref_softmax(x, mask), rtol=0, atol=1e-14)
    assert torch.all(out[1] == 0) and not out.isnan().any()
    torch.testing.assert_close(out[2], torch.softmax(x[2], -1), rtol=0, atol=1e-14)
    torch.testing.assert_close(
        stable_softmax(x, mask=mask.int()), out, rtol=0, atol=0
    )  # 0/1 masks too


def test_stable_softmax_huge_logits_and_all_minus_inf():
    x = torch.tensor([[1e4, 1e4 - 1.0, -1e4], [1e4, 1e4, 1e4], [-math.inf] * 3])
    out = stable_softmax(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _ref_softmax(x, torch.isfinite(x)).float(), rtol=0, atol=1e-6)
    assert torch.all(out[2] == 0)
    half = stable_softmax(
        torch.tensor([[6e4, 6e4]], dtype=torch.float16), mask=torch.tensor([[True, False]])
    )
    assert half.dtype == torch.float16 and half.tolist() == [[1.0, 0.0]]
