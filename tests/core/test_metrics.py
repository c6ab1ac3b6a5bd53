"""torchmetrics aggregators against sums written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from qkmonitor.kernels import AttentionStats
from qkmonitor.measures.metrics import AttentionStatistics, HeadMean


def stats(entropy, attended, max_prob, max_logit):
    t = lambda v: torch.tensor(v, dtype=torch.float32)[None]
    return AttentionStats(
        lse=t(max_logit),
        entropy=t(entropy),
        max_prob=t(max_prob),
        max_logit=t(max_logit),
        attended=t(attended),
    )


def test_attention_statistics_means_leave_out_masked_and_single_key_rows():
    metric = AttentionStatistics(num_heads=1)
    metric.update(
        stats(
            [[0.0, 0.6, 1.0, 0.0]],
            [[1, 2, 4, 0]],
            [[1.0, 0.7, 0.5, 0.0]],
            [[0.5, 2.0, 1.0, -math.inf]],
        )
    )
    metric.update(stats([[0.3]], [[3]], [[0.9]], [[4.0]]))
    out = metric.compute()
    assert out["entropy"].item() == pytest.approx(
        (0.0 + 0.6 + 1.0 + 0.3) / 4
    )  # the fully masked row is out
    assert out["entropy_norm"].item() == pytest.approx(
        (0.6 / math.log(2) + 1.0 / math.log(4) + 0.3 / math.log(3)) / 3
    )
    assert out["max_prob"].item() == pytest.approx((1.0 + 0.7 + 0.5 + 0.9) / 4)
    assert out["max_logit"].item() == 4.0
    with pytest.raises(ValueError, match=r"shape \(B, 1, N\)"):
        metric.update(stats([[0.1], [0.2]], [[2], [2]], [[0.5], [0.5]], [[1.0], [1.0]]))


def test_head_mean_passes_nan_on_leaves_out_unkept_samples_and_gives_nan_for_empty_slots():
    metric = HeadMean(num_heads=3)
    values = torch.tensor([[1.0, float("nan"), 5.0], [3.0, 2.0, 7.0]])
    keep = torch.tensor([[True, True, False], [True, True, False]])
    metric.update(values, keep)
    out = metric.compute()
    assert out[0].item() == 2.0  # (1 + 3) / 2
    assert math.isnan(out[1].item())  # a broken sample is never averaged away
    assert math.isnan(out[2].item())  # no sample kept
    with pytest.raises(ValueError, match="`num_heads`"):
        HeadMean(num_heads=0)


def test_attention_statistics_carry_nan_rows_to_nan_heads():
    """A NaN row (a NaN score) is not a masked row: its head's means turn NaN, other heads not."""
    nan, inf = math.nan, math.inf
    rows = {"entropy": [[0.5, nan], [0.4, 0.2]], "attended": [[3, 3], [3, 3]],
            "max_prob": [[0.6, nan], [0.5, 0.7]],
            "max_logit": [[1.0, nan], [2.0, 3.0]]}  # fmt: skip

    def t(values):  # (1, H, N)
        return torch.tensor(values, dtype=torch.float32)[None]

    metric = AttentionStatistics(num_heads=2)
    metric.update(AttentionStats(lse=t(rows["max_logit"]), sink_mass=t([[0.1, nan], [0.2, 0.3]]),
                                 **{k: t(v) for k, v in rows.items()}))  # fmt: skip
    out = metric.compute()
    for name in ("entropy", "entropy_norm", "max_prob", "max_logit", "sink_mass"):
        assert out[name][0].isnan(), name
        assert torch.isfinite(out[name][1]), name
    assert out["entropy"][1].item() == pytest.approx(0.3)
    # A +inf score: max_logit +inf, the probability statistics NaN.
    metric = AttentionStatistics(num_heads=1)
    metric.update(stats([[nan, 0.3]], [[2, 2]], [[nan, 0.8]], [[inf, 1.0]]))
    out = metric.compute()
    assert out["max_logit"].item() == inf and out["entropy"].isnan() and out["max_prob"].isnan()


def test_head_mean_columns_hold_several_quantities_side_by_side():
    """Updating column ranges of one HeadMean gives what separate HeadMeans give, slot by slot."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 3, generator=gen), torch.randn(2, 1, generator=gen)
    keep = torch.rand(5, 3, generator=gen) > 0.3
    together = HeadMean(4)
    together.update(a, keep, columns=slice(0, 3))
    together.update(b, columns=slice(3, 4))
    together.update(a[:1], columns=slice(0, 3))
    first, second = HeadMean(3), HeadMean(1)
    first.update(a, keep)
    first.update(a[:1])
    second.update(b)
    torch.testing.assert_close(
        together.compute(), torch.cat([first.compute(), second.compute().reshape(1)])
    )
    with pytest.raises(RuntimeError):
        together.update(torch.ones(2, 2), columns=slice(0, 3))  # 2 values for 3 columns
