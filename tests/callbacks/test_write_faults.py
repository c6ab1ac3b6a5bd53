"""Logging faults never stop training: a log directory deleted mid-run, and a write that raises
``OSError`` (a full disk), in a plain loop and in a Lightning fit.

The run ends normally; one warning names the destination and the error at the first lost write;
the monitors go on measuring; writing resumes when the directory comes back (read back with
TensorBoard's own reader); and the run's end says how many writes were lost, a number checked
against the writes the same run makes into a sink that never fails.
"""

from __future__ import annotations

import errno
import re
import shutil
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.callbacks.base import lost_writes
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.models import DecoderLM, TransformerConfig
from qkmonitor.output.guard import GuardedSink
from qkmonitor.output.publisher import PUBLISHER
from qkmonitor.output.sinks import MemorySink

EVERY, STEPS = 2, 12


def scalar_steps(log_dir, tag="qkmonitor/entropy_norm/layer_00") -> list[int]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def qkmonitor_warnings(caught) -> list[str]:
    return [
        str(w.message) for w in caught if "writ" in str(w.message) and "qkmonitor" in str(w.message)
    ]


class Counting(MemorySink):
    """A sink that never fails and counts every write by step (the twin run's writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[int | None] = []

    def log_scalars(self, scalars, step):
        self.writes.append(step)

    def log_text(self, tag, text, step):
        self.writes.append(step)

    def log_image(self, tag, image, step):
        self.writes.append(step)

    def log_histogram(self, tag, values, step):
        self.writes.append(step)


def plain_loop(writer, on_step=lambda step: None):
    """Three engines on the bundled decoder, probing every 2 steps, visuals every 2nd probe."""
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=2, max_seq_len=8)
    model = DecoderLM(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engines = [
        QKSpectrum(visuals_every_n_probes=2),
        AttentionEntropy(visuals_every_n_probes=2),
        EffectiveRank(visuals_every_n_probes=2, max_probe_tokens=6),
    ]
    tokens = torch.randint(16, (4, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitoring = Monitoring(model, engines, writer=writer, every_n_steps=EVERY)
        latest = []
        for step in range(STEPS):
            with monitoring.step(step):
                loss = model(tokens).logsumexp(-1).mean()
                monitoring.observe_loss(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            latest.append(engines[1].schedule.latest_step)
            monitoring.flush()  # what was drawn in the background is written before on_step
            on_step(step)
        monitoring.close()
    return latest, qkmonitor_warnings(caught)


def test_a_deleted_log_directory_in_a_plain_loop_loses_writes_not_the_run(tmp_path):
    log_dir = tmp_path / "run"
    gone, back = 3, 7  # deleted after step 3, back after step 7

    def on_step(step):
        if step == gone:
            shutil.rmtree(log_dir)
        elif step == back:
            log_dir.mkdir()

    latest, messages = plain_loop(SummaryWriter(log_dir), on_step)
    assert latest[-1] == STEPS - 2  # the monitors measured every probe

    # one warning at the first lost write, naming the directory and the error; then one that
    # says writing resumed, and the run's end with the count
    failed, resumed, report = messages
    assert failed.startswith(f"qkmonitor: writing to {log_dir} failed at step 4 (FileNotFoundError")
    lost = int(
        re.search(r"resumed at step 8; (\d+) write\(s\) were lost \(steps 4 to 6\)", resumed)[1]
    )
    assert report.startswith(f"qkmonitor: {lost} write(s) to {log_dir} were lost (steps 4 to 6)")

    # the lost writes are every write of the probes at 4 and 6, as a sink that never fails counts
    counting = Counting()
    plain_loop(counting)
    assert lost == sum(1 for step in counting.writes if step in (4, 6))
    # what was written before the deletion went with the directory; from step 8 it is back
    assert scalar_steps(log_dir) == [8, 10]


def test_a_log_directory_that_never_comes_back_ends_the_loop_normally(tmp_path):
    log_dir = tmp_path / "run"
    latest, messages = plain_loop(
        SummaryWriter(log_dir), lambda s: s == 3 and shutil.rmtree(log_dir)
    )
    assert latest[-1] == STEPS - 2
    failed, report = messages
    assert failed.startswith(f"qkmonitor: writing to {log_dir} failed at step 4")
    counting = Counting()
    plain_loop(counting)
    lost = sum(1 for step in counting.writes if step is not None and step >= 4)
    assert report.startswith(
        f"qkmonitor: {lost} write(s) to {log_dir} were lost (steps 4 to 10); it still fails"
    )
    assert not log_dir.exists()  # qkmonitor never made it again


class FullDisk(CSVLogger):
    """A logger whose writes of qkmonitor's values raise ENOSPC between two steps (the disk full,
    then freed); the training code's own metrics go through."""

    def __init__(self, *args, full: range, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.full, self.calls = full, []

    def log_metrics(self, metrics, step=None):
        if any(k.startswith("qkmonitor/") for k in metrics):
            self.calls.append(step)
            if step in self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
        super().log_metrics(metrics, step)


def fit(tmp_path, logger, extra=()):
    callbacks = [
        QKSpectrumMonitor(every_n_steps=EVERY),
        AttentionEntropyMonitor(every_n_steps=EVERY),
        EffectiveRankMonitor(every_n_steps=EVERY, max_probe_tokens=6),
    ]
    from .conftest import tiny_task

    task, data = tiny_task()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=STEPS,
            logger=logger,
            callbacks=[*callbacks, *extra],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            log_every_n_steps=1000,  # the training code's own logging stays out of the way
        )
        trainer.fit(task, datamodule=data)
    assert trainer.global_step == STEPS and callbacks[1].latest_step == STEPS - 2
    return trainer, qkmonitor_warnings(caught)


def test_a_write_that_raises_oserror_in_a_fit_is_lost_and_the_fit_ends_normally(tmp_path):
    logger = FullDisk(tmp_path, name="full", full=range(4, 8))
    trainer, messages = fit(tmp_path, logger)
    twin = FullDisk(tmp_path, name="twin", full=range(0))  # the same fit, on a disk never full
    fit(tmp_path, twin)
    lost = sum(1 for step in twin.calls if step in logger.full)
    failed, resumed, report = messages
    assert failed.startswith(f"qkmonitor: writing to FullDisk ({logger.log_dir}) failed at step 4")
    assert "(OSError: [Errno 28] No space left on device)" in failed
    assert f"resumed at step 8; {lost} write(s) were lost (steps 4 to 6)" in resumed
    assert report.startswith(f"qkmonitor: {lost} write(s) to FullDisk ({logger.log_dir}) were lost")
    assert lost_writes(trainer) == {f"FullDisk ({logger.log_dir})": lost}
    # the scalars of the other probes reached the logger's file
    written = {row["step"] for row in _csv_rows(logger) if row.get("qkmonitor/kappa/layer_00")}
    assert written == {
        "0",
        "2",
        "8",
        "10",
        "12",
    }  # the spectrum reads the weights after step 12 too


def _csv_rows(logger):
    import csv

    with open(logger.experiment.metrics_file_path) as file:
        return list(csv.DictReader(file))


class DeleteDirectory(pl.Callback):
    def __init__(self, gone, back) -> None:
        self.gone, self.back = gone, back

    def on_train_batch_end(self, trainer, *args):
        step = trainer.global_step - 1
        if step == self.gone:
            PUBLISHER.drain()  # what was drawn in the background is written first
            shutil.rmtree(trainer.logger.log_dir)
        elif step == self.back:
            import os

            os.makedirs(trainer.logger.log_dir)


@pytest.mark.parametrize("back", [7, None])
def test_a_deleted_tensorboard_directory_in_a_fit_loses_writes_and_the_fit_ends_normally(
    tmp_path, back
):
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer, messages = fit(tmp_path, logger, [DeleteDirectory(3, back)])
    assert messages[0].startswith(f"qkmonitor: writing to {logger.log_dir} failed at step 4")
    (count,) = lost_writes(trainer).values()
    assert messages[-1].startswith(f"qkmonitor: {count} write(s) to {logger.log_dir} were lost")
    if back is None:
        assert len(messages) == 2 and "it still fails" in messages[-1]
    else:
        assert "resumed at step 8" in messages[1]
        assert scalar_steps(logger.log_dir) == [8, 10]


def test_the_guard_passes_the_sinks_attributes_and_counts_nothing_when_nothing_fails():
    memory = MemorySink()
    guarded = GuardedSink(memory, "memory")
    guarded.log_scalars({"a": 1.0}, 3)
    assert guarded.scalars == [("a", 1.0, 3)] and guarded.draws
    assert guarded.report() is None and guarded.take_messages() == [] and guarded.lost_total == 0


class ReplaceDirectory(pl.Callback):
    """The logger's directory replaced by a file as probe step ``at`` starts: the monitors' writes
    at its end come before the logger's own (Lightning logs after the callbacks' batch end), and
    what the publishing thread confirms is waited for, so that the monitors' guard has seen the
    failure before the logger writes."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.at:
            PUBLISHER.drain()
            shutil.rmtree(trainer.logger.log_dir)
            open(trainer.logger.log_dir, "w").close()

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step - 1 == self.at:
            PUBLISHER.drain()


def _failed_fit(tmp_path, name, monitors):
    """A fit whose TensorBoardLogger writes every step and whose directory is replaced by a file
    as step 4 (a probe step) starts: the error it raises, and the logger."""
    from .conftest import tiny_task

    task, data = tiny_task()
    logger = TensorBoardLogger(tmp_path, name=name, version=0)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=STEPS,
        logger=logger,
        callbacks=[*monitors, ReplaceDirectory(4)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as raised:
            trainer.fit(task, datamodule=data)
    return raised.value, logger


def _root_cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def test_a_users_tensorboard_logger_that_fails_raises_lightnings_own_error(tmp_path):
    """The logger's own failure is raised as Lightning raises it without qkmonitor: the same OS
    error on the logger's own event file (the first write after the replacement may be the
    monitors'; their guard leaves the failed writer as it is, so the logger meets the failure its
    own write would have met, not one from a writer that qkmonitor reopened)."""
    alone, alone_logger = _failed_fit(tmp_path, "alone", [])
    monitored, logger = _failed_fit(
        tmp_path, "monitored", [AttentionEntropyMonitor(every_n_steps=EVERY)]
    )
    for err, its in ((alone, alone_logger), (monitored, logger)):
        cause = _root_cause(err)
        assert isinstance(cause, NotADirectoryError), repr(err)
        # the logger's own event file, in the directory that became a file
        assert cause.filename.decode().startswith(f"{its.log_dir}/events.out.tfevents."), cause
    # Lightning's own error either way, as it raises it without qkmonitor (which of the two
    # depends on which call meets the writer's failure first): a save()'s flush raising the
    # writer's error as it is, or log_metrics' ValueError made from it
    for err in (alone, monitored):
        assert type(err) in (NotADirectoryError, ValueError)
        assert isinstance(err, NotADirectoryError) or "you tried to log" in str(err)


def _chain(err: BaseException) -> list[BaseException]:
    """The error and every exception it carries (``__cause__``, else ``__context__``)."""
    chain = [err]
    while (err := err.__cause__ or err.__context__) is not None:
        chain.append(err)
    return chain


def _fit_into(log_dir, logger_class, monitors):
    """A fit whose logger's directory lies on a read-only mount: the error it raises, and the
    warnings given."""
    from .conftest import tiny_task

    task, data = tiny_task()
    trainer = pl.Trainer(
        max_steps=STEPS,
        logger=logger_class(log_dir, name="run"),
        callbacks=monitors,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    with warnings.catch_warnings(record=True) as caught, pytest.raises(BaseException) as raised:
        warnings.simplefilter("always")
        trainer.fit(task, datamodule=data)
    return raised.value, [str(w.message) for w in caught if "qkmonitor" in str(w.message)]


@pytest.mark.parametrize("logger_class", [TensorBoardLogger, CSVLogger])
def test_a_read_only_log_directory_fails_a_fit_with_lightnings_error_alone(
    read_only_dir, logger_class
):
    """Issue 59, item 7: Lightning alone raises one OSError (its logger cannot make its folder
    on the read-only mount); with ``QKMonitor`` the fit raises that same error and nothing else,
    carrying no exception of qkmonitor's (whose end of the run asked the logger for its
    ``experiment`` again, which raised again)."""
    from qkmonitor.callbacks import QKMonitor

    alone, _ = _fit_into(read_only_dir, logger_class, [])
    monitored, told = _fit_into(read_only_dir, logger_class, [QKMonitor(every_n_steps=EVERY)])
    for err in (alone, monitored):
        assert type(err) is OSError and err.errno == errno.EROFS, repr(err)
        assert err.filename == str(read_only_dir / "run"), err.filename
    assert [repr(e) for e in _chain(monitored)] == [repr(e) for e in _chain(alone)]
    assert monitored.__cause__ is None and monitored.__context__ is None
    assert told == []  # nothing of qkmonitor's failed on the way out


class FailAt(pl.Callback):
    """The user's error: raised as the training batch of ``step`` starts."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.step:
            raise RuntimeError("the user's step failed")


def test_what_still_fails_closing_the_monitors_after_a_fits_error_is_warned_not_chained(
    tmp_path, monkeypatch
):
    """Whatever raises while the monitors close after the fit's error is swallowed and warned:
    the fit raises the user's error alone, as it does without qkmonitor."""
    from qkmonitor.callbacks import QKMonitor, base

    def fails(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(base, "report_write_faults", fails)
    monitored, told = _fit_into(tmp_path, CSVLogger, [QKMonitor(every_n_steps=EVERY), FailAt(3)])
    assert type(monitored) is RuntimeError and str(monitored) == "the user's step failed"
    assert monitored.__cause__ is None and monitored.__context__ is None
    assert [message for message in told if "closing" in message] == [
        (
            "qkmonitor: closing the monitors after the fit's error failed too (OSError: "
            "[Errno 5] Input/output error); the fit's own error follows."
        )
    ]
