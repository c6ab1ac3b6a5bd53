"""A package's names loaded on first use (PEP 562): the module-level ``__getattr__`` and
``__dir__`` that :mod:`qkmonitor` and :mod:`qkmonitor.models.tasks` share, so that importing them
loads neither Lightning nor the engines until a name that needs them is used."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    namespace: dict[str, Any], modules: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the module whose ``globals()`` is ``namespace``.

    ``__getattr__`` imports a name of ``modules`` from its module when first asked for and keeps
    it in ``namespace``, an ordinary attribute from then on; any other name is an
    ``AttributeError`` as Python words it. ``__dir__`` lists the module's names and the lazy ones.

    Args:
        namespace: the module's ``globals()``.
        modules: each name loaded on first use -> the module that defines it, absolute
            (``"qkmonitor.engine.session"``) or relative to the module's package (``".lm"``).

    Example (in a package's ``__init__.py``: ``__getattr__, __dir__ = lazy_exports(globals(),
    _LAZY)``; here on a module made on the spot)::

        >>> import types
        >>> demo = types.ModuleType("demo")
        >>> demo.__getattr__, demo.__dir__ = lazy_exports(vars(demo), {"sqrt": "math"})
        >>> "sqrt" in vars(demo), demo.sqrt(4.0), "sqrt" in vars(demo)  # loaded on first use
        (False, 2.0, True)
        >>> "sqrt" in dir(demo)
        True
    """
    module_name, package = namespace["__name__"], namespace["__package__"]

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(import_module(module, package), name)
        namespace[name] = value  # once loaded, an ordinary attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *modules})

    return __getattr__, __dir__
