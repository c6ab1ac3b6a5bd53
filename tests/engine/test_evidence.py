"""Rules that combine evidence: a condition on another monitor's metric (the optimizer's view, read
by the spectrum engine, in a rule of the entropy engine) and on the run's loss signals. Checked
against the other engine's own logged values and the losses the test fed, in a plain loop and in a
Lightning fit with the three callbacks; alone, such a rule is skipped with one warning."""

from __future__ import annotations

import math
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch

from qkmonitor.alerts import AlertRule, Condition, LogitGrowthWarning, run_signals
from qkmonitor.engine import AttentionEntropy, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink

from .tiny import TOKENS, TinyTask, decoder


def combined(threshold: float) -> AlertRule:
    """Fires where a head's query update ratio is at least ``threshold`` (its own test, a logit
    above -1e9, always holds)."""
    return AlertRule(
        name="logit_and_update",
        metric="max_logit",
        threshold=-1e9,
        above=True,
        patience=1,
        margin=0.0,
        warning=LogitGrowthWarning,
        meaning="test",
        advice="test",
        also=(Condition("q_update_ratio", threshold, above=True),),
    )


def run(engines, steps: int = 3, losses=None, optimizer_lr: float = 0.05):
    model = decoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=optimizer_lr)
    fired = []
    for engine in engines:
        engine.alerting.on_alert = lambda owner, alert: fired.append(alert)
    with Monitoring(
        model, engines, writer=MemorySink(), every_n_steps=2, optimizer=optimizer
    ) as monitoring:
        for step in range(steps):
            with monitoring.step(step):
                loss = model(TOKENS).logsumexp(-1).mean()
                monitoring.observe_loss(losses[step] if losses is not None else loss.detach())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    return fired


@pytest.mark.parametrize("threshold", [0.0, 1e9])
def test_a_condition_on_the_spectrum_engines_metric_reads_its_values_of_the_same_step(threshold):
    spectrum = QKSpectrum(alerts=[])
    entropy = AttentionEntropy(alerts=[combined(threshold)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the alerts' own warnings
        fired = run([spectrum, entropy])
    if threshold > 0:
        assert fired == []
        return
    # at step 2 (step 0 has no update before it: NaN, which fires nothing), every head
    assert {(a.step, a.layer, a.head) for a in fired} == {
        (2, i, h) for i in (0, 1) for h in range(4)
    }
    for alert in fired:
        logged = float(spectrum.latest["q_update_ratio"][alert.layer][alert.head])
        assert alert.also_values == (pytest.approx(logged, rel=1e-6),)
        assert re.search(r"q_update_ratio = [0-9.e-]+", alert.message())


def test_alone_the_combined_rule_is_skipped_with_one_warning_naming_the_missing_monitor():
    entropy = AttentionEntropy(alerts=[combined(0.0)])
    with pytest.warns(RuntimeWarning, match="no QKSpectrumMonitor runs beside") as caught:
        fired = run([entropy], steps=5)
    assert fired == []
    assert sum("runs beside" in str(w.message) for w in caught) == 1


def test_a_rule_on_a_metric_no_monitor_logs_is_refused_naming_it():
    rule = combined(0.0).replace(also=(Condition("q_update_ration", 0.0, above=True),))
    with pytest.raises(ValueError, match="q_update_ration"):
        AttentionEntropy(alerts=[rule])
    with pytest.raises(ValueError, match="'kappa'.*does not log"):  # its own metric: the engine's
        AttentionEntropy(alerts=[combined(0.0).replace(metric="kappa")])


def test_loss_signals_are_the_fed_losses_ratios_at_each_probe():
    """Losses 1.0 for 21 steps, then 3.0: at the probe of step 28 the last 10 steps' mean is 2.6;
    at step 30 it is 3.0, three times both the 10 steps before and the best earlier probe's."""
    losses = [1.0] * 21 + [3.0] * 14
    rule = combined(0.0).replace(
        name="loss_spike",
        also=(
            Condition("loss_vs_best", 2.9, above=True),
            Condition("loss_change", 1.2, above=True),
        ),
    )
    fired = run([AttentionEntropy(alerts=[rule])], steps=35, losses=losses)
    assert fired and {a.step for a in fired} == {30}
    assert fired[0].also_values == (pytest.approx(3.0), pytest.approx(3.0))
    history = list(enumerate(losses[:29]))
    signals, now = run_signals(history, 28, best=1.0)
    assert signals == {"loss_vs_best": pytest.approx(2.6), "loss_change": pytest.approx(2.6)}
    assert now == pytest.approx(2.6)
    assert math.isnan(run_signals(history[:5], 4, best=None)[0]["loss_change"])


def test_three_lightning_callbacks_share_their_evidence(tmp_path):
    from qkmonitor.callbacks import AttentionEntropyMonitor, QKSpectrumMonitor

    fired = []
    entropy = AttentionEntropyMonitor(
        every_n_steps=2, alerts=[combined(0.0)], on_alert=lambda owner, a: fired.append(a)
    )
    spectrum = QKSpectrumMonitor(every_n_steps=2, alerts=[])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        pl.Trainer(
            max_steps=3, logger=False, callbacks=[spectrum, entropy], enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
        ).fit(TinyTask())  # fmt: skip
    assert {a.step for a in fired} == {2}
    for alert in fired:
        logged = float(spectrum.engine.latest["q_update_ratio"][alert.layer][alert.head])
        assert alert.also_values == (pytest.approx(logged, rel=1e-6),)
