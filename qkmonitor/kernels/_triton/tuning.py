"""Tile sizes and launches: the autotuned configurations, their pruning, the launcher.

On CUDA the tile sizes are autotuned per (bucketed N, M, head dim, causal, statistics) among those
that fit the GPU's shared memory and build without register spills on it (``_configs``); the
forward offers more tiles to sequences of 256 to 2048 (``SHORT_FWD_CONFIGS``), so that short and
long sequences each get their own choice from their own set. Under the interpreter
(``TRITON_INTERPRET=1``) one small configuration is used (``INTERPRETER_BLOCKS``), as autotuning
with several configurations fails without a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from triton import knobs

from qkmonitor.kernels._triton.backward import attn_bwd_dkdv, attn_bwd_dq
from qkmonitor.kernels._triton.forward import attn_fwd

#: Whether the kernels were decorated for the interpreter (the flag is read at decoration).
INTERPRETED = bool(knobs.runtime.interpret)
#: The one tile of every kernel under the interpreter (tests replace it to run other tiles' code).
INTERPRETER_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}
#: Query rows per program of the δ kernel (not autotuned).
DELTA_BLOCK_M = 16 if INTERPRETED else 64


def _configs(shapes: list[tuple], lengths: tuple[int, int] | None = None) -> list[triton.Config]:
    """Tiles ``(BLOCK_M, BLOCK_N, num_warps, num_stages, max_block_d, sm80_spills)``, offered at
    the length buckets ``lengths`` (None: at every length; see :class:`TileLimits`).

    ``max_block_d`` is the largest padded head dim the tile is kept for, and ``sm80_spills`` the
    head dims at which it spills on compute capability 8.x only (``mma.sync`` holds its operand
    tiles in registers, where sm_90's ``wgmma`` reads them from shared memory): ``prune`` drops
    the tile there. Both come from building every kept tile through the real compiler
    (``scripts/compile_kernels.py``, run by ``tests/kernels/test_triton_compile.py``): none may
    spill a register, on sm_90 or sm_80.
    """
    configs = []
    for bm, bn, warps, stages, max_block_d, sm80_spills in shapes:
        config = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
        limits = TileLimits(max_block_d, frozenset(sm80_spills), lengths)
        _LIMITS[id(config)] = (config, limits)
        configs.append(config)
    return configs


@dataclass(frozen=True)
class TileLimits:
    """Where a tile spills a register: above ``max_block_d`` (the padded head dim), and at the
    head dims of ``sm80_spills`` on compute capability 8.x only; and where it is offered:
    ``lengths = (lo, hi)`` while the longer of the two length buckets is in ``[lo, hi]`` (None:
    at every length)."""

    max_block_d: int = 256
    sm80_spills: frozenset[int] = frozenset()
    lengths: tuple[int, int] | None = None

    def offered_at(self, longest: int) -> bool:
        """Whether the tile is a candidate when the longer length bucket is ``longest``."""
        return self.lengths is None or self.lengths[0] <= longest <= self.lengths[1]


#: each tile's limits, by the identity of its ``triton.Config`` (kept alive here with it): beside
#: the config, not on it, as triton's Config has no field for them
_LIMITS: dict[int, tuple[triton.Config, TileLimits]] = {}


def limits_of(config: triton.Config) -> TileLimits:
    """The :class:`TileLimits` :func:`_configs` gave ``config`` (none: no limit)."""
    entry = _LIMITS.get(id(config))
    return entry[1] if entry is not None and entry[0] is config else TileLimits()


def smem_bytes(kernel: str, config: triton.Config, block_d: int, elem_bytes: int) -> int:
    """Upper estimate of a configuration's shared memory: the tiles kept for the whole program
    plus ``num_stages`` buffers (at least two: one-stage builds still double-buffer) of each tile
    the pipelined loop streams; dK/dV adds its cross-warp reduction over the key block. Compiled
    sm_90 and sm_80 kernels use at most this (``scripts/compile_kernels.py`` checks it)."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    stages = max(config.num_stages, 2)
    if kernel == "fwd":  # q resident; k, v streamed
        return (bm + 2 * bn * stages) * block_d * elem_bytes
    if kernel == "dkdv":  # k, v resident; q, dO and float32 lse2, δ streamed
        return (2 * bn + 2 * bm * stages) * block_d * elem_bytes + 8 * bm * stages + 4 * bn
    return (2 * bm + 2 * bn * stages) * block_d * elem_bytes  # dq: q, dO resident; k, v streamed


def _smem_limit(x) -> int | None:
    """Opt-in shared memory per block of the tensor's GPU (None off CUDA): a launch that needs
    more fails with OutOfResources, which autotuning survives but a lone configuration does not."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda):
        return None
    index = x.device.index
    return _device_smem(torch.cuda.current_device() if index is None else index)


@functools.cache
def _device_smem(index: int) -> int:
    """The device's opt-in shared memory per block, read at its first launch (never at import)
    and kept for the process."""
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(index)["max_shared_mem"]


def _capability_major(x) -> int | None:
    """The compute capability's major version of the tensor's GPU (None off CUDA)."""
    if not (isinstance(x, torch.Tensor) and x.is_cuda):
        return None
    return torch.cuda.get_device_capability(x.device)[0]


def prune(configs, named_args, kernel=None, smem_limit=None, capability=None, **kwargs):
    """Drop tiles that cannot fit (large head dims, tiles that spill registers at this head dim or
    on this GPU generation, or, for ``kernel``, the GPU's shared memory at the operands' element
    size) or exceed a short sequence, and tiles kept for other lengths (``TileLimits.lengths``);
    sequences of at most 128 get one mid-sized tile without benchmarking (tuning would cost more
    than it wins, and every new shape would pay it).
    ``kernel`` ("fwd", "dkdv", "dq") is bound per autotuned kernel; ``smem_limit`` and
    ``capability`` (the compute capability's major version) default to the device's."""
    block_d = kwargs["BLOCK_D"]
    n_q, n_k = named_args["N_Q_BUCKET"], named_args["N_K_BUCKET"]
    budget = 128 * 128 if block_d <= 64 else 128 * 64 if block_d <= 128 else 64 * 64
    q = named_args.get("Q")
    elem_bytes = q.element_size() if isinstance(q, torch.Tensor) else 2
    if smem_limit is None:
        smem_limit = _smem_limit(q)
    if capability is None:
        capability = _capability_major(q)

    def spills(c):
        limits = limits_of(c)
        return block_d > limits.max_block_d or (capability == 8 and block_d in limits.sm80_spills)

    def area(c):
        return c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"]

    def fits_smem(c):
        return (
            kernel is None
            or smem_limit is None
            or (smem_bytes(kernel, c, block_d, elem_bytes) <= smem_limit)
        )

    kept = [
        c
        for c in configs
        if area(c) <= budget
        and limits_of(c).offered_at(max(n_q, n_k))
        and not spills(c)
        and max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) * block_d <= 128 * 128
        and c.kwargs["BLOCK_M"] <= max(n_q, 16)
        and c.kwargs["BLOCK_N"] <= max(n_k, 16)
        and fits_smem(c)
    ]
    if not kept:
        return [_TINY_CONFIG]
    if max(n_q, n_k) <= 128:
        return [min(kept, key=lambda c: abs(area(c) - 64 * 32))]
    return kept


_TINY_CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)
_KEY = ["N_Q_BUCKET", "N_K_BUCKET", "HEAD_DIM", "CAUSAL", "GROUPS"]
# (BLOCK_M, BLOCK_N, warps, stages, max_block_d, head dims that spill on sm_8x). With BLOCK_D = 128
# a thread of a 4-warp tile holds too much of the float32 accumulators (and, backward, of p and
# dp) once the tile reaches 64×64, and ptxas spills on sm_90; 8 warps halve each thread's share.
# On sm_80 more tiles spill (some only in one variant, over every variant at D = 64 and 128):
# they are pruned there.
FWD_EVERY_LENGTH_CONFIGS = _configs(
    [
        (128, 64, 8, 3, 128, (128,)),
        (128, 128, 8, 3, 64, (64,)),
        (128, 32, 8, 3, 128, (64,)),
        (64, 64, 8, 3, 128, ()),
        (128, 32, 4, 4, 64, (64,)),
        (64, 64, 4, 3, 64, (64,)),
        (64, 32, 4, 4, 128, (64, 128)),
        (32, 32, 4, 2, 128, ()),
    ]
)
#: Sequences of 256 to 2048 (length buckets; the lengths most fine-tuning uses): a key loop of a
#: few blocks, where a deep pipeline's prologue is a large part of a program and smaller query
#: blocks put more programs in flight. Two stages, and query blocks of 32 and 64 beside 128.
#: Offered there in addition to the tiles above, so that autotuning compares them on the GPU; the
#: longer sequences keep their own set unchanged. Limits from scripts/compile_kernels.py's builds
#: (bfloat16, causal+pad+stats+sink, d = 64 and 128): 64×128 with 4 warps spills on sm_90 at
#: d = 64 and was left out, as was 128×64 with 4 warps.
SHORT_LENGTHS = (256, 2048)
SHORT_FWD_CONFIGS = _configs(
    [
        (128, 128, 8, 2, 64, (64,)),
        (128, 64, 8, 2, 128, (128,)),
        (64, 64, 4, 2, 64, (64,)),
        (64, 32, 4, 2, 128, (64,)),
        (32, 64, 4, 2, 128, ()),
    ],
    lengths=SHORT_LENGTHS,
)
FWD_CONFIGS = FWD_EVERY_LENGTH_CONFIGS + SHORT_FWD_CONFIGS
DKDV_CONFIGS = _configs(  # BLOCK_N keys per program, BLOCK_M queries per inner step
    [
        (64, 128, 8, 3, 64, (64,)),
        (32, 128, 8, 3, 128, (128,)),
        (32, 64, 8, 3, 128, ()),
        (64, 64, 4, 3, 64, (64,)),
        (32, 64, 4, 3, 64, (64,)),
        (16, 64, 4, 2, 128, (64,)),
    ]
)
DQ_CONFIGS = _configs(
    [
        (128, 64, 8, 3, 128, (128,)),
        (128, 32, 8, 3, 128, ()),
        (64, 64, 8, 3, 128, ()),
        (128, 32, 4, 3, 64, (64,)),
        (64, 64, 4, 3, 64, (64,)),
        (64, 32, 4, 3, 128, ()),
        (32, 32, 4, 2, 128, ()),
    ]
)


def _tuned(kernel, configs, name, extra_key=()):
    if INTERPRETED:
        return kernel
    # triton 3.9 calls early_config_prune(configs, named_args, **kernel_kwargs), where
    # named_args holds the positional arguments (Q, N_Q_BUCKET, ...) and BLOCK_D is a kwarg.
    early_prune = functools.partial(prune, kernel=name)
    return triton.autotune(
        configs=configs,
        key=_KEY + list(extra_key),
        prune_configs_by={"early_config_prune": early_prune},
    )(kernel)


fwd_kernel = _tuned(attn_fwd, FWD_CONFIGS, "fwd", extra_key=["STATS", "SINK", "HAS_PAD"])
dkdv_kernel = _tuned(attn_bwd_dkdv, DKDV_CONFIGS, "dkdv", extra_key=["HAS_PAD"])
dq_kernel = _tuned(attn_bwd_dq, DQ_CONFIGS, "dq", extra_key=["HAS_PAD"])


def launch(kernel, grid, *args, **meta) -> None:
    """Launch an autotuned kernel; under the interpreter with the one small tile."""
    if INTERPRETED:
        meta = {**meta, **INTERPRETER_BLOCKS}
        kernel[grid(meta)](*args, **meta, num_warps=4)
    else:
        kernel[grid](*args, **meta)


def bucket(n: int) -> int:
    """A sequence length's autotune key: the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(n))
