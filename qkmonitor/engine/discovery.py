"""What an engine says about the layers it found and could not read.

At bind an engine reports one line of what it measures (:func:`report_discovery`: ``Host.info``)
and a warning for each attention-like module no rule reads; a model whose parameters hold no data
or are lazy is one warning a run for every engine of a driver (:func:`lazy`,
:func:`without_data`). An engine that can read none of its layers raises
:class:`~qkmonitor.engine.failures.MeasuresNothingError` (:func:`check_statistics` at bind,
:func:`report_missing` at the first probed window): an error alone, one warning beside engines
that measure something (:meth:`~qkmonitor.engine.group.EngineGroup.bind`). A layer that did not
run, or whose calls could not be read, is NaN with one warning per layer.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from torch import nn

from qkmonitor.attention.adapters import AttentionLayer, parameters_without_data
from qkmonitor.attention.probes import ProbeResult
from qkmonitor.engine.failures import MeasuresNothingError
from qkmonitor.engine.host import Host

__all__ = [
    "Reporting",
    "check_statistics",
    "lazy",
    "qk_norm_layers",
    "report_discovery",
    "report_missing",
    "without_data",
]


class Reporting(Protocol):
    """What the reports here ask of an engine (:class:`~qkmonitor.engine.base.MonitorEngine`
    answers it; this module imports no engine, which imports it)."""

    @property
    def prefix(self) -> str: ...

    layers: list[AttentionLayer]
    #: the attention-like modules no rule reads: ``(name, class name)``
    unmeasured: list[tuple[str, str]]

    def warn_once(
        self,
        host: Host,
        key: str,
        message: str,
        *,
        shared: bool = False,
        logging_rank_only: bool = False,
    ) -> None: ...


def report_discovery(engine: Reporting, host: Host) -> None:
    """One line of what ``engine`` found (at fit start), and a warning per attention-like module
    that is not measured."""
    owner = f"qkmonitor: {type(engine).__name__} ({engine.prefix})"
    layers = engine.layers
    if not layers:  # a lazy model (bind warned why)
        host.info(f"{owner} measures nothing")
        return
    kinds = Counter(layer.kind for layer in layers)
    found = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
    host.info(
        f"{owner} measures {len(layers)} attention layer{'s' if len(layers) != 1 else ''}: {found}"
    )
    for name, cls in engine.unmeasured:
        engine.warn_once(
            host,
            f"unmeasured:{name}",
            f"{name!r} ({cls}) looks like attention but no rule reads it, so it is not "
            "measured; describe it with "
            "qkmonitor.register_attention(qkmonitor.AttentionSpec(...)) (README, 'Use it on "
            "your model')",
        )


def lazy(model: nn.Module, run_warnings: set[str]) -> bool:
    """Whether ``model`` holds lazy parameters not yet materialised (``nn.LazyLinear`` before
    its first forward): they have no shape, so no layer can be found by them; warned once a run
    (``run_warnings``; the same text from every engine: Python shows it once)."""
    names = [
        name
        for name, p in model.named_parameters()
        if isinstance(p, nn.parameter.UninitializedTensorMixin)
    ]
    if names and "lazy" not in run_warnings:
        run_warnings.add("lazy")
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        warnings.warn(  # one place and one text for every engine: shown once
            f"qkmonitor: the model's lazy parameters are not materialised yet ({names[0]!r}"
            f"{more}), so its attention layers cannot be found and nothing is measured in "
            "this run; run one forward (an example batch) before the fit or the loop to "
            "materialise them; training goes on.",
            RuntimeWarning,
            stacklevel=1,
        )
    return bool(names)


def without_data(layers: Sequence[AttentionLayer], run_warnings: set[str]) -> bool:
    """Whether a parameter of ``layers`` holds no data (a model on the meta device, or a lazy one
    not yet materialised), with one warning a run (``run_warnings``; the same text from every
    engine: Python shows it once)."""
    names = [
        f"{layer.name}.{name}" if layer.name else name
        for layer in layers
        for name in parameters_without_data(layer.module)
    ]
    if not names:
        return False
    if "no data" not in run_warnings:  # one warning a run for every engine of a driver
        run_warnings.add("no data")
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        warnings.warn(  # one place and one text for every engine: shown once
            f"qkmonitor: the attention layers' parameters hold no data ({names[0]!r}{more}: "
            "on the meta device, or lazy and not yet materialised), so nothing is measured "
            "until they do (e.g. `model.to_empty(device=...)` and an initialisation, or a "
            "first forward of a lazy module); training goes on.",
            RuntimeWarning,
            stacklevel=1,
        )
    return True


def qk_norm_layers(layers: Sequence[AttentionLayer]) -> frozenset[int]:
    """The indices of ``layers`` with QK-norm (rules with ``skip_qk_norm`` leave them out); a
    layer whose weights raise when read counts as without (their read warns)."""
    return frozenset(i for i, layer in enumerate(layers) if _has_qk_norm(layer))


def _has_qk_norm(layer: AttentionLayer) -> bool:
    try:
        return layer.has_qk_norm
    except Exception:  # noqa: BLE001 -- a metric problem must never stop training
        return False


def check_statistics(owner: str, layers: Sequence[AttentionLayer]) -> list[bool]:
    """Which of ``layers`` give attention statistics (``supports_stats``). None is an error; some
    not one warning (the adapters said why; those stay NaN).

    Raises:
        MeasuresNothingError: no layer gives statistics.
    """
    measurable = [layer.supports_stats for layer in layers]
    unsupported = [layer.name for layer, ok in zip(layers, measurable) if not ok]
    if len(unsupported) == len(layers):
        raise MeasuresNothingError(
            f"{owner}: layers {unsupported} give no attention statistics; "
            "describe them with qkmonitor.AttentionSpec (statistics come from their SDPA or "
            "softmax call), or pass `layers=` with qkmonitor.AttentionLayer subclasses that "
            "define `supports_stats` and `install(probe)`"
        )
    if unsupported:
        warnings.warn(
            f"{owner}: layers {unsupported} give no attention statistics here; "
            "their activation metrics are logged as NaN.",
            RuntimeWarning,
            stacklevel=3,  # the engine's bind, as from its `_prepare`
        )
    return measurable


def report_missing(
    engine: Reporting,
    host: Host,
    results: list[ProbeResult],
    measurable: list[bool],
    *,
    first: bool,
) -> None:
    """Say what a closed window could not measure: an empty batch, and per layer one that did not
    run, whose calls could not be read or were refused (tensor parallelism), or whose statistics
    failed; in the ``first`` window, none of the layers read is an error.

    Raises:
        MeasuresNothingError: in the first window, layers ran but no attention call was read.
    """
    measured = [t for r in results for t in [*(s.entropy for s in r.stats), *r.probs]]
    if measured and all(t.numel() == 0 for t in measured):
        engine.warn_once(
            host,
            "empty",
            "a probed batch held no token (an empty batch): nothing was measured and "
            "its values are NaN. This warning is shown once.",
        )
    if first:
        _refuse_unread(engine, results, measurable)
    for layer, result, ok in zip(engine.layers, results, measurable):
        _warn_layer(engine, host, layer, result, measurable=ok)


def _refuse_unread(engine: Reporting, results: list[ProbeResult], measurable: list[bool]) -> None:
    """Raise where the layers ran in the first probed forward but none of their calls was read."""
    layers = engine.layers
    unread = [
        (layer, result.unread[0])
        for layer, result, ok in zip(layers, results, measurable)
        if ok and result.calls == 0 and result.unread
    ]
    if not unread or any(r.calls for r, ok in zip(results, measurable) if ok):
        return
    names = "; ".join(f"{layer.name!r}: {why}" for layer, why in unread[:3])
    more = f" (and {len(unread) - 3} more)" if len(unread) > 3 else ""
    raise MeasuresNothingError(
        f"{type(engine).__name__} measures none of its {len(layers)} attention layers: "
        f"they ran in the first probed forward, but no attention call could be read "
        f"({names}{more}). Where a call could not be read, describe the attention "
        "with qkmonitor.register_attention (README, 'Use it on your model'); where it "
        "is refused (heads mixed before the softmax, a softmax over channels), it is "
        "not one head's attention over tokens: leave this monitor out."
    )


def _warn_layer(
    engine: Reporting,
    host: Host,
    layer: AttentionLayer,
    result: ProbeResult,
    *,
    measurable: bool,
) -> None:
    """One warning per layer and kind: a ``measurable`` layer of which no call was read (refused
    under tensor parallelism, unread, or it did not run); and its statistics that failed."""
    if measurable and result.calls == 0:
        if result.sharded:  # tensor parallelism
            engine.warn_once(
                host,
                f"sharded:{layer.name}",
                f"layer {layer.name!r}: {result.sharded[0]}; its values are NaN. This "
                "warning is shown once per layer.",
                logging_rank_only=True,
            )
        elif result.unread:
            engine.warn_once(
                host,
                f"unread:{layer.name}",
                f"layer {layer.name!r} ran in the probed forward, but none of its attention "
                f"calls could be read ({result.unread[0]}); its values are NaN. This warning "
                "is shown once per layer.",
            )
        else:
            engine.warn_once(
                host,
                f"missing:{layer.name}",
                f"layer {layer.name!r} did not run in the probed forward; its values are NaN. "
                "This warning is shown once per layer.",
            )
    for reason in result.failures[:1]:
        engine.warn_once(
            host,
            f"failed:{layer.name}",
            f"no statistics for layer {layer.name!r} in {len(result.failures)} call(s) "
            f"({reason}); they are left out. This warning is shown once per layer.",
            shared=True,
        )
