"""What a probe step leaves to Python's cyclic collector: the objects found unreachable in reference
cycles after it, and the bytes of the tensor storages among them (memory that stays allocated until
the collector next runs: on a GPU, memory the next step's peak cannot reuse).

A nanoGPT-style model of 4 blocks (d 256, 8 heads, 256 tokens, batch 8), its attention through
``F.scaled_dot_product_attention`` or an explicit ``softmax(q @ kᵀ) @ v``, monitored by
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
import math
import sys
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink

VOCAB = 100


class Attention(nn.Module):
    """nanoGPT's CausalSelfAttention: one ``c_attn``, SDPA or an explicit masked softmax."""

    def __init__(self, d: int, heads: int, explicit: bool) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.n_head, self.n_embd, self.explicit = heads, d, explicit

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for z in self.c_attn(x).split(c, 2)
        )
        if not self.explicit:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Model(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, explicit: bool) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, d), nn.Linear(d, VOCAB)
        self.blocks = nn.ModuleList(Attention(d, heads, explicit) for _ in range(layers))

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


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
                model = Model(args.layers, args.d_model, args.heads, explicit)
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
