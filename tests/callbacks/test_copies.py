"""A copy of the model is never probed: what qkmonitor installs for a probe window is bound to the
modules it was installed on (``qkmonitor.attention.installs``).

A lazily built EMA teacher (``copy.deepcopy`` of the student inside a probed step, then run on
every step) carries no hook, route or attribute of qkmonitor; the student's values are those of
the same run whose teacher never runs; the model pickles and saves inside the window, and what is
loaded back is clean. Eager on the zoo's three kinds of attention (qkmonitor's own, torch's MHA
pre-hook, a Hugging Face route and config view), and compiled.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from qkmonitor.attention.compiled import own_class
from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor

from .zoo import MODELS, Task

BUILD_AT = 2  # a probed step (every_n_steps=2)


def qkmonitor_attributes(model: torch.nn.Module) -> list[str]:
    """Every attribute of qkmonitor's in the model's modules' ``__dict__``s, and any module whose
    class is not its own (a switch)."""
    found = []
    for name, module in model.named_modules():
        found += [f"{name}.{key}" for key in module.__dict__ if "qkmonitor" in key]
        found += [f"{name}.__getstate__"] if "__getstate__" in module.__dict__ else []
        found += [f"{name}: switched class"] if type(module) is not own_class(module) else []
    return found


class EMATeacher(Task):
    """The zoo's task with an EMA teacher built at a probed step, inside its window: a deep copy
    of the student (kept off the module tree, as a teacher's parameters are not optimized) that
    runs on every later batch, under ``no_grad``, and follows the student after each step. Its
    output is not used by the loss, so that a run whose teacher never runs trains the same."""

    def __init__(self, model, run_teacher: bool, leftovers) -> None:
        super().__init__(model)
        self.run_teacher, self.leftovers = run_teacher, leftovers
        self.teachers: list[torch.nn.Module] = []
        self.seen: dict[str, object] = {}

    def training_step(self, batch, batch_idx):
        if self.global_step == BUILD_AT and not self.teachers:
            self.inspect_copies()
        if self.teachers and self.run_teacher:
            with torch.no_grad():
                self.teachers[0](batch[0])
        return super().training_step(batch, batch_idx)

    def inspect_copies(self) -> None:
        student = self.model
        self.seen["student installs"] = qkmonitor_attributes(student) != []  # the window is open
        teacher = copy.deepcopy(student)
        self.teachers.append(teacher)
        self.seen["teacher"] = self.leftovers(teacher) + qkmonitor_attributes(teacher)
        unpickled = pickle.loads(pickle.dumps(student))
        self.seen["unpickled"] = self.leftovers(unpickled) + qkmonitor_attributes(unpickled)
        buffer = io.BytesIO()
        torch.save(student, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        self.seen["loaded"] = self.leftovers(loaded) + qkmonitor_attributes(loaded)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.teachers:
            with torch.no_grad():
                for t, s in zip(self.teachers[0].parameters(), self.model.parameters()):
                    t.lerp_(s, 0.1)


def fit(tmp_path, kind, *, run_teacher, compiled, leftovers):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[kind]()
    if compiled:
        model.compile(backend="eager")
    task = EMATeacher(model, run_teacher, leftovers)
    version = f"{kind}-{compiled}-{run_teacher}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=6,
            logger=TensorBoardLogger(tmp_path, name="runs", version=version),
            callbacks=[
                QKSpectrumMonitor(every_n_steps=2, per_head=True),
                AttentionEntropyMonitor(every_n_steps=2, per_head=True),
                EffectiveRankMonitor(every_n_steps=2, per_head=True, max_probe_tokens=6),
            ],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            log_every_n_steps=1,
        ).fit(task)
    acc = EventAccumulator(str(tmp_path / "runs" / version), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {
        tag: [(e.step, "NaN" if math.isnan(e.value) else e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
        if tag.startswith("qkmonitor/")
    }
    return task, scalars


@pytest.mark.parametrize(
    ("kind", "compiled"),
    [("bundled", False), ("torch-mha", False), ("hf-llama", False), ("bundled", True)],
)
def test_an_ema_teacher_copied_in_a_probed_step_carries_nothing_and_changes_nothing(
    tmp_path, kind, compiled, leftovers
):
    task, scalars = fit(tmp_path, kind, run_teacher=True, compiled=compiled, leftovers=leftovers)
    assert task.seen["student installs"]  # the copies were taken inside an open window
    for copied in ("teacher", "unpickled", "loaded"):
        assert task.seen[copied] == [], copied
    assert leftovers(task) == [] and qkmonitor_attributes(task) == []
    assert leftovers(task.teachers[0]) == [] and qkmonitor_attributes(task.teachers[0]) == []

    _, quiet = fit(tmp_path, kind, run_teacher=False, compiled=compiled, leftovers=leftovers)
    assert {tag for tag in scalars if "/kappa/" in tag} and {t for t in scalars if "hidden" in t}
    assert scalars == quiet  # the student's values, every tag at every step, bit for bit
    assert all(step > BUILD_AT for step, _ in scalars["qkmonitor/kappa/layer_00"][2:])
