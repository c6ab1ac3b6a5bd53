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

import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor

from qkmonitor.alerts import LOSS_SMOOTHING
from qkmonitor.engine.alerting import AlertPolicy, LossHistory
from qkmonitor.engine.host import Host

__all__ = ["WEIGHTS_WORKER", "AtRead", "InFlightRead", "Worker", "losses_at_read", "use_worker"]

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
    """

    host: Host
    step: int
    layers: list[int]
    future: Future
    updates: tuple[dict, dict]
    learning_rate: float | None = None

    @contextmanager
    def as_read(self, host: Host, policy: AlertPolicy) -> Iterator[Host]:
        """``host`` and ``policy`` as the read saw them on the training thread, for its record
        at the end of the next batch (:class:`AtRead`, :func:`losses_at_read`): what its alerts
        say is what the synchronous path's say."""
        with losses_at_read(policy, self.step):
            yield AtRead(host, self.learning_rate)  # type: ignore[misc]


class AtRead:
    """A host as its read saw it, for the read's record at the end of the next batch: the learning
    rate of the read (an alert's message names the rate of its probe step, not the one a
    scheduler has set since), everything else the host's now."""

    def __init__(self, host: Host, learning_rate: float | None) -> None:
        self._host, self._learning_rate = host, learning_rate

    def learning_rate(self) -> float | None:
        return self._learning_rate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)


@contextmanager
def losses_at_read(policy: AlertPolicy, step: int) -> Iterator[None]:
    """``policy``'s losses as a read of the weights after ``step`` updates saw them on the
    training thread: the losses of earlier steps. The read came before the loss of its own step
    (whose forward ran on these weights) on the synchronous path, so the rules that read the loss
    test the same losses, and the run's first loss (the mean of the first
    :data:`~qkmonitor.alerts.LOSS_SMOOTHING`) is that of the losses then where they were fewer."""
    if not policy.reads_loss:
        yield
        return
    kept = policy.losses
    earlier = [(s, v) for s, v in kept.history() if s < step]
    if len(earlier) < LOSS_SMOOTHING:
        finite = [v for _, v in earlier if math.isfinite(v)]
        first = sum(finite) / len(finite) if finite else None
    else:
        first = kept.first()
    view = LossHistory(kept.maxlen)
    view.restore(earlier, first)
    policy.losses = view
    try:
        yield
    finally:
        policy.losses = kept
