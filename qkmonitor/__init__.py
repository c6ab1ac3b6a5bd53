"""qkmonitor: watch attention while a transformer trains.

The core (this package) holds the metric math (:mod:`qkmonitor.functional`), the attention
kernels (:mod:`qkmonitor.kernels`), the model adapters (:mod:`qkmonitor.adapters`), the alert
rules (:mod:`qkmonitor.alerts`) and the CLI. The Lightning callbacks live in
:mod:`qkmonitor.callbacks`, the bundled transformers and tasks in :mod:`qkmonitor.models`.
"""

from importlib import metadata as _metadata

# the adapter families register themselves on import (qkmonitor.registry), before any discovery
from qkmonitor import hf as _hf  # noqa: F401  (needs transformers only when a model holds its modules)
from qkmonitor.adapters import AttentionLayer, QKWeights, SupportsQKMonitor, find_attention_layers
from qkmonitor.alerts import (
    AlertRule,
    EntropyCollapseWarning,
    LogitGrowthWarning,
    MalignantCollapseWarning,
    OverLocalizationWarning,
    QKMonitorWarning,
    RankCollapseWarning,
)
from qkmonitor.intercept import InterceptedAttentionLayer, register_attention
from qkmonitor.layouts import AttentionSpec
from qkmonitor.probes import AttentionCall, KernelCall, Probe, ProbeRequest, ProbeResult

try:  # the one version is pyproject.toml's, read from the installed package's metadata
    __version__ = _metadata.version("qkmonitor")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "AlertRule",
    "AttentionCall",
    "AttentionLayer",
    "AttentionSpec",
    "EntropyCollapseWarning",
    "InterceptedAttentionLayer",
    "KernelCall",
    "LogitGrowthWarning",
    "MalignantCollapseWarning",
    "OverLocalizationWarning",
    "Probe",
    "ProbeRequest",
    "ProbeResult",
    "QKMonitorWarning",
    "QKWeights",
    "RankCollapseWarning",
    "SupportsQKMonitor",
    "__version__",
    "find_attention_layers",
    "register_attention",
]
