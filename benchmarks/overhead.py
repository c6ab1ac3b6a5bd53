"""What the monitors cost a training run: steady state, per probe window, and one-time.

Three configurations of ``qkmonitor train``'s default model and task (associative recall, the CLI's
d_model=64, 2 layers, 4 heads) run interleaved, several rounds each, so machine noise hits them
alike: no monitor; all three monitors at ``every_n_steps=50`` (the aim: <= 2 % steady-state
overhead); all three at every step. Each batch is timed from one ``on_train_batch_end`` to the
next, so a step's time holds everything the monitors do in it.

Printed per configuration (medians over rounds):

- **steady state**: steps/s over batches 1..N-1, and the overhead against no monitor. Batch 0 is
  left out of every configuration: it carries first-call costs (lazy imports, allocator warm-up)
  with or without monitors;
- **per probe window** (in-run, so run-to-run noise cancels): the median time of the batches a
  monitor touched (the activation probes' batches and the spectrum's) minus the median of the
  others, and that cost spread over ``every_n_steps`` batches, as a share of a plain step;
- **one-time**: the setup of the monitors (binding, the layout and hparams header: from the Trainer's
  ``setup`` to the first batch, against no monitor) and the extra time of the first probe window.

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


class Clock(pl.Callback):
    """Times from ``setup`` to the first batch and between consecutive batch ends.

    Put one instance first in the callback list and give it the same object last, so that the
    setup time covers every other callback's setup and each batch's time covers every other
    callback's batch hooks.
    """

    def __init__(self) -> None:
        self.marks: list[float] = []
        self.setup_at = self.first_batch_at = 0.0

    def setup(self, trainer, pl_module, stage):
        self.setup_at = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.first_batch_at = time.perf_counter()
            self.marks.append(self.first_batch_at)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.marks.append(time.perf_counter())

    @property
    def steps(self) -> list[float]:
        """Seconds of each batch, in order."""
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def monitors(every: int | None) -> list[pl.Callback]:
    if every is None:
        return []
    return [QKSpectrumMonitor(every_n_steps=every), AttentionEntropyMonitor(every_n_steps=every),
            EffectiveRankMonitor(every_n_steps=every)]


def run(steps: int, every: int | None, log_root: str) -> Clock:
    pl.seed_everything(0, verbose=False)
    data = AssociativeRecallDataModule(seed=0)
    config = TransformerConfig(vocab_size=data.vocab_size, max_seq_len=data.seq_len, d_model=64, n_layers=2,
                               n_heads=4, positional="rope")
    clock = Clock()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=TensorBoardLogger(log_root),
                         callbacks=[clock, *monitors(every)], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                         log_every_n_steps=50)
    trainer.fit(CausalLMTask(config), datamodule=data)
    return clock


def touched(batch: int, every: int) -> bool:
    """Whether a monitor works in this batch: activation probes open on steps 0, n, 2n, ...; the
    spectrum reads the weights after the updates that make the step count a multiple of n."""
    return batch % every == 0 or (batch + 1) % every == 0


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
    clocks: dict[str, list[Clock]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as log_root:
        for _ in range(args.rounds):
            for name, every in configs.items():
                clocks[name].append(run(args.steps, every, log_root))

    def steady(clock: Clock) -> float:
        return sum(clock.steps[1:])

    base = [steady(c) for c in clocks["no monitor"]]
    base_setup = statistics.median(c.first_batch_at - c.setup_at for c in clocks["no monitor"])
    base_first = statistics.median(c.steps[0] for c in clocks["no monitor"])
    plain_step = statistics.median(s for c in clocks["no monitor"] for s in c.steps[1:])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps x {args.rounds} rounds; "
          f"a plain step takes {1e3 * plain_step:.1f} ms")
    print(f"  {'configuration':30s} {'steady steps/s':>14s} {'overhead':>9s} {'per window':>11s} "
          f"{'spread':>8s} {'setup':>9s} {'first window':>13s}")
    for name, every in configs.items():
        rounds = clocks[name]
        seconds = statistics.median(steady(c) for c in rounds)
        overhead = statistics.median(steady(c) / b - 1 for c, b in zip(rounds, base))
        line = f"  {name:30s} {(args.steps - 1) / seconds:14.1f} {100 * overhead:+8.1f}%"
        if every is None:
            print(line)
            continue
        if every > 1:
            windows = [statistics.median(s for i, s in enumerate(c.steps) if i and touched(i, every))
                       - statistics.median(s for i, s in enumerate(c.steps) if i and not touched(i, every))
                       for c in rounds]
            window = statistics.median(windows)
            spread = 2 * window / (every * plain_step)  # two touched batches per n steps
            line += f" {1e3 * window:9.1f}ms {100 * spread:+7.2f}%"
        else:
            line += f" {'(all)':>11s} {'':>8s}"
        setup = statistics.median(c.first_batch_at - c.setup_at for c in rounds) - base_setup
        first = statistics.median(c.steps[0] for c in rounds) - base_first
        print(line + f" {1e3 * setup:7.0f}ms {1e3 * first:11.0f}ms")
    print("  overhead: steady-state time against no monitor, batches 1..N-1; per window: a touched batch minus an "
          "untouched one (in-run); spread: that cost over every_n_steps plain steps (2 touched batches per window)")


if __name__ == "__main__":
    main()
