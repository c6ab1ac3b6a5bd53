"""A miniature attention-logit-growth instability (Wortsman et al. 2023) with the default rules.

Two runs of the bundled decoder on associative recall, identical but for QK-norm, at a peak
learning rate of 0.1: without QK-norm the attention logits run away and the loss stalls; with it the
run trains. The default rules must flag the first before its loss separates from the second, and
say nothing about the second. ``benchmarks/instability.py`` is the full sweep this reproduces.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest

from qkmonitor.alerts import Alert
from qkmonitor.engine import AttentionEntropy, EffectiveRank, QKSpectrum

EVERY = 10


def train(
    train_recall_miniature: Callable[..., list[float]],
    qk_norm: bool,
    seed: int = 0,
    observe_loss: bool = True,
) -> tuple[list[float], list[Alert]]:
    """The miniature's 150 steps (``train_recall_miniature``, the fixture) with all three monitors
    and their default rules, the loss handed to them or not: (losses, alerts)."""
    fired: list[Alert] = []
    engines = [
        QKSpectrum(on_alert=lambda owner, alert: fired.append(alert)),
        AttentionEntropy(on_alert=lambda owner, alert: fired.append(alert)),
        EffectiveRank(max_probe_tokens=12, on_alert=lambda owner, alert: fired.append(alert)),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the alerts are collected through on_alert
        losses = train_recall_miniature(
            engines, qk_norm=qk_norm, seed=seed, every_n_steps=EVERY, observe_loss=observe_loss
        )
    return losses, fired


def trailing_mean(values: list[float], window: int = 10) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def separation_step(losses: list[float], reference: list[float], ratio: float = 1.1) -> int | None:
    """The first step from which the smoothed loss stays above ``ratio`` x the reference's."""
    above = [a > ratio * b for a, b in zip(trailing_mean(losses), trailing_mean(reference))]
    if not above[-1]:
        return None
    step = len(above)
    while step > 0 and above[step - 1]:
        step -= 1
    return step


@pytest.mark.slow  # two 150-step runs with all three monitors, each way
@pytest.mark.parametrize("observe_loss", [False, True], ids=["without-loss", "with-loss"])
def test_the_unstable_run_is_flagged_in_time_and_its_qk_norm_twin_is_not(
    train_recall_miniature, observe_loss
):
    """Without the loss the rules test their metric alone and flag the run before its loss
    separates. With it, the gated rules wait while the loss still falls, and the flag must be in
    time as ``benchmarks/instability.py`` defines it: >= 10 steps ahead of a separation after step
    30, else by the first probe at or after the separation."""
    unstable_losses, unstable_alerts = train(
        train_recall_miniature, qk_norm=False, observe_loss=observe_loss
    )
    stable_losses, stable_alerts = train(
        train_recall_miniature, qk_norm=True, observe_loss=observe_loss
    )

    # the instability is real: the run without QK-norm ends far behind its twin
    final = lambda losses: sum(losses[-20:]) / 20
    assert final(unstable_losses) >= 1.2 * final(stable_losses)
    separation = separation_step(unstable_losses, stable_losses)
    assert separation is not None

    assert stable_alerts == []
    assert unstable_alerts, "no alert on a run whose loss separated"
    first = min(alert.step for alert in unstable_alerts)
    if not observe_loss:
        assert first < separation, f"first alert at step {first}, separation at step {separation}"
    elif separation > 30:
        assert first <= separation - 10, (first, separation)
    else:
        assert first <= -(-separation // EVERY) * EVERY, (first, separation)
    earliest = [a for a in unstable_alerts if a.step == first]
    assert {a.rule.name for a in earliest} & {"logit_growth", "logit_burst", "logit_jump", "kappa"}
    assert all("Try:" in a.message() and "Evidence:" in a.message() for a in unstable_alerts)
