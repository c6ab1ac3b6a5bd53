"""Each default is declared once: a Lightning callback's keyword defaults are the engine options'
(``MonitorOptions``) and its engine's own, read from their signatures, so that changing one there
cannot leave a callback (whose signature LightningCLI reads) on the old value."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from qkmonitor.callbacks import (
    AttentionEntropyMonitor,
    EffectiveRankMonitor,
    QKClip,
    QKMonitor,
    QKSpectrumMonitor,
)
from qkmonitor.engine import (
    AttentionEntropy,
    EffectiveRank,
    MonitorOptions,
    QKClipEngine,
    QKSpectrum,
)

OPTIONS = {f.name: f.default for f in dataclasses.fields(MonitorOptions)}


def defaults(function) -> dict[str, object]:
    return {
        name: p.default
        for name, p in inspect.signature(function).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize(
    "callback, engines",
    [
        (QKSpectrumMonitor, [QKSpectrum]),
        (AttentionEntropyMonitor, [AttentionEntropy]),
        (EffectiveRankMonitor, [EffectiveRank]),
        (QKClip, [QKClipEngine]),
        (QKMonitor, [QKSpectrum, AttentionEntropy, EffectiveRank]),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_a_callbacks_defaults_are_its_engines(callback, engines):
    own = defaults(callback.__init__)
    declared = dict(OPTIONS)
    for engine in engines:
        declared.update(defaults(engine.__init__))
    shared = sorted(set(own) & set(declared))
    assert shared, "the callback shares no parameter with its engine"
    mismatched = {
        name: (own[name], declared[name]) for name in shared if own[name] != declared[name]
    }
    # QKClip probes every step unless told otherwise; its engine says so in its body
    if callback is QKClip:
        mismatched.pop("every_n_steps", None)
    assert mismatched == {}
