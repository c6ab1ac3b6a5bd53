"""Tensor parallelism's own hooks, run out of the interceptor's sight.

DTensor's parallel styles (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ... as
``parallelize_module`` applies them) run as forward pre-hooks and forward hooks of the modules
they split: ``DTensor.from_local`` of a projection's input, ``redistribute`` and ``to_local`` of
its output, about forty torch calls per attention layer and forward. Inside a probed attention
forward the interceptor (:mod:`.capture_mode`, a ``TorchFunctionMode``) would see each of them
and read none: a cost of tensor parallelism alone, which one process computing the same heads
does not pay (issue 42: a rank's probe costs no more than the reference's plus one collective).

While a channel is installed on an attention module, each of its submodules that holds DTensor
parameters and hooks of its own gets a hook before its first pre-hook and one before its first
forward hook that take the interceptor off the torch function mode stack (only where it is on
top: another mode entered above it is left alone), and one after its last pre-hook and after its
last forward hook that put it back, the latter also when the forward or a hook raises
(``always_call``). The submodule's own call (``F.linear`` of its sharded weight, between the
two) is seen as before. What was taken off is kept per thread, and
:meth:`ParallelHooks.remove` puts it back where a ``BaseException`` skipped the hooks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode, _push_mode

from qkmonitor.attention.installs import add_hooks
from qkmonitor.measures.sharding import is_dtensor

__all__ = ["ParallelHooks", "parallel_styled"]


def parallel_styled(module: nn.Module) -> list[nn.Module]:
    """The submodules of ``module`` (itself left out) whose own hooks are a parallel style's:
    they hold DTensor parameters and have forward pre-hooks or forward hooks."""
    return [
        sub
        for sub in module.modules()
        if sub is not module
        and (sub._forward_pre_hooks or sub._forward_hooks)
        and any(is_dtensor(p) for p in sub.parameters(recurse=False))
    ]


class ParallelHooks:
    """Steps the interceptor ``mode_of()`` names (the thread's innermost open one, or None) out
    of the parallel-style hooks of ``module``'s submodules; :meth:`remove` takes the hooks off."""

    def __init__(self, module: nn.Module, mode_of: Callable[[], TorchFunctionMode | None]) -> None:
        self._mode_of = mode_of
        self._off = threading.local()  # .modes: what each hook pair took off, per submodule
        self._removals = [self._install(sub) for sub in parallel_styled(module)]

    def _install(self, sub: nn.Module) -> Callable[[], None]:
        key = id(sub)

        def step_out(*_) -> None:
            mode = self._mode_of()
            if mode is not None and _get_current_function_mode() is mode:
                self._taken()[key] = _pop_mode()

        def step_in(*_) -> None:
            mode = self._taken().pop(key, None)
            if mode is not None:
                _push_mode(mode)

        handles = [
            sub.register_forward_pre_hook(step_out, prepend=True),
            sub.register_forward_pre_hook(step_in),
            sub.register_forward_hook(step_out, prepend=True),
            sub.register_forward_hook(step_in, always_call=True),
        ]
        return add_hooks(sub, handles)

    def _taken(self) -> dict[int, TorchFunctionMode]:
        modes = getattr(self._off, "modes", None)
        if modes is None:
            modes = self._off.modes = {}
        return modes

    def remove(self) -> None:
        """Take the hooks off; put back on this thread's stack what a hook pair took off and
        left off (a ``BaseException`` skips ``always_call`` hooks)."""
        for removal in self._removals:
            removal()
        self._removals = []
        for mode in self._taken().values():
            _push_mode(mode)
        self._taken().clear()
