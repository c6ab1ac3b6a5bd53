"""Failure paths: a step that raises, a keyboard interrupt, a forward that raises inside a probe.

Whatever a monitor installs on a model (observers on qkmonitor's attention, pre-hooks on
nn.MultiheadAttention, block hooks, a Hugging Face module's config view and route) must be gone
after every one of them, and a later clean ``fit`` must work as if nothing had happened.
"""

from __future__ import annotations

import signal

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from qkmonitor.attention.adapters import find_attention_layers
from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.models import DecoderLM, TransformerConfig

from .zoo import MODELS, SEQ, VOCAB, Task


def monitors():
    return [
        QKSpectrumMonitor(every_n_steps=2),
        AttentionEntropyMonitor(every_n_steps=2),
        EffectiveRankMonitor(every_n_steps=2, max_probe_tokens=4),
    ]


def trainer(tmp_path, callbacks, steps=4):
    return pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


@pytest.mark.parametrize("kind", MODELS)
def test_a_step_that_raises_mid_probe_leaves_nothing_and_a_clean_fit_follows(
    tmp_path, kind, leftovers
):
    torch.manual_seed(0)
    task = Task(MODELS[kind](), fail_at=2)
    configs = [m.__dict__.get("config") for m in task.modules()]
    with pytest.raises(RuntimeError, match="the user's step failed"):
        trainer(tmp_path, monitors()).fit(task)
    assert leftovers(task) == []
    assert [
        m.__dict__.get("config") for m in task.modules()
    ] == configs  # the model's own config objects

    task.fail_at = None
    clean = monitors()
    trainer(tmp_path, clean).fit(task)
    assert leftovers(task) == []
    entropy = clean[1].latest["entropy_norm"]
    assert clean[1].latest_step == 2 and all(torch.isfinite(heads).all() for heads in entropy)


def test_keyboard_interrupt_mid_probe_leaves_nothing(tmp_path, leftovers):
    task = Task(MODELS["bundled"](), fail_at=2, error=KeyboardInterrupt)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown after on_exception
            trainer(tmp_path, monitors()).fit(task)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores further Ctrl+C during shutdown
    assert leftovers(task) == []


@pytest.mark.parametrize("kind", MODELS)
def test_keyboard_interrupt_inside_a_probed_attention_forward_leaves_nothing(
    tmp_path, kind, leftovers
):
    """The interrupt comes from an attention module's forward at a probed step (a forward hook
    registered before the probe's raises it): torch runs no always-call hook for a BaseException,
    so the probe's own hook is skipped and whatever it entered stays entered until the callback's
    ``on_exception`` closes it."""
    torch.manual_seed(0)
    task = Task(MODELS[kind]())
    attention = next(m for m in task.modules() if "attention" in type(m).__name__.lower())
    calls = {"n": 0}

    def interrupt(module, args, output):
        calls["n"] += 1
        if task.global_step == 2:
            raise KeyboardInterrupt

    handle = attention.register_forward_hook(interrupt)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown after on_exception
            trainer(tmp_path, monitors()).fit(task)
    finally:
        signal.signal(signal.SIGINT, handler)
        handle.remove()
    assert calls["n"] > 0 and task.global_step == 2
    assert leftovers(task) == []


def test_teardown_closes_a_window_left_open(tmp_path, leftovers):
    """A probe window opened by hand (or by a hook whose batch never ended) closes at teardown."""
    task = Task(MODELS["torch-mha"]())
    monitor = AttentionEntropyMonitor(every_n_steps=1)
    fit = trainer(tmp_path, [monitor], steps=1)
    fit.fit(task)
    assert monitor.engine.open(10)
    assert leftovers(task) != []
    monitor.teardown(fit, task, "fit")
    assert leftovers(task) == [] and not monitor.engine.probing


def test_a_forward_that_raises_inside_a_probe_leaves_nothing_once_closed(leftovers):
    model = MODELS["torch-mha"]()
    probes = [layer.open_probe() for layer in find_attention_layers(model)]
    with pytest.raises(IndexError):
        model(torch.full((2, SEQ), VOCAB))  # out of the embedding's range: fails before attention
    with pytest.raises(AssertionError):  # torch's own check, after the probe's pre-hook
        model.encoder(torch.randn(2, SEQ, 7))  # wrong width: fails inside the probed module's call
    results = [probe.close() for probe in probes]
    assert leftovers(model) == []
    assert [r.calls for r in results] == [1, 0]  # the first layer saw the call; measuring it failed
    assert len(results[0].failures) == 1 and not results[0].stats


class BuiltLate(Task):
    """A model created on the meta device and materialized in `configure_model` (how large models
    are built for FSDP): at `setup` it has no weights, and none of its attention exists yet."""

    def __init__(self):
        super().__init__(nn.Identity())

    def configure_model(self):
        if isinstance(self.model, nn.Identity):
            with torch.device(
                "meta"
            ):  # learned positions: RoPE's tables are buffers meta would leave empty
                model = DecoderLM(
                    TransformerConfig(
                        vocab_size=VOCAB,
                        d_model=16,
                        n_layers=2,
                        n_heads=2,
                        max_seq_len=SEQ,
                        positional="learned",
                    )
                )
            model.to_empty(device="cpu")
            for module in model.modules():  # meta tensors have no values: initialise them
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            self.model = model


def test_a_model_built_in_configure_model_is_found_and_measured_where_it_lives(tmp_path):
    monitors_ = monitors()
    trainer(tmp_path, monitors_, steps=3).fit(BuiltLate())
    spectrum, entropy, rank = monitors_
    assert len(spectrum.engine.layers) == 2 and spectrum.latest_step == 2
    assert all(torch.isfinite(heads).all() for heads in entropy.latest["entropy_norm"])
    assert all(torch.isfinite(heads).all() for heads in rank.latest["hidden_collapse"])
    assert str(entropy.engine._aggregator.device) == "cpu"  # where the statistics were


def images_by_tag(log_dir) -> dict[str, list[int]]:
    """Every image tag of a TensorBoard run, with the steps it was written at (TensorBoard's own
    reader)."""
    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    acc.Reload()
    return {tag: [event.step for event in acc.Images(tag)] for tag in acc.Tags()["images"]}


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("fail_at", [5, 6])  # between two probes, and inside the probe at 6
def test_an_interrupted_run_draws_its_last_completed_probe_as_a_finished_run_does(
    tmp_path, error, fail_at, leftovers
):
    """Probes at 0, 2, 4 (6 fails or is never reached); visuals every 20th probe, so only step 0
    is drawn on the way. A run that fails at step 5 or 6 ends with the pictures of the last probe
    it completed, as a run that ends normally does: step 4 for the forward's monitors; for the
    spectrum, which reads the weights at a step's start, step 6 when the step that fails is 6."""

    def run(version, steps, fail):
        torch.manual_seed(0)
        task = Task(MODELS["bundled"](), fail_at=fail, error=error)
        fit = pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=steps,
            callbacks=monitors(),
            logger=TensorBoardLogger(tmp_path, name="run", version=version),
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            log_every_n_steps=1,
        )
        handler = signal.getsignal(signal.SIGINT)
        try:
            fit.fit(task)
        except (RuntimeError, SystemExit):  # Lightning's graceful shutdown after Ctrl+C
            assert fail is not None
        finally:
            signal.signal(signal.SIGINT, handler)  # Lightning ignores Ctrl+C during shutdown
        assert leftovers(task) == []
        return images_by_tag(tmp_path / "run" / version)

    finished, interrupted = run("finished", 5, None), run("interrupted", 10, fail_at)
    assert finished["qkmonitor/heatmap/kappa"] == [0, 4]
    assert any(tag.startswith("qkmonitor/attention/") for tag in finished)
    assert interrupted.keys() == finished.keys()
    weights = {f"qkmonitor/heatmap/{name}" for name in QKSpectrumMonitor().engine.metric_names}
    for tag, steps in interrupted.items():
        assert steps == ([0, fail_at] if tag in weights and fail_at == 6 else finished[tag]), tag
