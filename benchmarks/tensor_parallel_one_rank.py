"""One rank's own probe cost under tensor parallelism, with no other rank to wait for (issue 42,
item 5): the companion of ``benchmarks/tensor_parallel.py`` without its cross-rank noise.

In ``tensor_parallel.py`` the two gloo ranks meet in 28 ``all_reduce`` calls a TP step, so any
jitter of one rank (this 2-CPU machine runs both, and their gloo threads) becomes waiting in the
other: a TP step's paired differences scatter by several ms, as much as the excess it looks for.
Here one process joins torch's fake process group as rank 0 of 2 (``torch.testing``'s
``FakeStore``; every collective returns at once, no data moves), so each copy's step is this
rank's own work alone: DTensor's dispatch, the probe's measuring of its 4 local heads, its
bookkeeping of all 8, and the call of the one ``all_gather``.

The same model, plan and copies as ``tensor_parallel.py`` (its ``Model``, ``parallelize`` and
``engines``): under TP (8 heads, 4 on this rank) and the reference the bound names (4 heads of the
same width and half the MLP, unsplit, under the same process group: its monitors gather their
sums in the one ``all_gather``), each plain and monitored, every step a probe, all copies in turn
at each step (the order rotating). Printed: the median over steps of monitored minus plain, in
the process's CPU time, for each engine alone and all three, with the quartiles, and a second
plain copy's difference from the first (what no monitor costs: the noise floor), and a copy with
no monitor whose attention forwards run under a bare ``TorchFunctionMode`` that passes every call on
(what seeing the forward's torch calls costs before qkmonitor reads any: under TP DTensor's
parallel styles add their own calls there). Beside them, what
the bound's "one collective" carries for TP beyond the reference's sums: the CPU time of the heads'
exchange in the TP copy (the spectrum's heads put side by side, packed, placed back from the
gathered packs and into their tables; the fake ``all_gather`` itself costs nothing here), and the
TP probe less that exchange against the reference's less its own (empty packs: "beyond / ref",
1 where TP costs the reference plus its collective's work and nothing more).

One bias, against TP: the fake ``all_gather`` fills nothing in, so the other rank's heads stay
NaN and the spectrum's non-finite warning path runs at every TP probe (warnings are not shown).
The reference's gathered sums are whatever the unfilled buffers hold: the values of neither copy
mean anything here, only their cost.

Usage::

    python benchmarks/tensor_parallel_one_rank.py               # 40 steps a copy
    python benchmarks/tensor_parallel_one_rank.py --steps 80 --engines entropy all
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from tensor_parallel import ENGINES, VOCAB, Attention, Model, Size, engines, parallelize

from qkmonitor.engine import Monitoring
from qkmonitor.engine.spectrum_read import SpectrumRead
from qkmonitor.measures import metrics

#: process CPU seconds spent in the exchange of the split heads since the last :func:`step`
EXCHANGE = [0.0]


def exchange_counted(function):
    """``function`` (a step of the heads' exchange), its process CPU time added to EXCHANGE."""

    def counted(*args, **kwargs):
        cpu = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            EXCHANGE[0] += time.process_time() - cpu

    return counted


def count_the_exchange() -> None:
    """Count what the one collective carries for TP beside the sums: the spectrum's heads put side
    by side (``SpectrumRead.parts``), packed, placed from the gathered packs and put back in their
    tables (``SpectrumRead.merge``). The reference's empty packs are counted too (microseconds)."""
    SpectrumRead.parts = exchange_counted(SpectrumRead.parts)
    SpectrumRead.merge = exchange_counted(SpectrumRead.merge)
    metrics.pack_heads = exchange_counted(metrics.pack_heads)
    metrics.unpack_heads = exchange_counted(metrics.unpack_heads)


#: the arms: a second plain copy (the noise floor), a bare mode (below), each engine, all three
ARMS = ("plain2", "mode", *ENGINES, "all")


class PassingMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` that passes every call on: what seeing a forward's torch calls
    costs before any capture reads one (qkmonitor's interceptor is one of these)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def under_passing_mode(model: torch.nn.Module) -> None:
    """Run each attention module's forward under a :class:`PassingMode` (the "mode" arm)."""
    modes: list[PassingMode] = []

    def enter(module, args) -> None:
        modes.append(PassingMode())
        modes[-1].__enter__()

    def leave(module, args, output) -> None:
        modes.pop().__exit__(None, None, None)

    for module in model.modules():
        if isinstance(module, Attention):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)


def build(size: Size, split: bool, arm: str, sequences: int) -> dict:
    """One copy: TP (``split``) or the reference's unsplit half, plain or monitored by ``arm``."""
    torch.manual_seed(0)
    heads, hidden = (size.heads, size.hidden) if split else (size.heads // 2, size.hidden // 2)
    model = Model(size, heads, hidden)
    if split:
        parallelize(model)
    if arm == "mode":
        under_passing_mode(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = ENGINES if arm == "all" else (arm,) if arm in ENGINES else ()
    # the reference's EffectiveRank deals its sequences over the two data-parallel replicas
    dealt = sequences if split else 2 * sequences
    monitoring = (
        Monitoring(model, engines(names, dealt), every_n_steps=1, optimizer=optimizer)
        if names
        else None
    )
    return {
        "model": model,
        "optimizer": optimizer,
        "monitoring": monitoring,
        "n": 0,
        "cpu": [],
        "exchange": [],
    }


def step(copy: dict, tokens: torch.Tensor) -> float:
    """One training step of ``copy``; its process CPU seconds (the exchange's in EXCHANGE)."""
    EXCHANGE[0] = 0.0
    cpu = time.process_time()
    monitoring = copy["monitoring"]
    with monitoring.step(copy["n"]) if monitoring else nullcontext():
        logits = copy["model"](tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        copy["optimizer"].step()
        copy["optimizer"].zero_grad()
    copy["n"] += 1
    return time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps a copy")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--engines", nargs="+", choices=ARMS[1:], default=list(ARMS[1:]))
    parser.add_argument("--max-probe-sequences", type=int, default=4, help="EffectiveRank's")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    count_the_exchange()
    size = Size(layers=4, d_model=256, heads=8, head_dim=32, hidden=512, seq_len=128, batch=4)
    arms = ("plain", "plain2", *args.engines)
    copies = {
        (split, arm): build(size, split, arm, args.max_probe_sequences)
        for split in (True, False)
        for arm in arms
    }
    order = list(copies)
    generator = torch.Generator().manual_seed(1)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fake all_gather's NaN heads (see the docstring)
        for i in range(args.warmup + args.steps):
            tokens = torch.randint(VOCAB, (size.batch, size.seq_len + 1), generator=generator)
            for key in order[i % len(order) :] + order[: i % len(order)]:
                cpu = step(copies[key], tokens)
                if i >= args.warmup:
                    copies[key]["cpu"].append(cpu)
                    copies[key]["exchange"].append(EXCHANGE[0])
    print(
        f"\n{datetime.date.today()}, {platform.node() or 'this machine'}: {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, fake process group (rank 0 of 2), 1 thread; "
        f"{args.steps} steps a copy (+{args.warmup} warm-up), "
        f"{time.perf_counter() - started:.0f} s"
    )
    print("probe cost a step, monitored - plain, process CPU ms: median (quartiles)")
    print("(exchange: the heads' exchange in the TP copy; beyond: each copy less its own;")
    print(" mode: no monitor, a bare TorchFunctionMode around each attention forward)\n")
    print("| arm | TP (4 of 8 heads) | reference (4 heads) | TP / ref | exchange | beyond / ref |")
    print("|---|---|---|---|---|---|")
    for arm in arms[1:]:
        cells, medians = [], []
        for split in (True, False):
            plain = copies[(split, "plain")]["cpu"]
            diff = sorted(a - b for a, b in zip(copies[(split, arm)]["cpu"], plain, strict=True))
            n = len(diff)
            medians.append(statistics.median(diff))
            cells.append(
                f"{1e3 * medians[-1]:+.2f} ({1e3 * diff[n // 4]:+.2f}, "
                f"{1e3 * diff[3 * n // 4]:+.2f})"
            )
        beyond = [  # each copy's probe less its exchange (the reference's: its empty packs)
            statistics.median(
                a - b - e
                for a, b, e in zip(
                    copies[(split, arm)]["cpu"],
                    copies[(split, "plain")]["cpu"],
                    copies[(split, arm)]["exchange"],
                )
            )
            for split in (True, False)
        ]
        ratios = (
            ("", "")
            if arm == "plain2"
            else (f"{medians[0] / medians[1]:.3f}", f"{beyond[0] / beyond[1]:.3f}")
        )
        spent = sorted(copies[(True, arm)]["exchange"])
        exchange = (
            f"{1e3 * statistics.median(spent):.2f} ({1e3 * spent[n // 4]:.2f}, "
            f"{1e3 * spent[3 * n // 4]:.2f})"
        )
        print(f"| {arm} | {cells[0]} | {cells[1]} | {ratios[0]} | {exchange} | {ratios[1]} |")
    for split in (True, False):
        plain = statistics.median(copies[(split, "plain")]["cpu"])
        print(f"\nplain step, {'TP' if split else 'reference'}: {1e3 * plain:.1f} ms CPU", end="")
    print()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
