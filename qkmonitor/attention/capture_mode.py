"""The interceptor: the ``TorchFunctionMode`` that sees the torch calls of one intercepted forward
and hands the attention calls, projections, products and additive masks among them to that
forward's capture (:class:`~qkmonitor.attention.capture_call.ForwardCapture`); this thread's open
intercepted forwards; and ``flex_attention``, a Python function no mode sees, observed by the
names that hold it (:data:`FLEX`)."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from qkmonitor import private_apis
from qkmonitor.attention.capture_call import ForwardCapture
from qkmonitor.attention.compiled import own_class
from qkmonitor.attention.context_parallel import TORCH_SDPA
from qkmonitor.attention.probes import in_side_computation

#: the ways a softmax is called from Python (``F.softmax``, ``torch.softmax``, ``x.softmax``)
_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax)


class Interceptor(TorchFunctionMode):
    """Sees the torch calls of one forward of a module; hands them to that call's state."""

    def __init__(self, call: ForwardCapture) -> None:
        super().__init__()
        self.call = call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = self.call
        if call.in_kernel:  # inside an attention kernel already seen (flex_attention: torch
            return func(*args, **kwargs)  # 2.8's dynamo traces it, and this mode, but not `in`)
        try:  # most calls of a forward are none the capture reads (under tensor parallelism,
            read = func in _READ  # DTensor's own): one set lookup passes them on
        except TypeError:  # an unhashable callable: not one of those
            read = False
        if not read or in_side_computation():  # or qkmonitor's own computation
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention or func is TORCH_SDPA:  # the 2nd: under CP
            call.on_sdpa(args, kwargs)
        elif func in _SOFTMAX:
            call.on_softmax(args, kwargs)
        elif func is F.linear or func is torch.addmm:
            call.on_projection(func, args, kwargs)
        elif func is F.conv2d:
            out = func(*args, **kwargs)
            call.on_conv(args, kwargs, out)
            return out
        elif func is torch.einsum:
            out = func(*args, **kwargs)
            call.on_einsum(args, out)
            return out
        elif func in _MATMUL and len(args) == 2:
            out = func(*args, **kwargs)
            call.on_matmul(*args, out)
            return out
        elif func in _ADD and len(args) == 2 and "alpha" not in kwargs:
            out = func(*args, **kwargs)
            call.masks.on_add(*args, out)
            return out
        elif func in _MASKED_FILL:
            out = func(*args, **kwargs)
            call.masks.on_masked_fill(args, kwargs, out)
            return out
        return func(*args, **kwargs)


_MATMUL = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
#: the ways logits and an additive mask are added (``scores + mask``, ``scores += mask``, ...)
_ADD = (
    torch.add,
    torch.Tensor.add,
    torch.Tensor.add_,
    torch.Tensor.__add__,
    torch.Tensor.__radd__,
    torch.Tensor.__iadd__,
)
_MASKED_FILL = (torch.masked_fill, torch.Tensor.masked_fill, torch.Tensor.masked_fill_)
#: every call :meth:`Interceptor.__torch_function__` hands to the capture
_READ = frozenset(
    (F.scaled_dot_product_attention, TORCH_SDPA, F.linear, torch.addmm, F.conv2d, torch.einsum)
    + _SOFTMAX
    + _MATMUL
    + _ADD
    + _MASKED_FILL
)


def open_calls() -> list[ForwardCapture]:
    """This thread's open intercepted forwards, innermost last (any module's)."""
    calls = getattr(_OPEN, "calls", None)
    if calls is None:
        calls = _OPEN.calls = []
    return calls


def forget_call(call: ForwardCapture) -> None:
    calls = open_calls()
    if call in calls:
        calls.remove(call)


_OPEN = threading.local()


class FlexObserver:
    """``flex_attention`` seen inside an intercepted forward. It is a Python function, not a torch
    function a ``TorchFunctionMode`` sees: while an interception channel is installed, the names
    that hold it (``torch.nn.attention.flex_attention.flex_attention``, and in the namespace of the
    module's class any name bound to it or to ``torch.compile`` of it, found once per file) hold a
    function that hands the call to the innermost intercepted forward of the thread, then runs the
    original. One per
    process (:data:`FLEX`): each name is counted per channel and put back when the last channel
    that holds it goes."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, str], list] = {}  # (id(namespace), name) -> [count, ns, old]
        self._names: dict[int, tuple[str, ...]] = {}  # id(namespace) -> its flex_attention names

    def hold(self, module: nn.Module) -> Callable[[], None]:
        """Observe the flex_attention names ``module``'s forward may call; returns the release."""
        original = _flex_function()
        if original is None:  # torch before 2.5
            return lambda: None
        torch_names = vars(sys.modules[original.__module__])
        keys = [self._patch(torch_names, "flex_attention", original)]
        home = sys.modules.get(own_class(module).__module__)
        if home is not None and vars(home) is not torch_names:
            namespace = vars(home)
            for name in self._names_in(namespace, original):
                value = namespace.get(name)
                observed = getattr(value, "__qkmonitor_observes__", None)
                if value is original or _compiled_of(value) is original or observed is not None:
                    keys.append(self._patch(namespace, name, observed or value))

        def release() -> None:
            for key in keys:
                self._unpatch(key)

        return release

    def _names_in(self, namespace: dict, original: Callable) -> tuple[str, ...]:
        """The names of a module's namespace bound to flex_attention (or to ``torch.compile`` of
        it), read once per namespace: a module binds them at its import."""
        found = self._names.get(id(namespace))
        if found is None:
            found = self._names[id(namespace)] = tuple(
                name
                for name, value in list(namespace.items())
                if value is original
                or _compiled_of(value) is original
                or getattr(value, "__qkmonitor_observes__", None) is not None
            )
        return found

    def _patch(self, namespace: dict, name: str, value) -> tuple[int, str]:
        key = (id(namespace), name)
        held = self._held.get(key)
        if held is None:
            namespace[name] = _observing(value)
            held = self._held[key] = [0, namespace, value]
        held[0] += 1
        return key

    def _unpatch(self, key: tuple[int, str]) -> None:
        held = self._held.get(key)
        if held is None:
            return
        held[0] -= 1
        if held[0] == 0:
            del self._held[key]
            _, namespace, value = held
            name = key[1]
            if getattr(namespace.get(name), "__qkmonitor_observes__", None) is value:
                namespace[name] = value


def _flex_function():
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError:
        return None
    function = getattr(module, "flex_attention", None)
    observed_original = getattr(function, "__qkmonitor_observes__", None)
    return observed_original if observed_original is not None else function


def _compiled_of(value) -> object | None:
    """What ``torch.compile(f)`` compiled (``f``), for a compiled function; else None."""
    return private_apis.compiled_function_original(value)


def _observing(flex: Callable) -> Callable:
    """``flex`` that first hands its call to the thread's innermost intercepted forward."""

    @functools.wraps(flex)
    def observed(query, key, value, *args, **kwargs):
        calls = open_calls()
        call = calls[-1] if calls and not in_side_computation() else None
        if call is None or call.in_kernel:
            return flex(query, key, value, *args, **kwargs)
        call.on_flex(query, key, args, kwargs)
        call.in_kernel = True  # flex's own ops (its eager fallback's softmax) are not the module's
        try:
            return flex(query, key, value, *args, **kwargs)
        finally:
            call.in_kernel = False

    observed.__qkmonitor_observes__ = flex
    return observed


#: the process's observer of flex_attention (:class:`FlexObserver`)
FLEX = FlexObserver()
