"""The ``qkmonitor`` command line: ``qkmonitor train`` runs the main job.

``qkmonitor train`` trains a bundled model on an example task (``--task``: associative recall, the
default; copy / reverse with the encoder-decoder; character-level LM on the standard library's own
source; modular addition; a 2-D grid relation with the vision encoder; generated from a seed or read
from the local Python installation, nothing downloaded) with the monitors on, writes TensorBoard
logs under ``runs/``, and ends with a per-layer summary and the task's validation scores. The CLI is
the one place in the core that imports Lightning and the bundled models, and it does so only inside
the command that needs them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
import shlex
import sys
import textwrap
import warnings
from collections.abc import Sequence

from qkmonitor.models.tasks.registry import TASKS as TASK_REGISTRY

__all__ = ["build_parser", "main", "quiet_lightning"]


def _number(text: str, kind: type, what: str, ok) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, "a positive integer", lambda v: v >= 1)


def _positive_float(text: str) -> float:
    return _number(text, float, "a positive number", lambda v: v > 0 and math.isfinite(v))


def _non_negative_float(text: str) -> float:
    return _number(text, float, "a number >= 0", lambda v: v >= 0 and math.isfinite(v))


def _fraction(text: str) -> float:
    return _number(text, float, "a number between 0 and 1", lambda v: 0 < v < 1)


def _any_int(text: str) -> int:
    return _number(text, int, "an integer", lambda v: True)


def _run_name(text: str) -> str:
    """A run's folder name under the log directory: one path part, never one that leaves it."""
    import os

    separators = {"/", os.sep, *([os.altsep] if os.altsep else [])}
    if not text or text in (".", "..") or any(sep in text for sep in separators):
        raise argparse.ArgumentTypeError(
            f"expected a run name without '/' that is not '.' or '..' (a folder under "
            f"--log-dir), got {text!r}"
        )
    return text


TASKS = tuple(TASK_REGISTRY)
_PER_TASK = "default: per task, see below"


PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")

#: Below this many parameters ``qkmonitor train`` runs torch on one CPU thread: its matrices are
#: too small for intra-op threads to pay (the default recall model, 0.1 M parameters: 300 steps
#: in docs/cli.md's measurement, one thread against torch's default).
SMALL_MODEL = 1_000_000


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default once: appended unless the help text already speaks of it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = (None, False, argparse.SUPPRESS)
        if "default" in text or action.default in quiet or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _defaults_table() -> str:
    names = list(TASK_REGISTRY["recall"].defaults)
    rows = [["task", *names]] + [
        [name, *(str(task.defaults[n]) for n in names)] for name, task in TASK_REGISTRY.items()
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(names) + 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "per-task defaults (batch_size None = the whole training set):\n  " + "\n  ".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkmonitor",
        description=(
            "Watch attention while a transformer trains: train a bundled model with the "
            "monitors on (qkmonitor train), or read a run back (qkmonitor report)."
        ),
    )
    from qkmonitor import __version__
    from qkmonitor.models.config import POSITIONAL
    from qkmonitor.output.report import add_report_parser, directory_argument

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train a bundled model on an example task with the monitors on",
        formatter_class=_HelpFormatter,
        epilog=_defaults_table(),
    )
    per_task = {"default": argparse.SUPPRESS}  # resolved from the task's defaults once it is known
    train.add_argument("--task", choices=TASKS, default="recall", help="the task to learn")
    train.add_argument(
        "--steps", type=_positive_int, **per_task, help=f"optimizer steps ({_PER_TASK})"
    )
    train.add_argument(
        "--d-model", type=_positive_int, **per_task, help=f"residual width ({_PER_TASK})"
    )
    train.add_argument(
        "--layers",
        type=_positive_int,
        **per_task,
        help=f"transformer blocks; encoder-decoder: each side ({_PER_TASK})",
    )
    train.add_argument(
        "--heads", type=_positive_int, **per_task, help=f"query heads per layer ({_PER_TASK})"
    )
    train.add_argument(
        "--kv-heads",
        type=_positive_int,
        default=None,
        help=(
            "key/value heads for grouped-query attention; must divide --heads (default: as many "
            "as --heads)"
        ),
    )
    train.add_argument(
        "--batch-size",
        type=_positive_int,
        **per_task,
        help=f"examples per training batch ({_PER_TASK})",
    )
    train.add_argument(
        "--lr", type=_positive_float, **per_task, help=f"peak AdamW learning rate ({_PER_TASK})"
    )
    train.add_argument(
        "--lr-decay",
        choices=["constant", "cosine"],
        **per_task,
        help=(
            f"after warmup: keep the peak rate, or cosine to a tenth of it at the end ({_PER_TASK})"
        ),
    )
    train.add_argument(
        "--weight-decay",
        type=_non_negative_float,
        **per_task,
        help=f"AdamW weight decay on matrices ({_PER_TASK})",
    )
    train.add_argument(
        "--positional",
        choices=POSITIONAL,
        **per_task,
        help=f"position encoding of the model ({_PER_TASK})",
    )
    train.add_argument(
        "--pairs", type=_positive_int, default=6, help="recall: key-value pairs per sequence"
    )
    train.add_argument("--modulus", type=_positive_int, default=23, help="modular: the modulus p")
    train.add_argument(
        "--train-fraction",
        type=_fraction,
        default=0.6,
        help="modular: share of the p^2 pairs trained on",
    )
    train.add_argument(
        "--length", type=_positive_int, default=10, help="copy/reverse: longest source string"
    )
    train.add_argument(
        "--grid-size", type=_positive_int, default=8, help="grid: rows = columns of the grid"
    )
    train.add_argument(
        "--chars",
        type=_positive_int,
        default=1_000_000,
        help="charlm: characters read from the standard library's .py files",
    )
    train.add_argument("--seq-len", type=_positive_int, default=128, help="charlm: context length")
    train.add_argument(
        "--every-n-steps",
        type=_positive_int,
        default=25,
        help="the monitors probe every this many optimizer steps",
    )
    train.add_argument(
        "--per-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="log every head's value too (the heatmaps of `qkmonitor report` need them)",
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
        type=_run_name,
        default=None,
        help="run name, a folder under the log dir (default: the task's name)",
    )
    train.add_argument(
        "--seed", type=_any_int, default=0, help="seed of the data and the initialization"
    )
    train.add_argument(
        "--checkpoint",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="save the last weights under the run's checkpoints/ folder",
    )
    train.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help=(
            "torch's CPU threads (default: 1 for a model under "
            f"{SMALL_MODEL / 1e6:g} M parameters, else torch's own; OMP_NUM_THREADS wins where set)"
        ),
    )
    train.add_argument(
        "--progress-bar",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show the training progress (step N/total, loss, accuracy)",
    )
    train.add_argument(
        "--legend",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end the summary with what each column means (--no-legend: the table alone)",
    )
    add_report_parser(commands, formatter_class=_HelpFormatter)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        for name, value in TASK_REGISTRY[args.task].defaults.items():
            if not hasattr(args, name):
                setattr(args, name, value)
        return _train(args)
    if args.command == "report":
        from qkmonitor.output.report import run_report

        return run_report(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _train(args: argparse.Namespace) -> int:
    import torch

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


@contextlib.contextmanager
def quiet_lightning():
    """Turn Lightning's chatter down while the block runs: its info lines (tips, the device report,
    why ``fit`` stopped) and one known deprecation warning from torch's pytree that Lightning
    triggers (filtered by its message). Warnings (qkmonitor's alerts among them) and the progress
    bar stay; qkmonitor's own info lines under Lightning (the layers it found) go through
    Lightning's logger and are turned down too. ``qkmonitor train`` and the examples run in it.

    Example::

        with quiet_lightning():
            trainer = pl.Trainer(max_steps=100, callbacks=[QKSpectrumMonitor()])
            trainer.fit(model)
    """
    import lightning.pytorch  # noqa: F401 -- its import sets its loggers' levels: set ours after it

    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*"
            )
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _run_training(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.callbacks import ModelCheckpoint

    from qkmonitor.callbacks import QKMonitor
    from qkmonitor.callbacks.base import lost_writes

    pl.seed_everything(args.seed, verbose=False)
    try:
        data, task = TASK_REGISTRY[args.task].build(args)
    except ValueError as err:
        print(f"qkmonitor train: {err}", file=sys.stderr)
        return 2
    logger = _guarded_logger_class()(
        args.log_dir, name=args.name or args.task, default_hp_metric=False
    )
    monitor = QKMonitor(every_n_steps=args.every_n_steps, per_head=args.per_head)
    checkpoint = ModelCheckpoint(save_last=False) if args.checkpoint else None
    checkpoint_io = _checkpoint_io_class()(logger.log_dir)
    callbacks = [
        monitor,
        *([checkpoint] if checkpoint else []),
        *([_StepProgress()] if args.progress_bar else []),
    ]
    try:
        trainer = pl.Trainer(
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
        return 2
    threads = _threads(args, task)
    print(_what_trains(args, task, trainer, logger.log_dir, threads), flush=True)
    trainer.fit(task, datamodule=data)
    final = trainer.validate(task, datamodule=data, verbose=False)[0]
    lost = lost_writes(trainer)
    print(
        _summary(
            monitor.engines,
            final,
            logger.log_dir,
            step=trainer.global_step,
            lost=lost,
            legend=args.legend,
        )
    )
    if checkpoint is None:
        print("checkpoint: none (--no-checkpoint)")
    elif checkpoint_io.error is not None:
        print(f"checkpoint: not saved ({checkpoint_io.error})")
    elif checkpoint.best_model_path:
        print(f"checkpoint: {checkpoint.best_model_path}")
    print(_next_steps(args.log_dir, logger.log_dir))
    return 0


def _guarded_logger_class():
    from lightning.pytorch.loggers import TensorBoardLogger

    from qkmonitor.output.logger_sinks import guarded_sink

    class GuardedTensorBoardLogger(TensorBoardLogger):
        """``qkmonitor train``'s logger: a ``TensorBoardLogger`` whose own writes go through the
        guard of the monitors' writes to its directory (``output.guard``): a directory deleted,
        replaced or read-only mid-run loses writes, counted in the summary's ``writes lost``
        line, not the run; writing resumes when it can be written again, and a deleted
        directory is never made again by the logger (the monitors' writes do not make it either).
        """

        def log_metrics(self, metrics, step=None):
            guarded_sink(self).write(super().log_metrics, metrics, step, step=step)

        def log_hyperparams(self, params, *args, **kwargs):
            # as Lightning's own signature has it: (params, metrics) in 2.4, (…, step) from 2.5
            step = kwargs.get("step", args[1] if len(args) > 1 else None)
            write = functools.partial(super().log_hyperparams, params, *args, **kwargs)
            guarded_sink(self).write(write, step=step)

        def save(self):
            guard = guarded_sink(self)
            guard.confirm()  # what the writer took: written, or counted lost
            if not guard.failing:
                guard.write(super().save)  # a flush and hparams.yaml

        def finalize(self, status):
            guard = guarded_sink(self)
            guard.confirm()
            if not guard.failing:
                guard.write(super().finalize, status)

    return GuardedTensorBoardLogger


def _checkpoint_io_class():
    from lightning.fabric.plugins import TorchCheckpointIO

    class RunCheckpointIO(TorchCheckpointIO):
        """``qkmonitor train``'s checkpoints: saved only while the run directory is a writable
        directory (one deleted or replaced mid-run is not made again for them), and a save that
        fails does not end the run; ``error`` says why the last save was not made (None: it
        was)."""

        def __init__(self, run_dir: str) -> None:
            super().__init__()
            self.run_dir = run_dir
            self.error: str | None = None

        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            import os

            if not (os.path.isdir(self.run_dir) and os.access(self.run_dir, os.W_OK)):
                self.error = f"{self.run_dir} is no longer a writable directory"
                return
            try:
                super().save_checkpoint(checkpoint, path, storage_options)
            except OSError as err:
                self.error = f"{type(err).__name__}: {err}"
            else:
                self.error = None

    return RunCheckpointIO


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


def _step_progress_class():
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

    class StepProgress(TQDMProgressBar):
        """Lightning's progress bar counted in optimizer steps of the whole run (``step N/total``)
        with the task's loss and accuracy; no epoch counter and no logger version."""

        @property
        def train_description(self) -> str:
            return "step"

        def init_validation_tqdm(self):
            return Tqdm(disable=True)  # the validation scores come in the summary

        def on_train_epoch_start(self, trainer, *_):
            if trainer.current_epoch == 0:
                self.train_progress_bar.reset(total=trainer.max_steps)
                self.train_progress_bar.set_description("step")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            bar = self.train_progress_bar
            if bar is not None and not bar.disable:
                bar.n = trainer.global_step
                bar.set_postfix(self.get_metrics(trainer, pl_module))
                bar.refresh()

        def on_train_epoch_end(self, trainer, pl_module):
            pass  # one bar for the whole run

        def get_metrics(self, trainer, pl_module):
            metrics = super().get_metrics(trainer, pl_module)
            metrics.pop("v_num", None)
            return {
                k.removeprefix("train_"): v for k, v in metrics.items() if k.startswith("train_")
            }

    return StepProgress


def _StepProgress():
    return _step_progress_class()()


def summary_columns() -> list[tuple[str, str, str]]:
    """(monitor, metric, over heads) columns of the summary table, from the metric catalogue."""
    from qkmonitor.measures.catalogue import CATALOGUE

    return [(spec.monitor, spec.name, agg) for spec in CATALOGUE for agg in spec.summary]


def _summary(
    engines: list,
    final: dict[str, float],
    log_dir: str,
    step: int | None = None,
    lost: dict[str, int] | None = None,
    legend: bool = True,
) -> str:
    """A per-layer table of each monitor engine's last probe, which probe each column comes from, a
    legend of the columns (from the metric catalogue), the alerts and the task's final
    validation scores; ``step``: the optimizer steps trained; ``lost``: the monitors' writes a
    destination lost (``callbacks.base.lost_writes``), a line when any was; ``legend``: with the
    columns' legend."""
    by_kind = {e.monitor: e for e in engines}
    columns = [c for c in summary_columns() if c[0] in by_kind]
    header = ["layer", "name"] + [m if agg == "mean" else f"{m} {agg}" for _, m, agg in columns]
    rows = []
    for i, layer in enumerate(engines[0].layers):
        cells = [str(i), layer.name]
        for monitor, metric, agg in columns:
            latest = by_kind[monitor].latest.get(metric)
            if latest is None:
                cells.append("-")
                continue
            heads = latest[i]
            value = {"mean": heads.mean(), "max": heads.max(), "min": heads.min()}[agg].item()
            cells.append("nan" if math.isnan(value) else f"{value:.4g}")
        rows.append(cells)
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    counts = {name: n for e in engines for name, n in e.tracker.counts.items()}
    fired = ", ".join(f"{name}: {n}" for name, n in counts.items() if n)
    alerts = fired or f"none (rules watched: {', '.join(counts) or 'none'})"
    scores = ", ".join(f"{k} {v:.4f}" for k, v in sorted(final.items()))
    after = f" after step {step}" if step is not None else ""
    return "\n".join(
        [
            f"\nqkmonitor summary{after} ({log_dir})",
            *_sources(engines, columns),
            line(header),
            line(["-" * w for w in widths]),
            *map(line, rows),
            *(_legend(columns) if legend else []),
            f"alerts fired: {alerts}",
            *[
                f"writes lost: {n} to {where} (see the warnings above)"
                for where, n in (lost or {}).items()
            ],
            f"final validation: {scores}",
        ]
    )


def _sources(engines: list, columns: list[tuple[str, str, str]]) -> list[str]:
    """Which probe each column comes from: the spectrum reads the weights after a step, the
    activation monitors the batch of their last probe step (up to ``every_n_steps`` earlier)."""
    from qkmonitor.measures.catalogue import SPECTRUM

    groups: dict[str, list[str]] = {}
    for e in engines:
        names = list(
            dict.fromkeys(metric for monitor, metric, _ in columns if monitor == e.monitor)
        )
        if not names or e.latest_step is None:
            continue
        source = (
            f"the weights after step {e.latest_step}"
            if e.monitor == SPECTRUM
            else f"the last probed batch, at step {e.latest_step}"
        )
        groups.setdefault(source, []).extend(names)
    return [f"  {', '.join(names)}: {source}" for source, names in groups.items()]


def _legend(columns: list[tuple[str, str, str]]) -> list[str]:
    """One line per metric of the table: unit, range, which end is worse, how to read it."""
    from qkmonitor.measures.catalogue import metric

    names = list(dict.fromkeys(name for _, name, _ in columns))
    if not names:
        return []
    width = max(len(name) for name in names)
    lines = ["columns: a layer's mean over its heads; 'max'/'min': its highest/lowest head"]
    for name in names:
        spec = metric(name)
        worse = f"{spec.worse} is worse" if spec.worse else "neither end is worse"
        lo, hi = spec.range
        text = f"{spec.unit} in [{lo:g}, {hi:g}], {worse}" + (
            f"; {spec.reading}" if spec.reading else ""
        )
        lines.append(
            textwrap.fill(
                text,
                width=100,
                initial_indent=f"  {name.ljust(width)}  ",
                subsequent_indent=" " * (width + 4),
            )
        )
    return lines


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
