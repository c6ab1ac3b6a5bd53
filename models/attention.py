"""Multi-head (grouped-query) attention that qkmonitor can see into: self- and cross-attention."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkmonitor.adapters import QKWeights
from qkmonitor.functional import attention_probs
from qkmonitor.kernels import AttentionStats, attention
from qkmonitor.kernels._stats import attended_keys

from .config import TransformerConfig
from .norms import make_norm
from .positional import NDimensionalRoPE, RopeScaling, RotaryEmbedding
from .scaling import make_attention_scale

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head attention over (B, N, d) inputs, computed by :func:`qkmonitor.kernels.attention`.

    ``q = x W_q^T`` splits into H heads of d_k; ``k, v = m W_k^T, m W_v^T`` (``m = x`` for
    self-attention, the encoder output for cross-attention) into H_kv heads (GQA when fewer);
    ``out = W_o · concat_h softmax(τ_i · q_h k_g^T) v_g`` where the temperature ``τ_i`` comes from
    the config's attention-scale policy (``1/sqrt(d_k)`` for ``standard``; see
    :mod:`qkmonitor.models.scaling`) and depends on the number of keys row i attends. Optional
    QK-norm normalizes each head's q and k before RoPE. RoPE (1-D or axial N-D) applies to
    self-attention only: queries and keys of a cross-attention live on different sequences.

    Implements :class:`qkmonitor.adapters.SupportsQKMonitor`: ``qk_weights()`` for the spectrum,
    and probing for the activation statistics: after ``set_probe(True)``, every forward asks the
    kernel for its per-row statistics (computed in the same pass, no N x N matrix) and keeps the
    last ones until ``pop_stats()`` takes them.

    Args:
        config: the model's config.
        causal: mask future keys (bottom-right aligned when N != M).
        cross: keys and values come from ``memory`` rather than ``x``.
    """

    def __init__(self, config: TransformerConfig, *, causal: bool = False, cross: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.causal, self.cross, self.backend = causal, cross, config.attention_backend
        kv_width = self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.k_proj = nn.Linear(config.d_model, kv_width, bias=config.bias)
        self.v_proj = nn.Linear(config.d_model, kv_width, bias=config.bias)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.q_norm = make_norm(config.norm, self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = make_norm(config.norm, self.head_dim, config.norm_eps) if config.qk_norm else None
        self.rope = None if cross else _make_rope(config)
        self.scale_policy = make_attention_scale(
            config.attention_scale, self.head_dim, train_len=config.scale_train_len,
            c=config.polylog_c, p=config.polylog_p,
        )
        self.logit_factor = getattr(self.rope, "attention_factor", 1.0)  # YaRN temperature
        self.train_len = config.scale_train_len
        self.probe = False
        self._stats: AttentionStats | None = None
        self._probs: Tensor | None = None
        self._probs_slice: tuple[int, int] | None = None
        self._probe_users = 0
        #: while probing, also measure the attention mass on the first this-many keys (0: off)
        self.probe_sink_tokens = 0

    def forward(self, x: Tensor, memory: Tensor | None = None, key_padding_mask: Tensor | None = None,
                coords: Tensor | None = None) -> Tensor:
        """Attend from ``x`` (B, N, d) to itself or to ``memory`` (B, M, d).

        Args:
            x: queries' input (B, N, d).
            memory: keys' and values' input for cross-attention (B, M, d).
            key_padding_mask: (B, M) bool, True where a key may be attended.
            coords: (N, axes) integer grid coordinates for axial RoPE.

        Returns:
            (B, N, d).
        """
        if self.cross and memory is None:
            raise ValueError("Cross-attention needs `memory`, the encoder output of shape (B, M, d)")
        source = memory if self.cross else x
        b, n, _ = x.shape
        m = source.shape[1]
        self._last_n = n
        q = self.q_proj(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, N, D)
        k = self.k_proj(source).view(b, m, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, H_kv, M, D)
        v = self.v_proj(source).view(b, m, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if isinstance(self.rope, NDimensionalRoPE):
            if coords is None:
                raise ValueError("Axial RoPE needs `coords`, the (N, axes) grid coordinates of the tokens")
            q, k = self.rope(q, k, coords)
        elif self.rope is not None:
            q, k = self.rope(q, k)
        scale = self._row_scale(b, n, m, key_padding_mask, q.device)
        if isinstance(scale, Tensor):  # a temperature per row: fold it into q, the kernel scales by 1
            q, scale = q * scale.to(q.dtype), 1.0
        kwargs = dict(causal=self.causal, key_padding_mask=key_padding_mask, scale=scale, backend=self.backend)
        if self.probe:
            out, self._stats = attention(q, k, v, return_stats=True, sink_tokens=self.probe_sink_tokens, **kwargs)
            if self._probs_slice is not None:
                self._probs = self._explicit_probs(q, k, scale, key_padding_mask)
        else:
            out = attention(q, k, v, **kwargs)  # (B, H, N, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def _row_scale(self, b: int, n: int, m: int, key_padding_mask: Tensor | None, device) -> float | Tensor:
        """The logit multiplier: a float when constant, else (B, 1, N, 1) from each row's key count."""
        if self.scale_policy.constant:
            return float(self.scale_policy(torch.tensor(float(m)))) * self.logit_factor
        keys = attended_keys(b, 1, n, m, causal=self.causal, key_padding_mask=key_padding_mask, device=device)
        return (self.scale_policy(keys.clamp_min(1.0)) * self.logit_factor)[..., None]

    def set_probe(self, enabled: bool, probs_slice: tuple[int, int] | None = None) -> None:
        """Turn statistics capture on or off for the following forwards.

        Several monitors may probe at once: each ``set_probe(True)`` is matched by one
        ``set_probe(False)``, and capture stops when the last one has turned it off.

        Args:
            enabled: capture the kernel's per-row statistics.
            probs_slice: ``(sequences, rows)``: also keep the explicit attention matrix of the
                first ``sequences`` sequences and ``rows`` query rows (all keys), (S, H, R, M).
                Requests of several probes are merged (the largest of each).
        """
        if enabled:
            self._probe_users += 1
            if probs_slice is not None:
                old = self._probs_slice or (0, 0)
                self._probs_slice = (max(old[0], probs_slice[0]), max(old[1], probs_slice[1]))
        else:
            self._probe_users = max(0, self._probe_users - 1)
        self.probe = self._probe_users > 0
        if not self.probe:
            self._stats, self._probs, self._probs_slice = None, None, None
            self.probe_sink_tokens = 0

    def pop_stats(self) -> AttentionStats | None:
        """The statistics of the last probed forward (kept for every probe until capture stops)."""
        return self._stats

    def pop_probs(self, probs_slice: tuple[int, int] | None = None) -> Tensor | None:
        """The explicit attention matrix of the last probed forward, cut to ``probs_slice``."""
        if self._probs is None or probs_slice is None:
            return self._probs
        return self._probs[: probs_slice[0], :, : probs_slice[1]]

    def _explicit_probs(self, q: Tensor, k: Tensor, scale: float, key_padding_mask: Tensor | None) -> Tensor:
        sequences, rows = self._probs_slice
        q = q[:sequences, :, :rows]
        n, m = q.shape[2], k.shape[2]
        pad = None if key_padding_mask is None else key_padding_mask[:sequences]
        # rows [:R] of the full N x M matrix: keep the causal offset of the uncut rows
        bias = None
        if self.causal:
            full_n = self._last_n
            bias = torch.zeros(n, m, device=q.device).masked_fill(
                ~torch.ones(n, m, dtype=torch.bool, device=q.device).tril(diagonal=m - full_n), float("-inf"))
        return attention_probs(q.detach(), k[:sequences].detach(), scale=scale, key_padding_mask=pad, bias=bias)

    def qk_weights(self) -> QKWeights:
        """``W_Q``, ``W_K`` and the logit scale at the training length.

        With RoPE this is the position-0 bilinear form ``W_Q W_K^T``; with QK-norm the per-head
        normalization sits between the projections and the product and is not included.
        """
        scale = float(self.scale_policy(torch.tensor(float(self.train_len)))) * self.logit_factor
        return QKWeights(self.q_proj.weight, self.k_proj.weight, self.n_heads, self.n_kv_heads, scale)


def _make_rope(config: TransformerConfig) -> nn.Module | None:
    kind = config.positional
    if kind in ("rope_2d", "rope_3d"):
        return NDimensionalRoPE(config.head_dim, config.grid_size, base=config.rope_base)
    if kind not in ("rope", "rope_interleaved"):
        return None
    scaling = None
    if config.rope_scaling is not None:
        original = max(1, int(config.max_seq_len / config.rope_scaling_factor))
        scaling = RopeScaling(kind=config.rope_scaling, factor=config.rope_scaling_factor, original_max_len=original)
    return RotaryEmbedding(config.head_dim, config.max_seq_len, base=config.rope_base,
                           interleaved=kind == "rope_interleaved", scaling=scaling)
