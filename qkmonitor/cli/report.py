"""``qkmonitor report``'s arguments, and the command run from them: the report of
:func:`qkmonitor.output.report.build_report` printed, or the reason there is none."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from qkmonitor.cli.arguments import add_directory_option
from qkmonitor.output.report import build_report
from qkmonitor.output.tags import LOSS_TAGS

__all__ = ["add_report_parser", "main_report", "run_report"]


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help=(
            "a run folder (runs/recall/version_0) or a folder above one (the newest run "
            "is taken); give two to compare them"
        ),
    )
    add_directory_option(
        parser,
        "--out",
        help="where the PNG plots go (default: RUN_DIR/report, or ./report for several runs)",
    )
    parser.add_argument("--prefix", default="qkmonitor", help="the monitors' log_key_prefix")
    parser.add_argument("--no-plots", action="store_true", help="print the text only, write no PNG")
    parser.add_argument(
        "--loss-tag",
        default=None,
        metavar="TAG",
        help=f"the training loss's scalar tag (default: the first found of {', '.join(LOSS_TAGS)})",
    )
    parser.add_argument(
        "--max-alerts",
        type=_non_negative_int,
        default=20,
        help="list at most this many alert messages per run (0: none)",
    )


def add_report_parser(
    subparsers,
    formatter_class: type[argparse.HelpFormatter] = argparse.ArgumentDefaultsHelpFormatter,
) -> argparse.ArgumentParser:
    """Add the ``report`` command to a CLI's ``add_subparsers()`` object; returns its parser.
    ``formatter_class``: the CLI's help formatter (one that shows each default once)."""
    parser = subparsers.add_parser(
        "report",
        help="read a run back: per-layer table, alerts, PNG plots",
        description=(
            "Read qkmonitor runs back from their TensorBoard event files: a per-layer table of "
            "every metric, the alerts, and PNG plots. Two runs are compared side by side."
        ),
        formatter_class=formatter_class,
    )
    _add_arguments(parser)
    return parser


def run_report(args: argparse.Namespace) -> int:
    """Run the ``report`` command from parsed arguments: print the report; 0, or 2 on a bad run."""
    try:
        report = build_report(
            args.run_dirs,
            out_dir=args.out,
            prefix=args.prefix,
            plots=not args.no_plots,
            max_alerts=args.max_alerts,
            loss_tag=args.loss_tag,
        )
    except (ValueError, OSError) as err:  # a bad run; --out that cannot be written
        print(f"qkmonitor report: {err}", file=sys.stderr)
        return 2
    print(report.text)
    return 0


def main_report(argv: Sequence[str] | None = None) -> int:
    """``qkmonitor report`` on its own: parse ``argv`` and run it."""
    parser = argparse.ArgumentParser(
        prog="qkmonitor report",
        description=(
            "``qkmonitor report``: read a finished (or running) run back from its TensorBoard "
            "event files."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_arguments(parser)
    return run_report(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_report())
