"""The instability miniature: the bundled decoder on associative recall in a plain loop under
:class:`qkmonitor.engine.Monitoring`, whose attention logits run away at a high learning rate.

``benchmarks/qk_clip.py`` runs it side by side with QK-Clip and QK-norm; the tests of the alerts
(``tests/core/test_instability.py``) and of QK-Clip (``tests/engine/test_qk_clip.py``) import it
through their ``benchmark_module`` fixture. It drives the monitors, so it lives here and not in
:mod:`qkmonitor.models` (the bundled models know no monitor: docs/architecture.md, "Layers").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from qkmonitor.engine import Monitoring
from qkmonitor.models import DecoderLM, TransformerConfig
from qkmonitor.models.tasks.base import IGNORE_INDEX, lr_factor
from qkmonitor.models.tasks.recall import make_recall_batch
from qkmonitor.output.sinks import MemorySink

__all__ = ["train_recall_miniature"]


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
    optimizers = _optimizers(model, optimizer, lr)
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


def _optimizers(model: nn.Module, kind: str, lr: float) -> list[torch.optim.Optimizer]:
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
