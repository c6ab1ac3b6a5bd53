"""``qkmonitor scan``'s arguments, and the command run from them: the QK spectrum of saved models
(:func:`qkmonitor.scanning.write_scan`) written as one TensorBoard run, a per-layer table printed
for each model, or one line saying what could not be read."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import warnings
from pathlib import Path

from qkmonitor.cli.arguments import add_directory_option

__all__ = ["add_scan_parser", "format_scan", "run_scan"]

_COLUMNS = (
    ("kappa", "mean"),
    ("kappa", "max"),
    ("kappa_eig", "mean"),
    ("qk_erank", "mean"),
    ("qk_spectral_norm", "max"),
)


def add_scan_parser(
    subparsers,
    formatter_class: type[argparse.HelpFormatter] = argparse.ArgumentDefaultsHelpFormatter,
) -> argparse.ArgumentParser:
    """Add the ``scan`` command to a CLI's ``add_subparsers()`` object; returns its parser."""
    parser = subparsers.add_parser(
        "scan",
        help="the QK spectrum of saved models and checkpoints, as a TensorBoard run",
        description=(
            "Read saved models (Hugging Face folders, Trainer checkpoint-N folders, Lightning "
            ".ckpt files, or folders of them) one layer at a time and write their QK spectrum "
            "(kappa, kappa_eig, eig_mean, eig_var, qk_erank, qk_spectral_norm) as one "
            "TensorBoard run, each model at its step; qkmonitor report reads it."
        ),
        formatter_class=formatter_class,
    )
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="a model folder, checkpoint-N folder, .ckpt file, or a folder of checkpoints",
    )
    add_directory_option(
        parser,
        "--log-dir",
        required=True,
        help="the folder the run is written to (one that holds no run yet)",
    )
    parser.add_argument("--per-head", action="store_true", help="log every head's values too")
    parser.add_argument(
        "--model",
        default=None,
        metavar="package.module:Class",
        help=(
            "the LightningModule of .ckpt files that are not a bundled model's, imported as "
            "python -m would: from the current folder too"
        ),
    )
    return parser


def run_scan(args: argparse.Namespace) -> int:
    """Run the ``scan`` command from parsed arguments; 0, or 2 with one line on bad input."""
    from qkmonitor.scanning import ScanError, write_scan

    log_dir = Path(args.log_dir)
    if log_dir.is_dir() and any(
        p.name.startswith("events.out.tfevents") for p in log_dir.iterdir()
    ):
        print(
            f"qkmonitor scan: argument --log-dir: {log_dir} already holds a TensorBoard run; "
            "expected a new or empty folder",
            file=sys.stderr,
        )
        return 2
    try:
        with warnings.catch_warnings(record=True) as caught, _importing_from_here(args.model):
            warnings.simplefilter("always")
            write_scan(
                args.paths,
                log_dir,
                per_head=args.per_head,
                model_class=args.model,
                on_model=lambda scan: print(format_scan(scan), flush=True),
            )
    except (ScanError, OSError) as err:
        print(f"qkmonitor scan: {err}", file=sys.stderr)
        return 2
    for warning in caught:  # the alerts, one line each
        print(f"warning: {warning.message}", file=sys.stderr)
    print(f"\nwritten to {log_dir}\nNext:\n  qkmonitor report {log_dir}")
    print(f"  tensorboard --logdir {log_dir}")
    return 0


@contextlib.contextmanager
def _importing_from_here(model: str | None):
    """``--model package.module:Class`` imported from the current folder too, as ``python -m``
    would: the folder is first on ``sys.path`` while the scan runs (the console script's own
    ``sys.path`` starts at its ``bin`` folder), and taken off after."""
    here = os.getcwd()
    if model is None or here in sys.path:
        yield
        return
    sys.path.insert(0, here)
    try:
        yield
    finally:
        if here in sys.path:
            sys.path.remove(here)


def format_scan(scan) -> str:
    """One model's per-layer table: the heads' mean or highest value of each column."""
    header = ["layer", "name", "heads"] + [m if a == "mean" else f"{m} {a}" for m, a in _COLUMNS]
    rows = []
    for i, layer in enumerate(scan.layers):
        cells = [str(i), layer.name, str(layer.num_heads)]
        for name, agg in _COLUMNS:
            heads = layer.metrics[name]
            value = (heads.mean() if agg == "mean" else heads.max()).item()
            cells.append("nan" if math.isnan(value) else f"{value:.4g}")
        rows.append(cells)
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join(
        [
            f"\nstep {scan.step}: {scan.path} ({len(scan.layers)} attention layers)",
            line(header),
            line(["-" * w for w in widths]),
            *map(line, rows),
        ]
    )
