"""The backward kernels (Dao, "FlashAttention-2", 2023, Algorithm 2), split so that nothing needs
atomics.

With ``p = 2^{t − lse2}`` (``lse2 = +inf`` on fully masked rows so p = 0 there),
``δ_i = Σ_d dO_id O_id`` and ``dS = p ⊙ (dO vᵀ − δ)``:

- ``attn_bwd_delta``: δ, one program per block of query rows.
- ``attn_bwd_dkdv``: one program per block of BLOCK_N keys of one key/value head; it loops over
  (query head of its group, query block) pairs in one flat loop (grouped-query attention without
  repeating k and v), accumulating ``dV = pᵀ dO`` and ``dK = scale · dSᵀ q``.
- ``attn_bwd_dq``: one program per block of query rows, looping over key blocks:
  ``dQ = scale · dS k``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from qkmonitor.kernels._triton.tiles import (
    apply_mask,
    causal_ok,
    key_range,
    load_tile,
    store_tile,
)


@triton.jit(do_not_specialize=["n_heads", "n_ctx_q"])
def attn_bwd_delta(
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
    offs_m = row0 + tl.arange(0, BLOCK_M)
    o_tile = (Out + b * stride_ob + h * stride_oh, stride_on, stride_od)
    do_tile = (dO + b * stride_dob + h * stride_doh, stride_don, stride_dod)
    o = load_tile(o_tile, row0, n_ctx_q, BLOCK_M, HEAD_DIM, BLOCK_D, True)
    do = load_tile(do_tile, row0, n_ctx_q, BLOCK_M, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + pid_bh.to(tl.int64) * n_ctx_q + offs_m, delta, mask=offs_m < n_ctx_q)


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_tile,
    do_tile,
    stride_qh,
    stride_doh,
    lse2_base,
    delta_base,
    cols,
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
    head (``q_tile`` and ``do_tile`` are the group's first head, ``stride_qh`` and ``stride_doh``
    step to the next; Lse2/Delta rows of consecutive heads are ``n_ctx_q`` apart).

    One flat loop over (head, query block) pairs rather than a loop over heads around a loop over
    blocks: the nested form keeps the software pipeline's prologue and epilogue inside the outer
    loop and, on sm_90, drives ptxas to spill for GROUPS > 1.
    """
    q_base, stride_qn, stride_qd = q_tile
    do_base, stride_don, stride_dod = do_tile
    diag = n_ctx_k - n_ctx_q
    offs_m = tl.arange(0, BLOCK_M)
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
        q_g = (q_base + g64 * stride_qh, stride_qn, stride_qd)
        do_g = (do_base + g64 * stride_doh, stride_don, stride_dod)
        q = load_tile(q_g, start_m, n_ctx_q, BLOCK_M, HEAD_DIM, BLOCK_D, MASKED)
        do = load_tile(do_g, start_m, n_ctx_q, BLOCK_M, HEAD_DIM, BLOCK_D, MASKED)
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
            p_T = tl.where(causal_ok(rows[None, :], cols[:, None], diag), p_T, 0.0)
        dv = tl.dot(p_T.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_T = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_T = p_T * (dp_T - delta[None, :])
        dk = tl.dot(ds_T.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["n_kv_heads", "n_ctx_q", "n_ctx_k"])
def attn_bwd_dkdv(
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
    cols = start_n + tl.arange(0, BLOCK_N)
    k_tile = (K + b * stride_kb + h_kv * stride_kh, stride_kn, stride_kd)
    v_tile = (V + b * stride_vb + h_kv * stride_vh, stride_vn, stride_vd)
    dk_tile = (dK + b * stride_dkb + h_kv * stride_dkh, stride_dkn, stride_dkd)
    dv_tile = (dV + b * stride_dvb + h_kv * stride_dvh, stride_dvn, stride_dvd)
    k = load_tile(k_tile, start_n, n_ctx_k, BLOCK_N, HEAD_DIM, BLOCK_D, True)
    v = load_tile(v_tile, start_n, n_ctx_k, BLOCK_N, HEAD_DIM, BLOCK_D, True)
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
    q_tile = (Q + b * stride_qb + h0 * stride_qh, stride_qn, stride_qd)
    do_tile = (dO + b * stride_dob + h0 * stride_doh, stride_don, stride_dod)
    row_base = (b * (n_kv_heads * GROUPS) + h0) * n_ctx_q
    lse2_base = Lse2 + row_base
    delta_base = Delta + row_base
    bounds = (lo, diag_hi, full_lo, full_hi, tail_lo, q_stop)
    for part in tl.static_range(3):  # the diagonal band and the tail need masks, the middle not
        dk, dv = _dkdv_inner(
            dk=dk,
            dv=dv,
            k=k,
            v=v,
            q_tile=q_tile,
            do_tile=do_tile,
            stride_qh=stride_qh,
            stride_doh=stride_doh,
            lse2_base=lse2_base,
            delta_base=delta_base,
            cols=cols,
            lo=bounds[2 * part],
            hi=bounds[2 * part + 1],
            n_ctx_q=n_ctx_q,
            n_ctx_k=n_ctx_k,
            qk_scale=qk_scale,
            GROUPS=GROUPS,
            HEAD_DIM=HEAD_DIM,
            BLOCK_D=BLOCK_D,
            BLOCK_M=BLOCK_M,
            MASKED=part != 1,
            CAUSAL=CAUSAL,
            DOT_PRECISION=DOT_PRECISION,
        )

    dk = dk * sm_scale
    if HAS_PAD:
        # Scores of padded keys were never in the softmax; their rows may hold junk.
        dk = tl.where(keep[:, None], dk, 0.0)
        dv = tl.where(keep[:, None], dv, 0.0)
    store_tile(dk_tile, dk.to(dK.dtype.element_ty), start_n, n_ctx_k, BLOCK_N, HEAD_DIM, BLOCK_D)
    store_tile(dv_tile, dv.to(dV.dtype.element_ty), start_n, n_ctx_k, BLOCK_N, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
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
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate ``dQ`` over the key blocks ``[lo, hi)``."""
    diag = n_ctx_k - n_ctx_q
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_tile(k_tile, start_n, n_ctx_k, BLOCK_N, HEAD_DIM, BLOCK_D, MASKED)
        v = load_tile(v_tile, start_n, n_ctx_k, BLOCK_N, HEAD_DIM, BLOCK_D, MASKED)
        t = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.math.exp2(t - lse2[:, None])
        p = apply_mask(p, 0.0, offs_m, cols, n_ctx_k, diag, pad, MASKED, CAUSAL, HAS_PAD)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["n_heads", "n_ctx_q", "n_ctx_k"])
def attn_bwd_dq(
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
    offs_m = row0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_ctx_q
    q_tile = (Q + b * stride_qb + h * stride_qh, stride_qn, stride_qd)
    do_tile = (dO + b * stride_dob + h * stride_doh, stride_don, stride_dod)
    dq_tile = (dQ + b * stride_dqb + h * stride_dqh, stride_dqn, stride_dqd)
    q = load_tile(q_tile, row0, n_ctx_q, BLOCK_M, HEAD_DIM, BLOCK_D, True)
    do = load_tile(do_tile, row0, n_ctx_q, BLOCK_M, HEAD_DIM, BLOCK_D, True)
    row_ptr = pid_bh.to(tl.int64) * n_ctx_q + offs_m
    lse2 = tl.load(Lse2 + row_ptr, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + row_ptr, mask=row_ok, other=0.0)
    k_tile = (K + b * stride_kb + h_kv * stride_kh, stride_kn, stride_kd)
    v_tile = (V + b * stride_vb + h_kv * stride_vh, stride_vn, stride_vd)
    pad = (Pad + b * stride_pb, stride_pn)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full, hi = key_range(start_m, n_ctx_q, n_ctx_k, CAUSAL, BLOCK_M, BLOCK_N)
    bounds = (0, full, hi)
    for masked in tl.static_range(2):  # the key blocks [0, full) need no mask, [full, hi) do
        dq = _dq_inner(
            dq=dq,
            q=q,
            do=do,
            lse2=lse2,
            delta=delta,
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
            DOT_PRECISION=DOT_PRECISION,
        )
    dq = dq * sm_scale
    store_tile(dq_tile, dq.to(dQ.dtype.element_ty), row0, n_ctx_q, BLOCK_M, HEAD_DIM, BLOCK_D)
