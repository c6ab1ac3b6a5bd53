"""Import paths of modules that moved when the package was regrouped by concern (2026-12-03):
``import qkmonitor.report`` still works and gives the module at its new home
(:mod:`qkmonitor.output.report`), the same module object, so that code written against the old
layout (and a monkeypatch of one of its names) keeps working. docs/changes.md lists the moves.

One :class:`MovedModuleFinder` on ``sys.meta_path``, installed by ``qkmonitor/__init__.py`` for
the life of the process; it answers only for the names in :data:`MOVED`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: old module path -> its home now
MOVED = {
    "qkmonitor.adapters": "qkmonitor.attention.adapters",
    "qkmonitor.registry": "qkmonitor.attention.registry",
    "qkmonitor.layouts": "qkmonitor.attention.layouts",
    "qkmonitor.intercept": "qkmonitor.attention.intercept",
    "qkmonitor.hf": "qkmonitor.attention.hf",
    "qkmonitor.compiled": "qkmonitor.attention.compiled",
    "qkmonitor.calls": "qkmonitor.attention.calls",
    "qkmonitor.probes": "qkmonitor.attention.probes",
    "qkmonitor.installs": "qkmonitor.attention.installs",
    "qkmonitor.clip": "qkmonitor.attention.clip",
    "qkmonitor.functional": "qkmonitor.measures.functional",
    "qkmonitor.metrics": "qkmonitor.measures.metrics",
    "qkmonitor.catalogue": "qkmonitor.measures.catalogue",
    "qkmonitor.layer_spectra": "qkmonitor.measures.layer_spectra",
    "qkmonitor.tags": "qkmonitor.output.tags",
    "qkmonitor.dashboards": "qkmonitor.output.dashboards",
    "qkmonitor.report": "qkmonitor.output.report",
    "qkmonitor.engine.sinks": "qkmonitor.output.sinks",
    "qkmonitor.engine.publisher": "qkmonitor.output.publisher",
    "qkmonitor.engine.guard": "qkmonitor.output.guard",
    "qkmonitor.hf_trainer": "qkmonitor.callbacks.hf_trainer",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)  # the module itself, under its old name too

    def exec_module(self, module) -> None:
        pass  # already executed at its new home


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds each old path of :data:`MOVED` as its new module."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once per process."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
