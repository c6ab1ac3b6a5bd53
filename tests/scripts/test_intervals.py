"""The detector figures' 95 % intervals (benchmarks/intervals.py, issue 61 item 4) against values
derived by hand from their formulas."""

from __future__ import annotations

import math

import pytest


@pytest.fixture(scope="module")
def intervals(benchmark_module):
    return benchmark_module("intervals")


def test_wilson_at_none_and_all(intervals):
    z2 = (
        intervals.Z95**2
    )  # 3.8415; at k = 0 the upper bound is z²/(n + z²), at k = n the lower n/(n + z²)
    assert intervals.wilson(0, 40) == (0.0, pytest.approx(z2 / (40 + z2), abs=1e-12))
    assert intervals.wilson(40, 40) == (pytest.approx(40 / (40 + z2), abs=1e-12), 1.0)
    high = intervals.wilson(0, 40)[1]
    assert high == pytest.approx(
        0.0876, abs=5e-5
    )  # 1 in 40 = 0.025 lies inside: 0/40 proves no target
    assert intervals.wilson(40, 40)[0] == pytest.approx(0.9124, abs=5e-5)


def test_wilson_in_between(intervals):
    # 16/27: p = 0.5926; centre (p + z²/54) / (1 + z²/27),
    # half-width z / (1 + z²/27) · √(p(1-p)/27 + z²/2916)
    z, n, p = intervals.Z95, 27, 16 / 27
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low, high = intervals.wilson(16, 27)
    assert (low, high) == (pytest.approx(centre - half), pytest.approx(centre + half))
    assert (round(low, 3), round(high, 3)) == (0.407, 0.755)  # the sweep's validation, rounded
    assert low < p < high and centre < p  # pulled towards 1/2
    # symmetric: k of n and n - k of n mirror each other
    assert intervals.wilson(11, 27) == (pytest.approx(1 - high), pytest.approx(1 - low))


def test_wilson_refuses_and_empty(intervals):
    assert intervals.wilson(0, 0) is None
    with pytest.raises(ValueError):
        intervals.wilson(5, 4)
    assert intervals.fmt_share(16, 27) == "16/27 (59 %; 41–75 %)"


def test_median_interval_order_statistics(intervals):
    # n = 5: P(Bin(5, 1/2) = 0) = 1/32; the smallest and largest cover the median with 1 - 2/32
    assert intervals.median_interval([5, 1, 4, 2, 3]) == (1, 5, pytest.approx(1 - 2 / 32))
    # n = 10: j = 2 covers with 1 - 2 (1 + 10)/1024 = 0.9785;
    # j = 3 with 1 - 2·56/1024 = 0.891 < 0.95
    values = list(range(10))
    assert intervals.median_interval(values) == (1, 8, pytest.approx(1 - 2 * 11 / 1024))
    assert intervals.median_interval([]) is None
    assert intervals.fmt_median([5, 1, 4, 2, 3]) == "3 (1 to 5, 94 %)"
