r"""The spectrum of every head's ``W_QK`` for a whole model, one layer at a time, from Gram
matrices.

Conventions are those of :mod:`qkmonitor.measures.functional` (docs/architecture.md, "Metric
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
import warnings
import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn

from qkmonitor.measures.functional import (
    compute_dtype,
    effective_rank,
    eigenvalue_moments,
    spectral_concentration,
    split_heads,
)
from qkmonitor.measures.sharding import whole
from qkmonitor.threads import on_threads

__all__ = [
    "SPECTRUM_METRICS",
    "HeadSpectra",
    "LayerSpectra",
    "QKWeights",
    "full_parameters",
    "qk_head_spectra",
    "spectrum_of_layers",
]

#: The weight metrics of the QK spectrum, per head, in the order of the docs.
SPECTRUM_METRICS = ("kappa", "kappa_eig", "eig_mean", "eig_var", "qk_erank", "qk_spectral_norm")
_EIGEN_METRICS = ("kappa_eig", "eig_mean", "eig_var")
_RATIOS_OF_SIGMA = ("kappa", "kappa_eig", "qk_erank")  # 0/0 when W_QK^h = 0


@dataclass(frozen=True)
class QKWeights:
    """A layer's query and key projections (``nn.Linear`` layout) and how they split into heads.

    Attributes:
        w_q: (num_heads * d_k, d) query weight, biases left out.
        w_k: (num_kv_heads * d_k, d') key weight.
        num_heads: query heads H.
        num_kv_heads: key/value heads; divides H (GQA/MQA when smaller).
        scale: the factor the layer multiplies ``q·k`` by before the softmax.
        qk_norm: the layer normalizes q and k per head after the projections (QK-norm), so
            ``W_QK`` does not bound its logits; alert rules with ``skip_qk_norm`` leave it out.
    """

    w_q: Tensor
    w_k: Tensor
    num_heads: int
    num_kv_heads: int
    scale: float
    qk_norm: bool = False


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


@dataclass
class LayerSpectra:
    r"""The QK-spectrum metrics of many layers, one entry per layer in the order given.

    Attributes:
        metrics: metric name (:data:`SPECTRUM_METRICS`) -> one (num_heads,) float32 CPU tensor per
            layer. ``kappa = σ_1/Σσ``, ``kappa_eig = |λ|_max/Σ|λ|``, ``eig_mean`` and ``eig_var``
            (mean and variance of the d_k eigenvalues of ``W_K^T W_Q``), ``qk_erank`` (effective
            rank of σ), ``qk_spectral_norm = σ_1 · scale``. NaN where a weight is not finite or a
            decomposition failed, and where the value is undefined (``undefined``).
        singular_values: one (num_heads, d_k) float32 CPU tensor per layer, descending.
        undefined: same keys and shapes as ``metrics``, bool: True where the value is NaN by
            definition rather than because a weight is broken —

            * ``kappa_eig``, ``eig_mean``, ``eig_var`` of every head when ``W_QK`` is not square
              (``w_q`` and ``w_k`` have different input widths, e.g. ``nn.MultiheadAttention``
              with ``kdim != embed_dim``): it has no eigenvalues;
            * ``kappa``, ``kappa_eig``, ``qk_erank`` of a head whose ``W_QK^h`` is zero (e.g. a
              zero-initialised ``W_Q`` under muP; to working precision, see the module
              docstring): 0/0. Its ``eig_mean``, ``eig_var`` and ``qk_spectral_norm`` are 0.
    """

    metrics: dict[str, list[Tensor]] = field(
        default_factory=lambda: {m: [] for m in SPECTRUM_METRICS}
    )
    singular_values: list[Tensor] = field(default_factory=list)
    undefined: dict[str, list[Tensor]] = field(
        default_factory=lambda: {m: [] for m in SPECTRUM_METRICS}
    )


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


def spectrum_of_layers(weights: Sequence[QKWeights]) -> LayerSpectra:
    r"""The QK-spectrum metrics of many layers, computed and released one layer at a time.

    Large layers are never stacked into one tensor (at 70B scale that would copy the whole model);
    the heads of one layer are batched. Consecutive small layers of one shape (together at most
    ``_RUN_ELEMENTS`` query-weight entries, 4 MiB of float32) are solved as one batch of heads:
    per-call overheads, not arithmetic, are what small layers cost. A sharded weight (DTensor,
    FSDP2) is gathered for its layer only. Per head, one symmetric eigenproblem gives the singular
    values behind ``kappa``, ``qk_erank``, ``qk_spectral_norm`` and ``singular_values``, and one
    eigenproblem the eigenvalues (:func:`qk_head_spectra`).

    A layer whose eigen-solver fails (``torch.linalg.LinAlgError``) is all NaN, with a
    ``RuntimeWarning`` naming it; a head with NaN/Inf weights is NaN. Neither touches the other
    layers, and neither raises.

    Args:
        weights: per layer, its :class:`QKWeights` (any float dtype, any device, plain tensors or
            DTensors).

    Returns:
        :class:`LayerSpectra`, float32 tensors on CPU.

    Raises:
        ValueError: on weights that do not split into heads.

    Example:
        >>> w = QKWeights(torch.tensor([[3.0, 0.0], [0.0, 1.0]]), torch.eye(2), 1, 1, 0.5)
        >>> spectra = spectrum_of_layers([w])
        >>> spectra.metrics["kappa"], spectra.metrics["qk_spectral_norm"]
        ([tensor([0.7500])], [tensor([1.5000])])
    """
    spectra = LayerSpectra()
    for run in _runs(weights):
        for metrics, singular_values, undefined in _run_metrics(run):
            spectra.singular_values.append(singular_values.float())
            for name in SPECTRUM_METRICS:
                spectra.metrics[name].append(metrics[name].float())
                spectra.undefined[name].append(undefined[name])
    return spectra


def full_parameters(model: nn.Module | None) -> AbstractContextManager:
    """A context in which FSDP (v1) parameters are unsharded, read-only; a no-op for anything else.

    Args:
        model: the model as the strategy wraps it (``trainer.strategy.model``), or ``None``.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return nullcontext()
    if model is None:
        return nullcontext()
    wrapped = _HOLDS_FSDP.get(model)
    if wrapped is None:  # read once per model: walking a large model at every probe adds up
        wrapped = _HOLDS_FSDP[model] = any(
            isinstance(m, FullyShardedDataParallel) for m in model.modules()
        )
    if wrapped:
        return FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True)
    return nullcontext()


#: model -> whether it holds FSDP (v1) modules (wrapping happens before training, never during)
_HOLDS_FSDP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# -- one layer ----------------------------------------------------------------------------------


#: Consecutive layers of one shape are solved together up to this many query-weight entries.
_RUN_ELEMENTS = 2**20


def _runs(weights: Sequence[QKWeights]) -> list[list[tuple[int, QKWeights]]]:
    """Consecutive (index, layer) runs to solve as one batch of heads: small plain tensors of one
    shape, dtype and device (a DTensor is gathered on its own)."""
    runs: list[list[tuple[int, QKWeights]]] = []
    size = 0
    for index, layer in enumerate(weights):
        kind = _run_kind(layer)
        previous = runs[-1][-1][1] if runs else None
        if (
            kind is not None
            and previous is not None
            and _run_kind(previous) == kind
            and size + layer.w_q.numel() <= _RUN_ELEMENTS
        ):
            runs[-1].append((index, layer))
            size += layer.w_q.numel()
        else:
            runs.append([(index, layer)])
            size = layer.w_q.numel()
    return runs


def _run_kind(layer: QKWeights) -> tuple | None:
    w_q, w_k = layer.w_q, layer.w_k
    if (
        not isinstance(layer.num_heads, int)
        or callable(getattr(w_q, "full_tensor", None))
        or callable(getattr(w_k, "full_tensor", None))
        or w_q.numel() > _RUN_ELEMENTS
    ):
        return None
    return (
        w_q.shape,
        w_k.shape,
        w_q.dtype,
        w_k.dtype,
        w_q.device,
        layer.num_heads,
        layer.num_kv_heads,
    )


def _run_metrics(
    run: list[tuple[int, QKWeights]],
) -> list[tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]]:
    """Per layer of a run: (metric -> (H,) float64, (H, d_k) singular values, metric -> (H,)
    undefined mask)."""
    square = run[0][1].w_q.shape[-1] == run[0][1].w_k.shape[-1]
    if len(run) > 1:
        layers = [layer for _, layer in run]
        heads, kv_heads = layers[0].num_heads, layers[0].num_kv_heads or layers[0].num_heads
        try:
            spectra = qk_head_spectra(
                torch.cat([layer.w_q.detach() for layer in layers]),
                torch.cat([layer.w_k.detach() for layer in layers]),
                heads * len(layers),
                kv_heads * len(layers),
            )
        except torch.linalg.LinAlgError:  # solve the layers one by one, to name the failing one
            return [one for item in run for one in _run_metrics([item])]
        scale = torch.cat([_head_scale(layer.scale, heads) for layer in layers])
        metrics, sv, undefined = _metrics(spectra, scale, square)
        return [
            (
                {n: v[i * heads : (i + 1) * heads] for n, v in metrics.items()},
                sv[i * heads : (i + 1) * heads],
                {n: v[i * heads : (i + 1) * heads] for n, v in undefined.items()},
            )
            for i in range(len(layers))
        ]
    index, layer = run[0]
    num_heads = layer.num_heads
    try:
        spectra = qk_head_spectra(whole(layer.w_q), whole(layer.w_k), num_heads, layer.num_kv_heads)
    except torch.linalg.LinAlgError as err:  # an eigen-solver that did not converge
        warnings.warn(
            f"QK spectrum of layer {index}: {err}; the layer's metrics are NaN.",
            RuntimeWarning,
            stacklevel=4,
        )
        d_k = layer.w_q.shape[0] // num_heads
        nan = torch.full((num_heads, d_k), float("nan"), dtype=torch.float64)
        spectra = HeadSpectra(nan, nan.to(torch.complex128) if square else None)
    return [_metrics(spectra, _head_scale(layer.scale, num_heads), square)]


def _head_scale(scale: float | Tensor, num_heads: int) -> Tensor:
    return torch.as_tensor(scale, dtype=torch.float64).detach().cpu().expand(num_heads)


def _metrics(
    spectra: HeadSpectra, scale: Tensor, square: bool
) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]:
    """The metrics of some heads from their spectra; ``scale`` (heads,)."""
    sv, eig = spectra
    num_heads = sv.shape[0]
    metrics = {
        "kappa": spectral_concentration(sv),
        "qk_erank": effective_rank(sv),
        "qk_spectral_norm": sv[:, 0] * scale,
    }
    if eig is not None:
        eig = eig.to(torch.complex128)
        metrics["eig_mean"], metrics["eig_var"] = eigenvalue_moments(eig)
        metrics["kappa_eig"] = spectral_concentration(eig)
    else:
        metrics.update(
            {
                name: torch.full((num_heads,), float("nan"), dtype=torch.float64)
                for name in _EIGEN_METRICS
            }
        )
    zero = sv[:, 0] == 0  # False for NaN heads: broken, not undefined
    undefined = {name: torch.zeros(num_heads, dtype=torch.bool) for name in SPECTRUM_METRICS}
    for name in _RATIOS_OF_SIGMA:
        undefined[name] = zero.clone()
    # a NaN scale: the layer's logit scale could not be told from its forward (refused by name
    # where the layout was checked), not a broken weight
    undefined["qk_spectral_norm"] |= torch.isnan(scale.to(sv.device))
    if not square:
        for name in _EIGEN_METRICS:
            undefined[name] = torch.ones(num_heads, dtype=torch.bool)
    return metrics, sv, undefined


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
