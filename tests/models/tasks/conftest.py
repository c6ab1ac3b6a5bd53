"""Shared helpers for the task tests: a quiet real Trainer that records every validation."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch


class ValidationHistory(pl.Callback):
    """Keeps the logged metrics of every validation run, in order."""

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.history.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def best(self, key: str, mode: str = "max") -> float:
        values = [h[key] for h in self.history if key in h]
        return max(values) if mode == "max" else min(values)


@pytest.fixture
def fit(tmp_path):
    """``fit(task, data, steps, val_every)`` trains on a real CPU Trainer; returns the history."""

    def run(
        task: pl.LightningModule, data: pl.LightningDataModule, steps: int, val_every: int
    ) -> ValidationHistory:
        history = ValidationHistory()
        trainer = pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=steps,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            val_check_interval=val_every,
            check_val_every_n_epoch=None,
            num_sanity_val_steps=0,
            callbacks=[history],
        )
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small models: one thread is as fast, and fair on a shared CPU
        try:
            trainer.fit(task, datamodule=data)
        finally:
            torch.set_num_threads(threads)
        return history

    return run
