"""The autograd function over the Triton kernels, and ``triton_attention``, the backend's entry."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import triton

from qkmonitor.kernels._options import AttentionOptions
from qkmonitor.kernels._triton.backward import attn_bwd_delta
from qkmonitor.kernels._triton.tuning import (
    DELTA_BLOCK_M,
    INTERPRETED,
    bucket,
    dkdv_kernel,
    dq_kernel,
    fwd_kernel,
    launch,
)

__all__ = ["TritonAttention", "triton_attention"]

_LOG2E = 1.4426950408889634
_MAX_GRID_Y = 65535


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype != torch.float32:
        return "tf32"  # Triton's default; only float32 operands read it
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _strides(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.stride())


def _on_device(x: torch.Tensor):
    """Launch on the tensor's GPU, not the current one (the backward runs on autograd's thread)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


class TritonAttention(torch.autograd.Function):
    """``(q, k, v, pad, causal, scale, sink_tokens, stats) -> (out, lse, entropy, max_prob,
    max_logit, sink)``; the statistics are None without ``stats`` and not differentiable."""

    @staticmethod
    def forward(
        ctx, q, k, v, pad, causal, scale, sink_tokens, stats, pv_unbiased=False, emulate=False
    ):
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
        # Statistics not asked for point at lse2: the kernel does not write them.
        outputs = [lse2 if x is None else x for x in (lse, entropy, max_prob, max_logit, sink)]
        tensors = (q, k, v, out, lse2, pad_arg, *outputs)
        strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(out), *pad_strides)
        sizes = (heads, n, m, scale * _LOG2E, sink_tokens, bucket(n), bucket(m))
        launch(
            fwd_kernel,
            lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), batch * heads),
            *tensors,
            *strides,
            *sizes,
            GROUPS=heads // kv_heads,
            HEAD_DIM=d,
            BLOCK_D=_block_d(d),
            CAUSAL=causal,
            HAS_PAD=pad is not None,
            STATS=stats,
            SINK=stats and sink_tokens > 0,
            DOT_PRECISION=_dot_precision(q.dtype),
            # float32 values: rounding to them changes nothing (one build for both)
            PV_UNBIASED=pv_unbiased and (emulate or q.dtype != torch.float32),
            EMULATE_BF16=emulate,
        )
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
            return TritonAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse2, pad = ctx.saved_tensors
        batch, heads, n, d = q.shape
        kv_heads, m = k.shape[1], k.shape[2]
        dout = dout.to(q.dtype)
        delta = torch.empty_like(lse2)
        delta_grid = (triton.cdiv(n, DELTA_BLOCK_M), batch * heads)
        delta_strides = (*_strides(out), *_strides(dout))
        attn_bwd_delta[delta_grid](
            out,
            dout,
            delta,
            *delta_strides,
            heads,
            n,
            HEAD_DIM=d,
            BLOCK_D=_block_d(d),
            BLOCK_M=DELTA_BLOCK_M,
        )
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        pad_arg = q if pad is None else pad
        pad_strides = (0, 0) if pad is None else _strides(pad)
        inputs = (q, k, v, dout, lse2, delta, pad_arg)
        input_strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout))
        common = {
            "GROUPS": heads // kv_heads,
            "HEAD_DIM": d,
            "BLOCK_D": _block_d(d),
            "CAUSAL": ctx.causal,
            "HAS_PAD": pad is not None,
            "DOT_PRECISION": _dot_precision(q.dtype),
        }
        dkdv_strides = (*input_strides, *_strides(dk), *_strides(dv), *pad_strides)
        dkdv_sizes = (kv_heads, n, m, ctx.scale * _LOG2E, ctx.scale, bucket(n), bucket(m))
        launch(
            dkdv_kernel,
            lambda meta: (triton.cdiv(m, meta["BLOCK_N"]), batch * kv_heads),
            *inputs,
            dk,
            dv,
            *dkdv_strides,
            *dkdv_sizes,
            **common,
        )
        dq_strides = (*input_strides, *_strides(dq), *pad_strides)
        dq_sizes = (heads, n, m, ctx.scale * _LOG2E, ctx.scale, bucket(n), bucket(m))
        launch(
            dq_kernel,
            lambda meta: (triton.cdiv(n, meta["BLOCK_M"]), batch * heads),
            *inputs,
            dq,
            *dq_strides,
            *dq_sizes,
            **common,
        )
        return dq, dk, dv, None, None, None, None, None, None, None


def _block_d(d: int) -> int:
    """The head dim padded to a power of two, at least 16 (the smallest ``tl.dot`` operand)."""
    return max(16, triton.next_power_of_2(d))


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: AttentionOptions,
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...] | None]:
    """Fused attention on the Triton kernels; inputs already validated by ``attention``.

    Args:
        q: (B, H, N, D) queries, float16, bfloat16 or float32, D ≤ 256.
        k: (B, H_kv, M, D) keys, H_kv dividing H.
        v: (B, H_kv, M, D) values.
        options: the call's options (mask, causal rule, scale, statistics, sink keys).

    Returns:
        ``out`` (B, H, N, D) in q's dtype, and either None or the detached float32 (B, H, N)
        tensors ``(lse, entropy, max_prob, max_logit, sink_mass)``.

    Raises:
        ValueError: for CPU tensors when the kernels were not built for the interpreter (set
            ``TRITON_INTERPRET=1`` before triton is imported), or when H alone exceeds the grid's
            limit of 65,535 (B·H beyond it is split into launches over slices of the batch).
    """
    if q.device.type == "cpu" and not INTERPRETED:
        raise ValueError(
            "`backend='triton'` got CPU tensors but its kernels were compiled for the GPU: set "
            "TRITON_INTERPRET=1 before triton is first imported to run them in the interpreter"
        )
    batch, heads, n, _ = q.shape
    if heads > _MAX_GRID_Y:
        raise ValueError(f"Expected H ≤ {_MAX_GRID_Y} for `backend='triton'`, got H={heads}")
    if batch * heads > _MAX_GRID_Y:  # B·H is the grid's second axis: one launch per batch slice
        return _in_batch_slices(q, k, v, options, batch_per_launch=_MAX_GRID_Y // heads)
    if n == 0 or batch * heads == 0 or k.shape[2] == 0:
        from qkmonitor.kernels._torch import torch_attention  # nothing to fuse: empty rows

        return torch_attention(q, k, v, options)
    dtype = q.dtype
    # "auto": the kernel's own rounding (docs/kernel.md: the unbiased one spills registers on
    # sm_90 with statistics, so it is not the default before a GPU measures it); "float32": the
    # kernel in float32
    rounding = options.weight_rounding(dtype, auto="kernel")
    if rounding is None and dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    emulate = INTERPRETED and dtype == torch.bfloat16 and rounding is not None
    if emulate:  # the interpreter's bfloat16 math is wrong: float32, with p rounded on its bits
        q, k, v = q.float(), k.float(), v.float()
    mask = options.key_padding_mask
    pad = None if mask is None else mask.to(torch.int8)
    with _on_device(q):
        out, lse, entropy, max_prob, max_logit, sink = TritonAttention.apply(
            q, k, v, pad, options.causal, options.scale, options.sink_tokens,
            options.return_stats, rounding is not None and rounding[1], emulate,
        )  # fmt: skip
    out = out.to(dtype)
    if not options.return_stats:
        return out, None
    return out, (lse, entropy, max_prob, max_logit, sink)


def _in_batch_slices(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: AttentionOptions,
    *,
    batch_per_launch: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...] | None]:
    """:func:`triton_attention` over slices of ``batch_per_launch`` sequences, concatenated (each
    slice its own autograd node: the gradients flow back through the concatenation)."""
    mask = options.key_padding_mask
    slices = [slice(i, i + batch_per_launch) for i in range(0, q.shape[0], batch_per_launch)]
    parts = [
        triton_attention(
            q[s],
            k[s],
            v[s],
            dataclasses.replace(options, key_padding_mask=None if mask is None else mask[s]),
        )
        for s in slices
    ]
    out = torch.cat([o for o, _ in parts])
    if not options.return_stats:
        return out, None
    stats = tuple(
        None if values[0] is None else torch.cat(values)
        for values in zip(*(stats for _, stats in parts))
    )
    return out, stats
