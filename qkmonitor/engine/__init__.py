"""The monitor engine: measuring, scheduling, alerting and logging, with no training framework.

An engine (:mod:`.base`: schedule, measuring, resume state) takes its arguments as one
:class:`MonitorOptions` (:mod:`.options`) and hands each probe to its alert policy
(:mod:`.alerting`) and its publisher (:mod:`.publishing`, visuals drawn on the background thread of
:mod:`.publisher`). The Lightning callbacks (:mod:`qkmonitor.callbacks`) are thin adapters over
these engines; a plain PyTorch loop drives them through :class:`Monitoring`. See
``docs/architecture.md``.
"""

from qkmonitor.engine.activation import ActivationEngine
from qkmonitor.engine.base import MonitorEngine
from qkmonitor.engine.clip import QKClipEngine
from qkmonitor.engine.entropy import AttentionEntropy
from qkmonitor.engine.head_metrics import HeadMetric
from qkmonitor.engine.host import Host, PlainHost
from qkmonitor.engine.options import MonitorOptions
from qkmonitor.engine.rank import EffectiveRank
from qkmonitor.engine.session import Monitoring, check_tag_collisions, write_run_header
from qkmonitor.engine.spectrum import QKSpectrum

__all__ = [
    "ActivationEngine",
    "AttentionEntropy",
    "EffectiveRank",
    "HeadMetric",
    "Host",
    "MonitorEngine",
    "MonitorOptions",
    "Monitoring",
    "PlainHost",
    "QKClipEngine",
    "QKSpectrum",
    "check_tag_collisions",
    "write_run_header",
]
