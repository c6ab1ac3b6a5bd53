"""Edges of the input a user's loop can hand the monitors: an empty batch, one-token sequences,
and the argument errors that must name what to fix."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from qkmonitor.alerts import QKMonitorWarning
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.models import DecoderLM, TransformerConfig


class MHAModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.attn(x, x, x, need_weights=False)[0]


def engines():
    return [QKSpectrum(), AttentionEntropy(), EffectiveRank()]


def run_steps(model, monitored, batches, loss_of=lambda out: out.float().pow(2).mean()):
    """One probed step per batch (every_n_steps=1); returns the qkmonitor warnings and the
    engines."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitoring = Monitoring(model, monitored, every_n_steps=1)
        for step, batch in enumerate(batches):
            with monitoring.step(step):
                loss = loss_of(model(batch))
                monitoring.observe_loss(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        monitoring.close()
    return [
        w
        for w in caught
        if issubclass(w.category, QKMonitorWarning)
        or str(w.message).startswith(
            ("QKSpectrum", "AttentionEntropy", "EffectiveRank", "qkmonitor")
        )
    ]


def test_an_empty_batch_is_skipped_with_one_warning_and_trains_on():
    model = MHAModel()
    monitored = engines()
    empty = torch.zeros(0, 5, dtype=torch.long)
    full = torch.randint(10, (2, 5), generator=torch.Generator().manual_seed(0))
    caught = run_steps(model, monitored, [empty, empty, full])
    messages = [str(w.message) for w in caught]
    assert (
        sum("empty batch" in m for m in messages) == 2
    )  # once per activation engine, not per step
    assert not any("NaN" in m and "empty" not in m for m in messages)  # undefined, not "broken"
    entropy = monitored[1]
    assert entropy.schedule.latest_step == 2 and all(
        torch.isfinite(v).all() for v in entropy.latest["entropy"]
    )
    assert not any(
        engine.alerting.tracker.counts[rule]
        for engine in monitored
        for rule in engine.alerting.tracker.counts
    )
    assert not model.attn._forward_pre_hooks  # nothing left on the model


def test_one_token_sequences_give_undefined_values_said_once_and_no_alert():
    torch.manual_seed(0)
    model = DecoderLM(
        TransformerConfig(vocab_size=10, d_model=16, n_layers=2, n_heads=2, max_seq_len=8)
    )
    monitored = engines()
    batches = [
        torch.randint(10, (3, 1), generator=torch.Generator().manual_seed(s)) for s in range(3)
    ]
    caught = run_steps(
        model, monitored, batches, loss_of=lambda logits: logits.logsumexp(-1).mean()
    )
    # never a silent NaN: one line per metric that the data leave undefined, nothing else
    said = sorted(str(w.message).split(" is undefined")[0] for w in caught)
    assert said == [
        "AttentionEntropy: entropy_norm",
        "EffectiveRank: attn_entropy_norm",
        "EffectiveRank: hidden_collapse",
    ]
    entropy, rank = monitored[1], monitored[2]
    assert all(
        math.isnan(v) for layer in entropy.latest["entropy_norm"] for v in layer.tolist()
    )  # one key: undefined
    assert all(
        v == 0.0 for layer in entropy.latest["entropy"] for v in layer.tolist()
    )  # one key: entropy 0
    assert all(math.isnan(v) for layer in rank.latest["hidden_collapse"] for v in layer.tolist())
    assert not any(
        engine.alerting.tracker.counts[rule]
        for engine in monitored
        for rule in engine.alerting.tracker.counts
    )


def test_layers_given_as_a_function_that_returns_nothing_is_named():
    model = MHAModel()
    with pytest.raises(ValueError, match="function passed as `layers`"):
        Monitoring(model, [AttentionEntropy(layers=lambda m: None)])


def test_an_engine_class_instead_of_an_instance_says_to_pass_an_instance():
    with pytest.raises(
        TypeError,
        match=r"got the class `AttentionEntropy`: pass an instance: `AttentionEntropy\(\)`",
    ):
        Monitoring(MHAModel(), [QKSpectrum(), AttentionEntropy])


def test_one_engine_in_two_open_monitorings_is_an_error_and_free_after_close():
    engine = AttentionEntropy()
    first = Monitoring(MHAModel(), [engine])
    with pytest.raises(ValueError, match="already used by another Monitoring"):
        Monitoring(MHAModel(), [engine])
    import pickle

    assert (
        pickle.loads(pickle.dumps(engine))._session is None
    )  # picklable while held (spawned workers)
    first.close()
    Monitoring(MHAModel(), [engine]).close()  # closed: the engine may move on, and starts fresh
