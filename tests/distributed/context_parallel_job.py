"""A LLaMA-style attention under torch's context parallelism, for the distributed test: `python
context_parallel_job.py OUT_DIR`.

Starts two gloo ranks, each with its own string hash seed (``jobs.two_ranks``). Each trains two
steps (SGD) on the same 4 sequences with the spectrum, entropy and rank monitors, per head, in a
plain loop: first the plain model on the whole sequences (every rank alike: one process's values),
then the same weights with each step inside torch's ``context_parallel`` (the input and target
sequences sharded over the two ranks, SDPA dispatched to DTensors sharded along the sequence), the
gradients averaged over the ranks as data parallelism beside it would. Each rank saves its losses
(the ranks' mean), latest values and warnings of both runs to ``OUT_DIR/values_RANK.pt``.

On CPU, torch 2.13's ``context_parallel`` runs only where SDPA takes its math path: its ring
attention handles the CUDA kernels alone (flash, efficient, cuDNN), the CPU's flash kernel has no
DTensor sharding rule, and the math path's causal mask is a plain tensor that DTensor refuses to
mix. So the attention here is bidirectional and the step runs under ``sdpa_kernel(MATH)``: DTensor
computes it from its math decomposition, exactly (the keys gathered), which is enough to show
qkmonitor what context parallelism hands SDPA.
"""

import gc
import sys
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum

D, H, HEAD_DIM, T, VOCAB = 32, 4, 8, 8, 16


def rope(x, positions):
    """Rotary embedding (rotate-half) of ``(B, H, N, D)`` heads at ``(B, N)`` positions: each
    rank's tokens keep their place in the whole sequence (the positions are sharded with them)."""
    half = HEAD_DIM // 2
    angle = positions[:, None, :, None].float() * 10000.0 ** (-torch.arange(half) / half)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(D, H * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(D, H * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(D, H * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(H * HEAD_DIM, D, bias=False)

    def forward(self, x, positions):
        b, t, _ = x.shape
        q = rope(self.q_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2), positions)  # (B, H, N, D)
        k = rope(self.k_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2), positions)
        v = self.v_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)  # bidirectional: see the docstring
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()

    def forward(self, x, positions):
        return x + self.attn(x, positions)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens, positions):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.head(x)


def _context(parallel: bool, *buffers):
    """torch's ``context_parallel`` over every rank, sharding the ``(B, N)`` ``buffers`` along the
    sequence (in place, for the step: its load balancer reorders the chunks, positions and all),
    under SDPA's math path; nothing where not ``parallel``."""
    if not parallel:
        return nullcontext()
    from contextlib import ExitStack

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    stack = ExitStack()
    stack.enter_context(
        context_parallel(
            mesh,
            buffers=list(buffers),
            buffer_seq_dims=[1] * len(buffers),
            no_restore_buffers=set(buffers),
        )
    )
    stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
    return stack


def train(model: Model, tokens, parallel: bool) -> dict:
    """Two monitored SGD steps of ``model`` (each inside ``context_parallel`` where
    ``parallel``)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    spectrum, entropy = QKSpectrum(per_head=True), AttentionEntropy(per_head=True)
    rank = EffectiveRank(per_head=True)
    monitoring = Monitoring(model, [spectrum, entropy, rank], every_n_steps=1, optimizer=optimizer)
    world = dist.get_world_size()
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(2):
                inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
                positions = torch.arange(T).expand(len(tokens), T).clone()
                with monitoring.step(step):
                    with _context(parallel, inputs, targets, positions):
                        logits = model(inputs, positions)
                        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
                        loss.backward()
                    if parallel:  # each rank's loss is its chunk's mean: average them
                        for p in model.parameters():
                            dist.all_reduce(p.grad)
                            p.grad.div_(world)
                        loss = loss.detach().clone()
                        dist.all_reduce(loss)
                        loss.div_(world)
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss.item())
        finally:
            monitoring.close()
    return {
        "losses": losses,
        "stopped": monitoring.should_stop,
        "entropy": {k: [t.clone() for t in v] for k, v in entropy.latest.items()},
        "spectrum": {k: [t.clone() for t in v] for k, v in spectrum.latest.items()},
        "rank": {k: [t.clone() for t in v] for k, v in rank.latest.items()},
        "warnings": [str(w.message) for w in caught],
    }


def run(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    tokens = torch.randint(0, VOCAB, (4, T + 1), generator=torch.Generator().manual_seed(1))
    runs = {}
    for parallel in (False, True):
        torch.manual_seed(0)
        model = Model()
        with torch.no_grad():  # sharper heads than at initialisation: entropies differ
            for layer in model.layers:
                layer.attn.q_proj.weight.mul_(3.0)
        runs[parallel] = train(model, tokens, parallel)
    torch.save(runs, f"{out_dir}/values_{rank}.pt")
    del model  # its DTensors hold the group: gone while the interpreter is whole, not at exit
    gc.collect()
    dist.barrier()  # both ranks done with every collective before either tears gloo down
    dist.destroy_process_group()


try:  # imported by the test run's module collection
    from .jobs import two_ranks
except ImportError:  # run as the job script
    from jobs import two_ranks


def main() -> None:
    two_ranks(run, sys.argv[1])


if __name__ == "__main__":
    main()
