"""Modular addition, the grokking task of Power et al. (2022), "Grokking: generalization beyond
overfitting on small algorithmic datasets" (arXiv 2201.02177).

Every equation ``a + b = c`` with ``a, b`` in ``0 .. p-1`` and ``c = (a + b) mod p`` is one
example, four tokens long; the model (a :class:`~qkmonitor.models.DecoderLM`, trained with
:class:`~qkmonitor.models.tasks.CausalLMTask`) is scored only on the answer, predicted at the
``=`` token::

    tokens   a  +  b  =          (ids: a, b in 0..p-1; "+" = p; "=" = p + 1)
    targets  .  .  .  c          (-100 = not scored)

A seeded shuffle splits the p² equations into a training fraction and a held-out rest, so
validation accuracy measures generalization to unseen pairs. With strong weight decay the model
first memorizes the training pairs and later generalizes ("grokking"). The paper's p = 97 takes
far too long on a CPU; the defaults use p = 23 (529 equations) with half of them for training.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from qkmonitor.validation import check_fraction, check_positive_int

from .base import IGNORE_INDEX, TaskDataModule

__all__ = ["ModularAdditionDataModule", "make_modular_addition"]


def make_modular_addition(modulus: int) -> tuple[Tensor, Tensor]:
    """All ``modulus**2`` equations, ``a`` major, ``b`` minor.

    Returns:
        tokens (p², 4) = ``a, p, b, p + 1`` and targets (p², 4), ``-100`` except the last column,
        which holds ``(a + b) mod p``.
    """
    check_positive_int("modulus", modulus)
    a, b = torch.cartesian_prod(torch.arange(modulus), torch.arange(modulus)).unbind(1)
    plus, equals = torch.full_like(a, modulus), torch.full_like(a, modulus + 1)
    tokens = torch.stack((a, plus, b, equals), dim=1)
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:, -1] = (a + b) % modulus
    return tokens, targets


class ModularAdditionDataModule(TaskDataModule):
    """A seeded train / validation split of all ``a + b = c (mod p)`` equations.

    Args:
        modulus: p, the modulus and the number of operand tokens (vocabulary p + 2).
        train_fraction: share of the p² equations used for training, in (0, 1); the rest is
            the validation set.
        batch_size: equations per training batch; ``None`` = the whole training set (full batch,
            as in the paper).
        seed: the split's (and the shuffling's) seed.
    """

    val_batch_size = 1024

    def __init__(
        self,
        modulus: int = 23,
        train_fraction: float = 0.5,
        batch_size: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__("modulus")  # no train_size or val_size; batch_size may be None
        if modulus < 2:
            raise ValueError(f"Expected `modulus` >= 2, got {modulus}")
        check_fraction("train_fraction", train_fraction)
        if batch_size is not None:
            check_positive_int("batch_size", batch_size)
        self.num_train = round(train_fraction * modulus**2)
        if not 0 < self.num_train < modulus**2:
            raise ValueError(
                f"Expected `train_fraction` to leave both sets non-empty for `modulus`={modulus}, "
                f"got {train_fraction}"
            )
        self.vocab_size = modulus + 2
        self.seq_len = 4

    def setup(self, stage: str | None = None) -> None:
        tokens, targets = make_modular_addition(self.hparams.modulus)
        order = torch.randperm(
            len(tokens), generator=torch.Generator().manual_seed(self.hparams.seed)
        )
        train, val = order[: self.num_train], order[self.num_train :]
        self.train_set = TensorDataset(tokens[train], targets[train])
        self.val_set = TensorDataset(tokens[val], targets[val])
