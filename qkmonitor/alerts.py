"""Alert rules: when a metric crosses its threshold for long enough, say so once.

A rule watches one metric per (layer, head). It *fires* when the value has been on the wrong side
of ``threshold`` for ``patience`` consecutive probe events, then stays quiet for that
(rule, layer, head) until the value *recovers* past ``threshold ∓ margin`` (hysteresis), after
which it may fire again. NaN values neither count towards the patience nor recover.

What happens when a rule fires (warn, stop, raise) is the callback's business; this module only
keeps the state, which survives a resume through ``state_dict``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from numbers import Real

from torch import Tensor

__all__ = [
    "QKMonitorWarning",
    "OverLocalizationWarning",
    "EntropyCollapseWarning",
    "LogitGrowthWarning",
    "RankCollapseWarning",
    "MalignantCollapseWarning",
    "AlertRule",
    "Alert",
    "AlertTracker",
    "KAPPA_RULE",
    "ENTROPY_COLLAPSE_RULE",
    "LOGIT_GROWTH_RULE",
    "RANK_COLLAPSE_RULE",
    "MALIGNANT_COLLAPSE_RULE",
    "Condition",
    "ALERT_ACTIONS",
]

ALERT_ACTIONS = ("warn", "stop", "raise")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


class QKMonitorWarning(UserWarning):
    """Base class of every qkmonitor alert."""


class OverLocalizationWarning(QKMonitorWarning):
    """The QK spectrum of a head concentrates on one direction (rule ``kappa``)."""


class EntropyCollapseWarning(QKMonitorWarning):
    """A head's attention is near one-hot (rule ``entropy_collapse``)."""


class LogitGrowthWarning(QKMonitorWarning):
    """A head's attention logits grow without bound (rule ``logit_growth``)."""


class RankCollapseWarning(QKMonitorWarning):
    """A block's residual stream collapses towards rank one (rule ``rank_collapse``)."""


class MalignantCollapseWarning(QKMonitorWarning):
    """A head's attention is sparse *and* low-rank (rule ``malignant_collapse``)."""


@dataclass(frozen=True)
class Condition:
    """A further condition a rule needs at the same (layer, head): ``metric`` past ``threshold``.

    Recovery of either the rule's own metric or this one (past ``margin``) ends the alert.
    """

    metric: str
    threshold: float
    above: bool
    margin: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"Expected `metric` to be a metric name, got {self.metric!r}")
        if not _is_real(self.threshold) or not math.isfinite(self.threshold):
            raise ValueError(f"Expected `threshold` to be a finite number, got {self.threshold!r}")
        if not isinstance(self.above, bool):
            raise ValueError(f"Expected `above` to be a bool, got {self.above!r}")
        if not _is_real(self.margin) or not math.isfinite(self.margin) or self.margin < 0:
            raise ValueError(f"Expected `margin` to be a finite number >= 0, got {self.margin!r}")

    def crossed(self, value: float) -> bool:
        return value >= self.threshold if self.above else value <= self.threshold

    def recovered(self, value: float) -> bool:
        return value < self.threshold - self.margin if self.above else value > self.threshold + self.margin

    def describe(self) -> str:
        return f"{self.metric} {'>=' if self.above else '<='} {self.threshold:g}"


@dataclass(frozen=True)
class AlertRule:
    """One alert rule.

    Attributes:
        name: rule name, used in tags (``{prefix}/alerts/{name}``) and messages.
        metric: the per-head metric it watches.
        threshold: the bound.
        above: fire when ``value >= threshold`` (True) or ``value <= threshold`` (False).
        patience: consecutive probe events past the threshold before it fires.
        margin: recovery needs ``value < threshold - margin`` (above) or
            ``value > threshold + margin`` (below).
        warning: the warning class raised, warned or named.
        meaning: what crossing the threshold says about attention.
        advice: what to try.
        also: further conditions that must hold at the same time (e.g. low rank *and* sparse).
        per_head: False for metrics of a whole layer (one value per layer, no head).
    """

    name: str
    metric: str
    threshold: float
    above: bool
    patience: int
    margin: float
    warning: type[QKMonitorWarning]
    meaning: str
    advice: str
    also: tuple[Condition, ...] = ()
    per_head: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"Expected `name` to be a non-empty tag-safe string (letters, digits, '_', '.', '-'), "
                             f"got {self.name!r}")
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"Expected `metric` to be a metric name, got {self.metric!r}")
        if not _is_real(self.threshold) or not math.isfinite(self.threshold):
            raise ValueError(f"Expected `threshold` to be a finite number, got {self.threshold!r}")
        if not isinstance(self.above, bool):
            raise ValueError(f"Expected `above` to be a bool, got {self.above!r}")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"Expected `patience` to be a positive int, got {self.patience!r}")
        if not _is_real(self.margin) or not math.isfinite(self.margin) or self.margin < 0:
            raise ValueError(f"Expected `margin` to be a finite number >= 0, got {self.margin!r}")
        if not isinstance(self.warning, type) or not issubclass(self.warning, QKMonitorWarning):
            raise ValueError(f"Expected `warning` to be a subclass of qkmonitor.QKMonitorWarning, got {self.warning!r}")
        for field_name in ("meaning", "advice"):
            if not isinstance(getattr(self, field_name), str):
                raise ValueError(f"Expected `{field_name}` to be a string, got {getattr(self, field_name)!r}")
        if not isinstance(self.also, tuple) or not all(isinstance(c, Condition) for c in self.also):
            raise ValueError(f"Expected `also` to be a tuple of Condition, got {self.also!r}")
        if not isinstance(self.per_head, bool):
            raise ValueError(f"Expected `per_head` to be a bool, got {self.per_head!r}")

    def replace(self, **changes) -> AlertRule:
        """A copy with some fields changed, e.g. ``KAPPA_RULE.replace(threshold=0.9)``."""
        return dataclasses.replace(self, **changes)

    def crossed(self, value: float) -> bool:
        return value >= self.threshold if self.above else value <= self.threshold

    def recovered(self, value: float) -> bool:
        if self.above:
            return value < self.threshold - self.margin
        return value > self.threshold + self.margin

    def describe(self) -> str:
        side = ">=" if self.above else "<="
        return " and ".join([f"{self.metric} {side} {self.threshold:g}", *(c.describe() for c in self.also)])

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric, *(c.metric for c in self.also))


KAPPA_RULE = AlertRule(
    name="kappa",
    metric="kappa",
    threshold=0.8,
    above=True,
    patience=2,
    margin=0.05,
    warning=OverLocalizationWarning,
    meaning="the head's QK spectrum is concentrated on one direction (over-localized attention)",
    advice="lower the learning rate, add QK-norm or sigma-reparametrization, or lengthen warmup",
)


ENTROPY_COLLAPSE_RULE = AlertRule(
    name="entropy_collapse",
    metric="entropy_norm",
    threshold=0.1,
    above=False,
    patience=2,
    margin=0.05,
    warning=EntropyCollapseWarning,
    meaning="the head's attention is near one-hot (normalized entropy close to 0)",
    advice="lower the learning rate, add QK-norm or sigma-reparametrization, or check for a "
    "runaway query/key scale",
)

LOGIT_GROWTH_RULE = AlertRule(
    name="logit_growth",
    metric="max_logit",
    threshold=50.0,
    above=True,
    patience=2,
    margin=5.0,
    warning=LogitGrowthWarning,
    meaning="the largest pre-softmax attention logit is large enough to saturate the softmax "
    "(attention-logit growth, Dehghani et al. 2023; Wortsman et al. 2023)",
    advice="add QK-norm, lower the learning rate, or use weight decay on the query/key projections",
)


RANK_COLLAPSE_RULE = AlertRule(
    name="rank_collapse",
    metric="hidden_collapse",
    threshold=1e-3,
    above=False,
    patience=2,
    margin=1e-3,
    warning=RankCollapseWarning,
    meaning="the block's token representations have collapsed to (nearly) one vector: "
    "||X - 1 mean(X)||_F / ||X||_F is close to 0 (rank collapse, Dong et al. 2021)",
    advice="check the residual (skip) connections and the normalization, lower the depth or the "
    "learning rate",
    per_head=False,
)

MALIGNANT_COLLAPSE_RULE = AlertRule(
    name="malignant_collapse",
    metric="attn_entropy_norm",
    threshold=0.1,
    above=False,
    patience=2,
    margin=0.05,
    warning=MalignantCollapseWarning,
    meaning="the head's attention is near one-hot and its attention matrix is low-rank: most "
    "queries attend the same few keys (sparse and low-rank, the malignant kind; sparse but "
    "identity-like attention is benign — Qi et al. 2025)",
    advice="lower the learning rate, add QK-norm or sigma-reparametrization, or lengthen warmup",
    also=(Condition("attn_erank_norm", 0.2, above=False, margin=0.05),),
)


@dataclass(frozen=True)
class Alert:
    """A rule that fired for one (layer, head) at one step."""

    rule: AlertRule
    layer: int
    layer_name: str
    head: int
    value: float
    step: int

    def message(self, lr: float | None = None) -> str:
        """The user-facing sentence: where, what value, which threshold, when, and what to try."""
        where = f"layer {self.layer} ({self.layer_name})" if self.layer_name else f"layer {self.layer}"
        if self.rule.per_head:
            where += f", head {self.head}"
        lr_text = f", learning rate {lr:.3g}" if lr is not None else ""
        return (
            f"[qkmonitor:{self.rule.name}] {where}: {self.rule.metric} = "
            f"{self.value:.4g} (threshold {self.rule.describe()}, {self.rule.patience} probe(s) in a row) "
            f"at step {self.step}{lr_text}: {self.rule.meaning}. Try: {self.rule.advice}."
        )


class AlertTracker:
    """Patience and hysteresis state for a set of rules over (layer, head) cells.

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

    def update(self, values: dict[str, list[Tensor]], step: int, layer_names: list[str]) -> list[Alert]:
        """Feed one probe event; return the alerts that fire now.

        Args:
            values: metric name -> one (num_heads,) tensor per layer (a (layers, heads) tensor
                works too). Rules whose metric is absent are skipped.
            step: the global step of this probe.
            layer_names: the layers' module names, by index.
        """
        fired: list[Alert] = []
        for rule in self.rules:
            if not all(metric in values for metric in rule.metrics):
                continue
            grids = [values[metric] for metric in rule.metrics]
            for layer, heads in enumerate(zip(*grids)):
                rows = [h.detach().double().cpu().reshape(-1).tolist() for h in heads]
                for head, cell in enumerate(zip(*rows)):
                    if self._step_cell(rule, layer, head, cell):
                        self.counts[rule.name] += 1
                        fired.append(Alert(rule, layer, layer_names[layer], head, cell[0], step))
        return fired

    def _step_cell(self, rule: AlertRule, layer: int, head: int, cell: tuple[float, ...]) -> bool:
        if any(math.isnan(v) for v in cell):
            return False
        value, others = cell[0], cell[1:]
        key = f"{rule.name}/{layer}/{head}"
        if key in self._active:
            if rule.recovered(value) or any(c.recovered(v) for c, v in zip(rule.also, others)):
                self._active.discard(key)
                self._streak.pop(key, None)
            return False
        crossed = rule.crossed(value) and all(c.crossed(v) for c, v in zip(rule.also, others))
        streak = self._streak.get(key, 0) + 1 if crossed else 0
        if streak >= rule.patience:
            self._active.add(key)
            self._streak.pop(key, None)
            return True
        if streak:
            self._streak[key] = streak
        else:
            self._streak.pop(key, None)
        return False

    def state_dict(self) -> dict:
        return {"streak": dict(self._streak), "active": sorted(self._active), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self._streak = dict(state.get("streak", {}))
        self._active = set(state.get("active", []))
        self.counts.update(state.get("counts", {}))
