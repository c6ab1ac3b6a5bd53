"""QKMonitor: the three monitors behind one set of hooks log what the three callbacks log, in one
write a probe step, with each monitor's own cadence where one is given."""

from __future__ import annotations

import csv
import math
import operator
import warnings
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from qkmonitor.alerts import KAPPA_RULE, LOGIT_BURST_RULE, RANK_COLLAPSE_RULE
from qkmonitor.callbacks import (
    AttentionEntropyMonitor,
    EffectiveRankMonitor,
    QKMonitor,
    QKSpectrumMonitor,
)
from qkmonitor.engine import AttentionEntropy, EffectiveRank, QKSpectrum


def fit(tmp_path: Path, make_task, callbacks, *, steps: int = 6, logger=None, ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    task, data = make_task()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        callbacks=callbacks,
        logger=TensorBoardLogger(tmp_path, "run", 0) if logger is None else logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    trainer.fit(task, datamodule=data, ckpt_path=ckpt_path)
    return trainer, task


def qkmonitor_events(run_dir: Path) -> Counter:
    """How many events of the run hold qkmonitor scalars, by step (TensorBoard's own loader)."""
    events: Counter = Counter()
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            tags = [v.tag for v in event.summary.value if v.HasField("simple_value")] or [
                v.tag
                for v in event.summary.value
                if v.metadata.plugin_data.plugin_name == "scalars"
            ]
            if any(tag.startswith("qkmonitor/") for tag in tags):
                events[event.step] += 1
    return events


def test_qk_monitor_logs_what_the_three_callbacks_log_bit_for_bit(tmp_path, make_task, scalars_of):
    three = [
        QKSpectrumMonitor(every_n_steps=2, per_head=True),
        AttentionEntropyMonitor(every_n_steps=2, per_head=True),
        EffectiveRankMonitor(every_n_steps=2, per_head=True),
    ]
    fit(tmp_path / "three", make_task, three)
    one = QKMonitor(every_n_steps=2, per_head=True)
    fit(tmp_path / "one", make_task, [one])

    expected = scalars_of(tmp_path / "three" / "run" / "version_0")
    got = scalars_of(tmp_path / "one" / "run" / "version_0")
    tags = sorted(t for t in expected if t.startswith("qkmonitor/"))
    assert len(tags) > 100 and "qkmonitor/kappa/layer_01_head_03" in tags
    assert sorted(t for t in got if t.startswith("qkmonitor/")) == tags
    for tag in tags:
        # the same steps and the same float32 values (NaN where both are: step 0's update metrics)
        assert [(s, "NaN" if math.isnan(v) else v) for s, v in got[tag]] == [
            (s, "NaN" if math.isnan(v) else v) for s, v in expected[tag]
        ], tag
    assert [s for s, _ in got["qkmonitor/entropy/layer_00"]] == [0, 2, 4]
    assert [s for s, _ in got["qkmonitor/kappa/layer_00"]] == [0, 2, 4, 6]
    # the values the callbacks keep agree with the three's, metric for metric
    assert set(one.latest) == {m for cb in three for m in cb.latest}
    for cb in three:
        for name, grid in cb.latest.items():
            assert all(torch.equal(a, b) for a, b in zip(grid, one.latest[name])), name


def test_a_probe_step_is_one_event_and_one_csv_row(tmp_path, make_task):
    fit(tmp_path / "tb", make_task, [QKMonitor(every_n_steps=2, per_head=True)])
    events = qkmonitor_events(tmp_path / "tb" / "run" / "version_0")
    assert events == Counter({0: 1, 2: 1, 4: 1, 6: 1})  # the spectrum's 6: read after the last

    three = [
        QKSpectrumMonitor(every_n_steps=2),
        AttentionEntropyMonitor(every_n_steps=2),
        EffectiveRankMonitor(every_n_steps=2),
    ]
    fit(tmp_path / "three", make_task, three)
    assert qkmonitor_events(tmp_path / "three" / "run" / "version_0")[2] == 3  # one per monitor

    logger = CSVLogger(tmp_path / "csv", name="run", version=0)
    fit(tmp_path / "csv", make_task, [QKMonitor(every_n_steps=2)], logger=logger)
    with open(tmp_path / "csv" / "run" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("qkmonitor/kappa/layer_00")]
    assert [int(r["step"]) for r in rows] == [0, 2, 4, 6]
    probed = [r for r in rows if int(r["step"]) < 6]  # the three monitors in each of these rows
    assert all(
        r["qkmonitor/entropy/layer_00"] and r["qkmonitor/attn_erank/layer_01"] for r in probed
    )


def test_each_monitor_keeps_its_own_cadence_and_arguments(tmp_path, make_task, scalars_of):
    monitor = QKMonitor(
        every_n_steps=2,
        spectrum={"every_n_steps": 3},
        rank={"every_n_steps": 4, "max_probe_tokens": 4, "log_key_prefix": "rank"},
        entropy={"sink_tokens": 1},
    )
    fit(tmp_path, make_task, [monitor], steps=8)
    scalars = scalars_of(tmp_path / "run" / "version_0")
    assert [s for s, _ in scalars["qkmonitor/kappa/layer_00"]] == [0, 3, 6]
    assert [s for s, _ in scalars["qkmonitor/entropy/layer_00"]] == [0, 2, 4, 6]
    assert [s for s, _ in scalars["qkmonitor/sink_mass/layer_00"]] == [0, 2, 4, 6]
    assert [s for s, _ in scalars["rank/attn_erank/layer_00"]] == [0, 4]
    assert monitor.rank.max_probe_tokens == 4 and monitor.entropy.sink_tokens == 1
    assert isinstance(monitor.spectrum, QKSpectrum)


def test_only_the_monitors_asked_for_run(tmp_path, make_task, scalars_of):
    monitor = QKMonitor(every_n_steps=2, spectrum=False, rank=False)
    assert monitor.spectrum is None and monitor.rank is None
    assert [type(e) for e in monitor.engines] == [AttentionEntropy]
    fit(tmp_path, make_task, [monitor], steps=3)
    tags = {t for t in scalars_of(tmp_path / "run" / "version_0") if t.startswith("qkmonitor/")}
    assert "qkmonitor/entropy/layer_00" in tags
    assert not any(t.startswith(("qkmonitor/kappa", "qkmonitor/attn_erank")) for t in tags)


def test_unprobed_steps_reach_no_engine(tmp_path, make_task, monkeypatch):
    """One schedule check a batch: on the steps between two probes whose loss no rule reads, no
    engine is asked anything; on the others, each engine whose rules read the loss gets it once."""
    calls: Counter = Counter()
    for cls in (QKSpectrum, AttentionEntropy, EffectiveRank):
        weights = ("observe_weights",) if cls.reads_weights else ()  # (the spectrum's alone)
        for name in ("open", "observe_loss", "plan", *weights):
            original = getattr(cls, name)

            def counted(self, *args, _original=original, _name=name, **kwargs):
                calls[(type(self).__name__, _name)] += 1
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(cls, name, counted)
    losses: list[tuple[int, float]] = []
    monitor = QKMonitor(every_n_steps=40)
    every = 40
    fit(tmp_path, make_task, [monitor], steps=2 * every)
    entropy = monitor.entropy
    lead = entropy.alerting.loss_lead  # the steps before a probe whose loss the rules read
    losses = entropy.alerting.loss_history()
    # the entropy's rules read the loss: the run's first steps and `lead` steps before each probe
    kept = [s for s, _ in losses]
    assert kept == sorted(set(kept)) and kept[-1] == 2 * every - 1
    # one history for the three engines, each kept loss read once: a step's loss is kept once
    histories = {id(e.alerting.losses) for e in monitor.engines}
    assert len(histories) == 1 and len(monitor.spectrum.alerting.loss_history()) == len(kept)
    assert calls[("AttentionEntropy", "observe_loss")] == 0  # the group keeps it, once
    # quiet steps: between a probe's batch and the loss window before the next, nothing is asked
    quiet = every - 1 - lead - 10  # 10: the run's first losses (LOSS_SMOOTHING) at most
    per_engine = calls[("AttentionEntropy", "open")]
    assert per_engine <= 2 * every - quiet, calls
    assert calls[("AttentionEntropy", "plan")] <= 2 * every - quiet, calls


def test_alerts_go_to_the_monitor_that_logs_their_metrics():
    monitor = QKMonitor(alerts=[KAPPA_RULE, LOGIT_BURST_RULE])
    assert [r.name for r in monitor.spectrum.alerting.tracker.rules] == ["kappa"]
    assert [r.name for r in monitor.entropy.alerting.tracker.rules] == ["logit_burst"]
    assert monitor.rank.alerting.tracker.rules == []
    defaults = QKMonitor()
    assert [r.name for r in defaults.rank.alerting.tracker.rules] == [
        r.name for r in EffectiveRank().alerting.tracker.rules
    ]
    own = QKMonitor(alerts=[], rank={"alerts": [RANK_COLLAPSE_RULE]})
    assert [r.name for r in own.rank.alerting.tracker.rules] == ["rank_collapse"]
    assert own.entropy.alerting.tracker.rules == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"spectrum": 1}, "Expected `spectrum` to be True, False or a dict"),
        ({"rank": {"max_tokens": 4}}, "Expected `rank` to hold arguments of EffectiveRank"),
        ({"entropy": {"blocks": []}}, "'blocks'"),
        (
            {"spectrum": False, "entropy": False, "rank": False},
            "at least one of `spectrum`, `entropy` and `rank`",
        ),
        ({"spectrum": False, "alerts": [KAPPA_RULE]}, "which is off (`spectrum=False`)"),
        ({"alerts": ["kappa"]}, "Expected `alerts[0]` to be an AlertRule"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"rank": {"max_probe_tokens": 0}}, "max_probe_tokens"),
        ({"entropy": {"sink_tokens": 10_000}}, "sink_tokens"),
        ({"probe_validation": "yes"}, "Expected `probe_validation` to be a bool"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=None) as info:
        QKMonitor(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("layers", "layers"),
        ("tracker", "alerting.tracker"),
        ("prefix", "prefix"),
        ("every_n_steps", "schedule.every_n_steps"),
        ("metric_names", "metric_names"),
    ],
)
def test_the_engines_state_is_read_on_the_engines_not_through_a_callback(name, path):
    """The state is the engines' (``.engine``, ``.engines[i]``, ``QKMonitor``'s ``.spectrum``...),
    the schedule's and the alert policy's on their parts; a callback's own results are
    ``latest``."""
    single, several = QKSpectrumMonitor(every_n_steps=7), QKMonitor()
    assert not hasattr(single, name) and not hasattr(several, name)
    read = operator.attrgetter(path)
    read(single.engine), read(several.spectrum)  # no AttributeError
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert single.latest == {} and single.latest_step is None


def test_a_resumed_fit_goes_on_with_every_monitor_state(tmp_path, make_task, scalars_of):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=4)
    first = QKMonitor(every_n_steps=2)
    fit(tmp_path, make_task, [first, ckpt], steps=4)
    second = QKMonitor(every_n_steps=2)
    logger = TensorBoardLogger(tmp_path, "resumed", 0)
    fit(
        tmp_path,
        make_task,
        [second],
        steps=8,
        logger=logger,
        ckpt_path=tmp_path / "ckpt" / "last.ckpt",
    )
    for engine, before in zip(second.engines, first.engines):
        assert engine.schedule.latest_step == (8 if engine.reads_weights else 6)
        assert before.schedule.latest_step == (4 if engine.reads_weights else 2)
    scalars = scalars_of(tmp_path / "resumed" / "version_0")
    # the spectrum of step 4 was read before the checkpoint: not again
    assert [s for s, _ in scalars["qkmonitor/kappa/layer_00"]] == [6, 8]
    assert [s for s, _ in scalars["qkmonitor/entropy/layer_00"]] == [4, 6]


class Failing(pl.Callback):
    """Raises inside the forward of the training batch at ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:

            def boom(*args):
                raise RuntimeError("a failing step")

            pl_module.model.blocks[1].register_forward_pre_hook(boom)


def test_a_failing_probe_step_leaves_nothing_installed_and_writes_what_was_measured(
    tmp_path, make_task, scalars_of
):
    monitor = QKMonitor(every_n_steps=2)
    pl.seed_everything(0, verbose=False)
    task, data = make_task()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=6,
        callbacks=[monitor, Failing(4)],
        logger=TensorBoardLogger(tmp_path, "run", 0),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    with pytest.raises(RuntimeError, match="a failing step"):
        trainer.fit(task, datamodule=data)
    scalars = scalars_of(tmp_path / "run" / "version_0")
    # the weights after step 4's predecessor were measured and are written; the failed window not
    assert [s for s, _ in scalars["qkmonitor/kappa/layer_00"]] == [0, 2, 4]
    assert [s for s, _ in scalars["qkmonitor/entropy/layer_00"]] == [0, 2]
    for name, module in task.named_modules():
        assert "_qkmonitor_installs" not in vars(module), name
        assert not any("qkmonitor" in repr(h) for h in module._forward_hooks.values()), name
        assert type(module).__module__.split(".")[0] != "qkmonitor.attention.compiled", name
    attention = task.model.blocks[0].attn
    assert not attention._observers, "an observer stayed"


def test_the_losses_kept_are_those_the_three_callbacks_keep(tmp_path, make_task):
    """QKMonitor keeps a step's loss once, in one history, for exactly the steps one of the three
    callbacks' rules would read (each callback asks its own engine)."""
    every = 40
    three = [
        QKSpectrumMonitor(every_n_steps=every),
        AttentionEntropyMonitor(every_n_steps=every),
        EffectiveRankMonitor(every_n_steps=every),
    ]
    fit(tmp_path / "three", make_task, three, steps=2 * every)
    one = QKMonitor(every_n_steps=every)
    fit(tmp_path / "one", make_task, [one], steps=2 * every)
    wanted = sorted({s for cb in three for s, _ in cb.engine.alerting.loss_history() if s >= every})
    kept = [s for s, _ in one.entropy.alerting.loss_history() if s >= every]
    assert kept == wanted and len(kept) > 10
    losses = dict(three[1].engine.alerting.loss_history())
    assert all(v == losses[s] for s, v in one.entropy.alerting.loss_history() if s in losses)
