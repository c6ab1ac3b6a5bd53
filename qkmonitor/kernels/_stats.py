"""Per-row statistics of the attention distribution, from ``attention(..., return_stats=True)``.

For query row i with scaled scores ``s_ij = scale · q_i · k_j`` over the keys ``j ∈ A_i`` the row
may attend (key padding and the causal rule decide ``A_i``) and probabilities
``p_ij = exp(s_ij − lse_i)``:

- ``lse_i = log Σ_{j∈A_i} exp(s_ij)``;
- ``entropy_i = −Σ_j p_ij log p_ij`` in nats;
- ``max_prob_i = max_j p_ij``, ``max_logit_i = max_j s_ij``;
- ``attended_i = |A_i|``;
- ``sink_mass_i = Σ_{j∈A_i, j<sink_tokens} p_ij``.

A row with ``A_i`` empty (all its keys padded, or causal with N > M) has ``lse = max_logit = −inf``
and ``entropy = max_prob = sink_mass = attended = 0``. A row whose allowed scores hold a NaN has
NaN statistics (``attended`` still counts its keys); a +inf score gives ``lse = max_logit = +inf``
and NaN for the probability statistics (``attention``'s docstring has the rules).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionStats", "attended_keys"]


@dataclass(frozen=True)
class AttentionStats:
    """Detached float32 statistics of each query row, every field of shape (B, H, N).

    Attributes:
        lse: ``log Σ_j exp(s_ij)`` over the allowed keys; ``−inf`` for a fully masked row, NaN
            for a row with a NaN score, ``+inf`` for one with a +inf score.
        entropy: ``−Σ_j p_ij log p_ij`` in nats, in ``[0, log attended]``; 0 for a fully masked row,
            NaN for a row with a NaN or +inf score.
        max_prob: ``max_j p_ij`` in ``[1/attended, 1]``; 0 for a fully masked row, NaN for a row
            with a NaN or +inf score.
        max_logit: ``max_j s_ij``, the largest scaled score (after ``scale``); ``−inf`` for a fully
            masked row, NaN for a row with a NaN score, ``+inf`` for one with a +inf score.
        attended: number of keys the row may attend (key padding and the causal rule applied), as
            float32 holding exact integers, so that ``entropy / attended.log()`` needs no cast.
        sink_mass: ``Σ_{j < sink_tokens} p_ij``, the mass on the first ``sink_tokens`` keys, or
            ``None`` when ``sink_tokens == 0``; 0 for a fully masked row, NaN for a row with a NaN
            or +inf score.
    """

    lse: torch.Tensor
    entropy: torch.Tensor
    max_prob: torch.Tensor
    max_logit: torch.Tensor
    attended: torch.Tensor
    sink_mass: torch.Tensor | None = None


def attended_keys(
    batch: int,
    heads: int,
    num_queries: int,
    num_keys: int,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """Number of keys each query row may attend, ``|A_i|``, without forming the N×M mask.

    With causal bottom-right alignment query i may attend key j when ``j ≤ i + M − N``; with a key
    padding mask only keys where it is True count. The count is a prefix sum of the padding mask
    read at ``min(i + M − N, M − 1)`` (0 when ``i + M − N < 0``).

    Args:
        batch: B.
        heads: H, the number of query heads (the count does not depend on the head).
        num_queries: N.
        num_keys: M.
        causal: whether the causal rule applies.
        key_padding_mask: (B, M) bool, True where the key may be attended, or None.
        device: where to put the result.

    Returns:
        (B, H, N) float32 counts.
    """
    rows = torch.arange(num_queries, device=device)
    if key_padding_mask is None:
        if causal:
            counts = (rows + (num_keys - num_queries + 1)).clamp(0, num_keys)
        else:
            counts = torch.full((num_queries,), num_keys, device=device)
        counts = counts.to(torch.float32).expand(batch, heads, num_queries)
        return counts.contiguous()
    if num_keys == 0:
        return torch.zeros(batch, heads, num_queries, dtype=torch.float32, device=device)
    prefix = key_padding_mask.to(device=device, dtype=torch.int64).cumsum(dim=-1)  # (B, M)
    if causal:
        last = rows + (num_keys - num_queries)  # last key index row i may attend
        counts = prefix[:, last.clamp(0, num_keys - 1)] * (last >= 0)  # (B, N)
    else:
        counts = prefix[:, -1:].expand(batch, num_queries)
    return counts.to(torch.float32)[:, None, :].expand(batch, heads, num_queries).contiguous()
