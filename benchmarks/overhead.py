"""Training steps per second with the monitors on, against none, on a bundled or a nanoGPT-style
model.

Four configurations run interleaved, several rounds each, so machine noise hits them alike: no
monitor; all three monitors at ``every_n_steps=50`` with their defaults (visuals at every 20th
probe); the same with visuals at every probe (to measure what drawing costs); all three at every
step. Each batch is timed from its start to the next one's (on CUDA the device is synchronized
there), so a batch's time holds every callback's work at its start and end. Printed per
configuration (medians over rounds):

- **steady state, between runs**: steps/s over batches 1..N-1 and the overhead against the
  no-monitor run. Batch 0 is left out everywhere: it carries first-call costs with or without
  monitors. On a shared or virtual CPU the plain step time drifts by several percent from one run
  to the next, more than the monitors cost at ``every_n_steps=50``; hence the in-run figures:
- **per probe window, in-run**: the time the batches a monitor works in (the activation probes'
  and the spectrum's) and the three after each probe (the visuals are drawn on a background thread
  while they train) take beyond the median untouched batch *of the same run*, less what the same
  batches take beyond the median in the no-monitor run (Lightning's own periodic logging lands on
  them too), per window;
- **hooks, untouched**: the monitors' own hook time on the batches they do not probe, the mean
  per batch (timed directly around the hooks; batches counted in the run's order);
- **in-run overhead**: window cost spread over ``every_n_steps`` untouched batches, plus the hooks;
  for the defaults, also the visuals' extra cost (the visuals configuration's window cost minus the
  default one's) spread over ``visuals_every_n_probes`` windows — the figure a long run pays;
- **one-time**: the monitors' setup (binding, the layout and hparams header: from the Trainer's
  ``setup`` to the first batch, against no monitor) and the extra time of the first window;
- **unprobed step**: one line per run stating what a step the monitors do not probe costs: the
  median no-monitor step, and the defaults' hooks on an untouched batch against it.

Models (``--model``):

- ``default``: ``qkmonitor train``'s default model and task (associative recall), the CPU figure.
- ``gpt2-small``: a GPT-2-small-sized decoder (12 layers, d = 768, 12 heads of 64, 1024 tokens a
  sequence, batch 8) on bytes of the Python standard library's source (``PythonSourceDataModule``,
  nothing downloaded); with ``--device cuda --precision bf16-mixed`` its attention runs the
  Triton kernel under autocast.

Architectures (``--arch``), each at either size above:

- ``bundled``: qkmonitor's own ``DecoderLM`` (``CausalLMTask`` / ``CharLMTask``), whose attention
  hands the monitors its kernel's statistics.
- ``nanogpt``: a nanoGPT-style decoder (``benchmarks/nanogpt.py``: token embedding + learned
  positions, blocks of LayerNorm, ``CausalSelfAttention`` with one fused ``c_attn`` and
  ``F.scaled_dot_product_attention(..., is_causal=True)``, GELU MLP, tied LM head) with the same
  d_model, layers, heads, MLP width, sequence length, batch, data, optimizer and warmup. Nothing
  in it knows qkmonitor: the monitors discover it and measure by interception.

Usage::

    python benchmarks/overhead.py                 # 300 steps x 3 rounds, CPU
    python benchmarks/overhead.py --steps 100 --rounds 2
    python benchmarks/overhead.py --arch nanogpt --steps 100 --rounds 2
    python benchmarks/overhead.py --device cuda --model gpt2-small --precision bf16-mixed \\
        --steps 60 --rounds 1 --warmup-steps 4 --json overhead.json
    python benchmarks/overhead.py --dry-run       # arguments and report only, nothing trained
    python benchmarks/overhead.py --arch nanogpt --qk-clip   # also what QKClip costs
    # two copies stepped side by side in one loop, one monitored (drift cancelled)
    python benchmarks/overhead.py --side-by-side --steps 1000
    python benchmarks/overhead.py --arch nanogpt --compile --steps 300   # compiled
    # a window, batch by batch
    python benchmarks/overhead.py --arch nanogpt --offsets --steps 1000 --rounds 2
    # a window, part by part (timers inside the engines; nested parts overlap)
    python benchmarks/overhead.py --parts --steps 1000
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/nanogpt.py

from nanogpt import NanoGPTTask
from qkmonitor.callbacks import (
    AttentionEntropyMonitor,
    EffectiveRankMonitor,
    QKClip,
    QKSpectrumMonitor,
)
from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import (
    AssociativeRecallDataModule,
    CausalLMTask,
    CharLMTask,
    PythonSourceDataModule,
)

VISUALS_EVERY = inspect.signature(QKSpectrumMonitor).parameters["visuals_every_n_probes"].default
#: name -> (every_n_steps, visuals_every_n_probes), or None for no monitor
CONFIGS = {
    "no monitor": None,
    "all monitors, every 50 steps": (50, VISUALS_EVERY),
    "every 50 steps, visuals every probe": (50, 1),
    "all monitors, every step": (1, VISUALS_EVERY),
}
DEFAULTS = "all monitors, every 50 steps"
VISUALS = "every 50 steps, visuals every probe"
#: with ``--qk-clip``: QK-Clip alone (tau 100), (``"clip"``, every_n_steps)
QK_CLIP_CONFIGS = {"QKClip, every step": ("clip", 1), "QKClip, every 10 steps": ("clip", 10)}


def every_of(config: tuple) -> int:
    """The probe interval of a configuration."""
    return config[1] if config[0] == "clip" else config[0]


class Clock(pl.Callback):
    """Times from ``setup`` to the first batch, and each batch from its start to the next one's.

    Put it first in the callback list: its hooks then run before every other callback's, so a
    batch's time holds every callback's work at its start and at its end (the monitors open probes
    in ``on_train_batch_start`` and measure in ``on_train_batch_end``)."""

    def __init__(self) -> None:
        self.marks: list[float] = []
        self.setup_at = self.first_batch_at = 0.0

    def setup(self, trainer, pl_module, stage):
        self.setup_at = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _synchronize(pl_module)
        self.marks.append(time.perf_counter())
        if len(self.marks) == 1:  # the run's first batch (batch_idx is 0 again every epoch)
            self.first_batch_at = self.marks[-1]

    def on_train_end(self, trainer, pl_module):
        _synchronize(pl_module)
        self.marks.append(time.perf_counter())

    @property
    def steps(self) -> list[float]:
        """Seconds of each batch, in order."""
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    @property
    def steady(self) -> float:
        """Seconds of batches 1..N-1."""
        return sum(self.steps[1:])


def _synchronize(pl_module) -> None:
    device = next(pl_module.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def monitors(config: tuple[int, int] | None) -> list[pl.Callback]:
    if config is None:
        return []
    if config[0] == "clip":
        return [QKClip(tau=100.0, every_n_steps=config[1])]
    every, visuals = config
    return [
        QKSpectrumMonitor(every_n_steps=every, visuals_every_n_probes=visuals),
        AttentionEntropyMonitor(every_n_steps=every, visuals_every_n_probes=visuals),
        EffectiveRankMonitor(every_n_steps=every, visuals_every_n_probes=visuals),
    ]


class HookTimer:
    """Seconds each batch spends in the monitors' ``on_train_batch_start`` / ``_end`` hooks, by
    the batch's place in the run as ``clock`` counts them (``batch_idx`` starts again at 0 every
    epoch); ``clock`` comes before the monitors in the callback list."""

    def __init__(self, callbacks: list[pl.Callback], clock: Clock) -> None:
        self.seconds: dict[int, float] = {}
        self.clock = clock
        for callback in callbacks:
            for hook in ("on_train_batch_start", "on_train_batch_end"):
                setattr(callback, hook, self._timed(getattr(callback, hook)))

    def _timed(self, hook):
        def timed(trainer, pl_module, *args):
            start = time.perf_counter()
            try:
                return hook(trainer, pl_module, *args)
            finally:
                batch = len(self.clock.marks) - 1
                self.seconds[batch] = self.seconds.get(batch, 0.0) + time.perf_counter() - start

        return timed


def task_and_data(
    model: str, steps: int, arch: str = "bundled"
) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    """The task and data of ``model`` (the size); ``arch`` ``nanogpt`` trains the nanoGPT-style
    decoder of the same config on the same data, with the same optimizer and warmup."""
    if model == "default":
        data = AssociativeRecallDataModule(seed=0)
        config = TransformerConfig(vocab_size=data.vocab_size, max_seq_len=data.seq_len)
        return (CausalLMTask(config) if arch == "bundled" else NanoGPTTask(config)), data
    seq_len, batch = 1024, 8
    data = PythonSourceDataModule(max_chars=4_000_000, seq_len=seq_len, batch_size=batch,
                                  train_size=batch * steps, val_size=batch, seed=0)  # fmt: skip
    config = TransformerConfig(vocab_size=data.vocab_size, d_model=768, n_layers=12, n_heads=12,
                               max_seq_len=seq_len, positional="learned")  # fmt: skip
    return (
        CharLMTask(config, warmup_steps=10)
        if arch == "bundled"
        else NanoGPTTask(config, warmup_steps=10)
    ), data


def run(args, config: tuple[int, int] | None, log_root: str, steps: int | None = None) -> Clock:
    steps = args.steps if steps is None else steps
    pl.seed_everything(0, verbose=False)
    task, data = task_and_data(args.model, steps, args.arch)
    timer, callbacks = Clock(), monitors(config)
    timer.hooks = HookTimer(callbacks, timer)
    trainer = pl.Trainer(max_steps=steps, accelerator=args.device, devices=1,
                         precision=args.precision, logger=TensorBoardLogger(log_root),
                         callbacks=[timer, *callbacks], enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         limit_val_batches=0, log_every_n_steps=50)  # fmt: skip
    trainer.fit(task, datamodule=data)
    return timer


def touched(batch: int, every: int) -> bool:
    """Whether a monitor works in this batch: activation probes open on steps 0, n, 2n, ...; the
    spectrum reads the weights after the updates that make the step count a multiple of n."""
    return batch % every == 0 or (batch + 1) % every == 0


#: batches after a probe counted in its window: the visuals are drawn and written on a background
#: thread (qkmonitor.engine.publisher) while the next batches train, and slow them down
SPILL = 3


def window_cost(clock: Clock, base: Clock, every: int) -> float:
    """Seconds per probe window, in-run: what the touched batches and the :data:`SPILL` batches
    after each probe take beyond the run's median untouched batch, less the same for the
    no-monitor run at the same batches."""

    def counted(i: int) -> bool:
        return touched(i, every) or 0 < i % every <= SPILL

    def excess(c: Clock) -> dict[int, float]:
        steps = c.steps
        plain = statistics.median(s for i, s in enumerate(steps) if i and not counted(i))
        return {i: s - plain for i, s in enumerate(steps) if i and counted(i)}

    ours, theirs = excess(clock), excess(base)
    windows = len(ours) / 2 or 1  # a window: one activation probe and one spectrum probe
    return sum(ours[i] - theirs.get(i, 0.0) for i in ours) / windows


def untouched_step(clock: Clock, every: int) -> float:
    return statistics.median(s for i, s in enumerate(clock.steps) if i and not touched(i, every))


def hooks_untouched(clock: Clock, every: int) -> float:
    """Seconds per untouched batch in the monitors' hooks: the mean, not the median, since their
    cost has two levels (the steps whose loss a rule reads, and the quiet ones)."""
    values = [s for i, s in clock.hooks.seconds.items() if i and not touched(i, every)]
    return statistics.fmean(values) if values else 0.0


def measure(args) -> dict[str, dict[str, float]]:
    """Per configuration: steady steps/s, overhead between runs, in-run window cost and overhead,
    setup and first window (medians over rounds). With ``--dry-run`` the model and data are built
    (so that the configuration is checked) but nothing trains, and every figure is NaN."""
    if args.dry_run:
        task, data = task_and_data(args.model, args.steps, args.arch)
        data.setup("fit")
        del task, data
        figures = {name: {"steps_per_s": math.nan} for name in CONFIGS}
        figures["no monitor"]["plain_step_s"] = math.nan
        return figures
    configs = {**CONFIGS, **(QK_CLIP_CONFIGS if args.qk_clip else {})}
    clocks: dict[str, list[Clock]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as log_root:
        if args.warmup_steps:  # first-call costs (Triton autotuning, compiles) out of the rounds
            run(args, (1, 1), log_root, steps=args.warmup_steps)
        for _ in range(args.rounds):
            for name, config in configs.items():
                clocks[name].append(run(args, config, log_root))
    base = clocks["no monitor"]
    plain_step = statistics.median(s for c in base for s in c.steps[1:])
    figures: dict[str, dict[str, float]] = {}
    for name, config in configs.items():
        rounds = clocks[name]
        out = {
            "steps_per_s": (args.steps - 1) / statistics.median(c.steady for c in rounds),
            "overhead": statistics.median(c.steady / b.steady - 1 for c, b in zip(rounds, base)),
        }
        if config is not None:
            every = every_of(config)
            out["setup_s"] = statistics.median(
                c.first_batch_at - c.setup_at for c in rounds
            ) - statistics.median(b.first_batch_at - b.setup_at for b in base)
            out["first_window_s"] = statistics.median(
                c.steps[0] for c in rounds
            ) - statistics.median(b.steps[0] for b in base)
            out["hooks_s"] = statistics.median(hooks_untouched(c, every) for c in rounds)
        if config is not None and every_of(config) > 1:
            every = every_of(config)
            out["window_s"] = statistics.median(
                window_cost(c, b, every) for c, b in zip(rounds, base)
            )
            out["in_run"] = statistics.median(
                (window_cost(c, b, every) / every + hooks_untouched(c, every))
                / untouched_step(c, every)
                for c, b in zip(rounds, base)
            )
        figures[name] = out
    defaults, visuals = figures[DEFAULTS], figures[VISUALS]
    defaults["visuals_s"] = visuals["window_s"] - defaults["window_s"]
    every = CONFIGS[DEFAULTS][0]
    defaults["long_run"] = defaults["in_run"] + defaults["visuals_s"] / (
        VISUALS_EVERY * every
    ) / statistics.median(untouched_step(c, every) for c in clocks[DEFAULTS])
    figures["no monitor"]["plain_step_s"] = plain_step
    return figures


def side_by_side(args) -> dict[str, float]:
    """``--side-by-side`` (eager) and ``--compile``: two copies of the model (``torch.compile``'d
    alike with ``--compile``), trained step for step in one loop on the same batches, the second
    with all three monitors at ``every_n_steps=50`` (a plain loop with
    :class:`~qkmonitor.engine.Monitoring`: the callbacks' hooks are measured by the Lightning
    runs). Which copy steps first alternates, and each step of one is timed beside the same step
    of the other, so machine drift hits both. Returns :func:`paired_figures` of the per-step
    times, the one-time costs around them (the ``Monitoring``'s construction: discovery and the
    run header; its ``close``: the final drawing), and under compile the warm-up of each copy and
    the graphs compiled after warm-up."""
    from torch._dynamo.utils import counters

    from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum

    every = 50
    pl.seed_everything(0, verbose=False)
    twins = [task_and_data(args.model, args.steps, args.arch)[0] for _ in range(2)]
    twins[1].load_state_dict(twins[0].state_dict())
    _, data = task_and_data(args.model, args.steps, args.arch)
    data.setup("fit")
    batches = (batch for _ in range(args.steps) for batch in data.train_dataloader())  # epochs
    models = [task.to(args.device) for task in twins]
    stepped = (
        [torch.compile(task, backend=args.backend) for task in models] if args.compile else models
    )
    optimizers = [torch.optim.AdamW(task.parameters(), lr=1e-3) for task in models]
    engines = [
        QKSpectrum(every_n_steps=every, per_head=True),
        AttentionEntropy(every_n_steps=every),
        EffectiveRank(every_n_steps=every),
    ]
    times: list[list[float]] = [[], []]
    warm_graphs = 0
    with tempfile.TemporaryDirectory() as log_dir:
        start = time.perf_counter()
        monitoring = Monitoring(stepped[1], engines, writer=SummaryWriter(log_dir))
        construction = time.perf_counter() - start
        for step in range(args.steps):
            if step == every + 2:  # after a probed, an unprobed and a second probed step
                warm_graphs = counters["stats"]["unique_graphs"]
            tokens, targets = (t.to(args.device) for t in next(batches))
            for i in (0, 1) if step % 2 else (1, 0):  # alternate which runs first
                start = time.perf_counter()
                with monitoring.step(step) if i else contextlib.nullcontext():
                    loss = torch.nn.functional.cross_entropy(
                        stepped[i](tokens).flatten(0, 1), targets.flatten(), ignore_index=-100
                    )
                    loss.backward()
                    optimizers[i].step()
                    optimizers[i].zero_grad(set_to_none=True)
                    if i:
                        monitoring.observe_loss(loss)
                _synchronize(models[i])
                times[i].append(time.perf_counter() - start)
        start = time.perf_counter()
        monitoring.close()
        closing = time.perf_counter() - start
    plain, monitored = times
    return {
        **paired_figures(plain, monitored, every),
        "construction_s": construction,
        "close_s": closing,
        "warmup_plain_s": sum(plain[: every + 2]),
        "warmup_monitored_s": sum(monitored[: every + 2]),
        "graphs_after_warmup": counters["stats"]["unique_graphs"] - warm_graphs,
    }


def paired_figures(plain: list[float], monitored: list[float], every: int) -> dict[str, float]:
    """The monitors' cost from two copies' per-step times, step ``i`` of one beside step ``i`` of
    the other.

    - ``interval_*``: over each whole probe interval after the first (steps ``k·every`` to
      ``(k+1)·every − 1``, its probe included), the paired ratio ``Σ monitored / Σ plain − 1``;
      the median over intervals, and the 5th and 95th percentiles (a 90 % interval);
    - ``unprobed_overhead``: the median per-step ratio on the steps no monitor touches;
    - ``first_interval_extra_s``: what the first interval (the first probes' one-time work: the
      layout checks, first calls) costs beyond a median interval's excess, in seconds;
    - ``interval_excess_s``: a median interval's excess, in seconds (what each further
      ``every`` steps add).
    """
    n = min(len(plain), len(monitored)) // every * every
    intervals = [range(k, k + every) for k in range(every, n, every)]
    if not intervals:
        raise ValueError(f"Expected at least two whole probe intervals of {every} steps, got {n}")
    ratios = sorted(
        sum(monitored[i] for i in steps) / sum(plain[i] for i in steps) - 1 for steps in intervals
    )
    excess = statistics.median(sum(monitored[i] - plain[i] for i in steps) for steps in intervals)
    first = sum(monitored[i] - plain[i] for i in range(every))
    unprobed = [i for i in range(1, n) if not touched(i, every)]
    return {
        "interval_median": statistics.median(ratios),
        "interval_low": _percentile(ratios, 0.05),
        "interval_high": _percentile(ratios, 0.95),
        "intervals": len(ratios),
        "interval_excess_s": excess,
        "first_interval_extra_s": first - excess,
        "unprobed_plain_s": statistics.median(plain[i] for i in unprobed),
        "unprobed_overhead": statistics.median(monitored[i] / plain[i] for i in unprobed) - 1,
    }


def _percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated between the two nearest."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def offsets(
    args, every: int = 50, before: int = 3, after: int = 7
) -> tuple[dict[int, float], float]:
    """``--offsets``: where a probe window's time goes, batch by batch. The no-monitor run and the
    defaults alternate for ``--rounds``; each batch's excess over its run's median quiet batch
    (away from every window) is averaged over all windows of all rounds at each offset from the
    probed batch (offset -1: the spectrum's batch, 0: the activation probes', after: what the
    background visuals and the loggers' own threads spill over). Returns (offset -> the monitored
    run's mean excess less the no-monitor run's, the median quiet step), in seconds."""
    excess: dict[str, dict[int, list[float]]] = {
        name: {k: [] for k in range(-before, after + 1)} for name in ("plain", "monitored")
    }
    quiet_steps: list[float] = []
    with tempfile.TemporaryDirectory() as log_root:
        for _ in range(args.rounds):
            for name, config in (("plain", None), ("monitored", CONFIGS[DEFAULTS])):
                steps = run(args, config, log_root).steps
                quiet = statistics.median(
                    s
                    for i, s in enumerate(steps)
                    if i and before < i % every < every - before and i % every > after
                )
                quiet_steps.append(quiet)
                for probe in range(every, len(steps) - after, every):
                    for k in excess[name]:
                        excess[name][k].append(steps[probe + k] - quiet)
    diffs = {
        k: statistics.mean(excess["monitored"][k]) - statistics.mean(excess["plain"][k])
        for k in excess["plain"]
    }
    return diffs, statistics.median(quiet_steps)


def report_offsets(diffs: dict[int, float], quiet_step: float, every: int = 50) -> None:
    print(
        "  a window, batch by batch (the defaults less no monitor, mean over every window of every "
        "round):"
    )
    print("  " + "  ".join(f"{k:+d}: {1e3 * v:5.2f}" for k, v in diffs.items()) + "  (ms)")
    total = sum(diffs.values())
    print(
        f"  sum over offsets {min(diffs)}..{max(diffs)}: {1e3 * total:.1f} ms a window = "
        f"{100 * total / every / quiet_step:.2f}% of the quiet step ({1e3 * quiet_step:.2f} ms) at "
        f"every_n_steps={every} (the hooks on other steps and the visuals of every 20th window "
        "come on top: see the default run)"
    )


def report_side_by_side(figures: dict[str, float], args) -> None:
    f = figures
    how = f"torch.compile (backend {args.backend})" if args.compile else "eager"
    print(
        f"  {how}, two copies stepped side by side in one loop (Monitoring, a SummaryWriter), "
        "the three monitors every 50 steps on one (per_head on the spectrum):"
    )
    print(
        f"  a probe interval (50 steps, its probe included), paired: "
        f"{100 * f['interval_median']:+.2f}% at the median of {f['intervals']} intervals "
        f"(90 % of them within {100 * f['interval_low']:+.2f}% .. "
        f"{100 * f['interval_high']:+.2f}%), "
        f"{1e3 * f['interval_excess_s']:.1f} ms an interval"
    )
    print(
        f"  unprobed step: {1e3 * f['unprobed_plain_s']:.2f} ms without monitors; with them "
        f"{100 * f['unprobed_overhead']:+.2f}% (median of per-step ratios)"
    )
    print(
        f"  once a run: {1e3 * f['construction_s']:.0f} ms to construct (discovery, the header), "
        f"{1e3 * f['first_interval_extra_s']:.0f} ms more in the first interval (first probes), "
        f"{1e3 * f['close_s']:.0f} ms to close (the final drawing)"
    )
    if args.compile:
        print(
            f"  warm-up, steps 0-51 (compiling; the first copy to reach a graph compiles it for "
            f"both): {f['warmup_plain_s']:.1f} s without monitors, "
            f"{f['warmup_monitored_s']:.1f} s with them"
        )
        print(
            f"  graphs compiled after warm-up (a probed, an unprobed, a second probed step): "
            f"{f['graphs_after_warmup']}"
        )


def report(figures: dict[str, dict[str, float]], arch: str = "bundled") -> None:
    print(
        f"  {'configuration':36s} {'steps/s':>8s} {'between':>8s} {'window':>9s} {'hooks':>8s} "
        f"{'in-run':>7s} {'setup':>7s} {'1st window':>10s}"
    )
    for name, f in figures.items():
        line = f"  {name:36s} {f['steps_per_s']:8.1f} {100 * f.get('overhead', math.nan):+7.1f}%"
        if "window_s" in f:
            line += f" {1e3 * f['window_s']:7.1f}ms"
        elif "setup_s" in f:
            line += f" {'(all)':>9s}"
        if "hooks_s" in f:
            line += f" {1e3 * f['hooks_s']:6.2f}ms"
            line += f" {100 * f['in_run']:+6.2f}%" if "in_run" in f else f" {'':>7s}"
            line += f" {1e3 * f['setup_s']:5.0f}ms {1e3 * f['first_window_s']:8.0f}ms"
        print(line)
    d = figures[DEFAULTS]
    if "long_run" in d:
        print(
            f"  defaults over a long run: {1e3 * d['window_s']:.1f} ms a window + visuals "
            f"{1e3 * d['visuals_s']:.1f} ms every {VISUALS_EVERY} windows + hooks => "
            f"{100 * d['long_run']:+.2f}% of the plain step"
        )
    plain = figures["no monitor"].get("plain_step_s", math.nan)
    hooks = d.get("hooks_s", math.nan)
    print(
        f"  unprobed step, {arch}: {1e3 * plain:.2f} ms with no monitor; the monitors' hooks "
        f"(every {CONFIGS[DEFAULTS][0]} steps) add {1e3 * hooks:.3f} ms => "
        f"{100 * hooks / plain:+.2f}% of the plain step"
    )
    print(
        "  between: steady time against the no-monitor run; window: a probe window's cost, "
        "in-run; hooks: the monitors' hooks on an untouched batch; in-run: both over the run's "
        "own untouched batches"
    )


#: ``--parts``: the window's parts timed, as (module, qualified name); nested parts overlap
PARTS = (
    ("qkmonitor.engine.spectrum", "QKSpectrum.observe_weights"),
    ("qkmonitor.engine.spectrum", "spectrum_of_layers"),
    ("qkmonitor.engine.entropy", "AttentionEntropy._measure"),
    ("qkmonitor.engine.rank", "EffectiveRank._measure"),
    ("qkmonitor.engine.base", "MonitorEngine.record"),
    ("qkmonitor.engine.alerting", "AlertPolicy.update"),
    ("qkmonitor.engine.publishing", "ValuePublisher.publish"),
)


def parts(args) -> dict[str, tuple[float, float]]:
    """``--parts``: one run at the defaults with a timer around each of :data:`PARTS`; per part,
    the median seconds of a call (the probe at step 0 carries first-call costs) and the calls a
    probe window makes (wall time on the training thread, nested parts included in their
    callers')."""
    import importlib

    calls: dict[str, list[float]] = {name: [] for _, name in PARTS}
    undo = []
    for module_name, qualified in PARTS:
        owner = importlib.import_module(module_name)
        *path, attr = qualified.split(".")
        for name in path:
            owner = getattr(owner, name)
        original = getattr(owner, attr)

        def timed(*a, _original=original, _name=qualified, **kw):
            start = time.perf_counter()
            try:
                return _original(*a, **kw)
            finally:
                calls[_name].append(time.perf_counter() - start)

        setattr(owner, attr, timed)
        undo.append((owner, attr, original))
    try:
        with tempfile.TemporaryDirectory() as log_root:
            run(args, CONFIGS[DEFAULTS], log_root)
    finally:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)
    windows = args.steps // CONFIGS[DEFAULTS][0] + 1  # steps 0, 50, ..., the last multiple
    return {
        name: (statistics.median(seconds) if seconds else 0.0, len(seconds) / windows)
        for name, seconds in calls.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--warmup-steps", type=int, default=0,
        help="an untimed run with every monitor at every step first (GPU: autotuning)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--model", choices=["default", "gpt2-small"], default="default", help="the size and task"
    )
    parser.add_argument(
        "--arch", choices=["bundled", "nanogpt"], default="bundled",
        help="qkmonitor's bundled decoder, or a nanoGPT-style SDPA decoder of the same size found "
            "by interception",
    )  # fmt: skip
    parser.add_argument("--precision", default="32-true", help="Lightning's, e.g. bf16-mixed")
    parser.add_argument("--json", type=Path, help="also write the rates to this file")
    parser.add_argument(
        "--compile",
        action="store_true",
        help=(
            "torch.compile'd twins stepped side by side in a plain loop, with and without monitors"
        ),
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="eager twins stepped side by side in a plain loop, with and without monitors",
    )
    parser.add_argument(
        "--backend", default="inductor", help="with --compile: torch.compile's backend"
    )
    parser.add_argument(
        "--offsets",
        action="store_true",
        help="where a window's time goes, batch by batch around the probe (defaults vs no monitor)",
    )
    parser.add_argument(
        "--qk-clip",
        action="store_true",
        help="also QKClip alone (tau 100) every step and every 10 steps (what the cure costs)",
    )
    parser.add_argument(
        "--parts",
        action="store_true",
        help="where a window's time goes, part by part (one run at the defaults, timed inside)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="build model and data, train nothing"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not args.dry_run and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    if args.compile or args.side_by_side:
        if args.dry_run:
            return
        figures = side_by_side(args)
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}, "
            f"arch {args.arch}, {args.steps} steps"
        )
        report_side_by_side(figures, args)
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "model": args.model,
                        "arch": args.arch,
                        "compile": args.backend if args.compile else None,
                        "steps": args.steps,
                        "figures": figures,
                    },
                    indent=1,
                )
            )
        return
    if args.parts:
        if args.dry_run:
            return
        print(
            f"torch {torch.__version__}, model {args.model}, arch {args.arch}, {args.steps} steps"
        )
        for name, (seconds, per_window) in parts(args).items():
            print(
                f"  {name:34s} {seconds * 1e3:6.2f} ms a call (median), {per_window:.0f} a window"
            )
        return
    if args.offsets:
        if args.dry_run:
            return
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}, "
            f"arch {args.arch}, {args.steps} steps x {args.rounds} rounds"
        )
        report_offsets(*offsets(args))
        return
    figures = measure(args)
    where = torch.cuda.get_device_name() if args.device == "cuda" and not args.dry_run else (
        f"{torch.get_num_threads()} threads")  # fmt: skip
    arch = "" if args.arch == "bundled" else f", arch {args.arch}"  # the bundled header as before
    print(f"torch {torch.__version__}, {where}, model {args.model}{arch}, precision "
        f"{args.precision}, "
          f"{args.steps} steps x {args.rounds} rounds")  # fmt: skip
    report(figures, args.arch)
    if args.json:
        rates = {name: f["steps_per_s"] for name, f in figures.items()}
        args.json.write_text(json.dumps({"model": args.model, "arch": args.arch,
                                         "precision": args.precision, "device": args.device,
                                         "steps": args.steps, "steps_per_s": rates,
                                         "figures": figures}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
