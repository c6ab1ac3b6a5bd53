"""``benchmarks/instability.py --arms``: the four arms of each run, and the verdicts on what QK-Clip
did to the failed and the healthy runs, from records whose losses are known (nothing trained)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest


@pytest.fixture(scope="module")
def instability(benchmark_module):
    return benchmark_module("instability")


def record(instability, spec, final: float, clips: int = 0):
    window = instability.FINAL_WINDOW
    return instability.RunRecord(spec, [final] * window, [final] * window, {}, [], 0.0, clips=clips)


def test_each_run_comes_in_four_arms_with_keys_of_their_own(instability):
    base = instability.RunSpec("recall", 0.1, False, 2, 50, 300)
    arms = instability.arm_specs([base], tau=100.0)
    assert [s.arm for s in arms] == ["AdamW", "AdamW + QK-Clip", "Muon", "Muon + QK-Clip"]
    assert len({s.key for s in arms}) == 4
    assert arms[0].key == base.key  # an AdamW run without the clip is the sweep's own run


def test_failed_runs_are_judged_by_their_clipped_twin_and_healthy_ones_by_their_change(
    instability,
):
    spec = instability.RunSpec
    floor = instability.FAMILIES["recall"].floor
    best = 1.0
    runs = []
    for optimizer in ("adamw", "muon"):
        good = spec("recall", 0.01, False, 2, 50, 300, optimizer)
        bad = spec("recall", 0.1, False, 2, 50, 300, optimizer)
        runs += [
            record(instability, good, best if optimizer == "adamw" else 1.02),
            record(instability, replace(good, clip_tau=100.0), 1.03),
            record(instability, bad, 2.0),  # failed: 2 x the best, at a rate above the best one
            record(
                instability,
                replace(bad, clip_tau=100.0),
                1.05 if optimizer == "adamw" else 1.6,
                clips=7,
            ),
        ]
    stats = instability.arms_summary(runs)
    assert stats["families"]["recall"]["best"] == {"adamw": best, "muon": 1.02}
    failed = {r["arm"]: r for r in stats["failed"]}
    assert set(failed) == {"AdamW", "Muon"}

    def ratio(loss: float) -> float:
        return (loss + floor) / (best + floor)

    assert failed["AdamW"]["clipped_ratio"] == pytest.approx(ratio(1.05))
    assert failed["Muon"]["clipped_ratio"] == pytest.approx((1.6 + floor) / (1.02 + floor))
    assert failed["AdamW"]["clips"] == 7
    assert stats["rescued"] == 1  # AdamW's twin ends within 1.1 x the best; Muon's does not
    changes = {r["arm"]: r["change"] for r in stats["healthy"]}
    assert changes["AdamW"] == pytest.approx((1.03 + floor) / (1.0 + floor) - 1)
    assert changes["Muon"] == pytest.approx((1.03 + floor) / (1.02 + floor) - 1)
    table = instability.arms_table(runs, stats)
    assert "failed runs rescued (within 1.1 x the best): 1 of 2" in table
    assert not math.isnan(stats["healthy_changes"][0])
