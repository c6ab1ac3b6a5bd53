r"""The spectrum of every head's ``W_QK`` of one layer, from Gram matrices: the method the
monitors use (:func:`qk_head_spectra`; the runs over a model's layers are
:mod:`qkmonitor.measures.layer_spectra`).

Conventions are those of :mod:`qkmonitor.measures.spectra` (docs/architecture.md, "Metric
definitions"): for head ``h`` of key/value group ``g``, ``W_Q^h`` is d x d_k, ``W_K^g`` is d' x d_k
and ``W_QK^h = W_Q^h (W_K^g)^T``. Per layer, three batched products over the long dimension d are
the only O(d) work:

.. math::

    G_Q^h = W_Q^{h\top} W_Q^h, \qquad G_K^g = W_K^{g\top} W_K^g, \qquad
    C^h = W_K^{g\top} W_Q^h \qquad (\text{each } d_k \times d_k).

``G_Q`` and ``G_K`` are batched matmuls over the heads (three quarters of a full product: the
block below the diagonal is the one above it, transposed), ``C`` one matmul per key/value group
(the group's query heads side by side against its one ``W_K^g``). Everything else is on
d_k x d_k matrices, in float64:

- **singular values** (one symmetric eigenproblem per head, the only "SVD"): with a factor
  ``F`` of ``G_K^g = F^T F`` (Cholesky; an eigendecomposition where ``W_K^g`` is rank-deficient),
  ``W_K^g = Q F`` for some ``Q`` with orthonormal columns, so ``W_QK^h = W_Q^h F^T Q^T`` and
  ``σ_i(W_QK^h)² = λ_i(F G_Q^h F^T)``;
- **eigenvalues**: the non-zero eigenvalues of ``W_QK^h`` (d x d) are those of ``C^h``
  (``XY`` and ``YX`` share them), so one ``d_k x d_k`` non-symmetric eigenproblem per head.

Cost per layer: ``1.75 H d_k² d`` multiply-adds in BLAS (``G_Q`` and ``C``) plus
``0.75 H_kv d_k² d'``, then ``O(H d_k³)``. Householder QR of the same heads does about as many
flops at a fraction of the speed; see ``benchmarks/spectral.py``.

Threads. torch solves a batch of small LAPACK problems one after another on one core, and a
70B layer's 64 non-symmetric eigenproblems take about as long as its products. So a large layer on
CPU is split into runs of heads (whole key/value groups where there are enough), two per torch
thread, and each run — products and solvers — is computed single-threaded on a Python thread of
its own (torch releases the GIL); torch's intra-op thread count is 1 meanwhile and restored after.
The split changes no formula: each head's numbers are those of the single-threaded computation
(tested).

Precision. The products run in float32 on CPU for weights of any dtype up to float32 (bf16/fp16
weights convert exactly), and in float64 for float64 weights, on accelerators (where TF32 would
otherwise silently replace float32, and float64 is cheap on datacenter parts) and on a CPU whose
float32 matmuls are set to run in reduced precision (``torch.set_float32_matmul_precision``).
Accuracy against dense float64 linear algebra on the explicit d x d ``W_QK^h``, with ``u`` the
unit roundoff of the products' dtype (``2^-24`` float32, ``2^-53`` float64),
``ε = u·sqrt(max(d, d'))`` (the usual model of rounding in a long sum, ``||ΔG|| <= ε ||G||``;
measured float32 Gram errors at d = 8192 are 5-15x below it) and
``S = ||W_Q^h||_2 ||W_K^g||_2`` (which bounds ``σ_1(W_QK^h)``):

- ``|σ_i² − σ̂_i²| <= 3 ε S²``, so ``|σ_i − σ̂_i| <= min(sqrt(3ε)·S, 3ε S² / σ_i)``: the large
  singular values keep a relative error of order ε; those below about ``sqrt(ε)·S`` (the tail of
  an ill-conditioned head, the zeros of a low-rank one) are known only to ``± sqrt(3ε)·S`` — the
  price of the Gram matrix squaring the condition number. Float32 at d = 8192:
  ``sqrt(3ε) = 4.0e-3`` (measured: under 5e-4).
- a computed ``σ̂_i² <= 3ε S²`` cannot be told from zero and is reported as exactly 0 (its true
  value is then at most ``sqrt(6ε)·S``). So a low-rank head has exact zeros (κ = 1 and erank = 1
  for rank one, instead of rounding noise summed over d_k values), and a head whose ``W_QK^h``
  is zero to working precision has σ = 0 and all eigenvalues 0. ``S`` is estimated from below by
  power iteration on the Grams, which only lowers this floor.
- the eigenvalues are exact for ``C^h + ΔC`` with ``||ΔC||_2 <= ε S`` (plus the eigen-solver's
  backward error, ``d_k u ||C||``), so ``|Δλ| <= cond(V)·ε S`` (Bauer-Fike, ``V`` the eigenvectors
  of ``C^h``); ``eig_mean`` (a trace) is within ``ε S``.

Both bounds are asserted in ``tests/core/test_layer_spectra.py``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from qkmonitor.measures.spectra import compute_dtype, split_heads
from qkmonitor.threads import on_threads

__all__ = ["HeadSpectra", "qk_head_spectra"]


class HeadSpectra(NamedTuple):
    """The spectrum of every head of one layer.

    Attributes:
        singular_values: (num_heads, d_k) float64 on CPU, descending, values within rounding
            noise of zero set to 0; NaN rows for heads whose weights are not finite.
        eigenvalues: (num_heads, d_k) complex on CPU (complex64 from float32 products, else
            complex128), by descending modulus; ``None`` when ``W_QK`` is not square (the query
            and key input widths differ).
    """

    singular_values: Tensor
    eigenvalues: Tensor | None


def qk_head_spectra(
    w_q: Tensor, w_k: Tensor, num_heads: int, num_kv_heads: int | None = None
) -> HeadSpectra:
    r"""Singular values and eigenvalues of every head's ``W_QK^h`` of one layer, from Gram matrices.

    See the module docstring for the method and its accuracy bound.

    Args:
        w_q: (num_heads * d_k, d) query weight, any float dtype and device.
        w_k: (num_kv_heads * d_k, d') key weight.
        num_heads: query heads H.
        num_kv_heads: key/value heads; divides H; defaults to H.

    Returns:
        :class:`HeadSpectra`, on CPU. A head whose weights (or their products) are not finite
        gets NaN; the other heads are unaffected.

    Raises:
        ValueError: on shapes that do not split into heads, or weights that are not 2-D.
        torch.linalg.LinAlgError: when an eigen-solver does not converge.

    Example:
        >>> w_q = torch.tensor([[3.0, 0.0], [0.0, 1.0]])  # one head, d_k = d = 2
        >>> qk_head_spectra(w_q, torch.eye(2), num_heads=1).singular_values
        tensor([[3., 1.]], dtype=torch.float64)
    """
    if w_q.dim() != 2 or w_k.dim() != 2:
        raise ValueError(
            f"Expected 2-D `w_q` and `w_k` (one layer), got {tuple(w_q.shape)} and "
            f"{tuple(w_k.shape)}"
        )
    dtype = _gram_dtype(compute_dtype(w_q, w_k), w_q.device)
    with torch.no_grad():
        wq, wk, group = split_heads(
            w_q.detach().to(dtype), w_k.detach().to(dtype), num_heads, num_kv_heads
        )
        q_rows, k_rows = wq.mT, wk.mT  # (H, d_k, d), (H_kv, d_k, d'): views of the weights' rows
        rounding = torch.finfo(dtype).eps / 2 * math.sqrt(max(w_q.shape[-1], w_k.shape[-1]))  # ε
        square = w_q.shape[-1] == w_k.shape[-1]
        chunks = _head_chunks(q_rows, k_rows.shape[-1], group.cpu())
        solve = lambda heads: _spectra_of_heads(
            q_rows[heads], k_rows, group[heads], rounding, square
        )
        parts = on_threads(solve, chunks)
    singular_values = torch.cat([sv for sv, _ in parts])
    eigenvalues = torch.cat([eig for _, eig in parts]) if square else None
    return HeadSpectra(singular_values, eigenvalues)


def _spectra_of_heads(
    q_rows: Tensor, k_rows: Tensor, group: Tensor, rounding: float, square: bool
) -> tuple[Tensor, Tensor | None]:
    """(σ, λ) of some heads: ``q_rows`` (h, d_k, d) of heads whose key heads are ``k_rows[group]``.

    The heads of one key/value group are consecutive, so the key heads used are a range.
    """
    first, last = int(group[0]), int(group[-1]) + 1
    k_rows, group = k_rows[first:last], (group - first).cpu()
    gram_q = _gram(q_rows)  # (h, d_k, d_k)
    gram_k = _gram(k_rows)  # (h_kv, d_k, d_k)
    cross = _cross_products(q_rows, k_rows, group) if square else None  # (h, d_k, d_k): (C^h)^T
    finite_k = _finite(gram_k)
    finite = _finite(gram_q) & finite_k[group]  # (h,)
    if cross is not None:
        finite &= _finite(cross)
    singular_values = _singular_values(
        _small(gram_q, finite), _small(gram_k, finite_k), group, rounding
    )
    singular_values[~finite] = float("nan")
    eigenvalues = None
    if cross is not None:
        eigenvalues = _eigenvalues(torch.where(finite[:, None, None], cross.cpu(), 0.0))
        eigenvalues[singular_values[:, 0] == 0] = 0.0  # |λ| <= σ_1: zero to working precision
        eigenvalues[~finite] = complex(float("nan"), float("nan"))
    return singular_values, eigenvalues


def _gram_dtype(compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float32 only where float32 matmuls are IEEE float32 (CPU, unless set otherwise); else
    float64."""
    if compute_dtype == torch.float64 or device.type != "cpu":
        return torch.float64
    return torch.float32 if _cpu_float32_matmul_is_ieee() else torch.float64


def _cpu_float32_matmul_is_ieee() -> bool:
    # The most specific flag that is set wins (torch >= 2.9); `set_float32_matmul_precision`
    # writes the matmul one. Reading the legacy getter instead can raise once both APIs were used.
    for owner in (
        getattr(torch.backends.mkldnn, "matmul", None),
        torch.backends.mkldnn,
        torch.backends,
    ):
        precision = getattr(owner, "fp32_precision", "none")
        if precision != "none":
            return precision == "ieee"
    return True  # older torch: float32 matmuls on CPU are IEEE


def _gram(rows: Tensor) -> Tensor:
    """(B, n, n): ``X X^T`` of each (n, L) matrix, computing the block below the diagonal once.

    With ``X = [A; B]`` split in half by rows, ``A X^T`` gives the top half and ``B B^T`` the
    bottom-right block; the bottom-left is the top-right transposed: 3/4 of a full product.
    """
    half = rows.shape[-2] // 2
    if half < 32:  # small blocks: one product is faster
        return rows @ rows.mT
    top = rows[..., :half, :] @ rows.mT  # (B, half, n)
    bottom = torch.cat([top[..., half:].mT, rows[..., half:, :] @ rows[..., half:, :].mT], dim=-1)
    return torch.cat([top, bottom], dim=-2)


def _cross_products(q_rows: Tensor, k_rows: Tensor, group: Tensor) -> Tensor:
    """(h, d_k, d_k): ``W_Q^hT W_K^g = (C^h)^T`` for every head, one matmul per key/value group."""
    heads, d_k, d = q_rows.shape
    if heads == k_rows.shape[0]:  # one head per key head (here): a batched matmul
        return q_rows @ k_rows.mT
    out, start = [], 0
    for g, count in enumerate(torch.bincount(group, minlength=k_rows.shape[0]).tolist()):
        grouped = q_rows[start : start + count].reshape(
            count * d_k, d
        )  # the group's heads, stacked rows
        out.append((grouped @ k_rows[g].mT).reshape(count, d_k, d_k))
        start += count
    return torch.cat(out)


def _finite(batch: Tensor) -> Tensor:
    """(B,) bool on CPU: whether each matrix of a (B, n, n) batch is finite."""
    return torch.isfinite(batch).flatten(1).all(dim=1).cpu()


def _small(batch: Tensor, finite: Tensor) -> Tensor:
    """The d_k x d_k matrices as float64 on CPU, non-finite ones zeroed (LAPACK refuses NaN)."""
    batch = batch.to(device="cpu", dtype=torch.float64)
    return torch.where(finite[:, None, None], batch, 0.0)


def _singular_values(gram_q: Tensor, gram_k: Tensor, group: Tensor, rounding: float) -> Tensor:
    """(H, d_k) σ(W_QK^h), descending, as ``sqrt(λ(F G_Q^h F^T))`` with ``F^T F = G_K^g``.

    Squares within the error bound of zero, ``σ² <= 3ε S²``, are rounding noise and become 0.
    """
    factor = _gram_factor(gram_k).index_select(0, group)  # (H, d_k, d_k)
    # F G F^T is symmetric positive semi-definite by construction, so a symmetric solver applies.
    squared = torch.linalg.eigvalsh(factor @ gram_q @ factor.mT).flip(-1)  # descending
    scale_squared = _largest_eigenvalue(gram_q) * _largest_eigenvalue(gram_k).index_select(
        0, group
    )  # S²
    noise = squared <= 3 * rounding * scale_squared[:, None]
    return torch.where(noise, 0.0, squared).sqrt()


_EXACT_WORK = 2**20


def _largest_eigenvalue(gram: Tensor, steps: int = 4) -> Tensor:
    """(B,) λ_max of each PSD matrix from below: power iteration from the largest diagonal's axis.

    The Rayleigh quotient starts at ``max_i G_ii >= λ_max / n`` and never decreases; it only sets
    the floor below which values are rounding noise, so a few steps do. Small batches (``B n³`` up
    to ``_EXACT_WORK``) get the exact value from one symmetric eigensolve instead: a dozen small
    matmuls cost more than that there.
    """
    if (
        gram.shape[0] * gram.shape[-1] ** 3 <= _EXACT_WORK
    ):  # small: one LAPACK call is cheaper, and exact
        return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0.0)
    start = gram.diagonal(dim1=-2, dim2=-1).argmax(dim=-1)
    vector = torch.nn.functional.one_hot(start, gram.shape[-1]).to(gram.dtype)[
        ..., None
    ]  # (B, n, 1)
    for _ in range(steps):
        vector = torch.nn.functional.normalize(gram @ vector, dim=-2)  # a zero G stays zero
    return (vector.mT @ gram @ vector)[..., 0, 0]


def _gram_factor(gram: Tensor) -> Tensor:
    """F with ``F^T F = G`` for each PSD ``G``: Cholesky, or ``diag(sqrt λ) V^T`` where it fails."""
    factor, info = torch.linalg.cholesky_ex(gram, upper=True)
    failed = info != 0  # rank-deficient (or rounded to indefinite): exact zeros of a low-rank W_K
    if failed.any():
        lam, vectors = torch.linalg.eigh(gram[failed])
        factor[failed] = lam.clamp_min(0.0).sqrt()[..., None] * vectors.mT
    return factor


def _eigenvalues(cross: Tensor) -> Tensor:
    """(H, d_k) eigenvalues of each matrix by descending modulus (those of its transpose too)."""
    eigenvalues = torch.linalg.eigvals(cross)
    order = eigenvalues.abs().argsort(dim=-1, descending=True)
    return eigenvalues.gather(-1, order)


#: Below this many multiply-adds (``h d_k² (d + d_k)`` per layer) the heads are one chunk on the
#: caller's thread: handing work to threads would cost more than it saves. GPT-2 small's layer
#: (12 heads, d_k = 64, d = 768) is 3.8e7; a 70B layer (64 heads, d_k = 128, d = 8192) 8.7e9.
_THREADED_WORK = 2**28


def _head_chunks(q_rows: Tensor, d_kv: int, group: Tensor) -> list[slice]:
    """Consecutive ranges of heads to solve apart: two per thread for a large CPU layer, else one.

    A range ends at a key/value group boundary where there are enough groups, so each group's
    cross products stay one matmul.
    """
    heads, d_k, d = q_rows.shape
    threads = torch.get_num_threads()
    work = heads * d_k**2 * (max(d, d_kv) + d_k)
    if threads < 2 or heads < 2 or work < _THREADED_WORK:
        return [slice(0, heads)]
    count = min(2 * threads, heads)
    groups = int(group[-1]) + 1
    if groups >= count:  # whole groups per chunk
        starts = [
            int((group == g).nonzero()[0]) for g in (i * groups // count for i in range(count))
        ]
    else:
        starts = [i * heads // count for i in range(count)]
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], heads])]
