"""The spectrum of W_QK three ways: dense d x d SVD, Householder QR, and the Gram route.

- dense: form each head's ``W_QK^h = W_Q^h (W_K^g)^T`` (d x d) and take its full SVD, O(H·d³);
- QR (:func:`qkmonitor.measures.spectra.qk_singular_values`): ``W_Q^h = Q_1 R_1``, ``W_K^g = Q_2
  R_2``, ``svdvals(R_1 R_2^T)``, all layers stacked into one batched call;
- Gram (:func:`qkmonitor.measures.layer_spectra.spectrum_of_layers`): per layer, batched ``W_Q^T
  W_Q``, ``W_K^T W_K``, ``W_K^T W_Q`` products, then one d_k x d_k eigenproblem per head for σ and
  one for λ; layers one at a time.

Part 1 (the configurations of issue 2) times singular values only: dense vs QR vs Gram, with the
largest difference of the top d_k singular values from the dense float64 SVD, relative to σ_1.
A dense SVD of a 4096 x 4096 matrix takes tens of seconds, so ``--dense-heads`` times the dense
path on that many heads and scales to all heads (they are independent and equally sized).

Part 2 (issue 9) is a whole QKSpectrumMonitor probe of a 70B-shaped model (80 layers, d = 8192,
64 query / 8 key-value heads, d_k = 128): every metric plus the histogram's singular values. The
old path is what the callback did before: stack all layers of one shape, then
``qk_spectrum_metrics`` (QR + SVD + eigenvalues) and ``qk_singular_values`` (QR + SVD again). The
new path is ``spectrum_of_layers`` (runs of heads on torch's threads, see its module docstring).
Both are timed on ``--layers`` layers and scaled to 80 (layers are independent and equally sized;
the old path's stacking only grows with them). Accuracy is
measured on one layer against float64: the QR route run in float64 for σ and ``W_K^T W_Q``'s
eigenvalues in float64 (both checked against dense float64 in tests/core/test_measures_math.py).

Part 3 (issue 44, ``--scan``) is ``qkmonitor scan`` of a 70B-shaped model from its file: a
synthetic bf16 safetensors file holding only the 80 layers' ``q_proj``/``k_proj`` (about 12 GB,
written once under ``--scan-dir`` with its ``config.json``; :func:`write_qk_safetensors`), scanned
in a fresh subprocess (``qkmonitor.scan``, and ``write_scan`` as the command line writes it), its
wall time and peak resident memory (``ru_maxrss``) reported. The file is read one layer's query and
key tensors at a time.

Usage::

    python benchmarks/spectral.py             # parts 1 and 2
    python benchmarks/spectral.py --quick     # smaller shapes, a few seconds
    python benchmarks/spectral.py --part 2    # the 70B probe only
    python benchmarks/spectral.py --scan --scan-dir /tmp/qk70b   # part 3: the 70B scan
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qkmonitor.measures.layer_spectra import QKWeights, spectrum_of_layers
from qkmonitor.measures.ranks import effective_rank
from qkmonitor.measures.spectra import (
    qk_eigenvalues,
    qk_singular_values,
    qk_spectrum_metrics,
    spectral_concentration,
)


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
    Case(
        "(b) 1 layer, d=4096, 32 q / 8 kv heads, d_k=128",
        layers=1,
        d=4096,
        heads=32,
        kv_heads=8,
        d_k=128,
    ),
]
QUICK = [
    Case("(a-quick) 4 layers, d=256, 4 heads", layers=4, d=256, heads=4, kv_heads=4, d_k=64),
    Case(
        "(b-quick) 1 layer, d=1024, 8 q / 2 kv heads",
        layers=1,
        d=1024,
        heads=8,
        kv_heads=2,
        d_k=128,
    ),
]
LLAMA_70B = Case(
    "(c) 70B-shaped: 80 layers, d=8192, 64 q / 8 kv heads, d_k=128",
    layers=80,
    d=8192,
    heads=64,
    kv_heads=8,
    d_k=128,
)
LLAMA_70B_QUICK = Case(
    "(c-quick) 80 layers, d=1024, 16 q / 4 kv heads, d_k=64",
    layers=80,
    d=1024,
    heads=16,
    kv_heads=4,
    d_k=64,
)


def best_of(fn: Callable[[], object], repeats: int) -> float:
    return best_of_with_cpu(fn, repeats)[0]


def best_of_with_cpu(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best (wall, CPU) seconds: the CPU time of all threads tells a loaded machine from a slow
    path."""
    times = []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        times.append((time.perf_counter() - start, time.process_time() - start_cpu))
    return min(times)


def random_layers(
    case: Case, layers: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(w_q, w_k) per layer, float32, entries of variance 1/d (a standard initialisation)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(case.heads * case.d_k, case.d, generator=gen) / case.d**0.5,
            torch.randn(case.kv_heads * case.d_k, case.d, generator=gen) / case.d**0.5,
        )
        for _ in range(layers)
    ]


def qk_weights(case: Case, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> list[QKWeights]:
    return [QKWeights(w_q, w_k, case.heads, case.kv_heads, case.d_k**-0.5) for w_q, w_k in layers]


# -- part 1: singular values, dense vs QR vs Gram -------------------------------------------------


def dense_singular_values(
    w_q: torch.Tensor, w_k: torch.Tensor, case: Case, head: int
) -> torch.Tensor:
    """Top d_k singular values of the explicitly formed d x d W_QK of one head, in float64."""
    g = head // (case.heads // case.kv_heads)
    wq_h = w_q[head * case.d_k : (head + 1) * case.d_k].double().T  # (d, d_k)
    wk_g = w_k[g * case.d_k : (g + 1) * case.d_k].double().T
    return torch.linalg.svdvals(wq_h @ wk_g.T)[: case.d_k]


def part_one(case: Case, dense_heads: int, repeats: int) -> None:
    layers = random_layers(case, case.layers)
    stacked_q, stacked_k = torch.stack([q for q, _ in layers]), torch.stack([k for _, k in layers])
    weights = qk_weights(case, layers)
    qr_out = qk_singular_values(
        stacked_q, stacked_k, case.heads, case.kv_heads
    )  # warm-up, and the result
    t_qr = best_of(
        lambda: qk_singular_values(stacked_q, stacked_k, case.heads, case.kv_heads), repeats
    )
    gram_out = spectrum_of_layers(weights).singular_values
    t_gram = best_of(lambda: spectrum_of_layers(weights), repeats)

    total_heads = case.layers * case.heads
    cells = [(layer, head) for layer in range(case.layers) for head in range(case.heads)]
    timed = cells if dense_heads <= 0 else cells[: min(dense_heads, total_heads)]
    worst_qr = worst_gram = 0.0
    start = time.perf_counter()
    for layer, head in timed:
        dense = dense_singular_values(*layers[layer], case, head)
        worst_qr = max(worst_qr, ((dense - qr_out[layer, head]).abs().max() / dense[0]).item())
        worst_gram = max(
            worst_gram, ((dense - gram_out[layer][head]).abs().max() / dense[0]).item()
        )
    t_dense = (time.perf_counter() - start) * total_heads / len(timed)

    scaled = (
        ""
        if len(timed) == total_heads
        else f" (timed on {len(timed)} of {total_heads} heads, scaled)"
    )
    print(case.name)
    print(f"  dense {case.d}x{case.d} float64 SVD per head{scaled}: {t_dense * 1e3:10.1f} ms")
    print(
        f"  QR  + {case.d_k}x{case.d_k} SVD, all layers stacked, sigma only:   {t_qr * 1e3:10.1f} "
        f"ms   speed-up {t_dense / t_qr:7.1f}x   max |dsigma| / sigma_1 vs dense: {worst_qr:.1e}"
    )
    print(
        f"  Gram, layer by layer, every metric + sigma:        {t_gram * 1e3:10.1f} ms"
        f"   speed-up {t_dense / t_gram:7.1f}x   max |dsigma| / sigma_1 vs dense: {worst_gram:.1e}"
    )


# -- part 2: a whole probe of a 70B-shaped model -------------------------------------------------


def old_probe(
    case: Case, layers: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The stacked route timed against: stack the layers of one shape, metrics, then the SVD
    again."""
    w_q, w_k = torch.stack([q for q, _ in layers]), torch.stack([k for _, k in layers])
    scale = torch.full((len(layers),), case.d_k**-0.5, dtype=torch.float64)
    metrics = qk_spectrum_metrics(w_q, w_k, case.heads, case.kv_heads, scale)
    metrics["singular_values"] = qk_singular_values(w_q, w_k, case.heads, case.kv_heads)
    return metrics


def part_two(case: Case, timed_layers: int, repeats: int) -> None:
    layers = random_layers(case, timed_layers)
    weights = qk_weights(case, layers)
    print(case.name)
    t_old, cpu_old = (
        t / timed_layers for t in best_of_with_cpu(lambda: old_probe(case, layers), repeats)
    )
    t_new, cpu_new = (
        t / timed_layers for t in best_of_with_cpu(lambda: spectrum_of_layers(weights), repeats)
    )
    print(
        f"  timed on {timed_layers} layer(s), best of {repeats}, scaled to {case.layers} layers "
        f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
    )
    print(f"  {'':34s}{'per layer':>12s}{f'{case.layers} layers':>12s}{'CPU time':>12s}")
    print(
        f"  {'old: stacked QR metrics + 2nd SVD':34s}{t_old:11.3f}s{t_old * case.layers:11.1f}s"
        f"{cpu_old * case.layers:11.1f}s"
    )
    print(
        f"  {'new: Gram, layer by layer':34s}{t_new:11.3f}s{t_new * case.layers:11.1f}s"
        f"{cpu_new * case.layers:11.1f}s   speed-up {t_old / t_new:.1f}x"
    )
    accuracy(case, *layers[0])


def accuracy(case: Case, w_q: torch.Tensor, w_k: torch.Tensor) -> None:
    """Both paths on one layer against float64 (the QR route in float64, λ of W_K^T W_Q in
    float64)."""
    sigma = qk_singular_values(w_q.double(), w_k.double(), case.heads, case.kv_heads)  # (H, d_k)
    lam = qk_eigenvalues(w_q.double(), w_k.double(), case.heads, case.kv_heads)
    reference = {
        "sigma": sigma,
        "kappa": spectral_concentration(sigma),
        "qk_erank": effective_rank(sigma),
        "kappa_eig": spectral_concentration(lam),
    }
    d_k, group = case.d_k, torch.arange(case.heads) // (case.heads // case.kv_heads)
    scale = (
        torch.linalg.matrix_norm(w_q.double().view(case.heads, d_k, -1), ord=2)
        * torch.linalg.matrix_norm(w_k.double().view(case.kv_heads, d_k, -1), ord=2)[group]
    )  # S per head
    old = old_probe(case, [(w_q, w_k)])
    new = spectrum_of_layers(qk_weights(case, [(w_q, w_k)]))
    paths = {
        "old (float32 QR)": {
            "sigma": old["singular_values"][0],
            **{m: old[m][0] for m in reference if m != "sigma"},
        },
        "new (float32 Gram)": {
            "sigma": new.singular_values[0],
            **{m: new.metrics[m][0] for m in reference if m != "sigma"},
        },
    }
    print(
        f"  accuracy on one layer against float64 (S = ||W_Q^h|| ||W_K^g||, max over {case.heads} "
        "heads):"
    )
    print(
        f"  {'':20s}{'max|dsigma|/S':>15s}{'sigma_1 rel':>13s}{'|dkappa|':>11s}{'|derank|':>11s}"
        f"{'|dkappa_eig|':>14s}"
    )
    for name, got in paths.items():
        d_sigma = ((got["sigma"].double() - sigma).abs().amax(-1) / scale).max().item()
        d_top = ((got["sigma"][:, 0].double() - sigma[:, 0]).abs() / sigma[:, 0]).max().item()
        diffs = [
            (got[m].double() - reference[m]).abs().max().item()
            for m in ("kappa", "qk_erank", "kappa_eig")
        ]
        print(
            f"  {name:20s}{d_sigma:15.1e}{d_top:13.1e}"
            + "".join(f"{v:11.1e}" for v in diffs[:2])
            + f"{diffs[2]:14.1e}"
        )


def write_qk_safetensors(folder: Path, case: Case, seed: int = 0) -> Path:
    """A Hugging Face LLaMA folder holding only the query and key projections of ``case``, in
    bf16, written one tensor at a time (the safetensors layout: an 8-byte header length, the JSON
    header, the data). Each layer's weights are one random matrix scaled per layer (writing
    12 GB of fresh random numbers would take longer than the scan). Returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    q_shape, k_shape = (case.heads * case.d_k, case.d), (case.kv_heads * case.d_k, case.d)
    header, offset, order = {}, 0, []
    for layer in range(case.layers):
        for name, shape in (("q_proj", q_shape), ("k_proj", k_shape)):
            key = f"model.layers.{layer}.self_attn.{name}.weight"
            size = shape[0] * shape[1] * 2
            header[key] = {
                "dtype": "BF16",
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
            order.append((layer, name))
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    gen = torch.Generator().manual_seed(seed)
    base = {
        "q_proj": torch.randn(q_shape, generator=gen) * case.d**-0.5,
        "k_proj": torch.randn(k_shape, generator=gen) * case.d**-0.5,
    }
    with open(folder / "model.safetensors", "wb") as out:
        out.write(len(encoded).to_bytes(8, "little") + encoded)
        for layer, name in order:
            weight = (base[name] * (1 + layer / case.layers)).to(torch.bfloat16)
            out.write(weight.view(torch.int16).numpy().tobytes())
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": case.d,
        "num_attention_heads": case.heads,
        "num_key_value_heads": case.kv_heads,
        "head_dim": case.d_k,
        "num_hidden_layers": case.layers,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


_SCAN_CHILD = """
import resource, sys, time
start = time.perf_counter()
from qkmonitor.scanning import scan, write_scan
imported = time.perf_counter()
if sys.argv[2] == "api":
    layers = scan(sys.argv[1])
else:
    layers = write_scan([sys.argv[1]], sys.argv[3])[0].layers
done = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
kappa = sum(float(layer.metrics["kappa"].mean()) for layer in layers) / len(layers)
print(f"{len(layers)} {imported - start:.2f} {done - imported:.2f} {peak:.0f} {kappa:.6f}")
"""


def scan_phases(folder: Path, layers: int = 8) -> None:
    """Where a scanned layer's time goes, per layer over the first ``layers`` of ``folder``: the
    copy of its bf16 weights into float32, the products over d (G_Q and C, on every thread), and
    the eigenproblems (process CPU time, solved one head after another on one thread)."""
    from qkmonitor.measures.gram_spectra import _cross_products, _gram
    from qkmonitor.scanning.files import expand, open_model
    from qkmonitor.scanning.run import Float32Staging, layer_plans

    model = open_model(*expand([folder])[0], 0)
    staging, spent = (
        Float32Staging(),
        dict.fromkeys(("copy", "products", "eigvals", "eigvalsh"), 0.0),
    )
    for plan in layer_plans(model)[:layers]:
        start = time.perf_counter()
        weights = staging.stage(plan.read(model.tensors))
        spent["copy"] += time.perf_counter() - start
        heads, kv_heads = weights.num_heads, weights.num_kv_heads
        q_rows = weights.w_q.view(heads, -1, weights.w_q.shape[-1])
        k_rows = weights.w_k.view(kv_heads, -1, weights.w_k.shape[-1])
        group = torch.arange(heads) // (heads // kv_heads)
        start = time.perf_counter()
        gram_q, cross = _gram(q_rows), _cross_products(q_rows, k_rows, group)
        spent["products"] += time.perf_counter() - start
        with torch.no_grad():
            previous = torch.get_num_threads()
            torch.set_num_threads(1)
            start = time.process_time()
            torch.linalg.eigvals(cross)
            spent["eigvals"] += time.process_time() - start
            start = time.process_time()
            torch.linalg.eigvalsh(gram_q.double())
            spent["eigvalsh"] += time.process_time() - start
            torch.set_num_threads(previous)
    print(
        f"per layer ({layers} layers): "
        + ", ".join(f"{name} {value / layers * 1e3:.0f} ms" for name, value in spent.items())
        + " (copy and products: wall time on every thread; eigenproblems: CPU time, one thread)"
    )


def part_three(case: Case, folder: Path) -> None:
    """``qkmonitor scan`` of a 70B-shaped bf16 file, timed in fresh subprocesses."""
    if not (folder / "model.safetensors").is_file():
        start = time.perf_counter()
        write_qk_safetensors(folder, case)
        print(f"wrote {folder} in {time.perf_counter() - start:.1f} s")
    size = (folder / "model.safetensors").stat().st_size / 2**30
    print(f"\n## scan of {case.name} from {size:.1f} GiB of bf16 q/k projections")
    scan_phases(folder)
    for how in ("api", "write"):
        run_dir = folder.parent / f"{folder.name}-run-{time.time_ns()}"
        out = subprocess.run(
            [sys.executable, "-c", _SCAN_CHILD, str(folder), how, str(run_dir)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        layers, imports, seconds, peak, kappa = out[-5:]
        what = "qkmonitor.scan(path)" if how == "api" else "write_scan (qkmonitor scan)"
        print(
            f"{what}: {layers} layers in {seconds} s (imports {imports} s), peak RSS {peak} MiB, "
            f"mean kappa {kappa}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    parser.add_argument("--part", type=int, choices=(1, 2), default=None, help="run one part only")
    parser.add_argument(
        "--dense-heads",
        type=int,
        default=4,
        help="part 1: heads to time the dense path on (0 = all); the time is scaled to all heads",
    )
    parser.add_argument(
        "--layers", type=int, default=4, help="part 2: layers to time, scaled to 80"
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="repeats per timing (best time kept)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--scan", action="store_true", help="part 3 only: qkmonitor scan of a 70B-shaped file"
    )
    parser.add_argument(
        "--scan-dir",
        type=Path,
        default=Path("/tmp/qkmonitor-70b-qk"),
        help="part 3: the synthetic model folder (written if missing, about 12 GB)",
    )
    args = parser.parse_args()
    if args.scan:
        part_three(LLAMA_70B_QUICK if args.quick else LLAMA_70B, args.scan_dir)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 weights, CPU")
    if args.part in (None, 1):
        for case in QUICK if args.quick else CASES:
            part_one(case, args.dense_heads, args.repeats)
    if args.part in (None, 2):
        part_two(LLAMA_70B_QUICK if args.quick else LLAMA_70B, args.layers, args.repeats)


if __name__ == "__main__":
    main()
