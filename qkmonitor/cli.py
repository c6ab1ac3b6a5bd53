"""The ``qkmonitor`` command line: ``qkmonitor train`` runs the main job.

``qkmonitor train`` trains a bundled decoder on multi-query associative recall (generated from a
seed, nothing downloaded) with the monitors on, writes TensorBoard logs under ``runs/``, and ends
with a per-layer summary. The CLI is the one place in the core that imports Lightning and the
bundled models, and it does so only inside the command that needs them.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkmonitor", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train", help="train a bundled model on the default task with the monitors on",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train.add_argument("--task", choices=["recall"], default="recall", help="the task to learn")
    train.add_argument("--steps", type=_positive_int, default=1500, help="optimizer steps")
    train.add_argument("--d-model", type=_positive_int, default=64, help="residual width")
    train.add_argument("--layers", type=_positive_int, default=2, help="transformer blocks")
    train.add_argument("--heads", type=_positive_int, default=4, help="query heads per layer")
    train.add_argument("--kv-heads", type=_positive_int, default=None, help="key/value heads (GQA); default = heads")
    train.add_argument("--batch-size", type=_positive_int, default=64)
    train.add_argument("--lr", type=_positive_float, default=3e-3, help="peak AdamW learning rate")
    train.add_argument("--pairs", type=_positive_int, default=6, help="recall: key-value pairs per sequence")
    train.add_argument("--every-n-steps", type=_positive_int, default=25, help="monitor probe interval")
    train.add_argument("--per-head", action="store_true", help="also log every head")
    train.add_argument("--log-dir", default="runs", help="TensorBoard root directory")
    train.add_argument("--name", default=None, help="run name under the log dir (default: the task)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--no-progress-bar", action="store_true", help="hide Lightning's progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _train(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _train(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from qkmonitor.callbacks import QKSpectrumMonitor
    from qkmonitor.models import TransformerConfig
    from qkmonitor.models.tasks import AssociativeRecallDataModule, CausalLMTask

    pl.seed_everything(args.seed, verbose=False)
    data = AssociativeRecallDataModule(num_pairs=args.pairs, num_queries=args.pairs,
                                       num_keys=4 * args.pairs, num_values=4 * args.pairs,
                                       batch_size=args.batch_size, seed=args.seed)
    try:
        config = TransformerConfig(vocab_size=data.vocab_size, d_model=args.d_model, n_layers=args.layers,
                                   n_heads=args.heads, n_kv_heads=args.kv_heads,
                                   max_seq_len=data.seq_len)
    except ValueError as err:
        print(f"qkmonitor train: {err}", file=sys.stderr)
        return 2
    task = CausalLMTask(config, lr=args.lr, warmup_steps=min(100, args.steps // 10))
    logger = TensorBoardLogger(args.log_dir, name=args.name or args.task, default_hp_metric=False)
    spectrum = QKSpectrumMonitor(every_n_steps=args.every_n_steps, per_head=args.per_head)
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="cpu", devices=1, logger=logger, callbacks=[spectrum],
        log_every_n_steps=args.every_n_steps, val_check_interval=min(250, args.steps),
        check_val_every_n_epoch=None, enable_progress_bar=not args.no_progress_bar,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(task, datamodule=data)
    final = trainer.validate(task, datamodule=data, verbose=False)[0]
    print(_summary(spectrum, final, logger.log_dir))
    print(f"\nTo see the dashboards:\n  tensorboard --logdir {args.log_dir}")
    return 0


def _summary(spectrum, final: dict[str, float], log_dir: str) -> str:
    """A per-layer table of the last probe, with the task's final validation scores."""
    columns = [("kappa", "mean"), ("kappa", "max"), ("kappa_eig", "mean"), ("qk_erank", "mean"),
               ("qk_spectral_norm", "max")]
    header = ["layer", "name"] + [f"{m} {agg}" if agg != "mean" else m for m, agg in columns]
    rows = []
    for i, layer in enumerate(spectrum.layers):
        cells = [str(i), layer.name]
        for metric, agg in columns:
            heads = spectrum.latest[metric][i]
            value = heads.mean() if agg == "mean" else heads.max()
            cells.append("nan" if math.isnan(value) else f"{value.item():.4f}")
        rows.append(cells)
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    alerts = ", ".join(f"{name}: {n}" for name, n in spectrum.tracker.counts.items()) or "none"
    scores = ", ".join(f"{k} {v:.4f}" for k, v in sorted(final.items()))
    return "\n".join([
        f"\nqkmonitor summary at step {spectrum.latest_step} ({log_dir})",
        line(header), line(["-" * w for w in widths]), *map(line, rows),
        f"alerts fired: {alerts}", f"final validation: {scores}",
    ])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
