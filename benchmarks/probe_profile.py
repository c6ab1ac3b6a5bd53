"""Where a probe's time goes: by phase and by engine, on the host and on the device, with the
training thread's blocking reads (``python benchmarks/overhead.py --profile``).

One Lightning fit with the three monitors every ``--every`` steps (default 10 here). Two windows of
two batches each are profiled with ``torch.profiler``, both after a first probe has warmed the
code up:

- **probe**: the batch before the second probe (the spectrum copies the rows the update moves,
  then reads the weights at its end) and the probe batch (the activation probes measure its
  forward, close, record and publish);
- **plain**: two batches no monitor touches, later in the same run: the reference.

Each monitor callback's hooks and each engine part of ``overhead.PARTS`` run inside a
``record_function`` range, so the profile says, per range, the host time (CPU, inclusive) and the
device time of the kernels it launched (on CUDA). The blocking reads of each window are counted on
the training thread by :class:`host_reads.HostReads` (any device), attributed to the monitor whose
hook made them, or to the training step itself (the probes inside the model's forward and
backward); on CUDA the profile's own count of the runtime's synchronizing calls
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, ``cudaMemcpy``)
is printed beside it.

    python benchmarks/overhead.py --profile --steps 30
    python benchmarks/overhead.py --profile --device cuda --model gpt2-small \\
        --precision bf16-mixed --steps 30
"""

from __future__ import annotations

import importlib
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from host_reads import HostReads
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["WindowProfile", "profile_probe", "report_profile"]

#: The runtime calls that make the host wait for the device.
SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
)
STEP = "the training step (forward, backward, optimizer)"


@dataclass
class WindowProfile:
    """One profiled window: wall seconds, per range (host s, device s, calls), blocking reads by
    where they were made, and the runtime's synchronizing calls (CUDA only)."""

    wall: float = 0.0
    ranges: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    reads: Counter = field(default_factory=Counter)
    read_kinds: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    device_busy: float = 0.0


class _Labelled:
    """The monitors' hooks and the engine parts wrapped in ``record_function`` ranges; each hook
    also books the blocking reads it makes to its monitor."""

    def __init__(self, callbacks: list[pl.Callback], parts: tuple, state: dict) -> None:
        self.undo: list[tuple[object, str, object]] = []
        self.state = state
        for callback in callbacks:
            name = type(callback).__name__
            for hook in ("on_train_batch_start", "on_train_batch_end", "on_before_optimizer_step"):
                self._wrap(callback, hook, f"monitor {name}", monitor=name)
        for module_name, qualified in parts:
            owner = importlib.import_module(module_name)
            *path, attr = qualified.split(".")
            for name in path:
                owner = getattr(owner, name)
            self._wrap(owner, attr, f"part {qualified}", monitor=None)

    def _wrap(self, owner, attr: str, label: str, monitor: str | None) -> None:
        original = getattr(owner, attr)
        state, who = self.state, monitor

        def labelled(*args, **kwargs):
            reads: HostReads | None = state.get("reads")
            before = reads.owned if reads is not None and who else 0
            with record_function(label):
                try:
                    return original(*args, **kwargs)
                finally:
                    if reads is not None and who:
                        state["by_monitor"][who] += reads.owned - before

        setattr(owner, attr, labelled)
        self.undo.append((owner, attr, original))

    def remove(self) -> None:
        for owner, attr, original in reversed(self.undo):
            if isinstance(owner, type) or not hasattr(type(owner), attr):
                setattr(owner, attr, original)
            else:  # an instance's bound hook: drop the attribute, the class's method shows again
                delattr(owner, attr)


class _Windows(pl.Callback):
    """Starts and stops the profiler and the read counter at batch boundaries (first in the
    callback list, so a window holds every other callback's hooks of its batches)."""

    def __init__(self, windows: dict[str, tuple[int, int]], device: str, state: dict) -> None:
        self.windows, self.device, self.state = windows, device, state
        self.seen = 0
        self.open: tuple[str, profile, ExitStack, float] | None = None
        self.results: dict[str, WindowProfile] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        index, self.seen = self.seen, self.seen + 1
        if self.open is not None and index == self.windows[self.open[0]][1]:
            self._stop()
        for name, (start, _) in self.windows.items():
            if index == start:
                self._start(name)

    def on_train_end(self, trainer, pl_module):
        if self.open is not None:
            self._stop()

    def _synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _start(self, name: str) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._synchronize()
        stack = ExitStack()
        prof = stack.enter_context(profile(activities=activities))
        reads = stack.enter_context(HostReads())
        self.state["reads"], self.state["by_monitor"] = reads, Counter()
        self.open = (name, prof, stack, time.perf_counter())

    def _stop(self) -> None:
        name, prof, stack, start = self.open
        self._synchronize()
        wall = time.perf_counter() - start
        reads: HostReads = self.state.pop("reads")
        stack.close()
        self.open = None
        by_monitor = self.state.pop("by_monitor")
        result = WindowProfile(wall=wall, read_kinds=Counter(reads.kinds))
        result.reads.update(by_monitor)
        result.reads[STEP] = reads.owned - sum(by_monitor.values())
        for event in prof.key_averages():
            device = getattr(event, "device_time_total", 0.0) / 1e6
            if event.key.startswith(("monitor ", "part ")):
                result.ranges[event.key] = (event.cpu_time_total / 1e6, device, event.count)
            if event.key in SYNC_CALLS:
                result.syncs[event.key] += event.count
            result.device_busy += getattr(event, "self_device_time_total", 0.0) / 1e6
        self.results[name] = result


def profile_probe(args, every: int = 10) -> dict[str, WindowProfile]:
    """Profile the probe window and a plain window of one fit (see the module's docstring)."""
    overhead = importlib.import_module("overhead")
    from lightning.pytorch.loggers import TensorBoardLogger

    if every < 5:  # the plain window must sit between the second probe and the third's batches
        raise ValueError(f"Expected `--every` >= 5 for --profile, got {every}")
    if args.steps < 3 * every:
        raise ValueError(f"Expected `--steps` >= {3 * every} for --profile, got {args.steps}")
    pl.seed_everything(0, verbose=False)
    task, data = overhead.task_and_data(args.model, args.steps, args.arch)
    state: dict = {}
    # the second probe (step `every`) and its previous batch; then two batches nobody touches
    windows = {"probe": (every - 1, every + 1), "plain": (every + 2, every + 4)}
    clock = _Windows(windows, args.device, state)
    callbacks = overhead.monitors((every, overhead.VISUALS_EVERY))
    labelled = _Labelled(callbacks, overhead.PARTS, state)
    try:
        with tempfile.TemporaryDirectory() as log_root:
            trainer = pl.Trainer(max_steps=args.steps, accelerator=args.device, devices=1,
                                 precision=args.precision, logger=TensorBoardLogger(log_root),
                                 callbacks=[clock, *callbacks], enable_progress_bar=False,
                                 enable_model_summary=False, enable_checkpointing=False,
                                 limit_val_batches=0, log_every_n_steps=50)  # fmt: skip
            trainer.fit(task, datamodule=data)
    finally:
        labelled.remove()
    return clock.results


def report_profile(results: dict[str, WindowProfile], device: str) -> None:
    """Print the probe window against the plain one, range by range."""
    probe, plain = results["probe"], results["plain"]
    print(
        f"  probe window (2 batches) {probe.wall * 1e3:.1f} ms, plain window (2 batches) "
        f"{plain.wall * 1e3:.1f} ms: the probe costs {(probe.wall - plain.wall) * 1e3:+.1f} ms, "
        f"{(probe.wall - plain.wall) / (plain.wall / 2):.2f} plain steps"
    )
    if device == "cuda":
        print(
            f"  device busy: probe {probe.device_busy * 1e3:.1f} ms, "
            f"plain {plain.device_busy * 1e3:.1f} ms"
        )
    title = "range (inclusive; parts nest in monitors)"
    print(f"  {title:58s} {'host ms':>8s} {'device ms':>9s} calls")
    for key, (host, dev, calls) in sorted(probe.ranges.items(), key=lambda kv: -kv[1][0]):
        print(f"  {key:58s} {host * 1e3:8.2f} {dev * 1e3:9.2f} {calls:5d}")
    print("  blocking reads on the training thread (the monitors'; HostReads, any device):")
    for who, count in probe.reads.most_common():
        print(f"    {count:4d}  {who}")
    print(f"    plain window: {sum(plain.reads.values())}")
    kinds = ", ".join(f"{k} {n}" for k, n in probe.read_kinds.most_common())
    print(f"    by kind (all reads in the window, the model's too): {kinds}")
    if device == "cuda":
        for name, window in (("probe", probe), ("plain", plain)):
            calls = ", ".join(f"{k} {n}" for k, n in window.syncs.most_common()) or "none"
            print(f"  synchronizing runtime calls, {name} window: {calls}")
