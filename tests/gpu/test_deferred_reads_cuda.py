"""A probe's values on CUDA cross to the host in one non-blocking copy a probe
(``defer_reads=None``: deferred by default where they are on a GPU) and hold no device memory
past their probe: after each step the device holds what the immediate path's run holds
(``torch.cuda.memory_allocated``), the values logged are the immediate path's bit for bit, and
the copy lands in pinned memory."""

from __future__ import annotations

import struct

import pytest
import torch

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring
from qkmonitor.engine.reading import start_reading
from qkmonitor.models import DecoderLM, TransformerConfig
from qkmonitor.output.sinks import MemorySink

pytestmark = pytest.mark.gpu

STEPS, EVERY = 6, 2


def run(defer: bool | None) -> tuple[list[int], list]:
    """A plain AdamW loop on CUDA probed every EVERY steps: the memory allocated after each step,
    and the scalars logged (values as their bits)."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=20, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    model = DecoderLM(config).cuda()
    tokens = torch.randint(0, 20, (3, 12), generator=torch.Generator().manual_seed(1)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engines = [AttentionEntropy(defer_reads=defer), EffectiveRank(defer_reads=defer)]
    sink, allocated = MemorySink(), []
    with Monitoring(model, engines, writer=sink, every_n_steps=EVERY, optimizer=optimizer) as m:
        for step in range(STEPS):
            with m.step(step):
                loss = model(tokens).logsumexp(-1).mean()
                m.observe_loss(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
    return allocated, sorted((s, t, struct.pack("<d", v)) for t, v, s in sink.scalars)


def test_deferred_probes_hold_no_device_memory_and_log_the_same_values_on_cuda():
    run(False)  # the CUDA libraries' handles and workspaces, made before anything is counted
    immediate, immediate_values = run(False)
    deferred, deferred_values = run(None)  # the default on a GPU: deferred
    assert deferred == immediate
    assert deferred_values == immediate_values and immediate_values


def test_the_copy_is_non_blocking_into_pinned_memory():
    values = torch.randn(4, device="cuda")
    reading = start_reading(0, {"kappa": [values, values[:2].double()]})
    assert reading.on_device
    read = reading.read()
    assert all(t.device.type == "cpu" and t.is_pinned() for t in read.values["kappa"])
    assert read.rows["kappa"][0] == values.tolist()
