"""Routing a Hugging Face module's attention call through qkmonitor's registered attention
function (:data:`PROBE_IMPLEMENTATION`): the module alone sees a copy of its config naming it
(:func:`route_module`; GPT-2's upcast path is wrapped on the instance instead), each call is
measured on the side and handed to the implementation the model was using, and the route's
:class:`DispatchChannel` puts the module's own config back."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

from torch import Tensor, nn

from qkmonitor import private_apis
from qkmonitor.attention import _hf_compat
from qkmonitor.attention.calls import MaskedCall, UnreadCall
from qkmonitor.attention.installs import set_attribute
from qkmonitor.attention.route import Channel, Route, observed
from qkmonitor.measures.sharding import HeadPlacement

__all__ = ["PROBE_IMPLEMENTATION", "DispatchChannel", "route_module"]

#: The name the probe registers in ``transformers``' ``AttentionInterface``.
PROBE_IMPLEMENTATION = "qkmonitor_probe"
_ORIGINAL_KEY = "_qkmonitor_original_attn_implementation"


class DispatchChannel(Channel):
    """A module's attention calls routed through qkmonitor's registered attention function:
    ``restore`` puts the module's own implementation back."""

    def __init__(
        self,
        restore: Callable[[], None],
        default_scale: Callable[[], float],
        placement: Callable[[int], HeadPlacement | str | None],
    ) -> None:
        super().__init__()
        self.restore = restore
        self.default_scale = default_scale
        self.placement = placement  # a call's query heads -> where they are among the layer's

    def uninstall(self) -> None:
        self.restore()


def _dispatch_table(module: nn.Module):
    """The ``ALL_ATTENTION_FUNCTIONS`` the module's own source file dispatches through, or None."""
    return _hf_compat.dispatch_table(module)  # a dict before transformers 4.51


def _eager_default(module: nn.Module):
    return _hf_compat.eager_default(module)


def _register() -> None:
    _hf_compat.register(PROBE_IMPLEMENTATION, _probe_attention)


def route_module(module: nn.Module, name: str) -> Callable[[], None] | None:
    """Point ``module`` (alone) at the probe; return what undoes it, or None (with a warning
    naming the layer, ``name``)."""
    config = module.config
    original = private_apis.attn_implementation(config)
    if original in (None, "eager") and getattr(module, "reorder_and_upcast_attn", False):
        return _route_gpt2_upcast(module, name)  # this path never reaches the dispatch
    if original in (None, "eager") and _eager_default(module) is None:
        warn_no_stats(
            name,
            f"no `eager_attention_forward` next to {type(module).__name__} to hand the call to",
        )
        return None
    _register()
    probe_config = copy.copy(
        config
    )  # shallow: only this module's view of the implementation changes
    probe_config.__dict__[_ORIGINAL_KEY] = original
    if not private_apis.route_config(probe_config, PROBE_IMPLEMENTATION):
        warn_no_stats(
            name,
            private_apis.missing_message(
                "transformers.PretrainedConfig._attn_implementation_internal",
                "this transformers version keeps `config._attn_implementation` elsewhere",
            ),
        )
        return None
    return set_attribute(module, "config", probe_config)  # a copy keeps the model's own config


def _route_gpt2_upcast(module: nn.Module, name: str) -> Callable[[], None] | None:
    upcast = private_apis.gpt2_upcast(type(module))
    if upcast is None:
        private = "transformers.models.gpt2.modeling_gpt2.GPT2Attention._upcast_and_reordered_attn"
        warn_no_stats(name, private_apis.missing_message(private))
        return None
    own = upcast.__get__(module)

    def upcast_and_reordered_attn(query, key, value, attention_mask=None, *args, **kwargs):
        mask, seen = _hf_compat.as_applied(
            module,
            query,
            key,
            attention_mask,
            {"scaling": getattr(module, "scaling", None)},
            "eager",
            eager=upcast,
        )
        _capture(module, query, key, mask, seen, original="eager")
        return own(query, key, value, attention_mask, *args, **kwargs)  # head_mask before 5.0

    return set_attribute(module, private_apis.GPT2_UPCAST, upcast_and_reordered_attn)


def _probe_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *args, **kwargs
):
    """The registered attention function: measure on the side, then run the model's own."""
    original = getattr(module.config, _ORIGINAL_KEY, None)
    mask, seen = _hf_compat.as_applied(module, query, key, attention_mask, kwargs, original)
    _capture(module, query, key, mask, seen, original=original)
    attend = _hf_compat.attention_function(
        _dispatch_table(module), original, _eager_default(module)
    )
    return attend(module, query, key, value, attention_mask, *args, **kwargs)


def _capture(
    module: nn.Module, query: Tensor, key: Tensor, attention_mask, kwargs: dict, original
) -> None:
    channel = Route.channel(module, DispatchChannel)
    if channel is None or not channel.observers:
        return
    scale = kwargs.get("scaling")

    def build() -> MaskedCall | UnreadCall:
        placement = channel.placement(query.shape[1])  # tensor parallelism: this rank's heads
        if isinstance(placement, str):
            return UnreadCall(placement, placement, sharded=True)
        call = MaskedCall.of(
            module,
            query,
            key,
            attention_mask,
            kwargs,
            original,
            scale=channel.default_scale() if scale is None else float(scale),
        )
        call.placement = placement
        return call

    channel.observers.notify(observed(build))


def warn_no_stats(name: str, why: str) -> None:
    warnings.warn(
        f"qkmonitor: no attention statistics for {name!r} ({why})", RuntimeWarning, stacklevel=2
    )
