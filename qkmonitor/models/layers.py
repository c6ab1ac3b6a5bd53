"""Transformer layers: the MLPs, and the encoder and decoder layers built around attention.

A layer adds each sublayer ``f`` to the residual stream either pre-norm, ``x + f(norm(x))``, or
post-norm, ``norm(x + f(x))`` (the original Transformer; needs warmup to train stably).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .attention import MultiHeadAttention
from .config import TransformerConfig
from .norms import make_norm

__all__ = ["MLP", "DecoderLayer", "EncoderLayer", "SwiGLU", "make_mlp"]


class MLP(nn.Module):
    """``W_2 GELU(W_1 x)``, hidden width ``d_ff``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class SwiGLU(nn.Module):
    """``W_2 (SiLU(W_g x) ⊙ W_1 x)`` (Shazeer 2020), hidden width ``d_ff``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.up = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def make_mlp(config: TransformerConfig) -> nn.Module:
    return SwiGLU(config) if config.mlp == "swiglu" else MLP(config)


class _Residual(nn.Module):
    """One sublayer with its norm, in the config's pre- or post-norm arrangement."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.norm = make_norm(config.norm, config.d_model, config.norm_eps)
        self.pre = config.norm_position == "pre"
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.pre:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """Self-attention then MLP. With ``causal=True`` it is the block of a decoder-only LM.

    Args:
        config: the model config.
        causal: mask future positions in the self-attention.
    """

    def __init__(self, config: TransformerConfig, causal: bool = False) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(config, causal=causal)
        self.mlp = make_mlp(config)
        self.attn_residual, self.mlp_residual = _Residual(config), _Residual(config)

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None, coords: Tensor | None = None
    ) -> Tensor:
        """(B, N, d) -> (B, N, d); ``key_padding_mask`` (B, N) True where a token may be
        attended."""
        x = self.attn_residual(
            x, lambda h: self.attn(h, key_padding_mask=key_padding_mask, coords=coords)
        )
        return self.mlp_residual(x, self.mlp)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder output, then MLP."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(config, causal=True)
        self.cross_attn = MultiHeadAttention(config, cross=True)
        self.mlp = make_mlp(config)
        self.attn_residual, self.cross_residual, self.mlp_residual = (
            _Residual(config),
            _Residual(config),
            _Residual(config),
        )

    def forward(
        self, x: Tensor, memory: Tensor, memory_padding_mask: Tensor | None = None
    ) -> Tensor:
        """x (B, N, d) attends causally to itself and fully to ``memory`` (B, M, d)."""
        x = self.attn_residual(x, self.attn)
        x = self.cross_residual(
            x, lambda h: self.cross_attn(h, memory=memory, key_padding_mask=memory_padding_mask)
        )
        return self.mlp_residual(x, self.mlp)
