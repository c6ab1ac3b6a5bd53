"""The torch backend's forward over key blocks, with the rows' statistics (the algorithm:
:mod:`qkmonitor.kernels._torch`), and the statistics alone when every row sees one block of all
its keys: the same sums without the online rescaling, over parts that fit the CPU's caches.
"""

from __future__ import annotations

import math

import torch

from qkmonitor.kernels._blocks import (
    EXP_FLOOR,
    LOG2E,
    NEG_INF,
    ZERO_AT_OR_BELOW,
    allowed_pairs,
    compute_dtype,
    exp_shifted_,
    first_row_seeing,
    grouped,
    row_stats,
)

__all__ = ["forward_blocks", "one_block_stats"]


def forward_blocks(
    q, k, v, key_padding_mask, causal, scale, sink_tokens, stats, block_size, rounding=None,
    output=True,
):  # fmt: skip
    """The online forward; returns out in the compute dtype (None unless ``output``) and float32
    (B, H, N) statistics (all None but lse when ``stats`` is False); ``rounding``: the weights'
    (``AttentionOptions.weight_rounding``)."""
    batch, heads, n, _ = q.shape
    kv_heads, m_keys = k.shape[1], k.shape[2]
    diag = m_keys - n
    cd = compute_dtype(q.dtype)
    q_g = grouped(q, kv_heads).to(cd) * scale  # (B, H_kv, G, N, D)
    if stats and not output and 0 < m_keys <= block_size and first_row_seeing(0, diag, causal) == 0:
        return None, *one_block_stats(q_g, k, key_padding_mask, causal, sink_tokens, heads)
    row_shape = q_g.shape[:-1]
    m = torch.full(row_shape, NEG_INF, dtype=cd, device=q.device)
    l = torch.zeros(row_shape, dtype=cd, device=q.device)
    acc = torch.zeros(row_shape + (v.shape[-1],), dtype=cd, device=q.device) if output else None
    u = torch.zeros_like(l) if stats else None
    sink = torch.zeros_like(l) if stats and sink_tokens > 0 else None
    rows = torch.arange(n, device=q.device)
    largest = torch.finfo(cd).max
    lowest = -largest
    for start in range(0, m_keys, block_size):
        stop = min(start + block_size, m_keys)
        r0 = first_row_seeing(start, diag, causal)  # causal: rows above r0 see none of these keys
        if r0 >= n:
            break
        k_blk = k[:, :, None, start:stop].to(cd)  # (B, H_kv, 1, bn, D)
        s = q_g[..., r0:, :] @ k_blk.transpose(-1, -2)  # (B, H_kv, G, N − r0, bn)
        allowed = allowed_pairs(rows[r0:], start, stop, diag, causal, key_padding_mask)
        if allowed is not None:
            s.masked_fill_(~allowed, NEG_INF)
        m_old, l_old = m[..., r0:], l[..., r0:]
        m_new = torch.maximum(m_old, s.amax(dim=-1))
        # A finite shift: −inf (no key yet) would give −inf − (−inf), and +inf (an infinite score)
        # ∞ − ∞; clamped, masked keys stay at e^{−inf} = 0 and an infinite score makes l = +inf.
        m_safe = m_new.clamp(-largest, largest)
        s -= m_safe[..., None]  # s − m', −inf where masked
        p, p_v = _weights(exp_shifted_(s.clone()), rounding)
        alpha = torch.exp(m_old - m_safe)
        if stats:
            shift = torch.where(l_old > 0, m_old - m_safe, 0.0) * l_old  # no (−inf)·0
            s.clamp_(min=lowest).mul_(p)  # p·(s − m'), 0 (not 0·(−inf)) at masked keys
            u[..., r0:] = alpha * (u[..., r0:] + shift) + s.sum(dim=-1)
            if sink is not None:
                sink[..., r0:] = alpha * sink[..., r0:] + p[..., : max(0, sink_tokens - start)].sum(
                    -1
                )
        l[..., r0:] = alpha * l_old + p.sum(dim=-1)
        if acc is not None:
            v_blk = v[:, :, None, start:stop].to(cd)
            acc[..., r0:, :] = alpha[..., None] * acc[..., r0:, :] + p_v @ v_blk
        m[..., r0:] = m_new
    l_safe = torch.where(l == 0, 1.0, l)
    out = None if acc is None else (acc / l_safe[..., None]).reshape(batch, heads, n, v.shape[-1])
    if not stats:
        lse = torch.where(l == 0, NEG_INF, m + torch.log(l_safe))
        return out, lse.reshape(batch, heads, n).to(torch.float32), None, None, None, None
    return out, *row_stats(m, l, u, sink, heads)


def _weights(p: torch.Tensor, rounding) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights for the sums and for ``P·V``: ``p`` for both (no rounding); the rounded ``p``
    for ``P·V`` alone ("kernel"); the rounded ``p`` for both ("unbiased")."""
    if rounding is None:
        return p, p
    dtype, unbiased = rounding
    rounded = p.to(dtype).to(p.dtype)
    return (rounded if unbiased else p), rounded


#: The most scores :func:`_one_block_sums` holds at once (2 MiB in float32): its ten passes over
#: them then run in the CPU's caches, not through memory (twice as fast on 8 × 8 heads × 256²).
_SCORES_PER_PART = 2**19


#: Causal statistics in one block: the query rows are cut into up to this many runs (one per
#: :data:`_SCORES_PER_PART` scores of the whole), and a run's scores stop at its last row's
#: diagonal, so that with 8 runs 1 + 2 + ... + 8 eighths of the square, 56 %, are computed instead
#: of all of it (the keys past a run's diagonal are masked for all its rows).
_CAUSAL_ROW_RUNS = 8


def one_block_stats(q_g, k, key_padding_mask, causal, sink_tokens, heads):
    """The statistics of :func:`forward_blocks` when every row sees one block of all the keys
    it may attend: the same sums without the online rescaling (``q_g`` scaled,
    (B, H_kv, G, N, D)), computed over parts (:func:`_one_block_sums`) and turned into statistics
    once; the same numbers as from the whole at once (to the rounding of a row's sums over fewer
    terms, where a run leaves masked keys out).

    Causal rows in :data:`_CAUSAL_ROW_RUNS` runs, each against the keys up to its last row's
    diagonal (the others are masked for every row of the run: they add nothing to the sums); on
    the CPU each run over parts of the batch of at most :data:`_SCORES_PER_PART` scores (at least
    one sequence), so that the passes over them run in the caches. Every part works in the same
    two buffers (:class:`_Scratch`): no memory is allocated, or first touched, per part."""
    batch, n, m_keys = q_g.shape[0], q_g.shape[-2], k.shape[2]
    k = k.to(q_g.dtype).contiguous()  # once: every part's keys are then a view, not a copy
    q_g = q_g * LOG2E  # scores in powers of 2 (exp2): m and u back in e's powers at the end
    sums = [torch.empty(q_g.shape[:-1], dtype=q_g.dtype, device=q_g.device) for _ in range(3)]
    sink = torch.empty_like(sums[0]) if sink_tokens > 0 else None
    # as many runs as parts of the whole (a small call is one run: each costs a few dispatches)
    runs = min(_CAUSAL_ROW_RUNS, q_g.shape[:-1].numel() * m_keys // _SCORES_PER_PART)
    run = max(1, -(-n // runs) if causal and runs > 1 else n)
    scratch = _Scratch(q_g.dtype, q_g.device)
    for r0 in reversed(range(0, n, run)):  # the last run's parts, the largest, first
        r1 = min(n, r0 + run)
        keys = min(m_keys, r1 + m_keys - n) if causal else m_keys
        per_sequence = q_g.shape[1:3].numel() * (r1 - r0) * keys  # H_kv · G · rows · keys
        size = max(1, _SCORES_PER_PART // max(per_sequence, 1))
        if q_g.device.type != "cpu":
            size = batch
        for b in range(0, batch, size):
            part = _one_block_sums(
                q_g[b : b + size, ..., r0:r1, :],
                k[b : b + size, :, :keys],
                None if key_padding_mask is None else key_padding_mask[b : b + size, :keys],
                causal,
                sink_tokens,
                first_row=r0,
                diag=m_keys - n,
                scratch=scratch,
            )
            for out, value in zip((*sums, sink), part):
                if out is not None:
                    out[b : b + size, ..., r0:r1] = value
    m, l, u = sums
    return row_stats(m.mul_(math.log(2.0)), l, u.mul_(math.log(2.0)), sink, heads)


class _Scratch:
    """Two flat work buffers, the scores and their exponentials, grown to the largest part asked
    for and reused by the next (a new buffer per part costs its allocation and first touch: about
    as much as the passes over it)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def views(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        count = math.prod(shape)
        if self._buffers is None or self._buffers[0].numel() < count:
            self._buffers = tuple(
                torch.empty(count, dtype=self.dtype, device=self.device) for _ in range(2)
            )
        return tuple(b[:count].view(shape) for b in self._buffers)


def _one_block_sums(q_g, k, key_padding_mask, causal, sink_tokens, first_row, diag, scratch=None):
    """``(m, l, u, sink)`` for rows ``first_row ..`` of ``q_g`` ((B, H_kv, G, rows, D), scaled
    by the softmax scale and log2(e), so that the scores ``s`` are in powers of 2) against all of
    ``k``'s keys at once, in a sequence whose causal diagonal is ``diag = M − N``: ``m`` the row
    max, ``l = Σ 2^{s−m}`` (the e-powers' sum), ``u = Σ 2^{s−m}(s − m)`` (log2(e) times the
    e-powers' ``u`` of :func:`forward_blocks`), ``sink`` the first ``sink_tokens`` keys' share
    of ``l`` (None for 0), each (B, H_kv, G, rows). The scores and exponentials live in
    ``scratch``'s buffers (new ones when None).

    Passes over the (rows, M) scores: the product, the mask (only the columns past the first
    row's diagonal without padding), the max, the shift and floor (``s − m`` at least
    :data:`EXP_FLOOR` · log2(e): a key below it has probability 0, so its term is 0 either way),
    the exponential and its threshold (:func:`exp2_shifted_`), and the sums."""
    batch, kv_heads, groups, rows, depth = q_g.shape
    m_keys = k.shape[2]
    s, p = (scratch or _Scratch(q_g.dtype, q_g.device)).views(
        (batch, kv_heads, groups, rows, m_keys)
    )
    torch.bmm(  # a query head's rows of one key head side by side: (B·H_kv, G·rows, M)
        q_g.reshape(batch * kv_heads, groups * rows, depth),
        k.to(q_g.dtype).reshape(batch * kv_heads, m_keys, depth).transpose(1, 2),  # a view
        out=s.view(batch * kv_heads, groups * rows, m_keys),
    )
    # causal without padding: the keys up to the first row's diagonal are every row's
    first_masked = max(0, first_row + diag + 1) if key_padding_mask is None else 0
    allowed = allowed_pairs(
        torch.arange(first_row, first_row + rows, device=q_g.device),
        first_masked,
        m_keys,
        diag,
        causal,
        key_padding_mask,
    )
    if allowed is not None and first_masked < m_keys:
        s[..., first_masked:].masked_fill_(~allowed, NEG_INF)
    largest = torch.finfo(s.dtype).max
    m = s.amax(dim=-1)
    s.sub_(m.clamp(-largest, largest)[..., None])  # a finite shift
    torch.exp2(s.clamp_(min=EXP_FLOOR * LOG2E), out=p)  # floored: as exp2_shifted_, s kept
    torch.threshold_(p, ZERO_AT_OR_BELOW, 0.0)
    sink = p[..., :sink_tokens].sum(-1) if sink_tokens > 0 else None
    l = p.sum(dim=-1)
    return m, l, s.mul_(p).sum(dim=-1), sink  # u = Σ p·(s − m): 0 where p is 0
