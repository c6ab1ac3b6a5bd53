"""TransformerConfig: one dataclass describes every bundled model."""

from __future__ import annotations

from dataclasses import dataclass

from qkmonitor.kernels._options import PV_ROUNDINGS
from qkmonitor.validation import check_positive_int

__all__ = ["ATTENTION_SCALES", "POSITIONAL", "TransformerConfig"]

POSITIONAL = ("none", "learned", "sinusoidal", "rope", "rope_interleaved", "rope_2d", "rope_3d")
ATTENTION_SCALES = ("standard", "log_n", "polylog")
ROPE_SCALINGS = (None, "linear", "ntk", "yarn")


@dataclass
class TransformerConfig:
    """Hyper-parameters of a bundled transformer. Invalid values raise ``ValueError`` naming the
    field.

    The defaults are the CPU-sized decoder of ``qkmonitor train``.
    """

    vocab_size: int = 128
    d_model: int = 64  # residual width d; each head gets d_k = d_model // n_heads
    n_layers: int = 2  # two layers are the minimum for an induction (recall) circuit
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads (MHA); fewer = GQA; 1 = MQA
    d_ff: int | None = (
        None  # MLP hidden width; None = 4 * d_model (SwiGLU: 8/3 * d_model, same params)
    )
    max_seq_len: int = 256  # bounds position tables; longer inputs are rejected
    dropout: float = 0.0  # small tasks overfit little; dropout slows CPU training
    # -- block layout --
    norm: str = "layernorm"  # "layernorm" or "rmsnorm" (no mean subtraction, no bias)
    norm_position: str = (
        "pre"  # "pre": x + f(norm(x)), stable without warmup; "post": norm(x + f(x))
    )
    qk_norm: bool = False  # normalize q and k per head: bounds logits, a cure for entropy collapse
    mlp: str = "gelu"  # "gelu" or "swiglu"
    tie_embeddings: bool = True  # share the token embedding with the output head
    bias: bool = False  # LLaMA-style bias-free projections
    norm_eps: float = 1e-5
    # -- positions --
    positional: str = "rope"  # one of POSITIONAL; rope_2d / rope_3d are axial RoPE for grids
    rope_base: float = 10_000.0  # θ in θ^{-2i/d_k}; larger bases rotate slower
    rope_scaling: str | None = (
        None  # None, "linear", "ntk" or "yarn": stretch RoPE to longer contexts
    )
    rope_scaling_factor: float = 1.0  # s: the context is stretched s times beyond max_seq_len / s
    # -- attention temperature --
    attention_scale: str = "standard"  # one of ATTENTION_SCALES (see qkmonitor.models.scaling)
    scale_train_len: int | None = (
        None  # log_n: length beyond which logits sharpen; None = max_seq_len
    )
    polylog_c: float = 1.0  # polylog: f(T) = 1 + c (log T)^p
    polylog_p: float = 1.0
    # -- model family extras --
    n_decoder_layers: int | None = None  # encoder–decoder: decoder depth; None = n_layers
    num_classes: int | None = None  # encoder / vision classifiers
    grid_size: tuple[int, ...] | None = None  # vision: patches per axis, e.g. (4, 4) or (2, 4, 4)
    patch_dim: int | None = None  # vision: values per patch (channels * patch pixels)
    attention_backend: str = "auto"  # qkmonitor.kernels backend: "auto", "torch" or "triton"
    # how the kernel rounds the softmax weights before P·V (kernels.attention's `pv_rounding`):
    # "auto" (the backend's default), "float32" (no rounding: the exact reference), "kernel" (to
    # the values' dtype, as FlashAttention's GPU kernels do: biased, Qiu & Yao 2025) or "unbiased"
    # (rounded weights normalized by their own sum); only 2-byte inputs (autocast) are rounded
    attention_rounding: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            check_positive_int(name, getattr(self, name))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_decoder_layers is None:
            self.n_decoder_layers = self.n_layers
        if self.d_ff is None:
            self.d_ff = (
                4 * self.d_model if self.mlp != "swiglu" else _round_up(8 * self.d_model // 3, 8)
            )
        if self.scale_train_len is None:
            self.scale_train_len = self.max_seq_len
        for name in ("n_kv_heads", "n_decoder_layers", "d_ff", "scale_train_len"):
            check_positive_int(name, getattr(self, name))
        for name in ("num_classes", "patch_dim"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(
                f"Expected `d_model` ({self.d_model}) to be divisible by `n_heads` ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"Expected `n_kv_heads` ({self.n_kv_heads}) to divide `n_heads` ({self.n_heads})"
            )
        _check_choice("norm", self.norm, ("layernorm", "rmsnorm"))
        _check_choice("norm_position", self.norm_position, ("pre", "post"))
        _check_choice("mlp", self.mlp, ("gelu", "swiglu"))
        _check_choice("positional", self.positional, POSITIONAL)
        _check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        _check_choice("attention_scale", self.attention_scale, ATTENTION_SCALES)
        _check_choice("attention_backend", self.attention_backend, ("auto", "torch", "triton"))
        _check_choice("attention_rounding", self.attention_rounding, PV_ROUNDINGS)
        if self.positional.startswith("rope") and self.head_dim % 2:
            raise ValueError(
                f"Expected an even head dim for RoPE, got d_model / n_heads = {self.head_dim}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"Expected `dropout` in [0, 1), got {self.dropout}")
        if not self.rope_base > 1.0:
            raise ValueError(f"Expected `rope_base` > 1, got {self.rope_base}")
        if self.rope_scaling is not None and not self.rope_scaling_factor > 1.0:
            raise ValueError(
                f"Expected `rope_scaling_factor` > 1 with `rope_scaling`={self.rope_scaling!r}, "
                f"got {self.rope_scaling_factor}"
            )
        if self.grid_size is not None:
            self.grid_size = tuple(self.grid_size)
            for size in self.grid_size:
                check_positive_int("grid_size", size)
        axes = {"rope_2d": 2, "rope_3d": 3}.get(self.positional)
        if axes is not None and (self.grid_size is None or len(self.grid_size) != axes):
            raise ValueError(
                f"Expected `grid_size` with {axes} axes for `positional`={self.positional!r}, got "
                f"{self.grid_size}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, (value + multiple - 1) // multiple * multiple)


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"Expected `{name}` to be one of {choices}, got {value!r}")
