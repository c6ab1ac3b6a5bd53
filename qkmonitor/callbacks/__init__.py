"""Lightning callbacks that watch attention while a model trains."""

from .attention_entropy import AttentionEntropyMonitor
from .base import ActivationMonitor, AttentionMonitor
from .effective_rank import EffectiveRankMonitor
from .qk_clip import QKClip
from .qk_monitor import QKMonitor
from .qk_spectrum import QKSpectrumMonitor

__all__ = [
    "ActivationMonitor",
    "AttentionEntropyMonitor",
    "AttentionMonitor",
    "EffectiveRankMonitor",
    "QKClip",
    "QKMonitor",
    "QKSpectrumMonitor",
]
