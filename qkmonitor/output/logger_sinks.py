"""Lightning's loggers as sinks: what each kind of logger gets from the monitors.

A ``CSVLogger`` (any logger without images) gets the scalars through ``log_metrics``
(:class:`LoggerSink`); TensorBoard also the images, histograms, texts and the run header
(:class:`TensorBoardSink`); W&B and MLflow the images too. :func:`guarded_sink` puts a logger's
sink behind its guard (:mod:`qkmonitor.output.guard`), one per logger. The sinks of a plain loop
(a ``SummaryWriter``, memory) are in :mod:`qkmonitor.output.sinks`.
"""

from __future__ import annotations

import weakref
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from torch import Tensor

from qkmonitor import private_apis
from qkmonitor.output.guard import GuardedSink
from qkmonitor.output.sinks import SummaryWriterSink, is_summary_writer

__all__ = [
    "LoggerSink",
    "MLflowSink",
    "TensorBoardSink",
    "WandbSink",
    "guarded_sink",
    "logger_sink",
    "made_sink",
]


class LoggerSink:
    """A Lightning logger as an engine sink: its scalars through ``log_metrics``, nothing else.

    This is what a logger without images gets (``CSVLogger``); :func:`logger_sink` picks the
    sink for each logger. A logger's ``prefix`` (``log_metrics`` prepends ``{prefix}-``) is
    :attr:`tag_prefix`, which the sinks below put on what they write outside ``log_metrics``, so
    that it sits beside the scalars.
    """

    draws = False

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        prefix = private_apis.logger_prefix(logger)
        #: what the logger's ``log_metrics`` puts before every tag ("" without a prefix)
        self.tag_prefix = f"{prefix}{getattr(logger, 'LOGGER_JOIN_CHAR', '-')}" if prefix else ""

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self.logger.log_metrics(scalars, step=step)

    # what a logger cannot show is dropped; the layout and hparams are TensorBoard's alone

    def log_text(self, tag: str, text: str, step: int) -> None:
        pass

    def log_image(self, tag: str, image: Any, step: int) -> None:
        pass

    def log_histogram(self, tag: str, values: Tensor, step: int) -> None:
        pass

    def log_layout(self, layout: dict) -> None:
        pass

    def log_hparams(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        pass


class TensorBoardSink(LoggerSink):
    """A logger with a TensorBoard ``SummaryWriter`` as its ``experiment``: texts, images,
    histograms, the layout and hparams through the writer, under :attr:`tag_prefix`.

    A ``TensorBoardLogger`` without a prefix gets the scalars through its writer too, one event a
    probe (``log_metrics`` writes an event per tag; see :class:`SummaryWriterSink`) — the same tags
    and values in the same run.
    """

    draws = True

    def __init__(self, logger: Any) -> None:
        super().__init__(logger)
        self._writer = SummaryWriterSink(logger.experiment, scalars=False)
        direct = isinstance(logger, TensorBoardLogger) and not self.tag_prefix
        self._scalar_writer = SummaryWriterSink(logger.experiment) if direct else None

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        if self._scalar_writer is not None:
            self._scalar_writer.log_scalars(scalars, step)
        else:
            super().log_scalars(scalars, step)
        prefixed = {self.tag_prefix + tag: value for tag, value in scalars.items()}
        self._writer.log_layer_runs(prefixed, step)  # the writer with the layout: its overlays
        self._writer.note_scalars(prefixed, step)

    @property
    def layout_pending(self) -> bool:
        """Whether the layout held back waits to be written (``SummaryWriterSink``)."""
        return self._writer.layout_pending

    def write_pending_layout(self) -> None:
        """Write the layout held back until the run's tags were known (``SummaryWriterSink``)."""
        self._writer.write_pending_layout()

    def log_text(self, tag: str, text: str, step: int) -> None:
        self._writer.log_text(self.tag_prefix + tag, text, step)

    def log_image(self, tag: str, image: Any, step: int) -> None:
        self._writer.log_image(self.tag_prefix + tag, image, step)

    def log_histogram(self, tag: str, values: Tensor, step: int) -> None:
        self._writer.log_histogram(self.tag_prefix + tag, values, step)

    def log_layout(self, layout: dict) -> None:
        self._writer.log_layout(layout)

    def log_hparams(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        self._writer.log_hparams(params, metrics)

    def flush(self) -> None:
        self._writer.flush()

    @property
    def log_dir(self) -> str | None:
        """The writer's run directory."""
        return self._writer.log_dir

    def reset(self) -> None:
        """After a failed write: the writer opens a new event file (``SummaryWriterSink.reset``)."""
        self._writer.reset()


class WandbSink(LoggerSink):
    """A ``WandbLogger``: images through its ``log_image`` (media under the image's tag) and
    histograms as ``wandb.Histogram``, both through ``log_metrics``, which puts the prefix on them.

    Alert texts are not written: their tag is the alert counter's, and a W&B key holds one kind of
    value (the alert is still warned, and counted under that tag).
    """

    draws = True

    def log_image(self, tag: str, image: Any, step: int) -> None:
        self.logger.log_image(key=tag, images=[image], step=step)

    def log_histogram(self, tag: str, values: Tensor, step: int) -> None:
        import wandb

        self.logger.log_metrics({tag: wandb.Histogram(values.detach().cpu().numpy())}, step=step)


class MLflowSink(LoggerSink):
    """An ``MLFlowLogger``: images and alert texts as the run's artifacts, one file a probe at
    ``{tag_prefix}{tag}/step_SSSSSS.png`` (``.txt`` for a text). MLflow has no histograms."""

    draws = True

    def log_image(self, tag: str, image: Any, step: int) -> None:
        self.logger.experiment.log_image(
            self.logger.run_id, image, artifact_file=self._path(tag, step, "png")
        )

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.logger.experiment.log_text(self.logger.run_id, text, self._path(tag, step, "txt"))

    def _path(self, tag: str, step: int, suffix: str) -> str:
        return f"{self.tag_prefix}{tag}/step_{step:06d}.{suffix}"


def logger_sink(logger: Any) -> LoggerSink | None:
    """The sink for one of the Trainer's loggers, chosen by what it really writes to: W&B and
    MLflow by class, TensorBoard by its ``experiment`` being a ``SummaryWriter``, scalars alone
    otherwise; None for Lightning's stand-in (``DummyLogger``: ``fast_dev_run``, the ``Tuner``),
    which writes nothing. A stand-in experiment answers every method (``DummyExperiment``, also a
    logger's on the ranks that do not write), so the methods an object answers say nothing."""
    if isinstance(logger, DummyLogger):
        return None
    if isinstance(logger, WandbLogger):
        return WandbSink(logger)
    if isinstance(logger, MLFlowLogger):
        return MLflowSink(logger)
    if is_summary_writer(getattr(logger, "experiment", None)):
        return TensorBoardSink(logger)
    return LoggerSink(logger)


#: each logger's guarded sink (:func:`guarded_sink`), made once: its guard counts the writes lost
_GUARDED: weakref.WeakKeyDictionary[Any, GuardedSink] = weakref.WeakKeyDictionary()


def guarded_sink(logger: Any) -> GuardedSink | None:
    """The logger's sink (:func:`logger_sink`) behind its guard (:mod:`qkmonitor.output.guard`:
    a write that fails is lost, not the fit), one per logger, shared by every monitor that writes
    there; a TensorBoard directory is retried once it can be written again."""
    guarded = _GUARDED.get(logger)
    if guarded is None:
        sink = logger_sink(logger)
        if sink is None:
            return None
        where = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
        destination = f"{type(logger).__name__} ({where})" if where else type(logger).__name__
        tensorboard = isinstance(sink, TensorBoardSink)
        if tensorboard:  # a SummaryWriter: its thread writes (output.guard)
            directory, reset = sink.log_dir, sink.reset
            destination = str(directory)
        else:
            directory, reset = None, None
        guarded = _GUARDED[logger] = GuardedSink(
            sink, destination, directory=directory, reset=reset, asynchronous=tensorboard
        )
    return guarded


def made_sink(logger: Any) -> GuardedSink | None:
    """The logger's guarded sink if :func:`guarded_sink` made it already, else None; never asks
    the logger for anything. A fit that failed reaches its loggers through these alone: a logger
    whose ``experiment`` was never made (its directory cannot be written) would raise again."""
    return _GUARDED.get(logger)
