"""Find the attention layers of a model and read their query/key weights.

An :class:`AttentionLayer` wraps one attention module, whatever its origin, and gives the monitors
what they need: a name, its index in forward order, and :meth:`AttentionLayer.qk_weights` —
``(w_q, w_k, num_heads, num_kv_heads, scale)`` in ``nn.Linear`` layout. The core never imports
the bundled models: they take part through the :class:`SupportsQKMonitor` protocol, which any
user module may implement too.

:func:`find_attention_layers` asks the registered families (:mod:`qkmonitor.attention.registry`)
for each module; this module holds the base class and the search, the families their own modules
(:mod:`.native`, :mod:`.multihead`, :mod:`.hf`, :mod:`.intercept`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from torch import nn

from qkmonitor.attention.clip import QKRows
from qkmonitor.attention.probes import Probe, ProbeRequest, ProbeResult
from qkmonitor.attention.registry import families
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.measures.sharding import HeadPlacement, SplitHeadsError

__all__ = [
    "AttentionLayer",
    "SupportsQKMonitor",
    "find_attention_layers",
    "parameters_without_data",
]


def parameters_without_data(module: nn.Module) -> list[str]:
    """The names of the module's parameters that hold no data: on the meta device, or lazy and
    not yet materialised (``nn.LazyLinear`` before its first forward)."""
    return [
        name
        for name, p in module.named_parameters()
        if p.is_meta or isinstance(p, nn.parameter.UninitializedTensorMixin)
    ]


@runtime_checkable
class SupportsQKMonitor(Protocol):
    """An attention module that describes itself to qkmonitor (qkmonitor's own modules do).

    ``qk_weights()`` returns the :class:`~qkmonitor.measures.layer_spectra.QKWeights` of the
    module's current parameters. A module may also offer activation statistics by defining
    ``register_probe(observer, sink_tokens=0)``:
    it hands every following forward to ``observer`` as an
    :class:`~qkmonitor.attention.probes.AttentionCall` (e.g. a
    :class:`~qkmonitor.attention.probes.KernelCall` holding the kernel's statistics), and returns a
    function that removes exactly that observer (:class:`~qkmonitor.attention.probes.ObserverSet`
    does the bookkeeping). If it also takes ``stats=``, an observer that reads no per-row statistics
    (QK-Clip's) is registered with ``stats=False``, and the module may skip computing them.
    """

    def qk_weights(self) -> QKWeights: ...


class AttentionLayer:
    """One attention layer of a model, seen through an adapter.

    Subclasses read the module's query/key weights (:meth:`qk_weights`) and, where they can
    measure activations, install what a probe needs (:meth:`install`); :meth:`open_probe` is the
    protocol of :mod:`qkmonitor.attention.probes`.

    Args:
        name: the module's qualified name in the model (``""`` for the model itself).
        module: the attention module.
        index: position in forward order, from 0.
    """

    kind = "custom"

    def __init__(self, name: str, module: nn.Module, index: int = 0) -> None:
        self.name = name
        self.module = module
        self.index = index

    def qk_weights(self) -> QKWeights:
        """The layer's current query/key weights; subclasses read them from their module."""
        raise NotImplementedError(f"{type(self).__name__} must implement `qk_weights()`")

    def qk_rows(self) -> QKRows:
        """The layer's query and key projections by head, as views that in-place writes go
        through (what QK-Clip scales); NotImplementedError where the family cannot give them."""
        raise NotImplementedError(
            f"{type(self).__name__} ({self.kind}) does not give its query/key rows"
        )

    @property
    def supports_stats(self) -> bool:
        """Whether :meth:`open_probe` can measure this layer's forwards."""
        return False

    @property
    def supports_weights(self) -> bool:
        """Whether :meth:`qk_weights` can read this layer's W_Q and W_K."""
        return True

    @property
    def needs_layout_check(self) -> bool:
        """Whether the weights were read by name and wait for a forward to be checked against
        (:mod:`qkmonitor.attention.intercept`); open a probe with ``ProbeRequest(layout=True)`` for
        it."""
        return False

    def check_layout(self, result: ProbeResult) -> str | None:
        """Check the weight layout against a layout probe's result; a message if it fails."""
        return None

    @property
    def layout_ready(self) -> bool:
        """Whether :meth:`qk_weights` gives the weights now (no check pending)."""
        return self.supports_weights and not self.needs_layout_check

    @property
    def num_heads_hint(self) -> int:
        """The number of query heads, as far as it is known without a forward (1 if not at all:
        heads split across ranks in a way that is refused, too)."""
        try:
            return self.qk_weights().num_heads if self.layout_ready else 1
        except SplitHeadsError:
            return 1

    @property
    def head_placement(self) -> HeadPlacement | None:
        """Where the heads :meth:`qk_weights` and :meth:`qk_rows` give are among the layer's,
        where they are this rank's part (tensor parallelism); None where they are all of them."""
        return None

    @property
    def has_qk_norm(self) -> bool:
        """Whether the layer normalizes q and k after the projections (``QKWeights.qk_norm``)."""
        return self.qk_weights().qk_norm if self.layout_ready else False

    def open_probe(self, request: ProbeRequest | None = None) -> Probe:
        """Measure every forward of the module until the returned probe is closed.

        Args:
            request: what to measure (default: the per-row statistics only).

        Returns:
            An open :class:`~qkmonitor.attention.probes.Probe`; ``probe.close()`` removes what this
            installed and returns the measurements of every call.

        Raises:
            ValueError: if the layer gives no activation statistics.
        """
        request = ProbeRequest() if request is None else request
        if not isinstance(request, ProbeRequest):
            raise ValueError(
                f"Expected `request` to be a ProbeRequest, got {type(request).__name__}"
            )
        if request.layout and not self.needs_layout_check:
            raise ValueError(f"{type(self).__name__} {self.name!r} has no weight layout to check")
        if request.stats and not self.supports_stats:
            raise ValueError(f"{type(self).__name__} {self.name!r} gives no activation statistics")
        probe = Probe(self.name, request)
        probe.record_undo(self.install_layout(probe) if request.layout else self.install(probe))
        return probe

    def install(self, probe: Probe) -> Callable[[], None]:
        """Route the module's forwards to ``probe.observe``; return what undoes exactly that."""
        raise NotImplementedError(f"{type(self).__name__} has no activation statistics")

    def install_layout(self, probe: Probe) -> Callable[[], None]:
        """Like :meth:`install`, for a layout probe (layers whose weights were read by name)."""
        raise NotImplementedError(f"{type(self).__name__} has no weight layout to check")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(index={self.index}, name={self.name!r})"


def _adapt(name: str, module: nn.Module, index: int) -> AttentionLayer | None:
    """The first registered family's adapter for ``module`` (:mod:`qkmonitor.attention.registry`),
    or None."""
    for family in families():
        layer = family.adapt(name, module, index)
        if layer is not None:
            return layer
    return None


def _looked_for() -> str:
    return "; ".join(family.looked_for for family in families())


LayerSpec = (
    nn.Module | AttentionLayer | Iterable[AttentionLayer | nn.Module] | Callable[[nn.Module], Any]
)


def find_attention_layers(
    model: nn.Module, layers: LayerSpec | None = None
) -> list[AttentionLayer]:
    """The attention layers of ``model``, in forward (registration) order.

    Args:
        model: the model to search.
        layers: optional override: one module or :class:`AttentionLayer`, a list of them, or a
            function ``model -> list`` of either. Modules must be of a supported kind and
            submodules of ``model``.

    Returns:
        A non-empty list of :class:`AttentionLayer`, ``index`` counting from 0.

    Raises:
        ValueError: if no attention layer is found, or a given module is not supported or not in
            ``model``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"Expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    if layers is not None:
        return _from_user(model, layers)
    found: list[AttentionLayer] = []
    claimed: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") or prefix == "" for prefix in claimed):
            continue  # inside an attention module already found
        layer = _adapt(name, module, len(found))
        if layer is not None:
            found.append(layer)
            claimed.append(name)
    if not found:
        raise ValueError(
            f"No attention layers found in {type(model).__name__}: looked for {_looked_for()}."
            f"{_passed_over(model)} Describe yours with "
            "qkmonitor.register_attention(qkmonitor.AttentionSpec(...)), or pass `layers=` "
            "(AttentionLayer subclasses, modules, or a function of the model); see the README, "
            "'Use it on your model'."
        )
    return found


def _passed_over(model: nn.Module) -> str:
    """The modules that look like attention (by name, or an SDPA call in their code) that no
    family took, named for the error, and why they were passed over."""
    from qkmonitor.attention.recognition import NOT_ATTENTION, looks_like_attention

    passed = [
        f"{name!r} ({type(module).__name__})"
        for name, module in model.named_modules()
        if name and not isinstance(module, NOT_ATTENTION) and looks_like_attention(module)
    ]
    if not passed:
        return ""
    more = f" and {len(passed) - 3} more" if len(passed) > 3 else ""
    return (
        f" Passed over, though they look like attention: {', '.join(passed[:3])}{more}: none of "
        "their submodules is a query/key projection of a name qkmonitor knows, and no family "
        "recognises their structure."
    )


def _from_user(
    model: nn.Module, layers: LayerSpec | nn.Module | AttentionLayer
) -> list[AttentionLayer]:
    if isinstance(layers, (nn.Module, AttentionLayer)):  # one layer (a module is callable too)
        items = [layers]
    elif callable(layers):
        items = layers(model)
        if isinstance(items, (nn.Module, AttentionLayer)):
            items = [items]
        elif isinstance(items, Iterable) and not isinstance(items, (str, bytes)):
            items = list(items)
        else:
            raise ValueError(
                "Expected the function passed as `layers` to return a module, an AttentionLayer "
                f"or a list of them for the model, got {type(items).__name__}"
            )
    elif isinstance(layers, Iterable) and not isinstance(layers, (str, bytes)):
        items = list(layers)
    else:
        raise ValueError(
            f"Expected `layers` to be a module, an AttentionLayer, a list of them or a function of "
            f"the model, got {type(layers).__name__}"
        )
    names = {id(m): n for n, m in model.named_modules()}
    result: list[AttentionLayer] = []
    for i, item in enumerate(items):
        if isinstance(item, AttentionLayer):
            item.index = i
            result.append(item)
            continue
        if not isinstance(item, nn.Module):
            raise ValueError(
                "Expected `layers` to hold AttentionLayer or nn.Module items, got "
                f"{type(item).__name__} at {i}"
            )
        if id(item) not in names:
            raise ValueError(
                f"`layers[{i}]` ({type(item).__name__}) is not a submodule of the monitored "
                f"{type(model).__name__}: pass modules of the model being trained"
            )
        layer = _adapt(names[id(item)], item, i)
        if layer is None:
            raise ValueError(
                f"`layers[{i}]` ({type(item).__name__}) is not a supported attention module: "
                f"expected one of: {_looked_for()}; or describe it with qkmonitor.AttentionSpec, "
                "or wrap it in a qkmonitor.AttentionLayer subclass"
            )
        result.append(layer)
    if not result:
        raise ValueError("Expected `layers` to name at least one attention layer, got none")
    return result
