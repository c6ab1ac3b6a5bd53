"""Tiny Hugging Face models built from configs (nothing downloaded), their float64 references and
the live spectrum monitor's values on the same weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkmonitor.engine import Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink


def sharpened(model: nn.Module, seed: int = 2) -> nn.Module:
    """Norm weights away from 1 (so that diag(g) counts in a latent W_QK) and projections large
    enough for the heads to differ."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(0.5 + 1.5 * torch.rand(p.shape, generator=gen))
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
    return model


def dense_kappa(w_q: torch.Tensor, w_k: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """κ per head from the explicit d x d W_QK^h = W_Q^h (W_K^g)^T in float64 (rows as stored)."""
    w_q, w_k = w_q.double(), w_k.double()
    d_k = w_q.shape[0] // heads
    out = []
    for h in range(heads):
        g = h // (heads // kv_heads)
        q_h, k_g = w_q[h * d_k : (h + 1) * d_k], w_k[g * d_k : (g + 1) * d_k]
        s = torch.linalg.svdvals(q_h.T @ k_g)
        out.append(s[0] / s.sum())
    return torch.stack(out)


def live_values(model: nn.Module, inputs: dict) -> dict[str, list[torch.Tensor]]:
    """What the live QKSpectrum logs for ``model``'s weights at step 0 (one forward checks the
    layouts read by name)."""
    spectrum = QKSpectrum(per_head=True)
    monitoring = Monitoring(model, [spectrum], writer=MemorySink(), every_n_steps=1)
    with monitoring.step(0), torch.no_grad():
        model(**inputs)
    monitoring.close()
    return spectrum.latest


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 60, (2, 7), generator=torch.Generator().manual_seed(1))
