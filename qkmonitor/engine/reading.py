"""A probe's values on their way to the host: one copy an engine a probe, read now or a step later.

An engine's probe ends with tensors on the model's device: its values (metric -> one ``(H,)``
tensor per layer), where a NaN is NaN by definition (``undefined``, the same shape), per-layer
flags its warnings depend on (``notes``), its run values, the training losses its rules read and
the attention patterns it draws. :func:`start_reading` starts the copy of all of them to the host
at once (:class:`~qkmonitor.measures.transfer.HostCopy`: on a GPU one non-blocking copy, nothing
waits); :meth:`ProbeReading.read` waits for it (if it has not ended) and gives them as host
tensors of the same dtypes and shapes and as Python lists (:class:`ReadProbe`), from which the
rules and the sinks go on. Nothing of a probe is read by the host before that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from torch import Tensor

from qkmonitor.engine.host import Host
from qkmonitor.engine.publishing import AttentionPattern
from qkmonitor.measures.transfer import HostCopy

__all__ = ["AtProbe", "ProbeReading", "ReadProbe", "defers", "start_reading"]

#: metric -> per layer, a tensor (or its values as a list)
Grid = dict[str, list[Any]]


@dataclasses.dataclass
class ReadProbe:
    """A probe's values on the host.

    Attributes:
        values: metric -> one host tensor per layer (the probe's, same dtype and shape).
        rows: the same as Python lists of the heads' values.
        undefined: metric -> per layer, the heads' flags (True where a NaN is NaN by definition).
        noted: metric -> the layers whose note was set for any head, in order.
        run_values: name -> the run value, a float.
        losses: the losses copied with the probe, of :attr:`ProbeReading.loss_steps`, in order.
    """

    values: dict[str, list[Tensor]]
    rows: dict[str, list[list]]
    undefined: dict[str, list[list]]
    noted: dict[str, list[int]]
    run_values: dict[str, float]
    losses: list[float]


@dataclasses.dataclass
class ProbeReading:
    """A probe whose values are being copied to the host (:func:`start_reading`).

    Attributes:
        step: the probe's step.
        validation: whether it is a validation probe.
        images, histograms: its visuals, handed on to the sinks as they are.
    """

    step: int
    validation: bool
    images: dict
    histograms: Any
    losses_up_to: int  # the last step whose loss the probe's rules read
    loss_steps: list[int]  # the steps of the losses copied with it
    _grids: tuple[Grid, Grid, Grid, Grid]  # values, undefined, notes, run values ({name: [v]})
    _copy: HostCopy

    @property
    def on_device(self) -> bool:
        """Whether the copy comes from a CUDA device (and reading it may wait)."""
        return self._copy.on_device

    def ready(self) -> bool:
        """Whether :meth:`read` would not wait for a device."""
        return self._copy.ready()

    def read(self) -> ReadProbe:
        """The probe's values on the host (waiting here for the copy if it has not ended)."""
        read = iter(self._copy.tensors())
        values, undefined, notes, run = (_filled(grid, read) for grid in self._grids)
        losses = [float(next(read)) for _ in self.loss_steps]
        self.images = {  # the attention patterns' probabilities, copied with the values
            tag: dataclasses.replace(image, probs=next(read)) if image_copied(image) else image
            for tag, image in self.images.items()
        }
        return ReadProbe(
            values=values,
            rows=_lists(values),
            undefined=_lists(undefined),
            noted={
                name: [i for i, flags in enumerate(layers) if any(flags)]
                for name, layers in _lists(notes).items()
            },
            run_values={name: float(v[0][0]) for name, v in _lists(run).items()},
            losses=losses,
        )


def start_reading(
    step: int,
    values: Grid,
    *,
    validation: bool = False,
    undefined: Grid | None = None,
    notes: Grid | None = None,
    run_values: dict[str, Tensor | float] | None = None,
    losses_up_to: int | None = None,
    losses: list[tuple[int, Tensor]] = (),  # type: ignore[assignment]
    images: dict | None = None,
    histograms: Any = None,
) -> ProbeReading:
    """Start copying a probe's tensors to the host (see the module's docstring): ``values``,
    ``undefined`` and ``notes`` map a metric to one tensor (or list) per layer; ``run_values``
    a name to a one-element tensor or a float; ``losses`` are ``(step, loss tensor)`` pairs, of
    the steps up to ``losses_up_to`` (default ``step``), the last whose loss the rules read."""
    run = {name: [v] for name, v in (run_values or {}).items()}
    grids = (values, undefined or {}, notes or {}, run)
    tensors = [t for grid in grids for layers in grid.values() for t in layers if _is_tensor(t)]
    tensors += [loss for _, loss in losses]
    tensors += [image.probs for image in (images or {}).values() if _copied(image)]
    copy = HostCopy(tensors)
    # the reading keeps no device tensor: what it copies is freed as soon as its engine drops it
    grids = tuple(_emptied(grid) for grid in grids)  # type: ignore[assignment]
    images = {
        tag: dataclasses.replace(image, probs=_COPIED) if _copied(image) else image
        for tag, image in (images or {}).items()
    }
    return ProbeReading(
        step=step,
        validation=validation,
        images=images,
        histograms={} if histograms is None else histograms,
        losses_up_to=step if losses_up_to is None else losses_up_to,
        loss_steps=[s for s, _ in losses],
        _grids=grids,  # type: ignore[arg-type]
        _copy=copy,
    )


class AtProbe:
    """A host as a probe saw it, for the probe's logging at the end of the next batch: the
    learning rate of the probe's step (an alert names the rate of its probe step, not the one a
    scheduler has set since), everything else the host's now."""

    def __init__(self, host: Host, learning_rate: float | None) -> None:
        self._host, self._learning_rate = host, learning_rate

    def learning_rate(self) -> float | None:
        return self._learning_rate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)


def defers(setting: bool | None, reading: ProbeReading) -> bool:
    """Whether a training probe's ``reading`` is logged at the end of the next batch rather than
    now: as the user set it (``defer_reads``), else (``None``) where its copy comes from a CUDA
    device (on a CPU nothing would wait, and the values come a step sooner)."""
    return reading.on_device if setting is None else setting


def _copied(image: Any) -> bool:
    """Whether an image of the probe is an attention pattern whose probabilities are copied to
    the host with its values (drawn later, from the host)."""
    return isinstance(image, AttentionPattern) and _is_tensor(image.probs)


def image_copied(image: Any) -> bool:
    return isinstance(image, AttentionPattern) and image.probs is _COPIED


def _is_tensor(value: Any) -> bool:
    return isinstance(value, Tensor)


#: where a tensor was, in a reading: its values are in the reading's copy
_COPIED: Any = object()


def _emptied(grid: Grid) -> Grid:
    """``grid`` with :data:`_COPIED` for each tensor."""
    return {name: [_COPIED if _is_tensor(t) else t for t in grid[name]] for name in grid}


def _filled(grid: Grid, read: Iterator[Tensor]) -> dict[str, list]:
    """``grid`` with each tensor's place filled by its host copy (the next of ``read``)."""
    return {
        name: [next(read) if t is _COPIED else t for t in layers] for name, layers in grid.items()
    }


def _lists(grid: dict[str, list]) -> dict[str, list[list]]:
    """Each host tensor of ``grid`` as the list of its values (a list or float stays a list)."""
    return {
        name: [
            t.reshape(-1).tolist() if _is_tensor(t) else (list(t) if isinstance(t, list) else [t])
            for t in layers
        ]
        for name, layers in grid.items()
    }
