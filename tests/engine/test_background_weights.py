"""The spectrum computed off the training thread (``background_weights=True``): the same values,
at the same steps, as the synchronous path, bit for bit; computed on the worker from a copy that
is freed once read; waited for at a run's end, on a failure, and before a checkpoint's state."""

from __future__ import annotations

import copy
import gc
import math
import struct
import threading
import warnings
import weakref
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch.testing import assert_close

import qkmonitor.engine.spectrum as spectrum_module
from qkmonitor.engine import Monitoring, QKSpectrum
from qkmonitor.engine.background import WEIGHTS_WORKER, use_worker
from qkmonitor.output.sinks import MemorySink

from .tiny import TOKENS, TinyTask, decoder, first_raised


def plain_loop(background: bool | None, steps: int = 7, every: int = 2):
    """A plain AdamW loop over ``decoder()`` probed every ``every`` steps; returns the sink."""
    model = decoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    sink = MemorySink()
    engine = QKSpectrum(per_head=True, background_weights=background, visuals_every_n_probes=1)
    monitoring = Monitoring(model, [engine], writer=sink, every_n_steps=every, optimizer=optimizer)
    with monitoring:
        for step in range(steps):
            with monitoring.step(step):
                loss = model(TOKENS).logsumexp(-1).mean()
                monitoring.observe_loss(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    return sink


def spectrum_scalars(sink: MemorySink) -> list[tuple[str, bytes, int]]:
    """The logged scalars with each value as its bits (NaN compares equal to itself there)."""
    return [(tag, struct.pack("<d", value), step) for tag, value, step in sink.scalars]


def test_the_worker_logs_what_the_synchronous_path_logs_bit_for_bit():
    synchronous, background = plain_loop(False), plain_loop(True)
    assert spectrum_scalars(background) == spectrum_scalars(synchronous)
    assert {s[2] for s in synchronous.scalars} == {0, 2, 4, 6}
    assert len(background.histograms) == len(synchronous.histograms) > 0
    for (tag, got, step), (tag0, want, step0) in zip(background.histograms, synchronous.histograms):
        assert (tag, step) == (tag0, step0)
        assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_the_spectrum_is_computed_on_the_worker_from_a_copy_freed_once_read(monkeypatch):
    threads, copies, pointers, jobs = [], [], set(), []
    original_submit = WEIGHTS_WORKER.submit
    original_spectrum = spectrum_module.spectrum_of_layers

    def spectrum_on_record(weights):
        threads.append(threading.current_thread().name)
        return original_spectrum(weights)

    def submit(job, weights, *args):
        # the spectrum's job (the weights), then the update spectrum's (pairs: before, after)
        held = [w for item in weights for w in (item if isinstance(item, tuple) else (item,))]
        copies.extend(weakref.ref(t) for w in held for t in (w.w_q, w.w_k))
        pointers.update(t.data_ptr() for w in held for t in (w.w_q, w.w_k))
        jobs.append(job.__name__)
        return original_submit(job, weights, *args)

    monkeypatch.setattr(spectrum_module, "spectrum_of_layers", spectrum_on_record)
    monkeypatch.setattr(WEIGHTS_WORKER, "submit", submit)
    model = decoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine = QKSpectrum(background_weights=True, update_spectrum=True)
    parameters = {p.data_ptr() for p in model.parameters()}
    with Monitoring(model, [engine], every_n_steps=2, optimizer=optimizer) as monitoring:
        for step in range(3):
            with monitoring.step(step):
                model(TOKENS).logsumexp(-1).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            if step == 0:  # logged at the step's end: the copy is gone with the job
                assert engine.schedule.latest_step == 0 and not engine.probing
                assert copies and all(c() is None for c in copies)
    assert pointers and not pointers & parameters  # the worker read copies, not the parameters
    assert jobs == ["spectrum_on_record", "spectrum_on_record", "update_spectra"]  # step 2's
    assert all(c() is None for c in copies)  # the update spectrum's copies went with its job
    assert threads and all(name.startswith("qkmonitor-weights") for name in threads)


def test_a_read_in_flight_when_a_step_fails_is_waited_for_and_logged():
    # the weights after step 2 are read at step 2's start; step 2 fails before its end
    sinks = {}
    for background in (False, True):
        sink = MemorySink()
        model = decoder()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        engine = QKSpectrum(background_weights=background)
        monitoring = Monitoring(model, [engine], writer=sink, every_n_steps=2, optimizer=optimizer)
        with pytest.raises(RuntimeError, match="a failing step"), monitoring:
            for step in range(6):
                with monitoring.step(step):
                    if step == 2:
                        raise RuntimeError("a failing step")
                    model(TOKENS).logsumexp(-1).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
        sinks[background] = sink
    assert {s[2] for s in sinks[True].scalars} == {0, 2}  # step 2's read is not lost
    assert spectrum_scalars(sinks[True]) == spectrum_scalars(sinks[False])


def test_a_job_that_raises_leaves_its_read_nan_with_one_warning(monkeypatch):
    def broken(weights):
        raise RuntimeError("no eigenvalues today")

    monkeypatch.setattr(spectrum_module, "spectrum_of_layers", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink = plain_loop(True, steps=3)
    messages = [str(w.message) for w in caught if "no eigenvalues today" in str(w.message)]
    assert len(messages) == 1, messages
    kappa = [v for tag, v, step in sink.scalars if tag == "qkmonitor/kappa/layer_00"]
    assert kappa and all(math.isnan(v) for v in kappa)


class _Recorder(pl.Callback):
    """The spectrum engine's state at each checkpoint save (Lightning hands it over there)."""

    def __init__(self) -> None:
        self.states: list[dict] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.states.append(checkpoint["callbacks"])


def lightning_fit(tmp_path, background: bool) -> tuple[list, list]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from qkmonitor.callbacks import QKSpectrumMonitor

    pl.seed_everything(0, verbose=False)
    task = TinyTask()
    monitor = QKSpectrumMonitor(every_n_steps=2, per_head=True, background_weights=background)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / str(background), every_n_train_steps=1,
                                  save_top_k=-1)  # fmt: skip
    trainer = pl.Trainer(max_steps=5, logger=False, callbacks=[monitor, checkpoints],
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)  # fmt: skip
    latest = []
    original = monitor.engine.record

    def record(host, values, step, **kwargs):
        latest.append((step, {k: [t.clone() for t in v] for k, v in values.items()}))
        return original(host, values, step, **kwargs)

    monitor.engine.record = record
    states = []
    original_state = monitor.engine.state_dict

    def state_dict():
        state = original_state()
        states.append((trainer.global_step, copy.deepcopy(state)))
        return state

    monitor.engine.state_dict = state_dict
    trainer.fit(task)
    return latest, states


def test_a_lightning_fit_logs_the_same_values_and_each_checkpoint_holds_the_read(tmp_path):
    synchronous, sync_states = lightning_fit(tmp_path, False)
    background, states = lightning_fit(tmp_path, True)
    assert [step for step, _ in background] == [step for step, _ in synchronous] == [0, 2, 4]
    for (_, got), (_, want) in zip(background, synchronous):
        for name in want:
            for g, w in zip(got[name], want[name]):
                assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=name)
    # a checkpoint saved while a read is in flight waits for it: its state (the alert tracker's
    # history included) is the synchronous path's
    assert len(states) == 5 and repr(states) == repr(sync_states)


def test_the_worker_is_chosen_by_device_unless_the_user_says():
    cpu = torch.zeros(2)
    gpu = SimpleNamespace(device=torch.device("cuda", 0))
    sharded = SimpleNamespace(device=torch.device("cuda", 0), full_tensor=lambda: None)
    assert not use_worker(None, [cpu]) and use_worker(None, [cpu, gpu])
    assert use_worker(True, [cpu]) and not use_worker(False, [gpu])
    assert not use_worker(True, [sharded])  # a collective stays on the training thread
    with pytest.raises(ValueError, match="Expected `background_weights` to be a bool"):
        QKSpectrum(background_weights="yes")


def test_an_alert_of_a_read_in_flight_names_its_probe_step_and_comes_at_the_step_end():
    from qkmonitor import OverLocalizationWarning
    from qkmonitor.alerts import AlertRule

    rule = AlertRule(name="any_kappa", metric="kappa", threshold=0.0, above=True, patience=1,
                     margin=0.0, warning=OverLocalizationWarning, meaning="test",
                     advice="test")  # fmt: skip
    engine = QKSpectrum(background_weights=True, alerts=[rule], alert_action="raise")
    raised_at, message = first_raised([engine], OverLocalizationWarning)
    # the weights before step 0 are read at its start and settled at its end: the alert is raised
    # there, and says which probe it comes from
    assert raised_at == 0 and "at step 0" in message, message


def test_a_job_that_raises_frees_its_copy_once_settled_without_a_collection(monkeypatch):
    # the job's error holds the worker's frames, and so the copies, as long as it lives: settling
    # must not put it in a cycle that only the garbage collector breaks (on a GPU, device memory)
    copies = []
    original_submit = WEIGHTS_WORKER.submit

    def submit(job, weights):
        copies.extend(weakref.ref(t) for w in weights for t in (w.w_q, w.w_k))
        return original_submit(job, weights)

    def broken(weights):
        raise RuntimeError("no eigenvalues today")

    monkeypatch.setattr(spectrum_module, "spectrum_of_layers", broken)
    monkeypatch.setattr(WEIGHTS_WORKER, "submit", submit)
    model = decoder()
    engine = QKSpectrum(background_weights=True)
    gc.disable()
    try:
        with warnings.catch_warnings(), Monitoring(model, [engine], every_n_steps=1) as monitoring:
            warnings.simplefilter("ignore")
            with monitoring.step(0):  # the weights read at its start, settled at its end
                model(TOKENS).logsumexp(-1).mean().backward()
            assert copies and not engine.probing
            assert all(c() is None for c in copies)
    finally:
        gc.enable()
