"""Tensor parallelism's own hooks run out of the interceptor's sight (qkmonitor.attention.
parallel_hooks): a rank's probed forward hands the interceptor exactly the calls one process
computing the same heads hands it; the model's hooks are its own again after the probe, also
after a hook that raises (an ``Exception`` or a ``KeyboardInterrupt``), and a hook the model
replaced during the probe stays replaced; a mode of the model's own above the interceptor is left
alone; the probe leaves nothing of qkmonitor's in reference cycles.

On torch's fake process group (one process posing as rank 0 of 2: no collective moves data); the
values, on two gloo ranks, are tests/distributed/test_tensor_parallel.py's."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from qkmonitor.attention import capture_mode, parallel_hooks
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


def hooks_of(model: nn.Module) -> list[tuple[str, str, int, object]]:
    """Every forward pre-hook and forward hook of ``model``'s submodules (the projections; the
    probe's own are on the attention module), by module, kind and key: the objects themselves,
    so that a wrapper left in place shows."""
    return [
        (name, kind, key, hook)
        for name, module in model.named_modules()
        if name
        for kind, hooks in (("pre", module._forward_pre_hooks), ("post", module._forward_hooks))
        for key, hook in hooks.items()
    ]


def styles_of(model: nn.Module) -> list[tuple[str, str, int, object]]:
    """:func:`hooks_of` those torch's distributed package defined (the parallel styles'), or
    that say so (their wrappers): not the probe's own hooks on the projections."""
    return [h for h in hooks_of(model) if h[3].__module__.startswith("torch.distributed.")]


def probed(model: nn.Module, seen: list[int], *, during=None) -> int:
    """The calls the interceptor is handed in one probed forward and backward of ``model``
    (``during(model)`` called inside the probe, before the forward)."""
    monitoring = Monitoring(model, [AttentionEntropy(per_head=True)], every_n_steps=1)
    x = torch.randn(2, 6, WIDTH, generator=torch.Generator().manual_seed(0))
    seen[0] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fake all_gather leaves rank 1's heads unfilled
        with monitoring.step(0):
            if during is not None:
                during(model)
            model(x).sum().backward()
    return seen[0]


def test_a_tensor_parallel_forward_hands_the_interceptor_what_one_process_does(mesh, seen):
    sharded = parallelized(mesh)
    hooks = hooks_of(sharded)
    assert len(hooks) == 8  # the parallel styles': an input and an output hook a projection
    one_process = Attention(HEADS // 2)  # this rank's 2 heads, unsplit
    calls = probed(one_process, seen)
    assert calls > 0
    assert probed(sharded, seen) == calls
    assert hooks_of(sharded) == hooks  # the styles' own hook objects back, in their order
    assert torch._C._len_torch_function_stack() == 0
    assert probed(sharded, seen) == calls  # the kept swaps serve the next probe alike


def test_during_the_probe_the_styles_hooks_are_wrapped_and_call_the_originals(mesh, seen):
    sharded = parallelized(mesh)
    originals = hooks_of(sharded)
    inside = []
    probed(sharded, seen, during=lambda model: inside.extend(styles_of(model)))
    assert [h[:3] for h in inside] == [h[:3] for h in originals]  # same keys, same order
    for (*_, wrapper), (*_, hook) in zip(inside, originals, strict=True):
        assert wrapper is not hook and wrapper.__wrapped__ is hook


def test_without_stepping_out_the_interceptor_sees_the_parallel_styles_calls(mesh, seen):
    """What the stepping out saves: the parallel styles' calls, which one process never makes."""
    sharded = parallelized(mesh)
    stepping = probed(sharded, seen)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel_hooks, "_swaps", lambda module: [])
        assert probed(sharded, seen) > stepping


def failing_style(error: BaseException):
    """A forward pre-hook that torch's distributed package would have defined, and that raises."""

    def hook(module, args):
        top = torch.overrides._get_current_function_mode()
        assert not isinstance(top, capture_mode.Interceptor)  # run out of its sight
        raise error

    hook.__module__ = "torch.distributed.tensor._api"
    return hook


@pytest.mark.parametrize("error", [RuntimeError("a hook refuses"), KeyboardInterrupt()])
def test_a_style_hook_that_raises_leaves_the_stack_and_the_model_as_they_were(mesh, seen, error):
    """A style's hook raises while the interceptor is off the stack for it: the wrapper puts the
    interceptor back (``finally``, a ``KeyboardInterrupt`` too) and closing the probe takes it
    off; the stack is empty after the probe, the model holds its own hooks, and the next probe
    counts as before."""
    sharded = parallelized(mesh)
    before = probed(sharded, seen)
    handle = sharded.q_proj.register_forward_pre_hook(failing_style(error))
    hooks = hooks_of(sharded)
    monitoring = Monitoring(sharded, [AttentionEntropy(per_head=True)], every_n_steps=1)
    with pytest.raises(type(error)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with monitoring.step(0):
            sharded(torch.randn(2, 6, WIDTH))
    assert torch._C._len_torch_function_stack() == 0
    assert hooks_of(sharded) == hooks
    handle.remove()
    assert probed(sharded, seen) == before


def test_a_hook_the_model_replaces_or_removes_during_the_probe_stays_as_it_left_it(mesh, seen):
    sharded = parallelized(mesh)
    pre = sharded.q_proj._forward_pre_hooks
    key = next(iter(pre))
    post = sharded.o_proj._forward_hooks
    gone = next(iter(post))

    original = pre[key]

    def replacement(module, args):  # the model's own object, put where the wrapper stood
        return original(module, args)

    def meddle(model):
        pre[key] = replacement
        del post[gone]

    probed(sharded, seen, during=meddle)
    assert pre[key] is replacement and gone not in post
    assert len(hooks_of(sharded)) == 7
    assert torch._C._len_torch_function_stack() == 0


def test_a_mode_entered_above_the_interceptor_is_left_alone(mesh, seen):
    """The model enters a mode of its own around its query projection: the interceptor is then
    not on top, so the wrappers take nothing off; both modes are left as they were."""
    sharded = parallelized(mesh, around_q=PassingMode)
    one_process = Attention(HEADS // 2, around_q=PassingMode)
    assert probed(sharded, seen) > probed(one_process, seen)  # q's styles seen
    assert torch._C._len_torch_function_stack() == 0


def test_a_module_without_distributed_hooks_gets_nothing(seen):
    model = Attention(HEADS)
    model.q_proj.register_forward_hook(lambda module, args, output: None)
    hooks, inside = hooks_of(model), []
    probed(model, seen, during=lambda m: inside.extend(hooks_of(m)))
    assert hooks[0] in inside and hooks == hooks_of(model)


def holding(owner: nn.Module):
    """A forward pre-hook that names its module, as FSDP2's bound methods do, and says it is
    torch.distributed's."""

    def hook(module, args) -> None:
        assert module is owner

    hook.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_state"
    return hook


def test_a_probed_model_is_freed_with_its_last_reference(mesh, seen):
    """Nothing of the swap outlives the probe. A torch.distributed hook may hold its module (FSDP2's
    are methods of a state that names it): a wrapper kept beside such a hook would keep the
    projection and its weights alive for the life of the process."""
    sharded = parallelized(mesh)
    proj = sharded.q_proj
    proj.register_forward_pre_hook(holding(proj))
    probed(sharded, seen)
    gone = [weakref.ref(m) for m in (sharded, proj, proj.weight)]
    del sharded, proj
    gc.collect()
    assert [ref() for ref in gone] == [None, None, None]


def test_a_tensor_parallel_probe_leaves_no_reference_cycle_of_its_own(mesh):
    """The wrappers, channels and captures of a TP probe (entropy and spectrum) are freed by
    reference counting: nothing of qkmonitor's and no tensor in the cycles a step leaves (DTensor's
    own forward leaves torch's pytree helpers in cycles at every step on torch 2.13, not 2.4: not
    counted)."""
    from qkmonitor.engine import QKSpectrum
    from tests.core.test_no_cycles import collector_off, ours, unreachable_after

    model = parallelized(mesh)
    engines = [AttentionEntropy(per_head=True), QKSpectrum(per_head=True)]
    monitoring = Monitoring(model, engines, every_n_steps=1)
    x = torch.randn(2, 6, WIDTH, generator=torch.Generator().manual_seed(0))
    steps = iter(range(10))

    def step():
        with monitoring.step(next(steps)):
            model(x).sum().backward()
        control = []  # a cycle of the test's own, that the census must count
        control.append(control)

    with collector_off(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fake all_gather leaves rank 1's heads unfilled
        step()  # the first probe's discovery apart
        for _ in range(2):
            found = unreachable_after(step)
            assert found["builtins.list"] >= 1 and ours(found) == {}, found
    monitoring.close()
