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
    # a probe window against a plain one under torch.profiler, with its blocking reads
    python benchmarks/overhead.py --profile --every 10 --steps 30 [--device cuda ...]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import math
import random
import statistics
import sys
import tempfile
import threading
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


#: ``--model`` sizes on bytes of Python source: (sequence length, d_model, layers, heads)
SIZES = {
    "small": (64, 128, 4, 4),
    "medium": (256, 256, 6, 8),
    "gpt2-small": (1024, 768, 12, 12),
}


def task_and_data(
    model: str, steps: int, arch: str = "bundled"
) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    """The task and data of ``model`` (the size); ``arch`` ``nanogpt`` trains the nanoGPT-style
    decoder of the same config on the same data, with the same optimizer and warmup."""
    if model == "default":
        data = AssociativeRecallDataModule(seed=0)
        config = TransformerConfig(vocab_size=data.vocab_size, max_seq_len=data.seq_len)
        return (CausalLMTask(config) if arch == "bundled" else NanoGPTTask(config)), data
    seq_len, width, layers, heads = SIZES[model]
    batch = 8
    data = PythonSourceDataModule(max_chars=4_000_000, seq_len=seq_len, batch_size=batch,
                                  train_size=batch * steps, val_size=batch, seed=0)  # fmt: skip
    config = TransformerConfig(vocab_size=data.vocab_size, d_model=width, n_layers=layers,
                               n_heads=heads, max_seq_len=seq_len,
                               positional="learned")  # fmt: skip
    return (
        CharLMTask(config, warmup_steps=10)
        if arch == "bundled"
        else NanoGPTTask(config, warmup_steps=10)
    ), data


def run(
    args,
    config: tuple[int, int] | None,
    log_root: str,
    steps: int | None = None,
    callbacks: list[pl.Callback] | None = None,
) -> Clock:
    """One fit with the monitors of ``config`` (or the given ``callbacks``), timed by a Clock."""
    steps = args.steps if steps is None else steps
    pl.seed_everything(0, verbose=False)
    task, data = task_and_data(args.model, steps, args.arch)
    timer = Clock()
    callbacks = monitors(config) if callbacks is None else callbacks
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
#: thread (qkmonitor.output.publisher) while the next batches train, and slow them down
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

    every = args.every
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
                on = i and not args.null  # --null: an A/A run, the twins' own difference
                with monitoring.step(step) if on else contextlib.nullcontext():
                    loss = torch.nn.functional.cross_entropy(
                        stepped[i](tokens).flatten(0, 1), targets.flatten(), ignore_index=-100
                    )
                    loss.backward()
                    optimizers[i].step()
                    optimizers[i].zero_grad(set_to_none=True)
                    if on:
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


class Baton:
    """Two fits in two threads take turns, one training step each, so that each step of one runs
    beside the same step of the other: in pair ``p`` of turns, arm ``p % 2`` goes first. Only the
    arm holding the baton runs; the other waits on it. The setups and the ends are taken one arm
    at a time (:attr:`solo`), and both arms start stepping together (:attr:`start`)."""

    def __init__(self) -> None:
        self._turns = threading.Condition()
        self._turn = 0
        self._done = [False, False]
        self.solo = threading.Lock()
        self.start = threading.Barrier(2)

    def _owner(self, turn: int) -> int:
        pair, second = divmod(turn, 2)
        return (pair + second) % 2

    def wait(self, arm: int) -> None:
        with self._turns:
            self._turns.wait_for(lambda: self._owner(self._turn) == arm or self._done[1 - arm])

    def pass_on(self, arm: int, done: bool = False) -> None:
        with self._turns:
            self._turn += 1
            self._done[arm] = self._done[arm] or done
            self._turns.notify_all()


class TurnClock(pl.Callback):
    """First in an arm's callbacks: times each training step while its arm holds the baton, from
    the turn's start to the next batch's start (every other callback's hooks at the batch's start
    and end inside), and the arm's fixed costs: from ``fit`` to its first batch, and from
    ``on_train_end`` to the end of ``fit``."""

    def __init__(self, baton: Baton, arm: int) -> None:
        self.baton, self.arm = baton, arm
        self.steps: list[float] = []
        self.fit_at = self.first_batch_at = self.resumed = self.end_at = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self.steps or self.resumed:  # a step ended: hand the baton on, wait for the next turn
            self.steps.append(now - self.resumed)
            self.baton.pass_on(self.arm)
        else:  # the first batch: this arm's setup is over; step together from here
            self.first_batch_at = now
            self.baton.solo.release()
            self.baton.start.wait()
        self.baton.wait(self.arm)
        self.resumed = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        self.end_at = time.perf_counter()
        self.steps.append(self.end_at - self.resumed)
        self.baton.pass_on(self.arm, done=True)
        self.baton.solo.acquire()  # the ends one at a time (released when fit returns)
        self.end_at = time.perf_counter()


def lightning_side_by_side(args) -> dict[str, float]:
    """``--side-by-side --lightning``: two Lightning fits of twin models in two threads, stepped in
    turns (:class:`Baton`), one with ``QKMonitor(every_n_steps, per_head=True)`` and a
    TensorBoard logger, the other with the same logger and no monitor. Returns
    :func:`paired_figures` of their per-step times and the fixed costs of a fit: the monitored
    arm's setup (``fit`` to the first batch: discovery, the header) and end (the final drawing,
    waiting for the writers) beyond the plain arm's."""

    every = args.every
    pl.seed_everything(0, verbose=False)
    tasks = [task_and_data(args.model, args.steps, args.arch) for _ in range(2)]
    tasks[1][0].load_state_dict(tasks[0][0].state_dict())
    baton = Baton()
    clocks = [TurnClock(baton, arm) for arm in (0, 1)]
    errors: list[BaseException] = []
    with tempfile.TemporaryDirectory() as log_root:

        def fit(arm: int) -> None:
            task, data = tasks[arm]
            on = arm and not args.null  # --null: an A/A run, the twins' own difference
            monitors = readme_monitors(args) if on else []
            logger = TensorBoardLogger(log_root, str(arm))
            trainer = pl.Trainer(max_steps=args.steps, accelerator=args.device, devices=1,
                                 precision=args.precision, logger=logger,
                                 callbacks=[clocks[arm], *monitors], enable_progress_bar=False,
                                 enable_model_summary=False, enable_checkpointing=False,
                                 limit_val_batches=0, log_every_n_steps=50)  # fmt: skip
            baton.solo.acquire()  # the setups one at a time (released at the first batch)
            clocks[arm].fit_at = time.perf_counter()
            try:
                trainer.fit(task, datamodule=data)
            except BaseException as err:  # noqa: BLE001 -- reported by the main thread
                errors.append(err)
                baton.pass_on(arm, done=True)
            finally:
                clocks[arm].returned_at = time.perf_counter()
                if baton.solo.locked():
                    baton.solo.release()

        threads = [threading.Thread(target=fit, args=(arm,)) for arm in (0, 1)]
        collecting: list[float] = []  # the garbage collector's passes, both arms' (one process)

        def gc_timer(phase: str, info: dict) -> None:
            if phase == "start":
                collecting.append(-time.perf_counter())
            elif collecting:
                collecting[-1] += time.perf_counter()

        gc.callbacks.append(gc_timer)
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            gc.callbacks.remove(gc_timer)
    if errors:
        raise errors[0]
    plain, monitored = clocks

    def setup(c: TurnClock) -> float:
        return c.first_batch_at - c.fit_at

    def end(c: TurnClock) -> float:
        return c.returned_at - c.end_at

    return {  # with --rank-every, intervals of the rank's cadence (each holds one rank probe)
        **paired_figures(plain.steps, monitored.steps, args.rank_every or every),
        "construction_s": setup(monitored) - setup(plain),
        "close_s": end(monitored) - end(plain),
        "gc_s_per_interval": sum(collecting) / max(1, len(plain.steps) // every),
    }


class Empty(pl.Callback):
    """A callback whose batch hooks do nothing: what any callback costs Lightning to call."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pass

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pass


def dispatch(args, repeat: int = 20000) -> dict[str, float]:
    """``--dispatch``: what a step QKMonitor does not probe costs, in µs, against what Lightning's
    call of one callback costs.

    - ``dispatch_us``: Lightning's ``_call_callback_hooks`` for ``on_train_batch_start`` and
      ``on_train_batch_end`` with one empty callback, less with none (its loop, the profiler's
      context, the call), per batch: the median of ``repeat`` alternated calls;
    - ``quiet_us``, ``loss_us``, ``empty_us``: the bodies of QKMonitor's two batch hooks at
      ``every_n_steps=50`` (``per_head=True``, a TensorBoard logger) on its quiet steps and on
      the unprobed steps whose loss a rule keeps, and of the empty callback's, per batch (medians
      over a fit of ``--steps`` steps, each hook timed by the same wrapper)."""
    from lightning.pytorch.trainer import call

    from qkmonitor.callbacks import QKMonitor

    pl.seed_everything(0, verbose=False)
    task, data = task_and_data(args.model, args.steps, args.arch)
    empty, monitor = Empty(), QKMonitor(every_n_steps=50, per_head=True)
    bodies: dict[str, dict[int, float]] = {"empty": {}, "monitor": {}}
    kinds: dict[int, str] = {}

    def timed(name, hook):
        def wrapper(trainer, pl_module, *rest):
            step = trainer.global_step if hook.__name__ == "on_train_batch_start" else None
            if step is not None and name == "monitor":  # before the hook: the step's kind
                kinds[step] = (
                    "quiet"
                    if step in monitor._group.quiet
                    else "loss"
                    if step in monitor._group.between
                    else "probed"
                )
            start = time.perf_counter()
            hook(trainer, pl_module, *rest)
            key = trainer.global_step if step is None else step
            if step is None:  # the end hook: the step the batch started on
                key = monitor._batch_step
            bodies[name][key] = bodies[name].get(key, 0.0) + time.perf_counter() - start

        return wrapper

    for name, callback in (("empty", empty), ("monitor", monitor)):
        for hook in ("on_train_batch_start", "on_train_batch_end"):
            setattr(callback, hook, timed(name, getattr(callback, hook)))
    with tempfile.TemporaryDirectory() as log_root:
        trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1,
                             logger=TensorBoardLogger(log_root), callbacks=[empty, monitor],
                             enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, limit_val_batches=0,
                             log_every_n_steps=50)  # fmt: skip
        trainer.fit(task, datamodule=data)

    def median_of(name: str, kind: str) -> float:
        return 1e6 * statistics.median(
            t for step, t in bodies[name].items() if kinds.get(step) == kind and step
        )

    probe = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    one, none = [Empty()], []
    samples: dict[int, list[float]] = {0: [], 1: []}
    for i in range(repeat):
        for count, callbacks in ((0, none), (1, one)) if i % 2 else ((1, one), (0, none)):
            probe.callbacks = callbacks
            start = time.perf_counter()
            call._call_callback_hooks(probe, "on_train_batch_start", None, 0)
            call._call_callback_hooks(probe, "on_train_batch_end", None, None, 0)
            samples[count].append(time.perf_counter() - start)
    return {
        "dispatch_us": 1e6 * (statistics.median(samples[1]) - statistics.median(samples[0])),
        "quiet_us": median_of("monitor", "quiet"),
        "loss_us": median_of("monitor", "loss"),
        "empty_us": median_of("empty", "quiet"),
        "quiet_steps": sum(1 for k in kinds.values() if k == "quiet"),
        "loss_steps": sum(1 for k in kinds.values() if k == "loss"),
    }


def readme_monitors(args) -> list[pl.Callback]:
    """The monitors a user puts in a Trainer: ``QKMonitor`` (the README's first example), or with
    ``--three`` the three callbacks (the README's example before ``QKMonitor``); every
    ``--every`` steps, ``per_head=True`` on the spectrum."""
    from qkmonitor.callbacks import QKMonitor

    if not args.three:
        rank = {"every_n_steps": args.rank_every} if args.rank_every else True
        return [QKMonitor(every_n_steps=args.every, per_head=True, rank=rank)]
    return [
        QKSpectrumMonitor(every_n_steps=args.every, per_head=True),
        AttentionEntropyMonitor(every_n_steps=args.every),
        EffectiveRankMonitor(every_n_steps=args.every),
    ]


def user_fits(args, first_timed: int = 20) -> dict[str, float]:
    """``--user-fits``: the measurement a user makes, one fit after another: ``--rounds`` pairs of
    ``--steps``-step fits, one with the monitors (:func:`readme_monitors`) and one without, which
    goes first alternating, each timed from step ``first_timed`` to its last batch. Returns the
    median of the pairs' ratios, their spread, and each pair's ratio."""
    ratios = []
    with tempfile.TemporaryDirectory() as log_root:
        for pair in range(args.rounds):
            seconds = {}
            for monitored in (False, True) if pair % 2 else (True, False):
                pl.seed_everything(0, verbose=False)
                task, data = task_and_data(args.model, args.steps, args.arch)
                clock = Clock()
                callbacks = readme_monitors(args) if monitored and not args.null else []
                logger = TensorBoardLogger(log_root)
                trainer = pl.Trainer(max_steps=args.steps, accelerator=args.device, devices=1,
                                     logger=logger, callbacks=[clock, *callbacks],
                                     enable_progress_bar=False, enable_model_summary=False,
                                     enable_checkpointing=False, limit_val_batches=0,
                                     log_every_n_steps=50)  # fmt: skip
                trainer.fit(task, datamodule=data)
                seconds[monitored] = sum(clock.steps[first_timed:])
            ratios.append(seconds[True] / seconds[False] - 1)
    ordered = sorted(ratios)
    return {
        "median": statistics.median(ratios),
        "low": ordered[0],
        "high": ordered[-1],
        "slower": sum(r > 0 for r in ratios),
        "pairs": ratios,
    }


def paired_figures(plain: list[float], monitored: list[float], every: int) -> dict[str, float]:
    """The monitors' cost from two copies' per-step times, step ``i`` of one beside step ``i`` of
    the other.

    - ``interval_*``: over each whole probe interval after the first (steps ``k·every`` to
      ``(k+1)·every − 1``, its probe included), the paired ratio ``Σ monitored / Σ plain − 1``;
      the median over intervals (``interval_median``), a 90 % confidence interval of that median
      (``median_low``, ``median_high``: the 5th and 95th percentiles of the medians of 2000
      resamplings of the intervals, seeded), and the intervals' own spread (``interval_low``,
      ``interval_high``: their 5th and 95th percentiles);
    - ``interval_excess_s``: a median interval's excess, in seconds (what each further
      ``every`` steps add), and where it lies: at the steps a monitor works in
      (``probed_excess_s``, :func:`touched`), the :data:`SPILL` steps after the probe
      (``spill_excess_s``: the background threads' drawing and writing), the others
      (``rest_excess_s``); medians over intervals, so they need not add up exactly;
    - ``unprobed_overhead``: the median per-step ratio on the steps no monitor touches (NaN at
      ``every=1``);
    - ``first_interval_extra_s``: what the first interval (the first probes' one-time work: the
      layout checks, first calls) costs beyond a median interval's excess, in seconds.
    """
    n = min(len(plain), len(monitored)) // every * every
    intervals = [range(k, k + every) for k in range(every, n, every)]
    if not intervals:
        raise ValueError(f"Expected at least two whole probe intervals of {every} steps, got {n}")
    ratios = [
        sum(monitored[i] for i in steps) / sum(plain[i] for i in steps) - 1 for steps in intervals
    ]

    def excess(steps) -> float:
        return sum(monitored[i] - plain[i] for i in steps)

    def part(keep) -> float:
        return statistics.median(excess([i for i in steps if keep(i)]) for steps in intervals)

    median_excess = statistics.median(excess(steps) for steps in intervals)
    unprobed = [i for i in range(1, n) if not touched(i, every)]
    low, high = _bootstrap_median(ratios)
    ordered = sorted(ratios)
    return {
        "interval_median": statistics.median(ratios),
        "median_low": low,
        "median_high": high,
        "interval_low": _percentile(ordered, 0.05),
        "interval_high": _percentile(ordered, 0.95),
        "intervals": len(ratios),
        "interval_excess_s": median_excess,
        "probed_excess_s": part(lambda i: touched(i, every)),
        "spill_excess_s": part(lambda i: not touched(i, every) and 0 < i % every <= SPILL),
        "rest_excess_s": part(lambda i: not touched(i, every) and i % every > SPILL),
        "first_interval_extra_s": excess(range(every)) - median_excess,
        "unprobed_plain_s": statistics.median(plain[i] for i in unprobed) if unprobed else math.nan,
        "unprobed_overhead": (
            statistics.median(monitored[i] / plain[i] for i in unprobed) - 1
            if unprobed
            else math.nan
        ),
    }


def _bootstrap_median(
    values: list[float], rounds: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A 90 % interval of the median of ``values``: the 5th and 95th percentiles of the medians of
    ``rounds`` resamplings with replacement (a seeded generator: the same values give the same
    interval)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return _percentile(medians, 0.05), _percentile(medians, 0.95)


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
    who = "no monitor (A/A)" if args.null else "the three callbacks" if args.three else "QKMonitor"
    loop = (
        f"two Lightning fits stepped in turns ({who}, per_head=True, TensorBoardLogger)"
        if args.lightning
        else "two copies stepped side by side in one loop (Monitoring, a SummaryWriter, the "
        "three monitors, per_head on the spectrum)"
    )
    rank = f" (the ranks every {args.rank_every})" if args.rank_every else ""
    print(f"  {how}, {loop}, every {args.every} steps{rank}:")
    print(
        f"  a probe interval ({args.rank_every or args.every} steps, its probe included), paired: "
        f"{100 * f['interval_median']:+.2f}% at the median of {f['intervals']} intervals, "
        f"90 % interval of the median {100 * f['median_low']:+.2f}% .. "
        f"{100 * f['median_high']:+.2f}% (the intervals themselves: "
        f"{100 * f['interval_low']:+.2f}% .. {100 * f['interval_high']:+.2f}%)"
    )
    print(
        f"  {1e3 * f['interval_excess_s']:.1f} ms an interval: {1e3 * f['probed_excess_s']:.1f} ms "
        f"at the probed steps, {1e3 * f['spill_excess_s']:.1f} ms at the {SPILL} after, "
        f"{1e3 * f['rest_excess_s']:.1f} ms at the others (medians)"
    )
    if not math.isnan(f["unprobed_overhead"]):
        print(
            f"  unprobed step: {1e3 * f['unprobed_plain_s']:.2f} ms without monitors; with them "
            f"{100 * f['unprobed_overhead']:+.2f}% (median of per-step ratios)"
        )
    print(
        f"  once a run: {1e3 * f['construction_s']:.0f} ms to set up (discovery, the header), "
        f"{1e3 * f['first_interval_extra_s']:.0f} ms more in the first interval (first probes), "
        f"{1e3 * f['close_s']:.0f} ms to end (the final drawing, the writers)"
    )
    if "gc_s_per_interval" in f:
        print(
            f"  the garbage collector (one process: both arms'): "
            f"{1e3 * f['gc_s_per_interval']:.2f} ms an interval"
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
    ("qkmonitor.engine.spectrum", "QKSpectrum.before_update"),  # the optimizer's view: the copy
    ("qkmonitor.engine.spectrum", "QKSpectrum._updates_after"),  # ... and the comparison
    ("qkmonitor.engine.entropy", "logit_sums"),  # the output logits' sums
    # an intercepted layer's statistics (once a call), and its probability slice for the ranks
    ("qkmonitor.attention.calls", "MaskedCall._stats"),
    ("qkmonitor.attention.calls", "MaskedCall.probs"),
    ("qkmonitor.engine.entropy", "AttentionEntropy._accumulate"),
    ("qkmonitor.engine.entropy", "AttentionEntropy._values"),
    ("qkmonitor.engine.rank", "EffectiveRank._accumulate"),
    ("qkmonitor.engine.rank", "_attention_erank"),
    ("qkmonitor.engine.rank", "hidden_state_metrics"),
    ("qkmonitor.engine.rank", "EffectiveRank._values"),
    ("qkmonitor.engine.base", "MonitorEngine.record"),
    ("qkmonitor.engine.alerting", "AlertPolicy.update"),
    ("qkmonitor.engine.publishing", "ValuePublisher.publish"),
)


def parts(args) -> tuple[dict[str, tuple[float, float, float]], float]:
    """``--parts``: one run with a timer around each of :data:`PARTS`; per part, the median
    seconds of a call (the probe at step 0 carries first-call costs), the calls a probe window
    makes and the seconds they take a window (wall time on the training thread, nested parts
    included in their callers'). The three callbacks at their defaults (every 50 steps), or with
    ``--readme`` QKMonitor as the README configures it (``per_head=True``) every ``--every``
    steps. Also returns the median step of the run (its probes included)."""
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
    every = args.every if args.readme else CONFIGS[DEFAULTS][0]
    try:
        with tempfile.TemporaryDirectory() as log_root:
            if args.readme:
                clock = run(args, None, log_root, callbacks=readme_monitors(args))
            else:
                clock = run(args, CONFIGS[DEFAULTS], log_root)
    finally:
        for owner, attr, original in reversed(undo):
            setattr(owner, attr, original)
    windows = args.steps // every + 1  # steps 0, n, 2n, ..., the last multiple
    return {
        name: (
            statistics.median(seconds) if seconds else 0.0,
            len(seconds) / windows,
            sum(seconds) / windows,
        )
        for name, seconds in calls.items()
    }, statistics.median(clock.steps[1:])


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
        "--model", choices=["default", *SIZES], default="default", help="the size and task"
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
        "--lightning",
        action="store_true",
        help="with --side-by-side: two Lightning fits in turns, one with QKMonitor",
    )
    parser.add_argument(
        "--dispatch",
        action="store_true",
        help="what an unprobed step of QKMonitor costs against Lightning's call of one callback",
    )
    parser.add_argument(
        "--user-fits",
        action="store_true",
        help="a user's measurement: fits one after another, with and without the monitors",
    )
    parser.add_argument(
        "--three",
        action="store_true",
        help="with --side-by-side --lightning or --user-fits: the three callbacks, not QKMonitor",
    )
    parser.add_argument(
        "--rank-every",
        type=int,
        default=None,
        help="with --side-by-side --lightning: QKMonitor's rank monitor at its own cadence; the "
        "figures are then over intervals of that many steps",
    )
    parser.add_argument(
        "--null",
        action="store_true",
        help="with --side-by-side: no monitor on either twin (what pairing alone shows)",
    )
    parser.add_argument(
        "--every",
        type=int,
        default=50,
        help="with --side-by-side, --parts --readme or --profile: the probe interval",
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
        "--readme",
        action="store_true",
        help="with --parts: QKMonitor as the README configures it (per_head=True), every --every "
        "steps",
    )
    parser.add_argument(
        "--profile", action="store_true",
        help="a probe window and a plain one under torch.profiler, by phase and by engine, host "
        "and device, with the training thread's blocking reads (benchmarks/probe_profile.py); "
        "the three monitors every --every steps",
    )  # fmt: skip
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
        figures = lightning_side_by_side(args) if args.lightning else side_by_side(args)
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
    if args.user_fits:
        if args.dry_run:
            return
        f = user_fits(args)
        who = (
            "no monitor (A/A)"
            if args.null
            else "the three callbacks"
            if args.three
            else "QKMonitor"
        )
        print(
            f"torch {torch.__version__}, model {args.model}, arch {args.arch}, {args.rounds} pairs "
            f"of {args.steps}-step fits, {who} every {args.every} steps, timed from step 20"
        )
        print(
            f"  monitored / plain - 1: {100 * f['median']:+.1f}% at the median, pairs "
            f"{100 * f['low']:+.1f}% .. {100 * f['high']:+.1f}%, {f['slower']} of {args.rounds} "
            f"slower: " + ", ".join(f"{100 * r:+.1f}%" for r in f["pairs"])
        )
        return
    if args.dispatch:
        if args.dry_run:
            return
        f = dispatch(args)
        print(f"torch {torch.__version__}, lightning {pl.__version__}, model {args.model}")
        print(
            f"  Lightning's call of one callback (both batch hooks, empty): "
            f"{f['dispatch_us']:.1f} µs a batch"
        )
        print(
            f"  inside the hooks, a batch: QKMonitor {f['quiet_us']:.1f} µs on its "
            f"{f['quiet_steps']} quiet steps, {f['loss_us']:.1f} µs on the "
            f"{f['loss_steps']} whose loss it keeps; an empty callback {f['empty_us']:.1f} µs"
        )
        return
    if args.profile:
        if args.dry_run:
            return
        from probe_profile import profile_probe, report_profile

        where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(
            f"torch {torch.__version__}, {where}, model {args.model}, arch {args.arch}, precision "
            f"{args.precision}, {args.steps} steps, the three monitors every {args.every} steps"
        )
        report_profile(profile_probe(args, every=args.every), args.device)
        return
    if args.parts:
        if args.dry_run:
            return
        print(
            f"torch {torch.__version__}, model {args.model}, arch {args.arch}, {args.steps} steps"
        )
        timed, step = parts(args)
        if args.readme:
            print(f"  QKMonitor(every_n_steps={args.every}, per_head=True), TensorBoardLogger")
        print(f"  a step, its probes included: {step * 1e3:.1f} ms (median)")
        for name, (seconds, per_window, window) in timed.items():
            print(
                f"  {name:34s} {seconds * 1e3:6.2f} ms a call (median), {per_window:.0f} a "
                f"window, {window * 1e3:6.1f} ms a window"
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
