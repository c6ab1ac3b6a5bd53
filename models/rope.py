"""Rotary position embedding (RoPE, Su et al. 2021), half-split layout.

Pairs ``(x_i, x_{i + d/2})`` of each head vector rotate by the angle ``t · θ^{-2i/d}`` at position
``t``, so ``<R_s q, R_t k> = <q, R_{t-s} k>``: scores depend on the offset only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RotaryEmbedding", "apply_rotary_pos_emb"]


def apply_rotary_pos_emb(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (..., N, D) by per-position angles; ``cos``/``sin`` are (N, D/2).

    Half-split layout: ``[x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos]`` with ``x1 = x[..., :D/2]``.
    """
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class RotaryEmbedding(nn.Module):
    """Cached cos/sin tables for positions ``0 .. max_seq_len - 1``.

    Args:
        head_dim: D, even.
        max_seq_len: the longest sequence served.
        base: θ; frequencies are ``θ^{-2i/D}``, ``i = 0 .. D/2 - 1``.
    """

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10_000.0) -> None:
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq  # (N, D/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate queries (B, H, N, D) and keys (B, H_kv, N, D) by their positions."""
        n = q.shape[-2]
        if n > self.cos.shape[0]:
            raise ValueError(f"Sequence length {n} exceeds `max_seq_len` {self.cos.shape[0]}")
        cos, sin = self.cos[:n], self.sin[:n]
        return apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
