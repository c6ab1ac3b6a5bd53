"""Packing each rank's heads into one vector and unpacking the gathered packs
(``qkmonitor.measures.sharding.pack_heads`` / ``unpack_heads``), against a head-by-head
reference: every rank's heads land at their offsets, in their dtypes; a head no rank holds is NaN
(False for bool); the plan kept from one probe to the next moves the new values. The spectrum's
read, its tables side by side in one tensor a layer, comes back table by table as the same
reference places them."""

from __future__ import annotations

import torch

from qkmonitor.engine.spectrum_read import SpectrumRead
from qkmonitor.engine.updates import UPDATE_METRICS
from qkmonitor.measures.layer_spectra import SPECTRUM_METRICS, LayerSpectra
from qkmonitor.measures.sharding import HeadPlacement, pack_heads, unpack_heads


def rank_parts(rank: int, seed: int) -> list[tuple[HeadPlacement, list[torch.Tensor]]]:
    """Two layers as one of 2 ranks holds them: layer 0, 2 of 4 heads a rank; layer 1, 1 of 3
    heads a rank (head 2 held by none). Per layer a float32 (heads,), a (heads, 3) float32 and a
    bool (heads,) tensor."""
    gen = torch.Generator().manual_seed(10 * seed + rank)
    out = []
    for total, count in ((4, 2), (3, 1)):
        offset = rank * count
        out.append(
            (
                HeadPlacement(offset, count, total),
                [
                    torch.randn(count, generator=gen),
                    torch.randn(count, 3, generator=gen),
                    torch.rand(count, generator=gen) > 0.5,
                ],
            )
        )
    return out


def reference(ranks: list[list[tuple[HeadPlacement, list[torch.Tensor]]]]) -> list[list]:
    out = []
    for layer in range(len(ranks[0])):
        placement, tensors = ranks[0][layer]
        wholes = []
        for j, t in enumerate(tensors):
            fill = False if t.dtype == torch.bool else float("nan")
            whole = torch.full((placement.total, *t.shape[1:]), fill, dtype=t.dtype)
            for parts in ranks:
                p, ts = parts[layer]
                whole[p.offset : p.offset + p.count] = ts[j]
            wholes.append(whole)
        out.append(wholes)
    return out


def test_unpacked_heads_equal_a_head_by_head_reference_probe_after_probe():
    for seed in range(3):  # the second and third probes reuse the first one's plan
        ranks = [rank_parts(rank, seed) for rank in range(2)]
        gathered = torch.stack([pack_heads(parts) for parts in ranks])
        got = unpack_heads(ranks[0], gathered)
        want = reference(ranks)
        for got_layer, want_layer in zip(got, want, strict=True):
            for g, w in zip(got_layer, want_layer, strict=True):
                assert g.dtype == w.dtype and g.shape == w.shape
                torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)
        assert torch.isnan(got[1][0][2]) and not got[1][2][2]  # head 2 of layer 1: no rank's


def test_one_process_places_its_own_heads_and_leaves_the_rest_unset():
    parts = rank_parts(1, 0)
    got = unpack_heads(parts, pack_heads(parts)[None])
    torch.testing.assert_close(got[0][1][2:], parts[0][1][1])
    assert torch.isnan(got[0][0][:2]).all() and not got[0][2][:2].any()


def spectrum_read(rank: int, step: int) -> SpectrumRead:
    """The spectrum's read of 3 layers as one of 2 ranks holds them (layers 0 and 2: 2 of 4 query
    heads a rank, d_k 3 and 4, exchanged as one group; layer 1: 1 of 2, d_k 2): every table of
    metrics and undefined flags, with values that differ by rank, layer, head and table (one head's
    kappa NaN, some flags set). Layer 2's q_update_ratio is float32, as a read before the layer's
    first forward leaves it (NaN in the spectrum's shape), beside the other layers' float64: a
    block of two dtypes."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    spectra = LayerSpectra()
    values: dict[str, list[torch.Tensor]] = {m: [] for m in UPDATE_METRICS}
    undefined: dict[str, list[torch.Tensor]] = {m: [] for m in UPDATE_METRICS}
    split = []
    for layer, (total, count, d_k) in enumerate(((4, 2, 3), (2, 1, 2), (4, 2, 4))):
        for m in SPECTRUM_METRICS:
            spectra.metrics[m].append(torch.randn(count, generator=gen))
            spectra.undefined[m].append(torch.rand(count, generator=gen) > 0.5)
        spectra.singular_values.append(torch.rand(count, d_k, generator=gen))
        for m in UPDATE_METRICS:  # the update metrics are float64 before logging
            values[m].append(torch.randn(count, dtype=torch.float64, generator=gen))
            undefined[m].append(torch.rand(count, generator=gen) > 0.5)
        split.append((layer, HeadPlacement(rank * count, count, total)))
    spectra.metrics["kappa"][0][0] = float("nan")
    values["q_update_ratio"][2] = torch.randn(2, generator=gen)  # float32
    return SpectrumRead(step, spectra, values, undefined, split)


def flat_tables(read: SpectrumRead) -> list[list[torch.Tensor]]:
    return [table for block in read._tables() for table in block]


def test_the_spectrums_exchange_gives_every_table_of_every_head_in_its_dtype():
    """A read's tables go side by side in one tensor a group of layers of one placement
    (``SpectrumRead.parts``: 2 here); after the exchange each table of ``merge`` equals the ranks'
    tables placed head by head."""
    for step in range(2):  # the second exchange reuses the first one's plan
        reads = [spectrum_read(rank, step) for rank in range(2)]
        tables = [[list(t) for t in flat_tables(read)] for read in reads]  # as each rank read them
        packs = [read.parts() for read in reads]
        assert [len(parts) for parts in packs] == [2, 2]  # layers 0 and 2 in one tensor
        gathered = torch.stack([pack_heads(parts) for parts in packs])
        reads[0].merge(unpack_heads(packs[0], gathered))
        for t, merged in enumerate(flat_tables(reads[0])):
            for layer, (_, placement) in enumerate(reads[0].split):
                wanted = reference(
                    [[(HeadPlacement(rank * placement.count, placement.count, placement.total),
                       [tables[rank][t][layer]])] for rank in range(2)]
                )[0][0]  # fmt: skip
                got = merged[layer]
                assert got.dtype == wanted.dtype and got.shape == wanted.shape
                torch.testing.assert_close(got, wanted, equal_nan=True, rtol=0, atol=0)
