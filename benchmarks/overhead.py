"""Training steps per second with the monitors on, against none, on a bundled model.

Three configurations run interleaved, several rounds each, so machine noise hits them alike: no
monitor; all three monitors at ``every_n_steps=50`` (the aim is <= 2 % steady-state overhead); all
three at every step. Each batch is timed from one ``on_train_batch_end`` to the next (on CUDA the
device is synchronized there), so a step's time holds everything the monitors do in it. Printed
per configuration (medians over rounds):

- **steady state**: steps/s over batches 1..N-1 and the overhead against no monitor. Batch 0 is
  left out of every configuration: it carries first-call costs with or without monitors;
- **per probe window** (in-run, so run-to-run noise cancels): the median time of the batches a
  monitor touched (the activation probes' and the spectrum's) minus the median of the others,
  and that cost spread over ``every_n_steps`` plain steps;
- **one-time**: the monitors' setup (binding, the layout and hparams header: from the Trainer's
  ``setup`` to the first batch, against no monitor) and the extra time of the first window.

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


class Clock(pl.Callback):
    """Times from ``setup`` to the first batch, and between consecutive batch ends. Put it first
    in the callback list, so that its ``setup`` comes before every other callback's."""

    def __init__(self) -> None:
        self.marks: list[float] = []
        self.setup_at = self.first_batch_at = 0.0

    def setup(self, trainer, pl_module, stage):
        self.setup_at = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            _synchronize(pl_module)
            self.first_batch_at = time.perf_counter()
            self.marks.append(self.first_batch_at)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _synchronize(pl_module)
        self.marks.append(time.perf_counter())

    @property
    def steps(self) -> list[float]:
        """Seconds of each batch, in order."""
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    @property
    def steady(self) -> float:
        """Seconds of batches 1..N-1."""
        return sum(self.steps[1:])


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


def run(args, every: int | None, log_root: str, steps: int | None = None) -> Clock:
    steps = args.steps if steps is None else steps
    pl.seed_everything(0, verbose=False)
    task, data = task_and_data(args.model, steps)
    timer = Clock()
    trainer = pl.Trainer(max_steps=steps, accelerator=args.device, devices=1,
                         precision=args.precision, logger=TensorBoardLogger(log_root),
                         callbacks=[timer, *monitors(every)], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                         log_every_n_steps=50)  # fmt: skip
    trainer.fit(task, datamodule=data)
    return timer


def touched(batch: int, every: int) -> bool:
    """Whether a monitor works in this batch: activation probes open on steps 0, n, 2n, ...; the
    spectrum reads the weights after the updates that make the step count a multiple of n."""
    return batch % every == 0 or (batch + 1) % every == 0


def measure(args) -> dict[str, dict[str, float]]:
    """Per configuration: steady steps/s, overhead, per-window cost, its spread, setup and first
    window (medians over rounds). With ``--dry-run`` the model and data are built (so that the
    configuration is checked) but nothing trains, and every figure is NaN."""
    if args.dry_run:
        task, data = task_and_data(args.model, args.steps)
        data.setup("fit")
        del task, data
        return {name: {"steps_per_s": math.nan} for name in CONFIGS}
    clocks: dict[str, list[Clock]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as log_root:
        if args.warmup_steps:  # first-call costs (Triton autotuning, compiles) out of the rounds
            run(args, 1, log_root, steps=args.warmup_steps)
        for _ in range(args.rounds):
            for name, every in CONFIGS.items():
                clocks[name].append(run(args, every, log_root))
    base = clocks["no monitor"]
    plain_step = statistics.median(s for c in base for s in c.steps[1:])
    figures: dict[str, dict[str, float]] = {}
    for name, every in CONFIGS.items():
        rounds = clocks[name]
        out = {"steps_per_s": (args.steps - 1) / statistics.median(c.steady for c in rounds),
               "overhead": statistics.median(c.steady / b.steady - 1 for c, b in zip(rounds, base))}
        if every is not None:
            out["setup_s"] = statistics.median(c.first_batch_at - c.setup_at for c in rounds) - statistics.median(
                b.first_batch_at - b.setup_at for b in base)
            out["first_window_s"] = statistics.median(c.steps[0] for c in rounds) - statistics.median(
                b.steps[0] for b in base)
        if every is not None and every > 1:
            window = statistics.median(
                statistics.median(s for i, s in enumerate(c.steps) if i and touched(i, every))
                - statistics.median(s for i, s in enumerate(c.steps) if i and not touched(i, every))
                for c in rounds)
            out["window_s"] = window
            out["spread"] = 2 * window / (every * plain_step)  # two touched batches per window
        figures[name] = out
    figures["no monitor"]["plain_step_s"] = plain_step
    return figures


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
    figures = measure(args)
    where = torch.cuda.get_device_name() if args.device == "cuda" and not args.dry_run else (
        f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"torch {torch.__version__}, {where}, model {args.model}, precision {args.precision}, "
          f"{args.steps} steps x {args.rounds} rounds")  # fmt: skip
    print(f"  {'configuration':30s} {'steady steps/s':>14s} {'overhead':>9s} {'per window':>11s} {'spread':>8s} "
          f"{'setup':>8s} {'first window':>13s}")
    for name, f in figures.items():
        line = f"  {name:30s} {f['steps_per_s']:14.1f} {100 * f.get('overhead', math.nan):+8.1f}%"
        if "window_s" in f:
            line += f" {1e3 * f['window_s']:9.1f}ms {100 * f['spread']:+7.2f}%"
        elif "setup_s" in f:
            line += f" {'(all)':>11s} {'':>8s}"
        if "setup_s" in f:
            line += f" {1e3 * f['setup_s']:6.0f}ms {1e3 * f['first_window_s']:11.0f}ms"
        print(line)
    print("  overhead: steady-state time against no monitor (batches 1..N-1); per window: a touched batch minus an "
          "untouched one, in-run; spread: that over every_n_steps plain steps")
    if args.json:
        rates = {name: f["steps_per_s"] for name, f in figures.items()}
        args.json.write_text(json.dumps({"model": args.model, "precision": args.precision,
                                         "device": args.device, "steps": args.steps,
                                         "steps_per_s": rates, "figures": figures}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
