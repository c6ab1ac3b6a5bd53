"""Recognising attention modules that no family knows: by name, and by the code of their class.

This module is the one place qkmonitor reads code rather than observing calls, in two functions:

- :func:`computes_attention` reads a class's source. Discovery must decide which modules to probe
  before any forward has run, and a module that computes attention in its own forward (SDPA, or a
  softmax over its logits) is told apart from one that merely holds projections only by what its
  code calls. The first probe then observes the call itself and checks the layout against it
  (:mod:`.layout_check`), so a wrong guess costs a warning, not a wrong number.
- :func:`names_in_code` reads the names a function's bytecode refers to, for
  :mod:`._hf_compat`: whether a Hugging Face module's methods reach the attention registry (decided
  at discovery, before any call), and whether transformers' eager function applies the module's
  causal ``bias`` buffer (inside transformers' own code, after the call qkmonitor sees, where no
  observer of ours runs).
"""

from __future__ import annotations

import inspect
import re
from functools import cache

from torch import nn

ATTENTION_NAME = re.compile(r"attn|attention|attend", re.IGNORECASE)
# a call or a reference in code (``F.softmax``, ``x.softmax(``), not the word in a docstring
# (flex_attention counts as SDPA does: a fused kernel the capture intercepts by its name)
_SDPA_IN_CODE = re.compile(
    r"[.\w]scaled_dot_product_attention\b|\bscaled_dot_product_attention\s*\("
    r"|\bflex_attention\s*\("
)
_SOFTMAX_IN_CODE = re.compile(r"\.softmax\b|\bsoftmax\s*\(")


_FRAMEWORKS = (
    "transformers.modeling_utils",
    "transformers.generation",
    "transformers.integrations",
    "torch.",
    "lightning.",
    "pytorch_lightning.",
)


@cache
def computes_attention(cls: type) -> str | None:
    """``"sdpa"`` or ``"softmax"`` if the class's own source (up to ``nn.Module``) calls it."""
    found = None
    for base in cls.__mro__:
        if base in (nn.Module, object):
            break
        if base.__module__.startswith(_FRAMEWORKS):  # e.g. PreTrainedModel: its code names SDPA
            continue
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        if _SDPA_IN_CODE.search(source):
            return "sdpa"
        if _SOFTMAX_IN_CODE.search(source):
            found = "softmax"
    return found


@cache
def forward_computes_attention(cls: type) -> str | None:
    """``"sdpa"`` or ``"softmax"`` if the class that defines the ``forward`` ``cls`` resolves
    calls it in its own code (its methods, as GPT-J's ``_attn``; not a class it overrides): a
    Hugging Face module of a known shape that computes its attention there, instead of
    dispatching, is read by interception."""
    owner = next((base for base in cls.__mro__ if "forward" in vars(base)), None)
    if owner is None or owner in (nn.Module, object):
        return None
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):
        return None
    if _SDPA_IN_CODE.search(source):
        return "sdpa"
    return "softmax" if _SOFTMAX_IN_CODE.search(source) else None


def names_in_code(function: object) -> frozenset[str]:
    """The global and attribute names ``function``'s bytecode refers to (``co_names``; empty for
    anything without code), behind decorators that keep ``__wrapped__``. Why qkmonitor reads them
    rather than observing a call: the module docstring."""
    code = getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None
    return frozenset(code.co_names) if code is not None else frozenset()


def child_computes(module: nn.Module) -> str | None:
    kinds = {computes_attention(type(child)) for child in module.children()} - {None}
    return "sdpa" if "sdpa" in kinds else ("softmax" if kinds else None)


def looks_like_attention(module: nn.Module) -> bool:
    """An attention-like class name, or a forward that calls SDPA."""
    return (
        bool(ATTENTION_NAME.search(type(module).__name__))
        or computes_attention(type(module)) == "sdpa"
    )


NOT_ATTENTION = (
    nn.Linear,
    nn.Embedding,
    nn.LayerNorm,
    nn.Dropout,
    nn.ModuleList,
    nn.ModuleDict,
    nn.Sequential,
)


def library(module: nn.Module) -> str:
    root = type(module).__module__.split(".")[0]
    return "module" if root in ("__main__", "builtins") else root
