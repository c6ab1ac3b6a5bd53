"""AttentionEntropyMonitor: how spread each head's attention is, from the training forward."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from qkmonitor.alerts import ENTROPY_COLLAPSE_RULE, LOGIT_GROWTH_RULE
from qkmonitor.metrics import AttentionStatistics

from .base import ActivationMonitor

__all__ = ["AttentionEntropyMonitor"]

ENTROPY_METRICS = ("entropy", "entropy_norm", "max_prob", "max_logit")


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
    - ``{prefix}/heatmap/entropy_norm``, ``{prefix}/heatmap/max_prob`` — layer x head images.
    - ``{prefix}/{metric}/layer_LL/head_HH`` with ``per_head=True``.
    - ``{prefix}/alerts/entropy_collapse``, ``{prefix}/alerts/logit_growth``.

    Default alerts: ``entropy_norm <= 0.1`` (:data:`~qkmonitor.alerts.ENTROPY_COLLAPSE_RULE`) and
    ``max_logit >= 50`` (:data:`~qkmonitor.alerts.LOGIT_GROWTH_RULE`), 2 probes in a row.

    Example::

        trainer = Trainer(callbacks=[AttentionEntropyMonitor(every_n_steps=50)])
    """

    metric_names = ENTROPY_METRICS
    heatmaps = {"entropy_norm": (0.0, 1.0), "max_prob": (0.0, 1.0)}
    default_rules = (ENTROPY_COLLAPSE_RULE, LOGIT_GROWTH_RULE)

    def __init__(self, *args, sink_tokens: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"Expected `sink_tokens` to be an int >= 0, got {sink_tokens!r}")
        self.sink_tokens = sink_tokens
        if sink_tokens:
            self.metric_names = (*ENTROPY_METRICS, "sink_mass")

    def _setup_probes(self, pl_module: pl.LightningModule) -> None:
        unsupported = [layer.name for layer in self.layers if not layer.supports_stats]
        if unsupported:
            raise ValueError(
                f"AttentionEntropyMonitor: layers {unsupported} give no attention statistics; "
                "pass `layers=` with AttentionLayer adapters that implement `set_probe`/`pop_stats`"
            )
        self._aggregators = [
            AttentionStatistics(layer.qk_weights().num_heads).to(pl_module.device) for layer in self.layers
        ]
        self._warned_missing = False

    def _set_probes(self, enabled: bool) -> None:
        for layer in self.layers:
            layer.sink_tokens = self.sink_tokens
            layer.set_probe(enabled)

    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, list[Tensor]]:
        per_layer = []
        for layer, aggregator in zip(self.layers, self._aggregators):
            stats = layer.pop_stats()
            if stats is None:
                self._warn_missing(layer.name)
            else:
                aggregator.update(stats)
            # compute() on every rank, updated or not: it is the collective that sums the states
            # across processes (a rank that saw no rows adds zeros; no rows at all gives NaN).
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*was called before the ``update`` method.*")
                values = aggregator.compute()
            aggregator.reset()
            per_layer.append(values)
        nan = float("nan")
        return {name: [values.get(name, torch.full((agg.num_heads,), nan)) for values, agg in
                       zip(per_layer, self._aggregators)] for name in self.metric_names}

    def _warn_missing(self, name: str) -> None:
        if not self._warned_missing:
            self._warned_missing = True
            rank_zero_warn(
                f"AttentionEntropyMonitor: layer {name!r} did not run in the probed forward; its "
                "entropy is logged as NaN. This warning is shown once."
            )


