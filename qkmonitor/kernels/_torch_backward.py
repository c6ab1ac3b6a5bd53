"""The torch backend's backward (FlashAttention-2, recomputing each key block; the algorithm:
:mod:`qkmonitor.kernels._torch`) and the autograd function that pairs it with the blockwise
forward.
"""

from __future__ import annotations

import torch

from qkmonitor.kernels._autocast import autocast_off
from qkmonitor.kernels._blocks import (
    NEG_INF,
    allowed_pairs,
    compute_dtype,
    first_row_seeing,
    grouped,
)
from qkmonitor.kernels._torch_forward import forward_blocks

__all__ = ["BlockwiseAttention", "backward_blocks"]


class BlockwiseAttention(torch.autograd.Function):
    """Autograd wrapper: blockwise forward with statistics, blockwise FlashAttention-2 backward."""

    @staticmethod
    def forward(
        ctx, q, k, v, key_padding_mask, causal, scale, sink_tokens, stats, block_size, rounding=None
    ):
        out, lse, entropy, max_prob, max_logit, sink = forward_blocks(
            q, k, v, key_padding_mask, causal, scale, sink_tokens, stats, block_size, rounding
        )
        out = out.to(q.dtype)
        # Empty rows get lse = +inf in the backward so that p = e^{s − lse} = 0 there.
        lse_bwd = torch.where(torch.isneginf(lse), float("inf"), lse)
        ctx.save_for_backward(q, k, v, out, lse_bwd, key_padding_mask)
        ctx.causal, ctx.scale, ctx.block_size = causal, scale, block_size
        ctx.rounds = rounding is not None
        ctx.mark_non_differentiable(
            *(x for x in (lse, entropy, max_prob, max_logit, sink) if x is not None)
        )
        return out, lse, entropy, max_prob, max_logit, sink

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, *_stat_grads):
        q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
        # The backward may run under the caller's autocast (loss.backward() inside the context).
        with autocast_off(q.device.type):
            dq, dk, dv = backward_blocks(
                q, k, v, out, lse, dout, key_padding_mask, ctx.causal, ctx.scale, ctx.block_size,
                ctx.rounds,
            )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None, None


def backward_blocks(
    q, k, v, out, lse, dout, key_padding_mask, causal, scale, block_size, rounds=False
):
    """Gradients of q, k, v from recomputed blocks; ``lse`` is +inf on fully masked rows. With
    ``rounds``, ``p`` (for dV) and ``dS`` (for dQ, dK) are rounded to the inputs' dtype before
    their products, as the GPU kernel's dots take them."""
    kv_heads, m_keys = k.shape[1], k.shape[2]
    n = q.shape[2]
    diag = m_keys - n
    cd = compute_dtype(q.dtype)
    q_g = grouped(q, kv_heads).to(cd) * scale  # (B, H_kv, G, N, D)
    do_g = grouped(dout, kv_heads).to(cd)
    delta = (do_g * grouped(out, kv_heads).to(cd)).sum(dim=-1, keepdim=True)  # (B, H_kv, G, N, 1)
    lse_g = grouped(lse, kv_heads).to(cd)[..., None]  # (B, H_kv, G, N, 1)
    dq = torch.zeros_like(q_g)
    dk = torch.zeros(k.shape, dtype=cd, device=k.device)
    dv = torch.zeros(v.shape, dtype=cd, device=v.device)
    rows = torch.arange(n, device=q.device)
    for start in range(0, m_keys, block_size):
        stop = min(start + block_size, m_keys)
        r0 = first_row_seeing(start, diag, causal)
        if r0 >= n:
            break
        k_blk = k[:, :, None, start:stop].to(cd)  # (B, H_kv, 1, bn, D)
        v_blk = v[:, :, None, start:stop].to(cd)
        q_r, do_r = q_g[..., r0:, :], do_g[..., r0:, :]
        s = q_r @ k_blk.transpose(-1, -2)  # (B, H_kv, G, N − r0, bn)
        allowed = allowed_pairs(rows[r0:], start, stop, diag, causal, key_padding_mask)
        if allowed is not None:
            s.masked_fill_(~allowed, NEG_INF)
        p = torch.exp_(s - lse_g[..., r0:, :])
        p_dv = p.to(v.dtype).to(cd) if rounds else p
        dv[:, :, start:stop] = (p_dv.transpose(-1, -2) @ do_r).sum(dim=2)
        ds = (do_r @ v_blk.transpose(-1, -2)).sub_(delta[..., r0:, :]).mul_(p)
        if rounds:
            ds = ds.to(q.dtype).to(cd)
        dq[..., r0:, :] += ds @ k_blk
        dk[:, :, start:stop] = (ds.transpose(-1, -2) @ q_r).sum(dim=2)
    dq = (dq * scale).reshape(q.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
