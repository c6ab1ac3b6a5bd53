"""A LightningModule that trains a DecoderLM on next-token targets with ignored positions."""

from __future__ import annotations

import dataclasses
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import TransformerConfig
from ..transformer import DecoderLM
from .recall import IGNORE_INDEX

__all__ = ["CausalLMTask"]


class CausalLMTask(pl.LightningModule):
    """Cross-entropy on the positions whose target is not ``-100``; logs loss and accuracy.

    Args:
        config: the model.
        lr: peak AdamW learning rate, reached after ``warmup_steps`` linear warmup.
        weight_decay: AdamW weight decay on matrices (not on norms or embeddings).
        warmup_steps: linear warmup length in optimizer steps.
    """

    def __init__(self, config: TransformerConfig | dict, lr: float = 3e-3, weight_decay: float = 0.1,
                 warmup_steps: int = 100) -> None:
        super().__init__()
        if isinstance(config, dict):  # as saved in a checkpoint's hyper-parameters
            config = TransformerConfig(**config)
        if not lr >= 0:
            raise ValueError(f"Expected `lr` >= 0, got {lr}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"Expected `warmup_steps` to be an int >= 0, got {warmup_steps!r}")
        # a plain dict, so that checkpoints load with torch.load(weights_only=True)
        self.save_hyperparameters({"config": dataclasses.asdict(config), "lr": lr,
                                   "weight_decay": weight_decay, "warmup_steps": warmup_steps})
        self.model = DecoderLM(config)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def _step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        tokens, targets = batch
        logits = self(tokens)  # (B, N, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        scored = targets != IGNORE_INDEX
        acc = (logits.argmax(-1)[scored] == targets[scored]).float().mean()
        self.log(f"{stage}_loss", loss, prog_bar=True)
        self.log(f"{stage}_acc", acc, prog_bar=stage == "val")
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr, betas=(0.9, 0.98),
        )
        warmup = max(1, self.hparams.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
