"""What the torch backend's forward and backward share: the key blocks' masks and rows, the
floored exponential of shifted scores, and the rows' statistics from their running sums.

The exponential: shifted scores at or below about −79 count as probability 0 (below the rounding
of a row sum that is at least 1), computed as the exponential of the scores clamped at −80, then a
threshold, which keeps the CPU exponential off its slow path on subnormals.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "EXP_FLOOR",
    "LOG2E",
    "NEG_INF",
    "ZERO_AT_OR_BELOW",
    "allowed_pairs",
    "compute_dtype",
    "exp2_shifted_",
    "exp_shifted_",
    "first_row_seeing",
    "grouped",
    "row_stats",
]

NEG_INF = float("-inf")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, N, D) → (B, H_kv, G, N, D): head h = g_kv · G + g shares key/value head g_kv."""
    b, h, n = x.shape[:3]
    return x.reshape(b, kv_heads, h // kv_heads, n, *x.shape[3:])


def allowed_pairs(
    rows: torch.Tensor,
    start: int,
    stop: int,
    diag: int,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
) -> torch.Tensor | None:
    """Which (query, key) pairs of query ``rows`` and keys ``start:stop`` may be attended,
    broadcastable to (B, H_kv, G, rows, stop − start); None when all may. ``diag = M − N``."""
    allowed = None
    if causal:
        cols = torch.arange(start, stop, device=rows.device)
        allowed = cols[None, :] <= rows[:, None] + diag  # (rows, bn)
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, None, None, start:stop]  # (B, 1, 1, 1, bn)
        allowed = pad if allowed is None else allowed & pad
    return allowed


def first_row_seeing(start: int, diag: int, causal: bool) -> int:
    """First query row that may attend key ``start`` or later (rows above see none of them)."""
    return max(0, start - diag) if causal else 0


#: Shifted scores at or below about this are probability 0: e^-79 < 6e-35 is below the rounding of
#: a row sum that is at least 1 (its largest term is e^0), in float32 and float64 alike.
EXP_FLOOR = -80.0


ZERO_AT_OR_BELOW = math.exp(EXP_FLOOR + 1.0)  # a normal float32, above e^-80's rounding


#: log2(e): scores times this are in powers of 2, whose exponential (``exp2``) the CPU computes
#: about 3x faster than ``exp`` (as accurately: within an ulp of float32)
LOG2E = 1.0 / math.log(2.0)


def exp_shifted_(s: torch.Tensor) -> torch.Tensor:
    """``e^s`` of shifted scores (all <= 0, −inf where masked; NaN stays NaN), in place, 0 where
    ``e^s`` is at most e^-79 (below :data:`EXP_FLOOR` + 1): :func:`exp2_shifted_` of
    ``s · log2(e)``."""
    return exp2_shifted_(s.mul_(LOG2E))


def exp2_shifted_(s: torch.Tensor) -> torch.Tensor:
    """``2^s`` of shifted scores in powers of 2 (all <= 0, −inf where masked; NaN stays NaN), in
    place, 0 where ``2^s`` is at most e^-79.

    The same numbers to rounding, without the slow path of the CPU exponential on results that
    underflow into subnormals (about 40x slower per element; sharp attention has many) or on −inf:
    the exponential of the scores clamped at the floor, then a threshold.
    """
    return torch.threshold_(s.clamp_(min=EXP_FLOOR * LOG2E).exp2_(), ZERO_AT_OR_BELOW, 0.0)


def row_stats(m, l, u, sink, heads):
    """(lse, entropy, max_prob, max_logit, sink_mass) as float32 (B, H, N) from the running max
    ``m``, ``l = Σ e^{s−m}``, ``u = Σ e^{s−m}(s − m)`` and the sink sum, each (B, H_kv, G, N)."""
    # l = 0: no key (fully masked row); l = NaN: a NaN score; l = +inf: a +inf score; else finite.
    batch, n = m.shape[0], m.shape[-1]
    empty = l == 0
    l_safe = torch.where(empty, 1.0, l)
    log_l = torch.log(l_safe)
    lse = torch.where(empty, NEG_INF, m + log_l)  # NaN and +inf rows: NaN, +inf
    healthy = l < float("inf")  # False for NaN and +inf rows; True for empty rows

    def finish(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch, heads, n).to(torch.float32)

    def row_stat(value: torch.Tensor, empty_value: float) -> torch.Tensor:
        return torch.where(healthy, torch.where(empty, empty_value, value), float("nan"))

    entropy = row_stat((log_l - u / l_safe).clamp(min=0.0), 0.0)
    max_prob = row_stat(1.0 / l_safe, 0.0)
    sink_mass = None if sink is None else finish(row_stat(sink / l_safe, 0.0))
    max_logit = torch.where(l.isnan(), float("nan"), m)  # −inf on empty rows, +inf on +inf rows
    return finish(lse), finish(entropy), finish(max_prob), finish(max_logit), sink_mass
