"""Round 3's default rules on the new evidence (issue 31), on values whose verdict follows from the
rules' definitions:

- ``fast_updates``: a head's largest logit >= 30 *and* its query update ratio >= 0.08, at the same
  head and probe, with no loss gate;
- ``logit_plateau``: a head's largest logit >= 150 *and* the training loss no lower than its best
  earlier probe (``loss_vs_best >= 1``), quiet while the loss falls by 5 % per 10 steps or the task
  is solved.

The messages name the channels that agreed. The entropy engine alone (no spectrum engine to read
the update ratio from) skips ``fast_updates`` with one line, not a warning.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from qkmonitor.alerts import (
    DEFAULT_RULES,
    FAST_UPDATES_RULE,
    LOGIT_PLATEAU_RULE,
    AlertTracker,
    channel_of,
)
from qkmonitor.engine import AttentionEntropy, Monitoring
from qkmonitor.output.sinks import MemorySink

from .tiny import TOKENS, decoder

LAYER = ["blocks.0.attn"]


def fast(logits: list[float], ratios: list[float], step: int = 10):
    tracker = AlertTracker([FAST_UPDATES_RULE])
    values = {"max_logit": [torch.tensor(logits)], "q_update_ratio": [torch.tensor(ratios)]}
    return tracker.update(values, step, LAYER)


def test_fast_updates_needs_both_at_the_same_head():
    # head 0: logit only; head 1: ratio only; head 2: both; head 3: both, the logit at its level;
    # head 4: the ratio just under its level (round 4: 0.1)
    fired = fast([40.0, 10.0, 31.0, 30.0, 50.0], [0.01, 0.5, 0.11, 0.2, 0.099])
    assert [a.head for a in fired] == [2, 3]
    assert fired[0].also_values == (pytest.approx(0.11),)
    # a NaN ratio (no update seen yet) fires nothing
    assert fast([100.0], [float("nan")]) == []


def plateau(losses: list[float], logit: float, step: int, entropy: float = 0.01):
    """Feed the rule probes at 10, 20, ..., ``step`` with ``logit``, ``entropy`` (the head's
    entropy_norm) and the per-step ``losses`` (the engine's loss signals, computed as
    ``AlertPolicy`` does)."""
    from qkmonitor.alerts import run_signals

    tracker = AlertTracker([LOGIT_PLATEAU_RULE])
    history = list(enumerate(losses))
    best, fired = None, []
    for probe in range(10, step + 1, 10):
        seen = [(s, v) for s, v in history if s <= probe]
        signals, now = run_signals(seen, probe, best)
        values = {
            "max_logit": [torch.tensor([logit])],
            "loss_vs_best": [torch.tensor([signals["loss_vs_best"]])],
            "entropy_norm": [torch.tensor([entropy])],
        }
        fired += tracker.update(values, probe, LAYER, losses=seen, first_loss=losses[0])
        best = now if best is None or (now is not None and now < best) else best
    return fired


def test_logit_plateau_fires_when_the_loss_stops_improving_not_while_it_falls():
    falling = [4.0 * 0.97**s for s in range(61)]  # 26 % less every 10 steps: learning
    assert plateau(falling, 500.0, 60) == []
    stalled = [4.0 - 0.01 * s for s in range(31)] + [3.7] * 30  # flat from step 30
    fired = plateau(stalled, 500.0, 60)
    # at 40 the mean of steps 31-40 (3.7) is below step 30's (3.745): a new best; at 50 it equals
    # the best: loss_vs_best = 1, and the loss no longer falls by 5 % per 10 steps
    assert [a.step for a in fired] == [50]
    assert fired[0].also_values == (pytest.approx(1.0), pytest.approx(0.01))
    assert plateau(stalled, 149.0, 60) == []  # below the level: nothing
    assert plateau(stalled, 500.0, 60, entropy=0.03) == []  # a head not saturated: nothing
    solved = [4.0] * 10 + [0.2] * 51  # a twentieth of its first loss: solved, sharp on purpose
    assert plateau(solved, 500.0, 60) == []


def test_the_new_rules_are_defaults_of_the_entropy_engine():
    assert {FAST_UPDATES_RULE, LOGIT_PLATEAU_RULE} <= set(DEFAULT_RULES)
    assert {FAST_UPDATES_RULE, LOGIT_PLATEAU_RULE} <= set(AttentionEntropy().alerting.tracker.rules)


def test_a_combined_alert_names_the_channels_that_agreed():
    (alert,) = fast([45.0], [0.121])
    text = alert.message(0.03)
    assert "max_logit = 45 from the attention, q_update_ratio = 0.121 from the optimizer" in text
    (alert,) = plateau([4.0 - 0.01 * s for s in range(31)] + [3.7] * 30, 245.0, 60)
    assert "loss_vs_best = 1 from the training loss" in alert.message()
    assert channel_of("kappa") == "QK spectrum" and channel_of("output_lse_rms") == "output logits"


def test_one_rule_on_one_channel_names_none():
    from qkmonitor.alerts import LOGIT_BURST_RULE

    tracker = AlertTracker([LOGIT_BURST_RULE])
    tracker.update({"max_logit": [torch.tensor([2.0])]}, 0, LAYER)
    (alert,) = tracker.update({"max_logit": [torch.tensor([60.0])]}, 10, LAYER)
    assert " from the " not in alert.message()


def test_the_entropy_engine_alone_skips_fast_updates_with_one_line(caplog):
    model = decoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with caplog.at_level(logging.INFO, logger="qkmonitor"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a default left unused is no fault
        with Monitoring(
            model, [AttentionEntropy()], writer=MemorySink(), every_n_steps=2, optimizer=optimizer
        ) as monitoring:
            for step in range(5):
                with monitoring.step(step):
                    loss = model(TOKENS).logsumexp(-1).mean()
                    monitoring.observe_loss(loss.detach())
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
    lines = [r.getMessage() for r in caplog.records if "q_update_ratio" in r.getMessage()]
    assert len(lines) == 1
    assert "fast_updates" in lines[0] and "QKSpectrumMonitor" in lines[0]
