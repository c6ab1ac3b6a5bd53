"""Several monitors in one Trainer, two Trainers in one process, a module called twice a step."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.measures.entropies import attention_entropy
from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import CopyReverseDataModule, Seq2SeqTask


def seq2seq_task():
    data = CopyReverseDataModule(
        reverse=False, min_len=2, max_len=4, batch_size=8, train_size=64, val_size=8, seed=0
    )
    config = TransformerConfig(
        vocab_size=data.vocab_size, d_model=16, n_layers=1, n_heads=2, max_seq_len=data.seq_len
    )
    return Seq2SeqTask(config, warmup_steps=0), data


def encoder_layers(model):
    return [m for n, m in model.named_modules() if n.endswith(".attn") and ".encoder." in n]


def decoder_self_layers(model):
    return [m for n, m in model.named_modules() if n.endswith(".attn") and ".decoder." in n]


def three_prefixes():
    return [
        QKSpectrumMonitor(every_n_steps=2, log_key_prefix="enc", layers=encoder_layers),
        QKSpectrumMonitor(every_n_steps=2, log_key_prefix="dec", layers=decoder_self_layers),
        AttentionEntropyMonitor(every_n_steps=2, log_key_prefix="dec", layers=decoder_self_layers),
        EffectiveRankMonitor(every_n_steps=2, max_probe_tokens=4),
    ]


def test_three_prefixes_in_one_trainer_chart_every_tag_and_resume_each_state(tmp_path):
    task, data = seq2seq_task()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    first = three_prefixes()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=4,
        callbacks=[*first, ckpt],
        logger=TensorBoardLogger(tmp_path, "run", 0),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(task, datamodule=data)
    keys = [m.state_key for m in first]
    assert len(set(keys)) == 4 and "prefix': 'enc'" in keys[0] and "layers'" in keys[0]

    acc = EventAccumulator(
        str(tmp_path / "run" / "version_0"), size_guidance={"tensors": 0, "scalars": 0}
    )
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {
        "enc/kappa/layer_00",
        "dec/kappa/layer_00",
        "dec/entropy_norm/layer_00",
        "qkmonitor/hidden_collapse/layer_02",
    } <= scalars
    layout = layout_pb2.Layout.FromString(
        acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    )
    patterns = [
        tag
        for category in layout.category
        for chart in category.chart
        for tag in [
            *chart.multiline.tag,
            *(v for s in chart.margin.series for v in (s.value, s.lower, s.upper)),
        ]
    ]
    # the overlays' series are in the layers' runs (layers/layer_LL), read as TensorBoard does
    runs = EventMultiplexer().AddRunsFromDirectory(str(tmp_path / "run" / "version_0"))
    runs.Reload()
    everywhere = {tag for run in runs.Runs().values() for tag in run["scalars"]}
    assert {"enc/kappa", "dec/entropy_norm"} <= set(runs.Runs()["layers/layer_00"]["scalars"])
    unmatched = [
        p
        for p in patterns
        if not any(re.search(p, t) if p.startswith("^") else p == t for t in everywhere)
    ]
    # two charts wait for tags the run may not write: the loss chart (the task's own tag; this task
    # logs none) and a rule's alert counter (written from its first alert on; none fired here)
    waiting = [p for p in unmatched if "/alerts/" in p or re.fullmatch(p, "train_loss")]
    assert (
        patterns and unmatched == waiting and len(waiting) == 4
    )  # the loss and 3 prefixes' alerts
    assert layout.category[0].title.split(":")[0] == "training"  # the loss first
    assert {c.title.split(":")[0] for c in layout.category} == {
        "training",
        "enc",
        "dec",
        "qkmonitor",
    }

    # resume: each monitor gets its own state back (the tracker counts and the last step)
    for monitor in first:
        monitor.engine.alerting.tracker.counts[monitor.engine.alerting.tracker.rules[0].name] = 7
    trainer.save_checkpoint(tmp_path / "both.ckpt")
    saved = torch.load(tmp_path / "both.ckpt", weights_only=True)["callbacks"]
    assert all(
        saved[m.state_key] == m.engine.state_dict() for m in first
    )  # where Lightning keeps callback states
    second = three_prefixes()
    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=5,
        callbacks=second,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        enable_checkpointing=False,
    ).fit(task, datamodule=data, ckpt_path=tmp_path / "both.ckpt")
    assert [m.state_key for m in second] == keys
    assert all(
        m.engine.alerting.tracker.counts[m.engine.alerting.tracker.rules[0].name] >= 7
        for m in second
    )


def test_same_kind_same_prefix_is_refused_with_a_clear_message(tmp_path):
    task, data = seq2seq_task()
    monitors = [
        QKSpectrumMonitor(layers=encoder_layers),
        QKSpectrumMonitor(layers=decoder_self_layers),
    ]
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=1,
        callbacks=monitors,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.raises(
        ValueError, match=r"Two QKSpectrumMonitors log under the same `log_key_prefix` 'qkmonitor'"
    ):
        trainer.fit(task, datamodule=data)


def test_two_monitors_of_one_kind_under_one_prefix_get_qkmonitors_message_not_lightnings(tmp_path):
    """Same kind, prefix and layers: the same state key. Lightning's "more than one stateful
    callback" would come from `Trainer(...)` without naming the prefix; qkmonitor's says what to
    do."""
    task, data = seq2seq_task()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=1,
        callbacks=[AttentionEntropyMonitor(), AttentionEntropyMonitor()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.raises(
        ValueError,
        match=(
            r"Two AttentionEntropyMonitors log under the same `log_key_prefix` "
            r"'qkmonitor'.*Give each its own `log_key_prefix`"
        ),
    ):
        trainer.fit(task, datamodule=data)


def test_two_trainers_in_one_process_do_not_interfere(tmp_path):
    """Two models, each with its monitors, fitted in turn and then with steps interleaved."""
    runs = []
    for name in ("a", "b"):
        task, data = seq2seq_task()
        monitor = AttentionEntropyMonitor(every_n_steps=1)
        runs.append((task, data, monitor, name))
    for task, data, monitor, name in runs:
        pl.Trainer(
            default_root_dir=tmp_path / name,
            max_steps=2,
            callbacks=[monitor],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
        ).fit(task, datamodule=data)
    a, b = runs[0][2], runs[1][2]
    a.engine.open(100)
    assert all(
        not layer.module.probing for layer in b.engine.layers
    )  # an open window of one touches no other
    a.engine.abort()
    assert a.latest_step == b.latest_step == 1


class SharedAttention(nn.Module):
    """One attention module applied twice (weight sharing, as in ALBERT / Universal
    Transformers)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        y = x + self.attn(x, x, x, need_weights=False)[0]
        return y + self.attn(y, y, y, need_weights=False)[0]


def test_every_call_of_a_shared_module_is_measured():
    from qkmonitor.engine import AttentionEntropy, Monitoring
    from qkmonitor.output.sinks import MemorySink

    torch.manual_seed(0)
    model = SharedAttention()
    sink = MemorySink()
    monitoring = Monitoring(model, [AttentionEntropy(every_n_steps=1, per_head=True)], writer=sink)
    x = torch.randn(3, 5, 8)
    with monitoring.step(0):
        model(x)
    with torch.no_grad():  # the reference: MHA's own weights on both calls' inputs
        _, p1 = model.attn(x, x, x, need_weights=True, average_attn_weights=False)
        y = x + model.attn(x, x, x, need_weights=False)[0]
        _, p2 = model.attn(y, y, y, need_weights=True, average_attn_weights=False)
    rows = torch.cat([attention_entropy(p.double()) for p in (p1, p2)], dim=-1)  # (B, H, 2N)
    logged = {tag: value for tag, value, _ in sink.scalars}
    for head in range(2):
        expected = rows[:, head].mean().item()
        assert logged[f"qkmonitor/entropy/layer_00_head_{head:02d}"] == pytest.approx(
            expected, rel=1e-5
        )
