"""Lightning callbacks that watch attention while a model trains."""

from .base import AttentionMonitor
from .qk_spectrum import QKSpectrumMonitor

__all__ = ["AttentionMonitor", "QKSpectrumMonitor"]
