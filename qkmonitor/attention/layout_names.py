"""The names the field gives an attention module's projections, head counts, scale and QK-norm,
and :func:`infer_layouts`, every :class:`~qkmonitor.attention.layouts.QKLayout` a module's
projections allow by those names and shapes; the first probe keeps the one that reproduces the
queries and keys the module actually computed (see :mod:`qkmonitor.attention.intercept`)."""

from __future__ import annotations

from torch import nn

from qkmonitor.attention.layouts import QKLayout, out_features
from qkmonitor.validation import is_int, is_real

__all__ = ["infer_layouts", "qk_norm_modules"]

#: Separate query/key projections, by the names the field gives them.
SEPARATE_NAMES = (
    ("q_proj", "k_proj"),
    ("query", "key"),
    ("to_q", "to_k"),
    ("wq", "wk"),
    ("q", "k"),
    ("q_lin", "k_lin"),
    ("query_proj", "key_proj"),
    ("linear_q", "linear_k"),
    ("q", "kv"),  # a fused key/value projection, keys first (timm Twins' and PVT's `kv`)
)
#: One fused q/k/v projection.
FUSED_NAMES = (
    "qkv",
    "c_attn",
    "query_key_value",
    "Wqkv",
    "qkv_proj",
    "in_proj",
    "attn",
    "to_qkv",
    "wqkv",
    "qk",  # queries and keys alone, no values (timm ConViT's GPSA)
)
#: fused projections of queries and keys alone: rows ``[q | k]``
QK_ONLY_NAMES = ("qk",)
#: Head counts and sizes, on the module or its ``config``.
HEADS_NAMES = (
    "num_heads",
    "n_head",
    "n_heads",
    "heads",
    "num_attention_heads",
    "nhead",
    "n_heads_q",
)
KV_HEADS_NAMES = (
    "num_kv_heads",
    "n_kv_heads",
    "num_key_value_heads",
    "kv_heads",
    "n_query_groups",
    "n_kv_head",
    "num_kv",
)
HEAD_DIM_NAMES = (
    "head_dim",
    "head_size",
    "dim_head",
    "attention_head_size",
    "key_value_proj_dim",
    "d_head",
    "head_dim_qk",
)
SCALE_NAMES = ("scale", "scaling", "softmax_scale")
#: QK-norm modules (applied per head, or over the whole projection, after the projections).
QK_NORM_NAMES = (
    ("q_norm", "k_norm"),
    ("norm_q", "norm_k"),
    ("q_layernorm", "k_layernorm"),
    ("query_norm", "key_norm"),
    ("q_ln", "k_ln"),
)


def positive_int(value) -> int | None:
    return value if is_int(value, 1) else None


def attribute(module: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first positive int among ``names`` on the module, then on its ``config``."""
    for owner in (module, getattr(module, "config", None)):
        for name in names:
            value = positive_int(getattr(owner, name, None))
            if value is not None:
                return value
    return None


def _scale(module: nn.Module) -> float | None:
    for name in SCALE_NAMES:
        value = getattr(module, name, None)
        if is_real(value) and value > 0:
            return float(value)
    return None


def qk_norm_modules(module: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The module's QK-norm pair (``q_norm``/``k_norm`` and the like), or None."""
    for q_name, k_name in QK_NORM_NAMES:
        q, k = getattr(module, q_name, None), getattr(module, k_name, None)
        if isinstance(q, nn.Module) and isinstance(k, nn.Module) and not isinstance(q, nn.Identity):
            return q, k
    return None


def projections_of(module: nn.Module) -> tuple[str, str | None] | None:
    """``(q, k)`` paths of separate projections, ``(qkv, None)`` of a fused one, or None."""
    for q, k in SEPARATE_NAMES:
        if out_features(module, q) is not None and out_features(module, k) is not None:
            return q, k
    for name in FUSED_NAMES:
        if out_features(module, name) is not None:
            return name, None
    return None


def infer_layouts(
    module: nn.Module,
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    paths: tuple[str, str | None] | None = None,
    fused: str | None = None,
    kv_index: tuple[int, ...] | None = None,
    scale: float | None = None,
) -> list[QKLayout]:
    """Every layout of ``module`` that its projections' shapes and attributes allow.

    Counts given as arguments win over the module's attributes (``num_heads``, ``n_head``,
    ``num_key_value_heads``, ``n_query_groups``, ``head_dim``, ... on the module or its
    ``config``); what neither says is solved from the shapes where that is unambiguous.

    Returns:
        The candidate layouts, most likely first; empty when the module has no recognised
        projections or the counts do not fit them.
    """
    paths = paths or projections_of(module)
    if paths is None:
        return []
    q_path, k_path = paths
    heads = heads or attribute(module, HEADS_NAMES)
    if heads is None:
        return []
    q_out = out_features(module, q_path)
    if q_out is None:
        return []
    if k_path is not None:
        head_dim = (
            head_dim
            or attribute(module, HEAD_DIM_NAMES)
            or (q_out // heads if q_out % heads == 0 else None)
        )
    else:
        head_dim = head_dim or attribute(module, HEAD_DIM_NAMES)
    kv_heads = kv_heads or _stated_kv_heads(module, heads)
    if k_path is not None:
        kv_heads = _separate_kv_heads(module, k_path, q_out, heads, kv_heads, head_dim)
        candidates = [] if kv_heads is None else [("blocks", kv_heads, head_dim)]
    else:
        values = q_path.rsplit(".", 1)[-1] not in QK_ONLY_NAMES
        candidates = _fused_candidates(q_out, heads, kv_heads, head_dim, fused, values)
    if not candidates:
        return []
    norm = qk_norm_modules(module) is not None
    scale = scale if scale is not None else _scale(module)
    return [
        QKLayout(q_path, k_path, order, heads, kv, d, kv_index, scale, norm)
        for order, kv, d in candidates
    ]


def _stated_kv_heads(module: nn.Module, heads: int) -> int | None:
    """The key/value heads the module's attributes state: a count, ``multi_query``, or the
    query heads per group."""
    kv_heads = attribute(module, KV_HEADS_NAMES)
    if kv_heads is None and getattr(module, "multi_query", False) is True:
        kv_heads = 1
    if kv_heads is None:
        groups = attribute(module, ("num_key_value_groups",))
        kv_heads = heads // groups if groups and heads % groups == 0 else None
    return kv_heads


def _separate_kv_heads(
    module: nn.Module,
    k_path: str,
    q_out: int,
    heads: int,
    kv_heads: int | None,
    head_dim: int | None,
) -> int | None:
    """The key heads of separate projections (solved from the key projection's width where
    unstated), or None where the counts do not fit the shapes."""
    k_out = out_features(module, k_path)
    if k_path.rsplit(".", 1)[-1] == "kv":  # [k | v]: the keys are its first half
        k_out //= 2
    if head_dim is None or q_out < heads * head_dim:
        return None
    kv_heads = kv_heads or (k_out // head_dim if k_out % head_dim == 0 else None)
    if kv_heads is None or heads % kv_heads or k_out < kv_heads * head_dim:
        return None
    return kv_heads


def _fused_candidates(
    q_out: int,
    heads: int,
    kv_heads: int | None,
    head_dim: int | None,
    fused: str | None,
    values: bool = True,
) -> list[tuple[str, int, int]]:
    """``(order, kv_heads, head_dim)`` of every reading of a fused projection of ``q_out`` rows:
    ambiguous key/value head counts and row orders as separate candidates. ``values=False``: it
    holds queries and keys alone (``[q | k]``, by its name)."""
    if head_dim is None:  # q, k, v of one width: (H + 2 H_kv) d_k rows; or q and k alone
        widths = [heads + 2 * (kv_heads or heads)] if values else []
        widths.append(heads + (kv_heads or heads))
        head_dim = next((q_out // width for width in widths if q_out % width == 0), None)
    if head_dim is None:
        return []
    rest = q_out // head_dim - heads if q_out % head_dim == 0 else 0
    if not values:  # [q | k]: the rest are the keys
        kv = kv_heads or rest
        return [("blocks", kv, head_dim)] if kv > 0 and heads % kv == 0 and rest >= kv else []
    if kv_heads is None:  # (H + 2 H_kv) d_k rows hold q, k, v; 2 H d_k may also be q and k alone
        kv_options = [rest // 2] if rest > 0 and rest % 2 == 0 else []
        kv_options += [heads] if rest == heads and heads not in kv_options else []
    else:
        kv_options = [kv_heads]
    kv_options = [
        kv for kv in kv_options if kv > 0 and heads % kv == 0 and q_out >= (heads + kv) * head_dim
    ]
    candidates = []
    for kv in kv_options:
        orders = (
            (fused,) if fused else (("blocks", "heads") if kv == heads else ("blocks", "groups"))
        )
        candidates += [(order, kv, head_dim) for order in orders]
    return candidates
