r"""The optimizer's view of the query and key projections: what one update did to each head.

Per head h of a layer, over the one optimizer update before a spectrum read (the update that made
the step count a probe step), with :math:`W_Q^h` the head's query rows and :math:`W_K^g` the rows
of its key head (:class:`qkmonitor.clip.QKRows`):

.. math::

    \mathrm{q\_update\_ratio} = \frac{\lVert W_Q^h{}' - W_Q^h \rVert_F}{\lVert W_Q^h \rVert_F},
    \quad
    \mathrm{q\_grad\_norm} = \lVert \nabla_{W_Q^h} L \rVert_F

and the same for the keys (``k_update_ratio``, ``k_grad_norm``, of the key head g each query head
reads). The ratio of Frobenius norms of two equal-sized tensors is the ratio of their RMS values:
the update-to-weight RMS ratio that Wortsman et al. 2023 tie to attention-logit growth (a rate
too high, or AdamW's epsilon too large against the gradients' scale). Any optimizer: the weights
are compared before and after the update, nothing is read from the optimizer's state; the gradient
is the one the update was computed from (after any clipping that happens before the optimizer's
own step, as Lightning's, before it under ``on_before_optimizer_step``).

Only at the updates before a probe: the heads' rows are copied there (in the weights' dtype, W_Q
and W_K only), compared after, and the copy dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from qkmonitor.adapters import AttentionLayer
from qkmonitor.clip import ProjectionRows, QKRows

__all__ = ["UPDATE_METRICS", "UpdateSnapshot", "take_snapshot", "update_metrics"]

#: what :func:`update_metrics` gives, per layer one (H,) tensor each
UPDATE_METRICS = ("q_update_ratio", "k_update_ratio", "q_grad_norm", "k_grad_norm")


@dataclass
class _Projection:
    """One projection's heads before an update: its rows, their copy and their gradient norms."""

    rows: ProjectionRows
    before: Tensor  # (heads, d_k, in) copy
    grad_norm: Tensor  # (heads,) float64, NaN where the weight has no gradient


@dataclass
class UpdateSnapshot:
    """The heads of every readable layer before the update after ``step`` updates (``None`` for
    a layer whose rows cannot be read: :func:`take_snapshot` says why)."""

    step: int
    layers: list[tuple[_Projection, _Projection, tuple[int, ...]] | None]


def take_snapshot(layers: list[AttentionLayer], step: int) -> tuple[UpdateSnapshot, dict[str, str]]:
    """Copy every layer's query and key rows and read their gradient norms, before the update
    that follows ``step`` updates. Returns the snapshot and, by layer name, why a layer was left
    out (its family gives no rows, or its weights are sharded)."""
    snapped: list[tuple[_Projection, _Projection, tuple[int, ...]] | None] = []
    skipped: dict[str, str] = {}
    with torch.no_grad():
        for layer in layers:
            try:
                rows: QKRows = layer.qk_rows()
            except NotImplementedError as err:
                snapped.append(None)
                skipped[layer.name] = str(err)
                continue
            if _sharded(rows.q.weight) or _sharded(rows.k.weight):
                snapped.append(None)
                skipped[layer.name] = "its query/key weights are sharded (DTensor): not read yet"
                continue
            snapped.append((_projection(rows.q), _projection(rows.k), tuple(rows.kv_index)))
    return UpdateSnapshot(step, snapped), skipped


def update_metrics(snapshot: UpdateSnapshot, num_heads: list[int]) -> dict[str, list[Tensor]]:
    """``metric -> one (H,) float64 tensor per layer`` for the weights as they are now, against
    ``snapshot``; NaN for a layer it left out (``num_heads``: each layer's H, for its NaNs)."""
    out: dict[str, list[Tensor]] = {name: [] for name in UPDATE_METRICS}
    with torch.no_grad():
        for snapped, heads in zip(snapshot.layers, num_heads):
            if snapped is None:
                for name in UPDATE_METRICS:
                    out[name].append(torch.full((heads,), math.nan, dtype=torch.float64))
                continue
            q, k, kv_index = snapped
            per_key_head = list(kv_index)
            out["q_update_ratio"].append(_update_ratio(q))
            out["k_update_ratio"].append(_update_ratio(k)[per_key_head])
            out["q_grad_norm"].append(q.grad_norm)
            out["k_grad_norm"].append(k.grad_norm[per_key_head])
    return out


def _projection(rows: ProjectionRows) -> _Projection:
    heads, d_k = rows.rows.shape
    index = rows.rows.reshape(-1).to(rows.weight.device)
    before = rows.weight.detach()[index].reshape(heads, d_k, -1)  # indexing copies
    grad = gradient_of(rows.weight)
    grad_norm = (
        torch.full((heads,), math.nan, dtype=torch.float64)
        if grad is None
        else _head_norms(grad[index].reshape(heads, d_k, -1))
    )
    return _Projection(rows, before, grad_norm)


def _update_ratio(projection: _Projection) -> Tensor:
    """(heads,) ``||after - before|| / ||before||`` per head, in float64; NaN where the head's
    weight was 0."""
    heads, d_k, _ = projection.before.shape
    index = projection.rows.rows.reshape(-1).to(projection.rows.weight.device)
    after = projection.rows.weight.detach()[index].reshape(heads, d_k, -1)
    change = _head_norms(after.double() - projection.before.double())
    size = _head_norms(projection.before)
    return torch.where(size > 0, change / size, math.nan)


def _head_norms(x: Tensor) -> Tensor:
    """(heads, d_k, in) -> (heads,) Frobenius norms in float64, on the CPU."""
    return torch.linalg.vector_norm(x.double(), dim=(1, 2)).cpu()


def gradient_of(weight: Tensor) -> Tensor | None:
    """The gradient of ``weight``, a parameter or a view of one (a transposed ``Conv1D`` weight):
    the parameter's ``.grad`` seen through the same view; None without one (or where the gradient
    is laid out unlike its parameter)."""
    base = weight if weight._base is None else weight._base
    grad = base.grad
    if grad is None:
        return None
    if base is weight:
        return grad
    if grad.shape != base.shape or grad.stride() != base.stride():
        return None
    offset = weight.storage_offset() - base.storage_offset() + grad.storage_offset()
    return grad.as_strided(weight.shape, weight.stride(), offset)


def _sharded(weight: Tensor) -> bool:
    return type(weight).__name__ == "DTensor" or (
        weight._base is not None and type(weight._base).__name__ == "DTensor"
    )
