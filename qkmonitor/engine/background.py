"""Weight-only work off the training thread: the spectrum's eigenproblems on a worker.

A probe of the W_QK spectrum needs nothing of the training step but the weights at the read. On a
GPU its eigenproblems, and the reads of their results by the host, would make the training thread
wait for the device in the middle of the step; a worker computes them instead, from a copy of the
weights taken at the read (on their own device), while the training thread goes on. The engine
logs the values at their own step where it would have logged them anyway, at the end of the next
batch (:meth:`~qkmonitor.engine.spectrum.QKSpectrum.settle`): the same tags, the same alerts, the
same step, equal bit for bit to the synchronous path's. The copy is dropped as soon as the job has
read it.

On a CPU the worker would compete with training for the same cores (and the GIL), so the
synchronous path stays there: :func:`use_worker` chooses by the weights' device unless the user
says otherwise (``QKSpectrumMonitor(background_weights=...)``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor

from qkmonitor.engine.host import Host

__all__ = ["WEIGHTS_WORKER", "InFlightRead", "Worker", "use_worker"]

T = TypeVar("T")


class Worker:
    """One background thread a process, started on first use (again in a forked child), running
    jobs in submission order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def submit(self, job: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``job(*args)`` on the worker; the returned future holds its result or error (the
        worker keeps no reference to ``args`` once the job has run)."""
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
                self._pid = os.getpid()
            return self._pool.submit(job, *args)


#: The weights' worker: the spectrum's eigenproblems of every engine in the process.
WEIGHTS_WORKER = Worker("qkmonitor-weights")


def use_worker(setting: bool | None, tensors: Iterable[Tensor]) -> bool:
    """Whether a read of ``tensors`` goes to the worker: as the user set it, else (``None``) where
    a tensor is on a GPU. Sharded tensors (DTensors: their gathering is a collective, which stays
    on the training thread in the ranks' common order) never do."""
    tensors = list(tensors)
    if any(callable(getattr(t, "full_tensor", None)) for t in tensors):
        return False
    if setting is not None:
        return setting
    return any(t.device.type == "cuda" for t in tensors)


@dataclass
class InFlightRead:
    """A read of the weights whose spectrum the worker computes.

    Attributes:
        host: the host of the read, which logs it.
        step: the optimizer steps the weights had taken.
        layers: the indices of the layers read, in the order of the weights handed to the job.
        future: the job: the layers' :class:`~qkmonitor.measures.layer_spectra.LayerSpectra`.
        updates: the update metrics read beside it, on the training thread.
        learning_rate: the host's learning rate at the read, which its alerts name.
        update_job: the spectrum of the update before the read
            (:func:`~qkmonitor.measures.update_spectra.update_spectra`), merged into ``updates``
            when logged; None where there is none to compute.
    """

    host: Host
    step: int
    layers: list[int]
    future: Future
    updates: tuple[dict, dict]
    learning_rate: float | None = None
    update_job: Future | None = None
