"""Labels on a report's plot where no line and no band crosses them (:mod:`qkmonitor.output.plots`).

A label has spots to go to, in order of preference (an alert threshold's label: at the right end
of its line, above it, then below, then at the left end and the middle); :func:`place_labels`
puts each at the first spot whose box, as drawn, stays inside the axes and meets no line (a
layer's, its markers included), no band (the lowest-to-highest-head range) and no label placed
before it. Where every spot is crossed, the least crossed one is taken and the label gets a white
background, so that it stays legible. The layout is computed first (``draw_without_rendering``),
so the boxes are the ones the PNG will have; a legend placed afterwards at ``loc="best"`` avoids
the labels (matplotlib counts texts as obstacles).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PlotLabel", "Spot", "data_obstacles", "place_labels", "threshold_spots"]

#: pixels a label keeps clear of a layer's line: its markers (3 points wide at 110 dpi) reach
#: this far beyond it
_MARKER_CLEARANCE = 3.0
#: pixels a label keeps clear of a threshold's line, a band or another label
_CLEARANCE = 1.0
#: the gid prefix of the alert thresholds' lines (a label may touch the line it names)
_THRESHOLD_GID = "alert "


@dataclass(frozen=True)
class Spot:
    """Where a label may go: ``x`` in axes coordinates (0 left, 1 right), ``y`` in data
    coordinates (``data``) or axes coordinates, moved ``dy`` points up (negative: down), aligned
    by ``ha``/``va`` as matplotlib's text is."""

    x: float
    y: float
    ha: str
    va: str
    data: bool = True
    dy: float = 0.0


@dataclass(frozen=True)
class PlotLabel:
    """A text to place: its ``spots`` in order of preference, drawn with ``style``
    (``Axes.text``'s keywords: colour, font size) and tagged ``gid``; a threshold's label gives
    its line's ``level``."""

    text: str
    gid: str
    spots: tuple[Spot, ...]
    style: tuple[tuple[str, object], ...] = ()
    #: the height of the alert threshold's line it names, which it may touch (None: a note)
    level: float | None = None


def threshold_spots(level: float) -> tuple[Spot, ...]:
    """The spots of a label naming a horizontal line at ``level``: at the right end, left end or
    middle of the line, just above it or just below it (right above first)."""
    ends = ((0.995, "right"), (0.005, "left"), (0.5, "center"))
    sides = (("bottom", 2.0), ("top", -2.0))
    return tuple(Spot(x, level, ha, va, dy=dy) for x, ha in ends for va, dy in sides)


def data_obstacles(ax) -> tuple[list, list]:
    """What a label must not meet, in display coordinates: the lines, each as
    ``(path, clearance, level)`` (NaN gaps left out; ``level``: the height of an alert
    threshold's line, None for a layer's line) and the bands (filled polygons)."""
    from matplotlib.collections import PolyCollection

    lines = []
    for line in ax.get_lines():
        if not line.get_visible():
            continue
        path = line.get_transform().transform_path(line.get_path().cleaned(remove_nans=True))
        if (line.get_gid() or "").startswith(_THRESHOLD_GID):
            lines.append((path, _CLEARANCE, line.get_ydata()[0]))
        else:
            lines.append((path, _MARKER_CLEARANCE, None))
    bands = [
        collection.get_transform().transform_path(path)
        for collection in ax.collections
        if isinstance(collection, PolyCollection) and collection.get_visible()
        for path in collection.get_paths()
    ]
    return lines, bands


def _crossings(box, inside, lines: Sequence, bands: Sequence, taken: Sequence) -> int:
    """How many things ``box`` meets: ``lines`` (``(path, clearance)``: their segments or
    vertices), bands (their outline or inside), labels placed; a box not inside the axes counts
    as crossing everything."""
    if not (inside.x0 <= box.x0 <= box.x1 <= inside.x1 and inside.y0 <= box.y0 <= box.y1):
        return 1 + len(lines) + len(bands) + len(taken)
    if box.y1 > inside.y1:
        return 1 + len(lines) + len(bands) + len(taken)
    near = box.padded(_CLEARANCE)
    crossed = sum(path.intersects_bbox(near, filled=True) for path in bands)
    crossed += sum(near.overlaps(other) for other in taken)
    for path, clearance in lines:
        reach = box.padded(clearance)
        crossed += path.intersects_bbox(reach, filled=False) or bool(
            reach.count_contains(path.vertices)
        )
    return crossed


def _put(text, ax, spot: Spot) -> None:
    from matplotlib.transforms import blended_transform_factory, offset_copy

    base = blended_transform_factory(ax.transAxes, ax.transData) if spot.data else ax.transAxes
    text.set_transform(offset_copy(base, fig=ax.figure, y=spot.dy, units="points"))
    text.set_position((spot.x, spot.y))
    text.set_horizontalalignment(spot.ha)
    text.set_verticalalignment(spot.va)


def place_labels(figure, ax, labels: Sequence[PlotLabel]) -> list:
    """Put each of ``labels`` on ``ax`` at its first spot that no line, band or earlier label
    crosses (the least crossed, on a white background, where all are).

    Call it once everything else that changes the layout is on the figure (titles, axis labels,
    a colour bar) and before a legend at ``loc="best"``.

    Returns:
        The texts, in the order of ``labels``.
    """
    if not labels:
        return []
    figure.draw_without_rendering()  # the constrained layout: the axes as the PNG has them
    renderer = figure.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    lines, bands = data_obstacles(ax)
    taken: list = []
    texts = []
    for label in labels:
        text = ax.text(0, 0, label.text, gid=label.gid, **dict(label.style))
        best = None
        others = [(p, clear) for p, clear, level in lines if level is None or level != label.level]
        for spot in label.spots:
            _put(text, ax, spot)
            box = text.get_window_extent(renderer)
            cost = _crossings(box, inside, others, bands, taken)
            if best is None or cost < best[0]:
                best = (cost, spot, box)
            if cost == 0:
                break
        cost, spot, box = best
        _put(text, ax, spot)
        if cost:
            text.set_bbox({"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 1})
        taken.append(box)
        texts.append(text)
    return texts
