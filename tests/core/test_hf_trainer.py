"""HFQKMonitorCallback in a real ``transformers.Trainer``: tags and numbers against independent
references, read back with TensorBoard's own reader; a failing step; a stop alert."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch.utils.data import Dataset
from torch.utils.tensorboard import SummaryWriter

from qkmonitor.alerts import ENTROPY_COLLAPSE_RULE
from qkmonitor.callbacks.hf_trainer import HFQKMonitorCallback
from qkmonitor.engine import AttentionEntropy, EffectiveRank, QKSpectrum
from qkmonitor.measures.spectra import qk_singular_values, spectral_concentration

VOCAB, SEQ = 32, 8


class Tokens(Dataset):
    def __init__(self, size: int = 64) -> None:
        self.data = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def tiny_llama(fail_at_call: int | None = None):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    if fail_at_call is not None:
        calls = {"n": 0}

        def fail(module, args):
            calls["n"] += 1
            if calls["n"] == fail_at_call:
                raise RuntimeError("the user's forward failed")

        model.user_hook = model.model.layers[1].register_forward_pre_hook(fail)
    return model


def trainer(tmp_path, model, callback, steps: int = 4, **arguments):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        **arguments,
    )
    return transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[callback]
    )


def test_a_trainer_run_logs_the_tags_and_numbers_of_the_engines(tmp_path, leftovers):
    model = tiny_llama()
    layer = model.model.layers[0].self_attn
    expected_kappa = spectral_concentration(
        qk_singular_values(
            layer.q_proj.weight.detach().double(), layer.k_proj.weight.detach().double(), 4, 2
        )
    ).mean()
    writer = SummaryWriter(str(tmp_path / "run"))
    with HFQKMonitorCallback(writer=writer) as monitor:
        trainer(tmp_path, model, monitor).train()
    writer.close()
    assert leftovers(model) == []
    acc = EventAccumulator(
        str(tmp_path / "run"), size_guidance={"scalars": 0, "images": 0, "tensors": 0}
    )
    acc.Reload()
    kappa = acc.Scalars("qkmonitor/kappa/layer_00")
    assert [e.step for e in kappa] == [0, 2, 4]  # every logging_steps, and at initialization
    assert kappa[0].value == pytest.approx(expected_kappa.item(), rel=1e-5)  # the initial weights
    entropy = acc.Scalars("qkmonitor/entropy_norm/layer_01")
    assert [e.step for e in entropy] == [0, 2] and all(0 < e.value <= 1 for e in entropy)
    assert [e.step for e in acc.Scalars("qkmonitor/hidden_erank/layer_01")] == [0, 2]
    # the optimizer's view through accelerate's wrapper: NaN at initialization only, and the
    # output logits of the model's own output
    update = acc.Scalars("qkmonitor/q_update_ratio/layer_00")
    assert [e.step for e in update] == [0, 2, 4] and math.isnan(update[0].value)
    assert all(0 < e.value < 1 for e in update[1:])
    assert [e.step for e in acc.Scalars("qkmonitor/run/output_lse_rms")] == [0, 2]
    assert "qkmonitor/heatmap/kappa" in acc.Tags()["images"]
    assert "custom_scalars__config__" in acc.Tags()["tensors"]
    hparams = acc.summary_metadata["_hparams_/session_start_info"].plugin_data.content
    assert b"learning_rate" in hparams and b"qkmonitor/alert_kappa/threshold" in hparams
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/experiment"]
    ).experiment
    metrics = [info.name.tag for info in experiment.metric_infos]
    assert metrics[:2] == ["train/loss", "eval/loss"]  # the tags the Trainer's own logger writes


def test_a_step_that_raises_leaves_nothing_once_closed_and_a_clean_run_follows(tmp_path, leftovers):
    model = tiny_llama(
        fail_at_call=3
    )  # the second step's forward, a probe step with every_n_steps=1
    engines = [QKSpectrum(), AttentionEntropy(), EffectiveRank(max_probe_tokens=4)]
    with (
        pytest.raises(RuntimeError, match="the user's forward failed"),
        HFQKMonitorCallback(
            engines, writer=SummaryWriter(str(tmp_path / "a")), every_n_steps=1
        ) as monitor,
    ):
        trainer(tmp_path, model, monitor).train()
    model.user_hook.remove()  # the test's own hook; anything else left would be the monitor's
    assert leftovers(model) == []

    with HFQKMonitorCallback(
        engines, writer=SummaryWriter(str(tmp_path / "b")), every_n_steps=1
    ) as monitor:
        trainer(tmp_path, model, monitor, steps=2).train()
    assert leftovers(model) == []
    assert engines[1].schedule.latest_step == 1 and all(
        torch.isfinite(h).all() for h in engines[1].latest["entropy_norm"]
    )


def test_a_stop_alert_stops_the_trainer(tmp_path):
    rule = ENTROPY_COLLAPSE_RULE.replace(threshold=1.0, also=())  # fires at the first probe
    monitor = HFQKMonitorCallback(
        [AttentionEntropy(alerts=[rule], alert_action="stop")],
        writer=SummaryWriter(str(tmp_path / "run")),
        every_n_steps=1,
    )
    with pytest.warns(Warning, match="entropy"):
        result = trainer(tmp_path, tiny_llama(), monitor, steps=10).train()
    assert result.global_step == 1


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="`engines`"):
        HFQKMonitorCallback([])
    with pytest.raises(ValueError, match="`every_n_steps`"):
        HFQKMonitorCallback(every_n_steps=0)


def test_under_accumulation_the_first_micro_batch_of_a_step_is_measured_as_in_lightning(tmp_path):
    """Two micro-batches a step: the window closes after the first, so each probed layer saw one
    forward (the Lightning callbacks' semantics), not the two of the step."""
    model = tiny_llama()
    engine = AttentionEntropy()
    forwards = []
    close_probes = engine.close_probes

    def counting():
        results = close_probes()
        forwards.append([r.calls for r in results])
        return results

    engine.close_probes = counting
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        logging_steps=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    with HFQKMonitorCallback(engines=[engine]) as monitor:
        transformers.Trainer(
            model=model, args=args, train_dataset=Tokens(), callbacks=[monitor]
        ).train()
    probed = [calls for calls in forwards if any(calls)]
    assert probed == [[1, 1], [1, 1]]  # steps 0 and 2, one micro-batch each
    assert engine.schedule.latest_step == 2


class SelfAttention(torch.nn.Module):
    """Attention the generic family intercepts: projections by name, an SDPA call."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, x):
        q, k, v = (
            proj(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + out.transpose(1, 2).flatten(2)


class InterceptedLM(torch.nn.Module):
    """A user's own model in a Trainer: two intercepted attention layers and a loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.layers = torch.nn.ModuleList(SelfAttention() for _ in range(2))
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize(
    ("family", "precision"),
    [("dispatch", {}), ("interception", {}), ("interception", {"bf16": True})],
    ids=["dispatch", "interception", "interception-bf16"],
)
def test_a_keyboard_interrupt_in_a_probed_forward_leaves_nothing_without_a_context_manager(
    tmp_path, leftovers, family, precision
):
    """``transformers.Trainer`` runs no callback when a step raises, and torch's always-call hooks
    do not run on a ``BaseException``: the interrupt itself must close the window on its way up,
    so nothing stays installed or entered after ``train()`` even with no ``with`` around it."""
    model = tiny_llama() if family == "dispatch" else InterceptedLM()
    layers = model.model.layers if family == "dispatch" else model.layers
    calls = {"n": 0}

    def interrupt(module, args, output):
        calls["n"] += 1
        if calls["n"] == 2:  # the second step's forward: a probe step
            raise KeyboardInterrupt

    handle = layers[0].register_forward_hook(interrupt)
    monitor = HFQKMonitorCallback(writer=SummaryWriter(str(tmp_path / "a")), every_n_steps=1)
    with pytest.raises(KeyboardInterrupt):  # bf16: accelerate wraps the model's forward itself
        trainer(tmp_path, model, monitor, **precision).train()
    handle.remove()
    assert calls["n"] == 2
    assert leftovers(model) == []  # before any close(): the interrupt closed the window

    # the callback goes on: the next train() measures as usual
    trainer(tmp_path, model, monitor, steps=2, **precision).train()
    assert leftovers(model) == []
    entropy = monitor.engines[1]
    assert entropy.schedule.latest_step == 1
    assert all(torch.isfinite(h).all() for h in entropy.latest["entropy_norm"])


def interrupt_in_backward(model, at_call: int = 2):
    """A Ctrl+C while the backward of the model's ``at_call``-th forward runs (a probe step's with
    ``every_n_steps=1``): outside the forward, where the interrupt guard sees nothing. Returns the
    hook's handle."""
    calls = {"n": 0}

    def interrupt(grad):
        raise KeyboardInterrupt

    def arm(module, args, output):
        calls["n"] += 1
        if calls["n"] == at_call:
            output.register_hook(interrupt)

    return model.model.embed_tokens.register_forward_hook(arm)


def test_a_window_an_interrupted_train_left_open_is_closed_by_the_next_train_with_a_warning(
    tmp_path, leftovers
):
    """Issue 59, item 12: without a ``with``, a Ctrl+C in the backward leaves the probed step's
    window open (the Trainer calls no callback); the next ``train()`` closes it and says so once,
    and measures its own steps."""
    model = tiny_llama()
    handle = interrupt_in_backward(model)
    monitor = HFQKMonitorCallback(writer=SummaryWriter(str(tmp_path / "a")), every_n_steps=1)
    with pytest.raises(KeyboardInterrupt):
        trainer(tmp_path, model, monitor).train()
    handle.remove()
    assert leftovers(model) != []  # the window of step 1: nothing could close it yet

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, model, monitor, steps=2).train()
    told = [str(w.message) for w in caught if "left open" in str(w.message)]
    assert len(told) == 1 and "the next train() began" in told[0], told
    assert told[0].startswith("qkmonitor: the window of step 1 was left open")
    assert told[0].endswith("or call `monitor.close()` after an interrupted train().")
    assert leftovers(model) == []
    entropy = monitor.engines[1]
    assert entropy.schedule.latest_step == 1
    assert all(torch.isfinite(h).all() for h in entropy.latest["entropy_norm"])


#: an interrupted ``train()`` in a process that then ends without ``close()`` or another
#: ``train()``: a check registered with atexit before qkmonitor is imported runs after qkmonitor's
#: exit handler (last in, first out) and prints what is left on the model
HF_AT_EXIT = """
import atexit, sys
sys.path.insert(0, {root!r})

@atexit.register
def check():
    print("left at exit:", probe_leftovers(model))

import pathlib, warnings
warnings.simplefilter("ignore")
from tests.conftest import probe_leftovers
from tests.core import test_hf_trainer as hf

model = hf.tiny_llama()
handle = hf.interrupt_in_backward(model)
try:
    hf.trainer(pathlib.Path({tmp!r}), model, hf.HFQKMonitorCallback(every_n_steps=1)).train()
except KeyboardInterrupt:
    handle.remove()  # the test's own hook: anything left is the monitor's
    print("left after the interrupt:", len(probe_leftovers(model)) > 0)
"""


def test_a_window_an_interrupted_train_left_open_is_closed_at_the_interpreters_exit(tmp_path):
    from pathlib import Path

    from tests.engine.test_abandoned_windows import assert_nothing_left_at_exit

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "train.py"
    script.write_text(HF_AT_EXIT.format(root=str(root), tmp=str(tmp_path)))
    assert_nothing_left_at_exit(script)


def test_a_trainer_run_leaves_no_reference_cycle_of_qkmonitors(tmp_path):
    """Every step of a Trainer run probed (its model's attention intercepted): no step leaves
    qkmonitor's objects or tensors in cycles (``tests/core/test_no_cycles.py``)."""
    import gc
    from collections import Counter

    from tests.core.test_no_cycles import collector_off, ours

    class Census(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.left: list[Counter] = []

        def on_step_begin(self, args, state, control, **kwargs) -> None:
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)

        def on_step_end(self, args, state, control, **kwargs) -> None:
            gc.collect()
            found = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
            gc.garbage.clear()
            gc.set_debug(0)
            self.left.append(ours(found))

    census = Census()
    engines = [QKSpectrum(per_head=True), AttentionEntropy(per_head=True), EffectiveRank()]
    run = trainer(tmp_path, InterceptedLM(), HFQKMonitorCallback(engines, every_n_steps=1))
    run.add_callback(census)  # after qkmonitor's: its step ends first
    with collector_off():
        run.train()
    assert len(census.left) == 4 and not any(census.left), census.left
