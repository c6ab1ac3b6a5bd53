"""Every argument is checked where it is given: a wrong one is refused at construction or at the
call, with a message that names the argument and what was expected, never later (at the first
probe, at the first alert, at fit) and never with Python's own message from deep inside."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.engine.entropy import MAX_SINK_TOKENS
from qkmonitor.models import DecoderLM, TransformerConfig
from qkmonitor.output.sinks import MemorySink


@pytest.fixture
def model():
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
    return DecoderLM(config)


def test_a_path_as_the_writer_is_refused_with_the_writer_to_make(model):
    with pytest.raises(
        ValueError,
        match=r"Expected `writer` to be .*SummaryWriter.*got str 'runs/x'.*"
        r"SummaryWriter\('runs/x'\)",
    ):
        Monitoring(model, [QKSpectrum()], writer="runs/x")


def test_an_optimizer_named_by_a_string_is_refused_at_construction(model):
    with pytest.raises(
        ValueError, match="Expected `optimizer` to be a torch.optim.Optimizer .*got str 'adam'"
    ):
        Monitoring(model, [QKSpectrum()], optimizer="adam")


def test_one_engine_instead_of_a_list_says_to_pass_a_list(model):
    with pytest.raises(
        ValueError,
        match=r"Expected `engines` to be a list of engines, got one QKSpectrum: "
        r"pass `\[QKSpectrum\(...\)\]`",
    ):
        Monitoring(model, QKSpectrum())
    with pytest.raises(
        ValueError, match="Expected `engines` to be a non-empty list of MonitorEngine, got int 3"
    ):
        Monitoring(model, 3)


@pytest.mark.parametrize(
    ("loss", "got"),
    [
        (torch.ones(2), "a torch.float32 tensor of shape (2,)"),
        (None, "NoneType None"),
        ("nan", "str 'nan'"),
        (torch.tensor(True), "a torch.bool tensor of shape ()"),
    ],
)
def test_observe_loss_refuses_what_is_not_one_loss_at_the_call(model, loss, got):
    """At every step, not only at the steps whose loss a rule keeps (the first wrong loss here
    is at a step no rule reads), and on the engine as on the Monitoring."""
    engine = AttentionEntropy(every_n_steps=50)
    with Monitoring(model, [engine]) as monitoring:
        with monitoring.step(0):
            model(torch.zeros(1, 8, dtype=torch.long))
        assert engine.schedule.latest_step == 0 and not engine.wants_loss(15)
        expected = (
            "Expected `loss` to be a number or a tensor of one element (the step's mean loss), "
            f"got {got}"
        )
        with pytest.raises(ValueError) as info:
            monitoring.observe_loss(loss, step=15)
        assert str(info.value) == expected
        with pytest.raises(ValueError) as info:
            engine.observe_loss(15, loss)
        assert str(info.value) == expected


def test_observe_loss_takes_numbers_and_one_element_tensors_nan_included(model):
    engine = AttentionEntropy(every_n_steps=1)
    with Monitoring(model, [engine]) as monitoring:
        for step, loss in enumerate(
            [2.5, 3, torch.tensor(1.5), torch.tensor([[0.5]]), float("nan")]
        ):
            monitoring.observe_loss(loss, step=step)
        history = engine.alerting.loss_history()
    assert [s for s, _ in history] == [0, 1, 2, 3, 4]
    assert [v for _, v in history][:4] == [2.5, 3.0, 1.5, 0.5] and math.isnan(history[4][1])


@pytest.mark.parametrize("make", [EffectiveRankMonitor, EffectiveRank])
@pytest.mark.parametrize("blocks", ["h", [1, 2], 3])
def test_blocks_that_are_not_modules_are_refused_at_construction(make, blocks):
    with pytest.raises(
        ValueError,
        match="Expected `blocks` to be a list of modules, a function of the model or None, got",
    ):
        make(blocks=blocks)


@pytest.mark.parametrize("make", [AttentionEntropyMonitor, AttentionEntropy])
def test_sink_tokens_past_a_sink_are_refused_at_construction(make):
    with pytest.raises(
        ValueError,
        match=rf"Expected `sink_tokens` to be an int in \[0, {MAX_SINK_TOKENS}\], got 10000",
    ):
        make(sink_tokens=10000)
    made = make(sink_tokens=MAX_SINK_TOKENS)
    assert getattr(made, "engine", made).sink_tokens == MAX_SINK_TOKENS


def test_hparams_and_their_metrics_are_checked(model):
    with pytest.raises(ValueError, match="Expected `hparams` to be a dict"):
        Monitoring(model, [QKSpectrum()], hparams=["lr", 1e-3])
    with pytest.raises(
        ValueError, match="Expected `hparams_metrics` to be a list of scalar tags, got 'loss'"
    ):
        Monitoring(model, [QKSpectrum()], hparams_metrics="loss")


def test_what_is_accepted_still_is(model, tmp_path):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Monitoring(
            model, [QKSpectrum()], writer=SummaryWriter(tmp_path), optimizer=optimizer
        ).close()
        Monitoring(model, (QKSpectrum(),), writer=MemorySink(), hparams={"lr": 0.1}).close()


def test_the_hf_callback_refuses_one_engine_a_class_and_a_path_at_construction():
    """`HFQKMonitorCallback` answers as `Monitoring` does, when it is made (not when training
    starts, where a path as the writer used to be refused)."""
    pytest.importorskip("transformers")
    from qkmonitor.callbacks.hf_trainer import HFQKMonitorCallback

    with pytest.raises(
        ValueError, match=r"Expected `engines` to be a list of engines, got one QKSpectrum: pass"
    ):
        HFQKMonitorCallback(engines=QKSpectrum())
    with pytest.raises(TypeError, match=r"got the class `QKSpectrum`: pass `\[QKSpectrum\(\)\]`"):
        HFQKMonitorCallback(engines=QKSpectrum)
    with pytest.raises(TypeError, match=r"Expected engine instances in `engines`, got the class"):
        HFQKMonitorCallback(engines=[QKSpectrum])
    with pytest.raises(ValueError, match=r"Expected `engines` to be .* got int 5"):
        HFQKMonitorCallback(engines=5)
    with pytest.raises(
        ValueError,
        match=r"Expected `writer` to be .*SummaryWriter.*got str 'runs/x'.*"
        r"SummaryWriter\('runs/x'\)",
    ):
        HFQKMonitorCallback(writer="runs/x")
    assert HFQKMonitorCallback(engines=[QKSpectrum()], writer=MemorySink()).engines
