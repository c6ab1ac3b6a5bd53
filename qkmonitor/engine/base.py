"""The framework-free monitor engine: when to probe and what to measure, for a host.

A :class:`MonitorEngine` knows its layers
(:func:`qkmonitor.attention.adapters.find_attention_layers`) and computes its metrics; what it is
told comes in one :class:`~qkmonitor.engine.options.MonitorOptions`. Its parts are attributes a
host calls directly: :attr:`~MonitorEngine.schedule` (:mod:`qkmonitor.engine.schedule`: the
interval, the last probed step, the steps between probes), :attr:`~MonitorEngine.alerting`
(:mod:`qkmonitor.engine.alerting`: the tracker, the loss history, warn / stop / raise,
``on_alert``) and :attr:`~MonitorEngine.publishing` (:mod:`qkmonitor.engine.publishing`: the tags of
:mod:`qkmonitor.output.tags`, scalars to the sinks of a :class:`Host`, visuals to those that draw).
:meth:`~MonitorEngine.record` hands each probe's values to the last two. The host is whatever
drives the engine: the Lightning callbacks (a thin adapter over a Trainer) or
:class:`qkmonitor.engine.Monitoring` in a plain PyTorch loop. What it says of the layers it found
is :mod:`qkmonitor.engine.discovery`'s; the engines of the forward pass are
:mod:`qkmonitor.engine.activation`'s.
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from qkmonitor.alerts import LOSS_SMOOTHING, AlertRule
from qkmonitor.attention.adapters import AttentionLayer, find_attention_layers
from qkmonitor.attention.intercept import unmeasured_attention_like
from qkmonitor.engine import discovery
from qkmonitor.engine.alerting import AlertPolicy
from qkmonitor.engine.host import Host
from qkmonitor.engine.losses import check_loss
from qkmonitor.engine.options import MonitorOptions, check_prefix
from qkmonitor.engine.publishing import ValuePublisher, Values
from qkmonitor.engine.reading import ProbeReading
from qkmonitor.engine.recording import ProbeRecorder
from qkmonitor.engine.schedule import ProbeSchedule
from qkmonitor.engine.switches import CompileSwitches
from qkmonitor.measures.catalogue import MetricSpec, metric, names_of

__all__ = ["MonitorEngine", "MonitorOptions", "Values", "check_prefix"]


class MonitorEngine(ProbeRecorder):
    """Base of the engines: binding to a model, measuring and resume state.

    When it probes is :attr:`schedule` (a :class:`~qkmonitor.engine.schedule.ProbeSchedule`); each
    probe's values go to :attr:`alerting` (an :class:`~qkmonitor.engine.alerting.AlertPolicy`) and
    :attr:`publishing` (a :class:`~qkmonitor.engine.publishing.ValuePublisher`) through
    :meth:`record`. A host calls the three directly.

    Args:
        options: what the engine is told (see :class:`~qkmonitor.engine.options.MonitorOptions`).
        **fields: or the fields of :class:`~qkmonitor.engine.options.MonitorOptions`, by name.
    """

    #: the catalogue's name of the monitor whose metrics this engine computes
    monitor: str = ""
    default_rules: tuple[AlertRule, ...] = ()
    #: whether it measures the weights after a step's update; such an engine
    #: (:class:`~qkmonitor.engine.QKSpectrum`) also answers ``observe_weights(host, step,
    #: **kwargs)`` (the read, at the end of the step before a probe step), ``before_update(host,
    #: step)`` (before the update a read follows) and ``exchange_parts()``,
    #: ``complete_exchange(host, step, merged)``, ``drop_exchanges()`` (its values of heads split
    #: across ranks, :func:`~qkmonitor.engine.activation.finish_windows`): a driver asks them of
    #: these engines alone
    reads_weights: bool = False
    #: the metrics this engine logs that the catalogue does not hold, by name: the specs of a
    #: user's :class:`~qkmonitor.engine.head_metrics.HeadMetric` (set before ``__init__`` runs)
    own_specs: dict[str, MetricSpec] = {}  # noqa: RUF012 -- replaced, never mutated

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
        self.schedule = ProbeSchedule(options.every_n_steps, options.visuals_every_n_probes)
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
            specs=self.specs,
            defaults=self.default_rules,
            prefix=options.log_key_prefix,
        )
        self.publishing = ValuePublisher(
            type(self).__name__,
            options.log_key_prefix,
            per_head=options.per_head,
            specs=self.specs,
            visuals_every_n_probes=options.visuals_every_n_probes,
        )
        self.layers: list[AttentionLayer] = []
        #: Indices of the layers with QK-norm (rules with ``skip_qk_norm`` leave them out).
        self.qk_norm_layers: frozenset[int] = frozenset()
        #: The last probe's values: metric -> one (num_heads,) float CPU tensor per layer, and
        #: the step they were measured at.
        self.latest: Values = {}
        self.latest_at: int | None = None
        #: the probes whose values are on their way to the host (:meth:`record`, :meth:`settle`)
        self._readings: list[tuple[Host, ProbeReading]] = []
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

    @property
    def prefix(self) -> str:
        """The first part of every tag (``log_key_prefix``)."""
        return self.options.log_key_prefix

    # -- the training loss -------------------------------------------------------------------

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
        schedule = self.schedule
        return self.alerting.wants_loss(step, schedule.every_n_steps, schedule.latest_step)

    # -- what the engine logs ----------------------------------------------------------------

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Every metric this engine logs, in catalogue order, then its :attr:`own_specs`."""
        return names_of(self.monitor) + tuple(self.own_specs)

    @property
    def specs(self) -> tuple[MetricSpec, ...]:
        """The :class:`~qkmonitor.measures.catalogue.MetricSpec` of each of :attr:`metric_names`:
        the catalogue's, or the engine's own."""
        own = self.own_specs
        return tuple(own[name] if name in own else metric(name) for name in self.metric_names)

    def thresholds(self) -> dict[str, float | int | str]:
        """The rules and the probe interval, as hyper-parameters of the run."""
        params = self.alerting.thresholds(self.prefix)
        params[f"{self.prefix}/{self.monitor}/every_n_steps"] = self.schedule.every_n_steps or 0
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
        if self.schedule.every_n_steps is None:
            self.schedule.every_n_steps = max(1, int(default_every_n_steps))
        self.schedule.forget_plan()
        self.release()  # an earlier bind's switches (validate, then fit)
        self._model = weakref.ref(model)
        if discovery.lazy(model, self.run_warnings):  # no shapes to find layers by: no measures
            self.layers, self.unmeasured, self.qk_norm_layers = [], [], frozenset()
            self.switches.bind(model, lazy=True)
            return
        self.layers = find_attention_layers(model, self.options.layers)
        self.unmeasured = (
            unmeasured_attention_like(model, self.layers) if self.options.layers is None else []
        )
        self.qk_norm_layers = discovery.qk_norm_layers(self.layers)
        self._prepare(model)
        self.switches.bind(model)  # switched at the first window, after every engine's discovery

    @property
    def model(self) -> nn.Module | None:
        """The model of the last :meth:`bind` (None before one, or once it is gone)."""
        return self._model() if self._model is not None else None

    # -- torch.compile (engine/switches.py) ------------------------------------------------------

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
        state["_readings"] = []  # copies on their way to a device's host (settled before saving)
        return state

    def _start_run(self) -> None:
        """Forget what an earlier run left: alert state and counts, the latest values, the loss
        history, the warnings given, the interval taken from an earlier Trainer."""
        self.schedule.every_n_steps = self.options.every_n_steps
        self.schedule.latest_step = None
        self.alerting.start_run()
        self.latest, self.latest_validation, self.latest_at = {}, {}, None
        self.latest_run, self._readings = {}, []
        shared = self.run_warnings is not self._warned  # a driver's set, renewed by the driver
        self._warned = set()
        if not shared:
            self.run_warnings = self._warned
        self.publishing.forget()

    def _prepare(self, model: nn.Module) -> None:
        """Subclasses build per-layer state once the layers are known."""

    def without_data(self) -> bool:
        """Whether a measured layer's parameters hold no data (a model on the meta device, or a
        lazy one not yet materialised): then nothing is measured — probes opened on such a model
        would fail on its first read — and training goes on, with one warning a run for every
        engine of a driver (:func:`~qkmonitor.engine.discovery.without_data`). Asked at probe
        steps only."""
        return discovery.without_data(self.layers, self.run_warnings)

    def plan(self, step: int) -> None:
        """After the work of the batch at ``step``: once the schedule's ``between_probes`` lies
        behind, the steps ahead where a host may skip work (:meth:`steps_after`). A host calls it
        at the end of every batch whose work it did not skip."""
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

    # -- the probe window: what a driver asks of every engine ----------------------------------

    @property
    def probing(self) -> bool:
        """Whether :meth:`finish` may have work (a window is open); hosts skip it when False. True
        here, so that an engine that does not say is always finished."""
        return True

    def open(self, step: int, *, validation: bool = False) -> bool:
        """Open the probes of a probe window; True if any were opened."""
        return False

    def finish(self, host: Host) -> None:
        """Close the open probes and log what they measured."""

    def abort(self) -> None:
        """Close the open probes without logging (a failed step, teardown)."""

    # -- metric problems (engine/failures.py) ---------------------------------------------------

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
        """The resume state, after the probes still on their way to the host are logged (their
        alerts in it)."""
        self.settle()
        return {"latest_step": self.schedule.latest_step, **self.alerting.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored = True
        self.schedule.latest_step = state.get("latest_step")
        self.schedule.forget_plan()
        self.alerting.load_state_dict(state)
