"""Every forward tile shape autotuning may pick, run in the Triton interpreter against the float64
reference.

The interpreter runs one tile, ``tuning.INTERPRETER_BLOCKS`` (16 × 16 unless replaced): here it is
replaced by each (BLOCK_M, BLOCK_N) of ``tuning.FWD_CONFIGS`` in turn, the short-sequence tiles
included, so that the index arithmetic of every tile (ragged query and key blocks, the causal
diagonal band, the longest-rows-first order of causal programs, key padding, sink keys, grouped
heads) is checked where the GPU cannot be. The interpreter ignores ``num_warps`` and
``num_stages``: which of those build, and without spills, is ``test_triton_compile.py``'s. Forward
only (the statistics and the output), with shapes of two query blocks, one of them ragged.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", minversion="3.4")  # the kernel's own bound (pyproject)

from qkmonitor.kernels import attention  # after the importorskip
from qkmonitor.kernels._triton import autograd as triton_autograd
from qkmonitor.kernels._triton import tuning

STAT_NAMES = ("lse", "entropy", "max_prob", "max_logit", "attended", "sink_mass")
TILES = sorted({(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in tuning.FWD_CONFIGS})
SHORT_TILES = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in tuning.SHORT_FWD_CONFIGS}


def test_the_short_sequence_tiles_are_among_those_run():
    assert SHORT_TILES <= set(TILES)


class GridSpy:
    """Stands in for the forward kernel: records each launch's grid, then launches."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tile", TILES, ids=[f"{m}x{n}" for m, n in TILES])
def test_every_forward_tile_equals_the_reference(reference, device, monkeypatch, tile, causal):
    if device != "cpu":
        pytest.skip("the interpreter's tile override; on a GPU autotuning picks the tiles")
    block_m, block_n = tile
    monkeypatch.setattr(tuning, "INTERPRETER_BLOCKS", {"BLOCK_M": block_m, "BLOCK_N": block_n})
    spy = GridSpy(triton_autograd.fwd_kernel)
    monkeypatch.setattr(triton_autograd, "fwd_kernel", spy)
    # two query blocks (the second ragged); keys over a few key blocks with a ragged tail, more
    # keys than queries so that the causal diagonal is offset (bottom-right aligned)
    n, m, d = block_m + 7, block_m + block_n + 5, 16
    gen = torch.Generator().manual_seed(block_m * 1000 + block_n + causal)
    q = torch.randn(2, 2, n, d, generator=gen).to(device)
    k, v = (torch.randn(2, 1, m, d, generator=gen).to(device) for _ in range(2))
    mask = (torch.rand(2, m, generator=gen) > 0.25).to(device) if causal else None
    sink = 3 if causal else 0
    with torch.no_grad():
        out, stats = attention(
            q, k, v, causal=causal, key_padding_mask=mask, return_stats=True,
            sink_tokens=sink, backend="triton",
        )  # fmt: skip
    assert spy.grids == [(2, 4)]  # ceil(n / BLOCK_M) query blocks × B·H: the tile ran
    ref = reference(q, k, v, causal=causal, key_padding_mask=mask, sink_tokens=sink)
    torch.testing.assert_close(out.double(), ref.out, atol=2e-5, rtol=2e-5, msg="out")
    for name in STAT_NAMES:
        value = getattr(stats, name)
        if name == "sink_mass" and not sink:
            assert value is None
            continue
        torch.testing.assert_close(
            value.double(), getattr(ref, name), atol=2e-5, rtol=2e-5, msg=name
        )
