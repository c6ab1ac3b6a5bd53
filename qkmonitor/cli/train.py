"""``qkmonitor train``: its arguments, and the run made of them: a bundled model learns an example
task (:mod:`qkmonitor.models.tasks.registry`) with the monitors on, and the summary is printed."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from typing import Any

from qkmonitor.cli.arguments import (
    HelpFormatter,
    any_int,
    directory_argument,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    run_name,
    unwritable,
)
from qkmonitor.cli.summary import format_summary
from qkmonitor.cli.trainer import (
    checkpoint_io_class,
    guarded_logger_class,
    quiet_lightning,
    step_progress,
)
from qkmonitor.models.tasks.registry import TASKS as TASK_REGISTRY

__all__ = ["PRECISIONS", "SMALL_MODEL", "TASKS", "add_train_parser", "run_train"]

TASKS = tuple(TASK_REGISTRY)
_PER_TASK = "default: per task, see below"


PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")

#: Below this many parameters ``qkmonitor train`` runs torch on one CPU thread: its matrices are
#: too small for intra-op threads to pay (the default recall model, 0.1 M parameters: 300 steps
#: in docs/cli.md's measurement, one thread against torch's default).
SMALL_MODEL = 1_000_000


def _defaults_table() -> str:
    names = list(TASK_REGISTRY["recall"].defaults)
    rows = [["task", *names]] + [
        [name, *(str(task.defaults[n]) for n in names)] for name, task in TASK_REGISTRY.items()
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(names) + 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "per-task defaults (batch_size None = the whole training set):\n  " + "\n  ".join(lines)


def add_train_parser(
    subparsers, formatter_class: type[argparse.HelpFormatter] = HelpFormatter
) -> argparse.ArgumentParser:
    """Add the ``train`` command to a CLI's ``add_subparsers()`` object; returns its parser.
    ``formatter_class``: the CLI's help formatter (one that shows each default once)."""
    train = subparsers.add_parser(
        "train",
        help="train a bundled model on an example task with the monitors on",
        formatter_class=formatter_class,
        epilog=_defaults_table(),
    )
    _add_model_arguments(train)
    _add_training_arguments(train)
    _add_task_arguments(train)
    _add_run_arguments(train)
    _add_output_arguments(train)
    return train


def _add_per_task(train: argparse.ArgumentParser, flag: str, help: str, **kwargs: Any) -> None:
    """An option whose default is the task's: left out of the parsed options unless given
    (``argparse.SUPPRESS``), and resolved from the task's defaults once the task is known."""
    train.add_argument(flag, default=argparse.SUPPRESS, help=f"{help} ({_PER_TASK})", **kwargs)


def _add_model_arguments(train: argparse.ArgumentParser) -> None:
    """The task and the model's size."""
    train.add_argument("--task", choices=TASKS, default="recall", help="the task to learn")
    _add_per_task(train, "--steps", "optimizer steps", type=positive_int)
    _add_per_task(train, "--d-model", "residual width", type=positive_int)
    _add_per_task(
        train, "--layers", "transformer blocks; encoder-decoder: each side", type=positive_int
    )
    _add_per_task(train, "--heads", "query heads per layer", type=positive_int)
    train.add_argument(
        "--kv-heads",
        type=positive_int,
        default=None,
        help=(
            "key/value heads for grouped-query attention; must divide --heads (default: as many "
            "as --heads)"
        ),
    )


def _add_training_arguments(train: argparse.ArgumentParser) -> None:
    """The other options whose default is the task's: training's, and the positions."""
    from qkmonitor.models.config import POSITIONAL

    _add_per_task(train, "--batch-size", "examples per training batch", type=positive_int)
    _add_per_task(train, "--lr", "peak AdamW learning rate", type=positive_float)
    _add_per_task(
        train,
        "--lr-decay",
        "after warmup: keep the peak rate, or cosine to a tenth of it at the end",
        choices=["constant", "cosine"],
    )
    _add_per_task(
        train, "--weight-decay", "AdamW weight decay on matrices", type=non_negative_float
    )
    _add_per_task(train, "--positional", "position encoding of the model", choices=POSITIONAL)


def _add_task_arguments(train: argparse.ArgumentParser) -> None:
    """Each task's own options."""
    train.add_argument(
        "--pairs", type=positive_int, default=6, help="recall: key-value pairs per sequence"
    )
    train.add_argument("--modulus", type=positive_int, default=23, help="modular: the modulus p")
    train.add_argument(
        "--train-fraction",
        type=fraction,
        default=0.6,
        help="modular: share of the p^2 pairs trained on",
    )
    train.add_argument(
        "--length", type=positive_int, default=10, help="copy/reverse: longest source string"
    )
    train.add_argument(
        "--grid-size", type=positive_int, default=8, help="grid: rows = columns of the grid"
    )
    train.add_argument(
        "--chars",
        type=positive_int,
        default=1_000_000,
        help="charlm: characters read from the standard library's .py files",
    )
    train.add_argument("--seq-len", type=positive_int, default=128, help="charlm: context length")


def _add_run_arguments(train: argparse.ArgumentParser) -> None:
    """The monitors, the device and where the run logs."""
    train.add_argument(
        "--every-n-steps",
        type=positive_int,
        default=25,
        help="the monitors probe every this many optimizer steps",
    )
    _add_switch(
        train,
        "--per-head",
        "log every head's value too (the heatmaps of `qkmonitor report` need them)",
    )
    train.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="32-true",
        help="Lightning precision; the mixed modes autocast on CPU as on CUDA",
    )
    train.add_argument(
        "--accelerator",
        default="auto",
        help="Lightning accelerator: auto (a GPU where there is one), cpu, cuda, ...",
    )
    train.add_argument(
        "--log-dir", type=directory_argument, default="runs", help="TensorBoard root directory"
    )
    train.add_argument(
        "--name",
        type=run_name,
        default=None,
        help="run name, a folder under the log dir (default: the task's name)",
    )
    train.add_argument(
        "--seed", type=any_int, default=0, help="seed of the data and the initialization"
    )


def _add_output_arguments(train: argparse.ArgumentParser) -> None:
    """What the run saves and shows."""
    _add_switch(train, "--checkpoint", "save the last weights under the run's checkpoints/ folder")
    train.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help=(
            "torch's CPU threads (default: 1 for a model under "
            f"{SMALL_MODEL / 1e6:g} M parameters, else torch's own; OMP_NUM_THREADS wins where set)"
        ),
    )
    _add_switch(
        train, "--progress-bar", "show the training progress (step N/total, loss, accuracy)"
    )
    _add_switch(
        train,
        "--legend",
        "end the summary with what each column means (--no-legend: the table alone)",
    )


def _add_switch(train: argparse.ArgumentParser, flag: str, help: str) -> None:
    """An on-by-default ``--x`` with its ``--no-x``."""
    train.add_argument(flag, action=argparse.BooleanOptionalAction, default=True, help=help)


def run_train(args: argparse.Namespace) -> int:
    """Run the ``train`` command from parsed arguments, the options left out at the task's
    defaults: train, print the summary; 0, or 2 on options the task or the machine refuses."""
    import torch

    for name, value in TASK_REGISTRY[args.task].defaults.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    threads = torch.get_num_threads()  # process-wide: given back for a caller in this process
    try:
        with quiet_lightning(), _quiet_writer_threads():
            return _run_training(args)
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _quiet_writer_threads():
    """A TensorBoard writer's thread that fails (its directory gone, replaced, read-only) ends
    without its traceback: the guard of the run's writes says what failed and counts what was
    lost (``output.guard``). Other threads' exceptions are printed as before."""
    import threading

    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # another TensorBoard: its threads' tracebacks are printed
        yield
        return
    previous = threading.excepthook

    def hook(args):
        if not isinstance(args.thread, _AsyncWriterThread):
            previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def _threads(args: argparse.Namespace, task) -> str:
    """Set torch's CPU threads for the model; the header's words for it. A small model's matrices
    are too small for intra-op threads to pay, and on a loaded machine the threads wait for each
    other (docs/cli.md: 300 steps of the default model, one thread against torch's default)."""
    import os

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
        return f"{args.threads} (--threads)"
    if os.environ.get("OMP_NUM_THREADS"):
        return f"{torch.get_num_threads()} (OMP_NUM_THREADS)"
    params = sum(p.numel() for p in task.parameters())
    if params < SMALL_MODEL:
        torch.set_num_threads(1)
        return (
            f"1 (a model under {SMALL_MODEL / 1e6:g} M parameters gains nothing from more; "
            "--threads N to change)"
        )
    return f"{torch.get_num_threads()} (torch's default; --threads N to change)"


def _run_training(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from qkmonitor.callbacks import QKMonitor
    from qkmonitor.callbacks.base import lost_writes

    pl.seed_everything(args.seed, verbose=False)
    try:
        data, task = TASK_REGISTRY[args.task].build(args)
    except ValueError as err:
        print(f"qkmonitor train: {err}", file=sys.stderr)
        return 2
    logger = guarded_logger_class()(
        args.log_dir, name=args.name or args.task, default_hp_metric=False
    )
    monitor = QKMonitor(every_n_steps=args.every_n_steps, per_head=args.per_head)
    checkpoint = ModelCheckpoint(save_last=False) if args.checkpoint else None
    checkpoint_io = checkpoint_io_class()(logger.log_dir)
    callbacks = [
        monitor,
        *([checkpoint] if checkpoint else []),
        *([step_progress()] if args.progress_bar else []),
    ]
    trainer = _trainer(args, logger, callbacks, checkpoint_io)
    if trainer is None:
        return 2
    problem = unwritable(logger.root_dir)  # where the run's version_N folder is to be made
    if problem is not None:
        print(
            f"qkmonitor train: argument --log-dir: cannot write into {args.log_dir!r} ({problem})",
            file=sys.stderr,
        )
        return 2
    threads = _threads(args, task)
    print(_what_trains(args, task, trainer, logger.log_dir, threads), flush=True)
    trainer.fit(task, datamodule=data)
    final = trainer.validate(task, datamodule=data, verbose=False)[0]
    lost = lost_writes(trainer)
    print(
        format_summary(
            monitor.engines,
            final,
            logger.log_dir,
            step=trainer.global_step,
            lost=lost,
            legend=args.legend,
        )
    )
    saved = _checkpoint_line(checkpoint, checkpoint_io)
    if saved is not None:
        print(saved)
    print(_next_steps(args.log_dir, logger.log_dir))
    return 0


def _trainer(args: argparse.Namespace, logger, callbacks: list, checkpoint_io):
    """The run's Trainer, or None when Lightning refuses the options (said on stderr)."""
    import lightning.pytorch as pl
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    try:
        return pl.Trainer(
            max_steps=args.steps,
            accelerator=args.accelerator,
            devices=1,
            precision=args.precision,
            logger=logger,
            callbacks=callbacks,
            log_every_n_steps=args.every_n_steps,
            val_check_interval=min(250, args.steps),
            check_val_every_n_epoch=None,
            enable_progress_bar=args.progress_bar,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            enable_checkpointing=args.checkpoint,
            plugins=[checkpoint_io],
        )
    except (
        ValueError,
        RuntimeError,
        MisconfigurationException,
    ) as err:  # e.g. an accelerator this machine lacks
        print(f"qkmonitor train: {err}", file=sys.stderr)
        return None


def _checkpoint_line(checkpoint, checkpoint_io) -> str | None:
    """Where the checkpoint went, or why there is none."""
    if checkpoint is None:
        return "checkpoint: none (--no-checkpoint)"
    if checkpoint_io.error is not None:
        return f"checkpoint: not saved ({checkpoint_io.error})"
    if checkpoint.best_model_path:
        return f"checkpoint: {checkpoint.best_model_path}"
    return None


def _what_trains(args: argparse.Namespace, task, trainer, log_dir: str, threads: str) -> str:
    """The line before the progress bar: the task, the model's size, where it runs and logs."""
    params = sum(p.numel() for p in task.parameters())
    entry = TASK_REGISTRY[args.task]
    sides = " a side" if entry.model == "encoder-decoder" else ""
    kv = f" ({args.kv_heads} key/value)" if args.kv_heads else ""
    return (
        f"qkmonitor train: {entry.learns(args)}\n"
        f"  model: {entry.model}, {args.layers} "
        f"layer{'s' if args.layers != 1 else ''}{sides} x "
        f"{args.heads} heads{kv}, d_model {args.d_model}, {args.positional} positions, "
        f"{params / 1e6:.2f} M parameters\n"
        f"  {args.steps} steps on {trainer.strategy.root_device}, the monitors probing every "
        f"{args.every_n_steps}; logs: {log_dir}\n"
        f"  threads: {threads}"
    )


def _next_steps(root: str, log_dir: str) -> str:
    """The commands that show the run: TensorBoard on the log root, the report of this run."""
    commands = [
        (f"tensorboard --logdir {shlex.quote(root)}", "the dashboards, in a browser"),
        (f"qkmonitor report {shlex.quote(log_dir)}", "this run as tables, alerts and PNG plots"),
    ]
    width = max(len(command) for command, _ in commands)
    return "\nNext:\n" + "\n".join(f"  {c.ljust(width)}  # {what}" for c, what in commands)
