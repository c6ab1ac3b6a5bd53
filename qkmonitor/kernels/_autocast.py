"""Autocast switched off around the kernels and the probes' side computations."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

__all__ = ["autocast_available", "autocast_off"]


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
        device_types = ("cpu", "cuda") if _cuda_present() else ("cpu",)
    contexts = [
        torch.autocast(device_type, enabled=False)
        for device_type in device_types
        if autocast_available(device_type)
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


def autocast_available(device_type: str) -> bool:
    """``torch.amp.is_autocast_available(device_type)``, read from a table made at import for the
    usual device types: the dynamo of torch 2.4 and 2.8 cannot trace the call (2.13's can): a
    graph break in every compiled attention, and a resumed frame compiled anew at each step."""
    known = _AUTOCAST_AVAILABLE.get(device_type)
    return torch.amp.is_autocast_available(device_type) if known is None else known


def _autocast_table() -> dict[str, bool]:
    table = {}
    for device_type in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "privateuseone"):
        try:
            table[device_type] = torch.amp.is_autocast_available(device_type)
        except RuntimeError:  # a device type this release does not know
            continue
    return table


_AUTOCAST_AVAILABLE = _autocast_table()


@functools.cache
def _cuda_present() -> bool:
    """Whether this process sees a CUDA device, asked once: a CUDA build of torch on a machine
    without a GPU asks NVML anew at each ``torch.cuda.is_available()``, loading the library again
    and leaving its ctypes function types in reference cycles (torch 2.4 - 2.8), at every probe."""
    return torch.cuda.is_available()
