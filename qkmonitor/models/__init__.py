"""The bundled transformers, their building blocks, and the example tasks.

Attention runs through :func:`qkmonitor.kernels.attention`; every attention module implements
:class:`qkmonitor.attention.adapters.SupportsQKMonitor`, so the callbacks find it without special
cases. The names of the source document (``MultiHeadAttention``, ``PositionalEncoding``,
``apply_rotary_pos_emb``, ``NDimensionalRoPE``, ``CriticalAttentionScaling``, ``EncoderLayer``,
``DecoderLayer``, ``stable_softmax``) are the building blocks the models use, corrected.
"""

from .additive_positions import LearnedPositionalEmbedding, PositionalEncoding, sinusoidal_encoding
from .attention import MultiHeadAttention
from .axial_rope import NDimensionalRoPE, grid_coords
from .config import TransformerConfig
from .layers import MLP, DecoderLayer, EncoderLayer, SwiGLU
from .norms import RMSNorm
from .rope import RopeScaling, RotaryEmbedding, apply_rotary_pos_emb
from .scaling import (
    CriticalAttentionScaling,
    PolylogScale,
    StandardScale,
    make_attention_scale,
    stable_softmax,
)
from .transformer import DecoderLM, EncoderClassifier, EncoderDecoder, VisionEncoder

__all__ = [
    "MLP",
    "CriticalAttentionScaling",
    "DecoderLM",
    "DecoderLayer",
    "EncoderClassifier",
    "EncoderDecoder",
    "EncoderLayer",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "NDimensionalRoPE",
    "PolylogScale",
    "PositionalEncoding",
    "RMSNorm",
    "RopeScaling",
    "RotaryEmbedding",
    "StandardScale",
    "SwiGLU",
    "TransformerConfig",
    "VisionEncoder",
    "apply_rotary_pos_emb",
    "grid_coords",
    "make_attention_scale",
    "sinusoidal_encoding",
    "stable_softmax",
]
