"""The cost of the update's spectrum (``qk_update_entropy``, ``qk_update_top_share``) beside the
spectrum it rides with, on the CPU.

For each configuration, one probe's worth of work on the same layers, side by side in one run:

- the spectrum: :func:`qkmonitor.measures.layer_spectra.spectrum_of_layers` (κ, eigenvalues, ...);
- the update's spectrum: :func:`qkmonitor.measures.update_spectra.update_spectra` of the same
  layers before and after an update of relative size 10^-3 (Gram products of the 2 d_k-row factors
  and three small eigenproblems a head);
- the dense reference on a few heads (``svdvals`` of the explicit d x d first-order update), scaled
  to all heads: what the factor space saves;

and the memory the update's spectrum holds for one step (its copy of W_Q and W_K before the
update, as large as the update ratios' copy of the rows), with the largest difference of the top
singular values from the dense float64 reference, relative to σ_1. Best of ``--repeats``.

With ``--probed-step``: what turning it on (``QKSpectrum(update_spectrum=True)``) adds to a probe
of a plain loop on the default model (d 64, 2 layers, 4 heads, one torch thread): two
``Monitoring`` loops, with and without it, stepped in turns in one process; a probe's time is its
two batches' (the one whose update is copied before it, and the probe's, whose start reads the
weights after it), the median over the probes.

Usage::

    python benchmarks/update_spectrum.py
    python benchmarks/update_spectrum.py --quick    # smaller shapes, a few seconds
    python benchmarks/update_spectrum.py --probed-step
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from qkmonitor.measures.layer_spectra import QKWeights, spectrum_of_layers
from qkmonitor.measures.update_spectra import qk_update_singular_values, update_spectra

#: (name, layers, d, heads, kv heads, d_k)
CASES = [
    ("GPT-2 small: 12 layers, d 768, 12 heads, d_k 64", 12, 768, 12, 12, 64),
    ("1 layer, d 4096, 32 query / 8 KV heads, d_k 128", 1, 4096, 32, 8, 128),
]
QUICK = [("4 layers, d 256, 8 heads, d_k 32", 4, 256, 8, 8, 32)]


def best_of(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def layers_of(count, d, heads, kv_heads, d_k, seed=0) -> list[tuple[QKWeights, QKWeights]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        w_q = torch.randn(heads * d_k, d, generator=gen) / d**0.5
        w_k = torch.randn(kv_heads * d_k, d, generator=gen) / d**0.5
        q1 = w_q + 1e-3 * torch.randn(w_q.shape, generator=gen) / d**0.5
        k1 = w_k + 1e-3 * torch.randn(w_k.shape, generator=gen) / d**0.5
        out.append(
            (QKWeights(w_q, w_k, heads, kv_heads, 1.0), QKWeights(q1, k1, heads, kv_heads, 1.0))
        )
    return out


def dense(before: QKWeights, after: QKWeights, heads: int) -> torch.Tensor:
    """float64 svdvals of the first ``heads`` heads' explicit d x d first-order update."""
    d_k = before.w_q.shape[0] // before.num_heads
    group = before.num_heads // before.num_kv_heads
    out = []
    for h in range(heads):
        q, k = slice(h * d_k, (h + 1) * d_k), slice(h // group * d_k, (h // group + 1) * d_k)
        a, b = before.w_q[q].double(), before.w_k[k].double()
        da, db = after.w_q[q].double() - a, after.w_k[k].double() - b
        out.append(torch.linalg.svdvals(da.T @ b + a.T @ db)[: 2 * d_k])
    return torch.stack(out)


def run_case(case, repeats: int, dense_heads: int) -> None:
    name, count, d, heads, kv_heads, d_k = case
    pairs = layers_of(count, d, heads, kv_heads, d_k)
    afters = [after for _, after in pairs]
    spectrum = best_of(lambda: spectrum_of_layers(afters), repeats)
    update = best_of(lambda: update_spectra(pairs, [heads] * count), repeats)
    sample = min(dense_heads, heads)
    dense_time = best_of(lambda: dense(*pairs[0], sample), 1) * heads * count / sample
    want = dense(*pairs[0], sample)
    got = qk_update_singular_values(*pairs[0])[:sample]
    error = float(((got - want).abs().amax(-1) / want[:, 0]).max())
    held = sum(b.w_q.numel() + b.w_k.numel() for b, _ in pairs) * 4 / 2**20
    print(f"{name}")
    print(
        f"  spectrum {spectrum * 1e3:8.1f} ms   update spectrum {update * 1e3:8.1f} ms   "
        f"ratio {update / spectrum:4.2f}x   dense d x d (scaled from {sample} heads) "
        f"{dense_time:7.2f} s ({dense_time / update:,.0f}x the update spectrum)"
    )
    print(
        f"  held for one step: {held:.1f} MiB (float32 W_Q, W_K)   max |Δσ|/σ_1 vs dense float64: "
        f"{error:.1e}"
    )


def probed_step(steps: int = 200, every: int = 2) -> None:
    """Print the median time of a probe's two batches in two plain loops stepped in turns, with
    and without the update spectrum (see the module docstring)."""
    import statistics

    from qkmonitor.engine import Monitoring, QKSpectrum
    from qkmonitor.models import DecoderLM, TransformerConfig

    torch.set_num_threads(1)
    tokens = torch.randint(0, 64, (16, 64), generator=torch.Generator().manual_seed(0))
    loops = {}
    for on in (False, True):
        torch.manual_seed(0)
        config = TransformerConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
        model = DecoderLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        monitoring = Monitoring(model, [QKSpectrum(update_spectrum=on)], every_n_steps=every,
                                optimizer=optimizer)  # fmt: skip
        loops[on] = (model, optimizer, monitoring.__enter__())
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(steps):
        for on in (False, True) if step % 2 else (True, False):  # each first in turn
            model, optimizer, monitoring = loops[on]
            start = time.perf_counter()
            with monitoring.step(step):
                model(tokens).logsumexp(-1).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            times[on].append(time.perf_counter() - start)
    for _, _, monitoring in loops.values():
        monitoring.__exit__(None, None, None)
    probes = range(2 * every, steps, every)  # the batch before copies, the probe's start reads
    off, on = (
        statistics.median(times[k][s - 1] + times[k][s] for s in probes) * 1e3 for k in (0, 1)
    )
    print(f"a probe's two batches, median of {len(probes)}: without the update spectrum "
          f"{off:.2f} ms, with it {on:.2f} ms: +{on - off:.2f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dense-heads", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--probed-step", action="store_true", help="what it adds to a probe when on"
    )
    args = parser.parse_args()
    if args.probed_step:
        probed_step()
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 weights, CPU")
    for case in QUICK if args.quick else CASES:
        run_case(case, args.repeats, args.dense_heads)


if __name__ == "__main__":
    main()
