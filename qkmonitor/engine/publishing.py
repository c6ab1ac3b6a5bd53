"""An engine's output: its values as tags, scalars to every sink, visuals to the sinks that draw.

:class:`ValuePublisher` builds the tags of :mod:`qkmonitor.output.tags` from the metric catalogue
(layer mean, lowest and highest head, each head with ``per_head``), writes a probe's scalars and
alert counts to the host's sinks on the logging rank, and its alert texts. Visuals (the heatmaps of
the values, an engine's images and histograms) go only to the sinks that draw (``Sink.draws``), as
one job for the process's background :data:`~qkmonitor.output.publisher.PUBLISHER`; a probe that
draws none keeps its visual inputs, and :meth:`ValuePublisher.draw_final` draws the last one.
Engines hand over what to draw (an :class:`AttentionPattern`, a function) and draw nothing
themselves.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor

from qkmonitor.measures.catalogue import MetricSpec, metric
from qkmonitor.measures.transfer import to_python
from qkmonitor.output.dashboards import HeatmapScale, attention_image, grid_of, heatmap_image
from qkmonitor.output.publisher import PUBLISHER
from qkmonitor.output.sinks import Sink
from qkmonitor.output.tags import alert_scalars, alert_tag, head_tag, layer_tag, run_tag, worst_tag

if TYPE_CHECKING:
    from qkmonitor.engine.host import Host

__all__ = [
    "AttentionPattern",
    "Histograms",
    "Images",
    "ValuePublisher",
    "Values",
    "as_rows",
]

#: metric -> one (num_heads,) float CPU tensor per layer ((1,) for per-layer metrics)
Values = dict[str, list[Tensor]]
#: tag -> an (H, W, 3) uint8 image, or a function that draws it
Images = dict[str, np.ndarray | Callable[[], np.ndarray]]
#: tag -> the values of a histogram, or a function that makes them all
Histograms = dict[str, Tensor] | Callable[[], dict[str, Tensor]]


@dataclasses.dataclass(frozen=True)
class AttentionPattern:
    """One head's attention, ``(rows, keys)`` probabilities on the CPU, as an image of
    :data:`Images`: drawn (:func:`qkmonitor.output.dashboards.attention_image`) when it is
    published."""

    probs: Tensor
    title: str = ""

    def __call__(self) -> np.ndarray:
        return attention_image(self.probs, title=self.title)


def as_rows(values: Values | dict[str, list[list]]) -> dict[str, list[list]]:
    """metric -> per layer, its heads' values as Python lists: every tensor read once, and on an
    accelerator all of one device and dtype in one transfer (:func:`~qkmonitor.measures.transfer.
    to_python`)."""
    tensors = [heads for grid in values.values() for heads in grid if isinstance(heads, Tensor)]
    read = iter(to_python(tensors))
    return {
        name: [next(read) if isinstance(heads, Tensor) else list(heads) for heads in grid]
        for name, grid in values.items()
    }


class ValuePublisher:
    """Where one engine's values go, under its prefix.

    Args:
        owner: the engine's name, which starts its warnings.
        prefix: the first part of every tag (``log_key_prefix``).
        per_head: also write each head's value.
        specs: the metrics the engine logs, in its order (the heatmaps' order): whether each is
            per head, its heatmap's bounds.
        visuals_every_n_probes: the visuals' cadence; ``0``: no visuals, none kept for the end.
    """

    def __init__(
        self,
        owner: str,
        prefix: str,
        *,
        per_head: bool,
        specs: Sequence[MetricSpec],
        visuals_every_n_probes: int,
    ) -> None:
        self.owner = owner
        self.prefix = prefix
        self.per_head = per_head
        self.specs = tuple(specs)
        self._by_name = {spec.name: spec for spec in self.specs}
        self.visuals_every_n_probes = visuals_every_n_probes
        #: the last probe's visual inputs when it drew none: (values, step, images, histograms)
        self._undrawn: tuple | None = None
        self._scales: dict[str, HeatmapScale] = {}  # the run's heatmap colour ranges, by metric

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_undrawn": None}

    def forget(self) -> None:
        """A new run: nothing is kept for the run's end."""
        self._undrawn = None
        self._scales = {}

    def spec(self, name: str) -> MetricSpec:
        """The spec of ``name``: the engine's (:attr:`specs`), else the catalogue's."""
        return self._by_name.get(name) or metric(name)

    # -- scalars -------------------------------------------------------------------------------

    def scalars(self, values: Values | dict[str, list[list]], prefix: str) -> dict[str, float]:
        """The scalar tags of one probe: layer mean, lowest and highest head, and (``per_head``)
        every head.

        Args:
            values: metric -> one (heads,) tensor per layer, or those tensors as lists of floats.
            prefix: the tags' first part (``{prefix}/val`` for a validation probe).
        """
        out: dict[str, float] = {}
        for name, grid in as_rows(values).items():
            per_head = self.spec(name).per_head
            for layer, row in enumerate(grid):
                nan = any(math.isnan(v) for v in row)  # a NaN head makes mean and band NaN
                out[layer_tag(prefix, name, layer)] = (
                    math.nan if nan or not row else sum(row) / len(row)
                )
                if not per_head:
                    continue
                out[worst_tag(prefix, name, "min", layer)] = (
                    math.nan if nan or not row else min(row)
                )
                out[worst_tag(prefix, name, "max", layer)] = (
                    math.nan if nan or not row else max(row)
                )
                if self.per_head:
                    for head, value in enumerate(row):
                        out[head_tag(prefix, name, layer, head)] = value
        return out

    def publish(
        self,
        host: Host,
        values: Values,
        rows: dict[str, list[list]],
        step: int,
        *,
        validation: bool,
        draw: bool,
        alert_counts: dict[str, float],
        images: Images,
        histograms: Histograms,
        run_values: dict[str, float] | None = None,
        alert_texts: Sequence[tuple[str, str, int]] = (),
    ) -> None:
        """Write one probe at ``step`` on the logging rank, the only call a probe makes to the
        publisher: its scalars (``rows``, the values read once, and ``run_values`` under
        ``{prefix}/run/{name}``) and, for training probes, the rules' ``alert_counts`` to every
        sink; the texts of the alerts that fired (``alert_texts``: ``(rule, message, step)``,
        under ``{prefix}/alerts/{rule}``) to the sinks that take texts; its visuals to the sinks
        that draw when ``draw``, else kept for :meth:`draw_final`. A validation probe goes under
        ``{prefix}/val`` and has no visuals. Nothing is made where nothing is written (another
        rank, or no sink: a plain loop without a writer)."""
        sinks = host.sinks() if host.is_logging_rank else []
        if not sinks:
            return
        scalars = self.scalars(rows, f"{self.prefix}/val" if validation else self.prefix)
        scalars.update({run_tag(self.prefix, name): v for name, v in (run_values or {}).items()})
        scalars.update(alert_scalars(self.prefix, alert_counts))  # the rules that have fired
        host.write_scalars(scalars, step)  # now, or with the other engines' (ScalarBatch)
        for rule, message, at in alert_texts:
            for sink in sinks:
                sink.log_text(alert_tag(self.prefix, rule), message, at)
        drawing = [sink for sink in sinks if sink.draws]
        if not drawing or validation:
            return
        if draw:
            self._warn_errors(host, PUBLISHER.errors())
            PUBLISHER.submit(partial(self._draw, drawing, values, step, images, histograms))
            self._undrawn = None
        elif self.visuals_every_n_probes:
            self._undrawn = (values, step, images, histograms)  # drawn at the run's end

    # -- visuals -------------------------------------------------------------------------------

    def draw_final(self, host: Host) -> None:
        """At a run's end: draw the visuals of its last probe if that probe drew none (the
        pictures always show the final state)."""
        undrawn, self._undrawn = self._undrawn, None
        if undrawn is None or not host.is_logging_rank:
            return
        drawing = [sink for sink in host.sinks() if sink.draws]
        if drawing:
            PUBLISHER.submit(partial(self._draw, drawing, *undrawn))

    def drain(self) -> None:
        """Wait for every visual submitted so far (before a logger closes); warn about failures."""
        self._warn_errors(None, PUBLISHER.drain())

    def _draw(
        self,
        sinks: list[Sink],
        values: Values,
        step: int,
        images: Images,
        histograms: Histograms,
    ) -> None:
        """Draw a probe's visuals and write them (on the publisher's thread): the heatmaps of
        ``values``, ``images`` (arrays, or functions that draw them), histograms (or a function
        that makes them)."""
        drawn = {
            **self._heatmaps(values, step),
            **{tag: image() if callable(image) else image for tag, image in images.items()},
        }
        for sink in sinks:
            for tag, image in drawn.items():
                sink.log_image(tag, image, step)
            for tag, data in (histograms() if callable(histograms) else histograms).items():
                sink.log_histogram(tag, data, step)

    def _heatmaps(self, values: Values, step: int) -> dict[str, np.ndarray]:
        return {
            f"{self.prefix}/heatmap/{spec.name}": self._heatmap(spec, values[spec.name], step)
            for spec in self.specs
            if spec.heatmap is not None and spec.name in values
        }

    def _heatmap(self, spec, per_layer: list[Tensor], step: int) -> np.ndarray:
        """One metric's heatmap, coloured on the run's range (:class:`HeatmapScale`)."""
        grid = grid_of(per_layer)
        scale = self._scales.setdefault(spec.name, HeatmapScale(spec.heatmap))
        return heatmap_image(grid, *scale.update(grid), title=f"{spec.name} at step {step}")

    def _warn_errors(self, host: Host | None, errors: list[BaseException]) -> None:
        if errors:
            message = (
                f"{self.owner}: writing the visuals failed {len(errors)} time(s) "
                f"({type(errors[0]).__name__}: {errors[0]}); training goes on."
            )
            if host is None:
                warnings.warn(message, RuntimeWarning, stacklevel=4)
            else:
                host.warn(message, RuntimeWarning)
