"""The ``qkmonitor`` command line: ``qkmonitor train`` runs the main job.

``qkmonitor train`` trains a bundled model on an example task (``--task``: associative recall, the
default; copy / reverse with the encoder-decoder; character-level LM on the standard library's own
source; modular addition; a 2-D grid relation with the vision encoder; generated from a seed or read
from the local Python installation, nothing downloaded) with the monitors on, writes TensorBoard
logs under ``runs/``, and ends with a per-layer summary and the task's validation scores. The CLI is
the one place in the core that imports Lightning and the bundled models, and it does so only inside
the command that needs them.

Its modules: :mod:`~qkmonitor.cli.train` (``train``'s arguments and the run; the tasks are
:mod:`qkmonitor.models.tasks.registry`'s), :mod:`~qkmonitor.cli.trainer` (the Lightning pieces the
run is made of, and :func:`quiet_lightning`, exported here), :mod:`~qkmonitor.cli.summary` (the
table printed at its end), :mod:`~qkmonitor.cli.report` (``report``'s arguments),
:mod:`~qkmonitor.cli.scan` (``scan``: the QK spectrum of saved models) and
:mod:`~qkmonitor.cli.arguments` (the argument types and the help formatter).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from qkmonitor.cli.trainer import quiet_lightning

__all__ = ["build_parser", "main", "quiet_lightning"]


def build_parser() -> argparse.ArgumentParser:
    """The ``qkmonitor`` parser: ``--version`` and the ``train``, ``report`` and ``scan``
    commands."""
    from qkmonitor import __version__
    from qkmonitor.cli.arguments import HelpFormatter
    from qkmonitor.cli.report import add_report_parser
    from qkmonitor.cli.scan import add_scan_parser
    from qkmonitor.cli.train import add_train_parser

    parser = argparse.ArgumentParser(
        prog="qkmonitor",
        description=(
            "Watch attention while a transformer trains: train a bundled model with the "
            "monitors on (qkmonitor train), read a run back (qkmonitor report), or the QK "
            "spectrum of saved models (qkmonitor scan)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_train_parser(commands, formatter_class=HelpFormatter)
    add_report_parser(commands, formatter_class=HelpFormatter)
    add_scan_parser(commands, formatter_class=HelpFormatter)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``qkmonitor``: parse ``argv`` (default: the process's) and run the command; its exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "train":
        from qkmonitor.cli.train import run_train

        return run_train(args)
    if args.command == "report":
        from qkmonitor.cli.report import run_report

        return run_report(args)
    if args.command == "scan":
        from qkmonitor.cli.scan import run_scan

        return run_scan(args)
    return 2  # pragma: no cover - argparse rejects unknown commands
