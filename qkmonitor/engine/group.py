"""Several engines driven as one, by the Lightning callbacks and by :class:`Monitoring` alike.

An :class:`EngineGroup` holds what a driver does for its engines together: the steps where every
engine may skip its work (the intersection of their ``between_probes``, and of their ``quiet``
steps: one check a batch), the training loss handed once to the engines whose rules read it, the
windows closed together (:func:`~qkmonitor.engine.base.finish_windows`: their aggregators reduced
across processes in one collective) and a probe step's scalars written once
(:class:`~qkmonitor.engine.host.ScalarBatch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from torch import Tensor, nn

from qkmonitor.engine.activation import finish_windows
from qkmonitor.engine.base import MonitorEngine
from qkmonitor.engine.discovery import report_discovery
from qkmonitor.engine.failures import MeasuresNothingError, guarded
from qkmonitor.engine.host import Host, ScalarBatch
from qkmonitor.engine.losses import LossHistory, check_loss
from qkmonitor.engine.schedule import NO_STEPS

__all__ = ["EngineGroup"]


def _common(ranges: list[range]) -> range:
    """The steps every range holds (ranges of consecutive steps)."""
    start = max((r.start for r in ranges), default=0)
    stop = min((r.stop for r in ranges), default=0)
    return range(start, max(start, stop))


class EngineGroup:
    """The engines of one driver.

    Attributes:
        between: steps where no engine opens a window or reads weights (every engine's
            ``between_probes``): a driver skips all but the loss there.
        quiet: of them, those whose loss no rule reads either: a driver skips everything.
        scalars: the scalars waiting to be written with the others of their step; a driver's
            hosts hold it (``Host.scalar_batch``).
    """

    def __init__(self, engines: Sequence[MonitorEngine]) -> None:
        self.engines = list(engines)
        #: the engines that read the weights (the spectrum)
        self.weights = [e for e in self.engines if e.reads_weights]
        self.loss_readers: list[MonitorEngine] = []
        self._losses: LossHistory | None = None  # the readers' (shared) history
        self.between, self.quiet = NO_STEPS, NO_STEPS
        self.scalars = ScalarBatch()

    def bind(self, model: nn.Module, host: Host, *, default_every_n_steps: int = 50) -> None:
        """Bind every engine to ``model`` (a new run) and report what each found, then
        :meth:`bound`. The engines share one set of the run's once-only warnings (a model without
        data is one warning, not one per engine). An engine that can read none of the layers
        (:class:`~qkmonitor.engine.failures.MeasuresNothingError`) is an error only when no
        engine of the group can measure anything; beside one that can, it is one warning and
        measures nothing. A ``ValueError`` or ``TypeError`` (a ``layers=`` that names no module of
        the model) goes to the caller; another exception is a metric problem: warned, that engine
        measures nothing."""
        shared: set[str] = set()
        refused: list[tuple[MonitorEngine, MeasuresNothingError]] = []
        for engine in self.engines:
            engine.run_warnings = shared
            try:
                engine.bind(model, default_every_n_steps=default_every_n_steps)
            except MeasuresNothingError as err:
                refused.append((engine, err))
            except (ValueError, TypeError):
                raise
            except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
                engine.warn_failure(host, "finding the attention layers", None, err, layers=[])
                engine.measure_nothing(host, "Its layers could not be found.")
        if refused and len(refused) == len(self.engines):
            raise refused[0][1]
        for engine, err in refused:
            engine.measure_nothing(host, str(err))
        for engine in self.engines:
            guarded(
                host,
                engine,
                "reporting the layers found",
                None,
                partial(report_discovery, engine, host),
            )
        self.bound()

    def bound_to(self, model: nn.Module) -> bool:
        """Whether every engine is bound to ``model`` (a driver rebinds when its model changes)."""
        return all(e.model is model for e in self.engines)

    def bound(self) -> None:
        """After every engine's ``bind`` or ``load_state_dict``: a new schedule, and one loss
        history for the engines whose rules read the loss (what the longest-kept of them held)."""
        for engine in self.engines:
            engine.siblings = [e for e in self.engines if e is not engine]
        self.loss_readers = [e for e in self.engines if e.alerting.reads_loss]
        self.between, self.quiet = NO_STEPS, NO_STEPS
        if len(self.loss_readers) > 1:
            histories = [e.alerting.losses for e in self.loss_readers]
            shared = LossHistory(max(h.maxlen for h in histories))
            longest = max(histories, key=len)
            shared.restore(longest.history(), longest.first() if len(longest) else None)
            for engine in self.loss_readers:
                engine.alerting.share_losses(shared)
        self._losses = self.loss_readers[0].alerting.losses if self.loss_readers else None

    def open(self, host: Host, step: int, *, validation: bool = False) -> None:
        """Open the windows of ``step`` (the engines that may probe it)."""
        for engine in self.engines:
            if validation or step not in engine.schedule.between_probes:
                guarded(
                    host,
                    engine,
                    "opening the probes",
                    step,
                    partial(engine.open, step, validation=validation),
                )

    def observe_loss(self, step: int, loss: Tensor | float) -> None:
        """The loss of ``step``, kept once where an engine's rules may read it (the engines share
        one history)."""
        readers = self.loss_readers
        if len(readers) == 1:
            readers[0].observe_loss(step, loss)
        elif readers:
            if type(loss) is not Tensor or loss.numel() != 1 or not loss.is_floating_point():
                check_loss(loss)
            if any(engine.wants_loss(step) for engine in readers):
                readers[0].alerting.observe_loss(step, loss)

    def keep_loss(self, step: int, loss: Tensor | float) -> None:
        """The loss of a step in :attr:`between` but not in :attr:`quiet`: by the plan, a rule of
        some engine reads it (a step of its ``between_probes`` outside its ``quiet``), so it is
        kept without asking each engine. Lightning's loss (a one-element tensor, checked by the
        caller, detached) takes the shortest path: a few objects touched, since a training step
        has left little of them in the CPU's caches."""
        losses = self._losses
        if losses is None:
            return
        if type(loss) is Tensor and not loss.requires_grad:
            losses.append(step, loss)
            return
        check_loss(loss)
        losses.add(step, loss)

    def before_update(self, host: Host, step: int) -> None:
        """An optimizer is about to apply the update after ``step`` updates: the engines that read
        the weights after it take what they compare against (nothing where no read follows)."""
        if step + 1 in self.between:
            return
        for engine in self.weights:
            guarded(
                host,
                engine,
                "copying the query/key rows",
                step,
                partial(engine.before_update, host, step),
            )

    def observe_weights(self, host: Host, step: int, **kwargs: Any) -> None:
        """Measure the weights after ``step`` updates, where that is a probe step."""
        for engine in self.weights:
            guarded(
                host,
                engine,
                "reading the weights",
                step,
                partial(engine.observe_weights, host, step, **kwargs),
                self.engines,
            )

    def finish(self, host: Host, step: int, *, after: int | None = None, **kwargs: Any) -> None:
        """The end of the batch at ``step``: close and log the open windows, measure the weights
        after the batch's update (at ``after``, where the driver reads them there), plan the steps
        ahead, and write the scalars held up to ``step``."""
        self.settle(host)
        finish_windows(host, [e for e in self.engines if e.probing], self.engines)
        if after is not None and after > 0:
            self.observe_weights(host, after, **kwargs)
        for engine in self.engines:
            engine.plan(after if after is not None and engine.reads_weights else step)
        self.between = _common([e.schedule.between_probes for e in self.engines])
        self.quiet = _common([e.schedule.quiet for e in self.engines])
        self.scalars.flush(host, up_to=step)

    def settle(self, host: Host) -> None:
        """Log the probes of earlier steps still on their way to the host (a deferred copy, a
        worker's spectrum), each engine's in order."""
        for engine in self.engines:
            guarded(host, engine, "reading a probe", None, partial(engine.settle, host))

    def finish_validation(self, host: Host, step: int | None = None) -> None:
        """Close and log a validation window, and write what waits up to ``step`` (all of it with
        None)."""
        probing = [e for e in self.engines if e.probing]
        if probing or self.scalars:
            finish_windows(host, probing, self.engines)
            self.scalars.flush(host, up_to=step)

    def abort(self, host: Host | None = None) -> None:
        """Close every open window without logging (idempotent); an engine whose closing raises
        is warned about, and the others are still closed."""
        for engine in self.engines:
            guarded(host or Host(), engine, "closing the probes", None, engine.abort)

    def end(self, host: Host, *, completed: bool = False) -> None:
        """A run's end, on success or failure: close a window left open (unlogged), log the
        weights' values a worker computes (waiting for them), and those still waiting to cross the
        ranks where the run ``completed`` (every rank is here; after a failure they are dropped),
        write the scalars held, draw the last probe's visuals where it drew none, take out the
        switches and wait for the visuals to be written."""
        try:
            self.abort(host)
            self.settle(host)  # a probe on its way to the host is waited for, on any end
            if completed:
                finish_windows(host, [], self.engines)
            for engine in self.weights:  # (only the weights' engines exchange)
                dropped = [step for step, _ in engine.exchange_parts()]
                engine.drop_exchanges()
                if dropped:  # a run that failed: the ranks may not meet again (said, not lost)
                    engine.warn_once(
                        host,
                        "exchanges dropped",
                        f"the run ended in a failure before the values of step(s) {dropped} "
                        "crossed the ranks (heads split across ranks); they are not logged.",
                        logging_rank_only=True,
                    )
            self.scalars.flush(host)
            for engine in self.engines:
                guarded(
                    host,
                    engine,
                    "drawing the last probe",
                    None,
                    partial(engine.publishing.draw_final, host),
                )
        finally:
            self.release()

    def release(self) -> None:
        for engine in self.engines:
            engine.release()

    def state_dict(self) -> dict[str, Any]:
        """One engine's state as it is; several engines' by monitor."""
        if len(self.engines) == 1:
            return self.engines[0].state_dict()
        return {engine.monitor: engine.state_dict() for engine in self.engines}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(self.engines) == 1:
            self.engines[0].load_state_dict(state)
        else:
            for engine in self.engines:
                engine.load_state_dict(state.get(engine.monitor, {}))
        self.between, self.quiet = NO_STEPS, NO_STEPS
