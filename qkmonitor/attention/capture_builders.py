"""The calls a capture hands on, built from what the module called: an SDPA call and a
``flex_attention`` call as each defines its scores (:class:`~qkmonitor.attention.calls.MaskedCall`),
the logits handed to a softmax (:class:`~qkmonitor.attention.calls.ScoresCall`); leading dims
before the heads (windows) folded into the batch."""

from __future__ import annotations

import torch
from torch import Tensor

from qkmonitor.attention.calls import (
    MASK_FLOOR,
    MaskedCall,
    ScoresCall,
    block_mask_allowed,
    split_mask,
)


def fold(x: Tensor) -> Tensor:
    """(..., H, N, D) -> (B', H, N, D): leading dims before the heads folded into the batch (timm
    Twins' windows are independent attention problems)."""
    return x.reshape(-1, *x.shape[-3:]) if x.dim() > 4 else x


def folded(x: Tensor) -> tuple[int, ...]:
    """The shape :func:`fold` gives ``x``, without folding it."""
    return (x.shape[:-3].numel(), *x.shape[-3:]) if x.dim() > 4 else tuple(x.shape)


def sdpa_call(q: Tensor, k: Tensor, attn_mask, is_causal: bool, scale) -> MaskedCall:
    """The statistics of one SDPA call as SDPA defines it (``is_causal`` top-left aligned); leading
    dims before the heads (windows) are folded into the batch."""
    n, m = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    if attn_mask is not None and q.dim() > 4:
        attn_mask = attn_mask.detach()
        mask_heads = attn_mask.shape[-3] if attn_mask.dim() >= 3 else 1
        attn_mask = attn_mask.expand(*lead, mask_heads, n, m).reshape(-1, mask_heads, n, m)
    if q.dim() > 4:
        q = q.detach().expand(*lead, *q.shape[-3:]).reshape(-1, *q.shape[-3:])
        k = k.detach().expand(*lead, *k.shape[-3:]).reshape(-1, *k.shape[-3:])
    call = MaskedCall(q.detach(), k.detach(), scale, False, None, None, None)
    allowed = bias = None
    if attn_mask is not None:
        mask = attn_mask.detach()
        while mask.dim() < 4:
            mask = mask[None]
        allowed, bias = split_mask(mask)  # additive: entries at or below MASK_FLOOR are blocked
    if is_causal:
        if n == m and allowed is None:
            call.causal = True
        else:
            causal = torch.ones(n, m, dtype=torch.bool, device=q.device).tril()[None, None]
            allowed = causal if allowed is None else allowed & causal
    call.allowed, call.bias = allowed, bias
    if allowed is not None:
        call.reduce()
    return call


def flex_call(q: Tensor, k: Tensor, score_mod, block_mask, scale) -> MaskedCall:
    """The statistics of one flex_attention call as flex defines it: ``score_mod`` on the scaled
    scores, the block mask's blocks and ``mask_mod``; GQA keys read by query head h // (H/H_kv)."""
    n, m = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    call = MaskedCall(q.detach(), k.detach(), scale, False, None, None, None, score_mod=score_mod)
    if block_mask is not None:
        call.allowed = block_mask_allowed(block_mask, q.shape[0], q.shape[1], n, m)
        if score_mod is None:
            call.reduce()
    return call


def scores_call(logits: Tensor, masked: Tensor | None = None) -> tuple[ScoresCall, float | None]:
    """The logits a module hands its softmax: the keys an observed additive mask blocks
    (``masked``) and ``finfo.min``-like entries are blocked; any other entry is a key. Also the
    lowest finite logit at or below :data:`MASK_FLOOR` that no observed mask explains (a mask the
    capture could not see, or a very sharp head), or None."""
    scores = logits.detach()
    scores = scores.double() if scores.dtype == torch.float64 else scores.float()
    blocked = logits.detach() <= torch.finfo(logits.dtype).min / 2
    if masked is not None:
        blocked = blocked | masked
    unexplained = (scores <= MASK_FLOOR) & ~blocked & torch.isfinite(scores)
    lowest = float(scores[unexplained].min()) if bool(unexplained.any()) else None
    return ScoresCall(scores.masked_fill(blocked, float("-inf"))), lowest
