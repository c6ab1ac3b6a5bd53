"""A report's alert-threshold labels sit where no line and no band crosses them.

Each case is a run whose data passes through a label's old spot (the right end of its threshold
line, just above it): kappa with layer 1's line running along the rule's 0.2 there, max_logit with
the band of its heads over the 30 of ``logit_growth`` and ``fast_updates``. The figure is drawn as
the report saves it, and each label's box, as drawn (its window extent), is checked against the
run's own values: the lines sampled along their steps, the bands tested point by point between
their lowest and highest head, both mapped to pixels through the axes' data transform.
"""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from qkmonitor.output.plots import _metric_figure
from qkmonitor.output.report import build_report
from qkmonitor.output.runs import read_run

#: pixels around a line that a label keeps clear of: its markers' radius (3 points at 110 dpi)
#: and half its width
REACH = 2.5

KAPPA = {  # layer 1 ends along the rule's 0.2, where its label was drawn
    "qkmonitor/kappa/layer_00": [0.30, 0.31, 0.33, 0.34, 0.35, 0.36, 0.36],
    "qkmonitor/kappa/layer_01": [0.30, 0.27, 0.24, 0.21, 0.2025, 0.2025, 0.2025],
}
MAX_LOGIT = {  # the heads' band over 30 at the right end, where "≥ 30" was drawn
    "qkmonitor/max_logit/layer_00": [10.0, 14.0, 20.0, 27.0, 31.0],
    "qkmonitor/max_logit_min/layer_00": [8.0, 11.0, 16.0, 24.0, 27.0],
    "qkmonitor/max_logit_max/layer_00": [13.0, 18.0, 26.0, 34.0, 40.0],
}


def write_run(folder, values: dict[str, list[float]]) -> None:
    writer = SummaryWriter(str(folder))
    for tag, series in values.items():
        for step, value in enumerate(series):
            writer.add_scalar(tag, value, step)
    writer.close()


def drawn(run, metric: str, tmp_path):
    """The report's figure of ``metric``, saved as the report saves it; its axes and renderer."""
    figure = _metric_figure([run], metric, ["A"])
    figure.savefig(tmp_path / f"{metric}.png")
    return figure.axes[0], figure.canvas.get_renderer()


def labels(ax) -> dict[str, object]:
    """The thresholds' labels and the notes of thresholds off the plot, by gid."""
    return {
        text.get_gid(): text
        for text in ax.texts
        if (text.get_gid() or "").startswith(("threshold ", "alerts "))
    }


def crossings(ax, box, run, metric: str) -> list[str]:
    """What of ``run``'s ``metric`` crosses ``box`` (display pixels): a layer's line (sampled
    between its steps), a layer's band (a grid of the box's points, tested against the lowest and
    highest head at their step)."""
    found = []
    for layer, series in run.layers[metric].items():
        steps, values = np.asarray(series.steps, float), np.asarray(series.values, float)
        x = np.linspace(steps[0], steps[-1], 2000)
        pixels = ax.transData.transform(np.column_stack([x, np.interp(x, steps, values)]))
        near = box.padded(REACH)
        if near.count_contains(pixels):
            found.append(f"layer {layer}'s line")
        band = run.bands.get(metric, {}).get(layer)
        if band is None:
            continue
        grid = np.stack(
            np.meshgrid(np.linspace(box.x0, box.x1, 60), np.linspace(box.y0, box.y1, 12)), -1
        ).reshape(-1, 2)
        gx, gy = ax.transData.inverted().transform(grid).T
        inside = (gx >= steps[0]) & (gx <= steps[-1])
        low = np.interp(gx, steps, band["min"].values)
        high = np.interp(gx, steps, band["max"].values)
        if np.any(inside & (gy >= low) & (gy <= high)):
            found.append(f"layer {layer}'s band")
    return found


@pytest.mark.parametrize(
    ("metric", "values", "crossed"),
    [("kappa", KAPPA, "threshold 0.2"), ("max_logit", MAX_LOGIT, "threshold 30")],
)
def test_no_line_or_band_crosses_a_threshold_label(tmp_path, metric, values, crossed):
    write_run(tmp_path / "run", values)
    run = read_run(tmp_path / "run")
    ax, renderer = drawn(run, metric, tmp_path)
    marks = labels(ax)
    assert crossed in marks, sorted(marks)
    frame = ax.get_window_extent(renderer)
    boxes = {gid: text.get_window_extent(renderer) for gid, text in marks.items()}
    for gid, box in boxes.items():
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1, gid
        assert frame.y0 <= box.y0 and box.y1 <= frame.y1, gid
        assert crossings(ax, box, run, metric) == [], (gid, marks[gid].get_text())
        assert marks[gid].get_bbox_patch() is None, gid  # a free spot: no white background
        others = [o for g, o in boxes.items() if g != gid]
        assert not any(box.overlaps(other) for other in others), gid
    legend = ax.get_legend().get_window_extent(renderer)
    assert not any(legend.overlaps(box) for box in boxes.values())
    report = build_report([tmp_path / "run"], out_dir=tmp_path / "report")
    assert tmp_path / "report" / f"{metric}.png" in report.plots


def test_a_label_with_no_free_spot_gets_a_background(tmp_path):
    # the band covers the threshold's line over the whole plot, close above and below it
    write_run(
        tmp_path / "run",
        {
            "qkmonitor/kappa/layer_00": [0.25, 0.25, 0.25],
            "qkmonitor/kappa_min/layer_00": [0.15, 0.15, 0.15],
            "qkmonitor/kappa_max/layer_00": [0.35, 0.35, 0.35],
        },
    )
    ax, _ = drawn(read_run(tmp_path / "run"), "kappa", tmp_path)
    label = labels(ax)["threshold 0.2"]
    assert label.get_bbox_patch() is not None and label.get_bbox_patch().get_facecolor()[:3] == (
        1.0,
        1.0,
        1.0,
    )
