"""Tensor parallelism whose calls do not hold this rank's heads, for the distributed test:
`python tensor_parallel_heads_job.py OUT_DIR`.

Starts two gloo ranks, each with its own string hash seed (``jobs.two_ranks``). Each trains two
SGD steps of tensor_parallel_job's LLaMA-style model on the same 4 sequences with the spectrum,
entropy and rank engines, per head, in a plain loop: first the model left whole (every rank alike:
one process's values), then the same weights split across the ranks in one of :data:`CASES`:

- ``replicated``, ``replicated_named``: q/k/v ``ColwiseParallel(output_layouts=Replicate())``,
  o left whole: each rank computes its rows of every projection, and the outputs are gathered,
  so that every rank's attention call holds all 4 heads (the head counts told by the calls, or
  named by the module's ``num_heads``);
- ``global_view``: q/k/v ``ColwiseParallel``, o ``RowwiseParallel``, and a module that views its
  projections' outputs with its global head count and ``-1`` (``view(b, t, self.num_heads, -1)``):
  under the split each rank's call holds 4 "heads" of 4 features, halves of its 2 heads of 8 (the
  model is wrong under tensor parallelism; its attention is not one process's).

Each rank saves its losses, latest values, warnings and (rank 0, the only one that writes) scalar
tags of both runs to ``OUT_DIR/values_RANK.pt``.
"""

import gc
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink

try:  # imported by the test run's module collection
    from .jobs import two_ranks
    from .tensor_parallel_job import VOCAB, Attention, H, Model, T
except ImportError:  # run as the job script
    from jobs import two_ranks
    from tensor_parallel_job import VOCAB, Attention, H, Model, T

#: case -> (the module names its head counts, its forward views by the global head count)
CASES = {
    "replicated": (False, False),
    "replicated_named": (True, False),
    "global_view": (True, True),
}


class GlobalViewAttention(Attention):
    """``Attention`` written for one process: its projections viewed with the global head counts
    (``num_heads``, ``num_key_value_heads``) and ``-1`` for the head dim."""

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_key_value_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_key_value_heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def build(named: bool, view: bool) -> Model:
    """tensor_parallel_job's model (seeded: the same weights every time), its query weights
    sharpened (entropies differ between heads); its attention ``GlobalViewAttention`` where
    ``view``."""
    torch.manual_seed(0)
    model = Model(H, named)
    for layer in model.layers:
        if view:
            whole = GlobalViewAttention(H, named)
            whole.load_state_dict(layer.attn.state_dict())
            layer.attn = whole
        with torch.no_grad():
            layer.attn.q_proj.weight.mul_(3.0)
    return model


def split(model: Model, case: str) -> None:
    """Split every attention of ``model`` across the ranks as ``case`` says."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if case == "global_view":
        plan = {p: ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        plan["o_proj"] = RowwiseParallel()
    else:  # every rank's outputs gathered: all heads on every rank, o left whole
        gathered = ColwiseParallel(output_layouts=Replicate())
        plan = {p: gathered for p in ("q_proj", "k_proj", "v_proj")}
    for layer in model.layers:
        parallelize_module(layer.attn, mesh, plan)


def train(model: Model, tokens, case: str, parallel: bool) -> dict:
    """Two monitored SGD steps of ``model`` (split as ``case`` says where ``parallel``)."""
    if parallel:
        split(model, case)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engines = {
        "spectrum": QKSpectrum(per_head=True),
        "entropy": AttentionEntropy(per_head=True),
        # the 4 sequences on every rank, as one process measures them (one data-parallel replica)
        "rank": EffectiveRank(per_head=True, max_probe_sequences=4 if parallel else 8),
    }
    sink = MemorySink() if dist.get_rank() == 0 else None
    monitoring = Monitoring(
        model, list(engines.values()), writer=sink, every_n_steps=1, optimizer=optimizer
    )
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(2):
                with monitoring.step(step):
                    logits = model(tokens[:, :-1])
                    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss.item())
        finally:
            monitoring.close()
    return {
        "losses": losses,
        "stopped": monitoring.should_stop,
        **{
            name: {k: [t.clone() for t in v] for k, v in engine.latest.items()}
            for name, engine in engines.items()
        },
        "warnings": [str(w.message) for w in caught],
        "tags": None if sink is None else sorted({tag for tag, _, _ in sink.scalars}),
    }


def run(rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world
    )
    tokens = torch.randint(0, VOCAB, (4, T + 1), generator=torch.Generator().manual_seed(1))
    runs = {}
    for case, (named, view) in CASES.items():
        for parallel in (False, True):
            model = build(named, view)
            runs[case, parallel] = train(model, tokens, case, parallel)
    torch.save(runs, f"{out_dir}/values_{rank}.pt")
    del model  # its DTensors hold the group: gone while the interpreter is whole, not at exit
    gc.collect()
    dist.barrier()  # both ranks done with every collective before either tears gloo down
    dist.destroy_process_group()


def main() -> None:
    two_ranks(run, sys.argv[1])


if __name__ == "__main__":
    main()
