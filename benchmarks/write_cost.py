"""What writing one probe's scalars costs the training thread (``per_head=True``), by model size.

A probe of the three monitors with ``per_head=True`` writes, per layer, each metric's mean, lowest
and highest head and every head's value: about 13 scalars a head a layer, 13,700 at 32 layers ×
32 heads. This builds those tags as the engines do (each engine's
:class:`~qkmonitor.engine.publishing.ValuePublisher`, random values) and times, per probe, on the
training thread:

- **tags**: building the ``{tag: value}`` dictionaries of the three engines;
- **TensorBoard**: ``TensorBoardLogger``'s writer through qkmonitor's sink (one event a probe,
  behind its guard), and separately the writer's ``flush``, which waits for its own thread to
  serialise and write the event (what the run's background threads pay);
- **CSV**: ``CSVLogger.log_metrics`` (kept in memory) and its ``save`` (the file rewritten: a new
  header at the first probe, rows appended after), which Lightning calls every
  ``flush_logs_every_n_steps`` (100) steps, so once in two probes at ``every_n_steps=50``.

Each figure is the median over ``--probes`` probes (the first, which pays first-call costs, left
out). Usage::

    python benchmarks/write_cost.py                     # 2x4, 12x12, 32x32
    python benchmarks/write_cost.py --sizes 32x32 --probes 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from qkmonitor.engine import AttentionEntropy, EffectiveRank, QKSpectrum
from qkmonitor.output.logger_sinks import guarded_sink


def probe_values(engine, layers: int, heads: int, gen: torch.Generator) -> dict:
    """Random values of every metric the engine logs: one (heads,) tensor per layer ((1,) for a
    per-layer metric)."""
    out = {}
    for spec in engine.specs:
        width = heads if spec.per_head else 1
        out[spec.name] = [torch.rand(width, generator=gen) for _ in range(layers)]
    return out


def measure(layers: int, heads: int, probes: int) -> dict[str, float]:
    """Seconds per probe (medians) of each part, and the scalar count."""
    engines = [
        QKSpectrum(per_head=True),
        AttentionEntropy(per_head=True),
        EffectiveRank(per_head=True),
    ]
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {k: [] for k in ("tags", "tensorboard", "flush", "csv", "save")}
    count = 0
    with tempfile.TemporaryDirectory() as root:
        tensorboard = guarded_sink(TensorBoardLogger(root, "tb"))
        csv_logger = CSVLogger(root, "csv")
        csv = guarded_sink(csv_logger)
        for probe in range(probes + 1):
            step = 50 * probe
            values = [probe_values(e, layers, heads, gen) for e in engines]
            start = time.perf_counter()
            scalars = {}
            for engine, v in zip(engines, values):
                scalars.update(engine.publishing.scalars(v, engine.prefix))
            tags = time.perf_counter()
            tensorboard.log_scalars(scalars, step)
            written = time.perf_counter()
            tensorboard.flush()
            flushed = time.perf_counter()
            csv.log_scalars(scalars, step)
            logged = time.perf_counter()
            if probe % 2 == 0:  # Lightning saves every 100 steps: once in two probes at 50
                csv_logger.save()
            saved = time.perf_counter()
            if probe:  # the first probe pays first-call costs
                times["tags"].append(tags - start)
                times["tensorboard"].append(written - tags)
                times["flush"].append(flushed - written)
                times["csv"].append(logged - flushed)
                if probe % 2 == 0:
                    times["save"].append(saved - logged)
            count = len(scalars)
        tensorboard.sink.logger.experiment.close()
    return {**{k: statistics.median(v) for k, v in times.items() if v}, "scalars": count}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["2x4", "12x12", "32x32"])
    parser.add_argument("--probes", type=int, default=10)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {args.probes} probes a size (medians, ms a probe)")
    print(
        f"  {'layers x heads':>14s} {'scalars':>8s} {'tags':>7s} {'TB write':>9s} {'TB flush':>9s} "
        f"{'CSV log':>8s} {'CSV save':>9s}"
    )
    for size in args.sizes:
        layers, heads = (int(x) for x in size.split("x"))
        f = measure(layers, heads, args.probes)
        print(
            f"  {size:>14s} {f['scalars']:8d} {1e3 * f['tags']:7.1f} {1e3 * f['tensorboard']:9.1f} "
            f"{1e3 * f['flush']:9.1f} {1e3 * f['csv']:8.2f} {1e3 * f['save']:9.1f}"
        )
    print(
        "  tags, TB write, CSV log and CSV save run on the training thread; TB flush is the "
        "writer's own thread serialising and writing the event"
    )


if __name__ == "__main__":
    main()
