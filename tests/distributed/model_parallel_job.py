"""FSDP2 over tensor parallelism through Lightning, for the distributed test: `python
model_parallel_job.py OUT_DIR KV_HEADS [named]`.

First a one-process fit (``Trainer(accelerator="cpu", devices=1)``) of tensor_parallel_job's
LLaMA-style model, left whole; then the same model, weights and data fitted with
``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)`` on two gloo ranks
(Lightning's launcher re-runs this script for rank 1, with another string hash seed, and rank 1
skips the one-process fit):
``configure_model`` ``parallelize_module``s every attention (``ColwiseParallel`` q/k/v,
``RowwiseParallel`` o) on the ``tensor_parallel`` mesh and then ``fully_shard``s every layer and
the model on the ``data_parallel`` one, so that the projections' parameters are DTensors on the
1 x 2 mesh and the forward computes with their 1-D tensor-parallel DTensors. Every rank sees every
batch, in order (one data-parallel rank; no distributed sampler: Lightning's shuffles a training
set). Both fits train three SGD steps with the README's ``QKMonitor`` (per head, every step) and
``QKClip`` (its bound below the sharpened heads' logits) and log to a ``TensorBoardLogger`` under
``OUT_DIR/single`` and ``OUT_DIR/parallel``; each rank saves its warnings and (rank 0) the query and
key weights after the fit, whole, to ``OUT_DIR/{single,parallel}_rank{R}.pt``. With ``named``,
the attention names its head counts (tensor_parallel_job's ``Model(kv_heads, named=True)``).
"""

import os
import sys
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

from qkmonitor import QKMonitor
from qkmonitor.callbacks import QKClip

try:  # imported by the test run's module collection
    from .jobs import seed_other_ranks
    from .tensor_parallel_job import TAU, VOCAB, Model
except ImportError:  # run as the job script
    from jobs import seed_other_ranks
    from tensor_parallel_job import TAU, VOCAB, Model

T = 8


class Job(pl.LightningModule):
    def __init__(self, kv_heads: int, parallel: bool, named: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Model(kv_heads, named)
        with torch.no_grad():  # sharper heads than at initialisation: entropies differ, heads clip
            for layer in self.model.layers:
                layer.attn.q_proj.weight.mul_(3.0)
        self.parallel = parallel

    def configure_model(self) -> None:
        if not self.parallel:
            return
        from torch.distributed.fsdp import fully_shard
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
        for layer in self.model.layers:
            parallelize_module(layer.attn, self.device_mesh["tensor_parallel"], plan)
        for layer in self.model.layers:
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        tokens = torch.randint(0, VOCAB, (12, T + 1), generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(tokens), batch_size=4, shuffle=False)


def fit(out_dir: str, kv_heads: int, parallel: bool, named: bool = False) -> None:
    name = "parallel" if parallel else "single"
    job = Job(kv_heads, parallel, named)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 if parallel else 1,
        strategy=(
            ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
            if parallel
            else "auto"
        ),
        max_steps=3,
        default_root_dir=out_dir,
        logger=TensorBoardLogger(out_dir, name=name),
        callbacks=[
            # the rank engine's default 4 probe sequences: the whole batch, on each of the
            # tensor-parallel ranks (one data-parallel replica), as in one process
            QKMonitor(every_n_steps=1, per_head=True, spectrum={"update_spectrum": True}),
            QKClip(tau=TAU, per_head=True),
        ],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,  # Lightning's would shuffle the training batches
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(job)
    weights = {
        n: getattr(p, "full_tensor", p.detach)().detach().clone()
        for n, p in job.model.named_parameters()
        if "q_proj" in n or "k_proj" in n
    }
    torch.save(
        {
            "warnings": [str(w.message) for w in caught],
            "weights": weights if trainer.global_rank == 0 else None,
        },
        f"{out_dir}/{name}_rank{trainer.global_rank}.pt",
    )


def main() -> None:
    out_dir, kv_heads, named = sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["named"]
    if "LOCAL_RANK" not in os.environ:  # rank 0 before the launch: the one-process reference
        fit(out_dir, kv_heads, parallel=False, named=named)
        seed_other_ranks()  # rank 1, which Lightning's launcher starts, hashes strings otherwise
    fit(out_dir, kv_heads, parallel=True, named=named)


if __name__ == "__main__":
    main()
