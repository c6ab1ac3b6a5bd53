"""Logging faults never stop training: every write to a sink goes through a :class:`GuardedSink`.

A log directory that disappears, turns read-only or fills up, a tracking server that is down: the
sink's write raises, and the write is lost, not the run. The guard of a destination (one per
writer or logger, shared by every engine that writes there) counts the writes lost, says so once
at the first (naming the destination and the error), and the monitors go on measuring.

A TensorBoard writer writes on a thread of its own: a write is accepted at once, and a failure
shows only at a later write or flush. Its guard is *asynchronous*: the writer is flushed once a
probe, on the publishing thread (:meth:`GuardedSink.confirm`), and the writes accepted since the
last flush that went through are the ones lost when one fails. A writer whose thread failed
refuses every later write, its own logger's included, and raises again when flushed or closed.

The failed writer is left as it is while its directory cannot be written: a logger that shares it
(a Lightning ``TensorBoardLogger``) meets, at its own next write, the error its own write would
have met there (the same error on its own event file, raised by Lightning as it raises it without
qkmonitor), never one that qkmonitor's handling made. Later writes are tried again, once per step,
where the destination can take them (a TensorBoard directory: it exists and is writable): then the
failed event file is dropped first (``reset``; ``SummaryWriter`` opens a new one at its next
write, for the logger's writes too), the write is made and flushed; when one goes through, the
guard says that writing resumed and how many writes were lost. At the run's end
(:meth:`GuardedSink.report`) the summary says how many were lost in all, and a writer still failed
is dropped, so that its logger's flush and close at the end do not raise an error of a write of
the monitors (the logger's own failures are raised by the logger before that).

:meth:`GuardedSink.write` puts a write of the destination's owner under the same guard
(``qkmonitor train``'s own logger: its run survives a failing directory).

Messages are kept, not warned, where a write fails (it may be the publishing thread's): the
training thread hands them to its host (:func:`warn_write_faults`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import Tensor

from qkmonitor.output.sinks import Sink

__all__ = ["GuardedSink", "Warns", "confirm_writes", "report_write_faults", "warn_write_faults"]


class Warns(Protocol):
    """What the guards give their messages to: an engine's host
    (:class:`qkmonitor.engine.host.Host`), named here by what it does, as output sits below the
    engine (docs/architecture.md, "Layers")."""

    def warn(self, message: str, category: type[Warning] = UserWarning) -> None: ...


class GuardedSink:
    """``sink`` whose writes never raise (``Exception``s; a ``KeyboardInterrupt`` still stops).

    Args:
        sink: the sink written through.
        destination: where it writes, in words (a run directory, a logger and its directory).
        directory: the directory it writes into, if it is one: writes are retried only while it
            exists and is writable.
        reset: called before a write is retried where the destination can take it again, and at
            the run's end while it still fails (a TensorBoard writer drops its failed event file,
            so that the next write, ours or the logger's own, opens a new one).
        asynchronous: the sink's writes are taken by a thread of its own and confirmed by its
            ``flush`` (a TensorBoard writer).

    Other attributes (``logger``, ``tag_prefix``, ``writer``) are the sink's.
    """

    def __init__(
        self,
        sink: Sink,
        destination: str,
        *,
        directory: str | None = None,
        reset: Callable[[], None] | None = None,
        asynchronous: bool = False,
    ) -> None:
        self.sink = sink
        self.draws = sink.draws
        self.destination = destination
        self._directory = directory
        self._reset = reset
        self._asynchronous = asynchronous
        # the training thread and the publishing thread write; reentrant: a sink's write may go
        # through its logger, whose own writes may be guarded by this guard too (GuardedSink.write)
        self._lock = threading.RLock()
        self._pending = 0  # writes accepted by an asynchronous sink since its last flush
        self._pending_since: int | None = None  # the step of the first of them
        self._failing = False
        self._failed_step: int | None = None  # the step of the last failed write
        self._error = ""
        self._lost = 0  # writes lost since the last report
        self._lost_steps: tuple[int, int] | None = None  # their first and last step
        #: writes lost over the guard's life
        self.lost_total = 0
        self._messages: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["sink"], name)

    # -- the sink's methods --------------------------------------------------------------------

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self._write(self.sink.log_scalars, step, scalars, step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        self._write(self.sink.log_text, step, tag, text, step)

    def log_image(self, tag: str, image: Any, step: int) -> None:
        self._write(self.sink.log_image, step, tag, image, step)

    def log_histogram(self, tag: str, values: Tensor, step: int) -> None:
        self._write(self.sink.log_histogram, step, tag, values, step)

    def log_layout(self, layout: dict) -> None:
        self._write(self.sink.log_layout, None, layout)

    def log_hparams(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        self._write(self.sink.log_hparams, None, params, metrics)

    def write_pending_layout(self) -> None:
        """A layout the sink held back until the run's tags were known, written (at the end)."""
        pending = getattr(self.sink, "write_pending_layout", None)
        if callable(pending) and getattr(self.sink, "layout_pending", False):
            self._write(pending, None)

    def write(self, method: Callable, *args: Any, step: int | None = None) -> None:
        """``method(*args)``, a write of the destination's owner (``qkmonitor train``'s logger)
        under this guard: counted, retried and reported with the monitors' writes."""
        self._write(method, step, *args)

    @property
    def failing(self) -> bool:
        """Whether the destination failed and no write went through since."""
        return self._failing

    def flush(self) -> None:
        """Flush the sink; for an asynchronous one, what it accepted is confirmed (or lost)."""
        with self._lock:
            if not self._failing:
                self._flush()

    @property
    def unconfirmed(self) -> bool:
        """Whether an asynchronous sink accepted writes since its last flush that went through."""
        return bool(self._pending)

    def confirm(self) -> None:
        """Flush an asynchronous sink that accepted writes since its last flush (once a probe, on
        the publishing thread: :func:`confirm_writes`): its writes are confirmed, or a failure
        shows and they are counted lost."""
        with self._lock:
            if self._pending and not self._failing:
                self._flush()

    # -- the guard -----------------------------------------------------------------------------

    def _write(self, method: Callable, step: int | None, *args: Any) -> None:
        """``method(*args)``, the write of ``step`` (None: a layout, hparams); while the
        destination fails, tried again once per step and only where it can be written, and a
        retried write is flushed, so that writing resumes only once the destination took it."""
        with self._lock:
            retry = self._failing
            if retry and (step == self._failed_step or not self._may_retry()):
                self._lose(1, step)
                return
            if retry and self._reset is not None:
                self._reset()  # the failed event file is dropped only where a new one can go
            try:
                method(*args)
            except Exception as err:  # noqa: BLE001 -- a logging fault never stops training
                if self._pending:  # what the writer took before: confirmed, or lost with this
                    self._flush(failure_counts=False)
                self._fail(err, step, lost=1)
                return
            if self._asynchronous:
                if not self._pending:
                    self._pending_since = step
                self._pending += 1
            if retry and self._flush():
                self._resumed(step)

    def _flush(self, *, failure_counts: bool = True) -> bool:
        """Flush the sink (if it can be); False if that failed: its pending writes are lost (a
        failure of its own, unless ``failure_counts`` is False: a write's failure follows)."""
        flush = getattr(self.sink, "flush", None)
        if not callable(flush):
            return True
        try:
            flush()
        except Exception as err:  # noqa: BLE001 -- a logging fault never stops training
            if failure_counts:
                self._fail(err, self._pending_since, lost=0)
            return False
        self._pending, self._pending_since = 0, None
        return True

    def _may_retry(self) -> bool:
        directory = self._directory
        return directory is None or (os.path.isdir(directory) and os.access(directory, os.W_OK))

    def _lose(self, count: int, step: int | None) -> None:
        self._lost += count
        self.lost_total += count
        if step is not None and count:
            first, last = self._lost_steps or (step, step)
            self._lost_steps = min(first, step), max(last, step)

    def _fail(self, err: Exception, step: int | None, lost: int) -> None:
        """A write of ``step`` (``lost`` of them) or a flush failed: those writes and every one
        accepted since the last flush that went through are lost."""
        first = not self._failing and self.lost_total == 0
        since = self._pending_since if self._pending else step
        self._lose(self._pending, since)
        self._lose(lost, step)
        self._failing, self._failed_step = True, step
        self._error = f"{type(err).__name__}: {err}"
        self._pending, self._pending_since = 0, None
        if first:
            at = f" at step {since}" if since is not None else ""
            self._messages.append(
                f"qkmonitor: writing to {self.destination} failed{at} ({self._error}); the "
                f"monitors go on measuring, and writing resumes when {self.destination} can be "
                "written again. This warning is shown once; the run's end says how many writes "
                "were lost."
            )

    def _resumed(self, step: int | None) -> None:
        self._failing = False
        at = f" at step {step}" if step is not None else ""
        self._messages.append(
            f"qkmonitor: writing to {self.destination} resumed{at}; {self._lost} write(s) were "
            f"lost{self._steps()} ({self._error})."
        )

    def _steps(self) -> str:
        if self._lost_steps is None:
            return ""
        first, last = self._lost_steps
        return f" (step {first})" if first == last else f" (steps {first} to {last})"

    def take_messages(self) -> list[str]:
        """The messages not yet given (the first failure, a resumption), once."""
        with self._lock:
            messages, self._messages = self._messages, []
        return messages

    def report(self) -> str | None:
        """At a run's end: how many writes were lost since the last report, or None (once)."""
        with self._lock:
            if self._failing and self._reset is not None:
                self._reset()  # the end: a logger's flush and close meet no failure of ours
            if not self._lost:
                return None
            still = "; it still fails" if self._failing else ""
            message = (
                f"qkmonitor: {self._lost} write(s) to {self.destination} were lost{self._steps()}"
                f"{still} ({self._error})."
            )
            self._lost, self._lost_steps = 0, None
        return message


def confirm_writes(sinks: Sequence[Any]) -> None:
    """Confirm what the asynchronous sinks accepted: a failure shows here. Once a probe it runs on
    the publishing thread (a flush waits for the writer's thread: ~3 ms a probe on the training
    thread, measured side by side), and at the run's end on the training thread."""
    for sink in sinks:
        confirm = getattr(sink, "confirm", None)
        if callable(confirm):
            confirm()


def warn_write_faults(host: Warns, sinks: Sequence[Any]) -> None:
    """Give the guards' pending messages (a first failure, a resumption) through ``host``."""
    for sink in sinks:
        take = getattr(sink, "take_messages", None)
        for message in take() if callable(take) else ():
            host.warn(message, RuntimeWarning)


def report_write_faults(host: Warns, sinks: Sequence[Any]) -> None:
    """At a run's end: what is pending confirmed, the messages given, then how many writes each
    destination lost."""
    for sink in sinks:  # a layout held until the run's tags were known (output.sinks)
        pending = getattr(sink, "write_pending_layout", None)
        if callable(pending):
            pending()
    confirm_writes(sinks)
    warn_write_faults(host, sinks)
    for sink in sinks:
        report = getattr(sink, "report", None)
        message = report() if callable(report) else None
        if message is not None:
            host.warn(message, RuntimeWarning)
