r"""Row statistics of explicit attention: the entropy of each row of a probability matrix, its
normalized form, and every :class:`~qkmonitor.kernels.AttentionStats` field from explicit
pre-softmax scores (the float64-checkable references of the kernel's statistics).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["attention_entropy", "attention_stats_from_scores", "normalized_entropy"]


def normalized_entropy(entropy: Tensor, attended: Tensor) -> Tensor:
    r"""Row entropy over its largest possible value: ``H_i / log(n_i)``, in [0, 1].

    ``n_i`` is the number of keys row i may attend; a row with ``n_i <= 1`` has no spread to
    measure and gives NaN (aggregates leave it out).

    Args:
        entropy: (...) row entropies ``H_i``, in nats.
        attended: (...) the keys each row may attend, a floating tensor of the same shape.

    Returns:
        (...), in the dtype of ``entropy / attended``.

    Example:
        >>> normalized_entropy(torch.tensor([2.0, 0.0]).log(), torch.tensor([4.0, 1.0]))
        tensor([0.5000,    nan])
    """
    return torch.where(
        attended > 1, entropy / attended.log(), torch.full_like(entropy, float("nan"))
    )


def attention_entropy(probs: Tensor, normalize: bool = False, mask: Tensor | None = None) -> Tensor:
    r"""Entropy of each row of an explicit attention matrix, in nats.

    ``H_i = -Σ_j p_ij log p_ij`` with ``0 log 0 = 0``. With ``normalize``, ``H_i / log(n_i)`` where
    ``n_i`` is the row length, or the number of allowed keys when ``mask`` is given; rows with
    ``n_i <= 1`` have no spread to measure and give NaN (aggregates leave them out).

    Args:
        probs: (..., N, M), rows summing to 1 over their allowed keys.
        normalize: divide by ``log(n_i)``.
        mask: optional (..., N, M) or broadcastable bool, True where row i may attend key j.
            Probability outside the mask is ignored.

    Returns:
        (..., N), in the dtype of ``probs`` (float32 at least).

    Example:
        >>> attention_entropy(torch.tensor([[0.5, 0.5], [1.0, 0.0]]), normalize=True)
        tensor([1., 0.])
    """
    if not torch.is_floating_point(probs):
        raise ValueError(f"Expected floating-point `probs`, got dtype {probs.dtype}")
    p = probs if probs.dtype == torch.float64 else probs.float()
    allowed = (
        torch.ones_like(p, dtype=torch.bool) if mask is None else mask.to(torch.bool).expand_as(p)
    )
    plogp = torch.where(~allowed | (p == 0), 0.0, p * p.log())  # NaN stays NaN
    entropy = 0.0 - plogp.sum(dim=-1)
    if not normalize:
        return entropy
    return normalized_entropy(entropy, allowed.sum(dim=-1).to(p.dtype))


def attention_stats_from_scores(scores: Tensor, mask: Tensor | None = None, sink_tokens: int = 0):
    r"""Per-row :class:`~qkmonitor.kernels.AttentionStats` from explicit pre-softmax scores.

    The explicit counterpart of ``kernels.attention(..., return_stats=True)``, for attention whose
    mask the kernel does not take (arbitrary ``attn_mask``): ``lse_i = log Σ_j e^{s_ij}``,
    ``entropy_i = -Σ_j p_ij log p_ij``, ``max_prob_i``, ``max_logit_i = max_j s_ij``,
    ``attended_i`` over the allowed keys: those ``mask`` allows whose score is not ``-inf``.
    Fully masked rows give ``lse = max_logit = -inf`` and zeros elsewhere. Non-finite scores on
    allowed keys follow the kernel's contract: a NaN makes the row's statistics NaN; otherwise a
    ``+inf`` gives ``lse = max_logit = +inf`` and NaN entropy, max_prob and sink mass. (A NaN that
    a ``-inf`` bias was added to stays NaN: pass ``mask`` to mask it out.)

    Args:
        scores: (B, H, N, M) scaled logits; ``-inf`` marks a key that may not be attended.
        mask: optional bool, broadcastable to ``scores``, True where the key may be attended.
        sink_tokens: also report the mass on the first ``sink_tokens`` keys.

    Returns:
        AttentionStats with detached float32 (B, H, N) fields (computed in float64).
    """
    from qkmonitor.kernels import AttentionStats

    s = scores.detach().double()
    allowed = s != float("-inf")
    if mask is not None:
        allowed = allowed & mask.to(torch.bool).expand_as(s)
    s = s.masked_fill(~allowed, float("-inf"))
    has_nan = s.isnan().any(dim=-1)
    has_inf = torch.isposinf(s).any(dim=-1) & ~has_nan
    broken = has_nan | has_inf
    s = s.masked_fill(broken[..., None], float("-inf"))  # computed as empty, overwritten below
    lse = torch.logsumexp(s, dim=-1)
    live = lse != float("-inf")
    p = torch.where(live[..., None], (s - torch.where(live, lse, 0.0)[..., None]).exp(), 0.0)
    plogp = torch.where(p > 0, p * p.log(), 0.0)

    def mark(x: Tensor, inf_value: float = float("nan")) -> Tensor:
        return torch.where(has_nan, float("nan"), torch.where(has_inf, inf_value, x)).float()

    return AttentionStats(
        lse=mark(lse, float("inf")),
        entropy=mark((0.0 - plogp.sum(-1)).clamp_min(0.0)),
        max_prob=mark(p.amax(dim=-1)),
        max_logit=mark(s.amax(dim=-1), float("inf")),
        attended=allowed.sum(-1).float(),
        sink_mass=mark(p[..., :sink_tokens].sum(-1)) if sink_tokens > 0 else None,
    )
