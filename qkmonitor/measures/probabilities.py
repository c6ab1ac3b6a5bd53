r"""Explicit attention probabilities: a softmax that leaves fully masked rows at zero, and the
attention matrix ``softmax(scale · q kᵀ + bias)`` (the reference path the kernels are checked
against).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkmonitor.kernels._blocks import exp_shifted_

__all__ = ["attention_probs", "masked_softmax", "masked_softmax_"]


def masked_softmax(scores: Tensor, dim: int = -1, mask: Tensor | None = None) -> Tensor:
    r"""Softmax that subtracts the row maximum and gives an all-zero row where nothing is allowed.

    ``p_j = e^{x_j - m} / Σ_{k∈A} e^{x_k - m}`` for ``j ∈ A`` (``m`` the maximum over A), 0
    elsewhere; a row with A empty (all masked or all ``-inf``) is all zeros, never NaN. A row with
    a NaN or ``+inf`` score in A is all NaN (softmax itself would give a partly NaN row).
    float16/bfloat16 are computed in float32 and cast back.

    Args:
        scores: logits, any shape.
        dim: the dimension to normalize over.
        mask: optional bool (or 0/1), broadcastable to ``scores``, True where allowed.

    Example:
        >>> masked_softmax(
        ...     torch.tensor([[1e4, 1e4], [0.0, 0.0]]),
        ...     mask=torch.tensor([[True, True], [False, False]]),
        ... )
        tensor([[0.5000, 0.5000],
                [0.0000, 0.0000]])
    """
    work = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores.clone()
    return masked_softmax_(work, dim, mask).to(scores.dtype)


def masked_softmax_(work: Tensor, dim: int = -1, mask: Tensor | None = None) -> Tensor:
    r""":func:`masked_softmax` of a float32/float64 tensor, in place (the probability slices of
    :meth:`qkmonitor.attention.calls.MaskedCall.probs`, in the scores' own memory: no new buffer a
    pass).

    A probability at most e^-79 times the row's largest is 0 (below the rounding of a sum that is
    at least 1; the exponential takes the CPU's slow path on underflow, :func:`exp_shifted_`).
    """
    if mask is not None:
        work.masked_fill_(~mask.to(torch.bool), float("-inf"))
    row_max = work.amax(dim=dim, keepdim=True)  # NaN if a NaN is allowed, +inf if a +inf is
    broken = row_max.isnan() | torch.isposinf(row_max)
    row_max = row_max.masked_fill(~torch.isfinite(row_max), 0.0)  # empty row: exp(-inf - 0) = 0
    p = exp_shifted_(work.sub_(row_max))
    total = p.sum(dim=dim, keepdim=True)
    p.div_(torch.where(total > 0, total, torch.ones_like(total)))
    return p.masked_fill_(broken, float("nan"))


def attention_probs(
    q: Tensor,
    k: Tensor,
    *,
    scale: float | Tensor,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    r"""The explicit attention matrix ``A = softmax(scale · q kᵀ + bias)`` — the reference path.

    Args:
        q: (B, H, N, D); k: (B, H_kv, M, D) with H_kv dividing H (query head h reads key head
            ``h // (H / H_kv)``).
        scale: float, or a tensor broadcastable to (B, H, N, 1) (a temperature per row).
        causal: bottom-right aligned causal mask (row i sees keys ``j ≤ i + M − N``).
        key_padding_mask: (B, M) bool, True where a key may be attended.
        bias: optional additive bias broadcastable to (B, H, N, M) (``-inf`` blocks).

    Returns:
        (B, H, N, M) probabilities in float32 or better; fully masked rows are zeros.
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k = q.to(dtype), k.to(dtype)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * (scale.to(dtype) if isinstance(scale, Tensor) else scale)
    if bias is not None:
        scores = scores + bias.to(dtype)
    n, m = scores.shape[-2:]
    allowed = torch.ones(n, m, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril(diagonal=m - n)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(torch.bool)[:, None, None, :]
    return masked_softmax(scores, mask=allowed)
