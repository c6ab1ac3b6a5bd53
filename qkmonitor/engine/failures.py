"""What a monitor lets through to the training loop, and what it turns into one warning.

A monitor never stops a fit for a metric problem: an exception raised while measuring, aggregating,
reading weights, computing or recording becomes one warning naming the engine's layers
(:func:`guarded`, used by :class:`~qkmonitor.engine.group.EngineGroup` and
:func:`~qkmonitor.engine.activation.finish_windows` around each engine's part of every hook), and
the engine's open window is dropped. What passes through (:func:`passes_through`) is what the user
asked for or must fix: an alert with ``alert_action="raise"``, an exception of the user's own
``on_alert``, a configuration error (a ``ValueError`` or ``TypeError`` while binding, a monitor
that can read none of its layers: :class:`MeasuresNothingError`), and anything that is not an
``Exception`` (``KeyboardInterrupt``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from qkmonitor.alerts import QKMonitorWarning
from qkmonitor.engine.host import Host

__all__ = ["Guarded", "MeasuresNothingError", "guarded", "let_through", "passes_through"]

T = TypeVar("T")

_PASSES = "_qkmonitor_passes"


class MeasuresNothingError(ValueError):
    """A monitor can read none of its layers (no weights found, no statistics, no call read in the
    first probed forward): a configuration error. Alone it stops the run; beside monitors that
    measure something (``QKMonitor``, a ``Monitoring`` of several engines) it is one warning and
    that monitor measures nothing."""


class Guarded(Protocol):
    """What :func:`guarded` asks of an engine (:class:`~qkmonitor.engine.base.MonitorEngine`
    answers it; this module imports no engine, whose modules import it)."""

    #: its attention layers (none: it measures nothing)
    layers: Sequence[Any]

    def discard(self) -> None: ...

    def warn_failure(
        self,
        host: Host,
        stage: str,
        step: int | None,
        err: BaseException,
        layers: Sequence[str] | None = None,
    ) -> None: ...

    def measure_nothing(self, host: Host, reason: str) -> None: ...


def let_through(err: BaseException) -> BaseException:
    """Mark ``err`` as the user's (``on_alert``'s own exception): :func:`guarded` re-raises it."""
    setattr(err, _PASSES, True)
    return err


def passes_through(err: BaseException) -> bool:
    """Whether ``err``, raised inside a monitor, goes to the caller rather than into a warning."""
    return (
        not isinstance(err, Exception)
        or isinstance(err, (QKMonitorWarning, MeasuresNothingError))
        or getattr(err, _PASSES, False)
    )


def guarded(
    host: Host,
    engine: Guarded,
    stage: str,
    step: int | None,
    work: Callable[[], T],
    beside: Sequence[Guarded] = (),
) -> T | None:
    """``work()``, or, where it raises a metric problem, None: the engine's window dropped
    (:meth:`~qkmonitor.engine.base.MonitorEngine.discard`) and one warning per engine and stage
    naming its layers and the error. What :func:`passes_through` is re-raised, but a
    :class:`MeasuresNothingError` of an engine ``beside`` others that measure something turns that
    engine off with one warning."""
    try:
        return work()
    except BaseException as err:
        if isinstance(err, MeasuresNothingError) and any(
            e.layers for e in beside if e is not engine
        ):
            engine.measure_nothing(host, str(err))
            return None
        if passes_through(err):
            raise
        try:
            engine.discard()
        except Exception:  # noqa: BLE001, S110 -- the warning below says what failed first
            pass
        engine.warn_failure(host, stage, step, err)
        return None
