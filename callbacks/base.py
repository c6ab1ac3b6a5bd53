"""The Lightning side of qkmonitor: Trainer hooks mapped onto the core engines.

Each callback owns one :class:`~qkmonitor.engine.MonitorEngine` and nothing else: the engine
knows the layers, decides the probe steps, measures, alerts and builds the tags; this module gives
it a :class:`LightningHost` (the Trainer's loggers as sinks, ``rank_zero_warn``, ``should_stop``,
the learning rate) and calls it from the hooks. Probes are closed on success, on exception
(``on_exception``, which Lightning also calls for a keyboard interrupt), at ``on_train_end`` and
at ``teardown``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from qkmonitor.adapters import AttentionLayer
from qkmonitor.alerts import AlertTracker
from qkmonitor.engine import (
    Host,
    MonitorEngine,
    SummaryWriterSink,
    check_tag_collisions,
    write_run_header,
)
from qkmonitor.engine.base import ActivationEngine, Values

__all__ = ["AttentionMonitor", "ActivationMonitor", "LightningHost", "LoggerSink"]


class LoggerSink:
    """A Lightning logger as an engine sink: scalars through ``log_metrics``; texts, images,
    histograms, the layout and hparams through its TensorBoard ``SummaryWriter`` when it has one.

    A ``TensorBoardLogger`` without a prefix gets the scalars through its writer too, one event a
    probe (``log_metrics`` writes an event per tag; see :class:`SummaryWriterSink`) — the same tags
    and values in the same run. A logger's ``prefix`` (``log_metrics`` prepends ``{prefix}-``) is
    put on everything else it writes too: texts, images, histograms, and the layout's and hparams'
    tags (:attr:`tag_prefix`), so that the dashboards find the scalars.
    """

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        prefix = getattr(logger, "_prefix", "") or ""
        #: what the logger's ``log_metrics`` puts before every tag ("" without a prefix)
        self.tag_prefix = f"{prefix}{getattr(logger, 'LOGGER_JOIN_CHAR', '-')}" if prefix else ""
        experiment = getattr(logger, "experiment", None)
        self._writer = SummaryWriterSink(experiment, scalars=False) if hasattr(experiment, "add_image") else None
        self.draws = self._writer is not None
        direct = self.draws and isinstance(logger, TensorBoardLogger) and not self.tag_prefix
        self._scalar_writer = SummaryWriterSink(experiment) if direct else None

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        if self._scalar_writer is not None:
            self._scalar_writer.log_scalars(scalars, step)
        else:
            self.logger.log_metrics(scalars, step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        if self._writer is not None:
            self._writer.log_text(self.tag_prefix + tag, text, step)

    def log_image(self, tag: str, image: Any, step: int) -> None:
        if self._writer is not None:
            self._writer.log_image(self.tag_prefix + tag, image, step)

    def log_histogram(self, tag: str, values: Tensor, step: int) -> None:
        if self._writer is not None:
            self._writer.log_histogram(self.tag_prefix + tag, values, step)

    def __getattr__(self, name: str) -> Any:  # log_layout, log_hparams go to the writer
        if name.startswith("log_") and self.__dict__.get("_writer") is not None:
            return getattr(self._writer, name)
        if name.startswith("log_"):
            return lambda *args, **kwargs: None  # a logger that cannot show it
        raise AttributeError(name)


class LightningHost(Host):
    """A Trainer as the engine's host."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.owner = trainer

    @property
    def is_logging_rank(self) -> bool:  # type: ignore[override]
        return self.trainer.is_global_zero

    def sinks(self) -> list[LoggerSink]:
        return [LoggerSink(logger) for logger in self.trainer.loggers]

    def warn(self, message: str, category: type[Warning] = UserWarning) -> None:
        rank_zero_warn(message, category=category)

    def info(self, message: str) -> None:
        rank_zero_info(message)

    def stop(self) -> None:
        self.trainer.should_stop = True

    def learning_rate(self) -> float | None:
        for optimizer in self.trainer.optimizers:
            for group in optimizer.param_groups:
                if "lr" in group:
                    return float(group["lr"])
        return None


class AttentionMonitor(Callback):
    """Base of the qkmonitor callbacks: a Lightning adapter over one engine.

    Args:
        engine: the engine this callback drives.
    """

    def __init__(self, engine: MonitorEngine) -> None:
        self.engine = engine
        self._headers: set[str] = set()
        self._batch_step = 0  # the global step the current training batch started on
        # Lightning reads `state_key` at every hook call of every callback (its profiler names
        # the hook with it); prefix and selection are fixed at construction, so build it once
        self._state_key = self._generate_state_key(prefix=engine.prefix, layers=engine.selection())

    # -- the engine's state, read where users and tests look for it ---------------------------

    @property
    def layers(self) -> list[AttentionLayer]:
        return self.engine.layers

    @property
    def latest(self) -> Values:
        """The last probe's values: metric -> one (num_heads,) float CPU tensor per layer."""
        return self.engine.latest

    @property
    def latest_step(self) -> int | None:
        return self.engine.latest_step

    @property
    def tracker(self) -> AlertTracker:
        return self.engine.tracker

    @property
    def prefix(self) -> str:
        return self.engine.prefix

    @property
    def every_n_steps(self) -> int | None:
        return self.engine.every_n_steps

    @property
    def metric_names(self) -> tuple[str, ...]:
        return self.engine.metric_names

    @property
    @override
    def state_key(self) -> str:
        return self._state_key

    # -- Lightning hooks ----------------------------------------------------------------------

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # here, not in `setup`: a model built in `configure_model` exists now, the strategy has
        # put it on its device, and Lightning has not yet written its own hparams record
        self._bind(trainer, pl_module)
        monitors = [cb for cb in trainer.callbacks if isinstance(cb, AttentionMonitor)]
        if monitors[-1] is self:  # every monitor is bound now: one header for the run
            check_tag_collisions([m.engine for m in monitors])
            self._write_header(trainer, pl_module, monitors)
        if not trainer.loggers and self is monitors[0]:
            rank_zero_warn("qkmonitor: the Trainer has no logger; metrics are kept in each monitor's `.latest` "
                           "and alerts still fire, but nothing is written.")

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.engine.layers:  # `trainer.validate(...)` without a fit
            self._bind(trainer, pl_module)

    def _bind(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.engine.bind(pl_module, default_every_n_steps=trainer.log_every_n_steps)
        self.engine.report_discovery(LightningHost(trainer))

    def _write_header(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                      monitors: list[AttentionMonitor]) -> None:
        """The run's layout and hparams record, once per TensorBoard run directory."""
        if not trainer.is_global_zero:
            return
        sinks = [sink for sink in LightningHost(trainer).sinks() if sink.draws]
        if trainer.loggers and not sinks and "none" not in self._headers:
            self._headers.add("none")
            rank_zero_warn("qkmonitor: no TensorBoard logger, so the dashboards (layout, heatmaps, histograms, "
                           "attention images, hparams) are skipped; scalars are logged.")
        new = [sink for sink in sinks if _run_dir(sink) not in self._headers]
        if not new:
            return
        hparams = dict(pl_module.hparams)
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None:
            hparams.update(getattr(datamodule, "hparams", {}))
        write_run_header(new, [m.engine for m in monitors], hparams)
        self._headers.update(_run_dir(sink) for sink in new)

    def _observe_loss(self, outputs: Any) -> None:
        """Hand the batch's training loss (``training_step``'s return: the tensor, or its
        ``"loss"``) to the engine, at the step the batch started on, for the rules that read it."""
        if not self.engine.wants_loss(self._batch_step):
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, Tensor) and loss.numel() == 1:
            self.engine.observe_loss(self._batch_step, loss)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.engine.abort()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.engine.abort()  # a probed batch that never ended (e.g. skipped)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.engine.abort()

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict)


class ActivationMonitor(AttentionMonitor):
    """A monitor of the forward pass: probes open for the first batch of every
    ``every_n_steps``-th optimizer step (step 0 included) and close when that batch ends.

    Values are logged at the step the batch started on, i.e. for the weights the spectrum monitor
    logs at the same step. Validation is not probed unless ``probe_validation=True``: then the
    first batch of every validation run is measured and logged under ``{prefix}/val/...`` (no
    alerts).
    """

    engine: ActivationEngine

    def __init__(self, engine: ActivationEngine, probe_validation: bool = False) -> None:
        if not isinstance(probe_validation, bool):
            raise ValueError(f"Expected `probe_validation` to be a bool, got {probe_validation!r}")
        super().__init__(engine)
        self.probe_validation = probe_validation

    @property
    def latest_validation(self) -> Values:
        """The last validation probe's values, like :attr:`latest`."""
        return self.engine.latest_validation

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch_step = trainer.global_step
        self.engine.open(self._batch_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._observe_loss(outputs)
        if self.engine.probing:
            self.engine.finish(LightningHost(trainer))

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.probe_validation and batch_idx == 0 and dataloader_idx == 0 and not trainer.sanity_checking:
            self.engine.open(trainer.global_step, validation=True)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.engine.finish(LightningHost(trainer))


def _run_dir(sink: LoggerSink) -> str:
    return str(getattr(sink.logger, "log_dir", None) or id(sink.logger))
