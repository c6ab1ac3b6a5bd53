r"""Any attention that goes through SDPA or a softmax: statistics by interception, weights by
layout.

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
  blocked keys).

The mode is entered by the probe's forward pre-hook and left by its forward hook, which runs on
an exception too (``always_call``); both hooks are removed when the last probe on the module
closes. An unprobed step installs nothing. Statistics are computed on the side under ``no_grad``
in float32 or better; the model's call runs with its own arguments and its result is returned
unchanged.

**Weights.** A layer read by name (:func:`qkmonitor.attention.layouts.infer_layouts`) has candidate
layouts, not a layout. At its first probe the mode also keeps the inputs of the projections'
``F.linear``/``addmm`` calls; :func:`check_layout` predicts, in float64, the queries and keys of
each candidate at sequence position 0 (where RoPE is the identity), QK-norm applied where the
module has one, and compares them with what the module passed to SDPA (or, for a softmax, the
logit of query 0 on key 0, where ALiBi is zero too), up to one scale each. The candidate that
reproduces them is kept, with the key head each query head really scores against and the
effective logit scale; when none does, the layer's κ is NaN and a warning says what differed.
"""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from qkmonitor.attention.adapters import AttentionLayer, QKWeights
from qkmonitor.attention.calls import MaskedCall, ScoresCall, split_mask
from qkmonitor.attention.clip import QKRows
from qkmonitor.attention.compiled import add_forward_hooks
from qkmonitor.attention.layouts import (
    HEADS_NAMES,
    AttentionSpec,
    QKLayout,
    attribute,
    grouped_index,
    infer_layouts,
    modulo_index,
    projection,
    projections_of,
    qk_norm_modules,
)
from qkmonitor.attention.probes import AttentionCall, Probe, in_side_computation, side_computation
from qkmonitor.attention.registry import register_family
from qkmonitor.attention.route import Route, observed

__all__ = [
    "InterceptedAttentionLayer",
    "LayoutChecked",
    "LayoutEvidence",
    "LayoutUnknownError",
    "check_layout",
    "looks_like_attention",
    "register_attention",
    "unmeasured_attention_like",
]

_ROUTE_KEY = "_qkmonitor_intercept"
#: the ways a softmax is called from Python (``F.softmax``, ``torch.softmax``, ``x.softmax``)
_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax)
_ATTENTION_NAME = re.compile(r"attn|attention|attend", re.IGNORECASE)
# a call or a reference in code (``F.softmax``, ``x.softmax(``), not the word in a docstring
_SDPA_IN_CODE = re.compile(
    r"[.\w]scaled_dot_product_attention\b|\bscaled_dot_product_attention\s*\("
)
_SOFTMAX_IN_CODE = re.compile(r"\.softmax\b|\bsoftmax\s*\(")


# --- the evidence one forward leaves, and the check ---------------------------------------------


@dataclass
class LayoutEvidence:
    """What the first attention call of one forward shows about the layer's layout.

    Attributes:
        inputs: ``id(weight) -> input`` of the projections' calls in that forward.
        q, k: position-0 queries ``(B, H, D)`` and keys ``(B, H_kv, D)`` of an SDPA call.
        logits: ``(B, H)`` logits of query 0 on key 0 of a softmax call.
        scale: the SDPA call's scale (None: its default ``1/sqrt(D)``).
        batch, queries, keys: B, N, M of the call.
        dtype: the dtype the module computed in.
    """

    inputs: dict[int, Tensor]
    q: Tensor | None
    k: Tensor | None
    logits: Tensor | None
    scale: float | None
    batch: int
    queries: int
    keys: int
    dtype: torch.dtype


def _tolerance(dtype: torch.dtype) -> float:
    """Relative residual a right layout stays under (TF32 and half-precision matmuls included);
    a wrong one is of order 1."""
    return 1e-2 if dtype in (torch.float32, torch.float64) else 6e-2


def _position0(x: Tensor, batch: int, length: int) -> Tensor | None:
    """Row of sequence position 0 of each sequence from a projection input ``(B, N, d)`` or
    ``(B·N, d)``."""
    if x.dim() == 3 and x.shape[0] == batch and x.shape[1] == length:
        return x[:, 0]
    if x.dim() == 2 and x.shape[0] == batch * length:
        return x.view(batch, length, -1)[:, 0]
    return None


def _fit(observed: Tensor, predicted: Tensor) -> tuple[float, float]:
    """The scalar c minimising ``|observed - c predicted|`` and the relative residual left."""
    denom = float((predicted * predicted).sum())
    if denom == 0.0 or not torch.isfinite(observed).all() or not torch.isfinite(predicted).all():
        return float("nan"), float("inf")
    c = float((observed * predicted).sum()) / denom
    norm = float(observed.norm())
    return c, (float((observed - c * predicted).norm()) / norm if norm > 0 else float("inf"))


def _predict(
    module: nn.Module, layout: QKLayout, evidence: LayoutEvidence
) -> tuple[Tensor, Tensor] | str:
    """Position-0 queries ``(B, H, D)`` and keys ``(B, H_kv, D)`` in float64, or why not."""
    sources = layout.sources(module)
    x_q = evidence.inputs.get(id(sources[0]))
    x_k = evidence.inputs.get(id(sources[-1]))
    if x_q is None or x_k is None:
        return "the projections were not called in the forward (their inputs are unknown)"
    x_q, x_k = (
        _position0(x_q, evidence.batch, evidence.queries),
        _position0(x_k, evidence.batch, evidence.keys),
    )
    if x_q is None or x_k is None:
        return "the projection inputs are not (batch, sequence, features)"
    w_q, b_q, w_k, b_k = layout.read(module)
    q = F.linear(x_q.double(), w_q.double(), None if b_q is None else b_q.double())
    k = F.linear(x_k.double(), w_k.double(), None if b_k is None else b_k.double())
    q = q.view(q.shape[0], layout.num_heads, layout.head_dim)
    k = k.view(k.shape[0], layout.num_kv_heads, layout.head_dim)
    norms = qk_norm_modules(module)
    if norms is not None:
        q, k = _normed(norms[0], q), _normed(norms[1], k)
    return q, k


def _normed(norm: nn.Module, x: Tensor) -> Tensor:
    """A QK-norm applied to ``(B, H, D)`` heads: per head, or over the whole width if it is that
    wide."""
    weight = getattr(norm, "weight", None)
    width = weight.numel() if isinstance(weight, Tensor) else None
    dtype = weight.dtype if isinstance(weight, Tensor) else torch.float32
    if width is None or width == x.shape[-1]:
        return norm(x.to(dtype)).double()
    return norm(x.flatten(1).to(dtype)).view_as(x).double()


def check_layout(
    module: nn.Module, candidates: list[QKLayout], evidence: LayoutEvidence
) -> QKLayout | str:
    """The candidate layout that reproduces what the module computed, or what did not match.

    Returns:
        The layout kept, with ``kv_index`` (the key head each query head scores against) and
        ``scale`` (the effective factor on the projections' ``q·k``) as observed; or a message.
    """
    tolerance = _tolerance(evidence.dtype)
    failures: list[str] = []
    best: tuple[float, QKLayout] | None = None
    for layout in candidates:
        predicted = _predict(module, layout, evidence)
        if isinstance(predicted, str):
            failures.append(predicted)
            continue
        q, k = predicted
        found = (
            _match_sdpa(layout, q, k, evidence)
            if evidence.q is not None
            else _match_logits(layout, q, k, evidence)
        )
        if isinstance(found, str):
            failures.append(found)
        elif best is None or found[0] < best[0]:
            best = found
    if best is None:
        return failures[0] if failures else "no candidate layout"
    residual, layout = best
    if residual > tolerance:
        return (
            f"the weights read as {layout.describe()} give queries/keys {residual:.2g} (relative) "
            f"away from those the module computed (tolerance {tolerance:g})"
        )
    return layout


def _match_sdpa(
    layout: QKLayout, q: Tensor, k: Tensor, ev: LayoutEvidence
) -> tuple[float, QKLayout] | str:
    q_obs, k_obs = ev.q.double(), ev.k.double()
    if q_obs.shape != q.shape:
        return (
            f"the call's queries have {q_obs.shape[1]} heads of {q_obs.shape[2]}, the weights "
            f"{layout.num_heads} of {layout.head_dim}"
        )
    c_q, r_q = _fit(q_obs, q)
    kv_obs = k_obs.shape[1]
    if kv_obs == layout.num_kv_heads:
        index = None
        predicted_k = k
    elif kv_obs == layout.num_heads:  # the module expanded its keys itself: which key head is each
        unit = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-300)
        unit_obs = k_obs / k_obs.norm(dim=-1, keepdim=True).clamp_min(1e-300)
        similarity = torch.einsum("bhd,bgd->hg", unit_obs, unit)  # (H, H_kv)
        index = tuple(int(g) for g in similarity.argmax(dim=1))
        predicted_k = k[:, list(index)]
    else:
        return f"the call's keys have {kv_obs} heads, the weights {layout.num_kv_heads}"
    c_k, r_k = _fit(k_obs, predicted_k)
    if not (c_q > 0 and c_k > 0):
        return "the weights' queries or keys point the other way from the call's"
    nominal = ev.scale if ev.scale is not None else layout.head_dim**-0.5
    scale = (
        nominal if abs(c_q * c_k - 1.0) < 1e-4 else nominal * c_q * c_k
    )  # a module that pre-scales q or k
    if index is not None and index == grouped_index(layout.num_heads, layout.num_kv_heads):
        index = None
    return max(r_q, r_k), replace(layout, kv_index=index, scale=scale)


def _match_logits(
    layout: QKLayout, q: Tensor, k: Tensor, ev: LayoutEvidence
) -> tuple[float, QKLayout] | str:
    logits = ev.logits.double()
    if logits.shape[1] != layout.num_heads:
        return f"the softmax has {logits.shape[1]} heads, the weights {layout.num_heads}"
    valid = torch.isfinite(logits) & (logits > torch.finfo(ev.dtype).min / 2)
    if int(valid.sum()) < 2:
        return "too few unmasked logits of query 0 on key 0 to check against"
    pairings = [None]
    if layout.num_kv_heads < layout.num_heads:
        pairings.append(modulo_index(layout.num_heads, layout.num_kv_heads))
    best: tuple[float, QKLayout] | str = "no pairing fits"
    for index in pairings:
        keys = k[:, list(index or grouped_index(layout.num_heads, layout.num_kv_heads))]
        predicted = (q * keys).sum(-1)  # (B, H)
        c, residual = _fit(logits[valid], predicted[valid])
        if c > 0 and (isinstance(best, str) or residual < best[0]):
            scale = layout.logit_scale if abs(c / layout.logit_scale - 1.0) < 1e-4 else c
            best = (residual, replace(layout, kv_index=index, scale=scale))
    return best


# --- interception --------------------------------------------------------------------------------


class _Interceptor(TorchFunctionMode):
    """Sees the torch calls of one forward of a module; hands them to that call's state."""

    def __init__(self, call: _Call) -> None:
        super().__init__()
        self.call = call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = self.call
        if in_side_computation():  # qkmonitor measuring a call inside the forward, not the model
            return func(*args, **kwargs)
        weights = call.route.weights
        if func is F.scaled_dot_product_attention:
            call.on_sdpa(args, kwargs)
        elif func in _SOFTMAX:
            call.on_softmax(args, kwargs)
        elif weights and (func is F.linear or func is torch.addmm):
            call.on_projection(func, args, kwargs)
        elif weights and func in _MATMUL and len(args) == 2:
            call.on_matmul(*args)
        return func(*args, **kwargs)


_MATMUL = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _InterceptRoute(Route):
    """A module's calls intercepted while it runs: the hooks that enter and leave the
    interception. What one forward captures is that call's own (:class:`_Call`), on a stack per
    thread: a module called again inside its own forward, or from several threads at once
    (``nn.DataParallel`` replicas share the module's ``__dict__``), keeps each call's evidence
    apart."""

    key = _ROUTE_KEY

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.heads: int | None = None  # the query heads, where the layer knows them before a call
        self.weights: dict[int, int] = {}  # id(weight) -> probes asking for its inputs
        self._threads = threading.local()  # .calls: this thread's open calls, innermost last
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

    def _leave(self, module: nn.Module, args, output) -> None:
        calls = self._calls()
        if calls:
            calls.pop().mode.__exit__(None, None, None)

    def uninstall(self) -> None:
        self._remove_hooks()
        # a forward left without its hook: a BaseException (KeyboardInterrupt) skips torch's
        # always-call hooks, so its mode is still entered on this thread until the probe closes
        calls = self._calls()
        while calls:
            calls.pop().mode.__exit__(None, None, None)


class _Call:
    """What one forward of an intercepted module captures: the projections' inputs the layout
    check asks for, the first 4-D ``q @ kᵀ`` (an explicit softmax's queries and keys), and
    whether an attention call was already handed on (the first carries the layout evidence)."""

    def __init__(self, route: _InterceptRoute) -> None:
        self.route = route
        self.inputs: dict[int, Tensor] = {}
        self.first = True
        self.qk: tuple[Tensor, Tensor] | None = None
        self.mode = _Interceptor(self)

    def on_projection(self, func, args, kwargs) -> None:
        if func is F.linear:
            x, weight = (list(args) + [kwargs.get("input"), kwargs.get("weight")])[:2]
        else:  # Conv1D: addmm(bias, x, weight)
            x, weight = (list(args) + [None, None, None])[1:3]
        if (
            isinstance(weight, Tensor)
            and id(weight) in self.route.weights
            and isinstance(x, Tensor)
        ):
            self.inputs.setdefault(id(weight), x.detach())

    def on_matmul(self, a, b) -> None:
        """``x @ W.T`` (a projection written as a matmul, e.g. Falcon's) and the first 4-D
        ``q @ k.transpose(-2, -1)`` of the forward (the queries and keys of an explicit softmax)."""
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return
        weight = b if id(b) in self.route.weights else b._base
        if weight is not None and id(weight) in self.route.weights:
            self.inputs.setdefault(id(weight), a.detach())
        elif self.qk is None and a.dim() == 4 and b.dim() == 4 and a.shape[-1] == b.shape[-2]:
            self.qk = (a.detach(), b.detach().transpose(-1, -2))

    def on_sdpa(self, args, kwargs) -> None:
        sdpa = dict(zip(_SDPA_ARGS, args)) | kwargs
        q, k = sdpa["query"], sdpa["key"]
        self._notify(
            lambda: _sdpa_call(
                q, k, sdpa.get("attn_mask"), bool(sdpa.get("is_causal", False)), sdpa.get("scale")
            ),
            lambda: self._evidence(q, k, None, sdpa.get("scale")),
        )

    def on_softmax(self, args, kwargs) -> None:
        x = args[0] if args else kwargs.get("input")
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not isinstance(x, Tensor) or x.dim() != 4 or dim not in (-1, 3):
            return
        if (
            self.route.heads is not None and x.shape[1] != self.route.heads
        ):  # not (B, H, N, M): heads folded elsewhere
            return
        qk = self.qk
        if qk is not None and qk[0].shape[:3] == x.shape[:3] and qk[1].shape[2] == x.shape[3]:
            self._notify(lambda: _scores_call(x), lambda: self._evidence(qk[0], qk[1], None, None))
        else:
            self._notify(lambda: _scores_call(x), lambda: self._evidence(None, None, x, None))

    def _notify(self, build: Callable, evidence: Callable) -> None:
        if not self.route.observers:
            return
        first, self.first = self.first, False

        def build_with_evidence() -> AttentionCall:
            call = build()
            if first and self.route.weights:
                call.evidence = evidence()
            return call

        self.route.observers.notify(observed(build_with_evidence))

    def _evidence(
        self, q: Tensor | None, k: Tensor | None, logits: Tensor | None, scale
    ) -> LayoutEvidence:
        like = q if q is not None else logits
        b, n, m = like.shape[0], like.shape[2], (k.shape[2] if k is not None else logits.shape[3])
        return LayoutEvidence(
            dict(self.inputs),
            None if q is None else q[:, :, 0].detach().clone(),
            None if k is None else k[:, :, 0].detach().clone(),
            None if logits is None else logits[:, :, 0, 0].detach().clone(),
            None if scale is None else float(scale),
            b,
            n,
            m,
            like.dtype,
        )


def _sdpa_call(q: Tensor, k: Tensor, attn_mask, is_causal: bool, scale) -> MaskedCall:
    """The statistics of one SDPA call as SDPA defines it (``is_causal`` top-left aligned)."""
    n, m = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    call = MaskedCall(q.detach(), k.detach(), scale, False, None, None, None)
    allowed = bias = None
    if attn_mask is not None:
        mask = attn_mask.detach()
        while mask.dim() < 4:
            mask = mask[None]
        allowed, bias = split_mask(mask)  # additive: -inf and finfo.min-like entries are blocked
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


def _scores_call(logits: Tensor) -> ScoresCall:
    """The logits a module hands its softmax; ``finfo.min``-like entries are blocked keys."""
    scores = logits.detach()
    scores = scores.double() if scores.dtype == torch.float64 else scores.float()
    blocked = logits.detach() <= torch.finfo(logits.dtype).min / 2
    return ScoresCall(scores.masked_fill(blocked, float("-inf")))


def _route_probe(
    module: nn.Module,
    probe: Probe,
    weights: list[Tensor],
    observe: Callable | None = None,
    heads: int | None = None,
) -> Callable[[], None]:
    """Route the module's attention calls to ``observe`` (default ``probe.observe``), and keep the
    inputs of ``weights`` for a layout check."""

    def make() -> _InterceptRoute:
        route = _InterceptRoute(module)
        route.heads = heads
        return route

    route, remove_observer = _InterceptRoute.attach(
        module, observe or probe.observe, probe.request.sink_tokens, make
    )
    keys = [id(w) for w in weights]
    for key in keys:
        route.weights[key] = route.weights.get(key, 0) + 1

    def remove() -> None:
        for key in keys:
            route.weights[key] -= 1
            if not route.weights[key]:
                del route.weights[key]
        remove_observer()

    return remove


# --- the layer -----------------------------------------------------------------------------------


class LayoutChecked:
    """Weights read by layout (candidates, or one stated by an :class:`AttentionSpec`), kept only
    once a forward has reproduced them (:func:`check_layout`). Mixed into an
    :class:`~qkmonitor.attention.adapters.AttentionLayer` that has ``name`` and ``module``."""

    name: str
    module: nn.Module

    def set_layouts(
        self, candidates: list[QKLayout], *, trusted: bool = False, heads_from_call: bool = False
    ) -> None:
        """The candidate layouts; ``trusted``: the first one is used until a forward checks it;
        ``heads_from_call``: the projections are known but not the head counts (taken from the
        call)."""
        self.layout_candidates = list(candidates)
        self.layout: QKLayout | None = self.layout_candidates[0] if trusted and candidates else None
        self.layout_error: str | None = None
        self._checked = False
        self._trusted = trusted
        self._paths = projections_of(self.module) if heads_from_call else None

    @property
    def supports_weights(self) -> bool:
        return bool(self.layout_candidates) or self._paths is not None

    @property
    def needs_layout_check(self) -> bool:
        return self.supports_weights and not self._checked

    def qk_weights(self) -> QKWeights:
        return self._checked_layout().qk_weights(self.module)

    def qk_rows(self) -> QKRows:
        return self._checked_layout().qk_rows(self.module)

    def _checked_layout(self) -> QKLayout:
        if self.layout is None or not self._checked:
            why = self.layout_error or "its layout is checked at the first probed forward"
            raise LayoutUnknownError(f"the weights of {self.name!r} are not read: {why}")
        return self.layout

    def _layout_sources(self) -> list[Tensor]:
        seen, out = set(), []
        if self._paths is not None:
            layouts = [QKLayout(self._paths[0], self._paths[1], "blocks", 1, 1, 1)]
        else:
            layouts = self.layout_candidates
        for layout in layouts:
            for weight in layout.sources(self.module):
                if id(weight) not in seen:
                    seen.add(id(weight))
                    out.append(weight)
        return out

    def install_layout(self, probe: Probe) -> Callable[[], None]:
        def observe(call) -> None:
            # judged now, inside the forward: the weights are those that computed the call (an
            # optimizer step may change them before the probe closes)
            evidence = getattr(call, "evidence", None)
            if evidence is not None and self._verdict is None:
                try:
                    with torch.no_grad(), side_computation():
                        self._verdict = self._judge(evidence)
                except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
                    self._verdict = f"the layout check failed ({type(err).__name__}: {err})"
            probe.observe(call)

        self._verdict = None
        return _route_probe(
            self.module, probe, self._layout_sources(), observe, self._known_heads()
        )

    def _known_heads(self) -> int | None:
        """H where the layout candidates agree on it before any call (a softmax over another dim 1
        is then not this layer's attention)."""
        counts = {layout.num_heads for layout in self.layout_candidates}
        return counts.pop() if len(counts) == 1 else None

    @property
    def layout_ready(self) -> bool:
        return self.layout is not None and self._checked

    @property
    def num_heads_hint(self) -> int:
        layout = self.layout or (self.layout_candidates[0] if self.layout_candidates else None)
        return (
            layout.num_heads if layout is not None else (attribute(self.module, HEADS_NAMES) or 1)
        )

    @property
    def has_qk_norm(self) -> bool:
        return qk_norm_modules(self.module) is not None

    def weights_copy(self) -> SimpleNamespace:
        """A CPU copy of the projection weights the candidates read (``(out, in)`` layout), which
        ``layout.qk_weights`` reads like the module: values as they are now, for a check to come."""
        copy = SimpleNamespace()
        paths = self._paths or {
            p for layout in self.layout_candidates for p in (layout.q, layout.k) if p
        }
        for path in paths:
            if path is None:
                continue
            weight, _ = projection(self.module, path)
            owner = copy
            *parents, leaf = path.split(".")
            for part in parents:
                owner = owner.__dict__.setdefault(part, SimpleNamespace())
            setattr(owner, leaf, weight.detach().to("cpu", copy=True))
        return copy

    def _judge(self, evidence: LayoutEvidence) -> QKLayout | str:
        """The layout the evidence of one forward confirms, or why none (see
        :func:`check_layout`)."""
        if not all(id(w) in evidence.inputs for w in self._layout_sources()):
            return _UNSEEN_PROJECTIONS
        candidates = self.layout_candidates
        if self._paths is not None:  # counts from the call: H from the queries, H_kv from the keys
            heads = (evidence.q if evidence.q is not None else evidence.logits).shape[1]
            kv = (
                evidence.k.shape[1]
                if evidence.k is not None and evidence.k.shape[1] < heads
                else None
            )
            candidates = infer_layouts(self.module, heads=heads, kv_heads=kv, paths=self._paths)
            if not candidates:
                return (
                    f"its projections {self._paths} do not split into the {heads} heads of its "
                    "attention call"
                )
        return check_layout(self.module, candidates, evidence)

    def check_layout(self, result) -> str | None:
        """Keep the layout the first probed forward confirmed; a message when it confirmed none
        (the spectrum metrics are then NaN). Called once, when the first layout probe closes."""
        if self._checked:
            return None
        self._checked = True
        verdict, self._verdict = getattr(self, "_verdict", None), None
        if isinstance(verdict, QKLayout):
            self.layout, self.layout_error = verdict, None
            return None
        why = (
            verdict
            if verdict is not None
            else "no SDPA or 4-D softmax call was seen in its forward"
        )
        if verdict == _UNSEEN_PROJECTIONS or verdict is None:
            if self._trusted:
                return f"layer {self.name!r}: {why}, so its AttentionSpec layout is used unchecked"
            self.layout, self.layout_error = None, why
            return (
                f"layer {self.name!r}: {why}, so its weight layout cannot be checked; its "
                "spectrum metrics are NaN"
            )
        self.layout, self.layout_error = None, why
        return f"layer {self.name!r}: {why}; its spectrum metrics (kappa, ...) are NaN"


_UNSEEN_PROJECTIONS = "its projections were not called as F.linear, addmm or x @ W.T in its forward"


class LayoutUnknownError(ValueError):
    """A layer's W_Q/W_K layout is not (yet, or not at all) confirmed by its forward."""


class InterceptedAttentionLayer(LayoutChecked, AttentionLayer):
    """An attention module measured by interception, its weights read by layout.

    Args:
        name, module, index: as :class:`~qkmonitor.attention.adapters.AttentionLayer`.
        candidates: layouts its weights may have
        (:func:`qkmonitor.attention.layouts.infer_layouts`);
            empty for a module whose projections are not recognised (statistics only).
        kind: the family, shown at discovery.
        trusted: the candidate was stated by the user (an :class:`AttentionSpec`): used until a
            forward checks it.
        heads_from_call: the projections are known, the head counts come from the first call.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        index: int = 0,
        *,
        candidates: list[QKLayout] = (),
        kind: str = "intercepted",
        trusted: bool = False,
        heads_from_call: bool = False,
    ) -> None:
        AttentionLayer.__init__(self, name, module, index)
        self.kind = kind
        self.set_layouts(list(candidates), trusted=trusted, heads_from_call=heads_from_call)

    @property
    def supports_stats(self) -> bool:
        return True

    def install(self, probe: Probe) -> Callable[[], None]:
        return _route_probe(self.module, probe, [], heads=self._known_heads())


# --- recognising modules -------------------------------------------------------------------------


_FRAMEWORKS = (
    "transformers.modeling_utils",
    "transformers.generation",
    "transformers.integrations",
    "torch.",
    "lightning.",
    "pytorch_lightning.",
)


@cache
def _computes_attention(cls: type) -> str | None:
    """``"sdpa"`` or ``"softmax"`` if the class's own source (up to ``nn.Module``) calls it."""
    found = None
    for base in cls.__mro__:
        if base in (nn.Module, object):
            break
        if base.__module__.startswith(_FRAMEWORKS):  # e.g. PreTrainedModel: its code names SDPA
            continue
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        if _SDPA_IN_CODE.search(source):
            return "sdpa"
        if _SOFTMAX_IN_CODE.search(source):
            found = "softmax"
    return found


def _child_computes(module: nn.Module) -> str | None:
    kinds = {_computes_attention(type(child)) for child in module.children()} - {None}
    return "sdpa" if "sdpa" in kinds else ("softmax" if kinds else None)


def looks_like_attention(module: nn.Module) -> bool:
    """An attention-like class name, or a forward that calls SDPA."""
    return (
        bool(_ATTENTION_NAME.search(type(module).__name__))
        or _computes_attention(type(module)) == "sdpa"
    )


_NOT_ATTENTION = (
    nn.Linear,
    nn.Embedding,
    nn.LayerNorm,
    nn.Dropout,
    nn.ModuleList,
    nn.ModuleDict,
    nn.Sequential,
)


def _library(module: nn.Module) -> str:
    root = type(module).__module__.split(".")[0]
    return "module" if root in ("__main__", "builtins") else root


def adapt_intercepted(name: str, module: nn.Module, index: int) -> InterceptedAttentionLayer | None:
    """Any module that computes attention (SDPA or a softmax in its code or its children's) and
    has query/key projections of a recognised name, or an attention name and an SDPA call."""
    if isinstance(module, _NOT_ATTENTION):
        return None
    own = _computes_attention(type(module))
    named = bool(_ATTENTION_NAME.search(type(module).__name__))
    paths = projections_of(module)
    kind = f"{_library(module)}.{type(module).__name__}"
    if (
        paths is None
    ):  # statistics only (its weights are not found), if its own code computes attention
        inner = any(
            projections_of(child) is not None for child in module.modules() if child is not module
        )
        if not inner and (own == "sdpa" or (own and named)):
            return InterceptedAttentionLayer(name, module, index, kind=kind)
        return None
    # the attention call may sit in the module's code, a child's (x-transformers' `attend`), or a
    # module-level function its forward calls (GPT-NeoX and ModernBERT before transformers 5): an
    # attention-like name with projections of a known name is enough; the first probe checks it
    if not (own or named or _child_computes(module)):
        return None
    candidates = infer_layouts(module)
    return InterceptedAttentionLayer(
        name, module, index, candidates=candidates, kind=kind, heads_from_call=not candidates
    )


def unmeasured_attention_like(
    model: nn.Module, layers: list[AttentionLayer]
) -> list[tuple[str, str]]:
    """``(name, class)`` of modules that look like attention (:func:`looks_like_attention`) but are
    neither a found layer, inside one, nor around one (a block holding a found layer)."""
    found = [layer.name for layer in layers]

    def related(name: str) -> bool:
        return any(
            name == f
            or name.startswith(f + ".")
            or f.startswith(name + ".")
            or name == ""
            or f == ""
            for f in found
        )

    return [
        (name, type(module).__name__)
        for name, module in model.named_modules()
        if name
        and not related(name)
        and not isinstance(module, _NOT_ATTENTION)
        and looks_like_attention(module)
    ]


def register_attention(spec: AttentionSpec) -> None:
    """Recognise the modules ``spec`` matches, before every built-in rule (:class:`AttentionSpec`).

    Registering a spec of the same family name again replaces it.

    Raises:
        ValueError: if ``spec`` is not an :class:`AttentionSpec`.
    """
    if not isinstance(spec, AttentionSpec):
        raise ValueError(
            f"Expected `spec` to be a qkmonitor.AttentionSpec, got {type(spec).__name__}"
        )

    def adapt(name: str, module: nn.Module, index: int) -> InterceptedAttentionLayer | None:
        if not spec.matches(name, module):
            return None
        return InterceptedAttentionLayer(
            name, module, index, candidates=[spec.layout(module)], kind=spec.family, trusted=True
        )

    register_family(
        spec.family,
        adapt,
        priority=0,
        looked_for=f"modules matching the AttentionSpec {spec.family!r}",
    )


register_family(
    "intercepted",
    adapt_intercepted,
    priority=90,
    looked_for=(
        "any module calling F.scaled_dot_product_attention or a 4-D softmax with query/key "
        "projections named q_proj/k_proj, query/key, to_q/to_k, wq/wk, q/k, q_lin/k_lin, or fused "
        "qkv, c_attn, query_key_value, Wqkv, qkv_proj (timm, litgpt, x-transformers, "
        "nanoGPT-style modules)"
    ),
)
