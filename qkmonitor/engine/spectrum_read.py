"""One read of the query/key weights by :class:`~qkmonitor.engine.spectrum.QKSpectrum`, and its
part in the exchange of heads split across ranks (tensor parallelism): this rank's heads of every
table out (:meth:`SpectrumRead.parts`), every rank's back in (:meth:`SpectrumRead.merge`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from qkmonitor.attention.adapters import AttentionLayer
from qkmonitor.engine.updates import UPDATE_METRICS
from qkmonitor.measures.layer_spectra import SPECTRUM_METRICS, LayerSpectra
from qkmonitor.measures.sharding import HeadPlacement, apart, side_by_side

__all__ = ["SpectrumRead", "heads_of", "layer_of", "merged_layers", "split_layers"]


def split_layers(layers: list[AttentionLayer]) -> list[tuple[int, HeadPlacement]]:
    """``(index, placement)`` of the layers whose heads are split across ranks."""
    split = [(i, layer.head_placement) for i, layer in enumerate(layers)]
    return [(i, p) for i, p in split if p is not None]


@dataclass
class SpectrumRead:
    """One read of the weights: its values by layer, this rank's part of the layers whose heads
    are split across ranks (``split``) until every head's are merged in (:meth:`merge`)."""

    step: int
    spectra: LayerSpectra
    values: dict
    undefined: dict
    split: list[tuple[int, HeadPlacement]]

    def _tables(self) -> list[list[list[Tensor]]]:
        """Every table of values by layer, in blocks of one kind for the exchange: the metrics
        (float32), the undefined flags (bool), the singular values (``(heads, d_k)``), the update
        metrics (float64; float32 NaN before a layer's first forward). The blocks, not the dtypes,
        fix the layout, so it is the same on every rank."""
        spectra = self.spectra
        return [
            [spectra.metrics[m] for m in SPECTRUM_METRICS],
            [*(spectra.undefined[m] for m in SPECTRUM_METRICS)]
            + [self.undefined[m] for m in UPDATE_METRICS if m in self.undefined],
            [spectra.singular_values],
            [self.values[m] for m in UPDATE_METRICS if m in self.values],
        ]

    @cached_property
    def _groups(self) -> list[tuple[HeadPlacement, list[int]]]:
        """The split layers by placement (a model's layers alike: one group), as ``(placement,
        layers)``: each group goes in one tensor."""
        groups: dict[HeadPlacement, list[int]] = {}
        for i, p in self.split:
            groups.setdefault(p, []).append(i)
        return list(groups.items())

    def parts(self) -> list[tuple[HeadPlacement, list[Tensor]]]:
        """This rank's heads of the split layers, for the exchange: every table of a group of
        layers in one tensor (:func:`~qkmonitor.measures.sharding.side_by_side`)."""
        blocks = self._tables()
        return [
            (p, [side_by_side([[_own_heads(t[i], p) for t in b for i in ls] for b in blocks])])
            for p, ls in self._groups
        ]

    def merge(self, merged: list[list[Tensor]]) -> None:
        """Every head's values of the split layers in place of this rank's part (``merged``: per
        group, the :meth:`parts` tensor of every head; a head no rank sent is NaN, not
        undefined)."""
        blocks = self._tables()
        for (_, layers), (whole,) in zip(self._groups, merged, strict=True):
            slots = [[(t, i) for t in block for i in layers] for block in blocks]
            like = [[t[i] for t, i in block] for block in slots]
            for block, values in zip(slots, apart(whole, like), strict=True):
                for (table, i), layer_values in zip(block, values, strict=True):
                    table[i] = layer_values


def _own_heads(values: Tensor, placement: HeadPlacement) -> Tensor:
    """This rank's heads of a layer's values: all of them where they are this rank's part (read
    from its rows), else its slots of the whole layer's (NaN where nothing was read)."""
    return (
        values[placement.slots] if values.shape[0] == placement.total != placement.count else values
    )


def layer_of(spectra: LayerSpectra, j: int) -> tuple[dict, dict, Tensor]:
    """The ``j``-th layer of ``spectra``: (metrics, undefined flags, singular values)."""
    return (
        {name: values[j] for name, values in spectra.metrics.items()},
        {name: values[j] for name, values in spectra.undefined.items()},
        spectra.singular_values[j],
    )


def merged_layers(layers: list[AttentionLayer], *parts: dict[int, tuple]) -> LayerSpectra:
    """One :class:`LayerSpectra` in layer order; a layer no part has is NaN (and marked undefined:
    the warning that names it has been given)."""
    out = LayerSpectra()
    for i, layer in enumerate(layers):
        found = next((part[i] for part in parts if i in part), None)
        if found is None:
            heads = heads_of(layer)
            found = (
                {m: torch.full((heads,), float("nan")) for m in SPECTRUM_METRICS},
                {m: torch.ones(heads, dtype=torch.bool) for m in SPECTRUM_METRICS},
                torch.full((heads, 1), float("nan")),
            )
        metrics, undefined, sv = found
        for name in SPECTRUM_METRICS:
            out.metrics[name].append(metrics[name])
            out.undefined[name].append(undefined[name])
        out.singular_values.append(sv)
    return out


def heads_of(layer: AttentionLayer) -> int:
    """The layer's head count for its NaN values: 1 where reading it raises (a layer whose weights
    cannot be read, warned about where the read failed)."""
    try:
        return layer.num_heads_hint
    except Exception:  # noqa: BLE001 -- a metric problem must never stop training
        return 1
