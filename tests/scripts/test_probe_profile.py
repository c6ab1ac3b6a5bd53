"""benchmarks/probe_profile.py (``overhead.py --profile``): a probe window against a plain one,
on the CPU: each monitor's hooks and the engine parts appear as ranges, the blocking reads are
booked to the monitor that made them (none in the plain window), and every wrapper is removed."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def profiled(benchmark_module):
    probe_profile = benchmark_module("probe_profile")
    overhead = benchmark_module("overhead")
    originals = {}
    for module_name, qualified in overhead.PARTS:
        owner = importlib.import_module(module_name)
        *path, attr = qualified.split(".")
        for name in path:
            owner = getattr(owner, name)
        originals[qualified] = (owner, attr, getattr(owner, attr))
    args = SimpleNamespace(model="default", arch="bundled", device="cpu", precision="32-true",
                           steps=15)  # fmt: skip
    results = probe_profile.profile_probe(args, every=5)
    return probe_profile, results, originals


def test_each_monitor_and_part_is_a_range(profiled):
    _, results, _ = profiled
    probe = results["probe"]
    for monitor in ("QKSpectrumMonitor", "AttentionEntropyMonitor", "EffectiveRankMonitor"):
        host, _, calls = probe.ranges[f"monitor {monitor}"]
        assert host > 0 and calls >= 4, (monitor, probe.ranges)  # both batches' hooks
    assert probe.ranges["part QKSpectrum.observe_weights"][2] >= 1
    assert probe.ranges["part MonitorEngine.record"][2] == 3  # one record an engine


def test_reads_are_booked_to_the_monitors_and_none_in_a_plain_window(profiled):
    _, results, _ = profiled
    probe, plain = results["probe"], results["plain"]
    for monitor in ("QKSpectrumMonitor", "AttentionEntropyMonitor", "EffectiveRankMonitor"):
        assert probe.reads[monitor] > 0, probe.reads
    assert sum(plain.reads.values()) == 0, plain.reads
    assert not plain.ranges or all(calls for _, _, calls in plain.ranges.values())
    assert probe.wall > 0 and plain.wall > 0


def test_every_wrapper_is_removed(profiled):
    _, _, originals = profiled
    for qualified, (owner, attr, original) in originals.items():
        assert getattr(owner, attr) is original, qualified


def test_report_prints_both_windows(profiled, capsys):
    probe_profile, results, _ = profiled
    probe_profile.report_profile(results, "cpu")
    out = capsys.readouterr().out
    assert "probe window (2 batches)" in out and "plain window: 0" in out
    assert "monitor QKSpectrumMonitor" in out
