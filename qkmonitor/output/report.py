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

Metrics are discovered from the tags of :mod:`qkmonitor.output.tags`, not from a fixed list; the
known ones come first, in the catalogue's order (docs/metrics.md). Reading needs TensorBoard's
``EventAccumulator`` and plotting needs matplotlib (drawn on an Agg canvas, never through
``pyplot``, so the caller's backend is left alone); both are imported when first used, so importing
this module is cheap and torch-free.

Example::

    from qkmonitor.output.report import build_report

    report = build_report(["runs/recall/version_0"], out_dir="report")
    print(report.text)         # the table and the alerts
    report.plots               # [Path('report/training_loss.png'), Path('report/kappa.png'), ...]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qkmonitor.measures.catalogue import CATALOGUE, MetricSpec
from qkmonitor.output.tags import LOSS_TAGS, layer_prefixes, parse_alert_tag, parse_layer_tag

if TYPE_CHECKING:
    from qkmonitor.alerts import AlertRule, Condition

__all__ = [
    "AlertEntry",
    "Report",
    "RunData",
    "Series",
    "add_report_parser",
    "build_report",
    "format_report",
    "main_report",
    "plot_runs",
    "read_run",
    "resolve_run_dir",
    "run_report",
]

#: Display order of the metrics the bundled monitors log (the catalogue's); any other follows,
#: sorted.
KNOWN_METRICS = tuple(spec.name for spec in CATALOGUE)
_SPECS = {spec.name: spec for spec in CATALOGUE}
_EVENT_MARKER = "tfevents"
_LINE_STYLES = ("-", "--", ":", "-.")
_RUN_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_THRESHOLD_COLOR = "crimson"


@dataclass(frozen=True)
class Series:
    """One scalar tag over steps, in the order TensorBoard stored it."""

    steps: tuple[int, ...]
    values: tuple[float, ...]

    @property
    def final(self) -> float:
        return self.values[-1]

    @property
    def final_step(self) -> int:
        return self.steps[-1]

    @property
    def min(self) -> float:
        """The smallest value over steps, NaN left out (NaN if every value is NaN)."""
        finite = [v for v in self.values if not math.isnan(v)]
        return min(finite) if finite else math.nan

    @property
    def max(self) -> float:
        """The largest value over steps, NaN left out (NaN if every value is NaN)."""
        finite = [v for v in self.values if not math.isnan(v)]
        return max(finite) if finite else math.nan


@dataclass(frozen=True)
class AlertEntry:
    """One alert message as the monitors wrote it to TensorBoard text."""

    step: int
    message: str
    #: the rule, from the message's tag ``{prefix}/alerts/{rule}``
    rule: str | None = None


@dataclass
class RunData:
    """Everything a report needs from one run.

    Attributes:
        path: the folder (or event file) that was read.
        given: the path as the caller gave it.
        note: how ``given`` became ``path`` when that was a choice (several runs below it).
        layers: metric -> layer -> the ``{prefix}/{metric}/layer_{LL}`` series (mean over heads).
        bands: metric -> layer -> ``"min"``/``"max"`` -> the lowest/highest-head series.
        heads: metric -> layer -> head -> the ``{prefix}/{metric}/layer_{LL}_head_{HH}`` series.
        alert_counts: rule -> the ``{prefix}/alerts/{rule}`` counter series.
        alerts: the alert messages, by step.
        loss: the training loss, read from ``loss_tag`` (None: the run has none of the tags).
    """

    path: Path
    given: Path
    prefix: str
    note: str | None = None
    layers: dict[str, dict[int, Series]] = field(default_factory=dict)
    bands: dict[str, dict[int, dict[str, Series]]] = field(default_factory=dict)
    heads: dict[str, dict[int, dict[int, Series]]] = field(default_factory=dict)
    alert_counts: dict[str, Series] = field(default_factory=dict)
    alerts: list[AlertEntry] = field(default_factory=list)
    loss: Series | None = None
    loss_tag: str | None = None

    @property
    def metrics(self) -> list[str]:
        """The metrics found, known ones first; validation metrics (``val/...``) after the rest."""
        return sorted(self.layers, key=_metric_order)

    @property
    def final_step(self) -> int:
        return max(s.final_step for per_layer in self.layers.values() for s in per_layer.values())

    @property
    def first_step(self) -> int:
        return min(s.steps[0] for per_layer in self.layers.values() for s in per_layer.values())

    @property
    def num_layers(self) -> int:
        return 1 + max(layer for per_layer in self.layers.values() for layer in per_layer)

    @property
    def alerts_fired(self) -> int:
        return int(sum(s.final for s in self.alert_counts.values() if not math.isnan(s.final)))


@dataclass
class Report:
    """What :func:`build_report` read, wrote and says."""

    runs: list[RunData]
    text: str
    plots: list[Path]
    out_dir: Path | None

    def __str__(self) -> str:
        return self.text


# -- finding and reading runs ----------------------------------------------------------------


def _has_events(folder: Path) -> bool:
    return any(_EVENT_MARKER in p.name and p.is_file() for p in folder.iterdir())


def _newest_mtime(folder: Path) -> float:
    return max(
        p.stat().st_mtime for p in folder.iterdir() if _EVENT_MARKER in p.name and p.is_file()
    )


def _natural_key(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.as_posix())]


def resolve_run_dir(path: str | Path) -> tuple[Path, str | None]:
    """The event folder to read for ``path``, and a note when that had to be chosen.

    ``path`` may be an event file, a folder holding event files (``runs/recall/version_0``), or a
    folder above such folders (``runs/recall``); with several below it, the one whose event files
    were written last is taken.

    Raises:
        ValueError: ``path`` does not exist or there is no event file in or below it.
    """
    given = Path(path)
    if not given.exists():
        raise ValueError(
            f"Run directory `{given}` does not exist; expected a TensorBoard run folder such as "
            "`runs/recall/version_0` or a folder above one."
        )
    if given.is_file():
        if _EVENT_MARKER not in given.name:
            raise ValueError(
                f"`{given}` is a file but not a TensorBoard event file (events.out.tfevents.*)."
            )
        return given, None
    if _has_events(given):
        return given, None
    found = sorted(
        (
            Path(root)
            for root, _, files in os.walk(given)
            if any(_EVENT_MARKER in name for name in files)
        ),
        key=_natural_key,
    )
    if not found:
        raise ValueError(
            f"Run directory `{given}` holds no TensorBoard event files (events.out.tfevents.*) in "
            "it or below it; expected the folder a TensorBoardLogger wrote, such as "
            "`runs/recall/version_0`."
        )
    if len(found) == 1:
        return found[0], None
    newest = max(found, key=lambda folder: (_newest_mtime(folder), _natural_key(folder)))
    names = [str(folder.relative_to(given)) for folder in found]
    listed = ", ".join(names) if len(names) <= 6 else ", ".join(names[:3] + ["..."] + names[-2:])
    note = (
        f"`{given}` holds {len(found)} runs ({listed}); reporting the newest, "
        f"`{newest.relative_to(given)}` (give its folder to report another)."
    )
    return newest, note


def _accumulator(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # 0 keeps every event: the defaults sample scalars down to 10,000 and tensors (text) to 10
    keep = {
        "scalars": 0,
        "tensors": 0,
        "images": 1,
        "histograms": 1,
        "compressedHistograms": 1,
        "audio": 1,
    }
    acc = EventAccumulator(str(path), size_guidance=keep)
    acc.Reload()
    return acc


def read_run(
    path: str | Path, prefix: str = "qkmonitor", loss_tags: Sequence[str] = LOSS_TAGS
) -> RunData:
    """Read one run's qkmonitor scalars, alert messages and training loss.

    Args:
        path: a run folder, a folder above one, or an event file (see :func:`resolve_run_dir`).
        prefix: the monitors' ``log_key_prefix``.
        loss_tags: the training loss is read from the first of these tags the run has.

    Returns:
        The run's series, grouped by metric, layer and head.

    Raises:
        ValueError: no run at ``path``, or it holds no ``{prefix}/...`` layer scalars.
    """
    folder, note = resolve_run_dir(path)
    acc = _accumulator(folder)
    run = RunData(path=folder, given=Path(path), prefix=prefix, note=note)
    scalar_tags = acc.Tags().get("scalars", [])
    means: dict[tuple[str, int], Series] = {}
    for tag in scalar_tags:
        rule, parsed = parse_alert_tag(prefix, tag), parse_layer_tag(prefix, tag)
        if rule is None and parsed is None:
            continue
        events = acc.Scalars(tag)
        series = Series(tuple(e.step for e in events), tuple(float(e.value) for e in events))
        if rule is not None:
            run.alert_counts[rule] = series
            continue
        if not series.steps:
            continue
        metric, layer, head = parsed
        if head is None:
            means[metric, layer] = series
        else:
            run.heads.setdefault(metric, {}).setdefault(layer, {})[head] = series
    metrics = {metric for metric, _ in means}
    for (metric, layer), series in sorted(means.items()):
        base, _, worst = metric.rpartition("_")
        if worst in ("min", "max") and base in metrics:  # the lowest/highest head of `base`
            run.bands.setdefault(base, {}).setdefault(layer, {})[worst] = series
        else:
            run.layers.setdefault(metric, {})[layer] = series
    if not run.layers:
        raise ValueError(_no_scalars_message(folder, prefix, scalar_tags))
    run.alerts = _read_alerts(acc, prefix)
    run.loss_tag = next((tag for tag in loss_tags if tag in scalar_tags), None)
    if run.loss_tag is not None:
        events = acc.Scalars(run.loss_tag)
        run.loss = Series(tuple(e.step for e in events), tuple(float(e.value) for e in events))
    return run


def _no_scalars_message(folder: Path, prefix: str, tags: Sequence[str]) -> str:
    message = (
        f"Run directory `{folder}` holds no qkmonitor scalars: expected tags like "
        f"`{prefix}/kappa/layer_00` (written by the qkmonitor callbacks with `log_key_prefix="
        f"'{prefix}'`)"
    )
    others = sorted(layer_prefixes(tags))
    if others:
        return (
            message
            + f"; found layer tags under the prefix {', '.join(f'`{p}`' for p in others)} (try "
            "`--prefix`)."
        )
    shown = ", ".join(f"`{t}`" for t in sorted(tags)[:5]) or "none"
    return message + f"; its scalar tags: {shown}{', ...' if len(tags) > 5 else ''}."


def _read_alerts(acc, prefix: str) -> list[AlertEntry]:
    """The alert messages, each under ``{prefix}/alerts/{rule}``: the rule is read from the tag."""
    from tensorboard.util import tensor_util

    try:
        text_tags = set(acc.PluginTagToContent("text"))
    except KeyError:  # no text plugin data in this run
        text_tags = set()
    entries = []
    for tag in sorted(text_tags & set(acc.Tags().get("tensors", []))):
        # torch's SummaryWriter.add_text(tag) stores the string tensor under `{tag}/text_summary`
        rule = parse_alert_tag(prefix, tag.removesuffix("/text_summary"))
        if rule is None:
            continue
        for event in acc.Tensors(tag):
            cells = tensor_util.make_ndarray(event.tensor_proto).reshape(-1)
            text = "\n".join(
                c.decode("utf-8", "replace") if isinstance(c, bytes) else str(c) for c in cells
            )
            entries.append(AlertEntry(step=int(event.step), message=text, rule=rule))
    return sorted(
        entries, key=lambda entry: entry.step
    )  # stable: same-step alerts keep their order


# -- the text ----------------------------------------------------------------------------------


def _metric_order(metric: str) -> tuple[bool, int, str]:
    validation = metric.startswith("val/")
    name = metric[4:] if validation else metric
    rank = KNOWN_METRICS.index(name) if name in KNOWN_METRICS else len(KNOWN_METRICS)
    return validation, rank, name


def _fmt(value: float | None, signed: bool = False) -> str:
    """Four significant digits; NaN as ``nan``, a missing value as ``-``.

    >>> _fmt(0.123456), _fmt(float("nan")), _fmt(-float("inf")), _fmt(None), _fmt(0.5, signed=True)
    ('0.1235', 'nan', '-inf', '-', '+0.5')
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
        return f"{_fmt(low.final)}..{_fmt(high.final)}"
    if high is not None:
        return f"max {_fmt(high.final)}"
    if low is not None:
        return f"min {_fmt(low.final)}"
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
        f"training loss (`{run.loss_tag}`): {_fmt(loss.values[0])} at step {loss.steps[0]}, "
        f"{_fmt(loss.final)} at step {loss.final_step} (lowest {_fmt(loss.min)})"
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
                    _fmt(series.final),
                    _fmt(series.min),
                    _fmt(series.max),
                    _band_text(run, metric, layer),
                ]
            )
    return _table(header, rows, left=1)


def _comparison_table(runs: list[RunData]) -> list[str]:
    letters = _RUN_LETTERS[: len(runs)]
    header = ["metric", "layer", *(f"{letter} final" for letter in letters)]
    if len(runs) == 2:
        header.append("B - A")
    metrics = sorted({m for run in runs for m in run.layers}, key=_metric_order)
    rows = []
    for metric in metrics:
        layers = sorted({layer for run in runs for layer in run.layers.get(metric, {})})
        for layer in layers:
            finals = [
                s.final if (s := run.layers.get(metric, {}).get(layer)) else None for run in runs
            ]
            cells = [metric, str(layer), *map(_fmt, finals)]
            if len(runs) == 2:
                a, b = finals
                cells.append(_fmt(b - a if a is not None and b is not None else None, signed=True))
            rows.append(cells)
    return _table(header, rows, left=1)


def _alert_lines(run: RunData, max_alerts: int | None) -> list[str]:
    """The counters' final values in one line, then the messages, one a line."""
    finals = {rule: s.final for rule, s in sorted(run.alert_counts.items())}
    fired = ", ".join(f"{rule} {_fmt(n)}" for rule, n in finals.items() if n != 0)
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
        runs: what :func:`read_run` returned, one or more.
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
        for letter, run in zip(_RUN_LETTERS, runs):
            lines += [f"  {letter}: {run.path} ({_run_summary(run)})"]
            lines += [f"     note: {run.note}"] if run.note else []
            lines += [f"     {_loss_text(run)}"]
        lines += [
            "",
            "final value of the per-layer mean (at each run's last logged step)",
            *_comparison_table(list(runs)),
        ]
        for letter, run in zip(_RUN_LETTERS, runs):
            first, *rest = _alert_lines(run, max_alerts)
            lines += ["", f"{letter}: {first}", *rest]
    if out_dir is not None:
        lines += ["", f"plots: {len(plots)} PNG file(s) in {out_dir}"]
    return "\n".join(lines)


# -- the plots ---------------------------------------------------------------------------------


def _file_stem(metric: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", metric)


def _run_labels(runs: Sequence[RunData]) -> list[str]:
    """Each run's letter and the shortest tail of its path, two parts at least, that tells it from
    the others' (``A: a/recall/version_0``, ``B: b/recall/version_0``)."""
    parts = [run.path.resolve().parts for run in runs]
    longest = max(map(len, parts))
    for count in range(min(2, longest), longest + 1):
        tails = [Path(*p[-count:]).as_posix() for p in parts]
        if len(set(tails)) == len(tails):
            break
    return [f"{letter}: {tail}" for letter, tail in zip(_RUN_LETTERS, tails)]


def _spec(metric: str) -> MetricSpec | None:
    """The catalogue entry of ``metric`` (``val/kappa``: ``kappa``'s), None for a metric it
    lacks."""
    return _SPECS.get(metric.removeprefix("val/"))


def _axis_label(metric: str) -> str:
    spec = _spec(metric)
    return f"{metric} ({spec.unit})" if spec is not None else metric


def _thresholds(metric: str) -> list[tuple[AlertRule, AlertRule | Condition]]:
    """``(rule, test)`` for each test of a default alert rule on ``metric``: the rule's own or one
    of its ``also`` conditions (validation metrics have none: the rules watch training)."""
    from qkmonitor.alerts import DEFAULT_RULES  # imports torch: only when plotting

    return [(rule, test) for rule in DEFAULT_RULES for test in rule.tests if test.metric == metric]


def _threshold_text(marks: Sequence[tuple[AlertRule, AlertRule | Condition]]) -> str:
    """One label for the rules whose thresholds lie at one level: ``alert kappa: ≥ 0.2, with more
    conditions`` (the rule's message states them all); ``alert logit_growth, fast_updates: ≥ 30``
    for two at one level (two labels there would print over each other)."""
    groups: dict[str, list[str]] = {}  # sign -> the rules' names, in order
    more = False
    for rule, test in marks:
        groups.setdefault("≥" if test.above else "≤", []).append(rule.name)
        more |= test.growth is not None or len(rule.tests) > 1 or rule.learning_drop is not None
    level = marks[0][1].threshold
    parts = [f"{', '.join(names)}: {sign} {level:g}" for sign, names in groups.items()]
    return "alert " + "; ".join(parts) + (", with more conditions" if more else "")


def _finite(values: Sequence[float]) -> list[float]:
    # an infinite value would stretch the axis to nothing; leave a gap as NaN does
    return [v if math.isfinite(v) else math.nan for v in values]


def _span(values: Sequence[float]) -> tuple[float, float] | None:
    """The (low, high) to show ``values`` on; a range of rounding noise is widened to 5% around
    it."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    low, high = min(finite), max(finite)
    # float32 noise around a constant (kappa of a rank-one head: 1 +- 1e-7) must not fill the axis
    if high - low <= 1e-5 * max(abs(low), abs(high)) or high == low:
        middle = (low + high) / 2
        pad = 0.05 * abs(middle) or 0.5
        return middle - pad, middle + pad
    return low, high


def _new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _layer_colors(num_layers: int) -> list:
    from matplotlib import colormaps

    if num_layers <= 10:
        return [colormaps["tab10"](i) for i in range(num_layers)]
    return [colormaps["viridis"](i / (num_layers - 1)) for i in range(num_layers)]


def _draw_thresholds(ax, metric: str, low: float, high: float) -> None:
    """The default alert rules' thresholds on ``metric`` over values shown from ``low`` to
    ``high``: a dashed line each where the y axis, stretched to show it, stays within three times
    the values' range; the others named in a note at the edge they lie beyond."""
    from matplotlib.transforms import blended_transform_factory

    marks = _thresholds(metric)
    fits = [max(high, t.threshold) - min(low, t.threshold) <= 3 * (high - low) for _, t in marks]
    lines = [mark for mark, fit in zip(marks, fits) if fit]
    if lines:
        levels = [test.threshold for _, test in lines]
        bottom, top = min(low, *levels), max(high, *levels)
        ax.set_ylim(bottom - 0.05 * (top - bottom), top + 0.05 * (top - bottom))
    across = blended_transform_factory(ax.transAxes, ax.transData)
    levels: dict[float, list] = {}  # one label a level: rules at one threshold share it
    for rule, test in lines:
        ax.axhline(
            test.threshold,
            color=_THRESHOLD_COLOR,
            linestyle="--",
            linewidth=1,
            gid=f"alert {rule.name}",
        )
        levels.setdefault(test.threshold, []).append((rule, test))
    for level, marks in levels.items():
        ax.text(
            0.995,
            level,
            _threshold_text(marks),
            transform=across,
            ha="right",
            va="bottom",
            fontsize="x-small",
            color=_THRESHOLD_COLOR,
            gid=f"threshold {level:g}",
        )
    for side, y in (("above", 0.99), ("below", 0.01)):
        names = [
            f"{test.threshold:g} ({rule.name})"
            for (rule, test), fit in sorted(zip(marks, fits), key=lambda m: m[0][1].threshold)
            if not fit and (test.threshold > high) == (side == "above")
        ]
        if names:
            ax.text(
                0.01,
                y,
                f"alert thresholds {side} the plot: {', '.join(names)}",
                transform=ax.transAxes,
                ha="left",
                va="top" if side == "above" else "bottom",
                fontsize="x-small",
                color=_THRESHOLD_COLOR,
                gid=f"alerts {side}",
            )


def _metric_figure(runs: Sequence[RunData], metric: str, labels: Sequence[str]):
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    figure = _new_figure(7.5, 4.5)
    ax = figure.add_subplot()
    num_layers = max(1 + max(run.layers[metric]) for run in runs if metric in run.layers)
    colors = _layer_colors(num_layers)
    many_points = (
        max(len(s.steps) for run in runs for s in run.layers.get(metric, {}).values()) > 60
    )
    shown: list[float] = []  # every value drawn, for the y range
    for index, run in enumerate(runs):
        style = _LINE_STYLES[index % len(_LINE_STYLES)]
        for layer, series in sorted(run.layers.get(metric, {}).items()):
            ax.plot(
                series.steps,
                _finite(series.values),
                linestyle=style,
                color=colors[layer],
                linewidth=1.6,
                marker=None if many_points else "o",
                markersize=3,
            )
            shown += series.values
            band = run.bands.get(metric, {}).get(layer, {})
            if (
                len(runs) == 1
                and "min" in band
                and "max" in band
                and band["min"].steps == series.steps
            ):
                ax.fill_between(
                    series.steps,
                    _finite(band["min"].values),
                    _finite(band["max"].values),
                    color=colors[layer],
                    alpha=0.15,
                    linewidth=0,
                )
                shown += band["min"].values + band["max"].values
    has_heads = any(metric in run.bands or metric in run.heads for run in runs)
    what = "mean over heads" if has_heads else "per layer"
    shaded = (
        ", shaded: lowest to highest head"
        if len(runs) == 1 and any(metric in r.bands for r in runs)
        else ""
    )
    ax.set_title(f"{metric} ({what}{shaded})")
    finite = [v for v in shown if math.isfinite(v)]
    span = _span(finite)
    if span is not None and span != (min(finite), max(finite)):  # flat: no axis of float noise
        ax.set_ylim(*span)
    if span is not None:
        _draw_thresholds(ax, metric, *span)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(_axis_label(metric))
    ax.grid(True, alpha=0.3)
    handles = []
    if num_layers <= 12:
        handles += [Line2D([], [], color=colors[i], label=f"layer {i}") for i in range(num_layers)]
    else:
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        figure.colorbar(
            ScalarMappable(Normalize(0, num_layers - 1), "viridis"), ax=ax, label="layer"
        )
    if len(runs) > 1:
        handles += [
            Line2D([], [], color="0.3", linestyle=_LINE_STYLES[i % len(_LINE_STYLES)], label=label)
            for i, label in enumerate(labels)
        ]
    if handles:
        ax.legend(handles=handles, fontsize="small", loc="best", ncol=2 if len(handles) > 8 else 1)
    return figure


def _loss_figure(runs: Sequence[RunData], labels: Sequence[str]):
    """The training loss of every run that has one; a log axis when it falls 30-fold or more."""
    from matplotlib.ticker import MaxNLocator

    figure = _new_figure(7.5, 4.0)
    ax = figure.add_subplot()
    values: list[float] = []
    for index, (run, label) in enumerate(zip(runs, labels)):
        if run.loss is None:
            continue
        ax.plot(
            run.loss.steps,
            _finite(run.loss.values),
            linestyle=_LINE_STYLES[index % len(_LINE_STYLES)],
            color=f"C{index}",
            linewidth=1.4,
            label=f"{label} (`{run.loss_tag}`)",
        )
        values += [v for v in run.loss.values if math.isfinite(v)]
    if values and min(values) > 0 and max(values) >= 30 * min(values):
        ax.set_yscale("log")
    tags = sorted({run.loss_tag for run in runs if run.loss_tag is not None})
    ax.set_title("training loss")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({', '.join(tags)})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3, which="both")
    if len(runs) > 1:
        ax.legend(fontsize="small", loc="best")
    return figure


def _head_grid(run: RunData, metric: str) -> tuple[list[list[float]], int]:
    """(layers x heads) final values, NaN where a head is missing, and the last step among them."""
    per_layer = run.heads[metric]
    num_layers, num_heads = (
        1 + max(per_layer),
        1 + max(h for heads in per_layer.values() for h in heads),
    )
    grid = [[math.nan] * num_heads for _ in range(num_layers)]
    step = 0
    for layer, heads in per_layer.items():
        for head, series in heads.items():
            grid[layer][head] = series.final
            step = max(step, series.final_step)
    return grid, step


def _head_history(run: RunData, metric: str) -> list[list[float]]:
    """Every logged step's per-head values of ``metric``, oldest first."""
    by_step: dict[int, list[float]] = {}
    for heads in run.heads[metric].values():
        for series in heads.values():
            for step, value in zip(series.steps, series.values):
                by_step.setdefault(step, []).append(value)
    return [by_step[step] for step in sorted(by_step)]


def _heat_scale(runs: Sequence[RunData], metric: str) -> tuple[float, float, str]:
    """The colour range and colour map of ``metric``'s per-head heatmaps: one for every head of
    every run compared.

    A signed metric with no bad end (``eig_mean``) is centred at 0 on a diverging map. A metric
    that TensorBoard draws heatmap images of gets the range those images take over a run
    (:class:`~qkmonitor.output.dashboards.HeatmapScale` within the catalogue's ``heatmap`` bounds),
    fed each logged step of each run in turn: the range of a run's final TensorBoard image when
    every probe was drawn (at least as wide when fewer were), so the two read colour for colour. Any
    other metric spans the final values shown.

    Returns:
        ``(low, high, colormap name)``.
    """
    spec = _spec(metric)
    runs = [run for run in runs if metric in run.heads]
    finals = [v for run in runs for row in _head_grid(run, metric)[0] for v in row]
    finite = [v for v in finals if math.isfinite(v)]
    if spec is not None and spec.range[0] < 0 < spec.range[1] and not spec.worse:
        reach = max((abs(v) for v in finite), default=0.0) or 1.0
        return -reach, reach, "RdBu_r"
    if spec is not None and spec.heatmap is not None and not metric.startswith("val/"):
        import torch

        from qkmonitor.output.dashboards import HeatmapScale  # imports torch: only when plotting

        scale = HeatmapScale(spec.heatmap)
        for run in runs:
            for values in _head_history(run, metric):
                scale.update(torch.tensor(values, dtype=torch.float64))
        return (*(scale.range or spec.heatmap), "viridis")
    low, high = _span(finite) or (0.0, 1.0)
    return low, high, "viridis"


def _heads_figure(runs: Sequence[RunData], metric: str, labels: Sequence[str]):
    import numpy as np
    from matplotlib import colormaps

    grids = [
        (label, *_head_grid(run, metric)) for label, run in zip(labels, runs) if metric in run.heads
    ]
    low, high, name = _heat_scale(runs, metric)
    cmap = colormaps[name].with_extremes(bad="0.85")
    widest = max(len(grid[0]) for _, grid, _ in grids)
    tallest = max(len(grid) for _, grid, _ in grids)
    figure = _new_figure(
        min(16, 1.5 + len(grids) * (1.2 + 0.55 * widest)), min(12, 2.0 + 0.45 * tallest)
    )
    axes = figure.subplots(1, len(grids), squeeze=False)[0]
    for ax, (label, grid, step) in zip(axes, grids):
        data = np.ma.masked_invalid(np.asarray(grid, dtype=float))
        image = ax.imshow(
            data, cmap=cmap, vmin=low, vmax=high, aspect="auto", interpolation="nearest"
        )
        rows, cols = data.shape
        if rows * cols <= 256:  # the numbers stay readable up to about 16 x 16
            for r in range(rows):
                for c in range(cols):
                    value = grid[r][c]
                    finite = math.isfinite(value)
                    shade = min(1.0, max(0.0, (value - low) / (high - low))) if finite else 0.0
                    red, green, blue, _ = cmap(shade)
                    dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5 and finite
                    ax.text(
                        c,
                        r,
                        _fmt(value) if len(_fmt(value)) <= 6 else f"{value:.2g}",
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="white" if dark else "black",
                    )
        ax.set_xticks(range(cols))
        ax.set_yticks(range(rows))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        title = f"{metric} per head at step {step}"
        ax.set_title(title if len(grids) == 1 else f"{label}\n{title}", fontsize="medium")
    bar = figure.colorbar(image, ax=list(axes), label=_axis_label(metric))
    for rule, test in _thresholds(metric):
        if low <= test.threshold <= high:
            bar.ax.axhline(
                test.threshold, color=_THRESHOLD_COLOR, linewidth=2, gid=f"alert {rule.name}"
            )
    return figure


def _save(figure, path: Path) -> Path:
    figure.savefig(path)
    return path


def plot_runs(runs: Sequence[RunData], out_dir: str | Path) -> list[Path]:
    """Write ``training_loss.png`` where a run has its loss, ``{metric}.png`` for every metric and
    ``{metric}_heads.png`` where heads were logged.

    With several runs each figure overlays them (solid, dashed, dotted, ...), each labelled by the
    shortest tail of its path that tells the runs apart, and each heatmap has one panel per run on
    the metric's one colour scale (:func:`_heat_scale`). The thresholds of the default alert rules
    are drawn on the plots and colour bars of the metrics they watch.

    Args:
        runs: what :func:`read_run` returned.
        out_dir: the folder to write into; created if missing.

    Returns:
        The paths written: the loss, the metrics, the heatmaps.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = _run_labels(runs)
    written = []
    if any(run.loss is not None for run in runs):
        written.append(_save(_loss_figure(runs, labels), out / "training_loss.png"))
    metrics = sorted({m for run in runs for m in run.layers}, key=_metric_order)
    written += [
        _save(_metric_figure(runs, m, labels), out / f"{_file_stem(m)}.png") for m in metrics
    ]
    head_metrics = sorted({m for run in runs for m in run.heads}, key=_metric_order)
    written += [
        _save(_heads_figure(runs, m, labels), out / f"{_file_stem(m)}_heads.png")
        for m in head_metrics
    ]
    return written


# -- the public entry points -------------------------------------------------------------------


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
        run_dirs: one run folder (or a folder above one, see :func:`resolve_run_dir`); two or
            more to compare them.
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


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def directory_problem(path: str) -> str | None:
    """Why ``path`` cannot be a directory to write into, in words, or None: it is a file, or a
    part of it is (a directory that is missing is made; its permissions are found out at the
    write)."""
    if os.path.isdir(path):
        return None
    if os.path.exists(path):
        return "it is a file"
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        return f"{parent!r} in it is a file"
    return None


def directory_argument(text: str) -> str:
    """An argparse type (``report --out``, ``train --log-dir``): a directory to write into, one
    that is or one to make (no part of it a file)."""
    problem = directory_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"expected a directory, got {text!r}: {problem}")
    return text


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
    parser.add_argument(
        "--out",
        type=directory_argument,
        default=None,
        metavar="DIR",
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
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_arguments(parser)
    return run_report(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_report())
