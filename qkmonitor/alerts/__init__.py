"""Alert rules: when a metric crosses a level, or grows too fast, for long enough, say so once.

The rules and warning classes are in :mod:`.rules`, the defaults with their evidence in
:mod:`.defaults`, the alerts and their tracker in :mod:`.tracker`; everything is importable from
here.

A rule watches one metric per (layer, head). Its test at a probe is a level (``value >= threshold``
or ``<=``), optionally a trend (the value growing by a factor ``growth`` per ``window`` steps, or
since the run's first probe) and optionally joint conditions on other metrics of the same monitor
at the same (layer, head) (sharp *and* growing, sparse *and* low-rank). It *fires* when the test
has held for ``patience`` consecutive probe events, then stays quiet for that (rule, layer, head)
until the value *recovers* past ``threshold ∓ margin`` (hysteresis), after which it may fire
again. NaN values neither count towards the patience nor recover, nor enter a trend.

The default rules are calibrated on ``benchmarks/instability.py`` (see docs/alerts.md, "Does it
warn in time?"); each one quotes that evidence in its message.

What happens when a rule fires (warn, stop, raise, ``on_alert``) is the engine's business; the
tracker only keeps the state (streaks, active alerts, the recent values trends need), which
survives a resume through ``state_dict``.
"""

from qkmonitor.alerts.defaults import (
    DEFAULT_RULES,
    ENTROPY_COLLAPSE_RULE,
    FAST_UPDATES_RULE,
    KAPPA_RULE,
    LOGIT_BURST_RULE,
    LOGIT_GROWTH_RULE,
    LOGIT_JUMP_RULE,
    LOGIT_PLATEAU_RULE,
    MALIGNANT_COLLAPSE_RULE,
    RANK_COLLAPSE_RULE,
    SPECTRAL_GROWTH_RULE,
)
from qkmonitor.alerts.rules import (
    ALERT_ACTIONS,
    LEARNING_WINDOW,
    LOSS_SIGNALS,
    LOSS_SMOOTHING,
    RUN_SIGNALS,
    AlertRule,
    Condition,
    EntropyCollapseWarning,
    LogitGrowthWarning,
    MalignantCollapseWarning,
    OverLocalizationWarning,
    QKMonitorWarning,
    RankCollapseWarning,
    channel_of,
    run_signals,
)
from qkmonitor.alerts.tracker import Alert, AlertTracker

__all__ = [
    "ALERT_ACTIONS",
    "DEFAULT_RULES",
    "ENTROPY_COLLAPSE_RULE",
    "FAST_UPDATES_RULE",
    "KAPPA_RULE",
    "LEARNING_WINDOW",
    "LOGIT_BURST_RULE",
    "LOGIT_GROWTH_RULE",
    "LOGIT_JUMP_RULE",
    "LOGIT_PLATEAU_RULE",
    "LOSS_SIGNALS",
    "LOSS_SMOOTHING",
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
    "channel_of",
    "run_signals",
]
