"""QK-Clip (Kimi Team 2025, arXiv 2507.20534): after an optimizer step, shrink the query and key
projections of every head whose largest attention logit exceeded a bound ``tau``.

For head h, let ``S_h = max_{b,i,j} s_hij`` be its largest scaled logit over a step's forwards
(``s = scale · q·k``, the score the softmax sees). QK-Clip scales the head's logits by

    γ_h = min(1, τ / S_h),

so that the same inputs would give ``max s_h <= τ``. A logit is bilinear in the head's query and
key projections, biases included (``q = W_q x + b_q``); RoPE rotates q and k after the projections,
a linear map that commutes with a scalar. Scaling head h's query rows (weight and bias) by ``a`` and
its key head's rows by ``b`` therefore scales every logit of head h by exactly ``a · b``, and this
module makes ``a · b = γ_h``:

- each key head serves one query head (multi-head attention): ``a = b = √γ_h``, the paper's split:
  the two projections shrink alike;
- a key head serves several query heads (GQA, MQA): ``a = γ_h``, ``b = 1``. Shrinking the shared
  key head would shrink the logits of every head of its group, healthy ones included; on the
  queries alone, the group's other heads stay untouched, bit for bit.

Heads with ``γ_h = 1`` are never written. Layers with QK-norm are not clipped: their q and k are
normalized after the projections, so scaling W_Q and W_K does not change their logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from qkmonitor.measures.sharding import partitioned
from qkmonitor.validation import check_real

__all__ = [
    "LatentQKRows",
    "ProjectionRows",
    "QKRows",
    "clip_factors",
    "head_max_logits",
    "linear_rows",
]


def clip_factors(max_logits: Tensor, tau: float) -> Tensor:
    """``γ_h = min(1, τ / S_h)`` per head, float64; 1 where ``S_h`` is not finite.

    A non-finite ``S_h`` (a NaN or infinite logit) gives no factor to scale by: that head is left
    alone and its caller warns.

    Args:
        max_logits: ``(H,)`` the largest scaled logit of each head.
        tau: the bound, > 0, in the layer's scaled-logit units.
    """
    check_real("tau", tau, above=0.0)
    s = max_logits.detach().to(torch.float64)
    clipped = torch.isfinite(s) & (s > tau)
    return torch.where(clipped, tau / torch.where(clipped, s, 1.0), 1.0)


def head_max_logits(per_call: list[Tensor], num_heads: int) -> Tensor:
    """``(H,)`` float64: each head's largest scaled logit over the calls of a probe window.

    Args:
        per_call: each observed call's ``(B, H)`` largest logits (``ProbeResult.max_logits``;
            ``-inf`` for a sequence whose rows may attend no key, which takes no part).
        num_heads: H; ``-inf`` for every head when there is no call.
    """
    out = torch.full((num_heads,), -math.inf, dtype=torch.float64)
    for call in per_call:
        if call.shape[0] == 0:  # an empty batch
            continue
        per_head = call.detach().to(torch.float64).amax(dim=0).cpu()
        out = torch.maximum(out, per_head)  # NaN propagates: a NaN score is reported, not hidden
    return out


@dataclass(frozen=True)
class ProjectionRows:
    """Where each head of one projection lives: head h is ``weight[rows[h]]`` and ``bias[rows[h]]``.

    Attributes:
        weight: ``(out, in)`` view on the parameter (``nn.Linear`` layout; a transposed view of a
            ``Conv1D``'s weight), written through in place.
        bias: ``(out,)`` view on the bias, or None.
        rows: ``(heads, d_k)`` int64 row indices of each head.
        gradient: where ``weight`` is not the parameter's own view (a tensor-parallel rank's
            local rows), reads the gradient of the same rows; None: the parameter's ``.grad``
            seen through ``weight``.
    """

    weight: Tensor
    bias: Tensor | None
    rows: Tensor
    gradient: Callable[[], Tensor | None] | None = field(default=None, compare=False)

    def scale(self, factors: Tensor) -> None:
        """Multiply head h's rows (weight and bias) by ``factors[h]`` in place; heads with factor 1
        are not written."""
        changed = (factors != 1).nonzero().flatten()
        if changed.numel() == 0:
            return
        rows = self.rows[changed]  # (c, d_k)
        flat = rows.flatten()
        per_row = factors[changed].to(torch.float64).repeat_interleave(rows.shape[1])  # (c * d_k,)
        with torch.no_grad():
            for tensor in (self.weight, self.bias):
                if tensor is None:
                    continue
                local, start = local_rows(tensor)
                mine = (flat >= start) & (flat < start + local.shape[0])
                index = (flat[mine] - start).to(local.device)
                f = per_row[mine].to(local.device).view(-1, *([1] * (local.dim() - 1)))
                local[index] = (local[index].to(torch.float64) * f).to(local.dtype)


def local_rows(tensor: Tensor) -> tuple[Tensor, int]:
    """The rows of ``tensor`` this process holds, to write in place, and the global index of the
    first: all of a plain tensor (from 0); a DTensor's local shard, for one mesh dimension
    sharded along the rows (``Shard(0)``, FSDP2's parameters: ``torch.chunk``'s split) or
    replicated.

    Raises:
        ValueError: another layout (sharded along the columns, several mesh dimensions).
    """
    held = partitioned(tensor)
    if held is not None:  # a copy gathered by its owner would be written in vain
        raise ValueError(f"{held}: its rows are not written")
    if not callable(getattr(tensor, "to_local", None)):
        return tensor, 0
    placements = tuple(tensor.placements)
    local = tensor.to_local()
    if len(placements) == 1 and placements[0].is_replicate():
        return local, 0
    if len(placements) != 1 or not placements[0].is_shard(0):
        raise ValueError(
            f"Expected a weight sharded along its rows (Shard(0)) or replicated on one mesh "
            f"dimension, got placements {placements}"
        )
    mesh = tensor.device_mesh
    chunk = -(-tensor.shape[0] // mesh.size())  # torch.chunk: ceil(rows / ranks) a rank
    start = min(mesh.get_local_rank() * chunk, tensor.shape[0])
    if local.shape[0] != min(chunk, tensor.shape[0] - start):
        raise ValueError(
            f"Expected the local shard of rows {start}.. to hold "
            f"{min(chunk, tensor.shape[0] - start)} rows, got {local.shape[0]}"
        )
    return local, start


@dataclass(frozen=True)
class QKRows:
    """A layer's query and key projections by head, for scaling its logits (QK-Clip).

    Attributes:
        q: the query projection's rows, ``H`` heads.
        k: the key projection's rows, ``H_kv`` heads.
        kv_index: the key head of each query head (length H).
        qk_norm: the layer normalizes q and k after the projections (scaling does nothing).
    """

    q: ProjectionRows
    k: ProjectionRows
    kv_index: tuple[int, ...]
    qk_norm: bool = False

    @property
    def num_heads(self) -> int:
        return self.q.rows.shape[0]

    def split(self, gamma: Tensor) -> tuple[Tensor, Tensor]:
        """``(query factors (H,), key factors (H_kv,))`` whose products are ``gamma`` per head:
        ``√γ`` on both where each key head serves one query head, else ``γ`` on the queries."""
        kv_heads = self.k.rows.shape[0]
        one_to_one = sorted(self.kv_index) == list(range(kv_heads)) == list(range(self.num_heads))
        if not one_to_one:
            return gamma, torch.ones(kv_heads, dtype=gamma.dtype)
        root = gamma.sqrt()
        k = torch.ones(kv_heads, dtype=gamma.dtype)
        k[list(self.kv_index)] = root
        return root, k

    def scale_logits(self, gamma: Tensor) -> None:
        """Scale head h's logits by ``gamma[h]`` (``(H,)``, in ``(0, 1]``) in place."""
        if gamma.shape != (self.num_heads,):
            raise ValueError(
                f"Expected `gamma` of shape ({self.num_heads},), got {tuple(gamma.shape)}"
            )
        q, k = self.split(gamma.to(torch.float64))
        self.q.scale(q)
        self.k.scale(k)


@dataclass(frozen=True)
class LatentQKRows(QKRows):
    """The head-specific rows of multi-head latent attention (:mod:`.latent`), scaled as Kimi K2's
    QK-Clip scales them (Kimi Team 2025, the model it was made for).

    Head h's logit is ``q_C^h·k_C^h + q_R^h·k_R``: its non-rotary query and key, both its own, and
    its rotary query against the rotary key **shared** by every head. Scaling q_C^h and k_C^h by
    ``√γ_h`` and q_R^h by ``γ_h`` scales both terms, hence the logit, by ``γ_h``, and leaves k_R,
    and with it every other head, untouched.

    Attributes:
        q: each head's query rows (``d_n + d_r``, the rotary ``d_r`` last).
        k: each head's non-rotary key rows (``d_n``, in the key/value up projection).
        rope_dim: d_r.
    """

    rope_dim: int = 0

    def scale_logits(self, gamma: Tensor) -> None:
        if gamma.shape != (self.num_heads,):
            raise ValueError(
                f"Expected `gamma` of shape ({self.num_heads},), got {tuple(gamma.shape)}"
            )
        gamma = gamma.to(torch.float64)
        r = self.rope_dim
        nope = ProjectionRows(
            self.q.weight, self.q.bias, self.q.rows[:, : self.q.rows.shape[1] - r]
        )
        rope = ProjectionRows(
            self.q.weight, self.q.bias, self.q.rows[:, self.q.rows.shape[1] - r :]
        )
        nope.scale(gamma.sqrt())
        rope.scale(gamma)
        self.k.scale(gamma.sqrt())


def linear_rows(
    q: nn.Module, k: nn.Module, heads: int, kv_heads: int, qk_norm: bool = False
) -> QKRows:
    """The :class:`QKRows` of separate ``nn.Linear`` query and key projections whose output
    features are the heads in order, ``H_kv`` dividing ``H``, query head h reading key head
    ``h // (H / H_kv)`` (grouped-query attention; multi-head attention when ``H_kv = H``)."""
    head_dim = q.weight.shape[0] // heads
    group = heads // kv_heads
    return QKRows(
        ProjectionRows(q.weight, q.bias, torch.arange(heads * head_dim).view(heads, head_dim)),
        ProjectionRows(
            k.weight, k.bias, torch.arange(kv_heads * head_dim).view(kv_heads, head_dim)
        ),
        tuple(h // group for h in range(heads)),
        qk_norm,
    )
