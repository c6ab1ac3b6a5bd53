"""The monitors on your own LightningModule built from torch's nn.TransformerEncoder.

A small encoder learns to tell whether a sequence of random vectors contains a marked token —
nothing qkmonitor-specific in the model; the three callbacks find its nn.MultiheadAttention
layers on their own.

    python examples/own_encoder.py [--steps 120] [--log-dir runs]
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.cli import quiet_lightning


class MarkedTokenClassifier(pl.LightningModule):
    def __init__(self, d_model: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)
        return loss

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 16, 32, generator=gen)
        y = torch.randint(2, (4096,), generator=gen)
        x[y == 1, torch.randint(16, (int(y.sum()),), generator=gen), :4] += 3.0  # the mark
        return DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--log-dir", default="runs")
    args = parser.parse_args(argv)
    pl.seed_everything(0, verbose=False)
    monitors = [
        QKSpectrumMonitor(),
        AttentionEntropyMonitor(),
        EffectiveRankMonitor(max_probe_tokens=16),
    ]
    with quiet_lightning():  # no tips or device report: the progress, alerts and results
        trainer = pl.Trainer(
            max_steps=args.steps,
            logger=TensorBoardLogger(args.log_dir, name="own_encoder"),
            callbacks=list(monitors),
            log_every_n_steps=20,
            enable_checkpointing=False,
            enable_model_summary=False,
        )
        trainer.fit(MarkedTokenClassifier())
    print(
        "layers:", ", ".join(f"{layer.name} ({layer.kind})" for layer in monitors[0].engine.layers)
    )
    for monitor in monitors:
        for metric, layers in monitor.latest.items():
            print(f"{metric:18s}", "  ".join(f"L{i}: {v.mean():.3f}" for i, v in enumerate(layers)))
    print(f"train_acc (last batch): {float(trainer.callback_metrics['train_acc']):.3f}")
    print(f"\ntensorboard --logdir {args.log_dir}\nqkmonitor report {trainer.logger.log_dir}")
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


if __name__ == "__main__":
    main()
