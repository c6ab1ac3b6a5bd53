"""Does qkmonitor warn in time, and stay quiet on healthy learning? The alert calibration suite.

Six task/architecture families of the bundled models (``benchmarks/families.py``: induction-head
formation, char-LM, associative recall, an encoder-decoder, a vision encoder with 2-D RoPE,
grokking), each at its learning-rate sweep, with a 50-step linear warmup and without, seeds 0 to
6, and a seventh (``sorting``, seeds 3 to 6). Every run trains with AdamW (betas 0.9/0.98, weight
decay on matrices) in a plain loop with all three monitors on (:class:`qkmonitor.engine.Monitoring`,
probe every 10 steps, the spectrum's with ``update_spectrum=True``), their **default alert rules**,
and the training loss handed to them (``Monitoring.observe_loss``), so the alerts are the ones a
user would see. One process per core (``--jobs``), one thread each.

The split (:data:`CALIBRATION`) is fixed before any rule is fitted: the rules are fitted on the
calibration set only (round 4: seeds 0-4, every run read before); the validation set (seeds 5 and
6 of every family, written before any of them was trained) is the one whose figures count, per
seed. Earlier rounds' splits, whose validation sets have since been read, are described there for
the record.

Two **fault families** (issue 61, item 2; ``families.FAULTS``) are scored apart (:data:`HELD_OUT`):
not in the validation figures; round 3 was fitted without them, round 4 read seeds 0-4
(:data:`FAULT_READ_SEEDS`) and holds out seeds 5 and 6. Per seed, a healthy run (the
**twin**) and the same run with a fault from a step drawn within a window after its heads formed:
``numfault``, a biased rank-one error added to the W_Q and W_K gradients (:class:`Injection`;
magnitudes 0.3, 1 and 3 x the gradient's norm) and the model moved to bf16 with the kernel's
rounding or the unbiased one; ``lrjump``, the learning rate x10, x30 or x100 (a scheduler bug).
A faulted run is scored against its twin (:func:`score_faults`), its alerts from the fault's step
on, and written apart: ``docs/instability_faults.png`` and ``.json`` (:func:`fault_summary`).

Per run it records the training loss of every step, the scored loss (the training loss where
every batch is fresh, the held-out loss for grokking), every probe's values (every metric, layer
and head) and every alert. The summary then says, per family (losses plus the family's floor,
0.05 nats, so that two runs that both solved a task are alike):

- **final loss**: the mean scored loss over the last 20 steps;
- **failed**: final loss >= 1.2 x the family's best *and* a learning rate above the best one of
  its variant (warmup or not, by the mean over seeds); runs below it that end that high are
  *slow*, not unstable;
- **healthy**: final loss within 1.1 x the family's best; these must fire no alert at all;
- **separation**: the first step from which the run's loss (mean over the last 10 steps) stays
  above 1.1 x the best run's of the same seed until the end;
- **in time**: an alert at least ``MIN_LEAD`` steps before a separation after step ``EARLY``, or
  for an earlier separation by the first probe at or after it.

Trajectories are cached (``--cache``, one JSON per run), so that changed rules can be evaluated
against the recorded runs without training again (``--replay``): the recorded losses and values go
through the same engines and rules (``observe_loss``, ``MonitorEngine.record``) as in training. A
fresh run checks that the replay gives exactly the alerts the live run fired.

Outputs: ``docs/instability.png`` (per family: final loss and the largest attention logit against
the learning rate, with and without warmup, alerted runs marked), ``docs/instability.json`` (per-run
results and the summary per split and family), and markdown tables on stdout (docs/alerts.md, "Does
it warn in time?"). ``--quick`` writes its figure and JSON next to the cache instead.

Usage::

    python benchmarks/instability.py            # 7 families x 3-5 rates x warmup arms x 7 seeds
    # the two fault families alone (held out), seeds 0-2: docs/instability_faults.*
    python benchmarks/instability.py --families numfault lrjump --seeds 0 1 2
    python benchmarks/instability.py --quick    # 2 rates, seed 0, 60 % of the steps
    python benchmarks/instability.py --replay   # re-score the cached runs with the current rules
    # one calibration run's evidence, probe by probe (for fitting rules)
    python benchmarks/instability.py --trajectory charlm-lr0.03-qk0-s0-w0-n250
    python benchmarks/instability.py --qk-norm  # every run also with QK-norm
    # QK-Clip's proof: AdamW and Muon, each without and with QK-Clip (docs/qk_clip.md)
    python benchmarks/instability.py --arms
    python benchmarks/instability.py --arms --clip-tau 30
    # an earlier round's defaults on the same runs
    python benchmarks/instability.py --replay --round-rules 3
    # issue 61's 95 % intervals added to a written JSON from its run rows (no cached runs needed)
    python benchmarks/instability.py --intervals-from-json docs/instability.json

Every summary block (and fault arm) carries ``"intervals"``: each proportion with its 95 % Wilson
interval and the median lead with its order-statistic interval (``intervals.py``).
``QKMONITOR_SWEEP_THREADS=2`` trains with two torch threads a run (``margins.py``).

The full sweep (240 runs) takes about 22 min on 2 cores, and the fault families' 50 runs 15 min on
2 shared ones; ``--quick`` about 2 min, and 1.5 min more for its 4 fault-family runs (seed 0's twin
and middle magnitude, at full length); ``--replay`` about 40 s (the fault families alone: 20 s).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import statistics
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkmonitor.models.tasks.base import lr_factor

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/families.py

from families import FAMILIES, FAULTS, Family, Fault, fault_start
from intervals import fmt_share, median_interval, share

from qkmonitor.alerts import (
    DEFAULT_RULES,
    ENTROPY_COLLAPSE_RULE,
    FAST_UPDATES_RULE,
    KAPPA_RULE,
    LOGIT_BURST_RULE,
    LOGIT_GROWTH_RULE,
    LOGIT_JUMP_RULE,
    LOGIT_PLATEAU_RULE,
    MALIGNANT_COLLAPSE_RULE,
    RANK_COLLAPSE_RULE,
    SPECTRAL_GROWTH_RULE,
    Alert,
    AlertRule,
    Condition,
)
from qkmonitor.alerts.rules import LOSS_SIGNALS
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKClipEngine, QKSpectrum
from qkmonitor.models.attention import MultiHeadAttention

ROOT = Path(__file__).resolve().parents[1]
EVERY = 10  # probe interval (steps) of every monitor
FAIL_RATIO, HEALTHY_RATIO, SEPARATION_RATIO = 1.2, 1.1, 1.1
FINAL_WINDOW, SMOOTH_WINDOW = 20, 10
MIN_LEAD = 10  # steps an alert must come before a loss that separates after EARLY
EARLY = 30  # a run separating by this step must be flagged by the first probe at or after it
WARMUP = 50  # linear warmup steps of the warmup arm
#: bumped when what a run records changes; a cached run of another version is trained again
#: (3: the spectrum's q/k update and gradient metrics, the output logits' run values; issue 31;
#: 4: the QK update's spectrum, qk_update_entropy and qk_update_top_share; issue 61)
RECORD_VERSION = 4
#: environment variable: torch threads per run (default 1)
THREADS_ENV = "QKMONITOR_SWEEP_THREADS"
#: a probe's key for its run values (``{name: value}``), beside its metrics
RUN = "run"
#: where the bundled models keep their transformer blocks (Muon's 2-D weights, ``--arms``)
BLOCK_CONTAINERS = ("blocks", "encoder", "decoder")
MONITORS = ("QKSpectrumMonitor", "AttentionEntropyMonitor", "EffectiveRankMonitor")
#: rules that are not defaults, scored alone on the sweep: (rule, the monitor that has its metric)
OPT_IN = (
    (SPECTRAL_GROWTH_RULE, "QKSpectrumMonitor"),
    (ENTROPY_COLLAPSE_RULE, "AttentionEntropyMonitor"),
)


#: The split, fixed before any rule was tuned on the suite: the rules are fitted on the
#: calibration set only; the validation set is the one whose figures count.
#:
#: Round 1 (2026-12-01) fitted on seed 0 of charlm, recall, induction and seq2seq and validated on
#: the rest of seeds 0 and 1 (vision and grokking never seen). Its validation set was then read
#: (which runs were missed and why), so it could not validate again: round 2 (2026-12-02) fitted on
#: every run of seeds 0 and 1 and validated on seed 2 of every family. That set was read in turn
#: (docs/alerts.md lists its missed runs). Round 3 (issue 31, 2026-12-03, written here before any
#: run of seeds 3 and 4 or of the ``sorting`` family was trained, and before any rule of the round
#: was fitted): calibration = seeds 0, 1 and 2 of the six earlier families; validation = seeds 3
#: and 4 of those families, and every run of ``sorting`` (:data:`UNSEEN`), a family no rule has
#: seen. Each validation figure is reported per seed: two seeds give its spread.
#:
#: Round 4 (issue 61, 2026-12-07; written here before any run of seeds 5 and 6 was trained and
#: before any rule of the round was fitted): every run read so far is calibration, i.e. seeds 0-4
#: of the six families and seeds 3 and 4 of ``sorting``; validation = seeds 5 and 6 of every
#: family, ``sorting`` included. The fault families (:data:`HELD_OUT`) keep their own split: their
#: seeds 0-4 were read in issue 61's report (:data:`FAULT_READ_SEEDS`), seeds 5 and 6 are new.
CALIBRATION_SEEDS = (0, 1, 2, 3, 4)
VALIDATION_SEEDS = (5, 6)
#: a family's first seed where it starts later (``sorting`` entered in round 3's validation)
FIRST_SEED = {"sorting": 3}
#: families first seen in a validation set (round 3: ``sorting``)
UNSEEN = frozenset(FIRST_SEED)
CALIBRATION = {
    (family, seed)
    for family in FAMILIES
    if family not in FAULTS
    for seed in CALIBRATION_SEEDS
    if seed >= FIRST_SEED.get(family, 0)
}
#: the fault families' seeds whose runs were read (issue 61's first report) before round 4 fitted
FAULT_READ_SEEDS = (0, 1, 2, 3, 4)
#: the split of the fault families (``families.FAULTS``; issue 61, item 2): held out from every
#: fit, and scored apart from the validation set (``docs/instability_faults.json``)
HELD_OUT = "held-out"
SEEDS = CALIBRATION_SEEDS + VALIDATION_SEEDS
#: the seed of the QK-Clip arms (``--arms``; docs/qk_clip.md)
ARMS_SEED = 2


def round_1_rules() -> dict[str, list[AlertRule]]:
    """The round-1 defaults (2026-12-01): round 2's changes undone, to score them on round 2's
    split (``--round-1-rules``)."""
    return {
        "QKSpectrumMonitor": [KAPPA_RULE.replace(growth=2.5)],
        "AttentionEntropyMonitor": [
            LOGIT_GROWTH_RULE.replace(threshold=20.0),
            LOGIT_BURST_RULE.replace(threshold=100.0, growth=20.0, margin=25.0),
        ],
        "EffectiveRankMonitor": [
            MALIGNANT_COLLAPSE_RULE.replace(
                learning_drop=None, learning_window=None, solved_fraction=None
            ),
            RANK_COLLAPSE_RULE,
        ],
    }


def round_3_rules() -> dict[str, list[AlertRule]]:
    """The round-3 defaults (issue 31, 2026-12-03): round 4's changes undone (its margins, and
    ``low_rank_updates``), to score them on round 4's split (``--round-rules 3``)."""
    return {
        "QKSpectrumMonitor": [KAPPA_RULE.replace(growth=2.5)],
        "AttentionEntropyMonitor": [
            LOGIT_GROWTH_RULE,
            LOGIT_BURST_RULE.replace(threshold=50.0),
            LOGIT_JUMP_RULE.replace(threshold=20.0, growth=5.0),
            FAST_UPDATES_RULE.replace(
                also=(Condition("q_update_ratio", 0.08, above=True),), solved_fraction=None
            ),
            LOGIT_PLATEAU_RULE.replace(also=(Condition("loss_vs_best", 1.0, above=True),)),
        ],
        "EffectiveRankMonitor": [RANK_COLLAPSE_RULE, MALIGNANT_COLLAPSE_RULE],
    }


def round_2_rules() -> dict[str, list[AlertRule]]:
    """The round-2 defaults (2026-12-02): round 3's with its two rules on the new evidence left
    out, to score what they add on round 3's split (``--round-rules 2``)."""
    added = {FAST_UPDATES_RULE.name, LOGIT_PLATEAU_RULE.name}
    return {
        monitor: [r for r in rules if r.name not in added]
        for monitor, rules in round_3_rules().items()
    }


#: ``--round-rules``: an earlier round's defaults
EARLIER_RULES = {1: round_1_rules, 2: round_2_rules, 3: round_3_rules}


def split_of(family: str, seed: int) -> str:
    """``"calibration"``, ``"validation"``, or :data:`HELD_OUT` (a fault family)."""
    if family in FAULTS:
        return HELD_OUT
    return "calibration" if (family, seed) in CALIBRATION else "validation"


@dataclass(frozen=True)
class RunSpec:
    """One run of the sweep."""

    family: str
    lr: float
    qk_norm: bool
    seed: int
    warmup: int
    steps: int
    optimizer: str = "adamw"  # or "muon" (the --arms sweep)
    clip_tau: float | None = None  # QK-Clip (tau) at every step (the --arms sweep)
    #: a fault family's fault (``families.Fault.kind``), None for its healthy twin and elsewhere
    fault: str | None = None
    magnitude: float | None = None  # the fault's magnitude (``families.Fault.magnitudes``)

    @property
    def key(self) -> str:
        arm = ("" if self.optimizer == "adamw" else f"-{self.optimizer}") + (
            "" if self.clip_tau is None else f"-clip{self.clip_tau:g}"
        )
        if self.fault is not None:
            arm += f"-{self.fault}" + ("" if self.magnitude is None else f"{self.magnitude:g}")
        return (
            f"{self.family}-lr{self.lr:g}-qk{int(self.qk_norm)}-s{self.seed}-w{self.warmup}"
            f"-n{self.steps}{arm}"
        )

    @property
    def arm(self) -> str:
        """The optimizer and the cure, e.g. ``"Muon + QK-Clip"``."""
        name = "AdamW" if self.optimizer == "adamw" else "Muon"
        return name + ("" if self.clip_tau is None else " + QK-Clip")

    @property
    def split(self) -> str:
        return split_of(self.family, self.seed)

    @property
    def task(self) -> Family:
        return FAMILIES[self.family]

    @property
    def fault_step(self) -> int | None:
        """The step a fault family's fault starts at (its twin's too: the step it is compared
        from); None outside the fault families."""
        fault = FAULTS.get(self.family)
        return None if fault is None else fault_start(fault, self.seed)


@dataclass
class RunRecord:
    """What one run recorded. ``losses``: the training loss of every step; ``scored``: the loss
    the definitions are about, every step (the training loss, or the family's held-out loss);
    ``probes``: step -> metric -> one list of head values per layer."""

    spec: RunSpec
    losses: list[float]
    scored: list[float]
    probes: dict[int, dict[str, list[list[float]]]]
    live_alerts: list[dict[str, Any]]
    seconds: float
    alerts: list[dict[str, Any]] = field(default_factory=list)  # from the replay (the scored ones)
    clips: int = 0  # (step, head) pairs QK-Clip scaled (clip arms)

    @property
    def final_loss(self) -> float:
        tail = [x for x in self.scored[-FINAL_WINDOW:] if math.isfinite(x)]
        return statistics.fmean(tail) if len(tail) == FINAL_WINDOW else math.inf

    @property
    def max_logit(self) -> float:
        """The largest attention logit of any probe, layer and head over the run."""
        values = [
            v
            for p in self.probes.values()
            for layer in p.get("max_logit", [])
            for v in layer
            if math.isfinite(v)
        ]
        return max(values, default=math.nan)

    def smoothed(self) -> list[float]:
        """The scored loss averaged over the last ``SMOOTH_WINDOW`` steps (fewer at the start)."""
        out, total = [], 0.0
        for i, x in enumerate(self.scored):
            total += x if math.isfinite(x) else 1e9
            if i >= SMOOTH_WINDOW:
                total -= (
                    self.scored[i - SMOOTH_WINDOW]
                    if math.isfinite(self.scored[i - SMOOTH_WINDOW])
                    else 1e9
                )
            out.append(total / min(i + 1, SMOOTH_WINDOW))
        return out


# -- one run -------------------------------------------------------------------------------------


def _engines(on_alert=None, rules: dict[str, list[AlertRule]] | None = None) -> list:
    """The three monitors' engines; ``rules``: monitor name -> its rules (default: the defaults)."""
    rules = rules or {}
    return [
        QKSpectrum(update_spectrum=True, on_alert=on_alert, alerts=rules.get("QKSpectrumMonitor")),
        AttentionEntropy(on_alert=on_alert, alerts=rules.get("AttentionEntropyMonitor")),
        EffectiveRank(
            max_probe_tokens=32, on_alert=on_alert, alerts=rules.get("EffectiveRankMonitor")
        ),
    ]


def _alert_row(alert: Alert) -> dict[str, Any]:
    return {
        "rule": alert.rule.name,
        "layer": alert.layer,
        "head": alert.head if alert.rule.per_head else None,
        "step": alert.step,
        "value": alert.value,
        "message": alert.message(),
    }


def train_run(spec: RunSpec) -> RunRecord:
    """Train one run with the monitors and their default rules; record losses, probes and alerts."""
    # one process per core: threads only fight each other on a shared machine; THREADS_ENV
    # (benchmarks/margins.py) trains in another environment, two threads per run
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
    logging.getLogger("qkmonitor").setLevel(
        logging.WARNING
    )  # the discovery line, once per run: noise here
    torch.manual_seed(spec.seed)
    family = spec.task
    model = family.model(spec.qk_norm, **_rounding(spec))
    optimizers = _optimizers(model, spec)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, _lr_lambda(spec)) for o in optimizers]
    injection = Injection(model, spec) if spec.fault == "inject" else None
    fired: list[Alert] = []
    engines = _engines(on_alert=lambda owner, alert: fired.append(alert))
    clip = None if spec.clip_tau is None else QKClipEngine(tau=spec.clip_tau, every_n_steps=1)
    monitoring = Monitoring(
        model, engines + ([clip] if clip else []), optimizer=optimizers[0], every_n_steps=EVERY
    )
    losses, scored = [], []
    probes: dict[int, dict[str, list[list[float]]]] = {}
    batches = family.batches(spec.seed)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # the alerts are collected by on_alert; non-finite values are recorded
        for step in range(spec.steps):
            batch = next(batches)
            if injection is not None:
                injection.step = step
            with monitoring.step(step):
                with _precision(spec, step):
                    loss = family.loss(model, batch)
                monitoring.observe_loss(loss)
                loss.backward()
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            for schedule in schedules:
                schedule.step()
            losses.append(float(loss))
            if step % family.held_out_every == 0 or step >= spec.steps - FINAL_WINDOW:
                held = family.held_out(model, spec.seed)
            scored.append(losses[-1] if held is None else held)
            for engine in engines:
                if engine.schedule.latest_step == step:
                    probe = probes.setdefault(step, {})
                    probe.update(
                        {
                            name: [layer.tolist() for layer in grid]
                            for name, grid in engine.latest.items()
                        }
                    )
                    if engine.latest_run:  # the output logits' run values
                        probe.setdefault(RUN, {}).update(engine.latest_run)
    alerts = [_alert_row(a) for a in fired]
    clips = sum(int(c.sum()) for c in clip.clip_counts) if clip else 0
    return RunRecord(spec, losses, scored, probes, alerts, time.perf_counter() - start, clips=clips)


def _rounding(spec: RunSpec) -> dict[str, str]:
    """The model's ``attention_rounding`` in a bf16 arm (``"bf16_kernel"``: ``"kernel"``), none
    elsewhere (the config's default)."""
    if spec.fault is None or not spec.fault.startswith("bf16_"):
        return {}
    return {"rounding": spec.fault.removeprefix("bf16_")}


def _precision(spec: RunSpec, step: int):
    """The forward's precision: bf16 autocast in a bf16 arm from the fault's step on (the torch
    backend then computes attention from bf16 inputs, rounding as the model's config says);
    float32 elsewhere."""
    if _rounding(spec) and step >= spec.fault_step:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _lr_lambda(spec: RunSpec):
    """The learning-rate factor of optimizer step ``step``: the warmup, and in the ``lr_jump``
    fault the factor ``spec.magnitude`` from the fault's step on (a scheduler bug)."""
    if spec.fault != "lr_jump":
        return lambda step: lr_factor(step, spec.warmup)
    start, jump = spec.fault_step, spec.magnitude
    return lambda step: lr_factor(step, spec.warmup) * (jump if step >= start else 1.0)


class Injection:
    """The ``inject`` fault (``families.Fault``): from the fault's step on, a hook on the backward
    of every attention layer's W_Q and W_K adds to their gradient ``G`` the error
    ``magnitude * ||G||_F * D``: ``D`` a fixed random direction of the fault's rank and unit
    Frobenius norm per layer (drawn from a generator seeded by the run's seed), the same for W_Q
    and W_K and of one sign throughout: a small, consistently biased low-rank error in the
    attention's weight updates (Huang et al. 2026's injection; Qiu & Yao 2025's bias). Its drift
    ``-aD`` of both weights adds ``a^2 (v.x)(v.y) |u_h|^2`` to a head's logits: they grow.

    ``step`` is set by the training loop before each step's backward; before the fault's step
    the hooks change nothing (the run is its twin's, bit for bit)."""

    def __init__(self, model: nn.Module, spec: RunSpec) -> None:
        fault: Fault = FAULTS[spec.family]
        self.start, self.magnitude, self.step = spec.fault_step, spec.magnitude, -1
        gen = torch.Generator().manual_seed(30_000 + spec.seed)
        for layer in (m for m in model.modules() if isinstance(m, MultiHeadAttention)):
            rows, cols = layer.q_proj.weight.shape
            u = torch.randn(rows, fault.rank, generator=gen)
            v = torch.randn(cols, fault.rank, generator=gen)
            direction = u @ v.T
            for weight in (layer.q_proj.weight, layer.k_proj.weight):
                part = direction[: weight.shape[0]]
                weight.register_hook(self._hook(part / part.norm()))

    def _hook(self, direction: Tensor):
        def add_error(grad: Tensor) -> Tensor | None:
            if self.step < self.start:
                return None
            return grad + self.magnitude * grad.norm() * direction.to(grad.dtype)

        return add_error


def _optimizers(model: nn.Module, spec: RunSpec) -> list[torch.optim.Optimizer]:
    """AdamW (betas 0.9/0.98, weight decay on matrices) on every parameter; or, for ``"muon"``,
    ``torch.optim.Muon`` on the 2-D weights of the transformer blocks and AdamW at a tenth of the
    rate on the rest (embeddings, heads, norms), as Muon's authors do."""
    family = spec.task

    def adamw(matrices: list, others: list, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            [
                {"params": matrices, "weight_decay": family.weight_decay},
                {"params": others, "weight_decay": 0.0},
            ],
            lr=lr,
            betas=(0.9, 0.98),
        )

    named = list(model.named_parameters())
    if spec.optimizer == "adamw":
        matrices = [p for _, p in named if p.dim() >= 2]
        return [adamw(matrices, [p for _, p in named if p.dim() < 2], spec.lr)]
    hidden = [p for n, p in named if p.dim() == 2 and n.split(".")[0] in BLOCK_CONTAINERS]
    chosen = {id(p) for p in hidden}
    rest = [p for _, p in named if id(p) not in chosen]
    return [
        torch.optim.Muon(hidden, lr=spec.lr, weight_decay=family.weight_decay),
        adamw([p for p in rest if p.dim() >= 2], [p for p in rest if p.dim() < 2], spec.lr / 10),
    ]


def replay(
    record: RunRecord, rules: dict[str, list[AlertRule]] | None = None
) -> list[dict[str, Any]]:
    """The alerts the rules fire on the recorded values, through the engines' own path
    (``observe_loss`` at every step, ``MonitorEngine.record`` at the probes: tracker, actions,
    ``on_alert``); no training, no measuring.

    Args:
        rules: monitor name (``"QKSpectrumMonitor"``, ...) -> the rules to try instead of its
            defaults, e.g. to evaluate a rule of your own on the recorded sweep.
    """
    fired: list[Alert] = []
    engines = _engines(on_alert=lambda owner, alert: fired.append(alert), rules=rules)
    logging.getLogger("qkmonitor").setLevel(logging.WARNING)
    monitoring = Monitoring(
        record.spec.task.model(record.spec.qk_norm), engines, every_n_steps=EVERY
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, loss in enumerate(record.losses):
            # the live order: a step's loss is seen before its activation probe is logged; the
            # weights probed at step s were logged after the update of step s - 1
            for engine in engines:
                if step in record.probes and isinstance(engine, QKSpectrum):
                    _replay_probe(engine, monitoring, record.probes[step], step)
            monitoring.observe_loss(loss, step)
            if step in record.probes:
                for engine in engines:
                    if not isinstance(engine, QKSpectrum):
                        _replay_probe(engine, monitoring, record.probes[step], step)
    return [_alert_row(a) for a in fired]


def _replay_probe(
    engine, monitoring: Monitoring, probe: dict[str, list[list[float]]], step: int
) -> None:
    values = {
        m: [torch.tensor(layer) for layer in grid]
        for m, grid in probe.items()
        if m in engine.metric_names
    }
    if values:
        run = probe.get(RUN) if isinstance(engine, AttentionEntropy) else None
        engine.record(monitoring.host, values, step, run_values=run)


# -- the cache -----------------------------------------------------------------------------------


def _save(record: RunRecord, cache: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    data = {
        "version": RECORD_VERSION,
        "spec": dataclasses.asdict(record.spec),
        "family": dataclasses.asdict(record.spec.task),
        "losses": record.losses,
        "scored": record.scored,
        "probes": {str(k): v for k, v in record.probes.items()},
        "live_alerts": record.live_alerts,
        "seconds": record.seconds,
        "clips": record.clips,
    }
    (cache / f"{record.spec.key}.json").write_text(json.dumps(data))


def _load(
    spec: RunSpec, cache: Path, versions: tuple[int, ...] = (RECORD_VERSION,)
) -> RunRecord | None:
    """The cached run of ``spec``, or None (absent, or recorded by a ``RECORD_VERSION`` not in
    ``versions``: an older record lacks the metrics added since, which a caller that reads none of
    them may accept)."""
    path = cache / f"{spec.key}.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("version") not in versions or data.get("family") != json.loads(
        json.dumps(dataclasses.asdict(spec.task))
    ):
        return None
    probes = {int(k): v for k, v in data["probes"].items()}
    return RunRecord(
        spec,
        data["losses"],
        data["scored"],
        probes,
        data["live_alerts"],
        data["seconds"],
        clips=data.get("clips", 0),
    )


# -- scoring -------------------------------------------------------------------------------------


@dataclass
class Scored:
    """A run with its verdicts."""

    record: RunRecord
    status: str  # "failed", "healthy", "slow" or "between"
    separation: int | None
    first_alert: int | None

    @property
    def lead(self) -> int | None:
        if self.separation is None or self.first_alert is None:
            return None
        return self.separation - self.first_alert

    @property
    def in_time(self) -> bool:
        """Flagged early enough: ``MIN_LEAD`` steps before a separation after ``EARLY``, or (an
        earlier separation) by the first probe at or after it."""
        if self.separation is None or self.first_alert is None:
            return False
        if self.separation > EARLY:
            return self.separation - self.first_alert >= MIN_LEAD
        first_seeing = -(-self.separation // EVERY) * EVERY  # the first probe step >= separation
        return self.first_alert <= first_seeing


def _ratio(loss: float, reference: float, floor: float) -> float:
    return (loss + floor) / (reference + floor)


def separation_step(run: RunRecord, best: RunRecord) -> int | None:
    """The first step from which ``run``'s smoothed scored loss stays above ``SEPARATION_RATIO``
    x ``best``'s (both plus the family's floor)."""
    floor = run.spec.task.floor
    above = [
        _ratio(a, b, floor) > SEPARATION_RATIO for a, b in zip(run.smoothed(), best.smoothed())
    ]
    if not above or not above[-1]:
        return None
    step = len(above)
    while step > 0 and above[step - 1]:
        step -= 1
    return step


def score(records: list[RunRecord]) -> list[Scored]:
    """Verdicts for every run (see the module docstring for the definitions), per family."""
    out = []
    for family in sorted({r.spec.family for r in records}):
        runs = [r for r in records if r.spec.family == family]
        if family in FAULTS:
            out += score_faults(runs)
            continue
        floor = FAMILIES[family].floor
        best = min(runs, key=lambda r: r.final_loss)
        best_lr = {}
        for variant in {_variant(r.spec) for r in runs}:
            by_lr: dict[float, list[float]] = {}
            for r in runs:
                if _variant(r.spec) == variant:
                    by_lr.setdefault(r.spec.lr, []).append(r.final_loss)
            best_lr[variant] = min(by_lr, key=lambda lr: statistics.fmean(by_lr[lr]))
        for r in runs:
            ratio = _ratio(r.final_loss, best.final_loss, floor)
            if ratio <= HEALTHY_RATIO:
                status = "healthy"
            elif ratio >= FAIL_RATIO:
                status = "failed" if r.spec.lr > best_lr[_variant(r.spec)] else "slow"
            else:
                status = "between"
            reference = min(
                (b for b in runs if b.spec.seed == r.spec.seed), key=lambda b: b.final_loss
            )
            first = min((a["step"] for a in r.alerts), default=None)
            out.append(Scored(r, status, separation_step(r, reference), first))
    return out


def score_faults(runs: list[RunRecord]) -> list[Scored]:
    """Verdicts in a fault family: each faulted run against its **twin** (same seed and QK-norm,
    no fault). It **failed** when its final loss is >= ``FAIL_RATIO`` x the twin's (plus the
    floor), else it **survived**; its loss separates where it stays above ``SEPARATION_RATIO`` x
    the twin's; its first alert is the first at or after the fault's step (before it the run is
    its twin, whose alerts are the twin's). A twin is **healthy** within ``HEALTHY_RATIO`` x the
    family's best twin, else ``between``; any alert on it is a false alarm."""
    floor = runs[0].spec.task.floor
    twins = {(r.spec.seed, r.spec.qk_norm): r for r in runs if r.spec.fault is None}
    best = min(twins.values(), key=lambda r: r.final_loss, default=None)
    out = []
    for r in runs:
        twin = twins.get((r.spec.seed, r.spec.qk_norm))
        if r.spec.fault is None:
            healthy = _ratio(r.final_loss, best.final_loss, floor) <= HEALTHY_RATIO
            first = min((a["step"] for a in r.alerts), default=None)
            out.append(Scored(r, "healthy" if healthy else "between", None, first))
            continue
        if twin is None:
            raise ValueError(f"{r.spec.key}: its twin (no fault) is not in the sweep")
        failed = _ratio(r.final_loss, twin.final_loss, floor) >= FAIL_RATIO
        first = min((a["step"] for a in r.alerts if a["step"] >= r.spec.fault_step), default=None)
        status = "failed" if failed else "survived"
        out.append(Scored(r, status, separation_step(r, twin), first))
    return out


def _variant(spec: RunSpec) -> tuple[bool, bool]:
    """(warmup, QK-norm): runs whose best learning rate is looked for together."""
    return spec.warmup > 0, spec.qk_norm


def summary(scored: list[Scored]) -> dict[str, Any]:
    """Recall, precision, lead times and false alarms: per split (the validation one counts), per
    family, and over all."""

    def block(runs: list[Scored]) -> dict[str, Any]:
        failed = [s for s in runs if s.status == "failed"]
        alerted = [s for s in runs if s.first_alert is not None]
        hits = [s for s in failed if s.first_alert is not None]
        leads = [s.lead for s in failed if s.lead is not None]
        healthy = [s for s in runs if s.status == "healthy"]
        late = [s for s in failed if s.separation is not None and s.separation > EARLY]
        early = [s for s in failed if s.separation is not None and s.separation <= EARLY]
        rules = sorted(
            {a["rule"] for s in runs for a in s.record.alerts} | {r.name for r in DEFAULT_RULES}
        )
        return {
            "runs": len(runs),
            "failed": len(failed),
            "healthy": len(healthy),
            "slow": sum(s.status == "slow" for s in runs),
            "between": sum(s.status == "between" for s in runs),
            "recall": len(hits) / len(failed) if failed else math.nan,
            "precision": len(hits) / len(alerted) if alerted else math.nan,
            "min_lead": min(leads, default=None),
            "median_lead": statistics.median(leads) if leads else None,
            "in_time": sum(s.in_time for s in failed),
            "late_separating": len(late),
            "late_in_time": sum(s.in_time for s in late),
            "early_separating": len(early),
            "early_in_time": sum(s.in_time for s in early),
            "healthy_alerted": sum(s.first_alert is not None for s in healthy),
            "false_alarm_runs": len(alerted) - len(hits),
            "per_rule": {rule: _rule_stats(runs, rule) for rule in rules},
            "intervals": detector_figures([_verdict(s) for s in runs]),
        }

    families = sorted({s.record.spec.family for s in scored})
    validation = [s for s in scored if s.record.spec.split == "validation"]
    out = {
        "validation": block(validation),
        # each validation seed alone: the spread of a figure between seeds
        **{
            f"validation, seed {seed}": block([s for s in validation if s.record.spec.seed == seed])
            for seed in sorted({s.record.spec.seed for s in validation})
        },
        "calibration": block([s for s in scored if s.record.spec.split == "calibration"]),
        "all": block([s for s in scored if s.record.spec.split != HELD_OUT]),
    }
    out.update({f: block([s for s in scored if s.record.spec.family == f]) for f in families})
    return out


#: issue 61's targets: late failures flagged in time, healthy runs alerted
TARGET_IN_TIME = 0.8
TARGET_HEALTHY_ALERTED = 1 / 40


def _verdict(s: Scored) -> dict[str, Any]:
    """The fields of a run's verdict that :func:`detector_figures` reads (as the JSON has them)."""
    return {"status": s.status, "separation": s.separation, "first_alert": s.first_alert,
            "lead": s.lead, "in_time": s.in_time}  # fmt: skip


def detector_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 61's figures of a set of runs (verdicts as :func:`_verdict` or the JSON's run rows
    give them), each proportion with its 95 % Wilson interval (``intervals.share``): late
    failures flagged in time, early ones by the next probe, healthy runs alerted; the median lead
    of the failed runs flagged, with its order-statistic interval and that interval's coverage;
    whether each target is met (by the share itself) and by how much it is missed."""
    failed = [r for r in rows if r["status"] == "failed"]
    late = [r for r in failed if r["separation"] is not None and r["separation"] > EARLY]
    early = [r for r in failed if r["separation"] is not None and r["separation"] <= EARLY]
    healthy = [r for r in rows if r["status"] == "healthy"]
    leads = [r["lead"] for r in failed if r["lead"] is not None]
    interval = median_interval(leads)
    in_time = share(sum(bool(r["in_time"]) for r in late), len(late))
    alerted = share(sum(r["first_alert"] is not None for r in healthy), len(healthy))
    return {
        "late_in_time": in_time,
        "early_in_time": share(sum(bool(r["in_time"]) for r in early), len(early)),
        "healthy_alerted": alerted,
        "median_lead": {
            "median": statistics.median(leads) if leads else None,
            "interval": None if interval is None else list(interval[:2]),
            "coverage": None if interval is None else round(interval[2], 4),
            "method": "order statistics (binomial)",
        },
        "targets": _targets(in_time, alerted),
    }


def _targets(in_time: dict[str, Any], alerted: dict[str, Any]) -> dict[str, Any]:
    """Each target met or not (by the share), and the points it is missed by."""
    out = {}
    for name, figure, target, better in (
        ("late_in_time >= 0.8", in_time, TARGET_IN_TIME, 1),
        ("healthy_alerted <= 1/40", alerted, TARGET_HEALTHY_ALERTED, -1),
    ):
        if figure["share"] is None:
            continue
        missed_by = max(0.0, better * (target - figure["share"]))
        out[name] = {"met": missed_by == 0, "missed_by": round(missed_by, 4)}
    return out


def _rule_stats(runs: list[Scored], rule: str) -> dict[str, Any]:
    """How one rule did on its own: runs it fired on, failed runs it flagged in time, false
    alarms."""

    def alone(s: Scored) -> Scored:
        first = min((a["step"] for a in s.record.alerts if a["rule"] == rule), default=None)
        return Scored(s.record, s.status, s.separation, first)

    fired = [alone(s) for s in runs if alone(s).first_alert is not None]
    failed = [s for s in runs if s.status == "failed"]
    not_failed = [s for s in runs if s.status != "failed"]
    return {
        "runs_fired": len(fired),
        "failed_fired": sum(s.status == "failed" for s in fired),
        "failed_in_time": sum(alone(s).in_time for s in failed),
        "failed": len(failed),
        "false_alarms": sum(s.status != "failed" for s in fired),
        "false_alarm_rate": sum(s.status != "failed" for s in fired) / len(not_failed)
        if not_failed
        else math.nan,
        "healthy_fired": sum(s.status == "healthy" for s in fired),
    }


def opt_in_stats(records: list[RunRecord], rule: AlertRule, monitor: str) -> dict[str, Any]:
    """A rule that is not a default, replayed alone on the recorded runs."""
    saved = [r.alerts for r in records]
    try:
        for r in records:
            r.alerts = replay(r, {m: [rule] if m == monitor else [] for m in MONITORS})
        return _rule_stats(
            [s for s in score(records) if s.record.spec.split == "validation"], rule.name
        )
    finally:
        for r, alerts in zip(records, saved):
            r.alerts = alerts


# -- output --------------------------------------------------------------------------------------


def draw(scored: list[Scored], path: Path) -> None:
    """Per family: final scored loss and largest attention logit against the learning rate, with
    and without warmup, alerted runs marked (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    families = sorted({s.record.spec.family for s in scored})
    figure = Figure(figsize=(10, 2.9 * len(families)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(families), 2, squeeze=False)
    styles = {
        (True, False): ("tab:blue", "warmup"),
        (False, False): ("tab:red", "no warmup"),
        (True, True): ("tab:cyan", "warmup, QK-norm"),
        (False, True): ("tab:orange", "no warmup, QK-norm"),
    }
    for row, family in enumerate(families):
        runs = [s for s in scored if s.record.spec.family == family]
        best = min(s.record.final_loss for s in runs)
        floor = FAMILIES[family].floor
        loss_ax, logit_ax = axes[row]
        for variant in sorted({_variant(s.record.spec) for s in runs}, reverse=True):
            color, label = styles[variant]
            group = [s for s in runs if _variant(s.record.spec) == variant]
            lrs = sorted({s.record.spec.lr for s in group})
            for ax, value in (
                (loss_ax, lambda s: s.record.final_loss),
                (logit_ax, lambda s: s.record.max_logit),
            ):
                mean = [
                    statistics.fmean(value(s) for s in group if s.record.spec.lr == lr)
                    for lr in lrs
                ]
                ax.plot(lrs, mean, "-", color=color, alpha=0.6, label=label)
                quiet = [s for s in group if s.first_alert is None]
                loud = [s for s in group if s.first_alert is not None]
                ax.scatter(
                    [s.record.spec.lr for s in quiet],
                    [value(s) for s in quiet],
                    facecolors="none",
                    edgecolors=color,
                    s=24,
                    zorder=3,
                )
                ax.scatter(
                    [s.record.spec.lr for s in loud],
                    [value(s) for s in loud],
                    color=color,
                    marker="X",
                    s=50,
                    zorder=4,
                )
        split = (
            "validation"
            if all(s.record.spec.split == "validation" for s in runs)
            else "seed 0 calibration"
        )
        loss_ax.axhline(FAIL_RATIO * (best + floor) - floor, color="grey", ls="--", lw=0.8)
        loss_ax.axhline(HEALTHY_RATIO * (best + floor) - floor, color="grey", ls=":", lw=0.8)
        _label(
            loss_ax,
            logit_ax,
            f"{family} ({split}): final loss; X alerted, -- failed, ·· healthy",
            f"{family}: largest attention logit over training",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


def _label(loss_ax, logit_ax, loss_title: str, logit_title: str) -> None:
    """A family's row of the figures: final loss and largest logit against the learning rate."""
    loss_ax.set(xscale="log", xlabel="peak learning rate", ylabel="final loss (nats)")
    loss_ax.set_title(loss_title, fontsize=9)
    logit_ax.set(
        xscale="log", yscale="log", xlabel="peak learning rate", ylabel="max attention logit"
    )
    logit_ax.set_title(logit_title, fontsize=9)
    loss_ax.legend(fontsize=7)


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return "—" if math.isnan(value) else f"{value:.2f}"
    return str(value)


def tables(scored: list[Scored], stats: dict[str, Any]) -> str:
    """Markdown: per-run verdicts, per-rule false alarms (validation), the summary per split and
    family."""
    lines = [
        (
            "| family | split | warmup | lr | seed | final loss | max logit | status | separates "
            "at | first alert | in time | rules |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sorted(
        scored,
        key=lambda s: (
            s.record.spec.family,
            s.record.spec.qk_norm,
            -s.record.spec.warmup,
            s.record.spec.lr,
            s.record.spec.seed,
        ),
    ):
        spec = s.record.spec
        rules = sorted({a["rule"] for a in s.record.alerts})
        lines.append(
            f"| {spec.family}{' (QK-norm)' if spec.qk_norm else ''} | {spec.split[:3]} | "
            f"{spec.warmup} | {spec.lr:g} | {spec.seed} | {s.record.final_loss:.3f} | "
            f"{s.record.max_logit:.3g} | {s.status} | {_fmt(s.separation)} | {_fmt(s.first_alert)} "
            f"| {'yes' if s.in_time else '—'} | {', '.join(rules) or '—'} |"
        )
    lines += [
        "",
        (
            "| rule (validation set) | runs fired | failed runs flagged (in time) | false alarms "
            "(runs not failed) | false-alarm rate | healthy runs fired |"
        ),
        "|---|---|---|---|---|---|",
    ]
    rows = {
        **stats["validation"]["per_rule"],
        **{f"{k} (opt-in)": v for k, v in stats.get("opt_in", {}).items()},
    }
    for rule, r in rows.items():
        lines.append(
            f"| `{rule}` | {r['runs_fired']} | {r['failed_fired']}/{r['failed']} "
            f"({r['failed_in_time']}) | {r['false_alarms']} | {_fmt(r['false_alarm_rate'])} | "
            f"{r['healthy_fired']} |"
        )
    lines += [
        "",
        (
            "| set | runs | failed | healthy | recall | precision | separating after step 30: "
            f"flagged >= {MIN_LEAD} steps ahead | separating by step 30: flagged by the next probe "
            "| median lead | healthy runs alerted |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, b in ((k, v) for k, v in stats.items() if k != "opt_in"):
        lines.append(
            f"| {name} | {b['runs']} | {b['failed']} | {b['healthy']} | {_fmt(b['recall'])} | "
            f"{_fmt(b['precision'])} | {b['late_in_time']}/{b['late_separating']} | "
            f"{b['early_in_time']}/{b['early_separating']} | {_fmt(b['median_lead'])} | "
            f"{b['healthy_alerted']} |"
        )
    return "\n".join(lines)


def write_json(
    scored: list[Scored], stats: dict[str, Any], path: Path, settings: dict[str, Any]
) -> None:
    runs = [
        {
            "family": s.record.spec.family,
            "split": s.record.spec.split,
            "lr": s.record.spec.lr,
            "warmup": s.record.spec.warmup,
            "qk_norm": s.record.spec.qk_norm,
            "seed": s.record.spec.seed,
            "final_loss": s.record.final_loss,
            "max_logit": s.record.max_logit,
            "status": s.status,
            "separation": s.separation,
            "first_alert": s.first_alert,
            "lead": s.lead,
            "in_time": s.in_time,
            "alerts": [
                {k: a[k] for k in ("rule", "layer", "head", "step", "value")}
                for a in s.record.alerts
            ],
        }
        for s in scored
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"settings": settings, "summary": stats, "runs": runs}, indent=1) + "\n"
    )


# -- main ----------------------------------------------------------------------------------------


def sweep(args: argparse.Namespace) -> list[RunSpec]:
    """Every run: per family, its rates x warmup arms (the family's own, or ``--warmups``) x seeds
    (from a family's :data:`FIRST_SEED`) (x QK-norm with ``--qk-norm``)."""
    specs = []
    for name in args.families:
        if name in FAULTS:
            specs += fault_specs(name, args)
            continue
        family = FAMILIES[name]
        steps = int(family.steps * 0.6) if args.quick else family.steps
        lrs = (
            (family.lrs[1::2] if len(family.lrs) % 2 == 0 else family.lrs[::2])
            if args.quick
            else family.lrs
        )
        seeds = [s for s in args.seeds if s >= FIRST_SEED.get(name, 0)]
        if name in FIRST_SEED and args.quick:
            seeds = [FIRST_SEED[name]]
        for seed in seeds:
            for warmup in family.warmups or args.warmups:
                for qk in (False, True) if args.qk_norm else (False,):
                    specs += [RunSpec(name, lr, qk, seed, warmup, steps) for lr in lrs]
    return specs


def fault_specs(name: str, args: argparse.Namespace) -> list[RunSpec]:
    """A fault family's runs: per seed of its own that ``--seeds`` names (with ``--quick``, seed
    0), its twin and each faulted arm (``Fault.arms``), at its rate, warmup and full length (its
    fault starts after the heads formed: a shorter run would cut it), x QK-norm with
    ``--qk-norm``."""
    fault = FAULTS[name]
    seeds = [s for s in args.seeds if s in fault.seeds]
    return [
        RunSpec(name, fault.lr, qk, seed, fault.warmup, fault.steps, fault=f, magnitude=m)
        for seed in seeds
        for qk in ((False, True) if args.qk_norm else (False,))
        for f, m in fault.arms(args.quick)
    ]


# -- the fault families (held out; issue 61, item 2) ---------------------------------------------


def fault_row(s: Scored) -> dict[str, Any]:
    """One run of a fault family: its fault, verdict, separation from its twin, first alert after
    the fault's step (and each rule's), lead, ``in_time`` (the sweep's definition),
    ``by_next_probe`` (flagged by the first probe at or after its separation: all a monitor can
    do for a loss that jumps at the fault) and ``halfway`` (flagged no later than halfway between
    the fault's step and the separation: issue 61's target for numerical faults)."""
    spec, start = s.record.spec, s.record.spec.fault_step
    rules: dict[str, int] = {}
    for a in sorted(s.record.alerts, key=lambda a: a["step"]):
        if spec.fault is None or a["step"] >= start:
            rules.setdefault(a["rule"], a["step"])
    separation, first = s.separation, s.first_alert
    return {
        "key": spec.key, "family": spec.family, "seed": spec.seed, "qk_norm": spec.qk_norm,
        "fault": spec.fault, "magnitude": spec.magnitude, "fault_step": start,
        "final_loss": s.record.final_loss, "max_logit": s.record.max_logit, "status": s.status,
        "separation": separation, "first_alert": first, "lead": s.lead, "in_time": s.in_time,
        "by_next_probe": None if separation is None or first is None
        else first <= -(-separation // EVERY) * EVERY,
        "halfway": None if separation is None or first is None
        else first <= start + (separation - start) / 2,
        "halfway_rule": None if separation is None else _halfway_rule(rules, start, separation),
        "rules": rules, "seconds": s.record.seconds,
    }  # fmt: skip


#: rules that wait for the loss to go wrong (a condition on the loss itself, e.g. loss_vs_best:
#: logit_plateau); a loss gate, which only keeps a rule quiet while the loss falls, does not count
LOSS_RULES = frozenset(
    r.name for r in (*DEFAULT_RULES, *(rule for rule, _ in OPT_IN))
    if any(c.metric in LOSS_SIGNALS for c in r.also)
)  # fmt: skip


def _halfway_rule(rules: dict[str, int], start: int, separation: int) -> str | None:
    """The first rule that reads the weights or the attention (not one of :data:`LOSS_RULES`)
    to fire no later than halfway from the fault's step to the separation; None if none did."""
    early = [(step, rule) for rule, step in rules.items() if rule not in LOSS_RULES]
    early = [(step, rule) for step, rule in early if step <= start + (separation - start) / 2]
    return min(early)[1] if early else None


def fault_summary(scored: list[Scored]) -> dict[str, Any]:
    """Per fault family: the sweep's block (failed, in time, lead, healthy twins alerted) and per
    arm (fault and magnitude): runs, failed, flagged, in time, by the next probe, halfway, and the
    median lead; every run's row (:func:`fault_row`)."""
    out: dict[str, Any] = {"families": {}, "runs": [fault_row(s) for s in scored]}
    for family in sorted({s.record.spec.family for s in scored}):
        runs = [s for s in scored if s.record.spec.family == family]
        arms: dict[str, Any] = {}
        for fault, magnitude in FAULTS[family].arms():
            rows = [
                fault_row(s) for s in runs
                if (s.record.spec.fault, s.record.spec.magnitude) == (fault, magnitude)
            ]  # fmt: skip
            if not rows:
                continue
            failed = [r for r in rows if r["status"] == "failed"]
            leads = [r["lead"] for r in failed if r["lead"] is not None]
            arms[_arm_name(fault, magnitude)] = {
                "runs": len(rows), "failed": len(failed),
                "alerted": sum(r["first_alert"] is not None for r in rows),
                "failed_flagged": sum(r["first_alert"] is not None for r in failed),
                "in_time": sum(bool(r["in_time"]) for r in failed),
                "by_next_probe": sum(bool(r["by_next_probe"]) for r in failed),
                "halfway": sum(bool(r["halfway"]) for r in failed),
                "median_lead": statistics.median(leads) if leads else None,
                "intervals": fault_figures(rows),
            }  # fmt: skip
        groups = {
            fault or "twin": fault_figures(
                [fault_row(s) for s in runs if s.record.spec.fault == fault]
            )
            for fault in dict.fromkeys(s.record.spec.fault for s in runs)
        }
        out["families"][family] = {"sweep": summary(runs)[family], "arms": arms, "faults": groups}
    return out


def fault_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 61's figures of fault-family runs (:func:`fault_row`), each proportion with its 95 %
    Wilson interval: of the failed runs, flagged in time (>= 10 steps ahead), by the next probe,
    by halfway, and by halfway by a rule that reads the weights or the attention (not one that
    waits for the loss: :data:`LOSS_RULES`), with the rules that did; of all the runs, those
    alerted (for a twin: a healthy run alerted); the median lead with its order-statistic
    interval."""
    failed = [r for r in rows if r["status"] == "failed"]
    leads = [r["lead"] for r in failed if r["lead"] is not None]
    interval = median_interval(leads)
    return {
        "in_time": share(sum(bool(r["in_time"]) for r in failed), len(failed)),
        "by_next_probe": share(sum(bool(r["by_next_probe"]) for r in failed), len(failed)),
        "halfway": share(sum(bool(r["halfway"]) for r in failed), len(failed)),
        "halfway_weights_or_attention": share(
            sum(r["halfway_rule"] is not None for r in failed), len(failed)
        ),
        "halfway_rules": sorted({r["halfway_rule"] for r in failed} - {None}),
        "alerted": share(sum(r["first_alert"] is not None for r in rows), len(rows)),
        "median_lead": {
            "median": statistics.median(leads) if leads else None,
            "interval": None if interval is None else list(interval[:2]),
            "coverage": None if interval is None else round(interval[2], 4),
        },
    }


def _arm_name(fault: str | None, magnitude: float | None) -> str:
    """``"twin"``, ``"inject 0.3"``, ``"lr_jump 10"``, ``"bf16_kernel"``."""
    if fault is None:
        return "twin"
    return fault if magnitude is None else f"{fault} {magnitude:g}"


def fault_tables(stats: dict[str, Any]) -> str:
    """Markdown: every fault-family run, then per family and arm the counts."""
    lines = [
        (
            "| run | fault step | final loss | max logit | status | separates at | first alert "
            "(after the fault) | lead | in time | by next probe | halfway | rules (first step) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in stats["runs"]:
        rules = ", ".join(f"{k} {v}" for k, v in sorted(r["rules"].items(), key=lambda x: x[1]))
        cells = (
            r["key"], r["fault_step"], f"{r['final_loss']:.3f}", f"{r['max_logit']:.3g}",
            r["status"], r["separation"], r["first_alert"], r["lead"], r["in_time"] or "—",
            r["by_next_probe"], r["halfway"], rules or "—",
        )  # fmt: skip
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    lines += [
        "",
        (
            "| family | arm | runs | failed | failed flagged | in time (>= 10 steps ahead) | by "
            "the next probe | halfway | median lead | runs alerted |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for family, f in stats["families"].items():
        for arm, a in f["arms"].items():
            lines.append(
                f"| {family} | {arm} | {a['runs']} | {a['failed']} | {a['failed_flagged']} | "
                f"{a['in_time']} | {a['by_next_probe']} | {a['halfway']} | "
                f"{_fmt(a['median_lead'])} | {a['alerted']} |"
            )
    return "\n".join(lines)


def _cell(figure: dict[str, Any]) -> str:
    """A :func:`intervals.share` as a table cell: ``"16/27 (59 %; 41–75 %)"``."""
    return fmt_share(figure["k"], figure["n"]) if figure["n"] else "—"


def _lead_cell(lead: dict[str, Any]) -> str:
    """A median lead with its order-statistic interval and coverage, or ``—``."""
    if lead["median"] is None:
        return "—"
    low, high = lead["interval"]
    return f"{lead['median']:g} ({low:g} to {high:g}, {100 * lead['coverage']:.0f} %)"


def figures_table(stats: dict[str, Any]) -> str:
    """Markdown: issue 61's detector figures of the sweep's sets (validation, each of its seeds,
    calibration), each proportion with its 95 % Wilson interval, and the targets."""
    lines = [
        (
            "| set | late failures flagged >= 10 steps ahead | early failures flagged by the next "
            "probe | median lead (steps; interval, coverage) | healthy runs alerted | targets met |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for name in [k for k in stats if k.startswith("validation") or k == "calibration"]:
        f = stats[name]["intervals"]
        targets = ", ".join(
            f"{t}: " + ("yes" if v["met"] else f"no, by {100 * v['missed_by']:.1f} points")
            for t, v in f["targets"].items()
        )
        cells = (name, _cell(f["late_in_time"]), _cell(f["early_in_time"]),
                 _lead_cell(f["median_lead"]), _cell(f["healthy_alerted"]), targets)  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fault_figures_table(stats: dict[str, Any]) -> str:
    """Markdown: issue 61's detector figures of each fault family, per fault (all its arms) and
    per arm, each proportion with its 95 % Wilson interval."""
    lines = [
        (
            "| family | arms | failed / runs | failed flagged >= 10 steps ahead | by the next "
            "probe | by halfway | by halfway, by a weight or attention rule (which) | median lead "
            "(steps; interval, coverage) | runs alerted |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for family, fam in stats["families"].items():
        rows = [(f"{fault} (all)", g) for fault, g in fam["faults"].items()]
        rows += [(arm, a["intervals"]) for arm, a in fam["arms"].items() if arm != "twin"]
        for arm, f in rows:
            which = ", ".join(f"`{r}`" for r in f["halfway_rules"])
            cells = (
                family, arm, f"{f['in_time']['n']} / {f['alerted']['n']}", _cell(f["in_time"]),
                _cell(f["by_next_probe"]), _cell(f["halfway"]),
                _cell(f["halfway_weights_or_attention"]) + (f": {which}" if which else ""),
                _lead_cell(f["median_lead"]), _cell(f["alerted"]),
            )  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_faults(scored: list[Scored], args: argparse.Namespace, suffix: str) -> dict[str, Any]:
    """The fault families' figure, JSON (``instability_faults{suffix}.*``) and tables."""
    stats = fault_summary(scored)
    draw_faults(scored, args.out / f"instability_faults{suffix}.png")
    settings = {
        "faults": {n: dataclasses.asdict(FAULTS[n]) for n in args.families if n in FAULTS},
        "seeds": args.seeds, "qk_norm": args.qk_norm, "every_n_steps": EVERY,
        "quick": args.quick,
    }  # fmt: skip
    path = args.out / f"instability_faults{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "summary": stats}, indent=1) + "\n")
    print(fault_tables(stats) + "\n")
    print(fault_figures_table(stats) + "\n")
    return stats


def draw_faults(scored: list[Scored], path: Path) -> None:
    """Per fault family and seed: the scored loss (10-step mean) and the largest attention logit
    of the twin and each arm against the step; the fault's step dotted, first alerts marked X."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = sorted({(s.record.spec.family, s.record.spec.seed) for s in scored})
    figure = Figure(figsize=(10, 2.4 * len(groups)), dpi=70, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(groups), 2, squeeze=False)
    for (family, seed), (loss_ax, logit_ax) in zip(groups, axes):
        for s in (
            s for s in scored if (s.record.spec.family, s.record.spec.seed) == (family, seed)
        ):
            label = _arm_name(s.record.spec.fault, s.record.spec.magnitude)
            smooth = s.record.smoothed()
            steps = sorted(s.record.probes)
            logits = [max(max(row) for row in s.record.probes[t]["max_logit"]) for t in steps]
            line = loss_ax.plot(smooth, lw=1, label=label)[0]
            logit_ax.plot(steps, logits, lw=1, color=line.get_color())
            if s.first_alert is not None:
                loss_ax.plot(s.first_alert, smooth[s.first_alert], "X", color=line.get_color())
        for ax in (loss_ax, logit_ax):
            ax.axvline(s.record.spec.fault_step, color="grey", ls=":", lw=0.8)
        loss_ax.set(yscale="log", xlabel="step", ylabel="loss (10-step mean)")
        loss_ax.set_title(f"{family}, seed {seed}: X first alert after the fault", fontsize=9)
        logit_ax.set(yscale="log", xlabel="step", ylabel="max attention logit")
        loss_ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


# -- the QK-Clip arms (--arms) ---------------------------------------------------------------------

ARM_STYLES = {
    "AdamW": ("tab:blue", "-"),
    "AdamW + QK-Clip": ("tab:cyan", "--"),
    "Muon": ("tab:red", "-"),
    "Muon + QK-Clip": ("tab:orange", "--"),
}


def arm_specs(specs: list[RunSpec], tau: float) -> list[RunSpec]:
    """Each run of the sweep in four arms: AdamW and Muon, each without and with QK-Clip(tau)."""
    return [
        dataclasses.replace(spec, optimizer=optimizer, clip_tau=clip)
        for spec in specs
        for optimizer in ("adamw", "muon")
        for clip in (None, tau)
    ]


def arms_summary(records: list[RunRecord]) -> dict[str, Any]:
    """What QK-Clip did to each unclipped run's twin (same family, optimizer, rate, seed, warmup).

    Per family and optimizer, ``best`` is the lowest final loss of its runs, clipped or not (a
    cure cannot be asked to make AdamW reach what Muon reaches). An unclipped run **failed** when
    its final loss is >= FAIL_RATIO x best (losses plus the family's floor) at a rate above the
    best rate of its own arm (as in the alert sweep), and is **healthy** when within HEALTHY_RATIO
    x best. For a failed run: its clipped twin's ratio to best (rescued when within HEALTHY_RATIO,
    i.e. 10 %); for a healthy one: the twin's final loss against it."""
    out: dict[str, Any] = {"families": {}, "failed": [], "healthy": []}
    for family in sorted({r.spec.family for r in records}):
        floor = FAMILIES[family].floor
        in_family = [r for r in records if r.spec.family == family]
        out["families"][family] = {"best": {}}
        for run in in_family:
            runs = [r for r in in_family if r.spec.optimizer == run.spec.optimizer]
            best = min(r.final_loss for r in runs)
            out["families"][family]["best"][run.spec.optimizer] = best
            if run.spec.clip_tau is not None:
                continue
            twin = next(
                (
                    r
                    for r in runs
                    if r.spec.clip_tau is not None
                    and r.spec == dataclasses.replace(run.spec, clip_tau=r.spec.clip_tau)
                ),
                None,
            )
            if twin is None:
                continue
            same_arm = [
                r
                for r in runs
                if r.spec.clip_tau is None
                and (r.spec.optimizer, r.spec.warmup, r.spec.seed)
                == (run.spec.optimizer, run.spec.warmup, run.spec.seed)
            ]
            best_lr = min(same_arm, key=lambda r: r.final_loss).spec.lr
            ratio = _ratio(run.final_loss, best, floor)
            row = {
                "run": run.spec.key,
                "arm": run.spec.arm,
                "ratio": ratio,
                "clipped_ratio": _ratio(twin.final_loss, best, floor),
                "final": run.final_loss,
                "clipped_final": twin.final_loss,
                "max_logit": run.max_logit,
                "clipped_max_logit": twin.max_logit,
                "clips": twin.clips,
            }
            if ratio >= FAIL_RATIO and run.spec.lr > best_lr:
                out["failed"].append(row)
            elif ratio <= HEALTHY_RATIO:
                row["change"] = (twin.final_loss + floor) / (run.final_loss + floor) - 1
                out["healthy"].append(row)
    failed, healthy = out["failed"], out["healthy"]
    out["rescued"] = sum(r["clipped_ratio"] <= HEALTHY_RATIO for r in failed)
    out["healthy_changes"] = sorted(r["change"] for r in healthy)
    return out


def arms_table(records: list[RunRecord], stats: dict[str, Any]) -> str:
    """Markdown: per family and rate, each arm's final loss and largest logit (clips); then the
    failed and healthy runs' twins."""
    arms = list(ARM_STYLES)
    lines = [
        "| family | lr | " + " | ".join(arms) + " |",
        "|---|---|" + "---|" * len(arms),
    ]
    cells: dict[tuple, RunRecord] = {
        (r.spec.family, r.spec.lr, r.spec.arm): r for r in records
    }  # one seed and warmup per table
    for family in sorted({r.spec.family for r in records}):
        for lr in sorted({r.spec.lr for r in records if r.spec.family == family}):
            row = []
            for arm in arms:
                r = cells.get((family, lr, arm))
                clips = f", {r.clips} clips" if r is not None and r.spec.clip_tau else ""
                row.append("–" if r is None else f"{r.final_loss:.3f} ({r.max_logit:.3g}{clips})")
            lines.append(f"| {family} | {lr:g} | " + " | ".join(row) + " |")
    lines += [
        "",
        "| failed run | ratio to best | with QK-Clip | max logit | with QK-Clip | clips |",
        "|---|---|---|---|---|---|",
    ]
    for r in stats["failed"]:
        lines.append(
            f"| {r['run']} | {r['ratio']:.2f} | {r['clipped_ratio']:.2f} | {r['max_logit']:.3g} "
            f"| {r['clipped_max_logit']:.3g} | {r['clips']} |"
        )
    changes = stats["healthy_changes"]
    lines += [
        "",
        (
            f"failed runs rescued (within {HEALTHY_RATIO:g} x the best): {stats['rescued']} of "
            f"{len(stats['failed'])}"
        ),
        f"healthy runs: {len(changes)}; final loss with QK-Clip against without: "
        + (f"{min(changes):+.2%} to {max(changes):+.2%}" if changes else "none"),
    ]
    return "\n".join(lines)


def draw_arms(records: list[RunRecord], tau: float, path: Path) -> None:
    """Per family: final loss and largest attention logit against the learning rate, one line per
    arm (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    families = sorted({r.spec.family for r in records})
    figure = Figure(figsize=(10, 2.7 * len(families)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(families), 2, squeeze=False)
    for row, family in enumerate(families):
        loss_ax, logit_ax = axes[row]
        for arm, (color, style) in ARM_STYLES.items():
            runs = sorted(
                (r for r in records if r.spec.family == family and r.spec.arm == arm),
                key=lambda r: r.spec.lr,
            )
            lrs = sorted({r.spec.lr for r in runs})
            for ax, value in ((loss_ax, "final_loss"), (logit_ax, "max_logit")):
                mean = [
                    statistics.fmean(getattr(r, value) for r in runs if r.spec.lr == lr)
                    for lr in lrs
                ]
                ax.plot(lrs, mean, style, marker="o", ms=3, color=color, label=arm)
        logit_ax.axhline(tau, color="grey", ls=":", lw=0.8)
        _label(
            loss_ax,
            logit_ax,
            f"{family}: final loss",
            f"{family}: largest logit over training (·· tau = {tau:g})",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


def _parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rates, 1 seed, 60 %% of the steps")
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument(
        "--warmups",
        type=int,
        nargs="+",
        default=None,
        help="linear warmup steps, then the peak rate (0: none); default 50 and 0 (--arms: 50)",
    )
    parser.add_argument(
        "--arms",
        action="store_true",
        help="QK-Clip's proof: every run with AdamW and Muon, each without and with QK-Clip "
        "(seed 2 and warmup 50 unless given); figure and JSON docs/qk_clip_sweep.*",
    )
    parser.add_argument("--clip-tau", type=float, default=100.0, help="--arms: QK-Clip's tau")
    parser.add_argument("--qk-norm", action="store_true", help="every run also with QK-norm")
    parser.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel"
    )
    parser.add_argument(
        "--cache", type=Path, default=ROOT / "runs" / "instability", help="recorded runs"
    )
    parser.add_argument(
        "--replay", action="store_true", help="train nothing: score the cached runs only"
    )
    parser.add_argument(
        "--round-rules",
        type=int,
        choices=sorted(EARLIER_RULES),
        default=None,
        help="score with that earlier round's defaults instead (figure and JSON next to the cache)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the figure and the JSON go (default: docs/, or the cache with --quick)",
    )
    parser.add_argument(
        "--trajectory",
        nargs="+",
        metavar="KEY",
        help="train nothing: print the evidence of cached runs probe by probe (their keys, e.g. "
        "charlm-lr0.03-qk0-s0-w0-n250), for fitting rules on the calibration set",
    )
    parser.add_argument(
        "--intervals-from-json",
        type=Path,
        metavar="JSON",
        help="train nothing: add the 95 %% intervals to a written sweep JSON from its run rows "
        "(e.g. docs/instability.json, whose runs are not cached here) and print their table",
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    if args.intervals_from_json:
        stats = intervals_from_json(args.intervals_from_json)
        print(figures_table(stats))
        return stats
    if args.trajectory:
        for key in args.trajectory:
            print(trajectory(key, args.cache))
        return {}
    if args.seeds is None:
        args.seeds = [0] if args.quick else [ARMS_SEED] if args.arms else list(SEEDS)
    if args.warmups is None:
        args.warmups = [WARMUP] if args.arms else [WARMUP, 0]
    start = time.perf_counter()
    specs = arm_specs(sweep(args), args.clip_tau) if args.arms else sweep(args)
    records = {s.key: _load(s, args.cache) for s in specs}
    missing = [s for s in specs if records[s.key] is None]
    if missing and args.replay:
        sys.exit(
            f"--replay: {len(missing)} run(s) not in {args.cache}, e.g. {missing[0].key}; run "
            "without --replay"
        )
    fresh = set()
    if missing:
        print(
            f"training {len(missing)} run(s) with {args.jobs} job(s); {len(specs) - len(missing)} "
            "cached",
            flush=True,
        )
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
            for record in pool.map(train_run, _longest_first(missing)):
                _save(record, args.cache)
                records[record.spec.key] = record
                fresh.add(record.spec.key)
                print(
                    f"  {record.spec.key}: final loss {record.final_loss:.3f}, max logit "
                    f"{record.max_logit:.3g}, {len(record.live_alerts)} alert(s), "
                    f"{record.seconds:.0f} s",
                    flush=True,
                )
    ordered = [records[s.key] for s in specs]
    if args.arms:
        return _report_arms(ordered, args, time.perf_counter() - start)
    for record in ordered:
        earlier = EARLIER_RULES[args.round_rules]() if args.round_rules else None
        record.alerts = replay(record, earlier)
        if record.spec.key in fresh and not args.round_rules:
            live = [(a["rule"], a["layer"], a["head"], a["step"]) for a in record.live_alerts]
            again = [(a["rule"], a["layer"], a["head"], a["step"]) for a in record.alerts]
            if live != again:
                raise RuntimeError(
                    f"{record.spec.key}: the replay fired {again}, the live run {live}"
                )
    scored = score(ordered)
    suffix = ("_quick" if args.quick else "") + (
        f"_round{args.round_rules}" if args.round_rules else ""
    )
    if args.out is None:
        args.out = args.cache if args.quick or args.round_rules else ROOT / "docs"
    # the fault families (held out) are scored and written apart: instability_faults*.json
    faults = [s for s in scored if s.record.spec.split == HELD_OUT]
    fault_stats = report_faults(faults, args, suffix) if faults else {}
    scored = [s for s in scored if s.record.spec.split != HELD_OUT]
    ordered = [r for r in ordered if r.spec.split != HELD_OUT]
    if not scored:
        print(
            f"\n{len(specs)} runs ({len(fresh)} trained now) in {time.perf_counter() - start:.0f} s"
        )
        return fault_stats
    stats = summary(scored)
    stats["opt_in"] = {rule.name: opt_in_stats(ordered, rule, monitor) for rule, monitor in OPT_IN}
    draw(scored, args.out / f"instability{suffix}.png")
    settings = {
        "families": {n: dataclasses.asdict(FAMILIES[n]) for n in args.families if n not in FAULTS},
        "seeds": args.seeds,
        "warmups": args.warmups,
        "qk_norm": args.qk_norm,
        "every_n_steps": EVERY,
        "quick": args.quick,
        "calibration": sorted(CALIBRATION),
    }
    write_json(scored, stats, args.out / f"instability{suffix}.json", settings)
    print(tables(scored, stats))
    print("\n" + figures_table(stats))
    print(
        f"\n{len(specs)} runs ({len(fresh)} trained now) in {time.perf_counter() - start:.0f} s; "
        f"figure {args.out / f'instability{suffix}.png'}"
    )
    return stats


def intervals_from_json(path: Path) -> dict[str, Any]:
    """Add :func:`detector_figures` (``"intervals"``) to each block of a written sweep JSON from
    its run rows (each run's verdict is there), for a JSON whose cached runs are not at hand;
    ``--replay`` writes the same from the runs. Checks each block's counts against the ones it
    holds first; the rest of the file is left as it is."""
    data = json.loads(path.read_text())
    runs = data["runs"]
    for name, block in data["summary"].items():
        if name == "opt_in":
            continue
        if name.startswith("validation, seed "):
            seed = int(name.removeprefix("validation, seed "))
            rows = [r for r in runs if r["split"] == "validation" and r["seed"] == seed]
        elif name in ("validation", "calibration"):
            rows = [r for r in runs if r["split"] == name]
        elif name == "all":
            rows = [r for r in runs if r["split"] != HELD_OUT]
        else:
            rows = [r for r in runs if r["family"] == name]
        f = detector_figures(rows)
        counts = (
            (f["late_in_time"]["k"], f["late_in_time"]["n"]),
            (f["early_in_time"]["k"], f["early_in_time"]["n"]),
            (f["healthy_alerted"]["k"], f["healthy_alerted"]["n"]),
            f["median_lead"]["median"],
        )
        held = (
            (block["late_in_time"], block["late_separating"]),
            (block["early_in_time"], block["early_separating"]),
            (block["healthy_alerted"], block["healthy"]),
            block["median_lead"],
        )
        if counts != held:
            raise ValueError(f"{path}: block {name!r} holds {held}, its runs give {counts}")
        block["intervals"] = f
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data["summary"]


#: what ``--trajectory`` prints a probe: the largest head's value of each metric, the run values
TRAJECTORY = (
    "max_logit", "q_update_ratio", "k_update_ratio", "q_grad_norm", "kappa", "entropy_norm",
)  # fmt: skip


def trajectory(key: str, cache: Path) -> str:
    """A cached run's evidence probe by probe: the mean loss of the 10 steps up to the probe, the
    largest head's value of each of :data:`TRAJECTORY` (``entropy_norm``: the smallest), and the
    output logits' run values. Refuses a validation run: its figures are for scoring only."""
    path = cache / f"{key}.json"
    if not path.exists():
        raise SystemExit(f"--trajectory: no cached run {key!r} in {cache}")
    data = json.loads(path.read_text())
    spec = RunSpec(**data["spec"])
    if spec.split != "calibration":
        raise SystemExit(f"--trajectory: {key} is a validation run; rules are fitted without them")
    lines = [f"{key}: " + " | ".join(("step", "loss", *TRAJECTORY, "output_lse_rms", "logit_max"))]
    for step, probe in sorted((int(k), v) for k, v in data["probes"].items()):
        window = data["losses"][max(0, step - SMOOTH_WINDOW + 1) : step + 1]
        cells = [str(step), f"{statistics.fmean(window):.3f}"]
        for name in TRAJECTORY:
            values = [v for layer in probe.get(name, []) for v in layer if math.isfinite(v)]
            pick = min if name == "entropy_norm" else max
            cells.append(f"{pick(values):.4g}" if values else "nan")
        run = probe.get(RUN, {})
        cells += [f"{run.get(n, math.nan):.4g}" for n in ("output_lse_rms", "output_logit_max")]
        lines.append("  " + " | ".join(cells))
    return "\n".join(lines)


def _report_arms(records: list[RunRecord], args: argparse.Namespace, seconds: float) -> dict:
    stats = arms_summary(records)
    suffix = ("" if args.clip_tau == 100 else f"_tau{args.clip_tau:g}") + (
        "_quick" if args.quick else ""
    )
    out = args.out or (args.cache if args.quick else ROOT / "docs")
    draw_arms(records, args.clip_tau, out / f"qk_clip_sweep{suffix}.png")
    runs = [
        {
            **dataclasses.asdict(r.spec),
            "arm": r.spec.arm,
            "final_loss": r.final_loss,
            "max_logit": r.max_logit,
            "clips": r.clips,
            "seconds": r.seconds,
        }
        for r in records
    ]
    settings = {
        "seeds": args.seeds,
        "warmups": args.warmups,
        "tau": args.clip_tau,
        "quick": args.quick,
    }
    (out / f"qk_clip_sweep{suffix}.json").write_text(
        json.dumps({"settings": settings, "summary": stats, "runs": runs}, indent=1)
    )
    print(arms_table(records, stats))
    print(f"\n{len(records)} runs in {seconds:.0f} s; figure {out / f'qk_clip_sweep{suffix}.png'}")
    return stats


def _longest_first(specs: list[RunSpec]) -> list[RunSpec]:
    """Long runs first, so that the pool does not end on one long run with a core idle."""
    return sorted(specs, key=lambda s: -s.steps)


if __name__ == "__main__":
    main()
