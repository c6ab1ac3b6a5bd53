"""A probe leaves nothing for Python's cyclic collector: what it made for a step (the channels, each
forward's capture and the tensors it kept: the projections' inputs, the operands of the latest
matmul of 4-D tensors) is freed by reference counting, as a step without the monitor frees its own.

A forward's capture and its interceptor once held each other. The pair, ~40 objects a layer and
the tensors the capture kept, then lived until the collector next ran: for an explicit softmax
(``softmax(q @ kᵀ) @ v``) that was each layer's attention probabilities (B, H, N, M) and the
storages of its values and input, 24 MiB a layer at B 8, 8 heads, N 256, held past the step
(under ``no_grad`` too, where nothing else holds them; on a GPU, memory the next step's peak could
not reuse).

The reference is the collector itself: with it disabled, ``gc.collect()`` after the probe counts
the unreachable objects, which a cycle-free probe leaves none of (the plain model's own step
leaves none either: checked first)."""

from __future__ import annotations

import gc
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink
from tests.core.test_intercept import Model, ModuloGQA, NanoAttention, T
from tests.engine.tiny import decoder


@contextmanager
def collector_off():
    """The cyclic collector disabled (as it was after), its garbage kept for the message."""
    enabled = gc.isenabled()
    gc.disable()
    gc.collect()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()


def unreachable_after(run) -> Counter:
    """The types of what ``run()`` left unreachable in reference cycles (collector off)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    run()
    gc.collect()
    found = Counter(type(o).__qualname__ for o in gc.garbage)
    gc.garbage.clear()
    gc.set_debug(0)
    return found


def engines():
    return [QKSpectrum(every_n_steps=1), AttentionEntropy(every_n_steps=1), EffectiveRank()]


MODELS = {
    "sdpa and explicit softmax": lambda: Model(NanoAttention(), NanoAttention(flash=False)),
    "GQA with RoPE": lambda: Model(ModuloGQA(), ModuloGQA()),
    "bundled decoder": decoder,
}


def _tokens(model) -> torch.Tensor:
    vocab = 20
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(0))


def _train_step(model, tokens):
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()


@pytest.mark.parametrize("training", [True, False], ids=["training", "no_grad"])
@pytest.mark.parametrize("name", MODELS)
def test_a_probe_leaves_no_reference_cycle(name, training):
    """A probed training step, and a probed forward under ``no_grad`` (a validation probe, where
    nothing else holds the forward's tensors), leave the collector nothing to find."""
    model = MODELS[name]()
    tokens = _tokens(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitoring = Monitoring(
        model, engines(), writer=MemorySink(), every_n_steps=1, optimizer=optimizer
    )
    step = iter(range(100))

    def run():
        if training:
            _train_step(model, tokens)
            optimizer.step()
            optimizer.zero_grad()
        else:
            with torch.no_grad():
                model(tokens)

    def probed():
        with monitoring.step(next(step)):
            run()

    with collector_off():
        assert unreachable_after(run) == Counter()  # the model's own step leaves none
        probed()  # first-probe work (discovery, warnings given once) apart
        assert unreachable_after(probed) == Counter()
        assert unreachable_after(probed) == Counter()
    monitoring.close()
