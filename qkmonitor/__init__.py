"""qkmonitor: watch attention while a transformer trains.

The core (this package) holds the metric math (:mod:`qkmonitor.functional`), the attention
kernels (:mod:`qkmonitor.kernels`), the model adapters (:mod:`qkmonitor.adapters`), the alert
rules (:mod:`qkmonitor.alerts`) and the CLI. The Lightning callbacks live in
:mod:`qkmonitor.callbacks`, the bundled transformers and tasks in :mod:`qkmonitor.models`.
"""

from qkmonitor.adapters import AttentionLayer, QKWeights, SupportsQKMonitor, find_attention_layers

# the adapter families register themselves on import (qkmonitor.registry), before any discovery
from qkmonitor import hf as _hf  # noqa: F401  (needs transformers only when a model holds its modules)
from qkmonitor.intercept import InterceptedAttentionLayer, register_attention
from qkmonitor.layouts import AttentionSpec
from qkmonitor.probes import AttentionCall, KernelCall, Probe, ProbeRequest, ProbeResult
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
    "AttentionCall",
    "AttentionLayer",
    "AttentionSpec",
    "InterceptedAttentionLayer",
    "KernelCall",
    "Probe",
    "ProbeRequest",
    "ProbeResult",
    "SupportsQKMonitor",
    "register_attention",
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
