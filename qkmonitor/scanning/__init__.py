"""``qkmonitor scan``: the QK spectrum of saved models and of runs already done, read from their
files (:mod:`~qkmonitor.scanning.files`), placed by tensor names and config
(:mod:`~qkmonitor.scanning.names`) or from a Lightning module (:mod:`~qkmonitor.scanning.modules`),
computed one layer at a time and written as the live spectrum monitor writes
(:mod:`~qkmonitor.scanning.run`). ``qkmonitor.scan(path)`` is :func:`~qkmonitor.scanning.run.scan`.
"""

from qkmonitor.scanning.files import ScanError
from qkmonitor.scanning.run import LayerScan, ModelScan, scan, write_scan

__all__ = ["LayerScan", "ModelScan", "ScanError", "scan", "write_scan"]
