"""Tensor parallelism's own hooks, run out of the interceptor's sight.

DTensor's parallel styles (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ... as
``parallelize_module`` applies them through ``distribute_module``) run as forward pre-hooks and
forward hooks of the modules they split: ``DTensor.from_local`` of a projection's input,
``redistribute`` and ``to_local`` of its output, some forty torch calls per attention layer and
forward. Inside a probed attention forward the interceptor (:mod:`.capture_mode`, a
``TorchFunctionMode``) is on the mode stack and would be handed each of them, and read none: a
cost of tensor parallelism alone, which one process computing the same heads does not pay
(issue 42: a rank's probe costs no more than the reference's plus one collective).

While a channel is installed on an attention module (one probe window), each hook of its
submodules that torch's distributed package defined (``hook.__module__`` under
``torch.distributed``) is replaced, in place in the submodule's hook dictionary (same key, same
order, same ``with_kwargs``/``always_call`` flags), by a wrapper that takes the interceptor off the
top of the torch function mode stack while the hook runs and puts it back after it (``finally``:
also when the hook raises, ``KeyboardInterrupt`` included). A mode entered above the interceptor
is left alone. The submodule's own call (``F.linear`` of its sharded weight) runs between the
hooks and is seen as before. The originals go back when the channel is removed; a hook the
model removed or replaced meanwhile is left as the model left it.

The hooks are found and their wrappers made at each probe (a walk of the attention module's few
submodules, ~10 µs a layer); nothing is kept after it. Compiled forwards are left as they are:
dynamo traces the hooks, and a changed hook would recompile them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import nn

from qkmonitor import private_apis
from qkmonitor.attention.capture_mode import Interceptor

__all__ = ["ParallelHooks"]


class _Swap(NamedTuple):
    """One hook of a submodule: its dictionary and key, the hook and its wrapper."""

    hooks: dict
    key: int
    original: Callable
    wrapped: Callable


def _defined_by_torch_distributed(hook: Callable) -> bool:
    """A hook torch's distributed package defined (not one of this module's wrappers)."""
    module = getattr(hook, "__module__", None) or ""
    return module.startswith("torch.distributed.") and not hasattr(hook, _MARK)


#: the attribute that marks a wrapper of this module's
_MARK = "_qkmonitor_out_of_sight"


def _out_of_sight(hook: Callable, stack: private_apis.FunctionModeOps) -> Callable:
    """``hook``, run with the interceptor taken off the top of the mode stack (if it is there)."""

    def wrapped(*args, **kwargs):
        mode = stack.current()
        if not isinstance(mode, Interceptor):  # not probing, or a mode of the model's own above
            return hook(*args, **kwargs)
        stack.pop()
        try:
            return hook(*args, **kwargs)
        finally:
            stack.push(mode)

    wrapped.__wrapped__ = hook  # what it runs, and under which name a reader looks
    wrapped.__module__ = getattr(hook, "__module__", None)
    setattr(wrapped, _MARK, True)
    return wrapped


def _swaps(module: nn.Module) -> list[_Swap]:
    """The torch.distributed hooks of ``module``'s submodules as they are now, each with a wrapper
    of its own (found and made at each probe: a hook the model added or removed since the last
    one counts, and nothing outlives the probe: a wrapper kept beside its hook would hold it,
    and the module its closure names, for the life of the process). None where this torch lacks
    the private names it needs (:mod:`qkmonitor.private_apis`): the hooks stay in sight."""
    stack = private_apis.function_mode_ops()
    if stack is None:
        return []
    swaps = []
    for sub in module.modules():
        if sub is module:
            continue
        for hooks in private_apis.forward_hook_dicts(sub):
            for key, hook in hooks.items():
                if _defined_by_torch_distributed(hook):
                    swaps.append(_Swap(hooks, key, hook, _out_of_sight(hook, stack)))
    return swaps


class ParallelHooks:
    """Swaps ``module``'s submodules' torch.distributed hooks for their wrappers until
    :meth:`remove`."""

    def __init__(self, module: nn.Module) -> None:
        self._swapped = _swaps(module)
        for swap in self._swapped:
            swap.hooks[swap.key] = swap.wrapped

    def remove(self) -> None:
        """Put the original hooks back where the wrappers still stand."""
        for swap in self._swapped:
            if swap.hooks.get(swap.key) is swap.wrapped:
                swap.hooks[swap.key] = swap.original
        self._swapped = []
