"""The framework-free monitor engine: when to probe, how to measure, what to log, when to alert.

A :class:`MonitorEngine` knows its layers (:func:`qkmonitor.adapters.find_attention_layers`),
decides the probe steps, computes its metrics, feeds the alert tracker, builds the tags of
:mod:`qkmonitor.tags` from the metric catalogue and hands everything to the sinks of a
:class:`Host`. The host is whatever drives the engine: the Lightning callbacks (a thin adapter
over a Trainer) or :class:`qkmonitor.engine.Monitoring` in a plain PyTorch loop.

:class:`ActivationEngine` adds probes of the forward pass (:mod:`qkmonitor.probes`): ``open``
opens one probe per layer for a probe window, ``finish`` closes them and logs, ``abort`` closes
them and logs nothing. Every path closes what it opened.
"""

from __future__ import annotations

import logging
import math
import re
import warnings
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from qkmonitor.adapters import AttentionLayer, LayerSpec, find_attention_layers
from qkmonitor.alerts import ALERT_ACTIONS, LOSS_SMOOTHING, Alert, AlertRule, AlertTracker
from qkmonitor.catalogue import MetricSpec, metric, names_of
from qkmonitor.compiled import SwitchedForward, UncompiledForward, compiled_roots
from qkmonitor.dashboards import grid_of, heatmap_image
from qkmonitor.engine.publisher import PUBLISHER
from qkmonitor.engine.sinks import Sink
from qkmonitor.intercept import unmeasured_attention_like
from qkmonitor.probes import Probe, ProbeRequest, ProbeResult
from qkmonitor.tags import alert_tag, head_tag, layer_tag, worst_tag

__all__ = ["ActivationEngine", "Host", "MonitorEngine", "PlainHost", "Values", "check_prefix"]

#: metric -> one (num_heads,) float CPU tensor per layer ((1,) for per-layer metrics)
Values = dict[str, list[Tensor]]

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


class Host:
    """What an engine needs from what drives it. The base is a plain single-process loop.

    Attributes:
        owner: handed to ``on_alert(owner, alert)`` (the Trainer in Lightning).
        is_logging_rank: whether this process writes (rank zero).
    """

    owner: Any = None
    is_logging_rank: bool = True

    def sinks(self) -> list[Sink]:
        return []

    def warn(self, message: str, category: type[Warning] = UserWarning) -> None:
        warnings.warn(message, category, stacklevel=3)

    def info(self, message: str) -> None:
        """A line for the user (what was found): the ``qkmonitor`` logger at INFO, shown on stderr
        unless the application configured that logger itself."""
        _console_logger().info(message)

    def stop(self) -> None:
        """Ask the training loop to stop (alert action ``"stop"``)."""

    def learning_rate(self) -> float | None:
        return None


def _console_logger() -> logging.Logger:
    logger = logging.getLogger("qkmonitor")
    if (
        not logger.handlers and logger.level == logging.NOTSET
    ):  # as Lightning does for its own logger
        logger.setLevel(logging.INFO)
        logger.addHandler(logging.StreamHandler())
    return logger


class PlainHost(Host):
    """A host for a plain loop: fixed sinks, an optional optimizer for the learning rate.

    ``should_stop`` turns True when an alert with action ``"stop"`` fires.
    """

    def __init__(
        self,
        sinks: Sequence[Sink] = (),
        optimizer: torch.optim.Optimizer | None = None,
        owner: Any = None,
    ) -> None:
        self._sinks = list(sinks)
        self.optimizer = optimizer
        self.owner = owner
        self.should_stop = False

    def sinks(self) -> list[Sink]:
        return self._sinks

    def stop(self) -> None:
        self.should_stop = True

    def learning_rate(self) -> float | None:
        if self.optimizer is None:
            return None
        return next((float(g["lr"]) for g in self.optimizer.param_groups if "lr" in g), None)


def check_prefix(prefix: object) -> str:
    """A tag-safe ``log_key_prefix``: parts of letters, digits, ``_ . -`` joined by single ``/``."""
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(
            "Expected `log_key_prefix` to be a tag-safe string (letters, digits, '_', '.', '-', parts joined "
            f"by single '/', no leading or trailing '/'), got {prefix!r}"
        )
    return prefix


def _check_optional_positive_int(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"Expected `{name}` to be a positive int or None, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"Expected `{name}` to be a bool, got {value!r}")


class MonitorEngine:
    """Base of the engines: probe schedule, logging, alerts and resume state.

    Args:
        every_n_steps: probe every this many optimizer steps; ``None`` takes the host's default
            (the Trainer's ``log_every_n_steps``).
        per_head: also log ``{prefix}/{metric}/layer_LL_head_HH`` for every head.
        log_key_prefix: first part of every tag; tag-safe (see :func:`check_prefix`).
        alerts: the alert rules; ``None`` for the engine's defaults, ``[]`` for none. Each rule's
            metrics must be ones this engine logs.
        alert_action: ``"warn"`` (warning, TensorBoard text, counter), ``"stop"`` (also asks the
            loop to stop) or ``"raise"`` (raises the rule's warning class as an exception).
        on_alert: called as ``on_alert(owner, alert)`` for every alert that fires (the owner is
            the Trainer under Lightning), e.g. to lower the learning rate or save a checkpoint.
        layers: which attention layers: ``None`` finds them all; one module or AttentionLayer,
            a list of them, or a function ``model -> list``.
        visuals_every_n_probes: draw the visuals (layer x head heatmaps, attention images,
            singular-value histograms) at every this many probes, starting with the first (step
            0); ``0`` never. Scalars and alerts come at every probe. Drawing and encoding an
            image takes milliseconds, more than measuring a small model, so the default (20)
            keeps them to one probe in twenty: at ``every_n_steps=50``, one set every 1000 steps.
    """

    #: the catalogue's name of the monitor whose metrics this engine computes
    monitor: str = ""
    default_rules: tuple[AlertRule, ...] = ()

    def __init__(
        self,
        *,
        every_n_steps: int | None = None,
        per_head: bool = False,
        log_key_prefix: str = "qkmonitor",
        alerts: Sequence[AlertRule] | None = None,
        alert_action: str = "warn",
        on_alert: Callable[[Any, Alert], None] | None = None,
        layers: LayerSpec | nn.Module | AttentionLayer | None = None,
        visuals_every_n_probes: int = 20,
    ) -> None:
        _check_optional_positive_int("every_n_steps", every_n_steps)
        if (
            isinstance(visuals_every_n_probes, bool)
            or not isinstance(visuals_every_n_probes, int)
            or visuals_every_n_probes < 0
        ):
            raise ValueError(
                f"Expected `visuals_every_n_probes` to be an int >= 0, got {visuals_every_n_probes!r}"
            )
        _check_bool("per_head", per_head)
        if alert_action not in ALERT_ACTIONS:
            raise ValueError(
                f"Expected `alert_action` to be one of {ALERT_ACTIONS}, got {alert_action!r}"
            )
        if on_alert is not None and not callable(on_alert):
            raise ValueError(
                f"Expected `on_alert` to be a callable (owner, alert) or None, got {on_alert!r}"
            )
        if isinstance(alerts, AlertRule):
            alerts = [alerts]
        if alerts is not None and (
            isinstance(alerts, (str, bytes)) or not isinstance(alerts, Sequence)
        ):
            raise ValueError(
                f"Expected `alerts` to be a list of AlertRule or None, got {type(alerts).__name__}"
            )
        self.every_n_steps = every_n_steps
        self._every_n_steps_given = every_n_steps
        self._restored = False  # a checkpoint's state was loaded and the next bind keeps it
        self._session: Callable[[], Any] | None = (
            None  # the plain-loop Monitoring holding it (a weakref)
        )
        self._switches: list[SwitchedForward] = []  # under torch.compile, held from bind to release
        self._roots: list[SwitchedForward | UncompiledForward] = []  # the compiled regions' tops
        self._model: Callable[[], nn.Module | None] | None = None  # the bound model (a weakref)
        self._compiled_roots: list[nn.Module] = []  # found at bind, switched at the first window
        #: whether the bound model itself runs eagerly through a switch in each window, also when no
        #: compile is seen (plain loops: a loop may compile the model where the monitors cannot see)
        self.switch_model_in_windows = False
        self._window_removers: list[Callable[[], None]] = []  # the roots switched on for a window
        #: the last probe's visual inputs when it drew none: (values, step, images, histograms)
        self._undrawn: tuple | None = None
        self.visuals_every_n_probes = visuals_every_n_probes
        self.per_head = per_head
        self.prefix = check_prefix(log_key_prefix)
        self.alert_action = alert_action
        self.on_alert = on_alert
        if not (
            layers is None
            or callable(layers)
            or isinstance(layers, (nn.Module, AttentionLayer))
            or (isinstance(layers, Iterable) and not isinstance(layers, (str, bytes)))
        ):
            raise ValueError(
                f"Expected `layers` to be a module, an AttentionLayer, a list of them or a function of "
                f"the model, got {type(layers).__name__}"
            )
        if (
            isinstance(layers, Iterable)
            and not isinstance(layers, (nn.Module, AttentionLayer))
            and not callable(layers)
        ):
            layers = list(layers)  # a generator is read once, here
        self.layer_spec = layers
        rules = list(self.default_rules if alerts is None else alerts)
        self._check_rules(rules)
        self.tracker = AlertTracker(rules)
        self.layers: list[AttentionLayer] = []
        #: Indices of the layers with QK-norm (rules with ``skip_qk_norm`` leave them out).
        self.qk_norm_layers: frozenset[int] = frozenset()
        #: The last probe's values: metric -> one (num_heads,) float CPU tensor per layer.
        self.latest: Values = {}
        self.latest_step: int | None = None
        #: The last validation probe's values, like :attr:`latest`.
        self.latest_validation: Values = {}
        self._nonfinite: set[int] = set()
        self._warned: set[str] = set()
        #: whether a rule reads the training loss (``learning_drop``); the loss is kept only then
        self.reads_loss = any(rule.learning_drop is not None for rule in rules)
        horizon = max(
            (rule.loss_window for rule in rules if rule.learning_drop is not None), default=0
        )
        self._loss_horizon = horizon + LOSS_SMOOTHING  # steps before a probe whose loss it reads
        self._losses: deque[tuple[int, Tensor | float]] = deque(
            maxlen=4 * (horizon + LOSS_SMOOTHING)
        )
        self._first_losses: list[Tensor | float] = []

    # -- the training loss -------------------------------------------------------------------

    def observe_loss(self, step: int, loss: Tensor | float) -> None:
        """The training loss of the batch at ``step`` (call it at every step, before the step's
        :meth:`finish`). Kept as a detached tensor, read only when a probe's rules need it (no
        device sync on the other steps); a no-op when no rule reads the loss."""
        if self.wants_loss(step):
            self._losses.append((step, loss.detach() if isinstance(loss, Tensor) else float(loss)))
            if len(self._first_losses) < LOSS_SMOOTHING:
                self._first_losses.append(self._losses[-1][1])

    def wants_loss(self, step: int) -> bool:
        """Whether the loss of ``step`` can matter: a rule reads the loss and ``step`` is among the
        first :data:`~qkmonitor.alerts.LOSS_SMOOTHING` steps, within the rules' loss windows
        before a multiple of ``every_n_steps``, or in the first of those steps after one (where the
        probe of a skipped multiple lands): at ``every_n_steps=50``, 30 steps of 50; at 10, every step."""
        if not self.reads_loss:
            return False
        every = self.every_n_steps
        # also the first steps after a multiple: the probe step of a multiple that is skipped (two optimizers)
        return (
            every is None
            or step < LOSS_SMOOTHING
            or (-step) % every <= self._loss_horizon
            or step % every < LOSS_SMOOTHING
        )

    def first_loss(self) -> float | None:
        """The mean of the run's first :data:`~qkmonitor.alerts.LOSS_SMOOTHING` finite losses seen
        (each read from the device once)."""
        self._first_losses = _as_floats(self._first_losses)
        values = [v for v in self._first_losses if math.isfinite(v)]
        return sum(values) / len(values) if values else None

    def loss_history(self) -> list[tuple[int, float]]:
        """The kept ``(step, loss)`` pairs as floats, oldest first (each tensor read once, in one
        stack with the others not read yet)."""
        if any(isinstance(v, Tensor) for _, v in self._losses):
            steps = [s for s, _ in self._losses]
            floats = _as_floats([v for _, v in self._losses])
            self._losses.clear()
            self._losses.extend(zip(steps, floats))
        return list(self._losses)

    # -- what the engine logs ----------------------------------------------------------------

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Every metric this engine logs, in catalogue order."""
        return names_of(self.monitor)

    @property
    def specs(self) -> tuple[MetricSpec, ...]:
        return tuple(metric(name) for name in self.metric_names)

    def _check_rules(self, rules: list) -> None:
        for i, rule in enumerate(rules):
            if not isinstance(rule, AlertRule):
                raise ValueError(
                    f"Expected `alerts[{i}]` to be an AlertRule, got {type(rule).__name__}"
                )
            unknown = [m for m in rule.metrics if m not in self.metric_names]
            if unknown:
                raise ValueError(
                    f"Alert rule {rule.name!r} watches {', '.join(map(repr, unknown))}, which "
                    f"{self.monitor} does not log; it logs {', '.join(self.metric_names)}"
                )

    def thresholds(self) -> dict[str, float | int | str]:
        """The rules and the probe interval, as hyper-parameters of the run."""
        params: dict[str, float | int | str] = {}
        for rule in self.tracker.rules:
            key = f"{self.prefix}/alert_{rule.name}"
            params.update(
                {
                    f"{key}/threshold": rule.threshold,
                    f"{key}/patience": rule.patience,
                    f"{key}/margin": rule.margin,
                }
            )
            if rule.growth is not None:
                params.update({f"{key}/growth": rule.growth, f"{key}/window": rule.window or 0})
        params[f"{self.prefix}/{self.monitor}/every_n_steps"] = self.every_n_steps or 0
        return params

    def selection(self) -> str:
        """The layer selection as the constructor got it, in words that are the same in every
        process (it goes into a checkpoint's state key, read before the model is searched)."""
        spec = self.layer_spec
        if spec is None:
            return "auto"
        if callable(spec) and not isinstance(spec, nn.Module):
            return getattr(spec, "__qualname__", repr(spec))
        items = [spec] if isinstance(spec, (nn.Module, AttentionLayer)) else spec
        return ",".join(
            item.name if isinstance(item, AttentionLayer) else type(item).__name__ for item in items
        )

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
        self.release()  # an earlier bind's switches (validate, then fit)
        self.layers = find_attention_layers(model, self.layer_spec)
        self.unmeasured = (
            unmeasured_attention_like(model, self.layers) if self.layer_spec is None else []
        )
        self.qk_norm_layers = frozenset(
            i for i, layer in enumerate(self.layers) if layer.has_qk_norm
        )
        self._prepare(model)
        self._model = weakref.ref(model)
        self._compiled_roots = compiled_roots(
            model
        )  # switched at the first window, after every engine's discovery

    # -- torch.compile (qkmonitor.compiled) ------------------------------------------------------

    def _probed_modules(self) -> list[nn.Module]:
        """The modules this engine's probes install on (switched under compile)."""
        return []

    def _switch_modules(self, roots: list[nn.Module]) -> None:
        """Measure through switches (:mod:`qkmonitor.compiled`), held until :meth:`release`: the
        probed modules, and the roots of the compiled regions, which run eagerly while a window is
        open, so that probing neither recompiles the model nor breaks its graph inside a loop."""
        held = {id(switch.module) for switch in self._switches}
        for module in self._probed_modules():
            if id(module) not in held and (switch := SwitchedForward.attach(module)) is not None:
                self._switches.append(switch)
                held.add(id(module))
        for root in roots:
            if getattr(
                root, "_compiler_ctx", None
            ):  # Lightning compiles its forward: put aside while probed
                self._roots.append(UncompiledForward.of(root))
            elif (switch := SwitchedForward.attach(root)) is not None:
                self._switches.append(switch)
                self._roots.append(switch)

    def _switch_if_compiled(self) -> None:
        """At a window's opening: switch the probed modules and the compiled regions' roots if the
        model showed any at bind (:func:`~qkmonitor.compiled.compiled_roots`); here, not at bind,
        so that every engine's discovery sees the modules' own classes."""
        roots, self._compiled_roots = self._compiled_roots, []
        if roots and not self._roots:
            self._switch_modules(roots)

    def _open_roots(self) -> None:
        """Run the compiled regions' roots eagerly for the window (under compile), or the bound
        model itself when :attr:`switch_model_in_windows` (switched for the window only)."""
        if not self._roots and self.switch_model_in_windows and self._model is not None:
            model = self._model()
            switch = None if model is None else SwitchedForward.attach(model)
            if switch is not None:
                self._window_removers.append(switch.detach)
                self._window_removers.append(switch.add())
        for root in self._roots:
            self._window_removers.append(root.add())

    def _close_roots(self) -> None:
        removers, self._window_removers = self._window_removers, []
        for remove in reversed(removers):
            remove()

    def release(self) -> None:
        """Close any open probe and take out what binding put on the model (the switches under
        compile); idempotent. Called when a fit ends, on success and on failure."""
        self.abort()
        self._warn_publishing_errors(
            None, PUBLISHER.drain()
        )  # every visual written before a logger closes
        self._roots = []  # the roots' windows were closed by abort
        switches, self._switches = self._switches, []
        for switch in switches:
            switch.detach()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_session"] = None  # a weak reference to the Monitoring holding it: not carried along
        state.update(
            _switches=[],
            _roots=[],
            _model=None,
            _window_removers=[],
            _compiled_roots=[],
            _undrawn=None,
        )
        return state

    def _start_run(self) -> None:
        """Forget what an earlier run left: alert state and counts, the latest values, the loss
        history, the warnings given, the interval taken from an earlier Trainer."""
        self.every_n_steps = self._every_n_steps_given
        self.tracker = AlertTracker(self.tracker.rules)
        self.latest, self.latest_step, self.latest_validation = {}, None, {}
        self._nonfinite, self._warned = set(), set()
        self._undrawn = None
        self._losses.clear()
        self._first_losses = []

    def _prepare(self, model: nn.Module) -> None:
        """Subclasses build per-layer state once the layers are known."""

    def report_discovery(self, host: Host) -> None:
        """One line of what was found (at fit start), and a warning per attention-like module that
        is not measured."""
        kinds = Counter(layer.kind for layer in self.layers)
        found = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        host.info(
            f"qkmonitor: {type(self).__name__} ({self.prefix}) measures {len(self.layers)} attention "
            f"layer{'s' if len(self.layers) != 1 else ''}: {found}"
        )
        for name, cls in self.unmeasured:
            self.warn_once(
                host,
                f"unmeasured:{name}",
                f"{name!r} ({cls}) looks like attention but no rule reads it, so it is not measured; "
                "describe it with qkmonitor.register_attention(qkmonitor.AttentionSpec(...)) "
                "(README, 'Use it on your model')",
            )

    def is_probe_step(self, step: int) -> bool:
        """Whether ``step`` (optimizer steps so far) is probed: the first step at or after each
        multiple of ``every_n_steps``. Under gradient accumulation several batches share a step and
        only the first probes; with two optimizers stepping once per batch the step advances by 2,
        and a multiple it skips is probed at the next step (every 5 steps: 0, 6, 10, 16, 20)."""
        every = self.every_n_steps
        if every is None or step == self.latest_step:
            return False
        return step % every == 0 or (
            self.latest_step is not None and step // every > self.latest_step // every
        )

    def draws_visuals(self, step: int) -> bool:
        """Whether the probe at ``step`` draws the visuals: every ``visuals_every_n_probes``-th
        probe, counting the one at step 0."""
        every = self.every_n_steps or 1
        return (
            self.visuals_every_n_probes > 0 and (step // every) % self.visuals_every_n_probes == 0
        )

    # -- the probe window (weights engines ignore it) -------------------------------------------

    @property
    def probing(self) -> bool:
        """Whether :meth:`finish` may have work (a window is open); hosts skip it when False. True
        here, so that an engine that does not say is always finished."""
        return True

    def observe_weights(self, host: Host, step: int, **kwargs: Any) -> None:
        """Measure the weights as they are after ``step`` optimizer steps, if that is a probe step."""

    def open(self, step: int, *, validation: bool = False) -> bool:
        """Open the probes of a probe window; True if any were opened."""
        return False

    def finish(self, host: Host) -> None:
        """Close the open probes and log what they measured."""

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
        images: dict[str, np.ndarray | Callable[[], np.ndarray]] | None = None,
        histograms: dict[str, Tensor] | Callable[[], dict[str, Tensor]] | None = None,
    ) -> list[Alert]:
        """Log one probe's values at ``step``, fire and act on alerts (not for validation).

        Args:
            values: metric -> one tensor per layer.
            validation: log under ``{prefix}/val``; no alerts.
            undefined: metric -> per-layer bool tensors, True where a NaN is NaN by definition.
            images, histograms: extra visuals of this probe, by tag (an image may be a function
                that draws it; the histograms a function that makes them). Visuals are drawn and
                written on the publisher's thread (:mod:`qkmonitor.engine.publisher`); ``release``
                waits for them. A probe that draws none keeps them for :meth:`draw_final`.

        Returns:
            The alerts that fired.
        """
        rows = _rows(values)  # every tensor read once; the rest is in Python
        self._warn_nonfinite(
            host, rows, {name: _rows_of(masks) for name, masks in (undefined or {}).items()}, step
        )
        prefix = f"{self.prefix}/val" if validation else self.prefix
        alerts: list[Alert] = []
        if validation:
            self.latest_validation = values
        else:
            self.latest, self.latest_step = values, step
            alerts = self.tracker.update(
                rows,
                step,
                [layer.name for layer in self.layers],
                qk_norm_layers=self.qk_norm_layers,
                losses=self.loss_history() if self.reads_loss else (),
                first_loss=self.first_loss() if self.reads_loss else None,
            )
        scalars = self.scalars(rows, prefix)
        if not validation:
            scalars.update(
                {
                    alert_tag(self.prefix, r.name): float(self.tracker.counts[r.name])
                    for r in self.tracker.rules
                }
            )
        if host.is_logging_rank:
            sinks = host.sinks()
            for sink in sinks:
                sink.log_scalars(scalars, step)
            drawing = [sink for sink in sinks if sink.draws]
            if drawing and not validation and self.draws_visuals(step):
                self._warn_publishing_errors(host, PUBLISHER.errors())
                PUBLISHER.submit(
                    partial(
                        self._publish_visuals, drawing, values, step, images or {}, histograms or {}
                    )
                )
                self._undrawn = None
            elif drawing and not validation and self.visuals_every_n_probes:
                self._undrawn = (
                    values,
                    step,
                    images or {},
                    histograms or {},
                )  # drawn at the run's end
        for alert in alerts:
            self._act(host, alert)
        return alerts

    def scalars(
        self, values: Values | dict[str, list[list[float]]], prefix: str
    ) -> dict[str, float]:
        """The scalar tags of one probe: layer mean, lowest and highest head, and (``per_head``) heads.

        Args:
            values: metric -> one (heads,) tensor per layer, or those tensors as lists of floats.
        """
        out: dict[str, float] = {}
        for name, grid in _rows(values).items():
            per_head = metric(name).per_head
            for layer, row in enumerate(grid):
                nan = any(math.isnan(v) for v in row)  # a NaN head makes mean and band NaN
                out[layer_tag(prefix, name, layer)] = (
                    math.nan if nan or not row else sum(row) / len(row)
                )
                if not per_head:
                    continue
                out[worst_tag(prefix, name, "min", layer)] = (
                    math.nan if nan or not row else min(row)
                )
                out[worst_tag(prefix, name, "max", layer)] = (
                    math.nan if nan or not row else max(row)
                )
                if self.per_head:
                    for head, value in enumerate(row):
                        out[head_tag(prefix, name, layer, head)] = value
        return out

    def _publish_visuals(
        self,
        sinks: list[Sink],
        values: Values,
        step: int,
        images: dict[str, np.ndarray | Callable[[], np.ndarray]],
        histograms: dict[str, Tensor] | Callable[[], dict[str, Tensor]],
    ) -> None:
        """Draw a probe's visuals and write them (on the publisher's thread, :mod:`.publisher`):
        the heatmaps of ``values``, ``images`` (arrays, or functions that draw them), histograms
        (or a function that makes them)."""
        drawn = {
            **self._heatmaps(values, step),
            **{tag: image() if callable(image) else image for tag, image in images.items()},
        }
        for sink in sinks:
            for tag, image in drawn.items():
                sink.log_image(tag, image, step)
            for tag, data in (histograms() if callable(histograms) else histograms).items():
                sink.log_histogram(tag, data, step)

    def draw_final(self, host: Host) -> None:
        """At a run's end: draw the visuals of its last probe if that probe was not one of every
        ``visuals_every_n_probes``-th (the pictures always show the final state)."""
        undrawn, self._undrawn = self._undrawn, None
        if undrawn is None or not host.is_logging_rank:
            return
        drawing = [sink for sink in host.sinks() if sink.draws]
        if drawing:
            PUBLISHER.submit(partial(self._publish_visuals, drawing, *undrawn))

    def _warn_publishing_errors(self, host: Host | None, errors: list[BaseException]) -> None:
        if errors:
            message = (
                f"{type(self).__name__}: writing the visuals failed {len(errors)} time(s) "
                f"({type(errors[0]).__name__}: {errors[0]}); training goes on."
            )
            if host is None:
                warnings.warn(message, RuntimeWarning, stacklevel=3)
            else:
                host.warn(message, RuntimeWarning)

    def _heatmaps(self, values: Values, step: int) -> dict[str, np.ndarray]:
        return {
            f"{self.prefix}/heatmap/{spec.name}": heatmap_image(
                grid_of(values[spec.name]), *spec.heatmap, title=f"{spec.name} at step {step}"
            )
            for spec in self.specs
            if spec.heatmap is not None and spec.name in values
        }

    def _act(self, host: Host, alert: Alert) -> None:
        message = alert.message(host.learning_rate())
        if self.alert_action == "raise":
            raise alert.rule.warning(message)
        host.warn(message, alert.rule.warning)
        if host.is_logging_rank:
            for sink in host.sinks():
                sink.log_text(alert_tag(self.prefix, alert.rule.name), message, alert.step)
        if self.on_alert is not None:
            self.on_alert(host.owner, alert)
        if self.alert_action == "stop":
            host.stop()

    def warn_once(self, host: Host, key: str, message: str) -> None:
        """Warn once per ``key`` per run (a new fit warns again)."""
        if key not in self._warned:
            self._warned.add(key)
            host.warn(f"{type(self).__name__}: {message}", RuntimeWarning)

    def _warn_nonfinite(
        self,
        host: Host,
        rows: dict[str, list[list[float]]],
        undefined: dict[str, list[list]],
        step: int,
    ) -> None:
        """Name the layers and heads whose values are not finite (and not undefined by definition);
        warn again only when a layer goes bad that had not before. ``rows``: metric -> per layer, the
        heads' values; ``undefined``: the same shape, True where a NaN is NaN by definition."""
        bad: dict[int, dict[str, list[int]]] = {}
        for name, grid in rows.items():
            masks = undefined.get(name, [])
            for layer, heads in enumerate(grid):
                mask = masks[layer] if layer < len(masks) else ()
                broken = [
                    h
                    for h, v in enumerate(heads)
                    if not math.isfinite(v) and not (h < len(mask) and mask[h])
                ]
                if broken:
                    bad.setdefault(layer, {})[name] = broken
        new = sorted(set(bad) - self._nonfinite)
        if not new:
            return
        self._nonfinite.update(new)
        parts = []
        for layer in new:
            name = self.layers[layer].name if layer < len(self.layers) else ""
            cells = "; ".join(
                f"{m}" + (f" heads {h}" if metric(m).per_head else "")
                for m, h in bad[layer].items()
            )
            parts.append(f"layer {layer}{f' ({name})' if name else ''}: {cells}")
        host.warn(
            f"{type(self).__name__}: non-finite values at step {step} in "
            + " | ".join(parts)
            + ". They are logged as NaN and fire no alert (are the weights or activations NaN/Inf?). "
            "Warned again only if another layer goes bad.",
            RuntimeWarning,
        )

    # -- resume ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = {
            "alerts": self.tracker.state_dict(),
            "latest_step": self.latest_step,
            "nonfinite_layers": sorted(self._nonfinite),
        }
        if self.reads_loss:  # a resumed run tells learning from failing from its first probe on
            state["losses"] = [list(pair) for pair in self.loss_history()]
            state["first_loss"] = self.first_loss()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored = True
        self.tracker.load_state_dict(state.get("alerts", {}))
        self.latest_step = state.get("latest_step")
        self._nonfinite = set(state.get("nonfinite_layers", []))
        if self.reads_loss and "losses" in state:
            self._losses.clear()
            self._losses.extend((int(s), float(v)) for s, v in state["losses"])
            first = state.get("first_loss")
            self._first_losses = [] if first is None else [float(first)] * LOSS_SMOOTHING


def _rows(values: Values | dict[str, list[list[float]]]) -> dict[str, list[list[float]]]:
    """metric -> per layer, its heads' values as Python floats (one read of each tensor)."""
    return {name: _rows_of(grid) for name, grid in values.items()}


def _rows_of(grid: list[Tensor] | list[list]) -> list[list]:
    return [
        heads.reshape(-1).tolist() if isinstance(heads, Tensor) else list(heads) for heads in grid
    ]


class ActivationEngine(MonitorEngine):
    """An engine that measures the forward pass through probes (:mod:`qkmonitor.probes`).

    Subclasses say what they want (:meth:`_request`), may install more for the window
    (:meth:`_open_extra` / :meth:`_close_extra`, e.g. block hooks) and turn the probes' results
    into values (:meth:`_measure`).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._probes: list[Probe] = []
        self._window: tuple[int, bool] | None = None
        self._measurable: list[bool] = []

    @property
    def probing(self) -> bool:
        """Whether a probe window is open."""
        return self._window is not None

    def _prepare(self, model: nn.Module) -> None:
        self._measurable = [layer.supports_stats for layer in self.layers]
        unsupported = [layer.name for layer, ok in zip(self.layers, self._measurable) if not ok]
        if len(unsupported) == len(self.layers):
            raise ValueError(
                f"{type(self).__name__}: layers {unsupported} give no attention statistics; describe them with "
                "qkmonitor.AttentionSpec (statistics come from their SDPA or softmax call), or pass `layers=` with "
                "qkmonitor.AttentionLayer subclasses that define `supports_stats` and `install(probe)`"
            )
        if unsupported:  # the adapters said why; the others are measured, these stay NaN
            warnings.warn(
                f"{type(self).__name__}: layers {unsupported} give no attention statistics here; their "
                "activation metrics are logged as NaN.",
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
        ):
            return False
        self._switch_if_compiled()
        self._window = (step, validation)
        try:
            request = self._request()
            for layer, measurable in zip(self.layers, self._measurable):
                self._probes.append(
                    layer.open_probe(request) if measurable else Probe(layer.name, request)
                )
            self._open_extra()
            self._open_roots()
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
        self._close_roots()
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

    def finish(self, host: Host) -> None:
        if self._window is None:
            return
        step, validation = self._window
        results = self.close_probes()
        self._report_missing(host, results)
        with torch.no_grad():
            values, extra = self._measure(
                results, step, visuals=not validation and self.draws_visuals(step)
            )
        self.record(host, values, step, validation=validation, **extra)

    def _report_missing(self, host: Host, results: list[ProbeResult]) -> None:
        measured = [t for r in results for t in [*(s.entropy for s in r.stats), *r.probs]]
        if measured and all(t.numel() == 0 for t in measured):
            self.warn_once(
                host,
                "empty",
                "a probed batch held no token (an empty batch): nothing was measured and "
                "its values are NaN. This warning is shown once.",
            )
        for layer, result, measurable in zip(self.layers, results, self._measurable):
            if result.calls == 0 and measurable:
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
                )

    def _measure(
        self, results: list[ProbeResult], step: int, *, visuals: bool
    ) -> tuple[Values, dict[str, Any]]:
        """Values from the closed probes' results (one per layer, of the window at ``step``), plus
        extra ``record`` arguments; images only where ``visuals``."""
        raise NotImplementedError


def _as_floats(values: list[Tensor | float]) -> list[float]:
    """``values`` as Python floats; the tensors among them read from the device in one stack."""
    tensors = [v for v in values if isinstance(v, Tensor)]
    if not tensors:
        return list(values)  # type: ignore[arg-type]
    read = iter(torch.stack([t.reshape(()).float() for t in tensors]).tolist())
    return [next(read) if isinstance(v, Tensor) else v for v in values]
