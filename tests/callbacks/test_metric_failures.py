"""A metric problem never stops a fit: every stage of measuring made to fail in turn.

A real Lightning fit of the bundled decoder under ``QKMonitor(every_n_steps=1)``, with one stage
broken for one layer (or for one engine, where the stage is the engine's as a whole): the fit
completes, its losses are an unmonitored twin's bit for bit, one warning names the failing
layer(s), and what did not fail is still logged. The same in a plain loop with ``Monitoring``.
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn

from qkmonitor.attention.native import NativeAttentionLayer
from qkmonitor.attention.probes import Probe
from qkmonitor.callbacks import QKMonitor
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.engine.publishing import ValuePublisher
from qkmonitor.measures.metrics import AttentionStatistics, HeadMean
from qkmonitor.output.sinks import MemorySink

from .zoo import MODELS, Task

BROKEN = "model.blocks.0.attn"  # the layer made to fail
OTHER = "model.blocks.1.attn"


class Recorder(Logger):
    """A logger that keeps every scalar it is given, by step."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))

    def tags(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for _, metrics in self.rows:
            for tag, value in metrics.items():
                out.setdefault(tag, []).append(value)
        return out


class LossTask(Task):
    """:class:`Task` that keeps each step's loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())
        return loss


def _fit(callbacks, logger) -> LossTask:
    torch.manual_seed(0)
    task = LossTask(MODELS["bundled"]())
    pl.Trainer(
        max_steps=4,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    ).fit(task)
    return task


ARMED = [False]  # the weights' read breaks from the fit's start on (discovery reads them too)


class Arm(pl.Callback):
    """Put before the monitor: arms the broken read once the monitors are bound."""

    def on_train_start(self, trainer, pl_module):
        ARMED[0] = True


def _only_for(layer_name: str, original, error: Exception):
    """A method of an adapter that raises for the layer ``layer_name`` (once armed) and works for
    the others."""

    def method(self, *args, **kwargs):
        if self.name == layer_name and ARMED[0]:
            raise error
        return original(self, *args, **kwargs)

    return method


def _break(stage: str, monkeypatch) -> tuple[list[str], str]:
    """Break ``stage``; returns the layer names the warning must name and a tag that must still be
    logged (a layer or engine that did not fail)."""
    if stage == "observe":  # a probe's measurement of a call raises inside the model's forward
        original = Probe._observe

        def observe(self, call):
            if self.name == BROKEN:
                raise RuntimeError("observer broke")
            return original(self, call)

        monkeypatch.setattr(Probe, "_observe", observe)
        return [BROKEN], "qkmonitor/entropy/layer_01"
    if stage == "aggregate":  # the aggregator refuses one layer's statistics (a 5-D SDPA's)
        original = AttentionStatistics.update

        def update(self, stats, heads=None):
            if heads is not None and heads.start == 0:
                raise ValueError("Expected statistics of shape (B, 2, N), got (2, 2, 4, 4)")
            return original(self, stats, heads)

        monkeypatch.setattr(AttentionStatistics, "update", update)
        return [BROKEN], "qkmonitor/entropy/layer_01"
    if stage == "weights":  # reading one layer's W_Q/W_K raises
        monkeypatch.setattr(
            NativeAttentionLayer,
            "qk_weights",
            _only_for(BROKEN, NativeAttentionLayer.qk_weights, RuntimeError("weights broke")),
        )
        return [BROKEN], "qkmonitor/kappa/layer_01"
    if stage == "rows":  # reading one layer's rows before the update raises
        monkeypatch.setattr(
            NativeAttentionLayer,
            "qk_rows",
            _only_for(BROKEN, NativeAttentionLayer.qk_rows, RuntimeError("rows broke")),
        )
        return [BROKEN], "qkmonitor/q_update_ratio/layer_01"
    if stage == "compute":  # the rank engine's compute raises: its layers, not the others'

        def compute(self):
            raise RuntimeError("compute broke")

        monkeypatch.setattr(HeadMean, "compute", compute)
        return [BROKEN, OTHER], "qkmonitor/entropy/layer_00"
    if stage == "record":  # publishing the entropy engine's values raises
        original = ValuePublisher.publish

        def publish(self, *args, **kwargs):
            if self.owner == "AttentionEntropy":
                raise OSError("publish broke")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(ValuePublisher, "publish", publish)
        return [BROKEN, OTHER], "qkmonitor/kappa/layer_00"
    raise AssertionError(stage)


STAGES = ["observe", "aggregate", "weights", "rows", "compute", "record"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_failing_stage_is_one_warning_and_the_fit_trains_as_without_monitors(stage, monkeypatch):
    twin = _fit([], False)
    names, kept = _break(stage, monkeypatch)
    logger = Recorder()
    monitor = QKMonitor(every_n_steps=1)
    ARMED[0] = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = _fit([Arm(), monitor], logger)
    assert len(task.losses) == len(twin.losses) == 4
    for ours, theirs in zip(task.losses, twin.losses):
        assert torch.equal(ours, theirs)
    messages = [str(w.message) for w in caught]
    failure = "Expected statistics" if stage == "aggregate" else "broke"
    naming = [m for m in messages if all(repr(n) in m for n in names) and failure in m]
    assert len(naming) == 1, messages
    logged = logger.tags()
    assert kept in logged and all(math.isfinite(v) for v in logged[kept][-2:]), sorted(logged)


def test_a_failing_stage_in_a_plain_loop_is_one_warning(monkeypatch):
    _break("aggregate", monkeypatch)
    torch.manual_seed(0)
    model = MODELS["bundled"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MemorySink()
    tokens = torch.randint(16, (4, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitoring(
            model,
            [QKSpectrum(), AttentionEntropy(), EffectiveRank()],
            writer=sink,
            optimizer=optimizer,
            every_n_steps=1,
        ) as monitoring:
            for step in range(3):
                with monitoring.step(step):
                    model(tokens).logsumexp(-1).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
    messages = [str(w.message) for w in caught]
    layer = repr(BROKEN.removeprefix("model."))  # the decoder itself is the model here
    assert sum(layer in m and "Expected statistics" in m for m in messages) == 1, messages
    entropy = monitoring.engines[1].latest["entropy"]
    assert entropy[0].isnan().all() and torch.isfinite(entropy[1]).all()
