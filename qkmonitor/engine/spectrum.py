r"""QKSpectrum: the spectrum of every head's query-key product, from the weights alone.

Per head h, over the singular values :math:`\sigma_i` and eigenvalues :math:`\lambda_i` of
:math:`W_{QK}^h = W_Q^h (W_K^g)^\top` (:mod:`qkmonitor.spectrum`):

.. math::

    \kappa = \frac{\sigma_1}{\sum_i \sigma_i}, \quad
    \kappa_{eig} = \frac{|\lambda|_{max}}{\sum_i |\lambda_i|}, \quad
    \mathrm{erank} = \exp\Big(-\sum_i p_i \log p_i\Big),\ p_i = \frac{\sigma_i}{\sum_j \sigma_j},
    \quad \sigma_1 \cdot \mathrm{scale}.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from qkmonitor.alerts import KAPPA_RULE
from qkmonitor.catalogue import SPECTRUM
from qkmonitor.engine.base import Host, MonitorEngine
from qkmonitor.spectrum import full_parameters, spectrum_of_layers

__all__ = ["QKSpectrum"]


class QKSpectrum(MonitorEngine):
    """Logs κ, κ_eig, eig_mean, eig_var, qk_erank and qk_spectral_norm per layer and head, a κ
    heatmap and a histogram of each layer's singular values (``{prefix}/qk_singular_values/layer_LL``).

    Reads weights only: at step 0 (the initialization) and after every ``every_n_steps``-th
    optimizer step. Arguments: see :class:`~qkmonitor.engine.base.MonitorEngine`.
    """

    monitor = SPECTRUM
    default_rules = (KAPPA_RULE,)

    def observe_weights(self, host: Host, step: int, *, full_model: nn.Module | None = None, **kwargs: Any) -> None:
        """Measure and log the weights after ``step`` optimizer steps if that is a probe step.

        Args:
            full_model: the wrapped model under FSDP (v1), whose shards are gathered for the read.
        """
        if not self.is_probe_step(step):
            return
        with torch.no_grad(), full_parameters(full_model):
            spectra = spectrum_of_layers([layer.qk_weights() for layer in self.layers])
        histograms = self._histograms(spectra.singular_values) if self.draws_visuals(step) else {}
        self.record(host, spectra.metrics, step, undefined=spectra.undefined, histograms=histograms)

    def _histograms(self, singular_values: list[Tensor]) -> dict[str, Tensor]:
        out = {}
        for i, sv in enumerate(singular_values):
            finite = sv[torch.isfinite(sv)]  # NaN heads are in the scalars; a histogram needs numbers
            if finite.numel():
                out[f"{self.prefix}/qk_singular_values/layer_{i:02d}"] = finite
        return out
