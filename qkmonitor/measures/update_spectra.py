r"""The spectrum of one optimizer update to each head's query-key form, in the factor space.

For head h of key/value group g (conventions of :mod:`qkmonitor.measures.spectra`: the rows of
``w_q`` for the head are :math:`A = W_Q^{h\top}` (d_k x d), those of ``w_k`` for its key head
:math:`B = W_K^{g\top}` (d_k x d')), one update moves them to :math:`A + \Delta A` and
:math:`B + \Delta B`, and the head's bilinear form :math:`W_{QK}^h = A^\top B` by

.. math::

    \Delta W_{QK}^h = \underbrace{\Delta A^\top B + A^\top \Delta B}_{\text{first order}}
    + \Delta A^\top \Delta B .

The channel is the first-order term at the weights the gradient was taken at (before the
update), ``ΔW_Q W_Kᵀ + W_Q ΔW_Kᵀ``: it is linear in the update, so its normalized spectrum does
not move when the update is scaled (a learning rate twice as large gives the same entropy and
top share), where the whole change's second-order part grows with the square of the rate.

It is a product of two thin factors, :math:`X^\top Y` with :math:`X = [\Delta A; A]` and
:math:`Y = [B; \Delta B]` (each 2 d_k rows), so its singular values are those of a
2 d_k x 2 d_k problem, solved as :mod:`qkmonitor.measures.gram_spectra` solves W_QK's: Gram
matrices :math:`G_X = X X^\top`, :math:`G_Y = Y Y^\top` (the only O(d) work), then with
:math:`F^\top F = G_Y`, :math:`\sigma_i^2 = \lambda_i(F G_X F^\top)`; no d x d matrix is formed.

Balancing. An update is small against its weights (:math:`\lVert\Delta A\rVert \approx
10^{-3} \lVert A\rVert`), and a Gram matrix resolves singular values down to about
:math:`\sqrt{\varepsilon}\, \lVert X\rVert \lVert Y\rVert` only. Scaling the blocks, :math:`X \to
[\alpha \Delta A; A/\beta]`, :math:`Y \to [B/\alpha; \beta \Delta B]`, leaves the product alone;
with :math:`\alpha = \sqrt{\lVert B\rVert / \lVert\Delta A\rVert}` and
:math:`\beta = \sqrt{\lVert A\rVert / \lVert\Delta B\rVert}` every block has the norm of its term
of the update, so :math:`\lVert X\rVert \lVert Y\rVert` is of the order of the update's own
:math:`\lVert\Delta A\rVert\lVert B\rVert + \lVert A\rVert\lVert\Delta B\rVert` and the error
bound of :mod:`qkmonitor.measures.gram_spectra` holds relative to the update, not to the weights.
The scaling is applied to the Gram matrices (a Gram entry's rounding error is relative to its two
rows' norms, so scaling rows after the product is as accurate as before it); a term whose factor
is zero (``ΔA = 0``: that side was not updated) has both its blocks set to 0. Squares at or below
``3 ε S²`` (``S² = λ_max(G_X) λ_max(G_Y)`` of the balanced Grams, ``λ_max(G_X)`` from below by
power iteration, which only lowers the floor) are rounding noise, set to 0.

The metrics, over the ``σ_i`` of one head (``p_i = σ_i / Σ_j σ_j``, the shares that ``kappa`` and
``qk_erank`` use):

- ``qk_update_entropy = -Σ p_i log p_i / log r``, ``r = min(2 d_k, d, d')`` the most singular
  values the update can have: 1 = spread evenly over every direction it can take, 0 = one;
- ``qk_update_top_share = σ_1 / Σ σ_i``, in [1/r, 1].

Both are 0/0 where the first-order update is zero (a step that moved neither W_Q nor W_K of the
head, a learning rate of 0): undefined, NaN. Nothing here reads a value on the host: where the
weights are on a GPU, the Grams are computed there and the small problems on the CPU
(``.cpu()``, which waits), so callers on a GPU run this off the training thread (the spectrum's
worker); on a CPU no copy is made.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from qkmonitor.measures.gram_spectra import _gram_dtype, _largest_eigenvalue
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.measures.ranks import effective_rank
from qkmonitor.measures.spectra import compute_dtype, split_heads
from qkmonitor.threads import on_threads

__all__ = [
    "UPDATE_SPECTRUM_METRICS",
    "qk_update_metrics",
    "qk_update_singular_values",
    "update_spectra",
]

#: The metrics of the update's spectrum, per head.
UPDATE_SPECTRUM_METRICS = ("qk_update_entropy", "qk_update_top_share")


def qk_update_singular_values(before: QKWeights, after: QKWeights) -> Tensor:
    r"""Singular values of each head's first-order update ``ΔA^T B + A^T ΔB`` (module docstring).

    Args:
        before: the layer's weights the update started from (those the gradient was taken at).
        after: the same layer's weights after the update (same shapes and heads).

    Returns:
        (num_heads, 2 d_k) float64 on the CPU, descending; values within rounding noise of 0 are
        0; NaN rows for heads whose weights or update are not finite.

    Raises:
        ValueError: on weights that do not split into heads, or before and after that differ in
            shape.

    Example:
        >>> a = QKWeights(torch.eye(2), torch.eye(2), 1, 1, 1.0)
        >>> b = QKWeights(torch.diag(torch.tensor([1.5, 1.0])), torch.eye(2), 1, 1, 1.0)
        >>> qk_update_singular_values(a, b)  # ΔW_QK = diag(0.5, 0)
        tensor([[0.5000, 0.0000, 0.0000, 0.0000]], dtype=torch.float64)
    """
    if before.w_q.shape != after.w_q.shape or before.w_k.shape != after.w_k.shape:
        raise ValueError(
            "Expected the weights before and after the update to have one shape, got "
            f"{tuple(before.w_q.shape)}/{tuple(before.w_k.shape)} and "
            f"{tuple(after.w_q.shape)}/{tuple(after.w_k.shape)}"
        )
    weights = (before.w_q, after.w_q, before.w_k, after.w_k)
    dtype = _gram_dtype(compute_dtype(*weights), before.w_q.device)
    with torch.no_grad():
        q0, q1, k0, k1 = (w.detach().to(dtype) for w in weights)
        a, b = _rows(q0, k0, before)
        da, db = _rows(q1 - q0, k1 - k0, before)
        gram_x = _host(_block_gram(da, a))  # (H, 2 d_k, 2 d_k): X = [ΔA; A]
        group = torch.arange(before.num_heads) // (before.num_heads // b.shape[0])  # on the CPU
        gram_y = _host(_block_gram(b, db)).index_select(0, group)  # Y = [B; ΔB], per query head
    rounding = torch.finfo(dtype).eps / 2 * math.sqrt(max(q0.shape[-1], k0.shape[-1]))
    solve = lambda heads: _balanced_singular_values(gram_x[heads], gram_y[heads], rounding)
    return torch.cat(on_threads(solve, _chunks(before.num_heads)))


def qk_update_metrics(before: QKWeights, after: QKWeights) -> tuple[dict[str, Tensor], Tensor]:
    """``qk_update_entropy`` and ``qk_update_top_share`` of every head of one layer: ``(metric ->
    (H,) float64, (H,) undefined)``, on the CPU. Undefined (and NaN): a head whose first-order
    update is zero (to working precision), or a layer whose update can have one direction only
    (``r = 1``: no entropy to normalize)."""
    sv = qk_update_singular_values(before, after)
    d_k = sv.shape[-1] // 2
    rank_bound = min(2 * d_k, before.w_q.shape[-1], before.w_k.shape[-1])
    zero = sv[:, 0] == 0  # False for NaN heads: broken, not undefined
    total = sv.sum(dim=-1)
    if rank_bound > 1:
        entropy = effective_rank(sv).log() / math.log(rank_bound)
    else:
        entropy = torch.full_like(total, math.nan)
    metrics = {"qk_update_entropy": entropy, "qk_update_top_share": sv[:, 0] / total}
    return metrics, zero | (rank_bound < 2)


def update_spectra(
    pairs: Sequence[tuple[QKWeights, QKWeights] | None], num_heads: Sequence[int]
) -> tuple[dict[str, list[Tensor]], dict[str, list[Tensor]]]:
    """The update spectrum of many layers, one at a time: ``(values, undefined)``, each metric ->
    one (H,) tensor per layer (float64, bool). A layer without a pair is NaN and undefined (its
    caller has said why); a layer whose eigen-solver fails is NaN, not undefined, with a
    ``RuntimeWarning`` naming it."""
    values: dict[str, list[Tensor]] = {m: [] for m in UPDATE_SPECTRUM_METRICS}
    undefined: dict[str, list[Tensor]] = {m: [] for m in UPDATE_SPECTRUM_METRICS}
    for index, (pair, heads) in enumerate(zip(pairs, num_heads, strict=True)):
        flags = torch.ones(heads, dtype=torch.bool)
        metrics = {m: torch.full((heads,), math.nan, dtype=torch.float64) for m in values}
        if pair is not None:
            try:
                metrics, flags = qk_update_metrics(*pair)
            except torch.linalg.LinAlgError as err:
                warnings.warn(
                    f"QK update spectrum of layer {index}: {err}; its metrics are NaN.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                flags = torch.zeros(heads, dtype=torch.bool)
        for name in UPDATE_SPECTRUM_METRICS:
            values[name].append(metrics[name])
            undefined[name].append(flags)
    return values, undefined


def _rows(w_q: Tensor, w_k: Tensor, layer: QKWeights) -> tuple[Tensor, Tensor]:
    """(H, d_k, d) query rows and (H_kv, d_k, d') key rows (views of the weights)."""
    wq, wk, _ = split_heads(w_q, w_k, layer.num_heads, layer.num_kv_heads)
    return wq.mT, wk.mT


def _block_gram(top: Tensor, bottom: Tensor) -> Tensor:
    """(B, 2n, 2n) float64: the Gram matrix of ``[top; bottom]`` (each (B, n, L)) without
    stacking them: three products."""
    tt, tb, bb = top @ top.mT, top @ bottom.mT, bottom @ bottom.mT
    gram = torch.cat([torch.cat([tt, tb], -1), torch.cat([tb.mT, bb], -1)], -2)
    return gram.to(torch.float64)


def _chunks(heads: int) -> list[slice]:
    """The heads in one range a thread, at least two where torch has several threads (the second
    empty for one head): the small eigenproblems then run single-threaded
    (:func:`~qkmonitor.threads.on_threads`), as LAPACK's eigensolvers of 2 d_k x 2 d_k matrices
    run many times slower on two threads than on one (measured: 122 ms against 0.26 ms for one
    128 x 128 ``eigh`` on a 2-CPU VM)."""
    threads = torch.get_num_threads()
    if threads < 2:
        return [slice(0, heads)]
    parts = max(2, min(threads, heads))
    return [slice(i * heads // parts, (i + 1) * heads // parts) for i in range(parts)]


def _host(x: Tensor) -> Tensor:
    """``x`` on the CPU: a copy from a device, the tensor itself on a CPU (no read there)."""
    return x if x.device.type == "cpu" else x.cpu()


def _balanced_singular_values(gram_x: Tensor, gram_y: Tensor, rounding: float) -> Tensor:
    """(H, 2 d_k) σ of ``X^T Y`` from ``G_X``, ``G_Y`` (each (H, 2 d_k, 2 d_k) float64, one per
    query head), after the blocks' balancing (module docstring)."""
    d_k = gram_x.shape[-1] // 2
    finite = _finite(gram_x) & _finite(gram_y)
    gram_x = torch.where(finite[:, None, None], gram_x, 0.0)  # LAPACK is never handed a NaN
    gram_y = torch.where(finite[:, None, None], gram_y, 0.0)
    da, a = _block_norms(gram_x, d_k)  # ||ΔA||², ||A||²
    b, db = _block_norms(gram_y, d_k)  # ||B||², ||ΔB||²
    first, second = (da > 0) & (b > 0), (a > 0) & (db > 0)  # each term of the update non-zero
    alpha = torch.where(first, (b / torch.where(first, da, 1.0)) ** 0.25, 1.0)
    beta = torch.where(second, (a / torch.where(second, db, 1.0)) ** 0.25, 1.0)
    on1, on2 = first.to(torch.float64), second.to(torch.float64)
    gram_x = _scaled(gram_x, on1 * alpha, on2 / beta)  # X = [α ΔA; A / β]
    gram_y = _scaled(gram_y, on1 / alpha, on2 * beta)  # Y = [B / α; β ΔB]
    lam_y, vectors = torch.linalg.eigh(gram_y)
    factor = lam_y.clamp_min(0.0).sqrt()[..., None] * vectors.mT  # F^T F = G_Y
    product = factor @ gram_x @ factor.mT
    squared = torch.linalg.eigvalsh((product + product.mT) / 2).flip(-1).clamp_min(0.0)
    scale_squared = _largest_eigenvalue(gram_x) * lam_y[..., -1].clamp_min(0.0)  # S², from below
    noise = squared <= 3 * rounding * scale_squared[:, None]
    values = torch.where(noise, 0.0, squared).sqrt()
    return torch.where(finite[:, None], values, math.nan)


def _finite(batch: Tensor) -> Tensor:
    return torch.isfinite(batch).flatten(1).all(dim=1)


def _block_norms(gram: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The squared Frobenius norms of the two blocks of rows behind a (B, 2n, 2n) Gram matrix."""
    diagonal = gram.diagonal(dim1=-2, dim2=-1)
    return diagonal[:, :n].sum(-1), diagonal[:, n:].sum(-1)


def _scaled(gram: Tensor, top: Tensor, bottom: Tensor) -> Tensor:
    """The Gram matrix of ``[top_h · T; bottom_h · U]`` from that of ``[T; U]`` ((B, 2n, 2n); the
    factors (B,) per matrix)."""
    n = gram.shape[-1] // 2
    rows = torch.cat([top[:, None].expand(-1, n), bottom[:, None].expand(-1, n)], -1)
    return gram * rows[:, :, None] * rows[:, None, :]
