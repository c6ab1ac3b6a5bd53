"""DTensor and FSDP2 as the tests import them, on every torch pyproject admits.

``torch.distributed.tensor`` holds DTensor and its placements from torch 2.5, and
``torch.distributed.fsdp`` holds ``fully_shard`` from 2.5 and ``FSDPModule`` from 2.6; torch 2.4
(pyproject's floor, CI's minimum run) has the same classes under the earlier paths
``torch.distributed._tensor`` and ``torch.distributed._composable.fsdp``. qkmonitor itself reads a
DTensor by its attributes (``placements``, ``device_mesh``, ``full_tensor``), never by these names.
"""

from __future__ import annotations

import pytest
import torch

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

try:  # FSDP2's placement over tensor parallelism (torch's private name; from torch 2.5)
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
except ImportError:  # torch 2.4: FSDP2 over tensor parallelism shards with plain Shard(0)
    StridedShard = None

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # torch 2.4 - 2.5
    from torch.distributed._composable.fsdp import FSDPModule, fully_shard

__all__ = [
    "FAKE_GROUP_QUIET",
    "DTensor",
    "FSDPModule",
    "Partial",
    "Replicate",
    "Shard",
    "StridedShard",
    "distribute_tensor",
    "fully_shard",
    "needs_torch",
]


#: Why a test of a tensor-parallel model on torch's fake process group needs torch 2.9 or later
FAKE_GROUP_QUIET = (
    "a tensor-parallel forward on torch's fake process group (whose collectives fill nothing) "
    "computes without them (checked: torch 2.4.0 and 2.8.0 call them, and the model alone gives "
    "garbage or NaN logits; 2.13.0 passes)"
)


def needs_torch(version: str, why: str) -> None:
    """Skip the calling test on a torch older than ``version``, saying ``why`` (what of torch's
    own that test leans on is missing or different there) and which torch is installed."""
    if torch.__version__ < version:
        pytest.skip(f"{why}: from torch {version} (installed: {torch.__version__})")
