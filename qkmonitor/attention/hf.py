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

This module recognises the modules (:func:`adapt_hf_module`, the family's registration); their
shapes are read in :mod:`.hf_shapes`, the layers are :mod:`.hf_layers`, and the routing of their
calls through the registered attention function is :mod:`.hf_dispatch`.
"""

from __future__ import annotations

import sys

from torch import nn

from qkmonitor.attention import _hf_compat
from qkmonitor.attention.compiled import own_class
from qkmonitor.attention.hf_layers import (
    BertAttentionLayer,
    GPT2AttentionLayer,
    HFAttentionLayer,
    HFLatentAttentionLayer,
    HFLayoutAttentionLayer,
    LlamaAttentionLayer,
)
from qkmonitor.attention.hf_shapes import is_bert, is_gpt2, llama_shape
from qkmonitor.attention.latent import find_latent
from qkmonitor.attention.layout_names import infer_layouts
from qkmonitor.attention.recognition import forward_computes_attention
from qkmonitor.attention.registry import register_family

__all__ = ["adapt_hf_module"]


def adapt_hf_module(name: str, module: nn.Module, index: int) -> HFAttentionLayer | None:
    """The adapter for a ``transformers`` attention module of a supported shape, else None.

    A LLaMA- or BERT-shaped module whose forward computes its attention itself instead of
    dispatching (BART, CLIP, OPT, GPT-J, Whisper, BERT, ViT before their release dispatched) is
    left to the generic family, which intercepts that computation."""
    computes_itself = _computes_itself(module)
    if llama_shape(module) is not None and not computes_itself:
        return LlamaAttentionLayer(name, module, index)
    latent = find_latent(module)
    if latent is not None and _hf_compat.dispatches(module):
        return HFLatentAttentionLayer(name, module, index, latent)
    if is_gpt2(module):
        return GPT2AttentionLayer(name, module, index)
    if is_bert(module) and not computes_itself:
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
