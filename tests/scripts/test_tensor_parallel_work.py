"""``benchmarks/tensor_parallel.py``'s model, counted rather than timed: a rank's probe under tensor
parallelism does the tensor work of one process computing the same heads (issue 42, item 5: no
more than the reference's probe plus one collective). Every op that computes on more than a
vector of per-head values is the same op on the same shapes, the heads' exchange for the one
``all_gather`` apart. Timing cannot tell a 1 % excess on this machine (docs/benchmarks.md); this
counts the work itself.

On torch's fake process group (one process posing as rank 0 of 2), as
``benchmarks/tensor_parallel_one_rank.py`` times it; the values, on two gloo ranks, are
tests/distributed/test_tensor_parallel.py's."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from tests.parallel_api import FAKE_GROUP_QUIET, needs_torch


@pytest.fixture
def fake_group():
    """Torch's fake process group of 2 ranks, seen from rank 0 (no collective moves data)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def copies(benchmark_module, fake_group):
    """``copies(split)``: a fresh copy of ``benchmarks/tensor_parallel.py``'s model at a small
    size, seeded alike: under TP (``split``: 4 heads, 2 on this rank) or the reference the bound
    names (its 2 heads, half the MLP, unsplit), and a batch for it."""
    needs_torch("2.9", FAKE_GROUP_QUIET)
    bench = benchmark_module("tensor_parallel")
    size = bench.Size(layers=2, d_model=32, heads=4, head_dim=8, hidden=64, seq_len=6, batch=2)

    def make(split: bool):
        torch.manual_seed(0)
        heads, hidden = (size.heads, size.hidden) if split else (size.heads // 2, size.hidden // 2)
        model = bench.Model(size, heads, hidden)
        if split:
            bench.parallelize(model)
        tokens = torch.randint(bench.VOCAB, (size.batch, size.seq_len + 1))
        return model, tokens, bench.VOCAB

    return make


class CountedOps(TorchDispatchMode):
    """The aten ops run below it, by name and input shapes, but those of the heads' exchange
    (packing the split heads' values for the one ``all_gather`` and placing them back from it:
    ``EXCHANGING``), counted apart."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, tuple]] = Counter()
        self.exchange: Counter[tuple[str, tuple]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        (self.exchange if EXCHANGING[0] else self.ops)[str(func), shapes] += 1
        return func(*args, **(kwargs or {}))


#: how deep the thread is in the heads' exchange (:func:`exchange_marked`)
EXCHANGING = [0]


@pytest.fixture
def exchange_marked(monkeypatch) -> None:
    """The heads' exchange marked in :data:`EXCHANGING` while it runs: the spectrum's heads put
    side by side and back in their tables (``SpectrumRead.parts``, ``.merge``), packed and placed
    back from the gathered packs (``pack_heads``, ``unpack_heads`` as the collective calls them)."""
    from qkmonitor.engine.spectrum_read import SpectrumRead
    from qkmonitor.measures import metrics

    def marked(function):
        def run(*args, **kwargs):
            EXCHANGING[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                EXCHANGING[0] -= 1

        return run

    for name in ("pack_heads", "unpack_heads"):
        monkeypatch.setattr(metrics, name, marked(getattr(metrics, name)))
    for name in ("parts", "merge"):
        monkeypatch.setattr(SpectrumRead, name, marked(getattr(SpectrumRead, name)))


#: ops that move or relabel data without computing (views, copies, casts)
MOVES = {
    "_to_copy", "_unsafe_view", "alias", "as_strided", "clone", "copy_", "detach", "expand",
    "lift_fresh", "permute", "select", "slice", "split", "split_with_sizes", "squeeze", "t",
    "transpose", "unbind", "unsqueeze", "view",
}  # fmt: skip


def moved(name: str) -> bool:
    """Whether the aten op ``name`` (``aten.view.default``) is a move (:data:`MOVES`)."""
    return name.split(".")[1] in MOVES


def compute_ops(counted: Counter) -> Counter:
    """The ops that compute on more than a vector of per-head values: an input of 2 dims or more
    and 64 elements or more, and not a move (:data:`MOVES`)."""
    return Counter(
        {
            (name, shapes): n
            for (name, shapes), n in counted.items()
            if not moved(name) and any(len(s) >= 2 and math.prod(s) >= 64 for s in shapes)
        }
    )


def step_ops(copy, monitored: bool, steps: int = 2) -> Counter:
    """The ops of the last of ``steps`` training steps of ``copy`` (model, tokens, vocabulary),
    each a probe when ``monitored`` (every engine, per head)."""
    model, tokens, vocab = copy
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engines = [QKSpectrum(per_head=True), AttentionEntropy(per_head=True), EffectiveRank()]
    monitoring = Monitoring(model, engines, every_n_steps=1, optimizer=optimizer)
    for step in range(steps):
        counted = CountedOps()
        with warnings.catch_warnings(), counted:
            warnings.simplefilter("ignore")  # the fake all_gather leaves rank 1's heads unfilled
            with monitoring.step(step) if monitored else contextlib.nullcontext():
                logits = model(tokens[:, :-1])
                F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
                optimizer.step()
                optimizer.zero_grad()
    return counted.ops


def test_a_tensor_parallel_probe_computes_what_one_process_of_its_heads_does(
    copies, exchange_marked
):
    """The probe's own compute (monitored less plain) on a rank is one process's of the same 2
    heads, op by op and shape by shape: no whole weight gathered, no other rank's head measured.
    What differs is the heads' exchange (apart), moves and vectors of per-head values."""

    def probe_ops(split: bool) -> Counter:
        plain = step_ops(copies(split), monitored=False)
        return compute_ops(step_ops(copies(split), monitored=True)) - compute_ops(plain)

    sharded, one_process = probe_ops(True), probe_ops(False)
    assert sum(one_process.values()) > 20  # the spectrum's, the kernel's, the ranks' products
    assert sharded == one_process


def test_what_else_a_tensor_parallel_probe_runs_is_moves(copies, exchange_marked):
    """Beside that compute, the same ops by name (on vectors of 4 heads instead of 2: each rank
    keeps every head's tables), but moves (the local shards' views) and the exchange."""

    def probe_ops(split: bool) -> Counter:
        ops = step_ops(copies(split), monitored=True) - step_ops(copies(split), monitored=False)
        return Counter(name for (name, _), n in ops.items() for _ in range(n) if not moved(name))

    assert probe_ops(True) == probe_ops(False)
