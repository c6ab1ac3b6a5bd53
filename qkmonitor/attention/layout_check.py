"""The layout check: does a candidate layout reproduce what the module computed?

A layer read by name (:func:`qkmonitor.attention.layout_names.infer_layouts`) has candidate layouts,
not a layout. At its first probe the capture (:mod:`.capture`) keeps the inputs of the
projections' ``F.linear``/``addmm`` calls and the first attention call's queries and keys (or
logits) as a :class:`LayoutEvidence`; :func:`check_layout` predicts, in float64, the queries and
keys of each candidate at sequence position 0 (where RoPE is the identity), QK-norm applied where
the module has one, and compares them with what the module passed to SDPA (or, for a softmax, the
logit of query 0 on key 0, where ALiBi is zero too), up to one scale each. The candidate that
reproduces them is kept, with the key head each query head really scores against and the
effective logit scale; when none does, the layer's κ is NaN and a warning says what differed.

The logit scale is the factor between the projections' ``q·kᵀ`` and the logits the softmax gets,
wherever the module applies it: on q or k before the product (timm's ``q * scale``, or d^-1/4 on
both), which the fit of the call's queries and keys to the projections' gives, and on the product
after it (SDPA's ``scale``; for a softmax, what :func:`product_scale` measures between the
module's own ``q @ kᵀ`` and its logits, a position bias or mask the same over the batch allowed).
Where that factor cannot be told from what is seen (logits that are not a multiple of ``q·kᵀ``
plus such a bias: soft-capping, heads mixed before the softmax), the layout is kept with
``scale_unknown`` and ``qk_spectral_norm`` is NaN, named in a warning, rather than a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkmonitor.attention.calls import MASK_FLOOR
from qkmonitor.attention.layout_names import qk_norm_modules
from qkmonitor.attention.layouts import QKLayout, grouped_index, modulo_index
from qkmonitor.measures.sharding import RowShard


@dataclass
class LayoutEvidence:
    """What the first attention call of one forward shows about the layer's layout.

    Attributes:
        inputs: ``id(weight) -> input`` of the projections' calls in that forward.
        biases: ``id(weight) -> bias`` those calls added (not all add one).
        q, k: position-0 queries ``(B, H, D)`` and keys ``(B, H_kv, D)`` of an SDPA call.
        logits: ``(B, H)`` logits of query 0 on key 0 of a softmax call.
        scale: the factor the call puts on ``q·kᵀ``: an SDPA call's ``scale`` (None: its
            default ``1/sqrt(D)``), or for a softmax over ``q @ kᵀ`` (``q``, ``k`` its operands)
            the factor measured between that product and the logits (:func:`product_scale`).
        batch, queries, keys: B, N, M of the call.
        dtype: the dtype the module computed in.
        scale_unknown: why the factor on ``q·kᵀ`` cannot be told from the call (``scale`` is
            then not used); None where it can.
        shards: ``id(weight) -> RowShard`` of the projections whose weights the forward computed
            with split by rows across ranks (tensor parallelism): ``q`` and ``k`` hold this
            rank's heads.
    """

    inputs: dict[int, Tensor]
    biases: dict[int, Tensor]
    q: Tensor | None
    k: Tensor | None
    logits: Tensor | None
    scale: float | None
    batch: int
    queries: int
    keys: int
    dtype: torch.dtype
    scale_unknown: str | None = None
    shards: dict[int, RowShard] = field(default_factory=dict)


#: the first query rows of a softmax's logits compared with its ``q @ kᵀ`` (:func:`product_scale`)
_ROWS = 8


def _scale_tolerance(device: torch.device, *dtypes: torch.dtype) -> float:
    """Relative residual under which logits are taken for a multiple of ``q·kᵀ`` (plus a bias the
    same over the batch): rounding alone, of the least precise of ``dtypes`` (the operands' and
    the logits'), of a 16-bit autocast around the call, or of TF32 matmuls on CUDA; a bias that
    is not the same over the batch, or a nonlinearity (soft-capping), leaves more."""
    if any(dtype in (torch.float16, torch.bfloat16) for dtype in dtypes) or _autocast(device):
        return 1e-2
    if device.type == "cuda" and torch.float32 in dtypes:
        tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != (
            "highest"
        )
        if tf32:
            return 5e-3
    return 1e-4


def _autocast(device: torch.device) -> bool:
    """Whether an autocast is on for the device's type (the check runs inside the forward)."""
    try:
        return torch.is_autocast_enabled(device.type)
    except (TypeError, RuntimeError):  # an older torch, or a device type autocast does not know
        return torch.is_autocast_enabled()


def fit_scale(
    observed: Tensor, predicted: Tensor, valid: Tensor, tolerance: float
) -> tuple[float, str | None]:
    """The factor ``s`` with ``observed = s · predicted + bias`` over the ``valid`` entries, and
    None; or NaN and why it cannot be told. Dim 0 is the batch: the bias may be any per entry of
    the other dims (a relative position bias, ALiBi, a mask above the floor) if it is the same
    for every batch element (then the batch's variation alone tells ``s``); without one, every
    entry tells it. ``s`` must reproduce the entries to ``tolerance`` (relative residual)."""
    observed, predicted = observed.double(), predicted.double()
    c, residual = _fit(observed[valid], predicted[valid])
    if c > 0 and residual <= tolerance:
        return c, None
    why = f"the logits are {residual:.2g} (relative) away from a multiple of q·kᵀ"
    if observed.shape[0] > 1:
        common = valid.all(0)  # entries valid in every batch element
        if int(common.sum()) > 0:
            o, p = observed[:, common], predicted[:, common]
            c, residual = _fit(o - o.mean(0), p - p.mean(0))
            if c > 0 and residual <= tolerance:
                return c, None
            why += f", and {residual:.2g} away from one plus a bias the same for each batch element"
    return float("nan"), (
        f"{why} (tolerance {tolerance:g}): its logits are not scale · q·kᵀ (+ a position bias), "
        "so the scale cannot be told"
    )


def product_scale(
    q: Tensor, k: Tensor, logits: Tensor, blocked: Tensor | None
) -> tuple[float | None, str | None]:
    """The factor between a module's own ``q @ kᵀ`` (its operands ``q`` ``(B, H, N, D)``, ``k``
    ``(B, H_kv, M, D)``, broadcast as the matmul broadcast them) and the logits ``(B, H, N, M)``
    its softmax got (the scale applied after the product, 1 where none), from the first query
    rows in float64: ``(factor, None)``, or ``(None, why)`` where it cannot be told. Keys at or
    below the mask floor, and those ``blocked`` by a mask seen added, are left out."""
    rows = min(_ROWS, logits.shape[-2])
    product = q[..., :rows, :].double() @ k.double().transpose(-1, -2)
    observed = logits[..., :rows, :].double()
    if product.shape != observed.shape:
        return None, (
            f"its q @ kᵀ is {tuple(product.shape)} and its softmax's logits {tuple(observed.shape)}"
        )
    valid = torch.isfinite(observed) & (observed > MASK_FLOOR) & torch.isfinite(product)
    if blocked is not None:
        valid = valid & ~blocked[..., :rows, :].expand_as(valid)
    if int(valid.sum()) < 2:
        return None, "too few unmasked logits to compare with its q @ kᵀ"
    tolerance = _scale_tolerance(logits.device, q.dtype, k.dtype, logits.dtype)
    c, why = fit_scale(observed, product, valid, tolerance)
    return (None, why) if why is not None else (c, None)


def _snapped(scale: float, layout: QKLayout) -> float:
    """The layout's own scale (the module's ``scale`` attribute, else ``1/sqrt(d_k)``) where the
    measured factor is it up to rounding; else the measured factor."""
    return layout.logit_scale if abs(scale / layout.logit_scale - 1.0) < 1e-4 else scale


def _tolerance(dtype: torch.dtype) -> float:
    """Relative residual a right layout stays under (TF32 and half-precision matmuls included);
    a wrong one is of order 1."""
    return 1e-2 if dtype in (torch.float32, torch.float64) else 6e-2


def _position0(x: Tensor, batch: int, length: int) -> Tensor | None:
    """Row of sequence position 0 of each sequence from a projection input ``(B, N, d)`` or
    ``(B·N, d)``, or one whose leading dims hold B·N rows in that order (timm Twins' windows,
    ``(B, h, w, ws, ws, d)`` for a call of B·h·w windows of ws² tokens: read so, and checked)."""
    if x.dim() == 3 and x.shape[0] == batch and x.shape[1] == length:
        return x[:, 0]
    if x.dim() >= 2 and x.shape[:-1].numel() == batch * length:
        return x.reshape(batch, length, x.shape[-1])[:, 0]
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
    called = (evidence.biases.get(id(sources[0])), evidence.biases.get(id(sources[-1])))
    if any(bias is not None for bias in called):  # the biases the calls added, as they added them
        b_q, b_k = layout.split_biases(*called)
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
        why = (
            f"the weights read as {layout.describe()} give queries/keys {residual:.2g} (relative) "
            f"away from those the module computed (tolerance {tolerance:g})"
        )
        if evidence.q is not None and _directions_match(module, layout, evidence, tolerance):
            why += (
                ", but in the same directions: it normalizes each head's queries and keys in its "
                "forward (cosine attention, as Swinv2's, or an l2 QK-norm that is no module), "
                "which the weights alone do not give"
            )
        return why
    return layout


def _directions_match(
    module: nn.Module, layout: QKLayout, evidence: LayoutEvidence, tolerance: float
) -> bool:
    """Whether each position-0 query and key the layout predicts points where the call's does,
    once both are of unit length per head (what cosine attention computes)."""
    predicted = _predict(module, layout, evidence)
    if isinstance(predicted, str) or predicted[0].shape != evidence.q.shape:
        return False
    q, k = predicted
    if evidence.k.shape != k.shape:
        return False
    _, r_q = _fit(_unit(evidence.q.double()), _unit(q))
    _, r_k = _fit(_unit(evidence.k.double()), _unit(k))
    return max(r_q, r_k) <= tolerance


def _unit(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-300)


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
    if not (c_q > 0 and c_k > 0):  # a negative scale fits: the weights do not give these q, k
        return (
            f"the weights read as {layout.describe()} give queries/keys that the call's are not "
            f"a positive multiple of (relative residuals {r_q:.2g}, {r_k:.2g})"
        )
    if index is not None and index == grouped_index(layout.num_heads, layout.num_kv_heads):
        index = None
    if ev.scale_unknown is not None:
        return max(r_q, r_k), replace(layout, kv_index=index, scale_unknown=ev.scale_unknown)
    # the factor between the projections' q·kᵀ and the logits: what the module put on q and k
    # before the product (timm's q * scale, d^-1/4 on both), times what the call puts after it
    nominal = ev.scale if ev.scale is not None else layout.head_dim**-0.5
    scale = nominal if abs(c_q * c_k - 1.0) < 1e-4 else nominal * c_q * c_k
    return max(r_q, r_k), replace(layout, kv_index=index, scale=_snapped(scale, layout))


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
            best = (residual, replace(layout, kv_index=index), predicted)
    if isinstance(best, str):
        return best
    residual, layout, predicted = best
    # the layout fits; the scale is told only where the logits are that multiple of the
    # predicted q·k to rounding (or plus a bias of each head the same over the batch)
    scale, why = fit_scale(logits, predicted, valid, _scale_tolerance(logits.device, ev.dtype))
    if why is not None:
        return residual, replace(layout, scale_unknown=why)
    return residual, replace(layout, scale=_snapped(scale, layout))
