"""Small models of the three kinds the monitors meet, and a task that trains any of them.

Used by the callback tests: qkmonitor's own decoder, a user's nn.TransformerEncoder and a tiny
Hugging Face LLaMA, each learning next-token prediction on random tokens.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qkmonitor.models import DecoderLM, TransformerConfig

VOCAB, SEQ = 16, 8


class Encoder(nn.Module):
    """A user's own model: torch's nn.TransformerEncoder over token embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    return model


MODELS = {
    "bundled": lambda: DecoderLM(
        TransformerConfig(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, max_seq_len=SEQ)
    ),
    "torch-mha": Encoder,
    "hf-llama": tiny_llama,
}


class Task(pl.LightningModule):
    """Next-token prediction on random tokens; ``fail_at`` raises inside that step's forward."""

    def __init__(
        self,
        model: nn.Module,
        fail_at: int | None = None,
        error: type[BaseException] = RuntimeError,
    ):
        super().__init__()
        self.model, self.fail_at, self.error = model, fail_at, error

    def forward(self, tokens):
        out = self.model(tokens)
        return out.logits if hasattr(out, "logits") else out

    def training_step(self, batch, batch_idx):
        logits = self(batch[0])  # the probed forward runs, then the step fails
        if self.global_step == self.fail_at:
            raise self.error("the user's step failed")
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), batch[0][:, 1:].reshape(-1)
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        tokens = torch.randint(VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens), batch_size=4)
