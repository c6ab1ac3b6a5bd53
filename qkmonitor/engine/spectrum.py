r"""QKSpectrum: the spectrum of every head's query-key product, from the weights alone.

Per head h, over the singular values :math:`\sigma_i` and eigenvalues :math:`\lambda_i` of
:math:`W_{QK}^h = W_Q^h (W_K^g)^\top` (:mod:`qkmonitor.measures.layer_spectra`):

.. math::

    \kappa = \frac{\sigma_1}{\sum_i \sigma_i}, \quad
    \kappa_{eig} = \frac{|\lambda|_{max}}{\sum_i |\lambda_i|}, \quad
    \mathrm{erank} = \exp\Big(-\sum_i p_i \log p_i\Big),\ p_i = \frac{\sigma_i}{\sum_j \sigma_j},
    \quad \sigma_1 \cdot \mathrm{scale}.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from qkmonitor.alerts import KAPPA_RULE, LOW_RANK_UPDATES_RULE
from qkmonitor.attention.adapters import AttentionLayer
from qkmonitor.attention.calls import TENSOR_PARALLEL
from qkmonitor.attention.probes import Probe, ProbeRequest
from qkmonitor.engine.background import WEIGHTS_WORKER, InFlightRead, use_worker
from qkmonitor.engine.base import MonitorEngine
from qkmonitor.engine.failures import MeasuresNothingError
from qkmonitor.engine.host import Host
from qkmonitor.engine.optimizer_view import OptimizerView, merge_update_spectrum
from qkmonitor.engine.reading import AtProbe
from qkmonitor.engine.spectrum_read import (
    SpectrumRead,
    layer_of,
    merged_layers,
    split_layers,
)
from qkmonitor.engine.updates import UPDATE_METRICS, UpdateSnapshot
from qkmonitor.measures.catalogue import SPECTRUM, names_of
from qkmonitor.measures.layer_spectra import (
    LayerSpectra,
    QKWeights,
    full_parameters,
    spectrum_of_layers,
)
from qkmonitor.measures.sharding import (
    PartitionedWeightError,
    SplitHeadsError,
    distributed,
    gather_heads,
    gathered,
)
from qkmonitor.validation import check_bool

__all__ = ["QKSpectrum"]


class QKSpectrum(OptimizerView, MonitorEngine):
    """Logs κ, κ_eig, eig_mean, eig_var, qk_erank and qk_spectral_norm per layer and head, a κ
    heatmap and a histogram of each layer's singular values
    (``{prefix}/qk_singular_values/layer_LL``).

    Reads weights only: at step 0 (the initialization) and after every ``every_n_steps``-th
    optimizer step. Arguments: ``options``, or the fields of
    :class:`~qkmonitor.engine.MonitorOptions`.

    With the optimizer's view of the same weights (:mod:`qkmonitor.engine.updates`): each head's
    update-to-weight RMS ratio and gradient norm of W_Q and W_K over the update before the read
    (``q_update_ratio``, ``k_update_ratio``, ``q_grad_norm``, ``k_grad_norm``), where the driver
    calls :meth:`before_update` (the Lightning callbacks, ``Monitoring(optimizer=...)``, the HF
    Trainer callback); NaN at step 0 and where no update was seen.

    Layers whose W_Q/W_K were read by name (:mod:`qkmonitor.attention.intercept`) are checked
    against the first forward: the engine opens a layout probe on them for the first batch (``open``
    / ``finish``), and holds the step-0 values of those layers, computed from a copy of their
    weights, until that check has kept a layout; a layer whose layout fails the check, or whose
    weights are not found at all, is logged as NaN with one warning naming it.

    ``update_spectrum``: also log ``qk_update_entropy`` and ``qk_update_top_share``, the spectrum
    of each head's query-key update over the step before the read (off by default: it copies
    W_Q/W_K before the update and solves as many eigenproblems again as the spectrum, which on a
    CPU is more than the default probe's budget). With it, the default rules add
    ``low_rank_updates``, which reads it (docs/alerts.md).

    ``background_weights``: compute the spectrum on a worker thread from a copy of the weights
    taken at the read, and log it at the end of the next batch, at its own step
    (:mod:`qkmonitor.engine.background`); ``None`` (the default) does so where the weights are on
    a GPU and keeps the synchronous path on a CPU, where a worker competes with training for the
    cores. The values are the same either way.
    """

    monitor = SPECTRUM

    @property
    def default_rules(self) -> tuple:  # type: ignore[override]
        """``kappa``; with ``update_spectrum``, also ``low_rank_updates``, which reads it."""
        return (KAPPA_RULE, LOW_RANK_UPDATES_RULE) if self.update_spectrum else (KAPPA_RULE,)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The spectrum's metrics, the update spectrum's (optional in the catalogue) only with
        ``update_spectrum``, in catalogue order."""
        return names_of(self.monitor, optional=self.update_spectrum)

    reads_weights = True

    def __init__(
        self,
        *,
        background_weights: bool | None = None,
        update_spectrum: bool = False,
        **kwargs: Any,
    ) -> None:
        if background_weights is not None:
            check_bool("background_weights", background_weights)
        check_bool("update_spectrum", update_spectrum)
        self.update_spectrum = update_spectrum  # (before the base reads metric_names)
        super().__init__(**kwargs)
        self.background_weights = background_weights
        self._in_flight: list[InFlightRead] = []  # reads whose spectrum a worker computes
        self._checks: list[tuple[AttentionLayer, Probe]] = []
        self._pending: tuple[int, dict[int, tuple], dict[int, Any], dict] | None = None
        self._layouts_waiting = True  # whether some layer may still wait for its layout check
        self._snapshot: UpdateSnapshot | None = None  # the heads before the update of a probe
        self._weights_before: list = []  # each layer's W_Q/W_K then (OptimizerView)
        self._read_before: list = []  # those of the read being made
        self._updates_seen = False  # whether a driver has announced an update this run
        self._told_no_updates = False  # whether the run was told the update metrics are off
        self._exchanges: list[SpectrumRead] = []  # reads waiting for the heads of the other ranks

    def _prepare(self, model: nn.Module) -> None:
        self.abort()
        self._pending, self._exchanges, self._in_flight = None, [], []
        self._layouts_waiting = True
        self._snapshot, self._updates_seen, self._told_no_updates = None, False, False
        self._weights_before, self._read_before = [], []
        blind = [layer.name for layer in self.layers if not layer.supports_weights]
        if len(blind) == len(self.layers):
            raise MeasuresNothingError(f"{type(self).__name__}: {_blind_message(blind)}")

    # -- the layout check of layers read by name ------------------------------------------------

    @property
    def probing(self) -> bool:
        return (
            bool(self._checks)
            or self._pending is not None
            or bool(self._in_flight)
            or bool(self._readings)
        )

    def steps_after(self, step: int) -> tuple[range, range]:
        """As :meth:`MonitorEngine.steps_after`, and none while a layer may wait for its layout
        check (the next batch opens its probe)."""
        if self._layouts_waiting:
            return range(step + 1, step + 1), range(step + 1, step + 1)
        return super().steps_after(step)

    def open(self, step: int, *, validation: bool = False) -> bool:
        """Open a layout probe on every layer still waiting for its check (none: nothing)."""
        if validation or self._checks or not self._layouts_waiting or self.without_data():
            return False
        self.switches.before_window(self._probed_modules)
        waiting = [layer for layer in self.layers if layer.needs_layout_check]
        self._layouts_waiting = bool(waiting)  # a check only ends the wait: none waiting stays none
        try:
            for layer in waiting:
                self._checks.append(
                    (layer, layer.open_probe(ProbeRequest(stats=False, layout=True)))
                )
            if waiting:
                self.switches.open_window()
        except BaseException:
            self.abort()
            raise
        return bool(waiting)

    def finish(self, host: Host) -> None:
        """Close the layout probes, check the layouts, and log the values held for the check and
        those a worker computed."""
        self.settle(host)
        self._check_layouts(host)
        if self._pending is not None:
            step, spectra, copies, updates = self._pending
            self._pending = None
            merged = merged_layers(self.layers, spectra, self._spectra_of_copies(host, copies))
            self._log(host, step, merged, updates)

    def _check_layouts(self, host: Host) -> None:
        """Close the layout probes and keep the layouts their forwards confirmed (a no-op once
        done): at the window's end, or earlier, before the update of the first probed step (the
        forward has run by then), so that the rows the update metrics compare are known from the
        first update on."""
        checks, self._checks = self._checks, []
        self.switches.close_window()
        for layer, probe in checks:
            message = layer.check_layout(probe.close())
            if message:
                self.warn_once(
                    host,
                    f"layout:{layer.name}",
                    message,
                    logging_rank_only=TENSOR_PARALLEL in message,
                )

    def abort(self) -> None:
        checks, self._checks = self._checks, []
        self.switches.close_window()
        for _, probe in checks:
            probe.close()

    def _probed_modules(self) -> list[nn.Module]:
        return [layer.module for layer in self.layers if layer.needs_layout_check]

    # -- reading the weights ---------------------------------------------------------------------

    def observe_weights(
        self, host: Host, step: int, *, full_model: nn.Module | None = None, **kwargs: Any
    ) -> None:
        """Measure and log the weights after ``step`` optimizer steps if that is a probe step.

        Args:
            full_model: the wrapped model under FSDP (v1), whose shards are gathered for the read.
        """
        if not self.layers or not self.schedule.is_probe_step(step) or self.without_data():
            return
        self._warn_blind(host)
        ready = {
            i: layer
            for i, layer in enumerate(self.layers)
            if layer.supports_weights and layer.layout_ready
        }
        waiting = {i: layer for i, layer in enumerate(self.layers) if layer.needs_layout_check}
        updates = self._updates_after(host, step)
        with torch.no_grad(), full_parameters(full_model):
            weights = self._read(host, step, ready)
            tensors = [t for w in weights.values() for t in (w.w_q, w.w_k)]
            if not waiting and use_worker(self.background_weights, tensors):
                # a copy of the weights on their device, freed once the worker has read it
                copies = [_copied(w) for w in weights.values()]
                future = WEIGHTS_WORKER.submit(spectrum_of_layers, copies)
                job = self._update_spectrum_job(dict(zip(weights, copies)))
                rate = host.learning_rate()  # the rate of the read, which its alerts name
                read = InFlightRead(host, step, list(weights), future, updates, rate, job)
                self._in_flight.append(read)
                self.schedule.latest_step = step
                return
            spectra = spectrum_of_layers(list(weights.values()))
            self._update_spectrum_now(host, step, updates, weights)
            copies = self._copies(host, waiting)
        ready = weights
        spectra = {i: layer_of(spectra, j) for j, i in enumerate(ready)}
        if copies:  # logged once the first forward has checked their layouts (finish)
            self.schedule.latest_step = step
            self._pending = (step, spectra, copies, updates)
            return
        self._log(host, step, merged_layers(self.layers, spectra, {}), updates)

    def settle(self, host: Host | None = None) -> None:
        """Log the reads a worker computed, in the order read (waiting for a job still running):
        at the end of the batch after the read, before the activations of that step are logged, at
        a run's end (success or failure) and before a checkpoint takes the engine's state. A job
        that raised leaves its read NaN, with one warning."""
        super().settle(host)
        while self._in_flight:  # one at a time: an alert raised leaves the rest to the run's end
            read = self._in_flight[0]
            # waited for before it leaves the list (an interrupt here leaves it to the run's end);
            # its error as it is, not raised again here: a traceback through this frame would hold
            # the read, and through the worker's frames the copies, in a cycle until a collection
            err = read.future.exception()
            self._in_flight.pop(0)
            host = host or read.host
            computed = {}
            if err is not None:  # a metric problem must never stop training
                self.warn_failure(host, "computing the query/key spectrum", read.step, err)
            else:
                spectra = read.future.result()
                computed = {i: layer_of(spectra, j) for j, i in enumerate(read.layers)}
            if read.update_job is not None:  # the update spectrum, computed beside it
                if read.update_job.exception() is None:
                    merge_update_spectrum(read.updates, read.update_job.result())
                else:
                    stage = "computing the query/key update spectrum"
                    self.warn_failure(host, stage, read.step, read.update_job.exception())
            then = AtProbe(host, read.learning_rate)  # its alerts name the rate of the read
            merged = merged_layers(self.layers, computed)
            self._log(then, read.step, merged, read.updates, defer=False)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        """The state after every read a worker is computing has been logged (its alerts in it)."""
        self.settle()
        return super().state_dict()

    def _spectra_of_copies(self, host: Host, copies: dict[int, Any]) -> dict[int, tuple]:
        out = {}
        for i, copy in copies.items():
            layer = self.layers[i]
            if layer.layout is None:
                if (
                    layer.needs_layout_check
                ):  # still unchecked: it did not run in the first probed forward
                    self.warn_once(
                        host,
                        f"layout:{layer.name}",
                        f"layer {layer.name!r} gave no forward to check its weight layout against; "
                        "its spectrum metrics are NaN until one does",
                    )
                continue
            with torch.no_grad():
                out[i] = layer_of(spectrum_of_layers([layer.layout.qk_weights(copy)]), 0)
        return out

    def _copies(self, host: Host, layers: dict[int, AttentionLayer]) -> dict[int, Any]:
        """A copy of the weights of each layer waiting for its layout check; a partitioned one
        that cannot be gathered is left out (NaN), named once."""
        out = {}
        for i, layer in layers.items():
            try:
                with gathered(layer.module):
                    out[i] = layer.weights_copy()
            except PartitionedWeightError as err:
                self._refuse_partitioned(host, layer, err)
        return out

    def _refuse_partitioned(self, host: Host, layer: AttentionLayer, err: Exception) -> None:
        self.warn_once(
            host,
            f"partitioned:{layer.name}",
            f"layer {layer.name!r}: {err}; its spectrum metrics are NaN",
            logging_rank_only=True,
        )

    def _warn_blind(self, host: Host) -> None:
        """One warning for every layer whose weights are not found (the others are measured)."""
        blind = [layer.name for layer in self.layers if not layer.supports_weights]
        if blind:
            self.warn_once(
                host, "blind", f"{_blind_message(blind)}; their spectrum metrics are NaN"
            )

    def _read(self, host: Host, step: int, layers: dict[int, AttentionLayer]) -> dict[int, Any]:
        """Each layer's :class:`QKWeights`, by index; a layer whose read raises is left out (NaN)
        with one warning naming it (a metric problem never stops training)."""
        out = {}
        for i, layer in layers.items():
            try:
                with gathered(layer.module) as copy:  # a partitioned layer: copied out whole
                    weights = layer.qk_weights()
                    out[i] = _copied(weights) if copy else weights
            except (PartitionedWeightError, SplitHeadsError) as err:  # refused by name
                self._refuse_partitioned(host, layer, err)
            except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
                self.warn_failure(host, "reading the query/key weights", step, err, [layer.name])
        return out

    def _log(
        self,
        host: Host,
        step: int,
        spectra: LayerSpectra,
        updates: tuple[dict, dict],
        *,
        defer: bool | None = None,
    ) -> None:
        values, undefined = updates
        for i, kappa in enumerate(spectra.metrics["kappa"]):
            # read before the layer's first forward told its head count: undefined, as many as
            # the spectrum's
            for name in values:
                if values[name][i].shape != kappa.shape and bool(undefined[name][i].all()):
                    values[name][i] = torch.full(kappa.shape, float("nan"))
                    undefined[name][i] = torch.ones(kappa.shape, dtype=torch.bool)
        read = SpectrumRead(step, spectra, values, undefined, split_layers(self.layers))
        if read.split and distributed():  # every head's values wait for the ranks' exchange
            self._exchanges.append(read)
            return
        self._record(host, read, gather_heads(read.parts()), defer=defer)

    def _record(
        self,
        host: Host,
        read: SpectrumRead,
        merged: list[list[Tensor]],
        *,
        defer: bool | None = None,
    ) -> None:
        read.merge(merged)
        spectra, values = read.spectra, read.values
        histograms = partial(self._histograms, spectra.singular_values)  # made when drawn
        self.record(
            host,
            {
                **spectra.metrics,
                **{m: [v.float() for v in values[m]] for m in UPDATE_METRICS if m in values},
            },
            read.step,
            undefined={**spectra.undefined, **read.undefined},
            histograms=histograms,
            losses_up_to=read.step - 1,  # read before the loss of its step (on these weights)
            defer=defer,
        )

    # -- heads split across ranks ----------------------------------------------------------------

    def exchange_parts(self) -> list[tuple[int, list]]:
        """The reads whose layers' heads are split across ranks (tensor parallelism), waiting for
        every head's values from the rank that computes it: ``(step, this rank's parts)`` each, in
        the order read. The driver exchanges them in the collective that reduces the activation
        monitors' sums (:func:`~qkmonitor.engine.base.finish_windows`): one a probe for all."""
        return [(read.step, read.parts()) for read in self._exchanges]

    def complete_exchange(self, host: Host, step: int, merged: list[list[Tensor]]) -> None:
        """Log the read of ``step`` with every head's values (``merged``, as
        :func:`~qkmonitor.measures.sharding.gather_heads` gives them)."""
        index = next(i for i, read in enumerate(self._exchanges) if read.step == step)
        self._record(host, self._exchanges.pop(index), merged)

    def drop_exchanges(self) -> None:
        """Forget the reads waiting for the exchange (a run that ends in a failure: the ranks
        may not meet again)."""
        self._exchanges = []

    def _histograms(self, singular_values: list[Tensor]) -> dict[str, Tensor]:
        out = {}
        for i, sv in enumerate(singular_values):
            finite = sv[
                torch.isfinite(sv)
            ]  # NaN heads are in the scalars; a histogram needs numbers
            if finite.numel():
                out[f"{self.prefix}/qk_singular_values/layer_{i:02d}"] = finite
        return out


def _copied(weights: QKWeights) -> QKWeights:
    """The query and key weights copied out of parameters gathered for the read only."""
    return dataclasses.replace(
        weights, w_q=weights.w_q.detach().clone(), w_k=weights.w_k.detach().clone()
    )


def _blind_message(names: list[str]) -> str:
    return (
        f"the query/key weights of layer(s) {names} are not found (no projection of a known name, "
        "or a layout that no rule places); describe them with qkmonitor.AttentionSpec (README, "
        "'Use it on your model': q=/k= or qkv= with its order and head counts)"
    )
