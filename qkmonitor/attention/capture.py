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

Leading dims before the heads (``(B, windows, H, N, D)``, timm Twins) are folded into the batch:
each window is an attention problem of its own. Two calls are refused by name, as an
:class:`~qkmonitor.attention.calls.UnreadCall` with the reason: a softmax after a Linear (or a
convolution) over the heads of ``q @ kᵀ`` (talking heads, timm CaiT: the queries' and keys' layout
is still checked, κ is a property of the weights), and one over channels (``q·kᵀ`` contracting the
projections' tokens, its rows a head's channels: timm XCiT, whose weights then have no W_QK over
tokens either).

The mode is entered by the probe's forward pre-hook and left by its forward hook, which runs on
an exception too (``always_call``; a ``BaseException`` skips it, and the channel unwinds the call
when the probe closes); both hooks are removed when the last probe on the module closes. An
unprobed step installs nothing. What one forward captures is its own (:class:`_Call`, per thread).
Statistics are computed on the side under ``no_grad`` in float32 or better; the model's call runs
with its own arguments and its result is returned unchanged. The projections' inputs and the first
call's queries and keys are kept for the layout check (:mod:`.layout_check`), and for a softmax over
``q @ kᵀ`` the factor between that product and the logits it got
(:func:`~qkmonitor.attention.layout_check.product_scale`): the scale a module applies after the
product, which the queries and keys alone do not show.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from qkmonitor.attention.calls import (
    MASK_FLOOR,
    TENSOR_PARALLEL,
    MaskedCall,
    ScoresCall,
    UnreadCall,
    block_mask_allowed,
    split_mask,
)
from qkmonitor.attention.compiled import add_forward_hooks, own_class
from qkmonitor.attention.context_parallel import (
    TORCH_SDPA,
    context_parallel_reason,
    first_chunk,
    local,
)
from qkmonitor.attention.layout_check import LayoutEvidence, product_scale
from qkmonitor.attention.layouts import HEADS_NAMES, attribute
from qkmonitor.attention.masks import AdditiveMasks
from qkmonitor.attention.probes import AttentionCall, Probe, in_side_computation
from qkmonitor.attention.route import Channel, Route, observed
from qkmonitor.measures.sharding import HeadPlacement, RowShard, row_shard

#: the ways a softmax is called from Python (``F.softmax``, ``torch.softmax``, ``x.softmax``)
_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax)


class _Interceptor(TorchFunctionMode):
    """Sees the torch calls of one forward of a module; hands them to that call's state."""

    def __init__(self, call: _Call) -> None:
        super().__init__()
        self.call = call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = self.call
        if in_side_computation() or call.in_kernel:  # qkmonitor's own computation, or the ops
            return func(*args, **kwargs)  # inside an attention kernel already observed (flex)
        if func is F.scaled_dot_product_attention or func is TORCH_SDPA:  # the 2nd: under CP
            call.on_sdpa(args, kwargs)
        elif func in _SOFTMAX:
            call.on_softmax(args, kwargs)
        elif func is F.linear or func is torch.addmm:
            call.on_projection(func, args, kwargs)
        elif func is F.conv2d and args:
            call.on_conv(args[0])
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


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
#: flex_attention's arguments after (query, key, value)
_FLEX_ARGS = ("score_mod", "block_mask", "scale", "enable_gqa")


def _open_calls() -> list[_Call]:
    """This thread's open intercepted forwards, innermost last (any module's)."""
    calls = getattr(_OPEN, "calls", None)
    if calls is None:
        calls = _OPEN.calls = []
    return calls


def _forget(call: _Call) -> None:
    calls = _open_calls()
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
    return getattr(value, "_torchdynamo_orig_callable", None)


def _observing(flex: Callable) -> Callable:
    """``flex`` that first hands its call to the thread's innermost intercepted forward."""

    @functools.wraps(flex)
    def observed(query, key, value, *args, **kwargs):
        calls = _open_calls()
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

#: the capture's warnings given for each module (each is given once per module, whichever
#: monitor's probe made the channel that saw it): weak per module
_TOLD: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


class _InterceptChannel(Channel):
    """A module's calls intercepted while it runs: the hooks that enter and leave the
    interception. What one forward captures is that call's own (:class:`_Call`), on a stack per
    thread: a module called again inside its own forward, or from several threads at once
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

    def _calls(self) -> list[_Call]:
        calls = getattr(self._threads, "calls", None)
        if calls is None:
            calls = self._threads.calls = []
        return calls

    def _enter(self, module: nn.Module, args, kwargs) -> None:
        call = _Call(self)
        call.mode.__enter__()
        self._calls().append(call)
        _open_calls().append(call)

    def _leave(self, module: nn.Module, args, output) -> None:
        calls = self._calls()
        if not calls:
            return
        call = calls.pop()
        _forget(call)
        call.mode.__exit__(None, None, None)
        if output is not None and call.first and self.observers:  # it ran; nothing was read
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
        self._release_flex()
        # a forward left without its hook: a BaseException (KeyboardInterrupt) skips torch's
        # always-call hooks, so its mode is still entered on this thread until the probe closes
        calls = self._calls()
        while calls:
            call = calls.pop()
            _forget(call)
            call.mode.__exit__(None, None, None)


def _watched(channel: _InterceptChannel) -> set[int]:
    """The ids of the weights the channel's layout probes ask for, as the module holds them now."""
    watch: set[int] = set()
    for sources in channel.sources.values():
        try:
            weights = sources()
        except Exception:  # noqa: BLE001 -- no evidence then; the check says so, training goes on
            weights = []
        watch.update(id(weight) for weight in weights)
    return watch


class _Call:
    """What one forward of an intercepted module captures: the projections' inputs the layout
    check asks for, the first ``q @ kᵀ`` (an explicit softmax's queries and keys), the additive
    masks added to logits (:mod:`.masks`), what happened to the logits before the softmax (their
    heads mixed), the token counts and widths the projections saw, and whether an attention call
    was already handed on (the first carries the layout evidence)."""

    def __init__(self, channel: _InterceptChannel) -> None:
        self.channel = channel
        #: ids of the weights whose inputs are kept (the objects of this forward)
        self.watch = _watched(channel)
        self.inputs: dict[int, Tensor] = {}
        self.biases: dict[int, Tensor] = {}  # the bias each projection's call added, where one did
        self.first = True
        self.qk: tuple[Tensor, Tensor] | None = None  # the first q @ kᵀ: its q and k
        self.last_qk: tuple[Tensor, Tensor] | None = None  # the latest q @ kᵀ before a softmax
        self.product: Tensor | None = None  # the latest q @ kᵀ's result (logits to come)
        self.product_version: int | None = None  # its version counter when the matmul made it
        self.mixed: str | None = None  # how the logits' heads were mixed, before the softmax
        #: the heads were mixed from the product as the matmul gave it (no factor after it), or
        #: why that is not known (it was changed in place first)
        self.mixed_unscaled: str | None = None
        self.tokens: set[int] = set()  # the sequence lengths of the projections' inputs
        self.widths: set[int] = set()  # and their widths
        self.masks = AdditiveMasks()
        self.in_kernel = False  # inside an observed kernel: its own ops are not the module's
        self.unread: list[str] = []  # attention-like calls seen but not read, and why
        #: id(weight) -> how the projections' weights, as the forward computes with them, are
        #: split by output features across ranks (tensor parallelism: a ``RowShard``), or why
        #: that split cannot be read by head
        self.shards: dict[int, RowShard | str] = {}
        self.mode = _Interceptor(self)

    def unread_reason(self) -> str:
        """Why this forward gave nothing to read: the calls seen and what was missing, or that
        none of the calls qkmonitor reads was made."""
        if self.unread:
            return "; ".join(dict.fromkeys(self.unread))
        return (
            "its forward called none of F.scaled_dot_product_attention, flex_attention or a "
            "softmax over the keys of (B, H, N, M) or (B·H, N, M) scores (another kernel, e.g. "
            "xformers' or flash-attn's, is not read)"
        )

    def on_flex(self, query, key, args: tuple, kwargs: dict) -> None:
        """``flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, ...)``:
        the scores as flex computes them (its score_mod and block mask applied)."""
        flex = dict(zip(_FLEX_ARGS, args)) | kwargs
        refused = context_parallel_reason(query, key)
        if refused is not None:
            self._refuse_split(refused, query, key, flex.get("scale"))
            return
        if not (isinstance(query, Tensor) and isinstance(key, Tensor) and query.dim() == 4):
            self.unread.append("a flex_attention call whose queries are not (B, H, N, D)")
            return
        scale = flex.get("scale")
        self._notify(
            lambda: _flex_call(query, key, flex.get("score_mod"), flex.get("block_mask"), scale),
            lambda: self._evidence(query, key, None, scale),
            heads=query.shape[1],
        )

    def on_projection(self, func, args, kwargs) -> None:
        """``F.linear(input, weight, bias)`` and ``addmm(input, mat1, mat2)`` (GPT-2's Conv1D:
        ``addmm(bias, x, weight)``), their arguments given by position or by keyword; the bias the
        call adds is kept with the input (a module may assemble it in the forward, as BEiT's
        ``cat(q_bias, zeros, v_bias)``). A Linear over the heads of the logits (talking heads)
        mixes them."""
        if func is F.linear:
            call = dict(zip(("input", "weight", "bias"), args)) | kwargs
            x, weight, bias = call.get("input"), call.get("weight"), call.get("bias")
        else:
            call = dict(zip(("input", "mat1", "mat2"), args)) | kwargs
            x, weight, bias = call.get("mat1"), call.get("mat2"), call.get("input")
        shard = row_shard(weight, 0 if func is F.linear else 1)
        if shard is not None:
            self.shards[id(weight)] = shard
        if not isinstance(x, Tensor):
            return
        product = self.product
        if product is not None and x.shape[-1] == product.shape[-3] and _same_storage(x, product):
            self.mixed = (
                f"talking heads: a Linear over the {product.shape[-3]} heads of q·kᵀ, as CaiT's "
                "proj_l"
            )
            self.mixed_unscaled = self._changed_in_place(product)
            return
        if x.dim() >= 3:
            self.tokens.add(x.shape[-2])
            self.widths.add(x.shape[-1])
        watched = isinstance(weight, Tensor) and id(weight) in self.watch
        if watched and id(weight) not in self.inputs:
            self.inputs[id(weight)] = _replicated(x).detach()
            if isinstance(bias, Tensor) and bias.dim() == 1:
                self.biases[id(weight)] = bias.detach()

    def on_conv(self, x) -> None:
        """A convolution whose channels are the heads of the logits mixes them (x-transformers'
        1×1 talking heads)."""
        product = self.product
        if (
            isinstance(x, Tensor)
            and product is not None
            and x.dim() == 4
            and x.shape[1] == product.shape[-3]
            and _same_storage(x, product)
        ):
            self.mixed = f"talking heads: a convolution over the {x.shape[1]} heads of q·kᵀ"
            self.mixed_unscaled = self._changed_in_place(product)

    def _changed_in_place(self, product: Tensor) -> str | None:
        """None where the latest ``q @ kᵀ`` is as the matmul gave it (its version counter
        unchanged: the heads are mixed from it with no factor after the product); else why the
        factor after the product is not known."""
        version = _version(product)
        if version is not None and version == self.product_version:
            return None
        return (
            "its q @ kᵀ was changed in place before its heads were mixed, so the factor on a "
            "head's own q·kᵀ is not known"
        )

    def on_matmul(self, a, b, out) -> None:
        """``x @ W.T`` (a projection written as a matmul, e.g. Falcon's) and ``q @ kᵀ`` of
        (..., H, N, D) queries (the queries and keys of an explicit softmax, the first kept for
        the layout check)."""
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return
        if self.watch:
            weight = b if id(b) in self.watch else b._base
            if weight is not None and id(weight) in self.watch:
                self.inputs.setdefault(id(weight), a.detach())
                return
        if a.dim() >= 4 and b.dim() == a.dim() and a.shape[-1] == b.shape[-2]:
            self.last_qk = (a.detach(), b.detach().transpose(-1, -2))
            self.qk = self.qk or self.last_qk
            self.product = out.detach() if isinstance(out, Tensor) else None
            self.product_version = None if self.product is None else _version(self.product)

    def on_sdpa(self, args, kwargs) -> None:
        sdpa = dict(zip(_SDPA_ARGS, args)) | kwargs
        q, k = sdpa["query"], sdpa["key"]
        refused = context_parallel_reason(q, k)
        if refused is not None:
            self._refuse_split(refused, q, k, sdpa.get("scale"))
            return
        if isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() >= 4:
            refused = self._over_channels(q, k)
            if refused is not None:
                self._refuse(*refused)
                return
        self._notify(
            lambda: _sdpa_call(
                q, k, sdpa.get("attn_mask"), bool(sdpa.get("is_causal", False)), sdpa.get("scale")
            ),
            lambda: self._evidence(_fold(q), _fold(k), None, sdpa.get("scale")),
            heads=q.shape[-3] if isinstance(q, Tensor) and q.dim() >= 4 else None,
        )

    def on_softmax(self, args, kwargs) -> None:
        """A softmax over the keys: of (B, H, N, M) logits (any leading dims before H folded into
        the batch), of (B, N, H, M) ones (heads in the third dim where the layer's head count says
        so), or of (B·H, N, M) ones split by the module's head count. The additive masks seen
        going into the logits block their keys."""
        x = args[0] if args else kwargs.get("input")
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not isinstance(x, Tensor) or dim not in (-1, x.dim() - 1):
            return
        blocked = self.masks.blocked(x)
        self.masks.clear()
        mixed, self.mixed, self.product = self.mixed, None, None
        mixed_unscaled, self.mixed_unscaled = self.mixed_unscaled, None
        last_qk, self.last_qk = self.last_qk, None
        heads = self.channel.heads
        if x.dim() == 3:
            split = heads or self.channel.split_heads
            if split is None or x.shape[0] % split:
                self.unread.append(
                    f"a softmax over the last dim of a 3-D tensor of shape {tuple(x.shape)}, whose "
                    "first dim could not be split into (batch, heads): "
                    + ("the module names no head count" if split is None else f"{split} heads")
                )
                return
            x = x.view(x.shape[0] // split, split, *x.shape[1:])
            blocked = None if blocked is None else blocked.view(x.shape)
        elif x.dim() < 4:
            return
        elif heads is not None and x.shape[-3] != heads:
            if x.dim() != 4 or x.shape[2] != heads:  # not (B, H, N, M) nor (B, N, H, M)
                self.unread.append(
                    f"a softmax over a tensor of shape {tuple(x.shape)}, in which no dim holds "
                    f"the layer's {heads} heads"
                )
                return
            x = x.transpose(1, 2)
            blocked = None if blocked is None else blocked.transpose(1, 2)
        if last_qk is not None and x.shape[-2] == last_qk[0].shape[-2]:
            refused = self._over_channels(*last_qk)
            if refused is not None:
                self._refuse(*refused)
                return
        if mixed is not None:
            self._refuse(_mixed_reason(mixed), None, mixed_unscaled)
            return
        x, blocked = _fold(x), None if blocked is None else _fold(blocked)
        qk = self.qk
        if qk is not None and _folded(qk[0])[:3] == x.shape[:3] and qk[1].shape[-2] == x.shape[3]:
            self._notify(
                lambda: self._scores(x, blocked),
                lambda: self._evidence(
                    _fold(qk[0]),
                    _fold(qk[1]),
                    None,
                    *product_scale(_fold(qk[0]), _fold(qk[1]), x, blocked),
                ),
                heads=x.shape[1],
            )
            return
        self._notify(
            lambda: self._scores(x, blocked),
            lambda: self._evidence(None, None, x, None),
            heads=x.shape[1],
        )

    def _over_channels(self, q: Tensor, k: Tensor) -> tuple[str, str] | None:
        """Why a q·kᵀ of (..., H, R, D) queries is over channels, not tokens, with what it means
        for the weights; None when it is not: its rows are the head width of a projection
        (R = C/H) and the dim it contracts is the projections' tokens (D = N), as in XCiT's
        cross-covariance attention. Where R = D no shape tells them apart: read as tokens."""
        heads, rows, width = q.shape[-3], q.shape[-2], q.shape[-1]
        if rows == width or width not in self.tokens:
            return None
        if not any(c % heads == 0 and c // heads == rows for c in self.widths):
            return None
        reason = (
            "its softmax is over channels, not tokens (cross-covariance attention, as XCiT's XCA: "
            f"q·kᵀ contracts the {width} tokens, its rows are the {rows} channels of a head), so "
            "it has no attention over tokens to measure"
        )
        no_layout = (
            "its attention is over channels (cross-covariance attention, as XCiT's XCA: q·kᵀ "
            "contracts the tokens), so there is no W_QK over tokens to read"
        )
        return reason, no_layout

    def _refuse(self, reason: str, no_layout: str | None, scale_unknown: str | None = None) -> None:
        """Hand on a call that is not read, and why; ``no_layout``: why the weights are not read
        either (else the first call's evidence still checks them). The heads of a mixed product
        were mixed from ``q @ kᵀ`` as the matmul gave it: the factor on a head's own ``q·kᵀ`` is
        what its operands carry (1 after the product), unless ``scale_unknown`` says why not."""

        qk = self.qk
        evidence = (
            (lambda: self._evidence(_fold(qk[0]), _fold(qk[1]), None, 1.0, scale_unknown))
            if qk
            else None
        )
        self._notify(lambda: UnreadCall(reason, no_layout), None if no_layout else evidence)

    def _refuse_split(self, reason: str, q, k, scale) -> None:
        """Refuse a call whose keys are split across ranks (context parallelism) as
        :class:`UnreadCall` ``sharded``; its queries and keys, as the rank holding the sequence's
        first chunk computed them, still check the weights' layout (kappa is read)."""
        q_local, k_local = local(q), local(k)

        def evidence() -> LayoutEvidence:
            return first_chunk(self._evidence(_fold(q_local), _fold(k_local), None, scale), q)

        readable = isinstance(q_local, Tensor) and isinstance(k_local, Tensor) and q.dim() >= 4
        self._notify(lambda: UnreadCall(reason, sharded=True), evidence if readable else None)

    def _scores(self, x: Tensor, blocked: Tensor | None) -> ScoresCall:
        call, lowest = _scores_call(x, blocked)
        if lowest is not None:
            self.channel.note_unmasked(lowest)
        return call

    def _notify(
        self, build: Callable, evidence: Callable | None, *, heads: int | None = None
    ) -> None:
        """Hand one attention call on (its layout evidence with the forward's first). Where the
        forward's projections are split by output features across ranks (tensor parallelism),
        ``heads``, the query heads of the call, are this rank's part: the call says where they
        are among all (``placement``), or is refused where that cannot be told."""
        if not self.channel.observers:
            return
        placement = None
        if self.shards:
            placement = _placement(self.shards, heads)
            if isinstance(placement, str):
                self.first = False
                self.channel.observers.notify(UnreadCall(placement, placement, sharded=True))
                return
        first, self.first = self.first, False

        def build_with_evidence() -> AttentionCall:
            call = build()
            call.placement = placement
            if first and self.watch and evidence is not None:
                call.evidence = evidence()
            return call

        self.channel.observers.notify(observed(build_with_evidence))

    def _evidence(
        self,
        q: Tensor | None,
        k: Tensor | None,
        logits: Tensor | None,
        scale,
        scale_unknown: str | None = None,
    ) -> LayoutEvidence:
        like = q if q is not None else logits
        b, n, m = like.shape[0], like.shape[2], (k.shape[2] if k is not None else logits.shape[3])
        return LayoutEvidence(
            dict(self.inputs),
            dict(self.biases),
            None if q is None else q[:, :, 0].detach().clone(),
            None if k is None else k[:, :, 0].detach().clone(),
            None if logits is None else logits[:, :, 0, 0].detach().clone(),
            None if scale is None else float(scale),
            b,
            n,
            m,
            like.dtype,
            scale_unknown,
            {i: s for i, s in self.shards.items() if isinstance(s, RowShard)},
        )


def _placement(shards: dict[int, RowShard | str], heads: int | None) -> HeadPlacement | str:
    """Where this rank's ``heads`` query heads are among the layer's, from how the forward's
    projections are split across ranks (every split projection in equal chunks, all alike: the
    query heads of chunk c are ``c·heads ..``); else why they cannot be placed."""
    refused = [s for s in shards.values() if isinstance(s, str)]
    splits = {(s.index, s.ranks) for s in shards.values() if isinstance(s, RowShard)}
    if not refused and heads is not None and len(splits) > 1:
        refused = [f"its projections are split in different ways across ranks ({sorted(splits)})"]
    if not refused and heads is None:
        refused = ["its attention call's heads are not known"]
    if refused:
        return (
            f"its projections are sharded by rows across ranks ({TENSOR_PARALLEL}), and "
            f"{refused[0]}; its attention statistics are not measured"
        )
    (index, ranks), *_ = splits
    return HeadPlacement(index * heads, heads, ranks * heads)


def _replicated(x: Tensor) -> Tensor:
    """A projection's input as a plain tensor: a DTensor replicated on every mesh dim
    (``ColwiseParallel``'s input) by its local copy, which is the whole input."""
    placements = getattr(x, "placements", None)
    if placements is not None and all(p.is_replicate() for p in placements):
        return x.to_local()
    return x


def _mixed_reason(how: str) -> str:
    return (
        f"it mixes its heads' logits before the softmax ({how}), so a head's softmax is not over "
        "its own queries' and keys' logits: its attention statistics are not measured, while "
        "its kappa, of its own W_Q^h W_K^hᵀ, is a property of the weights and is read"
    )


def _version(x: Tensor) -> int | None:
    """A tensor's version counter (bumped by each in-place change), or None where it has none
    (an inference tensor)."""
    try:
        return int(x._version)
    except (RuntimeError, AttributeError):
        return None


def _same_storage(a: Tensor, b: Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor without storage of its own (a subclass): not known the same
        return False


def _fold(x: Tensor) -> Tensor:
    """(..., H, N, D) -> (B', H, N, D): leading dims before the heads folded into the batch (timm
    Twins' windows are independent attention problems)."""
    return x.reshape(-1, *x.shape[-3:]) if x.dim() > 4 else x


def _folded(x: Tensor) -> tuple[int, ...]:
    """The shape :func:`_fold` gives ``x``, without folding it."""
    return (x.shape[:-3].numel(), *x.shape[-3:]) if x.dim() > 4 else tuple(x.shape)


def _sdpa_call(q: Tensor, k: Tensor, attn_mask, is_causal: bool, scale) -> MaskedCall:
    """The statistics of one SDPA call as SDPA defines it (``is_causal`` top-left aligned); leading
    dims before the heads (windows) are folded into the batch."""
    n, m = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    if attn_mask is not None and q.dim() > 4:
        attn_mask = attn_mask.detach()
        mask_heads = attn_mask.shape[-3] if attn_mask.dim() >= 3 else 1
        attn_mask = attn_mask.expand(*lead, mask_heads, n, m).reshape(-1, mask_heads, n, m)
    if q.dim() > 4:
        q = q.detach().expand(*lead, *q.shape[-3:]).reshape(-1, *q.shape[-3:])
        k = k.detach().expand(*lead, *k.shape[-3:]).reshape(-1, *k.shape[-3:])
    call = MaskedCall(q.detach(), k.detach(), scale, False, None, None, None)
    allowed = bias = None
    if attn_mask is not None:
        mask = attn_mask.detach()
        while mask.dim() < 4:
            mask = mask[None]
        allowed, bias = split_mask(mask)  # additive: entries at or below MASK_FLOOR are blocked
    if is_causal:
        if n == m and allowed is None:
            call.causal = True
        else:
            causal = torch.ones(n, m, dtype=torch.bool, device=q.device).tril()[None, None]
            allowed = causal if allowed is None else allowed & causal
    call.allowed, call.bias = allowed, bias
    if allowed is not None:
        call.reduce()
    return call


def _flex_call(q: Tensor, k: Tensor, score_mod, block_mask, scale) -> MaskedCall:
    """The statistics of one flex_attention call as flex defines it: ``score_mod`` on the scaled
    scores, the block mask's blocks and ``mask_mod``; GQA keys read by query head h // (H/H_kv)."""
    n, m = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    call = MaskedCall(q.detach(), k.detach(), scale, False, None, None, None, score_mod=score_mod)
    if block_mask is not None:
        call.allowed = block_mask_allowed(block_mask, q.shape[0], q.shape[1], n, m)
        if score_mod is None:
            call.reduce()
    return call


def _scores_call(logits: Tensor, masked: Tensor | None = None) -> tuple[ScoresCall, float | None]:
    """The logits a module hands its softmax: the keys an observed additive mask blocks
    (``masked``) and ``finfo.min``-like entries are blocked; any other entry is a key. Also the
    lowest finite logit at or below :data:`MASK_FLOOR` that no observed mask explains (a mask the
    capture could not see, or a very sharp head), or None."""
    scores = logits.detach()
    scores = scores.double() if scores.dtype == torch.float64 else scores.float()
    blocked = logits.detach() <= torch.finfo(logits.dtype).min / 2
    if masked is not None:
        blocked = blocked | masked
    unexplained = (scores <= MASK_FLOOR) & ~blocked & torch.isfinite(scores)
    lowest = float(scores[unexplained].min()) if bool(unexplained.any()) else None
    return ScoresCall(scores.masked_fill(blocked, float("-inf"))), lowest


def route_probe(
    module: nn.Module,
    probe: Probe,
    sources: Callable[[], list[Tensor]] | None = None,
    observe: Callable | None = None,
    heads: int | None = None,
) -> Callable[[], None]:
    """Route the module's attention calls to ``observe`` (default ``probe.observe``), and keep the
    inputs of the weights ``sources()`` names, at each forward's entry, for a layout check."""

    def make() -> _InterceptChannel:
        channel = _InterceptChannel(module)
        channel.heads = heads
        channel.name = probe.name
        return channel

    channel, remove_observer = Route.attach(
        module, _InterceptChannel, observe or probe.observe, probe.request.sink_tokens, make
    )
    token = object()
    if sources is not None:
        channel.sources[token] = sources

    def remove() -> None:
        channel.sources.pop(token, None)
        remove_observer()

    return remove
