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

from qkmonitor.alerts import defaults, rules, tracker
from qkmonitor.alerts.defaults import *
from qkmonitor.alerts.rules import *
from qkmonitor.alerts.tracker import *

# each module's __all__ names its public names once; they are all importable from here
__all__: list[str] = []
__all__ += rules.__all__
__all__ += defaults.__all__
__all__ += tracker.__all__
