"""What every example task shares: argument checks, one AdamW + warmup training setup, and the
data modules' seeded loaders."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from qkmonitor.validation import check_non_negative_int, check_positive_int

from ..config import TransformerConfig

__all__ = ["IGNORE_INDEX", "SIZES", "TaskDataModule", "TaskModule", "lr_factor"]

#: the sizes every task's data module takes, checked positive (:class:`TaskDataModule`)
SIZES = ("batch_size", "train_size", "val_size")

#: Targets with this value are not scored (PyTorch's ``cross_entropy`` default).
IGNORE_INDEX = -100


def lr_factor(step: int, warmup: int, decay: int | None = None, floor: float = 0.1) -> float:
    """The learning rate at optimizer step ``step`` as a fraction of the peak.

    Linear warmup over ``warmup`` steps; then constant, or with ``decay`` a cosine from 1 down to
    ``floor`` at step ``decay`` (held after).
    """
    warmup = max(1, warmup)
    if step + 1 < warmup or decay is None:
        return min(1.0, (step + 1) / warmup)
    progress = min(1.0, (step + 1 - warmup) / max(1, decay - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class TaskDataModule(pl.LightningDataModule):
    """Base of the example data modules: the loaders over the ``train_set`` and ``val_set`` that
    the subclass's ``setup`` builds.

    Training batches hold ``hparams.batch_size`` examples (``None``: the whole training set) and
    are shuffled by a generator seeded with ``hparams.seed``, so that the same seed gives the same
    batches; validation batches hold ``val_batch_size`` examples, in order.

    The arguments every task's data module takes (each documents only its own):

    - ``batch_size``: examples per training batch.
    - ``train_size``: training examples (an epoch); validation uses ``val_size`` fresh ones.
    - ``val_size``: validation examples.
    - ``seed``: generator seed; the same seed gives the same data.

    Args:
        *positive: the names of the subclass's ``__init__`` arguments that must be positive
            integers (a ``ValueError`` names the first that is not); :data:`SIZES` holds the
            shared ones.
    """

    #: examples per validation batch (no gradients are kept, so larger than a training batch)
    val_batch_size: ClassVar[int] = 256

    train_set: Dataset
    val_set: Dataset

    def __init__(self, *positive: str) -> None:
        super().__init__()
        # the arguments of the subclass's ``__init__`` (the caller), as Lightning collects them
        caller = inspect.currentframe().f_back  # type: ignore[union-attr]
        self.save_hyperparameters(frame=caller)
        for name in positive:
            check_positive_int(name, self.hparams[name])

    def generate_sets(self, make: Callable[[int, torch.Generator], tuple[Tensor, ...]]) -> None:
        """``train_set`` from ``make(hparams.train_size, generator)``, the generator seeded with
        ``hparams.seed``; ``val_set`` from ``make(hparams.val_size, ...)`` seeded with
        ``hparams.seed + 1``, so that validation examples are drawn apart from training ones."""
        hp = self.hparams
        self.train_set = TensorDataset(*make(hp.train_size, torch.Generator().manual_seed(hp.seed)))
        self.val_set = TensorDataset(*make(hp.val_size, torch.Generator().manual_seed(hp.seed + 1)))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size or len(self.train_set),
            shuffle=True,
            generator=torch.Generator().manual_seed(self.hparams.seed),
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.val_batch_size)


class TaskModule(pl.LightningModule):
    """Base of the example tasks: checks and saves the hyper-parameters, builds the optimizer.

    Subclasses name their model's class in ``model_class`` (built from ``self.config`` as
    ``self.model``; ``None``: the subclass builds it) and implement the steps. Hyper-parameters
    are saved as plain values (the config as a dict) so that checkpoints load with
    ``torch.load(weights_only=True)``.

    Args:
        config: the model (a dict, as saved in a checkpoint, is accepted).
        lr: peak AdamW learning rate, reached after ``warmup_steps`` linear warmup, then constant.
        weight_decay: AdamW weight decay on matrices (not on norms, biases or 1-D parameters).
        warmup_steps: linear warmup length in optimizer steps.
        decay_steps: ``None`` keeps the peak rate after warmup; an int decays it along a cosine
            to a tenth of the peak at step ``decay_steps`` (then holds it): a run that ends on a
            low rate ends on a stable model rather than inside a loss spike.
        **extra: further hyper-parameters of the subclass, saved alongside.
    """

    #: the model the task trains, built from the config (``None``: the subclass builds it)
    model_class: ClassVar[Callable[[TransformerConfig], nn.Module] | None] = None

    def __init__(
        self,
        config: TransformerConfig | dict,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
        decay_steps: int | None = None,
        **extra: Any,
    ) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = TransformerConfig(**config)
        if not lr >= 0:
            raise ValueError(f"Expected `lr` >= 0, got {lr}")
        if not weight_decay >= 0:
            raise ValueError(f"Expected `weight_decay` >= 0, got {weight_decay}")
        check_non_negative_int("warmup_steps", warmup_steps)
        if decay_steps is not None:
            check_positive_int("decay_steps", decay_steps)
        self.config = config
        self.save_hyperparameters(
            {
                "config": dataclasses.asdict(config),
                "lr": lr,
                "weight_decay": weight_decay,
                "warmup_steps": warmup_steps,
                "decay_steps": decay_steps,
                **extra,
            }
        )
        if self.model_class is not None:
            self.model = self.model_class(self.config)

    def token_loss(self, logits: torch.Tensor, targets: torch.Tensor, stage: str) -> torch.Tensor:
        """Cross-entropy over the positions whose target is not ``IGNORE_INDEX``; logs
        ``{stage}_loss`` and ``{stage}_acc`` (accuracy on those positions).

        Args:
            logits: (B, N, V); targets: (B, N).
        """
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        scored = targets != IGNORE_INDEX
        acc = (logits.argmax(-1)[scored] == targets[scored]).float().mean()
        self.log(f"{stage}_loss", loss, prog_bar=True)
        self.log(f"{stage}_acc", acc, prog_bar=True)
        return loss

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
            betas=(0.9, 0.98),
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            partial(
                lr_factor, warmup=self.hparams.warmup_steps, decay=self.hparams.get("decay_steps")
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
