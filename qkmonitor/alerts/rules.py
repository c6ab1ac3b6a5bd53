"""Alert rules: a level, optionally a trend, optionally joint conditions and a loss gate.

A rule watches one metric per (layer, head). Its test at a probe is a level (``value >= threshold``
or ``<=``), optionally a trend (the value growing by a factor ``growth`` per ``window`` steps, or
since the run's first probe) and optionally joint conditions on other metrics of the same
(layer, head), another monitor's included, and on the run's signals (:data:`RUN_SIGNALS`: the
training loss's, the output logits'). The warning classes a rule raises are here too.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from qkmonitor.measures.catalogue import CATALOGUE
from qkmonitor.validation import (
    check_bool,
    check_non_negative_int,
    check_positive_int,
    check_real,
    is_int,
    is_real,
)

__all__ = [
    "ALERT_ACTIONS",
    "LEARNING_WINDOW",
    "LOSS_SIGNALS",
    "LOSS_SMOOTHING",
    "RUN_SIGNALS",
    "AlertRule",
    "Condition",
    "EntropyCollapseWarning",
    "LogitGrowthWarning",
    "LowRankUpdateWarning",
    "MalignantCollapseWarning",
    "OverLocalizationWarning",
    "QKMonitorWarning",
    "RankCollapseWarning",
    "advice_for",
    "channel_of",
    "run_signals",
]

ALERT_ACTIONS = ("warn", "stop", "raise")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


class QKMonitorWarning(UserWarning):
    """Base class of every qkmonitor alert."""


class OverLocalizationWarning(QKMonitorWarning):
    """The QK spectrum of a head concentrates on one direction (rule ``kappa``)."""


class EntropyCollapseWarning(QKMonitorWarning):
    """A head's attention is near one-hot (rule ``entropy_collapse``)."""


class LogitGrowthWarning(QKMonitorWarning):
    """A head's attention logits grow without bound (rule ``logit_growth``)."""


class LowRankUpdateWarning(QKMonitorWarning):
    """The updates of a head's query-key weights concentrate on one direction: the signature of a
    consistently biased error in the gradients, e.g. low-precision attention's rounding (rule
    ``low_rank_updates``)."""


class RankCollapseWarning(QKMonitorWarning):
    """A block's residual stream collapses towards rank one (rule ``rank_collapse``)."""


class MalignantCollapseWarning(QKMonitorWarning):
    """A head's attention is sparse *and* low-rank (rule ``malignant_collapse``)."""


def _check_test(owner: object) -> None:
    """Checks shared by :class:`Condition` and :class:`AlertRule`: each names the field."""
    if not isinstance(owner.metric, str) or not owner.metric:
        raise ValueError(f"Expected `metric` to be a metric name, got {owner.metric!r}")
    check_real("threshold", owner.threshold)
    check_bool("above", owner.above)
    check_real("margin", owner.margin, at_least=0)
    if owner.growth is not None and (
        not is_real(owner.growth) or not math.isfinite(owner.growth) or owner.growth <= 1
    ):
        raise ValueError(
            f"Expected `growth` to be None or a finite factor > 1, got {owner.growth!r}"
        )
    if owner.window is not None and not is_int(owner.window, 1):
        raise ValueError(
            f"Expected `window` to be None or a positive int (steps), got {owner.window!r}"
        )


#: Steps of training loss averaged for :attr:`AlertRule.learning_drop` (one batch's loss is noisy).
LOSS_SMOOTHING = 10

#: Values of the run, not of a head, that a rule's conditions may read like a metric (the same at
#: every (layer, head)); from the training loss the monitors are handed, at each probe.
RUN_SIGNALS = {
    "loss_change": (
        f"the training loss's mean over the last {LOSS_SMOOTHING} steps over its mean the "
        f"{LOSS_SMOOTHING} steps before (1: flat; above 1: rising)"
    ),
    "loss_vs_best": (
        f"the training loss's mean over the last {LOSS_SMOOTHING} steps over the lowest such mean "
        "at an earlier probe (1: at its best; above 1: worse than it has been)"
    ),
    "output_lse_rms": (
        "the RMS over the probed positions of the model's output log-partition log sum_v e^x_v "
        "(what the z-loss keeps near 0), from AttentionEntropyMonitor's probe"
    ),
    "output_logit_max": (
        "the largest |output logit| of the probed forward, from AttentionEntropyMonitor's probe"
    ),
}
#: the run signals computed from the training loss (the others are measured by a monitor)
LOSS_SIGNALS = ("loss_change", "loss_vs_best")
#: The comparison span of :attr:`AlertRule.learning_drop` for a rule without a ``window``.
LEARNING_WINDOW = 30


def channel_of(metric: str) -> str:
    """The evidence channel ``metric`` comes from, as an alert names it: its dashboard family
    (:data:`~qkmonitor.measures.catalogue.CATALOGUE`; ``"attention"``, ``"optimizer"``, ``"QK
    spectrum"``, ...), or ``"training loss"`` or ``"output logits"`` for a run signal."""
    if metric in LOSS_SIGNALS:
        return "training loss"
    if metric in RUN_SIGNALS:
        return "output logits"
    spec = next((spec for spec in CATALOGUE if spec.name == metric), None)
    family = spec.family if spec is not None else metric
    return _CHANNELS.get(family, family)


#: dashboard families that name a channel in other words
_CHANNELS = {"attention entropy": "attention", "optimizer's view": "optimizer"}


def _mean_loss(losses: Sequence[tuple[int, float]], step: int) -> float | None:
    """Mean finite loss of the steps in ``(step - LOSS_SMOOTHING, step]``; None if there is none
    (a non-finite loss is no evidence of learning)."""
    values = [v for s, v in losses if step - LOSS_SMOOTHING < s <= step]
    if not values or not all(math.isfinite(v) for v in values):
        return None
    return sum(values) / len(values)


def run_signals(
    losses: Sequence[tuple[int, float]], step: int, best: float | None
) -> tuple[dict[str, float], float | None]:
    """:data:`RUN_SIGNALS` at ``step`` from the recent ``losses`` (``(step, loss)``) and the
    lowest earlier probe's mean ``best``, and the loss's mean at ``step`` (None without one);
    a signal is NaN where the loss does not say (too few steps, a non-finite loss, no earlier
    probe)."""
    now = _mean_loss(losses, step)
    then = _mean_loss(losses, step - LOSS_SMOOTHING)
    ratio = math.nan if now is None or then is None or not then > 0 else now / then
    vs_best = math.nan if now is None or best is None or not best > 0 else now / best
    return {"loss_change": ratio, "loss_vs_best": vs_best}, now


def _crossed(test: Condition | AlertRule, value: float) -> bool:
    return value >= test.threshold if test.above else value <= test.threshold


def _recovered(test: Condition | AlertRule, value: float) -> bool:
    return (
        value < test.threshold - test.margin if test.above else value > test.threshold + test.margin
    )


def _grown(
    test: Condition | AlertRule, value: float, reference: tuple[int, float] | None, step: int
) -> bool:
    """Whether ``value`` at ``step`` grew by the factor ``growth`` (shrank, for a ``below`` test)
    from ``reference = (step, value)``.

    Over a ``window``, growth is a rate: the factor per ``window`` steps,
    ``(value / ref) ** (window / (step - ref_step))``, so the test means the same at any probe
    interval (the reference is the newest value at least ``window`` steps old). With
    ``window=None`` it is the plain factor since the run's first value. Without a positive
    reference there is no ratio to speak of: False.
    """
    if test.growth is None:
        return True
    if reference is None or not reference[1] > 0 or not value > 0:
        return False
    ratio = value / reference[1]
    if test.window is not None:
        ratio **= test.window / (step - reference[0])
    return ratio >= test.growth if test.above else ratio <= 1 / test.growth


def _describe(test: Condition | AlertRule) -> str:
    text = f"{test.metric} {'>=' if test.above else '<='} {test.threshold:g}"
    if test.growth is not None:
        span = f"per {test.window} steps" if test.window is not None else "since the first probe"
        text += f" and {'×' if test.above else '÷'}{test.growth:g} {span}"
    return text


@dataclass(frozen=True)
class Condition:
    """A further condition a rule needs at the same (layer, head): ``metric`` past ``threshold``
    (and, with ``growth``, grown by that factor over ``window`` steps, like :class:`AlertRule`).

    Recovery of either the rule's own metric or this one (past ``margin``) ends the alert.
    """

    metric: str
    threshold: float
    above: bool
    margin: float = 0.0
    growth: float | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        _check_test(self)

    def crossed(
        self, value: float, reference: tuple[int, float] | None = None, step: int = 0
    ) -> bool:
        """Past the threshold at ``step`` and, with ``growth``, grown from ``reference``
        (``(step, value)``, see :meth:`AlertTracker.reference`)."""
        return _crossed(self, value) and _grown(self, value, reference, step)

    def recovered(self, value: float) -> bool:
        return _recovered(self, value)

    def describe(self) -> str:
        return _describe(self)


@dataclass(frozen=True)
class AlertRule:
    """One alert rule: a level, optionally a trend, optionally joint conditions.

    The rule's test at a (layer, head) and probe is: ``metric`` past ``threshold`` and, with
    ``growth``, ``metric`` growing at least that fast: by the factor ``growth`` per ``window``
    steps, measured from the newest value at least ``window`` steps old and scaled to ``window``
    steps, so that the probe interval does not matter (``window=None``: by the factor ``growth``
    since the run's first value, "growth from its own start"); for a ``below`` rule, shrinking by
    that factor; and every condition of ``also`` holds at the same (layer, head). It fires when the
    test holds for ``patience`` consecutive probes at or after step ``grace_steps``.

    Attributes:
        name: rule name, used in tags (``{prefix}/alerts/{name}``) and messages.
        metric: the per-head metric it watches.
        threshold: the level.
        above: fire when ``value >= threshold`` (True) or ``value <= threshold`` (False).
        patience: consecutive probe events the test must hold before it fires.
        margin: recovery needs ``value < threshold - margin`` (above) or
            ``value > threshold + margin`` (below); a trend never ends an alert by itself.
        warning: the warning class raised, warned or named.
        meaning: what firing says about attention.
        advice: what to try; ``{qk_norm}`` in it becomes how to add QK-norm to the kind of model
            the alert is about (:attr:`Alert.layer_kind`), ``{rounding}`` how to take the bias
            out of its low-precision attention (:func:`advice_for`).
        also: further conditions that must hold at the same time (e.g. low rank *and* sparse).
        per_head: False for metrics of a whole layer (one value per layer, no head).
        growth: the factor per ``window`` steps the value must grow by (None: a level rule).
        window: the steps ``growth`` is a rate over (None: the factor since the run's first probe).
        grace_steps: no firing before this step (e.g. the warmup); values still count as history.
        skip_qk_norm: say nothing about layers with QK-norm. Their q and k are normalized after
            the projections, so the weights' spectrum does not bound their logits.
        evidence: what the rule's calibration measured, quoted in the message.
        learning_drop: stay quiet while the model is learning: while the training loss (mean
            of the last :data:`LOSS_SMOOTHING` steps) is at least this fraction below what it was
            ``learning_window`` steps earlier. A head
            that sharpens while the loss falls is learning (induction heads form so); one that
            sharpens while the loss stalls or rises is not. None: the loss is not consulted.
            Needs the loss (:meth:`MonitorEngine.observe_loss`); without it the rule fires on
            its own test alone.
        learning_window: the steps ``learning_drop`` compares over (default: ``window``, or
            :data:`LEARNING_WINDOW` for a rule without one).
        solved_fraction: also quiet while the training loss is at most this fraction of the
            run's first loss (mean of its first :data:`LOSS_SMOOTHING` steps): a model that has
            solved its task (a copy task at loss 0.001) has sharp heads and huge logits because
            that is the solution, and a loss near 0 no longer falls by a steady fraction. It
            may be set without ``learning_drop``: then only a solved run is exempt.
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
    growth: float | None = None
    window: int | None = None
    grace_steps: int = 0
    skip_qk_norm: bool = False
    evidence: str = ""
    learning_drop: float | None = None
    learning_window: int | None = None
    solved_fraction: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(
                "Expected `name` to be a non-empty tag-safe string (letters, digits, '_', '.', "
                f"'-'), got {self.name!r}"
            )
        _check_test(self)
        check_positive_int("patience", self.patience)
        if not isinstance(self.warning, type) or not issubclass(self.warning, QKMonitorWarning):
            raise ValueError(
                "Expected `warning` to be a subclass of qkmonitor.QKMonitorWarning, got "
                f"{self.warning!r}"
            )
        for field_name in ("meaning", "advice", "evidence"):
            if not isinstance(getattr(self, field_name), str):
                raise ValueError(
                    f"Expected `{field_name}` to be a string, got {getattr(self, field_name)!r}"
                )
        if not isinstance(self.also, tuple) or not all(isinstance(c, Condition) for c in self.also):
            raise ValueError(f"Expected `also` to be a tuple of Condition, got {self.also!r}")
        for field_name in ("per_head", "skip_qk_norm"):
            check_bool(field_name, getattr(self, field_name))
        check_non_negative_int("grace_steps", self.grace_steps)
        if self.learning_drop is not None and (
            not is_real(self.learning_drop) or not 0 < self.learning_drop < 1
        ):
            raise ValueError(
                "Expected `learning_drop` to be None or a fraction in (0, 1), got "
                f"{self.learning_drop!r}"
            )
        if self.learning_window is not None and not is_int(self.learning_window, 1):
            raise ValueError(
                f"Expected `learning_window` to be None or a positive int (steps), got "
                f"{self.learning_window!r}"
            )
        if self.solved_fraction is not None and (
            not is_real(self.solved_fraction) or not 0 < self.solved_fraction < 1
        ):
            raise ValueError(
                f"Expected `solved_fraction` to be None or a fraction in (0, 1), got "
                f"{self.solved_fraction!r}"
            )

    def replace(self, **changes) -> AlertRule:
        """A copy with some fields changed, e.g. ``KAPPA_RULE.replace(threshold=0.3)``."""
        return dataclasses.replace(self, **changes)

    def crossed(
        self, value: float, reference: tuple[int, float] | None = None, step: int = 0
    ) -> bool:
        """The rule's own test (level and trend) at one probe; ``also`` is checked by the
        tracker."""
        return _crossed(self, value) and _grown(self, value, reference, step)

    def recovered(self, value: float) -> bool:
        return _recovered(self, value)

    def describe(self) -> str:
        text = " and ".join([_describe(self), *(c.describe() for c in self.also)])
        unless = []
        if self.learning_drop is not None:
            unless.append(f"fell by {self.learning_drop:.0%} or more over {self.loss_window} steps")
        if self.solved_fraction is not None:
            unless.append(f"is below {self.solved_fraction:.0%} of its first value")
        if unless:
            text += ", unless the training loss " + " or ".join(unless)
        return text

    @property
    def loss_window(self) -> int:
        """The steps over which :attr:`learning_drop` compares the loss."""
        return self.learning_window or self.window or LEARNING_WINDOW

    def learning(
        self, losses: Sequence[tuple[int, float]], step: int, first: float | None = None
    ) -> bool:
        """Whether the training loss ``losses`` (``(step, loss)``, oldest first) fell by
        ``learning_drop`` over the window ending at ``step``, or (``solved_fraction``) is that
        small a part of the run's ``first`` loss; False without the loss to say."""
        if not self.reads_loss:
            return False
        now = _mean_loss(losses, step)
        if now is None:
            return False
        if (
            self.solved_fraction is not None
            and first is not None
            and first > 0
            and now <= self.solved_fraction * first
        ):
            return True
        if self.learning_drop is None:
            return False
        then = _mean_loss(losses, step - self.loss_window)
        return then is not None and now <= (1 - self.learning_drop) * then

    @property
    def reads_loss(self) -> bool:
        """Whether the rule's gate reads the training loss (``learning_drop`` or
        ``solved_fraction``; a solved run alone may gate a rule that does not wait for the loss
        to stop falling)."""
        return self.learning_drop is not None or self.solved_fraction is not None

    @property
    def tests(self) -> tuple[AlertRule | Condition, ...]:
        """The rule's own test first, then its conditions."""
        return (self, *self.also)

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(t.metric for t in self.tests)


def rounding_advice(layer_kind: str) -> str:
    """How to take the bias out of low-precision attention in a layer of ``layer_kind``: the
    bundled models' switch (docs/kernel.md, "Rounding of the softmax weights"), what to change
    in anyone else's attention."""
    if layer_kind.startswith("qkmonitor."):
        return (
            "TransformerConfig(attention_rounding='unbiased') (or 'float32'), which divides P.V "
            "by the sum of the rounded weights"
        )
    return (
        "in the attention's low-precision path, normalize P.V by the sum of the rounded softmax "
        "weights, or compute P.V in float32 (attention outside autocast, or a float32 "
        "scaled_dot_product_attention)"
    )


def advice_for(advice: str, layer_kind: str) -> str:
    """``advice`` with its placeholders filled for a layer of ``layer_kind``: ``{qk_norm}``
    (:func:`qk_norm_advice`) and ``{rounding}`` (:func:`rounding_advice`)."""
    return advice.replace("{qk_norm}", qk_norm_advice(layer_kind)).replace(
        "{rounding}", rounding_advice(layer_kind)
    )


def qk_norm_advice(layer_kind: str) -> str:
    """How to add QK-norm to a layer of ``layer_kind`` (:attr:`AttentionLayer.kind`): the bundled
    models' switch for qkmonitor's own attention, what to change for anyone else's."""
    if layer_kind.startswith("qkmonitor."):
        return "TransformerConfig(qk_norm=True)"
    if layer_kind == "torch.nn.MultiheadAttention":
        return (
            "nn.MultiheadAttention has no switch for it: an attention module that normalizes q "
            "and k after their projections"
        )
    if layer_kind.startswith("transformers."):
        return (
            "an RMSNorm on q and k after their projections, in the model's attention code, as "
            "transformers' Qwen3 and OLMo 2 attention have"
        )
    if layer_kind:
        return "a LayerNorm or RMSNorm on q and k after their projections, in the model's code"
    return (
        "normalize q and k after their projections; qkmonitor's bundled models: "
        "TransformerConfig(qk_norm=True)"
    )
