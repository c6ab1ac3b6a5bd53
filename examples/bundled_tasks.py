"""The bundled transformers on every example task, with all three monitors, via `qkmonitor train`.

Each task is a LightningModule + LightningDataModule in `qkmonitor.models.tasks` (generated from a
seed, or read from this Python installation's standard library — nothing downloaded):

- recall   decoder-only LM, multi-query associative recall (the default job)
- copy     encoder–decoder with cross-attention, copy a string
- reverse  encoder–decoder, reverse a string
- charlm   decoder-only LM on the standard library's .py files, bits per character
- modular  (a + b) mod p, the grokking setup (strong weight decay)
- grid     vision encoder with 2-D axial RoPE: are two marked cells in one row, one column, neither?

This runs each for a few steps (`--steps`) to show the monitors on every architecture; run
`qkmonitor train --task NAME` alone for the full default schedule that learns the task.

    python examples/bundled_tasks.py [--steps 40] [--tasks recall grid] [--log-dir runs]
"""

from __future__ import annotations

import argparse

from qkmonitor.cli import main as qkmonitor_main

TASKS = ("recall", "copy", "reverse", "charlm", "modular", "grid")


def main(argv: list[str] | None = None) -> dict[str, int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--log-dir", default="runs")
    args = parser.parse_args(argv)
    codes = {}
    for task in args.tasks:
        print(f"\n=== {task} ===")
        codes[task] = qkmonitor_main(
            [
                "train",
                "--task",
                task,
                "--steps",
                str(args.steps),
                "--every-n-steps",
                "10",
                "--log-dir",
                args.log_dir,
                "--no-progress-bar",
                *([] if task == args.tasks[0] else ["--no-legend"]),  # the columns' legend once
            ]
        )
    return codes


if __name__ == "__main__":
    main()
