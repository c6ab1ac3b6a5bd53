"""An engine's output path: a probe's values go one way, measure -> alert -> publish -> sinks.

:class:`ProbeRecorder`, the base of :class:`~qkmonitor.engine.base.MonitorEngine`, takes a
probe's tensors (:meth:`~ProbeRecorder.record`), copies everything the host will read of them in
one copy a device (:mod:`qkmonitor.engine.reading`), at once or, deferred, at the end of the next
batch (:meth:`~ProbeRecorder.settle`), and then, in this order, entering each module once: says
which layers are undefined for the data seen; hands the values to the rules
(:meth:`~qkmonitor.engine.alerting.AlertPolicy.judge`, which names the non-finite heads and
returns a :class:`~qkmonitor.engine.alerting.Verdict`); hands the values and the verdict's counts
and texts to the publisher (:meth:`~qkmonitor.engine.publishing.ValuePublisher.publish`, which
writes to the host's sinks); and carries out the verdict's action through the host (warn,
``on_alert``, stop, raise). Neither the policy nor the publisher calls the other, or back into the
engine.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torch import Tensor

from qkmonitor.alerts import Alert
from qkmonitor.engine.alerting import AlertPolicy, Beside, Verdict
from qkmonitor.engine.host import Host
from qkmonitor.engine.publishing import Histograms, Images, ValuePublisher, Values
from qkmonitor.engine.reading import AtProbe, ProbeReading, defers, start_reading
from qkmonitor.engine.schedule import ProbeSchedule
from qkmonitor.measures.catalogue import MetricSpec, metric

if TYPE_CHECKING:
    from qkmonitor.attention.adapters import AttentionLayer
    from qkmonitor.engine.options import MonitorOptions

__all__ = ["ProbeRecorder"]


class ProbeRecorder:
    """The output path of an engine (see the module's docstring). The engine sets the attributes
    below; the methods here are the only ones that read a probe's values into Python."""

    options: MonitorOptions
    specs: tuple[MetricSpec, ...]  # the metrics it logs (MonitorEngine.specs)
    schedule: ProbeSchedule
    alerting: AlertPolicy
    publishing: ValuePublisher
    layers: list[AttentionLayer]
    qk_norm_layers: frozenset[int]
    siblings: list[Any]  # the engines beside this one (MonitorEngine)
    latest: Values
    latest_at: int | None
    latest_run: dict[str, float]
    latest_validation: Values
    run_warnings: set[str]
    _warned: set[str]
    _readings: list[tuple[Host, ProbeReading]]

    def record(
        self,
        host: Host,
        values: Values,
        step: int,
        *,
        validation: bool = False,
        undefined: dict[str, list[Tensor]] | None = None,
        notes: dict[str, list[Tensor]] | None = None,
        images: Images | None = None,
        histograms: Histograms | None = None,
        run_values: dict[str, Tensor | float] | None = None,
        losses_up_to: int | None = None,
        defer: bool | None = None,
    ) -> list[Alert]:
        """Log one probe's values at ``step``, fire and act on alerts (not for validation).

        Everything the host reads of the probe (the values, ``undefined``, ``notes``,
        ``run_values`` and the losses its rules read) crosses in one copy a device
        (:func:`~qkmonitor.engine.reading.start_reading`). A training probe whose copy is
        deferred (``defer``, else the ``defer_reads`` option) is logged at :meth:`settle`, at
        the end of the next batch: then its alerts come a step later and name their probe step.

        Args:
            values: metric -> one tensor per layer (on any device).
            validation: log under ``{prefix}/val``; no alerts.
            undefined: metric -> per-layer bool tensors, True where a NaN is NaN by definition.
            notes: metric -> per-layer bool tensors; a layer with any True is said once a run
                to be undefined for the data seen (:meth:`warn_undefined`).
            images, histograms: extra visuals of this probe, by tag (an image may be a function
                that draws it; the histograms a function that makes them), drawn on the
                publisher's thread (:meth:`~qkmonitor.engine.publishing.ValuePublisher.publish`).
            run_values: values of the run rather than of a head (the output logits'), logged
                under ``{prefix}/run/{name}`` and read by the rules (training probes only).
            losses_up_to: the last step whose training loss the rules read (default ``step``:
                a read of the weights after ``step`` updates comes before that step's loss).
            defer: log at :meth:`settle` rather than now (``None``: the ``defer_reads`` option).

        Returns:
            The alerts that fired (none yet where the probe's logging is deferred).
        """
        reading = start_reading(
            step,
            values,
            validation=validation,
            undefined=undefined,
            notes=notes,
            run_values=run_values,
            losses_up_to=losses_up_to,
            losses=[]
            if validation
            else self.alerting.losses.unread(step if losses_up_to is None else losses_up_to),
            images=images,
            histograms=histograms,
        )
        if not validation and defers(self.options.defer_reads if defer is None else defer, reading):
            self.schedule.latest_step = step
            self._readings.append((AtProbe(host, host.learning_rate()), reading))
            return []
        return self._log_probe(host, reading)

    def settle(self, host: Host | None = None) -> None:
        """Log the probes whose reading was deferred, in order (waiting for a copy still on its
        way): at the end of the batch after the probe, at a run's end (success or failure) and
        before a checkpoint takes the engine's state."""
        readings, self._readings = self._readings, []
        for then, reading in readings:  # (the host now, with the learning rate of then)
            self._log_probe(then if host is None else AtProbe(host, then.learning_rate()), reading)

    def _log_probe(self, host: Host, reading: ProbeReading) -> list[Alert]:
        """Log a probe, one way: read it (:meth:`ProbeReading.read`), say its undefined layers
        and run values that are not finite, judge it (:meth:`AlertPolicy.judge`: its non-finite
        heads named, its alerts fired), publish it (:meth:`ValuePublisher.publish`: scalars,
        alert counts and texts, visuals, to the host's sinks), then act on its alerts
        (:meth:`_act`). Each of alerting and publishing is entered once, and neither calls the
        other or back into the engine."""
        read, step, validation = reading.read(), reading.step, reading.validation
        names = [layer.name for layer in self.layers]
        for name, layers in read.noted.items():
            if layers:
                self.warn_undefined(host, step, name, layers)
        if validation:
            self.latest_validation = read.values
        else:
            self.latest, self.latest_at, self.schedule.latest_step = read.values, step, step
            self._keep_run_values(host, step, read.run_values)
        verdict = self.alerting.judge(
            host,
            read.rows,
            read.undefined,
            step,
            names,
            losses=list(zip(reading.loss_steps, read.losses)),
            validation=validation,
            qk_norm_layers=self.qk_norm_layers,
            beside=[] if validation else self._beside(step),
            run_values=self.latest_run,
            losses_up_to=reading.losses_up_to,
            layer_kinds=[layer.kind for layer in self.layers],
        )
        self.publishing.publish(
            host,
            read.values,
            read.rows,
            step,
            validation=validation,
            draw=self.schedule.draws_visuals(step),
            alert_counts=verdict.counts,
            images=reading.images,
            histograms=reading.histograms,
            run_values={} if validation else self.latest_run,
            alert_texts=verdict.texts,
        )
        self._act(host, verdict)
        return list(verdict.alerts)

    @staticmethod
    def _act(host: Host, verdict: Verdict) -> None:
        """Carry out each alert of ``verdict`` through the host, its text already written: raise
        (``"raise"``), or warn, call ``on_alert`` and ask the loop to stop (``"stop"``)."""
        for alert, message in zip(verdict.alerts, verdict.messages):
            if verdict.action == "raise":
                raise alert.rule.warning(message)
            host.warn(message, alert.rule.warning)
            if verdict.on_alert is not None:
                verdict.on_alert(host.owner, alert)
            if verdict.action == "stop":
                host.stop()

    def warn_undefined(self, host: Host, step: int, name: str, layers: list[int]) -> None:
        """Say once a run that ``name`` is NaN by definition for the data seen (never a silent
        NaN): the layers, and the catalogue's reason."""
        names = [self.layers[i].name for i in layers]
        spec = next((s for s in self.specs if s.name == name), None) or metric(name)
        self.warn_once(
            host,
            f"undefined:{name}",
            f"{name} is undefined at step {step} for layer(s) {names}: {spec.undefined}. "
            "It is logged as NaN and fires no alert. This warning is shown once.",
        )

    def _keep_run_values(self, host: Host, step: int, run_values: dict[str, float]) -> None:
        """Keep a training probe's run values (:attr:`latest_run`); one that is not finite is
        warned about once a run."""
        self.latest_run = dict(run_values)
        for name, value in self.latest_run.items():
            if not math.isfinite(value):
                self.warn_once(
                    host,
                    f"run:{name}",
                    f"{name} is {value} at step {step} (the model's output logits are not "
                    "finite); it is logged as it is and fires no alert. Warned once.",
                )

    def _beside(self, step: int) -> list[Beside]:
        """What the engines beside this one measured at ``step``, for the rules that read it
        (:meth:`~qkmonitor.engine.alerting.AlertPolicy.evidence`): an engine whose last probe was
        at another step gives its names alone."""
        return [
            Beside(
                e.metric_names,
                [layer.name for layer in e.layers],
                e.latest if now else {},
                e.latest_run if now else {},
            )
            for e in self.siblings
            for now in [e.latest_at == step]
        ]

    def warn_once(
        self,
        host: Host,
        key: str,
        message: str,
        *,
        shared: bool = False,
        logging_rank_only: bool = False,
    ) -> None:
        """Warn once per ``key`` per run (a new fit warns again); ``shared``: once for every engine
        of the driver (:attr:`run_warnings`: a failure two engines meet on one layer);
        ``logging_rank_only``: on the logging rank alone (what every rank meets alike, as a
        layer refused under tensor parallelism)."""
        given = self.run_warnings if shared else self._warned
        if key not in given:
            given.add(key)
            if not logging_rank_only or (host.is_logging_rank and _process_rank() == 0):
                host.warn(f"{type(self).__name__}: {message}", RuntimeWarning)


def _process_rank() -> int:
    """This process's rank in torch.distributed's default group; 0 where none is initialised (a
    plain loop's host says it logs on every rank)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
