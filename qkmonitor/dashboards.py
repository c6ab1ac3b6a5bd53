"""TensorBoard dashboards: the custom-scalars layout, layer x head heatmaps, attention images.

Everything here turns monitor values into TensorBoard objects; the callbacks decide when to write
them. The layout is one per run (TensorBoard keeps a single custom-scalars layout per writer):

- a category per monitor family with a *Multiline* chart per metric, one line per layer — the
  tag regex ``{prefix}/{metric}/layer_\\d+$`` picks every layer's mean;
- a *Margin* chart per (metric, layer): mean over heads with the band from the lowest to the
  highest head (``{metric}``, ``{metric}_min``, ``{metric}_max``);
- the alert counters.

Images are HWC uint8 arrays: :func:`heatmap_image` colours a (layers, heads) grid (NaN cells grey)
and :func:`attention_image` a (rows, keys) attention matrix.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from qkmonitor.catalogue import FAMILIES, metric
from qkmonitor.tags import layer_tag, worst_tag

__all__ = ["FAMILIES", "LayoutSection", "custom_scalars_layout", "heatmap_image", "attention_image", "grid_of"]

@dataclass(frozen=True)
class LayoutSection:
    """What one monitor charts: its prefix, metrics, layer count and alert rules."""

    prefix: str
    metrics: tuple[str, ...]
    num_layers: int
    alert_rules: tuple[str, ...] = ()


def custom_scalars_layout(sections: Sequence[LayoutSection]) -> dict:
    """The layout for ``SummaryWriter.add_custom_scalars``, covering every prefix present.

    Sections under the same prefix (the usual three monitors) merge into one set of categories;
    each prefix gets its own. Metric families and order come from :mod:`qkmonitor.catalogue`.

    Returns:
        ``{category: {chart: ["Multiline" | "Margin", [tags]]}}``.
    """
    by_prefix: dict[str, dict] = {}
    for section in sections:
        merged = by_prefix.setdefault(section.prefix, {"metrics": [], "num_layers": 0, "rules": []})
        merged["metrics"] += [m for m in section.metrics if m not in merged["metrics"]]
        merged["num_layers"] = max(merged["num_layers"], section.num_layers)
        merged["rules"] += [r for r in section.alert_rules if r not in merged["rules"]]
    layout: dict[str, dict[str, list]] = {}
    for prefix, merged in by_prefix.items():
        layout.update(_prefix_layout(prefix, merged["metrics"], merged["num_layers"], merged["rules"]))
    return layout


def _prefix_layout(prefix: str, metrics: list[str], num_layers: int, rules: list[str]) -> dict:
    layout: dict[str, dict[str, list]] = {}
    known = {m for names in FAMILIES.values() for m in names}
    extra = tuple(m for m in metrics if m not in known)
    for family, names in (*FAMILIES.items(), ("other", extra)):
        present = [m for m in names if m in metrics]
        if not present:
            continue
        layout[f"{prefix}: {family}"] = {
            f"{m} (a line per layer)": ["Multiline", [f"^{re.escape(prefix)}/{m}/layer_\\d+$"]] for m in present
        }
        margins = {
            f"{m} layer {layer:02d} (heads: min, mean, max)": [
                "Margin",
                [layer_tag(prefix, m, layer), worst_tag(prefix, m, "min", layer), worst_tag(prefix, m, "max", layer)],
            ]
            for m in present if _per_head(m) for layer in range(num_layers)
        }
        if margins:
            layout[f"{prefix}: {family}, per layer over heads"] = margins
    if rules:
        layout[f"{prefix}: alerts"] = {"alerts fired (count)": ["Multiline", [f"^{re.escape(prefix)}/alerts/"]]}
    return layout


def _per_head(name: str) -> bool:
    try:
        return metric(name).per_head
    except KeyError:  # a metric of a user's own engine: assume heads
        return True


def _colormap(values: np.ndarray, vmin: float, vmax: float) -> np.ndarray:
    """A viridis-like colour ramp (dark blue -> green -> yellow) in pure numpy; NaN is grey."""
    stops = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=np.float64)
    span = vmax - vmin if vmax > vmin else 1.0
    t = np.clip((values - vmin) / span, 0.0, 1.0) * (len(stops) - 1)
    low = np.floor(np.nan_to_num(t)).astype(int).clip(0, len(stops) - 2)
    frac = (np.nan_to_num(t) - low)[..., None]
    rgb = stops[low] * (1 - frac) + stops[low + 1] * frac
    rgb[np.isnan(values)] = (128, 128, 128)
    return rgb.astype(np.uint8)


def heatmap_image(grid: Tensor, vmin: float | None = None, vmax: float | None = None, cell: int = 16) -> np.ndarray:
    """(layers, heads) values as an HWC uint8 image, ``cell`` pixels per value, layers downwards.

    ``vmin``/``vmax`` fix the colour range (e.g. 0..1 for kappa and entropy_norm); by default the
    finite range of ``grid``.
    """
    values = grid.detach().double().cpu().numpy()
    finite = values[np.isfinite(values)]
    lo = float(finite.min()) if vmin is None and finite.size else (vmin or 0.0)
    hi = float(finite.max()) if vmax is None and finite.size else (vmax if vmax is not None else 1.0)
    img = _colormap(values, lo, hi)
    return np.repeat(np.repeat(img, cell, axis=0), cell, axis=1)


def attention_image(probs: Tensor, size: int = 128) -> np.ndarray:
    """A (rows, keys) attention matrix as an HWC uint8 image, scaled so the largest weight is bright.

    Each entry becomes a square of ``max(1, size // max(rows, keys))`` pixels.
    """
    values = probs.detach().double().cpu().numpy()
    peak = float(np.nanmax(values)) if values.size else 1.0
    img = _colormap(values, 0.0, peak if peak > 0 else 1.0)
    scale = max(1, size // max(values.shape))
    return np.repeat(np.repeat(img, scale, axis=0), scale, axis=1)


def grid_of(per_layer: list[Tensor]) -> Tensor:
    """Stack per-layer (heads,) tensors into (layers, max_heads), padding short layers with NaN."""
    width = max(t.numel() for t in per_layer)
    rows = [torch.cat([t.reshape(-1).float(), torch.full((width - t.numel(),), math.nan)]) for t in per_layer]
    return torch.stack(rows)
