"""The alert tracker on hand-made probe sequences: levels, trends, joint conditions, grace, QK-norm
layers, resume; and the messages."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from qkmonitor.alerts import (
    DEFAULT_RULES,
    ENTROPY_COLLAPSE_RULE,
    KAPPA_RULE,
    LOGIT_GROWTH_RULE,
    AlertRule,
    AlertTracker,
    Condition,
    LogitGrowthWarning,
    OverLocalizationWarning,
)

LEVEL = AlertRule(
    name="level",
    metric="m",
    threshold=10.0,
    above=True,
    patience=1,
    margin=1.0,
    warning=LogitGrowthWarning,
    meaning="m is high",
    advice="lower it",
)
TREND = LEVEL.replace(name="trend", threshold=5.0, growth=4.0, window=30)


def feed(
    tracker: AlertTracker, series: dict[int, list[float]], metric: str = "m", qk_norm_layers=()
) -> list:
    """Feed one layer of heads per step: step -> [head values]; return every alert fired."""
    fired = []
    for step, heads in series.items():
        fired += tracker.update(
            {metric: [torch.tensor(heads)]}, step, ["blocks.0.attn"], qk_norm_layers=qk_norm_layers
        )
    return fired


def test_a_level_rule_fires_once_and_again_only_after_recovering_past_the_margin():
    tracker = AlertTracker([LEVEL])
    fired = feed(tracker, {0: [12.0], 10: [15.0], 20: [9.5], 30: [12.0], 40: [8.9], 50: [10.0]})
    # 9.5 is not below 10 - 1, so the alert at 0 stays active through 30; 8.9 recovers; 10 fires
    # again
    assert [(a.step, a.value) for a in fired] == [(0, 12.0), (50, 10.0)]
    assert tracker.counts == {"level": 2}


def test_a_trend_is_measured_from_the_newest_value_at_least_a_window_old():
    tracker = AlertTracker([TREND])
    # head 0: 1, 2, 3, then 12 at step 30: x12 since step 0, 30 steps back -> fires at 30
    # head 1: 4, 6, 9, then 14 at step 30: 14 < 4 x 4, and at 40: 20 < 4 x 6 (step 10) -> never
    fired = feed(
        tracker, {0: [1.0, 4.0], 10: [2.0, 6.0], 20: [3.0, 9.0], 30: [12.0, 14.0], 40: [13.0, 20.0]}
    )
    assert [(a.head, a.step) for a in fired] == [(0, 30)]
    alert = fired[0]
    assert (alert.reference, alert.reference_step) == (1.0, 0)
    assert alert.ratio == pytest.approx(12.0)
    assert alert.trend() == "×12 over the last 30 steps (1 at step 0)"


def test_a_window_forgets_values_older_than_it():
    tracker = AlertTracker([TREND])
    # 1 at step 0, then 4.5 from step 10 on: at 40 the reference is step 10 (17 < 4 x 4.5), at 50
    # step 20 (18 = 4 x 4.5); the 1 of step 0 no longer counts
    fired = feed(tracker, {0: [1.0], 10: [4.5], 20: [4.5], 30: [4.5], 40: [17.0], 50: [18.0]})
    assert [a.step for a in fired] == [50]
    assert fired[0].reference == 4.5 and fired[0].reference_step == 20


def test_growth_from_the_run_start_and_a_below_rule_shrinking():
    start = TREND.replace(name="start", window=None, growth=2.0)
    shrink = TREND.replace(
        name="shrink", metric="m", threshold=0.5, above=False, growth=3.0, window=None
    )
    tracker = AlertTracker([start, shrink])
    fired = feed(tracker, {0: [3.0], 10: [5.9], 20: [6.0], 30: [0.9], 40: [0.5]})
    # start: 6 >= 2 x 3 at step 20; shrink: 0.5 <= 0.5 and <= 3 / 3 at step 40 (0.9 is above 0.5)
    assert [(a.rule.name, a.step) for a in fired] == [("start", 20), ("shrink", 40)]


def test_no_reference_no_trend_and_non_positive_references_do_not_count():
    tracker = AlertTracker([TREND])
    assert feed(tracker, {0: [100.0]}) == []  # nothing to grow from at the first probe
    tracker = AlertTracker([TREND])
    assert feed(tracker, {0: [-1.0], 30: [50.0]}) == []  # a ratio to a negative value means nothing


def test_nan_values_neither_fire_nor_enter_the_history():
    tracker = AlertTracker([TREND])
    fired = feed(tracker, {0: [math.nan], 10: [2.0], 20: [math.nan], 30: [9.0], 40: [9.0]})
    # at 30 nothing is 30 steps old (step 0 was NaN); at 40 step 10 is: 9 >= 4 x 2
    assert [(a.step, a.reference_step) for a in fired] == [(40, 10)]


def test_growth_is_a_rate_so_the_probe_interval_does_not_matter():
    rule = TREND.replace(window=20)  # x4 per 20 steps
    # probes 50 steps apart: x40 in 50 steps is 40 ** (20 / 50) = x4.37 per 20 steps; x30 is x3.90
    assert [a.step for a in feed(AlertTracker([rule]), {0: [1.0], 50: [40.0]})] == [50]
    assert feed(AlertTracker([rule]), {0: [1.0], 50: [30.0]}) == []


def test_patience_counts_consecutive_probes_where_level_and_trend_hold():
    tracker = AlertTracker([TREND.replace(patience=2)])
    fired = feed(
        tracker, {0: [1.0], 10: [1.0], 20: [1.0], 30: [20.0], 40: [3.0], 50: [30.0], 60: [200.0]}
    )
    # 30: 20 >= 4 x 1 (streak 1); 40: 3 is below the level (0); 50: 30 >= 4 x 1 (1); 60: 200 >= 4 x
    # 20 (2)
    assert [a.step for a in fired] == [60]


def test_grace_steps_hold_firing_but_not_the_streak():
    tracker = AlertTracker([LEVEL.replace(grace_steps=25, patience=2)])
    fired = feed(tracker, {0: [11.0], 10: [11.0], 20: [11.0], 30: [11.0]})
    assert [a.step for a in fired] == [30]


def test_joint_condition_with_its_own_trend():
    sharp_and_growing = AlertRule(
        name="joint",
        metric="entropy_norm",
        threshold=0.1,
        above=False,
        patience=1,
        margin=0.05,
        warning=LogitGrowthWarning,
        meaning="sharp and sharpening",
        advice="QK-norm",
        also=(Condition("max_logit", 10.0, above=True, growth=3.0, window=20),),
    )
    tracker = AlertTracker([sharp_and_growing])
    steps = {0: (0.05, 8.0), 10: (0.05, 12.0), 20: (0.05, 12.0), 30: (0.3, 40.0), 40: (0.05, 40.0)}
    fired = []
    for step, (entropy, logit) in steps.items():
        fired += tracker.update(
            {"entropy_norm": [torch.tensor([entropy])], "max_logit": [torch.tensor([logit])]},
            step,
            ["a"],
        )
    # a sharp head with steady logits (0-20) is quiet; at 30 logits grew but the head is not sharp;
    # at 40 both hold (40 >= 3 x 12, the value of step 20)
    assert [(a.step, a.also_values) for a in fired] == [(40, (40.0,))]
    assert "max_logit = 40" in fired[0].message()


def test_skip_qk_norm_leaves_those_layers_out():
    rule = LEVEL.replace(skip_qk_norm=True)
    tracker = AlertTracker([rule, LEVEL.replace(name="all")])
    values = {"m": [torch.tensor([20.0]), torch.tensor([20.0])]}
    fired = tracker.update(values, 0, ["a", "b"], qk_norm_layers={1})
    assert sorted((a.rule.name, a.layer) for a in fired) == [("all", 0), ("all", 1), ("level", 0)]


def test_history_and_streaks_survive_a_resume():
    first = AlertTracker([TREND.replace(patience=2)])
    feed(first, {0: [1.0], 30: [5.0]})  # streak 1 at step 30 (5 >= 4 x 1)
    second = AlertTracker([TREND.replace(patience=2)])
    second.load_state_dict(first.state_dict())
    fired = feed(second, {60: [25.0]})  # 25 >= 4 x 5, the value of step 30 kept in the history
    assert [(a.step, a.reference, a.reference_step) for a in fired] == [(60, 5.0, 30)]


@pytest.mark.parametrize(
    "field, value",
    [
        ("growth", 1.0),
        ("growth", "x"),
        ("growth", math.inf),
        ("window", 0),
        ("window", 2.5),
        ("window", True),
        ("grace_steps", -1),
        ("grace_steps", 1.0),
        ("skip_qk_norm", 1),
        ("evidence", None),
    ],
)
def test_new_rule_fields_are_checked_by_name(field, value):
    with pytest.raises(ValueError, match=f"Expected `{field}`"):
        LEVEL.replace(**{field: value})


@pytest.mark.parametrize(
    "field, value", [("growth", 0.5), ("window", -3), ("margin", -1.0), ("above", 1)]
)
def test_condition_fields_are_checked_by_name(field, value):
    kwargs = {"metric": "m", "threshold": 1.0, "above": True, field: value}
    with pytest.raises(ValueError, match=f"Expected `{field}`"):
        Condition(**kwargs)


def test_messages_state_the_trend_the_remedy_and_the_evidence():
    tracker = AlertTracker([LOGIT_GROWTH_RULE])
    logit = LOGIT_GROWTH_RULE.threshold
    growth, window = LOGIT_GROWTH_RULE.growth, LOGIT_GROWTH_RULE.window
    series = {
        0: [logit / growth / 2],
        window: [logit * 2],
    }  # x(4 growth) in one window, past the level
    fired = feed(tracker, series, metric="max_logit")
    assert len(fired) == 1
    text = fired[0].message(lr=0.03)
    assert f"max_logit = {logit * 2:.4g}, ×{growth * 4:.3g} over the last {window} steps" in text
    assert "learning rate 0.03" in text and "QK-norm" in text
    assert "Evidence:" in text and "benchmarks/instability.py" in text


def test_every_default_rule_carries_evidence_and_the_kappa_rule_is_a_trend_that_skips_qk_norm():
    assert all(rule.evidence for rule in DEFAULT_RULES)
    assert KAPPA_RULE.growth is not None and KAPPA_RULE.skip_qk_norm
    # a sharp head alone is not collapse: the entropy rule also needs the logits to grow
    assert any(c.metric == "max_logit" and c.growth is not None for c in ENTROPY_COLLAPSE_RULE.also)


def test_engines_know_their_qk_norm_layers_and_the_kappa_rule_skips_them():
    from qkmonitor.engine import Monitoring, PlainHost, QKSpectrum
    from qkmonitor.models import DecoderLM, TransformerConfig

    fired = []
    engine = QKSpectrum(on_alert=lambda owner, alert: fired.append(alert))
    Monitoring(DecoderLM(TransformerConfig(qk_norm=True)), [engine])
    assert engine.qk_norm_layers == frozenset({0, 1})
    # kappa x3 in 30 steps would fire anywhere else
    for step, kappa in ((0, 0.1), (30, 0.3)):
        engine.record(PlainHost(), {"kappa": [torch.full((4,), kappa)] * 2}, step)
    assert fired == []


def tiny_model(kind: str) -> torch.nn.Module:
    if kind == "bundled":
        from qkmonitor.models import DecoderLM, TransformerConfig

        return DecoderLM(
            TransformerConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
        )
    if kind == "torch":
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        return torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize(
    ("kind", "advice"),
    [
        ("bundled", "add QK-norm (TransformerConfig(qk_norm=True))"),
        ("torch", "add QK-norm (nn.MultiheadAttention has no switch for it: an attention module"),
        ("transformers", "in the model's attention code, as transformers' Qwen3 and OLMo 2"),
    ],
)
def test_the_advice_says_how_to_add_qk_norm_to_the_kind_of_model(kind, advice):
    from qkmonitor.engine import Monitoring, QKSpectrum

    # kappa >= 0 with the kappa rule's advice: fires for every head at the first probe
    always = LEVEL.replace(
        metric="kappa", threshold=0.0, warning=OverLocalizationWarning, advice=KAPPA_RULE.advice
    )
    fired = []
    engine = QKSpectrum(alerts=[always], on_alert=lambda owner, alert: fired.append(alert))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = tiny_model(kind)
        with Monitoring(model, [engine], every_n_steps=1) as monitoring, monitoring.step(0):
            pass  # the spectrum is read from the weights
    messages = [str(w.message) for w in caught if w.category is OverLocalizationWarning]
    assert fired and len(messages) == len(fired)
    assert {alert.layer_kind for alert in fired} == {layer.kind for layer in engine.layers}
    for message in messages:
        assert advice in message
        assert kind == "bundled" or "TransformerConfig" not in message


def test_an_alert_of_no_known_kind_names_qk_norm_and_the_bundled_switch():
    tracker = AlertTracker([LEVEL.replace(advice="add QK-norm ({qk_norm})")])
    (alert,) = feed(tracker, {0: [11.0]})
    assert alert.layer_kind == ""
    assert "Try: add QK-norm (normalize q and k after their projections; qkmonitor's bundled " in (
        alert.message()
    )
    assert "{qk_norm}" not in alert.with_layer_kind("mylib.Attention").message()
