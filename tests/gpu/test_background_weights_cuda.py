"""The spectrum on its worker thread on CUDA (``background_weights=None``: on by default where
the weights are on a GPU) holds no device memory past its probe: the copy of the weights it is
computed from is freed once the worker has read it, so that after each step's settle the device
holds what the synchronous path's run holds, step by step (``torch.cuda.memory_allocated``)."""

from __future__ import annotations

import weakref

import pytest
import torch

from qkmonitor.engine import Monitoring, QKSpectrum
from qkmonitor.engine.background import WEIGHTS_WORKER
from qkmonitor.measures.layer_spectra import QKWeights, spectrum_of_layers
from qkmonitor.models import DecoderLM, TransformerConfig

pytestmark = pytest.mark.gpu

STEPS, EVERY = 5, 2


def warm_up() -> None:
    """The CUDA libraries' per-thread handles and workspaces (cuBLAS, cuSOLVER), which live as long
    as their thread, made on the training thread and on the worker before anything is counted."""
    weights = [QKWeights(torch.randn(8, 8, device="cuda"), torch.randn(8, 8, device="cuda"), 2, 2,
                         0.5)]  # fmt: skip
    spectrum_of_layers(weights)
    WEIGHTS_WORKER.submit(spectrum_of_layers, weights).result()
    torch.cuda.synchronize()


def run(background: bool | None, copies: list) -> list[int]:
    """A plain AdamW loop on CUDA probed every EVERY steps: the memory allocated after each step
    (its read settled at its end)."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=20, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    model = DecoderLM(config).cuda()
    tokens = torch.randint(0, 20, (3, 12), generator=torch.Generator().manual_seed(1)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine = QKSpectrum(background_weights=background)
    submit = WEIGHTS_WORKER.submit

    def counted(job, weights):
        copies.extend(weakref.ref(t) for w in weights for t in (w.w_q, w.w_k))
        return submit(job, weights)

    WEIGHTS_WORKER.submit = counted
    allocated = []
    try:
        with Monitoring(model, [engine], every_n_steps=EVERY, optimizer=optimizer) as monitoring:
            for step in range(STEPS):
                with monitoring.step(step):
                    model(tokens).logsumexp(-1).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                assert all(c() is None for c in copies), step  # read, and freed
                allocated.append(torch.cuda.memory_allocated())
    finally:
        del WEIGHTS_WORKER.submit
    return allocated


def test_the_workers_copy_of_the_weights_is_freed_once_read_on_cuda():
    warm_up()
    synchronous_copies, background_copies = [], []
    synchronous = run(False, synchronous_copies)
    background = run(None, background_copies)  # the default on a GPU: the worker
    assert synchronous_copies == [] and background_copies  # the worker read copies, on CUDA
    assert background == synchronous  # after each settle: not a byte more on the device
