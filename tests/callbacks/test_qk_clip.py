"""The QKClip callback in a real Lightning fit: it clips after every optimizer step, writes its
tags (read back with TensorBoard's EventAccumulator), leaves nothing on the model, and a resumed
fit goes on counting from the checkpoint."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from qkmonitor.callbacks import QKClip


def trainer(tmp_path, max_steps: int, callbacks) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=max_steps,
        logger=TensorBoardLogger(tmp_path, name="run", version=0),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    )


def clips_logged(scalars, layers: int = 2, heads: int = 4) -> list[list[int]]:
    """Per layer and head: the logged steps at which its clip factor was below 1."""
    return [
        [
            sum(v < 1 for _, v in scalars[f"qkmonitor/clip_factor/layer_{i:02d}_head_{h:02d}"])
            for h in range(heads)
        ]
        for i in range(layers)
    ]


def test_it_clips_after_every_step_logs_and_a_resume_keeps_the_counts(
    tmp_path, make_task, scalars_of, leftovers
):
    task, data = make_task(lr=0.05)
    clip = QKClip(tau=0.01, per_head=True)  # far below the heads' logits at initialization
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(tmp_path, 4, [clip, checkpoints]).fit(task, datamodule=data)
    assert leftovers(task) == []
    scalars = scalars_of(tmp_path / "run" / "version_0")
    assert [s for s, _ in scalars["qkmonitor/clip_factor/layer_00"]] == [0, 1, 2, 3]
    assert scalars["qkmonitor/clip_factor_max/layer_01"][0][1] < 1  # step 0: every head clipped
    saved = [c.tolist() for c in clip.engine.clip_counts]
    assert saved == clips_logged(scalars) and saved[0][0] > 1
    assert [v for _, v in scalars["qkmonitor/clip_count_max/layer_00"]][-1] == max(saved[0])

    resumed = QKClip(tau=0.01, per_head=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(tmp_path / "again", 6, [resumed]).fit(
            task, datamodule=data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
        )
    more = clips_logged(scalars_of(tmp_path / "again" / "run" / "version_0"))
    expected = [[a + b for a, b in zip(x, y)] for x, y in zip(saved, more)]
    assert [c.tolist() for c in resumed.engine.clip_counts] == expected


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"tau": -1.0}, "tau"), ({"every_n_steps": 0}, "every_n_steps")]
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        QKClip(**kwargs)


def test_a_callback_reused_for_a_second_fit_counts_from_zero_again(tmp_path, make_task, scalars_of):
    task, data = make_task(lr=0.05)
    clip = QKClip(tau=0.01, per_head=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(tmp_path / "first", 2, [clip]).fit(task, datamodule=data)
        first = [c.tolist() for c in clip.engine.clip_counts]
        trainer(tmp_path / "second", 2, [clip]).fit(task, datamodule=data)
    second = clips_logged(scalars_of(tmp_path / "second" / "run" / "version_0"))
    assert sum(map(sum, first)) > 0
    assert [c.tolist() for c in clip.engine.clip_counts] == second  # a new run, not first + second
