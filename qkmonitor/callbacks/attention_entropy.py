"""AttentionEntropyMonitor: how spread each head's attention is, from the training forward."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning.pytorch as pl

from qkmonitor.alerts import Alert, AlertRule
from qkmonitor.attention.adapters import LayerSpec
from qkmonitor.engine import AttentionEntropy, MonitorOptions
from qkmonitor.engine.options import keyword_only

from .base import ActivationMonitor

__all__ = ["AttentionEntropyMonitor"]


class AttentionEntropyMonitor(ActivationMonitor):
    r"""Log attention entropy, normalized entropy, max probability and max logit per layer and head.

    At probe steps the training forward itself is measured: qkmonitor's own attention takes the
    statistics from the fused kernel (same pass, no N x N matrix); ``nn.MultiheadAttention``
    recomputes its scores on the side from the call's inputs. Per query row i over the n_i keys it
    may attend, with probabilities p_ij and scaled logits s_ij:

    .. math::

        H_i = -\sum_j p_{ij}\log p_{ij}, \quad \tilde H_i = \frac{H_i}{\log n_i}, \quad
        \max_j p_{ij}, \quad \max_j s_{ij}.

    A head's value is the mean over rows and batch (rows with n_i ≤ 1 are left out of
    ``entropy_norm``, fully masked rows out of everything), except ``max_logit``: the largest over
    all rows. Sums are torchmetrics states, so under DDP the logged values cover every rank's rows.

    Logged keys (``LL`` layer, ``HH`` head, ``prefix`` = ``log_key_prefix``):

    - ``{prefix}/{metric}/layer_LL`` (mean over heads), ``{prefix}/{metric}_min/layer_LL`` and
      ``{prefix}/{metric}_max/layer_LL`` (lowest and highest head) for ``entropy`` (nats),
      ``entropy_norm`` (in [0, 1]), ``max_prob`` and ``max_logit``.
    - ``{prefix}/sink_mass/layer_LL`` (+ ``_min``, ``_max``) with ``sink_tokens=k`` > 0: the mean
      attention mass on the first k keys ("attention sinks"), from qkmonitor's own attention and
      ``nn.MultiheadAttention`` (NaN for adapters that cannot measure it).
    - ``{prefix}/heatmap/entropy_norm``, ``{prefix}/heatmap/max_prob`` — layer x head images (at
      every ``visuals_every_n_probes``-th probe).
    - ``{prefix}/{metric}/layer_LL_head_HH`` with ``per_head=True``.
    - ``{prefix}/alerts/logit_growth``, ``{prefix}/alerts/logit_burst``,
      ``{prefix}/alerts/logit_jump`` (the default rules).

    Default alerts (calibrated on ``benchmarks/instability.py``), all on ``max_logit``:
    ``>= 30`` growing x8 per 20 steps while the loss is not falling
    (:data:`~qkmonitor.alerts.LOGIT_GROWTH_RULE`), ``>= 50`` after x10 within 10 steps
    (:data:`~qkmonitor.alerts.LOGIT_BURST_RULE`, no loss gate), and ``>= 20`` after x5 within 10
    steps while the loss is not falling (:data:`~qkmonitor.alerts.LOGIT_JUMP_RULE`).
    :data:`~qkmonitor.alerts.ENTROPY_COLLAPSE_RULE` is opt-in.

    Args (keyword-only): those of :class:`~qkmonitor.callbacks.QKSpectrumMonitor`, and
        sink_tokens: also log ``sink_mass`` on the first this-many keys (0: off; at most 256,
            ``qkmonitor.engine.entropy.MAX_SINK_TOKENS``).
        probe_validation: also measure the first validation batch of each validation run, logged
            under ``{prefix}/val/...``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from qkmonitor.callbacks import AttentionEntropyMonitor
        >>> from qkmonitor.models import TransformerConfig
        >>> from qkmonitor.models.tasks import AssociativeRecallDataModule, CausalLMTask
        >>> data = AssociativeRecallDataModule(num_pairs=2, num_queries=2, batch_size=4,
        ...                                    train_size=8, val_size=4)
        >>> model = CausalLMTask(TransformerConfig(vocab_size=data.vocab_size, d_model=16,
        ...                                        n_heads=2, max_seq_len=data.seq_len))
        >>> monitor = AttentionEntropyMonitor(every_n_steps=1)
        >>> trainer = Trainer(max_steps=2, callbacks=[monitor], logger=False,
        ...                   enable_checkpointing=False, enable_progress_bar=False,
        ...                   enable_model_summary=False)
        >>> trainer.fit(model, data)
        >>> sorted(monitor.latest)
        ['entropy', 'entropy_norm', 'max_logit', 'max_prob']
        >>> all(0 <= h.min() and h.max() <= 1 for h in monitor.latest["entropy_norm"])
        True
    """

    engine: AttentionEntropy

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
        probe_validation: bool = False,
        sink_tokens: int = 0,
    ) -> None:
        engine = AttentionEntropy(options=MonitorOptions.pick(locals()), sink_tokens=sink_tokens)
        super().__init__(engine, probe_validation=probe_validation)
