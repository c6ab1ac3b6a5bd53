"""A run per layer: the overlay charts' series, where TensorBoard colours the layers apart.

TensorBoard's custom-scalars charts colour their lines by run, never by tag, so the layers of one
run are lines of one colour. Each layer's series of an overlay ("a line per layer",
:attr:`~qkmonitor.output.dashboards.Layout.overlays`) is therefore also written, beside the run's
own ``{prefix}/{metric}/layer_LL``, as ``{prefix}/{metric}`` into a run of the layer's own:
``{log_dir}/layers/layer_LL``, which TensorBoard lists as ``{run}/layers/layer_LL`` with a colour
of its own. The sink that writes the run's scalars writes these too (a TensorBoard sink, on the
rank that logs), at the same steps; the run's own tags are unchanged, and what reads a run
(:mod:`qkmonitor.output.runs`, ``qkmonitor report``) leaves the layers' runs out.

A model of more than :data:`LAYER_RUNS_MAX` layers gets none: TensorBoard's run selector turns on
no run at all by default where a logdir holds more than 40 runs, and its palette has 7 colours.

A layer's events are appended to one event file, opened and closed at each write (a few hundred
bytes a probe): no thread, no file held open between probes. A write that fails raises, for the
sink's guard to count (:mod:`qkmonitor.output.guard`); the run's directory is never made again
where it is gone.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from qkmonitor.output.tags import layer_tag_regex

__all__ = [
    "LAYER_RUNS_DIR",
    "LAYER_RUNS_MAX",
    "LayerRuns",
    "is_layer_run",
    "layer_run_dir",
    "overlay_chart",
]

#: the folder of a run's directory that holds its layers' runs
LAYER_RUNS_DIR = "layers"
#: the most layers that get runs of their own (beyond, a model's overlays stay in its run)
LAYER_RUNS_MAX = 12

_LAYER_TAG = re.compile(r"^(?P<base>.+)/layer_(?P<layer>\d+)$")
_LAYER_RUN = re.compile(r"layer_\d+")


def layer_run_dir(log_dir: str | os.PathLike, layer: int) -> Path:
    """``{log_dir}/layers/layer_LL``: the run of layer ``layer``."""
    return Path(log_dir) / LAYER_RUNS_DIR / f"layer_{layer:02d}"


def is_layer_run(folder: Path) -> bool:
    """Whether ``folder`` is a layer's run (``{run}/layers/layer_LL``), part of the run above."""
    return folder.parent.name == LAYER_RUNS_DIR and bool(_LAYER_RUN.fullmatch(folder.name))


def overlay_chart(overlays: set[str], prefix: str, metric: str, num_layers: int) -> list:
    """The custom-scalars chart of ``metric``'s overlay: ``{prefix}/{metric}`` in the layers' runs
    (added to ``overlays``, what the sinks write there), or beyond :data:`LAYER_RUNS_MAX` layers
    the run's own ``{prefix}/{metric}/layer_LL`` (lines of one colour)."""
    if num_layers > LAYER_RUNS_MAX:
        return ["Multiline", [layer_tag_regex(prefix, metric)]]
    overlays.add(base := f"{prefix}/{metric}")
    return ["Multiline", [f"^{re.escape(base)}$"]]


class LayerRuns:
    """The layers' runs of one run directory, written at each probe.

    Args:
        log_dir: the run's directory.
        overlays: the series to write there, ``{prefix}/{metric}`` (the layout's overlays): a
            scalar ``{prefix}/{metric}/layer_LL`` goes to layer LL's run as ``{prefix}/{metric}``.
    """

    def __init__(self, log_dir: str | os.PathLike, overlays: Iterable[str]) -> None:
        self.log_dir = Path(log_dir)
        self.overlays = set(overlays)
        self._files: dict[int, Path] = {}

    def write(self, scalars: Mapping[str, float], step: int) -> None:
        """The overlays' values among ``scalars`` (the run's tags), each into its layer's run: one
        event a layer."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        by_layer: dict[int, list] = {}
        for tag, value in scalars.items():
            match = _LAYER_TAG.match(tag)
            if match is not None and match["base"] in self.overlays:
                by_layer.setdefault(int(match["layer"]), []).append(
                    Summary.Value(tag=match["base"], simple_value=float(value))
                )
        now = time.time()
        for layer, values in sorted(by_layer.items()):
            self._append(layer, {"wall_time": now, "step": step, "summary": Summary(value=values)})

    def _append(self, layer: int, fields: dict) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        events = [Event(**fields)]
        path = self._files.get(layer)
        if path is None or not path.exists():  # a new file begins with its version, as TB's do
            path = self._new_file(layer)
            events.insert(0, Event(wall_time=fields["wall_time"], file_version="brain.Event:2"))
        with open(path, "ab") as file:
            records = RecordWriter(file)
            for event in events:
                records.write(event.SerializeToString())

    def _new_file(self, layer: int) -> Path:
        folder = layer_run_dir(self.log_dir, layer)
        for part in (folder.parent, folder):  # not the run's directory: a run gone stays gone
            try:
                os.mkdir(part)
            except FileExistsError:
                pass
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        path = self._files[layer] = folder / f"{name}.{id(self)}"
        return path

    def reset(self) -> None:
        """Forget the event files: the next write opens new ones (after a failed write, as the
        run's writer does)."""
        self._files.clear()
