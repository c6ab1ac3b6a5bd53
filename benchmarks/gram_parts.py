"""A probe's Gram eigenproblems in parts of about a megabyte against the whole batch at once, side
by side in one process: process CPU time and minor page faults a probe step.

EffectiveRank's attention ranks are the singular values of each layer's probability slices (a
sequence's head: 128 x 128 here), from their Gram matrices (``gram_singular_values``). Solved as
one batch (every layer's slices joined: 4 x 32 slices, a 16 MiB float64 copy, a Gram matrix and
LAPACK's copy of it), the buffers are freed together at the top of glibc's heap, which hands them
back to the system (its trim threshold), and the next probe takes them again page fault by page
fault. In parts of :data:`qkmonitor.measures.ranks.NUMBERS_PER_PART` numbers (what qkmonitor
does), the same memory is reused part after part and the passes run in the caches.

Three copies of a LLaMA-style decoder (``tensor_parallel.Model``, unsplit: 4 layers, d = 256, 8
heads of 32, SwiGLU MLP of 512, 128 tokens, batch 4, AdamW, one torch thread unless
``--threads``, no process group): plain, monitored with parts, monitored as before the parts
(:func:`whole_parts`, for that copy's steps alone), every step a probe, taken in a fresh random
order at each step. Printed: each monitored copy's step less the plain one's, median (quartiles),
in process CPU ms and in minor faults (``getrusage``), and parts − whole paired step by step,
median [95 %].

Usage::

    python benchmarks/gram_parts.py                  # all three engines, 60 steps
    python benchmarks/gram_parts.py --engines rank --steps 100
    python benchmarks/gram_parts.py --threads 2      # torch's default here: parts on threads
    python benchmarks/gram_parts.py --layers 6 --seq-len 256   # slices of 256 x 256
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from tensor_parallel import ENGINES, VOCAB, Model, Size, engines
from tensor_parallel_one_rank import median_interval

from qkmonitor.engine import Monitoring
from qkmonitor.measures import ranks

#: the copies: no monitor, the batch in parts (qkmonitor's), the whole batch at once
COPIES = ("plain", "parts", "whole")


def whole_parts(count: int, numbers: int, device: str, threads: int = 1) -> list[slice]:
    """The batch as :mod:`qkmonitor.measures.ranks` split it before its parts (the Gram
    eigenproblems, and the hidden states' collapse residual read whole): one slice, or one a
    thread where it runs on several (``threads``: torch's count for a large batch, else 1)."""
    parts = min(threads, count)
    return [slice(i * count // parts, (i + 1) * count // parts) for i in range(parts)]


def build(size: Size, names: list[str], copy: str) -> dict:
    """One copy: the model (the same initial weights in each), its optimizer and its monitoring."""
    torch.manual_seed(0)
    model = Model(size, size.heads, size.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitoring = (
        None
        if copy == "plain"
        else Monitoring(model, engines(names, 4), every_n_steps=1, optimizer=optimizer)
    )
    return {"model": model, "optimizer": optimizer, "monitoring": monitoring, "n": 0}


def step(copy: dict, tokens: torch.Tensor) -> tuple[float, int]:
    """One training step (a probe when monitored): its process CPU seconds and minor faults."""
    faults, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
    with copy["monitoring"].step(copy["n"]) if copy["monitoring"] else nullcontext():
        logits = copy["model"](tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        copy["optimizer"].step()
        copy["optimizer"].zero_grad()
    copy["n"] += 1
    return time.process_time() - cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps a copy")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--threads", type=int, default=1, help="torch's thread count")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128, help="tokens a sequence")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size = Size.of(args.layers, args.seq_len)
    copies = {name: build(size, args.engines, name) for name in COPIES}
    spent: dict[str, list[tuple[float, int]]] = {name: [] for name in COPIES}
    parts = ranks._parts
    shuffle, generator = torch.Generator().manual_seed(2), torch.Generator().manual_seed(1)
    started = time.perf_counter()
    warnings.simplefilter("error")  # a copy that warns has taken a path no other takes
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(VOCAB, (size.batch, size.seq_len + 1), generator=generator)
        for j in torch.randperm(len(COPIES), generator=shuffle).tolist():
            name = COPIES[j]
            ranks._parts = whole_parts if name == "whole" else parts
            try:
                cost = step(copies[name], tokens)
            finally:
                ranks._parts = parts
            if i >= args.warmup:
                spent[name].append(cost)
    print(
        f"\n{datetime.date.today()}, {platform.node() or 'this machine'}: {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {args.threads} thread(s); {' + '.join(args.engines)}, "
        "every step a probe; "
        f"{args.layers} layers, {args.seq_len} tokens; {args.steps} steps a copy "
        f"(+{args.warmup} warm-up), "
        f"{time.perf_counter() - started:.0f} s\n"
    )
    print("| copy | probe: monitored - plain, CPU ms | minor faults a step |")
    print("|---|---|---|")
    plain = spent["plain"]
    for name in COPIES:
        cpu = sorted(c - p for (c, _), (p, _) in zip(spent[name], plain, strict=True))
        faults = sorted(f for _, f in spent[name])
        n = len(cpu)
        probe = (
            "-"
            if name == "plain"
            else f"{1e3 * statistics.median(cpu):.2f} ({1e3 * cpu[n // 4]:.2f}, "
            f"{1e3 * cpu[3 * n // 4]:.2f})"
        )
        print(
            f"| {name} | {probe} | {statistics.median(faults):.0f} ({faults[n // 4]}, "
            f"{faults[3 * n // 4]}) |"
        )
    paired = [a - b for (a, _), (b, _) in zip(spent["parts"], spent["whole"], strict=True)]
    middle, low, high = median_interval(paired)
    whole = statistics.median(c - p for (c, _), (p, _) in zip(spent["whole"], plain, strict=True))
    print(
        f"\nparts - whole, paired: {1e3 * middle:+.2f} ms [{1e3 * low:+.2f}, {1e3 * high:+.2f}] "
        f"a probe step ({100 * middle / whole:+.1f} % of the whole batch's probe)"
    )


if __name__ == "__main__":
    main()
