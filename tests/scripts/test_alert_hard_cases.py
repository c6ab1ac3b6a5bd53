"""Issue 31's two hard cases, as runs of the calibration sweep (``benchmarks/instability.py``'s own
``train_run``: the default rules live, every 10 steps, AdamW, one thread), each in under 30 s:

- healthy induction-head formation without warmup at learning rate 0.03: the largest attention
  logit grows past 500 while the loss falls to a solved task's. Its logits grow as fast as a
  failing run's; the loss gate and the update ratio's level keep every default rule quiet.
- a character-level decoder without warmup at learning rate 0.03 fails: its logits run away past
  500 and its loss ends 1.2 x or more above its twin's at learning rate 0.01. The defaults flag it
  at least 10 steps before the loss separates, and say nothing about the twin.

All are calibration runs (seeds 0 and 1; seed 0): the rules were fitted on them. What the rules
do on runs they were not fitted on is the sweep's validation set (docs/alerts.md).
"""

from __future__ import annotations

import pytest


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
@pytest.mark.parametrize(
    "seed",
    [
        0,
        pytest.param(
            1,
            marks=pytest.mark.xfail(
                reason="a known false alarm (issue 41's fresh install, 2026-12-03): in a fresh "
                "environment this healthy run's fast_updates fires at step 210 (max_logit 160, "
                "q_update_ratio 0.084 against 0.08), on the code before and after issue 41; the "
                "machine whose packages the rule was fitted on kept it silent; docs/alerts.md",
                strict=True,  # it passing again says the environment changed: look again
            ),
        ),
    ],
)
def test_healthy_induction_with_logits_past_500_stays_silent(instability, seed):
    record = run(instability, "induction", 0.03, seed)
    assert record.max_logit > 500
    assert mean(record.losses[-20:]) < 0.1 * mean(record.losses[:10])  # the task is solved
    assert record.live_alerts == [], [a["message"][:160] for a in record.live_alerts]


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
