"""QKSpectrumMonitor: the spectrum of every head's query-key product, from the weights alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning.pytorch as pl

from qkmonitor.alerts import Alert, AlertRule
from qkmonitor.attention.adapters import LayerSpec
from qkmonitor.engine import MonitorOptions, QKSpectrum
from qkmonitor.engine.options import keyword_only

from .base import AttentionMonitor

__all__ = ["QKSpectrumMonitor"]


class QKSpectrumMonitor(AttentionMonitor):
    r"""Log the spectrum of ``W_QK^h = W_Q^h (W_K^g)^T`` for every head of every attention layer.

    Reads weights only (no forward pass): every ``every_n_steps`` optimizer steps, and once
    before the first step, layer by layer, each head's ``d_k x d_k`` Gram matrices give its
    singular values and eigenvalues (:mod:`qkmonitor.measures.layer_spectra`). Per head:

    .. math::

        \kappa = \frac{\sigma_1}{\sum_i \sigma_i}, \quad
        \kappa_{eig} = \frac{|\lambda|_{max}}{\sum_i |\lambda_i|}, \quad
        \mathrm{erank} = \exp\Big(-\sum_i p_i \log p_i\Big),\ p_i = \frac{\sigma_i}{\sum_j
        \sigma_j}, \quad \|W_{QK}\|_2 \cdot \mathrm{scale} = \sigma_1 \cdot \mathrm{scale}.

    Logged keys (``LL`` = layer index, ``HH`` = head index, two digits; ``prefix`` =
    ``log_key_prefix``):

    - ``{prefix}/{metric}/layer_LL`` — the mean over heads — and ``{prefix}/{metric}_min/layer_LL``,
      ``{prefix}/{metric}_max/layer_LL`` — the lowest and highest head — for ``kappa``,
      ``kappa_eig``, ``eig_mean`` and ``eig_var`` (mean and variance of the eigenvalues of
      ``W_K^T W_Q``, Bao et al. 2024), ``qk_erank`` and ``qk_spectral_norm``.
    - ``{prefix}/heatmap/kappa`` — a layer x head image; ``{prefix}/qk_singular_values/layer_LL`` —
      a histogram of the layer's singular values (TensorBoard loggers only; at every
      ``visuals_every_n_probes``-th probe).
    - ``{prefix}/{metric}/layer_LL_head_HH`` for each of the above with ``per_head=True``.
    - ``{prefix}/alerts/kappa`` — how many ``kappa`` alerts have fired.

    Default alert: ``kappa >= 0.2`` growing x2.5 per 30 steps, recovering below 0.15, on layers
    without QK-norm (:data:`qkmonitor.alerts.KAPPA_RULE`, calibrated on
    ``benchmarks/instability.py``), raising :class:`qkmonitor.OverLocalizationWarning`.

    Args (keyword-only; see :class:`~qkmonitor.engine.MonitorOptions`):
        every_n_steps: probe every this many optimizer steps (default: the Trainer's
            ``log_every_n_steps``).
        per_head: also log every head's value.
        log_key_prefix: first part of every tag (tag-safe).
        alerts: the alert rules (``None``: the defaults; ``[]``: none); each must watch a metric
            this monitor logs.
        alert_action: ``"warn"``, ``"stop"`` or ``"raise"``.
        on_alert: ``on_alert(trainer, alert)`` for every alert that fires.
        layers: which attention layers (one module, a list, or a function of the model).
        visuals_every_n_probes: heatmaps, attention images and histograms at every this many
            probes, from the first (default 20; 0: never); scalars and alerts at every probe.
        defer_reads: log a training probe's values at the end of the next batch, read in one
            copy started at the probe, so that the probe's step does not wait for the device
            (alerts then come a step later, naming their probe step); default: on a GPU.
        background_weights: compute the spectrum on a worker thread from a copy of the weights,
            logged at the end of the next batch at its own step (``None``, the default: where the
            weights are on a GPU; on a CPU the worker would compete with training for the cores).
        update_spectrum: also log the spectrum of each head's query-key update over the step
            before each read (``qk_update_entropy``, ``qk_update_top_share``; off by default).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from qkmonitor.callbacks import QKSpectrumMonitor
        >>> from qkmonitor.models import TransformerConfig
        >>> from qkmonitor.models.tasks import AssociativeRecallDataModule, CausalLMTask
        >>> data = AssociativeRecallDataModule(num_pairs=2, num_queries=2, batch_size=4,
        ...                                    train_size=8, val_size=4)
        >>> model = CausalLMTask(TransformerConfig(vocab_size=data.vocab_size, d_model=16,
        ...                                        n_heads=2, max_seq_len=data.seq_len))
        >>> monitor = QKSpectrumMonitor(every_n_steps=1, per_head=True)
        >>> trainer = Trainer(max_steps=2, callbacks=[monitor], logger=False,
        ...                   enable_checkpointing=False, enable_progress_bar=False,
        ...                   enable_model_summary=False)
        >>> trainer.fit(model, data)
        >>> len(monitor.latest["kappa"]), monitor.latest["kappa"][0].shape  # layers; heads
        (2, torch.Size([2]))
        >>> all(0 <= kappa.max() <= 1 for kappa in monitor.latest["kappa"])
        True
    """

    engine: QKSpectrum

    @keyword_only
    def __init__(
        self,
        *,
        every_n_steps: int | None = None,
        per_head: bool = MonitorOptions.per_head,
        log_key_prefix: str = MonitorOptions.log_key_prefix,
        alerts: Sequence[AlertRule] | None = None,
        alert_action: str = MonitorOptions.alert_action,
        on_alert: Callable[[pl.Trainer, Alert], None] | None = None,
        layers: LayerSpec | None = None,
        visuals_every_n_probes: int = MonitorOptions.visuals_every_n_probes,
        defer_reads: bool | None = MonitorOptions.defer_reads,
        background_weights: bool | None = None,
        update_spectrum: bool = False,
    ) -> None:
        options = MonitorOptions.pick(locals())
        engine = QKSpectrum(
            options=options,
            background_weights=background_weights,
            update_spectrum=update_spectrum,
        )
        super().__init__(engine)
        # the hooks are AttentionMonitor's: the weights are read at step 0 and after the update
        # that ends each n-th step, the first batch checks the layouts of layers read by name
