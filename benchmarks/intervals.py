"""95 % intervals for the sweep's detector figures (issue 61, item 4).

``wilson``: the Wilson score interval of a proportion k/n (Wilson 1927), which unlike the normal
approximation stays inside [0, 1] and is not empty at 0/n or n/n. ``median_interval``: the
distribution-free order-statistic interval of a median (the binomial one: the sample's j-th
smallest and j-th largest values cover the median with probability 1 - 2 P(Bin(n, 1/2) < j)),
whose coverage is exact but comes in steps; with 5 values or fewer no pair reaches 95 %, and the
widest (smallest to largest) is given with its own coverage.
"""

from __future__ import annotations

import math
import statistics
from statistics import NormalDist

Z95 = NormalDist().inv_cdf(0.975)  # 1.959964...


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval ``(low, high)`` of the proportion ``k / n`` at the normal
    quantile ``z`` (default: 95 %): ``(p + z²/2n ± z √(p(1 - p)/n + z²/4n²)) / (1 + z²/n)``;
    None for ``n = 0``."""
    if not 0 <= k <= n:
        raise ValueError(f"Expected 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return None
    p, zz = k / n, z * z
    centre = (p + zz / (2 * n)) / (1 + zz / n)
    half = z / (1 + zz / n) * math.sqrt(p * (1 - p) / n + zz / (4 * n * n))
    # at k = 0 and k = n the bound is exactly 0 or 1 (the formula's rounding may miss it)
    low = 0.0 if k == 0 else max(0.0, centre - half)
    high = 1.0 if k == n else min(1.0, centre + half)
    return low, high


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """``(low, high, coverage)``: the order-statistic interval of the median of ``values``, the
    narrowest symmetric pair of order statistics whose coverage is at least ``level`` (or, for
    too few values, the smallest and largest, with their coverage below it); None without
    values."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        return None

    def coverage(j: int) -> float:  # P(x_(j) <= median <= x_(n-j+1))
        below = sum(math.comb(n, i) for i in range(j)) / 2**n
        return 1 - 2 * below

    j = 1
    while j + 1 <= (n + 1) // 2 and coverage(j + 1) >= level:
        j += 1
    return xs[j - 1], xs[n - j], coverage(j)


def share(k: int, n: int) -> dict[str, object]:
    """``k`` of ``n`` with its share and 95 % Wilson interval, for the JSON."""
    interval = wilson(k, n)
    return {
        "k": k,
        "n": n,
        "share": k / n if n else None,
        "wilson95": None if interval is None else [round(interval[0], 4), round(interval[1], 4)],
    }


def fmt_share(k: int, n: int) -> str:
    """``"16/27 (59 %; 41–75 %)"``: the count, the share and its 95 % Wilson interval."""
    interval = wilson(k, n)
    if interval is None:
        return "0/0"
    low, high = (round(100 * x) for x in interval)
    return f"{k}/{n} ({round(100 * k / n)} %; {low}–{high} %)"


def fmt_median(values: list[float]) -> str:
    """``"57 (48–70, 94 %)"``: the median and its order-statistic interval with its coverage."""
    interval = median_interval(values)
    if interval is None:
        return "—"
    median = statistics.median(values)
    low, high, cover = interval
    return f"{median:g} ({low:g} to {high:g}, {100 * cover:.0f} %)"
