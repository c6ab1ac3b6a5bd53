"""The monitors on a tiny Hugging Face LLaMA (random weights from a config: nothing downloaded).

Needs the `hf` extra (`pip install -e ".[hf]"`). The model is transformers' own LlamaForCausalLM
with grouped-query attention (4 query heads, 2 key/value heads); the callbacks find its
`q_proj`/`k_proj` layers and measure attention through transformers' attention interface, without
changing what the model computes. Its default run is healthy and fires no alert: κ rises from 0.1
to about 0.4 while the loss falls, and the heads' largest logit per unit input (qk_spectral_norm)
stays near 0.1, far from the kappa rule's bound of 1.

    python examples/hf_llama.py [--steps 60] [--log-dir runs]
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.cli import quiet_lightning
from qkmonitor.models.tasks import make_recall_batch


class TinyLlama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = LlamaConfig(
            vocab_size=48,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self.model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=-100
        )
        self.log("train_loss", loss, prog_bar=True)  # also read by `qkmonitor report`
        return loss

    def train_dataloader(self):
        tokens, targets = make_recall_batch(4096, 6, 6, 24, 24, torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens, targets), batch_size=32, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main(argv: list[str] | None = None) -> dict[str, list]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-dir", default="runs")
    args = parser.parse_args(argv)
    pl.seed_everything(0, verbose=False)
    monitors = [
        QKSpectrumMonitor(every_n_steps=20, per_head=True),
        AttentionEntropyMonitor(every_n_steps=20),
        EffectiveRankMonitor(every_n_steps=20),
    ]
    with quiet_lightning():  # no tips or device report: the progress, alerts and results
        trainer = pl.Trainer(
            max_steps=args.steps,
            logger=TensorBoardLogger(args.log_dir, name="hf_llama"),
            callbacks=list(monitors),
            enable_checkpointing=False,
            enable_model_summary=False,
            log_every_n_steps=20,
        )
        trainer.fit(TinyLlama())
    print(
        "layers:", ", ".join(f"{layer.name} ({layer.kind})" for layer in monitors[0].engine.layers)
    )
    for monitor in monitors:
        for metric, layers in monitor.latest.items():
            print(f"{metric:18s}", "  ".join(f"L{i}: {v.mean():.3f}" for i, v in enumerate(layers)))
    print(f"train_loss (last batch): {float(trainer.callback_metrics['train_loss']):.3f}")
    print(f"\ntensorboard --logdir {args.log_dir}\nqkmonitor report {trainer.logger.log_dir}")
    return {name: values for monitor in monitors for name, values in monitor.latest.items()}


if __name__ == "__main__":
    main()
