"""What an engine needs from what drives it: the :class:`Host` (sinks, warnings, the stop flag,
the learning rate), the plain loop's :class:`PlainHost`, and how a probe's scalars reach the sinks
(:func:`write_scalars`, held by step in a :class:`ScalarBatch` when several engines write one
probe together). The Lightning host is :class:`qkmonitor.callbacks.base.LightningHost`.

It imports nothing of the engine, so the engine's parts (measuring, recording, alerting) all depend
on it and not on each other for their host's type.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from qkmonitor.output.guard import confirm_writes, warn_write_faults
from qkmonitor.output.publisher import PUBLISHER
from qkmonitor.output.sinks import Sink

__all__ = ["Host", "PlainHost", "ScalarBatch", "write_scalars"]


class Host:
    """What an engine needs from what drives it. The base is a plain single-process loop.

    Attributes:
        owner: handed to ``on_alert(owner, alert)`` (the Trainer in Lightning).
        is_logging_rank: whether this process writes (rank zero).
    """

    owner: Any = None
    is_logging_rank: bool = True
    #: where a probe's scalars wait to be written with those of the other engines at the same step
    #: (one write a probe, :class:`~qkmonitor.engine.publishing.ScalarBatch`); None: at once
    scalar_batch: ScalarBatch | None = None

    def sinks(self) -> list[Sink]:
        return []

    def write_scalars(self, scalars: dict[str, float], step: int) -> None:
        """Write one probe's scalars to every sink (on the logging rank), or add them to
        :attr:`scalar_batch`."""
        if self.scalar_batch is not None:
            self.scalar_batch.add(scalars, step)
        else:
            write_scalars(self, scalars, step)

    def warn(self, message: str, category: type[Warning] = UserWarning) -> None:
        warnings.warn(message, category, stacklevel=3)

    def info(self, message: str) -> None:
        """A line for the user (what was found): the ``qkmonitor`` logger at INFO, shown on stderr
        unless the application configured that logger itself."""
        _console_logger().info(message)

    def stop(self) -> None:
        """Ask the training loop to stop (alert action ``"stop"``)."""

    def learning_rate(self) -> float | None:
        return None


def _console_logger() -> logging.Logger:
    logger = logging.getLogger("qkmonitor")
    if (
        not logger.handlers and logger.level == logging.NOTSET
    ):  # as Lightning does for its own logger
        logger.setLevel(logging.INFO)
        logger.addHandler(logging.StreamHandler())
    return logger


class PlainHost(Host):
    """A host for a plain loop: fixed sinks, an optional optimizer for the learning rate.

    ``should_stop`` turns True when an alert with action ``"stop"`` fires.
    """

    def __init__(
        self,
        sinks: Sequence[Sink] = (),
        optimizer: torch.optim.Optimizer | None = None,
        owner: Any = None,
    ) -> None:
        self._sinks = list(sinks)
        self.optimizer = optimizer
        self.owner = owner
        self.should_stop = False

    def sinks(self) -> list[Sink]:
        return self._sinks

    def stop(self) -> None:
        self.should_stop = True

    def learning_rate(self) -> float | None:
        if self.optimizer is None:
            return None
        return next((float(g["lr"]) for g in self.optimizer.param_groups if "lr" in g), None)


def write_scalars(host: Host, scalars: dict[str, float], step: int) -> None:
    """Write scalars at ``step`` to every sink of ``host``: one ``log_scalars`` call each (one
    TensorBoard event, one CSV row); then what the guards saw (:mod:`qkmonitor.output.guard`)."""
    sinks = host.sinks()
    for sink in sinks:
        sink.log_scalars(scalars, step)
    # a TensorBoard writer's failure shows when it is flushed, off the training thread
    if any(getattr(sink, "unconfirmed", False) for sink in sinks):
        PUBLISHER.submit(partial(confirm_writes, sinks))
    warn_write_faults(host, sinks)  # a destination that failed or resumed (output.guard)


class ScalarBatch:
    """Scalars held by step until they are written together: the engines of one callback
    (``QKMonitor``) write a probe step's scalars once (one TensorBoard event, one CSV row), the
    spectrum read after the step before it with the activations measured in it.

    A host with a batch (:attr:`Host.scalar_batch`) adds to it; the driver calls :meth:`flush`
    after each batch's work, and with no bound at a run's end, on success and on failure."""

    def __init__(self) -> None:
        self._pending: dict[int, dict[str, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, scalars: dict[str, float], step: int) -> None:
        self._pending.setdefault(step, {}).update(scalars)

    def flush(self, host: Host, up_to: int | None = None) -> None:
        """Write the held steps up to ``up_to`` (every one with None) in step order, one write a
        step, on the logging rank."""
        for step in sorted(self._pending):
            if up_to is not None and step > up_to:
                break
            scalars = self._pending.pop(step)
            if host.is_logging_rank:
                write_scalars(host, scalars, step)
