"""What a probe costs each rank under tensor parallelism, against one process's probe of the same
heads, side by side (issue 42, item 5).

Two gloo ranks on the CPU (one torch thread each) train a LLaMA-style decoder (RMSNorm, rotary
embeddings, causal SDPA, SwiGLU MLP; 4 layers, d = 256, 8 heads of 32, 128 tokens a sequence,
batch 4 by default) in a plain loop. Six copies of it, each with its optimizer, in three kinds:

- **TP** (under the process group over the two ranks): two copies of the model, parallelized
  (``ColwiseParallel`` on q_proj, k_proj, v_proj and the MLP's gate and up projections,
  ``RowwiseParallel`` on o_proj and down), so that each rank computes H / 2 of the heads: (a) no
  monitor, (b) QKSpectrum, AttentionEntropy and EffectiveRank at their defaults with
  ``per_head=True``, through :class:`~qkmonitor.engine.Monitoring` at ``every_n_steps=1`` (every
  step is a probe: the activation engines measure its forward, the spectrum reads the weights
  after its update).
- **DDP** (under the same process group, the model unsplit): the reference the bound names, one
  process's probe of the same local heads plus the one collective a probe makes under data
  parallelism. Two copies of the model one rank computes (H / 2 heads of the same width, half the
  MLP), unparallelized, on both ranks: (c) the same monitors, (d) none. The monitors see two
  data-parallel ranks, so their sums meet in one ``all_gather`` a probe, as under DDP (the
  gradients are not averaged: no monitor reads them across ranks, and the plain copy would pay
  the same); EffectiveRank deals its ``max_probe_sequences`` over the two replicas, so that copy
  is given twice as many and each rank measures as many sequences as under TP.
- **alone** (no process group: ``torch.distributed`` is not initialized): the same two copies as
  DDP, (e) monitored and (f) not, with no collective at all; printed beside, for scale.

A round is two phases, their order alternating over rounds: the grouped phase, in which the four
TP and DDP copies take a step each in turn at every step (the order rotating, so that each copy
takes each place as often), and the phase alone. So a slow spell of this shared machine falls on
TP and on its reference alike, and the ratio of the two compares steps taken side by side. Both
ranks run every phase at the same time. All copies train on the same batches; each monitored
step is paired with its plain copy's same step. Models and ``Monitoring`` are built anew in each
phase, and its first ``--warmup`` steps (discovery, layout checks, first calls) are left out.
There is no writer (``writer=None``): a probe is the measuring, the reduction across ranks and the
alert rules, not the logging, which under TP only rank 0 would do.

EffectiveRank's ``max_probe_sequences`` is dealt over the data-parallel replicas (one under TP:
both ranks compute the same sequences; two for the DDP copies, which are given twice as many), so
each rank measures as many sequences in every copy; ``--max-probe-sequences`` sets it (per rank).

Printed per rank, medians over rounds of each kind's median paired difference: the probe's cost
per step under TP, (b) − (a), the reference's, (c) − (d), and one process's alone, (e) − (f), in
wall time and in the process's CPU time (``time.process_time``: all its threads, gloo's and
qkmonitor's included), and the ratios of TP's to each. Then the collectives a step makes under TP
and in the DDP copies, counted on ``--count-steps`` extra steps of each copy at the dispatcher (a
``TorchDispatchMode`` that sees every ``c10d`` and ``_c10d_functional`` op: ``torch.distributed``'s
calls and DTensor's): per step, in the unmonitored arm (TP's own, in the forward and backward), in
the monitored arm, and of those the ones made with qkmonitor on the Python stack (its own; the
difference of the two arms should be the same).

Usage::

    python benchmarks/tensor_parallel.py                  # 3 rounds x 12 steps an arm
    python benchmarks/tensor_parallel.py --max-probe-sequences 2   # fewer probe sequences
    python benchmarks/tensor_parallel.py --rounds 5 --steps 20 --json tp.json
    python benchmarks/tensor_parallel.py --profile DIR    # cProfile (CPU time), monitored copies
    python benchmarks/tensor_parallel.py --engines entropy   # one engine: whose the excess is
    python benchmarks/tensor_parallel.py --reference dtensor  # the DDP copies through DTensor
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.engine.rank import MAX_PROBE_SEQUENCES

WORLD = 2
VOCAB = 512


@dataclass(frozen=True)
class Size:
    """The model and batch (``heads`` and ``hidden`` over all ranks)."""

    layers: int
    d_model: int
    heads: int
    head_dim: int
    hidden: int
    seq_len: int
    batch: int

    @classmethod
    def of(cls, layers: int = 4, seq_len: int = 128) -> Size:
        """The one-rank benchmarks' model (d 256, 8 heads of 32, MLP 512, batch 4) at ``layers``
        and ``seq_len``."""
        return cls(layers, 256, 8, 32, 512, seq_len, 4)


# -- the model: LLaMA-style, its head count read from the projections' output (as under TP) -----


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half) of ``(B, H, N, D)`` heads at positions 0..N-1."""
    half = x.shape[-1] // 2
    positions = torch.arange(x.shape[-2], dtype=torch.float32)
    angle = positions[:, None] * 10000.0 ** (-torch.arange(half) / half)  # (N, D/2)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(d_model, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: the heads this rank computes (all of them in one process)
        q = rope(self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2))  # (B, H, N, D)
        k = rope(self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2))
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, size: Size, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(size.d_model)
        self.attn = Attention(size.d_model, heads, size.head_dim)
        self.mlp_norm = nn.RMSNorm(size.d_model)
        self.mlp = MLP(size.d_model, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(self, size: Size, heads: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, size.d_model)
        self.layers = nn.ModuleList([Block(size, heads, hidden) for _ in range(size.layers)])
        self.norm = nn.RMSNorm(size.d_model)
        self.head = nn.Linear(size.d_model, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def parallelize(model: Model, mesh=None) -> None:
    """Tensor parallelism over every rank (or over ``mesh``): attention and MLP split by output
    features, then input features."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if mesh is None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {
        **{f"attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "attn.o_proj": RowwiseParallel(),
        **{f"mlp.{p}": ColwiseParallel() for p in ("gate", "up")},
        "mlp.down": RowwiseParallel(),
    }
    for layer in model.layers:
        parallelize_module(layer, mesh, plan)


def one_rank_mesh():
    """Each rank's own mesh of one rank (the size-1 dim of a WORLD × 1 mesh): the DDP copies
    through DTensor's styles and dispatch with nothing split (``--reference dtensor``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    return mesh["tp"]


# -- counting the collectives -------------------------------------------------------------------

#: dispatcher ops of those namespaces that move no data
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}


class CollectiveCounter(TorchDispatchMode):
    """Counts the collective ops dispatched while it is entered (``torch.distributed``'s
    ``c10d.*`` and DTensor's ``_c10d_functional.*``), by op and by the innermost Python frame
    outside torch that led to it (``file:function``): qkmonitor's own calls, or the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") and func._opname not in _NOT_COLLECTIVES:
            torch_dir = os.path.dirname(torch.__file__)
            stack = traceback.extract_stack()[:-1]  # without this frame
            caller = next(f for f in reversed(stack) if not f.filename.startswith(torch_dir))
            parts = Path(caller.filename).parts
            path = "/".join(
                parts[parts.index("qkmonitor") :] if "qkmonitor" in parts else parts[-1:]
            )
            place = f"{path}:{caller.name}"
            self.calls[func._opname, place] += 1
        return func(*args, **(kwargs or {}))


# -- one phase ----------------------------------------------------------------------------------


#: the engines ``--engines`` chooses from, by name
ENGINES = ("spectrum", "entropy", "rank")


def engines(names: Sequence[str], max_probe_sequences: int) -> list:
    """The engines named (of :data:`ENGINES`) at their defaults, per head, but EffectiveRank's
    ``max_probe_sequences``."""
    made = {
        "spectrum": lambda: QKSpectrum(per_head=True),
        "entropy": lambda: AttentionEntropy(per_head=True),
        "rank": lambda: EffectiveRank(per_head=True, max_probe_sequences=max_probe_sequences),
    }
    return [made[name]() for name in names]


class Arm:
    """One copy of the model, its optimizer and (the monitored arm) its ``Monitoring``."""

    def __init__(
        self, model: Model, monitored: bool, names: Sequence[str], max_probe_sequences: int
    ) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.monitoring = (
            Monitoring(
                model,
                engines(names, max_probe_sequences),
                every_n_steps=1,
                optimizer=self.optimizer,
            )
            if monitored
            else None
        )
        self.steps = 0
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def step(self, tokens: torch.Tensor, timed: bool = True) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        probe = self.monitoring.step(self.steps) if self.monitoring else nullcontext()
        with probe:
            logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
        if timed:
            self.cpu.append(time.process_time() - cpu)
            self.wall.append(time.perf_counter() - wall)
        self.steps += 1

    def close(self) -> None:
        if self.monitoring is not None:
            self.monitoring.close()


def gathered_sizes(arm: Arm, tokens: torch.Tensor) -> list[int]:
    """The sizes (elements) of the ``dist.all_gather`` calls one probe step of ``arm`` makes."""
    sizes: list[int] = []
    original = dist.all_gather

    def recording(tensor_list, tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return original(tensor_list, tensor, *args, **kwargs)

    dist.all_gather = recording
    try:
        arm.step(tokens, timed=False)
    finally:
        dist.all_gather = original
    return sizes


def collective_cost(sizes: list[int], repeats: int = 30) -> tuple[float, float]:
    """Median wall and CPU seconds of the ``all_gather`` calls of ``sizes`` (float64) on their
    own, as ``reduce_across_ranks`` makes them: the "one collective per probe" the bound allows."""
    world = dist.get_world_size()
    tensors = [torch.zeros(n, dtype=torch.float64) for n in sizes]
    walls, cpus = [], []
    for _ in range(repeats):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for flat in tensors:
            dist.all_gather([torch.empty_like(flat) for _ in range(world)], flat)
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return statistics.median(walls), statistics.median(cpus)


#: what each kind of arm runs: whether the model is split by heads, whether it needs the process
#: group; the kinds that need it step together, the other apart
KINDS = {"tp": (True, True), "ddp": (False, True), "local": (False, False)}


def run_phase(
    args, size: Size, kinds: tuple[str, ...], count: bool, profile: Path | None
) -> dict[str, dict]:
    """Trains the plain and the monitored copy of each of ``kinds`` (:data:`KINDS`) step for step,
    all of them in turn at each step (the order rotating), so that a slow spell of the machine
    falls on every kind alike. Returns by kind the per-step excess of its monitored copy (its time
    less its plain copy's, step by step, after the warm-up) and its plain copy's median step, in
    wall and CPU seconds; the collective a probe makes, timed alone; and with ``count`` the
    collectives a step of each copy makes. ``profile``: cProfile stats of each kind's monitored
    steps, to ``{profile}_{kind}.prof``."""
    arms: dict[str, tuple[Arm, Arm]] = {}
    for kind in kinds:
        parallel, grouped = KINDS[kind]
        # TP: the whole model, split by parallelize; otherwise the part one rank computes
        split = 1 if parallel else WORLD
        sequences = args.max_probe_sequences or MAX_PROBE_SEQUENCES  # per rank
        if grouped and not parallel:  # dealt over the two data-parallel replicas
            sequences *= WORLD
        pair = []
        for monitored in (False, True):
            torch.manual_seed(0)
            model = Model(size, size.heads // split, size.hidden // split)
            if parallel:
                parallelize(model)
            elif grouped and args.reference == "dtensor":
                parallelize(model, one_rank_mesh())
            pair.append(Arm(model, monitored, args.engines, sequences))
        arms[kind] = (pair[0], pair[1])
    order = [(kind, arm) for kind in kinds for arm in arms[kind]]
    profilers = {kind: cProfile.Profile(time.process_time) for kind in kinds} if profile else {}
    batches = torch.randint(
        0, VOCAB, (4, size.batch, size.seq_len + 1), generator=torch.Generator().manual_seed(1)
    )
    out: dict[str, dict] = {}
    try:
        for i in range(args.warmup + args.steps):
            tokens, timed = batches[i % len(batches)], i >= args.warmup
            for kind, arm in order[i % len(order) :] + order[: i % len(order)]:
                profiler = profilers.get(kind) if arm.monitoring and timed else None
                if profiler:
                    profiler.enable()
                arm.step(tokens, timed)
                if profiler:
                    profiler.disable()
        for kind, (plain, probed) in arms.items():
            collective = (0.0, 0.0)
            if KINDS[kind][1]:
                collective = collective_cost(gathered_sizes(probed, batches[0]))
            counts = {}
            if count:
                for name, arm in (("plain", plain), ("monitored", probed)):
                    counter = CollectiveCounter()
                    with counter:
                        for i in range(args.count_steps):
                            arm.step(batches[i % len(batches)], timed=False)
                    counts[name] = [
                        [op, place, n / args.count_steps]
                        for (op, place), n in counter.calls.items()
                    ]
            out[kind] = {
                "cost_wall": statistics.median(b - a for a, b in zip(plain.wall, probed.wall)),
                "cost_cpu": statistics.median(b - a for a, b in zip(plain.cpu, probed.cpu)),
                "plain_wall": statistics.median(plain.wall),
                "plain_cpu": statistics.median(plain.cpu),
                "counts": counts,
                "collective_wall": collective[0],
                "collective_cpu": collective[1],
            }
    finally:
        for arm in (arm for _, arm in order):
            arm.close()
    for kind, profiler in profilers.items():
        profiler.dump_stats(f"{profile}_{kind}.prof")
    return out


def rank_main(rank: int, args, store_dir: str) -> None:
    """One rank: ``--rounds`` rounds of the grouped phase (TP and DDP, under the process group)
    and the local one (no process group), their order alternating; saves its figures to
    ``store_dir/rank_RANK.json``."""
    torch.set_num_threads(1)
    size = Size(args.layers, args.d_model, args.heads, args.head_dim, args.hidden, args.seq_len,
                args.batch)  # fmt: skip
    phases: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    grouped = tuple(kind for kind, (_, needs_group) in KINDS.items() if needs_group)
    alone = tuple(kind for kind in KINDS if kind not in grouped)
    for r in range(args.rounds):
        for kinds in (grouped, alone) if r % 2 == 0 else (alone, grouped):
            name = "_".join(kinds)
            profile = Path(args.profile) / f"rank{rank}_round{r}" if args.profile else None
            if kinds is grouped:
                dist.init_process_group("gloo", init_method=f"file://{store_dir}/store_{r}_{name}",
                                        rank=rank, world_size=WORLD)  # fmt: skip
            try:
                for kind, result in run_phase(args, size, kinds, r == 0, profile).items():
                    phases[kind].append(result)
            finally:
                if kinds is grouped:
                    dist.destroy_process_group()
    Path(store_dir, f"rank_{rank}.json").write_text(json.dumps(phases))


# -- the report ---------------------------------------------------------------------------------


#: what a phase returns that the report takes the median of, over rounds
KEYS = ("cost_wall", "cost_cpu", "plain_wall", "plain_cpu", "collective_wall", "collective_cpu")


def figures(phases: dict[str, list[dict]]) -> dict[str, float | list[float]]:
    """Medians over rounds, and the ratios of TP's probe cost to the reference's (the DDP copies:
    one process's probe of the same heads and its one collective) and to one process's alone (of
    the medians, and round by round against the reference)."""

    def med(name: str, key: str) -> float:
        return statistics.median(p[key] for p in phases[name])

    out: dict[str, float | list[float]] = {f"{n}_{k}": med(n, k) for n in KINDS for k in KEYS}
    for clock in ("wall", "cpu"):
        tp = out[f"tp_cost_{clock}"]
        out[f"ratio_{clock}"] = tp / out[f"ddp_cost_{clock}"]
        out[f"alone_ratio_{clock}"] = tp / out[f"local_cost_{clock}"]
        out[f"ratio_{clock}_rounds"] = [
            t[f"cost_{clock}"] / d[f"cost_{clock}"] for t, d in zip(phases["tp"], phases["ddp"])
        ]
    return out


def report(args, size: Size, ranks: list[dict], seconds: float) -> dict:
    """Prints the machine, the model, the table of figures per rank and the collectives."""
    print(
        f"\n{datetime.date.today()}, {platform.node() or 'host'}: {os.cpu_count()} CPUs "
        f"(nproc {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f}), "
        f"torch {torch.__version__}, gloo, {WORLD} ranks x 1 thread; {args.rounds} rounds x "
        f"{args.steps} steps an arm (+{args.warmup} warm-up); {seconds:.0f} s in all; the DDP "
        f"copies' heads: {'plain modules' if args.reference == 'plain' else 'through DTensor'}"
    )
    sequences = args.max_probe_sequences or MAX_PROBE_SEQUENCES
    print(
        f"model: {size.layers} layers, d {size.d_model}, {size.heads} heads of {size.head_dim} "
        f"({size.heads // WORLD} a rank), MLP {size.hidden}, sequence {size.seq_len}, "
        f"batch {size.batch}; engines {', '.join(args.engines)} (per_head; rank: {sequences} "
        f"probe sequences a rank), every_n_steps=1, no writer; medians over rounds\n"
    )
    rows = [figures(phases) for phases in ranks]
    print("| rank | plain step, TP / DDP / alone | probe, TP (b − a) | probe, local heads + "
          "collective, DDP (c − d) | probe, local heads alone (e − f) | **TP / DDP**, wall | "
          "**TP / DDP**, CPU | by round, wall / CPU | TP / alone, wall / CPU | the all_gather "
          "alone, TP / DDP |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rank, f in enumerate(rows):
        by_round = ", ".join(
            f"{w:.2f} / {c:.2f}" for w, c in zip(f["ratio_wall_rounds"], f["ratio_cpu_rounds"])
        )

        def ms(key: str, f: dict = f) -> str:
            return f"{f[key + '_wall'] * 1e3:.1f} ms (CPU {f[key + '_cpu'] * 1e3:.1f})"

        plain = " / ".join(f"{f[n + '_plain_wall'] * 1e3:.0f}" for n in KINDS)
        plain_cpu = " / ".join(f"{f[n + '_plain_cpu'] * 1e3:.0f}" for n in KINDS)
        print(
            f"| {rank} | {plain} ms (CPU {plain_cpu}) | {ms('tp_cost')} | {ms('ddp_cost')} "
            f"| {ms('local_cost')} | **{f['ratio_wall']:.2f}** | **{f['ratio_cpu']:.2f}** "
            f"| {by_round} | {f['alone_ratio_wall']:.2f} / {f['alone_ratio_cpu']:.2f} "
            f"| {f['tp_collective_wall'] * 1e3:.2f} / {f['ddp_collective_wall'] * 1e3:.2f} ms |"
        )
    print_counts({name: ranks[0][name][0]["counts"] for name in KINDS})
    return {"size": asdict(size), "ranks": rows, "raw": ranks}


def print_counts(counts: dict[str, dict[str, list]]) -> None:
    """The collectives a step makes in each phase, by op, in each arm; the difference; and under
    TP those whose innermost caller outside torch is qkmonitor's code."""

    def by_op(rows: list) -> Counter[str]:
        out: Counter[str] = Counter()
        for op, _, n in rows:
            out[op] += n
        return out

    for name, label in (("tp", "under TP"), ("ddp", "in the DDP copies")):
        plain, monitored = by_op(counts[name]["plain"]), by_op(counts[name]["monitored"])
        added = {
            op: monitored[op] - plain[op] for op in monitored | plain if monitored[op] != plain[op]
        }
        print(f"\ncollectives a step {label} (rank 0, counted at the dispatcher):")
        print(f"  no monitor: {sum(plain.values()):g} {dict(plain)}")
        print(f"  monitored:  {sum(monitored.values()):g} {dict(monitored)}")
        print(f"  added by the monitors: {sum(added.values()):g} a probe step {added}")
        for op, place, n in sorted(counts[name]["monitored"], key=lambda row: row[1]):
            if place.startswith("qkmonitor/"):
                passed = " (the model's own call, passed through)" if op in plain else ""
                print(f"    {n:g} {op} called from {place}{passed}")
    alone = by_op(counts["local"]["monitored"])
    print(f"\none process (no process group), monitored: {sum(alone.values()):g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="timed steps an arm in a phase")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--count-steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512, help="the MLP's width, all ranks")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--max-probe-sequences",
        type=int,
        help="EffectiveRank's, per rank (its default where not given)",
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=list(ENGINES),
        help="the monitored copies' engines (default: all three)",
    )
    parser.add_argument(
        "--reference",
        choices=("plain", "dtensor"),
        default="plain",
        help="the DDP copies' heads as plain modules (the bound's reference), or through DTensor "
        "on a mesh of each rank alone (what TP's split costs beyond DTensor's own machinery)",
    )
    parser.add_argument("--profile", help="a folder for cProfile stats of the monitored steps")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.heads % WORLD or args.hidden % WORLD:
        parser.error(f"`--heads` and `--hidden` must be multiples of {WORLD}")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    size = Size(args.layers, args.d_model, args.heads, args.head_dim, args.hidden, args.seq_len,
                args.batch)  # fmt: skip
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as store_dir:
        # rank 1 in a spawned process, rank 0 in this one
        other = mp.get_context("spawn").Process(target=rank_main, args=(1, args, store_dir))
        other.start()
        try:
            rank_main(0, args, store_dir)
        finally:
            other.join(timeout=600)
        if other.exitcode != 0:
            raise SystemExit(f"rank 1 failed (exit code {other.exitcode})")
        ranks = [json.loads(Path(store_dir, f"rank_{r}.json").read_text()) for r in range(WORLD)]
    result = report(args, size, ranks, time.perf_counter() - start)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
