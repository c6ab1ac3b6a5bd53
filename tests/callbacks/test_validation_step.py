"""``probe_validation=True`` writes its ``{prefix}/val`` tags at the step Lightning writes
``val_loss`` at, as TensorBoard's own event reader sees them: validation mid-epoch
(``val_check_interval``), at each epoch's end, and ``trainer.validate`` on its own."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qkmonitor.callbacks import QKMonitor

from .conftest import read_scalars
from .zoo import MODELS, SEQ, VOCAB, Task

VAL_TAG = "qkmonitor/val/entropy/layer_00"


class ValTask(Task):
    """:class:`Task` that logs its validation loss."""

    def validation_step(self, batch, batch_idx):
        logits = self(batch[0])
        loss = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), batch[0][:, 1:].reshape(-1)
        )
        self.log("val_loss", loss)

    def val_dataloader(self):
        tokens = torch.randint(VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(tokens), batch_size=4)


def trainer(tmp_path, **kwargs) -> pl.Trainer:
    monitor = QKMonitor(every_n_steps=2, probe_validation=True, rank=False, spectrum=False)
    return pl.Trainer(
        default_root_dir=tmp_path,
        logger=TensorBoardLogger(tmp_path),
        callbacks=[monitor],
        log_every_n_steps=1,
        limit_train_batches=4,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


def steps(log_dir, tag: str) -> list[int]:
    return [step for step, _ in read_scalars(log_dir)[tag]]


@pytest.mark.parametrize("val_check_interval", [0.5, 1.0])
def test_validation_tags_land_at_the_step_of_val_loss(tmp_path, val_check_interval):
    torch.manual_seed(0)
    fit = trainer(tmp_path, max_epochs=2, val_check_interval=val_check_interval)
    fit.fit(ValTask(MODELS["bundled"]()))
    log_dir = fit.logger.log_dir
    expected = steps(log_dir, "val_loss")
    assert len(expected) == (4 if val_check_interval == 0.5 else 2)
    assert steps(log_dir, VAL_TAG) == expected


def test_validate_alone_writes_at_the_step_of_val_loss(tmp_path):
    torch.manual_seed(0)
    run = trainer(tmp_path)
    run.validate(ValTask(MODELS["bundled"]()))
    log_dir = run.logger.log_dir
    assert steps(log_dir, VAL_TAG) == steps(log_dir, "val_loss") == [0]
