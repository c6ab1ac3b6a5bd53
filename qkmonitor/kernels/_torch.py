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

Memory is O(B·H·N·block_size) in both directions instead of O(B·H·N·M). Where no row can be fully
masked, ``F.scaled_dot_product_attention`` gives the output instead: without statistics, alone;
with statistics, SDPA gives the output (and its gradient) while the blockwise forward runs under
``no_grad`` for the statistics only, whether or not a gradient is taken. The output then never
depends on ``return_stats`` or the grad mode: a probed step computes the same output and gradients
as an unprobed one, also when a reentrant checkpoint runs the forward under ``no_grad`` and again
with grad in the backward, and skips the blockwise backward (several times slower than SDPA's on
CPU). Where SDPA is not exact, the blockwise forward gives the output with or without statistics
(the statistics only add sums beside it).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

__all__ = ["autocast_off", "max_logits", "torch_attention"]

DEFAULT_BLOCK_SIZE = 256
#: With statistics, SDPA for the output (and its gradient) where it is exact, as without them
#: (tests turn it off to exercise the blockwise forward and backward).
SDPA_WITH_STATS = True
_SDPA_HAS_GQA = torch.__version__ >= "2.5"  # `enable_gqa` appeared in torch 2.5
_NEG_INF = float("-inf")


def torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    scale: float,
    return_stats: bool,
    sink_tokens: int,
    block_size: int | None = None,
    output: bool = True,
) -> tuple[torch.Tensor | None, tuple[torch.Tensor | None, ...] | None]:
    """Softmax attention with optional per-row statistics; inputs already validated.

    Args:
        q: (B, H, N, D) queries.
        k: (B, H_kv, M, D) keys, H_kv dividing H.
        v: (B, H_kv, M, D) values.
        causal: query i attends key j only when ``j ≤ i + M − N`` (bottom-right aligned).
        key_padding_mask: (B, M) bool, True where the key may be attended, or None.
        scale: the factor on ``q · k``.
        return_stats: also compute the statistics.
        sink_tokens: number of leading keys whose attention mass is reported (0 for none).
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
    if return_stats and not output and not needs_grad:
        _, lse, entropy, max_prob, max_logit, sink = _forward_blocks(
            q, k, v, key_padding_mask, causal, scale, sink_tokens, True, block_size, output=False
        )
        return None, (lse, entropy, max_prob, max_logit, sink if sink_tokens > 0 else None)
    # The output comes from where an unprobed call takes it, with or without a gradient to take
    # (a reentrant checkpoint's first forward runs under no_grad and is recomputed with grad).
    if (not return_stats or SDPA_WITH_STATS) and _sdpa_is_exact(q, k, causal, key_padding_mask):
        out = _sdpa(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
        if not return_stats:
            return out, None
        with torch.no_grad():
            _, lse, entropy, max_prob, max_logit, sink = _forward_blocks(
                q,
                k,
                v,
                key_padding_mask,
                causal,
                scale,
                sink_tokens,
                True,
                block_size,
                output=False,
            )
        return out, (lse, entropy, max_prob, max_logit, sink if sink_tokens > 0 else None)
    out, lse, entropy, max_prob, max_logit, sink = _BlockwiseAttention.apply(
        q, k, v, key_padding_mask, causal, scale, sink_tokens, return_stats, block_size
    )
    if not return_stats:
        return out, None
    return out, (lse, entropy, max_prob, max_logit, sink if sink_tokens > 0 else None)


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
    cd = _compute_dtype(q.dtype)
    q_g = _grouped(q, kv_heads).to(cd) * scale  # (B, H_kv, G, N, D)
    keys = k[:, :, None].to(cd).transpose(-1, -2)  # (B, H_kv, 1, D, M)
    best = torch.full((batch, kv_heads, heads // kv_heads), _NEG_INF, dtype=cd, device=q.device)
    if n == 0 or m_keys == 0:
        return best.reshape(batch, heads)
    step = max(1, block_elements // max(1, batch * heads * m_keys))
    rows = torch.arange(n, device=q.device)
    for r0 in range(0, n, step):
        s = q_g[..., r0 : r0 + step, :] @ keys  # (B, H_kv, G, rows, M)
        allowed = _allowed(rows[r0 : r0 + step], 0, m_keys, m_keys - n, causal, key_padding_mask)
        if allowed is not None:
            s.masked_fill_(~allowed, _NEG_INF)  # in place: one block of scores held at a time
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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    attn_mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
    kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale, **kwargs
    )


def autocast_off(*device_types: str) -> contextlib.AbstractContextManager:
    """A context with autocast disabled: inside, the matmuls run in the dtype the code chose
    (float32 for the kernel's statistics, float32 or float64 for a probe's side computation), not
    bfloat16 or float16, whatever mixed-precision region the caller's forward runs in.

    Args:
        device_types: the device types to disable autocast for; none given: CPU, and CUDA where
            present. A device type without autocast is left alone. For one device type the
            context is ``torch.autocast`` itself (or a null context), which torch.compile traces.
    """
    if not device_types:
        device_types = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    contexts = [
        torch.autocast(device_type, enabled=False)
        for device_type in device_types
        if torch.amp.is_autocast_available(device_type)
    ]
    if len(contexts) == 1:
        return contexts[0]
    return _entered_together(contexts) if contexts else contextlib.nullcontext()


@contextlib.contextmanager
def _entered_together(contexts: list[contextlib.AbstractContextManager]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


class _BlockwiseAttention(torch.autograd.Function):
    """Autograd wrapper: blockwise forward with statistics, blockwise FlashAttention-2 backward."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, causal, scale, sink_tokens, stats, block_size):
        out, lse, entropy, max_prob, max_logit, sink = _forward_blocks(
            q, k, v, key_padding_mask, causal, scale, sink_tokens, stats, block_size
        )
        out = out.to(q.dtype)
        # Empty rows get lse = +inf in the backward so that p = e^{s − lse} = 0 there.
        lse_bwd = torch.where(torch.isneginf(lse), float("inf"), lse)
        ctx.save_for_backward(q, k, v, out, lse_bwd, key_padding_mask)
        ctx.causal, ctx.scale, ctx.block_size = causal, scale, block_size
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
            dq, dk, dv = _backward_blocks(
                q, k, v, out, lse, dout, key_padding_mask, ctx.causal, ctx.scale, ctx.block_size
            )
        return dq, dk, dv, None, None, None, None, None, None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, N, D) → (B, H_kv, G, N, D): head h = g_kv · G + g shares key/value head g_kv."""
    b, h, n = x.shape[:3]
    return x.reshape(b, kv_heads, h // kv_heads, n, *x.shape[3:])


def _allowed(
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


def _first_row(start: int, diag: int, causal: bool) -> int:
    """First query row that may attend key ``start`` or later (rows above see none of them)."""
    return max(0, start - diag) if causal else 0


def _forward_blocks(
    q, k, v, key_padding_mask, causal, scale, sink_tokens, stats, block_size, output=True
):
    """The online forward; returns out in the compute dtype (None unless ``output``) and float32
    (B, H, N) statistics (all None but lse when ``stats`` is False)."""
    batch, heads, n, _ = q.shape
    kv_heads, m_keys = k.shape[1], k.shape[2]
    diag = m_keys - n
    cd = _compute_dtype(q.dtype)
    q_g = _grouped(q, kv_heads).to(cd) * scale  # (B, H_kv, G, N, D)
    if stats and not output and 0 < m_keys <= block_size and _first_row(0, diag, causal) == 0:
        return None, *_one_block_stats_in_parts(
            q_g, k, key_padding_mask, causal, sink_tokens, heads
        )
    row_shape = q_g.shape[:-1]
    m = torch.full(row_shape, _NEG_INF, dtype=cd, device=q.device)
    l = torch.zeros(row_shape, dtype=cd, device=q.device)
    acc = torch.zeros(row_shape + (v.shape[-1],), dtype=cd, device=q.device) if output else None
    u = torch.zeros_like(l) if stats else None
    sink = torch.zeros_like(l) if stats and sink_tokens > 0 else None
    rows = torch.arange(n, device=q.device)
    largest = torch.finfo(cd).max
    lowest = -largest
    for start in range(0, m_keys, block_size):
        stop = min(start + block_size, m_keys)
        r0 = _first_row(start, diag, causal)  # causal: rows above r0 see none of these keys
        if r0 >= n:
            break
        k_blk = k[:, :, None, start:stop].to(cd)  # (B, H_kv, 1, bn, D)
        s = q_g[..., r0:, :] @ k_blk.transpose(-1, -2)  # (B, H_kv, G, N − r0, bn)
        allowed = _allowed(rows[r0:], start, stop, diag, causal, key_padding_mask)
        if allowed is not None:
            s.masked_fill_(~allowed, _NEG_INF)
        m_old, l_old = m[..., r0:], l[..., r0:]
        m_new = torch.maximum(m_old, s.amax(dim=-1))
        # A finite shift: −inf (no key yet) would give −inf − (−inf), and +inf (an infinite score)
        # ∞ − ∞; clamped, masked keys stay at e^{−inf} = 0 and an infinite score makes l = +inf.
        m_safe = m_new.clamp(-largest, largest)
        s -= m_safe[..., None]  # s − m', −inf where masked
        p = exp_shifted_(s.clone())
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
            acc[..., r0:, :] = alpha[..., None] * acc[..., r0:, :] + p @ v_blk
        m[..., r0:] = m_new
    l_safe = torch.where(l == 0, 1.0, l)
    out = None if acc is None else (acc / l_safe[..., None]).reshape(batch, heads, n, v.shape[-1])
    if not stats:
        lse = torch.where(l == 0, _NEG_INF, m + torch.log(l_safe))
        return out, lse.reshape(batch, heads, n).to(torch.float32), None, None, None, None
    return out, *_row_stats(m, l, u, sink, heads)


#: Shifted scores at or below about this are probability 0: e^-79 < 6e-35 is below the rounding of
#: a row sum that is at least 1 (its largest term is e^0), in float32 and float64 alike.
_EXP_FLOOR = -80.0
_ZERO_AT_OR_BELOW = math.exp(_EXP_FLOOR + 1.0)  # a normal float32, above e^-80's rounding
#: log2(e): scores times this are in powers of 2, whose exponential (``exp2``) the CPU computes
#: about 3x faster than ``exp`` (as accurately: within an ulp of float32)
_LOG2E = 1.0 / math.log(2.0)


def exp_shifted_(s: torch.Tensor) -> torch.Tensor:
    """``e^s`` of shifted scores (all <= 0, −inf where masked; NaN stays NaN), in place, 0 where
    ``e^s`` is at most e^-79 (below :data:`_EXP_FLOOR` + 1): :func:`exp2_shifted_` of
    ``s · log2(e)``."""
    return exp2_shifted_(s.mul_(_LOG2E))


def exp2_shifted_(s: torch.Tensor) -> torch.Tensor:
    """``2^s`` of shifted scores in powers of 2 (all <= 0, −inf where masked; NaN stays NaN), in
    place, 0 where ``2^s`` is at most e^-79.

    The same numbers to rounding, without the slow path of the CPU exponential on results that
    underflow into subnormals (about 40x slower per element; sharp attention has many) or on −inf:
    the exponential of the scores clamped at the floor, then a threshold.
    """
    return torch.threshold_(s.clamp_(min=_EXP_FLOOR * _LOG2E).exp2_(), _ZERO_AT_OR_BELOW, 0.0)


#: The most scores :func:`_one_block_sums` holds at once (2 MiB in float32): its ten passes over
#: them then run in the CPU's caches, not through memory (twice as fast on 8 × 8 heads × 256²).
_SCORES_PER_PART = 2**19
#: Causal statistics in one block: the query rows are cut into up to this many runs (one per
#: :data:`_SCORES_PER_PART` scores of the whole), and a run's scores stop at its last row's
#: diagonal, so that with 8 runs 1 + 2 + ... + 8 eighths of the square, 56 %, are computed instead
#: of all of it (the keys past a run's diagonal are masked for all its rows).
_CAUSAL_ROW_RUNS = 8


def _one_block_stats_in_parts(q_g, k, key_padding_mask, causal, sink_tokens, heads):
    """The statistics of :func:`_forward_blocks` when every row sees one block of all the keys
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
    q_g = q_g * _LOG2E  # scores in powers of 2 (exp2): m and u back in e's powers at the end
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
    return _row_stats(m.mul_(math.log(2.0)), l, u.mul_(math.log(2.0)), sink, heads)


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
    e-powers' ``u`` of :func:`_forward_blocks`), ``sink`` the first ``sink_tokens`` keys' share
    of ``l`` (None for 0), each (B, H_kv, G, rows). The scores and exponentials live in
    ``scratch``'s buffers (new ones when None).

    Passes over the (rows, M) scores: the product, the mask (only the columns past the first
    row's diagonal without padding), the max, the shift and floor (``s − m`` at least
    :data:`_EXP_FLOOR` · log2(e): a key below it has probability 0, so its term is 0 either way),
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
    allowed = _allowed(
        torch.arange(first_row, first_row + rows, device=q_g.device),
        first_masked,
        m_keys,
        diag,
        causal,
        key_padding_mask,
    )
    if allowed is not None and first_masked < m_keys:
        s[..., first_masked:].masked_fill_(~allowed, _NEG_INF)
    largest = torch.finfo(s.dtype).max
    m = s.amax(dim=-1)
    s.sub_(m.clamp(-largest, largest)[..., None])  # a finite shift
    torch.exp2(s.clamp_(min=_EXP_FLOOR * _LOG2E), out=p)  # floored: as exp2_shifted_, s kept
    torch.threshold_(p, _ZERO_AT_OR_BELOW, 0.0)
    sink = p[..., :sink_tokens].sum(-1) if sink_tokens > 0 else None
    l = p.sum(dim=-1)
    return m, l, s.mul_(p).sum(dim=-1), sink  # u = Σ p·(s − m): 0 where p is 0


def _row_stats(m, l, u, sink, heads):
    """(lse, entropy, max_prob, max_logit, sink_mass) as float32 (B, H, N) from the running max
    ``m``, ``l = Σ e^{s−m}``, ``u = Σ e^{s−m}(s − m)`` and the sink sum, each (B, H_kv, G, N)."""
    # l = 0: no key (fully masked row); l = NaN: a NaN score; l = +inf: a +inf score; else finite.
    batch, n = m.shape[0], m.shape[-1]
    empty = l == 0
    l_safe = torch.where(empty, 1.0, l)
    log_l = torch.log(l_safe)
    lse = torch.where(empty, _NEG_INF, m + log_l)  # NaN and +inf rows: NaN, +inf
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


def _backward_blocks(q, k, v, out, lse, dout, key_padding_mask, causal, scale, block_size):
    """Gradients of q, k, v from recomputed blocks; ``lse`` is +inf on fully masked rows."""
    kv_heads, m_keys = k.shape[1], k.shape[2]
    n = q.shape[2]
    diag = m_keys - n
    cd = _compute_dtype(q.dtype)
    q_g = _grouped(q, kv_heads).to(cd) * scale  # (B, H_kv, G, N, D)
    do_g = _grouped(dout, kv_heads).to(cd)
    delta = (do_g * _grouped(out, kv_heads).to(cd)).sum(dim=-1, keepdim=True)  # (B, H_kv, G, N, 1)
    lse_g = _grouped(lse, kv_heads).to(cd)[..., None]  # (B, H_kv, G, N, 1)
    dq = torch.zeros_like(q_g)
    dk = torch.zeros(k.shape, dtype=cd, device=k.device)
    dv = torch.zeros(v.shape, dtype=cd, device=v.device)
    rows = torch.arange(n, device=q.device)
    for start in range(0, m_keys, block_size):
        stop = min(start + block_size, m_keys)
        r0 = _first_row(start, diag, causal)
        if r0 >= n:
            break
        k_blk = k[:, :, None, start:stop].to(cd)  # (B, H_kv, 1, bn, D)
        v_blk = v[:, :, None, start:stop].to(cd)
        q_r, do_r = q_g[..., r0:, :], do_g[..., r0:, :]
        s = q_r @ k_blk.transpose(-1, -2)  # (B, H_kv, G, N − r0, bn)
        allowed = _allowed(rows[r0:], start, stop, diag, causal, key_padding_mask)
        if allowed is not None:
            s.masked_fill_(~allowed, _NEG_INF)
        p = torch.exp_(s - lse_g[..., r0:, :])
        dv[:, :, start:stop] = (p.transpose(-1, -2) @ do_r).sum(dim=2)
        ds = (do_r @ v_blk.transpose(-1, -2)).sub_(delta[..., r0:, :]).mul_(p)
        dq[..., r0:, :] += ds @ k_blk
        dk[:, :, start:stop] = (ds.transpose(-1, -2) @ q_r).sum(dim=2)
    dq = (dq * scale).reshape(q.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
