"""Alert rules: when a metric crosses a level, or grows too fast, for long enough, say so once.

A rule watches one metric per (layer, head). Its test at a probe is a level (``value >= threshold``
or ``<=``), optionally a trend (the value growing by a factor ``growth`` per ``window`` steps, or
since the run's first probe) and optionally joint conditions on other metrics of the same monitor
at the same (layer, head) (sharp *and* growing, sparse *and* low-rank). It *fires* when the test
has held for ``patience`` consecutive probe events, then stays quiet for that (rule, layer, head)
until the value *recovers* past ``threshold ∓ margin`` (hysteresis), after which it may fire
again. NaN values neither count towards the patience nor recover, nor enter a trend.

The default rules are calibrated on ``benchmarks/instability.py`` (see docs/alerts.md, "Does it
warn in time?"); each one quotes that evidence in its message.

What happens when a rule fires (warn, stop, raise, ``on_alert``) is the engine's business; this
module only keeps the state (streaks, active alerts, the recent values trends need), which
survives a resume through ``state_dict``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from torch import Tensor

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
    "DEFAULT_RULES",
    "ENTROPY_COLLAPSE_RULE",
    "FAST_UPDATES_RULE",
    "KAPPA_RULE",
    "LOGIT_BURST_RULE",
    "LOGIT_GROWTH_RULE",
    "LOGIT_JUMP_RULE",
    "LOGIT_PLATEAU_RULE",
    "LOSS_SIGNALS",
    "MALIGNANT_COLLAPSE_RULE",
    "RANK_COLLAPSE_RULE",
    "RUN_SIGNALS",
    "SPECTRAL_GROWTH_RULE",
    "Alert",
    "AlertRule",
    "AlertTracker",
    "Condition",
    "EntropyCollapseWarning",
    "LogitGrowthWarning",
    "MalignantCollapseWarning",
    "OverLocalizationWarning",
    "QKMonitorWarning",
    "RankCollapseWarning",
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
            the alert is about (:attr:`Alert.layer_kind`).
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
            that is the solution, and a loss near 0 no longer falls by a steady fraction.
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
        if self.learning_drop is not None:
            text += (
                f", unless the training loss fell by {self.learning_drop:.0%} or more over "
                f"{self.loss_window} steps"
            )
            if self.solved_fraction is not None:
                text += f" or is below {self.solved_fraction:.0%} of its first value"
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
        if self.learning_drop is None:
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
        then = _mean_loss(losses, step - self.loss_window)
        return then is not None and now <= (1 - self.learning_drop) * then

    @property
    def tests(self) -> tuple[AlertRule | Condition, ...]:
        """The rule's own test first, then its conditions."""
        return (self, *self.also)

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(t.metric for t in self.tests)


# The defaults below are fitted on the calibration set of ``benchmarks/instability.py`` (six
# task/architecture families, warmup and none, a learning-rate sweep each): calibration = seeds 0
# and 1 of every family, validation = seed 2, never seen while fitting. docs/alerts.md ("Does it
# warn in time?") has the per-run results of both sets; ``evidence`` quotes the calibration figures
# in every message.

_SWEEP = "benchmarks/instability.py"
_REMEDY = (
    "lower the peak learning rate or lengthen warmup; add QK-norm ({qk_norm}) or "
    "sigma-reparametrization; weight decay on the query/key projections"
)


def _qk_norm_advice(layer_kind: str) -> str:
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


#: Learning, not failing: the trend rules stay quiet while the training loss falls by 5 % per 10
#: steps, or is below a tenth of the run's first loss (the task is solved; its heads are sharp
#: because that is the solution). On the calibration set this alone took the healthy runs alerted
#: from 4 to 0 (induction-head formation), and lost no failed run flagged in time.
_LEARNING = {"learning_drop": 0.05, "learning_window": 10, "solved_fraction": 0.1}

KAPPA_RULE = AlertRule(
    name="kappa",
    metric="kappa",
    threshold=0.2,
    above=True,
    patience=1,
    margin=0.05,
    warning=OverLocalizationWarning,
    meaning=(
        "the head's query-key spectrum is concentrating on one direction fast (kappa = sigma_1 / "
        "sum sigma_i of W_QK rising), its largest logit per unit input (sigma_1 * scale) is at "
        "least 1, and the loss is not improving: the weight-side precursor of attention-logit "
        "growth"
    ),
    advice=_REMEDY,
    also=(Condition("qk_spectral_norm", 1.0, above=True),),
    growth=2.5,
    window=30,
    skip_qk_norm=True,
    evidence=(
        f"fitted on the calibration set of {_SWEEP} (round 1: seed 0 of char-LM, recall, induction "
        "and seq2seq; kept in round 2), where it fired on failed runs and on no healthy one. "
        "Without the loss gate it fired on healthy induction-head formation; without the "
        "qk_spectral_norm >= 1 condition on examples/hf_llama.py at step 40, where kappa rose "
        "x3.5 while sigma_1(W_QK) * scale was 0.1 and attention nearly uniform"
    ),
    **_LEARNING,
)

LOGIT_GROWTH_RULE = AlertRule(
    name="logit_growth",
    metric="max_logit",
    threshold=30.0,
    above=True,
    patience=1,
    margin=5.0,
    warning=LogitGrowthWarning,
    meaning=(
        "the head's largest attention logit is growing exponentially (attention-logit growth, "
        "Dehghani et al. 2023; Wortsman et al. 2023) while the loss is not improving: the softmax "
        "is saturating and the loss will follow"
    ),
    advice=_REMEDY,
    growth=8.0,
    window=20,
    evidence=(
        f"fitted on the calibration set of {_SWEEP}. Healthy induction heads grow their logits x7 "
        "to x10 per 20 steps while the loss falls: the loss gate, not the rate, tells them apart. "
        "At the former level 20 it fired on a healthy vision run whose head went from 2.3 to 21 "
        "during a transient loss spike; at 30, on no healthy run. A lower rate (x3 or x4) added 3 "
        "to 6 healthy runs alerted and one failed run in time"
    ),
    **_LEARNING,
)

LOGIT_BURST_RULE = AlertRule(
    name="logit_burst",
    metric="max_logit",
    threshold=50.0,
    above=True,
    patience=1,
    margin=10.0,
    warning=LogitGrowthWarning,
    meaning=(
        "the head's largest attention logit jumped past 50 by a factor of 10 or more within 10 "
        "steps: an immediate blow-up, typically at a high learning rate without warmup, before "
        "any trend can be measured"
    ),
    advice=_REMEDY,
    growth=10.0,
    window=10,
    evidence=(
        f"fitted on the calibration set of {_SWEEP}: without warmup, 15 of the 23 failing runs "
        "jumped x10 to x440 within their first 10 steps, to 22-1150; healthy ones at most x7, to "
        "37 (induction at lr 0.03). At the former level 100 and x20 it missed char-LM at lr 0.03 "
        "(x10-x12, to 57-67). It has no loss gate (the loss may still be falling from its first "
        "value); it fired on one healthy run, at lr 0.1, which blew up at step 10 and recovered, "
        "while the same run of the other seed failed"
    ),
)

LOGIT_JUMP_RULE = AlertRule(
    name="logit_jump",
    metric="max_logit",
    threshold=20.0,
    above=True,
    patience=1,
    margin=5.0,
    warning=LogitGrowthWarning,
    meaning=(
        "the head's largest attention logit rose past 20 by a factor of 5 or more within 10 steps "
        "while the loss was not falling: a fast early rise that learning does not explain"
    ),
    advice=_REMEDY,
    growth=5.0,
    window=10,
    evidence=(
        f"fitted on the calibration set of {_SWEEP}: vision runs without warmup at lr 0.01-0.03 "
        "jumped x8 to x34 at step 10 (to 21-89) while their loss rose, and separated 50 steps "
        "later; no other rule saw them. Healthy induction heads rise as fast, while their loss "
        "falls: the loss gate tells them apart"
    ),
    **_LEARNING,
)

FAST_UPDATES_RULE = AlertRule(
    name="fast_updates",
    metric="max_logit",
    threshold=30.0,
    above=True,
    patience=1,
    margin=5.0,
    warning=LogitGrowthWarning,
    meaning=(
        "the optimizer moved the head's query projection by 8 % or more of its RMS in one step "
        "while the head's largest attention logit is already past 30: the updates are driving "
        "the logits up faster than learning needs (update-to-weight ratio and logit growth, "
        "Wortsman et al. 2023)"
    ),
    advice=(
        "lower the peak learning rate or lengthen warmup; check AdamW's epsilon (too small "
        "amplifies the updates of weights with small gradients); add QK-norm ({qk_norm})"
    ),
    also=(Condition("q_update_ratio", 0.08, above=True),),
    evidence=(
        f"fitted on the calibration set of {_SWEEP} (round 3: seeds 0-2 of six families, AdamW): "
        "it flagged 3 failed runs in time that no attention-only rule did (induction at lr 0.1 "
        "with warmup, whose logits grew while the loss still fell), and fired on no healthy run "
        "the other rules had not; healthy heads with logits past 20 reached a q_update_ratio of "
        "at most 0.069 (induction at lr 0.03). It has no loss gate: those runs failed while "
        "their loss was falling fastest. Fitted with AdamW: Muon's and SGD's update ratios have "
        "other typical sizes"
    ),
)

LOGIT_PLATEAU_RULE = AlertRule(
    name="logit_plateau",
    metric="max_logit",
    threshold=150.0,
    above=True,
    patience=1,
    margin=25.0,
    warning=LogitGrowthWarning,
    meaning=(
        "the head's largest attention logit is past 150 (its softmax is saturated: the gradient "
        "through it has all but vanished) and the training loss is no lower than at an earlier "
        "probe: the logits kept growing after the loss stopped improving"
    ),
    advice=_REMEDY,
    also=(Condition("loss_vs_best", 1.0, above=True),),
    evidence=(
        f"fitted on the calibration set of {_SWEEP} (round 3): it flagged 2 failed runs in time "
        "that no other rule did (char-LM at lr 0.03 with warmup, whose loss stalled 100 steps "
        "before it separated while the logits grew past 150), and fired on no healthy run the "
        "other rules had not. At 100 it fired on 2 healthy recall runs whose loss improved by "
        "under 2 % a probe; solved runs (loss below a tenth of its first) are exempt"
    ),
    **_LEARNING,
)

#: Not a default: on the calibration set of the sweep it fired on healthy induction-head formation
#: and on runs that did not fail, and flagged no failed run in time that the default rules missed;
#: it stays for users who want to see a head go one-hot (replace it into ``alerts=``).
ENTROPY_COLLAPSE_RULE = AlertRule(
    name="entropy_collapse",
    metric="entropy_norm",
    threshold=0.05,
    above=False,
    patience=1,
    margin=0.05,
    warning=EntropyCollapseWarning,
    meaning=(
        "the head's attention is near one-hot and still sharpening (logits growing): entropy "
        "collapse under logit growth. A sharp head with steady logits (previous-token, induction) "
        "is not flagged"
    ),
    advice=_REMEDY,
    also=(Condition("max_logit", 10.0, above=True, growth=2.0, window=30),),
    evidence=(
        f"in {_SWEEP} (validation set), it fired on 25 of 27 failed runs but also on 7 that did "
        "not fail, 6 of them healthy, mostly induction-head formation; on the calibration set it "
        "flagged no failed run in time that the default rules missed"
    ),
)


RANK_COLLAPSE_RULE = AlertRule(
    name="rank_collapse",
    metric="hidden_collapse",
    threshold=1e-3,
    above=False,
    patience=2,
    margin=1e-3,
    warning=RankCollapseWarning,
    meaning=(
        "the block's token representations have collapsed to (nearly) one vector: "
        "||X - 1 mean(X)||_F / ||X||_F is close to 0 (rank collapse, Dong et al. 2021)"
    ),
    advice=(
        "check the residual (skip) connections and the normalization, lower the depth or the "
        "learning rate"
    ),
    per_head=False,
    evidence=(
        f"in {_SWEEP} no run came near (lowest hidden_collapse 0.15), so it fired on none: the "
        "logit-growth instability is not a rank collapse; Dong et al. 2021 show the collapse "
        "without skip connections (examples/rank_collapse.py)"
    ),
)

MALIGNANT_COLLAPSE_RULE = AlertRule(
    name="malignant_collapse",
    metric="attn_entropy_norm",
    threshold=0.1,
    above=False,
    patience=2,
    margin=0.05,
    warning=MalignantCollapseWarning,
    meaning=(
        "the head's attention is near one-hot and its attention matrix is low-rank: most "
        "queries attend the same few keys (sparse and low-rank, the malignant kind; sparse but "
        "identity-like attention is benign — Qi et al. 2025)"
    ),
    advice=_REMEDY,
    also=(Condition("attn_erank", 1.5, above=False, margin=0.5),),
    evidence=(
        f"in {_SWEEP}, solved vision runs (every query reads the two marked cells: sparse and "
        "low-rank, yet correct) fired it until the loss gate was added; sparse heads "
        "(attn_entropy_norm <= 0.1) of runs that ended within 10 % of the best loss had "
        "attn_erank down to 3.1 (recall at lr 0.01, which fired under the former bound "
        "attn_erank_norm <= 0.2) and, for one probe, 1.8 (recall at lr 0.03); a bound in "
        "directions (about one) means the same at any probe size. It fired only after the loss "
        "had separated: it confirms rather than warns"
    ),
    **_LEARNING,
)

#: An opt-in rule on Zhai et al.'s sigmaReparam quantity (not a default: on the sweep it flagged
#: fewer failed runs in time than ``kappa`` and nothing that ``kappa`` and ``logit_growth`` missed).
SPECTRAL_GROWTH_RULE = AlertRule(
    name="spectral_growth",
    metric="qk_spectral_norm",
    threshold=1.0,
    above=True,
    patience=1,
    margin=0.1,
    warning=LogitGrowthWarning,
    meaning=(
        "the head's largest possible logit per unit input (sigma_1(W_QK) * scale, Zhai et al. "
        "2023's sigmaReparam quantity) is growing fast: nothing in the weights stops the logits "
        "from following"
    ),
    advice=_REMEDY,
    growth=4.0,
    window=30,
    skip_qk_norm=True,
    evidence=(
        f"in {_SWEEP}, it fired on 4 of the 5 failed runs (2 of them 20 or more steps ahead) and "
        "on no other run; kappa and logit_growth flagged the same runs as early"
    ),
)


def _trend_text(value: float, reference: tuple[int, float], step: int) -> str:
    ref_step, ref = reference
    if not ref > 0 or not value > 0:
        return ""
    ratio = value / ref
    factor = f"×{ratio:.3g}" if ratio >= 1 else f"÷{1 / ratio:.3g}"
    return f"{factor} over the last {step - ref_step} steps ({ref:.4g} at step {ref_step})"


#: Every default rule, in the order of the table in docs/alerts.md.
DEFAULT_RULES = (
    KAPPA_RULE,
    LOGIT_GROWTH_RULE,
    LOGIT_BURST_RULE,
    LOGIT_JUMP_RULE,
    FAST_UPDATES_RULE,
    LOGIT_PLATEAU_RULE,
    MALIGNANT_COLLAPSE_RULE,
    RANK_COLLAPSE_RULE,
)


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
            f"{self.rule.advice.replace('{qk_norm}', _qk_norm_advice(self.layer_kind))}.{evidence}"
        )


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
        grids = {
            m: [
                h.detach().double().cpu().reshape(-1).tolist() if isinstance(h, Tensor) else list(h)
                for h in values[m]
            ]
            for m in values
            if any(m in r.metrics for r in self.rules)
        }
        fired: list[Alert] = []
        for rule in self.rules:
            if not all(metric in grids for metric in rule.metrics):
                continue
            learning = rule.learning(losses, step, first_loss)
            for layer, heads in enumerate(zip(*(grids[m] for m in rule.metrics))):
                if rule.skip_qk_norm and layer in qk_norm_layers:
                    continue
                for head, cell in enumerate(zip(*heads)):
                    alert = self._step_cell(rule, layer, head, cell, step, learning)
                    if alert is not None:
                        self.counts[rule.name] += 1
                        fired.append(dataclasses.replace(alert, layer_name=layer_names[layer]))
        self._remember(grids, step)
        return fired

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

    def _remember(self, grids: dict[str, list[list[float]]], step: int) -> None:
        """Add this probe's finite values of the trend metrics; forget those no later probe can
        use (older than the newest one at least the longest window old)."""
        for metric in self._trend_metrics & set(grids):
            for layer, heads in enumerate(grids[metric]):
                for head, value in enumerate(heads):
                    if not math.isfinite(value):
                        continue
                    key = f"{metric}/{layer}/{head}"
                    self._start.setdefault(key, (step, value))
                    entries = [(s, v) for s, v in self._history.get(key, []) if s < step] + [
                        (step, value)
                    ]
                    old = [i for i, (s, _) in enumerate(entries) if s <= step - self._horizon]
                    self._history[key] = entries[old[-1] :] if old else entries

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
