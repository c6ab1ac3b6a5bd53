"""A tiny bundled decoder, one batch of tokens and a LightningModule around them: what the tests of
the optimizer's view, the output logits and the rules that combine them train."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from qkmonitor.models import DecoderLM, TransformerConfig

TOKENS = torch.randint(0, 20, (3, 12), generator=torch.Generator().manual_seed(1))


def decoder(n_kv_heads: int | None = None) -> DecoderLM:
    """2 layers of 4 heads (``n_kv_heads`` key heads), d_model 32, vocabulary 20, seeded."""
    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=20, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, max_seq_len=16
    )
    return DecoderLM(config)


class TinyTask(pl.LightningModule):
    """``decoder()`` trained by AdamW on ``TOKENS[0]`` (8 batches of 2), its loss the mean
    log-partition of its logits; ``training_step`` calls the child model."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.model = decoder()
        self.lr = lr

    def training_step(self, batch, batch_idx):
        return self.model(batch).logsumexp(-1).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([TOKENS[0]] * 8, batch_size=2)


def first_raised(engines, warning: type[Warning], steps: int = 4, every: int = 2):
    """Train ``decoder()`` with AdamW in a plain loop under ``engines`` (``alert_action="raise"``)
    until an alert of class ``warning`` is raised: ``(step, message)``, or None if none is."""
    from qkmonitor.engine import Monitoring

    model = decoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    with Monitoring(model, engines, every_n_steps=every, optimizer=optimizer) as monitoring:
        for step in range(steps):
            try:
                with monitoring.step(step):
                    model(TOKENS).logsumexp(-1).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            except warning as alert:  # alert_action="raise", at the step's end
                return step, str(alert)
    return None
