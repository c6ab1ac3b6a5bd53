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
same width and half the MLP, unsplit, under the same process group: its monitors gather their sums
in the one ``all_gather``), each plain and monitored, every step a probe, all copies in turn at
each step in a fresh random order (a rotation keeps each copy behind the same one at every step,
and what a copy leaves behind it, in the allocator and the caches, then biases the next one: a
second plain TP copy read 3.7 ms dearer than the first that way). Printed: the median over steps of
monitored minus plain, in the process's CPU time, for each engine alone and all three, with the
quartiles, and a second plain copy's difference from the first (what no monitor costs: the noise
floor), and a copy with no monitor whose attention forwards run under a bare ``TorchFunctionMode``
that passes every call on (what seeing the forward's torch calls costs before qkmonitor reads any:
under TP DTensor's parallel styles add their own calls there), and controls with no monitor for
what the measuring's work does to the forward around it: "stats", qkmonitor's statistics kernel
alone on each attention's q and k (:func:`measuring_alone`), and, when named, "sweep", a pass
over ``--sweep-mib`` of memory at the same place (:func:`sweeping`). Beside them, what the
bound's "one collective" carries for TP beyond the reference's sums: the CPU time of the heads'
exchange in the TP copy (the spectrum's heads put side by side, packed, placed back from the
gathered packs and into their tables; the fake ``all_gather`` itself costs nothing here), and the
TP probe less that exchange against the reference's less its own (empty packs: "beyond / ref", 1
where TP costs the reference plus its collective's work and nothing more).

The fake ``all_gather`` fills nothing in; here the other rank's output is filled with what a
rank 1 computing rank 0's values for its own heads would send (:func:`mirror_all_gather`), so that
every head's values are finite, as in a real run, and neither copy takes a non-finite warning path
(a warning fails the run). Left unfilled, the TP copy's other 4 heads were NaN at every probe and
its alerting named them: work no real run does. The values mean nothing, only the cost.

The bound's figure is paired step by step: at each step, TP's probe less its exchange minus the
reference's less its own (``TP - ref beyond``, ms), with its median and a distribution-free 95 %
interval of that median (the order statistics a binomial count puts around it), so that a run
says whether its excess is told apart from zero, not only where its point lands; and the same
for each phase of the step (:data:`PHASES`), to show where an excess lies, the forward's part
inside the attention modules apart ("in attention": every copy's attention forwards timed by
hooks of the script's own, plain ones included).

With ``--reference dtensor`` the reference's 4 heads run through DTensor's parallel styles on a
mesh of this rank alone (:func:`tensor_parallel.one_rank_mesh`: the same machinery as TP, nothing
split), so that TP's figure less that reference's is what the split costs the probe, apart from
what running beside DTensor costs any work.

Usage::

    python benchmarks/tensor_parallel_one_rank.py               # 40 steps a copy
    python benchmarks/tensor_parallel_one_rank.py --engines all --reference dtensor --steps 100
    python benchmarks/tensor_parallel_one_rank.py --engines all --layers 6 --seq-len 256
    python benchmarks/tensor_parallel_one_rank.py --steps 80 --engines entropy all
    python benchmarks/tensor_parallel_one_rank.py --steps 80 --engines stats sweep --sweep-mib 4
"""

from __future__ import annotations

import argparse
import datetime
import gc
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

from tensor_parallel import (
    ENGINES,
    VOCAB,
    Attention,
    Model,
    Size,
    engines,
    one_rank_mesh,
    parallelize,
)

from qkmonitor.engine import Monitoring
from qkmonitor.engine.spectrum_read import SpectrumRead
from qkmonitor.kernels import attention_stats
from qkmonitor.measures import metrics, sharding

#: process CPU seconds spent in the exchange of the split heads since the last :func:`step`
EXCHANGE = [0.0]
#: since the last :func:`step`: process CPU seconds in Python's cyclic collector, its collections
COLLECTOR = [0.0, 0]


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


def count_the_collector() -> None:
    """Add each collection's process CPU time to COLLECTOR (``gc.callbacks``). The collector runs
    when generation 0's count of container objects allocated and not freed passes its threshold
    (700): a TP forward keeps ~800 alive (DTensors, their specs, autograd's nodes of the parallel
    styles), the reference's ~70, so a probe's own objects tip TP's count over more often."""
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.process_time()
        else:
            COLLECTOR[0] += time.process_time() - started[0]
            COLLECTOR[1] += 1

    gc.callbacks.append(timed)


#: the last pack of split heads: its size and where each layer's offset lies in it
PACKED: dict = {"size": 0, "offsets": []}


def recording_offsets(pack):
    """``pack`` (``pack_heads``), noting its size and where each layer's offset lies in it."""

    def packed(parts):
        offsets, index = [], 0
        for placement, tensors in parts:  # per layer: its offset, then its tensors flattened
            offsets.append((index, placement))
            index += 1 + sum(t.numel() for t in tensors)
        PACKED.update(size=index, offsets=offsets)
        return pack(parts)

    return packed


#: the copy stepping now: its heads a rank (the shift from this rank's head slots to the other
#: rank's in each layer's block of slots) under TP, 0 for the reference (its ranks hold all heads)
SHIFT = [0]


def mirror_all_gather() -> None:
    """Make ``dist.all_gather`` fill the other rank's output (the fake group's call moves nothing)
    with what a rank 1 computing rank 0's values would send. Under TP: the sums' slots of rank 1's
    heads, which this rank leaves at their neutral value (0, or -inf for a maximum), filled from
    this rank's heads (each layer's block of slots holds rank 0's heads, then rank 1's), and the
    spectrum's heads with their offsets moved to rank 1's heads; for the reference, this rank's
    vector as it is. A few tensor ops a probe, paid by the TP copy alone (against it)."""
    fake, rank = dist.all_gather, dist.get_rank()
    sharding.pack_heads = recording_offsets(sharding.pack_heads)
    metrics.pack_heads = recording_offsets(metrics.pack_heads)

    def mirrored(outputs, tensor, *args, **kwargs):
        work = fake(outputs, tensor, *args, **kwargs)
        start = tensor.numel() - PACKED["size"]  # the pack ends the vector (reduce_across_ranks)
        theirs = tensor.clone()
        shift = SHIFT[0]
        if shift and start > shift:
            sums = tensor[:start]
            neutral = (sums == 0) | (sums == float("-inf"))
            fill = neutral[shift:] & ~neutral[:-shift]
            theirs[shift:start][fill] = sums[:-shift][fill]
        for index, placement in PACKED["offsets"]:
            theirs[start + index] = placement.offset + placement.count
        for other, output in enumerate(outputs):
            output.copy_(tensor if other == rank else theirs)
        PACKED.update(size=0, offsets=[])
        return work

    dist.all_gather = mirrored


def median_interval(values: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """The median of ``values`` and a distribution-free ~95 % interval of it: the order statistics
    ``k`` and ``n - 1 - k`` with ``k = floor(n / 2 - z sqrt(n) / 2)`` (the binomial count of
    values below the median, in its normal approximation)."""
    ordered = sorted(values)
    n = len(ordered)
    k = max(0, int(n / 2 - z * n**0.5 / 2))
    return statistics.median(ordered), ordered[k], ordered[n - 1 - k]


#: the arms: a second plain copy (the noise floor), a bare mode and the measuring alone (below),
#: each engine, all three
ARMS = ("plain2", "mode", "stats", *ENGINES, "all")


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


def measuring_alone(model: torch.nn.Module) -> None:
    """The "stats" arm: no monitor, but each attention's statistics computed by qkmonitor's own
    kernel (``attention_stats``, as AttentionEntropy's capture calls it) on the forward's q and k
    projections (before the rotary embedding: the attention call's shapes and work, not its
    numbers), just before ``o_proj`` (where the capture measures, at the attention call): the
    measuring's passes over memory, with no interception, capture or bookkeeping. Its TP -
    ref is what that work alone does to the TP forward around it (DTensor's dispatch that
    follows it, in ``o_proj``'s hooks and op, runs after those passes have gone through the
    CPU's caches)."""
    for module in model.modules():
        if isinstance(module, Attention):
            outputs: dict[str, torch.Tensor] = {}

            def keep(name: str, outputs=outputs):
                def kept(projection, args, output) -> None:  # after the style's to_local
                    outputs[name] = output.detach()

                return kept

            def measure(projection, args, module=module, outputs=outputs) -> None:
                b, t, _ = args[0].shape  # before the style's from_local: this rank's heads
                q, k = (
                    outputs.pop(name).view(b, t, -1, module.head_dim).transpose(1, 2)
                    for name in "qk"
                )
                attention_stats(q, k, causal=True)

            module.q_proj.register_forward_hook(keep("q"))
            module.k_proj.register_forward_hook(keep("k"))
            module.o_proj.register_forward_pre_hook(measure, prepend=True)


def sweeping(model: torch.nn.Module, mib: float) -> None:
    """The "sweep" arm (named only): no monitor and no statistics, but a pass over ``mib`` MiB of
    memory (written, then read) just before each attention's ``o_proj``: what any work of that
    size there does to the dispatch after it, whatever computes it. The "stats" arm's kernel
    holds two buffers of its call's scores (1 MiB each on this model)."""
    buffer = torch.empty(int(mib * 2**18))  # float32

    def sweep(projection, args) -> None:
        buffer.fill_(1.0)
        buffer.sum()

    for module in model.modules():
        if isinstance(module, Attention):
            module.o_proj.register_forward_pre_hook(sweep, prepend=True)


#: process CPU seconds spent inside the attention modules' forwards since the last :func:`step`
IN_ATTENTION = [0.0]


def timing_attention(model: torch.nn.Module) -> None:
    """Add the CPU time of each attention module's forward to IN_ATTENTION: from a pre-hook put
    first to a forward hook put before any a probe adds (the probe's own entering hook is inside,
    its leaving one outside)."""
    started: list[float] = []

    def enter(module, args) -> None:
        started.append(time.process_time())

    def leave(module, args, output) -> None:
        IN_ATTENTION[0] += time.process_time() - started.pop()

    for module in model.modules():
        if isinstance(module, Attention):
            module.register_forward_pre_hook(enter, prepend=True)
            module.register_forward_hook(leave, always_call=True)


def build(
    size: Size,
    split: bool,
    arm: str,
    sequences: int,
    sweep_mib: float = 2.0,
    reference: str = "plain",
) -> dict:
    """One copy: TP (``split``) or the reference's unsplit half, plain or monitored by ``arm``;
    the reference through DTensor on a mesh of this rank alone where ``reference`` is
    ``"dtensor"``."""
    torch.manual_seed(0)
    heads, hidden = (size.heads, size.hidden) if split else (size.heads // 2, size.hidden // 2)
    model = Model(size, heads, hidden)
    if split:
        parallelize(model)
    elif reference == "dtensor":
        parallelize(model, one_rank_mesh())
    timing_attention(model)
    if arm == "mode":
        under_passing_mode(model)
    if arm == "stats":
        measuring_alone(model)
    if arm == "sweep":
        sweeping(model, sweep_mib)
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
        "shift": size.heads // 2 if split else 0,
        "cpu": [],
        "phases": [],
        "exchange": [],
    }


#: the parts of a step, timed apart: the probe's opening (entering ``Monitoring.step``), the
#: forward, the backward, the update (the spectrum's copy before it), the probe's closing
PHASES = ("open", "forward", "backward", "update", "close")
#: the phases' table: the forward's part inside the attention modules beside the forward
REPORTED = ("open", "forward", "in attention", "backward", "update", "close")


def step(copy: dict, tokens: torch.Tensor) -> dict[str, float]:
    """One training step of ``copy``: its process CPU seconds in all (``"step"``) and in each of
    :data:`PHASES` (the exchange's in EXCHANGE)."""
    EXCHANGE[0] = IN_ATTENTION[0] = COLLECTOR[0] = 0.0
    COLLECTOR[1] = 0
    SHIFT[0] = copy["shift"]
    monitoring = copy["monitoring"]
    probe = monitoring.step(copy["n"]) if monitoring else nullcontext()
    marks = [time.process_time()]
    probe.__enter__()
    marks.append(time.process_time())
    logits = copy["model"](tokens[:, :-1])
    marks.append(time.process_time())
    F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    marks.append(time.process_time())
    copy["optimizer"].step()
    copy["optimizer"].zero_grad()
    marks.append(time.process_time())
    probe.__exit__(None, None, None)
    marks.append(time.process_time())
    copy["n"] += 1
    spent = {phase: b - a for phase, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True)}
    return {
        "step": marks[-1] - marks[0],
        **spent,
        "in attention": IN_ATTENTION[0],
        "collector": COLLECTOR[0],
        "collections": COLLECTOR[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps a copy")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=(*ARMS[1:], "sweep"),
        default=list(ARMS[1:]),
        help="the arms besides plain (sweep: only when named)",
    )
    parser.add_argument("--sweep-mib", type=float, default=2.0, help="the sweep arm's MiB")
    parser.add_argument("--max-probe-sequences", type=int, default=4, help="EffectiveRank's")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--reference",
        choices=("plain", "dtensor"),
        default="plain",
        help="the reference's 4 heads as plain modules (the bound's), or through DTensor on a "
        "mesh of this rank alone (what TP's split costs beyond DTensor's own machinery)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    mirror_all_gather()  # first: the exchange's count includes its bookkeeping
    count_the_exchange()
    count_the_collector()
    size = Size.of(args.layers, args.seq_len)
    arms = ("plain", "plain2", *args.engines)
    copies = {
        (split, arm): build(
            size, split, arm, args.max_probe_sequences, args.sweep_mib, args.reference
        )
        for split in (True, False)
        for arm in arms
    }
    order = list(copies)
    shuffle = torch.Generator().manual_seed(2)  # the copies' order at each step
    generator = torch.Generator().manual_seed(1)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no copy may take a warning path (the docstring)
        for i in range(args.warmup + args.steps):
            tokens = torch.randint(VOCAB, (size.batch, size.seq_len + 1), generator=generator)
            for key in [order[j] for j in torch.randperm(len(order), generator=shuffle)]:
                spent = step(copies[key], tokens)
                if i >= args.warmup:
                    copies[key]["cpu"].append(spent.pop("step"))
                    copies[key]["phases"].append(spent)
                    copies[key]["exchange"].append(EXCHANGE[0])
    print(
        f"\n{datetime.date.today()}, {platform.node() or 'this machine'}: {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, fake process group (rank 0 of 2), 1 thread; "
        f"{size.layers} layers, {size.seq_len} tokens; "
        f"{args.steps} steps a copy (+{args.warmup} warm-up), "
        f"{time.perf_counter() - started:.0f} s; the reference: "
        + ("plain modules" if args.reference == "plain" else "DTensor on a mesh of rank 0 alone")
    )
    print("probe cost a step, monitored - plain, process CPU ms: median (quartiles)")
    print("(exchange: the heads' exchange in the TP copy; beyond: each copy less its own;")
    print(" TP - ref beyond: step by step, median [95 % interval of the median], ms;")
    print(" mode: no monitor, a bare TorchFunctionMode around each attention forward)\n")
    print(
        "| arm | TP (4 of 8 heads) | reference (4 heads) | TP / ref | exchange | beyond / ref "
        "| TP - ref beyond |"
    )
    print("|---|---|---|---|---|---|---|")
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
        steps = [  # each copy's probe less its exchange (the reference's: its empty packs)
            [
                a - b - e
                for a, b, e in zip(
                    copies[(split, arm)]["cpu"],
                    copies[(split, "plain")]["cpu"],
                    copies[(split, arm)]["exchange"],
                    strict=True,
                )
            ]
            for split in (True, False)
        ]
        beyond = [statistics.median(each) for each in steps]
        excess = median_interval([t - r for t, r in zip(*steps, strict=True)])
        ratios = (
            ("", "")
            if arm == "plain2"
            else (f"{medians[0] / medians[1]:.3f}", f"{beyond[0] / beyond[1]:.3f}")
        )
        paired = f"{1e3 * excess[0]:+.2f} [{1e3 * excess[1]:+.2f}, {1e3 * excess[2]:+.2f}]"
        spent = sorted(copies[(True, arm)]["exchange"])
        exchange = (
            f"{1e3 * statistics.median(spent):.2f} ({1e3 * spent[n // 4]:.2f}, "
            f"{1e3 * spent[3 * n // 4]:.2f})"
        )
        print(
            f"| {arm} | {cells[0]} | {cells[1]} | {ratios[0]} | {exchange} | {ratios[1]} "
            f"| {paired} |"
        )
    print("\nwhere TP's probe costs more than the reference's: each phase, TP - ref of monitored -")
    print(
        "plain, step by step, median [95 % interval], ms (close: the exchange's TP - ref apart)\n"
    )
    print(f"| arm | {' | '.join(REPORTED)} | of which the exchange |")
    print(f"|---|{'---|' * len(REPORTED)}---|")
    for arm in arms[2:]:
        cells = []
        for phase in REPORTED:
            excess = [
                (tm[phase] - tp[phase]) - (rm[phase] - rp[phase])
                for tm, tp, rm, rp in zip(
                    copies[(True, arm)]["phases"],
                    copies[(True, "plain")]["phases"],
                    copies[(False, arm)]["phases"],
                    copies[(False, "plain")]["phases"],
                    strict=True,
                )
            ]
            middle, low, high = median_interval(excess)
            cells.append(f"{1e3 * middle:+.2f} [{1e3 * low:+.2f}, {1e3 * high:+.2f}]")
        exchanged = [
            t - r
            for t, r in zip(
                copies[(True, arm)]["exchange"], copies[(False, arm)]["exchange"], strict=True
            )
        ]
        cells.append(f"{1e3 * statistics.median(exchanged):+.2f}")
        print(f"| {arm} | {' | '.join(cells)} |")
    print("\nPython's cyclic collector in each copy: collections a step and their CPU ms a step,")
    print("means (a collection falls in some steps only: its median is 0)\n")
    print("| copy | TP (4 of 8 heads) | reference (4 heads) |")
    print("|---|---|---|")
    for arm in arms:
        cells = []
        for split in (True, False):
            phases = copies[(split, arm)]["phases"]
            count = statistics.mean(p["collections"] for p in phases)
            spent = statistics.mean(p["collector"] for p in phases)
            cells.append(f"{count:.2f}, {1e3 * spent:.2f}")
        print(f"| {arm} | {cells[0]} | {cells[1]} |")
    for split in (True, False):
        plain = statistics.median(copies[(split, "plain")]["cpu"])
        print(f"\nplain step, {'TP' if split else 'reference'}: {1e3 * plain:.1f} ms CPU", end="")
    print()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
