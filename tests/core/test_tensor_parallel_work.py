"""A rank's probe under tensor parallelism does the tensor work of one process computing the same
heads (issue 42, item 5: no more than the reference's probe plus one collective): every op that
computes on more than a vector of per-head values is the same op on the same shapes, the heads'
exchange for the one ``all_gather`` apart. Timing cannot tell a 1 % excess on this machine
(docs/benchmarks.md); this counts the work itself.

On torch's fake process group (one process posing as rank 0 of 2: no collective moves data); the
values, on two gloo ranks, are tests/distributed/test_tensor_parallel.py's."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum

HEADS, HEAD_DIM, WIDTH = 4, 8, 32


class Attention(nn.Module):
    """LLaMA-style: the head count read from the projection's output, as each TP rank does."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, heads * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(WIDTH, heads * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(WIDTH, heads * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(heads * HEAD_DIM, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


@pytest.fixture
def mesh():
    """A 1-D mesh of 2 tensor-parallel ranks, seen from rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def parallelized(mesh) -> Attention:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = Attention(HEADS)
    plan = {p: ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    return parallelize_module(model, mesh, plan | {"o_proj": RowwiseParallel()})


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


def step_ops(model: nn.Module, monitored: bool, steps: int = 2) -> Counter:
    """The ops of the last of ``steps`` training steps of ``model``, each a probe when
    ``monitored`` (every engine, per head)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engines = [QKSpectrum(per_head=True), AttentionEntropy(per_head=True), EffectiveRank()]
    monitoring = Monitoring(model, engines, every_n_steps=1, optimizer=optimizer)
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(2, 6, WIDTH, generator=generator)
        counted = CountedOps()
        with warnings.catch_warnings(), counted:
            warnings.simplefilter("ignore")  # the fake all_gather leaves rank 1's heads unfilled
            with monitoring.step(step) if monitored else contextlib.nullcontext():
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    return counted.ops


def test_a_tensor_parallel_probe_computes_what_one_process_of_its_heads_does(mesh, exchange_marked):
    """The probe's own compute (monitored less plain) on a rank is one process's of the same 2
    heads, op by op and shape by shape: no whole weight gathered, no other rank's head measured.
    What differs is the heads' exchange (apart), moves and vectors of per-head values."""

    def probe_ops(make) -> Counter:
        torch.manual_seed(0)
        plain = step_ops(make(), monitored=False)
        torch.manual_seed(0)
        return compute_ops(step_ops(make(), monitored=True)) - compute_ops(plain)

    sharded = probe_ops(lambda: parallelized(mesh))
    one_process = probe_ops(lambda: Attention(HEADS // 2))
    assert sum(one_process.values()) > 20  # the spectrum's, the kernel's, the ranks' products
    assert sharded == one_process


def test_what_else_a_tensor_parallel_probe_runs_is_moves(mesh, exchange_marked):
    """Beside that compute, the same ops by name (on vectors of 4 heads instead of 2: each rank
    keeps every head's tables), but moves (the local shards' views) and the exchange."""

    def probe_ops(make) -> Counter:
        torch.manual_seed(0)
        plain = step_ops(make(), monitored=False)
        torch.manual_seed(0)
        ops = step_ops(make(), monitored=True) - plain
        return Counter(name for (name, _), n in ops.items() for _ in range(n) if not moved(name))

    assert probe_ops(lambda: parallelized(mesh)) == probe_ops(lambda: Attention(HEADS // 2))
