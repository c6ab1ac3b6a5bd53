r"""The optimizer's view of the query and key projections: what one update did to each head.

Per head h of a layer, over the one optimizer update before a spectrum read (the update that made
the step count a probe step), with :math:`W_Q^h` the head's query rows and :math:`W_K^g` the rows
of its key head (:class:`qkmonitor.attention.clip.QKRows`):

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

from qkmonitor import private_apis
from qkmonitor.attention.adapters import AttentionLayer
from qkmonitor.attention.clip import ProjectionRows, QKRows
from qkmonitor.attention.intercept import LayoutUnknownError
from qkmonitor.measures.sharding import SplitHeadsError, is_dtensor, local_whole, partitioned
from qkmonitor.measures.update_spectra import UPDATE_SPECTRUM_METRICS

__all__ = ["ROW_METRICS", "UPDATE_METRICS", "UpdateSnapshot", "take_snapshot", "update_metrics"]

#: what :func:`update_metrics` gives, per layer one (H,) tensor each
ROW_METRICS = ("q_update_ratio", "k_update_ratio", "q_grad_norm", "k_grad_norm")
#: every metric of the update before a read: the rows' and the spectrum of the update to each
#: head's query-key form (:mod:`qkmonitor.measures.update_spectra`)
UPDATE_METRICS = ROW_METRICS + UPDATE_SPECTRUM_METRICS


@dataclass
class _Group:
    """Projections whose heads' rows have one shape, dtype and device, copied side by side."""

    members: list[int]  # indices into the snapshot's projections
    before: Tensor  # (members, heads, d_k, in): their rows before the update
    size: Tensor  # (members, heads) float64: the norms of those rows


@dataclass
class UpdateSnapshot:
    """The heads of every readable layer before the update after ``step`` updates.

    ``projections`` holds each readable layer's query and key rows in turn; ``layers`` maps a
    layer to the index of its query projection and its key head per query head (``None`` for a
    layer whose rows cannot be read: :func:`take_snapshot` says why)."""

    step: int
    projections: list[ProjectionRows]
    grad_norms: list[Tensor]  # (heads,) float64 per projection, NaN without a gradient
    groups: list[_Group]
    layers: list[tuple[int, tuple[int, ...]] | None]


def _local_if_whole(projection: ProjectionRows) -> ProjectionRows:
    """``projection`` read through its DTensor weight's local shard where that shard is the whole
    weight (:func:`~qkmonitor.measures.sharding.local_whole`: a tensor-parallel mesh of one rank),
    its gradient likewise; else as it is."""
    weight = None if projection.gradient is not None else local_whole(projection.weight)
    if weight is None:  # a plain weight, a rank's rows already local, or part of a DTensor
        return projection
    parameter, bias = projection.weight, projection.bias
    if is_dtensor(bias):
        bias = local_whole(bias)
        if bias is None:
            return projection
    return ProjectionRows(
        weight,
        bias,
        projection.rows,
        gradient=lambda: None if parameter.grad is None else local_whole(parameter.grad),
    )


def take_snapshot(
    layers: list[AttentionLayer], step: int
) -> tuple[UpdateSnapshot, dict[str, tuple[str, bool]]]:
    """Copy every layer's query and key rows and read their gradient norms, before the update
    that follows ``step`` updates (the rows of every projection of one shape in one copy).
    Returns the snapshot and, by layer name, why a layer was left out and whether for the whole
    run (its family gives no rows, its layout failed its check, its weights are sharded) or for
    this read only (reading its rows raised)."""
    projections: list[ProjectionRows] = []
    mapped: list[tuple[int, tuple[int, ...]] | None] = []
    skipped: dict[str, tuple[str, bool]] = {}
    for layer in layers:
        try:
            rows: QKRows = layer.qk_rows()
        except (NotImplementedError, LayoutUnknownError, SplitHeadsError) as err:  # whole run
            mapped.append(None)
            skipped[layer.name] = (str(err), True)
            continue
        except Exception as err:  # noqa: BLE001 -- a metric problem: this read only
            mapped.append(None)
            skipped[layer.name] = (f"{type(err).__name__}: {err}", False)
            continue
        held = partitioned(rows.q.weight) or partitioned(rows.k.weight)
        rows = QKRows(_local_if_whole(rows.q), _local_if_whole(rows.k), rows.kv_index, rows.qk_norm)
        if held is not None or is_dtensor(rows.q.weight) or is_dtensor(rows.k.weight):
            mapped.append(None)
            skipped[layer.name] = (
                held or "its query/key weights are sharded (DTensor): not read yet",
                True,
            )
            continue
        mapped.append((len(projections), tuple(rows.kv_index)))
        projections += [rows.q, rows.k]
    with torch.no_grad():
        views = [_head_rows(p.weight.detach(), p.rows) for p in projections]
        grads = [gradient_of(p.weight) if p.gradient is None else p.gradient() for p in projections]
        grad_norms = [
            torch.full((p.rows.shape[0],), math.nan, dtype=torch.float64) for p in projections
        ]
        groups = []
        for members in _by_layout(views).values():
            before = torch.stack([views[i] for i in members])
            groups.append(_Group(members, before, _head_norms(before)))
            with_grad = [i for i in members if grads[i] is not None]
            if with_grad:  # one norm for the group's gradients
                rows = [_head_rows(grads[i], projections[i].rows) for i in with_grad]
                for i, norms in zip(with_grad, _head_norms(torch.stack(rows))):
                    grad_norms[i] = norms
    return UpdateSnapshot(step, projections, grad_norms, groups, mapped), skipped


def update_metrics(snapshot: UpdateSnapshot, num_heads: list[int]) -> dict[str, list[Tensor]]:
    """``metric -> one (H,) float64 tensor per layer`` for the weights as they are now, against
    ``snapshot``; NaN for a layer it left out (``num_heads``: each layer's H, for its NaNs)."""
    ratios: list[Tensor | None] = [None] * len(snapshot.projections)
    with torch.no_grad():
        for group in snapshot.groups:
            after = torch.stack(
                [
                    _head_rows(
                        snapshot.projections[i].weight.detach(), snapshot.projections[i].rows
                    )
                    for i in group.members
                ]
            )
            before = group.before
            if before.dtype in (torch.float16, torch.bfloat16):  # the difference not rounded
                after, before = after.float(), before.float()
            change = _head_norms(after - before)
            ratio = torch.where(group.size > 0, change / group.size, math.nan)
            for i, row in zip(group.members, ratio):
                ratios[i] = row
    out: dict[str, list[Tensor]] = {name: [] for name in ROW_METRICS}
    for mapped, heads in zip(snapshot.layers, num_heads):
        if mapped is None:
            for name in ROW_METRICS:
                out[name].append(torch.full((heads,), math.nan, dtype=torch.float64))
            continue
        q, kv_index = mapped
        per_key_head = list(kv_index)
        out["q_update_ratio"].append(ratios[q])
        out["k_update_ratio"].append(ratios[q + 1][per_key_head])
        out["q_grad_norm"].append(snapshot.grad_norms[q])
        out["k_grad_norm"].append(snapshot.grad_norms[q + 1][per_key_head])
    return out


def _by_layout(views: list[Tensor]) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, view in enumerate(views):
        groups.setdefault((tuple(view.shape), view.dtype, view.device), []).append(i)
    return groups


def _head_rows(weight: Tensor, rows: Tensor) -> Tensor:
    """(heads, d_k, in): the heads' rows of ``weight`` (out, in), a view where they are one run of
    consecutive rows (separate projections, a packed one's part), else a copy."""
    heads, d_k = rows.shape
    flat = rows.reshape(-1)
    first = int(flat[0])
    if torch.equal(flat, torch.arange(first, first + flat.numel())):
        return weight[first : first + flat.numel()].view(heads, d_k, -1)
    return weight[flat.to(weight.device)].view(heads, d_k, -1)


def _head_norms(x: Tensor) -> Tensor:
    """(..., heads, d_k, in) -> (..., heads) Frobenius norms, summed in float64, on ``x``'s
    device (read by the host with the probe's values)."""
    return torch.linalg.vector_norm(x.flatten(-2), dim=-1, dtype=torch.float64)


def gradient_of(weight: Tensor) -> Tensor | None:
    """The gradient of ``weight``, a parameter or a view of one (a transposed ``Conv1D`` weight):
    the parameter's ``.grad`` seen through the same view; None without one (or where the gradient
    is laid out unlike its parameter)."""
    base = private_apis.view_base(weight)
    base = weight if base is None else base
    grad = base.grad
    if grad is None:
        return None
    if base is weight:
        return grad
    if grad.shape != base.shape or grad.stride() != base.stride():
        return None
    offset = weight.storage_offset() - base.storage_offset() + grad.storage_offset()
    return grad.as_strided(weight.shape, weight.stride(), offset)
