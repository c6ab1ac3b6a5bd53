"""benchmarks/host_reads.py: the training thread's blocking reads, counted on a CPU.

The counter is checked against calls whose kind is known (each read once, and work that reads
nothing); then the plain loop's steps are counted: an unprobed step makes no read of the monitor's,
and a probed step makes no more than today's baseline (issue 60's target is at most one a probe per
engine; lower the baselines as the probe leaves the training path)."""

from __future__ import annotations

import threading

import pytest
import torch

#: The monitor's reads of one probed step on a CPU's own paths (2 layers of 4 heads, plain loop),
#: per engine set and model: what `python benchmarks/host_reads.py` prints on 2026-12-07
#: (qkmonitor's reads; the model's and the optimizer's are not counted). A probe's values cross
#: in one copy an engine; the spectrum's eigenproblems go to the host on the CPU path (10 more:
#: a CPU tensor's ``.cpu()`` is itself, so what is read of it after counts again), the attention
#: rank trims its keys there (3). The day before: 79, 63, 55, 185 and 177.
PROBED_BASELINE = {
    ("bundled", "spectrum"): 12,
    ("bundled", "entropy"): 1,
    ("bundled", "rank"): 4,
    ("bundled", "spectrum+entropy+rank"): 17,
    ("nanogpt", "spectrum+entropy+rank"): 17,
}
#: The step before a probe (the spectrum's snapshot of the rows the update moves) reads nothing
#: (18 the day before).
BEFORE_PROBE_BASELINE = 0
#: The engine sets counted on the paths a GPU run takes (``--gpu-paths``: the spectrum on its
#: worker, each probe logged at the next step), where a probe may read at most once an engine
#: (issue 60), over the probe's step and the next (where its values are logged): 101 and 93
#: reads at the probe step the day before.
GPU_PATHS = [("bundled", "spectrum+entropy+rank"), ("nanogpt", "spectrum+entropy+rank")]
EVERY = 4


@pytest.fixture(scope="module")
def host_reads(benchmark_module):
    return benchmark_module("host_reads")


def test_each_kind_of_read_is_counted_once(host_reads):
    x = torch.randn(6)  # made before the mode: device tensors (a model's) to it
    mask, counts, repeats = x > 0, torch.tensor([1, 2]), torch.ones(6, dtype=torch.long)
    reads_of = {
        "item": lambda: x[0].item(),
        "tolist": lambda: x.tolist(),
        "numpy": lambda: x.numpy(),
        "cpu": lambda: x.cpu(),
        "to_cpu": lambda: x.to("cpu"),
        "bool": lambda: bool(x[0] > 0),
        "float": lambda: float(x[0]),
        "int": lambda: int(x[0]),
        "index": lambda: [0, 1][counts[0] - 1],
        "format": lambda: f"{x[0]:.3f}",
        "repr": lambda: repr(x),
        "equal": lambda: torch.equal(x, x),
        "allclose": lambda: torch.allclose(x, x),
        "nonzero": lambda: x.nonzero(),
        "argwhere": lambda: torch.argwhere(x),
        "masked_select": lambda: torch.masked_select(x, mask),
        "unique": lambda: torch.unique(x),
        "bincount": lambda: torch.bincount(counts),
        "where": lambda: torch.where(mask),
        "repeat_interleave": lambda: x.repeat_interleave(repeats),
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


def test_host_tensors_are_told_from_device_tensors(host_reads):
    """Tensors made from Python values without a device, copied to the host, or computed from
    those alone are host tensors in any run: reading them waits for nothing. A factory told a
    device, and anything computed from a tensor made before the mode, may be on a device."""
    x = torch.randn(5)  # a model's tensor
    with host_reads.HostReads() as host:
        made = torch.tensor([1.0, 2.0])
        (made * 2 + torch.full((2,), 3.0)).tolist()
        float(made.sum())
        copied = x.to("cpu", copy=True)  # (x.cpu() is x itself on a CPU: a device tensor still)
        copied.tolist()  # the copy was counted once; reading it is free
        (copied[:2] + made).max().item()
    assert host.total == 1 and host.kinds == {"to_cpu": 1}, host.kinds
    with host_reads.HostReads() as device:
        (x + torch.tensor(1.0)).tolist()
        torch.zeros(2, device=x.device).tolist()
        torch.tensor([1.0], device=x.device).item()
    assert device.kinds == {"tolist": 2, "item": 1}, device.kinds


def test_other_threads_are_not_counted(host_reads):
    x = torch.randn(3)
    with host_reads.HostReads() as reads:
        worker = threading.Thread(target=lambda: x.tolist())
        worker.start()
        worker.join()
    assert reads.total == 0


def test_reads_are_attributed_to_the_package(host_reads):
    from qkmonitor.measures import ranks

    x, grams = torch.randn(3), torch.randn(2, 4, 4)  # device tensors to the mode
    with host_reads.HostReads(owner="qkmonitor", by_site=True) as reads:
        x.tolist()  # this test's: "other"
        ranks.gram_singular_values(grams)
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


@pytest.mark.parametrize("arch, engines", GPU_PATHS)
def test_on_the_gpu_paths_a_probe_reads_once_an_engine(host_reads, arch, engines):
    names = engines.split("+")
    steps = host_reads.reads_of_steps(arch, names, every=EVERY, steps=2 * EVERY, gpu_paths=True)
    probe = steps[EVERY].owned + steps[EVERY + 1].owned  # the probe, and where it is logged
    assert 0 < probe <= len(names), [(r.owned, r.kinds) for r in steps]
    assert steps[EVERY - 1].owned == 0  # the step before: the snapshot stays on the device
    quiet = [r.owned for i, r in enumerate(steps) if i not in (0, 1, EVERY - 1, EVERY, EVERY + 1)]
    assert quiet and max(quiet) == 0, quiet
