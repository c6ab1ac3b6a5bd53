"""Fused attention with in-kernel row statistics in Triton (FlashAttention-2 forward and backward).

Forward (one program per block of BLOCK_M query rows of one head). Scores are kept in base 2:
``t = log2(e) · scale · q kᵀ`` (the factor is folded into one multiply so that ``exp2`` replaces
``exp``). Over key blocks the program keeps, per row, the running max ``m``,
``l = Σ_j 2^{t_j − m}``, the output accumulator ``acc = Σ_j 2^{t_j − m} v_j`` and the centered
``u = Σ_j 2^{t_j − m}(t_j − m)``. When the max grows from ``m`` to ``m'`` the sums are rescaled by
``α = 2^{m − m'}`` and ``u ← α(u + (m − m')·l) + Σ_j 2^{t_j − m'}(t_j − m')``. At the end, in
natural units (``ln 2`` converts):

    out = acc / l,  lse = ln2·(m + log2 l),  entropy = ln2·(log2 l − u / l) ≥ 0,
    max_prob = 1 / l,  max_logit = ln2·m,  sink_mass = (Σ_{j<S} 2^{t_j − m}) / l.

The sink sum is not carried through the loop: after it, the first S keys are scored again and
summed with the final ``m`` (usually one extra block; a third running sum made the loop spill
registers on sm_90). Masked scores are −inf; a row whose keys are all masked keeps ``m = −inf`` and ``l = 0`` and is
finished as out = 0, lse = max_logit = −inf, entropy = max_prob = 0. Exponents are taken against
``m`` clamped to ±FLT_MAX, so ``−inf − (−inf)`` and ``∞ − ∞`` never arise, and masked entries of
``p·(t − m)`` are selected away (in tiles without masks they are not: see below).

Non-finite scores on allowed keys (the contract of ``attention``): a NaN score makes ``l`` NaN (a
NaN ``p`` enters the sum, and NaN stays NaN under rescaling), so the epilogue reads the row's
state from ``l`` alone: ``l = 0`` no key, ``l`` NaN a NaN score, ``l = +inf`` a +inf score
(``2^{∞ − FLT_MAX}``), finite otherwise. The running max cannot tell: the GPU's ``max.f32``
returns the non-NaN operand, so ``m`` skips NaN scores there (the interpreter's numpy propagates
them). A −inf score on an allowed key is probability 0 for out, lse and max_prob; in a tile
without masks its ``p·(t − m) = 0·(−inf)`` makes the row's entropy NaN (a select per score in the
hot loop would avoid it, for inputs that already hold ±inf), never a wrong finite number.

Backward (Dao, "FlashAttention-2", 2023, Algorithm 2, split in two kernels so that nothing needs
atomics): with ``p = 2^{t − lse2}`` (``lse2 = +inf`` on fully masked rows so p = 0 there),
``δ_i = Σ_d dO_id O_id`` and ``dS = p ⊙ (dO vᵀ − δ)``:

- ``_attn_bwd_dkdv``: one program per block of BLOCK_N keys of one key/value head; it loops over
  (query head of its group, query block) pairs in one flat loop (grouped-query attention without
  repeating k and v), accumulating ``dV = pᵀ dO`` and ``dK = scale · dSᵀ q``.
- ``_attn_bwd_dq``: one program per block of query rows, looping over key blocks:
  ``dQ = scale · dS k``.

Every loop over blocks is split into blocks that need no mask (full tiles, below the causal
diagonal) and blocks that do (the diagonal band and the ragged tail), which keeps masks out of the
bulk of the work. The causal mask is bottom-right aligned: query i attends key j iff
``j ≤ i + M − N``. Head dims that are not powers of two are padded to the next one with masked
loads. Each tile's first row is added to its base pointer in int64 (``row · stride`` can pass
2^31 in long strided layouts); offsets inside a tile stay int32. On CUDA the tile sizes are
autotuned per (bucketed N, M, head dim, causal, statistics) among those that fit the GPU's shared
memory and build without register spills on it (``_configs``); under the interpreter (``TRITON_INTERPRET=1``) one small configuration is used, and bfloat16 is
computed in float32 because the interpreter's bfloat16 arithmetic is wrong.

Reference: Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", 2023; Triton's fused-attention tutorial for the structure.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton import knobs

__all__ = ["triton_attention"]

_INTERPRETED = bool(knobs.runtime.interpret)  # how the kernels below were decorated
_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_MAX_GRID_Y = 65535


# --------------------------------------------------------------------------------------------------
# helpers


@triton.jit
def _load_tile(
    base,
    start,
    offs,
    offs_d,
    stride_r,
    stride_d,
    n_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    """Load the (len(offs), BLOCK_D) tile of rows ``start + offs``, zero outside ``rows < n_rows``
    and ``d < HEAD_DIM``.

    The block's first row is added to ``base`` in int64: ``start * stride_r`` passes 2^31 for a long
    sequence in a strided layout (e.g. a (B, N, H, D) tensor viewed as (B, H, N, D)), while the
    offsets inside the tile stay int32 (cheap, and small).
    """
    base = base + tl.cast(start, tl.int64) * stride_r
    ptrs = base + offs[:, None] * stride_r + offs_d[None, :] * stride_d
    if CHECK_ROWS:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs, mask=offs[:, None] < n_rows - start, other=0.0)
        else:
            x = tl.load(
                ptrs,
                mask=(offs[:, None] < n_rows - start) & (offs_d[None, :] < HEAD_DIM),
                other=0.0,
            )
    else:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _store_tile(
    base,
    x,
    start,
    offs,
    offs_d,
    stride_r,
    stride_d,
    n_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Store ``x`` to the rows ``start + offs`` below ``n_rows`` (int64 block base, as in
    ``_load_tile``)."""
    base = base + tl.cast(start, tl.int64) * stride_r
    ptrs = base + offs[:, None] * stride_r + offs_d[None, :] * stride_d
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, x, mask=offs[:, None] < n_rows - start)
    else:
        tl.store(ptrs, x, mask=(offs[:, None] < n_rows - start) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _key_range(
    start_m, n_ctx_q, n_ctx_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Key blocks of query block ``start_m``: ``[0, full)`` need no mask, ``[full, hi)`` do."""
    full = (n_ctx_k // BLOCK_N) * BLOCK_N
    hi = n_ctx_k
    if CAUSAL:
        diag = n_ctx_k - n_ctx_q
        # every row of the block sees keys j <= start_m * BLOCK_M + diag
        seen_by_all = tl.maximum(start_m * BLOCK_M + diag + 1, 0)
        full = tl.minimum(full, (seen_by_all // BLOCK_N) * BLOCK_N)
        hi = tl.minimum(hi, tl.maximum(start_m * BLOCK_M + BLOCK_M + diag, 0))
        hi = tl.maximum(hi, full)
    return full, hi


# --------------------------------------------------------------------------------------------------
# forward


@triton.jit
def _fwd_inner(
    acc,
    m_i,
    l_i,
    u_i,
    q,
    k_base,
    v_base,
    pad_base,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    stride_pn,
    offs_m,
    offs_n,
    offs_d,
    lo,
    hi,
    n_ctx_q,
    n_ctx_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    STATS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    diag = n_ctx_k - n_ctx_q
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_tile(
            k_base,
            start_n,
            offs_n,
            offs_d,
            stride_kn,
            stride_kd,
            n_ctx_k,
            HEAD_DIM,
            BLOCK_D,
            MASKED,
        )
        t = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASKED:
            allowed = cols[None, :] < n_ctx_k
            if CAUSAL:
                allowed = allowed & (cols[None, :] <= offs_m[:, None] + diag)
            t = tl.where(allowed, t, float("-inf"))
        if HAS_PAD:
            keep = tl.load(pad_base + cols * stride_pn, mask=cols < n_ctx_k, other=0) != 0
            t = tl.where(keep[None, :], t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(t, 1))
        # A finite shift: m = −inf (no key of the row seen yet) would give −inf − (−inf), and
        # m = +inf (an infinite score) ∞ − ∞; clamped, masked keys keep 2^{−inf} = 0 and an
        # infinite score makes l = +inf, which the epilogue reads.
        m_use = tl.clamp(m_new, -_FLT_MAX, _FLT_MAX)
        t = t - m_use[:, None]
        p = tl.math.exp2(t)
        alpha = tl.math.exp2(m_i - m_use)
        if STATS:
            if MASKED or HAS_PAD:
                pt = p * tl.where(p > 0.0, t, 0.0)  # no 0·(−inf) at masked keys
            else:
                pt = p * t
            shift = tl.where(l_i > 0.0, m_i - m_use, 0.0) * l_i  # no (−inf)·0 before the first key
            u_i = alpha * (u_i + shift) + tl.sum(pt, 1)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(
            v_base,
            start_n,
            offs_n,
            offs_d,
            stride_vn,
            stride_vd,
            n_ctx_k,
            HEAD_DIM,
            BLOCK_D,
            MASKED,
        )
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i, u_i


@triton.jit
def _fwd_sink(
    q,
    m_i,
    k_base,
    pad_base,
    stride_kn,
    stride_kd,
    stride_pn,
    offs_m,
    offs_n,
    offs_d,
    n_ctx_q,
    n_ctx_k,
    qk_scale,
    sink_tokens,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``Σ_{j<S} 2^{t_j − m}`` over the allowed sink keys, with the row's final max ``m``.

    Recomputed after the main loop (one extra ``q kᵀ`` over the first S keys, usually one block)
    rather than carried through it: a third running sum, rescaled every step and updated under a
    data-dependent branch, pushes the main loop past the register file (ptxas spills on sm_90).
    """
    diag = n_ctx_k - n_ctx_q
    m_use = tl.clamp(m_i, -_FLT_MAX, _FLT_MAX)  # a finite shift, as in the main loop
    n_sink = tl.minimum(sink_tokens, n_ctx_k)
    total = tl.zeros_like(m_i)
    for start_n in tl.range(0, n_sink, BLOCK_N, num_stages=1):  # usually one block: no pipeline
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_tile(
            k_base, start_n, offs_n, offs_d, stride_kn, stride_kd, n_sink, HEAD_DIM, BLOCK_D, True
        )
        t = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        allowed = cols[None, :] < n_sink
        if CAUSAL:
            allowed = allowed & (cols[None, :] <= offs_m[:, None] + diag)
        if HAS_PAD:
            keep = tl.load(pad_base + cols * stride_pn, mask=cols < n_sink, other=0) != 0
            allowed = allowed & keep[None, :]
        # select, not multiply: exp2 of a disallowed score may overflow to inf
        total += tl.sum(tl.where(allowed, tl.math.exp2(t - m_use[:, None]), 0.0), 1)
    return total


@triton.jit(do_not_specialize=["n_heads", "n_ctx_q", "n_ctx_k", "sink_tokens"])
def _attn_fwd(
    Q,
    K,
    V,
    Out,
    Lse2,
    Pad,
    Lse,
    Ent,
    MaxP,
    MaxL,
    Sink,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_pb,
    stride_pn,
    n_heads,
    n_ctx_q,
    n_ctx_k,
    qk_scale,
    sink_tokens,
    N_Q_BUCKET,  # autotune key only
    N_K_BUCKET,  # autotune key only
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    STATS: tl.constexpr,
    SINK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    h_kv = h // GROUPS
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    o_base = Out + b * stride_ob + h * stride_oh
    pad_base = Pad + b * stride_pb

    row0 = start_m * BLOCK_M
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = row0 + offs_r
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(
        q_base, row0, offs_r, offs_d, stride_qn, stride_qd, n_ctx_q, HEAD_DIM, BLOCK_D, True
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    u_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full, hi = _key_range(start_m, n_ctx_q, n_ctx_k, CAUSAL, BLOCK_M, BLOCK_N)
    acc, m_i, l_i, u_i = _fwd_inner(
        acc, m_i, l_i, u_i, q, k_base, v_base, pad_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_pn,
        offs_m, offs_n, offs_d, 0, full, n_ctx_q, n_ctx_k, qk_scale,
        HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, HAS_PAD, STATS, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i, u_i = _fwd_inner(
        acc, m_i, l_i, u_i, q, k_base, v_base, pad_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_pn,
        offs_m, offs_n, offs_d, full, hi, n_ctx_q, n_ctx_k, qk_scale,
        HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, HAS_PAD, STATS, DOT_PRECISION,
    )  # fmt: skip

    # l = 0: no key (fully masked row); l = NaN: a NaN score; l = +inf: a +inf score.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    _store_tile(
        o_base,
        out.to(Out.dtype.element_ty),
        row0,
        offs_r,
        offs_d,
        stride_on,
        stride_od,
        n_ctx_q,
        HEAD_DIM,
        BLOCK_D,
    )

    row_ptr = pid_bh.to(tl.int64) * n_ctx_q + offs_m
    row_ok = offs_m < n_ctx_q
    log2_l = tl.math.log2(l_safe)
    lse2 = m_i + log2_l  # NaN on a NaN row, +inf on a +inf row
    tl.store(Lse2 + row_ptr, tl.where(empty, float("inf"), lse2), mask=row_ok)
    if STATS:
        healthy = l_i < float("inf")  # False on NaN and +inf rows, True on empty rows
        inv_l = 1.0 / l_safe
        # NaN-propagating: the GPU's max otherwise returns the non-NaN operand
        entropy = tl.maximum(_LN2 * (log2_l - u_i * inv_l), 0.0, propagate_nan=tl.PropagateNan.ALL)
        # m ignores NaN scores on the GPU (max.f32 drops NaN): a NaN row's l says it instead
        max_logit = tl.where(l_i != l_i, float("nan"), _LN2 * m_i)  # noqa: PLR0124 (NaN test)
        tl.store(Lse + row_ptr, tl.where(empty, float("-inf"), _LN2 * lse2), mask=row_ok)
        tl.store(Ent + row_ptr, _row_stat(entropy, healthy, empty), mask=row_ok)
        tl.store(MaxP + row_ptr, _row_stat(inv_l, healthy, empty), mask=row_ok)
        tl.store(MaxL + row_ptr, max_logit, mask=row_ok)
        if SINK:
            sink_i = _fwd_sink(
                q, m_i, k_base, pad_base, stride_kn, stride_kd, stride_pn,
                offs_m, offs_n, offs_d, n_ctx_q, n_ctx_k, qk_scale, sink_tokens,
                HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, HAS_PAD, DOT_PRECISION,
            )  # fmt: skip
            tl.store(Sink + row_ptr, _row_stat(sink_i * inv_l, healthy, empty), mask=row_ok)


@triton.jit
def _row_stat(value, healthy, empty):
    """A probability statistic of each row: 0 on rows with no key, NaN on NaN and +inf rows."""
    return tl.where(healthy, tl.where(empty, 0.0, value), float("nan"))


# --------------------------------------------------------------------------------------------------
# backward


@triton.jit(do_not_specialize=["n_heads", "n_ctx_q"])
def _attn_bwd_delta(
    Out,
    dO,
    Delta,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    n_heads,
    n_ctx_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``δ_i = Σ_d dO_id · O_id`` in float32."""
    start_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    row0 = start_m * BLOCK_M
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = row0 + offs_r
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(
        Out + b * stride_ob + h * stride_oh,
        row0,
        offs_r,
        offs_d,
        stride_on,
        stride_od,
        n_ctx_q,
        HEAD_DIM,
        BLOCK_D,
        True,
    )
    do = _load_tile(
        dO + b * stride_dob + h * stride_doh,
        row0,
        offs_r,
        offs_d,
        stride_don,
        stride_dod,
        n_ctx_q,
        HEAD_DIM,
        BLOCK_D,
        True,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + pid_bh.to(tl.int64) * n_ctx_q + offs_m, delta, mask=offs_m < n_ctx_q)


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse2_base,
    delta_base,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_doh,
    stride_don,
    stride_dod,
    cols,
    offs_m,
    offs_d,
    lo,
    hi,
    n_ctx_q,
    n_ctx_k,
    qk_scale,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate the query blocks ``[lo, hi)`` of all GROUPS query heads sharing this key/value
    head (the ``*_base`` arguments point at the group's first head; Lse2/Delta rows of consecutive
    heads are ``n_ctx_q`` apart).

    One flat loop over (head, query block) pairs rather than a loop over heads around a loop over
    blocks: the nested form keeps the software pipeline's prologue and epilogue inside the outer
    loop and, on sm_90, drives ptxas to spill for GROUPS > 1.
    """
    diag = n_ctx_k - n_ctx_q
    n_blocks = tl.maximum(hi - lo + BLOCK_M - 1, 0) // BLOCK_M
    for it in range(GROUPS * n_blocks):
        if GROUPS == 1:
            g = 0
            start_m = lo + it * BLOCK_M
        else:
            g = it // n_blocks
            start_m = lo + (it - g * n_blocks) * BLOCK_M
        start_m = tl.multiple_of(start_m, BLOCK_M)
        g64 = tl.cast(g, tl.int64)
        rows = start_m + offs_m
        q = _load_tile(
            q_base + g64 * stride_qh, start_m, offs_m, offs_d, stride_qn, stride_qd, n_ctx_q,
            HEAD_DIM, BLOCK_D, MASKED,
        )  # fmt: skip
        do = _load_tile(
            do_base + g64 * stride_doh, start_m, offs_m, offs_d, stride_don, stride_dod, n_ctx_q,
            HEAD_DIM, BLOCK_D, MASKED,
        )  # fmt: skip
        row_ptr = g64 * n_ctx_q + rows
        if MASKED:
            lse2 = tl.load(lse2_base + row_ptr, mask=rows < n_ctx_q, other=float("inf"))
            delta = tl.load(delta_base + row_ptr, mask=rows < n_ctx_q, other=0.0)
        else:
            lse2 = tl.load(lse2_base + row_ptr)
            delta = tl.load(delta_base + row_ptr)
        t_T = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
        p_T = tl.math.exp2(t_T - lse2[None, :])
        if MASKED and CAUSAL:
            p_T = tl.where(cols[:, None] <= rows[None, :] + diag, p_T, 0.0)
        dv = tl.dot(p_T.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_T = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_T = p_T * (dp_T - delta[None, :])
        dk = tl.dot(ds_T.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["n_kv_heads", "n_ctx_q", "n_ctx_k"])
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    dO,
    Lse2,
    Delta,
    Pad,
    dK,
    dV,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    stride_pb,
    stride_pn,
    n_kv_heads,
    n_ctx_q,
    n_ctx_k,
    qk_scale,
    sm_scale,
    N_Q_BUCKET,  # autotune key only
    N_K_BUCKET,  # autotune key only
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    b = (pid_bkv // n_kv_heads).to(tl.int64)
    h_kv = (pid_bkv % n_kv_heads).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    cols = start_n + offs_n
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(
        K + b * stride_kb + h_kv * stride_kh,
        start_n,
        offs_n,
        offs_d,
        stride_kn,
        stride_kd,
        n_ctx_k,
        HEAD_DIM,
        BLOCK_D,
        True,
    )
    v = _load_tile(
        V + b * stride_vb + h_kv * stride_vh,
        start_n,
        offs_n,
        offs_d,
        stride_vn,
        stride_vd,
        n_ctx_k,
        HEAD_DIM,
        BLOCK_D,
        True,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # CAUSAL and HAS_PAD are constexpr, so each variable below has one type per compiled variant
    # (the untaken branch is never built).
    q_stop = n_ctx_q
    if HAS_PAD:
        keep = tl.load(Pad + b * stride_pb + cols * stride_pn, mask=cols < n_ctx_k, other=0) != 0
        # A block of padded keys gets zero gradients: skip its query loop altogether.
        q_stop = tl.where(tl.max(keep.to(tl.int32), 0) > 0, n_ctx_q, 0)
    # Query blocks: [lo, diag_hi) cross the causal diagonal, [full_lo, full_hi) need no mask,
    # [tail_lo, q_stop) is the ragged end.
    full_hi = (q_stop // BLOCK_M) * BLOCK_M
    lo = 0
    full_lo = 0
    if CAUSAL:
        diag = n_ctx_k - n_ctx_q
        lo = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
        full_lo = ((tl.maximum(start_n + BLOCK_N - 1 - diag, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    diag_hi = tl.minimum(full_lo, ((q_stop + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
    tail_lo = tl.maximum(full_lo, full_hi)

    h0 = h_kv * GROUPS  # first query head of the group
    q_base = Q + b * stride_qb + h0 * stride_qh
    do_base = dO + b * stride_dob + h0 * stride_doh
    row_base = (b * (n_kv_heads * GROUPS) + h0) * n_ctx_q
    dk, dv = _dkdv_inner(
        dk, dv, k, v, q_base, do_base, Lse2 + row_base, Delta + row_base,
        stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, cols, offs_m, offs_d,
        lo, diag_hi, n_ctx_q, n_ctx_k, qk_scale,
        GROUPS, HEAD_DIM, BLOCK_D, BLOCK_M, True, CAUSAL, DOT_PRECISION,
    )  # fmt: skip
    dk, dv = _dkdv_inner(
        dk, dv, k, v, q_base, do_base, Lse2 + row_base, Delta + row_base,
        stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, cols, offs_m, offs_d,
        full_lo, full_hi, n_ctx_q, n_ctx_k, qk_scale,
        GROUPS, HEAD_DIM, BLOCK_D, BLOCK_M, False, CAUSAL, DOT_PRECISION,
    )  # fmt: skip
    dk, dv = _dkdv_inner(
        dk, dv, k, v, q_base, do_base, Lse2 + row_base, Delta + row_base,
        stride_qh, stride_qn, stride_qd, stride_doh, stride_don, stride_dod, cols, offs_m, offs_d,
        tail_lo, q_stop, n_ctx_q, n_ctx_k, qk_scale,
        GROUPS, HEAD_DIM, BLOCK_D, BLOCK_M, True, CAUSAL, DOT_PRECISION,
    )  # fmt: skip

    dk = dk * sm_scale
    if HAS_PAD:
        # Scores of padded keys were never in the softmax; their rows may hold junk.
        dk = tl.where(keep[:, None], dk, 0.0)
        dv = tl.where(keep[:, None], dv, 0.0)
    _store_tile(
        dK + b * stride_dkb + h_kv * stride_dkh,
        dk.to(dK.dtype.element_ty),
        start_n,
        offs_n,
        offs_d,
        stride_dkn,
        stride_dkd,
        n_ctx_k,
        HEAD_DIM,
        BLOCK_D,
    )
    _store_tile(
        dV + b * stride_dvb + h_kv * stride_dvh,
        dv.to(dV.dtype.element_ty),
        start_n,
        offs_n,
        offs_d,
        stride_dvn,
        stride_dvd,
        n_ctx_k,
        HEAD_DIM,
        BLOCK_D,
    )


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    k_base,
    v_base,
    pad_base,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    stride_pn,
    offs_m,
    offs_n,
    offs_d,
    lo,
    hi,
    n_ctx_q,
    n_ctx_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    diag = n_ctx_k - n_ctx_q
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_tile(
            k_base,
            start_n,
            offs_n,
            offs_d,
            stride_kn,
            stride_kd,
            n_ctx_k,
            HEAD_DIM,
            BLOCK_D,
            MASKED,
        )
        v = _load_tile(
            v_base,
            start_n,
            offs_n,
            offs_d,
            stride_vn,
            stride_vd,
            n_ctx_k,
            HEAD_DIM,
            BLOCK_D,
            MASKED,
        )
        t = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.math.exp2(t - lse2[:, None])
        if MASKED:
            allowed = cols[None, :] < n_ctx_k
            if CAUSAL:
                allowed = allowed & (cols[None, :] <= offs_m[:, None] + diag)
            p = tl.where(allowed, p, 0.0)
        if HAS_PAD:
            keep = tl.load(pad_base + cols * stride_pn, mask=cols < n_ctx_k, other=0) != 0
            p = tl.where(keep[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["n_heads", "n_ctx_q", "n_ctx_k"])
def _attn_bwd_dq(
    Q,
    K,
    V,
    dO,
    Lse2,
    Delta,
    Pad,
    dQ,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_don,
    stride_dod,
    stride_dqb,
    stride_dqh,
    stride_dqn,
    stride_dqd,
    stride_pb,
    stride_pn,
    n_heads,
    n_ctx_q,
    n_ctx_k,
    qk_scale,
    sm_scale,
    N_Q_BUCKET,  # autotune key only
    N_K_BUCKET,  # autotune key only
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    h_kv = h // GROUPS
    row0 = start_m * BLOCK_M
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = row0 + offs_r
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < n_ctx_q
    q = _load_tile(
        Q + b * stride_qb + h * stride_qh,
        row0,
        offs_r,
        offs_d,
        stride_qn,
        stride_qd,
        n_ctx_q,
        HEAD_DIM,
        BLOCK_D,
        True,
    )
    do = _load_tile(
        dO + b * stride_dob + h * stride_doh,
        row0,
        offs_r,
        offs_d,
        stride_don,
        stride_dod,
        n_ctx_q,
        HEAD_DIM,
        BLOCK_D,
        True,
    )
    row_ptr = pid_bh.to(tl.int64) * n_ctx_q + offs_m
    lse2 = tl.load(Lse2 + row_ptr, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + row_ptr, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh
    pad_base = Pad + b * stride_pb
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full, hi = _key_range(start_m, n_ctx_q, n_ctx_k, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, pad_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_pn, offs_m, offs_n, offs_d,
        0, full, n_ctx_q, n_ctx_k, qk_scale,
        HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, HAS_PAD, DOT_PRECISION,
    )  # fmt: skip
    dq = _dq_inner(
        dq, q, do, lse2, delta, k_base, v_base, pad_base,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_pn, offs_m, offs_n, offs_d,
        full, hi, n_ctx_q, n_ctx_k, qk_scale,
        HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, HAS_PAD, DOT_PRECISION,
    )  # fmt: skip
    dq = dq * sm_scale
    _store_tile(
        dQ + b * stride_dqb + h * stride_dqh,
        dq.to(dQ.dtype.element_ty),
        row0,
        offs_r,
        offs_d,
        stride_dqn,
        stride_dqd,
        n_ctx_q,
        HEAD_DIM,
        BLOCK_D,
    )


# --------------------------------------------------------------------------------------------------
# configurations

_INTERPRETER_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}


def _configs(shapes: list[tuple]) -> list[triton.Config]:
    """Tiles ``(BLOCK_M, BLOCK_N, num_warps, num_stages, max_block_d, sm80_spills)``.

    ``max_block_d`` is the largest padded head dim the tile is kept for, and ``sm80_spills`` the
    head dims at which it spills on compute capability 8.x only (``mma.sync`` holds its operand
    tiles in registers, where sm_90's ``wgmma`` reads them from shared memory): ``_prune`` drops
    the tile there. Both come from building every kept tile through the real compiler
    (``scripts/compile_kernels.py``, run by ``tests/kernels/test_triton_compile.py``): none may
    spill a register, on sm_90 or sm_80.
    """
    configs = []
    for bm, bn, warps, stages, max_block_d, sm80_spills in shapes:
        config = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
        config.max_block_d, config.sm80_spills = max_block_d, frozenset(sm80_spills)
        configs.append(config)
    return configs


def _smem_bytes(kernel: str, config: triton.Config, block_d: int, elem_bytes: int) -> int:
    """Upper estimate of a configuration's shared memory: the tiles kept for the whole program
    plus ``num_stages`` buffers (at least two: one-stage builds still double-buffer) of each tile
    the pipelined loop streams; dK/dV adds its cross-warp reduction over the key block. Compiled
    sm_90 and sm_80 kernels use at most this (``scripts/compile_kernels.py`` checks it)."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    stages = max(config.num_stages, 2)
    if kernel == "fwd":  # q resident; k, v streamed
        return (bm + 2 * bn * stages) * block_d * elem_bytes
    if kernel == "dkdv":  # k, v resident; q, dO and float32 lse2, δ streamed
        return (2 * bn + 2 * bm * stages) * block_d * elem_bytes + 8 * bm * stages + 4 * bn
    return (2 * bm + 2 * bn * stages) * block_d * elem_bytes  # dq: q, dO resident; k, v streamed


_SMEM_LIMITS: dict[int, int] = {}


def _smem_limit(x) -> int | None:
    """Opt-in shared memory per block of the tensor's GPU (None off CUDA): a launch that needs
    more fails with OutOfResources, which autotuning survives but a lone configuration does not."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda):
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if index not in _SMEM_LIMITS:
        from triton.runtime import driver  # at first launch, never at import

        _SMEM_LIMITS[index] = driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return _SMEM_LIMITS[index]


def _capability_major(x) -> int | None:
    """The compute capability's major version of the tensor's GPU (None off CUDA)."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda):
        return None
    return torch.cuda.get_device_capability(x.device)[0]


def _prune(configs, named_args, kernel=None, smem_limit=None, capability=None, **kwargs):
    """Drop tiles that cannot fit (large head dims, tiles that spill registers at this head dim or
    on this GPU generation, or, for ``kernel``, the GPU's shared memory at the operands' element
    size) or exceed a short sequence; sequences of at most 128 get one mid-sized tile without
    benchmarking (tuning would cost more than it wins, and every new shape would pay it).
    ``kernel`` ("fwd", "dkdv", "dq") is bound per autotuned kernel; ``smem_limit`` and
    ``capability`` (the compute capability's major version) default to the device's."""
    block_d = kwargs["BLOCK_D"]
    n_q, n_k = named_args["N_Q_BUCKET"], named_args["N_K_BUCKET"]
    budget = 128 * 128 if block_d <= 64 else 128 * 64 if block_d <= 128 else 64 * 64
    q = named_args.get("Q")
    elem_bytes = q.element_size() if isinstance(q, torch.Tensor) else 2
    if smem_limit is None:
        smem_limit = _smem_limit(q)
    if capability is None:
        capability = _capability_major(q)

    def spills(c):
        return block_d > getattr(c, "max_block_d", 256) or (
            capability == 8 and block_d in getattr(c, "sm80_spills", ())
        )

    def area(c):
        return c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"]

    def fits_smem(c):
        return (
            kernel is None
            or smem_limit is None
            or (_smem_bytes(kernel, c, block_d, elem_bytes) <= smem_limit)
        )

    kept = [
        c
        for c in configs
        if area(c) <= budget
        and not spills(c)
        and max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) * block_d <= 128 * 128
        and c.kwargs["BLOCK_M"] <= max(n_q, 16)
        and c.kwargs["BLOCK_N"] <= max(n_k, 16)
        and fits_smem(c)
    ]
    if not kept:
        return [_TINY_CONFIG]
    if max(n_q, n_k) <= 128:
        return [min(kept, key=lambda c: abs(area(c) - 64 * 32))]
    return kept


_TINY_CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)
_KEY = ["N_Q_BUCKET", "N_K_BUCKET", "HEAD_DIM", "CAUSAL", "GROUPS"]
# (BLOCK_M, BLOCK_N, warps, stages, max_block_d, head dims that spill on sm_8x). With BLOCK_D = 128
# a thread of a 4-warp tile holds too much of the float32 accumulators (and, backward, of p and
# dp) once the tile reaches 64×64: ptxas spilled hundreds of bytes to kilobytes on sm_90; 8 warps
# halve each thread's share. On sm_80 more tiles spill (4 bytes to a few hundred, some only in
# one variant, measured over every variant at D = 64 and 128): they are pruned there.
_FWD_CONFIGS = _configs(
    [
        (128, 64, 8, 3, 128, (128,)),
        (128, 128, 8, 3, 64, (64,)),
        (128, 32, 8, 3, 128, (64,)),
        (64, 64, 8, 3, 128, ()),
        (128, 32, 4, 4, 64, (64,)),
        (64, 64, 4, 3, 64, (64,)),
        (64, 32, 4, 4, 128, (64, 128)),
        (32, 32, 4, 2, 128, ()),
    ]
)
_DKDV_CONFIGS = _configs(  # BLOCK_N keys per program, BLOCK_M queries per inner step
    [
        (64, 128, 8, 3, 64, (64,)),
        (32, 128, 8, 3, 128, (128,)),
        (32, 64, 8, 3, 128, ()),
        (64, 64, 4, 3, 64, (64,)),
        (32, 64, 4, 3, 64, (64,)),
        (16, 64, 4, 2, 128, (64,)),
    ]
)
_DQ_CONFIGS = _configs(
    [
        (128, 64, 8, 3, 128, (128,)),
        (128, 32, 8, 3, 128, ()),
        (64, 64, 8, 3, 128, ()),
        (128, 32, 4, 3, 64, (64,)),
        (64, 64, 4, 3, 64, (64,)),
        (64, 32, 4, 3, 128, ()),
        (32, 32, 4, 2, 128, ()),
    ]
)


def _tuned(kernel, configs, name, extra_key=()):
    if _INTERPRETED:
        return kernel
    # triton 3.9 calls early_config_prune(configs, named_args, **kernel_kwargs), where
    # named_args holds the positional arguments (Q, N_Q_BUCKET, ...) and BLOCK_D is a kwarg.
    prune = functools.partial(_prune, kernel=name)
    return triton.autotune(
        configs=configs, key=_KEY + list(extra_key), prune_configs_by={"early_config_prune": prune}
    )(kernel)


_fwd_kernel = _tuned(_attn_fwd, _FWD_CONFIGS, "fwd", extra_key=["STATS", "SINK", "HAS_PAD"])
_dkdv_kernel = _tuned(_attn_bwd_dkdv, _DKDV_CONFIGS, "dkdv", extra_key=["HAS_PAD"])
_dq_kernel = _tuned(_attn_bwd_dq, _DQ_CONFIGS, "dq", extra_key=["HAS_PAD"])


def _launch(kernel, grid, *args, **meta) -> None:
    if _INTERPRETED:
        meta = {**meta, **_INTERPRETER_BLOCKS}
        kernel[grid(meta)](*args, **meta, num_warps=4)
    else:
        kernel[grid](*args, **meta)


# --------------------------------------------------------------------------------------------------
# autograd


def _bucket(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype != torch.float32:
        return "tf32"  # Triton's default; only float32 operands read it
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _strides(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.stride())


def _on_device(x: torch.Tensor):
    """Launch on the tensor's GPU, not the current one (the backward runs on autograd's thread)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pad, causal, scale, sink_tokens, stats):
        batch, heads, n, d = q.shape
        kv_heads, m = k.shape[1], k.shape[2]
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        rows = (batch, heads, n)
        lse2 = torch.empty(rows, dtype=torch.float32, device=q.device)
        if stats:
            lse, entropy, max_prob, max_logit = (torch.empty_like(lse2) for _ in range(4))
            sink = torch.empty_like(lse2) if sink_tokens > 0 else None
        else:
            lse = entropy = max_prob = max_logit = sink = None
        pad_arg = q if pad is None else pad
        pad_strides = (0, 0) if pad is None else _strides(pad)
        block_d = max(16, triton.next_power_of_2(d))
        _launch(
            _fwd_kernel,
            lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), batch * heads),
            q, k, v, out, lse2, pad_arg,
            lse2 if lse is None else lse,
            lse2 if entropy is None else entropy,
            lse2 if max_prob is None else max_prob,
            lse2 if max_logit is None else max_logit,
            lse2 if sink is None else sink,
            *_strides(q), *_strides(k), *_strides(v), *_strides(out), *pad_strides,
            heads, n, m, scale * _LOG2E, sink_tokens, _bucket(n), _bucket(m),
            GROUPS=heads // kv_heads, HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=causal,
            HAS_PAD=pad is not None, STATS=stats, SINK=stats and sink_tokens > 0,
            DOT_PRECISION=_dot_precision(q.dtype),
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse2, pad)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(
            *(x for x in (lse, entropy, max_prob, max_logit, sink) if x is not None)
        )
        return out, lse, entropy, max_prob, max_logit, sink

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, *_stat_grads):
        with _on_device(dout):
            return _TritonAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse2, pad = ctx.saved_tensors
        batch, heads, n, d = q.shape
        kv_heads, m = k.shape[1], k.shape[2]
        groups = heads // kv_heads
        dout = dout.to(q.dtype)
        block_d = max(16, triton.next_power_of_2(d))
        delta = torch.empty_like(lse2)
        delta_block = 16 if _INTERPRETED else 64
        _attn_bwd_delta[(triton.cdiv(n, delta_block), batch * heads)](
            out, dout, delta, *_strides(out), *_strides(dout), heads, n,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=delta_block,
        )  # fmt: skip
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        pad_arg = q if pad is None else pad
        pad_strides = (0, 0) if pad is None else _strides(pad)
        common = {
            "GROUPS": groups, "HEAD_DIM": d, "BLOCK_D": block_d, "CAUSAL": ctx.causal,
            "HAS_PAD": pad is not None, "DOT_PRECISION": _dot_precision(q.dtype),
        }  # fmt: skip
        _launch(
            _dkdv_kernel,
            lambda meta: (triton.cdiv(m, meta["BLOCK_N"]), batch * kv_heads),
            q, k, v, dout, lse2, delta, pad_arg, dk, dv,
            *_strides(q), *_strides(k), *_strides(v), *_strides(dout),
            *_strides(dk), *_strides(dv), *pad_strides,
            kv_heads, n, m, ctx.scale * _LOG2E, ctx.scale, _bucket(n), _bucket(m),
            **common,
        )  # fmt: skip
        _launch(
            _dq_kernel,
            lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), batch * heads),
            q, k, v, dout, lse2, delta, pad_arg, dq,
            *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dq), *pad_strides,
            heads, n, m, ctx.scale * _LOG2E, ctx.scale, _bucket(n), _bucket(m),
            **common,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    scale: float,
    return_stats: bool,
    sink_tokens: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...] | None]:
    """Fused attention on the Triton kernels; inputs already validated by ``attention``.

    Args:
        q: (B, H, N, D) queries, float16, bfloat16 or float32, D ≤ 256.
        k: (B, H_kv, M, D) keys, H_kv dividing H.
        v: (B, H_kv, M, D) values.
        causal: query i attends key j only when ``j ≤ i + M − N``.
        key_padding_mask: (B, M) bool, True where the key may be attended, or None.
        scale: the factor on ``q · k``.
        return_stats: also return the statistics.
        sink_tokens: number of leading keys whose attention mass is reported (0 for none).

    Returns:
        ``out`` (B, H, N, D) in q's dtype, and either None or the detached float32 (B, H, N)
        tensors ``(lse, entropy, max_prob, max_logit, sink_mass)``.

    Raises:
        ValueError: for CPU tensors when the kernels were not built for the interpreter (set
            ``TRITON_INTERPRET=1`` before triton is imported), or when B·H exceeds the grid limit.
    """
    if q.device.type == "cpu" and not _INTERPRETED:
        raise ValueError(
            "`backend='triton'` got CPU tensors but its kernels were compiled for the GPU: set "
            "TRITON_INTERPRET=1 before triton is first imported to run them in the interpreter"
        )
    batch, heads, n, _ = q.shape
    if batch * heads > _MAX_GRID_Y:
        raise ValueError(
            f"Expected B·H ≤ {_MAX_GRID_Y} for `backend='triton'`, got B={batch}, H={heads}"
        )
    if n == 0 or batch * heads == 0 or k.shape[2] == 0:
        from qkmonitor.kernels._torch import torch_attention  # nothing to fuse: empty rows

        return torch_attention(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
            return_stats=return_stats, sink_tokens=sink_tokens,
        )  # fmt: skip
    dtype = q.dtype
    if _INTERPRETED and dtype == torch.bfloat16:  # the interpreter's bfloat16 math is wrong
        q, k, v = q.float(), k.float(), v.float()
    pad = None if key_padding_mask is None else key_padding_mask.to(torch.int8)
    with _on_device(q):
        out, lse, entropy, max_prob, max_logit, sink = _TritonAttention.apply(
            q, k, v, pad, causal, scale, sink_tokens, return_stats
        )
    out = out.to(dtype)
    if not return_stats:
        return out, None
    return out, (lse, entropy, max_prob, max_logit, sink)
