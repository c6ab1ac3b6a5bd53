"""QR + d_k x d_k SVD against dense per-head d x d SVD, for the singular values of W_QK.

The fast path (:func:`qkmonitor.functional.qk_singular_values`) factors each head's
``W_Q^h = Q_1 R_1`` and ``W_K^g = Q_2 R_2`` and takes ``svdvals(R_1 R_2^T)``: O(H·d·d_k²). The
naive path forms ``W_QK^h = W_Q^h (W_K^g)^T`` (d x d) and takes its full SVD: O(H·d³).

Both run in the same process, one after the other, on the same random weights, and the script
prints the times, their ratio and the largest relative difference of the top d_k singular values.
A dense SVD of a 4096 x 4096 matrix takes tens of seconds on a laptop CPU, so ``--dense-heads``
times the dense path on that many heads and scales the time to all heads (the heads are
independent and equally sized, so the cost is linear in their number); the output says so.

Usage::

    python benchmarks/spectral.py            # both configurations of issue 2
    python benchmarks/spectral.py --quick    # smaller shapes, a few seconds
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from qkmonitor.functional import qk_singular_values


@dataclass
class Case:
    name: str
    layers: int
    d: int
    heads: int
    kv_heads: int
    d_k: int


CASES = [
    Case("(a) 12 layers, d=768, 12 heads", layers=12, d=768, heads=12, kv_heads=12, d_k=64),
    Case("(b) 1 layer, d=4096, 32 q / 8 kv heads, d_k=128", layers=1, d=4096, heads=32, kv_heads=8, d_k=128),
]
QUICK = [
    Case("(a-quick) 4 layers, d=256, 4 heads", layers=4, d=256, heads=4, kv_heads=4, d_k=64),
    Case("(b-quick) 1 layer, d=1024, 8 q / 2 kv heads", layers=1, d=1024, heads=8, kv_heads=2, d_k=128),
]


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def dense_singular_values(w_q: torch.Tensor, w_k: torch.Tensor, case: Case, layer: int, head: int) -> torch.Tensor:
    """Top d_k singular values of the explicitly formed d x d W_QK of one head."""
    g = head // (case.heads // case.kv_heads)
    wq_h = w_q[layer, head * case.d_k:(head + 1) * case.d_k].T  # (d, d_k)
    wk_g = w_k[layer, g * case.d_k:(g + 1) * case.d_k].T
    return torch.linalg.svdvals(wq_h @ wk_g.T)[: case.d_k]


def run(case: Case, dense_heads: int, repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w_q = torch.randn(case.layers, case.heads * case.d_k, case.d, generator=gen) / case.d**0.5
    w_k = torch.randn(case.layers, case.kv_heads * case.d_k, case.d, generator=gen) / case.d**0.5
    total_heads = case.layers * case.heads

    fast_out = qk_singular_values(w_q, w_k, case.heads, case.kv_heads)  # warm-up, and the result
    t_fast = best_of(lambda: qk_singular_values(w_q, w_k, case.heads, case.kv_heads), repeats)

    cells = [(layer, head) for layer in range(case.layers) for head in range(case.heads)]
    timed = cells if dense_heads <= 0 else cells[: min(dense_heads, total_heads)]
    worst_rel = 0.0
    start = time.perf_counter()
    for layer, head in timed:
        dense = dense_singular_values(w_q, w_k, case, layer, head)
        rel = ((dense - fast_out[layer, head]).abs().max() / dense[0]).item()
        worst_rel = max(worst_rel, rel)
    t_dense = (time.perf_counter() - start) * total_heads / len(timed)

    scaled = "" if len(timed) == total_heads else f" (timed on {len(timed)} of {total_heads} heads, scaled)"
    print(f"{case.name}")
    print(f"  fast  QR + {case.d_k}x{case.d_k} SVD, all {total_heads} heads in one call: {t_fast * 1e3:10.1f} ms")
    print(f"  dense {case.d}x{case.d} SVD per head{scaled}: {t_dense * 1e3:10.1f} ms")
    print(f"  speed-up {t_dense / t_fast:8.1f}x   max relative difference of sigma: {worst_rel:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    parser.add_argument("--dense-heads", type=int, default=4,
                        help="heads to time the dense path on (0 = all); the time is scaled to all heads")
    parser.add_argument("--repeats", type=int, default=3, help="fast-path repeats (best time kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU")
    for case in QUICK if args.quick else CASES:
        run(case, args.dense_heads, args.repeats)


if __name__ == "__main__":
    main()
