r"""Ranks of a spectrum and of a matrix: effective rank, stable rank, spectral energy
concentration, singular values from Gram matrices, and the residual stream's rank metrics.

Every function accepts any leading batch dimensions. The singular values of a model's W_QK come
from :mod:`qkmonitor.measures.spectra` (the QR reference) or :mod:`qkmonitor.measures.gram_spectra`
(what the monitors use); the functions here turn them into ranks, and give the singular values of
any other matrix (an attention slice, a sequence's hidden states) from its Gram matrix.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkmonitor.threads import on_threads

__all__ = [
    "effective_rank",
    "gram_singular_values",
    "hidden_state_metrics",
    "spectral_energy_concentration",
    "stable_rank",
]


def _normalized_spectrum(singular_values: Tensor) -> Tensor:
    s = singular_values.abs()
    return s / s.sum(dim=-1, keepdim=True)


def effective_rank(singular_values: Tensor) -> Tensor:
    r"""Roy & Vetterli effective rank ``exp(-Σ p_i log p_i)``, ``p_i = σ_i / Σ_j σ_j``.

    ``0 log 0 = 0``; in [1, n]. NaN for an all-zero spectrum.

    Example:
        >>> effective_rank(torch.tensor([2.0, 2.0, 0.0]))
        tensor(2.)
    """
    p = _normalized_spectrum(singular_values)
    plogp = torch.where(p == 0, 0.0, p * p.log())  # NaN stays NaN
    return torch.exp(-plogp.sum(dim=-1))


def gram_singular_values(x: Tensor) -> Tensor:
    r"""Singular values of each (..., n, m) matrix, descending, from its smaller Gram matrix.

    ``σ_i(X) = sqrt(λ_i(X X^T))`` (``X^T X`` when m < n), the Gram matrix and its symmetric
    eigenproblem in float64: one small LAPACK call instead of an SVD. Squares within
    ``min(n, m) · 2^-52 · σ_1²`` of zero (rounding noise of the Gram matrix, which squares the
    condition number) are exactly 0, so a rank-one matrix has one non-zero value; the others
    keep an absolute error below about ``1e-7 σ_1`` (for min(n, m) up to 1024), which moves an
    effective rank by far less than float32 inputs already do. NaN in, NaN out (LAPACK is never
    handed a NaN). A CPU batch is solved in parts of about a megabyte (:data:`NUMBERS_PER_PART`),
    and a large one's parts on torch's threads, products and eigenproblems alike
    (:func:`qkmonitor.threads.on_threads`: LAPACK solves a batch on one core). A matrix's values
    do not depend on the part it is solved in beyond float64's rounding (LAPACK's results can
    move in the last bits with the memory a matrix lies in).

    Args:
        x: (..., n, m), any float dtype.

    Returns:
        (..., min(n, m)) float64.

    Example:
        >>> gram_singular_values(torch.tensor([[3.0, 0.0], [0.0, 4.0]]))
        tensor([4., 3.], dtype=torch.float64)
    """
    x = x.detach()
    n, m = x.shape[-2:]
    k = min(n, m)
    flat = x.flatten(0, -3) if x.dim() > 2 else x[None]  # (C, n, m)
    count, threads = flat.shape[0], torch.get_num_threads()
    threaded = (
        x.device.type == "cpu" and threads > 1 and count > 1 and count * k**3 >= _THREADED_EIGH
    )
    chunks = _parts(count, n * m, x.device.type, threads if threaded else 1)
    if threaded:
        parts = on_threads(lambda chunk: _gram_singular_values(flat[chunk]), chunks)
    else:
        parts = [_gram_singular_values(flat[chunk]) for chunk in chunks]
    values = parts[0] if len(parts) == 1 else torch.cat(parts)
    return values.reshape(*x.shape[:-2], k)


#: Below this many multiply-adds (``count · k³`` for ``count`` problems of size k) a batch of
#: eigenproblems is solved on the caller's thread (so is a batch of one part); the attention
#: slices of a 6-layer, 8-head model at 128 probe tokens (192 problems of 128) are 4e8.
_THREADED_EIGH = 2**24

#: The most numbers of ``x`` one part of a CPU batch holds (1 MiB in float64). Each part's float64
#: copy, Gram matrix and LAPACK's copy of it are then about a megabyte each, made and freed part
#: after part: the passes run in the CPU's caches, and glibc's malloc reuses the same memory
#: instead of handing the top of its heap back to the system after each larger batch and taking
#: it again, page fault by page fault, at the next (with EffectiveRank on 4 layers of 16
#: slices of 128 x 128, ~6,000 minor faults a probe and 12 % of its CPU time;
#: docs/benchmarks.md, "Page faults").
NUMBERS_PER_PART = 2**17


def _parts(count: int, numbers: int, device: str, threads: int = 1) -> list[slice]:
    """``count`` problems of ``numbers`` entries each, in slices of sizes differing by one at
    most: on the CPU of at most :data:`NUMBERS_PER_PART` entries (one problem at least), and at
    least ``threads`` of them (one each for :func:`~qkmonitor.threads.on_threads`; torch's own
    threads in one batched call double its CPU time for the same wall time); elsewhere one slice
    of all (and of an empty batch)."""
    if device != "cpu" or count == 0:  # (an empty batch: one empty part, its shapes kept)
        return [slice(0, count)]
    most = max(1, NUMBERS_PER_PART // max(numbers, 1))  # problems a part
    parts = max(-(-count // most), min(threads, count))
    return [slice(i * count // parts, (i + 1) * count // parts) for i in range(parts)]


def _gram_singular_values(x: Tensor) -> Tensor:
    """:func:`gram_singular_values` of a batch (C, n, m), on the caller's thread."""
    x = x.double()
    gram = x @ x.mT if x.shape[-2] <= x.shape[-1] else x.mT @ x
    # |G_ij| <= sqrt(G_ii G_jj) (Cauchy-Schwarz): a matrix is finite when its diagonal is, well
    # below overflow (a NaN or Inf entry of x makes its row's diagonal NaN or Inf)
    diagonal = gram.diagonal(dim1=-2, dim2=-1)
    finite = (diagonal <= torch.finfo(torch.float64).max / 2).all(-1)  # NaN compares False
    # LAPACK never sees a NaN: those matrices are solved as zeros (selected on the device,
    # without asking the host whether any is)
    gram = torch.where(finite[..., None, None], gram, 0.0)
    squares = torch.linalg.eigvalsh(gram).flip(-1)
    noise = squares <= squares[..., :1] * (gram.shape[-1] * torch.finfo(torch.float64).eps)
    return torch.where(finite[..., None], torch.where(noise, 0.0, squares).sqrt(), float("nan"))


def stable_rank(singular_values: Tensor) -> Tensor:
    r"""Stable rank ``Σ σ_i² / σ_1²`` along the last dim.

    Example:
        >>> stable_rank(torch.tensor([2.0, 1.0]))
        tensor(1.2500)
    """
    s2 = singular_values.abs().square()
    return s2.sum(dim=-1) / s2.amax(dim=-1)


def spectral_energy_concentration(singular_values: Tensor) -> Tensor:
    r"""SEC = ``σ_1² / Σ σ_i²`` (Qi et al. 2025), the reciprocal of the stable rank.

    Example:
        >>> spectral_energy_concentration(torch.tensor([2.0, 1.0]))
        tensor(0.8000)
    """
    return 1.0 / stable_rank(singular_values)


def hidden_state_metrics(x: Tensor) -> tuple[Tensor, Tensor]:
    r"""Effective rank and rank-collapse residual of each sequence's residual-stream matrix.

    For ``X`` (n x d): ``hidden_erank = erank(σ(X))`` (Roy & Vetterli, on the uncentered X) and
    ``hidden_collapse = ‖X − 1 x̄ᵀ‖_F / ‖X‖_F`` with ``x̄`` the mean over tokens — Dong et al.
    (2021)'s residual to the nearest rank-one matrix of identical rows; it tends to 0 under rank
    collapse, while the effective rank alone can stay low in a healthy stream that has a large
    mean direction.

    Args:
        x: (..., n, d) hidden states.

    Returns:
        ``(hidden_erank, hidden_collapse)``, each (...) float64 (singular values by
        :func:`gram_singular_values`); NaN for a sequence holding NaN or Inf, and
        ``hidden_collapse`` NaN for a single token (one row is its own mean: the residual is
        undefined, not a collapse).

    Example:
        >>> x = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])  # three identical tokens
        >>> hidden_state_metrics(x)
        (tensor(1., dtype=torch.float64), tensor(0., dtype=torch.float64))
    """
    x = x.detach()
    erank = effective_rank(gram_singular_values(x))  # NaN for a sequence holding NaN/Inf
    flat = x.flatten(0, -3) if x.dim() > 2 else x[None]  # (S, n, d)
    chunks = _parts(flat.shape[0], flat.shape[-2] * flat.shape[-1], x.device.type)
    collapse = torch.cat([_collapse_residual(flat[chunk].double()) for chunk in chunks])
    undefined = erank.isnan() | (x.shape[-2] < 2)
    return erank, torch.where(undefined, float("nan"), collapse.reshape(erank.shape))


def _collapse_residual(x: Tensor) -> Tensor:
    """``‖X − 1 x̄ᵀ‖_F / ‖X‖_F`` of each (n, d) matrix of ``x`` (S, n, d), in float64; the caller
    hands it a part of the sequences at a time (:func:`_parts`), so that no float64 copy of the
    whole batch is made and freed at each probe (as the Gram matrices' were)."""
    centered = x - x.mean(dim=-2, keepdim=True)
    return torch.linalg.vector_norm(centered, dim=(-2, -1)) / torch.linalg.vector_norm(
        x, dim=(-2, -1)
    )
