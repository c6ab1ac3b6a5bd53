"""``benchmarks/overhead.py``'s accounting, from known hook times (nothing trained): a batch's hook
time belongs to that batch in the run's order, also in a second epoch (where Lightning's
``batch_idx`` starts again at 0), and the hooks' figure is their mean over untouched batches."""

from __future__ import annotations

import math

import pytest
import torch


@pytest.fixture(scope="module")
def overhead(benchmark_module):
    return benchmark_module("overhead")


class Sleeper:
    """A monitor whose hooks take a known time: ``seconds[i]`` at the run's i-th batch (made
    measurable by a fake clock)."""

    def __init__(self, clock, seconds) -> None:
        self.clock, self.seconds = clock, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.now += self.seconds[len(self.clock.marks) - 1]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pass


def test_hook_times_go_to_the_batch_in_the_runs_order_across_epochs(overhead, monkeypatch):
    clock = overhead.Clock()
    clock.now = 0.0
    monkeypatch.setattr(overhead.time, "perf_counter", lambda: clock.now)
    epoch, every = 7, 5
    seconds = [float(i + 1) for i in range(2 * epoch)]
    monitor = Sleeper(clock, seconds)
    timer = clock.hooks = overhead.HookTimer([monitor], clock)  # as `run` attaches it
    for batch_idx in [*range(epoch), *range(epoch)]:  # two epochs
        clock.on_train_batch_start(None, _Module(), None, batch_idx)
        monitor.on_train_batch_start(None, None, None, batch_idx)
        monitor.on_train_batch_end(None, None, None, None, batch_idx)
    assert timer.seconds == {i: s for i, s in enumerate(seconds)}
    untouched = [s for i, s in enumerate(seconds) if i and not overhead.touched(i, every)]
    assert overhead.hooks_untouched(clock, every) == pytest.approx(sum(untouched) / len(untouched))


class _Module:
    def parameters(self):
        return iter([torch.zeros(1)])


def test_paired_figures_from_known_step_times(overhead):
    """Two copies' per-step times: the plain copy at 10 ms a step, drifting by interval (the
    machine), the monitored one 1 % slower on unprobed steps, with a probe of +5 ms at each
    multiple of 10 and +40 ms more at step 0 (a first probe's one-time work)."""
    every, intervals = 10, 6
    drift = [1.0, 1.3, 0.8, 1.1, 0.9, 1.2]
    plain = [0.010 * drift[i // every] for i in range(every * intervals)]
    monitored = [
        t * 1.01 + (0.005 if i % every == 0 else 0.0) + (0.040 if i == 0 else 0.0)
        for i, t in enumerate(plain)
    ]
    f = overhead.paired_figures(plain, monitored, every)
    expected = sorted(
        (sum(monitored[k : k + every]) / sum(plain[k : k + every]) - 1)
        for k in range(every, every * intervals, every)
    )
    assert f["intervals"] == intervals - 1
    assert f["interval_median"] == pytest.approx(expected[2])
    assert f["interval_low"] == pytest.approx(expected[0] + 0.2 * (expected[1] - expected[0]))
    assert f["interval_high"] == pytest.approx(expected[3] + 0.8 * (expected[4] - expected[3]))
    # each interval: 1 % of its steps plus the probe's 5 ms; the median one is the 1.1 interval
    assert f["interval_excess_s"] == pytest.approx(0.01 * 0.010 * 1.1 * every + 0.005)
    assert f["first_interval_extra_s"] == pytest.approx(
        0.01 * 0.010 * every + 0.005 + 0.040 - f["interval_excess_s"]
    )
    assert f["unprobed_overhead"] == pytest.approx(0.01)
    # where an interval's excess lies: the probe's 5 ms and 1 % of its two touched steps, 1 % of
    # the 3 after, 1 % of the 5 others (the median interval's, the drift-1.1 one)
    step = 0.010 * 1.1
    assert f["probed_excess_s"] == pytest.approx(0.005 + 0.01 * step * 2)
    assert f["spill_excess_s"] == pytest.approx(0.01 * step * 3)
    assert f["rest_excess_s"] == pytest.approx(0.01 * step * 5)
    # the 90 % interval of the median lies within the intervals' range, around the median
    assert (
        expected[0] <= f["median_low"] <= f["interval_median"] <= f["median_high"] <= expected[-1]
    )
    with pytest.raises(ValueError, match="at least two whole probe intervals of 10 steps"):
        overhead.paired_figures(plain[:15], monitored[:15], every)


def test_paired_figures_of_identical_intervals_have_a_point_interval(overhead):
    """Every interval the same ratio: the median's interval is that ratio; at every step there is
    no unprobed step."""
    plain = [0.010] * 40
    monitored = [0.0103] * 40
    f = overhead.paired_figures(plain, monitored, 1)
    assert f["median_low"] == pytest.approx(0.03) == f["median_high"]
    assert f["intervals"] == 39 and math.isnan(f["unprobed_overhead"])


def test_a_baton_gives_each_arm_its_turns_in_alternating_order(overhead):
    """Pair p of turns: arm p % 2 first. Two threads taking turns record 0 1 1 0 0 1 ..."""
    import threading

    baton, order = overhead.Baton(), []

    def arm(index: int) -> None:
        for _ in range(4):
            baton.wait(index)
            order.append(index)
            baton.pass_on(index)
        baton.pass_on(index, done=True)

    threads = [threading.Thread(target=arm, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert order == [0, 1, 1, 0, 0, 1, 1, 0]


def test_parts_times_every_part_of_the_readme_configuration(overhead, monkeypatch):
    """``--parts --readme`` on the nanoGPT-style model (its attention intercepted): every part of
    :data:`PARTS` still exists and is called in the windows (a renamed function would leave a
    part at zero calls), the timers are removed afterwards, and a window's parts, at their median
    call, add up to less than its steps took (the mean over windows also holds the first call's
    costs, such as an import the process has not made yet: 105 ms once in CI against a 35 ms
    step)."""
    import argparse

    import qkmonitor.attention.calls

    original = qkmonitor.attention.calls.MaskedCall._stats
    args = argparse.Namespace(model="default", arch="nanogpt", steps=6, every=3, readme=True,
                              three=False, rank_every=None, device="cpu",
                              precision="32-true")  # fmt: skip
    timed, step = overhead.parts(args)
    assert qkmonitor.attention.calls.MaskedCall._stats is original
    assert set(timed) == {name for _, name in overhead.PARTS}
    for name, (median, per_window, window) in timed.items():
        assert per_window > 0 and median > 0, name
        assert median * per_window < 3 * step, name
