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

import numpy as np
import torch
from torch import Tensor

from qkmonitor.tags import layer_tag, worst_tag

__all__ = ["FAMILIES", "custom_scalars_layout", "heatmap_image", "attention_image", "grid_of"]

#: Dashboard categories and the metrics they chart, in display order.
FAMILIES: dict[str, tuple[str, ...]] = {
    "QK spectrum": ("kappa", "kappa_eig", "qk_erank", "qk_spectral_norm", "eig_mean", "eig_var"),
    "attention entropy": ("entropy_norm", "entropy", "max_prob", "max_logit"),
    "effective rank": ("hidden_collapse", "hidden_erank", "attn_erank", "attn_erank_norm", "attn_entropy_norm"),
}


def custom_scalars_layout(prefix: str, metrics: dict[str, bool], num_layers: int,
                          alert_rules: list[str]) -> dict:
    """The layout for ``SummaryWriter.add_custom_scalars``.

    Args:
        prefix: the monitors' ``log_key_prefix``.
        metrics: metric name -> whether it has per-head values (then it gets margin charts).
        num_layers: layers monitored.
        alert_rules: names of the alert rules in use.

    Returns:
        ``{category: {chart: ["Multiline" | "Margin", [tags]]}}``.
    """
    layout: dict[str, dict[str, list]] = {}
    known = [m for family in FAMILIES.values() for m in family]
    extra = tuple(m for m in metrics if m not in known)
    for family, names in (*FAMILIES.items(), ("other", extra)):
        present = [m for m in names if m in metrics]
        if not present:
            continue
        layout[f"{prefix}: {family}"] = {
            f"{m} (a line per layer)": ["Multiline", [f"^{prefix}/{m}/layer_\\d+$"]] for m in present
        }
        margins = {
            f"{m} layer {layer:02d} (heads: min, mean, max)": [
                "Margin",
                [layer_tag(prefix, m, layer), worst_tag(prefix, m, "min", layer), worst_tag(prefix, m, "max", layer)],
            ]
            for m in present if metrics[m] for layer in range(num_layers)
        }
        if margins:
            layout[f"{prefix}: {family}, per layer over heads"] = margins
    if alert_rules:
        layout[f"{prefix}: alerts"] = {"alerts fired (count)": ["Multiline", [f"^{prefix}/alerts/"]]}
    return layout


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
