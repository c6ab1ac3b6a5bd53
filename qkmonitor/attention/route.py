"""A route: what probing installs on one module to see its attention calls, in one place.

A family that sees a module's calls from outside the module's own code (the pre-hook on
``nn.MultiheadAttention``, :mod:`~qkmonitor.attention.adapters`; the Hugging Face dispatch,
:mod:`~qkmonitor.attention.hf_dispatch`; the interception of SDPA and softmax calls,
:mod:`~qkmonitor.attention.capture`) says only *how* it sees them: a :class:`Channel` subclass,
which installs its hooks or patched attribute when made and takes them off in
:meth:`Channel.uninstall`, and hands each call to its observers.

Everything else is here, once. A probed module carries one :class:`Route` (in its ``__dict__``
under ``_qkmonitor_route``, recorded by :mod:`~qkmonitor.attention.installs` so that a copy of the
module carries none): its channels, at most one of each kind (a Hugging Face module read by name is
seen through the dispatch for its statistics and intercepted for its layout check), each with the
probes' observers. The observers are the reference count: the first probe to ask for a channel
makes it, the last one to leave uninstalls it, and the route leaves the module with its last
channel.

:func:`observed` builds a call for the observers and turns a failure into a
:class:`~qkmonitor.attention.calls.FailedCall`: a metric problem is reported, never raised into
the user's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from qkmonitor.attention.calls import FailedCall
from qkmonitor.attention.installs import set_attribute
from qkmonitor.attention.probes import AttentionCall, ObserverSet, side_computation

__all__ = ["Channel", "Route", "observed"]

#: the module attribute (in its ``__dict__``) that holds its route while it is probed
ROUTE_KEY = "_qkmonitor_route"

C = TypeVar("C", bound="Channel")


class Channel:
    """One way of seeing a module's attention calls: what it installed, and the probes' observers.

    A subclass installs in its ``__init__`` (or in the ``make`` function handed to
    :meth:`Route.attach`) and undoes exactly that in :meth:`uninstall`.
    """

    def __init__(self) -> None:
        self.observers = ObserverSet()

    def uninstall(self) -> None:
        """Undo what the channel put on the module (hooks, a patched attribute)."""


class Route:
    """What probing installed on one module: its channels by kind, and how to take itself off."""

    def __init__(self, undo_attribute: Callable[[], None] = lambda: None) -> None:
        self.channels: dict[type[Channel], Channel] = {}
        self._undo_attribute = undo_attribute

    @staticmethod
    def of(module: nn.Module) -> Route | None:
        """The module's route, if it is probed through one."""
        route = module.__dict__.get(ROUTE_KEY)
        return route if isinstance(route, Route) else None

    @staticmethod
    def channel(module: nn.Module, kind: type[C]) -> C | None:
        """The module's channel of this kind, if one is installed."""
        route = Route.of(module)
        channel = None if route is None else route.channels.get(kind)
        return channel if isinstance(channel, kind) else None

    @staticmethod
    def attach(
        module: nn.Module,
        kind: type[C],
        observe: Callable[[AttentionCall], None],
        sink_tokens: int,
        make: Callable[[], C | None],
    ) -> tuple[C, Callable[[], None]] | None:
        """Add ``observe`` to the module's channel of this kind, made by ``make()`` if there is none
        (None from ``make``: nothing could be installed, and nothing is). Returns the channel and
        the function that removes ``observe`` (and, with the last observer, the channel, and with
        the last channel, the route), or None."""
        channel = Route.channel(module, kind)
        if channel is None:
            channel = make()
            if channel is None:
                return None
            route = Route.of(module)
            if route is None:
                route = Route()
                route._undo_attribute = set_attribute(module, ROUTE_KEY, route)
            route.channels[kind] = channel
        remove_observer = channel.observers.add(observe, sink_tokens)

        def remove() -> None:
            remove_observer()
            route = Route.of(module)
            if channel.observers or route is None or route.channels.get(kind) is not channel:
                return
            del route.channels[kind]
            try:
                channel.uninstall()
            finally:
                if not route.channels:
                    route._undo_attribute()

        return channel, remove


def observed(build: Callable[[], AttentionCall]) -> AttentionCall:
    """``build()`` as a side computation (no autograd, not traced), or the error it raised as a
    :class:`~qkmonitor.attention.calls.FailedCall`."""
    try:
        with torch.no_grad(), side_computation():
            return build()
    except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
        return FailedCall(err)
