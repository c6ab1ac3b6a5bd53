"""Two cases of the calibration suite (``benchmarks/instability.py``) in miniature, with the default
rules in a plain loop that hands them the loss, as a user's loop would:

- induction-head formation (a decoder copying a repeated random sequence, learning rate 0.03, no
  warmup): the heads go from uniform to one-hot and the largest logit grows tenfold while the loss
  falls from 3.5 to near 0. Healthy, so silent; the same rules without the loss gate fire on it.
- a vision encoder (axial 2-D RoPE, grid relation task) at learning rate 0.1 after a 50-step
  warmup fails: its loss separates from a learning-rate-0.003 twin, and an alert comes at least 10
  steps before; the twin stays silent.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from qkmonitor.alerts import DEFAULT_RULES, Alert
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.models import DecoderLM, TransformerConfig, VisionEncoder
from qkmonitor.models.tasks.base import IGNORE_INDEX, lr_factor
from qkmonitor.models.tasks.grid import NUM_CLASSES, PATCH_DIM, make_grid_batch

EVERY = 10


def train(model, batches, loss_fn, *, lr: float, warmup: int, steps: int, extra_engines=()):
    """AdamW (betas 0.9/0.98, weight decay 0.1 on matrices) with all three monitors at their default
    rules (and ``extra_engines``), probing every 10 steps; returns (losses, alerts, max logits)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup))
    fired: list[Alert] = []
    keep = lambda owner, alert: fired.append(alert)
    engines = [
        QKSpectrum(on_alert=keep),
        AttentionEntropy(on_alert=keep),
        EffectiveRank(on_alert=keep),
        *extra_engines,
    ]
    monitoring = Monitoring(model, engines, optimizer=optimizer, every_n_steps=EVERY)
    losses, logits = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # alerts are collected through on_alert
        for step in range(steps):
            batch = next(batches)
            with monitoring.step(step):
                loss = loss_fn(model, batch)
                monitoring.observe_loss(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            schedule.step()
            losses.append(loss.item())
            if engines[1].schedule.latest_step == step:
                logits.append(max(float(t.max()) for t in engines[1].latest["max_logit"]))
    return losses, fired, logits


def trailing_mean(values: list[float], window: int = 10) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def separation_step(losses: list[float], reference: list[float], floor: float = 0.05) -> int | None:
    """The suite's definition: the first step from which the smoothed loss (+ floor) stays above
    1.1 x the reference's."""
    above = [
        (a + floor) > 1.1 * (b + floor)
        for a, b in zip(trailing_mean(losses), trailing_mean(reference))
    ]
    if not above[-1]:
        return None
    step = len(above)
    while step > 0 and above[step - 1]:
        step -= 1
    return step


def copy_batches(seed: int, batch: int = 32, symbols: int = 32, length: int = 16):
    gen = torch.Generator().manual_seed(10_000 + seed)
    while True:
        half = torch.randint(symbols, (batch, length), generator=gen)
        tokens = torch.cat((half, half), dim=1)
        targets = torch.full_like(tokens, IGNORE_INDEX)
        targets[:, length:-1] = tokens[
            :, length + 1 :
        ]  # only an induction head predicts the repeat
        yield tokens, targets


def lm_loss(model, batch):
    tokens, targets = batch
    return F.cross_entropy(
        model(tokens).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX
    )


@pytest.mark.slow  # 80 steps of a 2-layer decoder with all monitors
def test_induction_head_formation_is_silent_and_only_the_loss_gate_makes_it_so():
    torch.manual_seed(0)
    model = DecoderLM(
        TransformerConfig(
            vocab_size=32,
            d_model=64,
            n_layers=2,
            n_heads=4,
            max_seq_len=32,
            attention_backend="torch",
        )
    )
    ungated_fired: list[Alert] = []
    ungated = [r.replace(learning_drop=None) for r in DEFAULT_RULES if r.metric in ("max_logit",)]
    witness = AttentionEntropy(
        log_key_prefix="ungated",
        alerts=ungated,
        on_alert=lambda owner, alert: ungated_fired.append(alert),
    )
    losses, fired, logits = train(
        model, copy_batches(0), lm_loss, lr=0.03, warmup=0, steps=80, extra_engines=[witness]
    )
    assert sum(losses[:5]) / 5 > 3.0 and sum(losses[-10:]) / 10 < 0.2  # the induction head formed
    assert max(logits) >= 10 * logits[0]  # and its logits sharpened fast
    assert fired == [], [a.message() for a in fired]
    assert ungated_fired, "without the loss gate the same rules fire on this healthy run"


def vision_batches(seed: int, batch: int = 32, grid=(6, 6)):
    gen = torch.Generator().manual_seed(10_000 + seed)
    while True:
        labels = torch.randint(NUM_CLASSES, (batch,), generator=gen)
        yield make_grid_batch(labels, *grid, gen), labels


def vision_loss(model, batch):
    patches, labels = batch
    return F.cross_entropy(model(patches), labels)


def vision_run(lr: float, seed: int = 1, steps: int = 80):
    torch.manual_seed(seed)
    config = TransformerConfig(
        vocab_size=1,
        d_model=64,
        n_layers=2,
        n_heads=4,
        max_seq_len=36,
        positional="rope_2d",
        grid_size=(6, 6),
        patch_dim=PATCH_DIM,
        num_classes=NUM_CLASSES,
        attention_backend="torch",
    )
    return train(
        VisionEncoder(config), vision_batches(seed), vision_loss, lr=lr, warmup=50, steps=steps
    )


@pytest.mark.slow  # two 80-step runs of a 2-layer vision encoder with all monitors
def test_a_vision_encoder_failure_is_flagged_ten_steps_before_its_loss_separates():
    failing, failing_alerts, _ = vision_run(lr=0.1)
    healthy, healthy_alerts, _ = vision_run(lr=0.003)
    separation = separation_step(failing, healthy)
    assert separation is not None and separation > 30  # it fails, after the warmup's first steps
    first = min(a.step for a in failing_alerts)
    assert first <= separation - 10, (first, separation, [a.rule.name for a in failing_alerts])
    assert healthy_alerts == [], [a.message() for a in healthy_alerts]
