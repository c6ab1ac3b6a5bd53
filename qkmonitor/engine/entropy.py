r"""AttentionEntropy: how spread each head's attention is, from the training forward itself.

Per query row i over the :math:`n_i` keys it may attend, with probabilities :math:`p_{ij}` and
scaled logits :math:`s_{ij}`:

.. math::

    H_i = -\sum_j p_{ij}\log p_{ij}, \quad \tilde H_i = \frac{H_i}{\log n_i}, \quad
    \max_j p_{ij}, \quad \max_j s_{ij}.

A head's value is the mean over every row of every call in the probe window (rows with
:math:`n_i \le 1` are left out of ``entropy_norm``, fully masked rows out of everything), except
``max_logit``: the largest. Sums are torchmetrics states
(:class:`qkmonitor.metrics.AttentionStatistics`), reduced across processes with the other engines'
(:func:`qkmonitor.engine.base.finish_windows`), so under DDP the values cover every rank's rows.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from qkmonitor.alerts import LOGIT_BURST_RULE, LOGIT_GROWTH_RULE, LOGIT_JUMP_RULE
from qkmonitor.catalogue import ENTROPY, names_of
from qkmonitor.engine.base import ActivationEngine, Values
from qkmonitor.metrics import AttentionStatistics
from qkmonitor.probes import ProbeRequest, ProbeResult
from qkmonitor.validation import check_int_between

__all__ = ["MAX_SINK_TOKENS", "AttentionEntropy"]

#: the most keys ``sink_tokens`` may name: an attention sink is a few keys at a sequence's start
#: (StreamingLLM keeps 4); the mass on hundreds of keys measures a window, not a sink, and a count
#: at or past a sequence's length makes ``sink_mass`` 1 by definition
MAX_SINK_TOKENS = 256


class AttentionEntropy(ActivationEngine):
    """Logs entropy, entropy_norm, max_prob and max_logit (and sink_mass with ``sink_tokens``).

    Args:
        sink_tokens: also log ``sink_mass``, the mean attention mass on the first this-many keys
            (0 to :data:`MAX_SINK_TOKENS`; 0: off).
        **kwargs: ``options`` or the fields of :class:`~qkmonitor.engine.MonitorOptions`.
    """

    monitor = ENTROPY
    default_rules = (LOGIT_GROWTH_RULE, LOGIT_BURST_RULE, LOGIT_JUMP_RULE)

    def __init__(self, *, sink_tokens: int = 0, **kwargs: Any) -> None:
        check_int_between("sink_tokens", sink_tokens, 0, MAX_SINK_TOKENS)
        self.sink_tokens = sink_tokens
        super().__init__(**kwargs)
        self._heads: list[slice] = []  # each layer's slots in the aggregator
        self._aggregator = AttentionStatistics(1, sync_on_compute=False)

    @property
    def metric_names(self) -> tuple[str, ...]:
        names = names_of(self.monitor, optional=True)
        return names if self.sink_tokens else tuple(n for n in names if n != "sink_mass")

    def _request(self) -> ProbeRequest:
        return ProbeRequest(stats=True, sink_tokens=self.sink_tokens)

    def _prepare(self, model: nn.Module) -> None:
        super()._prepare(model)
        self._fit([layer.num_heads_hint for layer in self.layers])

    def _fit(self, heads: list[int]) -> None:
        """One aggregator for every layer, their heads side by side (created on the CPU; an update
        moves it to where the statistics are): one ``compute`` and ``reset`` a probe."""
        starts = [0, *itertools.accumulate(heads)]
        self._heads = [slice(a, b) for a, b in itertools.pairwise(starts)]
        self._aggregator = AttentionStatistics(max(starts[-1], 1), sync_on_compute=False)

    def aggregators(self) -> list[Metric]:
        return [self._aggregator]

    def _accumulate(self, results: list[ProbeResult], step: int, *, visuals: bool) -> None:
        heads = [h.stop - h.start for h in self._heads]
        observed = [
            result.stats[0].entropy.shape[1] if result.stats and not layer.layout_ready else count
            for layer, result, count in zip(self.layers, results, heads)
        ]
        if observed != heads:  # layers read by interception: their calls tell their head counts
            self._fit(observed)
        aggregator = self._aggregator
        for result, columns in zip(results, self._heads):
            for stats in result.stats:
                if aggregator.device != stats.entropy.device:
                    aggregator.to(stats.entropy.device)
                aggregator.update(stats, columns)

    def _values(self, carried: None) -> tuple[Values, dict[str, Any]]:
        # the states hold every rank's rows (reduced by the caller: a rank that saw no rows adds
        # zeros; no rows at all gives NaN)
        aggregator = self._aggregator
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*was called before the ``update`` method.*")
            computed = aggregator.compute()
        aggregator.reset()
        nan = torch.full((aggregator.num_heads,), math.nan)
        # (torchmetrics makes a one-slot result a scalar)
        computed = {name: value.float().cpu().reshape(-1) for name, value in computed.items()}
        no_rows, no_spread = computed["rows"] == 0, computed["norm_rows"] == 0
        values: Values = {}
        undefined: dict[str, list[Tensor]] = {}
        for name in self.metric_names:
            # no row (an empty batch), or no row with two keys (one-token sequences): NaN by
            # definition
            blank = no_spread | no_rows if name == "entropy_norm" else no_rows
            values[name] = [computed.get(name, nan)[h] for h in self._heads]
            undefined[name] = [blank[h] for h in self._heads]
        return values, {"undefined": undefined}
