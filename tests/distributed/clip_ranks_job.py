"""Two gloo ranks reduce QK-Clip's largest logits, for the distributed test:
`python clip_ranks_job.py OUT_DIR`.

Layer 0 has 3 heads on both ranks; layer 1 has 2 heads on rank 0 and 4 on rank 1 (a rank whose
forward did not run an intercepted layer reads its configured head count). Each rank saves what
``_largest_over_ranks`` returned to ``OUT_DIR/rank{R}.pt``.
"""

import math
import sys

import torch
import torch.distributed as dist

from qkmonitor.engine.clip import _largest_over_ranks


def reduce(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world
    )
    layer0 = torch.tensor([1.0, 5.0, math.nan]) if rank == 0 else torch.tensor([4.0, 2.0, 0.0])
    layer1 = torch.ones(2) if rank == 0 else torch.ones(4)
    reduced, disagree = _largest_over_ranks([layer0.double(), layer1.double()])
    torch.save({"reduced": reduced, "disagree": disagree}, f"{out_dir}/rank{rank}.pt")
    dist.barrier()  # both ranks done with every collective before either tears gloo down
    dist.destroy_process_group()


try:  # imported by the test run's module collection
    from .jobs import two_ranks
except ImportError:  # run as the job script
    from jobs import two_ranks


if __name__ == "__main__":
    two_ranks(reduce, sys.argv[1])
