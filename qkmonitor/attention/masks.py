"""Additive masks a module adds to its logits itself, seen inside an intercepted forward.

A module that builds its logits and calls a softmax hands qkmonitor one tensor, in which a masked
key and a very low logit look alike. But the capture (:mod:`.capture`) sees every torch call of
the forward, so it sees the mask go in: an ``add`` (``+``, ``+=``, ``add_``) one of whose operands
is a **mask** — a floating tensor without a gradient whose entries are all 0 or at or below
:data:`~qkmonitor.attention.calls.MASK_FLOOR` (``-inf`` included), at least one of them below —
or a ``masked_fill`` with a value at or below the floor. Its result is remembered with the keys
it blocks (those entries); a later add to that result adds its own; a softmax whose input is that
result (or a view of it with the same elements in the same order) has those keys blocked, as
SDPA's additive mask blocks them (docs/metrics.md, "Masked keys"). HF Swinv2 adds its shifted
windows' ``-100`` twice (``-200``), timm Swin once, older BERTs ``-10000``: all are read as masks.
"""

from __future__ import annotations

from numbers import Real

import torch
from torch import Tensor

from qkmonitor.attention.calls import MASK_FLOOR

__all__ = ["AdditiveMasks", "mask_blocks"]


def mask_blocks(operand: object) -> Tensor | None:
    """Where ``operand`` blocks keys if it is an additive mask (bool, its shape), else None: a
    floating tensor of at least 2 dims without a gradient, every entry 0 or at or below
    :data:`MASK_FLOOR`, at least one below."""
    if (
        not isinstance(operand, Tensor)
        or operand.dim() < 2
        or not operand.is_floating_point()
        or operand.requires_grad
    ):
        return None
    low = operand <= MASK_FLOOR
    if not bool(low.any()) or not bool((low | (operand == 0)).all()):
        return None
    return low


class AdditiveMasks:
    """The masked tensors of one forward: each result of a mask added (or filled in) with the
    keys it blocks. The results are held (detached: no copy) until the forward ends, so that no
    other tensor can take their memory and be mistaken for one of them."""

    def __init__(self) -> None:
        self._held: list[tuple[Tensor, Tensor]] = []  # (result, blocked of its shape), newest last

    def on_add(self, a: object, b: object, out: object) -> None:
        """``a + b`` (or in place): remember ``out`` if one operand is a mask."""
        if not isinstance(out, Tensor) or out.dim() < 2:
            return
        blocked, other = mask_blocks(b), a
        if blocked is None:
            blocked, other = mask_blocks(a), b
        if blocked is None:
            return
        self._hold(out, blocked, other)

    def on_masked_fill(self, args: tuple, kwargs: dict, out: object) -> None:
        """``x.masked_fill(mask, value)`` (or in place) with a value at or below the floor."""
        call = dict(zip(("input", "mask", "value"), args)) | kwargs
        x, where, value = call.get("input"), call.get("mask"), call.get("value")
        if isinstance(value, Tensor) and value.numel() == 1:
            value = float(value)
        if not (
            isinstance(out, Tensor)
            and isinstance(where, Tensor)
            and where.dtype == torch.bool
            and isinstance(value, Real)
            and value <= MASK_FLOOR
        ):
            return
        self._hold(out, where, x)

    def _hold(self, out: Tensor, blocked: Tensor, operand: object) -> None:
        try:
            blocked = blocked.expand(out.shape)
        except RuntimeError:  # not broadcast into the result: not a mask of these logits
            return
        earlier = self.blocked(operand) if isinstance(operand, Tensor) else None
        if earlier is not None:
            blocked = blocked | earlier
        self._held.append((out.detach(), blocked))

    def blocked(self, x: Tensor) -> Tensor | None:
        """The keys blocked in ``x`` (bool, its shape) by the masks added to it: ``x`` is one of
        the results held, or a view of one with its elements in the same order; else None."""
        for held, blocked in reversed(self._held):
            try:
                same = x.data_ptr() == held.data_ptr() and x.numel() == held.numel()
            except RuntimeError:  # a tensor without storage of its own (a subclass)
                return None
            if not same:
                continue
            if x.shape == held.shape and x.stride() == held.stride():
                return blocked
            if x.is_contiguous() and held.is_contiguous():
                return blocked.reshape(x.shape)
            return None
        return None

    def clear(self) -> None:
        """Forget the results held (a softmax has read them)."""
        self._held.clear()
