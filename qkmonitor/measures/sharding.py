r"""Sharded weights and heads split across ranks: the one place qkmonitor reads a DTensor.

Two ways a weight reaches qkmonitor sharded (``torch.distributed.tensor.DTensor``):

- **FSDP2** (``fully_shard``): each rank stores a slice of every parameter, and the forward computes
  with the whole tensor, gathered. qkmonitor reads such a weight whole (:func:`whole`: a
  collective, every rank reads its layers at the same probe), one layer at a time.
- **Tensor parallelism** (``ColwiseParallel`` on the query and key projections): the forward itself
  computes with a row shard, so each rank computes the heads of its rows only. The rows one rank
  computes with are its :class:`RowShard`, seen on the weight the forward computes with (the
  capture, :mod:`qkmonitor.attention.capture`); with an even split of R ranks, rank chunk c of
  a layer with H query heads holds heads ``c·H/R .. (c+1)·H/R - 1`` (:class:`HeadPlacement`).
  Every per-head value is measured on the rank that computes that head and placed at its global
  index: the aggregators' sums by slot (:mod:`qkmonitor.measures.metrics`, reduced with the other
  states in their one collective), the weights' values with :func:`gather_heads` (one collective
  a probe for every layer).

- **FSDP2 over tensor parallelism** (Lightning's ``ModelParallelStrategy``): the parameters live
  on the forward's mesh after FSDP2's data-parallel mesh dims. Where those split nothing on this
  rank (one data-parallel rank, or replicated), the local shard is still this rank's rows, read
  and written in place (:meth:`RowShard.in_place`); where they split them, the rows are read from
  the whole weight, and nothing writes to them.

A split that does not fall on head boundaries, or is uneven, is refused by name where it is seen.

A parameter partitioned by a library that is not torch's (DeepSpeed ZeRO-3: ``ds_numel`` entries,
none of them on this rank between forwards) is gathered through that library's own API where it is
installed (:func:`gathered`), and otherwise refused by name (:class:`PartitionedWeightError`): never
a κ of an empty or partial tensor.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from qkmonitor import private_apis

__all__ = [
    "HeadPlacement",
    "PartitionedWeightError",
    "RowShard",
    "SplitHeadsError",
    "apart",
    "collective_device",
    "distributed",
    "gather_heads",
    "gathered",
    "is_dtensor",
    "local_whole",
    "pack_heads",
    "partitioned",
    "row_shard",
    "side_by_side",
    "stated_shape",
    "tensor_parallel_ranks",
    "unpack_heads",
    "whole",
]


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (or a view of one)."""
    view_of = private_apis.view_base(tensor)
    return any(callable(getattr(t, "full_tensor", None)) for t in (tensor, view_of))


def local_whole(tensor: object) -> Tensor | None:
    """A DTensor's local shard where it is the whole tensor (replicated, or sharded over mesh dims
    of one rank), outside autograd, no copy; else None (a plain tensor, part or a partial sum)."""
    placements = getattr(tensor, "placements", None)
    if not is_dtensor(tensor) or placements is None or any(p.is_partial() for p in placements):
        return None
    with torch.no_grad():
        local = tensor.to_local()
    return local if tuple(local.shape) == tuple(tensor.shape) else None


class PartitionedWeightError(ValueError):
    """A weight whose data this rank does not hold and qkmonitor cannot gather."""


class SplitHeadsError(ValueError):
    """A layer whose heads are split across ranks (tensor parallelism) in a way qkmonitor cannot
    read head by head: refused by name, for the whole run."""


def partitioned(tensor: object) -> str | None:
    """Why ``tensor`` is not this rank's to read or write between forwards: a parameter its owner
    partitions across ranks (DeepSpeed ZeRO-3's, marked ``ds_numel``: between forwards a rank holds
    none or part of its entries, and what a forward gathers is released after it), else None."""
    stated = getattr(tensor, "ds_numel", None)
    if not isinstance(tensor, Tensor) or stated is None:
        return None
    return (
        f"its weight of {stated} entries is partitioned across ranks (DeepSpeed ZeRO-3, which "
        "gathers it for a forward and releases it after)"
    )


def stated_shape(tensor: Tensor) -> tuple[int, ...]:
    """A tensor's shape, or a partitioned parameter's whole shape (``ds_shape``)."""
    shape = getattr(tensor, "ds_shape", None) if partitioned(tensor) else None
    return tuple(tensor.shape) if shape is None else tuple(shape)


def whole(tensor: Tensor | None) -> Tensor | None:
    """The whole tensor behind a sharded one (a DTensor's ``full_tensor()``: a collective every
    rank makes), any other as it is (None stays None)."""
    to_full = getattr(tensor, "full_tensor", None)
    return to_full() if callable(to_full) else tensor


@contextmanager
def gathered(module: nn.Module) -> Iterator[bool]:
    """Read ``module``'s parameters whole inside the block: those its owner partitions across
    ranks (:func:`partitioned`) gathered by the owner's own API, DeepSpeed's
    ``GatheredParameters`` (a collective every rank makes; read-only, and gone again after the
    block: copy what is kept). Yields whether anything was gathered.

    Raises:
        PartitionedWeightError: a partitioned parameter and no DeepSpeed to gather it with.
    """
    held = [p for p in module.parameters() if partitioned(p) is not None]
    if not held:
        yield False
        return
    try:
        from deepspeed.zero import GatheredParameters
    except ImportError:
        raise PartitionedWeightError(
            f"{partitioned(held[0])}, and DeepSpeed, whose GatheredParameters would gather it, "
            "is not importable"
        ) from None
    with GatheredParameters(held, modifier_rank=None):
        yield True


@dataclass(frozen=True)
class HeadPlacement:
    """Where one rank's heads of a layer are among all of them: heads ``offset .. offset + count
    - 1`` of ``total``."""

    offset: int
    count: int
    total: int

    @property
    def slots(self) -> slice:
        return slice(self.offset, self.offset + self.count)


@dataclass(frozen=True)
class RowShard:
    """The rows of a projection weight this rank computes with under tensor parallelism: chunk
    ``index`` of ``ranks`` equal chunks along the output features, as the forward's DTensor holds
    them (``mesh``, ``placements``).

    Attributes:
        index: this rank's chunk, 0-based (the chunks of several mesh dims nested, the first
            outermost, as DTensor splits them).
        ranks: how many chunks the rows are split into.
        rows: the weight's rows in all (its output features).
        dim: the weight's dim of output features (0 for ``F.linear``'s ``(out, in)``).
        mesh, placements: the forward's DTensor layout, for :meth:`local`'s free path.
    """

    index: int
    ranks: int
    rows: int
    dim: int
    mesh: object
    placements: tuple

    @property
    def chunk(self) -> int:
        """Rows per rank."""
        return self.rows // self.ranks

    def heads(self, local_heads: int) -> HeadPlacement:
        """The placement of the ``local_heads`` heads this rank's rows hold."""
        return HeadPlacement(self.index * local_heads, local_heads, self.ranks * local_heads)

    def in_place(self, weight: Tensor) -> bool:
        """Whether ``weight``'s local shard is this rank's rows, in order, to read and write in
        place: it is laid out as in the forward, or on the forward's mesh after data-parallel mesh
        dims (FSDP2 over tensor parallelism) that split nothing on this rank (each of size 1, or
        replicated)."""
        extra = self._data_parallel_dims(weight)
        return extra is not None and all(
            weight.device_mesh.size(d) == 1 or weight.placements[d].is_replicate() for d in extra
        )

    def _data_parallel_dims(self, weight: Tensor) -> range | None:
        """The mesh dims of ``weight`` before the forward's: those FSDP2 adds over tensor
        parallelism (none where it is laid out as in the forward); None where its mesh does not
        end with the forward's mesh, laid out alike, around this rank."""
        if not callable(getattr(weight, "to_local", None)):
            return None
        mesh, placements = weight.device_mesh, tuple(weight.placements)
        if mesh == self.mesh and placements == self.placements:
            return range(0)
        extra = mesh.ndim - self.mesh.ndim
        if extra < 0 or placements[extra:] != self.placements:
            return None
        coordinate = mesh.get_coordinate()
        if coordinate is None or mesh.device_type != self.mesh.device_type:
            return None
        ranks = mesh.mesh[tuple(coordinate[:extra])]  # the forward's dims, around this rank
        return range(extra) if torch.equal(ranks, self.mesh.mesh) else None

    def local(self, weight: Tensor) -> Tensor:
        """This rank's rows of ``weight`` (the parameter or its gradient as the module holds it
        now), in ``nn.Linear`` order: the DTensor's local shard where that is them
        (:meth:`in_place`: tensor parallelism alone, or FSDP2 over it with one data-parallel
        rank; no copy, written through in place), else the rows cut from the whole tensor (FSDP2
        over tensor parallelism on several data-parallel ranks: a copy, a collective, one layer at
        a time). Outside autograd (a read to measure, or to write under ``no_grad``): the local
        shard itself, not ``to_local``'s differentiable view of it."""
        if self.in_place(weight):
            with torch.no_grad():
                return weight.to_local()
        full = whole(weight)
        start = self.index * self.chunk
        return full.narrow(self.dim, start, self.chunk)


def row_shard(weight: object, dim: int = 0) -> RowShard | str | None:
    """How the forward's ``weight`` is split along its output features (``dim``) across ranks: a
    :class:`RowShard`, None where it is not (a plain tensor: one process, DDP, FSDP2's unsharded
    parameter; a DTensor replicated, or sharded along its inputs: ``RowwiseParallel``), or why the
    split cannot be read by head (uneven chunks). A DTensor's answer is kept with it (its layout
    never changes): the capture asks at every projection call of a probed forward."""
    placements = getattr(weight, "placements", None)
    mesh = getattr(weight, "device_mesh", None)
    if placements is None or mesh is None or not isinstance(weight, Tensor):
        return None
    key = (id(weight), dim)
    known = _ROW_SHARDS.get(key)
    if known is None or known[0]() is not weight:
        ref = weakref.ref(weight, lambda _, key=key: _ROW_SHARDS.pop(key, None))
        known = _ROW_SHARDS[key] = (ref, _row_shard(weight, dim, placements, mesh))
    return known[1]


#: (id(DTensor), dim) -> (a weak reference to it, its row_shard), gone with the tensor (a
#: tensor's == is elementwise, so no WeakKeyDictionary)
_ROW_SHARDS: dict[tuple[int, int], tuple[weakref.ref, RowShard | str | None]] = {}


def _row_shard(weight: Tensor, dim: int, placements, mesh) -> RowShard | str | None:
    index, ranks = 0, 1
    for mesh_dim, placement in enumerate(placements):
        is_shard = getattr(placement, "is_shard", None)
        if not callable(is_shard) or not is_shard() or placement.dim % weight.dim() != dim:
            continue
        size = mesh.size(mesh_dim)
        index = index * size + mesh.get_local_rank(mesh_dim)
        ranks *= size
    if ranks == 1:
        return None
    rows = weight.shape[dim]
    local = weight.to_local().shape[dim]
    if rows % ranks or local != rows // ranks:
        return (
            f"its projection of {rows} output features is split unevenly across {ranks} ranks "
            f"(this rank holds {local}), so its heads cannot be placed"
        )
    return RowShard(index, ranks, rows, dim, mesh, tuple(placements))


def tensor_parallel_ranks(model: nn.Module) -> int:
    """How many ranks compute the same sequences, each for part of the heads: the largest row
    split over the mesh dims of tensor parallelism among the model's DTensor weights; 1 without
    any. A module under FSDP2 (``fully_shard`` on it or a module around it) has its first mesh
    dim for the data-parallel shards, which are not tensor parallelism. Read before a forward
    (the forward shows the split itself: :func:`row_shard`)."""
    fsdp_module = private_apis.fsdp_module_type()
    largest = 1
    under_fsdp = {
        id(m) for root in model.modules() if isinstance(root, fsdp_module) for m in root.modules()
    }
    for module in model.modules():
        fsdp = id(module) in under_fsdp  # its parameters are FSDP2's, sharded by a parent's call
        for weight in module.parameters(recurse=False):
            placements = getattr(weight, "placements", None)
            if placements is None or weight.dim() != 2:
                continue
            split = 1
            for mesh_dim, placement in enumerate(placements):
                if fsdp and mesh_dim == 0 and weight.device_mesh.ndim > 1:
                    continue  # FSDP2's shards over tensor parallelism
                if type(placement).__name__ == "Shard" and placement.dim == 0:
                    split *= weight.device_mesh.size(mesh_dim)
            if fsdp and weight.device_mesh.ndim == 1:
                split = 1  # FSDP2 alone: data-parallel shards
            largest = max(largest, split)
    return largest


def gather_heads(parts: Sequence[tuple[HeadPlacement, Sequence[Tensor]]]) -> list[list[Tensor]]:
    """Every head's values of layers whose heads are split across ranks, from the rank that
    computes each, in one ``all_gather`` for all of them (none without a process group of more
    than one process: this rank's heads placed, the others NaN).

    Args:
        parts: per layer, this rank's placement and its tensors, each ``(count, ...)`` (float,
            bool); every rank passes the same layers with tensors of the same shapes.

    Returns:
        Per layer, its tensors ``(total, ...)`` in the given dtypes and on the CPU.
    """
    if not parts:
        return []
    flat = pack_heads(parts)
    if distributed():
        device = collective_device()
        gathered = [torch.empty_like(flat, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat.to(device))
        return unpack_heads(parts, torch.stack(gathered).cpu())
    return unpack_heads(parts, flat[None])


def side_by_side(blocks: Sequence[Sequence[Tensor]]) -> Tensor:
    """Tensors of heads as one float64 ``(heads, columns)`` CPU tensor, for an exchange to pack
    and place at once.

    ``blocks``: lists of tensors, each ``(heads, ...)`` (float or bool); in a block, all of one
    value a head (``(heads,)``) or all of more, and best of one dtype: a block goes in one
    ``stack`` or ``cat`` (an op costs microseconds; a cat of several dtypes many times more).
    The columns hold the tensors block after block, in order, each flattened per head, bool as
    0/1, every float32 value exactly: a layout that depends on the blocks' shapes alone, the
    same on every rank."""
    heads = blocks[0][0].shape[0]
    columns = []
    for block in blocks:
        tensors = [t.cpu() for t in block]
        if all(t.dim() == 1 for t in tensors):
            columns.append(torch.stack(tensors, 1).double())
        else:
            columns.append(torch.cat([t.reshape(heads, -1) for t in tensors], 1).double())
    return torch.cat(columns, 1).detach()


def apart(whole: Tensor, like: Sequence[Sequence[Tensor]]) -> list[list[Tensor]]:
    """The blocks of :func:`side_by_side` back from ``whole`` (``(heads, columns)``, any head
    count): each tensor ``(heads, *shape[1:])``, contiguous, in the dtype of its tensor in
    ``like`` (a bool is True where the value is 1)."""
    heads, start, out = whole.shape[0], 0, []
    for block in like:
        single = all(t.dim() == 1 for t in block)
        widths = [1] * len(block) if single else [math.prod(t.shape[1:]) for t in block]
        columns = whole[:, start : start + sum(widths)]
        start += sum(widths)
        dtypes = {t.dtype for t in block}
        if len(dtypes) == 1:  # one conversion for the block
            columns = _as_dtype(columns, dtypes.pop())
        if single:  # each a contiguous row of the transposed block
            pieces = list(columns.T.contiguous().unbind(0))
        else:
            split = columns.split(widths, 1)
            pieces = [p.reshape(heads, *t.shape[1:]).contiguous() for p, t in zip(split, block)]
        if len(dtypes) > 1:
            pieces = [_as_dtype(p, t.dtype) for p, t in zip(pieces, block, strict=True)]
        out.append(pieces)
    return out


def _as_dtype(values: Tensor, dtype: torch.dtype) -> Tensor:
    """Exchanged float64 values in ``dtype`` (a bool: True where 1); themselves where they are."""
    if values.dtype == dtype:
        return values
    return values == 1 if dtype == torch.bool else values.to(dtype)


def pack_heads(parts: Sequence[tuple[HeadPlacement, Sequence[Tensor]]]) -> Tensor:
    """This rank's part of :func:`gather_heads` as one float64 CPU vector: per layer its offset,
    then its tensors (one ``cat`` a layer; to ride in another collective, as
    :func:`~qkmonitor.measures.metrics.reduce_across_ranks` does)."""
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    pieces = []
    for p, tensors in parts:  # one cat: float32 and bool promoted to float64 exactly
        pieces.append(torch.tensor([float(p.offset)], dtype=torch.float64))
        pieces += [t.detach().reshape(-1).cpu() for t in tensors]
    return torch.cat(pieces)


def unpack_heads(
    parts: Sequence[tuple[HeadPlacement, Sequence[Tensor]]], ranks: Tensor
) -> list[list[Tensor]]:
    """The layers' tensors of every head from every rank's :func:`pack_heads` (``ranks``:
    ``(world, size)``, on the CPU): each rank's heads at its offset; a head no rank holds is NaN
    (False for bool).

    One indexed copy moves every value to its place (:func:`_unpack_plan`, kept while the layers'
    shapes and the ranks' offsets stay the same: from one probe to the next)."""
    if not parts:  # the sums alone crossed (no layer's heads split)
        return []
    plan = _unpack_plan(parts, ranks)
    whole = plan.fill.clone()
    whole[plan.target] = ranks.reshape(-1)[plan.source]
    pieces = iter(whole.split(plan.sizes))
    out: list[list[Tensor]] = []
    for placement, tensors in parts:
        layer = []
        for t in tensors:
            piece = next(pieces).view(placement.total, *t.shape[1:])
            layer.append(piece != 0 if t.dtype == torch.bool else piece.to(t.dtype))
        out.append(layer)
    return out


class _UnpackPlan(NamedTuple):
    """Where :func:`unpack_heads` puts the gathered values: ``whole[target] = flat[source]``
    (``flat`` the ranks' packs end to end), ``whole`` starting as ``fill`` (NaN, 0 where a
    tensor is bool) and split into the tensors by ``sizes``."""

    source: Tensor
    target: Tensor
    fill: Tensor
    sizes: list[int]


#: (the layers' shapes, the ranks' offsets) -> their plan; a few kept (one a set of layers)
_UNPACK_PLANS: dict[tuple, _UnpackPlan] = {}


def _unpack_plan(
    parts: Sequence[tuple[HeadPlacement, Sequence[Tensor]]], ranks: Tensor
) -> _UnpackPlan:
    starts, start = [], 0
    for _, tensors in parts:
        starts.append(start)
        start += 1 + sum(t.numel() for t in tensors)
    offsets = ranks[:, starts].to(torch.int64).tolist()  # (world, layers)
    shapes = tuple(
        (p.total, tuple((tuple(t.shape), t.dtype == torch.bool) for t in tensors))
        for p, tensors in parts
    )
    key = (shapes, tuple(map(tuple, offsets)), ranks.shape[1])
    plan = _UNPACK_PLANS.get(key)
    if plan is None:
        if len(_UNPACK_PLANS) >= 8:
            _UNPACK_PLANS.clear()
        plan = _UNPACK_PLANS[key] = _build_unpack_plan(parts, starts, offsets, ranks.shape[1])
    return plan


def _build_unpack_plan(
    parts: Sequence[tuple[HeadPlacement, Sequence[Tensor]]],
    starts: list[int],
    offsets: list[list[int]],
    size: int,
) -> _UnpackPlan:
    sources, targets, fills, sizes = [], [], [], []
    placed = 0  # where the next whole tensor starts
    for layer, ((placement, tensors), start) in enumerate(zip(parts, starts)):
        piece = start + 1  # where this tensor starts in a rank's pack
        for t in tensors:
            row = math.prod(t.shape[1:])  # values per head
            whole = placement.total * row
            fills.append(torch.full((whole,), 0.0 if t.dtype == torch.bool else math.nan))
            for rank, rank_offsets in enumerate(offsets):
                sources.append(torch.arange(t.numel()) + rank * size + piece)
                targets.append(torch.arange(t.numel()) + placed + rank_offsets[layer] * row)
            sizes.append(whole)
            placed += whole
            piece += t.numel()
    empty = torch.zeros(0, dtype=torch.int64)
    return _UnpackPlan(
        torch.cat(sources) if sources else empty,
        torch.cat(targets) if targets else empty,
        torch.cat(fills).double() if fills else torch.zeros(0, dtype=torch.float64),
        sizes,
    )


def distributed() -> bool:
    """Whether a process group of more than one process is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device() -> torch.device:
    """Where the default process group's collectives run: the CUDA device for NCCL, else the
    CPU."""
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
