"""QKSpectrumMonitor: the spectrum of every head's query-key product, from the weights alone."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from qkmonitor.alerts import KAPPA_RULE
from qkmonitor.spectrum import SPECTRUM_METRICS, full_parameters, spectrum_of_layers

from .base import AttentionMonitor

__all__ = ["QKSpectrumMonitor"]


class QKSpectrumMonitor(AttentionMonitor):
    r"""Log the spectrum of ``W_QK^h = W_Q^h (W_K^g)^T`` for every head of every attention layer.

    Reads weights only (no forward pass): every ``every_n_steps`` optimizer steps, and once
    before the first step, layer by layer, the heads of a layer go through batched Gram products
    and one ``d_k x d_k`` symmetric and one general eigenproblem each (:mod:`qkmonitor.spectrum`).
    Per head:

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
        with full_parameters(getattr(trainer.strategy, "model", None)):
            spectra = spectrum_of_layers([layer.qk_weights() for layer in self.layers])
        self._singular_values = spectra.singular_values
        return spectra.metrics

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
