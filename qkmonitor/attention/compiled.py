"""Probing modules that run under ``torch.compile``: switches set once per fit, not hooks per
window.

Dynamo guards a compiled graph on the Python state it read while tracing: the modules' hook
dictionaries, attributes and configs. A probe that installs a hook, a route or a config for its
window changes that state at every window, and a probed forward that graph-breaks inside a loop
over the layers makes dynamo give up on the loop's frame for good (it runs uncompiled from then on,
probed or not). So under compile the monitors measure through switches:

- a **switched module** (:class:`SwitchedForward`) gets, once, a subclass of its own class whose
  ``forward`` reads one bool: off, it is the module's own forward, which dynamo traces as if the
  switch were not there (one more guard: ``active`` is False); on (while a probe holds it), the
  module's forward runs **eagerly** (:func:`torch.compiler.disable`) between the probes'
  callbacks (:func:`add_forward_hooks`), which run as ordinary hooks would. The probed modules
  (attention layers, blocks) and the **roots** of the compiled regions (the module that
  ``torch.compile`` wraps) are switched; on a probed step the root runs eagerly as a whole, so
  the one graph break is at the top, never inside a loop.
- a LightningModule that Lightning compiles (``trainer.fit(torch.compile(module))``) has its
  compiled ``forward`` and ``*_step`` methods put aside for the probed steps
  (:class:`UncompiledForward`).

The state dynamo reads is then the same at every window: once a probed and an unprobed step have
run, nothing recompiles, and unprobed steps run the model's own graph. A switched module pickles
and deep-copies as its own class, without the switch. Eagerly (no compile), modules keep the
ephemeral hooks of :mod:`qkmonitor.attention.probes`: nothing is switched outside a window.

:func:`compiled_roots` finds the compiled regions as the model shows them. A plain loop may compile
the model it hands the monitors uncompiled (``compiled = torch.compile(model)``); there the bound
model runs through a switch for each probe window (``MonitorEngine.switch_model_in_windows``), so
that its probed step runs eagerly from the top.
"""

from __future__ import annotations

import copyreg
import functools
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from qkmonitor import private_apis
from qkmonitor.attention.installs import add_hooks, set_attribute

__all__ = [
    "NeverCompiled",
    "SwitchedForward",
    "UncompiledForward",
    "add_forward_hooks",
    "compiled_roots",
    "guard_interrupts",
    "own_class",
    "switch_of",
]

_STATE = "_qkmonitor_switch"


def compiled_roots(model: nn.Module) -> list[nn.Module]:
    """The modules at the top of the compiled regions of ``model``, as the model shows them: what a
    ``torch.compile``'d module (``OptimizedModule``) inside it wraps, a module compiled in place
    (``nn.Module.compile()``), a LightningModule that Lightning compiles (its ``_compiler_ctx``)."""
    optimized = private_apis.optimized_module_type()
    roots: list[nn.Module] = []
    for module in model.modules():
        if optimized is not None and isinstance(module, optimized):
            original = private_apis.compiled_original(module)
            if original is not None:
                roots.append(original)
        elif private_apis.compiled_in_place(module) or private_apis.lightning_compiler_ctx(module):
            roots.append(module)
    return list({id(m): m for m in roots}.values())


class SwitchedForward:
    """The switch of one module: its own forward, or, while :attr:`active`, its own forward run
    eagerly between the probes' callbacks.

    :meth:`attach` installs it (the module's class becomes a subclass with a switched ``forward``;
    shared by every engine that measures the module, counted), :meth:`detach` takes it out when the
    last holder lets go; :meth:`add` adds a probe's callbacks and switches it on while any are
    present.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.base = type(module)
        self.active = False
        self._hooks: dict[int, tuple[Callable | None, Callable | None]] = {}  # key -> (pre, post)
        #: called when a BaseException that is not an Exception leaves the forward
        self._on_interrupt: dict[int, Callable[[], None]] = {}
        self.guarded = False  # a plain bool, as ``active``: whether to catch an interrupt
        self._next = 0
        self._holders = 0

    @classmethod
    def attach(cls, module: nn.Module) -> SwitchedForward | None:
        """The module's switch, installed on first use; each call adds a holder. None for a module
        whose ``forward`` is an attribute of its own (it keeps ordinary hooks)."""
        switch = switch_of(module)
        if switch is None:
            if "forward" in module.__dict__:
                return None
            _run_eagerly.prepare()  # eagerly, before dynamo may trace a switched forward
            switch = cls(module)
            module.__dict__[_STATE] = switch
            module.__class__ = _switched_class(switch.base)
        switch._holders += 1
        return switch

    def detach(self) -> None:
        """One holder lets go; the last one gives the module back its own class."""
        self._holders -= 1
        if self._holders > 0:
            return
        self._hooks.clear()
        self._on_interrupt.clear()
        self.active = self.guarded = False
        if self.module.__dict__.get(_STATE) is self:
            del self.module.__dict__[_STATE]
            self.module.__class__ = self.base

    def add(self, pre: Callable | None = None, post: Callable | None = None) -> Callable[[], None]:
        """Run ``pre(module, args, kwargs)`` before and ``post(module, args, output)`` after every
        forward (``output`` None when the forward raised) until the returned function is called.
        The module runs eagerly while anything was added (callbacks or not: a module that measures
        itself, or the root of a compiled region, only needs to run eagerly)."""
        key, self._next = self._next, self._next + 1
        self._hooks[key] = (pre, post)
        self.active = True

        def remove() -> None:
            self._hooks.pop(key, None)
            self.active = bool(self._hooks)

        return remove

    def on_interrupt(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` when a ``BaseException`` that is not an ``Exception`` (a
        ``KeyboardInterrupt``, ``SystemExit``) leaves the module's forward, before it goes on up:
        torch runs its always-call hooks on an ``Exception`` only, and a framework that gives its
        callbacks no hook on failure (``transformers.Trainer``) runs nothing of ours after it.
        Until the returned function is called."""
        key, self._next = self._next, self._next + 1
        self._on_interrupt[key] = callback
        self.guarded = True

        def remove() -> None:
            self._on_interrupt.pop(key, None)
            self.guarded = bool(self._on_interrupt)

        return remove

    def interrupted(self) -> None:
        """Run the interrupt callbacks (each once, even if one fails)."""
        callbacks, self._on_interrupt = list(self._on_interrupt.values()), {}
        self.guarded = False
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001, S110 -- the interrupt goes on up regardless
                pass


@functools.cache
def _switched_class(base: type) -> type:
    """``base`` with a switched ``forward`` (one class per base, named as the base). The cache
    is the one copy: made at a class's first switch, kept for the process (instances point at
    it)."""
    own_forward = base.forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        switch = self._qkmonitor_switch
        if switch.active:  # a plain bool attribute: dynamo guards on its value
            return _run_eagerly(switch, args, kwargs)
        if switch.guarded:
            try:
                return own_forward(self, *args, **kwargs)
            except Exception:
                raise
            except BaseException:
                switch.interrupted()
                raise
        return own_forward(self, *args, **kwargs)

    functools.update_wrapper(forward, own_forward)  # its signature, for those that read it
    switched = type(
        base.__name__,
        (base,),
        {
            "forward": forward,
            "__reduce_ex__": _reduce_as_base,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
        },
    )
    return switched


def _reduce_as_base(self: nn.Module, protocol: int):
    """Pickle and deep-copy a switched module as its own class, without the switch (rebuilt by the
    standard library's ``copyreg._reconstructor``, as protocols 0 and 1 rebuild objects)."""
    state = {key: value for key, value in self.__getstate__().items() if key != _STATE}
    return copyreg._reconstructor, (own_class(self), object, None), state


class NeverCompiled:
    """``torch.compiler.disable(function)``, made when first needed (:meth:`prepare`, or the first
    call): importing dynamo imports triton, which ``import qkmonitor`` must not."""

    def __init__(self, function: Callable) -> None:
        self.function = function
        self.disabled: Callable | None = None

    def prepare(self) -> Callable:
        if self.disabled is None:
            self.disabled = torch.compiler.disable(self.function)
        return self.disabled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.disabled or self.prepare())(*args, **kwargs)


def _run_module(switch: SwitchedForward, args: tuple, kwargs: dict) -> Any:
    module, hooks = switch.module, list(switch._hooks.values())
    for pre, _ in hooks:
        if pre is not None:
            pre(module, args, kwargs)
    output = None
    try:
        output = switch.base.forward(module, *args, **kwargs)
    except Exception:
        raise
    except BaseException:
        switch.interrupted()
        raise
    finally:
        for _, post in hooks:
            if post is not None:
                post(module, args, output)
    return output


_run_eagerly = NeverCompiled(_run_module)


def switch_of(module: nn.Module) -> SwitchedForward | None:
    """The :class:`SwitchedForward` installed on ``module``, or None."""
    return module.__dict__.get(_STATE)


def own_class(module: nn.Module) -> type:
    """The module's class as its author wrote it (not the switched subclass)."""
    switch = switch_of(module)
    return type(module) if switch is None else switch.base


class UncompiledForward:
    """A LightningModule that Lightning compiles (``trainer.fit(torch.compile(module))``) holds its
    compiled ``forward`` and ``*_step`` methods as attributes and the originals in its
    ``_compiler_ctx``; while :meth:`add` holds it, those attributes are the originals (the probed
    step runs uncompiled, outside any compiled frame), and the compiled ones after."""

    METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._holders = 0
        self._undo: list[Callable[[], None]] = []  # puts the compiled methods back

    #: the one instance per module, shared by every engine; weak: gone with the module
    _shared: ClassVar[weakref.WeakKeyDictionary[nn.Module, UncompiledForward]] = (
        weakref.WeakKeyDictionary()
    )

    @classmethod
    def of(cls, module: nn.Module) -> UncompiledForward:
        """The one instance for ``module``, shared by every engine (windows nest)."""
        shared = cls._shared.get(module)
        if shared is None:
            shared = cls._shared[module] = cls(module)
        return shared

    def add(self) -> Callable[[], None]:
        """Put the originals in place until the returned function is called (windows nest)."""
        self._holders += 1
        if self._holders == 1:
            context = private_apis.lightning_compiler_ctx(self.module) or {}
            for name in self.METHODS:
                original, compiled = context.get(f"original_{name}"), self.module.__dict__.get(name)
                if original is not None and compiled is not None:  # a copy keeps the compiled
                    self._undo.append(set_attribute(self.module, name, original))
        return self._release

    def _release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            undo, self._undo = self._undo, []
            for restore in undo:
                restore()


def guard_interrupts(module: nn.Module, callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback()`` when a ``KeyboardInterrupt`` (any ``BaseException`` that is not an
    ``Exception``) leaves ``module``'s forward, until the returned function is called: the module
    is switched (:class:`SwitchedForward`, its forward still its own, not run eagerly) while
    guarded; one whose ``forward`` is an attribute of its own (``accelerate``'s autocast wrapper)
    has that attribute wrapped instead, recorded in its installs and put back."""
    switch = SwitchedForward.attach(module)
    if switch is None:
        own = module.__dict__["forward"]

        @functools.wraps(own)
        def forward(*args: Any, **kwargs: Any) -> Any:
            try:
                return own(*args, **kwargs)
            except Exception:
                raise
            except BaseException:
                callback()
                raise

        return set_attribute(module, "forward", forward)
    remove = switch.on_interrupt(callback)

    def unguard() -> None:
        remove()
        switch.detach()

    return unguard


def add_forward_hooks(
    module: nn.Module, pre: Callable | None = None, post: Callable | None = None
) -> Callable[[], None]:
    """What a probe installs on ``module`` for its window: ``pre(module, args, kwargs)`` before
    and ``post(module, args, output)`` after each forward (also when it raises, with ``output``
    None). Through the module's :class:`SwitchedForward` when it has one (compile), else as
    ordinary forward hooks recorded in the module's :mod:`~qkmonitor.attention.installs` (a copy of
    the module leaves them out), removed by the returned function."""
    switch = switch_of(module)
    if switch is not None:
        return switch.add(pre, post)
    handles = []
    if pre is not None:
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    if post is not None:
        handles.append(module.register_forward_hook(post, always_call=True))
    return add_hooks(module, handles)  # a copy of the module carries none of them
