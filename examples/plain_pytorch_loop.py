"""The monitors in a plain PyTorch loop: no Lightning, a SummaryWriter, the same dashboards.

The bundled decoder learns associative recall with a hand-written AdamW loop. ``Monitoring``
drives the three engines that the Lightning callbacks wrap: it reads the weights at the start of
each probe step, measures the forward inside ``with monitoring.step(step):`` and logs the same
tags, layout and hparams to TensorBoard as the callbacks do. It prints the training loss as it goes
(mean over the steps since the last line), so you can tell that it learns.

    python examples/plain_pytorch_loop.py [--steps 300] [--log-dir runs]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.models import DecoderLM, TransformerConfig
from qkmonitor.models.tasks import make_recall_batch

PAIRS, KEYS, VALUES = 4, 16, 16


def build(seed: int = 0) -> tuple[DecoderLM, torch.Tensor, torch.Tensor]:
    """The model and a fixed training set: (model, tokens (N, L), targets (N, L))."""
    gen = torch.Generator().manual_seed(seed)
    tokens, targets = make_recall_batch(2048, PAIRS, PAIRS, KEYS, VALUES, gen)
    torch.manual_seed(seed)
    config = TransformerConfig(
        vocab_size=KEYS + VALUES + 1, d_model=32, n_layers=2, n_heads=4, max_seq_len=tokens.shape[1]
    )
    return DecoderLM(config), tokens, targets


def train(
    model: nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    steps: int,
    writer: SummaryWriter,
    every_n_steps: int = 25,
    batch_size: int = 64,
    lr: float = 3e-3,
) -> Monitoring:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    engines = [QKSpectrum(), AttentionEntropy(), EffectiveRank(max_probe_tokens=32)]
    monitoring = Monitoring(
        model,
        engines,
        writer=writer,
        optimizer=optimizer,
        every_n_steps=every_n_steps,
        hparams={"lr": lr, "batch_size": batch_size, "d_model": 32},
    )
    losses = []  # since the last printed line
    with monitoring:  # closes whatever is open at the end, even on an error
        for step in range(steps):
            rows = torch.arange(step * batch_size, (step + 1) * batch_size) % len(tokens)
            with monitoring.step(
                step
            ):  # weights read at the start; the forward measured on probe steps
                logits = model(tokens[rows])
                loss = nn.functional.cross_entropy(
                    logits.flatten(0, 1), targets[rows].flatten(), ignore_index=-100
                )
                monitoring.observe_loss(loss)  # the trend alerts stay quiet while the loss falls
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            writer.add_scalar("train/loss", losses[-1], step)
            if step % every_n_steps == 0 or step == steps - 1:
                print(f"step {step:5d}  loss {sum(losses) / len(losses):.4f}")
                losses.clear()
            if monitoring.should_stop:  # an alert with alert_action="stop" fired
                break
    return monitoring


def main(argv: list[str] | None = None) -> Monitoring:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--log-dir", default="runs", help="TensorBoard root directory")
    args = parser.parse_args(argv)
    model, tokens, targets = build()
    writer = SummaryWriter(f"{args.log_dir}/plain_pytorch_loop")
    monitoring = train(model, tokens, targets, args.steps, writer)
    writer.close()
    print(
        f"entropy_norm per layer at step {monitoring.engines[1].schedule.latest_step}:",
        [round(v.mean().item(), 3) for v in monitoring.engines[1].latest["entropy_norm"]],
    )
    print(f"tensorboard --logdir {args.log_dir}")
    print(f"qkmonitor report {args.log_dir}/plain_pytorch_loop")
    return monitoring


if __name__ == "__main__":
    main()
