"""A LLaMA-style attention under tensor parallelism, for the distributed test: `python
tensor_parallel_job.py OUT_DIR`.

Starts two gloo ranks, each with its own string hash seed (``jobs.two_ranks``). For 4 key heads
(MHA), 2 (GQA) and 1 (MQA), and GQA again with its head counts named (its layout candidates read
before a call, both projections gathered whole for the first probe's layout check, :data:`CASES`),
each rank trains two steps (SGD) on the same 4 sequences with the spectrum, entropy (sink mass too),
rank and QK-Clip engines, per head, in a plain loop: first the plain model (every rank alike: one
process's values), then the same weights with every attention ``parallelize_module``d
(``ColwiseParallel`` on q_proj, k_proj and v_proj, ``RowwiseParallel`` on o_proj), and the
vocabulary projection too (its logits a DTensor split along the vocabulary, the loss under
``loss_parallel``), so that each rank computes H / 2 of the heads (the forward's ``view(b, t, -1,
head_dim)``). Each rank saves its losses, latest values, QK-Clip counts, warnings and (rank 0, the
only one that writes) scalars and histograms of both runs, and the query weights after training, to
``OUT_DIR/values_RANK.pt``; and, under ``("mha", "background")``, the tensor-parallel MHA run again
with the spectrum on its worker thread (``background_weights=True``).
"""

import gc
import sys
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import distributed_c10d as c10d

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKClipEngine, QKSpectrum
from qkmonitor.engine.background import WEIGHTS_WORKER
from qkmonitor.output.sinks import MemorySink

D, H, HEAD_DIM, T, VOCAB = 32, 4, 8, 8, 16
#: QK-Clip's bound: below the sharpened heads' largest logits, so that some heads are clipped
TAU = 2.0


class SumGradient(torch.autograd.Function):
    """Identity forward; backward, the sum of the gradient over the ranks (Megatron's "copy to
    the tensor-parallel region"): the input of MQA's replicated k/v projections, whose gradient on
    each rank comes from its own query heads only."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        c10d.all_reduce(grad)  # not dist.all_reduce: that one is counted
        return grad


class Attention(nn.Module):
    #: set under TP for MQA: k_proj and v_proj replicated, their input's gradient summed
    replicated_kv = False

    def __init__(self, kv_heads: int, named: bool = False) -> None:
        super().__init__()
        if named:  # head counts by name: the layout candidates are read from them before a call
            self.num_heads, self.num_key_value_heads = H, kv_heads
        self.q_proj = nn.Linear(D, H * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(D, kv_heads * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(D, kv_heads * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(H * HEAD_DIM, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        x_kv = SumGradient.apply(x) if self.replicated_kv else x
        k = self.k_proj(x_kv).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x_kv).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, kv_heads: int, named: bool = False) -> None:
        super().__init__()
        self.attn = Attention(kv_heads, named)

    def forward(self, x):
        return x + self.attn(x)


class Model(nn.Module):
    def __init__(self, kv_heads: int, named: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Layer(kv_heads, named), Layer(kv_heads, named)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


#: the cases: their key heads, and whether the attention names its head counts (``num_heads``,
#: ``num_key_value_heads``: its layout candidates read before a call, the weights of both of them
#: gathered for the layout check) or its calls tell them
CASES = {"mha": (H, False), "gqa": (2, False), "mqa": (1, False), "gqa_named": (2, True)}

#: the collectives of torch.distributed's own API (qkmonitor's; DTensor's go through the
#: functional collectives, not counted)
COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "all_gather_object", "reduce", "gather")


@contextmanager
def counted_collectives():
    """Count the calls of :data:`COLLECTIVES` into the last Counter of the list yielded."""
    steps: list[Counter] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counter(name):
        def call(*args, **kwargs):
            if steps:
                steps[-1][name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, counter(name))
    try:
        yield steps
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def sum_replicated_gradients(model: Model) -> None:
    """MQA under TP (one key/value head, so k_proj and v_proj replicated, as Megatron replicates
    them): each rank's gradient of those weights holds its own query heads' part; their sum over
    the ranks is one process's."""
    for layer in model.layers:
        for proj in (layer.attn.k_proj, layer.attn.v_proj):
            if not hasattr(proj.weight, "full_tensor"):  # a plain (replicated) weight
                c10d.all_reduce(proj.weight.grad)  # not dist.all_reduce: that one is counted


def train(model: Model, tokens, parallel: bool, background: bool = False) -> dict:
    """Two monitored SGD steps of ``model`` (its attention tensor-parallel where ``parallel``; the
    spectrum on its worker thread with ``background``)."""
    if parallel:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            loss_parallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        plan = {"q_proj": ColwiseParallel(), "o_proj": RowwiseParallel()}
        mqa = model.layers[0].attn.k_proj.out_features == HEAD_DIM  # k, v replicated
        if not mqa:
            plan.update({"k_proj": ColwiseParallel(), "v_proj": ColwiseParallel()})
        for layer in model.layers:
            parallelize_module(layer.attn, mesh, plan)
            layer.attn.replicated_kv = mqa
        # the vocabulary split too, the logits a DTensor (loss parallelism, as torchtitan's)
        vocabulary = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(model, mesh, {"head": vocabulary})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engines = {
        "spectrum": QKSpectrum(per_head=True, background_weights=background),
        "entropy": AttentionEntropy(per_head=True, sink_tokens=2),
        # 4 probe sequences (the batch) measured as one process measures them: the unsharded run
        # is in the 2-rank group too, where the engine deals 8 as 4 + 4 over two data-parallel
        # ranks; the tensor-parallel ranks are one replica, and each measures the 4
        "rank": EffectiveRank(per_head=True, max_probe_sequences=4 if parallel else 8),
        "clip": QKClipEngine(tau=TAU, per_head=True),
    }
    sink = MemorySink() if dist.get_rank() == 0 else None  # the user's choice: rank 0 writes
    monitoring = Monitoring(
        model, list(engines.values()), writer=sink, every_n_steps=1, optimizer=optimizer
    )
    losses, jobs = [], []
    submit = WEIGHTS_WORKER.submit
    WEIGHTS_WORKER.submit = lambda *job: jobs.append(job) or submit(*job)  # counted
    with warnings.catch_warnings(record=True) as caught, counted_collectives() as collectives:
        warnings.simplefilter("always")
        try:
            for step in range(2):
                collectives.append(Counter())
                with monitoring.step(step), loss_parallel() if parallel else nullcontext():
                    logits = model(tokens[:, :-1])
                    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
                    loss.backward()
                    if parallel:
                        sum_replicated_gradients(model)
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss.item())
        finally:
            monitoring.close()
            del WEIGHTS_WORKER.submit
    q_weights = [layer.attn.q_proj.weight for layer in model.layers]
    return {
        "losses": losses,
        "stopped": monitoring.should_stop,
        "collectives": [dict(c) for c in collectives],
        "run": dict(engines["entropy"].latest_run),
        **{
            name: {k: [t.clone() for t in v] for k, v in engine.latest.items()}
            for name, engine in engines.items()
        },
        "clip_counts": [c.clone() for c in engines["clip"].clip_counts],
        "q_weights": [getattr(w, "full_tensor", w.detach)().detach().clone() for w in q_weights],
        "warnings": [str(w.message) for w in caught],
        "worker_jobs": len(jobs),
        "scalars": None if sink is None else {(tag, step): v for tag, v, step in sink.scalars},
        "histograms": None if sink is None else [(t, v.clone(), s) for t, v, s in sink.histograms],
    }


def run(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world
    )
    tokens = torch.randint(0, VOCAB, (4, T + 1), generator=torch.Generator().manual_seed(1))
    runs = {}
    for case, (kv_heads, named) in CASES.items():
        for parallel in (False, True):
            torch.manual_seed(0)
            model = Model(kv_heads, named)
            with torch.no_grad():  # sharper heads than at initialisation: entropies differ
                for layer in model.layers:
                    layer.attn.q_proj.weight.mul_(3.0)
            runs[case, parallel] = train(model, tokens, parallel)
    # and the spectrum of each rank's heads on its worker thread (background_weights=True), from
    # a copy of the rows it computes with, exchanged in the same collective
    torch.manual_seed(0)
    model = Model(H)
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.q_proj.weight.mul_(3.0)
    runs["mha", "background"] = train(model, tokens, True, background=True)
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
