"""Alerts and their tracker: patience, hysteresis, and the recent values trends are measured from.

A rule *fires* when its test has held for ``patience`` consecutive probe events, then stays quiet
for that (rule, layer, head) until the value *recovers* past ``threshold ∓ margin`` (hysteresis),
after which it may fire again. NaN values neither count towards the patience nor recover, nor
enter a trend. What happens when a rule fires (warn, stop, raise, ``on_alert``) is the engine's
business; the tracker only keeps the state (streaks, active alerts, the recent values), which
survives a resume through ``state_dict``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkmonitor.alerts.rules import AlertRule, advice_for, channel_of

__all__ = [
    "Alert",
    "AlertTracker",
]


def _trend_text(value: float, reference: tuple[int, float], step: int) -> str:
    ref_step, ref = reference
    if not ref > 0 or not value > 0:
        return ""
    ratio = value / ref
    factor = f"×{ratio:.3g}" if ratio >= 1 else f"÷{1 / ratio:.3g}"
    return f"{factor} over the last {step - ref_step} steps ({ref:.4g} at step {ref_step})"


@dataclass(frozen=True)
class Alert:
    """A rule that fired for one (layer, head) at one step.

    Attributes:
        rule: the rule.
        layer: the layer's index; ``layer_name`` its module name.
        head: the head (0 for a per-layer rule).
        value: the rule's metric at ``step``.
        step: the probe's step.
        reference: for a trend rule, the value the growth was measured from, at ``reference_step``.
        also_values: the values of the rule's ``also`` conditions at ``step``, in order.
        also_references: for conditions with a trend, the ``(step, value)`` it was measured from.
        layer_kind: the kind of attention layer (:attr:`AttentionLayer.kind`, set by the engine):
            the advice says how to add QK-norm to that kind of model ("" when unknown).
    """

    rule: AlertRule
    layer: int
    layer_name: str
    head: int
    value: float
    step: int
    reference: float | None = None
    reference_step: int | None = None
    also_values: tuple[float, ...] = ()
    also_references: tuple[tuple[int, float] | None, ...] = ()
    layer_kind: str = ""

    def with_layer_kind(self, layer_kind: str) -> Alert:
        """This alert about a layer of ``layer_kind`` (:attr:`AttentionLayer.kind`)."""
        return dataclasses.replace(self, layer_kind=layer_kind)

    @property
    def ratio(self) -> float | None:
        """``value / reference`` for a trend rule."""
        if self.reference is None or not self.reference > 0:
            return None
        return self.value / self.reference

    def trend(self) -> str:
        """The measured trend in words, e.g. ``"×12.6 over the last 30 steps (5.57 at step 0)"``."""
        if self.reference is None or self.reference_step is None:
            return ""
        return _trend_text(self.value, (self.reference_step, self.reference), self.step)

    def message(self, lr: float | None = None) -> str:
        """The user-facing sentence: where, what value and trend, which threshold, when, what to
        try, and what the rule's calibration measured."""
        where = (
            f"layer {self.layer} ({self.layer_name})" if self.layer_name else f"layer {self.layer}"
        )
        if self.rule.per_head:
            where += f", head {self.head}"
        lr_text = f", learning rate {lr:.3g}" if lr is not None else ""
        trend = self.trend()
        channels = [channel_of(test.metric) for test in self.rule.tests]
        several = len(set(channels)) > 1  # say which channels agreed
        measured = f"{self.rule.metric} = {self.value:.4g}" + (f", {trend}" if trend else "")
        measured += f" from the {channels[0]}" if several else ""
        references = self.also_references or (None,) * len(self.also_values)
        for condition, value, reference, channel in zip(
            self.rule.also, self.also_values, references, channels[1:]
        ):
            trend = _trend_text(value, reference, self.step) if reference is not None else ""
            measured += f", {condition.metric} = {value:.4g}" + (f", {trend}" if trend else "")
            measured += f" from the {channel}" if several else ""
        evidence = f" Evidence: {self.rule.evidence}." if self.rule.evidence else ""
        return (
            f"[qkmonitor:{self.rule.name}] {where}: {measured} (threshold {self.rule.describe()}, "
            f"{self.rule.patience} probe(s) in a row) at step {self.step}{lr_text}: "
            f"{self.rule.meaning}. Try: "
            f"{advice_for(self.rule.advice, self.layer_kind)}.{evidence}"
        )


class _Grid:
    """One metric's values at one probe, per layer: float64 on CPU, as one (layers, heads) tensor
    where every layer has as many heads (else NaN-padded on demand)."""

    def __init__(self, per_layer: Tensor | Sequence[Tensor | Sequence[float]]) -> None:
        if isinstance(per_layer, Tensor):  # (layers, heads) already
            per_layer = list(per_layer.reshape(per_layer.shape[0], -1).unbind())
        tensors = all(isinstance(h, Tensor) for h in per_layer)
        if tensors and per_layer and len({h.numel() for h in per_layer}) == 1:
            self.table = torch.stack([h.reshape(-1) for h in per_layer]).detach()
            self.table = self.table.to(device="cpu", dtype=torch.float64)
            self.rows = list(self.table.unbind())
        else:
            self.rows = [
                h.detach().double().cpu().reshape(-1)
                if isinstance(h, Tensor)
                else torch.tensor(list(h), dtype=torch.float64)
                for h in per_layer
            ]
            self.table = None
        self.counts = [row.shape[0] for row in self.rows]

    def padded(self, counts: list[int]) -> Tensor:
        """(len(counts), max(counts)): layer ``l``'s first ``counts[l]`` heads, NaN after."""
        widest = max(counts)
        if self.table is not None and all(c == widest for c in counts):
            return self.table[: len(counts), :widest]
        out = torch.full((len(counts), widest), float("nan"), dtype=torch.float64)
        for layer, count in enumerate(counts):
            out[layer, :count] = self.rows[layer][:count]
        return out

    def lists(self) -> list[list[float]]:
        return self.table.tolist() if self.table is not None else [r.tolist() for r in self.rows]


class AlertTracker:
    """Patience, hysteresis and trend state for a set of rules over (layer, head) cells.

    For rules with a ``growth``, the tracker keeps each watched cell's recent finite values (the
    first one of the run, and those a later probe may measure from), so a trend is measured
    against the run's own history; that history survives a resume through :meth:`state_dict`.

    Args:
        rules: the rules to track; names must be unique.
    """

    def __init__(self, rules: list[AlertRule]) -> None:
        names = [r.name for r in rules]
        if len(set(names)) != len(names):
            raise ValueError(f"Expected `alerts` to have unique rule names, got {names}")
        self.rules = list(rules)
        self._streak: dict[str, int] = {}
        self._active: set[str] = set()
        self.counts: dict[str, int] = {r.name: 0 for r in rules}
        #: metric/layer/head -> [(step, value), ...] of recent finite values, oldest first
        self._history: dict[str, list[tuple[int, float]]] = {}
        #: metric/layer/head -> (step, value) of the first finite value
        self._start: dict[str, tuple[int, float]] = {}
        #: (metric, layer) -> its heads' history keys, made once
        self._key_names: dict[tuple[str, int], list[str]] = {}
        trends = [t for r in rules for t in r.tests if t.growth is not None]
        self._trend_metrics = {t.metric for t in trends}
        windows = [t.window for t in trends if t.window is not None]
        self._horizon = max(windows, default=0)

    def update(
        self,
        values: dict[str, list[Tensor]],
        step: int,
        layer_names: list[str],
        *,
        qk_norm_layers: Collection[int] = (),
        losses: Sequence[tuple[int, float]] = (),
        first_loss: float | None = None,
    ) -> list[Alert]:
        """Feed one probe event; return the alerts that fire now.

        Args:
            values: metric name -> one (num_heads,) tensor per layer (a (layers, heads) tensor
                works too), or per layer a list of the heads' floats. Rules whose metric is absent
                are skipped.
            step: the global step of this probe.
            layer_names: the layers' module names, by index.
            qk_norm_layers: indices of layers with QK-norm; rules with ``skip_qk_norm`` leave them
                out.
            losses: the recent training loss, ``(step, loss)`` oldest first, for rules with
                ``learning_drop``.
            first_loss: the run's first training loss (for ``solved_fraction``).
        """
        grids = {m: _Grid(values[m]) for m in values if any(m in r.metrics for r in self.rules)}
        fired: list[Alert] = []
        for rule in self.rules:
            if not all(metric in grids for metric in rule.metrics):
                continue
            learning = rule.learning(losses, step, first_loss)
            for layer, head, cell in self._cells_to_step(rule, grids, learning, qk_norm_layers):
                alert = self._step_cell(rule, layer, head, cell, step, learning)
                if alert is not None:
                    self.counts[rule.name] += 1
                    fired.append(dataclasses.replace(alert, layer_name=layer_names[layer]))
        self._remember(grids, step)
        return fired

    def _cells_to_step(
        self,
        rule: AlertRule,
        grids: dict[str, _Grid],
        learning: bool,
        qk_norm_layers: Collection[int],
    ) -> list[tuple[int, int, tuple[float, ...]]]:
        """The (layer, head, values) cells of ``rule`` whose state this probe can change, in
        (layer, head) order: those past every level of the rule's tests (found for all cells at
        once) and those holding a streak or an active alert. Any other cell is unchanged by
        :meth:`_step_cell` (a level not past resets a streak it does not have; NaN changes
        nothing), so it is skipped. A layer's heads are the fewest any of the rule's metrics has.
        """
        columns = [grids[m] for m in rule.metrics]
        layers = min(len(c.counts) for c in columns)
        counts = [min(c.counts[layer] for c in columns) for layer in range(layers)]
        widest = max(counts, default=0)
        if not widest:
            return []
        cube = torch.stack([c.padded(counts) for c in columns])  # (tests, layers, widest)
        if learning:  # a learning run crosses nothing
            selected = torch.zeros(layers, widest, dtype=torch.bool)
        else:
            selected = torch.ones(layers, widest, dtype=torch.bool)
            for test, values in zip(rule.tests, cube):
                selected &= values >= test.threshold if test.above else values <= test.threshold
        for key in (*self._streak, *self._active):
            name, layer, head = key.rsplit("/", 2)
            if name == rule.name and int(layer) < layers and int(head) < counts[int(layer)]:
                selected[int(layer), int(head)] = True
        for layer in qk_norm_layers if rule.skip_qk_norm else ():
            if 0 <= layer < layers:
                selected[layer] = False
        cells = selected.nonzero().tolist()
        values = cube[:, selected].T.tolist() if cells else []
        return [(layer, head, tuple(cell)) for (layer, head), cell in zip(cells, values)]

    def reference(
        self, metric: str, layer: int, head: int, step: int, window: int | None
    ) -> tuple[int, float] | None:
        """The (step, value) a trend at ``step`` is measured from: the newest finite value at least
        ``window`` steps old, or the run's first one for ``window=None``; None if there is none."""
        key = f"{metric}/{layer}/{head}"
        if window is None:
            start = self._start.get(key)
            return tuple(start) if start is not None and start[0] < step else None
        return next(
            ((s, v) for s, v in reversed(self._history.get(key, [])) if s <= step - window), None
        )

    def _step_cell(
        self,
        rule: AlertRule,
        layer: int,
        head: int,
        cell: tuple[float, ...],
        step: int,
        learning: bool = False,
    ) -> Alert | None:
        if any(math.isnan(v) for v in cell):
            return None
        key = f"{rule.name}/{layer}/{head}"
        if key in self._active:
            if any(test.recovered(v) for test, v in zip(rule.tests, cell)):
                self._active.discard(key)
                self._streak.pop(key, None)
            return None
        references = (
            []
            if learning
            else [  # a learning run crosses nothing: no trend to measure
                self.reference(t.metric, layer, head, step, t.window)
                if t.growth is not None
                else None
                for t in rule.tests
            ]
        )
        crossed = not learning and all(
            t.crossed(v, ref, step) for t, v, ref in zip(rule.tests, cell, references)
        )
        streak = self._streak.get(key, 0) + 1 if crossed else 0
        if streak >= rule.patience and step >= rule.grace_steps:
            self._active.add(key)
            self._streak.pop(key, None)
            own = references[0]
            return Alert(
                rule,
                layer,
                "",
                head,
                cell[0],
                step,
                reference=None if own is None else own[1],
                reference_step=None if own is None else own[0],
                also_values=tuple(cell[1:]),
                also_references=tuple(references[1:]),
            )
        if streak:
            self._streak[key] = streak
        else:
            self._streak.pop(key, None)
        return None

    def _remember(self, grids: dict[str, _Grid], step: int) -> None:
        """Add this probe's finite values of the trend metrics; forget those no later probe can
        use (older than the newest one at least the longest window old). A cell's entries are
        in step order; a probe at a step already remembered replaces that step's value."""
        oldest_needed = step - self._horizon
        history, start = self._history, self._start
        for metric in self._trend_metrics & set(grids):
            for layer, heads in enumerate(grids[metric].lists()):
                for key, value in zip(self._keys(metric, layer, len(heads)), heads):
                    if not math.isfinite(value):
                        continue
                    if key not in start:
                        start[key] = (step, value)
                    entries = history.get(key)
                    if entries is None:
                        history[key] = [(step, value)]
                        continue
                    if entries[-1][0] >= step:  # this step again (or an earlier one): drop them
                        entries[:] = [e for e in entries if e[0] < step]
                    entries.append((step, value))
                    # keep the newest entry at least the horizon old, and those after it
                    drop = 0
                    while drop + 1 < len(entries) and entries[drop + 1][0] <= oldest_needed:
                        drop += 1
                    if drop:
                        del entries[:drop]

    def _keys(self, metric: str, layer: int, heads: int) -> list[str]:
        """The history keys ``metric/layer/head`` of a layer's first ``heads`` heads (kept)."""
        keys = self._key_names.get((metric, layer))
        if keys is None or len(keys) < heads:
            keys = self._key_names[metric, layer] = [f"{metric}/{layer}/{h}" for h in range(heads)]
        return keys

    def state_dict(self) -> dict:
        return {
            "streak": dict(self._streak),
            "active": sorted(self._active),
            "counts": dict(self.counts),
            "history": {k: [list(e) for e in v] for k, v in self._history.items()},
            "start": {k: list(v) for k, v in self._start.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self._streak = dict(state.get("streak", {}))
        self._active = set(state.get("active", []))
        self.counts.update(state.get("counts", {}))
        self._history = {
            k: [(int(s), float(v)) for s, v in entries]
            for k, entries in state.get("history", {}).items()
        }
        self._start = {k: (int(s), float(v)) for k, (s, v) in state.get("start", {}).items()}
