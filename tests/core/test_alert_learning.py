"""Rules that read the training loss (``AlertRule.learning_drop``): quiet while the loss falls, as
before while it stalls; the loss reaches them from a plain loop (``Monitoring.observe_loss``) and
from Lightning (``training_step``'s return)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from qkmonitor.alerts import (
    LEARNING_WINDOW,
    LOSS_SMOOTHING,
    AlertRule,
    AlertTracker,
    LogitGrowthWarning,
)
from qkmonitor.callbacks import AttentionEntropyMonitor
from qkmonitor.engine import AttentionEntropy, Monitoring
from qkmonitor.models import DecoderLM, TransformerConfig

GROWTH = AlertRule(
    name="growth",
    metric="m",
    threshold=5.0,
    above=True,
    patience=1,
    margin=1.0,
    warning=LogitGrowthWarning,
    meaning="m grows",
    advice="lower it",
    growth=2.0,
    window=20,
    learning_drop=0.1,
)


def losses(values: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(values.items())


def feed(tracker: AlertTracker, series: dict[int, float], loss: dict[int, float]) -> list:
    fired = []
    for step, value in series.items():
        seen = losses({s: v for s, v in loss.items() if s <= step})
        fired += tracker.update({"m": [torch.tensor([value])]}, step, ["attn"], losses=seen)
    return fired


@pytest.mark.parametrize(
    "field, value",
    [
        ("learning_drop", 0.0),
        ("learning_drop", 1.0),
        ("learning_drop", "0.1"),
        ("learning_drop", True),
        ("learning_window", 0),
        ("learning_window", 2.5),
    ],
)
def test_learning_drop_is_a_fraction(field, value):
    with pytest.raises(ValueError, match=field):
        GROWTH.replace(**{field: value})


def test_a_rule_is_quiet_while_the_loss_falls_and_fires_when_it_stalls():
    # m doubles every 10 steps (x4 per 20 steps: the trend holds at every probe from step 20)
    series = {s: 6.0 * 2 ** (s / 10) for s in range(0, 70, 10)}
    falling = {s: 3.0 * 0.97**s for s in range(70)}  # -45 % per 20 steps: learning
    stalled = {s: 3.0 for s in range(70)}
    assert feed(AlertTracker([GROWTH]), series, falling) == []
    fired = feed(AlertTracker([GROWTH]), series, stalled)
    assert [a.step for a in fired] == [20]


def test_the_loss_is_compared_over_the_rule_window_smoothed():
    rule = GROWTH
    # means of steps (s-10, s]; a drop of 11 % (at least the 10 % asked) counts as learning, 9 % not
    loss = {s: 1.0 for s in range(11)} | {s: 0.89 for s in range(11, 31)}
    assert rule.learning(losses(loss), 30)  # 0.89 vs 1.0, 20 steps back (steps 1..10)
    loss = {s: 1.0 for s in range(11)} | {s: 0.91 for s in range(11, 31)}
    assert not rule.learning(losses(loss), 30)
    assert not rule.learning([], 30)  # no loss: no evidence of learning
    assert not rule.learning(losses({s: float("nan") for s in range(31)}), 30)
    assert rule.replace(window=None).loss_window == LEARNING_WINDOW
    assert rule.replace(learning_window=5).loss_window == 5
    assert LOSS_SMOOTHING == 10


def test_the_default_trend_rules_read_the_loss_and_the_burst_rule_does_not():
    from qkmonitor.alerts import (
        DEFAULT_RULES,
        KAPPA_RULE,
        LOGIT_BURST_RULE,
        LOGIT_GROWTH_RULE,
        LOGIT_JUMP_RULE,
        MALIGNANT_COLLAPSE_RULE,
    )

    gated = [KAPPA_RULE, LOGIT_GROWTH_RULE, LOGIT_JUMP_RULE, MALIGNANT_COLLAPSE_RULE]
    assert all(rule.learning_drop for rule in gated) and LOGIT_BURST_RULE.learning_drop is None
    assert (
        LOGIT_JUMP_RULE in DEFAULT_RULES
        and LOGIT_JUMP_RULE in AttentionEntropy().alerting.tracker.rules
    )
    assert AttentionEntropy().alerting.reads_loss


def test_the_description_says_the_rule_reads_the_loss():
    assert "unless the training loss fell by 10% or more over 20 steps" in GROWTH.describe()


def tiny_decoder() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(
        TransformerConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
    )


#: fires on every head from step 30 (max_logit is always above -1e9), unless the loss falls
ALWAYS = AlertRule(
    name="always",
    metric="max_logit",
    threshold=-1e9,
    above=True,
    patience=1,
    margin=0.0,
    warning=LogitGrowthWarning,
    meaning="test",
    advice="none",
    learning_drop=0.2,
    grace_steps=30,
)


@pytest.mark.parametrize("trend, expected", [("falling", []), ("flat", [30])])
def test_a_plain_loop_hands_the_loss_to_the_rules(trend, expected):
    model = tiny_decoder()
    engine = AttentionEntropy(alerts=[ALWAYS], every_n_steps=10)
    fired = []
    engine.alerting.on_alert = lambda owner, alert: fired.append(alert)
    tokens = torch.randint(16, (2, 8), generator=torch.Generator().manual_seed(0))
    with Monitoring(model, [engine], every_n_steps=10) as monitoring:
        for step in range(41):
            with monitoring.step(step):
                model(tokens)
                # a made-up loss: halves every 10 steps, or stays
                monitoring.observe_loss(
                    torch.tensor(2.0 * (0.5 ** (step / 10) if trend == "falling" else 1.0))
                )
    # probes at 30 and 40 decide (grace before); a flat loss fires at 30 (then the alert is active)
    assert sorted({a.step for a in fired}) == expected
    assert [s for s, _ in engine.alerting.loss_history()][-1] == 40


def test_observe_loss_outside_a_window_needs_the_step():
    monitoring = Monitoring(tiny_decoder(), [AttentionEntropy(alerts=[ALWAYS])])
    with pytest.raises(ValueError, match="step"):
        monitoring.observe_loss(1.0)
    monitoring.observe_loss(1.0, step=3)
    assert monitoring.engines[0].alerting.loss_history() == [(3, 1.0)]


def test_engines_without_such_rules_keep_no_loss():
    engine = AttentionEntropy(alerts=[])
    engine.observe_loss(0, torch.tensor(1.0))
    assert not engine.alerting.reads_loss and engine.alerting.loss_history() == []


class _Task(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_decoder()

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        logits = self.model(tokens)
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the loss stays: the rule fires


def test_lightning_hands_training_step_loss_to_the_rules(tmp_path):
    tokens = torch.randint(16, (12, 8), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=2)
    monitor = AttentionEntropyMonitor(every_n_steps=5, alerts=[ALWAYS.replace(grace_steps=0)])
    task = _Task()
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        logger=CSVLogger(tmp_path),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.warns(LogitGrowthWarning):
        trainer.fit(task, loader)
    history = monitor.engine.alerting.loss_history()
    assert [s for s, _ in history] == list(range(6))  # the step each batch started on
    with torch.no_grad():
        expected = [
            float(task.training_step((tokens[2 * i : 2 * i + 2],), i)["loss"]) for i in range(6)
        ]
    assert [v for _, v in history] == pytest.approx(expected, rel=1e-6)  # lr 0: the same weights


def test_only_the_losses_a_probe_can_read_are_kept():
    # every 50 steps, windows of 10 + 10 steps: the first 10; the 20 steps before each multiple and
    # the multiple; after a probe nothing until the next window
    engine = AttentionEntropy(every_n_steps=50)
    for step in range(101):
        engine.observe_loss(step, float(step))
        if step % 50 == 0:
            engine.schedule.latest_step = (
                step  # the probe of the step, which records after the loss
            )
    kept = [s for s, _ in engine.alerting.loss_history()]
    assert kept == [*range(10), *range(30, 51), *range(80, 101)]
    assert engine.alerting.first_loss() == pytest.approx(4.5)  # mean of steps 0..9


def test_the_losses_before_a_probe_that_lands_after_its_multiple_are_kept():
    # two optimizers step over 50: the probe lands at 51, and its window reads the loss up to it
    engine = AttentionEntropy(every_n_steps=50)
    engine.schedule.latest_step = 0
    for step in range(21, 61, 2):
        engine.observe_loss(step, float(step))
        if step == 51:
            engine.schedule.latest_step = step
    kept = [s for s, _ in engine.alerting.loss_history()]
    assert kept == [*range(31, 52, 2)]


def test_the_loss_history_survives_a_resume_and_a_fresh_engine_then_decides_as_the_old_one():
    # a resumed run must tell learning from failing at its first probe: the kept losses and the
    # first loss travel in the state dict
    engine = AttentionEntropy(every_n_steps=10)
    for step in range(40):
        engine.observe_loss(step, torch.tensor(3.0 * 0.9**step))
    state = engine.state_dict()
    again = AttentionEntropy(every_n_steps=10)
    again.load_state_dict(state)
    kept, expected = again.alerting.loss_history(), engine.alerting.loss_history()
    assert [step for step, _ in kept] == [step for step, _ in expected]
    assert [loss for _, loss in kept] == pytest.approx([loss for _, loss in expected])
    assert again.alerting.first_loss() == pytest.approx(engine.alerting.first_loss())
    rule = again.alerting.tracker.rules[0]
    assert (
        rule.learning(again.alerting.loss_history(), 39, again.alerting.first_loss())
        == rule.learning(engine.alerting.loss_history(), 39, engine.alerting.first_loss())
        is True
    )
    fresh = AttentionEntropy(every_n_steps=10)
    assert not rule.learning(
        fresh.alerting.loss_history(), 39, fresh.alerting.first_loss()
    )  # without it: no evidence
