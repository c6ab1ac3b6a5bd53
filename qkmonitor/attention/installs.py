"""What qkmonitor puts on a user's module, bound to that module object.

While a probe window is open, the monitors install things on the modules they measure: forward
hooks (:func:`qkmonitor.attention.compiled.add_forward_hooks`), and attributes in the module's
``__dict__`` (an interception route, a Hugging Face module's route and config view, a method, a
LightningModule's uncompiled methods). A copy of the model taken in that window — a lazily built
EMA teacher or target network (``copy.deepcopy``), ``pickle``, ``torch.save`` — must carry none of
them: the copy's forwards would feed the original's probes (its values then depend on the copy),
the hooks would stay on the copy for good, and their closures do not pickle.

Every such install is recorded in the module's :class:`Installs` (one per module, in its
``__dict__`` under ``_qkmonitor_installs``) through :func:`add_hooks` or :func:`set_attribute`, and
undone by the function they return. While anything is recorded, the module carries an instance
``__getstate__`` — what ``copy``, ``pickle`` and ``torch.save`` read (``object.__reduce_ex__``
looks it up on the instance) — that gives the module's state as it would be without the installs:
the recorded hooks left out of the hook dictionaries, each attribute set put back to what it was
(or left out), the ledger and itself left out. The last undo removes both, and the module is as it
was. Observers a module keeps itself (:class:`qkmonitor.attention.probes.ObserverSet`) copy as an
empty set.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["Installs", "add_hooks", "installs_of", "set_attribute"]

#: where a module keeps its :class:`Installs`
LEDGER_KEY = "_qkmonitor_installs"
#: the instance attribute that copies and pickles read for the module's state
_GETSTATE = "__getstate__"
_ABSENT = object()


class Installs:
    """What qkmonitor installed on one module and has not undone: the hook handles by id, and the
    attributes set with what they were before (or absent)."""

    def __init__(self) -> None:
        self.hooks: dict[int, RemovableHandle] = {}
        self.attributes: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return bool(self.hooks or self.attributes)

    def __reduce__(self):  # never carried by a copy (the module's state leaves it out anyway)
        return (Installs, ())


class _StateWithoutInstalls:
    """A module's instance ``__getstate__`` while it holds installs: its own state (its class's
    ``__getstate__``) less what qkmonitor installed. Holds the module weakly (it lives in the
    module's ``__dict__``)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    def __call__(self) -> dict[str, Any]:
        module = self._module()
        state = dict(type(module).__getstate__(module))
        installs = state.pop(LEDGER_KEY, None) or Installs()
        state.pop(_GETSTATE, None)
        for name, before in installs.attributes.items():
            if before is _ABSENT:
                state.pop(name, None)
            else:
                state[name] = before
        ours = set(installs.hooks)
        hook_dicts = {id(d) for handle in installs.hooks.values() for d in _dicts_of(handle)}
        for name, value in state.items():
            if id(value) in hook_dicts:
                state[name] = type(value)((k, v) for k, v in value.items() if k not in ours)
        return state


def _dicts_of(handle: RemovableHandle) -> Iterable[dict]:
    """The hook dictionaries a handle's hook is registered in (the hooks and their flags)."""
    for ref in (handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ())):
        d = ref()
        if d is not None:
            yield d


def installs_of(module: nn.Module) -> Installs | None:
    """The module's :class:`Installs`, or None when qkmonitor has nothing on it."""
    return module.__dict__.get(LEDGER_KEY)


def _ledger(module: nn.Module) -> Installs:
    installs = module.__dict__.get(LEDGER_KEY)
    if installs is None:
        installs = module.__dict__[LEDGER_KEY] = Installs()
        module.__dict__[_GETSTATE] = _StateWithoutInstalls(module)
    return installs


def _forget_if_empty(module: nn.Module, installs: Installs) -> None:
    if not installs and module.__dict__.get(LEDGER_KEY) is installs:
        del module.__dict__[LEDGER_KEY]
        module.__dict__.pop(_GETSTATE, None)


def add_hooks(module: nn.Module, handles: list[RemovableHandle]) -> Callable[[], None]:
    """Record hooks just registered on ``module``; the returned function removes them (once)."""
    installs = _ledger(module)
    for handle in handles:
        installs.hooks[handle.id] = handle

    def remove() -> None:
        for handle in handles:
            handle.remove()
            installs.hooks.pop(handle.id, None)
        _forget_if_empty(module, installs)

    return remove


def set_attribute(module: nn.Module, name: str, value: Any) -> Callable[[], None]:
    """Put ``value`` in the module's ``__dict__`` under ``name`` (no ``nn.Module.__setattr__``:
    never a parameter, buffer or submodule); the returned function puts back what was there, or
    removes it, once. One install per name at a time (the callers share theirs, counted)."""
    installs = _ledger(module)
    if name in installs.attributes:
        raise RuntimeError(f"qkmonitor: {name!r} is already installed on {type(module).__name__}")
    before = installs.attributes[name] = module.__dict__.get(name, _ABSENT)
    module.__dict__[name] = value
    undone = False

    def undo() -> None:
        nonlocal undone
        if undone:
            return
        undone = True
        del installs.attributes[name]
        if before is _ABSENT:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = before
        _forget_if_empty(module, installs)

    return undo
