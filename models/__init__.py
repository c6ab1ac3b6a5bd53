"""The bundled transformers and the example tasks.

Attention runs through :func:`qkmonitor.kernels.attention`; every attention module implements
:class:`qkmonitor.adapters.SupportsQKMonitor`, so the callbacks find it without special cases.
"""

from .attention import MultiHeadAttention
from .config import TransformerConfig
from .rope import RotaryEmbedding, apply_rotary_pos_emb
from .transformer import MLP, Block, DecoderLM

__all__ = [
    "MLP",
    "Block",
    "DecoderLM",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "TransformerConfig",
    "apply_rotary_pos_emb",
]
