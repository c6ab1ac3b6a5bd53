"""Context parallelism is recognised from what an attention call is handed (issue 42): keys or
queries that are DTensors sharded along the sequence, or torch's ``context_parallel`` SDPA
wrapper in place. Plain calls, and DTensors split along other dims (the heads: tensor
parallelism), are not refused here. Two gloo ranks: tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkmonitor.attention.context_parallel import TORCH_SDPA, context_parallel_reason, local


class _Mesh:
    def __init__(self, *sizes: int) -> None:
        self.sizes = sizes

    def size(self, mesh_dim: int | None = None) -> int:
        return (
            self.sizes[mesh_dim] if mesh_dim is not None else int(torch.tensor(self.sizes).prod())
        )


class _Placement:
    def __init__(self, dim: int | None) -> None:
        self.dim = dim

    def is_shard(self) -> bool:
        return self.dim is not None


def _split(*dims: int | None, sizes=(2,)) -> torch.Tensor:
    """A (B, H, N, D) tensor that looks like a DTensor placed ``dims`` on a mesh of ``sizes``
    (what the detection reads: ``placements``, ``device_mesh``)."""
    x = torch.zeros(1, 2, 4, 8)
    x.placements = tuple(_Placement(d) for d in dims)
    x.device_mesh = _Mesh(*sizes)
    return x


def test_plain_calls_are_not_refused():
    q = k = torch.zeros(1, 2, 4, 8)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert context_parallel_reason(q, k) is None
    assert context_parallel_reason(None, None) is None
    assert local(q) is q


def test_keys_sharded_along_the_sequence_are_refused_by_name():
    reason = context_parallel_reason(_split(2), _split(-2))
    assert reason.startswith("its keys are split across 2 ranks (context parallelism: ")
    assert reason.endswith("entropy not measured")
    reason = context_parallel_reason(_split(None, 2, sizes=(3, 2)), _split(None, 2, sizes=(3, 2)))
    assert reason.startswith("its keys are split across 2 ranks"), reason  # the seq's mesh dim
    reason = context_parallel_reason(_split(2), torch.zeros(1, 2, 4, 8))
    assert reason.startswith("its queries are split across 2 ranks (context parallelism: ")


def test_dtensors_split_otherwise_are_not_context_parallel():
    assert context_parallel_reason(_split(1), _split(1)) is None  # heads: tensor parallelism
    assert context_parallel_reason(_split(None), _split(None)) is None  # replicated
    assert context_parallel_reason(_split(2, sizes=(1,)), _split(2, sizes=(1,))) is None


def test_torch_context_parallel_wrapper_is_recognised():
    try:  # where torch 2.13 keeps it; older releases, in _attention itself
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        _attention = pytest.importorskip("torch.distributed.tensor.experimental._attention")
    distribute = getattr(_attention, "_distribute_function", None)
    restore = getattr(_attention, "_restore_function", None)
    if distribute is None or restore is None:
        pytest.skip("this torch's context_parallel has no _distribute_function")
    q = k = torch.zeros(1, 2, 4, 8)
    distribute(F.scaled_dot_product_attention, F, _Mesh(4), None, None)
    try:
        assert F.scaled_dot_product_attention is not TORCH_SDPA
        reason = context_parallel_reason(q, k)
    finally:
        restore(F.scaled_dot_product_attention, F)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert reason.startswith("its keys are split across 4 ranks (context parallelism: torch's")
    assert context_parallel_reason(q, k) is None
