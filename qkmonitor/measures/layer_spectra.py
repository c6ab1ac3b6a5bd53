r"""The QK-spectrum metrics of a whole model, one layer at a time, and what a layer's weights are.

:class:`QKWeights` is what every family's ``qk_weights()`` returns: a layer's query and key
projections and how they split into heads. :func:`spectrum_of_layers` reads them layer by layer
(no stacked copy of the model; a sharded weight gathered for its layer only), solves runs of small
layers of one shape as one batch of heads, and turns each head's singular values and eigenvalues
(:func:`qkmonitor.measures.gram_spectra.qk_head_spectra`, the Gram method and its accuracy) into
the metrics the spectrum monitor logs. :func:`full_parameters` unshards FSDP (v1) parameters for
the read.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from qkmonitor.measures.gram_spectra import HeadSpectra, qk_head_spectra
from qkmonitor.measures.ranks import effective_rank
from qkmonitor.measures.sharding import whole
from qkmonitor.measures.spectra import eigenvalue_moments, spectral_concentration

__all__ = [
    "SPECTRUM_METRICS",
    "LayerSpectra",
    "QKWeights",
    "full_parameters",
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
