"""``qkmonitor report``: read a finished (or running) run back from its TensorBoard event files.

A run's story in three parts: a per-layer table of every metric the monitors logged (final value
and the range over steps of the ``{prefix}/{metric}/layer_{LL}`` mean), the alerts (the text
messages and the counters, both under ``{prefix}/alerts/{rule}``), and PNG plots: the training
loss (``training_loss.png``, the first of :data:`qkmonitor.output.tags.LOSS_TAGS` the run has), each
metric over steps with one line per layer, its unit on the y axis and the thresholds of the default
alert rules drawn (``kappa.png``) and, where per-head tags exist, a layer x head heatmap of the
final values (``kappa_heads.png``) on one colour scale per metric, across heads and runs: the
range TensorBoard's heatmap images take where it draws them, centred at 0 for a signed metric
(``eig_mean``). Given two runs, the table puts their final values side by side with the
difference and the plots overlay them, each run labelled by the shortest tail of its path that
tells it from the other.

The parts: :mod:`qkmonitor.output.runs` reads the runs (metrics discovered from the tags of
:mod:`qkmonitor.output.tags`, not from a fixed list; the known ones first, in the catalogue's
order, docs/metrics.md), :mod:`qkmonitor.output.report_text` writes the text and
:mod:`qkmonitor.output.plots` draws the PNGs. Reading needs TensorBoard's ``EventAccumulator`` and
plotting needs matplotlib (drawn on an Agg canvas, never through ``pyplot``, so the caller's
backend is left alone); both are imported when first used, so importing this module is cheap and
torch-free. The ``qkmonitor report`` command's arguments are :mod:`qkmonitor.cli.report`'s.

Example::

    from qkmonitor.output.report import build_report

    report = build_report(["runs/recall/version_0"], out_dir="report")
    print(report.text)         # the table and the alerts
    report.plots               # [Path('report/training_loss.png'), Path('report/kappa.png'), ...]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from qkmonitor.output.plots import plot_runs
from qkmonitor.output.report_text import format_report
from qkmonitor.output.runs import RunData, read_run
from qkmonitor.output.tags import LOSS_TAGS

__all__ = ["Report", "build_report"]


@dataclass
class Report:
    """What :func:`build_report` read, wrote and says."""

    runs: list[RunData]
    text: str
    plots: list[Path]
    out_dir: Path | None

    def __str__(self) -> str:
        return self.text


def build_report(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path | None = None,
    prefix: str = "qkmonitor",
    plots: bool = True,
    max_alerts: int | None = 20,
    loss_tag: str | None = None,
) -> Report:
    """Read runs back and tell their story: table, alerts, PNG plots.

    Args:
        run_dirs: one run folder (or a folder above one, see
            :func:`~qkmonitor.output.runs.resolve_run_dir`); two or more to compare them.
        out_dir: where the PNGs go; default ``RUN_DIR/report`` for one run (inside the folder that
            was read) and ``./report`` for several.
        prefix: the monitors' ``log_key_prefix``.
        plots: write the PNGs; ``False`` for the text alone.
        max_alerts: list at most this many alert messages per run (``None``: all).
        loss_tag: the training loss's scalar tag (default: the first of
            :data:`qkmonitor.output.tags.LOSS_TAGS` the run has).

    Returns:
        A :class:`Report` with the parsed runs, the text and the PNG paths.

    Raises:
        ValueError: no run directory given, one missing or empty, or one without qkmonitor scalars.
    """
    if isinstance(run_dirs, (str, Path)) or not run_dirs:
        raise ValueError(
            f"Expected `run_dirs` to be a non-empty list of run folders, got {run_dirs!r}"
        )
    loss_tags = LOSS_TAGS if loss_tag is None else (loss_tag,)
    runs = [read_run(path, prefix, loss_tags) for path in run_dirs]
    written: list[Path] = []
    out: Path | None = None
    if plots:
        out = (
            Path(out_dir)
            if out_dir is not None
            else (
                runs[0].path / "report"
                if len(runs) == 1 and runs[0].path.is_dir()
                else Path("report")
            )
        )
        written = plot_runs(runs, out)
    return Report(
        runs=runs, text=format_report(runs, written, out, max_alerts), plots=written, out_dir=out
    )
