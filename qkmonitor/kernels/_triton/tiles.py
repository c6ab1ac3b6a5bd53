"""The ``@triton.jit`` helpers the forward and backward kernels share: tiles, masks, key ranges.

A tile is ROWS rows × BLOCK_D columns of one head of a (B, H, N, D) tensor, described by the tuple
``(base, stride_r, stride_d)``: the head's first element and the strides of its rows and columns.
Head dims that are not powers of two are padded to BLOCK_D: columns from HEAD_DIM on load as zeros
and are never stored. Each tile's first row is added to its base pointer in int64
(``row · stride`` can pass 2^31 in long strided layouts, e.g. a (B, N, H, D) tensor viewed as
(B, H, N, D)); offsets inside a tile stay int32 (cheap, and small).

The causal mask is bottom-right aligned: query i attends key j iff ``j ≤ i + M − N``. Every loop
over key (or query) blocks is split into blocks that need no mask (full tiles, below the causal
diagonal) and blocks that do (the diagonal band and the ragged tail), which keeps masks out of the
bulk of the work: the helpers take that split as the constexpr MASKED (CHECK_ROWS for a tile).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_tile(
    tile,
    start,
    n_rows,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    """Rows ``start + [0, ROWS)`` of ``tile``, zero at rows ≥ ``n_rows`` (only checked when
    CHECK_ROWS) and at the padding columns ≥ HEAD_DIM."""
    base, stride_r, stride_d = tile
    base = base + tl.cast(start, tl.int64) * stride_r
    offs = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = base + offs[:, None] * stride_r + offs_d[None, :] * stride_d
    if CHECK_ROWS:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs, mask=offs[:, None] < n_rows - start, other=0.0)
        else:
            mask = (offs[:, None] < n_rows - start) & (offs_d[None, :] < HEAD_DIM)
            x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def store_tile(
    tile, x, start, n_rows, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Store ``x`` to the rows ``start + [0, ROWS)`` of ``tile`` below ``n_rows``, columns below
    HEAD_DIM."""
    base, stride_r, stride_d = tile
    base = base + tl.cast(start, tl.int64) * stride_r
    offs = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = base + offs[:, None] * stride_r + offs_d[None, :] * stride_d
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, x, mask=offs[:, None] < n_rows - start)
    else:
        tl.store(ptrs, x, mask=(offs[:, None] < n_rows - start) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def causal_ok(rows, cols, diag):
    """Whether query ``rows`` may attend key ``cols`` (broadcast) under the causal mask, with
    ``diag = M − N``."""
    return cols <= rows + diag


@triton.jit
def apply_mask(
    x,
    fill,
    rows,
    cols,
    n_cols,
    diag,
    pad,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
):
    """``x`` (one entry per query of ``rows`` × key of ``cols``) with ``fill`` where the query may
    not attend the key: with MASKED, keys ≥ ``n_cols`` and (CAUSAL) keys above the diagonal; with
    HAS_PAD, keys whose entry in the int8 key mask ``pad = (base, stride)`` is 0."""
    if MASKED:
        allowed = cols[None, :] < n_cols
        if CAUSAL:
            allowed = allowed & causal_ok(rows[:, None], cols[None, :], diag)
        x = tl.where(allowed, x, fill)
    if HAS_PAD:
        pad_base, stride_pn = pad
        keep = tl.load(pad_base + cols * stride_pn, mask=cols < n_cols, other=0) != 0
        x = tl.where(keep[None, :], x, fill)
    return x


@triton.jit
def key_range(
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
