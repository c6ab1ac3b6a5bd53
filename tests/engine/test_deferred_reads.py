"""A probe's values logged at the end of the next batch (``defer_reads=True``, the default on a
GPU): the same values, alerts and states as logging them at the probe, bit for bit, a batch later;
waited for when the next step fails, at the run's end and before a checkpoint's state."""

from __future__ import annotations

import struct
import warnings

import pytest
import torch

from qkmonitor import OverLocalizationWarning
from qkmonitor.alerts import AlertRule
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, MonitorOptions, QKSpectrum
from qkmonitor.engine.reading import defers, start_reading
from qkmonitor.output.sinks import MemorySink

from .tiny import TOKENS, decoder, first_raised

#: fires on every head at every probe: what alerts a probe gives, and when
ANY_KAPPA = AlertRule(name="any_kappa", metric="kappa", threshold=0.0, above=True, patience=1,
                      margin=0.0, warning=OverLocalizationWarning, meaning="test",
                      advice="test")  # fmt: skip


#: the same for the attention entropy (never negative)
ANY_ENTROPY = AlertRule(name="any_entropy", metric="entropy", threshold=0.0, above=True,
                        patience=1, margin=0.0, warning=OverLocalizationWarning, meaning="test",
                        advice="test")  # fmt: skip


def engines(defer: bool, action: str = "warn") -> list:
    """The three engines, every head logged, with ``defer_reads=defer`` (the spectrum and the
    entropy with a rule that fires at every probe)."""
    shared = {"per_head": True, "defer_reads": defer, "visuals_every_n_probes": 1}
    return [
        QKSpectrum(alerts=[ANY_KAPPA], alert_action=action, **shared),
        AttentionEntropy(alerts=[ANY_ENTROPY], alert_action=action, **shared),
        EffectiveRank(max_probe_tokens=8, **shared),
    ]


def plain_loop(defer: bool, steps: int = 6, fail_at: int | None = None, action: str = "warn"):
    """A plain AdamW loop over ``decoder()`` probed every 2 steps, step ``fail_at`` raising after
    its forward; returns (sink, engines, the warnings' texts)."""
    model = decoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    sink, watched = MemorySink(), engines(defer, action)
    monitoring = Monitoring(model, watched, writer=sink, every_n_steps=2, optimizer=optimizer)
    with warnings.catch_warnings(record=True) as caught, monitoring:
        warnings.simplefilter("always")
        for step in range(steps):
            try:
                with monitoring.step(step):
                    loss = model(TOKENS).logsumexp(-1).mean()
                    monitoring.observe_loss(loss)
                    if step == fail_at:
                        raise RuntimeError("a failing step")
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
            except RuntimeError:
                break
    return sink, watched, [str(w.message) for w in caught]


def logged(sink: MemorySink) -> list[tuple[int, str, bytes]]:
    """The scalars as (step, tag, the value's bits), sorted (NaN equals itself there)."""
    return sorted((step, tag, struct.pack("<d", value)) for tag, value, step in sink.scalars)


def test_deferred_probes_log_what_immediate_ones_do_bit_for_bit():
    now, now_engines, now_said = plain_loop(False)
    later, later_engines, later_said = plain_loop(True)
    assert logged(later) == logged(now)
    assert {step for step, _, _ in logged(now)} == {0, 2, 4}
    assert sorted(later.texts) == sorted(now.texts) and now.texts  # the alerts, at their steps
    assert sorted(later_said) == sorted(now_said)
    assert [(tag, step) for tag, _, step in later.images] == [
        (tag, step) for tag, _, step in now.images
    ]
    for a, b in zip(later_engines, now_engines):
        assert a.latest_at == b.latest_at == 4
        for name in b.latest:
            for x, y in zip(a.latest[name], b.latest[name]):
                assert x.dtype == y.dtype and x.device.type == "cpu"
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def test_a_deferred_alert_comes_at_the_next_step_end_and_names_its_probe_step():
    raised = {
        defer: first_raised(
            [AttentionEntropy(alerts=[ANY_ENTROPY], alert_action="raise", defer_reads=defer)],
            OverLocalizationWarning,
        )
        for defer in (False, True)
    }
    # step 0's forward is probed: logged at once at step 0's end, or, deferred, at step 1's; the
    # alert names step 0 either way (a read of the weights at a step's start is logged at its end)
    assert raised[False][0] == 0 and raised[True][0] == 1
    assert "at step 0" in raised[True][1] and raised[True][1] == raised[False][1]


def test_a_deferred_probe_is_logged_when_the_next_step_fails():
    now, _, _ = plain_loop(False, fail_at=3)
    later, watched, said = plain_loop(True, fail_at=3)
    assert {step for step, _, _ in logged(later)} == {0, 2}  # step 2's, logged at the run's end
    assert logged(later) == logged(now)
    assert all(not engine._readings for engine in watched)
    assert not [s for s in said if "failed" in s], said


def test_a_state_taken_with_a_probe_deferred_holds_it():
    states = {}
    for defer in (False, True):
        model = decoder()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        watched = engines(defer)
        monitoring = Monitoring(model, watched, every_n_steps=2, optimizer=optimizer)
        with monitoring:
            for step in range(3):
                with monitoring.step(step):
                    model(TOKENS).logsumexp(-1).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            # step 2 probed, its values on their way: a checkpoint here takes them in
            states[defer] = repr([engine.state_dict() for engine in watched])
            assert all(not engine._readings for engine in watched)
    assert states[True] == states[False]


def test_the_choice_is_by_device_unless_the_user_says():
    reading = start_reading(0, {"kappa": [torch.zeros(2)]})
    assert not reading.on_device and not defers(None, reading)
    assert defers(True, reading) and not defers(False, reading)
    with pytest.raises(ValueError, match="Expected `defer_reads` to be a bool"):
        MonitorOptions(defer_reads="yes")


def test_a_reading_gives_every_tensor_back_on_the_host_exactly():
    gen = torch.Generator().manual_seed(0)
    values = {"kappa": [torch.rand(4, generator=gen), [0.5, 0.25]], "x": [torch.rand(1).double()]}
    undefined = {"kappa": [torch.tensor([True, False, False, True]), [False, False]]}
    notes = {"kappa": [torch.tensor(False), torch.tensor(True)]}
    losses = [(0, torch.tensor(2.5)), (1, torch.tensor(2.25, dtype=torch.bfloat16))]
    reading = start_reading(
        3, values, undefined=undefined, notes=notes, run_values={"r": torch.tensor([7.0])},
        losses=losses,
    )  # fmt: skip
    values["kappa"][0].zero_()  # the copy was taken at the start
    read = reading.read()
    assert read.rows["kappa"][1] == [0.5, 0.25] and read.rows["x"][0][0] == values["x"][0].item()
    assert read.values["x"][0].dtype == torch.float64
    assert read.undefined["kappa"] == [[True, False, False, True], [False, False]]
    assert read.noted == {"kappa": [1]} and read.run_values == {"r": 7.0}
    assert read.losses == [2.5, 2.25]
    assert read.rows["kappa"][0] != [0.0] * 4


def test_values_that_never_crossed_the_ranks_are_said_when_a_failed_run_drops_them():
    from qkmonitor.engine.group import EngineGroup
    from qkmonitor.engine.host import Host

    class Waiting(QKSpectrum):  # a read of heads split across ranks, waiting for the exchange
        def __init__(self):
            super().__init__()
            self.waiting = [(4, []), (6, [])]

        def exchange_parts(self):
            return self.waiting

        def drop_exchanges(self):
            self.waiting = []

    engine = Waiting()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        EngineGroup([engine]).end(Host(), completed=False)
        EngineGroup([engine]).end(Host(), completed=False)  # nothing left: nothing said
    said = [str(w.message) for w in caught if "crossed the ranks" in str(w.message)]
    assert len(said) == 1 and "step(s) [4, 6]" in said[0] and not engine.waiting
