"""An intercepted attention module (nanoGPT's, known to qkmonitor only by its projections' names
and its SDPA call) under FSDP2, for the distributed test: `python fsdp2_intercept_job.py OUT_DIR
WORLD [projections]`.

WORLD 1 runs the plain model; WORLD 2 spawns two gloo ranks that ``fully_shard`` every block and
the model (with ``projections``, each attention's two projections first: FSDP2's hooks then run
inside the probed attention forward, out of the interceptor's sight), so that the projections'
weights are DTensors and FSDP2 hands ``F.linear`` unsharded parameters of its own during the
forward. Both probe two steps (no optimizer: the weights stay)
of the same 8 sequences (each of two ranks 4 of them) with the spectrum and entropy monitors in a
plain loop; rank 0 saves the latest values and the warnings to ``OUT_DIR/values.pt``. WORLD 2
without ``projections`` then fits again with ``QKSpectrum(background_weights=True)`` into
``OUT_DIR/values_background.pt``.
"""

import gc
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qkmonitor.engine import AttentionEntropy, Monitoring, QKSpectrum
from qkmonitor.engine.background import WEIGHTS_WORKER

D, H, T = 32, 4, 8


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.n_head = H

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for z in self.c_attn(x).split(c, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = CausalSelfAttention()

    def forward(self, x):
        return x + self.attn(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, 16)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def run(rank: int, world: int, out_dir: str, projections: bool = False) -> None:
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world
        )
    fit(rank, world, out_dir, projections)
    if world > 1 and not projections:  # again with background_weights=True: DTensors stay on
        fit(rank, world, out_dir, projections, background=True)  # the training thread
    if world > 1:
        # the model's DTensors and FSDP2's state, which hold the group, gone while the interpreter
        # is whole (left to its finalization, gloo's teardown aborted a rank now and then), and
        # both ranks done with every collective before either tears gloo down
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def fit(rank: int, world: int, out_dir: str, projections: bool, background: bool = False) -> None:
    """Two probed steps, and on rank 0 the values saved (``values_background.pt`` with
    ``background``: ``QKSpectrum(background_weights=True)``, the worker's jobs counted); what it
    made is freed on return."""
    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():  # sharper heads than at initialisation, so that entropies differ
        for block in model.blocks:
            block.attn.c_attn.weight.mul_(3.0)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            if projections:  # FSDP2's own hooks inside the attention module, on its projections
                fully_shard(block.attn.c_attn, mesh=mesh)
                fully_shard(block.attn.c_proj, mesh=mesh)
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    spectrum, entropy = QKSpectrum(background_weights=background), AttentionEntropy()
    jobs = []
    submit = WEIGHTS_WORKER.submit
    WEIGHTS_WORKER.submit = lambda *job: jobs.append(job) or submit(*job)  # counted
    monitoring = Monitoring(model, [spectrum, entropy], every_n_steps=1)
    tokens = torch.randint(0, 16, (8, T), generator=torch.Generator().manual_seed(1))
    mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
    kappa_at_0 = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(2):  # step 0 checks the layout on a copy, step 1 reads the weights
                with monitoring.step(step):
                    model(tokens[mine]).sum().backward()
                if step == 0:  # held for the layout check, logged when the step ended
                    kappa_at_0 = [t.clone() for t in spectrum.latest["kappa"]]
        finally:
            monitoring.close()
            del WEIGHTS_WORKER.submit
    if rank == 0:
        torch.save(
            {
                "kappa": [t.clone() for t in spectrum.latest["kappa"]],
                "kappa_at_0": kappa_at_0,
                "entropy_norm": [t.clone() for t in entropy.latest["entropy_norm"]],
                "warnings": [str(w.message) for w in caught],
                "worker_jobs": len(jobs),
            },
            f"{out_dir}/values{'_background' if background else ''}.pt",
        )


try:  # imported by the test run's module collection
    from .jobs import two_ranks
except ImportError:  # run as the job script
    from jobs import two_ranks


def main() -> None:
    out_dir, world = sys.argv[1], int(sys.argv[2])
    projections = sys.argv[3:] == ["projections"]
    if world == 1:
        run(0, 1, out_dir)
    elif world == 2:  # two ranks, each with its own hash seed
        two_ranks(run, out_dir, projections)
    else:
        raise SystemExit(f"WORLD is 1 or 2, got {world}")


if __name__ == "__main__":
    main()
