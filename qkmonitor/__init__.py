"""qkmonitor: watch attention while a transformer trains.

Its folders are its concerns: :mod:`qkmonitor.attention` finds a model's attention and sees its
calls, :mod:`qkmonitor.measures` holds the math, :mod:`qkmonitor.kernels` the attention kernels,
:mod:`qkmonitor.engine` the monitors (measuring, scheduling, recording), :mod:`qkmonitor.alerts` the
rules, :mod:`qkmonitor.output` the tags, sinks, dashboards and report, :mod:`qkmonitor.callbacks`
the Lightning and Hugging Face Trainer callbacks, :mod:`qkmonitor.models` the bundled transformers
and tasks; :mod:`qkmonitor.cli` is the ``qkmonitor`` command.

What a user imports first is here: :class:`QKMonitor` (the Lightning callback), :class:`Monitoring`
(a plain PyTorch loop) and :class:`AttentionSpec` (a module's attention layout). The first two are
loaded on first use, so that ``import qkmonitor`` (and every ``import qkmonitor.<module>``, which
runs this file first) loads neither Lightning nor the engines.
"""

from importlib import metadata as _metadata
from typing import TYPE_CHECKING

# the adapter families register themselves on import (qkmonitor.attention.registry), before any
# discovery
from qkmonitor.alerts import (
    AlertRule,
    EntropyCollapseWarning,
    LogitGrowthWarning,
    LowRankUpdateWarning,
    MalignantCollapseWarning,
    OverLocalizationWarning,
    QKMonitorWarning,
    RankCollapseWarning,
)
from qkmonitor.attention import hf as _hf  # noqa: F401  (needs transformers only when a model holds its modules)
from qkmonitor.attention import multihead as _multihead  # noqa: F401
from qkmonitor.attention import native as _native  # noqa: F401
from qkmonitor.attention.adapters import AttentionLayer, SupportsQKMonitor, find_attention_layers
from qkmonitor.attention.intercept import InterceptedAttentionLayer, register_attention
from qkmonitor.attention.latent import LatentNames
from qkmonitor.attention.probes import AttentionCall, KernelCall, Probe, ProbeRequest, ProbeResult
from qkmonitor.attention.spec import AttentionSpec
from qkmonitor.lazy import lazy_exports as _lazy_exports
from qkmonitor.measures.layer_spectra import QKWeights

if TYPE_CHECKING:
    from qkmonitor.callbacks.qk_monitor import QKMonitor
    from qkmonitor.engine.session import Monitoring
    from qkmonitor.scanning.run import scan

#: the names loaded on first use -> the module that defines them
_LAZY = {
    "QKMonitor": "qkmonitor.callbacks.qk_monitor",
    "Monitoring": "qkmonitor.engine.session",
    "scan": "qkmonitor.scanning.run",
}
__getattr__, __dir__ = _lazy_exports(globals(), _LAZY)


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
    "LowRankUpdateWarning",
    "MalignantCollapseWarning",
    "Monitoring",
    "OverLocalizationWarning",
    "Probe",
    "ProbeRequest",
    "ProbeResult",
    "QKMonitor",
    "QKMonitorWarning",
    "QKWeights",
    "RankCollapseWarning",
    "SupportsQKMonitor",
    "__version__",
    "find_attention_layers",
    "register_attention",
    "scan",
]
