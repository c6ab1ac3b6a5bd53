r"""Capture: seeing the torch calls of one module's forward while a probe is open on it.

While a probe is open on a module, and only inside that module's forward, a
``torch.overrides.TorchFunctionMode`` sees every torch call it makes. Two of them are attention:

- ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)``:
  the call's own q ``(B, H, N, D)``, k ``(B, H_kv, M, D)``, mask (bool: True = attend, or
  additive), ``is_causal`` (top-left aligned, as SDPA defines it) and scale become a
  :class:`~qkmonitor.attention.calls.MaskedCall`, measured by the fused kernel where the mask
  allows;
- a softmax over the last dim of a 4-D tensor ``(B, H, N, M)``: the logits the module computed,
  which already hold its additive mask, ALiBi, relative bias or soft-capping, become a
  :class:`~qkmonitor.attention.calls.ScoresCall` (``-inf`` and ``finfo.min``-like entries are
  blocked keys, and so are the keys of an additive mask seen added to those logits in the
  forward, :mod:`.masks`; other finite logits at or below ``MASK_FLOOR`` count as keys, and are
  named once per module in a warning).

Leading dims other than the heads (``(B, windows, H, N, D)``, timm Twins; ``(B, H, blocks, N, D)``,
timm NesT, its heads found by the layer's head count, or by strides where blocks and heads are as
many: :mod:`.capture_heads`) are folded into the batch: each window or block is an attention
problem of its own. Refused by name, as an :class:`~qkmonitor.attention.calls.UnreadCall` with the
reason: a softmax after a Linear, a convolution or an ``einsum`` over the heads of ``q·kᵀ``
(talking heads, timm CaiT, EfficientFormerV2, x-transformers: the queries' and keys' layout is
still checked, κ is a property of the weights), one over channels (``q·kᵀ`` contracting the
projections' tokens, its rows a head's channels: timm XCiT, whose weights then have no W_QK over
tokens either), two softmaxes of one forward over the same keys, of ``q·kᵀ`` and of logits no
``q·kᵀ`` gave (timm ConViT's GPSA, content and position mixed by a gate: the softmax calls of a
forward are handed on at its next call or its end, so that this is seen), and queries whose heads
no shape or stride tells from their blocks.

The mode is entered by the probe's forward pre-hook and left by its forward hook, which runs on
an exception too (``always_call``; a ``BaseException`` skips it, and the channel unwinds the call
when the probe closes); both hooks are removed when the last probe on the module closes. An
unprobed step installs nothing. What one forward captures is its own
(:class:`~qkmonitor.attention.capture_call.ForwardCapture`, per thread). Statistics are computed
on the side under ``no_grad`` in float32 or better; the model's call runs with its own arguments
and its result is returned unchanged. The projections' inputs and the first call's queries and
keys are kept for the layout check (:mod:`.layout_check`), and for a softmax over ``q @ kᵀ``
the factor between that product and the logits it got
(:func:`~qkmonitor.attention.layout_check.product_scale`): the scale a module applies after the
product, which the queries and keys alone do not show.

This module holds the channel (:class:`InterceptChannel`: the hooks, the open forwards, the
warnings) and :func:`route_probe`; the mode is :mod:`.capture_mode`, a forward's state
:mod:`.capture_call`, the calls it builds :mod:`.capture_builders`, and tensor parallelism's own
hooks on the module's projections, run with the mode off, :mod:`.parallel_hooks`. None of them
imports this module: a forward's capture names what it reads of its channel by a protocol
(:class:`~qkmonitor.attention.capture_call.CaptureChannel`).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable

from torch import Tensor, nn

from qkmonitor.attention.calls import MASK_FLOOR, UnreadCall
from qkmonitor.attention.capture_call import ForwardCapture
from qkmonitor.attention.capture_mode import FLEX, Interceptor, forget_call, open_calls
from qkmonitor.attention.compiled import add_forward_hooks, switch_of
from qkmonitor.attention.layout_names import HEADS_NAMES, attribute
from qkmonitor.attention.parallel_hooks import ParallelHooks
from qkmonitor.attention.probes import Probe
from qkmonitor.attention.route import Channel, Route

#: the capture's warnings given for each module (each is given once per module, whichever
#: monitor's probe made the channel that saw it): weak per module
_TOLD: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


class InterceptChannel(Channel):
    """A module's calls intercepted while it runs: the hooks that enter and leave the
    interception. What one forward captures is that call's own (:class:`ForwardCapture`), on a
    stack per thread: a module called again inside its own forward, or from several threads at once
    (``nn.DataParallel`` replicas share the module's ``__dict__``), keeps each call's evidence
    apart."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.heads: int | None = None  # the query heads, where the layer knows them before a call
        #: per probe that asks for the projections' inputs (a layout check), the function that
        #: names those weights; read at each forward's entry, so that the weights are the objects
        #: the forward computes with (FSDP2 hands F.linear unsharded parameters of its own)
        self.sources: dict[object, Callable[[], list[Tensor]]] = {}
        #: the head count a 3-D (B·H, N, M) softmax is split by, where the module names one
        self.split_heads: int | None = attribute(module, HEADS_NAMES)
        self._threads = threading.local()  # .calls: this thread's open calls, innermost last
        self.name = "?"  # the layer's name, for the warnings (set by the first probe)
        self.told = _TOLD.setdefault(module, set())  # the warnings given for the module
        self._release_flex = FLEX.hold(module)
        self._remove_hooks = add_forward_hooks(module, pre=self._enter, post=self._leave)
        # tensor parallelism's own hooks on the projections run out of the interceptor's sight
        # (eager forwards: a compiled one traces them)
        self._parallel = ParallelHooks(module) if switch_of(module) is None else None

    def _modes(self) -> list[Interceptor]:
        """This thread's open forwards of the module, innermost last: each one's mode, which holds
        its capture (the capture does not hold the mode: no reference cycle keeps a forward's
        tensors alive after it, until the cyclic collector runs)."""
        modes = getattr(self._threads, "modes", None)
        if modes is None:
            modes = self._threads.modes = []
        return modes

    def _enter(self, module: nn.Module, args, kwargs) -> None:
        call = ForwardCapture(self)
        mode = Interceptor(call)
        mode.__enter__()
        self._modes().append(mode)
        open_calls().append(call)

    def _leave(self, module: nn.Module, args, output) -> None:
        modes = self._modes()
        if not modes:
            return
        mode = modes.pop()
        call = mode.call
        forget_call(call)
        mode.__exit__(None, None, None)
        if output is None:  # it raised: the softmax calls it kept are not handed on
            call.pending.clear()
            return
        call.flush()  # the softmax calls kept until the forward's end
        if call.first and self.observers:  # it ran; nothing was read
            self.observers.notify(UnreadCall(call.unread_reason()))

    def note_unmasked(self, lowest: float) -> None:
        """Warn, once per module, that a softmax input held finite logits at or below the mask
        floor that no additive mask seen in the forward explains (counted as keys)."""
        if "unmasked" in self.told:
            return
        self.told.add("unmasked")
        warnings.warn(
            f"qkmonitor: layer {self.name!r} hands its softmax finite logits as low as "
            f"{lowest:.4g}, at or below {MASK_FLOOR:g}, that no additive mask seen in its forward "
            "explains; they are counted as keys (docs/metrics.md, 'Masked keys': only -inf, "
            "finfo.min-like logits and the keys of a mask added in the forward are blocked), so "
            "its entropy_norm and max_prob count them. If they are a mask, add it to the logits "
            "in the forward (`scores + mask`, `masked_fill`) from a tensor without a gradient, or "
            "pass it to F.scaled_dot_product_attention as `attn_mask`. This warning is shown "
            "once per layer.",
            RuntimeWarning,
            stacklevel=2,
        )

    def uninstall(self) -> None:
        self._remove_hooks()
        if self._parallel is not None:
            self._parallel.remove()
        self._release_flex()
        # a forward left without its hook: a BaseException (KeyboardInterrupt) skips torch's
        # always-call hooks, so its mode is still entered on this thread until the probe closes
        modes = self._modes()
        while modes:
            mode = modes.pop()
            forget_call(mode.call)
            mode.__exit__(None, None, None)


def route_probe(
    module: nn.Module,
    probe: Probe,
    sources: Callable[[], list[Tensor]] | None = None,
    observe: Callable | None = None,
    heads: int | None = None,
) -> Callable[[], None]:
    """Route the module's attention calls to ``observe`` (default ``probe.observe``), and keep the
    inputs of the weights ``sources()`` names, at each forward's entry, for a layout check."""

    def make() -> InterceptChannel:
        channel = InterceptChannel(module)
        channel.heads = heads
        channel.name = probe.name
        return channel

    channel, remove_observer = Route.attach(
        module, InterceptChannel, observe or probe.observe, probe.request.sink_tokens, make
    )
    token = object()
    if sources is not None:
        channel.sources[token] = sources

    def remove() -> None:
        channel.sources.pop(token, None)
        remove_observer()

    return remove
