"""The forward kernel: attention output and per-row statistics in one pass (FlashAttention-2).

One program per block of BLOCK_M query rows of one head; under the causal mask the programs take
the query blocks last to first, so that the longest rows (the most key blocks) start first and
the shortest are left for the tail of the launch, as FlashAttention-2 orders them. Scores are
kept in base 2: ``t = log2(e) · scale · q kᵀ`` (the factor is folded into one multiply so that
``exp2`` replaces ``exp``). Over key blocks the program keeps, per row, the running max ``m``,
``l = Σ_j 2^{t_j − m}``, the output accumulator ``acc = Σ_j 2^{t_j − m} v_j`` and the centered
``u = Σ_j 2^{t_j − m}(t_j − m)``. When the max grows from ``m`` to ``m'`` the sums are rescaled by
``α = 2^{m − m'}`` and ``u ← α(u + (m − m')·l) + Σ_j 2^{t_j − m'}(t_j − m')``. At the end, in
natural units (``ln 2`` converts):

    out = acc / l,  lse = ln2·(m + log2 l),  entropy = ln2·(log2 l − u / l) ≥ 0,
    max_prob = 1 / l,  max_logit = ln2·m,  sink_mass = (Σ_{j<S} 2^{t_j − m}) / l.

The weights meet the values as ``tl.dot(p.to(v.dtype), v, acc)``: rounded to the values' dtype,
accumulated in float32. With ``PV_UNBIASED`` (``pv_rounding="unbiased"``; not the default: it
spills registers on sm_90 with statistics) ``p`` is rounded once, right after ``exp2``, and ``l``,
``u`` and ``acc`` all sum the rounded weights: the output is then an exact average of the values
(docs/kernel.md, "Rounding of the softmax weights"). ``EMULATE_BF16`` rounds to bfloat16 on the
bits where the interpreter runs bfloat16 inputs as float32 (never on a GPU).

The sink sum is not carried through the loop: after it, the first S keys are scored again and
summed with the final ``m`` (usually one extra block; a third running sum makes the loop spill
registers on sm_90). Masked scores are −inf; a row whose keys are all masked keeps ``m = −inf``
and ``l = 0`` and is finished as out = 0, lse = max_logit = −inf, entropy = max_prob = 0.
Exponents are taken against ``m`` clamped to ±FLT_MAX, so ``−inf − (−inf)`` and ``∞ − ∞`` never
arise, and masked entries of ``p·(t − m)`` are selected away (in tiles without masks they are not:
see below).

Non-finite scores on allowed keys (the contract of ``attention``): a NaN score makes ``l`` NaN (a
NaN ``p`` enters the sum, and NaN stays NaN under rescaling), so the epilogue reads the row's
state from ``l`` alone: ``l = 0`` no key, ``l`` NaN a NaN score, ``l = +inf`` a +inf score
(``2^{∞ − FLT_MAX}``), finite otherwise. The running max cannot tell: the GPU's ``max.f32``
returns the non-NaN operand, so ``m`` skips NaN scores there (the interpreter's numpy propagates
them). A −inf score on an allowed key is probability 0 for out, lse and max_prob; in a tile
without masks its ``p·(t − m) = 0·(−inf)`` makes the row's entropy NaN (a select per score in the
hot loop would avoid it, for inputs that already hold ±inf), never a wrong finite number.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qkmonitor.kernels._triton.tiles import apply_mask, key_range, load_tile, store_tile

_LN2 = tl.constexpr(0.6931471805599453)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _fwd_inner(
    acc,
    m_i,
    l_i,
    u_i,
    q,
    k_tile,
    v_tile,
    pad,
    offs_m,
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
    PV_UNBIASED: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """The online softmax over the key blocks ``[lo, hi)``: the updated ``acc, m, l, u``."""
    diag = n_ctx_k - n_ctx_q
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_tile(k_tile, start_n, n_ctx_k, BLOCK_N, HEAD_DIM, BLOCK_D, MASKED)
        t = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        t = apply_mask(t, float("-inf"), offs_m, cols, n_ctx_k, diag, pad, MASKED, CAUSAL, HAS_PAD)
        m_new = tl.maximum(m_i, tl.max(t, 1))
        # A finite shift: m = −inf (no key of the row seen yet) would give −inf − (−inf), and
        # m = +inf (an infinite score) ∞ − ∞; clamped, masked keys keep 2^{−inf} = 0 and an
        # infinite score makes l = +inf, which the epilogue reads.
        m_use = tl.clamp(m_new, -_FLT_MAX, _FLT_MAX)
        t = t - m_use[:, None]
        p = tl.math.exp2(t)
        if PV_UNBIASED:  # the rounded weights for l, u and acc alike
            p = round_weights(p, q.dtype, EMULATE_BF16)
        alpha = tl.math.exp2(m_i - m_use)
        if STATS:
            if MASKED or HAS_PAD:
                pt = p * tl.where(p > 0.0, t, 0.0)  # no 0·(−inf) at masked keys
            else:
                pt = p * t
            shift = tl.where(l_i > 0.0, m_i - m_use, 0.0) * l_i  # no (−inf)·0 before the first key
            u_i = alpha * (u_i + shift) + tl.sum(pt, 1)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_tile, start_n, n_ctx_k, BLOCK_N, HEAD_DIM, BLOCK_D, MASKED)
        acc = acc * alpha[:, None]
        if EMULATE_BF16 and not PV_UNBIASED:
            acc = tl.dot(round_weights(p, q.dtype, True), v, acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i, u_i


@triton.jit
def round_weights(p, dtype, EMULATE_BF16: tl.constexpr):
    """``p`` (float32) rounded to ``dtype`` (to nearest, ties to even), back in float32. With
    ``EMULATE_BF16`` (the interpreter, whose bfloat16 runs as float32 and whose cast to bfloat16
    truncates) the rounding to bfloat16 is done on the bits."""
    if EMULATE_BF16:
        bits = p.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return p.to(dtype).to(tl.float32)


@triton.jit
def _row_stat(value, healthy, empty):
    """A probability statistic of each row: 0 on rows with no key, NaN on NaN and +inf rows."""
    return tl.where(healthy, tl.where(empty, 0.0, value), float("nan"))


@triton.jit(do_not_specialize=["n_heads", "n_ctx_q", "n_ctx_k", "sink_tokens"])
def attn_fwd(
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
    PV_UNBIASED: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0)
    if CAUSAL:  # the longest rows first: the last programs to start are the shortest ones
        start_m = tl.num_programs(0) - 1 - start_m
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    h_kv = h // GROUPS
    k_tile = (K + b * stride_kb + h_kv * stride_kh, stride_kn, stride_kd)
    v_tile = (V + b * stride_vb + h_kv * stride_vh, stride_vn, stride_vd)
    o_tile = (Out + b * stride_ob + h * stride_oh, stride_on, stride_od)
    pad = (Pad + b * stride_pb, stride_pn)

    row0 = start_m * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    q_tile = (Q + b * stride_qb + h * stride_qh, stride_qn, stride_qd)
    q = load_tile(q_tile, row0, n_ctx_q, BLOCK_M, HEAD_DIM, BLOCK_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    u_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full, hi = key_range(start_m, n_ctx_q, n_ctx_k, CAUSAL, BLOCK_M, BLOCK_N)
    bounds = (0, full, hi)
    for masked in tl.static_range(2):  # the key blocks [0, full) need no mask, [full, hi) do
        acc, m_i, l_i, u_i = _fwd_inner(
            acc=acc,
            m_i=m_i,
            l_i=l_i,
            u_i=u_i,
            q=q,
            k_tile=k_tile,
            v_tile=v_tile,
            pad=pad,
            offs_m=offs_m,
            lo=bounds[masked],
            hi=bounds[masked + 1],
            n_ctx_q=n_ctx_q,
            n_ctx_k=n_ctx_k,
            qk_scale=qk_scale,
            HEAD_DIM=HEAD_DIM,
            BLOCK_D=BLOCK_D,
            BLOCK_N=BLOCK_N,
            MASKED=masked == 1,
            CAUSAL=CAUSAL,
            HAS_PAD=HAS_PAD,
            STATS=STATS,
            DOT_PRECISION=DOT_PRECISION,
            PV_UNBIASED=PV_UNBIASED,
            EMULATE_BF16=EMULATE_BF16,
        )

    # l = 0: no key (fully masked row); l = NaN: a NaN score; l = +inf: a +inf score.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    store_tile(o_tile, out.to(Out.dtype.element_ty), row0, n_ctx_q, BLOCK_M, HEAD_DIM, BLOCK_D)

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
            # Σ_{j<S} 2^{t_j − m} over the allowed sink keys, with the row's final max m: one
            # more q kᵀ over the first S keys (usually one block) after the main loop rather than
            # a third running sum carried through it, which, rescaled every step and updated
            # under a data-dependent branch, pushes the main loop past the register file (ptxas
            # spills on sm_90).
            m_use = tl.clamp(m_i, -_FLT_MAX, _FLT_MAX)  # a finite shift, as in the main loop
            n_sink = tl.minimum(sink_tokens, n_ctx_k)
            sink_i = tl.zeros_like(m_i)
            for start_n in tl.range(0, n_sink, BLOCK_N, num_stages=1):  # usually one block
                start_n = tl.multiple_of(start_n, BLOCK_N)
                cols = start_n + tl.arange(0, BLOCK_N)
                k = load_tile(k_tile, start_n, n_sink, BLOCK_N, HEAD_DIM, BLOCK_D, True)
                t = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
                # select, not multiply: exp2 of a disallowed score may overflow to inf
                p = tl.math.exp2(t - m_use[:, None])
                diag = n_ctx_k - n_ctx_q
                p = apply_mask(p, 0.0, offs_m, cols, n_sink, diag, pad, True, CAUSAL, HAS_PAD)
                sink_i += tl.sum(p, 1)
            tl.store(Sink + row_ptr, _row_stat(sink_i * inv_l, healthy, empty), mask=row_ok)
