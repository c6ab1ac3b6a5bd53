"""Tensors read into Python in one transfer a device: what a probe makes the training step wait for.

Every read of a tensor's values by the host (``tolist``, ``float``, ``bool``) makes the host wait
for the work queued on the tensor's device before it: the training step stalls while the host
catches up. A probe's values (every layer's and metric's, their undefined marks, the losses its
rules read) are therefore read together: the bytes of all the tensors of one device, concatenated
on that device, cross to the host in one copy, and each tensor is read back from its own bytes
there, exactly (any dtype: a byte copy changes no value).

:class:`HostCopy` starts that copy and reads it later. On a CUDA device the copy goes, without
blocking, into pinned host memory and an event marks its end: nothing waits until :meth:`lists`,
which a caller can put off (to the next step) and ask :meth:`HostCopy.ready` before. On the CPU the
bytes are the tensors' own (nothing to wait for). :func:`to_python` is the copy read at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["HostCopy", "to_python"]


class HostCopy:
    """The values of ``tensors`` (any shapes, devices and dtypes) on their way to the host: one
    copy a device, started at construction.

    Args:
        tensors: what to read; detached and flattened (their autograd history is not kept).
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self._layout = [(t.dtype, t.shape) for t in tensors]
        self._devices = [t.device for t in tensors]
        self._events: list = []
        #: device -> the bytes of its tensors, in order, on the host (once copied)
        self._bytes: dict[torch.device, Tensor] = {}
        for device in dict.fromkeys(self._devices):
            parts = [
                t.detach().reshape(-1).contiguous().view(torch.uint8)
                for t, d in zip(tensors, self._devices)
                if d == device
            ]
            self._bytes[device] = self._start(device, torch.cat(parts) if parts else None)

    def _start(self, device: torch.device, flat: Tensor | None) -> Tensor:
        if flat is None:
            return torch.empty(0, dtype=torch.uint8)
        if device.type != "cuda":
            # another device's bytes in one copy; the CPU's copied too (a few kB: the values
            # never share memory with the tensors they were read from)
            return flat.to("cpu", copy=True)
        host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._events.append(event)
        return host

    @property
    def on_device(self) -> bool:
        """Whether a copy comes from a CUDA device (reading it may wait for the device)."""
        return bool(self._events)

    def ready(self) -> bool:
        """Whether :meth:`tensors` would read without waiting for a device."""
        return all(event.query() for event in self._events)

    def tensors(self) -> list[Tensor]:
        """Each tensor's values on the host, same dtype and shape, in order: after the copies
        have ended (waited for here if they have not)."""
        for event in self._events:
            event.synchronize()
        self._events = []
        at = dict.fromkeys(self._bytes, 0)
        out = []
        for (dtype, shape), device in zip(self._layout, self._devices):
            size = shape.numel() * _itemsize(dtype)
            start, at[device] = at[device], at[device] + size
            data = self._bytes[device][start : start + size]
            if start % _itemsize(dtype):  # a view as ``dtype`` starts at a multiple of its size
                data = data.clone()
            out.append(data.view(dtype).reshape(shape))
        return out

    def lists(self) -> list[list]:
        """Each tensor's values, flattened, as a Python list (what ``t.reshape(-1).tolist()``
        gives), in order (:meth:`tensors`)."""
        return [t.reshape(-1).tolist() for t in self.tensors()]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def to_python(tensors: Sequence[Tensor]) -> list[list]:
    """Each tensor's values, flattened, as a Python list (``t.reshape(-1).tolist()`` each), in
    order, read in one transfer a device (:class:`HostCopy`, waited for now)."""
    return HostCopy(tensors).lists()
