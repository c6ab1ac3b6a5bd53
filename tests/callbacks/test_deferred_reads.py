"""A Lightning fit with each probe logged at the end of the next batch (``defer_reads=True``, the
default on a GPU): TensorBoard holds what the probe's own step logs, read back by TensorBoard's
reader; an alert stops the fit a step later and names its probe step and that step's learning
rate under a scheduler."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from qkmonitor import OverLocalizationWarning
from qkmonitor.alerts import AlertRule
from qkmonitor.callbacks import QKMonitor

from .conftest import read_scalars, tiny_task

#: fires on every head from the first probe on (entropy is never negative)
ANY_ENTROPY = AlertRule(name="any_entropy", metric="entropy", threshold=0.0, above=True,
                        patience=1, margin=0.0, warning=OverLocalizationWarning, meaning="test",
                        advice="test")  # fmt: skip


class Scheduled:
    """``tiny_task``'s module with a learning rate that halves every step (what an alert names)."""

    def __new__(cls):
        task, data = tiny_task()
        configure = task.configure_optimizers

        def configure_optimizers():
            optimizer = configure()
            optimizer = optimizer[0][0] if isinstance(optimizer, tuple) else optimizer
            optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
            halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            every_step = {"scheduler": halving, "interval": "step"}
            return {"optimizer": optimizer, "lr_scheduler": every_step}

        task.configure_optimizers = configure_optimizers
        return task, data


def fit(tmp_path, defer: bool, action: str = "warn", steps: int = 6):
    pl.seed_everything(0, verbose=False)
    task, data = Scheduled()
    monitor = QKMonitor(every_n_steps=2, per_head=True, defer_reads=defer, alerts=[ANY_ENTROPY],
                        alert_action=action, visuals_every_n_probes=1,
                        rank={"max_probe_tokens": 8})  # fmt: skip
    logger = TensorBoardLogger(tmp_path / str(defer), name="", version="")
    trainer = pl.Trainer(max_steps=steps, logger=logger, callbacks=[monitor], log_every_n_steps=1,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(task, datamodule=data)
    said = [str(w.message) for w in caught if issubclass(w.category, OverLocalizationWarning)]
    scalars = read_scalars(logger.log_dir)
    # (values as their repr: a NaN equals itself there)
    ours = {
        tag: [(step, repr(value)) for step, value in points]
        for tag, points in scalars.items()
        if tag.startswith("qkmonitor/")
    }
    return ours, said, trainer.global_step


def test_a_deferred_fit_logs_what_an_immediate_one_logs(tmp_path):
    now, now_said, _ = fit(tmp_path, False)
    later, later_said, _ = fit(tmp_path, True)
    assert later == now and now  # every tag, every step, every value (float32 in the events)
    # probed steps, and the weights after the last update (read at the end, step 6)
    assert {step for points in now.values() for step, _ in points} == {0, 2, 4, 6}
    # the alerts name their probe step and the learning rate of that step (halved every step)
    assert later_said == now_said and now_said
    # (step 0's probe is logged once its batch has stepped the scheduler: the rate of then)
    assert all("at step 0, learning rate 0.0015:" in s for s in now_said), now_said


def test_a_deferred_alert_stops_the_fit_a_step_later(tmp_path):
    stops = {defer: fit(tmp_path, defer, action="stop", steps=8)[2] for defer in (False, True)}
    assert stops[True] == stops[False] + 1
