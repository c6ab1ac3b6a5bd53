"""Training steps per second with the monitors on, against none, on the bundled default model.

Three configurations of ``qkmonitor train``'s default model and task run interleaved, several
rounds each, so machine noise hits them alike: no monitor; all three monitors at
``every_n_steps=50`` (the aim is <= 2 % overhead); all three at every step. Time is measured from
``on_train_start`` to ``on_train_end`` (Trainer setup is left out) and the median round is kept.

Usage::

    python benchmarks/overhead.py                 # 300 steps x 3 rounds
    python benchmarks/overhead.py --steps 100 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import AssociativeRecallDataModule, CausalLMTask


class TrainTimer(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        self.seconds = time.perf_counter() - self.start


def monitors(every: int | None) -> list[pl.Callback]:
    if every is None:
        return []
    return [QKSpectrumMonitor(every_n_steps=every), AttentionEntropyMonitor(every_n_steps=every),
            EffectiveRankMonitor(every_n_steps=every)]


def run(steps: int, every: int | None, log_root: str) -> float:
    pl.seed_everything(0, verbose=False)
    data = AssociativeRecallDataModule(seed=0)
    config = TransformerConfig(vocab_size=data.vocab_size, max_seq_len=data.seq_len)
    timer = TrainTimer()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=TensorBoardLogger(log_root),
                         callbacks=[timer, *monitors(every)], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                         log_every_n_steps=50)
    trainer.fit(CausalLMTask(config), datamodule=data)
    return steps / timer.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    configs = {"no monitor": None, "all monitors, every 50 steps": 50, "all monitors, every step": 1}
    rates: dict[str, list[float]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as log_root:
        for _ in range(args.rounds):
            for name, every in configs.items():
                rates[name].append(run(args.steps, every, log_root))
    base = statistics.median(rates["no monitor"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps x {args.rounds} rounds")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"  {name:32s} {rate:8.1f} steps/s   overhead {100 * (base / rate - 1):+6.1f} %")


if __name__ == "__main__":
    main()
