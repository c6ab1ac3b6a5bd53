"""Autocast switched off around the kernels and the probes' side computations."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["autocast_off"]


def autocast_off(*device_types: str) -> contextlib.AbstractContextManager:
    """A context with autocast disabled: inside, the matmuls run in the dtype the code chose
    (float32 for the kernel's statistics, float32 or float64 for a probe's side computation), not
    bfloat16 or float16, whatever mixed-precision region the caller's forward runs in.

    Args:
        device_types: the device types to disable autocast for; none given: CPU, and CUDA where
            present. A device type without autocast is left alone. For one device type the
            context is ``torch.autocast`` itself (or a null context), which torch.compile traces.
    """
    if not device_types:
        device_types = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    contexts = [
        torch.autocast(device_type, enabled=False)
        for device_type in device_types
        if torch.amp.is_autocast_available(device_type)
    ]
    if len(contexts) == 1:
        return contexts[0]
    return _entered_together(contexts) if contexts else contextlib.nullcontext()


@contextlib.contextmanager
def _entered_together(contexts: list[contextlib.AbstractContextManager]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield
