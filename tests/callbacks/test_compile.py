"""The Lightning callbacks under ``torch.compile``: a fit logs what the uncompiled fit logs, nothing
recompiles once warm, unprobed steps run the compiled graphs, and nothing stays on the model.

Three ways users compile in Lightning: ``self.model = torch.compile(self.model)``,
``self.model.compile()`` (in place) and ``trainer.fit(torch.compile(task))`` (Lightning compiles
``forward`` and the ``*_step`` methods; with Lightning 2.6.6 and torch 2.13 dynamo fails on
``self.log`` there, with or without monitors, so that case uses a task that does not log). The
backend counts the graphs and their calls and runs them as they are (as ``"eager"`` does).
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor

STEPS, WARM = 10, 4


class Record(pl.Callback):
    """After each batch: the monitors' values of a probe at that step, and the backend's
    counters."""

    def __init__(self, monitors, backend) -> None:
        self.monitors, self.backend = monitors, backend
        self.values, self.counts = {}, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        for monitor in self.monitors:
            if monitor.latest_step == step:
                for metric, layers in monitor.latest.items():
                    self.values[(step, metric)] = [t.clone() for t in layers]
        if self.backend is not None:
            self.counts.append((self.backend.graphs, self.backend.calls))


def fit(make_task, tmp_path, *, how: str | None, monitors: bool = True, backend=None):
    torch._dynamo.reset()
    torch.manual_seed(0)
    task, data = make_task()
    if how == "wrapped":
        task.model = torch.compile(task.model, backend=backend)
    elif how == "in-place":
        task.model.compile(backend=backend)
    fitted = torch.compile(task, backend=backend) if how == "lightning" else task
    callbacks = (
        [
            QKSpectrumMonitor(every_n_steps=2, per_head=True),
            AttentionEntropyMonitor(every_n_steps=2),
            EffectiveRankMonitor(every_n_steps=2, max_probe_tokens=6),
        ]
        if monitors
        else []
    )
    record = Record(callbacks, backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=STEPS,
            logger=False,
            callbacks=[*callbacks, record],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            log_every_n_steps=1,
        ).fit(fitted, datamodule=data)
    return task, record


class LogFreeTask(pl.LightningModule):
    """The bundled decoder's task without ``self.log`` (which dynamo cannot trace here), so that
    Lightning can compile its ``training_step``."""

    def __init__(self, task) -> None:
        super().__init__()
        self.model = task.model

    def forward(self, tokens):
        return self.model(tokens)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return torch.nn.functional.cross_entropy(
            self(tokens).flatten(0, 1), targets.flatten(), ignore_index=-100
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "how",
    ["wrapped", "in-place", "lightning"],
    ids=[
        "task.model = torch.compile(task.model)",
        "task.model.compile()",
        "trainer.fit(torch.compile(task))",
    ],
)
def test_a_compiled_fit_logs_the_uncompiled_values_and_recompiles_nothing(
    how, make_task, tmp_path, leftovers, counting_backend
):
    if how == "lightning":
        make_task = _log_free(make_task)
    _, eager = fit(make_task, tmp_path, how=None)
    _, plain = fit(make_task, tmp_path, how=how, monitors=False, backend=counting_backend())
    task, compiled = fit(make_task, tmp_path, how=how, backend=counting_backend())
    assert compiled.counts[-1][0] > 0  # compiled
    assert eager.values.keys() == compiled.values.keys() and len(eager.values) > 0
    for key, layers in eager.values.items():
        for a, b in zip(layers, compiled.values[key]):
            assert torch.allclose(a, b, rtol=0, atol=0, equal_nan=True), (key, a, b)
    graphs = [g for g, _ in compiled.counts]
    assert graphs[WARM:] == [graphs[WARM]] * (STEPS - WARM), (
        graphs
    )  # nothing compiled after warm-up
    calls = [c for _, c in compiled.counts]
    plain_calls = [c for _, c in plain.counts]
    steps = range(WARM + 1, STEPS, 2)  # unprobed batches (the probes fall on even steps)
    assert [calls[i] - calls[i - 1] for i in steps] == [
        plain_calls[i] - plain_calls[i - 1] for i in steps
    ]
    assert leftovers(task) == []


def _log_free(make_task):
    def make():
        task, data = make_task()
        return LogFreeTask(task), data

    return make
