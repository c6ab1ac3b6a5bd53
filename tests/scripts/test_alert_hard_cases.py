"""Issue 31's two hard cases, as runs of the calibration sweep (``benchmarks/instability.py``'s own
``train_run``: the default rules live, every 10 steps, AdamW, one thread), each in under 30 s:

- healthy induction-head formation without warmup at learning rate 0.03: the largest attention
  logit grows past 500 while the loss falls to a solved task's. Its logits grow as fast as a
  failing run's; the loss gate and the update ratio's level keep every default rule quiet, but for
  fast_updates, which this run sits at the threshold of (a known false alarm, environment-bound).
- a character-level decoder without warmup at learning rate 0.03 fails: its logits run away past
  500 and its loss ends 1.2 x or more above its twin's at learning rate 0.01. The defaults flag it
  at least 10 steps before the loss separates, and say nothing about the twin.

All are calibration runs (seeds 0 and 1; seed 0): the rules were fitted on them. What the rules
do on runs they were not fitted on is the sweep's validation set (docs/alerts.md).
"""

from __future__ import annotations

import re

import pytest

from qkmonitor.alerts import FAST_UPDATES_RULE


@pytest.fixture(scope="module")
def instability(benchmark_module):
    return benchmark_module("instability")


def run(instability, family: str, lr: float, seed: int = 0):
    spec = instability.RunSpec(
        family, lr, False, seed, 0, instability.FAMILIES[family].steps
    )  # no warmup
    assert spec.split == "calibration"
    return instability.train_run(spec)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow  # one 300-step run of the sweep's induction decoder
@pytest.mark.parametrize("seed", [0, 1])
def test_healthy_induction_with_logits_past_500_alerts_at_most_at_the_threshold(instability, seed):
    """The rules stay quiet on this healthy run, except for a known false alarm: it sits at
    fast_updates' threshold, and whether it crosses depends on the installed packages (on
    2026-12-03's fresh install seed 1 fired, at q_update_ratio 0.084; on 2026-12-04's seed 0, at
    0.081 and 0.090 on two heads; the code the same, and the machine the rule was fitted on kept
    both silent; docs/alerts.md). What holds in each: the run is healthy, and any alert is
    fast_updates' with an update ratio under 1.25 x its threshold: a call at its edge."""
    record = run(instability, "induction", 0.03, seed)
    assert record.max_logit > 500
    assert mean(record.losses[-20:]) < 0.1 * mean(record.losses[:10])  # the task is solved
    (threshold,) = [c.threshold for c in FAST_UPDATES_RULE.also if c.metric == "q_update_ratio"]
    for alert in record.live_alerts:
        assert alert["rule"] == FAST_UPDATES_RULE.name, alert["message"][:160]
        ratio = float(re.search(r"q_update_ratio = ([0-9.e+-]+)", alert["message"]).group(1))
        assert threshold <= ratio < 1.25 * threshold, alert["message"][:160]


@pytest.mark.slow  # two 250-step runs of the sweep's character-level decoder
def test_a_no_warmup_failure_with_runaway_logits_is_flagged_before_its_loss_separates(instability):
    failing = run(instability, "charlm", 0.03)
    twin = run(instability, "charlm", 0.01)
    floor = instability.FAMILIES["charlm"].floor
    assert failing.max_logit > 500
    assert (failing.final_loss + floor) >= 1.2 * (twin.final_loss + floor)  # it failed
    separation = instability.separation_step(failing, twin)
    assert separation is not None and separation > instability.EARLY
    first = min(a["step"] for a in failing.live_alerts)
    assert first <= separation - instability.MIN_LEAD, (first, separation)
    assert twin.live_alerts == [], [a["message"][:160] for a in twin.live_alerts]
