"""Every model of the zoo: a probed step leaves Python's cyclic collector nothing beyond what the
model's own step leaves (``tests/core/test_no_cycles.py`` says why: a capture in a reference
cycle held its forward's tensors until the collector ran). The reference is the collector: with
it disabled, the unreachable objects ``gc.collect()`` finds after an unprobed step and after a
probed one, by type."""

from __future__ import annotations

import gc

import pytest

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink
from tests.core.test_no_cycles import collector_off, unreachable_after

from .models import ZOO
from .test_zoo import build


@pytest.mark.parametrize("name", list(ZOO))
def test_a_probed_step_leaves_no_more_reference_cycles_than_the_models_own(name):
    built = build(name)
    model = built.model
    engines = [QKSpectrum(per_head=True), AttentionEntropy(per_head=True), EffectiveRank()]
    monitoring = Monitoring(model, engines, writer=MemorySink(), every_n_steps=1)
    steps = iter(range(100))

    def plain():
        built.loss(model).backward()

    def probed():
        with monitoring.step(next(steps)):
            plain()

    try:
        with collector_off():
            plain()
            probed()  # first-step work (discovery, warnings given once) apart
            own = unreachable_after(plain)
            assert unreachable_after(plain) == own  # the model's own is the same at each step
            for _ in range(2):
                assert unreachable_after(probed) == own
    finally:
        monitoring.close()
        gc.collect()
