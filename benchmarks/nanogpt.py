"""A nanoGPT-style decoder (Karpathy's ``model.py``, trimmed) and a LightningModule that trains it.

It stands for third-party attention that qkmonitor finds with no user code: each
``CausalSelfAttention`` has one fused ``c_attn = nn.Linear(d, 3d)``, a ``c_proj``, ``n_head``,
and calls ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` (or, ``flash=False``,
nanoGPT's slow path: an explicit masked softmax); nothing in it imports qkmonitor. The sizes come
from a :class:`~qkmonitor.models.TransformerConfig` (``d_model``, ``n_layers``, ``n_heads``,
``d_ff``, ``max_seq_len``, ``vocab_size``, ``bias``, ``dropout``), so that it matches a bundled
model of the same config; positions are learned, as in nanoGPT, and the token embedding is tied
to the LM head. Used by ``benchmarks/overhead.py --arch nanogpt`` and ``benchmarks/cycles.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import TaskModule

__all__ = ["GPT", "NanoGPTTask"]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig, flash: bool = True) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.c_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_heads
        self.n_embd = config.d_model
        self.dropout = config.dropout
        self.flash = flash
        if not flash:  # nanoGPT's slow path: the causal mask as a buffer
            size = config.max_seq_len
            mask = torch.tril(torch.ones(size, size)).view(1, 1, size, size)
            self.register_buffer("bias", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: TransformerConfig, flash: bool = True) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config, flash)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """(B, T) tokens -> (B, T, V) logits; ``flash=False``: nanoGPT's slow path, an explicit masked
    softmax (``softmax(q @ kᵀ / √d) @ v``) where SDPA is not used."""

    def __init__(self, config: TransformerConfig, flash: bool = True) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.d_model),
            "wpe": nn.Embedding(config.max_seq_len, config.d_model),
            "drop": nn.Dropout(config.dropout),
            "h": nn.ModuleList([Block(config, flash) for _ in range(config.n_layers)]),
            "ln_f": nn.LayerNorm(config.d_model, bias=config.bias),
        })  # fmt: skip
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.size(1)
        if t > self.config.max_seq_len:
            raise ValueError(f"Sequence length {t} exceeds `max_seq_len` {self.config.max_seq_len}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class NanoGPTTask(TaskModule):
    """Next-token cross-entropy on :class:`GPT`, on the same ``(tokens, targets)`` batches and with
    the same optimizer and warmup as :class:`~qkmonitor.models.tasks.CausalLMTask` (targets of
    ``-100`` are not scored)."""

    def __init__(
        self,
        config: TransformerConfig | dict,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
        decay_steps: int | None = None,
    ) -> None:
        super().__init__(
            config,
            lr=lr,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            decay_steps=decay_steps,
            arch="nanogpt",
        )
        self.model = GPT(self.config)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        return self.token_loss(self(tokens), targets, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.token_loss(self(tokens), targets, "val")
