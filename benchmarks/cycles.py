"""What a probe step leaves to Python's cyclic collector: the objects found unreachable in reference
cycles after it, and the bytes of the tensor storages among them (memory that stays allocated until
the collector next runs: on a GPU, memory the next step's peak cannot reuse).

``benchmarks/nanogpt.py``'s GPT of 4 blocks (d 256, 8 heads, 256 tokens, batch 8), its attention
through ``F.scaled_dot_product_attention`` or nanoGPT's slow path, an explicit masked softmax
(``softmax(q @ kᵀ / √d) @ v``), monitored by
QKSpectrum, AttentionEntropy and EffectiveRank, every step a probe; a training step and a forward
under ``no_grad`` (a validation probe). The collector is disabled while it runs; after each step
``gc.collect()`` with ``DEBUG_SAVEALL`` keeps what it found for counting. The unmonitored model's
own step is the first row of each kind.

Usage::

    python benchmarks/cycles.py
    git checkout 392811c^ -- qkmonitor/attention && python benchmarks/cycles.py  # before the fix
"""

from __future__ import annotations

import argparse
import gc
import sys
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from nanogpt import GPT

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.models import TransformerConfig
from qkmonitor.output.sinks import MemorySink

VOCAB = 100


def step(model, monitoring, tokens, training: bool, probe: int | None) -> None:
    """A training step (or a forward under ``no_grad``), probed as step ``probe`` unless None."""
    with (
        nullcontext() if probe is None else monitoring.step(probe),
        torch.set_grad_enabled(training),
    ):
        out = model(tokens)
        if training:
            out.logsumexp(-1).mean().backward()


def left_in_cycles(run) -> tuple[int, int]:
    """``run()``'s unreachable objects (collector off) and the bytes of the tensor storages among
    them, each storage once."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        storages = {
            o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
            for o in gc.garbage
            if isinstance(o, torch.Tensor)
        }
        return len(gc.garbage), sum(storages.values())
    finally:
        gc.garbage.clear()
        gc.set_debug(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq_len))
    print(
        f"\n{args.layers} blocks, d {args.d_model}, {args.heads} heads, {args.seq_len} tokens, "
        f"batch {args.batch}; left in reference cycles after a step (the collector off): objects, "
        "MiB of tensor storage\n"
    )
    print("| attention | step | unmonitored | monitored |")
    print("|---|---|---|---|")
    enabled = gc.isenabled()
    gc.disable()
    try:
        for explicit in (False, True):
            for training in (True, False):
                torch.manual_seed(0)
                config = TransformerConfig(
                    vocab_size=VOCAB,
                    d_model=args.d_model,
                    n_layers=args.layers,
                    n_heads=args.heads,
                    max_seq_len=args.seq_len,
                    dropout=0.0,
                )
                model = GPT(config, flash=not explicit)
                engines = [QKSpectrum(), AttentionEntropy(), EffectiveRank()]
                monitoring = Monitoring(model, engines, writer=MemorySink(), every_n_steps=1)
                step(model, monitoring, tokens, training, 0)  # the first probe's discovery apart
                cells = []
                for probe in (None, 1):
                    objects, nbytes = left_in_cycles(
                        partial(step, model, monitoring, tokens, training, probe)
                    )
                    cells.append(f"{objects}, {nbytes / 2**20:.1f}")
                monitoring.close()
                kind = "explicit softmax" if explicit else "SDPA"
                print(f"| {kind} | {'training' if training else 'no_grad'} | {' | '.join(cells)} |")
    finally:
        if enabled:
            gc.enable()


if __name__ == "__main__":
    main()
