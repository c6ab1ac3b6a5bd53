"""Drawing and writing the visuals off the training thread.

Drawing a heatmap or an attention image and encoding it as a PNG takes milliseconds, more than
measuring a small model; a probe's visuals are therefore a job for one background thread per
process (:data:`PUBLISHER`): jobs run in the order they were submitted, and :meth:`Publisher.drain`
waits until every job submitted so far has run. Engines drain when a fit or a ``Monitoring``
ends, on success and on failure (``MonitorEngine.release``), so everything is written before a
logger closes. Scalars and alert texts stay on the training thread: they are cheap, and loggers
order them with their own.

A job that raises does not stop training (nor the thread): the error is kept and handed back by
the next :meth:`Publisher.drain` or :meth:`Publisher.errors`, which the engine warns about.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

__all__ = ["PUBLISHER", "Publisher"]


class Publisher:
    """One background thread running jobs in submission order."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job()`` on the background thread, after every job submitted before it."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="qkmonitor-publisher", daemon=True
                )
                self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except BaseException as err:  # noqa: BLE001 -- kept for the training thread to warn about
                with self._lock:
                    self._errors.append(err)
            finally:
                self._jobs.task_done()

    def drain(self) -> list[BaseException]:
        """Wait until every job submitted so far has run; return (and forget) the errors raised."""
        self._jobs.join()
        return self.errors()

    def errors(self) -> list[BaseException]:
        """The errors jobs raised since the last call (forgotten once returned)."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors


#: the process's publisher
PUBLISHER = Publisher()
