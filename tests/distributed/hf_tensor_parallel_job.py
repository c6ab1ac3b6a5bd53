"""A Hugging Face LLaMA under tensor parallelism, for the distributed test: `python
hf_tensor_parallel_job.py OUT_DIR`.

Spawns two gloo ranks. For 4 key heads (MHA) and for 2 (GQA), a tiny ``LlamaForCausalLM`` built
from its config is saved once (``save_pretrained``) and loaded on each rank three ways: whole (one
process's values: every rank alike), with a user's ``parallelize_module`` plan on every layer's
``self_attn`` (``ColwiseParallel`` q/k/v, ``RowwiseParallel`` o), and with transformers' own
tensor parallelism (``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``,
which runs on CPU over gloo), so that each rank computes H / 2 of the heads. Each trains two SGD
steps on the same 4 sequences with the spectrum, entropy (sink mass too), rank and QK-Clip engines,
per head, in a plain loop. Then qkmonitor's own decoder with its attention split the same way (its
head counts set to this rank's part, as torchtitan does), which is refused by name. Each rank saves
its losses, latest values, QK-Clip counts, warnings, (rank 0, the only one that writes) scalars and
histograms, and the query weights after training, to ``OUT_DIR/values_RANK.pt``.
"""

import gc
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKClipEngine, QKSpectrum
from qkmonitor.models.config import TransformerConfig
from qkmonitor.models.transformer import DecoderLM
from qkmonitor.output.sinks import MemorySink

VOCAB, T, H = 40, 8, 4
#: QK-Clip's bound: below the largest logits of some heads, so that some are clipped
TAU = 2.0


def llama_config(kv_heads: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        initializer_range=0.2,  # sharper heads than the default's: their entropies differ
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def attention_plan(model, mesh) -> None:
    """A user's plan: every attention's projections split across the ranks."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "q_proj": ColwiseParallel(),
        "k_proj": ColwiseParallel(),
        "v_proj": ColwiseParallel(),
        "o_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer.self_attn, mesh, plan)


def bundled_split(model, mesh) -> None:
    """qkmonitor's own attention split as torchtitan splits its own: the projections by rows, the
    head counts set to this rank's part."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "q_proj": ColwiseParallel(),
        "k_proj": ColwiseParallel(),
        "v_proj": ColwiseParallel(),
        "o_proj": RowwiseParallel(),
    }
    ranks = mesh.size()
    for block in model.blocks:
        parallelize_module(block.attn, mesh, plan)
        block.attn.n_heads //= ranks
        block.attn.n_kv_heads //= ranks


def train(model, tokens, *, tensor_parallel: bool) -> dict:
    """Two monitored SGD steps of ``model``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engines = {
        "spectrum": QKSpectrum(per_head=True),
        "entropy": AttentionEntropy(per_head=True, sink_tokens=2),
        # the one-process runs are dealt 8 sequences over the two data-parallel ranks (4 each),
        # the tensor-parallel ranks are one replica and each measures the 4
        "rank": EffectiveRank(per_head=True, max_probe_sequences=4 if tensor_parallel else 8),
        "clip": QKClipEngine(tau=TAU, per_head=True),
    }
    sink = MemorySink() if dist.get_rank() == 0 else None  # the user's choice: rank 0 writes
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
                    logits = getattr(logits, "logits", logits)
                    loss = F.cross_entropy(
                        logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1)
                    )
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss.item())
        finally:
            monitoring.close()
    q_weights = [m.q_proj.weight for m in model.modules() if hasattr(m, "q_proj")]
    return {
        "losses": losses,
        "stopped": monitoring.should_stop,
        **{
            name: {k: [t.clone() for t in v] for k, v in engine.latest.items()}
            for name, engine in engines.items()
        },
        "clip_counts": [c.clone() for c in engines["clip"].clip_counts],
        "q_weights": [getattr(w, "full_tensor", w.detach)().detach().clone() for w in q_weights],
        "warnings": [str(w.message) for w in caught],
        "scalars": None if sink is None else {(tag, step): v for tag, v, step in sink.scalars},
        "histograms": None if sink is None else [(t, v.clone(), s) for t, v, s in sink.histograms],
    }


def run(rank: int, world: int, out_dir: str) -> None:
    # transformers' tensor parallelism reads the launcher's variables
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    transformers.logging.set_verbosity_error()
    tokens = torch.randint(0, VOCAB, (4, T + 1), generator=torch.Generator().manual_seed(1))
    runs = {}
    for kv_heads in (H, 2):
        saved = f"{out_dir}/llama_{kv_heads}"
        if rank == 0:
            torch.manual_seed(0)
            transformers.LlamaForCausalLM(llama_config(kv_heads)).save_pretrained(saved)
        dist.barrier()
        load = transformers.LlamaForCausalLM.from_pretrained
        runs[kv_heads, "whole"] = train(load(saved), tokens, tensor_parallel=False)
        model = load(saved)
        attention_plan(model, mesh)
        runs[kv_heads, "plan"] = train(model, tokens, tensor_parallel=True)
        split = transformers.DistributedConfig(tp_plan="auto")
        runs[kv_heads, "tp_plan"] = train(
            load(saved, distributed_config=split), tokens, tensor_parallel=True
        )
    torch.manual_seed(0)
    model = DecoderLM(TransformerConfig(vocab_size=VOCAB, d_model=32, n_heads=H, max_seq_len=16))
    bundled_split(model, mesh)
    runs["bundled"] = train(model, tokens, tensor_parallel=True)
    torch.save(runs, f"{out_dir}/values_{rank}.pt")
    del model, mesh  # they hold the group: gone while the interpreter is whole, not at exit
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
