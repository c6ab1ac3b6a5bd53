"""Training steps per second with the monitors on, against none, on a bundled model.

Three configurations run interleaved, several rounds each, so machine noise hits them alike: no
monitor; all three monitors at ``every_n_steps=50`` (the aim is <= 2 % overhead); all three at
every step. Time is measured from ``on_train_start`` to ``on_train_end`` (Trainer setup is left
out; on CUDA the device is synchronized at both ends) and the median round is kept.

Models (``--model``):

- ``default``: ``qkmonitor train``'s default model and task (associative recall), the CPU figure.
- ``gpt2-small``: a GPT-2-small-sized decoder (12 layers, d = 768, 12 heads of 64, 1024 tokens a
  sequence, batch 8) on bytes of the Python standard library's source (``PythonSourceDataModule``,
  nothing downloaded); with ``--device cuda --precision bf16-mixed`` its attention runs the
  Triton kernel under autocast.

Usage::

    python benchmarks/overhead.py                 # 300 steps x 3 rounds, CPU
    python benchmarks/overhead.py --steps 100 --rounds 2
    python benchmarks/overhead.py --device cuda --model gpt2-small --precision bf16-mixed \\
        --steps 60 --rounds 1 --warmup-steps 4 --json overhead.json
    python benchmarks/overhead.py --dry-run       # arguments and report only, nothing trained
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import (
    AssociativeRecallDataModule,
    CausalLMTask,
    CharLMTask,
    PythonSourceDataModule,
)

CONFIGS = {"no monitor": None, "all monitors, every 50 steps": 50, "all monitors, every step": 1}


class TrainTimer(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        _synchronize(pl_module)
        self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        _synchronize(pl_module)
        self.seconds = time.perf_counter() - self.start


def _synchronize(pl_module) -> None:
    device = next(pl_module.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def monitors(every: int | None) -> list[pl.Callback]:
    if every is None:
        return []
    return [
        QKSpectrumMonitor(every_n_steps=every),
        AttentionEntropyMonitor(every_n_steps=every),
        EffectiveRankMonitor(every_n_steps=every),
    ]


def task_and_data(model: str, steps: int) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    if model == "default":
        data = AssociativeRecallDataModule(seed=0)
        config = TransformerConfig(vocab_size=data.vocab_size, max_seq_len=data.seq_len)
        return CausalLMTask(config), data
    seq_len, batch = 1024, 8
    data = PythonSourceDataModule(max_chars=4_000_000, seq_len=seq_len, batch_size=batch,
                                  train_size=batch * steps, val_size=batch, seed=0)  # fmt: skip
    config = TransformerConfig(vocab_size=data.vocab_size, d_model=768, n_layers=12, n_heads=12,
                               max_seq_len=seq_len, positional="learned")  # fmt: skip
    return CharLMTask(config, warmup_steps=10), data


def run(args, every: int | None, log_root: str, steps: int | None = None) -> float:
    steps = args.steps if steps is None else steps
    pl.seed_everything(0, verbose=False)
    task, data = task_and_data(args.model, steps)
    timer = TrainTimer()
    trainer = pl.Trainer(max_steps=steps, accelerator=args.device, devices=1,
                         precision=args.precision, logger=TensorBoardLogger(log_root),
                         callbacks=[timer, *monitors(every)], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                         log_every_n_steps=50)  # fmt: skip
    trainer.fit(task, datamodule=data)
    return steps / timer.seconds


def measure(args) -> dict[str, float]:
    """Median steps per second of each configuration. With ``--dry-run`` the model and data are
    built (so that the configuration is checked) but nothing trains, and every rate is NaN."""
    if args.dry_run:
        task, data = task_and_data(args.model, args.steps)
        data.setup("fit")
        del task, data
        return {name: math.nan for name in CONFIGS}
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as log_root:
        if args.warmup_steps:  # first-call costs (Triton autotuning, compiles) out of the rounds
            run(args, 1, log_root, steps=args.warmup_steps)
        for _ in range(args.rounds):
            for name, every in CONFIGS.items():
                rates[name].append(run(args, every, log_root))
    return {name: statistics.median(values) for name, values in rates.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--warmup-steps", type=int, default=0,
        help="an untimed run with every monitor at every step first (GPU: autotuning)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", choices=["default", "gpt2-small"], default="default")
    parser.add_argument("--precision", default="32-true", help="Lightning's, e.g. bf16-mixed")
    parser.add_argument("--json", type=Path, help="also write the rates to this file")
    parser.add_argument(
        "--dry-run", action="store_true", help="build model and data, train nothing"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not args.dry_run and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    rates = measure(args)
    base = rates["no monitor"]
    where = torch.cuda.get_device_name() if args.device == "cuda" and not args.dry_run else (
        f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"torch {torch.__version__}, {where}, model {args.model}, precision {args.precision}, "
          f"{args.steps} steps x {args.rounds} rounds")  # fmt: skip
    for name, rate in rates.items():
        print(f"  {name:32s} {rate:8.1f} steps/s   overhead {100 * (base / rate - 1):+6.1f} %")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "precision": args.precision,
                                         "device": args.device, "steps": args.steps,
                                         "steps_per_s": rates}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
