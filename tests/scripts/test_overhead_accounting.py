"""``benchmarks/overhead.py``'s accounting, from known hook times (nothing trained): a batch's hook
time belongs to that batch in the run's order, also in a second epoch (where Lightning's
``batch_idx`` starts again at 0), and the hooks' figure is their mean over untouched batches."""

from __future__ import annotations

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
