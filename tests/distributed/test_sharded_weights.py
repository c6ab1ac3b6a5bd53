"""Weight metrics on sharded parameters: a DTensor (FSDP2's parameters) is read whole."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from qkmonitor.adapters import AttentionLayer, QKWeights
from qkmonitor.spectrum import full_tensor, spectrum_of_layers


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_spectrum_of_dtensor_weights_equals_that_of_the_full_weights(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    gen = torch.Generator().manual_seed(0)
    w_q, w_k = torch.randn(32, 32, generator=gen), torch.randn(16, 32, generator=gen)
    sharded_q, sharded_k = distribute_tensor(w_q, mesh, [Shard(0)]), distribute_tensor(w_k, mesh, [Shard(0)])
    assert type(sharded_q).__name__ == "DTensor" and torch.equal(full_tensor(sharded_q), w_q)

    class Fixed(AttentionLayer):
        def __init__(self, q, k):
            super().__init__("fixed", nn.Identity())
            self.q, self.k = q, k

        def qk_weights(self):
            return QKWeights(self.q, self.k, 4, 2, 0.5)

    sharded = spectrum_of_layers([Fixed(sharded_q, sharded_k).qk_weights()]).metrics
    plain = spectrum_of_layers([Fixed(w_q, w_k).qk_weights()]).metrics
    for name, values in plain.items():
        torch.testing.assert_close(sharded[name][0], values[0], equal_nan=True)
