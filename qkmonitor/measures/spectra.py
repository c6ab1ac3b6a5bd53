r"""The spectrum of each head's W_QK from its weights, as pure tensor functions (the reference).

Conventions (docs/architecture.md, "Metric definitions"): weights are in ``nn.Linear`` layout
``(out_features, in_features)``. For head ``h`` with head dim ``d_k``,

.. math::

    W_Q^h = w_q[h d_k:(h+1) d_k]^\top \in \mathbb{R}^{d \times d_k}, \qquad
    W_{QK}^h = W_Q^h (W_K^{g})^\top \in \mathbb{R}^{d \times d'}, \quad
    g = \lfloor h / (H / H_{kv}) \rfloor,

so ``rank(W_QK^h) <= d_k``. Nothing here forms the ``d x d`` matrix: with the thin QR
factorizations ``W_Q^h = Q_1 R_1`` and ``W_K^g = Q_2 R_2``, ``W_QK^h = Q_1 (R_1 R_2^T) Q_2^T`` and
the orthonormal factors leave the singular values alone, so ``σ(W_QK^h) = σ(R_1 R_2^T)``: a
``d_k x d_k`` SVD per head. The non-zero eigenvalues of ``W_QK^h`` are those of the small
``(W_K^g)^T W_Q^h`` (``AB`` and ``BA`` share their non-zero eigenvalues).

Every function accepts any leading batch dimensions, so a whole model's heads (layers stacked on
a leading axis) go through in one call. The monitors use :mod:`qkmonitor.measures.layer_spectra`
instead, which goes layer by layer (no stacked copy of the model) through Gram matrices, several
times faster at scale; the QR route here is the backward-stable reference. Inputs of any floating
dtype are computed in float32, or in float64 when they are float64. A head whose weights hold NaN or
Inf gets NaN values rather than an error.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkmonitor.measures.ranks import effective_rank, spectral_energy_concentration, stable_rank
from qkmonitor.validation import check_positive_int, is_int

__all__ = [
    "compute_dtype",
    "eigenvalue_moments",
    "qk_eigenvalues",
    "qk_singular_values",
    "qk_spectrum_metrics",
    "spectral_concentration",
    "split_heads",
]


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the spectral functions compute in: float64 if any input is float64, else float32.

    Raises:
        ValueError: if an input is not floating-point.
    """
    for t in tensors:
        if not torch.is_floating_point(t):
            raise ValueError(f"Expected floating-point weights, got dtype {t.dtype}")
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def split_heads(w_q: Tensor, w_k: Tensor, num_heads: int, num_kv_heads: int | None):
    """Per-head factors ``W_Q^h`` (..., H, d, d_k), ``W_K^g`` (..., H_kv, d', d_k), and g for each
    h.

    Checks the shapes and head counts, naming the argument that is off (``ValueError``).
    """
    if w_q.dim() < 2 or w_k.dim() < 2:
        raise ValueError(
            f"Expected `w_q` and `w_k` of shape (..., heads * d_k, d), got {tuple(w_q.shape)} and "
            f"{tuple(w_k.shape)}"
        )
    if w_q.shape[:-2] != w_k.shape[:-2]:
        raise ValueError(
            f"Expected `w_q` and `w_k` to share leading dims, got {tuple(w_q.shape)} and "
            f"{tuple(w_k.shape)}"
        )
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    check_positive_int("num_heads", num_heads)
    if not is_int(num_kv_heads, 1) or num_heads % num_kv_heads:
        raise ValueError(
            f"Expected `num_kv_heads` to be a positive int dividing `num_heads`={num_heads}, got "
            f"{num_kv_heads!r}"
        )
    if w_q.shape[-2] % num_heads:
        raise ValueError(
            f"Expected `w_q` rows ({w_q.shape[-2]}) to be a multiple of `num_heads`={num_heads}"
        )
    d_k = w_q.shape[-2] // num_heads
    if w_k.shape[-2] != num_kv_heads * d_k:
        raise ValueError(
            f"Expected `w_k` to have num_kv_heads * d_k = {num_kv_heads} * {d_k} rows, got "
            f"{w_k.shape[-2]}"
        )
    lead = w_q.shape[:-2]
    wq = w_q.reshape(*lead, num_heads, d_k, w_q.shape[-1]).transpose(-1, -2)  # (..., H, d, d_k)
    wk = w_k.reshape(*lead, num_kv_heads, d_k, w_k.shape[-1]).transpose(
        -1, -2
    )  # (..., H_kv, d', d_k)
    group = torch.arange(num_heads, device=w_k.device) // (num_heads // num_kv_heads)
    return wq, wk, group


def _finite_heads(wq: Tensor, wk: Tensor, group: Tensor):
    """Zero out non-finite heads; return the cleaned factors and the (..., H) finite mask."""
    finite_q = torch.isfinite(wq).all(dim=(-1, -2))
    finite_k = torch.isfinite(wk).all(dim=(-1, -2))
    wq = torch.where(finite_q[..., None, None], wq, 0.0)
    wk = torch.where(finite_k[..., None, None], wk, 0.0)
    return wq, wk, finite_q & finite_k.index_select(-1, group)


def qk_singular_values(
    w_q: Tensor, w_k: Tensor, num_heads: int, num_kv_heads: int | None = None
) -> Tensor:
    r"""Singular values of each head's ``W_QK^h = W_Q^h (W_K^g)^T``, descending.

    Computed as ``σ(R_1 R_2^T)`` from thin QR factors, in O(H·d·d_k²) rather than O(H·d³).

    Args:
        w_q: query projection weight, (..., num_heads * d_k, d).
        w_k: key projection weight, (..., num_kv_heads * d_k, d'). ``d'`` may differ from ``d``.
        num_heads: number of query heads H.
        num_kv_heads: number of key/value heads (GQA/MQA); defaults to ``num_heads``.

    Returns:
        (..., num_heads, d_k), float32 (float64 for float64 input). Heads with non-finite weights
        are all NaN.

    Raises:
        ValueError: on shapes that do not split into heads.

    Example:
        >>> w_q = torch.tensor([[3.0, 0.0], [0.0, 1.0]])  # one head, d_k = d = 2
        >>> qk_singular_values(w_q, torch.eye(2), num_heads=1)
        tensor([[3., 1.]])
    """
    dtype = compute_dtype(w_q, w_k)
    wq, wk, group = split_heads(
        w_q.detach().to(dtype), w_k.detach().to(dtype), num_heads, num_kv_heads
    )
    wq, wk, finite = _finite_heads(wq, wk, group)
    r_q = torch.linalg.qr(wq, mode="r").R  # (..., H, d_k, d_k) when d >= d_k
    r_k = torch.linalg.qr(wk, mode="r").R.index_select(-3, group)  # one QR per KV head, shared
    sv = torch.linalg.svdvals(r_q @ r_k.transpose(-1, -2))
    return torch.where(finite[..., None], sv, float("nan"))


def qk_eigenvalues(
    w_q: Tensor, w_k: Tensor, num_heads: int, num_kv_heads: int | None = None
) -> Tensor:
    r"""Non-zero-capable eigenvalues of each head's ``W_QK^h``, by descending modulus.

    ``W_QK^h`` (d x d) has the eigenvalues of ``(W_K^g)^T W_Q^h`` (d_k x d_k) plus ``d - d_k``
    zeros; these are the former. ``W_QK`` is not symmetric, so they are complex in general.

    Args:
        w_q: (..., num_heads * d_k, d).
        w_k: (..., num_kv_heads * d_k, d); the key input dim must equal the query's.
        num_heads: H.
        num_kv_heads: defaults to ``num_heads``.

    Returns:
        (..., num_heads, d_k) complex64 (complex128 for float64 input).

    Example:
        >>> w_q = torch.tensor([[0.0, -2.0], [2.0, 0.0]])  # a scaled rotation: eigenvalues ±2i
        >>> qk_eigenvalues(w_q, torch.eye(2), num_heads=1).abs().round(decimals=4)
        tensor([[2., 2.]])
    """
    if w_q.shape[-1] != w_k.shape[-1]:
        raise ValueError(
            f"Eigenvalues need a square W_QK: `w_q` and `w_k` input dims differ ({w_q.shape[-1]} "
            f"vs {w_k.shape[-1]})"
        )
    dtype = compute_dtype(w_q, w_k)
    wq, wk, group = split_heads(
        w_q.detach().to(dtype), w_k.detach().to(dtype), num_heads, num_kv_heads
    )
    wq, wk, finite = _finite_heads(wq, wk, group)
    eig = torch.linalg.eigvals(wk.index_select(-3, group).transpose(-1, -2) @ wq)  # (..., H, d_k)
    order = eig.abs().argsort(dim=-1, descending=True)
    eig = eig.gather(-1, order)
    return torch.where(finite[..., None], eig, torch.full_like(eig, float("nan")))


def spectral_concentration(values: Tensor) -> Tensor:
    r"""κ = ``max_i |v_i| / Σ_i |v_i|`` along the last dim; in [1/n, 1].

    Takes singular values (κ) or complex eigenvalues (κ_eig, by modulus). An all-zero spectrum
    has no direction to concentrate on: its κ is NaN.

    Example:
        >>> spectral_concentration(torch.tensor([3.0, 1.0]))
        tensor(0.7500)
    """
    mod = values.abs()
    return mod.amax(dim=-1) / mod.sum(dim=-1)


def eigenvalue_moments(eigenvalues: Tensor) -> tuple[Tensor, Tensor]:
    r"""Mean and variance of eigenvalues along the last dim (Bao, Hataya & Karakida, ICML 2024).

    ``mean = (1/n) Σ λ_i`` — for a real matrix the sum is the trace, so the mean is real and its
    real part is returned; ``var = (1/n) Σ |λ_i − mean|²``.

    Example:
        >>> eigenvalue_moments(torch.tensor([1 + 1j, 1 - 1j, 4 + 0j]))
        (tensor(2.), tensor(2.6667))
    """
    mean = eigenvalues.mean(dim=-1)
    var = (eigenvalues - mean[..., None]).abs().square().mean(dim=-1)
    return mean.real, var


def qk_spectrum_metrics(
    w_q: Tensor,
    w_k: Tensor,
    num_heads: int,
    num_kv_heads: int | None = None,
    scale: float | Tensor = 1.0,
) -> dict[str, Tensor]:
    r"""Every weight metric of the QK spectrum, per head: the metrics QKSpectrumMonitor logs.

    Args:
        w_q, w_k, num_heads, num_kv_heads: as in :func:`qk_singular_values`.
        scale: the softmax temperature the layer multiplies its logits by (``1/sqrt(d_k)`` for
            standard attention); a float, or a tensor broadcastable to the leading dims.

    Returns:
        A dict of (..., num_heads) tensors: ``kappa`` (σ_1/Σσ), ``kappa_eig`` (|λ|_max/Σ|λ|),
        ``eig_mean`` and ``eig_var`` (of the d_k eigenvalues of ``W_K^T W_Q``), ``qk_erank``
        (effective rank of σ), ``qk_spectral_norm`` (σ_1 · scale), ``qk_stable_rank`` and
        ``sec`` (σ_1²/Σσ²). ``kappa_eig``, ``eig_mean``, ``eig_var`` are NaN when the query and
        key input dims differ (no square W_QK, no eigenvalues).
    """
    sv = qk_singular_values(w_q, w_k, num_heads, num_kv_heads)
    if w_q.shape[-1] == w_k.shape[-1]:
        eig = qk_eigenvalues(w_q, w_k, num_heads, num_kv_heads)
        eig_mean, eig_var = eigenvalue_moments(eig)
        kappa_eig = spectral_concentration(eig)
    else:
        kappa_eig = eig_mean = eig_var = torch.full_like(sv[..., 0], float("nan"))
    if isinstance(scale, Tensor):
        scale = scale.to(sv.dtype)[..., None]
    return {
        "kappa": spectral_concentration(sv),
        "kappa_eig": kappa_eig,
        "eig_mean": eig_mean,
        "eig_var": eig_var,
        "qk_erank": effective_rank(sv),
        "qk_spectral_norm": sv[..., 0] * scale,
        "qk_stable_rank": stable_rank(sv),
        "sec": spectral_energy_concentration(sv),
    }
