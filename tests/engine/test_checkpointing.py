"""Activation checkpointing around the bundled model's blocks: a monitored run trains
bit-identically to its unmonitored twin, and a forward recomputed in the backward is measured once
(issue 19 item 6)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.models import DecoderLM, TransformerConfig
from qkmonitor.output.sinks import MemorySink

VOCAB, SEQ, STEPS = 16, 12, 10


class Checkpointed(nn.Module):
    """One block run under ``torch.utils.checkpoint``: its activations are recomputed in the
    backward."""

    def __init__(self, block: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=self.reentrant)


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = DecoderLM(
        TransformerConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ)
    )
    if kind != "none":
        model.blocks = nn.ModuleList(
            Checkpointed(block, kind == "reentrant") for block in model.blocks
        )
    return model


def counting(engine):
    """Record, at each probe's close, the forwards each layer's probe saw (and the hidden states
    EffectiveRank kept per block)."""
    seen = []
    close_probes = engine.close_probes

    def close():
        results = close_probes()
        if results:
            hidden = getattr(engine, "_hidden", {})
            seen.append(
                ([r.calls for r in results], [len(hidden.get(i, [])) for i in range(len(results))])
            )
        return results

    engine.close_probes = close
    return seen


def train(model: nn.Module, monitored: bool):
    """STEPS AdamW steps on fixed batches, probed every 2nd step when ``monitored``: the losses, the
    parameters, the scalars logged and the forwards each probe saw."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    sink = MemorySink()
    engines = [QKSpectrum(), AttentionEntropy(), EffectiveRank()]
    seen = [counting(engine) for engine in engines[1:]]
    monitoring = Monitoring(model, engines, writer=sink, every_n_steps=2) if monitored else None
    losses = []
    for step in range(STEPS):
        tokens = torch.randint(VOCAB, (4, SEQ), generator=generator)
        if monitoring is not None:
            monitoring.begin(step)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
        )
        loss.backward()  # a checkpointed block runs its forward again here, the probes still open
        optimizer.step()
        optimizer.zero_grad()
        if monitoring is not None:
            monitoring.observe_loss(loss)
            monitoring.end()
        losses.append(loss.detach())
    if monitoring is not None:
        monitoring.close()
    scalars = {(tag, step): value for tag, value, step in sink.scalars}
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], scalars, seen


@pytest.mark.parametrize("kind", ["reentrant", "non_reentrant"])
def test_a_monitored_run_under_checkpointing_trains_as_its_twin_and_measures_each_forward_once(
    kind,
):
    twin_losses, twin_params, _, _ = train(make_model(kind), monitored=False)
    losses, params, scalars, seen = train(make_model(kind), monitored=True)
    assert torch.equal(losses, twin_losses)
    assert all(torch.equal(p, q) for p, q in zip(params, twin_params))
    # the forward recomputed in the backward is the same call again: one forward per probed step
    for per_engine in seen:
        assert len(per_engine) == STEPS // 2
        assert all(calls == [1, 1] for calls, _ in per_engine)
    assert all(hidden == [1, 1] for _, hidden in seen[1])  # EffectiveRank's hidden states: once too
    # and the values logged are those of the run without checkpointing, step for step
    _, _, plain_scalars, _ = train(make_model("none"), monitored=True)
    assert {step for _, step in scalars} == set(range(0, STEPS, 2))
    assert scalars.keys() == plain_scalars.keys()
    differ = {
        key: (value, plain_scalars[key])
        for key, value in scalars.items()
        if not (value == plain_scalars[key] or math.isnan(value) and math.isnan(plain_scalars[key]))
    }
    assert differ == {}
