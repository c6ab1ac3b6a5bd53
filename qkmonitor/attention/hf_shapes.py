"""Recognising Hugging Face attention modules by their structure: the LLaMA family's
``q_proj``/``k_proj`` and head counts, GPT-2's ``c_attn`` ``Conv1D`` and its scale, BERT's
``query``/``key``."""

from __future__ import annotations

from torch import Tensor, nn

from qkmonitor.validation import is_int


def _int_attr(*candidates) -> int | None:
    """The first positive int among ``(object, attribute)`` pairs."""
    for obj, attr in candidates:
        value = getattr(obj, attr, None)
        if is_int(value, 1):
            return value
    return None


def llama_shape(module: nn.Module) -> tuple[int, int, int] | None:
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


def is_gpt2(module: nn.Module) -> bool:
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


def gpt2_scale(module: nn.Module) -> float:
    scale = 1.0
    if getattr(module, "scale_attn_weights", True):
        scale = (module.embed_dim // module.num_heads) ** -0.5
    if getattr(module, "scale_attn_by_inverse_layer_idx", False):
        scale /= float((module.layer_idx or 0) + 1)
    return scale


def is_bert(module: nn.Module) -> bool:
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
