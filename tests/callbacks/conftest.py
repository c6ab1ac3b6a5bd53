"""Tiny real models and a reader for TensorBoard event files, shared by the callback tests."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import AssociativeRecallDataModule, CausalLMTask


def tiny_task(lr: float = 3e-3, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int | None = None):
    """The bundled decoder on a small recall dataset: (LightningModule, LightningDataModule)."""
    data = AssociativeRecallDataModule(
        num_pairs=3,
        num_queries=2,
        num_keys=8,
        num_values=8,
        batch_size=8,
        train_size=64,
        val_size=16,
        seed=0,
    )
    config = TransformerConfig(
        vocab_size=data.vocab_size,
        d_model=32,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        max_seq_len=data.seq_len,
    )
    return CausalLMTask(config, lr=lr, warmup_steps=0), data


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard run directory, read back by TensorBoard's own
    EventAccumulator."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture
def scalars_of():
    return read_scalars


@pytest.fixture
def make_task():
    return tiny_task
