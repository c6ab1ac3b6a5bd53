"""Find the attention layers of a model and read their query/key weights.

An :class:`AttentionLayer` wraps one attention module, whatever its origin, and gives the monitors
what they need: a name, its index in forward order, and :meth:`AttentionLayer.qk_weights` —
``(w_q, w_k, num_heads, num_kv_heads, scale)`` in ``nn.Linear`` layout. The core never imports
the bundled models: they take part through the :class:`SupportsQKMonitor` protocol, which any
user module may implement too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

__all__ = [
    "QKWeights",
    "SupportsQKMonitor",
    "AttentionLayer",
    "NativeAttentionLayer",
    "MultiheadAttentionLayer",
    "find_attention_layers",
]


@dataclass(frozen=True)
class QKWeights:
    """A layer's query and key projections (``nn.Linear`` layout) and how they split into heads.

    Attributes:
        w_q: (num_heads * d_k, d) query weight, biases left out.
        w_k: (num_kv_heads * d_k, d') key weight.
        num_heads: query heads H.
        num_kv_heads: key/value heads; divides H (GQA/MQA when smaller).
        scale: the factor the layer multiplies ``q·k`` by before the softmax.
    """

    w_q: Tensor
    w_k: Tensor
    num_heads: int
    num_kv_heads: int
    scale: float


@runtime_checkable
class SupportsQKMonitor(Protocol):
    """An attention module that describes itself to qkmonitor (qkmonitor's own modules do).

    ``qk_weights()`` returns the :class:`QKWeights` of the module's current parameters. A module
    may also offer activation statistics by defining ``set_probe(enabled: bool)`` (capture on the
    following forwards) and ``pop_stats() -> AttentionStats | None`` (the last forward's per-row
    statistics, see :class:`qkmonitor.kernels.AttentionStats`).
    """

    def qk_weights(self) -> QKWeights: ...


class AttentionLayer:
    """One attention layer of a model, seen through an adapter.

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

    @property
    def supports_stats(self) -> bool:
        """Whether :meth:`set_probe` / :meth:`pop_stats` give activation statistics."""
        return False

    def set_probe(self, enabled: bool) -> None:
        """Capture attention statistics on the following forwards (``enabled``) or stop."""
        raise NotImplementedError(f"{type(self).__name__} has no activation statistics")

    def pop_stats(self):
        """The :class:`~qkmonitor.kernels.AttentionStats` of the last probed forward, or None."""
        raise NotImplementedError(f"{type(self).__name__} has no activation statistics")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(index={self.index}, name={self.name!r})"


class NativeAttentionLayer(AttentionLayer):
    """A module implementing :class:`SupportsQKMonitor` (qkmonitor's own attention)."""

    kind = "qkmonitor"

    def qk_weights(self) -> QKWeights:
        return self.module.qk_weights()

    @property
    def supports_stats(self) -> bool:
        return callable(getattr(self.module, "set_probe", None)) and callable(getattr(self.module, "pop_stats", None))

    def set_probe(self, enabled: bool) -> None:
        if not self.supports_stats:
            super().set_probe(enabled)
        self.module.set_probe(enabled)

    def pop_stats(self):
        if not self.supports_stats:
            return super().pop_stats()
        return self.module.pop_stats()


class MultiheadAttentionLayer(AttentionLayer):
    """``torch.nn.MultiheadAttention``: packed ``in_proj_weight`` or separate q/k/v weights.

    ``batch_first`` does not matter for the weights. The scale is ``1/sqrt(head_dim)``, as in
    ``F.multi_head_attention_forward``.
    """

    kind = "torch.nn.MultiheadAttention"

    def qk_weights(self) -> QKWeights:
        mha: nn.MultiheadAttention = self.module
        e = mha.embed_dim
        if mha.in_proj_weight is not None:  # packed (3E, E): rows are q, k, v
            w_q, w_k = mha.in_proj_weight[:e], mha.in_proj_weight[e : 2 * e]
        else:
            w_q, w_k = mha.q_proj_weight, mha.k_proj_weight  # (E, E) and (E, kdim)
        return QKWeights(w_q, w_k, mha.num_heads, mha.num_heads, 1.0 / math.sqrt(mha.head_dim))


def _adapt(name: str, module: nn.Module, index: int) -> AttentionLayer | None:
    if isinstance(module, SupportsQKMonitor):
        return NativeAttentionLayer(name, module, index)
    if isinstance(module, nn.MultiheadAttention):
        return MultiheadAttentionLayer(name, module, index)
    return None


_LOOKED_FOR = (
    "qkmonitor attention modules (a `qk_weights()` method), torch.nn.MultiheadAttention"
)

LayerSpec = Iterable[AttentionLayer | nn.Module] | Callable[[nn.Module], Any]


def find_attention_layers(model: nn.Module, layers: LayerSpec | None = None) -> list[AttentionLayer]:
    """The attention layers of ``model``, in forward (registration) order.

    Args:
        model: the model to search.
        layers: optional override: a list of :class:`AttentionLayer` or modules, or a function
            ``model -> list`` of either. Modules must be of a supported kind.

    Returns:
        A non-empty list of :class:`AttentionLayer`, ``index`` counting from 0.

    Raises:
        ValueError: if no attention layer is found, or a given module is not supported.
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
            f"No attention layers found in {type(model).__name__}: looked for {_LOOKED_FOR}. "
            "Pass `layers=` (a list of AttentionLayer or modules, or a function of the model)."
        )
    return found


def _from_user(model: nn.Module, layers: LayerSpec) -> list[AttentionLayer]:
    items = list(layers(model) if callable(layers) else layers)
    names = {id(m): n for n, m in model.named_modules()}
    result: list[AttentionLayer] = []
    for i, item in enumerate(items):
        if isinstance(item, AttentionLayer):
            item.index = i
            result.append(item)
            continue
        if not isinstance(item, nn.Module):
            raise ValueError(
                f"Expected `layers` to hold AttentionLayer or nn.Module items, got {type(item).__name__} at {i}"
            )
        layer = _adapt(names.get(id(item), f"layers.{i}"), item, i)
        if layer is None:
            raise ValueError(
                f"`layers[{i}]` ({type(item).__name__}) is not a supported attention module: "
                f"expected one of {_LOOKED_FOR}, or wrap it in an AttentionLayer subclass"
            )
        result.append(layer)
    if not result:
        raise ValueError("Expected `layers` to name at least one attention layer, got none")
    return result
