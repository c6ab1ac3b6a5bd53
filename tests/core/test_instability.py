"""A miniature attention-logit-growth instability (Wortsman et al. 2023) with the default rules.

Two runs of the bundled decoder on associative recall, identical but for QK-norm, at a peak
learning rate of 0.1: without QK-norm the attention logits run away and the loss stalls; with it the
run trains. The default rules must flag the first before its loss separates from the second, and
say nothing about the second. ``benchmarks/instability.py`` is the full sweep this reproduces.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from qkmonitor.models import DecoderLM, TransformerConfig
from qkmonitor.models.tasks import make_recall_batch
from qkmonitor.models.tasks.base import IGNORE_INDEX, lr_factor
from torch import nn

from qkmonitor.alerts import Alert
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum

PAIRS, STEPS, WARMUP, LR, EVERY = 4, 150, 20, 0.1, 10


def train(qk_norm: bool, seed: int = 0) -> tuple[list[float], list[Alert]]:
    """150 AdamW steps with all three monitors and their default rules: (losses, alerts)."""
    torch.manual_seed(seed)
    config = TransformerConfig(
        vocab_size=8 * PAIRS,
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=3 * PAIRS,
        qk_norm=qk_norm,
        attention_backend="torch",
    )
    model = DecoderLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.98), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, WARMUP))
    fired: list[Alert] = []
    engines = [
        QKSpectrum(on_alert=lambda owner, alert: fired.append(alert)),
        AttentionEntropy(on_alert=lambda owner, alert: fired.append(alert)),
        EffectiveRank(max_probe_tokens=12, on_alert=lambda owner, alert: fired.append(alert)),
    ]
    monitoring = Monitoring(model, engines, optimizer=optimizer, every_n_steps=EVERY)
    generator = torch.Generator().manual_seed(seed + 1)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the alerts are collected through on_alert
        for step in range(STEPS):
            tokens, targets = make_recall_batch(32, PAIRS, PAIRS, 4 * PAIRS, 4 * PAIRS, generator)
            with monitoring.step(step):
                logits = model(tokens)
                loss = nn.functional.cross_entropy(
                    logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX
                )
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            schedule.step()
            losses.append(loss.item())
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


@pytest.mark.slow  # two 150-step runs with all three monitors
def test_the_unstable_run_is_flagged_before_its_loss_separates_and_its_qk_norm_twin_is_not():
    unstable_losses, unstable_alerts = train(qk_norm=False)
    stable_losses, stable_alerts = train(qk_norm=True)

    # the instability is real: the run without QK-norm ends far behind its twin
    final = lambda losses: sum(losses[-20:]) / 20
    assert final(unstable_losses) >= 1.2 * final(stable_losses)
    separation = separation_step(unstable_losses, stable_losses)
    assert separation is not None

    assert stable_alerts == []
    assert unstable_alerts, "no alert on a run whose loss separated"
    first = min(alert.step for alert in unstable_alerts)
    assert first < separation, f"first alert at step {first}, loss separated at step {separation}"
    earliest = [a for a in unstable_alerts if a.step == first]
    assert {a.rule.name for a in earliest} & {"logit_growth", "kappa"}
    assert all("Try:" in a.message() and "Evidence:" in a.message() for a in unstable_alerts)
