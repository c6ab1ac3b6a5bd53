"""The framework-free monitor engine: when to probe and what to measure, for a host.

A :class:`MonitorEngine` knows its layers
(:func:`qkmonitor.attention.adapters.find_attention_layers`), decides the probe steps and computes
its metrics; what it is told comes in one :class:`~qkmonitor.engine.options.MonitorOptions`. It
hands each probe's values to its two other parts: the alert policy
(:mod:`qkmonitor.engine.alerting`: the tracker, warn / stop / raise, ``on_alert``) and the publisher
(:mod:`qkmonitor.engine.publishing`: the tags of :mod:`qkmonitor.output.tags`, scalars to the sinks
of a :class:`Host`, visuals to those that draw). The host is whatever drives the engine: the
Lightning callbacks (a thin adapter over a Trainer) or :class:`qkmonitor.engine.Monitoring` in a
plain PyTorch loop.

:class:`ActivationEngine` adds probes of the forward pass (:mod:`qkmonitor.attention.probes`):
``open`` opens one probe per layer for a probe window, ``finish`` closes them and logs, ``abort``
closes them and logs nothing. Every path closes what it opened.
"""

from __future__ import annotations

import dataclasses
import math
import traceback
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from qkmonitor.alerts import LOSS_SMOOTHING, Alert, AlertRule, AlertTracker
from qkmonitor.attention.adapters import (
    AttentionLayer,
    find_attention_layers,
    parameters_without_data,
)
from qkmonitor.attention.calls import TENSOR_PARALLEL
from qkmonitor.attention.intercept import unmeasured_attention_like
from qkmonitor.attention.probes import Probe, ProbeRequest, ProbeResult
from qkmonitor.engine.alerting import AlertPolicy, check_loss
from qkmonitor.engine.failures import MeasuresNothingError, guarded
from qkmonitor.engine.host import Host
from qkmonitor.engine.options import MonitorOptions, check_prefix
from qkmonitor.engine.publishing import (
    Histograms,
    Images,
    ValuePublisher,
    Values,
    as_rows,
)
from qkmonitor.engine.schedule import ProbeSchedule
from qkmonitor.engine.switches import CompileSwitches
from qkmonitor.measures.catalogue import MetricSpec, metric, names_of
from qkmonitor.measures.metrics import reduce_across_ranks
from qkmonitor.measures.sharding import HeadPlacement

__all__ = [
    "ActivationEngine",
    "MonitorEngine",
    "MonitorOptions",
    "Values",
    "Window",
    "check_prefix",
    "finish_windows",
]


@dataclasses.dataclass(frozen=True)
class Window:
    """A closed probe window whose measures wait for the reduction across processes: its step,
    whether it was a validation window, and what the engine carries to
    :meth:`ActivationEngine.complete`."""

    step: int
    validation: bool
    carried: Any


def finish_windows(
    host: Host, engines: Sequence[ActivationEngine], beside: Sequence[MonitorEngine] = ()
) -> None:
    """Close the open windows of ``engines`` and log them, their aggregators reduced across
    processes together: one collective for all of them under DDP
    (:func:`~qkmonitor.measures.metrics.reduce_across_ranks`). An engine alone may have its own
    :meth:`~MonitorEngine.finish` (QKClipEngine's); several must split theirs
    (:meth:`ActivationEngine.close_window`, :meth:`ActivationEngine.complete`). ``beside``: every
    engine of the driver (an engine that reads none of its layers beside others that do is turned
    off, not an error: :func:`~qkmonitor.engine.failures.guarded`)."""
    # each engine's part guarded: a metric problem is one warning naming its layers, never the
    # end of the run (engine/failures.py)
    windows = [
        (
            engine,
            guarded(host, engine, "measuring", step, partial(engine.close_window, host), beside),
        )
        for engine in engines
        for step in [engine.window_step]
    ]
    closed = [(engine, window) for engine, window in windows if window is not None]
    # the reads whose heads are split across ranks cross them in the same collective
    reads = [(engine, step, parts) for engine in beside for step, parts in engine.exchange_parts()]
    try:
        merged = reduce_across_ranks(
            [m for engine, _ in closed for m in engine.aggregators()],
            [part for _, _, parts in reads for part in parts],
        )
    except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
        for engine, window in closed:
            engine.discard()
            engine.warn_failure(host, "reducing across processes", window.step, err)
        for engine, step, _ in reads:
            engine.drop_exchanges()
            engine.warn_failure(host, "exchanging the heads across processes", step, err)
        return
    completions = []
    for engine, step, parts in reads:  # a step's weights before its activations
        mine, merged = merged[: len(parts)], merged[len(parts) :]
        completions.append((step, 0, engine, partial(engine.complete_exchange, host, step, mine)))
    for engine, window in closed:
        completions.append((window.step, 1, engine, partial(engine.complete, host, window)))
    for step, _, engine, complete in sorted(completions, key=lambda c: c[:2]):
        guarded(host, engine, "computing", step, complete)


class MonitorEngine:
    """Base of the engines: the probe schedule, binding to a model, measuring and resume state.

    Each probe's values go to :attr:`alerting` (an :class:`~qkmonitor.engine.alerting.AlertPolicy`)
    and :attr:`publishing` (a :class:`~qkmonitor.engine.publishing.ValuePublisher`) through
    :meth:`record`.

    Args:
        options: what the engine is told (see :class:`~qkmonitor.engine.options.MonitorOptions`).
        **fields: or the fields of :class:`~qkmonitor.engine.options.MonitorOptions`, by name.
    """

    #: the catalogue's name of the monitor whose metrics this engine computes
    monitor: str = ""
    default_rules: tuple[AlertRule, ...] = ()
    #: whether it measures the weights after a step's update (:meth:`observe_weights`), which a
    #: host reads at the end of the step before a probe step
    reads_weights: bool = False

    def __init__(self, *, options: MonitorOptions | None = None, **fields: Any) -> None:
        if options is None:
            options = MonitorOptions(**fields)
        elif fields or not isinstance(options, MonitorOptions):
            raise ValueError(
                "Expected `options` to be a MonitorOptions, with no other engine argument, got "
                f"{type(options).__name__} and {sorted(fields)}"
            )
        self.options = options
        #: when it probes (the interval in effect, the last probed step, the steps between)
        self.schedule = ProbeSchedule(options.every_n_steps)
        self._restored = False  # a checkpoint's state was loaded and the next bind keeps it
        self._session: Callable[[], Any] | None = (
            None  # the plain-loop Monitoring holding it (a weakref)
        )
        self._model: Callable[[], nn.Module | None] | None = None  # the bound model (a weakref)
        #: the switches under torch.compile, from a bind to its release
        self.switches = CompileSwitches()
        self.alerting = AlertPolicy(
            self.default_rules if options.alerts is None else options.alerts,
            action=options.alert_action,
            on_alert=options.on_alert,
            owner=type(self).__name__,
            monitor=self.monitor,
            metric_names=self.metric_names,
        )
        self.publishing = ValuePublisher(
            type(self).__name__,
            options.log_key_prefix,
            per_head=options.per_head,
            metric_names=self.metric_names,
            visuals_every_n_probes=options.visuals_every_n_probes,
        )
        self.layers: list[AttentionLayer] = []
        #: Indices of the layers with QK-norm (rules with ``skip_qk_norm`` leave them out).
        self.qk_norm_layers: frozenset[int] = frozenset()
        #: The last probe's values: metric -> one (num_heads,) float CPU tensor per layer.
        self.latest: Values = {}
        #: the last training probe's run values (``record(run_values=)``), by name
        self.latest_run: dict[str, float] = {}
        #: the engines beside this one in its driver (set by the driver: ``EngineGroup.bound``,
        #: the Lightning callbacks of one Trainer), whose metrics its rules may read
        self.siblings: list[MonitorEngine] = []
        #: The last validation probe's values, like :attr:`latest`.
        self.latest_validation: Values = {}
        self._warned: set[str] = set()
        #: the warnings of the run given once for every engine of a driver (a model without data):
        #: the driver's group hands its engines one set at each bind; alone, the engine's own
        self.run_warnings: set[str] = self._warned

    # -- the schedule (engine/schedule.py) ------------------------------------------------------

    @property
    def every_n_steps(self) -> int | None:
        """The probe interval in effect: the one given, or the host's default from bind on."""
        return self.schedule.every_n_steps

    @every_n_steps.setter
    def every_n_steps(self, value: int | None) -> None:
        self.schedule.every_n_steps = value

    @property
    def latest_step(self) -> int | None:
        """The step of the last training probe."""
        return self.schedule.latest_step

    @latest_step.setter
    def latest_step(self, value: int | None) -> None:
        self.schedule.latest_step = value

    @property
    def between_probes(self) -> range:
        """Steps at which a host skips all but the loss (:meth:`steps_after`)."""
        return self.schedule.between_probes

    @property
    def quiet(self) -> range:
        """Steps at which a host skips everything (:meth:`steps_after`)."""
        return self.schedule.quiet

    @property
    def prefix(self) -> str:
        """The first part of every tag (``log_key_prefix``)."""
        return self.options.log_key_prefix

    @property
    def tracker(self) -> AlertTracker:
        """The alert rules' state and counts."""
        return self.alerting.tracker

    # -- the training loss -------------------------------------------------------------------

    @property
    def reads_loss(self) -> bool:
        """Whether a rule reads the training loss (``learning_drop``); the loss is kept only
        then."""
        return self.alerting.reads_loss

    def observe_loss(self, step: int, loss: Tensor | float) -> None:
        """The training loss of the batch at ``step`` (call it at every step, before the step's
        :meth:`finish`). Kept as a detached tensor, read only when a probe's rules need it (no
        device sync on the other steps); a no-op when no rule reads the loss.

        Raises:
            ValueError: ``loss`` is not a number or a tensor of one element (at every step, kept
                or not).
        """
        if type(loss) is not Tensor or loss.numel() != 1 or not loss.is_floating_point():
            check_loss(loss)
        if self.wants_loss(step):
            self.alerting.observe_loss(step, loss)

    def wants_loss(self, step: int) -> bool:
        """Whether the loss of ``step`` can matter: a rule reads the loss and ``step`` is among the
        first :data:`~qkmonitor.alerts.LOSS_SMOOTHING` steps, within the rules' loss windows
        before a multiple of ``every_n_steps`` or at one, or in an interval whose probe is still to
        come (:meth:`~qkmonitor.engine.alerting.AlertPolicy.wants_loss`): at
        ``every_n_steps=50``, 21 steps of 50; at 10, every step."""
        return self.alerting.wants_loss(step, self.every_n_steps, self.latest_step)

    def first_loss(self) -> float | None:
        """The mean of the run's first :data:`~qkmonitor.alerts.LOSS_SMOOTHING` finite losses
        seen."""
        return self.alerting.first_loss()

    def loss_history(self) -> list[tuple[int, float]]:
        """The kept ``(step, loss)`` pairs as floats, oldest first."""
        return self.alerting.loss_history()

    # -- what the engine logs ----------------------------------------------------------------

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Every metric this engine logs, in catalogue order."""
        return names_of(self.monitor)

    @property
    def specs(self) -> tuple[MetricSpec, ...]:
        return tuple(metric(name) for name in self.metric_names)

    def thresholds(self) -> dict[str, float | int | str]:
        """The rules and the probe interval, as hyper-parameters of the run."""
        params = self.alerting.thresholds(self.prefix)
        params[f"{self.prefix}/{self.monitor}/every_n_steps"] = self.every_n_steps or 0
        return params

    def selection(self) -> str:
        """The layer selection as the constructor got it, in words that are the same in every
        process (it goes into a checkpoint's state key, read before the model is searched)."""
        return self.options.selection()

    # -- binding to a model --------------------------------------------------------------------

    def bind(self, model: nn.Module, *, default_every_n_steps: int = 50) -> None:
        """Find the layers of ``model`` and prepare what measuring needs.

        Raises:
            ValueError: if no attention layer is found, or ``layers`` names a module that is not
                in ``model`` or not supported.
        """
        if self._restored:  # resuming: the state loaded from the checkpoint goes on
            self._restored = False
        else:  # a new run (a callback reused for a second fit starts as a new one would)
            self._start_run()
        if self.every_n_steps is None:
            self.every_n_steps = max(1, int(default_every_n_steps))
        self.schedule.forget_plan()
        self.release()  # an earlier bind's switches (validate, then fit)
        self._model = weakref.ref(model)
        if self._lazy(model):  # no shapes to find layers by: nothing is measured in this run
            self.layers, self.unmeasured, self.qk_norm_layers = [], [], frozenset()
            self.switches.bind(model, lazy=True)
            return
        self.layers = find_attention_layers(model, self.options.layers)
        self.unmeasured = (
            unmeasured_attention_like(model, self.layers) if self.options.layers is None else []
        )
        self.qk_norm_layers = frozenset(i for i, layer in enumerate(self.layers) if _qk_norm(layer))
        self._prepare(model)
        self.switches.bind(model)  # switched at the first window, after every engine's discovery

    @property
    def model(self) -> nn.Module | None:
        """The model of the last :meth:`bind` (None before one, or once it is gone)."""
        return self._model() if self._model is not None else None

    # -- torch.compile (engine/switches.py) ------------------------------------------------------

    def _probed_modules(self) -> list[nn.Module]:
        """The modules this engine's probes install on (switched under compile)."""
        return []

    @property
    def switch_model_in_windows(self) -> bool:
        """Whether the bound model itself runs through a switch in each window
        (:attr:`CompileSwitches.switch_model`)."""
        return self.switches.switch_model

    @switch_model_in_windows.setter
    def switch_model_in_windows(self, value: bool) -> None:
        self.switches.switch_model = value

    def release(self) -> None:
        """Close any open probe and take out what binding put on the model (the switches under
        compile); idempotent. Called when a fit ends, on success and on failure."""
        self.abort()
        self.publishing.drain()  # every visual written before a logger closes
        self.switches.release()  # its windows were closed by abort

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_session"] = None  # a weak reference to the Monitoring holding it: not carried along
        state["_model"] = None  # nor one to the bound model
        return state

    def _start_run(self) -> None:
        """Forget what an earlier run left: alert state and counts, the latest values, the loss
        history, the warnings given, the interval taken from an earlier Trainer."""
        self.every_n_steps = self.options.every_n_steps
        self.alerting.start_run()
        self.latest, self.latest_step, self.latest_validation = {}, None, {}
        self.latest_run = {}
        shared = self.run_warnings is not self._warned  # a driver's set, renewed by the driver
        self._warned = set()
        if not shared:
            self.run_warnings = self._warned
        self.publishing.forget()

    def _prepare(self, model: nn.Module) -> None:
        """Subclasses build per-layer state once the layers are known."""

    def report_discovery(self, host: Host) -> None:
        """One line of what was found (at fit start), and a warning per attention-like module that
        is not measured."""
        if not self.layers:  # a lazy model (bind warned why)
            host.info(f"qkmonitor: {type(self).__name__} ({self.prefix}) measures nothing")
            return
        kinds = Counter(layer.kind for layer in self.layers)
        found = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        host.info(
            f"qkmonitor: {type(self).__name__} ({self.prefix}) measures {len(self.layers)} "
            f"attention layer{'s' if len(self.layers) != 1 else ''}: {found}"
        )
        for name, cls in self.unmeasured:
            self.warn_once(
                host,
                f"unmeasured:{name}",
                f"{name!r} ({cls}) looks like attention but no rule reads it, so it is not "
                "measured; describe it with "
                "qkmonitor.register_attention(qkmonitor.AttentionSpec(...)) (README, 'Use it on "
                "your model')",
            )

    def _lazy(self, model: nn.Module) -> bool:
        """Whether ``model`` holds lazy parameters not yet materialised (``nn.LazyLinear`` before
        its first forward): they have no shape, so no layer can be found by them; warned once
        (the same text from every engine: Python shows it once)."""
        lazy = [
            name
            for name, p in model.named_parameters()
            if isinstance(p, nn.parameter.UninitializedTensorMixin)
        ]
        if lazy and "lazy" not in self.run_warnings:
            self.run_warnings.add("lazy")
            more = f" and {len(lazy) - 1} more" if len(lazy) > 1 else ""
            warnings.warn(  # one place and one text for every engine: shown once
                f"qkmonitor: the model's lazy parameters are not materialised yet ({lazy[0]!r}"
                f"{more}), so its attention layers cannot be found and nothing is measured in "
                "this run; run one forward (an example batch) before the fit or the loop to "
                "materialise them; training goes on.",
                RuntimeWarning,
                stacklevel=1,
            )
        return bool(lazy)

    def without_data(self) -> bool:
        """Whether a measured layer's parameters hold no data (a model on the meta device, or a
        lazy one not yet materialised): then nothing is measured — probes opened on such a model
        would fail on its first read — and training goes on, with one warning a run (the same
        text from every engine: Python shows it once). Asked at probe steps only."""
        names = [
            f"{layer.name}.{name}" if layer.name else name
            for layer in self.layers
            for name in parameters_without_data(layer.module)
        ]
        if not names:
            return False
        if "no data" not in self.run_warnings:  # one warning a run for every engine of a driver
            self.run_warnings.add("no data")
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            warnings.warn(  # one place and one text for every engine: shown once
                f"qkmonitor: the attention layers' parameters hold no data ({names[0]!r}{more}: "
                "on the meta device, or lazy and not yet materialised), so nothing is measured "
                "until they do (e.g. `model.to_empty(device=...)` and an initialisation, or a "
                "first forward of a lazy module); training goes on.",
                RuntimeWarning,
                stacklevel=1,
            )
        return True

    def is_probe_step(self, step: int) -> bool:
        """Whether ``step`` is probed (:meth:`ProbeSchedule.is_probe_step`)."""
        return self.schedule.is_probe_step(step)

    def plan(self, step: int) -> None:
        """After the work of the batch at ``step``: once :attr:`between_probes` lies behind, the
        steps ahead where a host may skip work (:meth:`steps_after`). A host calls it at the end
        of every batch whose work it did not skip."""
        schedule = self.schedule
        if step >= schedule.between_probes.stop:
            schedule.between_probes, schedule.quiet = self.steps_after(step)

    def steps_after(self, step: int) -> tuple[range, range]:
        """The steps after ``step`` where a host may skip work, as ``(between_probes, quiet)``
        (:meth:`ProbeSchedule.steps_after`, with this engine's window and its rules' loss
        lead)."""
        return self.schedule.steps_after(
            step,
            probing=self.probing,
            loss_lead=self.alerting.loss_lead,
            loss_smoothing=LOSS_SMOOTHING,
        )

    def draws_visuals(self, step: int) -> bool:
        """Whether the probe at ``step`` draws the visuals: every ``visuals_every_n_probes``-th
        probe, counting the one at step 0."""
        return self.schedule.draws_visuals(step, self.options.visuals_every_n_probes)

    # -- the probe window (weights engines ignore it) -------------------------------------------

    @property
    def probing(self) -> bool:
        """Whether :meth:`finish` may have work (a window is open); hosts skip it when False. True
        here, so that an engine that does not say is always finished."""
        return True

    def observe_weights(self, host: Host, step: int, **kwargs: Any) -> None:
        """Measure the weights as they are after ``step`` optimizer steps, if that is a probe
        step."""

    def before_update(self, host: Host, step: int) -> None:
        """An optimizer is about to apply the update after ``step`` updates (engines that compare
        the weights across it take their copy here)."""

    def open(self, step: int, *, validation: bool = False) -> bool:
        """Open the probes of a probe window; True if any were opened."""
        return False

    def finish(self, host: Host) -> None:
        """Close the open probes and log what they measured."""

    def exchange_parts(self) -> list[tuple[int, list]]:
        """Values that wait to cross the ranks before they are logged, ``(step, parts)`` each
        (:func:`~qkmonitor.measures.sharding.gather_heads`' parts): the weights' values of heads
        split across ranks (:meth:`QKSpectrum.exchange_parts`); none by default."""
        return []

    def complete_exchange(self, host: Host, step: int, merged: list) -> None:
        """Log the values of ``step`` that waited for the exchange, every rank's merged in."""

    def drop_exchanges(self) -> None:
        """Forget the values waiting for the exchange (the ranks may not meet again)."""

    def close_window(self, host: Host) -> Window | None:
        """Close the open window and hold what it measured until the aggregators of every engine
        closed with it are reduced across processes (:func:`finish_windows`), then
        :meth:`~ActivationEngine.complete`; an engine without aggregators finishes here and
        returns None."""
        self.finish(host)
        return None

    def abort(self) -> None:
        """Close the open probes without logging (a failed step, teardown)."""

    # -- logging ---------------------------------------------------------------------------------

    def record(
        self,
        host: Host,
        values: Values,
        step: int,
        *,
        validation: bool = False,
        undefined: dict[str, list[Tensor]] | None = None,
        images: Images | None = None,
        histograms: Histograms | None = None,
        run_values: dict[str, float] | None = None,
    ) -> list[Alert]:
        """Log one probe's values at ``step``, fire and act on alerts (not for validation).

        Args:
            values: metric -> one tensor per layer.
            validation: log under ``{prefix}/val``; no alerts.
            undefined: metric -> per-layer bool tensors, True where a NaN is NaN by definition.
            images, histograms: extra visuals of this probe, by tag (an image may be a function
                that draws it; the histograms a function that makes them). Visuals are drawn and
                written on the publisher's thread (:mod:`qkmonitor.output.publisher`); ``release``
                waits for them. A probe that draws none keeps them for :meth:`draw_final`.
            run_values: values of the run rather than of a head (the output logits'), logged
                under ``{prefix}/run/{name}`` and read by the rules as run signals (training
                probes only).

        Returns:
            The alerts that fired.
        """
        rows = as_rows(values)  # every tensor read once; the rest is in Python
        names = [layer.name for layer in self.layers]
        self.alerting.warn_nonfinite(host, rows, as_rows(undefined or {}), step, names)
        alerts: list[Alert] = []
        if validation:
            self.latest_validation = values
        else:
            self.latest, self.latest_step = values, step
            self.latest_run = dict(run_values or {})
            for name, value in self.latest_run.items():
                if not math.isfinite(value):
                    self.warn_once(
                        host,
                        f"run:{name}",
                        f"{name} is {value} at step {step} (the model's output logits are not "
                        "finite); it is logged as it is and fires no alert. Warned once.",
                    )
            evidence, signals = self._evidence(host, rows, step)
            alerts = self.alerting.update(
                rows, step, names, self.qk_norm_layers, evidence, {**signals, **self.latest_run}
            )
            alerts = [a.with_layer_kind(self.layers[a.layer].kind) for a in alerts]  # the advice
        self.publishing.publish(
            host,
            values,
            rows,
            step,
            validation=validation,
            draw=self.draws_visuals(step),
            alert_counts={} if validation else self.alerting.counts(),
            images=images or {},
            histograms=histograms or {},
            run_values={} if validation else self.latest_run,
        )
        for alert in alerts:
            self.alerting.act(host, alert, self.publishing.write_alert)
        return alerts

    def _evidence(
        self, host: Host, rows: dict[str, list[list[float]]], step: int
    ) -> tuple[dict[str, list[list[float]]], dict[str, float]]:
        """What this engine's rules read from the engines beside it (:attr:`siblings`) at
        ``step``: the metrics of other monitors (``AlertPolicy.borrowed``), laid out as ``rows``
        (a layer they do not measure, or whose heads differ, is NaN), and their measured run
        signals. A metric no engine beside it logs is left out, and its rules skipped, with one
        warning."""
        signals = {
            name: value
            for e in self.siblings
            if e.latest_step == step
            for name, value in e.latest_run.items()
            if name in self.alerting.signals
        }
        borrowed = self.alerting.borrowed
        if not borrowed or not rows:
            return {}, signals
        heads = [len(h) for h in next(iter(rows.values()))]
        out: dict[str, list[list[float]]] = {}
        for name, monitor in borrowed.items():
            source = next((e for e in self.siblings if name in e.metric_names), None)
            if source is None:
                self._evidence_missing(host, name, monitor)
                continue
            latest = source.latest if source.latest_step == step else {}
            index = {layer.name: i for i, layer in enumerate(source.layers)}
            grid = []
            for layer, count in zip(self.layers, heads):
                j = index.get(layer.name)
                values = latest[name][j].tolist() if name in latest and j is not None else []
                grid.append(values if len(values) == count else [math.nan] * count)
            out[name] = grid
        return out, signals

    def _evidence_missing(self, host: Host, name: str, monitor: str) -> None:
        """Say once that the rules reading ``name`` are skipped: a warning if the user chose one of
        them, a line if they are all defaults (running one monitor alone is a choice, not a
        fault)."""
        readers = [rule for rule in self.alerting.tracker.rules if name in rule.metrics]
        text = (
            f"{', '.join(rule.name for rule in readers)} read(s) {name}, which {monitor} logs, but "
            f"no {monitor} runs beside this monitor (QKMonitor runs the three together; or give "
            "both engines to one Monitoring): the rules that read it are skipped"
        )
        if all(rule in self.default_rules for rule in readers):
            if f"evidence:{name}" not in self._warned:
                self._warned.add(f"evidence:{name}")
                host.info(f"qkmonitor: {type(self).__name__} ({self.prefix}): {text}")
            return
        self.warn_once(host, f"evidence:{name}", text)

    def draw_final(self, host: Host) -> None:
        """At a run's end: draw the visuals of its last probe if that probe was not one of every
        ``visuals_every_n_probes``-th (the pictures always show the final state)."""
        self.publishing.draw_final(host)

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

    # -- metric problems (engine/failures.py) ---------------------------------------------------

    @property
    def window_step(self) -> int | None:
        """The step of the open probe window (None when none is open)."""
        return None

    def discard(self) -> None:
        """Drop what a failed stage left: the open window (unlogged) and the aggregators' sums."""
        self.abort()

    def warn_failure(
        self, host: Host, stage: str, step: int | None, err: BaseException, layers=None
    ) -> None:
        """One warning per stage and layer set: ``stage`` raised ``err`` at ``step``; the layers
        (all of the engine's by default) get nothing at that step, training goes on."""
        names = [layer.name for layer in self.layers] if layers is None else list(layers)
        where = f" at step {step}" if step is not None else ""
        frame = traceback.extract_tb(err.__traceback__)[-1:] if err.__traceback__ else []
        origin = f", in {frame[0].name} ({frame[0].filename}:{frame[0].lineno})" if frame else ""
        self.warn_once(
            host,
            f"failure:{stage}:{','.join(names)}",
            f"{stage} failed{where} for layer(s) {names} ({type(err).__name__}: {err}{origin}); "
            "nothing of theirs is logged for that step and training goes on. This warning is "
            "shown once (a metric problem, please report it).",
            shared=True,
        )

    def warn_undefined(self, host: Host, step: int, name: str, layers: list[int]) -> None:
        """Say once a run that ``name`` is NaN by definition for the data seen (never a silent
        NaN): the layers, and the catalogue's reason."""
        names = [self.layers[i].name for i in layers]
        self.warn_once(
            host,
            f"undefined:{name}",
            f"{name} is undefined at step {step} for layer(s) {names}: {metric(name).undefined}. "
            "It is logged as NaN and fires no alert. This warning is shown once.",
        )

    def measure_nothing(self, host: Host, reason: str) -> None:
        """Turn this engine off for the run, with one warning saying why (a monitor beside others
        that measure something: :class:`~qkmonitor.engine.failures.MeasuresNothingError`)."""
        self.discard()
        self.layers, self.unmeasured, self.qk_norm_layers = [], [], frozenset()
        self.warn_once(
            host,
            "measures nothing",
            f"{reason} This monitor measures nothing in this run; the others go on.",
        )

    # -- resume ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"latest_step": self.latest_step, **self.alerting.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored = True
        self.latest_step = state.get("latest_step")
        self.schedule.forget_plan()
        self.alerting.load_state_dict(state)


class ActivationEngine(MonitorEngine):
    """An engine that measures the forward pass through probes (:mod:`qkmonitor.attention.probes`).

    Subclasses say what they want (:meth:`_request`), may install more for the window
    (:meth:`_open_extra` / :meth:`_close_extra`, e.g. block hooks) and turn the probes' results
    into values (:meth:`_measure`).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._probes: list[Probe] = []
        self._window: tuple[int, bool] | None = None
        self._measurable: list[bool] = []
        #: metric -> the layers where the window's data left it undefined by definition (a
        #: one-token sequence), set by :meth:`_values` and said once a run in :meth:`complete`
        self._undefined_now: dict[str, list[int]] = {}

    @property
    def probing(self) -> bool:
        """Whether a probe window is open."""
        return self._window is not None

    def _prepare(self, model: nn.Module) -> None:
        self._measurable = [layer.supports_stats for layer in self.layers]
        self._first_window = True  # a first window that reads no layer is an error, later ones not
        unsupported = [layer.name for layer, ok in zip(self.layers, self._measurable) if not ok]
        if len(unsupported) == len(self.layers):
            raise MeasuresNothingError(
                f"{type(self).__name__}: layers {unsupported} give no attention statistics; "
                "describe them with qkmonitor.AttentionSpec (statistics come from their SDPA or "
                "softmax call), or pass `layers=` with qkmonitor.AttentionLayer subclasses that "
                "define `supports_stats` and `install(probe)`"
            )
        if unsupported:  # the adapters said why; the others are measured, these stay NaN
            warnings.warn(
                f"{type(self).__name__}: layers {unsupported} give no attention statistics here; "
                "their activation metrics are logged as NaN.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _request(self) -> ProbeRequest:
        return ProbeRequest()

    def _probed_modules(self) -> list[nn.Module]:
        return [
            layer.module for layer, measurable in zip(self.layers, self._measurable) if measurable
        ]

    def open(self, step: int, *, validation: bool = False) -> bool:
        if (
            self._window is not None
            or not self.layers
            or (not validation and not self.is_probe_step(step))
            or self.without_data()
        ):
            return False
        self.switches.before_window(self._probed_modules)
        self._window = (step, validation)
        try:
            request = self._request()
            for layer, measurable in zip(self.layers, self._measurable):
                self._probes.append(
                    layer.open_probe(request) if measurable else Probe(layer.name, request)
                )
            self._open_extra()
            self.switches.open_window()
        except BaseException:
            self.abort()
            raise
        return True

    def _open_extra(self) -> None:
        """Install what the window needs beyond the layer probes."""

    def _close_extra(self) -> None:
        """Remove what :meth:`_open_extra` installed; idempotent."""

    def close_probes(self) -> list[ProbeResult]:
        """Close every open probe (each one, even if another fails) and return their results."""
        probes, self._probes, self._window = self._probes, [], None
        self.switches.close_window()
        results, error = [], None
        for probe in probes:
            try:
                results.append(probe.close())
            except Exception as err:  # noqa: BLE001 -- close the rest first
                error = error or err
        try:
            self._close_extra()
        finally:
            if error is not None:
                raise error
        return results

    def abort(self) -> None:
        self.close_probes()

    @property
    def window_step(self) -> int | None:
        return None if self._window is None else self._window[0]

    def discard(self) -> None:
        try:
            self.close_probes()
        finally:
            for aggregator in self.aggregators():
                aggregator.reset()

    def finish(self, host: Host) -> None:
        window = self.close_window(host)
        if window is not None:
            reduce_across_ranks(self.aggregators())
            self.complete(host, window)

    def close_window(self, host: Host) -> Window | None:
        """The first half of :meth:`finish`: close the open probes and add what they measured to
        this process's aggregators (no collective); None when no window is open."""
        if self._window is None:
            return None
        step, validation = self._window
        results = [refuse_split_heads(lay, r) for lay, r in zip(self.layers, self.close_probes())]
        self._report_missing(host, results)
        with torch.no_grad():
            carried = self._accumulate(
                results, step, visuals=not validation and self.draws_visuals(step)
            )
        return Window(step, validation, carried)

    def aggregators(self) -> list[Metric]:
        """The torchmetrics states a window adds to, reduced across processes before
        :meth:`complete` (:func:`~qkmonitor.measures.metrics.reduce_across_ranks`)."""
        return []

    def complete(self, host: Host, window: Window) -> None:
        """The second half of :meth:`finish`, once the aggregators hold every process's share:
        the values, recorded (alerts, tags) at the window's step."""
        with torch.no_grad():
            values, extra = self._values(window.carried)
        notes, self._undefined_now = self._undefined_now, {}
        for name, layers in notes.items():
            self.warn_undefined(host, window.step, name, layers)
        self.record(host, values, window.step, validation=window.validation, **extra)

    def _accumulate(self, results: list[ProbeResult], step: int, *, visuals: bool) -> Any:
        """Add the closed probes' results to the aggregators; what :meth:`_values` needs after the
        reduction. By default the whole :meth:`_measure` (engines without aggregators)."""
        return self._measure(results, step, visuals=visuals)

    def _values(self, carried: Any) -> tuple[Values, dict[str, Any]]:
        """The values and extra ``record`` arguments, from the reduced aggregators and what
        :meth:`_accumulate` carried."""
        return carried

    def _report_missing(self, host: Host, results: list[ProbeResult]) -> None:
        measured = [t for r in results for t in [*(s.entropy for s in r.stats), *r.probs]]
        if measured and all(t.numel() == 0 for t in measured):
            self.warn_once(
                host,
                "empty",
                "a probed batch held no token (an empty batch): nothing was measured and "
                "its values are NaN. This warning is shown once.",
            )
        unread = [
            (layer, result.unread[0])
            for layer, result, measurable in zip(self.layers, results, self._measurable)
            if measurable and result.calls == 0 and result.unread
        ]
        read_any = any(r.calls for r, measurable in zip(results, self._measurable) if measurable)
        first, self._first_window = self._first_window, False
        if first and unread and not read_any:
            names = "; ".join(f"{layer.name!r}: {why}" for layer, why in unread[:3])
            more = f" (and {len(unread) - 3} more)" if len(unread) > 3 else ""
            raise MeasuresNothingError(
                f"{type(self).__name__} measures none of its {len(self.layers)} attention layers: "
                f"they ran in the first probed forward, but no attention call could be read "
                f"({names}{more}). Where a call could not be read, describe the attention "
                "with qkmonitor.register_attention (README, 'Use it on your model'); where it "
                "is refused (heads mixed before the softmax, a softmax over channels), it is "
                "not one head's attention over tokens: leave this monitor out."
            )
        for layer, result, measurable in zip(self.layers, results, self._measurable):
            if result.calls == 0 and measurable and result.sharded:  # tensor parallelism
                self.warn_once(
                    host,
                    f"sharded:{layer.name}",
                    f"layer {layer.name!r}: {result.sharded[0]}; its values are NaN. This "
                    "warning is shown once per layer.",
                    logging_rank_only=True,
                )
            elif result.calls == 0 and measurable and result.unread:
                self.warn_once(
                    host,
                    f"unread:{layer.name}",
                    f"layer {layer.name!r} ran in the probed forward, but none of its attention "
                    f"calls could be read ({result.unread[0]}); its values are NaN. This warning "
                    "is shown once per layer.",
                )
            elif result.calls == 0 and measurable:
                self.warn_once(
                    host,
                    f"missing:{layer.name}",
                    f"layer {layer.name!r} did not run in the probed forward; its values are NaN. "
                    "This warning is shown once per layer.",
                )
            for reason in result.failures[:1]:
                self.warn_once(
                    host,
                    f"failed:{layer.name}",
                    f"no statistics for layer {layer.name!r} in {len(result.failures)} call(s) "
                    f"({reason}); they are left out. This warning is shown once per layer.",
                    shared=True,
                )

    def _measure(
        self, results: list[ProbeResult], step: int, *, visuals: bool
    ) -> tuple[Values, dict[str, Any]]:
        """Values from the closed probes' results (one per layer, of the window at ``step``), plus
        extra ``record`` arguments; images only where ``visuals``."""
        raise NotImplementedError


def observed_heads(layer: AttentionLayer, result: ProbeResult, count: int) -> int:
    """A layer's query heads as its probe saw them: all ranks' where its calls are this rank's part
    (tensor parallelism), those of its calls where the layer did not know them before (read by
    interception), else ``count``."""
    if result.placement is not None:
        return result.placement.total
    return result.stats[0].entropy.shape[1] if result.stats and not layer.layout_ready else count


def refuse_split_heads(layer: AttentionLayer, result: ProbeResult) -> ProbeResult:
    """``result``, or a refusal where the layer's calls hold a part of the query heads its
    weights give (a divisor of H) and do not say which: its heads split across ranks (tensor
    parallelism) by a family that gives no placement of them, so no per-head value of this rank's
    calls is the layer's. A refused result is NaN, with one warning naming the layer on the
    logging rank (:meth:`ActivationEngine._report_missing`)."""
    if result.placement is not None or not result.calls or not layer.layout_ready:
        return result
    measured = (*(s.entropy for s in result.stats), *result.probs, *result.max_logits)
    seen = {t.shape[1] for t in measured if t.dim() > 1}
    try:
        heads = layer.num_heads_hint
    except Exception:  # noqa: BLE001 -- the weights' own read warns
        return result
    if not seen or not all(0 < s < heads and heads % s == 0 for s in seen):
        return result
    reason = (
        f"its attention calls hold {min(seen)} of the {heads} query heads its weights give: "
        f"its heads are split across ranks ({TENSOR_PARALLEL}), and {layer.kind} does not "
        "say which of them this rank holds; its attention statistics are not measured"
    )
    return ProbeResult(sharded=[reason])


def placed(slots: slice, placement: HeadPlacement | None) -> slice:
    """The slots of a layer's heads (``slots``, all of them) that this rank's calls fill: where
    they are this rank's part (tensor parallelism), those of its heads; the other ranks' stay
    at the aggregator's neutral value (0, or -inf for a maximum), so the sum across ranks is
    exact."""
    if placement is None:
        return slots
    return slice(slots.start + placement.offset, slots.start + placement.offset + placement.count)


def _process_rank() -> int:
    """This process's rank in torch.distributed's default group; 0 where none is initialised (a
    plain loop's host says it logs on every rank)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _qk_norm(layer: AttentionLayer) -> bool:
    """Whether ``layer`` has QK-norm; False where reading its weights raises (their read warns)."""
    try:
        return layer.has_qk_norm
    except Exception:  # noqa: BLE001 -- a metric problem must never stop training
        return False
