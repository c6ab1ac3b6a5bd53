"""Round 4's rule mechanics (issue 61): a gate on a solved run alone (``solved_fraction`` without
``learning_drop``), the advice that names the fix for the kind of model (``{rounding}``), and
``low_rank_updates``, a default of the spectrum monitor only where its metric is measured."""

from __future__ import annotations

import pytest
import torch

from qkmonitor.alerts import (
    FAST_UPDATES_RULE,
    LOW_RANK_UPDATES_RULE,
    AlertRule,
    AlertTracker,
    LogitGrowthWarning,
    LowRankUpdateWarning,
    advice_for,
)
from qkmonitor.engine import QKSpectrum

LAYER = ["blocks.0.attn"]


def solved_only(**changes) -> AlertRule:
    fields = dict(
        name="solved_only", metric="max_logit", threshold=30.0, above=True, patience=1,
        margin=5.0, warning=LogitGrowthWarning, meaning="test", advice="test",
        solved_fraction=0.1,
    )  # fmt: skip
    return AlertRule(**{**fields, **changes})


def fire(rule: AlertRule, losses: list[float], step: int = 40) -> list:
    tracker = AlertTracker([rule])
    seen = list(enumerate(losses))
    values = {"max_logit": [torch.tensor([100.0])]}
    return tracker.update(values, step, LAYER, losses=seen, first_loss=sum(losses[:10]) / 10)


def test_a_solved_gate_alone_quiets_a_solved_run_and_nothing_else():
    rule = solved_only()
    assert rule.reads_loss and rule.learning_drop is None
    assert fire(rule, [4.0] * 10 + [0.2] * 31) == []  # a twentieth of its first: solved
    # a falling loss that is not solved: no learning gate, so it fires
    assert len(fire(rule, [4.0 * 0.97**s for s in range(41)])) == 1
    assert rule.describe().endswith("unless the training loss is below 10% of its first value")
    assert not solved_only(solved_fraction=None).reads_loss


def test_fast_updates_is_quiet_on_a_solved_run_only():
    tracker = AlertTracker([FAST_UPDATES_RULE])
    values = {"max_logit": [torch.tensor([300.0])], "q_update_ratio": [torch.tensor([0.12])]}
    solved = list(enumerate([4.0] * 10 + [0.01] * 31))
    assert tracker.update(values, 40, LAYER, losses=solved, first_loss=4.0) == []
    falling = list(enumerate([4.0 * 0.9**s for s in range(11)]))
    assert len(AlertTracker([FAST_UPDATES_RULE]).update(values, 10, LAYER, losses=falling)) == 1


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("qkmonitor.MultiHeadAttention", "TransformerConfig(attention_rounding='unbiased')"),
        ("transformers.LlamaAttention", "normalize P.V by the sum of the rounded softmax weights"),
        ("", "compute P.V in float32"),
    ],
)
def test_the_rounding_advice_fits_the_model(kind, expected):
    text = advice_for(LOW_RANK_UPDATES_RULE.advice, kind)
    assert expected in text and "{rounding}" not in text


def test_low_rank_updates_is_a_default_only_with_the_update_spectrum_and_says_so():
    assert [r.name for r in QKSpectrum().alerting.tracker.rules] == ["kappa"]
    on = QKSpectrum(update_spectrum=True)
    assert [r.name for r in on.alerting.tracker.rules] == ["kappa", "low_rank_updates"]
    tracker = AlertTracker([LOW_RANK_UPDATES_RULE])
    values = {"qk_update_top_share": [torch.tensor([0.9, 0.3])]}
    assert tracker.update(values, 10, LAYER) == []  # one probe: patience is two
    (alert,) = tracker.update(values, 20, LAYER)
    assert alert.head == 0 and alert.rule.warning is LowRankUpdateWarning
    text = alert.with_layer_kind("qkmonitor.MultiHeadAttention").message()
    assert "attention_rounding='unbiased'" in text and "[qkmonitor:low_rank_updates]" in text
