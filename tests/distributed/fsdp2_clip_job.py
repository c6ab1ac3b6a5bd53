"""QK-Clip on FSDP2-sharded weights, for the distributed test:
`python fsdp2_clip_job.py OUT_DIR WORLD`.

WORLD 1 trains the plain model; WORLD 2 spawns two gloo ranks that ``fully_shard`` every block and
the model (their query and key weights are DTensors sharded along the rows). Both train 3 AdamW
steps on the same 8 sequences a step (each of two ranks on 4 of them; FSDP2 averages the gradients
as one process's mean loss does) with ``QKClipEngine(tau=0.5)`` (below every head's logits) in a
plain loop, then rank 0 saves the full query and key weights and the clip counts to
``OUT_DIR/qk.pt``.
"""

import gc
import sys

import torch
import torch.distributed as dist

from qkmonitor.engine import Monitoring, QKClipEngine
from qkmonitor.models import DecoderLM, TransformerConfig
from qkmonitor.models.tasks import make_recall_batch


def train(rank: int, world: int, out_dir: str) -> None:
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world
        )
    fit(rank, world, out_dir)
    if world > 1:
        # the model's DTensors and FSDP2's state, which hold the group, gone while the interpreter
        # is whole (left to its finalization, gloo's teardown aborted a rank now and then), and
        # both ranks done with every collective before either tears gloo down
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def fit(rank: int, world: int, out_dir: str) -> None:
    """Train, and on rank 0 save the weights and clip counts; what it made is freed on return."""
    torch.manual_seed(0)
    model = DecoderLM(
        TransformerConfig(vocab_size=16, d_model=32, n_heads=4, n_layers=2, max_seq_len=9)
    )
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    clip = QKClipEngine(tau=0.5)
    monitoring = Monitoring(model, [clip], optimizer=optimizer)
    tokens, targets = make_recall_batch(8, 3, 3, 8, 8, torch.Generator().manual_seed(0))
    mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
    try:
        for step in range(3):
            with monitoring.step(step):
                logits = model(tokens[mine])
                loss = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), targets[mine].flatten(), ignore_index=-100
                )
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        monitoring.close()
    weights = {
        name: (p.full_tensor() if callable(getattr(p, "full_tensor", None)) else p).detach()
        for name, p in model.named_parameters()
        if "q_proj" in name or "k_proj" in name
    }
    if rank == 0:
        counts = [c.clone() for c in clip.clip_counts]
        torch.save({"weights": weights, "counts": counts}, f"{out_dir}/qk.pt")


try:  # imported by the test run's module collection
    from .jobs import two_ranks
except ImportError:  # run as the job script
    from jobs import two_ranks


def main() -> None:
    out_dir, world = sys.argv[1], int(sys.argv[2])
    if world == 1:
        train(0, 1, out_dir)
    elif world == 2:  # two ranks, each with its own hash seed
        two_ranks(train, out_dir)
    else:
        raise SystemExit(f"WORLD is 1 or 2, got {world}")


if __name__ == "__main__":
    main()
