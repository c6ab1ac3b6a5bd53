"""Placing a Hugging Face model's query and key projections by tensor names and its config,
without importing the model's code.

Each attention layer becomes a :class:`LayerPlan`: the tensors it reads and how they make the
layer's :class:`~qkmonitor.attention.adapters.QKWeights` (``nn.Linear`` layout, heads, key groups,
logit scale). The families:

- separate projections: ``q_proj``/``k_proj`` (LLaMA, Mistral, Qwen, Gemma, Phi, OPT, ...),
  ``query``/``key`` (BERT, RoBERTa, ViT), ``q``/``k`` (T5: no logit scale), ``wq``/``wk``;
- fused q/k/v, in the order of the family: ``query_key_value`` per head (GPT-NeoX, BLOOM; Falcon by
  its config), ``qkv_proj``/``Wqkv``/``W_pack`` in blocks (Phi-3, MPT, Baichuan), GPT-2's
  ``c_attn`` (Conv1D, stored ``(in, out)``) in blocks;
- latent attention (DeepSeek-V2/V3, Kimi K2): ``q_proj`` or ``q_a_proj``/``q_a_layernorm``/
  ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, read as
  :class:`~qkmonitor.attention.latent.LatentLayout` reads the live module (the same products).

Head counts come from the config (``num_attention_heads`` and its other names, or its
``text_config``); the key heads and head width from the shapes, checked against it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from torch import Tensor

from qkmonitor.attention.latent import HF_NAMES, LatentLayout
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.scanning.files import ModelFiles, ScanError, TensorSource

__all__ = ["LayerPlan", "plan_layers"]

_SEPARATE = (("q_proj", "k_proj"), ("query", "key"), ("q", "k"), ("wq", "wk"))
#: fused q/k/v projections -> row order: per head [q k v], or blocks [Q; K; V]
_FUSED = {"query_key_value": "heads", "qkv_proj": "blocks", "Wqkv": "blocks", "W_pack": "blocks"}
_LATENT = "kv_a_proj_with_mqa"
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "kv_n_heads")
_NO_SCALE = ("t5", "mt5", "umt5", "longt5")


@dataclass(frozen=True)
class LayerPlan:
    """One attention layer of a saved model.

    Attributes:
        name: the attention module's path in the model (``model.layers.0.self_attn``).
        tensors: the names of the tensors it reads.
        num_heads: its query heads.
        read: builds its :class:`QKWeights` from the model's tensors (reads only ``tensors``).
    """

    name: str
    tensors: tuple[str, ...]
    num_heads: int
    read: Callable[[TensorSource], QKWeights]


def plan_layers(model: ModelFiles) -> list[LayerPlan]:
    """Every attention layer of a Hugging Face model, in the model's layer order.

    Raises:
        ScanError: no attention in the tensors, or projections that cannot be placed.
    """
    names = set(model.tensors.names())
    config = model.config
    plans = _latent_layers(model, names) or _separate_layers(model, names)
    plans = plans or _fused_layers(model, names)
    if not plans:
        raise ScanError(model.path, _unplaced_message(names, config))
    return sorted(plans, key=lambda plan: _natural_key(plan.name))


def _unplaced_message(names: set[str], config: dict) -> str:
    attention = sorted(n for n in names if re.search(r"att|\.q\b|query|qkv", n, re.IGNORECASE))
    looked = (
        "query/key projections named q_proj/k_proj, query/key, q/k or wq/wk, a fused "
        "query_key_value, qkv_proj, Wqkv, W_pack or c_attn (GPT-2), or latent attention's "
        "kv_a_proj_with_mqa/kv_b_proj"
    )
    if not attention:
        return f"no attention found (model_type {config.get('model_type')!r}); looked for {looked}"
    shown = ", ".join(attention[:4]) + (", ..." if len(attention) > 4 else "")
    return (
        f"cannot place the query/key projections of model_type {config.get('model_type')!r} "
        f"(tensors such as {shown}); looked for {looked}. Load the model in Python and describe "
        "its attention with qkmonitor.AttentionSpec, or scan a Lightning checkpoint with "
        "--model package.module:Class"
    )


# -- config ---------------------------------------------------------------------------------------


def _config_int(config: dict, keys: tuple[str, ...]) -> int | None:
    for owner in (config, config.get("text_config") or {}):
        for key in keys:
            value = owner.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _heads(model: ModelFiles) -> int:
    heads = _config_int(model.config, _HEADS)
    if heads is None:
        raise ScanError(
            model.path, f"config.json names no head count (looked for {', '.join(_HEADS)})"
        )
    return heads


def _scale(config: dict, head_dim: int, layer: int) -> float:
    """The factor on ``q·k`` that the family's attention applies."""
    kind = config.get("model_type", "")
    if kind in _NO_SCALE:
        return 1.0
    if isinstance(config.get("attention_multiplier"), (int, float)):  # Granite
        return float(config["attention_multiplier"])
    if isinstance(config.get("query_pre_attn_scalar"), (int, float)):  # Gemma 2/3
        return float(config["query_pre_attn_scalar"]) ** -0.5
    scale = head_dim**-0.5
    if kind == "gpt2":
        scale = scale if config.get("scale_attn_weights", True) else 1.0
        if config.get("scale_attn_by_inverse_layer_idx", False):
            scale /= layer + 1
    return scale


def _layer_index(prefix: str) -> int:
    numbers = re.findall(r"\.(\d+)(?:\.|$)", prefix)
    return int(numbers[-1]) if numbers else 0


def _natural_key(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _qk_norm(names: set[str], prefix: str) -> bool:
    return any(f"{prefix}.{n}.weight" in names for n in ("q_norm", "q_layernorm", "query_norm"))


def _split(model: ModelFiles, prefix: str, q_rows: int, k_rows: int) -> tuple[int, int, int]:
    """(heads, key heads, head width) of a layer from its rows and the config's head count."""
    heads = _heads(model)
    if q_rows % heads:
        raise ScanError(
            model.path, f"{prefix}: {q_rows} query rows do not split into {heads} heads"
        )
    head_dim = q_rows // heads
    if k_rows % head_dim or heads % (k_rows // head_dim or 1) or not k_rows:
        raise ScanError(
            model.path,
            f"{prefix}: {k_rows} key rows do not split into heads of {head_dim} that divide "
            f"{heads} query heads",
        )
    return heads, k_rows // head_dim, head_dim


# -- separate projections -------------------------------------------------------------------------


def _separate_layers(model: ModelFiles, names: set[str]) -> list[LayerPlan]:
    plans = []
    for q_name, k_name in _SEPARATE:
        suffix = f".{q_name}.weight"
        for name in names:
            if not name.endswith(suffix) or ".crossattention." in name:
                continue
            prefix = name[: -len(suffix)]
            key = f"{prefix}.{k_name}.weight"
            if key in names:
                plans.append(_separate_plan(model, names, prefix, name, key))
        if plans:
            return plans
    return plans


def _separate_plan(model: ModelFiles, names: set[str], prefix: str, q: str, k: str) -> LayerPlan:
    q_shape, k_shape = model.tensors.shape(q), model.tensors.shape(k)
    heads, kv_heads, head_dim = _split(model, prefix, q_shape[0], k_shape[0])
    scale = _scale(model.config, head_dim, _layer_index(prefix))
    qk_norm = _qk_norm(names, prefix)

    def read(source: TensorSource) -> QKWeights:
        return QKWeights(source.get(q), source.get(k), heads, kv_heads, scale, qk_norm)

    return LayerPlan(prefix, (q, k), heads, read)


# -- fused projections ----------------------------------------------------------------------------


def _fused_layers(model: ModelFiles, names: set[str]) -> list[LayerPlan]:
    plans = []
    for name in sorted(names):
        prefix, _, leaf = name.removesuffix(".weight").rpartition(".")
        if not name.endswith(".weight"):
            continue
        if leaf == "c_attn" and model.config.get("model_type") == "gpt2":
            plans.append(_fused_plan(model, names, prefix, name, "blocks", transposed=True))
        elif leaf in _FUSED:
            plans.append(_fused_plan(model, names, prefix, name, _order(model, leaf)))
    return plans


def _order(model: ModelFiles, leaf: str) -> str:
    config = model.config
    if leaf == "query_key_value" and config.get("model_type") == "falcon":
        if config.get("new_decoder_architecture"):
            return "groups"
        return "blocks" if config.get("multi_query", True) else "heads"
    return _FUSED[leaf]


def _fused_counts(model: ModelFiles, prefix: str, rows: int, order: str) -> tuple[int, int, int]:
    heads = _heads(model)
    kv_heads = _config_int(model.config, _KV_HEADS) or heads
    if model.config.get("model_type") == "falcon" and order == "blocks":
        kv_heads = 1  # multi-query Falcon: one key head
    if order == "heads":
        kv_heads = heads
    if rows % (heads + 2 * kv_heads) or heads % kv_heads:
        raise ScanError(
            model.path,
            f"{prefix}: {rows} fused q/k/v rows do not split into {heads} query and {kv_heads} "
            "key/value heads",
        )
    return heads, kv_heads, rows // (heads + 2 * kv_heads)


def _fused_plan(
    model: ModelFiles,
    names: set[str],
    prefix: str,
    name: str,
    order: str,
    transposed: bool = False,
) -> LayerPlan:
    shape = model.tensors.shape(name)
    rows = shape[1] if transposed else shape[0]
    heads, kv_heads, head_dim = _fused_counts(model, prefix, rows, order)
    scale = _scale(model.config, head_dim, _layer_index(prefix))
    qk_norm = _qk_norm(names, prefix)

    def read(source: TensorSource) -> QKWeights:
        weight = source.get(name)
        weight = weight.mT if transposed else weight
        w_q, w_k = _fused_qk(weight, order, heads, kv_heads, head_dim)
        return QKWeights(w_q, w_k, heads, kv_heads, scale, qk_norm)

    return LayerPlan(prefix, (name,), heads, read)


def _fused_qk(
    weight: Tensor, order: str, heads: int, kv_heads: int, head_dim: int
) -> tuple[Tensor, Tensor]:
    """(W_Q, W_K) rows of a fused q/k/v weight ``(rows, d)``."""
    d = weight.shape[-1]
    if order == "heads":  # per head [q | k | v] (GPT-NeoX's view(..., H, 3 d_k))
        per_head = weight.reshape(heads, 3, head_dim, d)
        return per_head[:, 0].reshape(-1, d), per_head[:, 1].reshape(-1, d)
    if order == "groups":  # per key group [its queries | k | v] (Falcon's new architecture)
        groups = weight.reshape(kv_heads, heads // kv_heads + 2, head_dim, d)
        return groups[:, :-2].reshape(-1, d), groups[:, -2].reshape(-1, d)
    q_rows, k_rows = heads * head_dim, kv_heads * head_dim
    return weight[:q_rows], weight[q_rows : q_rows + k_rows]


# -- latent attention ------------------------------------------------------------------------------


def _latent_layers(model: ModelFiles, names: set[str]) -> list[LayerPlan]:
    suffix = f".{_LATENT}.weight"
    return [
        _latent_plan(model, names, name[: -len(suffix)]) for name in names if name.endswith(suffix)
    ]


def _latent_plan(model: ModelFiles, names: set[str], prefix: str) -> LayerPlan:
    config = model.config
    sizes = {
        key: _config_int(config, (key,))
        for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    }
    missing = [key for key, value in sizes.items() if value is None]
    if missing:
        raise ScanError(
            model.path, f"{prefix}: latent attention without {', '.join(missing)} in config.json"
        )
    parts = {
        part: f"{prefix}.{part}.weight"
        for part in (
            "q_proj",
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            _LATENT,
            "kv_a_layernorm",
            "kv_b_proj",
        )
        if f"{prefix}.{part}.weight" in names
    }
    heads = _heads(model)
    head_dim = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]
    layout = LatentLayout(
        HF_NAMES,
        heads,
        sizes["qk_nope_head_dim"],
        sizes["qk_rope_head_dim"],
        sizes["v_head_dim"],
        sizes["kv_lora_rank"],
        _latent_scale(config, head_dim),
        qk_norm=False,
    )

    def read(source: TensorSource) -> QKWeights:
        module = SimpleNamespace(
            **{part: SimpleNamespace(weight=source.get(name)) for part, name in parts.items()}
        )
        names_read = HF_NAMES.with_query(module)
        if names_read is None:
            raise ScanError(model.path, f"{prefix}: latent attention without its query projection")
        return replace(layout, names=names_read).qk_weights(module)

    return LayerPlan(prefix, tuple(parts.values()), heads, read)


def _latent_scale(config: dict, head_dim: int) -> float:
    """DeepSeek's softmax scale: ``1/sqrt(d_n + d_r)``, times ``mscale²`` under YaRN with
    ``mscale_all_dim`` (as ``transformers``' ``yarn_apply_mscale``)."""
    scale = head_dim**-0.5
    rope: Any = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
        mscale_all_dim = rope.get("mscale_all_dim", 0)
        factor = rope.get("factor", 1.0)
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale
