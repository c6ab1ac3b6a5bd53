"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"), generated from a seed.

A sequence lists ``num_pairs`` key–value pairs, then asks for ``num_queries`` of the keys again::

    k_1 v_1 k_2 v_2 ... k_P v_P   q_1 q_2 ... q_Q        (targets at q_j: its value a_j)

Keys are distinct within a sequence (token ids ``0 .. num_keys-1``), values are drawn at random
(ids ``num_keys .. num_keys+num_values-1``). The model is scored only where it must recall: at
each query ``q_j`` it predicts ``a_j``, the value that followed ``q_j`` earlier — an induction
circuit, which needs at least two attention layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from qkmonitor.validation import check_positive_int

from .base import IGNORE_INDEX

__all__ = ["AssociativeRecallDataModule", "make_recall_batch", "train_recall_miniature"]


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


class AssociativeRecallDataModule(pl.LightningDataModule):
    """Train and validation sets of recall sequences, generated once from ``seed``.

    Args:
        num_pairs: key–value pairs per sequence (P).
        num_queries: queries per sequence (Q ≤ P).
        num_keys: key vocabulary (≥ P).
        num_values: value vocabulary.
        batch_size: sequences per batch.
        train_size: training sequences (an epoch); validation uses ``val_size`` fresh ones.
        val_size: validation sequences.
        seed: generator seed; the same seed gives the same data.
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
        super().__init__()
        for name, value in (
            ("num_pairs", num_pairs),
            ("num_queries", num_queries),
            ("num_keys", num_keys),
            ("num_values", num_values),
            ("batch_size", batch_size),
            ("train_size", train_size),
            ("val_size", val_size),
        ):
            check_positive_int(name, value)
        if num_queries > num_pairs:
            raise ValueError(
                f"Expected `num_queries` <= `num_pairs` ({num_pairs}), got {num_queries}"
            )
        if num_keys < num_pairs:
            raise ValueError(
                f"Expected `num_keys` >= `num_pairs` ({num_pairs}) for distinct keys, got "
                f"{num_keys}"
            )
        self.save_hyperparameters()
        self.vocab_size = num_keys + num_values
        self.seq_len = 2 * num_pairs + num_queries

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        shape = (hp.num_pairs, hp.num_queries, hp.num_keys, hp.num_values)
        self.train_set = TensorDataset(
            *make_recall_batch(hp.train_size, *shape, torch.Generator().manual_seed(hp.seed))
        )
        self.val_set = TensorDataset(
            *make_recall_batch(hp.val_size, *shape, torch.Generator().manual_seed(hp.seed + 1))
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(self.hparams.seed),
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


def train_recall_miniature(
    engines: Sequence[Any],
    *,
    lr: float = 0.1,
    qk_norm: bool = False,
    seed: int = 0,
    steps: int = 150,
    warmup: int = 20,
    every_n_steps: int = 10,
    on_step: Callable[[int], None] | None = None,
    optimizer: str = "adamw",
    observe_loss: bool = True,
) -> list[float]:
    """The instability miniature: a small run whose attention logits run away at a high rate.

    The bundled decoder (d_model 32, 2 layers, 4 heads of d_k 8, RoPE, torch attention backend;
    QK-norm with ``qk_norm``) learns recall of 4 key-value pairs (batches of 32 from a generator
    seeded ``seed + 1``), AdamW (betas 0.9 / 0.98, weight decay 0.1) at peak ``lr`` after a
    linear warmup of ``warmup`` steps, in a plain loop driven by
    :class:`qkmonitor.engine.Monitoring` with ``engines`` (probing every ``every_n_steps``). At
    ``lr=0.1`` without QK-norm the logits reach hundreds and the loss stalls; its QK-norm twin
    trains. The tests of the alerts and of QK-Clip, and ``benchmarks/qk_clip.py``, run it.

    Args:
        on_step: called with the step after each step (e.g. to read an engine's latest values).
        optimizer: ``"adamw"``, or ``"muon"``: ``torch.optim.Muon`` (torch >= 2.9) for the 2-D
            weights of the blocks at ``lr``, AdamW for the embedding, norms and biases at
            ``lr / 10`` (Muon's authors keep those on AdamW; its updates are orthogonalized, so
            its rates run higher than AdamW's).
        observe_loss: hand each step's loss to the monitors (``Monitoring.observe_loss``), as the
            README asks; False leaves the loss-gated rules to test their metric alone.

    Returns:
        The training loss of every step.
    """
    from qkmonitor.engine import Monitoring
    from qkmonitor.output.sinks import MemorySink

    from ..config import TransformerConfig
    from ..transformer import DecoderLM
    from .base import lr_factor

    pairs = 4
    torch.manual_seed(seed)
    config = TransformerConfig(
        vocab_size=8 * pairs,
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=3 * pairs,
        qk_norm=qk_norm,
        attention_backend="torch",
    )
    model = DecoderLM(config)
    optimizers = _miniature_optimizers(model, optimizer, lr)
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda step: lr_factor(step, warmup))
        for o in optimizers
    ]
    monitoring = Monitoring(
        model,
        list(engines),
        writer=MemorySink(),
        optimizer=optimizers[0],
        every_n_steps=every_n_steps,
    )
    generator = torch.Generator().manual_seed(seed + 1)
    losses = []
    try:
        for step in range(steps):
            tokens, targets = make_recall_batch(32, pairs, pairs, 4 * pairs, 4 * pairs, generator)
            with monitoring.step(step):
                logits = model(tokens)
                loss = nn.functional.cross_entropy(
                    logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX
                )
                if observe_loss:
                    monitoring.observe_loss(loss)
                loss.backward()
                for o in optimizers:
                    o.step()
                    o.zero_grad()
            for schedule in schedules:
                schedule.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(step)
    finally:
        monitoring.close()
    return losses


def _miniature_optimizers(model: nn.Module, kind: str, lr: float) -> list[torch.optim.Optimizer]:
    if kind == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.1)]
    if kind != "muon":
        raise ValueError(f"Expected `optimizer` to be 'adamw' or 'muon', got {kind!r}")
    if not hasattr(torch.optim, "Muon"):
        raise ValueError("`optimizer='muon'` needs torch.optim.Muon (torch >= 2.9)")
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed" not in n)]
    return [
        torch.optim.Muon(hidden, lr=lr, weight_decay=0.1),
        torch.optim.AdamW(rest, lr=lr / 10, betas=(0.9, 0.98), weight_decay=0.0),
    ]
