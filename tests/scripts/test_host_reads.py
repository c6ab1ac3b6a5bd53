"""benchmarks/host_reads.py: the training thread's blocking reads, counted on a CPU.

The counter is checked against calls whose kind is known (each read once, and work that reads
nothing); then the plain loop's steps are counted: an unprobed step makes no read of the monitor's,
and a probed step makes no more than today's baseline (issue 60's target is at most one a probe per
engine; lower the baselines as the probe leaves the training path)."""

from __future__ import annotations

import threading

import pytest
import torch

#: The monitor's reads of one probed step today (2 layers of 4 heads, plain loop), per engine set
#: and model: what `python benchmarks/host_reads.py` prints on 2026-12-07 (qkmonitor's reads; the
#: model's and the optimizer's are not counted). The step before a probe (the spectrum's snapshot
#: of the rows the update moves) makes 18 with the spectrum on, none without.
PROBED_BASELINE = {
    ("bundled", "spectrum"): 79,
    ("bundled", "entropy"): 63,
    ("bundled", "rank"): 55,
    ("bundled", "spectrum+entropy+rank"): 185,
    ("nanogpt", "spectrum+entropy+rank"): 177,
}
BEFORE_PROBE_BASELINE = 18
#: The same with the paths a GPU run takes (``--gpu-paths``: the spectrum on its worker, a
#: probe's values read in one transfer a device): what a GPU's training thread would wait for.
GPU_PATHS_BASELINE = {
    ("bundled", "spectrum+entropy+rank"): 101,
    ("nanogpt", "spectrum+entropy+rank"): 93,
}
EVERY = 4


@pytest.fixture(scope="module")
def host_reads(benchmark_module):
    return benchmark_module("host_reads")


def test_each_kind_of_read_is_counted_once(host_reads):
    x = torch.randn(6)
    mask = x > 0
    reads_of = {
        "item": lambda: x[0].item(),
        "tolist": lambda: x.tolist(),
        "numpy": lambda: x.numpy(),
        "cpu": lambda: x.cpu(),
        "to_cpu": lambda: x.to("cpu"),
        "bool": lambda: bool(x[0] > 0),
        "float": lambda: float(x[0]),
        "int": lambda: int(x[0]),
        "index": lambda: [0, 1][torch.tensor(1)],
        "format": lambda: f"{x[0]:.3f}",
        "repr": lambda: repr(x),
        "equal": lambda: torch.equal(x, x),
        "allclose": lambda: torch.allclose(x, x),
        "nonzero": lambda: x.nonzero(),
        "argwhere": lambda: torch.argwhere(x),
        "masked_select": lambda: torch.masked_select(x, mask),
        "unique": lambda: torch.unique(x),
        "bincount": lambda: torch.bincount(torch.tensor([0, 2])),
        "where": lambda: torch.where(mask),
        "repeat_interleave": lambda: x.repeat_interleave(torch.ones(6, dtype=torch.long)),
        "bool_index": lambda: x[mask],
    }
    for kind, read in reads_of.items():
        with host_reads.HostReads() as reads:
            read()
        assert reads.kinds[kind] >= 1, (kind, reads.kinds)
        others = {k: n for k, n in reads.kinds.items() if k != kind}
        assert reads.kinds[kind] == 1 or kind in ("repr", "format"), (kind, reads.kinds)
        assert kind in ("repr", "format") or not others, (kind, others)


def test_work_that_reads_nothing_counts_nothing(host_reads):
    x = torch.randn(4, 8, requires_grad=True)
    with host_reads.HostReads() as reads:
        y = (x @ x.T).softmax(-1)
        z = torch.where(y > 0.5, y, 0.0).sum() + x[torch.tensor([0, 2])].sum()
        z.backward()
        x.to(torch.float64).to("meta")
        torch.arange(3).repeat_interleave(2)
    assert reads.total == 0, reads.kinds


def test_other_threads_are_not_counted(host_reads):
    x = torch.randn(3)
    with host_reads.HostReads() as reads:
        worker = threading.Thread(target=lambda: x.tolist())
        worker.start()
        worker.join()
    assert reads.total == 0


def test_reads_are_attributed_to_the_package(host_reads):
    from qkmonitor.measures import ranks

    with host_reads.HostReads(owner="qkmonitor", by_site=True) as reads:
        torch.randn(3).tolist()  # this test's: "other"
        ranks.gram_singular_values(torch.randn(2, 4, 4))
    assert reads.sites["other (tolist)"] == 1
    assert reads.owned == reads.total - 1


@pytest.mark.parametrize("arch, engines", sorted(PROBED_BASELINE))
def test_plain_loop_reads_against_the_baseline(host_reads, arch, engines):
    steps = host_reads.reads_of_steps(arch, engines.split("+"), every=EVERY, steps=2 * EVERY)
    unprobed = [r.owned for i, r in enumerate(steps) if 0 < i % EVERY < EVERY - 1]
    assert unprobed and max(unprobed) == 0, unprobed  # an unprobed step reads nothing of ours
    before = steps[EVERY - 1].owned
    assert before <= (BEFORE_PROBE_BASELINE if "spectrum" in engines else 0), before
    probed = steps[EVERY].owned
    assert 0 < probed <= PROBED_BASELINE[arch, engines], (probed, steps[EVERY].kinds)


@pytest.mark.parametrize("arch, engines", sorted(GPU_PATHS_BASELINE))
def test_the_gpu_paths_read_less_than_the_cpu_paths(host_reads, arch, engines):
    steps = host_reads.reads_of_steps(
        arch, engines.split("+"), every=EVERY, steps=EVERY + 1, gpu_paths=True
    )
    probed = steps[EVERY].owned
    assert 0 < probed <= GPU_PATHS_BASELINE[arch, engines] < PROBED_BASELINE[arch, engines]
    assert max(r.owned for i, r in enumerate(steps) if 0 < i < EVERY - 1) == 0
