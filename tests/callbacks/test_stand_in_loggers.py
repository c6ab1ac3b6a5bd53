"""Runs whose logger is Lightning's stand-in: ``fast_dev_run`` and the ``Tuner`` replace the
Trainer's loggers by a ``DummyLogger``, whose ``experiment`` answers every method and writes
nothing. The monitors measure as in any run, write nothing there, and the sink of every logger is
chosen by what it really writes to."""

from __future__ import annotations

import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.logger import DummyExperiment, DummyLogger
from lightning.pytorch.tuner import Tuner
from torch.utils.tensorboard import SummaryWriter

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.engine.updates import UPDATE_METRICS
from qkmonitor.output.logger_sinks import LoggerSink, TensorBoardSink, logger_sink
from qkmonitor.output.runs import read_run


def monitors(every=2):
    return [
        QKSpectrumMonitor(every_n_steps=every),
        AttentionEntropyMonitor(every_n_steps=every),
        EffectiveRankMonitor(every_n_steps=every, max_probe_tokens=6),
    ]


def files_under(path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
    )


@pytest.mark.parametrize("logger", ["tensorboard", "csv", "none"])
def test_fast_dev_run_measures_and_writes_nothing(tmp_path, make_task, logger):
    loggers = {
        "tensorboard": TensorBoardLogger(tmp_path / "logs", name="run"),
        "csv": CSVLogger(tmp_path / "logs", name="run"),
        "none": False,
    }[logger]
    task, data = make_task()
    callbacks = monitors()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(
            default_root_dir=tmp_path,
            fast_dev_run=True,
            logger=loggers,
            callbacks=list(callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(task, datamodule=data)
    assert trainer.global_step == 1
    for monitor in callbacks:  # step 0 was measured: every value finite (but the update
        assert monitor.latest_step == 0  # metrics: no update comes before step 0)
        assert all(
            torch.isfinite(v).all()
            for name, vs in monitor.latest.items()
            if name not in UPDATE_METRICS
            for v in vs
        )
    assert not (tmp_path / "logs").exists() or files_under(tmp_path / "logs") == []
    qkmonitor = [str(w.message) for w in caught if "qkmonitor" in str(w.message)]
    assert not [m for m in qkmonitor if "no images" in m or "failed" in m], qkmonitor


def test_the_tuners_learning_rate_search_runs_with_the_monitors_and_is_unchanged_by_them(
    tmp_path, make_task
):
    """``lr_find`` trains under a stand-in logger; the monitors change nothing it measures, and
    the fit after it is measured and logged as usual."""
    found = []
    for callbacks in ([], monitors(every=5)):
        pl.seed_everything(0, verbose=False)
        task, data = make_task()
        trainer = pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=10,
            callbacks=list(callbacks),
            logger=TensorBoardLogger(tmp_path, name="tuned", version=len(found)),
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            log_every_n_steps=5,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = Tuner(trainer).lr_find(task, datamodule=data, num_training=12)
            found.append(result.results["loss"])
            trainer.fit(task, datamodule=data)
    assert found[0] == found[1]
    assert callbacks[1].latest_step == 5  # the fit after the search was probed
    run = read_run(tmp_path / "tuned" / "version_1")
    assert run.layers["entropy_norm"][0].steps == (0, 5)


def test_the_sink_is_chosen_by_what_the_logger_writes_to(tmp_path):
    assert logger_sink(DummyLogger()) is None

    class StandIn(CSVLogger):
        """A logger whose experiment answers every method but is no SummaryWriter (what a
        logger's experiment is on the ranks that do not write)."""

        @property
        def experiment(self):
            return DummyExperiment()

    assert type(logger_sink(StandIn(tmp_path))) is LoggerSink
    assert type(logger_sink(CSVLogger(tmp_path))) is LoggerSink
    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    assert isinstance(tensorboard.experiment, SummaryWriter)
    assert type(logger_sink(tensorboard)) is TensorBoardSink
