"""The spectrum on its worker thread (``background_weights=True``) through a real Lightning fit,
against the synchronous path (``False``) with the same seed, read back from TensorBoard's own
event files: an alert of a read in flight stops or raises one batch later and names its probe
step; a checkpoint saved while a read is in flight holds it and resumes as an uninterrupted run;
a step that fails or is interrupted while a read is in flight waits for it and logs it; and the
worker keeps no copy of the weights once it has read them."""

from __future__ import annotations

import contextlib
import gc
import math
import signal
import warnings
import weakref

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from qkmonitor import OverLocalizationWarning
from qkmonitor.alerts import AlertRule, Condition
from qkmonitor.alerts.rules import LOSS_SMOOTHING
from qkmonitor.callbacks import QKSpectrumMonitor
from qkmonitor.engine.background import WEIGHTS_WORKER

from .tiny import TOKENS, TinyTask

#: the first step the alert of :data:`RULE` may fire at (κ > 0 always: every probe crosses it)
GRACE = 2
RULE = AlertRule(name="any_kappa", metric="kappa", threshold=0.0, above=True, patience=1,
                 margin=0.0, warning=OverLocalizationWarning, meaning="test", advice="test",
                 grace_steps=GRACE)  # fmt: skip


def make_trainer(tmp_path, name: str, background: bool, max_steps: int, *, every: int = 1,
                 callbacks=(), **monitor) -> tuple[pl.Trainer, QKSpectrumMonitor]:  # fmt: skip
    """A fit of ``TinyTask`` probed every ``every`` steps, logged to ``tmp_path/name/version_0``."""
    pl.seed_everything(0, verbose=False)
    callback = QKSpectrumMonitor(
        every_n_steps=every, per_head=True, background_weights=background, **monitor
    )
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=max_steps,
        logger=TensorBoardLogger(tmp_path, name=name, version=0),
        callbacks=[callback, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        log_every_n_steps=1,
        accelerator="cpu",
    )
    return trainer, callback


def logged(tmp_path, name: str) -> dict[str, list[tuple[int, float]]]:
    """qkmonitor's scalars of a run, by tag, as TensorBoard reads them (NaN as the string "nan",
    equal to itself)."""
    acc = EventAccumulator(str(tmp_path / name / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    return {
        tag: [(e.step, "nan" if math.isnan(e.value) else e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
        if tag.startswith("qkmonitor/")
    }


def up_to(scalars: dict, step: int) -> dict:
    return {tag: [(s, v) for s, v in series if s <= step] for tag, series in scalars.items()}


@contextlib.contextmanager
def copies_seen(monkeypatch):
    """Weak references to every copy of the weights handed to the worker, checked with the cyclic
    garbage collector off: a copy still alive is held by a reference, not by a cycle."""
    refs: list[weakref.ref] = []
    submit = WEIGHTS_WORKER.submit

    def recording(job, weights, *args):
        # the spectrum's job (the weights), then the update spectrum's (pairs: before, after)
        held = [w for item in weights for w in (item if isinstance(item, tuple) else (item,))]
        refs.extend(weakref.ref(t) for w in held for t in (w.w_q, w.w_k))
        return submit(job, weights, *args)

    monkeypatch.setattr(WEIGHTS_WORKER, "submit", recording)
    gc.disable()
    try:
        yield refs
    finally:
        gc.enable()


@pytest.mark.parametrize("action", ["stop", "raise"])
def test_an_alert_of_a_read_in_flight_comes_one_batch_later_naming_its_probe_step(tmp_path, action):
    runs = {}
    for background in (False, True):
        fired = []
        trainer, _ = make_trainer(
            tmp_path, str(background), background, max_steps=4 * GRACE, alerts=[RULE],
            alert_action=action, on_alert=lambda t, a, at=fired.append: at((a.step, t.global_step)),
        )  # fmt: skip
        raises = pytest.raises(OverLocalizationWarning) if action == "raise" else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with raises or contextlib.nullcontext() as error:
                trainer.fit(TinyTask())
        texts = [str(w.message) for w in caught if w.category is OverLocalizationWarning]
        if raises is not None:  # raised, not warned
            assert texts == [] and fired == []
            texts = [str(error.value)]
        runs[background] = (trainer.global_step, fired, texts, logged(tmp_path, str(background)))
    (sync_stop, sync_fired, sync_texts, sync_logged) = runs[False]
    (stop, fired, texts, background_logged) = runs[True]
    # the synchronous path acts at the read of step GRACE, at the end of the batch before it;
    # the worker's read is logged at the end of the next batch: one step later, never more
    assert sync_stop == GRACE and stop == sync_stop + 1
    # the same alert, word for word, naming its probe step and not the step it arrived at
    assert texts == sync_texts and texts and all(f"at step {GRACE}," in t for t in texts)
    if action == "stop":
        heads = len(sync_fired)  # one alert a (layer, head), all at the probe step
        assert heads > 1 and sync_fired == [(GRACE, sync_stop)] * heads
        assert fired == [(GRACE, stop)] * heads
    # what both logged, the alert counter at its probe step included, is the same; the worker's
    # fit read the weights after the one more step it took
    counter = "qkmonitor/alerts/any_kappa"
    assert up_to(background_logged, GRACE) == sync_logged
    if action == "stop":
        assert sync_logged[counter] == [(GRACE, float(heads))]
        steps = {s for series in background_logged.values() for s, _ in series}
        assert steps == set(range(stop + 1))


class ScheduledTask(TinyTask):
    """``TinyTask`` whose learning rate falls at every step, over more batches."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def train_dataloader(self):
        return torch.utils.data.DataLoader([TOKENS[0]] * 8 * LOSS_SMOOTHING, batch_size=2)


def test_an_alert_from_the_worker_reads_the_loss_and_learning_rate_of_its_probe_step(tmp_path):
    # a rule on the loss's trend fires at the first probe with LOSS_SMOOTHING steps of loss
    # before it; its message gives the loss signal and the learning rate of that probe, which
    # the worker's read must give as the synchronous path does, though it is logged a step later
    rule = RULE.replace(grace_steps=0, also=(Condition("loss_change", 0.0, above=True),))
    texts = {}
    for background in (False, True):
        trainer, _ = make_trainer(tmp_path, str(background), background,
                                  max_steps=LOSS_SMOOTHING + 2, alerts=[rule],
                                  alert_action="raise")  # fmt: skip
        with pytest.raises(OverLocalizationWarning) as error:
            trainer.fit(ScheduledTask())
        texts[background] = str(error.value)
    assert f"at step {LOSS_SMOOTHING}," in texts[False] and "loss_change" in texts[False]
    assert texts[True] == texts[False]


def test_a_checkpoint_saved_while_a_read_is_in_flight_holds_it_and_resumes_as_one_run(
    tmp_path, monkeypatch
):
    every, saved_at, total = 2, 2, 6  # the checkpoint of step 2 is saved as its read is in flight
    saved = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1,
                            filename="{step}")  # fmt: skip
    trainer, first = make_trainer(tmp_path, "whole", True, total, every=every, callbacks=[saved])
    engine_state = first.engine.state_dict
    states = {}

    def engine_state_seen():
        states[trainer.global_step] = bool(first.engine._in_flight)
        return engine_state()

    monkeypatch.setattr(first.engine, "state_dict", engine_state_seen)
    trainer.fit(TinyTask())
    assert states[saved_at] is True  # the read of step 2 was on the worker when it was saved
    checkpoint = torch.load(tmp_path / "ckpt" / f"step={saved_at}.ckpt", weights_only=False)
    state = checkpoint["callbacks"][first.state_key]
    assert state["latest_step"] == saved_at  # ... and its state holds that read
    whole = logged(tmp_path, "whole")

    resumed, _ = make_trainer(tmp_path, "resumed", True, total, every=every)
    resumed.fit(TinyTask(), ckpt_path=tmp_path / "ckpt" / f"step={saved_at}.ckpt")
    after = logged(tmp_path, "resumed")
    assert after.keys() == whole.keys()
    for tag, series in whole.items():  # every step after the checkpoint, as the uninterrupted run
        assert after[tag] == [(s, v) for s, v in series if s > saved_at], tag
    assert [s for s, _ in after["qkmonitor/kappa/layer_00"]] == list(
        range(saved_at + every, total + 1, every)
    )


class FailingTask(TinyTask):
    """``TinyTask`` whose training step raises ``error`` at ``at`` (the weights after step
    ``at`` were read at the end of the batch before, and are on the worker when it raises)."""

    def __init__(self, error: BaseException, at: int) -> None:
        super().__init__()
        self.error, self.at = error, at

    def training_step(self, batch, batch_idx):
        if self.global_step == self.at:
            raise self.error
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("error", [RuntimeError("a failing step"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])  # fmt: skip
def test_a_step_that_fails_while_a_read_is_in_flight_logs_it_and_frees_its_copy(
    tmp_path, monkeypatch, error
):
    at = 3
    runs = {}
    for background in (False, True):
        trainer, _ = make_trainer(tmp_path, str(background), background, max_steps=2 * at)
        sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores Ctrl+C after an interrupt
        with copies_seen(monkeypatch) as copies, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # Lightning ends an interrupted fit with exit code 1, after its callbacks' hooks
            raised = SystemExit if isinstance(error, KeyboardInterrupt) else RuntimeError
            try:
                with pytest.raises(raised):
                    trainer.fit(FailingTask(error, at))
            finally:
                signal.signal(signal.SIGINT, sigint)
            assert all(c() is None for c in copies)  # nothing of the weights left on the worker
        assert bool(copies) is background
        said = [str(w.message) for w in caught if "qkmonitor" in str(w.message)]
        runs[background] = (logged(tmp_path, str(background)), said)
    # the read of step `at` is waited for and logged, as the synchronous path logged it, and no
    # warning is given: nothing was dropped
    assert runs[True] == runs[False]
    assert [s for s, _ in runs[True][0]["qkmonitor/kappa/layer_00"]] == list(range(at + 1))
    assert runs[True][1] == []
