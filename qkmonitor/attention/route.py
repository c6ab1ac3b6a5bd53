"""A route: what probing installs on one module to see its attention calls, in one place.

A family that sees a module's calls from outside the module (the Hugging Face dispatch,
:mod:`~qkmonitor.attention.hf`; the interception of SDPA and softmax calls,
:mod:`~qkmonitor.attention.intercept`) installs a :class:`Route` on the module when the first probe
asks for it and takes it off when the last one leaves: the probes' observers, the reference count
(the observers themselves) and the undo are here; a subclass says what else it installs
(:meth:`Route.uninstall`) and keeps the module's attribute name (:attr:`Route.key`). A module may
carry a route of each kind at once (a Hugging Face module read by name is routed by the dispatch
for its statistics and intercepted for its layout check), never two of one kind.

:func:`observed` builds a call for the observers and turns a failure into a
:class:`~qkmonitor.attention.calls.FailedCall`: a metric problem is reported, never raised into
the user's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, TypeVar

import torch
from torch import nn
from typing_extensions import Self

from qkmonitor.attention.calls import FailedCall
from qkmonitor.attention.installs import set_attribute
from qkmonitor.attention.probes import AttentionCall, ObserverSet, side_computation

__all__ = ["Route", "observed"]

R = TypeVar("R", bound="Route")


class Route:
    """What probing installed on one module: the probes' observers, and how to undo the install.

    Attributes:
        key: the module attribute (in its ``__dict__``, recorded by
            :mod:`~qkmonitor.attention.installs`) that holds the route of this kind.
        observers: the probes' observers of the module's calls.
    """

    key: ClassVar[str] = ""

    def __init__(self) -> None:
        self.observers = ObserverSet()
        self._undo_attribute: Callable[[], None] = lambda: None

    @classmethod
    def of(cls, module: nn.Module) -> Self | None:
        """The module's route of this kind, if one is installed."""
        route = module.__dict__.get(cls.key)
        return route if isinstance(route, cls) else None

    @classmethod
    def attach(
        cls,
        module: nn.Module,
        observe: Callable[[AttentionCall], None],
        sink_tokens: int,
        make: Callable[[], Self | None],
    ) -> tuple[Self, Callable[[], None]] | None:
        """Add ``observe`` to the module's route of this kind, installing one made by ``make()``
        if there is none (None from ``make``: nothing could be installed, and nothing is).
        Returns the route and the function that removes ``observe``, and the route with the last
        observer, or None."""
        route = cls.of(module)
        if route is None:
            route = make()
            if route is None:
                return None
            route._undo_attribute = set_attribute(module, cls.key, route)
        remove_observer = route.observers.add(observe, sink_tokens)

        def remove() -> None:
            remove_observer()
            if not route.observers and module.__dict__.get(cls.key) is route:
                route._undo_attribute()
                route.uninstall()

        return route, remove

    def uninstall(self) -> None:
        """Undo what the route put on the module besides itself (hooks, a patched function)."""


def observed(build: Callable[[], AttentionCall]) -> AttentionCall:
    """``build()`` as a side computation (no autograd, not traced), or the error it raised as a
    :class:`~qkmonitor.attention.calls.FailedCall`."""
    try:
        with torch.no_grad(), side_computation():
            return build()
    except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
        return FailedCall(err)
