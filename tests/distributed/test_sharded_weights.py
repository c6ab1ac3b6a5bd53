"""Weight metrics on sharded parameters: a DTensor (FSDP2's parameters) is read whole."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from qkmonitor.measures.layer_spectra import QKWeights, full_parameters, spectrum_of_layers
from qkmonitor.measures.sharding import whole


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_spectrum_of_dtensor_weights_equals_that_of_the_full_weights(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    from tests.parallel_api import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    gen = torch.Generator().manual_seed(0)
    w_q, w_k = torch.randn(32, 32, generator=gen), torch.randn(16, 32, generator=gen)
    sharded_q, sharded_k = (
        distribute_tensor(w_q, mesh, [Shard(0)]),
        distribute_tensor(w_k, mesh, [Shard(0)]),
    )
    assert type(sharded_q).__name__ == "DTensor" and torch.equal(whole(sharded_q), w_q)

    sharded = spectrum_of_layers(
        [QKWeights(sharded_q, sharded_k, 4, 2, 0.5), QKWeights(w_q, w_k, 4, 2, 0.5)]
    )
    plain = spectrum_of_layers([QKWeights(w_q, w_k, 4, 2, 0.5)])
    for name, values in plain.metrics.items():
        for layer in range(2):  # a DTensor layer next to a plain one
            torch.testing.assert_close(
                sharded.metrics[name][layer], values[0], rtol=0, atol=0, equal_nan=True
            )
    torch.testing.assert_close(sharded.singular_values[0], plain.singular_values[0], rtol=0, atol=0)


def test_full_parameters_is_a_no_op_without_fsdp():
    model = nn.Linear(4, 4)
    before = model.weight.detach().clone()
    with full_parameters(model), full_parameters(None):
        assert torch.equal(model.weight, before)


def test_qk_clip_writes_a_dtensors_rows_through_its_local_shard(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    from qkmonitor.attention.clip import ProjectionRows, local_rows
    from tests.parallel_api import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    weight = torch.arange(12.0).view(4, 3)
    rows = ProjectionRows(
        distribute_tensor(weight, mesh, [Shard(0)]), None, torch.arange(4).view(2, 2)
    )
    rows.scale(torch.tensor([0.5, 1.0]))  # head 0 is rows 0-1
    expected = weight.clone()
    expected[:2] *= 0.5
    assert torch.equal(rows.weight.full_tensor(), expected)
    replicated = distribute_tensor(weight, mesh, [Replicate()])
    assert local_rows(replicated)[1] == 0
    with pytest.raises(ValueError, match=r"Shard\(0\)"):
        local_rows(distribute_tensor(weight, mesh, [Shard(1)]))
