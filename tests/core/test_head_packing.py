"""Packing each rank's heads into one vector and unpacking the gathered packs
(``qkmonitor.measures.sharding.pack_heads`` / ``unpack_heads``), against a head-by-head
reference: every rank's heads land at their offsets, in their dtypes; a head no rank holds is NaN
(False for bool); the plan kept from one probe to the next moves the new values."""

from __future__ import annotations

import torch

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
