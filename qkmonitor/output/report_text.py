"""The text of a report: a per-layer table of every metric of one run (or the runs' final values
side by side with the difference), its alerts, and where the plots went.

Made of what :mod:`qkmonitor.output.runs` read; plain Python, so importing this module is cheap
and torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from qkmonitor.output.runs import RUN_LETTERS, RunData, metric_order

__all__ = ["format_report", "format_value"]


def format_value(value: float | None, signed: bool = False) -> str:
    """Four significant digits; NaN as ``nan``, a missing value as ``-``.

    >>> format_value(0.123456), format_value(float("nan")), format_value(-float("inf"))
    ('0.1235', 'nan', '-inf')
    >>> format_value(None), format_value(0.5, signed=True)
    ('-', '+0.5')
    """
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    return f"{value:+.4g}" if signed else f"{value:.4g}"


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """Aligned columns: the first ``left`` columns flush left, the others flush right."""
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(header), line(["-" * w for w in widths]), *map(line, rows)]


def _band_text(run: RunData, metric: str, layer: int) -> str:
    band = run.bands.get(metric, {}).get(layer, {})
    low, high = band.get("min"), band.get("max")
    if low is not None and high is not None:
        return f"{format_value(low.final)}..{format_value(high.final)}"
    if high is not None:
        return f"max {format_value(high.final)}"
    if low is not None:
        return f"min {format_value(low.final)}"
    return ""


def _run_summary(run: RunData) -> str:
    counts = {len(h) for per_layer in run.heads.values() for h in per_layer.values()}
    heads = (
        f"; per-head tags for {len(run.heads)} metric(s), {max(counts)} heads"
        if run.heads
        else "; no per-head tags"
    )
    return (
        f"steps {run.first_step}-{run.final_step}, {run.num_layers} layer(s), "
        f"{len(run.layers)} metric(s){heads}"
    )


def _loss_text(run: RunData) -> str:
    if run.loss is None:
        return "training loss: none found (give its tag with `--loss-tag`)"
    loss = run.loss
    return (
        f"training loss (`{run.loss_tag}`): {format_value(loss.values[0])} at step "
        f"{loss.steps[0]}, {format_value(loss.final)} at step {loss.final_step} (lowest "
        f"{format_value(loss.min)})"
    )


def _single_table(run: RunData) -> list[str]:
    header = ["metric", "layer", "step", "final", "min", "max", "heads min..max"]
    rows = []
    for metric in run.metrics:
        for layer, series in sorted(run.layers[metric].items()):
            rows.append(
                [
                    metric,
                    str(layer),
                    str(series.final_step),
                    format_value(series.final),
                    format_value(series.min),
                    format_value(series.max),
                    _band_text(run, metric, layer),
                ]
            )
    return _table(header, rows, left=1)


def _comparison_table(runs: list[RunData]) -> list[str]:
    letters = RUN_LETTERS[: len(runs)]
    header = ["metric", "layer", *(f"{letter} final" for letter in letters)]
    if len(runs) == 2:
        header.append("B - A")
    metrics = sorted({m for run in runs for m in run.layers}, key=metric_order)
    rows = []
    for metric in metrics:
        layers = sorted({layer for run in runs for layer in run.layers.get(metric, {})})
        for layer in layers:
            finals = [
                s.final if (s := run.layers.get(metric, {}).get(layer)) else None for run in runs
            ]
            cells = [metric, str(layer), *map(format_value, finals)]
            if len(runs) == 2:
                a, b = finals
                cells.append(
                    format_value(b - a if a is not None and b is not None else None, signed=True)
                )
            rows.append(cells)
    return _table(header, rows, left=1)


def _alert_lines(run: RunData, max_alerts: int | None) -> list[str]:
    """The counters' final values in one line, then the messages, one a line."""
    finals = {rule: s.final for rule, s in sorted(run.alert_counts.items())}
    fired = ", ".join(f"{rule} {format_value(n)}" for rule, n in finals.items() if n != 0)
    quiet = ", ".join(rule for rule, n in finals.items() if n == 0)
    if not finals:  # a rule's counter is written from its first alert on
        head = "alerts: none fired (no alert counter written)"
    elif fired:
        head = f"alerts: {run.alerts_fired} fired: {fired}" + (
            f" (none of {quiet})" if quiet else ""
        )
    else:
        head = f"alerts: none fired (rules counted: {quiet})"
    lines = [
        head + f"; {len(run.alerts)} message(s)" + (":" if run.alerts and max_alerts != 0 else "")
    ]
    shown = run.alerts if max_alerts is None else run.alerts[:max_alerts]
    width = len(str(max((a.step for a in shown), default=0)))
    lines += [f"  step {str(a.step).rjust(width)}  {a.message}" for a in shown]
    if len(shown) < len(run.alerts):
        lines.append(
            f"  ... and {len(run.alerts) - len(shown)} more (raise `--max-alerts` to list them)"
        )
    return lines


def format_report(
    runs: Sequence[RunData],
    plots: Sequence[Path] = (),
    out_dir: Path | None = None,
    max_alerts: int | None = 20,
) -> str:
    """The text of a report: per-layer table (or side-by-side finals), alerts, where the plots are.

    Args:
        runs: what :func:`~qkmonitor.output.runs.read_run` returned, one or more.
        plots: the PNG files written, to count in the last line.
        out_dir: where they were written.
        max_alerts: list at most this many messages per run (``None``: all).

    Returns:
        The report as lines of plain text.
    """
    if not runs:
        raise ValueError("Expected at least one run to report, got none")
    lines: list[str] = []
    if len(runs) == 1:
        run = runs[0]
        lines += [f"qkmonitor report: {run.path}"]
        lines += [f"  note: {run.note}"] if run.note else []
        lines += [
            f"  {_run_summary(run)}",
            f"  {_loss_text(run)}",
            "",
            (
                "final value, min and max over steps of the per-layer mean; the heads' range at "
                "the final step"
            ),
            *_single_table(run),
            "",
            *_alert_lines(run, max_alerts),
        ]
    else:
        lines += [f"qkmonitor report: comparing {len(runs)} runs"]
        for letter, run in zip(RUN_LETTERS, runs):
            lines += [f"  {letter}: {run.path} ({_run_summary(run)})"]
            lines += [f"     note: {run.note}"] if run.note else []
            lines += [f"     {_loss_text(run)}"]
        lines += [
            "",
            "final value of the per-layer mean (at each run's last logged step)",
            *_comparison_table(list(runs)),
        ]
        for letter, run in zip(RUN_LETTERS, runs):
            first, *rest = _alert_lines(run, max_alerts)
            lines += ["", f"{letter}: {first}", *rest]
    if out_dir is not None:
        lines += ["", f"plots: {len(plots)} PNG file(s) in {out_dir}"]
    return "\n".join(lines)
