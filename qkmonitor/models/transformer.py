"""The bundled transformer family, all from one :class:`TransformerConfig`.

- :class:`DecoderLM` — decoder-only language model: (B, N) tokens -> (B, N, V) logits.
- :class:`EncoderClassifier` — bidirectional encoder, mean-pooled: (B, N) -> (B, C).
- :class:`EncoderDecoder` — sequence to sequence with cross-attention: (B, M), (B, N) -> (B, N, V).
- :class:`VisionEncoder` — encoder over a grid of patches (2-D images, 3-D video):
  (B, P, patch_dim) -> (B, C), or per-patch features.

Every attention, self or cross, is a :class:`~qkmonitor.models.attention.MultiHeadAttention`, so
the monitors find them all. Positions: additive (learned, sinusoidal) at the embedding, or
rotary inside attention (RoPE, axial RoPE for grids), or none.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .additive_positions import LearnedPositionalEmbedding, PositionalEncoding
from .axial_rope import grid_coords
from .config import TransformerConfig
from .layers import DecoderLayer, EncoderLayer
from .norms import make_norm

__all__ = ["DecoderLM", "EncoderClassifier", "EncoderDecoder", "VisionEncoder"]


def _additive_positions(config: TransformerConfig, max_len: int) -> nn.Module | None:
    if config.positional == "learned":
        return LearnedPositionalEmbedding(max_len, config.d_model)
    if config.positional == "sinusoidal":
        return PositionalEncoding(config.d_model, max_len)
    return None


def _final_norm(config: TransformerConfig) -> nn.Module:
    # Pre-norm leaves the residual stream unnormalized; post-norm layers already end on a norm.
    return (
        make_norm(config.norm, config.d_model, config.norm_eps)
        if config.norm_position == "pre"
        else nn.Identity()
    )


class _Embedding(nn.Module):
    """Token embedding plus additive positions (if the config asks for them)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.max_len = config.max_seq_len
        self.positions = _additive_positions(config, config.max_seq_len)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"Expected `tokens` of shape (batch, seq), got {tuple(tokens.shape)}")
        if tokens.shape[1] > self.max_len:
            raise ValueError(
                f"Sequence length {tokens.shape[1]} exceeds `max_seq_len` {self.max_len}"
            )
        x = self.tokens(tokens)  # (B, N, d)
        if self.positions is not None:
            x = self.positions(x)
        return self.dropout(x)


class DecoderLM(nn.Module):
    """Token embedding, ``n_layers`` causal layers, final norm, LM head (tied by default)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = _Embedding(config)
        self.blocks = nn.ModuleList(
            EncoderLayer(config, causal=True) for _ in range(config.n_layers)
        )
        self.norm = _final_norm(config)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(_init_weights)
        if config.tie_embeddings:
            self.head.weight = self.embed.tokens.weight

    def forward(self, tokens: Tensor) -> Tensor:
        """(B, N) token ids -> (B, N, vocab) logits; position t sees tokens 0..t only."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class EncoderClassifier(nn.Module):
    """Bidirectional encoder; the mean of the unpadded positions goes to a linear classifier."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if config.num_classes is None:
            raise ValueError("Expected `num_classes` to be set for EncoderClassifier")
        self.config = config
        self.embed = _Embedding(config)
        self.blocks = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layers))
        self.norm = _final_norm(config)
        self.head = nn.Linear(config.d_model, config.num_classes)
        self.apply(_init_weights)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """(B, N) tokens, optional (B, N) bool mask True on real tokens -> (B, num_classes)."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, key_padding_mask=padding_mask)
        return self.head(_masked_mean(self.norm(x), padding_mask))


class EncoderDecoder(nn.Module):
    """Encoder over the source, decoder with cross-attention over the target; shared embedding."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = _Embedding(config)
        self.encoder = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layers))
        self.decoder = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_decoder_layers))
        self.encoder_norm, self.decoder_norm = _final_norm(config), _final_norm(config)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(_init_weights)
        if config.tie_embeddings:
            self.head.weight = self.embed.tokens.weight

    def encode(self, source: Tensor, source_padding_mask: Tensor | None = None) -> Tensor:
        """(B, M) source tokens -> (B, M, d) memory."""
        x = self.embed(source)
        for layer in self.encoder:
            x = layer(x, key_padding_mask=source_padding_mask)
        return self.encoder_norm(x)

    def decode(
        self, target: Tensor, memory: Tensor, source_padding_mask: Tensor | None = None
    ) -> Tensor:
        """(B, N) target tokens (shifted right) and memory -> (B, N, vocab) logits."""
        x = self.embed(target)
        for layer in self.decoder:
            x = layer(x, memory, memory_padding_mask=source_padding_mask)
        return self.head(self.decoder_norm(x))

    def forward(
        self, source: Tensor, target: Tensor, source_padding_mask: Tensor | None = None
    ) -> Tensor:
        return self.decode(target, self.encode(source, source_padding_mask), source_padding_mask)


class VisionEncoder(nn.Module):
    """Encoder over a grid of patches: linear patch embedding, positions, bidirectional layers.

    The grid is ``config.grid_size`` (e.g. (H, W) patches, or (T, H, W) for video), flattened
    row-major into P tokens. Positions are axial RoPE (``rope_2d`` / ``rope_3d``), learned or
    sinusoidal over the flattened index, or none.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if config.grid_size is None or config.patch_dim is None or config.num_classes is None:
            raise ValueError(
                "Expected `grid_size`, `patch_dim` and `num_classes` to be set for VisionEncoder"
            )
        self.config = config
        self.num_patches = int(torch.tensor(config.grid_size).prod())
        self.patch_embed = nn.Linear(config.patch_dim, config.d_model)
        self.positions = _additive_positions(config, self.num_patches)
        self.register_buffer(
            "coords", grid_coords(*config.grid_size), persistent=False
        )  # (P, axes)
        self.blocks = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layers))
        self.norm = _final_norm(config)
        self.head = nn.Linear(config.d_model, config.num_classes)
        self.apply(_init_weights)

    def features(self, patches: Tensor) -> Tensor:
        """(B, P, patch_dim) -> (B, P, d)."""
        if patches.dim() != 3 or patches.shape[1:] != (self.num_patches, self.config.patch_dim):
            raise ValueError(
                f"Expected `patches` of shape (batch, {self.num_patches}, "
                f"{self.config.patch_dim}), got {tuple(patches.shape)}"
            )
        x = self.patch_embed(patches)
        if self.positions is not None:
            x = self.positions(x)
        for block in self.blocks:
            x = block(x, coords=self.coords)
        return self.norm(x)

    def forward(self, patches: Tensor) -> Tensor:
        """(B, P, patch_dim) -> (B, num_classes), from the mean over patches."""
        return self.head(self.features(patches).mean(dim=1))


def _masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return x.mean(dim=1)
    weights = mask.to(x.dtype)[..., None]  # (B, N, 1)
    return (x * weights).sum(1) / weights.sum(1).clamp_min(1.0)


def _init_weights(module: nn.Module) -> None:
    # std = 1/sqrt(fan_in) keeps attention logits O(1) at d_model = 64; GPT-2's fixed 0.02 is
    # sized for d_model = 768 and leaves a small model's attention uniform for a long plateau.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=module.in_features**-0.5)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=module.embedding_dim**-0.5)
