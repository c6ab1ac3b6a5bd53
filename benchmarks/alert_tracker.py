"""What one probe costs the alert tracker: ``AlertTracker.update`` with the default rules, per
update, on grids of (layers × heads) cells.

Two kinds of values: "quiet" (every metric near 0.3, past few levels: a healthy run) and "noisy"
(uniform in [0, 1]: many cells past a level, streaks and alerts). CPU time
(``time.process_time``) per update, the best of ``--repeats`` passes over ``--probes`` updates.
To compare two versions of the tracker, run this file on each (it needs nothing but
``qkmonitor.alerts``).

Usage::

    python benchmarks/alert_tracker.py
    python benchmarks/alert_tracker.py --probes 20 --repeats 5
"""

from __future__ import annotations

import argparse
import time

import torch

from qkmonitor.alerts import DEFAULT_RULES, AlertTracker


def values(layers: int, heads: int, quiet: bool, gen: torch.Generator) -> dict:
    metrics = sorted({m for rule in DEFAULT_RULES for m in rule.metrics})
    if quiet:
        return {m: [0.3 + 0.01 * torch.rand(heads, generator=gen) for _ in range(layers)]
                for m in metrics}  # fmt: skip
    return {m: [torch.rand(heads, generator=gen) for _ in range(layers)] for m in metrics}


def per_update(layers: int, heads: int, quiet: bool, probes: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(0)
    grids = [values(layers, heads, quiet, gen) for _ in range(probes)]
    names = [f"layer{i}" for i in range(layers)]
    best = float("inf")
    for _ in range(repeats):
        tracker = AlertTracker(list(DEFAULT_RULES))
        start = time.process_time()
        for i, grid in enumerate(grids):
            tracker.update(grid, 10 * i, names, losses=[(10 * i, 1.0)], first_loss=2.0)
        best = min(best, (time.process_time() - start) / probes)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{len(DEFAULT_RULES)} default rules; CPU ms per update (best of {args.repeats})")
    for layers, heads in ((4, 8), (12, 12), (80, 64)):
        probes = args.probes if layers * heads < 1000 else max(2, args.probes // 8)
        cells = [
            f"{kind} {per_update(layers, heads, kind == 'quiet', probes, args.repeats) * 1e3:.2f}"
            for kind in ("quiet", "noisy")
        ]
        print(f"  {layers:3d} x {heads:2d} cells: " + ", ".join(cells))


if __name__ == "__main__":
    main()
