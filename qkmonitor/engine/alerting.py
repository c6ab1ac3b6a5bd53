"""An engine's alert policy: what its rules read, when they fire, and what is to be done then.

:class:`AlertPolicy` holds the :class:`~qkmonitor.alerts.AlertTracker` of an engine's rules, the
training losses the rules with a loss gate read, and the layers already warned about for
non-finite values. A probe enters it once, through :meth:`AlertPolicy.judge`: the losses it
carried kept, its non-finite heads named, and (a training probe) the evidence gathered from the
engines beside this one at the same step (:class:`Beside`: their metrics and measured run
signals), the tracker fed (:meth:`AlertPolicy.update`), and each alert's message made. What comes
out is a :class:`Verdict`: the alerts, their texts, the rules' counts and the action (warn, call
``on_alert``, stop, raise), which the engine's output path carries on to the publisher and then
carries out (:mod:`qkmonitor.engine.recording`); nothing here calls the publisher.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from qkmonitor.alerts import (
    LOSS_SIGNALS,
    LOSS_SMOOTHING,
    RUN_SIGNALS,
    Alert,
    AlertRule,
    AlertTracker,
    run_signals,
)
from qkmonitor.engine.losses import LossHistory
from qkmonitor.measures.catalogue import CATALOGUE, MetricSpec

if TYPE_CHECKING:
    from qkmonitor.engine.host import Host

__all__ = ["AlertPolicy", "Beside", "Verdict"]


@dataclasses.dataclass(frozen=True)
class Beside:
    """What an engine beside this one (a sibling: the same group, or the Lightning callbacks of
    one Trainer) measured at the step of a probe, for the rules that read it.

    Attributes:
        metric_names: every metric the engine logs.
        layer_names: the names of its layers, in its order.
        values: its values of that step, metric -> one tensor per layer (empty where its last
            probe was at another step).
        run_values: its run values of that step (the output logits'), empty where none.
    """

    metric_names: tuple[str, ...]
    layer_names: list[str]
    values: dict[str, list[Tensor]]
    run_values: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the rules made of one probe (:meth:`AlertPolicy.judge`), handed on down the output
    path: the publisher writes :attr:`counts` and :attr:`texts`, then the engine carries out
    :attr:`action` for each alert.

    Attributes:
        alerts: the alerts that fired, in the tracker's order, each with its layer's kind.
        messages: each alert's message (with the host's learning rate at the probe).
        counts: rule -> how many alerts it has fired in the run (empty for a validation probe).
        texts: ``(rule, message, step)`` of each alert written as text; none where the action
            raises (the run stops at the first alert, whose message is the exception's).
        action: ``"warn"``, ``"stop"`` or ``"raise"``.
        on_alert: called as ``on_alert(owner, alert)`` for every alert, or None.
    """

    alerts: tuple[Alert, ...] = ()
    messages: tuple[str, ...] = ()
    counts: dict[str, float] = dataclasses.field(default_factory=dict)
    texts: tuple[tuple[str, str, int], ...] = ()
    action: str = "warn"
    on_alert: Callable[[Any, Alert], None] | None = None


class AlertPolicy:
    """The rules of one engine, their state, and the action taken when one fires.

    Args:
        rules: the rules to track.
        action: ``"warn"``, ``"stop"`` or ``"raise"`` (see
            :class:`~qkmonitor.engine.MonitorOptions`).
        on_alert: called as ``on_alert(owner, alert)`` for every alert that fires, or None.
        owner: the engine's name, which starts every warning.
        monitor: the catalogue's name of the engine's monitor, for the rules' check.
        metric_names: the metrics the engine logs. A rule's own metric must be one of them; its
            conditions may also read another monitor's metric (:attr:`borrowed`: the engine
            hands the values of a monitor beside it, ``evidence``) or a run signal
            (:data:`~qkmonitor.alerts.RUN_SIGNALS`, from the training loss).
        specs: the specs of the metrics the catalogue does not hold (a user's own), for what
            the warnings say of them.
        defaults: the engine's default rules (a default rule whose evidence is missing is one
            INFO line, a rule the user gave one warning).
        prefix: the engine's ``log_key_prefix``, which names it in those lines.

    Raises:
        ValueError: if a rule watches a metric no monitor logs, or its own metric is not the
            engine's, or two rules share a name.
    """

    def __init__(
        self,
        rules: Sequence[AlertRule],
        *,
        action: str,
        on_alert: Callable[[Any, Alert], None] | None,
        owner: str,
        monitor: str,
        metric_names: Sequence[str],
        specs: Sequence[MetricSpec] = (),
        defaults: Sequence[AlertRule] = (),
        prefix: str = "",
    ) -> None:
        logged_anywhere = {spec.name: spec.monitor for spec in CATALOGUE}
        #: metrics of other monitors the rules' conditions read -> the monitor that logs them
        self.borrowed: dict[str, str] = {}
        for rule in rules:
            own = [rule.metric] if rule.metric not in metric_names else []
            others = [m for m in rule.metrics[1:] if m not in metric_names]
            unknown = own + [m for m in others if m not in logged_anywhere and m not in RUN_SIGNALS]
            if unknown:
                raise ValueError(
                    f"Alert rule {rule.name!r} watches {', '.join(map(repr, unknown))}, which "
                    f"{monitor} does not log; it logs {', '.join(metric_names)} (a condition may "
                    f"also read another monitor's metric or a run signal: "
                    f"{', '.join(RUN_SIGNALS)})"
                )
            self.borrowed.update({m: logged_anywhere[m] for m in others if m in logged_anywhere})
        self.tracker = AlertTracker(list(rules))
        self._per_head = {spec.name: spec.per_head for spec in specs}
        self.action = action
        self.on_alert = on_alert
        self.owner = owner
        self.defaults = tuple(defaults)
        self.prefix = prefix
        self._nonfinite: set[int] = set()
        self._missing: set[str] = set()  # the borrowed metrics said missing in this run
        #: the run signals the rules read: from the loss (computed here) or measured by a
        #: monitor (handed to :meth:`update`)
        self.signals = sorted({m for rule in rules for m in rule.metrics if m in RUN_SIGNALS})
        self._loss_signals = [name for name in self.signals if name in LOSS_SIGNALS]
        self._best_loss: float | None = None  # the lowest loss mean at a probe (loss_vs_best)
        #: whether a rule reads the training loss (its gate, a loss signal); the loss is kept
        #: only then
        self.reads_loss = bool(self._loss_signals) or any(rule.reads_loss for rule in rules)
        horizon = max(  # a gate on a solved run alone reads the last LOSS_SMOOTHING steps
            [rule.loss_window if rule.learning_drop is not None else 0 for rule in rules]
            + ([LOSS_SMOOTHING] if self._loss_signals else []),
            default=0,
        )
        #: steps before a probe whose loss a rule reads
        self.loss_horizon = horizon + LOSS_SMOOTHING
        #: the losses kept for the rules (shared with the other engines of a driver:
        #: :meth:`share_losses`)
        self.losses = LossHistory(4 * self.loss_horizon)

    def start_run(self) -> None:
        """Forget an earlier run: alert state and counts, the loss history, the layers warned
        about."""
        self.tracker = AlertTracker(self.tracker.rules)
        self._nonfinite = set()
        self._missing = set()
        self._best_loss = None
        self.losses.clear()

    # -- the training loss -------------------------------------------------------------------

    def wants_loss(self, step: int, every_n_steps: int | None, latest_step: int | None) -> bool:
        """Whether a rule may read the loss of ``step``: a rule reads the loss, and ``step`` is
        among the run's first :data:`~qkmonitor.alerts.LOSS_SMOOTHING` steps (its first loss),
        within :attr:`loss_lead` steps before a multiple of ``every_n_steps`` or at one, or in an
        interval whose probe is still to come (``latest_step``, the last probe's step, is before
        the interval: the probe of a multiple that two optimizers step over lands after it). At
        ``every_n_steps=50`` with the default rules: 21 steps of 50; at 10, every step."""
        if not self.reads_loss:
            return False
        every = every_n_steps
        return (
            every is None
            or step < LOSS_SMOOTHING
            or (-step) % every <= self.loss_lead
            or latest_step is None
            or latest_step < step - step % every
        )

    @property
    def loss_lead(self) -> int:
        """How many steps before a probe the rules read the loss: their longest loss window plus
        :data:`~qkmonitor.alerts.LOSS_SMOOTHING`; 0 when no rule reads it."""
        return self.loss_horizon if self.reads_loss else 0

    def observe_loss(self, step: int, loss: Tensor | float) -> None:
        """Keep the loss of ``step`` (:meth:`LossHistory.add`)."""
        self.losses.add(step, loss)

    def share_losses(self, history: LossHistory) -> None:
        """Keep the losses in ``history``, shared with other engines' policies (one driver keeps
        a step's loss once, and reads the kept tensors once); it must hold at least as many as
        this policy's own."""
        if history.maxlen < self.losses.maxlen:
            raise ValueError(
                f"Expected a loss history of at least {self.losses.maxlen} losses, got "
                f"{history.maxlen}"
            )
        self.losses = history

    def first_loss(self, up_to: int | None = None) -> float | None:
        """The mean of the run's first :data:`~qkmonitor.alerts.LOSS_SMOOTHING` finite losses seen
        (of the steps up to ``up_to``; each read from the device once)."""
        return self.losses.first(up_to)

    def loss_history(self, up_to: int | None = None) -> list[tuple[int, float]]:
        """The kept ``(step, loss)`` pairs (of the steps up to ``up_to``) as floats, oldest first
        (each tensor read once, in one copy with the others not read yet)."""
        return self.losses.history(up_to)

    # -- one probe ---------------------------------------------------------------------------

    def update(
        self,
        rows: dict[str, list[list[float]]],
        step: int,
        layer_names: list[str],
        qk_norm_layers: frozenset[int],
        evidence: dict[str, list[list[float]]] | None = None,
        run_values: dict[str, float] | None = None,
        *,
        losses_up_to: int | None = None,
    ) -> list[Alert]:
        """Feed one probe's values (metric -> per layer, the heads' values) to the tracker; return
        the alerts that fired. ``evidence``: the :attr:`borrowed` metrics of the same step, from
        the monitors beside the engine, in the same layout (a rule whose metric is absent is
        skipped); ``run_values``: the measured run signals of the step (the output logits'); the
        loss signals are computed from the loss history. A signal without a value is NaN, which
        fires nothing. The loss signals read the losses of the steps up to ``losses_up_to``
        (default ``step``)."""
        up_to = step if losses_up_to is None else losses_up_to
        losses = self.loss_history(up_to) if self.reads_loss else []
        grids = {**rows, **(evidence or {})}
        if self.signals and rows:
            signals = dict(run_values or {})
            if self._loss_signals:
                from_loss, now = run_signals(losses, step, self._best_loss)
                signals.update(from_loss)
                if now is not None and (self._best_loss is None or now < self._best_loss):
                    self._best_loss = now
            shape = next(iter(rows.values()))
            for name in self.signals:
                value = signals.get(name, math.nan)
                grids[name] = [[value] * len(heads) for heads in shape]
        return self.tracker.update(
            grids,
            step,
            layer_names,
            qk_norm_layers=qk_norm_layers,
            losses=losses,
            first_loss=self.first_loss(up_to) if self.reads_loss else None,
        )

    def evidence(
        self,
        host: Host,
        rows: dict[str, list[list[float]]],
        step: int,
        layer_names: list[str],
        beside: Sequence[Beside],
    ) -> tuple[dict[str, list[list[float]]], dict[str, float]]:
        """What the rules read from the engines ``beside`` this one at ``step``, as the
        ``evidence`` and measured ``run_values`` of :meth:`update`: the :attr:`borrowed` metrics,
        laid out as ``rows`` (a layer they do not measure, or whose heads differ, is NaN), and
        their run signals. A metric no engine beside it logs is left out, and its rules skipped,
        said once a run (:meth:`_say_missing`)."""
        signals = {
            name: value
            for other in beside
            for name, value in other.run_values.items()
            if name in self.signals
        }
        if not self.borrowed or not rows:
            return {}, signals
        heads = [len(h) for h in next(iter(rows.values()))]
        out: dict[str, list[list[float]]] = {}
        for name, monitor in self.borrowed.items():
            source = next((other for other in beside if name in other.metric_names), None)
            if source is None:
                self._say_missing(host, name, monitor)
            else:
                out[name] = _grid(source, name, layer_names, heads)
        return out, signals

    def _say_missing(self, host: Host, name: str, monitor: str) -> None:
        """Say once that the rules reading ``name`` are skipped: a warning if the user chose one of
        them, a line if they are all defaults (running one monitor alone is a choice, not a
        fault)."""
        if name in self._missing:
            return
        self._missing.add(name)
        readers = [rule for rule in self.tracker.rules if name in rule.metrics]
        text = (
            f"{', '.join(rule.name for rule in readers)} read(s) {name}, which {monitor} logs, but "
            f"no {monitor} runs beside this monitor (QKMonitor runs the three together; or give "
            "both engines to one Monitoring): the rules that read it are skipped"
        )
        if all(rule in self.defaults for rule in readers):
            host.info(f"qkmonitor: {self.owner} ({self.prefix}): {text}")
        else:
            host.warn(f"{self.owner}: {text}", RuntimeWarning)

    def counts(self) -> dict[str, float]:
        """How many alerts each rule has fired, in rule order."""
        return {rule.name: float(self.tracker.counts[rule.name]) for rule in self.tracker.rules}

    def judge(
        self,
        host: Host,
        rows: dict[str, list[list[float]]],
        undefined: dict[str, list[list]],
        step: int,
        layer_names: list[str],
        *,
        losses: Sequence[tuple[int, float]] = (),
        validation: bool = False,
        qk_norm_layers: frozenset[int] = frozenset(),
        beside: Sequence[Beside] = (),
        run_values: dict[str, float] | None = None,
        losses_up_to: int | None = None,
        layer_kinds: Sequence[str] = (),
    ) -> Verdict:
        """One probe through the rules, the only call a probe makes to the policy: ``losses``
        (``(step, loss)`` pairs copied with the probe) kept, the non-finite heads of ``rows`` named
        (:meth:`warn_nonfinite`, ``undefined`` left out); then, for a training probe, what the
        rules read from the engines ``beside`` this one (:meth:`evidence`) and the probe's
        measured ``run_values``, fed to the tracker (:meth:`update`, losses up to
        ``losses_up_to``), each alert given its layer's kind (``layer_kinds``, for the advice)
        and its message. A validation probe fires nothing: an empty :class:`Verdict`."""
        self.losses.fill(list(losses))
        self.warn_nonfinite(host, rows, undefined, step, layer_names)
        if validation:
            return Verdict(action=self.action, on_alert=self.on_alert)
        evidence, signals = self.evidence(host, rows, step, layer_names, beside)
        fired = self.update(
            rows,
            step,
            layer_names,
            qk_norm_layers,
            evidence,
            {**signals, **(run_values or {})},
            losses_up_to=losses_up_to,
        )
        alerts = tuple(a.with_layer_kind(layer_kinds[a.layer]) for a in fired)
        rate = host.learning_rate()
        messages = tuple(alert.message(rate) for alert in alerts)
        texts = [(a.rule.name, m, a.step) for a, m in zip(alerts, messages)]
        return Verdict(
            alerts,
            messages,
            self.counts(),
            () if self.action == "raise" else tuple(texts),
            self.action,
            self.on_alert,
        )

    def warn_nonfinite(
        self,
        host: Host,
        rows: dict[str, list[list[float]]],
        undefined: dict[str, list[list]],
        step: int,
        layer_names: list[str],
    ) -> None:
        """Name the layers and heads whose values are not finite (and not undefined by definition);
        warn again only when a layer goes bad that had not before. ``rows``: metric -> per layer,
        the heads' values; ``undefined``: the same shape, True where a NaN is NaN by definition."""
        bad: dict[int, dict[str, list[int]]] = {}
        for name, grid in rows.items():
            masks = undefined.get(name, [])
            for layer, heads in enumerate(grid):
                if all(map(math.isfinite, heads)):  # the usual case, checked in one C loop
                    continue
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
            name = layer_names[layer] if layer < len(layer_names) else ""
            cells = "; ".join(
                f"{m}" + (f" heads {h}" if self._per_head.get(m, True) else "")
                for m, h in bad[layer].items()
            )
            parts.append(f"layer {layer}{f' ({name})' if name else ''}: {cells}")
        host.warn(
            f"{self.owner}: non-finite values at step {step} in "
            + " | ".join(parts)
            + ". They are logged as NaN and fire no alert (are the weights or activations "
            "NaN/Inf?). Warned again only if another layer goes bad.",
            RuntimeWarning,
        )

    # -- hyper-parameters and resume -----------------------------------------------------------

    def thresholds(self, prefix: str) -> dict[str, float | int | str]:
        """The rules' thresholds, patience, margins and trends, as hyper-parameters of the run."""
        params: dict[str, float | int | str] = {}
        for rule in self.tracker.rules:
            key = f"{prefix}/alert_{rule.name}"
            params.update(
                {
                    f"{key}/threshold": rule.threshold,
                    f"{key}/patience": rule.patience,
                    f"{key}/margin": rule.margin,
                }
            )
            if rule.growth is not None:
                params.update({f"{key}/growth": rule.growth, f"{key}/window": rule.window or 0})
        return params

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "alerts": self.tracker.state_dict(),
            "nonfinite_layers": sorted(self._nonfinite),
        }
        if self.reads_loss:  # a resumed run tells learning from failing from its first probe on
            state["losses"] = [list(pair) for pair in self.loss_history()]
            state["first_loss"] = self.first_loss()
        if self._loss_signals:
            state["best_loss"] = self._best_loss
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state.get("alerts", {}))
        self._nonfinite = set(state.get("nonfinite_layers", []))
        if self.reads_loss and "losses" in state:
            self.losses.restore(state["losses"], state.get("first_loss"))
        self._best_loss = state.get("best_loss")


def _grid(source: Beside, name: str, layer_names: list[str], heads: list[int]) -> list[list[float]]:
    """``source``'s values of ``name`` for the layers ``layer_names`` (``heads`` values each), by
    layer name; NaN for a layer it does not measure or whose heads differ."""
    index = {layer: i for i, layer in enumerate(source.layer_names)}
    grid = []
    for layer, count in zip(layer_names, heads):
        j = index.get(layer)
        values = source.values[name][j].tolist() if name in source.values and j is not None else []
        grid.append(values if len(values) == count else [math.nan] * count)
    return grid
