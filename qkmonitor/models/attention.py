"""Multi-head (grouped-query) attention that qkmonitor can see into: self- and cross-attention."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from qkmonitor.attention.calls import TENSOR_PARALLEL
from qkmonitor.attention.clip import QKRows, linear_rows
from qkmonitor.attention.probes import AttentionCall, KernelCall, ObserverSet
from qkmonitor.kernels import attended_keys, attention
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.measures.sharding import SplitHeadsError

from .axial_rope import NDimensionalRoPE
from .config import TransformerConfig
from .norms import make_norm
from .rope import RopeScaling, RotaryEmbedding
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

    Implements :class:`qkmonitor.attention.adapters.SupportsQKMonitor`: ``qk_weights()`` for the
    spectrum, and ``register_probe`` for the activation statistics: while an observer is registered,
    every forward asks the kernel for its per-row statistics (computed in the same pass, no N x N
    matrix) and hands them to each observer (:mod:`qkmonitor.attention.probes`).

    Args:
        config: the model's config.
        causal: mask future keys (bottom-right aligned when N != M).
        cross: keys and values come from ``memory`` rather than ``x``.
    """

    def __init__(
        self, config: TransformerConfig, *, causal: bool = False, cross: bool = False
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.causal, self.cross, self.backend = causal, cross, config.attention_backend
        self.pv_rounding = config.attention_rounding
        kv_width = self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.k_proj = nn.Linear(config.d_model, kv_width, bias=config.bias)
        self.v_proj = nn.Linear(config.d_model, kv_width, bias=config.bias)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.q_norm = (
            make_norm(config.norm, self.head_dim, config.norm_eps) if config.qk_norm else None
        )
        self.k_norm = (
            make_norm(config.norm, self.head_dim, config.norm_eps) if config.qk_norm else None
        )
        self.rope = None if cross else _make_rope(config)
        self.scale_policy = make_attention_scale(
            config.attention_scale,
            self.head_dim,
            train_len=config.scale_train_len,
            c=config.polylog_c,
            p=config.polylog_p,
        )
        self.logit_factor = getattr(self.rope, "attention_factor", 1.0)  # YaRN temperature
        self.train_len = config.scale_train_len
        self._observers = ObserverSet()

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        coords: Tensor | None = None,
    ) -> Tensor:
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
            raise ValueError(
                "Cross-attention needs `memory`, the encoder output of shape (B, M, d)"
            )
        b, n, _ = x.shape
        q, k, v = self._project(x, memory if self.cross else x)
        q, k = self._position(q, k, coords)
        scale = self._row_scale(b, n, k.shape[2], key_padding_mask, q.device)
        if isinstance(scale, Tensor):  # a temperature per row: in q, the kernel scales by 1
            q, scale = q * scale.to(q.dtype), 1.0
        out = self._attend(q, k, v, key_padding_mask, scale)  # (B, H, N, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def _project(self, x: Tensor, source: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, N, D) from ``x``, k and v (B, H_kv, M, D) from ``source``; QK-norm applied."""
        b, n, _ = x.shape
        m = source.shape[1]
        q = self.q_proj(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, N, D)
        k = (
            self.k_proj(source).view(b, m, self.n_kv_heads, self.head_dim).transpose(1, 2)
        )  # (B, H_kv, M, D)
        v = self.v_proj(source).view(b, m, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _position(self, q: Tensor, k: Tensor, coords: Tensor | None) -> tuple[Tensor, Tensor]:
        """q and k rotated by RoPE (1-D, or axial by the tokens' grid ``coords``), if any."""
        if isinstance(self.rope, NDimensionalRoPE):
            if coords is None:
                raise ValueError(
                    "Axial RoPE needs `coords`, the (N, axes) grid coordinates of the tokens"
                )
            return self.rope(q, k, coords)
        if self.rope is not None:
            return self.rope(q, k)
        return q, k

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, scale: float
    ) -> Tensor:
        """The kernel's output; while probed, with the statistics the observers read, handed to
        them as a :class:`~qkmonitor.attention.probes.KernelCall`."""
        kwargs = dict(
            causal=self.causal,
            key_padding_mask=key_padding_mask,
            scale=scale,
            backend=self.backend,
            pv_rounding=self.pv_rounding,
        )
        if not self._observers:
            return attention(q, k, v, **kwargs)
        sink = self._observers.sink_tokens()
        if self._observers.wants_stats() or self._fused(q):
            out, stats = attention(q, k, v, return_stats=True, sink_tokens=sink, **kwargs)
        else:  # the largest logits alone: read from q and k, not from a statistics pass
            out, stats = attention(q, k, v, **kwargs), None
        self._observers.notify(
            KernelCall(
                q,
                k,
                scale=scale,
                causal=self.causal,
                key_padding_mask=key_padding_mask,
                stats=stats,
                stats_sink=sink,
            )
        )
        return out

    def _row_scale(
        self, b: int, n: int, m: int, key_padding_mask: Tensor | None, device
    ) -> float | Tensor:
        """The logit multiplier: a float when constant, else (B, 1, N, 1) from each row's key
        count."""
        if self.scale_policy.constant:
            return float(self.scale_policy(torch.tensor(float(m)))) * self.logit_factor
        keys = attended_keys(
            b, 1, n, m, causal=self.causal, key_padding_mask=key_padding_mask, device=device
        )
        return (self.scale_policy(keys.clamp_min(1.0)) * self.logit_factor)[..., None]

    @property
    def probing(self) -> bool:
        """Whether a probe is registered (the forward then computes statistics)."""
        return bool(self._observers)

    def register_probe(
        self, observer: Callable[[AttentionCall], None], sink_tokens: int = 0, stats: bool = True
    ) -> Callable[[], None]:
        """Hand every following forward to ``observer`` until the returned function is called.

        The forward then asks the kernel for its per-row statistics (same pass, no N x N matrix,
        with the most sink keys any observer wants) and passes a
        :class:`~qkmonitor.attention.probes.KernelCall` holding them, the scaled queries and the
        keys. When no observer reads statistics (``stats=False``: QK-Clip's largest logits) the
        torch backend skips them (the call computes the maximum alone when read); the fused kernel
        keeps them, as they cost it next to nothing.

        Returns:
            A function that removes exactly this observer.
        """
        return self._observers.add(observer, sink_tokens, stats)

    def _fused(self, q: Tensor) -> bool:
        """Whether the Triton kernel runs this call (its statistics are nearly free)."""
        return self.backend == "triton" or (self.backend == "auto" and q.is_cuda)

    def qk_weights(self) -> QKWeights:
        """``W_Q``, ``W_K`` and the logit scale at the training length.

        With RoPE this is the position-0 bilinear form ``W_Q W_K^T``; with QK-norm the per-head
        normalization sits between the projections and the product and is not included (the
        result says ``qk_norm=True``).

        Raises:
            SplitHeadsError: the projections hold other than ``n_heads`` (``n_kv_heads``) heads
                of ``head_dim`` rows: the heads split across ranks (tensor parallelism, the
                counts set to this rank's part), which qkmonitor does not read head by head.
        """
        self._check_whole_heads()
        scale = float(self.scale_policy(torch.tensor(float(self.train_len)))) * self.logit_factor
        return QKWeights(
            self.q_proj.weight,
            self.k_proj.weight,
            self.n_heads,
            self.n_kv_heads,
            scale,
            qk_norm=self.q_norm is not None,
        )

    def qk_rows(self) -> QKRows:
        """The query and key projections by head, for QK-Clip (:mod:`qkmonitor.attention.clip`)."""
        self._check_whole_heads()
        return linear_rows(
            self.q_proj, self.k_proj, self.n_heads, self.n_kv_heads, self.q_norm is not None
        )

    def _check_whole_heads(self) -> None:
        rows = (self.q_proj.weight.shape[0], self.k_proj.weight.shape[0])  # a DTensor's: all
        if rows != (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim):
            raise SplitHeadsError(
                f"its query and key projections hold {rows[0]} and {rows[1]} rows, not "
                f"{self.n_heads} and {self.n_kv_heads} heads of {self.head_dim}: its heads are "
                f"split across ranks ({TENSOR_PARALLEL}), which qkmonitor does not measure for "
                "qkmonitor's own attention"
            )


def _make_rope(config: TransformerConfig) -> nn.Module | None:
    kind = config.positional
    if kind in ("rope_2d", "rope_3d"):
        return NDimensionalRoPE(config.head_dim, config.grid_size, base=config.rope_base)
    if kind not in ("rope", "rope_interleaved"):
        return None
    scaling = None
    if config.rope_scaling is not None:
        original = max(1, int(config.max_seq_len / config.rope_scaling_factor))
        scaling = RopeScaling(
            kind=config.rope_scaling, factor=config.rope_scaling_factor, original_max_len=original
        )
    return RotaryEmbedding(
        config.head_dim,
        config.max_seq_len,
        base=config.rope_base,
        interleaved=kind == "rope_interleaved",
        scaling=scaling,
    )
