"""qkmonitor: watch attention while a transformer trains.

The core (this package) holds the metric math (:mod:`qkmonitor.functional`), the attention
kernels (:mod:`qkmonitor.kernels`), the model adapters (:mod:`qkmonitor.adapters`), the alert
rules (:mod:`qkmonitor.alerts`) and the CLI. The Lightning callbacks live in
:mod:`qkmonitor.callbacks`, the bundled transformers and tasks in :mod:`qkmonitor.models`.
"""

from qkmonitor.adapters import AttentionLayer, QKWeights, find_attention_layers
from qkmonitor.alerts import (
    AlertRule,
    EntropyCollapseWarning,
    LogitGrowthWarning,
    MalignantCollapseWarning,
    OverLocalizationWarning,
    QKMonitorWarning,
    RankCollapseWarning,
)

__version__ = "0.1.0"

__all__ = [
    "AlertRule",
    "AttentionLayer",
    "EntropyCollapseWarning",
    "LogitGrowthWarning",
    "MalignantCollapseWarning",
    "OverLocalizationWarning",
    "RankCollapseWarning",
    "QKMonitorWarning",
    "QKWeights",
    "find_attention_layers",
    "__version__",
]
