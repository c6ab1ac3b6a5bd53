"""Find the attention layers of a model and read their query/key weights.

An :class:`AttentionLayer` wraps one attention module, whatever its origin, and gives the monitors
what they need: a name, its index in forward order, and :meth:`AttentionLayer.qk_weights` —
``(w_q, w_k, num_heads, num_kv_heads, scale)`` in ``nn.Linear`` layout. The core never imports
the bundled models: they take part through the :class:`SupportsQKMonitor` protocol, which any
user module may implement too.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkmonitor.attention.calls import MASK_FLOOR, TENSOR_PARALLEL, ScoresCall, UnreadCall
from qkmonitor.attention.clip import ProjectionRows, QKRows
from qkmonitor.attention.compiled import add_forward_hooks
from qkmonitor.attention.probes import AttentionCall, KernelCall, Probe, ProbeRequest, ProbeResult
from qkmonitor.attention.registry import families, register_family
from qkmonitor.attention.route import Channel, Route, observed
from qkmonitor.kernels import autocast_off
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.measures.sharding import HeadPlacement, SplitHeadsError, row_shard

__all__ = [
    "AttentionLayer",
    "MultiheadAttentionLayer",
    "NativeAttentionLayer",
    "SupportsQKMonitor",
    "find_attention_layers",
    "parameters_without_data",
]


def parameters_without_data(module: nn.Module) -> list[str]:
    """The names of the module's parameters that hold no data: on the meta device, or lazy and
    not yet materialised (``nn.LazyLinear`` before its first forward)."""
    return [
        name
        for name, p in module.named_parameters()
        if p.is_meta or isinstance(p, nn.parameter.UninitializedTensorMixin)
    ]


@runtime_checkable
class SupportsQKMonitor(Protocol):
    """An attention module that describes itself to qkmonitor (qkmonitor's own modules do).

    ``qk_weights()`` returns the :class:`~qkmonitor.measures.layer_spectra.QKWeights` of the
    module's current parameters. A module may also offer activation statistics by defining
    ``register_probe(observer, sink_tokens=0)``:
    it hands every following forward to ``observer`` as an
    :class:`~qkmonitor.attention.probes.AttentionCall` (e.g. a
    :class:`~qkmonitor.attention.probes.KernelCall` holding the kernel's statistics), and returns a
    function that removes exactly that observer (:class:`~qkmonitor.attention.probes.ObserverSet`
    does the bookkeeping). If it also takes ``stats=``, an observer that reads no per-row statistics
    (QK-Clip's) is registered with ``stats=False``, and the module may skip computing them.
    """

    def qk_weights(self) -> QKWeights: ...


class AttentionLayer:
    """One attention layer of a model, seen through an adapter.

    Subclasses read the module's query/key weights (:meth:`qk_weights`) and, where they can
    measure activations, install what a probe needs (:meth:`install`); :meth:`open_probe` is the
    protocol of :mod:`qkmonitor.attention.probes`.

    Args:
        name: the module's qualified name in the model (``""`` for the model itself).
        module: the attention module.
        index: position in forward order, from 0.
    """

    kind = "custom"

    def __init__(self, name: str, module: nn.Module, index: int = 0) -> None:
        self.name = name
        self.module = module
        self.index = index

    def qk_weights(self) -> QKWeights:
        """The layer's current query/key weights; subclasses read them from their module."""
        raise NotImplementedError(f"{type(self).__name__} must implement `qk_weights()`")

    def qk_rows(self) -> QKRows:
        """The layer's query and key projections by head, as views that in-place writes go
        through (what QK-Clip scales); NotImplementedError where the family cannot give them."""
        raise NotImplementedError(
            f"{type(self).__name__} ({self.kind}) does not give its query/key rows"
        )

    @property
    def supports_stats(self) -> bool:
        """Whether :meth:`open_probe` can measure this layer's forwards."""
        return False

    @property
    def supports_weights(self) -> bool:
        """Whether :meth:`qk_weights` can read this layer's W_Q and W_K."""
        return True

    @property
    def needs_layout_check(self) -> bool:
        """Whether the weights were read by name and wait for a forward to be checked against
        (:mod:`qkmonitor.attention.intercept`); open a probe with ``ProbeRequest(layout=True)`` for
        it."""
        return False

    def check_layout(self, result: ProbeResult) -> str | None:
        """Check the weight layout against a layout probe's result; a message if it fails."""
        return None

    @property
    def layout_ready(self) -> bool:
        """Whether :meth:`qk_weights` gives the weights now (no check pending)."""
        return self.supports_weights and not self.needs_layout_check

    @property
    def num_heads_hint(self) -> int:
        """The number of query heads, as far as it is known without a forward (1 if not at all:
        heads split across ranks in a way that is refused, too)."""
        try:
            return self.qk_weights().num_heads if self.layout_ready else 1
        except SplitHeadsError:
            return 1

    @property
    def head_placement(self) -> HeadPlacement | None:
        """Where the heads :meth:`qk_weights` and :meth:`qk_rows` give are among the layer's,
        where they are this rank's part (tensor parallelism); None where they are all of them."""
        return None

    @property
    def has_qk_norm(self) -> bool:
        """Whether the layer normalizes q and k after the projections (``QKWeights.qk_norm``)."""
        return self.qk_weights().qk_norm if self.layout_ready else False

    def open_probe(self, request: ProbeRequest | None = None) -> Probe:
        """Measure every forward of the module until the returned probe is closed.

        Args:
            request: what to measure (default: the per-row statistics only).

        Returns:
            An open :class:`~qkmonitor.attention.probes.Probe`; ``probe.close()`` removes what this
            installed and returns the measurements of every call.

        Raises:
            ValueError: if the layer gives no activation statistics.
        """
        request = ProbeRequest() if request is None else request
        if not isinstance(request, ProbeRequest):
            raise ValueError(
                f"Expected `request` to be a ProbeRequest, got {type(request).__name__}"
            )
        if request.layout and not self.needs_layout_check:
            raise ValueError(f"{type(self).__name__} {self.name!r} has no weight layout to check")
        if request.stats and not self.supports_stats:
            raise ValueError(f"{type(self).__name__} {self.name!r} gives no activation statistics")
        probe = Probe(self.name, request)
        probe.record_undo(self.install_layout(probe) if request.layout else self.install(probe))
        return probe

    def install(self, probe: Probe) -> Callable[[], None]:
        """Route the module's forwards to ``probe.observe``; return what undoes exactly that."""
        raise NotImplementedError(f"{type(self).__name__} has no activation statistics")

    def install_layout(self, probe: Probe) -> Callable[[], None]:
        """Like :meth:`install`, for a layout probe (layers whose weights were read by name)."""
        raise NotImplementedError(f"{type(self).__name__} has no weight layout to check")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(index={self.index}, name={self.name!r})"


class NativeAttentionLayer(AttentionLayer):
    """A module implementing :class:`SupportsQKMonitor` (qkmonitor's own attention)."""

    @property
    def kind(self) -> str:  # type: ignore[override]
        return f"qkmonitor.{type(self.module).__name__}"

    def qk_weights(self) -> QKWeights:
        return self.module.qk_weights()

    def qk_rows(self) -> QKRows:
        rows = getattr(self.module, "qk_rows", None)
        if not callable(rows):
            raise NotImplementedError(
                f"{type(self.module).__name__} has no `qk_rows()` returning a "
                "qkmonitor.attention.clip.QKRows"
            )
        return rows()

    @property
    def supports_stats(self) -> bool:
        return callable(getattr(self.module, "register_probe", None))

    def install(self, probe: Probe) -> Callable[[], None]:
        module = self.module
        request = probe.request
        skip_stats = {"stats": False} if not request.stats and _takes_stats(module) else {}

        def observe(call: AttentionCall) -> None:
            refused = _split_heads(module)  # as the forward computes, FSDP2's weights unsharded
            probe.observe(call if refused is None else UnreadCall(refused, sharded=True))

        remove_observer = module.register_probe(
            observe, sink_tokens=request.sink_tokens, **skip_stats
        )
        remove_switch = add_forward_hooks(self.module)  # under compile: run eagerly while probed

        def remove() -> None:
            remove_switch()
            remove_observer()

        return remove


def _split_heads(module: nn.Module) -> str | None:
    """Why a :class:`SupportsQKMonitor` module's call is refused: its query or key weights, as its
    forward computes with them, are split by rows across ranks (tensor parallelism), and the
    protocol does not say which heads this rank holds; None where they are whole."""
    try:
        weights = module.qk_weights()
    except SplitHeadsError as err:
        return str(err)
    except Exception:  # noqa: BLE001 -- the weights' own read warns
        return None
    if all(row_shard(w) is None for w in (weights.w_q, weights.w_k)):
        return None
    return (
        f"its query/key projections are sharded by rows across ranks ({TENSOR_PARALLEL}), and "
        f"{type(module).__name__}.qk_weights() does not say which heads this rank holds; its "
        "attention statistics are not measured"
    )


class MultiheadAttentionLayer(AttentionLayer):
    """``torch.nn.MultiheadAttention``: packed ``in_proj_weight`` or separate q/k/v weights.

    ``batch_first`` does not matter for the weights. The scale is ``1/sqrt(head_dim)``, as in
    ``F.multi_head_attention_forward``.

    Statistics: the module's route carries one forward pre-hook (:class:`_MultiheadChannel`, for
    every probe open on it) that reads the call's query, key and masks and recomputes the scores
    ``q_h k_h^T / sqrt(d_k)`` on the side, under ``no_grad`` and in float32
    or better — the module's own call, its arguments and its outputs are untouched
    (``need_weights`` stays as the caller set it). The keys MHA appends (``bias_k``, the zero key
    of ``add_zero_attn``) are appended here too, and masks are widened over them as MHA does. With
    no mask, a causal mask or a boolean key padding mask the fused kernel gives the statistics
    without an N x M matrix; any other ``attn_mask`` goes through the explicit scores. Closing the
    last probe removes the hook.
    """

    kind = "torch.nn.MultiheadAttention"

    def qk_weights(self) -> QKWeights:
        w_q, w_k, _, _ = self._projections()
        mha: nn.MultiheadAttention = self.module
        return QKWeights(w_q, w_k, mha.num_heads, mha.num_heads, 1.0 / math.sqrt(mha.head_dim))

    def qk_rows(self) -> QKRows:
        mha: nn.MultiheadAttention = self.module
        w_q, w_k, b_q, b_k = self._projections()
        rows = torch.arange(mha.embed_dim).view(mha.num_heads, mha.head_dim)
        heads = tuple(range(mha.num_heads))
        return QKRows(ProjectionRows(w_q, b_q, rows), ProjectionRows(w_k, b_k, rows), heads)

    def _projections(self):
        mha: nn.MultiheadAttention = self.module
        e = mha.embed_dim
        if mha.in_proj_weight is not None:  # packed (3E, E): rows are q, k, v
            w_q, w_k = mha.in_proj_weight[:e], mha.in_proj_weight[e : 2 * e]
        else:
            w_q, w_k = mha.q_proj_weight, mha.k_proj_weight  # (E, E) and (E, kdim)
        b = mha.in_proj_bias
        return w_q, w_k, (None if b is None else b[:e]), (None if b is None else b[e : 2 * e])

    @property
    def supports_stats(self) -> bool:
        return True

    def install(self, probe: Probe) -> Callable[[], None]:
        def make() -> _MultiheadChannel:
            return _MultiheadChannel(self)

        _, remove = Route.attach(
            self.module, _MultiheadChannel, probe.observe, probe.request.sink_tokens, make
        )
        return remove

    def _call_of(self, call: dict):
        mha: nn.MultiheadAttention = self.module
        query, key = call["query"], call["key"]
        if query.dim() == 2:  # unbatched (L, E)
            query, key = query[None], key[None]
        elif not mha.batch_first:  # (L, B, E) -> (B, L, E)
            query, key = query.transpose(0, 1), key.transpose(0, 1)
        w_q, w_k, b_q, b_k = self._projections()
        dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        h, d_k = mha.num_heads, mha.head_dim
        q = (
            F.linear(query.to(dtype), w_q.to(dtype), _to(b_q, dtype))
            .unflatten(-1, (h, d_k))
            .transpose(1, 2)
        )
        k = (
            F.linear(key.to(dtype), w_k.to(dtype), _to(b_k, dtype))
            .unflatten(-1, (h, d_k))
            .transpose(1, 2)
        )
        extra = 0
        if mha.bias_k is not None or mha.add_zero_attn:
            k, extra = _extra_keys(mha, k)
        b, n, m = q.shape[0], q.shape[2], k.shape[2]
        key_padding_mask, attn_mask = call.get("key_padding_mask"), call.get("attn_mask")
        if key_padding_mask is not None and key_padding_mask.dim() == 1:  # unbatched (S,)
            key_padding_mask = key_padding_mask[None]
        scale = 1.0 / math.sqrt(d_k)
        causal = attn_mask is not None and extra == 0 and _is_causal_mask(attn_mask, n, m)
        if (attn_mask is None or causal) and _boolean_or_none(key_padding_mask):
            allowed = (
                None
                if key_padding_mask is None
                else _pad_keys(~key_padding_mask.to(q.device), m, True)
            )
            return KernelCall(q, k, scale=scale, causal=causal, key_padding_mask=allowed)
        scores = (
            q @ k.transpose(-1, -2)
        ) * scale  # an arbitrary mask: the explicit path (B, H, N, M)
        if attn_mask is not None:
            scores = scores + _pad_keys(_additive(attn_mask, b, h, scores), m, 0.0)
        if (
            key_padding_mask is not None
        ):  # MHA: bool True = ignore; _additive's keys: True = allowed
            kpm = ~key_padding_mask if key_padding_mask.dtype == torch.bool else key_padding_mask
            scores = scores + _pad_keys(
                _additive(kpm.to(q.device), None, h, scores, keys_only=True), m, 0.0
            )
        return ScoresCall(scores)


_MHA_ARGS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)


class _MultiheadChannel(Channel):
    """``nn.MultiheadAttention``'s calls, seen by a forward pre-hook that reads the call's
    arguments and measures it once for every probe open on the module."""

    def __init__(self, layer: MultiheadAttentionLayer) -> None:
        super().__init__()

        def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
            call = dict(zip(_MHA_ARGS, args)) | kwargs

            def build() -> AttentionCall:
                with autocast_off():  # float32 or better under autocast too
                    return layer._call_of(call)

            self.observers.notify(observed(build))

        self._remove_hook = add_forward_hooks(layer.module, pre=capture)

    def uninstall(self) -> None:
        self._remove_hook()


def _to(bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if bias is None else bias.to(dtype)


def _pad_keys(mask: Tensor, num_keys: int, value) -> Tensor:
    """Widen a mask's key dim to ``num_keys`` with ``value`` (the keys MHA appends are allowed)."""
    short = num_keys - mask.shape[-1]
    if short <= 0:
        return mask
    if mask.dtype == torch.bool:
        return F.pad(mask, (0, short), value=bool(value))
    return F.pad(mask, (0, short), value=float(value))


def _boolean_or_none(mask: Tensor | None) -> bool:
    return mask is None or mask.dtype == torch.bool


def _is_causal_mask(attn_mask: Tensor, n: int, m: int) -> bool:
    """Whether ``attn_mask`` is exactly the causal mask (bool True or float -inf above the
    diagonal)."""
    if attn_mask.dim() != 2 or tuple(attn_mask.shape) != (n, m) or n != m:
        return False
    future = torch.ones(n, m, dtype=torch.bool, device=attn_mask.device).triu(1)
    blocked = attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
    if attn_mask.dtype != torch.bool and not bool((attn_mask[~future] == 0).all()):
        return False
    return bool((blocked == future).all())


def _additive(
    mask: Tensor | None, batch: int | None, heads: int, like: Tensor, keys_only: bool = False
) -> Tensor:
    """A bool (True = blocked) or float mask as an additive bias broadcastable to (B, H, N, M)."""
    if mask is None:
        return torch.zeros((), dtype=like.dtype, device=like.device)
    if keys_only:  # (B, M): bool True = allowed here, or an additive float mask
        bias = mask if mask.dtype != torch.bool else torch.where(mask, 0.0, float("-inf"))
        return _floored(bias.to(like.dtype))[:, None, None, :]
    bias = torch.where(mask, float("-inf"), 0.0) if mask.dtype == torch.bool else mask
    bias = _floored(bias.to(device=like.device, dtype=like.dtype))
    if bias.dim() == 3:  # (B * H, N, M)
        bias = bias.view(batch, heads, *bias.shape[-2:])
    return bias[..., : like.shape[-2], : like.shape[-1]] if bias.dim() == 2 else bias


def _floored(bias: Tensor) -> Tensor:
    """An additive mask with its entries at or below ``MASK_FLOOR`` made ``-inf``: blocked keys."""
    return bias.masked_fill(bias <= MASK_FLOOR, float("-inf"))


def _extra_keys(mha: nn.MultiheadAttention, k: Tensor) -> tuple[Tensor, int]:
    """The keys MHA appends: ``bias_k`` and, with ``add_zero_attn``, a zero key; and how many."""
    b, h, _, d_k = k.shape
    extra = 0
    if mha.bias_k is not None:
        k = torch.cat([k, mha.bias_k.to(k.dtype).view(1, h, 1, d_k).expand(b, h, 1, d_k)], dim=2)
        extra += 1
    if mha.add_zero_attn:
        k = torch.cat([k, k.new_zeros(b, h, 1, d_k)], dim=2)
        extra += 1
    return k, extra


def _adapt(name: str, module: nn.Module, index: int) -> AttentionLayer | None:
    """The first registered family's adapter for ``module`` (:mod:`qkmonitor.attention.registry`),
    or None."""
    for family in families():
        layer = family.adapt(name, module, index)
        if layer is not None:
            return layer
    return None


def _looked_for() -> str:
    return "; ".join(family.looked_for for family in families())


def _adapt_native(name: str, module: nn.Module, index: int) -> AttentionLayer | None:
    return (
        NativeAttentionLayer(name, module, index) if isinstance(module, SupportsQKMonitor) else None
    )


def _adapt_mha(name: str, module: nn.Module, index: int) -> AttentionLayer | None:
    return (
        MultiheadAttentionLayer(name, module, index)
        if isinstance(module, nn.MultiheadAttention)
        else None
    )


register_family(
    "qkmonitor",
    _adapt_native,
    priority=10,
    looked_for=(
        "qkmonitor attention modules and modules implementing SupportsQKMonitor (`qk_weights()`)"
    ),
)
register_family("torch", _adapt_mha, priority=20, looked_for="torch.nn.MultiheadAttention")


LayerSpec = (
    nn.Module | AttentionLayer | Iterable[AttentionLayer | nn.Module] | Callable[[nn.Module], Any]
)


def find_attention_layers(
    model: nn.Module, layers: LayerSpec | None = None
) -> list[AttentionLayer]:
    """The attention layers of ``model``, in forward (registration) order.

    Args:
        model: the model to search.
        layers: optional override: one module or :class:`AttentionLayer`, a list of them, or a
            function ``model -> list`` of either. Modules must be of a supported kind and
            submodules of ``model``.

    Returns:
        A non-empty list of :class:`AttentionLayer`, ``index`` counting from 0.

    Raises:
        ValueError: if no attention layer is found, or a given module is not supported or not in
            ``model``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"Expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    if layers is not None:
        return _from_user(model, layers)
    found: list[AttentionLayer] = []
    claimed: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") or prefix == "" for prefix in claimed):
            continue  # inside an attention module already found
        layer = _adapt(name, module, len(found))
        if layer is not None:
            found.append(layer)
            claimed.append(name)
    if not found:
        raise ValueError(
            f"No attention layers found in {type(model).__name__}: looked for {_looked_for()}."
            f"{_passed_over(model)} Describe yours with "
            "qkmonitor.register_attention(qkmonitor.AttentionSpec(...)), or pass `layers=` "
            "(AttentionLayer subclasses, modules, or a function of the model); see the README, "
            "'Use it on your model'."
        )
    return found


def _passed_over(model: nn.Module) -> str:
    """The modules that look like attention (by name, or an SDPA call in their code) that no
    family took, named for the error, and why they were passed over."""
    from qkmonitor.attention.recognition import NOT_ATTENTION, looks_like_attention

    passed = [
        f"{name!r} ({type(module).__name__})"
        for name, module in model.named_modules()
        if name and not isinstance(module, NOT_ATTENTION) and looks_like_attention(module)
    ]
    if not passed:
        return ""
    more = f" and {len(passed) - 3} more" if len(passed) > 3 else ""
    return (
        f" Passed over, though they look like attention: {', '.join(passed[:3])}{more}: none of "
        "their submodules is a query/key projection of a name qkmonitor knows, and no family "
        "recognises their structure."
    )


def _from_user(
    model: nn.Module, layers: LayerSpec | nn.Module | AttentionLayer
) -> list[AttentionLayer]:
    if isinstance(layers, (nn.Module, AttentionLayer)):  # one layer (a module is callable too)
        items = [layers]
    elif callable(layers):
        items = layers(model)
        if isinstance(items, (nn.Module, AttentionLayer)):
            items = [items]
        elif isinstance(items, Iterable) and not isinstance(items, (str, bytes)):
            items = list(items)
        else:
            raise ValueError(
                "Expected the function passed as `layers` to return a module, an AttentionLayer "
                f"or a list of them for the model, got {type(items).__name__}"
            )
    elif isinstance(layers, Iterable) and not isinstance(layers, (str, bytes)):
        items = list(layers)
    else:
        raise ValueError(
            f"Expected `layers` to be a module, an AttentionLayer, a list of them or a function of "
            f"the model, got {type(layers).__name__}"
        )
    names = {id(m): n for n, m in model.named_modules()}
    result: list[AttentionLayer] = []
    for i, item in enumerate(items):
        if isinstance(item, AttentionLayer):
            item.index = i
            result.append(item)
            continue
        if not isinstance(item, nn.Module):
            raise ValueError(
                "Expected `layers` to hold AttentionLayer or nn.Module items, got "
                f"{type(item).__name__} at {i}"
            )
        if id(item) not in names:
            raise ValueError(
                f"`layers[{i}]` ({type(item).__name__}) is not a submodule of the monitored "
                f"{type(model).__name__}: pass modules of the model being trained"
            )
        layer = _adapt(names[id(item)], item, i)
        if layer is None:
            raise ValueError(
                f"`layers[{i}]` ({type(item).__name__}) is not a supported attention module: "
                f"expected one of: {_looked_for()}; or describe it with qkmonitor.AttentionSpec, "
                "or wrap it in a qkmonitor.AttentionLayer subclass"
            )
        result.append(layer)
    if not result:
        raise ValueError("Expected `layers` to name at least one attention layer, got none")
    return result


def _takes_stats(module: nn.Module) -> bool:
    """Whether the module's ``register_probe`` takes ``stats=`` (an observer that reads none)."""
    return _register_probe_takes_stats(type(module))


@functools.cache
def _register_probe_takes_stats(cls: type) -> bool:
    """Read once per class: QKClip installs a probe at every step."""
    try:
        return "stats" in inspect.signature(cls.register_probe).parameters
    except (AttributeError, TypeError, ValueError):  # on the instance only, or no signature
        return False
