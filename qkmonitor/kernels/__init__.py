"""Attention kernels: one entry point, several backends, optional per-row statistics.

``attention(q, k, v, ...)`` computes ``softmax(scale · q kᵀ) v`` without forming the N×M attention
matrix and, on request, statistics of each row's attention distribution (entropy, max probability,
max logit, log-sum-exp, attended keys, sink mass) from the same pass (docs/architecture.md, "The
kernel and its statistics"). Backends:

- ``"triton"``: fused FlashAttention-2 style kernels (``_triton/``), forward and backward; CUDA
  tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was imported.
- ``"torch"``: exact online computation over key blocks in PyTorch (``_torch.py``), any device.
- ``"auto"``: triton for CUDA tensors when triton >= 3.4 is installed, torch otherwise (with a
  warning when CUDA tensors meet a triton that is missing or too old).

Under autocast (``torch.autocast`` for the tensors' device, as Lightning's ``"bf16-mixed"`` and
``"16-mixed"`` precision use it) the inputs are cast as ``F.scaled_dot_product_attention`` casts
them, to the autocast dtype, and the kernels then run with autocast off: the output comes back in
the autocast dtype, and the statistics are still accumulated and returned in float32.

Example: ``out, stats = attention(q, k, v, causal=True, return_stats=True)``, then
``stats.entropy`` is (B, H, N), nats per query row.

Rounding (``pv_rounding``; docs/kernel.md, "Rounding of the softmax weights"), for float16 and
bfloat16 inputs only (float32 and float64 are never rounded): ``"float32"``, the weights
``e^{s − m}`` not rounded (the exact reference); ``"kernel"``, rounded to the values' dtype for
``P·V`` with float32 accumulation, as FlashAttention's GPU kernels do (biased where keys tie near
a row's max: Qiu & Yao 2025); ``"unbiased"``, rounded once and used rounded for the row sum, the
output and the statistics alike, so that the output is an exact average of the values;
``"auto"``, the backend's own: ``"kernel"`` on triton, on torch SDPA's (which rounds as
``"kernel"``) where it is exact and ``"float32"`` elsewhere.

Non-finite scores on allowed keys (docs/architecture.md, "Precision and non-finite values";
``attended`` always counts the allowed keys):

- a NaN score makes every other statistic of its row NaN (zeros stay reserved for fully masked
  rows);
- otherwise a +inf score gives ``lse = max_logit = +inf`` (exact: the max and the log-sum-exp of a
  set holding +inf) and NaN ``entropy``, ``max_prob``, ``sink_mass`` (the probabilities
  ``e^{s − lse}`` are ∞/∞, as softmax's are);
- a −inf score is probability 0, as in softmax; on the triton backend the row's entropy may then
  read NaN (see ``_triton``), never a wrong number.

``out`` of a NaN or +inf row is non-finite, as softmax makes it; other rows' outputs are
unaffected.

Triton is imported only when the triton backend runs, so this package imports without it. CUDA
builds of torch bring triton; a CPU-only install gets the interpreter with ``qkmonitor[triton]``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
import os
import re
import warnings

import torch

from qkmonitor.kernels._autocast import autocast_available, autocast_off
from qkmonitor.kernels._options import PV_ROUNDINGS, AttentionOptions
from qkmonitor.kernels._stats import AttentionStats, attended_keys
from qkmonitor.kernels._torch import max_logits, torch_attention
from qkmonitor.validation import check_bool, is_int, is_real

__all__ = [
    "PV_ROUNDINGS",
    "AttentionStats",
    "attended_keys",
    "attention",
    "attention_max_logits",
    "attention_stats",
    "autocast_off",
]

BACKENDS = ("auto", "triton", "torch")
#: The oldest triton the kernels run on (``triton.knobs``). On CPU, the interpreter of 3.4 - 3.8
#: needs numpy < 2.4; 3.9 runs under numpy 2.4.
TRITON_MIN_VERSION = (3, 4)
TRITON_MAX_HEAD_DIM = 256
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TORCH_DTYPES = _FLOAT_DTYPES + (torch.float64,)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    return_stats: bool = False,
    sink_tokens: int = 0,
    backend: str = "auto",
    pv_rounding: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, AttentionStats]:
    """Softmax attention ``out_i = Σ_j p_ij v_j``, ``p_ij = exp(s_ij) / Σ_{j'∈A_i} exp(s_ij')``.

    Scores are ``s_ij = scale · q_i · k_j`` over the keys ``A_i`` that query row i may attend: all M
    keys, minus those the key padding mask drops, minus (``causal``) those with
    ``j > i + M − N`` — the causal mask is aligned bottom-right, so the last query sees every key;
    with N > M the first N − M rows see none. A row with no key left gets ``out_i = 0`` and zero
    gradients, never NaN. Query head h reads key/value head ``h // (H / H_kv)`` (grouped-query and
    multi-query attention); repeated keys and values are never materialized. Statistics never
    change the output and carry no gradient.

    Args:
        q: (B, H, N, D) queries; float16, bfloat16 or float32 (float64 on the torch backend).
        k: (B, H_kv, M, D) keys, same dtype and device as ``q``; H_kv must divide H.
        v: (B, H_kv, M, D) values, same shape, dtype and device as ``k``.
        causal: apply the bottom-right aligned causal rule (query i attends key j iff
            ``j ≤ i + M − N``).
        key_padding_mask: (B, M) bool, **True where the key may be attended** (the Hugging Face
            ``attention_mask`` convention; integer 0/1 masks are accepted too). This is the
            opposite of ``torch.nn.MultiheadAttention``'s ``key_padding_mask``, where True means
            "ignore": pass ``~mask`` from there.
        scale: factor on ``q · k``; default ``1 / sqrt(D)``.
        return_stats: also return an :class:`AttentionStats` of the rows.
        sink_tokens: report the attention mass on the first ``sink_tokens`` keys as
            ``stats.sink_mass`` (0: don't, and ``sink_mass`` is None).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        pv_rounding: ``"auto"``, ``"float32"``, ``"kernel"`` or ``"unbiased"``: how float16
            and bfloat16 weights are rounded before ``P·V`` (the module docstring).

    Returns:
        ``out`` of shape (B, H, N, D) in q's dtype (under autocast: in the autocast dtype, as
        ``F.scaled_dot_product_attention`` returns it); with ``return_stats``, ``(out, stats)``
        where ``stats`` holds detached float32 (B, H, N) tensors (see :class:`AttentionStats`):
        ``lse = log Σ_j exp(s_ij)``, ``entropy = −Σ_j p_ij log p_ij`` (nats),
        ``max_prob = max_j p_ij``, ``max_logit = max_j s_ij``, ``attended = |A_i|`` and
        ``sink_mass = Σ_{j<sink_tokens} p_ij``. A fully masked row has ``lse = max_logit = −inf``
        and ``entropy = max_prob = attended = sink_mass = 0``. Non-finite scores on allowed keys:
        the module docstring.

    Raises:
        ValueError: if a shape, dtype, device or option is not supported (the message names the
            argument, what was expected and what was received), if ``backend="triton"`` is asked
            for CPU tensors without ``TRITON_INTERPRET=1`` or without triton installed, or for a
            head dim above 256.
    """
    options = (causal, key_padding_mask, scale, return_stats, sink_tokens, backend, pv_rounding)
    return _attention(q, k, v, *options)


def attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    sink_tokens: int = 0,
    backend: str = "auto",
) -> AttentionStats:
    """The :class:`AttentionStats` of :func:`attention` of ``q`` over ``k``, without its output.

    For measuring attention computed elsewhere (the adapters' side computations): no gradient,
    and on the torch backend no value accumulation (the Triton kernel computes the output of
    ``v = k`` and drops it). Arguments as :func:`attention`.
    """
    with torch.no_grad():
        out_and_stats = _attention(
            q, k, k, causal, key_padding_mask, scale, True, sink_tokens, backend, output=False
        )
        return out_and_stats[1]


def attention_max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Each head's largest scaled logit ``max_{i, j} scale · q_i · k_j`` over the keys each row may
    attend, without the softmax: ``AttentionStats.max_logit`` reduced over the rows, from blocks of
    query rows (no N x M matrix of a whole sequence; on any device, in float32 or float64).
    Arguments as :func:`attention`, without the values.

    Returns:
        (B, H) float32 (float64 for float64 inputs); ``-inf`` for a head of a sequence whose rows
        may attend no key.
    """
    q, k, _ = _autocast_inputs(q, k, k)
    _check_inputs(q, k, k, key_padding_mask, causal, scale, True, 0)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    with torch.no_grad(), autocast_off(q.device.type):
        return max_logits(q, k, causal=bool(causal), key_padding_mask=key_padding_mask, scale=scale)


def _attention(
    q,
    k,
    v,
    causal,
    key_padding_mask,
    scale,
    return_stats,
    sink_tokens,
    backend,
    pv_rounding="auto",
    output=True,
):
    q, k, v = _autocast_inputs(q, k, v)
    _check_inputs(q, k, v, key_padding_mask, causal, scale, return_stats, sink_tokens)
    if pv_rounding not in PV_ROUNDINGS:
        raise ValueError(f"Expected `pv_rounding` to be one of {PV_ROUNDINGS}, got {pv_rounding!r}")
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    use_triton = _choose_backend(backend, q)
    options = AttentionOptions(
        bool(causal), key_padding_mask, scale, bool(return_stats), int(sink_tokens), pv_rounding
    )
    run = _run_kernel if _DYNAMO_TRACES_KERNELS else _kernel_outside_dynamo()
    out, raw = run(use_triton, q, k, v, options, output)
    if not return_stats:
        return out
    lse, entropy, max_prob, max_logit, sink_mass = raw
    batch, heads, n = q.shape[:3]
    attended = attended_keys(
        batch,
        heads,
        n,
        k.shape[2],
        causal=causal,
        key_padding_mask=key_padding_mask,
        device=q.device,
    )
    return out, AttentionStats(lse, entropy, max_prob, max_logit, attended, sink_mass)


def _run_kernel(use_triton: bool, q, k, v, options: AttentionOptions, output: bool):
    """The chosen backend's forward, autocast off: the kernels pick their own precision."""
    with autocast_off(q.device.type):
        if use_triton:
            from qkmonitor.kernels._triton import triton_attention

            return triton_attention(q, k, v, options)
        return torch_attention(q, k, v, options, output=output)


#: Whether torch.compile traces the kernels' autograd functions. Dynamo of torch 2.4 fails inside
#: the torch backend's ``BlockwiseAttention.apply`` (an internal error, "'NoneType' object has no
#: attribute 'node'", on the bundled model with the QK clip); 2.8 traces it. Before 2.8 the
#: kernel call runs eagerly: a graph break at one function of fixed identity.
_DYNAMO_TRACES_KERNELS = torch.__version__ >= "2.8"


@functools.cache
def _kernel_outside_dynamo():
    """:func:`_run_kernel` behind ``torch.compiler.disable``, made when first needed (importing
    dynamo imports triton, which ``import qkmonitor`` must not)."""
    return torch.compiler.disable(_run_kernel)


def _autocast_inputs(q, k, v):
    """Cast q, k, v to the autocast dtype when autocast is on for their device, as autocast casts
    the inputs of ``F.scaled_dot_product_attention`` (float64 and non-float tensors are left
    alone, as autocast leaves them). The cast is differentiable: gradients reach the inputs in
    their own dtype."""
    if not isinstance(q, torch.Tensor):
        return q, k, v
    device_type = q.device.type
    if not autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)

    def cast(x):
        eligible = (
            isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
        )
        return x.to(dtype) if eligible else x

    return cast(q), cast(k), cast(v)


def _check_inputs(q, k, v, key_padding_mask, causal, scale, return_stats, sink_tokens) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"Expected `{name}` to be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            layout = "(B, H, N, D)" if name == "q" else "(B, H_kv, M, D)"
            raise ValueError(
                f"Expected `{name}` of shape {layout}, got {x.dim()} dims: {tuple(x.shape)}"
            )
    if q.dtype not in _TORCH_DTYPES:
        raise ValueError(
            f"Expected `q` of dtype float16, bfloat16, float32 or float64, got {q.dtype}"
        )
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise ValueError(f"Expected `{name}` of q's dtype {q.dtype}, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"Expected `{name}` on q's device {q.device}, got {x.device}")
    if k.shape != v.shape:
        raise ValueError(
            f"Expected `k` and `v` of the same shape (B, H_kv, M, D), got {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )
    (b, h, _, d), (b_kv, h_kv, _, d_kv) = q.shape, k.shape
    if b_kv != b:
        raise ValueError(f"Expected `k`, `v` with q's batch size {b}, got {b_kv}")
    if d_kv != d:
        raise ValueError(f"Expected `k`, `v` with q's head dim {d}, got {d_kv}")
    if d == 0:
        raise ValueError(f"Expected a head dim D ≥ 1, got `q` of shape {tuple(q.shape)}")
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(
            f"Expected the key/value heads H_kv to divide the query heads H, got H={h}, "
            f"H_kv={h_kv} (H % H_kv must be 0)"
        )
    if key_padding_mask is not None:
        _check_mask(key_padding_mask, q, k)
    check_bool("causal", causal)
    check_bool("return_stats", return_stats)
    if scale is not None and (not is_real(scale) or not math.isfinite(scale)):
        raise ValueError(f"Expected `scale` to be a finite float or None, got {scale!r}")
    if not is_int(sink_tokens, 0):
        raise ValueError(f"Expected `sink_tokens` to be a non-negative int, got {sink_tokens!r}")


def _check_mask(mask, q, k) -> None:
    if not isinstance(mask, torch.Tensor):
        raise ValueError(
            f"Expected `key_padding_mask` to be a (B, M) bool tensor, got {type(mask).__name__}"
        )
    expected = (k.shape[0], k.shape[2])
    if tuple(mask.shape) != expected:
        raise ValueError(
            f"Expected `key_padding_mask` of shape (B, M) = {expected}, got {tuple(mask.shape)}"
        )
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise ValueError(
            "Expected `key_padding_mask` to be a bool tensor (True = key may be attended), got "
            f"{mask.dtype}; additive float masks are not supported"
        )
    if mask.device != q.device:
        raise ValueError(f"Expected `key_padding_mask` on q's device {q.device}, got {mask.device}")


def _choose_backend(backend: str, q: torch.Tensor) -> bool:
    """True for the triton backend, False for torch; raises if the choice cannot run here."""
    if backend not in BACKENDS:
        raise ValueError(f"Expected `backend` to be one of {BACKENDS}, got {backend!r}")
    triton_ok = q.dtype in _FLOAT_DTYPES and q.shape[-1] <= TRITON_MAX_HEAD_DIM
    if backend == "torch":
        return False
    if backend == "auto":
        if not (q.is_cuda and triton_ok):
            return False
        missing = _triton_missing()
        if missing:
            warnings.warn(
                f"qkmonitor: the fused Triton kernel is not used: {missing}; "
                "attention runs on the torch backend",
                RuntimeWarning,
                stacklevel=3,
            )
        return not missing
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"Expected float16, bfloat16 or float32 inputs for `backend='triton'`, got {q.dtype}"
        )
    if q.shape[-1] > TRITON_MAX_HEAD_DIM:
        raise ValueError(
            f"Expected a head dim D ≤ {TRITON_MAX_HEAD_DIM} for `backend='triton'`, got "
            f"{q.shape[-1]}; use backend='torch'"
        )
    if q.device.type == "cpu" and not _interpreter_requested():
        raise ValueError(
            "`backend='triton'` runs on CUDA tensors, or on CPU tensors only under the Triton "
            "interpreter (set TRITON_INTERPRET=1 before triton is imported); got CPU tensors"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"`backend='triton'` runs on CUDA tensors, got {q.device.type} tensors")
    missing = _triton_missing()  # last: the input's own problems are named whatever is installed
    if missing:
        raise ValueError(f"`backend='triton'` cannot run: {missing}; use backend='torch'")
    return True


@functools.cache
def _triton_missing() -> str:
    """Why the triton backend cannot run here (no triton, or one older than 3.4), or ``""``.

    Reads the installed version without importing triton (the interpreter flag is read at import);
    once per process, as the installed packages do not change under it.
    """
    if importlib.util.find_spec("triton") is None:
        return (
            "the `triton` package is not installed (CUDA builds of torch bring it; on a CPU-only "
            "machine `pip install 'qkmonitor[triton]'` gives the interpreter)"
        )
    try:
        version = importlib.metadata.version("triton")
    except (
        importlib.metadata.PackageNotFoundError
    ):  # a differently named build (e.g. pytorch-triton)
        return ""
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if numbers < TRITON_MIN_VERSION:
        need = ".".join(map(str, TRITON_MIN_VERSION))
        return (
            f"triton {version} is installed and the kernels need triton >= {need} "
            f"(`triton.knobs`; CUDA builds of torch >= 2.8 bring it)"
        )
    return ""


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
