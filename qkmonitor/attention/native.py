"""The qkmonitor family: a module implementing
:class:`~qkmonitor.attention.adapters.SupportsQKMonitor` (qkmonitor's own attention, or a user's),
read through its own ``qk_weights()`` and ``register_probe``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from torch import nn

from qkmonitor.attention.adapters import AttentionLayer, SupportsQKMonitor
from qkmonitor.attention.calls import TENSOR_PARALLEL, UnreadCall
from qkmonitor.attention.clip import QKRows
from qkmonitor.attention.compiled import add_forward_hooks
from qkmonitor.attention.probes import AttentionCall, Probe
from qkmonitor.attention.registry import register_family
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.measures.sharding import SplitHeadsError, row_shard

__all__ = ["NativeAttentionLayer"]


class NativeAttentionLayer(AttentionLayer):
    """A module implementing :class:`SupportsQKMonitor` (qkmonitor's own attention)."""

    @property
    def kind(self) -> str:  # type: ignore[override]
        return f"qkmonitor.{type(self.module).__name__}"

    def qk_weights(self) -> QKWeights:
        return self.module.qk_weights()

    def qk_rows(self) -> QKRows:
        rows = getattr(self.module, "qk_rows", None)
        if not callable(rows):
            raise NotImplementedError(
                f"{type(self.module).__name__} has no `qk_rows()` returning a "
                "qkmonitor.attention.clip.QKRows"
            )
        return rows()

    @property
    def supports_stats(self) -> bool:
        return callable(getattr(self.module, "register_probe", None))

    def install(self, probe: Probe) -> Callable[[], None]:
        module = self.module
        request = probe.request
        skip_stats = {"stats": False} if not request.stats and _takes_stats(module) else {}

        def observe(call: AttentionCall) -> None:
            refused = _split_heads(module)  # as the forward computes, FSDP2's weights unsharded
            probe.observe(call if refused is None else UnreadCall(refused, sharded=True))

        remove_observer = module.register_probe(
            observe, sink_tokens=request.sink_tokens, **skip_stats
        )
        remove_switch = add_forward_hooks(self.module)  # under compile: run eagerly while probed

        def remove() -> None:
            remove_switch()
            remove_observer()

        return remove


def _split_heads(module: nn.Module) -> str | None:
    """Why a :class:`SupportsQKMonitor` module's call is refused: its query or key weights, as its
    forward computes with them, are split by rows across ranks (tensor parallelism), and the
    protocol does not say which heads this rank holds; None where they are whole."""
    try:
        weights = module.qk_weights()
    except SplitHeadsError as err:
        return str(err)
    except Exception:  # noqa: BLE001 -- the weights' own read warns
        return None
    if all(row_shard(w) is None for w in (weights.w_q, weights.w_k)):
        return None
    return (
        f"its query/key projections are sharded by rows across ranks ({TENSOR_PARALLEL}), and "
        f"{type(module).__name__}.qk_weights() does not say which heads this rank holds; its "
        "attention statistics are not measured"
    )


def _adapt_native(name: str, module: nn.Module, index: int) -> AttentionLayer | None:
    return (
        NativeAttentionLayer(name, module, index) if isinstance(module, SupportsQKMonitor) else None
    )


register_family(
    "qkmonitor",
    _adapt_native,
    priority=10,
    looked_for=(
        "qkmonitor attention modules and modules implementing SupportsQKMonitor (`qk_weights()`)"
    ),
)


def _takes_stats(module: nn.Module) -> bool:
    """Whether the module's ``register_probe`` takes ``stats=`` (an observer that reads none)."""
    return _register_probe_takes_stats(type(module))


@functools.cache
def _register_probe_takes_stats(cls: type) -> bool:
    """Read once per class: QKClip installs a probe at every step."""
    try:
        return "stats" in inspect.signature(cls.register_probe).parameters
    except (AttributeError, TypeError, ValueError):  # on the instance only, or no signature
        return False
