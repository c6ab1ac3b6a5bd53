"""A tiny training job for the distributed test:
`python ddp_job.py OUT_DIR DEVICES BATCH_PER_DEVICE [clip | qkmonitor | qkmonitor-background]`.

With ``clip``, QKClip alone runs (tau 0.5, below every head's logits) and each rank saves its query
and key weights after the fit to ``OUT_DIR/qk_rank{R}.pt``. With ``qkmonitor``, one QKMonitor runs
in place of the three callbacks, and each rank writes to ``OUT_DIR/collectives_rank{R}.json`` the
collectives ``torch.distributed`` was asked for inside each of its hook calls that probed, by step;
``qkmonitor-background`` the same on a GPU's paths: the spectrum computed on its worker thread
(``background_weights=True``) and each probe logged at the end of the next batch
(``defer_reads=True``).

Lightning's DDP launcher re-runs this script once per extra rank; every rank sees the same
generated data, and the DistributedSampler (shuffle off) deals rank r the samples r, r+W, r+2W, ...
so one global batch of the DDP run is the single-process run's batch.
"""

import json
import os
import sys
from collections import Counter

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from qkmonitor.callbacks import (
    AttentionEntropyMonitor,
    EffectiveRankMonitor,
    QKClip,
    QKMonitor,
    QKSpectrumMonitor,
)
from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import CausalLMTask, make_recall_batch


class Job(CausalLMTask):
    def train_dataloader(self):
        tokens, targets = make_recall_batch(64, 3, 3, 8, 8, torch.Generator().manual_seed(0))
        data = TensorDataset(tokens, targets)
        sampler = DistributedSampler(data, shuffle=False) if self.trainer.world_size > 1 else None
        return DataLoader(data, batch_size=int(sys.argv[3]), sampler=sampler, shuffle=False)


COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "all_gather_object",
)


class CountedQKMonitor(QKMonitor):
    """QKMonitor counting the collectives asked for inside ``on_train_batch_end``, by step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.collectives: dict[int, Counter] = {}
        self._inside = False
        for name in COLLECTIVES:
            original = getattr(torch.distributed, name)

            def counted(*args, _original=original, _name=name, **kw):
                if self._inside:
                    self.collectives.setdefault(self._batch_step, Counter())[_name] += 1
                return _original(*args, **kw)

            setattr(torch.distributed, name, counted)

    def on_train_batch_end(self, *args, **kwargs):
        self._inside = True
        try:
            super().on_train_batch_end(*args, **kwargs)
        finally:
            self._inside = False


try:  # imported by the test run's module collection
    from .jobs import seed_other_ranks
except ImportError:  # run as the job script
    from jobs import seed_other_ranks


def main() -> None:
    out_dir, devices = sys.argv[1], int(sys.argv[2])
    if "LOCAL_RANK" not in os.environ:  # rank 0 before the launch
        seed_other_ranks()  # the ranks Lightning's launcher starts hash strings otherwise
    pl.seed_everything(0, verbose=False)
    model = Job(
        TransformerConfig(vocab_size=16, d_model=32, n_heads=4, max_seq_len=9),
        lr=1e-3,
        warmup_steps=0,
    )
    clip = len(sys.argv) > 4 and sys.argv[4] == "clip"
    one = len(sys.argv) > 4 and sys.argv[4] in ("qkmonitor", "qkmonitor-background")
    background = one and sys.argv[4] == "qkmonitor-background"
    monitors = (
        [QKClip(tau=0.5, per_head=True)]
        if clip
        else [
            CountedQKMonitor(
                every_n_steps=2,
                per_head=True,
                spectrum={"background_weights": background},
                defer_reads=background or None,
            )
        ]
        if one
        else [
            AttentionEntropyMonitor(every_n_steps=2, per_head=True),
            QKSpectrumMonitor(every_n_steps=2),
            EffectiveRankMonitor(every_n_steps=2),
        ]
    )
    trainer = pl.Trainer(
        default_root_dir=out_dir,
        max_steps=3,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=TensorBoardLogger(out_dir, "run"),
        callbacks=monitors,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    if clip:
        qk = {
            n: p.detach().clone()
            for n, p in model.named_parameters()
            if "q_proj" in n or "k_proj" in n
        }
        torch.save(qk, f"{out_dir}/qk_rank{trainer.global_rank}.pt")
    if one:
        counts = {step: dict(c) for step, c in monitors[0].collectives.items()}
        with open(f"{out_dir}/collectives_rank{trainer.global_rank}.json", "w") as f:
            json.dump(counts, f)


if __name__ == "__main__":
    main()
