"""What a user imports first comes from the top-level package, the same objects as in their
modules, and ``import qkmonitor`` loads neither Lightning nor the engines until they are used."""

from __future__ import annotations

import subprocess
import sys

import pytest

import qkmonitor


def test_the_first_names_import_from_the_package_as_the_objects_of_their_modules():
    from qkmonitor import AttentionSpec, Monitoring, QKMonitor
    from qkmonitor.attention.spec import AttentionSpec as spec
    from qkmonitor.callbacks import QKMonitor as callback
    from qkmonitor.engine import Monitoring as session

    assert (QKMonitor, Monitoring, AttentionSpec) == (callback, session, spec)
    assert QKMonitor is callback and Monitoring is session and AttentionSpec is spec
    assert {"QKMonitor", "Monitoring", "AttentionSpec"} <= set(qkmonitor.__all__)
    assert {"QKMonitor", "Monitoring"} <= set(dir(qkmonitor))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'QKMonitorCallbak'"):
        qkmonitor.QKMonitorCallbak  # noqa: B018


def test_importing_the_package_loads_lightning_and_the_engines_only_when_asked():
    code = (
        "import sys\n"
        "import qkmonitor\n"
        "assert 'lightning' not in sys.modules and 'qkmonitor.engine' not in sys.modules\n"
        "from qkmonitor import *\n"
        "assert QKMonitor.__module__ == 'qkmonitor.callbacks.qk_monitor'\n"
        "assert Monitoring.__module__ == 'qkmonitor.engine.session'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
