"""A LightningModule that trains a DecoderLM on next-token targets with ignored positions."""

from __future__ import annotations

from torch import Tensor

from ..transformer import DecoderLM
from .base import TaskModule

__all__ = ["CausalLMTask"]


class CausalLMTask(TaskModule):
    """Cross-entropy on the positions whose target is not ``-100``; logs loss and accuracy.

    Batches are ``(tokens, targets)``, both (B, N); ``targets[:, t]`` is what position ``t``
    should predict. Logs ``{stage}_loss`` (nats per scored token) and ``{stage}_acc`` (argmax
    accuracy over the scored tokens) for ``stage`` in ``train`` and ``val``.

    Args:
        config: the model.
        lr: peak AdamW learning rate, reached after ``warmup_steps`` linear warmup.
        weight_decay: AdamW weight decay on matrices (not on norms or embeddings).
        warmup_steps: linear warmup length in optimizer steps.
        decay_steps: ``None`` = constant after warmup; else a cosine decay to a tenth of ``lr``
            at that step (see :func:`~qkmonitor.models.tasks.base.lr_factor`).
    """

    model_class = DecoderLM

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def _step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        tokens, targets = batch
        logits = self(tokens)  # (B, N, V)
        return self.token_loss(logits, targets, stage)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")
