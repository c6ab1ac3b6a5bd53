"""The CUDA autotuning search space: what ``tuning.prune`` keeps for each shape (plain Python, no
GPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", minversion="3.4")  # the kernel's own bound (pyproject)

from qkmonitor.kernels._triton import tuning  # after the importorskip

KERNEL_CONFIGS = {
    "fwd": tuning.FWD_CONFIGS,
    "dkdv": tuning.DKDV_CONFIGS,
    "dq": tuning.DQ_CONFIGS,
}


@pytest.mark.parametrize("kernel", sorted(KERNEL_CONFIGS))
@pytest.mark.parametrize("n_q, n_k", [(16, 16), (32, 64), (128, 128), (16, 16384), (16384, 16384)])
@pytest.mark.parametrize("block_d", [16, 64, 128, 256])
def test_prune_keeps_fitting_tiles(kernel, n_q, n_k, block_d):
    kept = tuning.prune(
        KERNEL_CONFIGS[kernel], {"N_Q_BUCKET": n_q, "N_K_BUCKET": n_k}, BLOCK_D=block_d
    )
    assert kept
    for config in kept:
        bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        assert bm <= max(n_q, 16) and bn <= max(n_k, 16)
        assert max(bm, bn) * block_d <= 128 * 128  # register budget per tile row
    if max(n_q, n_k) <= 128:
        assert len(kept) == 1  # short sequences: no benchmarking at first call


def test_autotune_key_buckets_lengths():
    assert [tuning.bucket(n) for n in (1, 16, 17, 1000, 1024, 1025)] == [
        16,
        16,
        32,
        1024,
        1024,
        2048,
    ]


@pytest.mark.parametrize("kernel", sorted(KERNEL_CONFIGS))
@pytest.mark.parametrize("n", [128, 16384])
@pytest.mark.parametrize("block_d", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_prune_keeps_tiles_within_shared_memory(kernel, n, block_d, dtype):
    """A configuration over the GPU's shared memory fails at launch; with a single configuration
    left (short sequences) nothing would catch it, so pruning must drop it (sm_90: 227 KiB)."""
    import torch

    q = torch.empty(0, dtype=getattr(torch, dtype))
    named_args = {"N_Q_BUCKET": n, "N_K_BUCKET": n, "Q": q}
    limit = 232448
    kept = tuning.prune(
        KERNEL_CONFIGS[kernel], named_args, kernel=kernel, smem_limit=limit, BLOCK_D=block_d
    )
    assert kept
    for config in kept:
        assert tuning.smem_bytes(kernel, config, block_d, q.element_size()) <= limit


@pytest.mark.parametrize("kernel", sorted(KERNEL_CONFIGS))
@pytest.mark.parametrize("block_d", [64, 128])
def test_prune_drops_tiles_that_spill_at_this_head_dim(kernel, block_d):
    """Tiles carry where they spill (measured by scripts/compile_kernels.py): above their
    ``max_block_d`` everywhere, and at ``sm80_spills`` head dims on compute capability 8.x."""
    named_args = {"N_Q_BUCKET": 4096, "N_K_BUCKET": 4096}
    configs = KERNEL_CONFIGS[kernel]
    assert any(tuning.limits_of(c) != tuning.TileLimits() for c in configs)  # measured limits
    for capability in (8, 9):
        kept = tuning.prune(configs, named_args, capability=capability, BLOCK_D=block_d)
        for config in kept:
            limits = tuning.limits_of(config)
            assert block_d <= limits.max_block_d
            assert capability != 8 or block_d not in limits.sm80_spills
    on_sm90 = tuning.prune(configs, named_args, capability=9, BLOCK_D=block_d)
    on_sm80 = tuning.prune(configs, named_args, capability=8, BLOCK_D=block_d)
    spilling_on_sm80 = [c for c in on_sm90 if block_d in tuning.limits_of(c).sm80_spills]
    assert len(on_sm80) == len(on_sm90) - len(spilling_on_sm80)


def _keys(configs) -> set[tuple]:
    return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs}


@pytest.mark.parametrize("n_q, n_k", [(512, 512), (1024, 1024), (2048, 2048), (1000, 2048)])
@pytest.mark.parametrize("block_d", [64, 128])
def test_short_sequences_are_offered_their_own_forward_tiles(n_q, n_k, block_d):
    """N = 512..2048 (the lengths most fine-tuning uses) get the short-sequence tiles (two
    stages; query blocks of 32 and 64) beside the others, each where it builds without spills on
    sm_90: every short tile of ``SHORT_FWD_CONFIGS`` whose limits admit this head dim."""
    named_args = {"N_Q_BUCKET": tuning.bucket(n_q), "N_K_BUCKET": tuning.bucket(n_k)}
    kept = tuning.prune(tuning.FWD_CONFIGS, named_args, capability=9, BLOCK_D=block_d)
    fitting = [c for c in tuning.SHORT_FWD_CONFIGS if block_d <= tuning.limits_of(c).max_block_d]
    assert fitting and _keys(fitting) <= _keys(kept)
    assert any(c.num_stages == 2 and c.kwargs["BLOCK_M"] <= 64 for c in kept)
    everywhere = tuning.prune(
        tuning.FWD_EVERY_LENGTH_CONFIGS, named_args, capability=9, BLOCK_D=block_d
    )
    assert _keys(everywhere) < _keys(kept)  # the other tiles are still offered there


@pytest.mark.parametrize("n", [16, 128, 4096, 16384])
@pytest.mark.parametrize("block_d", [64, 128])
@pytest.mark.parametrize("capability", [8, 9])
def test_other_lengths_keep_their_forward_tiles(n, block_d, capability):
    """The short-sequence tiles are offered at no other length: sequences of at most 128 keep
    their one untuned tile and long ones their own set (no more configurations to benchmark)."""
    named_args = {"N_Q_BUCKET": n, "N_K_BUCKET": n}
    kept = tuning.prune(tuning.FWD_CONFIGS, named_args, capability=capability, BLOCK_D=block_d)
    before = tuning.prune(
        tuning.FWD_EVERY_LENGTH_CONFIGS, named_args, capability=capability, BLOCK_D=block_d
    )
    assert _keys(kept) == _keys(before)
    assert not _keys(kept) & _keys(tuning.SHORT_FWD_CONFIGS)
