"""What the unbiased rounding of the softmax weights costs: ``pv_rounding="unbiased"`` against
``"kernel"`` (docs/kernel.md, "Rounding of the softmax weights"), side by side in one run.

CPU (``--device cpu``): the torch backend's blockwise kernel on bfloat16 inputs, forward and
forward+backward, in the modes "kernel" (the weights rounded for ``P·V`` alone), "unbiased" (the
rounded weights for the sums too) and "float32" (not rounded), and, for scale,
``F.scaled_dot_product_attention`` (what ``pv_rounding="auto"`` runs where it is exact). The
modes' calls are interleaved, one of each per round, so that a drift of the machine's speed falls
on all of them alike; each time is the median over rounds. The line to read is the ratio
unbiased / kernel.

GPU (``--device cuda``): the same ratio for the Triton kernels (forward, and forward+backward),
which differ by one conversion per score in the forward.

Usage::

    python benchmarks/rounding.py --device cpu            # B=4, H=8, D=64, N = 256 and 1024
    python benchmarks/rounding.py --device cuda --lengths 1024 4096 --causal
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from qkmonitor.kernels import attention

MODES = ("kernel", "unbiased", "float32")


def contenders(backend: str, causal: bool) -> dict:
    runs = {
        mode: (lambda q, k, v, mode=mode: attention(
            q, k, v, causal=causal, backend=backend, pv_rounding=mode))
        for mode in MODES
    }  # fmt: skip
    if backend == "torch":
        runs["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return runs


def timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def side_by_side(runs: dict, q, k, v, rounds: int, backward: bool, sync) -> dict:
    """Median seconds of each contender over ``rounds`` interleaved rounds (after a warm-up)."""
    dout = torch.randn_like(q)

    def call(fn):
        if not backward:
            with torch.no_grad():
                return lambda: fn(q, k, v)
        return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    calls = {name: call(fn) for name, fn in runs.items()}
    for fn in calls.values():
        fn()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(timed(fn, sync))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="the header alone, no timing")
    args = parser.parse_args(argv)
    backend = "torch" if args.device == "cpu" else "triton"
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"pv_rounding on backend={backend}, bfloat16, B={args.batch} H={args.heads} "
          f"D={args.head_dim} causal={args.causal}, torch threads {torch.get_num_threads()}, "
          f"median of {args.rounds} interleaved rounds (ms)")  # fmt: skip
    if args.dry_run:
        return
    for n in args.lengths:
        shape = (args.batch, args.heads, n, args.head_dim)
        q, k, v = (torch.randn(shape, device=args.device, dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))  # fmt: skip
        for backward in (False, True):
            t = side_by_side(contenders(backend, args.causal), q, k, v, args.rounds, backward, sync)
            cells = "  ".join(f"{name} {1e3 * s:8.2f}" for name, s in t.items())
            label = "fwd+bwd" if backward else "fwd    "
            ratio = t["unbiased"] / t["kernel"]
            print(f"N={n:5d} {label}  {cells}  unbiased/kernel {ratio:.3f}")


if __name__ == "__main__":
    main()
