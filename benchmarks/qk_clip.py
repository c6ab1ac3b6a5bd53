"""Does QK-Clip rescue a run whose attention logits run away? A small side-by-side measurement.

The instability miniature of ``tests/core/test_instability.py``: the bundled decoder (d_model 32,
2 layers, 4 heads, d_k 8) on associative recall, AdamW at peak lr 0.1 after a 20-step warmup, 150
steps. Each seed trains five runs from the same initialization and batches: without a cure, with
``QKClip(tau)`` for tau in 100, 30 and 10, and with QK-norm. It prints, per run, the mean training
loss of the last 20 steps and the largest attention logit AttentionEntropy saw at its probes
(every 10 steps, in the step's forward, before that step's clip), and how many (step, head) clips
QKClip made. Then the same at a healthy rate (3e-3): what the clip costs a run that needs none.

Usage::

    python benchmarks/qk_clip.py                # seeds 0 and 1 (about 2 minutes on 2 CPUs)
    python benchmarks/qk_clip.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch
from qkmonitor.models import DecoderLM, TransformerConfig
from qkmonitor.models.tasks import make_recall_batch
from qkmonitor.models.tasks.base import IGNORE_INDEX, lr_factor
from torch import nn

from qkmonitor.engine import AttentionEntropy, Monitoring, QKClip
from qkmonitor.engine.sinks import MemorySink

PAIRS, STEPS, WARMUP, LR = 4, 150, 20, 0.1
TAUS = (100.0, 30.0, 10.0)
HEALTHY_LR = 3e-3  # a rate at which the run trains without a cure


def run(
    seed: int, tau: float | None = None, qk_norm: bool = False, lr: float = LR
) -> dict[str, float]:
    torch.manual_seed(seed)
    config = TransformerConfig(
        vocab_size=8 * PAIRS,
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=3 * PAIRS,
        qk_norm=qk_norm,
        attention_backend="torch",
    )
    model = DecoderLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, WARMUP))
    entropy = AttentionEntropy(every_n_steps=10, alerts=[])
    clip = QKClip(tau=tau) if tau is not None else None
    engines = [entropy] + ([clip] if clip else [])
    monitoring = Monitoring(model, engines, writer=MemorySink(), every_n_steps=10)
    generator = torch.Generator().manual_seed(seed + 1)
    losses, largest = [], 0.0
    for step in range(STEPS):
        tokens, targets = make_recall_batch(32, PAIRS, PAIRS, 4 * PAIRS, 4 * PAIRS, generator)
        with monitoring.step(step):
            logits = model(tokens)
            loss = nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
        if entropy.latest_step == step:
            largest = max(largest, max(float(x.max()) for x in entropy.latest["max_logit"]))
    monitoring.close()
    clips = sum(int(c.sum()) for c in clip.clip_counts) if clip else 0
    return {"final": sum(losses[-20:]) / 20, "largest": largest, "clips": clips}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("qkmonitor").setLevel(logging.WARNING)  # the discovery line of each run
    start = time.perf_counter()
    print("| seed | run | final loss | / QK-norm twin | largest logit seen | clips |")
    print("|---|---|---|---|---|---|")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the discovery lines and QKClip's notes are not the point
        for seed in args.seeds:
            twin = run(seed, qk_norm=True)
            rows = [("no cure", run(seed))]
            rows += [(f"QKClip(tau={tau:g})", run(seed, tau)) for tau in TAUS]
            rows += [("QK-norm", twin)]
            for name, r in rows:
                print(
                    f"| {seed} | {name} | {r['final']:.3f} | {r['final'] / twin['final']:.2f} | "
                    f"{r['largest']:.1f} | {r['clips']} |"
                )
    print(f"\nat the healthy rate {HEALTHY_LR:g}:\n")
    print("| seed | run | final loss | / no cure | largest logit seen | clips |")
    print("|---|---|---|---|---|---|")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in args.seeds:
            plain = run(seed, lr=HEALTHY_LR)
            rows = [("no cure", plain)]
            rows += [(f"QKClip(tau={tau:g})", run(seed, tau, lr=HEALTHY_LR)) for tau in TAUS]
            for name, r in rows:
                print(
                    f"| {seed} | {name} | {r['final']:.3f} | {r['final'] / plain['final']:.3f} | "
                    f"{r['largest']:.1f} | {r['clips']} |"
                )
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
