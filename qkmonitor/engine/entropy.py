r"""AttentionEntropy: how spread each head's attention is, from the training forward itself.

Per query row i over the :math:`n_i` keys it may attend, with probabilities :math:`p_{ij}` and
scaled logits :math:`s_{ij}`:

.. math::

    H_i = -\sum_j p_{ij}\log p_{ij}, \quad \tilde H_i = \frac{H_i}{\log n_i}, \quad
    \max_j p_{ij}, \quad \max_j s_{ij}.

The same probe reads the model's output logits (:class:`qkmonitor.measures.metrics.OutputLogits`:
``output_lse_rms``, the RMS of each position's log-partition, and ``output_logit_max``), logged
under ``{prefix}/run/`` and read by the rules as run signals. They are the output of the model's
forward (a tensor, ``.logits``, ``["logits"]`` or a tuple's first), or, where the model's own
forward does not run (a LightningModule's ``training_step`` calls a submodule), of the last of its
direct children to run with such an output (``lm_head``, a wrapped model; never an attention
layer); which one is decided at the first probe and kept.

A head's value is the mean over every row of every call in the probe window (rows with
:math:`n_i \le 1` are left out of ``entropy_norm``, fully masked rows out of everything), except
``max_logit``: the largest. Sums are torchmetrics states
(:class:`qkmonitor.measures.metrics.AttentionStatistics`), reduced across processes with the other
engines' (:func:`qkmonitor.engine.base.finish_windows`), so under DDP the values cover every rank's
rows.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from qkmonitor.alerts import (
    FAST_UPDATES_RULE,
    LOGIT_BURST_RULE,
    LOGIT_GROWTH_RULE,
    LOGIT_JUMP_RULE,
    LOGIT_PLATEAU_RULE,
)
from qkmonitor.attention.compiled import add_forward_hooks
from qkmonitor.attention.probes import ProbeRequest, ProbeResult, recomputing
from qkmonitor.engine.activation import ActivationEngine, Window, observed_heads, placed
from qkmonitor.engine.host import Host
from qkmonitor.engine.publishing import Values
from qkmonitor.measures.catalogue import ENTROPY, names_of
from qkmonitor.measures.metrics import AttentionStatistics, OutputLogits, logit_sums
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
    default_rules = (
        LOGIT_GROWTH_RULE,
        LOGIT_BURST_RULE,
        LOGIT_JUMP_RULE,
        FAST_UPDATES_RULE,
        LOGIT_PLATEAU_RULE,
    )

    def __init__(self, *, sink_tokens: int = 0, **kwargs: Any) -> None:
        check_int_between("sink_tokens", sink_tokens, 0, MAX_SINK_TOKENS)
        self.sink_tokens = sink_tokens
        super().__init__(**kwargs)
        self._heads: list[slice] = []  # each layer's slots in the aggregator
        self._aggregator = AttentionStatistics(1, sync_on_compute=False)
        self._output = OutputLogits(sync_on_compute=False)
        #: where the output logits come from: 0 the model, i > 0 its i-th direct child; None
        #: until a probe has seen them
        self._logits_source: int | None = None
        self._output_hooks: list = []
        self._output_sums: dict[int, list] = {}  # a window's logit sums, by source
        self._output_order: list[int] = []  # the sources in the order they ran
        self._output_window: list | None = None  # the chosen source's sums, for _accumulate
        self._told_no_logits = False
        self._output_failure: str | None = None  # why a window's logits could not be read
        self._failed: dict[int, tuple[int, Exception]] = {}  # layers whose aggregation raised
        self._broken: set[int] = set()  # of them, those of the window being completed

    @property
    def metric_names(self) -> tuple[str, ...]:
        names = names_of(self.monitor, optional=True)
        return names if self.sink_tokens else tuple(n for n in names if n != "sink_mass")

    def _request(self) -> ProbeRequest:
        return ProbeRequest(stats=True, sink_tokens=self.sink_tokens)

    def _prepare(self, model: nn.Module) -> None:
        super()._prepare(model)
        self._fit([layer.num_heads_hint for layer in self.layers])
        self._logits_source = None
        self._told_no_logits = False
        self._output.reset()

    # -- the output logits -------------------------------------------------------------------

    def _open_extra(self) -> None:
        self._output_sums, self._output_order, self._output_window = {}, [], None
        model = self._model() if self._model is not None else None
        if model is None:
            return
        attention = {id(layer.module) for layer in self.layers}  # their outputs are no logits
        candidates = [model, *model.children()]
        chosen = range(len(candidates)) if self._logits_source is None else [self._logits_source]
        self._output_hooks = [
            add_forward_hooks(candidates[i], post=self._output_hook(i))
            for i in chosen
            if i < len(candidates) and id(candidates[i]) not in attention
        ]

    def _output_hook(self, index: int):
        def hook(module: nn.Module, args, output) -> None:
            logits = logits_of(output)
            if logits is None or recomputing():
                return
            try:
                with torch.no_grad():
                    sums = logit_sums(logits)
            except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
                self._output_failure = f"{type(err).__name__}: {err}"
                return
            self._output_sums.setdefault(index, []).append(sums)
            self._output_order.append(index)

        return hook

    def _close_extra(self) -> None:
        hooks, self._output_hooks = self._output_hooks, []
        for remove in hooks:
            remove()
        sums, order = self._output_sums, self._output_order
        self._output_sums, self._output_order = {}, []
        if not order:
            return
        if self._logits_source is None:  # the model itself, else the last child that ran
            self._logits_source = 0 if 0 in sums else order[-1]
        self._output_window = sums.get(self._logits_source)

    def _fit(self, heads: list[int]) -> None:
        """One aggregator for every layer, their heads side by side (created on the CPU; an update
        moves it to where the statistics are): one ``compute`` and ``reset`` a probe."""
        starts = [0, *itertools.accumulate(heads)]
        self._heads = [slice(a, b) for a, b in itertools.pairwise(starts)]
        self._aggregator = AttentionStatistics(max(starts[-1], 1), sync_on_compute=False)

    def aggregators(self) -> list[Metric]:
        return [self._aggregator, self._output]

    def complete(self, host: Host, window: Window) -> None:
        failure, self._output_failure = self._output_failure, None
        if failure is not None:
            self.warn_once(
                host, "output logits", f"the output logits could not be read ({failure})"
            )
        failed, self._failed = self._failed, {}
        for i, (step, err) in failed.items():
            self.warn_failure(host, "aggregating the statistics", step, err, [self.layers[i].name])
        self._broken = set(failed)
        super().complete(host, window)
        if self._logits_source is None and not window.validation and not self._told_no_logits:
            self._told_no_logits = True
            host.info(
                f"qkmonitor: {type(self).__name__} ({self.prefix}): no output logits were found "
                "in the probed forward (neither the model's output nor a direct child's is a "
                "tensor, .logits or ['logits'] of at least 2 dims): output_lse_rms and "
                "output_logit_max are not logged"
            )

    def _accumulate(self, results: list[ProbeResult], step: int, *, visuals: bool) -> None:
        heads = [h.stop - h.start for h in self._heads]
        observed = [
            observed_heads(layer, result, count)
            for layer, result, count in zip(self.layers, results, heads)
        ]
        if observed != heads:  # layers read by interception: their calls tell their head counts
            self._fit(observed)
        window, self._output_window = self._output_window, None
        for sums in window or []:
            self._output.add(*sums)
        aggregator = self._aggregator
        self._failed = {}
        for i, (result, columns) in enumerate(zip(results, self._heads)):
            columns = placed(columns, result.placement)
            try:
                for stats in result.stats:
                    if aggregator.device != stats.entropy.device:
                        aggregator.to(stats.entropy.device)
                    aggregator.update(stats, columns)
            except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
                self._failed[i] = (step, err)  # NaN at this step (warned in `complete`)

    def _values(self, carried: None) -> tuple[Values, dict[str, Any]]:
        # the states hold every rank's rows (reduced by the caller: a rank that saw no rows adds
        # zeros; no rows at all gives NaN); everything stays on the aggregator's device, read by
        # the host in the probe's one copy (`record`)
        aggregator = self._aggregator
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*was called before the ``update`` method.*")
            computed = aggregator.compute()
        aggregator.reset()
        run: dict[str, Tensor] = {}
        if self._logits_source is not None:  # (none found: nothing logged, said once)
            run = {k: v.reshape(-1)[0] for k, v in self._output.values().items()}
        self._output.reset()
        # (torchmetrics makes a one-slot result a scalar)
        computed = {name: value.float().reshape(-1) for name, value in computed.items()}
        no_rows, no_spread = computed["rows"] == 0, computed["norm_rows"] == 0
        nan = torch.full_like(computed["rows"], math.nan)
        values: Values = {}
        undefined: dict[str, list[Tensor]] = {}
        broken = [i in self._broken for i in range(len(self._heads))]
        for name in self.metric_names:
            # no row (an empty batch), or no row with two keys (one-token sequences): NaN by
            # definition
            blank = no_spread | no_rows if name == "entropy_norm" else no_rows
            values[name] = [
                nan[h] if out else computed.get(name, nan)[h] for out, h in zip(broken, self._heads)
            ]
            # a layer whose aggregation failed is NaN, warned about already (not as non-finite)
            undefined[name] = [blank[h] | out for out, h in zip(broken, self._heads)]
        # rows, none of them with two keys: entropy_norm undefined for the data seen (said once)
        one_key = no_spread & ~no_rows
        notes = {"entropy_norm": [one_key[h] for h in self._heads]}
        return values, {"undefined": undefined, "notes": notes, "run_values": run}


def logits_of(output: Any) -> Tensor | None:
    """The logits in a module's output: a floating tensor of at least 2 dims whose last (the
    classes) has at least 2 entries, as it is, as ``.logits``, ``["logits"]`` or a tuple's or
    list's first item; None otherwise."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    elif isinstance(output, Mapping):
        output = output.get("logits")
    elif not isinstance(output, Tensor):
        output = getattr(output, "logits", None)
    if isinstance(output, Tensor) and output.is_floating_point() and output.dim() >= 2:
        return output if output.shape[-1] >= 2 else None
    return None
