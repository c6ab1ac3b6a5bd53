"""Compile the Triton attention kernels for a GPU that is not here, through the real compiler.

Every configuration that autotuning may pick is built to a cubin with ``triton.compile`` for a
``GPUTarget`` (sm_90 = H100/H200, sm_80 = A100): Triton's front end, its GPU passes, LLVM, and the
``ptxas`` that the ``triton`` wheel ships. No GPU and no CUDA driver are needed. Each build is
checked for

- compile errors (any stage);
- shared memory (``metadata.shared``) above the target's opt-in limit per block (sm_90:
  227 KiB, sm_80: 163 KiB): such a launch fails with OutOfResources on the GPU;
- register spills above ``--max-spill-bytes`` (default 0): ``n_regs``/``n_spills`` of a
  ``CompiledKernel`` are filled in only when a CUDA driver loads the cubin, so they are read from
  the same build's ``ptxas -v`` report instead (``Used R registers``, ``S bytes spill stores``).

What is compiled is what a launch would compile: the kernels' arguments are recorded from the real
forward and backward of ``TritonAttention`` (CPU tensors, the launcher replaced by a recorder),
so pointer alignment, stride specialization (unit strides become constants) and constexprs are
those of a contiguous (B, H, N, D) input; the candidate tiles are the autotuner's own
configurations after its own ``early_config_prune`` (``_triton.tuning.prune``) with the target's
shared memory limit and compute capability, over every pair of sequence-length buckets from 16 to
16384. Variants (the constexpr specializations):

- ``--set ci`` (default): every candidate tile of every kernel, d = 64 and 128, in the heaviest
  variant (causal, key padding, statistics, sink tokens, grouped-query heads), which carries a
  superset of every other variant's code (each flag only adds code), in bfloat16; plus, on the
  first ``--arch`` only, every other variant in float16 with the one tile that sequences of at
  most 128 get without benchmarking (the constexpr branches are target-independent front-end
  code; the two 2-byte dtypes give the same tiles, shared memory and MMA shapes). About 100
  builds for sm_90 and sm_80, 2-4 minutes on 2 cores.
- ``--set full``: the whole cross product (both dtypes × every variant × every tile).
- ``--set gpu-check``: every tile of the variants that ``scripts/gpu_check.sh`` launches; on the
  GPU machine this warms Triton's cache (the builds have a launch's cache key) on every core.

Usage::

    python scripts/compile_kernels.py --arch 90 80 --jobs 2
    python scripts/compile_kernels.py --arch 90 --set full --json results.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import os
import re
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# The kernels must be built as GPU kernels: the interpreter flag is read when triton is imported.
os.environ.pop("TRITON_INTERPRET", None)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import torch  # after the environment is set

# triton 3.9 warns once that its FP-fusion default will change; setting TRITON_DEFAULT_FP_FUSION
# to silence it would enter the cache key and part these builds from a launch's.
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

# Opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin). The target's third
# field is the warp size, 32 on every NVIDIA GPU: it is what Triton's CUDA driver reports, and a
# build for another width would lay tensors out for warps that do not exist.
TARGETS = {
    90: {"name": "sm_90 (H100/H200)", "warp_size": 32, "smem": 227 * 1024},
    80: {"name": "sm_80 (A100)", "warp_size": 32, "smem": 163 * 1024},
}
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
BUCKETS = tuple(16 * 2**i for i in range(11))  # 16 … 16384, the autotune key's length buckets
GQA_GROUPS = 4


@dataclasses.dataclass(frozen=True)
class Variant:
    """One constexpr specialization of the kernels (the autograd function's options)."""

    dtype: str
    head_dim: int
    groups: int
    causal: bool
    pad: bool
    stats: bool
    sink: bool

    def label(self) -> str:
        flags = [f for f, on in (("causal", self.causal), ("pad", self.pad), ("stats", self.stats),
                                 ("sink", self.sink)) if on]  # fmt: skip
        flags.append(f"G={self.groups}")
        return f"{self.dtype} d={self.head_dim} " + "+".join(flags)


@dataclasses.dataclass
class Launch:
    """One recorded kernel launch: the kernel (an Autotuner or a JITFunction), its arguments."""

    name: str
    kernel: object
    args: tuple
    meta: dict


def record_launches(variant: Variant) -> list[Launch]:
    """The launches of one forward and backward of ``TritonAttention`` on small CPU tensors.

    Strides and alignment of a (1, H, 64, D) contiguous tensor specialize like those of any
    (B, H, N, D) contiguous input with D a multiple of 16 (every stride but the unit one is then a
    multiple of 16), so the compiled code is the code a real launch compiles.
    """
    from qkmonitor.kernels._triton import autograd, tuning

    launches: list[Launch] = []
    names = {id(tuning.fwd_kernel): "fwd", id(tuning.dkdv_kernel): "dkdv",
             id(tuning.dq_kernel): "dq"}  # fmt: skip

    def record(kernel, grid, *args, **meta):
        launches.append(Launch(names[id(kernel)], kernel, args, meta))

    delta_kernel = autograd.attn_bwd_delta

    class DeltaRecorder:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append(Launch("delta", delta_kernel, args, meta))

            return launch

    dtype = getattr(torch, variant.dtype)
    kv_heads, n = 2, 64
    heads = kv_heads * variant.groups
    q = torch.zeros(1, heads, n, variant.head_dim, dtype=dtype, requires_grad=True)
    k, v = (torch.zeros(1, kv_heads, n, variant.head_dim, dtype=dtype, requires_grad=True)
            for _ in range(2))  # fmt: skip
    pad = torch.ones(1, n, dtype=torch.int8) if variant.pad else None
    saved = autograd.launch, autograd.attn_bwd_delta
    autograd.launch, autograd.attn_bwd_delta = record, DeltaRecorder()
    try:
        out, *_ = autograd.TritonAttention.apply(
            q, k, v, pad, variant.causal, variant.head_dim**-0.5, 4 if variant.sink else 0,
            variant.stats,
        )  # fmt: skip
        out.backward(torch.zeros_like(out))
    finally:
        autograd.launch, autograd.attn_bwd_delta = saved
    return launches


def candidate_configs(launch: Launch, arch: int) -> list:
    """The tiles autotuning may pick for this launch on an ``arch`` GPU: the union, over all
    (query, key) length buckets, of what the autotuner's own pruning keeps with that GPU's shared
    memory and compute capability."""
    smem_limit, capability = TARGETS[arch]["smem"], arch // 10
    tuner = launch.kernel
    if not hasattr(tuner, "configs"):  # not autotuned (the δ kernel): its one launch
        return [None]
    arg_names = tuner.fn.arg_names
    named = dict(zip(arg_names, launch.args))
    seen, kept = set(), []
    for n_q, n_k in itertools.product(BUCKETS, BUCKETS):
        named.update(N_Q_BUCKET=n_q, N_K_BUCKET=n_k)
        for config in tuner.early_config_prune(
            tuner.configs, named, smem_limit=smem_limit, capability=capability, **launch.meta
        ):
            key = config_key(config)
            if key not in seen:
                seen.add(key)
                kept.append(config)
    return kept


def config_key(config) -> tuple:
    if config is None:
        return ()
    return (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps,
            config.num_stages)  # fmt: skip


def config_label(config) -> str:
    if config is None:
        return "fixed"
    bm, bn, warps, stages = config_key(config)
    return f"{bm}x{bn} w{warps} s{stages}"


# --------------------------------------------------------------------------------------------------
# one compile


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_launch(arch: int, variant: Variant, kernel_name: str, config_index: int) -> dict:
    """Compile one (kernel, variant, tile) for ``arch``; returns the measurements or the error.

    Runs in a worker process: the launch is recorded again there (launch records hold tensors and
    kernel objects, which are not worth pickling).
    """
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    info = TARGETS[arch]
    launch = next(x for x in record_launches(variant) if x.name == kernel_name)
    config = candidate_configs(launch, arch)[config_index]
    fn = launch.kernel.fn if hasattr(launch.kernel, "configs") else launch.kernel
    meta = dict(launch.meta)
    if config is not None:
        meta.update(config.all_kwargs())
    # The options JITFunction.run adds at a launch: the same options give the same cache key, so
    # that a build here also warms the cache of a GPU run (scripts/gpu_check.sh).
    meta["debug"] = bool(knobs.runtime.debug)
    for option in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # what this triton has
        if hasattr(knobs.compilation, option):
            meta[option] = getattr(knobs.compilation, option)
    target = GPUTarget("cuda", arch, info["warp_size"])
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **meta)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, meta, bound, specialization, options
    )
    result = {
        "arch": arch, "kernel": kernel_name, "variant": variant.label(),
        "config": config_label(config), "smem_limit": info["smem"],
    }  # fmt: skip
    log = io.StringIO()
    start = time.perf_counter()
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report goes to stdout
    knobs.compilation.always_compile = True  # a cached kernel would bring no ptxas report
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
            )
    except Exception as error:  # noqa: BLE001 (every compile failure is a finding to report)
        result["error"] = f"{type(error).__name__}: {str(error)[:2000]}"
        return result
    finally:
        result["seconds"] = round(time.perf_counter() - start, 2)
    report = log.getvalue()
    regs, spills = _PTXAS_REGS.findall(report), _PTXAS_SPILLS.findall(report)
    if not regs or not spills:
        result["error"] = "no ptxas -v report in the build log: " + report[-500:]
        return result
    result["regs"] = int(regs[-1])
    result["spill_stores"], result["spill_loads"] = (int(x) for x in spills[-1])
    result["smem"] = int(compiled.metadata.shared)
    if config is not None:
        from qkmonitor.kernels._triton.tuning import smem_bytes

        result["smem_estimate"] = smem_bytes(
            kernel_name,
            config,
            meta["BLOCK_D"],
            torch.empty(0, dtype=getattr(torch, variant.dtype)).element_size(),
        )
    return result


# --------------------------------------------------------------------------------------------------
# what to compile


def all_variants(dtypes=DTYPES, head_dims=HEAD_DIMS) -> list[Variant]:
    variants = []
    for dtype, d, groups, causal, pad in itertools.product(
        dtypes, head_dims, (1, GQA_GROUPS), (False, True), (False, True)
    ):
        for stats, sink in ((False, False), (True, False), (True, True)):
            variants.append(Variant(dtype, d, groups, causal, pad, stats, sink))
    return variants


def gpu_check_variants() -> list[Variant]:
    """What ``pytest -m gpu`` and the benchmarks of ``scripts/gpu_check.sh`` launch with tuned
    tiles: both 2-byte dtypes and head dims, causal or not, with or without statistics (no sink
    tokens, padding or grouped heads; their tests use sequences short enough for one tile)."""
    return [Variant(dtype, d, 1, causal, False, stats, False)
            for dtype, d, causal, stats in itertools.product(DTYPES, HEAD_DIMS, (False, True),
                                                              (False, True))]  # fmt: skip


def heaviest(dtype: str, head_dim: int) -> Variant:
    return Variant(dtype, head_dim, GQA_GROUPS, True, True, True, True)


def plan(arch: int, which: str, variant_sweep: bool = True) -> list[tuple[Variant, str, int]]:
    """(variant, kernel, tile index) jobs for ``arch``; ``which`` is "ci", "full" or "gpu-check"
    (every tile of ``gpu_check_variants``: run on a GPU machine, it fills Triton's cache in
    parallel before the tests and benchmarks would compile one tile at a time).

    "ci": every candidate tile in the heaviest variant (bfloat16, both head dims); and, when
    ``variant_sweep``, every variant (float16, d = 64) with the tile that sequences of at most 128
    get without benchmarking (``prune``'s single pick), so that each constexpr specialization and
    the other 2-byte dtype are built once (grouped-query heads only where they change the code).
    """
    jobs: list[tuple[Variant, str, int]] = []
    seen: set[tuple] = set()

    def add(variant: Variant, launch: Launch, index: int) -> None:
        # The backward kernels do not read the statistics flags, nor δ any flag: one build each.
        if launch.name == "delta":
            variant = dataclasses.replace(variant, groups=1, causal=False, pad=False)
        if launch.name != "fwd":
            variant = dataclasses.replace(variant, stats=False, sink=False)
        key = (variant, launch.name, index)
        if key not in seen:
            seen.add(key)
            jobs.append(key)

    if which in ("full", "gpu-check"):
        variants = all_variants() if which == "full" else gpu_check_variants()
        for variant in variants:
            for launch in record_launches(variant):
                for index in range(len(candidate_configs(launch, arch))):
                    add(variant, launch, index)
        return jobs
    for d in HEAD_DIMS:
        variant = heaviest("bfloat16", d)
        for launch in record_launches(variant):
            for index in range(len(candidate_configs(launch, arch))):
                add(variant, launch, index)
    if variant_sweep:
        for variant in all_variants(dtypes=("float16",), head_dims=(64,)):
            for launch in record_launches(variant):
                # GROUPS > 1 changes only an index division, except in dK/dV's flat loop; the
                # heaviest variant above builds it (GROUPS = 4) for every other kernel.
                if variant.groups == 1 or launch.name == "dkdv":
                    add(variant, launch, short_sequence_pick(launch, arch))
    return jobs


def short_sequence_pick(launch: Launch, arch: int) -> int:
    """Index, in ``candidate_configs``, of the one tile that N = M = 128 gets without tuning."""
    configs = candidate_configs(launch, arch)
    tuner = launch.kernel
    if not hasattr(tuner, "configs"):
        return 0
    named = dict(zip(tuner.fn.arg_names, launch.args), N_Q_BUCKET=128, N_K_BUCKET=128)
    (pick,) = tuner.early_config_prune(
        tuner.configs, named, smem_limit=TARGETS[arch]["smem"], capability=arch // 10,
        **launch.meta,
    )  # fmt: skip
    return [config_key(c) for c in configs].index(config_key(pick))


# --------------------------------------------------------------------------------------------------
# checks and report


def problems(result: dict, max_spill_bytes: int) -> list[str]:
    if "error" in result:
        return [result["error"].splitlines()[0] if result["error"] else "compile error"]
    found = []
    if result["smem"] > result["smem_limit"]:
        found.append(f"shared memory {result['smem']} B > {result['smem_limit']} B")
    spill = result["spill_stores"] + result["spill_loads"]
    if spill > max_spill_bytes:
        found.append(
            f"spills {result['spill_stores']} B stores + {result['spill_loads']} B loads "
            f"> {max_spill_bytes} B"
        )
    if "smem_estimate" in result and result["smem"] > result["smem_estimate"]:
        found.append(
            f"shared memory {result['smem']} B above smem_bytes' estimate "
            f"{result['smem_estimate']} B (pruning could keep a tile that does not fit)"
        )
    return found


def run(archs: list[int], which: str, jobs: int) -> list[dict]:
    """Compile the plan for every arch (the variant sweep on the first arch only: the constexpr
    branches are target-independent front-end code) in ``jobs`` worker processes."""
    work = [(arch, *job) for i, arch in enumerate(archs) for job in plan(arch, which, i == 0)]
    if jobs <= 1:
        return [compile_launch(*w) for w in work]
    import multiprocessing

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(compile_launch, *w) for w in work]
        return [f.result() for f in futures]


def print_table(results: list[dict]) -> None:
    header = ["arch", "kernel", "variant", "tile", "regs", "spill B", "smem KiB", "s", "status"]
    rows = []
    for r in results:
        found = r["problems"]
        rows.append([
            f"sm_{r['arch']}", r["kernel"], r["variant"], r["config"], str(r.get("regs", "")),
            str(r.get("spill_stores", 0) + r.get("spill_loads", 0)) if "regs" in r else "",
            f"{r['smem'] / 1024:.1f}" if "smem" in r else "", f"{r.get('seconds', 0):.1f}",
            "ok" if not found else "; ".join(found),
        ])  # fmt: skip
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", choices=sorted(TARGETS), default=[90, 80])
    parser.add_argument("--set", dest="which", choices=["ci", "full", "gpu-check"], default="ci")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-spill-bytes", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write every result to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = run(args.arch, args.which, args.jobs)
    for result in results:
        result["problems"] = problems(result, args.max_spill_bytes)
    print_table(results)
    failed = [r for r in results if r["problems"]]
    print(f"{len(results)} builds, {len(failed)} failing, {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
