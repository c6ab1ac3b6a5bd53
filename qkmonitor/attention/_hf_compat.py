"""What differs between ``transformers`` releases (4.48 and later) in how attention is dispatched.

:mod:`qkmonitor.attention.hf_dispatch` measures a Hugging Face attention module by routing its call
through a function registered under a name of its own, then handing the call to the implementation
the model was using. The registry and the lookup changed over the releases (read from each release's
source):

- 4.48 – 4.50: ``ALL_ATTENTION_FUNCTIONS`` is a plain ``dict`` in ``modeling_utils``; a module runs
  ``eager_attention_forward`` when ``config._attn_implementation`` is ``"eager"``, else
  ``ALL_ATTENTION_FUNCTIONS[name]``.
- 4.51 – 5.0: the registry is an ``AttentionInterface`` (``AttentionInterface.register``); the
  lookup is the same.
- 5.1 and later: ``ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)``.

Which modules dispatch at all: the LLaMA family and GPT-2 from 4.48; BERT only from 5.0 (before,
``BertSelfAttention`` and ``BertSdpaSelfAttention`` compute attention inside the module, so there is
nothing to route: :func:`qkmonitor.attention.hf.adapt_hf_module` leaves such modules to the
generic family, which intercepts the computation).
What a call leaves implicit, made explicit here so that the statistics describe the attention the
model computes:

- GPT-2's own ``eager_attention_forward`` (and ``_upcast_and_reordered_attn``) apply the module's
  causal buffer ``module.bias`` on top of the mask they are given, up to 5.2; before 4.53 the mask
  GPT-2 builds for eager attention holds only the padding.
- GPT-2 passes ``scaling`` only from 5.4. Without it SDPA and FlashAttention scale by
  ``1/sqrt(head_dim)``, whatever ``scale_attn_weights`` or ``scale_attn_by_inverse_layer_idx`` say,
  while GPT-2's eager function follows them (the adapter's own scale).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor, nn

from qkmonitor.attention.compiled import own_class
from qkmonitor.attention.recognition import names_in_code

#: The name of the registry in the modeling files of ``transformers``.
REGISTRY = "ALL_ATTENTION_FUNCTIONS"


def transformers_version() -> str:
    """The installed ``transformers`` version, or ``"unknown"``."""
    try:
        import transformers
    except ImportError:
        return "unknown"
    return str(getattr(transformers, "__version__", "unknown"))


def dispatch_table(module: nn.Module):
    """The attention registry the module's forward looks its function up in, or None.

    A ``dict`` (4.48 – 4.50) or an ``AttentionInterface`` (4.51 and later), read from the globals
    of the method that names it, so a user's subclass defined elsewhere finds it too.
    """
    method = _dispatching_method(module)
    return None if method is None else _table_in(method.__globals__)


def eager_default(module: nn.Module) -> Callable | None:
    """The ``eager_attention_forward`` next to the dispatching method, the modules' eager
    default."""
    method = _dispatching_method(module)
    return None if method is None else method.__globals__.get("eager_attention_forward")


def dispatches(module: nn.Module) -> bool:
    """Whether the module calls its attention through the registry.

    True when one of the methods the module's class resolves (its own or inherited, up to
    ``nn.Module``) names ``ALL_ATTENTION_FUNCTIONS`` and finds it in its module. A class that
    overrides ``forward`` with attention of its own does not, nor BERT before transformers 5.0.
    """
    return _dispatching_method(module) is not None


def _dispatching_method(module: nn.Module):
    """The first method the module's class runs (as resolved) that reads the registry, or None
    (the module's own class: under compile a probed module's class is switched,
    qkmonitor.attention.compiled)."""
    cls = own_class(module)
    names = dict.fromkeys(
        name for base in cls.__mro__[: cls.__mro__.index(nn.Module)] for name in vars(base)
    )
    for name in names:
        for function in _reached(cls, name):
            if REGISTRY in names_in_code(function) and _table_in(function.__globals__) is not None:
                return function
    return None


def _reached(cls: type, name: str):
    """The functions ``cls.name`` runs: the one it resolves to, then those its ``super()`` calls
    reach.

    An override that calls ``super().forward(...)`` still dispatches; one that computes attention
    itself does not, whatever the base class did.
    """
    for base in cls.__mro__:
        if name not in vars(base):
            continue
        function = inspect.unwrap(getattr(base, name))  # decorators that keep `__wrapped__`
        if not hasattr(function, "__code__") or not hasattr(function, "__globals__"):
            return
        yield function
        if "super" not in names_in_code(function):
            return


def _table_in(scope: dict | None):
    table = (scope or {}).get(REGISTRY)
    if callable(getattr(table, "__getitem__", None)) and callable(
        getattr(table, "__contains__", None)
    ):
        return table
    return None


def why_no_dispatch(module: nn.Module) -> str:
    """The warning's reason for a module that :func:`dispatches` rejects: what is missing, where."""
    return (
        f"transformers {transformers_version()}: {type(module).__name__} computes its attention "
        f"inside the module without calling a function from `{REGISTRY}`, so there is no call to "
        "measure; its query/key weight metrics still work (BERT dispatches from transformers 5.0)"
    )


def attention_function(table, name: str | None, eager: Callable | None) -> Callable:
    """The function a module of this ``transformers`` picks for ``config._attn_implementation``.

    Raises:
        KeyError: if ``name`` is neither eager nor registered (what the module itself would raise).
        ValueError: if ``name`` is eager (or None) and the module has no eager default.
    """
    get_interface = getattr(table, "get_interface", None)
    if callable(get_interface):  # 5.1 and later
        return get_interface(name, eager)
    if name not in (None, "eager"):
        return table[name]
    if eager is None:
        raise ValueError(f"no `eager_attention_forward` to hand the {name!r} call to")
    return eager


def register(name: str, function: Callable) -> None:
    """Register ``function`` under ``name`` for every module that dispatches (idempotent)."""
    try:
        from transformers import AttentionInterface  # 4.51 and later
    except ImportError:
        AttentionInterface = None
    if AttentionInterface is not None:
        AttentionInterface.register(name, function)
        return
    from transformers import modeling_utils  # 4.48 - 4.50: the registry is a plain dict

    getattr(modeling_utils, REGISTRY)[name] = function


def as_applied(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    attention_mask,
    kwargs: dict,
    implementation: str | None,
    eager: Callable | None = None,
) -> tuple[object, dict]:
    """The call's mask and keywords with what the implementation adds implicitly made explicit.

    Args:
        module: the attention module making the call.
        query: (B, H, N, D) queries of the call.
        key: (B, H_kv, M, D) keys of the call.
        attention_mask: the mask the call passes (None, 2-D or 4-D).
        kwargs: the call's keyword arguments (not modified).
        implementation: the ``config._attn_implementation`` the model uses.
        eager: the eager function that will run for ``"eager"``/None (default: the module's
            :func:`eager_default`); GPT-2's ``_upcast_and_reordered_attn`` when that runs.

    Returns:
        ``(mask, kwargs)``: a 4-D mask that also blocks what the eager function's own causal buffer
        blocks (GPT-2 up to 5.2), and ``kwargs`` with the ``scaling`` that SDPA, FlashAttention or
        flex attention apply when the call passes none (GPT-2 up to 5.3).
    """
    kwargs = dict(kwargs)
    if implementation in (None, "eager"):
        attention_mask = _with_causal_buffer(
            module, query, key, attention_mask, eager or eager_default(module)
        )
    elif kwargs.get("scaling") is None:
        kwargs["scaling"] = query.shape[-1] ** -0.5  # the default of every non-eager implementation
    return attention_mask, kwargs


def _with_causal_buffer(module: nn.Module, query: Tensor, key: Tensor, attention_mask, eager):
    """``attention_mask`` and the module's causal buffer, where the eager function applies it.

    The buffer is ``bias`` (1, 1, P, P) bool, lower-triangular; eager attention keeps
    ``bias[:, :, M - N : M, :M]`` (bottom-right aligned) and fills the rest with ``finfo.min``.
    """
    buffer = getattr(module, "bias", None)
    if (
        "bias" not in names_in_code(eager)
        or getattr(module, "is_cross_attention", False)
        or not isinstance(buffer, Tensor)
        or buffer.dtype != torch.bool
        or buffer.dim() != 4
    ):
        return attention_mask
    n, m = query.shape[-2], key.shape[-2]
    causal = buffer[:, :, m - n : m, :m]  # (1, 1, N, M), True = attend
    if attention_mask is None:
        return causal
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 4:
        return attention_mask  # not a mask eager takes; the statistics code says so
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., :m] & causal
    blocked = torch.tensor(
        torch.finfo(attention_mask.dtype).min,
        dtype=attention_mask.dtype,
        device=attention_mask.device,
    )
    return torch.where(causal, attention_mask[..., :m], blocked)
