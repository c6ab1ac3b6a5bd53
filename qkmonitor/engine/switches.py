"""An engine's switches under ``torch.compile`` (docs/architecture.md, "Under torch.compile").

A probe window must see the modules it measures run eagerly, without recompiling the model or
breaking its graph inside a loop. :class:`CompileSwitches` holds, from a bind to its release, the
:class:`~qkmonitor.attention.compiled.SwitchedForward` of every probed module and the roots of the
compiled regions found at bind, and turns the roots eager for each window (a Lightning-compiled
forward is put aside instead: :class:`~qkmonitor.attention.compiled.UncompiledForward`). In a plain
loop the bound model itself can be switched for each window (:attr:`switch_model`), since a loop
may compile the model where the monitors cannot see.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from qkmonitor import private_apis
from qkmonitor.attention.compiled import SwitchedForward, UncompiledForward, compiled_roots

__all__ = ["CompileSwitches"]


class CompileSwitches:
    """What one engine switches under compile, and the windows it opens on them."""

    def __init__(self) -> None:
        self._switches: list[SwitchedForward] = []  # held from the first window to release
        self._roots: list[SwitchedForward | UncompiledForward] = []  # the compiled regions' tops
        self._model: Callable[[], nn.Module | None] | None = None  # the bound model (a weakref)
        self._found: list[nn.Module] = []  # roots found at bind, switched at the first window
        self._removers: list[Callable[[], None]] = []  # what the open window turned on
        #: whether the bound model itself runs through a switch in each window, also when no
        #: compile is seen (``Monitoring`` sets it: a plain loop may compile the model unseen)
        self.switch_model = False

    def bind(self, model: nn.Module, *, lazy: bool = False) -> None:
        """Remember ``model`` and the roots of its compiled regions (none for a ``lazy`` model,
        which is not measured); nothing is switched before the first window, so that every
        engine's discovery sees the modules' own classes."""
        self._model = weakref.ref(model)
        self._found = [] if lazy else compiled_roots(model)

    def before_window(self, probed: Callable[[], list[nn.Module]]) -> None:
        """At a window's opening: switch the ``probed()`` modules and the roots found at bind, the
        first time a bind showed compiled regions."""
        roots, self._found = self._found, []
        if not roots or self._roots:
            return
        held = {id(switch.module) for switch in self._switches}
        for module in probed():
            if id(module) not in held and (switch := SwitchedForward.attach(module)) is not None:
                self._switches.append(switch)
                held.add(id(module))
        for root in roots:
            if private_apis.lightning_compiler_ctx(root):  # Lightning compiles it: put aside
                self._roots.append(UncompiledForward.of(root))
            elif (switch := SwitchedForward.attach(root)) is not None:
                self._switches.append(switch)
                self._roots.append(switch)

    def open_window(self) -> None:
        """Run the compiled regions' roots eagerly for the window, or the bound model itself with
        :attr:`switch_model` (switched for the window only)."""
        if not self._roots and self.switch_model and self._model is not None:
            model = self._model()
            switch = None if model is None else SwitchedForward.attach(model)
            if switch is not None:
                self._removers.append(switch.detach)
                self._removers.append(switch.add())
        for root in self._roots:
            self._removers.append(root.add())

    def close_window(self) -> None:
        """Undo what :meth:`open_window` turned on, last first; idempotent."""
        removers, self._removers = self._removers, []
        for remove in reversed(removers):
            remove()

    def release(self) -> None:
        """Take every switch out (the windows must be closed); idempotent."""
        self._roots = []
        switches, self._switches = self._switches, []
        for switch in switches:
            switch.detach()

    def __getstate__(self) -> dict[str, Any]:
        """A copy of the engine (``copy.deepcopy``, ``pickle``) carries no switch and no model."""
        return {"_switches": [], "_roots": [], "_model": None, "_found": [], "_removers": [],
                "switch_model": self.switch_model}  # fmt: skip
