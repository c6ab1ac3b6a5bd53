"""Rank collapse (Dong, Cordonnier & Loukas 2021): attention without skip connections.

The same stack of 8 self-attention layers (no MLP) is built twice, with and without residual
connections. Without them every token's representation converges to the same vector — the
residual to rank one, ``‖X − 1 x̄ᵀ‖_F / ‖X‖_F``, falls doubly exponentially with depth — and
EffectiveRankMonitor raises RankCollapseWarning; with them the stream keeps its rank.

    python examples/rank_collapse.py [--depth 8] [--log-dir runs]
"""

from __future__ import annotations

import argparse
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qkmonitor import RankCollapseWarning
from qkmonitor.callbacks import EffectiveRankMonitor
from qkmonitor.cli import quiet_lightning


class AttentionBlock(nn.Module):
    def __init__(self, d: int, heads: int, skip: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out = self.attn(h, h, h, need_weights=False)[0]
        return x + out if self.skip else out


class AttentionOnly(pl.LightningModule):
    def __init__(self, depth: int, skip: bool, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(AttentionBlock(d, heads, skip) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def training_step(self, batch, batch_idx):
        return (self(batch[0]) - batch[0]).square().mean()  # try to keep the input: needs rank

    def train_dataloader(self):
        x = torch.randn(512, 32, 64, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x), batch_size=32)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def run(depth: int, skip: bool, log_dir: str) -> tuple[list[float], int, str]:
    pl.seed_everything(0, verbose=False)
    monitor = EffectiveRankMonitor(every_n_steps=5)
    with quiet_lightning():  # no tips or device report
        trainer = pl.Trainer(
            max_steps=10,
            logger=TensorBoardLogger(log_dir, name=f"rank_collapse_skip_{skip}"),
            callbacks=[monitor],
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
            log_every_n_steps=5,
        )
        with warnings.catch_warnings(record=True) as caught:  # counted, not printed
            warnings.simplefilter("always")
            trainer.fit(AttentionOnly(depth, skip))
    fired = sum(issubclass(w.category, RankCollapseWarning) for w in caught)
    return [v.item() for v in monitor.latest["hidden_collapse"]], fired, trainer.logger.log_dir


def main(argv: list[str] | None = None) -> dict[str, tuple[list[float], int]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--log-dir", default="runs")
    args = parser.parse_args(argv)
    results = {skip: run(args.depth, skip, args.log_dir) for skip in (False, True)}
    print("hidden_collapse = ||X - 1 mean(X)||_F / ||X||_F after each layer")
    for skip, (collapse, fired, _) in results.items():
        label = "with skips   " if skip else "without skips"
        print(
            f"  {label}",
            " ".join(f"{c:8.1e}" for c in collapse),
            f"  rank-collapse warnings: {fired}",
        )
    print(f"\ntensorboard --logdir {args.log_dir}")
    print(f"qkmonitor report {results[False][2]} {results[True][2]}")
    return {"no_skip": results[False][:2], "skip": results[True][:2]}


if __name__ == "__main__":
    main()
