"""The arguments every monitor engine takes, checked once: :class:`MonitorOptions`.

The engines take them as keyword arguments or as one ``options=MonitorOptions(...)``; the
Lightning callbacks spell them out as keyword-only parameters (LightningCLI reads signatures) and
hand them over with :meth:`MonitorOptions.pick`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from torch import nn

from qkmonitor.alerts import ALERT_ACTIONS, Alert, AlertRule
from qkmonitor.attention.adapters import AttentionLayer, LayerSpec
from qkmonitor.validation import check_bool, check_non_negative_int, check_optional_positive_int

__all__ = ["MonitorOptions", "check_prefix", "keyword_only"]

F = TypeVar("F", bound=Callable)

#: a part: letters, digits, ``_ - .``, never ``.`` or ``..`` nor any part that begins with two
#: dots (MLflow refuses a name that ``posixpath.normpath`` changes or that begins with ``..``)
_PREFIX_PART = r"\.?[A-Za-z0-9_\-][A-Za-z0-9_.\-]*"
_PREFIX_RE = re.compile(rf"^{_PREFIX_PART}(/{_PREFIX_PART})*$")


def check_prefix(prefix: object) -> str:
    """A tag-safe ``log_key_prefix``, one that every logger takes as it is: parts of letters,
    digits, ``_ . -`` joined by single ``/``, no leading or trailing ``/``, and no part ``.``,
    ``..`` or beginning with ``..`` (TensorBoard and CSV take any tag; W&B makes sections of
    the parts; MLflow refuses a metric name that would read as another path, as ``../x`` or
    ``a/./b`` do)."""
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(
            "Expected `log_key_prefix` to be a tag-safe string (letters, digits, '_', '.', '-', "
            "parts joined by single '/', no leading or trailing '/', no part '.' or '..' or "
            f"beginning with '..'), got {prefix!r}"
        )
    return prefix


@dataclasses.dataclass(frozen=True)
class MonitorOptions:
    """What every engine is told: when to probe, what to log, which layers, how to alert.

    Checked at construction; ``alerts`` is kept as a tuple (one rule becomes a tuple of one), and
    a list or generator of ``layers`` as a tuple (a generator is read once, here).

    Args:
        every_n_steps: probe every this many optimizer steps; ``None`` takes the host's default
            (the Trainer's ``log_every_n_steps``).
        per_head: also log ``{prefix}/{metric}/layer_LL_head_HH`` for every head.
        log_key_prefix: first part of every tag; tag-safe (see :func:`check_prefix`).
        alerts: the alert rules; ``None`` for the engine's defaults, ``[]`` for none. Each rule's
            metrics must be ones the engine logs (checked by the engine).
        alert_action: ``"warn"`` (warning, TensorBoard text, counter), ``"stop"`` (also asks the
            loop to stop) or ``"raise"`` (raises the rule's warning class as an exception).
        on_alert: called as ``on_alert(owner, alert)`` for every alert that fires (the owner is
            the Trainer under Lightning), e.g. to lower the learning rate or save a checkpoint.
        layers: which attention layers: ``None`` finds them all; one module or AttentionLayer,
            a list of them, or a function ``model -> list``.
        visuals_every_n_probes: draw the visuals (layer x head heatmaps, attention images,
            singular-value histograms) at every this many probes, starting with the first (step
            0); ``0`` never. Scalars and alerts come at every probe. Drawing and encoding an
            image costs more than measuring a small model, so the default (20) keeps them to one
            probe in twenty: at ``every_n_steps=50``, one set every 1000 steps.
        defer_reads: log a training probe's values at the end of the next batch, so that the
            host reads them (one copy a device, started at the probe) without making the probe's
            step wait for the device; its alerts then come a step later and name their probe
            step. ``None`` (the default): where the values are on a CUDA device; on a CPU
            nothing would wait, and they come at once.
    """

    every_n_steps: int | None = None
    per_head: bool = False
    log_key_prefix: str = "qkmonitor"
    alerts: Sequence[AlertRule] | None = None
    alert_action: str = "warn"
    on_alert: Callable[[Any, Alert], None] | None = None
    layers: LayerSpec | nn.Module | AttentionLayer | None = None
    visuals_every_n_probes: int = 20
    defer_reads: bool | None = None

    def __post_init__(self) -> None:
        check_optional_positive_int("every_n_steps", self.every_n_steps)
        check_non_negative_int("visuals_every_n_probes", self.visuals_every_n_probes)
        check_bool("per_head", self.per_head)
        if self.defer_reads is not None:
            check_bool("defer_reads", self.defer_reads)
        if self.alert_action not in ALERT_ACTIONS:
            raise ValueError(
                f"Expected `alert_action` to be one of {ALERT_ACTIONS}, got {self.alert_action!r}"
            )
        if self.on_alert is not None and not callable(self.on_alert):
            raise ValueError(
                "Expected `on_alert` to be a callable (owner, alert) or None, got "
                f"{self.on_alert!r}"
            )
        object.__setattr__(self, "alerts", _checked_alerts(self.alerts))
        check_prefix(self.log_key_prefix)
        object.__setattr__(self, "layers", _checked_layers(self.layers))
        for i, rule in enumerate(self.alerts or ()):
            if not isinstance(rule, AlertRule):
                raise ValueError(
                    f"Expected `alerts[{i}]` to be an AlertRule, got {type(rule).__name__}"
                )

    @classmethod
    def pick(cls, arguments: Mapping[str, Any]) -> MonitorOptions:
        """The options among ``arguments``, each field by its name (a callback's ``locals()``)."""
        return cls(**{field.name: arguments[field.name] for field in dataclasses.fields(cls)})

    def selection(self) -> str:
        """The layer selection in words that are the same in every process (it goes into a
        checkpoint's state key, read before the model is searched)."""
        spec = self.layers
        if spec is None:
            return "auto"
        if callable(spec) and not isinstance(spec, nn.Module):
            return getattr(spec, "__qualname__", repr(spec))
        items = [spec] if isinstance(spec, (nn.Module, AttentionLayer)) else spec
        return ",".join(
            item.name if isinstance(item, AttentionLayer) else type(item).__name__ for item in items
        )


def _checked_alerts(alerts: object) -> tuple[AlertRule, ...] | None:
    if isinstance(alerts, AlertRule):
        return (alerts,)
    if alerts is None:
        return None
    if isinstance(alerts, (str, bytes)) or not isinstance(alerts, Sequence):
        raise ValueError(
            f"Expected `alerts` to be a list of AlertRule or None, got {type(alerts).__name__}"
        )
    return tuple(alerts)


def _checked_layers(layers: object) -> Any:
    if not (
        layers is None
        or callable(layers)
        or isinstance(layers, (nn.Module, AttentionLayer))
        or (isinstance(layers, Iterable) and not isinstance(layers, (str, bytes)))
    ):
        raise ValueError(
            f"Expected `layers` to be a module, an AttentionLayer, a list of them or a function of "
            f"the model, got {type(layers).__name__}"
        )
    if (
        isinstance(layers, Iterable)
        and not isinstance(layers, (nn.Module, AttentionLayer))
        and not callable(layers)
    ):
        layers = tuple(layers)  # a generator is read once, here
        if not layers:
            raise ValueError(
                "Expected `layers` to be a non-empty list of modules or AttentionLayers, got an "
                "empty list: leave it out (None) to monitor every attention layer found"
            )
        for i, item in enumerate(layers):
            if not isinstance(item, (nn.Module, AttentionLayer)):
                raise ValueError(
                    f"Expected `layers[{i}]` to be a module or an AttentionLayer of the model, got "
                    f"{type(item).__name__} {item!r}{_LAYER_HINTS.get(type(item), '')}"
                )
    return layers


#: what to pass instead of a name or an index (a module of the model, which is known only at fit
#: start: a function of the model is called then)
_LAYER_HINTS = {
    str: (
        ": a name is not looked up; pass the module itself, or a function of the model, called "
        "when training starts, e.g. `layers=lambda m: [m.get_submodule(NAME)]`"
    ),
    int: (
        ": an index is not looked up; pass the module itself, or a function of the model, "
        "called when training starts, e.g. `layers=lambda m: [m.blocks[0].attn]`"
    ),
}


def keyword_only(init: F) -> F:
    """Wrap a class's ``__init__`` whose parameters are all keyword-only, so that a positional
    argument raises a ``TypeError`` that says so and names the parameter it was likely meant for
    ("QKMonitor takes keyword arguments only: QKMonitor(every_n_steps=50)"), where Python's own
    says "takes 1 positional argument but 2 were given". The signature stays the wrapped one
    (``inspect.signature`` and LightningCLI read it through ``__wrapped__``)."""
    names = [
        p.name for p in inspect.signature(init).parameters.values() if p.kind is p.KEYWORD_ONLY
    ]

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        if args:
            cls = type(self).__name__
            shown = ", ".join(
                f"{name}={value!r}" for name, value in zip([*names, *["..."] * len(args)], args)
            )
            raise TypeError(
                f"{cls} takes keyword arguments only: {cls}({shown}), got {len(args)} positional "
                f"argument{'s' if len(args) > 1 else ''}"
            )
        return init(self, **kwargs)

    return checked  # type: ignore[return-value]
