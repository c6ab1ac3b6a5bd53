"""A package's names loaded on first use: ``qkmonitor.lazy.lazy_exports``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qkmonitor.lazy import lazy_exports


def test_a_lazy_name_is_imported_when_first_asked_for_then_kept():
    namespace = {"__name__": "qkmonitor.fake", "__package__": "qkmonitor"}
    getattr_, dir_ = lazy_exports(
        namespace, {"check_bool": "qkmonitor.validation", "on_threads": ".threads"}
    )
    from qkmonitor.threads import on_threads
    from qkmonitor.validation import check_bool

    assert "check_bool" not in namespace
    assert getattr_("check_bool") is check_bool and namespace["check_bool"] is check_bool
    assert getattr_("on_threads") is on_threads  # relative to the module's package
    assert dir_() == sorted({*namespace, "check_bool", "on_threads"})
    with pytest.raises(AttributeError, match="module 'qkmonitor.fake' has no attribute 'nope'"):
        getattr_("nope")


def test_the_tasks_names_are_their_modules_objects_and_the_registry_loads_no_lightning():
    code = (
        "import sys\n"
        "import qkmonitor.models.tasks as tasks\n"
        "from qkmonitor.models.tasks.registry import TASKS\n"
        "assert 'lightning' not in sys.modules\n"
        "from qkmonitor.models.tasks.base import TaskDataModule\n"
        "from qkmonitor.models.tasks.recall import AssociativeRecallDataModule\n"
        "assert tasks.TaskDataModule is TaskDataModule\n"
        "assert tasks.AssociativeRecallDataModule is AssociativeRecallDataModule\n"
        "assert set(tasks.__all__) <= set(dir(tasks))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
