"""Context parallelism is recognised from what an attention call is handed (issue 42): keys or
queries that are DTensors sharded along the sequence, or torch's ``context_parallel`` SDPA
wrapper in place. Plain calls, and DTensors split along other dims (the heads: tensor
parallelism), are not refused here. Two gloo ranks: tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkmonitor.attention.context_parallel import (
    TORCH_SDPA,
    context_parallel_reason,
    local,
    sequence_split_reason,
)


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


def test_hidden_states_split_along_the_sequence_are_told():
    """A block output ``(B, N, d)`` (the rank monitor's hidden states): its sequence dim is -2."""
    hidden = torch.zeros(1, 4, 8)
    assert sequence_split_reason(hidden) is None
    hidden.placements, hidden.device_mesh = (_Placement(1),), _Mesh(2)
    assert sequence_split_reason(hidden).startswith("split across 2 ranks (context parallelism: ")
    hidden.placements = (_Placement(2),)  # its channels: tensor parallelism, not the sequence
    assert sequence_split_reason(hidden) is None


def _families():
    from qkmonitor.models import DecoderLM, TransformerConfig

    class Intercepted(torch.nn.Module):  # the generic family: an SDPA call in its forward
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
            self.v_proj = torch.nn.Linear(16, 16)

        def forward(self, x):
            q, k, v = (
                p(x).view(2, 6, 2, 8).transpose(1, 2)
                for p in (self.q_proj, self.k_proj, self.v_proj)
            )
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 6, 16)

    x = torch.randn(2, 6, 16)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    config = TransformerConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
    return {
        "nn.MultiheadAttention": (mha, lambda: mha(x, x, x, need_weights=False)),
        "qkmonitor": (DecoderLM(config), None),
        "intercepted": (Intercepted(), None),
    }, x


def _inputs_as_they_are(*args, **kwargs):
    """context_parallel's input conversion, left out: torch 2.8 calls it as ``(mesh, *args,
    **kwargs)``, torch 2.13 as ``(module, args, kwargs, mesh)``; both take ``(args, kwargs)``."""
    if isinstance(args[0], _Mesh):
        return args[1:], kwargs
    return args[1], args[2]


def _output_as_it_is(*args):
    """Its output conversion, left out: ``(mesh, output)`` (2.8) or ``(module, inputs, output,
    mesh)`` (2.13)."""
    return args[1] if isinstance(args[0], _Mesh) else args[2]


def test_every_family_refuses_its_calls_while_torch_context_parallel_is_in_place():
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        _attention = pytest.importorskip("torch.distributed.tensor.experimental._attention")
    distribute = getattr(_attention, "_distribute_function", None)
    if distribute is None:
        pytest.skip("this torch's context_parallel has no _distribute_function")
    from qkmonitor.attention.adapters import find_attention_layers
    from qkmonitor.attention.probes import ProbeRequest

    families, x = _families()
    tokens = torch.randint(0, 16, (2, 6))
    # torch's own wrapper, its conversions left out: what the families see of it is its presence
    distribute(F.scaled_dot_product_attention, F, _Mesh(2), _inputs_as_they_are, _output_as_it_is)
    try:
        for name, (model, run) in families.items():
            layer = find_attention_layers(model)[0]
            probe = layer.open_probe(ProbeRequest())
            with torch.no_grad():
                if run is not None:
                    run()
                else:
                    model(tokens if name == "qkmonitor" else x)
            result = probe.close()
            assert result.calls == 0 and result.failures == [], (name, result)
            assert len(result.sharded) == 1, (name, result)
            assert result.sharded[0].startswith(
                "its keys are split across 2 ranks (context parallelism"
            ), name
    finally:
        _attention._restore_function(F.scaled_dot_product_attention, F)
    assert F.scaled_dot_product_attention is TORCH_SDPA
