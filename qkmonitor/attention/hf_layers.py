"""The Hugging Face attention layers: the family's base (:class:`HFAttentionLayer`: the
routing of its calls, tensor parallelism's placement of its heads) and how each kind of module's
query/key weights are read (LLaMA family, GPT-2, BERT, by layout, latent)."""

from __future__ import annotations

from collections.abc import Callable
from weakref import WeakKeyDictionary

import torch
from torch import nn

from qkmonitor import private_apis
from qkmonitor.attention import _hf_compat
from qkmonitor.attention.adapters import AttentionLayer
from qkmonitor.attention.calls import TENSOR_PARALLEL
from qkmonitor.attention.clip import ProjectionRows, QKRows, linear_rows
from qkmonitor.attention.compiled import own_class
from qkmonitor.attention.hf_dispatch import DispatchChannel, route_module, warn_no_stats
from qkmonitor.attention.hf_shapes import gpt2_scale, llama_shape
from qkmonitor.attention.intercept import LayoutChecked
from qkmonitor.attention.latent import LatentLayout
from qkmonitor.attention.layouts import QKLayout
from qkmonitor.attention.probes import Probe
from qkmonitor.attention.route import Route
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.measures.sharding import HeadPlacement, RowShard, SplitHeadsError, row_shard
from qkmonitor.validation import is_real

__all__ = [
    "BertAttentionLayer",
    "GPT2AttentionLayer",
    "HFAttentionLayer",
    "HFLatentAttentionLayer",
    "HFLayoutAttentionLayer",
    "LlamaAttentionLayer",
]

#: module -> how its query and key projections' weights were split by rows across ranks (tensor
#: parallelism: a ``RowShard`` each, or why the split cannot be read by head) in the last probed
#: forward that had them split: the weights as the forward computes with them (FSDP2 hands it
#: unsharded ones), shared by the layers each engine holds of one module
_FORWARD_SHARDS: WeakKeyDictionary = WeakKeyDictionary()


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
            warn_no_stats(self.name, _hf_compat.why_no_dispatch(self.module))
            return False
        if not private_apis.has_attn_implementation(getattr(self.module, "config", None)):
            warn_no_stats(
                self.name,
                f"transformers {_hf_compat.transformers_version()}: {type(self.module).__name__} "
                "has no `config._attn_implementation` to route its attention call by",
            )
            return False
        return True

    def install(self, probe: Probe) -> Callable[[], None]:
        def make() -> DispatchChannel | None:
            restore = route_module(self.module, self.name)
            # None: warned; the probe sees no call, and the monitor says so
            if restore is None:
                return None
            return DispatchChannel(restore, self._default_scale, self._call_placement)

        attached = Route.attach(
            self.module, DispatchChannel, probe.observe, probe.request.sink_tokens, make
        )
        return (lambda: None) if attached is None else attached[1]


class LlamaAttentionLayer(HFAttentionLayer):
    """LLaMA-family attention: ``q_proj``/``k_proj`` ``nn.Linear``, GQA from the config."""

    def _whole_layout(self) -> QKLayout:
        m = self.module
        heads, kv_heads, head_dim = llama_shape(m)
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
        return QKWeights(w_q, w_k, m.num_heads, m.num_heads, gpt2_scale(m))

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
