"""Multi-head (grouped-query) self-attention that qkmonitor can see into."""

from __future__ import annotations

import math

from torch import Tensor, nn

from qkmonitor.adapters import QKWeights
from qkmonitor.kernels import AttentionStats, attention

from .config import TransformerConfig
from .rope import RotaryEmbedding

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Causal self-attention with RoPE and GQA, computed by :func:`qkmonitor.kernels.attention`.

    ``q = x W_q^T`` split into H heads of d_k, ``k, v`` into H_kv heads;
    ``out = W_o · concat_h softmax(q_h k_g^T / sqrt(d_k)) v_g``.
    Implements :class:`qkmonitor.adapters.SupportsQKMonitor`: ``qk_weights()`` for the spectrum,
    and probing for the activation statistics: after ``set_probe(True)``, every forward asks the
    kernel for its per-row statistics (computed in the same pass, no N x N matrix) and keeps the
    last ones until ``pop_stats()`` takes them.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.backend = config.attention_backend
        kv_width = self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.k_proj = nn.Linear(config.d_model, kv_width, bias=config.bias)
        self.v_proj = nn.Linear(config.d_model, kv_width, bias=config.bias)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.rope = RotaryEmbedding(self.head_dim, config.max_seq_len, config.rope_base)
        self.probe = False
        self._stats: AttentionStats | None = None

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape  # (B, N, d)
        q = self.q_proj(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, N, D)
        k = self.k_proj(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, H_kv, N, D)
        v = self.v_proj(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, k)
        if self.probe:
            out, self._stats = attention(q, k, v, causal=True, scale=self.scale, backend=self.backend,
                                         return_stats=True)
        else:
            out = attention(q, k, v, causal=True, scale=self.scale, backend=self.backend)  # (B, H, N, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def set_probe(self, enabled: bool) -> None:
        """Turn statistics capture on or off for the following forwards."""
        self.probe = bool(enabled)
        if not enabled:
            self._stats = None

    def pop_stats(self) -> AttentionStats | None:
        """The statistics of the last forward since probing was turned on (then forgets them)."""
        stats, self._stats = self._stats, None
        return stats

    def qk_weights(self) -> QKWeights:
        """With RoPE this is the position-0 bilinear form ``W_Q W_K^T``."""
        return QKWeights(self.q_proj.weight, self.k_proj.weight, self.n_heads, self.n_kv_heads, self.scale)
