"""What every qkmonitor callback shares: when to probe, how to log, and what to do on an alert.

A monitor subclass implements ``_measure(trainer, pl_module) -> {metric: [(heads,) tensor per layer]}``
and the hooks that decide when to call ``_collect_and_log``; this base class knows the probe steps
(every ``every_n_steps`` optimizer steps), writes the tags of :mod:`qkmonitor.tags` to every logger
on rank zero, feeds the alert rules, acts on alerts, and keeps the state a resumed run needs.
:class:`ActivationMonitor` adds probing of the training forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from qkmonitor.adapters import AttentionLayer, LayerSpec, find_attention_layers
from qkmonitor.alerts import ALERT_ACTIONS, Alert, AlertRule, AlertTracker
from qkmonitor.dashboards import custom_scalars_layout, grid_of, heatmap_image
from qkmonitor.tags import alert_tag, head_tag, layer_tag, worst_tag

__all__ = ["AttentionMonitor", "ActivationMonitor"]


class AttentionMonitor(Callback):
    """Base class of the qkmonitor callbacks.

    Args:
        every_n_steps: probe every this many optimizer steps; ``None`` takes the trainer's
            ``log_every_n_steps``.
        per_head: also log ``{prefix}/{metric}/layer_{LL}/head_{HH}`` for every head.
        log_key_prefix: first part of every tag.
        alerts: the alert rules; ``None`` for the monitor's defaults, ``[]`` for none.
        alert_action: ``"warn"`` (warning, TensorBoard text, counter), ``"stop"`` (also asks the
            trainer to stop) or ``"raise"`` (raises the rule's warning class as an exception).
        layers: override the attention-layer discovery (see
            :func:`qkmonitor.adapters.find_attention_layers`).
    """

    #: every metric the monitor logs, in display order.
    metric_names: tuple[str, ...] = ()
    #: metrics with one value per layer (no heads): logged as the layer tag only.
    layer_metrics: frozenset[str] = frozenset()
    #: metrics drawn as a layer x head heatmap image, with their fixed colour range (or None).
    heatmaps: dict[str, tuple[float, float] | None] = {}
    default_rules: tuple[AlertRule, ...] = ()

    def __init__(
        self,
        every_n_steps: int | None = None,
        per_head: bool = False,
        log_key_prefix: str = "qkmonitor",
        alerts: Sequence[AlertRule] | None = None,
        alert_action: str = "warn",
        layers: LayerSpec | None = None,
    ) -> None:
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
        ):
            raise ValueError(f"Expected `every_n_steps` to be a positive int or None, got {every_n_steps!r}")
        if not isinstance(per_head, bool):
            raise ValueError(f"Expected `per_head` to be a bool, got {per_head!r}")
        if not isinstance(log_key_prefix, str) or not log_key_prefix or log_key_prefix.endswith("/"):
            raise ValueError(
                f"Expected `log_key_prefix` to be a non-empty string without a trailing '/', got {log_key_prefix!r}"
            )
        if alert_action not in ALERT_ACTIONS:
            raise ValueError(f"Expected `alert_action` to be one of {ALERT_ACTIONS}, got {alert_action!r}")
        rules = list(self.default_rules if alerts is None else alerts)
        for rule in rules:
            if not isinstance(rule, AlertRule):
                raise ValueError(f"Expected `alerts` to hold AlertRule items, got {type(rule).__name__}")
        self.every_n_steps = every_n_steps
        self.per_head = per_head
        self.prefix = log_key_prefix
        self.alert_action = alert_action
        self._layer_spec = layers
        self.tracker = AlertTracker(rules)
        self.layers: list[AttentionLayer] = []
        #: The last probe's values: metric -> one (num_heads,) float CPU tensor per layer.
        self.latest: dict[str, list[Tensor]] = {}
        self.latest_step: int | None = None
        self._warned_nonfinite = False
        self._warned_no_images = False

    # -- Lightning hooks -------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.every_n_steps is None:
            self.every_n_steps = max(1, int(trainer.log_every_n_steps))
        self.layers = find_attention_layers(pl_module, self._layer_spec)
        self._log_thresholds(trainer)
        if not trainer.loggers:
            rank_zero_warn(
                f"{type(self).__name__}: the Trainer has no logger; metrics are kept in `.latest` "
                "and alerts still fire, but nothing is written."
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"alerts": self.tracker.state_dict(), "latest_step": self.latest_step,
                "warned_nonfinite": self._warned_nonfinite}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state_dict.get("alerts", {}))
        self.latest_step = state_dict.get("latest_step")
        self._warned_nonfinite = state_dict.get("warned_nonfinite", False)

    # -- shared mechanics ------------------------------------------------------------------

    def _log_thresholds(self, trainer: pl.Trainer) -> None:
        """The alert rules' thresholds, as hyper-parameters of the run (next to the model's)."""
        params = {}
        for rule in self.tracker.rules:
            key = f"{self.prefix}/alert_{rule.name}"
            params.update({f"{key}/threshold": rule.threshold, f"{key}/patience": rule.patience,
                           f"{key}/margin": rule.margin})
        params[f"{self.prefix}/{type(self).__name__}/every_n_steps"] = self.every_n_steps
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_hyperparams(params)

    def _is_probe_step(self, step: int) -> bool:
        # global_step counts optimizer steps; under gradient accumulation several batches share
        # a step, and only the first of them probes.
        return step % self.every_n_steps == 0 and step != self.latest_step

    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, list[Tensor]]:
        """metric -> one (num_heads,) tensor per layer of ``self.layers``."""
        raise NotImplementedError

    def _collect_and_log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        values = self._collect(trainer, pl_module)
        self.latest, self.latest_step = values, step
        self._warn_nonfinite(values, step)
        alerts = self.tracker.update(values, step, [layer.name for layer in self.layers])
        metrics = self._scalars(values, self.prefix)
        metrics.update({alert_tag(self.prefix, r.name): float(self.tracker.counts[r.name])
                        for r in self.tracker.rules})
        self._log(trainer, metrics, step)
        if trainer.is_global_zero:
            self._log_visuals(trainer, values, step)
        for alert in alerts:
            self._act(trainer, alert)

    # -- dashboards ------------------------------------------------------------------------

    def _images(self, values: dict[str, list[Tensor]]) -> dict[str, np.ndarray]:
        """tag -> HWC uint8 image for this probe: the heatmaps; subclasses add their own."""
        return {
            f"{self.prefix}/heatmap/{metric}": heatmap_image(grid_of(values[metric]), *(limits or (None, None)))
            for metric, limits in self.heatmaps.items() if metric in values
        }

    def _histograms(self) -> dict[str, Tensor]:
        """tag -> values to histogram for this probe; none by default."""
        return {}

    def _draws_visuals(self) -> bool:
        """Whether this monitor has images or histograms for TensorBoard."""
        return bool(self.heatmaps)

    def _log_visuals(self, trainer: pl.Trainer, values: dict[str, list[Tensor]], step: int) -> None:
        writers = [logger.experiment for logger in trainer.loggers
                   if hasattr(getattr(logger, "experiment", None), "add_image")]
        if not writers:
            if trainer.loggers and not self._warned_no_images and self._draws_visuals():
                self._warned_no_images = True
                rank_zero_warn(f"{type(self).__name__}: no TensorBoard logger, so heatmaps, histograms and "
                               "attention images are skipped; scalars are logged. This message is shown once.")
            return
        images, histograms = self._images(values), self._histograms()
        for writer in writers:
            _register_layout(writer, trainer, len(self.layers))
            for tag, image in images.items():
                writer.add_image(tag, image, global_step=step, dataformats="HWC")
            for tag, data in histograms.items():
                writer.add_histogram(tag, data, global_step=step)

    def _collect(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, list[Tensor]]:
        with torch.no_grad():
            return {
                name: [heads.detach().float().cpu() for heads in per_layer]
                for name, per_layer in self._measure(trainer, pl_module).items()
            }

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _scalars(self, values: dict[str, list[Tensor]], prefix: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for metric, grid in values.items():
            for layer, heads in enumerate(grid):
                out[layer_tag(prefix, metric, layer)] = heads.mean().item()
                if metric in self.layer_metrics:
                    continue
                # the band over heads; a NaN head makes it NaN too, as it does the mean
                nan = bool(heads.isnan().any())
                out[worst_tag(prefix, metric, "min", layer)] = math.nan if nan else heads.min().item()
                out[worst_tag(prefix, metric, "max", layer)] = math.nan if nan else heads.max().item()
                if self.per_head:
                    for head, value in enumerate(heads.tolist()):
                        out[head_tag(prefix, metric, layer, head)] = value
        return out

    def _warn_nonfinite(self, values: dict[str, list[Tensor]], step: int) -> None:
        if self._warned_nonfinite:
            return
        bad = sorted({layer for grid in values.values() for layer, heads in enumerate(grid)
                      if not torch.isfinite(heads).all()})
        if bad:
            self._warned_nonfinite = True
            names = ", ".join(f"{i} ({self.layers[i].name})" for i in bad if i < len(self.layers))
            rank_zero_warn(
                f"{type(self).__name__}: non-finite metric values at step {step} in layer(s) {names}; "
                "they are logged as NaN (are the weights or activations NaN/Inf?). "
                "This warning is shown once."
            )

    def _act(self, trainer: pl.Trainer, alert: Alert) -> None:
        message = alert.message(_current_lr(trainer))
        if self.alert_action == "raise":
            raise alert.rule.warning(message)
        rank_zero_warn(message, category=alert.rule.warning)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                experiment = getattr(logger, "experiment", None)
                if hasattr(experiment, "add_text"):
                    experiment.add_text(f"{self.prefix}/alerts", message, global_step=alert.step)
        if self.alert_action == "stop":
            trainer.should_stop = True


def _current_lr(trainer: pl.Trainer) -> float | None:
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            if "lr" in group:
                return float(group["lr"])
    return None


class ActivationMonitor(AttentionMonitor):
    """A monitor of the training forward: probes are switched on for the first batch of every
    ``every_n_steps``-th optimizer step (step 0 included) and read when that batch ends.

    Values are logged at the step the batch started on, i.e. for the weights the spectrum monitor
    logs at the same step. Validation is not probed unless ``probe_validation=True``: then the first
    batch of every validation run is measured and logged under ``{prefix}/val/...`` (no alerts).

    Args:
        probe_validation: also measure the first validation batch of each validation run.
        *args, **kwargs: see :class:`AttentionMonitor`.
    """

    def __init__(self, *args, probe_validation: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(probe_validation, bool):
            raise ValueError(f"Expected `probe_validation` to be a bool, got {probe_validation!r}")
        self.probe_validation = probe_validation
        self._probing_step: int | None = None
        self._probing_validation = False
        #: The last validation probe's values, like :attr:`latest`.
        self.latest_validation: dict[str, list[Tensor]] = {}

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.probe_validation and batch_idx == 0 and dataloader_idx == 0 and not trainer.sanity_checking:
            self._probing_validation = True
            self._set_probes(True)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._probing_validation:
            self._probing_validation = False
            try:
                self.latest_validation = self._collect(trainer, pl_module)
                self._log(trainer, self._scalars(self.latest_validation, f"{self.prefix}/val"), trainer.global_step)
            finally:
                self._set_probes(False)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._setup_probes(pl_module)

    def _setup_probes(self, pl_module: pl.LightningModule) -> None:
        """Prepare what probing needs (aggregators, hooks) once the layers are known."""

    def _set_probes(self, enabled: bool) -> None:
        raise NotImplementedError

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        if self._probing_step is None and self._is_probe_step(step):
            self._probing_step = step
            self._set_probes(True)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._probing_step is not None:
            step, self._probing_step = self._probing_step, None
            try:
                self._collect_and_log(trainer, pl_module, step)
            finally:
                self._set_probes(False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._probing_step is not None:  # a probed batch that never ended (e.g. skipped)
            self._probing_step = None
            self._set_probes(False)


def _register_layout(writer: Any, trainer: pl.Trainer, num_layers: int) -> None:
    """Write the custom-scalars layout once per run, covering every qkmonitor callback."""
    if getattr(writer, "_qkmonitor_layout", False):
        return
    monitors = [cb for cb in trainer.callbacks if isinstance(cb, AttentionMonitor)]
    metrics = {name: name not in cb.layer_metrics for cb in monitors for name in cb.metric_names}
    rules = [rule.name for cb in monitors for rule in cb.tracker.rules]
    prefix = monitors[0].prefix if monitors else "qkmonitor"
    writer.add_custom_scalars(custom_scalars_layout(prefix, metrics, num_layers, rules))
    writer._qkmonitor_layout = True
