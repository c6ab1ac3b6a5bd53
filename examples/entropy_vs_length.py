"""Attention entropy against sequence length under `standard` and `log_n` attention scaling.

With a fixed temperature, a softmax over n keys flattens as n grows: its entropy climbs like
log n and attention "fades" on long inputs. The `log_n` policy (critical scaling, Chen, Lin,
Polyanskiy & Rigollet, arXiv 2510.05554; the Qwen/SSMax log-n form) multiplies the logits by
max(1, log n / log L) beyond the training length L, which keeps the normalized entropy from
drifting to 1. Both decoders share their weights; only the scale policy differs. Entropies come
from the fused kernel's statistics (no n x n matrix), read through the adapter protocol the
monitors use.

    python examples/entropy_vs_length.py [--lengths 64 128 256 512 1024]
"""

from __future__ import annotations

import argparse
import math

import torch

from qkmonitor.attention.adapters import find_attention_layers
from qkmonitor.models import DecoderLM, TransformerConfig

TRAIN_LEN = 64


def build(policy: str, max_len: int) -> DecoderLM:
    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=64,
        d_model=64,
        n_layers=2,
        n_heads=4,
        max_seq_len=max_len,
        attention_scale=policy,
        scale_train_len=TRAIN_LEN,
    )
    model = DecoderLM(config).eval()
    with torch.no_grad():  # sharper-than-initial queries, as a trained model has
        for block in model.blocks:
            block.attn.q_proj.weight.mul_(4.0)
    return model


def mean_entropy(model: DecoderLM, n: int) -> tuple[float, float]:
    """Mean entropy (nats) and normalized entropy of the last layer, over its heads and the last
    quarter of the rows (rows that see about n keys)."""
    layer = find_attention_layers(model)[-1]
    tokens = torch.randint(64, (2, n), generator=torch.Generator().manual_seed(n))
    with (
        layer.open_probe() as probe,
        torch.no_grad(),
    ):  # the probe measures every forward until closed
        model(tokens)
    stats = probe.close().stats[0]  # per row: entropy, attended keys, ... (B, H, n)
    entropy, keys = stats.entropy[..., n - n // 4 :], stats.attended[..., n - n // 4 :]
    return entropy.mean().item(), (entropy / keys.log()).mean().item()


def main(argv: list[str] | None = None) -> dict[str, list[tuple[int, float, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    args = parser.parse_args(argv)
    results = {}
    for policy in ("standard", "log_n"):
        model = build(policy, max(args.lengths))
        results[policy] = [(n, *mean_entropy(model, n)) for n in args.lengths]
    print(f"last-layer attention entropy (training length L = {TRAIN_LEN})")
    print(f"{'n':>6} {'log n':>7} {'standard H':>11} {'H/log n':>8} {'log_n H':>9} {'H/log n':>8}")
    for (n, h_std, norm_std), (_, h_log, norm_log) in zip(results["standard"], results["log_n"]):
        print(
            f"{n:6d} {math.log(n):7.2f} {h_std:11.3f} {norm_std:8.3f} {h_log:9.3f} {norm_log:8.3f}"
        )
    return results


if __name__ == "__main__":
    main()
