"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"), generated from a seed.

A sequence lists ``num_pairs`` key–value pairs, then asks for ``num_queries`` of the keys again::

    k_1 v_1 k_2 v_2 ... k_P v_P   q_1 q_2 ... q_Q        (targets at q_j: its value a_j)

Keys are distinct within a sequence (token ids ``0 .. num_keys-1``), values are drawn at random
(ids ``num_keys .. num_keys+num_values-1``). The model is scored only where it must recall: at
each query ``q_j`` it predicts ``a_j``, the value that followed ``q_j`` earlier — an induction
circuit, which needs at least two attention layers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import IGNORE_INDEX, SIZES, TaskDataModule

__all__ = ["AssociativeRecallDataModule", "make_recall_batch"]


def make_recall_batch(
    n: int,
    num_pairs: int,
    num_queries: int,
    num_keys: int,
    num_values: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """``n`` recall sequences.

    Returns:
        tokens (n, L) and targets (n, L) with ``L = 2 * num_pairs + num_queries``; ``targets``
        holds each query's value at its position and ``IGNORE_INDEX`` (-100) elsewhere. The
        answers are never shown in the sequence, so no later query can be answered by
        elimination: the only way below ``log(num_pairs)`` loss is recall.
    """
    keys = torch.rand(n, num_keys, generator=generator).argsort(dim=1)[:, :num_pairs]  # distinct
    values = num_keys + torch.randint(num_values, (n, num_pairs), generator=generator)
    asked = torch.rand(n, num_pairs, generator=generator).argsort(dim=1)[:, :num_queries]
    context = torch.stack((keys, values), dim=2).flatten(1)  # k1 v1 k2 v2 ...
    tokens = torch.cat((context, keys.gather(1, asked)), dim=1)
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[:, 2 * num_pairs :] = values.gather(1, asked)
    return tokens, targets


class AssociativeRecallDataModule(TaskDataModule):
    """Train and validation sets of recall sequences, generated once from ``seed``.

    Args:
        num_pairs: key–value pairs per sequence (P).
        num_queries: queries per sequence (Q ≤ P).
        num_keys: key vocabulary (≥ P).
        num_values: value vocabulary.
        batch_size, train_size, val_size, seed: as :class:`~.base.TaskDataModule` (its
            examples are sequences).
    """

    def __init__(
        self,
        num_pairs: int = 6,
        num_queries: int = 6,
        num_keys: int = 24,
        num_values: int = 24,
        batch_size: int = 64,
        train_size: int = 50_000,
        val_size: int = 1_024,
        seed: int = 0,
    ) -> None:
        super().__init__("num_pairs", "num_queries", "num_keys", "num_values", *SIZES)
        if num_queries > num_pairs:
            raise ValueError(
                f"Expected `num_queries` <= `num_pairs` ({num_pairs}), got {num_queries}"
            )
        if num_keys < num_pairs:
            raise ValueError(
                f"Expected `num_keys` >= `num_pairs` ({num_pairs}) for distinct keys, got "
                f"{num_keys}"
            )
        self.vocab_size = num_keys + num_values
        self.seq_len = 2 * num_pairs + num_queries

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        shape = (hp.num_pairs, hp.num_queries, hp.num_keys, hp.num_values)
        self.generate_sets(lambda n, generator: make_recall_batch(n, *shape, generator))
