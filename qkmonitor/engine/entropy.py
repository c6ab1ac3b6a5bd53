r"""AttentionEntropy: how spread each head's attention is, from the training forward itself.

Per query row i over the :math:`n_i` keys it may attend, with probabilities :math:`p_{ij}` and
scaled logits :math:`s_{ij}`:

.. math::

    H_i = -\sum_j p_{ij}\log p_{ij}, \quad \tilde H_i = \frac{H_i}{\log n_i}, \quad
    \max_j p_{ij}, \quad \max_j s_{ij}.

A head's value is the mean over every row of every call in the probe window (rows with
:math:`n_i \le 1` are left out of ``entropy_norm``, fully masked rows out of everything), except
``max_logit``: the largest. Sums are torchmetrics states
(:class:`qkmonitor.metrics.AttentionStatistics`), so under DDP the values cover every rank's rows.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from qkmonitor.alerts import LOGIT_BURST_RULE, LOGIT_GROWTH_RULE, LOGIT_JUMP_RULE
from qkmonitor.catalogue import ENTROPY, names_of
from qkmonitor.engine.base import ActivationEngine, Values
from qkmonitor.metrics import AttentionStatistics
from qkmonitor.probes import ProbeRequest, ProbeResult
from qkmonitor.validation import check_non_negative_int

__all__ = ["AttentionEntropy"]


class AttentionEntropy(ActivationEngine):
    """Logs entropy, entropy_norm, max_prob and max_logit (and sink_mass with ``sink_tokens``).

    Args:
        sink_tokens: also log ``sink_mass``, the mean attention mass on the first this-many keys.
        **kwargs: ``options`` or the fields of :class:`~qkmonitor.engine.MonitorOptions`.
    """

    monitor = ENTROPY
    default_rules = (LOGIT_GROWTH_RULE, LOGIT_BURST_RULE, LOGIT_JUMP_RULE)

    def __init__(self, *, sink_tokens: int = 0, **kwargs: Any) -> None:
        check_non_negative_int("sink_tokens", sink_tokens)
        self.sink_tokens = sink_tokens
        super().__init__(**kwargs)
        self._aggregators: list[AttentionStatistics] = []

    @property
    def metric_names(self) -> tuple[str, ...]:
        names = names_of(self.monitor, optional=True)
        return names if self.sink_tokens else tuple(n for n in names if n != "sink_mass")

    def _request(self) -> ProbeRequest:
        return ProbeRequest(stats=True, sink_tokens=self.sink_tokens)

    def _prepare(self, model: nn.Module) -> None:
        super()._prepare(model)
        # created on the CPU; each update moves them to where the statistics are
        self._aggregators = [AttentionStatistics(layer.num_heads_hint) for layer in self.layers]

    def _measure(
        self, results: list[ProbeResult], step: int, *, visuals: bool
    ) -> tuple[Values, dict[str, Any]]:
        values: Values = {name: [] for name in self.metric_names}
        undefined: dict[str, list[Tensor]] = {name: [] for name in self.metric_names}
        for i, result in enumerate(results):
            heads = [stats.entropy.shape[1] for stats in result.stats]
            if (
                heads
                and heads[0] != self._aggregators[i].num_heads
                and not self.layers[i].layout_ready
            ):
                # a layer read by interception: its calls tell its head count
                self._aggregators[i] = AttentionStatistics(heads[0])
            aggregator = self._aggregators[i]
            for stats in result.stats:
                if aggregator.device != stats.entropy.device:
                    aggregator.to(stats.entropy.device)
                aggregator.update(stats)
            # compute() on every rank, updated or not: it is the collective that sums the states
            # across processes (a rank that saw no rows adds zeros; no rows at all gives NaN)
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message=".*was called before the ``update`` method.*"
                )
                computed = aggregator.compute()
            aggregator.reset()
            nan = torch.full((aggregator.num_heads,), math.nan)
            no_rows, no_spread = (computed["rows"] == 0).cpu(), (computed["norm_rows"] == 0).cpu()
            for name in self.metric_names:
                values[name].append(computed.get(name, nan).float().cpu())
                # no row (an empty batch), or no row with two keys (one-token sequences): NaN by
                # definition
                undefined[name].append(no_spread | no_rows if name == "entropy_norm" else no_rows)
        return values, {"undefined": undefined}
