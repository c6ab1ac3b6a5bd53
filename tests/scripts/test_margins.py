"""``benchmarks/margins.py``'s margins (issue 61, item 3) against values derived by hand: a rule of
``patience`` 2 is as near as the farther of two probes in a row, a closed loss gate hides a probe,
and the healthy seeds beside failures are reported apart from the groups held to 20 %."""

from __future__ import annotations

import math

import pytest

from qkmonitor.alerts import LOW_RANK_UPDATES_RULE


@pytest.fixture(scope="module")
def margins(benchmark_module):
    return benchmark_module("margins")


def record(instability, shares: list[float], losses: list[float]):
    """A one-layer, one-head run probed every 10 steps with ``qk_update_top_share`` ``shares``."""
    probes = {10 * i: {"qk_update_top_share": [[v]]} for i, v in enumerate(shares)}
    spec = instability.RunSpec("induction", 0.01, False, 0, 0, len(losses))
    return instability.RunRecord(spec, losses, losses, probes, [], 0.0)


def test_patience_takes_the_farther_of_two_probes_in_a_row(margins, instability):
    flat = [3.0] * 41  # not learning, not solved: the gate is open at every probe
    rule = LOW_RANK_UPDATES_RULE  # >= 0.7, two probes in a row
    m = margins.rule_margins([record(instability, [0.2, 0.35, 0.63, 0.56, 0.35], flat)], rule)
    # the closest pair is (0.63, 0.56): the farther, 0.56, is 1 - 0.56 / 0.7 = 20 % short
    assert m["closest"]["margin"] == pytest.approx(1 - 0.56 / 0.7)
    assert m["closest"]["step"] == 30 and m["fired"] == []
    fired = margins.rule_margins([record(instability, [0.2, 0.8, 0.75, 0.3, 0.3], flat)], rule)
    assert fired["closest"]["margin"] == pytest.approx(1 - 0.75 / 0.7)
    assert fired["closest"]["margin"] < 0
    assert fired["fired"] == ["induction-lr0.01-qk0-s0-w0-n41"]
    # one probe past the level alone is not a firing: the one before it counts
    alone = margins.rule_margins([record(instability, [0.2, 0.35, 0.9, 0.35, 0.35], flat)], rule)
    assert alone["closest"]["margin"] == pytest.approx(1 - 0.35 / 0.7)


def test_a_probe_behind_a_closed_gate_does_not_count(margins, instability):
    solved = [3.0] * 10 + [0.01] * 31  # under a tenth of its first loss from step 10 on
    m = margins.rule_margins(
        [record(instability, [0.2, 0.9, 0.9, 0.9, 0.9], solved)], LOW_RANK_UPDATES_RULE
    )
    assert math.isinf(m["closest"]["margin"]) and m["fired"] == []


def test_seeds_beside_failures_are_not_held_to_the_margin(margins):
    assert not margins.held(f"sweep {margins.BESIDE}, 1 thread")
    assert margins.held("sweep healthy, safe settings, 1 thread")
    assert margins.held("fault twins, 2 threads")
