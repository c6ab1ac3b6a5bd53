"""QKMonitor: the spectrum, entropy and rank monitors behind one set of Lightning hooks."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl

from qkmonitor.alerts import Alert, AlertRule
from qkmonitor.attention.adapters import LayerSpec
from qkmonitor.measures.catalogue import CATALOGUE, ENTROPY, RANK, SPECTRUM, metric

_KNOWN = frozenset(spec.name for spec in CATALOGUE)
from qkmonitor.engine import (
    AttentionEntropy,
    EffectiveRank,
    MonitorEngine,
    MonitorOptions,
    QKSpectrum,
)
from qkmonitor.engine.options import keyword_only

from .base import AttentionMonitor

__all__ = ["QKMonitor"]

#: argument name -> (engine class, catalogue monitor)
_MONITORS: dict[str, tuple[type[MonitorEngine], str]] = {
    "spectrum": (QKSpectrum, SPECTRUM),
    "entropy": (AttentionEntropy, ENTROPY),
    "rank": (EffectiveRank, RANK),
}


def _own_arguments(engine: type[MonitorEngine]) -> tuple[str, ...]:
    """The arguments an engine takes beside :class:`MonitorOptions`' fields (``sink_tokens``,
    ``max_probe_tokens``, ...)."""
    return tuple(
        name
        for name, p in inspect.signature(engine.__init__).parameters.items()
        if p.kind is p.KEYWORD_ONLY and name != "options"
    )


class QKMonitor(AttentionMonitor):
    r"""The three monitors in one callback: κ and the spectrum of every head's ``W_QK`` (from the
    weights), attention entropy (from the training forward) and effective rank (of the attention
    matrices and the residual stream), at one cadence, behind one set of hooks.

    What is logged, and each default alert, is what :class:`QKSpectrumMonitor`,
    :class:`AttentionEntropyMonitor` and :class:`EffectiveRankMonitor` log under the same
    ``log_key_prefix``; the three callbacks stay for those who want one alone. Together they cost
    less than the three callbacks: one schedule check and one read of the loss a batch, a probe
    step's scalars written once (one TensorBoard event, one CSV row), and under DDP one collective
    a probe for the entropy and rank aggregates.

    Args (keyword-only):
        every_n_steps: probe every this many optimizer steps (default: the Trainer's
            ``log_every_n_steps``).
        per_head: also log every head's value.
        log_key_prefix: first part of every tag (tag-safe).
        alerts: the alert rules (``None``: each monitor's defaults; ``[]``: none). Each rule goes
            to the monitor that logs the metrics it watches.
        alert_action: ``"warn"``, ``"stop"`` or ``"raise"``.
        on_alert: ``on_alert(trainer, alert)`` for every alert that fires.
        layers: which attention layers (one module, a list, or a function of the model).
        visuals_every_n_probes: heatmaps, attention images and histograms at every this many
            probes, from the first (default 20; 0: never).
        defer_reads: log a training probe's values at the end of the next batch, read in one
            copy started at the probe, so that the probe's step does not wait for the device
            (alerts then come a step later, naming their probe step); default: on a GPU.
        probe_validation: also measure the first validation batch of each validation run
            (``{prefix}/val/...``).
        spectrum, entropy, rank: each monitor on (``True``), off (``False``), or on with some
            arguments of its own, which override the shared ones: a dict of the monitor's keyword
            arguments, e.g. ``rank={"every_n_steps": 200, "max_probe_tokens": 256}``,
            ``entropy={"sink_tokens": 4}``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from qkmonitor.callbacks import QKMonitor
        >>> from qkmonitor.models import TransformerConfig
        >>> from qkmonitor.models.tasks import AssociativeRecallDataModule, CausalLMTask
        >>> data = AssociativeRecallDataModule(num_pairs=2, num_queries=2, batch_size=4,
        ...                                    train_size=8, val_size=4)
        >>> model = CausalLMTask(TransformerConfig(vocab_size=data.vocab_size, d_model=16,
        ...                                        n_heads=2, max_seq_len=data.seq_len))
        >>> monitor = QKMonitor(every_n_steps=1, per_head=True)
        >>> trainer = Trainer(max_steps=2, callbacks=[monitor], logger=False,
        ...                   enable_checkpointing=False, enable_progress_bar=False,
        ...                   enable_model_summary=False)
        >>> trainer.fit(model, data)
        >>> {"kappa", "entropy", "hidden_erank"} <= set(monitor.latest)  # all three engines
        True
    """

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
        spectrum: bool | Mapping[str, Any] = True,
        entropy: bool | Mapping[str, Any] = True,
        rank: bool | Mapping[str, Any] = True,
    ) -> None:
        shared = MonitorOptions.pick(locals())  # checks the shared arguments once
        chosen = {"spectrum": spectrum, "entropy": entropy, "rank": rank}
        for name, choice in chosen.items():
            if not isinstance(choice, (bool, Mapping)):
                raise ValueError(
                    f"Expected `{name}` to be True, False or a dict of its monitor's arguments, "
                    f"got {type(choice).__name__} {choice!r}"
                )
        on = [name for name, choice in chosen.items() if choice is not False]
        if not on:
            raise ValueError(
                "Expected at least one of `spectrum`, `entropy` and `rank` to be on, got all three "
                "False"
            )
        rules = _rules_by_monitor(shared.alerts, on)
        engines = []
        for name in on:
            engine_class, monitor = _MONITORS[name]
            own = dict(chosen[name]) if isinstance(chosen[name], Mapping) else {}
            allowed = (*MonitorOptions.__dataclass_fields__, *_own_arguments(engine_class))
            unknown = sorted(set(own) - set(allowed))
            if unknown:
                raise ValueError(
                    f"Expected `{name}` to hold arguments of {engine_class.__name__} "
                    f"({', '.join(allowed)}), got {', '.join(map(repr, unknown))}"
                )
            fields = {**vars(shared), "alerts": rules.get(monitor)}
            options = {k: own.pop(k) for k in list(own) if k in MonitorOptions.__dataclass_fields__}
            engines.append(engine_class(options=MonitorOptions(**{**fields, **options}), **own))
        super().__init__(*engines, probe_validation=probe_validation)

    @property
    def spectrum(self) -> QKSpectrum | None:
        """The spectrum engine (None when off)."""
        return self._engine_of(QKSpectrum)

    @property
    def entropy(self) -> AttentionEntropy | None:
        """The entropy engine (None when off)."""
        return self._engine_of(AttentionEntropy)

    @property
    def rank(self) -> EffectiveRank | None:
        """The effective-rank engine (None when off)."""
        return self._engine_of(EffectiveRank)

    def _engine_of(self, kind: type[MonitorEngine]) -> Any:
        return next((e for e in self.engines if isinstance(e, kind)), None)


def _rules_by_monitor(
    alerts: Sequence[AlertRule] | None, on: list[str]
) -> dict[str, tuple[AlertRule, ...] | None]:
    """Each rule of ``alerts`` with the monitor that logs the metrics it watches (None: every
    monitor's defaults; a list: those rules alone, none for a monitor they do not watch)."""
    if alerts is None:
        return {}
    monitors_on = {_MONITORS[name][1]: name for name in on}
    out: dict[str, list[AlertRule]] = {monitor: [] for monitor in monitors_on}
    for rule in alerts:  # AlertRules (MonitorOptions checked them)
        unknown = [name for name in rule.metrics if name not in _KNOWN]
        if unknown:
            raise ValueError(
                f"Alert rule {rule.name!r} watches {', '.join(map(repr, unknown))}, which no "
                f"monitor logs"
            )
        owners = {metric(name).monitor for name in rule.metrics}
        if len(owners) != 1:
            raise ValueError(
                f"Alert rule {rule.name!r} watches metrics of several monitors "
                f"({', '.join(sorted(owners))}); a rule reads one monitor's values"
            )
        owner = owners.pop()
        if owner not in monitors_on:
            argument = next(n for n, (_, m) in _MONITORS.items() if m == owner)
            raise ValueError(
                f"Alert rule {rule.name!r} watches {', '.join(rule.metrics)}, logged by "
                f"{owner}, which is off (`{argument}=False`)"
            )
        out[owner].append(rule)
    return {monitor: tuple(rules) for monitor, rules in out.items()}
