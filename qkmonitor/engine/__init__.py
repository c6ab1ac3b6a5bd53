"""The monitor engine: measuring, scheduling, alerting and logging, with no training framework.

The Lightning callbacks (:mod:`qkmonitor.callbacks`) are thin adapters over these engines; a plain
PyTorch loop drives them through :class:`Monitoring`. See ``docs/architecture.md``.
"""

from qkmonitor.engine.base import ActivationEngine, Host, MonitorEngine, PlainHost
from qkmonitor.engine.entropy import AttentionEntropy
from qkmonitor.engine.rank import EffectiveRank
from qkmonitor.engine.session import Monitoring, check_tag_collisions, write_run_header
from qkmonitor.engine.sinks import MemorySink, Sink, SummaryWriterSink
from qkmonitor.engine.spectrum import QKSpectrum

__all__ = [
    "ActivationEngine",
    "AttentionEntropy",
    "EffectiveRank",
    "Host",
    "MemorySink",
    "MonitorEngine",
    "Monitoring",
    "PlainHost",
    "QKSpectrum",
    "Sink",
    "SummaryWriterSink",
    "check_tag_collisions",
    "write_run_header",
]
