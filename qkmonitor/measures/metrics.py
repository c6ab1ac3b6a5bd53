r"""torchmetrics aggregators: per-head attention statistics reduced over rows, batches and ranks.

:class:`AttentionStatistics` takes the per-row :class:`~qkmonitor.kernels.AttentionStats` of one
layer and keeps sums, so that ``compute()`` gives exact means over every row of every rank (the
states reduce with ``sum`` / ``max`` across processes). Per head h, over rows i with ``n_i ≥ 1``
allowed keys (fully masked rows are left out of everything):

.. math::

    \mathrm{entropy}_h = \frac{1}{R_h}\sum_i H_i, \qquad
    \mathrm{entropy\_norm}_h = \frac{1}{R'_h}\sum_{i: n_i > 1} \frac{H_i}{\log n_i}, \qquad
    \mathrm{max\_prob}_h = \frac{1}{R_h}\sum_i \max_j p_{ij}, \qquad
    \mathrm{max\_logit}_h = \max_i \max_j s_{ij},

with ``R_h`` the rows counted and ``R'_h`` those with more than one key. ``sink_mass`` is the mean
mass on the first ``k`` keys, when the kernel was asked for it. A row with NaN statistics (its
scores held a NaN) is not skipped: it makes its head's values NaN until the next reset, so that
a numerical failure shows as NaN rather than as a mean over the rows that survived; a +inf score
gives that head ``max_logit = +inf`` and NaN means.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

from qkmonitor.kernels import AttentionStats
from qkmonitor.measures.entropies import normalized_entropy
from qkmonitor.measures.sharding import (
    HeadPlacement,
    collective_device,
    distributed,
    pack_heads,
    unpack_heads,
)
from qkmonitor.validation import check_positive_int

__all__ = ["AttentionStatistics", "HeadMean", "OutputLogits", "logit_sums", "reduce_across_ranks"]


class _PerHeadMetric(Metric):
    """A metric with one slot per head; subclasses add their states, reduced across processes by
    ``sum``, except those named in :attr:`max_states`."""

    #: the states reduced by ``max`` across processes (:func:`reduce_across_ranks`)
    max_states: tuple[str, ...] = ()
    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    def __init__(self, num_heads: int, **kwargs) -> None:
        super().__init__(**kwargs)
        check_positive_int("num_heads", num_heads)
        self.num_heads = num_heads


class AttentionStatistics(_PerHeadMetric):
    """Per-head means of attention entropy, normalized entropy, max probability (and sink mass),
    and the largest logit, over all rows seen since the last reset.

    Args:
        num_heads: H of the layer.
    """

    max_states = ("max_logit",)

    def __init__(self, num_heads: int, **kwargs) -> None:
        super().__init__(num_heads, **kwargs)
        zeros = torch.zeros(num_heads, dtype=torch.float64)
        for name in (
            "entropy_sum",
            "entropy_norm_sum",
            "max_prob_sum",
            "sink_mass_sum",
            "rows",
            "norm_rows",
            "sink_rows",
        ):
            self.add_state(name, default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state(
            "max_logit",
            default=torch.full((num_heads,), float("-inf"), dtype=torch.float64),
            dist_reduce_fx="max",
        )

    def update(self, stats: AttentionStats, heads: slice | None = None) -> None:
        """Add the rows of one forward: every field (B, H, N).

        ``heads``: the slots the H heads go to (a range of width H); all of them by default. One
        aggregator so holds several layers side by side (one ``compute`` and ``reset`` a probe for
        all of them)."""
        target = slice(0, self.num_heads) if heads is None else heads
        width = len(range(self.num_heads)[target])
        if stats.entropy.dim() != 3 or stats.entropy.shape[1] != width:
            raise ValueError(
                f"Expected statistics of shape (B, {width}, N), got {tuple(stats.entropy.shape)}"
            )
        if stats.entropy.numel() == 0:  # an empty batch (0 sequences or 0 tokens): no row to add
            return
        n = stats.attended.double()
        live = n >= 1  # fully masked rows are left out of every aggregate
        spread = n > 1  # entropy_norm is undefined for a single key
        entropy = stats.entropy.double()
        columns = [
            entropy,
            stats.max_prob.double(),
            torch.ones_like(n),
            normalized_entropy(entropy, n),  # NaN where n <= 1, rows left out by `spread`
            spread.double(),
        ]
        if stats.sink_mass is not None:
            columns += [stats.sink_mass.double(), torch.ones_like(n)]
        keep = torch.stack([live, live, live, spread, live] + [live] * (len(columns) - 5))
        sums = torch.where(keep, torch.stack(columns), 0.0).sum(
            dim=(1, 3)
        )  # (fields, H): one reduction
        self.entropy_sum[target] += sums[0]
        self.max_prob_sum[target] += sums[1]
        self.rows[target] += sums[2]
        self.entropy_norm_sum[target] += sums[3]
        self.norm_rows[target] += sums[4]
        if stats.sink_mass is not None:
            self.sink_mass_sum[target] += sums[5]
            self.sink_rows[target] += sums[6]
        logits = torch.where(live, stats.max_logit.double(), float("-inf"))
        self.max_logit[target] = torch.maximum(self.max_logit[target], logits.amax(dim=(0, 2)))

    def compute(self) -> dict[str, Tensor]:
        """Per-head (H,) float64 values; NaN where no row contributed or a row was NaN. Also
        ``rows`` and ``norm_rows``, the rows counted (all, and those with more than one key): a
        value with none is undefined, not broken."""
        out = {
            "rows": self.rows.clone(),
            "norm_rows": self.norm_rows.clone(),
            "entropy": self.entropy_sum / self.rows,
            "entropy_norm": self.entropy_norm_sum / self.norm_rows,
            "max_prob": self.max_prob_sum / self.rows,
            "max_logit": torch.where(self.rows > 0, self.max_logit, float("nan")),
            # NaN where no row had sink keys (no value read here: the host reads none)
            "sink_mass": self.sink_mass_sum / self.sink_rows,
        }
        return out


class HeadMean(_PerHeadMetric):
    """Mean of per-sample values for each of ``num_heads`` slots, over samples, batches and ranks.

    A NaN sample makes its slot NaN (a broken value is never averaged away); samples that have no
    value by definition are left out through ``keep``. A slot with no sample computes to NaN.

    Args:
        num_heads: number of slots (heads, or 1 for a per-layer value).
    """

    def __init__(self, num_heads: int, **kwargs) -> None:
        super().__init__(num_heads, **kwargs)
        self.add_state(
            "total", default=torch.zeros(num_heads, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "count", default=torch.zeros(num_heads, dtype=torch.float64), dist_reduce_fx="sum"
        )

    def update(
        self, values: Tensor, keep: Tensor | None = None, columns: slice | None = None
    ) -> None:
        """``values``: (S, width) samples, or (width,) for one; ``keep``: same shape, bool.

        ``columns``: the slots updated (a range of width ``width``); all of them by default. One
        metric can so hold several quantities side by side (fewer metrics to update, compute and
        reset at every probe).
        """
        target = slice(0, self.num_heads) if columns is None else columns
        width = len(range(self.num_heads)[target])
        values = values.detach().double().reshape(-1, width)
        keep = (
            torch.ones_like(values, dtype=torch.bool)
            if keep is None
            else keep.reshape(values.shape)
        )
        self.total[target] += torch.where(keep, values, 0.0).sum(0)
        self.count[target] += keep.sum(0).double()

    def compute(self) -> Tensor:
        return self.total / self.count


class OutputLogits(_PerHeadMetric):
    r"""The model's output logits over every position of a probe window: with
    :math:`z_i = \log \sum_v e^{x_{iv}}` the log-partition of position i (the quantity the z-loss
    of PaLM and Wortsman et al. 2023 keeps near 0),

    .. math::

        \mathrm{output\_lse\_rms} = \sqrt{\tfrac{1}{P} \sum_i z_i^2}, \qquad
        \mathrm{output\_logit\_max} = \max_{i, v} |x_{iv}|,

    over the P positions seen since the last reset (one slot: the run's, not a head's)."""

    max_states = ("logit_max",)

    def __init__(self, **kwargs) -> None:
        super().__init__(1, **kwargs)
        self.add_state(
            "lse_square_sum", default=torch.zeros(1, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "positions", default=torch.zeros(1, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "logit_max", default=torch.full((1,), float("-inf"), dtype=torch.float64),
            dist_reduce_fx="max",
        )  # fmt: skip

    def update(self, logits: Tensor) -> None:
        """Add one forward's logits, (..., V) (:func:`logit_sums`)."""
        self.add(*logit_sums(logits))

    def add(self, lse_square_sum: Tensor, positions: Tensor, logit_max: Tensor) -> None:
        """Add sums already taken (:func:`logit_sums`), e.g. of several forwards."""
        device = self.positions.device
        self.lse_square_sum += lse_square_sum.to(device)
        self.positions += positions.to(device)
        self.logit_max = torch.maximum(self.logit_max, logit_max.to(device))

    def compute(self) -> dict[str, Tensor]:
        return self.values()

    def values(self) -> dict[str, Tensor]:
        """:meth:`compute` from the states as they are (reduced by the caller), without
        torchmetrics' own wrapping."""
        seen = self.positions > 0
        nan = torch.full_like(self.positions, float("nan"))
        return {
            "output_lse_rms": torch.where(seen, (self.lse_square_sum / self.positions).sqrt(), nan),
            "output_logit_max": torch.where(seen, self.logit_max, nan),
        }


def logit_sums(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(Σ z_i², positions, max |x|)`` of logits (..., V), each a float64 (1,) tensor on their
    device: z_i the log-partition over the last dim, in float32 or better (no autograd). NaN or
    Inf in the logits carry into the sums.

    Logits that are a DTensor (a tensor-parallel model's output) are read by their local part: the
    positions this rank holds (a split over the positions adds up across ranks, as under DDP), and
    where the vocabulary is split across ranks (``ColwiseParallel`` on the vocabulary projection
    with loss parallelism: ``Shard(-1)``), each position's log-partition combined from the ranks'
    parts, ``z = log Σ_r exp(z_r)``, in one ``all_gather`` over that mesh dim (every rank of it
    computes the same forward) — never the whole logits on one rank.

    The positions are read in parts of at most :data:`LOGITS_PER_PART` logits (a position at
    least), so that no temporary (the float32 copy of half-precision logits, the shifted values
    and their exponentials) is larger than a part: the hook runs right after the model's output,
    where a step's memory peaks, and the whole logits' temporaries would be several times their
    size (a 128k vocabulary at 32k positions: 16 GiB each in float32)."""
    x = logits.detach()
    vocab_group = None
    if callable(getattr(x, "to_local", None)):
        vocab_group = _vocab_split(x)
        x = x.to_local()
    if x.numel() == 0:
        zero = torch.zeros(1, dtype=torch.float64, device=x.device)
        return zero, zero.clone(), torch.full_like(zero, float("-inf"))
    lse_parts, largest = [], None
    for part in _position_parts(x, max(1, LOGITS_PER_PART // x.shape[-1])):
        part = part.float() if part.dtype in (torch.float16, torch.bfloat16) else part
        lse_parts.append(torch.logsumexp(part, dim=-1).double())
        big = torch.maximum(part.amax(), part.amin().neg())  # max |x|, no copy
        largest = big if largest is None else torch.maximum(largest, big)
    lse = lse_parts[0] if len(lse_parts) == 1 else torch.cat(lse_parts)
    largest = largest.double().reshape(1)
    if vocab_group is not None:
        lse, largest = _combine_vocabulary(lse, largest, vocab_group)
    return (
        lse.square().sum().reshape(1),
        torch.full((1,), float(lse.numel()), dtype=torch.float64, device=x.device),
        largest,
    )


#: The most logits :func:`logit_sums` reads at once (64 MiB in float32): each part costs a few
#: dispatches, so parts as small as the CPU's caches would cost more than they save (a 50k
#: vocabulary at 8k positions would be 4,000 parts of two positions).
LOGITS_PER_PART = 2**24


def _position_parts(x: Tensor, positions: int) -> list[Tensor]:
    """``x`` (..., V) as 2-D views (P, V) of at most ``positions`` rows each, in order: slices of
    its rows where they are one strided block, else the parts of each ``x[i]`` (a slice of
    positions, such as ``logits[:, -k:]``), never a copy."""
    try:
        rows = x.view(-1, x.shape[-1])
    except RuntimeError:  # not one block of rows: each leading index apart
        return [part for inner in x.unbind(0) for part in _position_parts(inner, positions)]
    return list(rows.split(positions))


def _vocab_split(x: Tensor):
    """The process group over which a DTensor's last dim is split, None where it is not.

    Raises:
        ValueError: where it is split over several mesh dims."""
    dims = [
        i
        for i, p in enumerate(x.placements)
        if p.is_shard() and p.dim % x.dim() == x.dim() - 1 and x.device_mesh.size(i) > 1
    ]
    if len(dims) > 1:
        raise ValueError(f"logits split along the vocabulary over several mesh dims {dims}")
    return x.device_mesh.get_group(dims[0]) if dims else None


def _combine_vocabulary(lse: Tensor, largest: Tensor, group) -> tuple[Tensor, Tensor]:
    """Each position's log-partition, and the largest |logit|, over the parts of the vocabulary
    the ranks of ``group`` hold (their ``lse`` and ``largest``): one ``all_gather``."""
    flat = torch.cat([lse.reshape(-1), largest])
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, flat, group=group)
    stacked = torch.stack(parts)  # (ranks, positions + 1)
    return torch.logsumexp(stacked[:, :-1], dim=0), stacked[:, -1:].amax(0)


def reduce_across_ranks(
    metrics: Sequence[_PerHeadMetric],
    heads: Sequence[tuple[HeadPlacement, Sequence[Tensor]]] = (),
) -> list[list[Tensor]]:
    """Reduce the states of ``metrics`` over the processes in place, all of them in one
    collective: each process's states side by side in one float64 vector, one ``all_gather``, then
    per state the sum over processes (the max for :attr:`~_PerHeadMetric.max_states`). Build such
    metrics with ``sync_on_compute=False``: ``compute()`` then reads the reduced states, where
    torchmetrics' own sync would gather each state apart (two collectives a state). Nothing is done
    without an initialised process group of more than one process. Every process must call it
    with the same metrics, of the same sizes.

    ``heads``: the per-head values of layers whose heads are split across ranks (tensor
    parallelism), in the same collective (:func:`~qkmonitor.measures.sharding.gather_heads`).

    Returns:
        ``heads`` merged: per layer, its tensors of every head.
    """
    if not distributed() or not (metrics or heads):
        return unpack_heads(heads, pack_heads(heads)[None])
    world = dist.get_world_size()
    states = [(m, name) for m in metrics for name in m.metric_state]
    device = getattr(metrics[0], states[0][1]).device if states else collective_device()
    packed = pack_heads(heads).to(device)
    flat = torch.cat(
        [*(getattr(m, name).reshape(-1).to(device, torch.float64) for m, name in states), packed]
    )
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    stacked = torch.stack(gathered)  # (world, every state's slots, then the heads)
    start = 0
    for m, name in states:
        state = getattr(m, name)
        part = stacked[:, start : start + state.numel()]
        start += state.numel()
        reduced = part.amax(0) if name in m.max_states else part.sum(0)
        setattr(m, name, reduced.reshape(state.shape).to(state.device, state.dtype))
    return unpack_heads(heads, stacked[:, start:].cpu())
