"""Tensors read into Python with as few waits for the device as the device needs.

Every read of a tensor's values by the host (``tolist``, ``float``) makes the host wait for the
work queued on the tensor's device before it. On an accelerator a probe's values are therefore read
in one transfer per device and dtype (one wait), however many layers and metrics they hold; on the
CPU nothing waits, and a concatenation there costs more than it saves, so each tensor is read as
it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["to_python"]


def to_python(tensors: Sequence[Tensor], *, one_transfer: bool | None = None) -> list[list]:
    """Each tensor's values, flattened, as a Python list (``t.reshape(-1).tolist()`` each).

    Args:
        tensors: any shapes, devices and dtypes.
        one_transfer: read the tensors of one device and dtype concatenated, in one transfer;
            ``None`` (the default) does so where any is off the CPU. The values are the same.

    Returns:
        One list per tensor, in order.
    """
    if one_transfer is None:
        one_transfer = any(t.device.type != "cpu" for t in tensors)
    if not one_transfer:
        return [t.reshape(-1).tolist() for t in tensors]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out: list[list] = [[] for _ in tensors]
    for members in groups.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in members]).tolist()
        at = 0
        for i in members:
            count = tensors[i].numel()
            out[i] = flat[at : at + count]
            at += count
    return out
