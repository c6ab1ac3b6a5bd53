"""Attention in plain PyTorch, exact, over key blocks: the any-device (CPU) backend.

Forward. For each block of at most ``block_size`` keys, the scores ``s = scale · q kᵀ`` of that
block update a running row max ``m``, ``l = Σ_j e^{s_j − m}``, the output accumulator
``acc = Σ_j e^{s_j − m} v_j`` and, for the statistics, the centered sum
``u = Σ_j e^{s_j − m}(s_j − m)``. When the max grows from ``m`` to ``m'`` every running sum is
rescaled by ``α = e^{m − m'}``, and ``u`` also absorbs the shift:
``u ← α(u + (m − m')·l) + Σ_j e^{s_j − m'}(s_j − m')``. At the end

    out = acc / l,   lse = m + log l,   H = log l − u / l,   max_prob = 1 / l,   max_logit = m.

The shift is ``m`` clamped to ±FLT_MAX, so that a row with no key yet (m = −inf) and an infinite
score (m = +inf) raise no ``−inf − (−inf)`` or ``∞ − ∞``. Then ``l`` tells each row's state at the
end: 0 no key (fully masked), NaN a NaN score, +inf a +inf score, finite otherwise; the statistics
follow ``attention``'s contract for each.

Backward (FlashAttention-2, recomputing each block): with ``p = e^{s − lse}``,
``δ_i = Σ_d dO_id O_id`` and ``dS = p ⊙ (dO vᵀ − δ)``, ``dV = pᵀ dO``, ``dQ = scale · dS k``,
``dK = scale · dSᵀ q``. Grouped-query heads are handled by viewing q as (B, H_kv, G, N, D) and
broadcasting each key/value block over G, so the repeated keys and values are never formed (at
most one block's broadcast, O(G·block·D), inside a matmul). With ``causal``, query rows that see
none of a key block's keys are skipped, which halves the work.

Rounding (``options.pv_rounding`` for 2-byte inputs, docs/kernel.md): "kernel" rounds ``p`` to the
values' dtype for ``p @ v`` alone (float32 sums, as the GPU kernel's ``tl.dot``); "unbiased" rounds
``p`` once after the exponential and uses the rounded weights for ``l``, ``u`` and ``acc`` alike.
Both round the backward's ``p`` (for dV) and ``dS`` (for dQ, dK) to the inputs' dtype, as the
GPU kernel's dots do.

Memory is O(B·H·N·block_size) in both directions instead of O(B·H·N·M). Where no row can be fully
masked, ``F.scaled_dot_product_attention`` gives the output instead: without statistics, alone;
with statistics, SDPA gives the output (and its gradient) while the blockwise forward runs under
``no_grad`` for the statistics only, whether or not a gradient is taken. The output then never
depends on ``return_stats`` or the grad mode: a probed step computes the same output and gradients
as an unprobed one, also when a reentrant checkpoint runs the forward under ``no_grad`` and again
with grad in the backward, and skips the blockwise backward (several times slower than SDPA's on
CPU). Where SDPA is not exact, the blockwise forward gives the output with or without statistics
(the statistics only add sums beside it).

The blockwise forward and its one-block statistics are :mod:`qkmonitor.kernels._torch_forward`, the
backward and the autograd function :mod:`qkmonitor.kernels._torch_backward`, what both use (masks,
the floored exponential, the rows' statistics) :mod:`qkmonitor.kernels._blocks`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qkmonitor.kernels._blocks import NEG_INF, allowed_pairs, compute_dtype, grouped
from qkmonitor.kernels._options import AttentionOptions
from qkmonitor.kernels._torch_backward import BlockwiseAttention
from qkmonitor.kernels._torch_forward import forward_blocks

__all__ = ["max_logits", "torch_attention"]


DEFAULT_BLOCK_SIZE = 256


#: With statistics, SDPA for the output (and its gradient) where it is exact, as without them
#: (tests turn it off to exercise the blockwise forward and backward).
SDPA_WITH_STATS = True


_SDPA_HAS_GQA = torch.__version__ >= "2.5"  # `enable_gqa` appeared in torch 2.5


def torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: AttentionOptions,
    *,
    block_size: int | None = None,
    output: bool = True,
) -> tuple[torch.Tensor | None, tuple[torch.Tensor | None, ...] | None]:
    """Softmax attention with optional per-row statistics; inputs already validated.

    Args:
        q: (B, H, N, D) queries.
        k: (B, H_kv, M, D) keys, H_kv dividing H.
        v: (B, H_kv, M, D) values.
        options: the call's options (mask, causal rule, scale, statistics, sink keys).
        block_size: keys per block of the online computation; None reads ``DEFAULT_BLOCK_SIZE``
            (at call time, so that tests can shrink it to exercise many blocks).
        output: False (with ``return_stats`` and no gradient needed): the statistics alone, out
            None.

    Returns:
        ``out`` (B, H, N, D) in q's dtype, and either None or the detached float32 (B, H, N)
        tensors ``(lse, entropy, max_prob, max_logit, sink_mass)``, ``sink_mass`` None when
        ``sink_tokens == 0``.
    """
    block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    mask, return_stats = options.key_padding_mask, options.return_stats
    rows = (q, k, v, mask, options.causal, options.scale, options.sink_tokens)
    if return_stats and not output and not needs_grad:
        return None, _statistics(*rows, block_size)
    # The weights' rounding before P·V: SDPA's own (as "kernel" on CPU and CUDA) only for "auto";
    # an explicit choice for 2-byte inputs runs blockwise ("auto" blockwise: float32, exact).
    rounding = options.weight_rounding(v.dtype, auto="float32")
    low_precision = v.dtype in (torch.float16, torch.bfloat16)
    sdpa_rounds_alike = options.pv_rounding == "auto" or not low_precision
    # The output comes from where an unprobed call takes it, with or without a gradient to take
    # (a reentrant checkpoint's first forward runs under no_grad and is recomputed with grad).
    exact = sdpa_rounds_alike and _sdpa_is_exact(q, k, options.causal, mask)
    if (not return_stats or SDPA_WITH_STATS) and exact:
        out = _sdpa(q, k, v, options)
        if not return_stats:
            return out, None
        with torch.no_grad():
            return out, _statistics(*rows, block_size)
    out, *stats = BlockwiseAttention.apply(*rows, return_stats, block_size, rounding)
    return out, _returned_stats(*stats, options.sink_tokens) if return_stats else None


def _statistics(q, k, v, key_padding_mask, causal, scale, sink_tokens, block_size):
    """The rows' statistics from the blockwise forward, without its output."""
    _, *stats = forward_blocks(
        q, k, v, key_padding_mask, causal, scale, sink_tokens, True, block_size, output=False
    )
    return _returned_stats(*stats, sink_tokens)


def _returned_stats(lse, entropy, max_prob, max_logit, sink, sink_tokens):
    """``(lse, entropy, max_prob, max_logit, sink_mass)``, ``sink_mass`` None for no sink keys."""
    return lse, entropy, max_prob, max_logit, sink if sink_tokens > 0 else None


#: :func:`max_logits`: score elements per block of query rows (16 MiB in float32)
MAX_LOGIT_BLOCK = 1 << 22


def max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    scale: float,
    block_elements: int | None = None,
) -> torch.Tensor:
    r"""Each head's largest scaled logit, ``max_{i, j allowed} scale · q_i · k_j``, alone.

    QK-Clip's input without the softmax: the scores of a block of query rows against every key,
    masked and reduced to their maximum, one block at a time, so that no (N, M) matrix of a whole
    sequence is held. The scores are those of the statistics' forward (the same products in the
    same dtype), so the result equals ``AttentionStats.max_logit`` reduced over rows. Inputs
    already validated, as :func:`torch_attention`'s.

    Args:
        q: (B, H, N, D) queries; k: (B, H_kv, M, D) keys, H_kv dividing H.
        causal, key_padding_mask, scale: as :func:`torch_attention`.
        block_elements: scores per block (B · H · rows · M); None reads :data:`MAX_LOGIT_BLOCK`.

    Returns:
        (B, H) in float32 (float64 for float64 inputs): ``-inf`` for a head whose rows may attend
        no key, NaN where a score is NaN.
    """
    block_elements = MAX_LOGIT_BLOCK if block_elements is None else block_elements
    batch, heads, n, _ = q.shape
    kv_heads, m_keys = k.shape[1], k.shape[2]
    cd = compute_dtype(q.dtype)
    q_g = grouped(q, kv_heads).to(cd) * scale  # (B, H_kv, G, N, D)
    keys = k[:, :, None].to(cd).transpose(-1, -2)  # (B, H_kv, 1, D, M)
    best = torch.full((batch, kv_heads, heads // kv_heads), NEG_INF, dtype=cd, device=q.device)
    if n == 0 or m_keys == 0:
        return best.reshape(batch, heads)
    step = max(1, block_elements // max(1, batch * heads * m_keys))
    rows = torch.arange(n, device=q.device)
    for r0 in range(0, n, step):
        s = q_g[..., r0 : r0 + step, :] @ keys  # (B, H_kv, G, rows, M)
        allowed = allowed_pairs(
            rows[r0 : r0 + step], 0, m_keys, m_keys - n, causal, key_padding_mask
        )
        if allowed is not None:
            s.masked_fill_(~allowed, NEG_INF)  # in place: one block of scores held at a time
        best = torch.maximum(best, s.amax(dim=(-2, -1)))
    return best.reshape(batch, heads)


def _sdpa_is_exact(
    q: torch.Tensor, k: torch.Tensor, causal: bool, key_padding_mask: torch.Tensor | None
) -> bool:
    """Whether SDPA gives our semantics: no fully masked row (SDPA makes those NaN), causal only
    when N == M (SDPA aligns the causal mask top-left), and GQA only where SDPA supports it."""
    if q.shape[1] != k.shape[1] and not _SDPA_HAS_GQA:
        return False
    if causal:
        return key_padding_mask is None and q.shape[2] == k.shape[2]
    if key_padding_mask is None:
        return k.shape[2] > 0
    return bool(key_padding_mask.any(dim=-1).all())


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions
) -> torch.Tensor:
    mask = options.key_padding_mask
    attn_mask = None if mask is None else mask[:, None, None, :]
    kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=options.causal, scale=options.scale, **kwargs
    )
