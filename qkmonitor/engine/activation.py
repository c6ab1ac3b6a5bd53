"""Engines that measure the forward pass, and the windows of several closed together.

An :class:`ActivationEngine` opens one probe per layer for a probe window
(:mod:`qkmonitor.attention.probes`): ``open`` opens them, ``finish`` closes them and logs, ``abort``
closes them and logs nothing. Every path closes what it opened. :func:`finish_windows` closes the
windows of several engines, their aggregators reduced across processes in one collective;
:func:`observed_heads`, :func:`refuse_split_heads` and :func:`placed` say which heads a layer's
calls hold (tensor parallelism).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from qkmonitor.attention.adapters import AttentionLayer
from qkmonitor.attention.calls import TENSOR_PARALLEL
from qkmonitor.attention.probes import Probe, ProbeRequest, ProbeResult
from qkmonitor.engine.base import MonitorEngine
from qkmonitor.engine.discovery import check_statistics, report_missing
from qkmonitor.engine.failures import guarded
from qkmonitor.engine.host import Host
from qkmonitor.engine.publishing import Values
from qkmonitor.measures.metrics import reduce_across_ranks
from qkmonitor.measures.sharding import HeadPlacement

__all__ = [
    "ActivationEngine",
    "Window",
    "finish_windows",
    "observed_heads",
    "placed",
    "refuse_split_heads",
]


@dataclasses.dataclass(frozen=True)
class Window:
    """A closed probe window whose measures wait for the reduction across processes: its step,
    whether it was a validation window, and what the engine carries to
    :meth:`ActivationEngine.complete`."""

    step: int
    validation: bool
    carried: Any


def finish_windows(
    host: Host, engines: Sequence[MonitorEngine], beside: Sequence[MonitorEngine] = ()
) -> None:
    """Close the open windows of ``engines`` and log them, the aggregators of the activation
    engines among them reduced across processes together: one collective for all of them under
    DDP (:func:`~qkmonitor.measures.metrics.reduce_across_ranks`). Each splits its finish in two
    (:meth:`ActivationEngine.close_window`, :meth:`ActivationEngine.complete`); an engine of the
    weights (``reads_weights``) finishes whole (:meth:`~MonitorEngine.finish`: its layout probes,
    a read a worker computes), and its values of heads split across ranks
    (``exchange_parts``) ride in the same collective. ``beside``: every engine of the driver (an
    engine that reads none of its layers beside others that do is turned off, not an error:
    :func:`~qkmonitor.engine.failures.guarded`)."""
    # each engine's part guarded: a metric problem is one warning naming its layers, never the
    # end of the run (engine/failures.py)
    windows = [(engine, _close(host, engine, beside)) for engine in engines]
    closed = [(engine, window) for engine, window in windows if window is not None]
    # the reads whose heads are split across ranks cross them in the same collective
    reads = [
        (engine, step, parts)
        for engine in beside
        if engine.reads_weights
        for step, parts in engine.exchange_parts()
    ]
    try:
        merged = reduce_across_ranks(
            [m for engine, _ in closed for m in engine.aggregators()],
            [part for _, _, parts in reads for part in parts],
        )
    except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
        for engine, window in closed:
            engine.discard()
            engine.warn_failure(host, "reducing across processes", window.step, err)
        for engine, step, _ in reads:
            engine.drop_exchanges()
            engine.warn_failure(host, "exchanging the heads across processes", step, err)
        return
    completions = []
    for engine, step, parts in reads:  # a step's weights before its activations
        mine, merged = merged[: len(parts)], merged[len(parts) :]
        completions.append((step, 0, engine, partial(engine.complete_exchange, host, step, mine)))
    for engine, window in closed:
        completions.append((window.step, 1, engine, partial(engine.complete, host, window)))
    for step, _, engine, complete in sorted(completions, key=lambda c: c[:2]):
        guarded(host, engine, "computing", step, complete)


def _close(host: Host, engine: MonitorEngine, beside: Sequence[MonitorEngine]) -> Window | None:
    """Close ``engine``'s window, guarded: an activation engine's probes closed and added to its
    aggregators (the :class:`Window` to complete after the reduction); any other engine finished
    whole (None)."""
    if isinstance(engine, ActivationEngine):
        work, step = partial(engine.close_window, host), engine.window_step
    else:
        work, step = partial(engine.finish, host), None
    return guarded(host, engine, "measuring", step, work, beside)


class ActivationEngine(MonitorEngine):
    """An engine that measures the forward pass through probes (:mod:`qkmonitor.attention.probes`).

    Subclasses say what they want (:meth:`_request`), may install more for the window
    (:meth:`_open_extra` / :meth:`_close_extra`, e.g. block hooks), add the probes' results to
    their aggregators (:meth:`_accumulate`) and turn those, once reduced across processes, into
    values (:meth:`_values`).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._probes: list[Probe] = []
        self._window: tuple[int, bool] | None = None
        self._measurable: list[bool] = []

    @property
    def probing(self) -> bool:
        """Whether a probe window is open, or a probe's values wait to be logged."""
        return self._window is not None or bool(self._readings)

    def _prepare(self, model: nn.Module) -> None:
        self._first_window = True  # a first window that reads no layer is an error, later ones not
        self._measurable = check_statistics(type(self).__name__, self.layers)

    def _request(self) -> ProbeRequest:
        return ProbeRequest()

    def _probed_modules(self) -> list[nn.Module]:
        return [
            layer.module for layer, measurable in zip(self.layers, self._measurable) if measurable
        ]

    def open(self, step: int, *, validation: bool = False) -> bool:
        if (
            self._window is not None
            or not self.layers
            or (not validation and not self.schedule.is_probe_step(step))
            or self.without_data()
        ):
            return False
        self.switches.before_window(self._probed_modules)
        self._window = (step, validation)
        try:
            request = self._request()
            for layer, measurable in zip(self.layers, self._measurable):
                self._probes.append(
                    layer.open_probe(request) if measurable else Probe(layer.name, request)
                )
            self._open_extra()
            self.switches.open_window()
        except BaseException:
            self.abort()
            raise
        return True

    def _open_extra(self) -> None:
        """Install what the window needs beyond the layer probes."""

    def _close_extra(self) -> None:
        """Remove what :meth:`_open_extra` installed; idempotent."""

    def close_probes(self) -> list[ProbeResult]:
        """Close every open probe (each one, even if another fails) and return their results."""
        probes, self._probes, self._window = self._probes, [], None
        self.switches.close_window()
        results, error = [], None
        for probe in probes:
            try:
                results.append(probe.close())
            except Exception as err:  # noqa: BLE001 -- close the rest first
                error = error or err
        try:
            self._close_extra()
        finally:
            if error is not None:
                raise error
        return results

    def abort(self) -> None:
        self.close_probes()

    @property
    def window_step(self) -> int | None:
        return None if self._window is None else self._window[0]

    def discard(self) -> None:
        try:
            self.close_probes()
        finally:
            for aggregator in self.aggregators():
                aggregator.reset()

    def finish(self, host: Host) -> None:
        window = self.close_window(host)
        if window is not None:
            reduce_across_ranks(self.aggregators())
            self.complete(host, window)

    def close_window(self, host: Host) -> Window | None:
        """The first half of :meth:`finish`: close the open probes and add what they measured to
        this process's aggregators (no collective); None when no window is open."""
        if self._window is None:
            return None
        step, validation = self._window
        results = [refuse_split_heads(lay, r) for lay, r in zip(self.layers, self.close_probes())]
        first, self._first_window = self._first_window, False
        report_missing(self, host, results, self._measurable, first=first)
        with torch.no_grad():
            carried = self._accumulate(
                results, step, visuals=not validation and self.schedule.draws_visuals(step)
            )
        return Window(step, validation, carried)

    def aggregators(self) -> list[Metric]:
        """The torchmetrics states a window adds to, reduced across processes before
        :meth:`complete` (:func:`~qkmonitor.measures.metrics.reduce_across_ranks`)."""
        return []

    def complete(self, host: Host, window: Window) -> None:
        """The second half of :meth:`finish`, once the aggregators hold every process's share:
        the values, recorded (alerts, tags) at the window's step."""
        with torch.no_grad():
            values, extra = self._values(window.carried)
        self.record(host, values, window.step, validation=window.validation, **extra)

    def _accumulate(self, results: list[ProbeResult], step: int, *, visuals: bool) -> Any:
        """Add the closed probes' results (one per layer, of the window at ``step``) to the
        aggregators; return what :meth:`_values` needs after the reduction (an engine without
        aggregators: the values themselves). Images only where ``visuals``."""
        raise NotImplementedError

    def _values(self, carried: Any) -> tuple[Values, dict[str, Any]]:
        """The values (metric -> one ``(num_heads,)`` tensor per layer) and extra ``record``
        arguments, from the reduced aggregators and what :meth:`_accumulate` carried."""
        raise NotImplementedError


def observed_heads(layer: AttentionLayer, result: ProbeResult, count: int) -> int:
    """A layer's query heads as its probe saw them: all ranks' where its calls are this rank's part
    (tensor parallelism), those of its calls where the layer did not know them before (read by
    interception), else ``count``."""
    if result.placement is not None:
        return result.placement.total
    return result.stats[0].entropy.shape[1] if result.stats and not layer.layout_ready else count


def refuse_split_heads(layer: AttentionLayer, result: ProbeResult) -> ProbeResult:
    """``result``, or a refusal where the layer's calls hold a part of the query heads its
    weights give (a divisor of H) and do not say which: its heads split across ranks (tensor
    parallelism) by a family that gives no placement of them, so no per-head value of this rank's
    calls is the layer's. A refused result is NaN, with one warning naming the layer on the
    logging rank (:func:`~qkmonitor.engine.discovery.report_missing`)."""
    if result.placement is not None or not result.calls or not layer.layout_ready:
        return result
    measured = (*(s.entropy for s in result.stats), *result.probs, *result.max_logits)
    seen = {t.shape[1] for t in measured if t.dim() > 1}
    try:
        heads = layer.num_heads_hint
    except Exception:  # noqa: BLE001 -- the weights' own read warns
        return result
    if not seen or not all(0 < s < heads and heads % s == 0 for s in seen):
        return result
    reason = (
        f"its attention calls hold {min(seen)} of the {heads} query heads its weights give: "
        f"its heads are split across ranks ({TENSOR_PARALLEL}), and {layer.kind} does not "
        "say which of them this rank holds; its attention statistics are not measured"
    )
    return ProbeResult(sharded=[reason])


def placed(slots: slice, placement: HeadPlacement | None) -> slice:
    """The slots of a layer's heads (``slots``, all of them) that this rank's calls fill: where
    they are this rank's part (tensor parallelism), those of its heads; the other ranks' stay
    at the aggregator's neutral value (0, or -inf for a maximum), so the sum across ranks is
    exact."""
    if placement is None:
        return slots
    return slice(slots.start + placement.offset, slots.start + placement.offset + placement.count)
