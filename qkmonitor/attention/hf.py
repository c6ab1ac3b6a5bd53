"""Hugging Face ``transformers`` attention modules as qkmonitor attention layers (the ``hf`` extra).

Three families are recognised by structure, not by class name:

- **LLaMA-family** (``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention``, ...): ``q_proj``
  and ``k_proj`` ``nn.Linear`` with the head counts on the module or its ``config``
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
(older releases differ: :mod:`qkmonitor.attention._hf_compat` says how, from 4.48 on) and call it
with ``(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)``
— queries and keys after RoPE and the cache, the model's own mask. While a layer is probed its
module alone sees a shallow copy of the model config whose ``_attn_implementation`` names
``"qkmonitor_probe"``, a function registered through ``transformers.AttentionInterface`` that
measures the call on the side, under ``no_grad``, then hands the same arguments to the
implementation the model was using and returns its result unchanged. The shared model config is
never written: ``transformers`` also builds the attention *mask* from
``config._attn_implementation`` (``masking_utils``), so renaming it model-wide would change the
masks the model computes with. The first open probe on a module installs that view (and a route
holding the probes' observers in the module's ``__dict__``); the last one closed puts the module's
own config object back and removes the route, so no state outlives the probes. GPT-2 with
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
import sys
import warnings
from collections.abc import Callable
from weakref import WeakKeyDictionary

import torch
from torch import Tensor, nn

from qkmonitor.attention import _hf_compat
from qkmonitor.attention.adapters import AttentionLayer
from qkmonitor.attention.calls import TENSOR_PARALLEL, MaskedCall, UnreadCall
from qkmonitor.attention.clip import ProjectionRows, QKRows, linear_rows
from qkmonitor.attention.compiled import own_class
from qkmonitor.attention.installs import set_attribute
from qkmonitor.attention.intercept import LayoutChecked
from qkmonitor.attention.latent import LatentLayout, find_latent
from qkmonitor.attention.layout_names import infer_layouts
from qkmonitor.attention.layouts import QKLayout
from qkmonitor.attention.probes import Probe
from qkmonitor.attention.recognition import forward_computes_attention
from qkmonitor.attention.registry import register_family
from qkmonitor.attention.route import Channel, Route, observed
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.measures.sharding import HeadPlacement, RowShard, SplitHeadsError, row_shard
from qkmonitor.validation import is_int, is_real

__all__ = [
    "PROBE_IMPLEMENTATION",
    "BertAttentionLayer",
    "GPT2AttentionLayer",
    "HFAttentionLayer",
    "HFLatentAttentionLayer",
    "HFLayoutAttentionLayer",
    "LlamaAttentionLayer",
    "adapt_hf_module",
]

#: The name the probe registers in ``transformers``' ``AttentionInterface``.
PROBE_IMPLEMENTATION = "qkmonitor_probe"
_ORIGINAL_KEY = "_qkmonitor_original_attn_implementation"

#: module -> how its query and key projections' weights were split by rows across ranks (tensor
#: parallelism: a ``RowShard`` each, or why the split cannot be read by head) in the last probed
#: forward that had them split: the weights as the forward computes with them (FSDP2 hands it
#: unsharded ones), shared by the layers each engine holds of one module
_FORWARD_SHARDS: WeakKeyDictionary = WeakKeyDictionary()


class _DispatchChannel(Channel):
    """A module's attention calls routed through qkmonitor's registered attention function:
    ``restore`` puts the module's own implementation back."""

    def __init__(
        self,
        restore: Callable[[], None],
        default_scale: Callable[[], float],
        placement: Callable[[int], HeadPlacement | str | None],
    ) -> None:
        super().__init__()
        self.restore = restore
        self.default_scale = default_scale
        self.placement = placement  # a call's query heads -> where they are among the layer's

    def uninstall(self) -> None:
        self.restore()


class HFAttentionLayer(AttentionLayer):
    """A ``transformers`` attention module; subclasses read its query/key weights.

    Its :attr:`kind` is ``transformers.`` and the module's class (``transformers.BartAttention``):
    the subclass says only how the weights are read, which several model families share.

    Tensor parallelism: where a forward computes with the query and key projections split by rows
    across ranks (``ColwiseParallel``, as a user's ``parallelize_module`` plan or transformers'
    ``tp_plan`` shard them), each call holds this rank's heads; a family whose heads are the rows
    of separate ``nn.Linear`` projections in order (:meth:`_whole_layout`) places them at their
    global index (the call's ``placement``) and reads this rank's rows (:meth:`qk_weights`,
    :meth:`qk_rows`, :attr:`head_placement`), as the generic family does; the others' calls are
    refused by name."""

    @property
    def kind(self) -> str:  # type: ignore[override]
        return f"transformers.{own_class(self.module).__name__}"

    def _default_scale(self) -> float:
        return self.qk_weights().scale

    def _whole_layout(self) -> QKLayout | None:
        """Every head's layout, where the heads are the rows of separate query and key
        ``nn.Linear`` projections in order (what tensor parallelism splits by whole heads)."""
        return None

    def _forward_shards(self) -> tuple[RowShard | str | None, ...]:
        """How the weights the forward computes with now are split by rows across ranks: the
        query and key projections' (:meth:`_whole_layout`), else any parameter's."""
        layout = self._whole_layout()
        if layout is None:
            split = (row_shard(p) for p in self.module.parameters())
            return (next((s for s in split if s is not None), None), None)
        return tuple(row_shard(w) for w in layout.sources(self.module))

    def _local_layout(self) -> QKLayout | str | None:
        """This rank's layout where the module's probed forwards computed with its heads split
        across ranks (its heads, its rows), why they cannot be read by head, or None: whole."""
        q, k = _FORWARD_SHARDS.get(self.module, (None, None))
        if q is None and k is None:
            return None
        layout = self._whole_layout()
        why = next((s for s in (q, k) if isinstance(s, str)), None)
        if why is None and layout is None:
            why = f"{self.kind}'s projections are not read head by head under it"
        elif why is None and q is None:
            why = "its key projection is split by rows and its query projection is not"
        return why if why is not None else layout.localized(q, k)

    def _call_placement(self, heads: int) -> HeadPlacement | str | None:
        """Where a call's ``heads`` query heads are among the layer's, from the weights its
        forward computes with (None: all of them), or why the call is refused."""
        shards = self._forward_shards()
        if all(s is None for s in shards):
            _FORWARD_SHARDS.pop(self.module, None)
            return None
        _FORWARD_SHARDS[self.module] = shards
        local = self._local_layout()
        if isinstance(local, QKLayout) and local.num_heads != heads:
            local = f"its attention call holds {heads} heads where its rows hold {local.num_heads}"
        if isinstance(local, str):
            return (
                f"its projections are sharded by rows across ranks ({TENSOR_PARALLEL}), and "
                f"{local}; its attention statistics are not measured"
            )
        return local.shards.placement

    def _local(self) -> QKLayout | None:
        """:meth:`_local_layout`, a refusal raised (:class:`SplitHeadsError`)."""
        local = self._local_layout()
        if isinstance(local, str):
            raise SplitHeadsError(
                f"its projections are sharded by rows across ranks ({TENSOR_PARALLEL}), and {local}"
            )
        return local

    @property
    def head_placement(self) -> HeadPlacement | None:
        local = self._local_layout()
        return local.shards.placement if isinstance(local, QKLayout) else None

    @property
    def num_heads_hint(self) -> int:
        placement = self.head_placement  # every rank's heads
        return placement.total if placement is not None else super().num_heads_hint

    @property
    def supports_stats(self) -> bool:
        if not _hf_compat.dispatches(self.module):  # e.g. BERT before transformers 5.0
            _warn(self.name, _hf_compat.why_no_dispatch(self.module))
            return False
        if not hasattr(getattr(self.module, "config", None), "_attn_implementation"):
            _warn(
                self.name,
                f"transformers {_hf_compat.transformers_version()}: {type(self.module).__name__} "
                "has no `config._attn_implementation` to route its attention call by",
            )
            return False
        return True

    def install(self, probe: Probe) -> Callable[[], None]:
        def make() -> _DispatchChannel | None:
            restore = _route_module(self)
            # None: warned; the probe sees no call, and the monitor says so
            if restore is None:
                return None
            return _DispatchChannel(restore, self._default_scale, self._call_placement)

        attached = Route.attach(
            self.module, _DispatchChannel, probe.observe, probe.request.sink_tokens, make
        )
        return (lambda: None) if attached is None else attached[1]


class LlamaAttentionLayer(HFAttentionLayer):
    """LLaMA-family attention: ``q_proj``/``k_proj`` ``nn.Linear``, GQA from the config."""

    def _whole_layout(self) -> QKLayout:
        m = self.module
        heads, kv_heads, head_dim = _llama_shape(m)
        scale = m.scaling if is_real(getattr(m, "scaling", None)) else head_dim**-0.5
        qk_norm = isinstance(getattr(m, "q_norm", None), nn.Module) and isinstance(
            getattr(m, "k_norm", None), nn.Module
        )
        return QKLayout("q_proj", "k_proj", "", heads, kv_heads, head_dim, None, scale, qk_norm)

    def qk_weights(self) -> QKWeights:
        local = self._local()  # tensor parallelism: this rank's heads
        if local is not None:
            return local.qk_weights(self.module)
        m, layout = self.module, self._whole_layout()
        return QKWeights(
            m.q_proj.weight,
            m.k_proj.weight,
            layout.num_heads,
            layout.num_kv_heads,
            float(layout.logit_scale),
            qk_norm=layout.qk_norm,
        )

    def qk_rows(self) -> QKRows:
        local = self._local()
        if local is not None:
            return local.qk_rows(self.module)
        m, layout = self.module, self._whole_layout()
        return linear_rows(
            m.q_proj, m.k_proj, layout.num_heads, layout.num_kv_heads, layout.qk_norm
        )


class GPT2AttentionLayer(HFAttentionLayer):
    """GPT-2 attention: q, k, v packed in the ``c_attn`` ``Conv1D`` (weight ``(in, out)``)."""

    def qk_weights(self) -> QKWeights:
        m = self.module
        e, w = m.embed_dim, m.c_attn.weight  # Conv1D: (in_features, out_features)
        if getattr(m, "is_cross_attention", False):  # c_attn holds k, v; q_attn holds q
            w_q, w_k = m.q_attn.weight.T, w[:, :e].T
        else:
            w_q, w_k = w[:, :e].T, w[:, e : 2 * e].T
        return QKWeights(w_q, w_k, m.num_heads, m.num_heads, _gpt2_scale(m))

    def qk_rows(self) -> QKRows:
        m = self.module
        e, heads = m.embed_dim, m.num_heads
        w, b = m.c_attn.weight, m.c_attn.bias  # Conv1D: (in_features, out_features)
        if getattr(m, "is_cross_attention", False):
            q = (m.q_attn.weight.T, m.q_attn.bias)
            k = (w[:, :e].T, None if b is None else b[:e])
        else:
            q = (w[:, :e].T, None if b is None else b[:e])
            k = (w[:, e : 2 * e].T, None if b is None else b[e : 2 * e])
        rows = torch.arange(e).view(heads, e // heads)
        one_each = tuple(range(heads))
        return QKRows(ProjectionRows(*q, rows), ProjectionRows(*k, rows), one_each)


class BertAttentionLayer(HFAttentionLayer):
    """BERT-style attention: ``query``/``key`` ``nn.Linear``, ``attention_head_size``."""

    def _whole_layout(self) -> QKLayout:
        m = self.module
        heads, head_dim = m.num_attention_heads, m.attention_head_size
        scale = m.scaling if is_real(getattr(m, "scaling", None)) else head_dim**-0.5
        return QKLayout("query", "key", "", heads, heads, head_dim, None, float(scale))

    def qk_weights(self) -> QKWeights:
        local = self._local()  # tensor parallelism: this rank's heads
        if local is not None:
            return local.qk_weights(self.module)
        m, layout = self.module, self._whole_layout()
        heads = layout.num_heads
        return QKWeights(m.query.weight, m.key.weight, heads, heads, layout.logit_scale)

    def qk_rows(self) -> QKRows:
        local = self._local()
        if local is not None:
            return local.qk_rows(self.module)
        heads = self.module.num_attention_heads
        return linear_rows(self.module.query, self.module.key, heads, heads)


class HFLayoutAttentionLayer(LayoutChecked, HFAttentionLayer):
    """Any other ``transformers`` module that dispatches through the attention registry (GPT-NeoX,
    Phi-3, T5, ModernBERT, DistilBERT, GPT-BigCode, ...): statistics through the registry as
    above, W_Q/W_K read by name (:func:`qkmonitor.attention.layout_names.infer_layouts`) and checked
    against the first probed forward (:mod:`qkmonitor.attention.intercept`)."""

    def __init__(self, name: str, module: nn.Module, index: int, candidates: list) -> None:
        HFAttentionLayer.__init__(self, name, module, index)
        self.set_layouts(candidates)

    def _default_scale(self) -> float:
        scaling = getattr(self.module, "scaling", None)
        if is_real(scaling):
            return float(scaling)
        return (self.layout or self.layout_candidates[0]).logit_scale


class HFLatentAttentionLayer(HFAttentionLayer):
    """Multi-head latent attention (``DeepseekV3Attention``, and any module of its structure that
    dispatches through the registry): statistics from the call's own queries and keys (rotary and
    non-rotary parts concatenated, as the model hands them over), W_Q and W_K from the factored
    projections (:mod:`qkmonitor.attention.latent`)."""

    def __init__(self, name: str, module: nn.Module, index: int, layout: LatentLayout) -> None:
        super().__init__(name, module, index)
        self.layout = layout

    def _default_scale(self) -> float:
        return self.layout.logit_scale

    def qk_weights(self) -> QKWeights:
        return self.layout.qk_weights(self.module)

    def qk_rows(self) -> QKRows:
        return self.layout.qk_rows(self.module)


def adapt_hf_module(name: str, module: nn.Module, index: int) -> HFAttentionLayer | None:
    """The adapter for a ``transformers`` attention module of a supported shape, else None.

    A LLaMA- or BERT-shaped module whose forward computes its attention itself instead of
    dispatching (BART, CLIP, OPT, GPT-J, Whisper, BERT, ViT before their release dispatched) is
    left to the generic family, which intercepts that computation."""
    computes_itself = _computes_itself(module)
    if _llama_shape(module) is not None and not computes_itself:
        return LlamaAttentionLayer(name, module, index)
    latent = find_latent(module)
    if latent is not None and _hf_compat.dispatches(module):
        return HFLatentAttentionLayer(name, module, index, latent)
    if _is_gpt2(module):
        return GPT2AttentionLayer(name, module, index)
    if _is_bert(module) and not computes_itself:
        return BertAttentionLayer(name, module, index)
    if _hf_compat.dispatches(module):
        candidates = infer_layouts(module)
        if candidates:
            return HFLayoutAttentionLayer(name, module, index, candidates)
    return None


def _computes_itself(module: nn.Module) -> bool:
    """The module's own forward computes attention (SDPA or a softmax) and does not dispatch."""
    return bool(forward_computes_attention(own_class(module))) and not _hf_compat.dispatches(module)


def _adapt_if_imported(name: str, module: nn.Module, index: int) -> HFAttentionLayer | None:
    # a transformers module implies transformers imported: without it nothing here is looked for
    return (
        adapt_hf_module(name, module, index)
        if sys.modules.get("transformers") is not None
        else None
    )


register_family(
    "transformers",
    _adapt_if_imported,
    priority=30,
    looked_for=(
        "Hugging Face transformers attention (LLaMA-family `q_proj`/`k_proj`, GPT-2 `c_attn` "
        "Conv1D, BERT `query`/`key`, DeepSeek-V3's latent `kv_a_proj_with_mqa`/`kv_b_proj`, and "
        "any module dispatching through ALL_ATTENTION_FUNCTIONS with projections of a known "
        "name; needs the `hf` extra)"
    ),
)


# --- recognising the modules -------------------------------------------------------------------


def _int_attr(*candidates) -> int | None:
    """The first positive int among ``(object, attribute)`` pairs."""
    for obj, attr in candidates:
        value = getattr(obj, attr, None)
        if is_int(value, 1):
            return value
    return None


def _llama_shape(module: nn.Module) -> tuple[int, int, int] | None:
    """(num_heads, num_kv_heads, head_dim) of a q_proj/k_proj attention module, or None."""
    q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
    config = getattr(module, "config", None)
    if (
        not isinstance(q, nn.Linear)
        or not isinstance(k, nn.Linear)
        or not hasattr(config, "num_attention_heads")
    ):
        return None
    heads = _int_attr(
        (module, "num_heads"), (module, "num_attention_heads"), (config, "num_attention_heads")
    )
    if heads is None or q.out_features % heads:
        return None
    head_dim = _int_attr((module, "head_dim"), (config, "head_dim")) or q.out_features // heads
    kv_heads = _int_attr((module, "num_key_value_heads"), (config, "num_key_value_heads"))
    groups = _int_attr((module, "num_key_value_groups"))
    if kv_heads is None:
        kv_heads = heads // groups if groups else k.out_features // head_dim
    if (
        q.out_features != heads * head_dim
        or k.out_features != kv_heads * head_dim
        or heads % kv_heads
    ):
        return None
    return heads, kv_heads, head_dim


def _is_gpt2(module: nn.Module) -> bool:
    c_attn = getattr(module, "c_attn", None)
    e, heads = _int_attr((module, "embed_dim")), _int_attr((module, "num_heads"))
    weight = getattr(c_attn, "weight", None)
    if (
        e is None
        or heads is None
        or not isinstance(weight, Tensor)
        or weight.dim() != 2
        or e % heads
    ):
        return False
    cross = bool(getattr(module, "is_cross_attention", False))
    packed = 2 * e if cross else 3 * e
    # Conv1D keeps (in, out) and says so through `nf` (out); nn.Linear would be (out, in)
    return (
        getattr(c_attn, "nf", None) == packed
        and weight.shape[1] == packed
        and (
            not cross
            or isinstance(getattr(getattr(module, "q_attn", None), "weight", None), Tensor)
        )
    )


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
    return (
        isinstance(q, nn.Linear)
        and isinstance(k, nn.Linear)
        and heads is not None
        and head_dim is not None
        and q.out_features == heads * head_dim
        and k.out_features == heads * head_dim
    )


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
        _warn(
            layer.name,
            f"no `eager_attention_forward` next to {type(module).__name__} to hand the call to",
        )
        return None
    _register()
    probe_config = copy.copy(
        config
    )  # shallow: only this module's view of the implementation changes
    probe_config.__dict__["_attn_implementation_internal"] = PROBE_IMPLEMENTATION
    probe_config.__dict__[_ORIGINAL_KEY] = original
    if probe_config._attn_implementation != PROBE_IMPLEMENTATION:
        _warn(layer.name, "this transformers version keeps `config._attn_implementation` elsewhere")
        return None
    return set_attribute(module, "config", probe_config)  # a copy keeps the model's own config


def _route_gpt2_upcast(layer: HFAttentionLayer) -> Callable[[], None]:
    module = layer.module
    own = type(module)._upcast_and_reordered_attn.__get__(module)

    def upcast_and_reordered_attn(query, key, value, attention_mask=None, *args, **kwargs):
        mask, seen = _hf_compat.as_applied(
            module,
            query,
            key,
            attention_mask,
            {"scaling": getattr(module, "scaling", None)},
            "eager",
            eager=type(module)._upcast_and_reordered_attn,
        )
        _capture(module, query, key, mask, seen, original="eager")
        return own(query, key, value, attention_mask, *args, **kwargs)  # head_mask before 5.0

    return set_attribute(module, "_upcast_and_reordered_attn", upcast_and_reordered_attn)


def _probe_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *args, **kwargs
):
    """The registered attention function: measure on the side, then run the model's own."""
    original = getattr(module.config, _ORIGINAL_KEY, None)
    mask, seen = _hf_compat.as_applied(module, query, key, attention_mask, kwargs, original)
    _capture(module, query, key, mask, seen, original=original)
    attend = _hf_compat.attention_function(
        _dispatch_table(module), original, _eager_default(module)
    )
    return attend(module, query, key, value, attention_mask, *args, **kwargs)


def _capture(
    module: nn.Module, query: Tensor, key: Tensor, attention_mask, kwargs: dict, original
) -> None:
    channel = Route.channel(module, _DispatchChannel)
    if channel is None or not channel.observers:
        return
    scale = kwargs.get("scaling")

    def build() -> MaskedCall | UnreadCall:
        placement = channel.placement(query.shape[1])  # tensor parallelism: this rank's heads
        if isinstance(placement, str):
            return UnreadCall(placement, placement, sharded=True)
        call = MaskedCall.of(
            module,
            query,
            key,
            attention_mask,
            kwargs,
            original,
            scale=channel.default_scale() if scale is None else float(scale),
        )
        call.placement = placement
        return call

    channel.observers.notify(observed(build))


def _warn(name: str, why: str) -> None:
    warnings.warn(
        f"qkmonitor: no attention statistics for {name!r} ({why})", RuntimeWarning, stacklevel=2
    )
