"""A probe's values go one way: measure -> alert -> publish -> sinks (docs/architecture.md, "From a
probe to a tag", step 4). The output path (engine/recording.py) enters the alert policy once and
the publisher once a probe; neither calls the other or back into the engine, and neither imports
the other."""

from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

import torch

from qkmonitor.alerts import AlertRule, LogitGrowthWarning
from qkmonitor.engine import AttentionEntropy, Monitoring
from qkmonitor.output.sinks import MemorySink

from .tiny import TOKENS, decoder

ENGINE = Path(__file__).resolve().parents[2] / "qkmonitor" / "engine"

#: fires on every head at every probe
ANY_ENTROPY = AlertRule(name="any_entropy", metric="entropy", threshold=0.0, above=True,
                        patience=1, margin=0.0, warning=LogitGrowthWarning, meaning="test",
                        advice="test")  # fmt: skip

#: the modules of the output path, by file name
STAGES = {"recording.py", "alerting.py", "publishing.py", "host.py", "base.py", "entropy.py"}


def _imports(name: str) -> set[str]:
    """The qkmonitor modules ``engine/{name}.py`` imports, type-checking imports included."""
    tree = ast.parse((ENGINE / f"{name}.py").read_text())
    return {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qkmonitor")
    }


def test_the_alert_policy_and_the_publisher_import_neither_each_other_nor_the_engine():
    engine_side = {f"qkmonitor.engine.{m}" for m in ("base", "recording", "activation")}
    alerting, publishing = _imports("alerting"), _imports("publishing")
    assert not alerting & (engine_side | {"qkmonitor.engine.publishing"})
    assert not publishing & (engine_side | {"qkmonitor.engine.alerting"})
    assert {"qkmonitor.engine.alerting", "qkmonitor.engine.publishing"} <= _imports("recording")


def _entries(run) -> list[tuple[str, str, str]]:
    """``run()`` traced: each call from one module of :data:`STAGES` into another, as
    ``(caller file, callee file, callee function)``, in order."""
    seen: list[tuple[str, str, str]] = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee = Path(frame.f_code.co_filename)
        caller = Path(frame.f_back.f_code.co_filename)
        if callee.parent != ENGINE or callee.name not in STAGES or callee.name == caller.name:
            return
        if caller.parent == ENGINE and caller.name in STAGES:
            seen.append((caller.name, callee.name, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def test_a_probe_enters_the_alert_policy_once_then_the_publisher_once_then_the_sinks():
    model, sink = decoder(), MemorySink()
    engine = AttentionEntropy(alerts=[ANY_ENTROPY], defer_reads=False, visuals_every_n_probes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitoring = Monitoring(model, [engine], writer=sink, every_n_steps=1)
        monitoring.begin(0)
        with torch.no_grad():
            model(TOKENS)
        entries = _entries(lambda: monitoring.end())
        monitoring.close()
    # the probe's way out of the engine, from its values to the sinks
    ours = ("recording.py", "alerting.py", "publishing.py")
    path = [(a, b, f) for a, b, f in entries if a in ours and {a, b} & set(ours[1:])]
    assert [(a, b) for a, b, _ in path if b in ours[1:]] == [
        ("recording.py", "alerting.py"),
        ("recording.py", "publishing.py"),
    ]
    assert [f for a, b, f in path if a == "recording.py"] == ["judge", "publish"]
    # onward only: the publisher writes to the host, the policy asks it for warnings and the
    # learning rate; neither calls the other, the output path or the engine
    onward = {(a, b) for a, b, _ in path if a != "recording.py"}
    assert onward <= {("alerting.py", "host.py"), ("publishing.py", "host.py")}
    assert ("publishing.py", "host.py") in onward
    # the alerts fired, were written as texts and counted, after the values
    rule_tags = [tag for tag, _, _ in sink.texts]
    assert rule_tags and set(rule_tags) == {"qkmonitor/alerts/any_entropy"}
    assert any(tag == "qkmonitor/alerts/any_entropy" for tag, _, _ in sink.scalars)
