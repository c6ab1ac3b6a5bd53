"""qkmonitor: watch attention while a transformer trains.

Its folders are its concerns: :mod:`qkmonitor.attention` finds a model's attention and sees its
calls, :mod:`qkmonitor.measures` holds the math, :mod:`qkmonitor.kernels` the attention kernels,
:mod:`qkmonitor.engine` the monitors (measuring, scheduling, recording), :mod:`qkmonitor.alerts` the
rules, :mod:`qkmonitor.output` the tags, sinks, dashboards and report, :mod:`qkmonitor.callbacks`
the Lightning and Hugging Face Trainer callbacks, :mod:`qkmonitor.models` the bundled transformers
and tasks; :mod:`qkmonitor.cli` is the ``qkmonitor`` command.
"""

from importlib import metadata as _metadata

# the adapter families register themselves on import (qkmonitor.attention.registry), before any
# discovery
from qkmonitor.alerts import (
    AlertRule,
    EntropyCollapseWarning,
    LogitGrowthWarning,
    MalignantCollapseWarning,
    OverLocalizationWarning,
    QKMonitorWarning,
    RankCollapseWarning,
)
from qkmonitor.attention import hf as _hf  # noqa: F401  (needs transformers only when a model holds its modules)
from qkmonitor.attention.adapters import (
    AttentionLayer,
    QKWeights,
    SupportsQKMonitor,
    find_attention_layers,
)
from qkmonitor.attention.intercept import InterceptedAttentionLayer, register_attention
from qkmonitor.attention.latent import LatentNames
from qkmonitor.attention.layouts import AttentionSpec
from qkmonitor.attention.probes import AttentionCall, KernelCall, Probe, ProbeRequest, ProbeResult

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
    "LatentNames",
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
