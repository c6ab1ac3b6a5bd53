"""Which row shards are read and written in place (qkmonitor.measures.sharding.RowShard): the
forward's tensor-parallel layout, and FSDP2 over it, whose parameters live on the forward's mesh
after data-parallel mesh dims. Only the layouts are checked here, on torch's fake process group
(one process posing as rank 0 of 2 or 4: no collective runs); the values, through Lightning and two
gloo ranks, are tests/distributed/test_model_parallel.py's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from qkmonitor.attention.layouts import HeadShards
from qkmonitor.measures.sharding import HeadPlacement, RowShard

ROWS, IN = 16, 3  # 4 heads of 4 rows, split over 2 tensor-parallel ranks: 8 rows a rank


@pytest.fixture
def mesh(request):
    """A ``(data_parallel, tensor_parallel)`` mesh of ``request.param`` data-parallel ranks times
    2 tensor-parallel ones, seen from rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dp = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp * 2)
    try:
        yield init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def _forward_shard(mesh) -> RowShard:
    from tests.parallel_api import Shard

    return RowShard(0, 2, ROWS, 0, mesh["tp"], (Shard(0),))


def _dtensor(local: torch.Tensor, mesh, placements) -> torch.Tensor:
    from tests.parallel_api import DTensor

    shape = (ROWS, IN)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=(IN, 1))


@pytest.mark.parametrize("mesh", [1], indirect=True)
def test_the_forwards_layout_is_read_in_place(mesh):
    from tests.parallel_api import Shard

    shard = _forward_shard(mesh)
    local = torch.arange(8 * IN, dtype=torch.float32).view(8, IN)
    weight = _dtensor(local, mesh["tp"], (Shard(0),))
    assert shard.in_place(weight)
    assert shard.local(weight).data_ptr() == local.data_ptr()


@pytest.mark.parametrize("mesh", [1], indirect=True)
def test_fsdp2_over_tensor_parallelism_on_one_data_parallel_rank_is_read_in_place(mesh):
    """FSDP2's parameter on the 1 x 2 mesh: its local shard is the rows the forward computes
    with, so they are read, and written, in place (no gathered copy)."""
    from tests.parallel_api import Shard, StridedShard

    shard = _forward_shard(mesh)
    local = torch.arange(8 * IN, dtype=torch.float32).view(8, IN)
    strided = [] if StridedShard is None else [StridedShard(0, split_factor=2)]
    for dp_placement in (Shard(0), *strided):
        weight = _dtensor(local, mesh, (dp_placement, Shard(0)))
        assert shard.in_place(weight), dp_placement
        assert shard.local(weight).data_ptr() == local.data_ptr()


@pytest.mark.parametrize("mesh", [2], indirect=True)
def test_a_data_parallel_dim_that_splits_the_rows_is_not_in_place(mesh):
    from tests.parallel_api import Replicate, Shard

    shard = _forward_shard(mesh)
    split = _dtensor(torch.zeros(4, IN), mesh, (Shard(0), Shard(0)))
    assert not shard.in_place(split)  # rank 0 holds 4 of its 8 rows
    replicated = _dtensor(torch.zeros(8, IN), mesh, (Replicate(), Shard(0)))
    assert shard.in_place(replicated)  # HSDP's replicated dim: all 8 rows here


@pytest.mark.parametrize("mesh", [1], indirect=True)
def test_another_layout_is_not_in_place(mesh):
    from tests.parallel_api import Replicate, Shard

    shard = _forward_shard(mesh)
    assert not shard.in_place(torch.zeros(ROWS, IN))  # a plain tensor
    assert not shard.in_place(_dtensor(torch.zeros(ROWS, IN), mesh["tp"], (Replicate(),)))
    assert not shard.in_place(_dtensor(torch.zeros(8, IN), mesh, (Shard(0), Replicate())))
    # the forward's mesh dims, but the other way round (tensor-parallel dim first)
    from torch.distributed.device_mesh import init_device_mesh

    swapped = init_device_mesh("cpu", (2, 1), mesh_dim_names=("tp", "dp"))
    assert not shard.in_place(_dtensor(torch.zeros(8, IN), swapped, (Shard(0), Shard(0))))


class _Attention(nn.Module):
    def __init__(self, q: torch.Tensor, k: torch.Tensor) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(IN, ROWS, bias=False), nn.Linear(IN, ROWS, bias=False)
        self.q_proj.weight, self.k_proj.weight = nn.Parameter(q), nn.Parameter(k)


def _head_shards(mesh) -> HeadShards:
    return HeadShards(_forward_shard(mesh), _forward_shard(mesh), HeadPlacement(0, 2, 4))


@pytest.mark.parametrize("mesh", [1], indirect=True)
def test_qk_clip_scales_the_local_rows_of_fsdp2_over_tensor_parallelism(mesh):
    from tests.parallel_api import Shard

    q_local, k_local = torch.ones(8, IN), torch.ones(8, IN)
    module = _Attention(*(_dtensor(t, mesh, (Shard(0), Shard(0))) for t in (q_local, k_local)))
    q, k = _head_shards(mesh).rows(module, "q_proj", "k_proj", head_dim=4)
    q.scale(torch.tensor([1.0, 0.5], dtype=torch.float64))  # this rank's second head
    assert q_local[:4].eq(1).all() and q_local[4:].eq(0.5).all()  # written through
    assert k.weight.data_ptr() == k_local.data_ptr()


@pytest.mark.parametrize("mesh", [2], indirect=True)
def test_rows_split_over_data_parallel_ranks_are_refused_by_name(mesh):
    from tests.parallel_api import Shard

    halves = [_dtensor(torch.ones(4, IN), mesh, (Shard(0), Shard(0))) for _ in range(2)]
    with pytest.raises(ValueError, match=r"shard of 'q_proj' is not the rows it computes with"):
        _head_shards(mesh).rows(_Attention(*halves), "q_proj", "k_proj", head_dim=4)


def _fake_group(world: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


@pytest.mark.parametrize("how", ["tensor_parallel", "fsdp2_around", "fsdp2_on_it", "none"])
def test_tensor_parallel_ranks_tells_tensor_parallelism_from_fsdp2(how):
    """The ranks that compute the same sequences (EffectiveRank deals its probe sequences over the
    others): 2 under tensor parallelism over 2 ranks; 1 under FSDP2 over 2 ranks, whether
    ``fully_shard`` is applied to the module that holds the weight or only around it."""
    from torch.distributed.device_mesh import init_device_mesh

    from qkmonitor.measures.sharding import tensor_parallel_ranks

    _fake_group(2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        block = nn.Sequential(nn.Linear(IN, ROWS), nn.Linear(ROWS, IN))
        model = nn.Sequential(block)
        if how == "tensor_parallel":
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            parallelize_module(block, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        elif how == "fsdp2_around":
            from tests.parallel_api import fully_shard

            fully_shard(block, mesh=mesh)
        elif how == "fsdp2_on_it":
            from tests.parallel_api import fully_shard

            fully_shard(block[0], mesh=mesh)
            fully_shard(model, mesh=mesh)
        assert tensor_parallel_ranks(model) == (2 if how == "tensor_parallel" else 1)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mesh", [1], indirect=True)
def test_a_dtensor_is_whole_locally_only_where_this_rank_holds_all_of_it(mesh):
    """``local_whole``: the local shard itself (no copy) of a DTensor sharded over a mesh dim of
    one rank or replicated; None where this rank holds part of it, for a partial sum, and for a
    plain tensor."""
    from qkmonitor.measures.sharding import local_whole
    from tests.parallel_api import DTensor, Partial, Replicate, Shard

    whole = torch.arange(ROWS * IN, dtype=torch.float32).view(ROWS, IN)
    on_one = DTensor.from_local(whole, mesh["dp"], (Shard(0),), run_check=False)
    assert local_whole(on_one).data_ptr() == whole.data_ptr()
    replicated = DTensor.from_local(whole, mesh["tp"], (Replicate(),), run_check=False)
    assert local_whole(replicated).data_ptr() == whole.data_ptr()
    assert local_whole(_dtensor(whole[:8], mesh["tp"], (Shard(0),))) is None  # half of it
    assert local_whole(DTensor.from_local(whole, mesh["tp"], (Partial(),), run_check=False)) is None
    assert local_whole(whole) is None


class _Projections(nn.Module):
    """Separate q/k/v/o projections of 2 heads of 4 and SDPA: the generic family's reading."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(8, 8, bias=False) for _ in range(4)
        )

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, 2, 4).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, 8))


def _update_metrics(mesh=None) -> dict[str, torch.Tensor]:
    """Two probed AdamW steps of ``_Projections`` (parallelized on ``mesh`` where given): the
    spectrum's update and gradient metrics of the second, and its update's spectrum."""
    import warnings

    from qkmonitor.engine import Monitoring, QKSpectrum

    torch.manual_seed(0)
    model = nn.Sequential(_Projections())
    if mesh is not None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {f"0.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        try:
            parallelize_module(model, mesh, plan | {"0.o_proj": RowwiseParallel()})
        except RuntimeError as err:  # torch 2.4 - 2.8: TP on the innermost mesh dim only
            if "innermost" not in str(err):
                raise
            pytest.skip(f"torch {torch.__version__} refuses this mesh itself: {err}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    spectrum = QKSpectrum(per_head=True, update_spectrum=True)
    monitoring = Monitoring(model, [spectrum], every_n_steps=1, optimizer=optimizer)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer refused
        for step in range(2):
            with monitoring.step(step):
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    monitoring.close()
    names = ("q_update_ratio", "k_update_ratio", "q_grad_norm", "k_grad_norm")
    names += ("qk_update_entropy", "qk_update_top_share")  # the update's spectrum likewise
    return {name: torch.stack(spectrum.latest[name]) for name in names}


@pytest.mark.parametrize("mesh", [1], indirect=True)
def test_on_a_tensor_parallel_mesh_of_one_rank_the_update_metrics_are_the_unsplit_models(mesh):
    """A model parallelized over a mesh dim of one rank (``ModelParallelStrategy`` with a tensor
    parallel size of 1) holds its projections whole, as DTensors: its update and gradient metrics
    are read through their local shards and equal the unparallelized twin's (they were NaN for
    the whole run, "its query/key weights are sharded (DTensor): not read yet")."""
    expected = _update_metrics()
    got = _update_metrics(mesh["dp"])
    for name, values in expected.items():
        assert torch.isfinite(values).all(), name
        torch.testing.assert_close(got[name], values, rtol=1e-6, atol=0, msg=name)
