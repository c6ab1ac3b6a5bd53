"""The training losses the rules read: checked as they come, kept as tensors, read when a probe
needs them (:class:`LossHistory`)."""

from __future__ import annotations

import math
from collections import deque

import torch
from torch import Tensor

from qkmonitor.alerts import LOSS_SMOOTHING
from qkmonitor.measures.transfer import to_python
from qkmonitor.validation import is_real

__all__ = ["LossHistory", "check_loss"]


def check_loss(loss: object) -> None:
    """Raise ``ValueError`` unless ``loss`` is one training loss: a real number (NaN and inf
    included: a diverged loss is a loss) or a real tensor of one element. Read nothing from the
    device."""
    if isinstance(loss, Tensor):
        ok = loss.numel() == 1 and not (loss.dtype == torch.bool or loss.is_complex())
    else:
        ok = is_real(loss)
    if not ok:
        got = (
            f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, Tensor)
            else f"{type(loss).__name__} {loss!r}"
        )
        raise ValueError(
            f"Expected `loss` to be a number or a tensor of one element (the step's mean loss), "
            f"got {got}"
        )


class LossHistory:
    """The training losses kept for the rules that read them: the last ``maxlen`` as ``(step,
    loss)``, and the run's first :data:`~qkmonitor.alerts.LOSS_SMOOTHING`. A loss is kept as the
    tensor it came as, without autograd history, and read from the device only when a probe needs
    it: copied with the probe's values (:meth:`unread`, :meth:`fill`), or, where they were not,
    every unread one in one copy."""

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self._losses: deque[tuple[int, Tensor | float]] = deque(maxlen=maxlen)
        self._first: list[tuple[int, Tensor | float]] = []

    def __len__(self) -> int:
        return len(self._losses)

    def clear(self) -> None:
        self._losses.clear()
        self._first = []

    def add(self, step: int, loss: Tensor | float) -> None:
        """Keep the loss of ``step`` (Lightning's loss is already detached, and kept as it is)."""
        if isinstance(loss, Tensor):
            loss = loss.detach() if loss.requires_grad else loss
        else:
            loss = float(loss)
        self.append(step, loss)

    def append(self, step: int, loss: Tensor | float) -> None:
        """Keep ``loss``, a float or a tensor without autograd history, as it is."""
        self._losses.append((step, loss))
        if len(self._first) < LOSS_SMOOTHING:
            self._first.append((step, loss))

    def unread(self, up_to: int) -> list[tuple[int, Tensor]]:
        """The losses of the steps up to ``up_to`` still held as tensors, ``(step, loss)``, one a
        step, to be copied to the host with a probe's values and handed back to :meth:`fill`."""
        seen: dict[int, tuple[int, Tensor]] = {}
        for step, loss in (*self._first, *self._losses):
            if isinstance(loss, Tensor) and step <= up_to:
                seen.setdefault(step, (step, loss))
        return list(seen.values())

    def fill(self, read: list[tuple[int, float]]) -> None:
        """Replace the loss tensors of the steps of ``read`` (:meth:`unread`'s steps, with the
        values read) by those values."""
        floats = dict(read)
        for pairs in (self._losses, self._first):
            kept = [(s, floats.get(s, v) if isinstance(v, Tensor) else v) for s, v in pairs]
            pairs.clear()
            pairs.extend(kept)

    def _read(self, up_to: int) -> None:
        """Read the tensors of the steps up to ``up_to`` still unread, in one copy."""
        unread = self.unread(up_to)
        if unread:
            values = to_python([v for _, v in unread])
            self.fill([(s, v[0]) for (s, _), v in zip(unread, values)])

    def first(self, up_to: int | None = None) -> float | None:
        """The mean of the first finite losses kept (of the steps up to ``up_to``)."""
        up_to = math.inf if up_to is None else up_to  # type: ignore[assignment]
        self._read(up_to)  # type: ignore[arg-type]
        values = [v for s, v in self._first if s <= up_to and math.isfinite(v)]
        return sum(values) / len(values) if values else None

    def history(self, up_to: int | None = None) -> list[tuple[int, float]]:
        """The kept ``(step, loss)`` pairs (of the steps up to ``up_to``) as floats, oldest
        first."""
        up_to = math.inf if up_to is None else up_to  # type: ignore[assignment]
        self._read(up_to)  # type: ignore[arg-type]
        return [(s, v) for s, v in self._losses if s <= up_to]  # type: ignore[misc]

    def restore(self, losses: list, first: float | None) -> None:
        """The state of a checkpoint: the kept pairs and the first losses' mean."""
        self._losses.clear()
        self._losses.extend((int(s), float(v)) for s, v in losses)
        self._first = [] if first is None else [(-1, float(first))] * LOSS_SMOOTHING
