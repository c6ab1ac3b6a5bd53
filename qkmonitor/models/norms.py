"""Normalization layers: LayerNorm and RMSNorm behind one factory."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RMSNorm", "make_norm"]


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · g`` over the last dim (Zhang & Sennrich 2019): no centering, no
    bias."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        ) * self.weight


def make_norm(kind: str, dim: int, eps: float = 1e-5) -> nn.Module:
    """``"layernorm"`` or ``"rmsnorm"`` over a last dim of size ``dim``."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f"Expected `norm` to be 'layernorm' or 'rmsnorm', got {kind!r}")
