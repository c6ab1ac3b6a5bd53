"""The steps between two probes (`MonitorEngine.steps_after`), where a host skips work: all but
keeping the loss (`between_probes`), or everything (`quiet`).

What a host skips must be what would not have happened: no probe opens, no weights are read, no
loss a rule reads is dropped. Checked against the engine's own per-step predicates on step
sequences a Trainer makes (one step a batch, two with two optimizers, none on accumulating
batches, uneven). End to end, with Lightning: tests/callbacks/test_quiet_batches.py.
"""

from __future__ import annotations

import itertools
import random

import pytest

from qkmonitor.engine import AttentionEntropy, MonitorEngine, QKSpectrum
from qkmonitor.models import DecoderLM, TransformerConfig


def step_sequences() -> dict[str, list[int]]:
    """The global step at each batch's start."""
    rng = random.Random(0)
    uneven, step = [], 0
    for _ in range(400):
        uneven.append(step)
        step += rng.choice([0, 1, 1, 1, 2, 3])
    return {
        "one a batch": list(range(300)),
        "two optimizers": list(range(0, 600, 2)),
        "accumulating": [s for s in range(200) for _ in range(3)],
        "uneven": uneven,
    }


def activation_host(engine: MonitorEngine, steps: list[int], skip: bool) -> list[int]:
    """What the Lightning activation callback does at each batch; returns the probe steps, and
    checks every batch it skips work in against the engine's predicates."""
    probes = []
    for step in steps:
        if skip and step in engine.schedule.between_probes:
            assert not engine.schedule.is_probe_step(step), step
            if step in engine.schedule.quiet:
                assert not engine.wants_loss(step), step
            else:
                assert engine.wants_loss(step), step
                engine.observe_loss(step, float(step))
            continue
        probed = engine.schedule.is_probe_step(step)  # `open`
        engine.observe_loss(step, float(step))
        if probed:  # `finish` records the probe after the batch's loss
            engine.schedule.latest_step = step
            probes.append(step)
        engine.plan(step)
    return probes


def spectrum_host(engine: QKSpectrum, steps: list[int], skip: bool) -> list[int]:
    """What the Lightning spectrum callback does: the loss of the batch's step, the weights after
    its optimizer step (the next batch's step)."""
    probes = []
    for step, after in itertools.pairwise(steps):
        if (
            skip
            and step in engine.schedule.between_probes
            and after in engine.schedule.between_probes
        ):
            assert not engine.schedule.is_probe_step(after), after
            if step in engine.schedule.quiet:
                assert not engine.wants_loss(step), step
            else:
                engine.observe_loss(step, float(step))
            continue
        engine.observe_loss(step, float(step))
        if after > 0 and engine.schedule.is_probe_step(after):
            engine.schedule.latest_step = after
            probes.append(after)
        engine.plan(after)
    return probes


def bound_spectrum(every: int, alerts) -> QKSpectrum:
    engine = QKSpectrum(every_n_steps=every, alerts=alerts)
    engine.bind(DecoderLM(TransformerConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2)))
    engine.open(0)  # the first batch: the bundled layers wait for no layout check
    engine.schedule.latest_step = 0  # the spectrum at initialization
    return engine


@pytest.mark.parametrize("every", [1, 7, 25, 50, 64])
@pytest.mark.parametrize("reads_loss", [True, False], ids=["loss rules", "no loss rule"])
@pytest.mark.parametrize("sequence", list(step_sequences()))
def test_a_skipped_batch_is_one_where_nothing_would_happen(every, reads_loss, sequence):
    steps = step_sequences()[sequence]
    alerts = None if reads_loss else []
    for make, host in (
        (lambda: AttentionEntropy(every_n_steps=every, alerts=alerts), activation_host),
        (lambda: bound_spectrum(every, alerts), spectrum_host),
    ):
        skipping, always = make(), make()
        assert skipping.alerting.reads_loss is reads_loss
        assert host(skipping, steps, skip=True) == host(always, steps, skip=False)
        assert skipping.alerting.loss_history() == always.alerting.loss_history()
        assert skipping.alerting.first_loss() == always.alerting.first_loss()


def test_every_50_steps_49_batches_of_50_open_nothing_and_29_keep_nothing():
    # the loss rules read the 20 steps before a probe and the probe's own; the run's first 10
    # losses are kept too
    engine = AttentionEntropy(every_n_steps=50)
    between, quiet = [], []
    for step in range(200):
        if step in engine.schedule.between_probes:
            between.append(step)
            quiet += [step] if step in engine.schedule.quiet else []
            continue
        probed = engine.schedule.is_probe_step(step)
        engine.observe_loss(step, 1.0)
        if probed:
            engine.schedule.latest_step = step
        engine.plan(step)
    assert between == [s for s in range(200) if s % 50]
    assert quiet == [s for s in range(200) if (10 if s < 50 else 1) <= s % 50 < 30]
    assert len(quiet) == 20 + 3 * 29


def test_a_resumed_or_new_run_is_not_quiet_on_the_old_runs_steps():
    engine = AttentionEntropy(every_n_steps=50)
    engine.schedule.latest_step = 100
    engine.plan(100)
    assert 110 in engine.schedule.quiet and 140 in engine.schedule.between_probes
    engine.load_state_dict({"latest_step": 0})  # resuming an earlier checkpoint
    assert 110 not in engine.schedule.between_probes and 110 not in engine.schedule.quiet
    engine.schedule.latest_step = 100
    engine.plan(100)
    engine.bind(DecoderLM(TransformerConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2)))
    assert 110 not in engine.schedule.between_probes  # a new fit starts at step 0 again
