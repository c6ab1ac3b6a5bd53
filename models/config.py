"""TransformerConfig: one dataclass describes every bundled model."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TransformerConfig"]


@dataclass
class TransformerConfig:
    """Hyper-parameters of a bundled transformer. Invalid values raise ``ValueError`` naming the field.

    The defaults are the CPU-sized model of ``qkmonitor train``.
    """

    vocab_size: int = 128
    d_model: int = 64  # residual width d; each head gets d_k = d_model // n_heads
    n_layers: int = 2  # two layers are the minimum for an induction (recall) circuit
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads (MHA); fewer = GQA; 1 = MQA
    d_ff: int | None = None  # MLP hidden width; None = 4 * d_model
    max_seq_len: int = 256  # only bounds the RoPE cache; longer inputs are rejected
    dropout: float = 0.0  # small tasks overfit little; dropout slows CPU training
    rope_base: float = 10_000.0  # θ in θ^{-2i/d_k}; larger bases rotate slower
    bias: bool = False  # LLaMA-style bias-free projections
    norm_eps: float = 1e-5
    attention_backend: str = "auto"  # qkmonitor.kernels backend: "auto", "torch" or "triton"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            _check_positive_int(name, getattr(self, name))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        _check_positive_int("n_kv_heads", self.n_kv_heads)
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        _check_positive_int("d_ff", self.d_ff)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"Expected `d_model` ({self.d_model}) to be divisible by `n_heads` ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"Expected `n_kv_heads` ({self.n_kv_heads}) to divide `n_heads` ({self.n_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"Expected an even head dim for RoPE, got d_model / n_heads = {self.head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"Expected `dropout` in [0, 1), got {self.dropout}")
        if not self.rope_base > 1.0:
            raise ValueError(f"Expected `rope_base` > 1, got {self.rope_base}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"Expected `attention_backend` to be 'auto', 'torch' or 'triton', got {self.attention_backend!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Expected `{name}` to be a positive int, got {value!r}")
