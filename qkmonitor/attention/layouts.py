r"""Where an attention module keeps W_Q and W_K, and how they split into heads.

A :class:`QKLayout` names the projections of one module and how to cut them: separate query and
key projections, or one fused q/k/v projection in one of three row orders, each ``(out, in)``
like ``nn.Linear`` (a GPT-2 ``Conv1D``, whose weight is ``(in, out)``, is read transposed):

- ``"blocks"``: ``[q_0 … q_{H-1} | k_0 … k_{H_kv-1} | v …]`` (timm, nanoGPT, Phi-3, ModernBERT,
  GPT-BigCode and Falcon multi-query, litgpt ≥ 0.5);
- ``"heads"``: per head ``[q_h k_h v_h]`` (GPT-NeoX/Pythia, BLOOM);
- ``"groups"``: per key/value group ``[q_{g r} … q_{g r + r - 1} k_g v_g]``, ``r = H / H_kv``
  (Falcon's new decoder architecture, litgpt before 0.5).

Query head h scores against key head ``kv_index[h]``; ``None`` means the grouped pairing of
SDPA's ``enable_gqa`` and ``repeat_interleave``, ``g = h // (H / H_kv)``. Some libraries pair
``g = h % H_kv`` instead (x-transformers repeats its keys with ``einops.repeat``); the pairing is
the model's own, found by :func:`qkmonitor.attention.intercept.check_layout` from the call it makes.

Tensor parallelism: :class:`HeadShards`, how a layer's projections are split across ranks, and
:meth:`QKLayout.localized`, the layout one rank computes. A layout is found by name
(:func:`qkmonitor.attention.layout_names.infer_layouts`) or stated
(:class:`qkmonitor.attention.spec.AttentionSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from qkmonitor.attention.clip import ProjectionRows, QKRows
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.measures.sharding import HeadPlacement, RowShard, stated_shape, whole

__all__ = ["FUSED_ORDERS", "PAIRINGS", "HeadShards", "QKLayout", "placed_heads"]

FUSED_ORDERS = ("blocks", "heads", "groups")
PAIRINGS = ("grouped", "modulo")


@dataclass(frozen=True)
class QKLayout:
    """How one module's W_Q and W_K are read (resolved: every count known).

    Attributes:
        q: the query projection's path in the module (a submodule with a ``weight``, or a
            parameter), or the fused q/k/v projection when ``k`` is None.
        k: the key projection's path; None when ``q`` is fused.
        fused: the fused projection's row order (:data:`FUSED_ORDERS`); ignored when ``k`` is set.
        num_heads, num_kv_heads, head_dim: H, H_kv (dividing H) and d_k.
        kv_index: the key head of each query head; None for the grouped pairing.
        scale: the factor on ``q·k``; None for ``1/sqrt(head_dim)``.
        qk_norm: the layer normalizes q and k after the projections.
        scale_unknown: why the layer's forward does not tell the factor between its projections'
            ``q·kᵀ`` and the logits its softmax gets (set by the layout check,
            :mod:`.layout_check`); the weights are read, and ``qk_spectral_norm`` (σ₁ · scale) is
            NaN (:meth:`qk_weights` gives a NaN scale) rather than a guess.
        shards: where the heads are split across ranks (tensor parallelism): the layout is then
            this rank's, its counts and rows those of the heads it computes (:meth:`localized`).
    """

    q: str
    k: str | None
    fused: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_index: tuple[int, ...] | None = None
    scale: float | None = None
    qk_norm: bool = False
    scale_unknown: str | None = None
    shards: HeadShards | None = None

    @property
    def logit_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale

    def sources(self, module: nn.Module) -> list[Tensor]:
        """The parameters whose inputs are the layer's query and key inputs (the fused one once)."""
        return [_weight_param(module, path) for path in (self.q, self.k) if path is not None]

    def read(self, module: nn.Module) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """``(w_q, b_q, w_k, b_k)``: (H·d_k, d) and (H_kv·d_k, d') weights, ``nn.Linear`` layout."""
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.shards is not None:  # this rank's rows, as the forward computes with them
            return self.shards.read(module, self.q, self.k)
        if self.k is not None:
            w_q, b_q = map(whole, projection(module, self.q))
            w_k, b_k = map(whole, projection(module, self.k))
            return (
                w_q[: h * d],
                _rows(b_q, slice(0, h * d)),
                w_k[: kv * d],
                _rows(b_k, slice(0, kv * d)),
            )
        w, b = map(whole, projection(module, self.q))
        q_rows, k_rows = fused_rows(self.fused, h, kv, d, device=w.device)
        return w[q_rows], _rows(b, q_rows), w[k_rows], _rows(b, k_rows)

    def split_biases(
        self, q_bias: Tensor | None, k_bias: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """The query and key rows of biases given for the projections (``q_bias`` for ``q``, or
        for the fused one; ``k_bias`` for ``k``), cut as :meth:`read` cuts the weights'."""
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.k is not None:
            return _rows(q_bias, slice(0, h * d)), _rows(k_bias, slice(0, kv * d))
        if q_bias is None:
            return None, None
        q_rows, k_rows = fused_rows(self.fused, h, kv, d, device=q_bias.device)
        return q_bias[q_rows], q_bias[k_rows]

    def qk_rows(self, module: nn.Module) -> QKRows:
        """The projections by head, as views written through in place (QK-Clip)."""
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        index = self.kv_index if self.kv_index is not None else grouped_index(h, kv)
        if self.shards is not None:
            q, k = self.shards.rows(module, self.q, self.k, d)
            return QKRows(q, k, tuple(index), self.qk_norm)
        if self.k is not None:
            (w_q, b_q), (w_k, b_k) = projection(module, self.q), projection(module, self.k)
            q_rows, k_rows = torch.arange(h * d), torch.arange(kv * d)
            return QKRows(
                ProjectionRows(w_q, b_q, q_rows.view(h, d)),
                ProjectionRows(w_k, b_k, k_rows.view(kv, d)),
                tuple(index),
                self.qk_norm,
            )
        w, b = projection(module, self.q)
        q_rows, k_rows = fused_rows(self.fused, h, kv, d)
        return QKRows(
            ProjectionRows(w, b, q_rows.view(h, d)),
            ProjectionRows(w, b, k_rows.view(kv, d)),
            tuple(index),
            self.qk_norm,
        )

    def qk_weights(self, module: nn.Module) -> QKWeights:
        w_q, _, w_k, _ = self.read(module)
        kv_heads = self.num_kv_heads
        if self.kv_index is not None and tuple(self.kv_index) != grouped_index(
            self.num_heads, kv_heads
        ):
            # a pairing of its own: one key head per query head, in the query heads' order
            index = torch.tensor(self.kv_index, device=w_k.device)
            w_k = w_k.view(kv_heads, self.head_dim, -1)[index].flatten(0, 1)
            kv_heads = self.num_heads
        scale = float("nan") if self.scale_unknown is not None else self.logit_scale
        return QKWeights(w_q, w_k, self.num_heads, kv_heads, scale, qk_norm=self.qk_norm)

    def describe(self) -> str:
        where = f"{self.q}/{self.k}" if self.k is not None else f"{self.q} ({self.fused})"
        pairing = "" if self.kv_index is None else f", key heads {list(self.kv_index)}"
        return (
            f"{where}, {self.num_heads} heads, {self.num_kv_heads} kv heads, d_k "
            f"{self.head_dim}{pairing}"
        )

    def localized(self, q: RowShard | None, k: RowShard | None) -> QKLayout | str:
        """This layout (of all the heads) as one rank of tensor parallelism computes it: its query
        projection split as ``q`` says, its key projection as ``k`` (None: whole on every rank),
        each rank holding whole heads whose key heads it holds too; else why it cannot be."""
        if q is None:
            return self
        if self.k is None:
            return f"its fused projection {self.q!r} is sharded by rows across {q.ranks} ranks"
        heads, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        k_ranks = 1 if k is None else k.ranks
        if heads % q.ranks or kv % k_ranks or q.rows != heads * d:
            return (
                f"its {heads} query heads of {d} ({q.rows} rows) and {kv} key heads do not split "
                f"into whole heads across {q.ranks} ranks"
            )
        local, local_kv = heads // q.ranks, kv // k_ranks
        first, first_kv = q.index * local, (0 if k is None else k.index * local_kv)
        pairing = self.kv_index or grouped_index(heads, kv)
        index = tuple(pairing[first + h] - first_kv for h in range(local))
        if not all(0 <= g < local_kv for g in index):
            return "its query heads and the key heads they score against are on different ranks"
        shards = HeadShards(q, k, HeadPlacement(first, local, heads))
        grouped = index == grouped_index(local, local_kv)
        return replace(
            self,
            num_heads=local,
            num_kv_heads=local_kv,
            kv_index=None if grouped else index,
            shards=shards,
        )


@dataclass(frozen=True)
class HeadShards:
    """How a layer's query and key projections are split across ranks (tensor parallelism), and
    where this rank's query heads are among all (``placement``); ``k`` None: the keys whole on
    every rank."""

    q: RowShard
    k: RowShard | None
    placement: HeadPlacement

    def read(self, module: nn.Module, q: str, k: str) -> tuple:
        """``(w_q, b_q, w_k, b_k)`` of this rank's heads."""
        (w_q, b_q), (w_k, b_k) = projection(module, q), projection(module, k)
        read_k = whole if self.k is None else self.k.local
        return (
            self.q.local(w_q),
            None if b_q is None else self.q.local(b_q),
            read_k(w_k),
            None if b_k is None else read_k(b_k),
        )

    def rows(
        self, module: nn.Module, q: str, k: str, head_dim: int
    ) -> tuple[ProjectionRows, ProjectionRows]:
        """This rank's query and key rows by head, written through in place.

        Raises:
            ValueError: where this rank's local shard of a weight is not the rows it computes with
                (:meth:`RowShard.in_place`; FSDP2 over tensor parallelism on several
                data-parallel ranks: the rows would be a gathered copy, which a write would lose
                and which an update would leave stale).
        """
        out = []
        for path, shard in ((q, self.q), (k, self.k)):
            weight, bias = projection(module, path)
            if shard is not None and not shard.in_place(weight):
                raise ValueError(
                    f"this rank's shard of {path!r} is not the rows it computes with (FSDP2 over "
                    "tensor parallelism on more than one data-parallel rank), so they are not "
                    "read in place"
                )
            local = shard.local if shard is not None else _replica
            mine = local(weight)
            out.append(
                ProjectionRows(
                    mine,
                    None if bias is None else local(bias),
                    torch.arange(mine.shape[0]).view(-1, head_dim),
                    gradient=lambda w=weight, read=local: None if w.grad is None else read(w.grad),
                )
            )
        return out[0], out[1]


def _replica(tensor: Tensor) -> Tensor:
    """A tensor whole on every rank: a replicated DTensor's local copy (outside autograd, as
    :meth:`~qkmonitor.measures.sharding.RowShard.local`), else itself."""
    to_local = getattr(tensor, "to_local", None)
    if not callable(to_local):
        return tensor
    with torch.no_grad():
        return to_local()


def placed_heads(
    placement: HeadPlacement,
    *,
    call_head_dim: int | None,
    rows: int | None,
    heads: int | None = None,
    head_dim: int | None = None,
) -> HeadPlacement | str | None:
    """Where one rank's attention call's query heads are among the layer's under tensor
    parallelism, checked against the query projection they come from.

    The capture places a call of h query heads on rank chunk c of R as heads c·h .. c·h + h - 1
    of R·h (``placement``): right where the call holds this rank's rows of the query projection
    as whole heads. A call that holds every head (the projections' outputs gathered on every
    rank, ``ColwiseParallel(output_layouts=Replicate())``) or a view of this rank's rows by other
    counts (a forward that views them with the global head count and ``-1``) is neither.

    Args:
        placement: the capture's placement of the call (``count`` h, ``total`` R·h).
        call_head_dim: d, the last dim of the call's queries ``(B, h, N, d)``; None where the
            call has no queries (explicit logits).
        rows: the query projection's output features over all ranks (H·d of separate
            projections); None where not known (a fused projection).
        heads, head_dim: H and d_k where the layer's layout candidates agree on them before a
            call (the module names them), else None.

    Returns:
        ``placement`` where the call holds this rank's part of the heads: h·R = H, or, H not
        known, h·d·R = rows; None where it holds every head, h·d = rows (and h = H): each rank
        measures them all, as one process does, and the reduction's sums and counts are R
        times one rank's alike (the same means and maxima); else why it is neither, for the
        call to be refused by name.
    """
    h, d = placement.count, call_head_dim
    ranks = placement.total // h
    if d is not None and head_dim is not None and d != head_dim:
        return (
            f"its attention call's {h} query heads on this rank hold {d} features each where its "
            f"projections' {heads} heads hold {head_dim}, so they are not its heads"
        )
    known = d is not None and rows is not None
    if known and h * d == rows and heads in (None, h):
        return None  # every head, on every rank
    if heads is not None:
        part = h * ranks == heads
    else:  # where the call's head dim or the rows are not known, nothing says otherwise
        part = not known or h * d * ranks == rows
    if part:
        return placement
    total = heads if heads is not None else rows // d
    return (
        f"its attention call holds {h} query heads on this rank of {ranks}, neither this rank's "
        f"part of its {total} heads nor all of them"
    )


def grouped_index(heads: int, kv_heads: int) -> tuple[int, ...]:
    """The grouped pairing ``g = h // (H / H_kv)``."""
    return tuple(h // (heads // kv_heads) for h in range(heads))


def modulo_index(heads: int, kv_heads: int) -> tuple[int, ...]:
    """The pairing ``g = h % H_kv`` (x-transformers)."""
    return tuple(h % kv_heads for h in range(heads))


def fused_rows(
    order: str, heads: int, kv_heads: int, head_dim: int, device=None
) -> tuple[Tensor, Tensor]:
    """Row indices of W_Q and W_K in a fused projection of the given order."""
    d, r = head_dim, heads // kv_heads
    if order == "blocks":
        q = torch.arange(heads * d)
        k = heads * d + torch.arange(kv_heads * d)
    elif order == "heads":  # per head [q k v]
        base = torch.arange(heads)[:, None] * 3 * d + torch.arange(d)
        q, k = base.flatten(), (base + d).flatten()
    elif order == "groups":  # per group [q x r, k, v]
        group = torch.arange(kv_heads)[:, None, None] * (r + 2) * d
        q = (group + torch.arange(r)[None, :, None] * d + torch.arange(d)).flatten()
        k = (group[:, 0] + r * d + torch.arange(d)).flatten()
    else:
        raise ValueError(f"Expected `fused` to be one of {FUSED_ORDERS}, got {order!r}")
    return q.to(device), k.to(device)


def _rows(bias: Tensor | None, rows) -> Tensor | None:
    return None if bias is None else bias[rows]


def resolve(module: nn.Module, path: str):
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def is_conv1d(proj: nn.Module) -> bool:
    """GPT-2's ``Conv1D``: weight ``(in, out)``, out features in ``nf``."""
    weight = getattr(proj, "weight", None)
    return (
        type(proj).__name__ == "Conv1D"
        and isinstance(weight, Tensor)
        and weight.dim() == 2
        and getattr(proj, "nf", None) == weight.shape[1]
    )


def projection(module: nn.Module, path: str) -> tuple[Tensor, Tensor | None]:
    """The ``(out, in)`` weight and the bias of a projection (a Linear-like module, a
    ``Conv1D``, or a bare 2-D parameter) at ``path`` in ``module``."""
    obj = resolve(module, path)
    if isinstance(obj, Tensor):
        return obj, None
    weight = getattr(obj, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(
            f"`{path}` of {type(module).__name__} is not a projection with a 2-D weight"
        )
    bias = getattr(obj, "bias", None)
    bias = bias if isinstance(bias, Tensor) else None
    return (weight.T, bias) if is_conv1d(obj) else (weight, bias)


def _weight_param(module: nn.Module, path: str) -> Tensor:
    obj = resolve(module, path)
    return obj if isinstance(obj, Tensor) else obj.weight


def out_features(module: nn.Module, path: str) -> int | None:
    obj = resolve(module, path)
    weight = getattr(obj, "weight", None) if isinstance(obj, nn.Module) else None
    if not isinstance(weight, Tensor) or isinstance(obj, (nn.Embedding, nn.MultiheadAttention)):
        return None
    shape = stated_shape(weight)  # a partitioned parameter's whole shape
    if len(shape) == 2:
        return shape[1] if is_conv1d(obj) else shape[0]
    return None
