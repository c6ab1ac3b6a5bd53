"""Does QK-Clip rescue a run whose attention logits run away? A small side-by-side measurement.

The instability miniature (``benchmarks/miniature.py``, also run by
``tests/core/test_instability.py``): the bundled decoder (d_model 32, 2 layers, 4 heads, d_k 8) on
associative recall, AdamW at peak lr 0.1 after a 20-step warmup, 150 steps. Each seed trains five
runs from the same initialization and batches: without a cure, with QK-Clip (``QKClipEngine(tau)``)
for tau in 100, 30 and 10, and with QK-norm. It prints, per run, the mean training loss of the last
20 steps and the largest attention logit AttentionEntropy saw at its probes (every 10 steps, in the
step's forward, before that step's clip), and how many (step, head) clips QK-Clip made. Then the
same at a healthy rate (3e-3): what the clip costs a run that needs none.

Usage::

    python benchmarks/qk_clip.py                # seeds 0 and 1
    python benchmarks/qk_clip.py --seeds 0 1 2
    # Muon on the blocks' 2-D weights, AdamW on the rest
    python benchmarks/qk_clip.py --optimizer muon --lr 0.1 --healthy-lr 0.01


"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch
from miniature import train_recall_miniature

from qkmonitor.engine import AttentionEntropy, QKClipEngine

LR = 0.1  # the miniature's peak rate, at which its logits run away
TAUS = (100.0, 30.0, 10.0)
HEALTHY_LR = 3e-3  # a rate at which the run trains without a cure


def run(
    seed: int,
    tau: float | None = None,
    qk_norm: bool = False,
    lr: float = LR,
    optimizer: str = "adamw",
) -> dict[str, float]:
    entropy = AttentionEntropy(every_n_steps=10, alerts=[])
    clip = QKClipEngine(tau=tau) if tau is not None else None
    largest = [0.0]

    def read(step: int) -> None:
        if entropy.schedule.latest_step == step:
            largest.append(max(float(x.max()) for x in entropy.latest["max_logit"]))

    engines = [entropy] + ([clip] if clip else [])
    losses = train_recall_miniature(
        engines, lr=lr, qk_norm=qk_norm, seed=seed, on_step=read, optimizer=optimizer
    )
    clips = sum(int(c.sum()) for c in clip.clip_counts) if clip else 0
    return {"final": sum(losses[-20:]) / 20, "largest": max(largest), "clips": clips}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    parser.add_argument("--lr", type=float, default=LR, help="the high peak rate")
    parser.add_argument("--healthy-lr", type=float, default=HEALTHY_LR, help="the healthy rate")
    args = parser.parse_args()
    opt = {"optimizer": args.optimizer}
    print(f"{args.optimizer}, peak lr {args.lr:g}:\n")
    torch.set_num_threads(1)
    logging.getLogger("qkmonitor").setLevel(logging.WARNING)  # the discovery line of each run
    start = time.perf_counter()
    print("| seed | run | final loss | / QK-norm twin | largest logit seen | clips |")
    print("|---|---|---|---|---|---|")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the discovery lines and QK-Clip's notes are not the point
        for seed in args.seeds:
            twin = run(seed, qk_norm=True, lr=args.lr, **opt)
            rows = [("no cure", run(seed, lr=args.lr, **opt))]
            rows += [(f"QKClip(tau={tau:g})", run(seed, tau, lr=args.lr, **opt)) for tau in TAUS]
            rows += [("QK-norm", twin)]
            for name, r in rows:
                print(
                    f"| {seed} | {name} | {r['final']:.3f} | {r['final'] / twin['final']:.2f} | "
                    f"{r['largest']:.1f} | {r['clips']} |"
                )
    print(f"\nat the healthy rate {args.healthy_lr:g}:\n")
    print("| seed | run | final loss | / no cure | largest logit seen | clips |")
    print("|---|---|---|---|---|---|")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in args.seeds:
            plain = run(seed, lr=args.healthy_lr, **opt)
            rows = [("no cure", plain)]
            rows += [
                (f"QKClip(tau={tau:g})", run(seed, tau, lr=args.healthy_lr, **opt)) for tau in TAUS
            ]
            for name, r in rows:
                print(
                    f"| {seed} | {name} | {r['final']:.3f} | {r['final'] / plain['final']:.3f} | "
                    f"{r['largest']:.1f} | {r['clips']} |"
                )
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
