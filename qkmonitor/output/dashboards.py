"""TensorBoard dashboards: the custom-scalars layout, layer x head heatmaps, attention images.

Everything here turns monitor values into TensorBoard objects; the callbacks decide when to write
them. The layout is one per run (TensorBoard keeps a single custom-scalars layout per writer):

- a category per monitor family with a *Multiline* chart per metric, one line per layer, each
  from the layer's own run (:mod:`qkmonitor.output.layer_runs`), so that TensorBoard, which
  colours by run, colours them apart;
- a *Margin* chart per (metric, layer): mean over heads with the band from the lowest to the
  highest head (``{metric}``, ``{metric}_min``, ``{metric}_max``);
- with AttentionEntropyMonitor, the model's output logits (``{prefix}/run/output_*``);
- the alert counters (a rule's series starts at its first alert);
- first, a chart of the training and validation loss, the tags of
  :data:`qkmonitor.output.tags.LOSS_TAGS` and :data:`~qkmonitor.output.tags.VAL_LOSS_TAGS` that the
  run has (qkmonitor does not write the loss).

Images are HWC uint8 arrays: :func:`heatmap_image` colours a (layers, heads) grid (NaN cells grey)
and :func:`attention_image` a (rows, keys) attention matrix, each with a title, labelled axes and a
colour bar with its range (drawn with Pillow's built-in font; the frame of each shape is cached, so
an image draws only its title, numbers and cells).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from qkmonitor.measures.catalogue import CATALOGUE, FAMILIES, MetricSpec
from qkmonitor.output.layer_runs import overlay_chart
from qkmonitor.output.tags import (
    LOSS_TAGS,
    VAL_LOSS_TAGS,
    alert_tag,
    layer_tag,
    run_tag,
    worst_tag,
)

__all__ = [
    "FAMILIES",
    "FAMILY_ORDER",
    "HEADLINE",
    "HeatmapScale",
    "Layout",
    "LayoutSection",
    "attention_image",
    "custom_scalars_layout",
    "grid_of",
    "heatmap_image",
]


@dataclass(frozen=True)
class LayoutSection:
    """What one monitor charts: its prefix, metrics, layer count, alert rules, and the specs of
    its metrics the catalogue lacks (a user's: charted in their ``family``'s category)."""

    prefix: str
    metrics: tuple[str, ...]
    num_layers: int
    alert_rules: tuple[str, ...] = ()
    own: tuple[MetricSpec, ...] = ()


#: the metrics charted first, after the loss: what to look at first (the catalogue's families
#: follow, each without these)
HEADLINE = ("entropy_norm", "kappa", "max_logit")

#: the order of the families' categories after the headline: the activations' (what attention
#: does) before the weights' (its spectrum, then the optimizer's view of it)
FAMILY_ORDER = (
    "attention entropy",
    "QK spectrum",
    "effective rank",
    "QK-Clip",
    "optimizer's view",
)


class Layout(dict):
    """A custom-scalars layout (``{category: {chart: [kind, [tags]]}}``) that says which of its
    categories chart tags a run may never write (:attr:`conditional`: the output logits', which
    only a model whose forward returns logits has), and which series its overlays read from the
    layers' own runs (:attr:`overlays`). A TensorBoard sink writes a conditional category only
    once one of its tags was written, and each overlay's layers into their runs
    (:class:`~qkmonitor.output.sinks.SummaryWriterSink`)."""

    def __init__(self, *args, conditional: set[str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: the categories written only once a tag they chart was
        self.conditional: set[str] = set(conditional or ())
        #: ``{prefix}/{metric}`` of each overlay charted from the layers' runs, where the scalars
        #: ``{prefix}/{metric}/layer_LL`` go too, as ``{prefix}/{metric}``
        self.overlays: set[str] = set()

    def written(self, charted: set[str] | frozenset[str]) -> dict:
        """The layout to write: the conditional categories not in ``charted`` (the ones whose
        tags were written, :meth:`charted`) left out."""
        return {
            title: charts
            for title, charts in self.items()
            if title not in self.conditional or title in charted
        }

    def charted(self, tags: Iterable[str]) -> set[str]:
        """The conditional categories that chart one of ``tags``."""
        tags = list(tags)
        return {title for title in self.conditional if _charts_any(self[title], tags)}


def _charts_any(charts: dict, tags: Iterable[str]) -> bool:
    patterns = [p for _, (_, chart_tags) in charts.items() for p in chart_tags]
    return any(re.search(p, t) for p in patterns for t in tags)


def custom_scalars_layout(
    sections: Sequence[LayoutSection],
    *,
    loss_tags: Sequence[str] = LOSS_TAGS + VAL_LOSS_TAGS,
    tag_prefix: str = "",
) -> Layout:
    """The layout for ``SummaryWriter.add_custom_scalars``, covering every prefix present.

    TensorBoard shows the categories and their charts in the layout's order (its custom-scalars
    dashboard maps ``layout.category`` as it comes, and pages a category at 12 charts), so the
    order here is the page's: the loss, then per prefix the headline metrics (:data:`HEADLINE`:
    ``entropy_norm``, ``kappa``, ``max_logit``), then the families (:data:`FAMILY_ORDER`), the
    output logits and the alert counters. A "per layer over heads" category follows each, its
    charts by metric (the category's order) and then by layer (00, 01, ...) on the page: the
    layout lists them last first, as TensorBoard shows a category of margin charts from its last
    chart to its first (its multiline categories in order; tests/browser reads the page).

    A *Multiline* chart colours its lines by run, not by tag, so a metric's overlay ("a line per
    layer") charts ``^{prefix}/{metric}$``, which each layer's own run holds (``layers/layer_LL``,
    :attr:`Layout.overlays`): a colour a layer, the run named in the tooltip (beyond
    ``layer_runs.LAYER_RUNS_MAX`` layers, the run's ``{prefix}/{metric}/layer_LL``: one colour).
    Each per-head metric also has a *Margin* chart per layer (the mean over heads, with the band
    from the lowest to the highest head).

    Sections under the same prefix (the usual three monitors) merge into one set of categories;
    each prefix gets its own. The first category charts the loss: the loss is written by the
    training code, not by the monitors, so the chart matches whichever of ``loss_tags`` the run
    has. The output logits' category is conditional (:class:`Layout`): written once the run wrote
    one of its tags.

    Args:
        sections: what each monitor charts.
        loss_tags: the loss's possible tags (training and validation); empty for no loss chart.
        tag_prefix: what the logger puts before every tag it writes (a Lightning logger's
            ``prefix``), the loss's included; the sections' prefixes carry it already.

    Returns:
        ``{category: {chart: ["Multiline" | "Margin", [tags]]}}``, a :class:`Layout`.
    """
    by_prefix: dict[str, dict] = {}
    for section in sections:
        merged = by_prefix.setdefault(section.prefix, {"metrics": [], "num_layers": 0, "rules": []})
        merged["metrics"] += [m for m in section.metrics if m not in merged["metrics"]]
        merged.setdefault("own", {}).update({spec.name: spec for spec in section.own})
        merged["num_layers"] = max(merged["num_layers"], section.num_layers)
        merged["rules"] += [r for r in section.alert_rules if r not in merged["rules"]]
    layout = Layout()
    if loss_tags:
        names = "|".join(re.escape(tag_prefix + tag) for tag in loss_tags)
        layout["training"] = {"loss (training and validation)": ["Multiline", [f"^({names})$"]]}
    for prefix, merged in by_prefix.items():
        _add_prefix_layout(layout, prefix, **merged)
    return layout


def _add_prefix_layout(layout: Layout, prefix: str, metrics, num_layers, rules, own) -> None:
    grouped = {family: list(names) for family, names in FAMILIES.items()}
    for spec in own.values():  # a user's metrics join their family's category, after its own
        grouped.setdefault(spec.family, []).append(spec.name)
    known = {m for names in grouped.values() for m in names}
    headline = tuple(m for m in HEADLINE if m in metrics)
    families = [(f"{prefix}: {', '.join(headline)}", headline)] if headline else []
    order = [*FAMILY_ORDER, *(f for f in grouped if f not in FAMILY_ORDER)]
    families += [
        (f"{prefix}: {family}", tuple(m for m in grouped[family] if m not in HEADLINE))
        for family in order
        if family in grouped
    ]
    families.append((f"{prefix}: other", tuple(m for m in metrics if m not in known)))
    # per head: a catalogue metric as it says, a user's as its spec says; one of an engine of a
    # user's own without a spec: assumed
    per_head = {m: True for m in metrics} | {s.name: s.per_head for s in CATALOGUE}
    per_head |= {name: spec.per_head for name, spec in own.items()}
    for title, names in families:
        present = [m for m in names if m in metrics]
        if not present:
            continue
        layout[title] = {
            f"{m} (a line per layer)": overlay_chart(layout.overlays, prefix, m, num_layers)
            for m in present
        }
        margins = {
            f"{m} layer {layer:02d} (heads: min, mean, max)": [
                "Margin",
                [
                    layer_tag(prefix, m, layer),
                    worst_tag(prefix, m, "min", layer),
                    worst_tag(prefix, m, "max", layer),
                ],
            ]
            for m in present
            if per_head[m]
            for layer in range(num_layers)
        }
        if margins:  # last first: TensorBoard shows a category of margin charts from its last
            # chart to its first (seen in headless Chromium, tests/browser), so the page reads
            # them by metric, then layer 00, 01, ...
            layout[f"{title}, per layer over heads"] = dict(reversed(margins.items()))
    if "max_logit" in metrics:  # AttentionEntropy's probe reads the model's output logits too
        title = f"{prefix}: output logits"
        layout[title] = {
            "output_lse_rms and output_logit_max (the run's, not a layer's)": [
                "Multiline",
                [f"^{re.escape(run_tag(prefix, 'output_'))}"],
            ]
        }
        layout.conditional.add(title)  # a model whose forward returns no logits has none
    if rules:
        layout[f"{prefix}: alerts"] = {
            "alerts fired (count; a rule appears at its first alert)": [
                "Multiline",
                [f"^{re.escape(alert_tag(prefix, ''))}"],
            ]
        }


class HeatmapScale:
    """One metric's heatmap colour range over a run: set by the first grid drawn, then only widened.

    A fixed range over the metric's bounds leaves typical values in a corner of the ramp (κ of a
    trained model at 0.17-0.39 of 0..1 reads almost uniformly dark), and a range per image changes
    what a colour means from one step to the next. So the range starts at the first grid's
    finite values, at least ``min_span`` of the bounds wide (the nearly equal heads of an
    initialisation do not fill the ramp), rounded outward to a round step, within the bounds; it
    widens when a later grid leaves it and never narrows. Images drawn between two widenings
    compare colour for colour; each one's colour bar is labelled with its range.

    Args:
        bounds: the values the metric can take (the catalogue's ``heatmap``); the range stays
            inside them.
        min_span: the smallest range, as a fraction of the bounds' width.

    Example::

        >>> scale = HeatmapScale((0.0, 1.0))
        >>> scale.update(torch.tensor([[0.12, 0.39]]))
        (0.1, 0.4)
        >>> scale.update(torch.tensor([[0.2, 0.3]]))  # inside: unchanged
        (0.1, 0.4)
        >>> scale.update(torch.tensor([[0.2, 0.62]]))  # above: widened
        (0.1, 0.65)
    """

    def __init__(self, bounds: tuple[float, float] = (0.0, 1.0), min_span: float = 0.25) -> None:
        lo, hi = bounds
        if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo):
            raise ValueError(f"Expected finite `bounds` with lo < hi, got {bounds!r}")
        if not 0 < min_span <= 1:
            raise ValueError(f"Expected `min_span` in (0, 1], got {min_span!r}")
        self.bounds = (float(lo), float(hi))
        self.min_span = min_span
        #: the current range; None until a grid with a finite value was seen
        self.range: tuple[float, float] | None = None

    def update(self, grid: Tensor) -> tuple[float, float]:
        """Widen the range to hold ``grid``'s finite values; return the range to draw it with."""
        values = grid.detach().double().cpu()
        finite = values[torch.isfinite(values)]
        if finite.numel() == 0:
            return self.range or self.bounds
        lo, hi = float(finite.min()), float(finite.max())
        if self.range is None:
            span = max(hi - lo, self.min_span * (self.bounds[1] - self.bounds[0]))
            lo = min(max(self.bounds[0], (lo + hi - span) / 2), self.bounds[1] - span)
            hi = lo + span
        else:
            lo, hi = min(lo, self.range[0]), max(hi, self.range[1])
        step = 10.0 ** math.floor(math.log10(hi - lo)) / 2
        slack = 1e-5  # of a step: float32 values on a round number stay on it
        self.range = (
            max(self.bounds[0], round(math.floor(lo / step + slack) * step, 12)),
            min(self.bounds[1], round(math.ceil(hi / step - slack) * step, 12)),
        )
        return self.range


def _colormap(values: np.ndarray, vmin: float, vmax: float) -> np.ndarray:
    """A viridis-like colour ramp (dark blue -> green -> yellow) in pure numpy; NaN is grey."""
    stops = np.array(
        [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
        dtype=np.float64,
    )
    span = vmax - vmin if vmax > vmin else 1.0
    t = np.clip((values - vmin) / span, 0.0, 1.0) * (len(stops) - 1)
    low = np.floor(np.nan_to_num(t)).astype(int).clip(0, len(stops) - 2)
    frac = (np.nan_to_num(t) - low)[..., None]
    rgb = stops[low] * (1 - frac) + stops[low + 1] * frac
    rgb[np.isnan(values)] = (128, 128, 128)
    return rgb.astype(np.uint8)


def heatmap_image(
    grid: Tensor,
    vmin: float | None = None,
    vmax: float | None = None,
    *,
    title: str = "",
    cell: int | None = None,
    annotate: bool | None = None,
) -> np.ndarray:
    """(layers, heads) values as a readable HWC uint8 image: layers downwards, heads across.

    Axes labelled ``layer`` and ``head`` with their indices, a colour bar with its range, NaN cells
    grey, and (``annotate``; default: grids up to 12 x 12) each cell's value written in it.

    Args:
        grid: (layers, heads) values.
        vmin, vmax: the colour range (e.g. 0..1 for kappa and entropy_norm); by default the
            finite range of ``grid``.
        title: a line above the grid, e.g. ``"kappa at step 100"``.
        cell: pixels per cell (default: larger for small grids).
        annotate: write each value in its cell.
    """
    values = grid.detach().double().cpu().numpy()
    lo, hi = _range(values, vmin, vmax)
    rows, cols = values.shape
    annotate = max(rows, cols) <= 12 if annotate is None else annotate
    cell = cell or (
        max(32, min(48, 480 // max(cols, 1)))
        if annotate
        else max(6, min(24, 480 // max(cols, rows, 1)))
    )
    cells = np.repeat(np.repeat(_colormap(values, lo, hi), cell, axis=0), cell, axis=1)
    canvas = _Canvas(
        cells,
        title,
        xlabel="head",
        ylabel="layer",
        xticks=cols,
        yticks=rows,
        cell=cell,
        lo=lo,
        hi=hi,
    )
    if annotate:
        for (i, j), value in np.ndenumerate(values):
            canvas.cell_text(
                i, j, _short(value), dark=_is_dark(_colormap(np.array([value]), lo, hi)[0])
            )
    return canvas.image()


def attention_image(probs: Tensor, size: int = 192, *, title: str = "") -> np.ndarray:
    """A (rows, keys) attention matrix as a readable HWC uint8 image: queries downwards, keys
    across, colour from 0 to the largest weight, with axes and a colour bar.

    Each entry becomes a square of ``max(1, size // max(rows, keys))`` pixels.
    """
    values = probs.detach().double().cpu().numpy()
    finite = values[np.isfinite(values)]
    peak = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    scale = max(1, size // max(values.shape))
    cells = np.repeat(np.repeat(_colormap(values, 0.0, peak), scale, axis=0), scale, axis=1)
    canvas = _Canvas(
        cells,
        title,
        xlabel="key",
        ylabel="query",
        xticks=values.shape[1],
        yticks=values.shape[0],
        cell=scale,
        lo=0.0,
        hi=peak,
    )
    return canvas.image()


def _range(values: np.ndarray, vmin: float | None, vmax: float | None) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    lo = vmin if vmin is not None else (float(finite.min()) if finite.size else 0.0)
    hi = vmax if vmax is not None else (float(finite.max()) if finite.size else 1.0)
    return (lo, hi) if hi > lo else (lo, lo + 1.0)


def _short(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-2):
        return f"{value:.0e}"
    return f"{value:.3g}" if abs(value) >= 10 else f"{value:.2f}"


def _is_dark(rgb: np.ndarray) -> bool:
    return float(0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]) < 128


class _Canvas:
    """Coloured cells framed by a title, axis labels, tick indices and a colour bar (Pillow's
    built-in font). Everything but the cells, the title and the colour bar's numbers depends on
    the shape only, so that frame is drawn once per shape and copied (text rendering was most of
    an image's cost)."""

    MARGIN_LEFT, MARGIN_TOP, MARGIN_BOTTOM, BAR = 60, 22, 34, 64

    def __init__(
        self,
        cells: np.ndarray,
        title: str,
        *,
        xlabel: str,
        ylabel: str,
        xticks: int,
        yticks: int,
        cell: int,
        lo: float,
        hi: float,
    ) -> None:
        from PIL import Image, ImageDraw

        h, w = cells.shape[:2]
        self.cell = cell
        self.left, self.top = self.MARGIN_LEFT, self.MARGIN_TOP
        self.canvas = _frame(h, w, cell, xticks, yticks, xlabel, ylabel).copy()
        self.canvas.paste(Image.fromarray(cells), (self.left, self.top))
        self.draw = ImageDraw.Draw(self.canvas)
        self.font = _font()
        if title:
            self.draw.text((self.left, 4), title, fill=(0, 0, 0), font=self.font)
        x, height = self.left + w + 10 + 13, max(h, 60)
        for value, at in (
            (hi, self.top),
            ((lo + hi) / 2, self.top + height / 2),
            (lo, self.top + height - 1),
        ):
            self.draw.text((x, at), _short(value), fill=(0, 0, 0), font=self.font, anchor="lm")

    def cell_text(self, i: int, j: int, text: str, dark: bool) -> None:
        x, y = self.left + j * self.cell + self.cell / 2, self.top + i * self.cell + self.cell / 2
        self.draw.text(
            (x, y), text, fill=(255, 255, 255) if dark else (0, 0, 0), font=self.font, anchor="mm"
        )

    def image(self) -> np.ndarray:
        return np.asarray(self.canvas, dtype=np.uint8).copy()


@functools.lru_cache(maxsize=1)
def _font():
    from PIL import ImageFont

    return ImageFont.load_default(size=11)


@functools.lru_cache(maxsize=32)
def _frame(h: int, w: int, cell: int, xticks: int, yticks: int, xlabel: str, ylabel: str):
    """The white canvas with tick indices, axis labels and the colour bar's ramp, for (h, w)
    cells."""
    from PIL import Image, ImageDraw

    left, top = _Canvas.MARGIN_LEFT, _Canvas.MARGIN_TOP
    height = max(h, 60)
    canvas = Image.new(
        "RGB", (left + w + _Canvas.BAR, top + height + _Canvas.MARGIN_BOTTOM), (255, 255, 255)
    )
    draw, font, ink = ImageDraw.Draw(canvas), _font(), (0, 0, 0)
    step_x = max(1, math.ceil(xticks / max(1, w // 24)))
    for j in range(0, xticks, step_x):
        draw.text(
            (left + j * cell + cell / 2, top + h + 8), str(j), fill=ink, font=font, anchor="mm"
        )
    step_y = max(1, math.ceil(yticks / max(1, h // 14)))
    for i in range(0, yticks, step_y):
        draw.text((left - 6, top + i * cell + cell / 2), str(i), fill=ink, font=font, anchor="rm")
    draw.text((left + w / 2, top + h + 22), xlabel, fill=ink, font=font, anchor="mm")
    draw.text((4, top + h / 2), ylabel, fill=ink, font=font, anchor="lm")
    ramp = np.linspace(1.0, 0.0, height)[:, None].repeat(10, axis=1)  # top: the range's high end
    canvas.paste(Image.fromarray(_colormap(ramp, 0.0, 1.0)), (left + w + 10, top))
    return canvas


def grid_of(per_layer: list[Tensor]) -> Tensor:
    """Stack per-layer (heads,) tensors into (layers, max_heads), padding short layers with NaN."""
    width = max(t.numel() for t in per_layer)
    rows = [
        torch.cat([t.reshape(-1).float(), torch.full((width - t.numel(),), math.nan)])
        for t in per_layer
    ]
    return torch.stack(rows)
