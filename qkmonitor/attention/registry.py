"""The adapter registry: one entry per family of attention modules qkmonitor can read.

A family is a function ``adapt(name, module, index) -> AttentionLayer | None`` that recognises a
module of its kind and wraps it. Discovery
(:func:`qkmonitor.attention.adapters.find_attention_layers`) asks the families in order of
``priority`` (lower first) and takes the first answer, so a specific family (qkmonitor's own
modules, ``nn.MultiheadAttention``, Hugging Face) is asked before the generic one that reads
projections by name and intercepts the attention call.

Each family registers itself in its own module (:mod:`qkmonitor.attention.native`,
:mod:`qkmonitor.attention.multihead`, :mod:`qkmonitor.attention.hf`,
:mod:`qkmonitor.attention.intercept`), which ``import qkmonitor`` imports; a user's
:class:`AttentionSpec` (:mod:`qkmonitor.attention.spec`) registers with :func:`register_attention`.
Registering is idempotent by name: the same name replaces its earlier entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from qkmonitor.validation import is_int

__all__ = [
    "FAMILIES",
    "Family",
    "FamilyRegistry",
    "families",
    "register_family",
    "unregister_family",
]

Adapt = Callable[[str, nn.Module, int], Any]


@dataclass(frozen=True)
class Family:
    """One registered family of attention modules.

    Attributes:
        name: unique name, shown in discovery's summary (e.g. ``"transformers"``).
        adapt: ``adapt(name, module, index)`` -> an ``AttentionLayer`` or None.
        priority: lower is asked first; qkmonitor's families use 10-90, user specs 0.
        looked_for: what the family recognises, in words, for the "no attention found" error.
    """

    name: str
    adapt: Adapt
    priority: int
    looked_for: str


class FamilyRegistry:
    """The families discovery asks, by name. One per process (:data:`FAMILIES`): filled at
    ``import qkmonitor`` (each family's module registers itself) and by ``register_attention``;
    never emptied."""

    def __init__(self) -> None:
        self._by_name: dict[str, Family] = {}

    def register(self, name: str, adapt: Adapt, *, priority: int, looked_for: str) -> Family:
        """Add (or replace, by ``name``) a family of attention modules; returns its entry.

        Raises:
            ValueError: if ``name`` is not a non-empty string, ``adapt`` is not callable or
                ``priority`` is not an int.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"Expected `name` to be a non-empty str, got {name!r}")
        if not callable(adapt):
            raise ValueError(
                f"Expected `adapt` to be callable (name, module, index) -> layer, got {adapt!r}"
            )
        if not is_int(priority):
            raise ValueError(f"Expected `priority` to be an int, got {priority!r}")
        family = Family(name, adapt, priority, looked_for)
        self._by_name[name] = family
        return family

    def unregister(self, name: str) -> None:
        """Remove a family by name (no error if it is not registered)."""
        self._by_name.pop(name, None)

    def ordered(self) -> list[Family]:
        """The registered families, in the order discovery asks them."""
        return sorted(self._by_name.values(), key=lambda family: (family.priority, family.name))


#: the process's families
FAMILIES = FamilyRegistry()
register_family = FAMILIES.register
unregister_family = FAMILIES.unregister
families = FAMILIES.ordered
