"""Benchmark ``qkmonitor.kernels.attention`` against PyTorch's attention, side by side.

CPU (``--device cpu``, the default without a GPU): the torch backend *with* statistics against
``F.scaled_dot_product_attention`` (which computes none), forward and forward+backward time, and
the peak memory of the torch backend against explicit attention that forms P = softmax(s·qkᵀ)
and takes the same statistics from it.

GPU (``--device cuda``): TFLOP/s of the Triton kernels, forward and forward+backward, without and
with statistics, against ``F.scaled_dot_product_attention`` restricted to the flash backend, in
bfloat16, for N ∈ {1k, 2k, 4k, 8k, 16k}, D ∈ {64, 128}, causal and not; plus peak memory and the
forward tile autotuning picked (without and with statistics: N ≤ 2048 choose among more tiles).

How memory is measured (CPU): the peak resident set size of this process over the call, read from
``VmHWM`` in ``/proc/self/status`` after resetting it (``echo 5 > /proc/self/clear_refs``), minus
the resident size just before the call. PyTorch's CPU allocator does not cache, and the benchmark
sets glibc's mmap threshold to 64 KiB (``mallopt``) and trims the heap (``malloc_trim``) before
each measured call, so every tensor of 64 KiB or more is mapped on allocation and unmapped on
free: the high-water mark is the memory the call really touched (inputs excluded; its output and
every temporary included), to a page, not an allocator's reserve. Timed runs use a large
threshold instead, so that they pay no page faults. (torch.profiler's CPU memory events were tried
and found incomplete here.) It needs Linux and glibc; elsewhere the column reads "n/a". On CUDA:
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated
before the call.

FLOPs (GPU) follow the FlashAttention papers: forward ``4·B·H·N·M·D`` (halved when causal),
forward+backward 3.5× that (the backward recomputes QKᵀ: 2.5× the forward).

Usage::

    python benchmarks/attention.py --quick            # small N, a few seconds on CPU
    python benchmarks/attention.py --device cpu       # N up to 16k on CPU
    python benchmarks/attention.py --device cuda      # the Triton table on a GPU
    python benchmarks/attention.py --device cuda --causal true --repeats 5 --json out.json
    python benchmarks/attention.py --device cuda --dry-run   # the GPU table's layout, no GPU
    python benchmarks/attention.py --max-logits --quick   # QK-Clip's input alone, see below

``--max-logits`` times what a QK-Clip probe pays per observed call: each head's largest logit
alone (``attention_max_logits``: blocks of QKᵀ and a max, no softmax) against the full statistics
without an output (``attention_stats``, what a probe of the entropy monitor pays) and against the
model's own SDPA forward, with the max-only path's peak extra memory (CPU: as above) against the
N x N scores it never forms.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from qkmonitor.kernels import (
    attention,
    attention_max_logits,
    attention_stats,
)  # after the path insert

GIB = 2**30


# ------------------------------------------------------------------------------------------------
# measurement


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _malloc_mode(precise: bool) -> bool:
    """glibc tuning: ``precise`` maps every block ≥ 64 KiB and returns freed memory at once (for
    measuring); otherwise blocks below 32 MiB come from a heap that is kept (for timing, without
    page-fault costs). Returns False where glibc is not available."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        mmap_threshold, trim_threshold = (
            (64 * 1024, 128 * 1024) if precise else (32 * 2**20, 64 * 2**20)
        )
        ok = libc.mallopt(-3, mmap_threshold) and libc.mallopt(-1, trim_threshold)
        if precise:
            libc.malloc_trim(0)  # hand freed heap pages back so their reuse counts again
        return bool(ok)
    except (OSError, AttributeError):
        return False


def cpu_peak_bytes(fn: Callable[[], object]) -> int | None:
    """Extra resident memory at the peak of ``fn()`` (see the module docstring), or None."""
    if not _malloc_mode(precise=True):
        return None
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        before = _status_bytes("VmRSS")
        result = fn()
        peak = _status_bytes("VmHWM")
        del result
    except OSError:
        return None
    finally:
        _malloc_mode(precise=False)
    if before is None or peak is None:
        return None
    return max(0, peak - before)


def cuda_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak CUDA memory allocated during ``fn()`` beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak


def cpu_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` in seconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cuda_time(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median time of ``fn()`` in seconds from CUDA events, after warm-up (autotuning included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------
# the contenders


def explicit_attention_with_stats(q, k, v, causal):
    """Forms the (B, H, N, M) matrix and takes the statistics from it, as a naive monitor would."""
    n, m = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = p @ v
    entropy = -torch.special.xlogy(p, p).sum(-1)
    return out, entropy, p.amax(-1), s.amax(-1), torch.logsumexp(s, -1)


def sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def ours(backend, stats):
    def run(q, k, v, causal):
        return attention(q, k, v, causal=causal, return_stats=stats, backend=backend)

    return run


def forward_backward(fn, q, k, v, causal, dout):
    def run():
        result = fn(q, k, v, causal)
        out = result[0] if isinstance(result, tuple) else result
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    return run


def make_inputs(batch, heads, n, d, dtype, device, grad):
    gen = torch.Generator(device="cpu").manual_seed(0)
    return [
        torch.randn(batch, heads, n, d, generator=gen)
        .to(device=device, dtype=dtype)
        .requires_grad_(grad)
        for _ in range(3)
    ]


# ------------------------------------------------------------------------------------------------
# tables


def fmt_bytes(x: int | None) -> str:
    if x is None:
        return "n/a"
    return f"{x / 2**20:,.0f} MiB" if x < GIB else f"{x / GIB:,.2f} GiB"


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    sys.stdout.flush()


def run_cpu(args) -> None:
    lengths = args.lengths or ([256, 512, 1024] if args.quick else [1024, 2048, 4096, 8192, 16384])
    d, heads, batch = (args.head_dim or [64])[0], args.heads or 2, args.batch or 1
    repeats = args.repeats or 3
    _malloc_mode(precise=False)
    warm = make_inputs(batch, heads, 128, d, torch.float32, "cpu", grad=False)
    for _ in range(3):  # first-call costs (thread pool, one-time setup) out of the table
        ours("torch", True)(*warm, True)
        sdpa(*warm, True)
    print(
        f"CPU, {torch.get_num_threads()} threads, float32, B={batch} H={heads} D={d}: the torch "
        "backend WITH statistics vs SDPA (no statistics), median times and their ratio (ours / "
        "sdpa, lower is better); peak extra memory vs explicit attention (P formed, the same "
        "statistics taken from P)."
    )
    header = ["N", "causal", "ours fwd", "sdpa fwd", "time ratio", "ours f+b", "sdpa f+b",
              "time ratio", "ours mem", "explicit mem", "mem ratio"]  # fmt: skip
    rows = []
    for n in lengths:
        for causal in (False, True):
            rows.append(_cpu_row(args, batch, heads, n, d, causal, repeats))
            print(f"  done N={n} causal={causal}", file=sys.stderr, flush=True)
    print_table(header, rows)


def _cpu_row(args, batch, heads, n, d, causal, repeats) -> list[str]:
    q, k, v = make_inputs(batch, heads, n, d, torch.float32, "cpu", grad=False)
    with_stats = ours("torch", True)
    with torch.no_grad():
        t_ours = cpu_time(lambda: with_stats(q, k, v, causal), repeats)
        t_sdpa = cpu_time(lambda: sdpa(q, k, v, causal), repeats)
        m_ours = cpu_peak_bytes(lambda: with_stats(q, k, v, causal))
        explicit_bytes = 3 * batch * heads * n * n * 4  # s, p, and one temporary
        m_explicit = None
        if explicit_bytes <= args.max_explicit_gib * GIB:
            m_explicit = cpu_peak_bytes(lambda: explicit_attention_with_stats(q, k, v, causal))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    bwd_repeats = max(1, repeats - 1)
    tb_ours = cpu_time(forward_backward(with_stats, qg, kg, vg, causal, dout), bwd_repeats)
    tb_sdpa = cpu_time(forward_backward(sdpa, qg, kg, vg, causal, dout), bwd_repeats)
    mem_ratio = "n/a" if m_ours is None or not m_explicit else f"{m_ours / m_explicit:.3f}"
    explicit = "skipped (--max-explicit-gib)" if m_explicit is None else fmt_bytes(m_explicit)
    return [
        str(n), str(causal), f"{t_ours * 1e3:,.1f} ms", f"{t_sdpa * 1e3:,.1f} ms",
        f"{t_ours / t_sdpa:.2f}", f"{tb_ours * 1e3:,.1f} ms", f"{tb_sdpa * 1e3:,.1f} ms",
        f"{tb_ours / tb_sdpa:.2f}", fmt_bytes(m_ours), explicit, mem_ratio,
    ]  # fmt: skip


def flash_sdpa(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return sdpa(q, k, v, causal)


def run_cuda(args) -> list[dict]:
    """The GPU table; returns its rows as dicts (``--json``). With ``--dry-run`` nothing touches
    CUDA: every time is NaN, so that argument handling and the tables can be checked anywhere."""
    lengths = args.lengths or ([1024, 2048] if args.quick else [1024, 2048, 4096, 8192, 16384])
    head_dims = args.head_dim or ([64] if args.quick else [64, 128])
    causal_values = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    repeats = args.repeats or (10 if args.quick else 30)
    device_name = "dry run" if args.dry_run else torch.cuda.get_device_name()
    print(
        f"{device_name}, bfloat16, B·N = {args.tokens} tokens, H·D = 2048. "
        "TFLOP/s (higher is better); ratios are ours / SDPA-flash throughput (≥ 1: ours faster); "
        "stats cost = extra time of the statistics over the same Triton kernel without them."
    )
    header = ["N", "D", "causal", "pass", "sdpa-flash", "triton", "triton+stats", "ratio",
              "ratio+stats", "stats cost", "mem flash", "mem triton+stats", "fwd tile",
              "fwd tile+stats"]  # fmt: skip
    rows, results = [], []
    start = time.perf_counter()
    for d in head_dims:
        for n in lengths:
            for causal in causal_values:
                if args.budget_s and time.perf_counter() - start > args.budget_s:
                    print(
                        f"  skipped N={n} D={d} causal={causal}: over --budget-s", file=sys.stderr
                    )
                    continue
                for result in _cuda_results(args, n, d, causal, repeats):
                    results.append(result)
                    rows.append(_cuda_row(result))
                if not args.dry_run:
                    torch.cuda.empty_cache()
    print_table(header, rows)
    return results


def _cuda_results(args, n, d, causal, repeats) -> list[dict]:
    """Times (seconds) and peak memory of SDPA-flash, Triton and Triton with statistics, forward
    and forward+backward, at one (N, D, causal)."""
    batch, heads = max(1, args.tokens // n), 2048 // d
    flops_fwd = 4 * batch * heads * n * n * d * (0.5 if causal else 1.0)
    shape = {"n": n, "d": d, "causal": causal, "batch": batch, "heads": heads}
    if args.dry_run:
        nan = math.nan
        return [{**shape, "pass": name, "flops": flops_fwd * factor, "t_flash": nan,
                 "t_triton": nan, "t_stats": nan, "mem_flash": None, "mem_stats": None,
                 "tile": "n/a", "tile_stats": "n/a"}
                for name, factor in (("fwd", 1.0), ("fwd+bwd", 3.5))]  # fmt: skip
    q, k, v = make_inputs(batch, heads, n, d, torch.bfloat16, "cuda", grad=True)
    dout = torch.randn_like(q)
    contenders = (flash_sdpa, ours("triton", False), ours("triton", True))
    results = []
    for name in ("fwd", "fwd+bwd"):
        if name == "fwd":
            calls = [_no_grad_call(fn, q, k, v, causal) for fn in contenders]
            flops = flops_fwd
        else:
            calls = [forward_backward(fn, q, k, v, causal, dout) for fn in contenders]
            flops = 3.5 * flops_fwd
        t_flash, t_ours = cuda_time(calls[0], repeats), cuda_time(calls[1], repeats)
        tile = forward_tile()
        t_stats = cuda_time(calls[2], repeats)
        tile_stats = forward_tile()
        m_flash, m_stats = cuda_peak_bytes(calls[0]), cuda_peak_bytes(calls[2])
        print(f"  done N={n} D={d} causal={causal} {name}", file=sys.stderr, flush=True)
        results.append({**shape, "pass": name, "flops": flops, "t_flash": t_flash,
                        "t_triton": t_ours, "t_stats": t_stats, "mem_flash": m_flash,
                        "mem_stats": m_stats, "tile": tile,
                        "tile_stats": tile_stats})  # fmt: skip
    return results


def forward_tile() -> str:
    """The tile autotuning gave the Triton forward's last launch: ``BLOCK_MxBLOCK_N wW sS``."""
    from qkmonitor.kernels._triton import tuning

    config = getattr(tuning.fwd_kernel, "best_config", None)
    if config is None:
        return "n/a"
    kwargs = config.kwargs
    return f"{kwargs['BLOCK_M']}x{kwargs['BLOCK_N']} w{config.num_warps} s{config.num_stages}"


def _cuda_row(r: dict) -> list[str]:
    def tflops(t):
        return f"{r['flops'] / t / 1e12:.1f}"

    return [
        str(r["n"]), str(r["d"]), str(r["causal"]), r["pass"], tflops(r["t_flash"]),
        tflops(r["t_triton"]), tflops(r["t_stats"]), f"{r['t_flash'] / r['t_triton']:.2f}",
        f"{r['t_flash'] / r['t_stats']:.2f}", f"{(r['t_stats'] / r['t_triton'] - 1) * 100:+.1f}%",
        fmt_bytes(r["mem_flash"]), fmt_bytes(r["mem_stats"]), r["tile"], r["tile_stats"],
    ]  # fmt: skip


def _no_grad_call(fn, q, k, v, causal):
    def run():
        with torch.no_grad():
            return fn(q, k, v, causal)

    return run


def run_max_logits(args, device: str) -> None:
    """The ``--max-logits`` table: per call, the max-only path against the statistics and SDPA."""
    lengths = args.lengths or ([256, 512, 1024] if args.quick else [1024, 2048, 4096, 8192])
    d, heads, batch = (args.head_dim or [64])[0], args.heads or 2, args.batch or 1
    repeats = args.repeats or 3
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if device == "cpu":
        _malloc_mode(precise=False)
    print(
        f"{device.upper()}, {dtype}, B={batch} H={heads} D={d}: per call, the largest logits alone "
        "(max only) vs the statistics without output (stats) vs the SDPA forward; median times; "
        "peak extra memory of the max-only path vs the N x N float32 scores."
    )
    header = ["N", "causal", "max only", "stats", "max / stats", "sdpa fwd", "max / sdpa",
              "max-only mem", "N x N scores"]  # fmt: skip
    rows = []
    for n in lengths:
        for causal in (False, True):
            rows.append(_max_logits_row(batch, heads, n, d, dtype, device, causal, repeats))
            print(f"  done N={n} causal={causal}", file=sys.stderr, flush=True)
    print_table(header, rows)


def _max_logits_row(batch, heads, n, d, dtype, device, causal, repeats) -> list[str]:
    q, k, v = make_inputs(batch, heads, n, d, dtype, device, grad=False)
    timer = cpu_time if device == "cpu" else cuda_time
    peak_bytes = cpu_peak_bytes if device == "cpu" else cuda_peak_bytes

    def max_only():
        return attention_max_logits(q, k, causal=causal)

    t_max = timer(max_only, repeats)
    t_stats = timer(lambda: attention_stats(q, k, causal=causal), repeats)
    t_sdpa = timer(lambda: sdpa(q, k, v, causal), repeats)
    return [
        str(n), str(causal), f"{t_max * 1e3:,.2f} ms", f"{t_stats * 1e3:,.2f} ms",
        f"{t_max / t_stats:.2f}", f"{t_sdpa * 1e3:,.2f} ms", f"{t_max / t_sdpa:.2f}",
        fmt_bytes(peak_bytes(max_only)), fmt_bytes(batch * heads * n * n * 4),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--quick", action="store_true", help="small N, few repeats")
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths N (= M)")
    parser.add_argument(
        "--head-dim", type=int, nargs="+", help="D, one or more (GPU default: 64 128; CPU: 64)"
    )
    parser.add_argument(
        "--causal", choices=["both", "true", "false"], default="both", help="GPU: which masks"
    )
    parser.add_argument("--heads", type=int, help="H on CPU (default 2)")
    parser.add_argument("--batch", type=int, help="B on CPU (default 1)")
    parser.add_argument("--tokens", type=int, default=16384, help="B·N on GPU (default 16384)")
    parser.add_argument("--repeats", type=int, help="timed repetitions (median reported)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own)")
    parser.add_argument(
        "--max-explicit-gib", type=float, default=8.0,
        help="skip explicit attention on CPU when its matrices would exceed this (default 8)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="GPU: also write the rows to this file")
    parser.add_argument(
        "--max-logits", action="store_true", help="QK-Clip's input alone (see the docstring)"
    )
    parser.add_argument(
        "--budget-s", type=float, help="GPU: measure no new shape after this many seconds"
    )
    parser.add_argument(
        "--dry-run", action="store_true",
        help="GPU table without a GPU: parse, lay out, print NaN times (checks the script)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        parser.error("--device cuda: no CUDA device")
    if args.dry_run and device != "cuda":
        parser.error("--dry-run lays out the GPU table: use it with --device cuda")
    if args.max_logits:
        run_max_logits(args, device)
    elif device == "cuda":
        results = run_cuda(args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    else:
        if len(args.head_dim or []) > 1:
            parser.error("--head-dim: the CPU table takes one head dim")
        run_cpu(args)


if __name__ == "__main__":
    main()
