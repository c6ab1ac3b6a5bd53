r"""Spectral and entropy metrics of attention, as pure tensor functions.

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

from qkmonitor.kernels._torch import exp_shifted_
from qkmonitor.threads import on_threads
from qkmonitor.validation import check_positive_int, is_int

__all__ = [
    "attention_entropy",
    "attention_probs",
    "attention_stats_from_scores",
    "compute_dtype",
    "effective_rank",
    "eigenvalue_moments",
    "gram_singular_values",
    "hidden_state_metrics",
    "masked_softmax",
    "masked_softmax_",
    "normalized_entropy",
    "qk_eigenvalues",
    "qk_singular_values",
    "qk_spectrum_metrics",
    "spectral_concentration",
    "spectral_energy_concentration",
    "split_heads",
    "stable_rank",
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
    handed a NaN). A large CPU batch is split over torch's threads, products and eigenproblems
    alike (:func:`qkmonitor.threads.on_threads`: LAPACK solves a batch on one core); each
    matrix's values are those of a single-threaded call.

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
    if x.device.type != "cpu" or threads < 2 or count < 2 or count * k**3 < _THREADED_EIGH:
        values = _gram_singular_values(flat)
    else:
        parts = min(threads, count)
        chunks = [slice(i * count // parts, (i + 1) * count // parts) for i in range(parts)]
        values = torch.cat(on_threads(lambda chunk: _gram_singular_values(flat[chunk]), chunks))
    return values.reshape(*x.shape[:-2], k)


#: Below this many multiply-adds (``count · k³`` for ``count`` problems of size k) a batch of
#: eigenproblems is one LAPACK call on the caller's thread; the attention slices of a 6-layer,
#: 8-head model at 128 probe tokens (192 problems of 128) are 4e8.
_THREADED_EIGH = 2**24


def _gram_singular_values(x: Tensor) -> Tensor:
    """:func:`gram_singular_values` of a batch (C, n, m), on the caller's thread."""
    x = x.double()
    gram = x @ x.mT if x.shape[-2] <= x.shape[-1] else x.mT @ x
    # |G_ij| <= sqrt(G_ii G_jj) (Cauchy-Schwarz): a matrix is finite when its diagonal is, well
    # below overflow (a NaN or Inf entry of x makes its row's diagonal NaN or Inf)
    diagonal = gram.diagonal(dim1=-2, dim2=-1)
    finite = (diagonal <= torch.finfo(torch.float64).max / 2).all(-1)  # NaN compares False
    if not bool(finite.all()):  # LAPACK never sees a NaN: those matrices are solved as zeros
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


def normalized_entropy(entropy: Tensor, attended: Tensor) -> Tensor:
    r"""Row entropy over its largest possible value: ``H_i / log(n_i)``, in [0, 1].

    ``n_i`` is the number of keys row i may attend; a row with ``n_i <= 1`` has no spread to
    measure and gives NaN (aggregates leave it out).

    Args:
        entropy: (...) row entropies ``H_i``, in nats.
        attended: (...) the keys each row may attend, a floating tensor of the same shape.

    Returns:
        (...), in the dtype of ``entropy / attended``.

    Example:
        >>> normalized_entropy(torch.tensor([2.0, 0.0]).log(), torch.tensor([4.0, 1.0]))
        tensor([0.5000,    nan])
    """
    return torch.where(
        attended > 1, entropy / attended.log(), torch.full_like(entropy, float("nan"))
    )


def attention_entropy(probs: Tensor, normalize: bool = False, mask: Tensor | None = None) -> Tensor:
    r"""Entropy of each row of an explicit attention matrix, in nats.

    ``H_i = -Σ_j p_ij log p_ij`` with ``0 log 0 = 0``. With ``normalize``, ``H_i / log(n_i)`` where
    ``n_i`` is the row length, or the number of allowed keys when ``mask`` is given; rows with
    ``n_i <= 1`` have no spread to measure and give NaN (aggregates leave them out).

    Args:
        probs: (..., N, M), rows summing to 1 over their allowed keys.
        normalize: divide by ``log(n_i)``.
        mask: optional (..., N, M) or broadcastable bool, True where row i may attend key j.
            Probability outside the mask is ignored.

    Returns:
        (..., N), in the dtype of ``probs`` (float32 at least).

    Example:
        >>> attention_entropy(torch.tensor([[0.5, 0.5], [1.0, 0.0]]), normalize=True)
        tensor([1., 0.])
    """
    if not torch.is_floating_point(probs):
        raise ValueError(f"Expected floating-point `probs`, got dtype {probs.dtype}")
    p = probs if probs.dtype == torch.float64 else probs.float()
    allowed = (
        torch.ones_like(p, dtype=torch.bool) if mask is None else mask.to(torch.bool).expand_as(p)
    )
    plogp = torch.where(~allowed | (p == 0), 0.0, p * p.log())  # NaN stays NaN
    entropy = 0.0 - plogp.sum(dim=-1)
    if not normalize:
        return entropy
    return normalized_entropy(entropy, allowed.sum(dim=-1).to(p.dtype))


def attention_stats_from_scores(scores: Tensor, mask: Tensor | None = None, sink_tokens: int = 0):
    r"""Per-row :class:`~qkmonitor.kernels.AttentionStats` from explicit pre-softmax scores.

    The explicit counterpart of ``kernels.attention(..., return_stats=True)``, for attention whose
    mask the kernel does not take (arbitrary ``attn_mask``): ``lse_i = log Σ_j e^{s_ij}``,
    ``entropy_i = -Σ_j p_ij log p_ij``, ``max_prob_i``, ``max_logit_i = max_j s_ij``,
    ``attended_i`` over the allowed keys: those ``mask`` allows whose score is not ``-inf``.
    Fully masked rows give ``lse = max_logit = -inf`` and zeros elsewhere. Non-finite scores on
    allowed keys follow the kernel's contract: a NaN makes the row's statistics NaN; otherwise a
    ``+inf`` gives ``lse = max_logit = +inf`` and NaN entropy, max_prob and sink mass. (A NaN that
    a ``-inf`` bias was added to stays NaN: pass ``mask`` to mask it out.)

    Args:
        scores: (B, H, N, M) scaled logits; ``-inf`` marks a key that may not be attended.
        mask: optional bool, broadcastable to ``scores``, True where the key may be attended.
        sink_tokens: also report the mass on the first ``sink_tokens`` keys.

    Returns:
        AttentionStats with detached float32 (B, H, N) fields (computed in float64).
    """
    from qkmonitor.kernels import AttentionStats

    s = scores.detach().double()
    allowed = s != float("-inf")
    if mask is not None:
        allowed = allowed & mask.to(torch.bool).expand_as(s)
    s = s.masked_fill(~allowed, float("-inf"))
    has_nan = s.isnan().any(dim=-1)
    has_inf = torch.isposinf(s).any(dim=-1) & ~has_nan
    broken = has_nan | has_inf
    s = s.masked_fill(broken[..., None], float("-inf"))  # computed as empty, overwritten below
    lse = torch.logsumexp(s, dim=-1)
    live = lse != float("-inf")
    p = torch.where(live[..., None], (s - torch.where(live, lse, 0.0)[..., None]).exp(), 0.0)
    plogp = torch.where(p > 0, p * p.log(), 0.0)

    def mark(x: Tensor, inf_value: float = float("nan")) -> Tensor:
        return torch.where(has_nan, float("nan"), torch.where(has_inf, inf_value, x)).float()

    return AttentionStats(
        lse=mark(lse, float("inf")),
        entropy=mark((0.0 - plogp.sum(-1)).clamp_min(0.0)),
        max_prob=mark(p.amax(dim=-1)),
        max_logit=mark(s.amax(dim=-1), float("inf")),
        attended=allowed.sum(-1).float(),
        sink_mass=mark(p[..., :sink_tokens].sum(-1)) if sink_tokens > 0 else None,
    )


def masked_softmax(scores: Tensor, dim: int = -1, mask: Tensor | None = None) -> Tensor:
    r"""Softmax that subtracts the row maximum and gives an all-zero row where nothing is allowed.

    ``p_j = e^{x_j - m} / Σ_{k∈A} e^{x_k - m}`` for ``j ∈ A`` (``m`` the maximum over A), 0
    elsewhere; a row with A empty (all masked or all ``-inf``) is all zeros, never NaN. A row with
    a NaN or ``+inf`` score in A is all NaN (softmax itself would give a partly NaN row).
    float16/bfloat16 are computed in float32 and cast back.

    Args:
        scores: logits, any shape.
        dim: the dimension to normalize over.
        mask: optional bool (or 0/1), broadcastable to ``scores``, True where allowed.

    Example:
        >>> masked_softmax(
        ...     torch.tensor([[1e4, 1e4], [0.0, 0.0]]),
        ...     mask=torch.tensor([[True, True], [False, False]]),
        ... )
        tensor([[0.5000, 0.5000],
                [0.0000, 0.0000]])
    """
    work = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores.clone()
    return masked_softmax_(work, dim, mask).to(scores.dtype)


def masked_softmax_(work: Tensor, dim: int = -1, mask: Tensor | None = None) -> Tensor:
    r""":func:`masked_softmax` of a float32/float64 tensor, in place (the probability slices of
    :meth:`qkmonitor.attention.calls.MaskedCall.probs`, in the scores' own memory: no new buffer a
    pass).

    A probability at most e^-79 times the row's largest is 0 (below the rounding of a sum that is
    at least 1; the exponential takes the CPU's slow path on underflow, :func:`exp_shifted_`).
    """
    if mask is not None:
        work.masked_fill_(~mask.to(torch.bool), float("-inf"))
    row_max = work.amax(dim=dim, keepdim=True)  # NaN if a NaN is allowed, +inf if a +inf is
    broken = row_max.isnan() | torch.isposinf(row_max)
    row_max = row_max.masked_fill(~torch.isfinite(row_max), 0.0)  # empty row: exp(-inf - 0) = 0
    p = exp_shifted_(work.sub_(row_max))
    total = p.sum(dim=dim, keepdim=True)
    p.div_(torch.where(total > 0, total, torch.ones_like(total)))
    return p.masked_fill_(broken, float("nan"))


def attention_probs(
    q: Tensor,
    k: Tensor,
    *,
    scale: float | Tensor,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    r"""The explicit attention matrix ``A = softmax(scale · q kᵀ + bias)`` — the reference path.

    Args:
        q: (B, H, N, D); k: (B, H_kv, M, D) with H_kv dividing H (query head h reads key head
            ``h // (H / H_kv)``).
        scale: float, or a tensor broadcastable to (B, H, N, 1) (a temperature per row).
        causal: bottom-right aligned causal mask (row i sees keys ``j ≤ i + M − N``).
        key_padding_mask: (B, M) bool, True where a key may be attended.
        bias: optional additive bias broadcastable to (B, H, N, M) (``-inf`` blocks).

    Returns:
        (B, H, N, M) probabilities in float32 or better; fully masked rows are zeros.
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k = q.to(dtype), k.to(dtype)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * (scale.to(dtype) if isinstance(scale, Tensor) else scale)
    if bias is not None:
        scores = scores + bias.to(dtype)
    n, m = scores.shape[-2:]
    allowed = torch.ones(n, m, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril(diagonal=m - n)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(torch.bool)[:, None, None, :]
    return masked_softmax(scores, mask=allowed)


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
    x = x.detach().double()
    erank = effective_rank(gram_singular_values(x))  # NaN for a sequence holding NaN/Inf
    centered = x - x.mean(dim=-2, keepdim=True)
    collapse = torch.linalg.vector_norm(centered, dim=(-2, -1)) / torch.linalg.vector_norm(
        x, dim=(-2, -1)
    )
    undefined = erank.isnan() | (x.shape[-2] < 2)
    return erank, torch.where(undefined, float("nan"), collapse)
