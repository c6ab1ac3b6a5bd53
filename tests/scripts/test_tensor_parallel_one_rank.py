"""``benchmarks/tensor_parallel_one_rank.py``'s statistics and its stand-in for the other rank: the
interval it gives the median covers it as often as it says (exact binomial sums), and the fake
``all_gather`` hands back what a rank 1 computing rank 0's values for its own heads would send."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from qkmonitor.measures import metrics, sharding
from qkmonitor.measures.sharding import HeadPlacement
from tests.parallel_api import FAKE_GROUP_QUIET, needs_torch


@pytest.mark.parametrize("n", [40, 100, 150, 400])
def test_median_interval_covers_the_median_at_least_95_percent(benchmark_module, n):
    one_rank = benchmark_module("tensor_parallel_one_rank")
    values = [float(v) for v in range(n)]
    middle, low, high = one_rank.median_interval(values)
    assert middle == (n - 1) / 2
    # [x_(k), x_(n-1-k)] (0-based) misses the true median exactly when k or fewer of the n draws
    # fall on one side of it: each side below it with probability 1/2 per draw
    k = int(low)
    assert high == n - 1 - k
    tail = sum(math.comb(n, j) for j in range(k + 1)) / 2**n
    assert 1 - 2 * tail >= 0.94
    assert 1 - 2 * sum(math.comb(n, j) for j in range(k + 2)) / 2**n < 0.95  # not wider than needed


@pytest.fixture
def one_rank_of_two(benchmark_module, monkeypatch):
    """The script's module with ``dist`` as rank 0 of 2 whose ``all_gather`` moves nothing (as the
    fake process group's), and every name ``mirror_all_gather`` replaces put back afterwards."""
    one_rank = benchmark_module("tensor_parallel_one_rank")

    def moves_nothing(outputs, tensor, *args, **kwargs):
        for output in outputs:
            output.fill_(float("nan"))

    monkeypatch.setattr(dist, "all_gather", moves_nothing)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(sharding, "pack_heads", sharding.pack_heads)
    monkeypatch.setattr(metrics, "pack_heads", metrics.pack_heads)
    monkeypatch.setattr(one_rank, "SHIFT", [0])
    one_rank.mirror_all_gather()
    return one_rank


def test_mirrored_all_gather_sends_rank_zero_values_as_rank_one_heads(one_rank_of_two):
    one_rank = one_rank_of_two
    heads, local = 8, 4
    one_rank.SHIFT[0] = local  # a TP copy: each layer's block of 8 slots, rank 0's heads first
    # sums of two layers as rank 0 leaves them: its heads filled, rank 1's neutral (0, or -inf for
    # a maximum); a per-layer slot (both ranks fill it) and a slot no head of rank 0 filled either
    sums = torch.zeros(2 * heads + 1, dtype=torch.float64)
    sums[0:local] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    sums[heads : heads + local] = torch.tensor([5.0, 6.0, 0.0, 7.0])  # head 2: no row (0)
    sums[2 * heads] = 9.0
    # the spectrum's split heads of one layer, packed as the exchange packs them
    placement = HeadPlacement(offset=0, count=local, total=heads)
    kappa = torch.tensor([10.0, 11.0, 12.0, 13.0], dtype=torch.float64)
    pack = sharding.pack_heads([(placement, [kappa])])
    flat = torch.cat([sums, pack])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)

    torch.testing.assert_close(gathered[0], flat, rtol=0, atol=0)  # this rank's own, as sent
    theirs = gathered[1]
    want = sums.clone()
    want[local:heads] = sums[0:local]  # rank 1's heads of layer 0: rank 0's values
    want[heads + local : 2 * heads] = sums[heads : heads + local]
    want[heads + local + 2] = 0.0  # rank 0's head 2 had no row: rank 1's stays neutral
    torch.testing.assert_close(theirs[: sums.numel()], want, rtol=0, atol=0)
    # placed back, the packs give every head: rank 1's offset moved to its heads
    packs = torch.stack(gathered)[:, sums.numel() :]  # each rank's pack, as reduce_across_ranks
    merged = sharding.unpack_heads([(placement, [kappa])], packs)
    torch.testing.assert_close(merged[0][0], torch.cat([kappa, kappa]), rtol=0, atol=0)


def test_mirrored_all_gather_copies_a_reference_vector_as_it_is(one_rank_of_two):
    one_rank = one_rank_of_two
    one_rank.SHIFT[0] = 0  # the reference: its ranks hold every head, data-parallel
    flat = torch.tensor([1.0, 0.0, 0.0, float("-inf"), 2.0], dtype=torch.float64)
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    for output in gathered:
        torch.testing.assert_close(output, flat, rtol=0, atol=0)


def test_the_stats_arm_runs_the_kernel_on_each_attention_calls_shapes(
    benchmark_module, monkeypatch
):
    """The "stats" control calls qkmonitor's statistics kernel once a layer a forward, causal, on
    tensors of the attention call's shape (batch, heads, tokens, head dim), before ``o_proj``, and
    leaves the model's output as it was."""
    one_rank = benchmark_module("tensor_parallel_one_rank")
    size = one_rank.Size(
        layers=2, d_model=64, heads=4, head_dim=16, hidden=128, seq_len=12, batch=3
    )
    calls, order = [], []
    monkeypatch.setattr(
        one_rank, "attention_stats", lambda q, k, **kw: calls.append((q.shape, k.shape, kw))
    )
    torch.manual_seed(0)
    model = one_rank.Model(size, size.heads, size.hidden)
    torch.manual_seed(0)
    twin = one_rank.Model(size, size.heads, size.hidden)
    one_rank.measuring_alone(model)
    for layer in model.layers:
        layer.attn.o_proj.register_forward_pre_hook(lambda m, a: order.append(len(calls)))
    tokens = torch.randint(one_rank.VOCAB, (size.batch, size.seq_len))
    torch.testing.assert_close(model(tokens), twin(tokens), rtol=0, atol=0)
    shape = (size.batch, size.heads, size.seq_len, size.head_dim)
    assert calls == [(shape, shape, {"causal": True})] * 2
    assert order == [1, 2]  # each layer's kernel call before its o_proj


def test_the_whole_arm_of_gram_parts_splits_as_before_the_parts(benchmark_module, monkeypatch):
    """``gram_parts.py``'s "whole" copy stands for the code before the parts: a batch in one
    slice on one thread, and one slice a thread (sizes differing by one) where it was threaded."""
    gram_parts = benchmark_module("gram_parts")
    assert gram_parts.whole_parts(128, 128 * 128, "cpu") == [slice(0, 128)]
    assert gram_parts.whole_parts(7, 64, "cpu", threads=2) == [slice(0, 3), slice(3, 7)]
    from qkmonitor.measures import ranks

    seen = []
    solve = ranks._gram_singular_values
    monkeypatch.setattr(ranks, "_parts", gram_parts.whole_parts)
    monkeypatch.setattr(ranks, "_gram_singular_values", lambda b: seen.append(len(b)) or solve(b))
    count = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ranks.gram_singular_values(torch.rand(32, 128, 128))  # 32 x 128^3 >= _THREADED_EIGH
    finally:
        torch.set_num_threads(count)
    assert seen == [16, 16]


def test_the_dtensor_reference_holds_its_heads_whole_on_a_mesh_of_one_rank(benchmark_module):
    """``--reference dtensor``: the reference's 4 heads and half MLP, their projections DTensors
    on a mesh of this rank alone (each whole on it), computing what the plain reference does."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    needs_torch("2.9", FAKE_GROUP_QUIET)
    one_rank = benchmark_module("tensor_parallel_one_rank")
    size = one_rank.Size(
        layers=2, d_model=64, heads=4, head_dim=16, hidden=128, seq_len=12, batch=3
    )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        plain = one_rank.build(size, False, "plain", 4)["model"]
        through = one_rank.build(size, False, "plain", 4, reference="dtensor")["model"]
        weight = through.layers[0].attn.q_proj.weight
        assert weight.device_mesh.size() == 1
        assert weight.to_local().shape == weight.shape == (size.heads // 2 * size.head_dim, 64)
        tokens = torch.randint(one_rank.VOCAB, (size.batch, size.seq_len))
        torch.testing.assert_close(through(tokens), plain(tokens), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()
