"""Where an engine's output goes: scalars, texts, images, histograms, the layout and hparams.

A :class:`Sink` is what the engine writes through; it never needs Lightning.
:class:`SummaryWriterSink` writes TensorBoard event files through
``torch.utils.tensorboard.SummaryWriter`` (the plain-loop path); the Lightning callbacks wrap each
of the Trainer's loggers in a sink of its kind (``qkmonitor.callbacks.base``: TensorBoard, W&B,
MLflow, or scalars alone); :class:`MemorySink` keeps everything in lists, for tests and notebooks.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Protocol, runtime_checkable

import numpy as np
from tensorboard.compat.proto.summary_pb2 import Summary
from torch import Tensor

from qkmonitor import private_apis
from qkmonitor.output.layer_runs import LayerRuns

__all__ = [
    "MemorySink",
    "Sink",
    "SummaryWriterSink",
    "check_writer",
    "flatten_hparams",
    "is_summary_writer",
]


@runtime_checkable
class Sink(Protocol):
    """The engine's output channel. Images are HWC uint8 arrays."""

    #: whether images can be written; the engine draws (images, histograms) only for such sinks.
    #: A sink that draws ignores what its backend cannot show: TensorBoard takes everything, W&B
    #: images and histograms, MLflow images and texts; the layout and hparams are TensorBoard's.
    draws: bool

    def log_scalars(self, scalars: dict[str, float], step: int) -> None: ...

    def log_text(self, tag: str, text: str, step: int) -> None: ...

    def log_image(self, tag: str, image: np.ndarray, step: int) -> None: ...

    def log_histogram(self, tag: str, values: Tensor, step: int) -> None: ...

    def log_layout(self, layout: dict) -> None: ...

    def log_hparams(self, params: dict[str, Any], metrics: dict[str, float]) -> None: ...


def is_summary_writer(writer: object) -> bool:
    """Whether ``writer`` is a TensorBoard ``SummaryWriter``: torch's, or tensorboardX's (which
    Lightning's TensorBoardLogger uses where it is installed), told by class, not by the methods an
    object answers (a stand-in answers them all)."""
    from torch.utils.tensorboard import SummaryWriter

    if isinstance(writer, SummaryWriter):
        return True
    return any(
        cls.__name__ == "SummaryWriter" and cls.__module__.partition(".")[0] == "tensorboardX"
        for cls in type(writer).__mro__
    )


def check_writer(writer: object) -> None:
    """Raise ``ValueError`` unless ``writer`` is None, a TensorBoard ``SummaryWriter`` or a
    qkmonitor :class:`Sink` (what ``Monitoring(writer=...)`` takes); a path is answered with the
    writer to make of it."""
    from os import PathLike

    path = isinstance(writer, (str, bytes, PathLike))
    if writer is None or is_summary_writer(writer) or (isinstance(writer, Sink) and not path):
        return
    hint = f": pass `SummaryWriter({str(writer)!r})` (torch.utils.tensorboard)" if path else ""
    raise ValueError(
        "Expected `writer` to be a torch.utils.tensorboard.SummaryWriter, a qkmonitor Sink or "
        f"None, got {type(writer).__name__} {writer!r}{hint}"
    )


class SummaryWriterSink:
    """A ``torch.utils.tensorboard.SummaryWriter`` as a sink.

    A probe's scalars go into one event (``add_scalar`` writes an event per tag, each through the
    writer's bounded queue), and images are PNGs encoded at zlib level 1 (``add_image`` converts
    to float and back and compresses at level 6). TensorBoard reads both as ``add_scalar`` and
    ``add_image`` would have written them. The layout's overlays (``Layout.overlays``) go into the
    layers' own runs too, ``{log_dir}/layers/layer_LL`` (:mod:`qkmonitor.output.layer_runs`).

    Args:
        writer: the writer; the run directory is ``writer.log_dir``.
        scalars: also write scalars (False where another logger writes them, as in Lightning).
    """

    draws = True

    def __init__(self, writer: Any, scalars: bool = True) -> None:
        self.writer = writer
        self._scalars = scalars
        self._layout: Any = None  # a layout with conditional categories, written when known
        self._charted: set[str] = set()  # its conditional categories whose tags were written
        self._layout_pending = False
        self._last_step: int | None = None
        self._layer_runs: LayerRuns | None = None  # the layout's overlays, a run per layer

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        if self._scalars and scalars:
            values = [
                Summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()
            ]
            private_apis.tensorboard_file_writer(self.writer).add_summary(
                Summary(value=values), step
            )
            self.log_layer_runs(scalars, step)
        self.note_scalars(scalars, step)

    def log_layer_runs(self, scalars: dict[str, float], step: int) -> None:
        """The values of the layout's overlays among ``scalars`` (with the logger's prefix, where
        a logger writes the scalars) into the layers' runs; nothing before a layout with
        overlays (``Layout.overlays``)."""
        if self._layer_runs is not None:
            self._layer_runs.write(scalars, step)

    def note_scalars(self, tags: Any, step: int) -> None:
        """The scalar tags written at ``step`` (with the logger's prefix, where a logger writes
        them): a layout with conditional categories is written at the first write of a later
        step than the first probe's (once a probe step's writes are all made) or at the run's end
        (:meth:`write_pending_layout`), with the conditional categories whose tags were written
        by then; again if one more comes."""
        layout = self._layout
        if layout is None:
            return
        if self._layout_pending and self._last_step is not None and step != self._last_step:
            self.write_pending_layout()
        self._last_step = step
        charted = layout.charted(tags) - self._charted
        if charted:
            self._charted |= charted
            self._layout_pending = True

    @property
    def layout_pending(self) -> bool:
        """Whether a layout held back (:meth:`note_scalars`) waits to be written."""
        return self._layout is not None and self._layout_pending

    def write_pending_layout(self) -> None:
        """Write the layout held back (:meth:`note_scalars`), if it is pending."""
        if self._layout is not None and self._layout_pending:
            self._layout_pending = False
            self.writer.add_custom_scalars(self._layout.written(self._charted))

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, global_step=step)

    def log_image(self, tag: str, image: np.ndarray, step: int) -> None:
        """``image``: (H, W, 3) uint8."""
        from PIL import Image

        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(
                f"Expected `image` to be an (H, W, 3) uint8 array, got {image.dtype} {image.shape}"
            )
        png = io.BytesIO()
        Image.fromarray(image).save(png, format="PNG", compress_level=1)
        encoded = Summary.Image(
            height=image.shape[0],
            width=image.shape[1],
            colorspace=3,
            encoded_image_string=png.getvalue(),
        )
        private_apis.tensorboard_file_writer(self.writer).add_summary(
            Summary(value=[Summary.Value(tag=tag, image=encoded)]), step
        )

    def log_histogram(self, tag: str, values: Tensor, step: int) -> None:
        self.writer.add_histogram(tag, values, global_step=step)

    def log_layout(self, layout: dict) -> None:
        """The custom-scalars layout; one with conditional categories
        (:class:`~qkmonitor.output.dashboards.Layout`: the output logits', which a model whose
        forward returns no logits never writes) is held until the first probe's scalars say which
        of them the run writes (:meth:`note_scalars`): one layout a run, without an empty chart.
        """
        overlays = getattr(layout, "overlays", None)
        if overlays and self.log_dir is not None:
            self._layer_runs = LayerRuns(self.log_dir, overlays)
        if getattr(layout, "conditional", None):
            self._layout, self._charted, self._layout_pending = layout, set(), True
            self._last_step = None
        else:
            self.writer.add_custom_scalars(layout)

    def log_hparams(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        """One hparams record in the run itself (``SummaryWriter.add_hparams`` would open a new
        run).

        TensorBoard keeps the first record of a run, so this must come before any other.
        """
        from torch.utils.tensorboard.summary import hparams

        experiment, start, end = hparams(flatten_hparams(params), metrics)
        file_writer = private_apis.tensorboard_file_writer(self.writer)
        for summary in (experiment, start, end):
            file_writer.add_summary(summary)

    def flush(self) -> None:
        self.writer.flush()

    @property
    def log_dir(self) -> str | None:
        """The writer's run directory."""
        return getattr(self.writer, "log_dir", None) or getattr(self.writer, "logdir", None)

    def reset(self) -> None:
        """Drop the writer's event file after a failed write: a TensorBoard writer whose
        background thread failed (its directory gone, read-only or full) refuses every later
        write and raises again when flushed or closed; ``SummaryWriter`` opens a new event file
        at its next write (TensorBoard reads every event file of a run directory)."""
        if self._layer_runs is not None:
            self._layer_runs.reset()
        writer = self.writer
        failed = getattr(writer, "file_writer", None)
        if failed is None:
            return
        try:  # a live writer is closed; a failed one raises at once and is dropped (closing it
            failed.flush()  # would wait on its dead thread)
            failed.close()
        except Exception:  # noqa: BLE001,S110 -- it failed already; what it held is lost
            pass
        writer.file_writer = writer.all_writers = None


class MemorySink:
    """Keeps everything written, in lists: ``scalars`` holds ``(tag, value, step)``."""

    draws = True

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.texts: list[tuple[str, str, int]] = []
        self.images: list[tuple[str, np.ndarray, int]] = []
        self.histograms: list[tuple[str, Tensor, int]] = []
        self.layouts: list[dict] = []
        self.hparams: list[tuple[dict, dict]] = []

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self.scalars.extend((tag, value, step) for tag, value in scalars.items())

    def log_text(self, tag: str, text: str, step: int) -> None:
        self.texts.append((tag, text, step))

    def log_image(self, tag: str, image: np.ndarray, step: int) -> None:
        self.images.append((tag, image, step))

    def log_histogram(self, tag: str, values: Tensor, step: int) -> None:
        self.histograms.append((tag, values, step))

    def log_layout(self, layout: dict) -> None:
        self.layouts.append(layout)

    def log_hparams(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        self.hparams.append((flatten_hparams(params), dict(metrics)))


def flatten_hparams(params: dict[str, Any], parent: str = "") -> dict[str, Any]:
    """Nested dicts as ``a/b`` keys; values TensorBoard cannot show (None, lists, ...) as text."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent}/{key}" if parent else str(key)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if isinstance(value, dict):
            flat.update(flatten_hparams(value, name))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        elif isinstance(value, Tensor) and value.numel() == 1:
            flat[name] = value.item()
        else:
            flat[name] = str(value)
    return flat
