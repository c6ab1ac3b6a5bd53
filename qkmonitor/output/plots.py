"""A report's PNG plots, drawn with matplotlib on an Agg canvas (never through ``pyplot``, so the
caller's backend is left alone); matplotlib is imported when a figure is first drawn.

The training loss (``training_loss.png``, the first of :data:`qkmonitor.output.tags.LOSS_TAGS`
the run has), each metric over steps with one line per layer, its unit on the y axis and the
thresholds of the default alert rules drawn (``kappa.png``; their labels where no line, band or
other label crosses them, :mod:`qkmonitor.output.plot_labels`) and, where per-head tags exist, a
layer x head heatmap of the final values (``kappa_heads.png``) on one colour scale per metric,
across heads and runs: the range TensorBoard's heatmap images take where it draws them, centred at
0 for a signed metric (``eig_mean``). Several runs are overlaid, each labelled by the shortest tail
of its path that tells it from the others.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from qkmonitor.measures.catalogue import CATALOGUE, MetricSpec
from qkmonitor.output.plot_labels import PlotLabel, Spot, place_labels, threshold_spots
from qkmonitor.output.report_text import format_value
from qkmonitor.output.runs import RUN_LETTERS, RunData, metric_order

if TYPE_CHECKING:
    from qkmonitor.alerts import AlertRule, Condition

__all__ = ["plot_runs"]

_SPECS = {spec.name: spec for spec in CATALOGUE}
_LINE_STYLES = ("-", "--", ":", "-.")
_THRESHOLD_COLOR = "crimson"


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
    return [f"{letter}: {tail}" for letter, tail in zip(RUN_LETTERS, tails)]


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
        more |= test.growth is not None or len(rule.tests) > 1 or rule.reads_loss
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


def _draw_thresholds(ax, metric: str, low: float, high: float) -> list[PlotLabel]:
    """The default alert rules' thresholds on ``metric`` over values shown from ``low`` to
    ``high``: a dashed line each where the y axis, stretched to show it, stays within three times
    the values' range; the others named in a note at the edge they lie beyond. Returns the labels
    of the lines and the notes, to place where no line or band crosses them
    (:func:`~qkmonitor.output.plot_labels.place_labels`)."""
    marks = _thresholds(metric)
    fits = [max(high, t.threshold) - min(low, t.threshold) <= 3 * (high - low) for _, t in marks]
    lines = [mark for mark, fit in zip(marks, fits) if fit]
    if lines:
        levels = [test.threshold for _, test in lines]
        bottom, top = min(low, *levels), max(high, *levels)
        ax.set_ylim(bottom - 0.05 * (top - bottom), top + 0.05 * (top - bottom))
    style = (("fontsize", "x-small"), ("color", _THRESHOLD_COLOR))
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
    labels = [
        PlotLabel(
            _threshold_text(marks), f"threshold {level:g}", threshold_spots(level), style, level
        )
        for level, marks in levels.items()
    ]
    for side, y, va in (("above", 0.99, "top"), ("below", 0.01, "bottom")):
        names = [
            f"{test.threshold:g} ({rule.name})"
            for (rule, test), fit in sorted(zip(marks, fits), key=lambda m: m[0][1].threshold)
            if not fit and (test.threshold > high) == (side == "above")
        ]
        if names:
            spots = (Spot(0.01, y, "left", va, data=False), Spot(0.99, y, "right", va, data=False))
            text = f"alert thresholds {side} the plot: {', '.join(names)}"
            labels.append(PlotLabel(text, f"alerts {side}", spots, style))
    return labels


def _metric_figure(runs: Sequence[RunData], metric: str, labels: Sequence[str]):
    from matplotlib.ticker import MaxNLocator

    figure = _new_figure(7.5, 4.5)
    ax = figure.add_subplot()
    num_layers = max(1 + max(run.layers[metric]) for run in runs if metric in run.layers)
    colors = _layer_colors(num_layers)
    shown = _draw_layers(ax, runs, metric, colors)  # every value drawn, for the y range
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
    marks = _draw_thresholds(ax, metric, *span) if span is not None else []
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(_axis_label(metric))
    ax.grid(True, alpha=0.3)
    handles = _layers_legend(figure, ax, colors, labels if len(runs) > 1 else ())
    place_labels(figure, ax, marks)  # where no line or band crosses them, the layout done
    if handles:  # "best": around the lines, bands and the labels placed
        ax.legend(handles=handles, fontsize="small", loc="best", ncol=2 if len(handles) > 8 else 1)
    return figure


def _draw_layers(ax, runs: Sequence[RunData], metric: str, colors: list) -> list[float]:
    """One line per layer of each run (a line style per run) and, for one run, the band from its
    lowest to its highest head; returns every value drawn."""
    many_points = (
        max(len(s.steps) for run in runs for s in run.layers.get(metric, {}).values()) > 60
    )
    shown: list[float] = []
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
    return shown


def _layers_legend(figure, ax, colors: list, run_labels: Sequence[str]) -> list:
    """The legend's handles: the layers' colours (a colour bar, drawn here, beyond 12 layers) and
    the runs' line styles (``run_labels``: none for one run)."""
    from matplotlib.lines import Line2D

    num_layers = len(colors)
    handles = []
    if num_layers <= 12:
        handles += [Line2D([], [], color=colors[i], label=f"layer {i}") for i in range(num_layers)]
    else:
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        figure.colorbar(
            ScalarMappable(Normalize(0, num_layers - 1), "viridis"), ax=ax, label="layer"
        )
    handles += [
        Line2D([], [], color="0.3", linestyle=_LINE_STYLES[i % len(_LINE_STYLES)], label=label)
        for i, label in enumerate(run_labels)
    ]
    return handles


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
                        format_value(value) if len(format_value(value)) <= 6 else f"{value:.2g}",
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
        runs: what :func:`~qkmonitor.output.runs.read_run` returned.
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
    metrics = sorted({m for run in runs for m in run.layers}, key=metric_order)
    written += [
        _save(_metric_figure(runs, m, labels), out / f"{_file_stem(m)}.png") for m in metrics
    ]
    head_metrics = sorted({m for run in runs for m in run.heads}, key=metric_order)
    written += [
        _save(_heads_figure(runs, m, labels), out / f"{_file_stem(m)}_heads.png")
        for m in head_metrics
    ]
    return written
