"""The Lightning side of qkmonitor: Trainer hooks mapped onto the core engines.

Each callback drives one or more :class:`~qkmonitor.engine.MonitorEngine` through one set of
hooks (:class:`AttentionMonitor`): the engines know the layers, decide the probe steps, measure,
alert and build the tags; this module gives them a :class:`LightningHost` (the Trainer's loggers
as sinks, a sink per kind of logger: :mod:`qkmonitor.output.logger_sinks`; ``rank_zero_warn``,
``should_stop``, the learning rate) and calls them from the hooks. Probes are closed on success, on
exception (``on_exception``, which Lightning also calls for a keyboard interrupt), at
``on_train_end`` and at ``teardown``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from qkmonitor.engine import (
    Host,
    MonitorEngine,
    check_tag_collisions,
    write_run_header,
)
from qkmonitor.engine.activation import ActivationEngine
from qkmonitor.engine.group import EngineGroup
from qkmonitor.engine.host import ScalarBatch
from qkmonitor.engine.publishing import Values
from qkmonitor.output.guard import GuardedSink, report_write_faults
from qkmonitor.output.logger_sinks import LoggerSink, guarded_sink, made_sink
from qkmonitor.validation import check_bool

__all__ = ["ActivationMonitor", "AttentionMonitor", "LightningHost"]


def lost_writes(trainer: pl.Trainer) -> dict[str, int]:
    """How many of the monitors' writes each of the Trainer's loggers lost (by destination), over
    the loggers' lives; empty when none was lost."""
    sinks = LightningHost(trainer).sinks()
    return {sink.destination: sink.lost_total for sink in sinks if sink.lost_total}


class LightningHost(Host):
    """A Trainer as the engine's host.

    Args:
        trainer: the Trainer.
        scalar_batch: where the scalars of one probe step are held (:class:`ScalarBatch`).
        made_only: the sinks made already and no others (:func:`made_sink`): after a failure,
            where asking a logger for its ``experiment`` may raise again.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        scalar_batch: ScalarBatch | None = None,
        *,
        made_only: bool = False,
    ) -> None:
        self.trainer = trainer
        self.owner = trainer
        self.scalar_batch = scalar_batch
        self.made_only = made_only

    @property
    def is_logging_rank(self) -> bool:  # type: ignore[override]
        return self.trainer.is_global_zero

    def sinks(self) -> list[GuardedSink]:
        sink_of = made_sink if self.made_only else guarded_sink
        return [sink for logger in self.trainer.loggers if (sink := sink_of(logger))]

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


class _StateKey:
    """A monitor's ``state_key``: the key built at construction. Lightning reads it before each
    hook it calls on a callback (its profiler names the hook with it), so read on the class itself
    (a class put in the Trainer's ``callbacks``, not an instance) it says so, where the hook would
    fail on its arguments (``on_exception() missing 1 required positional argument``)."""

    def __get__(self, instance: AttentionMonitor | None, owner: type) -> str:
        if instance is None:
            raise TypeError(
                f"Expected callback instances in the Trainer's `callbacks`, got the class "
                f"`{owner.__name__}`: pass an instance: `{owner.__name__}()`"
            )
        return instance._state_key


class AttentionMonitor(Callback):
    """Base of the qkmonitor callbacks: one set of Lightning hooks over one or more engines.

    Every callback is this driver: the single monitors (``QKSpectrumMonitor``,
    ``AttentionEntropyMonitor``, ``EffectiveRankMonitor``, ``QKClip``) drive one engine,
    ``QKMonitor`` several. A batch costs one schedule check: the steps where every engine may skip
    its work (the intersection of their ``between_probes``, and of their ``quiet`` steps) are
    skipped at once. Otherwise the batch's loss is read once and handed to the engines whose rules
    read it, the windows of the engines that probed are closed together
    (:func:`~qkmonitor.engine.base.finish_windows`: their aggregators reduced across processes in
    one collective), and the scalars of a probe step go out in one write
    (:class:`~qkmonitor.engine.host.ScalarBatch`: the spectrum read after the step before it
    waits for the activations measured in it).

    The engines' state (alert counts, the last probe step) goes into a checkpoint under
    :attr:`state_key`, where Lightning puts a callback's ``state_dict``, and comes back through
    ``load_state_dict`` on a resume. It is written by ``on_save_checkpoint`` rather than
    ``state_dict``: Lightning checks the keys of callbacks that override ``state_dict`` inside
    ``Trainer(...)``, and two monitors of one kind under one prefix would meet its "more than one
    stateful callback" error there instead of qkmonitor's, which names the prefix to change
    (``setup``).

    Args:
        engines: the engines this callback drives.
        probe_validation: also measure the first batch of each validation run with the engines of
            the forward pass, logged under ``{prefix}/val/...`` (no alerts).
    """

    def __init__(self, *engines: MonitorEngine, probe_validation: bool = False) -> None:
        check_bool("probe_validation", probe_validation)
        self.engines: list[MonitorEngine] = list(engines)
        if len(self.engines) == 1:
            self.engine = self.engines[0]
        self.probe_validation = probe_validation
        self._group = EngineGroup(self.engines)  # the schedule in common, the scalars held
        self._headers: set[str] = set()
        self._batch_step = 0  # the global step the current training batch started on
        # Lightning reads `state_key` at every hook call of every callback (its profiler names
        # the hook with it); prefix and selection are fixed at construction, so build it once
        first = self.engines[0]
        prefix = ",".join(dict.fromkeys(e.prefix for e in self.engines))
        self._state_key = self._generate_state_key(prefix=prefix, layers=first.selection())

    # -- what the callback measured: the last probe's values -----------------------------------

    @property
    def latest(self) -> Values:
        """The last probe's values: metric -> one (num_heads,) float CPU tensor per layer (every
        engine's metrics)."""
        return {name: grid for engine in self.engines for name, grid in engine.latest.items()}

    @property
    def latest_validation(self) -> Values:
        """The last validation probe's values, like :attr:`latest`."""
        return {
            name: grid for engine in self.engines for name, grid in engine.latest_validation.items()
        }

    @property
    def latest_step(self) -> int | None:
        """The step of the latest probe (of any engine)."""
        steps = [e.schedule.latest_step for e in self.engines]
        steps = [step for step in steps if step is not None]
        return max(steps) if steps else None

    state_key = _StateKey()

    # -- Lightning hooks ----------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        monitors = _monitors(trainer)
        if monitors[0] is self:  # before a checkpoint is restored or a model searched
            check_tag_collisions([e for m in monitors for e in m.engines])

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # here, not in `setup`: a model built in `configure_model` exists now, the strategy has
        # put it on its device, and Lightning has not yet written its own hparams record
        self._bind(trainer, pl_module)
        self._batch_step = trainer.global_step
        monitors = _monitors(trainer)
        if monitors[-1] is self:  # every monitor is bound now: one header for the run
            try:
                self._write_header(trainer, pl_module, monitors)
            except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
                rank_zero_warn(
                    f"qkmonitor: the run's layout and hparams record could not be written "
                    f"({type(err).__name__}: {err}); the metrics are logged without them.",
                    category=RuntimeWarning,
                )
        # the rules may read the metrics of every monitor of the Trainer, not only this one's
        everyone = [e for m in monitors for e in m.engines]
        for engine in everyone:
            engine.siblings = [e for e in everyone if e is not engine]
        if not trainer.loggers and self is monitors[0]:
            rank_zero_warn(
                "qkmonitor: the Trainer has no logger; metrics are kept in each monitor's "
                "`.latest` and alerts still fire, but nothing is written."
            )

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._group.bound_to(pl_module):  # `trainer.validate(...)` without a fit, or
            self._bind(trainer, pl_module)  # of another module than the last one bound

    def _bind(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._group.bind(
            pl_module, self._host(trainer), default_every_n_steps=trainer.log_every_n_steps
        )

    def _host(self, trainer: pl.Trainer) -> LightningHost:
        return LightningHost(trainer, scalar_batch=self._group.scalars)

    def _write_header(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, monitors: list[AttentionMonitor]
    ) -> None:
        """The run's layout and hparams record, once per TensorBoard run directory, and one line
        per run for each logger that takes no images."""
        if not trainer.is_global_zero:
            return
        sinks = LightningHost(trainer).sinks()
        for sink in sinks:
            if not sink.draws and f"no images {_run_dir(sink)}" not in self._headers:
                self._headers.add(f"no images {_run_dir(sink)}")
                rank_zero_warn(
                    f"qkmonitor: no images for {type(sink.logger).__name__} (the heatmaps, "
                    "histograms and attention images go to TensorBoard, W&B and MLflow loggers); "
                    "its scalars are logged."
                )
        new = [sink for sink in sinks if sink.draws and _run_dir(sink) not in self._headers]
        if not new:
            return
        hparams = dict(pl_module.hparams)
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None:
            hparams.update(getattr(datamodule, "hparams", {}))
        write_run_header(new, [e for m in monitors for e in m.engines], hparams)
        self._headers.update(_run_dir(sink) for sink in new)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == 0:  # the spectrum at initialization
            self._observe_weights(trainer, 0)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = self._batch_step = trainer.global_step
        if step not in self._group.between:  # no engine opens a window there (`steps_after`)
            self._group.open(self._host(trainer), step)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # `after`: the global step after this batch's optimizer step, whose weights a probe reads
        step, after, group = self._batch_step, trainer.global_step, self._group
        if step in group.between and (after in group.between or not group.weights):
            if step not in group.quiet:  # a rule reads this step's loss (`steps_after`)
                loss = self._loss_of(outputs)
                if loss is not None:
                    group.keep_loss(step, loss)
            return
        self._observe_loss(outputs)
        # under FSDP every rank holds a shard: the spectrum gathers the full weights for the read
        group.finish(self._host(trainer), step, after=after, full_model=trainer.strategy.model)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        """An update comes after ``global_step`` updates: the engines that compare the weights
        across it (the q/k update metrics) copy what they need where a read follows it."""
        step = trainer.global_step
        if step + 1 not in self._group.between:  # a read follows this update
            self._group.before_update(self._host(trainer), step)

    def _observe_weights(self, trainer: pl.Trainer, step: int) -> None:
        self._group.observe_weights(self._host(trainer), step, full_model=trainer.strategy.model)

    def _observe_loss(self, outputs: Any) -> None:
        """Hand the batch's training loss (``training_step``'s return: the tensor, or its
        ``"loss"``), read once, to the engines whose rules read it, at the step the batch started
        on."""
        if self._group.loss_readers and (loss := self._loss_of(outputs)) is not None:
            self._group.observe_loss(self._batch_step, loss)

    @staticmethod
    def _loss_of(outputs: Any) -> Tensor | None:
        """``training_step``'s loss: the tensor, or its ``"loss"``; None if it is not one number."""
        mapping = type(outputs) is dict or isinstance(outputs, Mapping)  # Lightning's: a dict
        loss = outputs.get("loss") if mapping else outputs
        return loss if isinstance(loss, Tensor) and loss.numel() == 1 else None

    @override
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if (
            self.probe_validation
            and batch_idx == 0
            and dataloader_idx == 0
            and not trainer.sanity_checking
        ):
            step = self._validation_step(trainer)
            self._group.open(self._host(trainer), step, validation=True)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        """Close and log the validation probe opened at this batch's start, if one is open (the
        batch itself is not read)."""
        self._group.finish_validation(self._host(trainer), self._validation_step(trainer))

    def _validation_step(self, trainer: pl.Trainer) -> int:
        """The step Lightning logs a validation's metrics (``val_loss``) at: inside a fit, the step
        of the training batch it follows (whose optimizer step has already advanced
        ``global_step``), mid-epoch (``val_check_interval``) and at an epoch's end alike; in
        ``trainer.validate``, ``global_step``."""
        if trainer.state.fn == TrainerFn.FITTING:
            return self._batch_step
        return trainer.global_step

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # a failed step or Ctrl+C (Lightning calls this for both): the window of the failed step
        # is closed unlogged, and the last completed probe is drawn, as at a normal end. The
        # user's error is Lightning's alone: the loggers are reached through the sinks made
        # already (a logger whose directory cannot be written raises again when asked for its
        # `experiment`), and what still raises here is warned, never raised on top of it
        try:
            self._end_run(trainer, completed=False)
        except Exception as err:  # noqa: BLE001 -- the fit's own error is the one to raise
            rank_zero_warn(
                f"qkmonitor: closing the monitors after the fit's error failed too "
                f"({type(err).__name__}: {err}); the fit's own error follows.",
                category=RuntimeWarning,
            )

    def _end_run(self, trainer: pl.Trainer, *, completed: bool) -> None:
        """Close a window left open (unlogged), write the scalars held, draw the last probe's
        visuals if it drew none, take out the switches and wait for the visuals to be written;
        ``completed``: the fit ended on every rank (what waits to cross the ranks is logged);
        otherwise only the sinks made already are written to."""
        host = LightningHost(trainer, self._group.scalars, made_only=not completed)
        self._group.end(host, completed=completed)
        monitors = _monitors(trainer)
        if trainer.is_global_zero and monitors[-1] is self:  # after every monitor's last write
            report_write_faults(host, host.sinks())  # how many writes were lost, once per logger

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a probed batch that never ended (e.g. skipped) is closed too
        self._end_run(trainer, completed=True)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._group.release()

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if "callbacks" in checkpoint:  # absent from a weights-only checkpoint
            checkpoint["callbacks"][self.state_key] = self._group.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._group.load_state_dict(state_dict)


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
        super().__init__(engine, probe_validation=probe_validation)


def _monitors(trainer: pl.Trainer) -> list[AttentionMonitor]:
    return [cb for cb in trainer.callbacks if isinstance(cb, AttentionMonitor)]


def _run_dir(sink: LoggerSink) -> str:
    return str(getattr(sink.logger, "log_dir", None) or id(sink.logger))
