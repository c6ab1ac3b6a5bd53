"""Context parallelism: whether one attention call's keys are split across ranks.

Under sequence or context parallelism each rank holds a chunk of the sequence, and a query row's
softmax runs over keys held by other ranks too. Its entropy needs all of those keys, so a
statistic computed from one rank's chunk is not the model's: such a call is refused by name
(:func:`context_parallel_reason`), never measured from part of its keys.

Detected, for a call qkmonitor sees (an SDPA or ``flex_attention`` call, or the queries and keys
a family hands its probes):

- its queries or keys are DTensors sharded along the sequence dim (dim -2 of ``(B, H, N, D)``)
  over more than one rank: what torch's ``context_parallel`` hands SDPA (its wrapper turns every
  tensor argument into ``DTensor.from_local(..., [Shard(2)])``), and what a module-level
  ``_ContextParallel`` style hands the module it wraps;
- torch's ``context_parallel`` SDPA wrapper is in place (``F.scaled_dot_product_attention`` is
  the function its ``_distribute_function`` installs, torch 2.4 to 2.13): inside that context
  torch takes every SDPA call to be over this rank's chunk, so a call made with plain tensors
  (a name bound to the original SDPA before the context, a family that measures from the
  module's inputs) is over this rank's keys alone.

Not detected: a ring attention written with private ops (``aten._scaled_dot_product_*``,
flash-attn's or a custom kernel on chunks) is never seen as an attention call at all, so it is
unread already; and a sequence split done by hand (a module handed its rank's chunk with no
DTensor and no torch wrapper) shows nothing that tells it from a short sequence. Keys gathered
whole before the call (flex ``_ContextParallel``'s all-gather of the keys) are not split: each
rank's rows see every key, and the call is read.

A refused call's queries and keys still check the layer's weight layout (its kappa is a property
of the weights, context parallelism or not): the check reads sequence position 0, where RoPE is
the identity, which only the rank holding the sequence's first chunk has, so every rank checks
that rank's rows (:func:`first_chunk`, a broadcast over the sequence's ranks) and all reach one
verdict.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qkmonitor import private_apis

if TYPE_CHECKING:  # probes import this module, and layout_check imports probes (via adapters)
    from qkmonitor.attention.layout_check import LayoutEvidence

__all__ = [
    "CONTEXT_PARALLEL",
    "TORCH_SDPA",
    "context_parallel_reason",
    "first_chunk",
    "local",
    "sequence_split_reason",
]

#: the words every refusal under context parallelism names
CONTEXT_PARALLEL = "context parallelism"

#: torch's own SDPA: what a ``TorchFunctionMode`` is handed for an SDPA call, also inside
#: ``context_parallel``, whose wrapper replaces ``F.scaled_dot_product_attention`` meanwhile
TORCH_SDPA = private_apis.torch_sdpa()


def context_parallel_reason(q: object, k: object, *, seq_dim: int = -2) -> str | None:
    """Why one attention call is refused under context parallelism, or None where nothing says
    its keys are split across ranks.

    Args:
        q: the call's queries (a tensor, a DTensor, or None where the family has none at hand).
        k: its keys, likewise.
        seq_dim: the sequence dim of ``q`` and ``k`` (-2 of SDPA's ``(B, H, N, D)``).

    Returns:
        The reason, starting "its keys are split across N ranks (context parallelism: ...)"
        (or "its queries are split", where only they are) and ending "entropy not measured";
        the caller prefixes the layer's name.
    """
    keys, queries = _sequence_ranks(k, seq_dim), _sequence_ranks(q, seq_dim)
    if keys > 1:
        return (
            f"its keys are split across {keys} ranks ({CONTEXT_PARALLEL}: they are a DTensor "
            "sharded along the sequence dim), so a row's softmax is over keys other ranks hold; "
            "entropy not measured"
        )
    if queries > 1:
        return (
            f"its queries are split across {queries} ranks ({CONTEXT_PARALLEL}: they are a "
            "DTensor sharded along the sequence dim), so its rows are this rank's part of the "
            "sequence; entropy not measured"
        )
    ranks = _patched_sdpa_ranks()
    if ranks is None or ranks == 1:  # not in place, or over one rank: every key is here
        return None
    across = f"across {ranks} ranks" if ranks > 1 else "across ranks"
    return (
        f"its keys are split {across} ({CONTEXT_PARALLEL}: torch's context_parallel is active, "
        "and takes every SDPA call to be over this rank's chunk of the sequence), so a row's "
        "softmax is over keys other ranks hold; entropy not measured"
    )


def sequence_split_reason(x: object, *, seq_dim: int = -2) -> str | None:
    """Why ``x``, a tensor along the sequence (a block's output ``(B, N, d)``: the hidden states),
    holds this rank's part of the sequence alone, or None where nothing says so: it is a DTensor
    sharded along ``seq_dim`` over more than one rank, or torch's ``context_parallel`` is in
    place (its buffers, the model's inputs among them, sharded along the sequence in place).

    Returns:
        The reason, "split across N ranks (context parallelism: ...)", for the caller to name
        its layer and metrics with.
    """
    ranks = _sequence_ranks(x, seq_dim)
    if ranks > 1:
        return (
            f"split across {ranks} ranks ({CONTEXT_PARALLEL}: a DTensor sharded along the "
            "sequence dim)"
        )
    ranks = _patched_sdpa_ranks()
    if ranks is None or ranks == 1:
        return None
    across = f"across {ranks} ranks" if ranks > 1 else "across ranks"
    return (
        f"split {across} ({CONTEXT_PARALLEL}: torch's context_parallel is active, its buffers "
        "sharded along the sequence)"
    )


def local(x: object) -> object:
    """This rank's part of a DTensor (``to_local()``), else ``x`` itself."""
    to_local = getattr(x, "to_local", None)
    return to_local() if callable(to_local) and hasattr(x, "placements") else x


def first_chunk(evidence: LayoutEvidence, q: object, *, seq_dim: int = -2) -> LayoutEvidence:
    """``evidence`` of sequence position 0 as the rank holding the first chunk of ``q``'s
    sequence saw it, on every rank of that split: its position-0 queries, keys and projection
    inputs broadcast from the first rank of the mesh dim ``q`` is sharded along (a collective:
    every rank makes it at the same call, the first of a probed forward). ``evidence`` itself
    where ``q`` is not a DTensor split along one mesh dim, or its inputs are not ``(B, N, d)``.
    """
    group = _sequence_group(q, seq_dim)
    if group is None or evidence.q is None or evidence.k is None:
        return evidence
    b, n, m = evidence.batch, evidence.queries, evidence.keys
    rows = {}
    for key, x in evidence.inputs.items():
        if x.dim() != 3 or x.shape[0] != b or x.shape[1] not in (n, m):
            return evidence
        rows[key] = x[:, :1]
    source = dist.get_global_rank(group, 0)

    def from_first(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().contiguous().clone()
        dist.broadcast(x, src=source, group=group)
        return x

    return dataclasses.replace(
        evidence,
        inputs={key: from_first(x) for key, x in rows.items()},
        q=from_first(evidence.q),
        k=from_first(evidence.k),
        queries=1,
        keys=1,
    )


def _sequence_group(x: object, seq_dim: int):
    """The process group of the one mesh dim ``x``, a DTensor, is sharded along ``seq_dim`` over,
    else None."""
    placements, mesh = getattr(x, "placements", None), getattr(x, "device_mesh", None)
    if placements is None or mesh is None or not isinstance(x, torch.Tensor):
        return None
    target = seq_dim % x.dim()
    dims = [
        mesh_dim
        for mesh_dim, placement in enumerate(placements)
        if callable(getattr(placement, "is_shard", None))
        and placement.is_shard()
        and isinstance(getattr(placement, "dim", None), int)
        and placement.dim % x.dim() == target
        and mesh.size(mesh_dim) > 1
    ]
    return mesh.get_group(dims[0]) if len(dims) == 1 and dist.is_initialized() else None


def _sequence_ranks(x: object, seq_dim: int) -> int:
    """Over how many ranks ``x``, a DTensor, is sharded along ``seq_dim``; 1 for a plain tensor,
    a replicated DTensor, or one sharded along other dims (heads: tensor parallelism)."""
    placements = getattr(x, "placements", None)
    mesh = getattr(x, "device_mesh", None)
    if placements is None or mesh is None or not isinstance(x, torch.Tensor) or x.dim() == 0:
        return 1
    target = seq_dim % x.dim()
    ranks = 1
    for mesh_dim, placement in enumerate(placements):
        dim, is_shard = getattr(placement, "dim", None), getattr(placement, "is_shard", None)
        if isinstance(dim, int) and callable(is_shard) and is_shard() and dim % x.dim() == target:
            ranks *= mesh.size(mesh_dim)
    return ranks


def _patched_sdpa_ranks() -> int | None:
    """The ranks of the mesh torch's ``context_parallel`` wrapper distributes SDPA over (0 where
    it is in place but its mesh is not found), or None where ``F.scaled_dot_product_attention``
    is not that wrapper. The wrapper is ``_distribute_function``'s ``inner_fn``, a closure over
    ``device_mesh`` in every release that has it."""
    sdpa = F.scaled_dot_product_attention
    if sdpa is TORCH_SDPA:
        return None
    if not private_apis.is_context_parallel_wrapper(sdpa):
        return None
    code, cells = getattr(sdpa, "__code__", None), getattr(sdpa, "__closure__", None) or ()
    names = getattr(code, "co_freevars", ())
    mesh = dict(zip(names, cells)).get("device_mesh")
    try:
        return int(mesh.cell_contents.size())
    except (AttributeError, ValueError, TypeError, RuntimeError):
        return 0
