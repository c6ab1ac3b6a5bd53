"""QKSpectrumMonitor: the spectrum of every head's query-key product, from the weights alone."""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from qkmonitor.adapters import AttentionLayer
from qkmonitor.alerts import KAPPA_RULE
from qkmonitor.functional import qk_singular_values, qk_spectrum_metrics

from .base import AttentionMonitor

__all__ = ["QKSpectrumMonitor"]

#: The metrics this monitor logs, in the order of the docs.
SPECTRUM_METRICS = ("kappa", "kappa_eig", "eig_mean", "eig_var", "qk_erank", "qk_spectral_norm")


class QKSpectrumMonitor(AttentionMonitor):
    r"""Log the spectrum of ``W_QK^h = W_Q^h (W_K^g)^T`` for every head of every attention layer.

    Reads weights only (no forward pass): every ``every_n_steps`` optimizer steps, and once
    before the first step, all heads of all layers go through one batched QR + ``d_k x d_k`` SVD
    and eigen-decomposition (:mod:`qkmonitor.functional`). Per head:

    .. math::

        \kappa = \frac{\sigma_1}{\sum_i \sigma_i}, \quad
        \kappa_{eig} = \frac{|\lambda|_{max}}{\sum_i |\lambda_i|}, \quad
        \mathrm{erank} = \exp\Big(-\sum_i p_i \log p_i\Big),\ p_i = \frac{\sigma_i}{\sum_j \sigma_j},
        \quad \|W_{QK}\|_2 \cdot \mathrm{scale} = \sigma_1 \cdot \mathrm{scale}.

    Logged keys (``LL`` = layer index, ``HH`` = head index, two digits; ``prefix`` =
    ``log_key_prefix``):

    - ``{prefix}/{metric}/layer_LL`` — the mean over heads — and ``{prefix}/{metric}_min/layer_LL``,
      ``{prefix}/{metric}_max/layer_LL`` — the lowest and highest head — for ``kappa``,
      ``kappa_eig``, ``eig_mean`` and ``eig_var`` (mean and variance of the eigenvalues of
      ``W_K^T W_Q``, Bao et al. 2024), ``qk_erank`` and ``qk_spectral_norm``.
    - ``{prefix}/heatmap/kappa`` — a layer x head image; ``{prefix}/qk_singular_values/layer_LL`` —
      a histogram of the layer's singular values (TensorBoard loggers only).
    - ``{prefix}/{metric}/layer_LL/head_HH`` for each of the above with ``per_head=True``.
    - ``{prefix}/alerts/kappa`` — how many ``kappa`` alerts have fired.

    Default alert: ``kappa >= 0.8`` for 2 consecutive probes, recovering below 0.75
    (:data:`qkmonitor.alerts.KAPPA_RULE`), raising :class:`qkmonitor.OverLocalizationWarning`.

    Args: see :class:`~qkmonitor.callbacks.base.AttentionMonitor`.

    Example::

        from lightning.pytorch import Trainer
        from qkmonitor.callbacks import QKSpectrumMonitor

        trainer = Trainer(callbacks=[QKSpectrumMonitor(every_n_steps=50, per_head=True)])
    """

    metric_names = SPECTRUM_METRICS
    heatmaps = {"kappa": (0.0, 1.0)}
    default_rules = (KAPPA_RULE,)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == 0 and self.latest_step is None:  # the spectrum at initialization
            self._collect_and_log(trainer, pl_module, 0)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step  # after the optimizer step: the weights of this step
        if step > 0 and self._is_probe_step(step):
            self._collect_and_log(trainer, pl_module, step)

    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, list[Tensor]]:
        # Under FSDP every rank holds a shard: gather the full weights (read-only) for the probe.
        with _full_parameters(getattr(trainer.strategy, "model", None)):
            values = spectrum_of_layers(self.layers, keep_singular_values=True)
        self._singular_values = values.pop("singular_values")
        return values

    def _draws_visuals(self) -> bool:
        return True

    def _histograms(self) -> dict[str, Tensor]:
        """Each layer's singular values of W_QK, all heads together."""
        out = {}
        for i, sv in enumerate(getattr(self, "_singular_values", [])):
            finite = sv[torch.isfinite(sv)]  # NaN heads are in the scalars; a histogram needs numbers
            if finite.numel():
                out[f"{self.prefix}/qk_singular_values/layer_{i:02d}"] = finite
        return out


def _full_parameters(model: nn.Module | None):
    """A context in which FSDP (v1) parameters are unsharded; a no-op for anything else."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return nullcontext()
    if model is not None and any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True)
    return nullcontext()


def full_tensor(weight: Tensor) -> Tensor:
    """The whole tensor behind a sharded parameter (FSDP2 / DTensor), else the tensor itself."""
    weight = weight.detach()
    to_full = getattr(weight, "full_tensor", None)  # torch.distributed.tensor.DTensor
    return to_full() if callable(to_full) else weight


def spectrum_of_layers(layers: list[AttentionLayer], keep_singular_values: bool = False) -> dict[str, list[Tensor]]:
    """The spectrum metrics of each layer; layers of the same shape go through one batched call.

    Returns:
        metric -> one (num_heads,) tensor per layer, in the order of ``layers``; with
        ``keep_singular_values`` also ``"singular_values"`` -> one (num_heads, d_k) per layer.
    """
    groups: dict[tuple, list[int]] = defaultdict(list)
    weights = [layer.qk_weights() for layer in layers]
    for i, w in enumerate(weights):
        key = (tuple(w.w_q.shape), tuple(w.w_k.shape), w.num_heads, w.num_kv_heads, w.w_q.device)
        groups[key].append(i)
    per_layer: list[dict[str, Tensor]] = [{} for _ in layers]
    for (_, _, num_heads, num_kv_heads, _), members in groups.items():
        w_q = torch.stack([full_tensor(weights[i].w_q) for i in members])  # (G, H*d_k, d)
        w_k = torch.stack([full_tensor(weights[i].w_k) for i in members])
        scale = torch.tensor([weights[i].scale for i in members], dtype=torch.float64)
        try:
            metrics = qk_spectrum_metrics(w_q, w_k, num_heads, num_kv_heads, scale.to(w_q.device))
            if keep_singular_values:
                metrics["singular_values"] = qk_singular_values(w_q, w_k, num_heads, num_kv_heads)
        except torch.linalg.LinAlgError as err:  # a decomposition that did not converge
            rank_zero_warn(f"QKSpectrumMonitor: {err}; the affected layers are logged as NaN.")
            nan = torch.full((len(members), num_heads), float("nan"))
            metrics = {name: nan for name in SPECTRUM_METRICS}
            metrics["singular_values"] = nan[..., None]
        names = (*SPECTRUM_METRICS, "singular_values") if keep_singular_values else SPECTRUM_METRICS
        for j, i in enumerate(members):
            per_layer[i] = {name: metrics[name][j] for name in names}
    names = (*SPECTRUM_METRICS, "singular_values") if keep_singular_values else SPECTRUM_METRICS
    return {name: [values[name] for values in per_layer] for name in names}
