"""Tensor parallelism's own hooks run out of the interceptor's sight (qkmonitor.attention.
parallel_hooks): a rank's probed forward hands the interceptor exactly the calls one process
computing the same heads hands it, and whatever the hooks take off the torch function mode stack
is back on it after a forward that raises, an interrupt, or another mode entered above.

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
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from qkmonitor.attention import capture_mode
from qkmonitor.attention.parallel_hooks import parallel_styled
from qkmonitor.engine import AttentionEntropy, Monitoring

HEADS, HEAD_DIM, WIDTH = 4, 8, 32


class Attention(nn.Module):
    """LLaMA-style: the head count read from the projection's output, as each TP rank does."""

    def __init__(self, heads: int, around_q: type[TorchFunctionMode] | None = None) -> None:
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, heads * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(WIDTH, heads * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(WIDTH, heads * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(heads * HEAD_DIM, WIDTH, bias=False)
        self.around_q = around_q  # a mode of the model's own around its query projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.around_q is not None:
            with self.around_q():
                q = self.q_proj(x)
        else:
            q = self.q_proj(x)
        q = q.view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class PassingMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


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


def parallelized(mesh, **kwargs) -> Attention:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = Attention(HEADS, **kwargs)
    plan = {p: ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    return parallelize_module(model, mesh, plan | {"o_proj": RowwiseParallel()})


@pytest.fixture
def seen(monkeypatch) -> list[int]:
    """``seen[0]``: the torch calls the interceptor has been handed (counting from 0)."""
    count = [0]
    handle = capture_mode.Interceptor.__torch_function__

    def counted(self, *args, **kwargs):
        count[0] += 1
        return handle(self, *args, **kwargs)

    monkeypatch.setattr(capture_mode.Interceptor, "__torch_function__", counted)
    return count


def hooks_on(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def probed_forward(model: nn.Module, seen: list[int]) -> int:
    """The calls the interceptor is handed in one probed forward and backward of ``model``."""
    monitoring = Monitoring(model, [AttentionEntropy(per_head=True)], every_n_steps=1)
    x = torch.randn(2, 6, WIDTH, generator=torch.Generator().manual_seed(0))
    seen[0] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fake all_gather leaves rank 1's heads unfilled
        with monitoring.step(0):
            model(x).sum().backward()
    return seen[0]


def test_a_tensor_parallel_forward_hands_the_interceptor_what_one_process_does(mesh, seen):
    sharded = parallelized(mesh)
    hooks = hooks_on(sharded)
    assert [type(m).__name__ for m in parallel_styled(sharded)] == ["Linear"] * 4
    one_process = Attention(HEADS // 2)  # this rank's 2 heads, unsplit
    calls = probed_forward(one_process, seen)
    assert calls > 0
    assert probed_forward(sharded, seen) == calls
    # the hooks that step around the parallel styles' are gone with the probe, the styles' stay
    assert hooks_on(sharded) == hooks > 0
    assert torch._C._len_torch_function_stack() == 0
    assert parallel_styled(one_process) == []  # a plain module's projections get nothing


def test_without_stepping_out_the_interceptor_sees_the_parallel_styles_calls(mesh, seen):
    """What the stepping out saves: the parallel styles' calls, which one process never makes."""
    from qkmonitor.attention import parallel_hooks

    sharded = parallelized(mesh)
    stepping = probed_forward(sharded, seen)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel_hooks, "parallel_styled", lambda module: [])
        assert probed_forward(sharded, seen) > stepping


class Refused(RuntimeError):
    pass


def failing_hook(error: BaseException):
    def hook(module, args):
        raise error

    return hook


@pytest.mark.parametrize("error", [Refused("a hook refuses"), KeyboardInterrupt()])
def test_a_hook_that_raises_leaves_the_stack_and_the_model_as_they_were(mesh, seen, error):
    """A hook of the projection raises where the interceptor is off the stack (after the first
    stepping hook, before the last): an ``Exception`` runs the always-call hook that puts it back;
    a ``KeyboardInterrupt`` skips it, and closing the probe puts it back. Either way the stack is
    empty after the probe, the model carries only its own hooks, and the next probe counts as
    before."""
    sharded = parallelized(mesh)
    before = probed_forward(sharded, seen)
    handle = sharded.q_proj.register_forward_pre_hook(failing_hook(error))
    hooks = hooks_on(sharded)
    monitoring = Monitoring(sharded, [AttentionEntropy(per_head=True)], every_n_steps=1)
    with pytest.raises(type(error)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with monitoring.step(0):
            sharded(torch.randn(2, 6, WIDTH))
    assert torch._C._len_torch_function_stack() == 0
    assert hooks_on(sharded) == hooks
    handle.remove()
    assert probed_forward(sharded, seen) == before


def test_a_mode_entered_above_the_interceptor_is_left_alone(mesh, seen):
    """The model enters a mode of its own around its query projection: the interceptor is then
    not on top, so the stepping hooks take nothing off; both modes are left as they were."""
    sharded = parallelized(mesh, around_q=PassingMode)
    one_process = Attention(HEADS // 2, around_q=PassingMode)
    assert probed_forward(sharded, seen) > probed_forward(one_process, seen)  # q's styles seen
    assert torch._C._len_torch_function_stack() == 0


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


#: how deep the thread is in the heads' exchange (:func:`exchanging`)
EXCHANGING = [0]


@pytest.fixture
def exchange_marked(monkeypatch) -> None:
    """The heads' exchange (``pack_heads`` and ``unpack_heads`` as the collective calls them)
    marked in :data:`EXCHANGING` while it runs."""
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


#: ops that move or relabel data without computing (views, copies, casts)
MOVES = {
    "_to_copy", "_unsafe_view", "alias", "as_strided", "clone", "copy_", "detach", "expand",
    "lift_fresh", "permute", "select", "slice", "split", "split_with_sizes", "squeeze", "t",
    "transpose", "unbind", "unsqueeze", "view",
}  # fmt: skip


def compute_ops(counted: Counter) -> Counter:
    """The ops that compute on more than a vector of per-head values: an input of 2 dims or more
    and 64 elements or more, and not a move (:data:`MOVES`)."""
    return Counter(
        {
            (name, shapes): n
            for (name, shapes), n in counted.items()
            if name.split(".")[1] not in MOVES
            and any(len(s) >= 2 and math.prod(s) >= 64 for s in shapes)
        }
    )


def step_ops(model: nn.Module, monitored: bool, steps: int = 2) -> Counter:
    """The ops of the last of ``steps`` training steps of ``model``, each a probe when
    ``monitored`` (every engine, per head)."""
    from qkmonitor.engine import EffectiveRank, QKSpectrum

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
