"""Hugging Face ``transformers`` attention modules as qkmonitor attention layers (the ``hf`` extra).

Three families are recognised by structure, not by class name:

- **LLaMA-family** (``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention``, ...): ``q_proj`` and
  ``k_proj`` ``nn.Linear`` with the head counts on the module or its ``config``
  (``num_attention_heads``, ``num_key_value_heads`` for GQA/MQA, ``head_dim``); the scale is
  ``module.scaling``, else ``1/sqrt(head_dim)``. With RoPE, W_QK is the position-0 bilinear form;
  a QK-norm (``q_norm``/``k_norm``, e.g. Qwen3) is not part of it (``QKWeights.qk_norm`` says so).
- **GPT-2** (``GPT2Attention``): a ``c_attn`` ``Conv1D`` whose weight is ``(in, 3·embed)`` —
  transposed compared to ``nn.Linear`` — split into q, k, v (cross-attention: ``q_attn`` and a
  ``(in, 2·embed)`` ``c_attn``); the scale is ``1/sqrt(head_dim)`` when ``scale_attn_weights``,
  divided by ``layer_idx + 1`` when ``scale_attn_by_inverse_layer_idx``.
- **BERT** (``BertSelfAttention``, ``BertCrossAttention`` and copies such as RoBERTa's): ``query``
  and ``key`` ``nn.Linear``, ``num_attention_heads``, ``attention_head_size``.

Activation statistics: these modules pick their attention function at every forward with
``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)``
(older releases differ: :mod:`qkmonitor._hf_compat` says how, from 4.48 on) and call it with
``(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)``
— queries and keys after RoPE and the cache, the model's own mask. While a layer is probed its
module alone sees a shallow copy of the model config whose ``_attn_implementation`` names
``"qkmonitor_probe"``, a function registered through ``transformers.AttentionInterface`` that
measures the call on the side, under ``no_grad``, then hands the same arguments to the
implementation the model was using and returns its result unchanged. The shared model config is
never written: ``transformers`` also builds the attention *mask* from ``config._attn_implementation``
(``masking_utils``), so renaming it model-wide would change the masks the model computes with.
The first open probe on a module installs that view (and a route holding the probes' observers
in the module's ``__dict__``); the last one closed puts the module's own config object back and
removes the route, so no state outlives the probes. GPT-2 with
``reorder_and_upcast_attn`` under eager attention bypasses the dispatch; there the module's
``_upcast_and_reordered_attn`` is wrapped on the instance instead.

Which keys a query row may attend follows the implementation the model uses: a 4-D mask (bool,
True = attend, or additive float, ``finfo.min``/``-inf`` = blocked) says it all; without one,
eager attention attends everything while SDPA and FlashAttention apply ``is_causal`` (the call's
keyword, else ``module.is_causal``); a 2-D mask is FlashAttention's key padding. When the mask is
causal and/or key padding the statistics come from :func:`qkmonitor.kernels.attention` (no N×M
matrix); other masks, ``sliding_window``, ``softcap`` and ``position_bias`` go through explicit
scores, a few query rows at a time. ``flex_attention``'s ``BlockMask`` is not supported (a warning,
no statistics). A query row left with no key (e.g. a padded query under a sliding window) has
zero statistics and ``attended = 0``, as everywhere in qkmonitor, where eager attention would
spread it uniformly. A metric problem never stops training: the probe records the failure and the
monitor warns.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real

import torch
from torch import Tensor, nn

from qkmonitor import _hf_compat
from qkmonitor.adapters import AttentionLayer, QKWeights, _FailedCall
from qkmonitor.probes import ObserverSet, Probe, full_precision

__all__ = [
    "PROBE_IMPLEMENTATION",
    "HFAttentionLayer",
    "LlamaAttentionLayer",
    "GPT2AttentionLayer",
    "BertAttentionLayer",
    "adapt_hf_module",
]

#: The name the probe registers in ``transformers``' ``AttentionInterface``.
PROBE_IMPLEMENTATION = "qkmonitor_probe"
_ORIGINAL_KEY = "_qkmonitor_original_attn_implementation"
_MAX_SCORES = 1 << 24  # explicit path: score elements per chunk (128 MiB in float64)


#: Where probing keeps its route on a module (installed by the first open probe, removed by the last).
_ROUTE_KEY = "_qkmonitor_route"


class _Route:
    """What probing installed on one module: the probes' observers, and how to undo the install."""

    def __init__(self, restore: Callable[[], None], default_scale: Callable[[], float]) -> None:
        self.observers = ObserverSet()
        self.restore = restore
        self.default_scale = default_scale


class HFAttentionLayer(AttentionLayer):
    """A ``transformers`` attention module; subclasses read its query/key weights."""

    kind = "transformers"

    def _default_scale(self) -> float:
        return self.qk_weights().scale

    @property
    def supports_stats(self) -> bool:
        if not _hf_compat.dispatches(self.module):  # e.g. BERT before transformers 5.0
            _warn(self.name, _hf_compat.why_no_dispatch(self.module))
            return False
        if not hasattr(getattr(self.module, "config", None), "_attn_implementation"):
            _warn(self.name, f"transformers {_hf_compat.transformers_version()}: {type(self.module).__name__} "
                             "has no `config._attn_implementation` to route its attention call by")
            return False
        return True

    def _install(self, probe: Probe) -> Callable[[], None]:
        module = self.module
        route = module.__dict__.get(_ROUTE_KEY)
        if route is None:
            restore = _route_module(self)
            if restore is None:  # warned: the probe sees no call, and the monitor says so
                return lambda: None
            route = _Route(restore, self._default_scale)
            module.__dict__[_ROUTE_KEY] = route
        remove_observer = route.observers.add(probe.observe, probe.request.sink_tokens)

        def remove() -> None:
            remove_observer()
            if not route.observers and module.__dict__.get(_ROUTE_KEY) is route:
                del module.__dict__[_ROUTE_KEY]
                route.restore()

        return remove


class LlamaAttentionLayer(HFAttentionLayer):
    """LLaMA-family attention: ``q_proj``/``k_proj`` ``nn.Linear``, GQA from the config."""

    kind = "transformers.llama"

    def qk_weights(self) -> QKWeights:
        m = self.module
        heads, kv_heads, head_dim = _llama_shape(m)
        scale = m.scaling if _is_number(getattr(m, "scaling", None)) else head_dim**-0.5
        qk_norm = isinstance(getattr(m, "q_norm", None), nn.Module) and isinstance(getattr(m, "k_norm", None), nn.Module)
        return QKWeights(m.q_proj.weight, m.k_proj.weight, heads, kv_heads, float(scale), qk_norm=qk_norm)


class GPT2AttentionLayer(HFAttentionLayer):
    """GPT-2 attention: q, k, v packed in the ``c_attn`` ``Conv1D`` (weight ``(in, out)``)."""

    kind = "transformers.gpt2"

    def qk_weights(self) -> QKWeights:
        m = self.module
        e, w = m.embed_dim, m.c_attn.weight  # Conv1D: (in_features, out_features)
        if getattr(m, "is_cross_attention", False):  # c_attn holds k, v; q_attn holds q
            w_q, w_k = m.q_attn.weight.T, w[:, :e].T
        else:
            w_q, w_k = w[:, :e].T, w[:, e : 2 * e].T
        return QKWeights(w_q, w_k, m.num_heads, m.num_heads, _gpt2_scale(m))


class BertAttentionLayer(HFAttentionLayer):
    """BERT-style attention: ``query``/``key`` ``nn.Linear``, ``attention_head_size``."""

    kind = "transformers.bert"

    def qk_weights(self) -> QKWeights:
        m = self.module
        heads, head_dim = m.num_attention_heads, m.attention_head_size
        scale = m.scaling if _is_number(getattr(m, "scaling", None)) else head_dim**-0.5
        return QKWeights(m.query.weight, m.key.weight, heads, heads, float(scale))


def adapt_hf_module(name: str, module: nn.Module, index: int) -> HFAttentionLayer | None:
    """The adapter for a ``transformers`` attention module of a supported shape, else None."""
    if _llama_shape(module) is not None:
        return LlamaAttentionLayer(name, module, index)
    if _is_gpt2(module):
        return GPT2AttentionLayer(name, module, index)
    if _is_bert(module):
        return BertAttentionLayer(name, module, index)
    return None


# --- recognising the modules -------------------------------------------------------------------


def _is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _int_attr(*candidates) -> int | None:
    """The first positive int among ``(object, attribute)`` pairs."""
    for obj, attr in candidates:
        value = getattr(obj, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _llama_shape(module: nn.Module) -> tuple[int, int, int] | None:
    """(num_heads, num_kv_heads, head_dim) of a q_proj/k_proj attention module, or None."""
    q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
    config = getattr(module, "config", None)
    if not isinstance(q, nn.Linear) or not isinstance(k, nn.Linear) or not hasattr(config, "num_attention_heads"):
        return None
    heads = _int_attr((module, "num_heads"), (module, "num_attention_heads"), (config, "num_attention_heads"))
    if heads is None or q.out_features % heads:
        return None
    head_dim = _int_attr((module, "head_dim"), (config, "head_dim")) or q.out_features // heads
    kv_heads = _int_attr((module, "num_key_value_heads"), (config, "num_key_value_heads"))
    groups = _int_attr((module, "num_key_value_groups"))
    if kv_heads is None:
        kv_heads = heads // groups if groups else k.out_features // head_dim
    if q.out_features != heads * head_dim or k.out_features != kv_heads * head_dim or heads % kv_heads:
        return None
    return heads, kv_heads, head_dim


def _is_gpt2(module: nn.Module) -> bool:
    c_attn = getattr(module, "c_attn", None)
    e, heads = _int_attr((module, "embed_dim")), _int_attr((module, "num_heads"))
    weight = getattr(c_attn, "weight", None)
    if e is None or heads is None or not isinstance(weight, Tensor) or weight.dim() != 2 or e % heads:
        return False
    cross = bool(getattr(module, "is_cross_attention", False))
    packed = 2 * e if cross else 3 * e
    # Conv1D keeps (in, out) and says so through `nf` (out); nn.Linear would be (out, in)
    return getattr(c_attn, "nf", None) == packed and weight.shape[1] == packed and (
        not cross or isinstance(getattr(getattr(module, "q_attn", None), "weight", None), Tensor))


def _gpt2_scale(module: nn.Module) -> float:
    scale = 1.0
    if getattr(module, "scale_attn_weights", True):
        scale = (module.embed_dim // module.num_heads) ** -0.5
    if getattr(module, "scale_attn_by_inverse_layer_idx", False):
        scale /= float((module.layer_idx or 0) + 1)
    return scale


def _is_bert(module: nn.Module) -> bool:
    q, k = getattr(module, "query", None), getattr(module, "key", None)
    heads = _int_attr((module, "num_attention_heads"))
    head_dim = _int_attr((module, "attention_head_size"))
    return (isinstance(q, nn.Linear) and isinstance(k, nn.Linear) and heads is not None
            and head_dim is not None and q.out_features == heads * head_dim
            and k.out_features == heads * head_dim)


# --- probing: install, dispatch, restore -------------------------------------------------------


def _dispatch_table(module: nn.Module):
    """The ``ALL_ATTENTION_FUNCTIONS`` the module's own source file dispatches through, or None."""
    return _hf_compat.dispatch_table(module)  # a dict before transformers 4.51


def _eager_default(module: nn.Module):
    return _hf_compat.eager_default(module)


def _register() -> None:
    _hf_compat.register(PROBE_IMPLEMENTATION, _probe_attention)


def _route_module(layer: HFAttentionLayer) -> Callable[[], None] | None:
    """Point the module (alone) at the probe; return what undoes it, or None (with a warning)."""
    module = layer.module
    config = module.config
    original = config._attn_implementation
    if original in (None, "eager") and getattr(module, "reorder_and_upcast_attn", False):
        return _route_gpt2_upcast(layer)  # this path never reaches the dispatch
    if original in (None, "eager") and _eager_default(module) is None:
        _warn(layer.name, f"no `eager_attention_forward` next to {type(module).__name__} to hand the call to")
        return None
    _register()
    probe_config = copy.copy(config)  # shallow: only this module's view of the implementation changes
    probe_config.__dict__["_attn_implementation_internal"] = PROBE_IMPLEMENTATION
    probe_config.__dict__[_ORIGINAL_KEY] = original
    if probe_config._attn_implementation != PROBE_IMPLEMENTATION:
        _warn(layer.name, "this transformers version keeps `config._attn_implementation` elsewhere")
        return None
    module.config = probe_config

    def restore() -> None:
        module.config = config

    return restore


def _route_gpt2_upcast(layer: HFAttentionLayer) -> Callable[[], None]:
    module = layer.module
    own = type(module)._upcast_and_reordered_attn.__get__(module)

    def upcast_and_reordered_attn(query, key, value, attention_mask=None, *args, **kwargs):
        mask, seen = _hf_compat.as_applied(module, query, key, attention_mask,
                                           {"scaling": getattr(module, "scaling", None)}, "eager",
                                           eager=type(module)._upcast_and_reordered_attn)
        _capture(module, query, key, mask, seen, original="eager")
        return own(query, key, value, attention_mask, *args, **kwargs)  # head_mask before 5.0

    module.__dict__["_upcast_and_reordered_attn"] = upcast_and_reordered_attn

    def restore() -> None:
        module.__dict__.pop("_upcast_and_reordered_attn", None)

    return restore


def _probe_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask, *args, **kwargs):
    """The registered attention function: measure on the side, then run the model's own."""
    original = getattr(module.config, _ORIGINAL_KEY, None)
    mask, seen = _hf_compat.as_applied(module, query, key, attention_mask, kwargs, original)
    _capture(module, query, key, mask, seen, original=original)
    attend = _hf_compat.attention_function(_dispatch_table(module), original, _eager_default(module))
    return attend(module, query, key, value, attention_mask, *args, **kwargs)


def _capture(module: nn.Module, query: Tensor, key: Tensor, attention_mask, kwargs: dict, original) -> None:
    route = module.__dict__.get(_ROUTE_KEY)
    if route is None or not route.observers:
        return
    try:
        with torch.no_grad():
            scale = kwargs.get("scaling")
            call = _Call.of(module, query, key, attention_mask, kwargs, original,
                            scale=route.default_scale() if scale is None else float(scale))
    except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
        call = _FailedCall(err)
    route.observers.notify(call)


def _warn(name: str, why: str) -> None:
    warnings.warn(f"qkmonitor: no attention statistics for {name!r} ({why})", RuntimeWarning, stacklevel=2)


# --- the statistics of one call ----------------------------------------------------------------


@dataclass
class _Call:
    """One attention call, reduced to scores and the keys each query row may attend."""

    q: Tensor  # (B, H, N, D)
    k: Tensor  # (B, H_kv, M, D)
    scale: float
    causal: bool  # bottom-right aligned: row i attends key j <= i + M - N
    padding: Tensor | None  # (B, M) bool, True = attend
    allowed: Tensor | None  # 4-D bool broadcastable to (B, H, N, M), beyond causal/padding
    bias: Tensor | None  # 4-D additive float, same broadcasting
    window: int | None = None
    softcap: float | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, module, query, key, mask, kwargs, original, scale) -> _Call:
        n, m = query.shape[2], key.shape[2]
        bias = kwargs.get("position_bias")
        softcap = kwargs.get("softcap")
        call = cls(query, key, scale, False, None, None, None, None, None if softcap is None else float(softcap))
        if isinstance(mask, Tensor) and mask.dim() == 4:  # the mask says it all (sliding windows too)
            call.allowed, mask_bias = _split_mask(mask[..., :m])  # eager cuts a longer mask to the keys
            call.bias = _add(mask_bias, bias)
            call._reduce()
            return call
        if mask is not None and not (isinstance(mask, Tensor) and mask.dim() == 2):
            raise ValueError(f"attention mask of type {type(mask).__name__} is not supported")
        call.bias = bias
        if mask is not None:  # FlashAttention's (B, M) key padding, 1 = attend
            call.padding = mask.to(torch.bool)
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        call.causal = original not in (None, "eager") and bool(is_causal) and n > 1
        if original is not None and "flash" in original:  # FlashAttention applies the window itself
            call.window = kwargs.get("sliding_window")
        if original == "sdpa" and call.causal and mask is None and m > n:
            call.k = key[:, :, :n]  # what sdpa_attention_forward does for this case
        return call

    def _reduce(self) -> None:
        """Recognise a 4-D mask that is only causal and/or key padding (the kernel's cases)."""
        a = self.allowed
        if self.bias is not None or a.shape[1] != 1:
            return
        a = a[:, 0].expand(self.q.shape[0], *a.shape[-2:])  # (B, N, M)
        n, m = a.shape[-2:]
        pad = a.any(dim=1)  # a key any row may attend (the last row, when causal)
        for causal in (False, True):
            rule = torch.ones(n, m, dtype=torch.bool, device=a.device)
            rule = rule.tril(m - n) if causal else rule
            if torch.equal(a, rule & pad[:, None, :]):
                self.causal, self.allowed = causal, None
                self.padding = None if bool(pad.all()) else pad
                return

    def stats(self, sink_tokens: int = 0):
        """Per-row statistics; computed once per sink count however many probes ask."""
        cached = self._cache.get(sink_tokens)
        if cached is None:
            cached = self._cache[sink_tokens] = self._stats(sink_tokens)
        return cached

    def _stats(self, sink_tokens: int):
        from qkmonitor.functional import attention_stats_from_scores
        from qkmonitor.kernels import attention

        if self.allowed is None and self.bias is None and self.window is None and self.softcap is None:
            try:
                with full_precision():
                    return attention(self.q, self.k, self.k, causal=self.causal, key_padding_mask=self.padding,
                                     scale=self.scale, return_stats=True, sink_tokens=sink_tokens)[1]
            except ValueError:  # a shape or dtype the kernel does not take: the explicit path below
                pass
        b, h, n = self.q.shape[:3]
        rows = max(1, _MAX_SCORES // (h * self.k.shape[2]))
        return _cat_stats([_cat_stats([attention_stats_from_scores(*self._scores(slice(i, i + 1), slice(r, r + rows)),
                                                                   sink_tokens=sink_tokens)
                                       for r in range(0, n, rows)], dim=2) for i in range(b)], dim=0)

    def probs(self, sequences: int, rows: int) -> Tensor:
        """(S, H, R, M) attention probabilities of the first sequences and query rows."""
        from qkmonitor.functional import masked_softmax

        scores, allowed = self._scores(slice(0, sequences), slice(0, rows))
        return masked_softmax(scores, mask=allowed)

    def _scores(self, seqs: slice, rows: slice) -> tuple[Tensor, Tensor]:
        """Scaled scores (S, H, R, M) in float32 or better, and where they may be attended."""
        dtype = torch.float64 if self.q.dtype == torch.float64 else torch.float32
        q, k = self.q[seqs, :, rows].to(dtype), self.k[seqs].to(dtype)
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.scale  # (S, H, R, M)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        n, m = self.q.shape[2], k.shape[2]
        i = torch.arange(n, device=q.device)[rows][:, None] + (m - n)  # the row's position among the keys
        j = torch.arange(m, device=q.device)
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
        if self.causal:
            allowed = allowed & (j <= i)
        if self.window is not None:  # FlashAttention's window_size=(w - 1, w - 1)
            allowed = allowed & ((i - j).abs() < self.window)
        allowed = allowed.expand_as(scores)
        if self.padding is not None:
            allowed = allowed & self.padding[seqs, None, None, :]
        if self.allowed is not None:
            allowed = allowed & _rows_of(self.allowed, seqs, rows)
        if self.bias is not None:
            scores = scores + _rows_of(self.bias, seqs, rows).to(dtype)
        return scores, allowed


def _cat_stats(parts: list, dim: int):
    """AttentionStats concatenated field by field along ``dim``."""
    if len(parts) == 1:
        return parts[0]
    fields = {f.name: [getattr(p, f.name) for p in parts] for f in dataclasses.fields(parts[0])}
    return type(parts[0])(**{name: None if values[0] is None else torch.cat(values, dim=dim)
                             for name, values in fields.items()})


def _rows_of(mask: Tensor, seqs: slice, rows: slice) -> Tensor:
    """A (B|1, H|1, N, M) tensor cut to some sequences and rows (broadcast dims kept)."""
    mask = mask if mask.shape[0] == 1 else mask[seqs]
    return mask[:, :, rows]


def _split_mask(mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """A 4-D attention mask as (allowed bool, additive bias or None)."""
    if mask.dtype == torch.bool:
        return mask, None
    blocked = mask <= torch.finfo(mask.dtype).min / 2  # eager masks use finfo.min; -inf too
    bias = mask.masked_fill(blocked, 0.0)
    return ~blocked, (None if not bool(bias.any()) else bias)


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None or b is None:
        return a if b is None else b
    return a + b
