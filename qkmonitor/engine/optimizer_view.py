r"""The spectrum engine's view of the optimizer: what the update before a read did to each head.

:class:`OptimizerView` is a part of :class:`~qkmonitor.engine.spectrum.QKSpectrum`: before the
update that a read follows (:meth:`OptimizerView.before_update`) it copies each head's query and
key rows (:func:`~qkmonitor.engine.updates.take_snapshot`, for the update ratios and gradient norms)
and each layer's W_Q and W_K as the spectrum reads them (``qk_weights()``: for latent attention the
products), and at the read it gives the update metrics (:meth:`OptimizerView._updates_after`) and
the spectrum of the update to each head's query-key form (:mod:`qkmonitor.measures.update_spectra`,
computed where the spectrum is: on the weights' worker, or on the training thread on a CPU).

The update is the one before the read, the update the rows' snapshot sees: nothing is held between
probes (docs/metrics.md, "The update's spectrum", says why).
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import Future
from typing import Any

import torch

from qkmonitor.attention.calls import TENSOR_PARALLEL
from qkmonitor.engine.background import WEIGHTS_WORKER
from qkmonitor.engine.host import Host
from qkmonitor.engine.spectrum_read import heads_of
from qkmonitor.engine.updates import ROW_METRICS, UPDATE_METRICS, take_snapshot, update_metrics
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.measures.sharding import is_dtensor, local_whole
from qkmonitor.measures.update_spectra import UPDATE_SPECTRUM_METRICS, update_spectra

__all__ = ["OptimizerView"]


class OptimizerView:
    """The optimizer's view of :class:`~qkmonitor.engine.spectrum.QKSpectrum` (a base of it: it
    uses the engine's layers, schedule and warnings)."""

    def before_update(self, host: Host, step: int) -> None:
        """An optimizer is about to apply the update after ``step`` updates (the driver says so
        before each optimizer step): where the weights after it are read (a probe step), copy
        every head's query/key rows and read their gradients, and copy each layer's W_Q/W_K. Once
        per step, however many optimizers step in it; a failure warns and leaves the update
        metrics NaN."""
        self._updates_seen = True
        if not self.layers or not self.schedule.is_probe_step(step + 1) or self.without_data():
            return
        self._check_layouts(host)  # the first forward has run: the rows of its layout are known
        if self._snapshot is not None and self._snapshot.step == step:
            return
        self._snapshot, self._weights_before = None, []
        try:
            snapshot, skipped = take_snapshot(self.layers, step)
        except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
            self.warn_once(
                host,
                "updates",
                f"the query/key update metrics could not be read ({type(err).__name__}: {err}); "
                f"they are NaN at step {step + 1} and read again at the next probe (shown once)",
            )
            return
        self._snapshot = snapshot
        for name, (why, whole_run) in skipped.items():
            when = (
                "for the whole run"
                if whole_run
                else f"at step {step + 1}, and read again at the next probe (shown once)"
            )
            self.warn_once(
                host,
                f"updates:{name}",
                f"the query/key update and gradient metrics of layer {name!r} are NaN {when}: "
                f"{why}",
                logging_rank_only=TENSOR_PARALLEL in why,
            )
        if self.update_spectrum:  # (off: no copy of the weights)
            self._weights_before = self._copy_weights(host, snapshot.layers, step)

    def _copy_weights(self, host: Host, mapped: list, step: int) -> list[QKWeights | None]:
        """Each layer's W_Q/W_K as the spectrum reads them, copied, where the snapshot reads its
        rows (None elsewhere, and where reading them raises: named once)."""
        out: list[QKWeights | None] = []
        with torch.no_grad():
            for layer, rows in zip(self.layers, mapped):
                weights = None
                if rows is not None:
                    try:
                        weights = plain_weights(layer.qk_weights())
                    except Exception as err:  # noqa: BLE001 -- a metric problem
                        self.warn_once(
                            host,
                            f"update spectrum:{layer.name}",
                            f"the query/key update spectrum of layer {layer.name!r} is NaN at "
                            f"step {step + 1} ({type(err).__name__}: {err}; shown once)",
                        )
                if weights is not None:
                    weights = dataclasses.replace(
                        weights, w_q=weights.w_q.detach().clone(), w_k=weights.w_k.detach().clone()
                    )
                out.append(weights)
        return out

    def _updates_after(self, host: Host, step: int) -> tuple[dict, dict]:
        """The update metrics of the weights after ``step`` updates (``(values, undefined)``, each
        metric -> one (H,) tensor per layer): from the snapshot taken before the last update, NaN
        and undefined without one. The update spectrum's are NaN and undefined here, filled in
        by :meth:`_update_spectrum_now` or :meth:`_update_spectrum_job` from the weights read."""
        snapshot, self._snapshot = self._snapshot, None
        before, self._weights_before = self._weights_before, []
        heads = [heads_of(layer) for layer in self.layers]
        values = None
        if snapshot is not None and snapshot.step == step - 1:
            try:
                values = update_metrics(snapshot, heads)
            except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
                self.warn_once(
                    host,
                    "updates",
                    f"the query/key update metrics could not be read ({type(err).__name__}: "
                    f"{err}); they are NaN at step {step} and read again at the next probe "
                    "(shown once)",
                )
        self._read_before = before if values is not None else []
        names = UPDATE_METRICS if self.update_spectrum else ROW_METRICS  # (those it logs)
        nan = {name: [torch.full((h,), math.nan) for h in heads] for name in names}
        undefined = {name: [torch.ones(h, dtype=torch.bool) for h in heads] for name in nan}
        if values is not None:
            for name, per_layer in values.items():
                nan[name] = per_layer
                undefined[name] = [
                    torch.full((h,), part is None, dtype=torch.bool)
                    for part, h in zip(snapshot.layers, heads)
                ]
            return nan, undefined
        if step > 0 and not self._updates_seen and not self._told_no_updates:
            self._told_no_updates = True  # a capability left unused, not a fault: one line
            host.info(
                f"qkmonitor: {type(self).__name__} ({self.prefix}): no optimizer step was "
                "announced before the weights were read, so the query/key update and gradient "
                "metrics are NaN (undefined); in a plain loop, pass Monitoring(optimizer=...)"
            )
        return nan, undefined

    def _update_pairs(self, after: dict[int, Any]) -> list[tuple[QKWeights, QKWeights] | None]:
        """Each layer's weights before the update and after it (``after``: the weights read, by
        layer index), where both are known; taken out of the engine (read once)."""
        before, self._read_before = self._read_before, []
        pairs: list[tuple[QKWeights, QKWeights] | None] = [None] * len(self.layers)
        for i, old in enumerate(before):
            new = plain_weights(after[i]) if old is not None and i in after else None
            if new is not None:
                pairs[i] = (old, new)
        return pairs

    def _update_spectrum_now(self, host: Host, step: int, updates: tuple, after: dict) -> None:
        """Compute the update spectrum on this thread and put it in ``updates``."""
        pairs = self._update_pairs(after)
        if not any(pairs):
            return
        try:
            merge_update_spectrum(updates, update_spectra(pairs, self._update_heads(pairs)))
        except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
            self.warn_failure(host, "computing the query/key update spectrum", step, err)

    def _update_spectrum_job(self, after: dict) -> Future | None:
        """The update spectrum computed on the weights' worker (None: nothing to compute)."""
        pairs = self._update_pairs(after)
        if not any(pairs):
            return None
        return WEIGHTS_WORKER.submit(update_spectra, pairs, self._update_heads(pairs))

    def _update_heads(self, pairs: list) -> list[int]:
        return [
            heads_of(layer) if pair is None else pair[0].num_heads
            for layer, pair in zip(self.layers, pairs)
        ]


def plain_weights(weights: QKWeights) -> QKWeights | None:
    """``weights`` with plain tensors: a DTensor read through its local shard where that is the
    whole tensor; None where it is not (its update metrics were refused by name already)."""
    tensors = []
    for tensor in (weights.w_q, weights.w_k):
        if is_dtensor(tensor):
            tensor = local_whole(tensor)
            if tensor is None:
                return None
        tensors.append(tensor)
    return dataclasses.replace(weights, w_q=tensors[0], w_k=tensors[1])


def merge_update_spectrum(updates: tuple[dict, dict], computed: tuple[dict, dict]) -> None:
    """Put the update spectrum's values and undefined flags (``computed``, as
    :func:`~qkmonitor.measures.update_spectra.update_spectra` gives them) into a read's
    ``updates``, in place."""
    for table, new in zip(updates, computed, strict=True):
        for name in UPDATE_SPECTRUM_METRICS:
            table[name] = list(new[name])
