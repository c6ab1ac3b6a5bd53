"""(Interim) the spectrum of many layers; replaced by the Gram/Cholesky core on merge."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from qkmonitor.adapters import QKWeights
from qkmonitor.functional import qk_singular_values, qk_spectrum_metrics

SPECTRUM_METRICS = ("kappa", "kappa_eig", "eig_mean", "eig_var", "qk_erank", "qk_spectral_norm")


@dataclass
class LayerSpectra:
    metrics: dict[str, list[Tensor]]
    singular_values: list[Tensor]
    undefined: dict[str, list[Tensor]] = field(default_factory=dict)


def full_parameters(model: nn.Module | None):
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return nullcontext()
    if model is not None and any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True)
    return nullcontext()


def full_tensor(weight: Tensor) -> Tensor:
    weight = weight.detach()
    to_full = getattr(weight, "full_tensor", None)
    return to_full() if callable(to_full) else weight


def spectrum_of_layers(weights: Sequence[QKWeights]) -> LayerSpectra:
    metrics: dict[str, list[Tensor]] = {name: [] for name in SPECTRUM_METRICS}
    svs = []
    for w in weights:
        w_q, w_k = full_tensor(w.w_q)[None], full_tensor(w.w_k)[None]
        try:
            values = qk_spectrum_metrics(w_q, w_k, w.num_heads, w.num_kv_heads,
                                         torch.tensor([w.scale], dtype=torch.float64, device=w_q.device))
            sv = qk_singular_values(w_q, w_k, w.num_heads, w.num_kv_heads)[0]
        except torch.linalg.LinAlgError:
            nan = torch.full((1, w.num_heads), float("nan"))
            values = {name: nan for name in SPECTRUM_METRICS}
            sv = nan[0, :, None]
        for name in SPECTRUM_METRICS:
            metrics[name].append(values[name][0].float().cpu())
        svs.append(sv.float().cpu())
    return LayerSpectra(metrics, svs)
