"""The decoder-only transformer: pre-norm blocks of attention and MLP around a residual stream."""

from __future__ import annotations

from torch import Tensor, nn

from .attention import MultiHeadAttention
from .config import TransformerConfig

__all__ = ["MLP", "Block", "DecoderLM"]


class MLP(nn.Module):
    """``W_2 GELU(W_1 x)``, hidden width ``d_ff``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.attn = MultiHeadAttention(config)
        self.mlp_norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:  # (B, N, d)
        x = x + self.dropout(self.attn(self.attn_norm(x)))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class DecoderLM(nn.Module):
    """Token embedding, ``n_layers`` causal blocks, final norm, tied LM head: (B, N) -> (B, N, V)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.embed.weight  # weight tying
        self.apply(_init_weights)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"Expected `tokens` of shape (batch, seq), got {tuple(tokens.shape)}")
        x = self.embed(tokens)  # (B, N, d)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, N, V)


def _init_weights(module: nn.Module) -> None:
    # std = 1/sqrt(fan_in) keeps attention logits O(1) at d_model = 64; GPT-2's fixed 0.02 is
    # sized for d_model = 768 and leaves a small model's attention uniform for a long plateau.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=module.in_features**-0.5)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):  # tied to the head, which has fan_in = d_model too
        nn.init.normal_(module.weight, std=module.embedding_dim**-0.5)
